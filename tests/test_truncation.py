"""The contract's truncation (top-k / top-p / min-p), reference backend: the vectorised op
equals the rule written out as a loop; ties go to the lower id; the top-p boundary is
"smallest prefix whose mass reaches p"; a row's result never depends on the other rows;
rows with every setting off come back unchanged; gradients flow through the kept set."""
import math
from fractions import Fraction

import pytest
import torch

import consistent_ops as co
from consistent_ops.contract import TRUNCATION_FIXED_BITS

NEG_INF = float("-inf")


def rows(n=6, v=97, seed=0):
    g = torch.Generator().manual_seed(seed)
    return co.log_softmax(torch.randn(n, v, generator=g) * 3, 0.7, v - 5)   # 5 padded ids: -inf


def spec_kept(lp_row, k, p, mp):
    """contract.COMMON["truncation"] as a plain loop over one row (Python ints and floats)."""
    v = len(lp_row)
    order = sorted(range(v), key=lambda i: (-lp_row[i], i))            # ties: lower id first
    prob = [float(torch.tensor(math.exp(lp_row[i]), dtype=torch.float32)) for i in order]
    q = [math.floor(Fraction(x) * 2 ** TRUNCATION_FIXED_BITS) for x in prob]
    n_k = k if 0 < k < v else v
    total, n_p, before = sum(q[:n_k]), 0, 0
    for r in range(n_k):
        if p < 1.0 and not float(before) < p * float(total):
            break
        n_p, before = n_p + 1, before + q[r]
    mp32 = torch.tensor(mp, dtype=torch.float32)
    thr = float(mp32 * torch.tensor(prob[0], dtype=torch.float32))
    n_m = sum(x >= thr for x in prob) if mp > 0 else v
    return set(order[:max(1, min(n_k, n_p, n_m))])


SETTINGS = [(5, 1.0, 0.0), (0, 0.9, 0.0), (0, 1.0, 0.1), (20, 0.9, 0.0), (20, 0.8, 0.05), (1, 1.0, 0.0),
            (0, 0.3, 0.0), (200, 0.95, 0.0)]


@pytest.mark.parametrize("k,p,mp", SETTINGS)
def test_op_equals_the_rule(k, p, mp):
    lp = rows()
    out = co.truncate_logprobs(lp, k, p, mp)
    for r in range(lp.shape[0]):
        kept = {i for i in range(lp.shape[1]) if out[r, i] > NEG_INF}
        assert kept == spec_kept(lp[r].tolist(), k, p, mp)
        ref = co.log_softmax(torch.where(out[r] > NEG_INF, lp[r], NEG_INF)[None], 1.0)[0]
        assert torch.equal(out[r], ref)                  # renormalised by the contract's log-softmax


def test_ties_go_to_the_lower_id():
    lp = co.log_softmax(torch.tensor([[0.0, 2.0, 1.0, 2.0, 2.0, 1.0]]))
    assert (co.truncate_logprobs(lp, 2) > NEG_INF).tolist() == [[False, True, False, True, False, False]]
    assert (co.truncate_logprobs(lp, 4) > NEG_INF).tolist() == [[False, True, True, True, True, False]]


def test_top_p_boundary_is_the_smallest_prefix_reaching_p():
    # probabilities 1/2, 1/4, 1/8, 1/8 exactly (exp of these fp32 log-probs rounds back to them)
    lp = torch.tensor([[math.log(0.25), math.log(0.5), math.log(0.125), math.log(0.125)]])
    assert torch.equal(lp.exp(), torch.tensor([[0.25, 0.5, 0.125, 0.125]]))
    kept = lambda p: (co.truncate_logprobs(lp, top_p=p) > NEG_INF).sum().item()   # noqa: E731
    assert [kept(0.5), kept(0.5000001), kept(0.75), kept(0.7500001), kept(0.875), kept(0.9)] == [1, 2, 2, 3, 3, 4]
    # top-p of the top-k mass: within the top 2 (3/4 of the mass), 0.6 of it is 0.45 < 1/2
    assert (co.truncate_logprobs(lp, 2, 0.6) > NEG_INF).sum().item() == 1
    assert (co.truncate_logprobs(lp, 2, 0.7) > NEG_INF).sum().item() == 2


def test_row_alone_equals_row_in_batch_with_mixed_settings():
    lp = rows(n=8)
    k = torch.tensor([0, 5, 20, 0, 1, 0, 3, 0])
    p = torch.tensor([1.0, 1.0, 0.9, 0.8, 1.0, 0.95, 0.5, 1.0], dtype=torch.float64)
    mp = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 0.05, 0.0, 0.0])
    batch = co.truncate_logprobs(lp, k, p, mp)
    for r in range(8):
        alone = co.truncate_logprobs(lp[r:r + 1], int(k[r]), float(p[r]), float(mp[r]))
        assert torch.equal(batch[r:r + 1], alone)
    assert torch.equal(batch[[0, 7]], lp[[0, 7]])        # every setting off: unchanged bits
    assert not torch.equal(batch[3], lp[3])              # a truncating row: renormalised


def test_gradient_is_that_of_the_renormalised_kept_set():
    z = (torch.randn(3, 40, generator=torch.Generator().manual_seed(1)) * 2).requires_grad_()
    out = co.truncate_logprobs(co.log_softmax(z, 1.0), 10, 0.9)
    keep = out.detach() > NEG_INF
    ids = torch.stack([torch.nonzero(keep[r])[0, 0] for r in range(3)])   # a kept token per row
    out.gather(1, ids[:, None]).sum().backward()
    p = torch.where(keep, out.detach(), NEG_INF).exp()
    expect = torch.nn.functional.one_hot(ids, 40).float() - p
    assert torch.allclose(z.grad, expect, atol=1e-6)     # dropped tokens: ~0 (exactly 0 in exact math)
