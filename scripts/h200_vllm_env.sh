#!/usr/bin/env bash
# On the device machine: gather the pieces made by scripts/h200_vllm_pack.sh (each call carries one;
# /tmp keeps them while the machine is warm), and once all have arrived unpack vLLM 0.26 into
# /tmp/h200_site, install this checkout beside it (its vLLM plugin entry point included), print the
# versions and a CUDA smoke test. Writes /tmp/h200_env.sh to source:
#   bash scripts/h200_vllm_env.sh && . /tmp/h200_env.sh && python3 -m true_on_policy.check ...
# Exit 0: ready; 3: pieces still missing (listed); other: a failure, named.
set -euo pipefail
cd "$(dirname "$0")/.."
parts=/tmp/h200_parts site=/tmp/h200_site proj=/tmp/h200_project
mkdir -p "$parts"
[ -f .h200/MANIFEST ] || { echo "error: .h200/MANIFEST not carried; carry it with every piece" >&2; exit 2; }
cp .h200/MANIFEST "$parts/"
for f in .h200/vllm026.tar.xz.part-*; do [ -f "$f" ] && cp "$f" "$parts/"; done
cd "$parts"
missing=$(awk '{print $2}' MANIFEST | while read -r p; do [ -f "$p" ] || echo "$p"; done)
if [ -n "$missing" ]; then
    echo "[h200_vllm_env] have $(ls vllm026.tar.xz.part-* 2>/dev/null | wc -l) of $(wc -l < MANIFEST) pieces;" \
         "missing: $(echo $missing)"
    exit 3
fi
stamp=$(sha256sum MANIFEST | cut -d' ' -f1)
if [ "$(cat "$site/.stamp" 2>/dev/null)" != "$stamp" ]; then
    sha256sum -c --quiet MANIFEST
    rm -rf "$site" && mkdir -p "$site"
    cat $(awk '{print $2}' MANIFEST) | xz -d -T0 | tar -x -C "$site"
    echo "$stamp" > "$site/.stamp"
    echo "[h200_vllm_env] unpacked $(du -sm "$site" | cut -f1) MB into $site"
fi
cd - > /dev/null
# This checkout, installed (not editable: the repo copy is new every call) with its entry points.
rm -rf "$proj"
python3 -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation --no-index \
    --target "$proj" . 2>&1 | grep -v "^WARNING" || true
rm -rf build ./*.egg-info
cat > /tmp/h200_env.sh <<EOF
export PYTHONPATH=$proj:$site\${PYTHONPATH:+:\$PYTHONPATH}
export VLLM_USE_FLASHINFER_SAMPLER=0   # the sampler would import flashinfer, absent on the image
export PYTHONUNBUFFERED=1
EOF
. /tmp/h200_env.sh
python3 - <<'EOF'
import importlib.metadata as md
import torch, triton, transformers, vllm
from vllm.vllm_flash_attn import flash_attn_varlen_func   # FA3: stock vLLM's attention on Hopper
eps = [e.name for e in md.entry_points(group="vllm.general_plugins")]
print(f"[h200_vllm_env] vllm {vllm.__version__} torch {torch.__version__} triton {triton.__version__} "
      f"transformers {transformers.__version__}; vllm.general_plugins {eps}")
x = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16)
q = torch.randn(64, 8, 128, device="cuda", dtype=torch.bfloat16)
cu = torch.tensor([0, 64], device="cuda", dtype=torch.int32)
o = flash_attn_varlen_func(q, q, q, max_seqlen_q=64, cu_seqlens_q=cu, max_seqlen_k=64, cu_seqlens_k=cu,
                           causal=True, fa_version=3)
torch.cuda.synchronize()
print(f"[h200_vllm_env] CUDA smoke on {torch.cuda.get_device_name()}: matmul {tuple((x @ x).shape)}, "
      f"FA3 {tuple(o.shape)} finite={bool(o.isfinite().all())}")
EOF
