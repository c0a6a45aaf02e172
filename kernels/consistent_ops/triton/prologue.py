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

At a decode step the rollout may pass its paged cache (``cache=(key_cache, value_cache, slot_mapping)``):
k's and v's rows are then stored at their slots, as write_kv_cache stores them (a copy: the same bits),
instead of into new tensors, which saves write_kv_cache's launch a layer.
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
def _out_rows(rows, t, H, live, Slots, s_page, s_pos, s_head, PAGE: tl.constexpr, D: tl.constexpr,
              CACHE: tl.constexpr):
    """Where the rows go and which are stored: contiguous [M, D] rows, or (CACHE) row (t, h) at token
    t's slot of a [pages, PAGE, H, D]-shaped cache (write_kv_cache's addressing; slot -1: padding, not
    stored)."""
    if CACHE:
        slot = tl.load(Slots + t, mask=live, other=-1).to(tl.int64)
        return slot // PAGE * s_page + slot % PAGE * s_pos + rows % H * s_head, live & (slot >= 0)
    else:
        return rows * D, live


@triton.jit
def _norm_rope_rows(X, W, Y, Cos, Sin, program, M, H, stride_t, stride_c, Hf, eps, Slots, s_page, s_pos, s_head,
                    ROWS: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr, CACHE: tl.constexpr):
    """apply_rope(rms_norm(X's rows)) for this program's rows, into Y's rows (_out_rows)."""
    HALF: tl.constexpr = D // 2
    rows, t, start, live = _head_rows(program, M, H, stride_t, ROWS, D)
    out, keep = _out_rows(rows, t, H, live, Slots, s_page, s_pos, s_head, PAGE, D, CACHE)
    x = tl.load(X + start + tl.arange(0, D)[None, :], mask=live, other=0.0).to(tl.float32)
    inv = _inv_rms(x, Hf, eps)       # rms_norm's tile, load and tree
    d = tl.arange(0, HALF)[None, :]
    dtype = Y.dtype.element_ty
    x1 = _normed(tl.load(X + start + d, mask=live, other=0.0).to(tl.float32), inv,
                 tl.load(W + d).to(tl.float32), dtype).to(tl.float32)
    x2 = _normed(tl.load(X + start + HALF + d, mask=live, other=0.0).to(tl.float32), inv,
                 tl.load(W + HALF + d).to(tl.float32), dtype).to(tl.float32)
    y1, y2 = _rotate(x1, x2, tl.load(Cos + t * stride_c + d, mask=live), tl.load(Sin + t * stride_c + d, mask=live))
    tl.store(Y + out + d, y1.to(dtype), mask=keep)
    tl.store(Y + out + HALF + d, y2.to(dtype), mask=keep)


@triton.jit
def _qk_norm_rope_kernel(Q, K, V, QW, KW, QOut, KOut, VOut, Cos, Sin, q_programs, MQ, MKV, HQ, HKV,
                         stride_q, stride_k, stride_v, stride_c, Hf, eps, Slots, sk_page, sk_pos, sk_head,
                         sv_page, sv_pos, sv_head, ROWS: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr = 1,
                         CACHE: tl.constexpr = False, PDL: tl.constexpr = False):
    """CACHE: KOut and VOut are the paged caches (strides s*_page/pos/head), Slots each token's slot."""
    pdl_enter(PDL)
    program = tl.program_id(0)
    if program < q_programs:
        _norm_rope_rows(Q, QW, QOut, Cos, Sin, program, MQ, HQ, stride_q, stride_c, Hf, eps, Slots, 0, 0, 0,
                        ROWS, D, PAGE, False)
    else:       # k's rows, and the same rows of v copied
        program -= q_programs
        _norm_rope_rows(K, KW, KOut, Cos, Sin, program, MKV, HKV, stride_k, stride_c, Hf, eps, Slots, sk_page, sk_pos,
                        sk_head, ROWS, D, PAGE, CACHE)
        rows, t, start, live = _head_rows(program, MKV, HKV, stride_v, ROWS, D)
        out, keep = _out_rows(rows, t, HKV, live, Slots, sv_page, sv_pos, sv_head, PAGE, D, CACHE)
        cols = tl.arange(0, D)[None, :]
        tl.store(VOut + out + cols, tl.load(V + start + cols, mask=keep), mask=keep)


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


def _cache_addressed(k, cache):
    """Whether write_kv_cache's addressing holds for k's rows and this cache: (key_cache, value_cache)
    [pages, page_size, Hkv, D] of k's dtype and heads, contiguous D, and a slot for every token."""
    key_cache, value_cache, slots = cache
    return (all(c.dim() == 4 and c.shape[1:] == key_cache.shape[1:] and c.shape[2:] == k.shape[1:]
                and c.dtype == k.dtype and c.stride(3) == 1 and c.device == k.device for c in (key_cache, value_cache))
            and slots.dim() == 1 and slots.shape[0] >= k.shape[0])


def qk_norm_rope(q, k, v, q_norm, k_norm, eps, cos, sin, cache=None):
    """consistent_ops.qk_norm_rope in one launch where _addressed and no gradient is needed (the same
    bits as rms_norm then apply_rope, and v.contiguous()); None elsewhere (the caller runs those).
    cache=(key_cache, value_cache, slot_mapping): k's and v's rows stored there, as write_kv_cache
    stores them, and (q, None, None) returned."""
    if not _addressed(q, k, v, cos, sin) or needs_grad(q, k, v, q_norm, k_norm):
        return None
    if cache is not None and not _cache_addressed(k, cache):
        return None
    (t, hq, d), hkv = q.shape, k.shape[1]
    rows, block, warps = _shape(d)
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if cache is None:
        k_out, v_out = (torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in (k, v))
        slots, strides, page = q_out, (0,) * 6, 1       # slots: unread
    else:
        k_out, v_out, slots = cache
        slots = slots[:t].contiguous()
        strides, page = (*k_out.stride()[:3], *v_out.stride()[:3]), k_out.shape[1]
    cos, sin = cos.contiguous(), sin.contiguous()
    q_programs = triton.cdiv(t * hq, rows)
    _qk_norm_rope_kernel[(q_programs + triton.cdiv(t * hkv, rows),)](
        q, k, v, q_norm.to(q.dtype), k_norm.to(k.dtype), q_out, k_out, v_out, cos, sin, q_programs, t * hq, t * hkv,
        hq, hkv, q.stride(0), k.stride(0), v.stride(0), cos.stride(0), float(d), float(eps), slots, *strides,
        ROWS=rows, D=block, PAGE=page, CACHE=cache is not None, num_warps=warps, **launch(q))
    return (q_out, k_out, v_out) if cache is None else (q_out, None, None)
