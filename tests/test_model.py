"""The model written once: trainer (packed/padded) == rollout paged path (prefill, chunked
prefill, decode, mixed batches, page sizes) == TP over a real gloo group; vs float64 HF."""
import pytest
import torch

from helpers import PagedCache, paged_step, per_expert, random_model, run_gloo, tiny_config
from true_on_policy.models import CausalLM, ConsistentForCausalLM, TensorParallel
from true_on_policy.models.qwen3 import fuse

ARCHS = ["qwen3", "qwen3_moe"]


def prompts(n=4, seed=0, lens=(37, 64, 5, 90)):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 500, (lens[i % len(lens)],), generator=g) for i in range(n)]


def trainer_logits(model, seqs):
    ids = torch.cat(seqs)
    pos = torch.cat([torch.arange(len(s)) for s in seqs])
    with torch.no_grad():
        return model.forward_packed(ids, pos).split([len(s) for s in seqs])


def rollout_logits(model, seqs, chunk, page_size, layers=False, writes=False):
    """Every sequence advances `chunk` tokens per engine step, all in one batch (layers, writes:
    paged_step's)."""
    cache, out = PagedCache(model.cfg, page_size, seed=page_size), [[] for _ in seqs]
    with torch.no_grad():
        for start in range(0, max(map(len, seqs)), chunk):
            live = [(i, s[start:start + chunk], start) for i, s in enumerate(seqs) if start < len(s)]
            logits = paged_step(model, cache, live, layers, writes).split([len(t) for _, t, _ in live])
            for (i, _, _), lg in zip(live, logits):
                out[i].append(lg)
    return [torch.cat(o) for o in out]


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("arch", ARCHS)
def test_rollout_paths_equal_trainer(arch, fused):
    model = random_model(tiny_config(arch))
    seqs = prompts()
    ref = trainer_logits(model, seqs)
    if fused:           # as the vLLM model class runs it
        fuse(model)
    for chunk, page_size in ((1000, 16), (13, 32), (1, 64), (64, 16)):
        got = rollout_logits(model, seqs, chunk, page_size)
        assert all(torch.equal(a, b) for a, b in zip(got, ref)), (chunk, page_size)


@pytest.mark.parametrize("arch", ARCHS)
def test_decode_steps_one_call_per_layer(arch, monkeypatch):
    """The rollout's CPU decode steps with each layer's paged cache given (vLLM's model class): one
    native call per layer (co.decode_layer), the trainer's bits; steps of more than one token per
    sequence and the trainer's modules run the ops. Companion: a layer whose call gets another
    post-attention eps than its ops use gives other logits (the call is what ran)."""
    from consistent_ops.reference import native
    model, seqs = random_model(tiny_config(arch)), prompts()
    ref, calls, real = trainer_logits(model, seqs), [], native.decode_layer
    monkeypatch.setattr(native, "decode_layer", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    rollout_logits(model, seqs, 1, 16, layers=True)
    assert not calls                                        # unfused modules: the ops
    fuse(model)
    for chunk in (1, 13):
        got = rollout_logits(model, seqs, chunk, 16, layers=True)
        assert all(torch.equal(a, b) for a, b in zip(got, ref)), chunk
    steps = [sum(len(s) > i for s in seqs) for i in range(max(map(len, seqs)))]
    assert calls == [n for n in steps for _ in model.model.layers]   # chunk 13: no step of one token each
    monkeypatch.setattr(native, "decode_layer", lambda x, r, w, *a: real(x, r, w._replace(post_eps=1e-2), *a))
    got = rollout_logits(model, seqs, 1, 16, layers=True)
    assert not all(torch.equal(a, b) for a, b in zip(got, ref))


def test_one_gemm_for_q_k_v_and_loads_land_in_it(monkeypatch):
    """The rollout's q/k/v as one GEMM over stacked weights (the path of backends without a fused
    prologue, e.g. Triton): the trainer's bits, also after weights are loaded in place into the
    fused model; a projection weight replaced (not loaded) takes the projections' own path."""
    import consistent_ops as co
    monkeypatch.setattr(co, "attention_prologue", lambda *args: None)
    cfg, seqs = tiny_config("qwen3_moe"), prompts()
    model, fresh = random_model(cfg), random_model(cfg, seed=1)
    fuse(model)
    attn = model.model.layers[0].self_attn
    assert attn.qkv_weight is not None and attn.k_proj.weight.data_ptr() > attn.q_proj.weight.data_ptr()
    model.load_weights(fresh.state_dict().items())
    ref = trainer_logits(fresh, seqs)
    linear, stacked = co.linear, []
    monkeypatch.setattr(co, "linear", lambda x, w, *a: stacked.append(w is attn.qkv_weight) or linear(x, w, *a))
    assert all(torch.equal(a, b) for a, b in zip(rollout_logits(model, seqs, 13, 16), ref)) and any(stacked)
    attn.v_proj.weight = torch.nn.Parameter(attn.v_proj.weight.detach() * 2)
    fresh.model.layers[0].self_attn.v_proj.weight.data.mul_(2)
    ref = trainer_logits(fresh, seqs)
    assert all(torch.equal(a, b) for a, b in zip(rollout_logits(model, seqs, 13, 16), ref))


def test_stacked_qkv_norms_rope_and_v_in_one_call(monkeypatch):
    """Where the backend has qk_norm_rope (Triton), the stacked path hands it q/k/v as views of the one
    GEMM output and takes its three tensors (here the ops themselves: the trainer's bits); a hooked
    norm runs its own forward instead."""
    import consistent_ops as co
    monkeypatch.setattr(co, "attention_prologue", lambda *args: None)
    calls = []

    def ops(q, k, v, q_norm, k_norm, eps, cos, sin):
        width = (q.shape[1] + 2 * k.shape[1]) * q.shape[2]       # rows of one [T, (Hq + 2 Hkv) * D] tensor
        calls.append(len({x.untyped_storage().data_ptr() for x in (q, k, v)}) == 1
                     and {x.stride(0) for x in (q, k, v)} == {width})
        return (*(co.apply_rope(co.rms_norm(x, w, eps), cos, sin) for x, w in ((q, q_norm), (k, k_norm))),
                v.contiguous())

    monkeypatch.setattr(co, "qk_norm_rope", ops)
    model, seqs = random_model(tiny_config("qwen3")), prompts()
    ref = trainer_logits(model, seqs)
    assert not calls                        # the trainer's modules: the separate ops
    fuse(model)
    assert all(torch.equal(a, b) for a, b in zip(rollout_logits(model, seqs, 13, 16), ref)) and all(calls)
    calls.clear()
    model.model.layers[0].self_attn.k_norm.register_forward_hook(lambda *_: None)
    rollout_logits(model, seqs[:1], 1000, 16)
    assert calls == [True] * (len(model.model.layers) - 1)


def test_the_prologue_stores_k_and_v_where_the_rollout_passes_its_cache(monkeypatch):
    """Where the backend's qk_norm_rope takes the rollout's cache (Triton), each fused layer hands it
    the layer's cache and slots, and attend gets k = v = None (vLLM's Attention then skips its cache
    update): the trainer's bits (here the ops and write_kv_cache themselves); a layer it cannot serve
    (None) runs the ops and the write. Companion: a prologue storing other values gives other logits."""
    import consistent_ops as co
    monkeypatch.setattr(co, "attention_prologue", lambda *args: None)
    stored, scale = [], [1]

    def ops(q, k, v, q_norm, k_norm, eps, cos, sin, cache=None):
        q, k = (co.apply_rope(co.rms_norm(x, w, eps), cos, sin) for x, w in ((q, q_norm), (k, k_norm)))
        if cache is None:
            return q, k, v.contiguous()
        if scale[0] is None:
            return None
        stored.append(True)
        co.write_kv_cache(k, v * scale[0], *cache)
        return q, None, None

    monkeypatch.setattr(co, "qk_norm_rope", ops)
    model, seqs = random_model(tiny_config("qwen3_moe")), prompts()
    ref = trainer_logits(model, seqs)
    fuse(model)
    for scale[0] in (1, None):
        got = rollout_logits(model, seqs, 13, 16, writes=True)
        assert all(torch.equal(a, b) for a, b in zip(got, ref))
        assert bool(stored) == (scale[0] == 1)          # None: the ops and the write ran
        stored.clear()
    scale[0] = 2
    assert not all(torch.equal(a, b) for a, b in zip(rollout_logits(model, seqs, 13, 16, writes=True), ref))


def test_fused_calls_leave_hooked_modules_to_their_forward():
    """check --localize hooks projections and norms: a hooked module runs its own forward."""
    model = random_model(tiny_config("qwen3"))
    fuse(model)
    layer, seen = model.model.layers[0], []
    layer.self_attn.q_proj.register_forward_hook(lambda *_: seen.append("q_proj"))
    layer.self_attn.o_proj.register_forward_pre_hook(lambda *_: seen.append("o_proj"))
    layer.mlp.up_proj.register_forward_hook(lambda *_: seen.append("up_proj"))
    rollout_logits(model, prompts(1), 1000, 16)
    assert seen == ["q_proj", "o_proj", "up_proj"]


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
    loaded = shard.load_weights(full.state_dict().items())     # stacked names: this rank's experts
    assert loaded == set(dict(shard.named_parameters(remove_duplicate=False)))
    out = rollout_logits(shard, seqs, 16, 32)
    other = CausalLM(full.cfg, TensorParallel(world, rank, dist.group.WORLD))
    assert other.load_weights(per_expert(full.state_dict().items())) == loaded   # checkpoint names
    assert all(torch.equal(x, y) for x, y in zip(other.state_dict().values(), shard.state_dict().values()))
    return out


@pytest.mark.parametrize("arch", ARCHS)
def test_tp2_ranks_equal_trainer_emulation(arch):
    seqs = prompts(3)
    emulated = trainer_logits(random_model(tiny_config(arch), tp_size=2), seqs)
    for rank_out in run_gloo(_rank_forward, 2, (arch, seqs)):
        assert all(torch.equal(a, b) for a, b in zip(rank_out, emulated))


def test_tp_heads_not_divisible_is_a_clear_error():
    with pytest.raises(ValueError, match="num_key_value_heads=2 is not divisible by tensor_parallel_size=4"):
        ConsistentForCausalLM(tiny_config("qwen3"), tp_size=4)


def test_experts_stacked_and_loaded_by_either_name(tmp_path):
    """Experts held as transformers 5 keeps them (mlp.experts.gate_up_proj [E, 2I, H], gate
    rows then up; mlp.experts.down_proj [E, H, I]): checkpoint names one expert at a time
    and the stacked names load the same bits, each load bumps the stack's version, a stack
    counts as loaded once every expert's part has arrived (over any number of calls), and
    gradients land in the stacks."""
    from safetensors.torch import save_file
    cfg = tiny_config("qwen3_moe")
    src, a, b = random_model(cfg, seed=1), random_model(cfg), random_model(cfg)
    params = dict(src.named_parameters())
    assert params["model.layers.0.mlp.experts.gate_up_proj"].shape == (8, 128, 128)
    assert params["model.layers.0.mlp.experts.down_proj"].shape == (8, 128, 64)
    stack = a.model.layers[1].mlp.experts.gate_up_proj
    version = stack._version
    assert a.load_weights(per_expert(src.state_dict().items())) == set(params)
    assert stack._version > version
    assert b.load_weights(src.state_dict().items()) == set(params)
    seqs = prompts()
    want = trainer_logits(src, seqs)
    for m in (a, b):
        assert all(torch.equal(x, y) for x, y in zip(m.state_dict().values(), src.state_dict().values()))
        assert all(torch.equal(x, y) for x, y in zip(trainer_logits(m, seqs), want))
    first, rest = [], []
    for name, t in per_expert(src.state_dict().items()):      # a layer's experts over two files
        (first if ".experts.7." not in name else rest).append((name, t))
    save_file(dict(first), str(tmp_path / "a.safetensors"))
    fresh = random_model(cfg)
    with pytest.raises(ValueError, match="lacks parameters.*experts.down_proj"):
        fresh.load_checkpoint(tmp_path)
    save_file(dict(rest), str(tmp_path / "b.safetensors"))
    assert all(torch.equal(x, y) for x, y in zip(fresh.load_checkpoint(tmp_path).state_dict().values(),
                                                 src.state_dict().values()))
    ids, pos = torch.cat(seqs), torch.cat([torch.arange(len(s)) for s in seqs])
    src.forward_packed(ids, pos).float().pow(2).mean().backward()
    assert src.model.layers[0].mlp.experts.gate_up_proj.grad.abs().amax(dim=(1, 2)).gt(0).all()
