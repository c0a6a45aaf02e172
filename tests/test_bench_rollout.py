"""benchmarks/bench_rollout.py --step-times: the split of one generate's forwards into prefill and decode, the
pooled medians, the table's two extra columns (and the table unchanged without the option), the timer around
vLLM's _model_forward, and one tiny real in-process engine run."""
import json
import math
import os
import subprocess
import sys

import pytest
from readme import ROOT, benchmark


@pytest.fixture
def bench(monkeypatch):
    return benchmark(monkeypatch, "bench_rollout")


def test_split_steps_prefill_is_every_forward_of_more_tokens_than_requests(bench):
    # 4 requests: a chunked prefill of 2 forwards (one mixed with decode tokens), then 3 decode steps (4, 4, 2 left)
    forwards = [(48, 0.010), (20, 0.005), (4, 0.002), (4, 0.004), (2, 0.001)]
    prefill, decode = bench.split_steps(forwards, requests=4)
    assert prefill == pytest.approx(15.0) and decode == pytest.approx(2.0)
    assert math.isnan(bench.split_steps([(64, 0.01)], requests=4)[1])       # no decode step: nan


def test_pool_and_table(bench):
    results = {}
    for mode, rounds in {"plugin": [([100.0, 120.0], [80.0, 90.0], [2.5, 2.7]), ([110.0], [85.0], [2.9])],
                         "stock": [([200.0, 220.0, 210.0], [70.0, 72.0, 71.0], [1.7, 1.9, 1.8])]}.items():
        for tps, pre, dec in rounds:
            bench.pool(results.setdefault(mode, {"mode": mode, "tokens_per_s": [], "wall_s": 0.0}),
                       {"tokens_per_s": tps, "wall_s": 1.0, "prefill_ms": pre, "decode_ms": dec})
    plugin = results["plugin"]
    assert plugin["prefill_ms"] == [80.0, 90.0, 85.0] and plugin["prefill_ms_median"] == 85.0
    assert plugin["decode_ms_median"] == 2.7 and plugin["median"] == 110.0 and plugin["wall_s"] == 2.0
    lines = bench.table(results, "cpu", step_times=True).splitlines()
    assert lines[2].split() == ["mode", "tokens/s", "(median)", "vs", "stock", "prefill", "ms", "decode", "ms/step"]
    assert lines[3].split() == ["plugin", "110.0", "0.524", "85.0", "2.70"]
    assert lines[4].split() == ["stock", "210.0", "1.000", "71.0", "1.80"]
    # without the option: the table and the pooled keys as before it
    plain = {"stock": bench.pool({"mode": "stock", "tokens_per_s": [], "wall_s": 0.0},
                                 {"tokens_per_s": [200.0], "wall_s": 1.0})}
    assert set(plain["stock"]) == {"mode", "tokens_per_s", "wall_s", "median"}
    before = (f"\nCPU: cpu\n{'mode':<12}{'tokens/s (median)':>20}{'vs stock':>10}\n"
              f"{'stock':<12}{200.0:>20.1f}{1.0:>10.3f}")
    assert bench.table(plain, "cpu") == before                        # the format strings the table had before


def test_step_timer_records_between_start_and_stop(bench, monkeypatch):
    pytest.importorskip("vllm")
    import torch
    from vllm.v1.worker import gpu_model_runner
    monkeypatch.setattr(gpu_model_runner.GPUModelRunner, "_model_forward", lambda self, input_ids=None, **kw: "out")
    timer = bench.StepTimer()
    forward = gpu_model_runner.GPUModelRunner._model_forward
    forward(None, input_ids=torch.zeros(7))                           # warm-up: not recorded
    timer.start()
    assert forward(None, input_ids=torch.zeros(9)) == "out"
    forward(None, torch.zeros(3))
    assert [n for n, _ in timer.stop()] == [9, 3]
    forward(None, input_ids=torch.zeros(5))
    assert len(timer.forwards) == 2


def test_step_times_needs_tp_1(bench):
    with pytest.raises(SystemExit):
        bench.parse_args(["--step-times", "--tp", "2"])


def test_a_tiny_in_process_run(tmp_path):
    pytest.importorskip("vllm")
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, "benchmarks/bench_rollout.py", "--prompts", "4", "--prompt-len", "16",
                           "--max-tokens", "4", "--repeats", "1", "--modes", "plugin", "--step-times",
                           "--json", str(out)], cwd=ROOT, env=os.environ, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "prefill ms  decode ms/step" in proc.stdout
    plugin = json.loads(out.read_text())["results"]["plugin"]
    assert len(plugin["prefill_ms"]) == len(plugin["decode_ms"]) == 1
    assert plugin["prefill_ms_median"] > 0 and plugin["decode_ms_median"] > 0
