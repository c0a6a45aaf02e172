"""Test-only: break one op of the rollout's model, so a test can assert that --localize
names it. Applied by check/rollout.py (through worker.perturb) when the environment of the
check's vLLM process sets PERTURB_ENV; nothing on the production model's path imports it."""
from true_on_policy.check.capture import op_specs

PERTURB_ENV = "TRUE_ON_POLICY_TEST_PERTURB_OP"


def install_perturbation(model, op: str, factor: float = 1 + 2 ** -4):
    """Scale one op's output (or, for ``attn``, o_proj's input) by ``factor``."""
    for name, module, where, fn in op_specs(model):
        if name == op:
            if where == "in":
                return module.register_forward_pre_hook(lambda _m, args: (args[0] * factor,) + args[1:])
            return module.register_forward_hook(
                lambda _m, _a, out: (out[0] * factor,) + out[1:] if isinstance(out, tuple) else out * factor)
    raise ValueError(f"no op named {op!r}; ops: {[n for n, *_ in op_specs(model)]}")
