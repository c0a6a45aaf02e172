"""Qwen3 / Qwen3-MoE written once on consistent_ops; trainer and rollout adapters wrap it."""
from .causal_lm import CausalLM, ConsistentForCausalLM, TrainerMixin, build_causal_lm, packed_layout
from .config import ARCHITECTURES, ModelConfig
from .layers import TensorParallel
