"""The scheme module: the rules both adapters share, importing neither host."""
import ast
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from true_on_policy import scheme

PKG = Path(scheme.__file__).parent


def _imports(path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            yield "." * node.level + (node.module or "")
        elif isinstance(node, ast.Import):
            yield from (a.name for a in node.names)


def test_verl_adapter_does_not_import_the_vllm_adapter():
    for path in (PKG / "verl").glob("*.py"):
        bad = [m for m in _imports(path) if m.startswith(("..vllm", "true_on_policy.vllm"))]
        assert not bad, f"{path.name} imports {bad}"


def test_scheme_imports_neither_host():
    code = ("import sys, true_on_policy.scheme; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('verl', 'vllm')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_sampling_problems_name_the_setting_and_the_fix():
    assert scheme.sampling_problems({}) == []
    assert scheme.sampling_problems({"temperature": 0, "top_k": -1, "top_p": 1, "min_p": 0.0}) == []
    assert scheme.sampling_problems({"top_k": 1, "top_p": 0.9, "min_p": 0.05}) == []   # the contract applies them
    (msg,) = scheme.sampling_problems({"top_p": 1.5}, prefix="actor_rollout_ref.rollout.")
    assert msg == "actor_rollout_ref.rollout.top_p=1.5 must be in (0, 1] (1: off)"
    (msg,) = scheme.sampling_problems({"repetition_penalty": 1.2}, prefix="actor_rollout_ref.rollout.")
    assert msg.startswith("actor_rollout_ref.rollout.repetition_penalty=1.2 changes") and "default" in msg
    assert "temperature=-0.5 must be a finite number >= 0" in scheme.sampling_problems({"temperature": -0.5})[0]
    assert scheme.sampling_problems({"temperature": float("inf")})


def test_greedy_temperature_channel():
    assert scheme.request_temperature(0.0) == {"temperature": 0.0, "extra_args": {scheme.TEMPERATURE_KEY: 0.0}}
    assert scheme.request_temperature(0.7, {"a": 1}) == {"temperature": 1.0,
                                                         "extra_args": {"a": 1, scheme.TEMPERATURE_KEY: 0.7}}
    assert scheme.logprob_temperature(0.0) == 1.0 and scheme.logprob_temperature(0.7) == 0.7


def test_seeded_request_runs_the_engine_greedy_and_checks_its_key():
    key = {scheme.SEED_KEY: [1, 2, 3, 0, 0]}
    assert scheme.request_temperature(0.7, key) == {"temperature": 0.0, "extra_args": {**key, scheme.TEMPERATURE_KEY: 0.7}}
    assert scheme.seed_key_problems([1, 2, 3, 0, 0]) == []
    for bad in ([1, 2, 3, 0], [1, 2, 3, 0, -1], [2 ** 32, 0, 0, 0, 0], [1.0, 2, 3, 0, 0], "1"):
        (msg,) = scheme.seed_key_problems(bad)
        assert msg.startswith(f"extra_args['{scheme.SEED_KEY}']={bad!r} must be 5 ints")


def test_vocab_limit_refuses_a_tokenizer_larger_than_the_head():
    assert scheme.vocab_limit(1003, 1024) == 1003
    with pytest.raises(ValueError, match="the tokenizer has 1100 tokens but the model's vocab_size is 1024"):
        scheme.vocab_limit(1100, 1024)


def test_rollout_dtype_is_bf16_for_every_checkpoint():
    assert scheme.ROLLOUT_DTYPE == torch.bfloat16
    assert scheme.dtype_problems("bfloat16") == [] and scheme.dtype_problems(torch.bfloat16) == []
    assert "set bfloat16" in scheme.dtype_problems(torch.float16)[0]
    assert scheme.dtype_problems("float32", prefix="actor_rollout_ref.rollout.")[0].startswith(
        "actor_rollout_ref.rollout.dtype='float32'")


def test_cpu_threads_bind_splits_the_allowed_cpus(monkeypatch):
    monkeypatch.setattr(scheme.os, "sched_getaffinity", lambda _pid: {0, 1, 2, 3})
    assert scheme.cpu_threads_bind(2) == "0-1|2-3" and scheme.cpu_threads_bind(4) == "0|1|2|3"
    monkeypatch.setattr(scheme.os, "sched_getaffinity", lambda _pid: {0, 1})
    assert scheme.cpu_threads_bind(2) == "0|1"


def test_verl_preflight_refuses_a_large_tokenizer_and_a_bad_backend(tmp_path, monkeypatch):
    """Both once passed the job's preflight and killed an engine later (IndexError on the
    first id >= vocab; "Engine core initialization failed")."""
    import json
    import shutil

    from omegaconf import OmegaConf

    from true_on_policy.make_tiny_model import ensure_tiny_model
    from true_on_policy.verl import preflight
    model = shutil.copytree(ensure_tiny_model(tmp_path, "qwen3", hidden_size=64, num_layers=1, head_dim=16),
                            tmp_path / "small_vocab")
    cfg_json = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**cfg_json, "vocab_size": 512}))
    cfg = OmegaConf.create({"actor_rollout_ref": {"rollout": {"name": "vllm"}, "model": {"path": str(model)}}})
    assert any("the tokenizer has 1003 tokens but the model's vocab_size is 512" in p for p in preflight.problems(cfg))
    monkeypatch.setenv("CONSISTENT_OPS_BACKEND", "cpu")
    assert any("CONSISTENT_OPS_BACKEND='cpu' is not a backend" in p for p in preflight.problems(cfg))
