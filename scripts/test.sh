#!/usr/bin/env bash
# The test command: set up .venv if needed, then run the CPU test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# The Megatron environment (tests/test_megatron.py skips where it cannot be made).
bash scripts/setup_megatron.sh || echo "[test] .venv-megatron not made: the Megatron tests will be skipped"
exec .venv/bin/python -m pytest tests "$@"
