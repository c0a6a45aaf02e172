"""Against transformers: our trainer module loads a HF checkpoint and matches the float64
HF forward and gradients; and the stock HF path is shown to differ between prefill and
KV-cache decode (the gap this project closes)."""
import pytest
import torch

from true_on_policy.make_tiny_model import ensure_tiny_model
from true_on_policy.models import ConsistentForCausalLM

transformers = pytest.importorskip("transformers")
SIZES = dict(hidden_size=128, num_layers=2, head_dim=32, intermediate_size=256, moe_intermediate_size=64,
             init_std=0.08)


@pytest.fixture(scope="module", params=["qwen3", "qwen3_moe"])
def ckpt(request, tmp_path_factory):
    return ensure_tiny_model(tmp_path_factory.getbasetemp() / "models", request.param, **SIZES)


def hf_model(path, dtype):
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    if hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation("eager")   # grouped_mm has no float64 kernel
    return model.eval()


def ids(n=2, length=48):
    return torch.randint(0, 1000, (n, length), generator=torch.Generator().manual_seed(0))


def rel_err(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


def test_logits_and_grads_vs_float64(ckpt):
    x = ids()
    ours = ConsistentForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    ref = hf_model(ckpt, torch.float64)
    lp = ours.next_token_logprobs(ours(x, attention_mask=torch.ones_like(x)), x)
    lp_ref = torch.log_softmax(ref(x).logits[:, :-1], -1).gather(-1, x[:, 1:, None]).squeeze(-1)
    assert rel_err(lp, lp_ref) < 1e-5
    lp.sum().backward()
    lp_ref.sum().backward()
    grads = dict(ref.named_parameters())
    checked = []
    for name, p in ours.named_parameters():
        if name in grads:                      # transformers 5's names, stacked experts included
            assert rel_err(p.grad, grads[name].grad) < 1e-4, name
            checked.append(name)
    assert len(checked) >= 10
    assert ours.cfg.num_experts == 0 or "model.layers.0.mlp.experts.gate_up_proj" in checked


def test_stock_hf_prefill_and_decode_differ(ckpt):
    """Companion: stock HF bf16, whole-sequence forward vs token-by-token KV-cache decode."""
    model, x = hf_model(ckpt, torch.bfloat16), ids(1, 40)
    with torch.no_grad():
        full = model(x).logits[0].float()
        cache, steps = None, []
        for t in range(x.shape[1]):
            out = model(x[:, t:t + 1], past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            steps.append(out.logits[0, -1].float())
    assert (full - torch.stack(steps)).abs().max() > 0
