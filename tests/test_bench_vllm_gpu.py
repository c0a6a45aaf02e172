"""benchmarks/bench_vllm_gpu.py's parent side (no GPU, no vLLM): the interleaved rounds, the
pooled medians and per-round ratios it reports, and its refusal of bad counts."""
import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

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
        return {"engine": engine, "engine_start_s": 20.0, "seconds": next(times[engine]), "tokens": 1000,
                "plugin_log": ["decode steps store K/V"] if engine == "plugin" else []}

    monkeypatch.setattr(bench, "run_engine", fake_engine)
    out = tmp_path / "b.json"
    bench.main(["--model", str(tmp_path), "--rounds", "2", "--repeats", "2", "--json", str(out)])
    assert order == [("stock", "stock-1"), ("plugin", "plugin-1"), ("plugin", "plugin-2"), ("stock", "stock-2")]  # ABBA
    doc = json.loads(out.read_text())
    assert set(doc) == {"device", "date", "args", "results", "rounds"}          # --tail's key only with --tail
    stock, plugin = doc["results"]["stock"], doc["results"]["plugin"]
    assert set(stock) == {"engine", "tokens", "seconds", "engine_start_s", "wall_s", "batch_s", "steps", "tokens_per_s"}
    assert stock["seconds"] == [30.0, 31.0, 34.0, 36.0] and stock["batch_s"] == 32.5
    assert plugin["batch_s"] == 36.5 and plugin["tokens_per_s"] == 1000 / 36.5
    assert [r["plugin"]["batch_s"] for r in doc["rounds"]] == [41.0, 32.5]
    printed = capsys.readouterr().out
    assert "per round, plugin / stock: 0.744, 1.077" in printed
    assert ["plugin", "27", "36.50", "0.890"] in [line.split() for line in printed.splitlines()]
    assert printed.count("[bench_vllm_gpu] plugin: decode steps store K/V\n") == 1      # the first round's


def test_a_bad_count_is_refused_in_one_line(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    r = subprocess.run([sys.executable, str(SCRIPT), "--model", str(tmp_path), "--rounds", "0"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.strip() == "error: --rounds 0: use 1 or more"


def test_an_unknown_engine_is_refused_in_one_line(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    r = subprocess.run([sys.executable, str(SCRIPT), "--model", str(tmp_path), "--engines", "stock,vllm"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.strip() == "error: --engines stock,vllm: name some of stock, plugin, sampling"


def test_the_sampling_engine_is_stock_vllm_with_the_plugins_sampling_path(tmp_path, monkeypatch):
    """'sampling': stock's model (TRUE_ON_POLICY=0, no compilation settings) with what the plugin's
    config hook sets for sampling (processed_logits, its logits processor) and its request params."""
    from true_on_policy.vllm import engine_config, sampling
    built = []
    monkeypatch.setitem(sys.modules, "vllm", SimpleNamespace(LLM=lambda **kw: built.append(kw)))
    bench.build_llm(SimpleNamespace(model="m", gpu_memory_utilization=0.5, load_format=None), "sampling", 100)
    assert built[0]["logprobs_mode"] == engine_config.LOGPROBS_MODE == "processed_logits"
    assert built[0]["logits_processors"] == [sampling.V1_PROCESSOR] and "compilation_config" not in built[0]
    monkeypatch.setattr(sampling, "sampling_params", lambda t, **kw: ("plugin params", t, kw["max_tokens"]))
    assert bench.params_for("sampling", 7) == ("plugin params", 1.0, 7)
    envs = []

    class Child:
        stdout, returncode = iter(['@@result {"engine": "sampling"}\n']), 0

        def wait(self, timeout=None):
            return 0
    monkeypatch.setattr(bench.subprocess, "Popen", lambda argv, env, **k: envs.append(env) or Child())
    (tmp_path / "config.json").write_text("{}")
    bench.run_engine(bench.parse_args(["--model", str(tmp_path), "--engines", "sampling"]), "sampling")
    assert envs[0]["TRUE_ON_POLICY"] == "0"


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
    assert bench.run_engine(args, "stock", "stock-1") == {"engine": "stock", "plugin_log": []}
    assert (tmp_path / "stock-1.log").read_text() == "compiling\n[stock] engine up in 9.0 s; warm-up\n"
    path = "(EngineCore pid=7) INFO [model.py:150] true_on_policy: decode steps store K/V\n"
    lines = [path, path, '@@result {"engine": "plugin"}\n']            # the plugin's own lines, each once
    assert bench.run_engine(args, "plugin", "plugin-1") == {"engine": "plugin",
                                                            "plugin_log": ["decode steps store K/V"]}
    assert capsys.readouterr().out == "[stock] engine up in 9.0 s; warm-up\n"     # progress, not vLLM's log
    lines = ["compiling\n", "[stock] engine up in 9.0 s; warm-up\n"]      # killed before its result: the log has it
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
    assert bench.run_engine(bench.parse_args(["--model", str(tmp_path)]), "plugin") == {"engine": "plugin",
                                                                                          "plugin_log": []}
    assert child.killed and "did not exit" in capsys.readouterr().out


# ----------------------------------------------------------------------------- --tail
def test_tail_cases_prompts_and_decode_step_arithmetic(tmp_path):
    assert bench.TAIL_CASES == tuple((b, ctx) for ctx in (1024, 8192, 32768) for b in (1, 4, 16))
    assert bench.TAIL_DECODE == 256 and bench.TAIL_GOAL == 0.9
    prompts = bench.tail_prompts(4, 1024, vocab=1000)
    assert [len(p) for p in prompts] == [1024] * 4 and len({tuple(p) for p in prompts}) == 4
    assert all(0 <= t < 1000 for p in prompts for t in p) and bench.tail_prompts(4, 1024, 1000) == prompts
    assert bench.tail_prompts(1, 1024, 1000) != prompts[:1]          # each case its own prompts
    assert bench.decode_ms(short_s=0.5, long_s=0.5 + 256 * 0.004) == pytest.approx(4.0)
    (tmp_path / "config.json").write_text("{}")
    assert bench.parse_args(["--model", str(tmp_path), "--tail"]).repeats == 3
    assert bench.parse_args(["--model", str(tmp_path)]).repeats == 1
    assert bench.parse_args(["--model", str(tmp_path), "--tail", "--repeats", "5"]).repeats == 5


class _Clock:
    now = 0.0

    def perf_counter(self):
        return self.now


def test_tail_child_warms_up_then_times_prefill_and_decode_per_case(tmp_path, monkeypatch, capsys):
    """The engine process: model length for the longest case, one untimed warm-up on the smallest
    case, then per case and repeat a prefill-only and a 1 + TAIL_DECODE generate, each from a reset
    prefix cache; on a fake clock, one engine step a token (prefill 1 us a prompt token, decode 4 +
    0.1 B ms a step, and one 50 ms hiccup in every decode: the steps' median ignores it, the
    generates' difference does not)."""
    clock, vocab = _Clock(), 5000

    class Engine:
        def get_num_unfinished_requests(self):
            return 1

        def step(self):
            clock.now += self.seconds.pop(0)

    class LLM:
        calls, fresh, llm_engine = [], False, Engine()

        def reset_prefix_cache(self):
            self.fresh = True

        def generate(self, prompts, params, use_tqdm):
            ids = [p["prompt_token_ids"] for p in prompts]
            (n,) = set(params)
            assert len({tuple(p) for p in ids}) == len(ids) and max(max(p) for p in ids) < vocab
            self.calls.append((len(ids), {len(p) for p in ids}, n, self.fresh))
            decode = [(4 + 0.1 * len(ids)) * 1e-3] * (n - 1)
            self.llm_engine.seconds = [len(ids) * len(ids[0]) * 1e-6] + [s + 0.05 * (i == 1) for i, s in enumerate(decode)]
            for _ in range(n):
                self.llm_engine.step()
            self.fresh = False
            return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=[0] * n)]) for _ in ids]
    llm, lengths = LLM(), []
    monkeypatch.setitem(sys.modules, "transformers", SimpleNamespace(
        AutoTokenizer=SimpleNamespace(from_pretrained=lambda path: [None] * vocab)))
    monkeypatch.setattr(bench, "build_llm", lambda args, engine, longest: lengths.append(longest) or llm)
    monkeypatch.setattr(bench, "params_for", lambda engine, max_tokens: max_tokens)
    monkeypatch.setattr(bench, "time", SimpleNamespace(perf_counter=clock.perf_counter))
    (tmp_path / "config.json").write_text("{}")
    bench.run_child(bench.parse_args(["--model", str(tmp_path), "--tail", "--repeats", "2", "--child", "plugin"]))

    assert lengths[0] >= 32768 + 1 + 256 and lengths[0] <= 40960       # the checkpoint's max_position_embeddings
    assert llm.calls[0] == (1, {1024}, 257, False)                        # warm-up: untimed, smallest case
    assert llm.calls[1:] == [(b, {ctx}, n, True) for b, ctx in bench.TAIL_CASES for _ in range(2) for n in (1, 257)]
    out = capsys.readouterr().out.splitlines()
    assert "[plugin] tail B=16 context=32768 repeat 2/2: prefill 0.524 s, decode 5.600 ms/step" in out
    result = json.loads(out[-1].removeprefix("@@result "))
    assert result["engine"] == "plugin" and [(c["b"], c["ctx"]) for c in result["cases"]] == list(bench.TAIL_CASES)
    for case in result["cases"]:
        assert case["prefill_s"] == pytest.approx([case["b"] * case["ctx"] * 1e-6] * 2)
        assert case["decode_ms"] == pytest.approx([4 + 0.1 * case["b"]] * 2)
        assert case["decode_ms_difference"] == pytest.approx([4 + 0.1 * case["b"] + 50 / 256] * 2)
    assert "step" not in vars(llm.llm_engine)                             # the step clock unwrapped


def _tail_result(engine, i):
    """Round i's fake engine: stock's decode ms [10, 12] + k + 4 i for case k; the plugin's
    11 + k + i, but 1.5x that in the last case (B=16, 32k: below the goal)."""
    def ms(k):
        if engine == "stock":
            return [10.0 + k + 4 * i, 12.0 + k + 4 * i]
        return [(11.0 + k + i) * (1.5 if k == 8 else 1.0)] * 2
    return {"engine": engine, "engine_start_s": 30.0 + i, "cases": [
        {"b": b, "ctx": ctx, "prefill_s": [0.5, 0.7], "decode_ms": ms(k)} for k, (b, ctx) in enumerate(bench.TAIL_CASES)]}


def test_tail_rounds_pool_medians_ratios_and_json(tmp_path, monkeypatch, capsys):
    (tmp_path / "config.json").write_text("{}")
    order = []

    def fake_engine(args, engine, name):
        order.append(name)
        assert args.tail and args.repeats == 3
        return _tail_result(engine, int(name[-1]) - 1)
    monkeypatch.setattr(bench, "run_engine", fake_engine)
    out = tmp_path / "t.json"
    bench.main(["--model", str(tmp_path), "--tail", "--rounds", "2", "--json", str(out)])
    assert order == ["stock-1", "plugin-1", "plugin-2", "stock-2"]                     # ABBA
    doc = json.loads(out.read_text())
    assert set(doc) == {"device", "date", "args", "results", "rounds", "tail"}
    assert doc["results"]["plugin"] == {"engine": "plugin", "engine_start_s": 30.5, "wall_s": pytest.approx(
        sum(r["plugin"]["wall_s"] for r in doc["rounds"]))}
    tail = doc["tail"]
    assert tail["decode_steps"] == 256 and tail["goal"] == 0.9 and len(tail["cases"]) == 9
    first, third, last = tail["cases"][0], tail["cases"][2], tail["cases"][8]
    assert (first["b"], first["ctx"], first["stock"]["decode_ms"], first["plugin"]["decode_ms"]) == (1, 1024, 13.0, 11.5)
    assert first["plugin_speed"] == 13.0 / 11.5 and first["plugin_speed_per_round"] == [1.0, 15.0 / 12.0]
    assert first["stock"]["prefill_s"] == 0.6 and third["stock"]["decode_tokens_per_s"] == 16e3 / 15.0
    assert (last["b"], last["ctx"], last["plugin"]["decode_ms"]) == (16, 32768, 29.25)
    printed = capsys.readouterr().out
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in printed.splitlines() if line.startswith("| ")]
    assert rows[0][:4] == ["B", "context", "stock ms/step", "plugin ms/step"] and len(rows) == 10
    assert rows[1] == ["1", "1,024", "13.000", "11.500", "77", "87", "0.600", "0.600", "1.130", "1.000, 1.250"]
    assert "goal >= 0.9 at every B and context (issue 26): 8 of 9 cases; lowest 0.718 (B=16, context 32,768)" \
        in printed


def test_the_child_gets_its_settings_and_flags(tmp_path, monkeypatch):
    argvs = []

    class Child:
        stdout, returncode = iter(['@@result {"engine": "stock"}\n']), 0

        def wait(self, timeout=None):
            return 0
    envs = []
    monkeypatch.setattr(bench.subprocess, "Popen", lambda argv, env, **k: argvs.append(argv[2:]) or envs.append(env)
                        or Child())
    monkeypatch.delenv("CONSISTENT_OPS_PDL", raising=False)
    (tmp_path / "config.json").write_text("{}")
    bench.run_engine(bench.parse_args(["--model", str(tmp_path), "--tail", "--rounds", "2"]), "stock")
    assert "--tail" in argvs[0] and "--repeats=3" in argvs[0] and "--profile" not in argvs[0]
    assert not [a for a in argvs[0] if a.endswith("=None") or a.startswith(("--cases", "--host-times", "--load-format"))]  # unset: absent
    assert not [a for a in argvs[0] if a.startswith(("--rounds", "--json", "--logs", "--engines"))]
    assert argvs[0][-2:] == ["--child", "stock"]
    Child.stdout = iter(['@@result {"engine": "stock"}\n'])
    bench.run_engine(bench.parse_args(["--model", str(tmp_path), "--profile"]), "stock")
    assert "--profile" in argvs[1] and "--tail" not in argvs[1] and "--repeats=1" in argvs[1]
    # a profile times each kernel alone (PDL off), a timing run keeps the default (on)
    assert envs[1]["CONSISTENT_OPS_PDL"] == "0" and "CONSISTENT_OPS_PDL" not in envs[0]
    Child.stdout = iter(['@@result {"engine": "stock"}\n'])
    bench.run_engine(bench.parse_args(["--model", str(tmp_path), "--tail", "--cases", "1x1024", "--host-times"]), "stock")
    assert "--cases=1x1024" in argvs[2] and "--host-times" in argvs[2]
    Child.stdout = iter(['@@result {"engine": "stock"}\n'])
    bench.run_engine(bench.parse_args(["--model", str(tmp_path), "--tail", "--load-format", "dummy"]), "stock")
    assert "--load-format=dummy" in argvs[3]


def test_dummy_weights_reach_the_engine_and_only_when_asked(tmp_path, monkeypatch):
    """--load-format dummy (a checkpoint of config and tokenizer alone, the full 48-layer shape):
    vLLM draws the weights; without it vLLM's default (the checkpoint's files)."""
    monkeypatch.setitem(sys.modules, "vllm", SimpleNamespace(LLM=lambda **kw: kw))
    (tmp_path / "config.json").write_text("{}")
    dummy = bench.build_llm(bench.parse_args(["--model", str(tmp_path), "--tail", "--load-format", "dummy"]),
                            "stock", 2048)
    files = bench.build_llm(bench.parse_args(["--model", str(tmp_path), "--tail"]), "stock", 2048)
    assert dummy["load_format"] == "dummy" and "load_format" not in files and dummy["max_model_len"] == 2048


def test_tail_with_profile_is_refused_in_one_line(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    r = subprocess.run([sys.executable, str(SCRIPT), "--model", str(tmp_path), "--tail", "--profile"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.strip() == "error: --tail with --profile: run them separately"


@pytest.mark.parametrize("argv, message", [
    (["--tail", "--cases", "1x1024,16"], "--cases 1x1024,16: give BxCONTEXT pairs of positive integers, "
                                         "comma-separated (e.g. 1x1024,16x32768)"),
    (["--tail", "--cases", "0x1024"], "--cases 0x1024: give BxCONTEXT pairs of positive integers, "
                                      "comma-separated (e.g. 1x1024,16x32768)"),
    (["--cases", "1x1024"], "--cases without --tail: add --tail"),
    (["--host-times"], "--host-times without --tail: add --tail"),
    (["--gpu-memory-utilization", "95"], "--gpu-memory-utilization 95.0: give a fraction of the GPU's memory "
                                         "in (0, 1], e.g. 0.95"),
    (["--gpu-memory-utilization", "0"], "--gpu-memory-utilization 0.0: give a fraction of the GPU's memory "
                                        "in (0, 1], e.g. 0.95"),
])
def test_bad_cases_host_times_without_tail_or_memory_fraction_are_refused_in_one_line(tmp_path, argv, message):
    (tmp_path / "config.json").write_text("{}")
    r = subprocess.run([sys.executable, str(SCRIPT), "--model", str(tmp_path), *argv],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.strip() == f"error: {message}"


def test_host_times_split_each_decode_step_by_function_per_case(tmp_path, monkeypatch, capsys):
    """--cases picks the cases (the warm-up takes the smallest); --host-times wraps HOST_TIMED's
    functions on their classes for the run and reports, per case, each one's median microseconds
    over the decode steps of every repeat (a step that makes no call counts 0); on a fake clock where
    a step spends 300 us scheduling and 100 + 10 B us in the runner, of which 40 us in a nested
    function at every other step; then unwraps them."""
    clock, vocab = _Clock(), 5000

    class Runner:
        def execute_model(self, b, nested):
            clock.now += (100 + 10 * b) * 1e-6
            if nested:
                self.sample(b)

        def sample(self, b):
            clock.now += 40e-6

    class Scheduler:
        def schedule(self):
            clock.now += 300e-6
    fake = SimpleNamespace(Runner=Runner, Scheduler=Scheduler)
    originals = dict(vars(Runner))
    monkeypatch.setitem(sys.modules, "fake_vllm_runner", fake)
    monkeypatch.setattr(bench, "HOST_TIMED", ("fake_vllm_runner:Scheduler.schedule", "fake_vllm_runner:Runner.execute_model",
                                              "fake_vllm_runner:Runner.sample", "fake_vllm_runner:Runner.missing",
                                              "no_such_module:Runner.execute_model"))

    class Engine:
        runner, scheduler, n = Runner(), Scheduler(), 0

        def get_num_unfinished_requests(self):
            return 1

        def step(self):
            self.n += 1
            self.scheduler.schedule()
            self.runner.execute_model(self.b, self.n % 2)

    class LLM:
        llm_engine, calls = Engine(), []

        def reset_prefix_cache(self):
            pass

        def generate(self, prompts, params, use_tqdm):
            (n,) = set(params)
            self.calls.append((len(prompts), len(prompts[0]["prompt_token_ids"]), n))
            self.llm_engine.b = len(prompts)
            for _ in range(n):
                self.llm_engine.step()
            return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=[0] * n)]) for _ in prompts]
    llm = LLM()
    monkeypatch.setitem(sys.modules, "transformers", SimpleNamespace(
        AutoTokenizer=SimpleNamespace(from_pretrained=lambda path: [None] * vocab)))
    monkeypatch.setattr(bench, "build_llm", lambda args, engine, longest: llm)
    monkeypatch.setattr(bench, "params_for", lambda engine, max_tokens: max_tokens)
    monkeypatch.setattr(bench, "time", SimpleNamespace(perf_counter=clock.perf_counter))
    (tmp_path / "config.json").write_text("{}")
    args = bench.parse_args(["--model", str(tmp_path), "--tail", "--cases", "4x8192,1x1024", "--host-times",
                             "--repeats", "2", "--child", "plugin"])
    bench.run_child(args)

    assert llm.calls[0] == (1, 1024, 257)                                  # warm-up: the smallest case
    assert llm.calls[1:] == [(b, ctx, n) for b, ctx in ((4, 8192), (1, 1024)) for _ in range(2) for n in (1, 257)]
    result = json.loads(capsys.readouterr().out.splitlines()[-1].removeprefix("@@result "))
    cases = result["cases"]
    assert [(c["b"], c["ctx"]) for c in cases] == [(4, 8192), (1, 1024)]
    for case in cases:
        us = case["host_us"]
        assert set(us) == {"Scheduler.schedule", "Runner.execute_model", "Runner.sample"}
        assert us["Scheduler.schedule"] == pytest.approx(300)
        assert us["Runner.execute_model"] == pytest.approx(100 + 10 * case["b"] + 20)   # median of x and x + 40
        assert us["Runner.sample"] == pytest.approx(20)
    assert dict(vars(Runner)) == originals and "schedule" in vars(Scheduler)    # unwrapped
    Runner().execute_model(1, True)

    rounds = [{"stock": result, "plugin": result}]
    bench.print_tail(bench.tail_summary(rounds, ["stock", "plugin"]), ["stock", "plugin"])
    printed = capsys.readouterr().out
    assert "host us a decode step, B=4 context 8,192 (inclusive; engine in-process):" in printed
    assert "  Runner.execute_model" + " " * 38 + "     160.0     160.0" in printed


def test_a_case_the_kv_cache_cannot_hold_at_once_is_skipped_not_timed(capsys):
    """On an H100 the stock engine held 62,787 tokens beside the 48-layer model's weights: B=16 x 8k
    then decoded with sequences queued (6.5 ms a step against 16.6 at B=16 x 1k, 2026-12-06). Such a
    case is skipped, with the tokens it needs, by the engine that cannot hold it, and left out of the
    ratios; a case that fits is timed (the companion)."""
    kv = (3924, 16)                                                      # the H100's stock engine
    assert bench.too_big(kv, 4, 8192) is None and bench.too_big(None, 16, 32768) is None
    assert bench.too_big(kv, 16, 8192) == ("needs 135,424 tokens of KV cache at once, the engine holds 62,784 "
                                          "(more with a higher --gpu-memory-utilization)")

    class Engine:
        vllm_config = SimpleNamespace(cache_config=SimpleNamespace(num_gpu_blocks=3924, block_size=16))

        def step(self):
            raise AssertionError("a skipped case ran")

    llm = SimpleNamespace(llm_engine=Engine())
    stock = bench.time_tail(llm, "stock", 3, 5000, [(16, 8192)])
    assert stock == [{"b": 16, "ctx": 8192, "skipped": bench.too_big(kv, 16, 8192)}]
    assert "[stock] tail B=16 context=8192: skipped: needs 135,424 tokens" in capsys.readouterr().out
    plugin = [{"b": 16, "ctx": 8192, "prefill_s": [3.4], "decode_ms": [12.9]}]
    fits = {"b": 1, "ctx": 1024, "prefill_s": [0.1], "decode_ms": [4.8]}
    rounds = [{"stock": {"cases": [fits] + stock}, "plugin": {"cases": [dict(fits, decode_ms=[6.0])] + plugin}}]
    tail = bench.tail_summary(rounds, ["stock", "plugin"])
    assert tail["cases"][1] == {"b": 16, "ctx": 8192, "skipped": stock[0]["skipped"]}
    assert tail["cases"][0]["plugin_speed"] == 4.8 / 6.0
    bench.print_tail(tail, ["stock", "plugin"])
    printed = capsys.readouterr().out
    assert f"| 16 | 8,192 | skipped: {stock[0]['skipped']} |" in printed
    assert "(issue 26): 0 of 1 cases (1 more skipped); lowest 0.800 (B=1, context 1,024)" in printed
    assert bench._tail_note({"cases": [fits] + stock}) == "decode ms/step B=1 1k 4.800, B=16 8k skipped"


@pytest.mark.parametrize("mem, passed", [("0.95", ["--gpu-memory-utilization", "0.95"]), ("", [])])
def test_the_suite_passes_gpu_vllm_mem_to_each_benchmark_step(tmp_path, mem, passed):
    """GPU_VLLM_MEM reaches bench_vllm_gpu.py in the suite's tail48 step (what lets an 80 GB card hold
    B=4 x 32k beside the 48-layer weights); unset, the benchmark's own default stands (the companion).
    A python3 on PATH that records its arguments stands in for the device's."""
    shim, model = tmp_path / "bin", tmp_path / "model48"
    shim.mkdir(), model.mkdir()
    (model / "config.json").write_text("{}")
    (shim / "python3").write_text('#!/bin/sh\nprintf "%s\\n" "$@" > "$ARGS_OUT"\n')
    (shim / "python3").chmod(0o755)
    env = {"PATH": f"{shim}:/usr/bin:/bin", "GPU_VLLM_MEM": mem, "GPU_VLLM_TAIL_MODEL": str(model),
           "ARGS_OUT": str(tmp_path / "args")}
    r = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_vllm_suite.sh"), "tail48", str(tmp_path / "out")],
                       env=env, capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    args = (tmp_path / "args").read_text().split("\n")
    assert args[0] == "benchmarks/bench_vllm_gpu.py" and args[1:3 if passed else 1] == passed
    assert args[len(passed) + 1:len(passed) + 3] == ["--model", str(model)]
