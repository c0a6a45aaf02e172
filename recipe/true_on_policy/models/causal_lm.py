"""Causal LM = Qwen3Model + vocab-parallel LM head, and the trainer-facing module.

``CausalLM`` is what both engines hold (the vLLM model class subclasses it), so
parameter names, weight loading and logits are shared. ``ConsistentForCausalLM``
adds the trainer's view: packed or padded batches, varlen attention, autograd and
the contract's log-probs.
"""
import re
from pathlib import Path

import torch
from torch import nn

import consistent_ops as co

from .config import ModelConfig
from .layers import TensorParallel
from .qwen3 import Experts, LMHead, Qwen3Model

EMBED, LM_HEAD = "model.embed_tokens.weight", "lm_head.weight"
# One expert's tensor as HF checkpoints store it (and verl's weight sync sends it); the model
# holds the layer's experts stacked (qwen3.Experts), under the names ``<prefix>.gate_up_proj``
# and ``<prefix>.down_proj``, which load too (the trainer's own state_dict).
_PER_EXPERT = re.compile(r"(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight")


def build_causal_lm(module: nn.Module, cfg: ModelConfig, tp: TensorParallel):
    """Give ``module`` the shared submodules (names = HF names: model.*, lm_head.*)."""
    module.cfg, module.tp = cfg, tp
    module.model = Qwen3Model(cfg, tp)
    module.lm_head = LMHead(cfg, tp)
    if cfg.tie_word_embeddings and not tp.sharded:
        module.lm_head.weight = module.model.embed_tokens.weight   # one tensor, like HF


class CausalLMMixin:
    """Logits and weight loading over ``self.model`` / ``self.lm_head`` (see build_causal_lm);
    mixed into plain nn.Modules here and into the HF PreTrainedModel adapter."""

    def compute_logits(self, hidden):
        """fp32 logits [T, vocab_size] (padded vocabulary rows included)."""
        return self.lm_head(hidden)

    def load_weights(self, weights):
        """weights: iterable of (HF name, FULL tensor); experts one by one (checkpoint names)
        or stacked (parameter names). Returns the names of the parameters set (an experts
        stack once every local expert's part has arrived, in this call or an earlier one)."""
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded = set()
        for name, tensor in weights:
            expert = _PER_EXPERT.fullmatch(name)
            if expert and f"{expert[1]}.down_proj" in params:
                with torch.no_grad():
                    done = self.get_submodule(expert[1]).load_expert(int(expert[2]), expert[3], tensor)
                loaded.update(f"{expert[1]}.{p}" for p in done)
                continue
            targets = [name] + ([LM_HEAD] if name == EMBED and self.cfg.tie_word_embeddings else [])
            for target in targets:
                if target not in params:
                    if target == LM_HEAD:
                        continue  # a tied head's copy
                    raise KeyError(f"weight {target!r} matches no parameter of {type(self).__name__} "
                                   f"(expected HF names such as {next(iter(params))!r})")
                module = self.get_submodule(target.rsplit(".", 1)[0])
                with torch.no_grad():
                    module.weight_loader(params[target], tensor)
                loaded.add(target)
        return loaded

    def load_checkpoint(self, path):
        from safetensors import safe_open
        files = sorted(Path(path).glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors in {path}: pass a HF checkpoint directory")
        loaded = set()
        for f in files:
            with safe_open(str(f), framework="pt") as st:
                loaded |= self.load_weights((k, st.get_tensor(k)) for k in st.keys())
        missing = set(dict(self.named_parameters(remove_duplicate=False))) - loaded
        if missing:
            raise ValueError(f"checkpoint {path} lacks parameters: {sorted(missing)[:5]} ...")
        return self


class CausalLM(CausalLMMixin, nn.Module):
    """What both engines hold: Qwen3Model + vocab-parallel LM head."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel = TensorParallel()):
        super().__init__()
        build_causal_lm(self, cfg, tp)


def sync_names(model):
    """What a weight sync must set on this rank: every parameter name, but the experts one
    by one under their checkpoint names (verl's FSDP sync unfuses stacks into those); and,
    for each experts stack, the checkpoint names it sets when it arrives whole."""
    held, stacks = set(), {}
    for name, _ in model.named_parameters(remove_duplicate=False):
        prefix, _, leaf = name.rpartition(".")
        module = model.get_submodule(prefix)
        if isinstance(module, Experts):
            stacks[name] = module.checkpoint_names(prefix, leaf)
            held.update(stacks[name])
        else:
            held.add(name)
    return held, stacks


def packed_layout(position_ids):
    """cu_seqlens [S+1] from packed position ids that restart at 0 for each sequence."""
    starts = torch.nonzero(position_ids == 0).flatten()
    end = torch.tensor([position_ids.numel()], device=position_ids.device)
    return torch.cat([starts, end]).to(torch.int64)


class TrainerMixin(CausalLMMixin):
    """The trainer's view: packed or padded batches, varlen attention, autograd, log-probs."""

    def forward_packed(self, input_ids, position_ids, cu_seqlens=None):
        """input_ids, position_ids [T]; returns fp32 logits [T, V]."""
        cu = packed_layout(position_ids) if cu_seqlens is None else cu_seqlens
        attend = lambda _i, q, k, v: co.attention_varlen(q, k, v, cu)
        return self.compute_logits(self.model(input_ids, position_ids, attend))

    def forward_tokens(self, input_ids, attention_mask=None, position_ids=None, cu_seqlens=None):
        """Padded [B, S] (with attention_mask) or packed [1, T] / [T] (with position_ids
        or cu_seqlens). Returns fp32 logits in the input's layout."""
        if attention_mask is None:
            flat = input_ids.reshape(-1)
            if position_ids is None:
                position_ids = positions_from_cu(cu_seqlens, flat.numel(), flat.device)
            logits = self.forward_packed(flat, position_ids.reshape(-1), cu_seqlens)
            return logits.reshape(*input_ids.shape, -1)
        mask = attention_mask.bool()
        pos = (mask.long().cumsum(-1) - 1).clamp(min=0)
        lens = mask.sum(-1)
        cu = torch.cat([lens.new_zeros(1), lens.cumsum(0)])
        logits = self.forward_packed(input_ids[mask], pos[mask], cu)
        out = logits.new_zeros(*input_ids.shape, logits.shape[-1])
        out[mask] = logits
        return out

    def next_token_logprobs(self, logits, input_ids, temperature=1.0, vocab_limit=None):
        """log p(input_ids[..., t+1] | prefix) from logits[..., t, :], same layout minus one step."""
        v = logits.shape[-1]
        lp = co.token_logprobs(logits[..., :-1, :].reshape(-1, v), input_ids[..., 1:].reshape(-1),
                               temperature, vocab_limit)
        return lp.reshape(input_ids[..., 1:].shape)


class ConsistentForCausalLM(TrainerMixin, CausalLM):
    """Trainer-side module. TP of the rollout is emulated in-process with ``tp_size``
    (only row-parallel sums depend on it; everything else is TP-invariant)."""

    def __init__(self, cfg: ModelConfig, tp_size: int = 1):
        super().__init__(cfg, TensorParallel(size=tp_size))

    @classmethod
    def from_pretrained(cls, path, tp_size=1, dtype=None, device=None):
        """``device``: where the parameters live (default: torch's current default device)."""
        cfg = ModelConfig.from_dir(path)
        if dtype is not None:
            cfg.dtype = dtype
        with torch.device(device or torch.get_default_device()):
            model = cls(cfg, tp_size)
        return model.load_checkpoint(path)

    def forward(self, input_ids, attention_mask=None, position_ids=None, cu_seqlens=None):
        return self.forward_tokens(input_ids, attention_mask, position_ids, cu_seqlens)


def positions_from_cu(cu_seqlens, total, device):
    """Each token's position inside its packed sequence (cu_seqlens [S+1]; None: one sequence)."""
    idx = torch.arange(total, device=device)
    if cu_seqlens is None:
        return idx
    cu = cu_seqlens.to(device)     # each token's offset from its sequence's start: no host sync
    return idx - cu[torch.searchsorted(cu[1:], idx, right=True)]
