"""scripts/setup.sh on a machine where the install cannot finish: a first install on a disk with too
little room stops before pip starts, and a pip that fails ends set-up there (exit 1, one line naming
the failed step and the fix, the stamp unwritten) instead of running on into an import traceback. A
fake .venv (python without torch, pip that fails like a full disk) and a fake df stand in."""
import os
import shutil
import stat
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _exe(path, body):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/usr/bin/env bash\n" + body + "\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


def _run(tmp_path, free_kb):
    """setup.sh in a copy of the repo's set-up files; df reports `free_kb` free."""
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    for name in ("scripts/setup.sh", "requirements.lock", "setup.py"):
        shutil.copy(ROOT / name, repo / name)
    _exe(repo / ".venv/bin/python", 'case "$*" in *"import torch"*) exit 1;; esac; exit 0')
    _exe(repo / ".venv/bin/pip", 'echo "ERROR: Could not install packages due to an OSError: '
                                 '[Errno 28] No space left on device"; exit 1')
    _exe(tmp_path / "bin/df", f'echo "Filesystem 1024-blocks Used Available Capacity Mounted"; '
                              f'echo "/dev/x 1 1 {free_kb} 1% /"')
    env = {**os.environ, "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}"}
    res = subprocess.run(["bash", str(repo / "scripts/setup.sh")], capture_output=True, text=True,
                         env=env, timeout=60)
    assert not (repo / ".venv/.true_on_policy.stamp").exists()
    return res


def test_a_first_install_on_a_full_disk_stops_before_pip(tmp_path):
    res = _run(tmp_path, free_kb=2 * 1048576)
    assert res.returncode == 1 and "installing" not in res.stdout
    assert res.stderr.splitlines() == [
        f"[setup] error: 2 GB free where .venv lives ({tmp_path / 'repo'}); a first install needs about 6 GB: "
        "free disk space, then run scripts/setup.sh again"]


def test_a_failing_pip_ends_setup_with_one_line(tmp_path):
    res = _run(tmp_path, free_kb=50 * 1048576)
    assert res.returncode == 1 and "Traceback" not in res.stdout + res.stderr
    assert "No space left on device" in res.stdout                       # pip's own message, kept
    assert res.stderr.splitlines() == [
        "[setup] error: pip install -r requirements.lock failed (exit 1; its message is above): "
        "fix that, then run scripts/setup.sh again"]
