"""Megatron-Bridge on a machine without Transformer Engine or CUDA (CPU), as small named
work-arounds.

The import work-arounds act only where the package they stand in for cannot be imported, the
CUDA ones only on a host with no accelerator (neither CUDA nor an Ascend NPU): with them
installed (GPU, NPU) nothing here changes anything.
"""
import functools
import importlib
import importlib.abc
import importlib.util
import sys
import types

import torch

from ..accelerator import available as _accelerator   # CUDA or an Ascend NPU


class _Absent(type):
    """Any attribute is another absent class; making one says what is missing."""

    def __getattr__(cls, name):
        return _Absent(f"{cls.__name__}.{name}", (), {})

    def __call__(cls, *args, **kwargs):
        raise RuntimeError(f"{cls.__name__} used, but it is not installed")


class _AbsentWhileImporting(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Only while the body of module ``target`` runs, the packages ``stubbed`` are absent
    stubs (any name imported from them is an ``_Absent`` class); everything else still sees
    them missing. ``deps``: the target's other imports, made first without the stub, so no
    other module can see it."""

    def __init__(self, target, stubbed, deps):
        self.target, self.stubbed, self.deps = target, stubbed, deps

    def find_spec(self, name, path, target=None):
        if name != self.target:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        self.real = spec.loader
        spec.loader = self
        return spec

    def create_module(self, spec):
        return self.real.create_module(spec)

    def exec_module(self, module):
        for dep in self.deps:
            importlib.import_module(dep)
        stubs = {name: types.ModuleType(name) for name in self.stubbed}
        for name, stub in stubs.items():
            stub.__getattr__ = lambda attr, name=name: _Absent(f"{name}.{attr}", (), {})
            parent, _, child = name.rpartition(".")
            if parent in stubs:
                setattr(stubs[parent], child, stub)
        sys.modules.update(stubs)
        try:
            self.real.exec_module(module)
        finally:
            for name in stubs:
                sys.modules.pop(name, None)


# Work-around TE_ABSENT_FOR_BRIDGE_PEFT: bridge's LoRA module (imported by every bridge
# import, used by none of ours) does ``import transformer_engine.pytorch`` and names TE classes
# in signatures; megatron.core's own TE detection still sees no TE.
_TE_ABSENT_FOR_BRIDGE_PEFT = _AbsentWhileImporting(
    "megatron.bridge.peft.lora_layers", ("transformer_engine", "transformer_engine.pytorch"),
    ("megatron.core.transformer.moe.moe_utils", "megatron.bridge.peft.adapter_wrapper",
     "megatron.bridge.peft.lora_merge"))
# Work-around ENERGON_ABSENT_FOR_BRIDGE_CONFIG: bridge's training config (whose DDP config
# verl's Megatron engine builds) imports its multimodal Energon data module, which imports
# ``megatron.energon`` (and through it s3fs, webdataset, multistorageclient, ...) at the top
# but uses it only when an Energon dataset is built (never by verl).
_ENERGON_ABSENT_FOR_BRIDGE_CONFIG = _AbsentWhileImporting(
    "megatron.bridge.data.energon.base_energon_datamodule", ("megatron.energon",),
    ("megatron.core.process_groups_config",))


def import_bridge():
    """``import megatron.bridge`` (with the work-arounds for what is absent: Transformer
    Engine, Megatron-Energon)."""
    for finder, package in ((_TE_ABSENT_FOR_BRIDGE_PEFT, "transformer_engine"),
                            (_ENERGON_ABSENT_FOR_BRIDGE_CONFIG, "megatron.energon")):
        if finder not in sys.meta_path and importlib.util.find_spec(package) is None:
            sys.meta_path.insert(0, finder)
    import megatron.bridge
    return megatron.bridge


class _CpuStream(torch.cpu.Stream):
    """torch's CPU stream, made with CUDA's arguments (device, priority)."""

    def __init__(self, *args, **kwargs):
        super().__init__()


def apply_cpu_workarounds():
    """Work-arounds for Megatron on a host with no accelerator (no-ops where one exists).
    CUDA_CURRENT_DEVICE_IS_CPU: megatron-core and bridge place tensors on
    ``torch.cuda.current_device()`` (~45 sites); on CPU that device is the CPU.
    CUDA_RNG_IS_CPU_RNG: the model-parallel RNG tracker (dropout, init) saves, seeds and
    restores the CUDA generator; on CPU it is the CPU generator.
    CUDA_STREAM_IS_CPU_STREAM: DDP wrapping and its grad buffers make, enter and wait on
    CUDA streams; on CPU they are torch's (no-op) CPU streams."""
    if _accelerator():
        return
    from megatron.core.tensor_parallel import random
    torch.cuda.current_device = lambda: torch.device("cpu")
    torch.cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    torch.cuda.manual_seed = torch.manual_seed
    random._get_cuda_rng_state = lambda *args, clone=False, **kwargs: torch.get_rng_state()
    random._set_cuda_rng_state = lambda state, *args, **kwargs: torch.set_rng_state(state)
    torch.cuda.Stream = _CpuStream
    torch.cuda.current_stream = lambda device=None: torch.cpu.current_stream()
    torch.cuda.stream = torch.cpu.stream


def cpu_provider_settings():
    """Provider fields a CPU run needs (none where CUDA exists). CPU_INITIALIZATION: the
    model is built on the CPU instead of being moved to ``torch.cuda.current_device()``."""
    return {} if _accelerator() else dict(use_cpu_initialization=True)


def cpu_provider(provider):
    """CPU_INITIALIZATION for ``provide_distributed_model`` (its own argument, default off)."""
    if not _accelerator():
        provider.provide_distributed_model = functools.partial(provider.provide_distributed_model,
                                                               use_cpu_initialization=True)
    return provider


class CudaIsCpu(torch.overrides.TorchFunctionMode):
    """Work-around CUDA_DEVICE_ARG_IS_CPU: megatron-core's schedules and optimizer create
    tensors with a literal ``device="cuda"``; inside this mode (entered only on CPU, around
    the engine's steps) such a tensor is made on the CPU.
    Work-around CUDA_TENSOR_TYPE_NAMES: megatron-core's optimizers accept parameters by
    their ``tensor.type()`` name ('torch.cuda.BFloat16Tensor', ...); inside this mode a CPU
    tensor's name is its CUDA twin's."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            return func(*args).replace("torch.", "torch.cuda.", 1)
        device = kwargs.get("device")
        if device is not None and torch.device(device).type == "cuda":
            kwargs = {**kwargs, "device": "cpu"}
        return func(*args, **kwargs)


def on_cpu(method):
    """``method`` run inside CudaIsCpu where CUDA is absent (unchanged where it exists)."""
    if _accelerator():
        return method

    @functools.wraps(method)
    def wrapper(*args, **kwargs):
        with CudaIsCpu():
            return method(*args, **kwargs)
    return wrapper
