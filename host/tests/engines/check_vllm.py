"""`selkie serve` in front of two real vLLM engines (CPU, dummy weights),
hearing their KV cache events. Exits non-zero when a check fails.

Checks:
* every event type arrives decoded from the live engines (`BlockStored`,
  `BlockRemoved`, `AllBlocksCleared` after `/reset_prefix_cache`);
* for every request, the router's predicted cached tokens on the engine it
  chose (`x-selkie-predicted-cached-tokens`) equal the engine's own
  `cached_tokens`, within the engine's cap (it computes at least the
  prompt's last token), with both ways of hashing (`--kv-hash tokens` and
  `engine-sha256-cbor`);
* the same through the endpoint picker door (`--ext-proc-port`), driven
  as Envoy drives it by grpcio and envoy-data-plane: the test sends each
  request to the engine the picker named and the predictions stay exact;
* an engine killed and restarted mid-run: its blocks stop counting when it
  refuses a connection, its restart is seen, predictions stay exact;
* on prompts sharing prefixes, the kv policy's engine-reported cached share
  is above round-robin's;
* the engines' `cached_tokens` add up to their `/metrics` hit counters;
* the check itself can fail: a router told the wrong hash seed
  (`engine-sha256-cbor:1`) predicts no hits where the engines had them.

Usage: check_vllm.py --venv VENV --selkie BINARY --work DIR
"""

import argparse
import json
import os
import random
import sys
import time
import urllib.error

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import engines as E  # noqa: E402

PREFIXES = 8  # shared prefixes of PREFIX_BLOCKS blocks: 160 blocks, more than one engine holds
PREFIX_BLOCKS = 20
ENGINE_BLOCKS = 128


def workload(n, seed):
    rng = random.Random(seed)
    prefixes = [[rng.randint(3, E.VOCAB - 1) for _ in range(PREFIX_BLOCKS * E.BLOCK)] for _ in range(PREFIXES)]
    return [rng.choice(prefixes) + [rng.randint(3, E.VOCAB - 1) for _ in range(rng.randint(40, 200))] for _ in range(n)]


def total(m, name, **labels):
    want = [f'{k}="{v}"' for k, v in labels.items()]
    return sum(v for k, v in m.items() if k.split("{")[0] == name and all(w in k for w in want))


def settle(router, quiet=0.15, limit=3.0):
    """Waits until the router has taken no KV event message for `quiet` s."""
    deadline = time.time() + limit
    last = total(E.metrics(router.url), "selkie_kv_events_messages_total")
    while time.time() < deadline:
        time.sleep(quiet)
        now = total(E.metrics(router.url), "selkie_kv_events_messages_total")
        if now == last:
            return
        last = now


def clear_both(router, engines):
    """Resets both engines' prefix caches until the router has seen each
    one's `AllBlocksCleared`. vLLM sends it with its next step's events, so
    a short request follows each reset (its blocks are then known to the
    router too); the engines' PUB sockets connect to the router's a moment
    after it binds, so this is repeated until it arrives."""
    for e in engines:
        for _ in range(60):
            e.reset_prefix_cache()
            E.complete(e.url, list(range(3, 3 + 2 * E.BLOCK)), max_tokens=1)
            time.sleep(0.3)
            if total(E.metrics(router.url), "selkie_kv_events_received_total", worker=e.url, event="cleared") >= 1:
                break
        else:
            m = {k: v for k, v in E.metrics(router.url).items() if k.startswith("selkie_kv_events")}
            raise AssertionError(f"no AllBlocksCleared from {e.url} reached the router: {m}")


class Phase:
    def __init__(self, name):
        self.name, self.prompt, self.cached, self.exact, self.checked, self.misses = name, 0, 0, 0, 0, []

    def record(self, headers, body):
        usage = body["usage"]
        length, cached = usage["prompt_tokens"], E.cached_tokens(usage)
        self.prompt += length
        self.cached += cached
        predicted = headers.get("x-selkie-predicted-cached-tokens")
        if predicted is not None:
            self.checked += 1
            expected = min(int(predicted), (length - 1) // E.BLOCK * E.BLOCK)
            if expected == cached:
                self.exact += 1
            else:
                self.misses.append((headers.get("x-selkie-worker"), length, int(predicted), cached))

    @property
    def share(self):
        return self.cached / max(self.prompt, 1)

    def report(self):
        print(
            f"{self.name}: cached share {self.share:.3f} ({self.cached}/{self.prompt} prompt tokens); "
            f"predictions exact {self.exact}/{self.checked}",
            flush=True,
        )
        for m in self.misses[:10]:
            print(f"  miss: worker {m[0]} prompt {m[1]} predicted {m[2]} engine {m[3]}", flush=True)


def run_phase(name, router, engines, prompts, restart_at=None):
    phase = Phase(name)
    before = [e.prefix_cache_counters()[1] for e in engines]
    restarted = None
    for i, prompt in enumerate(prompts):
        if restart_at is not None and i == restart_at:
            victim = engines[1]
            # Its hits so far in this phase (its counters die with it).
            so_far = victim.prefix_cache_counters()[1] - before[1]
            victim.kill()
            # A request pinned to it is refused: its blocks stop counting.
            try:
                E.complete(router.url, prompt, headers={"x-selkie-worker": victim.url})
                raise AssertionError("a request pinned to a killed engine was answered")
            except urllib.error.HTTPError as err:
                assert err.code == 502, err.code
            for _ in range(50):  # the router drops its blocks a moment later
                if total(E.metrics(router.url), "selkie_kv_events_unreachable_total", worker=victim.url) >= 1:
                    break
                time.sleep(0.1)
            else:
                raise AssertionError("the killed engine's refusal was not counted")
            victim.start()
            victim.wait_healthy(time.time() + 600)
            restarted = victim
            before[1] = -so_far  # the new process counts from 0
        headers, body = E.complete(router.url, prompt)
        phase.record(headers, body)
        settle(router)
    hits = sum(e.prefix_cache_counters()[1] for e in engines) - sum(before)
    phase.report()
    assert hits == phase.cached, f"{name}: engines' /metrics hits {hits} != their cached_tokens sum {phase.cached}"
    if restarted is not None:
        m = E.metrics(router.url)
        assert total(m, "selkie_kv_events_restarts_total", worker=restarted.url) >= 1, "the restart was not seen"
    return phase


def run_picker_phase(name, router, picker, engines, prompts):
    """The same requests through the endpoint picker door: the test asks
    the picker (as Envoy would, with grpcio and envoy-data-plane), sends
    each request to the engine it named, and passes the response back
    through the picker, which adds its prediction to the response headers."""
    import grpc

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "e2e"))
    import epp_proxy as P

    stub = P.ExternalProcessorSyncStub(grpc.insecure_channel(picker))
    phase = Phase(name)
    before = [e.prefix_cache_counters()[1] for e in engines]
    for prompt in prompts:
        body = json.dumps({"model": E.MODEL, "prompt": prompt, "max_tokens": 4, "ignore_eos": True})
        s, dest, refused = P.ask(stub, body)
        assert refused is None, f"the picker refused: {refused}"
        added, got = P.relay(s, dest.split(",")[0], "/v1/completions", body, False)
        phase.record(added, json.loads(got))
        settle(router)
    assert not P.failures, P.failures
    hits = sum(e.prefix_cache_counters()[1] for e in engines) - sum(before)
    phase.report()
    assert hits == phase.cached, f"{name}: engines' /metrics hits {hits} != their cached_tokens sum {phase.cached}"
    return phase


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--venv", required=True)
    ap.add_argument("--selkie", required=True)
    ap.add_argument("--work", required=True)
    ap.add_argument("--requests", type=int, default=60)
    args = ap.parse_args()
    t0 = time.time()
    model = E.write_model(os.path.join(args.work, "model"))
    engines = E.start_engines(args.venv, model, args.work, ENGINE_BLOCKS)
    print(f"two engines healthy after {time.time() - t0:.0f} s", flush=True)
    failures = []
    events = {e.url: {"stored": 0.0, "removed": 0.0, "cleared": 0.0} for e in engines}
    prompts = workload(args.requests, seed=7)
    routers = []
    try:
        phases = {}
        for name, policy, kv_hash, restart in [
            ("kv, --kv-hash tokens", "kv", "tokens", None),
            ("kv through the endpoint picker (ext_proc)", "kv", "tokens", "picker"),
            ("round-robin", "round-robin", None, None),
            ("kv, --kv-hash engine-sha256-cbor, engine b killed and restarted", "kv", "engine-sha256-cbor", args.requests // 2),
            ("kv, the wrong hash seed (must miss)", "kv", "engine-sha256-cbor:1", None),
        ]:  # fmt: skip
            log = os.path.join(args.work, f"selkie-{len(routers)}.log")
            picker = restart == "picker" and E.free_ports(1)[0]
            extra = ["--ext-proc-port", str(picker)] if picker else []
            router = E.selkie(args.selkie, engines, log, policy=policy, kv_hash=kv_hash or "tokens", extra=extra)
            routers.append(router)
            router.wait_ready()
            clear_both(router, engines)
            wrong = kv_hash == "engine-sha256-cbor:1"
            if picker:
                phase = run_picker_phase(name, router, f"127.0.0.1:{picker}", engines, prompts)
            else:
                phase = run_phase(name, router, engines, prompts[: len(prompts) // 3] if wrong else prompts, restart)
            phases[name] = phase
            m = E.metrics(router.url)
            for e in engines:
                for kind in events[e.url]:
                    events[e.url][kind] += total(m, "selkie_kv_events_received_total", worker=e.url, event=kind)
            refused = total(m, "selkie_kv_events_refused_total")
            if refused:
                failures.append(f"{name}: {refused} KV event messages refused")
            if wrong:
                if not phase.misses:
                    failures.append(f"{name}: every prediction matched with the wrong seed")
            elif policy == "kv" and (phase.checked < len(prompts) // 2 or phase.misses):
                failures.append(f"{name}: {phase.exact}/{phase.checked} predictions exact")
            router.stop()
        for url, kinds in events.items():
            print(f"events from {url}: {kinds}")
            for kind, n in kinds.items():
                if n < 1:
                    failures.append(f"no {kind} event from {url}")
        kv, rr = phases["kv, --kv-hash tokens"], phases["round-robin"]
        if not kv.share > rr.share:
            failures.append(f"kv cached share {kv.share:.3f} not above round-robin's {rr.share:.3f}")
    finally:
        for r in routers:
            r.stop()
        for e in engines:
            e.stop()
    print(f"done in {time.time() - t0:.0f} s")
    if failures:
        print("FAILED:\n  " + "\n  ".join(failures))
        for r in routers:
            print(r.tail(20))
        sys.exit(1)
    print("all checks passed")


if __name__ == "__main__":
    main()
