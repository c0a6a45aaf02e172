"""Debug mode: every trainer -> rollout weight sync is checksummed on both sides.

With ``TRUE_ON_POLICY_CHECK_SYNC=1`` (the recipe sets it from ``true_on_policy.check_sync``)
the trainer side digests each tensor it sends (name, dtype, shape, bytes) between two extra
items that open and close the stream (``SYNC_START``, then ``SYNC_ITEM`` carrying the table);
the rollout side digests what it receives in between, and on the closing item compares the
two tables and checks that the sync covered every parameter it holds. Any difference stops
the sync with the names that differ, so a rollout never samples from weights the trainer
does not have. Off by default: digesting every tensor reads it once more. The trainer's side lives in
the verl adapter (verl/weight_sync.py); this module imports no host.
"""
import json
import logging
import os

import torch

log = logging.getLogger("vllm.true_on_policy")  # logged by the rollout worker: vLLM's handler
ENV = "TRUE_ON_POLICY_CHECK_SYNC"
SYNC_START, SYNC_ITEM = "true_on_policy.sync_start", "true_on_policy.sync_digest"


class WeightSyncMismatch(RuntimeError):
    """The rollout did not receive exactly the tensors the trainer sent."""


def enabled() -> bool:
    return os.environ.get(ENV) == "1"


_WORDS = 1 << 24       # 16-bit words summed at a time: no int64 overflow (|word * weight| < 2^31)


def digest(tensor: torch.Tensor) -> str:
    """dtype, shape and two sums of the bytes read as 16-bit words, plain and weighted by
    position (so a moved word counts too), computed where the tensor lives: integer sums are
    exact in any order, so trainer and rollout agree on any device, and nothing is copied to the
    host (a host copy and sha256 held the 8-layer Qwen3-30B-A3B sync on the H200 for ~68 s)."""
    raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    odd = raw.numel() % 2
    words = raw[:raw.numel() - odd].view(torch.int16)
    plain = weighted = 0
    for start in range(0, words.numel(), _WORDS):
        w = words[start:start + _WORDS].to(torch.int64)
        pos = torch.arange(start, start + w.numel(), device=w.device) % 65521 + 1
        plain, weighted = plain + int(w.sum()), weighted + int((w * pos).sum())
    return f"{tensor.dtype}{tuple(tensor.shape)}:{plain}:{weighted}:{int(raw[-1]) if odd else ''}"


def encode(table: dict) -> torch.Tensor:
    return torch.frombuffer(bytearray(json.dumps(table).encode()), dtype=torch.uint8)


def decode(item: torch.Tensor) -> dict:
    return json.loads(item.cpu().numpy().tobytes().decode())


class Receiver:
    """Rollout side, one per model: digests what arrives between SYNC_START and SYNC_ITEM
    (over several load_weights calls, one per bucket). A load outside a sync (vLLM's
    own checkpoint load) passes through unchecked."""

    def __init__(self):
        self.table = None

    def filter(self, weights, expected_names, covers=None):
        """Pass the weights through, digesting them; verify on SYNC_ITEM. ``expected_names``:
        the tensors this rank holds, each of which a sync must set; ``covers(name)``: the
        expected names a received tensor sets (default: its own name; e.g. a stack of
        experts sets each expert's)."""
        for name, tensor in weights:
            if name == SYNC_START:
                self.table = {}
            elif name == SYNC_ITEM:
                self.verify(decode(tensor), expected_names, covers)
            else:
                if self.table is not None:
                    self.table[name] = digest(tensor)
                yield name, tensor

    def verify(self, sent: dict, expected_names, covers=None):
        got, self.table = self.table or {}, None
        covered = {c for n in got for c in (covers(n) if covers else (n,))}
        problems = []
        differ = sorted(n for n in sent.keys() & got.keys() if sent[n] != got[n])
        for what, names in (("arrived with other bytes", differ),
                            ("sent but not received", sorted(sent.keys() - got.keys())),
                            ("received but not sent", sorted(got.keys() - sent.keys())),
                            ("held by the rollout but not synced", sorted(set(expected_names) - covered))):
            if names:
                problems.append(f"{len(names)} {what} (e.g. {', '.join(names[:3])})")
        if problems:
            raise WeightSyncMismatch("true_on_policy: weight sync not exact: " + "; ".join(problems))
        log.info("true_on_policy: weight sync exact (%d tensors checksummed on both sides)", len(got))
