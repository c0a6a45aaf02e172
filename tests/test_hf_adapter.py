"""The HF adapter (what verl's FSDP engine builds through AutoModelForCausalLM for a
scoped config) runs the shared layers: fp32 master weights give the bits of the bf16
model, packed and padded; a plain Qwen3 config still builds transformers' class."""
import pytest
import torch

from true_on_policy.make_tiny_model import ensure_tiny_model
from true_on_policy.models import ConsistentForCausalLM

transformers = pytest.importorskip("transformers")


@pytest.fixture
def registered():
    """hf_model.register() adds our marked configs to AutoModelForCausalLM: undo it for later tests."""
    from true_on_policy import hf_model
    mapping = transformers.AutoModelForCausalLM._model_mapping
    saved = dict(mapping._extra_content)
    hf_model.register()
    yield hf_model
    mapping._extra_content.clear()
    mapping._extra_content.update(saved)


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
def test_auto_model_is_ours_and_exact(arch, tmp_path_factory, registered):
    hf_model = registered
    path = ensure_tiny_model(tmp_path_factory.getbasetemp() / "models", arch, hidden_size=128, num_layers=2)
    stock = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(path))
    assert not isinstance(stock, hf_model.TrueOnPolicyForCausalLM)
    scoped = hf_model.scoped_config(transformers.AutoConfig.from_pretrained(path))
    model = transformers.AutoModelForCausalLM.from_pretrained(path, config=scoped, dtype=torch.float32)
    assert isinstance(model, hf_model.TrueOnPolicyForCausalLM)
    assert next(model.parameters()).dtype == torch.float32            # storage: fp32 master
    ref = ConsistentForCausalLM.from_pretrained(path)                  # storage: bf16
    ids = torch.randint(0, 1000, (1, 50), generator=torch.Generator().manual_seed(0))
    pos = torch.cat([torch.arange(20), torch.arange(30)])[None]        # verl remove-padding layout
    mask = torch.ones(2, 25, dtype=torch.long)
    mask[0, :5] = 0
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids, position_ids=pos).logits, ref(ids, position_ids=pos))
        assert torch.equal(model(input_ids=ids.view(2, 25), attention_mask=mask).logits,
                           ref(ids.view(2, 25), attention_mask=mask))
    model(input_ids=ids, position_ids=pos).logits.float().logsumexp(-1).sum().backward()
    assert model.model.layers[0].self_attn.q_proj.weight.grad.abs().sum() > 0


def test_ours_builds_with_any_attention_verl_requests(tmp_path_factory, registered):
    """verl asks for flash_attention_2 unless override_config names another; without flash-attn
    (the H200 image) transformers refuses to build its own class so, ours builds: its attention is
    the contract's whatever the config says."""
    import importlib.util
    path = ensure_tiny_model(tmp_path_factory.getbasetemp() / "models", "qwen3_moe", hidden_size=128, num_layers=2)
    config = transformers.AutoConfig.from_pretrained(path, attn_implementation="flash_attention_2")
    if importlib.util.find_spec("flash_attn") is None:
        with pytest.raises(ImportError, match="FlashAttention2"):
            transformers.AutoModelForCausalLM.from_config(config)
    model = transformers.AutoModelForCausalLM.from_config(registered.scoped_config(config))
    assert isinstance(model, registered.TrueOnPolicyForCausalLM)


def test_rollout_truncation_reaches_verl_logprobs(tmp_path_factory, registered, monkeypatch):
    """Config attributes (set by the driver through override_config) -> the model this
    process built (its scoring.Scoring) -> verl's patched logprobs_from_logits scores the
    truncated distribution, bitwise as the rollout's processor rows; a config without them
    stays untruncated."""
    import consistent_ops as co
    from true_on_policy import scoring, truncation
    from true_on_policy.verl import trainer_logprobs
    hf_model = registered
    monkeypatch.setattr(scoring, "_active", scoring.active())          # process-wide: restored after
    monkeypatch.setattr(trainer_logprobs, "_publish_contract", lambda _fingerprint: None)   # no Ray job to report to
    path = ensure_tiny_model(tmp_path_factory.getbasetemp() / "models", "qwen3", hidden_size=128, num_layers=2)
    logits = torch.randn(6, 1024, generator=torch.Generator().manual_seed(2)) * 4 / 0.7   # verl divided by T
    config = hf_model.scoped_config(transformers.AutoConfig.from_pretrained(path))   # as the actor's engine does
    transformers.AutoModelForCausalLM.from_pretrained(path, config=config)
    assert scoring.active().truncation is None
    for attr, value in zip(truncation.CONFIG_ATTRS, (20, 0.9, 0.0)):
        setattr(config, attr, value)
    transformers.AutoModelForCausalLM.from_pretrained(path, config=config)
    assert scoring.active().truncation == (20, 0.9, 0.0)
    limit = scoring.active().vocab_limit
    rows = co.log_softmax(logits, 1.0, limit, (20, 0.9, 0.0))
    labels = rows.argmax(-1)
    engine_logprobs = trainer_logprobs._fsdp(lambda *a, **k: None)   # the engine's name, patched
    got = engine_logprobs(logits[None], labels[None])[0]
    assert torch.equal(got, rows.gather(-1, labels[:, None])[:, 0])
    assert not torch.equal(got, co.token_logprobs(logits, labels, 1.0, limit))


def test_saved_checkpoint_loads_back_exactly(tmp_path, registered):
    """A checkpoint the trainer saves (save_pretrained: transformers 5 writes the stacked
    experts under per-expert checkpoint names) loads into both engines' model bit for bit."""
    from safetensors import safe_open
    hf_model = registered
    path = ensure_tiny_model(tmp_path / "models", "qwen3_moe", hidden_size=128, num_layers=2)
    config = hf_model.scoped_config(transformers.AutoConfig.from_pretrained(path))
    model = transformers.AutoModelForCausalLM.from_pretrained(path, config=config, dtype=torch.float32)
    model.save_pretrained(tmp_path / "saved")
    keys = set()
    for f in (tmp_path / "saved").glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            keys |= set(st.keys())
    assert "model.layers.1.mlp.experts.3.up_proj.weight" in keys
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "saved", config=config, dtype=torch.float32)
    ours = ConsistentForCausalLM.from_pretrained(tmp_path / "saved", dtype=torch.float32)
    for m in (again, ours):
        assert all(torch.equal(a, b) for a, b in zip(m.state_dict().values(), model.state_dict().values()))
