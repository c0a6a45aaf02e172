"""Seeded draws (seeded_draw.py): a row's token is a function of its key, position and log-probs only."""
import torch

from true_on_policy import seeded_draw as sd
from helpers import chi_square_p

V = 50


def _batch(n, seed=7):
    g = torch.Generator().manual_seed(0)
    logp = torch.log_softmax(torch.randn(n, V, generator=g) * 2, dim=1)
    keys = torch.tensor([[seed, 3, i // 4, i % 4, 0] for i in range(n)])
    return logp, keys, torch.arange(n) + 10


def test_a_row_draws_the_same_token_alone_in_any_batch_and_order():
    logp, keys, pos = _batch(64)
    together = sd.draw(logp, keys, pos)
    alone = torch.cat([sd.draw(logp[i:i + 1], keys[i:i + 1], pos[i:i + 1]) for i in range(64)])
    perm = torch.randperm(64, generator=torch.Generator().manual_seed(1))
    shuffled = torch.empty_like(together)
    shuffled[perm] = sd.draw(logp[perm], keys[perm], pos[perm])
    assert torch.equal(together, alone) and torch.equal(together, shuffled)
    noise = sd.gumbel(keys, pos, V)
    assert torch.equal(noise[5:6], sd.gumbel(keys[5:6], pos[5:6], V))


def test_another_key_or_position_draws_other_tokens():
    logp, keys, pos = _batch(64)
    base = sd.draw(logp, keys, pos)
    assert not torch.equal(base, sd.draw(logp, _batch(64, seed=8)[1], pos))
    assert not torch.equal(base, sd.draw(logp, keys, pos + 1))


def test_draws_follow_the_distribution():
    """3,000 samples (sample index varies) of one row: chi-square accepts softmax(logp), rejects
    a mildly tempered one; -inf entries are never drawn."""
    logp = torch.log_softmax(torch.randn(1, V, generator=torch.Generator().manual_seed(2)), dim=1)
    logp[0, :5] = float("-inf")
    n = 3000
    keys = torch.tensor([[1, 2, 3, i, 0] for i in range(n)])
    tokens = sd.draw(logp.expand(n, V), keys, torch.full((n,), 17))
    counts = torch.bincount(tokens, minlength=V).double()
    assert counts[:5].sum() == 0
    p = logp[0, 5:].double().exp()
    assert chi_square_p(counts[5:], n * p) > 1e-3
    assert chi_square_p(counts[5:], n * torch.softmax(logp[0, 5:].double() * 0.7, 0)) < 1e-6


def test_pin_keeps_the_drawn_log_prob_and_leaves_unseeded_rows():
    logp, keys, pos = _batch(8)
    seeded = torch.tensor([True, False] * 4)
    out = sd.pin(logp, keys, pos, seeded)
    tokens = sd.draw(logp, keys, pos)
    assert torch.equal(out[~seeded], logp[~seeded])
    assert torch.equal(out[seeded].argmax(1), tokens[seeded])
    assert torch.equal(out[seeded].gather(1, tokens[seeded, None]), logp[seeded].gather(1, tokens[seeded, None]))
    assert (out[seeded] == float("-inf")).sum() == 4 * (V - 1)
