"""Sampling and reported log-probs: the temperature scheme.

Requirement: the log-prob vLLM reports for a sampled token is EXACTLY the trainer's
``consistent_ops.token_logprobs(logits, token, T, vocab_limit=len(tokenizer))``, and
the token was drawn from the distribution that log-prob describes.

vLLM divides logits by the request temperature inside its sampler, with its own
kernel, after every logits processor has run (V2 runner: always; V1: for the
processors that may change the argmax). Its log-softmax is not the contract's
either. So the scheme is:

  1. The engine samples at temperature 1.0. The rollout temperature T travels per
     request in ``SamplingParams.extra_args[TEMPERATURE_KEY]`` (``sampling_params``
     below builds such params; a request at T=1 may omit it).
  2. ``ContractLogProbs`` (a logits processor that runs before the engine's
     temperature step) replaces each row by ``consistent_ops.log_softmax(logits, T,
     vocab_limit)``: the contract's fp32 log-probs at the request's T, rows of the
     padded vocabulary (>= len(tokenizer)) at -inf.
  3. The engine's temperature step divides by 1.0 (exact: x / 1 == x; the V2 runner
     skips it), and softmax(log_softmax(z / T)) == softmax(z / T): tokens are drawn
     from the tempered distribution, and padded ids can never be drawn.
  4. ``logprobs_mode="processed_logits"`` makes vLLM report the post-processor rows,
     i.e. exactly the contract's log-probs. The plugin's config hook sets it and
     installs the processor, so callers set nothing but TRUE_ON_POLICY=1.

Truncation (top-k, top-p, min-p) is the contract's (``consistent_ops.truncate_logprobs``,
which the trainer runs too): the settings travel like T, in ``extra_args``
(``TRUNCATION_KEYS``; ``sampling_params`` moves them there), step 2 returns the
truncated distribution's log-probs (-inf outside the kept set) and the engine's own
top_k/top_p/min_p stay off, since applying vLLM's top-p again to the renormalised rows
would cut further. Anything else that would change the distribution after step 2
(the engine's top-k/top-p/min-p, penalties, logit bias, bad words, allowed ids, min
tokens) would make the reported number describe a different distribution, so
``validate_params`` rejects it at admission, as it rejects a temperature != 1 that
bypasses step 1. Greedy requests (temperature 0) pick the argmax of the T=1 log-probs
and report them.
"""

import torch

import consistent_ops as co
from true_on_policy import truncation
from vllm.sampling_params import SamplingParams
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
from vllm.v1.sample.logits_processor.builtin import process_dict_updates


TEMPERATURE_KEY = "true_on_policy_temperature"
# extra_args keys of the contract's truncation; values are the SamplingParams-style ones.
TRUNCATION_KEYS = {name: f"true_on_policy_{name}" for name in truncation.NAMES}
V1_PROCESSOR = "true_on_policy.vllm.sampling:ContractLogProbs"
V2_PROCESSOR = "true_on_policy.vllm.sampling_v2:ContractLogProbsV2"
_GREEDY_EPS = 1e-5   # vLLM's threshold below which a request is greedy


def sampling_params(temperature: float, **kwargs) -> SamplingParams:
    """SamplingParams for a rollout at ``temperature`` under the scheme above; top_k /
    top_p / min_p in ``kwargs`` become the contract's truncation (extra_args)."""
    extra = dict(kwargs.pop("extra_args", None) or {}, **{TEMPERATURE_KEY: float(temperature)})
    extra.update(truncation_extra_args(kwargs))
    return SamplingParams(temperature=1.0, extra_args=extra, **kwargs)


def rollout_temperature(params: SamplingParams) -> float:
    """The T whose log-probs a request reports (1.0 unless extra_args carries one)."""
    return float((params.extra_args or {}).get(TEMPERATURE_KEY, 1.0))


def truncation_extra_args(kwargs: dict) -> dict:
    """Pops top_k/top_p/min_p from ``kwargs``; the extra_args entries of the contract's
    truncation (none when every setting is off)."""
    values = [kwargs.pop(name, None) for name in truncation.NAMES]
    if truncation.problems(*values):
        return {k: v for k, v in zip(TRUNCATION_KEYS.values(), values) if v is not None}   # validate() names it
    cut = truncation.normalise(*values)
    return {} if cut is None else dict(zip(TRUNCATION_KEYS.values(), cut))


def rollout_truncation(params: SamplingParams) -> tuple:
    """(top_k, top_p, min_p) the contract applies for a request (the off values when unset)."""
    extra = params.extra_args or {}
    return tuple(extra.get(key, off) for key, off in zip(TRUNCATION_KEYS.values(), truncation.OFF))


def _truncation_problem(params: SamplingParams) -> str | None:
    found = truncation.problems(*rollout_truncation(params))
    return f"{found[0]} (extra_args {list(TRUNCATION_KEYS.values())})" if found else None


def validate(params: SamplingParams) -> None:
    """Admission check shared by the V1 and V2 processors; raises ValueError naming the field."""
    t = rollout_temperature(params)
    if not t > 0 or t == float("inf"):
        raise ValueError(f"true_on_policy: extra_args[{TEMPERATURE_KEY!r}]={t} must be a positive number")
    if params.temperature != 1.0 and (TEMPERATURE_KEY in (params.extra_args or {})
                                      or params.temperature >= _GREEDY_EPS):
        raise ValueError(
            f"true_on_policy: temperature={params.temperature}: the engine samples at 1.0 and the "
            f"rollout temperature goes in extra_args[{TEMPERATURE_KEY!r}] "
            f"(use true_on_policy.vllm.sampling.sampling_params(T, ...))")
    problem = _truncation_problem(params)
    if problem:
        raise ValueError(f"true_on_policy: {problem}")
    for name, value in _distribution_changes(params).items():
        fix = (f"pass it to true_on_policy.vllm.sampling.sampling_params(T, {name}=...), which applies it "
               f"by the contract" if name in TRUNCATION_KEYS else "leave it at its default")
        raise ValueError(f"true_on_policy: {name}={value!r} changes the sampling distribution after the "
                         f"contract's log-probs; it is not supported ({fix})")


def _distribution_changes(params: SamplingParams) -> dict:
    checks = {
        "top_k": params.top_k not in (None, 0, -1), "top_p": params.top_p != 1.0,
        "min_p": params.min_p != 0.0, "presence_penalty": params.presence_penalty != 0.0,
        "frequency_penalty": params.frequency_penalty != 0.0,
        "repetition_penalty": params.repetition_penalty != 1.0, "logit_bias": bool(params.logit_bias),
        "allowed_token_ids": bool(params.allowed_token_ids), "bad_words": bool(params.bad_words),
        "min_tokens": params.min_tokens > 0,
    }
    return {name: getattr(params, name) for name, bad in checks.items() if bad}


def tokenizer_length(model_config) -> int:
    """len(tokenizer): the vocab_limit the trainer uses (rows beyond it are padding)."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model_config.tokenizer, revision=model_config.tokenizer_revision,
                                        trust_remote_code=model_config.trust_remote_code)
    return len(tok)


def contract_logprobs(logits: torch.Tensor, temperatures: torch.Tensor, vocab_limit: int,
                      cut: tuple | None = None) -> torch.Tensor:
    """Rows -> the contract's log-probs at each row's temperature (fp32 [rows, V]);
    ``cut`` = per-row (top_k, top_p, min_p) tensors, or None when no row truncates."""
    return co.log_softmax(logits, temperatures, vocab_limit, cut)


def truncation_columns(settings: list, device) -> tuple | None:
    """[(k, p, min_p) per row] -> the per-row tensors truncate_logprobs takes (None: all off)."""
    if not any(co.truncation_active(*s) for s in settings):
        return None
    k, p, mp = zip(*settings)
    return (torch.tensor(k, dtype=torch.int64, device=device), torch.tensor(p, dtype=torch.float64, device=device),
            torch.tensor(mp, dtype=torch.float32, device=device))


class ContractLogProbs(LogitsProcessor):
    """V1-runner processor (CPU, vLLM-Ascend): see the module docstring.

    Declared NOT argmax-invariant so the V1 sampler runs it in its first stage,
    before temperature, for greedy and random batches alike."""

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams):
        validate(sampling_params)

    def __init__(self, vllm_config, device, is_pin_memory):
        self.vocab_limit = tokenizer_length(vllm_config.model_config)
        self.temperature: dict[int, float] = {}   # persistent-batch index -> T
        self.truncation: dict[int, tuple] = {}    # persistent-batch index -> (top_k, top_p, min_p)

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self.temperature, batch_update, lambda p, _prompt, _out: rollout_temperature(p))
        process_dict_updates(self.truncation, batch_update, lambda p, _prompt, _out: rollout_truncation(p))

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        t = torch.tensor([self.temperature.get(i, 1.0) for i in range(logits.shape[0])],
                         dtype=torch.float32, device=logits.device)
        off = (0, 1.0, 0.0)
        cut = truncation_columns([self.truncation.get(i, off) for i in range(logits.shape[0])], logits.device)
        return contract_logprobs(logits, t, self.vocab_limit, cut)
