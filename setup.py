"""verl-true-on-policy: bitwise-equal rollout and trainer log-probs for verl.

Two import packages, mapped from the design card's folders so that neither a
top-level ``kernels`` nor a ``recipe`` module is ever installed:
  kernels/consistent_ops  -> consistent_ops   (numerics contract + backends)
  recipe/true_on_policy   -> true_on_policy   (models, verl/vLLM adapters)
  configs/                -> true_on_policy/configs (hydra configs, package data)
"""
from setuptools import setup

setup(
    name="verl-true-on-policy",
    version="0.1.0",
    python_requires=">=3.10",
    packages=[
        "consistent_ops",
        "consistent_ops.reference",
        "true_on_policy",
        "true_on_policy.models",
    ],
    package_dir={
        "consistent_ops": "kernels/consistent_ops",
        "true_on_policy": "recipe/true_on_policy",
    },
    install_requires=["torch", "safetensors"],
)
