"""Trainer side of ``true_on_policy.check``: recompute the rollout's tokens' log-probs.

Runs in the check's own process, never in vLLM's, on the rollout's device: the one its
consistent_ops backend computes on (triton: CUDA, ascend: NPU, reference: CPU), for --stock
too. The consistent path is what the verl actor computes: ConsistentForCausalLM over packed
sequences (TP emulated with the rollout's size), then ``consistent_ops.token_logprobs`` with
the rollout temperature and vocab_limit = len(tokenizer). The stock path is a plain HF forward
and ``log_softmax(logits / T)``; it keeps the whole (padded) vocabulary, as stock vLLM samples
from it too, and scores the untruncated distribution, as a stock trainer does even when the
rollout truncates (top-k/top-p/min-p).
"""
import sys

import torch

import consistent_ops as co
from true_on_policy.models import ConsistentForCausalLM

PACK_TOKENS = 8192   # tokens per packed forward


def _packs(sequences):
    pack, n = [], 0
    for i, s in enumerate(sequences):
        length = len(s["prompt"]) + len(s["output"])
        if pack and n + length > PACK_TOKENS:
            yield pack
            pack, n = [], 0
        pack.append(i)
        n += length
    if pack:
        yield pack


def _gen_rows(lens_prompt, lens_out, offsets):
    """Row indices of the logits that predict each generated token."""
    return torch.cat([torch.arange(o + p - 1, o + p - 1 + n) for p, n, o in zip(lens_prompt, lens_out, offsets)])


def consistent_logprobs(model_dir, sequences, temperature, tp, vocab_limit, dtype=None, truncation=None):
    """fp32 log-prob of every generated token, per sequence. ``dtype``: the compute dtype
    of the rollout (scheme.ROLLOUT_DTYPE: checkpoints and fp32 pushes are rounded to it on
    both sides); ``truncation``: the rollout's (top_k, top_p, min_p), applied by the contract
    as the rollout did."""
    dev = co.backend_device()
    model = ConsistentForCausalLM.from_pretrained(model_dir, tp_size=tp, dtype=dtype, device=dev).eval()
    out = [None] * len(sequences)
    for pack in _packs(sequences):
        seqs = [sequences[i] for i in pack]
        ids = torch.tensor([t for s in seqs for t in s["prompt"] + s["output"]], device=dev)
        lens = [len(s["prompt"]) + len(s["output"]) for s in seqs]
        pos = torch.cat([torch.arange(n) for n in lens]).to(dev)
        with torch.no_grad():
            logits = model.forward_packed(ids, pos)
        offsets = torch.tensor([0] + lens[:-1]).cumsum(0).tolist()
        rows = _gen_rows([len(s["prompt"]) for s in seqs], [len(s["output"]) for s in seqs], offsets)
        targets = torch.tensor([t for s in seqs for t in s["output"]], device=dev)
        lp = co.token_logprobs(logits[rows.to(dev)], targets, temperature, vocab_limit, truncation).cpu()
        for i, part in zip(pack, lp.split([len(s["output"]) for s in seqs])):
            out[i] = part
    return out


def load_hf(model_dir):
    _hide_broken_torchvision()
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(model_dir).to(co.backend_device()).eval()


def stock_logprobs(model_dir, sequences, temperature):
    """fp32 log-prob of every generated token from a stock HF forward (one sequence at a time)."""
    model, out, dev = load_hf(model_dir), [], co.backend_device()
    for s in sequences:
        ids = torch.tensor([s["prompt"] + s["output"]], device=dev)
        with torch.no_grad():
            logits = model(ids).logits[0].float()
        rows = torch.arange(len(s["prompt"]) - 1, ids.shape[1] - 1, device=dev)
        lp = torch.log_softmax(logits[rows] / temperature, dim=-1)
        out.append(lp.gather(-1, torch.tensor(s["output"], device=dev)[:, None])[:, 0].cpu())
    return out


def capture(model_dir, tokens, tp, stock, dtype=None):
    """Per-op activations of one full sequence: {op: (positions, rows)}."""
    from true_on_policy.check.capture import Capture
    dev = co.backend_device()
    model = load_hf(model_dir) if stock else ConsistentForCausalLM.from_pretrained(
        model_dir, tp_size=tp, dtype=dtype, device=dev).eval()
    cap = Capture(model)
    ids = torch.tensor(tokens, device=dev)
    with torch.no_grad():
        if stock:
            model(ids[None])
        else:
            model.forward_packed(ids, torch.arange(len(tokens), device=dev))
    return cap.stop(positions=torch.arange(len(tokens)))


def _hide_broken_torchvision():
    """transformers imports torchvision when installed; a wheel built for another torch
    breaks that import. Nothing here needs vision ops: make it look absent."""
    try:
        import torchvision  # noqa: F401
    except Exception:
        for name in [m for m in sys.modules if m.split(".")[0] == "torchvision"]:
            del sys.modules[name]
        sys.modules["torchvision"] = None
