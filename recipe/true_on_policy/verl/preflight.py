"""Known-breaking settings, rejected before anything starts, each with its fix.

Run by the recipe (main_ppo) and by the swap-in hook on verl's config. Each rule is a
setting that would make the rollout and trainer compute different bits (or stop the
run from reporting rollout log-probs at all), so it can never silently cost logdiff.
"""
from pathlib import Path

from omegaconf import OmegaConf

from .. import scheme
from .seeding import seed_problems
from ..models import ModelConfig


class UnsupportedSetting(ValueError):
    pass


def _get(cfg, key, default=None):
    return OmegaConf.select(cfg, key, default=default)


def _rollout_rules(cfg):
    ro = "actor_rollout_ref.rollout."
    vllm_kwargs = _get(cfg, ro + "engine_kwargs.vllm") or {}
    if _get(cfg, ro + "name") != "vllm":
        yield f"{ro}name={_get(cfg, ro + 'name')!r}: only the vLLM rollout is covered; set {ro}name=vllm"
    quant = _get(cfg, ro + "quantization") or vllm_kwargs.get("quantization")
    if quant:
        yield (f"rollout quantization={quant!r} (e.g. FP8) computes other numbers than the trainer; "
               f"remove it (bf16 rollout)")
    backend = vllm_kwargs.get("attention_backend")
    if backend not in (None, "CUSTOM"):
        yield (f"{ro}engine_kwargs.vllm.attention_backend={backend!r} is outside the contract; remove it "
               f"(the plugin supplies the attention backend)")
    if not _get(cfg, ro + "calculate_log_probs", True):
        yield f"{ro}calculate_log_probs=False leaves nothing to compare; set it to True"
    # training rollouts, then validation ones (greedy by default: val_kwargs.temperature=0)
    yield from scheme.sampling_problems(_sampling_settings(_get(cfg, ro[:-1])), prefix=ro)
    yield from scheme.sampling_problems(_sampling_settings(_get(cfg, ro + "val_kwargs")), prefix=ro + "val_kwargs.")
    if _get(cfg, ro + "temperature", 1.0) == 0:
        yield (f"{ro}temperature=0: training rollouts must sample (the trainer divides its logits by this "
               f"temperature); set it > 0 (greedy belongs in {ro}val_kwargs)")
    yield from _truncation_rules(cfg, ro)
    yield from seed_problems(cfg)


def _sampling_settings(section) -> dict:
    """The sampling keys of a rollout config section that scheme.sampling_problems knows."""
    if section is None:
        return {}
    plain = OmegaConf.to_container(section, resolve=True) if OmegaConf.is_config(section) else dict(section)
    return {k: v for k, v in plain.items() if k in scheme.SAMPLING_KEYS}


_UNBOUNDED_KL = ("kl", "k1", "abs", "mse", "k2")


def _truncation_rules(cfg, ro):
    """top_k / top_p are applied by the contract on both sides (truncation.py); verl has no
    min_p. Truncated log-probs are -inf outside the kept set: the reference model's can be,
    for a sampled token, and verl's unclamped KL estimators then become infinite."""
    from ..truncation import normalise, problems
    top_k, top_p = _get(cfg, ro + "top_k"), _get(cfg, ro + "top_p")
    if problems(top_k, top_p) or normalise(top_k, top_p) is None:   # bad values: scheme.sampling_problems
        return
    ac = "actor_rollout_ref.actor."
    kinds = {ac + "kl_loss_type": _get(cfg, ac + "use_kl_loss", False) and _get(cfg, ac + "kl_loss_type", "kl"),
             "algorithm.kl_penalty": _get(cfg, "algorithm.use_kl_in_reward", False)
             and _get(cfg, "algorithm.kl_penalty", "kl")}
    for key, kind in kinds.items():
        if kind in _UNBOUNDED_KL:
            yield (f"{key}={kind!r} with top_k/top_p: the reference's truncated log-prob of a sampled "
                   f"token can be -inf, making this KL infinite; use low_var_kl (clamped)")


def _actor_rules(cfg):
    ac = "actor_rollout_ref.actor."
    strategy = _get(cfg, ac + "strategy", "fsdp")
    if strategy == "megatron":
        yield from _megatron_rules(cfg)
    elif strategy not in ("fsdp", "fsdp2"):
        yield f"{ac}strategy={strategy!r}: only fsdp2 and megatron (Megatron-Bridge) are covered; use one"
    if (_get(cfg, ac + "ulysses_sequence_parallel_size", 1) or 1) > 1:
        yield f"{ac}ulysses_sequence_parallel_size>1 splits attention differently; set it to 1"
    if _get(cfg, "actor_rollout_ref.model.use_fused_kernels", False):
        yield "actor_rollout_ref.model.use_fused_kernels=True bypasses the contract's log-probs; set False"
    if (_get(cfg, "actor_rollout_ref.model.lora_rank", 0) or 0) > 0:
        yield (f"actor_rollout_ref.model.lora_rank={_get(cfg, 'actor_rollout_ref.model.lora_rank')}: LoRA is not "
               f"supported (vLLM applies adapters with its own LoRA kernels, not the contract's linear, and the "
               f"shared model has no nn.Linear for PEFT to wrap); set lora_rank=0 (full fine-tuning)")
    yield from scheme.dtype_problems(_get(cfg, "actor_rollout_ref.rollout.dtype", "bfloat16"),
                                     prefix="actor_rollout_ref.rollout.")


def _megatron_rules(cfg):
    """What true_on_policy.megatron covers: Megatron-Bridge, packed (thd) batches, experts
    whole, no pipeline or context parallel yet."""
    import importlib.util
    mg = "actor_rollout_ref.actor.megatron."
    if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.bridge") is None:
        yield ("actor.strategy=megatron needs megatron-core + megatron-bridge: run scripts/setup_megatron.sh "
               "and launch with .venv-megatron/bin/python")
    for key, want in (("vanilla_mbridge", False), ("expert_tensor_parallel_size", 1),
                      ("pipeline_model_parallel_size", 1), ("context_parallel_size", 1)):
        value = _get(cfg, mg + key, want)
        if value is not None and value != want:
            yield f"{mg}{key}={value!r} is not covered by the Megatron spec yet; set {want}"
    if _get(cfg, mg + "expert_tensor_parallel_size", None) is None and _get(cfg, mg + "tensor_model_parallel_size", 1) > 1:
        yield f"{mg}expert_tensor_parallel_size must be 1 (experts are placed whole, as in the rollout); set 1"
    if not _get(cfg, "actor_rollout_ref.model.use_remove_padding", True):
        yield "actor_rollout_ref.model.use_remove_padding=False: the Megatron spec runs packed batches; set True"


def _model_rules(cfg):
    path = _get(cfg, "actor_rollout_ref.model.path")
    if not path or not (Path(str(path)) / "config.json").exists():
        return
    try:
        model = ModelConfig.from_dir(path)
    except (NotImplementedError, ValueError) as err:      # a config feature refused by the reader
        yield f"{err} (actor_rollout_ref.model.path={path})"
        return
    tp = int(_get(cfg, "actor_rollout_ref.rollout.tensor_model_parallel_size", 1) or 1)
    yield from scheme.tp_problems(model, tp)
    if _get(cfg, "actor_rollout_ref.actor.strategy") == "megatron":
        yield from _megatron_layout_rules(cfg, model)
    tokenizer = _get(cfg, "actor_rollout_ref.model.tokenizer_path") or path
    try:
        from transformers import AutoTokenizer
        n = len(AutoTokenizer.from_pretrained(str(tokenizer)))
    except (OSError, ValueError):
        return                              # verl reports a missing tokenizer itself
    try:
        scheme.vocab_limit(n, model.vocab_size)
    except ValueError as err:
        yield f"{err} (actor_rollout_ref.model.path={path})"


def _megatron_layout_rules(cfg, model):
    """The Megatron trainer's TP splits heads, KV heads and experts as the rollout's does; its
    EP places whole experts."""
    mg = "actor_rollout_ref.actor.megatron."
    tp = int(_get(cfg, mg + "tensor_model_parallel_size", 1) or 1)
    yield from (f"{p} (the trainer's {mg}tensor_model_parallel_size)" for p in scheme.tp_problems(model, tp))
    yield from scheme.megatron_model_problems(model)
    ep = int(_get(cfg, mg + "expert_model_parallel_size", 1) or 1)
    experts = model.num_experts or 0
    if ep > 1 and experts % ep:
        yield f"{mg}expert_model_parallel_size={ep} does not divide num_experts={experts}; use a divisor"


# Routing replay (R2 / R3) forces recorded expert choices into the trainer's router. Under the
# plugin both engines route with the contract's moe_route on bit-identical inputs, so the
# routes already agree; and neither engine carries replay's hooks (our vLLM model class
# returns no routed experts, our trainer layers have no replay router): refused, not ignored.
_ROUTING_REPLAY = ("routing replay is redundant under true on-policy: the rollout and the trainer "
                   "route with the same bits, so their top-k experts are already identical "
                   "(python -m true_on_policy.check --localize reports the agreement)")


def _routing_replay_rules(cfg):
    key = "actor_rollout_ref.rollout.enable_rollout_routing_replay"
    if _get(cfg, key, False):
        yield f"{key}=True: {_ROUTING_REPLAY}; drop it (set False)"
    for engine in ("megatron", "fsdp_config", "veomni"):
        key = f"actor_rollout_ref.actor.{engine}.router_replay.mode"
        mode = _get(cfg, key, "disabled")
        if mode not in (None, "disabled"):
            yield f"{key}={mode!r}: {_ROUTING_REPLAY}; drop it (set disabled)"


def _backend_rules(_cfg):
    import consistent_ops as co
    try:
        co.set_backend()                    # CONSISTENT_OPS_BACKEND, as every engine will resolve it
    except (ValueError, NotImplementedError) as err:
        yield str(err)


def problems(cfg) -> list:
    return [*_rollout_rules(cfg), *_routing_replay_rules(cfg), *_actor_rules(cfg), *_model_rules(cfg),
            *_backend_rules(cfg)]


def check(cfg) -> None:
    """Raise UnsupportedSetting listing every problem (and its fix) in ``cfg``."""
    found = problems(cfg)
    if found:
        raise UnsupportedSetting("true_on_policy cannot run this job:\n  - " + "\n  - ".join(found))
