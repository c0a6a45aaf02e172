"""verl's trainer log-probs through the contract.

verl 0.9.1's FSDP engine (workers/engine/fsdp/transformer_impl.py, prepare_model_outputs)
divides the logits by the per-row fp32 temperature tensor — one IEEE division, which is
the contract's — then calls ``logprobs_from_logits``, imported by name. Only that name
(the engine's) is replaced, by ``consistent_ops.token_logprobs`` at T = 1 (the division
already happened; /1 is exact) with the padded-vocabulary rule and the rollout's
truncation (top-k / top-p, hf_model.active_truncation: the rollout config's values, so
every sample of the job carries the settings its tokens were drawn with), so old_log_prob,
ref and the policy-update forward all compute the rollout's bits: the log-probs of the
truncated distribution (-inf outside its kept set, where no response token can be: each was
drawn from it). verl's own function elsewhere is untouched. The first call in a worker
reports the contract it ran (contract_registry: the contract_match metric).
"""
import functools
import logging

import consistent_ops as co

from .. import hf_model
from . import contract_registry

log = logging.getLogger("true_on_policy.verl")
_reported = False


def _contract(stock):
    """verl's signature and output (shape ``labels.shape``, dtype of the logits); verl's
    own function in a process that built no model of ours (nothing to match there)."""
    if getattr(stock, "_true_on_policy", False):
        return stock

    @functools.wraps(stock)
    def logprobs_from_logits(logits, labels, inplace_backward=True):
        global _reported
        if not hf_model.built():
            return stock(logits, labels, inplace_backward=inplace_backward)
        if not _reported:
            contract_registry.publish("trainer", [co.contract_fingerprint()])
            _reported = True
        flat = co.token_logprobs(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), 1.0,
                                 hf_model.active_vocab_limit(), hf_model.active_truncation())
        return flat.view(labels.shape).to(logits.dtype)

    logprobs_from_logits._true_on_policy = True
    return logprobs_from_logits


def patch(engine_module):
    """Replace the FSDP engine's ``logprobs_from_logits`` (idempotent)."""
    engine_module.logprobs_from_logits = _contract(engine_module.logprobs_from_logits)
    log.info("true_on_policy: verl FSDP engine logprobs_from_logits -> consistent_ops.token_logprobs")
