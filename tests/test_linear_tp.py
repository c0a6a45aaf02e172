"""Linear: a row's bits do not depend on the batch or the thread count; TP row-parallel
emulated for k = 1, 2, 4 equals a real 2-process gloo group. Bitwise, with stock companions."""
import numpy as np
import pytest
import torch

import consistent_ops as co
from consistent_ops import parallel
from helpers import run_gloo

SIZES = [1, 2, 3, 7, 16, 33, 100, 257, 1000]


def data(m=2048, k=512, n=384, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(m, k, generator=g).to(dtype), (0.05 * torch.randn(n, k, generator=g)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_row_invariant(dtype):
    x, w = data(dtype=dtype)
    full = co.linear(x, w)
    for m in SIZES:
        for start in (0, m, 1024 - m):
            assert torch.equal(co.linear(x[start:start + m], w), full[start:start + m])


def test_stock_fp32_matmul_is_not_row_invariant():
    x, w = data(dtype=torch.float32)
    full = x @ w.T
    assert any(not torch.equal(x[:m] @ w.T, full[:m]) for m in SIZES)


def _threads(n, fn):
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        return fn()
    finally:
        torch.set_num_threads(old)


def test_thread_count_invariant():
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(4, 65536, generator=g), torch.randn(16, 65536, generator=g)
    ours = [_threads(n, lambda: co.linear(x, w, out_dtype=torch.float32)) for n in (1, 2)]
    assert torch.equal(*ours)
    # Companion: what a thread split of K (as BLAS GEMMs do) does to a sum: the same fp32
    # products added left to right in one pass vs in two halves, written out explicitly
    # (np.cumsum is a strictly sequential accumulate), so no library heuristic decides it.
    prods = (x[:, None, :] * w[None, :, :]).numpy()                      # fp32 [4, 16, K]
    half = prods.shape[-1] // 2
    one_pass = np.cumsum(prods, axis=-1)[..., -1]
    two_halves = np.cumsum(prods[..., :half], axis=-1)[..., -1] + np.cumsum(prods[..., half:], axis=-1)[..., -1]
    assert (one_pass != two_halves).any()


def test_tp_emulation_is_tp_invariant():
    x, w = data(m=64)
    ref = co.row_parallel_linear(x, w, 1)
    for k in (2, 4):
        assert torch.equal(co.row_parallel_linear(x, w, k), ref)


def test_stock_tp_partials_differ():
    """Companion: stock TP (fp32 partials, backend all-reduce ~ sum) differs from TP=1."""
    x, w = data(m=256, dtype=torch.float32)
    tp1 = x @ w.T
    tp4 = sum(xs @ ws.T for xs, ws in zip(x.chunk(4, -1), w.chunk(4, -1)))
    assert not torch.equal(tp1, tp4)


def _rank_row_parallel(rank, world, x, w):
    shard = x.shape[-1] // world
    sl = slice(rank * shard, (rank + 1) * shard)
    total = parallel.gather_ordered_sum(co.row_parallel_partial(x[:, sl], w[:, sl]))
    return co.finish_row_parallel(total, None, x.dtype)


def test_real_gloo_group_equals_emulation():
    x, w = data(m=64)
    results = run_gloo(_rank_row_parallel, 2, (x, w))
    for k in (1, 2, 4):
        emulated = co.row_parallel_linear(x, w, k)
        assert all(torch.equal(r, emulated) for r in results)


def test_tp_not_dividing_is_a_clear_error():
    x, w = data(m=4, k=30)
    with pytest.raises(ValueError, match="not divisible by tp_size=4"):
        co.row_parallel_linear(x, w, 4)
