"""python -m consistent_ops.probe on the reference backend: every invariance holds (exit 0),
and a batch-dependent op makes it exit 1 (the probe sees differences); `--digest` prints the same
bits on every CPU kind."""
import os
import subprocess
import sys

import consistent_ops as co
from consistent_ops import contract, probe
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


# Measured 2026-12-04 on two CPU kinds: an AVX2 AMD EPYC (bf16 pairs in the C emulation, torch 2.13)
# and the H200 host's Intel Xeon (AVX-512 + VDPBF16PS, torch 2.11): the same lines.
# bf16 since the k-serial pair chain (branch kchain): this AMD EPYC Zen 4 (VDPBF16PS) only; the
# scalar build's bits are the same (test_native_dot32), the other CPU kinds not re-measured.
DIGESTS = {
    "bf16": {"linear": "053484b9632f201d", "add_rms_norm": "e42336c554a833e9", "attention_varlen": "eb66ce31dca6514b",
             "mlp": "04e306e4f4ddbc79", "log_softmax": "c96d723c44807a5e"},
    "fp32": {"linear": "aec6decb333400ea", "add_rms_norm": "e42336c554a833e9", "attention_varlen": "eb66ce31dca6514b",
             "mlp": "f83adb4db2bb28fd", "log_softmax": "c96d723c44807a5e"}}


def test_digests_are_the_same_on_every_cpu_kind_and_differ_by_realisation():
    """`--digest` on this CPU == the digests of two other CPU kinds, per realisation; the two
    realisations' GEMMs differ (the digest sees bits)."""
    for realisation, want in DIGESTS.items():
        res = subprocess.run([sys.executable, "-m", "consistent_ops.probe", "--digest"], capture_output=True,
                             text=True, timeout=120, env={**os.environ, "CONSISTENT_OPS_BACKEND": "reference",
                                                          contract.CPU_ACCUMULATION_ENV: realisation})
        assert res.returncode == 0, res.stderr
        got = dict(line.split() for line in res.stdout.splitlines()[1:])
        assert got == want, realisation
    assert DIGESTS["bf16"]["linear"] != DIGESTS["fp32"]["linear"]
