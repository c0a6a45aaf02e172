"""Every config feature is computed as transformers computes it, or refused before any engine.

For each feature of the README's table, a tiny Qwen3 / Qwen3-MoE is built from the same
config.json keys twice, by transformers' own class and by ours (models.ModelConfig.from_hf),
with the same weights (bf16 values), both computing in fp32: our logits stay within BOUND of
transformers'. Comparing in fp32 isolates what the config means from bf16 rounding (in bf16
the dense gaps are ~0.05 here, and MoE routing flips near ties make any bound meaningless);
BOUND is far below that bf16 noise. The companions show the bound has teeth: the model that
reads a feature the other way (plain RoPE for YaRN, the other theta) is > 0.5 away.
"""
import copy
import json

import pytest
import torch

from true_on_policy.models import ConsistentForCausalLM, ModelConfig

transformers = pytest.importorskip("transformers")

# fp32 against fp32 on the same weights: the features measured 2-6e-6 (2 layers, logits ~5-10).
BOUND = 1e-4
DTYPE = torch.float32
BASE = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=32, intermediate_size=96, max_position_embeddings=256, rms_norm_eps=1e-6,
            tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48, norm_topk_prob=True)
YARN = {"factor": 4.0, "original_max_position_embeddings": 64}

# (name, arch, config.json edits): each feature on its own
FEATURES = [
    ("plain", "qwen3", {}),
    ("rope_theta top-level only", "qwen3", {"rope_parameters": None, "rope_theta": 5e5}),
    ("rope_theta in both places", "qwen3", {"rope_theta": 5e5,
                                            "rope_parameters": {"rope_type": "default", "rope_theta": 300.0}}),
    ("rope_scaling yarn (classic spelling)", "qwen3", {"rope_scaling": {"type": "yarn", **YARN}}),
    ("rope_parameters yarn, every option", "qwen3", {"rope_parameters": {
        "rope_type": "yarn", "rope_theta": 1e4, **YARN, "beta_fast": 16, "beta_slow": 2, "truncate": False,
        "attention_factor": 1.3}}),
    ("yarn mscale / mscale_all_dim", "qwen3", {"rope_parameters": {
        "rope_type": "yarn", "rope_theta": 1e4, **YARN, "mscale": 1.0, "mscale_all_dim": 0.5}}),
    ("yarn factor from max_position_embeddings", "qwen3", {"rope_parameters": {
        "rope_type": "yarn", "rope_theta": 1e4, "factor": None, "original_max_position_embeddings": 32}}),
    ("rope_scaling linear", "qwen3", {"rope_scaling": {"type": "linear", "factor": 3.0}}),
    ("attention_bias", "qwen3", {"attention_bias": True}),
    ("tie_word_embeddings", "qwen3", {"tie_word_embeddings": True}),
    ("head_dim absent (Qwen3: 128)", "qwen3", {"head_dim": None}),
    ("head_dim != hidden/heads", "qwen3", {"head_dim": 48}),
    ("sliding_window without use_sliding_window", "qwen3", {"sliding_window": 8, "use_sliding_window": False}),
    ("use_sliding_window, no layer above max_window_layers", "qwen3",
     {"sliding_window": 8, "use_sliding_window": True, "max_window_layers": 2}),
    ("moe plain", "qwen3_moe", {}),
    ("moe norm_topk_prob absent (False)", "qwen3_moe", {"norm_topk_prob": None}),
    ("moe mlp_only_layers", "qwen3_moe", {"mlp_only_layers": [0]}),
    ("moe decoder_sparse_step 2", "qwen3_moe", {"decoder_sparse_step": 2}),
    ("moe head_dim absent (hidden/heads)", "qwen3_moe", {"head_dim": None}),
    ("moe yarn", "qwen3_moe", {"rope_scaling": {"rope_type": "yarn", **YARN}}),
]

# (arch, config.json edits, what the one-line error names)
REFUSED = [
    ("qwen3", {"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope_type='dynamic'"),
    ("qwen3", {"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0] * 16, "long_factor": [2.0] * 16,
                                "original_max_position_embeddings": 64}}, "rope_type='longrope'"),
    ("qwen3", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}},
     "rope_type='llama3'"),
    ("qwen3", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1},
     "use_sliding_window=True (sliding_window=8)"),
    ("qwen3_moe", {"use_sliding_window": True, "sliding_window": 8}, "use_sliding_window=True (sliding_window=8)"),
    ("qwen3", {"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ("qwen3", {"attention_dropout": 0.1}, "attention_dropout=0.1"),
    ("qwen3", {"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5"),
    ("qwen3", {"dual_chunk_attention_config": {"chunk_size": 262144}}, "dual_chunk_attention_config is set"),
    ("qwen3", {"quantization_config": {"quant_method": "fp8"}}, "quantization_config is set"),
    ("qwen3_moe", {"decoder_sparse_step": 0}, "decoder_sparse_step=0"),
    ("qwen3", {"hidden_size": "wide"}, "hidden_size"),
]


def config_json(arch, edits):
    cls = {"qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}[arch]
    raw = {"architectures": [cls], "model_type": arch, **BASE, **(MOE if arch == "qwen3_moe" else {}), **edits}
    return {k: v for k, v in raw.items() if v is not None}


def hf_config(raw):
    """transformers' config object (it edits nested dicts in place: a copy)."""
    raw = copy.deepcopy(raw)
    return transformers.AutoConfig.for_model(raw.pop("model_type"), **raw)


def same_weights(raw, seed=0):
    """transformers' model and ours (both fp32) holding the same weights (bf16 values)."""
    torch.manual_seed(seed)
    ref = transformers.AutoModelForCausalLM.from_config(
        hf_config(raw), dtype=torch.float32)
    if hasattr(ref, "set_experts_implementation"):
        ref.set_experts_implementation("eager")
    cfg = ModelConfig.from_hf(raw)
    cfg.dtype = DTYPE
    ours = ConsistentForCausalLM(cfg)
    theirs = dict(ref.named_parameters())
    with torch.no_grad():
        for name, p in ref.named_parameters():
            scale = 0.1 if ("norm" in name or name.endswith("bias")) else 0.08
            base = 1.0 if "norm" in name else 0.0
            p.copy_((base + scale * torch.randn_like(p)).bfloat16().float())
        for name, p in ours.named_parameters():
            p.copy_(theirs[name])
    return ref.eval(), ours


def ids(length=160):
    return torch.randint(0, BASE["vocab_size"], (2, length), generator=torch.Generator().manual_seed(0))


def gap(ref, ours, x):
    with torch.no_grad():
        return (ours(x, attention_mask=torch.ones_like(x)) - ref(x).logits).abs().max().item()


@pytest.mark.parametrize("name, arch, edits", FEATURES, ids=[f[0] for f in FEATURES])
def test_feature_matches_transformers(name, arch, edits):
    raw = config_json(arch, edits)
    ref, ours = same_weights(raw)
    assert gap(ref, ours, ids()) <= BOUND, name


@pytest.mark.parametrize("arch, edits, names", REFUSED, ids=[r[2] for r in REFUSED])
def test_feature_refused_with_one_line(arch, edits, names):
    with pytest.raises(ValueError) as err:
        ModelConfig.from_hf(config_json(arch, edits))
    assert names in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("edits, misread", [
    ({"rope_scaling": {"type": "yarn", **YARN}}, {"rope_scaling": None}),
    ({"rope_scaling": {"type": "linear", "factor": 3.0}}, {"rope_scaling": None}),
    ({"rope_theta": 5e5, "rope_parameters": {"rope_type": "default", "rope_theta": 300.0}}, {"rope_theta": 5e5}),
], ids=["yarn ignored", "linear ignored", "top-level theta"])
def test_companion_a_misread_feature_leaves_the_bound(edits, misread):
    """Reading a feature the other way (as the old reader did) is far outside even bf16 noise."""
    raw = config_json("qwen3", edits)
    ref, ours = same_weights(raw)
    for key, value in misread.items():
        setattr(ours.cfg, key, value)
    assert gap(ref, ours, ids()) > 0.5


def test_head_dim_is_transformers_default():
    """No head_dim in config.json: Qwen3 means 128 (Qwen3Config's default), Qwen3-MoE hidden/heads."""
    assert ModelConfig.from_hf(config_json("qwen3", {"head_dim": None})).head_dim == 128
    assert ModelConfig.from_hf(config_json("qwen3_moe", {"head_dim": None})).head_dim == 16


def test_one_reader_for_dict_and_config_object():
    """The vLLM and HF adapters pass transformers config objects, check and preflight the
    config.json dict: one parse, one result, whatever the spelling."""
    for edits in ({"rope_theta": 5e5, "rope_parameters": {"rope_type": "default", "rope_theta": 300.0}},
                  {"rope_scaling": {"type": "yarn", **YARN}}, {"norm_topk_prob": None}):
        raw = config_json("qwen3_moe", edits)
        obj = hf_config(raw)
        assert ModelConfig.from_hf(raw) == ModelConfig.from_hf(obj) == ModelConfig.from_hf(json.loads(
            json.dumps(obj.to_dict())))


def test_fingerprint_covers_the_parameters_that_change_bits():
    """ModelConfig.numerics() hashed into the fingerprint (as check reports it): one reader,
    one fingerprint; any bit-changing parameter read differently, another fingerprint."""
    import consistent_ops as co
    raw = config_json("qwen3_moe", {"rope_scaling": {"type": "yarn", **YARN}})
    base = co.contract_fingerprint(ModelConfig.from_hf(raw).numerics())
    assert base == co.contract_fingerprint(ModelConfig.from_hf(hf_config(raw)).numerics())
    assert base != co.contract_fingerprint()
    for edits in ({"rope_theta": 5e5}, {"rms_norm_eps": 1e-5}, {"norm_topk_prob": False}, {"mlp_only_layers": [1]},
                  {"rope_scaling": {"type": "yarn", **YARN, "beta_fast": 16}}, {"rope_scaling": None}):
        other = ModelConfig.from_hf({**raw, **edits, "rope_parameters": None} if "rope_theta" in edits else
                                    {**raw, **edits})
        assert co.contract_fingerprint(other.numerics()) != base, edits


def test_the_verl_trainer_publishes_the_models_fingerprint():
    """The trainer's scoring (what its log-prob hook publishes for contract_match) carries the same
    model-aware fingerprint the vLLM model class reports; an actor-side edit of a bit-changing key
    gives another (contract_match 0)."""
    import consistent_ops as co
    from true_on_policy.scoring import Scoring
    raw = config_json("qwen3_moe", {"rope_scaling": {"type": "yarn", **YARN}})
    rollout = co.contract_fingerprint(ModelConfig.from_hf(raw).numerics())    # vllm/model.py's
    assert Scoring.of(hf_config(raw), 1000).contract == rollout
    assert Scoring.of(hf_config({**raw, "rms_norm_eps": 1e-5}), 1000).contract != rollout
