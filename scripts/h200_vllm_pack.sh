#!/usr/bin/env bash
# Here, without device time: pack vLLM 0.26.0 and what it needs on the H200 image into pieces that
# fit the device tool's carry limit (64 MiB a call, working tree included).
#   bash scripts/h200_vllm_pack.sh            # -> .h200/MANIFEST + .h200/vllm026.tar.xz.part-a?
# Then one device call per piece, back to back (a warm machine keeps /tmp between calls):
#   run(carry=[".h200/MANIFEST", ".h200/vllm026.tar.xz.part-aa"], command="bash scripts/h200_vllm_env.sh")
#   ... part-ab ..., then with the last piece the env is unpacked and smoke-tested (README "Real vLLM on a GPU").
# Pinned and hash-checked by scripts/h200_vllm.lock. Idempotent: the same lock gives the same pieces.
set -euo pipefail
cd "$(dirname "$0")/.."
lock=scripts/h200_vllm.lock
cache="${H200_VLLM_CACHE:-$HOME/.cache/verl-true-on-policy/h200-vllm}"
out=.h200
piece=${H200_PIECE_MB:-56}M
want=$( (cat "$lock" "$0") | sha256sum | cut -d' ' -f1)
if [ "$(cat "$out/.stamp" 2>/dev/null)" = "$want" ]; then
    echo "[h200_vllm_pack] $out is up to date:"; cat "$out/MANIFEST"; exit 0
fi
plats=(--platform manylinux1_x86_64 --platform manylinux2014_x86_64)
for n in 17 24 26 27 28 31 34 35; do plats+=(--platform "manylinux_2_${n}_x86_64"); done
echo "[h200_vllm_pack] downloading $(grep -c '^[a-z]' "$lock") pinned wheels (cp312 manylinux) into $cache/wheels"
mkdir -p "$cache/wheels"
python3 -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp "${plats[@]}" --require-hashes -r "$lock" -d "$cache/wheels" 2>&1 \
    | grep -v "^WARNING: Location" || true
# A wheel is its site-packages content: unzipped side by side they are the --target install.
stage="$cache/site"
rm -rf "$stage" && mkdir -p "$stage"
for spec in $(grep -o '^[a-z0-9.-]*==[^ ]*' "$lock"); do
    name=${spec%%==*}; ver=${spec#*==}
    whl=$(ls "$cache/wheels/$(echo "$name" | tr - _)-$ver-"*.whl 2>/dev/null | head -1)
    [ -n "$whl" ] || whl=$(ls "$cache/wheels/$name-$ver-"*.whl | head -1)
    python3 -m zipfile -e "$whl" "$stage"
done
# Not used by a Hopper run of the plugin or of stock vLLM (FA3, Triton fused MoE, cuBLAS):
# Ampere FA2 (305 MB), Blackwell attention and FP8 GEMMs, the Rust front-end binary.
rm -rf "$stage/vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so" "$stage/vllm/third_party/fmha_sm100" \
       "$stage/vllm/third_party/deep_gemm" "$stage/vllm/vllm-rs"
rm -rf "$out" && mkdir -p "$out"
echo "[h200_vllm_pack] $(du -sm "$stage" | cut -f1) MB unpacked; compressing (xz) into $piece pieces"
tar --sort=name --mtime=@0 --owner=0 --group=0 --numeric-owner -C "$stage" -cf - . \
    | xz -T2 -6 | split -b "$piece" - "$out/vllm026.tar.xz.part-"
(cd "$out" && sha256sum vllm026.tar.xz.part-* > MANIFEST)
echo "$want" > "$out/.stamp"
ls -l "$out"
