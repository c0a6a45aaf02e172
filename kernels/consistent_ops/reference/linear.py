"""Batch-invariant linear and its tensor-parallel row-parallel form."""
import torch

from . import native
from .core import matmul32, recording, to64, weight64


def linear(x, weight, bias=None, out_dtype=None):
    """x [..., K] @ weight[N, K].T: each output is one fp64 dot product rounded once,
    so a row's bits never depend on the other rows in the call or the thread count."""
    out = matmul32(x, weight.t())
    if bias is not None:
        out = out + bias.float()
    dtype = out_dtype or x.dtype
    return out if out.dtype == dtype else out.to(dtype)    # (.to of the same dtype costs ~2 us)


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


def _fusable(x, *tensors):
    """Whether a fused native call runs for these operands: CPU inference in the fp32/bf16
    realisations, a 2-D x and every tensor of x's ACTIVATIONS dtype."""
    return (x.is_cpu and x.dim() == 2 and x.dtype in native.ACTIVATIONS
            and all(t.dtype == x.dtype for t in tensors) and native.accumulation() != "fp64"
            and not recording(x, *tensors))


def attention_prologue(x, wq, wk, wv, q_norm, k_norm, eps, cos, sin, head_dim):
    """consistent_ops.attention_prologue in one native call where _fusable: the same kernels as
    linear, rms_norm and apply_rope one by one (the same bits); None elsewhere (the caller runs those ops)."""
    if (not _fusable(x, wq, wk, wv, q_norm, k_norm) or cos.shape != sin.shape
            or cos.shape != (x.shape[0], head_dim // 2) or recording(cos, sin)):
        return None
    return native.attention_prologue(x, wq, wk, wv, q_norm, k_norm, eps, cos.float(), sin.float(), head_dim)


def linear_add_rms_norm(x, weight, residual, norm_weight, eps):
    """consistent_ops.linear_add_rms_norm in one native call where _fusable: the kernels of linear and
    add_rms_norm one by one (the same bits); None elsewhere."""
    if not _fusable(x, weight, residual, norm_weight) or residual.shape != (x.shape[0], weight.shape[0]):
        return None
    return native.linear_add_rms_norm(x, weight, residual, norm_weight, eps)


def mlp(x, gate, up, down):
    """consistent_ops.mlp in one native call where _fusable: the kernels of linear and silu_mul one by
    one (the same bits); None elsewhere."""
    if not _fusable(x, gate, up, down) or gate.shape != up.shape or down.shape != gate.shape[::-1]:
        return None
    return native.mlp(x, gate, up, down)
