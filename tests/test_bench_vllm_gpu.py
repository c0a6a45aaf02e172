"""benchmarks/bench_vllm_gpu.py's parent side (no GPU, no vLLM): the interleaved rounds, the
pooled medians and per-round ratios it reports, and its refusal of bad counts."""
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "bench_vllm_gpu.py"
_spec = importlib.util.spec_from_file_location("bench_vllm_gpu", SCRIPT)
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def test_gpu_sampler_summarises_clock_power_and_temperature(monkeypatch):
    monkeypatch.setattr(bench.GpuSampler, "QUERY", [sys.executable, "-c",
                                                    "print('1980, 650.5, 61'); print('1755, 700.0, 66')"])
    with bench.GpuSampler() as gpu:
        gpu.proc.wait()
    assert gpu.summary() == {"sm_mhz_median": 1867.5, "sm_mhz_min": 1755.0, "power_w_median": 675.25,
                             "temp_c_max": 66.0, "samples": 2}
    monkeypatch.setattr(bench.GpuSampler, "QUERY", ["/nonexistent/nvidia-smi"])
    with bench.GpuSampler() as gpu:
        pass
    assert gpu.summary() == {}


def test_rounds_interleave_engines_and_pool_every_timed_generate(tmp_path, monkeypatch, capsys):
    (tmp_path / "config.json").write_text("{}")
    times = {"stock": iter([[30.0, 31.0], [34.0, 36.0]]), "plugin": iter([[40.0, 42.0], [32.0, 33.0]])}
    order = []

    def fake_engine(args, engine, name):
        order.append((engine, name))
        return {"engine": engine, "engine_start_s": 20.0, "seconds": next(times[engine]), "tokens": 1000}

    monkeypatch.setattr(bench, "run_engine", fake_engine)
    out = tmp_path / "b.json"
    bench.main(["--model", str(tmp_path), "--rounds", "2", "--repeats", "2", "--json", str(out)])
    assert order == [("stock", "stock-1"), ("plugin", "plugin-1"), ("plugin", "plugin-2"), ("stock", "stock-2")]  # ABBA
    doc = json.loads(out.read_text())
    stock, plugin = doc["results"]["stock"], doc["results"]["plugin"]
    assert stock["seconds"] == [30.0, 31.0, 34.0, 36.0] and stock["batch_s"] == 32.5
    assert plugin["batch_s"] == 36.5 and plugin["tokens_per_s"] == 1000 / 36.5
    assert [r["plugin"]["batch_s"] for r in doc["rounds"]] == [41.0, 32.5]
    printed = capsys.readouterr().out
    assert "per round, plugin / stock: 0.744, 1.077" in printed
    assert ["plugin", "27", "36.50", "0.890"] in [line.split() for line in printed.splitlines()]


def test_a_bad_count_is_refused_in_one_line(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    r = subprocess.run([sys.executable, str(SCRIPT), "--model", str(tmp_path), "--rounds", "0"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.strip() == "error: --rounds 0: use 1 or more"


def test_step_times_bucket_by_unfinished_requests_and_pool_over_rounds(tmp_path, monkeypatch, capsys):
    class Engine:
        left = [300, 100, 9, 8, 1]

        def get_num_unfinished_requests(self):
            return self.left[0]

        def step(self):
            self.left.pop(0)
            return ["out"]
    engine = Engine()
    steps = bench.StepTimes(engine)
    assert [engine.step() for _ in range(5)] == [["out"]] * 5
    summary = steps.summary(generates=1)
    assert list(summary) == ["<=8", "9-64", "65-256", ">256"]
    assert [n for _, n in summary.values()] == [2, 1, 1, 1]
    steps.close()                                                # the engine's own step() again
    assert "step" not in vars(engine) and engine.step.__func__ is Engine.step
    assert bench.StepTimes(object()).summary(1) == {}            # an engine without the count: left alone

    (tmp_path / "config.json").write_text("{}")
    per = {"stock": iter([{"<=8": [2.0, 100], ">256": [10.0, 50]}, {"<=8": [4.0, 100], ">256": [12.0, 50]}]),
           "plugin": iter([{"<=8": [4.0, 100], ">256": [11.0, 50]}, {"<=8": [4.0, 100], ">256": [11.0, 50]}])}
    monkeypatch.setattr(bench, "run_engine", lambda args, engine, name: {
        "engine": engine, "engine_start_s": 1.0, "seconds": [30.0], "tokens": 1000, "steps": next(per[engine])})
    out = tmp_path / "b.json"
    bench.main(["--model", str(tmp_path), "--rounds", "2", "--json", str(out)])
    assert json.loads(out.read_text())["results"]["stock"]["steps"] == {"<=8": [3.0, 100], ">256": [11.0, 50]}
    rows = [line.split() for line in capsys.readouterr().out.splitlines()]
    assert ["<=8", "3.00", "4.00", "0.750", "100"] in rows and [">256", "11.00", "11.00", "1.000", "50"] in rows


def test_each_engine_process_leaves_its_whole_output_under_logs(tmp_path, monkeypatch, capsys):
    class Child:   # an engine process: two lines, then (or not) its result
        def __init__(self, lines):
            self.stdout, self.returncode = iter(lines), 1

        def wait(self, timeout=None):
            return self.returncode
    lines = ["compiling\n", "[stock] engine up in 9.0 s; warm-up\n", '@@result {"engine": "stock"}\n']
    monkeypatch.setattr(bench.subprocess, "Popen", lambda *a, **k: Child(lines))
    (tmp_path / "config.json").write_text("{}")
    args = bench.parse_args(["--model", str(tmp_path), "--logs", str(tmp_path)])
    assert bench.run_engine(args, "stock", "stock-1") == {"engine": "stock"}
    assert (tmp_path / "stock-1.log").read_text() == "compiling\n[stock] engine up in 9.0 s; warm-up\n"
    assert capsys.readouterr().out == "[stock] engine up in 9.0 s; warm-up\n"     # progress, not vLLM's log
    lines = lines[:2]                                   # killed before its result: the log still has it
    with pytest.raises(SystemExit, match="the plugin engine failed"):
        bench.run_engine(args, "plugin", "plugin-1")
    assert (tmp_path / "plugin-1.log").read_text() == "compiling\n[stock] engine up in 9.0 s; warm-up\n"


def test_an_engine_process_that_does_not_exit_after_its_result_is_killed(tmp_path, monkeypatch, capsys):
    """The result counts; a process still alive EXIT_GRACE_S after it is killed, not waited on."""
    class Child:
        stdout, killed = iter(['@@result {"engine": "plugin"}\n']), False

        def wait(self, timeout=None):
            if not self.killed:
                raise subprocess.TimeoutExpired("engine", timeout)
            return -9

        def kill(self):
            self.killed = True
    child = Child()
    monkeypatch.setattr(bench.subprocess, "Popen", lambda *a, **k: child)
    (tmp_path / "config.json").write_text("{}")
    assert bench.run_engine(bench.parse_args(["--model", str(tmp_path)]), "plugin") == {"engine": "plugin"}
    assert child.killed and "did not exit" in capsys.readouterr().out
