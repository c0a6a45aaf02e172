"""Attention: one online-softmax loop over fixed KV blocks, two entry points.

``attention_varlen`` (packed training batches, prefill without cache) and
``attention_paged`` (any number of new tokens per sequence against a paged KV
cache) differ only in how they lay K/V out per sequence (zero-padding vs a gather
from the pages); both run ``_attend``, so a token gets the same bits whether it was
trained, prefilled, chunk-prefilled or decoded.
"""
import math

import torch

from ..contract import KV_BLOCK
from .core import exp32, matmul32, sum32, to64

NEG_INF = float("-inf")


def _heads_major64(x):
    """[S, L, H, D] -> contiguous fp64 [S, H, L, D] (exact), in one copy, so every KV block
    below is a plain strided view that the batched matmul reads without copying."""
    return x.transpose(1, 2).to(torch.float64, memory_format=torch.contiguous_format)


def _attend(q, qpos, k, v, scale):
    """q [S, Tq, Hq, D], qpos [S, Tq] absolute positions (< seq_len);
    k, v [S, L, Hkv, D] from position 0, L covering every block up to the last qpos;
    at positions >= seq_len k may hold anything (masked) and v must be zero.
    Returns [S, Tq, Hq, D] in q's dtype."""
    S, Tq, Hq, D = q.shape
    hkv = k.shape[2]
    g = Hq // hkv
    # [S, Hkv, G*Tq, D]: the G query heads sharing a KV head are stacked as rows.
    qh = to64(q.reshape(S, Tq, hkv, g, D).permute(0, 2, 3, 1, 4).reshape(S, hkv, g * Tq, D))
    m = torch.full((S, hkv, g * Tq, 1), NEG_INF, dtype=torch.float32, device=q.device)
    l = torch.zeros_like(m)
    acc = torch.zeros((S, hkv, g * Tq, D), dtype=torch.float32, device=q.device)
    qpos_rows = qpos.repeat(1, g)                                   # [S, G*Tq]
    offsets = torch.arange(KV_BLOCK, device=q.device)
    for j in range(int(qpos.max()) // KV_BLOCK + 1):  # blocks from 0, in order
        sl = slice(j * KV_BLOCK, (j + 1) * KV_BLOCK)
        kpos = j * KV_BLOCK + offsets
        visible = kpos[None, None, :] <= qpos_rows[:, :, None]      # qpos < seq_len: in the sequence
        kb, vb = _heads_major64(k[:, sl]), _heads_major64(v[:, sl])
        s = matmul32(qh, kb.transpose(-1, -2)) * scale             # [S, Hkv, G*Tq, B]
        s = s.masked_fill(~visible[:, None], NEG_INF)
        # m only shifts the exponent: detach it so autograd sees the exact softmax.
        m_new = torch.maximum(m, s.detach().amax(-1, keepdim=True))
        a = exp32(m - m_new)
        p = to64(exp32(s - m_new))                                 # fp32 values, widened once
        l = l * a + sum32(p, -1, keepdim=True)
        acc = acc * a + matmul32(p, vb)
        m = m_new
    out = (acc / l).reshape(S, hkv, g, Tq, D).permute(0, 3, 1, 2, 4).reshape(S, Tq, Hq, D)
    return out.to(q.dtype)


def _check_heads(hq, hkv):
    if hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of KV heads ({hkv})")


def _pad_rows(x, starts, lens, width):
    """Consecutive rows x[starts[i] : starts[i]+lens[i]] into a zero-padded [S, width, ...] tensor."""
    if all(n == width for n in lens):           # e.g. decode: the rows already are [S, width]
        return x[starts[0]:starts[0] + len(lens) * width].reshape(len(lens), width, *x.shape[1:])
    out = x.new_zeros((len(lens), width) + tuple(x.shape[1:]))
    for i, (s, n) in enumerate(zip(starts, lens)):
        out[i, :n] = x[s:s + n]
    return out


def _unpad_rows(x, lens):
    if all(n == x.shape[1] for n in lens):
        return x.reshape(-1, *x.shape[2:])
    return torch.cat([x[i, :n] for i, n in enumerate(lens)], dim=0)


def attention_varlen(q, k, v, cu_seqlens, scale=None):
    """Packed causal attention. q [T, Hq, D]; k, v [T, Hkv, D]; cu_seqlens [S+1] int.
    Differentiable (training forward)."""
    _check_heads(q.shape[1], k.shape[1])
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    bounds = cu_seqlens.tolist()
    starts, lens = bounds[:-1], [e - s for s, e in zip(bounds[:-1], bounds[1:])]
    width = -(-max(lens) // KV_BLOCK) * KV_BLOCK
    qp, kp, vp = (_pad_rows(t, starts, lens, width) for t in (q, k, v))
    pos = torch.arange(width, device=q.device)
    seq_lens = torch.tensor(lens, device=q.device)
    qpos = torch.minimum(pos[None, :], seq_lens[:, None] - 1)     # padded rows see a real prefix
    out = _attend(qp, qpos, kp, vp, scale)
    return _unpad_rows(out, lens)


def write_kv_cache(key, value, key_cache, value_cache, slot_mapping):
    """Store this step's K/V before attention reads them (prefill and decode then
    reduce over the same cache). Caches [pages, page_size, Hkv, D]; slot -1 = padding."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    key_cache.view(-1, *key_cache.shape[2:])[slots] = key[keep].to(key_cache.dtype)
    value_cache.view(-1, *value_cache.shape[2:])[slots] = value[keep].to(value_cache.dtype)


def attention_paged(q, key_cache, value_cache, block_table, seq_lens, query_start_loc, scale=None):
    """New tokens of each sequence against the paged cache (which already holds them).
    q [T, Hq, D]; caches [pages, page_size, Hkv, D]; block_table [S, max_pages];
    seq_lens [S] include this step's tokens; query_start_loc [S+1]."""
    _check_heads(q.shape[1], key_cache.shape[2])
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    page_size = key_cache.shape[1]
    bounds = query_start_loc.tolist()
    starts, lens = bounds[:-1], [e - s for s, e in zip(bounds[:-1], bounds[1:])]
    width = max(lens)
    seq_lens = seq_lens.to(device=q.device, dtype=torch.long)
    qp = _pad_rows(q, starts, lens, width)
    n_new = torch.tensor(lens, device=q.device)
    qpos = seq_lens[:, None] - n_new[:, None] + torch.arange(width, device=q.device)[None, :]
    qpos = torch.minimum(qpos, seq_lens[:, None] - 1)
    table = block_table.to(device=q.device, dtype=torch.long)
    # One gather of the whole pages that hold every block this call walks (a page is one
    # strided copy; single slots are not). Columns past a sequence's last page repeat it.
    # Positions past seq_len are masked in _attend; their V rows are zeroed here, as in
    # the padded varlen layout (stale cache rows may hold NaN, and 0 * NaN is NaN).
    walked = (int(qpos.max()) // KV_BLOCK + 1) * KV_BLOCK
    n_pages = -(-walked // page_size)
    last_page = (seq_lens[:, None] - 1) // page_size
    pages = torch.gather(table, 1, torch.minimum(torch.arange(n_pages, device=q.device)[None, :], last_page))
    keys, values = (c.index_select(0, pages.flatten()).view(len(lens), n_pages * page_size, *c.shape[2:])
                    for c in (key_cache, value_cache))
    past_end = torch.arange(n_pages * page_size, device=q.device)[None, :] >= seq_lens[:, None]
    values.view(-1, *values.shape[2:]).index_fill_(0, past_end.flatten().nonzero().squeeze(1), 0)
    out = _attend(qp, qpos, keys, values, scale)
    return _unpad_rows(out, lens)
