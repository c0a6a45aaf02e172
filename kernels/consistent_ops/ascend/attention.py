"""Attention on Ascend: flash-attention-npu's consistency build when it imports, else the
Triton kernels of consistent_ops.triton compiled by triton-ascend.

flash_attn_npu_v3 (vllm-ascend's FA3 path) walks keys in stacks of ASCEND_KV_BLOCK (512)
from position 0, fp32 softmax state, p rounded to bf16 before P.V, num_splits 1: the
same walk for training (varlen, with backward), prefill, chunked prefill and decode,
which is the contract's attention rule with KV block 512. Its paged kernel takes pages
of 128 positions only. The Triton fallback is the contract with KV_BLOCK (64).
"""
import torch

from ..contract import attention_scale
from ..triton import attention as _triton
from . import runtime

PAGE = 128     # the only page size flash_attn_with_kvcache accepts


def _fa():
    return runtime.require(runtime.FLASH_ATTN_NPU)


def _scale(q, scale):
    return attention_scale(q.shape[-1]) if scale is None else scale


def attention_varlen(q, k, v, cu_seqlens, scale=None):
    if not runtime.use_flash_attn_npu():
        return _triton.attention_varlen(q, k, v, cu_seqlens, scale)
    cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
    max_len = int((cu[1:] - cu[:-1]).max())
    return _fa().flash_attn_varlen_func(q, k, v, cu, cu, max_len, max_len, softmax_scale=_scale(q, scale),
                                        causal=True)


def attention_paged(q, key_cache, value_cache, block_table, seq_lens, query_start_loc, scale=None,
                    max_query_len=None):
    if not runtime.use_flash_attn_npu():
        return _triton.attention_paged(q, key_cache, value_cache, block_table, seq_lens, query_start_loc, scale,
                                       max_query_len)
    if key_cache.shape[1] != PAGE:
        raise ValueError(f"flash-attention-npu needs KV-cache pages of {PAGE} positions, got {key_cache.shape[1]}; "
                         f"set the engine's block size to {PAGE}")
    qsl = query_start_loc.to(torch.int32)
    max_q = max_query_len or int((qsl[1:] - qsl[:-1]).max())
    # causal is bottom-right aligned (the new tokens are the last of each sequence), so one
    # call serves decode, prefill and chunked prefill alike; num_splits=1: no split-KV reduction
    return _fa().flash_attn_with_kvcache(q, key_cache, value_cache, cache_seqlens=seq_lens.to(torch.int32),
                                         page_table=block_table.to(torch.int32), cu_seqlens_q=qsl,
                                         max_seqlen_q=max_q, softmax_scale=_scale(q, scale), causal=True,
                                         window_size=(-1, -1), num_splits=1)
