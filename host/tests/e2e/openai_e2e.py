#!/usr/bin/env python3
"""End to end: the official `openai` Python client against `selkie serve`
in front of the project's stub engines.

Completions and chat, streaming and not, token-id, text and chat prompts:
every request must be answered; each response's bytes (read raw through
the client) must equal the bytes the engine named in `x-selkie-worker`
gives the same request directly; the parsed answers must be what the
engine said; and afterwards the router must book nothing (its /metrics).

usage: openai_e2e.py ROUTER_URL [--concurrent N]
"""

import argparse
import concurrent.futures
import json
import sys
import time
import urllib.request

import openai

TEXT = "hello world the cat sat on the mat again"
CHAT = [
    {"role": "system", "content": "the cat sat on the mat"},
    {"role": "user", "content": "hello world again"},
]


def cases():
    """(endpoint, request body) for every shape, streaming and not."""
    out = []
    for stream in (False, True):
        extra = {"stream": True, "stream_options": {"include_usage": True}} if stream else {}
        out.append(("completions", dict(model="tiny", prompt=[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17], max_tokens=5, **extra)))
        out.append(("completions", dict(model="tiny", prompt=TEXT, max_tokens=6, **extra)))
        out.append(("completions", dict(model="tiny", prompt=[[5, 6, 7, 8]], max_tokens=3, **extra)))
        out.append(("chat", dict(model="tiny", messages=CHAT, max_tokens=4, **extra)))
    return out


def direct(worker, endpoint, body):
    """The engine's bytes for `body`, asked directly."""
    path = "/v1/completions" if endpoint == "completions" else "/v1/chat/completions"
    req = urllib.request.Request(worker + path, data=json.dumps(body).encode(), headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return r.read()


def raw_through_router(client, endpoint, body):
    """The bytes the client reads through the router, and the worker."""
    api = client.completions if endpoint == "completions" else client.chat.completions
    with api.with_streaming_response.create(**body) as resp:
        data = b"".join(resp.iter_bytes())
        return data, resp.headers["x-selkie-worker"], resp.status_code


def parsed_through_router(client, endpoint, body):
    """The client's parsed answer: the text (joined over chunks) and usage."""
    api = client.completions if endpoint == "completions" else client.chat.completions
    if not body.get("stream"):
        r = api.create(**body)
        text = r.choices[0].text if endpoint == "completions" else r.choices[0].message.content
        return text, r.usage.completion_tokens
    text, usage = "", None
    for chunk in api.create(**body):
        if chunk.usage is not None:
            usage = chunk.usage.completion_tokens
        for c in chunk.choices:
            text += (c.text if endpoint == "completions" else (c.delta.content or ""))
    return text, usage


def booked(router):
    """Requests, prefill tokens and decode blocks the router books now."""
    text = urllib.request.urlopen(router + "/metrics", timeout=10).read().decode()
    sums = {"selkie_inflight_requests": 0.0, "selkie_booked_prefill_tokens": 0.0, "selkie_booked_decode_blocks": 0.0}
    for line in text.splitlines():
        for name in sums:
            if line.startswith(name + "{"):
                sums[name] += float(line.rsplit(" ", 1)[1])
    return tuple(sums.values())


def one(client, endpoint, body):
    """Checks one request both ways; returns a failure message or None."""
    raw, worker, status = raw_through_router(client, endpoint, body)
    if status != 200:
        return f"{endpoint} {body}: status {status}"
    expected = direct(worker, endpoint, body)
    if raw != expected:
        return f"{endpoint} {body}: {len(raw)} bytes through the router differ from the engine's {len(expected)}"
    text, usage = parsed_through_router(client, endpoint, body)
    want = body["max_tokens"]
    if usage is not None and usage != want:
        return f"{endpoint} {body}: usage {usage}, asked {want}"
    if text.count(" e") != want:
        return f"{endpoint} {body}: {text!r} is not {want} tokens"
    return None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("router")
    ap.add_argument("--concurrent", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=8)
    a = ap.parse_args()
    client = openai.OpenAI(base_url=a.router + "/v1", api_key="none", max_retries=0, timeout=60)
    models = [m.id for m in client.models.list()]
    if "tiny" not in models:
        sys.exit(f"FAIL: /v1/models lists {models}")
    failures, answered, workers = [], 0, set()
    # Each shape once, in order, then every shape many times at once.
    for endpoint, body in cases():
        f = one(client, endpoint, body)
        answered += 1
        failures += [f] if f else []
    work = [c for _ in range(a.rounds) for c in cases()]
    with concurrent.futures.ThreadPoolExecutor(a.concurrent) as pool:
        for f in pool.map(lambda c: one(client, *c), work):
            answered += 1
            failures += [f] if f else []
    for _ in range(4):
        with client.completions.with_streaming_response.create(model="tiny", prompt=[9, 9, 9], max_tokens=1) as r:
            workers.add(r.headers["x-selkie-worker"])
    deadline = time.time() + 10
    left = booked(a.router)
    while left != (0.0, 0.0, 0.0) and time.time() < deadline:
        time.sleep(0.05)
        left = booked(a.router)
    print(f"openai {openai.__version__}: {answered} requests checked ({len(cases())} shapes), "
          f"{len(failures)} failures, workers seen {sorted(workers)}, booked after: {left}")
    for f in failures[:20]:
        print("FAIL:", f)
    if failures or left != (0.0, 0.0, 0.0):
        sys.exit(1)


if __name__ == "__main__":
    main()
