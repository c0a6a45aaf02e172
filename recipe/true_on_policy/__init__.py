"""verl-true-on-policy recipe: models and verl/vLLM adapters for bitwise-equal log-probs."""
