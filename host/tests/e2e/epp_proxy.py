#!/usr/bin/env python3
"""Drives `selkie serve --ext-proc-port` as Envoy drives an endpoint picker,
from an implementation of Envoy's protos independent of selkie's: `grpcio`
with the `envoy-data-plane` messages (PyPI).

For each request it plays the proxy: request headers, the body in chunks,
then (once the picker has named the endpoint) sends the request to that
endpoint itself, and passes the response's headers and body chunks through
the picker as they arrive, with the served endpoint reported. Checked on
every answer: the destination header and the `envoy.lb` metadata name the
same endpoints, the body mode's shape of each answer, the response headers
the picker adds; the 503 and 429 immediate responses; subset hints; a
request served by the fallback, which moves the booking; bookings back to 0.

    epp_proxy.py PICKER_HOST:PORT ROUTER_URL   (ROUTER_URL: its HTTP door, for /metrics)
"""
import json
import os
import queue
import sys
import threading
import time
import urllib.request

import grpc
from envoy_data_plane.envoy.config.core.v3 import HeaderMap, HeaderValue, Metadata
from envoy_data_plane.envoy.service.ext_proc.v3 import (
    ExternalProcessorSyncStub,
    HttpBody,
    HttpHeaders,
    HttpTrailers,
    ProcessingRequest,
    ProtocolConfiguration,
)
from envoy_data_plane.google.protobuf import ListValue, Struct, Value

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "engines"))
from engines import metrics  # noqa: E402  (Prometheus text as {'name{labels}': value})

DEST = "x-gateway-destination-endpoint"
SERVED = "x-gateway-destination-endpoint-served"
FULL_DUPLEX = 4
failures = []


def check(ok, what):
    if not ok:
        failures.append(what)
        print("FAIL:", what, flush=True)


class Stream:
    """One ext_proc stream, the proxy's side."""

    def __init__(self, stub):
        self.out = queue.Queue()
        self.answers = stub.process(iter(self.out.get, None))

    def send(self, **fields):
        self.out.put(ProcessingRequest(**fields))

    def answer(self):
        return next(self.answers)

    def close(self):
        self.out.put(None)


def hdrs(pairs, eos=False):
    return HttpHeaders(headers=HeaderMap(headers=[HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs]),
                       end_of_stream=eos)


def subset_hint(endpoints):
    lst = Value(list_value=ListValue(values=[Value(string_value=e) for e in endpoints]))
    return Metadata(filter_metadata={"envoy.lb.subset_hint": Struct(fields={
        "x-gateway-destination-endpoint-subset": lst})})


def set_headers(common):
    if common is None or common.header_mutation is None:
        return {}
    return {o.header.key: (o.header.raw_value or o.header.value.encode()).decode()
            for o in common.header_mutation.set_headers}


def decision(answers, duplex):
    """The destination the decision names, checked in header and metadata."""
    first = answers[0]
    common = (first.request_headers if duplex else first.request_body)
    check(common is not None, f"the decision comes as the {'headers' if duplex else 'body'} answer: {first}")
    if common is None:
        return None
    common = common.response
    check(common.clear_route_cache, "clear_route_cache set")
    header = set_headers(common).get(DEST)
    meta = first.dynamic_metadata.fields["envoy.lb"].struct_value.fields[DEST].string_value
    check(header is not None and header == meta, f"header {header!r} == metadata {meta!r}")
    return header


def ask(stub, body, path="/v1/completions", duplex=False, hint=None, chunks=3):
    """Sends a request's headers and body; returns (stream, destination, immediate)."""
    s = Stream(stub)
    pc = ProtocolConfiguration(request_body_mode=FULL_DUPLEX, response_body_mode=FULL_DUPLEX) if duplex else None
    s.send(request_headers=hdrs([(":path", path), (":method", "POST"), ("content-type", "application/json")]),
           protocol_config=pc, metadata_context=hint)
    if not duplex:
        a = s.answer()
        if a.immediate_response is not None:
            return s, None, a.immediate_response
        check(a.request_headers is not None, "headers answered at once")
    data = body.encode()
    step = max(1, len(data) // chunks)
    pieces = [data[i:i + step] for i in range(0, len(data), step)]
    for i, p in enumerate(pieces):
        last = i == len(pieces) - 1
        s.send(request_body=HttpBody(body=p, end_of_stream=last))
        if not last and not duplex:
            a = s.answer()
            check(a.request_body is not None, "a body chunk answered")
    a = s.answer()
    if a.immediate_response is not None:
        return s, None, a.immediate_response
    answers = [a]
    if duplex:
        back = b""
        while True:
            b = s.answer()
            sr = b.request_body.response.body_mutation.streamed_response
            back += sr.body
            if sr.end_of_stream:
                break
        check(back == data, "full duplex: the body comes back unchanged")
        check(set_headers(a.request_headers.response).get("content-length") == str(len(data)), "content-length set")
    return s, decision(answers, duplex), None


def relay(s, endpoint, path, body, duplex, served=None, trailers=False):
    """Sends the request to `endpoint`, passes its response through the
    picker (ending it with response trailers when `trailers`)."""
    req = urllib.request.Request(f"http://{endpoint}{path}", data=body.encode(),
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        headers = [(":status", str(r.status)), ("content-type", r.headers.get("content-type", ""))]
        headers.append((SERVED, served or endpoint))
        s.send(response_headers=hdrs(headers))
        a = s.answer()
        added = set_headers(a.response_headers.response)
        got = b""
        while True:
            chunk = r.read1(65536) if hasattr(r, "read1") else r.read(65536)
            if not chunk and trailers:
                s.send(response_trailers=HttpTrailers(trailers=HeaderMap(headers=[])))
                check(s.answer().response_trailers is not None, "response trailers answered")
                break
            s.send(response_body=HttpBody(body=chunk, end_of_stream=not chunk))
            b = s.answer()
            check(b.response_body is not None, "response chunk answered")
            if duplex:
                check(b.response_body.response.body_mutation.streamed_response.body == chunk, "echoed")
            got += chunk
            if not chunk:
                break
    s.close()
    return added, got


def booked(router):
    m = metrics(router)
    return sum(v for k, v in m.items() if k.startswith("selkie_inflight_requests"))


def wait_unbooked(router):
    for _ in range(200):
        if booked(router) == 0:
            return 0
        time.sleep(0.05)
    return booked(router)


def main():
    picker, router = sys.argv[1], sys.argv[2]
    stub = ExternalProcessorSyncStub(grpc.insecure_channel(picker))
    models = json.load(urllib.request.urlopen(router + "/v1/models", timeout=5))
    model = models["data"][0]["id"]
    routed, seen, named = 0, set(), set()
    # Completions and chat, streaming and not, both body modes.
    for i in range(16):
        duplex = i % 2 == 1
        chat = i % 4 >= 2
        stream = i % 8 >= 4
        path = "/v1/chat/completions" if chat else "/v1/completions"
        req = {"model": model, "max_tokens": 6, "stream": stream}
        if chat:
            req["messages"] = [{"role": "user", "content": f"shared system prompt words {i % 3} " * 20}]
        else:
            req["prompt"] = list(range(1, 70)) + [i]
        body = json.dumps(req)
        s, dest, refused = ask(stub, body, path, duplex)
        check(refused is None, f"request {i} routed, got {refused}")
        if dest is None:
            continue
        first = dest.split(",")[0]
        check(len(dest.split(",")) == 2, f"the choice and one fallback: {dest}")
        added, got = relay(s, first, path, body, duplex, trailers=stream)
        check(added.get("x-selkie-worker") == "http://" + first, f"x-selkie-worker names {first}: {added}")
        check(len(got) > 0, "a response came back")
        routed += 1
        seen.add(first)
        named.update(dest.split(","))
    check(len(named) == 2, f"both engines named: {named}")
    # The subset hint.
    engines = sorted(named)
    for _ in range(3):
        body = json.dumps({"model": model, "prompt": [5, 6, 7, 8], "max_tokens": 2})
        s, dest, refused = ask(stub, body, hint=subset_hint([engines[1]]))
        check(dest == engines[1], f"only the hinted endpoint: {dest}")
        relay(s, dest, "/v1/completions", body, False)
    # Served by the fallback: the booking moves.
    before = metrics(router).get("selkie_ext_proc_served_elsewhere_total", 0)
    body = json.dumps({"model": model, "prompt": [9, 9, 9], "max_tokens": 2})
    s, dest, _ = ask(stub, body)
    first, fallback = dest.split(",")
    added, _ = relay(s, fallback, "/v1/completions", body, False, served=fallback)
    check(added.get("x-selkie-worker") == "http://" + fallback, f"the response names the fallback: {added}")
    after = metrics(router).get("selkie_ext_proc_served_elsewhere_total", 0)
    check(after == before + 1, f"served elsewhere counted ({before} -> {after})")
    # 503: the hint names no worker.
    _, _, refused = ask(stub, body, hint=subset_hint(["10.255.0.1:9"]))
    check(refused is not None and refused.status.code == 503, f"503 for an unknown subset: {refused}")
    # 429: every worker at its admission limit (the router runs with
    # --max-active 2): hold four decided streams, the fifth is shed.
    held = []
    for _ in range(4):
        s, dest, refused = ask(stub, body)
        check(dest is not None, f"held stream routed ({refused})")
        held.append(s)
    s, _, refused = ask(stub, body)
    ok = refused is not None and refused.status.code == 429
    check(ok, f"429 when every worker is at its limit: {refused}")
    if ok:
        hs = {o.header.key: o.header.raw_value.decode() for o in refused.headers.set_headers}
        check("retry-after" in hs, f"Retry-After on 429: {hs}")
        check(json.loads(refused.body)["error"]["code"] == "workers_at_capacity", "429 body code")
    for h in held:
        h.close()
    left = wait_unbooked(router)
    check(left == 0, f"bookings back to 0, {left} left")
    print(f"ext_proc (grpcio {grpc.__version__}, envoy-data-plane): {routed} requests relayed, engines {sorted(seen)}, "
          f"booked after: {left}, failures: {len(failures)}")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
