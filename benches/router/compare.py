#!/usr/bin/env python3
"""selkie serve beside vllm-router and smg, in one run on one machine.

One pair of stub engines (the project's, `--example stub_engine`), one load
generator (`--example loadgen`: open loop, latency counted from when each
request was due). For each target: direct to the engines, selkie serve,
vllm-router and smg, each with round-robin and its cache-aware policies:

1. latency p50 / p99 at a fixed rate (default 500 requests/s for 10 s):
   every router runs at once, idle but for the one measured, and each of
   five rounds measures every target back to back (direct included), so
   a change in the machine's load falls on all alike; the medians over the
   rounds, added latency = a router's median minus the direct median; the
   router's CPU time per request over those runs;
2. the highest rate (a ladder of rates, 5 s each, every target still
   passing in turn) whose p99 stays under 50 ms with no errors and at least
   95% of the rate achieved (a failed step is tried once more);
3. resident memory (VmRSS) idle and with 10,000 streams open (HTTP/2 from
   the load generator, the engines holding every stream after its first
   event), one router at a time.

Requests: non-streaming /v1/completions with a text prompt (smg 1.13
refuses token ids): 64 shared prefixes of about 100 words plus a 16-word
suffix each, max_tokens 8. selkie's kv and prefix-hash run twice: with the
word-level tokenizer the tests use, and with no tokenizer (`--text-as-bytes`:
four bytes of text stand for a token, as the peers' cache-aware policies,
which read text, need no tokenizer); both hash every prompt.

usage: benches/router/compare.py [--peers-venv DIR] [--rate 500] [--duration 10]
                                 [--streams 10000] [--only NAME,...] [--json out.json]
vllm-router and smg come from --peers-venv/bin (default: $SELKIE_PEERS_VENV,
else the PATH); `python3 -m venv v && v/bin/pip install vllm-router==0.1.17 smg==1.13.0`.
"""

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
TARGET = os.environ.get("CARGO_TARGET_DIR", os.path.join(ROOT, "target"))
RELEASE = os.path.join(TARGET, "release")
P99_BOUND_MS = 50.0

sys.path.insert(0, os.path.join(ROOT, "host", "tests", "engines"))
from engines import free_ports  # noqa: E402


def wait_http(url, timeout=60):
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            urllib.request.urlopen(url, timeout=1).read()
            return True
        except Exception:
            time.sleep(0.2)
    return False


def rss_kib(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def cpu_ticks(pid):
    """User + system CPU time of a process, in clock ticks."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])
    except (OSError, IndexError, ValueError):
        return None


def stop(p):
    if p is None or p.poll() is not None:
        return
    p.send_signal(signal.SIGTERM)
    try:
        p.wait(timeout=10)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()


def loadgen(urls, rate=None, duration=None, streams=None, hold=None):
    cmd = [os.path.join(RELEASE, "examples", "loadgen")]
    for u in urls:
        cmd += ["--url", u]
    if streams:
        cmd += ["--streams", str(streams), "--hold", str(hold)]
    else:
        cmd += ["--rate", str(rate), "--duration", str(duration)]
    return cmd


def run_rate(urls, rate, duration):
    out = subprocess.run(loadgen(urls, rate, duration), capture_output=True, text=True, timeout=duration * 6 + 60)
    line = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else "{}"
    r = json.loads(line)
    r["load"] = os.getloadavg()[0]
    return r


def passes(r):
    return r.get("errors", 1) == 0 and r.get("p99_ms", 1e9) < P99_BOUND_MS and r.get("achieved_rps", 0) >= 0.95 * r["rate"]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--peers-venv", default=os.environ.get("SELKIE_PEERS_VENV"))
    ap.add_argument("--rate", type=int, default=500)
    ap.add_argument("--duration", type=int, default=10)
    ap.add_argument("--repeat", type=int, default=5, help="rounds of fixed-rate runs over every target (medians)")
    ap.add_argument("--step", type=int, default=5, help="seconds per rate of the max-rate search")
    ap.add_argument("--ladder", default="1000,1500,2000,2500,3000,3500,4000,5000,6000,7000,8000,9000,10000,12000,14000,16000")
    ap.add_argument("--streams", type=int, default=10000)
    ap.add_argument("--only", default="", help="comma-separated target names (default: all)")
    ap.add_argument("--json", default="")
    ap.add_argument("--no-build", action="store_true")
    a = ap.parse_args()
    ladder = [int(x) for x in a.ladder.split(",")]

    def peer(name):
        if a.peers_venv:
            p = os.path.join(a.peers_venv, "bin", name)
            return p if os.path.exists(p) else None
        return shutil.which(name)

    if not a.no_build:
        subprocess.run(["cargo", "build", "--release", "-q", "-p", "selkie", "--features", "serve", "--bin", "selkie",
                        "--example", "stub_engine", "--example", "loadgen"], cwd=ROOT, check=True)
    work = tempfile.mkdtemp(prefix="selkie-bench-")
    stub = os.path.join(RELEASE, "examples", "stub_engine")
    subprocess.run([stub, "--write-tokenizer", work], check=True, capture_output=True)
    e1, e2, h1, h2 = free_ports(4)
    engines = [f"http://127.0.0.1:{e1}", f"http://127.0.0.1:{e2}"]
    held = [f"http://127.0.0.1:{h1}", f"http://127.0.0.1:{h2}"]
    procs = []
    try:
        stubs = subprocess.Popen([stub, "--listen", f"127.0.0.1:{e1}", "--listen", f"127.0.0.1:{e2}"], stdout=subprocess.DEVNULL)
        hold_stubs = subprocess.Popen([stub, "--listen", f"127.0.0.1:{h1}", "--listen", f"127.0.0.1:{h2}", "--hold-after", "1"],
                                      stdout=subprocess.DEVNULL)
        procs += [stubs, hold_stubs]
        for u in engines + held:
            assert wait_http(u + "/v1/models"), f"stub engine {u} did not start"

        selkie = os.path.join(RELEASE, "selkie")
        tok = ["--tokenizer", os.path.join(work, "tokenizer.json")]
        big = ["--max-concurrent-requests", "12000", "--max-connections", "1024"]

        def selkie_cmd(policy, extra=()):
            return lambda port, ws: [selkie, "serve", "--port", str(port), *sum((["--worker", w] for w in ws), []),
                                     "--policy", policy, *extra, *big]

        vr, smg = peer("vllm-router"), peer("smg")

        def vr_cmd(policy):
            def cmd(port, ws):
                (mport,) = free_ports(1)
                return [vr, "--port", str(port), "--worker-urls", *ws, "--policy", policy, "--log-level", "error",
                        "--prometheus-port", str(mport), "--max-concurrent-requests", "20000", "--queue-size", "20000"]
            return cmd

        def smg_cmd(policy):
            def cmd(port, ws):
                (mport,) = free_ports(1)
                return [smg, "launch", "--port", str(port), "--worker-urls", *ws, "--policy", policy, "--log-level", "error",
                        "--prometheus-port", str(mport), "--max-concurrent-requests", "20000", "--queue-size", "20000"]
            return cmd

        targets = [("direct", None, "")]
        targets += [("selkie round-robin", selkie_cmd("round-robin"), "round-robin"),
                    ("selkie kv", selkie_cmd("kv", tok), "cache-aware"),
                    ("selkie prefix-hash", selkie_cmd("prefix-hash", tok), "cache-aware"),
                    ("selkie kv --text-as-bytes", selkie_cmd("kv", ["--text-as-bytes"]), "cache-aware"),
                    ("selkie prefix-hash --text-as-bytes", selkie_cmd("prefix-hash", ["--text-as-bytes"]), "cache-aware")]
        if vr:
            targets += [("vllm-router round_robin", vr_cmd("round_robin"), "round-robin"),
                        ("vllm-router cache_aware", vr_cmd("cache_aware"), "cache-aware"),
                        ("vllm-router consistent_hash", vr_cmd("consistent_hash"), "cache-aware")]
        if smg:
            targets += [("smg round_robin", smg_cmd("round_robin"), "round-robin"),
                        ("smg cache_aware", smg_cmd("cache_aware"), "cache-aware"),
                        ("smg prefix_hash", smg_cmd("prefix_hash"), "cache-aware")]
        if a.only:
            keep = {x.strip() for x in a.only.split(",")}
            targets = [t for t in targets if t[0] in keep or t[0] == "direct"]

        # Every router runs at once, idle but for the one measured: each
        # round measures every target back to back, so a change in the
        # machine's load falls on all of them alike.
        rows = {}
        running = {}
        for name, cmd, kind in targets:
            row = rows[name] = {"target": name, "kind": kind, "runs": [], "cpu_s": 0.0, "answered": 0}
            if cmd is None:
                running[name] = (None, engines)
                continue
            (port,) = free_ports(1)
            log = open(os.path.join(work, f"{name.replace(' ', '_')}.log"), "w")
            p = subprocess.Popen(cmd(port, engines), stdout=subprocess.DEVNULL, stderr=log)
            procs.append(p)
            url = f"http://127.0.0.1:{port}"
            if not wait_http(url + "/v1/models", 90):
                row["error"] = "did not start"
                stop(p)
                with open(log.name) as f:
                    print(f"{name} did not start:\n{f.read()[-2000:]}", file=sys.stderr, flush=True)
                continue
            running[name] = (p, [url])
        time.sleep(2)
        for name, (p, urls) in running.items():
            if p:
                rows[name]["rss_idle_kib"] = rss_kib(p.pid)
            run_rate(urls, 200, 2)  # warm-up
        for rnd in range(a.repeat):
            print(f"== latency round {rnd + 1}/{a.repeat} at {a.rate}/s", file=sys.stderr, flush=True)
            for name, (p, urls) in running.items():
                ticks = cpu_ticks(p.pid) if p else None
                r = run_rate(urls, a.rate, a.duration)
                rows[name]["runs"].append(r)
                if ticks is not None:
                    rows[name]["cpu_s"] += (cpu_ticks(p.pid) - ticks) / os.sysconf("SC_CLK_TCK")
                    rows[name]["answered"] += r["ok"]
                print(f"   {name}: p50 {r['p50_ms']:.3f} p99 {r['p99_ms']:.3f} ms (load {r['load']:.1f})",
                      file=sys.stderr, flush=True)
        med = lambda rs, k: sorted(x[k] for x in rs)[len(rs) // 2]
        for row in rows.values():
            if row["runs"]:
                row.update(p50_ms=med(row["runs"], "p50_ms"), p99_ms=med(row["runs"], "p99_ms"),
                           load=med(row["runs"], "load"))
                if row["answered"]:
                    row["cpu_us_per_request"] = row["cpu_s"] * 1e6 / row["answered"]
        # The highest rate: each step of the ladder for every target still
        # passing, in turn; a target that fails a step gets one more try at
        # it, and keeps the last step it passed.
        active = list(running)
        for rate in ladder:
            print(f"== {rate}/s: {', '.join(active)}", file=sys.stderr, flush=True)
            for name in list(active):
                urls = running[name][1]
                r = run_rate(urls, rate, a.step)
                if not passes(r):
                    r = run_rate(urls, rate, a.step)
                rows[name].setdefault("search", []).append(r)
                if passes(r):
                    rows[name]["max_rate"] = rate
                else:
                    active.remove(name)
            if not active:
                break
        for name, (p, _) in running.items():
            stop(p)
        # Memory with many open streams, one router at a time.
        for name, cmd, kind in targets:
            if cmd is None or not a.streams or "error" in rows[name]:
                continue
            (port,) = free_ports(1)
            p = subprocess.Popen(cmd(port, held), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            procs.append(p)
            url = f"http://127.0.0.1:{port}"
            if wait_http(url + "/v1/models", 90):
                time.sleep(1)
                g = subprocess.Popen(loadgen([url], streams=a.streams, hold=3), stdout=subprocess.PIPE, text=True)
                line = g.stdout.readline()
                opened = json.loads(line) if line.strip() else {}
                rows[name]["streams_opened"] = opened.get("opened")
                rows[name]["rss_streams_kib"] = rss_kib(p.pid)
                g.wait(timeout=300)
                print(f"== {name}: {opened.get('opened')} streams, RSS {rows[name]['rss_streams_kib']} KiB",
                      file=sys.stderr, flush=True)
            stop(p)
        results = list(rows.values())
        if a.json:
            with open(a.json, "w") as f:
                json.dump({"load": os.getloadavg(), "results": results}, f, indent=1)

        direct = rows["direct"]
        print(f"\nmachine: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f} at the end; "
              f"fixed rate {a.rate}/s for {a.duration} s, {a.repeat} rounds over every target\n")
        print("| target | p50 ms | p99 ms | added p50 ms | added p99 ms | router CPU µs/request | max rate (p99 < 50 ms) | RSS idle MiB | RSS with streams MiB | streams opened | load avg |")
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        for r in results:
            if "error" in r:
                print(f"| {r['target']} | {r['error']} |||||||||")
                continue
            add50 = r["p50_ms"] - direct["p50_ms"]
            add99 = r["p99_ms"] - direct["p99_ms"]
            mib = lambda k: f"{r[k] / 1024:.0f}" if r.get(k) else "-"
            cpu = f"{r['cpu_us_per_request']:.0f}" if r.get("cpu_us_per_request") else "-"
            print(f"| {r['target']} | {r['p50_ms']:.3f} | {r['p99_ms']:.3f} | {add50:.3f} | {add99:.3f} | {cpu} | "
                  f"{r.get('max_rate', 0)} | {mib('rss_idle_kib')} | {mib('rss_streams_kib')} | "
                  f"{r.get('streams_opened', '-')} | {r['load']:.1f} |")
        # The ratios the targets are stated in: each selkie row against the
        # best peer of its kind (round-robin against round-robin, a
        # cache-aware policy against the peers' cache-aware ones), or
        # against every peer where `--only` left none of its kind.
        routers = [r for r in results if r["target"] != "direct" and "error" not in r]
        ours = [r for r in routers if r["target"].startswith("selkie")]
        peers = [r for r in routers if not r["target"].startswith("selkie")]
        kind = lambda r: "round-robin" if "round-robin" in r["target"] or "round_robin" in r["target"] else "cache-aware"
        add99 = lambda r: max(r["p99_ms"] - direct["p99_ms"], 1e-3)
        for o in ours:
            rivals = [p for p in peers if kind(p) == kind(o)] or peers
            if not rivals:
                break
            best_p99 = min(rivals, key=add99)
            best_rate = max(rivals, key=lambda r: r.get("max_rate", 0))
            print(f"\n{o['target']}: added p99 {add99(o):.3f} ms = {add99(o) / add99(best_p99):.2f}x the best "
                  f"{kind(o)} peer's ({best_p99['target']}, {add99(best_p99):.3f} ms); max rate "
                  f"{o.get('max_rate', 0)}/s = {o.get('max_rate', 0) / max(best_rate.get('max_rate', 0), 1):.2f}x "
                  f"the best {kind(o)} peer's ({best_rate['target']}, {best_rate.get('max_rate', 0)}/s)")
    finally:
        for p in procs:
            stop(p)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
