"""true_on_policy.check without an engine: configuration errors before start-up, the
comparison statistics, and --localize's capture/compare logic on two in-process models."""
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from helpers import random_model, tiny_config
from true_on_policy import truncation
from true_on_policy.check import cli
from true_on_policy.check import localize as loc
from true_on_policy.check.capture import Capture, op_specs
from true_on_policy.check.perturb import install_perturbation
from true_on_policy.check.report import compare_phases, plugin_log
from true_on_policy.models.qwen3 import fuse


def test_indivisible_tp_fails_before_any_engine(tmp_path):
    """Exit 2 with the sizes and the valid TP degrees, in seconds (vLLM is never imported)."""
    from true_on_policy.make_tiny_model import ensure_tiny_model
    model = ensure_tiny_model(tmp_path, "qwen3_moe", hidden_size=64, num_layers=1, head_dim=16)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    res = subprocess.run([sys.executable, "-m", "true_on_policy.check", "--model", str(model), "--tp", "3"],
                         capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 2, res.stderr
    assert "num_attention_heads=4 is not divisible by tensor_parallel_size=3" in res.stderr
    assert "num_experts=8 is not divisible" in res.stderr and "[1, 2]" in res.stderr
    assert "[rollout]" not in res.stdout


@pytest.mark.parametrize("flags, message", [
    (["--top-p", "1.5"], "--top-p 1.5 must be in (0, 1]"), (["--min-p", "-0.1"], "--min-p -0.1 must be in [0, 1]"),
    (["--top-k", "-3"], "--top-k -3 must be an integer >= 1"),
])
def test_bad_truncation_flag_is_a_usage_error(flags, message, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.parse_args(flags)
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_truncation_flags_map_to_the_contract():
    assert truncation.of_settings(cli.parse_args([])) is None
    assert truncation.of_settings(cli.parse_args(["--top-k", "-1", "--top-p", "1"])) is None
    assert truncation.of_settings(cli.parse_args(["--top-k", "20", "--top-p", "0.9"])) == (20, 0.9, 0.0)


@pytest.fixture(scope="module")
def small_model(tmp_path_factory):
    from true_on_policy.make_tiny_model import ensure_tiny_model
    return ensure_tiny_model(tmp_path_factory.mktemp("m"), "qwen3", hidden_size=64, num_layers=1, head_dim=16)


def _bad_dirs(root, model):
    """Checkpoint dirs that are each wrong in one way."""
    (root / "empty").mkdir()
    for name, edit in (("llama", {"architectures": ["LlamaForCausalLM"], "model_type": "llama"}),
                       ("small_vocab", {"vocab_size": 512}),
                       ("dynamic_rope", {"rope_scaling": {"type": "dynamic", "factor": 2.0}}),
                       ("sliding", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 0})):
        shutil.copytree(model, root / name)
        cfg = json.loads((root / name / "config.json").read_text())
        (root / name / "config.json").write_text(json.dumps({**cfg, **edit}))
    return root


@pytest.mark.parametrize("args, env, message", [
    (["--model", "{root}/missing"], {}, "--model {root}/missing: no such directory"),
    (["--model", "{root}/empty"], {}, "--model {root}/empty has no config.json"),
    (["--model", "{root}/llama"], {}, "architecture ['LlamaForCausalLM'] / model_type 'llama' is not supported"),
    (["--model", "{root}/small_vocab"], {}, "the tokenizer has 1003 tokens but the model's vocab_size is 512"),
    (["--model", "{root}/dynamic_rope"], {}, "rope_type='dynamic' (rope_parameters / rope_scaling): not in the contract"),
    (["--model", "{root}/sliding"], {}, "use_sliding_window=True (sliding_window=8): sliding-window attention"),
    (["--model", "{model}", "--prompts", "0"], {}, "--prompts 0: use 1 or more"),
    (["--model", "{model}", "--max-tokens", "0"], {}, "--max-tokens 0: use 1 or more"),
    (["--model", "{model}"], {"CONSISTENT_OPS_BACKEND": "cpu"}, "CONSISTENT_OPS_BACKEND='cpu' is not a backend"),
    (["--model", "{model}", "--cuda-graphs", "--localize"], {}, "--cuda-graphs with --localize"),
] + ([] if torch.cuda.is_available() else [
    (["--model", "{model}", "--cuda-graphs"], {}, "--cuda-graphs: no CUDA GPU in this process"),
]))
def test_configuration_errors_exit_2_with_one_line(tmp_path, small_model, monkeypatch, capsys, args, env, message):
    """Each bad input: exit 2, one line naming the value and the fix, no engine, no traceback."""
    root = _bad_dirs(tmp_path, small_model)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    fill = lambda a: a.format(root=root, model=small_model)
    with pytest.raises(SystemExit) as exc:
        cli.main([fill(a) for a in args])
    err = capsys.readouterr()
    assert exc.value.code == 2
    errors = [ln for ln in err.err.splitlines() if ln.startswith("error: ")]   # (transformers may warn first)
    assert len(errors) == 1 and fill(message) in errors[0] and "Traceback" not in err.err, err.err
    assert "[rollout]" not in err.out


def test_root_cause_of_a_failed_engine_is_the_workers_error():
    log = ["(EngineCore pid=7) ERROR worker failed", "Traceback (most recent call last):",
           "(Worker pid=9) ValueError: true_on_policy: tensor_parallel_size=3 must divide 4",
           "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}"]
    assert cli.root_cause(log) == "ValueError: true_on_policy: tensor_parallel_size=3 must divide 4"
    assert cli.root_cause(log[-1:]) is None


def test_plugin_log_keeps_the_plugins_lines_once_in_order():
    log = ["INFO 12-07 23:20:01 [plugin.py:43] true_on_policy: registered M for A",
           "(EngineCore pid=7) INFO [model.py:88] true_on_policy: qwen3_moe TP 0/1, consistent_ops c",
           "INFO [core.py:1] graph capture done",
           "(EngineCore pid=7) INFO [model.py:150] true_on_policy: decode steps store K/V\n",
           "(EngineCore pid=7) INFO [model.py:150] true_on_policy: decode steps store K/V\n"]
    assert plugin_log(log) == ["registered M for A", "qwen3_moe TP 0/1, consistent_ops c", "decode steps store K/V"]
    assert plugin_log(log[2:3]) == []                                 # a stock engine


def test_compare_phases_counts_bitwise_equality():
    seqs = [{"prompt": [1], "output": [2, 3], "logprobs": [-1.5, -2.25]},
            {"prompt": [1], "output": [4], "logprobs": [-0.5]}]
    trainer = [[torch.tensor([-1.5, -2.25]), torch.tensor([-0.5])]]
    stats = compare_phases([{"sequences": seqs}], trainer)
    assert stats["total"] == {"num_tokens": 3, "num_exact": 3, "frac_exact": 1.0,
                              "max_abs_logdiff": 0.0, "mean_abs_logdiff": 0.0}
    assert stats["first_mismatch"] is None
    off = torch.nextafter(torch.tensor(-2.25), torch.tensor(0.0))          # one fp32 ulp
    stats = compare_phases([{"sequences": seqs}], [[torch.tensor([-1.5, float(off)]), torch.tensor([-0.5])]])
    assert stats["total"]["num_exact"] == 2 and stats["total"]["max_abs_logdiff"] > 0
    assert stats["first_mismatch"] == {"phase": 0, "sequence": 0, "token": 1, "rollout": -2.25,
                                       "trainer": float(off)}


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
def test_op_names_in_forward_order(arch):
    model = random_model(tiny_config(arch))
    names = [n for n, *_ in op_specs(model)]
    mlp = ["layers.0.experts", "layers.0.moe"] if arch == "qwen3_moe" else ["layers.0.mlp"]
    assert names[:8 + len(mlp)] == ["embedding", "layers.0.q_proj", "layers.0.k_proj", "layers.0.v_proj",
                                    "layers.0.q_norm", "layers.0.k_norm", "layers.0.attn", "layers.0.o_proj", *mlp]
    assert names[-2:] == ["norm", "logits"]


def _capture(model, ids):
    cap = Capture(model)
    with torch.no_grad():
        model.forward_packed(ids, torch.arange(len(ids)))
    return cap.stop(positions=torch.arange(len(ids)))


@pytest.mark.parametrize("fused", [False, True])       # True: the layers as the rollout runs them
@pytest.mark.parametrize("op", ["layers.0.attn", "layers.1.moe", "logits"])
def test_localize_names_the_broken_op(op, fused):
    cfg = tiny_config("qwen3_moe")
    good, bad = random_model(cfg), random_model(cfg)
    if fused:
        fuse(good)
        fuse(bad)
    install_perturbation(bad, op)
    ids = torch.randint(0, cfg.vocab_size, (20,))
    report = loc.compare(_capture(bad, ids), _capture(good, ids))
    assert loc.first_divergence(report)["op"] == op
    assert all(r["equal"] for r in report["ops"][:[r["op"] for r in report["ops"]].index(op)])
    assert f"FIRST DIVERGENCE: {op}" in loc.format_report(report)
    json.dumps(report)


def test_merge_ranks_concatenates_head_sharded_ops():
    pos = torch.arange(3)
    ranks = [{"layers.0.q_proj": (pos, torch.zeros(3, 2)), "layers.0.o_proj": (pos, torch.ones(3, 4))},
             {"layers.0.q_proj": (pos, torch.ones(3, 2)), "layers.0.o_proj": (pos, torch.ones(3, 4))}]
    merged = loc.merge_ranks(ranks)
    assert torch.equal(merged["layers.0.q_proj"][1], torch.tensor([[0., 0, 1, 1]] * 3))
    assert merged["layers.0.o_proj"][1].shape == (3, 4)


def test_compare_uses_only_positions_both_engines_computed():
    """The rollout's logits exist for the last scheduled token of a step only."""
    full = {"logits": (torch.arange(5), torch.arange(10.).reshape(5, 2))}
    last = {"logits": (torch.tensor([4]), torch.tensor([[8., 9.]]))}
    row = loc.compare(last, full)["ops"][0]
    assert row["equal"] and row["positions"] == 1


def test_routing_agreement_per_layer_and_first_differing_layer():
    """Same weights: every top-k set agrees (1.0). Layer 1's router changed in one engine:
    layer 0 still agrees, layer 1 does not, and it is named as the first differing layer."""
    cfg = tiny_config("qwen3_moe")
    ids = torch.randint(0, cfg.vocab_size, (24,), generator=torch.Generator().manual_seed(0))
    a, b = random_model(cfg), random_model(cfg)
    same = loc.routing_agreement(_capture(a, ids), _capture(b, ids))
    assert same == {"fraction": 1.0, "per_layer": [1.0, 1.0], "first_differing_layer": None, "tokens": 24}
    with torch.no_grad():
        gate = b.model.layers[1].mlp.gate.weight
        gate.copy_(gate.flip(0))                                   # experts renumbered: other sets
    flipped = loc.routing_agreement(_capture(a, ids), _capture(b, ids))
    assert flipped["per_layer"][0] == 1.0 and flipped["per_layer"][1] < 1.0
    assert flipped["first_differing_layer"] == 1 and flipped["fraction"] < 1.0
    assert "first differing: layer 1" in loc.format_routing(flipped)
    assert loc.routing_agreement(_capture(random_model(tiny_config("qwen3")), ids), {}) is None


def test_hf_routes_are_its_router_indices(tmp_path):
    """Stock HF transformers' Qwen3-MoE: the experts op holds the indices its router chose."""
    from true_on_policy.check import trainer as check_trainer
    from true_on_policy.make_tiny_model import ensure_tiny_model
    model = ensure_tiny_model(tmp_path, "qwen3_moe", hidden_size=64, num_layers=2, head_dim=16)
    tokens = list(range(5, 25))
    cap = check_trainer.capture(str(model), tokens, 1, stock=True)
    pos, routes = cap["layers.1.experts"]
    assert torch.equal(pos, torch.arange(len(tokens))) and routes.shape == (len(tokens), 2)
    assert (routes[:, 0] < routes[:, 1]).all()                     # a sorted set of distinct experts
