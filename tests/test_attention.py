"""Attention invariance: training (packed) == prefill == chunked prefill == decode ==
mixed batch, for any page size and page placement; bitwise. Plus accuracy and grads."""
import math

import pytest
import torch
import torch.nn.functional as F

import consistent_ops as co

HQ, HKV, D = 4, 2, 32


def qkv(lens, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = sum(lens)
    return [torch.randn(t, h, D, generator=g).to(dtype) for h in (HQ, HKV, HKV)]


def cu(lens):
    return torch.tensor([0] + list(lens)).cumsum(0)


def paged(q, k, v, lens, page_size, chunk, seed=0):
    """Feed every sequence in chunks of `chunk` new tokens per step (all sequences in
    the same step, so prefill and decode rows mix), through a shuffled paged cache."""
    pages_per_seq = [math.ceil(n / page_size) for n in lens]
    perm = torch.randperm(sum(pages_per_seq), generator=torch.Generator().manual_seed(seed))
    tables, at = [], 0
    for n in pages_per_seq:
        tables.append(perm[at:at + n]); at += n
    width = max(pages_per_seq)
    table = torch.stack([F.pad(t, (0, width - len(t))) for t in tables])
    kc = torch.full((len(perm), page_size, HKV, D), float("nan"), dtype=k.dtype)
    vc = kc.clone()
    out = torch.empty_like(q)
    starts = cu(lens)[:-1].tolist()
    for step in range(math.ceil(max(lens) / chunk)):
        rows, seq_ids, qlens, seq_lens, slots = [], [], [], [], []
        for i, (s, n) in enumerate(zip(starts, lens)):
            a, b = step * chunk, min((step + 1) * chunk, n)
            if a >= n:
                continue
            pos = torch.arange(a, b)
            rows.append(torch.arange(s + a, s + b)); seq_ids.append(i)
            qlens.append(b - a); seq_lens.append(b)
            slots.append(tables[i][pos // page_size] * page_size + pos % page_size)
        r = torch.cat(rows)
        co.write_kv_cache(k[r], v[r], kc, vc, torch.cat(slots))
        out[r] = co.attention_paged(q[r], kc, vc, table[seq_ids], torch.tensor(seq_lens), cu(qlens))
    return out


LENS = [150, 1, 64, 77, 200]


@pytest.fixture(params=[512, 64, 128])
def kv_chunk(request, monkeypatch):
    """The contract's KV chunk (512), and chunks these short sequences cross (every block a chunk,
    two blocks a chunk): the fold of chunk states runs in every path."""
    from consistent_ops.reference import attention
    monkeypatch.setattr(attention, "KV_CHUNK", request.param)
    return request.param


@pytest.mark.parametrize("page_size", [16, 32, 64])
@pytest.mark.parametrize("chunk", [1, 7, 64, 100, 1000])
def test_paged_equals_packed(page_size, chunk, kv_chunk):
    q, k, v = qkv(LENS)
    train = co.attention_varlen(q, k, v, cu(LENS))
    assert torch.equal(paged(q, k, v, LENS, page_size, chunk, seed=page_size), train)


def test_kv_chunks_fold_in_the_contract(monkeypatch):
    """A sequence within one chunk has the bits of one unchunked walk (chunk 0's state is the
    fold); a longer one is folded, and its bits depend on the chunk size: the rule is real (so
    both engines must share it: contract.KV_CHUNK is in the fingerprint)."""
    from consistent_ops import contract
    from consistent_ops.reference import attention
    q, k, v = qkv([300], seed=5)
    outs = {}
    for c in (64, 128, 320, 1 << 20):
        monkeypatch.setattr(attention, "KV_CHUNK", c)
        outs[c] = co.attention_varlen(q, k, v, cu([300]))
    assert torch.equal(outs[320], outs[1 << 20])
    assert torch.equal(outs[64][:64], outs[1 << 20][:64]) and torch.equal(outs[128][:128], outs[1 << 20][:128])
    assert not torch.equal(outs[64][64:], outs[1 << 20][64:]) and not torch.equal(outs[64][128:], outs[128][128:])
    assert '"kv_chunk": %d' % contract.KV_CHUNK in contract.contract_text("reference")


def test_alone_equals_in_mixed_batch(kv_chunk):
    q, k, v = qkv(LENS)
    batch = co.attention_varlen(q, k, v, cu(LENS))
    s = cu(LENS)
    for i, n in enumerate(LENS):
        sl = slice(s[i], s[i + 1])
        assert torch.equal(co.attention_varlen(q[sl], k[sl], v[sl], cu([n])), batch[sl])


def test_a_steps_index_work_follows_its_metadata():
    """attention_paged does its index work once a step (_PagedLayout.of: every layer passes the same
    metadata tensors): a call after the metadata changed in place, or with a cache of another layout,
    equals a call with fresh tensors of the same contents."""
    g = torch.Generator().manual_seed(5)
    kc, vc = (torch.randn(12, 16, HKV, D, generator=g).bfloat16() for _ in range(2))
    q = torch.randn(3, HQ, D, generator=g).bfloat16()
    table, seq_lens, qsl = torch.tensor([[3, 7, 1], [5, 0, 9], [2, 4, 6]]), torch.tensor([40, 17, 33]), cu([1, 1, 1])

    def fresh():
        return co.attention_paged(q, kc, vc, table.clone(), seq_lens.clone(), qsl.clone())

    def again():      # a call after one with these very tensors (a fresh() call replaces the layout)
        co.attention_paged(q, kc, vc, table, seq_lens, qsl)
        return lambda k=kc, v=vc: co.attention_paged(q, k, v, table, seq_lens, qsl)

    assert torch.equal(again()(), fresh())
    kh, vh = (c.transpose(1, 2).contiguous().transpose(1, 2) for c in (kc, vc))   # the same cache, head-major
    assert torch.equal(again()(kh, vh), fresh())
    for change in (lambda: seq_lens.sub_(9), lambda: table[:, :2].copy_(table[:, :2].flip(1)),
                   lambda: qsl.copy_(cu([2, 0, 1]))):   # (last: a request without rows)
        call = again()
        change()
        assert torch.equal(call(), fresh())


@pytest.mark.parametrize("qlens", [[1, 1, 1], [6, 6, 6], [6, 2, 5], [3, 0, 2]])
def test_paged_out_receives_the_result(qlens):
    """attention_paged(..., out=rows) fills rows of a larger buffer (vLLM's output) and returns them:
    bitwise the call without out, for decode, equal-length prefill (the native walk writes the rows
    in place), ragged and padded steps (copied); the buffer's other rows untouched. Companion:
    another scale changes the result (the comparison reads real rows)."""
    g = torch.Generator().manual_seed(6)
    kc, vc = (torch.randn(12, 16, HKV, D, generator=g).bfloat16() for _ in range(2))
    table, seq_lens = torch.tensor([[3, 7, 1], [5, 0, 9], [2, 4, 6]]), torch.tensor([40, 17, 33])
    t = sum(qlens) + (qlens == [3, 0, 2])            # the padded step: a row no request holds
    q = torch.randn(t, HQ, D, generator=g).bfloat16()
    want = co.attention_paged(q, kc, vc, table, seq_lens, cu(qlens))
    buf = torch.full((t + 2, HQ, D), float("nan"), dtype=torch.bfloat16)
    got = co.attention_paged(q, kc, vc, table, seq_lens, cu(qlens), out=buf[:t])
    assert got.data_ptr() == buf.data_ptr() and torch.equal(buf[:t], want) and buf[t:].isnan().all()
    assert not torch.equal(co.attention_paged(q, kc, vc, table, seq_lens, cu(qlens), scale=0.5), want)


def sdpa(q, k, v):
    """Stock path: PyTorch SDPA with GQA, causal over the last q rows."""
    qh, kh, vh = (t.transpose(0, 1) for t in (q, k, v))
    nq, nk = q.shape[0], k.shape[0]
    mask = torch.ones(nq, nk, dtype=torch.bool).tril(nk - nq)
    return F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, enable_gqa=True).transpose(0, 1)


def test_stock_prefill_and_decode_differ():
    """Companion: stock SDPA gives a token different bits in prefill and in decode."""
    q, k, v = qkv([300], seed=3)
    full = sdpa(q, k, v)
    decode = torch.cat([sdpa(q[t:t + 1], k[:t + 1], v[:t + 1]) for t in range(300)])
    assert (full.float() - decode.float()).abs().max() > 0


def reference64(q, k, v, lens):
    s = cu(lens)
    return torch.cat([sdpa(q[a:b].double(), k[a:b].double(), v[a:b].double())
                      for a, b in zip(s[:-1], s[1:])])


def test_accuracy_vs_float64(kv_chunk):
    q, k, v = qkv(LENS, dtype=torch.float32)
    out = co.attention_varlen(q, k, v, cu(LENS)).double()
    ref = reference64(q, k, v, LENS)
    assert ((out - ref).abs().max() / ref.abs().max()) < 1e-6


def test_gradients_vs_float64(kv_chunk):
    q, k, v = qkv([70, 130], dtype=torch.float32, seed=1)
    grads = []
    for dtype, fn in ((torch.float32, lambda *t: co.attention_varlen(*t, cu([70, 130]))),
                      (torch.float64, lambda *t: reference64(*t, [70, 130]))):
        ts = [t.detach().to(dtype).clone().requires_grad_() for t in (q, k, v)]
        (fn(*ts) * torch.linspace(-1, 1, D, dtype=dtype)).sum().backward()
        grads.append([t.grad.double() for t in ts])
    for ours, ref in zip(*grads):
        assert ((ours - ref).abs().max() / ref.abs().max()) < 1e-5


def test_torch_loop_equals_the_native_pass_in_fp64(monkeypatch, kv_chunk):
    """The block loop in torch ops (other devices, the CPU backward) and the native pass (dot64.c
    attend64) realise the same rule, KV chunks and their fold included: in the fp64 realisation
    (fp64 sums of fp32 terms, libm exp in both) they give the same bits."""
    from consistent_ops import contract
    from consistent_ops.reference import attention
    monkeypatch.setenv(contract.CPU_ACCUMULATION_ENV, "fp64")
    lens = [300, 77]
    q, k, v = qkv(lens, seed=6)
    width = 320
    padded = [attention._pad_rows(t, [0, lens[0]], lens, width) for t in (q, k, v)]
    qpos = torch.minimum(torch.arange(width)[None], torch.tensor(lens)[:, None] - 1)
    loop = attention._attend_torch(padded[0], qpos, attention._DenseKV(*padded[1:]), D ** -0.5)
    assert torch.equal(attention._unpad_rows(loop, lens), co.attention_varlen(q, k, v, cu(lens), D ** -0.5))
