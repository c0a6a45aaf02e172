"""Shared test utilities: tiny configs, deterministic weights, a paged KV cache, gloo groups."""
import os
import socket
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import consistent_ops as co
from true_on_policy.models import ConsistentForCausalLM, ModelConfig


def tiny_config(arch="qwen3_moe", dtype=torch.bfloat16, **over):
    base = dict(arch=arch, vocab_size=512, hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                head_dim=32, intermediate_size=256, dtype=dtype, tie_word_embeddings=(arch == "qwen3"))
    if arch == "qwen3_moe":
        base.update(num_experts=8, top_k=2, moe_intermediate_size=64, moe_layers=[0, 1])
    base.update(over)
    return ModelConfig(**base)


def random_model(cfg, seed=0, std=0.08, tp_size=1):
    """Deterministic weights; norm weights perturbed around 1 so they matter."""
    torch.manual_seed(seed)
    model = ConsistentForCausalLM(cfg, tp_size)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p, dtype=torch.float32))
            else:
                p.copy_(std * torch.randn_like(p, dtype=torch.float32))
    return model


def per_expert(state):
    """(name, tensor) pairs with each experts stack split into HF checkpoint names (as on
    disk, and as verl's FSDP weight sync sends them)."""
    for name, t in state:
        if name.endswith(".experts.gate_up_proj"):
            for e, (g, u) in enumerate(zip(*t.chunk(2, 1))):
                yield from ((name.replace("gate_up_proj", f"{e}.gate_proj.weight"), g),
                            (name.replace("gate_up_proj", f"{e}.up_proj.weight"), u))
        elif name.endswith(".experts.down_proj"):
            yield from ((name.replace("down_proj", f"{e}.down_proj.weight"), d) for e, d in enumerate(t))
        else:
            yield name, t


class PagedCache:
    """A paged KV cache per layer with shuffled page placement, as an inference engine has."""

    def __init__(self, cfg, page_size, num_pages=256, seed=0):
        shape = (num_pages, page_size, cfg.num_kv_heads, cfg.head_dim)
        # Stale garbage (NaN) in unused slots: attention must never read it.
        self.k = [torch.full(shape, float("nan"), dtype=cfg.dtype) for _ in range(cfg.num_layers)]
        self.v = [torch.full(shape, float("nan"), dtype=cfg.dtype) for _ in range(cfg.num_layers)]
        self.free = torch.randperm(num_pages, generator=torch.Generator().manual_seed(seed)).tolist()
        self.page_size, self.tables = page_size, {}

    def slots(self, seq_id, start, n):
        table = self.tables.setdefault(seq_id, [])
        while len(table) * self.page_size < start + n:
            table.append(self.free.pop())
        pos = torch.arange(start, start + n)
        return torch.tensor(table)[pos // self.page_size] * self.page_size + pos % self.page_size


def paged_step(model, cache, chunks, layers=False, writes=False):
    """Run one engine step. chunks: list of (seq_id, tokens [n], start_pos). Returns fp32
    logits for every new token, concatenated, through the rollout-style paged path; layers: the
    model also gets each layer's paged cache and metadata, writes: each layer's cache and slots (as
    vLLM's model class passes them on the CPU and on the GPU)."""
    ids = torch.cat([t for _, t, _ in chunks])
    pos = torch.cat([torch.arange(s, s + len(t)) for _, t, s in chunks])
    slots = torch.cat([cache.slots(sid, s, len(t)) for sid, t, s in chunks])
    qsl = torch.tensor([0] + [len(t) for _, t, _ in chunks]).cumsum(0)
    seq_lens = torch.tensor([s + len(t) for _, t, s in chunks])
    width = max(len(cache.tables[sid]) for sid, _, _ in chunks)
    table = torch.tensor([cache.tables[sid] + [0] * (width - len(cache.tables[sid])) for sid, _, _ in chunks])

    def attend(i, q, k, v):
        if k is not None:       # else the layer stored them (writes)
            co.write_kv_cache(k, v, cache.k[i], cache.v[i], slots)
        return co.attention_paged(q, cache.k[i], cache.v[i], table, seq_lens, qsl)

    paged = (lambda i: (cache.k[i], cache.v[i], slots, table, seq_lens, qsl)) if layers else None
    kv = (lambda i: (cache.k[i], cache.v[i], slots)) if writes else None
    return model.compute_logits(model.model(ids, pos, attend, paged=paged, cache=kv))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, port, fn, args, out_dir):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        torch.save(fn(rank, world, *args), os.path.join(out_dir, f"{rank}.pt"))
    finally:
        dist.destroy_process_group()


def run_gloo(fn, world=2, args=()):
    """Run fn(rank, world, *args) in `world` gloo processes; returns their results by rank."""
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_worker, args=(world, free_port(), fn, args, out_dir), nprocs=world, join=True)
        return [torch.load(os.path.join(out_dir, f"{r}.pt")) for r in range(world)]


def chi_square_p(observed, expected):
    """p-value of Pearson's chi-square (bins with expected < 5 merged into one)."""
    small = expected < 5
    if small.any():
        observed = torch.cat([observed[~small], observed[small].sum()[None]])
        expected = torch.cat([expected[~small], expected[small].sum()[None]])
    stat = ((observed - expected) ** 2 / expected).sum()
    df = len(observed) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat.double() / 2))
