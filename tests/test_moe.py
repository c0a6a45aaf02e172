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


def _route_spec(logits, k, norm):
    """The fp32/bf16 realisations' router rule in torch steps: exp in fp64 (on these inputs the same
    values as the native polynomial), sums in fp64 in expert / slot order, a stable descending sort."""
    p = torch.exp((logits - logits.amax(-1, keepdim=True)).double()).float()
    s = torch.zeros(len(p), dtype=torch.float64)
    for e in range(p.shape[1]):
        s = s + p[:, e].double()
    prob = p / s.float()[:, None]
    ids = torch.sort(prob, dim=-1, descending=True, stable=True).indices[:, :k]
    w = torch.gather(prob, 1, ids)
    if norm:
        sw = torch.zeros(len(w), dtype=torch.float64)
        for j in range(k):
            sw = sw + w[:, j].double()
        w = w / sw.float()[:, None]
    return ids, w


def test_native_router_is_its_rule_trainer_and_rollout_alike(monkeypatch):
    """The fp32/bf16 realisations' router (one native call: softmax by the attention's exp, fp64 sums
    in order, stable top-k, renormalisation; the linear too without autograd) == its rule written in
    torch steps, with NaN, -inf and tied logits; the trainer's (autograd) call == the rollout's, and
    its gradient is the torch steps' rule. Companion: stock's fp32 softmax gives other weights."""
    from consistent_ops.contract import CPU_ACCUMULATION_ENV
    from consistent_ops.reference import moe as rmoe
    g = torch.Generator().manual_seed(7)
    for name in ("fp32", "bf16"):
        monkeypatch.setenv(CPU_ACCUMULATION_ENV, name)
        for e, k, h, scale in ((8, 2, 64, 1.0), (128, 8, 96, 4.0), (6, 6, 32, 1.0)):
            x = torch.randn(200, h, generator=g).bfloat16()
            gate = (scale * torch.randn(e, h, generator=g)).bfloat16()
            x[3] = 0.0                                       # every logit 0: all tied
            for norm in (True, False):
                with torch.inference_mode():
                    ids, w = co.moe_route(x, gate, k, norm)
                logits = co.linear(x, gate, out_dtype=torch.float32)
                want = _route_spec(logits, k, norm)
                assert torch.equal(ids, want[0]) and torch.equal(w, want[1])
                assert ids[3].tolist() == list(range(k))
                lg = logits.clone().requires_grad_()
                tids, tw = rmoe._NativeRoute.apply(lg, k, norm)
                assert torch.equal(tids, ids) and torch.equal(tw, w)
                grad = torch.autograd.grad((tw * torch.arange(k)).sum(), lg)[0]
                ref = lg.detach().clone().requires_grad_()
                rw = rmoe._route_torch(ref, k, norm, tids)[1]
                assert torch.allclose(grad, torch.autograd.grad((rw * torch.arange(k)).sum(), ref)[0], atol=1e-6)
                stock = torch.softmax(logits, -1).topk(k, -1).values
                assert not torch.equal(stock / stock.sum(-1, keepdim=True) if norm else stock, w)
    odd = torch.tensor([[1.0, float("nan"), 3.0, float("nan")], [2.0, 2.0, float("-inf"), 2.0],
                        [float("-inf")] * 4, [0.5, 0.25, 0.5, -1.0]])
    got = rmoe.native.moe_route(odd, 3, True)
    want = _route_spec(odd, 3, True)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1].isnan(), want[1].isnan())
    assert torch.equal(got[1].nan_to_num(), want[1].nan_to_num())
    assert got[0][1].tolist() == [0, 1, 3] and got[0][3].tolist() == [0, 2, 1]
