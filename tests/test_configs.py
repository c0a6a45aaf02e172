"""The Qwen3-30B-A3B configs (8xH200, 16 Ascend NPUs) compose from verl's ppo_trainer, add no
verl keys, fill the consistency settings and pass the preflight against the real model shape.
They are validated here, not run."""
import json

import pytest

from test_verl_cpu import _compose, _leaf_keys
from true_on_policy.verl import preflight

QWEN3_30B_A3B = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 151936,
                 "hidden_size": 2048, "num_hidden_layers": 48, "num_attention_heads": 32,
                 "num_key_value_heads": 4, "head_dim": 128, "intermediate_size": 6144,
                 "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8,
                 "norm_topk_prob": True, "rms_norm_eps": 1e-6, "rope_theta": 1e6, "torch_dtype": "bfloat16",
                 "tie_word_embeddings": False}


@pytest.mark.parametrize("preset", ["qwen3_30b_a3b_h200x8", "qwen3_30b_a3b_ascend16"])
def test_large_presets_compose_and_pass_preflight(preset, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_30B_A3B))
    cfg = _compose([f"preset={preset}", f"actor_rollout_ref.model.path={tmp_path}",
                    "data.train_files=train.parquet", "data.val_files=val.parquet"])
    extra = {k for k in _leaf_keys(cfg) - _leaf_keys(_compose(["~preset"]))
             if not k.startswith(("true_on_policy.", "actor_rollout_ref.rollout.engine_kwargs.vllm."))}
    assert not extra, f"keys verl does not have: {extra}"
    assert preflight.problems(cfg) == []
    ro = cfg.actor_rollout_ref.rollout
    assert ro.tensor_model_parallel_size == 4 and ro.calculate_log_probs and ro.dtype == "bfloat16"
    assert cfg.actor_rollout_ref.actor.strategy == "fsdp2" and cfg.true_on_policy.self_check.enable
    assert cfg.trainer.n_gpus_per_node == (16 if "ascend" in preset else 8)
    if "h200" in preset:   # CUDA graphs on: full graphs for decode batches (tests/gpu/test_triton_graphs.py)
        assert not ro.enforce_eager and ro.engine_kwargs.vllm.compilation_config.cudagraph_mode == "FULL_DECODE_ONLY"


def test_preflight_rejects_tp8_for_qwen3_30b(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_30B_A3B))
    cfg = _compose(["preset=qwen3_30b_a3b_h200x8", f"actor_rollout_ref.model.path={tmp_path}",
                    "actor_rollout_ref.rollout.tensor_model_parallel_size=8"])
    assert any("num_key_value_heads=4 is not divisible by tensor_parallel_size=8" in p
               for p in preflight.problems(cfg))
