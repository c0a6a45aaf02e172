"""Model hyper-parameters of a Qwen3 / Qwen3-MoE checkpoint, read once for every reader.

Both engines, ``check``, the verl preflight and the Megatron spec call ``ModelConfig.from_hf``
(or ``from_dir``), which parses config.json with transformers' own config class for the
checkpoint: every key means what transformers makes of it (defaults, legacy spellings such as
``rope_scaling: {"type": ...}`` or a top-level ``rope_theta``, conflicts resolved its way). A
feature our model does not compute as transformers does is refused here, with one line naming
the key and its value (ValueError), before any engine starts.
"""
import copy
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

# HF architecture -> model type of the shared model (qwen3.py): what true on-policy covers.
ARCHITECTURES = {"Qwen3ForCausalLM": "qwen3", "Qwen3MoeForCausalLM": "qwen3_moe"}
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
_ROPE_TYPES = ("default", "linear", "yarn")       # the contract's "rope" and "rope_scaling" rules
# Keys whose presence means a model this class does not compute (transformers' Qwen3 ignores
# them too, but the checkpoint was made for a model that uses them).
_FOREIGN = {"dual_chunk_attention_config": "dual-chunk attention is not in the contract",
            "quantization_config": "quantized weights are not in the contract; use a bf16 checkpoint"}


@dataclass
class ModelConfig:
    arch: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1e6
    rope_scaling: dict = None       # resolved parameters of a scaled RoPE (linear, yarn); None: plain
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    dtype: torch.dtype = torch.bfloat16
    num_experts: int = 0
    top_k: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    moe_layers: list = field(default_factory=list)

    @classmethod
    def from_hf(cls, cfg) -> "ModelConfig":
        """From a config.json dict or a transformers config object (re-parsed from its dict, so
        every caller goes through the same parse)."""
        raw = cfg if isinstance(cfg, dict) else cfg.to_dict()
        arch = _arch_of(raw)
        hf = _parse(arch, raw)
        _refuse_unsupported(arch, hf, raw)
        heads = hf.num_attention_heads
        theta, scaling = _rope(hf)
        out = cls(arch=arch, vocab_size=hf.vocab_size, hidden_size=hf.hidden_size,
                  num_layers=hf.num_hidden_layers, num_heads=heads, num_kv_heads=hf.num_key_value_heads,
                  head_dim=_head_dim(hf), intermediate_size=hf.intermediate_size,
                  rms_norm_eps=float(hf.rms_norm_eps), rope_theta=theta, rope_scaling=scaling,
                  tie_word_embeddings=bool(hf.tie_word_embeddings), attention_bias=bool(hf.attention_bias),
                  dtype=DTYPES[str(raw.get("torch_dtype") or raw.get("dtype") or "bfloat16").replace("torch.", "")])
        if arch == "qwen3_moe":
            out._set_moe(hf)
        return out

    def _set_moe(self, hf):
        """Which layers are sparse: transformers' Qwen3MoeDecoderLayer rule."""
        self.num_experts, self.top_k = hf.num_experts, hf.num_experts_per_tok
        self.moe_intermediate_size, self.norm_topk_prob = hf.moe_intermediate_size, bool(hf.norm_topk_prob)
        step, dense = hf.decoder_sparse_step, set(hf.mlp_only_layers or [])
        self.moe_layers = [i for i in range(self.num_layers)
                           if i not in dense and self.num_experts > 0 and (i + 1) % step == 0]

    @classmethod
    def from_dir(cls, path) -> "ModelConfig":
        return cls.from_hf(json.loads((Path(path) / "config.json").read_text()))

    def numerics(self) -> dict:
        """Every parameter that reaches the bits of a log-prob (hashed into the fingerprint the
        engines compare): shapes, eps, RoPE, routing, layer kinds. Not the dtype: the trainer
        takes the rollout's (scheme.dtype_problems, hf_model.DTYPE_ATTR)."""
        out = asdict(self)
        del out["dtype"]
        return out


def _arch_of(cfg):
    for name in cfg.get("architectures") or []:
        if name in ARCHITECTURES:
            return ARCHITECTURES[name]
    if cfg.get("model_type") in ARCHITECTURES.values():
        return cfg["model_type"]
    raise NotImplementedError(
        f"architecture {cfg.get('architectures')} / model_type {cfg.get('model_type')!r} is not supported; "
        f"true on-policy covers {sorted(ARCHITECTURES)}")


def _parse(arch, raw):
    """transformers' config class for ``arch`` (Qwen3Config / Qwen3MoeConfig) from config.json's keys."""
    from huggingface_hub.errors import StrictDataclassError
    from transformers import AutoConfig
    from transformers.utils import logging as hf_logging
    keys = {k: v for k, v in copy.deepcopy(raw).items() if k != "model_type"}   # it edits nested dicts in place
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()        # its RoPE warnings: the refusals below name the problem
    try:
        return AutoConfig.for_model(arch, **keys)
    except (StrictDataclassError, TypeError, ValueError, KeyError) as err:     # field validation, bad rope dicts
        raise ValueError(f"config.json is not a valid {arch} config: {str(err).splitlines()[-1].strip()}") from None
    finally:
        hf_logging.set_verbosity(verbosity)


def _head_dim(hf):
    """Qwen3Config always has head_dim (128 when config.json has none); Qwen3MoeConfig has
    none unless config.json sets it, and its attention then uses hidden_size // heads."""
    return getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads


def _rope(hf):
    """(theta, scaling): the parameters transformers' rotary embedding computes from, resolved
    (factor, attention_factor, beta_fast/slow, truncate) as modeling_rope_utils does."""
    p = dict(hf.rope_parameters)
    kind, theta = p["rope_type"], float(p["rope_theta"])
    if kind == "default":
        return theta, None
    if kind == "linear":
        return theta, {"rope_type": "linear", "factor": float(p["factor"])}
    original = p["original_max_position_embeddings"]
    factor = p.get("factor") or hf.max_position_embeddings / original
    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        m, m_all = p.get("mscale"), p.get("mscale_all_dim")
        attention_factor = _mscale(factor, m) / _mscale(factor, m_all) if m and m_all else _mscale(factor)
    return theta, {"rope_type": "yarn", "factor": float(factor), "original_max_position_embeddings": original,
                   "beta_fast": float(p.get("beta_fast") or 32), "beta_slow": float(p.get("beta_slow") or 1),
                   "truncate": bool(p.get("truncate", True)), "attention_factor": float(attention_factor)}


def _mscale(scale, mscale=1):
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _refuse_unsupported(arch, hf, raw):
    """ValueError naming the first config feature that our model would not compute as
    transformers' Qwen3 / Qwen3-MoE does (the README's table of config features)."""
    for key, why in _FOREIGN.items():
        if raw.get(key):
            raise ValueError(f"{key} is set: {why}")
    if hf.hidden_act != "silu":
        raise ValueError(f"hidden_act={hf.hidden_act!r}: the contract's MLP is SiLU; only 'silu' is supported")
    if hf.attention_dropout:
        raise ValueError(f"attention_dropout={hf.attention_dropout}: the model has no dropout (training "
                         f"log-probs would differ from the rollout's); set 0.0")
    if _sliding(arch, hf):
        raise ValueError(f"use_sliding_window=True (sliding_window={hf.sliding_window}): sliding-window "
                         f"attention is not in the contract; set use_sliding_window=false")
    p = hf.rope_parameters or {}
    if "rope_type" not in p:            # per-layer-type RoPE: Qwen3 has one
        raise ValueError(f"rope_parameters={p}: one RoPE for all layers is supported, not one per layer type")
    if p["rope_type"] not in _ROPE_TYPES:
        raise ValueError(f"rope_type={p['rope_type']!r} (rope_parameters / rope_scaling): not in the contract "
                         f"(its frequencies depend on the sequence length or no Qwen3 checkpoint uses it); "
                         f"supported: {', '.join(_ROPE_TYPES)}")
    if p.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"partial_rotary_factor={p['partial_rotary_factor']}: Qwen3 rotates the whole head; "
                         f"set 1.0")
    if arch == "qwen3_moe" and hf.decoder_sparse_step < 1:
        raise ValueError(f"decoder_sparse_step={hf.decoder_sparse_step}: use 1 or more")


def _sliding(arch, hf):
    """Whether transformers would use a sliding window in some layer (Qwen3: layer_types from
    max_window_layers; Qwen3-MoE: every layer) once use_sliding_window sets ``sliding_window``."""
    if hf.sliding_window is None:
        return False
    return arch == "qwen3_moe" or "sliding_attention" in (hf.layer_types or [])
