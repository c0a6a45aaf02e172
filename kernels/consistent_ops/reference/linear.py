"""Batch-invariant linear and its tensor-parallel row-parallel form."""
import torch

from .core import matmul32, to64, weight64


def linear(x, weight, bias=None, out_dtype=None):
    """x [..., K] @ weight[N, K].T: each output is one fp64 dot product rounded once,
    so a row's bits never depend on the other rows in the call or the thread count."""
    out = matmul32(x, weight.t())
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype or x.dtype)


def row_parallel_partial(x_shard, w_shard):
    """One rank's partial product over its K-shard, in the contract's partial dtype (fp64)."""
    return torch.matmul(to64(x_shard), weight64(w_shard).t())


def ordered_sum(partials):
    """Sum partials in rank order 0..k-1 (left fold), never a tree or a backend reduce."""
    total = partials[0]
    for part in partials[1:]:
        total = total + part
    return total


def finish_row_parallel(total, bias=None, out_dtype=torch.bfloat16):
    """Round the ordered sum once to fp32, add bias in fp32, then round to out dtype."""
    out = total.float()
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)
