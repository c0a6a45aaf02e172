"""The test suite's processes, found by a mark in their environment (which Ray, vLLM and
multiprocessing hand to every process they start, whatever its session or parent): a job's
(``JOB_MARK``, one value per job) and the whole suite's (``SUITE_MARK``, see conftest.py)."""
import os

import psutil

from true_on_policy.interrupt import stop

JOB_MARK = "TRUE_ON_POLICY_TEST_JOB"
SUITE_MARK = "TRUE_ON_POLICY_TEST_SUITE"


# Helpers Python keeps beside this process until it exits (multiprocessing's, torch's).
HELPERS = ("multiprocessing.resource_tracker", "multiprocessing.forkserver", "compile_worker")


def marked(name: str, value: str) -> list[psutil.Process]:
    """Live processes (not zombies) whose environment holds ``name=value``, but this
    process's own helpers."""
    found = []
    for p in psutil.process_iter():
        try:
            if p.pid == os.getpid() or p.status() == psutil.STATUS_ZOMBIE or p.environ().get(name) != value:
                continue
            if p.ppid() == os.getpid() and any(h in " ".join(p.cmdline()) for h in HELPERS):
                continue
            found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    return found


def describe(p: psutil.Process) -> str:
    try:
        return f"pid {p.pid} {' '.join(p.cmdline())[:160]}"
    except psutil.Error:
        return f"pid {p.pid}"


def reap(value: str, name: str = JOB_MARK, wait: float = 10.0) -> list[str]:
    """Stop every process marked ``name=value`` (given ``wait`` seconds to exit by itself,
    then killed); returns those that were still alive after the wait."""
    procs = marked(name, value)
    names = {p.pid: describe(p) for p in procs}     # (before they go)
    return [names[p.pid] for p in stop(procs, wait)] if procs else []
