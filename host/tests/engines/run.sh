#!/usr/bin/env bash
# selkie serve in front of two real vLLM engines on CPU (dummy weights),
# hearing their KV cache events: host/tests/engines/check_vllm.py.
#
# vLLM lives in a venv of its own (SELKIE_VLLM_VENV, default
# ~/.cache/selkie/vllm-0.32; installed the first time, about 6 GB, then
# reused). SELKIE_SERVE_FEATURES (default `serve`) names the features the
# router is built with. Everything it starts is stopped when it ends.
set -euo pipefail
cd "$(dirname "$0")/../../.."
venv=${SELKIE_VLLM_VENV:-$HOME/.cache/selkie/vllm-0.32}
target=${CARGO_TARGET_DIR:-target}
host/tests/engines/install-vllm.sh "$venv"
# The endpoint picker check plays Envoy with envoy-data-plane's messages.
"$venv/bin/python" -c "import envoy_data_plane" 2>/dev/null ||
  "$venv/bin/pip" install --quiet --disable-pip-version-check envoy-data-plane
cargo build -q -p selkie --features "${SELKIE_SERVE_FEATURES:-serve}" --bin selkie
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$venv/bin/python" host/tests/engines/check_vllm.py --venv "$venv" --selkie "$target/debug/selkie" --work "$work"
