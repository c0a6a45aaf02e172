"""MoE routing, per-(token, slot) expert contributions, slot-ordered combine."""
import torch

from ..experts import ExpertStack
from . import native
from .core import exp32, matmul32, recording, sum32
from .linear import _fusable, linear
from .pointwise import silu_mul


def moe_route(x, gate_weight, top_k, norm_topk_prob=True):
    """Router: fp32 logits, fp32 softmax, top-k with ties to the lower expert id.
    Returns (ids int64 [T, k], weights fp32 [T, k]). On CPU in the fp32/bf16 realisations the
    softmax, top-k and renormalisation are one native call (its exp the attention's polynomial, its
    sums in fp64 in expert order: contract.CPU_ACCUMULATION "moe_router"), with or without autograd,
    so the trainer and the rollout share it; elsewhere (and in the fp64 realisation) the torch steps."""
    native_route = 0 < top_k <= gate_weight.shape[0]
    if native_route and _fusable(x, gate_weight):       # inference: the linear in the same call
        return native.moe_router(x, gate_weight, top_k, norm_topk_prob)
    logits = linear(x, gate_weight, out_dtype=torch.float32)
    if native_route and logits.device.type == "cpu" and native.accumulation() != "fp64":
        if recording(logits):
            ids, weights = _NativeRoute.apply(logits, top_k, norm_topk_prob)
            return ids, weights
        return native.moe_route(logits, top_k, norm_topk_prob)
    return _route_torch(logits, top_k, norm_topk_prob)


def _route_torch(logits, top_k, norm_topk_prob, ids=None):
    """The router's torch steps after the linear (ids: take these experts' probs instead of the top-k)."""
    e = exp32(logits - logits.amax(-1, keepdim=True))
    probs = e / sum32(e, -1, keepdim=True)
    if ids is None:
        ids = torch.sort(probs, dim=-1, descending=True, stable=True).indices[:, :top_k]
    weights = torch.gather(probs, 1, ids)
    if norm_topk_prob:
        weights = weights / sum32(weights, -1, keepdim=True)
    return ids, weights


class _NativeRoute(torch.autograd.Function):
    """Forward: native.moe_route; backward: autograd through the torch steps at the forward's experts
    (their exp and sums differ from the native ones in at most rare last bits, not in the rule)."""

    @staticmethod
    def forward(ctx, logits, top_k, norm):
        ids, weights = native.moe_route(logits, top_k, norm)
        ctx.save_for_backward(logits, ids)
        ctx.norm = norm
        ctx.mark_non_differentiable(ids)
        return ids, weights

    @staticmethod
    def backward(ctx, _, grad):
        logits, ids = ctx.saved_tensors
        with torch.enable_grad():
            leaf = logits.detach().requires_grad_()
            weights = _route_torch(leaf, ids.shape[1], ctx.norm, ids)[1]
            return torch.autograd.grad(weights, leaf, grad)[0], None, None


def _pairs_by_expert(ids, local):
    """(token, slot) pair indices [L, n] of each local expert, ascending, padded to the
    largest group n, and each expert's group size [L]."""
    hits = ids.reshape(1, -1) == torch.tensor(local, device=ids.device)[:, None]     # [L, T*k]
    counts = hits.sum(1)
    pairs = torch.sort(hits.to(torch.uint8), dim=1, descending=True, stable=True).indices
    return pairs[:, :int(counts.max())], counts


def _stacked(experts, local):
    """The local experts as [L, H, 2I] (gate columns, then up) and [L, I, H], i.e. stacked
    and transposed for x @ w: an ExpertStack's tensors as they are (views), a mapping's
    per-expert tensors concatenated."""
    if isinstance(experts, ExpertStack) and experts.local == list(local):
        return experts.gate_up.transpose(1, 2), experts.down.transpose(1, 2)
    weights = [experts[e] for e in local]
    gate_up = torch.stack([torch.cat(w[:2]) for w in weights]).transpose(1, 2)
    return gate_up, torch.stack([w[2] for w in weights]).transpose(1, 2)


def moe_expert_contributions(x, ids, weights, experts, local_experts=None):
    """contrib [T, k, H] fp32: routing weight * expert(x) for the slots whose expert is
    local (zeros elsewhere), and owned [T, k]. experts[e] = (w_gate [I, H], w_up [I, H],
    w_down [H, I]), or an ExpertStack (read in place). All local experts run as one
    batched matmul over their (token, slot) rows, padded to the largest group (padding rows are not computed); every row is its own
    contract dot products rounded once (as in ``linear``), so a contribution has the same
    bits on whichever rank, and in whichever token group, it is computed."""
    t, k = ids.shape
    local = sorted(range(len(experts)) if local_experts is None else local_experts)
    if _native(x, experts, local, weights):
        contrib, owned, _ = native.moe_experts(x, ids, weights, experts.gate_up, experts.down, local[0])
        return contrib.view(t, k, -1), owned.view(t, k)
    every = len(local) == len(experts)        # then each (token, slot) gets a contribution
    contrib = (torch.empty if every else torch.zeros)(t * k, x.shape[-1], dtype=torch.float32, device=x.device)
    owned = torch.zeros(t * k, dtype=torch.bool, device=x.device)
    if local and t:
        pairs, counts = _pairs_by_expert(ids, local)
        valid = torch.arange(pairs.shape[1], device=x.device) < counts[:, None]
        w_gate_up, w_down = _stacked(experts, local)
        gate, up = matmul32(x[pairs // k], w_gate_up, counts).to(x.dtype).chunk(2, -1)
        out = matmul32(silu_mul(gate, up), w_down, counts) * weights.reshape(-1)[pairs].unsqueeze(-1)
        sel = pairs[valid]
        contrib = contrib.index_put((sel,), out[valid])
        owned[sel] = True
    return contrib.view(t, k, -1), owned.view(t, k)


def moe_experts(x, ids, weights, experts):
    """consistent_ops.moe_experts: moe_combine(moe_expert_contributions(x, ids, weights, experts)[0], x's
    dtype) in one native call where the experts run as one (_native: here an ExpertStack of experts
    0 .. E-1): the same dots and the same adds (the same bits); None elsewhere (the caller runs the two)."""
    if not _native(x, experts, list(range(len(experts))), weights):
        return None
    return native.moe_experts(x, ids, weights, experts.gate_up, experts.down, 0, combine=True)[2]


def _native(x, experts, local, weights):
    """Whether the experts run as one native call (CPU inference in the fp32/bf16 realisations,
    a stack of contiguous local ids in x's dtype): the same dots of the same rows as the torch
    path below, minus its ~30 gathers, scatters and pointwise ops a layer."""
    return (x.is_cpu and x.dtype in native.ACTIVATIONS and x.shape[0] > 0 and isinstance(experts, ExpertStack)
            and experts.local == list(local) and local == list(range(local[0], local[0] + len(local)))
            and experts.gate_up.dtype == x.dtype and experts.down.dtype == x.dtype
            and native.accumulation() != "fp64" and not recording(x, weights, experts.gate_up, experts.down))


def moe_combine(contrib, out_dtype):
    """Sum the k slot contributions in slot order 0..k-1 in fp32, round once."""
    total = contrib[:, 0]
    for j in range(1, contrib.shape[1]):
        total = total + contrib[:, j]
    return total.to(out_dtype)
