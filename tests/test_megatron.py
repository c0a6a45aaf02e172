"""verl's Megatron actor under TRUE_ON_POLICY=1, unit level: Megatron GPTModels built by
Megatron-Bridge from the tiny Qwen3-MoE checkpoint with our layer spec, on 2 gloo ranks,
trainer TP=2/EP=2 (sequence parallel) and TP=1/EP=2 (data parallel, different batches per
rank), and the tiny Qwen3 dense (tied embeddings) at TP=2, give the rollout model's logits at rollout TP 1 and 2 BITWISE (packed trainer path and
the paged rollout path); stock Megatron modules differ (companion); the spec's backward
matches the trainer model's gradients; bridge's weight export is exact, and after a training
step the exported weights give the rollout model Megatron's logits bitwise; verl 0.9.1's own
Megatron engine (our registered subclass) computes the rollout's log-probs (infer_batch), and
again after its own training step (train_batch) with the exported new weights. Runs in .venv-megatron (scripts/setup_megatron.sh);
skipped where that environment is absent."""
import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PY = ROOT / ".venv-megatron" / "bin" / "python"
READY = (ROOT / ".venv-megatron" / ".stamp").exists()      # written by a completed setup only
needs_env = pytest.mark.skipif(not READY, reason="no .venv-megatron (run scripts/setup_megatron.sh)")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    if not READY:
        pytest.skip("no .venv-megatron (run scripts/setup_megatron.sh)")
    tmp = tmp_path_factory.mktemp("megatron")
    out = tmp / "out.json"
    for arch in ("qwen3_moe", "qwen3"):
        subprocess.run([str(ROOT / ".venv" / "bin" / "python"), "-m", "true_on_policy.make_tiny_model",
                        "--arch", arch, "--out", str(tmp / arch), "--num-layers", "2", "--hidden-size", "128",
                        "--head-dim", "32", "--init-std", "0.08"], check=True, capture_output=True)
    proc = subprocess.run([str(PY), str(ROOT / "tests" / "megatron_worker.py"), str(tmp / "qwen3_moe"),
                           str(tmp / "qwen3"), str(out)],
                          capture_output=True, text=True, timeout=600)
    if proc.returncode:
        pytest.fail(f"megatron_worker.py failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(out.read_text())


@pytest.mark.parametrize("arch, tp, ep", [("moe", 2, 2), ("moe", 1, 2), ("dense", 2, 1)])
@pytest.mark.parametrize("rollout_tp", [1, 2])
def test_megatron_logits_bitwise_equal_rollout(results, arch, tp, ep, rollout_tp):
    rows = [r for r in results if r.get("arch") == arch and r.get("tp") == tp and r.get("ep") == ep
            and r.get("rollout_tp") == rollout_tp]
    assert len(rows) == 2                                        # both ranks
    for r in rows:
        assert r["max_abs_diff"] == 0.0 and r["equal"] and r["equal_paged_rollout"], r


def test_stock_megatron_differs(results):
    rows = [r for r in results if r.get("stock")]
    assert len(rows) == 2 and all(not r["equal"] and r["max_abs_diff"] > 0 for r in rows), rows


def test_spec_backward_matches_trainer_gradients(results):
    rows = [r["train_step"]["grads"] for r in results if "train_step" in r]
    assert len(rows) == 2
    for grads in rows:      # bf16 gradients, different reduction orders: a few bf16 ulps
        assert grads and all(err < 0.05 for err in grads.values()), grads


def test_weight_export_exact_and_synced_rollout_bitwise_after_step(results):
    for r in [r["train_step"] for r in results if "train_step" in r]:
        assert r["export_exact"], r                          # HF -> Megatron -> HF round trip
        assert r["changed"] > r["total"] // 2, r             # the step changed the weights
        assert r["synced_equal"] and r["synced_max_abs_diff"] == 0.0, r


@pytest.mark.parametrize("tp, ep", [(2, 2), (1, 2)])
def test_verl_megatron_engine_logprobs_bitwise_equal_rollout(results, tp, ep):
    rows = [r for r in results if r.get("engine") and r["tp"] == tp and r["ep"] == ep]
    assert len(rows) == 2 and all(r["equal"] and r["max_abs_diff"] == 0.0 for r in rows), rows


def test_verl_megatron_engine_applies_the_rollout_truncation(results):
    """At trainer TP=2 the job's rollout top_p=0.9 (carried in override_config, as the driver
    carries it) reaches verl's Megatron engine: its log-probs are the rollout's truncated ones
    bitwise (both rows above), and differ from the untruncated ones (companion)."""
    rows = [r for r in results if r.get("engine") and r["tp"] == 2]
    assert len(rows) == 2 and all(r["cut"] == [0, 0.9, 0.0] for r in rows), rows
    assert all(r["equal"] and r["trained_equal"] and r["untruncated_max_abs_diff"] > 0 for r in rows), rows


@pytest.mark.parametrize("tp, ep", [(2, 2), (1, 2)])
def test_verl_megatron_engine_train_step_then_logprobs_bitwise_equal_rollout(results, tp, ep):
    """verl's ``train_batch`` (forward, backward, DDP, distributed Adam) changes the weights;
    exported by ``get_per_tensor_param`` into the rollout model, the engine's new log-probs
    equal the rollout's bitwise; the rollout left on the old weights differs (companion)."""
    rows = [r for r in results if r.get("engine") and r["tp"] == tp and r["ep"] == ep]
    assert len(rows) == 2 and any(r["grad_norm"] for r in rows), rows
    for r in rows:
        assert r["changed"] > r["total"] // 2, r
        assert r["trained_equal"] and r["trained_max_abs_diff"] == 0.0, r
        assert r["stale_max_abs_diff"] > 0, r


@needs_env
def test_swap_in_registers_the_engines_and_logprobs():
    code = ("import verl, verl.workers.engine.megatron.transformer_impl as t\n"
            "from verl.workers.engine.base import EngineRegistry as R\n"
            "from verl.workers.engine.mindspeed import MindspeedEngineWithLMHead as M\n"
            "npu = R._engines['language_model']['megatron'][('npu', 'huawei')]\n"
            "print(issubclass(npu, M), npu.__name__, "
            "R.get_engine_cls('language_model', 'megatron').__name__, "
            "t.vocab_parallel_log_probs_from_logits.__name__)")
    proc = subprocess.run([str(PY), "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "TRUE_ON_POLICY": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    # MindSpeed (Ascend): the same spec on verl's MindSpeed engine, shadowing verl's "npu" key
    assert proc.stdout.split()[-4:] == ["True", "TrueOnPolicyMindspeedEngine", "TrueOnPolicyMegatronEngine",
                                        "contract_vocab_parallel_log_probs"]


def _megatron_job(**megatron):
    from omegaconf import OmegaConf
    return OmegaConf.create({"actor_rollout_ref": {"actor": {"strategy": "megatron", "megatron": megatron},
                                                   "rollout": {"name": "vllm"}}})


def test_preflight_megatron_rules():
    from true_on_policy.verl import preflight
    found = preflight.problems(_megatron_job(tensor_model_parallel_size=2, pipeline_model_parallel_size=2))
    assert any("expert_tensor_parallel_size must be 1" in p for p in found)
    assert any("pipeline_model_parallel_size=2" in p for p in found)
    # .venv has no Megatron: the job is told how to get it.
    assert any("scripts/setup_megatron.sh" in p for p in found)
    ok = preflight.problems(_megatron_job(tensor_model_parallel_size=2, expert_tensor_parallel_size=1))
    assert all("setup_megatron" in p for p in ok), ok       # admitted (tests/test_megatron_e2e.py)
