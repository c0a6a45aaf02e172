"""python -m true_on_policy.check: is the rollout's log-prob the trainer's, token by token?

Starts vLLM (with the true_on_policy plugin, or stock with --stock) in a child
process, generates, recomputes every generated token's log-prob with the trainer's
model in this process, compares them bitwise, prints a summary table and exits 1
on any difference (2 on a configuration error, before any engine starts).

    python -m true_on_policy.check --tp 2 --temperature 0.7 --max-num-batched-tokens 64 \\
        --enable-prefix-caching --json out.json            # exact: max |d| == 0
    python -m true_on_policy.check --stock                  # the stock gap, for reference
    python -m true_on_policy.check --localize ...           # on a mismatch: first diverging op;
                                                            # MoE: routing agreement per layer

Without --model a tiny random Qwen3-MoE is built (once) in a cache directory.
"""
import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from true_on_policy import scheme, truncation
from true_on_policy.check.prompts import make_prompts
from true_on_policy.check.report import compare_phases, plugin_log, print_summary, summary_json

DEFAULT_CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "true_on_policy"


def say(msg):
    print(f"[check] {msg}", flush=True)


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m true_on_policy.check", description=__doc__.split("\n")[0])
    p.add_argument("--model", help="HF checkpoint dir (default: a tiny Qwen3-MoE in the cache dir)")
    p.add_argument("--arch", default="qwen3_moe", choices=["qwen3", "qwen3_moe"],
                   help="architecture of the default tiny model (ignored with --model)")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=1.0, help="rollout temperature (0 = greedy)")
    p.add_argument("--top-k", type=int, default=0, help="the contract's top-k (0 or -1: off)")
    p.add_argument("--top-p", type=float, default=1.0, help="the contract's top-p (1: off)")
    p.add_argument("--min-p", type=float, default=0.0, help="the contract's min-p (0: off)")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--enable-prefix-caching", action="store_true")
    p.add_argument("--json", help="write the summary as JSON here")
    p.add_argument("--stock", action="store_true", help="both sides without the plugin: the baseline gap")
    p.add_argument("--localize", action="store_true", help="on a mismatch, name the first diverging op; for MoE also the "
                   "rollout/trainer routing agreement (top-k expert sets), per layer")
    p.add_argument("--block-size", type=int, default=32, help="KV-cache page size (tokens)")
    p.add_argument("--cuda-graphs", action="store_true", help="vLLM with CUDA graphs, as a GPU job runs it "
                   "(the plugin: scheme.CUDA_GRAPHS, FULL; --stock: vLLM's defaults); default: eager")
    p.add_argument("--update-weights-from", help="after generating, load this checkpoint's weights in "
                   "place (full fp32 tensors, as verl syncs them) and generate again")
    p.add_argument("--workdir", help="keep intermediate files here (default: a temp dir)")
    p.add_argument("--cache-dir", default=str(DEFAULT_CACHE))
    a = p.parse_args(argv)
    for flag, value, ok, fix in (
            ("--prompts", a.prompts, a.prompts >= 1, "use 1 or more"),
            ("--max-tokens", a.max_tokens, a.max_tokens >= 1, "use 1 or more"),
            ("--tp", a.tp, a.tp >= 1, "use 1 or more"),
            ("--temperature", a.temperature, not scheme.sampling_problems({"temperature": a.temperature}),
             "use a finite number >= 0 (0 = greedy)")):
        if not ok:
            fail(f"{flag} {value}: {fix}")
    truncation_errors(a)
    if a.cuda_graphs and a.localize:
        fail("--cuda-graphs with --localize: the op hooks need eager modules; drop one of them")
    if a.cuda_graphs and not torch.cuda.is_available():
        fail("--cuda-graphs: no CUDA GPU in this process; drop the flag (CPU and eager runs check the same math)")
    return a


def fail(msg):
    """A configuration error: one line on stderr, exit 2, before any engine starts."""
    print(f"error: {msg}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def truncation_errors(a):
    for problem in truncation.problems(a.top_k, a.top_p, a.min_p):
        fail("--" + problem.replace("_", "-", 1).replace("=", " ", 1))


def resolve_model(args):
    if args.model:
        return str(Path(args.model).resolve())
    from true_on_policy.make_tiny_model import ensure_tiny_model
    return str(ensure_tiny_model(args.cache_dir, args.arch))


def preflight(model_dir, tp):
    """Configuration errors before any engine starts (exit 2); returns the vocab limit."""
    from true_on_policy.models import ModelConfig
    path = Path(model_dir)
    if not path.is_dir():
        fail(f"--model {model_dir}: no such directory; pass a HF checkpoint directory")
    if not (path / "config.json").is_file():
        fail(f"--model {model_dir} has no config.json; pass a HF checkpoint directory (config.json, "
             f"*.safetensors, tokenizer files)")
    try:
        cfg = ModelConfig.from_dir(path)
    except KeyError as err:
        fail(f"--model {model_dir}: config.json has no {err} entry; pass a Qwen3 / Qwen3-MoE checkpoint")
    except (NotImplementedError, ValueError) as err:
        fail(f"--model {model_dir}: {err}")
    problems = scheme.tp_problems(cfg, tp)
    if problems:
        fail("; ".join(problems))
    try:
        import consistent_ops as co
        co.set_backend()
    except (ValueError, NotImplementedError, ImportError, RuntimeError) as err:
        fail(f"{err}")
    from transformers import AutoTokenizer
    try:
        tok = AutoTokenizer.from_pretrained(model_dir)
    except (OSError, ValueError) as err:
        fail(f"--model {model_dir}: no tokenizer could be loaded ({str(err).splitlines()[0]}); put the "
             f"model's tokenizer files beside the weights")
    try:
        scheme.vocab_limit(len(tok), cfg.vocab_size)
    except ValueError as err:
        fail(f"--model {model_dir}: {err}")
    return tok


def is_moe(model_dir):
    from true_on_policy.models import ModelConfig
    return bool(ModelConfig.from_dir(model_dir).moe_layers)


def child_env(args):
    env = dict(os.environ, VLLM_ALLOW_INSECURE_SERIALIZATION="1")   # apply_model for --localize
    env.pop("TRUE_ON_POLICY", None)
    if not args.stock:
        env["TRUE_ON_POLICY"] = "1"
    if args.tp > 1 and "VLLM_CPU_OMP_THREADS_BIND" not in env:
        env["VLLM_CPU_OMP_THREADS_BIND"] = scheme.cpu_threads_bind(args.tp)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    return env


# Errors that only report that something else failed (vLLM's engine core, its workers).
_WRAPPERS = ("EngineDeadError", "Engine core initialization failed", "WorkerProc initialization failed",
             "See root cause above", "EngineCore failed to start")
_ERROR = re.compile(r"\b([A-Za-z_][\w.]*(?:Error|Exception)): (.+)")


def root_cause(lines):
    """The first error line of a vLLM log that is not a wrapper of another one (a worker's
    own exception, not the engine's "initialization failed"), or None."""
    for line in lines:
        m = _ERROR.search(line)
        if m and not any(w in line for w in _WRAPPERS):
            return f"{m.group(1)}: {m.group(2)}"
    return None


class Rollout:
    """The vLLM child process: generation, then capture commands over stdin."""

    def __init__(self, plan_path, env, log_path):
        self.log_path, self.log = log_path, open(log_path, "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "true_on_policy.check.rollout", str(plan_path)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
                                     stderr=subprocess.STDOUT)

    def wait_for(self, marker):
        """Relay progress lines, log everything else, return the payload of ``marker``."""
        for line in self.proc.stdout:
            if line.startswith(marker):
                return line[len(marker):].strip()
            if line.startswith("[rollout]"):
                print(line, end="", flush=True)
            self.log.write(line)
            self.log.flush()
        self.fail()

    def send(self, cmd):
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def fail(self):
        self.proc.wait()
        lines = Path(self.log_path).read_text().splitlines()
        cause = root_cause(lines)
        print("\n".join(lines[-40:] + [f"error: the vLLM process failed: {cause or 'see ' + str(self.log_path)}"]),
              file=sys.stderr)
        raise SystemExit(3)

    def close(self):
        """Ask the child to quit (it shuts vLLM down cleanly); kill it if it does not."""
        if self.proc.poll() is None:
            try:
                self.send({"cmd": "quit"})
                self.proc.stdin.close()
                self.proc.wait(timeout=120)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
        self.log.close()


def write_plan(args, model_dir, prompts, workdir):
    longest = max(len(p) for p in prompts) + args.max_tokens
    if args.cuda_graphs:    # vLLM's capture warm-up runs requests as long as the largest graph
        longest = max(longest, scheme.CUDA_GRAPHS["max_cudagraph_capture_size"])
    plan = dict(model=model_dir, tp=args.tp, seed=args.seed, temperature=args.temperature,
                truncation=truncation.of_settings(args),
                max_tokens=args.max_tokens, max_num_batched_tokens=args.max_num_batched_tokens,
                enable_prefix_caching=args.enable_prefix_caching, block_size=args.block_size,
                cuda_graphs=args.cuda_graphs,
                max_model_len=-(-longest // 256) * 256, kv_cache_bytes=512 << 20, stock=args.stock,
                update_weights_from=args.update_weights_from and str(Path(args.update_weights_from).resolve()),
                prompts=prompts, workdir=str(workdir))
    path = Path(workdir) / "plan.json"
    path.write_text(json.dumps(plan))
    return plan, path


def recompute(args, phases, vocab_limit, cut="rollout's"):
    """The trainer's log-probs per phase; ``cut``: the truncation it applies (default: the
    rollout's; None: untruncated, what a trainer unaware of the rollout's truncation scores)."""
    from true_on_policy.check import trainer as tr
    out, t = [], scheme.logprob_temperature(args.temperature)
    cut = truncation.of_settings(args) if cut == "rollout's" else cut
    for phase in phases:
        if args.stock:
            out.append(tr.stock_logprobs(phase["weights"], phase["sequences"], t))
        else:
            out.append(tr.consistent_logprobs(phase["weights"], phase["sequences"], t, args.tp, vocab_limit,
                                              scheme.ROLLOUT_DTYPE, cut))
    return out


def untruncated_gap(args, phases, vocab_limit):
    """With truncation on: how far the trainer's UNtruncated log-probs are from the rollout's
    (the gap exact truncation removes); JSON keys untruncated_*."""
    if args.stock or truncation.of_settings(args) is None:
        return {}
    total = compare_phases(phases, recompute(args, phases, vocab_limit, cut=None))["total"]
    return {f"untruncated_{k}": total[k] for k in ("max_abs_logdiff", "mean_abs_logdiff", "frac_exact")}


def main(argv=None):
    args = parse_args(argv)
    t0 = time.time()
    model_dir = resolve_model(args)
    tok = preflight(model_dir, args.tp)
    prompts = make_prompts(tok, args.prompts, args.seed)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="true-on-policy-check-"))
    workdir.mkdir(parents=True, exist_ok=True)
    plan, plan_path = write_plan(args, model_dir, prompts, workdir)
    say(f"model {model_dir}; {len(prompts)} prompts ({min(map(len, prompts))}..{max(map(len, prompts))} "
        f"tokens); logs in {workdir}")
    rollout = Rollout(plan_path, child_env(args), workdir / "vllm.log")
    try:
        result = torch.load(rollout.wait_for("@@done"))
        say("recomputing with the trainer's model" + (" (stock HF)" if args.stock else ""))
        t1 = time.time()
        trainer = recompute(args, result["phases"], len(tok))
        stats = compare_phases(result["phases"], trainer)
        gap = untruncated_gap(args, result["phases"], len(tok))
        say(f"recomputed in {time.time() - t1:.1f}s")
        localize = None
        if args.localize and stats["first_mismatch"] is not None:
            from true_on_policy.check.localize import localize_mismatch
            localize = localize_mismatch(args, rollout, result, stats, workdir, len(tok))
        elif args.localize and is_moe(model_dir):
            from true_on_policy.check.localize import localize_exact
            localize = localize_exact(args, rollout, result, workdir)
    finally:
        rollout.close()
    log = plugin_log((workdir / "vllm.log").read_text(errors="replace").splitlines())
    summary = {**summary_json(args, plan, model_dir, result, stats, localize, time.time() - t0, log), **gap}
    print_summary(summary)
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2) + "\n")
    return 0 if summary["num_exact"] == summary["num_tokens"] else 1
