"""Attention: one online-softmax loop over fixed KV blocks, two entry points.

``attention_varlen`` (packed training batches, prefill without cache) and
``attention_paged`` (any number of new tokens per sequence against a paged KV
cache) differ only in how K/V rows are addressed (a zero-padded per-sequence layout
vs the pages themselves, read in place through the block table); both run ``_attend``
(on CPU the native one-pass loop, elsewhere its torch ops), so a token gets the same
bits whether it was trained, prefilled, chunk-prefilled or decoded.
"""

import torch

from ..contract import KV_BLOCK, KV_CHUNK, attention_scale
from . import native
from .core import exp32, matmul32, recording, steps_backward, sum32

NEG_INF = float("-inf")


class _DenseKV:
    """K/V laid out per sequence from position 0, [S, L, Hkv, D]; V is zero past the end."""

    def __init__(self, k, v):
        self.k, self.v, self.hkv = k, v, k.shape[2]

    def scores(self, qh, width):
        """[S, Hkv, R, width]: every query row against keys 0 .. width-1."""
        return matmul32(qh, self.k[:, :width].permute(0, 2, 3, 1))

    def values(self, p):
        """p [S, Hkv, J, R, KV_BLOCK] -> [S, Hkv, J, R, D]: block j's p against block j's V."""
        S, hkv, J = p.shape[:3]
        return matmul32(p, self.v[:, :J * KV_BLOCK].transpose(1, 2).reshape(S, hkv, J, KV_BLOCK, -1))

    def addresses(self):
        """(K, V, token offsets [S, L], head stride, dim stride, seq_lens) for native.attend_heads."""
        k, v = self.k, self.v
        if k.stride() != v.stride():
            k, v = k.contiguous(), v.contiguous()
        S, L = k.shape[:2]
        token = torch.arange(S)[:, None] * k.stride(0) + torch.arange(L)[None, :] * k.stride(1)
        return k, v, token, k.stride(2), k.stride(3), torch.full((S,), L)


class _PagedKV:
    """K/V read in place from a paged CPU cache [pages, page_size, Hkv, D] through a step's
    _PagedLayout (nothing gathered). Positions past a sequence's end read as zero V."""

    def __init__(self, key_cache, value_cache, layout):
        if key_cache.stride() != value_cache.stride():
            raise ValueError("attention_paged: key and value caches must share one layout")
        self.k, self.v, self.hkv, self.layout = key_cache, value_cache, key_cache.shape[2], layout

    def addresses(self):
        return self.k, self.v, self.layout.token, self.k.stride(2), self.k.stride(3), self.layout.seq_lens


class _NativeAttention(torch.autograd.Function):
    """Forward: native.attend_heads (the contract loop in one pass, as in inference); backward:
    autograd through _attend_torch, the same rules written in torch ops."""

    @staticmethod
    def forward(ctx, q, k, v, qpos, scale):
        ctx.save_for_backward(q, k, v, qpos)
        ctx.scale = scale
        return _attend_native(q, qpos, _DenseKV(k, v), scale)

    @staticmethod
    def backward(ctx, grad):
        q, k, v, qpos = ctx.saved_tensors
        return steps_backward(lambda q, k, v: _attend_torch(q, qpos, _DenseKV(k, v), ctx.scale), (q, k, v),
                              ctx.needs_input_grad[:3], grad) + (None, None)


def _rows(q, hkv):
    """q [S, Tq, Hq, D] -> [S, Hkv, G*Tq, D]: the G query heads sharing a KV head stacked as rows."""
    S, Tq, Hq, D = q.shape
    return q.reshape(S, Tq, hkv, Hq // hkv, D).permute(0, 2, 3, 1, 4).reshape(S, hkv, Hq // hkv * Tq, D)


def _unrows(out, q):
    S, Tq, Hq, D = q.shape
    hkv = out.shape[1]
    return out.reshape(S, hkv, Hq // hkv, Tq, D).permute(0, 3, 1, 2, 4).reshape(S, Tq, Hq, D).to(q.dtype)


def _attend(q, qpos, kv, scale, out=None):
    """q [S, Tq, Hq, D], qpos [S, Tq] absolute positions (< seq_len); kv a _DenseKV or
    _PagedKV covering every block up to the last qpos. Returns [S, Tq, Hq, D] in q's dtype
    (in out when given: the native walk writes it in place, the other paths copy).
    On CPU every forward (trainer and rollout, with or without autograd) is native.attend_heads;
    elsewhere the torch ops of _attend_torch."""
    if not q.is_cpu or q.dtype not in native.DTYPES or kv.k.dtype not in native.DTYPES:
        return _into(out, _attend_torch(q, qpos, kv, scale))
    if recording(q, kv.k, kv.v):
        return _into(out, _NativeAttention.apply(q, kv.k, kv.v, qpos, scale))
    return _attend_native(q, qpos, kv, scale, out)


def _into(out, result):
    return result if out is None else out.copy_(result)


def _attend_native(q, qpos, kv, scale, out=None):
    """native.attend_heads: _rows' rows read where q holds them, the result written as _unrows makes it
    (into out when given)."""
    k, v, token, head_stride, dim_stride, seq_lens = kv.addresses()
    layout = getattr(kv, "layout", None)        # a paged step's: its rows' positions and offset range, made once
    rows_qpos = layout.rows_qpos if layout is not None else qpos.repeat(1, q.shape[2] // kv.hkv)
    return native.attend_heads(q, kv.hkv, k, v, token, head_stride, dim_stride, rows_qpos, seq_lens, scale,
                               KV_CHUNK, None if layout is None else layout.token_range, out)


def _attend_torch(q, qpos, kv, scale):
    """The contract's block loop in torch ops, with the work that does not carry state
    between blocks done for all blocks at once: scores (each its own dot product), the
    running max within each KV chunk (a cummax of block maxima is the loop's m), p and its
    row sums, and each block's p @ V; only the fp32 rescale-and-add runs block by block, and
    the chunk states' fold chunk by chunk, in order."""
    S, Tq, Hq, D = q.shape
    hkv = kv.hkv
    g, rows = Hq // hkv, Hq // hkv * Tq
    n_blocks = int(qpos.max()) // KV_BLOCK + 1
    per_chunk = KV_CHUNK // KV_BLOCK
    qh = _rows(q, hkv)
    kpos = torch.arange(n_blocks * KV_BLOCK, device=q.device)
    visible = kpos[None, None, :] <= qpos.repeat(1, g)[:, :, None]     # qpos < seq_len: in the sequence
    s = (kv.scores(qh, n_blocks * KV_BLOCK) * scale).masked_fill(~visible[:, None], NEG_INF)
    s = s.view(S, hkv, rows, n_blocks, KV_BLOCK)
    # m only shifts the exponent: detach it so autograd sees the exact softmax.
    block_max = s.detach().amax(-1)
    m = torch.cat([torch.cummax(block_max[..., c:c + per_chunk], -1).values
                   for c in range(0, n_blocks, per_chunk)], -1)        # [S, Hkv, R, J]
    m_prev = torch.cat([torch.full_like(m[..., :1], NEG_INF), m[..., :-1]], -1)
    m_prev[..., ::per_chunk] = NEG_INF                                  # a chunk starts fresh
    m0 = m.masked_fill(m == NEG_INF, 0.0)                               # no key seen yet: a = p = 0
    a = exp32(m_prev - m0)
    p = exp32(s - m0[..., None])
    row_sums = sum32(p, -1)
    pv = kv.values(p.transpose(2, 3))                                   # [S, Hkv, J, R, D]
    out = None
    for c in range(0, n_blocks, per_chunk):                             # chunks from 0, in order
        l = torch.zeros((S, hkv, rows), dtype=torch.float32, device=q.device)
        acc = torch.zeros((S, hkv, rows, D), dtype=torch.float32, device=q.device)
        for j in range(c, min(c + per_chunk, n_blocks)):                # blocks of the chunk, in order
            l = l * a[..., j] + row_sums[..., j]
            acc = acc * a[..., j, None] + pv[:, :, j]
        state = (m[..., min(c + per_chunk, n_blocks) - 1], l, acc)
        out = state if out is None else _fold(out, state)
    return _unrows(out[2] / out[1][..., None], q)


def _fold(f, chunk):
    """The contract's fold of a chunk's state into the state of the chunks before it; a row
    that sees no key of the chunk keeps its state."""
    (fm, fl, facc), (m, l, acc) = f, chunk
    top = torch.maximum(fm, m)
    x, y = exp32(fm - top), exp32(m - top)
    seen = m != NEG_INF
    return (torch.where(seen, top, fm), torch.where(seen, fl * x + l * y, fl),
            torch.where(seen[..., None], facc * x[..., None] + acc * y[..., None], facc))


def _check_heads(hq, hkv):
    if hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of KV heads ({hkv})")


def _pad_rows(x, starts, lens, width):
    """Consecutive rows x[starts[i] : starts[i]+lens[i]] into a zero-padded [S, width, ...] tensor."""
    if lens.count(width) == len(lens):          # e.g. decode: the rows already are [S, width]
        return x[starts[0]:starts[0] + len(lens) * width].reshape(len(lens), width, *x.shape[1:])
    out = x.new_zeros((len(lens), width) + tuple(x.shape[1:]))
    for i, (s, n) in enumerate(zip(starts, lens)):
        out[i, :n] = x[s:s + n]
    return out


def _unpad_rows(x, lens):
    if lens.count(x.shape[1]) == len(lens):
        return x.reshape(-1, *x.shape[2:])
    return torch.cat([x[i, :n] for i, n in enumerate(lens)], dim=0)


def _padded_batch(q, key_cache, value_cache, block_table, seq_lens, starts, lens, scale):
    """The requests that have tokens, attended alone; rows no request holds are zeros."""
    out = torch.zeros_like(q)
    keep = [i for i, n in enumerate(lens) if n]
    if keep:
        rows = torch.cat([torch.arange(starts[i], starts[i] + lens[i]) for i in keep]).to(q.device)
        qsl = torch.tensor([0] + [lens[i] for i in keep]).cumsum(0)
        sel = torch.tensor(keep, device=seq_lens.device)
        out[rows] = attention_paged(q[rows], key_cache, value_cache, block_table[sel], seq_lens[sel], qsl, scale)
    return out


def attention_varlen(q, k, v, cu_seqlens, scale=None):
    """Packed causal attention. q [T, Hq, D]; k, v [T, Hkv, D]; cu_seqlens [S+1] int.
    Differentiable (training forward)."""
    _check_heads(q.shape[1], k.shape[1])
    scale = attention_scale(q.shape[-1]) if scale is None else scale
    bounds = cu_seqlens.tolist()
    starts, lens = bounds[:-1], [e - s for s, e in zip(bounds[:-1], bounds[1:])]
    width = -(-max(lens) // KV_BLOCK) * KV_BLOCK
    qp, kp, vp = (_pad_rows(t, starts, lens, width) for t in (q, k, v))
    pos = torch.arange(width, device=q.device)
    seq_lens = torch.tensor(lens, device=q.device)
    qpos = torch.minimum(pos[None, :], seq_lens[:, None] - 1)     # padded rows see a real prefix
    out = _attend(qp, qpos, _DenseKV(kp, vp), scale)
    return _unpad_rows(out, lens)


def write_kv_cache(key, value, key_cache, value_cache, slot_mapping):
    """Store this step's K/V before attention reads them (prefill and decode then
    reduce over the same cache). Caches [pages, page_size, Hkv, D]; slot -1 = padding."""
    if (key.is_cpu and key.dtype == value.dtype == key_cache.dtype == value_cache.dtype
            and key_cache.stride() == value_cache.stride() and key.shape == value.shape
            and key.shape[1:] == key_cache.shape[2:]             # (the torch write below also broadcasts)
            and key.shape[0] == slot_mapping.shape[0] and not recording(key, value)):
        return native.write_kv(key, value, key_cache, value_cache, slot_mapping)   # the same copies, one call
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    page, pos = slots // key_cache.shape[1], slots % key_cache.shape[1]   # any strides (head-major too)
    key_cache[page, pos] = key[keep].to(key_cache.dtype)
    value_cache[page, pos] = value[keep].to(value_cache.dtype)


def attention_paged(q, key_cache, value_cache, block_table, seq_lens, query_start_loc, scale=None,
                    max_query_len=None, out=None):
    """New tokens of each sequence against the paged cache (which already holds them).
    q [T, Hq, D]; caches [pages, page_size, Hkv, D]; block_table [S, max_pages];
    seq_lens [S] include this step's tokens; query_start_loc [S+1]. max_query_len (a launch
    bound for backends that size grids by it) is not needed here: the lengths are read.
    out: q's shape and dtype (e.g. vLLM's output rows), returned; the native walk writes it in
    place where the rows need no padding (decode, a prefill of equal lengths), else a copy."""
    _check_heads(q.shape[1], key_cache.shape[2])
    scale = attention_scale(q.shape[-1]) if scale is None else scale
    layout = _PagedLayout.of(q.shape[:2], q.device, key_cache, block_table, seq_lens, query_start_loc)
    if layout.padded:    # padding (a padded capture size): rows of no request are 0
        return _into(out, _padded_batch(q, key_cache, value_cache, block_table, seq_lens, layout.starts, layout.lens,
                                        scale))
    if layout.token is None:
        kv = _gathered_kv(key_cache, value_cache, layout.table, layout.seq_lens, layout.walked)
    else:
        kv = _PagedKV(key_cache, value_cache, layout)
        if layout.decode and q.dtype in native.DTYPES and not recording(q, key_cache, value_cache):
            return _decode(q, kv, scale, out)
    qp = _pad_rows(q, layout.starts, layout.lens, layout.width)
    if layout.lens.count(layout.width) == len(layout.lens):       # rows [S, width] as they lie, out's too
        return _attend(qp, layout.qpos, kv, scale, None if out is None else out.view(qp.shape)).view(q.shape)
    return _into(out, _unpad_rows(_attend(qp, layout.qpos, kv, scale), layout.lens))


def _decode(q, kv, scale, out=None):
    """_attend_native for one new token per sequence, q [S, Hq, D] (CPU inference) as [S, 1, Hq, D]:
    without _pad_rows' and _unpad_rows' reshapes."""
    k, v, token, head_stride, dim_stride, seq_lens = kv.addresses()
    res = native.attend_heads(q[:, None], kv.hkv, k, v, token, head_stride, dim_stride, kv.layout.rows_qpos,
                              seq_lens, scale, KV_CHUNK, kv.layout.token_range, None if out is None else out[:, None])
    return res[:, 0]


class _PagedLayout:
    """A step's index work for attention_paged, the same for every layer: each request's rows and
    positions, and on CPU the K/V offsets into caches of one geometry (native.paged_tokens) and their
    range. ``of`` makes it once per step: a layer called with the same metadata tensors, unchanged
    (compared with a copy), and a cache of the same geometry reuses the last one. It is a function
    of those contents alone, so reusing it changes no bit."""

    _last = None

    def __init__(self, rows, device, key_cache, block_table, seq_lens, query_start_loc):
        """rows: (query rows T, query heads Hq) of the step; device: the queries'."""
        bounds = query_start_loc.tolist()
        self.starts, self.lens = bounds[:-1], [e - s for s, e in zip(bounds[:-1], bounds[1:])]
        self.padded = 0 in self.lens or bounds[-1] < rows[0]
        self.token, self.decode = None, False
        if self.padded:
            return
        self.width = width = max(self.lens)
        self.seq_lens = seq_lens = seq_lens.to(device=device, dtype=torch.long)
        if min(self.lens) == width:      # e.g. decode: positions seq_len - width .. seq_len - 1, none past the end
            qpos = seq_lens[:, None] + torch.arange(-width, 0, device=device)
        else:
            n_new = torch.tensor(self.lens, device=device)
            qpos = seq_lens[:, None] - n_new[:, None] + torch.arange(width, device=device)[None, :]
            qpos = torch.minimum(qpos, seq_lens[:, None] - 1)
        # [S, G * width], contiguous (native.attend_heads would copy it every layer): qpos.repeat(1, G) in half its time
        grouped = qpos.unsqueeze(1).expand(-1, rows[1] // key_cache.shape[2], -1)
        self.qpos, self.rows_qpos = qpos, grouped.contiguous().flatten(1)
        self.table = block_table.to(device=device, dtype=torch.long)
        self.walked = (int(qpos.max()) // KV_BLOCK + 1) * KV_BLOCK
        if device.type == "cpu" and key_cache.dtype in native.DTYPES:
            # [S, L]; columns past a sequence's last page repeat it (masked keys; V reads as zero there).
            self.token = native.paged_tokens(self.table, seq_lens, self.walked, key_cache.shape[1],
                                             *key_cache.stride()[:2])
            self.token_range = tuple(int(t) for t in self.token.aminmax())
            # q's rows are the requests' one new token each, in order (attention_paged's _decode)
            self.decode = width == 1 and bounds[0] == 0 and bounds[-1] == rows[0]

    @classmethod
    def of(cls, rows, device, key_cache, block_table, seq_lens, query_start_loc):
        key = (tuple(rows), device, key_cache.shape, key_cache.stride(), key_cache.dtype)
        last = cls._last
        if (last is not None and last[0][0] is block_table and last[0][1] is seq_lens
                and last[0][2] is query_start_loc and last[1] == key
                and all(torch.equal(a, b) for a, b in zip(last[2], (block_table, seq_lens, query_start_loc)))):
            return last[3]
        layout = cls(rows, device, key_cache, block_table, seq_lens, query_start_loc)
        metadata = (block_table, seq_lens, query_start_loc)
        cls._last = (metadata, key, [t.clone() for t in metadata], layout)
        return layout


def _gathered_kv(key_cache, value_cache, table, seq_lens, walked):
    """_DenseKV from one gather of the whole pages that hold every block walked (a page is
    one strided copy; single slots are not); for devices without the native kernel.
    Columns past a sequence's last page repeat it; V rows past seq_len are zeroed, as in
    the padded varlen layout (stale cache rows may hold NaN, and 0 * NaN is NaN)."""
    page_size, device = key_cache.shape[1], key_cache.device
    n_pages = -(-walked // page_size)
    last_page = (seq_lens[:, None] - 1) // page_size
    pages = torch.gather(table, 1, torch.minimum(torch.arange(n_pages, device=device)[None, :], last_page))
    keys, values = (c.index_select(0, pages.flatten()).view(len(seq_lens), n_pages * page_size, *c.shape[2:])
                    for c in (key_cache, value_cache))
    past_end = torch.arange(n_pages * page_size, device=device)[None, :] >= seq_lens[:, None]
    values.view(-1, *values.shape[2:]).index_fill_(0, past_end.flatten().nonzero().squeeze(1), 0)
    return _DenseKV(keys, values)
