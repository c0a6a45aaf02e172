"""Per-op activation capture for ``check --localize`` (no vLLM import: both engines use it).

An op is a named point in the forward pass, in forward order: ``embedding``; per
layer ``q_proj k_proj v_proj q_norm k_norm attn o_proj`` and ``mlp`` (dense) or
``experts moe``; ``norm``; ``logits``. ``experts`` is the MoE router's choice: each token's
top-k expert ids, sorted (a set), as that engine routed it. ``attn`` is the attention output (o_proj's input);
projections and norms are taken before RoPE. Every capture is flattened to
[tokens, features] and kept in its own dtype, so comparisons are bitwise.

The same names are found in three module trees: ours (models.CausalLM, used by the
trainer and by the vLLM plugin), stock vLLM's Qwen3 / Qwen3-MoE, and stock HF
transformers'. Under TP the rollout's head-sharded ops (projections, q/k norms,
attn) hold this rank's heads; the check concatenates ranks in order.
"""
import torch

HEAD_SHARDED = ("q_proj", "k_proj", "v_proj", "q_norm", "k_norm", "attn")


def _first(x):
    return x[0] if isinstance(x, tuple) else x


def op_specs(model):
    """[(op name, module, "out" | "in", transform(raw) -> {name: [T, F] tensor})] in forward order."""
    from true_on_policy.models import CausalLM
    if isinstance(model, CausalLM):
        return _specs(model.model, model.lm_head, model.model.norm, "ours")
    if hasattr(model, "logits_processor"):                 # stock vLLM Qwen3ForCausalLM / Qwen3Moe
        return _specs(model.model, model.logits_processor, model.model.norm, "vllm",
                      getattr(model.config, "num_experts_per_tok", None))
    return _specs(model.model, model.lm_head, model.model.norm, "hf")


def _flattener(batched):
    """[T, ...] (or HF's [1, T, ...]) -> [T, F]."""
    def flat(name):
        return lambda raw: {name: (_first(raw)[0] if batched else _first(raw)).flatten(1)}
    return flat


def _specs(body, head, norm, kind, top_k=None):
    _flat = _flattener(kind == "hf")
    specs = [("embedding", body.embed_tokens, "out", _flat("embedding"))]
    for i, layer in enumerate(body.layers):
        p, attn = f"layers.{i}.", layer.self_attn
        if kind == "vllm":
            q, kv = attn.q_size, attn.kv_size
            split = lambda raw, p=p, q=q, kv=kv: dict(zip(
                (p + "q_proj", p + "k_proj", p + "v_proj"), _first(raw).flatten(1).split([q, kv, kv], -1)))
            specs.append((p + "qkv", attn.qkv_proj, "out", split))
        else:
            specs += [(p + n, getattr(attn, n), "out", _flat(p + n)) for n in ("q_proj", "k_proj", "v_proj")]
        specs += [(p + "q_norm", attn.q_norm, "out", _flat(p + "q_norm")),
                  (p + "k_norm", attn.k_norm, "out", _flat(p + "k_norm")),
                  (p + "attn", attn.o_proj, "in", _flat(p + "attn")),
                  (p + "o_proj", attn.o_proj, "out", _flat(p + "o_proj"))]
        mlp = p + ("moe" if hasattr(layer.mlp, "experts") else "mlp")
        if mlp.endswith("moe"):
            specs.append(_routes(p + "experts", layer.mlp, kind, top_k))
        specs.append((mlp, layer.mlp, "out", _flat(mlp)))
    specs += [("norm", norm, "out", _flat("norm")), ("logits", head, "out", _flat("logits"))]
    return specs


def _routes(name, block, kind, top_k=None):
    """(op spec) the block's top-k expert ids per token, sorted. Ours: the contract's
    moe_route on the block's input (the engine's own routing function and input); stock
    vLLM: the top-k of its router logits (its CPU router takes top-k on the logits; the
    softmax keeps the order); HF transformers: the indices its router returns."""
    def ids(chosen):
        return {name: chosen.reshape(-1, chosen.shape[-1]).sort(-1).values}
    if kind == "ours":
        import consistent_ops as co
        return (name, block, "in", lambda x: ids(co.moe_route(
            x, block.gate.weight.to(x.dtype), block.top_k, block.norm_topk_prob)[0]))
    if kind == "vllm":
        return (name, block.gate, "out", lambda raw: ids(_first(raw).float().topk(top_k, -1).indices))
    return (name, block.gate, "out", lambda raw: ids(raw[2]))


class Capture:
    """Records every op of every forward call. ``root`` (optional) supplies each call's
    positions; an op with fewer rows than its call (the logits: vLLM computes them for
    the last scheduled token only) gets the call's last positions."""

    def __init__(self, model, root=None):
        self.calls, self.handles = [], []
        if root is not None:
            self.handles.append(root.register_forward_pre_hook(self._new_call, with_kwargs=True))
        for name, module, where, fn in op_specs(model):
            self.handles.append(self._hook(module, where, fn))

    def _new_call(self, _module, args, kwargs):
        pos = kwargs.get("positions", args[1] if len(args) > 1 else None)
        self.calls.append({"positions": pos.detach().reshape(-1).to("cpu", copy=True)})

    def _hook(self, module, where, fn):
        def record(raw):
            if not self.calls:
                self.calls.append({})
            for name, t in fn(raw).items():
                self.calls[-1][name] = t.detach().to("cpu", copy=True)   # compared on the host
        if where == "in":
            return module.register_forward_pre_hook(lambda _m, args: record(args[0]))
        return module.register_forward_hook(lambda _m, _a, out: record(out))

    def stop(self, positions=None):
        """Remove the hooks; returns {op: (positions [N], rows [N, F])}, calls concatenated.
        ``positions`` is used for a single call without a root (the trainer's forward)."""
        for h in self.handles:
            h.remove()
        if positions is not None:
            for call in self.calls:
                call["positions"] = positions
        out = {}
        for name in dict.fromkeys(k for call in self.calls for k in call if k != "positions"):
            pos, rows = [], []
            for call in (c for c in self.calls if name in c):
                pos.append(call["positions"][len(call["positions"]) - len(call[name]):])
                rows.append(call[name])
            out[name] = (torch.cat(pos), torch.cat(rows))
        return out

