"""Model hyper-parameters read from a HF config.json (Qwen3 and Qwen3-MoE)."""
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

# HF architecture -> model type of the shared model (qwen3.py): what true on-policy covers.
ARCHITECTURES = {"Qwen3ForCausalLM": "qwen3", "Qwen3MoeForCausalLM": "qwen3_moe"}
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


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
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    dtype: torch.dtype = torch.bfloat16
    num_experts: int = 0
    top_k: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    moe_layers: list = field(default_factory=list)

    @classmethod
    def from_hf(cls, cfg: dict) -> "ModelConfig":
        arch = _arch_of(cfg)
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        if rope.get("rope_type", "default") not in ("default", None):
            raise NotImplementedError(f"rope_type={rope['rope_type']!r}: only default RoPE is in the contract")
        heads = cfg["num_attention_heads"]
        out = cls(arch=arch, vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
                  num_layers=cfg["num_hidden_layers"], num_heads=heads,
                  num_kv_heads=cfg.get("num_key_value_heads", heads),
                  head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
                  intermediate_size=cfg.get("intermediate_size", 0),
                  rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
                  rope_theta=float(cfg.get("rope_theta", rope.get("rope_theta", 1e6))),
                  tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                  attention_bias=bool(cfg.get("attention_bias", False)),
                  dtype=DTYPES[str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16").replace("torch.", "")])
        if arch == "qwen3_moe":
            out._set_moe(cfg)
        return out

    def _set_moe(self, cfg):
        self.num_experts = cfg.get("num_experts") or cfg["num_local_experts"]
        self.top_k = cfg["num_experts_per_tok"]
        self.moe_intermediate_size = cfg["moe_intermediate_size"]
        self.norm_topk_prob = bool(cfg.get("norm_topk_prob", True))
        step, dense = cfg.get("decoder_sparse_step", 1), set(cfg.get("mlp_only_layers") or [])
        self.moe_layers = [i for i in range(self.num_layers)
                           if i not in dense and self.num_experts > 0 and (i + 1) % step == 0]

    @classmethod
    def from_dir(cls, path) -> "ModelConfig":
        return cls.from_hf(json.loads((Path(path) / "config.json").read_text()))


def _arch_of(cfg):
    for name in cfg.get("architectures") or []:
        if name in ARCHITECTURES:
            return ARCHITECTURES[name]
    if cfg.get("model_type") in ARCHITECTURES.values():
        return cfg["model_type"]
    raise NotImplementedError(
        f"architecture {cfg.get('architectures')} / model_type {cfg.get('model_type')!r} is not supported; "
        f"true on-policy covers {sorted(ARCHITECTURES)}")
