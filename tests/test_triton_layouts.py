"""The layout a Triton reduction runs on decides its tree, so its bits: the fused attention prologue
(triton/prologue.py) reduces a head's sum of squares on the layout rms_norm's kernel reduces it on,
read from the installed Triton's output for the H200 (sm_90), compiled on the CPU (no GPU needed);
and the same output shows which reads the software pipeline makes async copies (the decode tail's
fold, the log-softmax's vocabulary walks) and how wide they are."""
import re
import subprocess

import pytest

triton = pytest.importorskip("triton")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from consistent_ops.triton import norm, prologue  # noqa: E402
from consistent_ops.triton.common import EXACT  # noqa: E402

H200 = GPUTarget("cuda", 90, 32)
RMS_STRIDES = {"H", "stride_x", "stride_r", "stride_y"}       # H = D and its contiguous rows: multiples of 16
TOKEN_STRIDES = {"stride_q", "stride_k", "stride_v", "stride_c"}


RMS_TENSORS = ("X", "Res", "W", "Y", "ResOut")
PROLOGUE_TENSORS = ("Q", "K", "V", "QW", "KW", "QOut", "KOut", "VOut")


def compile_h200(kernel, types, constexprs, divisible, **options):
    """kernel compiled for the H200 down to its cubin (Triton's own ptxas); types: argument -> Triton
    type, "i32" unless named; divisible: the integer arguments the launcher marks divisible by 16
    (pointers: always, fresh or 16-byte aligned tensors)."""
    sig, attrs = {}, {}
    for i, p in enumerate(kernel.params):
        sig[p.name] = "constexpr" if p.is_constexpr else types.get(p.name, "i32")
        if sig[p.name].startswith("*") or p.name in divisible:
            attrs[(i,)] = [["tt.divisibility", 16]]
    return triton.compile(ASTSource(kernel, sig, constexprs, attrs), target=H200, options=dict(**options, **EXACT))


def reduce_layouts(kernel, tensors, dtype, constexprs, divisible, num_warps, types=()):
    """[(shape, layout)] of kernel's tt.reduce operands compiled for the H200; tensors: the arguments
    of the activation dtype (Cos/Sin: fp32, Hf and eps: fp32 scalars); types: any other argument's."""
    types = {"Hf": "fp32", "eps": "fp32", "Cos": "*fp32", "Sin": "*fp32", **{t: "*" + dtype for t in tensors},
             **dict(types)}
    ir = compile_h200(kernel, types, constexprs, divisible, num_warps=num_warps).asm["ttgir"]
    layouts = dict(re.findall(r"^(#\w+) = #ttg\.blocked<(.*)>$", ir, re.M))
    operands = re.findall(r'"tt\.reduce".*?\}\) : \(tensor<(\w+), (#\w+)>', ir, re.S)
    return [(shape, layouts[enc]) for shape, enc in operands]


def rms_norm_layout(d, dtype):
    rows, block, warps = norm._shape(d)
    found = reduce_layouts(norm._rms_norm_kernel, RMS_TENSORS, dtype, {"HAS_RES": False, "ROWS": rows, "BLOCK": block},
                           RMS_STRIDES, warps)
    assert len(found) == 1
    return found[0]


@pytest.mark.parametrize("d, dtype, aligned", [(128, "bf16", True), (128, "bf16", False), (64, "bf16", True),
                                               (16, "bf16", True), (256, "bf16", True), (4096, "bf16", True),
                                               (128, "fp32", True), (64, "fp16", True)])
def test_prologue_reduces_on_the_rms_norm_layout(d, dtype, aligned):
    """q's and k's sums of squares, for token strides that are multiples of 16 (the GEMM output's
    column blocks) or not."""
    rows, block, warps = norm._shape(d)
    fused = reduce_layouts(prologue._qk_norm_rope_kernel, PROLOGUE_TENSORS, dtype, {"ROWS": rows, "D": block},
                           TOKEN_STRIDES if aligned else set(), warps)
    assert fused == [rms_norm_layout(d, dtype)] * 2


def test_prologue_storing_into_the_cache_reduces_on_the_same_layout():
    """The decode step's variant (k and v stored at their slots of the paged cache) reduces as the
    plain one, on rms_norm's layout."""
    rows, block, warps = norm._shape(128)
    fused = reduce_layouts(prologue._qk_norm_rope_kernel, PROLOGUE_TENSORS, "bf16",
                           {"ROWS": rows, "D": block, "PAGE": 16, "CACHE": True}, TOKEN_STRIDES, warps,
                           types={"Slots": "*i64"})
    assert fused == [rms_norm_layout(128, "bf16")] * 2


def test_one_head_a_program_reduces_on_another_layout():
    """Non-vacuous: the obvious tiling (one head a program, same warps) reduces on another layout,
    across warps (another tree)."""
    _, block, warps = norm._shape(128)
    one = reduce_layouts(prologue._qk_norm_rope_kernel, PROLOGUE_TENSORS, "bf16", {"ROWS": 1, "D": block},
                         TOKEN_STRIDES, warps)
    assert one[0] != rms_norm_layout(128, "bf16") and "warpsPerCTA = [1, 4]" in one[0][1]


ATTN_TYPES = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "O": "*bf16", "LSE": "*fp32", "WAcc": "*fp32", "WML": "*fp32",
              "Count": "*i32", "QStart": "*i32", "SeqLen": "*i32", "Table": "*i32", "qk_scale": "fp32"}


def reductions(ir):
    """(element type, combining op, operand layout) of every tt.reduce in a TTGIR text."""
    layouts = dict(re.findall(r"^(#\w+) = (#.*)$", ir, re.M))
    found = re.findall(r'"tt\.reduce"\(.*?\^bb0\(%\w+: (\w+).*?\):\s*%\w+ = (\S+).*?\}\) : \(tensor<\S+, (#\w+)>', ir, re.S)
    return [(ty, op, layouts[enc]) for ty, op, enc in found]


def float_reductions(ir):
    """(combining op, operand layout) of every floating-point tt.reduce in a TTGIR text."""
    return [(op, layout) for ty, op, layout in reductions(ir) if ty.startswith(("f", "bf"))]


def attention_ttgir(*args, **kw):
    """The forward kernel's TTGIR for the H200 in one launch form (attention_compiled)."""
    return attention_compiled(*args, **kw).asm["ttgir"]


def attention_compiled(paged, split, rows, warps, stages, fold_stages=None, off32=True, page=16, divisible=(),
                       hold=True, fold_half=None, carry=False, pdl=False):
    """The forward kernel compiled for the H200 in one launch form (TTGIR to cubin); divisible:
    the integer arguments the launcher would mark divisible by 16 (none unless named)."""
    from consistent_ops.contract import KV_BLOCK, KV_CHUNK
    from consistent_ops.triton import attention as ta
    const = dict(G=8, TPT=rows // 8, ROWS=rows, D=128, KV=KV_BLOCK, CHUNK=KV_CHUNK, PAGE=page if paged else 1,
                 PAGED=paged, STORE_LSE=not paged, SB=16, TMA=False, SPLIT=split,
                 FOLD_STAGES=fold_stages or ta._FOLD_STAGES,
                 FOLD_HALF=ta._FOLD_HALF if fold_half is None else fold_half, OFF32=paged and off32, HOLD=hold,
                 SEG=ta._FOLD_SEGMENT, LAST_FIRST=False, CARRY=carry, PDL=pdl)
    kernel = compile_h200(ta._attn_fwd_kernel, ATTN_TYPES, const, set(divisible), num_warps=warps,
                          num_stages=stages, launch_pdl=pdl)
    assert kernel.asm["cubin"]
    return kernel


def attention_row_reductions(paged, split, rows, warps, stages):
    """(element type, op, layout) of the reductions over a key block's rows (the MMA's layout)."""
    return [r for r in reductions(attention_ttgir(paged, split, rows, warps, stages)) if "_mma<" in r[2]]


@pytest.mark.parametrize("tile", ["forward", "decode"])
@pytest.mark.parametrize("paged, split", [(True, True), (True, False), (False, False)],
                         ids=["decode-split", "paged", "training"])
def test_attention_forward_compiles_for_the_h200(paged, split, tile):
    """The forward kernel in its launch forms and both tiles, compiled for sm_90 to a cubin on the
    CPU: what the interpreter accepts and the GPU would not (a plain global read in a kernel, a type
    error) fails here, before a device session (it did, 2026-12-04). Its reductions over a key block's
    rows are the row max (exact in any order) and the row sum in int32 (exact in any order): no float
    sum, so no tree (tests/gpu/test_triton_attention.py holds the bits)."""
    from consistent_ops.contract import TRITON_TILES
    found = attention_row_reductions(paged, split, *TRITON_TILES["attention"][tile])
    assert sorted({(ty, op) for ty, op, _ in found}) == [("f32", "arith.maxnumf"), ("i32", "arith.addi")], found


def test_the_decode_tile_sums_a_row_across_warps_the_forward_tile_inside_one():
    """Companion: the two tiles reduce a row on different layouts (16 rows of 4 warps split a row's
    keys over the warps, warpsPerCTA [1, 4]; the forward's wgmma warps hold whole rows, [4, 1]), so a
    float row sum would take two trees: it gave other bits on the H200 (2026-12-04). Only the exact
    integer sum makes the decode tile's bits the forward's."""
    from consistent_ops.contract import TRITON_TILES
    tiles = TRITON_TILES["attention"]
    decode = {layout for ty, _, layout in attention_row_reductions(True, True, *tiles["decode"]) if ty == "i32"}
    forward = {layout for ty, _, layout in attention_row_reductions(False, False, *tiles["forward"]) if ty == "i32"}
    assert all("warpsPerCTA = [1, 4]" in layout for layout in decode) and decode
    assert all(re.search(r"warpsPerCTA = \[4, 1\]", layout) for layout in forward) and forward


@pytest.mark.parametrize("off32", [True, False])
def test_the_decode_walk_addresses_the_cache_in_int32_where_it_fits(off32):
    """The key walk's K/V row offsets (a [64 keys] column of the paged cache's blocks) are int32
    where the cache's offsets fit int32 (sm_90 compile, 2026-12-06: 811 vs 948 SASS instructions a
    key block), int64 otherwise (the companion)."""
    from consistent_ops.contract import TRITON_TILES
    ir = attention_ttgir(True, True, *TRITON_TILES["attention"]["decode"], off32=off32)
    offsets = set(re.findall(r"tt\.addptr %\S+, %\S+ : tensor<64x1x!tt\.ptr<bf16>, #\w+>, tensor<64x1x(i\d+)", ir))
    assert offsets == ({"i32"} if off32 else {"i64"})


def test_rms_norm_sums_along_its_layout():
    """Companion: the reduction check sees a float sum where there is one (RMSNorm's)."""
    rows, block, warps = norm._shape(128)
    types = {"Hf": "fp32", "eps": "fp32", **{t: "*bf16" for t in RMS_TENSORS}}
    ir = compile_h200(norm._rms_norm_kernel, types, {"HAS_RES": False, "ROWS": rows, "BLOCK": block}, RMS_STRIDES,
                      num_warps=warps).asm["ttgir"]
    assert [op for op, _ in float_reductions(ir)] == ["arith.addf"]


def state_reads(ttgir):
    """(pipelined, plain) reads of the split launch's chunk states: the kernel's only L2-only (.cg)
    loads, as async copies into shared memory (the software pipeline) or as plain loads."""
    ops = re.findall(r"= (ttg\.async_copy_global_to_local|tt\.load) [^\n]*cache_?[mM]odifier = cg", ttgir)
    return ops.count("ttg.async_copy_global_to_local"), ops.count("tt.load")


def test_the_split_fold_reads_its_states_through_the_pipeline():
    """The decode tail's fold (_fold_states) reads chunk states while earlier ones are folded: the
    loop's loads are async copies, issued for at least two chunks ahead (the prologue's), where with
    one stage (the companion) every read is a plain load, each fold step waiting on its own."""
    from consistent_ops.contract import TRITON_TILES
    tile = TRITON_TILES["attention"]["decode"]
    pipelined, plain = state_reads(attention_ttgir(True, True, *tile))
    unpiped, every = state_reads(attention_ttgir(True, True, *tile, fold_stages=1))
    assert unpiped == 0 and plain > 0 and every == 2 * plain    # chunk 0's reads stay plain loads
    assert pipelined >= 2 * plain


def half_fold_reads(ttgir):
    """The split fold's pipelined reads of chunk states of 8 rows (the decode tile's first half)."""
    return len(re.findall(r"ttg\.async_copy_global_to_local [^\n]*tensor<8x128x!tt\.ptr<f32>", ttgir))


def test_a_decode_tile_of_one_token_folds_its_real_half_of_rows():
    """With fold_half, the decode tile (16 rows: two tokens of 8 query heads) folds a tile of one token
    (a decode step) over its first 8 rows alone, through the same pipeline (sm_90 compile, 2026-12-06:
    98 SASS instructions a fold step against 152); the companion: without it, no 8-row fold."""
    from consistent_ops.contract import TRITON_TILES
    tile = TRITON_TILES["attention"]["decode"]
    assert half_fold_reads(attention_ttgir(True, True, *tile, fold_half=True)) >= 2
    assert half_fold_reads(attention_ttgir(True, True, *tile, fold_half=False)) == 0


# A paged decode step's strides as the launcher sees them (a cache [pages, page, Hkv, D], q and out
# [T, Hq, D], D = 128, a table row of 16k columns): multiples of 16, marked so; the key walk's copies
# are async only where their rows are known aligned.
DECODE_STRIDES = ("stride_qt", "stride_qh", "stride_k", "stride_kh", "stride_v", "stride_vh", "stride_ot",
                  "stride_oh", "stride_tab")


def walk_wait(ttgir):
    """The async wait at the top of the split launch's first loop (its chunk's unmasked key blocks):
    how many groups of copies may still be in flight while a block is computed (0: the block's own
    K/V were issued after the block before was computed, a memory round trip exposed every block)."""
    loop = ttgir[ttgir.index("scf.for"):]
    return int(re.search(r"ttg\.async_wait [^\n]*\{num = (\d+) : i32\}", loop).group(1))


@pytest.mark.parametrize("page, hold, ahead", [(16, True, True), (32, True, True), (128, True, True),
                                              (48, True, False), (16, False, False)])
def test_the_split_walk_prefetches_key_blocks_ahead(page, hold, ahead):
    """The decode tail's key walk (one warp a (sequence, KV head, chunk)) reads its chunk's page ids
    before the loop (_held_pages), so its K/V addresses wait on no load and the software pipeline
    keeps a block's copies in flight while the block before is computed (wait num = 2 at 3 stages).
    Companions: a page of 48 keys (not a power of two: per-key lookups) and the probes' `hold=False`
    read the table inside the loop, and the compiler then waits on every copy (num = 0)."""
    from consistent_ops.contract import TRITON_TILES
    num = walk_wait(attention_ttgir(True, True, *TRITON_TILES["attention"]["decode"], page=page,
                                    divisible=DECODE_STRIDES, hold=hold))
    assert (num > 0) == ahead, num


@pytest.mark.parametrize("tile, held", [("forward", 2), ("decode", 3)])
@pytest.mark.parametrize("carry", [True, False], ids=["carried", "read-in-loop"])
def test_the_unsplit_paged_walk_prefetches_when_its_page_ids_are_carried(tile, held, carry, tmp_path):
    """The unsplit paged walk (prefill over the cache, decode of many sequences) with its page ids
    carried a block ahead (_CARRY_PAGES) keeps a block's copies in flight while one is computed (wait
    num = 2 at 3 stages) and still fits 2 forward-tile programs an SM (112 KB of shared memory) or 3
    decode-tile ones (70 KB); the companion, the ids read in the block's own iteration (the default
    until timed), waits on every copy (num = 0) at 81 / 38 KB (2 programs an SM / 3 on Triton 3.6, 4 on
    3.9, where the decode tile's registers allow it)."""
    from consistent_ops.contract import TRITON_TILES
    rows, warps, stages = TRITON_TILES["attention"][tile]
    kernel = attention_compiled(True, False, rows, warps, stages, divisible=DECODE_STRIDES, carry=carry)
    assert (walk_wait(kernel.asm["ttgir"]) == 2) == carry
    programs = programs_an_sm(kernel, warps, tmp_path)
    assert programs == held if carry else programs >= held


def programs_an_sm(kernel, warps, tmp_path):
    """How many programs of a compiled kernel one Hopper SM holds: registers (64K a SM, allocated 256
    a warp; the count read from the cubin by the cuobjdump that Triton ships) and shared memory (228 KB
    a SM; the cubin's static part and Triton's dynamic part)."""
    path = tmp_path / "k.cubin"
    path.write_bytes(kernel.asm["cubin"])
    tool = f"{triton.__path__[0]}/backends/nvidia/bin/cuobjdump"
    usage = subprocess.run([tool, "-res-usage", str(path)], capture_output=True, text=True, check=True,
                           timeout=60).stdout
    regs, static = (int(re.search(rf"{k}:(\d+)", usage).group(1)) for k in ("REG", "SHARED"))
    per_warp = -(-regs * 32 // 256) * 256
    return min(65536 // (per_warp * warps), (228 << 10) // (static + kernel.metadata.shared))


def test_the_split_decode_launch_holds_three_programs_an_sm(tmp_path):
    """The decode tail's split launch (vLLM's strides) fits 3 programs an SM (70 KB of shared memory:
    two stages of K/V blocks, q and p; Triton 3.6 / 3.9: 128 / 121 registers), the count the segmented
    fold's waves are reckoned in; the companion: a third K/V stage (the probe's `stages 4`) leaves room for 2."""
    from consistent_ops.contract import TRITON_TILES
    rows, warps, stages = TRITON_TILES["attention"]["decode"]
    for n, held in ((stages, 3), (stages + 1, 2)):
        kernel = attention_compiled(True, True, rows, warps, n, divisible=DECODE_STRIDES)
        assert programs_an_sm(kernel, warps, tmp_path) == held, n


LOGPROB_TYPES = {"Z": "*fp32", "Temp": "*fp32", "Mx": "*fp32", "Acc": "*fp32", "Out": "*fp32"}


def vocabulary_copies(which, divisible):
    """The sizes (bytes, as PTX writes them) of the async copies in a log-softmax pass compiled for
    the H200; divisible: what the launcher marks divisible by 16 (never vlim here: Qwen3's tokenizer
    limit, 151,669, is no multiple of 16)."""
    from consistent_ops.triton import logprobs as lp
    kernel, const, warps = {"max": (lp._lane_max_kernel, dict(LANES=256), 2),
                            "sum": (lp._lane_sum_kernel, dict(LANES=256, GB=16), 2),
                            "out": (lp._log_softmax_kernel, dict(GB=16), 8)}[which]
    const = dict(const, BLOCK=lp._BLOCK, STAGES=lp._STAGES)
    ptx = compile_h200(kernel, LOGPROB_TYPES, const, divisible, num_warps=warps).asm["ptx"]
    return sorted(set(re.findall(r"cp\.async\.c[ag]\.shared\.global \[[^]]*\], \[[^]]*\], (\w+)", ptx)))


@pytest.mark.parametrize("which", ["max", "sum", "out"])
def test_the_vocabulary_walks_read_vectors_through_the_pipeline(which):
    """Log-softmax passes 1-3 read the logits 16 bytes a copy, asynchronously (ahead of the block
    reduced or written), with a tokenizer limit that is no multiple of 16: the load is masked by the
    row's width and the limit applied after (masked by the limit, every column was a load of its own).
    The companion: a row width that is no multiple of 16 reads 4 bytes a copy."""
    assert vocabulary_copies(which, {"stride_z", "stride_o", "V"}) == ["0x10"]
    assert vocabulary_copies(which, {"stride_z", "stride_o"}) == ["0x4"]


MOE_TYPES = {"X": "*bf16", "Hin": "*bf16", "Wg": "*bf16", "Wu": "*bf16", "Wd": "*bf16", "Hout": "*bf16", "GU": "*bf16",
             "Order": "*i32", "TileE": "*i32", "TileRow0": "*i32", "TileRowEnd": "*i32", "RouteW": "*fp32",
             "Out": "*fp32"}


@pytest.mark.parametrize("axis", [0, 1])
def test_the_expert_kernels_compile_in_either_grid_order(axis):
    """The experts' kernels with their tile on grid axis 0 (large batches) or 1 (decode sizes:
    the plan's tiles before its idle slots), compiled for sm_90 to a cubin with the decode tiles;
    and the router (its NaN row's branch included)."""
    from consistent_ops.triton import moe
    bm, gate_up, down = moe._DECODE
    for kernel, opts, extra in ((moe._gate_up_kernel, gate_up, dict(SAVE_GU=False)), (moe._down_kernel, down, {})):
        const = dict(BM=bm, BLOCK_N=opts["BLOCK_N"], BLOCK_K=opts["BLOCK_K"], TILE_AXIS=axis, **extra)
        assert compile_h200(kernel, MOE_TYPES, const, set(), num_warps=opts["num_warps"],
                            num_stages=opts["num_stages"]).asm["cubin"]
    router = compile_h200(moe._route_kernel, {"L": "*fp32", "Ids": "*i64", "W": "*fp32"},
                          dict(TOPK=8, KB=8, NORM=True, BLOCK=128), set(), num_warps=moe._SOFTMAX_WARPS)
    assert router.asm["cubin"]


def _kernels():
    """Every launched kernel of the Triton backend (its @triton.jit functions named *_kernel)."""
    import importlib
    import pkgutil

    import consistent_ops.triton as pkg
    for mod in pkgutil.iter_modules(pkg.__path__):
        m = importlib.import_module(f"{pkg.__name__}.{mod.name}")
        for name, obj in vars(m).items():
            if name.endswith("_kernel") and isinstance(obj, triton.runtime.JITFunction):
                yield f"{mod.name}.{name}", obj


def test_every_kernel_waits_for_the_previous_launch_first():
    """Programmatic dependent launch is safe only where a kernel touches no memory before its wait:
    every kernel takes PDL (constexpr, default off) and its first statement is pdl_enter(PDL); off the
    GPU a launch asks for none."""
    import ast

    import torch

    from consistent_ops.triton.common import launch
    assert launch(torch.zeros(1)) == dict(EXACT, PDL=False) and launch(torch.zeros(1), fusion=True) == dict(PDL=False)
    found = dict(_kernels())
    assert len(found) >= 25, sorted(found)
    for name, k in found.items():
        last = k.params[-1]
        assert (last.name, last.is_constexpr, last.default) == ("PDL", True, False), name
        body = ast.parse(k.src).body[0].body
        first = body[1] if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) else body[0]
        assert ast.unparse(first) == "pdl_enter(PDL)", name


def test_a_bad_pdl_switch_is_named():
    """CONSISTENT_OPS_PDL takes 0 or 1: another value stops the import with one line naming it and both."""
    import os
    import sys
    kernels = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "kernels")
    env = dict(os.environ, CONSISTENT_OPS_PDL="off", PYTHONPATH=kernels)
    res = subprocess.run([sys.executable, "-c", "import consistent_ops.triton.common"], env=env,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode != 0 and res.stderr.strip().splitlines()[-1] == (
        "ValueError: CONSISTENT_OPS_PDL='off' is not a switch; use 1 (programmatic dependent launch on sm_90+, "
        "the default) or 0 (off)")


def _ptx_ops(kernel):
    """The PTX instructions of a compiled kernel, in order, without comments and debug lines."""
    lines = (ln.split("//")[0].strip() for ln in kernel.asm["ptx"].splitlines())
    return [ln for ln in lines if ln and not ln.startswith(".")]


MEMORY_OPS = ("ld.global", "st.global", "cp.async", "atom.", "red.")


@pytest.mark.parametrize("pdl", [True, False])
def test_the_wait_compiles_before_any_global_memory_op(pdl):
    """With PDL on, the GEMM (and the probe's K split over programs: atomics), and the split decode
    attention (atomics, async copies) compile the grid-dependency wait, then the trigger, before
    their first global load, store or atomic; off (the companion), neither instruction is there."""
    from consistent_ops.triton import gemm

    def gemm_kernel(chunk_k, split):
        return compile_h200(gemm._gemm_kernel, {"X": "*bf16", "W": "*bf16", "Bias": "*bf16", "Y": "*bf16",
                                                "Part": "*fp32", "Count": "*i32"},
                            dict(HAS_BIAS=False, EVEN_K=True, PRECISION="tf32", TMA=False, BLOCK_M=64, BLOCK_N=64,
                                 BLOCK_K=64, GROUP_M=1, CHUNK_K=chunk_k, SPLIT=split, PDL=pdl),
                            {"stride_xm", "stride_wn", "stride_ym", "K", "N"}, num_warps=4, num_stages=4,
                            launch_pdl=pdl)
    for kernel in (gemm_kernel(0, 1), gemm_kernel(512, 4), attention_compiled(True, True, 16, 4, 3, pdl=pdl)):
        ops = _ptx_ops(kernel)
        grid = [i for i, op in enumerate(ops) if op.startswith("griddepcontrol")]
        memory = next(i for i, op in enumerate(ops) if op.startswith(MEMORY_OPS))
        if pdl:
            assert [ops[i].rstrip(";") for i in grid] == ["griddepcontrol.wait", "griddepcontrol.launch_dependents"]
            assert grid[1] < memory
        else:
            assert grid == []
