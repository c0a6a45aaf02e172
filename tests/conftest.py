"""Every process the suite starts carries SUITE_MARK in its environment; when the session
ends, none may be left running (a Ray cluster or vLLM server that outlived its test). vLLM's
ZMQ sockets go to one directory of the session, removed at its end (vLLM leaves them in /tmp:
~1,200 a run)."""
import os
import shutil
import tempfile
import uuid

from processes import SUITE_MARK, reap

_MARK = uuid.uuid4().hex
_RPC_DIR = tempfile.mkdtemp(prefix="top-vllm-rpc-")


def pytest_configure(config):
    os.environ[SUITE_MARK] = _MARK      # inherited by every process started from here on
    os.environ["VLLM_RPC_BASE_PATH"] = _RPC_DIR


def pytest_sessionfinish(session, exitstatus):
    left = reap(_MARK, SUITE_MARK)
    shutil.rmtree(_RPC_DIR, ignore_errors=True)
    if left:
        print(f"\n[conftest] {len(left)} process(es) of the suite still running at its end (killed now):\n  "
              + "\n  ".join(left))
        session.exitstatus = 1
