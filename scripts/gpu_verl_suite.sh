#!/usr/bin/env bash
# verl on one CUDA GPU (after scripts/h200_vllm_env.sh with the verl091 pack): the recipe's GRPO job
# at the 8-layer Qwen3-30B-A3B shape (preset qwen3_moe_h200x1: FSDP2 actor, colocated vLLM with
# sleep mode and CUDA graphs) with the plugin, with the weight-sync check, and stock; then verl's
# time per phase side by side (README "verl on a GPU").
#   bash scripts/gpu_verl_suite.sh STEP... [OUTDIR]     # from the repo root; OUTDIR: $OUT or outputs/gpu_verl
# Steps, in any order (a job takes minutes: one per device call, two where they fit):
#   model   the checkpoint: scripts/gpu_vllm_suite.sh's model step (its GPU_VLLM_MODEL / GPU_VLLM_LAYERS)
#   plugin  TRUE_ON_POLICY=1: logdiff_max 0 and contract_match 1 every step
#   sync    the same with true_on_policy.check_sync=true: every weight sync checksummed on both sides
#   stock   TRUE_ON_POLICY=0: stock vLLM + stock HF, padded batches (no flash-attn on the image to pack)
#   table   benchmarks/verl_step_table.py over the jobs run so far: phases side by side, plugin / stock
# Each job's log, metrics.jsonl and GPU memory samples go to OUTDIR; the jobs' own output dirs stay in
# $GPU_VERL_DIR (default /tmp/gpu_verl: kept while the machine is warm, so `table` can follow other
# calls). A job is stopped after $GPU_VERL_TIMEOUT s (default 570), or earlier so that the whole call
# ends within $GPU_VERL_BUDGET s (default 585: the device tool's 600 s); $GPU_VERL_ARGS adds hydra overrides to
# every job (e.g. actor_rollout_ref.ref.fsdp_config.param_offload=true). Exit status: non-zero if a step failed.
set -uo pipefail
cd "$(dirname "$0")/.."
steps=() out=${OUT:-outputs/gpu_verl}
for a in "$@"; do case $a in model|plugin|sync|stock|table) steps+=("$a") ;; *) out=$a ;; esac; done
[ ${#steps[@]} -gt 0 ] || { echo "usage: $0 model|plugin|sync|stock|table ... [OUTDIR]" >&2; exit 2; }
mkdir -p "$out"
if [ -f /tmp/h200_env.sh ]; then . /tmp/h200_env.sh; else export PYTHONPATH="recipe:kernels" PYTHONUNBUFFERED=1; fi
model=${GPU_VLLM_MODEL:-/tmp/qwen3_30b_a3b_l${GPU_VLLM_LAYERS:-8}}
state=${GPU_VERL_DIR:-/tmp/gpu_verl}
rc=0

job() {   # name, "ENV=value ...", hydra overrides...
    local name=$1 envs=$2; shift 2
    local limit=$(( ${GPU_VERL_BUDGET:-585} - SECONDS - 15 ))   # 15 s for Ray's stop and the table
    [ "$limit" -lt "${GPU_VERL_TIMEOUT:-570}" ] || limit=${GPU_VERL_TIMEOUT:-570}
    if [ "$limit" -lt 60 ]; then echo "[gpu_verl_suite] $name: skipped, ${limit} s left in this call"; rc=1; return; fi
    rm -rf "${state:?}/$name" && mkdir -p "$state/$name"
    echo "[gpu_verl_suite] $name (stopped after $limit s): $envs python3 -m true_on_policy.main_ppo preset=qwen3_moe_h200x1 $* ${GPU_VERL_ARGS:-}"
    nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -l 2 > "$out/$name.gpu_mem_mib" 2>/dev/null &
    local sampler=$!
    # shellcheck disable=SC2086   # envs, GPU_VERL_ARGS: words by design
    env $envs timeout -k 10 "$limit" python3 -m true_on_policy.main_ppo preset=qwen3_moe_h200x1 \
        actor_rollout_ref.model.path="$model" true_on_policy.cache_dir="$state/cache" hydra.run.dir="$state/$name" \
        "$@" ${GPU_VERL_ARGS:-} 2>&1 | tee "$out/$name.log"
    local status=${PIPESTATUS[0]}
    kill "$sampler" 2>/dev/null
    cp "$state/$name/metrics.jsonl" "$out/$name.metrics.jsonl" 2>/dev/null
    # a stopped job can leave Ray's processes (and vLLM's engine under them) holding the GPU
    python3 -m ray.scripts.scripts stop --force > /dev/null 2>&1
    echo "[gpu_verl_suite] $name: exit $status; GPU memory peak $(sort -n "$out/$name.gpu_mem_mib" | tail -1) MiB"
    [ "$status" -eq 0 ] || rc=1
}

for step in "${steps[@]}"; do
    case $step in
    model)
        bash scripts/gpu_vllm_suite.sh model "$out" || rc=1 ;;
    plugin)
        job plugin "TRUE_ON_POLICY=1" ;;
    sync)
        # the rollout worker logs each exact sync at INFO (verl sets vLLM's level to WARN)
        job sync "TRUE_ON_POLICY=1 VLLM_LOGGING_LEVEL=INFO" true_on_policy.check_sync=true
        echo "[gpu_verl_suite] sync: $(grep -c "weight sync exact" "$out/sync.log") weight syncs checksummed exact" ;;
    stock)
        job stock "TRUE_ON_POLICY=0" actor_rollout_ref.model.use_remove_padding=false ;;
    table)
        runs=()
        for name in plugin sync stock; do
            [ -f "$state/$name/metrics.jsonl" ] && runs+=("$name=$state/$name/metrics.jsonl")
        done
        if [ ${#runs[@]} -eq 0 ]; then echo "[gpu_verl_suite] table: no job has run" >&2; rc=1; continue; fi
        python3 benchmarks/verl_step_table.py "${runs[@]}" --json "$out/table.json" | tee "$out/table.txt"
        [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1 ;;
    esac
done
exit $rc
