"""The job's console: one row per training step and a final summary, read from the
metrics file that verl's ``file`` logger writes (one JSON line per step, ``{"step": N,
"data": {...}}`` with verl's and our metric keys unchanged). verl trains inside a Ray
actor; its file is the one channel that reaches the driver without touching verl's
trainer. Used by the recipe (main_ppo) and by a swap-in job that names
``true_on_policy.metrics_file`` (verl/swap_in.py).
"""
from __future__ import annotations

import atexit
import json
import threading
from pathlib import Path

from omegaconf import DictConfig, OmegaConf, open_dict

_LOGGER_PATH = "ray_kwargs.ray_init.runtime_env.env_vars.VERL_FILE_LOGGER_PATH"
# (column, verl metric key, format); the step comes from the logger record itself.
LOGDIFF, CONTRACT = "true_on_policy/logdiff_max", "true_on_policy/contract_match"
PROBS_DIFF = "training/rollout_probs_diff_max"   # verl's own (on probabilities): the stock baseline's gap
COLUMNS = (("reward", "critic/score/mean", "{:.3f}"),
           ("resp_len", "response_length/mean", "{:.1f}"),
           ("logdiff_max", LOGDIFF, "{:.3e}"),
           ("frac_exact", "true_on_policy/frac_exact", "{:.4f}"),
           ("contract", CONTRACT, "{:.0f}"),
           ("step_s", "timing_s/step", "{:.1f}"))


class Console:
    """Follows the metrics file while verl trains (a daemon thread): a row per step, then
    the summary on exit."""

    def __init__(self, path: Path, rows: bool = True):
        self.path, self.rows, self.records = path, rows, []
        self._stop, self._offset = threading.Event(), 0
        self._thread = threading.Thread(target=self._follow, daemon=True)

    def __enter__(self):
        if self.rows:
            print(self.header(), flush=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self._drain()  # rows written after the last poll
        if self.records:   # (a job that stopped before its first step has its error instead)
            print(self.summary(), flush=True)

    @staticmethod
    def header() -> str:
        return " | ".join([f"{'step':>4}"] + [f"{name:>{max(len(name), 9)}}" for name, _, _ in COLUMNS])

    @staticmethod
    def row(record: dict) -> str:
        data, cells = record.get("data", {}), [f"{record.get('step', '?'):>4}"]
        for name, key, fmt in COLUMNS:
            value = data.get(key)
            cells.append(f"{fmt.format(value) if value is not None else '-':>{max(len(name), 9)}}")
        return " | ".join(cells)

    def summary(self) -> str:
        """Steps run, the worst log-prob gap over them, whether every step ran one contract."""
        data = [r.get("data", {}) for r in self.records]
        worst = [d[LOGDIFF] for d in data if LOGDIFF in d]
        contract = [d[CONTRACT] for d in data if CONTRACT in d]
        seconds = sum(d.get("timing_s/step", 0.0) for d in data)
        stock = [d[PROBS_DIFF] for d in data if PROBS_DIFF in d]
        gap = (f"logdiff_max {max(worst):.3e} over all steps" if worst else
               f"no true_on_policy metrics (plugin off), verl's rollout_probs_diff_max {max(stock):.3e}" if stock
               else "no true_on_policy metrics")
        agree = (", contract_match 1 every step" if contract and min(contract) == 1.0 else
                 ", contract_match 0 at some step" if contract else "")
        return (f"[true_on_policy] {len(data)} step(s) in {seconds:.1f} s: {gap}{agree}. "
                f"Metrics (verl's and ours, one JSON line per step): {self.path}")

    def _follow(self):
        while not self._stop.wait(1.0):
            self._drain()

    def _drain(self):
        if not self.path.is_file():
            return
        with open(self.path, "rb") as f:
            f.seek(self._offset)
            for line in f:
                if not line.endswith(b"\n"):
                    break  # a row still being written
                self._offset += len(line)
                record = json.loads(line)
                if "timing_s/step" not in record.get("data", {}):
                    continue  # a validation pass (e.g. val_before_train's): in the file, not a step row
                self.records.append(record)
                if self.rows:
                    print(self.row(self.records[-1]), flush=True)


def route_metrics(config: DictConfig, path: Path) -> None:
    """verl's file logger writes every step's metrics to ``path``, in whatever process
    the trainer runs (the Ray runtime env reaches it), next to any logger the config asks
    for (console, wandb, tensorboard)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)   # verl's logger truncates it anyway: no old rows replayed
    with open_dict(config):
        loggers = config.trainer.logger
        loggers = [loggers] if isinstance(loggers, str) else list(loggers)
        if "file" not in loggers:
            loggers.append("file")
        config.trainer.logger = loggers
        OmegaConf.update(config, _LOGGER_PATH, str(path), force_add=True)


def routed(config: DictConfig) -> str | None:
    """The metrics file verl's file logger is routed to by ``route_metrics``, if any."""
    return OmegaConf.select(config, _LOGGER_PATH, default=None)


def follow(config: DictConfig, path: Path) -> None:
    """A swap-in job (nothing wraps verl's main): rows while it trains, the summary at exit."""
    route_metrics(config, path)
    atexit.register(Console(path).__enter__().__exit__)
