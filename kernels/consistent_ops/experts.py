"""Local experts' weights held stacked, as transformers 5 and vLLM's fused MoE keep them.

``moe_expert_contributions`` takes experts as a mapping ``e -> (w_gate [I, H], w_up [I, H],
w_down [H, I])``. The model keeps a layer's local experts in two stacked tensors instead,
``gate_up`` [L, 2I, H] (each expert's gate rows, then its up rows) and ``down`` [L, H, I]
(transformers 5's ``gate_up_proj`` / ``down_proj``), and the grouped kernels read them as
they are: restacking 128 experts per layer and step cost more than the experts' matmuls at
decode sizes, and hundreds of per-expert parameters cost the trainer a gradient
accumulation and a slice each. ``ExpertStack`` is that mapping over the stacks; backends
that want the stack take ``.gate`` / ``.up`` (strided views of ``gate_up``, no copy) and
``.down``; others index it like any mapping. The stacks carry autograd: a backward through
them accumulates straight into the stacked gradients. The layout never changes bits: the
same values, the same kernel.
"""
from collections.abc import Mapping


class ExpertStack(Mapping):
    def __init__(self, gate_up, down, local):
        """gate_up [L, 2I, H]; down [L, H, I]; local: the L expert ids, ascending."""
        inter = down.shape[-1]
        self.gate_up, self.down, self.local = gate_up, down, list(local)
        self.gate, self.up = gate_up[:, :inter], gate_up[:, inter:]
        self._row = {e: i for i, e in enumerate(self.local)}

    def __getitem__(self, e):
        i = self._row[int(e)]
        return self.gate[i], self.up[i], self.down[i]

    def __iter__(self):
        return iter(self.local)

    def __len__(self):
        return len(self.local)
