"""The rollout's tail log-probs as CUDA-graph replays (true_on_policy.vllm.logprob_graphs; no vLLM
needed): every row count's replays give co.log_softmax's bits on the same rows, whatever came
before (other row counts, other temperatures, new logits); the companion: rows at another
temperature differ, so the replay does read the temperatures it is given."""
import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("triton")

import consistent_ops as co  # noqa: E402
from true_on_policy.vllm.logprob_graphs import MAX_ROWS, GraphedLogSoftmax  # noqa: E402

co.set_backend("triton")
VOCAB, VLIM = 151936, 151669          # Qwen3's padded vocabulary and its tokenizer's length


def test_replays_equal_the_eager_log_softmax_bitwise():
    graphed = GraphedLogSoftmax(VLIM)
    g = torch.Generator(device="cuda").manual_seed(3)
    for step, n in enumerate((1, 4, 16, MAX_ROWS, 4, 1, 7, 4)):
        logits = torch.randn(n, VOCAB, generator=g, device="cuda") * 4
        t = torch.rand(n, generator=g, device="cuda") + 0.5
        assert graphed.takes(logits)
        got = graphed(logits, t).clone()
        assert torch.equal(got, co.log_softmax(logits, t, VLIM)), (step, n)
        assert torch.isneginf(got[:, VLIM:]).all()
        other = graphed(logits, t * 1.25).clone()                    # new temperatures (a new tensor)
        assert not torch.equal(other, got) and torch.equal(other, co.log_softmax(logits, t * 1.25, VLIM))
    assert sorted(graphed.graphs) == [1, 4, 7, 16, MAX_ROWS]


def test_what_it_does_not_take_runs_eager():
    graphed = GraphedLogSoftmax(VLIM)
    assert not graphed.takes(torch.zeros(MAX_ROWS + 1, VOCAB, device="cuda"))
    assert not graphed.takes(torch.zeros(2, VOCAB))                               # CPU
    assert not graphed.takes(torch.zeros(2, VOCAB, device="cuda", dtype=torch.bfloat16))
    graphed(torch.zeros(2, VOCAB, device="cuda"), torch.ones(2, device="cuda"))
    assert not graphed.takes(torch.zeros(2, VOCAB - 16, device="cuda"))          # another vocabulary
