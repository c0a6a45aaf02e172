"""The trainer's log-probs through the contract: ONE function (``token_logprobs``) that every
verl trainer engine calls: FSDP, Megatron and MindSpeed (verl/megatron_engine.py).

Each engine divides the fp32 logits by the per-row temperature tensor — one IEEE division,
the contract's — before its log-prob function, so the contract runs at T = 1 (/1 is exact).
The rest comes from one object, this process's ``scoring.Scoring`` (set when the trainer
built its model): the padded-vocabulary limit and the rollout's truncation (top-k / top-p /
min-p: the rollout config's values, so every sample of the job carries the settings its
tokens were drawn with). old_log_prob, ref and the policy-update forward then compute the
rollout's bits: the log-probs of the truncated distribution (-inf outside its kept set, where
no response token can be: each was drawn from it). The first call in a worker reports the
contract it ran (contract_registry: the contract_match metric).

FSDP: verl 0.9.1's engine (workers/engine/fsdp/transformer_impl.py, prepare_model_outputs)
calls ``logprobs_from_logits``, imported by name; only that name (the engine's) is replaced.
"""
import functools
import logging

import consistent_ops as co

from .. import scoring
from ..hooks import patch
from . import contract_registry

log = logging.getLogger("true_on_policy.verl")


@functools.cache
def _publish_contract(fingerprint: str):
    contract_registry.publish("trainer", [fingerprint])


def token_logprobs(logits, labels, settings: scoring.Scoring):
    """Log-probs [labels.shape] (fp32) of ``labels`` under the contract from fp32 logits
    [..., V] over the whole vocabulary, already divided by the temperature."""
    _publish_contract(settings.contract or co.contract_fingerprint())
    flat = co.token_logprobs(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), 1.0,
                             settings.vocab_limit, settings.truncation)
    return flat.view(labels.shape)


def _fsdp(stock):
    """verl's signature and output (shape ``labels.shape``, dtype of the logits); verl's
    own function in a process that built no model of ours."""
    @functools.wraps(stock)
    def logprobs_from_logits(logits, labels, inplace_backward=True):
        settings = scoring.active()
        if settings is None:
            return stock(logits, labels, inplace_backward=inplace_backward)
        return token_logprobs(logits, labels, settings).to(logits.dtype)
    return logprobs_from_logits


def patch_fsdp(engine_module):
    """Replace the FSDP engine's ``logprobs_from_logits`` (idempotent)."""
    patch(engine_module, "logprobs_from_logits", _fsdp)
    log.info("true_on_policy: verl FSDP engine logprobs_from_logits -> trainer_logprobs.token_logprobs")
