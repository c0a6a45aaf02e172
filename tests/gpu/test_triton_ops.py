"""Triton linear, RMSNorm, log-probs and MoE on the GPU: each invariance is one exact
comparison (slice-of-batch == batch-of-slice, TP=k emulation == partials in rank
order, EP split == whole), with accuracy against float64 and, for the linear family,
the stock cuBLAS path shown NOT to have the property."""
import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("triton")

import torch.nn.functional as F  # noqa: E402

import consistent_ops as co  # noqa: E402
import consistent_ops.reference as ref  # noqa: E402

co.set_backend("triton")
DEV, BF16 = "cuda", torch.bfloat16
H, VOCAB = 2048, 151936
E, TOPK, INTER = 128, 8, 768
SHAPES = {"qkv": (2048, 5120), "o_proj": (4096, 2048), "router": (2048, 128), "lm_head": (2048, 151936)}   # (K, N)
MS = [1, 7, 16, 100, 255, 256, 257, 1024, 4096]


def rand(*shape, seed, scale=1.0, dtype=BF16):
    g = torch.Generator(device=DEV).manual_seed(seed)
    return (torch.randn(*shape, generator=g, device=DEV) * scale).to(dtype)


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


# ---------------------------------------------------------------- linear
@pytest.mark.parametrize("shape", list(SHAPES))
def test_linear_row_independent_of_m(shape):
    k, n = SHAPES[shape]
    x, w = rand(4096, k, seed=1), rand(n, k, seed=2, scale=k ** -0.5)
    full = co.linear(x, w)
    for m in MS:          # crosses the small/large tile switch at M = 256
        assert torch.equal(co.linear(x[:m], w), full[:m]), f"M={m}"
    for i in (0, 77, 4095):
        assert torch.equal(co.linear(x[i:i + 1], w), full[i:i + 1])


def test_stock_cublas_rows_depend_on_m():
    """Non-vacuous: cuBLAS gives a row different bits depending on M (o_proj shape)."""
    k, n = SHAPES["o_proj"]
    x, w = rand(4096, k, seed=3), rand(n, k, seed=4, scale=k ** -0.5)
    full = F.linear(x, w)
    assert any(not torch.equal(F.linear(x[:m], w), full[:m]) for m in MS[:-1])


def test_linear_accuracy_vs_float64():
    x, w, b = rand(1024, 4096, seed=5), rand(2048, 4096, seed=6, scale=1 / 64), rand(2048, seed=7)
    exact = x.double() @ w.double().t()
    assert rel(co.linear(x, w, b), exact + b.double()) < 1e-2           # one bf16 rounding
    assert rel(co.linear(x, w, out_dtype=torch.float32), exact) < 1e-5    # fp32 accumulator
    assert rel(co.row_parallel_partial(x, w), exact) < 1e-5


@pytest.mark.parametrize("tp", [2, 4])
def test_tp_emulation_is_partials_in_rank_order(tp):
    x, w = rand(300, 4096, seed=8), rand(2048, 4096, seed=9, scale=1 / 64)
    shard = 4096 // tp
    parts = [co.row_parallel_partial(x[:, r * shard:(r + 1) * shard], w[:, r * shard:(r + 1) * shard])
             for r in range(tp)]
    total = parts[0]
    for p in parts[1:]:
        total = total + p
    assert torch.equal(co.row_parallel_linear(x, w, tp), total.to(BF16))
    assert torch.equal(co.row_parallel_linear(x, w, 1), co.linear(x, w))   # TP=1 == plain linear
    assert torch.equal(co.row_parallel_linear(x[:1], w, tp), co.row_parallel_linear(x, w, tp)[:1])


# ---------------------------------------------------------------- RMSNorm
@pytest.mark.parametrize("h", [128, 2048])
def test_rms_norm_rows_and_accuracy(h):
    x, r, w = rand(4096, h, seed=10), rand(4096, h, seed=11), rand(h, seed=12)
    full = co.rms_norm(x, w, 1e-6)
    for m in (1, 100, 4095):
        assert torch.equal(co.rms_norm(x[:m], w, 1e-6), full[:m])
    y, res = co.add_rms_norm(x, r, w, 1e-6)
    assert torch.equal(res, x + r)                          # bf16 add, as torch does it
    assert torch.equal(y, co.rms_norm(res, w, 1e-6))
    assert rel(full, ref.rms_norm(x, w, 1e-6)) < 1e-2
    x64 = x.double()
    exact = x64 / (x64.square().mean(-1, keepdim=True) + 1e-6).sqrt() * w.double()
    assert rel(full, exact) < 1e-2


# ---------------------------------------------------------------- log-probs
@pytest.fixture(scope="module")
def logits():
    return rand(1024, VOCAB, seed=13, scale=3.0, dtype=torch.float32)


def test_logprobs_rows_temperature_vocab(logits):
    temp = torch.rand(1024, device=DEV) + 0.5
    limit = VOCAB - 269
    full = co.log_softmax(logits, temp, limit)
    for m in (1, 33, 1023):
        assert torch.equal(co.log_softmax(logits[:m], temp[:m], limit), full[:m])
    assert torch.isneginf(full[:, limit:]).all()
    ids = torch.randint(0, limit, (1024,), device=DEV)
    assert torch.equal(co.token_logprobs(logits, ids, temp, limit), full.gather(1, ids[:, None])[:, 0])
    assert torch.equal(co.log_softmax(logits, 0.7), co.log_softmax(logits, torch.full((1024,), 0.7, device=DEV)))
    z = logits[:, :limit].double() / temp.double()[:, None]
    assert (full[:, :limit].double() - torch.log_softmax(z, -1)).abs().max() < 1e-4


def test_logprob_gradients_vs_float64(logits):
    ids = torch.randint(0, VOCAB, (256,), device=DEV)
    x = logits[:256].clone().requires_grad_()
    co.token_logprobs(x, ids, 0.8).sum().backward()
    x64 = logits[:256].double().requires_grad_()
    torch.log_softmax(x64 / 0.8, -1).gather(1, ids[:, None]).sum().backward()
    assert rel(x.grad, x64.grad) < 1e-5


def test_truncation_rollout_call_equals_trainer_call(logits):
    """The rollout's call (log_softmax at T with per-row truncation) == the trainer's (logits
    divided by T first, token_logprobs at T = 1 with the same truncation), bitwise, for rows
    alone and in the batch; the kept set is the reference rule's (same log-probs in)."""
    rows, limit = 256, VOCAB - 269
    temp = torch.full((rows,), 0.7, device=DEV)
    k = torch.randint(0, 40, (rows,), device=DEV)
    p = (torch.rand(rows, device=DEV, dtype=torch.float64) * 0.5 + 0.5)
    mp = torch.where(torch.arange(rows, device=DEV) % 3 == 0, 0.05, 0.0).float()
    cut = (k, p, mp)
    rollout = co.log_softmax(logits[:rows], temp, limit, cut)
    ids = torch.where(rollout > float("-inf"), rollout, -1e30).argmax(-1)
    trainer = co.token_logprobs(logits[:rows] / temp[:, None], ids, 1.0, limit, cut)
    assert torch.equal(trainer, rollout.gather(1, ids[:, None])[:, 0])
    for m in (1, 17, 255):
        assert torch.equal(co.log_softmax(logits[:m], temp[:m], limit, (k[:m], p[:m], mp[:m])), rollout[:m])
    lp = co.log_softmax(logits[:rows], temp, limit)
    assert torch.equal(co.get_backend().truncation.keep_mask(lp, *cut), ref.truncation.keep_mask(lp, *cut))


# ---------------------------------------------------------------- MoE
@pytest.fixture(scope="module")
def moe():
    experts = {e: (rand(INTER, H, seed=100 + e, scale=H ** -0.5), rand(INTER, H, seed=300 + e, scale=H ** -0.5),
                   rand(H, INTER, seed=500 + e, scale=INTER ** -0.5)) for e in range(E)}
    return rand(2048, H, seed=14), rand(E, H, seed=15, scale=H ** -0.5), experts


def test_moe_rows_independent_of_batch_and_placement(moe):
    x, gate, experts = moe
    ids, w = co.moe_route(x, gate, TOPK)
    contrib, owned = co.moe_expert_contributions(x, ids, w, experts)
    assert owned.all()
    for lo, hi in ((0, 1), (5, 9), (1000, 1300)):       # decode-sized and chunk-sized groups
        i2, w2 = co.moe_route(x[lo:hi], gate, TOPK)
        assert torch.equal(i2, ids[lo:hi]) and torch.equal(w2, w[lo:hi])
        assert torch.equal(co.moe_expert_contributions(x[lo:hi], i2, w2, experts)[0], contrib[lo:hi])
    halves = [co.moe_expert_contributions(x, ids, w, experts, range(r * 64, (r + 1) * 64)) for r in (0, 1)]
    merged = torch.where(halves[0][1][..., None], halves[0][0], halves[1][0])   # EP=2 emulation
    assert torch.equal(merged, contrib)
    small = [co.moe_expert_contributions(x[:64], ids[:64], w[:64], experts, range(r * 64, (r + 1) * 64))
             for r in (0, 1)]                  # decode size: the one-kernel plan, EP=2
    assert torch.equal(torch.where(small[0][1][..., None], small[0][0], small[1][0]), contrib[:64])
    out = co.moe_combine(contrib, BF16)
    total = contrib[:, 0]
    for j in range(1, TOPK):
        total = total + contrib[:, j]
    assert torch.equal(out, total.to(BF16))


def test_moe_accuracy_and_gradients_vs_reference(moe):
    """Against the reference backend (fp64 accumulation) on the same routing."""
    x0, gate, experts = moe
    x0 = x0[:256]
    ids, w = co.moe_route(x0, gate, TOPK)
    ids_r, w_r = ref.moe_route(x0, gate, TOPK)
    assert (ids == ids_r).float().mean() > 0.99 and rel(w, w_r) < 1e-4
    results = []
    for backend in (co.get_backend(), ref):
        x = x0.clone().requires_grad_()
        ex = {e: tuple(t.clone().requires_grad_() for t in ws) for e, ws in experts.items()}
        contrib, _ = backend.moe_expert_contributions(x, ids, w, ex)
        (contrib * torch.linspace(-1, 1, H, device=DEV)).sum().backward()
        results.append((contrib, x.grad, ex[int(ids[0, 0])][2].grad))
    for mine, exact in zip(*results):
        assert rel(mine, exact) < 2e-2


# ---------------------------------------------------------------- tile switch points (added checks)
@pytest.mark.parametrize("shape", list(SHAPES))
def test_linear_rows_across_every_tile_entry(shape):
    """Each M bucket / program-count switch of gemm._config, and every tile entry forced
    on the same rows, give the rows of M=4096 bit for bit."""
    from consistent_ops.triton import gemm
    k, n = SHAPES[shape]
    x, w = rand(4096, k, seed=21), rand(n, k, seed=22, scale=k ** -0.5)
    full = co.linear(x, w)
    for m in (1, 4, 15, 16, 17, 64, 65, 128, 129, 256, 257, 512, 513, 2048):
        assert torch.equal(co.linear(x[:m], w), full[:m]), f"M={m}"
    entries = [*gemm._TINY.values(), *gemm._NARROW.values(), gemm._MID_NARROW, gemm._MID_WIDE, gemm._MID_SQUARE,
               gemm._MID_TALL, gemm._LARGE, gemm._HUGE, gemm._PINNED]
    for cfg in entries:
        assert torch.equal(gemm.matmul(x[:300], w, cfg=cfg), full[:300]), cfg


@pytest.mark.parametrize("shape", list(SHAPES))
def test_k_chunks_over_programs_equal_the_chunks_in_one_program(shape):
    """The probe's fixed split of K (matmul's chunk=, not the contract): one program a chunk with the
    tile's last arrival adding them == the chunks in one program, bit for bit, eagerly and over
    20 replays of a captured graph, at the decode tail's M and past one tile; every counter back at 0.
    Rows of M=1 == rows of M=300 with chunks in one program (the chunked linear is batch-invariant too)."""
    from consistent_ops.triton import common, gemm
    k, n = SHAPES[shape]
    x, w = rand(300, k, seed=24), rand(n, k, seed=25, scale=k ** -0.5)
    for c in (512, 1024):
        full = gemm.matmul(x, w, chunk=(c, 1))
        for m in (1, 4, 16, 64):
            split = (c, -(-k // c))
            assert torch.equal(gemm.matmul(x[:m], w, chunk=(c, 1)), full[:m]), (c, m)
            assert torch.equal(gemm.matmul(x[:m], w, chunk=split), full[:m]), (c, m)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                y = gemm.matmul(x[:m], w, chunk=split)
            for _ in range(20):
                g.replay()
                assert torch.equal(y, full[:m]), (c, m)
    torch.cuda.synchronize()
    assert all(not b.any() for bufs in common.COUNTERS.values() for b in bufs)


def test_moe_rows_across_tile_configs(moe):
    """Batches of 1..8192 tokens and both tile sets (the GPU's and the interpreter's) forced: same bits."""
    from consistent_ops.triton import moe as tmoe
    _, gate, experts = moe
    x = rand(8192, H, seed=23)
    ids, w = co.moe_route(x, gate, TOPK)
    full, _ = co.moe_expert_contributions(x, ids, w, experts)
    # decode tile <= 256 tokens, mid <= 1024
    for lo, hi in ((0, 1), (0, 64), (0, 256), (0, 257), (0, 1024), (0, 1025), (0, 2048), (100, 5100), (8000, 8192)):
        assert torch.equal(co.moe_expert_contributions(x[lo:hi], ids[lo:hi], w[lo:hi], experts)[0], full[lo:hi])
    gate_up = torch.stack([torch.cat(experts[e][:2]) for e in range(E)])
    wd = torch.stack([experts[e][2] for e in range(E)])
    stack = co.ExpertStack(gate_up, wd, range(E))       # the model's stacked layout: same bits
    assert torch.equal(co.moe_expert_contributions(x[:300], ids[:300], w[:300], stack)[0], full[:300])
    for cfg in (tmoe._TILES, tmoe._DECODE, tmoe._MID, tmoe._INTERP, (64, tmoe._opts(64, 64, 4, 4), tmoe._opts(128, 64, 4, 3))):
        got = tmoe._grouped_kernel(x[:3000], w[:3000], gate_up, wd, ids=ids[:3000], local=list(range(E)), cfg=cfg)
        assert torch.equal(got[0], full[:3000]), cfg[0]


def test_moe_stacks_read_in_place_with_autograd(moe):
    """The model's stacks (gate_up [E, 2I, H], down): read in place, so an in-place update
    (a weight load) is seen at once; their gradients are the per-expert tensors' bit for bit."""
    x0, gate, experts = moe
    x0 = x0[:512]
    ids, w = co.moe_route(x0, gate, TOPK)
    gate_up = torch.stack([torch.cat(experts[e][:2]) for e in range(E)]).requires_grad_()
    down = torch.stack([experts[e][2] for e in range(E)]).requires_grad_()
    grads = []
    for ex in ({e: tuple(t.clone().requires_grad_() for t in ws) for e, ws in experts.items()},
               co.ExpertStack(gate_up, down, range(E))):
        x = x0.clone().requires_grad_()
        contrib, _ = co.moe_expert_contributions(x, ids, w, ex)
        (contrib * torch.linspace(-1, 1, H, device=DEV)).sum().backward()
        e = int(ids[0, 0])
        grads.append((x.grad, ex[e][0].grad if isinstance(ex, dict) else gate_up.grad[e, :INTER],
                      ex[e][2].grad if isinstance(ex, dict) else down.grad[e]))
    assert all(torch.equal(a, b) for a, b in zip(*grads))
    stack = co.ExpertStack(gate_up.detach(), down.detach(), range(E))
    with torch.inference_mode():
        before = co.moe_expert_contributions(x0[:64], ids[:64], w[:64], stack)[0]
    with torch.no_grad():
        gate_up[int(ids[0, 0])].mul_(2)
    with torch.inference_mode():
        after = co.moe_expert_contributions(x0[:64], ids[:64], w[:64], stack)[0]
    assert not torch.equal(before, after)


# ---------------------------------------------------------------- fused rollout kernels
def test_fused_router_rope_combine_equal_their_torch_forms(moe):
    """The rollout's one-kernel router (softmax + top-8 with ties to the lower id + renorm),
    RoPE and slot-ordered combine give the bits of the torch ops the trainer's autograd
    path runs, at Qwen3-30B-A3B shapes."""
    from consistent_ops.triton import moe as tmoe
    x, gate, _ = moe
    logits = co.linear(x, gate, out_dtype=torch.float32).contiguous()
    logits[7] = 0.25                                              # an all-tie row
    ids_t, w_t = tmoe._route_from_probs(tmoe._softmax_rows(logits), TOPK, True)   # the training path's ops
    ids, w = tmoe._route_fused(logits, TOPK, True)
    assert torch.equal(ids, ids_t) and torch.equal(w, w_t) and ids[7].tolist() == list(range(TOPK))
    q = rand(4096, 32, 128, seed=40)
    cos, sin = ref.rope_cos_sin(torch.arange(4096, device=DEV) * 3, 128, 1e6)
    assert torch.equal(co.apply_rope(q, cos, sin), ref.apply_rope(q, cos, sin))
    contrib = torch.randn(4096, TOPK, H, device=DEV)
    assert torch.equal(co.moe_combine(contrib, BF16), ref.moe_combine(contrib, BF16))


@pytest.mark.parametrize("t", [1, 2, 7, 64, 512, 4099])
def test_qk_norm_rope_equals_rms_norm_then_rope(t):
    """The rollout's q/k norms, RoPE and v's copy in one launch, read from the column blocks of one q/k/v
    GEMM output (Qwen3-30B-A3B heads): the bits of rms_norm then apply_rope, v copied; another eps or
    other positions give other bits."""
    hq, hkv, d = 32, 4, 128
    q, k, v = (p.view(t, -1, d) for p in rand(t, (hq + 2 * hkv) * d, seed=50 + t).split([hq * d, hkv * d, hkv * d], 1))
    wq, wk = ((1 + 0.1 * rand(d, seed=s, dtype=torch.float32)).to(BF16) for s in (51, 52))
    cos, sin = co.rope_cos_sin(torch.arange(t, device=DEV) * 3 + 11, d, 1e6)
    fused = co.qk_norm_rope(q, k, v, wq, wk, 1e-6, cos, sin)
    assert fused is not None and all(x.is_contiguous() for x in fused)
    separate = (co.apply_rope(co.rms_norm(q, wq, 1e-6), cos, sin), co.apply_rope(co.rms_norm(k, wk, 1e-6), cos, sin),
                v.contiguous())
    assert all(torch.equal(a, b) for a, b in zip(fused, separate))
    assert not torch.equal(co.qk_norm_rope(q, k, v, wq, wk, 1e-2, cos, sin)[1], fused[1])
    moved = co.rope_cos_sin(torch.arange(t, device=DEV) * 3 + 12, d, 1e6)
    assert not torch.equal(co.qk_norm_rope(q, k, v, wq, wk, 1e-6, *moved)[0], fused[0])


@pytest.mark.parametrize("t", [1, 7, 64])
def test_qk_norm_rope_stores_k_and_v_as_the_cache_write_does(t):
    """Given the paged cache (vLLM's split K/V views of one [2, pages, 16, Hkv, D] tensor) and slots
    (-1 on padded rows, the table longer than the batch), the one launch stores k and v there: the
    cache == qk_norm_rope's k and v through write_kv_cache, bit for bit, q the same; slots one place on
    store other bits."""
    hq, hkv, d, page = 32, 4, 128, 16
    q, k, v = (p.view(t, -1, d) for p in rand(t, (hq + 2 * hkv) * d, seed=60 + t).split([hq * d, hkv * d, hkv * d], 1))
    wq, wk = ((1 + 0.1 * rand(d, seed=s, dtype=torch.float32)).to(BF16) for s in (61, 62))
    cos, sin = co.rope_cos_sin(torch.arange(t, device=DEV) * 5 + 3, d, 1e6)
    slots = torch.randperm(8 * page, device=DEV)[:t + 3]
    slots[1::3] = -1

    def caches():
        both = torch.full((2, 8, page, hkv, d), float("nan"), dtype=BF16, device=DEV)
        return both[0], both[1]

    fq, fk, fv = co.qk_norm_rope(q, k, v, wq, wk, 1e-6, cos, sin)
    want, got, moved = caches(), caches(), caches()
    co.write_kv_cache(fk, fv, *want, slots)
    out = co.qk_norm_rope(q, k, v, wq, wk, 1e-6, cos, sin, cache=(*got, slots))
    assert torch.equal(out[0], fq) and out[1:] == (None, None)
    assert all(torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0)) for a, b in zip(got, want))
    co.qk_norm_rope(q, k, v, wq, wk, 1e-6, cos, sin, cache=(*moved, torch.where(slots >= 0, (slots + 1) % (8 * page), slots)))
    assert not torch.equal(moved[0].nan_to_num(7.0), want[0].nan_to_num(7.0))
