#!/usr/bin/env bash
# selkie serve end to end, as a user runs it: two stub engines and the
# router as processes, driven by the official `openai` Python client
# (host/tests/e2e/openai_e2e.py), then a SIGTERM that must exit 0.
#
# The client lives in a venv of its own (SELKIE_E2E_VENV, default
# target/e2e-venv; created and `pip install openai` the first time).
# Everything it starts is stopped when it ends, passing or failing.
set -euo pipefail
cd "$(dirname "$0")/../../.."
target=${CARGO_TARGET_DIR:-target}
venv=${SELKIE_E2E_VENV:-$target/e2e-venv}
if ! "$venv/bin/python" -c "import openai" 2>/dev/null; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install --quiet --disable-pip-version-check openai
fi
cargo build -q -p selkie --features serve --bin selkie --example stub_engine
dir=$(mktemp -d)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$dir"
}
trap cleanup EXIT
read -r p1 p2 p3 < <(python3 -c '
import socket
s = [socket.socket() for _ in range(3)]
for x in s: x.bind(("127.0.0.1", 0))
print(*(x.getsockname()[1] for x in s))')
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
urllib.request.urlopen('http://127.0.0.1:$p3/health', timeout=1)
sys.exit(not json.load(urllib.request.urlopen('http://127.0.0.1:$p3/v1/models', timeout=1))['data'])" 2>/dev/null; }
for _ in $(seq 200); do healthy && break; sleep 0.1; done
healthy || { echo "selkie serve did not come up"; cat "$dir/router.log" "$dir/engines.log"; exit 1; }
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
