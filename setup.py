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
        "consistent_ops.triton",
        "consistent_ops.ascend",
        "true_on_policy",
        "true_on_policy.check",
        "true_on_policy.models",
        "true_on_policy.vllm",
        "true_on_policy.verl",
        "true_on_policy.megatron",
        "true_on_policy.configs",
    ],
    package_dir={
        "consistent_ops": "kernels/consistent_ops",
        "true_on_policy": "recipe/true_on_policy",
        "true_on_policy.configs": "configs",
    },
    # dot64.c / dot32.c (and native.h) are compiled on first use (consistent_ops/reference/native.py).
    package_data={"true_on_policy.configs": ["*.yaml", "preset/*.yaml", "fsdp_actor/*.yaml"],
                  "consistent_ops.reference": ["*.c", "*.h"]},
    install_requires=["torch", "safetensors"],
    entry_points={
        # Inert unless TRUE_ON_POLICY=1 (see true_on_policy/vllm/plugin.py).
        "vllm.general_plugins": ["true_on_policy = true_on_policy.vllm.plugin:register"],
        # verl imports this module in every process that imports verl; CPU support in it
        # is inert when an accelerator exists (see true_on_policy/verl/register.py).
        "verl.plugins": ["true_on_policy = true_on_policy.verl.register"],
    },
)
