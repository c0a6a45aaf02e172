"""Contraction, reduction and transcendental primitives of the reference backend.

Every rounding-sensitive step goes through here. Contractions and reductions are
done in fp64 and rounded ONCE to fp32: fp64 products of bf16/fp32 inputs are
exact, and the summation error is ~2^29 below an fp32 ulp, so the result does not
see the BLAS kernel's order, the batch shape or the thread count. Transcendentals
are evaluated in fp64 too because ATen's vectorised and scalar-tail fp32 paths
return different bits for the same input (seen for silu/sigmoid/rsqrt on CPU).
"""
import torch


def to64(x: torch.Tensor) -> torch.Tensor:
    """Exact widening to fp64; bf16/fp16 go through fp32 (also exact), which ATen does
    several times faster than its direct bf16 -> fp64 path."""
    if x.dtype in (torch.bfloat16, torch.float16):
        x = x.float()
    return x.double()


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
