"""The sampling step's contract log-probs as CUDA-graph replays, for the rollout's tail.

vLLM runs its sampler outside its CUDA graphs, so ContractLogProbs.apply's log-softmax (three
Triton launches and three allocations) is host work at every decode step: 190-275 us a step on
an H100 host (2026-12-05, bench_vllm_gpu --tail --host-times), where the whole step is 2-3 ms
and host-bound at B 1-16. Replaying one graph per row count instead costs three copies and a
replay. The graph runs the same launches (each row count's own lane groups and programs), so
the bits are those of co.log_softmax on the same rows.
"""
import torch

import consistent_ops as co

MAX_ROWS = 32       # row counts up to this replay graphs (the tail); larger batches are GPU-bound


class GraphedLogSoftmax:
    """co.log_softmax(logits, t, vocab_limit) of CUDA logits [n <= MAX_ROWS, V] and temperatures
    [n], by graph replays over persistent buffers: the inputs are copied in, the graph writes the
    first n rows of one output buffer (returned; valid until the next call). The first call captures
    every row count's graph, largest first, in one memory pool: each later capture reuses the
    largest's freed intermediates, so all of them hold ~3 row buffers of MAX_ROWS (60 MB at Qwen3's
    vocabulary; one pool block a row count, captured smallest first, would be 320 MB)."""

    def __init__(self, vocab_limit: int):
        self.vocab_limit, self.graphs = vocab_limit, {}
        self.z = self.t = self.out = self.pool = None

    def takes(self, logits: torch.Tensor) -> bool:
        return (logits.is_cuda and logits.dim() == 2 and 0 < logits.shape[0] <= MAX_ROWS
                and not torch.cuda.is_current_stream_capturing()
                and (self.z is None or (logits.shape[1:] == self.z.shape[1:] and logits.dtype == self.z.dtype
                                        and logits.device == self.z.device)))

    def __call__(self, logits: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        n = logits.shape[0]
        if self.z is None:
            self.z = torch.empty((MAX_ROWS, logits.shape[1]), dtype=logits.dtype, device=logits.device)
            self.t = torch.ones(MAX_ROWS, dtype=torch.float32, device=logits.device)
            self.out = torch.empty((MAX_ROWS, logits.shape[1]), dtype=torch.float32, device=logits.device)
            self.pool = torch.cuda.graph_pool_handle()
        self.z[:n].copy_(logits)
        self.t[:n].copy_(t)
        if not self.graphs:
            self.graphs = {rows: self._capture(rows) for rows in range(MAX_ROWS, 0, -1)}
        self.graphs[n].replay()
        return self.out[:n]

    def _step(self, n):
        self.out[:n].copy_(co.log_softmax(self.z[:n], self.t[:n], self.vocab_limit))

    def _capture(self, n):
        """Run once on a side stream (compiles what this row count launches), then capture."""
        side = torch.cuda.Stream(device=self.z.device)
        side.wait_stream(torch.cuda.current_stream(self.z.device))
        with torch.cuda.stream(side):
            self._step(n)
        torch.cuda.current_stream(self.z.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: work of other threads (none expected) does not break the capture
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            self._step(n)
        return graph
