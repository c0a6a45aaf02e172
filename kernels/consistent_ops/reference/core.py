"""Contraction, reduction and transcendental primitives of the reference backend.

Every rounding-sensitive step goes through here. Contractions and reductions are
done in fp64 and rounded ONCE to fp32: fp64 products of bf16/fp32 inputs are
exact, and the summation error is ~2^29 below an fp32 ulp, so the result does not
see the BLAS kernel's order, the batch shape or the thread count. Transcendentals
are evaluated in fp64 too because ATen's vectorised and scalar-tail fp32 paths
return different bits for the same input (seen for silu/sigmoid/rsqrt on CPU).
"""
import torch
from torch.utils.weak import WeakIdKeyDictionary


def to64(x: torch.Tensor) -> torch.Tensor:
    """Exact widening to fp64."""
    return x.double()


# weight -> ((version, data_ptr), fp64 copy); entries die with their weight.
_WIDE_WEIGHTS = WeakIdKeyDictionary()


def weight64(w: torch.Tensor) -> torch.Tensor:
    """to64(w), kept per weight version under inference mode (the rollout engine's mode).

    At decode batch sizes, widening every weight on every call costs more than the
    matmuls. In the rollout, weights change only in place through ``load_weights``,
    which bumps the version counter (a write through ``.data`` would not). Elsewhere,
    e.g. in training, where autograd needs the conversion in its graph and FSDP refills
    parameters without bumping versions, the weight is widened per call. Costs 4x the
    bf16 weight memory."""
    if not torch.is_inference_mode_enabled() or w.is_inference():   # inference tensors have no version
        return to64(w)
    key = (w._version, w.data_ptr())
    hit = _WIDE_WEIGHTS.get(w)
    if hit is None or hit[0] != key:
        hit = _WIDE_WEIGHTS[w] = (key, to64(w))
    return hit[1]


def matmul32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b with fp64 accumulation, rounded once to fp32."""
    return torch.matmul(to64(a), to64(b)).float()


def sum32(x: torch.Tensor, dim: int, keepdim: bool = False) -> torch.Tensor:
    """Sum over ``dim`` in fp64, rounded once to fp32."""
    return to64(x).sum(dim, keepdim=keepdim).float()


def exp32(x: torch.Tensor) -> torch.Tensor:
    return torch.exp(x.double()).float()


def log32(x: torch.Tensor) -> torch.Tensor:
    return torch.log(x.double()).float()


def inv_sqrt32(x: torch.Tensor) -> torch.Tensor:
    """1/sqrt(x) from IEEE sqrt and division (never the rsqrt kernel)."""
    x = x.float()
    return 1.0 / torch.sqrt(x)
