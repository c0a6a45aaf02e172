"""The reference backend's CPU contraction (dot64.c): one fixed order, whatever the layout.

Every claim is bitwise. The order is shown to matter (a sum whose fp64 rounding depends on
it), so the layout/batch invariance checks cannot pass because all orders agree.
"""
import pytest
import torch

from consistent_ops.reference import native
from consistent_ops.reference.core import matmul32

BIG = 2.0 ** 60


def _bf16(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).bfloat16()


@pytest.mark.parametrize("m,k,n", [(1, 1, 1), (3, 5, 7), (32, 256, 512), (17, 130, 33), (64, 64, 4)])
def test_bf16_products_match_fp64_blas(m, k, n):
    """bf16 products have 16 bits, so these fp64 sums are exact and every order agrees."""
    a, b = _bf16(m, k, seed=1), _bf16(n, k, seed=2)
    assert torch.equal(native.dot64_matmul(a, b.t()), (a.double() @ b.double().t()).float())


def test_fixed_lane_order_not_sequential():
    """k = 0..3 land in four lanes summed (0+1)+(2+3): 2^60 + 1 and -2^60 + 1 each round,
    giving 0 where a left-to-right sum gives 1."""
    a = torch.ones(1, 4, dtype=torch.float64)
    b = torch.tensor([[BIG], [1.0], [-BIG], [1.0]], dtype=torch.float64)
    sequential = ((BIG + 1.0) - BIG) + 1.0
    assert sequential == 1.0
    assert native.dot64_matmul(a, b).item() == 0.0


def _cancelling(m, k, n, seed):
    """fp64 operands whose sums cancel: each row of a holds +2^60 and -2^60 at random places
    among small values and b is +-1, so which small terms survive depends on the order."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(m, k, generator=g, dtype=torch.float64)
    for i in range(m):
        p, q = torch.randperm(k, generator=g)[:2].tolist()
        a[i, p], a[i, q] = BIG, -BIG
    b = torch.randint(0, 2, (k, n), generator=g).double() * 2 - 1
    return a, b


def test_order_is_the_same_for_every_layout_and_batch():
    a, b = _cancelling(24, 37, 19, seed=3)
    ref = native.dot64_matmul(a, b)
    assert not torch.equal(ref, (a @ b).float()), "BLAS's order should differ somewhere here"
    cols = native.dot64_matmul(a, b.contiguous())                 # B contiguous in n
    rows = native.dot64_matmul(a, b.t().contiguous().t())         # B contiguous in k
    assert torch.equal(rows, ref) and torch.equal(cols, ref)
    alone = torch.cat([native.dot64_matmul(a[i:i + 1], b) for i in range(a.shape[0])])
    assert torch.equal(alone, ref)
    batched = native.dot64_matmul(a.expand(3, -1, -1), b)         # a batch of the same rows
    assert all(torch.equal(x, ref) for x in batched)
    assert torch.equal(native.dot64_matmul(a[::2], b), ref[::2])  # strided rows


def test_broadcast_batches_and_fp16_operands():
    a, b = _bf16(2, 3, 5, 16, seed=4), _bf16(3, 16, 6, seed=5)
    out = native.dot64_matmul(a, b)
    assert out.shape == (2, 3, 5, 6) and out.dtype == torch.float32
    assert torch.equal(out, (a.double() @ b.double()).float())
    h = a.half()
    assert torch.equal(native.dot64_matmul(h, b), (h.double() @ b.double()).float())


def test_autograd_matches_fp64():
    a = _bf16(6, 10, seed=7).float().requires_grad_()
    b = _bf16(10, 4, seed=8).float().requires_grad_()
    a64, b64 = a.detach().double().requires_grad_(), b.detach().double().requires_grad_()
    matmul32(a, b).pow(2).sum().backward()
    (a64 @ b64).float().pow(2).sum().backward()
    assert torch.allclose(a.grad, a64.grad.float(), rtol=1e-6) and torch.allclose(b.grad, b64.grad.float(), rtol=1e-6)


def test_build_error_names_the_fix(tmp_path, monkeypatch):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("CONSISTENT_OPS_CACHE", str(tmp_path))
    with pytest.raises(RuntimeError, match="install one"):
        native._build()


def test_rows_computes_only_each_groups_rows():
    """MoE groups padded to the largest: rows past a group's count are 0 (an empty group
    costs nothing), the others are the full product's bits; no gradient passes them."""
    a, b = _bf16(3, 6, 16, seed=9).float().requires_grad_(), _bf16(3, 16, 5, seed=10).float()
    rows = torch.tensor([6, 2, 0])
    full, part = matmul32(a.detach(), b), matmul32(a, b, rows)
    keep = (torch.arange(6) < rows[:, None])[..., None]
    assert torch.equal(part, torch.where(keep, full, 0.0))
    part.sum().backward()
    assert torch.equal(a.grad, torch.where(keep, (torch.ones(3, 6, 5).double() @ b.double().mT).float(), 0.0))


def test_attention_forward_is_native_with_and_without_autograd():
    """On CPU the trainer's recorded forward, its no-grad forward and the rollout all run the
    native one-pass attention: the same bits; its gradient comes from the torch loop. A
    one-shot softmax (no block recurrence) lands elsewhere, so the equality is not vacuous."""
    import consistent_ops as co
    g = torch.Generator().manual_seed(11)
    lens = [150, 64, 7]
    q = torch.randn(sum(lens), 4, 32, generator=g).bfloat16()
    k, v = (torch.randn(sum(lens), 2, 32, generator=g).bfloat16() for _ in range(2))
    cu = torch.tensor([0] + lens).cumsum(0)
    with torch.no_grad():
        fast = co.attention_varlen(q, k, v, cu)
    q64 = q.double().requires_grad_()
    qr = q.clone().float().requires_grad_()
    recorded = co.attention_varlen(qr.bfloat16(), k, v, cu)
    assert recorded.requires_grad and torch.equal(fast, recorded.detach())
    recorded.float().sum().backward()
    ref = co.attention_varlen(q64, k.double(), v.double(), cu)     # an fp64 reference
    ref.sum().backward()
    assert torch.allclose(qr.grad.double(), q64.grad, rtol=2e-2, atol=2e-2)
    one_shot = torch.nn.functional.scaled_dot_product_attention(
        q[:150].float().transpose(0, 1), k[:150].float().repeat_interleave(2, 1).transpose(0, 1),
        v[:150].float().repeat_interleave(2, 1).transpose(0, 1), is_causal=True).transpose(0, 1).bfloat16()
    assert not torch.equal(one_shot, fast[:150])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rms_norm_in_one_call_equals_the_torch_steps(dtype):
    """Inference runs RMSNorm (and its residual add) in one native call, autograd the torch
    steps: the same bits (1,200 rows: the fp32/bf16 realisations split them over the threads). A stock
    fp32 RMSNorm (rsqrt of a mean) differs somewhere."""
    import consistent_ops as co
    g = torch.Generator().manual_seed(12)
    x, res = (torch.randn(400, 3, 64, generator=g).to(dtype) * 3 for _ in range(2))
    w = (1 + torch.randn(64, generator=g) / 4).to(dtype)
    with torch.no_grad():
        y_fast, r_fast = co.add_rms_norm(x, res, w, 1e-6)
        plain = co.rms_norm(x, w, 1e-6)
    x_rec = x.clone().requires_grad_()
    y_rec, r_rec = co.add_rms_norm(x_rec, res, w, 1e-6)
    assert y_rec.requires_grad
    assert torch.equal(y_fast, y_rec.detach()) and torch.equal(r_fast, r_rec.detach())
    assert torch.equal(plain, co.rms_norm(x.clone().requires_grad_(), w, 1e-6).detach())
    x32, w32 = x.float(), w.float()                     # fp32: no bf16 rounding to hide it
    stock = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6) * w32
    with torch.no_grad():
        assert not torch.equal(stock, co.rms_norm(x32, w32, 1e-6))


def test_inv_sqrt_is_ieee_where_torch_sqrt_is_not():
    """The contract asks for IEEE sqrt and division; on CPU torch.sqrt misses the correctly
    rounded result in some last bits, numpy's float32 sqrt does not, and ours equals numpy."""
    import numpy as np
    from consistent_ops.reference.core import inv_sqrt32
    v = torch.rand(4096, generator=torch.Generator().manual_seed(13)) * 20 + 0.1
    ieee = np.float32(1) / np.sqrt(v.numpy())
    assert np.array_equal(inv_sqrt32(v).numpy(), ieee)
    assert not np.array_equal((1.0 / torch.sqrt(v)).numpy(), ieee)
    x = v.clone().requires_grad_()
    inv_sqrt32(x).sum().backward()
    assert torch.allclose(x.grad, -0.5 * v ** -1.5, rtol=1e-5)
