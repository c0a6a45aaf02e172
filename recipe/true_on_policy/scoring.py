"""What the trainer's log-probs must apply to score a token as the rollout did: the
padded-vocabulary limit and the rollout's top-k / top-p / min-p, in one object per process
(``active()``), set when the trainer builds its model (the HF adapter; verl's Megatron and
MindSpeed engines). Every trainer engine's log-prob hook reads it (verl/trainer_logprobs.py).
Imports no host."""
from dataclasses import dataclass

from . import truncation


@dataclass(frozen=True)
class Scoring:
    vocab_limit: int | None = None      # rows >= it are excluded (scheme.vocab_limit); None: all
    truncation: tuple | None = None     # the contract's (top_k, top_p, min_p); None: untruncated
    contract: str | None = None         # the fingerprint with the model's numerics, as vLLM's model reports it

    @classmethod
    def of(cls, config, vocab_limit) -> "Scoring":
        """The truncation carried in a model config (truncation.CONFIG_ATTRS, set through verl's
        ``model.override_config``), the vocabulary limit of the model's tokenizer, and the contract
        fingerprint of this model (ModelConfig.numerics: the parameters that reach the bits)."""
        import consistent_ops as co
        from .models.config import ModelConfig
        return cls(vocab_limit, truncation.normalise(*(getattr(config, a, None) for a in truncation.CONFIG_ATTRS)),
                   co.contract_fingerprint(ModelConfig.from_hf(config.to_dict()).numerics()))


_active: Scoring | None = None


def activate(scoring: Scoring) -> None:
    global _active
    _active = scoring


def active() -> Scoring | None:
    """This process's scoring; None where it built no model of ours (nothing to match there)."""
    return _active
