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
        other = graphed(logits, t * 1.25).clone()                    # other temperatures, the same logits
        assert not torch.equal(other, got) and torch.equal(other, co.log_softmax(logits, t * 1.25, VLIM))
    assert sorted(graphed.graphs) == list(range(1, MAX_ROWS + 1))


def test_what_it_does_not_take_runs_eager():
    graphed = GraphedLogSoftmax(VLIM)
    assert not graphed.takes(torch.zeros(MAX_ROWS + 1, VOCAB, device="cuda"))
    assert not graphed.takes(torch.zeros(2, VOCAB))                               # CPU
    graphed(torch.zeros(2, VOCAB, device="cuda"), torch.ones(2, device="cuda"))
    assert not graphed.takes(torch.zeros(2, VOCAB - 16, device="cuda"))          # another vocabulary
    assert not graphed.takes(torch.zeros(2, VOCAB, device="cuda", dtype=torch.bfloat16))
    logits = torch.zeros(2, VOCAB, device="cuda")
    with torch.cuda.graph(torch.cuda.CUDAGraph()):                                # inside another capture
        assert not graphed.takes(logits)


def test_every_row_count_shares_one_output_buffer():
    """The first call captures every row count (largest first), and all of them hold one [MAX_ROWS, V]
    output and the pool of the largest one's intermediates: not one block a row count (~320 MB at
    Qwen3's vocabulary); a result is valid until the next call."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_reserved()
    graphed = GraphedLogSoftmax(VLIM)
    t = torch.ones(MAX_ROWS, device="cuda")
    for n in (1, 2, MAX_ROWS, 5):
        out = graphed(torch.randn(n, VOCAB, device="cuda"), t[:n])
        assert out.data_ptr() == graphed.out.data_ptr() and len(graphed.graphs) == MAX_ROWS
    assert torch.cuda.memory_reserved() - before < 5 * MAX_ROWS * VOCAB * 4
