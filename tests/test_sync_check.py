"""Debug-mode weight sync checksum (true_on_policy.sync_check, verl/weight_sync.py): the trainer's stream and
the rollout's receiver agree on an exact sync, over several buckets, and name what
differs otherwise. The whole loop with it on is in test_recipe_e2e.py."""
import asyncio

import pytest
import torch

from true_on_policy import sync_check
from true_on_policy.verl.weight_sync import sending

HELD = ["a.weight", "b.weight", "c.weight"]


def trainer_stream(weights):
    async def collect():
        return [item async for item in sending(iter(weights))]
    return asyncio.run(collect())


def weights():
    torch.manual_seed(0)
    return [("a.weight", torch.randn(4, 3)), ("b.weight", torch.randn(5).bfloat16()),
            ("c.weight", torch.randn(2, 2))]


def receive(items, held=HELD, buckets=(2,)):
    """The rollout side: one load_weights call per bucket, as verl's receiver makes them."""
    receiver, loaded, start = sync_check.Receiver(), [], 0
    for end in [*buckets, len(items)]:
        loaded += list(receiver.filter(items[start:end], held))
        start = end
    return loaded


def test_exact_sync_passes_and_loads_only_weights():
    sent = weights()
    loaded = receive(trainer_stream(sent), buckets=(1, 3))
    assert [n for n, _ in loaded] == [n for n, _ in sent]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(loaded, sent))


@pytest.mark.parametrize("change, message", [
    (lambda items: items.__setitem__(2, ("b.weight", items[2][1].float().bfloat16() + 2 ** -7)),
     "1 arrived with other bytes (e.g. b.weight)"),
    (lambda items: items.__setitem__(2, ("b.weight", items[2][1].float())),      # a dtype change on the way
     "1 arrived with other bytes (e.g. b.weight)"),
    (lambda items: items.pop(3), "1 sent but not received (e.g. c.weight)"),
    (lambda items: items.insert(1, ("z.weight", torch.ones(1))), "1 received but not sent (e.g. z.weight)"),
])
def test_any_difference_stops_the_sync(change, message):
    items = trainer_stream(weights())
    change(items)
    with pytest.raises(sync_check.WeightSyncMismatch, match="weight sync not exact") as err:
        receive(items)
    assert message in str(err.value)


def test_a_parameter_left_out_of_the_sync_is_named():
    items = trainer_stream(weights()[:2])
    with pytest.raises(sync_check.WeightSyncMismatch, match=r"1 held by the rollout but not synced \(e.g. c.weight\)"):
        receive(items)


def test_a_load_outside_a_sync_is_not_checked():
    """vLLM's own checkpoint load at start-up goes through load_weights without the markers."""
    assert len(receive(weights(), held=["x.weight"])) == 3


@pytest.mark.parametrize("layout", ["per_expert", "stacked"])
def test_experts_synced_by_either_name(layout):
    """verl's FSDP sync sends experts one by one under checkpoint names (it unfuses
    transformers 5 stacks); the trainer's state_dict names them stacked: either covers
    the rollout's experts, and a missing expert is named."""
    from helpers import per_expert, random_model, tiny_config
    from true_on_policy.models.causal_lm import sync_names
    model = random_model(tiny_config("qwen3_moe"))
    held, stacks = sync_names(model)
    assert "model.layers.0.mlp.experts.7.up_proj.weight" in held and "model.layers.0.mlp.experts.down_proj" not in held
    state = list(model.state_dict().items())
    sent = list(per_expert(state)) if layout == "per_expert" else state
    covers = lambda n: stacks.get(n, (n,))        # noqa: E731
    assert len(list(sync_check.Receiver().filter(trainer_stream(sent), held, covers))) == len(sent)
    gone = [(n, t) for n, t in sent if not n.startswith("model.layers.1.mlp.experts.")]
    with pytest.raises(sync_check.WeightSyncMismatch, match="held by the rollout but not synced.*layers.1.mlp.experts"):
        list(sync_check.Receiver().filter(trainer_stream(gone), held, covers))


def test_digest_sees_a_flipped_bit_and_a_moved_word():
    """Integer sums of 16-bit words, plain and position-weighted: a one-bit change, two words
    swapped, a dtype or shape change and an odd trailing byte all change the digest."""
    x = torch.randn(3, 1001).bfloat16()
    flipped = x.clone()
    flipped.view(torch.int16)[1, 7] ^= 1
    swapped = x.clone()
    swapped[0, :2] = x[0, :2].flip(0)
    odd = torch.arange(7, dtype=torch.uint8)
    other = odd.clone()
    other[-1] += 1
    d = sync_check.digest
    assert d(x) == d(x.clone()) and d(x) == d(x.t().contiguous().t())
    assert len({d(x), d(flipped), d(swapped), d(x.view(torch.int16)), d(x.reshape(1001, 3))}) == 5
    assert d(odd) != d(other) and d(torch.empty(0)) == "torch.float32(0,):0:0:"
