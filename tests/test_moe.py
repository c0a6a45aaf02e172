"""MoE: routing ties resolve to the lower expert id; a token's output is independent of
its batch and of which rank holds its experts (2 gloo ranks == 1 process); bitwise."""
import torch

import consistent_ops as co
from consistent_ops import parallel
from helpers import run_gloo

E, K, H, I = 8, 2, 64, 32


def setup(t=96, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, H, generator=g).bfloat16()
    gate = (0.3 * torch.randn(E, H, generator=g)).bfloat16()
    experts = {e: tuple((0.1 * torch.randn(*s, generator=g)).bfloat16() for s in ((I, H), (I, H), (H, I)))
               for e in range(E)}
    return x, gate, experts


def moe(x, gate, experts, local=None):
    ids, w = co.moe_route(x, gate, K)
    contrib, owned = co.moe_expert_contributions(x, ids, w, experts, local)
    return co.moe_combine(contrib, x.dtype), contrib, owned


def test_router_ties_pick_lower_id():
    x, gate, _ = setup(t=4)
    row = gate[2].abs()
    gate[:] = -row                         # every expert loses ...
    gate[[2, 5, 6]] = row                  # ... but 2, 5, 6, which tie exactly
    ids, w = co.moe_route(x[:1].abs(), gate, 2)
    assert ids.tolist() == [[2, 5]] and torch.equal(w[:, 0], w[:, 1])


def test_token_alone_equals_in_batch():
    x, gate, experts = setup()
    full = moe(x, gate, experts)[0]
    for t in (0, 5, 95):
        assert torch.equal(moe(x[t:t + 1], gate, experts)[0], full[t:t + 1])
    assert torch.equal(moe(x[10:50], gate, experts)[0], full[10:50])


def _rank_moe(rank, world, x, gate, experts, placement):
    local = [e for e in range(E) if placement[e] == rank]
    _, contrib, owned = moe(x, gate, experts, local)
    return co.moe_combine(parallel.gather_owned(contrib, owned), x.dtype)


def test_expert_parallel_equals_one_process():
    x, gate, experts = setup()
    single = moe(x, gate, experts)[0]
    for placement in ([0, 0, 0, 0, 1, 1, 1, 1], [0, 1] * 4, [1, 0, 0, 1, 1, 0, 1, 0]):
        results = run_gloo(_rank_moe, 2, (x, gate, experts, placement))
        assert all(torch.equal(r, single) for r in results)


def test_stock_ep_partial_sums_differ():
    """Companion: stock EP (each rank sums its experts' weighted outputs, sends them in
    bf16, and the partials are all-reduced) depends on expert placement."""
    x, gate, experts = setup()
    _, contrib, _ = moe(x, gate, experts)
    ids = co.moe_route(x, gate, K)[0]

    def stock(placement):
        partials = [torch.where((torch.tensor(placement)[ids] == r)[..., None], contrib, 0).sum(1).bfloat16()
                    for r in (0, 1)]
        return partials[0] + partials[1]

    assert not torch.equal(stock([0] * 4 + [1] * 4), stock([0, 1] * 4))


def test_native_stack_equals_the_torch_path():
    """Stacked experts on CPU run as one native call (reference/moe.py _native); a mapping takes
    the batched torch path. Same bits: all experts, a rank's contiguous share, a token alone,
    an expert without tokens."""
    from consistent_ops.reference import moe as reference_moe, native
    x, gate, experts = setup()
    stack = co.ExpertStack(torch.stack([torch.cat(experts[e][:2]) for e in range(E)]),
                           torch.stack([experts[e][2] for e in range(E)]), list(range(E)))
    ids, w = co.moe_route(x, gate, K)
    ids[:, :] = torch.where(ids == 3, 4, ids)           # expert 3 gets no token
    for local in (None, [4, 5, 6, 7]):
        sub = stack if local is None else co.ExpertStack(stack.gate_up[4:], stack.down[4:], local)
        assert reference_moe._native(x, sub, local or list(range(E)), w) == (native.accumulation() != "fp64")
        c_native, o_native = co.moe_expert_contributions(x, ids, w, sub, local)
        c_torch, o_torch = co.moe_expert_contributions(x, ids, w, experts, local)
        assert torch.equal(o_native, o_torch) and torch.equal(c_native[o_native], c_torch[o_torch])
        one, o_one = co.moe_expert_contributions(x[7:8], ids[7:8], w[7:8], sub, local)
        assert torch.equal(o_one, o_native[7:8]) and torch.equal(one[o_one], c_native[7:8][o_one])


def test_experts_and_combine_in_one_call_equal_the_two_ops():
    """co.moe_experts (the rollout's experts and slot-ordered combine in one native call) gives the
    bits of moe_combine(moe_expert_contributions) on the torch path, top-2 and top-3, an expert
    without tokens, a token alone; a rank's share of the experts is not "every expert", and the fp64
    realisation has no such call: None."""
    from consistent_ops.reference import native
    x, gate, experts = setup()
    stack = co.ExpertStack(torch.stack([torch.cat(experts[e][:2]) for e in range(E)]),
                           torch.stack([experts[e][2] for e in range(E)]), list(range(E)))
    for k, dtype in ((2, torch.bfloat16), (3, torch.bfloat16), (3, torch.float32)):   # fp32: the slot order shows
        if dtype != x.dtype:
            x, gate, stack = x.to(dtype), gate.to(dtype), co.ExpertStack(stack.gate_up.to(dtype), stack.down.to(dtype),
                                                                         stack.local)
            experts = {e: tuple(t.to(dtype) for t in w) for e, w in experts.items()}
        ids, w = co.moe_route(x, gate, k)
        ids[:, :] = torch.where(ids == 3, 4, ids)           # expert 3 gets no token
        with torch.inference_mode():
            whole, one = co.moe_experts(x, ids, w, stack), co.moe_experts(x[7:8], ids[7:8], w[7:8], stack)
            ops = co.moe_combine(co.moe_expert_contributions(x, ids, w, experts)[0], x.dtype)
        if native.accumulation() == "fp64":
            assert whole is None and one is None
        else:
            assert torch.equal(whole, ops) and torch.equal(one, ops[7:8])
    assert co.moe_experts(x, ids, w, co.ExpertStack(stack.gate_up[4:], stack.down[4:], [4, 5, 6, 7])) is None
