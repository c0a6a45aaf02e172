"""The model written once: trainer (packed/padded) == rollout paged path (prefill, chunked
prefill, decode, mixed batches, page sizes) == TP over a real gloo group; vs float64 HF."""
import pytest
import torch

from helpers import PagedCache, paged_step, random_model, run_gloo, tiny_config
from true_on_policy.models import CausalLM, ConsistentForCausalLM, TensorParallel

ARCHS = ["qwen3", "qwen3_moe"]


def prompts(n=4, seed=0, lens=(37, 64, 5, 90)):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 500, (lens[i % len(lens)],), generator=g) for i in range(n)]


def trainer_logits(model, seqs):
    ids = torch.cat(seqs)
    pos = torch.cat([torch.arange(len(s)) for s in seqs])
    with torch.no_grad():
        return model.forward_packed(ids, pos).split([len(s) for s in seqs])


def rollout_logits(model, seqs, chunk, page_size):
    """Every sequence advances `chunk` tokens per engine step, all in one batch."""
    cache, out = PagedCache(model.cfg, page_size, seed=page_size), [[] for _ in seqs]
    with torch.no_grad():
        for start in range(0, max(map(len, seqs)), chunk):
            live = [(i, s[start:start + chunk], start) for i, s in enumerate(seqs) if start < len(s)]
            logits = paged_step(model, cache, live).split([len(t) for _, t, _ in live])
            for (i, _, _), lg in zip(live, logits):
                out[i].append(lg)
    return [torch.cat(o) for o in out]


@pytest.mark.parametrize("arch", ARCHS)
def test_rollout_paths_equal_trainer(arch):
    model = random_model(tiny_config(arch))
    seqs = prompts()
    ref = trainer_logits(model, seqs)
    for chunk, page_size in ((1000, 16), (13, 32), (1, 64), (64, 16)):
        got = rollout_logits(model, seqs, chunk, page_size)
        assert all(torch.equal(a, b) for a, b in zip(got, ref)), (chunk, page_size)


@pytest.mark.parametrize("arch", ARCHS)
def test_alone_equals_batch_and_padded_equals_packed(arch):
    model = random_model(tiny_config(arch))
    seqs = prompts()
    ref = trainer_logits(model, seqs)
    assert torch.equal(trainer_logits(model, seqs[2:3])[0], ref[2])
    width = max(map(len, seqs))
    ids = torch.stack([torch.cat([torch.zeros(width - len(s), dtype=torch.long), s]) for s in seqs])
    mask = torch.stack([torch.arange(width) >= width - len(s) for s in seqs]).long()   # left padded
    with torch.no_grad():
        padded = model(ids, attention_mask=mask)
    assert all(torch.equal(padded[i][mask[i].bool()], ref[i]) for i in range(len(seqs)))


def test_thread_count_invariant():
    model = random_model(tiny_config("qwen3_moe"))
    old = torch.get_num_threads()
    try:
        outs = []
        for n in (1, 2):
            torch.set_num_threads(n)
            outs.append(trainer_logits(model, prompts()))
    finally:
        torch.set_num_threads(old)
    assert all(torch.equal(a, b) for a, b in zip(*outs))


def _rank_forward(rank, world, arch, seqs):
    import torch.distributed as dist
    full = random_model(tiny_config(arch))
    shard = CausalLM(full.cfg, TensorParallel(world, rank, dist.group.WORLD))
    loaded = shard.load_weights(full.state_dict().items())
    assert loaded == set(dict(shard.named_parameters(remove_duplicate=False)))
    return rollout_logits(shard, seqs, 16, 32)


@pytest.mark.parametrize("arch", ARCHS)
def test_tp2_ranks_equal_trainer_emulation(arch):
    seqs = prompts(3)
    emulated = trainer_logits(random_model(tiny_config(arch), tp_size=2), seqs)
    for rank_out in run_gloo(_rank_forward, 2, (arch, seqs)):
        assert all(torch.equal(a, b) for a, b in zip(rank_out, emulated))


def test_tp_heads_not_divisible_is_a_clear_error():
    with pytest.raises(ValueError, match="num_key_value_heads=2 is not divisible by tensor_parallel_size=4"):
        ConsistentForCausalLM(tiny_config("qwen3"), tp_size=4)


def test_stacked_experts_keep_names_bits_loading_and_gradients():
    """The rollout's stacked expert layout (CausalLM.stack_experts): the same parameter names,
    the same logits bit for bit, in-place loads land in the stacks, autograd still reaches
    every expert; the stacks are used only while the parameters are still their views."""
    cfg = tiny_config("qwen3_moe")
    plain, stacked = random_model(cfg), random_model(cfg).stack_experts()
    assert [n for n, _ in plain.named_parameters()] == [n for n, _ in stacked.named_parameters()]
    block = stacked.model.layers[0].mlp
    with torch.no_grad():
        assert block._experts(cfg.dtype) is block._stack
    assert isinstance(block._experts(cfg.dtype), dict)       # autograd: the per-expert views
    seqs = prompts()
    assert all(torch.equal(a, b) for a, b in zip(trainer_logits(plain, seqs), trainer_logits(stacked, seqs)))
    name = "model.layers.1.mlp.experts.5.down_proj.weight"
    new = torch.randn_like(dict(stacked.named_parameters())[name], dtype=torch.float32)
    for m in (plain, stacked):
        m.load_weights([(name, new)])
    assert torch.equal(stacked.model.layers[1].mlp._stack.down[5], new.to(cfg.dtype))
    assert all(torch.equal(a, b) for a, b in zip(trainer_logits(plain, seqs), trainer_logits(stacked, seqs)))
    ids = torch.cat(seqs)
    pos = torch.cat([torch.arange(len(s)) for s in seqs])
    stacked.forward_packed(ids, pos).float().pow(2).mean().backward()
    assert all(p.grad is not None for n, p in stacked.named_parameters() if ".experts." in n)
    with torch.no_grad():   # a replaced parameter (as FSDP or .to() would do): per-expert weights again
        block.experts["0"].gate_proj.weight = torch.nn.Parameter(block.experts["0"].gate_proj.weight.clone())
        assert isinstance(block._experts(cfg.dtype), dict)
