"""HF (transformers) adapter of the shared model, for trainers that build models with
``AutoModelForCausalLM.from_pretrained`` (verl's FSDP engine).

``TrueOnPolicyForCausalLM``'s submodules, parameter names and math are models.CausalLM's:
the trainer then runs the same layers as the rollout. The replacement is scoped to the
models that must compute the rollout's bits: ``register()`` maps only our own config
subclasses (``TrueOnPolicyQwen3Config`` / ``TrueOnPolicyQwen3MoeConfig``) to our classes,
and ``scoped_config(config)`` turns one model's config into one of them (verl's FSDP
engine does it for the actor and the reference, verl/swap_in.py). Any other Qwen3 model
the process builds from a plain Qwen3Config is transformers' own class. TP of the rollout
is emulated through the config attribute ``true_on_policy_tp_size`` (set with verl's
``model.override_config``), the rollout's top-k / top-p / min-p through
``truncation.CONFIG_ATTRS`` the same way (read into scoring.Scoring when the model is built).
"""
import copy
import logging

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel, Qwen3Config, Qwen3MoeConfig
from transformers.modeling_outputs import CausalLMOutputWithPast

from . import scheme, scoring
from .models import ModelConfig, TensorParallel, TrainerMixin, build_causal_lm

log = logging.getLogger(__name__)
TP_ATTR = "true_on_policy_tp_size"
# Compute dtype of the layer math (the rollout's dtype). Storage may be fp32 master
# weights; loaders rewrite config.dtype to the storage dtype, so it is kept apart.
DTYPE_ATTR = "true_on_policy_dtype"
# Rows >= len(tokenizer) are excluded from log-probs (the rollout masks them too).
VOCAB_ATTR = "true_on_policy_vocab_limit"


def _tokenizer_length(path):
    from transformers import AutoTokenizer
    try:
        return len(AutoTokenizer.from_pretrained(path))
    except (OSError, ValueError):
        return None     # no tokenizer beside the weights: set VOCAB_ATTR explicitly


class TrueOnPolicyForCausalLM(TrainerMixin, PreTrainedModel):
    base_model_prefix = "model"
    _no_split_modules = ["DecoderLayer"]          # FSDP wraps one decoder layer per unit
    supports_gradient_checkpointing = True       # Qwen3Model.gradient_checkpointing
    _supports_sdpa = _supports_flash_attn = True  # attention is ours whatever is requested

    def __init__(self, config):
        super().__init__(config)
        cfg = ModelConfig.from_hf(config.to_dict())
        if getattr(config, DTYPE_ATTR, None):
            cfg.dtype = getattr(torch, str(getattr(config, DTYPE_ATTR)).replace("torch.", ""))
        build_causal_lm(self, cfg, TensorParallel(size=int(getattr(config, TP_ATTR, 1) or 1)))
        self.scoring = scoring.Scoring.of(config, getattr(config, VOCAB_ATTR, None))
        scoring.activate(self.scoring)        # what this process's trainer log-probs apply
        if cfg.tie_word_embeddings:
            self._tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def _init_weights(self, module):
        pass  # weights always come from a checkpoint (load_checkpoint)

    def _check_and_adjust_attn_implementation(self, attn_implementation, is_init_check=False, **kwargs):
        """Nothing to check or load: the attention is ours whatever is requested. (transformers'
        check refuses verl's default, flash_attention_2, where flash-attn is not installed.)"""
        return attn_implementation or "sdpa"

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, config=None, torch_dtype=None, dtype=None,
                        **kwargs):
        """Our own loader (HF names, per-expert tensors as on disk): transformers' MoE
        weight conversion would fuse experts into tensors this model does not have."""
        config = config or scoped_config(AutoConfig.from_pretrained(pretrained_model_name_or_path))
        if not getattr(config, DTYPE_ATTR, None):     # what the rollout computes in, any checkpoint dtype
            setattr(config, DTYPE_ATTR, str(scheme.ROLLOUT_DTYPE))
        if getattr(config, VOCAB_ATTR, None) is None:
            n = _tokenizer_length(pretrained_model_name_or_path)
            setattr(config, VOCAB_ATTR, n and scheme.vocab_limit(n, config.vocab_size))
        model = cls(config)
        if not any(p.is_meta for p in model.parameters()):
            model.load_checkpoint(pretrained_model_name_or_path)
        return model.to(dtype or torch_dtype or torch.float32)

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=False, **kwargs):
        """verl calls either padded (attention_mask) or remove-padding packed (input_ids
        [1, T] with position_ids restarting at 0 per sequence) batches."""
        if position_ids is not None and input_ids.shape[0] == 1:
            attention_mask = None                 # packed: position_ids define the sequences
        logits = self.forward_tokens(input_ids, attention_mask, position_ids)
        return CausalLMOutputWithPast(logits=logits)


class TrueOnPolicyQwen3Config(Qwen3Config):
    """A Qwen3Config marked for the shared model (same model_type, same config.json)."""


class TrueOnPolicyQwen3MoeConfig(Qwen3MoeConfig):
    """A Qwen3MoeConfig marked for the shared model (same model_type, same config.json)."""


class TrueOnPolicyQwen3ForCausalLM(TrueOnPolicyForCausalLM):
    config_class = TrueOnPolicyQwen3Config


class TrueOnPolicyQwen3MoeForCausalLM(TrueOnPolicyForCausalLM):
    config_class = TrueOnPolicyQwen3MoeConfig


_MODELS = (TrueOnPolicyQwen3ForCausalLM, TrueOnPolicyQwen3MoeForCausalLM)
_SCOPED = {model_cls.config_class.__mro__[1]: model_cls.config_class for model_cls in _MODELS}


def scoped_config(config):
    """A copy of ``config`` that AutoModelForCausalLM builds as our model (after
    ``register()``); ``config`` itself when it is no Qwen3 / Qwen3-MoE config."""
    marked = _SCOPED.get(type(config))
    if marked is None:
        return config
    config = copy.deepcopy(config)
    config.__class__ = marked   # a subclass adding no state: the copy's fields stay as they are
    return config


def register():
    """Make AutoModelForCausalLM build our classes for our marked configs only (idempotent)."""
    for model_cls in _MODELS:
        AutoModelForCausalLM.register(model_cls.config_class, model_cls, exist_ok=True)
    log.info("true_on_policy: AutoModelForCausalLM -> TrueOnPolicyForCausalLM for scoped qwen3, qwen3_moe configs")
