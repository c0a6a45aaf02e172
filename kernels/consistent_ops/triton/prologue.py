"""The attention prologue after the rollout's one q/k/v GEMM in one launch: q and k per-head RMSNorm
then RoPE, and v's copy, read from the GEMM output's column blocks in place (rms_norm's two copies, two
norms, two ropes and v's copy were ~8 launches a layer, at decode batch 1 longer than reading the weights).

The bits are rms_norm's then apply_rope's. A head's sum of squares is reduced on the tile rms_norm
takes for H = head_dim (norm._shape: rows a program, block, warps), loaded as rms_norm loads a row, so
on the same layout and by the same tree (tests/test_triton_layouts.py reads both layouts from the sm_90
compiler's output), through the same helpers (_inv_rms, _normed: rounded to the activation dtype where
rms_norm rounds); the rotation is rope's _rotate on the rounded halves, which are reloaded (L1) and
normalised elementwise rather than permuted in registers. Rollout inference only (no autograd): the
trainer runs the separate ops.
"""
import torch
import triton
import triton.language as tl

from .common import launch, pdl_enter
from .autograd import needs_grad
from .norm import _inv_rms, _normed, _shape
from .rope import _rotate


@triton.jit
def _head_rows(program, M, H, stride_t, ROWS: tl.constexpr, D: tl.constexpr):
    """This program's ROWS of the M = T * H (token, head) rows: row index, token, the row's start in
    a [T, H, D] tensor whose heads are adjacent (row (t, h) at t * stride_t + h * D) and the mask."""
    rows = program.to(tl.int64) * ROWS + tl.arange(0, ROWS)
    t = rows // H
    return rows[:, None], t[:, None], (t * stride_t + (rows % H) * D)[:, None], (rows < M)[:, None]


@triton.jit
def _norm_rope_rows(X, W, Y, Cos, Sin, program, M, H, stride_t, stride_c, Hf, eps,
                    ROWS: tl.constexpr, D: tl.constexpr):
    """Y (contiguous [M, D]) = apply_rope(rms_norm(X's rows)) for this program's rows."""
    HALF: tl.constexpr = D // 2
    rows, t, start, live = _head_rows(program, M, H, stride_t, ROWS, D)
    x = tl.load(X + start + tl.arange(0, D)[None, :], mask=live, other=0.0).to(tl.float32)
    inv = _inv_rms(x, Hf, eps)       # rms_norm's tile, load and tree
    d = tl.arange(0, HALF)[None, :]
    dtype = Y.dtype.element_ty
    x1 = _normed(tl.load(X + start + d, mask=live, other=0.0).to(tl.float32), inv,
                 tl.load(W + d).to(tl.float32), dtype).to(tl.float32)
    x2 = _normed(tl.load(X + start + HALF + d, mask=live, other=0.0).to(tl.float32), inv,
                 tl.load(W + HALF + d).to(tl.float32), dtype).to(tl.float32)
    y1, y2 = _rotate(x1, x2, tl.load(Cos + t * stride_c + d, mask=live), tl.load(Sin + t * stride_c + d, mask=live))
    tl.store(Y + rows * D + d, y1.to(dtype), mask=live)
    tl.store(Y + rows * D + HALF + d, y2.to(dtype), mask=live)


@triton.jit
def _qk_norm_rope_kernel(Q, K, V, QW, KW, QOut, KOut, VOut, Cos, Sin, q_programs, MQ, MKV, HQ, HKV,
                         stride_q, stride_k, stride_v, stride_c, Hf, eps, ROWS: tl.constexpr, D: tl.constexpr,
                         PDL: tl.constexpr = False):
    pdl_enter(PDL)
    program = tl.program_id(0)
    if program < q_programs:
        _norm_rope_rows(Q, QW, QOut, Cos, Sin, program, MQ, HQ, stride_q, stride_c, Hf, eps, ROWS, D)
    else:       # k's rows, and the same rows of v copied
        program -= q_programs
        _norm_rope_rows(K, KW, KOut, Cos, Sin, program, MKV, HKV, stride_k, stride_c, Hf, eps, ROWS, D)
        rows, _, start, live = _head_rows(program, MKV, HKV, stride_v, ROWS, D)
        cols = tl.arange(0, D)[None, :]
        tl.store(VOut + rows * D + cols, tl.load(V + start + cols, mask=live), mask=live)


def _addressed(q, k, v, cos, sin):
    """Whether the kernel addresses these: q [T, Hq, D], k and v [T, Hkv, D] with adjacent heads
    (strides (any, D, 1)), D a power of two >= 16 (rms_norm's block is then D: no column mask);
    cos/sin [T, D/2]."""
    if q.dim() != 3 or k.dim() != 3:
        return False
    t, _, d = q.shape
    if not t or d < 16 or d & (d - 1) or k.shape != v.shape or cos.shape != (t, d // 2) or sin.shape != cos.shape:
        return False
    return all(x.shape[0] == t and x.shape[2] == d and x.stride(2) == 1 and x.stride(1) == d for x in (q, k, v))


def qk_norm_rope(q, k, v, q_norm, k_norm, eps, cos, sin):
    """consistent_ops.qk_norm_rope in one launch where _addressed and no gradient is needed (the same
    bits as rms_norm then apply_rope, and v.contiguous()); None elsewhere (the caller runs those)."""
    if not _addressed(q, k, v, cos, sin) or needs_grad(q, k, v, q_norm, k_norm):
        return None
    (t, hq, d), hkv = q.shape, k.shape[1]
    rows, block, warps = _shape(d)
    outs = [torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in (q, k, v)]
    cos, sin = cos.contiguous(), sin.contiguous()
    q_programs = triton.cdiv(t * hq, rows)
    _qk_norm_rope_kernel[(q_programs + triton.cdiv(t * hkv, rows),)](
        q, k, v, q_norm.to(q.dtype), k_norm.to(k.dtype), *outs, cos, sin, q_programs, t * hq, t * hkv, hq, hkv,
        q.stride(0), k.stride(0), v.stride(0), cos.stride(0), float(d), float(eps), ROWS=rows, D=block,
        num_warps=warps, **launch(q))
    return tuple(outs)
