"""RMSNorm on Triton: whole rows in registers, ROWS rows per program (a function of H).

A row's sum of squares is reduced along its own axis by a tree whose shape depends only
on H (rows per program, block width and warp count are functions of H), so a row's bits
never depend on how many rows the call holds or where in a program it sits. sqrt and
division are IEEE (sqrt_rn, div_rn), never rsqrt.
"""
import torch
import triton
import triton.language as tl

from ..contract import TRITON_TILES
from .autograd import needs_grad
from .common import launch, pdl_enter

_ELEMENTS = TRITON_TILES["rms_norm_elements"]   # elements per program: a row of H >= 2048, else 2048 / H rows


@triton.jit
def _rows_of(M, H, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """This program's ROWS rows x BLOCK columns and their mask."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    return rows[:, None], cols[None, :], (rows < M)[:, None] & (cols < H)[None, :]


@triton.jit
def _row_mean(v, Hf):
    """Per row: sum(v) / H, IEEE division."""
    return tl.div_rn(tl.sum(v, 1), Hf)[:, None]


@triton.jit
def _inv_rms(x, Hf, eps):
    """Per row of fp32 x: 1 / sqrt(sum(x^2) / H + eps), IEEE sqrt and division."""
    return tl.div_rn(1.0, tl.sqrt_rn(_row_mean(x * x, Hf) + eps))


@triton.jit
def _normed(x, inv, w, dtype: tl.constexpr):
    """(x32 * inv) -> dtype, then * weight (fp32 of dtype's) -> dtype: elementwise, so any slice of a
    row (prologue.py's halves) gets the bits of the whole row's."""
    return ((x * inv).to(dtype).to(tl.float32) * w).to(dtype)


@triton.jit
def _rms_norm_kernel(X, Res, W, Y, ResOut, M, H, Hf, eps, stride_x, stride_r, stride_y,
                     HAS_RES: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    pdl_enter(PDL)
    rows, cols, inside = _rows_of(M, H, ROWS, BLOCK)
    x = tl.load(X + rows * stride_x + cols, mask=inside, other=0.0).to(tl.float32)
    if HAS_RES:  # residual' = x + residual, rounded to the activation dtype first
        r = tl.load(Res + rows * stride_r + cols, mask=inside, other=0.0).to(tl.float32)
        xr = (x + r).to(Y.dtype.element_ty)
        tl.store(ResOut + rows * stride_y + cols, xr, mask=inside)
        x = xr.to(tl.float32)
    # var = sum(x32^2) / H; y = (x32 * (1 / sqrt(var + eps))) -> dtype, then * weight in dtype
    inv = _inv_rms(x, Hf, eps)
    w = tl.load(W + cols, mask=cols < H, other=0.0).to(tl.float32)
    tl.store(Y + rows * stride_y + cols, _normed(x, inv, w, Y.dtype.element_ty), mask=inside)


@triton.jit
def _rms_norm_bwd_kernel(X, W, DY, DRes, DX, YHat, M, H, Hf, eps, stride, HAS_DRES: tl.constexpr,
                         ROWS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """dx for rows of y = (x * inv) * w, inv = 1 / sqrt(mean(x^2) + eps), in fp32:
    g = dy * w; dx = inv * (g - n * mean(g * n)), n = x * inv (+ the residual's own gradient
    when the norm was fused with a residual add). Also stores n rounded (for dw)."""
    pdl_enter(PDL)
    rows, cols, inside = _rows_of(M, H, ROWS, BLOCK)
    x = tl.load(X + rows * stride + cols, mask=inside, other=0.0).to(tl.float32)
    inv = _inv_rms(x, Hf, eps)
    n = x * inv
    tl.store(YHat + rows * stride + cols, n.to(YHat.dtype.element_ty), mask=inside)
    g = tl.load(DY + rows * stride + cols, mask=inside, other=0.0).to(tl.float32) * \
        tl.load(W + cols, mask=cols < H, other=0.0).to(tl.float32)
    dx = inv * (g - n * _row_mean(g * n, Hf))
    if HAS_DRES:
        dx = dx + tl.load(DRes + rows * stride + cols, mask=inside, other=0.0).to(tl.float32)
    tl.store(DX + rows * stride + cols, dx.to(DX.dtype.element_ty), mask=inside)


def _shape(h):
    """(rows per program, block, warps): functions of H only (row invariance); short rows
    are packed ROWS to a program (2,048 elements) so that q/k-norm launches few programs."""
    block = triton.next_power_of_2(h)
    rows = max(1, _ELEMENTS // block)
    return rows, block, min(max(rows * block // 512, 1), 8)


def _launch(x, residual, weight, eps):
    h = x.shape[-1]
    x2 = x.reshape(-1, h).contiguous()
    r2 = residual.reshape(-1, h).contiguous() if residual is not None else x2
    y = torch.empty_like(x2)
    r_out = torch.empty_like(x2) if residual is not None else y
    rows, block, warps = _shape(h)
    m = x2.shape[0]
    _rms_norm_kernel[(triton.cdiv(m, rows),)](x2, r2, weight.to(x.dtype), y, r_out, m, h, float(h), float(eps),
                                              x2.stride(0), r2.stride(0), y.stride(0), HAS_RES=residual is not None,
                                              ROWS=rows, BLOCK=block, num_warps=warps, **launch(x2))
    return y.view(x.shape), r_out.view(x.shape)


def _backward(x, weight, dy, dres, eps):
    """(dx, dweight) of rms_norm at input x (the residual sum when fused); dres: the
    gradient reaching the fused residual output, added to dx (None: not fused/unused)."""
    h = x.shape[-1]
    x2, dy2 = x.reshape(-1, h), dy.reshape(-1, h).contiguous()
    dr2 = dres.reshape(-1, h).contiguous() if dres is not None else dy2
    dx, yhat = torch.empty_like(x2), torch.empty_like(x2)
    rows, block, warps = _shape(h)
    m = x2.shape[0]
    if m:
        _rms_norm_bwd_kernel[(triton.cdiv(m, rows),)](x2, weight.to(x.dtype), dy2, dr2, dx, yhat, m, h, float(h),
                                                      float(eps), h, HAS_DRES=dres is not None, ROWS=rows,
                                                      BLOCK=block, num_warps=warps, **launch(x2))
    dw = (dy2.float() * yhat.float()).sum(0).to(weight.dtype)
    return dx.view(x.shape), dw


class _RMSNorm(torch.autograd.Function):
    """Forward: the contract's kernel. Backward: one kernel for dx (+ the residual's
    gradient), a column sum for dweight (deterministic: no atomics)."""

    @staticmethod
    def forward(ctx, x, residual, weight, eps):
        y, r_out = _launch(x, residual, weight, eps)
        ctx.save_for_backward(r_out if residual is not None else x, weight)
        ctx.eps, ctx.fused = eps, residual is not None
        ctx.set_materialize_grads(False)      # an unused output's gradient stays None (no zeros added)
        return (y, r_out) if ctx.fused else y

    @staticmethod
    def backward(ctx, dy, dres=None):
        x, weight = ctx.saved_tensors
        if dy is None:                        # only the residual output was used
            return dres, dres, None, None
        dx, dw = _backward(x.contiguous(), weight, dy, dres, ctx.eps)
        return dx, dx if ctx.fused else None, dw, None


def rms_norm(x, weight, eps):
    if needs_grad(x, weight):
        return _RMSNorm.apply(x, None, weight, eps)
    return _launch(x, None, weight, eps)[0]


def add_rms_norm(x, residual, weight, eps):
    """residual' = x + residual in the activation dtype; returns (rms_norm(residual'), residual')."""
    if residual is None:
        return rms_norm(x, weight, eps), x
    if needs_grad(x, residual, weight):
        return _RMSNorm.apply(x, residual, weight, eps)
    return _launch(x, residual, weight, eps)
