"""Truncated log-probs (top-k / top-p / min-p): contract.COMMON["truncation"], the spec.

Every step is either exact (sort, integer fixed-point sums, comparisons) or one IEEE
operation, so a row's kept set depends on the row and its settings alone. The kept set
is a prefix of the rank order (top-k, top-p and min-p each keep a prefix), decided on a
detached copy; the renormalisation is the contract's log-softmax, so gradients flow
through the kept tokens as through any log-softmax.
"""
import torch

from ..contract import TRUNCATION_FIXED_BITS
from .logprobs import NEG_INF, log_softmax

_SCALE = float(2 ** TRUNCATION_FIXED_BITS)


def row_settings(top_k, top_p, min_p, rows, device):
    """Per-row columns [rows, 1]: top_k int64 (<= 0: off), top_p fp64, min_p fp32."""
    def column(value, dtype):
        if not isinstance(value, torch.Tensor):     # a device fill, not a host-to-device copy
            return torch.full((rows, 1), value, dtype=dtype, device=device)
        t = value.to(device=device, dtype=dtype)
        return t.reshape(-1, 1) if t.ndim else t.reshape(1, 1).expand(rows, 1)
    return column(top_k, torch.int64), column(top_p, torch.float64), column(min_p, torch.float32)


def rows_off(logp, top_k, top_p, min_p):
    """bool [rows, 1]: rows with every setting off, which are returned unchanged."""
    k, p, mp = row_settings(top_k, top_p, min_p, logp.shape[0], logp.device)
    return ((k <= 0) | (k >= logp.shape[-1])) & (p >= 1.0) & (mp <= 0)


def kept_ranks(q, prob, top_k, top_p, min_p):
    """n per row [rows, 1] from the rank-ordered fixed-point masses q (int64) and fp32
    probabilities prob, both [rows, V]: the length of the kept prefix (>= 1)."""
    v = q.shape[-1]
    n_k = torch.where((top_k > 0) & (top_k < v), top_k, v)
    rank = torch.arange(v, device=q.device)
    q_k = torch.where(rank < n_k, q, 0)
    before = torch.cumsum(q_k, -1) - q_k                  # C_r: exact int64
    mass = q_k.sum(-1, keepdim=True)                      # S: exact int64
    in_p = (before.double() < top_p * mass.double()) | (top_p >= 1.0)
    n_p = torch.where(rank < n_k, in_p, False).sum(-1, keepdim=True)
    n_m = torch.where(min_p > 0, (prob >= min_p * prob[:, :1]).sum(-1, keepdim=True), v)
    return torch.clamp(torch.minimum(torch.minimum(n_k, n_p), n_m), min=1)


def fixed_point(logp_sorted):
    """prob = exp(logp) (fp64, rounded to fp32) and q = floor(prob * 2^bits) as int64."""
    prob = torch.exp(logp_sorted.double()).float()
    return torch.floor(prob.double() * _SCALE).long(), prob


def keep_mask(logp, top_k=0, top_p=1.0, min_p=0.0):
    """bool [rows, V]: the tokens the truncation keeps (no gradient)."""
    logp = logp.detach()
    k, p, mp = row_settings(top_k, top_p, min_p, logp.shape[0], logp.device)
    sorted_lp, order = torch.sort(logp, stable=True, dim=-1, descending=True)
    q, prob = fixed_point(sorted_lp)
    n = kept_ranks(q, prob, k, p, mp)
    in_prefix = torch.arange(logp.shape[-1], device=logp.device) < n
    return torch.zeros_like(in_prefix).scatter(-1, order, in_prefix)


def truncate_logprobs(logp, top_k=0, top_p=1.0, min_p=0.0):
    """fp32 [rows, V] log-probs of the truncated, renormalised distribution (-inf outside)."""
    kept = log_softmax(torch.where(keep_mask(logp, top_k, top_p, min_p), logp, NEG_INF), 1.0)
    return torch.where(rows_off(logp, top_k, top_p, min_p), logp, kept)
