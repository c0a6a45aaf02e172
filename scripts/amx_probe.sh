#!/usr/bin/env bash
# Issue 30: which order and rounding does AMX's TDPBF16PS use? Builds
# kernels/consistent_ops/reference/amx_probe.c (its header lists the candidate orders) into a temp
# dir and runs it, arguments passed through. Needs nothing but a C compiler (the H200 image has
# gcc 13.3), so on the device machine, whose host Xeon has amx_bf16:
#   run(command="bash scripts/amx_probe.sh")                          # ~3 s; exit 0: one candidate fits
#   run(command="bash scripts/amx_probe.sh --dump $OUT/amx_probe.bin") # + every tile and result back
# Here (no AMX): `bash scripts/amx_probe.sh --self-test` (the candidates tell themselves apart), and a
# plain run prints one line and exits 3. Other flags: --runs N, --seed S, --emulate a-i (a candidate
# stands in for the instruction). Exit: the probe's (0 one candidate matched every output, 1 none or
# several, 2 setup, 3 no AMX), or the compiler's.
set -euo pipefail
cd "$(dirname "$0")/.."
echo "cpu: $(grep -m1 '^model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//')"
flags=$(grep -m1 '^flags' /proc/cpuinfo | tr ' ' '\n' | grep -E '^(amx_|avx512_bf16$)' | tr '\n' ' ' || true)
echo "flags: ${flags:-(no amx_*, no avx512_bf16)}"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# -ffp-contract=off: the emulations' multiplies and adds stay separate IEEE ops (fmaf is explicit);
# x86-64-v2: no AVX-512 needed, so --self-test runs on any x86-64 CPU.
cc=${CC:-$(command -v cc || command -v gcc || echo cc)}
$cc -O2 -ffp-contract=off -march=x86-64-v2 -mamx-tile -mamx-bf16 \
    -o "$tmp/amx_probe" kernels/consistent_ops/reference/amx_probe.c -lm
"$tmp/amx_probe" "$@"
