"""Triton backend vs the stock path on the device, all in one run (ratios need one run).

Medians of triton.testing.do_bench (linear and decode: do_bench_cudagraph, marked
"(graph)", so that device time, not host launch cost, is compared; attention: ours and stock in
interleaved rounds, the median over rounds). "x stock" = stock
time / our time (> 1: we are faster). Sections: attention fwd+bwd vs SDPA (flash and cuDNN backends, named), paged
decode vs the HBM roofline (copy bandwidth measured in this run), linear vs cuBLAS, the
rollout's log-softmax vs torch's, grouped MoE experts vs torch._grouped_mm, 4-layer actor fwd+bwd vs stock HF.

    PYTHONPATH=kernels:recipe:tests/gpu python benchmarks/bench_triton.py [--json FILE]
    ... --only probe      # tile probes: every GEMM / MoE tile entry, its time and its bits
    ... --only probe_decode_split --cases 4x32768,1x1024 --variants "default,one segment"
                          # the decode probes (probe_decode_split, probe_decode_ncu) narrowed
"""
import argparse
import datetime
import json
import statistics
import subprocess

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench, do_bench_cudagraph

import consistent_ops as co
from bench_vllm_gpu import _parse_cases
from consistent_ops.triton import moe as tmoe

DEV, BF16 = "cuda", torch.bfloat16
HQ, HKV, D = 32, 4, 128
COLD_BYTES = 256 << 20      # read between timed launches to evict K/V from L2 (50 MB on the H200)
ROWS, META = [], {}


def bench(fn, rep=300, grad_to_none=None):
    """Median milliseconds, host launch overhead included."""
    return do_bench(fn, warmup=50, rep=rep, grad_to_none=grad_to_none, return_mode="median")


def bench_graph(fn):
    """Median milliseconds of CUDA-graph replays: device time of small ops whose host
    launch cost would otherwise dominate (how a rollout engine runs decode)."""
    return do_bench_cudagraph(fn, rep=200, return_mode="median")


class Cold:
    """Milliseconds of a launch after a read of COLD_BYTES, less that read's own time: its operands
    out of L2, as in a model step, where ~6 GB of weights pass between two uses of a layer's (a read
    leaves no dirty lines to write back). Graph replays keep what they read in L2 (50 MB), which a
    layer's weights (17-21 MB a GEMM) and a short K/V fit."""

    def __init__(self):
        self.flush = torch.zeros(COLD_BYTES // 2, dtype=BF16, device=DEV)
        self.flush_ms = bench_graph(self.flush.amax)

    def __call__(self, fn):
        return bench_graph(lambda: (self.flush.amax(), fn())) - self.flush_ms


def rand(*shape, scale=1.0, dtype=BF16):
    return (torch.randn(*shape, device=DEV) * scale).to(dtype)


def record(section, case, ours_ms, stock=None, metric=None, goal=None):
    """stock: {name: ms}; metric: free text (TFLOP/s, % roofline)."""
    ROWS.append(dict(section=section, case=case, ours_ms=round(ours_ms, 4),
                     stock={k: round(v, 4) for k, v in (stock or {}).items()},
                     ratio={k: round(v / ours_ms, 3) for k, v in (stock or {}).items()},
                     metric=metric, goal=goal))
    r = ", ".join(f"{k} {v / ours_ms:.2f}x" for k, v in (stock or {}).items())
    print(f"{section:10s} {case:34s} ours {ours_ms:9.3f} ms  {r}  {metric or ''}", flush=True)


def ceilings():
    n = 1 << 30                                     # 2 GiB bf16 copy: read + write
    a = torch.empty(n, dtype=BF16, device=DEV).normal_()
    b = torch.empty_like(a)
    ms = bench(lambda: b.copy_(a))
    bw = 2 * a.numel() * 2 / ms / 1e9               # TB/s
    x, y = rand(8192, 8192), rand(8192, 8192)
    tf = 2 * 8192 ** 3 / bench(lambda: x @ y) / 1e9
    META.update(copy_tbs=round(bw, 3), gemm_tflops=round(tf, 1))
    print(f"ceilings: HBM copy {bw:.2f} TB/s (read + write), bf16 GEMM 8192^3 {tf:.0f} TFLOP/s", flush=True)
    return bw


def _interleaved(cases, rounds=3):
    """{name: (fn, grad_to_none)} -> {name: ms}: each case benched once a round, the cases in turn,
    the median over rounds (clock or thermal drift during the run then moves every case alike)."""
    runs = {name: [] for name in cases}
    for _ in range(rounds):
        for name, (fn, grads) in cases.items():
            runs[name].append(bench(fn, grad_to_none=grads))
    return {name: statistics.median(ms) for name, ms in runs.items()}


def attention_fwd_bwd():
    for s in (4096, 8192, 16384):
        batch = 16384 // s
        q, k, v = rand(batch * s, HQ, D), rand(batch * s, HKV, D), rand(batch * s, HKV, D)
        for t in (q, k, v):
            t.requires_grad_()
        cu = torch.arange(batch + 1, device=DEV, dtype=torch.int32) * s
        do = rand(batch * s, HQ, D)
        flops = 2 * batch * HQ * s * s * D * 3.5       # causal fwd (2 matmuls, half) x (1 + 2.5 bwd)
        cases = {"ours fwd": (lambda: co.attention_varlen(q, k, v, cu), None),
                 "ours": (lambda: co.attention_varlen(q, k, v, cu).backward(do), [q, k, v])}
        qs, ks, vs = (t.detach().view(batch, s, -1, D).transpose(1, 2).contiguous().requires_grad_()
                      for t in (q, k, v))
        dos = do.view(batch, s, HQ, D).transpose(1, 2).contiguous()
        # KV heads expanded to 32 only if a backend refuses enable_gqa (named "(kv x8)")
        kx, vx = (t.detach().repeat_interleave(HQ // HKV, 1).requires_grad_() for t in (ks, vs))
        for name, backend in (("sdpa-flash", SDPBackend.FLASH_ATTENTION), ("sdpa-cudnn", SDPBackend.CUDNN_ATTENTION)):
            for kk, vv, gqa, label in ((ks, vs, True, name), (kx, vx, False, name + " (kv x8)")):
                def run(bwd=True, kk=kk, vv=vv, gqa=gqa, backend=backend):
                    with sdpa_kernel(backend):
                        o = F.scaled_dot_product_attention(qs, kk, vv, is_causal=True, enable_gqa=gqa)
                        if bwd:
                            o.backward(dos)
                try:
                    run()                                   # backend refuses this shape: RuntimeError
                    cases[label + " fwd"] = (lambda run=run: run(False), None)
                    cases[label] = (run, [qs, kk, vv])
                    break
                except RuntimeError as e:
                    print(f"  {label}: {str(e).splitlines()[0][:100]}")
        ms = _interleaved(cases)
        stock = {n: t for n, t in ms.items() if not n.startswith("ours") and not n.endswith(" fwd")}
        stock_fwd = {n[:-4]: t for n, t in ms.items() if not n.startswith("ours") and n.endswith(" fwd")}
        record("attention", f"fwd      S={s} x{batch}", ms["ours fwd"], stock_fwd,
               f"{flops / 3.5 / ms['ours fwd'] / 1e9:.0f} TFLOP/s")
        record("attention", f"fwd+bwd  S={s} x{batch}", ms["ours"], stock, f"{flops / ms['ours'] / 1e9:.0f} TFLOP/s",
               ">= 1.0x flash, >= 0.8x cuDNN")


def paged_decode(bw_tbs):
    from consistent_ops.triton import attention as ta
    from harness import PagedKV
    for batch, ctx in ((64, 8192), (32, 16384), (128, 4096), (4, 32768), (1, 32768)):
        kv = PagedKV(1, batch * ctx // 16 + 8, 16, HKV, D, BF16, DEV)
        kv.k[0].normal_(), kv.v[0].normal_()
        _, _, bt, seq_lens, qsl = kv.plan([(i, ctx) for i in range(batch)])
        q = rand(batch, HQ, D)
        qsl = torch.arange(batch + 1, device=DEV, dtype=torch.int32)
        ms = bench_graph(lambda: co.attention_paged(q, kv.k[0], kv.v[0], bt, seq_lens, qsl))
        # the same without splitting by KV chunk (one program per tile walks every chunk)
        whole = bench_graph(lambda: ta._forward(q, kv.k[0], kv.v[0], qsl, seq_lens, bt, D ** -0.5, True, split=False))
        nbytes = 2 * batch * ctx * HKV * D * 2          # K and V read once
        roof = nbytes / (bw_tbs * 1e12) * 1e3
        record("decode", f"paged B={batch} ctx={ctx} page=16 (graph)", ms, metric=f"{100 * roof / ms:.0f}% of HBM roofline"
               f" ({nbytes / ms / 1e9:.2f} TB/s; unsplit {100 * roof / whole:.0f}%)", goal=">= 80%")
        del kv


def linear():
    """Graph replays (the weight stays in L2) and, at decode's M <= 256, cold (Cold: the weight out of
    L2, as in a model step, where the B=1 GEMMs averaged ~10 us a launch against ~7 replayed)."""
    cold = Cold()
    for name, (k, n) in (("qkv", (2048, 5120)), ("o_proj", (4096, 2048))):
        w = rand(n, k, scale=k ** -0.5)
        for m in (1, 4, 16, 64, 256, 1024, 4096):
            x = rand(m, k)
            ours = bench_graph(lambda: co.linear(x, w))
            stock = bench_graph(lambda: F.linear(x, w))
            record("linear", f"{name} M={m} K={k} N={n} (graph)", ours, {"cuBLAS": stock},
                   f"{2 * m * n * k / ours / 1e9:.0f} TFLOP/s", ">= 0.95x" if m >= 1024 else ">= 0.9x")
            if m <= 256:
                record("linear", f"{name} M={m} K={k} N={n} (cold)", cold(lambda: co.linear(x, w)),
                       {"cuBLAS": cold(lambda: F.linear(x, w))}, None, ">= 0.9x")


def logprobs():
    """The rollout's log-probs per step (outside vLLM's graphs there; timed as graph replays here):
    ours (the contract's log_softmax at per-row T) vs stock's log_softmax(logits / T), rows 1..512
    of the real vocabulary and tokenizer limit; each row count's bits against the 512-row call's rows;
    "1 stage": ours with the vocabulary walks' software pipeline off (the same bits)."""
    from consistent_ops.triton import logprobs as tlp
    v, vlim = 151936, 151669              # Qwen3's LM head and tokenizer (no multiple of 16)
    logits = rand(512, v, scale=3.0, dtype=torch.float32)
    temps = torch.full((512,), 0.7, device=DEV)
    full = co.log_softmax(logits, temps, vlim)
    for rows in (1, 8, 64, 512):
        z, t = logits[:rows], temps[:rows]
        same = torch.equal(co.log_softmax(z, t, vlim), full[:rows])
        ours = bench_graph(lambda: co.log_softmax(z, t, vlim))
        stock = bench_graph(lambda: torch.log_softmax(z / t[:, None], -1))
        stages, tlp._STAGES = tlp._STAGES, 1
        try:
            same = same and torch.equal(co.log_softmax(z, t, vlim), full[:rows])
            plain = bench_graph(lambda: co.log_softmax(z, t, vlim))
        finally:
            tlp._STAGES = stages
        record("logprobs", f"log_softmax rows={rows} V={v} (graph)", ours, {"torch": stock, "1 stage": plain},
               f"{rows * v * 4 * 2 / ours / 1e6:.0f} GB/s; rows == 512-row call: {'same' if same else 'DIFF'}",
               ">= 0.9x")


def moe():
    h, inter, e, topk = 2048, 768, 128, 8
    wg, wu = rand(e, inter, h, scale=h ** -0.5), rand(e, inter, h, scale=h ** -0.5)
    wd = rand(e, h, inter, scale=inter ** -0.5)
    w_gate_up = torch.cat([wg, wu], 1)                         # [E, 2I, H]: the model's (and HF's) stack
    experts = {i: (wg[i], wu[i], wd[i]) for i in range(e)}
    for t in (1024, 8192):
        x = rand(t, h)
        ids, w = co.moe_route(x, rand(e, h, scale=h ** -0.5), topk)

        def ours():
            contrib, _ = tmoe.grouped_expert_contributions(x, ids, w, w_gate_up, wd, range(e), every=True)
            return co.moe_combine(contrib, BF16)

        def stock():          # HF-style: sort by expert, grouped_mm, SiLU*up, grouped_mm, index_add
            flat = ids.reshape(-1)
            order = torch.argsort(flat, stable=True)
            offs = torch.bincount(flat, minlength=e).cumsum(0).to(torch.int32)
            tok = order // topk
            gu = torch._grouped_mm(x[tok], w_gate_up.transpose(1, 2), offs)
            y = torch._grouped_mm(F.silu(gu[:, :inter]) * gu[:, inter:], wd.transpose(1, 2), offs)
            y = y * w.reshape(-1)[order, None].to(y.dtype)
            return torch.zeros(t, h, dtype=BF16, device=DEV).index_add_(0, tok, y)

        flops = 2 * t * topk * 3 * h * inter
        ms = bench(ours)
        record("moe", f"experts T={t} E={e} top{topk}", ms, {"grouped_mm": bench(stock)},
               f"{flops / ms / 1e9:.0f} TFLOP/s", ">= 1.0x")
        def public_api():     # what the Megatron spec passes: stacked per call
            with torch.inference_mode():
                return co.moe_combine(co.moe_expert_contributions(x, ids, w, experts)[0], BF16)
        record("moe", f"  + public API (per-expert tensors, stacked per call) T={t}", bench(public_api),
               {"grouped_mm": bench(stock)})
        # forward + backward (what a training step pays): gradients for x, the routing weights
        # and both stacks, the same loss on both sides
        leaves = [x.requires_grad_(), w.requires_grad_(), w_gate_up.requires_grad_(), wd.requires_grad_()]
        dout = rand(t, h)
        fwd_bwd = {name: (lambda f=f: f().backward(dout)) for name, f in (("ours", ours), ("stock", stock))}
        record("moe", f"experts fwd+bwd T={t}", bench(fwd_bwd["ours"], grad_to_none=leaves),
               {"grouped_mm": bench(fwd_bwd["stock"], grad_to_none=leaves)}, goal=">= 1.0x / 1.1x")
        for leaf in leaves:
            leaf.requires_grad_(False)


def _actor_ms(model, step, ids, pos):
    """Median ms of one fwd+bwd step, and the step's peak memory above the weights (GB)."""
    params = list(model.parameters())
    ms = bench(lambda: step(model, ids, pos), rep=3000, grad_to_none=params)
    torch.cuda.synchronize()
    for p in params:
        p.grad = None
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step(model, ids, pos)
    torch.cuda.synchronize()
    return ms, (torch.cuda.max_memory_allocated() - base) / 1e9


def _ours_step(model, ids, pos):
    logits = model.forward_packed(ids, pos)
    (-co.token_logprobs(logits[:-1], ids[1:]).mean()).backward()


def _hf_step(hf, ids, pos):
    logits = hf(ids[None], position_ids=pos[None]).logits.float()[0]
    lp = torch.log_softmax(logits[:-1], -1).gather(1, ids[1:, None])
    (-lp.mean()).backward()


def actor_step():
    """4 layers as the kernel bench (vs HF eager and sdpa), and 8 layers with gradient
    checkpointing (what verl runs) vs HF sdpa, with each step's peak memory."""
    from harness import build_hf_model, build_model
    tokens = 4096
    ids = torch.randint(0, 151643, (tokens,), device=DEV)
    pos = torch.arange(tokens, device=DEV)
    for layers, recompute, attns in ((4, False, ("eager", "sdpa")), (8, True, ("sdpa",))):
        model = build_model(layers=layers)
        model.model.gradient_checkpointing = recompute
        ours_ms, ours_gb = _actor_ms(model, _ours_step, ids, pos)
        del model
        torch.cuda.empty_cache()
        stock, peaks = {}, {}
        for attn in attns:
            hf = build_hf_model(layers=layers, attn=attn)
            if recompute:
                hf.gradient_checkpointing_enable()
            stock[f"HF-{attn}"], peaks[attn] = _actor_ms(hf, _hf_step, ids, pos)
            del hf
            torch.cuda.empty_cache()
        memory = f"peak above weights: ours {ours_gb:.1f} GB, " + ", ".join(f"HF-{a} {g:.1f} GB" for a, g in peaks.items())
        record("actor", f"{layers}-layer fwd+bwd {tokens} tokens{' (grad ckpt)' if recompute else ''}", ours_ms,
               stock, memory, goal=">= 1.0x HF sdpa")


def actor_profile():
    """Where the 4-layer actor step's time goes (host vs device), for issue 11: the torch
    profiler's top ops by host time and by device time, and the launch count."""
    from torch.profiler import ProfilerActivity, profile

    from harness import build_model
    tokens = 4096
    ids = torch.randint(0, 151643, (tokens,), device=DEV)
    pos = torch.arange(tokens, device=DEV)
    model = build_model(layers=4)

    def step():
        logits = model.forward_packed(ids, pos)
        (-co.token_logprobs(logits[:-1], ids[1:]).mean()).backward()
        model.zero_grad(set_to_none=True)
    for _ in range(2):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
        step()
        torch.cuda.synchronize()
    events = prof.key_averages()
    launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx"))
    print(f"actor profile: {launches} kernel launches per step")
    print(events.table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=60))
    print(events.table(sort_by="self_device_time_total", row_limit=12, max_name_column_width=60))
    print(prof.key_averages(group_by_input_shape=True).table(sort_by="self_device_time_total", row_limit=16,
                                                             max_name_column_width=40, max_shapes_column_width=70))
    del model


# ---------------------------------------------------------------- tile probes (--only probe)
def _graph_ms(fn, n=20, reps=9):
    """Median ms per call of a CUDA graph of n calls (inputs as in do_bench_cudagraph)."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(n):
            fn()
    g.replay()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / n)
    return sorted(times)[len(times) // 2]


LINEAR_PROBE = {   # (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, warps, stages, TMA)
    "64x64x128 s4": (64, 64, 128, 1, 4, 4, False), "64x32x128 s4": (64, 32, 128, 1, 4, 4, False),
    "64x32x128 s4 T": (64, 32, 128, 1, 4, 4, True), "64x16x128 s6 T": (64, 16, 128, 1, 4, 6, True),
    "64x16x128 s6": (64, 16, 128, 1, 4, 6, False), "64x32x64 s8 T": (64, 32, 64, 1, 4, 8, True),
    "64x64x64 s6 T": (64, 64, 64, 1, 4, 6, True), "64x16x256 s4 T": (64, 16, 256, 1, 4, 4, True),
    "16x32x128 s4": (16, 32, 128, 1, 4, 4, False), "16x64x128 s4": (16, 64, 128, 1, 4, 4, False),
    "128x128x64 s4 T": (128, 128, 64, 8, 8, 4, True), "64x128x64 s4 T": (64, 128, 64, 8, 4, 4, True),
    "128x64x64 s4 T": (128, 64, 64, 8, 4, 4, True), "64x64x64 g8 s6 T": (64, 64, 64, 8, 4, 6, True),
    "64x128x128 s3 T": (64, 128, 128, 8, 4, 3, True), "128x256x64 s3 T": (128, 256, 64, 8, 8, 3, True),
    "128x256x64 s4 T": (128, 256, 64, 8, 8, 4, True), "256x128x64 s3 T": (256, 128, 64, 8, 8, 3, True),
    "128x128x64 w4 s4 T": (128, 128, 64, 8, 4, 4, True), "128x128x128 s3 T": (128, 128, 128, 8, 8, 3, True),
    "128x128x64 s5 T": (128, 128, 64, 8, 8, 5, True), "64x256x64 s4 T": (64, 256, 64, 8, 8, 4, True),
}


def probe_linear():
    """Every tile entry at every M, per layer shape: ratio cuBLAS / ours (graph replays) and whether
    its rows equal the 128x128x64 rows of the largest M bit for bit. lm_head: the rollout's logits
    GEMM at decode batch sizes (vLLM computes one row a sequence; an 8-layer model spends ~40 % of
    a 512-sequence step's FLOPs there)."""
    from consistent_ops.triton import gemm
    dense = (16, 64, 128, 256, 512, 1024, 4096)
    for name, (k, n), ms_list in (("qkv", (2048, 5120), dense), ("o_proj", (4096, 2048), dense),
                                  ("lm_head", (2048, 151936), (64, 128, 256, 512, 1024))):
        w, x = rand(n, k, scale=k ** -0.5), rand(ms_list[-1], k)
        full = gemm.matmul(x, w, cfg=(128, 128, 64, 8, 8, 4, True))
        stock = {m: _graph_ms(lambda m=m: F.linear(x[:m], w)) for m in ms_list}
        print(f"probe linear {name}: cuBLAS us " + " ".join(f"M{m}={stock[m] * 1e3:.1f}" for m in ms_list)
              + "; in use " + " ".join(f"M{m}={gemm._config(m, n)}" for m in ms_list))
        for cname, cfg in LINEAR_PROBE.items():
            try:
                same = all(torch.equal(gemm.matmul(x[:m], w, cfg=cfg), full[:m]) for m in (1, 7) + ms_list)
                r = {m: stock[m] / _graph_ms(lambda m=m: gemm.matmul(x[:m], w, cfg=cfg)) for m in ms_list}
                print(f"  {name:7s} {cname:20s} bits {'same' if same else 'DIFF'}  "
                      + " ".join(f"{r[m]:.2f}" for m in ms_list), flush=True)
            except Exception as e:
                print(f"  {name:7s} {cname:20s} failed: {type(e).__name__}: {str(e)[:80]}", flush=True)


DECODE_SHAPES = (("qkv", (2048, 5120)), ("o_proj", (4096, 2048)), ("router", (2048, 128)),
                 ("lm_head", (2048, 151936)))


def probe_linear_decode(ms=(1, 16), tiles=None, shapes=DECODE_SHAPES):
    """The decode tail's GEMMs (M 1..16; B=1 spends 44 % of a 48-layer step in them): tiles with
    more, shorter programs (no split-K: the contract's one accumulator) against cuBLAS and the
    tile in use, per layer shape; bits against the tile in use's rows. K steps of 512: a program's K
    walk is a chain (o_proj M 1: 16 steps of 256 in 9.9 us against cuBLAS's 7.6, H100 2026-12-05), and
    the MMA's k16 steps keep their order at any BLOCK_K (the same bits). Each time warm (graph replays:
    the weights stay in L2) / cold (Cold: as in the step, where the B=1 GEMMs averaged 9.97 us a launch
    against ~7 warm, H100 2026-12-06); tiles ranked cold. 18 tiles at M 1 and 16: with 54 at M 1, 4 and
    16 the probe reached only qkv at M 1 in 340 s (H100, 2026-12-06; its cold top 4 all bulk copies
    (TMA), 32-64 columns a program), so those alone now. ms, tiles, shapes: others (probe_linear_mid)."""
    from consistent_ops.triton import gemm
    cold = Cold()
    tiles = tiles or [(16, bn, bk, 1, w, st, True) for bn in (32, 64) for bk in (128, 256, 512)
                      for w, st in ((4, 4), (4, 6), (2, 4))]
    for name, (k, n) in shapes:
        w, x = rand(n, k, scale=k ** -0.5), rand(max(ms), k)
        for m in ms:
            base = gemm.matmul(x[:m], w)

            def times(fn):
                return f"{_graph_ms(fn) * 1e3:.1f} / {cold(fn) * 1e3:.1f} us"
            stock, ours = times(lambda: F.linear(x[:m], w)), times(lambda: gemm.matmul(x[:m], w))
            best = []
            for cfg in tiles:
                try:
                    same = torch.equal(gemm.matmul(x[:m], w, cfg=cfg), base)
                    run = lambda cfg=cfg: gemm.matmul(x[:m], w, cfg=cfg)  # noqa: E731
                    best.append((cold(run), _graph_ms(run), cfg, same))
                except Exception as e:
                    print(f"  {name} M={m} {cfg}: failed {type(e).__name__}: {str(e)[:60]}", flush=True)
            best.sort()
            print(f"probe linear decode {name} M={m} (warm / cold): cuBLAS {stock}, in use {gemm._config(m, n)} "
                  f"{ours}; fastest cold: " + "; ".join(f"{c} {t * 1e3:.1f} / {tc * 1e3:.1f} us bits "
                                                        f"{'same' if sm else 'DIFF'}" for tc, t, c, sm in best[:4]),
                  flush=True)


SPLIT_WIDE = (16, 64, 256, 1, 4, 4, True)     # probe_linear_split's other tile at M <= 16


def probe_linear_split(ms=(1, 4, 16, 64), large=(1024, 4096), shapes=DECODE_SHAPES[:3], chunks=(512, 1024)):
    """A fixed split of K: NOT the contract (one accumulator), a candidate change of it (matmul's
    chunk=). K in chunks of C, each from zero, added in chunk order: in one program (what a trainer's
    and a prefill's GEMMs would run: its cost at M 1024 / 4096, warm) or one program a chunk, the
    tile's last arrival adding them (the decode tail: more programs stream the weights; o_proj's N 2048
    gives 128 at M 1, each walking K 4096 alone: 11.7 us cold against a 5.6 us HBM line, cuBLAS 11.0,
    H100 2026-12-07). Each warm / cold against cuBLAS and the contract's tile; the split's bits against
    the one-program chunks (the same by construction: interpreter-tested)."""
    from consistent_ops.triton import gemm
    cold = Cold()

    def us(fn):
        return f"{_graph_ms(fn) * 1e3:.1f} / {cold(fn) * 1e3:.1f}"
    for name, (k, n) in shapes:
        w, x = rand(n, k, scale=k ** -0.5), rand(max(large), k)
        for m in ms:
            xs = x[:m]
            row = [f"cuBLAS {us(lambda: F.linear(xs, w))}", f"contract {us(lambda: gemm.matmul(xs, w))}"]
            for c in chunks:
                split = (c, -(-k // c))
                try:
                    one = gemm.matmul(xs, w, chunk=(c, 1))
                    row.append(f"C{c} one program {us(lambda: gemm.matmul(xs, w, chunk=(c, 1)))}")
                    # over split x programs: the tile in use, and at M <= 16 64 columns a tile (4x fewer tiles)
                    for cfg in (None, SPLIT_WIDE)[:1 + (m <= 16)]:
                        same = torch.equal(gemm.matmul(xs, w, cfg=cfg, chunk=split), one)
                        row.append(f"split x{split[1]}{' ' + str(cfg[:3]) if cfg else ''} "
                                   f"{us(lambda: gemm.matmul(xs, w, cfg=cfg, chunk=split))} "
                                   f"bits {'same' if same else 'DIFF'}")
                except Exception as e:
                    row.append(f"C{c} failed {type(e).__name__}: {str(e)[:60]}")
            print(f"probe linear split {name} M={m} (us warm / cold): " + "; ".join(row), flush=True)
        for m in large:
            xs = x[:m]
            row = [f"cuBLAS {_graph_ms(lambda: F.linear(xs, w)) * 1e3:.1f}",
                   f"contract {_graph_ms(lambda: gemm.matmul(xs, w)) * 1e3:.1f}"]
            row += [f"C{c} {_graph_ms(lambda c=c: gemm.matmul(xs, w, chunk=(c, 1))) * 1e3:.1f}" for c in chunks]
            print(f"probe linear split {name} M={m} (us warm, chunks in one program): " + "; ".join(row), flush=True)


def probe_linear_mid():
    """Decode batches of 64 and 256 sequences (M 64 / 256), cold as in a step, where the tiles in use
    trail cuBLAS at M=256 (H100 2026-12-06, `linear`: qkv 0.79x, o_proj 0.64x; they were picked from
    warm replays): the 64-row tiles of every width (more programs: 128-256 at o_proj's N 2048) and
    the 128-row ones, against the tile in use; and deeper pipelines of the 128-row tiles (cold, a
    tile's weight reads wait on HBM: H100 2026-12-07, qkv M=256 in use 12.6 us warm, 16.7 cold, cuBLAS
    12.0 / 13.8), and shallow ones that let several programs share an SM (H100 2026-12-07: none among
    the fastest four). Warp-specialized tiles (Triton 3.6) were slower or hung (RESULTS.md session 38)."""
    tiles = [(64, bn, bk, 1, 4, st, True) for bn, bk, st in ((16, 128, 6), (32, 128, 4), (64, 64, 6),
                                                             (64, 128, 4), (128, 128, 3), (128, 64, 4))]
    tiles += [(128, 64, 64, 8, 4, 4, True), (128, 128, 64, 8, 8, 4, True), (64, 128, 128, 8, 4, 3, True)]
    tiles += [(128, 64, 64, 8, 4, 6, True), (128, 64, 128, 8, 4, 3, True), (128, 64, 128, 8, 4, 4, True),
              (128, 128, 64, 8, 8, 6, True), (256, 64, 64, 8, 8, 4, True)]
    # several programs an SM (shallow pipelines, 40-64 KB of shared memory): qkv's 320 programs of
    # 64 x 64 three an SM at most, o_proj's 256 / 512 of 64 x 32 / 64 x 16 two / four
    tiles += [(64, 64, 64, 1, 4, 3, True), (64, 64, 64, 1, 4, 4, True), (64, 32, 64, 1, 4, 4, True),
              (64, 16, 64, 1, 4, 4, True)]
    # around the cold winners of H100 2026-12-07 (qkv M=256 128 x 128 x 64 at 6 stages, now `mid_square`;
    # o_proj M=256 `mid_narrow`): K steps of 128, one warp group, and o_proj's tile 6 stages deep
    tiles += [(128, 128, 128, 8, 8, 3, True), (128, 128, 64, 8, 4, 6, True), (64, 64, 128, 1, 4, 6, True)]
    probe_linear_decode((64, 256), tiles, DECODE_SHAPES[:2])


def _probe_variants(label, runs, variants, rounds=5):
    """runs: {case: fn(**variant) -> tensors}; variants: keyword dicts, the first the default.
    Each (case, variant) is timed once a round, in turn (medians over rounds: drift moves all
    alike); its outputs against the default's (bit for bit, else their relative difference) and
    against a second run of its own (deterministic)."""
    for case, run in runs.items():
        base = run(**variants[0])
        cases, same = {}, {}
        for i, kw in enumerate(variants):
            try:
                out = run(**kw)
                diff = max(((a.double() - b.double()).norm() / b.double().norm()).item() for a, b in zip(out, base))
                same[i] = (diff, all(torch.equal(a, b) for a, b in zip(out, run(**kw))))
                cases[i] = (lambda kw=kw: run(**kw), None)
            except Exception as e:
                print(f"  {label} {case} {kw}: failed {type(e).__name__}: {str(e)[:80]}", flush=True)
        ms = _interleaved(cases, rounds)
        for i, t in ms.items():
            print(f"  {label} {case} {variants[i] or 'default'}: {t:.3f} ms ({ms[0] / t:.3f}x the default), "
                  f"{'bits ==' if same[i][0] == 0 else f'rel. diff {same[i][0]:.1e} from'} the default, two runs "
                  f"{'identical' if same[i][1] else 'DIFFER'}",
                  flush=True)


def probe_attention():
    """Forward variants (keyword arguments of _forward: tile (rows, warps, stages), tma (bulk
    copies of packed K/V)) at S=16k x1, 8k x2 and 4k x4 (varlen) and a 2k chunk at context 8k
    and 30k (paged: pointer loads always); 128-row tiles (the same bits since the integer row sum, so a
    training tile of its own would be a speed choice: H100 2026-12-06, no faster with TMA); KV chunks
    of 256 keys (a contract change, other bits); the unsplit paged walk's page ids read in a block's
    own iteration, not carried a block ahead (`carry=False`: its chunks over a cache of 8k and 30k,
    what a multi-turn prefill attends; H100 2026-12-07: 0.825 / 2.918 ms against 0.828 / 2.869)."""
    from consistent_ops.triton import attention as ta
    from harness import PagedKV
    chunk, scale, runs = 2048, D ** -0.5, {}
    qc = rand(chunk, HQ, D)
    for ctx in (8192, 30720):
        kv = PagedKV(1, (ctx + chunk) // 16 + 8, 16, HKV, D, BF16, DEV)
        kv.k[0].normal_(), kv.v[0].normal_()
        kv.plan([(0, ctx)])
        _, _, bt, seq_lens, qsl = kv.plan([(0, chunk)])
        runs[f"paged 2k@{ctx // 1024}k"] = (lambda kv=kv, bt=bt, seq_lens=seq_lens, qsl=qsl, **kw:
                                             (ta._forward(qc, kv.k[0], kv.v[0], qsl, seq_lens, bt, scale, True, **kw),))
    for s, batch in ((16384, 1), (8192, 2), (4096, 4)):
        q, k, v, _, cu, _, lse, _ = _attention_case(s, batch)
        runs[f"varlen {s // 1024}k x{batch}"] = (
            lambda q=q, k=k, v=v, cu=cu, lse=lse, **kw:
            (ta._forward(q, k, v, cu, None, None, scale, False, lse=lse, **kw), lse.clone()))
    _probe_variants("attention fwd", runs, (dict(), dict(tma=False), dict(tile=(64, 4, 2)), dict(tile=(128, 8, 3)),
                                            dict(tile=(128, 8, 4)), dict(chunk=256), dict(carry=False)))


DECODE_VARIANTS = {"default": {}, "one segment": dict(fold_segment=0), "segments 8": dict(fold_segment=8),
                   "segments 32": dict(fold_segment=32), "full fold": dict(fold_half=False),
                   "stages 4": dict(tile=(16, 4, 4)), "chunk 256": dict(chunk=256), "no carry": dict(carry=False)}
DECODE_CASES = ((1, 1024), (1, 8192), (1, 32768), (2, 32768), (4, 8192), (4, 32768), (16, 32768), (64, 8192))


def probe_decode_split(cases=DECODE_CASES, only=None, width=None):
    """The decode tail's paged launch alone: graph-replayed us per call at B 1 / 2 / 4 and context 1k /
    8k / 32k with vLLM's table width (40,960 tokens: 80 KV chunks of programs, most returning at once),
    and at B=16 x 32k and B=64 x 8k, for the variants below; bits against the default launch. only:
    these variants alone; width: the table's, for every case."""
    # Settled on the H100 (2026-12-04 to 06, RESULTS.md sessions 25-30) and dropped from the list:
    # stages 2 / 5 (timed before the held page ids), fold stages 2 / 6 / 8, a fold of 2 or 4 chunks an
    # iteration, int64 offsets, the forward's 64 rows, unsplit, chunks of 128 keys, the table's width,
    # 8 warps on the half fold (45.7 against 41.8 us at B=1 x 32k, 2026-12-06); and, slower on the H100
    # and the H200 alike (sessions 30-34), the decode tile before 2026-12-06 (one warp: 20.8 vs 14.3
    # us at B=1 x 1k), 8 warps on 16 rows, the page ids read in the walk's loop.
    # Kept: chunks of 256 keys (a contract change, other bits: more programs against a longer fold);
    # the fold over the whole decode tile ("full fold"; the default folds a decode step's real half of
    # rows: B=1 x 32k 51.3 -> 41.8 us); the fold in one segment, or in segments of 8 or 32 chunks
    # (the default: 16 where a launch's chunk programs span waves, _FOLD_SEGMENT); 4 stages on the 4-warp tile
    # ("stages 4": two key blocks in flight a program, 104 KB of shared memory against 70, so 2
    # programs an SM, not 3; over the half fold, H100 2026-12-06: B=1 x 1k / 8k / 32k 13.0 / 18.5 /
    # 41.3 us against 12.6 / 18.0 / 41.9, B=4 x 8k 34.7 / 36.2, 4 x 32k 119.3 / 116.2: mixed, kept
    # for the H200).
    # (A register cap, maxnreg 168 / 128: within +-3 %, H200 2026-12-06, slower at B=1 x 1k; dropped. The
    # split launch holds 128 / 121 registers (Triton 3.6 / 3.9, 138 on 3.9 before the lanes; sm_90
    # compile with vLLM's strides divisible by 16) and 70 KB of shared memory: 3 programs an SM, which
    # shared memory caps, so no register cap adds one; tests/test_triton_layouts.py.)
    # Dropped 2026-12-07 (H100, B=4 x 32k / 16 x 32k / 4 x 8k us, against the default's 106.1 / 378.1 /
    # 36.0): a tile's sequence offsets and length read again at its index once the lanes found it
    # ("seq reads", 109.3 / 387.2 / 37.1); a split program walking 2 or 4 KV chunks in one loop, as
    # FlashAttention-3's split heuristic sizes them ("programs of 2 / 4", 106.6 / 387.0 / 36.7 and
    # 111.7 / 395.2 / 51.6; slower still at B=1: 23.5 / 26.9 against 12.9 at 1k).
    # "no carry": the unsplit launch's page ids read in a block's own iteration, not a block ahead
    # (_CARRY_PAGES; B=64 x 8k here, the split cases unchanged; H100 2026-12-07: 368.2 against 363.3 us).
    # "cold": the same launch after a read of COLD_BYTES (K/V out of L2, as in a model step), less
    # that read's own time.
    variants = {k: v for k, v in DECODE_VARIANTS.items() if only is None or k in only}
    cold, cold_variants = Cold(), ("default", "one segment", "stages 4")
    for batch, ctx in cases:
        run, cols = _decode_launch(batch, ctx, width)
        base = run()
        cells = []
        for name, kw in variants.items():
            try:
                same = torch.equal(run(**kw), base)
                cells.append(f"{name} {bench_graph(lambda kw=kw: run(**kw)) * 1e3:.1f} us"
                             + ("" if same else " DIFF"))
                if name in cold_variants:
                    cells.append(f"{name} cold {cold(lambda kw=kw: run(**kw)) * 1e3:.1f} us")
            except Exception as e:
                cells.append(f"{name} failed {type(e).__name__}")
        print(f"probe decode split page={DECODE_PAGE} B={batch} ctx={ctx} table {cols}: " + "; ".join(cells),
              flush=True)


DECODE_PAGE = 16     # page 32 gave the same times (2026-12-04)


def _decode_launch(batch, ctx, width=None):
    """(run, table width): run(**variant) is the decode tail's paged launch (_forward) of one token in
    each of B sequences of ctx keys, at vLLM's table width (40,960 tokens) up to B=4, else ctx."""
    from consistent_ops.triton import attention as ta
    from harness import PagedKV
    cols = width or (40960 if batch <= 4 else ctx)
    kv = PagedKV(1, batch * cols // DECODE_PAGE + 8, DECODE_PAGE, HKV, D, BF16, DEV)
    kv.k[0].normal_(), kv.v[0].normal_()
    _, _, bt, seq_lens, _ = kv.plan([(i, ctx) for i in range(batch)])
    table = torch.zeros(batch, cols // DECODE_PAGE, dtype=torch.int32, device=DEV)
    table[:, :bt.shape[1]] = bt
    q = rand(batch, HQ, D)
    qsl = torch.arange(batch + 1, device=DEV, dtype=torch.int32)
    return (lambda **kw: ta._forward(q, kv.k[0], kv.v[0], qsl, seq_lens, table, D ** -0.5, True, **kw)), cols


def probe_decode_ncu(cases=((4, 32768), (64, 8192), (1, 1024)), only=("default", "one segment")):
    """One launch of each case and variant (only: DECODE_VARIANTS named) inside the NVTX range "ncu"
    (a range in it names the case; its warm-up launch outside), for Nsight Compute to read where the
    walk's time goes (why B=4 x 32k streams at ~3.3 TB/s where B=64 x 8k reaches 4.0 with the same
    chunk programs):
      ncu --clock-control none --nvtx --nvtx-include "ncu/" --section SpeedOfLight --section Occupancy
          --section WarpStateStats --section MemoryWorkloadAnalysis python3 benchmarks/bench_triton.py
          --only probe_decode_ncu"""
    for batch, ctx in cases:
        run, _ = _decode_launch(batch, ctx)
        for name in only:
            kw = DECODE_VARIANTS[name]
            run(**kw)
            torch.cuda.synchronize()
            torch.cuda.nvtx.range_push("ncu")
            torch.cuda.nvtx.range_push(f"B={batch} ctx={ctx} {name}")
            run(**kw)
            torch.cuda.synchronize()
            torch.cuda.nvtx.range_pop()
            torch.cuda.nvtx.range_pop()
            print(f"probe decode ncu: B={batch} ctx={ctx} {name}", flush=True)


def probe_fold_length():
    """What one step of the split launch's serial fold costs: 32k keys of KV in B sequences of 32k / B
    (B = 1 .. 32), so the same 256 chunk programs read the same bytes in the same grid (vLLM's table
    width), and each tile's last program folds 64 / B chunk states: the time's slope against the
    fold's length is a step's cost (H100, 2026-12-06: 51.4 / 43.7 / 39.5 / 37.9 / 36.2 / 36.7 us at
    64 / 32 / 16 / 8 / 4 / 2 steps: ~0.24 us a step, over the whole tile: "full fold"); the default
    folds a decode tile's real half of rows (41.9 / 38.8 / 36.1 / 35.7 / 35.0 / 36.5 us: ~0.1 us)."""
    probe_decode_split(tuple((b, 32768 // b) for b in (1, 2, 4, 8, 16, 32)),
                       only=("default", "one segment", "full fold"), width=40960)


BWD_SHAPES = ((4096, 4), (8192, 2), (16384, 1), (4096, 1))   # S x seqs; 4k x1: the actor's one sequence


def _attention_case(s, batch):
    """Random packed q, k, v, dO of `batch` sequences of s tokens, and the forward's o and lse."""
    from consistent_ops.triton import attention as ta
    q, k, v, do = rand(batch * s, HQ, D), rand(batch * s, HKV, D), rand(batch * s, HKV, D), rand(batch * s, HQ, D)
    cu = torch.arange(batch + 1, device=DEV, dtype=torch.int32) * s
    scale = D ** -0.5
    lse = torch.empty(q.shape[:2], dtype=torch.float32, device=DEV)
    return q, k, v, do, cu, scale, lse, ta._forward(q, k, v, cu, None, None, scale, False, lse=lse)


def probe_attention_bwd():
    """Backward variants (keyword arguments of _backward: tiles (dQ (warps, stages), (dK/dV rows,
    keys, warps), stages), tma (bulk copies of dS, q/dO), qchunk (least tokens, most chunks)):
    bwd ms, gradients against the default's (other chunks add the partials otherwise)."""
    from consistent_ops.triton import attention as ta
    runs = {}
    for s, batch in BWD_SHAPES:
        q, k, v, do, cu, scale, lse, o = _attention_case(s, batch)
        runs[f"S={s} x{batch}"] = lambda q=q, k=k, v=v, o=o, lse=lse, do=do, cu=cu, scale=scale, **kw: \
            ta._backward(q, k, v, o, lse, do, cu, scale, **kw)
    _probe_variants("attention bwd", runs, (dict(), dict(qchunk=(1024, 8)), dict(qchunk=(256, 32)),
                                            dict(tiles=((4, 2), (64, 64, 4), 2)), dict(tiles=((8, 3), (64, 64, 4), 2))))


def _kernel_stats(fn):
    """Registers, spills and shared memory of every compiled variant of a Triton kernel."""
    try:
        return "; ".join(f"regs {k.n_regs} spills {k.n_spills} smem {k.metadata.shared}"
                         for cache in fn.device_caches.values() for k in cache[0].values())
    except Exception as e:          # the cache layout moves between Triton versions
        return f"stats unavailable ({type(e).__name__})"


def probe_attention_kernels():
    """Where the attention's time goes: device ms of each kernel a call (profiler) at S=4k x4, 16k x1
    and 4k x1 (the actor's one sequence), and each kernel's registers, spills, shared memory."""
    from torch.profiler import ProfilerActivity, profile

    from consistent_ops.triton import attention as ta
    for s, batch in BWD_SHAPES:
        q, k, v, do, cu, scale, lse, o = _attention_case(s, batch)
        ta._backward(q, k, v, o, lse, do, cu, scale)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                ta._forward(q, k, v, cu, None, None, scale, False, lse=lse)
                ta._backward(q, k, v, o, lse, do, cu, scale)
            torch.cuda.synchronize()
        mm = 2 * batch * HQ * s * s / 2 * D / 1e9      # one causal matmul's GFLOP
        for e in prof.key_averages():
            if e.device_time_total > 0:
                ms = e.device_time_total / 5 / 1e3          # a call's total over its launches
                n = 2 if "fwd" in e.key else 1 if "dq_" in e.key else 4 if "dkdv" in e.key else 0
                print(f"  attention S={s} x{batch} {e.key[:40]:40s} {ms:.3f} ms in {e.count // 5} launches"
                      + (f" {n * mm / ms:.0f} TFLOP/s ({n} matmuls)" if n else ""), flush=True)
    for fn in (ta._attn_fwd_kernel, ta._bwd_delta_kernel, ta._bwd_dkdv_kernel, ta._bwd_dq_kernel,
               ta._sum_parts_kernel):
        print(f"  {fn.__name__}: {_kernel_stats(fn)}", flush=True)


def probe_host():
    """Host microseconds per launch (no sync: the device is faster than the host here) of the
    linear with TMA descriptors vs pointer loads of the same tile, at a 2k-token chunk's shapes."""
    import time

    from consistent_ops.triton import gemm
    x = rand(2048, 2048)
    for name, n in (("qkv", 5120), ("o_proj", 2048)):
        w = rand(n, 2048, scale=2048 ** -0.5)
        for cfg in ((128, 128, 64, 8, 4, 4, True), (128, 128, 64, 8, 4, 4, False),
                    (256, 128, 64, 8, 8, 3, True), (256, 128, 64, 8, 8, 3, False)):
            for _ in range(3):
                gemm.matmul(x, w, cfg=cfg)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(200):
                gemm.matmul(x, w, cfg=cfg)
            host = (time.perf_counter() - t0) / 200 * 1e6
            torch.cuda.synchronize()
            same = torch.equal(gemm.matmul(x, w, cfg=cfg), gemm.matmul(x, w, cfg=(128, 128, 64, 8, 4, 4, True)))
            print(f"  host linear {name} cfg {cfg}: host {host:.1f} us/call, device "
                  f"{_graph_ms(lambda: gemm.matmul(x, w, cfg=cfg)) * 1e3:.1f} us, bits {'same' if same else 'DIFF'}",
                  flush=True)


def _moe_cfg(bm, gu, dn):
    opts = lambda c: dict(BLOCK_N=c[0], BLOCK_K=c[1], num_warps=c[2], num_stages=c[3])  # noqa: E731
    return bm, opts(gu), opts(dn)


MOE_PROBE = [(64, (64, 64, 4, 4), (256, 64, 8, 3)), (64, (64, 64, 4, 4), (256, 64, 8, 4)),
             (64, (64, 64, 4, 3), (256, 64, 8, 3)), (64, (128, 64, 4, 4), (128, 64, 4, 4)),
             (64, (128, 64, 4, 4), (256, 64, 8, 3)), (128, (128, 64, 8, 4), (256, 64, 8, 3)),
             (128, (128, 64, 8, 3), (256, 64, 8, 3)), (64, (64, 64, 4, 4), (128, 128, 4, 3)),
             (16, (128, 64, 4, 4), (128, 64, 4, 4)), (16, (64, 64, 4, 4), (128, 64, 4, 4)),
             (16, (128, 128, 4, 3), (128, 128, 4, 3)), (16, (256, 64, 8, 3), (256, 64, 8, 3)),
             (32, (128, 64, 4, 4), (128, 64, 4, 4)), (16, (64, 128, 4, 4), (64, 128, 4, 4)),
             (16, (32, 64, 4, 4), (64, 64, 4, 4)), (16, (64, 64, 4, 4), (64, 64, 4, 4)),
             (32, (128, 128, 4, 3), (128, 128, 4, 3)), (64, (128, 128, 4, 3), (128, 128, 4, 3)),
             # the decode tail (B=1: 33 us a layer for 75 MB of experts, 16 at the copy bandwidth): more,
             # shorter programs, as the M <= 16 GEMM tiles
             (16, (32, 128, 4, 4), (32, 128, 4, 4)), (16, (32, 256, 4, 3), (64, 256, 4, 3)),
             (16, (64, 256, 4, 3), (64, 256, 4, 3)), (16, (32, 128, 2, 4), (32, 128, 2, 4)),
             # B=1 on the H100 (2026-12-06): the decode tile above fastest warm (0.040 ms at T=1), its
             # gate_up 48 programs of 1 MB at 23.5 us in the step (71 % of the copy bandwidth): 384 of
             # 128 KB
             (16, (16, 256, 2, 4), (32, 256, 2, 4)),
             # the full RL batch (T=512: 4,096 rows; the plugin's experts 1.30x stock's fused_moe in vLLM):
             # the mid tile with 128-deep K steps
             (64, (64, 128, 4, 4), (128, 128, 4, 4)), (64, (128, 128, 8, 3), (256, 64, 8, 3)),
             (32, (64, 128, 4, 4), (128, 128, 4, 4)), (64, (128, 64, 4, 4), (256, 128, 8, 2))]
# first probe (2026-11-30, same device): BM128 gu(128,64,8,3) dn(128,64,8,3) [the old entry]
# 1.195 / 1.750 / 2.445 ms at T 1024 / 4096 / 8192; BM128 dn(256,64,8,3) 1.068 / 1.696 / 2.177;
# BM64 gu(64,64,4,4) dn(128,64,4,3) 1.075 / 1.870 / 2.465; BM64 gu(128,64,4,4) dn(128,64,4,4)
# 1.093 / 1.635 / 2.507; BM128 gu(64,..)/BN64 variants and dn(64,128,4,4) slower; all bits same.


def probe_moe():
    """Each (BM, gate_up, down) entry: ms of the expert kernels (plan included, graph replays) at T tokens,
    and whether the contributions equal the first entry's bit for bit; at decode T (<= 64) also cold
    (Cold: the step reads its experts from HBM; 8 experts are 75 MB, partly in L2 across replays)."""
    h, inter, e, topk = 2048, 768, 128, 8
    w_gate_up = torch.cat([rand(e, inter, h, scale=h ** -0.5), rand(e, inter, h, scale=h ** -0.5)], 1)
    wd = rand(e, h, inter, scale=inter ** -0.5)
    local, cold = list(range(e)), Cold()
    for t in (1, 8, 64, 256, 512, 1024, 8192):    # 1 .. 512: decode batches
        x = rand(t, h)
        ids, w = co.moe_route(x, rand(e, h, scale=h ** -0.5), topk)
        base = None
        for bm, gu, dn in MOE_PROBE:
            cfg = _moe_cfg(bm, gu, dn)
            try:
                run = lambda: tmoe._grouped_kernel(x, w, w_gate_up, wd, ids=ids, local=local, cfg=cfg)  # noqa: E731
                out = run()[0]
                base = out if base is None else base
                ms = _graph_ms(run)          # graph replays: the plan is capturable
                cold_cell = f" (cold {cold(run):.3f})" if t <= 64 else ""
                print(f"  moe T={t} BM{bm} gu{gu} dn{dn}: {ms:.3f} ms{cold_cell} bits "
                      f"{'same' if torch.equal(out, base) else 'DIFF'}", flush=True)
            except Exception as ex:
                print(f"  moe T={t} BM{bm} gu{gu} dn{dn}: failed {type(ex).__name__}: {str(ex)[:80]}", flush=True)


def print_table():
    """The summary: one line per case, every stock path named, goal beside it."""
    print("\n| section | case | ours ms | stock ms | x stock | metric | goal |\n|---|---|---|---|---|---|---|")
    for r in ROWS:
        stock = "; ".join(f"{k} {v}" for k, v in r["stock"].items()) or "-"
        ratio = "; ".join(f"{k} {v}x" for k, v in r["ratio"].items()) or "-"
        print(f"| {r['section']} | {r['case']} | {r['ours_ms']} | {stock} | {ratio} | {r['metric'] or '-'} "
              f"| {r['goal'] or '-'} |")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", help="write all rows here")
    ap.add_argument("--only", nargs="*", default=["attention", "decode", "linear", "logprobs", "moe", "actor"])
    ap.add_argument("--cases", help="the decode probes' B x context cases only, e.g. 4x32768,1x1024")
    ap.add_argument("--variants", help="the decode probes' variants only, comma-separated, of: "
                                       + ", ".join(DECODE_VARIANTS))
    args = ap.parse_args()
    cases = _parse_cases(args.cases) if args.cases else None
    if args.cases and not cases:
        ap.error(f"--cases {args.cases!r}: expected B x context pairs such as 4x32768,1x1024")
    only = args.variants.split(",") if args.variants else None
    bad = [v for v in only or () if v not in DECODE_VARIANTS]
    if bad:
        ap.error(f"--variants {args.variants!r}: {bad[0]!r} is not a variant; choose from {', '.join(DECODE_VARIANTS)}")
    decode_probe = {k: v for k, v in dict(cases=cases, only=only).items() if v}
    bw = 0      # the copy ceiling, measured below where a section reads it
    steps = dict(attention=attention_fwd_bwd, decode=lambda: paged_decode(bw), linear=linear, logprobs=logprobs,
                 moe=moe,
                 actor=actor_step, probe=lambda: (probe_linear(), probe_moe()), probe_moe=probe_moe,
                 actor_profile=actor_profile, probe_attention=probe_attention,
                 probe_attention_bwd=probe_attention_bwd, probe_attention_kernels=probe_attention_kernels,
                 probe_host=probe_host, probe_linear=probe_linear,
                 probe_decode_split=lambda: probe_decode_split(**decode_probe),
                 probe_fold_length=probe_fold_length, probe_decode_ncu=lambda: probe_decode_ncu(**decode_probe),
                 probe_linear_decode=probe_linear_decode, probe_linear_mid=probe_linear_mid,
                 probe_linear_split=probe_linear_split)
    bad = [k for k in args.only if k not in steps]
    if bad:
        ap.error(f"--only {' '.join(bad)}: no such section; choose from {', '.join(steps)}")
    if not torch.cuda.is_available():
        ap.error("no CUDA GPU in this process: the Triton benchmarks run on the device (scripts/gpu_suite.sh)")
    co.set_backend("triton")
    torch.manual_seed(0)
    name = torch.cuda.get_device_name()
    print(f"# {datetime.date.today()} {name} torch {torch.__version__} triton "
          f"{__import__('triton').__version__} contract {co.contract_fingerprint()}", flush=True)
    if any(k in args.only for k in ("decode", "attention")):
        bw = ceilings()
    failed = []
    for key in args.only:
        try:
            steps[key]()
        except Exception as e:          # keep the other sections' numbers; exit non-zero
            failed.append(key)
            print(f"!! {key} failed: {type(e).__name__}: {e}", flush=True)
            torch.cuda.empty_cache()
    print_table()
    if args.json:
        meta = dict(META, date=str(datetime.date.today()), device=name, torch=torch.__version__,
                    triton=__import__("triton").__version__, contract=co.contract_fingerprint(), driver=subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                          capture_output=True, text=True).stdout.strip())
        with open(args.json, "w") as f:
            json.dump(dict(meta=meta, rows=ROWS, failed=failed), f, indent=1)
    raise SystemExit(1 if failed else 0)


if __name__ == "__main__":
    main()
