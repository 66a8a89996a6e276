"""Routers in front of two real vLLM engines (CPU, dummy weights, 128 KV
blocks of 32 tokens each), one run on one machine: the share of prompt
tokens the engines served from their prefix caches (their own
`cached_tokens`, checked against their `/metrics`), TTFT p50 / p99 and
end-to-end p99 at the client.

Routers: selkie serve (kv on the engines' KV events, round-robin, kv with
a switching margin, prefix-hash with a load factor of 2; more with
--selkie-policy, and a `selkie tune` config with --selkie-config),
vllm-router (kv_aware fed the same engines' events, cache_aware,
round_robin) and smg (cache_aware, prefix_hash). selkie and vllm-router get token-id prompts, smg the same
prompts as text (its 1.13 release answers 400 to token-id prompts; the
engines' word-level tokenizer maps word `tN` to token id N, so both reach
the engine as the same ids).

Workloads (--workload):
* `shared`: 10 system prompts of 16 blocks each (more blocks than one
  engine holds), each request one of them (Zipf-weighted) and a user part
  of 32-256 tokens; 16 tokens out.
* `mooncake`: requests of a Mooncake trace (--trace) that share its 40
  most frequent first blocks, every k-th in trace order; each 512-token
  block id becomes one 32-token block of token ids (equal ids give equal
  blocks), at most 60 blocks; output lengths / 16, 1-16 tokens.
The bounds: one cache of unlimited size shared by both engines (a prompt's
leading whole blocks already sent, at most the prompt's length - 1), and
one LRU cache of both engines' 256 blocks, pooled.

Usage: real_engines.py --selkie target/release/selkie [--peers-venv V]
       [--vllm-venv V] [--workload shared|mooncake] [--runs 3]
       [--requests 240] [--clients 6] [--json OUT]
       [--selkie-config tune=FILE] [--write-trace FILE]
"""

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "host", "tests", "engines"))
import engines as E  # noqa: E402


# The selkie policies measured besides `kv` and `round-robin`: kv with a
# switching margin, and bounded-load prefix hashing.
MARGIN = "kv:{switch_margin_relative: 1.0, max_dwell: 1024}"
PREFIX_HASH = "prefix-hash:{load_factor: 2, prefix_blocks: 8}"


def shared_workload(n, seed=11):
    rng = random.Random(seed)
    systems = [[rng.randint(3, E.VOCAB - 1) for _ in range(16 * E.BLOCK)] for _ in range(10)]
    weights = [1 / (i + 1) for i in range(len(systems))]
    return [
        (rng.choices(systems, weights)[0] + [rng.randint(3, E.VOCAB - 1) for _ in range(rng.randint(32, 256))], 16)
        for _ in range(n)
    ]


def mooncake_workload(n, trace, groups=40, max_blocks=60):
    """`n` requests of a Mooncake trace: those whose first block id is one
    of the `groups` most frequent first ids (the trace's shared prefixes),
    every k-th of them in trace order; each 512-token block id becomes one
    32-token block of token ids (equal ids give equal blocks), at most
    `max_blocks`; output lengths / 16, 1-16 tokens."""
    import collections

    with open(trace) as f:
        rows = [json.loads(line) for line in f]
    firsts = collections.Counter(r["hash_ids"][0] for r in rows if r["hash_ids"])
    keep = {h for h, _ in firsts.most_common(groups)}
    chosen = [r for r in rows if r["hash_ids"] and r["hash_ids"][0] in keep]
    chosen = chosen[:: max(1, len(chosen) // n)][:n]
    out = []
    for r in chosen:
        tokens = []
        for h in r["hash_ids"][:max_blocks]:
            rng = random.Random(h)
            tokens += [rng.randint(3, E.VOCAB - 1) for _ in range(E.BLOCK)]
        out.append((tokens, max(1, min(16, r["output_length"] // 16))))
    return out


def unlimited_bound(requests):
    seen, cached, total = set(), 0, 0
    for tokens, _ in requests:
        blocks = [tuple(tokens[: (i + 1) * E.BLOCK]) for i in range(len(tokens) // E.BLOCK)]
        hit = 0
        for b in blocks[: (len(tokens) - 1) // E.BLOCK]:
            if hash(b) not in seen:
                break
            hit += 1
        seen.update(hash(b) for b in blocks)
        cached += hit * E.BLOCK
        total += len(tokens)
    return cached / total


def write_trace(requests, path, interval_ms):
    """The workload as a trace `selkie simulate --trace` replays (the
    Mooncake layout, one hash id per 32-token block, the last partial
    block's id its own, `block_size` 32 on every row), one request every
    `interval_ms`."""
    ids = {}
    with open(path, "w") as f:
        for i, (tokens, out) in enumerate(requests):
            hash_ids = []
            for b in range((len(tokens) + E.BLOCK - 1) // E.BLOCK):
                key = tuple(tokens[: (b + 1) * E.BLOCK])
                hash_ids.append(ids.setdefault(key, len(ids)))
            f.write(json.dumps({"timestamp": round(i * interval_ms), "input_length": len(tokens),
                                "output_length": out, "hash_ids": hash_ids, "block_size": E.BLOCK}) + "\n")  # fmt: skip


def pooled_lru_bound(requests, blocks):
    """One LRU cache of `blocks` blocks shared by both engines, requests in
    order: the share of prompt tokens it would serve (a prompt's leading
    whole blocks it holds, at most the prompt's length - 1)."""
    from collections import OrderedDict

    cache, cached, total = OrderedDict(), 0, 0
    for tokens, _ in requests:
        keys = [hash(tuple(tokens[: (i + 1) * E.BLOCK])) for i in range(len(tokens) // E.BLOCK)]
        hit = 0
        for k in keys[: (len(tokens) - 1) // E.BLOCK]:
            if k not in cache:
                break
            hit += 1
        for k in keys:
            cache[k] = True
            cache.move_to_end(k)
            while len(cache) > blocks:
                cache.popitem(last=False)
        cached += hit * E.BLOCK
        total += len(tokens)
    return cached / total


def stream(url, prompt, max_tokens):
    body = {"model": E.MODEL, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
    t0 = time.perf_counter()
    ttft, usage = None, None
    with urllib.request.urlopen(req, timeout=300) as r:
        for line in r:
            line = line.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            event = json.loads(line[6:])
            if ttft is None and event.get("choices"):
                ttft = time.perf_counter() - t0
            if event.get("usage"):
                usage = event["usage"]
    return ttft, time.perf_counter() - t0, usage


def drive(url, requests, clients, text):
    results = [None] * len(requests)
    next_i = [0]
    lock = threading.Lock()
    errors = []

    def client():
        while True:
            with lock:
                i = next_i[0]
                next_i[0] += 1
            if i >= len(requests):
                return
            tokens, out = requests[i]
            try:
                results[i] = stream(url, E.text_of(tokens) if text else tokens, out)
            except Exception as e:  # noqa: BLE001 (counted, reported)
                errors.append(repr(e))

    threads = [threading.Thread(target=client) for _ in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [r for r in results if r], errors, time.perf_counter() - t0


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--selkie", required=True)
    ap.add_argument("--peers-venv", default=os.environ.get("SELKIE_PEERS_VENV"))
    ap.add_argument("--vllm-venv", default=os.environ.get("SELKIE_VLLM_VENV", os.path.expanduser("~/.cache/selkie/vllm-0.32")))
    ap.add_argument("--workload", choices=["shared", "mooncake"], default="shared")
    ap.add_argument("--trace", default=os.path.join(HERE, "..", "..", "..", "shared", "data", "mooncake_synthetic_trace.jsonl"))
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--requests", type=int, default=240)
    ap.add_argument("--clients", type=int, default=6)
    ap.add_argument("--only", default="", help="comma-separated router names to run (default: all)")
    ap.add_argument("--json")
    ap.add_argument("--selkie-policy", action="append", default=[], metavar="LABEL=POLICY",
                    help="also run selkie with this --policy on the engines' events (repeatable)")  # fmt: skip
    ap.add_argument("--selkie-config", action="append", default=[], metavar="LABEL=FILE",
                    help="also run selkie with this worker-selection config (--config, what `selkie tune` "
                         "writes) on the engines' events (repeatable)")  # fmt: skip
    ap.add_argument("--write-trace", metavar="FILE", help="write the workload as a trace for `selkie simulate` and exit")
    ap.add_argument("--trace-interval-ms", type=float, default=100.0)
    a = ap.parse_args()
    requests = shared_workload(a.requests) if a.workload == "shared" else mooncake_workload(a.requests, a.trace)
    bound = unlimited_bound(requests)
    pooled = pooled_lru_bound(requests, 2 * 128)
    if a.write_trace:
        write_trace(requests, a.write_trace, a.trace_interval_ms)
        print(f"{len(requests)} requests written to {a.write_trace}; unlimited-cache bound {bound:.3f}")
        return
    load0 = " ".join(f"{x:.2f}" for x in os.getloadavg())
    work = tempfile.mkdtemp(prefix="selkie-real-")
    model = E.write_model(os.path.join(work, "model"))
    engines = E.start_engines(a.vllm_venv, model, work, 128, bind_events=True)
    urls = [e.url for e in engines]
    events = [f"{e.url}={e.events_connect},mode=connect,topic=kv,replay={e.replay_endpoint}" for e in engines]

    def selkie(policy, with_events, config=None):
        def cmd(port):
            c = [a.selkie, "serve", "--port", str(port), "--block-size", str(E.BLOCK)]
            c += ["--config", config] if config else ["--policy", policy]
            for u in urls:
                c += ["--worker", u]
            if with_events:
                for s in events:
                    c += ["--kv-events", s]
            return c
        return cmd

    peer = lambda name: shutil.which(name, path=os.path.join(a.peers_venv, "bin") if a.peers_venv else None)  # noqa: E731
    vr, smg = peer("vllm-router"), peer("smg")

    def vr_cmd(policy, extra=()):
        return lambda port: [vr, "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *urls, "--policy", policy,
                             "--prometheus-port", str(E.free_ports(1)[0]), "--log-level", "warning", *extra]  # fmt: skip

    def smg_cmd(policy):
        return lambda port: [smg, "launch", "--host", "127.0.0.1", "--prometheus-host", "127.0.0.1", "--port", str(port),
                             "--worker-urls", *urls, "--policy", policy,
                             "--prometheus-port", str(E.free_ports(1)[0]), "--log-level", "warn"]  # fmt: skip

    vr_events = []
    for e in engines:
        vr_events += ["--kv-event-source", f"{e.url}={e.events_connect}",
                      "--kv-event-replay-source", f"{e.url}={e.replay_endpoint}"]  # fmt: skip
    vr_events += ["--kv-event-block-size", str(E.BLOCK), "--kv-event-model", E.MODEL]
    # (name, command, text prompts, told)
    targets = [
        ("selkie kv", selkie("kv", True), False, "--policy kv --block-size 32 --kv-events URL=ENDPOINT per engine"),
        ("selkie round-robin", selkie("round-robin", False), False, "--policy round-robin"),
        ("selkie kv margin 1.0", selkie(MARGIN, True), False, f"--policy '{MARGIN}' --block-size 32 --kv-events per engine"),
        ("selkie prefix-hash lf 2", selkie(PREFIX_HASH, True), False, f"--policy '{PREFIX_HASH}' --block-size 32 --kv-events per engine"),
    ]  # fmt: skip
    for spec in a.selkie_policy:
        label, policy = spec.split("=", 1)
        targets.append((f"selkie {label}", selkie(policy, True), False, f"--policy '{policy}' --kv-events per engine"))
    for spec in a.selkie_config:
        label, path = spec.split("=", 1)
        targets.append((f"selkie {label}", selkie(None, True, os.path.abspath(path)), False,
                        f"--config {os.path.basename(path)} --block-size 32 --kv-events per engine"))  # fmt: skip
    if vr:
        targets += [
            ("vllm-router kv_aware", vr_cmd("kv_aware", vr_events), False,
             "--policy kv_aware --kv-event-source URL=ENDPOINT per engine --kv-event-block-size 32 --kv-event-model tiny"),
            ("vllm-router cache_aware", vr_cmd("cache_aware"), False, "--policy cache_aware (token-id prompts)"),
            ("vllm-router round_robin", vr_cmd("round_robin"), False, "--policy round_robin"),
        ]  # fmt: skip
    if smg:
        targets += [
            ("smg cache_aware", smg_cmd("cache_aware"), True, "--policy cache_aware (text prompts)"),
            ("smg prefix_hash", smg_cmd("prefix_hash"), True, "--policy prefix_hash (text prompts)"),
        ]  # fmt: skip
    if a.only:
        keep = set(a.only.split(","))
        targets = [t for t in targets if t[0] in keep]
    rows = {name: [] for name, *_ in targets}
    print(f"workload {a.workload}: {len(requests)} requests, {a.clients} clients; "
          f"unlimited-cache bound {bound:.3f}, pooled 256-block LRU {pooled:.3f}", flush=True)  # fmt: skip
    try:
        for run in range(a.runs):
            for name, cmd, text, _ in targets:
                port = E.free_ports(1)[0]
                router = E.Process(cmd(port), port, os.path.join(work, f"{name.replace(' ', '_')}.log"))
                try:
                    router.wait_ready(timeout=60)
                    time.sleep(1.0)  # subscriptions up (ZMQ connects in the background)
                    for e in engines:
                        e.reset_prefix_cache()
                    before = sum(e.prefix_cache_counters()[1] for e in engines)
                    results, errors, wall = drive(router.url, requests, a.clients, text)
                    hits = sum(e.prefix_cache_counters()[1] for e in engines) - before
                finally:
                    router.stop()
                prompt = sum(u["prompt_tokens"] for _, _, u in results if u)
                cached = sum(E.cached_tokens(u) for _, _, u in results if u)
                row = {
                    "share": cached / max(prompt, 1),
                    "metrics_share": hits / max(prompt, 1),
                    "ttft_p50_ms": 1e3 * pct([r[0] for r in results if r[0]], 0.5),
                    "ttft_p99_ms": 1e3 * pct([r[0] for r in results if r[0]], 0.99),
                    "e2e_p99_ms": 1e3 * pct([r[1] for r in results], 0.99),
                    "ok": len(results),
                    "errors": len(errors),
                    "wall_s": wall,
                }
                rows[name].append(row)
                print(f"run {run + 1} {name:26} share {row['share']:.3f} (/metrics {row['metrics_share']:.3f}) "
                      f"TTFT p50 {row['ttft_p50_ms']:.0f} ms p99 {row['ttft_p99_ms']:.0f} ms e2e p99 {row['e2e_p99_ms']:.0f} ms "
                      f"ok {row['ok']} errors {row['errors']} {errors[:1]}", flush=True)  # fmt: skip
    finally:
        for e in engines:
            e.stop()
    load1 = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"\n{a.workload}: {len(requests)} streamed requests, {a.clients} clients, {a.runs} runs; "
          f"unlimited-cache bound {bound:.3f}, pooled 256-block LRU {pooled:.3f}")  # fmt: skip
    print(f"load average {load0} at the start, {load1} at the end")
    print("| router | told | cached share, mean (min-max) | of bound | TTFT p50 ms | TTFT p99 ms | e2e p99 ms | errors |")
    print("|---|---|---|---|---|---|---|---|")
    summary = {}
    for name, _, _, told in targets:
        rs = rows[name]
        if not rs:
            continue
        m = {k: statistics.mean(r[k] for r in rs) for k in ("share", "ttft_p50_ms", "ttft_p99_ms", "e2e_p99_ms")}
        m["share_min"], m["share_max"] = min(r["share"] for r in rs), max(r["share"] for r in rs)
        m["errors"] = sum(r["errors"] for r in rs)
        summary[name] = m
        print(f"| {name} | `{told}` | {m['share']:.3f} ({m['share_min']:.3f}-{m['share_max']:.3f}) | {m['share'] / bound:.2f} | {m['ttft_p50_ms']:.0f} | "
              f"{m['ttft_p99_ms']:.0f} | {m['e2e_p99_ms']:.0f} | {m['errors']} |")  # fmt: skip
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"workload": a.workload, "bound": bound, "pooled_bound": pooled, "load_average": [load0, load1],
                       "runs": rows, "summary": summary}, f, indent=1)
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
