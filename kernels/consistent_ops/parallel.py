"""Cross-rank steps of the contract over a torch.distributed group (gloo, NCCL, HCCL).

Reductions are gather + local ordered sum, never a backend-chosen all-reduce, so
the bits do not depend on the collective's algorithm, channel count or topology.
"""
import torch
import torch.distributed as dist


def all_gather(t, group=None):
    """Every rank's tensor (equal shapes), in rank order."""
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return parts


def gather_ordered_sum(partial, group=None):
    """Row-parallel reduction: gather every rank's partial, sum in rank order."""
    from . import ordered_sum
    return ordered_sum(all_gather(partial, group))


def gather_owned(contrib, owned, group=None):
    """Expert-parallel exchange: every (token, slot) takes the contribution of the rank
    that owns its expert; selection, not summation, so placement never changes bits."""
    return select_owned(all_gather(contrib, group), all_gather(owned, group))


def select_owned(contribs, owneds):
    """Per (token, slot), the contribution of the rank whose ``owned`` mask is set."""
    out = contribs[0]
    for c, o in zip(contribs, owneds):
        out = torch.where(o[..., None], c, out)
    return out


def gather_concat(t, dim=-1, group=None):
    """Column/vocab-parallel outputs: gather shards and concatenate in rank order (exact)."""
    return torch.cat(all_gather(t, group), dim=dim)
