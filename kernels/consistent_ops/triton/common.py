"""Launch options shared by every kernel of this backend, and the portability switches.

The kernels are ONE source for CUDA (upstream Triton) and Ascend NPUs (triton-ascend,
which the ascend backend launches). The few constructs triton-ascend lacks sit behind
module-level ``tl.constexpr`` switches set from the installed compiler, so a CUDA build
compiles exactly the code it always did and triton-ascend compiles the alternative.
"""
import functools
import importlib.util
import logging
import os

import torch
import triton
import triton.language as tl

log = logging.getLogger("consistent_ops")

# Arithmetic compiles as written: no FMA contraction (a*b+c rounded once), so every
# compiled variant of a kernel (paged or not, 64 or 128 rows) rounds the contract's
# expression at the same steps.
EXACT = dict(enable_fp_fusion=False)

# CPU interpreter (TRITON_INTERPRET=1, CI): tl.dot is a numpy matmul whose rounding may
# depend on the block shape, so shape choices that are free on tensor cores are pinned.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

# The installed Triton is triton-ascend (its backend package is "ascend"): Ascend A2/A3.
ASCEND = importlib.util.find_spec("triton.backends.ascend") is not None
# Contract transcendentals in fp64 (exp/log of fp32 evaluated in fp64, rounded once); the
# Ascend A2/A3 cores have no fp64, so there they are fp32 (contract.ACCUMULATION["ascend"]).
FP64_TRANSCENDENTALS = tl.constexpr(not ASCEND)
# IEEE division of 0-d values as tl.div_rn: triton-ascend's adapter aborts on it (and on
# splats of them), so there the kernels take the same IEEE quotient on [1]-shaped tensors.
SCALAR_DIV_RN = tl.constexpr(not ASCEND)
# input_precision of tl.dot on bf16/fp16 operands: any value gives exact products there;
# triton-ascend rejects "tf32" (it takes "ieee" or "hf32").
HALF_DOT_PRECISION = "ieee" if ASCEND else "tf32"

# Programmatic dependent launch (PDL, CUDA sm_90+): a kernel launched with it may start while the
# kernel before it in the stream still runs. Its programs first wait (griddepcontrol.wait) for that
# kernel to finish with its writes visible, then let the next kernel start (pdl_enter), so every
# read and write follows the previous kernel's as without it: the same bits, while the launch gap
# and the programs' start overlap the previous kernel's tail (a decode step is ~12 launches a layer).
# H100, 48-layer decode step (bench_rollout_gpu.py, 2026-12-07): 1.1-3.7 % faster at B=1 x 1k / 8k,
# 4 x 8k / 32k, every run trainer == rollout. A speed choice, not in the fingerprint;
# CONSISTENT_OPS_PDL=0 turns it off.
_PDL_ENV = os.environ.get("CONSISTENT_OPS_PDL", "1")
if _PDL_ENV not in ("0", "1"):
    raise ValueError(f"CONSISTENT_OPS_PDL={_PDL_ENV!r} is not a switch; use 1 (programmatic dependent launch on "
                     "sm_90+, the default) or 0 (off)")
PDL = not INTERPRET and not ASCEND and _PDL_ENV == "1"
_OPTIONS = {(fusion, pdl): dict({} if fusion else EXACT, PDL=pdl, **({"launch_pdl": True} if pdl else {}))
            for fusion in (False, True) for pdl in (False, True)}


@functools.lru_cache(maxsize=None)
def hopper_or_newer(device_index):
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def launch(t, fusion=False):
    """The options of a kernel launch whose tensors live where t does: EXACT (fusion=True: the
    compiler's FMA contraction, for the kernels that always had it), and PDL on sm_90+ CUDA (every
    kernel takes `PDL: tl.constexpr = False` and calls pdl_enter(PDL) before any memory op)."""
    return _OPTIONS[fusion, PDL and t.is_cuda and hopper_or_newer(t.get_device())]


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    """A program's first step: wait for the previous kernel (its writes visible), then let the next
    kernel's programs launch. Nothing without PDL."""
    if PDL:
        tl.inline_asm_elementwise("griddepcontrol.wait;\n\tgriddepcontrol.launch_dependents; // $0", "=r", [],
                                  dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def exp32(x):
    """The contract's exp of fp32 x (see FP64_TRANSCENDENTALS)."""
    if FP64_TRANSCENDENTALS:
        return tl.exp(x.to(tl.float64)).to(tl.float32)
    else:
        return tl.exp(x)


@triton.jit
def log32(x):
    """The contract's log of fp32 x (see FP64_TRANSCENDENTALS)."""
    if FP64_TRANSCENDENTALS:
        return tl.log(x.to(tl.float64)).to(tl.float32)
    else:
        return tl.log(x)


# Arrival counters of the split launches (attention's KV chunks, the linear's K chunks; arrival_counters):
# device -> every buffer allocated, the last in use; at least COUNTER_SLOTS (64 KiB), far more than the
# (tile program, KV head, fold segment) triples of any attention launch the threshold splits (fewer
# than 264 pairs on the H200, 5 segments at a 40k table, 16 at 128k) or a decode GEMM's output tiles.
COUNTERS, COUNTER_SLOTS = {}, 1 << 14


@triton.jit
def last_to_arrive(Count, n):
    """Whether this program is the last of the n arrivals at Count (a tile's chunk programs that
    stored their states, and in attention's segments the folder before, its fold stored); that one
    resets the counter to 0 (for the next launch or graph replay).
    Ordering: every thread's state stores, then a CTA barrier, then ONE acq_rel atomic at gpu
    scope (release: the barrier put the other threads' stores before it; acquire: the last
    program sees every earlier program's release, the atomics on Count forming one chain).
    The old value reaches every thread of the program through shared memory and a barrier,
    so its loads after this (bypassing L1: cache_modifier ".cg") see all n stores."""
    tl.debug_barrier()
    last = tl.atomic_add(Count, 1, sem="acq_rel", scope="gpu") == n - 1
    if last:
        tl.store(Count, 0)   # no program of this launch touches Count again: all n have arrived
    return last


def arrival_counters(device, slots, op):
    """A split launch's arrival counters on `device` (int32, zero between launches: each tile's last
    program resets its own), at least `slots` of them; None where that needs an allocation while the
    current stream is capturing a CUDA graph (op, the caller's name, then logs once that it ran unsplit).
    The rule: allocated at the first split launch (vLLM's eager warm-up before each capture
    makes it), at least COUNTER_SLOTS (one allocation serves every launch), grown only outside
    capture (a capture that would need more launches unsplit: the same bits), never freed (a
    captured graph keeps the address). One split launch in flight a device at a time (one stream,
    graphs replayed one after another; kernels in stream order share them): concurrent ones would
    share the counters."""
    bufs = COUNTERS.setdefault(device, [])
    if not bufs or bufs[-1].numel() < slots:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            _warn_unsplit_capture(op, device)
            return None
        bufs.append(torch.zeros(max(slots, COUNTER_SLOTS), dtype=torch.int32, device=device))
    return bufs[-1]


@functools.cache
def _warn_unsplit_capture(op, device):
    log.warning("%s on %s: a split launch was captured unsplit (the same bits, slower): its counters are "
                "allocated only outside CUDA-graph capture (run the batch once eagerly first)", op, device)
