"""The reference backend's contraction on CPU tensors: dot64.c and dot32.c, built once per machine.

Which realisation runs (contract.CPU_ACCUMULATION: bf16 pairs by VDPBF16PS, fp32 lanes with FMA,
or fp64 lanes) is ``accumulation()``, read from $CONSISTENT_OPS_CPU_ACCUMULATION (unset: bf16
where the CPU has avx512_bf16, else fp32); fp64 operands always
take the fp64 kernel (their products are exact only there). The C sources are compiled with
the system C compiler on first use into ``$CONSISTENT_OPS_CACHE`` (default
``~/.cache/consistent_ops``), keyed by the sources, the flags and the CPU's feature flags, and
loaded with ctypes in every process (vLLM workers too). The bits do not depend on the build:
the kernels' order is explicit and floating-point contraction is off. -fopenmp: large calls split
whole outputs over torch's OpenMP threads (the same libgomp.so.1), never a sum.
"""
import ctypes
import functools
import hashlib
import os
import platform
import struct
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

from ..contract import CPU_ACCUMULATION, CPU_ACCUMULATION_BF16, CPU_ACCUMULATION_DEFAULT, CPU_ACCUMULATION_ENV, KV_BLOCK

SOURCES = [Path(__file__).with_name("dot64.c"), Path(__file__).with_name("dot32.c")]
HEADER = Path(__file__).with_name("native.h")                      # included by both
CFLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-fast-math", "-fPIC", "-shared", "-fopenmp"]
LIBS = ["-lm"]
DTYPES = {torch.float64: 0, torch.float32: 1, torch.bfloat16: 2}
_lock = threading.Lock()
_lib = None


@functools.cache
def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def _build() -> Path:
    cc = os.environ.get("CC", "cc")
    key = hashlib.sha256(b"".join(f.read_bytes() for f in SOURCES + [HEADER]) + " ".join([cc] + CFLAGS).encode()
                         + platform.machine().encode() + _cpu_flags().encode()).hexdigest()[:16]
    cache = Path(os.environ.get("CONSISTENT_OPS_CACHE", Path.home() / ".cache" / "consistent_ops"))
    lib = cache / f"dot64-{key}.so"
    if lib.is_file():
        return lib
    cache.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=cache, suffix=".so")
    os.close(fd)
    try:
        done = subprocess.run([cc, *CFLAGS, *map(str, SOURCES), "-o", tmp, *LIBS], capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(
                f"consistent_ops: building the reference backend's CPU kernel failed ({cc} "
                f"{' '.join(CFLAGS)} {' '.join(map(str, SOURCES))}):\n{done.stderr.strip()}\nInstall a C compiler "
                f"(e.g. apt install gcc) or point $CC at one.")
        os.replace(tmp, lib)         # atomic: concurrent builders (vLLM workers) all succeed
    except FileNotFoundError:
        raise RuntimeError(f"consistent_ops: no C compiler {cc!r} for the reference backend's CPU "
                           f"kernel; install one (e.g. apt install gcc) or set $CC") from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return lib


def library():
    global _lib
    if _lib is not None:                 # built and loaded: no lock on the per-call path
        return _lib
    with _lock:
        if _lib is None:
            lib = ctypes.CDLL(str(_build()))
            p = ctypes.c_void_p
            i64 = ctypes.c_int64
            for dot, attend, norm in (("dot64", "attend64", "rms_norm_rows"), ("dot32", "attend32", "rms_norm_rows32"),
                                      ("dot32p", "attend32p", "rms_norm_rows32")):
                getattr(lib, dot).argtypes = [p, p, ctypes.c_int, p, p, ctypes.c_int, p, p, p]
                getattr(lib, dot).restype = ctypes.c_int
                getattr(lib, attend).argtypes = [p, p, ctypes.c_int, p, p, p, ctypes.c_int, p, p, p, p, ctypes.c_float, p,
                                                 ctypes.c_int, p]
                getattr(lib, attend).restype = ctypes.c_int
                getattr(lib, norm).argtypes = [i64, i64, ctypes.c_int, p, i64, p, i64, p, ctypes.c_float, p, p]
                getattr(lib, norm).restype = None
            lib.inv_sqrt32.argtypes = [i64, p, p]
            lib.inv_sqrt32.restype = None
            lib.silu_mul32.argtypes = [i64, i64, ctypes.c_int, p, i64, p, i64, p]
            lib.silu_mul32.restype = ctypes.c_int
            lib.moe_experts32.argtypes = [i64, i64, i64, i64, ctypes.c_int, p, i64, p, p, i64, i64, p, p, p, p,
                                          ctypes.c_int, p, p, p]
            lib.moe_experts32.restype = ctypes.c_int
            lib.rope_rows.argtypes = [i64, i64, i64, ctypes.c_int, p, p, p, p]
            lib.rope_rows.restype = None
            lib.paged_tokens.argtypes = [i64, i64, p, p, i64, i64, i64, i64, p]
            lib.paged_tokens.restype = ctypes.c_int
            lib.write_kv.argtypes = [i64, i64, i64, i64, p, p, p, p, p, p, p, p, i64, i64]
            lib.write_kv.restype = ctypes.c_int
            lib.attn_prologue32.argtypes = [i64, i64, i64, i64, i64, ctypes.c_int, p, i64, p, p, p, i64, p, p,
                                            ctypes.c_float, p, p, ctypes.c_int, p, p, p]
            lib.attn_prologue32.restype = ctypes.c_int
            lib.linear_add_norm32.argtypes = [i64, i64, i64, ctypes.c_int, p, i64, p, i64, p, i64, p, ctypes.c_float,
                                              ctypes.c_int, p, p]
            lib.linear_add_norm32.restype = ctypes.c_int
            lib.mlp32.argtypes = [i64, i64, i64, ctypes.c_int, p, i64, p, p, p, ctypes.c_int, p]
            lib.mlp32.restype = ctypes.c_int
            f32 = ctypes.c_float
            lib.decode_layer32.argtypes, lib.decode_layer32.restype = [p, f32, f32, f32, f32], ctypes.c_int
            lib.log_softmax32.argtypes, lib.log_softmax32.restype = [i64, i64, p, i64, p, i64, i64, p], ctypes.c_int
            lib.dot32_isa.argtypes, lib.dot32_isa.restype = [], ctypes.c_int
            lib.moe_route32.argtypes = [i64, i64, p, i64, i64, ctypes.c_int, p, p]
            lib.moe_route32.restype = ctypes.c_int
            lib.moe_router32.argtypes = [i64, i64, i64, ctypes.c_int, p, i64, p, i64, ctypes.c_int, i64, ctypes.c_int, p, p]
            lib.moe_router32.restype = ctypes.c_int
            _lib = lib
    return _lib


def build_isa() -> str:
    """The vector paths of this machine's dot32.c build: "avx512 + vdpbf16ps", "avx512", "avx2" or
    "scalar" (the C loops; bf16 pairs emulated). Every build gives the same bits; this says how fast."""
    isa = library().dot32_isa()
    name = "avx512" if isa & 2 else "avx2" if isa & 1 else "scalar"
    return name + " + vdpbf16ps" if isa & 4 else name


def _int64s(values):
    """values packed for a `const int64_t *` argument: ctypes passes a bytes object's own buffer
    (~0.3 us; a ctypes array costs ~1.5)."""
    return struct.pack(f"{len(values)}q", *values)


def _longs(*ts):
    """The tensors as contiguous int64 (per-call index tensors: no copy, nor .to's ~1 us, when they are)."""
    return [t if t.dtype == torch.int64 and t.is_contiguous() else t.to(torch.int64).contiguous() for t in ts]


def _unit_last(t):
    """t with a unit-stride last dimension (rows may keep any stride): a copy only when it has not."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _operand(x):
    return x if x.dtype in DTYPES else x.float()      # e.g. fp16: widening to fp32 is exact


def accumulation() -> str:
    """The CPU realisation this process runs: a key of contract.CPU_ACCUMULATION; unset, the
    CPU's (default_accumulation)."""
    name = os.environ.get(CPU_ACCUMULATION_ENV) or default_accumulation()
    if name not in CPU_ACCUMULATION:
        raise ValueError(f"{CPU_ACCUMULATION_ENV}={name!r} is not a CPU accumulation; use one of "
                         f"{', '.join(sorted(CPU_ACCUMULATION))}")
    return name


def default_accumulation() -> str:
    """contract.CPU_ACCUMULATION_BF16 where this CPU has the bf16 dot instruction (VDPBF16PS, flag
    avx512_bf16), else CPU_ACCUMULATION_DEFAULT: a function of the host, so every process of a
    job on one machine (trainer, vLLM workers) picks the same, and the fingerprint names it."""
    return CPU_ACCUMULATION_BF16 if "avx512_bf16" in _flag_set(_cpu_flags()) else CPU_ACCUMULATION_DEFAULT


@functools.cache
def _flag_set(flags: str) -> frozenset:
    """The words of a cpuinfo flags line, split once (this runs on every contraction)."""
    return frozenset(flags.split())


_KERNELS = {"fp32": "32", CPU_ACCUMULATION_BF16: "32p"}


def _kernel(*tensors) -> str:
    """"32p" (dot32.c, bf16 pairs), "32" (dot32.c) or "64" (dot64.c) for these operands."""
    for t in tensors:
        if t.dtype == torch.float64:
            return "64"
    return _KERNELS.get(accumulation(), "64")


def dot64_matmul(a: torch.Tensor, b: torch.Tensor, rows=None) -> torch.Tensor:
    """a [..., M, K] @ b [..., K, N] (batch dims broadcast) -> fp32, each output one
    contract_dot of dot64.c. rows (int64, one per batch entry of a 3-D a): compute only the
    first rows[e] rows of entry e, the others are 0. CPU tensors; no autograd (core.matmul32
    wraps it)."""
    return _matmul(a, b, rows, "64")


def dot32_matmul(a: torch.Tensor, b: torch.Tensor, rows=None) -> torch.Tensor:
    """dot64_matmul in dot32.c's fp32 order (bf16/fp16/fp32 operands)."""
    return _matmul(a, b, rows, "32")


def dot32p_matmul(a: torch.Tensor, b: torch.Tensor, rows=None) -> torch.Tensor:
    """dot32_matmul in the "bf16" realisation: two bf16 operands in VDPBF16PS pairs, others as dot32."""
    return _matmul(a, b, rows, "32p")


def matmul(a: torch.Tensor, b: torch.Tensor, rows=None, lanes=False) -> torch.Tensor:
    """The contraction of this process's accumulation() (fp64 operands: dot64). lanes: the fp32
    realisation's lanes in the bf16 realisation too (its reductions: RMSNorm's sum of squares)."""
    a, b = _operand(a), _operand(b)
    kernel = _kernel(a, b)
    return _matmul(a, b, rows, "32" if lanes and kernel == "32p" else kernel)


def _matmul(a, b, rows, kernel):
    a, b = _operand(a), _operand(b)
    if kernel != "64" and torch.float64 in (a.dtype, b.dtype):
        raise TypeError("dot32_matmul: fp64 operands would be rounded; use dot64_matmul (or matmul)")
    m, k, n = a.shape[-2], a.shape[-1], b.shape[-1]
    if rows is None and a.dim() == 2 and b.dim() == 2:    # a plain x @ w.T (most calls): the general path's
        out = torch.empty(m, n, dtype=torch.float32)      # arguments, built without its broadcasting steps
        if out.numel() and getattr(library(), "dot" + kernel)(
                _int64s((1, 1, 1, m, n, k)), a.data_ptr(), DTYPES[a.dtype], _int64s((0, 0, 0, *a.stride())), b.data_ptr(),
                DTYPES[b.dtype], _int64s((0, 0, 0, b.stride(1), b.stride(0))), None, out.data_ptr()):
            raise MemoryError(f"consistent_ops dot{kernel}: out of memory for its row buffers")
        return out
    if rows is None and b.dim() == 2 and a.dim() > 2:   # a shared matrix: fold a's batch into M
        return _matmul(a.reshape(-1, k), b, None, kernel).reshape(*a.shape[:-1], n)
    batch = a.shape[:-2] if a.shape[:-2] == b.shape[:-2] else torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    out = torch.empty(*batch, m, n, dtype=torch.float32)
    if out.numel() == 0:
        return out
    if rows is not None:
        if len(batch) != 1 or rows.shape != batch:
            raise ValueError(f"dot{kernel}_matmul: rows {tuple(rows.shape)} must give one count per batch "
                             f"entry of a 3-D product (batch {tuple(batch)})")
        rows = rows.to(torch.int64).contiguous()
    a, b = a.expand(*batch, m, k), b.expand(*batch, k, n)
    if len(batch) > 3:
        a, b = a.reshape(-1, m, k), b.reshape(-1, k, n)
    pad = 3 - (a.dim() - 2)
    shape = [1] * pad + list(a.shape[:-2]) + [m, n, k]
    sb = [0] * pad + list(b.stride()[:-2]) + [b.stride(-1), b.stride(-2)]   # b0 b1 b2 n k
    rc = getattr(library(), "dot" + kernel)(
        _int64s(shape), a.data_ptr(), DTYPES[a.dtype], _int64s([0] * pad + list(a.stride())), b.data_ptr(),
        DTYPES[b.dtype], _int64s(sb), None if rows is None else rows.data_ptr(), out.data_ptr())
    if rc:
        raise MemoryError(f"consistent_ops dot{kernel}: out of memory for its row buffers")
    return out


def _check_offsets(k, v, token_range, heads, head_stride, d, dim_stride):
    """Raises IndexError unless every K/V element the attention may read (token offsets in token_range,
    heads x d at these strides) lies inside k's and v's storage."""
    lo, hi = token_range
    reach = hi + (heads - 1) * head_stride + (d - 1) * dim_stride
    for c in (k, v):
        if lo < -c.storage_offset() or reach >= c.untyped_storage().nbytes() // c.element_size() - c.storage_offset():
            raise IndexError(f"attend: K/V offsets up to {reach} fall outside the cache tensor")


def attend(qh, k, v, token, head_stride, dim_stride, qpos, seq_lens, scale, chunk, token_range=None):
    """The contract's attention in one pass (attend64 / attend32 per _kernel), states restarted every
    `chunk` keys (contract.KV_CHUNK, a multiple of KV_BLOCK) and folded: qh [S, H, R, D] query rows;
    K/V element (s, h, pos, d) at k/v's first element + token[s, pos] + h * head_stride +
    d * dim_stride (a padded layout or a paged cache read in place); qpos [S, R] each row's
    position; V past seq_lens[s] reads as 0; token_range: token's (min, max) where the caller has it.
    Returns acc / l, fp32 [S, H, R, D]. No autograd."""
    S, H, R, D = qh.shape
    qh = _unit_last(qh)
    out = torch.empty(S, H, R, D, dtype=torch.float32)
    _attend(qh, (S, H, R, D, 1), (*qh.stride()[:3], 0), k, v, token, head_stride, dim_stride, qpos, seq_lens, scale,
            chunk, token_range, out, (H * R * D, R * D, D, 0))
    return out


def attend_heads(q, hkv, k, v, token, head_stride, dim_stride, qpos, seq_lens, scale, chunk, token_range=None,
                 out=None):
    """attend's walk for q [S, T, Hq, D] as it lies (any strides, D contiguous): KV head h's rows are its
    G = Hq / hkv query heads x T tokens, row r = (g, t) = (r / T, r % T) (qpos [S, G * T] in that order),
    read in place; returns [S, T, Hq, D] in q's dtype, each row the rounding of attend's fp32 row, as
    .to() rounds it, so the bits of attend's rows permuted and cast, without those copies. out: a tensor
    of q's shape and dtype (any strides, D contiguous) written in place instead of a new one."""
    S, T, hq, D = q.shape
    q = _unit_last(q)
    g = hq // hkv
    if out is None:
        out = torch.empty(S, T, hq, D, dtype=q.dtype)
    elif out.shape != q.shape or out.dtype != q.dtype or out.stride(-1) != 1:
        raise ValueError(f"attend_heads: out {tuple(out.shape)} {out.dtype} (last stride {out.stride(-1)}); "
                         f"pass one of q's shape {tuple(q.shape)} and dtype {q.dtype}, last dimension contiguous")
    _attend(q, (S, hkv, g * T, D, T), (q.stride(0), g * q.stride(2), q.stride(2), q.stride(1)), k, v, token, head_stride,
            dim_stride, qpos, seq_lens, scale, chunk, token_range, out,
            (out.stride(0), g * out.stride(2), out.stride(2), out.stride(1)))
    return out


def _attend(q, dims, qs, k, v, token, head_stride, dim_stride, qpos, seq_lens, scale, chunk, token_range, out, os):
    """One attend64 / attend32 call: dims (S, H, R, D, T), q's and out's row strides (attn_row in native.h)."""
    S, H, R, D, T = dims
    token, qpos, seq_lens = _longs(token, qpos, seq_lens)
    L = token.shape[1]
    _check_offsets(k, v, token_range or tuple(int(t) for t in token.aminmax()), H, head_stride, D, dim_stride)
    if k.dtype != v.dtype or k.dtype not in DTYPES:
        raise TypeError(f"attend: K/V dtypes {k.dtype}/{v.dtype}; use one of {list(DTYPES)}")
    if out.numel():
        rc = getattr(library(), "attend" + _kernel(q, k))(_int64s([S, H, R, D, L, KV_BLOCK, chunk, T]), q.data_ptr(),
                                                       DTYPES[q.dtype], _int64s(qs), k.data_ptr(), v.data_ptr(),
                                                       DTYPES[k.dtype], token.data_ptr(), _int64s([head_stride, dim_stride]),
                                                       qpos.data_ptr(), seq_lens.data_ptr(), scale, out.data_ptr(),
                                                       DTYPES[out.dtype], _int64s(os))
        if rc:
            raise MemoryError("consistent_ops attend: out of memory for its buffers")


ACTIVATIONS = (torch.bfloat16, torch.float32)


def rms_norm(x, weight, eps, residual=None):
    """reference/norm.py's RMSNorm (and its fused residual add) in one call (rms_norm_rows
    of dot64.c / dot32.c per _kernel): the same bits as those torch steps. x [..., H] of an ACTIVATIONS dtype;
    returns y, or (y, x + residual) when residual is given. No autograd."""
    h = x.shape[-1]
    rows = _unit_last(x if x.dim() == 2 else x.reshape(-1, h))
    res = None if residual is None else _unit_last(residual if residual.dim() == 2 else residual.reshape(-1, h))
    w = (weight if weight.dtype == x.dtype else weight.to(x.dtype)).contiguous()
    out = torch.empty(*x.shape, dtype=x.dtype)        # (a torch.Size argument costs 2 us more)
    res_out = None if res is None else torch.empty(*x.shape, dtype=x.dtype)
    norm = library().rms_norm_rows if _kernel(x) == "64" else library().rms_norm_rows32
    norm(rows.shape[0], h, DTYPES[x.dtype], rows.data_ptr(), rows.stride(0),
                            None if res is None else res.data_ptr(), 0 if res is None else res.stride(0),
                            w.data_ptr(), eps, out.data_ptr(), None if res_out is None else res_out.data_ptr())
    return out if residual is None else (out, res_out)


def inv_sqrt(x):
    """1 / sqrt(x) of an fp32 CPU tensor with IEEE sqrt and division (dot64.c inv_sqrt32)."""
    x = x.contiguous()
    out = torch.empty_like(x)
    library().inv_sqrt32(x.numel(), x.data_ptr(), out.data_ptr())
    return out


def silu_mul(gate, up):
    """contract silu_mul of gate/up [..., C] (ACTIVATIONS dtype, the same for both) in one call
    (dot32.c silu_mul32: exp(-g) by the attention's polynomial; the fp32 and bf16 realisations).
    No autograd."""
    c = gate.shape[-1]
    g, u = gate.reshape(-1, c), up.reshape(-1, c)      # views where rows are strided (a chunk of gate|up)
    g, u = _unit_last(g), _unit_last(u)
    out = torch.empty(gate.shape, dtype=gate.dtype)
    if out.numel() and library().silu_mul32(g.shape[0], c, DTYPES[gate.dtype], g.data_ptr(), g.stride(0),
                                            u.data_ptr(), u.stride(0), out.data_ptr()):
        raise MemoryError("consistent_ops silu_mul: out of memory for its row buffer")
    return out


def log_softmax(logits, temperature, vocab_limit):
    """reference/logprobs.py log_softmax in the fp32/bf16 realisations (dot32.c log_softmax32): fp32 [rows, V]
    of fp32 logits [rows, V] (any row stride), temperature an fp32 tensor of one value or one per row,
    columns >= vocab_limit -inf. No autograd."""
    logits = _unit_last(logits)
    rows, v = logits.shape
    t = temperature.contiguous()
    out = torch.empty(rows, v, dtype=torch.float32)
    if out.numel() and library().log_softmax32(rows, v, logits.data_ptr(), logits.stride(0), t.data_ptr(),
                                               int(t.numel() > 1), vocab_limit, out.data_ptr()):
        raise MemoryError("consistent_ops log_softmax: out of memory for its row buffers")
    return out


def moe_route(logits, top_k, norm):
    """reference/moe.py moe_route after its linear, in one call (dot32.c moe_route32: the softmax's
    exp by the attention's polynomial, its sums in fp64 in expert / slot order): ids int64 [T, top_k],
    weights fp32 [T, top_k] of fp32 logits [T, E]. The fp32 / bf16 realisations. No autograd."""
    logits = _unit_last(logits)
    t, e = logits.shape
    ids, weights = torch.empty(t, top_k, dtype=torch.int64), torch.empty(t, top_k, dtype=torch.float32)
    if t and library().moe_route32(t, e, logits.data_ptr(), logits.stride(0), top_k, int(norm), ids.data_ptr(),
                                   weights.data_ptr()):
        raise MemoryError("consistent_ops moe_route: out of memory for its row buffer")
    return ids, weights


def moe_router(x, gate_weight, top_k, norm):
    """reference/moe.py moe_route whole, linear included, in one call (dot32.c moe_router32: the linear's
    contraction into fp32 logits, then moe_route32): x [T, H] and gate_weight [E, H] of one ACTIVATIONS
    dtype. The same bits as linear then moe_route. No autograd."""
    x, gate_weight = _unit_last(x), _unit_last(gate_weight)
    t, (e, h) = x.shape[0], gate_weight.shape
    ids, weights = torch.empty(t, top_k, dtype=torch.int64), torch.empty(t, top_k, dtype=torch.float32)
    if t and library().moe_router32(t, e, h, DTYPES[x.dtype], x.data_ptr(), x.stride(0), gate_weight.data_ptr(),
                                    gate_weight.stride(0), int(_kernel(x, gate_weight) == "32p"), top_k, int(norm),
                                    ids.data_ptr(), weights.data_ptr()):
        raise MemoryError("consistent_ops moe_router: out of memory for its logits buffer")
    return ids, weights


def moe_experts(x, ids, weights, gate_up, down, first, combine=False):
    """reference/moe.py's expert contributions in one call (dot32.c moe_experts32) for the local
    experts first .. first + len(gate_up) - 1, stacked as gate_up [L, 2I, H] and down [L, H, I]
    (x's dtype, an ACTIVATIONS dtype): contrib [T*k, H] fp32 (0 where no local expert), owned
    [T*k] bool and, with combine, moe_combine(contrib) [T, H] in x's dtype (else None): the bits of
    the batched torch path and moe_combine (the same dots of the same rows, the same adds). The fp32 /
    bf16 realisations only (fp64 operands take dot64.c). No autograd."""
    t, k = ids.shape
    h, inter = x.shape[-1], down.shape[-1]
    x = _unit_last(x)
    ids, weights = _longs(ids)[0], weights.float().contiguous()
    contrib = torch.empty(t * k, h, dtype=torch.float32)
    owned = torch.empty(t * k, dtype=torch.bool)
    combined = torch.empty(t, h, dtype=x.dtype) if combine else None
    if library().moe_experts32(t, k, h, inter, DTYPES[x.dtype], x.data_ptr(), x.stride(0), ids.data_ptr(),
                               weights.data_ptr(), first, gate_up.shape[0], gate_up.data_ptr(),
                               _int64s(gate_up.stride()), down.data_ptr(), _int64s(down.stride()),
                               int(_kernel(x, gate_up) == "32p"), contrib.data_ptr(), owned.data_ptr(),
                               None if combined is None else combined.data_ptr()):
        raise MemoryError("consistent_ops moe_experts: out of memory for its buffers")
    return contrib, owned, combined


def apply_rope(x, cos, sin):
    """reference/pointwise.py apply_rope (x [T, H, D] of an ACTIVATIONS dtype, fp32 cos/sin
    [T, D/2]) in one call (dot32.c rope_rows): the same IEEE fp32 steps. No autograd."""
    x, cos, sin = x.contiguous(), cos.float().contiguous(), sin.float().contiguous()
    out = torch.empty_like(x)
    library().rope_rows(x.shape[0], x.shape[1], x.shape[2], DTYPES[x.dtype], x.data_ptr(), cos.data_ptr(),
                        sin.data_ptr(), out.data_ptr())
    return out


def paged_tokens(table, seq_lens, walked, page_size, page_stride, slot_stride):
    """[S, walked] K/V offsets into a paged cache (dot32.c paged_tokens): table[s, page] *
    page_stride + (pos % page_size) * slot_stride, the page clamped to the sequence's last."""
    table, seq_lens = _longs(table, seq_lens)
    token = torch.empty(table.shape[0], walked, dtype=torch.int64)
    if library().paged_tokens(table.shape[0], table.shape[1], table.data_ptr(), seq_lens.data_ptr(), walked, page_size,
                              page_stride, slot_stride, token.data_ptr()):
        raise IndexError(f"attention_paged: a position below seq_len falls past the block table's {table.shape[1]} pages")
    return token


def write_kv(key, value, key_cache, value_cache, slot_mapping):
    """reference/attention.py write_kv_cache (caches [pages, page_size, Hkv, D] of key's dtype,
    one layout for both) in one call (dot32.c write_kv): the same copies."""
    slots, = _longs(slot_mapping)
    if library().write_kv(key.shape[0], key.shape[1], key.shape[2], key.element_size(), key.data_ptr(),
                          _int64s(key.stride()), value.data_ptr(), _int64s(value.stride()), key_cache.data_ptr(),
                          value_cache.data_ptr(), _int64s(key_cache.stride()), slots.data_ptr(), key_cache.shape[0],
                          key_cache.shape[1]):
        raise IndexError(f"write_kv_cache: a slot falls past the cache's {key_cache.shape[0]} pages")


def attention_prologue(x, wq, wk, wv, q_norm, k_norm, eps, cos, sin, head_dim):
    """reference/linear.py attention_prologue in one call (dot32.c attn_prologue32): x [T, H] and
    the weights of one ACTIVATIONS dtype, fp32 cos/sin [T, D/2]; the fp32/bf16 realisations. No autograd."""
    t, d = x.shape[0], head_dim
    x = _unit_last(x)
    wq, wk, wv, q_norm, k_norm, cos, sin = (w.contiguous() for w in (wq, wk, wv, q_norm, k_norm, cos, sin))
    q = torch.empty(t, wq.shape[0] // d, d, dtype=x.dtype)
    k, v = (torch.empty(t, wk.shape[0] // d, d, dtype=x.dtype) for _ in range(2))
    if library().attn_prologue32(t, x.shape[1], d, q.shape[1], k.shape[1], DTYPES[x.dtype], x.data_ptr(), x.stride(0),
                                 wq.data_ptr(), wk.data_ptr(), wv.data_ptr(), wq.stride(0), q_norm.data_ptr(),
                                 k_norm.data_ptr(), eps, cos.data_ptr(), sin.data_ptr(), int(_kernel(x, wq) == "32p"),
                                 q.data_ptr(), k.data_ptr(), v.data_ptr()):
        raise MemoryError("consistent_ops attention_prologue: out of memory for its buffers")
    return q, k, v


def linear_add_rms_norm(x, weight, residual, norm_weight, eps):
    """reference/linear.py linear_add_rms_norm in one call (dot32.c linear_add_norm32): x [T, K],
    weight [N, K], residual [T, N], all of one ACTIVATIONS dtype; the fp32/bf16 realisations.
    Returns (RMSNorm(y + residual), y + residual), y = linear(x, weight). No autograd."""
    x, residual = _unit_last(x), _unit_last(residual)
    weight, norm_weight = weight.contiguous(), norm_weight.contiguous()
    out, res_out = (torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype) for _ in range(2))
    if library().linear_add_norm32(x.shape[0], x.shape[1], weight.shape[0], DTYPES[x.dtype], x.data_ptr(), x.stride(0),
                                   weight.data_ptr(), weight.stride(0), residual.data_ptr(), residual.stride(0),
                                   norm_weight.data_ptr(), eps, int(_kernel(x, weight) == "32p"), out.data_ptr(),
                                   res_out.data_ptr()):
        raise MemoryError("consistent_ops linear_add_rms_norm: out of memory for its buffers")
    return out, res_out


def mlp(x, gate, up, down):
    """reference/linear.py mlp in one call (dot32.c mlp32): x [T, H], gate/up [I, H], down [H, I], all
    of one ACTIVATIONS dtype; the fp32/bf16 realisations. Returns [T, H]. No autograd."""
    x = _unit_last(x)
    gate, up, down = gate.contiguous(), up.contiguous(), down.contiguous()
    out = torch.empty(x.shape[0], down.shape[0], dtype=x.dtype)
    if library().mlp32(x.shape[0], x.shape[1], gate.shape[0], DTYPES[x.dtype], x.data_ptr(), x.stride(0),
                       gate.data_ptr(), up.data_ptr(), down.data_ptr(), int(_kernel(x, gate) == "32p"), out.data_ptr()):
        raise MemoryError("consistent_ops mlp: out of memory for its buffers")
    return out


def decode_layer(x, residual, w, cos, sin, key_cache, value_cache, slots, layout, scale, chunk):
    """reference/decoder.py's decoder layer for a step of one new token per sequence in one call (dot32.c
    decode_layer32): the calls of rms_norm, attention_prologue, write_kv, attend, linear_add_rms_norm and
    mlp (or moe_router and moe_experts) one by one, so the same bits. x, residual (or None) [T, H] and
    every weight of w (a consistent_ops.DecoderWeights) of one ACTIVATIONS dtype, contiguous; caches
    [pages, page_size, Hkv, D] of x's dtype (one layout); slots int64 [T]; layout: the step's
    attention._PagedLayout (token offsets, rows' positions, seq_lens). Returns (out, new residual). No autograd."""
    t, h = x.shape
    d = w.q_norm.shape[0]
    hq, hkv = w.wq.shape[0] // d, w.wk.shape[0] // d
    _check_offsets(key_cache, value_cache, layout.token_range, hkv, key_cache.stride(2), d, key_cache.stride(3))
    moe = w.experts is not None
    inter = w.experts.down.shape[-1] if moe else w.gate.shape[0]
    out, res_out = torch.empty(t, h, dtype=x.dtype), torch.empty(t, h, dtype=x.dtype)
    gate, up, down = ((w.router, w.experts.gate_up, w.experts.down) if moe else (w.gate, w.up, w.down))
    fields = _int64s((
        t, h, d, hq, hkv, inter, w.router.shape[0] if moe else 0, w.top_k, int(w.norm_topk_prob), DTYPES[x.dtype],
        int(_kernel(x, w.wq) == "32p"), x.data_ptr(), 0 if residual is None else residual.data_ptr(), w.in_norm.data_ptr(), w.wq.data_ptr(),
        w.wk.data_ptr(), w.wv.data_ptr(), w.wq.stride(0), w.q_norm.data_ptr(), w.k_norm.data_ptr(), cos.data_ptr(),
        sin.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(), *key_cache.stride(), slots.data_ptr(),
        key_cache.shape[0], key_cache.shape[1], layout.token.data_ptr(), layout.token.shape[1],
        layout.rows_qpos.data_ptr(), layout.seq_lens.data_ptr(), KV_BLOCK, chunk, w.wo.data_ptr(),
        w.post_norm.data_ptr(), gate.data_ptr(), up.data_ptr(), down.data_ptr(),
        *(up.stride() if moe else (0, 0, 0)), *(down.stride() if moe else (0, 0, 0)), out.data_ptr(), res_out.data_ptr()))
    rc = library().decode_layer32(fields, w.in_eps, w.qk_eps, w.post_eps, scale)
    if rc == -2:
        raise IndexError(f"write_kv_cache: a slot falls past the cache's {key_cache.shape[0]} pages")
    if rc:
        raise MemoryError("consistent_ops decode_layer: out of memory for its buffers")
    return out, res_out
