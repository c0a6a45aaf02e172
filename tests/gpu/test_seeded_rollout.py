"""Seeded draws on the GPU (README "Reproducible runs"): two rollouts of the same requests, each
decode step's forward AND draw replayed from CUDA graphs, give identical tokens although they
batch the sequences differently (all together vs two groups, other page orders); another run seed
gives other tokens. The noise itself is the same bits on the GPU as on the CPU."""
import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("triton")

import consistent_ops as co  # noqa: E402
from harness import GraphRunner, ModelRunner, build_model  # noqa: E402
from true_on_policy import seeded_draw  # noqa: E402

co.set_backend("triton")
DEV, TEMP, VLIM, ROWS = "cuda", 0.7, 151643, 8
LENS = [37, 120, 5, 64, 91]
NEW = 12


@pytest.fixture(scope="module")
def model():
    return build_model(layers=2)


class SampleGraph:
    """The sampler's work in one graph: contract log-probs at per-row T, seeded pin, argmax
    (what the engine does after the processor at temperature 0); rows padded to ROWS."""

    def __init__(self, vocab):
        z = dict(device=DEV)
        self.logits, self.temps = torch.zeros(ROWS, vocab, **z), torch.ones(ROWS, **z)
        self.keys = torch.zeros(ROWS, 5, dtype=torch.long, **z)
        self.pos, self.seeded = torch.zeros(ROWS, dtype=torch.long, **z), torch.ones(ROWS, dtype=torch.bool, **z)
        self._run()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.out = self._run()

    def _run(self):
        logp = co.log_softmax(self.logits, self.temps, VLIM)
        return seeded_draw.pin(logp, self.keys, self.pos, self.seeded).argmax(1)

    def draw(self, logits, keys, pos):
        n = len(logits)
        self.logits.zero_()[:n] = logits
        self.keys.zero_()[:n] = keys
        self.pos.zero_()[:n] = pos
        self.temps.fill_(TEMP)
        self.graph.replay()
        return self.out[:n].clone()


@torch.no_grad()
def rollout(model, seed, groups, page_seed):
    g = torch.Generator(device=DEV).manual_seed(5)
    prompts = [torch.randint(0, VLIM, (n,), generator=g, device=DEV) for n in LENS]
    runner = ModelRunner(model, seed=page_seed)
    graphs, sampler = GraphRunner(runner, sizes=(1, 2, 4, 8), max_reqs=8, last_only=True), SampleGraph(
        model.cfg.vocab_size)
    keys = torch.tensor([[seed, 1, s, 0, 0] for s in range(len(LENS))], device=DEV)
    logits = runner.step([(s, p) for s, p in enumerate(prompts)])
    last = torch.stack([logits[n - 1] for n in torch.tensor(LENS).cumsum(0).tolist()])
    lens = torch.tensor(LENS, device=DEV)
    out = [sampler.draw(last, keys, lens)]
    for _ in range(NEW - 1):
        nxt = torch.empty(len(LENS), dtype=torch.long, device=DEV)
        for members in groups:
            rows = torch.tensor(members, device=DEV)
            got = graphs.step([(s, out[-1][s:s + 1]) for s in members])
            lens[rows] += 1
            nxt[rows] = sampler.draw(got, keys[rows], lens[rows])
        out.append(nxt)
    return torch.stack(out, 1)


def test_graph_replayed_rollouts_draw_identical_tokens(model):
    together = rollout(model, 1, [[0, 1, 2, 3, 4]], page_seed=1)
    split = rollout(model, 1, [[3, 1], [4, 0, 2]], page_seed=2)
    assert torch.equal(together, split)
    assert not torch.equal(together, rollout(model, 2, [[0, 1, 2, 3, 4]], page_seed=1))


def test_noise_is_the_same_bits_on_gpu_and_cpu():
    keys = torch.tensor([[7, 3, i, i % 3, 0] for i in range(6)])
    pos = torch.arange(6) * 97 + 1
    assert torch.equal(seeded_draw.gumbel(keys, pos, 4096), seeded_draw.gumbel(keys.to(DEV), pos.to(DEV), 4096).cpu())
