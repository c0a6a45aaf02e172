"""verl's platform interface for a host with no accelerator (torch CPU tensors, gloo).

verl 0.9.1 resolves every device question (device name, torch device module,
collective backend, Ray resource, IPC) through ``verl.plugin.platform.get_platform()``
and ships CUDA, NPU and ROCm platforms only; with none available it falls back to
"nvidia" and then asks for NCCL. Registering this class under "cpu" through verl's
``PlatformRegistry`` answers those questions for CPU without touching verl's code.
Imported only by ``cpu_support.apply()``, which runs only when no accelerator exists.
"""
from contextlib import contextmanager
from types import ModuleType
from typing import Any, Optional

import torch
from verl.plugin.platform.platform_base import PlatformBase


class CpuDeviceModule:
    """``torch.cpu`` plus the calls verl makes on its device module that torch.cpu lacks
    (memory statistics, cache release, RNG state): the CPU has no caching allocator, so
    nothing is reserved and nothing is freed; its RNG is torch's default generator."""

    def __getattr__(self, name):
        return getattr(torch.cpu, name)

    @staticmethod
    def memory_allocated(device=None) -> int:
        return 0

    memory_reserved = max_memory_allocated = max_memory_reserved = memory_allocated

    @staticmethod
    def reset_peak_memory_stats(device=None) -> None:
        return None

    empty_cache = ipc_collect = reset_peak_memory_stats

    @staticmethod
    def mem_get_info(device=None) -> tuple[int, int]:
        import psutil
        vm = psutil.virtual_memory()
        return vm.available, vm.total

    @staticmethod
    def get_device_name(device=None) -> str:
        return "cpu"

    get_rng_state = staticmethod(torch.get_rng_state)
    set_rng_state = staticmethod(torch.set_rng_state)


CPU_DEVICE_MODULE = CpuDeviceModule()


class PlatformCPU(PlatformBase):
    """One "device" per trainer rank, all of them the host CPU."""

    @property
    def device_name(self) -> str:
        return "cpu"

    @property
    def vendor_name(self) -> str:
        return "cpu"

    @property
    def device_module(self) -> ModuleType:
        return CPU_DEVICE_MODULE  # duck-typed torch.<device> namespace

    def is_available(self) -> bool:
        return True

    def is_platform_available(self, use_smi_check=False) -> bool:
        # Probed by verl after the built-in platforms; cpu_support registers this class
        # only on hosts where those would all answer False.
        return True

    def current_device(self):
        # verl writes `tensor.to(get_device_id())`; an int would mean cuda:<i>.
        return "cpu"

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index: int) -> None:
        return None

    def synchronize(self, device_index: Optional[int] = None) -> None:
        return None

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        return None  # expandable segments are a CUDA caching-allocator notion

    def empty_cache(self) -> None:
        return None

    def get_device_capability(self, device_index: int = 0) -> tuple[Optional[int], Optional[int]]:
        return None, None

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        # Ray sets CUDA_VISIBLE_DEVICES for actors holding its logical "GPU" slots
        # (cpu_support.cpu_settings gives ray.init one slot per trainer rank).
        return "CUDA_VISIBLE_DEVICES"

    def ray_resource_name(self) -> str:
        # verl checks the cluster for "GPU" (or "NPU") slots before it places workers;
        # on CPU these are logical slots, one per trainer rank.
        return "GPU"

    def ray_resource_options(self, num_gpus: float) -> dict[str, Any]:
        return {"num_gpus": num_gpus}

    def ray_noset_envvars(self) -> list[str]:
        return []

    def is_ipc_supported(self) -> bool:
        return False  # CUDA IPC handles do not exist: verl then ships weights through shared memory

    def rollout_env_vars(self) -> dict[str, str]:
        return {}

    @contextmanager
    def nvtx_range(self, msg: str):
        yield

    def profiler_start(self) -> None:
        return None

    def profiler_stop(self) -> None:
        return None

    def cudart(self) -> Any:
        return None
