"""Pointwise and data-movement ops: the reference's PyTorch code, run on the device.

Bitwise-safe on CUDA: an elementwise kernel applies the same scalar code to every
element (vectorised loads change memory access, not arithmetic; there is no separate
scalar tail path as on CPU), so a token's bits never depend on the batch. The
contract's fp64 transcendentals (exp in silu, cos/sin in RoPE) are kept as written.
Row-parallel partial sums are combined by elementwise adds in rank order (no
reduction kernel). Each of these captures in a CUDA graph (no host syncs).
"""
from ..reference.linear import finish_row_parallel, ordered_sum
from ..reference.pointwise import embedding, rope_cos_sin, silu_mul

__all__ = ["embedding", "finish_row_parallel", "ordered_sum", "rope_cos_sin",
           "silu_mul"]
