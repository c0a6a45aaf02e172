"""Contraction, reduction and transcendental primitives of the reference backend.

Every rounding-sensitive step goes through here. Contractions and reductions are
done in fp64 and rounded ONCE to fp32: fp64 products of bf16/fp32 inputs are
exact, and the summation error is ~2^29 below an fp32 ulp, so the result does not
see the BLAS kernel's order, the batch shape or the thread count. Transcendentals
are evaluated in fp64 too because ATen's vectorised and scalar-tail fp32 paths
return different bits for the same input (seen for silu/sigmoid/rsqrt on CPU).
"""
import weakref

import torch
from torch.utils.weak import WeakIdKeyDictionary


def to64(x: torch.Tensor) -> torch.Tensor:
    """Exact widening to fp64."""
    return x.double()


def kept(cache, tensors, make):
    """make() (an fp64 copy derived from weight ``tensors``), kept in ``cache`` while each
    tensor is the same object at the same version, under inference mode only.

    At decode batch sizes, widening every weight on every call costs more than the
    matmuls. Inference mode is the rollout engine's: there, weights change only in place
    through ``load_weights``, which bumps the version counter (a write through ``.data``
    would not). Elsewhere, e.g. in training, where autograd needs the conversion in its
    graph and FSDP refills parameters without bumping versions, make() runs per call.
    Costs 4x the bf16 weight memory."""
    if not torch.is_inference_mode_enabled() or any(t.is_inference() for t in tensors):
        return make()                                   # inference tensors have no version
    state = [(t._version, t.data_ptr()) for t in tensors]
    hit = cache.get(tensors[0])
    if hit is None or hit[1] != state or not all(r() is t for r, t in zip(hit[0], tensors)):
        hit = cache[tensors[0]] = ([weakref.ref(t) for t in tensors], state, make())
    return hit[2]


_WEIGHTS64 = WeakIdKeyDictionary()    # weight -> (weakrefs, versions, fp64 copy); dies with it


def weight64(w: torch.Tensor) -> torch.Tensor:
    """to64(w), kept per weight version in the rollout (see ``kept``)."""
    return kept(_WEIGHTS64, (w,), lambda: to64(w))


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
