"""The ascend backend without an NPU: every kernel it launches compiles with triton-ascend
(scripts/ascend_compile_check.sh, an isolated install), the CUDA-only constructs are what
the switches keep out (the same kernels with the CUDA side of the switches fail), the
launch-limit chunking keeps bits, the Ascend side of the kernel source passes the probe
battery under the CPU interpreter, and selecting it here names what is missing."""
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import consistent_ops as co
from consistent_ops import contract
from consistent_ops.ascend import rows
from consistent_ops.reference import linear as ref_linear  # the function
from readme import readme_command

ROOT = Path(__file__).parents[1]


def _check(*args):
    return subprocess.run([*readme_command("bash scripts/ascend_compile_check.sh")[1], *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=900)


def test_every_ascend_kernel_compiles_with_triton_ascend():
    res = _check()
    # the failures first: a long run's output tail alone can miss them (CI, 2026-12-07: 1 of 61)
    failures = "\n".join(re.findall(r"^FAIL .*\n.*$", res.stdout, re.M))
    assert res.returncode == 0, failures + "\n" + res.stdout[-3000:] + res.stderr[-3000:]
    n = int(re.search(r"^(\d+) kernels compiled for Ascend, 0 failed$", res.stdout, re.M).group(1))
    assert n >= 25
    for kernel in ("_gemm_kernel", "_rms_norm_kernel", "_lane_max_kernel", "_lane_sum_kernel",
                   "_log_softmax_kernel", "_token_logprob_kernel",
                   "_token_logprob_bwd_kernel", "_softmax_kernel", "_route_kernel", "_plan_kernel",
                   "_gate_up_kernel", "_down_kernel", "_attn_fwd_kernel", "_bwd_dq_kernel", "_bwd_dkdv_kernel",
                   "_rms_norm_bwd_kernel"):
        assert f"ok   {kernel}" in res.stdout, kernel
    assert re.search(r"^ok   _attn_fwd_kernel\{.*'SPLIT': True[,}]", res.stdout, re.M)   # its arrival atomics too


def test_cuda_constructs_fail_the_check():
    """The companion: the same kernels with the CUDA side of the switches are rejected."""
    res = _check("--cuda-constructs", "--models", "tiny-dense")
    assert res.returncode == 1, res.stdout[-3000:]
    assert re.search(r"^\d+ kernels compiled for Ascend, [1-9]\d* failed$", res.stdout, re.M)
    assert re.search(r"FAIL _gemm_kernel\{.*'PRECISION': 'tf32'", res.stdout)   # tf32 dots
    assert re.search(r"FAIL _log_softmax_kernel", res.stdout)         # fp64 exp/log
    assert "ok   _rms_norm_kernel" in res.stdout   # rows per program: no 0-d division left to switch


def test_row_chunks_keep_bits():
    """The launch-limit chunking (rows.py) is bit-neutral for a row-invariant op."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(50, 64, generator=g).bfloat16()
    w = torch.randn(32, 64, generator=g).bfloat16()
    assert torch.equal(rows.chunked(ref_linear, 7, (x,), w), ref_linear(x, w))
    y, r = rows.chunked(lambda a, b: (a + b, a - b), 7, (x, x))
    assert torch.equal(y, x + x) and torch.equal(r, x - x)


def test_selecting_ascend_here_names_the_missing_piece(monkeypatch):
    monkeypatch.setenv("CONSISTENT_OPS_BACKEND", "ascend")
    with pytest.raises(ImportError, match=r"needs torch-npu .*get it from PyPI: pip install torch-npu=="):
        co.set_backend()
    co.set_backend("reference")


def test_fingerprint_covers_the_realisation():
    base = {"attention": "triton", "kv_block": contract.KV_BLOCK, "kv_chunk": contract.KV_CHUNK, "linear": "triton",
            "versions": {}}
    fa = {**base, "attention": "flash-attention-npu consistency build", "kv_block": contract.ASCEND_KV_BLOCK,
          "kv_chunk": None}
    newer = {**base, "versions": {"triton-ascend": "3.2.1"}}
    prints = {contract.fingerprint("ascend", r) for r in (base, fa, newer)}
    assert len(prints) == 3 and contract.fingerprint("ascend") not in prints


def _interpret(side, tmp_path):
    out = tmp_path / f"{side}.pt"
    res = subprocess.run([sys.executable, str(ROOT / "tests/ascend_interpret_case.py"), side, str(out)],
                         capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return [json.loads(ln) for ln in res.stdout.splitlines() if ln.startswith("{")], torch.load(out)


def test_ascend_side_of_the_source_is_invariant_under_the_interpreter(tmp_path):
    """The kernel code triton-ascend compiles (switches on their Ascend side), run by the CPU
    interpreter through the ascend ops: the whole probe battery holds. RMSNorm has no switch
    (its bits equal the CUDA side's); the fp32 exp/log is a real switch (log-probs differ
    from the fp64 side)."""
    rows, asc = _interpret("ascend", tmp_path)
    assert len(rows) >= 20 and all(r["delta"] == 0.0 for r in rows), [r for r in rows if r["delta"]]
    _, cuda = _interpret("cuda", tmp_path)
    assert torch.equal(asc["rms_norm"], cuda["rms_norm"])
    assert not torch.equal(asc["log_softmax"], cuda["log_softmax"])
