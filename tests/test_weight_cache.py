"""The reference backend's fp64 weight copies (kept per weight version under inference
mode, i.e. in the rollout): reused while a weight is unchanged, refreshed after any
in-place update (verl's weight sync through load_weights, an optimizer-style op), never
used outside inference mode; the bits are those of a per-call widening."""
import torch

import consistent_ops as co
from consistent_ops.reference.core import weight64
from helpers import random_model, tiny_config


def logits(model, ids, pos, inference):
    with torch.inference_mode() if inference else torch.no_grad():
        return model.forward_packed(ids, pos)


def test_kept_per_version_under_inference_mode_only():
    w = torch.nn.Parameter(torch.randn(8, 4).bfloat16())
    with torch.inference_mode():
        first = weight64(w)
        assert weight64(w) is first and torch.equal(first, w.double())
        with torch.no_grad():
            w.mul_(2)
        assert torch.equal(weight64(w), w.double()) and not torch.equal(weight64(w), first)
    with torch.no_grad():
        assert weight64(w) is not weight64(w)


def test_rollout_follows_in_place_weight_sync():
    cfg = tiny_config("qwen3_moe")
    model, new = random_model(cfg, seed=0), random_model(cfg, seed=1)
    ids = torch.randint(0, 500, (40,), generator=torch.Generator().manual_seed(0))
    pos = torch.cat([torch.arange(25), torch.arange(15)])
    before = logits(model, ids, pos, inference=True)
    assert torch.equal(before, logits(model, ids, pos, inference=False))
    model.load_weights(new.state_dict().items())              # verl's sync: in place, by HF name
    after = logits(model, ids, pos, inference=True)
    assert torch.equal(after, logits(new, ids, pos, inference=False)) and not torch.equal(after, before)
    with torch.no_grad():                                      # any in-place op bumps the version
        for m in (model, new):
            m.lm_head.weight.mul_(2)
            m.model.layers[1].mlp.experts.down_proj[3].mul_(-1)   # one expert's row of the stack
    assert torch.equal(logits(model, ids, pos, inference=True), logits(new, ids, pos, inference=False))


def test_linear_bits_with_and_without_the_copy():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(33, 64, generator=g).bfloat16(), torch.randn(48, 64, generator=g).bfloat16()
    ref = co.linear(x, w)
    with torch.inference_mode():
        assert torch.equal(co.linear(x, w), ref) and torch.equal(co.linear(x, w), ref)


def test_fsdp2_refills_parameters_without_a_version_bump(tmp_path):
    """Why every weight cache here lives under inference mode only (reference ``kept``): in training, FSDP2 hands the forward the same unsharded parameter
    object, refilled in place with the new weights but at the same version."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    class Probe(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight, self.seen = torch.nn.Parameter(torch.randn(8, 8)), []

        def forward(self, x):
            self.seen.append((self.weight, self.weight._version, self.weight.detach().clone()))
            return x @ self.weight.t()

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        probe = Probe()
        model = torch.nn.Sequential(probe, torch.nn.Linear(8, 8))
        fully_shard(probe)
        fully_shard(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        for _ in range(2):
            model(torch.randn(2, 8)).sum().backward()
            opt.step()
            opt.zero_grad()
        (w1, v1, d1), (w2, v2, d2) = probe.seen
        assert w1 is w2 and v1 == v2 and not torch.equal(d1, d2)
    finally:
        dist.destroy_process_group()
