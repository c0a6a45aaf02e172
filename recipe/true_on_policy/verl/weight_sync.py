"""Debug mode (``sync_check``): the trainer's side of the checksummed weight sync, on verl's
rollout adapter. The rollout's side (``sync_check.Receiver``) imports no host."""
import functools

import torch

from .. import sync_check
from ..hooks import patch


async def sending(weights):
    """SYNC_START, verl's (sync or async) stream of (name, tensor), then SYNC_ITEM with the digests."""
    from verl.workers.rollout.utils import ensure_async_iterator
    table = {}
    yield sync_check.SYNC_START, torch.zeros(1, dtype=torch.uint8)
    async for name, tensor in ensure_async_iterator(weights):
        table[name] = sync_check.digest(tensor)
        yield name, tensor
    yield sync_check.SYNC_ITEM, sync_check.encode(table)


def _checksummed(update):
    @functools.wraps(update)
    async def update_weights(self, weights, *args, wire_format="named_tensors", **kwargs):
        if wire_format == "named_tensors":
            weights = sending(weights)
        return await update(self, weights, *args, wire_format=wire_format, **kwargs)
    return update_weights


def patch_sender(module):
    """verl's ``ServerAdapter.update_weights`` sends through ``sending`` when sync_check is on."""
    if sync_check.enabled():
        patch(module.ServerAdapter, "update_weights", _checksummed)
