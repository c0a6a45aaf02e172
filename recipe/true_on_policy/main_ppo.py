"""The recipe's entry point: verl's PPO/GRPO trainer with the recipe's config.

    python -m true_on_policy.main_ppo              # embedded default (configs/preset/tiny_grpo.yaml)
    python -m true_on_policy.main_ppo trainer.total_training_steps=5 actor_rollout_ref.rollout.n=8
    python -m true_on_policy.main_ppo ~preset actor_rollout_ref.model.path=... data.train_files=...

It extends ``verl.trainer.main_ppo`` and never copies it: hydra composes configs/
(verl's ppo_trainer + the ``true_on_policy:`` keys), ``prepare`` fills in what the
config leaves null (the tiny model, the synthetic task's files) and, on a host with no
accelerator, the CPU settings of ``true_on_policy.verl.cpu_support`` (keys given on the
command line win); then verl's own ``main`` runs with that config. verl's full metrics go to the metrics
file (``true_on_policy.metrics_file``, default ``metrics.jsonl`` in the run's output dir)
through verl's file logger; the console shows one row per step read from it (reward,
response length, our log-prob gap, the exact fraction, contract match, step time) and a
final summary naming the file. verl's config dump and known-harmless warnings are
off unless ``true_on_policy.verbose=true`` (``true_on_policy.quiet``).
"""
from __future__ import annotations

import logging
import os
from importlib.metadata import entry_points
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf, open_dict

from true_on_policy import interrupt, quiet, sync_check
from true_on_policy.console import Console, route_metrics

log = logging.getLogger("true_on_policy")

PLUGIN = "true_on_policy.verl.register"


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
        _fill_calculator_tool(config.actor_rollout_ref.rollout.multi_turn)
    from true_on_policy.verl.cpu_support import known_rollout_blocker, prepare_job
    prepare_job(config, explicit)
    blocker = known_rollout_blocker(config)
    if blocker:
        log.warning("true_on_policy: %s", blocker)


def _fill_calculator_tool(multi_turn) -> None:
    """The calculator call format without a tool file: the recipe's calculator."""
    from true_on_policy import tool_calls
    if multi_turn.get("format") == tool_calls.FORMAT and not multi_turn.get("function_tool_path"):
        multi_turn.function_tool_path = str(tool_calls.TOOL_FILE)


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


# ----------------------------------------------------------------------------- main
def metrics_file(config: DictConfig, run_dir: Path) -> Path:
    """``true_on_policy.metrics_file``, or ``metrics.jsonl`` in the run's output dir."""
    given = config.true_on_policy.get("metrics_file")
    return Path(str(given)).expanduser().absolute() if given else run_dir / "metrics.jsonl"


def run(config: DictConfig, explicit: set[str] = frozenset(), metrics: Path | None = None) -> None:
    """prepare + verl's main. ``metrics``: the metrics file (the console's source)."""
    from verl.trainer import main_ppo as verl_main_ppo
    prepare(config, explicit)
    if config.true_on_policy.get("check_sync", False):  # before Ray starts: every process inherits it
        os.environ[sync_check.ENV] = "1"
    if not config.true_on_policy.get("verbose", False):
        quiet.apply()
    print(f"[true_on_policy] model {config.actor_rollout_ref.model.path}; starting Ray, the trainer "
          f"and the rollout engines", flush=True)
    if metrics is None:
        interrupt.arm(config)
        verl_main_ppo.main(config)  # hydra passes a given config straight to verl's main
        return
    route_metrics(config, metrics)
    interrupt.arm(config)
    with Console(metrics, rows=config.true_on_policy.step_table):
        verl_main_ppo.main(config)


@hydra.main(config_path="pkg://true_on_policy.configs", config_name="true_on_policy", version_base="1.3")
def main(config: DictConfig) -> None:
    hydra_cfg = HydraConfig.get()
    run(config, override_keys(hydra_cfg.overrides.task), metrics_file(config, Path(hydra_cfg.runtime.output_dir)))


if __name__ == "__main__":
    # The recipe is the true on-policy launcher: TRUE_ON_POLICY=1 unless the caller says
    # otherwise (TRUE_ON_POLICY=0 runs the same job stock, the baseline). Set before
    # hydra imports verl, whose plugin hook reads it in this and every later process.
    os.environ.setdefault("TRUE_ON_POLICY", "1")
    main()
