"""Reference backend: plain PyTorch on any device. It is the readable spec of the contract."""
from ..contract import CPU_ACCUMULATION
from .attention import attention_paged, attention_varlen, write_kv_cache
from .decoder import decode_layer
from .linear import (attention_prologue, finish_row_parallel, linear, linear_add_rms_norm, mlp, ordered_sum,
                     row_parallel_partial)
from .logprobs import log_softmax, token_logprobs
from .native import accumulation
from .moe import moe_combine, moe_expert_contributions, moe_experts, moe_route
from .norm import add_rms_norm, rms_norm
from .pointwise import apply_rope, embedding, rope_cos_sin, silu_mul
from .truncation import truncate_logprobs

NAME = "reference"


def realisation():
    """The CPU accumulation's fingerprint entry (contract.CPU_ACCUMULATION; None for fp64)."""
    return CPU_ACCUMULATION[accumulation()]
