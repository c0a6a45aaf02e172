"""The per-step guard (true_on_policy/* metrics, raise|warn, the saved batch) and the
contract registry behind true_on_policy/contract_match, with a real local Ray."""
import logging

import pytest
import torch
from verl import DataProto

from true_on_policy.verl import contract_registry, guard

FP = "cops-v1-reference-0123456789ab"
SAME = {"trainer": [FP], "rollout": [FP, FP]}


@pytest.fixture(autouse=True)
def settings(tmp_path):
    guard.configure({"true_on_policy": {"on_mismatch": "raise", "dump_dir": str(tmp_path / "dumps")}})
    yield tmp_path / "dumps"
    guard.configure({})


def batch(offset=0.0):
    torch.manual_seed(0)
    rollout = -torch.rand(3, 5)
    actor = rollout.clone()
    actor[1, 2] += offset
    mask = torch.ones(3, 5)
    mask[2, 3:] = 0
    return DataProto.from_dict({"rollout_log_probs": rollout, "old_log_probs": actor, "response_mask": mask})


def test_exact_step():
    m = guard.check_batch(batch(), contracts=SAME)
    assert m == {"true_on_policy/logdiff_max": 0.0, "true_on_policy/logdiff_mean": 0.0,
                 "true_on_policy/frac_exact": 1.0, "true_on_policy/num_tokens": 13,
                 "true_on_policy/contract_match": 1.0}


def test_logdiff_raises_with_report_and_saved_batch(settings):
    with pytest.raises(guard.TrueOnPolicyMismatch) as err:
        guard.check_batch(batch(2.0 ** -20), contracts=SAME)
    text = str(err.value)
    assert "logdiff_max=9.54e-07" in text and "sample 1, response token 2" in text and "--localize" in text
    saved = torch.load(next(settings.iterdir()))
    assert set(saved) == {"rollout_log_probs", "old_log_probs", "response_mask"}


def test_warn_mode_keeps_going(caplog):
    guard.configure({"true_on_policy": {"on_mismatch": "warn"}})
    with caplog.at_level(logging.WARNING, logger="true_on_policy.verl"):
        m = guard.check_batch(batch(0.5), contracts=SAME)
    assert m["true_on_policy/logdiff_max"] == 0.5 and m["true_on_policy/frac_exact"] == 12 / 13
    assert "true on-policy broken" in caplog.text


def test_bad_on_mismatch_value():
    with pytest.raises(ValueError, match="on_mismatch='stop'; use raise or warn"):
        guard.configure({"true_on_policy": {"on_mismatch": "stop"}})


@pytest.mark.parametrize("contracts, why", [
    ({"trainer": [FP], "rollout": [FP, "cops-v1-triton-ffffffffffff"]}, "the engines run different contracts"),
    ({"trainer": [FP], "rollout": [None]}, "rollout None"),                 # a stock vLLM model class
    ({"trainer": [FP], "rollout": []}, "no contract fingerprint from the rollout"),
])
def test_contract_mismatch_stops_even_with_equal_logprobs(contracts, why):
    with pytest.raises(guard.TrueOnPolicyMismatch, match="contract_match=0") as err:
        guard.check_batch(batch(), contracts=contracts)
    assert why in str(err.value)


def test_registry_across_ray_processes():
    """Reports from other processes of the same job are collected; another job's are not."""
    ray = pytest.importorskip("ray")
    assert contract_registry.collect() == {"trainer": [], "rollout": []}   # no Ray job: nothing
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        @ray.remote
        def report(role, fingerprints):
            from true_on_policy.verl import contract_registry as registry
            registry.publish(role, fingerprints)

        ray.get([report.remote("trainer", [FP]), report.remote("rollout", [FP, FP])])
        found = contract_registry.collect()
        assert found == {"trainer": [FP], "rollout": [FP, FP]}
        assert contract_registry.compare(found) == (True, "")
        ray.get(report.remote("rollout", ["cops-v1-triton-ffffffffffff"]))   # a worker in another process
        assert contract_registry.compare(contract_registry.collect())[0] is False
    finally:
        ray.shutdown()


def test_per_turn_metrics_follow_the_response_mask_runs():
    """A multi-turn response mask (model tokens 1, tool tokens 0): one logdiff per assistant
    turn; the tool tokens' log-probs (here wildly off) count nowhere. Single-turn: no keys."""
    rollout = -torch.arange(16.0).reshape(2, 8) / 16        # dyadic: the differences are exact
    actor = rollout.clone()
    mask = torch.tensor([[1, 1, 0, 0, 1, 1, 1, 0], [1, 0, 1, 0, 1, 1, 0, 0]], dtype=torch.float)
    actor[mask == 0] += 5.0                        # tool / padding positions: ignored
    actor[1, 4] += 0.25                            # sample 1's third turn
    assert torch.equal(guard.turn_index(mask), torch.tensor([[1, 1, 0, 0, 2, 2, 2, 0], [1, 0, 2, 0, 3, 3, 0, 0]]))
    m = guard.turn_metrics(rollout, actor, mask)
    assert m == {"true_on_policy/turns_mean": 2.5, "true_on_policy/turn_1/logdiff_max": 0.0, "true_on_policy/turn_1/num_tokens": 3,
                 "true_on_policy/turn_2/logdiff_max": 0.0, "true_on_policy/turn_2/num_tokens": 4,
                 "true_on_policy/turn_3/logdiff_max": 0.25, "true_on_policy/turn_3/num_tokens": 2}
    assert guard.turn_metrics(rollout, actor, torch.ones(2, 8)) == {}
