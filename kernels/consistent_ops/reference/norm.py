"""RMSNorm (with the fused residual add the decoder layers use).

The torch steps below are the spec, and what autograd records; inference on CPU runs
the same steps in one native call (native.rms_norm: every step an IEEE fp32 operation
rounded as torch rounds it, and the sum of squares is the same contract dot), so both
give the same bits."""
from . import native
from .core import inv_sqrt32, matmul32, recording


def _native(x, residual, weight):
    return (x.is_cpu and x.dtype in native.ACTIVATIONS
            and (residual is None or residual.dtype == x.dtype)
            and not recording(x, residual, weight))


def rms_norm(x, weight, eps):
    if _native(x, None, weight):
        return native.rms_norm(x, weight, eps)
    # contract dot(x, x) in the fp32 lanes (the bf16 realisation's reductions too, as native.rms_norm)
    var = matmul32(x.unsqueeze(-2), x.unsqueeze(-1), lanes=True).squeeze(-1) / x.shape[-1]
    y = (x.float() * inv_sqrt32(var + eps)).to(x.dtype)
    return y * weight.to(x.dtype)


def add_rms_norm(x, residual, weight, eps):
    """residual' = x + residual in the activation dtype; returns (rms_norm(residual'), residual')."""
    if residual is not None and _native(x, residual, weight):
        return native.rms_norm(x, weight, eps, residual)
    residual = x if residual is None else x + residual
    return rms_norm(residual, weight, eps), residual
