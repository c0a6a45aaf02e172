"""benchmarks/bench_cpu_step.py (issue 30): the README's command runs every case (stock, each realisation, its
stub) at each thread count and writes them; its digest is the trainer's logits bit for bit, the same at 1 and
2 threads, and tells realisations apart; a digest that moves with the thread count fails the run; bad values
are one line."""
import hashlib
import json
import os
import subprocess

import pytest
import torch
from readme import ROOT, benchmark, readme_command

TINY = ["--prompts", "2", "--prompt-len", "8", "--steps", "2", "--repeats", "1"]


def _run(*args):
    env, argv = readme_command("python benchmarks/bench_cpu_step.py")
    return subprocess.run([*argv, *args], cwd=ROOT, env={**os.environ, **env}, capture_output=True, text=True,
                          timeout=300)


@pytest.fixture
def bench(monkeypatch):
    return benchmark(monkeypatch, "bench_cpu_step")


def test_every_case_at_every_thread_count(tmp_path):
    out = tmp_path / "step.json"
    proc = _run(*TINY, "--threads", "1,2", "--accumulation", "fp32,fp64", "--stub", "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert {"date", "cpu", "realisations", "threads", "rows", "digests", "digest_runs", "weights_sha256"} <= set(doc)
    assert doc["realisations"] == ["fp32", "fp64"] and doc["threads"] == [1, 2]
    cases = ["stock", "fp32", "fp32 stub", "fp64", "fp64 stub"]
    assert [(r["case"], r["threads"]) for r in doc["rows"]] == [(c, t) for t in (1, 2) for c in cases]
    for row in doc["rows"]:
        assert row["prefill_ms"] > 0 and row["decode_ms_per_step"] > 0 and row["tokens_per_s"] > 0
        if row["case"] in ("fp32", "fp64"):
            assert {"vs_stock_prefill", "vs_stock_decode", "host_share_decode"} <= set(row)
    for r in ("fp32", "fp64"):     # one digest at 1 and 2 threads ...
        assert len(doc["digest_runs"][r]) == 2 and set(doc["digest_runs"][r].values()) == {doc["digests"][r]}
    assert doc["digests"]["fp32"] != doc["digests"]["fp64"]     # ... that sees the realisation's bits
    assert f"digest fp32: {doc['digests']['fp32']}" in proc.stdout


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen3"])
def test_digest_is_the_trainers_logits(bench, monkeypatch, arch):
    """The harness's paged steps give the trainer's packed forward bits at each sampled position, so
    its metadata is laid out right (a wrong slot, position or table would move them)."""
    from true_on_policy.models import ConsistentForCausalLM
    monkeypatch.setenv("CONSISTENT_OPS_CPU_ACCUMULATION", "fp32")
    path, ours, _ = bench.build(arch)
    prompts = [[5, 17, 300, 2, 9, 41, 7], [800, 3, 3, 64, 12, 1, 990]]
    _, decode, digest = bench.run_ours(ours, prompts, 3, 4)        # pages of 4: a sequence spans pages
    trainer, seqs, want = ConsistentForCausalLM.from_pretrained(path), [list(p) for p in prompts], hashlib.sha256()
    with torch.no_grad():
        for _ in range(4):
            flat = torch.tensor([t for s in seqs for t in s])
            pos = torch.cat([torch.arange(len(s)) for s in seqs])
            logits = trainer.forward_packed(flat, pos)[torch.tensor([len(s) for s in seqs]).cumsum(0) - 1]
            want.update(logits.numpy().tobytes())
            for s, t in zip(seqs, logits.argmax(-1).tolist()):
                s.append(t)
    assert len(decode) == 3 and digest == want.hexdigest()


def test_logits_that_move_with_the_thread_count_fail_the_run(bench, monkeypatch, capsys):
    real = bench.run_ours

    def by_threads(*args, **kw):
        prefill, decode, digest = real(*args, **kw)
        return prefill, decode, digest + str(torch.get_num_threads())
    monkeypatch.setattr(bench, "run_ours", by_threads)
    assert bench.main([*TINY, "--arch", "qwen3", "--threads", "1,2", "--accumulation", "fp32"]) == 1
    err = capsys.readouterr().err.splitlines()
    assert err[-1].startswith("error: the fp32 realisation's logits differ between thread counts")


def test_bad_values_are_one_line():
    proc = _run("--accumulation", "fp32,fp16")
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1].startswith(
        "error: --accumulation fp16: not a CPU realisation; use bf16, fp32, fp64")
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr
    proc = _run("--threads", "0")
    assert proc.returncode == 2 and "usage:" in proc.stderr and "--threads" in proc.stderr
