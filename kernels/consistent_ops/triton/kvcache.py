"""KV-cache write on Triton: this step's K/V stored by slot, padding (slot -1) skipped
on the device.

The reference's boolean-mask indexing sizes its result by the data (a device sync), so
it cannot run inside a CUDA graph; here one program per token reads its slot and
returns at once for padding, so a graph captured at a padded batch size replays for
any real batch that fits it. A copy is exact: the bits are the reference's.
"""
import torch
import triton
import triton.language as tl

from .common import launch, pdl_enter


@triton.jit
def _write_kv_kernel(K, V, KC, VC, Slots, stride_kt, stride_kh, stride_vt, stride_vh,
                     sk_page, sk_pos, sk_head, sv_page, sv_pos, sv_head,
                     PAGE: tl.constexpr, HKV: tl.constexpr, HB: tl.constexpr, D: tl.constexpr,
                     PDL: tl.constexpr = False):
    pdl_enter(PDL)
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(Slots + tok).to(tl.int64)
    if slot < 0:                       # padding token: nothing to store
        return
    page, pos = slot // PAGE, slot % PAGE
    h = tl.arange(0, HB)
    d = tl.arange(0, D)
    live = (h < HKV)[:, None]
    k = tl.load(K + tok * stride_kt + h[:, None] * stride_kh + d[None, :], mask=live)
    v = tl.load(V + tok * stride_vt + h[:, None] * stride_vh + d[None, :], mask=live)
    tl.store(KC + page * sk_page + pos * sk_pos + h[:, None] * sk_head + d[None, :],
             k.to(KC.dtype.element_ty), mask=live)
    tl.store(VC + page * sv_page + pos * sv_pos + h[:, None] * sv_head + d[None, :],
             v.to(VC.dtype.element_ty), mask=live)


def write_kv_cache(key, value, key_cache, value_cache, slot_mapping):
    """Store this step's K/V before attention reads them. key/value [T, Hkv, D]; caches
    [pages, page_size, Hkv, D] (any page/position/head strides, contiguous D); slot -1 =
    padding. Rows of slot_mapping past T are ignored (vLLM pads it)."""
    t, hkv, d = key.shape
    if not t:
        return
    for x in (key, value, key_cache, value_cache):
        if x.stride(-1) != 1:
            raise ValueError("write_kv_cache needs a contiguous head_dim")
    if d & (d - 1):
        raise NotImplementedError(f"head_dim={d}: the Triton backend needs a power of two")
    slots = slot_mapping[:t]
    slots = slots if slots.is_contiguous() else slots.contiguous()
    _write_kv_kernel[(t,)](key, value, key_cache, value_cache, slots,
                           key.stride(0), key.stride(1), value.stride(0), value.stride(1),
                           *key_cache.stride()[:3], *value_cache.stride()[:3],
                           PAGE=key_cache.shape[1], HKV=hkv, HB=triton.next_power_of_2(hkv), D=d,
                           num_warps=1, **launch(key, fusion=True))
