"""Log-probs with temperature and the padded-vocabulary rule.

On CPU in the fp32/bf16 realisations the row's steps are one native call (native.log_softmax: exp by
the attention's polynomial, the sum in fixed fp64 lanes: contract.CPU_ACCUMULATION "logprobs"), with
or without autograd (a backward through the torch steps), so the trainer and the rollout share it:
the torch steps' fp64 exp on one thread took ~120 us of a decode step's 32 x 1k rows. Elsewhere (and
in the fp64 realisation) the torch steps below."""
import torch

from . import native
from .core import recording, steps_backward

NEG_INF = float("-inf")


def _temperature_column(temperature, logits):
    """Temperature as an fp32 tensor [rows, 1] (one per row, as vLLM's sampler holds it):
    z = logits / T is one IEEE division, never a multiplication by 1/T (rounds differently).
    A Python number becomes a device fill, not a host-to-device copy (CUDA-graph capturable)."""
    if not isinstance(temperature, torch.Tensor):
        return torch.full((1, 1), float(temperature), dtype=torch.float32, device=logits.device)
    t = temperature.to(device=logits.device, dtype=torch.float32)
    return t.reshape(-1, 1) if t.ndim else t.reshape(1, 1)


def log_softmax(logits, temperature=1.0, vocab_limit=None):
    """fp32 log-probs [rows, V] of logits [rows, V]; rows >= vocab_limit are excluded (-inf)."""
    t = _temperature_column(temperature, logits)
    rows = logits.reshape(-1, logits.shape[-1]) if logits.dim() else logits
    if (logits.is_cpu and logits.dim() and t.shape[0] in (1, rows.shape[0]) and native.accumulation() != "fp64"):
        limit = logits.shape[-1] if vocab_limit is None else min(vocab_limit, logits.shape[-1])
        if recording(logits, t):
            return _NativeLogSoftmax.apply(rows, t, limit).view(logits.shape)
        return native.log_softmax(rows.float(), t, limit).view(logits.shape)
    return _log_softmax_torch(logits, t, vocab_limit)


def _log_softmax_torch(logits, t, vocab_limit):
    z = logits.float() / t
    if vocab_limit is not None and vocab_limit < z.shape[-1]:
        z = z.masked_fill(torch.arange(z.shape[-1], device=z.device) >= vocab_limit, NEG_INF)
    zs = z - z.amax(-1, keepdim=True)
    # exp in place on the fp64 copy (zs is fp32, so .double() is a fresh tensor): the same kernel and bits
    # without a second [rows, V] fp64 buffer (~15 us a decode step of 32 x 1k)
    lse = torch.log(zs.double().exp_().sum(-1, keepdim=True)).float()
    return zs - lse


class _NativeLogSoftmax(torch.autograd.Function):
    """Forward: native.log_softmax; backward: autograd through the torch steps (their exp and sum
    differ from the native ones in rare last bits, not in the rule), as _NativeRoute does."""

    @staticmethod
    def forward(ctx, logits, t, limit):
        ctx.save_for_backward(logits, t)
        ctx.limit = limit
        return native.log_softmax(logits.detach().float(), t.detach(), limit)

    @staticmethod
    def backward(ctx, grad):
        logits, t = ctx.saved_tensors
        return steps_backward(lambda z, t: _log_softmax_torch(z, t, ctx.limit), (logits, t), ctx.needs_input_grad[:2],
                              grad) + (None,)


def token_logprobs(logits, token_ids, temperature=1.0, vocab_limit=None):
    """fp32 log-prob [rows] of token_ids [rows] under log_softmax(logits, ...)."""
    lp = log_softmax(logits, temperature, vocab_limit)
    return torch.gather(lp, -1, token_ids.long().reshape(-1, 1)).reshape(-1)
