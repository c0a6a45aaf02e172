"""Cross-rank steps of the contract over a torch.distributed group (gloo, NCCL, HCCL).

Reductions are gather + local ordered sum, never a backend-chosen all-reduce, so
the bits do not depend on the collective's algorithm, channel count or topology.
"""
import torch
import torch.distributed as dist


def _all_gather(t, group):
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return parts


def gather_ordered_sum(partial, group=None):
    """Row-parallel reduction: gather every rank's partial, sum in rank order."""
    from . import ordered_sum
    return ordered_sum(_all_gather(partial, group))


def gather_owned(contrib, owned, group=None):
    """Expert-parallel exchange: every (token, slot) takes the contribution of the rank
    that owns its expert; selection, not summation, so placement never changes bits."""
    out = contrib
    for c, o in zip(_all_gather(contrib, group), _all_gather(owned, group)):
        out = torch.where(o[..., None], c, out)
    return out


def gather_concat(t, dim=-1, group=None):
    """Column/vocab-parallel outputs: gather shards and concatenate in rank order (exact)."""
    return torch.cat(_all_gather(t, group), dim=dim)
