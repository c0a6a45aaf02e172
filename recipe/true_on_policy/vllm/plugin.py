"""The ``vllm.general_plugins`` entry point. vLLM runs it in every process (front-end,
engine core, each worker), so it is idempotent and does nothing unless TRUE_ON_POLICY=1.
Registrations are string paths: nothing heavy is imported until vLLM needs it."""
import logging

from true_on_policy.models.config import ARCHITECTURES
from true_on_policy.scheme import enabled

log = logging.getLogger("vllm.true_on_policy")  # under vLLM's logger: same handler and format

MODEL_CLASS = "true_on_policy.vllm.model:TrueOnPolicyForCausalLM"
BACKEND_CLASS = "true_on_policy.vllm.attention.ConsistentAttentionBackend"
_registered = False


def worker_contract(worker):
    """``collective_rpc("true_on_policy_contract")``: the contract fingerprint of the model
    this worker runs; None when it is not ours (the plugin did not take the model)."""
    return getattr(worker.model_runner.get_model(), "contract_fingerprint", None)


def register() -> None:
    global _registered
    from .. import quiet
    quiet.install()   # vLLM's engine and worker processes of a quiet job (quiet.py)
    if _registered or not enabled():
        return
    from vllm import ModelRegistry
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    from . import ascend, engine_config
    ascend.register_vllm_ascend_models()        # first, so the registrations below win
    for arch in ARCHITECTURES:
        ModelRegistry.register_model(arch, MODEL_CLASS)
        MODELS_CONFIG_MAP[arch] = engine_config.hook_for(arch, MODELS_CONFIG_MAP.get(arch))
    # Our model passes the backend to Attention directly; registering CUSTOM too lets
    # vLLM code that resolves a layer's backend by enum name find the same class.
    register_backend(AttentionBackendEnum.CUSTOM, BACKEND_CLASS)
    from vllm.v1.worker.worker_base import WorkerBase
    WorkerBase.true_on_policy_contract = worker_contract
    _registered = True
    log.info("true_on_policy: registered %s for %s", MODEL_CLASS, ", ".join(ARCHITECTURES))
