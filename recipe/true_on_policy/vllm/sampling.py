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

Anything that would change the distribution after step 2 (top-k, top-p, min-p,
penalties, logit bias, bad words, allowed ids, min tokens) would make the reported
number describe a different distribution, so ``validate`` rejects it at admission
(the rules: ``scheme.sampling_problems``, shared with the verl preflight), as it
rejects an engine temperature that bypasses step 1. A greedy request (T = 0) runs at
engine temperature 0 with T = 0 in extra_args: the processor makes the rows the T = 1
log-probs, vLLM takes their argmax (ties to the lower id) and reports them
(contract.COMMON["greedy"]).
"""

import torch

import consistent_ops as co
from true_on_policy import scheme
from vllm.sampling_params import SamplingParams
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
from vllm.v1.sample.logits_processor.builtin import process_dict_updates

TEMPERATURE_KEY = scheme.TEMPERATURE_KEY
V1_PROCESSOR = "true_on_policy.vllm.sampling:ContractLogProbs"
V2_PROCESSOR = "true_on_policy.vllm.sampling_v2:ContractLogProbsV2"
_GREEDY_EPS = 1e-5   # vLLM's threshold below which a request is greedy


def sampling_params(temperature: float, **kwargs) -> SamplingParams:
    """SamplingParams for a rollout at ``temperature`` (0 = greedy) under the scheme above."""
    return SamplingParams(**scheme.request_temperature(temperature, kwargs.pop("extra_args", None)), **kwargs)


def rollout_temperature(params: SamplingParams) -> float:
    """The T of the request (1.0 unless extra_args carries one; 0 when it is greedy)."""
    extra = params.extra_args or {}
    if TEMPERATURE_KEY not in extra and params.temperature < _GREEDY_EPS:
        return 0.0
    return float(extra.get(TEMPERATURE_KEY, 1.0))


def validate(params: SamplingParams) -> None:
    """Admission check shared by the V1 and V2 processors; raises ValueError naming the field."""
    t = rollout_temperature(params)
    settings = {name: getattr(params, name) for name in scheme.NEUTRAL}
    problems = scheme.sampling_problems(dict(settings, temperature=t))
    if not problems and params.temperature != scheme.engine_temperature(t) and not (
            scheme.is_greedy(t) and params.temperature < _GREEDY_EPS):
        problems = [f"temperature={params.temperature}: the engine samples at {scheme.engine_temperature(t)} and "
                    f"the rollout temperature goes in extra_args[{TEMPERATURE_KEY!r}] "
                    f"(use true_on_policy.vllm.sampling.sampling_params(T, ...))"]
    if problems:
        raise ValueError("true_on_policy: " + "; ".join(problems))


def tokenizer_length(model_config) -> int:
    """len(tokenizer): the vocab_limit the trainer uses (rows beyond it are padding)."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model_config.tokenizer, revision=model_config.tokenizer_revision,
                                        trust_remote_code=model_config.trust_remote_code)
    return scheme.vocab_limit(len(tok), model_config.get_vocab_size())


def contract_logprobs(logits: torch.Tensor, temperatures: torch.Tensor, vocab_limit: int) -> torch.Tensor:
    """Rows -> the contract's log-probs at each row's temperature (fp32 [rows, V])."""
    return co.log_softmax(logits, temperatures, vocab_limit)


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

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self.temperature, batch_update,
                             lambda p, _prompt, _out: scheme.logprob_temperature(rollout_temperature(p)))

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        t = torch.tensor([self.temperature.get(i, 1.0) for i in range(logits.shape[0])],
                         dtype=torch.float32, device=logits.device)
        return contract_logprobs(logits, t, self.vocab_limit)
