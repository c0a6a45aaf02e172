"""The recipe's entry point: verl's PPO/GRPO trainer with the recipe's config.

    python -m true_on_policy.main_ppo              # embedded default (configs/preset/tiny_grpo.yaml)
    python -m true_on_policy.main_ppo trainer.total_training_steps=5 actor_rollout_ref.rollout.n=8
    python -m true_on_policy.main_ppo ~preset actor_rollout_ref.model.path=... data.train_files=...

It extends ``verl.trainer.main_ppo`` and never copies it: hydra composes configs/
(verl's ppo_trainer + the ``true_on_policy:`` keys), ``prepare`` fills in what the
config leaves null (the tiny model, the synthetic task's files) and, on a host with no
accelerator, the CPU settings of ``true_on_policy.verl.cpu_support`` (keys given on the
command line win); then verl's own ``main`` runs with that config. A per-step table
(step, reward, response length, verl's rollout/trainer probability gap, and our log-prob
gap ``true_on_policy/logdiff_max`` once the trainer reports it) is printed from verl's
file logger while it trains.
"""
from __future__ import annotations

import json
import logging
import os
import threading
from importlib.metadata import entry_points
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf, open_dict

from true_on_policy import sync_check

log = logging.getLogger("true_on_policy")

PLUGIN = "true_on_policy.verl.register"
# (column, verl metric key, format); the step comes from the logger record itself.
COLUMNS = (("reward", "critic/score/mean", "{:.3f}"),
           ("resp_len", "response_length/mean", "{:.1f}"),
           ("rollout_probs_diff_max", "training/rollout_probs_diff_max", "{:.3e}"),
           ("logdiff_max", "true_on_policy/logdiff_max", "{:.3e}"),
           ("contract", "true_on_policy/contract_match", "{:.0f}"),
           ("step_s", "timing_s/step", "{:.1f}"))


# ----------------------------------------------------------------------------- prepare
def prepare(config: DictConfig, explicit: set[str] = frozenset()) -> None:
    """Fill the model path and data files the config leaves null, then the CPU settings."""
    _check_plugin()
    top = config.true_on_policy
    cache = Path(top.cache_dir).expanduser()
    with open_dict(config):
        if config.actor_rollout_ref.model.path is None:
            from true_on_policy.make_tiny_model import ensure_tiny_model
            tiny = dict(top.tiny_model)
            config.actor_rollout_ref.model.path = str(ensure_tiny_model(cache, tiny.pop("arch"), **tiny))
        if config.data.train_files is None:
            from true_on_policy.task import ensure_task_data
            train, val = ensure_task_data(cache, **top.task)
            config.data.train_files = str(train)
            if config.data.val_files is None:
                config.data.val_files = str(val)
    from true_on_policy.verl.cpu_support import known_rollout_blocker, prepare_job
    prepare_job(config, explicit)
    blocker = known_rollout_blocker(config)
    if blocker:
        log.warning("true_on_policy: %s", blocker)


def _check_plugin() -> None:
    """verl reaches its worker processes only through its own hooks; without one of them
    the CPU platform (and later the trainer-side registrations) would exist here only."""
    names = {ep.value for ep in entry_points(group="verl.plugins")}
    names |= set(os.environ.get("VERL_USE_EXTERNAL_MODULES", "").split(","))
    if PLUGIN not in names:
        raise RuntimeError(f"{PLUGIN} is not a verl plugin in this environment: reinstall the "
                           f"package (pip install -e .) or set VERL_USE_EXTERNAL_MODULES={PLUGIN}")


def override_keys(overrides) -> set[str]:
    """Config keys named on the command line ("+a.b=1", "++a.b=1", "~a.b" -> "a.b")."""
    from true_on_policy.verl.cpu_support import command_line_keys
    return command_line_keys(overrides)


# ----------------------------------------------------------------------------- step table
class StepTable:
    """One console row per training step, read from verl's ``file`` logger (a JSON line
    per step). verl trains inside a Ray actor; its file is the one channel that reaches
    this driver without touching verl's trainer."""

    def __init__(self, config: DictConfig, path: Path):
        self.path, self._stop, self._offset = path, threading.Event(), 0
        with open_dict(config):
            loggers = config.trainer.logger
            loggers = [loggers] if isinstance(loggers, str) else list(loggers)
            if "file" not in loggers:
                loggers.append("file")
            config.trainer.logger = loggers
            OmegaConf.update(config, "ray_kwargs.ray_init.runtime_env.env_vars.VERL_FILE_LOGGER_PATH",
                             str(path), force_add=True)
        self._thread = threading.Thread(target=self._follow, daemon=True)

    def __enter__(self):
        print(self.header(), flush=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self._drain()  # rows written after the last poll

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
                print(self.row(json.loads(line)), flush=True)


# ----------------------------------------------------------------------------- main
def run(config: DictConfig, explicit: set[str] = frozenset(), table_path: Path | None = None) -> None:
    """prepare + verl's main. ``table_path``: where verl's file logger writes (the table's source)."""
    from verl.trainer import main_ppo as verl_main_ppo
    prepare(config, explicit)
    if config.true_on_policy.get("check_sync", False):  # before Ray starts: every process inherits it
        os.environ[sync_check.ENV] = "1"
    if not config.true_on_policy.step_table or table_path is None:
        verl_main_ppo.main(config)  # hydra passes a given config straight to verl's main
        return
    with StepTable(config, table_path):
        verl_main_ppo.main(config)


@hydra.main(config_path="pkg://true_on_policy.configs", config_name="true_on_policy", version_base="1.3")
def main(config: DictConfig) -> None:
    hydra_cfg = HydraConfig.get()
    run(config, override_keys(hydra_cfg.overrides.task),
        Path(hydra_cfg.runtime.output_dir) / "metrics.jsonl")


if __name__ == "__main__":
    # The recipe is the true on-policy launcher: TRUE_ON_POLICY=1 unless the caller says
    # otherwise (TRUE_ON_POLICY=0 runs the same job stock, the baseline). Set before
    # hydra imports verl, whose plugin hook reads it in this and every later process.
    os.environ.setdefault("TRUE_ON_POLICY", "1")
    main()
