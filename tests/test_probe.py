"""python -m consistent_ops.probe on the reference backend: every invariance holds (exit 0),
and a batch-dependent op makes it exit 1 (the probe sees differences)."""
import subprocess

import consistent_ops as co
from consistent_ops import probe
from readme import readme_command


def test_probe_passes_on_reference():
    res = subprocess.run(readme_command("python -m consistent_ops.probe")[1], capture_output=True, text=True,
                         timeout=300, env={"CONSISTENT_OPS_BACKEND": "reference", "PATH": "/usr/bin:/bin"})
    assert res.returncode == 0, res.stdout + res.stderr
    assert "backend reference" in res.stdout and ", 0 differ" in res.stdout
    for check in ("decode == train", "chunked prefill == train", "row-parallel k=4", "moe layer",
                  "token_logprobs T 0.7"):
        assert check in res.stdout, check


def test_probe_fails_on_a_batch_dependent_op(monkeypatch, capsys):
    backend = co.set_backend("reference")
    exact = backend.rms_norm
    monkeypatch.setattr(backend, "rms_norm", lambda x, w, eps: exact(x, w, eps) * (1 + 0.01 * (x.shape[0] > 1)))
    monkeypatch.setenv("CONSISTENT_OPS_BACKEND", "reference")
    monkeypatch.setattr(co, "set_backend", lambda name=None: backend)
    assert probe.main([]) == 1
    out = capsys.readouterr().out
    assert [ln for ln in out.splitlines() if "DIFFERS" in ln] == [
        ln for ln in out.splitlines() if ln.startswith("rms_norm ")]
