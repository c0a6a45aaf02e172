"""A test-only verl reward that spreads inside every GRPO group: a hash of the response
text in [0, 1). The demo task's reward is 0 for a response with no integer, which is
what a tiny random model writes most of the time; a group with equal rewards has zero
advantages, and an e2e test that asserts the policy moves (grad_norm > 0) would then
depend on luck. Distinct responses get distinct rewards here."""
import hashlib


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs) -> float:
    return int(hashlib.sha256(solution_str.encode()).hexdigest()[:8], 16) / 2 ** 32
