"""RMSNorm (with the fused residual add the decoder layers use)."""
from .core import inv_sqrt32, sum32


def rms_norm(x, weight, eps):
    x32 = x.float()
    var = sum32(x.double().square(), -1, keepdim=True) / x.shape[-1]
    y = (x32 * inv_sqrt32(var + eps)).to(x.dtype)
    return y * weight.to(x.dtype)


def add_rms_norm(x, residual, weight, eps):
    """residual' = x + residual in the activation dtype; returns (rms_norm(residual'), residual')."""
    residual = x if residual is None else x + residual
    return rms_norm(residual, weight, eps), residual
