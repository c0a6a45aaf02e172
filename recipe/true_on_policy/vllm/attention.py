"""vLLM attention backend over consistent_ops.attention_paged / write_kv_cache.

Why a backend of our own: the stock kernels (CPU_ATTN, FlashAttention, Ascend FIA)
split and reduce keys differently for prefill, chunked prefill and decode, so a
token's attention output depends on how the scheduler happened to batch it. The
contract walks keys in fixed KV_BLOCK blocks from position 0 in every path, and
the trainer's varlen attention runs the same loop, so the bits match.

KV-cache layout. vLLM hands each layer a [blocks, Hkv, page, Dk + Dv] logical view
whose physical order is the layout we declare, one contiguous region per layer:
head-major pages (LBHNC) for the reference backend (one head's tokens of a page are
adjacent, so a CPU decode step reads K/V in dense runs; token-major measured ~1.4x
slower with a cold cache), token-major (LBNHC) for Triton, whose kernel addresses rows
as pages * page_size. Either way ``permute(0, 2, 1, 3)`` is a strided
[pages, page_size, Hkv, Dk + Dv] view whose K and V halves are consistent_ops' cache
layout [pages, page_size, Hkv, D] (strided views, no copy). The page size is vLLM's
kernel block size; the contract never depends on it (keys are walked in KV_BLOCK
positions whatever the page size). vLLM 0.23 allocates another shape: compat.py.

Metadata facts relied on (vLLM 0.31, NOTES 4b): seq_lens include this step's
tokens; block_table is in kernel-block units; slot_mapping is -1 on padding; new
pages are not zeroed (attention_paged masks positions >= seq_len); attn_metadata
is None in warm-up/profile runs. Chunked prefill and prefix-cache hits are just
seq_len > query_len, which attention_paged handles like any other step.
"""
from dataclasses import dataclass
from typing import ClassVar

import torch

import consistent_ops as co
from vllm.v1.attention.backend import (AttentionBackend, AttentionCGSupport, AttentionImpl,
                                       AttentionMetadataBuilder, AttentionType, CommonAttentionMetadata)

from . import compat


class ConsistentAttentionBackend(AttentionBackend):
    # vLLM calls impl.do_kv_cache_update before forward: this step's K/V is in the
    # cache before attention reads it, as the contract requires.
    forward_includes_kv_cache_update: bool = False
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.bfloat16, torch.float16, torch.float32]
    # The cache holds K/V in the activation dtype; a quantised cache would change bits.
    supported_kv_cache_dtypes: ClassVar[list[str]] = ["auto"]

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"   # must name an AttentionBackendEnum member; the plugin maps CUSTOM to us

    @staticmethod
    def get_impl_cls():
        return ConsistentAttentionImpl

    @staticmethod
    def get_builder_cls():
        return ConsistentAttentionMetadataBuilder

    @classmethod
    def supported_kv_cache_layouts(cls):
        # The Triton kernel addresses rows as pages * page_size (token-major pages).
        return compat.kv_cache_layouts(head_major=co.backend_name() == "reference")

    @staticmethod
    def get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size, cache_dtype_str="auto"):
        return compat.kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size)   # vLLM 0.23

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER


@dataclass
class AttentionGroup:
    """Requests attended in one attention_paged call, and where their rows live in the batch."""
    rows: torch.Tensor | None       # token rows of these requests (None: the whole batch, in order)
    query_start_loc: torch.Tensor   # [reqs + 1], relative to ``rows``
    seq_lens: torch.Tensor          # [reqs], this step's tokens included
    block_table: torch.Tensor       # [reqs, max_pages], kernel-block units
    max_query_len: int              # launch bound: most new tokens of any of these requests


@dataclass
class ConsistentAttentionMetadata:
    num_tokens: int                 # real (unpadded) tokens of this step
    groups: list[AttentionGroup]


def group_requests(query_lens: list[int]) -> list[list[int]]:
    """Requests bucketed by query length (decodes; then powers of two).

    The reference backend's attention_paged pads every request to the longest query of its
    call, so one call over 63 decodes and a 2k-token prefill chunk would do 64 x 2k rows of
    work (the Triton kernel launches tiles per request and needs no buckets).
    Bucketing bounds the padding to 2x. Bits do not change: the contract computes
    each request alone (batch-of-slice == slice-of-batch) and the trainer packs
    sequences differently anyway."""
    buckets: dict[int, list[int]] = {}
    for i, n in enumerate(query_lens):
        if n > 0:               # requests without tokens this step (padding) have nothing to attend
            buckets.setdefault((n - 1).bit_length(), []).append(i)
    return [buckets[k] for k in sorted(buckets)]


class ConsistentAttentionMetadataBuilder(AttentionMetadataBuilder[ConsistentAttentionMetadata]):
    # FULL CUDA graphs: one attention_paged call over views of vLLM's persistent metadata
    # buffers, padding requests (no tokens) included as exact no-ops, nothing read back on
    # the host in the forward. The Triton kernel's grid is sized by shapes alone, so any
    # batch, mixed prefill/decode included, is one launch: ALWAYS. The reference backend
    # pads each call to its longest query, so mixed batches are bucketed per step (index
    # tensors built here) and only uniform batches (decode, spec-decode verification) are
    # one call; Ascend's flash-attention-npu takes max_query_len as a launch size, so it
    # captures uniform batches only too. tests/gpu/test_triton_graphs.py replays decode and
    # mixed graphs as vLLM's runner does and checks the bits against eager and the trainer.
    _cudagraph_support = AttentionCGSupport.UNIFORM_BATCH

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)

    @classmethod
    def get_cudagraph_support(cls, vllm_config, kv_cache_spec) -> AttentionCGSupport:
        return AttentionCGSupport.ALWAYS if co.backend_name() == "triton" else cls._cudagraph_support

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> ConsistentAttentionMetadata:
        m, n = common_attn_metadata, common_attn_metadata.num_reqs
        qsl = m.query_start_loc_cpu[:n + 1].tolist()
        lens = [b - a for a, b in zip(qsl[:-1], qsl[1:])]
        groups = group_requests(lens) if co.backend_name() == "reference" else []
        if len(groups) <= 1:        # one call (padding requests ride along): the whole batch
            whole = AttentionGroup(None, m.query_start_loc[:n + 1], m.seq_lens[:n], m.block_table_tensor[:n],
                                   max(lens, default=1))
            return ConsistentAttentionMetadata(qsl[-1], [whole])
        return ConsistentAttentionMetadata(qsl[-1], [self._group(m, qsl, lens, idx) for idx in groups])

    @staticmethod
    def _group(m, qsl, lens, idx):
        rows = torch.cat([torch.arange(qsl[i], qsl[i + 1]) for i in idx]).to(m.query_start_loc.device)
        sub = torch.tensor([0] + [lens[i] for i in idx]).cumsum(0).to(m.query_start_loc)
        sel = torch.tensor(idx, device=m.seq_lens.device)
        return AttentionGroup(rows, sub, m.seq_lens[sel], m.block_table_tensor[sel], max(lens[i] for i in idx))


class ConsistentAttentionImpl(AttentionImpl[ConsistentAttentionMetadata]):
    def __init__(self, num_heads, head_size, scale, num_kv_heads=None, alibi_slopes=None,
                 sliding_window=None, kv_cache_dtype="auto", logits_soft_cap=None,
                 attn_type=AttentionType.DECODER, kv_sharing_target_layer_name=None, **extra):
        unsupported = {"alibi_slopes": alibi_slopes, "sliding_window": sliding_window,
                       "logits_soft_cap": logits_soft_cap,
                       "kv_sharing_target_layer_name": kv_sharing_target_layer_name, **extra}
        for name, value in unsupported.items():
            if value not in (None, 0):
                raise NotImplementedError(f"consistent attention: {name}={value!r} is not in the contract")
        if kv_cache_dtype != "auto":
            raise NotImplementedError(f"consistent attention: kv_cache_dtype={kv_cache_dtype!r}; use 'auto'")
        self.num_heads, self.head_size, self.num_kv_heads = num_heads, head_size, num_kv_heads or num_heads
        self.scale = scale            # unused: the op's default 1/sqrt(D) is what the trainer uses too
        self.kv_cache_dtype = kv_cache_dtype
        self.attn_type = attn_type
        self._split = None          # (this layer's cache tensor, its K and V views): caches

    def caches(self, kv_cache):
        """K, V views of the layer's cache, made once: vLLM binds one tensor per layer and passes it to
        every call (twice a step), so the views (split_kv_cache's ~4 us) only change with the tensor."""
        if self._split is None or self._split[0] is not kv_cache:
            self._split = (kv_cache, *compat.split_kv_cache(kv_cache))
        return self._split[1:]

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping):
        k_cache, v_cache = self.caches(kv_cache)
        n = key.shape[0]
        co.write_kv_cache(key, value, k_cache, v_cache, slot_mapping[:n])

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                output_scale=None, output_block_scale=None):
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("consistent attention: fused output quantisation")
        if attn_metadata is None:          # warm-up / memory profiling: no cache yet
            return output.zero_()
        n = attn_metadata.num_tokens
        k_cache, v_cache = self.caches(kv_cache)
        for g in attn_metadata.groups:
            if g.rows is None:      # the rows of the output buffer written in place (by a backend that can)
                co.attention_paged(query[:n], k_cache, v_cache, g.block_table, g.seq_lens, g.query_start_loc,
                                   max_query_len=g.max_query_len, out=output[:n])
            else:
                output[g.rows] = co.attention_paged(query[g.rows], k_cache, v_cache, g.block_table, g.seq_lens,
                                                    g.query_start_loc, max_query_len=g.max_query_len)
        if n < output.shape[0]:
            output[n:] = 0                 # padded rows: defined, never read
        return output
