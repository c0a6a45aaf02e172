"""Attention on Triton: ONE key-block walk for training, prefill, chunked prefill and decode.

A program owns a tile of query ROWS of one sequence and one KV head; a row is a
(token, query head) pair, the G query heads that share the KV head stacked as in the
reference. ``_attend_tile`` walks keys in blocks of KV_BLOCK from position 0, in
order, with the contract's online-softmax update; the varlen (training) and paged
(rollout) kernels are the same kernel and differ only in where a key block is read from
(``_block_rows``: packed K/V by TMA bulk copies on Hopper, the paged cache by pointers;
the arithmetic is the same, so are the bits). A row's bits depend on its q, its position
and the keys only:
- every row sees the same instructions: its scores and output are MMAs (the same k16 steps
  in wgmma's 64-row tiles and mma.sync's 16-row decode tiles), its max is exact in any
  order and its sum is taken in integers (_row_sum), so no tile or warp layout reaches them;
- a block a row cannot see is an exact no-op (a = exp2(0) = 1, p = exp2(-inf) = 0), so
  a tile that walks further for its later rows leaves earlier rows' bits unchanged.
Keys come in KV chunks (contract.KV_CHUNK): the state restarts at each chunk and a tile folds
its chunks' states in order (_fold). Small paged batches (the decode tail) run one program per
(tile, chunk) instead, each writing its chunk's fp32 state; the last of a tile's programs to
finish (an arrival counter per (tile, KV head), common.last_to_arrive) folds them in the same order
with the same instructions (_fold_states), in the same launch: the same bits, many more
programs at long context, no second launch. Over many waves the fold runs in segments of chunks
(_fold_arrivals), each folded by its last arrival while later chunks walk.
The softmax runs in base 2 (contract.ACCUMULATION["triton"]). Grids are sized by shapes
alone: the tiles of every sequence are numbered one after another (_flat_tile), so a mixed
prefill/decode batch is one launch of about T / tile + S programs and captures in a CUDA
graph. The backward (training only) recomputes p from the saved base-2 log-sum-exp with the
same masks; dK/dV are accumulated by the program that owns the key block and a chunk of
queries, over its query tiles in ascending order, the chunks' fp32 partials then added in
ascending chunk order; that program also stores each pair's dS (bf16), and dQ is one matmul
over them by the program that owns the query tile, key blocks in ascending order: 5 matmuls
(FlashAttention's count) with no atomics, so gradients are run-to-run deterministic. The dS
buffer is bounded: query tiles run in windows whose dS fits _DS_BYTES (_ds_windows).
"""
import functools
import struct

import torch
import triton
import triton.language as tl

from ..contract import KV_BLOCK, KV_CHUNK, TRITON_ATTENTION_SUM_BITS, TRITON_TILES, attention_scale
from . import gemm
from .common import arrival_counters, last_to_arrive, launch, pdl_enter


# Forward tile (rows, warps) of training and prefill (decode steps: _DECODE_TILE). On the H200 it
# was the fastest for chunked prefill (2k chunk at 8k: 64/4 0.83 ms vs 128/8 0.93 ms); 128/8 was
# faster for a 16k varlen prompt before TMA (4.95 vs 5.37 ms), with TMA it is not (H100, 2026-12-06:
# 5.13 vs 5.02 ms, 2.63 / 2.63 at 8k x2; 4 stages 5.14), so training takes no tile of its own.
_A = TRITON_TILES["attention"]
_TILE, _STAGES = _A["forward"][:2], _A["forward"][2]
# Decode steps (paged, one new token a sequence: G real rows a tile) take 16-row tiles (a quarter
# of the wasted rows) of 4 warps, each on a quarter of a key block: a row's sum then crosses warps,
# which the integer row sum makes harmless (tests/test_triton_layouts.py). H100 (probe_decode_split,
# 2026-12-06, its float sum: other bits then): 14.4 vs 21.4 us a launch at B=1 x 1k, 17.6 vs 29.5
# at 8k, 50.6 vs 71.1 at 32k against one warp.
_DECODE_TILE = _A["decode"]
# rowsum(p) in int32 fixed point (contract.TRITON_ATTENTION_SUM_BITS): p + _SUM_BIAS stays in the
# bias's binade, whose fp32 ulp is the grid 2^-bits, so its bits less the bias's are round(p * 2^bits).
_SUM_BIAS = tl.constexpr(1.5 * 2.0 ** (23 - TRITON_ATTENTION_SUM_BITS))
_SUM_BIAS_BITS = tl.constexpr(struct.unpack("<i", struct.pack("<f", _SUM_BIAS.value))[0])
_SUM_SCALE = tl.constexpr(2.0 ** -TRITON_ATTENTION_SUM_BITS)
# Backward: the dK/dV kernel (tile: rows, keys, warps) walks every (query tile, key block)
# pair once and also stores the pair's dS (bf16); dQ is then one matmul (dS K) over those
# blocks in key order: 5 matmuls, no atomics, deterministic. dK/dV (64, 64, 4) holds 255
# registers and spills 136 bytes (compiler report), the fastest of the tiles probed
# (probe_attention_bwd); the dQ kernel (_BWD_DQ: warps, stages) 96 registers, no spills.
_BWD_DKDV, _BWD_STAGES, _BWD_DQ = _A["backward_dkdv"], _A["backward_stages"], _A["backward_dq"]
_DELTA_ROWS, _DELTA_WARPS = _A["backward_delta_rows"], _A["backward_delta_warps"]
# dK/dV programs walk the query tiles of one chunk of at least _QCHUNK tokens each, at most
# _CHUNKS chunks (fp32 partials, added in chunk order): the causal walks are unequal, and
# shorter ones balance the SMs better than they cost in partials (H200, probe_attention_bwd:
# 512 / 16 vs 1024 / 8 bwd 3.4 / 1.2 / 1.7 / 3.7 % faster at 4k x4 / 8k x2 / 16k x1 / 4k x1;
# 1024 unsplit: one 4k sequence 1.11 ms vs 1.53). The partials (2 x chunks fp32 copies of K)
# take at most _PART_BYTES: fewer chunks for very long batches (16 up to 16k tokens at 4 x 128).
_QCHUNK, _CHUNKS, _PART_BYTES = _A["backward_query_chunks"]
# The dS blocks of the query tiles launched together (a window) take at most this much
# memory, bounded from shapes for any packing (2 bytes a score; a window holds at least one
# key block's worth of tiles, so this is exceeded only by a window of a single step).
_DS_BYTES = 2 << 30
# Bulk copies (TMA) on Hopper (H200, S=4k x4, probe_attention_bwd): dS stores and loads (bwd
# 3.99 vs 4.30 ms with pointers), q/dO of the dK/dV walk as [TPT, G, D] boxes (3.85 vs 3.99).
# The dK/dV partials stay pointer stores: their 32 KB staging buffer leaves room for one
# program an SM (5.88 ms).
_DS_TMA, _QDO_TMA = True, True
# Packed (training) K/V by bulk copies in the forward (probe_attention): 4.56 vs 5.39 ms at
# 16k x1, 1.28 vs 1.49 at 4k x4, the same bits (184 -> 139 registers). A masked key of another
# packed sequence is read then (p = 0 for it): K/V must be finite, as activations are.
_FWD_TMA = True
# The online softmax runs in base 2 with the logit scale folded into one FMA (two fp32
# operations fewer per score than exp(s * scale - m)): on the H200 the forward got 11-14 %
# faster (probe_attention). qk_scale = scale * log2(e) in fp64, rounded to fp32 once.
_LOG2E = 1.4426950408889634
# Paged batches of fewer programs than this many per SM run one program per KV chunk, if the
# chunks' fp32 states fit _SPLIT_BYTES (sized by the table's capacity: shapes only, so CUDA
# graphs replay the same grid). The split changes no bit; it fills the GPU in the decode tail.
# H200 (bench_triton decode, both launches timed, 2026-12-02), programs = (tiles + S) x KV heads:
# B=1 / 4 x 32k (8 / 20 programs) split 18 / 36 % of the HBM roofline vs 2 / 6 % unsplit, B=32 x
# 16k (144) 61 vs 44 %, B=64 x 8k (288) 63 vs 79 %, B=128 x 4k (576) 79 % unsplit: split below 2
# programs an SM (264).
_SPLIT_WAVES, _SPLIT_BYTES = 2, 256 << 20
# The split fold's software pipeline (_fold_states): 4 stages keep two chunk states in flight while
# one is folded, in the shared memory the key walk used (sm_90 compile: 70 KB a program either way,
# the walk's three K/V stages; 37 KB while the walk read the table in its loop: _held_pages).
_FOLD_STAGES = 4
# FOLD_HALF: a split tile of one token in two (decode) folds its real half of rows alone (the same
# bits: tests). The fold is a serial chain, issue-bound (one warp a scheduler): ~0.24 us a chunk
# over the whole [16, 128] state, ~0.1 over its half (H100, 2026-12-06, probe_fold_length: B=1 x 32k
# 51.3 -> 41.8 us; 8 warps on the half 45.7); in vLLM's 48-layer step B=1 x 32k 6.995 -> 6.479 ms.
_FOLD_HALF = True
# The split fold in segments of _FOLD_SEGMENT chunks (_fold_arrivals) where a launch's chunk programs
# outnumber _SEGMENT_PROGRAMS times the split threshold (B=4 x 32k's 1,024 programs: 2.6 waves of 3 an
# SM, which the decode tile's 70 KB of shared memory allow): a segment folds while later chunks walk,
# so the fold left after the last chunk is a segment's (16 steps) where it was the tile's (64 at 32k:
# ~6 us, ~0.1 us a step, of the H200's 93 us launch at B=4 x 32k); in one wave (B=1 x 32k) the chunks
# arrive together and segments would only add their stores. The same bits either way.
_FOLD_SEGMENT, _SEGMENT_PROGRAMS = 16, 2
# The unsplit paged walk (prefill over the cache, decode of many sequences): a key block's page ids
# read in the block's own iteration make the compiler wait on every K/V copy (sm_90: async_wait num
# = 0); _CARRY_PAGES reads them a block ahead (_walk's CARRY: num > 0, more shared memory a program).
# H100 (2026-12-07, probes `no carry`): a 2k prefill chunk over a 30k cache 2.869 against 2.918 ms,
# over 8k 0.828 against 0.825 (a tie), B=64 x 8k decode 362.0 / 363.3 against 368.0 / 368.2 us (two
# calls); the same bits.
_CARRY_PAGES = True


@triton.jit
def _page_start(page, pages, PAGE: tl.constexpr, OFF32: tl.constexpr):
    """The cache row of a page's first key, the page id clamped into the cache; int32 where every
    element offset of the cache fits it (half the address arithmetic), else int64."""
    page = tl.minimum(tl.maximum(page, 0), pages - 1)
    if OFF32:
        start = page * PAGE
    else:
        start = page.to(tl.int64) * PAGE
    return start


@triton.jit
def _held_pages(seq, c, Table, stride_tab, tab_cols, CHUNK: tl.constexpr, PAGE: tl.constexpr):
    """The table entries of KV chunk c's pages (its first table column col0 and the entries from
    there), read once before the chunk's walk, for a page of a power of two keys. The walk's key
    blocks then pick their page ids from registers (_key_rows): their K/V addresses wait on no load,
    so the software pipeline prefetches them whole blocks ahead (with the table read in the loop the
    sm_90 compile waited on every copy, num = 0, and issued block j + 1's K/V after block j's math:
    a cold cache's full latency every block)."""
    HELD: tl.constexpr = (CHUNK + PAGE - 1) // PAGE
    col0 = (c * CHUNK) // PAGE
    ids = tl.load(Table + seq * stride_tab + tl.minimum(col0 + tl.arange(0, HELD), tab_cols - 1))
    return ids, col0


@triton.jit
def _block_pages(first, seq, Table, stride_tab, tab_cols, KV: tl.constexpr, PAGE: tl.constexpr):
    """The table entries of the pages of the key block from position first (a page holds the
    block, or the block is whole pages: RUNS runs of consecutive keys), the column clamped into
    the table (the carried walk reads one block past its last)."""
    RUNS: tl.constexpr = (KV + PAGE - 1) // PAGE
    return tl.load(Table + seq * stride_tab + tl.minimum(first // PAGE + tl.arange(0, RUNS), tab_cols - 1))


@triton.jit
def _key_rows(kpos, first, seq, seq_len, row0, Table, stride_tab, tab_cols, pages, held, col0, KV: tl.constexpr,
              PAGE: tl.constexpr, PAGED: tl.constexpr, OFF32: tl.constexpr, MASK: tl.constexpr,
              HOLD: tl.constexpr):
    """Storage row of the key positions kpos = first + [0, KV). In a masked block, positions past
    the sequence are clamped to its last key (always written, so finite); the mask excludes them
    later. An unmasked block lies inside the sequence: its keys are runs of consecutive keys on one
    page each, one table lookup a run (sm_90 compile, 2026-12-06: 811 vs 857 SASS instructions a
    block with int32 offsets, 948 vs 1,073 with int64); HOLD: those entries are picked from the
    chunk's held ones (_held_pages; the same entries: the block's columns lie in its chunk).
    Paged: the table column and the page id are clamped into the table and the cache, so metadata
    that no real step has (vLLM's capture and memory-profiling dummies: empty or stale tables,
    sequences longer than a table row) reads inside them; real steps never clamp."""
    if MASK:
        kpos = tl.maximum(tl.minimum(kpos, seq_len - 1), 0)
    if PAGED:
        if (not MASK) and (KV % PAGE == 0 or PAGE % KV == 0):
            RUNS: tl.constexpr = (KV + PAGE - 1) // PAGE      # pages a block spans (1 if a page holds it)
            col = first // PAGE + tl.arange(0, RUNS)
            if HOLD:
                cols = col0 + tl.arange(0, held.shape[0])
                page = tl.sum(tl.where(col[:, None] == cols[None, :], held[None, :], 0), 1)
            else:
                page = _block_pages(first, seq, Table, stride_tab, tab_cols, KV, PAGE)
            start = _page_start(page, pages, PAGE, OFF32) + first % PAGE
            row = tl.reshape(start[:, None] + tl.arange(0, KV // RUNS)[None, :], [KV])
        else:
            page = tl.load(Table + seq * stride_tab + tl.minimum(kpos // PAGE, tab_cols - 1))
            row = _page_start(page, pages, PAGE, OFF32) + kpos % PAGE
        return row
    else:
        return row0 + kpos.to(tl.int64)


@triton.jit
def _block_rows(kpos, seq, seq_len, row0, first, col, Table, stride_tab, tab_cols, pages, held, col0,
                KV: tl.constexpr, PAGE: tl.constexpr, PAGED: tl.constexpr, TMA: tl.constexpr, OFF32: tl.constexpr,
                MASK: tl.constexpr, HOLD: tl.constexpr):
    """Where a key block lies: its storage rows (_key_rows), or for bulk copies of packed
    K/V the (row, column) of its first element (rows past the sequence are masked later)."""
    if TMA:
        return (row0 + first).to(tl.int32), col
    else:
        return _key_rows(kpos, first, seq, seq_len, row0, Table, stride_tab, tab_cols, pages, held, col0, KV, PAGE,
                         PAGED, OFF32, MASK, HOLD)


@triton.jit
def _attend_block(acc, m, l, q, K, V, krow, stride_k, stride_v, kpos, qpos, seq_len, qk_scale,
                  D: tl.constexpr, MASK: tl.constexpr, TMA: tl.constexpr):
    """One KV block of the contract's online softmax (base 2), in its order m, a, p, l, acc."""
    if TMA:  # CUDA-ONLY, packed K/V: host TensorDescriptors [T, Hkv * D]; krow = (first row, column)
        k = K.load([krow[0], krow[1]])
        v = V.load([krow[0], krow[1]])
    else:
        d = tl.arange(0, D)
        k = tl.load(K + krow[:, None] * stride_k + d[None, :])
        v = tl.load(V + krow[:, None] * stride_v + d[None, :])
    qk = tl.dot(q, tl.trans(k))                                      # fp32 [rows, KV_BLOCK]
    if MASK:  # causal and end-of-sequence mask (only diagonal/tail blocks need it)
        visible = (kpos[None, :] <= qpos[:, None]) & (kpos[None, :] < seq_len)
        qk = tl.where(visible, qk, float("-inf"))
    m_new = tl.maximum(m, tl.max(qk, 1) * qk_scale)                  # == max(qk * qk_scale): scale > 0
    m0 = m_new
    if MASK:  # a row that has seen no key of this chunk yet: exponents against 0 (a = p = 0)
        m0 = tl.where(m_new == float("-inf"), 0.0, m_new)
    a = tl.exp2(m - m0)
    p = tl.exp2(tl.fma(qk, qk_scale, -m0[:, None]))                  # one rounding
    l = l * a + _row_sum(p)
    acc = tl.dot(p.to(v.dtype), v, acc * a[:, None])                 # p rounded to v's dtype
    return acc, m_new, l


@triton.jit
def _row_sum(p):
    """The contract's rowsum(p) of a [rows, keys] block: each p rounded to the 2^-bits grid by one
    add, summed as integers (exact in any order), converted once."""
    grid = (p + _SUM_BIAS).to(tl.int32, bitcast=True) - _SUM_BIAS_BITS
    return tl.sum(grid, 1).to(tl.float32) * _SUM_SCALE


@triton.jit
def _fresh(ROWS: tl.constexpr, D: tl.constexpr):
    """An empty online-softmax state: acc 0, row max -inf, row sum 0."""
    return tl.zeros([ROWS, D], tl.float32), tl.full([ROWS], float("-inf"), tl.float32), tl.zeros([ROWS], tl.float32)


@triton.jit
def _walk(facc, fm, fl, acc, m, l, j_lo, j_hi, q, qpos, seq, seq_len, row0, K, V, stride_k, stride_v, Table,
          stride_tab, tab_cols, pages, qk_scale, col, held, col0, ROWS: tl.constexpr, D: tl.constexpr,
          KV: tl.constexpr, CHUNK: tl.constexpr, PAGE: tl.constexpr, PAGED: tl.constexpr, TMA: tl.constexpr,
          OFF32: tl.constexpr, MASK: tl.constexpr, FOLD: tl.constexpr, HOLD: tl.constexpr,
          CARRY: tl.constexpr = False):
    """Key blocks j_lo .. j_hi - 1 of the contract's walk, in ONE loop (a loop a chunk would restart
    the software pipeline every CHUNK // KV blocks). FOLD: at the first block of every chunk but
    chunk 0, the state (acc, m, l) of the chunk before is folded into (facc, fm, fl) and restarts;
    else the blocks lie in one chunk and (facc, fm, fl) pass through. HOLD: the blocks lie in one
    chunk whose page ids are held (_held_pages: held, col0). CARRY (unmasked paged blocks of whole
    pages or within one): block j + 1's page ids are read in block j's iteration and carried to the
    next, so no K/V address waits on a load of its own iteration and the software pipeline can keep
    copies in flight; the same ids, so the same rows and bits."""
    offs = tl.arange(0, KV)
    if CARRY:
        ids = _block_pages(j_lo * KV, seq, Table, stride_tab, tab_cols, KV, PAGE)
    for j in range(j_lo, j_hi):
        if FOLD:
            if (j > 0) & (j % (CHUNK // KV) == 0):
                facc, fm, fl = _fold(facc, fm, fl, acc, m, l)
                acc, m, l = _fresh(ROWS, D)
        kpos = j * KV + offs
        if CARRY:   # this block's ids as a held set of its own columns (_key_rows picks each run's)
            nxt = _block_pages((j + 1) * KV, seq, Table, stride_tab, tab_cols, KV, PAGE)
            krow = _block_rows(kpos, seq, seq_len, row0, j * KV, col, Table, stride_tab, tab_cols, pages, ids,
                               (j * KV) // PAGE, KV, PAGE, PAGED, TMA, OFF32, MASK, True)
            ids = nxt
        else:
            krow = _block_rows(kpos, seq, seq_len, row0, j * KV, col, Table, stride_tab, tab_cols, pages, held, col0,
                               KV, PAGE, PAGED, TMA, OFF32, MASK, HOLD)
        acc, m, l = _attend_block(acc, m, l, q, K, V, krow, stride_k, stride_v, kpos, qpos, seq_len,
                                  qk_scale, D, MASK, TMA)
    return facc, fm, fl, acc, m, l


@triton.jit
def _attend_chunk(c, q, qpos, seq, seq_len, row0, n_full, n_blocks, K, V, stride_k, stride_v, Table, stride_tab,
                  tab_cols, pages, qk_scale, col, ROWS: tl.constexpr, D: tl.constexpr, KV: tl.constexpr,
                  CHUNK: tl.constexpr, PAGE: tl.constexpr, PAGED: tl.constexpr, TMA: tl.constexpr,
                  OFF32: tl.constexpr, HOLD_PAGES: tl.constexpr):
    """The contract's walk over the key blocks of KV chunk c, from a fresh state: blocks
    below n_full are seen whole by every row of the tile (no mask), blocks from n_blocks on
    by none. Returns the chunk's unnormalised acc, row max m and sum l."""
    acc, m, l = _fresh(ROWS, D)
    j0 = c * (CHUNK // KV)
    j1 = tl.minimum(j0 + CHUNK // KV, n_blocks)
    # a page of a power of two keys: the chunk's pages are whole (HOLD_PAGES off: probes only)
    HOLD: tl.constexpr = HOLD_PAGES and (PAGED and (PAGE & (PAGE - 1)) == 0)
    if HOLD:
        held, col0 = _held_pages(seq, c, Table, stride_tab, tab_cols, CHUNK, PAGE)
    else:
        held, col0 = 0, 0
    _, _, _, acc, m, l = _walk(acc, m, l, acc, m, l, j0, tl.minimum(j1, n_full), q, qpos, seq, seq_len, row0, K, V,
                               stride_k, stride_v, Table, stride_tab, tab_cols, pages, qk_scale, col, held, col0, ROWS,
                               D, KV, CHUNK, PAGE, PAGED, TMA, OFF32, False, False, HOLD)
    _, _, _, acc, m, l = _walk(acc, m, l, acc, m, l, tl.maximum(j0, n_full), j1, q, qpos, seq, seq_len, row0, K, V,
                               stride_k, stride_v, Table, stride_tab, tab_cols, pages, qk_scale, col, held, col0, ROWS,
                               D, KV, CHUNK, PAGE, PAGED, TMA, OFF32, True, False, HOLD)
    return acc, m, l


@triton.jit
def _fold(facc, fm, fl, acc, m, l):
    """The contract's fold of a chunk's state (acc, m, l) into the fold of the chunks before
    it (base 2; each product rounded, then the sum: no FMA); a row that sees no key of the
    chunk keeps its state. Folding into an empty state (fm = -inf, facc = fl = 0) gives the
    chunk's state bit for bit (0 * 0 + acc * 1)."""
    top = tl.maximum(fm, m)
    x = tl.exp2(fm - top)
    y = tl.exp2(m - top)
    seen = m != float("-inf")
    return (tl.where(seen[:, None], facc * x[:, None] + acc * y[:, None], facc), tl.where(seen, top, fm),
            tl.where(seen, fl * x + l * y, fl))


@triton.jit
def _attend_tile(q, qpos, seq, seq_len, row0, first_pos, last_pos, K, V, stride_k, stride_v,
                 Table, stride_tab, tab_cols, pages, qk_scale, col, ROWS: tl.constexpr, D: tl.constexpr,
                 KV: tl.constexpr, CHUNK: tl.constexpr, PAGE: tl.constexpr, PAGED: tl.constexpr,
                 TMA: tl.constexpr, OFF32: tl.constexpr, CARRY_PAGES: tl.constexpr):
    """The contract's walk over key blocks 0, 1, ... for a tile whose query positions
    lie in [first_pos, last_pos], chunk by chunk, folded in order. Returns the unnormalised
    acc, the row max m and sum l of the fold. CARRY_PAGES: the unmasked blocks' page ids carried
    one block ahead (_walk's CARRY) where a block is whole pages or lies in one."""
    n_full = (first_pos + 1) // KV      # blocks every row sees entirely: the mask is a no-op
    n_blocks = last_pos // KV + 1       # later blocks are invisible to every row of the tile
    facc, fm, fl = _fresh(ROWS, D)
    acc, m, l = _fresh(ROWS, D)
    CARRY: tl.constexpr = CARRY_PAGES and (PAGED and (KV % PAGE == 0 or PAGE % KV == 0))
    facc, fm, fl, acc, m, l = _walk(facc, fm, fl, acc, m, l, 0, n_full, q, qpos, seq, seq_len, row0, K, V, stride_k,
                                    stride_v, Table, stride_tab, tab_cols, pages, qk_scale, col, 0, 0, ROWS, D, KV,
                                    CHUNK, PAGE, PAGED, TMA, OFF32, False, True, False, CARRY)
    facc, fm, fl, acc, m, l = _walk(facc, fm, fl, acc, m, l, n_full, n_blocks, q, qpos, seq, seq_len, row0, K, V,
                                    stride_k, stride_v, Table, stride_tab, tab_cols, pages, qk_scale, col, 0, 0, ROWS,
                                    D, KV, CHUNK, PAGE, PAGED, TMA, OFF32, True, True, False)
    return _fold(facc, fm, fl, acc, m, l)


@triton.jit
def _tile_rows(tile, n_new, ROWS: tl.constexpr, G: tl.constexpr, TPT: tl.constexpr):
    """Rows of a tile: token index within this step's tokens, query head within the
    KV group, and whether the row is real (a partial last tile has padding rows)."""
    r = tl.arange(0, ROWS)
    tok = tile * TPT + r // G
    return tok, r % G, (r < TPT * G) & (tok < n_new)


@triton.jit
def _seq_lens(Starts, S, SB: tl.constexpr):
    """Lanes 0 .. SB-1, and the first token rows and token counts of sequences 0 .. S-1 (0 past S)."""
    i = tl.arange(0, SB)
    inb = i < S
    first = tl.load(Starts + i, mask=inb, other=0)
    return i, first, tl.load(Starts + i + 1, mask=inb, other=0) - first


@triton.jit
def _lane(x, i, seq):
    """x[seq] of the lanes i, from registers."""
    return tl.sum(tl.where(i == seq, x, 0), 0)


@triton.jit
def _flat_index(p, i, units):
    """(lane, index in lane) of unit p when the units of lanes i are numbered one after
    another, lane 0's first; lane >= the lane count: p is past the last unit."""
    end = tl.cumsum(units, 0)
    seq = tl.sum((end <= p).to(tl.int32), 0)
    return seq, p - tl.sum(tl.where(i == seq, end - units, 0), 0)


@triton.jit
def _flat_tile(p, Starts, S, UNIT: tl.constexpr, SB: tl.constexpr):
    """(sequence, tile) of program p when the tiles of UNIT tokens of every sequence are
    numbered one after another, sequence 0's first. The grid is sized by shapes alone
    (min(T, cdiv(T, UNIT) + S) bounds the tiles of any batch of T tokens in S sequences), so a
    mixed batch launches no program per (sequence, longest query) pair, and nothing is
    read back on the host; seq >= S: p is past the last tile. SB: a power of two >= S."""
    i, _, lens = _seq_lens(Starts, S, SB)
    return _flat_index(p, i, (lens + UNIT - 1) // UNIT)


@triton.jit
def _tile_setup(seq, tile, i, firsts, lens, kv_lens, G: tl.constexpr, TPT: tl.constexpr, ROWS: tl.constexpr,
                PAGED: tl.constexpr):
    """A tile's rows: first token row q0, rows' token and query head within the KV group,
    which rows are real, their positions, the tile's first and last position and seq_len.
    Padding rows get a real prefix and are never stored. The sequence's first row, token count
    and seq_len are picked from lanes i of every sequence's (firsts, lens, kv_lens), read with
    the lanes that found seq: no load of its own (one dependent read fewer before the walk's
    first K/V copy than reading them at seq, which was slower on the H100, 2026-12-07)."""
    q0, n_new = _lane(firsts, i, seq), _lane(lens, i, seq)
    if PAGED:                                        # includes this step's tokens
        seq_len = _lane(kv_lens, i, seq)
    else:                                            # packed sequences: no cached tokens
        seq_len = n_new
    ctx = seq_len - n_new                            # tokens cached before this step
    tok, hg, valid = _tile_rows(tile, n_new, ROWS, G, TPT)
    qpos = tl.minimum(ctx + tok, seq_len - 1)
    first_pos = ctx + tile * TPT
    last_pos = tl.minimum(first_pos + TPT - 1, seq_len - 1)
    return q0, (q0 + tok).to(tl.int64), hg, valid, qpos, first_pos, last_pos, seq_len


@triton.jit
def _attn_fwd_kernel(Q, K, V, O, LSE, WAcc, WML, Count, QStart, SeqLen, Table, S, T,
                     stride_qt, stride_qh, stride_k, stride_kh, stride_v, stride_vh,
                     stride_ot, stride_oh, stride_tab, tab_cols, pages, qk_scale,
                     G: tl.constexpr, TPT: tl.constexpr, ROWS: tl.constexpr, D: tl.constexpr,
                     KV: tl.constexpr, CHUNK: tl.constexpr, PAGE: tl.constexpr, PAGED: tl.constexpr,
                     STORE_LSE: tl.constexpr, SB: tl.constexpr, TMA: tl.constexpr, SPLIT: tl.constexpr,
                     FOLD_STAGES: tl.constexpr, FOLD_HALF: tl.constexpr, OFF32: tl.constexpr,
                     HOLD: tl.constexpr, SEG: tl.constexpr, LAST_FIRST: tl.constexpr, CARRY: tl.constexpr,
                     PDL: tl.constexpr = False):
    pdl_enter(PDL)
    # 1. which tile: latest tiles (longest walks) launch first for causal load balance; the
    # sequences' lengths read beside their offsets, so the tile's setup waits on no load
    i, firsts, lens = _seq_lens(QStart, S, SB)
    kv_lens = tl.load(SeqLen + i, mask=i < S, other=0) if PAGED else lens
    seq, tile = _flat_index(tl.num_programs(0) - 1 - tl.program_id(0), i, (lens + TPT - 1) // TPT)
    if seq >= S:
        return
    kvh = tl.program_id(1)
    # 2. rows and their positions
    q0, qrow, hg, valid, qpos, first_pos, last_pos, seq_len = _tile_setup(seq, tile, i, firsts, lens, kv_lens,
                                                                          G, TPT, ROWS, PAGED)
    c = tl.program_id(2)                             # SPLIT: this program's KV chunk (else 0)
    if LAST_FIRST:                                   # (tests: the chunks arrive last first)
        c = tl.num_programs(2) - 1 - c
    if c > last_pos // CHUNK:                        # no row of the tile sees it
        return
    head = kvh * G + hg
    d = tl.arange(0, D)
    q = tl.load(Q + qrow[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=valid[:, None], other=0.0)
    # 3. the key walk (shared by every path): the tile's chunks folded, or one chunk's state
    if TMA:
        Kh, Vh = K, V
    else:
        Kh, Vh = K + kvh * stride_kh, V + kvh * stride_vh
    store = valid
    if SPLIT:
        acc, m, l = _attend_chunk(c, q, qpos, seq, seq_len, q0.to(tl.int64), (first_pos + 1) // KV, last_pos // KV + 1,
                                  Kh, Vh, stride_k, stride_v, Table, stride_tab, tab_cols, pages, qk_scale, kvh * D,
                                  ROWS, D, KV, CHUNK, PAGE, PAGED, TMA, OFF32, HOLD)
        # a tile of several chunks: its state, folded by the tile's last program; of one: its output
        several = (qpos * 0 + last_pos) >= CHUNK       # per row (a scalar mask is not one on every backend)
        hq = G * tl.num_programs(1)
        _chunk_store(WAcc, WML, c, qrow, head, valid & several, acc, m, l, T, hq, tl.num_programs(2), D)
        store = valid & ~several
        if last_pos >= CHUNK:
            # the tile's chunk programs: none past the table's capacity (only vLLM's dummy runs have
            # sequences longer than a table row; their outputs are never read)
            n = tl.minimum(last_pos // CHUNK + 1, tl.num_programs(2))
            if (FOLD_HALF and TPT >= 2) and (last_pos - first_pos < TPT // 2):
                # the tile's real rows are its first half (a decode step: one token of TPT): those
                # alone are folded (half the elements a thread: 98 SASS instructions a step, not
                # 152) and stored here; the same instructions on each real row, so the same bits
                tok, hg2, valid2 = _tile_rows(tile, tile * TPT + last_pos - first_pos + 1, ROWS // 2, G, TPT)
                qrow2, head2 = (q0 + tok).to(tl.int64), kvh * G + hg2
                done, acc2, _, l2 = _fold_arrivals(WAcc, WML, Count, c, n, qrow2, head2, valid2, T, hq, ROWS // 2, D,
                                                   SEG, FOLD_STAGES)
                if done:
                    _store_out(O, qrow2, head2, stride_ot, stride_oh, acc2, l2, valid2, D)
            else:
                done, acc, m, l = _fold_arrivals(WAcc, WML, Count, c, n, qrow, head, valid, T, hq, ROWS, D, SEG,
                                                 FOLD_STAGES)
                if done:
                    store = valid
    else:
        acc, m, l = _attend_tile(q, qpos, seq, seq_len, q0.to(tl.int64), first_pos, last_pos, Kh, Vh,
                                 stride_k, stride_v, Table, stride_tab, tab_cols, pages, qk_scale, kvh * D, ROWS,
                                 D, KV, CHUNK, PAGE, PAGED, TMA, OFF32, CARRY)
    # 4. out = acc / l (IEEE division), rounded to the input dtype
    _store_out(O, qrow, head, stride_ot, stride_oh, acc, l, store, D)
    if STORE_LSE:  # log-sum-exp for the backward's recomputation of p
        tl.store(LSE + qrow * (G * tl.num_programs(1)) + head, m + tl.log2(l), mask=valid)   # base 2


@triton.jit
def _store_out(O, qrow, head, stride_ot, stride_oh, acc, l, mask, D: tl.constexpr):
    """Rows (token qrow, query head) of the output: acc / l (IEEE division) in O's dtype."""
    out = tl.div_rn(acc, l[:, None])
    tl.store(O + qrow[:, None] * stride_ot + head[:, None] * stride_oh + tl.arange(0, D)[None, :],
             out.to(O.dtype.element_ty), mask=mask[:, None])


@triton.jit
def _chunk_ptrs(WAcc, WML, c, qrow, head, T, HQ, chunks, D: tl.constexpr):
    """Where chunk c's fp32 state of rows (token qrow, query head) lies: acc in WAcc [chunks,
    T, HQ, D], m and l in WML [2, chunks, T, HQ]. From the chunk's base, a scalar, by int32 offsets
    (_forward splits only where the states' elements fit int32) that do not depend on c: a fold
    step adds one base."""
    n = T * HQ
    r = qrow.to(tl.int32) * HQ + head
    acc, ml = WAcc + c * n * D, WML + c * n
    return acc + (r[:, None] * D + tl.arange(0, D)[None, :]), ml + r, ml + chunks * n + r


@triton.jit
def _chunk_store(WAcc, WML, c, qrow, head, valid, acc, m, l, T, HQ, chunks, D: tl.constexpr):
    pa, pm, pl = _chunk_ptrs(WAcc, WML, c, qrow, head, T, HQ, chunks, D)
    tl.store(pa, acc, mask=valid[:, None])
    tl.store(pm, m, mask=valid)
    tl.store(pl, l, mask=valid)


@triton.jit
def _fold_arrivals(WAcc, WML, Count, c, n, qrow, head, valid, T, HQ, R: tl.constexpr, D: tl.constexpr,
                   SEG: tl.constexpr, STAGES: tl.constexpr):
    """Chunk c's arrival, its state stored, and the folds it then owes. A tile's n chunks fold in
    segments of SEG (0: one segment of all n), a counter each: segment s's last arrival (of its
    chunks' programs and, for s > 0, the folder of s - 1) folds its chunks onto the fold of those
    before, which the folder of s - 1 stored in the slot of its last chunk (fp32, read back exact):
    _fold_states' one left fold in chunk order, cut into pieces, so the same bits; the folds of early
    segments run while later chunks still walk. A folder whose next segment has all arrived goes on
    with it. Returns (done, acc, m, l) of R rows: done where this program folded the last segment
    (acc, m, l then the fold of all n states)."""
    size = n if SEG == 0 else SEG
    last = (n - 1) // size
    per = tl.num_programs(0) * tl.num_programs(1)     # counters a segment: one per (tile program, KV head)
    mine = Count + tl.program_id(1) * tl.num_programs(0) + tl.program_id(0)
    s0 = c // size
    go = last_to_arrive(mine + s0 * per, tl.minimum(size, n - s0 * size) + (s0 > 0).to(tl.int32))
    done = s0 < 0                                      # False, as a tensor (a loop-carried value)
    acc, m, l = _fresh(R, D)
    for s in range(s0, last + 1):
        if go:
            hi = tl.minimum(s * size + size, n)
            acc, m, l = _fold_states(WAcc, WML, qrow, head, valid, T, HQ, tl.num_programs(2),
                                     tl.maximum(s * size - 1, 0), hi, D, STAGES)
            if s == last:
                done = go
            else:
                _chunk_store(WAcc, WML, hi - 1, qrow, head, valid, acc, m, l, T, HQ, tl.num_programs(2), D)
                go = last_to_arrive(mine + (s + 1) * per, tl.minimum(size, n - (s + 1) * size) + 1)
    return done, acc, m, l


@triton.jit
def _load_state(WAcc, WML, c, qrow, head, valid, T, HQ, chunks, D: tl.constexpr):
    """Chunk c's stored state (acc, m, l), read past L1 (other programs wrote it); invalid rows
    an empty state."""
    pa, pm, pl = _chunk_ptrs(WAcc, WML, c, qrow, head, T, HQ, chunks, D)
    return (tl.load(pa, mask=valid[:, None], other=0.0, cache_modifier=".cg"),
            tl.load(pm, mask=valid, other=float("-inf"), cache_modifier=".cg"),
            tl.load(pl, mask=valid, other=0.0, cache_modifier=".cg"))


@triton.jit
def _fold_states(WAcc, WML, qrow, head, valid, T, HQ, chunks, first, end, D: tl.constexpr, STAGES: tl.constexpr):
    """The states in slots first .. end-1 of a split tile folded in slot order: _attend_tile's
    order and instructions (slot first: chunk 0's state, or the fold up to it). Returns the fold's
    acc, m and l. The fold is a serial chain, and a step
    that waits on its own loads takes a round trip to L2 (~0.75 us a chunk on the H100, 2026-12-05:
    B=1 x 32k, 64 chunks, 67 us a launch, 8k 31 us): the states are read through the software
    pipeline instead (cp.async into shared memory, STAGES - 2 chunks ahead of the one folded;
    tests/test_triton_layouts.py checks that the compiler does)."""
    acc, m, l = _load_state(WAcc, WML, first, qrow, head, valid, T, HQ, chunks, D)
    m = tl.where(valid, m, 0.0)          # invalid rows: finite, never stored
    l = tl.where(valid, l, 1.0)
    for c in tl.range(first + 1, end, num_stages=STAGES):
        cacc, cm, cl = _load_state(WAcc, WML, c, qrow, head, valid, T, HQ, chunks, D)
        acc, m, l = _fold(acc, m, l, cacc, cm, cl)
    return acc, m, l


@triton.jit
def _bwd_delta_kernel(O, DO, Delta, rows_total, D: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """delta = rowsum(dO * O) in fp32 for BLOCK (token, head) rows (o, dO contiguous)."""
    pdl_enter(PDL)
    r = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ptr = r.to(tl.int64)[:, None] * D + tl.arange(0, D)[None, :]
    inb = r < rows_total
    do = tl.load(DO + ptr, mask=inb[:, None], other=0.0)
    o = tl.load(O + ptr, mask=inb[:, None], other=0.0)
    tl.store(Delta + r, tl.sum(do.to(tl.float32) * o.to(tl.float32), 1), mask=inb)


@triton.jit
def _ds_before(t, TPT: tl.constexpr, BLOCK_N: tl.constexpr):
    """dS blocks of a sequence's query tiles 0 .. t-1: tile u takes u // R + 1 + E blocks, at
    least the key blocks it sees (R = BLOCK_N // TPT; E = 1 where TPT does not divide
    BLOCK_N), each tile's after the previous one's. _ds_before_host is the same count."""
    R: tl.constexpr = BLOCK_N // TPT
    E: tl.constexpr = (BLOCK_N % TPT + TPT - 1) // TPT
    q = t // R
    return t * (1 + E) + R * (q * (q - 1) // 2) + (t % R) * q


def _ds_before_host(t, tpt, keys):
    """_ds_before on the host (the buffer's bound)."""
    r, e = keys // tpt, int(keys % tpt != 0)
    q = t // r
    return t * (1 + e) + r * (q * (q - 1) // 2) + (t % r) * q


@triton.jit
def _ds_layout(seq, i, lens, u0, u1, TPT: tl.constexpr, BLOCK_N: tl.constexpr):
    """First dS block of sequence seq among those of query tiles u0 <= t < u1 (a window):
    the sequences' tiles one after another (_ds_before within a sequence)."""
    t_end = tl.minimum((lens + TPT - 1) // TPT, u1)
    blocks = tl.where(t_end > u0, _ds_before(t_end, TPT, BLOCK_N) - _ds_before(u0, TPT, BLOCK_N), 0)
    return tl.sum(tl.where(i < seq, blocks.to(tl.int64), 0), 0) - _ds_before(u0, TPT, BLOCK_N)


@triton.jit
def _ds_ptrs(DS, block, ROWS: tl.constexpr, BLOCK_N: tl.constexpr):
    off = block.to(tl.int64) * (BLOCK_N * ROWS)
    return DS + off + tl.arange(0, BLOCK_N)[:, None] * ROWS + tl.arange(0, ROWS)[None, :]


@triton.jit
def _ds_store(DS, block, dst, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, TMA: tl.constexpr):
    if TMA:  # CUDA-ONLY: DS is a host TensorDescriptor over [blocks * BLOCK_N, ROWS] (bulk store)
        DS.store([(block * BLOCK_N).to(tl.int32), 0], dst)
    else:
        tl.store(_ds_ptrs(DS, block, ROWS, BLOCK_N), dst)


@triton.jit
def _ds_load(DS, block, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, TMA: tl.constexpr):
    if TMA:  # CUDA-ONLY, as _ds_store
        return DS.load([(block * BLOCK_N).to(tl.int32), 0])
    else:
        return tl.load(_ds_ptrs(DS, block, ROWS, BLOCK_N))


@triton.jit
def _bwd_dkdv_tile(dk, dv, k, v, Q, DO, LSE, Delta, DS, ds_block, s0, n, kvh, t, kpos, stride_t, qk_scale,
                   G: tl.constexpr, TPT: tl.constexpr, ROWS: tl.constexpr, D: tl.constexpr,
                   HQ: tl.constexpr, BLOCK_N: tl.constexpr, MASK: tl.constexpr, TMA: tl.constexpr,
                   QDO_TMA: tl.constexpr):
    tok, hg, valid = _tile_rows(t, n, ROWS, G, TPT)
    head = kvh * G + hg
    qrow = (s0 + tok).to(tl.int64)
    if QDO_TMA:  # CUDA-ONLY: [T, Hq, D] descriptors, box [TPT, G, D]: rows past n hold other
        # tokens (finite) or zeros; the mask below gives them p = 0, so their dS is an exact 0
        q = Q.load([(s0 + t * TPT).to(tl.int32), kvh * G, 0]).reshape(ROWS, D)
        do = DO.load([(s0 + t * TPT).to(tl.int32), kvh * G, 0]).reshape(ROWS, D)
    else:        # padding rows load q = do = 0: their dS is an exact 0
        qptr = qrow[:, None] * stride_t + head[:, None] * D + tl.arange(0, D)[None, :]
        q = tl.load(Q + qptr, mask=valid[:, None], other=0.0)
        do = tl.load(DO + qptr, mask=valid[:, None], other=0.0)
    lse = tl.load(LSE + qrow * HQ + head, mask=valid, other=0.0)
    delta = tl.load(Delta + qrow * HQ + head, mask=valid, other=0.0)
    pt = tl.exp2(tl.fma(tl.dot(k, tl.trans(q)), qk_scale, -lse[None, :]))   # [keys, rows]
    if MASK:  # causal, and for bulk-copied q/dO rows past the sequence (a partial last tile)
        if QDO_TMA:
            pt = tl.where((kpos[:, None] <= tok[None, :]) & valid[None, :], pt, 0.0)
        else:
            pt = tl.where(kpos[:, None] <= tok[None, :], pt, 0.0)
    dv = tl.dot(pt.to(do.dtype), do, dv)
    dst = (pt * (tl.dot(v, tl.trans(do)) - delta[None, :])).to(q.dtype)
    # this (tile, key block)'s dS, for the dQ kernel: exact 0 where a row cannot see a key
    _ds_store(DS, ds_block, dst, ROWS, BLOCK_N, TMA)
    dk = tl.dot(dst, q, dk)
    return dk, dv


@triton.jit
def _part_block(j, c, kvh, fb, chunks, hkv, part_blocks, BLOCK_N: tl.constexpr, D: tl.constexpr):
    """Element offset of a partial block in Part [dK / dV (j), chunk c, KV head, flat key
    block fb, BLOCK_N, D], in int64 (chunks may be a constexpr 1: no .to() on it)."""
    return (((j * chunks + c) * hkv + kvh).to(tl.int64) * part_blocks + fb) * (BLOCK_N * D)


@triton.jit
def _bwd_dkdv_kernel(Q, K, V, DO, LSE, Delta, Part, DS, Cu, S, u0, u1, chunks, stride_t, stride_kt, part_blocks,
                     ds_blocks, qk_scale, G: tl.constexpr, TPT: tl.constexpr, ROWS: tl.constexpr,
                     D: tl.constexpr, BLOCK_N: tl.constexpr, HQ: tl.constexpr, QT: tl.constexpr, SB: tl.constexpr,
                     TMA: tl.constexpr, QDO_TMA: tl.constexpr, PDL: tl.constexpr = False):
    """fp32 partial dK, dV of one key block over the query tiles of one chunk of QT tiles
    (tiles walked in ascending order, no atomics) at Part[0 / 1, chunk], and the pairs' dS
    blocks for the dQ kernel. One launch covers the tiles u0 <= t < u1 (a window: its dS
    blocks fit the buffer); a chunk cut by a window boundary continues the accumulation
    its earlier window stored (same order, same bits). _sum_parts_kernel adds a block's
    chunks in ascending order. Chunks split the long walks of early key blocks into more
    programs (few long sequences still fill the GPU)."""
    pdl_enter(PDL)
    i, _, lens = _seq_lens(Cu, S, SB)
    seen = tl.where((lens + TPT - 1) // TPT > u0, (tl.minimum(lens, u1 * TPT) + BLOCK_N - 1) // BLOCK_N, 0)
    seq, blk = _flat_index(tl.program_id(0), i, seen)
    if seq >= S:
        return
    c = u0 // QT + tl.program_id(1)
    kvh = tl.program_id(2)
    s0 = tl.load(Cu + seq)
    n = tl.load(Cu + seq + 1) - s0
    n0 = blk * BLOCK_N
    first = tl.maximum(n0 // TPT, c * QT)                        # the chunk's first tile seeing these keys
    t_lo = tl.maximum(first, u0)
    t_hi = tl.minimum(tl.minimum(tl.cdiv(n, TPT), (c + 1) * QT), u1)
    if t_lo >= t_hi:                                              # no query of the window sees them
        return
    ds_blk = kvh * ds_blocks + _ds_layout(seq, i, lens, u0, u1, TPT, BLOCK_N) + blk   # + tile t's offset
    d = tl.arange(0, D)
    kpos = n0 + tl.arange(0, BLOCK_N)
    kin = kpos < n
    kptr = (s0 + kpos).to(tl.int64)[:, None] * stride_kt + kvh * D + d[None, :]
    k = tl.load(K + kptr, mask=kin[:, None], other=0.0)
    v = tl.load(V + kptr, mask=kin[:, None], other=0.0)
    # whole Part blocks, so no masks and no [BLOCK_N, D] pointer tensor kept alive across the
    # walk (registers)
    fb = tl.sum(tl.where(i < seq, (lens + BLOCK_N - 1) // BLOCK_N, 0), 0) + blk
    pk = Part + _part_block(0, c, kvh, fb, chunks, tl.num_programs(2), part_blocks, BLOCK_N, D)
    pv = Part + _part_block(1, c, kvh, fb, chunks, tl.num_programs(2), part_blocks, BLOCK_N, D)
    poff = tl.arange(0, BLOCK_N)[:, None] * D + d[None, :]
    dk = tl.zeros([BLOCK_N, D], tl.float32)
    dv = tl.zeros([BLOCK_N, D], tl.float32)
    if first < u0:                                                # an earlier window began this chunk
        dk = tl.load(pk + poff)
        dv = tl.load(pv + poff)
    # tiles [t_lo, t_mid) see part of the keys, [t_mid, t_end) all of them; with bulk-copied
    # q/dO a partial last tile of the sequence (rows past n) is walked with the mask too
    t_mid = tl.maximum(tl.minimum(tl.cdiv(n0 + BLOCK_N - 1, TPT), t_hi), t_lo)
    t_end = tl.maximum(tl.minimum(n // TPT, t_hi), t_mid) if QDO_TMA else t_hi
    for t in range(t_lo, t_mid):
        dk, dv = _bwd_dkdv_tile(dk, dv, k, v, Q, DO, LSE, Delta, DS, ds_blk + _ds_before(t, TPT, BLOCK_N),
                                s0, n, kvh, t, kpos, stride_t, qk_scale, G, TPT, ROWS, D, HQ, BLOCK_N, True,
                                TMA, QDO_TMA)
    for t in range(t_mid, t_end):
        dk, dv = _bwd_dkdv_tile(dk, dv, k, v, Q, DO, LSE, Delta, DS, ds_blk + _ds_before(t, TPT, BLOCK_N),
                                s0, n, kvh, t, kpos, stride_t, qk_scale, G, TPT, ROWS, D, HQ, BLOCK_N, False,
                                TMA, QDO_TMA)
    for t in range(t_end, t_hi):
        dk, dv = _bwd_dkdv_tile(dk, dv, k, v, Q, DO, LSE, Delta, DS, ds_blk + _ds_before(t, TPT, BLOCK_N),
                                s0, n, kvh, t, kpos, stride_t, qk_scale, G, TPT, ROWS, D, HQ, BLOCK_N, True,
                                TMA, QDO_TMA)
    tl.store(pk + poff, dk)
    tl.store(pv + poff, dv)


@triton.jit
def _bwd_dq_kernel(DS, K, DQ, Cu, S, u0, u1, stride_t, stride_kt, ds_blocks, scale,
                   G: tl.constexpr, TPT: tl.constexpr, ROWS: tl.constexpr, D: tl.constexpr,
                   BLOCK_N: tl.constexpr, SB: tl.constexpr, TMA: tl.constexpr, PDL: tl.constexpr = False):
    """dQ of one query tile u0 <= t < u1 (the window): its dS blocks (written by the dK/dV
    kernel) times K, key blocks walked from 0 in order into one fp32 accumulator."""
    pdl_enter(PDL)
    i, _, lens = _seq_lens(Cu, S, SB)
    tiles = tl.maximum(tl.minimum((lens + TPT - 1) // TPT, u1) - u0, 0)
    seq, w_t = _flat_index(tl.num_programs(0) - 1 - tl.program_id(0), i, tiles)   # long walks first
    if seq >= S:
        return
    kvh = tl.program_id(1)
    t = u0 + w_t
    s0 = tl.load(Cu + seq)
    n = tl.load(Cu + seq + 1) - s0
    tok, hg, valid = _tile_rows(t, n, ROWS, G, TPT)
    ds_blk = kvh * ds_blocks + _ds_layout(seq, i, lens, u0, u1, TPT, BLOCK_N) + _ds_before(t, TPT, BLOCK_N)
    kk = tl.arange(0, BLOCK_N)
    d = tl.arange(0, D)
    dq = tl.zeros([ROWS, D], tl.float32)
    for j in range(0, tl.cdiv(tl.minimum((t + 1) * TPT, n), BLOCK_N)):
        dst = _ds_load(DS, ds_blk + j, ROWS, BLOCK_N, TMA)                     # [keys, rows]
        krow = (s0 + tl.minimum(j * BLOCK_N + kk, n - 1)).to(tl.int64)
        k = tl.load(K + krow[:, None] * stride_kt + kvh * D + d[None, :])
        dq = tl.dot(tl.trans(dst), k, dq)
    head = kvh * G + hg
    qptr = (s0 + tok).to(tl.int64)[:, None] * stride_t + head[:, None] * D + d[None, :]
    tl.store(DQ + qptr, (dq * scale).to(DQ.dtype.element_ty), mask=valid[:, None])


@triton.jit
def _sum_parts_kernel(Part, Out, Cu, S, chunks, stride_kt, stride_out, scale, TPT: tl.constexpr,
                      D: tl.constexpr, BLOCK_N: tl.constexpr, QT: tl.constexpr, SB: tl.constexpr,
                      PDL: tl.constexpr = False):
    """dK (axis 2 = 0, times the logit scale) or dV (1) of one key block: the partials of the
    chunks that see it added in ascending chunk order, rounded once to the output dtype."""
    pdl_enter(PDL)
    seq, blk = _flat_tile(tl.program_id(0), Cu, S, BLOCK_N, SB)
    if seq >= S:
        return
    kvh = tl.program_id(1)
    j = tl.program_id(2).to(tl.int64)
    s0 = tl.load(Cu + seq)
    n = tl.load(Cu + seq + 1) - s0
    n0 = blk * BLOCK_N
    kpos = n0 + tl.arange(0, BLOCK_N)
    kin = kpos < n
    kptr = (s0 + kpos).to(tl.int64)[:, None] * stride_kt + kvh * D + tl.arange(0, D)[None, :]
    acc = tl.zeros([BLOCK_N, D], tl.float32)
    for c in range((n0 // TPT) // QT, tl.cdiv(tl.cdiv(n, TPT), QT)):
        pblk = Part + _part_block(j, c, kvh, tl.program_id(0), chunks, tl.num_programs(1), tl.num_programs(0),
                                  BLOCK_N, D)
        acc += tl.load(pblk + tl.arange(0, BLOCK_N)[:, None] * D + tl.arange(0, D)[None, :])
    acc = acc * tl.where(j == 0, scale, 1.0)
    tl.store(Out + j * stride_out + kptr, acc.to(Out.dtype.element_ty), mask=kin[:, None])


def _check(q, hkv):
    hq, d = q.shape[1], q.shape[2]
    if hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of KV heads ({hkv})")
    if d & (d - 1) or d < 16:
        raise NotImplementedError(f"head_dim={d}: the Triton backend needs a power of two >= 16")
    return hq // hkv


def _grid_tiles(t, s, unit):
    """Programs of a flat tile grid (_flat_tile) over t tokens in s sequences, and its SB:
    at least 32 (one warp's lanes; below that the H200 compile of the forward took 255
    registers and spilled instead of 181)."""
    return triton.cdiv(t, unit) + s, triton.next_power_of_2(max(s, 32))


@functools.cache
def _split_programs(device) -> int:
    """Paged launches of fewer (tile, KV head) programs than this split by KV chunk."""
    return _SPLIT_WAVES * torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 0


def _fits_int32(*caches):
    """Whether every element offset of these paged caches (from their KV head's base) fits int32."""
    return all(c.shape[0] * c.stride(0) < 2 ** 31 for c in caches)


def _forward(q, k, v, q_start, seq_lens, table, scale, paged, lse=None, tile=None, tma=None, split=None,
             chunk=None, fold_stages=None, fold_half=None, off32=None, hold=True, fold_segment=None,
             last_first=False, carry=None):
    """Launch the one forward kernel. k/v: packed [T, Hkv, D] (seq_lens, table None) or caches
    [pages, page, Hkv, D]. tile: (rows, warps, stages) instead of the one forward tile; tma: bulk
    copies of packed K/V on or off; split: one program per KV chunk on or off (paged; probes and
    tests only: the same bits either way); chunk: keys a KV chunk other than the contract's
    (probes only: other bits); fold_stages: the split fold's pipeline stages (probes: the same bits);
    fold_half: a decode tile's fold over its real half of rows on or off (probes: the same bits);
    off32: the cache's offsets as int32 on or off (default: on where they fit; the same bits); hold:
    the split walk's page ids read before its loop (_held_pages) or in it (probes: the same bits);
    fold_segment: chunks a segment of the split fold (0: one segment; probes and tests: the same
    bits); last_first: chunk programs numbered from the last chunk (tests: the same bits); carry:
    the unsplit paged walk's page ids read a block ahead (default _CARRY_PAGES; the same bits)."""
    g = _check(q, k.shape[-2])
    # decode steps: no more tokens than sequences (vLLM's graph padding adds requests of 0 tokens);
    # CUDA only: the tiles' equal bits are an NVIDIA MMA layout fact (triton-ascend keeps one tile)
    decode = paged and q.is_cuda and q.shape[0] <= len(q_start) - 1 and g <= _DECODE_TILE[0]
    rows, warps, stages = tile or (_DECODE_TILE if decode else (*_TILE, _STAGES))
    chunk = chunk or KV_CHUNK
    if g > rows:
        raise NotImplementedError(f"{g} query heads per KV head: at most {rows}")
    tpt = rows // g
    page = k.shape[1] if paged else 1
    for c in (k, v):  # a cache row index must address [pages * page_size] rows
        if paged and c.stride(0) != page * c.stride(1):
            raise ValueError("KV cache pages must be contiguous [pages, page_size, Hkv, D]")
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("q, k, v need a contiguous head_dim")
    o = torch.empty_like(q)
    s, hkv, (t, hq, d) = len(q_start) - 1, k.shape[-2], q.shape
    bound, sb = _grid_tiles(t, s, tpt)
    # a tile holds a token at least: a decode step's grid is its S tiles (not S + S/2, a third of them
    # idle programs taking the SMs between busy ones); the split threshold stays timed on the bound
    programs = min(t, bound)
    if not programs:
        return o
    tab = table if paged else q_start
    kr, vr = (k.stride(1), v.stride(1)) if paged else (k.stride(0), v.stride(0))
    tma = not paged and (_FWD_TMA if tma is None else tma) and k.shape[0] > 0 and k.is_contiguous() \
        and v.is_contiguous() and gemm.tma_ready(k.flatten(1), v.flatten(1))
    ka, va = ((gemm.descriptor(c.flatten(1), [KV_BLOCK, d]) for c in (k, v)) if tma else (k, v))
    # the chunks a sequence of the table's capacity has: shapes only
    chunks = triton.cdiv(table.shape[1] * page, chunk) if paged else 1
    if split is None:
        split = paged and bound * hkv < _split_programs(q.device) and chunks * t * hq * (d + 2) * 4 <= _SPLIT_BYTES
    # (int32 state offsets: _chunk_ptrs)
    split = split and paged and chunks > 1 and lse is None and chunks * t * hq * d < 2 ** 31
    if fold_segment is None:   # segments where the chunk programs span waves (shapes only)
        fold_segment = _FOLD_SEGMENT if programs * hkv * chunks > _SEGMENT_PROGRAMS * _split_programs(q.device) else 0
    segments = triton.cdiv(chunks, fold_segment) if fold_segment else 1
    count = arrival_counters(q.device, programs * hkv * segments, "attention") if split else o
    split = split and count is not None
    wacc, wml = ((torch.empty((chunks, t, hq, d), dtype=torch.float32, device=q.device),
                  torch.empty((2, chunks, t, hq), dtype=torch.float32, device=q.device)) if split else (o, o))
    _attn_fwd_kernel[(programs, hkv, chunks if split else 1)](
        q, ka, va, o, lse if lse is not None else o, wacc, wml, count if split else o, q_start,
        seq_lens if paged else q_start, tab, s, t,
        q.stride(0), q.stride(1), kr, k.stride(-2), vr, v.stride(-2), o.stride(0), o.stride(1),
        tab.stride(0) if paged else 0, tab.shape[1] if paged else 1, k.shape[0] if paged else 1, scale * _LOG2E,
        G=g, TPT=tpt, ROWS=rows, D=d, KV=KV_BLOCK, CHUNK=chunk, PAGE=page, PAGED=paged,
        STORE_LSE=lse is not None, SB=sb, TMA=tma, SPLIT=split, FOLD_STAGES=fold_stages or _FOLD_STAGES,
        FOLD_HALF=_FOLD_HALF if fold_half is None else fold_half,
        OFF32=paged and (_fits_int32(k, v) if off32 is None else off32), HOLD=hold,
        SEG=fold_segment if split else 0, LAST_FIRST=last_first, CARRY=_CARRY_PAGES if carry is None else carry,
        num_warps=warps, num_stages=stages, **launch(q))
    return o


def _query_chunks(t, tpt, chunk_bytes, least=None, most=None):
    """(query tiles a chunk, chunks) of the dK/dV kernel for t tokens: chunks of a power of two
    tokens, at least `least` (_QCHUNK), at most `most` (_CHUNKS), fewer where their partials
    (chunk_bytes each) would pass _PART_BYTES."""
    most = max(1, min(most or _CHUNKS, _PART_BYTES // chunk_bytes))
    # powers of two: few distinct constexpr QT values, so few compiled kernel variants
    qt = triton.cdiv(max(least or _QCHUNK, triton.next_power_of_2(triton.cdiv(t, most))), tpt)
    return qt, triton.cdiv(triton.cdiv(t, tpt), qt)


@functools.lru_cache(maxsize=64)
def _ds_windows(t, s, tpt, keys, qt, block_bytes, budget):
    """Query-tile windows [u0, u1) launched one after another, each with bounds (dS blocks,
    dK/dV programs, dQ programs) that hold for ANY packing of t tokens into s sequences: the
    grids and the dS buffer come from shapes, never from device data. A window grows by key
    blocks' worth of tiles while its dS fits `budget` bytes (at least one step)."""
    def bounds(u0, u1):
        span = min(t, u1 * tpt)                      # tokens of a sequence the window's tiles see
        m = s if u0 == 0 else min(s, t // (u0 * tpt + 1))     # sequences that reach the window
        r, e = keys // tpt, int(keys % tpt != 0)
        # a sequence of x tokens up to span: <= (x/tpt + 1)(x/(tpt r) + 1 + e) blocks (_ds_before)
        loose = (-(-t * span // (tpt * tpt * r)) + triton.cdiv(t, tpt) * (1 + e) + triton.cdiv(t, tpt * r)
                 + s * (1 + e))
        return (min(m * (_ds_before_host(u1, tpt, keys) - _ds_before_host(u0, tpt, keys)), loose),
                min(m * triton.cdiv(span, keys), triton.cdiv(t, keys) + s),
                min(m * (u1 - u0), triton.cdiv(t, tpt) + s))
    tiles, step = triton.cdiv(t, tpt), max(1, keys // tpt)
    out, u0 = [], 0
    while u0 < tiles:
        u1 = min(u0 + step, tiles)
        while u1 < tiles and bounds(u0, min(u1 + step, tiles))[0] * block_bytes <= budget:
            u1 = min(u1 + step, tiles)
        window = bounds(u0, u1)
        if window[0]:
            out.append((u0, u1, *window))
        u0 = u1
    return tuple(out)


def _backward(q, k, v, o, lse, do, cu, scale, tiles=None, tma=None, qchunk=None):
    """dQ, dK, dV. tiles: (dQ (warps, stages), dK/dV (rows, keys, warps), stages) instead of
    the backward's; tma: bulk copies of (dS, q/dO) on or off; qchunk: (_QCHUNK, _CHUNKS)
    instead (probes only)."""
    (dq_warps, dq_stages), (rows, keys, warps), stages = tiles or (_BWD_DQ, _BWD_DKDV, _BWD_STAGES)
    (t, hq, d), hkv = q.shape, k.shape[1]
    g = hq // hkv
    do = do.contiguous()
    if not (q.is_contiguous() and o.is_contiguous()):
        raise ValueError("q and o must be contiguous [T, Hq, D]")
    if k.stride() != v.stride() or not k.is_contiguous():
        raise ValueError("k and v must be contiguous [T, Hkv, D]")
    if g > rows:
        raise NotImplementedError(f"{g} query heads per KV head: the backward handles at most {rows}")
    if t == 0:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    s = len(cu) - 1
    tpt = rows // g
    if keys < tpt:
        raise NotImplementedError(f"backward tile {(rows, keys)}: a key block must span a query tile's tokens")
    part_blocks, sb = _grid_tiles(t, s, keys)         # key blocks of every sequence, numbered flat
    qt, chunks = _query_chunks(t, tpt, 2 * hkv * part_blocks * keys * d * 4, *(qchunk or ()))   # fp32 dK, dV
    delta = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
    _bwd_delta_kernel[(triton.cdiv(t * hq, _DELTA_ROWS),)](o, do, delta, t * hq, D=d, BLOCK=_DELTA_ROWS,
                                                           num_warps=_DELTA_WARPS, **launch(o, fusion=True))
    windows = _ds_windows(t, s, tpt, keys, qt, keys * rows * q.element_size() * hkv, _DS_BYTES)
    ds_blocks = max((w[2] for w in windows), default=1)
    ds = torch.empty((hkv * ds_blocks * keys, rows), dtype=q.dtype, device=q.device)
    tma, qdo_tma = (_DS_TMA, _QDO_TMA) if tma is None else tma
    tma = tma and gemm.tma_ready(ds)
    dsa = gemm.descriptor(ds, [keys, rows]) if tma else ds
    qdo_tma = qdo_tma and tma and tpt * g == rows and gemm.tma_ready(q, do)     # whole [TPT, G, D] boxes
    qa, doa = (gemm.descriptor(x, [tpt, g, d]) for x in (q, do)) if qdo_tma else (q, do)
    part = torch.empty((2, chunks, hkv, part_blocks, keys, d), dtype=torch.float32, device=k.device)
    dq = torch.empty_like(q)
    for u0, u1, _, kv_programs, q_programs in windows:
        _bwd_dkdv_kernel[(kv_programs, triton.cdiv(u1, qt) - u0 // qt, hkv)](
            qa, k, v, doa, lse, delta, part, dsa, cu, s, u0, u1, chunks, q.stride(0), k.stride(0), part_blocks,
            ds_blocks, scale * _LOG2E, G=g, TPT=tpt, ROWS=rows, D=d, BLOCK_N=keys, HQ=hq, QT=qt,
            SB=sb, TMA=tma, QDO_TMA=qdo_tma, num_warps=warps, num_stages=stages, **launch(q))
        _bwd_dq_kernel[(q_programs, hkv)](
            dsa, k, dq, cu, s, u0, u1, q.stride(0), k.stride(0), ds_blocks, scale,
            G=g, TPT=tpt, ROWS=rows, D=d, BLOCK_N=keys, SB=sb, TMA=tma, num_warps=dq_warps,
            num_stages=dq_stages, **launch(ds))
    dkv = torch.empty((2, *k.shape), dtype=k.dtype, device=k.device)
    _sum_parts_kernel[(part_blocks, hkv, 2)](part, dkv, cu, s, chunks, k.stride(0), k.numel(), scale, TPT=tpt,
                                          D=d, BLOCK_N=keys, QT=qt, SB=sb, num_warps=4, **launch(part, fusion=True))
    return dq, dkv[0], dkv[1]


class _VarlenAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu, scale):
        need_grad = any(ctx.needs_input_grad[:3])
        lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device) if need_grad else None
        o = _forward(q, k, v, cu, None, None, scale, paged=False, lse=lse)
        if need_grad:
            ctx.save_for_backward(q, k, v, o, lse, cu)
            ctx.scale = scale
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse, cu = ctx.saved_tensors
        return (*_backward(q, k, v, o, lse, do, cu, ctx.scale), None, None)


def attention_varlen(q, k, v, cu_seqlens, scale=None):
    """Packed causal attention. q [T, Hq, D]; k, v [T, Hkv, D]; cu_seqlens [S+1]. Differentiable."""
    scale = attention_scale(q.shape[-1]) if scale is None else float(scale)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
    return _VarlenAttention.apply(q, k, v, cu, scale)


def attention_paged(q, key_cache, value_cache, block_table, seq_lens, query_start_loc, scale=None,
                    max_query_len=None):
    """New tokens of each sequence against the paged cache (which already holds them).
    q [T, Hq, D]; caches [pages, page_size, Hkv, D]; block_table [S, max_pages];
    seq_lens [S] include this step's tokens; query_start_loc [S+1]; requests with no tokens
    (padding) are exact no-ops. max_query_len is not needed: the grid is sized by shapes alone
    (_flat_tile), so mixed prefill/decode batches run as one launch and capture in CUDA graphs
    (nothing here reads device data on the host)."""
    scale = attention_scale(q.shape[-1]) if scale is None else float(scale)
    dev = q.device
    qsl = query_start_loc.to(device=dev, dtype=torch.int32)
    return _forward(q, key_cache, value_cache, qsl, seq_lens.to(device=dev, dtype=torch.int32),
                    block_table.to(device=dev, dtype=torch.int32), scale, paged=True)
