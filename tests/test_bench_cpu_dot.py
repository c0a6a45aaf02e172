"""benchmarks/bench_cpu_dot.py (issue 30): the README's command runs and writes every shape in every
realisation this CPU has, beside torch's matmul; a bad value is one line, exit 2."""
import json
import os
import subprocess

import torch
from consistent_ops.reference import native
from readme import ROOT, benchmark, readme_command

SHAPES = ["qkv", "o_proj", "expert gate_up", "expert down", "qkv decode", "o_proj decode"]


def _run(*args):
    env, argv = readme_command("python benchmarks/bench_cpu_dot.py")
    return subprocess.run([*argv, *args], cwd=ROOT, env={**os.environ, **env}, capture_output=True, text=True,
                          timeout=300)


def test_bench_cpu_dot_times_every_shape_against_torch(tmp_path):
    out = tmp_path / "dot.json"
    proc = _run("--reps", "1", "--threads", "1", "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    doc = json.loads(out.read_text())
    assert doc["threads"] == 1 and [r["shape"] for r in doc["rows"]] == SHAPES
    for row in doc["rows"]:
        assert {"ours fp32", "torch bf16", "torch fp32"} <= set(row["ms"]) and "ours fp32" in row["vs_torch_bf16"]


def test_bad_thread_count_is_one_line():
    proc = _run("--threads", "0")
    assert proc.returncode == 2 and proc.stderr.strip() == "error: --threads 0: use 1 or more"


def test_each_case_runs_in_its_own_realisation(monkeypatch):
    """The cases are made together and interleaved: each sets its realisation when called (it was
    set when made, so every case ran the last one's)."""
    monkeypatch.setenv("CONSISTENT_OPS_CPU_ACCUMULATION", "fp32")
    bench_cpu_dot = benchmark(monkeypatch, "bench_cpu_dot")
    a, w = torch.randn(8, 300).bfloat16(), torch.randn(16, 300).bfloat16()
    cases = {name: bench_cpu_dot.ours(name, a, w) for name in ("fp32", "bf16")}
    pairs = native.dot32p_matmul(a, w.t())
    assert not torch.equal(pairs, native.dot32_matmul(a, w.t()))
    assert torch.equal(cases["fp32"](), native.dot32_matmul(a, w.t())) and torch.equal(cases["bf16"](), pairs)
