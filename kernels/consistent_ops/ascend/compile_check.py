"""Compile every Triton kernel the ascend backend launches with triton-ascend, on a CPU.

Run by scripts/ascend_compile_check.sh with triton-ascend as the importable triton (an
isolated install, never beside torch in .venv). The ascend ops are called on CPU tensors
over a battery of shapes (the tiny test models and Qwen3-30B-A3B); each kernel launch is
caught before anything runs on a device and compiled by triton-ascend's own front end
(Python -> TTIR) and its bundled ``triton-adapter-opt`` (TTIR -> linalg, the stage that
rejects what Ascend lacks). Every distinct (kernel, signature, constexprs) is compiled
once; the launch's grid is checked against the 65,535-program limit by triton-ascend's
launcher itself. Code generation (bishengir) and running need CANN and an NPU: not here.

``--cuda-constructs`` compiles the same kernels with the CUDA side of the portability
switches (fp64 exp/log, tf32 dots, 0-d div_rn): those kernels must fail (the check's own test).
"""
import argparse
import signal
import subprocess
import sys

import torch

_ADAPTER_TRIES = 5
NPU_ARCH = "Ascend910B3"     # A2; the adapter stage does not depend on the sub-model
MODELS = {   # name: (hidden, heads, kv_heads, head_dim, moe_inter or None, experts, top_k, vocab)
    "tiny-moe": (256, 4, 2, 64, 128, 8, 2, 1024),
    "tiny-dense": (256, 4, 2, 64, None, 0, 0, 1024),
    "qwen3-30b-a3b": (2048, 32, 4, 128, 768, 128, 8, 151936),
}


class _StubDriver:
    """triton-ascend's launcher asks the driver for a device, a stream and the target."""

    def __init__(self, target):
        self.target = target

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return self.target


class _NotRun:
    """Stands for a compiled kernel: the launch is a no-op (outputs stay uninitialised)."""
    function = packed_metadata = None

    def launch_metadata(self, *args):
        return None

    def _init_handles(self):
        pass

    def run(self, *args):
        pass


class Compiler:
    def __init__(self):
        from triton._C.libtriton import ir
        from triton.compiler import compiler as tc
        self.ir, self.tc = ir, tc
        self.done, self.failed, self.retried = [], [], []

    def __call__(self, src, target=None, options=None):
        """triton.compiler.compile, stopped after the linalg stage."""
        backend = self.tc.make_backend(target)
        opts = backend.parse_options(dict(options or {}, **src.parse_options()))
        metadata = {"hash": src.hash(), "target": target, **opts.__dict__}
        stages = {}
        backend.add_stages(stages, opts)
        ctx = self.ir.context()
        self.ir.load_dialects(ctx)
        backend.load_dialects(ctx)
        consts = {k: v for k, v in src.constants.items() if not isinstance(k, tuple)}
        label = f"{src.name}{consts}"
        try:
            module = src.make_ir(opts, backend.get_codegen_implementation(), backend.get_module_map(), ctx)
            module = stages["ttir"](module, metadata)
            self._adapter(stages["ttadapter"], module, metadata, label)
        except Exception as e:     # noqa: BLE001 - every failure is reported, then the run fails
            err = getattr(e, "stderr", None)
            text = (err.decode(errors="replace") if isinstance(err, bytes) else str(e)).strip()
            lines = [ln for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
            code = f" (exit {e.returncode})" if isinstance(e, subprocess.CalledProcessError) else ""
            self.failed.append((label, f"{type(e).__name__}{code}: {' | '.join(lines[:3])[:600]}"))
            print(f"FAIL {label}\n     {self.failed[-1][1]}", flush=True)
        else:
            self.done.append(label)
            print(f"ok   {label}", flush=True)
        return _NotRun()

    def _adapter(self, stage, module, metadata, label):
        """triton-adapter-opt 3.2.0 segfaults now and then on an input it compiles on the next
        run (seen ~1 run in 10 on the same TTIR file): a SIGSEGV is retried, and counted.
        Every other failure (front-end errors, SIGABRT on a rejected construct) is final."""
        for attempt in range(_ADAPTER_TRIES):
            try:
                return stage(module, metadata)
            except subprocess.CalledProcessError as e:
                if e.returncode != -signal.SIGSEGV or attempt == _ADAPTER_TRIES - 1:
                    raise
                self.retried.append(label)


def _battery(ops, model):
    """Call every op the ascend backend has at this model's shapes, in every mode it is
    launched in (inference, autograd forward + backward, fp32 outputs, paged decode ...)."""
    from ..triton import attention as triton_attention
    hidden, heads, kvh, d, moe_i, experts, top_k, vocab = MODELS[model]
    bf = dict(dtype=torch.bfloat16)
    for t in (1, 37, 256):                        # decode, ragged, full tiles
        x = torch.randn(t, hidden, **bf)
        w = torch.randn(hidden, hidden, **bf)
        ops.linear(x, w)                                   # projections
        ops.linear(x, w, torch.randn(hidden, **bf))        # biased
        ops.linear(x[:, :hidden - 8], w[:, :hidden - 8])   # K not a multiple of BLOCK_K
        ops.linear(x, torch.empty(vocab, hidden, **bf), out_dtype=torch.float32)   # lm_head logits
        ops.row_parallel_partial(x[:, :hidden // 2], w[:, :hidden // 2])
        ops.linear(x.float(), w.float())                   # fp32 operands (ieee)
        ops.rms_norm(x, torch.ones(hidden, **bf), 1e-6)
        ops.add_rms_norm(x, x, torch.ones(hidden, **bf), 1e-6)
        ops.rms_norm(torch.randn(t, heads, d, **bf), torch.ones(d, **bf), 1e-6)   # q/k norm
        logits = torch.randn(t, vocab)
        ops.log_softmax(logits, 0.7, vocab - 3)
        ops.token_logprobs(logits, torch.zeros(t, dtype=torch.long), torch.full((t,), 0.7), vocab - 3)
        if moe_i:
            gate = torch.randn(experts, hidden, **bf)
            ids, weights = ops.moe_route(x, gate, top_k)                      # rollout: fused router
            ops.moe_route(x, gate.requires_grad_(), top_k)                    # training: softmax kernel
            local = range(min(experts, 8))                 # a few local experts (EP placement)
            mats = {e: (torch.randn(moe_i, hidden, **bf), torch.randn(moe_i, hidden, **bf),
                        torch.randn(hidden, moe_i, **bf)) for e in local}
            with torch.inference_mode():
                ops.moe_expert_contributions(x, ids.clamp(max=7), weights, mats, list(local))
    # a prompt's lm_head: more programs than one launch takes -> chunked by rows (rows.py)
    ops.linear(torch.empty(2048, hidden, **bf), torch.empty(vocab, hidden, **bf), out_dtype=torch.float32)
    # training: packed varlen attention and token log-probs with their backward kernels
    cu = torch.tensor([0, 100, 300], dtype=torch.int32)
    q = torch.randn(300, heads, d, **bf, requires_grad=True)
    k = torch.randn(300, kvh, d, **bf, requires_grad=True)
    v = torch.randn(300, kvh, d, **bf, requires_grad=True)
    ops.attention_varlen(q, k, v, cu).float().sum().backward()
    logits = torch.randn(300, vocab, requires_grad=True)
    ops.token_logprobs(logits, torch.zeros(300, dtype=torch.long), 0.7).sum().backward()
    xn = torch.randn(300, hidden, **bf, requires_grad=True)
    ops.add_rms_norm(xn, xn, torch.ones(hidden, **bf), 1e-6)[0].float().sum().backward()   # norm backward
    with torch.no_grad():
        ops.attention_varlen(q, k, v, cu)                  # prefill without cache
        # rollout: paged KV cache (pages of 128: the flash-attention-npu page size), decode + chunks
        cache_k = torch.randn(8, 128, kvh, d, **bf)
        cache_v = torch.randn(8, 128, kvh, d, **bf)
        table = torch.arange(8, dtype=torch.int32).view(2, 4)
        for new in ((1, 1), (5, 64)):
            qsl = torch.tensor([0, new[0], new[0] + new[1]], dtype=torch.int32)
            ops.attention_paged(torch.randn(sum(new), heads, d, **bf), cache_k, cache_v, table,
                                torch.tensor([300, 400], dtype=torch.int32), qsl)
        # the decode tail's launch (CUDA picks it for small batches): a program per KV chunk, the
        # last to finish folding (arrival counters: atomics); compiled here so the one source stays portable
        triton_attention._forward(torch.randn(2, heads, d, **bf), cache_k, cache_v,
                                  torch.tensor([0, 1, 2], dtype=torch.int32), torch.tensor([900, 1000], dtype=torch.int32),
                                  torch.arange(16, dtype=torch.int32).view(2, 8) % 8, d ** -0.5, True, split=True)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="ascend_compile_check", description=__doc__.splitlines()[0])
    ap.add_argument("--cuda-constructs", action="store_true",
                    help="compile with the CUDA side of the portability switches (must fail)")
    ap.add_argument("--models", default=",".join(MODELS), help=f"comma-separated subset of {list(MODELS)}")
    args = ap.parse_args(argv)
    models = args.models.split(",")
    bad = [m for m in models if m not in MODELS]
    if bad:
        print(f"--models: unknown {bad[0]!r}; choose from {', '.join(MODELS)}", file=sys.stderr)
        return 2
    import triton
    import triton.compiler
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver
    from ..triton import common
    if not common.ASCEND:
        print(f"the importable triton ({triton.__file__}) is not triton-ascend; "
              "run this through scripts/ascend_compile_check.sh", file=sys.stderr)
        return 2
    if args.cuda_constructs:
        from ..triton import gemm, logprobs
        common.FP64_TRANSCENDENTALS = tl.constexpr(True)
        logprobs.SCALAR_DIV_RN = tl.constexpr(True)
        gemm.HALF_DOT_PRECISION = "tf32"
    compiler = Compiler()
    triton.compiler.compile = compiler      # what JITFunction.create_binder picks up
    driver.set_active(_StubDriver(GPUTarget("npu", NPU_ARCH, 0)))
    from . import attention, linear, ops, runtime
    import consistent_ops.ascend as backend
    for m in models:
        print(f"-- {m}: attention={'flash-attention-npu' if runtime.use_flash_attn_npu() else 'triton'}, "
              f"linear={'cann+triton' if runtime.use_cann_matmul() else 'triton'}", flush=True)
        _battery(backend, m)
    del attention, linear, ops
    if compiler.retried:
        print(f"note: triton-adapter-opt segfaulted and passed on a rerun for {len(compiler.retried)} kernel(s)")
    print(f"{len(compiler.done)} kernels compiled for Ascend, {len(compiler.failed)} failed")
    return 1 if compiler.failed or not compiler.done else 0


if __name__ == "__main__":
    sys.exit(main())
