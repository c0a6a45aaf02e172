"""True on-policy for a verl job: everything that TRUE_ON_POLICY=1 switches on.

One setting (the environment variable, which Ray and vLLM hand to every process they
start) turns a stock ``python -m verl.trainer.main_ppo`` job true on-policy. Each piece
is installed right after verl imports the module it concerns (hooks.after_import), so a
process only pays for what it uses:

  driver        verl.utils.config             on a CPU host its settings (cpu_support);
                                              preflight (known-breaking settings fail
                                              fast), the startup self-check, and the
                                              trainer's TP emulation degree
  TaskRunner    trainer classes + metrics      per-step true_on_policy/* metrics + guard
  trainer       FSDP engine                    the actor's / reference's model -> the
                                              shared model; their log-probs ->
                                              consistent_ops.token_logprobs
  trainer       Megatron, MindSpeed engines    our layer spec + LM head + log-probs
                                              (true_on_policy.verl.megatron_engine)
  vLLM server   vllm_async_server              requests sample at T=1 with the rollout T
                                              carried to the contract's log-probs; reports
                                              its workers' contract (contract_match)
  agent loop    AgentLoopWorker                with true_on_policy.seed: each request
                                              carries its key (seeding.py)
  TaskRunner    v1 trainer_base, replay_buffer sequential uids; batches handed to the
                                              trainer in data order, not completion order
                                              (seeding.py: same run, same sums)
  trainer       vllm_rollout.ServerAdapter     debug mode (TRUE_ON_POLICY_CHECK_SYNC=1):
                                              each weight sync checksummed (weight_sync.py)
  vLLM workers  (vllm.general_plugins entry)   our model class + attention backend
"""
import functools
import logging
from pathlib import Path

from .. import scheme
from ..hooks import after_import, patch

log = logging.getLogger("true_on_policy.verl")


def _driver(module):
    """verl's ``main`` calls ``validate_config(config, ...)`` before it starts Ray (also when
    main_ppo runs as ``__main__``, which no import hook sees): our checks go there, once,
    in the driver (Ray not yet up), so a bad job fails before anything starts."""
    def checked_first(validate):
        def validate_config(config, *args, **kwargs):
            import ray
            if not ray.is_initialized():
                _prepare_job(config)
            return validate(config, *args, **kwargs)
        return validate_config

    patch(module, "validate_config", checked_first)


def _prepare_job(config):
    from omegaconf import OmegaConf, open_dict

    from .. import console, interrupt, quiet
    from . import cpu_support, preflight, seeding, self_check
    written = cpu_support.prepare_job(config)   # a CPU host: its settings (command-line keys win)
    if written:
        print(f"[true_on_policy] CPU host: {len(written)} CPU settings applied "
              f"(python -m true_on_policy.verl.cpu_support lists them)", flush=True)
    preflight.check(config)
    if OmegaConf.select(config, "true_on_policy.verbose", default=None) is False:
        quiet.apply()             # +true_on_policy.verbose=false: the recipe's quiet console
    metrics = OmegaConf.select(config, "true_on_policy.metrics_file", default=None)
    if metrics and console.routed(config) is None:   # a swap-in job's; the recipe routes its own
        console.follow(config, Path(str(metrics)).expanduser().absolute())
    interrupt.arm(config)     # SIGINT / SIGTERM end the job cleanly, Ray and vLLM with it
    with open_dict(config):   # the trainer emulates the rollout's TP sums (hf_model.TP_ATTR)
        tp = config.actor_rollout_ref.rollout.get("tensor_model_parallel_size", 1) or 1
        config.actor_rollout_ref.model.override_config["true_on_policy_tp_size"] = int(tp)
        _carry_truncation(config)
        seeding.seed_data(config)
    self_check.run(config)


def _carry_truncation(config):
    """The rollout's top_k / top_p to the trainer's model config (truncation.CONFIG_ATTRS):
    old_log_prob, ref and the update then score the truncated distribution."""
    from .. import truncation
    ro = config.actor_rollout_ref.rollout
    cut = truncation.normalise(ro.get("top_k"), ro.get("top_p"))
    for attr, value in zip(truncation.CONFIG_ATTRS, cut or truncation.OFF):
        config.actor_rollout_ref.model.override_config[attr] = value


def _trainer_engine(module):
    """verl's FSDP engine builds its model with ``get_hf_auto_model_class(hf_config)
    .from_pretrained(config=hf_config)`` in ``_build_module``: the config's type picks the
    class. Only there, and only for a language model (actor, reference; the critic is a
    value model whose values the rollout never computes), the config becomes our marked
    type; every other model of the process keeps transformers' class."""
    from .. import hf_model
    from . import trainer_logprobs
    hf_model.register()
    trainer_logprobs.patch_fsdp(module)

    def ours_for_language_models(build):
        @functools.wraps(build)
        def _build_module(self):
            if self.model_config.model_type == "language_model":
                self.model_config.hf_config = hf_model.scoped_config(self.model_config.hf_config)
            return build(self)
        return _build_module

    patch(module.FSDPEngine, "_build_module", ours_for_language_models)


def _megatron_engine(_module):
    from ..megatron import env
    env.import_bridge()
    from . import megatron_engine
    megatron_engine.install()


def _mindspeed_engine(module):
    from ..megatron import env
    env.import_bridge()
    from . import megatron_engine
    megatron_engine.install_mindspeed(module)


def _rollout_server(module):
    """verl builds ``SamplingParams(max_tokens=..., **dict)`` with the rollout temperature
    (0 for greedy validation); under the plugin the engine samples at 1.0 (greedy: 0) and the
    contract applies T and any top-k / top-p (scheme.request, vllm/sampling.py)."""
    def contract_applies_t(stock):
        def SamplingParams(temperature=1.0, **kwargs):  # noqa: N802 - replaces the class name
            return stock(**scheme.request(temperature, kwargs), **kwargs)
        return SamplingParams

    patch(module, "SamplingParams", contract_applies_t)
    patch(module.vLLMHttpServer, "run_server", _reporting_contract)


def _reporting_contract(run_server):
    """Once the server's engine is up, ask each of its workers which contract its model
    runs and report it (contract_registry: the contract_match metric)."""
    @functools.wraps(run_server)
    async def reporting_run_server(self, *args, **kwargs):
        result = await run_server(self, *args, **kwargs)
        from . import contract_registry
        contract_registry.publish("rollout", await self.engine.collective_rpc("true_on_policy_contract"))
        return result
    return reporting_run_server


def _weight_sync(module):
    from . import weight_sync
    weight_sync.patch_sender(module)


def _seeded_requests(module):
    from . import seeding
    seeding.patch_agent_loop(module)


def _sequential_uids(module):
    from . import seeding
    seeding.patch_trainer(module)


def _batches_in_data_order(module):
    from . import seeding
    seeding.patch_replay_buffer(module)


def _guard(module):
    from . import guard
    guard.patch_module(module)


def apply() -> bool:
    if not scheme.enabled():
        return False
    after_import("verl.utils.config", _driver)
    after_import("verl.workers.engine.fsdp.transformer_impl", _trainer_engine)
    after_import("verl.workers.engine.megatron.transformer_impl", _megatron_engine)
    after_import("verl.workers.engine.mindspeed.transformer_impl", _mindspeed_engine)
    after_import("verl.workers.rollout.vllm_rollout.vllm_async_server", _rollout_server)
    after_import("verl.workers.rollout.vllm_rollout.vllm_rollout", _weight_sync)
    after_import("verl.experimental.agent_loop.agent_loop", _seeded_requests)
    after_import("verl.trainer.ppo.v1.trainer_base", _sequential_uids)
    after_import("verl.trainer.ppo.v1.replay_buffer", _batches_in_data_order)
    for name in ("verl.utils.debug.metrics", "verl.trainer.ppo.ray_trainer", "verl.trainer.ppo.v1.trainer_base"):
        after_import(name, _guard)
    log.info("true_on_policy: on (%s=1)", scheme.ENV)
    return True
