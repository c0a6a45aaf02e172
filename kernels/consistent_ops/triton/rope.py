"""RoPE on Triton: the contract's neox rotation in one kernel (the torch form is ~10 launches).

y1 = x1*cos - x2*sin, y2 = x2*cos + x1*sin in fp32, each product and sum rounded on its own
(no FMA: EXACT), then rounded to x's dtype: the same operations, in the same order, as the
reference's torch ops, so the bits are theirs. cos/sin [T, D/2] fp32 come from rope_cos_sin
(per position). Gradients: the same kernel rotating back (training only).
"""
import torch
import triton
import triton.language as tl

from ..reference.pointwise import apply_rope as _apply_rope_torch
from .common import launch, pdl_enter


@triton.jit
def _rotate(x1, x2, c, s):
    """fp32 halves (x1, x2) rotated: (x1*c - x2*s, x2*c + x1*s), each product and sum rounded (EXACT)."""
    return x1 * c - x2 * s, x2 * c + x1 * s


@triton.jit
def _rope_kernel(X, Cos, Sin, Y, H, stride_xt, stride_xh, stride_yt, stride_yh, stride_c,
                 HB: tl.constexpr, HALF: tl.constexpr, PDL: tl.constexpr = False):
    pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * HB + tl.arange(0, HB)
    d = tl.arange(0, HALF)
    live = (h < H)[:, None]
    x = X + t * stride_xt + h[:, None] * stride_xh + d[None, :]
    x1 = tl.load(x, mask=live).to(tl.float32)
    x2 = tl.load(x + HALF, mask=live).to(tl.float32)
    c = tl.load(Cos + t * stride_c + d)[None, :]
    s = tl.load(Sin + t * stride_c + d)[None, :]
    y = Y + t * stride_yt + h[:, None] * stride_yh + d[None, :]
    y1, y2 = _rotate(x1, x2, c, s)
    tl.store(y, y1.to(Y.dtype.element_ty), mask=live)
    tl.store(y + HALF, y2.to(Y.dtype.element_ty), mask=live)


def _rope(x, cos, sin):
    t, h, d = x.shape
    if not t or x.stride(-1) != 1 or d & (d - 1):
        return _apply_rope_torch(x, cos, sin)      # layouts the kernel does not address: the same ops
    y = torch.empty_like(x)
    cos, sin = cos.contiguous(), sin.contiguous()
    hb = min(triton.next_power_of_2(h), 16)
    _rope_kernel[(t, triton.cdiv(h, hb))](x, cos, sin, y, h, x.stride(0), x.stride(1), y.stride(0), y.stride(1),
                                          cos.stride(0), HB=hb, HALF=d // 2, num_warps=4, **launch(x))
    return y


class _Rope(torch.autograd.Function):
    """The rotation's transpose is the rotation by -angle: dx = the same kernel on dy with
    -sin (dx1 = dy1*cos + dy2*sin, dx2 = dy2*cos - dy1*sin), fp32, rounded to x's dtype."""

    @staticmethod
    def forward(ctx, x, cos, sin):
        ctx.save_for_backward(cos, sin)
        return _rope(x, cos, sin)

    @staticmethod
    def backward(ctx, dy):
        cos, sin = ctx.saved_tensors
        return _rope(dy.contiguous(), cos, -sin), None, None


def apply_rope(x, cos, sin):
    """Neox rotate-half on x [T, H, D] in fp32, rounded to x's dtype."""
    if torch.is_grad_enabled() and x.requires_grad:
        return _Rope.apply(x, cos, sin)
    return _rope(x, cos, sin)
