"""Triton attention on the GPU: one key walk, so every path gives the same bits.

train varlen == paged prefill == chunked prefill == decode == mixed batch, for any
page size, with a sequence past 16k; stock SDPA does not have this property; accuracy
and gradients against float64.
"""
import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("triton")

import torch.nn.functional as F  # noqa: E402

import consistent_ops as co  # noqa: E402
from consistent_ops.triton import common  # noqa: E402
from harness import PagedKV  # noqa: E402

co.set_backend("triton")
DEV, BF16 = "cuda", torch.bfloat16
HQ, HKV, D = 32, 4, 128
LENS = [16384 + 37, 1000, 5]          # one sequence past 16k, a short one, a tiny one


def rand(*shape, seed):
    g = torch.Generator(device=DEV).manual_seed(seed)
    return torch.randn(*shape, generator=g, device=DEV).to(BF16)


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def cu_of(lens):
    return torch.tensor([0] + lens, device=DEV).cumsum(0)


@pytest.fixture(scope="module")
def qkv():
    t = sum(LENS)
    return rand(t, HQ, D, seed=1), rand(t, HKV, D, seed=2), rand(t, HKV, D, seed=3)


@pytest.fixture(scope="module")
def train(qkv):
    return co.attention_varlen(*qkv, cu_of(LENS))


def _rows(seq, lo, hi):
    start = sum(LENS[:seq])
    return list(range(start + lo, start + hi))


def run_schedule(qkv, steps, page_size):
    """steps: list of [(seq, lo, hi)] new-token ranges per step. Returns {row: out}."""
    q, k, v = qkv
    kv = PagedKV(1, sum(-(-n // page_size) for n in LENS) + 4, page_size, HKV, D, BF16, DEV)
    got = {}
    for batch in steps:
        rows = [r for s, lo, hi in batch for r in _rows(s, lo, hi)]
        idx = torch.tensor(rows, device=DEV)
        out = kv.attend(0, q[idx], k[idx], v[idx], kv.plan([(s, hi - lo) for s, lo, hi in batch]))
        got.update(zip(rows, out))
    return got


def assert_rows_equal(got, train):
    rows = sorted(got)
    assert torch.equal(torch.stack([got[r] for r in rows]), train[torch.tensor(rows, device=DEV)])


def test_training_forward_equals_inference_forward(qkv, train):
    """With autograd on, the forward also stores the log-sum-exp: same output bits."""
    q, k, v = (t.clone().requires_grad_() for t in qkv)
    assert torch.equal(co.attention_varlen(q, k, v, cu_of(LENS)).detach(), train)


@pytest.mark.parametrize("page_size", [16, 64, 128])
def test_prefill_equals_train(qkv, train, page_size):
    assert_rows_equal(run_schedule(qkv, [[(s, 0, n) for s, n in enumerate(LENS)]], page_size), train)


def _chunked_steps():
    """Seq 0 in 4096-token chunks; seqs 1 and 2 prefilled, then decoded one token per step
    inside the same batches as seq 0's chunks (mixed batches: 128-row tiles)."""
    a, b, c = LENS
    steps = [[(1, 0, b - 3), (2, 0, c - 3)]]
    for i, lo in enumerate(range(0, a, 4096)):
        step = [(0, lo, min(lo + 4096, a))]
        if i < 3:
            step += [(1, b - 3 + i, b - 2 + i), (2, c - 3 + i, c - 2 + i)]
        steps.append(step)
    return steps


def test_chunked_prefill_mixed_with_decode_equals_train(qkv, train):
    assert_rows_equal(run_schedule(qkv, _chunked_steps(), 16), train)


@pytest.mark.parametrize("carry", [True, False], ids=["carried", "read-in-loop"])
@pytest.mark.parametrize("page_size", [16, 128])
def test_carried_page_ids_equal_train(qkv, train, page_size, carry, monkeypatch):
    """The unsplit paged walk with its page ids read a block ahead (_CARRY_PAGES, the default) or in
    the block's own iteration (the probes' `no carry`): chunked prefill mixed with decode == the
    trainer's bits on the MMAs too."""
    from consistent_ops.triton import attention as ta
    monkeypatch.setattr(ta, "_CARRY_PAGES", carry)
    monkeypatch.setattr(ta, "_split_programs", lambda device: 0)
    assert_rows_equal(run_schedule(qkv, _chunked_steps(), page_size), train)


@pytest.mark.parametrize("rows, warps", [(16, 4), (16, 1), (64, 4)])
@pytest.mark.parametrize("split", [True, False])
def test_decode_equals_train(qkv, train, split, rows, warps, monkeypatch):
    """Pure decode batches (the decode tile's 16 rows of 4 warps, of one, and the forward tile's 64) for the last 8
    tokens of every sequence, with one program per KV chunk, the last of a tile's folding (what so
    small a batch gets), and without."""
    from consistent_ops.triton import attention as ta
    monkeypatch.setattr(ta, "_split_programs", lambda device: (1 << 30) if split else 0)
    monkeypatch.setattr(ta, "_DECODE_TILE", (rows, warps, 3))
    steps = [[(s, 0, n - 8) for s, n in enumerate(LENS) if n > 8]]
    steps += [[(s, n - 8 + i, n - 7 + i) for s, n in enumerate(LENS) if n > 8] for i in range(8)]
    got = run_schedule(qkv, steps, 16)
    decoded = [r for s, n in enumerate(LENS) if n > 8 for r in _rows(s, n - 8, n)]
    assert_rows_equal({r: got[r] for r in decoded}, train)


@pytest.mark.parametrize("rows, warps", [(16, 4), (16, 1), (16, 2), (16, 8), (32, 2), (64, 4), (128, 8)])
def test_any_tile_gives_the_same_bits(qkv, train, rows, warps):
    """mma.sync tiles of 16 rows (1, 2, 4 or 8 warps: a row's keys across the warps), 32 of 2, and wgmma
    tiles (64 of 4, 128 of 8) give the training forward's bits: a row's scores and output are the same
    MMA steps, its max exact and its sum in integers (tests/test_triton_layouts.py checks the layouts).
    With a float row sum, 16 of 4 (H200, 2026-12-04) and 32 of 2 (H100, 2026-12-05) gave other bits."""
    from consistent_ops.contract import attention_scale
    from consistent_ops.triton import attention as ta
    q, k, v = qkv
    out = ta._forward(q, k, v, cu_of(LENS).to(torch.int32), None, None, attention_scale(D), False,
                      tile=(rows, warps, 3))
    assert torch.equal(out, train)


def test_another_kv_chunk_gives_other_bits(qkv, train):
    """Companion: a setting the contract fixes (the KV chunk, 256 keys instead of 512) moves bits."""
    from consistent_ops.contract import attention_scale
    from consistent_ops.triton import attention as ta
    q, k, v = qkv
    out = ta._forward(q, k, v, cu_of(LENS).to(torch.int32), None, None, attention_scale(D), False, chunk=256)
    assert not torch.equal(out, train)


def _counters_idle():
    torch.cuda.synchronize()
    return all(not b.any() for bufs in common.COUNTERS.values() for b in bufs)


@pytest.mark.parametrize("fold_stages, fold_half, off32, segment",
                         [(None, False, True, None), (2, False, True, None), (6, False, True, None),
                          (None, True, True, None), (None, False, False, None), (None, True, True, 4),
                          (None, False, True, 1)],
                         ids=["full", "fold2", "fold6", "half", "int64", "half-seg4", "full-seg1"])
def test_split_decode_graph_replays_equal_unsplit(fold_stages, fold_half, off32, segment, monkeypatch):
    """The decode tail's split launch, where the last program of a tile to store its chunk state
    folds them all (an arrival counter; no fold launch), captured in a CUDA graph of 8 launches in
    a row and replayed 100 times: every output of every replay == the unsplit launch bit for bit,
    so no fold read a state before it was visible (a race would flip bits in some replay) and the
    counters reset between launches (they end at 0). Tiles of 1, 2, 16 and 33 KV chunks; the fold's
    states read through its software pipeline (the default's stages, and 2 and 6), over the whole
    tile or (a decode step: one token of two) its real half of rows; the cache addressed
    with int64 offsets (a cache past int32) against the unsplit launch's int32; the fold in segments
    of 4 and of 1 chunk (each folded by its last arrival onto the fold of those before, or by the
    folder before it when all its chunks came first)."""
    from consistent_ops.triton import attention as ta
    from consistent_ops.contract import attention_scale
    monkeypatch.setattr(ta, "_split_programs", lambda device: 1 << 30)   # split (so small a batch does)
    if fold_stages:
        monkeypatch.setattr(ta, "_FOLD_STAGES", fold_stages)
    monkeypatch.setattr(ta, "_FOLD_HALF", fold_half)
    if segment:
        monkeypatch.setattr(ta, "_FOLD_SEGMENT", segment)
        monkeypatch.setattr(ta, "_SEGMENT_PROGRAMS", 0)      # segments at any grid
    lens, page = [16384 + 37, 1000, 5, 8000], 16
    n_pages = [-(-n // page) for n in lens]
    k, v = rand(sum(n_pages) + 8, page, HKV, D, seed=11), rand(sum(n_pages) + 8, page, HKV, D, seed=12)
    perm = torch.randperm(k.shape[0], generator=torch.Generator().manual_seed(0)).to(torch.int32)
    table = torch.zeros(len(lens), max(n_pages), dtype=torch.int32)
    for i, (n, lo) in enumerate(zip(n_pages, [0, *torch.tensor(n_pages).cumsum(0).tolist()])):
        table[i, :n] = perm[lo:lo + n]
    table, q = table.to(DEV), rand(len(lens), HQ, D, seed=13)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEV)
    qsl = torch.arange(len(lens) + 1, dtype=torch.int32, device=DEV)
    want = ta._forward(q, k, v, qsl, seq_lens, table, attention_scale(D), True, split=False)
    monkeypatch.setattr(ta, "_fits_int32", lambda *caches: off32)

    def launches():
        return [co.attention_paged(q, k, v, table, seq_lens, qsl) for _ in range(8)]

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):                   # eager warm-up: allocates the counters (never in capture)
        assert all(torch.equal(o, want) for o in launches())
    torch.cuda.current_stream().wait_stream(side)
    assert common.COUNTERS[q.device] and _counters_idle()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = launches()
    for replay in range(100):
        graph.replay()
        assert all(torch.equal(o, want) for o in outs), f"replay {replay}"
    assert _counters_idle()


@pytest.mark.parametrize("width", [3, 40])
def test_dummy_metadata_reads_inside_the_table_and_cache(width):
    """vLLM's capture and memory-profiling dummies (max_model_len not a multiple of the page
    size: the engine crashed with an illegal memory access) give sequences longer than a
    table row and empty or stale tables, on a cache of few pages: the kernel reads inside
    the table and the cache, and a real request beside them keeps its bits. Rows of 40 pages
    (640 keys: two KV chunks) run split (a program per chunk; so small a batch always does):
    no chunk state is read past the table's capacity either."""
    page, pages = 16, 8                            # rows hold 16 * width keys; the cache 128
    q, k, v = rand(4 + 100, HQ, D, seed=7), rand(pages, page, HKV, D, seed=8), rand(pages, page, HKV, D, seed=9)
    real = torch.tensor([[5, 2, 7] + [0] * (width - 3)], dtype=torch.int32, device=DEV)
    one = co.attention_paged(q[:4], k, v, real, torch.tensor([40], dtype=torch.int32, device=DEV),
                             torch.tensor([0, 4], dtype=torch.int32, device=DEV))
    table = torch.cat([real, torch.tensor([[-1, 10**6, 3] + [3] * (width - 3)], dtype=torch.int32, device=DEV)])
    both = co.attention_paged(q, k, v, table, torch.tensor([40, 1664], dtype=torch.int32, device=DEV),
                              torch.tensor([0, 4, 104], dtype=torch.int32, device=DEV))
    assert torch.equal(both[:4], one) and torch.isfinite(both[4:]).all() and _counters_idle()


def test_stock_sdpa_prefill_and_decode_differ():
    """Non-vacuous: SDPA over the whole sequence vs SDPA for one new token against its
    prefix (what an HF-style decode does) give different bits."""
    n = 2048
    q, k, v = (rand(1, h, n, D, seed=s) for h, s in ((HQ, 4), (HKV, 5), (HKV, 6)))
    full = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    same = 0
    for t in range(n - 32, n):
        step = F.scaled_dot_product_attention(q[:, :, t:t + 1], k[:, :, :t + 1], v[:, :, :t + 1],
                                              enable_gqa=True)
        same += torch.equal(step[:, :, 0], full[:, :, t])
    assert same < 32, "stock SDPA decode matched prefill on every token"


def attention64(q, k, v, lens):
    """float64 causal GQA attention, one sequence at a time (autograd-capable)."""
    outs, start, g = [], 0, HQ // HKV
    for n in lens:
        qs = q[start:start + n].transpose(0, 1)
        ks = k[start:start + n].repeat_interleave(g, 1).transpose(0, 1)
        vs = v[start:start + n].repeat_interleave(g, 1).transpose(0, 1)
        s = qs @ ks.transpose(1, 2) / D ** 0.5
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=DEV).triu(1), float("-inf"))
        outs.append((s.softmax(-1) @ vs).transpose(0, 1))
        start += n
    return torch.cat(outs)


@pytest.mark.parametrize("lens", [[700, 1500], [300, 200]])   # 3 query chunks / one (chunks == 1)
def test_forward_and_gradients_vs_float64(lens):
    t = sum(lens)
    base = [rand(t, HQ, D, seed=7), rand(t, HKV, D, seed=8), rand(t, HKV, D, seed=9)]
    do = rand(t, HQ, D, seed=10)
    grads = []
    for _ in range(2):
        q, k, v = (x.clone().requires_grad_() for x in base)
        out = co.attention_varlen(q, k, v, cu_of(lens))
        out.backward(do)
        grads.append((out, q.grad, k.grad, v.grad))
    q64, k64, v64 = (x.double().requires_grad_() for x in base)
    ref = attention64(q64, k64, v64, lens)
    ref.backward(do.double())
    bounds = (1e-2, 2e-2, 2e-2, 2e-2)   # bf16 rounding of the output / of p and dS
    for mine, exact, bound in zip(grads[0], (ref, q64.grad, k64.grad, v64.grad), bounds):
        assert rel(mine, exact) < bound
    for a, b in zip(*grads):             # fixed-order accumulation: run-to-run identical
        assert torch.equal(a, b)
