"""Functions ``true_on_policy.check`` runs inside vLLM's workers (LLM.apply_model).

They take the worker's model (our TrueOnPolicyForCausalLM, or stock vLLM's class in
--stock mode) and live in an importable module so vLLM can pickle them by name.
"""
from pathlib import Path

import torch


def load_full_weights(model_dir, model):
    """What verl does on a weight sync: full fp32 tensors by HF name into load_weights."""
    from safetensors.torch import load_file
    tensors = {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    return len(model.load_weights((k, v.float()) for k, v in tensors.items()))


def start_capture(model):
    from true_on_policy.check.capture import Capture
    model._check_capture = Capture(model, root=model)


def stop_capture(path, model):
    """Save this rank's capture next to ``path``; returns the file name."""
    records = model._check_capture.stop()
    del model._check_capture
    rank = getattr(getattr(model, "tp", None), "rank", 0)
    torch.save(records, f"{path}.rank{rank}")
    return f"{path}.rank{rank}"


def perturb(op, model):
    """Test-only (check/perturb.py): scale one op's output in this worker's model."""
    from true_on_policy.check.perturb import install_perturbation
    install_perturbation(model, op)
