"""Local experts' weights held stacked, as vLLM's fused MoE keeps them.

``moe_expert_contributions`` takes experts as a mapping ``e -> (w_gate [I, H], w_up [I, H],
w_down [H, I])``. A rollout model keeps its experts in three stacked tensors instead (the
per-expert parameters are views of them), so a grouped kernel reads the stack as it is:
restacking 128 experts per layer and step cost more than the experts' matmuls at decode
sizes, and a cached second copy doubles the weights' memory. ``ExpertStack`` is that mapping
over the stacks; backends that want the stack take ``.gate``, ``.up``, ``.down``; others
index it like any mapping. The layout never changes bits: the same tensors, the same kernel.
A stack carries no autograd: a caller that trains passes the per-expert weights.
"""
from collections.abc import Mapping


class ExpertStack(Mapping):
    def __init__(self, gate, up, down, local):
        """gate, up [L, I, H]; down [L, H, I]; local: the L expert ids, ascending."""
        self.gate, self.up, self.down, self.local = gate, up, down, list(local)
        self._row = {e: i for i, e in enumerate(self.local)}

    def __getitem__(self, e):
        i = self._row[int(e)]
        return self.gate[i], self.up[i], self.down[i]

    def __iter__(self):
        return iter(self.local)

    def __len__(self):
        return len(self.local)
