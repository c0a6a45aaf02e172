"""GPU test/benchmark harness: a Qwen3-30B-A3B-shaped model builder (ours and stock HF)
and a minimal paged-KV rollout engine.

It does what vLLM does around the attention op, and nothing else: pages handed out in
a shuffled order, this step's K/V written to the cache BEFORE attention, block tables,
seq_lens that include this step's tokens, query_start_loc for mixed batches. Unwritten
cache slots hold NaN, so a kernel that reads past a sequence shows it.
"""
import torch

import consistent_ops as co

# Qwen3-30B-A3B shapes (layers cut to what a test needs)
QWEN3_30B_A3B = dict(vocab_size=151936, hidden_size=2048, num_heads=32, num_kv_heads=4, head_dim=128,
                     intermediate_size=6144, num_experts=128, top_k=8, moe_intermediate_size=768,
                     rms_norm_eps=1e-6, rope_theta=1e6)


def build_model(layers=4, seed=0, device="cuda"):
    """Our trainer/rollout model with random weights (std 0.02, norms near 1); experts
    stacked, as both engines keep them."""
    from true_on_policy.models import ConsistentForCausalLM, ModelConfig
    cfg = ModelConfig(arch="qwen3_moe", num_layers=layers, moe_layers=list(range(layers)), **QWEN3_30B_A3B)
    with torch.device(device):
        model = ConsistentForCausalLM(cfg)
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g, device=device))
            else:
                p.normal_(0, 0.02, generator=g)
    return model


def build_hf_model(layers=4, attn="sdpa", seed=0, device="cuda"):
    """Stock transformers Qwen3-MoE of the same shape (its own random weights)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    s = QWEN3_30B_A3B
    cfg = Qwen3MoeConfig(vocab_size=s["vocab_size"], hidden_size=s["hidden_size"],
                         intermediate_size=s["intermediate_size"], num_hidden_layers=layers,
                         num_attention_heads=s["num_heads"], num_key_value_heads=s["num_kv_heads"],
                         head_dim=s["head_dim"], num_experts=s["num_experts"], num_experts_per_tok=s["top_k"],
                         moe_intermediate_size=s["moe_intermediate_size"], norm_topk_prob=True,
                         max_position_embeddings=40960, attn_implementation=attn)
    torch.manual_seed(seed)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = Qwen3MoeForCausalLM(cfg)
    finally:
        torch.set_default_dtype(default)
    return model


class PagedKV:
    """One layer's (or several layers') paged cache with per-sequence block tables."""

    def __init__(self, layers, pages, page_size, kv_heads, head_dim, dtype, device, seed=0):
        shape = (pages, page_size, kv_heads, head_dim)
        self.k = [torch.full(shape, float("nan"), dtype=dtype, device=device) for _ in range(layers)]
        self.v = [torch.full(shape, float("nan"), dtype=dtype, device=device) for _ in range(layers)]
        self.page_size, self.device = page_size, device
        g = torch.Generator().manual_seed(seed)
        self.free = torch.randperm(pages, generator=g).tolist()   # physical order != logical
        self.tables, self.lens = {}, {}

    def plan(self, batch):
        """batch: [(seq_id, n_new)]. Allocates pages; returns (slots, positions, block_table,
        seq_lens, query_start_loc) for this step, all on the device."""
        slots, positions, qsl, seq_lens = [], [], [0], []
        for sid, n in batch:
            start = self.lens.get(sid, 0)
            table = self.tables.setdefault(sid, [])
            while len(table) * self.page_size < start + n:
                table.append(self.free.pop())
            pos = torch.arange(start, start + n)
            slots.append(torch.tensor(table)[pos // self.page_size] * self.page_size + pos % self.page_size)
            positions.append(pos)
            self.lens[sid] = start + n
            qsl.append(qsl[-1] + n)
            seq_lens.append(start + n)
        width = max(len(self.tables[sid]) for sid, _ in batch)
        bt = torch.zeros(len(batch), width, dtype=torch.int32)
        for i, (sid, _) in enumerate(batch):
            bt[i, : len(self.tables[sid])] = torch.tensor(self.tables[sid])
        to = dict(device=self.device)
        return (torch.cat(slots).to(**to), torch.cat(positions).to(**to), bt.to(**to),
                torch.tensor(seq_lens, dtype=torch.int32, **to), torch.tensor(qsl, dtype=torch.int32, **to))

    def attend(self, layer, q, k, v, step):
        slots, _, bt, seq_lens, qsl = step
        if k is not None:       # else the layer's prologue stored them (forward's writes)
            co.write_kv_cache(k, v, self.k[layer], self.v[layer], slots)
        return co.attention_paged(q, self.k[layer], self.v[layer], bt, seq_lens, qsl)

    def forward(self, model, ids, step, writes):
        """model.model's hidden states for this step; writes: each layer's cache and slots passed, so the
        attention prologue may store k and v (vLLM's model class passes them at decode steps; here at
        every step, prefill chunks and mixed batches too, which the prologue serves alike)."""
        cache = (lambda i: (self.k[i], self.v[i], step[0])) if writes else None
        return model.model(ids, step[1], lambda i, q, k, v: self.attend(i, q, k, v, step), cache=cache)


class ModelRunner:
    """Rollout side of a CausalLM: steps of mixed prefill chunks and decodes (writes: PagedKV.forward's)."""

    def __init__(self, model, pages=4096, page_size=16, seed=0, writes=True):
        cfg = model.cfg
        self.model, self.writes = model, writes
        self.kv = PagedKV(cfg.num_layers, pages, page_size, cfg.num_kv_heads, cfg.head_dim, cfg.dtype,
                          next(model.parameters()).device, seed)

    @torch.no_grad()
    def step(self, batch):
        """batch: [(seq_id, token_ids [n])]. Returns fp32 logits [sum n, V] in batch order."""
        step = self.kv.plan([(sid, len(t)) for sid, t in batch])
        ids = torch.cat([t for _, t in batch]).to(step[1].device)
        return self.model.compute_logits(self.kv.forward(self.model, ids, step, self.writes))


class GraphRunner:
    """What vLLM's runner does for FULL CUDA graphs: persistent input buffers, one graph per
    capture size (tokens; requests up to min(size, max_reqs), as vLLM's dispatcher sizes
    them), a real batch (decodes, prefill chunks or a mix) padded up to the smallest size
    that holds it (padding tokens: id 0, position 0, slot -1; padding requests: no tokens),
    replays across steps while block tables and sequence lengths change. The graph holds
    the whole forward and the LM head (over every token, or each request's last token with
    last_only, as vLLM samples); only the buffer fills run on the host."""

    def __init__(self, runner: ModelRunner, sizes=(1, 8, 64), max_pages=256, max_reqs=None, last_only=False):
        self.runner, self.kv, self.model = runner, runner.kv, runner.model
        self.pool, self.graphs, self.last_only = torch.cuda.graph_pool_handle(), {}, last_only
        dev, i32, i64 = self.kv.device, torch.int32, torch.long
        for b in sorted(sizes, reverse=True):      # largest first: smaller graphs reuse its pool
            r = min(b, max_reqs or b)
            bufs = dict(ids=torch.zeros(b, dtype=i64, device=dev), pos=torch.zeros(b, dtype=i64, device=dev),
                        slots=torch.full((b,), -1, dtype=i64, device=dev),
                        table=torch.zeros(r, max_pages, dtype=i32, device=dev),
                        qsl=torch.arange(r + 1, dtype=i32, device=dev), last=torch.zeros(r, dtype=i64, device=dev))
            bufs["qsl"][-1] = b                     # warm-up batch: the last request takes the rest
            bufs["seq_lens"] = (bufs["qsl"][1:] - bufs["qsl"][:-1]).to(i32)
            self.graphs[b] = (bufs, *self._capture(bufs))

    def _forward(self, bufs):
        step = (bufs["slots"], bufs["pos"], bufs["table"], bufs["seq_lens"], bufs["qsl"])
        hidden = self.kv.forward(self.model, bufs["ids"], step, self.runner.writes)
        return self.model.compute_logits(hidden[bufs["last"]] if self.last_only else hidden)

    @torch.no_grad()
    def _capture(self, bufs):
        """Warm up (compiles every kernel, slot -1 writes nothing) on a side stream, then capture."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self._forward(bufs)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = self._forward(bufs)
        return graph, out

    def step(self, batch):
        """batch: [(seq_id, token_ids [n])], any mix of decodes and prefill chunks. Returns fp32
        logits [sum n, V] in batch order (last_only: [len(batch), V], each request's last token)."""
        n, reqs = sum(len(t) for _, t in batch), len(batch)
        size = min(b for b, (bufs, _, _) in self.graphs.items() if b >= n and len(bufs["seq_lens"]) >= reqs)
        bufs, graph, out = self.graphs[size]
        slots, pos, table, seq_lens, qsl = self.kv.plan([(sid, len(t)) for sid, t in batch])
        bufs["ids"].zero_()[:n] = torch.cat([t for _, t in batch]).to(bufs["ids"].device)
        bufs["pos"].zero_()[:n] = pos
        bufs["slots"].fill_(-1)[:n] = slots
        bufs["table"].zero_()[:reqs, :table.shape[1]] = table
        bufs["seq_lens"].zero_()[:reqs] = seq_lens
        bufs["qsl"].fill_(n)[:reqs + 1] = qsl       # padding requests: no tokens
        bufs["last"].zero_()[:reqs] = qsl[1:] - 1
        graph.replay()
        return out[:reqs if self.last_only else n].clone()
