"""A readable console: verl's config dump, the vLLM command-line dump, verl's INFO
chatter and warnings known to be harmless are off unless ``true_on_policy.verbose=true``.

``apply()`` runs in the driver before Ray starts (the recipe; a swap-in job whose config
says ``true_on_policy.verbose: false``) and hands the choice to every process of the
job through the environment, which Ray and vLLM pass on: ``TRUE_ON_POLICY_QUIET=1``
(read by ``install()``, which the verl and vLLM plugins run in each process), Python
warning filters (``PYTHONWARNINGS``) and verl's log level (``VERL_LOGGING_LEVEL``, unless
set).
A warning is silenced only if its message contains a known text (``HARMLESS_*``); any
other warning still shows.
"""
import builtins
import functools
import logging
import os
import re
import sys

import psutil

from .hooks import after_import, patch

ENV = "TRUE_ON_POLICY_QUIET"
# (category, start of the message): Python warnings every CPU run of verl 0.9.1 prints.
HARMLESS_WARNINGS = (
    ("UserWarning", "torchtitan engine is not available"),
    ("UserWarning", "veomni engine is not available"),
    ("UserWarning", "automodel engine is not available"),
    ("UserWarning", "mindspeed engine is not available"),
    ("UserWarning", "megatron engine is not available"),
    ("UserWarning", "Disabled critic as algorithm.adv_estimator != gae"),
    ("UserWarning", "'set_vital' is deprecated"),
    ("UserWarning", "FSDP2-wrapped module"),
    ("FutureWarning", "`torch.distributed.reduce_op` is deprecated"),
)
# (logger, text in the message): log warnings of the same runs. verl names some loggers
# by their file ("verl/..." below: the path inside the installed verl).
HARMLESS_LOGS = (
    ("vllm.triton_utils.importing", "Triton is installed, but"),
    ("vllm.platforms.cpu", "Triton is not installed"),
    ("vllm.model_executor.layers.indexer_topk", "Failed to import the DeepSelect extension"),
    ("vllm.config.vllm", "Model Runner V2 requires Triton"),
    ("vllm.config.vllm", "Enforce eager set"),
    ("vllm.config.vllm", "Inductor compilation was disabled"),
    ("vllm.config.model", "Default vLLM sampling parameters have been overridden"),
    ("vllm.v1.worker.cpu_worker", "is not found in LD_PRELOAD"),
    ("vllm.entrypoints.serve.lora.api_router", "LoRA dynamic loading & unloading is enabled"),
    ("vllm.v1.engine.input_processor", "Passing raw prompts to InputProcessor is deprecated"),
    ("vllm.true_on_policy", "logprobs_mode processed_logprobs -> processed_logits"),
    ("transformers.utils.import_utils", "requires torchvision (not installed)"),
    ("transfer_queue.utils.common", "should not exceed total physical CPU cores"),
    ("torch.fx._symbolic_trace", "is_fx_tracing will return true"),
    ("ray._private.worker", "Using blocking ray.get inside async actor"),
    ("ray._private.authentication.authentication_token_setup", "Token authentication is enabled"),
    ("verl/workers/rollout/vllm_rollout/vllm_rollout.py", "IPC is not supported on your devices"),
    ("verl/workers/rollout/vllm_rollout/vllm_async_server.py", "agent loop only support torch and npu profiler"),
    # INFO lines of verl's vLLM server (its logger is set to INFO whatever VERL_LOGGING_LEVEL says)
    ("verl/workers/rollout/vllm_rollout/vllm_async_server.py", "vLLMHttpServer, replica_rank"),
    ("verl/workers/rollout/vllm_rollout/vllm_async_server.py", "override_generation_config:"),
    ("verl/workers/rollout/vllm_rollout/vllm_async_server.py", "enable_sleep_mode:"),
    ("verl/workers/rollout/vllm_rollout/vllm_async_server.py", "Initializing a V1 LLM engine with config"),
)
# Modules whose pprint dumps a whole config (~1,000 lines) or vLLM's command line.
VERL_MAIN = "verl.trainer.main_ppo"
DUMPS = (VERL_MAIN, "verl.workers.rollout.vllm_rollout.vllm_async_server")


def enabled() -> bool:
    return os.environ.get(ENV) == "1"


def apply() -> None:
    """Quiet this process and every process started after this call."""
    os.environ[ENV] = "1"
    os.environ.setdefault("VERL_LOGGING_LEVEL", "WARNING")
    # TransferQueue asks for 8 threads and, on a smaller host, warns at every put/get
    # that it takes the physical core count instead: ask for what it takes anyway.
    cores = psutil.cpu_count(logical=False) or 1
    os.environ.setdefault("TQ_NUM_THREADS", str(min(8, cores)))
    current = [f for f in os.environ.get("PYTHONWARNINGS", "").split(",") if f]
    mine = [f"ignore:{message}:{category}" for category, message in HARMLESS_WARNINGS]
    os.environ["PYTHONWARNINGS"] = ",".join(current + [f for f in mine if f not in current])
    main = sys.modules.get("__main__")   # `python -m verl.trainer.main_ppo`: no import hook sees it
    if getattr(getattr(main, "__spec__", None), "name", None) == VERL_MAIN:
        skip_dumps(main)
    install()


class _Harmless(logging.Filter):
    def __init__(self, texts):
        super().__init__()
        self.texts = texts

    def filter(self, record):
        message = record.getMessage()
        return not any(text in message for text in self.texts)


def install() -> None:
    """In a process of a quiet job (idempotent): the warning filters, the log filters on
    the loggers that emit them, and the dumps skipped."""
    if not enabled():
        return
    import warnings
    for category, message in HARMLESS_WARNINGS:
        warnings.filterwarnings("ignore", message=re.escape(message), category=getattr(builtins, category))
    by_logger = {}
    for name, text in HARMLESS_LOGS:
        by_logger.setdefault(_logger_name(name), []).append(text)
    for name, texts in by_logger.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _Harmless) for f in logger.filters):
            logger.addFilter(_Harmless(tuple(texts)))
    for module in DUMPS:
        after_import(module, skip_dumps)


def _logger_name(name: str) -> str:
    if not name.startswith("verl/"):
        return name
    import importlib.util
    root = os.path.dirname(importlib.util.find_spec("verl").origin)
    return os.path.join(root, name[len("verl/"):])


def skip_dumps(module) -> None:
    """verl pretty-prints the resolved config (TaskRunner) and vLLM's command line (server)."""
    def silent(dump):
        @functools.wraps(dump)
        def pprint(obj, *args, **kwargs):
            return None
        return pprint

    patch(module, "pprint", silent)
