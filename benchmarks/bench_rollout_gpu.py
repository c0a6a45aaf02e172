"""Rollout speed on one GPU at the full Qwen3-30B-A3B shape (48 layers, 128 experts top-8,
vocab 151,936, random weights), Triton backend, as a vLLM runner would drive it.

  1. trainer == rollout, bitwise, at full depth: packed trainer forward vs chunked prefill
     plus CUDA-graph decode (tests/gpu/harness.py GraphRunner);
  2. decode step time as graph replays for B in {1, 4, 16, 64, 256} at context 1k, {1, 4, 16, 64}
     at 8k and {1, 4, 16} at 32k,
     each as % of its HBM roofline: bytes of the weights the step touches (the experts its
     routing selects, measured) plus the KV it reads, over the copy bandwidth of this run;
  3. prefill tokens/s for 16k tokens in chunks of 2k and 8k (last-token logits, as vLLM),
     eager and, for 2k, as FULL CUDA-graph replays (the attention backend declares ALWAYS),
     against stock transformers Qwen3-MoE (sdpa) forward of the same shape, both at
     PREFILL_LAYERS layers (two 48-layer models do not fit one GPU beside a KV cache).

    PYTHONPATH=kernels:recipe:tests/gpu python benchmarks/bench_rollout_gpu.py [--json FILE] [--layers N]
"""
import argparse
import datetime
import json
import time

import torch

import consistent_ops as co
from consistent_ops.triton import common as triton_common
from bench_vllm_gpu import _parse_cases
from harness import GraphRunner, ModelRunner, build_hf_model, build_model
from true_on_policy.models.qwen3 import fuse

DEV, BF16 = "cuda", torch.bfloat16
PAGE, PREFILL_LAYERS = 16, 8
# the rollout's tail (B 1-16 at long context) and its body (B 64-256)
DECODE_CASES = ((1, 1024), (4, 1024), (16, 1024), (64, 1024), (256, 1024), (1, 8192), (4, 8192), (16, 8192),
                (64, 8192), (1, 32768), (4, 32768), (16, 32768))
GOALS = {(64, 1024): 50, (256, 1024): 50, (64, 8192): 60, (1, 1024): 40, (1, 8192): 40,
         **{(b, c): 60 for b in (4, 16) for c in (8192, 32768)}}
# decode cases whose step is profiled by kernel: B=1 at both ends, and the cases timed against stock
# vLLM at 48 layers (scripts/gpu_vllm_suite.sh tail48)
PROFILED = {(1, 1024), (1, 32768), (4, 8192), (16, 32768)}
ROWS, META = [], {}
WORK_BYTES = 4 << 30     # a decode case's activations, MoE scratch and graph pool, beside its KV cache


def record(section, case, ms, metric="", goal=""):
    ROWS.append(dict(section=section, case=case, ms=round(ms, 3), metric=metric, goal=goal))
    print(f"{section:8s} {case:40s} {ms:9.3f} ms  {metric}  {goal}", flush=True)


def copy_bandwidth():
    a = torch.empty(1 << 30, dtype=BF16, device=DEV).normal_()
    b = torch.empty_like(a)
    ms = _median_ms(lambda: b.copy_(a), 20)
    del a, b
    return 2 * (1 << 30) * 2 / ms / 1e9         # TB/s, read + write


def _median_ms(fn, reps):
    fn()
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e))
    return sorted(times)[len(times) // 2]


def check_full_depth(model):
    """Packed trainer forward == chunked prefill + graph decode, every logit row; the rollout's
    layers as vLLM's model class runs them (fuse: q/k/v in one GEMM), the trainer's unfused."""
    g = torch.Generator(device=DEV).manual_seed(5)
    lens, decode = [700, 333], 24
    toks = [torch.randint(0, 151643, (n,), generator=g, device=DEV) for n in lens]
    with torch.no_grad():
        train = model.forward_packed(torch.cat(toks), torch.cat([torch.arange(n, device=DEV) for n in lens]))
    train = train.split(lens)
    fuse(model)
    runner = ModelRunner(model, pages=256, page_size=PAGE)
    got = [[] for _ in lens]
    for lo in range(0, max(lens) - decode, 256):       # chunked prefill, both sequences per step
        batch = [(s, t[lo:min(lo + 256, n - decode)]) for s, (t, n) in enumerate(zip(toks, lens)) if lo < n - decode]
        for (s, t), part in zip(batch, runner.step(batch).split([len(t) for _, t in batch])):
            got[s].append(part)
    graphs = GraphRunner(runner, sizes=(2,), max_pages=64)
    for i in range(decode):
        out = graphs.step([(s, t[n - decode + i:n - decode + i + 1]) for s, (t, n) in enumerate(zip(toks, lens))])
        for s in range(len(lens)):
            got[s].append(out[s:s + 1])
    same = all(torch.equal(torch.cat(rows), t) for rows, t in zip(got, train))
    record("check", f"{len(model.model.layers)}-layer train == prefill+graph decode ({sum(lens)} tok)", 0.0,
           "bitwise EQUAL" if same else "DIFFER")
    del graphs, runner, train
    torch.cuda.empty_cache()
    return same


def touched_bytes(model, runner, batch):
    """Bytes one eager decode step must read: every weight but the experts, the experts
    its routing selects (recorded), and the KV of every sequence."""
    seen = []
    route = co.moe_route

    def recording_route(*args, **kw):
        ids, w = route(*args, **kw)
        seen.append(int(torch.unique(ids).numel()))
        return ids, w
    co.moe_route = recording_route
    try:
        runner.step(batch)
    finally:
        co.moe_route = route
    cfg, elt = model.cfg, 2
    expert = 3 * cfg.moe_intermediate_size * cfg.hidden_size * elt
    dense = sum(p.numel() * elt for n, p in model.named_parameters() if ".experts." not in n and "embed" not in n)
    kv_tok = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * elt
    ctx = sum(runner.kv.lens[s] for s, _ in batch)
    return dense + expert * sum(seen) + kv_tok * ctx, sum(seen) / len(seen)


def decode_cases(model, bw, cases=DECODE_CASES, writes=True):
    """Each case on a KV cache of its own size, allocated and freed around it, so that the cases
    fitting beside the 48-layer weights run on an 80 GB card too (the weights take ~61 GB; one
    cache for the largest case, 52 GB, did not fit the H100, 2026-12-05); a case that does not fit
    is reported as skipped, with the memory it needs."""
    runner = ModelRunner(model, pages=1, page_size=PAGE, writes=writes)
    cfg = model.cfg
    g = torch.Generator(device=DEV).manual_seed(7)
    for b, ctx in cases:
        pages = b * (ctx + 2 * PAGE) // PAGE + 64
        shape = (pages, PAGE, cfg.num_kv_heads, cfg.head_dim)
        need = 2 * cfg.num_layers * pages * PAGE * cfg.num_kv_heads * cfg.head_dim * 2
        free = torch.cuda.mem_get_info()[0]
        if need + WORK_BYTES > free:
            record("decode", f"B={b} ctx={ctx} (graph replay)", 0.0,
                   f"skipped: its KV cache needs {need / 1e9:.1f} GB + {WORK_BYTES / 1e9:.0f} GB of work space, "
                   f"{free / 1e9:.1f} GB free beside the weights", "")
            continue
        kv = runner.kv
        kv.k = [torch.empty(shape, dtype=BF16, device=DEV).normal_() for _ in range(cfg.num_layers)]
        kv.v = [torch.empty(shape, dtype=BF16, device=DEV).normal_() for _ in range(cfg.num_layers)]
        kv.free, kv.tables, kv.lens = torch.randperm(pages).tolist(), {}, {}
        kv.plan([(s, ctx) for s in range(b)])             # context "already cached" (random K/V)
        batch = [(s, torch.randint(0, 151643, (1,), generator=g, device=DEV)) for s in range(b)]
        nbytes, experts = touched_bytes(model, runner, batch)
        for s in range(b):                                 # the timed steps rewrite the same slot
            kv.lens[s] = ctx
        graphs = GraphRunner(runner, sizes=(b,), max_pages=(ctx + 2 * PAGE) // PAGE)
        bufs, graph, _ = graphs.graphs[b]
        graphs.step(batch)
        for s in range(b):
            kv.lens[s] = ctx
        ms = _median_ms(graph.replay, 20)
        if (b, ctx) in PROFILED:                 # the tail's launch chain: kernels a step (48 layers)
            _print_kernels(graph.replay, f"one B={b} ctx={ctx} decode step (graph replay)", rows=40)
        roof = nbytes / (bw * 1e12) * 1e3
        pct = 100 * roof / ms
        goal = GOALS.get((b, ctx))
        record("decode", f"B={b} ctx={ctx} (graph replay)", ms,
               f"{pct:.0f}% of roofline {roof:.2f} ms ({nbytes / 1e9:.1f} GB, {experts:.0f} experts/layer)",
               f">= {goal}%" if goal else "")
        del graphs, bufs, graph
        kv.k = kv.v = None
        torch.cuda.empty_cache()
    del runner


def _prefill_ours(model, toks, chunk):
    runner = ModelRunner(model, pages=len(toks) // PAGE + 8, page_size=PAGE)
    with torch.no_grad():
        for lo in range(0, len(toks), chunk):
            step = runner.kv.plan([(0, min(chunk, len(toks) - lo))])
            hidden = model.model(toks[lo:lo + chunk], step[1], lambda i, q, k, v: runner.kv.attend(i, q, k, v, step))
            model.compute_logits(hidden[-1:])
    torch.cuda.synchronize()


def _prefill_graphed(model, toks, chunk):
    """Prefill in chunks as FULL-graph replays (vLLM with capture sizes up to the chunk: the
    attention backend declares ALWAYS): one graph of `chunk` tokens, captured once (engine
    start-up, not timed); each call prefills a fresh sequence through it."""
    runner = ModelRunner(model, pages=len(toks) // PAGE + 8, page_size=PAGE)
    graphs = GraphRunner(runner, sizes=(chunk,), max_pages=len(toks) // PAGE + 8, max_reqs=1, last_only=True)
    kv, free = runner.kv, list(runner.kv.free)

    def run():
        kv.free, kv.tables, kv.lens = list(free), {}, {}
        for lo in range(0, len(toks), chunk):
            graphs.step([(0, toks[lo:lo + chunk])])
        torch.cuda.synchronize()
    return run


def _wall_ms(fn, reps=3):
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


def _print_kernels(fn, what, rows=12):
    """Where the device time of one call goes: kernels by total device time, with their counts."""
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    overlap = (" (programmatic dependent launch on: a kernel's time includes its wait on the one before;"
               " CONSISTENT_OPS_PDL=0 for each kernel's own)" if triton_common.PDL else "")
    print(f"# device time of {what}, by kernel{overlap}:", flush=True)
    print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=rows, max_name_column_width=70),
          flush=True)


def _print_top_kernels(fn, what, rows=12):
    """_print_kernels of one eager call, and its host time (Python functions and ops by self time)."""
    _print_kernels(fn, what, rows)
    _print_host_by_op(fn, what)


def _print_host_by_op(fn, what):
    """Host time of one call per consistent_ops op (each op's Python + launches, no sync)."""
    backend = co.get_backend()
    names = [n for n in dir(backend) if callable(getattr(backend, n)) and not n.startswith("_")]
    spent, calls, saved = {}, {}, {n: getattr(backend, n) for n in names}

    def timed(name, op):
        def run(*args, **kw):
            t0 = time.perf_counter()
            try:
                return op(*args, **kw)
            finally:
                spent[name] = spent.get(name, 0.0) + time.perf_counter() - t0
                calls[name] = calls.get(name, 0) + 1
        return run
    for n, op in saved.items():
        setattr(backend, n, timed(n, op))
    try:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        total = (time.perf_counter() - t0) * 1e3
        torch.cuda.synchronize()
    finally:
        for n, op in saved.items():
            setattr(backend, n, op)
    print(f"# host time of {what}: {total:.1f} ms, of which per op (ms, calls):", flush=True)
    for n in sorted(spent, key=spent.get, reverse=True):
        print(f"#   {n:28s} {spent[n] * 1e3:7.2f} {calls[n]:5d}", flush=True)


def _chunk_device_ms(model, toks, chunk, ctx):
    """One prefill chunk (ctx tokens already cached) as a graph replay: its device time,
    to tell the host's launch cost in the eager numbers apart."""
    runner = ModelRunner(model, pages=(ctx + chunk) // PAGE + 8, page_size=PAGE)
    runner.kv.plan([(0, ctx)])
    step = runner.kv.plan([(0, chunk)])

    def run():
        hidden = model.model(toks[:chunk], step[1], lambda i, q, k, v: runner.kv.attend(i, q, k, v, step))
        return model.compute_logits(hidden[-1:])
    with torch.no_grad():
        eager = _median_ms(run, 5)
        _print_top_kernels(run, f"one {chunk}-token chunk at ctx {ctx}")
        enqueue = []
        for _ in range(5):          # host time to issue the chunk (no sync inside it)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            run()
            enqueue.append((time.perf_counter() - t0) * 1e3)
        print(f"# host time to issue one {chunk}-token chunk ({len(model.model.layers)} layers): "
              f"{sorted(enqueue)[2]:.1f} ms", flush=True)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run()
        return eager, _median_ms(graph.replay, 10)


def prefill_cases(layers):
    n = 16384
    toks = torch.randint(0, 151643, (n,), device=DEV)
    ours = build_model(layers=layers)
    fuse(ours)                  # as vLLM's model class
    mine = {c: _wall_ms(lambda c=c: _prefill_ours(ours, toks, c)) for c in (2048, 8192)}
    graphed = _wall_ms(_prefill_graphed(ours, toks, 2048))
    eager, replay = _chunk_device_ms(ours, toks, 2048, 8192)
    record("prefill", f"{layers}-layer one 2k chunk at ctx 8k: eager", eager,
           f"graph replay {replay:.1f} ms (device time; the rest is launch cost)")
    del ours
    torch.cuda.empty_cache()
    hf = build_hf_model(layers=layers, attn="sdpa")
    with torch.no_grad():
        stock = _wall_ms(lambda: hf(toks[None], logits_to_keep=1))
    del hf
    torch.cuda.empty_cache()
    for c, ms in [*mine.items(), ("2048 (FULL graph replays)", graphed)]:
        record("prefill", f"{layers}-layer 16k tokens, chunks of {c}", ms,
               f"{n / ms * 1e3:.0f} tok/s; HF sdpa one pass {stock:.1f} ms -> {stock / ms:.2f}x stock", ">= 1.0x")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--cases", help="decode cases B x context only, e.g. 1x1024,4x8192 (default: all), "
                                    "and no prefill cases")
    ap.add_argument("--kv-write", choices=("prologue", "separate"), default="prologue",
                    help="decode steps store K/V from the attention prologue, as vLLM's model class does "
                         "(default), or in write_kv_cache's own launch, as before (to time the two)")
    args = ap.parse_args()
    cases = DECODE_CASES if args.cases is None else _parse_cases(args.cases)
    if not cases:
        ap.error(f"--cases {args.cases!r}: expected B x context pairs such as 1x1024,4x8192")
    if not torch.cuda.is_available():
        ap.error("no CUDA GPU in this process: the 48-layer rollout benchmark runs on the device (scripts/gpu_suite.sh)")
    co.set_backend("triton")
    torch.manual_seed(0)
    bw = copy_bandwidth()
    META.update(date=str(datetime.date.today()), device=torch.cuda.get_device_name(), torch=torch.__version__,
                contract=co.contract_fingerprint(), copy_tbs=round(bw, 3), layers=args.layers,
                pdl=triton_common.PDL,   # programmatic dependent launch (CONSISTENT_OPS_PDL=0: off)
                kv_write=args.kv_write)
    print(f"# {META}", flush=True)
    model = build_model(layers=args.layers)
    same = check_full_depth(model)
    decode_cases(model, bw, cases, writes=args.kv_write == "prologue")
    del model
    torch.cuda.empty_cache()
    if args.cases is None:
        prefill_cases(min(PREFILL_LAYERS, args.layers))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(meta=META, rows=ROWS), f, indent=1)
    raise SystemExit(0 if same else 1)


if __name__ == "__main__":
    main()
