"""A decoder layer's weights, as consistent_ops.decode_layer takes them.

The model (Qwen3 / Qwen3-MoE: pre-norm attention with per-head q/k RMSNorm and RoPE, then a dense
MLP or a routed MoE block) is written once on the ops; a backend may run one decode step of a whole
layer in one call (the reference backend on CPU: dot32.c decode_layer32), with the bits of those ops.
"""
from typing import NamedTuple

import torch

from .experts import ExpertStack


class DecoderWeights(NamedTuple):
    in_norm: torch.Tensor           # input_layernorm [H], eps in_eps
    in_eps: float
    wq: torch.Tensor                # q/k/v projections [heads * D, H], no bias
    wk: torch.Tensor
    wv: torch.Tensor
    q_norm: torch.Tensor            # per-head RMSNorms [D], eps qk_eps
    k_norm: torch.Tensor
    qk_eps: float
    wo: torch.Tensor                # o_proj [H, Hq * D], no bias
    post_norm: torch.Tensor         # post_attention_layernorm [H], eps post_eps
    post_eps: float
    gate: torch.Tensor | None = None    # dense MLP: gate/up [I, H], down [H, I]
    up: torch.Tensor | None = None
    down: torch.Tensor | None = None
    router: torch.Tensor | None = None  # MoE: router [E, H] and every expert, stacked
    experts: ExpertStack | None = None
    top_k: int = 0
    norm_topk_prob: bool = False
