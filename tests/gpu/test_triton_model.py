"""End to end on the GPU: a 4-layer Qwen3-30B-A3B-shaped MoE (random weights) gives the
same logits and log-probs, bit for bit, whether a token is trained (packed varlen),
prefilled, chunk-prefilled, decoded or in a mixed batch; a stock HF model does not."""
import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("triton")

import consistent_ops as co  # noqa: E402
from harness import ModelRunner, build_hf_model, build_model  # noqa: E402
from true_on_policy.models.qwen3 import fuse  # noqa: E402

co.set_backend("triton")
DEV = "cuda"
LENS = [900, 1537, 70]
TEMP = 0.7


@pytest.fixture(scope="module")
def model():
    return build_model(layers=4)


@pytest.fixture(scope="module")
def tokens():
    g = torch.Generator(device=DEV).manual_seed(1)
    return [torch.randint(0, 151643, (n,), generator=g, device=DEV) for n in LENS]


@pytest.fixture(scope="module")
def train_logits(model, tokens):
    """Trainer view: one packed varlen batch (cu_seqlens), as the actor computes it."""
    ids = torch.cat(tokens)
    pos = torch.cat([torch.arange(n, device=DEV) for n in LENS])
    with torch.no_grad():
        logits = model.forward_packed(ids, pos)
    return list(logits.split(LENS))


def run(model, tokens, schedule):
    """schedule: list of steps, each [(seq, lo, hi)]. Returns per-seq logits [n, V]."""
    runner, got = ModelRunner(model, page_size=16), [dict() for _ in LENS]
    for batch in schedule:
        logits = runner.step([(s, tokens[s][lo:hi]) for s, lo, hi in batch])
        for (s, lo, hi), part in zip(batch, logits.split([hi - lo for _, lo, hi in batch])):
            got[s].update(zip(range(lo, hi), part))
    return got


def assert_equal_rows(got, train_logits, tokens):
    for s, rows in enumerate(got):
        idx = sorted(rows)
        mine = torch.stack([rows[i] for i in idx])
        ref = train_logits[s][torch.tensor(idx, device=DEV)]
        assert torch.equal(mine, ref), f"seq {s}: logits differ"
        nxt = [i for i in idx if i + 1 < LENS[s]]   # the contract's log-probs, temperature applied
        t = torch.tensor(nxt, device=DEV)
        lp = co.token_logprobs(torch.stack([rows[i] for i in nxt]), tokens[s][t + 1], TEMP, 151643)
        assert torch.equal(lp, co.token_logprobs(train_logits[s][t], tokens[s][t + 1], TEMP, 151643))


def test_autograd_forward_equals_no_grad(model, tokens, train_logits):
    """The actor runs with autograd on (custom Functions save for backward): same bits."""
    ids = torch.cat(tokens)
    pos = torch.cat([torch.arange(n, device=DEV) for n in LENS])
    logits = model.forward_packed(ids, pos)
    assert logits.requires_grad
    assert torch.equal(logits.detach(), torch.cat(train_logits))


def test_prefill_equals_train(model, tokens, train_logits):
    assert_equal_rows(run(model, tokens, [[(s, 0, n) for s, n in enumerate(LENS)]]), train_logits, tokens)


def test_chunked_prefill_equals_train(model, tokens, train_logits):
    sched = [[(0, 0, 256), (1, 0, 100)], [(1, 100, 700), (2, 0, 70)], [(0, 256, 900), (1, 700, 1537)]]
    assert_equal_rows(run(model, tokens, sched), train_logits, tokens)


def test_decode_equals_train(model, tokens, train_logits):
    """Prefill all but 12 tokens, then 12 pure-decode steps of all three sequences."""
    sched = [[(s, 0, n - 12) for s, n in enumerate(LENS)]]
    sched += [[(s, n - 12 + i, n - 11 + i) for s, n in enumerate(LENS)] for i in range(12)]
    got = run(model, tokens, sched)
    assert_equal_rows([{i: r[i] for i in range(n - 12, n)} for r, n in zip(got, LENS)], train_logits, tokens)


def test_mixed_batches_equal_train(model, tokens, train_logits):
    """Decodes of one sequence ride in the same steps as prefill chunks of the others."""
    a, b, c = LENS
    sched = [[(0, 0, a - 4), (2, 0, 33)]]
    sched += [[(0, a - 4 + i, a - 3 + i), (1, i * 400, min((i + 1) * 400, b)), (2, 33 + i, 34 + i)]
              for i in range(4)]
    got = run(model, tokens, sched)
    keep = [{i: got[0][i] for i in range(a - 4, a)}, got[1], {i: got[2][i] for i in range(33, 37)}]
    assert_equal_rows(keep, train_logits, tokens)


def test_fused_prologue_equals_separate_ops(tokens, monkeypatch):
    """The rollout's modules as vLLM's model class fuses them (q/k/v in one GEMM, then q/k norms, RoPE
    and v's copy in one launch): the logits of the separate norm and RoPE launches, prefill and decode."""
    model = build_model(layers=2)
    fuse(model)
    real, hits = co.qk_norm_rope, []

    def counted(*args, **kw):
        out = real(*args, **kw)
        hits.append(out is not None)
        return out

    sched = [[(s, 0, n - 3) for s, n in enumerate(LENS)]]
    sched += [[(s, n - 3 + i, n - 2 + i) for s, n in enumerate(LENS)] for i in range(3)]
    monkeypatch.setattr(co, "qk_norm_rope", counted)
    fused = run(model, tokens, sched)
    assert hits and all(hits)
    monkeypatch.setattr(co, "qk_norm_rope", lambda *args, **kw: None)
    separate = run(model, tokens, sched)
    for f, s in zip(fused, separate):
        assert sorted(f) == sorted(s) and all(torch.equal(f[i], s[i]) for i in f)
    del model, fused, separate
    torch.cuda.empty_cache()


@torch.no_grad()
def test_stock_hf_full_forward_and_decode_differ():
    """Non-vacuous: HF eager-style KV-cache decode vs HF full forward, same model."""
    hf = build_hf_model(layers=4, attn="sdpa")
    g = torch.Generator(device=DEV).manual_seed(2)
    ids = torch.randint(0, 151643, (1, 320), generator=g, device=DEV)
    full = torch.log_softmax(hf(ids).logits.float(), -1)
    out = hf(ids[:, :256], use_cache=True)
    cache, steps = out.past_key_values, []
    for t in range(256, 320):
        out = hf(ids[:, t:t + 1], past_key_values=cache, use_cache=True)
        cache = out.past_key_values
        steps.append(torch.log_softmax(out.logits[:, -1].float(), -1))
    decoded = torch.stack(steps, 1)
    assert not torch.equal(decoded, full[:, 256:320])
    del hf
    torch.cuda.empty_cache()
