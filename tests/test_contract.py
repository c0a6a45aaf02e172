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


def test_a_tile_value_changes_the_fingerprint(monkeypatch):
    """The Triton kernels' tiles are contract data (TRITON_TILES), hashed by the backends that
    run those kernels; the reference backend (no tiles) keeps its fingerprint."""
    before = {b: contract.fingerprint(b) for b in contract.ACCUMULATION}
    monkeypatch.setitem(contract.TRITON_TILES["attention"], "backward_delta_rows", 128)
    assert contract.fingerprint("triton") != before["triton"]
    assert contract.fingerprint("ascend") != before["ascend"]
    assert contract.fingerprint("reference") == before["reference"]


def test_the_kernels_run_the_contract_tiles():
    pytest.importorskip("triton")
    from consistent_ops.triton import attention, gemm, logprobs, moe, norm
    tiles = contract.TRITON_TILES
    assert gemm._HUGE is tiles["gemm"]["huge"] and gemm._NARROW is tiles["gemm"]["narrow"]
    assert moe._TILES[0] == tiles["moe"]["tiles"][0] and moe._DECODE_ROWS == tiles["moe"]["decode_rows"]
    assert moe._MID[0] == tiles["moe"]["mid"][0] and moe._MID_ROWS == tiles["moe"]["mid_rows"]
    assert (*attention._TILE, attention._STAGES) == tiles["attention"]["forward"]
    assert attention._DECODE_TILE is tiles["attention"]["decode"]
    assert (attention._DELTA_ROWS, attention._DELTA_WARPS) == (tiles["attention"]["backward_delta_rows"],
                                                               tiles["attention"]["backward_delta_warps"])
    assert (moe._SOFTMAX_WARPS, moe._ACT_BWD_WARPS) == (tiles["moe"]["router_warps"], tiles["moe"]["act_backward_warps"])
    assert gemm._MID_NARROW is tiles["gemm"]["mid_narrow"] and gemm._PINNED is tiles["gemm"]["pinned"]
    assert gemm._MID_SQUARE is tiles["gemm"]["mid_square"] and gemm._MID_TALL is tiles["gemm"]["mid_tall"]
    assert norm._ELEMENTS == tiles["rms_norm_elements"] and logprobs._BLOCK == tiles["logprob_block"]


def test_the_mid_m_tile_is_the_narrowest_of_one_wave(monkeypatch):
    """M 129..512 (decode batches of 129-512 sequences): the narrowest entry whose programs fit the 132
    SMs in one wave, else the 128 x 64 tile (qkv N 5120, o_proj N 2048)."""
    pytest.importorskip("triton")
    from consistent_ops.triton import gemm
    monkeypatch.setattr(gemm, "_INTERPRET", False)
    monkeypatch.setattr(gemm, "_ASCEND", False)
    picks = {(m, n): gemm._config(m, n) for m in (192, 256, 384, 512) for n in (5120, 2048)}
    assert picks[192, 5120] is gemm._MID_WIDE and picks[256, 2048] is gemm._MID_NARROW
    assert picks[256, 5120] is gemm._MID_SQUARE and picks[384, 5120] is gemm._MID_SQUARE
    assert picks[512, 5120] is gemm._MID_TALL and picks[512, 2048] is gemm._MID_WIDE


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
