"""The ascend backend's ops on the CPU under TRITON_INTERPRET=1 (run by test_ascend.py).

``python ascend_interpret_case.py ascend|cuda OUT``: with ``ascend`` the portability
switches of consistent_ops/triton/common.py take their triton-ascend side (fp32 exp/log,
[1]-shaped div_rn, ieee dots), so the kernel code an NPU compiles is what the interpreter
runs; then the probe battery runs on the ascend ops (Triton fallbacks: attention, linear).
Prints the battery as JSON lines and saves a few outputs to OUT for cross-side checks."""
import json
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"        # read when the kernels are decorated (import time)
import torch  # noqa: E402
import triton.language as tl  # noqa: E402

from consistent_ops.triton import common, gemm, logprobs  # noqa: E402
from interpreter_bf16 import fix_interpreter_bf16  # noqa: E402

fix_interpreter_bf16()                     # real bf16 dots and casts, as on the device

side, out = sys.argv[1], sys.argv[2]
if side == "ascend":   # the interpreter looks module globals up when a kernel runs
    common.FP64_TRANSCENDENTALS = logprobs.SCALAR_DIV_RN = tl.constexpr(False)
    gemm.HALF_DOT_PRECISION = "ieee"

import consistent_ops.ascend as ascend  # noqa: E402
from consistent_ops import dispatch, probe  # noqa: E402

dispatch._active = ascend                   # no activate(): no NPU here
g = torch.Generator().manual_seed(0)
x = torch.randn(9, 256, generator=g).bfloat16()
logits = torch.randn(9, 1000, generator=g) * 3
torch.save({"rms_norm": ascend.rms_norm(x, torch.ones(256).bfloat16(), 1e-6),
            "log_softmax": ascend.log_softmax(logits, 0.7, 990)}, out)
if side == "ascend":
    for op, check, delta in probe.battery():
        print(json.dumps({"op": op, "check": check, "delta": delta}))
