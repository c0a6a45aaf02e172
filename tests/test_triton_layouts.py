"""The layout a Triton reduction runs on decides its tree, so its bits: the fused attention prologue
(triton/prologue.py) reduces a head's sum of squares on the layout rms_norm's kernel reduces it on,
read from the installed Triton's output for the H200 (sm_90), compiled on the CPU (no GPU needed)."""
import re

import pytest

triton = pytest.importorskip("triton")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from consistent_ops.triton import norm, prologue  # noqa: E402
from consistent_ops.triton.common import EXACT  # noqa: E402

H200 = GPUTarget("cuda", 90, 32)
RMS_STRIDES = {"H", "stride_x", "stride_r", "stride_y"}       # H = D and its contiguous rows: multiples of 16
TOKEN_STRIDES = {"stride_q", "stride_k", "stride_v", "stride_c"}


RMS_TENSORS = ("X", "Res", "W", "Y", "ResOut")
PROLOGUE_TENSORS = ("Q", "K", "V", "QW", "KW", "QOut", "KOut", "VOut")


def compile_h200(kernel, types, constexprs, divisible, **options):
    """kernel compiled for the H200 down to its cubin (Triton's own ptxas); types: argument -> Triton
    type, "i32" unless named; divisible: the integer arguments the launcher marks divisible by 16
    (pointers: always, fresh or 16-byte aligned tensors)."""
    sig, attrs = {}, {}
    for i, p in enumerate(kernel.params):
        sig[p.name] = "constexpr" if p.is_constexpr else types.get(p.name, "i32")
        if sig[p.name].startswith("*") or p.name in divisible:
            attrs[(i,)] = [["tt.divisibility", 16]]
    return triton.compile(ASTSource(kernel, sig, constexprs, attrs), target=H200, options=dict(**options, **EXACT))


def reduce_layouts(kernel, tensors, dtype, constexprs, divisible, num_warps):
    """[(shape, layout)] of kernel's tt.reduce operands compiled for the H200; tensors: the arguments
    of the activation dtype (Cos/Sin: fp32, Hf and eps: fp32 scalars)."""
    types = {"Hf": "fp32", "eps": "fp32", "Cos": "*fp32", "Sin": "*fp32", **{t: "*" + dtype for t in tensors}}
    ir = compile_h200(kernel, types, constexprs, divisible, num_warps=num_warps).asm["ttgir"]
    layouts = dict(re.findall(r"^(#\w+) = #ttg\.blocked<(.*)>$", ir, re.M))
    operands = re.findall(r'"tt\.reduce".*?\}\) : \(tensor<(\w+), (#\w+)>', ir, re.S)
    return [(shape, layouts[enc]) for shape, enc in operands]


def rms_norm_layout(d, dtype):
    rows, block, warps = norm._shape(d)
    found = reduce_layouts(norm._rms_norm_kernel, RMS_TENSORS, dtype, {"HAS_RES": False, "ROWS": rows, "BLOCK": block},
                           RMS_STRIDES, warps)
    assert len(found) == 1
    return found[0]


@pytest.mark.parametrize("d, dtype, aligned", [(128, "bf16", True), (128, "bf16", False), (64, "bf16", True),
                                               (16, "bf16", True), (256, "bf16", True), (4096, "bf16", True),
                                               (128, "fp32", True), (64, "fp16", True)])
def test_prologue_reduces_on_the_rms_norm_layout(d, dtype, aligned):
    """q's and k's sums of squares, for token strides that are multiples of 16 (the GEMM output's
    column blocks) or not."""
    rows, block, warps = norm._shape(d)
    fused = reduce_layouts(prologue._qk_norm_rope_kernel, PROLOGUE_TENSORS, dtype, {"ROWS": rows, "D": block},
                           TOKEN_STRIDES if aligned else set(), warps)
    assert fused == [rms_norm_layout(d, dtype)] * 2


def test_one_head_a_program_reduces_on_another_layout():
    """Non-vacuous: the obvious tiling (one head a program, same warps) reduces on another layout,
    across warps (another tree)."""
    _, block, warps = norm._shape(128)
    one = reduce_layouts(prologue._qk_norm_rope_kernel, PROLOGUE_TENSORS, "bf16", {"ROWS": 1, "D": block},
                         TOKEN_STRIDES, warps)
    assert one[0] != rms_norm_layout(128, "bf16") and "warpsPerCTA = [1, 4]" in one[0][1]


ATTN_TYPES = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "O": "*bf16", "LSE": "*fp32", "WAcc": "*fp32", "WML": "*fp32",
              "Count": "*i32", "QStart": "*i32", "SeqLen": "*i32", "Table": "*i32", "qk_scale": "fp32"}


@pytest.mark.parametrize("paged, split", [(True, True), (True, False), (False, False)],
                         ids=["decode-split", "paged", "training"])
def test_attention_forward_compiles_for_the_h200(paged, split):
    """The forward kernel in its launch forms, compiled for sm_90 to a cubin on the CPU: what the
    interpreter accepts and the GPU would not (a plain global read in a kernel, a type error) fails
    here, before a device session (it did, 2026-12-04)."""
    from consistent_ops.contract import KV_BLOCK, KV_CHUNK
    from consistent_ops.triton import attention as ta
    rows, warps, stages = ta._TILE[0], ta._TILE[1], ta._STAGES
    const = dict(G=8, TPT=rows // 8, ROWS=rows, D=128, KV=KV_BLOCK, CHUNK=KV_CHUNK, PAGE=16 if paged else 1,
                 PAGED=paged, STORE_LSE=not paged, SB=16, TMA=False, SPLIT=split)
    assert compile_h200(ta._attn_fwd_kernel, ATTN_TYPES, const, set(), num_warps=warps, num_stages=stages).asm["cubin"]
