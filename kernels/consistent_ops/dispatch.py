"""Backend choice: one key, resolved once per process, logged with the fingerprint."""
import importlib
import importlib.util
import logging
import os

from .contract import ACCUMULATION, fingerprint

log = logging.getLogger("consistent_ops")

ENV_KEY = "CONSISTENT_OPS_BACKEND"   # the single channel: auto | reference | triton | ascend
_MODULES = {"reference": "consistent_ops.reference", "triton": "consistent_ops.triton",
            "ascend": "consistent_ops.ascend"}
_active = None


def _auto():
    """Pick by device: CUDA -> triton, NPU -> ascend, otherwise reference (when present)."""
    import torch
    if torch.cuda.is_available() and importlib.util.find_spec("consistent_ops.triton"):
        return "triton"
    npu = getattr(torch, "npu", None)      # present once torch_npu is loaded (autoloaded by torch)
    if npu is not None and npu.is_available() and importlib.util.find_spec("consistent_ops.ascend"):
        return "ascend"
    return "reference"


def set_backend(name=None):
    """Select and import a backend (None -> $CONSISTENT_OPS_BACKEND or auto). Returns its module."""
    global _active
    name = name or os.environ.get(ENV_KEY, "auto")
    if name == "auto":
        name = _auto()
    if name not in _MODULES or name not in ACCUMULATION:
        raise ValueError(f"{ENV_KEY}={name!r} is not a backend; use auto, {', '.join(sorted(_MODULES))}")
    if importlib.util.find_spec(_MODULES[name]) is None:
        raise NotImplementedError(f"consistent_ops backend {name!r} is not implemented in this version; "
                                  f"use reference (any device) or triton (CUDA)")
    module = importlib.import_module(_MODULES[name])
    if hasattr(module, "activate"):        # a backend with runtime requirements (ascend) checks them
        module.activate()
    _active = module
    log.info("consistent_ops backend=%s contract=%s", name, contract_fingerprint())
    return _active


def get_backend():
    return _active or set_backend()


def backend_name():
    return get_backend().NAME


_DEVICES = {"triton": "cuda", "ascend": "npu"}   # the reference backend runs on the CPU


def backend_device() -> str:
    """The device type the active backend's kernels run on."""
    return _DEVICES.get(backend_name(), "cpu")


def contract_fingerprint(model=None):
    """The fingerprint of the active backend's contract; both engines log and compare it.
    ``model``: the model's op parameters (models.ModelConfig.numerics()), hashed in with it."""
    backend = get_backend()
    return fingerprint(backend.NAME, backend.realisation() if hasattr(backend, "realisation") else None, model)
