"""Bad input to the benchmarks and helper commands ends them at once with exit 2 and one error line that
names the value and the fix, before any engine starts or device time is spent: an unknown section or
mode, a count below 1, no CUDA GPU for the GPU benchmarks and scripts/gpu_suite.sh (this CI has none),
a rank count that is not a number. Good input is run by the commands' own tests (test_bench_rollout.py,
test_readme_commands.py)."""
import os
import subprocess
import sys

import pytest
import torch

from readme import ROOT


def _run(*argv):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(str(ROOT / p) for p in ("kernels", "recipe", "tests/gpu"))}
    res = subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    assert "Traceback" not in res.stderr, res.stderr
    return res.returncode, res.stderr.splitlines()[-1] if res.stderr else ""


@pytest.mark.parametrize("args, error", [
    (["--modes", "plugin,fast"], "--modes plugin,fast: fast not a mode; use a comma list of plugin, stock, stock-eager"),
    (["--rounds", "0"], "--rounds 0: use 1 or more"),
    (["--max-tokens", "-1"], "--max-tokens -1: use 1 or more"),
])
def test_bench_rollout_refuses_bad_modes_and_counts(args, error):
    assert _run("benchmarks/bench_rollout.py", *args) == (2, f"bench_rollout.py: error: {error}")


def test_bench_triton_names_an_unknown_section_before_the_device():
    rc, line = _run("benchmarks/bench_triton.py", "--only", "decode", "nosuch")
    assert rc == 2 and line.startswith("bench_triton.py: error: --only nosuch: no such section; choose from "
                                       "attention, decode, linear,")


@pytest.mark.parametrize("args, error", [
    (["--cases", "4by32768"], "--cases '4by32768': expected B x context pairs such as 4x32768,1x1024"),
    (["--variants", "default,seq read"], "--variants 'default,seq read': 'seq read' is not a variant; choose from "
                                         "default, one segment, segments 8, segments 32, full fold, stages 4, "
                                         "chunk 256, no carry"),
])
def test_bench_triton_names_a_bad_decode_case_or_variant_before_the_device(args, error):
    assert _run("benchmarks/bench_triton.py", "--only", "probe_decode_split", *args) == (
        2, f"bench_triton.py: error: {error}")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal of a process without CUDA")
@pytest.mark.parametrize("script, argv, what", [
    ("bench_triton.py", ["--only", "decode"], "the Triton benchmarks run"),
    ("bench_rollout_gpu.py", ["--cases", "1x1024"], "the 48-layer rollout benchmark runs"),
])
def test_gpu_benchmarks_refuse_a_process_without_cuda(script, argv, what):
    assert _run(f"benchmarks/{script}", *argv) == (
        2, f"{script}: error: no CUDA GPU in this process: {what} on the device (scripts/gpu_suite.sh)")


def test_bench_rollout_gpu_refuses_bad_cases():
    assert _run("benchmarks/bench_rollout_gpu.py", "--cases", "1by1024") == (
        2, "bench_rollout_gpu.py: error: --cases '1by1024': expected B x context pairs such as 1x1024,4x8192")
    rc, line = _run("benchmarks/bench_rollout_gpu.py", "--kv-write", "fused")
    assert rc == 2 and line.startswith("bench_rollout_gpu.py: error: argument --kv-write: invalid choice: 'fused'")


@pytest.mark.parametrize("arg", ["two", "0"])
def test_cpu_support_refuses_a_rank_count_that_is_not_one_or_more(arg):
    assert _run("-m", "true_on_policy.verl.cpu_support", arg) == (
        2, f"error: '{arg}': give the number of ranks N (an integer >= 1), or nothing for 1")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal of a machine without CUDA")
def test_gpu_suite_refuses_a_machine_without_cuda(tmp_path):
    res = subprocess.run(["bash", "scripts/gpu_suite.sh", str(tmp_path)], capture_output=True, text=True, timeout=120,
                         cwd=ROOT, env={**os.environ, "PATH": f"{ROOT / '.venv/bin'}:{os.environ['PATH']}"})
    assert res.returncode == 2 and res.stderr.splitlines() == [
        '[gpu_suite] error: python3 here has no CUDA GPU (or no torch): run it on the device, '
        'run(command="bash scripts/gpu_suite.sh $OUT")']
