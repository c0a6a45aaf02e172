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

    @classmethod
    def of(cls, config, vocab_limit) -> "Scoring":
        """The truncation carried in a model config (truncation.CONFIG_ATTRS, set through verl's
        ``model.override_config``) and the vocabulary limit of the model's tokenizer."""
        return cls(vocab_limit, truncation.normalise(*(getattr(config, a, None) for a in truncation.CONFIG_ATTRS)))


_active: Scoring | None = None


def activate(scoring: Scoring) -> None:
    global _active
    _active = scoring


def active() -> Scoring | None:
    """This process's scoring; None where it built no model of ours (nothing to match there)."""
    return _active
