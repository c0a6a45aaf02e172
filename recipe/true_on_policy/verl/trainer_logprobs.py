"""verl's trainer log-probs through the contract.

verl 0.9.1's FSDP engine (workers/engine/fsdp/transformer_impl.py, prepare_model_outputs)
divides the logits by the per-row fp32 temperature tensor — one IEEE division, which is
the contract's — then calls ``logprobs_from_logits`` (imported by name, so both names
are patched). We replace that call with ``consistent_ops.token_logprobs`` at T = 1 (the
division already happened; /1 is exact), the padded-vocabulary rule and the rollout's
truncation (top-k / top-p, hf_model.active_truncation: the rollout config's values, so
every sample of the job carries the settings its tokens were drawn with), so
old_log_prob, ref and the policy-update forward all compute the rollout's bits: the
log-probs of the truncated distribution (-inf outside its kept set, where no response
token can be: each was drawn from it). The first call in a worker reports the contract
it ran (contract_registry: the contract_match metric).
"""
import logging

import consistent_ops as co

from .. import hf_model
from . import contract_registry

log = logging.getLogger("true_on_policy.verl")
_TARGETS = ("verl.utils.torch_functional", "verl.workers.engine.fsdp.transformer_impl")
_reported = False


def contract_logprobs_from_logits(logits, labels, inplace_backward=True):
    global _reported
    if not _reported:
        contract_registry.publish("trainer", [co.contract_fingerprint()])
        _reported = True
    limit, cut = hf_model.active_vocab_limit(), hf_model.active_truncation()
    lp = co.token_logprobs(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), 1.0, limit, cut)
    return lp.view(labels.shape)


def patch():
    import importlib
    for name in _TARGETS:
        module = importlib.import_module(name)
        if module.logprobs_from_logits is not contract_logprobs_from_logits:
            module.logprobs_from_logits = contract_logprobs_from_logits
    log.info("true_on_policy: verl logprobs_from_logits -> consistent_ops.token_logprobs")
