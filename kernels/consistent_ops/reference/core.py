"""Contraction, reduction and transcendental primitives of the reference backend.

Every rounding-sensitive step goes through here. On CPU tensors a contraction runs in the
one fixed order of a native kernel (native.py: fp32 FMA lanes, dot32.c, or fp64 lanes,
dot64.c, per contract.CPU_ACCUMULATION), so a result never sees the batch shape, the
operand layout or the thread count; elsewhere fp64 products are summed by fp64 BLAS, whose
order does not reach the bits while the fp64 sum is exact (bf16 products), rounded ONCE to
fp32. Reductions are fp64 sums rounded once.
Transcendentals are evaluated in fp64 too because ATen's vectorised and scalar-tail fp32
paths return different bits for the same input (seen for silu/sigmoid/rsqrt on CPU).
"""
import weakref

import torch
from torch.utils.weak import WeakIdKeyDictionary

from . import native


def recording(*tensors) -> bool:
    """Whether autograd records an op on these tensors (then the torch steps, or a native
    forward with a torch backward, run instead of a plain native call)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def steps_backward(steps, tensors, needs, grad):
    """The backward of a native forward: gradients of steps(*tensors) (the torch steps it realises) for
    the tensors autograd asks for (needs: ctx.needs_input_grad's entries for them), None for the others."""
    with torch.enable_grad():
        leaves = [t.detach().requires_grad_(need) for t, need in zip(tensors, needs)]
        wanted = [t for t in leaves if t.requires_grad]
        grads = iter(torch.autograd.grad(steps(*leaves), wanted, grad))
    return tuple(next(grads) if t.requires_grad else None for t in leaves)


def to64(x: torch.Tensor) -> torch.Tensor:
    """Exact widening to fp64."""
    return x.double()


def kept(cache, tensors, make):
    """make() (a copy derived from weight ``tensors``, e.g. fp64), kept in
    ``cache`` while each tensor is the same object at the same version, under inference
    mode only.

    At decode batch sizes, rebuilding such copies on every call costs more than the
    matmuls. Inference mode is the rollout engine's: there, weights change only in place
    through ``load_weights``, which bumps the version counter (a write through ``.data``
    would not). Elsewhere, e.g. in training, where autograd needs the conversion in its
    graph and FSDP refills parameters without bumping versions, make() runs per call."""
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


class _Dot(torch.autograd.Function):
    """Forward: native.matmul (the contract's order); backward: fp64 matmuls, as
    autograd would give for torch.matmul(to64(a), to64(b)).float(). Outputs past ``rows``
    are constant zeros, so they pass no gradient."""

    @staticmethod
    def forward(ctx, a, b, rows, lanes):
        ctx.save_for_backward(a, b)
        ctx.rows = rows
        return native.matmul(a, b, rows, lanes)

    @staticmethod
    def backward(ctx, grad):
        a, b = ctx.saved_tensors
        g = grad.double() if ctx.rows is None else _first_rows(grad.double(), ctx.rows)
        ga = gb = None
        if ctx.needs_input_grad[0]:
            ga = (g @ to64(b).transpose(-1, -2)).sum_to_size(a.shape).to(a.dtype)
        if ctx.needs_input_grad[1]:
            gb = (to64(a).transpose(-1, -2) @ g).sum_to_size(b.shape).to(b.dtype)
        return ga, gb, None, None


def _first_rows(x, rows):
    """x [E, M, N] with every row past rows[e] set to 0."""
    return x * (torch.arange(x.shape[-2], device=x.device) < rows[:, None])[..., None]


def matmul32(a: torch.Tensor, b: torch.Tensor, rows=None, lanes=False) -> torch.Tensor:
    """a @ b -> fp32: on CPU the native kernel's fixed order (native.matmul); elsewhere fp64
    BLAS rounded once (the same bits whenever the fp64 sum is exact).
    rows [E] (a 3-D a of E entries): only the first rows[e] rows of entry e are computed,
    the others are 0 (padded MoE groups; on CPU an empty expert costs nothing).
    lanes: on CPU the fp32 realisation's lanes in the bf16 realisation too (native.matmul)."""
    if not a.is_cpu:
        out = torch.matmul(to64(a), to64(b)).float()
        return out if rows is None else _first_rows(out, rows)
    if recording(a, b):
        return _Dot.apply(a, b, rows, lanes)
    return native.matmul(a, b, rows, lanes)


def sum32(x: torch.Tensor, dim: int, keepdim: bool = False) -> torch.Tensor:
    """Sum over ``dim`` in fp64, rounded once to fp32."""
    return to64(x).sum(dim, keepdim=keepdim).float()


def exp32(x: torch.Tensor) -> torch.Tensor:
    return torch.exp(x.double()).float()


def log32(x: torch.Tensor) -> torch.Tensor:
    return torch.log(x.double()).float()


class _InvSqrt(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        y = native.inv_sqrt(x)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, grad):
        y, = ctx.saved_tensors
        return grad * -0.5 * y * y * y


def inv_sqrt32(x: torch.Tensor) -> torch.Tensor:
    """1/sqrt(x) in fp32 from IEEE sqrt and division (never the rsqrt kernel). On CPU in
    native code: torch's CPU sqrt is not correctly rounded (seen: last-bit differences
    from sqrtf), and the fused native RMSNorm must produce the same bits."""
    x = x.float()
    if not x.is_cpu:
        return 1.0 / torch.sqrt(x)
    return _InvSqrt.apply(x) if recording(x) else native.inv_sqrt(x)
