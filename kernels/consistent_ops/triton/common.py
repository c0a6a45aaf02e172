"""Launch options shared by every kernel of this backend."""
import os

# Arithmetic compiles as written: no FMA contraction (a*b+c rounded once), so every
# compiled variant of a kernel (paged or not, 64 or 128 rows) rounds the contract's
# expression at the same steps.
EXACT = dict(enable_fp_fusion=False)

# CPU interpreter (TRITON_INTERPRET=1, CI): tl.dot is a numpy matmul whose rounding may
# depend on the block shape, so shape choices that are free on tensor cores are pinned.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
