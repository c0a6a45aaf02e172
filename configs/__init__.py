"""Hydra configs of the recipe (package data: true_on_policy.configs, see setup.py)."""
