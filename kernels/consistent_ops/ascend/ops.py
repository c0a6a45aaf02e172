"""The remaining ops on Ascend: the Triton kernels (chunked to the launch limit) and the
exact or elementwise ops as PyTorch on the NPU.

No fp64 on the NPU: RoPE's fp64 cos/sin tables (a function of the position alone) are
computed on the host CPU exactly as the reference computes them, and silu_mul takes the
fp32 exp of the device (Ascend's transcendentals are fp32, contract.ACCUMULATION).
"""
import torch

from ..reference import pointwise as _ref_pointwise
from ..triton import logprobs as _logprobs, moe as _moe, norm as _norm
from .rows import MAX_PROGRAMS, chunked

_MOE_TOKENS = 16384   # router + expert launches stay far below the limit at this many tokens


def rms_norm(x, weight, eps):
    x2 = x.reshape(-1, x.shape[-1])
    return chunked(_norm.rms_norm, MAX_PROGRAMS, (x2,), weight, eps).view(x.shape)


def add_rms_norm(x, residual, weight, eps):
    if residual is None:
        return rms_norm(x, weight, eps), x
    h = x.shape[-1]
    y, r = chunked(_norm.add_rms_norm, MAX_PROGRAMS, (x.reshape(-1, h), residual.reshape(-1, h)), weight, eps)
    return y.view(x.shape), r.view(x.shape)


def _with_temperature(fn, logits, extra, temperature, vocab_limit):
    """Chunk rows; a per-row temperature tensor is chunked with them."""
    z = logits.reshape(-1, logits.shape[-1])
    t = temperature
    if torch.is_tensor(t) and t.numel() > 1:
        rows = (z, *extra, t.reshape(-1))
        return chunked(lambda *r: fn(*r[:-1], r[-1], vocab_limit), MAX_PROGRAMS, rows)
    return chunked(lambda *r: fn(*r, t, vocab_limit), MAX_PROGRAMS, (z, *extra))


def log_softmax(logits, temperature=1.0, vocab_limit=None):
    return _with_temperature(_logprobs.log_softmax, logits, (), temperature, vocab_limit).view(logits.shape)


def token_logprobs(logits, token_ids, temperature=1.0, vocab_limit=None):
    return _with_temperature(_logprobs.token_logprobs, logits, (token_ids.reshape(-1),), temperature, vocab_limit)


def moe_route(x, gate_weight, top_k, norm_topk_prob=True):
    return chunked(_moe.moe_route, _MOE_TOKENS, (x.reshape(-1, x.shape[-1]),), gate_weight, top_k, norm_topk_prob)


def moe_expert_contributions(x, ids, weights, experts, local_experts=None):
    return chunked(_moe.moe_expert_contributions, _MOE_TOKENS, (x, ids, weights), experts, local_experts)


def rope_cos_sin(positions, head_dim, theta, scaling=None):
    cos, sin = _ref_pointwise.rope_cos_sin(positions.cpu(), head_dim, theta, scaling)
    return cos.to(positions.device), sin.to(positions.device)


def silu_mul(gate, up):
    g = gate.float()
    return (g / (1.0 + torch.exp(-g)) * up.float()).to(gate.dtype)
