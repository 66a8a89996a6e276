#!/usr/bin/env python3
"""The endpoint picker's added latency beside the HTTP door's, in one run.

Two stub engines (`--example stub_engine`), one `selkie serve` with both
doors (`--port` and `--ext-proc-port`, policy kv, block size 16), one load
generator (`--example loadgen`, open loop) sending token-id prompts of
--prompt-tokens (default 4,000: one of 64 shared prefixes plus 16 ids of
its own) at --rate requests/s (default 1,000) for --duration seconds.
Each round measures, back to back:

* direct: the engines themselves (non-streaming /v1/completions);
* http: the same through selkie serve's HTTP door; its added latency is
  its p50 / p99 minus direct's;
* picker: an ext_proc stream per request in FULL_DUPLEX_STREAMED mode,
  request headers then the body in one message; the latency is from
  sending the headers to the picker's answer naming the endpoint (all of
  it is added latency: the request then goes to the engine as it would
  without a picker).

Prints each round and the median over rounds, and the load average.

usage: benches/router/picker.py [--rate 1000] [--duration 10] [--prompt-tokens 4000] [--repeat 3] [--no-build]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from compare import RELEASE, ROOT, wait_http  # noqa: E402
from compare import free_ports  # noqa: E402


def loadgen(args, *extra):
    cmd = [os.path.join(RELEASE, "examples", "loadgen"), "--rate", str(args.rate), "--duration", str(args.duration),
           "--prompt-tokens", str(args.prompt_tokens), *extra]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=args.duration * 6 + 60, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rate", type=float, default=1000)
    ap.add_argument("--duration", type=float, default=10)
    ap.add_argument("--prompt-tokens", type=int, default=4000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--no-build", action="store_true")
    args = ap.parse_args()
    if not args.no_build:
        subprocess.run(["cargo", "build", "--release", "-q", "-p", "selkie", "--features", "serve", "--bin", "selkie",
                        "--example", "stub_engine", "--example", "loadgen"], cwd=ROOT, check=True)
    e1, e2, port, picker = free_ports(4)
    procs = []
    try:
        procs.append(subprocess.Popen([os.path.join(RELEASE, "examples", "stub_engine"), "--listen", f"127.0.0.1:{e1}",
                                       "--listen", f"127.0.0.1:{e2}"], stdout=subprocess.DEVNULL))
        engines = [f"http://127.0.0.1:{e1}", f"http://127.0.0.1:{e2}"]
        cmd = [os.path.join(RELEASE, "selkie"), "serve", "--port", str(port), "--ext-proc-port", str(picker),
               "--policy", "kv", "--block-size", "16", "--max-connections", "4096",
               "--max-concurrent-requests", "8192"]
        for e in engines:
            cmd += ["--worker", e]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        router = f"http://127.0.0.1:{port}"
        for url in engines + [router]:
            assert wait_http(url + "/v1/models"), f"{url} did not come up"
        time.sleep(0.5)
        rows = {"direct": [], "http": [], "picker": []}
        for r in range(args.repeat):
            runs = {
                "direct": loadgen(args, *sum((["--url", e] for e in engines), [])),
                "http": loadgen(args, "--url", router),
                "picker": loadgen(args, "--ext-proc", f"127.0.0.1:{picker}"),
            }
            for name, o in runs.items():
                rows[name].append(o)
                print(f"round {r + 1} {name:7} ok {o['ok']}/{o['sent']} errors {o['errors']} "
                      f"{o['achieved_rps']:.0f}/s p50 {o['p50_ms']:.3f} ms p99 {o['p99_ms']:.3f} ms", flush=True)
        med = {n: {k: statistics.median(o[k] for o in rows[n]) for k in ("p50_ms", "p99_ms")} for n in rows}
        errors = {n: sum(o["errors"] for o in rows[n]) for n in rows}
        print(f"\n{args.prompt_tokens}-token prompts at {args.rate:.0f} requests/s for {args.duration:.0f} s, "
              f"{args.repeat} rounds (medians); load average {os.getloadavg()[0]:.2f}")
        print("| path | p50 ms | p99 ms | added p50 ms | added p99 ms | errors |")
        print("|---|---|---|---|---|---|")
        d = med["direct"]
        for n in rows:
            m = med[n]
            added = ("", "") if n == "direct" else (
                (f"{m['p50_ms'] - d['p50_ms']:.3f}", f"{m['p99_ms'] - d['p99_ms']:.3f}") if n == "http"
                else (f"{m['p50_ms']:.3f}", f"{m['p99_ms']:.3f}"))
            print(f"| {n} | {m['p50_ms']:.3f} | {m['p99_ms']:.3f} | {added[0]} | {added[1]} | {errors[n]} |")
        failed = [n for n in rows if errors[n]]
        sys.exit(1 if failed else 0)
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait()


if __name__ == "__main__":
    main()
