#!/usr/bin/env bash
# Compile every Triton kernel the ascend backend launches with triton-ascend, on this CPU
# (front end + bundled triton-adapter-opt: Python -> TTIR -> linalg; no NPU, no CANN).
# triton-ascend is installed once into its own folder (never into .venv beside torch: it
# replaces the `triton` package) and put first on PYTHONPATH for this run only.
# Prints "N kernels compiled for Ascend, 0 failed"; exits non-zero on any failure.
# Arguments go to `python -m consistent_ops.ascend.compile_check` (--help).
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=3.2.0
DIR="${TRITON_ASCEND_HOME:-$HOME/.cache/verl-true-on-policy/triton-ascend-$VERSION}"
if [ ! -f "$DIR/.complete" ]; then
    rm -rf "$DIR.partial"
    if ! log=$(.venv/bin/python -m pip install --quiet --disable-pip-version-check --no-deps \
               --target "$DIR.partial" "triton-ascend==$VERSION" 2>&1); then
        echo "$log" | grep -v "^WARNING: Location" >&2
        echo "ascend_compile_check: could not install triton-ascend==$VERSION (PyPI)" >&2
        exit 1
    fi
    touch "$DIR.partial/.complete"
    rm -rf "$DIR" && mv "$DIR.partial" "$DIR"
fi
export PYTHONPATH="$DIR${PYTHONPATH:+:$PYTHONPATH}"
# triton-ascend warns about launch options that mean nothing on Ascend (num_warps ...): noise here
.venv/bin/python -m consistent_ops.ascend.compile_check "$@" 2>&1 | grep -v "Please DO NOT tune args"
