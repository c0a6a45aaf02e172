"""MoE on Triton: router softmax, per-row-invariant grouped expert GEMMs, slot-ordered combine.

(token, slot) pairs are grouped by expert with a stable sort; a program owns up to
_BM consecutive rows of ONE expert. Kernel 1 computes gate and up for its rows (x
rows gathered by token, K walked in order into fp32), rounds both to the activation
dtype and applies SiLU*up (the contract's silu_mul, fp64 exp); kernel 2 computes the
down projection in fp32, scales it by the row's fp32 routing weight and scatters it
to its (token, slot). A row's result depends on its token and expert only, never on
which other rows share its tile or its rank (EP placement), so batches, chunks and
decode steps route and compute alike. The tile table is built on the device: no sync.
"""
import torch
import triton
import triton.language as tl

from ..reference import moe as ref_moe
from ..reference.pointwise import silu_mul as _silu_mul_torch
from .autograd import with_torch_grad
from .common import EXACT
from .gemm import linear

# Fastest of those tried on the H200 (BM 64/128, N 64/128, 4/8 warps, TMA loads: slower).
_BM = 128
_GATE_UP = dict(BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3)   # two accumulators
_DOWN = dict(BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3)
_SOFTMAX_WARPS = 4


@triton.jit
def _softmax_kernel(L, P, E, stride, BLOCK: tl.constexpr):
    """Router probs of one token: fp32 softmax, exp in fp64, IEEE division."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    x = tl.load(L + row * stride + cols, mask=cols < E, other=float("-inf"))
    e = tl.exp((x - tl.max(x, 0)).to(tl.float64)).to(tl.float32)
    tl.store(P + row * stride + cols, tl.div_rn(e, tl.sum(e, 0)), mask=cols < E)


@triton.jit
def _tile(TileE, TileRow0, TileRowEnd, Order, BM: tl.constexpr):
    """Expert, sorted rows and their (token*k + slot) ids for this program's tile."""
    t = tl.program_id(0)
    e = tl.load(TileE + t)
    r0 = tl.load(TileRow0 + t)
    rows = r0 + tl.arange(0, BM)
    live = rows < tl.load(TileRowEnd + t)
    slot = tl.load(Order + rows, mask=live, other=0)
    return e, rows.to(tl.int64), live, slot.to(tl.int64)


@triton.jit
def _gate_up_kernel(X, Order, TileE, TileRow0, TileRowEnd, Wg, Wu, Hout, K, TOPK,
                    stride_x, stride_we, stride_wn, stride_h,
                    BM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    e, rows, live, slot = _tile(TileE, TileRow0, TileRowEnd, Order, BM)
    if e < 0:                                   # idle tile (the grid is an upper bound)
        return
    tok = slot // TOPK
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    kk = tl.arange(0, BLOCK_K)
    wg = Wg + e.to(tl.int64) * stride_we
    wu = Wu + e.to(tl.int64) * stride_we
    acc_g = tl.zeros((BM, BLOCK_N), tl.float32)
    acc_u = tl.zeros((BM, BLOCK_N), tl.float32)
    for k0 in range(0, K, BLOCK_K):            # K walked in order, as in linear()
        a = tl.load(X + tok[:, None] * stride_x + (k0 + kk)[None, :])
        acc_g = tl.dot(a, tl.load(wg + n[None, :] * stride_wn + (k0 + kk)[:, None]), acc_g)
        acc_u = tl.dot(a, tl.load(wu + n[None, :] * stride_wn + (k0 + kk)[:, None]), acc_u)
    # gate and up are linear outputs (rounded to dtype); silu_mul: g/(1+exp(-g)) * up in fp32
    g = acc_g.to(Hout.dtype.element_ty).to(tl.float32)
    u = acc_u.to(Hout.dtype.element_ty).to(tl.float32)
    act = tl.div_rn(g, 1.0 + tl.exp((-g).to(tl.float64)).to(tl.float32))
    tl.store(Hout + rows[:, None] * stride_h + n[None, :], (act * u).to(Hout.dtype.element_ty),
             mask=live[:, None])


@triton.jit
def _down_kernel(Hin, Order, TileE, TileRow0, TileRowEnd, Wd, RouteW, Out, K, stride_h,
                 stride_we, stride_wn, stride_o, BM: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr):
    e, rows, live, slot = _tile(TileE, TileRow0, TileRowEnd, Order, BM)
    if e < 0:
        return
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    kk = tl.arange(0, BLOCK_K)
    wd = Wd + e.to(tl.int64) * stride_we
    hrow = tl.where(live, rows, 0)
    acc = tl.zeros((BM, BLOCK_N), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a = tl.load(Hin + hrow[:, None] * stride_h + (k0 + kk)[None, :])
        acc = tl.dot(a, tl.load(wd + n[None, :] * stride_wn + (k0 + kk)[:, None]), acc)
    # contribution = fp32 down output * fp32 routing weight, stored at its (token, slot)
    w = tl.load(RouteW + slot, mask=live, other=0.0)
    tl.store(Out + slot[:, None] * stride_o + n[None, :], acc * w[:, None], mask=live[:, None])


def _softmax_rows(logits):
    p = torch.empty_like(logits)
    _softmax_kernel[(logits.shape[0],)](logits, p, logits.shape[1], logits.stride(0),
                                        BLOCK=triton.next_power_of_2(logits.shape[1]),
                                        num_warps=_SOFTMAX_WARPS, **EXACT)
    return p


def _softmax_formula(logits):
    return torch.softmax(logits, -1)


def moe_route(x, gate_weight, top_k, norm_topk_prob=True):
    """Router: fp32 logits (invariant linear), fp32 softmax, top-k with ties to the
    lower expert id (stable sort: exact, no arithmetic). Returns (ids int64, weights fp32)."""
    logits = linear(x, gate_weight, out_dtype=torch.float32).contiguous()
    probs = with_torch_grad(_softmax_rows, _softmax_formula, (logits,))
    ids = torch.sort(probs.detach(), dim=-1, descending=True, stable=True).indices[:, :top_k]
    weights = torch.gather(probs, 1, ids)
    if norm_topk_prob:  # fp32 sum in slot order (elementwise adds: no reduction kernel)
        total = weights[:, 0]
        for j in range(1, top_k):
            total = total + weights[:, j]
        weights = weights / total[:, None]
    return ids, weights


def _plan(ids, local, n_local):
    """Group the (token, slot) pairs by local expert: sort order, per-expert counts, and
    the tile table (expert, first row, row end) for a grid of an upper-bound size."""
    lut = torch.full((max(local) + 1,), n_local, dtype=torch.int64)
    lut[local] = torch.arange(n_local)
    lut = lut.to(ids.device)
    flat = ids.reshape(-1)
    key = torch.where(flat < len(lut), lut[flat.clamp(max=len(lut) - 1)], n_local)
    order = torch.argsort(key, stable=True)            # expert-major, token order inside
    counts = torch.bincount(key, minlength=n_local + 1)[:n_local]
    starts = torch.cumsum(counts, 0) - counts
    tiles = (counts + _BM - 1) // _BM
    tile_end = torch.cumsum(tiles, 0)
    n_tiles = (flat.numel() + _BM - 1) // _BM + n_local   # >= sum(tiles), known without a sync
    t = torch.arange(n_tiles, device=ids.device)
    e = torch.searchsorted(tile_end, t, right=True)
    ec = e.clamp(max=n_local - 1)
    row0 = starts[ec] + (t - (tile_end[ec] - tiles[ec])) * _BM
    plan = dict(order=order.to(torch.int32), tile_e=torch.where(e < n_local, e, -1).to(torch.int32),
                row0=row0.to(torch.int32), row_end=(starts[ec] + counts[ec]).to(torch.int32))
    return plan, key, counts, n_tiles


def _grouped_kernel(x, weights, wg, wu, wd, *, ids, local):
    t, k = ids.shape
    n_local, inter, hidden = wg.shape[0], wg.shape[1], wg.shape[2]
    if inter % _GATE_UP["BLOCK_N"] or inter % _DOWN["BLOCK_K"] or hidden % _DOWN["BLOCK_N"] \
            or hidden % _GATE_UP["BLOCK_K"]:
        raise NotImplementedError(f"expert shapes H={hidden}, I={inter}: need multiples of 128")
    plan, key, _, n_tiles = _plan(ids, local, n_local)
    x = x.contiguous()
    h = torch.empty((t * k, inter), dtype=x.dtype, device=x.device)
    contrib = torch.zeros((t * k, hidden), dtype=torch.float32, device=x.device)
    tiles = (plan["tile_e"], plan["row0"], plan["row_end"])
    if not (n_tiles and t):
        return contrib.view(t, k, hidden), (key < n_local).view(t, k)
    wg, wu, wd = wg.contiguous(), wu.contiguous(), wd.contiguous()
    _gate_up_kernel[(n_tiles, triton.cdiv(inter, _GATE_UP["BLOCK_N"]))](
        x, plan["order"], *tiles, wg, wu, h, hidden, k,
        x.stride(0), wg.stride(0), wg.stride(1), h.stride(0), BM=_BM, **_GATE_UP, **EXACT)
    _down_kernel[(n_tiles, triton.cdiv(hidden, _DOWN["BLOCK_N"]))](
        h, plan["order"], *tiles, wd, weights.reshape(-1).float().contiguous(), contrib, inter,
        h.stride(0), wd.stride(0), wd.stride(1), contrib.stride(0), BM=_BM, **_DOWN, **EXACT)
    return contrib.view(t, k, hidden), (key < n_local).view(t, k)


def _grouped_formula(x, weights, wg, wu, wd, *, ids, local):
    """Differentiable equivalent for the backward: torch._grouped_mm over the same groups."""
    t, k = ids.shape
    plan, key, counts, _ = _plan(ids, local, wg.shape[0])
    sel = plan["order"].long()[: int(counts.sum())]
    offs = torch.cumsum(counts, 0).to(torch.int32)
    xs = x[sel // k]
    g = torch._grouped_mm(xs, wg.transpose(1, 2), offs)
    u = torch._grouped_mm(xs, wu.transpose(1, 2), offs)
    y = torch._grouped_mm(_silu_mul_torch(g, u), wd.transpose(1, 2), offs).float()
    y = y * weights.reshape(-1)[sel, None]
    contrib = torch.zeros((t * k, wd.shape[1]), dtype=torch.float32, device=x.device).index_put((sel,), y)
    return contrib.view(t, k, -1), (key < wg.shape[0]).view(t, k)


def grouped_expert_contributions(x, ids, weights, wg, wu, wd, local_ids):
    """Stacked-weight form: wg, wu [L, I, H], wd [L, H, I] for the experts local_ids (L ints)."""
    return with_torch_grad(_grouped_kernel, _grouped_formula, (x, weights, wg, wu, wd),
                           ids=ids, local=[int(e) for e in local_ids])


def moe_expert_contributions(x, ids, weights, experts, local_experts=None):
    """contrib [T, k, H] fp32 (zeros for slots whose expert is not local) and owned [T, k].
    experts[e] = (w_gate [I, H], w_up [I, H], w_down [H, I]). The experts are stacked
    for the grouped kernels (a copy per call: the model keeps per-expert parameters)."""
    local = list(range(len(experts))) if local_experts is None else sorted(int(e) for e in local_experts)
    wg, wu, wd = (torch.stack([experts[e][i] for e in local]) for i in range(3))
    return grouped_expert_contributions(x, ids, weights, wg, wu, wd, local)


def moe_combine(contrib, out_dtype):
    """Slot order 0..k-1, fp32 elementwise adds (no reduction kernel), one rounding."""
    return ref_moe.moe_combine(contrib, out_dtype)
