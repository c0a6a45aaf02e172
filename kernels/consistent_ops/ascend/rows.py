"""Row chunking for triton-ascend's launch limit (at most 65,535 programs per launch).

Every op chunked here is row-invariant by the contract (a row's bits depend on that row
alone), so running it over consecutive row chunks and concatenating gives the same bits
as one launch: the limit never reaches the numerics.
"""
import torch

MAX_PROGRAMS = 65535


def chunked(fn, limit, rows, *static, **kw):
    """fn(*row_chunks, *static, **kw) over chunks of at most ``limit`` rows of the tensors
    in ``rows`` (all with the same first dimension); outputs concatenated along rows."""
    n = rows[0].shape[0]
    if n <= limit:
        return fn(*rows, *static, **kw)
    outs = [fn(*(r[i:i + limit] for r in rows), *static, **kw) for i in range(0, n, limit)]
    if isinstance(outs[0], tuple):
        return tuple(torch.cat(parts) for parts in zip(*outs))
    return torch.cat(outs)
