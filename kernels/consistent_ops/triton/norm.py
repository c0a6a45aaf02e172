"""RMSNorm on Triton: one row per program, the whole row in registers.

A row's sum of squares is reduced by a tree whose shape depends only on H (the block
width and warp count are functions of H), so a row's bits never depend on how many
rows the call holds. sqrt and division are IEEE (sqrt_rn, div_rn), never rsqrt.
"""
import torch
import triton
import triton.language as tl

from .autograd import with_torch_grad
from .common import EXACT, SCALAR_DIV_RN


@triton.jit
def _rms_norm_kernel(X, Res, W, Y, ResOut, H, Hf, eps, stride_x, stride_r, stride_y,
                     HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    inside = cols < H
    x = tl.load(X + row * stride_x + cols, mask=inside, other=0.0).to(tl.float32)
    if HAS_RES:  # residual' = x + residual, rounded to the activation dtype first
        r = tl.load(Res + row * stride_r + cols, mask=inside, other=0.0).to(tl.float32)
        xr = (x + r).to(Y.dtype.element_ty)
        tl.store(ResOut + row * stride_y + cols, xr, mask=inside)
        x = xr.to(tl.float32)
    # var = sum(x32^2) / H; y = (x32 * (1 / sqrt(var + eps))) -> dtype, then * weight in dtype
    if SCALAR_DIV_RN:
        var = tl.div_rn(tl.sum(x * x, 0), Hf)
    else:  # triton-ascend: the same quotients on a [1]-shaped row sum (see common.SCALAR_DIV_RN)
        var = tl.div_rn(tl.sum((x * x)[None, :], 1), Hf)
    inv = tl.div_rn(1.0, tl.sqrt_rn(var + eps))
    y = (x * inv).to(Y.dtype.element_ty).to(tl.float32)
    w = tl.load(W + cols, mask=inside, other=0.0).to(tl.float32)
    tl.store(Y + row * stride_y + cols, (y * w).to(Y.dtype.element_ty), mask=inside)


def _launch(x, residual, weight, eps):
    h = x.shape[-1]
    x2 = x.reshape(-1, h).contiguous()
    r2 = residual.reshape(-1, h).contiguous() if residual is not None else x2
    y = torch.empty_like(x2)
    r_out = torch.empty_like(x2) if residual is not None else y
    block = triton.next_power_of_2(h)
    warps = min(max(block // 512, 1), 8)    # a function of H only (row invariance)
    _rms_norm_kernel[(x2.shape[0],)](x2, r2, weight.to(x.dtype), y, r_out, h, float(h), float(eps),
                                     x2.stride(0), r2.stride(0), y.stride(0),
                                     HAS_RES=residual is not None, BLOCK=block, num_warps=warps, **EXACT)
    return y.view(x.shape), r_out.view(x.shape)


def _rms_kernel(x, weight, eps):
    return _launch(x, None, weight, eps)[0]


def _add_rms_kernel(x, residual, weight, eps):
    return _launch(x, residual, weight, eps)


def _rms_formula(x, weight, eps):
    """Differentiable fp32 equivalent for the backward."""
    x32 = x.float()
    y = (x32 / torch.sqrt(x32.square().mean(-1, keepdim=True) + eps)).to(x.dtype)
    return y * weight.to(x.dtype)


def _add_rms_formula(x, residual, weight, eps):
    residual = x + residual
    return _rms_formula(residual, weight, eps), residual


def rms_norm(x, weight, eps):
    return with_torch_grad(_rms_kernel, _rms_formula, (x, weight), eps=eps)


def add_rms_norm(x, residual, weight, eps):
    """residual' = x + residual in the activation dtype; returns (rms_norm(residual'), residual')."""
    if residual is None:
        return rms_norm(x, weight, eps), x
    return with_torch_grad(_add_rms_kernel, _add_rms_formula, (x, residual, weight), eps=eps)
