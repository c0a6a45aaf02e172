"""Every process the suite starts carries SUITE_MARK in its environment; when the session
ends, none may be left running (a Ray cluster or vLLM server that outlived its test)."""
import os
import uuid

from processes import SUITE_MARK, reap

_MARK = uuid.uuid4().hex


def pytest_configure(config):
    os.environ[SUITE_MARK] = _MARK      # inherited by every process started from here on


def pytest_sessionfinish(session, exitstatus):
    left = reap(_MARK, SUITE_MARK)
    if left:
        print(f"\n[conftest] {len(left)} process(es) of the suite still running at its end (killed now):\n  "
              + "\n  ".join(left))
        session.exitstatus = 1
