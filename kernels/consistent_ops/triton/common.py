"""Launch options shared by every kernel of this backend."""

# Arithmetic compiles as written: no FMA contraction (a*b+c rounded once), so every
# compiled variant of a kernel (paged or not, 64 or 128 rows) rounds the contract's
# expression at the same steps.
EXACT = dict(enable_fp_fusion=False)
