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
                     TensorParallel, _check_divisible, _write)


class RotaryTable:
    """cos/sin [T, D/2] fp32 for one forward. Deliberately a plain object, not a tensor
    argument: FSDP mixed precision casts floating tensors passed to a wrapped layer's
    forward to its param dtype, which would round these fp32 tables to bf16."""

    def __init__(self, positions, head_dim, theta, scaling=None):
        self.cos, self.sin = co.rope_cos_sin(positions, head_dim, theta, scaling)

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
        self.fused = False      # the rollout's modules (vllm/model.py): fused native calls where unhooked
        self.qkv_weight = None  # the rollout's: q/k/v weights as row blocks of one tensor (fuse)

    def qkv(self, x, rope, cache=None):
        """Projections, per-head q/k RMSNorm, RoPE. Returns q [T, Hq, D], k, v [T, Hkv, D]; or, given the
        rollout's cache (key cache, value cache, slot mapping) and a backend that can, (q, None, None)
        with k and v already stored there (co.qk_norm_rope: one launch fewer a layer)."""
        qp, kp, vp, qn, kn = _children(self, "q_proj", "k_proj", "v_proj", "q_norm", "k_norm")
        projections, norms = (qp, kp, vp), (qn, kn)
        if self.fused and qp.bias is None and not _hooked(*projections, *norms):
            out = co.attention_prologue(x, *_weights(qp, kp, vp, qn, kn), qn.eps, rope.cos, rope.sin, self.head_dim)
            if out is not None:
                return out
        t, d = x.shape[0], self.head_dim
        if self.qkv_weight is not None and not _hooked(*projections) and _rows_of(self.qkv_weight, projections):
            # one GEMM: each output is the dot product its own projection computes (contract "linear")
            out = co.linear(x, self.qkv_weight.to(x.dtype)).split([m.weight.shape[0] for m in projections], 1)
            q, k, v = (part.view(t, -1, d) for part in out)
            # the norms, RoPE and v's copy read q/k/v in place, in one call where the backend has one
            fused = None
            if not _hooked(*norms):
                args = (q, k, v, qn.weight, kn.weight, qn.eps, rope.cos, rope.sin)
                fused = None if cache is None else co.qk_norm_rope(*args, cache=cache)
                fused = fused or co.qk_norm_rope(*args)
            if fused is not None:
                return fused
            v = v.contiguous()
        else:
            q, k, v = (m(x).view(t, -1, d) for m in projections)
        return rope.apply(qn(q)), rope.apply(kn(k)), v

    def heads(self, x, rope, attend, cache=None):
        """The attention output [T, Hq * D] (o_proj's input). cache: see qkv; attend then gets k = v = None
        where the cache holds them already."""
        q, k, v = self.qkv(x, rope, cache)
        return attend(q, k, v).reshape(x.shape[0], -1)

    def forward(self, x, rope, attend):
        return self.o_proj(self.heads(x, rope, attend))


def fuse(model):
    """Let every Attention and MLP of model take fused native calls, and every bias-free Attention
    project q, k and v in one GEMM (the rollout: vllm/model.py; never the trainer's modules, whose
    parameters FSDP and the optimizer own)."""
    for module in model.modules():
        if isinstance(module, (Attention, MLP, SparseMoeBlock)):
            module.fused = True
        if isinstance(module, Attention) and module.q_proj.bias is None:
            module.qkv_weight = _stack_rows(module.q_proj, module.k_proj, module.v_proj)


def _stack_rows(*linears):
    """One tensor holding these linears' weights as consecutive row blocks; the weights become
    views of it, so in-place weight loads (vLLM's, verl's syncs) land in it."""
    stacked = torch.cat([m.weight.detach() for m in linears])
    start = 0
    for m in linears:
        rows = m.weight.shape[0]
        m.weight = nn.Parameter(stacked[start:start + rows], requires_grad=m.weight.requires_grad)
        start += rows
    return stacked


def _rows_of(stacked, linears):
    """Whether the linears' weights are still the consecutive row blocks of stacked (a weight
    replaced rather than written in place would leave the stack stale: then each runs its own)."""
    at = stacked.data_ptr()
    for m in linears:
        if m.weight.data_ptr() != at:
            return False
        at += m.weight.numel() * m.weight.element_size()
    return True


def _children(module, *names):
    """module's submodules by name, as ``module.name`` gives them: nn.Module.__getattr__ costs ~1.2 us a
    lookup on Python 3.11 (the failed instance lookup raises first), and a decode layer made ~25."""
    children = module._modules
    return [children[n] for n in names]


def _weights(*modules):
    """The modules' ``weight`` parameters (see _children), for the rollout's fused calls: there every
    module is the rollout's own, its weight registered (FSDP's trainer modules may hold plain tensors)."""
    return [m._parameters["weight"] for m in modules]


def _hooked(*modules):
    """Whether a forward hook sits on any of these modules (check --localize's capture and its
    test perturbation): a fused call would skip it."""
    return any(m._forward_hooks or m._forward_pre_hooks for m in modules)


class MLP(nn.Module):
    def __init__(self, hidden, inter, tp, dtype):
        super().__init__()
        self.gate_proj = ColumnParallelLinear(hidden, inter, tp, dtype=dtype)
        self.up_proj = ColumnParallelLinear(hidden, inter, tp, dtype=dtype)
        self.down_proj = RowParallelLinear(inter, hidden, tp, dtype=dtype)
        self.fused = False      # as Attention.fused

    def forward(self, x):
        g, u, d = _children(self, "gate_proj", "up_proj", "down_proj")
        if self.fused and d.tp.size == 1 and not _hooked(g, u, d):
            out = co.mlp(x, *_weights(g, u, d))
            if out is not None:
                return out
        return d(co.silu_mul(g(x), u(x)))


class Experts(nn.Module):
    """This rank's experts (whole: experts are placed, not split), stacked as transformers 5
    keeps them: ``gate_up_proj`` [L, 2I, H] (each expert's gate rows, then its up rows) and
    ``down_proj`` [L, H, I], for the contiguous expert ids ``local``. The grouped kernels
    read the stacks in place, forward and backward (consistent_ops.ExpertStack)."""

    _HALF = {"gate": 0, "up": 1}                                   # rows of gate_up_proj
    _PARTS = {"gate_up_proj": ("gate", "up"), "down_proj": ("down",)}

    def __init__(self, local, hidden, inter, dtype):
        super().__init__()
        self.local = list(local)
        self.gate_up_proj = nn.Parameter(torch.empty(len(self.local), 2 * inter, hidden, dtype=dtype))
        self.down_proj = nn.Parameter(torch.empty(len(self.local), hidden, inter, dtype=dtype))
        self._parts = set()     # (expert, part) loaded one by one (load_expert)
        self._stack = None      # (storage state, ExpertStack): stack's last

    def stack(self, dtype):
        """The stacks as a co.ExpertStack in dtype. Outside autograd, in the stacks' own dtype (views, so
        in-place loads land in them), the last one is kept while it views the same storage (a decode step
        builds one per layer)."""
        gu, dn = self.gate_up_proj, self.down_proj
        if torch.is_grad_enabled() or gu.dtype != dtype or dn.dtype != dtype:
            return co.ExpertStack(gu.to(dtype), dn.to(dtype), self.local)
        state = (torch.is_inference_mode_enabled(), gu.data_ptr(), dn.data_ptr(), gu.shape, dn.shape, gu.stride(),
                 dn.stride())
        if self._stack is None or self._stack[0] != state:
            self._stack = (state, co.ExpertStack(gu, dn, self.local))
        return self._stack[1]

    def weight_loader(self, param, full):
        """A stacked tensor of ALL experts [E, ...] (the trainer's state_dict): this rank's rows."""
        _write(param, full[self.local[0]:self.local[-1] + 1])

    def load_expert(self, expert, part, tensor):
        """One expert's ``{gate,up,down}_proj.weight`` (HF checkpoint names): written into its
        row of the stack (bumping the stack's version), nothing if another rank owns it.
        Returns the names of the stacks that now hold every local expert's part."""
        if expert not in self.local:
            return []
        i, inter = expert - self.local[0], self.down_proj.shape[-1]
        if part == "down":
            _write(self.down_proj[i], tensor)
        else:
            h = self._HALF[part]
            _write(self.gate_up_proj[i, h * inter:(h + 1) * inter], tensor)
        self._parts.add((expert, part))
        return [name for name, parts in self._PARTS.items()
                if all((e, p) in self._parts for e in self.local for p in parts)]

    def checkpoint_names(self, prefix, stack):
        """The HF checkpoint names of the local experts' parts held in ``stack`` (a parameter name)."""
        return [f"{prefix}.{e}.{p}_proj.weight" for e in self.local for p in self._PARTS[stack]]


def moe_mix(x, router_weight, top_k, norm_topk_prob, contributions, whole=None):
    """The MoE block's math around its experts, for every host's block (this file's, the
    Megatron spec's): contract routing of x [T, H], the per-(token, slot) contributions
    ``contributions(ids, w)`` [T, k, H] (fp32, wherever the experts live), slot-ordered combine.
    ``whole``: an ExpertStack of every expert, here (the rollout without TP): contributions and
    combine in one call where the backend has one (co.moe_experts, the same bits)."""
    ids, w = co.moe_route(x, router_weight.to(x.dtype), top_k, norm_topk_prob)
    out = None if whole is None else co.moe_experts(x, ids, w, whole)
    return out if out is not None else co.moe_combine(contributions(ids, w), x.dtype)


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
        self.experts = Experts(local, cfg.hidden_size, cfg.moe_intermediate_size, cfg.dtype)
        self.top_k, self.norm_topk_prob, self.tp = cfg.top_k, cfg.norm_topk_prob, tp
        self.fused = False      # as Attention.fused

    def forward(self, x):
        experts, gate = _children(self, "experts", "gate")
        whole = experts.stack(x.dtype) if self.fused and not self.tp.sharded else None
        return moe_mix(x, gate.weight, self.top_k, self.norm_topk_prob,
                       lambda ids, w: self._contributions(x, ids, w), whole)

    def _contributions(self, x, ids, w):
        # local None: every expert is here (the backward then needs no host sync)
        local = self.experts.local if self.tp.sharded else None
        contrib, owned = co.moe_expert_contributions(x, ids, w, self.experts.stack(x.dtype), local)
        return parallel.gather_owned(contrib, owned, self.tp.group) if self.tp.sharded else contrib


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, idx: int, tp: TensorParallel):
        super().__init__()
        self.self_attn = Attention(cfg, tp)
        self.mlp = (SparseMoeBlock(cfg, tp) if idx in cfg.moe_layers
                    else MLP(cfg.hidden_size, cfg.intermediate_size, tp, cfg.dtype))
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.dtype)

    def forward(self, hidden, residual, rope, attend, paged=None, cache=None):
        """HF order: x = x + attn(norm(x)); x = x + mlp(norm(x)); the residual add is
        fused into the next norm (the same bf16 add either way). paged: the host's (key cache, value
        cache, slot mapping, block table, seq_lens, query_start_loc) of this layer's step (what attend
        passes attention_paged), where the rollout lets the whole layer be one call (co.decode_layer:
        the same ops' bits); None, or a layer the call does not cover, runs the ops. cache: the host's
        (key cache, value cache, slot mapping) of this layer's step, where the rollout lets the
        attention's prologue store k and v (Attention.qkv)."""
        if paged is not None:
            out = self._decode(hidden, residual, rope, paged)
            if out is not None:
                return out
        norm, mlp = _children(self, "input_layernorm", "mlp")
        h, residual = norm(hidden, residual, fuse_residual=True)
        h, residual = self._attention(h, residual, rope, attend, cache)
        return mlp(h), residual

    def _decode(self, hidden, residual, rope, paged):
        """co.decode_layer of this layer's weights, or None where the ops must run: modules not fused
        (the trainer's), hooked (check --localize), sharded (TP) or with biases."""
        attn, mlp, n_in, n_post = _children(self, "self_attn", "mlp", "input_layernorm", "post_attention_layernorm")
        qp, kp, vp, op, qn, kn = _children(attn, "q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")
        if not (attn.fused and mlp.fused and op.tp.size == 1 and qp.bias is None and op.bias is None):
            return None
        if isinstance(mlp, SparseMoeBlock):
            if mlp.tp.sharded:
                return None
            experts, gate = _children(mlp, "experts", "gate")
            ffn, parts = {"router": gate.weight, "experts": experts.stack(hidden.dtype), "top_k": mlp.top_k,
                          "norm_topk_prob": mlp.norm_topk_prob}, (experts, gate)
        else:
            g, u, d = parts = _children(mlp, "gate_proj", "up_proj", "down_proj")
            if d.tp.size != 1:
                return None
            ffn = dict(zip(("gate", "up", "down"), _weights(g, u, d)))
        if _hooked(self, attn, mlp, n_in, n_post, qp, kp, vp, op, qn, kn, *parts):
            return None
        weights = co.DecoderWeights(*_weights(n_in), n_in.eps, *_weights(qp, kp, vp, qn, kn), qn.eps, *_weights(op, n_post),
                                    n_post.eps, **ffn)
        return co.decode_layer(hidden, residual, weights, rope.cos, rope.sin, *paged)

    def _attention(self, h, residual, rope, attend, cache=None):
        """Attention and the post-attention residual add + RMSNorm; in the rollout o_proj, the add
        and the norm are one call where the backend has one (the same bits). cache: Attention.qkv's."""
        attn, norm = _children(self, "self_attn", "post_attention_layernorm")
        o, = _children(attn, "o_proj")
        if attn.fused and o.tp.size == 1 and o.bias is None and not _hooked(attn, o, norm):
            heads = attn.heads(h, rope, attend, cache)
            out = co.linear_add_rms_norm(heads, *_weights(o), residual, *_weights(norm), norm.eps)
            return out if out is not None else norm(o(heads), residual, fuse_residual=True)
        return norm(attn(h, rope, attend), residual, fuse_residual=True)


class Qwen3Model(nn.Module):
    """Embedding, decoder layers, final norm: hidden states [T, H] for flat tokens."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel = TensorParallel()):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, cfg.dtype)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, tp) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.dtype)
        self.gradient_checkpointing = False   # the name transformers' switch sets

    def forward(self, input_ids, positions, attend, hidden=None, paged=None, cache=None):
        """attend(layer_idx, q, k, v) -> [T, Hq, D]; ``hidden`` overrides the embedding; paged(layer_idx),
        cache(layer_idx): the layer's paged cache and metadata, its cache and slots (DecoderLayer.forward)
        or None, from a host that has them."""
        if hidden is None:
            hidden = self.embed_tokens(input_ids, self.cfg.dtype)
        rope = RotaryTable(positions, self.cfg.head_dim, self.cfg.rope_theta, self.cfg.rope_scaling)
        residual = None
        recompute = self.gradient_checkpointing and torch.is_grad_enabled()
        for i, layer in enumerate(self.layers):
            args = (hidden, residual, rope, lambda q, k, v, i=i: attend(i, q, k, v))
            # Recomputation repeats the same ops on the same inputs: the same bits.
            hidden, residual = (checkpoint(layer, *args, use_reentrant=False) if recompute
                                else layer(*args, paged(i) if paged else None, cache(i) if cache else None))
        return self.norm(hidden, residual, fuse_residual=True)[0]


class LMHead(ColumnParallelLinear):
    """Vocab-parallel output layer: fp32 logits; shards are concatenated (exact)."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel):
        super().__init__(cfg.hidden_size, cfg.vocab_size, tp, dtype=cfg.dtype, out_dtype=torch.float32)

    def forward(self, x):
        logits = super().forward(x)
        return parallel.gather_concat(logits, -1, self.tp.group) if self.tp.sharded else logits
