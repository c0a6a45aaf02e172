#!/usr/bin/env bash
# verl on one CUDA GPU (after scripts/h200_vllm_env.sh with the verl091 pack): the recipe's GRPO job
# at the Qwen3-30B-A3B shape ($GPU_VERL_LAYERS of its 48 layers, default 4; preset
# qwen3_moe_h200x1: FSDP2 actor, colocated vLLM with sleep mode and CUDA graphs) with the plugin,
# with the weight-sync check, and stock; then verl's time per phase side by side (README "verl on a GPU").
#   bash scripts/gpu_verl_suite.sh STEP... [OUTDIR]     # from the repo root; OUTDIR: $OUT or outputs/gpu_verl
# Steps, in any order:
#   model   the checkpoint: scripts/gpu_vllm_suite.sh's model step, $GPU_VERL_LAYERS layers
#   plugin  TRUE_ON_POLICY=1: logdiff_max 0 and contract_match 1 every step
#   sync    the same with true_on_policy.check_sync=true: every weight sync checksummed on both sides
#   stock   TRUE_ON_POLICY=0: stock vLLM + stock HF, padded batches (no flash-attn on the image to pack)
#   wait    wait for the jobs started by an earlier call
#   table   benchmarks/verl_step_table.py over the jobs finished so far: phases side by side, plugin / stock
# A job takes longer than one device call (10 min): the jobs of a call run one after another in a
# detached runner that outlives the call (a warm machine keeps running it between back-to-back
# calls), and each call waits for them until its budget ($GPU_VERL_BUDGET s, default 570) is spent,
# printing their progress, then copies every job's log and metrics.jsonl to OUTDIR (GPU memory:
# sampled every 2 s, its peak printed). Exit 3: jobs still running (call again with `wait`); 1: a job
# or the table failed.
# Job folders live in $GPU_VERL_DIR (default /tmp/gpu_verl); $GPU_VERL_TIMEOUT stops a job (1500 s);
# $GPU_VERL_ARGS adds hydra overrides to every job (e.g. actor_rollout_ref.ref.fsdp_config.param_offload=true).
set -uo pipefail
state=${GPU_VERL_DIR:-/tmp/gpu_verl}
export GPU_VLLM_LAYERS=${GPU_VERL_LAYERS:-4}
model=${GPU_VLLM_MODEL:-/tmp/qwen3_30b_a3b_l$GPU_VLLM_LAYERS}
if [ -f /tmp/h200_env.sh ]; then
    . /tmp/h200_env.sh
elif [ "${1:-}" != --runner ]; then   # the runner inherits these (it runs from a copy of this script)
    root=$(cd "$(dirname "$0")/.." && pwd)
    export PYTHONPATH="$root/recipe:$root/kernels" PYTHONUNBUFFERED=1
fi

job() {   # name, "ENV=value ...", hydra overrides...: one job, run by the runner
    local name=$1 envs=$2; shift 2
    local dir="$state/$name"
    rm -rf "${dir:?}" && mkdir -p "$dir"
    echo "[gpu_verl_suite] $name: $envs python3 -m true_on_policy.main_ppo preset=qwen3_moe_h200x1 $* ${GPU_VERL_ARGS:-}"
    nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -l 2 > "$dir/gpu_mem_mib" 2>/dev/null &
    local sampler=$!
    # shellcheck disable=SC2086   # envs, GPU_VERL_ARGS: words by design
    env $envs timeout -k 10 "${GPU_VERL_TIMEOUT:-1500}" python3 -m true_on_policy.main_ppo preset=qwen3_moe_h200x1 \
        actor_rollout_ref.model.path="$model" true_on_policy.cache_dir="$state/cache" hydra.run.dir="$dir" \
        "$@" ${GPU_VERL_ARGS:-} > "$dir/log" 2>&1
    echo $? > "$dir/exit"
    kill "$sampler" 2>/dev/null
    # a stopped job can leave Ray's processes (and vLLM's engine under them) holding the GPU
    python3 -m ray.scripts.scripts stop --force > /dev/null 2>&1
}

if [ "${1:-}" = "--runner" ]; then   # detached: the jobs named, one after another
    shift
    cd "$state"   # not the call's copy of the repo, which the next call replaces
    for name in "$@"; do
        case $name in
        plugin) job plugin "TRUE_ON_POLICY=1" ;;
        # the rollout worker logs each exact sync at INFO (verl sets vLLM's level to WARN)
        sync) job sync "TRUE_ON_POLICY=1 VLLM_LOGGING_LEVEL=INFO" true_on_policy.check_sync=true ;;
        stock) job stock "TRUE_ON_POLICY=0" actor_rollout_ref.model.use_remove_padding=false ;;
        esac
    done
    exit 0
fi

cd "$(dirname "$0")/.."
steps=() jobs=() out=${OUT:-outputs/gpu_verl}
for a in "$@"; do
    case $a in
    model|wait|table) steps+=("$a") ;;
    plugin|sync|stock) jobs+=("$a") ;;
    *) out=$a ;;
    esac
done
[ $((${#steps[@]} + ${#jobs[@]})) -gt 0 ] || { echo "usage: $0 model|plugin|sync|stock|wait|table ... [OUTDIR]" >&2; exit 2; }
mkdir -p "$out" "$state"
rc=0
running() { [ -f "$state/runner.pid" ] && kill -0 "$(cat "$state/runner.pid")" 2>/dev/null; }

report() {   # each job's state, and its files into OUTDIR
    local name dir
    for name in plugin sync stock; do
        dir="$state/$name"
        [ -d "$dir" ] || continue
        cp "$dir/log" "$out/$name.log" 2>/dev/null
        cp "$dir/metrics.jsonl" "$out/$name.metrics.jsonl" 2>/dev/null
        if [ -f "$dir/exit" ]; then
            echo "[gpu_verl_suite] $name: exit $(cat "$dir/exit"); GPU memory peak" \
                 "$(sort -n "$dir/gpu_mem_mib" | tail -1) MiB"
            [ "$name" != sync ] || echo "[gpu_verl_suite] sync: $(grep -c "weight sync exact" "$dir/log") weight syncs checksummed exact"
            [ "$(cat "$dir/exit")" -eq 0 ] || rc=1
        fi
    done
}

wait_jobs() {   # until the runner ends or this call's budget is spent; progress every 30 s
    local shown=""
    while running; do
        if [ "$SECONDS" -ge "${GPU_VERL_BUDGET:-570}" ]; then
            echo "[gpu_verl_suite] jobs still running after ${SECONDS} s: call again with 'wait'"
            return 3
        fi
        local now
        now=$(grep -hE "^ *[0-9]+ \||^\[true_on_policy\]|Error" "$state"/*/log 2>/dev/null | tail -3)
        [ "$now" = "$shown" ] || { echo "$now"; shown=$now; }
        sleep 10
    done
    return 0
}

for step in "${steps[@]}"; do
    [ "$step" = model ] || continue
    bash scripts/gpu_vllm_suite.sh model "$out" || rc=1
done
if [ ${#jobs[@]} -gt 0 ]; then
    if running; then echo "error: jobs of an earlier call are running; 'wait' for them first" >&2; exit 2; fi
    # the runner outlives this call's copy of the repo: it runs from a copy of this script
    mkdir -p "$state/bin" && cp "$0" "$state/bin/gpu_verl_suite.sh"
    setsid nohup bash "$state/bin/gpu_verl_suite.sh" --runner "${jobs[@]}" > "$state/runner.log" 2>&1 &
    echo $! > "$state/runner.pid"
    echo "[gpu_verl_suite] started: ${jobs[*]} (model $model)"
fi
status=0
if [ ${#jobs[@]} -gt 0 ] || [[ " ${steps[*]} " == *" wait "* ]]; then wait_jobs || status=$?; fi
report
for step in "${steps[@]}"; do
    [ "$step" = table ] || continue
    runs=()
    for name in plugin sync stock; do
        [ -f "$state/$name/metrics.jsonl" ] && runs+=("$name=$state/$name/metrics.jsonl")
    done
    if [ ${#runs[@]} -eq 0 ]; then echo "[gpu_verl_suite] table: no job has metrics" >&2; rc=1; continue; fi
    python3 benchmarks/verl_step_table.py "${runs[@]}" --json "$out/table.json" | tee "$out/table.txt"
    [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
done
[ "$status" -eq 0 ] || exit "$status"
exit $rc
