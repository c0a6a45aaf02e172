"""A Megatron layer spec whose math is the rollout's: models/qwen3.py on consistent_ops.

Megatron keeps what carries no bits of its own: parameter layout and names (so
Megatron-Bridge loads and exports HF weights unchanged), tensor/sequence/expert-parallel
placement, the embedding lookup (a gather, exact), residual adds (one bf16 add, as ours)
and the optimizer. Every op whose bits matter is replaced through Megatron's own module
spec: linears (fp64-dot per output), row-parallel partials gathered and summed in rank
order at the ROLLOUT's TP degree (emulated where the trainer's differs), RMSNorm and
q/k-norm, RoPE by position inside packed varlen attention, the MoE layer (contract
routing, per-(token, slot) contributions exchanged by owner, slot-ordered fp32 combine),
and an fp32 vocab-parallel LM head.
"""
from functools import partial

import torch
import torch.distributed as dist
from megatron.core import tensor_parallel
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.tensor_parallel import mappings
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

import consistent_ops as co
from consistent_ops import parallel

from .. import scheme
from ..models.causal_lm import positions_from_cu
from ..models.layers import RMSNorm
from ..models.qwen3 import RotaryTable, moe_mix


def _tp(group):
    return (dist.get_world_size(group), dist.get_rank(group)) if group is not None else (1, 0)


class ConsistentNorm(RMSNorm):
    """models.layers.RMSNorm with Megatron's constructor (input, pre-MLP, final and q/k norms)."""

    def __init__(self, config, hidden_size, eps=1e-6):
        super().__init__(hidden_size, eps, config.params_dtype)
        # Replicated over TP but fed different tokens under sequence parallel: Megatron
        # all-reduces the grads of parameters marked so.
        self.weight.sequence_parallel = config.sequence_parallel


class ConsistentColumnParallelLinear(tensor_parallel.ColumnParallelLinear):
    """Megatron's column-parallel parameters; each output one contract dot (shard-exact)."""
    out_dtype = None

    def forward(self, input_, weight=None, runtime_gather_output=None):
        w = self.weight if weight is None else weight
        x = input_
        if self.sequence_parallel:
            x = mappings.gather_from_sequence_parallel_region(x, group=self.tp_group)
        elif _tp(self.tp_group)[0] > 1:
            x = mappings.copy_to_tensor_model_parallel_region(x, group=self.tp_group)
        bias = None if self.skip_bias_add else self.bias
        out = co.linear(x, w.to(x.dtype), bias, self.out_dtype)
        gather = self.gather_output if runtime_gather_output is None else runtime_gather_output
        if gather and _tp(self.tp_group)[0] > 1:
            out = mappings.gather_from_tensor_model_parallel_region(out, group=self.tp_group)
        return out, (self.bias if self.skip_bias_add else None)


class ConsistentOutputLayer(ConsistentColumnParallelLinear):
    """The LM head: fp32 logits, vocab-parallel (shards concatenate exactly)."""
    out_dtype = torch.float32

    def forward(self, input_, weight=None, runtime_gather_output=None):
        out, bias = super().forward(input_, weight, runtime_gather_output)
        # verl divides a transposed view of the logits by T in place, which autograd forbids
        # on a view of a custom Function's output (the contract's matmul): a copy when training.
        return (out.clone() if out.requires_grad else out), bias


class _GatherOrderedSum(torch.autograd.Function):
    """Row-parallel reduction of the contract; the sum is replicated on every rank, so each
    rank's partial receives the (identical) output gradient."""

    @staticmethod
    def forward(ctx, partial_, group):
        return parallel.gather_ordered_sum(partial_, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class ConsistentRowParallelLinear(tensor_parallel.RowParallelLinear):
    """Megatron's row-parallel parameters; partials at the rollout's TP degree ``rollout_tp``.
    Same degree: this rank's partial, gathered and summed in rank order. Otherwise the
    input and weight shards are gathered (exact) and the rollout's partition is emulated."""

    def __init__(self, *args, rollout_tp=1, **kwargs):
        super().__init__(*args, **kwargs)
        self.rollout_tp = rollout_tp

    def forward(self, input_):
        x, w = input_, self.weight
        size = _tp(self.tp_group)[0]
        if size > 1 and size == self.rollout_tp:
            total = _GatherOrderedSum.apply(co.row_parallel_partial(x, w.to(x.dtype)), self.tp_group)
            out = co.finish_row_parallel(total, self.bias, x.dtype)
        else:
            if size > 1:
                x = mappings.gather_from_tensor_model_parallel_region(x, group=self.tp_group)
                w = mappings.gather_from_tensor_model_parallel_region(w, group=self.tp_group)
            w = w.to(x.dtype)
            out = (co.linear(x, w, self.bias) if self.rollout_tp == 1
                   else co.row_parallel_linear(x, w, self.rollout_tp, self.bias))
        if self.sequence_parallel:
            out = mappings.scatter_to_sequence_parallel_region(out, group=self.tp_group)
        return out, None


class ConsistentAttention(MegatronModule):
    """Core attention: RoPE by position (q/k arrive normed, un-rotated: the model is built
    with position_embedding_type='none'), then the contract's packed causal varlen attention."""

    def __init__(self, config, layer_number=None, attn_mask_type=None, attention_type=None, cp_comm_type=None,
                 softmax_scale=None, pg_collection=None, rope_theta=1e6, rope_scaling=None):
        super().__init__(config)
        self.rope_theta, self.rope_scaling = rope_theta, rope_scaling

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":   # q [T, Hq, D]
            p = packed_seq_params
            cu = (p.cu_seqlens_q_padded if p.cu_seqlens_q_padded is not None else p.cu_seqlens_q).long()
            out = self._attend(query, key, value, cu)
            return out.reshape(out.shape[0], -1)
        s, b = query.shape[:2]                      # [S, B, H, D]: B whole sequences
        flat = lambda t: t.transpose(0, 1).reshape(s * b, *t.shape[2:])
        cu = torch.arange(b + 1, device=query.device) * s
        out = self._attend(flat(query), flat(key), flat(value), cu)
        return out.reshape(b, s, -1).transpose(0, 1)

    def _attend(self, q, k, v, cu):
        rope = RotaryTable(positions_from_cu(cu, int(cu[-1]), q.device), q.shape[-1], self.rope_theta,
                           self.rope_scaling)
        return co.attention_varlen(rope.apply(q), rope.apply(k), v, cu)


class ConsistentMLP(MLP):
    """Dense SwiGLU MLP: Megatron's fc1 (gate and up shards stacked) and fc2 parameters."""

    def forward(self, hidden_states, **_):
        gate, up = self.linear_fc1(hidden_states)[0].chunk(2, -1)
        return self.linear_fc2(co.silu_mul(gate, up))


class ConsistentRouter(torch.nn.Module):
    """The router's weight [E, H], as Megatron's TopKRouter holds it (name ``router.weight``)."""

    def __init__(self, config):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(config.num_moe_experts, config.hidden_size,
                                                     dtype=config.params_dtype))
        config.init_method(self.weight)
        self.weight.sequence_parallel = config.sequence_parallel


class _GatherStack(torch.autograd.Function):
    """[W, ...] of every rank's tensor (equal shapes). Each rank uses the stack for its own
    tokens, so a rank's gradient is the rank-ordered sum of every rank's gradient slice."""

    @staticmethod
    def forward(ctx, t, group):
        ctx.group = group
        return torch.stack(parallel.all_gather(t, group))

    @staticmethod
    def backward(ctx, grad):
        me = dist.get_rank(ctx.group)
        return co.ordered_sum([g[me] for g in parallel.all_gather(grad, ctx.group)]), None


def _exchange_by_owner(x, ids, w, experts, group):
    """Contributions [T, k, H] of this rank's tokens when the experts are spread over the
    EP ranks, which may hold different tokens: all ranks' tokens are gathered, each owner
    computes its experts' (token, slot) contributions, and every rank selects by owner."""
    n = parallel.all_gather(torch.tensor([x.shape[0]]), group)
    m, me = int(max(n)), dist.get_rank(group)
    pad = lambda t: torch.cat([t, t.new_zeros(m - t.shape[0], *t.shape[1:])])
    xs, ws = _GatherStack.apply(pad(x), group), _GatherStack.apply(pad(w), group)
    ids_all = torch.stack(parallel.all_gather(pad(ids), group))
    contrib, owned = co.moe_expert_contributions(xs.flatten(0, 1), ids_all.flatten(0, 1), ws.flatten(0, 1),
                                                 experts, sorted(experts))
    contribs = _GatherStack.apply(contrib.view(len(n), m, *contrib.shape[1:]), group)
    owneds = parallel.all_gather(owned.view(len(n), m, -1), group)
    return parallel.select_owned([c[me] for c in contribs], [o[me] for o in owneds])[:x.shape[0]]


class ConsistentMoE(MegatronModule):
    """Qwen3-MoE block: contract routing, experts placed by EP (contiguous id ranges, whole:
    expert TP 1), contributions exchanged by owner, slot-ordered fp32 combine. Parameters
    are Megatron's (``router.weight``, SequentialMLP's ``experts.local_experts.i.*``)."""

    def __init__(self, config, submodules=None, layer_number=None, pg_collection=None, is_mtp_layer=False,
                 name=None, **_):
        super().__init__(config)
        self.ep_group = pg_collection.ep
        if _tp(pg_collection.expt_tp)[0] > 1:
            raise ValueError("expert_tensor_parallel_size must be 1 with TRUE_ON_POLICY=1 (experts are placed "
                             "whole, as in the rollout); set expert_tensor_parallel_size=1")
        ep, rank = _tp(self.ep_group)
        local = config.num_moe_experts // ep
        self.first_expert = rank * local
        self.router = ConsistentRouter(config)
        self.experts = SequentialMLP(local, config, MLPSubmodules(
            linear_fc1=tensor_parallel.ColumnParallelLinear, linear_fc2=tensor_parallel.RowParallelLinear),
            pg_collection=pg_collection)

    def forward(self, hidden_states, **_):
        x = hidden_states.reshape(-1, hidden_states.shape[-1])
        out = moe_mix(x, self.router.weight, self.config.moe_router_topk, not self.config.moe_router_pre_softmax,
                      lambda ids, w: self._contributions(x, ids, w))
        return out.view_as(hidden_states), None

    def _contributions(self, x, ids, w):
        experts = {self.first_expert + i: (*e.linear_fc1.weight.to(x.dtype).chunk(2), e.linear_fc2.weight.to(x.dtype))
                   for i, e in enumerate(self.experts.local_experts)}
        if _tp(self.ep_group)[0] > 1:
            return _exchange_by_owner(x, ids, w, experts, self.ep_group)
        return co.moe_expert_contributions(x, ids, w, experts, sorted(experts))[0]


def block_spec(config, rollout_tp=1, rope_theta=1e6, rope_scaling=None):
    """TransformerBlockSubmodules for a Qwen3 / Qwen3-MoE GPTModel (every layer MoE when
    ``config.num_moe_experts``), partials at the rollout's TP degree."""
    row = partial(ConsistentRowParallelLinear, rollout_tp=rollout_tp)
    mlp = (ConsistentMoE if config.num_moe_experts else partial(
        ConsistentMLP.as_mlp_submodule, submodules=MLPSubmodules(linear_fc1=ConsistentColumnParallelLinear, linear_fc2=row)))
    layer = ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
        input_layernorm=ConsistentNorm,
        self_attention=ModuleSpec(module=SelfAttention, params={"attn_mask_type": AttnMaskType.causal},
                                  submodules=SelfAttentionSubmodules(
                                      linear_qkv=ConsistentColumnParallelLinear,
                                      core_attention=partial(ConsistentAttention, rope_theta=rope_theta,
                                                             rope_scaling=rope_scaling),
                                      linear_proj=row, q_layernorm=ConsistentNorm, k_layernorm=ConsistentNorm)),
        self_attn_bda=get_bias_dropout_add,
        pre_mlp_layernorm=ConsistentNorm,
        mlp=mlp,
        mlp_bda=get_bias_dropout_add))
    return TransformerBlockSubmodules(layer_specs=[layer] * config.num_layers, layer_norm=ConsistentNorm)


def adopt_output_layer(model):
    """GPTModel builds its LM head outside the spec: give it the fp32 contract forward
    (same parameters, same class layout)."""
    model.output_layer.__class__ = ConsistentOutputLayer
    return model


def gather_vocab(logits, tp_group=None):
    """Whole-vocabulary logits [..., V] from vocab-parallel ones [..., V/tp]: shards
    concatenated in rank order (exact; backward: this rank's slice)."""
    if _tp(tp_group)[0] > 1:
        logits = mappings.gather_from_tensor_model_parallel_region(logits, group=tp_group)
    return logits


_BRIDGE_TYPES = {"ConsistentColumnParallelLinear": "column", "ConsistentOutputLayer": "column",
                 "ConsistentRowParallelLinear": "row", "ConsistentRouter": "replicated"}


# Provider fields for this spec: RoPE inside the attention, the rollout's vocabulary exactly
# (no padding), experts whole (expert TP 1) as per-expert parameters (SequentialMLP's names),
# no fused kernels (they are Transformer Engine's or Apex's).
PROVIDER_SETTINGS = dict(position_embedding_type="none", should_pad_vocab=False, expert_tensor_parallel_size=1,
                         moe_grouped_gemm=False, moe_permute_fusion=False, gradient_accumulation_fusion=False)


def configure_provider(provider, model, rollout_tp=1):
    """Point a Megatron-Bridge GPT provider (Qwen3 / Qwen3-MoE) at this spec (call before
    ``provider.finalize()``; PROVIDER_SETTINGS may also arrive as verl overrides). ``model``:
    the checkpoint's models.ModelConfig, the rollout's reader (RoPE as the rollout computes it)."""
    problems = list(scheme.megatron_model_problems(model))
    if problems:
        raise ValueError("; ".join(problems))
    for name, value in PROVIDER_SETTINGS.items():
        setattr(provider, name, value)
    provider.transformer_layer_spec = partial(_spec_for, rollout_tp=rollout_tp, rope_theta=model.rope_theta,
                                               rope_scaling=model.rope_scaling)
    from megatron.bridge.models.conversion.param_mapping import AutoMapping
    for name, kind in _BRIDGE_TYPES.items():      # how bridge splits/gathers our modules' weights
        AutoMapping.register_module_type(name, kind)
    return provider


def _spec_for(config, rollout_tp, rope_theta, rope_scaling):
    return block_spec(config, rollout_tp, rope_theta, rope_scaling)
