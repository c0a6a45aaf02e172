"""Checks that must fail before an engine starts (no vLLM import: the check CLI runs them first).

TP=k equals the trainer bitwise only when the model splits evenly: heads (and KV
heads) by rank, dense MLP columns by rank, experts placed whole on ranks. Anything
else would change which values a rank sums or owns, so it is refused up front with
the numbers and the TP sizes that would work.
"""
from true_on_policy.models import ModelConfig


def _splits(cfg: ModelConfig) -> dict:
    """Every size a TP rank takes an equal share of."""
    sizes = {"num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads}
    if cfg.moe_layers:
        sizes["num_experts"] = cfg.num_experts
    if len(cfg.moe_layers) < cfg.num_layers:
        sizes["intermediate_size"] = cfg.intermediate_size
    return sizes


def valid_tp_sizes(cfg: ModelConfig, limit: int = 64) -> list[int]:
    return [k for k in range(1, limit + 1) if all(n % k == 0 for n in _splits(cfg).values())]


def tp_problems(cfg: ModelConfig, tp: int) -> list[str]:
    """Why ``cfg`` cannot run at tensor_parallel_size=tp (empty list = it can)."""
    return [f"{name}={n} is not divisible by tensor_parallel_size={tp} (TP sizes that divide every "
            f"split: {valid_tp_sizes(cfg)})" for name, n in _splits(cfg).items() if n % tp]


def check_tp(cfg: ModelConfig, tp: int) -> None:
    problems = tp_problems(cfg, tp)
    if problems:
        raise ValueError("true_on_policy: " + "; ".join(problems))
