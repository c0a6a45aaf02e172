"""Scoped patches (issue 17): with the plugin on, only the models and functions a true
on-policy job owns change; every wrapper keeps verl's contract for the inputs verl's own
tests give it; with TRUE_ON_POLICY=0 every verl function is verl's."""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from verl import DataProto

from true_on_policy import scoring
from true_on_policy.make_tiny_model import ensure_tiny_model
from true_on_policy.verl import contract_registry, guard, trainer_logprobs

PROBE = Path(__file__).with_name("scoped_probe.py")
OURS = ["FSDPEngine._build_module", "PPOTrainer.__init__", "RayPPOTrainer.__init__",
        "debug_metrics.calculate_debug_metrics", "engine.logprobs_from_logits", "trainer_base.calculate_debug_metrics",
        "vLLMHttpServer.run_server", "validate_config", "vllm_async_server.SamplingParams"]
STOCK_LM = "transformers.models.qwen3.modeling_qwen3.Qwen3ForCausalLM"


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return ensure_tiny_model(tmp_path_factory.getbasetemp() / "models", "qwen3", hidden_size=128, num_layers=2)


def probe(path, switch):
    """Build verl's real FSDP actor and critic and an outside Qwen3 in a fresh process."""
    env = dict(os.environ, TRUE_ON_POLICY=switch)
    done = subprocess.run([sys.executable, str(PROBE), str(path)], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_plugin_on_replaces_only_the_actor_model(qwen3):
    found = probe(qwen3, "1")
    assert found["actor"] == "true_on_policy.hf_model.TrueOnPolicyQwen3ForCausalLM"
    assert found["critic"] == "transformers.models.qwen3.modeling_qwen3.Qwen3ForTokenClassification"
    assert found["outside"] == STOCK_LM                   # a reward / user model: transformers' own
    assert found["outside_linears"] > 0 and found["lora_layers"] > 0   # PEFT's all-linear finds them
    assert found["auto_mapping_extra"] == ["TrueOnPolicyQwen3Config", "TrueOnPolicyQwen3MoeConfig"]
    assert found["patched"] == sorted(OURS)                       # verl's torch_functional stays verl's
    assert found["sampling"] == [True, 8, 0, 3, {"a": 1}]  # verl's request keys arrive unchanged


def test_plugin_off_is_stock(qwen3):
    """TRUE_ON_POLICY=0: the package installed (its verl plugin imported), every verl function
    and every model class stock (only the CPU-host settings of cpu_support apply)."""
    found = probe(qwen3, "0")
    assert found["actor"] == found["outside"] == STOCK_LM
    assert found["patched"] == [] and found["auto_mapping_extra"] == []


# ----------------------------------------------------------------------------- wrappers, verl's inputs
def verl_debug_batch(**masks):
    """The batch of verl's tests/utils/debug/test_metrics.py (a loss_mask only: no
    response or attention mask, so verl falls back to every token)."""
    torch.manual_seed(0)
    rollout = -torch.rand(2, 10)
    return DataProto.from_dict({"rollout_log_probs": rollout, "old_log_probs": rollout - torch.rand(2, 10),
                                "loss_mask": torch.ones(2, 10, dtype=torch.long),
                                "responses": torch.zeros((2, 10)), **masks})


@pytest.fixture
def in_trainer(monkeypatch):
    """As in a TaskRunner whose trainer verl built (guard armed), warn mode, contracts equal."""
    monkeypatch.setattr(guard, "_trainer_built", True)
    monkeypatch.setattr(contract_registry, "collect", lambda: {"trainer": ["fp"], "rollout": ["fp"]})
    guard.configure({"true_on_policy": {"on_mismatch": "warn"}})
    yield
    guard.configure({})


@pytest.mark.parametrize("masks", [{}, {"attention_mask": torch.ones(2, 14, dtype=torch.long)},
                                   {"response_mask": torch.zeros(2, 10, dtype=torch.long)}],
                         ids=["no_mask", "attention_mask", "empty_response_mask"])
def test_calculate_debug_metrics_keeps_verls_contract(masks, in_trainer):
    from verl.utils.debug.metrics import calculate_debug_metrics as stock
    data = verl_debug_batch(**masks)
    expected, ours = stock(data), guard._wrap(stock)(data)
    assert {k: ours[k] for k in expected} == pytest.approx(expected, nan_ok=True)
    assert ours["true_on_policy/num_tokens"] == (0 if "response_mask" in masks else 20)


def test_calculate_debug_metrics_outside_a_trainer_is_verls():
    """No trainer built in this process (a tool, verl's own test): verl's result only, no guard."""
    from verl.utils.debug.metrics import calculate_debug_metrics as stock
    assert guard._wrap(stock)(verl_debug_batch()) == stock(verl_debug_batch())


@pytest.mark.parametrize("shape", [(7, 50), (2, 5, 50)], ids=["packed", "batched"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logprobs_from_logits_keeps_verls_contract(shape, dtype, monkeypatch):
    """verl's inputs (tests/utils: (T, V) packed and (B, S, V), fp32 and bf16, the
    inplace_backward keyword): same shape and dtype as verl's; the same numbers up to
    rounding; verl's own function where no model of ours was built."""
    from verl.utils.torch_functional import logprobs_from_logits as stock
    logits = torch.randn(*shape, generator=torch.Generator().manual_seed(0)).to(dtype)
    labels = torch.randint(0, shape[-1], shape[:-1], generator=torch.Generator().manual_seed(1))
    wrapped = trainer_logprobs._fsdp(stock)
    monkeypatch.setattr(scoring, "_active", None)               # no model of ours built here
    assert torch.equal(wrapped(logits, labels, inplace_backward=False), stock(logits, labels))
    monkeypatch.setattr(scoring, "_active", scoring.Scoring())
    monkeypatch.setattr(trainer_logprobs, "_publish_contract", lambda _fingerprint: None)   # no Ray job to report to
    ours, theirs = wrapped(logits=logits, labels=labels, inplace_backward=True), stock(logits, labels)
    assert ours.shape == theirs.shape and ours.dtype == theirs.dtype
    tol = 1e-5 if dtype == torch.float32 else 0.1
    assert torch.allclose(ours.float(), theirs.float(), atol=tol) and not math.isnan(ours.float().sum())


def test_lora_is_rejected_with_its_reason():
    from omegaconf import OmegaConf

    from true_on_policy.verl import preflight
    cfg = OmegaConf.create({"actor_rollout_ref": {"model": {"lora_rank": 8}, "rollout": {"name": "vllm"}}})
    [problem] = preflight.problems(cfg)
    assert problem.startswith("actor_rollout_ref.model.lora_rank=8: LoRA is not supported")
    assert problem.endswith("set lora_rank=0 (full fine-tuning)")
