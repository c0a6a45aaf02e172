#!/usr/bin/env bash
# The test command: set up .venv if needed, then run the CPU test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest tests "$@"
