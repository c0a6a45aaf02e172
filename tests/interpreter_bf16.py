"""Three gaps of the numpy Triton interpreter, patched for every test that runs kernels on it."""
import numpy as np
import torch
import triton.language as tl
import triton.runtime.interpreter as interp


def fix_interpreter_bf16():
    """Three gaps of the numpy interpreter (triton 3.9), not of the GPU backend: tl.dot
    multiplies the raw uint16 storage of bf16 operands; its numpy matmul (OpenBLAS) rounds an
    element differently by where its row sits in the tile (seen on 1 in 3 random 64 x 64 tiles),
    where an MMA's element depends on its own row and column alone; and fp32 -> bf16 casts
    truncate instead of rounding to nearest even. Patch all three to the GPU's semantics (the
    dot: products in fp32, added onto the accumulator in ascending k, the same for every element)."""
    builder = interp.InterpreterBuilder
    if getattr(builder, "_cops_fixed", False):
        return
    dot, cast = builder.create_dot, builder.cast_impl

    def as_f32(h):
        if h.dtype.scalar != tl.bfloat16:
            return h
        data = interp._convert_float(h.data, tl.bfloat16, tl.float32, None).view(np.float32)
        return interp.TensorHandle(data, tl.float32)

    def create_dot(self, a, b, d, precision, max_imprecise):
        a, b = as_f32(a), as_f32(b)
        if a.dtype.scalar != tl.float32 or b.dtype.scalar != tl.float32 or d.dtype.scalar != tl.float32:
            return dot(self, a, b, d, precision, max_imprecise)
        acc = d.data.copy()
        for k in range(a.data.shape[-1]):
            acc += a.data[..., :, k:k + 1] * b.data[..., k:k + 1, :]
        return interp.TensorHandle(acc, d.dtype.scalar)

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            t = torch.from_numpy(np.ascontiguousarray(src.data)).to(torch.bfloat16)
            return interp.TensorHandle(t.view(torch.int16).numpy().view(np.uint16), dst_type.scalar)
        return cast(self, src, dst_type)

    builder.create_dot, builder.cast_impl, builder._cops_fixed = create_dot, cast_impl, True
