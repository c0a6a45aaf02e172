"""RMSNorm, RoPE, SiLU*mul, log-probs: row results independent of the batch, accuracy
vs float64, the padded-vocabulary rule; stock companions where the stock op differs."""
import pytest
import torch
import torch.nn.functional as F

import consistent_ops as co

g = torch.Generator().manual_seed(0)
X = torch.randn(1000, 256, generator=g)


WINDOWS = [(0, 1), (3, 1), (5, 17), (100, 333)] + [(i, 1) for i in range(7, 400, 3)]


def rows_invariant(fn, x):
    full = fn(x)
    return all(torch.equal(fn(x[i:i + n]), full[i:i + n]) for i, n in WINDOWS)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rms_norm_rows_invariant(dtype):
    w = (1 + 0.1 * torch.randn(256, generator=g)).to(dtype)
    assert rows_invariant(lambda x: co.rms_norm(x, w, 1e-6), X.to(dtype))
    pair = torch.cat([X, X.flip(0)], -1).to(dtype)          # rows of (x, residual)
    assert rows_invariant(lambda p: torch.cat(co.add_rms_norm(p[:, :256], p[:, 256:], w, 1e-6), -1), pair)


def test_rms_norm_odd_width_rows_invariant():
    """Widths that are not a multiple of the SIMD width put some elements on ATen's
    scalar tail, whose position depends on the batch; the contract's ops do not care."""
    assert rows_invariant(lambda x: co.rms_norm(x, torch.ones(100), 1e-6), X[:, :100].contiguous())


def test_silu_mul_rows_invariant_and_stock_not():
    """Companion: stock F.silu (vectorised body vs scalar tail) changes a row's bits."""
    pair = torch.cat([X[:, :100], X.flip(0)[:, :100]], -1)  # rows of (gate, up); odd width
    assert rows_invariant(lambda p: co.silu_mul(p[:, :100], p[:, 100:]), pair)
    assert not rows_invariant(lambda p: F.silu(p[:, :100].contiguous()) * p[:, 100:], pair)


def test_pointwise_accuracy_vs_float64():
    w = 1 + 0.1 * torch.randn(256, generator=g)
    x64 = X.double()
    ref = x64 / torch.sqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()
    assert ((co.rms_norm(X, w, 1e-6).double() - ref).abs().max() / ref.abs().max()) < 1e-6
    ref = F.silu(x64) * x64.flip(0)
    assert ((co.silu_mul(X, X.flip(0)).double() - ref).abs().max() / ref.abs().max()) < 1e-6


@pytest.mark.parametrize("scaling", [None, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024,
                                              "beta_fast": 32, "beta_slow": 1, "truncate": True, "attention_factor": 1.2}])
def test_rope_table_rows_are_the_direct_rows(scaling):
    """The rollout's table (CPU inference mode: rows gathered from a table grown a block at a time)
    gives the direct computation's bits (the trainer's: no inference mode), in any order of growth
    (a decode step's 32 positions, then a jump past several blocks, then positions inside it)."""
    from consistent_ops.reference import pointwise
    pointwise._TABLES.clear()
    steps = [torch.arange(100, 132), torch.arange(5000).flip(0), torch.tensor([3, 4095, 1000, 0]), torch.arange(7000, 7300)]
    with torch.inference_mode():
        got = [co.rope_cos_sin(p, 64, 1e6, scaling) for p in steps]
    assert next(iter(pointwise._TABLES.values()))[0].shape[0] == 7424      # whole blocks of ROPE_TABLE_BLOCK
    for p, (c, s) in zip(steps, got):
        want = co.rope_cos_sin(p, 64, 1e6, scaling)
        assert torch.equal(c, want[0]) and torch.equal(s, want[1]) and c.is_contiguous()


def test_rope_depends_on_position_only():
    pos = torch.arange(5000)
    cos, sin = co.rope_cos_sin(pos, 64, 1e6)
    for p in (0, 1, 777, 4999):
        c, s = co.rope_cos_sin(torch.tensor([p]), 64, 1e6)
        assert torch.equal(c, cos[p:p + 1]) and torch.equal(s, sin[p:p + 1])
    x = torch.randn(5000, 2, 64, generator=g)
    out = co.apply_rope(x, cos, sin)
    assert torch.equal(co.apply_rope(x[777:778], cos[777:778], sin[777:778]), out[777:778])
    ang = pos.double()[:, None] * 1e6 ** (-torch.arange(0, 64, 2).double() / 64)
    ref = torch.cat([x[..., :32].double() * ang.cos()[:, None] - x[..., 32:].double() * ang.sin()[:, None],
                     x[..., 32:].double() * ang.cos()[:, None] + x[..., :32].double() * ang.sin()[:, None]], -1)
    assert ((out.double() - ref).abs().max() / ref.abs().max()) < 1e-6


def test_logprobs_rule():
    logits = 3 * torch.randn(64, 1024, generator=g)
    ids = torch.randint(0, 1000, (64,), generator=g)
    for t in (1.0, 0.7):
        lp = co.log_softmax(logits, t, vocab_limit=1000)
        assert torch.isinf(lp[:, 1000:]).all() and torch.isfinite(lp[:, :1000]).all()
        ref = torch.log_softmax(logits[:, :1000].double() / t, -1)
        assert (lp[:, :1000].double() - ref).abs().max() < 1e-5
        tok = co.token_logprobs(logits, ids, t, 1000)
        assert torch.equal(tok, lp[torch.arange(64), ids])
        assert all(torch.equal(co.token_logprobs(logits[i:i + 1], ids[i:i + 1], t, 1000), tok[i:i + 1])
                   for i in range(0, 64, 7))
    # Padded rows included vs excluded is a real difference: the rule must be shared.
    assert not torch.equal(co.log_softmax(logits, 1.0, 1000)[:, :1000], co.log_softmax(logits)[:, :1000])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_native_rope_equals_the_torch_steps(dtype):
    """Inference on CPU runs RoPE as one native call, autograd the torch steps: the same bits."""
    cos, sin = co.rope_cos_sin(torch.arange(300) * 37, 64, 1e6)
    x = (torch.randn(300, 3, 64, generator=g) * 100).to(dtype)
    from consistent_ops.reference import native
    trained = co.apply_rope(x.clone().requires_grad_(), cos, sin)        # recorded: the torch steps
    assert torch.equal(native.apply_rope(x, cos, sin), trained.detach())
    assert torch.equal(co.apply_rope(x, cos, sin), trained.detach())
