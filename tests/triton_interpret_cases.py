"""Triton backend kernel logic on the CPU (TRITON_INTERPRET=1), at tiny sizes, for CI.

The interpreter runs every kernel program in numpy, so these tests check indexing,
masks, the KV-block walk, the tile tables and the autograd wiring against the
reference backend; the bit-level claims on real tensor cores are the GPU suite's
(tests/gpu/). Cross-path equalities hold here too: each path runs the same tile code, and
tiles of other shapes (decode's 16 rows, prefill's 64) give an element of tl.dot from its own
row and column alone, as an MMA does (interpreter_bf16.py).

Run by test_triton_interpret.py in a fresh interpreter (see there why).
"""
import os
import sys

import pytest
import torch

if "consistent_ops.triton" in sys.modules:  # compiled mode already loaded (e.g. on a GPU run)
    pytest.skip("the Triton backend was imported without TRITON_INTERPRET", allow_module_level=True)
os.environ["TRITON_INTERPRET"] = "1"        # read when the kernels are decorated (import time)
triton = pytest.importorskip("triton")

import numpy as np  # noqa: E402
import triton.language as tl  # noqa: E402

import consistent_ops as co  # noqa: E402
from interpreter_bf16 import fix_interpreter_bf16  # noqa: E402
import consistent_ops.reference as R  # noqa: E402
import consistent_ops.triton as T  # noqa: E402
from consistent_ops.triton import common  # noqa: E402
from consistent_ops.triton.attention import _block_pages, _chunk_ptrs, _ds_before, _fold  # noqa: E402


fix_interpreter_bf16()
BF16 = torch.bfloat16


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def rand(*shape, scale=1.0, seed=None):
    g = torch.Generator().manual_seed(seed if seed is not None else sum(shape))
    return (torch.randn(*shape, generator=g) * scale).to(BF16)


# ---------------------------------------------------------------- attention
HQ, HKV, D = 4, 2, 32
LENS = [70, 130]                     # crosses KV blocks of 64, partial last tiles


@pytest.fixture(scope="module")
def qkv():
    t = sum(LENS)
    return rand(t, HQ, D, seed=1), rand(t, HKV, D, seed=2), rand(t, HKV, D, seed=3)


@pytest.fixture(params=[(512, False), (64, False), (64, True)], ids=["chunk512", "chunk64", "chunk64-split"])
def kv_chunks(request, monkeypatch):
    """The contract's KV chunk, and chunks of one KV block each (these short sequences cross
    several), folded in each tile's program or (split) by one program per chunk, the last of a
    tile's to finish folding: the same bits on every path."""
    from consistent_ops.triton import attention as ta
    chunk, split = request.param
    monkeypatch.setattr(ta, "KV_CHUNK", chunk)
    monkeypatch.setattr(ta, "_split_programs", lambda device: (1 << 30) if split else 0)
    return request.param


def _cu(lens):
    return torch.tensor([0] + list(np.cumsum(lens)), dtype=torch.int64)


class Cache:
    """Paged KV cache with shuffled physical pages and NaN in every unwritten slot."""

    def __init__(self, page=16, pages=40, seqs=2):
        self.page = page
        self.k = torch.full((pages, page, HKV, D), float("nan"), dtype=BF16)
        self.v = self.k.clone()
        perm = torch.randperm(pages, generator=torch.Generator().manual_seed(0))
        self.table = perm[: seqs * (pages // seqs)].view(seqs, -1).to(torch.int32)
        self.lens = [0] * seqs

    def step(self, q, k, v, batch):
        """batch: [(seq, n_new)] in token order of q/k/v. Writes KV, then attends."""
        slots, qsl, seq_lens = [], [0], []
        for s, n in batch:
            pos = torch.arange(self.lens[s], self.lens[s] + n)
            slots.append(self.table[s, pos // self.page].long() * self.page + pos % self.page)
            self.lens[s] += n
            qsl.append(qsl[-1] + n)
            seq_lens.append(self.lens[s])
        T.write_kv_cache(k, v, self.k, self.v, torch.cat(slots))
        table = self.table[[s for s, _ in batch]]
        return T.attention_paged(q, self.k, self.v, table, torch.tensor(seq_lens), torch.tensor(qsl))


def test_attention_varlen_matches_reference(qkv):
    q, k, v = qkv
    assert rel(T.attention_varlen(q, k, v, _cu(LENS)), R.attention_varlen(q, k, v, _cu(LENS))) < 1e-2


def test_attention_paths_bitwise_equal(qkv, kv_chunks):
    """train varlen == paged prefill == chunked prefill (mixed with decode) == decode."""
    q, k, v = qkv
    train = T.attention_varlen(q, k, v, _cu(LENS))
    a, b = LENS
    prefill = Cache().step(q, k, v, [(0, a), (1, b)])
    assert torch.equal(prefill, train)
    # chunked: seq 1 in chunks of 50, seq 0 prefilled then decoded token by token alongside
    c, got = Cache(), {}
    idx0, idx1 = list(range(a)), list(range(a, a + b))
    plan = [([], idx1[:50]), (idx0[:65], idx1[50:100]), (idx0[65:66], idx1[100:])]
    plan += [([i], []) for i in idx0[66:]]
    for i0, i1 in plan:
        rows = i0 + i1
        batch = [(s, len(ix)) for s, ix in ((0, i0), (1, i1)) if ix]
        out = c.step(q[rows], k[rows], v[rows], batch)
        got.update(zip(rows, out))
    assert torch.equal(torch.stack([got[i] for i in range(a + b)]), train)


@pytest.mark.parametrize("page", [32, 128, 48])
def test_page_sizes_give_the_same_bits(qkv, kv_chunks, page):
    """Pages that split a key block (32), hold several (128) or neither (48: one table lookup a key,
    not a run): the prefill, then decode steps, equal the trainer's bits; NaN in every unwritten slot."""
    q, k, v = qkv
    a, b = LENS
    train = T.attention_varlen(q, k, v, _cu(LENS))
    c = Cache(page=page, pages=2 * -(-(b + 4) // page))
    rows = list(range(a - 4)) + list(range(a, a + b - 4))
    out = [c.step(q[rows], k[rows], v[rows], [(0, a - 4), (1, b - 4)])]
    for i in range(4, 0, -1):
        out.append(c.step(q[[a - i, a + b - i]], k[[a - i, a + b - i]], v[[a - i, a + b - i]], [(0, 1), (1, 1)]))
    got = torch.cat(out)
    order = rows + [r for i in range(4, 0, -1) for r in (a - i, a + b - i)]
    assert torch.equal(got, train[order])


@triton.jit
def _block_pages_behind(first, seq, Table, stride_tab, tab_cols, KV: tl.constexpr, PAGE: tl.constexpr):
    """_block_pages of the block before (the mutation the carried walk's companion runs)."""
    return _block_pages(tl.maximum(first - KV, 0), seq, Table, stride_tab, tab_cols, KV, PAGE)


def _carried_walk(page):
    """Two sequences of 200 and 304 tokens through the unsplit paged walk in KV chunks of 64 keys:
    chunked prefill (150 + 100 tokens, then 46 + 200), then 4 decode steps; (outputs in token order,
    the trainer's)."""
    lens = [200, 304]
    q, k, v = rand(sum(lens), HQ, D, seed=4), rand(sum(lens), HKV, D, seed=5), rand(sum(lens), HKV, D, seed=6)
    train = T.attention_varlen(q, k, v, _cu(lens))
    c, got, done = Cache(page=page, pages=2 * -(-lens[1] // page)), {}, [0, 0]
    for step in [(150, 100), (46, 200)] + [(1, 1)] * 4:
        rows = [lens[0] * s + done[s] + i for s in (0, 1) for i in range(step[s])]
        got.update(zip(rows, c.step(q[rows], k[rows], v[rows], [(0, step[0]), (1, step[1])])))
        done = [done[0] + step[0], done[1] + step[1]]
    return torch.stack([got[i] for i in range(sum(lens))]), train


@pytest.mark.parametrize("carry", [True, False], ids=["carried", "read-in-loop"])
@pytest.mark.parametrize("page", [16, 32, 128, 48])
def test_carried_page_ids_give_the_same_bits(page, carry, monkeypatch):
    """The unsplit paged walk reading a key block's page ids one block ahead (_CARRY_PAGES, the
    default) or in the block's own iteration (the probes' `no carry`) == the trainer's bits over
    chunked prefill and decode steps, pages that split a key block (16, 32), hold several (128) or
    neither (48: per-key lookups, not carried), NaN in every unwritten slot. Companion: a
    _block_pages reading the block before's ids (the lookup both walks share) gives other bits; which
    walk runs, the sm_90 compile shows (test_triton_layouts: wait num 2 carried, 0 read in the loop)."""
    from consistent_ops.triton import attention as ta
    monkeypatch.setattr(ta, "KV_CHUNK", 64)
    monkeypatch.setattr(ta, "_split_programs", lambda device: 0)
    monkeypatch.setattr(ta, "_CARRY_PAGES", carry)
    got, train = _carried_walk(page)
    assert torch.equal(got, train)
    if page != 48:
        monkeypatch.setattr(ta, "_block_pages", _block_pages_behind)
        assert not torch.equal(_carried_walk(page)[0], train)


@pytest.mark.parametrize("tile", [(16, 1, 3), (128, 8, 3)])
def test_any_tile_gives_the_same_bits(qkv, tile):
    """Tiles of other row counts (16: the decode tile) == the forward tile, bit for bit, padding
    rows and partial tiles included (the GPU suite's test_any_tile_gives_the_same_bits holds the
    MMAs to it)."""
    from consistent_ops.triton import attention as ta
    q, k, v = qkv
    cu = _cu(LENS).to(torch.int32)
    assert torch.equal(ta._forward(q, k, v, cu, None, None, D ** -0.5, False, tile=tile),
                       ta._forward(q, k, v, cu, None, None, D ** -0.5, False))


def test_kv_chunks_are_live(qkv, monkeypatch):
    """Companion: the chunk size reaches the bits (rows past the first chunk), nothing before it."""
    from consistent_ops.triton import attention as ta
    q, k, v = qkv
    outs = []
    for chunk in (64, 512):
        monkeypatch.setattr(ta, "KV_CHUNK", chunk)
        outs.append(T.attention_varlen(q, k, v, _cu(LENS)))
    first = torch.tensor([i < 64 or LENS[0] <= i < LENS[0] + 64 for i in range(sum(LENS))])
    assert torch.equal(outs[0][first], outs[1][first]) and not torch.equal(outs[0][~first], outs[1][~first])


def test_attention_backward_vs_float64(qkv, kv_chunks):
    q, k, v = (t.clone().requires_grad_() for t in qkv)
    out = T.attention_varlen(q, k, v, _cu(LENS))
    g = rand(*out.shape, seed=9)
    out.backward(g)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in qkv)
    ref = R.attention_varlen(q64, k64, v64, _cu(LENS))
    ref.backward(g.double())
    for mine, exact in ((q.grad, q64.grad), (k.grad, k64.grad), (v.grad, v64.grad)):
        assert rel(mine, exact) < 2e-2


def test_padded_mixed_batch_is_one_launch_with_exact_no_op_padding(qkv, kv_chunks):
    """A batch padded as a FULL CUDA graph pads it (a request with no tokens, token rows past
    the last request): the grid comes from shapes alone, the real rows equal the unpadded
    call's bit for bit."""
    q, k, v = qkv
    a, b = LENS
    c = Cache()
    c.step(q[:60], k[:60], v[:60], [(0, 60)])                  # seq 0's context
    rows = list(range(60, 61)) + list(range(a, a + 40))         # seq 0 decodes, seq 1 prefills 40
    ref = Cache()
    ref.step(q[:60], k[:60], v[:60], [(0, 60)])
    want = ref.step(q[rows], k[rows], v[rows], [(0, 1), (1, 40)])
    qp = torch.cat([q[rows], rand(7, HQ, D, seed=5)])           # 7 padding token rows
    slots, qsl, seq_lens = [], [0], []
    for s, n in ((0, 1), (1, 40)):
        pos = torch.arange(c.lens[s], c.lens[s] + n)
        slots.append(c.table[s, pos // c.page].long() * c.page + pos % c.page)
        c.lens[s] += n
        qsl.append(qsl[-1] + n)
        seq_lens.append(c.lens[s])
    T.write_kv_cache(k[rows], v[rows], c.k, c.v, torch.cat(slots))
    table = torch.cat([c.table[[0, 1]], torch.zeros(1, c.table.shape[1], dtype=torch.int32)])
    got = T.attention_paged(qp, c.k, c.v, table, torch.tensor(seq_lens + [0]), torch.tensor(qsl + [qsl[-1]]))
    assert torch.equal(got[:41], want)


def test_dummy_metadata_reads_inside_the_table_and_cache(kv_chunks):
    """vLLM's capture and memory-profiling dummies: a sequence longer than its table row and
    page ids -1 and past the cache are clamped into the table and the cache (the interpreter
    reads numpy arrays: no read outside them; split: no chunk state read past the table's
    capacity), and a real request beside them keeps its bits."""
    page, pages = 16, 6
    q, k, v = rand(4 + 20, HQ, D, seed=7), rand(pages, page, HKV, D, seed=8), rand(pages, page, HKV, D, seed=9)
    real = torch.tensor([[5, 2, 4, 1, 0]], dtype=torch.int32)    # 80 keys: 2 KV chunks of 64 (split)
    one = T.attention_paged(q[:4], k, v, real, torch.tensor([40]), torch.tensor([0, 4]))
    table = torch.cat([real, torch.tensor([[-1, 10**6, 3, 3, 3]], dtype=torch.int32)])
    both = T.attention_paged(q, k, v, table, torch.tensor([40, 300]), torch.tensor([0, 4, 24]))
    assert torch.equal(both[:4], one) and torch.isfinite(both[4:].float()).all() and _counters_idle()


def _counters_idle():
    """The split launch's arrival counters are all back at 0 (each tile's last program resets its
    own): a tile that counted more or fewer programs than its chunks would leave one behind."""
    return all(not b.any() for bufs in common.COUNTERS.values() for b in bufs)


def _decode_tail(dtype):
    """_forward's arguments for a batch of tiles of one KV chunk of 64 keys and of several in a
    grid of 4 chunks (the table's capacity, 256 keys): a decode at 200 keys (4 chunks), one at
    30 (1), a 20-token prefill chunk ending at 130 (3; its rows at 110-127 see 2), and a padding
    request. fp32 q/k/v give an fp32 output: the fold's bits unrounded."""
    page = 16
    k, v = (rand(48, page, HKV, D, seed=s).to(dtype) for s in (21, 22))
    i32 = dict(dtype=torch.int32)
    perm = torch.randperm(48, generator=torch.Generator().manual_seed(1)).to(torch.int32)
    table = torch.cat([perm.view(3, 16), torch.zeros(1, 16, **i32)])
    return (rand(22, HQ, D, seed=23).to(dtype), k, v, torch.tensor([0, 1, 2, 22, 22], **i32),
            torch.tensor([200, 30, 130, 0], **i32), table, D ** -0.5, True)


@pytest.mark.parametrize("split", [False, True])
def test_int64_cache_offsets_give_the_same_bits(split):
    """A cache whose element offsets pass int32 is addressed in 64 bits (the same bits: only the
    addresses' arithmetic differs); the small caches of every other test take int32."""
    from consistent_ops.triton import attention as ta
    args = _decode_tail(BF16)
    assert torch.equal(ta._forward(*args, split=split, off32=False), ta._forward(*args, split=split))
    big, small = (torch.empty(n, 16, HKV, D, dtype=BF16, device="meta") for n in (2 ** 31 // (16 * HKV * D), 64))
    assert not ta._fits_int32(small, big) and ta._fits_int32(small, small)


def test_split_walk_with_its_table_reads_in_the_loop_gives_the_same_bits(monkeypatch):
    """The probes' `hold=False` (a block's page ids read inside the walk's loop, as before
    2026-12-06 evening) addresses the same rows as the held ids: the same bits."""
    from consistent_ops.triton import attention as ta
    monkeypatch.setattr(ta, "KV_CHUNK", 128)
    args = _decode_tail(BF16)
    assert torch.equal(ta._forward(*args, split=True, hold=False), ta._forward(*args, split=True))


@pytest.mark.parametrize("dtype", [BF16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("chunk", [64, 128, 256])
def test_split_launch_equals_unsplit_launch_after_launch(dtype, chunk, monkeypatch):
    """The decode tail's split launch (a program per (tile, KV chunk), the tile's last program to
    finish folding the chunk states) == one program walking every chunk, bit for bit, on a batch
    mixing tiles of one chunk and of several; and again on the next launch (the counters were
    reset), twice more in a row. Chunks of 1, 2 and 4 key blocks: a chunk's walk picks each block's
    pages from the chunk's held page ids (_held_pages: 4, 8 and 16 of them)."""
    from consistent_ops.triton import attention as ta
    monkeypatch.setattr(ta, "KV_CHUNK", chunk)
    args = _decode_tail(dtype)
    want = ta._forward(*args, split=False)
    assert torch.isfinite(want.float()).all()
    for _ in range(3):
        assert torch.equal(ta._forward(*args, split=True), want) and _counters_idle()
    assert common.COUNTERS[want.device]                 # it did split


@pytest.mark.parametrize("prefill", [False, True], ids=["decode", "short-prefill"])
def test_split_fold_over_a_tiles_real_half_gives_the_same_bits(prefill, monkeypatch):
    """A split tile whose tokens fill at most half its rows (here 32 tokens a tile: decode steps, or
    two prefill chunks of 10 tokens) folds and stores that half alone, where a tile of more (the
    20-token chunk) folds whole: the bits of the whole tile's fold, and of the unsplit launch."""
    from consistent_ops.triton import attention as ta
    monkeypatch.setattr(ta, "KV_CHUNK", 64)
    args = list(_decode_tail(BF16))
    if prefill:   # 10 tokens ending at 120 (2 chunks) and 10 ending at 130 (3 chunks)
        i32 = dict(dtype=torch.int32)
        args[3], args[4] = torch.tensor([0, 1, 2, 12, 22], **i32), torch.tensor([200, 30, 120, 130], **i32)
    want = ta._forward(*args, split=True, fold_half=False)
    assert torch.isfinite(want.float()).all()        # (rows never stored may divide 0 by 0)
    assert torch.equal(ta._forward(*args, split=True, fold_half=True), want) and _counters_idle()
    assert torch.equal(ta._forward(*args, split=False), want)


@pytest.mark.parametrize("segment", [1, 2, 3])
@pytest.mark.parametrize("last_first", [False, True], ids=["in-order", "last-first"])
def test_split_fold_in_segments_gives_the_same_bits(segment, last_first, monkeypatch):
    """The split fold cut into segments of 1, 2 or 3 chunks (each folded by its last arrival onto the
    fold of those before, read back from the slot of the previous segment's last chunk) == the
    unsplit launch, bit for bit, whole and half fold: chunks arriving in order (each segment's fold
    handed on to a later arrival) and last first (the first segment's folder finds every later one
    arrived and folds them all); every counter back at 0."""
    from consistent_ops.triton import attention as ta
    monkeypatch.setattr(ta, "KV_CHUNK", 64)
    args = _decode_tail(torch.float32)
    want = ta._forward(*args, split=False)
    for half in (False, True):
        got = ta._forward(*args, split=True, fold_segment=segment, last_first=last_first, fold_half=half)
        assert torch.equal(got, want) and _counters_idle()


@triton.jit
def _fold_reversed(WAcc, WML, qrow, head, valid, T, HQ, chunks, first, end, D: tl.constexpr, STAGES: tl.constexpr):
    """_fold_states with the slots in reverse order (the mutation the companion below runs)."""
    pa, pm, pl = _chunk_ptrs(WAcc, WML, end - 1, qrow, head, T, HQ, chunks, D)
    acc = tl.load(pa, mask=valid[:, None], other=0.0)
    m = tl.load(pm, mask=valid, other=0.0)
    l = tl.load(pl, mask=valid, other=1.0)
    for i in range(first + 1, end):
        pa, pm, pl = _chunk_ptrs(WAcc, WML, end - 1 - i + first, qrow, head, T, HQ, chunks, D)
        acc, m, l = _fold(acc, m, l, tl.load(pa, mask=valid[:, None], other=0.0),
                          tl.load(pm, mask=valid, other=float("-inf")), tl.load(pl, mask=valid, other=0.0))
    return acc, m, l


@pytest.mark.parametrize("segment", [None, 2], ids=["one-segment", "segments-of-2"])
def test_split_fold_order_reaches_the_bits(segment, monkeypatch):
    """Companion: the split launch folding its chunk states in reverse order gives other bits on
    every row that sees 3 or 4 chunks (the equality above would catch a wrong order); rows of 1
    or 2 chunks keep theirs (one fold of two states is commutative). In segments of 2, each
    segment's slots reversed: the decode at 200 keys still differs (its second segment folds 3)."""
    from consistent_ops.triton import attention as ta
    monkeypatch.setattr(ta, "KV_CHUNK", 64)
    args = _decode_tail(torch.float32)
    want = ta._forward(*args, split=False)
    monkeypatch.setattr(ta, "_fold_states", _fold_reversed)
    got = ta._forward(*args, split=True, fold_segment=segment)
    differ = [r for r in range(len(got)) if not torch.equal(got[r], want[r])]
    # the decode at 200 keys; whole: the prefill rows at 128, 129 too
    assert differ == ([0, 20, 21] if segment is None else [0]) and _counters_idle()


def test_attention_backward_over_query_chunks(qkv, monkeypatch):
    """dK/dV split over query chunks (fp32 partials added in chunk order): deterministic and
    accurate against float64 when a sequence spans several chunks."""
    from consistent_ops.triton import attention as ta
    monkeypatch.setattr(ta, "_QCHUNK", 32)
    q, k, v = (t.clone().requires_grad_() for t in qkv)
    g = rand(*q.shape, seed=9)
    grads = []
    for _ in range(2):
        for t in (q, k, v):
            t.grad = None
        T.attention_varlen(q, k, v, _cu(LENS)).backward(g)
        grads.append([t.grad.clone() for t in (q, k, v)])
    assert all(torch.equal(x, y) for x, y in zip(*grads))
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in qkv)
    R.attention_varlen(q64, k64, v64, _cu(LENS)).backward(g.double())
    for mine, exact in zip(grads[0], (q64.grad, k64.grad, v64.grad)):
        assert rel(mine, exact) < 2e-2


def test_attention_empty_batch():
    """No tokens: the forward and backward launch nothing that fails, gradients are empty."""
    q, k, v = (torch.zeros(0, h, D, dtype=BF16, requires_grad=True) for h in (HQ, HKV, HKV))
    T.attention_varlen(q, k, v, _cu([0])).float().sum().backward()
    assert q.grad.shape == q.shape and k.grad.shape == k.shape and v.grad.shape == v.shape


def _grads(q, k, v, lens, g):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    T.attention_varlen(q, k, v, _cu(lens)).backward(g)
    return [t.grad for t in (q, k, v)]


def test_attention_backward_windows_and_uneven_tiles(monkeypatch):
    """The dS buffer's windows (query tiles launched together) never move a gradient bit:
    one window == a window per key block's worth of tiles (cutting chunks). G = 5 query
    heads per KV head (12 tokens a tile, dividing neither the chunk nor the key block):
    accurate against float64."""
    from consistent_ops.triton import attention as ta
    monkeypatch.setattr(ta, "_QCHUNK", 32)
    lens = [70, 3, 130]
    q, k, v = rand(sum(lens), 10, D, seed=11), rand(sum(lens), 2, D, seed=12), rand(sum(lens), 2, D, seed=13)
    g = rand(*q.shape, seed=14)
    one = _grads(q, k, v, lens, g)
    monkeypatch.setattr(ta, "_DS_BYTES", 1)
    assert len(ta._ds_windows(sum(lens), 3, 12, 64, 2, 1, 1)) > 1
    assert all(torch.equal(a, b) for a, b in zip(one, _grads(q, k, v, lens, g)))
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    R.attention_varlen(q64, k64, v64, _cu(lens)).backward(g.double())
    for mine, exact in zip(one, (q64.grad, k64.grad, v64.grad)):
        assert rel(mine, exact) < 2e-2


def _ds_blocks(lens, u0, u1, tpt, keys):
    """The dS blocks a window uses, counted as _ds_layout lays them out."""
    from consistent_ops.triton import attention as ta
    before = lambda u: ta._ds_before_host(u, tpt, keys)  # noqa: E731
    return sum(before(min(-(-n // tpt), u1)) - before(u0) for n in lens if -(-n // tpt) > u0)


@triton.jit
def _ds_count_kernel(Out, TPT: tl.constexpr, BLOCK_N: tl.constexpr):
    t = tl.arange(0, 512)
    tl.store(Out + t, _ds_before(t, TPT, BLOCK_N))


def test_ds_block_count_kernel_equals_host():
    """The kernels' dS offsets (_ds_before) and the host's bound use the same count, and a
    tile's blocks cover the key blocks it sees."""
    from consistent_ops.triton import attention as ta
    for tpt, keys in ((8, 64), (12, 64), (32, 64), (64, 64), (4, 128)):
        out = torch.zeros(512, dtype=torch.int32)
        _ds_count_kernel[(1,)](out, TPT=tpt, BLOCK_N=keys)
        assert out.tolist() == [ta._ds_before_host(u, tpt, keys) for u in range(512)]
        assert all(out[u + 1] - out[u] >= -(-(u + 1) * tpt // keys) for u in range(511))


def test_ds_window_bounds_hold_for_any_packing():
    """The buffer and grids are sized from shapes: their bounds hold for random packings
    (many short sequences, one long one, empty ones) of the same token count."""
    from consistent_ops.triton import attention as ta
    gen = np.random.default_rng(0)
    for t, s, tpt, keys, qt in ((4096, 1, 8, 64, 128), (5000, 7, 12, 64, 85), (3000, 40, 32, 64, 32)):
        windows = ta._ds_windows(t, s, tpt, keys, qt, 1, 1 << 10)
        assert len(windows) > 1 and windows[0][0] == 0
        for _ in range(50):
            cuts = np.sort(gen.integers(0, t + 1, s - 1)) if gen.random() < 0.8 else [0] * (s - 1)
            lens = np.diff([0, *cuts, t]).tolist()
            for u0, u1, blocks, kv_programs, q_programs in windows:
                assert _ds_blocks(lens, u0, u1, tpt, keys) <= blocks
                assert sum(-(-min(n, u1 * tpt) // keys) for n in lens if -(-n // tpt) > u0) <= kv_programs
                assert sum(max(min(-(-n // tpt), u1) - u0, 0) for n in lens) <= q_programs
            covered = {u for w in windows for u in range(w[0], w[1])}
            assert all(u in covered for n in lens for u in range(-(-n // tpt)))


def test_query_chunks_bound_the_partials():
    """dK/dV query chunks: at least _QCHUNK tokens, at most _CHUNKS, their fp32 partials within
    _PART_BYTES (one chunk where even one passes it), and every tile in a chunk."""
    from consistent_ops.triton import attention as ta
    for t in (1, 500, 4096, 16384, 65536, 1 << 20):
        for hkv, d, tpt in ((4, 128, 8), (8, 128, 12), (1, 64, 64)):
            chunk_bytes = 2 * hkv * (t // 64 + 1) * 64 * d * 4
            qt, chunks = ta._query_chunks(t, tpt, chunk_bytes)
            assert qt * tpt >= min(ta._QCHUNK, t) - tpt and chunks <= ta._CHUNKS
            assert chunks * chunk_bytes <= ta._PART_BYTES or chunks == 1
            assert (chunks - 1) * qt < -(-t // tpt) <= chunks * qt


# ---------------------------------------------------------------- linear, norms, log-probs
def test_linear_rows_and_accuracy():
    x, w, b = rand(200, 256, seed=4), rand(96, 256, scale=0.05, seed=5), rand(96, seed=6)
    y = T.linear(x, w, b)
    assert rel(y, x.double() @ w.double().t() + b.double()) < 1e-2
    assert torch.equal(T.linear(x[:1], w, b)[0], y[0])        # same tile shape: exact
    assert rel(T.row_parallel_partial(x, w), x.double() @ w.double().t()) < 1e-6
    assert T.row_parallel_partial(x, w).dtype == torch.float32
    parts = [T.row_parallel_partial(xs, ws) for xs, ws in zip(x.split(128, -1), w.split(128, -1))]
    assert rel(T.finish_row_parallel(T.ordered_sum(parts), b, BF16), y) < 1e-2   # TP=2 emulation


def _gemm_entries():
    from consistent_ops.contract import TRITON_TILES
    for name, entry in TRITON_TILES["gemm"].items():
        yield from ((f"{name}-{k}", e) for k, e in entry.items()) if isinstance(entry, dict) else [(name, entry)]


@pytest.mark.parametrize("cfg", [pytest.param(e, id=n) for n, e in _gemm_entries()])
def test_every_gemm_tile_entry_gives_the_pinned_rows(cfg):
    """Each entry of the contract's GEMM table, forced (the GPU picks them by M and N): the pinned
    entry's rows bit for bit, partial row and column tiles and a K that no BLOCK_K divides included
    (the GPU suite's test_linear_rows_across_every_tile_entry holds the MMAs to it)."""
    from consistent_ops.triton import gemm
    x, w, b = rand(150, 200, seed=31), rand(136, 200, scale=0.07, seed=32), rand(136, seed=33)
    assert torch.equal(gemm.matmul(x, w, b, cfg=cfg), gemm.matmul(x, w, b, cfg=gemm._PINNED)), cfg


def test_a_split_of_k_gives_other_bits():
    """Companion: what the tiles keep is K walked in one ascending chain; two chains (a fixed split
    of K, as cuBLAS takes at small M) summed give other fp32 sums."""
    from consistent_ops.triton import gemm
    x, w, fp32 = rand(150, 200, seed=31), rand(136, 200, scale=0.07, seed=32), torch.float32
    halves = sum(gemm.matmul(x[:, ks], w[:, ks], out_dtype=fp32) for ks in (slice(0, 96), slice(96, None)))
    assert not torch.equal(gemm.matmul(x, w, out_dtype=fp32), halves)


@pytest.mark.parametrize("m, k", [(1, 448), (5, 200), (70, 448), (3, 64)])
def test_k_chunks_over_programs_equal_the_chunks_in_one_program(m, k):
    """The probe's K chunks (matmul's chunk=, not the contract): chunks of 128 from zero added in
    chunk order in one program == those chunks' own GEMMs added in order, and == one program a
    chunk with the tile's last arrival adding them, bit for bit (fp32 and bf16 out, a K that no
    chunk divides, one chunk longer than K, M past one tile), twice in a row (each tile's counter
    back at 0)."""
    from consistent_ops.triton import gemm
    x, w, fp32 = rand(m, k, seed=41), rand(136, k, scale=0.07, seed=42), torch.float32
    chunks = -(-k // 128)
    by_chunk = [gemm.matmul(x[:, c:c + 128], w[:, c:c + 128], out_dtype=fp32) for c in range(0, k, 128)]
    assert torch.equal(gemm.matmul(x, w, out_dtype=fp32, chunk=(128, 1)), sum(by_chunk[1:], by_chunk[0]))
    for out in (fp32, BF16):
        one = gemm.matmul(x, w, out_dtype=out, chunk=(128, 1))
        for _ in range(2):
            assert torch.equal(gemm.matmul(x, w, out_dtype=out, chunk=(128, chunks)), one) and _counters_idle()
    with pytest.raises(ValueError, match="CHUNK_K a multiple of BLOCK_K"):
        gemm.matmul(x, w, chunk=(100, 1))


def test_rms_norm_and_fused_residual():
    x, r, w = rand(33, 256, seed=7), rand(33, 256, seed=8), rand(256, seed=9)
    assert rel(T.rms_norm(x, w, 1e-6), R.rms_norm(x, w, 1e-6)) < 1e-2
    y, res = T.add_rms_norm(x, r, w, 1e-6)
    y_ref, res_ref = R.add_rms_norm(x, r, w, 1e-6)
    assert torch.equal(res, res_ref) and rel(y, y_ref) < 1e-2
    assert torch.equal(T.rms_norm(x[5:6], w, 1e-6), T.rms_norm(x, w, 1e-6)[5:6])


def _norm_grads(fused, x, r, w, dy, dr):
    xg, rg, wg = (t.clone().requires_grad_() for t in (x, r, w))
    if fused:
        y, res = T.add_rms_norm(xg, rg, wg, 1e-6)
        ((y.float() * dy.float()).sum() + (res.float() * dr.float()).sum()).backward()
    else:
        (T.rms_norm(xg, wg, 1e-6).float() * dy.float()).sum().backward()
    return xg.grad, rg.grad, wg.grad


@pytest.mark.parametrize("fused", [False, True])
def test_rms_norm_backward_vs_float64_and_deterministic(fused):
    """The backward kernel (dx, + the fused residual's gradient) and dweight's column sum."""
    x, r, dy, dr = (rand(33, 96, seed=s) for s in (20, 21, 22, 23))
    w = torch.rand(96, generator=torch.Generator().manual_seed(24)) + 0.5
    grads = _norm_grads(fused, x, r, w, dy, dr)
    x6, r6, w6 = (t.double().requires_grad_() for t in (x, r, w))
    s6 = x6 + r6 if fused else x6
    y6 = s6 / torch.sqrt(s6.square().mean(-1, keepdim=True) + 1e-6) * w6
    ((y6 * dy.double()).sum() + ((s6 * dr.double()).sum() if fused else 0)).backward()
    assert rel(grads[0], x6.grad) < 1e-2 and rel(grads[2], w6.grad) < 1e-2
    assert (grads[1] is not None) == fused and (not fused or torch.equal(grads[1], grads[0]))
    assert all(a is b or torch.equal(a, b) for a, b in zip(grads, _norm_grads(fused, x, r, w, dy, dr)))


def test_rope_backward_is_the_reference_autograd():
    """RoPE's gradient is the forward kernel rotating back: autograd of the torch form, bit for bit."""
    _, x, cos, sin, _ = fused_cases()
    dy = rand(*x.shape, seed=25)
    xg, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
    (T.apply_rope(xg, cos, sin).float() * dy.float()).sum().backward()
    (R.apply_rope(xr, cos, sin).float() * dy.float()).sum().backward()
    assert torch.equal(xg.grad, xr.grad)


def _stacked_qkv(t, hq, hkv, d, seed):
    """q [T, Hq, D], k, v [T, Hkv, D] as the rollout takes them: views of one q/k/v GEMM output."""
    out = rand(t, (hq + 2 * hkv) * d, seed=seed)
    return [part.view(t, -1, d) for part in out.split([hq * d, hkv * d, hkv * d], 1)]


@pytest.mark.parametrize("t", [1, 3, 17, 64])
def test_qk_norm_rope_is_rms_norm_then_rope(t):
    """The rollout's one launch == rms_norm then apply_rope on copies of q and k, and v copied, bit
    for bit; the rope at other positions, or another eps, gives other bits."""
    q, k, v = _stacked_qkv(t, 4, 2, 32, seed=80 + t)
    wq, wk = ((1 + 0.1 * rand(32, seed=s).float()).to(BF16) for s in (81, 82))
    cos, sin = R.rope_cos_sin(torch.arange(t) * 37 + 5, 32, 1e6)
    fq, fk, fv = T.qk_norm_rope(q, k, v, wq, wk, 1e-6, cos, sin)
    assert torch.equal(fq, T.apply_rope(T.rms_norm(q.contiguous(), wq, 1e-6), cos, sin))
    assert torch.equal(fk, T.apply_rope(T.rms_norm(k.contiguous(), wk, 1e-6), cos, sin))
    assert torch.equal(fv, v) and all(x.is_contiguous() for x in (fq, fk, fv))
    moved = R.rope_cos_sin(torch.arange(t) * 37 + 6, 32, 1e6)
    assert not torch.equal(T.qk_norm_rope(q, k, v, wq, wk, 1e-6, *moved)[0], fq)
    assert not torch.equal(T.qk_norm_rope(q, k, v, wq, wk, 1e-2, cos, sin)[1], fk)


def test_qk_norm_rope_leaves_unaddressed_layouts_to_the_ops():
    """None (the caller runs the separate ops) where the kernel's addressing does not hold: head_dim
    not a power of two, a strided last dim, no tokens, or a gradient to keep."""
    q, k, v = _stacked_qkv(3, 4, 2, 32, seed=83)
    w, cos, sin = rand(32, seed=84), *R.rope_cos_sin(torch.arange(3), 32, 1e6)
    assert T.qk_norm_rope(q, k, v, w, w, 1e-6, cos, sin) is not None
    q24, k24, v24 = _stacked_qkv(3, 4, 2, 24, seed=85)
    assert T.qk_norm_rope(q24, k24, v24, w[:24], w[:24], 1e-6, *R.rope_cos_sin(torch.arange(3), 24, 1e6)) is None
    assert T.qk_norm_rope(q.transpose(1, 2).contiguous().transpose(1, 2), k, v, w, w, 1e-6, cos, sin) is None
    assert T.qk_norm_rope(q[:0], k[:0], v[:0], w, w, 1e-6, cos[:0], sin[:0]) is None
    assert T.qk_norm_rope(q.clone().requires_grad_(), k, v, w, w, 1e-6, cos, sin) is None
    with torch.no_grad():
        assert T.qk_norm_rope(q.clone().requires_grad_(), k, v, w, w, 1e-6, cos, sin) is not None


@pytest.mark.parametrize("page, layout", [(16, "token-major"), (48, "head-major")])
def test_qk_norm_rope_stores_k_and_v_as_the_cache_write_does(page, layout):
    """Given the rollout's cache, the one launch stores k's and v's rows at their slots: the cache ==
    qk_norm_rope's k and v through write_kv_cache, bit for bit (slot -1 rows: nothing stored; a slot
    table longer than the batch, as vLLM's padded one), and q is the same; the slots one place on
    store other bits there."""
    t, hkv, d = 5, 2, 32
    q, k, v = _stacked_qkv(t, 4, hkv, d, seed=86)
    wq, wk = ((1 + 0.1 * rand(d, seed=s).float()).to(BF16) for s in (87, 88))
    cos, sin = R.rope_cos_sin(torch.arange(t) * 41 + 3, d, 1e6)
    slots = torch.tensor([page + 3, -1, 2 * page - 1, 0, 3 * page + 5, -1, 7])

    def caches():
        shape = (4, page, hkv, d) if layout == "token-major" else (4, hkv, page, d)
        made = [torch.full(shape, float("nan"), dtype=BF16) for _ in range(2)]
        return made if layout == "token-major" else [c.transpose(1, 2) for c in made]

    fq, fk, fv = T.qk_norm_rope(q, k, v, wq, wk, 1e-6, cos, sin)
    want = caches()
    T.write_kv_cache(fk, fv, *want, slots)
    got = caches()
    assert T.qk_norm_rope(q, k, v, wq, wk, 1e-6, cos, sin, cache=(*got, slots))[1:] == (None, None)
    out = T.qk_norm_rope(q, k, v, wq, wk, 1e-6, cos, sin, cache=(*caches(), slots))
    assert torch.equal(out[0], fq)
    for a, b in zip(got, want):
        assert torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0))
    assert got[0].isnan().sum() == (4 * page - 4) * hkv * d       # 4 of the 5 tokens have a slot
    moved = caches()
    T.qk_norm_rope(q, k, v, wq, wk, 1e-6, cos, sin, cache=(*moved, torch.where(slots >= 0, slots + 1, slots)))
    assert not torch.equal(moved[0].nan_to_num(7.0), want[0].nan_to_num(7.0))


def test_qk_norm_rope_leaves_a_cache_it_cannot_address_to_the_write():
    """None (the caller runs the ops and write_kv_cache) where the cache write's addressing does not
    hold: fewer slots than tokens, another dtype, other heads."""
    q, k, v = _stacked_qkv(3, 4, 2, 32, seed=89)
    w, cos, sin = rand(32, seed=90), *R.rope_cos_sin(torch.arange(3), 32, 1e6)
    cache = [torch.zeros(2, 16, 2, 32, dtype=BF16) for _ in range(2)]
    slots = torch.arange(3)
    assert T.qk_norm_rope(q, k, v, w, w, 1e-6, cos, sin, cache=(*cache, slots)) is not None
    assert T.qk_norm_rope(q, k, v, w, w, 1e-6, cos, sin, cache=(*cache, slots[:2])) is None
    assert T.qk_norm_rope(q, k, v, w, w, 1e-6, cos, sin, cache=(*(c.float() for c in cache), slots)) is None
    assert T.qk_norm_rope(q, k, v, w, w, 1e-6, cos, sin, cache=(*(c[:, :, :1] for c in cache), slots)) is None


def test_log_softmax_temperature_and_vocab_limit():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(5, 9000, generator=g) * 4
    temp = torch.tensor([0.7, 1.0, 1.3, 0.5, 2.0])
    lp = T.log_softmax(logits, temp, vocab_limit=8800)
    ref = R.log_softmax(logits, temp, vocab_limit=8800)
    assert (lp[:, :8800] - ref[:, :8800]).abs().max() < 1e-5 and torch.isneginf(lp[:, 8800:]).all()
    ids = torch.tensor([0, 8799, 8800, 17, 4])
    tok = T.token_logprobs(logits, ids, temp, vocab_limit=8800)
    assert torch.equal(tok, lp.gather(1, ids[:, None])[:, 0])
    assert torch.equal(T.log_softmax(logits, 0.7), T.log_softmax(logits, torch.full((5,), 0.7)))
    grads = []
    for backend in (T, R):
        x = logits.clone().requires_grad_()
        backend.token_logprobs(x, ids % 8800, temp, vocab_limit=8800).sum().backward()
        grads.append(x.grad)
    assert rel(*grads) < 1e-5


def test_log_softmax_lane_groups_keep_bits():
    """Passes 1-2 split a row's lanes over 1, 2 or 16 programs (the decode tail's fill): the same
    bits, as each lane still walks every block in order and one tree reduces the stored row. The
    companion: torch's log_softmax of the same z differs."""
    from consistent_ops.triton import logprobs as tl_lp
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(3, 9000, generator=g) * 4
    temp = torch.tensor([0.7, 1.0, 1.3])
    outs = [tl_lp._log_softmax_kernel_call(logits, temp, 8800, groups=n) for n in (1, 2, 16)]
    assert all(torch.equal(o, outs[0]) for o in outs[1:])
    assert tl_lp.lane_groups(3) == 16 and tl_lp.lane_groups(4096) == 1
    z = (logits / temp[:, None]).masked_fill(torch.arange(9000) >= 8800, float("-inf"))
    assert not torch.equal(outs[0], torch.log_softmax(z, -1))


# ---------------------------------------------------------------- MoE
H, I, E, K = 128, 128, 8, 2


@pytest.fixture(scope="module")
def moe():
    experts = {e: (rand(I, H, scale=0.1, seed=10 + e), rand(I, H, scale=0.1, seed=30 + e),
                   rand(H, I, scale=0.1, seed=50 + e)) for e in range(E)}
    return rand(40, H, seed=11), rand(E, H, seed=12), experts


def test_moe_route_and_contributions(moe):
    x, gate, experts = moe
    ids, w = T.moe_route(x, gate, K)
    ids_ref, w_ref = R.moe_route(x, gate, K)
    assert torch.equal(ids, ids_ref) and rel(w, w_ref) < 1e-6
    contrib, owned = T.moe_expert_contributions(x, ids, w, experts)
    contrib_ref, _ = R.moe_expert_contributions(x, ids, w, experts)
    assert owned.all() and rel(contrib, contrib_ref) < 1e-2
    assert rel(T.moe_combine(contrib, BF16), R.moe_combine(contrib_ref, BF16)) < 1e-2
    # a token's contribution does not depend on its batch or on expert placement (EP)
    alone, _ = T.moe_expert_contributions(x[7:9], ids[7:9], w[7:9], experts)
    assert torch.equal(alone, contrib[7:9])
    lo, own_lo = T.moe_expert_contributions(x, ids, w, experts, [0, 1, 2])
    hi, own_hi = T.moe_expert_contributions(x, ids, w, experts, [3, 4, 5, 6, 7])
    assert torch.equal(torch.where(own_lo[..., None], lo, hi), contrib) and torch.equal(own_lo ^ own_hi, owned)
    odd, own_odd = T.moe_expert_contributions(x, ids, w, experts, [1, 3, 6])     # not a range: lookup table
    assert torch.equal(odd[own_odd], contrib[own_odd]) and not own_odd.all()
    # the model's stacked layout (ExpertStack: gate_up [E, 2I, H], down) is read in place: the same bits
    stack = co.ExpertStack(torch.stack([torch.cat(experts[e][:2]) for e in range(E)]),
                           torch.stack([experts[e][2] for e in range(E)]), range(E))
    assert torch.equal(T.moe_expert_contributions(x, ids, w, stack)[0], contrib)
    assert torch.equal(R.moe_expert_contributions(x, ids, w, stack)[0], contrib_ref)
    assert torch.equal(T.moe_expert_contributions(x, ids, w, stack, [0, 1, 2])[0], lo)
    # the rollout's one call (a stack of every expert, no autograd): the two ops' bits, without the mask
    with torch.no_grad():
        assert torch.equal(T.moe_experts(x, ids, w, stack), T.moe_combine(contrib, x.dtype))
    assert T.moe_experts(x, ids, w, experts) is None                   # per-expert tensors: the caller runs both
    grad = co.ExpertStack(stack.gate_up.clone().requires_grad_(), stack.down, range(E))
    assert T.moe_experts(x, ids, w, grad) is None                      # under autograd: the caller runs both


def test_moe_grid_order_keeps_the_bits(moe, monkeypatch):
    """The experts' grid numbers a tile's column blocks first at decode sizes, a column block's tiles
    first above: the same programs, the same bits."""
    from consistent_ops.triton import moe as M
    x, gate, experts = moe
    ids, w = T.moe_route(x, gate, K)
    decode, _ = T.moe_expert_contributions(x, ids, w, experts)
    monkeypatch.setattr(M, "_DECODE_ROWS", 0)
    assert torch.equal(T.moe_expert_contributions(x, ids, w, experts)[0], decode)


def test_moe_gradients(moe):
    """Per-expert tensors and the stacks (gradients straight into gate_up / down) give the
    same gradients, close to the reference's."""
    x0, gate, experts = moe

    def run(backend, stacked, local=None):
        x, router = x0.clone().requires_grad_(), gate.clone().requires_grad_()
        ex = {e: tuple(t.clone().requires_grad_() for t in ws) for e, ws in experts.items()}
        if stacked:
            gate_up = torch.stack([torch.cat(experts[e][:2]) for e in range(E)]).requires_grad_()
            down = torch.stack([experts[e][2] for e in range(E)]).requires_grad_()
            ex = co.ExpertStack(gate_up, down, range(E))
        ids, w = backend.moe_route(x, router, K)
        if local is not None:             # this rank's experts only (EP): rows not a multiple of 8
            ex = co.ExpertStack(ex.gate_up[local[0]:local[-1] + 1], ex.down[local[0]:local[-1] + 1], local)
        contrib, _ = backend.moe_expert_contributions(x, ids, w, ex, local)
        (contrib * torch.linspace(-1, 1, H)).sum().backward()
        if stacked:
            return x.grad, router.grad, down.grad[1], gate_up.grad[2]
        return x.grad, router.grad, ex[1][2].grad, torch.cat([ex[2][0].grad, ex[2][1].grad])

    ref = run(R, False)
    for mine, stacked, want in zip(run(T, False), run(T, True), ref):
        assert torch.equal(mine, stacked) and rel(mine, want) < 2e-2
    for mine, want in zip(run(T, True, [1, 2, 3]), run(R, True, [1, 2, 3])):
        assert rel(mine, want) < 2e-2


def test_kv_cache_write_skips_padding_slots():
    """The Triton cache write (capturable: padding is skipped on the device) stores what the
    reference stores, for any cache strides; slot -1 rows write nothing."""
    k, v = rand(6, 2, 32, seed=60), rand(6, 2, 32, seed=61)
    slots = torch.tensor([5, -1, 17, 0, -1, 31])
    for layout in ("token-major", "head-major"):
        caches = []
        for backend in (T, R):
            if layout == "token-major":
                kc, vc = (torch.full((4, 8, 2, 32), float("nan"), dtype=BF16) for _ in range(2))
            else:
                kc, vc = (torch.full((4, 2, 8, 32), float("nan"), dtype=BF16).transpose(1, 2) for _ in range(2))
            backend.write_kv_cache(k, v, kc, vc, slots)
            caches.append((kc, vc))
        for a, b in zip(*caches):
            assert torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0)), layout
        assert caches[0][0].isnan().sum() == (32 - 4) * 2 * 32


def fused_cases():
    """Inputs for the fused router / RoPE / combine kernels, with exact ties in the router."""
    logits = torch.randn(40, 8, generator=torch.Generator().manual_seed(70))
    logits[3] = 0.5                                            # all experts tie: ids 0, 1
    logits[5, 2] = logits[5, 6] = logits[5].max() + 1          # a tie at the top: 2 before 6
    x = rand(40, 4, 32, seed=71)
    cos, sin = R.rope_cos_sin(torch.arange(40) * 37, 32, 1e6)
    return logits, x, cos, sin, torch.randn(40, 2, 128, generator=torch.Generator().manual_seed(72))


def test_fused_router_rope_combine_equal_their_torch_forms():
    """One kernel each (rollout), the same bits as the torch ops they replace (which the
    trainer's autograd path runs): router softmax + top-k (ties to the lower id) + renorm,
    RoPE, the slot-ordered combine."""
    from consistent_ops.triton import moe as M
    logits, x, cos, sin, contrib = fused_cases()
    ids, w = M._route_fused(logits, 2, True)
    ids_t, w_t = M._route_from_probs(M._softmax_rows(logits), 2, True)     # the training path's ops
    assert torch.equal(ids, ids_t) and torch.equal(w, w_t)
    assert ids[3].tolist() == [0, 1] and ids[5].tolist() == [2, 6]
    bad = logits.clone()
    bad[0] = float("nan")                    # a diverged row still names experts (no read past the table)
    ids_bad, w_bad = M._route_fused(bad, 2, True)
    assert ((ids_bad >= 0) & (ids_bad < logits.shape[1])).all() and w_bad[0].isnan().all()
    assert torch.equal(ids_bad[1:], ids[1:]) and torch.equal(w_bad[1:], w[1:])
    assert torch.equal(T.apply_rope(x, cos, sin), R.apply_rope(x, cos, sin))
    assert torch.equal(T.moe_combine(contrib, BF16), R.moe_combine(contrib, BF16))
    xg, cg = x.clone().requires_grad_(), contrib.clone().requires_grad_()
    (T.apply_rope(xg, cos, sin).float().sum() + T.moe_combine(cg, torch.float32).sum()).backward()
    assert xg.grad is not None and torch.equal(cg.grad, torch.ones_like(cg))


@pytest.mark.parametrize("t, k, n_exp, lo, n_local, bm", [(37, 2, 8, 3, 5, 16), (200, 8, 16, 0, 16, 16),
                                                          (1, 8, 128, 0, 128, 16), (100, 4, 8, 4, 4, 4),
                                                          (1100, 8, 16, 0, 16, 128)])   # 8,800 rows: 3 passes
def test_one_kernel_plan_equals_the_torch_plan(t, k, n_exp, lo, n_local, bm):
    """The MoE plan in one launch (_plan_fused) gives the torch plan's order, keys and tile
    table (idle tile slots: no rows either way)."""
    from consistent_ops.triton import moe as M
    ids = torch.randint(0, n_exp, (t, k), generator=torch.Generator().manual_seed(t))
    fused, key, n_tiles = M._plan_fused(ids.reshape(-1).contiguous(), lo, n_local, bm)
    M._FUSED_PLAN = False                            # the torch plan
    try:
        ref, key_ref, n_ref = M._plan(ids, list(range(lo, lo + n_local)), n_local, bm)
    finally:
        M._FUSED_PLAN = True
    live = ref["tile_e"] >= 0
    assert n_tiles == n_ref and torch.equal(key, key_ref)
    assert torch.equal(fused["order"], ref["order"]) and torch.equal(fused["tile_e"], ref["tile_e"])
    assert torch.equal(fused["row0"][live], ref["row0"][live]) and torch.equal(fused["row_end"][live], ref["row_end"][live])
    assert (fused["row0"][~live] >= fused["row_end"][~live]).all()
    # the grid's bound (_tile_bound) holds every row: live tiles cover the rows once
    covered = (torch.minimum(ref["row_end"], ref["row0"] + bm) - ref["row0"])[live]
    assert (covered > 0).all() and covered.sum() == t * k


def test_the_expert_grid_is_no_larger_than_the_rows_at_decode():
    """T=1, top-8, 128 experts: 8 tiles (every row its own expert, the worst case), not 130; the
    plan fills exactly those."""
    from consistent_ops.triton import moe as M
    assert M._tile_bound(8, 16, 128) == 8 and M._tile_bound(2048, 16, 128) == 128 + 129
    plan, _, n_tiles = M._plan_fused(torch.arange(8), 0, 128, 16)
    assert n_tiles == 8 and torch.equal(plan["tile_e"], torch.arange(8, dtype=torch.int32))


# ---------------------------------------------------------------- truncation
def test_truncation_keeps_the_reference_set_and_is_row_invariant():
    """The device truncation (sort, fixed-point kernel, boundary-compare kernel) keeps
    exactly the tokens the reference rule keeps (ties included: a row of equal values),
    a row alone == the row in a batch with mixed settings, off rows come back unchanged."""
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(4, 1500, generator=g) * 3
    logits[3, 100:400] = logits[3].max()                       # 300 tied maxima: ties -> lower ids
    lp = T.log_softmax(logits, 0.8, vocab_limit=1400)
    k = torch.tensor([20, 0, 0, 7])
    p = torch.tensor([0.9, 0.8, 1.0, 1.0], dtype=torch.float64)
    mp = torch.tensor([0.0, 0.05, 0.0, 0.0])
    assert torch.equal(T.truncation.keep_mask(lp, k, p, mp), R.truncation.keep_mask(lp, k, p, mp))
    out = T.truncate_logprobs(lp, k, p, mp)
    for r in range(4):
        alone = T.truncate_logprobs(lp[r:r + 1], int(k[r]), float(p[r]), float(mp[r]))
        assert torch.equal(out[r:r + 1], alone)
    assert torch.equal(out[2], lp[2])
    assert torch.nonzero(out[3] > float("-inf")).reshape(-1).tolist() == list(range(100, 107))
    ref = R.truncate_logprobs(lp, k, p, mp)
    assert torch.allclose(out[out > float("-inf")], ref[ref > float("-inf")], atol=1e-6)
