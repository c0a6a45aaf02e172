"""Log-probs on Triton: fp32 log-softmax with temperature and the padded-vocabulary rule.

The vocabulary is walked in blocks of _BLOCK columns, in order: pass 1 takes the max (exact
in any order), pass 2 adds exp(z - m) into a _BLOCK-wide fp32 accumulator, lane j taking
columns j, _BLOCK + j, 2 _BLOCK + j, ... one after another, and the accumulator is reduced
by one fixed tree (``_row_lse``, always 8 warps over the stored [_BLOCK] row: the same code,
so the same tree, for the rollout's log_softmax and the trainer's token_logprobs); so a
row's bits depend on V and the row alone. Lanes are independent until that tree, so passes 1
and 2 split a row's lanes over ``groups`` programs (each program a contiguous run of lanes
through every block) without changing a bit: few rows (the decode tail: 8 rows x 151,936
columns ran 8 programs on 132 SMs, 116 us) fill the GPU. exp and log are evaluated in fp64
and rounded to fp32 (the contract's transcendentals); z = logits / T is an IEEE division by
an fp32 temperature.
"""
import torch
import triton
import triton.language as tl

from ..contract import TRITON_TILES
from ..reference import logprobs as ref
from .autograd import with_torch_grad
from .common import ASCEND, SCALAR_DIV_RN, exp32, launch, log32, pdl_enter

_BLOCK, _WARPS = TRITON_TILES["logprob_block"], TRITON_TILES["logprob_finish_warps"]
# Lane groups: at least _LANES_MIN lanes a program; programs up to 2 waves of the H200's SMs.
_LANES_MIN, _PROGRAMS = 256, 2 * 132
_GROUPS_MAX = _BLOCK // _LANES_MIN    # the maxima's width read back (masked): one compiled finish
# The vocabulary walks read through Triton's software pipeline (cp.async, two blocks ahead of the one
# reduced or written): a program of the decode tail walks ~37 blocks of a row one after another, and a
# plain loop waited on each block's read. The same instructions on the same values: the same bits.
_STAGES = 4


def lane_groups(rows):
    """Programs a row's lanes split over in passes 1-2 (a power of two; speed only: bits
    never depend on it). Ascend: 1 (its launch limit counts programs; no fill to gain there)."""
    if ASCEND:
        return 1
    g = 1
    while g * 2 <= _GROUPS_MAX and rows * g * 2 <= _PROGRAMS:
        g *= 2
    return g


@triton.jit
def _z(Row, cols, V, vlim, t):
    """z = logits / T for these columns of a row of V; columns >= vocab_limit are -inf (excluded).
    The load is masked by V and the limit applied after: a real tokenizer's limit (Qwen3's 151,669)
    is no multiple of a vector's width, and masking the load by it read every column alone."""
    x = tl.load(Row + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
    return tl.div_rn(tl.where(cols < vlim, x, float("-inf")), t)


@triton.jit
def _lane_max_kernel(Z, Temp, Mx, V, vlim, stride_z, stride_t, BLOCK: tl.constexpr, LANES: tl.constexpr,
                     STAGES: tl.constexpr, PDL: tl.constexpr = False):
    """Pass 1 over one run of lanes: Mx[row, group] = max z over them (exact in any order)."""
    pdl_enter(PDL)
    row, group = tl.program_id(0).to(tl.int64), tl.program_id(1)
    t = tl.load(Temp + row * stride_t)
    lanes = group * LANES + tl.arange(0, LANES)
    mx = tl.full([LANES], float("-inf"), tl.float32)
    for c0 in tl.range(0, vlim, BLOCK, num_stages=STAGES):
        mx = tl.maximum(mx, _z(Z + row * stride_z, c0 + lanes, V, vlim, t))
    tl.store(Mx + row * tl.num_programs(1) + group, tl.max(mx, 0))


@triton.jit
def _row_max(Mx, row, groups, GB: tl.constexpr):
    return tl.max(tl.load(Mx + row * groups + tl.arange(0, GB), mask=tl.arange(0, GB) < groups,
                          other=float("-inf")), 0)


@triton.jit
def _lane_sum_kernel(Z, Temp, Mx, Acc, V, vlim, stride_z, stride_t, BLOCK: tl.constexpr, LANES: tl.constexpr,
                     GB: tl.constexpr, STAGES: tl.constexpr, PDL: tl.constexpr = False):
    """Pass 2 over one run of lanes: each lane's sum of exp(z - m) over the blocks, in order."""
    pdl_enter(PDL)
    row, group = tl.program_id(0).to(tl.int64), tl.program_id(1)
    t = tl.load(Temp + row * stride_t)
    m = _row_max(Mx, row, tl.num_programs(1), GB)
    lanes = group * LANES + tl.arange(0, LANES)
    acc = tl.zeros([LANES], tl.float32)
    for c0 in tl.range(0, vlim, BLOCK, num_stages=STAGES):
        acc += exp32(_z(Z + row * stride_z, c0 + lanes, V, vlim, t) - m)
    tl.store(Acc + row * BLOCK + lanes, acc)


@triton.jit
def _row_lse(Mx, Acc, row, groups, BLOCK: tl.constexpr, GB: tl.constexpr):
    """(m, log-sum-exp) of a row: the one tree over its stored accumulator (see the docstring)."""
    return _row_max(Mx, row, groups, GB), log32(tl.sum(tl.load(Acc + row * BLOCK + tl.arange(0, BLOCK)), 0))


@triton.jit
def _log_softmax_kernel(Z, Temp, Mx, Acc, Out, V, vlim, groups, stride_z, stride_o, stride_t,
                        BLOCK: tl.constexpr, GB: tl.constexpr, STAGES: tl.constexpr, PDL: tl.constexpr = False):
    """Pass 3: logp = (z - m) - lse over blocks part, part + parts, ... of the row."""
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    t = tl.load(Temp + row * stride_t)
    m, lse = _row_lse(Mx, Acc, row, groups, BLOCK, GB)
    cols = tl.arange(0, BLOCK)
    for c0 in tl.range(tl.program_id(1) * BLOCK, V, tl.num_programs(1) * BLOCK, num_stages=STAGES):
        c = c0 + cols
        tl.store(Out + row * stride_o + c, (_z(Z + row * stride_z, c, V, vlim, t) - m) - lse, mask=c < V)


@triton.jit
def _token_logprob_kernel(Z, Temp, Ids, Mx, Acc, Out, M, LSE, vlim, groups, stride_z, stride_t,
                          BLOCK: tl.constexpr, GB: tl.constexpr, PDL: tl.constexpr = False):
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    t = tl.load(Temp + row * stride_t)
    m, lse = _row_lse(Mx, Acc, row, groups, BLOCK, GB)
    tok = tl.load(Ids + row)
    if SCALAR_DIV_RN:
        z = tl.div_rn(tl.load(Z + row * stride_z + tok).to(tl.float32), t)
    else:  # triton-ascend: the same quotient on a [1]-shaped load (see common.SCALAR_DIV_RN)
        z = tl.max(tl.div_rn(tl.load(Z + row * stride_z + tok + tl.arange(0, 1)).to(tl.float32), t), 0)
    z = tl.where(tok < vlim, z, float("-inf"))
    tl.store(Out + row, (z - m) - lse)
    tl.store(M + row, m)            # saved for the backward
    tl.store(LSE + row, lse)


def _row_passes(z, t, st, vlim, groups=None):
    """Passes 1-2 for every row: the per-group maxima [rows, groups] and the accumulators
    [rows, _BLOCK] that _row_lse reduces. groups: a power of two (tests; default lane_groups)."""
    rows = z.shape[0]
    groups = groups or lane_groups(rows)
    lanes = _BLOCK // groups
    mx = torch.empty((rows, groups), dtype=torch.float32, device=z.device)
    acc = torch.empty((rows, _BLOCK), dtype=torch.float32, device=z.device)
    warps = max(2, min(8, lanes // 512))
    _lane_max_kernel[(rows, groups)](z, t, mx, z.shape[1], vlim, z.stride(0), st, BLOCK=_BLOCK, LANES=lanes,
                                     STAGES=_STAGES, num_warps=warps, **launch(z))
    _lane_sum_kernel[(rows, groups)](z, t, mx, acc, z.shape[1], vlim, z.stride(0), st, BLOCK=_BLOCK, LANES=lanes,
                                     GB=_GROUPS_MAX, STAGES=_STAGES, num_warps=warps, **launch(z))
    return mx, acc, groups


@triton.jit
def _token_logprob_bwd_kernel(Z, Temp, Ids, M, LSE, G, DZ, V, vlim, stride_z, stride_dz, stride_t,
                              BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """d logp(tok) / d logits = (onehot(tok) - softmax(z)) * g / T, one pass per row."""
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    t = tl.load(Temp + row * stride_t)
    m, lse = tl.load(M + row), tl.load(LSE + row)
    tok = tl.load(Ids + row)
    gt = tl.load(G + row) / t
    cols = tl.arange(0, BLOCK)
    for c0 in range(0, V, BLOCK):
        c = c0 + cols
        p = tl.exp((_z(Z + row * stride_z, c, V, vlim, t) - m) - lse)
        tl.store(DZ + row * stride_dz + c, (tl.where(c == tok, 1.0, 0.0) - p) * gt, mask=c < V)


def _prepare(logits, temperature, vocab_limit):
    z = logits.reshape(-1, logits.shape[-1])
    z = z if z.stride(-1) == 1 else z.contiguous()
    t = ref._temperature_column(temperature, z).reshape(-1).contiguous()
    v = z.shape[-1]
    vlim = v if vocab_limit is None else min(int(vocab_limit), v)
    return z, t, (0 if t.numel() == 1 else 1), v, vlim


def _log_softmax_kernel_call(logits, temperature, vocab_limit, groups=None):
    z, t, st, v, vlim = _prepare(logits, temperature, vocab_limit)
    out = torch.empty(z.shape, dtype=torch.float32, device=z.device)
    rows = z.shape[0]
    if rows == 0:
        return out.view(logits.shape)
    mx, acc, groups = _row_passes(z, t, st, vlim, groups)
    parts = min(triton.cdiv(v, _BLOCK), max(1, _PROGRAMS // rows)) if not ASCEND else 1
    _log_softmax_kernel[(rows, parts)](z, t, mx, acc, out, v, vlim, groups, z.stride(0), out.stride(0), st,
                                       BLOCK=_BLOCK, GB=_GROUPS_MAX, STAGES=_STAGES, num_warps=_WARPS, **launch(z))
    return out.view(logits.shape)


class _TokenLogprobs(torch.autograd.Function):
    """Forward: the contract's bits. Backward: one Triton pass per row from the saved
    max and log-sum-exp (the training path's only full-vocabulary gradient)."""

    @staticmethod
    def forward(ctx, logits, token_ids, temperature, vocab_limit):
        z, t, st, v, vlim = _prepare(logits, temperature, vocab_limit)
        ids = token_ids.reshape(-1).to(device=z.device, dtype=torch.int64).contiguous()
        rows = z.shape[0]
        out, m, lse = (torch.empty(rows, dtype=torch.float32, device=z.device) for _ in range(3))
        if rows:
            mx, acc, groups = _row_passes(z, t, st, vlim)
            _token_logprob_kernel[(rows,)](z, t, ids, mx, acc, out, m, lse, vlim, groups, z.stride(0), st,
                                           BLOCK=_BLOCK, GB=_GROUPS_MAX, num_warps=_WARPS, **launch(z))
        ctx.save_for_backward(z, t, ids, m, lse)
        ctx.meta = (st, v, vlim, logits.shape, logits.dtype)
        return out

    @staticmethod
    def backward(ctx, g):
        z, t, ids, m, lse = ctx.saved_tensors
        st, v, vlim, shape, dtype = ctx.meta
        dz = torch.empty(z.shape, dtype=torch.float32, device=z.device)
        _token_logprob_bwd_kernel[(z.shape[0],)](z, t, ids, m, lse, g.float().contiguous(), dz, v, vlim,
                                                 z.stride(0), dz.stride(0), st, BLOCK=_BLOCK,
                                                 num_warps=_WARPS, **launch(z))
        return dz.to(dtype).view(shape), None, None, None


def _log_softmax_formula(logits, temperature, vocab_limit):
    """Differentiable equivalent for the backward (temperature as a tensor or scalar)."""
    z = logits.float() / ref._temperature_column(temperature, logits)
    if vocab_limit is not None and vocab_limit < z.shape[-1]:
        z = z.masked_fill(torch.arange(z.shape[-1], device=z.device) >= vocab_limit, float("-inf"))
    return torch.log_softmax(z, -1)


def log_softmax(logits, temperature=1.0, vocab_limit=None):
    """fp32 log-probs [rows, V] of logits [rows, V]; rows >= vocab_limit are excluded (-inf)."""
    return with_torch_grad(_log_softmax_kernel_call, _log_softmax_formula, (logits,),
                           temperature=temperature, vocab_limit=vocab_limit)


def token_logprobs(logits, token_ids, temperature=1.0, vocab_limit=None):
    """fp32 log-prob [rows] of token_ids [rows] under log_softmax(logits, ...)."""
    return _TokenLogprobs.apply(logits, token_ids, temperature, vocab_limit)
