#!/usr/bin/env bash
# Here, without device time: pack the wheels of a lock (default vLLM 0.26.0 and what it needs on
# the H200 image) into pieces that fit the device tool's carry limit (64 MiB a call, tree included).
#   bash scripts/h200_vllm_pack.sh                          # -> .h200/vllm026.tar.xz.part-a? + MANIFEST
#   bash scripts/h200_vllm_pack.sh scripts/h200_verl.lock   # -> .h200/verl091.tar.xz.part-a? (verl 0.9.1)
# A lock's `# pack: NAME` names its pieces, `# trim: PATH...` drops unused files from it. MANIFEST
# lists the sha256 of every pack's pieces in .h200/. Then one device call per piece, back to back
# (a warm machine keeps /tmp between calls), each carrying MANIFEST too:
#   run(carry=[".h200/MANIFEST", ".h200/vllm026.tar.xz.part-aa"], command="bash scripts/h200_vllm_env.sh")
#   ... part-ab ..., then with the last piece the env is unpacked and smoke-tested (README "Real vLLM on a GPU").
# Pinned and hash-checked by the lock. Idempotent: the same lock gives the same pieces.
set -euo pipefail
cd "$(dirname "$0")/.."
out=.h200
piece=${H200_PIECE_MB:-56}M
cache="${H200_VLLM_CACHE:-$HOME/.cache/verl-true-on-policy/h200-vllm}"
plats=(--platform manylinux1_x86_64 --platform manylinux2014_x86_64)
for n in 17 24 26 27 28 31 34 35; do plats+=(--platform "manylinux_2_${n}_x86_64"); done
mkdir -p "$out" "$cache/wheels" "$cache/built"

first() {   # dir name version -> its wheel (file names spell the name with _ or -), or nothing
    local f
    for f in "$1/$(echo "$2" | tr - _)-$3-"*.whl "$1/$2-$3-"*.whl; do [ -f "$f" ] && { echo "$f"; return; }; done
    return 0
}

pack_lock() {   # lock file -> $out/<pack>.tar.xz.part-*
    local lock=$1 pack trim want stage spec name ver whl
    pack=$(sed -n 's/^# pack: *//p' "$lock")
    trim=$(sed -n 's/^# trim: *//p' "$lock")
    [ -n "$pack" ] || { echo "error: $lock has no '# pack: NAME' line" >&2; return 2; }
    want=$( (cat "$lock" "$0") | sha256sum | cut -d' ' -f1)
    if [ "$(cat "$out/.stamp-$pack" 2>/dev/null)" = "$want" ]; then
        echo "[h200_vllm_pack] $pack is up to date"; return 0
    fi
    echo "[h200_vllm_pack] $pack: downloading $(grep -c '^[a-z]' "$lock") pinned distributions (cp312 manylinux) into $cache/wheels"
    python3 -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp "${plats[@]}" --require-hashes -r "$lock" -d "$cache/wheels" 2>&1 \
        | grep -v "^WARNING: Location" || true
    # A wheel is its site-packages content: unzipped side by side they are the --target install.
    stage="$cache/site-$pack"
    rm -rf "$stage" && mkdir -p "$stage"
    for spec in $(grep -o '^[a-z0-9.-]*==[^ ]*' "$lock"); do
        name=${spec%%==*}; ver=${spec#*==}
        whl=$(first "$cache/wheels" "$name" "$ver")
        if [ -z "$whl" ]; then   # a pure-Python sdist (the lock's --no-binary): build its wheel here
            python3 -m pip wheel -q --disable-pip-version-check --no-deps -w "$cache/built" "$cache/wheels/$name-$ver.tar.gz"
            whl=$(first "$cache/built" "$name" "$ver")
        fi
        unzip -qo "$whl" -d "$stage"   # keeps the wheel's file modes, as pip does (Ray's raylet, gcs_server)
    done
    for p in $trim; do rm -rf "${stage:?}/$p"; done
    echo "[h200_vllm_pack] $pack: $(du -sm "$stage" | cut -f1) MB unpacked; compressing (xz) into $piece pieces"
    rm -f "$out/$pack".tar.xz.part-*
    tar --sort=name --mtime=@0 --owner=0 --group=0 --numeric-owner -C "$stage" -cf - . \
        | xz -T2 -6 | split -b "$piece" - "$out/$pack.tar.xz.part-"
    echo "$want" > "$out/.stamp-$pack"
}

for lock in "${@:-scripts/h200_vllm.lock}"; do pack_lock "$lock"; done
rm -f "$out/.stamp"   # the single-pack stamp of before
(cd "$out" && sha256sum *.tar.xz.part-* > MANIFEST)
cat "$out/MANIFEST" && ls -l "$out"
