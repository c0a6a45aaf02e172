"""The recipe's console (issue 9): a row per step and a summary read from the metrics
file verl's own file logger writes; the quiet mode's filters drop only the known texts."""
import io
import logging
import os
import types
from contextlib import redirect_stdout

from omegaconf import OmegaConf

from true_on_policy import quiet
from true_on_policy.console import Console, route_metrics
from true_on_policy.main_ppo import metrics_file

STEP = {"critic/score/mean": 0.25, "response_length/mean": 30.5, "true_on_policy/logdiff_max": 0.0,
        "true_on_policy/frac_exact": 1.0, "true_on_policy/contract_match": 1.0, "timing_s/step": 3.0,
        "actor/grad_norm": 0.5}


def test_rows_and_summary_from_verls_file_logger(tmp_path, monkeypatch):
    from verl.utils.tracking import FileLogger
    path = tmp_path / "run" / "metrics.jsonl"
    cfg = OmegaConf.create({"trainer": {"logger": ["console"]}})
    route_metrics(cfg, path)
    assert list(cfg.trainer.logger) == ["console", "file"]
    assert cfg.ray_kwargs.ray_init.runtime_env.env_vars.VERL_FILE_LOGGER_PATH == str(path)
    monkeypatch.setenv("VERL_FILE_LOGGER_PATH", str(path))     # as the runtime env gives it to verl
    out = io.StringIO()
    with redirect_stdout(out), Console(path):
        logger = FileLogger("p", "e")
        for step in (1, 2):
            logger.log(data=STEP, step=step)
        logger.finish()
    lines = [ln for ln in out.getvalue().splitlines() if not ln.startswith("Creating file logger")]  # verl's
    assert lines[0].split() == "step | reward | resp_len | logdiff_max | frac_exact | contract | step_s".split()
    assert [ln.split("|")[0].strip() for ln in lines[1:3]] == ["1", "2"]
    assert lines[1].split("|")[3].strip() == "0.000e+00" and lines[1].split("|")[4].strip() == "1.0000"
    assert lines[3] == (f"[true_on_policy] 2 step(s) in 6.0 s: logdiff_max 0.000e+00 over all steps, "
                        f"contract_match 1 every step. Metrics (verl's and ours, one JSON line per step): {path}")
    assert len(lines) == 4


def test_metrics_file_default_and_given(tmp_path):
    cfg = OmegaConf.create({"true_on_policy": {"metrics_file": None}})
    assert metrics_file(cfg, tmp_path) == tmp_path / "metrics.jsonl"
    cfg.true_on_policy.metrics_file = str(tmp_path / "m" / "x.jsonl")
    assert metrics_file(cfg, tmp_path / "elsewhere") == tmp_path / "m" / "x.jsonl"


def test_quiet_drops_only_known_texts(monkeypatch):
    env = {k: v for k, v in os.environ.items()
           if k not in (quiet.ENV, "PYTHONWARNINGS", "VERL_LOGGING_LEVEL", "TQ_NUM_THREADS")}
    monkeypatch.setattr(os, "environ", env)          # this process's environment stays as it was
    monkeypatch.setattr(quiet, "DUMPS", ())          # no import hooks from a unit test
    quiet.apply()
    assert os.environ[quiet.ENV] == "1" and os.environ["VERL_LOGGING_LEVEL"] == "WARNING"
    assert "ignore:Disabled critic as algorithm.adv_estimator != gae:UserWarning" in os.environ["PYTHONWARNINGS"]
    logger = logging.getLogger("transfer_queue.utils.common")
    try:
        def shown(text):
            return logger.filter(logger.makeRecord(logger.name, logging.WARNING, "f", 1, text, (), None))
        assert not shown("target_num_threads 8 should not exceed total physical CPU cores 2. Setting to 2.")
        assert shown("storage unit lost")                    # any other warning still shows
    finally:
        logger.filters.clear()
    module = types.SimpleNamespace(pprint=print)
    quiet.skip_dumps(module)
    out = io.StringIO()
    with redirect_stdout(out):
        module.pprint({"trainer": {}})
    assert out.getvalue() == ""


def test_summary_of_a_stock_run_names_verls_gap(tmp_path):
    console = Console(tmp_path / "m.jsonl")
    console.records = [{"step": 1, "data": {"training/rollout_probs_diff_max": 0.25, "timing_s/step": 2.0}}]
    assert console.summary().startswith("[true_on_policy] 1 step(s) in 2.0 s: no true_on_policy metrics "
                                        "(plugin off), verl's rollout_probs_diff_max 2.500e-01.")
