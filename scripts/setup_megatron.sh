#!/usr/bin/env bash
# Make .venv-megatron/: megatron-core + megatron-bridge layered over .venv (its
# site-packages are added by a .pth file, so torch/verl/transformers are not copied and
# .venv itself is never changed). Idempotent (stamp). Exit 0 with the env ready, else 1.
set -euo pipefail
cd "$(dirname "$0")/.."
CORE=megatron-core==0.19.2       # 0.16.1 gives wrong log-probs (NOTES §8): keep this pin
BRIDGE=megatron-bridge==0.6.2
env=.venv-megatron
base=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
want=$(printf '%s\n' "$CORE" "$BRIDGE" "$base" | cat - "$0" | sha256sum | cut -d' ' -f1)
if [ "$(cat "$env/.stamp" 2>/dev/null)" != "$want" ] || [ ! -x "$env/bin/python" ]; then
  echo "[setup_megatron] making $env ($CORE, $BRIDGE over .venv)"
  rm -rf "$env"
  "$(.venv/bin/python -c 'import sys; print(sys._base_executable)')" -m venv --without-pip "$env"
  site=$("$env/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  # addsitedir (not a bare path line) so .venv's own .pth files (our editable install) run too.
  echo "import site; site.addsitedir('$(realpath "$base")')" > "$site/00_true_on_policy_base.pth"
  # Work-around PY311_TYPING_OVERRIDE: bridge's megatron.training imports typing.override (3.12+).
  echo "import typing, typing_extensions; typing.override = getattr(typing, 'override', typing_extensions.override)" \
    > "$site/zz_py311_typing_override.pth"
  # Both declare Python >= 3.12 but run on 3.11 (NOTES §8); no deps: .venv provides them.
  "$env/bin/python" -m pip install -q --disable-pip-version-check --no-deps --ignore-requires-python \
    "$CORE" "$BRIDGE" 2>&1 | grep -v -E "^WARNING: (Location|Target)" || true
  "$env/bin/python" -c "from true_on_policy.megatron import env; env.import_bridge()"
  echo "$want" > "$env/.stamp"
fi
echo "[setup_megatron] $env ready"
