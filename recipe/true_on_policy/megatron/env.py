"""Megatron-Bridge on a machine without Transformer Engine (CPU), as small named work-arounds.

Only needed where ``transformer_engine`` cannot be imported; with it installed (GPU) nothing
here changes anything.
"""
import functools
import importlib
import importlib.abc
import importlib.util
import sys
import types

import torch

_LORA = "megatron.bridge.peft.lora_layers"
_TE = ("transformer_engine", "transformer_engine.pytorch")


class _Absent(type):
    """Any attribute is another absent class; making one says what is missing."""

    def __getattr__(cls, name):
        return _Absent(name, (), {})

    def __call__(cls, *args, **kwargs):
        raise RuntimeError(f"transformer_engine.{cls.__name__} used, but Transformer Engine is not installed")


class _TEAbsentForBridgePeft(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Work-around TE_ABSENT_FOR_BRIDGE_PEFT: bridge's LoRA module (imported by every bridge
    import, used by none of ours) does ``import transformer_engine.pytorch`` and names TE classes
    in signatures. Only while that one module body runs, ``transformer_engine`` is an absent
    stub; everything else (megatron.core's own TE detection included) still sees no TE."""

    def find_spec(self, name, path, target=None):
        if name != _LORA:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        self.real = spec.loader
        spec.loader = self
        return spec

    def create_module(self, spec):
        return self.real.create_module(spec)

    def exec_module(self, module):
        # Its imports first, without the stub, so no other module can see the stub.
        for dep in ("megatron.core.transformer.moe.moe_utils", "megatron.bridge.peft.adapter_wrapper",
                    "megatron.bridge.peft.lora_merge"):
            importlib.import_module(dep)
        stub = types.ModuleType(_TE[0])
        stub.pytorch = types.ModuleType(_TE[1])
        stub.pytorch.__getattr__ = lambda name: _Absent(name, (), {})
        sys.modules.update({_TE[0]: stub, _TE[1]: stub.pytorch})
        try:
            self.real.exec_module(module)
        finally:
            for name in _TE:
                sys.modules.pop(name, None)


def have_transformer_engine():
    return importlib.util.find_spec("transformer_engine") is not None


def import_bridge():
    """``import megatron.bridge`` (with the work-around where TE is absent)."""
    if not have_transformer_engine() and not any(isinstance(f, _TEAbsentForBridgePeft) for f in sys.meta_path):
        sys.meta_path.insert(0, _TEAbsentForBridgePeft())
    import megatron.bridge
    return megatron.bridge


def apply_cpu_workarounds():
    """Work-arounds for Megatron on a machine without CUDA (no-ops where CUDA exists).
    CUDA_CURRENT_DEVICE_IS_CPU: megatron-core and bridge place tensors on
    ``torch.cuda.current_device()`` (~45 sites); on CPU that device is the CPU.
    CUDA_RNG_IS_CPU_RNG: the model-parallel RNG tracker (dropout, init) saves, seeds and
    restores the CUDA generator; on CPU it is the CPU generator."""
    if torch.cuda.is_available():
        return
    from megatron.core.tensor_parallel import random
    torch.cuda.current_device = lambda: torch.device("cpu")
    torch.cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    torch.cuda.manual_seed = torch.manual_seed
    random._get_cuda_rng_state = lambda *args, clone=False, **kwargs: torch.get_rng_state()
    random._set_cuda_rng_state = lambda state, *args, **kwargs: torch.set_rng_state(state)


def cpu_provider_settings():
    """Provider fields a CPU run needs (none where CUDA exists). CPU_INITIALIZATION: the
    model is built on the CPU instead of being moved to ``torch.cuda.current_device()``."""
    return {} if torch.cuda.is_available() else dict(use_cpu_initialization=True)


def cpu_provider(provider):
    """CPU_INITIALIZATION for ``provide_distributed_model`` (its own argument, default off)."""
    if not torch.cuda.is_available():
        provider.provide_distributed_model = functools.partial(provider.provide_distributed_model,
                                                               use_cpu_initialization=True)
    return provider


class CudaIsCpu(torch.overrides.TorchFunctionMode):
    """Work-around CUDA_DEVICE_ARG_IS_CPU: megatron-core's schedules and optimizer create
    tensors with a literal ``device="cuda"``; inside this mode (entered only on CPU, around
    the engine's steps) such a tensor is made on the CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        device = kwargs.get("device")
        if device is not None and torch.device(device).type == "cuda":
            kwargs = {**kwargs, "device": "cpu"}
        return func(*args, **kwargs)


def on_cpu(method):
    """``method`` run inside CudaIsCpu where CUDA is absent (unchanged where it exists)."""
    if torch.cuda.is_available():
        return method

    @functools.wraps(method)
    def wrapper(*args, **kwargs):
        with CudaIsCpu():
            return method(*args, **kwargs)
    return wrapper
