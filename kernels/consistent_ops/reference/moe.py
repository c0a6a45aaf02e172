"""MoE routing, per-(token, slot) expert contributions, slot-ordered combine."""
import torch

from .core import exp32, sum32
from .linear import linear
from .pointwise import silu_mul


def moe_route(x, gate_weight, top_k, norm_topk_prob=True):
    """Router: fp32 logits, fp32 softmax, top-k with ties to the lower expert id.
    Returns (ids int64 [T, k], weights fp32 [T, k])."""
    logits = linear(x, gate_weight, out_dtype=torch.float32)
    e = exp32(logits - logits.amax(-1, keepdim=True))
    probs = e / sum32(e, -1, keepdim=True)
    ids = torch.sort(probs, dim=-1, descending=True, stable=True).indices[:, :top_k]
    weights = torch.gather(probs, 1, ids)
    if norm_topk_prob:
        weights = weights / sum32(weights, -1, keepdim=True)
    return ids, weights


def moe_expert_contributions(x, ids, weights, experts, local_experts=None):
    """contrib [T, k, H] fp32: routing weight * expert(x) for the slots whose expert is
    local (zeros elsewhere), and owned [T, k]. experts[e] = (w_gate [I, H], w_up [I, H],
    w_down [H, I]). Rows are computed with the row-invariant linear, so a contribution
    has the same bits on whichever rank, and in whichever token group, it is computed."""
    t, k = ids.shape
    local = set(range(len(experts)) if local_experts is None else local_experts)
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)              # (token, slot) pairs grouped by expert
    counts = torch.bincount(flat, minlength=max(local, default=0) + 1).tolist()
    picked, values, start = [], [], 0
    for e, n in enumerate(counts):
        sel, start = order[start:start + n], start + n
        if n == 0 or e not in local:
            continue
        w_gate, w_up, w_down = experts[e]
        xs = x[sel // k]
        h = silu_mul(linear(xs, w_gate), linear(xs, w_up))
        values.append(linear(h, w_down, out_dtype=torch.float32) * weights.reshape(-1)[sel].unsqueeze(-1))
        picked.append(sel)
    contrib = torch.zeros(t * k, x.shape[-1], dtype=torch.float32, device=x.device)
    owned = torch.zeros(t * k, dtype=torch.bool, device=x.device)
    if picked:
        sel = torch.cat(picked)
        contrib = contrib.index_put((sel,), torch.cat(values))
        owned[sel] = True
    return contrib.view(t, k, -1), owned.view(t, k)


def moe_combine(contrib, out_dtype):
    """Sum the k slot contributions in slot order 0..k-1 in fp32, round once."""
    total = contrib[:, 0]
    for j in range(1, contrib.shape[1]):
        total = total + contrib[:, j]
    return total.to(out_dtype)
