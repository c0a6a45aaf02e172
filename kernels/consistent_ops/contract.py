"""The numerics contract: every rule that decides the bits of a log-prob, in one place.

Both engines (trainer and rollout) call the same op functions; this module writes
down what those functions compute, so that a reader, a backend author and the
fingerprint all see one text. A backend realises the COMMON rules exactly and
states how it realises contractions (its ``ACCUMULATION`` entry); two engines
agree bitwise only when they log the same fingerprint.
"""
from __future__ import annotations

import hashlib
import json
import math

VERSION = 1

# Keys are walked in fixed blocks of KV_BLOCK positions, from position 0, in order,
# in every attention path (training varlen, prefill, chunked prefill, decode).
# It is independent of the KV-cache page size on purpose (rule 2/3 of the seeds).
KV_BLOCK = 64
# The KV block is a per-backend value where a backend's attention kernel fixes it:
# flash-attention-npu's consistency build walks keys in stacks of 512 (ascend backend).
ASCEND_KV_BLOCK = 512
# Keys are also cut into chunks of KV_CHUNK positions (a multiple of every KV block): each chunk's
# softmax state starts fresh and the chunk states are folded in chunk order by one formula, so a
# decoder may walk the chunks of a long sequence in parallel programs and fold them after, with
# the bits of the trainer's one walk (the seeds' "online softmax split strategy aligned").
KV_CHUNK = 512



def attention_scale(head_dim: int) -> float:
    """The softmax scale every attention path uses unless given one: 1 / sqrt(head_dim) in fp64
    (one spelling: ``head_dim ** -0.5`` differs from it in the last fp64 bit for some dims)."""
    return 1.0 / math.sqrt(head_dim)


# Truncation (top-k / top-p / min-p) sums probabilities as int64 fixed point with this
# many fraction bits: every sum is then exact, so no summation order can reach the bits.
TRUNCATION_FIXED_BITS = 60
# The Triton backend's log-softmax walks the vocabulary in blocks of this many columns,
# in order, into an accumulator of this width (triton/logprobs.py).
TRITON_LOGPROB_BLOCK = 4096
# The Triton backend's attention sums a key block's p per row in int32 fixed point with this many
# fraction bits: one fp32 add of 1.5 * 2^(23 - bits) rounds p to the grid (the sum lands in the
# binade whose ulp is 2^-bits), its bits less the constant's are the integer, and integers add
# exactly: no reduction tree, warps splitting a row's keys included, can reach the bits. p is in
# [0, 2) (above 1 only by the rounding of the row max m', half an ulp of it: < 1 while |m'| < 2^24),
# so the sum stays in the binade and KV_BLOCK * 2^bits * 2 < 2^31. Error <= 2^-(bits+1) a key
# against a row sum >= 1 (the row max's own p); the p that meets V is rounded to bf16 (2^-9) anyway.
TRITON_ATTENTION_SUM_BITS = 21
# The Triton backend's tiles and launch shapes, as data: the kernels (triton/*.py) import
# them, and the fingerprint of every backend running those kernels (triton, ascend) hashes
# them, so a tile that changes (and with it, possibly, an order of a sum) changes the
# fingerprint. Why each value was picked is said where it is used.
TRITON_TILES = {
    # (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, warps, stages, TMA), chosen by M and the program count
    "gemm": {
        # M <= 16 by N: lm_head-wide (thousands of programs), qkv-wide (N 4k..16k), narrower
        "tiny": {"wide": (16, 64, 128, 1, 4, 4, False), "mid": (16, 64, 256, 1, 4, 4, True),
                 "narrow": (16, 16, 256, 1, 2, 4, True)},
        "narrow": {128: (64, 128, 128, 8, 4, 3, True), 64: (64, 64, 128, 1, 4, 4, True),
                   32: (64, 32, 128, 1, 4, 4, True), 16: (64, 16, 128, 1, 4, 6, True)},
        # the one tile for every M under the CPU interpreter and on Ascend
        "pinned": (64, 64, 64, 1, 4, 6, True),
        "mid_narrow": (64, 64, 128, 1, 4, 4, True), "mid_wide": (64, 128, 128, 8, 4, 3, True),
        "mid_square": (128, 128, 64, 8, 8, 6, True), "mid_tall": (128, 64, 64, 8, 4, 4, True),
        "large": (128, 128, 64, 8, 4, 4, True), "huge": (256, 128, 64, 8, 8, 3, True),
    },
    # (rows of one expert a program, gate_up (BLOCK_N, BLOCK_K, warps, stages), down (same)),
    # by the number of (token, slot) rows: decode up to decode_rows, mid up to mid_rows, interpreter pinned
    "moe": {
        "tiles": (128, (128, 64, 8, 4), (256, 64, 8, 3)), "decode": (16, (128, 128, 4, 3), (128, 128, 4, 3)),
        "decode_rows": 2048, "mid": (64, (128, 64, 4, 4), (256, 64, 8, 3)), "mid_rows": 8192,
        "interpreter": (128, (128, 64, 8, 3), (128, 64, 8, 3)),
        # warps of the one-program-a-row reductions, whose tree is their layout: the router's softmax
        # sum over experts (the rollout's fused route and the trainer's softmax alike) and the
        # activation backward's routing-weight gradient
        "router_warps": 4, "act_backward_warps": 4,
    },
    "attention": {
        "forward": (64, 4, 3),              # (rows = (token, query head) pairs, warps, stages)
        "decode": (16, 4, 3),               # paged steps of one new token a sequence: the same bits
        "backward_dkdv": (64, 64, 4),       # (rows, keys, warps)
        "backward_stages": 2,
        "backward_dq": (4, 3),              # (warps, stages)
        "backward_delta_rows": 64,          # delta = rowsum(dO * O): rows a program
        "backward_delta_warps": 4,          # ... on this many warps (the sum's tree)
        "backward_query_chunks": (512, 16, 2 << 30),   # (tokens at least, chunks at most, partial bytes at most)
    },
    "rms_norm_elements": 2048,              # elements a program: a row of H >= 2048, else 2048 / H rows
    "logprob_block": TRITON_LOGPROB_BLOCK,
    "logprob_finish_warps": 8,              # warps of the one tree over a row's stored accumulator
}

COMMON = {
    "attention": (
        "causal GQA; keys walked in blocks of KV_BLOCK from position 0 in order; per block "
        "s = contract_dot(q, k) (fp32), masked (key_pos > query_pos or >= seq_len) to -inf; "
        "online softmax in fp32, in the base the backend's ACCUMULATION names: base e: "
        "m' = max(m, rowmax(s*scale)); a = exp(m - m'); p = exp(s*scale - m') (s*scale rounded first); "
        "base 2: c = scale*log2(e) in fp64 rounded to fp32, m' = max(m, rowmax(s)*c); a = exp2(m - m'); "
        "p = exp2(fma(s, c, -m')) (one rounding); then l = l*a + rowsum(p); acc = acc*a + "
        "contract_dot(p, v). KV chunks: keys are cut into chunks of KV_CHUNK positions from position 0; the "
        "state (m, l, acc) starts fresh (m = -inf, l = 0, acc = 0) at each chunk's first block, a block "
        "with no visible key for a row leaving its state as it is (a = 1 once m is finite; a = 0 and p = 0 "
        "while m = -inf, the exponent taken against 0); chunk states are folded per row in chunk order: F "
        "= the state of chunk 0; for each later chunk c with a visible key (m_c > -inf): M = max(F.m, m_c), "
        "x = E(F.m - M), y = E(m_c - M), F.l = F.l*x + l_c*y, F.acc = F.acc*x + acc_c*y (E the softmax's "
        "exponential in its base, each product rounded to fp32 then the sum, no FMA); a chunk with no "
        "visible key is skipped. out = F.acc / F.l, rounded to the input dtype. Fully masked blocks are "
        "exact no-ops, so walking further never changes bits, and the chunks of a row may be computed in "
        "any programs and folded after. KV for this step is written to the cache before attention."),
    "linear": "out[m, n] = contract_dot(x[m, :], w[n, :]) (+ bias in fp32), rounded to out dtype",
    "linear_row_parallel": (
        "k contiguous K-shards in rank order; each rank's partial is the contraction of its "
        "shard in the backend's partial dtype; partials are gathered (never all-reduced by "
        "the backend) and summed in rank order 0..k-1, then rounded to the out dtype"),
    "rms_norm": (
        "x32 = x (fp32); var = sum(x32^2) / H (reduction per ACCUMULATION); "
        "y = (x32 * (1 / sqrt(var + eps))) -> dtype, then * weight in dtype; "
        "fused residual: r = x + residual in dtype first"),
    "rope": (
        "neox rotate-half; inv_freq = theta^(-2i/d) and angles = pos * inv_freq in fp64; "
        "cos/sin in fp64 rounded to fp32 per position (never depends on table length); "
        "y = x*cos + rotate_half(x)*sin in fp32, rounded to dtype. "
        # Scaled RoPE as transformers computes it (modeling_rope_utils), every step in fp64 (Python
        # floats for scalars); the parameters arrive resolved (defaults filled by the config reader).
        "Scaled RoPE: linear: inv_freq / factor. yarn: c(r) = d*ln(original_max_position_embeddings / (2*pi*r)) / "
        "(2*ln(theta)); low = c(beta_fast), high = c(beta_slow), floor/ceil when truncate; low = max(low, "
        "0), high = min(high, d-1), high += 0.001 when equal; e_i = 1 - clamp((i - low)/(high - low), 0, 1) "
        "for i < d/2; inv_freq = (inv_freq/factor)*(1 - e) + inv_freq*e; cos and sin multiplied by "
        "attention_factor in fp64 before the one rounding to fp32. Types whose frequencies depend on the "
        "sequence length (dynamic, longrope) are not in the contract"),
    "silu_mul": "g32 = gate (fp32); silu = g32 / (1 + exp(-g32)); y = (silu * up32) -> dtype",
    "embedding": "row gather (exact)",
    "moe_router": (
        "logits = contract_dot(x, w_gate) in fp32; softmax in fp32 (exp per transcendentals); "
        "top-k by descending prob, ties to the LOWER expert id (stable sort); "
        "weights renormalised by their fp32 sum when norm_topk_prob"),
    "moe_experts": (
        "per (token, slot): down(silu_mul(gate(x), up(x))) with the linear rule, contribution "
        "kept in fp32 and scaled by its fp32 routing weight; combine = sum over slots 0..k-1 "
        "in slot order in fp32, rounded to dtype; contributions are computed identically on "
        "whichever rank holds the expert and exchanged by gather, never summed across ranks"),
    "logprobs": (
        "logits fp32 (lm_head with out dtype fp32); z = logits / T in fp32; vocabulary rows "
        ">= vocab_limit (the tokenizer length) are -inf, i.e. excluded; m = max z; "
        "lse = log(sum exp(z - m)) with exp/log/sum per ACCUMULATION; logp = (z - m) - lse -> fp32"),
    "transcendentals": (
        "exp, log, cos, sin evaluated in fp64 and rounded to fp32 (vectorised and scalar "
        "CPU paths differ in fp32); rsqrt/sigmoid/silu kernels are never used; sqrt and "
        "division are IEEE correctly rounded"),
    "tie_rule": "top-k ties resolve to the lower index",
    "truncation": (
        "input: a row's contract log-probs logp (logprobs rule, T applied); per row top_k (off when "
        "<= 0 or >= V), top_p (fp64; off when >= 1), min_p (rounded to fp32; off when <= 0); a row "
        "with every setting off is returned unchanged. rank = position in the descending order of "
        "logp, ties to the LOWER token id (stable sort); prob = exp(logp) per transcendentals, fp32; "
        "q = floor(prob * 2^" + str(TRUNCATION_FIXED_BITS) + ") as int64 (exact fixed point: every "
        "sum below is exact, in any order). Kept = the first n ranks, n = max(1, min(n_k, n_p, "
        "n_m)): n_k = top_k; top-p within the top-k set: S = sum of q over ranks < n_k, C_r = sum of "
        "q over ranks < r, rank r < n_k kept while fp64(C_r) < top_p * fp64(S) (fp64 multiply), "
        "i.e. the smallest prefix whose mass reaches top_p of the top-k mass; min-p: rank r kept "
        "while prob_r >= min_p * prob_max (fp32 multiply; relative to the max it commutes with "
        "the others). Output: the logprobs rule at T = 1 on logp with every token outside the "
        "kept set at -inf: the kept set renormalised by the contract's log-sum-exp, -inf outside"),
    "greedy": (
        "temperature 0 = greedy: the token is the argmax of the logprobs rule at T = 1, ties to the "
        "LOWER token id; its reported log-prob is that T = 1 log-prob"),
}

# How each backend realises contract_dot and reductions. The reference backend
# accumulates in fp64: products of bf16/fp32 inputs are exact in fp64. On CPU tensors
# (both engines of a CPU run) one native kernel (reference/dot64.c) fixes the order of the
# sum itself, so no BLAS order, batch shape, layout or thread count can reach the bits;
# on other devices fp64 BLAS sums in its own order, which gives the same bits whenever
# the fp64 sum is exact (bf16 products: 16 significant bits each).
ACCUMULATION = {
    "reference": {
        "contract_dot": (
            "fp64 products; CPU: k in 4 fp64 lanes (lane j: k = j, j+4, ... ascending), "
            "result (lane0 + lane1) + (lane2 + lane3), no FMA, one thread per output; "
            "other devices: fp64 BLAS; rounded once to fp32"),
        "reductions": "fp64, rounded once to fp32; RMSNorm's sum of squares is contract_dot(x, x)",
        "attention": (
            "softmax base e; CPU: one native pass per (sequence, KV head) over K/V blocks (reference/dot64.c "
            "attend64), row sums of p in the contract_dot lane order, exp from libm in fp64; "
            "sqrt: IEEE (libm sqrtf)"),
        "tp_partial_dtype": "float64",
    },
    "triton": {
        "contract_dot": (
            "tl.dot on bf16/fp16 operands (fp32 operands: ieee precision), one fp32 accumulator "
            "carried through K in ascending k16 MMA steps, no split-K; tile shape chosen by M and by "
            "the program count (BLOCK_M 16..256, BLOCK_N 16..256, BLOCK_K 64/128, pointer or CUDA TMA "
            "loads; the CPU interpreter pins one shape), all shapes giving identical bits on the H200; "
            "MoE experts: the same walk over one expert's rows (gate/up fp32, rounded, SiLU*up; down "
            "fp32 times the routing weight), a 16-row tile up to 2048 (token, slot) rows, a 64-row tile up to "
            "8192 and a 128-row tile above, all giving identical bits on the H200; "
            "attention: softmax base 2, p rounded to the value dtype for contract_dot(p, v), acc*a fed as "
            "the MMA accumulator; rowsum(p) = (sum over the block of round(p * 2^TRITON_ATTENTION_SUM_BITS) "
            "in int32, exact) converted to fp32 (round to nearest) times 2^-TRITON_ATTENTION_SUM_BITS, the "
            "rounding by one fp32 add of 1.5 * 2^(23 - TRITON_ATTENTION_SUM_BITS); so any tile and warp "
            "layout gives the same bits: 64-row tiles ((token, query head) pairs, 4 warps: a wgmma "
            "warpgroup) and 16-row tiles of 4 warps (mma.sync, a row's keys across the warps) for paged "
            "steps of one token a sequence (CUDA); a tile's KV chunks folded in its program, or (small "
            "paged batches) one program per chunk writing fp32 states that the tile's last program to "
            "finish folds in chunk order"),
        "reductions": (
            "fp32, whole rows per program (RMSNorm packs rows of H < 2048 to 2048 elements a program), each row "
            "reduced along its own axis, tree shape a function of the row length only (RMSNorm, router "
            "softmax; without autograd the router's top-k and renormalisation run in the same kernel); "
            f"log-softmax walks the vocabulary in blocks of {TRITON_LOGPROB_BLOCK} in order into a "
            f"{TRITON_LOGPROB_BLOCK}-wide fp32 accumulator (lane j: columns j, j + {TRITON_LOGPROB_BLOCK}, ... "
            "in order), stored, then one tree sum over the stored row; attention row max exact in any "
            "order, row sums in integers (see contract_dot)"),
        "transcendentals": (
            "exp/log in fp64 (libdevice) rounded to fp32, except the attention online softmax: fp32 exp2 "
            "(ex2.approx, exp2(0) = 1 and exp2(-inf) = 0 exactly); sqrt and division IEEE (sqrt_rn, div_rn); "
            "no FMA contraction (enable_fp_fusion=False) except the explicit fma of the attention's p"),
        "tp_partial_dtype": "float32",
    },
    "ascend": {
        "contract_dot": (
            "the triton backend's kernels compiled by triton-ascend: tl.dot (ieee precision), one fp32 "
            "accumulator through K in order, no split-K, ONE pinned tile per op for every M (cube "
            "accumulation order across tile shapes is undocumented); where CANN batch_invariant_ops is "
            "installed, bf16-out bias-free linears are npu_mm_batch_invariant (realisation: linear)"),
        "reductions": "as the triton backend (fp32, row-shaped trees), launches chunked by rows",
        "attention": (
            "flash-attention-npu consistency build where flash_attn_npu_v3 imports: keys in stacks of "
            "ASCEND_KV_BLOCK from position 0, fp32 softmax state, p rounded to bf16, num_splits 1, pages of "
            "128 (its softmax base), one walk with no KV chunks (its kernel has no chunk restart); otherwise "
            "the triton attention (KV_BLOCK, KV_CHUNK, base 2); realisation: attention, kv_block, kv_chunk"),
        "transcendentals": (
            "fp32 exp/log (A2/A3 cores have no fp64) in every kernel and in silu_mul; RoPE cos/sin tables "
            "in fp64 on the host CPU (the reference's); sqrt and division IEEE (sqrt_rn, div_rn)"),
        "tp_partial_dtype": "float32",
    },
}


# How the reference backend sums on CPU tensors: one of these realisations per process, chosen
# by $CONSISTENT_OPS_CPU_ACCUMULATION (reference/native.py accumulation()). "fp64" is the
# ACCUMULATION["reference"] text as written (no realisation entry: its fingerprint is the one
# it always was); "fp32" is the realisation entry of the fingerprint, replacing the CPU parts
# of that text. Both are invariant by construction; they give different bits.
CPU_ACCUMULATION_ENV = "CONSISTENT_OPS_CPU_ACCUMULATION"
CPU_ACCUMULATION_DEFAULT = "fp32"
# Where the CPU has VDPBF16PS (flag avx512_bf16: AMD Zen 4/5, Intel Cooper Lake and later) the
# unset variable picks this one instead (native.default_accumulation): a function of the host.
CPU_ACCUMULATION_BF16 = "bf16"
CPU_ACCUMULATION = {
    "fp64": None,
    "fp32": {
        "cpu_accumulation": "fp32",
        "contract_dot": (
            "CPU tensors of bf16/fp16/fp32: operands converted exactly to fp32; k in 16 fp32 lanes "
            "(lane j: k = j, j+16, ... ascending, zero-padded to a multiple of 16), acc_j = fma(a, b, "
            "acc_j) from +0 (reference/dot32.c); lanes reduced by the fixed tree t_i = l_i + l_(i+8), "
            "u_i = t_i + t_(i+4), (u_0 + u_2) + (u_1 + u_3); register blocks share loads, never sums; "
            "one thread per output (AVX-512, AVX2 and scalar fmaf give the same bits); fp64 operands "
            "and other devices: as the reference text"),
        "reductions": "RMSNorm's sum of squares is contract_dot(x, x) in these lanes; the others as the reference text",
        "attention": (
            "CPU: one native pass per (sequence, KV head) over K/V blocks (reference/dot32.c attend32), "
            "q.k and p.v (p fp32) in these lanes, row sums of p in the same 16 lanes by fp32 adds and the "
            "same tree; exp(x): NaN -> NaN, x < -104 -> 0, x clamped to <= 89, in fp64: n = rint(x log2 e), "
            "r = fma(-n, ln2_lo, fma(-n, ln2_hi, x)) (fdlibm's ln2 split), degree-13 Taylor polynomial of "
            "exp(r) by fma Horner, times 2^n, rounded to fp32 (dot32.c exp32_rows; exp(0) = 1); "
            "sqrt: IEEE (libm sqrtf)"),
        "silu_mul": (
            "CPU tensors of bf16/fp32 (gate and up alike), trainer and rollout: exp(-g) by the attention's exp "
            "above (fp64 polynomial rounded to fp32; dot32.c silu_mul32), the other steps as the common rule"),
        "moe_router": (
            "CPU, trainer and rollout, after the linear, per token: m = max of the fp32 logits (NaN if one "
            "is NaN), p = exp(l - m) by the attention's exp above, s = fp32(fp64 sum of p, experts in "
            "ascending id), prob = p / s; top-k by descending prob, NaN first, ties to the lower id; "
            "weights renormalised by fp32(fp64 sum of them, slot order) (dot32.c moe_route32)"),
        "logprobs": (
            "CPU, trainer and rollout, per row: z = logits / T (fp32 division), columns >= vocab_limit -inf, "
            "m = max z (NaN if one is NaN), zs = z - m, e = exp(zs) by the attention's exp above, s = fp64 sum "
            "of e in 8 lanes (lane j: columns j, j+8, ... ascending) reduced ((l0 + l4) + (l2 + l6)) + "
            "((l1 + l5) + (l3 + l7)), lse = fp32(log(s)) (libm log in fp64), logp = zs - lse "
            "(dot32.c log_softmax32)"),
    },
    "bf16": {
        "cpu_accumulation": "bf16",
        "contract_dot": (
            "CPU tensors, both operands bf16: each output ONE fp32 chain over the pairs (k, k+1) = (2j, 2j+1), "
            "j = 0 .. ceil(K/2)-1 ascending (an odd K's last pair completed by a bf16 +0), from acc = +0, "
            "each pair as one VDPBF16PS lane (Intel SDM) does it: acc = ftz(fma(a[k+1], b[k+1], acc)) then "
            "acc = ftz(fma(a[k], b[k], acc)), round to nearest even, bf16 denormal operands read as zero "
            "(DAZ), denormal results flushed to a zero of their sign (FTZ), MXCSR not consulted; no lane "
            "tree (reference/dot32.c dot32p: lanes over n, B packed per call or transposed in registers; "
            "any vector axis gives the same bits); one thread per output; CPUs without avx512_bf16 run the "
            "same steps in C (same bits); any other operand dtypes: the fp32 realisation's lanes; fp64 "
            "operands and other devices: as the reference text"),
        "reductions": "as the fp32 realisation",
        "attention": (
            "as the fp32 realisation (reference/dot32.c attend32p), except q.k of bf16 q and K in 16 "
            "fp32 lanes of pairs, lane j holding (k, k+1) = (32i + 2j, 32i + 2j + 1), i ascending "
            "(zero-padded to a multiple of 32), each pair the VDPBF16PS step above, acc from +0, lanes "
            "reduced by the fp32 realisation's tree; p.v (p fp32) and the row sums of p in the fp32 lanes"),
        "silu_mul": "as the fp32 realisation",
        "moe_router": "as the fp32 realisation",
        "logprobs": "as the fp32 realisation",
    },
}


TILED_BACKENDS = ("triton", "ascend")     # the backends that run the triton/ kernels (TRITON_TILES)


def contract_text(backend: str, realisation=None, model=None) -> str:
    """The canonical text both engines hash: common rules + this backend's realisation
    (``realisation``: what an installation decides, e.g. the ascend backend's kernels and
    package versions; None for backends whose realisation is fixed by this text) + the
    parameters the model passes to the ops (``model``: RoPE, eps, routing, shapes; None: none)."""
    if backend not in ACCUMULATION:
        raise ValueError(f"unknown consistent_ops backend {backend!r}; choose one of {sorted(ACCUMULATION)}")
    doc = {"version": VERSION, "kv_block": KV_BLOCK, "kv_chunk": KV_CHUNK, "triton_logprob_block": TRITON_LOGPROB_BLOCK, "common": COMMON,
           "backend": backend, "accumulation": ACCUMULATION[backend]}
    if backend in TILED_BACKENDS:
        doc["triton_tiles"] = TRITON_TILES
        doc["triton_attention_sum_bits"] = TRITON_ATTENTION_SUM_BITS
    if realisation is not None:
        doc["realisation"] = realisation
    if model is not None:
        doc["model"] = model
    return json.dumps(doc, sort_keys=True)


def fingerprint(backend: str, realisation=None, model=None) -> str:
    """Short id logged by both engines; equal fingerprints = same numerics."""
    digest = hashlib.sha256(contract_text(backend, realisation, model).encode()).hexdigest()[:12]
    return f"cops-v{VERSION}-{backend}-{digest}"
