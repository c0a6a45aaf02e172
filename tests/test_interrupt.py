"""SIGINT / SIGTERM to a job's driver (true_on_policy.interrupt) on a stand-in driver with a
process tree like a job's (a child that ignores SIGTERM, a grandchild), after a ``ray.init``
that sets its own SIGTERM handler (Ray's does): exit 130 / 143, one
line, every descendant gone, a metrics line cut short by the kill removed. The real jobs
(verl + Ray + vLLM), one signal each: test_recipe_e2e.py."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from processes import JOB_MARK, marked

DRIVER = r"""
import signal, subprocess, sys, time
from pathlib import Path
import ray
from true_on_policy import interrupt
ray.init = lambda: signal.signal(signal.SIGTERM, lambda *a: sys.exit(15))   # as Ray's own does
interrupt.GRACE_S = 1.0
metrics = Path(sys.argv[1])
interrupt.install(metrics, sys.argv[2], 2)
ray.init()                                  # the job starts Ray: the handlers are ours again
subprocess.Popen([sys.executable, "-c", "import signal, subprocess, sys, time; "
                  "signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                  "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); time.sleep(600)"])
metrics.write_text('{"step": 1, "data": {"timing_s/step": 1.0}}\n{"step": 2, "data": {"timing_s/step": 1.0}}\n{"step": 3, "da')
print("ready", flush=True)
while True:
    time.sleep(1)
"""


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_signal_stops_the_tree_with_one_line(tmp_path, sig, code):
    metrics, ckpt = tmp_path / "metrics.jsonl", tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "latest_checkpointed_iteration.txt").write_text("2")
    mark = str(tmp_path)
    proc = subprocess.Popen([sys.executable, "-c", DRIVER, str(metrics), str(ckpt)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env={**os.environ, JOB_MARK: mark})
    try:
        assert proc.stdout.readline() == "ready\n"
        while len(marked(JOB_MARK, mark)) < 3:      # the driver, its child and grandchild
            time.sleep(0.1)
        proc.send_signal(sig)
        out = proc.communicate(timeout=30)[0]
    finally:
        proc.kill()
    assert proc.returncode == code, out
    assert out.splitlines() == [f"[true_on_policy] interrupted ({sig.name}) at step 2; metrics of steps up to 2: "
                                f"{metrics}; last checkpoint: {ckpt / 'global_step_2'}. Ray and vLLM processes stopped."]
    assert marked(JOB_MARK, mark) == []
    assert [json.loads(ln)["step"] for ln in metrics.read_text().splitlines()] == [1, 2]


def test_summary_without_metrics_or_checkpoint():
    from true_on_policy.interrupt import summary
    assert summary("SIGTERM", None, None, "ckpts", -1) == (
        "[true_on_policy] interrupted (SIGTERM) before its first step finished; no metrics file "
        "(true_on_policy.metrics_file); no checkpoint (trainer.save_freq=-1). Ray and vLLM processes stopped.")
