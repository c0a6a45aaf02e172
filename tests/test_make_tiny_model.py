"""true_on_policy.make_tiny_model: both archs build, are byte-deterministic, load in HF
with no missing keys, keep the classic per-expert names on disk, and cache."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open


def _hide_broken_torchvision():
    """transformers' modeling modules import torchvision when it is installed; a wheel
    built for another torch (e.g. +cu130 next to CPU torch) then crashes the import.
    Nothing here needs vision ops, so make transformers see it as absent."""
    try:
        import torchvision  # noqa: F401
    except Exception:
        for name in [m for m in sys.modules if m.split(".")[0] == "torchvision"]:
            del sys.modules[name]
        sys.modules["torchvision"] = None


_hide_broken_torchvision()

from readme import readme_command  # noqa: E402
from true_on_policy import make_tiny_model as mtm  # noqa: E402

ARCHS = ["qwen3", "qwen3_moe"]
FILES = ["config.json", "generation_config.json", "model.safetensors",
         "tokenizer.json", "tokenizer_config.json"]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return {arch: mtm.make_tiny_model(root / arch, arch) for arch in ARCHS}


def _keys(path):
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return set(f.keys())


@pytest.mark.parametrize("arch", ARCHS)
def test_hf_loads_without_missing_keys(built, arch):
    from transformers import AutoModelForCausalLM
    model, info = AutoModelForCausalLM.from_pretrained(built[arch], output_loading_info=True)
    assert not (info["missing_keys"] or info["unexpected_keys"] or info["mismatched_keys"]), info
    assert type(model).__name__ == ("Qwen3MoeForCausalLM" if arch == "qwen3_moe" else "Qwen3ForCausalLM")
    assert model.dtype == torch.bfloat16
    with torch.no_grad():
        logits = model(torch.tensor([[1, 2, 3, 4]])).logits
    assert logits.shape == (1, 4, model.config.vocab_size) and torch.isfinite(logits).all()
    if arch == "qwen3":  # tied: lm_head is the embedding, and is not saved
        assert "lm_head.weight" not in _keys(built[arch])
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_moe_checkpoint_uses_per_expert_names(built):
    path = built["qwen3_moe"]
    layer0 = {k for k in _keys(path) if k.startswith("model.layers.0.mlp.")}
    expected = {"model.layers.0.mlp.gate.weight"} | {
        f"model.layers.0.mlp.experts.{e}.{p}_proj.weight" for e in range(8) for p in ("gate", "up", "down")}
    assert layer0 == expected
    assert "lm_head.weight" in _keys(path)  # qwen3_moe default: untied
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["num_experts"] == 8 and cfg["num_experts_per_tok"] == 2 and cfg["norm_topk_prob"]
    assert cfg["decoder_sparse_step"] == 1 and cfg["mlp_only_layers"] == [] and not cfg["use_sliding_window"]


def test_hf_fuses_experts_in_the_right_order(built):
    """Whatever layout transformers uses in memory, expert e's gate/up/down come from file."""
    from transformers import AutoModelForCausalLM
    path = built["qwen3_moe"]
    sd = AutoModelForCausalLM.from_pretrained(path).state_dict()
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        gate, up = (f.get_tensor(f"model.layers.1.mlp.experts.3.{p}_proj.weight") for p in ("gate", "up"))
        down = f.get_tensor("model.layers.1.mlp.experts.3.down_proj.weight")
    if "model.layers.1.mlp.experts.gate_up_proj" in sd:  # transformers 5 fused layout
        assert torch.equal(sd["model.layers.1.mlp.experts.gate_up_proj"][3], torch.cat([gate, up]))
        assert torch.equal(sd["model.layers.1.mlp.experts.down_proj"][3], down)
    else:
        assert torch.equal(sd["model.layers.1.mlp.experts.3.gate_proj.weight"], gate)


def test_weight_init_rules(built):
    with safe_open(str(built["qwen3_moe"] / "model.safetensors"), "pt") as f:
        assert torch.all(f.get_tensor("model.layers.0.self_attn.q_norm.weight") == 1)
        assert torch.all(f.get_tensor("model.norm.weight") == 1)
        router = f.get_tensor("model.layers.0.mlp.gate.weight").float()
        assert 0.015 < router.std().item() < 0.025 and f.get_tensor("model.embed_tokens.weight").dtype == torch.bfloat16


@pytest.mark.parametrize("arch", ARCHS)
def test_cli_rebuild_is_byte_identical(built, arch, tmp_path):
    """A second build in a fresh process (new hash seeds, new threads) gives the same bytes."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    _, cmd = readme_command("python -m true_on_policy.make_tiny_model --arch {qwen3,qwen3_moe}",
                            fill={"{qwen3,qwen3_moe}": arch, "DIR": tmp_path / "m"})
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "params" in res.stdout
    assert sorted(os.listdir(tmp_path / "m")) == sorted(FILES)
    for name in FILES:
        assert (tmp_path / "m" / name).read_bytes() == (built[arch] / name).read_bytes(), name


def test_no_weights_writes_the_full_shape_without_its_tensors(built, tmp_path):
    """--no-weights (vLLM's load_format=dummy draws them): the 48-layer Qwen3-30B-A3B shape as config,
    generation config and tokenizer, the tokenizer the same bytes as a built model's."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    out = tmp_path / "l48"
    _, cmd = readme_command("python -m true_on_policy.make_tiny_model --arch qwen3_moe --out DIR --no-weights",
                            fill={"DIR": out})
    shape = ["--num-layers", "48", "--hidden-size", "2048", "--num-heads", "32", "--num-kv-heads", "4", "--head-dim",
             "128", "--moe-intermediate-size", "768", "--num-experts", "128", "--top-k", "8", "--vocab-size", "151936"]
    res = subprocess.run(cmd + shape, env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "30532.12M params (no weights written)" in res.stdout, res.stdout
    assert sorted(os.listdir(out)) == sorted(f for f in FILES if f != "model.safetensors")
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["num_hidden_layers"], cfg["num_experts"], cfg["vocab_size"]) == (48, 128, 151936)
    assert (out / "tokenizer.json").read_bytes() == (built["qwen3_moe"] / "tokenizer.json").read_bytes()


def test_seed_changes_weights_not_tokenizer(built, tmp_path):
    other = mtm.make_tiny_model(tmp_path / "s1", "qwen3", seed=1)
    assert (other / "tokenizer.json").read_bytes() == (built["qwen3"] / "tokenizer.json").read_bytes()
    assert (other / "model.safetensors").read_bytes() != (built["qwen3"] / "model.safetensors").read_bytes()


def test_tokenizer(built):
    from transformers import AutoTokenizer
    path = built["qwen3"]
    tok = AutoTokenizer.from_pretrained(path)
    cfg = json.loads((path / "config.json").read_text())
    ids = tok("What is 12+7?")["input_ids"]
    assert tok.decode(ids) == "What is 12+7?"
    assert [t for t in tok.convert_ids_to_tokens(ids) if t.isdigit()] == ["1", "2", "7"]  # one token per digit
    assert cfg["vocab_size"] > len(tok) and cfg["vocab_size"] % 128 == 0
    assert cfg["eos_token_id"] == tok.eos_token_id == tok.convert_tokens_to_ids("<|im_end|>")
    assert cfg["pad_token_id"] == tok.pad_token_id == tok.convert_tokens_to_ids("<|endoftext|>")
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok(chat)["input_ids"][0] == tok.convert_tokens_to_ids("<|im_start|>")


def test_ensure_tiny_model_caches(tmp_path, monkeypatch):
    small = dict(hidden_size=32, num_layers=1, head_dim=8, num_experts=4)
    first = mtm.ensure_tiny_model(tmp_path, "qwen3_moe", **small)
    monkeypatch.setattr(mtm, "_build_into", lambda *a: pytest.fail("rebuilt a cached model"))
    assert mtm.ensure_tiny_model(tmp_path, "qwen3_moe", **small) == first
    assert mtm.cache_key("qwen3_moe", **small) != mtm.cache_key("qwen3_moe", **small, seed=1)
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no temp dirs left behind


def test_crash_leaves_no_half_model(tmp_path, monkeypatch):
    def boom(*a, **k):
        raise RuntimeError("disk full")
    monkeypatch.setattr(mtm, "save_file", boom)
    with pytest.raises(RuntimeError, match="disk full"):
        mtm.make_tiny_model(tmp_path / "m", "qwen3", num_layers=1)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("kwargs, match", [
    (dict(arch="llama"), "unknown --arch 'llama'"),
    (dict(num_kv_heads=3), "--num-kv-heads 3"),
    (dict(top_k=9), "--top-k 9 exceeds --num-experts 8"),
    (dict(vocab_size=500), "--vocab-size 500 is smaller than the tokenizer"),
    (dict(head_dim=15), "--head-dim 15 is odd"),
    (dict(hidden_size=0), "--hidden-size must be a positive integer"),
])
def test_bad_input_names_the_value(tmp_path, kwargs, match):
    arch = kwargs.pop("arch", "qwen3_moe")
    with pytest.raises(ValueError, match=match.replace("+", r"\+")):
        mtm.make_tiny_model(tmp_path / "m", arch, **kwargs)
    assert not (tmp_path / "m").exists()


def test_refuses_non_empty_out_and_unknown_args(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "x").write_text("keep me")
    with pytest.raises(FileExistsError, match="--overwrite"):
        mtm.make_tiny_model(tmp_path / "m", "qwen3")
    with pytest.raises(TypeError, match="hiden_size"):
        mtm.make_tiny_model(tmp_path / "n", "qwen3", hiden_size=8)
