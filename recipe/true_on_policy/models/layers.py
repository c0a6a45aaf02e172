"""Parameter-holding building blocks over consistent_ops, in vLLM's vocabulary.

A module holds either the full weight (trainer; TP, if any, is emulated in one
process) or its rank's shard (rollout rank in a real group). Parameter names are
the HF checkpoint names on both sides, and ``weight_loader`` takes the FULL HF
tensor and keeps this rank's part, so one name map serves both engines.
"""
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

import consistent_ops as co
from consistent_ops import parallel


@dataclass(frozen=True)
class TensorParallel:
    size: int = 1
    rank: int = 0
    group: Any = None            # None: every shard lives in this process (emulation)

    @property
    def sharded(self) -> bool:
        return self.group is not None and self.size > 1


def _check_divisible(what, n, size):
    if n % size:
        raise ValueError(f"{what}={n} is not divisible by tensor_parallel_size={size}; "
                         f"choose a TP size that divides it")


def _write(param, value):
    """In-place weight update that bumps the version counter (``param.data.copy_`` would
    not): the reference backend keeps fp64 copies of rollout weights per version."""
    with torch.no_grad():
        param.copy_(value)


class _Linear(nn.Module):
    def __init__(self, in_features, out_features, bias, dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype)) if bias else None

    def weight_loader(self, param, full):
        _write(param, full)


class ReplicatedLinear(_Linear):
    def __init__(self, in_features, out_features, bias=False, dtype=torch.bfloat16, out_dtype=None):
        super().__init__(in_features, out_features, bias, dtype)
        self.out_dtype = out_dtype

    def forward(self, x):
        return co.linear(x, self.weight.to(x.dtype), self.bias, self.out_dtype)


class ColumnParallelLinear(_Linear):
    """Output features split over ranks: every output is one whole dot product, so a
    shard computes exactly the bits the full layer would (no reduction involved)."""

    def __init__(self, in_features, out_features, tp, bias=False, dtype=torch.bfloat16, out_dtype=None):
        _check_divisible("output features", out_features, tp.size)
        super().__init__(in_features, out_features // tp.size if tp.sharded else out_features, bias, dtype)
        self.tp, self.out_dtype = tp, out_dtype

    def forward(self, x):
        return co.linear(x, self.weight.to(x.dtype), self.bias, self.out_dtype)

    def weight_loader(self, param, full):
        _write(param, full.chunk(self.tp.size, 0)[self.tp.rank] if self.tp.sharded else full)


class RowParallelLinear(_Linear):
    """Input features split over ranks: partials summed in rank order by the contract
    (emulated when unsharded, gathered when sharded: the same bits either way)."""

    def __init__(self, in_features, out_features, tp, bias=False, dtype=torch.bfloat16):
        _check_divisible("input features", in_features, tp.size)
        super().__init__(in_features // tp.size if tp.sharded else in_features, out_features, bias, dtype)
        self.tp = tp

    def forward(self, x):
        w = self.weight.to(x.dtype)
        if self.tp.sharded:
            total = parallel.gather_ordered_sum(co.row_parallel_partial(x, w), self.tp.group)
        elif self.tp.size == 1:   # one shard: its partial rounded once is a plain linear
            return co.linear(x, w, self.bias)
        else:
            return co.row_parallel_linear(x, w, self.tp.size, self.bias)
        return co.finish_row_parallel(total, self.bias, x.dtype)

    def weight_loader(self, param, full):
        if param is self.bias or not self.tp.sharded:
            _write(param, full)
        else:
            _write(param, full.chunk(self.tp.size, -1)[self.tp.rank])


class RMSNorm(nn.Module):
    def __init__(self, size, eps, dtype=torch.bfloat16):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype))
        self.eps = eps

    def forward(self, x, residual=None, fuse_residual=False):
        if fuse_residual:
            return co.add_rms_norm(x, residual, self.weight, self.eps)
        return co.rms_norm(x, self.weight, self.eps)

    def weight_loader(self, param, full):
        _write(param, full)


class Embedding(nn.Module):
    """Replicated on every rank (a gather is exact, so sharding would buy memory only)."""

    def __init__(self, vocab, hidden, dtype=torch.bfloat16):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab, hidden, dtype=dtype))

    def forward(self, ids, dtype):
        return co.embedding(ids, self.weight).to(dtype)

    def weight_loader(self, param, full):
        _write(param, full)
