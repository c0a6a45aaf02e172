"""consistent_ops.decode_layer on CPU: one native call per decoder layer of a decode step.

A CPU decode step's kernels are small (tens of microseconds), so the Python around them (a wrapper,
its checks and allocations per op, vLLM's attention layer) cost as much as they did. The fused call
runs the same native kernels in the same order as the ops (dot32.c decode_layer32), so the bits are
the ops' bits; anything it does not cover returns None and the caller runs the ops."""
import torch

from ..contract import KV_CHUNK, attention_scale
from . import native
from .attention import _PagedLayout
from .linear import _fusable


def decode_layer(x, residual, w, cos, sin, key_cache, value_cache, slot_mapping, block_table, seq_lens,
                 query_start_loc):
    d = w.q_norm.shape[0]
    t = x.shape[0]
    moe = w.experts is not None
    mlp = (w.router, w.experts.gate_up, w.experts.down) if moe else (w.gate, w.up, w.down)
    if (not _fusable(x, *(u for u in (residual, w.in_norm, w.wq, w.wk, w.wv, w.q_norm, w.k_norm, w.wo, w.post_norm,
                                      *mlp, key_cache, value_cache) if u is not None))
            or not _dense(x, residual, w.in_norm, w.wq, w.wk, w.wv, w.q_norm, w.k_norm, w.wo, w.post_norm)
            or (not moe and not _dense(*mlp)) or (moe and not _stack(w, mlp))
            or w.wq.stride(0) != w.wk.stride(0) or w.wv.stride(0) != w.wq.stride(0)
            or cos.shape != (t, d // 2) or sin.shape != cos.shape or cos.dtype != torch.float32
            or sin.dtype != torch.float32 or not cos.is_contiguous() or not sin.is_contiguous()
            or key_cache.stride() != value_cache.stride() or key_cache.shape[2:] != (w.wk.shape[0] // d, d)
            or slot_mapping.dtype != torch.int64 or slot_mapping.shape != (t,) or not slot_mapping.is_contiguous()):
        return None
    layout = _PagedLayout.of((t, w.wq.shape[0] // d), x.device, key_cache, block_table, seq_lens, query_start_loc)
    if not layout.decode:
        return None
    return native.decode_layer(x, residual, w, cos, sin, key_cache, value_cache, slot_mapping, layout,
                               attention_scale(d), KV_CHUNK)


def _dense(*tensors):
    return all(u is None or u.is_contiguous() for u in tensors)


def _stack(w, mlp):
    """A MoE block the call covers: an ExpertStack of every expert (ids 0 .. E-1), a contiguous router,
    1 <= top_k <= E (as moe_route's native path)."""
    return (w.experts.local == list(range(w.router.shape[0])) and w.router.is_contiguous()
            and 0 < w.top_k <= w.router.shape[0] and mlp[1].stride(-1) == 1 and mlp[2].stride(-1) == 1)
