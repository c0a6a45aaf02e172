"""The sampling step's contract log-probs as CUDA-graph replays, for the rollout's tail.

vLLM runs its sampler outside its CUDA graphs, so ContractLogProbs.apply's log-softmax (three
Triton launches and three allocations) is host work at every decode step: 190-275 us a step on
an H100 host (2026-12-05, bench_vllm_gpu --tail --host-times), where the whole step is 2-3 ms
and host-bound at B 1-16. Replaying one graph per row count instead costs two copies and a
replay. The graph runs the same launches (each row count's own lane groups and programs), so
the bits are those of co.log_softmax on the same rows.
"""
import torch

import consistent_ops as co

MAX_ROWS = 32       # row counts up to this replay graphs (the tail); larger batches are GPU-bound


class GraphedLogSoftmax:
    """co.log_softmax(logits, t, vocab_limit) of fp32 CUDA logits [n <= MAX_ROWS, V], by graph
    replays over persistent buffers (logits and temperatures in; the output is the graph's, valid
    until the next call). A graph is captured at a row count's first call."""

    def __init__(self, vocab_limit: int):
        self.vocab_limit, self.graphs, self.z, self.t, self.t_source = vocab_limit, {}, None, None, None
        self.pool = None

    def takes(self, logits: torch.Tensor) -> bool:
        return (logits.is_cuda and logits.dtype == torch.float32 and logits.dim() == 2
                and 0 < logits.shape[0] <= MAX_ROWS and logits.stride(-1) == 1
                and (self.z is None or (logits.shape[1] == self.z.shape[1] and logits.device == self.z.device)))

    def __call__(self, logits: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        n = logits.shape[0]
        if self.z is None:
            self.z = torch.empty(MAX_ROWS, logits.shape[1], dtype=torch.float32, device=logits.device)
            self.t = torch.ones(MAX_ROWS, dtype=torch.float32, device=logits.device)
            self.pool = torch.cuda.graph_pool_handle()
        if t is not self.t_source:           # new per-row temperatures only when the batch changed
            self.t[:n].copy_(t)
            self.t_source = t
        self.z[:n].copy_(logits)
        if n not in self.graphs:
            self.graphs[n] = self._capture(n)
        graph, out = self.graphs[n]
        graph.replay()
        return out

    def _capture(self, n):
        """Run once on a side stream (compiles what this row count launches), then capture."""
        z, t = self.z[:n], self.t[:n]
        side = torch.cuda.Stream(device=z.device)
        side.wait_stream(torch.cuda.current_stream(z.device))
        with torch.cuda.stream(side):
            co.log_softmax(z, t, self.vocab_limit)
        torch.cuda.current_stream(z.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: vLLM's output-copy stream may be used by this thread's work around the capture
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            out = co.log_softmax(z, t, self.vocab_limit)
        return graph, out
