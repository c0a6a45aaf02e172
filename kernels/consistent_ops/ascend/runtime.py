"""What an Ascend process needs, where each piece comes from, and what it found.

Nothing here imports torch_npu at module import: a CPU machine imports this package to
compile its kernels with triton-ascend (compile_check.py). ``activate`` is what a real
NPU process runs when the backend is selected.
"""
import functools
import importlib
import importlib.metadata
import importlib.util
import os

# (import name, distribution, where it comes from)
TORCH_NPU = ("torch_npu", "torch-npu", "PyPI: pip install torch-npu==2.10.0.post4 (needs CANN 9.1 from "
             "Huawei's Ascend download site); never into an environment that must import torch on a CPU")
TRITON_ASCEND = ("triton", "triton-ascend", "PyPI: pip install triton-ascend==3.2.0 (replaces upstream triton)")
FLASH_ATTN_NPU = ("flash_attn_npu_v3", "flash-attn-npu", "the consistency build (branch trainlnferConsist) of "
                  "the flash-attention-npu sources; the PyPI flash-attn-npu wheel lacks flash_attn_npu_v3")
CANN_BATCH_INVARIANT = ("batch_invariant_ops", "batch-invariant-ops", "Huawei's CANN batch_invariant_ops "
                        ".run package (Ascend download site; not on PyPI)")

# Deterministic collectives for other libraries' collectives (the contract itself
# gathers and sums in rank order, so it never relies on them for bits).
DETERMINISTIC_ENV = {"HCCL_DETERMINISTIC": "strict", "LCCL_DETERMINISTIC": "1"}


class MissingPiece(ImportError):
    pass


def present(piece):
    return importlib.util.find_spec(piece[0]) is not None


def version(piece):
    try:
        return importlib.metadata.version(piece[1])
    except importlib.metadata.PackageNotFoundError:
        return None


def require(piece):
    """Import a required piece or raise one line naming the package and where it comes from."""
    try:
        return importlib.import_module(piece[0])
    except ImportError as e:
        raise MissingPiece(f"consistent_ops backend 'ascend' needs {piece[1]} ({piece[0]} failed to import: "
                           f"{e}); get it from {piece[2]}") from None


def triton_is_ascend():
    from ..triton.common import ASCEND
    return ASCEND


@functools.lru_cache(maxsize=None)       # asked per layer per step; the installation does not change
def use_flash_attn_npu():
    """flash-attention-npu's consistency build decides attention when it imports."""
    return os.environ.get("CONSISTENT_OPS_ASCEND_ATTENTION", "auto") != "triton" and present(FLASH_ATTN_NPU)


@functools.lru_cache(maxsize=None)
def use_cann_matmul():
    return os.environ.get("CONSISTENT_OPS_ASCEND_LINEAR", "auto") != "triton" and present(CANN_BATCH_INVARIANT)


def activate():
    """Called when the backend is selected: torch_npu and triton-ascend must be there,
    collectives deterministic, torch deterministic."""
    import torch
    require(TORCH_NPU)
    if not triton_is_ascend():
        raise MissingPiece(f"consistent_ops backend 'ascend' needs triton-ascend as the installed triton "
                           f"(found upstream triton {version(('triton', 'triton'))}); get it from {TRITON_ASCEND[2]}")
    for key, value in DETERMINISTIC_ENV.items():
        os.environ[key] = value
    torch.use_deterministic_algorithms(True, warn_only=True)


def realisation():
    """Everything per installation that can change bits: it goes into the fingerprint."""
    from ..contract import ASCEND_KV_BLOCK, KV_BLOCK, KV_CHUNK
    fa = use_flash_attn_npu()
    return {
        "attention": "flash-attention-npu consistency build" if fa else "triton",
        "kv_block": ASCEND_KV_BLOCK if fa else KV_BLOCK,
        "kv_chunk": None if fa else KV_CHUNK,     # flash-attention-npu walks its stacks in one pass
        "linear": "cann npu_mm_batch_invariant (bf16 out, no bias) + triton" if use_cann_matmul() else "triton",
        "versions": {p[1]: version(p) for p in (TORCH_NPU, TRITON_ASCEND, FLASH_ATTN_NPU, CANN_BATCH_INVARIANT)},
        "cann": os.path.basename(os.path.realpath(os.environ["ASCEND_TOOLKIT_HOME"]))
        if os.environ.get("ASCEND_TOOLKIT_HOME") else None,          # .../ascend-toolkit/latest -> its version
    }
