"""Ascend backend (Huawei NPUs: torch_npu + triton-ascend).

Same op set and signatures as the reference and triton backends. The default
realisation is the Triton kernels of consistent_ops.triton compiled by triton-ascend:
one kernel source for both platforms, the constructs Ascend lacks behind the constexpr
switches of triton/common.py, one pinned tile per op. Attention takes
flash-attention-npu's consistency build when ``flash_attn_npu_v3`` imports and linear
takes CANN's ``npu_mm_batch_invariant`` where installed (attention.py, linear.py); what
was found goes into the fingerprint (``realisation``). Importing this package needs no
NPU (scripts/ascend_compile_check.sh compiles its kernels on a CPU); ``activate`` runs
when the backend is selected and names any missing piece.
"""
from ..reference.attention import write_kv_cache
from ..reference.linear import finish_row_parallel, ordered_sum
from ..reference.moe import moe_combine
from ..reference.pointwise import apply_rope, embedding
from .attention import attention_paged, attention_varlen
from .linear import linear, row_parallel_partial
from .ops import (add_rms_norm, log_softmax, moe_expert_contributions, moe_route, rms_norm, rope_cos_sin,
                  silu_mul, token_logprobs)
from .runtime import activate, realisation

NAME = "ascend"


def truncate_logprobs(logp, top_k=0, top_p=1.0, min_p=0.0):
    """The truncation rule's exact masses are int64 fixed point from fp64 exps; Ascend A2/A3
    cores have no fp64, and no realisation of the rule for them is written yet."""
    raise NotImplementedError("consistent_ops ascend backend: top-k / top-p / min-p truncation is not realised on "
                              "Ascend yet; leave the rollout's top_k, top_p and min_p at their defaults")
