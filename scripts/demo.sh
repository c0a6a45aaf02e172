#!/usr/bin/env bash
# The main job: set up .venv if needed, then the recipe's embedded default run (tiny
# Qwen3-MoE made on first use, synthetic arithmetic task, GRPO, 3 steps, logdiff table).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m true_on_policy.main_ppo "$@"
