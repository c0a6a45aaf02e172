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
(the engine's own top-k/top-p/min-p, penalties, logit bias, bad words, allowed ids, min
tokens) would make the reported number describe a different distribution, so
``validate`` rejects it at admission (the rules: ``scheme.sampling_problems``, shared
with the verl preflight), as it rejects an engine temperature that bypasses step 1. A greedy request (T = 0) runs at
engine temperature 0 with T = 0 in extra_args: the processor makes the rows the T = 1
log-probs, vLLM takes their argmax (ties to the lower id) and reports them
(contract.COMMON["greedy"]).

Seeded requests (``extra_args[scheme.SEED_KEY]`` = [run seed, step, prompt index, sample
index, phase]; README "Reproducible runs"): after step 2 the processor draws the token itself
(``seeded_draw.pin``: Gumbel-max with noise hashed from the key and the token's position, the
other entries -inf) and the engine, at temperature 0, takes it by argmax and reports its
log-prob. The token then depends on nothing but the key, the position and the log-probs,
which the contract already makes independent of batch, chunking, replica and TP rank.
Such a request must ask for ``logprobs`` <= 0 (the alternatives would read -inf).
"""

import torch

import consistent_ops as co
from true_on_policy import scheme, seeded_draw, truncation
from true_on_policy.hooks import after_import, patch
from true_on_policy.vllm.logprob_graphs import GraphedLogSoftmax
from vllm.sampling_params import SamplingParams
from vllm.v1.sample.logits_processor import BUILTIN_LOGITS_PROCESSORS, BatchUpdate, LogitsProcessor
from vllm.v1.sample.logits_processor.builtin import process_dict_updates

TEMPERATURE_KEY = scheme.TEMPERATURE_KEY
TRUNCATION_KEYS = truncation.EXTRA_ARGS_KEYS
V1_PROCESSOR = "true_on_policy.vllm.sampling:ContractLogProbs"
V2_PROCESSOR = "true_on_policy.vllm.sampling_v2:ContractLogProbsV2"
_GREEDY_EPS = 1e-5   # vLLM's threshold below which a request is greedy


def sampling_params(temperature: float, **kwargs) -> SamplingParams:
    """SamplingParams for a rollout at ``temperature`` (0 = greedy) under the scheme above;
    top_k / top_p / min_p in ``kwargs`` become the contract's truncation (extra_args)."""
    return SamplingParams(**scheme.request(temperature, kwargs), **kwargs)


def rollout_temperature(params: SamplingParams) -> float:
    """The T of the request (1.0 unless extra_args carries one; 0 when it is greedy)."""
    extra = params.extra_args or {}
    if TEMPERATURE_KEY not in extra and params.temperature < _GREEDY_EPS:
        return 0.0
    return float(extra.get(TEMPERATURE_KEY, 1.0))


def rollout_truncation(params: SamplingParams) -> tuple:
    """(top_k, top_p, min_p) the contract applies for a request (the off values when unset)."""
    extra = params.extra_args or {}
    return tuple(extra.get(key, off) for key, off in zip(TRUNCATION_KEYS.values(), truncation.OFF))


def rollout_seed_key(params: SamplingParams) -> list | None:
    """The request's seed key (scheme.SEED_KEY), or None when its draws are not seeded; a
    greedy request has no draws to seed."""
    key = (params.extra_args or {}).get(scheme.SEED_KEY)
    return None if key is None or scheme.is_greedy(rollout_temperature(params)) else key


def validate(params: SamplingParams) -> None:
    """Admission check shared by the V1 and V2 processors; raises ValueError naming the field."""
    t = rollout_temperature(params)
    key = rollout_seed_key(params)
    settings = {name: getattr(params, name) for name in scheme.NEUTRAL}
    settings.update(zip(truncation.NAMES, rollout_truncation(params)), temperature=t)
    problems = scheme.sampling_problems(settings)
    problems += [f"{name}={value!r}: the engine's own {name} would cut the contract's rows again; pass it to "
                 f"true_on_policy.vllm.sampling.sampling_params(T, {name}=...), which applies it by the contract"
                 for name, value in _engine_truncation(params).items()]
    if key is not None:
        problems += scheme.seed_key_problems(key)
        if params.logprobs not in (None, 0):
            problems.append(f"logprobs={params.logprobs}: a seeded request reports its sampled token's log-prob "
                            f"only (logprobs=0); the alternatives of its pinned row are -inf")
    engine_t = scheme.engine_temperature(t, key is not None)
    if not problems and params.temperature != engine_t and not (
            engine_t == 0 and params.temperature < _GREEDY_EPS):
        problems = [f"temperature={params.temperature}: the engine samples at {engine_t} and "
                    f"the rollout temperature goes in extra_args[{TEMPERATURE_KEY!r}] "
                    f"(use true_on_policy.vllm.sampling.sampling_params(T, ...))"]
    if problems:
        raise ValueError("true_on_policy: " + "; ".join(problems))


def _engine_truncation(params: SamplingParams) -> dict:
    """vLLM's own top_k / top_p / min_p that are not off (the contract applies them instead)."""
    on = {"top_k": params.top_k not in (None, 0, -1), "top_p": params.top_p != 1.0, "min_p": params.min_p != 0.0}
    return {name: getattr(params, name) for name, bad in on.items() if bad}


def tokenizer_length(model_config) -> int:
    """len(tokenizer): the vocab_limit the trainer uses (rows beyond it are padding)."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model_config.tokenizer, revision=model_config.tokenizer_revision,
                                        trust_remote_code=model_config.trust_remote_code)
    return scheme.vocab_limit(len(tok), model_config.get_vocab_size())


def contract_logprobs(logits: torch.Tensor, temperatures: torch.Tensor, vocab_limit: int,
                      cut: tuple | None = None) -> torch.Tensor:
    """Rows -> the contract's log-probs at each row's temperature (fp32 [rows, V]);
    ``cut`` = per-row (top_k, top_p, min_p) tensors, or None when no row truncates."""
    return co.log_softmax(logits, temperatures, vocab_limit, cut)


def to_device(values, dtype, device) -> torch.Tensor:
    """A host list on ``device`` without a stream sync: a CUDA copy goes from fresh pinned memory,
    non-blocking (torch.tensor(..., device=cuda) waits for every kernel queued before it, which
    stalls vLLM's async scheduling at each step that builds rows; the caching host allocator
    keeps the pinned block until the copy is done)."""
    device = torch.device(device)
    host = torch.tensor(values, dtype=dtype, pin_memory=device.type == "cuda")
    return host.to(device, non_blocking=True)


def truncation_columns(settings: list, device) -> tuple | None:
    """[(k, p, min_p) per row] -> the per-row tensors truncate_logprobs takes (None: all off)."""
    if not any(co.truncation_active(*s) for s in settings):
        return None
    k, p, mp = zip(*settings)
    return to_device(k, torch.int64, device), to_device(p, torch.float64, device), to_device(mp, torch.float32, device)


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
        self.seeded: dict[int, tuple] = {}        # persistent-batch index -> (key, prompt length, output ids)
        self.rows = None                          # (rows, T, cut) on the device while the batch is unchanged
        self.graphed = GraphedLogSoftmax(self.vocab_limit)

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self.temperature, batch_update,
                             lambda p, _prompt, _out: scheme.logprob_temperature(rollout_temperature(p)))
        process_dict_updates(self.truncation, batch_update, lambda p, _prompt, _out: rollout_truncation(p))
        process_dict_updates(self.seeded, batch_update, lambda p, prompt, out: None if rollout_seed_key(p) is None
                             else (rollout_seed_key(p), len(prompt or ()), out))   # out: vLLM's live list
        if batch_update is not None:
            self.rows = None

    def row_settings(self, n: int, device) -> tuple:
        """Per-row T and truncation tensors, built again only when the batch changed: a decode
        step of an unchanged batch runs no Python over its rows and copies nothing to the device."""
        if self.rows is None or self.rows[0] != n:
            t = to_device([self.temperature.get(i, 1.0) for i in range(n)], torch.float32, device)
            self.rows = (n, t, truncation_columns([self.truncation.get(i, truncation.OFF) for i in range(n)], device))
        return self.rows[1:]

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        t, cut = self.row_settings(logits.shape[0], logits.device)
        if cut is None and not self.seeded and self.graphed.takes(logits):    # the tail's steps (logprob_graphs)
            return self.graphed(logits, t)
        logp = contract_logprobs(logits, t, self.vocab_limit, cut)
        if not self.seeded:
            return logp
        rows = range(logits.shape[0])
        entries = [self.seeded.get(i) for i in rows]
        keys = to_device([e[0] if e else [0] * scheme.SEED_WORDS for e in entries], torch.int64, logits.device)
        # the drawn token's index in the whole sequence (prompt + response so far)
        positions = to_device([e[1] + len(e[2]) if e else 0 for e in entries], torch.int64, logits.device)
        seeded = to_device([e is not None for e in entries], torch.bool, logits.device)
        return seeded_draw.pin(logp, keys, positions, seeded)


def _no_output_ids_wait(init):
    """InputBatch.__init__, then vLLM's `logitsprocs_need_output_token_ids` off when ContractLogProbs is
    the only custom processor. vLLM sets it for any custom processor, and under async scheduling it
    then waits at every step for the previous step's sampled ids to reach the host, to put them in
    place of the -1 placeholders of each request's output list (update_async_output_token_ids: 1.1-1.9
    ms a step at B=16 x 32k on an H100, 2026-12-05). The processor reads only those lists' lengths
    (a seeded draw's position), which the placeholders already give."""
    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        custom = [p for p in self.logitsprocs.all if type(p) not in BUILTIN_LOGITS_PROCESSORS]
        if custom and all(isinstance(p, ContractLogProbs) for p in custom):
            self.logitsprocs_need_output_token_ids = False
    return __init__


# vLLM imports this module while its runner builds the processors, before it builds the InputBatch
after_import("vllm.v1.worker.gpu_input_batch", lambda m: patch(m.InputBatch, "__init__", _no_output_ids_wait))
