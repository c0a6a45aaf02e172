"""The Triton backend's kernel logic on the CPU: triton_interpret_cases.py, run in a fresh
interpreter with TRITON_INTERPRET=1.

Triton reads TRITON_INTERPRET when a function is decorated, and torch imports triton (with
the tl.* helper functions) as soon as another test imports verl; inside one shared pytest
process the interpreter would then meet compiled-mode helpers ("Cannot call @triton.jit'd
outside of the scope of a kernel"), depending on test order."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

CASES = Path(__file__).with_name("triton_interpret_cases.py")


def test_triton_kernels_under_the_interpreter():
    pytest.importorskip("triton")
    proc = subprocess.run([sys.executable, "-m", "pytest", str(CASES), "-q", "-p", "no:cacheprovider"],
                          env={**os.environ, "TRITON_INTERPRET": "1"}, cwd=CASES.parent.parent,
                          capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-8000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and "skipped" not in proc.stdout, proc.stdout[-2000:]
