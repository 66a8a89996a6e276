#!/usr/bin/env bash
# selkie serve end to end, as a user runs it: two stub engines and the
# router as processes, driven by the official `openai` Python client
# (host/tests/e2e/openai_e2e.py), then a SIGTERM that must exit 0; then a
# second router with its endpoint picker door on, driven as Envoy drives
# it by grpcio and envoy-data-plane (host/tests/e2e/epp_proxy.py).
#
# The clients live in a venv of their own (SELKIE_E2E_VENV, default
# target/e2e-venv; created and `pip install openai grpcio envoy-data-plane`
# the first time). SELKIE_SERVE_FEATURES (default `serve`) names the
# features the router is built with.
# Everything it starts is stopped when it ends, passing or failing.
set -euo pipefail
cd "$(dirname "$0")/../../.."
target=${CARGO_TARGET_DIR:-target}
venv=${SELKIE_E2E_VENV:-$target/e2e-venv}
if ! "$venv/bin/python" -c "import openai, grpc, envoy_data_plane" 2>/dev/null; then
  [ -x "$venv/bin/pip" ] || python3 -m venv "$venv"
  "$venv/bin/pip" install --quiet --disable-pip-version-check openai grpcio envoy-data-plane
fi
cargo build -q -p selkie --features "${SELKIE_SERVE_FEATURES:-serve}" --bin selkie --example stub_engine
dir=$(mktemp -d)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$dir"
}
trap cleanup EXIT
# Ports from below the ephemeral range (see free_ports), so that no
# outgoing connection takes one before the servers bind it.
read -r p1 p2 p3 p4 p5 < <(PYTHONPATH=host/tests/engines python3 -c 'import engines; print(*engines.free_ports(5))')
"$target/debug/examples/stub_engine" --write-tokenizer "$dir" >/dev/null
"$target/debug/examples/stub_engine" --listen "127.0.0.1:$p1" --listen "127.0.0.1:$p2" >"$dir/engines.log" 2>&1 &
pids+=($!)
"$target/debug/selkie" serve --port "$p3" --worker "http://127.0.0.1:$p1" --worker "http://127.0.0.1:$p2" \
  --policy kv --tokenizer "$dir/tokenizer.json" --chat-template "$dir/template.jinja" \
  --max-connections 512 --max-concurrent-requests 512 >"$dir/router.log" 2>&1 &
router=$!
pids+=("$router")
# Up, and the engines' models read (the router reads each engine's
# /v1/models after it starts listening).
healthy() { python3 -c "import json, sys, urllib.request
urllib.request.urlopen('http://127.0.0.1:$1/health', timeout=1)
sys.exit(not json.load(urllib.request.urlopen('http://127.0.0.1:$1/v1/models', timeout=1))['data'])" 2>/dev/null; }
for _ in $(seq 200); do healthy "$p3" && break; sleep 0.1; done
healthy "$p3" || { echo "selkie serve did not come up"; cat "$dir/router.log" "$dir/engines.log"; exit 1; }
"$venv/bin/python" host/tests/e2e/openai_e2e.py "http://127.0.0.1:$p3" || { cat "$dir/router.log"; exit 1; }
unhashed=$(python3 -c "
import urllib.request
t = urllib.request.urlopen('http://127.0.0.1:$p3/metrics').read().decode()
print(sum(float(l.rsplit(' ', 1)[1]) for l in t.splitlines() if l.startswith('selkie_unhashed_requests_total')))")
echo "prompts routed unhashed: $unhashed"
[ "$unhashed" = "0.0" ] || { echo "every prompt should have been hashed"; exit 1; }
kill -TERM "$router"
status=0; wait "$router" || status=$?
echo "selkie serve exited $status after SIGTERM"
[ "$status" = 0 ]
# The endpoint picker door, on a router of its own (each engine admits 2
# requests, so that the check can fill them and see the 429).
"$target/debug/selkie" serve --port "$p5" --ext-proc-port "$p4" \
  --worker "http://127.0.0.1:$p1" --worker "http://127.0.0.1:$p2" --policy kv --max-active 2 \
  --tokenizer "$dir/tokenizer.json" --chat-template "$dir/template.jinja" >"$dir/picker.log" 2>&1 &
picker=$!
pids+=("$picker")
for _ in $(seq 200); do healthy "$p5" && break; sleep 0.1; done
healthy "$p5" || { echo "the picker did not come up"; cat "$dir/picker.log"; exit 1; }
"$venv/bin/python" host/tests/e2e/epp_proxy.py "127.0.0.1:$p4" "http://127.0.0.1:$p5" || { cat "$dir/picker.log"; exit 1; }
kill -TERM "$picker"
status=0; wait "$picker" || status=$?
echo "selkie serve (picker) exited $status after SIGTERM"
[ "$status" = 0 ]
