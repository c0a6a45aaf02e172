"""Batch-invariant linear on Triton, and its tensor-parallel row-parallel form.

out[m, n] is one fp32 accumulator carried through K in tiles walked in order (no
split-K, no stream-K; matmul's chunk= probes a fixed split of K, not the contract), rounded once. The MMA computes each output element from its
own row and column only, so a row's bits never depend on M or on the other rows.
The tile shape is picked by M and by the program count for speed: on the H200 every
shape tried (BLOCK_M 16..256, BLOCK_N 16..256, BLOCK_K 64..256, 4/8 warps, 3..8 stages,
pointer or TMA loads) gave bit-identical results, because all of them run the same k16
MMA steps in the same order; the GPU tests check it across every switch point and for
every entry (row of M=1 == row of M=4096).
"""
import torch
import triton
import triton.language as tl

from ..contract import TRITON_TILES
from .common import (ASCEND as _ASCEND, HALF_DOT_PRECISION, INTERPRET as _INTERPRET, arrival_counters,
                     hopper_or_newer, last_to_arrive, launch, pdl_enter)

# Tile by M and by the number of programs (the grid has to fill the 132 SMs without
# splitting K). Each entry (contract.TRITON_TILES["gemm"]): (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M,
# warps, stages, TMA).
# Every entry walks K in BLOCK_K steps of k16 MMAs in ascending order into one fp32
# accumulator; on the H200 all of them gave bit-identical rows (bench_triton.py --only
# probe checks each entry against the others at M 1..4096; tests/gpu check rows across
# every switch point). Picked from that probe (qkv and o_proj shapes, graph replays).
_T = TRITON_TILES["gemm"]
_TINY = _T["tiny"]              # M <= 16: mma 16-row tiles, no padded rows read
# H200 (bench_triton --only probe_linear_decode, M 1 / 4 / 16, graph replays, 2026-12-03): qkv
# N 5120 "mid" 6.9 / 6.9 / 6.4 us (cuBLAS 6.4 / 6.2 / 5.5; the 64-column tile with K steps of 128
# before: 11.0 / 7.7 / 7.4), o_proj N 2048 "narrow" 9.4 / 9.3 / 9.0 (cuBLAS 7.4 / 7.1 / 6.8; a
# 64-row tile before: 29.7 / 18.9 / 9.3), router N 128 5.4 (5.6-5.8 before); lm_head N 151,936
# keeps "wide" (144-151 us, cuBLAS 150-154). Bits the same as the tile before in every case.
# 2026-12-04: the probe preferred "narrow" by pointer loads (o_proj 7.7 vs 9.4 us at M 4, router 4.6
# vs 5.4) and "wide" by TMA (lm_head 140 vs 156 at M 1), but in the 48-layer B=1 step the GEMMs
# then averaged 9.5 us a launch against 8.9: kept as they are.
_TINY_WIDE_N, _TINY_MID_N = 16384, 4096
_NARROW = _T["narrow"]          # M <= 128: the widest BLOCK_N that still gives >= _MIN_PROGRAMS programs
# H200 (probe_linear_mid, 2026-12-06): qkv M=64 (64, 64, 128, 1, 4, 4) 9.6 / 6.5 us cold / warm against
# (64, 64, 64, 1, 4, 6) 10.0 / 7.4 (cuBLAS 8.7 / 6.2), the same bits: the 64-column entry since.
_PINNED = _T["pinned"]
# M <= 512: the narrowest that fits one wave. H200 (bench_triton --only probe_linear_mid, cold as in a
# step, 2026-12-06): o_proj M 256 "mid_narrow" 14.2 us, "mid_wide" 19.7 (cuBLAS 10.8); the same bits.
# H100 (the same probe, 2026-12-07): qkv M 256 "mid_square" 13.3 / 16.0 us warm / cold (one wave of 80
# programs, 6 stages to hide the cold weight reads), "mid_tall" 13.7 / 17.9 (cuBLAS 11.9 / 14.2); the same bits.
_MID_NARROW, _MID_WIDE, _MID_SQUARE, _MID_TALL = _T["mid_narrow"], _T["mid_wide"], _T["mid_square"], _T["mid_tall"]
_LARGE = _T["large"]
_HUGE = _T["huge"]              # once it gives >= 2 waves of programs
_MIN_PROGRAMS, _SMS = 72, 132
_SMEM = 200 * 1024       # operand pipeline budget per program (the H200 gives a block up to 227 KB)


def _programs(m, n, cfg):
    return triton.cdiv(m, cfg[0]) * triton.cdiv(n, cfg[1])


def _config(m, n):
    if _INTERPRET or _ASCEND:   # one tile for all M: the CPU interpreter's numpy dots of other
        return _PINNED          # shapes round differently; Ascend's cube order across shapes is undocumented
    if m <= 16:   # the decode tail: weight-streaming, so many short programs (probe_linear_decode)
        return _TINY["wide"] if n >= _TINY_WIDE_N else _TINY["mid"] if n >= _TINY_MID_N else _TINY["narrow"]
    # the lm_head from M 65 (H200, probe_linear lm_head, 2026-12-03, cuBLAS / ours at M 128 / 256 / 512):
    # "large" 0.91 at 128, "huge" 0.86 / 0.90 at 256 / 512, where the M <= 512 tiles gave 0.73 / 0.70 / 0.71
    if n >= _TINY_WIDE_N and m > 64:
        return _LARGE if m <= 128 else _HUGE
    if m <= 128:
        return next((c for c in _NARROW.values() if _programs(m, n, c) >= _MIN_PROGRAMS), _NARROW[16])
    if m <= 512:
        return next((c for c in (_MID_NARROW, _MID_WIDE, _MID_SQUARE) if _programs(m, n, c) <= _SMS), _MID_TALL)
    return _HUGE if _programs(m, n, _HUGE) >= 2 * _SMS else _LARGE


@triton.jit
def _tile_of(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(row tile, col tile) of a program; GROUP_M row tiles in a row share W tiles in L2."""
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    group = pid // (GROUP_M * num_n)
    first_m = group * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    return first_m + (pid % (GROUP_M * num_n)) % size_m, (pid % (GROUP_M * num_n)) // size_m


@triton.jit
def _epilogue(acc, Bias, Y, rm, rn, M, N, stride_ym, HAS_BIAS: tl.constexpr):
    """Bias in fp32, one rounding to the output dtype, store the in-range part."""
    if HAS_BIAS:
        acc += tl.load(Bias + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    tl.store(Y + rm.to(tl.int64)[:, None] * stride_ym + rn[None, :], acc.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _chain(X, W, pid_m, pid_n, xm, wn, k_lo, k_hi, K, stride_xm, stride_wn, EVEN_K: tl.constexpr,
           PRECISION: tl.constexpr, TMA: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
           BLOCK_K: tl.constexpr):
    """K from k_lo to k_hi walked in order into one fp32 accumulator, from zero."""
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        kk = k0 + rk
        if TMA:  # CUDA-ONLY: X, W are host TensorDescriptors (Hopper bulk copies, zero-filled edges)
            a = X.load([pid_m * BLOCK_M, k0])
            b = W.load([pid_n * BLOCK_N, k0]).T
        elif EVEN_K:
            a = tl.load(X + xm[:, None] * stride_xm + kk[None, :])
            b = tl.load(W + wn[None, :] * stride_wn + kk[:, None])
        else:  # zero-padded tail: zero products leave the accumulator unchanged
            a = tl.load(X + xm[:, None] * stride_xm + kk[None, :], mask=kk[None, :] < K, other=0.0)
            b = tl.load(W + wn[None, :] * stride_wn + kk[:, None], mask=kk[:, None] < K, other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    return acc


@triton.jit(do_not_specialize=["M"])
def _gemm_kernel(X, W, Bias, Y, Part, Count, M, N, K, stride_xm, stride_wn, stride_ym,
                 HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, PRECISION: tl.constexpr, TMA: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 GROUP_M: tl.constexpr, CHUNK_K: tl.constexpr = 0, SPLIT: tl.constexpr = 1,
                 PDL: tl.constexpr = False):
    pdl_enter(PDL)
    # 1. tile of this program (SPLIT programs a tile: its K chunks)
    pid_m, pid_n = _tile_of(tl.program_id(0) // SPLIT, M, N, BLOCK_M, BLOCK_N, GROUP_M)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # rows/cols past the edge read a valid row (mod) and are never stored
    xm = (rm % M).to(tl.int64)
    wn = (rn % N).to(tl.int64)
    if CHUNK_K == 0:    # 2. K walked in order into one fp32 accumulator (the contract)
        acc = _chain(X, W, pid_m, pid_n, xm, wn, 0, K, K, stride_xm, stride_wn,
                     EVEN_K, PRECISION, TMA, BLOCK_M, BLOCK_N, BLOCK_K)
        _epilogue(acc, Bias, Y, rm, rn, M, N, stride_ym, HAS_BIAS)
    elif SPLIT == 1:    # (probe) K in chunks of CHUNK_K, each from zero, added in chunk order
        acc = _chain(X, W, pid_m, pid_n, xm, wn, 0, tl.minimum(CHUNK_K, K), K, stride_xm, stride_wn,
                     EVEN_K, PRECISION, TMA, BLOCK_M, BLOCK_N, BLOCK_K)
        for c0 in range(CHUNK_K, K, CHUNK_K):
            acc += _chain(X, W, pid_m, pid_n, xm, wn, c0, tl.minimum(c0 + CHUNK_K, K), K, stride_xm, stride_wn,
                          EVEN_K, PRECISION, TMA, BLOCK_M, BLOCK_N, BLOCK_K)
        _epilogue(acc, Bias, Y, rm, rn, M, N, stride_ym, HAS_BIAS)
    else:               # (probe) the same chunks, one a program; the tile's last arrival adds them in order
        c = tl.program_id(0) % SPLIT
        part = _chain(X, W, pid_m, pid_n, xm, wn, c * CHUNK_K, tl.minimum((c + 1) * CHUNK_K, K), K, stride_xm,
                      stride_wn, EVEN_K, PRECISION, TMA, BLOCK_M, BLOCK_N, BLOCK_K)
        live = (rm[:, None] < M) & (rn[None, :] < N)
        at = rm.to(tl.int64)[:, None] * N + rn[None, :]
        tl.store(Part + c * M * N + at, part, mask=live)
        if last_to_arrive(Count + tl.program_id(0) // SPLIT, SPLIT):
            acc = tl.load(Part + at, mask=live, other=0.0, cache_modifier=".cg")
            for j in range(1, SPLIT):
                acc += tl.load(Part + j * M * N + at, mask=live, other=0.0, cache_modifier=".cg")
            _epilogue(acc, Bias, Y, rm, rn, M, N, stride_ym, HAS_BIAS)


def tma_ready(*tensors):
    """CUDA-only bulk tensor copies: sm_90+, 16-bit operands, 16-byte aligned bases and rows."""
    t0 = tensors[0]
    return (t0.is_cuda and hopper_or_newer(t0.device.index)
            and all(t.dtype in (torch.bfloat16, torch.float16) and t.data_ptr() % 16 == 0
                    and (t.stride(-2) * t.element_size()) % 16 == 0 for t in tensors))


def descriptor(t, block):
    from triton.tools.tensor_descriptor import TensorDescriptor
    return TensorDescriptor.from_tensor(t, block)


def matmul(x2, weight, bias=None, out_dtype=None, cfg=None, chunk=None):
    """x2 [M, K] @ weight[N, K].T (+ bias) -> [M, N] in out_dtype (default x2's dtype).
    cfg: a tile entry (as in _LARGE) instead of the one _config picks (probes only).
    chunk: (CHUNK_K, SPLIT), probes only (bench_triton.py --only probe_linear_split), not the
    contract: K in chunks of CHUNK_K, each chunk's accumulator from zero, the chunks' sums added in
    chunk order (other bits than the contract's one accumulator), SPLIT = 1 in one program, else one
    program a chunk (SPLIT = the chunk count) and the tile's last arrival adds them."""
    m, k = x2.shape
    n = weight.shape[0]
    if weight.shape[1] != k:
        raise ValueError(f"x has K={k} but weight is {tuple(weight.shape)}")
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    y = torch.empty((m, n), dtype=out_dtype or x2.dtype, device=x2.device)
    if m == 0:
        return y
    bm, bn, bk, group, warps, stages, tma = cfg or _config(m, n)
    stages = max(2, min(stages, _SMEM // ((bm + bn) * bk * x2.element_size())))   # fp32 operands: fewer stages
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    chunk_k, split, part, count = 0, 1, y, y       # the contract: one accumulator (Part, Count unused)
    if chunk:                                      # the probe's K chunks
        chunk_k, split = chunk
        if chunk_k % bk or (split > 1 and split != triton.cdiv(k, chunk_k)):
            raise ValueError(f"chunk {chunk}: CHUNK_K a multiple of BLOCK_K={bk}, SPLIT 1 or the chunk count")
        if split > 1:
            count = arrival_counters(x2.device, tiles, "linear")
            split = split if count is not None else 1   # in a capture without counters: one program, the same bits
            part = torch.empty((split, m, n), dtype=torch.float32, device=x2.device) if split > 1 else y
    xa, wa = x2, weight
    tma = tma and tma_ready(x2, weight)
    if tma:
        xa, wa = descriptor(x2, [bm, bk]), descriptor(weight, [bn, bk])
    # fp32 operands: exact fp32 products ("ieee"), not tf32
    precision = "ieee" if x2.dtype == torch.float32 else HALF_DOT_PRECISION
    _gemm_kernel[(tiles * split,)](xa, wa, bias if bias is not None else y, y, part, count, m, n, k, x2.stride(0),
                                   weight.stride(0), y.stride(0), HAS_BIAS=bias is not None, EVEN_K=k % bk == 0,
                                   PRECISION=precision, TMA=tma, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=group,
                                   CHUNK_K=chunk_k, SPLIT=split, num_warps=warps, num_stages=stages, **launch(x2))
    return y


class _Linear(torch.autograd.Function):
    """Forward: the invariant kernel. Backward: cuBLAS matmuls (gradients are never
    compared with the rollout, so they need accuracy, not these bits)."""

    @staticmethod
    def forward(ctx, x2, weight, bias, out_dtype):
        ctx.save_for_backward(x2, weight)
        ctx.bias_dtype = None if bias is None else bias.dtype
        return matmul(x2, weight, bias, out_dtype)

    @staticmethod
    def backward(ctx, gy):
        x2, weight = ctx.saved_tensors
        g = gy.to(x2.dtype)
        gx = g @ weight.to(x2.dtype) if ctx.needs_input_grad[0] else None
        gw = (g.t() @ x2).to(weight.dtype) if ctx.needs_input_grad[1] else None
        gb = gy.float().sum(0).to(ctx.bias_dtype) if ctx.needs_input_grad[2] else None
        return gx, gw, gb, None


def linear(x, weight, bias=None, out_dtype=None):
    """x [..., K] @ weight[N, K].T (+ bias in fp32) -> [..., N] in out_dtype (default x's)."""
    x2 = x.reshape(-1, x.shape[-1])
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                    or (bias is not None and bias.requires_grad)):
        y = _Linear.apply(x2, weight, bias, out_dtype or x.dtype)
    else:  # inference: no autograd node (host overhead matters at decode sizes)
        y = matmul(x2, weight, bias, out_dtype or x.dtype)
    return y.reshape(*x.shape[:-1], weight.shape[0])


def row_parallel_partial(x_shard, w_shard):
    """One rank's partial over its K-shard, fp32 (the contract's tp_partial_dtype here)."""
    return linear(x_shard, w_shard, out_dtype=torch.float32)
