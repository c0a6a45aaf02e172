"""Qwen3 and Qwen3-MoE layer math, written once on consistent_ops.

The trainer module (causal_lm.py) and the vLLM model class both build these
layers and pass an ``attend(layer_idx, q, k, v)`` callable: packed varlen
attention for training, paged attention over vLLM's KV cache for rollout.
Everything else (projections, norms, RoPE, MLP/MoE, residual order) is this file.
"""
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import consistent_ops as co
from consistent_ops import parallel

from .config import ModelConfig
from .layers import (ColumnParallelLinear, Embedding, ReplicatedLinear, RMSNorm, RowParallelLinear,
                     TensorParallel, _check_divisible)


class RotaryTable:
    """cos/sin [T, D/2] fp32 for one forward. Deliberately a plain object, not a tensor
    argument: FSDP mixed precision casts floating tensors passed to a wrapped layer's
    forward to its param dtype, which would round these fp32 tables to bf16."""

    def __init__(self, positions, head_dim, theta):
        self.cos, self.sin = co.rope_cos_sin(positions, head_dim, theta)

    def apply(self, x):
        return co.apply_rope(x, self.cos, self.sin)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel):
        super().__init__()
        _check_divisible("num_attention_heads", cfg.num_heads, tp.size)
        _check_divisible("num_key_value_heads", cfg.num_kv_heads, tp.size)
        d, dt, b = cfg.head_dim, cfg.dtype, cfg.attention_bias
        self.q_proj = ColumnParallelLinear(cfg.hidden_size, cfg.num_heads * d, tp, b, dt)
        self.k_proj = ColumnParallelLinear(cfg.hidden_size, cfg.num_kv_heads * d, tp, b, dt)
        self.v_proj = ColumnParallelLinear(cfg.hidden_size, cfg.num_kv_heads * d, tp, b, dt)
        self.o_proj = RowParallelLinear(cfg.num_heads * d, cfg.hidden_size, tp, b, dt)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps, dt)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps, dt)
        self.head_dim = d

    def qkv(self, x, rope):
        """Projections, per-head q/k RMSNorm, RoPE. Returns q [T, Hq, D], k, v [T, Hkv, D]."""
        t, d = x.shape[0], self.head_dim
        q = self.q_norm(self.q_proj(x).view(t, -1, d))
        k = self.k_norm(self.k_proj(x).view(t, -1, d))
        v = self.v_proj(x).view(t, -1, d)
        return rope.apply(q), rope.apply(k), v

    def forward(self, x, rope, attend):
        q, k, v = self.qkv(x, rope)
        return self.o_proj(attend(q, k, v).reshape(x.shape[0], -1))


class MLP(nn.Module):
    def __init__(self, hidden, inter, tp, dtype):
        super().__init__()
        self.gate_proj = ColumnParallelLinear(hidden, inter, tp, dtype=dtype)
        self.up_proj = ColumnParallelLinear(hidden, inter, tp, dtype=dtype)
        self.down_proj = RowParallelLinear(inter, hidden, tp, dtype=dtype)

    def forward(self, x):
        return self.down_proj(co.silu_mul(self.gate_proj(x), self.up_proj(x)))


class Expert(nn.Module):
    """One expert, whole on the rank that owns it (experts are placed, not split)."""

    def __init__(self, hidden, inter, dtype):
        super().__init__()
        self.gate_proj = ReplicatedLinear(hidden, inter, dtype=dtype)
        self.up_proj = ReplicatedLinear(hidden, inter, dtype=dtype)
        self.down_proj = ReplicatedLinear(inter, hidden, dtype=dtype)

    def weights(self, dtype):
        return tuple(m.weight.to(dtype) for m in (self.gate_proj, self.up_proj, self.down_proj))


class SparseMoeBlock(nn.Module):
    """Router + experts. Under TP the experts are spread over the ranks (contiguous id
    ranges) and their per-slot contributions exchanged by owner, so the result does
    not depend on where an expert lives."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel):
        super().__init__()
        _check_divisible("num_experts", cfg.num_experts, tp.size)
        per_rank = cfg.num_experts // tp.size
        local = range(tp.rank * per_rank, (tp.rank + 1) * per_rank) if tp.sharded else range(cfg.num_experts)
        self.gate = ReplicatedLinear(cfg.hidden_size, cfg.num_experts, dtype=cfg.dtype)
        self.experts = nn.ModuleDict({str(e): Expert(cfg.hidden_size, cfg.moe_intermediate_size, cfg.dtype)
                                      for e in local})
        self.top_k, self.norm_topk_prob, self.tp = cfg.top_k, cfg.norm_topk_prob, tp
        self._stack = None

    _PROJ = ("gate_proj", "up_proj", "down_proj")

    def stack_experts(self):
        """Keep the experts' weights in three stacked tensors, each expert's parameters
        becoming views of them (names, loading and bits unchanged): the rollout's grouped
        kernels then read the stacks in place (consistent_ops.ExpertStack)."""
        mods = [self.experts[str(e)] for e in sorted(map(int, self.experts))]
        stacks = []
        for proj in self._PROJ:
            stack = torch.stack([getattr(m, proj).weight.detach() for m in mods])
            for m, view in zip(mods, stack):
                getattr(m, proj).weight = nn.Parameter(view, requires_grad=getattr(m, proj).weight.requires_grad)
            stacks.append(stack)
        self._stack = co.ExpertStack(*stacks, sorted(map(int, self.experts)))

    def _experts(self, dtype):
        """The stacks while the parameters are still their views (FSDP or ``.to()`` would
        replace them) and no gradient is wanted (a stack carries none), else each expert's
        weights."""
        first = self.experts[str(self._stack.local[0])] if self._stack is not None else None
        if (first is not None and self._stack.gate.dtype == dtype
                and not (torch.is_grad_enabled() and first.gate_proj.weight.requires_grad)
                and all(getattr(first, p).weight.data_ptr() == s.data_ptr()
                        for p, s in zip(self._PROJ, (self._stack.gate, self._stack.up, self._stack.down)))):
            return self._stack
        return {int(e): m.weights(dtype) for e, m in self.experts.items()}

    def forward(self, x):
        ids, w = co.moe_route(x, self.gate.weight.to(x.dtype), self.top_k, self.norm_topk_prob)
        experts = self._experts(x.dtype)
        contrib, owned = co.moe_expert_contributions(x, ids, w, experts, sorted(experts))
        if self.tp.sharded:
            contrib = parallel.gather_owned(contrib, owned, self.tp.group)
        return co.moe_combine(contrib, x.dtype)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, idx: int, tp: TensorParallel):
        super().__init__()
        self.self_attn = Attention(cfg, tp)
        self.mlp = (SparseMoeBlock(cfg, tp) if idx in cfg.moe_layers
                    else MLP(cfg.hidden_size, cfg.intermediate_size, tp, cfg.dtype))
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.dtype)

    def forward(self, hidden, residual, rope, attend):
        """HF order: x = x + attn(norm(x)); x = x + mlp(norm(x)); the residual add is
        fused into the next norm (the same bf16 add either way)."""
        h, residual = self.input_layernorm(hidden, residual, fuse_residual=True)
        h = self.self_attn(h, rope, attend)
        h, residual = self.post_attention_layernorm(h, residual, fuse_residual=True)
        return self.mlp(h), residual


class Qwen3Model(nn.Module):
    """Embedding, decoder layers, final norm: hidden states [T, H] for flat tokens."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel = TensorParallel()):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, cfg.dtype)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, tp) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.dtype)
        self.gradient_checkpointing = False   # the name transformers' switch sets

    def forward(self, input_ids, positions, attend, hidden=None):
        """attend(layer_idx, q, k, v) -> [T, Hq, D]; ``hidden`` overrides the embedding."""
        if hidden is None:
            hidden = self.embed_tokens(input_ids, self.cfg.dtype)
        rope = RotaryTable(positions, self.cfg.head_dim, self.cfg.rope_theta)
        residual = None
        recompute = self.gradient_checkpointing and torch.is_grad_enabled()
        for i, layer in enumerate(self.layers):
            args = (hidden, residual, rope, lambda q, k, v, i=i: attend(i, q, k, v))
            # Recomputation repeats the same ops on the same inputs: the same bits.
            hidden, residual = (checkpoint(layer, *args, use_reentrant=False) if recompute else layer(*args))
        return self.norm(hidden, residual, fuse_residual=True)[0]


class LMHead(ColumnParallelLinear):
    """Vocab-parallel output layer: fp32 logits; shards are concatenated (exact)."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel):
        super().__init__(cfg.hidden_size, cfg.vocab_size, tp, dtype=cfg.dtype, out_dtype=torch.float32)

    def forward(self, x):
        logits = super().forward(x)
        return parallel.gather_concat(logits, -1, self.tp.group) if self.tp.sharded else logits
