"""The bf16 realisation's AMX engine (dot32.c block_tiles, $CONSISTENT_OPS_CPU_AMX): each lane of each
output its own TDPBF16PS chain, the pairs packed swapped, the lanes in finish16's tree. Here it runs
in its C emulation of the instruction (the engine's whole data path: packing, swapping, tail tiles,
tree; no AMX needed), and on AMX itself where the CPU and Linux allow it (else those cases skip), and
must give the bits of the VDPBF16PS pair path (block_pairs) bit for bit,
-0 and NaN positions included, over shapes, hard inputs, layouts and the fused calls that go through
dot_pairs. Companions: the emulation made wrong in each way the order could be (pairs not swapped,
no DAZ, no FTZ, one rounding a pair, another lane tree) differs on inputs built to show it."""
import pytest
import torch

from consistent_ops import contract
from consistent_ops.reference import native

UNSWAPPED, NO_DAZ, NO_FTZ, ONE_ROUNDING, LANE_ORDER = 1, 2, 4, 8, 16   # dot32.c's test-only variants


@pytest.fixture(autouse=True)
def _bf16(monkeypatch):
    monkeypatch.setenv(contract.CPU_ACCUMULATION_ENV, "bf16")


@pytest.fixture(params=["emulate", "1"])
def engine(request, monkeypatch):
    """The tiles' engine under test: the C emulation, and AMX (CONSISTENT_OPS_CPU_AMX=1) where it runs."""
    monkeypatch.setenv(native.AMX_ENV, request.param)
    if native.amx_engine() == "off":
        pytest.skip("no AMX-BF16 here (or Linux refused tile data)")
    return request.param


def bits(t):
    """t's bit patterns as int32 (so -0 != +0), every NaN one pattern (the tree's operand order may
    pick its payload, in either engine)."""
    t = t.float()                       # bf16 -> fp32 is exact, zeros keep their sign
    b = t.view(torch.int32).clone()
    b[t.isnan()] = 0x7FC00000
    return b


def both(monkeypatch, fn, variant=0, engine="emulate"):
    """fn() on the pair path and on the tiles (emulated: in the given test-only variant)."""
    monkeypatch.setenv(native.AMX_ENV, "off")
    ref = fn()
    monkeypatch.setenv(native.AMX_ENV, engine)
    native.library().dot32_tiles_variant(variant)
    try:
        got = fn()
    finally:
        native.library().dot32_tiles_variant(0)
    return ref, got


def same(pairs):
    return all(torch.equal(bits(x), bits(y)) for x, y in zip(*pairs))


def _x(*shape, seed, scale=1.0):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).bfloat16()


def _bf16_bits(values):
    return torch.tensor(values, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)


def test_the_switch(monkeypatch):
    flags = native._flag_set(native._cpu_flags())
    for value, engine in (("0", "off"), ("off", "off"), ("emulate", "emulate"),
                          ("1", "amx" if {"amx_bf16", "amx_tile"} <= flags else "off")):   # no AMX: silently off
        monkeypatch.setenv(native.AMX_ENV, value)
        assert native.amx_engine() == engine
    monkeypatch.delenv(native.AMX_ENV)
    assert native.amx_engine() == "off"
    monkeypatch.setenv(native.AMX_ENV, "yes")
    with pytest.raises(ValueError, match="CONSISTENT_OPS_CPU_AMX='yes'"):
        native.amx_engine()


@pytest.mark.parametrize("k", [1, 2, 31, 32, 33, 64, 100, 4096])
def test_same_bits_for_every_shape(k, monkeypatch, engine):
    a, w = _x(64, k, seed=1), _x(33, k, seed=2)
    shapes = [(m, n) for m in (1, 2, 3, 4, 5, 17, 64) for n in (1, 3, 16, 17, 33)]
    for m, n in shapes if k < 4096 else [(1, 1), (5, 17), (17, 33), (64, 16)]:
        assert same(both(monkeypatch, lambda: [native.dot32p_matmul(a[:m], w[:n].t())], engine=engine)), (m, n, k)


def _hard(kind, k, seed):
    """[8, k] bf16 operands of one kind."""
    g = torch.Generator().manual_seed(seed)
    if kind == "denormal":             # bf16 denormals against 2^100: DAZ makes ~2^-30 products 0
        den = _bf16_bits((torch.randint(1, 128, (8, k), generator=g) | torch.randint(0, 2, (8, k), generator=g) << 15).tolist())
        return torch.where(torch.rand(8, k, generator=g) < 0.5, den, _x(8, k, seed=seed, scale=2.0 ** 100))
    if kind == "tiny":                 # products and sums around 2^-126: FTZ decides, lanes of -0
        return _x(8, k, seed=seed, scale=2.0 ** -63)
    if kind == "cancel":               # pair elements k + 1 ~ -k, large, beside small ones
        x = _x(8, k, seed=seed) * torch.exp2(torch.randint(0, 24, (8, k), generator=g)).bfloat16()
        x[:, 1::2] = -x[:, 0:k - 1:2] * (1 + torch.randint(-2, 3, x[:, 1::2].shape, generator=g) * 2.0 ** -7)
        return x
    x = _x(8, k, seed=seed)            # "special": inf, -inf, NaN, -0 among ordinary values
    pick = torch.randint(0, 40, (8, k), generator=g)
    for code, value in ((0, float("inf")), (1, -float("inf")), (2, float("nan")), (3, -0.0)):
        x[pick == code] = value
    return x


@pytest.mark.parametrize("kind", ["denormal", "tiny", "cancel", "special"])
def test_same_bits_on_hard_inputs(kind, monkeypatch, engine):
    seen = []
    for k in (31, 32, 33, 64, 100):
        a, b = _hard(kind, k, 3), _hard(kind, k, 4)
        ref, got = both(monkeypatch, lambda: [native.dot32p_matmul(a, b.t())], engine=engine)
        assert same((ref, got)), (kind, k)
        seen.append(bits(ref[0]).flatten())
    seen = torch.cat(seen)
    if kind == "special":              # the inputs reach NaN and inf outputs
        assert (seen == 0x7FC00000).any() and (seen == 0x7F800000).any()


def test_a_lane_of_negative_zeros_stays_as_the_pair_path_leaves_it(monkeypatch, engine):
    """Products of -2^-140 flush to -0 in every lane: with K a multiple of 32 the output is -0; K = 33
    pads lanes 1-15 with +0 . +0 pairs, which make them +0 (and the output +0) on the pair path: the
    tiles' own padding (+0 . -0 products) must add nothing beyond that."""
    for k, sign in ((31, -0.0), (32, -0.0), (64, -0.0), (33, 0.0), (100, 0.0)):
        a, b = torch.full((3, k), -(2.0 ** -70)).bfloat16(), torch.full((5, k), 2.0 ** -70).bfloat16()
        ref, got = both(monkeypatch, lambda: [native.dot32p_matmul(a, b.t())], engine=engine)
        assert torch.equal(bits(ref[0]), bits(torch.full((3, 5), sign))) and same((ref, got)), k


def test_same_bits_for_any_layout_batch_and_threads(monkeypatch, engine):
    a, w = _x(40, 300, seed=5), _x(70, 300, seed=6)
    a3, b3 = _x(2, 9, 64, seed=7), _x(2, 64, 13, seed=8)
    calls = lambda: [native.dot32p_matmul(a, w.t()), native.dot32p_matmul(a, w.t().contiguous()),   # B contiguous in n
                     native.dot32p_matmul(a.t().contiguous().t(), w.t()),                           # A strided in k
                     native.dot32p_matmul(a[::3], w[::2].t()), native.dot32p_matmul(a[:, :256], w[:, :256].t()),
                     native.dot32p_matmul(a3, b3), native.dot32p_matmul(a3, b3, rows=torch.tensor([4, 0])),
                     native.dot32p_matmul(a3.expand(2, 2, 9, 64), b3)]
    assert same(both(monkeypatch, calls, engine=engine))
    big = _x(64, 256, seed=9), _x(70, 256, seed=10)                 # enough work for the OpenMP split
    old = torch.get_num_threads()
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            assert same(both(monkeypatch, lambda: [native.dot32p_matmul(big[0], big[1].t())], engine=engine))
    finally:
        torch.set_num_threads(old)


def test_fused_calls_through_dot_pairs(monkeypatch, engine):
    """The fused rollout calls go through dot_pairs: the same bits on the tiles; on all-denormal
    activations against 2^120 weights the no-DAZ variant changes them (so the tiles really ran)."""
    def calls(scale, x):
        t, h, d = x.shape[0], 256, 64
        wq, wk, wv, wg, wu = (_x(n, h, seed=s, scale=scale) for n, s in ((256, 11), (128, 12), (128, 13), (96, 14), (96, 15)))
        wd, nw, gate = _x(h, 96, seed=16, scale=scale), 1 + _x(h, seed=17) / 4, _x(8, h, seed=18, scale=scale)
        angle = torch.rand(t, d // 2, generator=torch.Generator().manual_seed(19)) * 100
        ids = torch.randint(0, 8, (t, 2), generator=torch.Generator().manual_seed(19))
        ids[:, 1] = (ids[:, 0] + 1) % 8
        wts = torch.rand(t, 2, generator=torch.Generator().manual_seed(19))
        gu, dn = _x(4, 2 * 48, h, seed=20, scale=scale), _x(4, h, 48, seed=21, scale=scale)
        return lambda: [*native.attention_prologue(x, wq, wk, wv, nw[:d], nw[d:2 * d], 1e-6, angle.cos(), angle.sin(), d),
                        *native.linear_add_rms_norm(x, wq, x, nw, 1e-6), native.mlp(x, wg, wu, wd),
                        *native.moe_router(x, gate, 2, True),
                        *native.moe_experts(x, ids, wts, gu, dn, 2, combine=True)[::2]]
    with torch.inference_mode():
        for t in (1, 37, 130):
            assert same(both(monkeypatch, calls(1 / 16, _x(t, 256, seed=22)), engine=engine)), t
        g = torch.Generator().manual_seed(23)
        den = _bf16_bits((torch.randint(1, 128, (37, 256), generator=g) | torch.randint(0, 2, (37, 256), generator=g) << 15).tolist())
        assert same(both(monkeypatch, calls(2.0 ** 120, den), engine=engine))
        ref, got = both(monkeypatch, calls(2.0 ** 120, den), NO_DAZ)
        assert all(not torch.equal(bits(x), bits(y)) for x, y in zip(ref, got))


def _dot(values_a, values_b, k=64):
    """One dot of two bf16 rows given as {k: value}."""
    a, b = torch.zeros(1, k), torch.zeros(1, k)
    for i, v in values_a.items():
        a[0, i] = v
    for i, v in values_b.items():
        b[0, i] = v
    return lambda: [native.dot32p_matmul(a.bfloat16(), b.bfloat16().t())]


@pytest.mark.parametrize("variant, values_a, values_b", [
    # lane 0: acc 1, then the pair (32, 33): -1 first gives 0 + 2^-30; 2^-30 first is lost in 1
    (UNSWAPPED, {0: 1.0, 32: 2.0 ** -15, 33: -1.0}, {0: 1.0, 32: 2.0 ** -15, 33: 1.0}),
    (NO_DAZ, {0: 2.0 ** -130, 2: 2.0 ** -20}, {0: 2.0 ** 100, 2: 1.0}),       # a bf16 denormal x 2^100
    (NO_FTZ, {0: 2.0 ** -70}, {0: 2.0 ** -70}),                              # 2^-140 flushed
    (ONE_ROUNDING, {0: 1.0, 32: 2.0 ** -12, 33: 2.0 ** -12}, {0: 1.0, 32: 2.0 ** -12, 33: 2.0 ** -12}),  # two ties vs 2^-23
    (LANE_ORDER, {0: 2.0 ** 15, 16: -(2.0 ** 15), 2: 1.0}, {0: 2.0 ** 15, 16: 2.0 ** 15, 2: 1.0}),  # lanes 0 and 8 first
])
def test_each_wrong_order_is_seen(variant, values_a, values_b, monkeypatch):
    assert same(both(monkeypatch, _dot(values_a, values_b)))
    assert not same(both(monkeypatch, _dot(values_a, values_b), variant))
