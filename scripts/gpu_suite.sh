#!/usr/bin/env bash
# The Triton backend on a CUDA device in one command: GPU tests, the invariance probe, then the benchmark
# table (ratios vs stock measured in this same run).
#   bash scripts/gpu_suite.sh [OUTDIR]        # from the repo root; OUTDIR defaults to $OUT or outputs/gpu_suite
# Exit status: non-zero if any test failed, the probe found a difference or the benchmark crashed
# (missed speed goals do not fail it).
set -uo pipefail
cd "$(dirname "$0")/.."
out_dir=${1:-${OUT:-outputs/gpu_suite}}
mkdir -p "$out_dir"
export PYTHONPATH="kernels:recipe:tests/gpu${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if ! python3 -c 'import sys, torch; sys.exit(not torch.cuda.is_available())' 2>/dev/null; then
  echo "[gpu_suite] error: python3 here has no CUDA GPU (or no torch): run it on the device, run(command=\"bash scripts/gpu_suite.sh \$OUT\")" >&2
  exit 2
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, "gpus", torch.cuda.device_count())'

python3 -m pytest -q -rs tests/gpu -p no:cacheprovider --junitxml "$out_dir/junit.xml" 2>&1 | tee "$out_dir/tests.log"
tests_rc=${PIPESTATUS[0]}
CONSISTENT_OPS_BACKEND=triton python3 -m consistent_ops.probe 2>&1 | tee "$out_dir/probe.log"
probe_rc=${PIPESTATUS[0]}
python3 benchmarks/bench_triton.py --json "$out_dir/bench.json" 2>&1 | tee "$out_dir/bench.log"
bench_rc=${PIPESTATUS[0]}
# the full 48-layer Qwen3-30B-A3B shape: trainer == rollout bitwise, graph-replayed decode, prefill
python3 benchmarks/bench_rollout_gpu.py --json "$out_dir/rollout.json" 2>&1 | tee "$out_dir/rollout.log"
rollout_rc=${PIPESTATUS[0]}
echo "tests rc=$tests_rc probe rc=$probe_rc bench rc=$bench_rc rollout rc=$rollout_rc"
exit $(( tests_rc != 0 || probe_rc != 0 || bench_rc != 0 || rollout_rc != 0 ))
