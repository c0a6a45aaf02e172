"""MoE on Triton: router softmax, per-row-invariant grouped expert GEMMs, slot-ordered combine.

(token, slot) pairs are grouped by expert with a stable sort; a program owns up to
_BM consecutive rows of ONE expert. Kernel 1 computes gate and up for its rows (x
rows gathered by token, K walked in order into fp32), rounds both to the activation
dtype and applies SiLU*up (the contract's silu_mul, fp64 exp); kernel 2 computes the
down projection in fp32, scales it by the row's fp32 routing weight and scatters it
to its (token, slot). A row's result depends on its token and expert only, never on
which other rows share its tile or its rank (EP placement), so batches, chunks and
decode steps route and compute alike. The tile table is built on the device: no sync.
Slots whose expert is not local get zero tiles (the down kernel stores zeros there), so
the contribution buffer is never zero-filled separately.

The model keeps its experts stacked (consistent_ops.ExpertStack: transformers 5's
gate_up_proj / down_proj) and the kernels read the stacks as they are, gate and up as
strided views of gate_up: no restacking per forward, and under autograd the backward's
grouped GEMMs hand the two stacks their gradients directly. A plain mapping of per-expert
tensors (the Megatron spec, the probe) is stacked per call with torch.stack (differentiable).
"""
import torch
import triton
import triton.language as tl

from ..contract import TRITON_TILES
from ..experts import ExpertStack
from .autograd import needs_grad, with_torch_grad
from .common import ASCEND as _ASCEND, INTERPRET as _INTERPRET, exp32, launch, pdl_enter
from .gemm import linear

def _opts(block_n, block_k, warps, stages):
    return dict(BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, num_stages=stages)


# (BM rows of one expert per program, gate_up launch options, down launch options) from
# contract.TRITON_TILES["moe"],
# picked by the number of (token, slot) rows; measured on the H200 (bench_triton.py
# --only probe). Every entry walks K in ascending BLOCK_K steps of k16 MMAs: the same bits
# (tests/gpu check every entry and the switch point).
def _tile_set(rows, gate_up, down):
    return rows, _opts(*gate_up), _opts(*down)


_T = TRITON_TILES["moe"]
_TILES = _tile_set(*_T["tiles"])          # fastest or within 3% at T 1024..8192
_DECODE = _tile_set(*_T["decode"])        # decode: a few rows per expert
_DECODE_ROWS = _T["decode_rows"]          # up to 256 tokens x top-8
# 257..1024 tokens x top-8 (a rollout's body): BM64 0.38-0.47 ms vs 0.50-0.57 for BM128 and
# 0.43-0.69 for BM16 (H200, probe_moe, 2026-12-02, T 512 / 1024)
_MID, _MID_ROWS = _tile_set(*_T["mid"]), _T["mid_rows"]
_INTERP = _tile_set(*_T["interpreter"])   # CPU interpreter; also the fallback widths


def _moe_config(rows):
    """Tile set by rows = T * top_k: at decode sizes an expert holds a few rows, and a
    16-row tile streams its weights without 128-row MMAs of padding."""
    if _INTERPRET or _ASCEND:   # one pinned tile: the interpreter's numpy dots; Ascend's cube order
        return _INTERP
    return _DECODE if rows <= _DECODE_ROWS else _MID if rows <= _MID_ROWS else _TILES


_SOFTMAX_WARPS, _ACT_BWD_WARPS = _T["router_warps"], _T["act_backward_warps"]


@triton.jit
def _softmax_kernel(L, P, E, stride, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """Router probs of one token: fp32 softmax, exp in fp64, IEEE division."""
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    x = tl.load(L + row * stride + cols, mask=cols < E, other=float("-inf"))
    e = exp32(x - tl.max(x, 0))
    tl.store(P + row * stride + cols, tl.div_rn(e, tl.sum(e, 0)), mask=cols < E)


@triton.jit
def _tile(TileE, TileRow0, TileRowEnd, Order, BM: tl.constexpr, TILE_AXIS: tl.constexpr):
    """Expert, sorted rows and their (token*k + slot) ids for this program's tile (grid axis
    TILE_AXIS; the other: the program's column block)."""
    t = tl.program_id(TILE_AXIS)
    e = tl.load(TileE + t)
    r0 = tl.load(TileRow0 + t)
    rows = r0 + tl.arange(0, BM)
    live = rows < tl.load(TileRowEnd + t)
    slot = tl.load(Order + rows, mask=live, other=0)
    return e, rows.to(tl.int64), live, slot.to(tl.int64)


@triton.jit
def _gate_up_kernel(X, Order, TileE, TileRow0, TileRowEnd, Wg, Wu, Hout, GU, K, TOPK, NL,
                    stride_x, stride_we, stride_wn, stride_h,
                    BM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SAVE_GU: tl.constexpr,
                    TILE_AXIS: tl.constexpr, PDL: tl.constexpr = False):
    pdl_enter(PDL)
    e, rows, live, slot = _tile(TileE, TileRow0, TileRowEnd, Order, BM, TILE_AXIS)
    if (e < 0) | (e >= NL):                     # idle tile (the grid is an upper bound) or zero tile
        return
    tok = slot // TOPK
    n = tl.program_id(1 - TILE_AXIS) * BLOCK_N + tl.arange(0, BLOCK_N)
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
    g = acc_g.to(Hout.dtype.element_ty)
    u = acc_u.to(Hout.dtype.element_ty)
    if SAVE_GU:  # training: gate and up as rounded, [rows, 2I] (the backward's input)
        gu = GU + rows[:, None] * (2 * stride_h) + n[None, :]
        tl.store(gu, g, mask=live[:, None])
        tl.store(gu + stride_h, u, mask=live[:, None])
    g = g.to(tl.float32)
    u = u.to(tl.float32)
    act = tl.div_rn(g, 1.0 + exp32(-g))
    tl.store(Hout + rows[:, None] * stride_h + n[None, :], (act * u).to(Hout.dtype.element_ty),
             mask=live[:, None])


@triton.jit
def _down_kernel(Hin, Order, TileE, TileRow0, TileRowEnd, Wd, RouteW, Out, K, NL, stride_h,
                 stride_we, stride_wn, stride_o, BM: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, TILE_AXIS: tl.constexpr, PDL: tl.constexpr = False):
    pdl_enter(PDL)
    e, rows, live, slot = _tile(TileE, TileRow0, TileRowEnd, Order, BM, TILE_AXIS)
    if e < 0:
        return
    n = tl.program_id(1 - TILE_AXIS) * BLOCK_N + tl.arange(0, BLOCK_N)
    if e == NL:                                 # slots of experts that are not local: zeros
        tl.store(Out + slot[:, None] * stride_o + n[None, :], tl.zeros((BM, BLOCK_N), tl.float32),
                 mask=live[:, None])
        return
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


@triton.jit
def _route_kernel(L, Ids, W, E, stride, TOPK: tl.constexpr, KB: tl.constexpr, NORM: tl.constexpr,
                  BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """The whole router of one token after its logits: the softmax of _softmax_kernel, the
    top-k by descending probability with ties to the lower expert id (what a stable
    descending sort puts first), the weights renormalised by their fp32 sum in slot order."""
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    x = tl.load(L + row * stride + cols, mask=cols < E, other=float("-inf"))
    e = exp32(x - tl.max(x, 0))
    p = tl.where(cols < E, tl.div_rn(e, tl.sum(e, 0)), float("-inf"))
    slots = tl.arange(0, KB)
    ids = tl.zeros([KB], tl.int32)
    w = tl.zeros([KB], tl.float32)
    total = 0.0                                   # 0 + w0 = w0 exactly: the slot-order sum
    for j in tl.static_range(TOPK):
        best = tl.max(p, 0)
        first = tl.min(tl.where(p == best, cols, BLOCK), 0)
        pick = tl.minimum(first, E - 1)                                         # a NaN row still names an expert
        if first < BLOCK:                                                       # p[pick] == best, exactly
            wj = best
        else:                                                                   # a NaN row: p[E - 1]
            wj = tl.sum(tl.where(cols == pick, p, 0.0), 0)
        ids = tl.where(slots == j, pick, ids)
        w = tl.where(slots == j, wj, w)
        total = total + wj
        p = tl.where(cols == pick, float("-inf"), p)
    if NORM:
        w = tl.div_rn(w, total)
    tl.store(Ids + row * TOPK + slots, ids.to(tl.int64), mask=slots < TOPK)
    tl.store(W + row * TOPK + slots, w, mask=slots < TOPK)


def _route_fused(logits, top_k, norm_topk_prob):
    t, e = logits.shape
    ids = torch.empty((t, top_k), dtype=torch.int64, device=logits.device)
    weights = torch.empty((t, top_k), dtype=torch.float32, device=logits.device)
    if t:
        _route_kernel[(t,)](logits, ids, weights, e, logits.stride(0), TOPK=top_k, KB=triton.next_power_of_2(top_k),
                            NORM=bool(norm_topk_prob), BLOCK=triton.next_power_of_2(e), num_warps=_SOFTMAX_WARPS,
                            **launch(logits))
    return ids, weights


def _softmax_rows(logits):
    p = torch.empty_like(logits)
    _softmax_kernel[(logits.shape[0],)](logits, p, logits.shape[1], logits.stride(0),
                                        BLOCK=triton.next_power_of_2(logits.shape[1]),
                                        num_warps=_SOFTMAX_WARPS, **launch(logits))
    return p


def _softmax_formula(logits):
    return torch.softmax(logits, -1)


def moe_route(x, gate_weight, top_k, norm_topk_prob=True):
    """Router: fp32 logits (invariant linear), fp32 softmax, top-k with ties to the
    lower expert id (stable sort: exact, no arithmetic). Returns (ids int64, weights fp32)."""
    logits = linear(x, gate_weight, out_dtype=torch.float32).contiguous()
    if not (torch.is_grad_enabled() and logits.requires_grad):   # rollout / no-grad: one kernel
        return _route_fused(logits, top_k, norm_topk_prob)
    return _route_from_probs(with_torch_grad(_softmax_rows, _softmax_formula, (logits,)), top_k, norm_topk_prob)


def _route_from_probs(probs, top_k, norm_topk_prob):
    """The training path's top-k (stable sort: ties to the lower id) and renormalisation,
    torch ops that autograd differentiates; _route_fused gives their bits in one kernel."""
    ids = torch.sort(probs.detach(), dim=-1, descending=True, stable=True).indices[:, :top_k]
    weights = torch.gather(probs, 1, ids)
    if norm_topk_prob:  # fp32 sum in slot order (elementwise adds: no reduction kernel)
        total = weights[:, 0]
        for j in range(1, top_k):
            total = total + weights[:, j]
        weights = weights / total[:, None]
    return ids, weights


_LUT = {}


def _local_index(flat, local):
    """Expert id -> local index, len(local) for experts that are not local. A contiguous
    range (how the model places experts) is arithmetic on the device; any other set goes
    through a lookup table built once per set (a host copy: keep it out of graph capture)."""
    n_local, lo = len(local), local[0]
    if list(local) == list(range(lo, lo + n_local)):
        inside = (flat >= lo) & (flat < lo + n_local)
        return torch.where(inside, flat - lo, n_local)
    key = (tuple(local), str(flat.device))
    lut = _LUT.get(key)
    if lut is None:
        host = torch.full((max(local) + 1,), n_local, dtype=torch.int64)
        host[list(local)] = torch.arange(n_local)
        lut = _LUT[key] = host.to(flat.device)
    return torch.where(flat < len(lut), lut[flat.clamp(max=len(lut) - 1)], n_local)


@triton.jit
def _plan_kernel(Ids, Key, Order, TileE, Row0, RowEnd, R, LO, N_TILES, NL: tl.constexpr, BM: tl.constexpr,
                 RB: tl.constexpr, GB: tl.constexpr, TB: tl.constexpr, PDL: tl.constexpr = False):
    """Program g: the rows of local expert g (g = NL: rows of experts that are not local),
    stably in token order, and g's tiles. Every program counts all groups (a histogram over
    the rows, RB at a time), so no program waits for another; the last one also marks the
    idle tile slots. Rows are read twice per program: cheap next to the experts' weights."""
    pdl_enter(PDL)
    g = tl.program_id(0)
    r = tl.arange(0, RB)
    bins = tl.arange(0, GB)
    counts = tl.zeros([GB], tl.int32)
    for c0 in range(0, R, RB):
        flat = tl.load(Ids + c0 + r, mask=c0 + r < R, other=-1)
        key = tl.where((flat >= LO) & (flat < LO + NL), flat - LO, NL)
        key = tl.where(c0 + r < R, key, NL + 1).to(tl.int32)          # past R: a bin no group reads
        counts += tl.histogram(key, GB)
        if g == 0:
            tl.store(Key + c0 + r, key.to(tl.int64), mask=c0 + r < R)
    tiles = (counts + BM - 1) // BM
    start = tl.sum(tl.where(bins < g, counts, 0), 0)
    tile0 = tl.sum(tl.where(bins < g, tiles, 0), 0)
    c = tl.sum(tl.where(bins == g, counts, 0), 0)
    done = start
    for c0 in range(0, R, RB):                                         # g's rows in token order
        flat = tl.load(Ids + c0 + r, mask=c0 + r < R, other=-1)
        key = tl.where((flat >= LO) & (flat < LO + NL), flat - LO, NL)
        mine = (key == g) & (c0 + r < R)
        tl.store(Order + done + tl.cumsum(mine.to(tl.int32), 0) - 1, c0 + r, mask=mine)
        done += tl.sum(mine.to(tl.int32), 0)
    for i0 in range(0, (c + BM - 1) // BM, TB):
        i = i0 + tl.arange(0, TB)
        live = i < (c + BM - 1) // BM
        tl.store(TileE + tile0 + i, tl.zeros([TB], tl.int32) + g, mask=live)
        tl.store(Row0 + tile0 + i, start + i * BM, mask=live)
        tl.store(RowEnd + tile0 + i, tl.zeros([TB], tl.int32) + start + c, mask=live)
    if g == NL:                                                        # idle slots: no expert, no rows
        first = tl.sum(tl.where(bins <= NL, tiles, 0), 0)
        for t0 in range(0, N_TILES, TB):
            j = t0 + tl.arange(0, TB)
            idle = (j >= first) & (j < N_TILES)
            tl.store(TileE + j, tl.full([TB], -1, tl.int32), mask=idle)
            tl.store(Row0 + j, tl.zeros([TB], tl.int32), mask=idle)
            tl.store(RowEnd + j, tl.zeros([TB], tl.int32), mask=idle)


_PLAN_RB, _PLAN_TB = 4096, 256     # rows per pass; tile slots per store
_FUSED_PLAN = True                 # False: the torch plan below (tests compare the two)


def _tile_bound(rows, bm, n_local):
    """The experts' grid: at least the tiles the plan can make of `rows` (token, slot) rows, from
    shapes alone (no sync). A tile holds at least one row, and each group adds at most one partial
    tile: at decode the first bound is the smaller (T=1, top-8: 8 tiles, not 130), so the launch
    holds no idle programs that would take the SMs (and start before busy ones) for nothing."""
    return min(rows, (rows + bm - 1) // bm + n_local + 1)


def _plan_fused(flat, lo, n_local, bm):
    """The plan of _plan for a contiguous local expert range, in one launch."""
    rows = flat.numel()
    n_tiles = _tile_bound(rows, bm, n_local)
    dev, i32 = flat.device, torch.int32
    key = torch.empty(rows, dtype=torch.int64, device=dev)
    plan = dict(order=torch.empty(rows, dtype=i32, device=dev), tile_e=torch.empty(n_tiles, dtype=i32, device=dev),
                row0=torch.empty(n_tiles, dtype=i32, device=dev), row_end=torch.empty(n_tiles, dtype=i32, device=dev))
    _plan_kernel[(n_local + 1,)](flat, key, plan["order"], plan["tile_e"], plan["row0"], plan["row_end"], rows, lo,
                                 n_tiles, NL=n_local, BM=bm, RB=min(_PLAN_RB, triton.next_power_of_2(rows)),
                                 GB=triton.next_power_of_2(n_local + 2), TB=_PLAN_TB, num_warps=4,
                                 **launch(flat, fusion=True))
    return plan, key, n_tiles


def _plan(ids, local, n_local, bm):
    """Group the (token, slot) pairs by local expert (group n_local: not local, sorted
    last): sort order, per-expert counts, and the tile table (expert, first row, row end;
    expert n_local = zero tile, -1 = idle) for a grid of an upper-bound size. Built on the
    device with shapes known from ids alone: no sync, so it captures in a CUDA graph."""
    flat = ids.reshape(-1)
    if _FUSED_PLAN and list(local) == list(range(local[0], local[0] + n_local)):   # how the model places experts
        return _plan_fused(flat.contiguous(), local[0], n_local, bm)
    key = _local_index(flat, local)
    order = torch.argsort(key, stable=True)            # expert-major, token order inside
    counts = torch.zeros(n_local + 1, dtype=torch.int64, device=ids.device).scatter_add_(
        0, key, torch.ones_like(key))                   # bincount without its size sync
    starts = torch.cumsum(counts, 0) - counts
    tiles = (counts + bm - 1) // bm
    tile_end = torch.cumsum(tiles, 0)
    n_tiles = _tile_bound(flat.numel(), bm, n_local)
    t = torch.arange(n_tiles, device=ids.device)
    e = torch.searchsorted(tile_end, t, right=True)
    ec = e.clamp(max=n_local)
    row0 = starts[ec] + (t - (tile_end[ec] - tiles[ec])) * bm
    plan = dict(order=order.to(torch.int32), tile_e=torch.where(e <= n_local, e, -1).to(torch.int32),
                row0=row0.to(torch.int32), row_end=(starts[ec] + counts[ec]).to(torch.int32))
    return plan, key, n_tiles


def _grouped_kernel(x, weights, w_gate_up, wd, *, ids, local, cfg=None, save_gu=False, owned=True):
    """contrib [T, k, H], owned [T, k] (None without `owned`; and with save_gu what the backward
    takes: the rounded gate/up outputs [T*k, 2I] in the plan's row order, that order and the rows'
    local keys)."""
    t, k = ids.shape
    n_local, hidden, inter = wd.shape
    bm, gate_up, down = cfg or _moe_config(t * k)

    def fits(gu, dn):
        return not (inter % gu["BLOCK_N"] or inter % dn["BLOCK_K"] or hidden % dn["BLOCK_N"]
                    or hidden % gu["BLOCK_K"])
    if not fits(gate_up, down):       # other block widths: the same K walk, so the same bits
        bm, gate_up, down = _INTERP
        if not fits(gate_up, down):
            raise NotImplementedError(f"expert shapes H={hidden}, I={inter}: need multiples of 128")
    if not t:
        out = (torch.zeros((0, k, hidden), dtype=torch.float32, device=x.device),
               torch.zeros((0, k), dtype=torch.bool, device=x.device))
        return (*out, (x.new_empty(0, 2 * inter), ids.new_empty(0, dtype=torch.int32), ids.new_empty(0))) \
            if save_gu else out
    plan, key, n_tiles = _plan(ids, local, n_local, bm)
    x = x.contiguous()
    h = torch.empty((t * k, inter), dtype=x.dtype, device=x.device)
    contrib = torch.empty((t * k, hidden), dtype=torch.float32, device=x.device)   # every slot stored
    tiles = (plan["tile_e"], plan["row0"], plan["row_end"])
    w_gate_up = w_gate_up if w_gate_up.stride(-1) == 1 else w_gate_up.contiguous()
    wd = wd if wd.stride(-1) == 1 else wd.contiguous()
    wg, wu = w_gate_up[:, :inter], w_gate_up[:, inter:]     # views: the kernel reads the stack in place
    gu = torch.empty((t * k, 2 * inter), dtype=x.dtype, device=x.device) if save_gu else h
    # decode sizes: a tile's column blocks numbered first, so the plan's tiles (the first ones) start
    # before its idle slots; larger batches: a column block's tiles first (an expert's tiles share it in L2)
    axis = int(t * k <= _DECODE_ROWS)

    def grid(blocks):
        return (blocks, n_tiles) if axis else (n_tiles, blocks)
    _gate_up_kernel[grid(triton.cdiv(inter, gate_up["BLOCK_N"]))](
        x, plan["order"], *tiles, wg, wu, h, gu, hidden, k, n_local,
        x.stride(0), wg.stride(0), wg.stride(1), h.stride(0), BM=bm, **gate_up, SAVE_GU=save_gu, TILE_AXIS=axis,
        **launch(x))
    _down_kernel[grid(triton.cdiv(hidden, down["BLOCK_N"]))](
        h, plan["order"], *tiles, wd, weights.reshape(-1).float().contiguous(), contrib, inter, n_local,
        h.stride(0), wd.stride(0), wd.stride(1), contrib.stride(0), BM=bm, **down, TILE_AXIS=axis, **launch(h))
    out = contrib.view(t, k, hidden), (key < n_local).view(t, k) if owned else None
    return (*out, (gu, plan["order"], key)) if save_gu else out


def _groups(order, key, n_local, every):
    """(token, slot) rows of the local experts grouped by expert (the forward plan's order)
    and the groups' end offsets. every: each slot has a local expert, so all t*k rows are
    taken without a count from the device (otherwise that count is one host sync)."""
    counts = torch.zeros(n_local + 1, dtype=torch.int64, device=key.device).scatter_add_(
        0, key, torch.ones_like(key))[:n_local]                  # bincount without its size sync
    sel = order.long()
    if not every:
        sel = sel[: int(counts.sum())]
    return sel, torch.cumsum(counts, 0).to(torch.int32)


def _weight_grad(dy, xs, offs):
    """Per-group dy^T @ xs -> [L, N, K]. The grouped GEMM needs the row count in 16-byte
    strides: rows are padded with zeros (into the last group, adding nothing) when short."""
    pad = -dy.shape[0] % 8
    if pad:
        dy, xs = (torch.cat([m, m.new_zeros(pad, m.shape[1])]) for m in (dy, xs))
        offs = torch.cat([offs[:-1], offs[-1:] + pad])
    return torch._grouped_mm(dy.t(), xs, offs)


@triton.jit
def _act_bwd_kernel(GU, DHW, WR, Hout, DGU, DW, I, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """One (token, slot) row of the experts' activation backward, in fp32: h = silu(g) * u
    (the forward's, rounded), dw = <dC @ Wd, h>, dh = (dC @ Wd) * w, dg = dh * u * silu'(g),
    du = dh * silu(g). Rows are contiguous: gu [R, 2I], dC @ Wd [R, I]."""
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    w = tl.load(WR + row)
    acc = tl.zeros([BLOCK], tl.float32)
    for c0 in range(0, I, BLOCK):
        c = c0 + tl.arange(0, BLOCK)
        live = c < I
        g = tl.load(GU + row * 2 * I + c, mask=live, other=0.0).to(tl.float32)
        u = tl.load(GU + row * 2 * I + I + c, mask=live, other=0.0).to(tl.float32)
        dhw = tl.load(DHW + row * I + c, mask=live, other=0.0).to(tl.float32)
        e1 = 1.0 + exp32(-g)
        silu = tl.div_rn(g, e1)
        sig = tl.div_rn(1.0, e1)
        h = (silu * u).to(Hout.dtype.element_ty)
        tl.store(Hout + row * I + c, h, mask=live)
        acc += dhw * h.to(tl.float32)
        dh = dhw * w
        tl.store(DGU + row * 2 * I + c, (dh * u * sig * (1.0 + g * (1.0 - sig))).to(DGU.dtype.element_ty),
                 mask=live)
        tl.store(DGU + row * 2 * I + I + c, (dh * silu).to(DGU.dtype.element_ty), mask=live)
    tl.store(DW + row, tl.sum(acc, 0))


def _act_backward(gu, dhw, wr):
    """(h, d_gu, dw) of _act_bwd_kernel for R rows."""
    rows, inter = dhw.shape
    h, d_gu = gu.new_empty(rows, inter), torch.empty_like(gu)
    dw = torch.empty(rows, dtype=torch.float32, device=gu.device)
    if rows:
        _act_bwd_kernel[(rows,)](gu, dhw, wr, h, d_gu, dw, inter, BLOCK=min(triton.next_power_of_2(inter), 1024),
                                 num_warps=_ACT_BWD_WARPS, **launch(gu))
    return h, d_gu, dw


@triton.jit
def _slot_grad_kernel(D, Sel, WR, DC, DCW, H, TOPK, stride_t, stride_k, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """Row r of the plan order: dC_r = d_contrib[token, slot] (any strides: the combine's
    expanded view included) and w_r * dC_r, both rounded to the activation dtype."""
    pdl_enter(PDL)
    r = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    live = c < H
    sel = tl.load(Sel + r)
    v = tl.load(D + (sel // TOPK) * stride_t + (sel % TOPK) * stride_k + c, mask=live, other=0.0)
    tl.store(DC + r * H + c, v.to(DC.dtype.element_ty), mask=live)
    tl.store(DCW + r * H + c, (v * tl.load(WR + r)).to(DCW.dtype.element_ty), mask=live)


def _slot_grads(d_contrib, sel, wr, dtype):
    t, k, hidden = d_contrib.shape
    if d_contrib.stride(-1) != 1:
        d_contrib = d_contrib.contiguous()
    dc = torch.empty((sel.shape[0], hidden), dtype=dtype, device=d_contrib.device)
    dcw = torch.empty_like(dc)
    if sel.shape[0]:
        _slot_grad_kernel[(sel.shape[0], triton.cdiv(hidden, 1024))](
            d_contrib, sel, wr, dc, dcw, hidden, k, d_contrib.stride(0), d_contrib.stride(1), BLOCK=1024,
            num_warps=4, **launch(d_contrib))
    return dc, dcw


def _grouped_backward(x, weights, w_gate_up, wd, ids, every, gu, order, key, d_contrib):
    """Gradients of contrib[r] = w_r * down(silu_mul(gate(x), up(x))) for the rows r of the
    local experts, with torch._grouped_mm over the forward's groups, from the forward's
    saved gate/up outputs gu, plan order and keys; nothing is recomputed but h (dw_r = <dC_r, y_r> =
    <dC_r @ Wd, h_r>), the activation's backward one kernel. Each token's gradient sums its
    slots in slot order: no atomics, deterministic."""
    t, k = ids.shape
    sel, offs = _groups(order, key, wd.shape[0], every)
    xs = x[sel // k]
    gu = gu[:sel.shape[0]]                                      # the local rows lead the plan order
    wr = weights.reshape(-1)[sel].float().contiguous()
    dc, dcw = _slot_grads(d_contrib, sel, wr, x.dtype)
    dhw = torch._grouped_mm(dc, wd, offs)                       # dC @ Wd: [R, I]
    h, d_gu, dw = _act_backward(gu, dhw, wr)
    d_weights = torch.zeros(t * k, dtype=torch.float32, device=x.device).index_put((sel,), dw)
    d_wd = _weight_grad(dcw, h, offs)
    d_wgu = _weight_grad(d_gu, xs, offs)
    d_rows = torch._grouped_mm(d_gu, w_gate_up, offs)           # [R, H], plan order
    if every:     # every (token, slot) is a row: back to slot order by a gather
        d_slots = d_rows[torch.empty_like(sel).scatter_(0, sel, torch.arange(sel.shape[0], device=sel.device))]
    else:
        d_slots = d_rows.new_zeros(t * k, d_rows.shape[1]).index_put((sel,), d_rows)
    d_x = d_slots.view(t, k, -1).sum(1, dtype=torch.float32).to(x.dtype)
    return d_x, d_weights.view(weights.shape).to(weights.dtype), d_wgu, d_wd


class _GroupedExperts(torch.autograd.Function):
    """Forward: the grouped kernels (the contract's bits). Backward: _grouped_backward."""

    @staticmethod
    def forward(ctx, x, weights, w_gate_up, wd, ids, local, every):
        contrib, owned, saved = _grouped_kernel(x, weights, w_gate_up, wd, ids=ids, local=local, save_gu=True)
        ctx.save_for_backward(x, weights, w_gate_up, wd, ids, *saved)
        ctx.every = every
        ctx.mark_non_differentiable(owned)
        return contrib, owned

    @staticmethod
    def backward(ctx, d_contrib, _):
        x, weights, w_gate_up, wd, ids, gu, order, key = ctx.saved_tensors
        grads = _grouped_backward(x, weights, w_gate_up, wd, ids, ctx.every, gu, order, key, d_contrib)
        return (*(g if need else None for g, need in zip(grads, ctx.needs_input_grad)), None, None, None)


def grouped_expert_contributions(x, ids, weights, w_gate_up, wd, local_ids, every=False):
    """Stacked-weight form: w_gate_up [L, 2I, H] (gate rows, then up rows), wd [L, H, I] for
    the experts local_ids (L ints), read in place; every: ids name local experts only (the
    backward then needs no host sync)."""
    local = [int(e) for e in local_ids]
    if needs_grad(x, weights, w_gate_up, wd):
        return _GroupedExperts.apply(x, weights, w_gate_up, wd, ids, local, every)
    return _grouped_kernel(x, weights, w_gate_up, wd, ids=ids, local=local)


def moe_expert_contributions(x, ids, weights, experts, local_experts=None):
    """contrib [T, k, H] fp32 (zeros for slots whose expert is not local) and owned [T, k].
    experts[e] = (w_gate [I, H], w_up [I, H], w_down [H, I]); local_experts None: every
    expert is local. An ExpertStack is read as it is (see the module doc); other experts
    are stacked per call."""
    local = list(range(len(experts))) if local_experts is None else sorted(int(e) for e in local_experts)
    every = local_experts is None
    if isinstance(experts, ExpertStack) and experts.local == local:
        return grouped_expert_contributions(x, ids, weights, experts.gate_up, experts.down, local, every)
    g, u, d = zip(*map(experts.__getitem__, local))
    return grouped_expert_contributions(x, ids, weights, torch.cat([torch.stack(g), torch.stack(u)], 1),
                                        torch.stack(d), local, every)


def moe_experts(x, ids, weights, experts):
    """consistent_ops.moe_experts for an ExpertStack of every expert, outside autograd (the rollout):
    moe_combine(moe_expert_contributions(...)[0]) by the same kernels (the same bits) without the
    ownership mask only a TP exchange reads: one launch fewer a layer (a compare kernel, ~1.4 us; 48
    in the 48-layer B=1 decode step, H100 2026-12-05). None elsewhere (the caller runs the two)."""
    if (not isinstance(experts, ExpertStack) or experts.local != list(range(len(experts)))
            or needs_grad(x, weights, experts.gate_up, experts.down)):
        return None
    contrib, _ = _grouped_kernel(x, weights, experts.gate_up, experts.down, ids=ids, local=experts.local, owned=False)
    return _combine(contrib, x.dtype)


@triton.jit
def _combine_kernel(C, Out, H, stride_t, stride_k, stride_o, TOPK: tl.constexpr, BLOCK: tl.constexpr,
                    PDL: tl.constexpr = False):
    """Slots 0..k-1 added in order in fp32 (as the reference's elementwise adds), rounded once."""
    pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    live = h < H
    acc = tl.load(C + t * stride_t + h, mask=live)
    for j in tl.static_range(1, TOPK):
        acc = acc + tl.load(C + t * stride_t + j * stride_k + h, mask=live)
    tl.store(Out + t * stride_o + h, acc.to(Out.dtype.element_ty), mask=live)


def _combine(contrib, out_dtype):
    t, k, h = contrib.shape
    c = contrib if contrib.stride(-1) == 1 else contrib.contiguous()
    out = torch.empty((t, h), dtype=out_dtype, device=contrib.device)
    if t:
        _combine_kernel[(t, triton.cdiv(h, 1024))](c, out, h, c.stride(0), c.stride(1), out.stride(0),
                                                  TOPK=k, BLOCK=1024, num_warps=4, **launch(c))
    return out


class _Combine(torch.autograd.Function):
    """The gradient of a sum over slots is the output's gradient broadcast to every slot: an
    expanded view (no [T, k, H] buffer is written; the experts' backward gathers its rows)."""

    @staticmethod
    def forward(ctx, contrib, out_dtype):
        ctx.shape, ctx.dtype = contrib.shape, contrib.dtype
        return _combine(contrib, out_dtype)

    @staticmethod
    def backward(ctx, d_out):
        return d_out.to(ctx.dtype).unsqueeze(1).expand(ctx.shape), None


def moe_combine(contrib, out_dtype):
    """Slot order 0..k-1, fp32 elementwise adds, one rounding (one kernel, the bits of the
    reference's torch adds)."""
    if torch.is_grad_enabled() and contrib.requires_grad:
        return _Combine.apply(contrib, out_dtype)
    return _combine(contrib, out_dtype)
