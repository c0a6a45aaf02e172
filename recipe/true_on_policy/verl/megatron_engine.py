"""verl 0.9.1's Megatron engine under TRUE_ON_POLICY=1, through verl's own extension points:
the engine registry (a subclass of ``MegatronEngineWithLMHead`` that points the Bridge
provider at our layer spec and gives GPTModel our LM head) and the log-prob function the
engine calls by name (``vocab_parallel_log_probs_from_logits`` -> the vocab shards gathered,
then the trainer's one log-prob function, trainer_logprobs.token_logprobs, with this
process's scoring: vocabulary limit and the rollout's top-k / top-p / min-p). Weight export is the engine's own (``bridge.export_hf_weights``:
our modules keep Megatron's parameter layout and names). verl's MindSpeed engine (Ascend), a
subclass of the same engine, gets the same spec (``install_mindspeed``)."""
import logging

from megatron.core import parallel_state as mpu
from verl.workers.engine.base import EngineRegistry
from verl.workers.engine.megatron import transformer_impl

from .. import hf_model, scoring
from ..models import ModelConfig
from ..megatron import env, spec
from . import trainer_logprobs

log = logging.getLogger("true_on_policy.verl")
TrueOnPolicyMindspeedEngine = None      # made by install_mindspeed once verl defines its MindSpeed engine


class _ContractSpec:
    """Mixed in before one of verl's Megatron-family engines (Megatron, MindSpeed): the
    Bridge provider builds our layer spec and LM head."""

    def _build_tf_config(self):
        # read by the provider's finalize, inside super()
        self.engine_config.override_transformer_config.update({**spec.PROVIDER_SETTINGS, **env.cpu_provider_settings()})
        super()._build_tf_config()
        if self.provider is None:
            raise ValueError("TRUE_ON_POLICY=1 with the Megatron actor needs Megatron-Bridge: "
                             "set actor.megatron.vanilla_mbridge=False")
        rollout_tp = int(getattr(self.model_config.hf_config, hf_model.TP_ATTR, 1) or 1)
        spec.configure_provider(self.provider, ModelConfig.from_hf(self.model_config.hf_config), rollout_tp)
        # Bridge's hook before DDP wrapping: GPTModel's LM head gets the contract's forward.
        self.provider.register_pre_wrap_hook(lambda chunks: [spec.adopt_output_layer(m) for m in chunks])
        env.cpu_provider(self.provider)
        scoring.activate(scoring.Scoring.of(self.model_config.hf_config,
                                            hf_model._tokenizer_length(self.model_config.local_path)))


class TrueOnPolicyMegatronEngine(_ContractSpec, transformer_impl.MegatronEngineWithLMHead):
    @env.on_cpu
    def initialize(self):           # builds the optimizer
        return super().initialize()

    @env.on_cpu
    def forward_backward_batch(self, *args, **kwargs):
        return super().forward_backward_batch(*args, **kwargs)

    @env.on_cpu
    def optimizer_step(self):
        return super().optimizer_step()


def contract_vocab_parallel_log_probs(logits, labels):
    """verl divided the fp32 vocab-parallel logits by T in place (one IEEE division, the contract's)."""
    whole = spec.gather_vocab(logits, mpu.get_tensor_model_parallel_group())
    return trainer_logprobs.token_logprobs(whole, labels, scoring.active() or scoring.Scoring())


def _register(engine, device, vendor=None):
    registry = EngineRegistry._engines["language_model"]["megatron"]
    if registry.get((device, vendor) if vendor else device) is not engine:
        EngineRegistry.register("language_model", "megatron", device, vendor)(engine)


def install(_module=None):
    """Register the engine and the log-prob function; idempotent. The registry looks a
    (device, vendor) key up before the device's default, so ("cuda", "nvidia") shadows the
    stock engine on NVIDIA; "cpu" has none."""
    env.apply_cpu_workarounds()
    _register(TrueOnPolicyMegatronEngine, "cuda", "nvidia")
    _register(TrueOnPolicyMegatronEngine, "cpu")
    transformer_impl.vocab_parallel_log_probs_from_logits = contract_vocab_parallel_log_probs
    log.info("true_on_policy: verl Megatron engine -> true_on_policy.megatron spec + contract log-probs")


def install_mindspeed(module):
    """verl's MindSpeed engine (Ascend: ``MindspeedEngineWithLMHead``, a
    ``MegatronEngineWithLMHead`` run with MindSpeed's patches) with the same spec; its
    log-probs are the same function of Megatron's module. ("npu", "huawei") shadows verl's "npu"."""
    install()
    global TrueOnPolicyMindspeedEngine
    if TrueOnPolicyMindspeedEngine is None:
        class TrueOnPolicyMindspeedEngine(_ContractSpec, module.MindspeedEngineWithLMHead):
            pass
    _register(TrueOnPolicyMindspeedEngine, "npu", "huawei")
