"""verl's NPU monkey patches for Qwen3 (verl/models/transformers/npu_patch.py, applied by
its FSDP engine on Ascend) replace methods of transformers' Qwen3 / Qwen3-MoE modules.
Our trainer model is its own module tree on consistent_ops, so they cannot reach its math.
Checked here without torch_npu: every target those patch functions assign (read from
verl's source) is replaced by a tripwire; our model runs with the same bits, stock
transformers' Qwen3 trips it (the companion: the patches do reach the stock model)."""
import ast
import importlib
import importlib.util
from pathlib import Path

import pytest
import torch

from true_on_policy.make_tiny_model import ensure_tiny_model

transformers = pytest.importorskip("transformers")
PATCH_FUNCTIONS = {"qwen3": "_patch_qwen3", "qwen3_moe": "_patch_qwen3_moe"}


def _patch_targets(arch):
    """(module, dotted attribute) pairs that verl's _patch_<arch>() assigns."""
    src = Path(importlib.util.find_spec("verl.models.transformers").submodule_search_locations[0],
               "npu_patch.py").read_text()
    fn = next(n for n in ast.walk(ast.parse(src))
              if isinstance(n, ast.FunctionDef) and n.name == PATCH_FUNCTIONS[arch])
    targets = []
    for node in ast.walk(fn):
        if isinstance(node, ast.Assign):
            for t in node.targets:
                parts = ast.unparse(t).split(".")
                if parts[0].startswith("modeling_"):
                    targets.append((f"transformers.models.{arch}.{parts[0]}", parts[1:]))
    assert targets, f"verl's {PATCH_FUNCTIONS[arch]} assigns nothing: npu_patch.py changed"
    return targets


def _tripwire(*args, **kwargs):
    raise AssertionError("a verl NPU patch target ran")


@pytest.fixture
def registered():
    from true_on_policy import hf_model
    mapping = transformers.AutoModelForCausalLM._model_mapping
    saved = dict(mapping._extra_content)
    hf_model.register()
    yield
    mapping._extra_content.clear()
    mapping._extra_content.update(saved)


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
def test_verl_npu_patches_cannot_reach_our_model(arch, tmp_path_factory, registered, monkeypatch):
    path = ensure_tiny_model(tmp_path_factory.getbasetemp() / "models", arch, hidden_size=128, num_layers=2)
    ids = torch.randint(0, 1000, (1, 40), generator=torch.Generator().manual_seed(0))
    from true_on_policy import hf_model
    config = hf_model.scoped_config(transformers.AutoConfig.from_pretrained(path))   # as the actor's engine builds it
    ours = transformers.AutoModelForCausalLM.from_pretrained(path, config=config, dtype=torch.bfloat16)
    assert isinstance(ours, hf_model.TrueOnPolicyForCausalLM)
    stock_cls = getattr(transformers, {"qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}[arch])
    stock = stock_cls(transformers.AutoConfig.from_pretrained(path)).to(torch.bfloat16)
    with torch.no_grad():
        before = ours(input_ids=ids).logits
        for module, attrs in _patch_targets(arch):
            obj = importlib.import_module(module)
            for a in attrs[:-1]:
                obj = getattr(obj, a)
            monkeypatch.setattr(obj, attrs[-1], _tripwire)
        assert torch.equal(ours(input_ids=ids).logits, before)
        with pytest.raises(AssertionError, match="verl NPU patch target ran"):
            stock(input_ids=ids)
