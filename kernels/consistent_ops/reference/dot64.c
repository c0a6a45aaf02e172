/* contract_dot on the CPU: out = fp32(sum_k a[k] * b[k]) with fp64 accumulation in one
 * fixed order, read straight from bf16 / fp32 / fp64 operands of any strides.
 *
 * Order (the contract's, see contract.py ACCUMULATION["reference"]): k is split into four
 * fp64 lanes, lane j holding k = j, j+4, j+8, ... summed in ascending k (products and sums
 * are separate IEEE operations: built with -ffp-contract=off, no FMA); the result is
 * (lane0 + lane1) + (lane2 + lane3), rounded once to fp32. Every output is computed alone
 * from its own row and column, on one thread, so it never depends on M, N, the batch, the
 * strides, how operands are addressed, the ISA the vector code runs on, or the thread count.
 *
 * Why not torch.matmul on fp64 copies (the previous realisation): widening every operand to
 * fp64 in memory made the rollout's decode step bound by fp64 traffic (KV blocks and weights
 * re-widened each step); here operands are widened in cache-sized buffers.
 */
#include "native.h"

typedef double v4d __attribute__((vector_size(32)));

enum { BFULL_DOUBLES = 1 << 19 }; /* B widened whole up to 4 MiB */
enum { BBUF_DOUBLES = 8192 };   /* else B rows widened at a time: 64 KiB */
enum { ABUF_DOUBLES = 8192 };  /* A rows widened at a time: 64 KiB */

/* n elements at stride s (in elements) -> fp64 dst. The s == 1 loops vectorise. */
static void widen(const char *src, int dt, int64_t n, int64_t s, double *dst) {
    int64_t i;
    if (dt == F64) {
        const double *p = (const double *)src;
        if (s == 1) memcpy(dst, p, (size_t)n * sizeof(double));
        else for (i = 0; i < n; i++) dst[i] = p[i * s];
    } else if (dt == F32) {
        const float *p = (const float *)src;
        if (s == 1) for (i = 0; i < n; i++) dst[i] = p[i];
        else for (i = 0; i < n; i++) dst[i] = p[i * s];
    } else {
        const uint16_t *p = (const uint16_t *)src;
        if (s == 1) for (i = 0; i < n; i++) dst[i] = (double)bf16_to_float(p[i]);
        else for (i = 0; i < n; i++) dst[i] = (double)bf16_to_float(p[i * s]);
    }
}

/* B of one batch entry: element (n, k) at base + n * sn + k * sk (in elements). */
typedef struct {
    const char *base;
    int dt;
    int64_t sn, sk;
} Bview;

static inline v4d load4(const double *p) {
    v4d v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline float finish(v4d lanes) { return (float)((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])); }

/* Two loop nests, one arithmetic. For every output, lane t accumulates a[k] * b[k] over
 * k = t, t+4, ... in ascending k, then (lane0 + lane1) + (lane2 + lane3) is rounded once.
 * "rows" form: B widened as rows n of length kp, a vector holds 4 lanes of one output.
 * "cols" form: B widened as rows k of length ldb, a vector holds one lane of 4 outputs.
 * Which form runs depends only on how B is laid out in memory (k contiguous or not), so
 * e.g. attention's p @ V runs the cols form for the trainer's padded V and the rollout's
 * paged V alike; the bits are the same in either form. */
static inline void store4(float *o, int64_t left, const float v[4]) {
    for (int64_t t = 0; t < 4 && t < left; t++) o[t] = v[t];
}

/* Two A rows at a time (a1 == a0 for a last odd row; its outputs are not stored): each B
 * vector loaded feeds two rows, which keeps the loop off the L2 bandwidth limit. */
static void block_rows(const double *abuf, int64_t mr, const double *bbuf, int64_t nr, int64_t left,
                       int64_t kp, float *out, int64_t ldo) {
    for (int64_t j0 = 0; j0 < nr; j0 += 4) {
        const double *b0 = bbuf + j0 * kp, *b1 = b0 + kp, *b2 = b1 + kp, *b3 = b2 + kp;
        for (int64_t i = 0; i < mr; i += 2) {
            const double *a0 = abuf + i * kp, *a1 = i + 1 < mr ? a0 + kp : a0;
            v4d c00 = {0, 0, 0, 0}, c01 = c00, c02 = c00, c03 = c00;
            v4d c10 = c00, c11 = c00, c12 = c00, c13 = c00;
            for (int64_t k = 0; k < kp; k += 4) {
                const v4d x0 = load4(a0 + k), x1 = load4(a1 + k);
                const v4d y0 = load4(b0 + k), y1 = load4(b1 + k), y2 = load4(b2 + k), y3 = load4(b3 + k);
                c00 += x0 * y0; c01 += x0 * y1; c02 += x0 * y2; c03 += x0 * y3;
                c10 += x1 * y0; c11 += x1 * y1; c12 += x1 * y2; c13 += x1 * y3;
            }
            const float r0[4] = {finish(c00), finish(c01), finish(c02), finish(c03)};
            store4(out + i * ldo + j0, left - j0, r0);
            if (i + 1 < mr) {
                const float r1[4] = {finish(c10), finish(c11), finish(c12), finish(c13)};
                store4(out + (i + 1) * ldo + j0, left - j0, r1);
            }
        }
    }
}

static inline v4d lanes_total(v4d l0, v4d l1, v4d l2, v4d l3) { return (l0 + l1) + (l2 + l3); }

static void block_cols(const double *abuf, int64_t mr, const double *bbuf, int64_t ldb, int64_t nr,
                       int64_t left, int64_t kp, float *out, int64_t ldo) {
    for (int64_t j0 = 0; j0 < nr; j0 += 4) {
        for (int64_t i = 0; i < mr; i += 2) {
            const double *a0 = abuf + i * kp, *a1 = i + 1 < mr ? a0 + kp : a0, *b = bbuf + j0;
            v4d l00 = {0, 0, 0, 0}, l01 = l00, l02 = l00, l03 = l00;
            v4d l10 = l00, l11 = l00, l12 = l00, l13 = l00;
            for (int64_t k = 0; k < kp; k += 4, b += 4 * ldb) {
                const v4d y0 = load4(b), y1 = load4(b + ldb), y2 = load4(b + 2 * ldb), y3 = load4(b + 3 * ldb);
                l00 += a0[k] * y0; l01 += a0[k + 1] * y1; l02 += a0[k + 2] * y2; l03 += a0[k + 3] * y3;
                l10 += a1[k] * y0; l11 += a1[k + 1] * y1; l12 += a1[k + 2] * y2; l13 += a1[k + 3] * y3;
            }
            const v4d t0 = lanes_total(l00, l01, l02, l03), t1 = lanes_total(l10, l11, l12, l13);
            const float r0[4] = {(float)t0[0], (float)t0[1], (float)t0[2], (float)t0[3]};
            store4(out + i * ldo + j0, left - j0, r0);
            if (i + 1 < mr) {
                const float r1[4] = {(float)t1[0], (float)t1[1], (float)t1[2], (float)t1[3]};
                store4(out + (i + 1) * ldo + j0, left - j0, r1);
            }
        }
    }
}

/* B rows n0 .. n0+nr-1, zero-padded to kp (0 * 0 adds nothing), into bbuf: in the rows
 * form when B is contiguous in k (weights, K), else in the cols form with each k's run of
 * n read in order (V: a position's head dims are contiguous). Returns the cols form's row
 * length (0 for the rows form). */
static int64_t widen_b(const Bview *v, int64_t n0, int64_t nr, int64_t K, int64_t kp, double *dst) {
    const int64_t e = ELEM[v->dt], padded = (nr + 3) & ~(int64_t)3;
    if (v->sk == 1) {
        for (int64_t j = 0; j < padded; j++) {
            const char *row = v->base + (n0 + j) * v->sn * e;
            if (j + PREFETCH < nr) prefetch(row + PREFETCH * v->sn * e, K * e);
            if (j < nr) widen(row, v->dt, K, 1, dst + j * kp);
            memset(dst + j * kp + (j < nr ? K : 0), 0, (size_t)(kp - (j < nr ? K : 0)) * sizeof(double));
        }
        return 0;
    }
    for (int64_t k = 0; k < kp; k++) {
        double *d = dst + k * padded;
        if (k < K) widen(v->base + (n0 * v->sn + k * v->sk) * e, v->dt, nr, v->sn, d);
        for (int64_t j = k < K ? nr : 0; j < padded; j++) d[j] = 0.0;
    }
    return padded;
}

/* out[b, m, n] = contract_dot(A[b, m, :], B[b, n, :]) for every entry b of a batch of
 * shape {nb0, nb1, nb2}; shape = {nb0, nb1, nb2, M, N, K}; sa = A strides {b0, b1, b2, m, k};
 * sb = B strides {b0, b1, b2, n, k} (elements); out contiguous fp32 [nb0, nb1, nb2, M, N].
 * mlen [nb] (or NULL) computes only the first mlen[b] rows of entry b and sets the others
 * to 0 (MoE experts padded to the largest group; an empty expert costs nothing);
 * nb = nb0 * nb1 * nb2, entries in row-major batch order. Returns 0, or -1 when out of memory. */
int dot64(const int64_t *shape, const char *A, int ta, const int64_t *sa,
          const char *B, int tb, const int64_t *sb, const int64_t *mlen, float *out) {
    const int64_t M = shape[3], N = shape[4], K = shape[5];
    const int64_t ea = ELEM[ta], eb = ELEM[tb];
    const int64_t kp = (K + 3) & ~(int64_t)3;
    const int64_t mb = kp && ABUF_DOUBLES / kp > 0 ? (ABUF_DOUBLES / kp < M ? ABUF_DOUBLES / kp : M) : 1;
    /* B is widened once per batch entry when it fits (then A once per m block too); else in
     * blocks of nb rows, A again for each. */
    int64_t nb = N * kp <= BFULL_DOUBLES ? N : (BBUF_DOUBLES / kp) & ~(int64_t)3;
    if (nb < 4) nb = 4;
    double *abuf = scratch_bytes((size_t)((mb + ((nb + 3) & ~(int64_t)3)) * kp + 4) * sizeof(double));
    if (!abuf) return -1;
    double *bbuf = abuf + mb * kp;
    int64_t b = 0;
    for (int64_t b0 = 0; b0 < shape[0]; b0++)
    for (int64_t b1 = 0; b1 < shape[1]; b1++)
    for (int64_t b2 = 0; b2 < shape[2]; b2++, b++) {
        const char *Ab = A + (b0 * sa[0] + b1 * sa[1] + b2 * sa[2]) * ea;
        const Bview bv = {B + (b0 * sb[0] + b1 * sb[1] + b2 * sb[2]) * eb, tb, sb[3], sb[4]};
        float *ob = out + b * M * N;
        const int64_t rows = mlen && mlen[b] < M ? (mlen[b] > 0 ? mlen[b] : 0) : M;
        memset(ob + rows * N, 0, (size_t)((M - rows) * N) * sizeof(float));
        for (int64_t n0 = 0; n0 < N && rows; n0 += nb) {
            const int64_t nr = N - n0 < nb ? N - n0 : nb, padded = (nr + 3) & ~(int64_t)3;
            const int64_t ldb = widen_b(&bv, n0, nr, K, kp, bbuf);
            for (int64_t m0 = 0; m0 < rows; m0 += mb) {
                const int64_t mr = rows - m0 < mb ? rows - m0 : mb;
                for (int64_t i = 0; i < mr; i++) {
                    widen(Ab + (m0 + i) * sa[3] * ea, ta, K, sa[4], abuf + i * kp);
                    for (int64_t k = K; k < kp; k++) abuf[i * kp + k] = 0.0;
                }
                float *o = ob + m0 * N + n0;
                if (ldb) block_cols(abuf, mr, bbuf, ldb, padded, N - n0, kp, o, N);
                else block_rows(abuf, mr, bbuf, padded, N - n0, kp, o, N);
            }
        }
    }
    return 0;
}

/* contract_dot(r, r) of n fp32 values (n a multiple of 4) in this file's lanes. */
static float sumsq64(const float *r, int64_t n) {
    v4d lanes = {0, 0, 0, 0};
    for (int64_t i = 0; i < n; i++) lanes[i & 3] += (double)r[i] * (double)r[i];
    return finish(lanes);
}

/* native.h norm_rows with this file's sum of squares. */
void rms_norm_rows(int64_t T, int64_t H, int dt, const char *x, int64_t sx, const char *res, int64_t sres,
                   const char *w, float eps, char *out, char *res_out) {
    norm_rows(sumsq64, 4, T, H, dt, x, sx, res, sres, w, eps, out, res_out);
}

/* out = 1 / sqrt(x) in fp32 with IEEE sqrt and division (torch's CPU sqrt is not correctly
 * rounded: it differs from sqrtf in some last bits). */
void inv_sqrt32(int64_t n, const float *x, float *out) {
    for (int64_t i = 0; i < n; i++) out[i] = 1.0f / sqrtf(x[i]);
}

/* The softmax's exponential of attend64: exp in fp64, rounded to fp32. */
static float exp64f(float x) { return (float)exp((double)x); }

/* The contract's attention for every (sequence s, KV head h), one pass over K/V blocks of
 * KVB positions from 0 in order (contract.py COMMON["attention"]): per block
 * s = fp32(contract_dot(q, k)) * scale, masked past the row's position to -inf;
 * m' = max(m, rowmax s); a = fp32(exp64(m - m')); p = fp32(exp64(s - m'));
 * l = l * a + fp32(lane sum of p); acc = acc * a + fp32(contract_dot(p, v)); the state restarts
 * at every KV chunk of CH positions and chunk states are folded in order (fold_chunk); out = acc / l.
 * Contractions use block_rows / block_cols (the lane order of dot64); fp32 steps are
 * separate IEEE operations. Reading K and V of a block together keeps the one pass over
 * the cache (a paged KV cache is read in place: no gather).
 * dims = {S, H, R, D, L, KVB, CH, T}: R query rows per (s, h), keys 0 .. L-1 (L a multiple of KVB);
 * KVB = contract.KV_BLOCK, CH = contract.KV_CHUNK (a multiple of KVB), passed by native.py so the
 * contract's constants are the only ones.
 * Q element (s, h, r, d) at Q + attn_row(qs, s, h, r, T) + d; K/V element (s, h, pos, d)
 * at base + tok[s*L + pos] + h*kvs[0] + d*kvs[1]; qpos [S*R] (row r of s: its position,
 * < seq_len[s]); V at pos >= seq_len[s] reads as 0. Row r's result to out + attn_row(os, ...) in tout
 * (store_attn_rows). 0 or -1 (memory). */
int attend64(const int64_t *dims, const char *Q, int tq, const int64_t *qs, const char *K, const char *V,
             int tkv, const int64_t *tok, const int64_t *kvs, const int64_t *qpos, const int64_t *seq_len,
             float scale, char *out, int tout, const int64_t *os) {
    const int64_t S = dims[0], H = dims[1], R = dims[2], D = dims[3], L = dims[4], KVB = dims[5], T = dims[7];
    const int64_t per_chunk = dims[6] / KVB;
    const int64_t dp = (D + 3) & ~(int64_t)3, eq = ELEM[tq], ekv = ELEM[tkv];
    const size_t need = (size_t)(R * dp + KVB * dp + KVB * dp + R * KVB + 4) * 2 + (size_t)(R * (dp + 2 * D + 4)) + 8;
    double *buf = scratch_bytes(need * sizeof(double));
    if (!buf) return -1;
    double *qb = buf, *kb = qb + R * dp, *vb = kb + KVB * dp, *pb = vb + KVB * dp;
    float *sb = (float *)(pb + R * KVB), *pv = sb + R * KVB, *mrow = pv + R * dp, *lrow = mrow + R;
    float *fm = lrow + R, *fl = fm + R, *ca = fl + R;   /* the fold of chunks before; a later chunk's acc */
    float *o = ca + R * D;                               /* chunk 0's acc, then the fold, then the result */
    for (int64_t s = 0; s < S; s++)
    for (int64_t h = 0; h < H; h++) {
        const int64_t *ts = tok + s * L;
        const int64_t slen = seq_len[s];
        const int64_t *qp = qpos + s * R;
        for (int64_t r = 0; r < R; r++) {
            widen(Q + attn_row(qs, s, h, r, T) * eq, tq, D, 1, qb + r * dp);
            for (int64_t d = D; d < dp; d++) qb[r * dp + d] = 0.0;
            mrow[r] = -INFINITY;
            lrow[r] = 0.0f;
            for (int64_t d = 0; d < D; d++) o[r * D + d] = 0.0f;
        }
        int64_t last = 0;                                /* blocks up to the largest position */
        for (int64_t r = 0; r < R; r++) last = qp[r] > last ? qp[r] : last;
        int64_t j = 0;
        for (; j * KVB <= last && j * KVB < L; j++) {
            float *acc = chunk_step(j, per_chunk, R, D, exp64f, fm, fl, o, mrow, lrow, ca);
            for (int64_t n = 0; n < KVB; n++) {
                const int64_t pos = j * KVB + n;
                const char *kr = K + (ts[pos] + h * kvs[0]) * ekv, *vr = V + (ts[pos] + h * kvs[0]) * ekv;
                if (n + PREFETCH < KVB) {
                    prefetch(K + (ts[pos + PREFETCH] + h * kvs[0]) * ekv, D * ekv);
                    prefetch(V + (ts[pos + PREFETCH] + h * kvs[0]) * ekv, D * ekv);
                }
                widen(kr, tkv, D, kvs[1], kb + n * dp);
                for (int64_t d = D; d < dp; d++) kb[n * dp + d] = 0.0;
                if (pos < slen) widen(vr, tkv, D, kvs[1], vb + n * dp);
                else memset(vb + n * dp, 0, (size_t)D * sizeof(double));
                for (int64_t d = D; d < dp; d++) vb[n * dp + d] = 0.0;
            }
            block_rows(qb, R, kb, KVB, KVB, dp, sb, KVB);          /* sb[r][n] = fp32 dot */
            for (int64_t r = 0; r < R; r++) {
                float *sr = sb + r * KVB, bm = -INFINITY;
                for (int64_t n = 0; n < KVB; n++) {
                    sr[n] = j * KVB + n <= qp[r] ? sr[n] * scale : -INFINITY;
                    bm = sr[n] > bm ? sr[n] : bm;
                }
                const float m_new = mrow[r] > bm ? mrow[r] : bm;
                const float m0 = m_new == -INFINITY ? 0.0f : m_new;   /* no key seen yet in this chunk */
                const float a = exp64f(mrow[r] - m0);
                v4d lanes = {0, 0, 0, 0};
                for (int64_t n = 0; n < KVB; n++) {
                    const float p = exp64f(sr[n] - m0);
                    pb[r * KVB + n] = p;
                    lanes[n & 3] += (double)p;
                }
                lrow[r] = lrow[r] * a + finish(lanes);
                mrow[r] = m_new;
                sr[0] = a;                                          /* keep a for the acc update */
            }
            block_cols(pb, R, vb, dp, dp, D, KVB, pv, dp);         /* pv[r][d] = fp32 dot(p, v) */
            for (int64_t r = 0; r < R; r++) {
                const float a = sb[r * KVB];
                for (int64_t d = 0; d < D; d++) acc[r * D + d] = acc[r * D + d] * a + pv[r * dp + d];
            }
        }
        chunk_finish(j, per_chunk, R, D, exp64f, fm, fl, o, mrow, lrow, ca);
        store_attn_rows(o, R, D, T, tout, out, os, s, h);
    }
    return 0;
}
