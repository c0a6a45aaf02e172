"""Config hook (vLLM's MODELS_CONFIG_MAP): runs when the VllmConfig is built in the
front-end, i.e. before the engine core or any worker starts, so a bad setup fails
early with a clear message and the settings the scheme needs reach every process."""
import logging

from vllm.model_executor.models.config import VerifyAndUpdateConfig

from true_on_policy import scheme
from true_on_policy.models import ModelConfig

from . import compat
from .sampling import V1_PROCESSOR, V2_PROCESSOR

log = logging.getLogger("vllm.true_on_policy")  # under vLLM's logger: same handler and format
LOGPROBS_MODE = "processed_logits"


def verify(vllm_config) -> None:
    mc, pc = vllm_config.model_config, vllm_config.parallel_config
    problems = scheme.tp_problems(ModelConfig.from_hf(mc.hf_config.to_dict()), pc.tensor_parallel_size)
    problems += scheme.dtype_problems(mc.dtype)
    if problems:
        raise ValueError("true_on_policy: " + "; ".join(problems))
    refuse = {
        "pipeline_parallel_size": pc.pipeline_parallel_size != 1,
        "speculative_config": vllm_config.speculative_config is not None,
        "kv_cache_dtype": vllm_config.cache_config.cache_dtype != "auto",
        "quantization": mc.quantization is not None,
        "decode_context_parallel_size": getattr(pc, "decode_context_parallel_size", 1) != 1,
    }
    for name, bad in refuse.items():
        if bad:
            raise ValueError(f"true_on_policy: {name} is not supported by the consistent model "
                             f"(the contract covers TP-only, unquantised, non-speculative decoding)")


def configure_sampling(vllm_config) -> None:
    """Report the contract's log-probs (see sampling.py): processed-logits mode + our processor."""
    mc = vllm_config.model_config
    if mc.logprobs_mode != LOGPROBS_MODE:
        log.warning("true_on_policy: logprobs_mode %s -> %s (exact log-probs need it)", mc.logprobs_mode,
                    LOGPROBS_MODE)
        mc.logprobs_mode = LOGPROBS_MODE
    path = V2_PROCESSOR if compat.use_v2_runner(vllm_config) else V1_PROCESSOR
    procs = list(mc.logits_processors or [])
    if path not in procs:
        mc.logits_processors = procs + [path]


def cap_graphs_at_model_len(vllm_config) -> None:
    """FULL graphs of mixed batches (our backend's ALWAYS): vLLM's capture warm-up runs dummy
    requests as long as the graph (seq_lens = its token count); past max_model_len their pages
    would lie beyond the block table's width. Capture at most max_model_len tokens (no change
    where max_model_len >= the largest graph: the presets' 2,048)."""
    cc, limit = vllm_config.compilation_config, vllm_config.model_config.max_model_len
    if vllm_config.model_config.enforce_eager or getattr(cc.cudagraph_mode, "name", None) != "FULL":
        return
    if cc.cudagraph_capture_sizes:
        kept = [n for n in cc.cudagraph_capture_sizes if n <= limit] or [1]
        if kept == list(cc.cudagraph_capture_sizes):
            return
        cc.cudagraph_capture_sizes, cc.max_cudagraph_capture_size = kept, max(kept)
    elif (cc.max_cudagraph_capture_size or GRAPH_DEFAULT_MAX) > limit:
        cc.max_cudagraph_capture_size = limit
    else:
        return
    log.warning("true_on_policy: CUDA graphs capture at most max_model_len=%d tokens", limit)


GRAPH_DEFAULT_MAX = 512   # vLLM's largest graph when none is set (min(2 max_num_seqs, 512))


def hook_for(arch: str, previous=None) -> type:
    """A VerifyAndUpdateConfig class for ``arch`` that runs vLLM's own hook (if any) first."""

    def verify_and_update_config(vllm_config) -> None:
        if previous is not None:
            previous.verify_and_update_config(vllm_config)
        verify(vllm_config)
        configure_sampling(vllm_config)
        cap_graphs_at_model_len(vllm_config)

    return type(f"TrueOnPolicy{arch}Config", (VerifyAndUpdateConfig,),
                {"verify_and_update_config": staticmethod(verify_and_update_config)})
