"""The Qwen3-30B-A3B configs (8xH200, 16 Ascend NPUs; its 8-layer shape on one H200) compose
from verl's ppo_trainer, add no verl keys, fill the consistency settings and pass the preflight
against the real model shape. They are validated here, not run."""
import json

import pytest

from test_verl_cpu import _compose, _leaf_keys
from true_on_policy import scheme
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
    if "h200" in preset:   # CUDA graphs on: full graphs for any batch (tests/gpu/test_triton_graphs.py)
        from vllm.config import CompilationConfig
        graphs = CompilationConfig(**ro.engine_kwargs.vllm.compilation_config)   # vLLM accepts every key
        assert not ro.enforce_eager and graphs.cudagraph_mode.name == "FULL"
        assert dict(ro.engine_kwargs.vllm.compilation_config) == scheme.CUDA_GRAPHS   # what check --cuda-graphs runs


def test_one_h200_preset_composes_and_passes_preflight(tmp_path):
    """preset=qwen3_moe_h200x1 (scripts/gpu_verl_suite.sh): verl's keys only, GRPO with a
    reference on one GPU, the synthetic task, 3 steps, n 4 up to 1,024 tokens, CUDA graphs as
    check --cuda-graphs runs them, sleep mode on, at the 8-layer Qwen3-30B-A3B shape."""
    from verl.utils.config import omega_conf_to_dataclass

    from true_on_policy.main_ppo import prepare
    (tmp_path / "config.json").write_text(json.dumps({**QWEN3_30B_A3B, "num_hidden_layers": 8}))
    cfg = _compose(["preset=qwen3_moe_h200x1", f"actor_rollout_ref.model.path={tmp_path}",
                    f"true_on_policy.cache_dir={tmp_path}"])
    extra = {k for k in _leaf_keys(cfg) - _leaf_keys(_compose(["~preset"]))
             if not k.startswith(("true_on_policy.", "actor_rollout_ref.rollout.engine_kwargs.vllm.",
                                  "actor_rollout_ref.model.override_config."))}
    assert not extra, f"keys verl does not have: {extra}"
    assert preflight.problems(cfg) == []
    ro, actor = cfg.actor_rollout_ref.rollout, cfg.actor_rollout_ref.actor
    assert (cfg.trainer.n_gpus_per_node, cfg.trainer.nnodes, cfg.trainer.total_training_steps) == (1, 1, 3)
    assert (ro.n, cfg.data.max_response_length, ro.tensor_model_parallel_size) == (4, 1024, 1)
    assert cfg.algorithm.adv_estimator == "grpo" and actor.strategy == "fsdp2" and actor.use_kl_loss
    assert not ro.enforce_eager and dict(ro.engine_kwargs.vllm.compilation_config) == scheme.CUDA_GRAPHS
    assert ro.max_model_len >= scheme.CUDA_GRAPHS["max_cudagraph_capture_size"]
    assert ro.max_model_len >= cfg.data.max_prompt_length + cfg.data.max_response_length
    rollout = omega_conf_to_dataclass(ro)   # verl's RolloutConfig takes every key
    assert rollout.free_cache_engine and rollout.enable_sleep_mode
    assert cfg.actor_rollout_ref.model.override_config.attn_implementation == "sdpa"   # no flash-attn there
    assert cfg.reward.custom_reward_function.path == "pkg://true_on_policy.task" and cfg.data.train_files is None
    prepare(cfg)   # the synthetic task's files
    assert cfg.data.train_files.endswith("train.parquet") and cfg.actor_rollout_ref.model.path == str(tmp_path)


MEGATRON_NEEDED = "actor.strategy=megatron needs megatron-core + megatron-bridge"   # absent from .venv


@pytest.mark.parametrize("preset, tp, ep", [("qwen3_30b_a3b_megatron_h200x8", 4, 8),
                                            ("qwen3_30b_a3b_megatron_ascend16", 4, 16)])
def test_large_megatron_presets_compose_and_pass_preflight(preset, tp, ep, tmp_path):
    """The Megatron variants: verl's Megatron actor config (its own dataclass accepts every
    key), layouts that divide 32 heads, 4 KV heads and 128 experts, no PP / CP / expert TP."""
    from verl.utils.config import omega_conf_to_dataclass
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_30B_A3B))
    cfg = _compose([f"preset={preset}", f"actor_rollout_ref.model.path={tmp_path}",
                    "data.train_files=train.parquet", "data.val_files=val.parquet"])
    extra = {k for k in _leaf_keys(cfg) - _leaf_keys(_compose(["~preset", "model_engine=megatron"]))
             if not k.startswith(("true_on_policy.", "actor_rollout_ref.rollout.engine_kwargs.vllm."))}
    assert not extra, f"keys verl does not have: {extra}"
    assert type(omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)).__name__ == "McoreActorConfig"
    assert [p for p in preflight.problems(cfg) if not p.startswith(MEGATRON_NEEDED)] == []
    mg = cfg.actor_rollout_ref.actor.megatron
    assert (mg.tensor_model_parallel_size, mg.expert_model_parallel_size) == (tp, ep)
    assert (mg.expert_tensor_parallel_size, mg.pipeline_model_parallel_size, mg.context_parallel_size) == (1, 1, 1)
    n_ranks = cfg.trainer.n_gpus_per_node * cfg.trainer.nnodes
    assert n_ranks % tp == 0 and n_ranks % ep == 0 and cfg.actor_rollout_ref.rollout.tensor_model_parallel_size == tp
    assert cfg.true_on_policy.self_check.enable and cfg.trainer.n_gpus_per_node == (16 if "ascend" in preset else 8)


def test_preflight_names_a_megatron_layout_that_does_not_divide_the_model(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_30B_A3B))
    mg = "actor_rollout_ref.actor.megatron."
    cfg = _compose(["preset=qwen3_30b_a3b_megatron_h200x8", f"actor_rollout_ref.model.path={tmp_path}",
                    f"{mg}tensor_model_parallel_size=8", f"{mg}expert_model_parallel_size=3"])
    found = preflight.problems(cfg)
    assert any("num_key_value_heads=4 is not divisible by tensor_parallel_size=8" in p
               and f"{mg}tensor_model_parallel_size" in p for p in found), found
    assert f"{mg}expert_model_parallel_size=3 does not divide num_experts=128; use a divisor" in found


def test_preflight_rejects_tp8_for_qwen3_30b(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_30B_A3B))
    cfg = _compose(["preset=qwen3_30b_a3b_h200x8", f"actor_rollout_ref.model.path={tmp_path}",
                    "actor_rollout_ref.rollout.tensor_model_parallel_size=8"])
    assert any("num_key_value_heads=4 is not divisible by tensor_parallel_size=8" in p
               for p in preflight.problems(cfg))


def test_rollout_top_k_top_p_pass_preflight_and_reach_the_trainer_config():
    """Truncation is the contract's on both sides: accepted, bad values named, and the
    driver carries the rollout's values to the trainer's model config (hf_model)."""
    from omegaconf import open_dict

    from true_on_policy import truncation
    from true_on_policy.verl import swap_in
    cfg = _compose(["actor_rollout_ref.rollout.top_k=20", "actor_rollout_ref.rollout.top_p=0.9"])
    assert preflight.problems(cfg) == []
    with open_dict(cfg):
        swap_in._carry_truncation(cfg)
    oc = cfg.actor_rollout_ref.model.override_config
    assert [oc[a] for a in truncation.CONFIG_ATTRS] == [20, 0.9, 0.0]
    bad = _compose(["actor_rollout_ref.rollout.top_p=1.5", "actor_rollout_ref.rollout.top_k=-2"])
    assert {p for p in preflight.problems(bad) if "top_" in p} == {
        "actor_rollout_ref.rollout.top_k=-2 must be an integer >= 1 (0 or -1: off)",
        "actor_rollout_ref.rollout.top_p=1.5 must be in (0, 1] (1: off)"}
    kl = _compose(["actor_rollout_ref.rollout.top_p=0.9", "actor_rollout_ref.actor.use_kl_loss=true",
                   "actor_rollout_ref.actor.kl_loss_type=k1"])
    assert any("kl_loss_type='k1' with top_k/top_p" in p for p in preflight.problems(kl))
    assert not any("kl_loss_type" in p for p in preflight.problems(
        _compose(["actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.actor.kl_loss_type=k1"])))


@pytest.mark.parametrize("overrides, key, drop", [
    (["actor_rollout_ref.rollout.enable_rollout_routing_replay=true"],
     "actor_rollout_ref.rollout.enable_rollout_routing_replay=True", "set False"),
    (["preset=tiny_grpo_megatron", "actor_rollout_ref.actor.megatron.router_replay.mode=R3"],
     "actor_rollout_ref.actor.megatron.router_replay.mode='R3'", "set disabled"),
    (["preset=tiny_grpo_megatron", "actor_rollout_ref.actor.megatron.router_replay.mode=R2"],
     "actor_rollout_ref.actor.megatron.router_replay.mode='R2'", "set disabled")])
def test_routing_replay_is_refused_naming_the_key_to_drop(overrides, key, drop):
    """R2 / R3 with the plugin on: one line per key, saying routing is already identical."""
    found = [p for p in preflight.problems(_compose(overrides)) if "routing replay" in p]
    assert len(found) == 1 and found[0].startswith(key + ": routing replay is redundant"), found
    assert "already identical" in found[0] and found[0].endswith(f"drop it ({drop})") and "\n" not in found[0]


@pytest.mark.parametrize("edit, message", [
    ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope_type='dynamic'"),
    ({"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 0}, "use_sliding_window=True")])
def test_a_refused_config_feature_fails_the_preflight(tmp_path, edit, message):
    """The shared reader's refusals reach the verl preflight too (before Ray or any engine),
    naming the key, its value and the model path; the plain config passes."""
    (tmp_path / "config.json").write_text(json.dumps({**QWEN3_30B_A3B, **edit}))
    found = [p for p in preflight.problems(_compose([f"actor_rollout_ref.model.path={tmp_path}"])) if message in p]
    assert len(found) == 1 and found[0].endswith(f"(actor_rollout_ref.model.path={tmp_path})"), found
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_30B_A3B))
    assert not [p for p in preflight.problems(_compose([f"actor_rollout_ref.model.path={tmp_path}"]))
                if "model.path" in p]


def test_routing_replay_off_passes():
    assert not [p for p in preflight.problems(_compose()) if "routing replay" in p]


def test_tools_preset_composes_and_passes_preflight(tmp_path):
    """preset=tiny_grpo_tools: verl's own multi-turn keys only; prepare fills the calculator tool."""
    from true_on_policy.main_ppo import prepare
    cfg = _compose(["preset=tiny_grpo_tools", f"true_on_policy.cache_dir={tmp_path}"])
    extra = {k for k in _leaf_keys(cfg) - _leaf_keys(_compose(["~preset"]))
             if not k.startswith(("true_on_policy.", "actor_rollout_ref.rollout.engine_kwargs.vllm."))}
    assert not extra, f"keys verl does not have: {extra}"
    prepare(cfg)
    mt = cfg.actor_rollout_ref.rollout.multi_turn
    assert mt.enable and mt.format == "true_on_policy_calculator" and mt.function_tool_path.endswith("calculator_tool.py")
    assert cfg.actor_rollout_ref.rollout.agent.default_agent_loop == "tool_agent"
    assert cfg.actor_rollout_ref.rollout.enable_prefix_caching
    assert preflight.problems(cfg) == []
