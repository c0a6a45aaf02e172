"""The reference backend's fp32 CPU realisation (dot32.c: 16 FMA lanes, one lane tree).

Bitwise: the same bits for any batch composition, M, row order, layout, thread count and
ISA build (the scalar fmaf path vs this machine's vector path); the lane order, the tree
and the FMA are each shown to decide bits (so those checks are not vacuous), and a naive
torch fp32 matmul is shown to depend on M. Accuracy against fp64 within a tolerance."""
import pytest
import torch

import consistent_ops as co
from consistent_ops import contract
from consistent_ops.reference import native

BIG = 2.0 ** 30


def _x(*shape, seed=0, dtype=torch.bfloat16):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _one_dot(values_a, values_b):
    a = torch.zeros(1, 32)
    b = torch.zeros(32, 1)
    for k, (x, y) in enumerate(zip(values_a, values_b)):
        a[0, k], b[k, 0] = x, y
    return native.dot32_matmul(a, b).item()


def test_lanes_tree_and_fma_decide_bits():
    # k = 0 and 16 share lane 0 (BIG - BIG = 0), k = 1 is lane 1: 1. Left to right: 0.
    assert _one_dot([BIG, 1.0] + [0.0] * 14 + [-BIG], [1.0] * 17) == 1.0
    # lanes 0 and 8 meet first in the tree: (BIG + 1) + (-BIG) = 0, lane by lane in order 1.
    assert _one_dot([BIG, -BIG] + [0.0] * 6 + [1.0], [1.0] * 9) == 0.0
    # lane 0: -(1 + 2^-11) then + (1 + 2^-12)^2: the FMA keeps the 2^-24 a rounded product drops.
    e = 1.0 + 2.0 ** -12
    assert _one_dot([1.0] + [0.0] * 15 + [e], [-(1.0 + 2.0 ** -11)] + [0.0] * 15 + [e]) == 2.0 ** -24


def test_accuracy_against_fp64():
    for m, k, n in [(1, 1, 1), (3, 5, 7), (32, 256, 512), (17, 130, 33), (2, 4099, 3)]:
        a, b = _x(m, k, seed=1), _x(k, n, seed=2)
        exact = a.double() @ b.double()
        bound = 2 * k * 2.0 ** -24 * (a.double().abs() @ b.double().abs()) + 1e-30
        assert ((native.dot32_matmul(a, b).double() - exact).abs() <= bound).all()


def test_same_bits_for_any_batch_rows_layout_threads():
    a, w = _x(40, 300, seed=3, dtype=torch.float32), _x(70, 300, seed=4)
    ref = native.dot32_matmul(a, w.t())
    assert torch.equal(native.dot32_matmul(a, w.t().contiguous()), ref)      # B contiguous in n
    for m in (1, 2, 3, 7, 33):
        assert torch.equal(native.dot32_matmul(a[5:5 + m], w.t()), ref[5:5 + m])
    perm = torch.randperm(40, generator=torch.Generator().manual_seed(5))
    assert torch.equal(native.dot32_matmul(a[perm], w.t()), ref[perm])
    mixed = torch.cat([a[:9], _x(11, 300, seed=6, dtype=torch.float32)])    # another batch around row 0..8
    assert torch.equal(native.dot32_matmul(mixed, w.t())[:9], ref[:9])
    assert torch.equal(native.dot32_matmul(a.expand(2, -1, -1), w.t())[1], ref)
    old = torch.get_num_threads()
    try:
        outs = []
        for t in (1, 2):
            torch.set_num_threads(t)
            outs.append(native.dot32_matmul(a, w.t()))
    finally:
        torch.set_num_threads(old)
    assert torch.equal(outs[0], ref) and torch.equal(outs[1], ref)


def test_naive_fp32_matmul_depends_on_m():
    a, w = _x(64, 4096, seed=7, dtype=torch.float32), _x(64, 4096, seed=8, dtype=torch.float32)
    full = a @ w.t()
    assert any(not torch.equal(a[:m] @ w.t(), full[:m]) for m in (1, 2, 3, 5))


def test_scalar_build_gives_the_same_bits(tmp_path, monkeypatch):
    """The portable build (no -march=native: no FMA or AVX, scalar fmaf) against this
    machine's: the order is the contract's, not the ISA's."""
    a, w = _x(9, 333, seed=9), _x(13, 333, seed=10)
    q, k, v = _x(1, 2, 70, 32, seed=11), _x(80, 1, 32, seed=12), _x(80, 1, 32, seed=13)
    def run():
        token = torch.arange(128)[None, :].clamp(max=79) * 32
        att = native.attend(q, k, v, token, 0, 1, torch.tensor([list(range(70))]), torch.tensor([80]), 0.17)
        return native.dot32_matmul(a, w.t()), att, native.rms_norm(a, w[0, :333], 1e-6)
    fast = run()
    monkeypatch.setattr(native, "CFLAGS", [f for f in native.CFLAGS if f != "-march=native"])
    monkeypatch.setenv("CONSISTENT_OPS_CACHE", str(tmp_path))
    monkeypatch.setattr(native, "_lib", None)
    assert all(torch.equal(x, y) for x, y in zip(run(), fast))


def test_realisation_is_in_the_fingerprint_and_bits_differ(monkeypatch):
    a, w = _x(8, 512, seed=14), _x(16, 512, seed=15)
    seen = {}
    for name in ("fp32", "fp64"):
        monkeypatch.setenv(contract.CPU_ACCUMULATION_ENV, name)
        seen[name] = (co.contract_fingerprint(), co.linear(a, w, out_dtype=torch.float32))
    assert seen["fp32"][0] != seen["fp64"][0]
    assert not torch.equal(seen["fp32"][1], seen["fp64"][1])


@pytest.mark.parametrize("name", ["fp32", "fp64"])
def test_trainer_and_rollout_paths_agree(name, monkeypatch):
    """Autograd forward (trainer) and no-grad forward (rollout) of linear, RMSNorm and
    attention give the same bits in each realisation; gradients flow."""
    monkeypatch.setenv(contract.CPU_ACCUMULATION_ENV, name)
    x, w = _x(6, 3, 64, seed=16), (1 + _x(64, seed=17) / 4)
    lin = _x(48, 64, seed=18)
    lens = [100, 7]
    q, k, v = _x(sum(lens), 4, 32, seed=19), _x(sum(lens), 2, 32, seed=20), _x(sum(lens), 2, 32, seed=21)
    cu = torch.tensor([0] + lens).cumsum(0)
    def fwd(*ts):
        return (co.rms_norm(ts[0], w, 1e-6), co.linear(ts[0], lin), co.attention_varlen(ts[1], k, v, cu))
    with torch.no_grad():
        fast = fwd(x, q)
    rec = fwd(x.clone().requires_grad_(), q.clone().requires_grad_())
    assert all(r.requires_grad and torch.equal(f, r.detach()) for f, r in zip(fast, rec))
    sum(r.float().sum() for r in rec).backward()
