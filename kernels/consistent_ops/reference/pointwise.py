"""Pointwise ops: RoPE, SiLU*mul, embedding."""
import torch

from .core import exp32


def rope_cos_sin(positions, head_dim, theta):
    """cos, sin [T, head_dim/2] fp32 for integer positions [T]; each row depends on its
    position alone (fp64 angles and trig, one rounding), never on the table length."""
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64, device=positions.device) / head_dim)
    angles = positions.to(torch.float64)[:, None] * inv_freq[None, :]
    return torch.cos(angles).float(), torch.sin(angles).float()


def apply_rope(x, cos, sin):
    """Neox rotate-half on x [T, H, D] in fp32, rounded to x's dtype."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)


def silu_mul(gate, up):
    g = gate.float()
    act = g / (1.0 + exp32(-g))
    return (act * up.float()).to(gate.dtype)


def embedding(ids, weight):
    return torch.nn.functional.embedding(ids, weight)
