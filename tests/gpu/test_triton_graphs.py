"""The rollout forward captured in CUDA graphs (Triton backend), as vLLM's runner does it:
a graph replay gives the same logits and log-probs, bit for bit, as eager decode and as
the trainer's packed forward, across steps whose block tables, sequence lengths and batch
composition change, at real batches padded up to each capture size (padding tokens with
slot -1, padding requests with no tokens)."""
import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("triton")

import consistent_ops as co  # noqa: E402
from consistent_ops.triton import common  # noqa: E402
from harness import GraphRunner, ModelRunner, build_model  # noqa: E402

co.set_backend("triton")
DEV, TEMP, VLIM = "cuda", 0.7, 151643
LENS = [300, 517, 64, 200, 129]
DECODE = 16                                         # the last DECODE tokens of each sequence are decoded


@pytest.fixture(scope="module")
def model():
    return build_model(layers=4)


@pytest.fixture(scope="module")
def tokens():
    g = torch.Generator(device=DEV).manual_seed(3)
    return [torch.randint(0, VLIM, (n,), generator=g, device=DEV) for n in LENS]


@pytest.fixture(scope="module")
def train_logits(model, tokens):
    ids = torch.cat(tokens)
    pos = torch.cat([torch.arange(n, device=DEV) for n in LENS])
    with torch.no_grad():
        return list(model.forward_packed(ids, pos).split(LENS))


def schedule():
    """Decode steps [(seq, position)]: the batch shrinks, grows and crosses capture sizes."""
    steps, nxt = [], {s: n - DECODE for s, n in enumerate(LENS)}
    for members in [[0, 1, 2]] * 5 + [[0, 2]] * 3 + [[1]] * 2 + [[0, 1, 2, 3, 4]] * DECODE:
        live = [s for s in members if nxt[s] < LENS[s]]
        if live:
            steps.append([(s, nxt[s]) for s in live])
        for s in live:
            nxt[s] += 1
    return steps


def test_graph_replays_equal_eager_and_trainer(model, tokens, train_logits):
    graphed, eager = ModelRunner(model, seed=1), ModelRunner(model, seed=2)   # other page orders
    prefill = [(s, tokens[s][:n - DECODE]) for s, n in enumerate(LENS)]
    graphed.step(prefill)
    eager.step(prefill)
    graphs = GraphRunner(graphed, sizes=(1, 4, 8))
    checked = 0
    for step in schedule():
        batch = [(s, tokens[s][p:p + 1]) for s, p in step]
        got, ref = graphs.step(batch), eager.step(batch)
        assert torch.equal(got, ref), f"graph replay != eager at {step}"
        train = torch.stack([train_logits[s][p] for s, p in step])
        assert torch.equal(got, train), f"graph replay != trainer at {step}"
        inner = [(i, s, p) for i, (s, p) in enumerate(step) if p + 1 < LENS[s]]
        if inner:
            rows = torch.tensor([i for i, _, _ in inner], device=DEV)
            nxt = torch.stack([tokens[s][p + 1] for _, s, p in inner])
            assert torch.equal(co.token_logprobs(got[rows], nxt, TEMP, VLIM),
                               co.token_logprobs(train[rows], nxt, TEMP, VLIM))
        checked += len(step)
    assert checked == DECODE * len(LENS)            # every decoded token, through graphs of sizes 1, 4 and 8


def test_programmatic_launch_keeps_the_bits(model, tokens, monkeypatch):
    """Programmatic dependent launch (common.PDL, on by default on sm_90+) moves when a kernel's
    programs start, not what they read: graph replays captured with it and without it give the same
    logits, bit for bit, step by step."""
    if not common.hopper_or_newer(tokens[0].device.index):
        pytest.skip("programmatic dependent launch needs sm_90+")
    prefill = [(s, tokens[s][:n - DECODE]) for s, n in enumerate(LENS)]
    runs = []
    for pdl in (True, False):
        monkeypatch.setattr(common, "PDL", pdl)
        runner = ModelRunner(model, seed=5)
        runner.step(prefill)
        graphs = GraphRunner(runner, sizes=(1, 4, 8))
        runs.append([graphs.step([(s, tokens[s][p:p + 1]) for s, p in step]) for step in schedule()])
    for step, with_pdl, without in zip(schedule(), *runs):
        assert torch.equal(with_pdl, without), f"PDL on != off at {step}"


def test_mixed_batch_graph_replays_equal_eager_and_trainer(model, tokens, train_logits):
    """FULL graphs of mixed batches (what ALWAYS lets vLLM capture): every step mixes prefill
    chunks of changing lengths with decodes, padded up to a token capture size with padding
    requests; every token equals eager and the trainer bit for bit."""
    graphed, eager = ModelRunner(model, seed=3), ModelRunner(model, seed=4)
    graphs = GraphRunner(graphed, sizes=(16, 64, 160), max_reqs=8)
    g = torch.Generator().manual_seed(11)
    done, checked, sizes_used = [0] * len(LENS), 0, set()
    while any(d < n for d, n in zip(done, LENS)):
        batch = []
        for s, n in enumerate(LENS):
            if done[s] < n and torch.rand((), generator=g) < 0.8:
                take = 1 if torch.rand((), generator=g) < 0.4 else int(torch.randint(2, 33, (), generator=g))
                batch.append((s, tokens[s][done[s]:min(done[s] + take, n)]))
        if not batch:
            continue
        got, ref = graphs.step(batch), eager.step(batch)
        sizes_used.add(min(b for b in graphs.graphs if b >= sum(len(t) for _, t in batch)))
        assert torch.equal(got, ref), f"mixed graph replay != eager at {[(s, len(t)) for s, t in batch]}"
        for (s, t), rows in zip(batch, got.split([len(t) for _, t in batch])):
            assert torch.equal(rows, train_logits[s][done[s]:done[s] + len(t)]), f"graph != trainer, seq {s}"
            done[s] += len(t)
            checked += len(t)
    assert checked == sum(LENS) and sizes_used == {16, 64, 160}


@torch.no_grad()
def test_logprobs_capture_with_per_row_temperatures():
    """The contract's log-probs (vLLM computes them after the forward) capture too: per-row
    fp32 temperatures in a persistent buffer; replays with new logits, tokens and
    temperatures equal eager calls bit for bit."""
    g = torch.Generator(device=DEV).manual_seed(9)
    logits = torch.empty(8, 151936, device=DEV)
    toks = torch.zeros(8, dtype=torch.long, device=DEV)
    temps = torch.ones(8, device=DEV)

    def run():
        return co.log_softmax(logits, temps, VLIM), co.token_logprobs(logits, toks, temps, VLIM)

    run()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    for _ in range(3):
        logits.copy_(torch.randn(logits.shape, generator=g, device=DEV) * 4)
        toks.copy_(torch.randint(0, VLIM, (8,), generator=g, device=DEV))
        temps.copy_(torch.rand(8, generator=g, device=DEV) + 0.3)
        graph.replay()
        for got, ref in zip(out, run()):
            assert torch.equal(got, ref)
