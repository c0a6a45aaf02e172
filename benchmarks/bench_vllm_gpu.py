"""Real vLLM on a CUDA GPU: an RL-shaped rollout, stock vLLM vs vLLM with the true_on_policy plugin.

The same checkpoint, vLLM build, prompts and requests for both; the only difference is
TRUE_ON_POLICY=1 (and the plugin's CUDA-graph setting, scheme.CUDA_GRAPHS; stock runs vLLM's
defaults: FA3, Triton fused MoE, cuBLAS, torch.compile + CUDA graphs). The batch is a GRPO
rollout: --prompts prompts of about --prompt-len tokens, each sent --n times as separate
requests (as verl's agent loop sends them; prefix caching on), T=1.0, logprobs=0 (verl asks
for them), and per-request response lengths with a long tail (log-normal, median a quarter of
--max-response, capped there; ignore_eos, so both engines generate exactly the same number of
tokens). Each engine runs in its own process: start-up, a warm-up generate (every request, 32
tokens: kernel compilation and autotuning happen there), then
--repeats timed generates of the whole batch (prefix cache reset before each). --rounds runs
that many fresh processes of each engine, interleaved ABBA (stock, plugin, plugin, stock, ...):
on the H200 one engine's batch time moved by up to 1.5x between processes (2026-12-03), so a
ratio needs several; the GPU's SM clock, power and temperature are sampled during each.
Reported: output tokens/s and the time to finish the batch (medians over every timed generate of
all rounds), each round's plugin / stock, and plugin / stock of the medians; and the steps' wall
time by how many requests were unfinished (the full batch vs its tail; StepTimes).

--tail (issue 26: the rollout's tail, few sequences with long contexts, >= 0.9x stock): per
TAIL_CASES case (B in 1/4/16, context 1k/8k/32k tokens), B distinct random prompts of exactly that
many tokens, generated twice with the prefix cache reset before each: max_tokens=1 (the prefill)
and 1 + TAIL_DECODE; a decode step is the median wall time of the second's last TAIL_DECODE
engine steps (their difference / TAIL_DECODE is kept beside it). --repeats (default 3) times
a case per process; reported per case: each engine's decode ms per step, decode tokens/s (B / step
time), prefill time (medians over every repeat of all rounds) and stock ms / plugin ms. --cases
BxCONTEXT,... times those cases instead. --host-times (with --tail) runs each engine in this
process and adds, per case, the host's median microseconds a decode step inside each of HOST_TIMED's
functions (inclusive): where one engine's step spends host time the other's does not.

    python3 benchmarks/bench_vllm_gpu.py --model DIR [--json out.json]
    python3 benchmarks/bench_vllm_gpu.py --model DIR --max-response 16384 --prompts 16
    python3 benchmarks/bench_vllm_gpu.py --model DIR --profile   # each engine's CUDA kernels, wall
                         # time and launches over the whole batch (128 tokens) and a tail (8 x 512)
    python3 benchmarks/bench_vllm_gpu.py --model DIR --tail      # decode at B 1/4/16 x context 1k/8k/32k
    python3 benchmarks/bench_vllm_gpu.py --model DIR --tail --engines stock,plugin,sampling
                         # + stock vLLM with the plugin's sampling path alone: what it costs a step
    python3 benchmarks/bench_vllm_gpu.py --model DIR --tail --cases 1x1024,16x32768 --host-times
    python3 benchmarks/bench_vllm_gpu.py --model DIR48 --load-format dummy --tail
                         # the full 48-layer shape, weights drawn by vLLM (DIR48: make_tiny_model
                         # --no-weights --num-layers 48 ...; scripts/gpu_vllm_suite.sh tail48)
"""
import argparse
import importlib
import json
import math
import os
import random
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ENGINES = ("stock", "plugin", "sampling")
DEFAULT_ENGINES = "stock,plugin"
# "sampling": stock vLLM (its model, kernels and graphs) with the plugin's sampling path alone (its
# logits processor, processed_logits mode, its request params): what that path costs a decode step
# (2026-12-05: the plugin's steps 0.4-1.0 ms longer than stock's at B 1-4, both host-bound)
EXIT_GRACE_S = 60          # an engine process that has sent its result and not exited by then is killed
PROFILE_TAIL = (8, 512)    # --profile's second batch: the rollout's tail, few sequences decoding long
# --tail's cases (B sequences, context tokens each), its decode steps and goal (issue 26)
TAIL_CASES = ((1, 1024), (4, 1024), (16, 1024), (1, 8192), (4, 8192), (16, 8192),
              (1, 32768), (4, 32768), (16, 32768))
TAIL_DECODE = 256
TAIL_GOAL = 0.9
# --host-times: the functions of a decode step timed on the host (module:Class.method; inclusive, so
# nested ones are part of those above them); one missing from a vLLM build is left out
HOST_TIMED = ("vllm.v1.core.sched.scheduler:Scheduler.schedule",
              "vllm.v1.core.sched.scheduler:Scheduler.update_from_output",
              "vllm.v1.engine.output_processor:OutputProcessor.process_outputs",
              "vllm.v1.worker.gpu_model_runner:GPUModelRunner.execute_model",
              "vllm.v1.worker.gpu_model_runner:GPUModelRunner._update_states",
              "vllm.v1.worker.gpu_model_runner:GPUModelRunner._prepare_inputs",
              "vllm.v1.worker.gpu_model_runner:GPUModelRunner._build_attention_metadata",
              "vllm.v1.worker.gpu_model_runner:GPUModelRunner._model_forward",
              "vllm.model_executor.layers.logits_processor:LogitsProcessor.forward",
              "true_on_policy.vllm.model:TrueOnPolicyForCausalLM.compute_logits",
              "vllm.v1.worker.gpu_model_runner:GPUModelRunner.sample_tokens",
              "vllm.v1.worker.gpu_input_batch:InputBatch.update_async_output_token_ids",
              "vllm.v1.sample.sampler:Sampler.forward",
              "true_on_policy.vllm.sampling:ContractLogProbs.apply",
              "vllm.v1.worker.gpu_model_runner:GPUModelRunner._bookkeeping_sync")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="HF checkpoint dir (Qwen3 / Qwen3-MoE)")
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--n", type=int, default=8, help="samples per prompt (separate requests)")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--max-response", type=int, default=4096)
    p.add_argument("--repeats", type=int, help="timed generates per engine process (default 1; "
                   "--tail: 3 per case)")
    p.add_argument("--rounds", type=int, default=1, help="fresh processes per engine, interleaved")
    p.add_argument("--engines", default=DEFAULT_ENGINES, help=f"comma-separated, of {', '.join(ENGINES)}")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.85, help="vLLM's fraction of the GPU's "
                   "memory for each engine (weights, activations, KV cache); --tail at 48 layers on an 80 GB "
                   "card, 0.95 holds B=4 x 32k's 132k tokens of KV beside the weights in both engines (H100, "
                   "2026-12-07; stock vLLM held 62,816 at 0.85)")
    p.add_argument("--load-format", choices=("auto", "dummy"), help="vLLM's: dummy draws random weights "
                   "(each engine its own), for a checkpoint of config and tokenizer alone (make_tiny_model "
                   "--no-weights): the full 48-layer shape without 61 GB of files")
    p.add_argument("--profile", action="store_true", help="instead of timing: each engine's top CUDA "
                   "kernels, wall time and launches (torch profiler, engine in-process) over --prompts x --n "
                   "requests of 128 tokens, then over a tail of 8 of them generating 512 tokens")
    p.add_argument("--tail", action="store_true", help="instead of the batch: decode ms per step at B "
                   "1/4/16 and contexts 1k/8k/32k (TAIL_CASES; --prompts, --n, --prompt-len, --max-response unused)")
    p.add_argument("--cases", help="--tail: these cases instead of TAIL_CASES, as BxCONTEXT,... (e.g. 1x1024,16x32768)")
    p.add_argument("--host-times", action="store_true", help="--tail: each engine in this process; per case the "
                   "host's microseconds a decode step in each of HOST_TIMED's functions")
    p.add_argument("--json")
    p.add_argument("--logs", help="a folder: each engine process's whole output, written as it runs "
                   "(<engine>-<n>.log; what a killed run leaves to read)")
    p.add_argument("--child", choices=ENGINES, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.repeats is None:
        a.repeats = 3 if a.tail else 1
    bad = [f"--{k.replace('_', '-')} {v}" for k, v in vars(a).items()
           if k in ("prompts", "n", "prompt_len", "max_response", "repeats", "rounds") and v < 1]
    if bad:
        problem = f"{', '.join(bad)}: use 1 or more"
    elif not 0 < a.gpu_memory_utilization <= 1:
        problem = (f"--gpu-memory-utilization {a.gpu_memory_utilization}: give a fraction of the GPU's memory "
                   "in (0, 1], e.g. 0.95")
    elif not a.child and (not a.engines or set(a.engines.split(",")) - set(ENGINES)):
        problem = f"--engines {a.engines}: name some of {', '.join(ENGINES)}"
    elif a.tail and a.profile:
        problem = "--tail with --profile: run them separately"
    elif (a.cases or a.host_times) and not a.tail:
        problem = f"{'--cases' if a.cases else '--host-times'} without --tail: add --tail"
    elif a.cases and not _parse_cases(a.cases):
        problem = f"--cases {a.cases}: give BxCONTEXT pairs of positive integers, comma-separated (e.g. 1x1024,16x32768)"
    elif not Path(a.model, "config.json").is_file():
        problem = f"--model {a.model}: no config.json: pass a HF checkpoint directory"
    else:
        return a
    print(f"error: {problem}", file=sys.stderr)
    raise SystemExit(2)


def _parse_cases(text):
    """'1x1024,16x32768' -> ((1, 1024), (16, 32768)); None when malformed."""
    try:
        cases = tuple(tuple(int(x) for x in case.split("x")) for case in text.split(","))
    except ValueError:
        return None
    return cases if all(len(c) == 2 and min(c) > 0 for c in cases) else None


def tail_cases(args):
    return _parse_cases(args.cases) if args.cases else TAIL_CASES


def workload(args, vocab):
    """[(prompt ids, response length)]: the same for both engines (seeded)."""
    rng = random.Random(0)
    out = []
    for _ in range(args.prompts):
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(args.prompt_len * 3 // 4, args.prompt_len * 5 // 4))]
        for _ in range(args.n):
            length = math.exp(rng.gauss(math.log(args.max_response / 4), 0.8))
            out.append((prompt, max(16, min(args.max_response, round(length)))))
    return out


def tail_prompts(b, ctx, vocab):
    """b distinct random prompts of exactly ctx token ids, the same in every process (seeded)."""
    rng = random.Random(f"tail {b} {ctx}")
    return [[rng.randrange(vocab) for _ in range(ctx)] for _ in range(b)]


def decode_ms(short_s, long_s):
    """ms per decode step: the 1 + TAIL_DECODE token generate less the prefill-only one."""
    return (long_s - short_s) / TAIL_DECODE * 1e3


# ----------------------------------------------------------------------------- child: one engine
def build_llm(args, engine, longest):
    from vllm import LLM
    kwargs = dict(model=args.model, seed=0, enable_prefix_caching=True, max_model_len=longest,
                  gpu_memory_utilization=args.gpu_memory_utilization, disable_log_stats=True)
    if args.load_format:
        kwargs["load_format"] = args.load_format
    if engine == "plugin":
        from true_on_policy import scheme
        kwargs.update(dtype="bfloat16", compilation_config=dict(scheme.CUDA_GRAPHS))
    elif engine == "sampling":       # what the plugin's config hook sets (vllm/engine_config.py)
        from true_on_policy.vllm.engine_config import LOGPROBS_MODE
        from true_on_policy.vllm.sampling import V1_PROCESSOR
        kwargs.update(logprobs_mode=LOGPROBS_MODE, logits_processors=[V1_PROCESSOR])
    else:
        kwargs["logprobs_mode"] = "processed_logprobs"     # log_softmax(logits / T), verl's default
    return LLM(**kwargs)


def params_for(engine, max_tokens):
    common = dict(max_tokens=max_tokens, logprobs=0, ignore_eos=True, detokenize=False)
    if engine in ("plugin", "sampling"):
        from true_on_policy.vllm.sampling import sampling_params
        return sampling_params(1.0, **common)
    from vllm import SamplingParams
    return SamplingParams(temperature=1.0, **common)


def generate(llm, engine, work):
    prompts = [{"prompt_token_ids": p} for p, _ in work]
    outs = llm.generate(prompts, [params_for(engine, n) for _, n in work], use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outs)


def timed(llm, engine, work):
    """(seconds, output tokens) of one generate, the prefix cache reset first: every timed
    generate prefills all of its prompts."""
    llm.reset_prefix_cache()
    t = time.perf_counter()
    tokens = generate(llm, engine, work)
    return time.perf_counter() - t, tokens


class StepTimes:
    """Wall time of the engine's steps by how many requests were unfinished when each began (the
    full batch, its middle, its tail: where one engine loses to the other), summed over the timed
    generates. Wraps the instance's step(), which LLM.generate calls once a step; engines without
    get_num_unfinished_requests are left alone (summary empty). `durations` keeps each step's seconds
    (the tail's decode steps are the last of a generate); after_step, if given, runs after each."""
    BUCKETS = ((8, "<=8"), (64, "9-64"), (256, "65-256"), (math.inf, ">256"))

    def __init__(self, engine, after_step=None):
        self.spent, self.engine, self.durations = {}, None, []
        if not hasattr(engine, "get_num_unfinished_requests"):
            return
        self.engine = engine
        inner = engine.step

        def step():
            n = engine.get_num_unfinished_requests()
            t = time.perf_counter()
            try:
                return inner()
            finally:
                self.durations.append(time.perf_counter() - t)
                cell = self.spent.setdefault(next(name for most, name in self.BUCKETS if n <= most), [0.0, 0])
                cell[0] += self.durations[-1]
                cell[1] += 1
                if after_step:
                    after_step()
        engine.step = step

    def close(self):
        """Unwrap step(): the wrapper refers to the engine, a cycle that outlives the timed runs."""
        if self.engine is not None:
            vars(self.engine).pop("step", None)

    def summary(self, generates):
        """{bucket: [seconds, steps] per timed generate}, buckets in BUCKETS order."""
        return {name: [self.spent[name][0] / generates, self.spent[name][1] / generates]
                for _, name in self.BUCKETS if name in self.spent}


def key_medians(rows, scale=1.0):
    """[{key: value}] -> {key: median value * scale} (0 where a row lacks the key)."""
    keys = dict.fromkeys(key for row in rows for key in row)
    return {key: statistics.median(row.get(key, 0.0) for row in rows) * scale for key in keys}


class HostTimes:
    """Inclusive host wall time of HOST_TIMED's functions, per engine step: each is wrapped on its
    class (so every instance, engine core included when it runs in this process); end_step() closes
    a step (`steps`: one {function: seconds} a step); close() unwraps."""

    def __init__(self):
        self.current, self.steps, self.wrapped = {}, [], []
        for target in HOST_TIMED:
            module, _, attr = target.partition(":")
            owner, _, name = attr.rpartition(".")
            try:
                cls = getattr(importlib.import_module(module), owner)
            except (ImportError, AttributeError):
                continue
            if name in vars(cls):
                self.wrapped.append((cls, name, vars(cls)[name]))
                setattr(cls, name, self._timed(target.rpartition(":")[2], vars(cls)[name]))

    def _timed(self, label, inner):
        current = self.current

        def run(*args, **kwargs):
            t = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                current[label] = current.get(label, 0.0) + time.perf_counter() - t
        return run

    def end_step(self):
        self.steps.append(dict(self.current))
        self.current.clear()

    def close(self):
        for cls, name, inner in self.wrapped:
            setattr(cls, name, inner)


def run_child(args):
    from transformers import AutoTokenizer
    vocab = len(AutoTokenizer.from_pretrained(args.model))
    t0 = time.perf_counter()
    if args.tail:
        # warm-up: the smallest case end to end (compilation, autotuning)
        cases = tail_cases(args)
        warm = [(p, 1 + TAIL_DECODE) for p in tail_prompts(*min(cases, key=lambda c: c[0] * c[1]), vocab)]
        longest = max(ctx for _, ctx in cases) + 1 + TAIL_DECODE
    else:
        work = workload(args, vocab)
        if args.profile:
            work = [(p, 128) for p, _ in work]
        # warm-up: every request for 32 tokens, so Triton compiles and autotunes what the batch's
        # shapes need (decode at every batch size down from the whole batch) before the clock runs
        warm = [(p, 32) for p, _ in work]
        longest = max(len(p) + max(n, PROFILE_TAIL[1] if args.profile else 0) for p, n in work)
    llm = build_llm(args, args.child, longest + 16)
    start_s = time.perf_counter() - t0
    print(f"[{args.child}] engine up in {start_s:.1f} s; warm-up", flush=True)
    generate(llm, args.child, warm)
    print(f"[{args.child}] warm-up done at {time.perf_counter() - t0:.1f} s", flush=True)
    result = {"engine": args.child, "engine_start_s": start_s}
    if args.tail:
        result["cases"] = time_tail(llm, args.child, args.repeats, vocab, tail_cases(args), args.host_times)
    else:
        result.update(time_batch(llm, args, work))
    print("@@result " + json.dumps(result), flush=True)


def time_batch(llm, args, work):
    """--repeats timed generates of the whole batch (or, with --profile, its two profiles)."""
    result = {"seconds": [], "tokens": 0}
    if args.profile:
        result["kernels"] = profile(llm, args.child, work)
        result["tail"] = profile(llm, args.child, [(p, PROFILE_TAIL[1]) for p, _ in work[:PROFILE_TAIL[0]]])
    steps = StepTimes(llm.llm_engine)
    for _ in range(0 if args.profile else args.repeats):
        seconds, result["tokens"] = timed(llm, args.child, work)
        result["seconds"].append(seconds)
        print(f"[{args.child}] generate {len(result['seconds'])}: {seconds:.2f} s", flush=True)
    result["steps"] = steps.summary(max(len(result["seconds"]), 1))
    steps.close()
    return result


def kv_cache_blocks(llm):
    """(blocks, tokens a block) of the engine's KV cache as its core reported them at start-up, or
    None where the engine does not say."""
    cache = getattr(getattr(llm.llm_engine, "vllm_config", None), "cache_config", None)
    blocks = getattr(cache, "num_gpu_blocks", None)
    return (blocks, cache.block_size) if blocks else None


def too_big(kv, b, ctx):
    """Why B sequences of ctx + 1 + TAIL_DECODE tokens cannot all decode at once in a KV cache of
    kv = (blocks, tokens a block), or None where they can (or kv is unknown). A case that does
    not fit would be timed with the scheduler queueing sequences: a step of fewer than B."""
    if kv is None:
        return None
    blocks, size = kv
    need = b * -(-(ctx + 1 + TAIL_DECODE) // size)
    return None if need <= blocks else (f"needs {need * size:,} tokens of KV cache at once, the engine "
                                        f"holds {blocks * size:,} (more with a higher --gpu-memory-utilization)")


def time_tail(llm, engine, repeats, vocab, cases=TAIL_CASES, host_times=False):
    """Per case, `repeats` times: the prefill-only generate's seconds and the decode
    ms per step, both generates over the same prompts from a reset prefix cache. decode_ms is the
    median of the long generate's last TAIL_DECODE engine steps (one hiccup, e.g. a compilation,
    moves it by a step at most); decode_ms_difference the two generates' difference per step
    (the measure before 2026-12-05, which such a hiccup in either generate skews). With
    host_times, host_us: the medians of HostTimes' steps (those steps of every repeat), us.
    A case whose B sequences do not fit the engine's KV cache together is skipped, said why."""
    host = HostTimes() if host_times else None
    steps = StepTimes(llm.llm_engine, host.end_step if host else None)
    kv = kv_cache_blocks(llm)
    out = []
    for b, ctx in cases:
        if (why := too_big(kv, b, ctx)):
            print(f"[{engine}] tail B={b} context={ctx}: skipped: {why}", flush=True)
            out.append({"b": b, "ctx": ctx, "skipped": why})
            continue
        prompts = tail_prompts(b, ctx, vocab)
        case = {"b": b, "ctx": ctx, "prefill_s": [], "decode_ms": [], "decode_ms_difference": []}
        decoded = []
        for i in range(repeats):
            short, _ = timed(llm, engine, [(p, 1) for p in prompts])
            steps.durations.clear()
            if host:
                host.steps.clear()
            long, _ = timed(llm, engine, [(p, 1 + TAIL_DECODE) for p in prompts])
            case["prefill_s"].append(short)
            case["decode_ms_difference"].append(decode_ms(short, long))
            decode_steps = steps.durations[-TAIL_DECODE:]
            case["decode_ms"].append(statistics.median(decode_steps) * 1e3 if len(decode_steps) == TAIL_DECODE
                                     else case["decode_ms_difference"][-1])
            if host:
                decoded += host.steps[-TAIL_DECODE:]
            print(f"[{engine}] tail B={b} context={ctx} repeat {i + 1}/{repeats}: prefill {short:.3f} s, "
                  f"decode {case['decode_ms'][-1]:.3f} ms/step", flush=True)
        if host:
            case["host_us"] = key_medians(decoded, 1e6)      # us a step
        out.append(case)
    steps.close()
    if host:
        host.close()
    return out


def profile(llm, engine, work, rows=20):
    """One generate under the torch profiler (the engine runs in this process): the top CUDA
    kernels by time, the wall time, and the host's launches. Kernel time well below the wall
    time means host-bound steps; graph launches say whether the steps replayed CUDA graphs. The
    plugin's kernels run without programmatic dependent launch here (each kernel's own time), unless
    CONSISTENT_OPS_PDL is set."""
    import torch
    from torch.profiler import ProfilerActivity, profile as torch_profile
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        wall_ms = timed(llm, engine, work)[0] * 1e3
    events = prof.key_averages()
    kernels = sorted((e for e in events if e.device_type == torch.autograd.DeviceType.CUDA),
                     key=lambda e: e.self_device_time_total, reverse=True)
    launches = {name: sum(e.count for e in events if e.key == name)
                for name in ("cudaGraphLaunch", "cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx")}
    # the host's side: which ops and runtime calls hold the CPU (self time), e.g. a sync or a copy per step
    host = sorted((e for e in events if e.device_type == torch.autograd.DeviceType.CPU),
                  key=lambda e: e.self_cpu_time_total, reverse=True)
    return {"requests": len(work), "tokens": sum(n for _, n in work), "wall_ms": wall_ms,
            "total_ms": sum(e.self_device_time_total for e in kernels) / 1e3, "launches": launches,
            "top": [{"kernel": e.key[:90], "ms": e.self_device_time_total / 1e3, "calls": e.count}
                    for e in kernels[:rows]],
            "host": [{"op": e.key[:90], "ms": e.self_cpu_time_total / 1e3, "calls": e.count} for e in host[:rows]]}


# ----------------------------------------------------------------------------- parent
def print_profile(engine, r):
    for part in ("kernels", "tail"):
        k = r[part]
        print(f"\n[{engine}] {k['requests']} requests x {k['tokens'] // k['requests']} tokens: wall "
              f"{k['wall_ms']:.1f} ms, CUDA kernel time {k['total_ms']:.1f} ms "
              f"({k['total_ms'] / k['wall_ms']:.0%}); host launches {k['launches']}; top kernels:")
        for row in k["top"]:
            print(f"  {row['ms']:9.2f} ms {row['calls']:7d}x  {row['kernel']}")
        print(f"[{engine}] top host ops (self CPU time):")
        for row in k["host"]:
            print(f"  {row['ms']:9.2f} ms {row['calls']:7d}x  {row['op']}")


class GpuSampler:
    """nvidia-smi every 2 s while an engine runs: SM clock, power and temperature (does the GPU
    throttle under one engine's kernels? on 2026-12-03 one engine's batch time moved by 1.47x
    between processes). Empty where nvidia-smi is missing."""
    QUERY = ["nvidia-smi", "--query-gpu=clocks.sm,power.draw,temperature.gpu", "--format=csv,noheader,nounits",
             "-lms", "2000"]

    def __enter__(self):
        self.rows = []
        try:
            self.proc = subprocess.Popen(self.QUERY, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        except OSError:
            self.proc = None
            return self
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        return self

    def _read(self):
        for line in self.proc.stdout:
            try:
                self.rows.append([float(x) for x in line.split(",")[:3]])
            except ValueError:
                pass

    def __exit__(self, *exc):
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait()
            self.reader.join(timeout=5)

    def summary(self):
        if not self.rows:
            return {}
        clock, power, temp = zip(*self.rows)
        return {"sm_mhz_median": statistics.median(clock), "sm_mhz_min": min(clock),
                "power_w_median": statistics.median(power), "temp_c_max": max(temp), "samples": len(self.rows)}


def run_engine(args, engine, name=None):
    """One engine process (name: its log's name under --logs) -> its @@result, with the plugin's
    own log lines (plugin_log: the decode paths it took; [] for stock)."""
    from true_on_policy.check.report import PLUGIN_LOG_MARK, plugin_log
    env = {k: v for k, v in os.environ.items() if k != "TRUE_ON_POLICY"}
    env["TRUE_ON_POLICY"] = "1" if engine == "plugin" else "0"
    if args.profile or args.host_times:    # engine core in this process, so the profiler / HostTimes see it
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if args.profile:   # under programmatic dependent launch a kernel's time includes its wait on the one before
        env.setdefault("CONSISTENT_OPS_PDL", "0")
    # the child's own settings; a flag (--profile, --tail) only when set
    argv = [f"--{k.replace('_', '-')}" + ("" if v is True else f"={v}") for k, v in vars(args).items()
            if k not in ("json", "child", "engines", "rounds", "logs") and v is not False and v is not None]
    proc = subprocess.Popen([sys.executable, __file__, *argv, "--child", engine], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env)
    tail, plugin = [], []
    log = open(Path(args.logs) / f"{name or engine}.log", "w") if args.logs else None
    try:
        for line in proc.stdout:
            if line.startswith("@@result "):
                _reap(proc)
                return {**json.loads(line[len("@@result "):]), "plugin_log": plugin_log(plugin)}
            tail = (tail + [line])[-60:]
            if PLUGIN_LOG_MARK in line:
                plugin.append(line)
            if line.startswith(f"[{engine}] "):    # the child's progress: where a slow start stands
                print(line, end="", flush=True)
            if log:
                log.write(line)
                log.flush()
        proc.wait()
    finally:
        if log:
            log.close()
    sys.stderr.write("".join(tail))
    raise SystemExit(f"error: the {engine} engine failed (exit {proc.returncode}); its last lines are above")


def _reap(proc):
    """Wait for an engine process that has sent its result; kill it past EXIT_GRACE_S (2026-12-04,
    H200: both engines' processes stayed alive after their result, and the round waited on them
    until the call's limit)."""
    try:
        proc.wait(timeout=EXIT_GRACE_S)
    except subprocess.TimeoutExpired:
        print(f"[bench_vllm_gpu] the engine process did not exit {EXIT_GRACE_S} s after its result: killed",
              flush=True)
        proc.kill()
        proc.wait()


def _pooled_steps(per_round):
    """StepTimes summaries of several rounds -> their mean per bucket (rounds without one skipped)."""
    rounds = [r for r in per_round if r]
    names = [name for _, name in StepTimes.BUCKETS if any(name in r for r in rounds)]
    return {name: [sum(r.get(name, [0.0, 0])[i] for r in rounds) / len(rounds) for i in (0, 1)] for name in names}


def _gpu_text(g):
    return (f"; GPU SM clock median {g['sm_mhz_median']:.0f} MHz (min {g['sm_mhz_min']:.0f}), power "
            f"{g['power_w_median']:.0f} W, up to {g['temp_c_max']:.0f} C" if g else "")


def run_rounds(args, engines, note):
    """--rounds fresh processes of each engine in ABBA order (drift hits both alike) -> [{engine:
    its result, wall time and GPU samples}]; note(result) adds that mode's medians and says them."""
    rounds = []
    for i in range(args.rounds):
        this = {}
        for engine in engines if i % 2 == 0 else engines[::-1]:
            t = time.time()
            with GpuSampler() as gpu:
                r = this[engine] = run_engine(args, engine, f"{engine}-{i + 1}")
            r["wall_s"], r["gpu"] = time.time() - t, gpu.summary()
            print(f"[bench_vllm_gpu] round {i + 1}/{args.rounds} {engine}: engine up in {r['engine_start_s']:.1f}s; "
                  f"{note(r)}{_gpu_text(r['gpu'])}", flush=True)
            if i == 0:
                print("".join(f"[bench_vllm_gpu] {engine}: {line}\n" for line in r.get("plugin_log", ())), end="",
                      flush=True)
        rounds.append(this)
    return rounds


def _batch_note(r):
    r["batch_s"] = statistics.median(r["seconds"])
    return (f"{r['tokens']} output tokens in {r['batch_s']:.2f}s ({', '.join(f'{s:.2f}' for s in r['seconds'])})"
            f": {r['tokens'] / r['batch_s']:.0f} tokens/s")


def _tail_note(r):
    def ms(c):
        return "skipped" if "skipped" in c else f"{statistics.median(c['decode_ms']):.3f}"
    return "decode ms/step " + ", ".join(f"B={c['b']} {c['ctx'] // 1024}k {ms(c)}" for c in r["cases"])


def _pooled_batch(runs):
    """One engine's rounds of the batch -> every timed generate pooled, their median, tokens/s."""
    seconds = [s for r in runs for s in r["seconds"]]
    batch_s = statistics.median(seconds)
    return {"tokens": runs[0]["tokens"], "seconds": seconds, "batch_s": batch_s,
            "steps": _pooled_steps([r.get("steps", {}) for r in runs]), "tokens_per_s": runs[0]["tokens"] / batch_s}


def tail_summary(rounds, engines):
    """Per case: each engine's medians over every repeat of all rounds (host_us: over rounds) and,
    with both engines, the plugin's decode speed against stock's (stock ms / plugin ms; > 1: the
    plugin is faster), pooled and per round."""
    cases = []
    for k, first in enumerate(rounds[0][engines[0]]["cases"]):
        b, ctx = first["b"], first["ctx"]
        row = {"b": b, "ctx": ctx}
        skipped = [c["skipped"] for r in rounds for e in engines if "skipped" in (c := r[e]["cases"][k])]
        if skipped:           # by any engine in any round: no time to set beside the other's
            cases.append({**row, "skipped": skipped[0]})
            continue
        for engine in engines:
            runs = [r[engine]["cases"][k] for r in rounds]
            ms = statistics.median(x for c in runs for x in c["decode_ms"])
            row[engine] = {"decode_ms": ms, "decode_tokens_per_s": b * 1e3 / ms,
                           "prefill_s": statistics.median(x for c in runs for x in c["prefill_s"])}
            if "host_us" in runs[0]:
                row[engine]["host_us"] = key_medians([c["host_us"] for c in runs])
        if {"stock", "plugin"} <= set(engines):
            row["plugin_speed"] = row["stock"]["decode_ms"] / row["plugin"]["decode_ms"]
            row["plugin_speed_per_round"] = [statistics.median(r["stock"]["cases"][k]["decode_ms"])
                                             / statistics.median(r["plugin"]["cases"][k]["decode_ms"]) for r in rounds]
        cases.append(row)
    return {"decode_steps": TAIL_DECODE, "goal": TAIL_GOAL, "cases": cases}


def print_tail(tail, engines):
    cases = tail["cases"]
    timed = [row for row in cases if "skipped" not in row]
    both = bool(timed) and "plugin_speed" in timed[0]
    cols = ["B", "context"] + [f"{e} {what}" for what in ("ms/step", "tok/s", "prefill s") for e in engines]
    cols += ["plugin x stock", "per round"] if both else []
    print("\n| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    for row in cases:
        if "skipped" in row:
            print(f"| {row['b']} | {row['ctx']:,} | skipped: {row['skipped']} |" + " |" * (len(cols) - 3))
            continue
        cells = [str(row["b"]), f"{row['ctx']:,}"] + [
            f"{row[e][key]:{form}}" for key, form in (("decode_ms", ".3f"), ("decode_tokens_per_s", ",.0f"),
                                                      ("prefill_s", ".3f")) for e in engines]
        if both:
            cells += [f"{row['plugin_speed']:.3f}", ", ".join(f"{x:.3f}" for x in row["plugin_speed_per_round"])]
        print("| " + " | ".join(cells) + " |")
    if both:
        worst = min(timed, key=lambda row: row["plugin_speed"])
        met = sum(row["plugin_speed"] >= tail["goal"] for row in timed)
        print(f"\nplugin x stock: stock ms / plugin ms (> 1: the plugin decodes faster); goal >= {tail['goal']} at "
              f"every B and context (issue 26): {met} of {len(timed)} cases"
              f"{f' ({len(cases) - len(timed)} more skipped)' if len(timed) < len(cases) else ''}; lowest "
              f"{worst['plugin_speed']:.3f} (B={worst['b']}, context {worst['ctx']:,})")
    for row in timed:
        if "host_us" in row[engines[0]]:
            print_host_times(row, engines)


def print_host_times(row, engines):
    """One case's HostTimes medians: a function a line, an engine a column (us a decode step)."""
    names = dict.fromkeys(name for e in engines for name in row[e]["host_us"])
    print(f"\nhost us a decode step, B={row['b']} context {row['ctx']:,} (inclusive; engine in-process):")
    print(f"  {'function':<58}" + "".join(f"{e:>10}" for e in engines))
    for name in names:
        print(f"  {name:<58}" + "".join(f"{row[e]['host_us'].get(name, 0.0):>10.1f}" for e in engines))


def print_batch(results, rounds):
    if "stock" not in results:
        return
    base = results["stock"]
    if len(rounds) > 1 and "plugin" in results:
        print("per round, plugin / stock: " + ", ".join(
            f"{r['stock']['batch_s'] / r['plugin']['batch_s']:.3f}" for r in rounds))
    print(f"\n{'engine':<8}{'output tok/s':>14}{'batch s':>10}{'vs stock':>10}")
    for engine, r in results.items():
        print(f"{engine:<8}{r['tokens_per_s']:>14.0f}{r['batch_s']:>10.2f}"
              f"{r['tokens_per_s'] / base['tokens_per_s']:>10.3f}")
    if "plugin" in results and base["steps"] and results["plugin"]["steps"]:
        mine = results["plugin"]["steps"]
        print(f"\n{'unfinished requests':<20}{'stock s':>9}{'plugin s':>10}{'stock / plugin':>16}{'steps':>8}")
        for name, (sec, n) in base["steps"].items():
            if name in mine:
                print(f"{name:<20}{sec:>9.2f}{mine[name][0]:>10.2f}{sec / mine[name][0]:>16.3f}{n:>8.0f}")


def main(argv=None):
    args = parse_args(argv)
    if args.child:
        return run_child(args)
    import torch
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device"
    engines = args.engines.split(",")
    if args.tail:
        cases = tail_cases(args)
        print(f"[bench_vllm_gpu] {device}; decode tail: {len(cases)} cases (B, context) "
              f"{', '.join(f'{b}x{ctx}' for b, ctx in cases)}, {TAIL_DECODE} decode steps, {args.repeats} "
              f"repeats a process; engines {args.engines}", flush=True)
    else:
        print(f"[bench_vllm_gpu] {device}; {args.prompts} prompts x n={args.n} ({args.prompts * args.n} requests), "
              f"prompts ~{args.prompt_len} tokens, responses <= {args.max_response}; engines {args.engines}",
              flush=True)
    if args.logs:
        Path(args.logs).mkdir(parents=True, exist_ok=True)
    results, rounds, extra = {}, [], {}
    if args.profile:
        for engine in engines:
            t = time.time()
            r = results[engine] = run_engine(args, engine, f"{engine}-profile")
            r["wall_s"] = time.time() - t
            print_profile(engine, r)
    else:
        rounds = run_rounds(args, engines, _tail_note if args.tail else _batch_note)
        for engine in engines:
            runs = [r[engine] for r in rounds]
            results[engine] = {"engine": engine, "engine_start_s": statistics.median(r["engine_start_s"] for r in runs),
                               "wall_s": sum(r["wall_s"] for r in runs)}
            if not args.tail:
                results[engine].update(_pooled_batch(runs))
        if args.tail:
            extra["tail"] = tail_summary(rounds, engines)
            print_tail(extra["tail"], engines)
        else:
            print_batch(results, rounds)
    if args.json:
        Path(args.json).write_text(json.dumps({"device": device, "date": time.strftime("%Y-%m-%d %H:%M"),
                                               "args": {k: v for k, v in vars(args).items() if k != "child"},
                                               "results": results, "rounds": rounds, **extra}, indent=2) + "\n")


if __name__ == "__main__":
    main()
