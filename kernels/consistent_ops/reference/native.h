/* What dot64.c and dot32.c share: operand dtypes, per-thread scratch, bf16 conversions as
 * torch rounds them, prefetch hints. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#else
static inline int omp_get_max_threads(void) { return 1; }
static inline int omp_get_thread_num(void) { return 0; }
static inline int omp_get_num_threads(void) { return 1; }
#endif

enum { F64 = 0, F32 = 1, BF16 = 2 };

static const int64_t ELEM[] = {8, 4, 2};

/* Growing buffers per thread (and per kernel file) for widened rows: never freed, so no
 * allocation per call. Slot 0 is a call's own (scratch_bytes); slot 1 is free; slot 2 is a fused call's chunk
 * buffers, held around the calls it makes (dot32.c fused_chunks); slot 3, a decoder layer's
 * intermediates, held around the fused calls it makes (dot32.c decode_layer32). */
static void *scratch_slot(int slot, size_t bytes) {
    static __thread void *buf[4];
    static __thread size_t cap[4];
    if (bytes > cap[slot]) {
        free(buf[slot]);
        buf[slot] = aligned_alloc(64, (bytes + 63) / 64 * 64);
        cap[slot] = buf[slot] ? bytes : 0;
    }
    return buf[slot];
}

static inline void *scratch_bytes(size_t bytes) { return scratch_slot(0, bytes); }

static inline float bf16_to_float(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* fp32 -> bf16 as torch rounds it (nearest even; NaN -> 0x7FC0). */
static inline uint16_t float_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if (f != f) return 0x7FC0;
    return (uint16_t)((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}

static inline float load_act(const char *p, int dt, int64_t i) {
    return dt == F32 ? ((const float *)p)[i] : bf16_to_float(((const uint16_t *)p)[i]);
}

/* v rounded to the activation dtype and back (identity for fp32). */
static inline float round_act(int dt, float v) { return dt == BF16 ? bf16_to_float(float_to_bf16(v)) : v; }

static inline void store_act(char *p, int dt, int64_t i, float v) {
    if (dt == F32) ((float *)p)[i] = v;
    else ((uint16_t *)p)[i] = float_to_bf16(v);
}

/* Rows of an operand can be scattered (strided views, KV pages): ask for the row PREFETCH
 * ahead while widening this one. Hints only; bits are unaffected. */
enum { PREFETCH = 8 };

static inline void prefetch(const char *p, int64_t bytes) {
    for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(p + off);
}

/* prefetch into L2 (prefetcht1): for rows wanted a whole block of work later. */
static inline void prefetch_l2(const char *p, int64_t bytes) {
    for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(p + off, 0, 2);
}

/* The contract's fold of a KV chunk's attention state (m, l, acc of R rows of D) into the fold of the
 * chunks before it (fm, fl, facc), contract.COMMON["attention"]: a row with no visible key in the
 * chunk (m = -inf) keeps its state; expf is the realisation's exp (fp32 in, fp32 out). Then the
 * chunk's state is reset for the next chunk. Every step is one IEEE fp32 operation (no contraction). */
static inline void fold_chunk(int64_t R, int64_t D, float (*expf32)(float), float *fm, float *fl, float *facc,
                              float *m, float *l, float *acc) {
    for (int64_t r = 0; r < R; r++) {
        if (m[r] != -INFINITY) {
            const float top = fm[r] > m[r] ? fm[r] : m[r];
            const float x = expf32(fm[r] - top), y = expf32(m[r] - top);
            fl[r] = fl[r] * x + l[r] * y;
            for (int64_t d = 0; d < D; d++) facc[r * D + d] = facc[r * D + d] * x + acc[r * D + d] * y;
            fm[r] = top;
        }
        m[r] = -INFINITY;
        l[r] = 0.0f;
        for (int64_t d = 0; d < D; d++) acc[r * D + d] = 0.0f;
    }
}

/* An attention walk's query and output rows (attend64, attend_lanes): row r of (s, h) is (g, t) =
 * (r / T, r % T), at s * st[0] + h * st[1] + g * st[2] + t * st[3] elements (dims[7] = T). T = 1: rows
 * at st[2], as [S, H, R, D]; T = tokens: the G query heads of KV head h and T tokens read and written in
 * place in a [S, T, Hq, D] layout (no permuted copies). */
static inline int64_t attn_row(const int64_t *st, int64_t s, int64_t h, int64_t r, int64_t T) {
    return s * st[0] + h * st[1] + r / T * st[2] + r % T * st[3];
}

/* The walk's result o [R, D] (fp32) into (s, h)'s rows of out (strides os, attn_row) in dt: F32 as is,
 * F64 widened, BF16 rounded as torch rounds (the .to() each replaces). */
static void store_attn_rows(const float *o, int64_t R, int64_t D, int64_t T, int dt, char *out, const int64_t *os,
                            int64_t s, int64_t h) {
    for (int64_t r = 0; r < R; r++) {
        char *dst = out + attn_row(os, s, h, r, T) * ELEM[dt];
        if (dt == F32) memcpy(dst, o + r * D, (size_t)D * sizeof(float));
        else if (dt == F64) for (int64_t d = 0; d < D; d++) ((double *)dst)[d] = o[r * D + d];
        else for (int64_t d = 0; d < D; d++) ((uint16_t *)dst)[d] = float_to_bf16(o[r * D + d]);
    }
}

/* The KV-chunk bookkeeping of an attention walk (attend64, attend_lanes) at KV block j: where a
 * chunk ends, chunk 0's state becomes the fold (its acc stays in o) or a later chunk's state is
 * folded into it, and the next chunk starts fresh. Returns the acc block j accumulates into. */
static inline float *chunk_step(int64_t j, int64_t per_chunk, int64_t R, int64_t D, float (*expf32)(float),
                                float *fm, float *fl, float *o, float *m, float *l, float *ca) {
    if (j == per_chunk) {
        memcpy(fm, m, (size_t)R * sizeof(float));
        memcpy(fl, l, (size_t)R * sizeof(float));
        for (int64_t r = 0; r < R; r++) m[r] = -INFINITY, l[r] = 0.0f;
        memset(ca, 0, (size_t)(R * D) * sizeof(float));
    } else if (j > per_chunk && j % per_chunk == 0)
        fold_chunk(R, D, expf32, fm, fl, o, m, l, ca);
    return j < per_chunk ? o : ca;
}

/* The walk's end after `blocks` KV blocks: the last chunk folded (if there were several), then
 * o = acc / l per row, every division IEEE. */
static inline void chunk_finish(int64_t blocks, int64_t per_chunk, int64_t R, int64_t D, float (*expf32)(float),
                                float *fm, float *fl, float *o, float *m, float *l, float *ca) {
    if (blocks > per_chunk) fold_chunk(R, D, expf32, fm, fl, o, m, l, ca);
    const float *lsum = blocks > per_chunk ? fl : l;
    for (int64_t r = 0; r < R; r++)
        for (int64_t d = 0; d < D; d++) o[r * D + d] = o[r * D + d] / lsum[r];
}

/* RMSNorm of T rows of H (dt = F32 or BF16, rows contiguous): r = x (+ residual, added in
 * dt, written to res_out); var = sumsq(r zero-padded to a multiple of lanes) / H, the
 * contract_dot(r, r) of the calling kernel; inv = 1 / sqrt(var + eps);
 * out = dt(dt(r * inv) * w), every step an IEEE fp32 operation rounded as torch rounds it,
 * so the same bits as reference/norm.py's torch steps, which autograd uses instead.
 * Rows go NORM_GROUP at a time, their sums first, then their divisions and roots, which are
 * independent: a row no longer waits for the last one's serial sum, division, root and division
 * (the q/k norms' many rows of 64; dot32.c's prologue 6.75 -> 6.2 ms a 4096-row layer).
 * norm_rows_dt is inlined once per dtype, so its loops carry no dtype branch and vectorise. */
enum { NORM_GROUP = 16 };
static inline __attribute__((always_inline)) void norm_rows_dt(
        float (*sumsq)(const float *, int64_t), int64_t lanes, int64_t T, int64_t H, const int dt, const char *x,
        int64_t sx, const char *res, int64_t sres, const char *w, float eps, char *out, char *res_out) {
    const int64_t e = ELEM[dt], hp = (H + lanes - 1) / lanes * lanes;
    float *r = scratch_bytes((size_t)(NORM_GROUP * hp + H) * sizeof(float)), *wf = r + NORM_GROUP * hp;
    for (int64_t i = 0; i < H; i++) wf[i] = load_act(w, dt, i);
    for (int64_t t0 = 0; t0 < T; t0 += NORM_GROUP) {
        const int64_t g = T - t0 < NORM_GROUP ? T - t0 : NORM_GROUP;
        float inv[NORM_GROUP];
        for (int64_t k = 0; k < g; k++) {
            float *rk = r + k * hp;
            const char *xr = x + (t0 + k) * sx * e;
            for (int64_t i = 0; i < H; i++) rk[i] = load_act(xr, dt, i);
            for (int64_t i = H; i < hp; i++) rk[i] = 0.0f;
            if (res) {
                const char *rr = res + (t0 + k) * sres * e;
                for (int64_t i = 0; i < H; i++) rk[i] = round_act(dt, rk[i] + load_act(rr, dt, i));
                for (int64_t i = 0; i < H; i++) store_act(res_out + (t0 + k) * H * e, dt, i, rk[i]);
            }
            inv[k] = sumsq(rk, hp);
        }
        for (int64_t k = 0; k < g; k++) inv[k] = 1.0f / sqrtf(inv[k] / (float)H + eps);
        for (int64_t k = 0; k < g; k++)
            for (int64_t i = 0; i < H; i++)
                store_act(out + (t0 + k) * H * e, dt, i, round_act(dt, r[k * hp + i] * inv[k]) * wf[i]);
    }
}

static void norm_rows(float (*sumsq)(const float *, int64_t), int64_t lanes, int64_t T, int64_t H, int dt,
                      const char *x, int64_t sx, const char *res, int64_t sres, const char *w, float eps,
                      char *out, char *res_out) {
    if (dt == BF16) norm_rows_dt(sumsq, lanes, T, H, BF16, x, sx, res, sres, w, eps, out, res_out);
    else norm_rows_dt(sumsq, lanes, T, H, F32, x, sx, res, sres, w, eps, out, res_out);
}
