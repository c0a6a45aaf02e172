"""The plugin's V1 logits processor on a CUDA device (needs vLLM importable: after
scripts/h200_vllm_env.sh): a step that rebuilds the row settings (batch changed, seeded rows,
truncation) synchronises nothing, so vLLM's async scheduling keeps the GPU fed; the rows stay
the contract's. The companion: the copy it replaced (torch.tensor(..., device=cuda)) is
flagged by the same sync check."""
import contextlib

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("triton")
pytest.importorskip("vllm", reason="vLLM is not importable here (scripts/h200_vllm_env.sh)")

import consistent_ops as co  # noqa: E402
from true_on_policy import scheme  # noqa: E402
from true_on_policy.vllm import sampling  # noqa: E402
from true_on_policy.vllm import logprob_graphs  # noqa: E402
from true_on_policy.vllm.logprob_graphs import GraphedLogSoftmax  # noqa: E402
from vllm.v1.sample.logits_processor import BatchUpdate  # noqa: E402

co.set_backend("triton")
VLIM = 1000


def _processor():
    proc = object.__new__(sampling.ContractLogProbs)
    proc.vocab_limit, proc.temperature, proc.truncation, proc.seeded, proc.rows = VLIM, {}, {}, {}, None
    proc.graphed = GraphedLogSoftmax(VLIM)
    return proc


@contextlib.contextmanager
def _a_sync_raises():
    """Any host-device synchronisation inside is a RuntimeError (torch's sync debug mode)."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_row_rebuild_synchronises_nothing_and_rows_stay_the_contracts():
    proc, logits = _processor(), torch.randn(3, 1024, device="cuda") * 3
    key = {scheme.SEED_KEY: [1, 2, 3, 4, 0]}
    added = [(0, sampling.sampling_params(0.7), [1], []), (1, sampling.sampling_params(1.3, top_k=20), [1], []),
             (2, sampling.sampling_params(0.7, logprobs=0, extra_args=key), [1, 2], [5])]
    proc.update_state(BatchUpdate(3, removed=[], added=added, moved=[]))
    with _a_sync_raises():
        out = proc.apply(logits.clone())
    assert torch.equal(out[0], co.log_softmax(logits[:1], 0.7, VLIM)[0])
    with pytest.raises(RuntimeError, match="synchroniz"), _a_sync_raises():   # the companion: a blocking copy
        torch.tensor([0.7, 1.3], device="cuda")


def test_a_tail_step_replays_a_graph_that_synchronises_nothing():
    """Rows neither seeded nor truncated, few of them: apply replays the row count's graph (every row
    count's captured at the first step), synchronising nothing, and the rows are the contract's."""
    proc = _processor()
    proc.update_state(BatchUpdate(2, removed=[], added=[(0, sampling.sampling_params(0.7), [1], []),
                                                        (1, sampling.sampling_params(1.0), [1], [])], moved=[]))
    proc.apply(torch.randn(2, 1024, device="cuda"))                   # the captures
    logits = torch.randn(2, 1024, device="cuda") * 3
    with _a_sync_raises():
        out = proc.apply(logits.clone())
    assert len(proc.graphed.graphs) == logprob_graphs.MAX_ROWS          # all captured at the first step
    assert torch.equal(out, co.log_softmax(logits, torch.tensor([0.7, 1.0], device="cuda"), VLIM))
