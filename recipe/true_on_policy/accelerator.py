"""Whether this process has an accelerator (CUDA / ROCm or an Ascend NPU). Imports no host:
the verl adapter's CPU support and the Megatron work-arounds both ask it."""
import functools
import importlib.util


@functools.cache
def available() -> bool:
    """True when CUDA (or ROCm) or an Ascend NPU is usable in this process."""
    import torch
    if torch.cuda.is_available():
        return True
    if importlib.util.find_spec("torch_npu") is None:
        return False
    import torch_npu  # noqa: F401  (registers torch.npu)
    return bool(torch.npu.is_available())
