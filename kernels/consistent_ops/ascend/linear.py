"""Linear on Ascend: CANN's batch-invariant matmul where it applies, else the Triton GEMM.

``npu_mm_batch_invariant`` (CANN batch_invariant_ops) returns the input dtype with no
bias: it serves the bf16-out, bias-free linears (every projection of Qwen3). fp32 outputs
(lm_head logits, router logits, TP partials) and biased linears take the Triton GEMM,
whose fp32 accumulator is rounded once as the contract says. Either way a row's bits
depend on the row alone; the Triton launch is chunked by rows (rows.py).
"""
import torch

from ..triton import gemm as _triton
from . import runtime
from .rows import MAX_PROGRAMS, chunked


def _row_limit(n):
    bm, bn = _triton._config(1, n)[:2]            # the one pinned tile on Ascend
    tiles_n = -(-n // bn)
    if tiles_n > MAX_PROGRAMS:
        raise ValueError(f"linear with N={n}: {tiles_n} column tiles exceed one launch ({MAX_PROGRAMS})")
    return (MAX_PROGRAMS // tiles_n) * bm


def _cann_mm(x2, weight):
    runtime.require(runtime.CANN_BATCH_INVARIANT)
    return torch.ops.batch_invariant_ops.npu_mm_batch_invariant(x2.contiguous(), weight.t().contiguous())


class _CannLinear(torch.autograd.Function):
    """Forward: CANN's invariant matmul. Backward: plain matmuls (gradients need accuracy only)."""

    @staticmethod
    def forward(ctx, x2, weight):
        ctx.save_for_backward(x2, weight)
        return _cann_mm(x2, weight)

    @staticmethod
    def backward(ctx, gy):
        x2, weight = ctx.saved_tensors
        return gy @ weight, gy.t() @ x2


def linear(x, weight, bias=None, out_dtype=None):
    x2 = x.reshape(-1, x.shape[-1])
    if bias is None and (out_dtype or x.dtype) == x.dtype == weight.dtype and runtime.use_cann_matmul():
        y = _CannLinear.apply(x2, weight)
    else:
        y = chunked(_triton.linear, _row_limit(weight.shape[0]), (x2,), weight, bias, out_dtype or x.dtype)
    return y.reshape(*x.shape[:-1], weight.shape[0])


def row_parallel_partial(x_shard, w_shard):
    """One rank's partial, fp32 (tp_partial_dtype): always the Triton GEMM (CANN's is bf16 out)."""
    return linear(x_shard, w_shard, out_dtype=torch.float32)
