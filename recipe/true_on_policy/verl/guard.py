"""Per-step logdiff metrics and the guard that stops a run on any non-zero logdiff.

verl already compares rollout and actor log-probs in ``calculate_debug_metrics``
(training/rollout_probs_diff_*); we wrap it (both trainer generations import it) to
add ``true_on_policy/*`` metrics on log-probs themselves and on the contract both engines
ran (contract_registry), and to act on a mismatch of either. The wrapper keeps verl's
contract (same inputs accepted, verl's metrics unchanged) and adds ours only in a process
whose trainer verl built (``configure`` captures its config there): a call anywhere else
is verl's function as it is.
"""
import functools
import logging
import os
import time
from pathlib import Path

import torch

from ..hooks import patch
from . import contract_registry

log = logging.getLogger("true_on_policy.verl")
PREFIX = "true_on_policy/"
DEFAULTS = {"on_mismatch": "raise", "dump_dir": "/tmp/true_on_policy_mismatch"}
_settings = dict(DEFAULTS)
_trainer_built = False


class TrueOnPolicyMismatch(RuntimeError):
    """Rollout and trainer log-probs differ: the run is no longer on-policy."""


def configure(config):
    """Take ``true_on_policy.*`` from verl's config (absent in a plain swap-in job)."""
    section = dict((config or {}).get("true_on_policy", None) or {})
    mode = section.get("on_mismatch", DEFAULTS["on_mismatch"])
    if mode not in ("raise", "warn"):
        raise ValueError(f"true_on_policy.on_mismatch={mode!r}; use raise or warn")
    _settings.update(section, on_mismatch=mode)


def logdiff_metrics(rollout_lp, actor_lp, mask):
    """|rollout - actor| over response tokens: max, mean, fraction exactly equal."""
    mask = mask.bool()
    diff = (rollout_lp.float() - actor_lp.float()).abs()[mask]
    n = max(int(mask.sum()), 1)
    return {PREFIX + "logdiff_max": float(diff.max()) if diff.numel() else 0.0,
            PREFIX + "logdiff_mean": float(diff.sum()) / n,
            PREFIX + "frac_exact": float((diff == 0).sum()) / n,
            PREFIX + "num_tokens": int(mask.sum())}


def turn_index(mask):
    """[B, T] 1-based index of each response token's assistant turn, 0 where masked out.
    verl's multi-turn response mask is 1 on the model's tokens and 0 on the tool's (and on
    padding), so each run of 1s is one assistant turn: the turn boundaries verl exposes."""
    mask = mask.bool()
    starts = mask & ~torch.nn.functional.pad(mask, (1, 0))[:, :-1]
    return starts.long().cumsum(1) * mask


def turn_metrics(rollout_lp, actor_lp, mask):
    """Per assistant turn k (a multi-turn batch only): true_on_policy/turn_k/logdiff_max and
    /num_tokens, over every sample's k-th turn; turns_mean: assistant turns per sample."""
    turns = turn_index(mask)
    if turns.numel() == 0 or int(turns.max()) < 2:
        return {}
    diff = (rollout_lp.float() - actor_lp.float()).abs()
    out = {f"{PREFIX}turns_mean": float(turns.amax(1).float().mean())}
    for k in range(1, int(turns.max()) + 1):
        d = diff[turns == k]
        out[f"{PREFIX}turn_{k}/logdiff_max"] = float(d.max())
        out[f"{PREFIX}turn_{k}/num_tokens"] = d.numel()
    return out


def mismatch_report(rollout_lp, actor_lp, mask, metrics):
    diff = (rollout_lp.float() - actor_lp.float()).abs() * mask
    row, col = divmod(int(diff.flatten().argmax()), diff.shape[1])
    return (f"true on-policy broken: logdiff_max={metrics[PREFIX + 'logdiff_max']:.3g} "
            f"(mean {metrics[PREFIX + 'logdiff_mean']:.3g}, exact {metrics[PREFIX + 'frac_exact']:.2%} of "
            f"{metrics[PREFIX + 'num_tokens']} tokens); worst at sample {row}, response token {col}: "
            f"rollout {float(rollout_lp[row, col])!r} vs trainer {float(actor_lp[row, col])!r}. "
            f"Localise it with: python -m true_on_policy.check --model <actor model path> --localize")


def response_mask(batch, rollout_lp):
    """verl's choice of mask: response_mask, else the attention mask's response part,
    else every token."""
    for key in ("response_mask", "attention_mask"):
        if key in batch:
            return batch[key][:, -rollout_lp.shape[1]:]
    return torch.ones_like(rollout_lp)


def check_batch(data, contracts=None):
    """Metrics for one step's batch; raise or warn per ``on_mismatch``. ``contracts``:
    {role: [fingerprint, ...]}, read from this job's registry when not given."""
    rollout_lp, actor_lp = data.batch["rollout_log_probs"], data.batch["old_log_probs"]
    mask = response_mask(data.batch, rollout_lp)
    metrics = logdiff_metrics(rollout_lp, actor_lp, mask)
    metrics.update(turn_metrics(rollout_lp, actor_lp, mask))
    contract_ok, contract_why = contract_registry.compare(
        contract_registry.collect() if contracts is None else contracts)
    metrics[PREFIX + "contract_match"] = float(contract_ok)
    problems = [] if metrics[PREFIX + "logdiff_max"] == 0.0 else \
        [mismatch_report(rollout_lp, actor_lp, mask.float(), metrics)]
    if not contract_ok:
        problems.append(f"true on-policy not guaranteed: contract_match=0, {contract_why}.")
    if problems:
        report = " ".join(problems) + _dump(data)
        if _settings["on_mismatch"] == "raise":
            raise TrueOnPolicyMismatch(report)
        log.warning(report)
    return metrics


def _dump(data):
    """Keep the step's tokens and both log-probs for offline localisation (nothing lost)."""
    path = Path(_settings["dump_dir"]).expanduser() / f"step-{os.getpid()}-{time.time_ns()}.pt"
    path.parent.mkdir(parents=True, exist_ok=True)
    batch = {k: [t.cpu() for t in v.unbind()] if v.is_nested else v.cpu()
             for k, v in data.batch.items() if isinstance(v, torch.Tensor)}
    torch.save(batch, path)
    return f" Batch saved to {path}."


def _wrap(original):
    @functools.wraps(original)
    def calculate_debug_metrics(data):
        metrics = original(data)
        if _trainer_built:
            metrics.update(check_batch(data))
        return metrics
    return calculate_debug_metrics


def _capture_config(init):
    @functools.wraps(init)
    def __init__(self, config, *args, **kwargs):
        global _trainer_built
        configure(config)
        _trainer_built = True
        init(self, config, *args, **kwargs)
    return __init__


_TRAINERS = {"verl.trainer.ppo.v1.trainer_base": "PPOTrainer", "verl.trainer.ppo.ray_trainer": "RayPPOTrainer"}


def patch_module(module):
    """Wrap ``calculate_debug_metrics`` where ``module`` holds it (defined or imported by
    name) and capture the config of the trainer class it defines."""
    if hasattr(module, "calculate_debug_metrics"):
        patch(module, "calculate_debug_metrics", _wrap)
    if module.__name__ in _TRAINERS:
        patch(getattr(module, _TRAINERS[module.__name__]), "__init__", _capture_config)
