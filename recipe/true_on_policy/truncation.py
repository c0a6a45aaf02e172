"""Sampling truncation (top-k / top-p / min-p) settings, shared by every adapter.

The numbers are applied by ``consistent_ops.truncate_logprobs`` on both sides (the
rule: contract.COMMON["truncation"]). This module only says which values are valid,
normalises the hosts' "off" spellings (vLLM / verl: top_k -1 or 0, top_p 1, min_p 0)
and names the model-config attributes that carry them to the trainer (verl's
``model.override_config``, as the TP degree is carried). Imports neither verl nor vLLM.
"""
import consistent_ops as co

OFF = (0, 1.0, 0.0)
NAMES = ("top_k", "top_p", "min_p")
# HF config attributes of the trainer's model (set through verl's model.override_config)
CONFIG_ATTRS = tuple(f"true_on_policy_{n}" for n in NAMES)
# vLLM request extra_args keys that carry them to the rollout's log-prob processor
EXTRA_ARGS_KEYS = {n: f"true_on_policy_{n}" for n in NAMES}


def problems(top_k=None, top_p=None, min_p=None) -> list:
    """One line per invalid value (None: unset); the valid ranges and off values."""
    out = []
    if top_k is not None and (isinstance(top_k, bool) or int(top_k) != top_k or top_k < -1):
        out.append(f"top_k={top_k!r} must be an integer >= 1 (0 or -1: off)")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        out.append(f"top_p={top_p!r} must be in (0, 1] (1: off)")
    if min_p is not None and not 0.0 <= min_p <= 1.0:
        out.append(f"min_p={min_p!r} must be in [0, 1] (0: off)")
    return out


def normalise(top_k=None, top_p=None, min_p=None):
    """The contract's (top_k, top_p, min_p), or None when nothing truncates."""
    cut = (max(int(top_k if top_k is not None else 0), 0), float(1.0 if top_p is None else top_p),
           float(min_p or 0.0))
    return cut if co.truncation_active(*cut) else None


def of_settings(settings):
    """``normalise`` of an object's ``top_k`` / ``top_p`` / ``min_p`` attributes (the check's arguments)."""
    return normalise(*(getattr(settings, name) for name in NAMES))


def extra_args(kwargs: dict) -> dict:
    """Pops top_k / top_p / min_p from request ``kwargs``; their extra_args entries (none when
    every setting is off; invalid values are passed on for the admission check to name)."""
    values = [kwargs.pop(name, None) for name in NAMES]
    if problems(*values):
        return {k: v for k, v in zip(EXTRA_ARGS_KEYS.values(), values) if v is not None}
    cut = normalise(*values)
    return {} if cut is None else dict(zip(EXTRA_ARGS_KEYS.values(), cut))
