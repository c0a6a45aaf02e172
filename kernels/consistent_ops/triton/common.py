"""Launch options shared by every kernel of this backend, and the portability switches.

The kernels are ONE source for CUDA (upstream Triton) and Ascend NPUs (triton-ascend,
which the ascend backend launches). The few constructs triton-ascend lacks sit behind
module-level ``tl.constexpr`` switches set from the installed compiler, so a CUDA build
compiles exactly the code it always did and triton-ascend compiles the alternative.
"""
import importlib.util
import os

import triton
import triton.language as tl

# Arithmetic compiles as written: no FMA contraction (a*b+c rounded once), so every
# compiled variant of a kernel (paged or not, 64 or 128 rows) rounds the contract's
# expression at the same steps.
EXACT = dict(enable_fp_fusion=False)

# CPU interpreter (TRITON_INTERPRET=1, CI): tl.dot is a numpy matmul whose rounding may
# depend on the block shape, so shape choices that are free on tensor cores are pinned.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

# The installed Triton is triton-ascend (its backend package is "ascend"): Ascend A2/A3.
ASCEND = importlib.util.find_spec("triton.backends.ascend") is not None
# Contract transcendentals in fp64 (exp/log of fp32 evaluated in fp64, rounded once); the
# Ascend A2/A3 cores have no fp64, so there they are fp32 (contract.ACCUMULATION["ascend"]).
FP64_TRANSCENDENTALS = tl.constexpr(not ASCEND)
# IEEE division of 0-d values as tl.div_rn: triton-ascend's adapter aborts on it (and on
# splats of them), so there the kernels take the same IEEE quotient on [1]-shaped tensors.
SCALAR_DIV_RN = tl.constexpr(not ASCEND)
# input_precision of tl.dot on bf16/fp16 operands: any value gives exact products there;
# triton-ascend rejects "tf32" (it takes "ieee" or "hf32").
HALF_DOT_PRECISION = "ieee" if ASCEND else "tf32"


@triton.jit
def exp32(x):
    """The contract's exp of fp32 x (see FP64_TRANSCENDENTALS)."""
    if FP64_TRANSCENDENTALS:
        return tl.exp(x.to(tl.float64)).to(tl.float32)
    else:
        return tl.exp(x)


@triton.jit
def log32(x):
    """The contract's log of fp32 x (see FP64_TRANSCENDENTALS)."""
    if FP64_TRANSCENDENTALS:
        return tl.log(x.to(tl.float64)).to(tl.float32)
    else:
        return tl.log(x)
