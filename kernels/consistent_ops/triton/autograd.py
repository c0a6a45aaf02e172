"""Gradients for ops whose forward is a Triton kernel and whose backward needs no kernel.

The forward's bits are the contract's; gradients are never compared with the rollout,
so the backward is autograd of an equivalent PyTorch formula, recomputed from the saved
inputs (accurate and deterministic, cheap next to the matmuls and attention).
"""
import torch


class _Recompute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, kernel, formula, static, *tensors):
        ctx.formula, ctx.static = formula, static
        ctx.save_for_backward(*tensors)
        out = kernel(*tensors, **static)
        for o in (out if isinstance(out, tuple) else (out,)):
            if not o.is_floating_point():
                ctx.mark_non_differentiable(o)
        return out

    @staticmethod
    def backward(ctx, *grads):
        inputs = [t.detach().requires_grad_(need) if t is not None else None
                  for t, need in zip(ctx.saved_tensors, ctx.needs_input_grad[3:])]
        with torch.enable_grad():
            outs = ctx.formula(*inputs, **ctx.static)
        outs = outs if isinstance(outs, tuple) else (outs,)
        pairs = [(o, g) for o, g in zip(outs, grads) if g is not None and o.requires_grad]
        wanted = [t for t in inputs if t is not None and t.requires_grad]
        got = iter(torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs],
                                       allow_unused=True) if pairs and wanted else [None] * len(wanted))
        return (None, None, None, *[next(got) if t is not None and t.requires_grad else None
                                    for t in inputs])


def needs_grad(*tensors):
    """Whether autograd records an op on these tensors (None entries ignored)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def with_torch_grad(kernel, formula, tensors, **static):
    """kernel(*tensors, **static) in forward; formula (same signature, differentiable
    PyTorch) supplies the gradient. Without autograd the kernel runs bare."""
    if needs_grad(*tensors):
        return _Recompute.apply(kernel, formula, static, *tensors)
    return kernel(*tensors, **static)
