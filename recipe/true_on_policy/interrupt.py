"""Stopping a job as cleanly as it finishes: SIGINT (Ctrl-C) or SIGTERM (a scheduler) to
the driver of a recipe or swap-in job ends it within seconds, exit code 128 + the signal
(130 / 143), with one line naming the last finished step, the metrics file and the last
checkpoint; no traceback, and no Ray or vLLM process of the job left running.

Left to Python and Ray, a SIGINT raised ``KeyboardInterrupt`` wherever the driver happened
to be (a traceback through Ray's internals, exit 1) or was lost in a wait, and the job ran
on to exit 0. The handler instead takes the whole process tree down itself: every process
of the job (Ray's GCS, raylet and workers, verl's actors, the vLLM server and its engine
processes) descends from the driver, so terminating the driver's descendants, then killing
any left after a grace period, leaves nothing behind. What those processes print while
they go is dropped, so the job's last line is the handler's.
"""
from __future__ import annotations

import functools
import json
import os
import signal
import threading
from pathlib import Path

import psutil

GRACE_S = 10.0        # SIGTERM -> SIGKILL for the job's processes (a wedged vLLM worker)
EXIT = {signal.SIGINT: 130, signal.SIGTERM: 143}
RAY_CORE = ("gcs_server", "raylet")


def arm(config) -> None:
    """In the driver's main thread, before Ray starts (the recipe's ``run``, the swap-in's
    driver hook; idempotent): the handler for SIGINT and SIGTERM, with the job's metrics
    file (verl's file logger, if on) and checkpoint dir."""
    from omegaconf import OmegaConf

    from .console import routed
    if threading.current_thread() is not threading.main_thread():
        return                               # (signal handlers belong to the main thread)
    loggers = OmegaConf.select(config, "trainer.logger", default=[]) or []
    path = routed(config) or (os.environ.get("VERL_FILE_LOGGER_PATH") if "file" in loggers else None)
    install(Path(path).absolute() if path else None, OmegaConf.select(config, "trainer.default_local_dir"),
            OmegaConf.select(config, "trainer.save_freq"))


def install(metrics: Path | None, checkpoints: str | None, save_freq: int | None) -> None:
    once = threading.Lock()

    def teardown(signum):
        out = os.dup(1)
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, 1)                     # the dying processes' last words (Ray streams
        os.dup2(null, 2)                     # them through this process) are not the job's
        # Ray's GCS and raylet last: this process's Ray client exits (code 1) once they go.
        stop_descendants(keep=RAY_CORE)
        step = last_step(metrics) if metrics else None
        os.write(out, (summary(signal.Signals(signum).name, step, metrics, checkpoints, save_freq) + "\n").encode())
        for p in psutil.Process().children(recursive=True):
            _signal(p, signal.SIGKILL)
        os._exit(EXIT[signum])

    def on_signal(signum, _frame=None):
        if not once.acquire(blocking=False):
            return                           # a second Ctrl-C must not cut the teardown short
        # Not a daemon: should the main thread end meanwhile (its Ray call failing as the job's
        # actors go), the interpreter waits for this thread, which sets the exit code.
        worker = threading.Thread(target=teardown, args=(signum,), name="true_on_policy-teardown")
        worker.start()
        worker.join()

    global _handler
    _handler = on_signal
    _take_signals()
    _after_ray_init()
    # Python runs a handler only when the main thread runs Python code, and a driver blocked
    # in Ray's C++ wait may not for a long time: the signal's number also reaches a pipe at
    # once (the interpreter's wake-up fd), where a thread of ours acts on it.
    read, write = os.pipe()
    os.set_blocking(write, False)
    signal.set_wakeup_fd(write, warn_on_full_buffer=False)
    threading.Thread(target=_watch, args=(read, on_signal), daemon=True, name="true_on_policy-interrupt").start()


def _watch(read: int, on_signal) -> None:
    while (signum := os.read(read, 1)[0]) not in EXIT:   # another signal with a Python handler
        pass
    on_signal(signum)


_handler = None


def _take_signals() -> None:
    for sig in EXIT:
        signal.signal(sig, _handler)


def _after_ray_init() -> None:
    """``ray.init`` sets SIGTERM handlers of its own (the driver's ``sys.exit``, the head
    node's): ours are set again once it returns."""
    import ray
    init = ray.init
    if getattr(init, "_true_on_policy", False):
        return

    @functools.wraps(init)
    def ray_init(*args, **kwargs):
        try:
            return init(*args, **kwargs)
        finally:
            _take_signals()

    ray_init._true_on_policy = True
    ray.init = ray_init


def stop_descendants(grace: float | None = None, keep: tuple[str, ...] = ()) -> None:
    """Terminate every descendant of this process but those named in ``keep``, kill those
    still alive after ``grace`` seconds; repeated until none is left (a parent may start a
    child while it goes)."""
    for _ in range(5):
        procs = [p for p in psutil.Process().children(recursive=True) if _name(p) not in keep]
        if not procs:
            return
        for p in procs:
            _signal(p, signal.SIGTERM)
        stop(procs, GRACE_S if grace is None else grace)


def _name(p: psutil.Process) -> str:
    try:
        return p.name()
    except psutil.Error:
        return ""


def _signal(p: psutil.Process, sig) -> None:
    try:
        p.send_signal(sig)
    except psutil.NoSuchProcess:
        pass


def stop(procs: list[psutil.Process], grace: float) -> list[psutil.Process]:
    """Give ``procs`` ``grace`` seconds to exit, then kill the rest; returns those it killed."""
    _, alive = psutil.wait_procs(procs, timeout=grace)
    for p in alive:
        _signal(p, signal.SIGKILL)
    psutil.wait_procs(alive, timeout=5)
    return alive


def last_step(metrics: Path) -> int | None:
    """The last training step in verl's metrics file; a line cut short by the kill is
    removed, so the file stays valid JSON line by line."""
    if not metrics.is_file():
        return None
    raw = metrics.read_bytes()
    whole = raw[:raw.rfind(b"\n") + 1]
    if len(whole) != len(raw):
        metrics.write_bytes(whole)
    steps = [r["step"] for r in map(json.loads, whole.splitlines()) if "timing_s/step" in r.get("data", {})]
    return steps[-1] if steps else None


def last_checkpoint(checkpoints: str | None) -> Path | None:
    """verl's ``latest_checkpointed_iteration.txt`` in ``trainer.default_local_dir``."""
    if not checkpoints:
        return None
    root = Path(checkpoints).expanduser().absolute()
    try:
        step = int((root / "latest_checkpointed_iteration.txt").read_text().strip())
    except (OSError, ValueError):
        return None
    return root / f"global_step_{step}"


def summary(name: str, step: int | None, metrics: Path | None, checkpoints: str | None,
            save_freq: int | None) -> str:
    done = f"at step {step}" if step is not None else "before its first step finished"
    where = (f"metrics of steps up to {step}: {metrics}" if metrics and step is not None else
             f"metrics: {metrics} (no step row)" if metrics else "no metrics file (true_on_policy.metrics_file)")
    ckpt = last_checkpoint(checkpoints)
    saved = (f"last checkpoint: {ckpt}" if ckpt else
             f"no checkpoint (trainer.save_freq={save_freq})" if not save_freq or save_freq <= 0 else
             f"no checkpoint yet in {checkpoints}")
    return f"[true_on_policy] interrupted ({name}) {done}; {where}; {saved}. Ray and vLLM processes stopped."
