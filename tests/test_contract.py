"""The contract is one text: fingerprints are stable per backend, differ across backends,
and the README's table names every op of the contract (docs must not drift from code)."""
from pathlib import Path

import pytest

import consistent_ops as co
from consistent_ops import contract


def test_fingerprint_per_backend(monkeypatch):
    monkeypatch.setenv(contract.CPU_ACCUMULATION_ENV, "fp64")
    assert co.contract_fingerprint() == contract.fingerprint("reference")
    monkeypatch.setenv(contract.CPU_ACCUMULATION_ENV, "fp32")          # a realisation: its own id
    assert co.contract_fingerprint() == contract.fingerprint("reference", contract.CPU_ACCUMULATION["fp32"])
    assert co.contract_fingerprint() != contract.fingerprint("reference")
    assert contract.fingerprint("reference") != contract.fingerprint("triton")
    with pytest.raises(ValueError, match="unknown consistent_ops backend 'cuda'"):
        contract.fingerprint("cuda")


def test_bad_cpu_accumulation_is_a_clear_error(monkeypatch):
    monkeypatch.setenv(contract.CPU_ACCUMULATION_ENV, "fp16")
    with pytest.raises(ValueError, match="CONSISTENT_OPS_CPU_ACCUMULATION='fp16' is not a CPU accumulation; use"):
        co.contract_fingerprint()


def test_bad_backend_name_is_a_clear_error():
    with pytest.raises(ValueError, match="CONSISTENT_OPS_BACKEND='cpu' is not a backend"):
        co.set_backend("cpu")
    co.set_backend("reference")


def test_readme_table_covers_contract():
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    table = readme.split("## The numerics contract")[1]
    names = {"attention", "linear", "RMSNorm", "RoPE", "SiLU·mul", "embedding", "MoE router",
             "MoE experts", "log-probs", "truncation", "greedy", "transcendentals"}
    assert len(names) >= len(contract.COMMON) - 2          # tie_rule and row-parallel live in rows
    for name in names:
        assert f"| {name}" in table, name
