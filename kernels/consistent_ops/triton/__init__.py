"""Triton backend (CUDA GPUs; kernel logic also runs under TRITON_INTERPRET=1 on CPU).

Same op set and signatures as the reference backend. Contractions and reductions are
Triton kernels with one tile walk per op (see contract.ACCUMULATION["triton"]); ops
that are exact or elementwise run as PyTorch on the device (pointwise.py says why).
Bits are equal across every path of THIS backend (training varlen, prefill, chunked
prefill, decode, mixed batches, TP emulation vs real ranks), not equal to the
reference backend's.
"""
from .attention import attention_paged, attention_varlen
from .gemm import linear, row_parallel_partial
from .kvcache import write_kv_cache
from .logprobs import log_softmax, token_logprobs
from .moe import moe_combine, moe_expert_contributions, moe_experts, moe_route
from .norm import add_rms_norm, rms_norm
from .pointwise import embedding, finish_row_parallel, ordered_sum, rope_cos_sin, silu_mul
from .prologue import qk_norm_rope
from .rope import apply_rope
from .truncation import truncate_logprobs

NAME = "triton"
