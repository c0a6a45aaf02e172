"""Attention: one online-softmax loop over fixed KV blocks, two entry points.

``attention_varlen`` (packed training batches, prefill without cache) and
``attention_paged`` (any number of new tokens per sequence against a paged KV
cache) differ only in how a KV block is fetched; both run ``_attend``, so a token
gets the same bits whether it was trained, prefilled, chunk-prefilled or decoded.
"""
import math

import torch

from ..contract import KV_BLOCK
from .core import exp32, matmul32, sum32, to64

NEG_INF = float("-inf")


def _attend(q, qpos, seq_lens, fetch_block, hkv, scale):
    """q [S, Tq, Hq, D], qpos [S, Tq] absolute positions, seq_lens [S];
    fetch_block(j) -> k, v [S, KV_BLOCK, Hkv, D] for positions j*KV_BLOCK + [0, KV_BLOCK).
    Returns [S, Tq, Hq, D] in q's dtype."""
    S, Tq, Hq, D = q.shape
    g = Hq // hkv
    # [S, Hkv, G*Tq, D]: the G query heads sharing a KV head are stacked as rows.
    qh = to64(q.reshape(S, Tq, hkv, g, D).permute(0, 2, 3, 1, 4).reshape(S, hkv, g * Tq, D))
    m = torch.full((S, hkv, g * Tq, 1), NEG_INF, dtype=torch.float32, device=q.device)
    l = torch.zeros_like(m)
    acc = torch.zeros((S, hkv, g * Tq, D), dtype=torch.float32, device=q.device)
    qpos_rows = qpos.repeat(1, g)                                   # [S, G*Tq]
    offsets = torch.arange(KV_BLOCK, device=q.device)
    for j in range(int(qpos.max()) // KV_BLOCK + 1):  # blocks from 0, in order
        k, v = fetch_block(j)                                       # fp64 (exact copies)
        kpos = j * KV_BLOCK + offsets
        in_seq = kpos[None, :] < seq_lens[:, None]                  # [S, B]
        v = v.masked_fill(~in_seq[:, :, None, None], 0)             # stale cache rows: 0*NaN is NaN
        visible = (kpos[None, None, :] <= qpos_rows[:, :, None]) & in_seq[:, None, :]
        s = matmul32(qh, k.permute(0, 2, 3, 1)) * scale             # [S, Hkv, G*Tq, B]
        s = s.masked_fill(~visible[:, None], NEG_INF)
        # m only shifts the exponent: detach it so autograd sees the exact softmax.
        m_new = torch.maximum(m, s.detach().amax(-1, keepdim=True))
        a = exp32(m - m_new)
        p = exp32(s - m_new)
        l = l * a + sum32(p, -1, keepdim=True)
        acc = acc * a + matmul32(p, v.permute(0, 2, 1, 3))
        m = m_new
    out = (acc / l).reshape(S, hkv, g, Tq, D).permute(0, 3, 1, 2, 4).reshape(S, Tq, Hq, D)
    return out.to(q.dtype)


def _check_heads(hq, hkv):
    if hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of KV heads ({hkv})")


def _pad_rows(x, starts, lens, width):
    """Rows x[starts[i] : starts[i]+lens[i]] into a zero-padded [S, width, ...] tensor."""
    out = x.new_zeros((len(lens), width) + tuple(x.shape[1:]))
    for i, (s, n) in enumerate(zip(starts, lens)):
        out[i, :n] = x[s:s + n]
    return out


def _unpad_rows(x, lens):
    return torch.cat([x[i, :n] for i, n in enumerate(lens)], dim=0)


def attention_varlen(q, k, v, cu_seqlens, scale=None):
    """Packed causal attention. q [T, Hq, D]; k, v [T, Hkv, D]; cu_seqlens [S+1] int.
    Differentiable (training forward)."""
    _check_heads(q.shape[1], k.shape[1])
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    bounds = cu_seqlens.tolist()
    starts, lens = bounds[:-1], [e - s for s, e in zip(bounds[:-1], bounds[1:])]
    width = -(-max(lens) // KV_BLOCK) * KV_BLOCK
    qp = _pad_rows(q, starts, lens, width)
    kp, vp = (to64(_pad_rows(t, starts, lens, width)) for t in (k, v))
    pos = torch.arange(width, device=q.device)
    seq_lens = torch.tensor(lens, device=q.device)
    qpos = torch.minimum(pos[None, :], seq_lens[:, None] - 1)     # padded rows see a real prefix

    def fetch_block(j):
        sl = slice(j * KV_BLOCK, (j + 1) * KV_BLOCK)
        return kp[:, sl], vp[:, sl]

    out = _attend(qp, qpos, seq_lens, fetch_block, k.shape[1], scale)
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
    # One gather of every block this call walks (not one per block), widened once.
    pos = torch.arange((int(qpos.max()) // KV_BLOCK + 1) * KV_BLOCK, device=q.device)
    pos = torch.minimum(pos[None, :], seq_lens[:, None] - 1)      # masked later; keep in range
    pages = torch.gather(table, 1, pos // page_size)
    keys, values = to64(key_cache[pages, pos % page_size]), to64(value_cache[pages, pos % page_size])

    def fetch_block(j):
        sl = slice(j * KV_BLOCK, (j + 1) * KV_BLOCK)
        return keys[:, sl], values[:, sl]

    out = _attend(qp, qpos, seq_lens, fetch_block, key_cache.shape[2], scale)
    return _unpad_rows(out, lens)
