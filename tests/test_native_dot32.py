"""The reference backend's fp32 CPU realisation (dot32.c: 16 FMA lanes, one lane tree) and its
bf16 realisation (dot32.c dot32p: VDPBF16PS pairs in the same lanes, or their C emulation).

Bitwise: the same bits for any batch composition, M, row order, layout, thread count and
ISA build (the scalar fmaf path vs this machine's vector path); the lane order, the tree
and the FMA are each shown to decide bits (so those checks are not vacuous), and a naive
torch fp32 matmul is shown to depend on M. Accuracy against fp64 within a tolerance."""
import itertools

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


@pytest.mark.parametrize("dot", [native.dot32_matmul, native.dot32p_matmul])
def test_accuracy_against_fp64(dot):
    for m, k, n in [(1, 1, 1), (3, 5, 7), (32, 256, 512), (17, 130, 33), (2, 4099, 3)]:
        a, b = _x(m, k, seed=1), _x(k, n, seed=2)
        exact = a.double() @ b.double()
        bound = 2 * k * 2.0 ** -24 * (a.double().abs() @ b.double().abs()) + 1e-30
        assert ((dot(a, b).double() - exact).abs() <= bound).all()


@pytest.mark.parametrize("dot, dtype, k", [(native.dot32_matmul, torch.float32, 300),
                                            (native.dot32p_matmul, torch.bfloat16, 300),
                                            (native.dot32p_matmul, torch.bfloat16, 320)])  # rows read in place
def test_same_bits_for_any_batch_rows_layout_threads(dot, dtype, k):
    a, w = _x(40, k, seed=3, dtype=dtype), _x(70, k, seed=4)
    ref = dot(a, w.t())
    assert torch.equal(dot(a, w.t().contiguous()), ref)      # B contiguous in n
    assert torch.equal(dot(a.t().contiguous().t(), w.t()), ref)    # A strided in k
    for m in (1, 2, 3, 7, 33):
        assert torch.equal(dot(a[5:5 + m], w.t()), ref[5:5 + m])
    perm = torch.randperm(40, generator=torch.Generator().manual_seed(5))
    assert torch.equal(dot(a[perm], w.t()), ref[perm])
    mixed = torch.cat([a[:9], _x(11, k, seed=6, dtype=dtype)])    # another batch around row 0..8
    assert torch.equal(dot(mixed, w.t())[:9], ref[:9])
    assert torch.equal(dot(a.expand(2, -1, -1), w.t())[1], ref)
    old = torch.get_num_threads()
    try:
        outs = []
        for t in (1, 2):
            torch.set_num_threads(t)
            outs.append(dot(a, w.t()))
    finally:
        torch.set_num_threads(old)
    assert torch.equal(outs[0], ref) and torch.equal(outs[1], ref)


def test_naive_fp32_matmul_depends_on_m():
    a, w = _x(64, 4096, seed=7, dtype=torch.float32), _x(64, 4096, seed=8, dtype=torch.float32)
    full = a @ w.t()
    assert any(not torch.equal(a[:m] @ w.t(), full[:m]) for m in (1, 2, 3, 5))


def test_scalar_build_gives_the_same_bits(tmp_path, monkeypatch):
    """The portable build (no -march=native: no FMA or AVX, scalar fmaf; no VDPBF16PS, its C
    emulation) against this machine's: the order is the contract's, not the ISA's. In both
    realisations (bf16: tiny and denormal operands too, where DAZ/FTZ decide)."""
    a, w = _x(9, 333, seed=9), _x(13, 333, seed=10)
    tiny = (_x(9, 64, seed=22) * 2.0 ** -63).bfloat16()      # products near and below 2^-126
    tiny[0, :8] = torch.tensor([2.0 ** -130, -(2.0 ** -128), 2.0 ** -133, 1.0, 2.0 ** -127, 3.0, -(2.0 ** -131), 2.0 ** 60])
    q, k, v = _x(1, 2, 70, 32, seed=11), _x(80, 1, 32, seed=12), _x(80, 1, 32, seed=13)
    def run():
        out = []
        for name in ("fp32", "bf16"):
            monkeypatch.setenv(contract.CPU_ACCUMULATION_ENV, name)
            token = torch.arange(128)[None, :].clamp(max=79) * 32
            out.append(native.attend(q, k, v, token, 0, 1, torch.tensor([list(range(70))]), torch.tensor([80]), 0.17, 64))
        return (native.dot32_matmul(a, w.t()), native.dot32p_matmul(a, w.t()), native.dot32p_matmul(tiny, tiny.t()),
                native.rms_norm(a, w[0, :333], 1e-6), native.silu_mul(a * 40, w[:9]),
                native.log_softmax(a.float() * 8, torch.tensor([0.7]), 330), *out)
    fast = run()
    monkeypatch.setattr(native, "CFLAGS", [f for f in native.CFLAGS if f != "-march=native"])
    monkeypatch.setenv("CONSISTENT_OPS_CACHE", str(tmp_path))
    monkeypatch.setattr(native, "_lib", None)
    assert all(torch.equal(x, y) for x, y in zip(run(), fast))
    assert native.build_isa() == "scalar"


def test_build_isa_names_the_vector_paths_this_cpu_has():
    """The machine's build (-march=native) takes the widest path its cpuinfo lists: what the
    plugin's log line and the benches report (an emulated build on a VDPBF16PS CPU would be slow)."""
    flags, isa = native._flag_set(native._cpu_flags()), native.build_isa()
    assert ("vdpbf16ps" in isa) == ("avx512_bf16" in flags)
    assert isa.startswith("avx512") == ("avx512f" in flags)
    assert (isa == "scalar") == (not {"avx2", "fma"} <= flags and "avx512f" not in flags)


def test_native_silu_mul_equals_the_torch_steps():
    """The native SiLU*mul (exp by the attention's polynomial) against the torch steps (torch.exp
    in fp64): equal for EVERY bf16 gate value (so bf16 models get the bits they had), and on 4M fp32
    values over [-150, 150]; the trainer's autograd forward is the native one too."""
    from consistent_ops.reference import pointwise
    g = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).reshape(256, 256)
    for gate, up in ((g, torch.ones_like(g)), (g, g.flip(0)), (_x(4000, 1000, seed=30, dtype=torch.float32) * 50,
                                                             _x(4000, 1000, seed=31, dtype=torch.float32))):
        got, want = native.silu_mul(gate, up), pointwise._silu_mul_torch(gate, up)
        assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got[~got.isnan()], want[~want.isnan()])
    gate = _x(5, 64, seed=32).requires_grad_()
    trained = co.silu_mul(gate, gate.flip(0))
    assert torch.equal(trained, native.silu_mul(gate.detach(), gate.detach().flip(0)))
    assert torch.equal(torch.autograd.grad(trained.float().sum(), gate)[0],
                       torch.autograd.grad(pointwise._silu_mul_torch(gate, gate.flip(0)).float().sum(), gate)[0])


def test_realisation_is_in_the_fingerprint_and_bits_differ(monkeypatch):
    a, w = _x(8, 512, seed=14), _x(16, 512, seed=15)
    seen = {}
    for name in ("fp32", "fp64", "bf16"):
        monkeypatch.setenv(contract.CPU_ACCUMULATION_ENV, name)
        seen[name] = (co.contract_fingerprint(), co.linear(a, w, out_dtype=torch.float32))
    for x, y in (("fp32", "fp64"), ("bf16", "fp32"), ("bf16", "fp64")):
        assert seen[x][0] != seen[y][0]
        assert not torch.equal(seen[x][1], seen[y][1])


def test_default_follows_the_cpu(monkeypatch):
    monkeypatch.delenv(contract.CPU_ACCUMULATION_ENV, raising=False)
    monkeypatch.setattr(native, "_cpu_flags", lambda: "flags : fpu avx2 avx512f avx512_bf16")
    assert native.accumulation() == "bf16"
    monkeypatch.setattr(native, "_cpu_flags", lambda: "flags : fpu avx2 fma")
    assert native.accumulation() == "fp32"


def test_pair_order_ftz_and_daz_decide_bits():
    """The bf16 realisation's dot is ONE fp32 chain over the pairs (k, k+1) = (2j, 2j+1), j ascending,
    each pair adding its odd product first. Pairs in order: 2^30 (k = 1), -2^30 (k = 3), then 1 (k = 2)
    give 1, where 16 lanes of pairs (k = 0, 1 in lane 0, k = 2, 3 in lane 1) gave 0, and so would
    the pairs taken in descending order. In a pair the odd product first: 1, then 2^24 (k = 3; 1 + 2^24
    rounds to 2^24), then -2^24 (k = 2) give 0; even first, 1 - 2^24 is exact and the result 1. A
    product below 2^-126 is flushed (the fp32 FMA realisation keeps it), and so is a denormal bf16
    operand; an odd K's pad pair (+0, added first) leaves a flushed -0 as it is."""
    def pair_dot(xa, xb, ks=(1, 32, 33, 0), k=64):
        a, b = torch.zeros(1, k, dtype=torch.bfloat16), torch.zeros(k, 1, dtype=torch.bfloat16)
        for i, x, y in zip(ks, xa, xb):
            a[0, i], b[i, 0] = x, y
        return native.dot32p_matmul(a, b).item(), native.dot32_matmul(a, b).item()
    assert pair_dot([2.0 ** 30, -(2.0 ** 30), 1.0], [1.0] * 3, ks=(1, 3, 2))[0] == 1.0
    assert pair_dot([2.0 ** 30, 1.0, -(2.0 ** 30)], [1.0] * 3, ks=(1, 0, 3))[0] == 0.0     # 1 absorbed
    assert pair_dot([1.0, 2.0 ** 24, -(2.0 ** 24)], [1.0] * 3, ks=(1, 3, 2))[0] == 0.0
    assert pair_dot([1.0, -(2.0 ** 24), 2.0 ** 24], [1.0] * 3, ks=(1, 3, 2))[0] == 1.0
    # far apart in k, still one chain: 2^30 (k = 1), -2^30 (k = 33), then 1 (k = 32): 1
    assert pair_dot([2.0 ** 30, 1.0, -(2.0 ** 30)], [1.0] * 3)[0] == 1.0
    assert pair_dot([2.0 ** 30, -(2.0 ** 30), 1.0], [1.0] * 3)[0] == 0.0
    assert pair_dot([2.0 ** -70], [2.0 ** -70]) == (0.0, 2.0 ** -140)
    assert pair_dot([2.0 ** -130], [2.0 ** 10]) == (0.0, 2.0 ** -120)
    neg = pair_dot([-(2.0 ** -70)], [2.0 ** -70], ks=(0,), k=1)[0]
    assert neg == 0.0 and str(neg) == "-0.0"                                  # K = 1: pad first, then -0
    # K = 3: -0 after pair 0, the pad's +0 makes it +0, and -0 * 1 (k = 2) keeps +0 (unpadded: -0)
    assert str(pair_dot([-(2.0 ** -70), -0.0], [2.0 ** -70, 1.0], ks=(0, 2), k=3)[0]) == "0.0"


@pytest.mark.parametrize("name", ["fp32", "fp64", "bf16"])
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


@pytest.mark.parametrize("name", ["fp32", "bf16"])
def test_native_log_softmax_is_the_trainers_and_differs_from_the_torch_steps(name, monkeypatch):
    """The contract's CPU log-probs (dot32.c log_softmax32, contract CPU_ACCUMULATION "logprobs"): the
    trainer's autograd forward == the rollout's, a row alone == in its batch, per-row and shared
    temperatures, padded columns -inf, a row with a NaN logit NaN (as torch's steps); within 1e-5 of
    fp64; gradients those of the torch steps. Companion: the torch steps (torch's fp64 exp and sum)
    differ from it in some last bits."""
    from consistent_ops.reference import logprobs
    monkeypatch.setenv(contract.CPU_ACCUMULATION_ENV, name)
    z = _x(64, 1000, seed=30, dtype=torch.float32) * 6
    t = torch.rand(64, generator=torch.Generator().manual_seed(31)) + 0.5
    z[5, 17] = float("nan")
    with torch.no_grad():
        rollout = co.log_softmax(z, t, 990)
        shared = co.log_softmax(z, 0.7, 990)
    leaf = z.clone().requires_grad_()
    trainer = co.log_softmax(leaf, t, 990)
    ok = torch.arange(64) != 5                                        # (NaN != NaN: row 5 checked apart)
    assert torch.equal(trainer.detach()[ok], rollout[ok]) and trainer[5].isnan().all()
    assert all(torch.equal(co.log_softmax(z[i:i + 1], t[i:i + 1], 990)[0], rollout[i]) for i in (0, 4, 63))
    assert torch.equal(co.log_softmax(z[3:4], 0.7, 990)[0], shared[3])
    assert rollout[ok, 990:].eq(float("-inf")).all() and rollout[5].isnan().all() and not rollout[4].isnan().any()
    ref = torch.log_softmax(z[ok, :990].double() / t[ok, None].double(), -1)
    assert (rollout[ok, :990].double() - ref).abs().max() < 1e-5
    (trainer[ok, :990] * torch.linspace(-1, 1, 990)).sum().backward()
    torch_leaf = z.clone().requires_grad_()
    (logprobs._log_softmax_torch(torch_leaf, t[:, None], 990)[ok, :990] * torch.linspace(-1, 1, 990)).sum().backward()
    assert torch.equal(leaf.grad[ok], torch_leaf.grad[ok])
    steps = logprobs._log_softmax_torch(z, t[:, None], 990)
    assert not torch.equal(steps[ok], rollout[ok]) and (steps[ok] - rollout[ok]).nan_to_num().abs().max() < 1e-5


def test_threads_split_whole_outputs():
    """dot32.c runs large contractions, attention and the MoE experts on OpenMP's threads (torch's
    count): each output computed whole by one thread, so 1, 2 or 3 threads give the same bits."""
    a32, w32 = _x(64, 512, seed=9, dtype=torch.float32), _x(300, 512, seed=10, dtype=torch.float32)
    a16, w16 = a32.bfloat16(), w32.bfloat16()
    q, k, v = (_x(600, h, 64, seed=s) for h, s in ((4, 11), (2, 12), (2, 13)))
    cu = torch.tensor([0, 250, 600])
    x, ids = _x(128, 256, seed=14), torch.randint(0, 8, (128, 2), generator=torch.Generator().manual_seed(15))
    stack = co.ExpertStack(0.1 * _x(8, 256, 256, seed=16), 0.1 * _x(8, 256, 128, seed=17), list(range(8)))
    weights = torch.rand(128, 2, generator=torch.Generator().manual_seed(18))

    def run():
        with torch.inference_mode():
            return [native.dot32_matmul(a32, w32.t()), native.dot32p_matmul(a16, w16.t()),
                    co.attention_varlen(q, k, v, cu), co.moe_expert_contributions(x, ids, weights, stack)[0],
                    co.log_softmax(a32 * 8, weights[:64, 0] + 0.5, 500)]
    old = torch.get_num_threads()
    try:
        outs = []
        for t in (1, 2, 3):
            torch.set_num_threads(t)
            outs.append(run())
    finally:
        torch.set_num_threads(old)
    assert all(torch.equal(r, o) for out in outs[1:] for r, o in zip(outs[0], out))


@pytest.mark.parametrize("name", ["fp32", "bf16"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_calls_equal_the_ops(name, dtype, monkeypatch):
    """co.attention_prologue (q/k/v projections, per-head q/k RMSNorm, RoPE), co.linear_add_rms_norm
    (o_proj, residual add, RMSNorm) and co.mlp (gate/up, SiLU*mul, down), each one native call, give
    the bits of linear, rms_norm, apply_rope, add_rms_norm and silu_mul run one by one, at decode and
    prefill row counts (300: the fused calls take rows in chunks of at most 128, one thread's each when
    there are several: 1, 2 and 3 threads cut 300 rows differently)."""
    monkeypatch.setenv(contract.CPU_ACCUMULATION_ENV, name)
    wq, wk, wv = (_x(n, 256, seed=s, dtype=dtype) / 8 for n, s in ((256, 30), (128, 31), (128, 32)))
    nq, nk, nw = (1 + _x(n, seed=s, dtype=dtype) / 4 for n, s in ((64, 33), (64, 34), (256, 36)))
    wg, wu, wd = (_x(*shape, seed=s, dtype=dtype) / 8 for shape, s in (((200, 256), 38), ((200, 256), 39),
                                                                       ((256, 200), 40)))
    old = torch.get_num_threads()
    for threads, t in itertools.product((1, 2, 3), (1, 37, 300)):
        torch.set_num_threads(threads)
        x, res = _x(t, 256, seed=35, dtype=dtype), _x(t, 256, seed=37, dtype=dtype)
        cos, sin = co.rope_cos_sin(torch.arange(t) * 7, 64, 1e6)
        try:
            with torch.inference_mode():
                fused = (*co.attention_prologue(x, wq, wk, wv, nq, nk, 1e-6, cos, sin, 64),
                         *co.linear_add_rms_norm(x, wq, res, nw, 1e-6), co.mlp(x, wg, wu, wd))
                q, k = (co.apply_rope(co.rms_norm(co.linear(x, w).view(t, -1, 64), n, 1e-6), cos, sin)
                        for w, n in ((wq, nq), (wk, nk)))
                ops = (q, k, co.linear(x, wv).view(t, -1, 64), *co.add_rms_norm(co.linear(x, wq), res, nw, 1e-6),
                       co.linear(co.silu_mul(co.linear(x, wg), co.linear(x, wu)), wd))
        finally:
            torch.set_num_threads(old)
        assert len(fused) == len(ops) and all(torch.equal(f, o) for f, o in zip(fused, ops)), (threads, t)


@pytest.mark.parametrize("name", ["fp32", "bf16"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_attention_rows_together_equal_rows_alone(name, dtype, monkeypatch):
    """native.attend's p.v passes (4, 2 or 1 rows sharing each V load; V widened once for many rows,
    read in place for few; a pass reading only the keys its rows see): each of 1..9 rows gets the bits
    it gets alone, at positions in and past blocks of 64 and in a tail block of 22 keys."""
    monkeypatch.setenv(contract.CPU_ACCUMULATION_ENV, name)
    L, H, D = 150, 2, 64
    k, v = _x(L, H, D, seed=31, dtype=dtype), _x(L, H, D, seed=32, dtype=dtype)
    token = (torch.arange(L) * H * D)[None]
    pos = torch.tensor([70, 3, 149, 64, 0, 127, 16, 131, 63])
    q = _x(1, H, len(pos), D, seed=33, dtype=dtype)
    def attend(rows):
        return native.attend(q[:, :, rows], k, v, token, D, 1, pos[rows][None], torch.tensor([L]), 0.125, 128)
    alone = torch.cat([attend([r]) for r in range(len(pos))], 2)
    for n in range(1, len(pos) + 1):
        assert torch.equal(attend(list(range(n))), alone[:, :, :n])


@pytest.mark.parametrize("name", ["fp64", "fp32", "bf16"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_attention_heads_in_place_equal_the_permuted_rows(name, dtype, monkeypatch):
    """native.attend_heads reads q [S, T, Hq, D] where it lies (here: a strided view into a fused qkv
    buffer) and writes [S, T, Hq, D] in q's dtype: bitwise the rows native.attend returns for q's rows
    permuted to [S, Hkv, G * T, D], permuted back and cast (.to), for prefill (T = 70) and decode (T = 1)
    rows. Companion: another scale changes the rows (the comparison reads real results)."""
    from consistent_ops.reference import attention as ref
    monkeypatch.setenv(contract.CPU_ACCUMULATION_ENV, name)
    L, hkv, hq, D = 192, 2, 4, 64                                  # keys: whole blocks of 64 (attend's walk)
    k, v = _x(L, hkv, D, seed=41, dtype=dtype), _x(L, hkv, D, seed=42, dtype=dtype)
    token = (torch.arange(L) * hkv * D)[None].expand(2, -1)
    for t, pos0 in ((70, 10), (1, 149)):
        qkv = _x(2, t, hq + 2 * hkv, D, seed=43, dtype=dtype)
        q = qkv[:, :, :hq]                                         # not contiguous
        qpos = (pos0 + torch.arange(t))[None].expand(2, -1).repeat(1, hq // hkv)
        args = (k, v, token, D, 1, qpos, torch.tensor([150, 150]))
        heads = native.attend_heads(q, hkv, *args, 0.125, 128)
        rows = ref._unrows(native.attend(ref._rows(q, hkv), *args, 0.125, 128), q)
        assert heads.dtype == dtype and heads.shape == q.shape and torch.equal(heads, rows)
        assert not torch.equal(native.attend_heads(q, hkv, *args, 0.25, 128), heads)
