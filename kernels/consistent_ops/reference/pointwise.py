"""Pointwise ops: RoPE, SiLU*mul, embedding."""
import math

import torch

from . import native
from .core import exp32, recording


_TABLES = {}        # repr((head_dim, theta, scaling)) -> (cos, sin) fp32 rows of positions 0 .. n-1, CPU
# Positions a table grows by: 256 x D/2 fp64 angles stay below ATen's parallel grain (32768), so a block's
# trig is one thread's vector loop over whole vectors, as a decode step's T x D/2 is.
ROPE_TABLE_BLOCK = 256


def rope_cos_sin(positions, head_dim, theta, scaling=None):
    """cos, sin [T, head_dim/2] fp32 for integer positions [T]; each row depends on its
    position alone (fp64 angles and trig, one rounding), never on the table length.
    ``scaling``: None (plain RoPE) or the resolved parameters of a scaled RoPE (contract "rope").
    The rollout (CPU, inference mode) gathers the rows from a table of every position seen so far,
    grown a block at a time by the same steps: a decode step's trig was ~60 us of Python and ATen."""
    if not (positions.is_cpu and torch.is_inference_mode_enabled()):
        return _cos_sin(positions, rope_inv_freq(head_dim, theta, scaling, positions.device), scaling)
    key = repr((head_dim, theta, scaling))
    table = _TABLES.get(key)
    need = int(positions.max()) + 1 if positions.numel() else 0
    if table is None or table[0].shape[0] < need:
        have = 0 if table is None else table[0].shape[0]
        grown = _cos_sin(torch.arange(have, -(-need // ROPE_TABLE_BLOCK) * ROPE_TABLE_BLOCK),
                         rope_inv_freq(head_dim, theta, scaling), scaling, ROPE_TABLE_BLOCK)
        table = _TABLES[key] = grown if table is None else tuple(torch.cat(p) for p in zip(table, grown))
    return table[0][positions], table[1][positions]


def _cos_sin(positions, inv_freq, scaling, block=None):
    """The contract's rows for positions, computed ``block`` positions at a time (None: at once)."""
    if block is not None and positions.shape[0] > block:
        parts = [_cos_sin(p, inv_freq, scaling) for p in positions.split(block)]
        return torch.cat([c for c, _ in parts]), torch.cat([s for _, s in parts])
    angles = positions.to(torch.float64).unsqueeze(1) * inv_freq
    cos, sin = torch.cos(angles), torch.sin(angles)
    if scaling and scaling.get("attention_factor", 1.0) != 1.0:
        cos, sin = cos * scaling["attention_factor"], sin * scaling["attention_factor"]
    return cos.float(), sin.float()


def rope_inv_freq(head_dim, theta, scaling=None, device=None):
    """[head_dim/2] fp64: theta^(-2i/d), then the scaling's frequency rule (transformers'
    _compute_{linear_scaling,yarn}_parameters, in fp64)."""
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64, device=device) / head_dim)
    kind = (scaling or {}).get("rope_type", "default")
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "yarn":
        low, high = _yarn_range(head_dim, theta, scaling)
        ramp = ((torch.arange(head_dim // 2, dtype=torch.float64, device=device) - low) / (high - low)).clamp(0, 1)
        extrapolate = 1 - ramp           # 1: the frequency kept, 0: divided by the factor
        return inv_freq / scaling["factor"] * (1 - extrapolate) + inv_freq * extrapolate
    raise NotImplementedError(f"rope_type={kind!r} is not in the contract; use default, linear or yarn")


def _yarn_range(d, theta, s):
    """The dimensions [low, high] between which YaRN ramps from extrapolation to interpolation."""
    dim = lambda rotations: d * math.log(s["original_max_position_embeddings"] / (rotations * 2 * math.pi)) / (
        2 * math.log(theta))
    low, high = dim(s["beta_fast"]), dim(s["beta_slow"])
    if s["truncate"]:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    return low, (high + 0.001 if low == high else high)     # transformers' guard against 0/0


def apply_rope(x, cos, sin):
    """Neox rotate-half on x [T, H, D] in fp32, rounded to x's dtype (on CPU without autograd the
    same steps in one native call)."""
    if (x.is_cpu and x.dtype in native.ACTIVATIONS and x.dim() == 3 and cos.shape == sin.shape
            == (x.shape[0], x.shape[2] // 2) and not recording(x, cos, sin)):
        return native.apply_rope(x, cos, sin)
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)


def silu_mul(gate, up):
    """On CPU in the fp32/bf16 realisations one native call (native.silu_mul: exp by the attention's
    polynomial, contract.CPU_ACCUMULATION "silu_mul"), with or without autograd, so the trainer and
    the rollout share it; elsewhere (and in the fp64 realisation) the torch steps below."""
    if (gate.is_cpu and gate.dtype in native.ACTIVATIONS and up.dtype == gate.dtype
            and native.accumulation() != "fp64"):
        return _NativeSiluMul.apply(gate, up) if recording(gate, up) else native.silu_mul(gate, up)
    return _silu_mul_torch(gate, up)


def _silu_mul_torch(gate, up):
    g = gate.float()
    act = g / (1.0 + exp32(-g))
    return (act * up.float()).to(gate.dtype)


class _NativeSiluMul(torch.autograd.Function):
    """Forward: native.silu_mul; backward: autograd through the torch steps (their exp differs from
    the polynomial in at most rare last bits of a value, not in the gradient's rule)."""

    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        return native.silu_mul(gate, up)

    @staticmethod
    def backward(ctx, grad):
        gate, up = (t.detach().requires_grad_() for t in ctx.saved_tensors)
        with torch.enable_grad():
            return torch.autograd.grad(_silu_mul_torch(gate, up), (gate, up), grad)


def embedding(ids, weight):
    return torch.nn.functional.embedding(ids, weight)
