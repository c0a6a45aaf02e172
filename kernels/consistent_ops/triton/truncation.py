"""Truncated log-probs (top-k / top-p / min-p) on the device: contract.COMMON["truncation"].

Steps, none of which reads a value back to the host (no syncs; grids come from shapes):
  1. stable descending sort of the row (torch.sort: exact, ties keep the lower id first);
  2. kernel: prob = exp(logp) in fp64 rounded to fp32 (the backend's transcendentals) and
     its int64 fixed point q (exact, so the sums of step 3 are order-free);
  3. the kept prefix length n per row from exact int64 sums and IEEE compares (torch ops,
     the reference's function: these steps have one possible result);
  4. kernel: keep = the tokens ranked before the row's boundary token (value, id), i.e.
     logp > boundary, or equal with an id <= the boundary's;
  5. the backend's log-softmax of the kept row (renormalisation; autograd as there).
"""
import torch
import triton
import triton.language as tl

from ..contract import TRUNCATION_FIXED_BITS
from ..reference.logprobs import NEG_INF
from ..reference.truncation import kept_ranks, row_settings, rows_off
from .common import launch, pdl_enter
from .logprobs import log_softmax

_BLOCK = 1024


@triton.jit
def _fixed_point_kernel(LP, Q, P, V, stride, SCALE: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    lp = tl.load(LP + row * stride + c, mask=c < V, other=float("-inf"))
    p = tl.exp(lp.to(tl.float64)).to(tl.float32)
    q = (p.to(tl.float64) * SCALE).to(tl.int64)       # p >= 0: truncation == floor
    tl.store(P + row * stride + c, p, mask=c < V)
    tl.store(Q + row * stride + c, q, mask=c < V)


@triton.jit
def _keep_kernel(LP, BV, BI, Keep, V, stride, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    lp = tl.load(LP + row * stride + c, mask=c < V, other=float("-inf"))
    bv, bi = tl.load(BV + row), tl.load(BI + row)
    keep = (lp > bv) | ((lp == bv) & (c <= bi))
    tl.store(Keep + row * stride + c, keep.to(tl.int8), mask=c < V)


def keep_mask(logp, top_k=0, top_p=1.0, min_p=0.0):
    """bool [rows, V]: the tokens the truncation keeps (no gradient)."""
    lp = logp.detach().float().contiguous()
    rows, v = lp.shape
    k, p, mp = row_settings(top_k, top_p, min_p, rows, lp.device)
    sorted_lp, order = torch.sort(lp, stable=True, dim=-1, descending=True)
    q = torch.empty(lp.shape, dtype=torch.int64, device=lp.device)
    prob = torch.empty_like(lp)
    grid = (rows, triton.cdiv(v, _BLOCK))
    _fixed_point_kernel[grid](sorted_lp, q, prob, v, v, SCALE=float(2 ** TRUNCATION_FIXED_BITS),
                              BLOCK=_BLOCK, **launch(sorted_lp))
    last = kept_ranks(q, prob, k, p, mp) - 1                     # [rows, 1] boundary rank
    bound_v = torch.gather(sorted_lp, -1, last).reshape(-1).contiguous()
    bound_i = torch.gather(order, -1, last).reshape(-1).contiguous()
    keep = torch.empty(lp.shape, dtype=torch.int8, device=lp.device)
    _keep_kernel[grid](lp, bound_v, bound_i, keep, v, v, BLOCK=_BLOCK, **launch(lp))
    return keep.bool()


def truncate_logprobs(logp, top_k=0, top_p=1.0, min_p=0.0):
    """fp32 [rows, V] log-probs of the truncated, renormalised distribution (-inf outside)."""
    kept = log_softmax(torch.where(keep_mask(logp, top_k, top_p, min_p), logp, NEG_INF), 1.0)
    return torch.where(rows_off(logp, top_k, top_p, min_p), logp, kept)
