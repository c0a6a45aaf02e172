"""consistent_ops: one numerics contract for trainer and rollout, behind one op set.

Every op whose bits decide a log-prob is a function here; the active backend
(reference | triton | ascend, see dispatch.py) implements it with the same
signature. The rules are written in contract.py; ``contract_fingerprint()`` is
what both engines log and must agree on.
"""
from .contract import KV_BLOCK, fingerprint
from .dispatch import backend_device, backend_name, contract_fingerprint, get_backend, set_backend
from .decoder import DecoderWeights
from .experts import ExpertStack


def attention_varlen(q, k, v, cu_seqlens, scale=None):
    """Packed causal GQA attention; q [T, Hq, D], k/v [T, Hkv, D], cu_seqlens [S+1]."""
    return get_backend().attention_varlen(q, k, v, cu_seqlens, scale)


def attention_paged(q, key_cache, value_cache, block_table, seq_lens, query_start_loc, scale=None,
                    max_query_len=None, out=None):
    """New tokens against a paged KV cache [pages, page_size, Hkv, D] that already holds them.
    max_query_len: an upper bound on any sequence's new tokens, e.g. vLLM's metadata value: a
    launch size for flash-attention-npu (never the bits); the Triton grid comes from shapes and
    the reference reads the lengths, so both ignore it. out: a tensor of q's shape and dtype (e.g.
    vLLM's output rows) that receives the result and is returned: the reference backend writes it
    in place (on CPU), the others' result is copied in."""
    backend = get_backend()
    args = (q, key_cache, value_cache, block_table, seq_lens, query_start_loc, scale, max_query_len)
    if out is not None and backend.NAME == "reference":
        return backend.attention_paged(*args, out=out)
    result = backend.attention_paged(*args)
    return result if out is None else out.copy_(result)


def write_kv_cache(key, value, key_cache, value_cache, slot_mapping):
    return get_backend().write_kv_cache(key, value, key_cache, value_cache, slot_mapping)


def linear(x, weight, bias=None, out_dtype=None):
    return get_backend().linear(x, weight, bias, out_dtype)


def attention_prologue(x, wq, wk, wv, q_norm, k_norm, eps, cos, sin, head_dim):
    """q/k/v [T, heads, head_dim] of attention without bias: q = apply_rope(rms_norm(linear(x, wq)) per
    head), k likewise, v = linear(x, wv), in one call where the backend has one for these tensors (the
    reference backend on CPU inference: the same bits as those ops); None otherwise (run the ops)."""
    fused = getattr(get_backend(), "attention_prologue", None)
    return fused(x, wq, wk, wv, q_norm, k_norm, eps, cos, sin, head_dim) if fused else None


def qk_norm_rope(q, k, v, q_norm, k_norm, eps, cos, sin, cache=None):
    """(apply_rope(rms_norm(q, q_norm, eps), cos, sin), the same of k with k_norm, v contiguous) for q
    [T, Hq, D] and k/v [T, Hkv, D], e.g. column blocks of one q/k/v GEMM output read in place, in one
    call where the backend has one for these tensors (the same bits as those ops); None otherwise.
    cache=(key_cache, value_cache, slot_mapping): k and v are stored there instead, as write_kv_cache
    stores them, and (q, None, None) is returned (None where the call cannot: run the ops, then the write)."""
    fused = getattr(get_backend(), "qk_norm_rope", None)
    return fused(q, k, v, q_norm, k_norm, eps, cos, sin, cache) if fused else None


def linear_add_rms_norm(x, weight, residual, norm_weight, eps):
    """add_rms_norm(linear(x, weight), residual, norm_weight, eps) (no bias): (normed, the new residual)
    in one call where the backend has one for these tensors (the same bits as those ops); None otherwise."""
    fused = getattr(get_backend(), "linear_add_rms_norm", None)
    return fused(x, weight, residual, norm_weight, eps) if fused else None


def mlp(x, gate, up, down):
    """linear(silu_mul(linear(x, gate), linear(x, up)), down) (no bias) in one call where the backend has
    one for these tensors (the same bits as those ops); None otherwise."""
    fused = getattr(get_backend(), "mlp", None)
    return fused(x, gate, up, down) if fused else None


def decode_layer(x, residual, weights, cos, sin, key_cache, value_cache, slot_mapping, block_table, seq_lens,
                 query_start_loc):
    """A whole decoder layer (DecoderWeights: add_rms_norm, attention_prologue, write_kv_cache,
    attention_paged, linear_add_rms_norm, then mlp or moe_route + moe_experts) for a step of one new
    token per sequence (x [S, H], residual [S, H] or None for the first layer), on a paged cache and
    metadata as attention_paged takes them: (the MLP's output, the residual after attention) in one
    call where the backend has one for these tensors (the same bits as those ops); None otherwise."""
    fused = getattr(get_backend(), "decode_layer", None)
    return fused(x, residual, weights, cos, sin, key_cache, value_cache, slot_mapping, block_table, seq_lens,
                 query_start_loc) if fused else None


def row_parallel_partial(x_shard, w_shard):
    return get_backend().row_parallel_partial(x_shard, w_shard)


def ordered_sum(partials):
    return get_backend().ordered_sum(partials)


def finish_row_parallel(total, bias=None, out_dtype=None):
    return get_backend().finish_row_parallel(total, bias, out_dtype)


def row_parallel_linear(x, weight, tp_size, bias=None, out_dtype=None):
    """TP=tp_size row-parallel linear emulated in one process: contiguous K-shards,
    partials in rank order. A real rank group gets the same bits with
    row_parallel_partial + parallel.gather_ordered_sum + finish_row_parallel."""
    k = x.shape[-1]
    if k % tp_size:
        raise ValueError(f"K={k} is not divisible by tp_size={tp_size}")
    parts = [row_parallel_partial(xs, ws) for xs, ws in
             zip(x.split(k // tp_size, -1), weight.split(k // tp_size, -1))]
    return finish_row_parallel(ordered_sum(parts), bias, out_dtype or x.dtype)


def rms_norm(x, weight, eps):
    return get_backend().rms_norm(x, weight, eps)


def add_rms_norm(x, residual, weight, eps):
    return get_backend().add_rms_norm(x, residual, weight, eps)


def rope_cos_sin(positions, head_dim, theta, scaling=None):
    return get_backend().rope_cos_sin(positions, head_dim, theta, scaling)


def apply_rope(x, cos, sin):
    return get_backend().apply_rope(x, cos, sin)


def silu_mul(gate, up):
    return get_backend().silu_mul(gate, up)


def embedding(ids, weight):
    return get_backend().embedding(ids, weight)


def moe_route(x, gate_weight, top_k, norm_topk_prob=True):
    return get_backend().moe_route(x, gate_weight, top_k, norm_topk_prob)


def moe_expert_contributions(x, ids, weights, experts, local_experts=None):
    """experts: e -> (w_gate, w_up, w_down), a mapping or an ExpertStack (stacked weights)."""
    return get_backend().moe_expert_contributions(x, ids, weights, experts, local_experts)


def moe_combine(contrib, out_dtype):
    return get_backend().moe_combine(contrib, out_dtype)


def moe_experts(x, ids, weights, experts):
    """moe_combine(moe_expert_contributions(x, ids, weights, experts)[0], x.dtype) for an ExpertStack
    holding every expert (no TP exchange in between), in one call where the backend has one for these
    tensors (the same bits as those ops); None otherwise (run the two)."""
    fused = getattr(get_backend(), "moe_experts", None)
    return fused(x, ids, weights, experts) if fused else None


def log_softmax(logits, temperature=1.0, vocab_limit=None, truncation=None):
    """fp32 log-probs [rows, V]; ``truncation`` = (top_k, top_p, min_p) scalars or per-row
    tensors: the truncated distribution's log-probs (truncate_logprobs), None: untruncated."""
    lp = get_backend().log_softmax(logits, temperature, vocab_limit)
    return lp if truncation is None else truncate_logprobs(lp, *truncation)


def token_logprobs(logits, token_ids, temperature=1.0, vocab_limit=None, truncation=None):
    """fp32 log-prob [rows] of token_ids; with ``truncation`` (see log_softmax) through the
    full truncated rows, so it is log_softmax(..., truncation) gathered, bit for bit."""
    if truncation is None:
        return get_backend().token_logprobs(logits, token_ids, temperature, vocab_limit)
    lp = log_softmax(logits, temperature, vocab_limit, truncation)
    return lp.gather(-1, token_ids.long().reshape(-1, 1)).reshape(-1)


def truncate_logprobs(logp, top_k=0, top_p=1.0, min_p=0.0):
    """Top-k / top-p / min-p (contract.COMMON["truncation"]) of contract log-probs logp
    [rows, V] (log_softmax's output); settings are scalars or per-row tensors [rows].
    Returns the truncated distribution's fp32 log-probs, -inf outside the kept set."""
    return get_backend().truncate_logprobs(logp, top_k, top_p, min_p)


def truncation_active(top_k=0, top_p=1.0, min_p=0.0) -> bool:
    """Whether these (scalar) settings truncate at all (else truncate_logprobs is skipped)."""
    return (top_k or 0) > 0 or (1.0 if top_p is None else top_p) < 1.0 or (min_p or 0.0) > 0.0


__all__ = [n for n in dir() if not n.startswith("_")]
