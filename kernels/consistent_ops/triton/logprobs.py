"""Log-probs on Triton: fp32 log-softmax with temperature and the padded-vocabulary rule.

One row per program. The vocabulary is walked in blocks of _BLOCK columns, in order:
pass 1 takes the max (exact in any order), pass 2 adds exp(z - m) into a _BLOCK-wide
fp32 accumulator and reduces it by one fixed tree; so a row's bits depend on V and the
row alone. exp and log are evaluated in fp64 and rounded to fp32 (the contract's
transcendentals); z = logits / T is an IEEE division by an fp32 temperature.
"""
import torch
import triton
import triton.language as tl

from ..contract import TRITON_TILES
from ..reference import logprobs as ref
from .autograd import with_torch_grad
from .common import EXACT, SCALAR_DIV_RN, exp32, log32

_BLOCK, _WARPS = TRITON_TILES["logprob_block"], 8


@triton.jit
def _z(Row, cols, vlim, t):
    """z = logits / T for these columns; columns >= vocab_limit are -inf (excluded)."""
    x = tl.load(Row + cols, mask=cols < vlim, other=float("-inf")).to(tl.float32)
    return tl.div_rn(x, t)


@triton.jit
def _row_max_lse(Row, vlim, t, BLOCK: tl.constexpr):
    cols = tl.arange(0, BLOCK)
    mx = tl.full([BLOCK], float("-inf"), tl.float32)
    for c0 in range(0, vlim, BLOCK):          # pass 1: m = max z
        mx = tl.maximum(mx, _z(Row, c0 + cols, vlim, t))
    m = tl.max(mx, 0)
    acc = tl.zeros([BLOCK], tl.float32)
    for c0 in range(0, vlim, BLOCK):          # pass 2: sum exp(z - m), blocks in order
        zs = _z(Row, c0 + cols, vlim, t) - m
        acc += exp32(zs)
    lse = log32(tl.sum(acc, 0))
    return m, lse


@triton.jit
def _log_softmax_kernel(Z, Temp, Out, V, vlim, stride_z, stride_o, stride_t, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    t = tl.load(Temp + row * stride_t)
    m, lse = _row_max_lse(Z + row * stride_z, vlim, t, BLOCK)
    cols = tl.arange(0, BLOCK)
    for c0 in range(0, V, BLOCK):             # pass 3: logp = (z - m) - lse
        c = c0 + cols
        tl.store(Out + row * stride_o + c, (_z(Z + row * stride_z, c, vlim, t) - m) - lse, mask=c < V)


@triton.jit
def _token_logprob_kernel(Z, Temp, Ids, Out, M, LSE, vlim, stride_z, stride_t, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    t = tl.load(Temp + row * stride_t)
    m, lse = _row_max_lse(Z + row * stride_z, vlim, t, BLOCK)
    tok = tl.load(Ids + row)
    if SCALAR_DIV_RN:
        z = tl.div_rn(tl.load(Z + row * stride_z + tok).to(tl.float32), t)
    else:  # triton-ascend: the same quotient on a [1]-shaped load (see common.SCALAR_DIV_RN)
        z = tl.max(tl.div_rn(tl.load(Z + row * stride_z + tok + tl.arange(0, 1)).to(tl.float32), t), 0)
    z = tl.where(tok < vlim, z, float("-inf"))
    tl.store(Out + row, (z - m) - lse)
    tl.store(M + row, m)            # saved for the backward
    tl.store(LSE + row, lse)


@triton.jit
def _token_logprob_bwd_kernel(Z, Temp, Ids, M, LSE, G, DZ, V, vlim, stride_z, stride_dz, stride_t,
                              BLOCK: tl.constexpr):
    """d logp(tok) / d logits = (onehot(tok) - softmax(z)) * g / T, one pass per row."""
    row = tl.program_id(0).to(tl.int64)
    t = tl.load(Temp + row * stride_t)
    m, lse = tl.load(M + row), tl.load(LSE + row)
    tok = tl.load(Ids + row)
    gt = tl.load(G + row) / t
    cols = tl.arange(0, BLOCK)
    for c0 in range(0, V, BLOCK):
        c = c0 + cols
        p = tl.exp((_z(Z + row * stride_z, c, vlim, t) - m) - lse)
        tl.store(DZ + row * stride_dz + c, (tl.where(c == tok, 1.0, 0.0) - p) * gt, mask=c < V)


def _prepare(logits, temperature, vocab_limit):
    z = logits.reshape(-1, logits.shape[-1])
    z = z if z.stride(-1) == 1 else z.contiguous()
    t = ref._temperature_column(temperature, z).reshape(-1).contiguous()
    v = z.shape[-1]
    vlim = v if vocab_limit is None else min(int(vocab_limit), v)
    return z, t, (0 if t.numel() == 1 else 1), v, vlim


def _log_softmax_kernel_call(logits, temperature, vocab_limit):
    z, t, st, v, vlim = _prepare(logits, temperature, vocab_limit)
    out = torch.empty(z.shape, dtype=torch.float32, device=z.device)
    _log_softmax_kernel[(z.shape[0],)](z, t, out, v, vlim, z.stride(0), out.stride(0), st,
                                       BLOCK=_BLOCK, num_warps=_WARPS, **EXACT)
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
        _token_logprob_kernel[(rows,)](z, t, ids, out, m, lse, vlim, z.stride(0), st,
                                       BLOCK=_BLOCK, num_warps=_WARPS, **EXACT)
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
                                                 num_warps=_WARPS, **EXACT)
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
