/* contract_dot on the CPU, the fp32 realisation (contract.py CPU_ACCUMULATION["fp32"]):
 * out = sum_k a[k] * b[k] with operands converted exactly to fp32 (bf16, fp16 and fp32
 * widen exactly) and products accumulated by FMA in 16 fp32 lanes.
 *
 * Order: lane j (0..15) holds k = j, j+16, j+32, ... in ascending k, acc_j = fma(a[k], b[k],
 * acc_j) from acc_j = +0 (k padded with zeros to a multiple of 16: fma(0, 0, acc) = acc,
 * and acc is never -0); the lanes are then added by one fixed tree:
 * t_i = l_i + l_{i+8} (i < 8), u_i = t_i + t_{i+4} (i < 4), w_i = u_i + u_{i+2} (i < 2), w_0 + w_1.
 * FMA is one correctly rounded operation, so an AVX-512 register, two AVX2 registers or a
 * scalar fmaf loop give the same bits; every output is computed from its own row and column
 * alone (register blocks share loads, never sums), by one thread (large calls split whole
 * outputs over threads: share), so it never depends on M, N, the batch, the strides, the ISA or
 * the thread count. Built with -ffp-contract=off: every other multiply and add is a separate
 * IEEE operation.
 */
#include "native.h"
#if defined(__AVX512F__) || defined(__FMA__)
#include <immintrin.h>
#endif
enum { LANES = 16 };
enum { BFULL_FLOATS = 1 << 20 };  /* B widened whole up to 4 MiB */
enum { BBUF_FLOATS = 65536 };     /* else blocks of B rows: 256 KiB (L2) */
enum { ABUF_FLOATS = 4096 };      /* A rows widened at a time: 16 KiB (L1) */
enum { PAR_WORK = 1 << 19 };       /* multiply-adds below which one thread runs (a region costs ~us) */

/* The threads for `work` multiply-adds: OpenMP's count (torch's, as torch loads the same
 * libgomp.so.1: torch.set_num_threads and vLLM's core binding set it), one for small work. */
static int threads_for(double work) { return work < PAR_WORK ? 1 : omp_get_max_threads(); }

/* The calling thread's share [lo, hi) of n items cut in whole groups of g, in order. */
static void share(int64_t n, int64_t g, int64_t *lo, int64_t *hi) {
    const int64_t groups = (n + g - 1) / g, t = omp_get_thread_num(), nt = omp_get_num_threads();
    *lo = groups * t / nt * g;
    *hi = groups * (t + 1) / nt * g;
    *hi = *hi < n ? *hi : n;
}

/* 16 fp32 lanes and the three operations the order uses. */
#if defined(__AVX512F__)
typedef struct { __m512 v; } v16;
static inline v16 zero16(void) { v16 r = {_mm512_setzero_ps()}; return r; }
static inline v16 load16(const float *p) { v16 r = {_mm512_loadu_ps(p)}; return r; }
static inline v16 fma16(v16 a, v16 b, v16 c) { v16 r = {_mm512_fmadd_ps(a.v, b.v, c.v)}; return r; }
static inline v16 add16(v16 a, v16 b) { v16 r = {_mm512_add_ps(a.v, b.v)}; return r; }
static inline void store16(float *p, v16 a) { _mm512_storeu_ps(p, a.v); }
static inline v16 set16(float x) { v16 r = {_mm512_set1_ps(x)}; return r; }
static inline v16 max16(v16 a, v16 b) { v16 r = {_mm512_max_ps(a.v, b.v)}; return r; }   /* a > b ? a : b */
#elif defined(__FMA__)
typedef struct { __m256 lo, hi; } v16;
static inline v16 zero16(void) { v16 r = {_mm256_setzero_ps(), _mm256_setzero_ps()}; return r; }
static inline v16 load16(const float *p) { v16 r = {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; return r; }
static inline v16 fma16(v16 a, v16 b, v16 c) {
    v16 r = {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
    return r;
}
static inline v16 add16(v16 a, v16 b) { v16 r = {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; return r; }
static inline void store16(float *p, v16 a) { _mm256_storeu_ps(p, a.lo); _mm256_storeu_ps(p + 8, a.hi); }
static inline v16 set16(float x) { v16 r = {_mm256_set1_ps(x), _mm256_set1_ps(x)}; return r; }
static inline v16 max16(v16 a, v16 b) { v16 r = {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; return r; }
#else
typedef struct { float v[LANES]; } v16;
static inline v16 zero16(void) { v16 r; for (int i = 0; i < LANES; i++) r.v[i] = 0.0f; return r; }
static inline v16 load16(const float *p) { v16 r; memcpy(r.v, p, sizeof r.v); return r; }
static inline v16 fma16(v16 a, v16 b, v16 c) {
    v16 r;
    for (int i = 0; i < LANES; i++) r.v[i] = fmaf(a.v[i], b.v[i], c.v[i]);
    return r;
}
static inline v16 add16(v16 a, v16 b) { v16 r; for (int i = 0; i < LANES; i++) r.v[i] = a.v[i] + b.v[i]; return r; }
static inline void store16(float *p, v16 a) { memcpy(p, a.v, sizeof a.v); }
static inline v16 set16(float x) { v16 r; for (int i = 0; i < LANES; i++) r.v[i] = x; return r; }
static inline v16 max16(v16 a, v16 b) { v16 r; for (int i = 0; i < LANES; i++) r.v[i] = a.v[i] > b.v[i] ? a.v[i] : b.v[i]; return r; }
#endif

/* The fixed lane tree (header comment); the AVX2 steps are that tree on registers. */
static inline float finish16(v16 acc) {
#if defined(__FMA__)
#if defined(__AVX512F__)
    const __m256 t = _mm256_add_ps(_mm512_castps512_ps256(acc.v),                     /* t_i, i < 8 */
                                   _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc.v), 1)));
#else
    const __m256 t = _mm256_add_ps(acc.lo, acc.hi);                                   /* t_i, i < 8 */
#endif
    const __m128 u = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1)); /* u_i, i < 4 */
    const __m128 w = _mm_add_ps(u, _mm_movehl_ps(u, u));                              /* u_0+u_2, u_1+u_3 */
    return _mm_cvtss_f32(_mm_add_ss(w, _mm_shuffle_ps(w, w, 1)));
#else
    float l[LANES];
    store16(l, acc);
    float t[8], u[4];
    for (int i = 0; i < 8; i++) t[i] = l[i] + l[i + 8];
    for (int i = 0; i < 4; i++) u[i] = t[i] + t[i + 4];
    return (u[0] + u[2]) + (u[1] + u[3]);
#endif
}

/* finish16 of four accumulators at once, the same tree in every step (AVX-512: 128-bit
 * quarters moved by shuffles, each add one of the tree's adds for several outputs). */
static inline void finish16x4(v16 a, v16 b, v16 c, v16 d, float *r) {
#if defined(__AVX512F__)
    const __m512 tab = _mm512_add_ps(_mm512_shuffle_f32x4(a.v, b.v, 0x44), _mm512_shuffle_f32x4(a.v, b.v, 0xEE));
    const __m512 tcd = _mm512_add_ps(_mm512_shuffle_f32x4(c.v, d.v, 0x44), _mm512_shuffle_f32x4(c.v, d.v, 0xEE));
    /* tab = [t(a) t(b)], tcd = [t(c) t(d)]; u_i = t_i + t_(i+4) per output, one quarter each */
    const __m512 u = _mm512_add_ps(_mm512_shuffle_f32x4(tab, tcd, 0x88), _mm512_shuffle_f32x4(tab, tcd, 0xDD));
    const __m512 w = _mm512_add_ps(u, _mm512_permute_ps(u, 0x4E));                 /* u_0+u_2, u_1+u_3 */
    const __m512 f = _mm512_add_ps(w, _mm512_permute_ps(w, 0xB1));                 /* w_0 + w_1 */
    _mm_storeu_ps(r, _mm512_castps512_ps128(_mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0), f)));
#else
    r[0] = finish16(a); r[1] = finish16(b); r[2] = finish16(c); r[3] = finish16(d);
#endif
}

/* finish16 of 16 accumulators c[4m + k] (4 columns m of 4 rows k) into the rows k of out (row stride
 * ldo), columns m < nj: out[k * ldo + m] = finish16(c[4m + k]). One tree step for all of them at a time
 * (AVX-512: each add adds the same two lanes as finish16x4's; 22 shuffles, 8 blends and 15 adds where
 * four finish16x4 take 36 shuffles and 20 adds: shuffles share Zen 4's VDPBF16PS pipe, blends run on any),
 * a row of outputs a quarter of the last sum. As there, a NaN's payload is the compiler's pick of operand
 * order; NaN positions are not. */
static inline void finish16x16(const v16 *c, int64_t nj, float *out, int64_t ldo) {
#if defined(__AVX512F__)
    __m512 t[8], u[4], w[2];
    for (int p = 0; p < 8; p++)   /* [t(c[2p]) t(c[2p+1])], t_i = l_i + l_(i+8): [lo(c[2p]) hi(c[2p+1])] + [hi(c[2p]) lo(c[2p+1])] */
        t[p] = _mm512_add_ps(_mm512_mask_blend_ps(0xFF00, c[2 * p].v, c[2 * p + 1].v),
                             _mm512_shuffle_f32x4(c[2 * p].v, c[2 * p + 1].v, 0x4E));
    for (int p = 0; p < 4; p++)   /* quarter k: u(c[4p + k]), u_i = t_i + t_(i+4) */
        u[p] = _mm512_add_ps(_mm512_shuffle_f32x4(t[2 * p], t[2 * p + 1], 0x88),
                             _mm512_shuffle_f32x4(t[2 * p], t[2 * p + 1], 0xDD));
    for (int p = 0; p < 2; p++)   /* quarter k: w_0, w_1 of c[8p + k], then of c[8p + 4 + k] (u_0+u_2, u_1+u_3) */
        w[p] = _mm512_add_ps(_mm512_shuffle_ps(u[2 * p], u[2 * p + 1], 0x44), _mm512_shuffle_ps(u[2 * p], u[2 * p + 1], 0xEE));
    /* quarter k: w_0 + w_1 of c[k], c[4 + k], c[8 + k], c[12 + k] */
    const __m512 f = _mm512_add_ps(_mm512_shuffle_ps(w[0], w[1], 0x88), _mm512_shuffle_ps(w[0], w[1], 0xDD));
    const __mmask8 cols = (__mmask8)((1u << nj) - 1);
    _mm_mask_storeu_ps(out, cols, _mm512_castps512_ps128(f));
    _mm_mask_storeu_ps(out + ldo, cols, _mm512_extractf32x4_ps(f, 1));
    _mm_mask_storeu_ps(out + 2 * ldo, cols, _mm512_extractf32x4_ps(f, 2));
    _mm_mask_storeu_ps(out + 3 * ldo, cols, _mm512_extractf32x4_ps(f, 3));
#else
    for (int m = 0; m < nj; m++) {
        float f[4];
        finish16x4(c[4 * m], c[4 * m + 1], c[4 * m + 2], c[4 * m + 3], f);
        for (int k = 0; k < 4; k++) out[k * ldo + m] = f[k];
    }
#endif
}

/* finish16's tree applied elementwise: l[j] holds lane j of 16 outputs, one output per element. */
static inline v16 tree16(const v16 *l) {
    v16 t[8], u[4];
    for (int i = 0; i < 8; i++) t[i] = add16(l[i], l[i + 8]);
    for (int i = 0; i < 4; i++) u[i] = add16(t[i], t[i + 4]);
    return add16(add16(u[0], u[2]), add16(u[1], u[3]));
}

/* n elements at stride s of a F32 or BF16 operand -> fp32 dst. */
static void widen32(const char *src, int dt, int64_t n, int64_t s, float *dst) {
    int64_t i;
    if (dt == F32) {
        const float *p = (const float *)src;
        if (s == 1) memcpy(dst, p, (size_t)n * sizeof(float));
        else for (i = 0; i < n; i++) dst[i] = p[i * s];
    } else {
        const uint16_t *p = (const uint16_t *)src;
        if (s == 1) {
            i = 0;
#if defined(__AVX512F__)
            for (; i + 16 <= n; i += 16)
                _mm512_storeu_ps(dst + i, _mm512_castsi512_ps(_mm512_slli_epi32(
                                              _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(p + i))), 16)));
#endif
            for (; i < n; i++) dst[i] = bf16_to_float(p[i]);
        }
        else for (i = 0; i < n; i++) dst[i] = bf16_to_float(p[i * s]);
    }
}

/* out[i, j] = contract_dot(arow i, brow j) for mr rows of abuf and nr rows of bbuf, both of
 * length kp (a multiple of 16, zero-padded). Register blocks of 2 x 3 outputs share the
 * loads; each output keeps its own 16 lanes. bbuf holds nr rounded up to 3 rows. */
static void block32(const float *abuf, int64_t mr, const float *bbuf, int64_t nr, int64_t kp,
                    float *out, int64_t ldo) {
    for (int64_t j0 = 0; j0 < nr; j0 += 3) {
        const float *b0 = bbuf + j0 * kp, *b1 = b0 + kp, *b2 = b1 + kp;
        const int64_t nj = nr - j0 < 3 ? nr - j0 : 3;
        for (int64_t i = 0; i < mr; i += 2) {
            const float *a0 = abuf + i * kp, *a1 = i + 1 < mr ? a0 + kp : a0;
            v16 c00 = zero16(), c01 = c00, c02 = c00, c10 = c00, c11 = c00, c12 = c00;
            for (int64_t k = 0; k < kp; k += LANES) {
                const v16 x0 = load16(a0 + k), x1 = load16(a1 + k);
                v16 y = load16(b0 + k);
                c00 = fma16(x0, y, c00); c10 = fma16(x1, y, c10);
                y = load16(b1 + k);
                c01 = fma16(x0, y, c01); c11 = fma16(x1, y, c11);
                y = load16(b2 + k);
                c02 = fma16(x0, y, c02); c12 = fma16(x1, y, c12);
            }
            const float r0[3] = {finish16(c00), finish16(c01), finish16(c02)};
            const float r1[3] = {finish16(c10), finish16(c11), finish16(c12)};
            for (int64_t t = 0; t < nj; t++) out[i * ldo + j0 + t] = r0[t];
            if (i + 1 < mr)
                for (int64_t t = 0; t < nj; t++) out[(i + 1) * ldo + j0 + t] = r1[t];
        }
    }
}

/* B rows n0 .. n0+nr-1 (element (n, k) at base + n*sn + k*sk) as fp32 rows of kp, zero
 * padded in k and to a multiple of 3 rows. A B contiguous in n (e.g. V) is transposed here. */
static void widen_b32(const char *base, int dt, int64_t sn, int64_t sk, int64_t n0, int64_t nr, int64_t K,
                      int64_t kp, float *dst) {
    const int64_t e = ELEM[dt], padded = (nr + 2) / 3 * 3;
    if (sk == 1 || sn != 1) {
        for (int64_t j = 0; j < padded; j++) {
            const char *row = base + (n0 + j) * sn * e;
            if (j + PREFETCH < nr && sk == 1) prefetch(row + PREFETCH * sn * e, K * e);
            const int64_t have = j < nr ? K : 0;
            if (have) widen32(row, dt, K, sk, dst + j * kp);
            memset(dst + j * kp + have, 0, (size_t)(kp - have) * sizeof(float));
        }
        return;
    }
    memset(dst, 0, (size_t)(padded * kp) * sizeof(float));
    for (int64_t k = 0; k < K; k++) {                    /* sn == 1: read each k's run of n in order */
        const char *run = base + (n0 + k * sk) * e;
        if (dt == F32) for (int64_t j = 0; j < nr; j++) dst[j * kp + k] = ((const float *)run)[j];
        else for (int64_t j = 0; j < nr; j++) dst[j * kp + k] = bf16_to_float(((const uint16_t *)run)[j]);
    }
}

/* The "bf16" realisation's pair step (contract.py CPU_ACCUMULATION["bf16"]), as VDPBF16PS does it
 * per fp32 lane (Intel SDM; checked bit for bit on 20M random and adversarial inputs on an AMD
 * Zen 4): acc = ftz(fma(a[k+1], b[k+1], acc)), then acc = ftz(fma(a[k], b[k], acc)), RNE, bf16
 * denormal inputs read as 0 (DAZ), a denormal result flushed to a zero of its sign (FTZ), MXCSR not
 * consulted. Its attention q.k (block_pairs): 16 fp32 lanes, lane j holding the pairs (k, k+1) =
 * (32i + 2j, 32i + 2j + 1), i ascending (k zero-padded to a multiple of 32), acc from +0, then the
 * lane tree of finish16. Its linear contraction: the pair chain (dot_pairs, below). Without
 * AVX512_BF16 the same steps run per lane in C (pair16). */
static inline float daz_bf16(uint16_t h) { return (h & 0x7F80) ? bf16_to_float(h) : 0.0f * bf16_to_float(h); }
static inline float ftz32(float x) { return fabsf(x) < 0x1p-126f ? copysignf(0.0f, x) : x; }
#if defined(__AVX512BF16__) && defined(__AVX512F__)
typedef __m512bh p32;   /* 16 pairs of bf16 */
static inline p32 load_pairs(const uint16_t *p) { return (__m512bh)_mm512_loadu_si512(p); }
static inline v16 pair16(p32 a, p32 b, v16 acc) {
    v16 r = {_mm512_dpbf16_ps(acc.v, a, b)};
    return r;
}
#else
typedef struct { uint16_t v[2 * LANES]; } p32;
static inline p32 load_pairs(const uint16_t *p) { p32 r; memcpy(r.v, p, sizeof r.v); return r; }
static inline v16 pair16(p32 a, p32 b, v16 acc) {
    float l[LANES];
    store16(l, acc);
    for (int j = 0; j < LANES; j++) {
        float c = ftz32(l[j]);
        c = ftz32(fmaf(daz_bf16(a.v[2 * j + 1]), daz_bf16(b.v[2 * j + 1]), c));
        l[j] = ftz32(fmaf(daz_bf16(a.v[2 * j]), daz_bf16(b.v[2 * j]), c));
    }
    return load16(l);
}
#endif
/* The vector paths this build compiled (1: 16 lanes on AVX2 + FMA, 2: on AVX-512, 4: pairs on
 * VDPBF16PS; 0: scalar C): logs and benches name the build a CPU ran, not what its cpuinfo
 * suggests. The bits never depend on it. */
int dot32_isa(void) {
    int isa = 0;
#if defined(__AVX512F__)
    isa |= 2;
#elif defined(__FMA__)
    isa |= 1;
#endif
#if defined(__AVX512BF16__) && defined(__AVX512F__)
    isa |= 4;
#endif
    return isa;
}

enum { PAIR_K = 2 * LANES, PAIR_COLS = 4 };   /* register blocks: 4 rows x PAIR_COLS columns */

/* block32 in the attention's pair lanes (register blocks of 4 x 4 outputs: each 32 k, the block's 4 A rows
 * and 4 B rows are loaded once each, into registers, for its 16 VDPBF16PS): rows of kp (a multiple
 * of PAIR_K) bf16 values, a row i of A at a + i * lda, a row j of B at b[j] (nr rows, b holds nr
 * rounded up to PAIR_COLS). */
static void block_pairs(const uint16_t *a, int64_t lda, int64_t mr, const uint16_t *const *b, int64_t nr,
                        int64_t kp, float *out, int64_t ldo) {
    for (int64_t j0 = 0; j0 < nr; j0 += PAIR_COLS) {
        const int64_t nj = nr - j0 < PAIR_COLS ? nr - j0 : PAIR_COLS;
        const uint16_t *const *bj = b + j0;
        for (int64_t i = 0; i < mr; i += 4) {
            const int64_t mi = mr - i < 4 ? mr - i : 4;
            if (mi == 2) {  /* two rows (decode attention's G = 2): each B load shared, two chains in flight */
                const uint16_t *a0 = a + i * lda, *a1 = a0 + lda;
                v16 c0[PAIR_COLS], c1[PAIR_COLS];
                for (int64_t t = 0; t < PAIR_COLS; t++) c0[t] = c1[t] = zero16();
                for (int64_t k = 0; k < kp; k += PAIR_K) {
                    const p32 x0 = load_pairs(a0 + k), x1 = load_pairs(a1 + k);
                    for (int64_t t = 0; t < PAIR_COLS; t++) {
                        const p32 y = load_pairs(bj[t] + k);
                        c0[t] = pair16(x0, y, c0[t]);
                        c1[t] = pair16(x1, y, c1[t]);
                    }
                }
                float f0[4], f1[4];
                finish16x4(c0[0], c0[1], c0[2], c0[3], f0);
                finish16x4(c1[0], c1[1], c1[2], c1[3], f1);
                for (int64_t t = 0; t < nj; t++) { out[i * ldo + j0 + t] = f0[t]; out[(i + 1) * ldo + j0 + t] = f1[t]; }
                continue;
            }
            if (mi < 4) {   /* one or three tail rows, each alone: no padding rows computed */
                for (int64_t r = 0; r < mi; r++) {
                    const uint16_t *arow = a + (i + r) * lda;
                    v16 c[PAIR_COLS];
                    for (int64_t t = 0; t < PAIR_COLS; t++) c[t] = zero16();
                    for (int64_t k = 0; k < kp; k += PAIR_K) {
                        const p32 x = load_pairs(arow + k);
                        for (int64_t t = 0; t < PAIR_COLS; t++) c[t] = pair16(x, load_pairs(bj[t] + k), c[t]);
                    }
                    float f[4];
                    finish16x4(c[0], c[1], c[2], c[3], f);   /* four independent trees */
                    for (int64_t t = 0; t < nj; t++) out[(i + r) * ldo + j0 + t] = f[t];
                }
                continue;
            }
            const uint16_t *ar = a + i * lda;
            v16 c[PAIR_COLS][4];
            for (int64_t t = 0; t < PAIR_COLS; t++) c[t][0] = c[t][1] = c[t][2] = c[t][3] = zero16();
            for (int64_t k = 0; k < kp; k += PAIR_K) {
                p32 x[4];
                for (int64_t r = 0; r < 4; r++) x[r] = load_pairs(ar + r * lda + k);
                for (int64_t t = 0; t < PAIR_COLS; t++) {
                    const p32 y = load_pairs(bj[t] + k);
                    for (int64_t r = 0; r < 4; r++) c[t][r] = pair16(x[r], y, c[t][r]);
                }
            }
            finish16x16(&c[0][0], nj, out + i * ldo + j0, ldo);
        }
    }
}

/* n bf16 at stride s -> dst[0..kp), zero padded. */
static void copy_bf16(const uint16_t *src, int64_t n, int64_t s, int64_t kp, uint16_t *dst) {
    if (s == 1) memcpy(dst, src, (size_t)n * 2);
    else for (int64_t i = 0; i < n; i++) dst[i] = src[i * s];
    memset(dst + n, 0, (size_t)(kp - n) * 2);
}

/* The "bf16" realisation's linear contraction (dot32p, the MoE experts): the k-serial pair chain
 * (contract.py CPU_ACCUMULATION["bf16"]). out[m, n] is ONE fp32 chain over the pairs j = 0 .. K2-1,
 * K2 = ceil(K / 2) (an odd K's last pair completed by a bf16 +0), in ascending j, from c = +0:
 * c = ftz(fma(a[2j+1], b[2j+1], c)), then c = ftz(fma(a[2j], b[2j], c)) (one VDPBF16PS lane: DAZ
 * operands, FTZ results, RNE), no tree. Every output being the same chain, the vector axis is free:
 * here 16 lanes over n (B packed per call into panels of 16 columns, each pair of a column one 32-bit
 * word, a row's pair broadcast to the 16 lanes); pair16's C emulation gives the same bits per lane. */
enum { CHAIN_COLS = 16, CHAIN_PACK = 1 << 18 };   /* panel width; B packed at a time: 256 KiB (L2) */

#if defined(__AVX512BF16__) && defined(__AVX512F__)
static inline p32 bcast_pair(const uint16_t *p) { int32_t w; memcpy(&w, p, 4); return (__m512bh)_mm512_set1_epi32(w); }
#else
static inline p32 bcast_pair(const uint16_t *p) {
    p32 r;
    for (int j = 0; j < LANES; j++) { r.v[2 * j] = p[0]; r.v[2 * j + 1] = p[1]; }
    return r;
}
#endif

/* The first n (< 16) lanes of a at p. */
static inline void store16n(float *p, v16 a, int64_t n) {
#if defined(__AVX512F__)
    _mm512_mask_storeu_ps(p, (__mmask16)((1u << n) - 1), a.v);
#else
    float l[LANES];
    store16(l, a);
    memcpy(p, l, (size_t)n * sizeof(float));
#endif
}

#if defined(__AVX512F__)
/* Pairs j .. j+3 of the 16 columns at p (column l at p + l * sn, pair j at p) as four registers, out[c]
 * holding pair j + c of all 16 columns: x[i] takes in its 128-bit quarter g column 4g + i's four pairs
 * (one plain and three merge-masked 128-bit broadcast loads: the cross-quarter moves done by the load
 * unit), then an in-lane 4 x 4 transpose of x[0..3] (8 shuffles): 32 shuffles a 16 x 16 block, not 64. */
static inline __attribute__((always_inline)) void pairs4x16(const uint16_t *p, int64_t sn, __m512i *out) {
    __m512i x[4];
    for (int i = 0; i < 4; i++) {
        const uint16_t *c = p + i * sn;
        __m512i v = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)c));
        v = _mm512_mask_broadcast_i32x4(v, 0x00F0, _mm_loadu_si128((const __m128i *)(c + 4 * sn)));
        v = _mm512_mask_broadcast_i32x4(v, 0x0F00, _mm_loadu_si128((const __m128i *)(c + 8 * sn)));
        x[i] = _mm512_mask_broadcast_i32x4(v, 0xF000, _mm_loadu_si128((const __m128i *)(c + 12 * sn)));
    }
    const __m512i t0 = _mm512_unpacklo_epi32(x[0], x[1]), t1 = _mm512_unpackhi_epi32(x[0], x[1]);
    const __m512i t2 = _mm512_unpacklo_epi32(x[2], x[3]), t3 = _mm512_unpackhi_epi32(x[2], x[3]);
    out[0] = _mm512_unpacklo_epi64(t0, t2);
    out[1] = _mm512_unpackhi_epi64(t0, t2);
    out[2] = _mm512_unpacklo_epi64(t1, t3);
    out[3] = _mm512_unpackhi_epi64(t1, t3);
}

/* Pairs j .. j+15 of the 16 columns at bp (column l at bp + l * sn) into a panel's rows j .. j+15 (pd: the panel). */
static inline void pack16x16(const uint16_t *bp, int64_t sn, int64_t j, uint32_t *pd) {
    for (int q = 0; q < 4; q++) {
        __m512i y[4];
        pairs4x16(bp + 2 * j + 8 * q, sn, y);
        for (int c = 0; c < 4; c++) _mm512_storeu_si512(pd + (j + 4 * q + c) * CHAIN_COLS, y[c]);
    }
}
#endif

/* B columns 0 .. nr-1 (element (n, k) at B + n*sn + k*sk) as chain panels: panel p holds columns
 * 16p + l (l < 16), pair j at dst[(p * K2 + j) * 16 + l] = b[n, 2j] | b[n, 2j+1] << 16, zeros past K
 * and past nr. */
static void pack_panels(const uint16_t *B, int64_t sn, int64_t sk, int64_t nr, int64_t K, int64_t K2, uint32_t *dst) {
    for (int64_t p = 0; p * CHAIN_COLS < nr; p++) {
        uint32_t *pd = dst + p * K2 * CHAIN_COLS;
        const uint16_t *bp = B + p * CHAIN_COLS * sn;
        const int64_t nc = nr - p * CHAIN_COLS < CHAIN_COLS ? nr - p * CHAIN_COLS : CHAIN_COLS;
        int64_t j = 0;
#if defined(__AVX512F__)
        if (sk == 1 && nc == CHAIN_COLS)
            for (; j + 16 <= K / 2; j += 16) pack16x16(bp, sn, j, pd);
#endif
        for (; j < K2; j++)
            for (int64_t l = 0; l < CHAIN_COLS; l++) {
                uint32_t w = 0;
                if (l < nc) {
                    const uint16_t *e = bp + l * sn + 2 * j * sk;
                    w = (uint32_t)e[0] | (2 * j + 1 < K ? (uint32_t)e[sk] << 16 : 0u);
                }
                pd[j * CHAIN_COLS + l] = w;
            }
    }
}

/* The chains of R rows of A (row i's pairs at a + i * lda) and Z panels from pk (panel stride ps words):
 * out[i * ldo + 16z + l] for the first nc columns. R x Z accumulators in registers, each its own chain. */
static inline __attribute__((always_inline)) void chain_tile(const int R, const int Z, const uint16_t *a, int64_t lda,
                                                             const uint32_t *pk, int64_t ps, int64_t K2, float *out,
                                                             int64_t ldo, int64_t nc) {
    v16 c[12][8];
#pragma GCC unroll 12
    for (int r = 0; r < R; r++)
#pragma GCC unroll 8
        for (int z = 0; z < Z; z++) c[r][z] = zero16();
    for (int64_t j = 0; j < K2; j++) {
        p32 y[8];
#pragma GCC unroll 8
        for (int z = 0; z < Z; z++) y[z] = load_pairs((const uint16_t *)(pk + z * ps + j * CHAIN_COLS));
#pragma GCC unroll 12
        for (int r = 0; r < R; r++) {
            const p32 x = bcast_pair(a + r * lda + 2 * j);
#pragma GCC unroll 8
            for (int z = 0; z < Z; z++) c[r][z] = pair16(x, y[z], c[r][z]);
        }
    }
#pragma GCC unroll 12
    for (int r = 0; r < R; r++)
#pragma GCC unroll 8
        for (int z = 0; z < Z; z++) {
            const int64_t n = nc - z * CHAIN_COLS;
            if (n >= CHAIN_COLS) store16(out + r * ldo + z * CHAIN_COLS, c[r][z]);
            else if (n > 0) store16n(out + r * ldo + z * CHAIN_COLS, c[r][z], n);
        }
}

/* R rows against every panel of nc columns: Z panels a tile (Z x R accumulators), fewer for the last. */
static inline __attribute__((always_inline)) void chain_row_block(const int R, const int Z, const uint16_t *a, int64_t lda,
                                                                  const uint32_t *pk, int64_t K2, int64_t nc, float *out,
                                                                  int64_t ldo) {
    const int64_t ps = K2 * CHAIN_COLS;
    int64_t n = 0;
    for (; n + Z * CHAIN_COLS <= nc; n += Z * CHAIN_COLS) chain_tile(R, Z, a, lda, pk + n * K2, ps, K2, out + n, ldo, Z * CHAIN_COLS);
    for (; n + 2 * CHAIN_COLS < nc + CHAIN_COLS && Z > 2; n += 2 * CHAIN_COLS)
        chain_tile(R, Z > 2 ? 2 : 1, a, lda, pk + n * K2, ps, K2, out + n, ldo, nc - n);
    for (; n < nc; n += CHAIN_COLS) chain_tile(R, 1, a, lda, pk + n * K2, ps, K2, out + n, ldo, nc - n);
}

/* The row blocks' shapes: 12 rows x 2 panels (24 accumulators), fewer rows across more panels. */
static void chain_rows_r(int R, const uint16_t *a, int64_t lda, const uint32_t *pk, int64_t K2, int64_t nc, float *out, int64_t ldo) {
    switch (R) {
    case 1: chain_row_block(1, 8, a, lda, pk, K2, nc, out, ldo); break;
    case 2: chain_row_block(2, 6, a, lda, pk, K2, nc, out, ldo); break;
    case 3: chain_row_block(3, 4, a, lda, pk, K2, nc, out, ldo); break;
    case 4: chain_row_block(4, 4, a, lda, pk, K2, nc, out, ldo); break;
    case 5: chain_row_block(5, 3, a, lda, pk, K2, nc, out, ldo); break;
    case 6: chain_row_block(6, 3, a, lda, pk, K2, nc, out, ldo); break;
    case 7: chain_row_block(7, 3, a, lda, pk, K2, nc, out, ldo); break;
    case 8: chain_row_block(8, 3, a, lda, pk, K2, nc, out, ldo); break;
    case 9: chain_row_block(9, 2, a, lda, pk, K2, nc, out, ldo); break;
    case 10: chain_row_block(10, 2, a, lda, pk, K2, nc, out, ldo); break;
    case 11: chain_row_block(11, 2, a, lda, pk, K2, nc, out, ldo); break;
    default: chain_row_block(12, 2, a, lda, pk, K2, nc, out, ldo); break;
    }
}

enum { CHAIN_ROWS = 12 };

/* out[i * ldo + n] = the chain of A row i and packed column n, i < mr, n < nc (panels at pk). A rows at
 * a + i * sm, k stride sk; direct (sk == 1, K even): read in place, else copied (zero padded to 2 * K2)
 * into the calling thread's scratch slot 1 a row block at a time. Returns 0, or -1 when out of memory. */
static int chain_rows(const uint16_t *a, int64_t sm, int64_t sk, int direct, int64_t mr, int64_t K, const uint32_t *pk,
                      int64_t K2, int64_t nc, float *out, int64_t ldo) {
    uint16_t *ab = direct ? NULL : scratch_slot(1, (size_t)(CHAIN_ROWS * 2 * K2 + 32) * 2);
    if (!direct && !ab) return -1;
    for (int64_t i = 0; i < mr; i += CHAIN_ROWS) {
        const int64_t R = mr - i < CHAIN_ROWS ? mr - i : CHAIN_ROWS;
        const uint16_t *ar = a + i * sm;
        if (!direct)
            for (int64_t r = 0; r < R; r++) copy_bf16(a + (i + r) * sm, K, sk, 2 * K2, ab + r * 2 * K2);
        chain_rows_r((int)R, direct ? ar : ab, direct ? sm : 2 * K2, pk, K2, nc, out + i * ldo, ldo);
    }
    return 0;
}

#if defined(__AVX512BF16__) && defined(__AVX512F__)
/* Few rows (decode, a MoE expert's few pairs): B's pairs transposed in registers as the chain uses
 * them, no packed copy (packing costs two passes over B, more than these rows' arithmetic). The same
 * steps as chain_tile on the panels pack_panels would make, so the same bits. R rows of A, Z panels of
 * 16 whole columns at b (column l at b + l * sn, k contiguous), K2 a multiple of 16. */
static inline __attribute__((always_inline)) void direct_tile(const int R, const int Z, const uint16_t *a, int64_t lda,
                                                              const uint16_t *b, int64_t sn, int64_t K2, float *out,
                                                              int64_t ldo) {
    v16 c[12][4];
#pragma GCC unroll 12
    for (int r = 0; r < R; r++)
#pragma GCC unroll 4
        for (int z = 0; z < Z; z++) c[r][z] = zero16();
    for (int64_t j = 0; j < K2; j += 16)
        for (int q = 0; q < 4; q++) {
            __m512i y[4][4];
#pragma GCC unroll 4
            for (int z = 0; z < Z; z++) pairs4x16(b + z * CHAIN_COLS * sn + 2 * j + 8 * q, sn, y[z]);
            for (int t = 0; t < 4; t++)
#pragma GCC unroll 12
                for (int r = 0; r < R; r++) {
                    const p32 xa = bcast_pair(a + r * lda + 2 * (j + 4 * q + t));
#pragma GCC unroll 4
                    for (int z = 0; z < Z; z++) c[r][z] = pair16(xa, (p32)y[z][t], c[r][z]);
                }
        }
#pragma GCC unroll 12
    for (int r = 0; r < R; r++)
#pragma GCC unroll 4
        for (int z = 0; z < Z; z++) store16(out + r * ldo + z * CHAIN_COLS, c[r][z]);
}

static inline __attribute__((always_inline)) void direct_rows_z(const int R, const int Z, const uint16_t *a, int64_t lda,
                                                                const uint16_t *b, int64_t sn, int64_t K2, int64_t n16,
                                                                float *out, int64_t ldo) {
    int64_t n = 0;
    for (; n + Z * CHAIN_COLS <= n16; n += Z * CHAIN_COLS) direct_tile(R, Z, a, lda, b + n * sn, sn, K2, out + n, ldo);
    for (; n < n16; n += CHAIN_COLS) direct_tile(R, 1, a, lda, b + n * sn, sn, K2, out + n, ldo);
}
#endif

enum { DIRECT_ROWS = 12 };   /* at most this many rows: direct_tile, no packing */
#if defined(__AVX512BF16__) && defined(__AVX512F__)
enum { DIRECT_BUILT = 1 };
#else
enum { DIRECT_BUILT = 0 };
#endif

/* The chains of mr <= DIRECT_ROWS rows of A (row stride lda, k contiguous, K even) with the columns
 * n < n16 (a multiple of 16) of B (column n at b + n * sn, k contiguous), K a multiple of 32: direct_tile.
 * Returns 0 when it ran, 1 when these operands take the packed path. */
static int chain_direct(const uint16_t *a, int64_t lda, int64_t mr, const uint16_t *b, int64_t sn, int64_t K,
                        int64_t n16, float *out, int64_t ldo) {
#if defined(__AVX512BF16__) && defined(__AVX512F__)
    if (mr < 1 || mr > DIRECT_ROWS || K % 32) return 1;
    const int64_t K2 = K / 2;
    switch (mr) {
    case 1: direct_rows_z(1, 2, a, lda, b, sn, K2, n16, out, ldo); break;
    case 2: direct_rows_z(2, 2, a, lda, b, sn, K2, n16, out, ldo); break;
    case 3: direct_rows_z(3, 2, a, lda, b, sn, K2, n16, out, ldo); break;
    case 4: direct_rows_z(4, 2, a, lda, b, sn, K2, n16, out, ldo); break;
    case 5: direct_rows_z(5, 2, a, lda, b, sn, K2, n16, out, ldo); break;
    case 6: direct_rows_z(6, 2, a, lda, b, sn, K2, n16, out, ldo); break;
    case 7: direct_rows_z(7, 2, a, lda, b, sn, K2, n16, out, ldo); break;
    case 8: direct_rows_z(8, 2, a, lda, b, sn, K2, n16, out, ldo); break;
    case 9: direct_rows_z(9, 1, a, lda, b, sn, K2, n16, out, ldo); break;
    case 10: direct_rows_z(10, 1, a, lda, b, sn, K2, n16, out, ldo); break;
    case 11: direct_rows_z(11, 1, a, lda, b, sn, K2, n16, out, ldo); break;
    default: direct_rows_z(12, 1, a, lda, b, sn, K2, n16, out, ldo); break;
    }
    return 0;
#else
    (void)a; (void)lda; (void)mr; (void)b; (void)sn; (void)K; (void)n16; (void)out; (void)ldo;
    return 1;
#endif
}

/* dot32 for two BF16 operands in the chain order. B packed per call, CHAIN_PACK bytes of columns at a
 * time; A rows read in place where k is contiguous and K even, else copied. solo: on the calling thread
 * alone (a fused call's chunk, its threads already busy), else large blocks split whole panels of
 * columns over the threads (each packs its own panels, then runs them over all rows). */
static int dot_pairs(int solo, const int64_t *shape, const char *A, const int64_t *sa, const char *B, const int64_t *sb,
                     const int64_t *mlen, float *out) {
    const int64_t M = shape[3], N = shape[4], K = shape[5], K2 = (K + 1) / 2;
    const int a_direct = sa[4] == 1 && K % 2 == 0;
    int64_t nb = (CHAIN_PACK / 4 / (K2 ? K2 : 1)) / CHAIN_COLS * CHAIN_COLS;
    const int64_t n16 = (N + CHAIN_COLS - 1) / CHAIN_COLS * CHAIN_COLS;
    nb = nb < CHAIN_COLS ? CHAIN_COLS : nb > n16 ? n16 : nb;
    uint32_t *pk = scratch_bytes((size_t)(nb * K2 + 16) * 4);
    if (!pk) return -1;
    int fail = 0;
    int64_t b = 0;
    for (int64_t b0 = 0; b0 < shape[0]; b0++)
    for (int64_t b1 = 0; b1 < shape[1]; b1++)
    for (int64_t b2 = 0; b2 < shape[2]; b2++, b++) {
        const uint16_t *Ab = (const uint16_t *)A + b0 * sa[0] + b1 * sa[1] + b2 * sa[2];
        const uint16_t *Bb = (const uint16_t *)B + b0 * sb[0] + b1 * sb[1] + b2 * sb[2];
        float *ob = out + b * M * N;
        const int64_t rows = mlen && mlen[b] < M ? (mlen[b] > 0 ? mlen[b] : 0) : M;
        memset(ob + rows * N, 0, (size_t)((M - rows) * N) * sizeof(float));
        for (int64_t n0 = 0; n0 < N && rows; n0 += nb) {
            const int64_t nr = N - n0 < nb ? N - n0 : nb;
            const int nt = solo ? 1 : threads_for((double)rows * nr * K);
#pragma omp parallel num_threads(nt) if (nt > 1) reduction(| : fail)
            {
                int64_t lo, hi;
                share(nr, CHAIN_COLS, &lo, &hi);   /* whole panels of columns */
                int64_t done = 0;   /* columns run by chain_direct: few rows, whole panels */
                if (hi > lo && a_direct && sb[4] == 1 && rows <= DIRECT_ROWS && (hi - lo) >= CHAIN_COLS &&
                    !chain_direct(Ab, sa[3], rows, Bb + (n0 + lo) * sb[3], sb[3], K, (hi - lo) / CHAIN_COLS * CHAIN_COLS,
                                  ob + n0 + lo, N))
                    done = (hi - lo) / CHAIN_COLS * CHAIN_COLS;
                if (hi - lo > done) {
                    const int64_t c0 = n0 + lo + done;
                    pack_panels(Bb + c0 * sb[3], sb[3], sb[4], hi - lo - done, K, K2, pk + (lo + done) * K2);
                    fail |= chain_rows(Ab, sa[3], sa[4], a_direct, rows, K, pk + (lo + done) * K2, K2, hi - lo - done,
                                       ob + c0, N);
                }
            }
        }
    }
    return fail ? -1 : 0;
}

/* The batched contraction of dot64.c (same arguments: shape {nb0, nb1, nb2, M, N, K}, A
 * strides {b0, b1, b2, m, k}, B strides {b0, b1, b2, n, k}, mlen, contiguous fp32 out) in the
 * fp32 order above. Operands F32 or BF16. solo: as dot_pairs. Returns 0, or -1 when out of memory. */
static int dot_lanes(int solo, const int64_t *shape, const char *A, int ta, const int64_t *sa,
                     const char *B, int tb, const int64_t *sb, const int64_t *mlen, float *out) {
    const int64_t M = shape[3], N = shape[4], K = shape[5];
    const int64_t ea = ELEM[ta], eb = ELEM[tb];
    const int64_t kp = (K + LANES - 1) / LANES * LANES;
    int64_t mb = kp ? ABUF_FLOATS / kp : M;
    mb = mb < 2 ? 2 : mb > M ? M : mb;                   /* two rows share each B load */
    int64_t nb = N * kp <= BFULL_FLOATS ? N : (BBUF_FLOATS / kp) / 3 * 3;
    if (nb < 3) nb = 3;
    float *abuf = scratch_bytes((size_t)((mb + (nb + 2) / 3 * 3) * kp + LANES) * sizeof(float));
    if (!abuf) return -1;
    float *bbuf = abuf + mb * kp;
    int64_t b = 0;
    for (int64_t b0 = 0; b0 < shape[0]; b0++)
    for (int64_t b1 = 0; b1 < shape[1]; b1++)
    for (int64_t b2 = 0; b2 < shape[2]; b2++, b++) {
        const char *Ab = A + (b0 * sa[0] + b1 * sa[1] + b2 * sa[2]) * ea;
        const char *Bb = B + (b0 * sb[0] + b1 * sb[1] + b2 * sb[2]) * eb;
        float *ob = out + b * M * N;
        const int64_t rows = mlen && mlen[b] < M ? (mlen[b] > 0 ? mlen[b] : 0) : M;
        memset(ob + rows * N, 0, (size_t)((M - rows) * N) * sizeof(float));
        for (int64_t n0 = 0; n0 < N && rows; n0 += nb) {
            const int64_t nr = N - n0 < nb ? N - n0 : nb;
            widen_b32(Bb, tb, sb[3], sb[4], n0, nr, K, kp, bbuf);
            for (int64_t m0 = 0; m0 < rows; m0 += mb) {
                const int64_t mr = rows - m0 < mb ? rows - m0 : mb;
                for (int64_t i = 0; i < mr; i++) {
                    widen32(Ab + (m0 + i) * sa[3] * ea, ta, K, sa[4], abuf + i * kp);
                    memset(abuf + i * kp + K, 0, (size_t)(kp - K) * sizeof(float));
                }
                const int nt = solo ? 1 : threads_for((double)mr * nr * kp);
#pragma omp parallel num_threads(nt) if (nt > 1)
                {
                    int64_t lo, hi;
                    share(nr, 3, &lo, &hi);                       /* whole register blocks of columns */
                    if (hi > lo) block32(abuf, mr, bbuf + lo * kp, hi - lo, kp, ob + m0 * N + n0 + lo, N);
                }
            }
        }
    }
    return 0;
}

int dot32(const int64_t *shape, const char *A, int ta, const int64_t *sa,
          const char *B, int tb, const int64_t *sb, const int64_t *mlen, float *out) {
    return dot_lanes(0, shape, A, ta, sa, B, tb, sb, mlen, out);
}

/* dot32 in the "bf16" realisation: two BF16 operands in the pair chain, others as dot32. */
int dot32p(const int64_t *shape, const char *A, int ta, const int64_t *sa,
           const char *B, int tb, const int64_t *sb, const int64_t *mlen, float *out) {
    if (ta == BF16 && tb == BF16) return dot_pairs(0, shape, A, sa, B, sb, mlen, out);
    return dot32(shape, A, ta, sa, B, tb, sb, mlen, out);
}

/* The lane sum of x[0..n-1] (plain adds, lane j: n = j, j+16, ... ascending; the tree above). */
static inline float lane_sum32(const float *x, int64_t n) {
    float l[LANES];
    v16 acc = zero16();
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES) acc = add16(acc, load16(x + i));     /* lane j: x[j], x[j+16], ... in order */
    store16(l, acc);
    for (; i < n; i++) l[i % LANES] += x[i];
    return finish16(load16(l));
}

/* exp in fp64, rounded to fp32, by one fixed sequence of IEEE operations (the same in the
 * AVX2 and the scalar form): x < -104 (fp32 exp is 0 below; -inf) -> 0, NaN -> NaN, x clamped
 * to <= 89; n = rint(x * log2(e)); r = fma(-n, ln2_lo, fma(-n, ln2_hi, x)); p = the degree-13
 * Taylor polynomial of exp(r) by Horner with fma (|r| <= 0.35: truncation error < 2e-16);
 * result fp32(p * 2^n). exp(0) = 1 exactly, so masked blocks stay exact no-ops. */
#define EXP_DEGREE 13
static const double EXP_C[EXP_DEGREE + 1] = {
    1.0, 1.0, 1.0 / 2, 1.0 / 6, 1.0 / 24, 1.0 / 120, 1.0 / 720, 1.0 / 5040, 1.0 / 40320, 1.0 / 362880,
    1.0 / 3628800, 1.0 / 39916800, 1.0 / 479001600, 1.0 / 6227020800.0};
static const double LOG2E = 1.4426950408889634, LN2_HI = 0.6931471803691238, LN2_LO = 1.9082149292705877e-10;

static inline float exp32_one(float x) {
    if (x != x) return x;
    if (x < -104.0f) return 0.0f;
    const double xd = x < 89.0f ? (double)x : 89.0;
    const double n = nearbyint(xd * LOG2E);
    const double r = fma(-n, LN2_LO, fma(-n, LN2_HI, xd));
    double p = EXP_C[EXP_DEGREE];
    for (int i = EXP_DEGREE - 1; i >= 0; i--) p = fma(p, r, EXP_C[i]);
    const uint64_t bits = (uint64_t)((int64_t)n + 1023) << 52;
    double scale;
    memcpy(&scale, &bits, 8);
    return (float)(p * scale);
}

/* out[i] = exp32_one(x[i]), i < n. */
static void exp32_rows(const float *x, float *out, int64_t n) {
    int64_t i = 0;
#if defined(__AVX512F__)
    for (; i + 8 <= n; i += 8) {                                            /* the AVX2 steps, 8 wide */
        const __m256 xf = _mm256_loadu_ps(x + i);
        const __m512d xd = _mm512_min_pd(_mm512_cvtps_pd(xf), _mm512_set1_pd(89.0));
        const __m512d nn = _mm512_roundscale_pd(_mm512_mul_pd(xd, _mm512_set1_pd(LOG2E)),
                                                _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        const __m512d negn = _mm512_castsi512_pd(_mm512_xor_si512(_mm512_castpd_si512(nn),
                                                                  _mm512_set1_epi64((long long)0x8000000000000000ULL)));
        __m512d r = _mm512_fmadd_pd(negn, _mm512_set1_pd(LN2_HI), xd);
        r = _mm512_fmadd_pd(negn, _mm512_set1_pd(LN2_LO), r);
        __m512d p = _mm512_set1_pd(EXP_C[EXP_DEGREE]);
        for (int j = EXP_DEGREE - 1; j >= 0; j--) p = _mm512_fmadd_pd(p, r, _mm512_set1_pd(EXP_C[j]));
        const __m512i e = _mm512_slli_epi64(_mm512_add_epi64(_mm512_cvtepi32_epi64(_mm512_cvtpd_epi32(nn)),
                                                             _mm512_set1_epi64(1023)), 52);
        __m256 y = _mm512_cvtpd_ps(_mm512_mul_pd(p, _mm512_castsi512_pd(e)));
        y = _mm256_blendv_ps(y, _mm256_setzero_ps(), _mm256_cmp_ps(xf, _mm256_set1_ps(-104.0f), _CMP_LT_OQ));
        y = _mm256_blendv_ps(y, xf, _mm256_cmp_ps(xf, xf, _CMP_UNORD_Q));
        _mm256_storeu_ps(out + i, y);
    }
#endif
#if defined(__FMA__)
    for (; i + 4 <= n; i += 4) {
        const __m128 xf = _mm_loadu_ps(x + i);
        const __m256d xd = _mm256_min_pd(_mm256_cvtps_pd(xf), _mm256_set1_pd(89.0));
        const __m256d nn = _mm256_round_pd(_mm256_mul_pd(xd, _mm256_set1_pd(LOG2E)),
                                           _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        const __m256d negn = _mm256_xor_pd(nn, _mm256_set1_pd(-0.0));            /* -n, as the scalar form */
        __m256d r = _mm256_fmadd_pd(negn, _mm256_set1_pd(LN2_HI), xd);
        r = _mm256_fmadd_pd(negn, _mm256_set1_pd(LN2_LO), r);
        __m256d p = _mm256_set1_pd(EXP_C[EXP_DEGREE]);
        for (int j = EXP_DEGREE - 1; j >= 0; j--) p = _mm256_fmadd_pd(p, r, _mm256_set1_pd(EXP_C[j]));
        const __m256i e = _mm256_slli_epi64(_mm256_add_epi64(_mm256_cvtepi32_epi64(_mm256_cvtpd_epi32(nn)),
                                                             _mm256_set1_epi64x(1023)), 52);
        __m128 y = _mm256_cvtpd_ps(_mm256_mul_pd(p, _mm256_castsi256_pd(e)));
        y = _mm_blendv_ps(y, _mm_setzero_ps(), _mm_cmplt_ps(xf, _mm_set1_ps(-104.0f)));   /* -inf too */
        y = _mm_blendv_ps(y, xf, _mm_cmpunord_ps(xf, xf));                                 /* NaN */
        _mm_storeu_ps(out + i, y);
    }
#endif
    for (; i < n; i++) out[i] = exp32_one(x[i]);
}

/* contract_dot(r, r) of n fp32 values (n a multiple of 16) in this file's lanes. */
static float sumsq32(const float *r, int64_t n) {
    v16 acc = zero16();
    for (int64_t i = 0; i < n; i += LANES) {
        const v16 v = load16(r + i);
        acc = fma16(v, v, acc);
    }
    return finish16(acc);
}

/* native.h norm_rows with this file's sum of squares, on the calling thread (the fused calls' chunks). */
static void norm_rows32(int64_t T, int64_t H, int dt, const char *x, int64_t sx, const char *res, int64_t sres,
                        const char *w, float eps, char *out, char *res_out) {
    norm_rows(sumsq32, LANES, T, H, dt, x, sx, res, sres, w, eps, out, res_out);
}

/* norm_rows32, a prefill's rows split over the threads (every row alone: the same bits). An element
 * costs about as much as 16 multiply-adds of a dot (its conversions, stores and share of the row's
 * division), so a region pays from ~128 rows of 256. */
void rms_norm_rows32(int64_t T, int64_t H, int dt, const char *x, int64_t sx, const char *res, int64_t sres,
                     const char *w, float eps, char *out, char *res_out) {
    const int64_t e = ELEM[dt];
    const int nt = threads_for((double)T * H * 16);
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
        int64_t lo, hi;
        share(T, 1, &lo, &hi);
        if (hi > lo)
            norm_rows32(hi - lo, H, dt, x + lo * sx * e, sx, res ? res + lo * sres * e : NULL, sres, w, eps, out + lo * H * e,
                        res_out ? res_out + lo * H * e : NULL);
    }
}

/* 16 fp32 values of a V row from element d0: a BF16 row widened in registers (exact), an fp32 row as
 * stored. The attention reads V in place this way instead of widening its rows into a buffer. */
static inline v16 v_load16(const void *row, int bf16, int64_t d0) {
    if (!bf16) return load16((const float *)row + d0);
    const uint16_t *p = (const uint16_t *)row + d0;
#if defined(__AVX512F__)
    v16 r = {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16))};
    return r;
#elif defined(__AVX2__) && defined(__FMA__)
    v16 r = {_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16)),
             _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p + 8))), 16))};
    return r;
#else
    float f[LANES];
    for (int i = 0; i < LANES; i++) f[i] = bf16_to_float(p[i]);
    return load16(f);
#endif
}

/* pv[r][d] = contract_dot(p_r, v[., d]) for d < dp and the rows r = rows[0..NR): p_r at p + r * ldp,
 * pv_r at out + r * dp; V row n at vrow[n] (bf16 or fp32 per bf16), n < nv16 (rows past the visible
 * keys point at zeros). block32's order (lane j: n = j, j+16, ... ascending, from +0; finish16's tree),
 * vectorised over 16 d at a time instead of over the lanes: each d gets exactly the same fmas and adds,
 * and V is used as the cache stores it (no transpose). The NR rows share each V load; their lanes are
 * taken 16 / NR at a time so that the NR x 16 / NR accumulators fit the registers (each lane its own
 * chain: the split changes no sum). Groups of 16 positions with no key visible to these rows are never
 * reached (nv16): fma(+0, v, acc) == acc there (p = +0, v finite or a pad's +0), since a lane that starts
 * at +0 never holds -0. */
static inline __attribute__((always_inline)) void pv_pass(const float *p, int64_t ldp, const int64_t *rows, const int NR,
                                                          const void *const *vrow, const int bf16, int64_t nv16,
                                                          int64_t dp, float *out) {
    const int LP = LANES / NR;                                 /* lanes a pass */
    for (int64_t d0 = 0; d0 < dp; d0 += LANES) {
        v16 l[4][LANES];                                      /* l[r][j]: lane j of row r */
        for (int h = 0; h < LANES; h += LP) {
            v16 a[4][LANES];
            for (int r = 0; r < NR; r++)
                for (int j = 0; j < LP; j++) a[r][j] = zero16();
            for (int64_t i = h; i < nv16; i += LANES)
                for (int j = 0; j < LP; j++) {
                    const v16 v = v_load16(vrow[i + j], bf16, d0);
                    for (int r = 0; r < NR; r++) a[r][j] = fma16(set16(p[rows[r] * ldp + i + j]), v, a[r][j]);
                }
            for (int r = 0; r < NR; r++)
                for (int j = 0; j < LP; j++) l[r][h + j] = a[r][j];
        }
        for (int r = 0; r < NR; r++) store16(out + rows[r] * dp + d0, tree16(l[r]));
    }
}

/* The keys (a multiple of 16) a pass over rows rows[0..nr) reads: nv16[k], row rows[k]'s, at most. */
static inline int64_t pass_keys(const int64_t *nv16, int64_t nr) {
    int64_t n = 0;
    for (int64_t k = 0; k < nr; k++) n = nv16[k] > n ? nv16[k] : n;
    return n;
}

/* pv_pass over the rows rows[0..n) (nv16[k]: row rows[k]'s visible keys rounded up to 16): four at a
 * time (a prefill's many rows: each V load shared by more), then two, then a last one alone. */
static void pv_rows(const float *p, int64_t ldp, const int64_t *rows, int64_t n, const void *const *vrow, int bf16,
                    const int64_t *nv16, int64_t dp, float *out) {
    int64_t k = 0;
    for (; k + 4 <= n; k += 4)
        if (bf16) pv_pass(p, ldp, rows + k, 4, vrow, 1, pass_keys(nv16 + k, 4), dp, out);
        else pv_pass(p, ldp, rows + k, 4, vrow, 0, pass_keys(nv16 + k, 4), dp, out);
    for (; k + 2 <= n; k += 2)
        if (bf16) pv_pass(p, ldp, rows + k, 2, vrow, 1, pass_keys(nv16 + k, 2), dp, out);
        else pv_pass(p, ldp, rows + k, 2, vrow, 0, pass_keys(nv16 + k, 2), dp, out);
    if (k < n) {
        if (bf16) pv_pass(p, ldp, rows + k, 1, vrow, 1, nv16[k], dp, out);
        else pv_pass(p, ldp, rows + k, 1, vrow, 0, nv16[k], dp, out);
    }
}

/* Asks for the K (or V) rows X (bytes each) of n keys, at (t[i] + hk) * e, as prefetcht1 (L2): a whole
 * block asked at once with prefetcht0 stalled on L1's miss buffers and was slower (Zen 4). Hints only. */
static void prefetch_rows(const char *X, const int64_t *t, int64_t n, int64_t hk, int64_t e, int64_t bytes) {
    for (int64_t i = 0; i < n; i++) prefetch_l2(X + (t[i] + hk) * e, bytes);
}

/* Query rows scored together: block_pairs' register block. Causal prefill rows see a triangle of
 * a diagonal block and nothing of a later one, so each group is scored up to its last visible key. */
enum { SCORE_ROWS = 4 };

/* The keys (< nvis) of a block starting at position b0 that some of rows qp[0..rn) see. The scores
 * past them are masked (-inf, never read), so they need no dot. */
static inline int64_t group_keys(const int64_t *qp, int64_t rn, int64_t b0, int64_t nvis) {
    int64_t cols = 0;
    for (int64_t r = 0; r < rn; r++) cols = qp[r] - b0 + 1 > cols ? qp[r] - b0 + 1 : cols;
    return cols < nvis ? cols : nvis;
}

/* dot64.c's attend64 (same arguments, loop and KV chunks) with the contractions and the row sums
 * of p in this file's order; exp by exp32_rows (and exp32_one in the chunks' fold). pairs: q.k of BF16 q and K in the pair lanes (block_pairs).
 * Keys past the last query position of a block (masked for every row) are neither read nor
 * multiplied: their scores are -inf and their p exactly 0 either way; a row is skipped in a
 * block it sees no key of (a = exp(0) = 1, p = 0: l and o would be kept exactly). */
static int attend_lanes(const int64_t *dims, const char *Q, int tq, const int64_t *qs, const char *K, const char *V,
                        int tkv, const int64_t *tok, const int64_t *kvs, const int64_t *qpos, const int64_t *seq_len,
                        float scale, char *out, int tout, const int64_t *os, int pairs) {
    const int64_t S = dims[0], H = dims[1], R = dims[2], D = dims[3], L = dims[4], KVB = dims[5], T = dims[7];
    const int64_t per_chunk = dims[6] / KVB;                     /* KV blocks a chunk */
    const int64_t dp = (D + LANES - 1) / LANES * LANES, kvp = (KVB + LANES - 1) / LANES * LANES;
    const int64_t npad = (KVB + 2) / 3 * 3, eq = ELEM[tq], ekv = ELEM[tkv];
    const int64_t dq = (D + PAIR_K - 1) / PAIR_K * PAIR_K;       /* pair rows (bf16) */
    const int64_t nq = (KVB + PAIR_COLS - 1) / PAIR_COLS * PAIR_COLS;
    pairs = pairs && tq == BF16 && tkv == BF16;
    const int k_direct = pairs && kvs[1] == 1 && dq == D;       /* K rows read in place from the cache */
    const int v_direct = kvs[1] == 1 && dp == D;                /* V rows too (whole 16-element loads) */
    const int v_bf16 = v_direct && tkv == BF16;                 /* ... widened in registers */
    const size_t need = (size_t)(R * dp + npad * dp + kvp * dp + R * kvp + R * kvp + R * dp + 5 * R + 2 * R * D + dp + 64)
                        + (size_t)(nq + kvp + 2 * R) * 2 + (pairs ? (size_t)((R + nq) * dq / 2 + 16) : 0);
    const int nt = threads_for((double)S * H * R * L * D);
    int fail = 0;
#pragma omp parallel num_threads(nt) if (nt > 1) reduction(| : fail)
    {   /* each thread its (s, h) share, with its own buffers */
    float *buf = scratch_bytes(need * sizeof(float));
    int64_t lo, hi;
    share(S * H, 1, &lo, &hi);
    fail = !buf;
    if (!buf) hi = lo;
    float *qb = buf, *kb = qb + R * dp, *vb = kb + npad * dp, *pb = vb + kvp * dp, *sbuf = pb + R * kvp;
    float *pv = sbuf + R * kvp, *mrow = pv + R * dp, *lrow = mrow + R;
    float *fm = lrow + R, *fl = fm + R, *ca = fl + R;   /* the fold of chunks before; a later chunk's acc */
    float *o = ca + R * D;                              /* chunk 0's acc, then the fold, then the result */
    float *arow = o + R * D, *zrow = arow + R;          /* each active row's rescale a; a V row of zeros */
    if (buf) memset(kb, 0, (size_t)(npad * dp + kvp * dp + R * kvp) * sizeof(float));   /* pads stay 0 */
    if (buf) memset(zrow, 0, (size_t)dp * sizeof(float));
    const uint16_t **krow = (const uint16_t **)(((uintptr_t)(zrow + dp) + 63) & ~(uintptr_t)63);
    const void **vrow = (const void **)(krow + nq);     /* block j's V rows: in the cache, vb or zrow */
    int64_t *act = (int64_t *)(vrow + kvp);             /* the rows that see some key of block j */
    int64_t *act16 = act + R;                           /* ... and the keys each sees, rounded up to 16 */
    uint16_t *qb16 = (uint16_t *)(act16 + R), *kb16 = qb16 + R * dq;
    for (int64_t sh = lo; sh < hi; sh++) {
        const int64_t s = sh / H, h = sh % H;
        const int64_t *ts = tok + s * L;
        const int64_t *qp = qpos + s * R;
        const int64_t slen = seq_len[s];
        for (int64_t r = 0; r < R; r++) {
            const char *qr = Q + attn_row(qs, s, h, r, T) * eq;
            if (pairs) copy_bf16((const uint16_t *)qr, D, 1, dq, qb16 + r * dq);
            else {
                widen32(qr, tq, D, 1, qb + r * dp);
                memset(qb + r * dp + D, 0, (size_t)(dp - D) * sizeof(float));
            }
            mrow[r] = -INFINITY;
            lrow[r] = 0.0f;
            for (int64_t d = 0; d < D; d++) o[r * D + d] = 0.0f;
        }
        int64_t last = 0;
        for (int64_t r = 0; r < R; r++) last = qp[r] > last ? qp[r] : last;
        int64_t j = 0;
        for (; j * KVB <= last && j * KVB < L; j++) {
            float *acc = chunk_step(j, per_chunk, R, D, exp32_one, fm, fl, o, mrow, lrow, ca);
            const int64_t nvis = last - j * KVB + 1 < KVB ? last - j * KVB + 1 : KVB;   /* keys some row sees */
            const int64_t nv16 = (nvis + LANES - 1) / LANES * LANES;
            const int64_t *tj = ts + j * KVB, hk = h * kvs[0];    /* block j's token offsets */
            const int64_t vis = slen - j * KVB < 0 ? 0 : slen - j * KVB < nvis ? slen - j * KVB : nvis;   /* V rows in the sequence */
            int64_t na = 0;
            for (int64_t r = 0; r < R; r++)
                if (j * KVB <= qp[r]) act[na++] = r;   /* a block a row sees nothing of: an exact no-op (m, l, o kept) */
            /* BF16 V read in place is widened by every pass over it: for more rows than one pass, once into vb */
            const int v_place = v_direct && (!v_bf16 || na <= 4);
            for (int64_t n = 0; n < nvis; n++) {                 /* K and V rows in place: no branch, no copy */
                krow[n] = (const uint16_t *)(K + (tj[n] + hk) * ekv);
                vrow[n] = V + (tj[n] + hk) * ekv;
            }
            if (!k_direct)
                for (int64_t n = 0; n < nvis; n++)
                    if (pairs) { copy_bf16(krow[n], D, kvs[1], dq, kb16 + n * dq); krow[n] = kb16 + n * dq; }
                    else widen32((const char *)krow[n], tkv, D, kvs[1], kb + n * dp);
            if (!v_place)
                for (int64_t n = 0; n < vis; n++) { widen32(vrow[n], tkv, D, kvs[1], vb + n * dp); vrow[n] = vb + n * dp; }   /* d pads stay 0 */
            for (int64_t n = vis; n < nv16; n++) vrow[n] = zrow;          /* V past the sequence reads as 0; pads */
            /* The walk's next block (this (s, h)'s next, else the next (s, h)'s first) asked for now, to arrive
             * while this one is computed (the cache's rows are rarely in L2 between steps): its K rows before
             * this block's scores, its V rows after them. Both at once filled the miss queues and stalled:
             * a cold decode step's attention 1.4x slower (Zen 4, 1 thread). */
            int64_t s1 = s, h1 = h, p1 = (j + 1) * KVB, n1 = last - p1 + 1;
            if (p1 > last || p1 >= L) s1 = (sh + 1) / H, h1 = (sh + 1) % H, p1 = 0, n1 = sh + 1 < hi ? KVB : 0;
            n1 = n1 < KVB ? n1 : KVB;
            const int64_t *next = tok + s1 * L + p1, n_next = n1 < L - p1 ? n1 : L - p1;
            prefetch_rows(K, next, n_next, h1 * kvs[0], ekv, D * ekv);
            if (pairs)
                for (int64_t n = nvis; n < (nvis + PAIR_COLS - 1) / PAIR_COLS * PAIR_COLS; n++) krow[n] = krow[0];
            for (int64_t r0 = 0; r0 < R; r0 += SCORE_ROWS) {   /* sbuf[r][n] = contract_dot(q, k) */
                const int64_t rn = R - r0 < SCORE_ROWS ? R - r0 : SCORE_ROWS, cols = group_keys(qp + r0, rn, j * KVB, nvis);
                if (cols && pairs) block_pairs(qb16 + r0 * dq, dq, rn, krow, cols, dq, sbuf + r0 * kvp, kvp);
                else if (cols) block32(qb + r0 * dp, rn, kb, cols, dp, sbuf + r0 * kvp, kvp);
            }
            prefetch_rows(V, next, n_next, h1 * kvs[0], ekv, D * ekv);
            /* The rows' softmax steps in passes over all active rows, not row by row: a pass's vector loads
             * then find the last pass's narrower stores retired, not stalled waiting to forward them. */
            for (int64_t k = 0; k < na; k++) {
                const int64_t r = act[k];
                float *sr = sbuf + r * kvp;
                const int64_t see = qp[r] - j * KVB + 1 < nvis ? qp[r] - j * KVB + 1 : nvis;   /* keys this row sees */
                for (int64_t n = 0; n < see; n++) sr[n] = sr[n] * scale;
                for (int64_t n = see; n < kvp; n++) sr[n] = -INFINITY;
            }
            for (int64_t k = 0; k < na; k++) {
                const int64_t r = act[k];
                float bm = -INFINITY, lm[LANES];
                v16 mx = set16(-INFINITY);
                for (int64_t n = 0; n < kvp; n += LANES) mx = max16(load16(sbuf + r * kvp + n), mx);   /* s > m ? s : m, per lane */
                store16(lm, mx);
                for (int i = 0; i < LANES; i++) bm = lm[i] > bm ? lm[i] : bm;
                const float m_new = mrow[r] > bm ? mrow[r] : bm;
                arow[k] = mrow[r] - m_new;
                mrow[r] = m_new;
            }
            exp32_rows(arow, arow, na);                           /* each active row's rescale a */
            for (int64_t k = 0; k < na; k++) {
                const int64_t r = act[k];
                const float *sr = sbuf + r * kvp;
                float *pr = pb + r * kvp;
                const int64_t see = qp[r] - j * KVB + 1 < nvis ? qp[r] - j * KVB + 1 : nvis;
                const int64_t e8 = (see + 7) / 8 * 8 < KVB ? (see + 7) / 8 * 8 : KVB;   /* whole vectors of exp */
                for (int64_t n = 0; n < e8; n++) pr[n] = sr[n] - mrow[r];
                exp32_rows(pr, pr, e8);
                for (int64_t n = see; n < KVB; n++) pr[n] = 0.0f;     /* exp32(-inf): the masked keys */
                act16[k] = (see + LANES - 1) / LANES * LANES;
            }
            pv_rows(pb, kvp, act, na, vrow, v_bf16 && v_place, act16, dp, pv);   /* pv[r][d] = contract_dot(p, v) */
            for (int64_t k = 0; k < na; k++) {
                const int64_t r = act[k];
                lrow[r] = lrow[r] * arow[k] + lane_sum32(pb + r * kvp, KVB);
                for (int64_t d = 0; d < D; d++) acc[r * D + d] = acc[r * D + d] * arow[k] + pv[r * dp + d];
            }
        }
        chunk_finish(j, per_chunk, R, D, exp32_one, fm, fl, o, mrow, lrow, ca);
        store_attn_rows(o, R, D, T, tout, out, os, s, h);
    }
    }
    return fail ? -1 : 0;
}

int attend32(const int64_t *dims, const char *Q, int tq, const int64_t *qs, const char *K, const char *V,
             int tkv, const int64_t *tok, const int64_t *kvs, const int64_t *qpos, const int64_t *seq_len,
             float scale, char *out, int tout, const int64_t *os) {
    return attend_lanes(dims, Q, tq, qs, K, V, tkv, tok, kvs, qpos, seq_len, scale, out, tout, os, 0);
}

/* attend32 in the "bf16" realisation: q.k of BF16 operands in the pair lanes; p.v (p fp32) as attend32. */
int attend32p(const int64_t *dims, const char *Q, int tq, const int64_t *qs, const char *K, const char *V,
              int tkv, const int64_t *tok, const int64_t *kvs, const int64_t *qpos, const int64_t *seq_len,
              float scale, char *out, int tout, const int64_t *os) {
    return attend_lanes(dims, Q, tq, qs, K, V, tkv, tok, kvs, qpos, seq_len, scale, out, tout, os, 1);
}

/* SiLU*mul of R rows of C (dt = F32 or BF16; gate, up and out rows at strides sg, su, C elements
 * contiguous): g = gate (fp32), e = exp32(-g) by exp32_rows (the attention's fp64 polynomial, rounded
 * to fp32), out = dt(g / (1 + e) * up), each step one IEEE fp32 operation (contract CPU_ACCUMULATION
 * "silu_mul"). reference/pointwise.py's torch steps spell the same with torch.exp in fp64. */
static inline __attribute__((always_inline)) void silu_rows_dt(int64_t R, int64_t C, const int dt, const char *gate,
                                                               int64_t sg, const char *up, int64_t su, char *out, float *g) {
    const int64_t e = ELEM[dt];
    float *ex = g + C;
    for (int64_t r = 0; r < R; r++) {
        const char *gr = gate + r * sg * e, *ur = up + r * su * e;
        for (int64_t i = 0; i < C; i++) { g[i] = load_act(gr, dt, i); ex[i] = -g[i]; }
        exp32_rows(ex, ex, C);
        for (int64_t i = 0; i < C; i++) store_act(out + r * C * e, dt, i, g[i] / (1.0f + ex[i]) * load_act(ur, dt, i));
    }
}

/* silu_rows_dt inlined once per dtype: no dtype branch in the loops, so they vectorise. */
int silu_mul32(int64_t R, int64_t C, int dt, const char *gate, int64_t sg, const char *up, int64_t su, char *out) {
    float *g = scratch_bytes((size_t)(2 * C) * sizeof(float));
    if (!g) return -1;
    if (dt == BF16) silu_rows_dt(R, C, BF16, gate, sg, up, su, out, g);
    else silu_rows_dt(R, C, F32, gate, sg, up, su, out, g);
    return 0;
}

/* dst = dt(src) for n values (a linear's .to(dt)), inlined per dtype so that the loop vectorises. */
static inline __attribute__((always_inline)) void round_rows_dt(const float *src, const int dt, int64_t n, char *dst) {
    for (int64_t j = 0; j < n; j++) store_act(dst, dt, j, src[j]);
}

static void round_rows(const float *src, int dt, int64_t n, char *dst) {
    if (dt == BF16) round_rows_dt(src, BF16, n, dst);
    else round_rows_dt(src, F32, n, dst);
}

/* acc [tr, n] = contract_dot(x row, w row) in fp32, a linear's dots (dot32p for BF16 pairs, else dot32,
 * as native.matmul picks them), for tr rows of x (row stride sx, K contiguous) against n rows of w
 * (strides sn, sk); solo as dot_pairs. Returns 0, or -1 when out of memory. */
static int dot_rows(int pairs, int solo, int64_t tr, int64_t n, int64_t K, int dt, const char *x, int64_t sx,
                    const char *w, int64_t sn, int64_t sk, float *acc) {
    const int64_t shape[6] = {1, 1, 1, tr, n, K}, sa[5] = {0, 0, 0, sx, 1}, sb[5] = {0, 0, 0, sn, sk};
    if (pairs && dt == BF16) return dot_pairs(solo, shape, x, sa, w, sb, NULL, acc);
    return dot_lanes(solo, shape, x, dt, sa, w, dt, sb, NULL, acc);
}

/* dst = dt(dot_rows(...)) [tr, n] through acc: a linear's bits. Returns 0, or -1 when out of memory. */
static int linear_rows(int pairs, int solo, int64_t tr, int64_t n, int64_t K, int dt, const char *x, int64_t sx,
                       const char *w, int64_t sn, int64_t sk, float *acc, char *dst) {
    const int rc = dot_rows(pairs, solo, tr, n, K, dt, x, sx, w, sn, sk, acc);
    if (!rc) round_rows(acc, dt, tr * n, dst);
    return rc;
}

/* Rows per chunk of moe_experts32 and the fused calls at the end of this file: their buffers stay
 * small (a prefill's multi-MB allocations page-faulted on every call) and in L2; every output is
 * computed alone, so chunks change no bit. */
enum { FUSED_ROWS = 128 };

/* A fused call's work on rows t0 .. t0 + tr - 1 of its arguments a, with buf (tr times the call's bytes
 * a row) for its own buffers; solo: its dots on the calling thread alone. Returns 0, or -1. */
typedef int (*chunk_fn)(const void *a, int64_t t0, int64_t tr, int solo, char *buf);

/* The calling thread's share of whole chunks of rows rows (fused_chunks), with its scratch slot 2. */
static int own_chunks(int64_t T, int64_t rows, size_t row_bytes, chunk_fn fn, const void *a, int solo) {
    char *buf = scratch_slot(2, (size_t)rows * row_bytes);
    int64_t lo, hi;
    share(T, rows, &lo, &hi);
    int rc = buf ? 0 : -1;
    for (int64_t t0 = lo; t0 < hi && !rc; t0 += rows) rc = fn(a, t0, hi - t0 < rows ? hi - t0 : rows, solo, buf);
    return rc;
}

/* A fused call over T rows (work: its multiply-adds), in chunks of at most FUSED_ROWS rows, each chunk
 * fn's. With threads: one OpenMP region, each thread its share of whole chunks, each chunk's dots and
 * epilogue (SiLU, norms, RoPE) on that thread alone: the epilogue runs on every thread and one region
 * opens a call instead of one per dot. The chunks are as many as a multiple of the threads and of equal
 * rows (a multiple of 4: block_pairs' register rows) so that the threads get equal work: 4096 rows ->
 * 32 chunks of 128, 300 -> 4 of 76, a decode step's 32 -> 2 of 16 (at 2 threads; there, on the Zen 4,
 * 10-15% faster than one chunk whose dots split their columns, though each thread reads all weights).
 * Fewer rows than 4 a thread: one chunk, no region here (one, even of one thread, would make the dots'
 * regions nested: libgomp starts new threads for those each time), the dots split their columns.
 * Buffers: each thread's scratch slot 2, kept between calls. Returns 0, or -1 when out of memory. */
static int fused_chunks(int64_t T, double work, size_t row_bytes, chunk_fn fn, const void *a) {
    const int nt = threads_for(work);
    if (nt == 1 || T < 4 * nt) return own_chunks(T, T < FUSED_ROWS ? (T > 0 ? T : 1) : FUSED_ROWS, row_bytes, fn, a, 0);
    const int64_t chunks = (T + FUSED_ROWS * nt - 1) / (FUSED_ROWS * nt) * nt, rows = ((T + chunks - 1) / chunks + 3) / 4 * 4;
    int rc = 0;
#pragma omp parallel num_threads(nt) reduction(| : rc)
    rc = own_chunks(T, rows, row_bytes, fn, a, 1);
    return rc;
}

/* out[t] = dt(contrib[t, 0] + contrib[t, 1] + ... + contrib[t, k-1]), fp32 adds left to right (moe_combine),
 * inlined per dtype so that the loops vectorise. Returns 0, or -1 when out of memory. */
static inline __attribute__((always_inline)) int combine_slots_dt(int64_t T, int64_t k, int64_t H, const float *contrib,
                                                                  const int dt, char *out) {
    float *total = scratch_bytes((size_t)H * sizeof(float));
    if (!total) return -1;
    for (int64_t t = 0; t < T; t++) {
        const float *c = contrib + t * k * H;
        for (int64_t i = 0; i < H; i++) total[i] = c[i];
        for (int64_t j = 1; j < k; j++)
            for (int64_t i = 0; i < H; i++) total[i] = total[i] + c[j * H + i];
        round_rows_dt(total, dt, H, out + t * H * ELEM[dt]);
    }
    return 0;
}

/* One row of K dt values (contiguous; NULL: zeros) as a block kernel's operand row of kp: bf16 copied
 * (pairs), else widened to fp32; zero padded. Exact copies, so the dots see the values dot32p / dot32 see. */
static void operand_row(int pairs, int dt, const char *src, int64_t K, int64_t kp, void *dst) {
    const int64_t es = pairs ? 2 : 4;
    if (pairs) memcpy(dst, src, (size_t)K * 2);
    else widen32(src, dt, K, 1, dst);
    memset((char *)dst + K * es, 0, (size_t)((kp - K) * es));
}

/* An expert's n weight rows of K (element (j, k) at base + j*sn + k*sk) for moe_block: pairs, packed
 * into chain panels in buf (pack_panels: dot_pairs' B); fp32, the rows widened into buf (widen_b32:
 * dot32's B). Once per expert and call, not per chunk of its rows. */
static void expert_rows(int pairs, int dt, const char *base, int64_t sn, int64_t sk, int64_t n, int64_t K, int64_t kp,
                        void *buf) {
    if (pairs) pack_panels((const uint16_t *)base, sn, sk, n, K, (K + 1) / 2, buf);
    else widen_b32(base, dt, sn, sk, 0, n, K, kp, buf);
}

/* out [mr, nr] (contiguous) = the dots of mr operand rows a (row stride lda elements, zero padded
 * past K) with an expert's rows (expert_rows): the kernels dot32p / dot32 run on the same rows, so
 * their bits. */
static void moe_block(int pairs, const void *a, int64_t lda, int64_t mr, const void *w, int64_t nr, int64_t K,
                      int64_t kp, float *out, const uint16_t *raw, int64_t sn) {
    if (raw) chain_direct(a, lda, mr, raw, sn, K, nr, out, nr);   /* moe_experts32 checked that it runs */
    else if (pairs) chain_rows(a, lda, 1, 1, mr, K, w, (K + 1) / 2, nr, out, nr);
    else block32(a, mr, w, nr, kp, out, nr);
}

/* The MoE experts of reference/moe.py moe_expert_contributions without autograd, in one call:
 * for each local expert le (global id e0 + le) its (token, slot) pairs p (p = token * k + slot,
 * ascending), x rows gathered; gu = dt(contract_dot(x row, gate_up rows)) [2I]; h = silu_mul32(gu[:I],
 * gu[I:]); contrib[p] = contract_dot(h, down rows) [H] * wts[p] (fp32), owned[p] = 1; pairs routed
 * to no local expert: contrib 0, owned 0. Every dot is dot32p's (pairs, BF16) or dot32's, on the same
 * operand rows (the block kernels called directly: each expert's weights made ready once per call, in
 * chunks of FUSED_ROWS pairs), so each value has the bits of the batched torch path. Stack strides
 * {expert, n, k} in elements. combined (or NULL): also reference/moe.py moe_combine of contrib, [T, H]
 * in dt: total = contrib[t, 0], then total + contrib[t, j] for j = 1 .. k-1 in order (fp32 IEEE adds),
 * rounded once to dt: the same operations. Returns 0, or -1 when out of memory. */
int moe_experts32(int64_t T, int64_t k, int64_t H, int64_t I, int dt, const char *x, int64_t sx,
                  const int64_t *ids, const float *wts, int64_t e0, int64_t ne, const char *gu, const int64_t *sgu,
                  const char *dn, const int64_t *sdn, int pairs, float *contrib, uint8_t *owned, char *combined) {
    pairs = pairs && dt == BF16;                          /* dot32p runs other operands as dot32 */
    const int64_t e = ELEM[dt], TK = T * k, es = pairs ? 2 : 4, step = pairs ? PAIR_K : LANES;
    const int64_t kh = (H + step - 1) / step * step, ki = (I + step - 1) / step * step;
    int64_t *start = calloc((size_t)(ne + 1), sizeof(int64_t)), *list = malloc((size_t)(TK ? TK : 1) * sizeof(int64_t));
    int64_t most = 0;
    for (int64_t p = 0; p < TK; p++) {
        const int64_t le = ids[p] - e0;
        owned[p] = le >= 0 && le < ne;
        if (owned[p]) start[le + 1]++;
        else memset(contrib + p * H, 0, (size_t)H * sizeof(float));
    }
    for (int64_t le = 0; le < ne; le++) {
        most = start[le + 1] > most ? start[le + 1] : most;
        start[le + 1] += start[le];
    }
    int64_t *fill = malloc((size_t)(ne + 1) * sizeof(int64_t));
    int rc = !(start && list && fill) ? -1 : 0;
    if (!rc) {
        memcpy(fill, start, (size_t)(ne + 1) * sizeof(int64_t));
        for (int64_t p = 0; p < TK; p++)
            if (owned[p]) list[fill[ids[p] - e0]++] = p;              /* ascending p within each expert */
    }
    const int nt = threads_for((double)TK * 3 * I * H);
    const int64_t rows = most < FUSED_ROWS ? most : FUSED_ROWS;   /* an expert's pairs in chunks of rows */
    /* Per thread (its scratch slot 0, kept between calls): x and h operand rows, fp32 dots, gu and h in dt,
     * SiLU's row, the expert's weights (chain panels, or widened). Weight rows rounded up to 48: both
     * kernels' column groups (16-column pair panels, 3 fp32 columns); a panel's pairs take kh * 2 bytes
     * a column at most. */
    const int64_t wide = 2 * I > H ? 2 * I : H, ng = (2 * I + 47) / 48 * 48, nd = (H + 47) / 48 * 48;
    const size_t part[7] = {(size_t)(rows * kh * es), (size_t)(rows * ki * es), (size_t)(rows * wide) * 4,
                            (size_t)(rows * 2 * I * e), (size_t)(rows * I * e), (size_t)(2 * I) * 4,
                            (size_t)(ng * kh + nd * ki) * es};
    size_t total = 0;
    for (int i = 0; i < 7; i++) total += (part[i] + 63) / 64 * 64;
    if (!rc)
#pragma omp parallel num_threads(nt) if (nt > 1) reduction(| : rc)
    {   /* each thread the experts whose first pair falls in its share of the pairs */
    char *buf[7] = {scratch_bytes(total)};
    for (int i = 1; i < 7 && buf[0]; i++) buf[i] = buf[i - 1] + (part[i - 1] + 63) / 64 * 64;
    char *xa = buf[0], *ha = buf[1], *gd = buf[3], *h = buf[4];
    float *acc = (float *)buf[2], *g = (float *)buf[5];
    int64_t lo, hi;
    share(TK, 1, &lo, &hi);
    rc |= buf[0] ? 0 : -1;
    for (int64_t le = 0; le < ne && !rc; le++) {
        if (start[le + 1] == start[le] || start[le] < lo || start[le] >= hi) continue;
        /* an expert of few pairs reads its weights in place (chain_direct), else packs them once */
        const int raw = pairs && DIRECT_BUILT && start[le + 1] - start[le] <= DIRECT_ROWS && sgu[2] == 1 && sdn[2] == 1 &&
                        H % 32 == 0 && I % 32 == 0;
        const uint16_t *graw = raw ? (const uint16_t *)(gu + le * sgu[0] * e) : NULL;
        const uint16_t *draw = raw ? (const uint16_t *)(dn + le * sdn[0] * e) : NULL;
        if (!raw) {
            expert_rows(pairs, dt, gu + le * sgu[0] * e, sgu[1], sgu[2], 2 * I, H, kh, buf[6]);
            expert_rows(pairs, dt, dn + le * sdn[0] * e, sdn[1], sdn[2], H, I, ki, buf[6] + ng * kh * es);
        }
        const char *gw = buf[6], *dw = gw + ng * kh * es;
        for (int64_t i0 = start[le]; i0 < start[le + 1]; i0 += rows) {
            const int64_t n = start[le + 1] - i0 < rows ? start[le + 1] - i0 : rows, *pl = list + i0;
            for (int64_t i = 0; i < n; i++) operand_row(pairs, dt, x + (pl[i] / k) * sx * e, H, kh, xa + i * kh * es);
            moe_block(pairs, xa, kh, n, gw, 2 * I, H, kh, acc, graw, sgu[1]);
            round_rows(acc, dt, n * 2 * I, gd);                                               /* gu in dt */
            if (dt == BF16) silu_rows_dt(n, I, BF16, gd, 2 * I, gd + I * e, 2 * I, h, g);
            else silu_rows_dt(n, I, F32, gd, 2 * I, gd + I * e, 2 * I, h, g);
            const int direct = pairs && ki == I;                           /* h rows are the operand rows */
            for (int64_t i = 0; i < n && !direct; i++) operand_row(pairs, dt, h + i * I * e, I, ki, ha + i * ki * es);
            moe_block(pairs, direct ? h : ha, ki, n, dw, H, I, ki, acc, draw, sdn[1]);
            for (int64_t i = 0; i < n; i++)
                for (int64_t c = 0; c < H; c++) contrib[pl[i] * H + c] = acc[i * H + c] * wts[pl[i]];
        }
    }
    }
    free(start); free(list); free(fill);
    if (!rc && combined)
        rc = dt == BF16 ? combine_slots_dt(T, k, H, contrib, BF16, combined) : combine_slots_dt(T, k, H, contrib, F32, combined);
    return rc;
}

/* Neox rotate-half RoPE of x [T, Hh, D] (dt F32 or BF16, contiguous) with fp32 tables cos, sin [T, D/2]:
 * out[i] = dt(x1 * c - x2 * s), out[i + D/2] = dt(x2 * c + x1 * s), each product and sum one IEEE fp32
 * operation (no FMA: -ffp-contract=off), i.e. reference/pointwise.py apply_rope's torch steps. Any
 * realisation: these bits never depended on it. */
static inline __attribute__((always_inline)) void rope_rows_dt(int64_t T, int64_t Hh, int64_t D, const int dt,
                                                               const char *x, const float *cos, const float *sin, char *out) {
    const int64_t e = ELEM[dt], half = D / 2;
    for (int64_t t = 0; t < T; t++)
        for (int64_t h = 0; h < Hh; h++) {
            const char *xr = x + (t * Hh + h) * D * e;
            char *o = out + (t * Hh + h) * D * e;
            const float *c = cos + t * half, *s = sin + t * half;
            for (int64_t i = 0; i < half; i++) {
                const float x1 = load_act(xr, dt, i), x2 = load_act(xr, dt, i + half);
                store_act(o, dt, i, x1 * c[i] - x2 * s[i]);
                store_act(o, dt, i + half, x2 * c[i] + x1 * s[i]);
            }
        }
}

/* rope_rows_dt inlined once per dtype: no dtype branch in the loop, so it vectorises. */
void rope_rows(int64_t T, int64_t Hh, int64_t D, int dt, const char *x, const float *cos, const float *sin, char *out) {
    if (dt == BF16) rope_rows_dt(T, Hh, D, BF16, x, cos, sin, out);
    else rope_rows_dt(T, Hh, D, F32, x, cos, sin, out);
}

/* The K/V offsets of a paged cache for attend32/attend64 (any realisation): token[s, pos] =
 * table[s, page] * sp + (pos % ps) * st, page = min(pos / ps, (seq_len[s] - 1) / ps) (columns past a
 * sequence's last page repeat it), pos < L; reference/attention.py _PagedKV's torch steps in one
 * call. Returns 0, or -1 when a page falls outside the table's W columns. */
int paged_tokens(int64_t S, int64_t W, const int64_t *table, const int64_t *seq_len, int64_t L, int64_t ps,
                 int64_t sp, int64_t st, int64_t *token) {
    for (int64_t s = 0; s < S; s++) {
        const int64_t last = seq_len[s] > 0 ? (seq_len[s] - 1) / ps : 0;
        for (int64_t p0 = 0, j = 0; p0 < L; p0 += ps, j++) {   /* page by page: no division per position */
            const int64_t page = j < last ? j : last;
            if (page >= W) return -1;
            const int64_t base = table[s * W + page] * sp;
            for (int64_t i = 0; i < ps && p0 + i < L; i++) token[s * L + p0 + i] = base + i * st;
        }
    }
    return 0;
}

/* reference/attention.py write_kv_cache for caches of the new rows' dtype (a copy, exact): rows t
 * of key/value [T, Hkv, D] (strides ks/vs in elements) to cache slot slots[t] (page slot / ps,
 * position slot % ps; cache strides cs {page, position, head, dim}, both caches alike); slot < 0 is
 * padding. Returns 0, or -1 when a slot falls past the cache's pages. */
int write_kv(int64_t T, int64_t Hkv, int64_t D, int64_t esize, const char *key, const int64_t *ks, const char *value,
             const int64_t *vs, char *kc, char *vc, const int64_t *cs, const int64_t *slots, int64_t pages, int64_t ps) {
    for (int64_t t = 0; t < T; t++) {
        if (slots[t] < 0) continue;
        const int64_t page = slots[t] / ps, pos = slots[t] % ps;
        if (page >= pages) return -1;
        for (int64_t h = 0; h < Hkv; h++) {
            char *kd = kc + (page * cs[0] + pos * cs[1] + h * cs[2]) * esize, *vd = vc + (page * cs[0] + pos * cs[1] + h * cs[2]) * esize;
            const char *kr = key + (t * ks[0] + h * ks[1]) * esize, *vr = value + (t * vs[0] + h * vs[1]) * esize;
            if (cs[3] == 1 && ks[2] == 1 && vs[2] == 1) {
                memcpy(kd, kr, (size_t)(D * esize));
                memcpy(vd, vr, (size_t)(D * esize));
            } else
                for (int64_t d = 0; d < D; d++) {
                    memcpy(kd + d * cs[3] * esize, kr + d * ks[2] * esize, (size_t)esize);
                    memcpy(vd + d * cs[3] * esize, vr + d * vs[2] * esize, (size_t)esize);
                }
        }
    }
    return 0;
}

/* The attention prologue of models/qwen3.py Attention.qkv in one call (CPU inference, fp32/bf16
 * realisations): for x [T, H] (rows contiguous, row stride sx) and weights w [n*D, H] (row stride
 * sw each), q = rope(rms_norm(dt(contract_dot(x, wq rows)) per head of D, nq)), k likewise with wk,
 * nk, and v = dt(contract_dot(x, wv rows)): the calls the ops make one by one (dot32p / dot32 as
 * native.matmul picks them, rms_norm_rows32, rope_rows), so the same bits. Outputs contiguous
 * q [T, hq, D], k, v [T, hkv, D]. Returns 0, or -1 when out of memory. */
struct prologue { int64_t H, D, heads[3]; int dt, pairs; const char *x; int64_t sx; const char *w[3]; int64_t sw;
                  const char *nw[3]; float eps; const float *cos, *sin; char *out[3]; };

static int prologue_chunk(const void *p, int64_t t0, int64_t tr, int solo, char *buf) {
    const struct prologue *a = p;
    const int64_t e = ELEM[a->dt], wide = (a->heads[0] > a->heads[1] ? a->heads[0] : a->heads[1]) * a->D, half = a->D / 2;
    float *acc = (float *)buf;
    char *rounded = (char *)(acc + tr * wide), *normed = rounded + tr * wide * e;
    for (int i = 0; i < 3; i++) {                                                      /* q, k, v */
        const int64_t n = a->heads[i] * a->D;
        char *o = a->out[i] + t0 * n * e;
        const int rc = linear_rows(a->pairs, solo, tr, n, a->H, a->dt, a->x + t0 * a->sx * e, a->sx, a->w[i], a->sw, 1, acc,
                                   a->nw[i] ? rounded : o);
        if (rc) return rc;
        if (!a->nw[i]) continue;                                                       /* v: the linear alone */
        norm_rows32(tr * a->heads[i], a->D, a->dt, rounded, a->D, NULL, 0, a->nw[i], a->eps, normed, NULL);
        rope_rows(tr, a->heads[i], a->D, a->dt, normed, a->cos + t0 * half, a->sin + t0 * half, o);
    }
    return 0;
}

int attn_prologue32(int64_t T, int64_t H, int64_t D, int64_t hq, int64_t hkv, int dt, const char *x, int64_t sx,
                    const char *wq, const char *wk, const char *wv, int64_t sw, const char *nq, const char *nk,
                    float eps, const float *cos, const float *sin, int pairs, char *q, char *k, char *v) {
    const struct prologue a = {H, D, {hq, hkv, hkv}, dt, pairs, x, sx, {wq, wk, wv}, sw, {nq, nk, NULL}, eps, cos, sin,
                               {q, k, v}};
    const int64_t wide = (hq > hkv ? hq : hkv) * D;                 /* acc, then the rounded and the normed rows */
    return fused_chunks(T, (double)T * (hq + 2 * hkv) * D * H, (size_t)(wide * 4 + 2 * wide * ELEM[dt]), prologue_chunk, &a);
}

/* reference/moe.py moe_route after its linear (CPU, the fp32/bf16 realisations, trainer and rollout),
 * per token t of logits [T, E] fp32 (row stride sl): m = max_e l_e (NaN if one is NaN, as torch.amax),
 * p_e = exp(l_e - m) by the attention's polynomial (exp32_one), s = fp32(fp64 sum of p_e, e ascending),
 * prob_e = p_e / s; the top_k experts by descending prob, NaN first, ties to the lower id (a stable
 * descending sort), their probs, renormalised when norm by fp32(fp64 sum of them, slot order). ids
 * int64 [T, top_k], w fp32 [T, top_k]; top_k <= E. Every token alone, in order: any batch, same bits. */
int moe_route32(int64_t T, int64_t E, const float *logits, int64_t sl, int64_t top_k, int norm, int64_t *ids,
                float *w) {
    float *prob = scratch_bytes((size_t)E * sizeof(float));
    if (!prob) return -1;
    for (int64_t t = 0; t < T; t++) {
        const float *l = logits + t * sl;
        float m = l[0];
        for (int64_t e = 0; e < E; e++) m = l[e] != l[e] || m != m ? NAN : l[e] > m ? l[e] : m;
        double s = 0.0;
        for (int64_t e = 0; e < E; e++) {
            prob[e] = exp32_one(l[e] - m);
            s += (double)prob[e];
        }
        for (int64_t e = 0; e < E; e++) prob[e] = prob[e] / (float)s;
        int64_t *id = ids + t * top_k;
        float *wt = w + t * top_k;
        double sw = 0.0;
        for (int64_t j = 0; j < top_k; j++) {   /* the j-th of a stable descending sort: NaN above all */
            int64_t best = -1;
            for (int64_t e = 0; e < E; e++) {
                int taken = 0;
                for (int64_t i = 0; i < j; i++) taken |= id[i] == e;
                if (taken) continue;
                const float a = prob[e], b = best < 0 ? 0.0f : prob[best];
                if (best < 0 || (a != a && b == b) || a > b) best = e;
            }
            id[j] = best;
            wt[j] = prob[best];
            sw += (double)wt[j];
        }
        if (norm)
            for (int64_t j = 0; j < top_k; j++) wt[j] = wt[j] / (float)sw;
    }
    return 0;
}

/* The router in one call (CPU inference): logits = contract_dot(x row, w rows) in fp32 (dot32p for BF16
 * pairs, else dot32: the linear's bits), then moe_route32; x [T, K] (row stride sx) and w [E, K] (row
 * stride sw) of one dtype, K contiguous. Returns 0, or -1 when out of memory. */
struct router { int64_t E, K; int dt, pairs; const char *x; int64_t sx; const char *w; int64_t sw, top_k; int norm;
                int64_t *ids; float *weights; };

static int router_chunk(const void *p, int64_t t0, int64_t tr, int solo, char *buf) {
    const struct router *a = p;
    float *logits = (float *)buf;
    const int rc = dot_rows(a->pairs, solo, tr, a->E, a->K, a->dt, a->x + t0 * a->sx * ELEM[a->dt], a->sx, a->w, a->sw, 1,
                            logits);
    return rc ? rc : moe_route32(tr, a->E, logits, a->E, a->top_k, a->norm, a->ids + t0 * a->top_k, a->weights + t0 * a->top_k);
}

int moe_router32(int64_t T, int64_t E, int64_t K, int dt, const char *x, int64_t sx, const char *w, int64_t sw,
                 int pairs, int64_t top_k, int norm, int64_t *ids, float *weights) {
    const struct router a = {E, K, dt, pairs, x, sx, w, sw, top_k, norm, ids, weights};
    return fused_chunks(T, (double)T * E * K, (size_t)E * sizeof(float), router_chunk, &a);
}

/* A linear layer rounded to dt, then reference/norm.py add_rms_norm of it and the residual, in one
 * call (CPU inference, fp32/bf16 realisations): y = dt(contract_dot(x row, w rows)) [T, N] (x row
 * stride sx, w [N, K] row stride sw), then rms_norm_rows32(y, res, nw): out = RMSNorm(y + res),
 * res_out = y + res (in dt). The calls linear and add_rms_norm make one by one, so the same bits.
 * Returns 0, or -1 when out of memory. */
struct linear_norm { int64_t K, N; int dt, pairs; const char *x; int64_t sx; const char *w; int64_t sw; const char *res;
                     int64_t sres; const char *nw; float eps; char *out, *res_out; };

static int linear_norm_chunk(const void *p, int64_t t0, int64_t tr, int solo, char *buf) {
    const struct linear_norm *a = p;
    const int64_t e = ELEM[a->dt];
    float *acc = (float *)buf;
    char *y = (char *)(acc + tr * a->N);
    const int rc = linear_rows(a->pairs, solo, tr, a->N, a->K, a->dt, a->x + t0 * a->sx * e, a->sx, a->w, a->sw, 1, acc, y);
    if (!rc)
        norm_rows32(tr, a->N, a->dt, y, a->N, a->res + t0 * a->sres * e, a->sres, a->nw, a->eps, a->out + t0 * a->N * e,
                        a->res_out + t0 * a->N * e);
    return rc;
}

int linear_add_norm32(int64_t T, int64_t K, int64_t N, int dt, const char *x, int64_t sx, const char *w, int64_t sw,
                      const char *res, int64_t sres, const char *nw, float eps, int pairs, char *out, char *res_out) {
    const struct linear_norm a = {K, N, dt, pairs, x, sx, w, sw, res, sres, nw, eps, out, res_out};
    return fused_chunks(T, (double)T * K * N, (size_t)(N * 4 + N * ELEM[dt]), linear_norm_chunk, &a);
}

/* models/qwen3.py MLP in one call (CPU inference, fp32/bf16 realisations): for x [T, H] (row
 * stride sx) and contiguous weights wg, wu [I, H], wd [H, I]: g = dt(contract_dot(x, wg rows)),
 * u likewise with wu, h = silu_mul32(g, u), out = dt(contract_dot(h, wd rows)) [T, H] contiguous:
 * the calls linear and silu_mul make one by one, so the same bits. Returns 0, or -1 when out of memory. */
struct mlp { int64_t H, I; int dt, pairs; const char *x; int64_t sx; const char *wg, *wu, *wd; char *out; };

static int mlp_chunk(const void *p, int64_t t0, int64_t tr, int solo, char *buf) {
    const struct mlp *a = p;
    const int64_t e = ELEM[a->dt], H = a->H, I = a->I;
    float *acc = (float *)buf;
    char *gu = (char *)(acc + tr * (I > H ? I : H)), *h = gu + 2 * tr * I * e;
    const char *x = a->x + t0 * a->sx * e;
    int rc = linear_rows(a->pairs, solo, tr, I, H, a->dt, x, a->sx, a->wg, H, 1, acc, gu);          /* gate */
    if (!rc) rc = linear_rows(a->pairs, solo, tr, I, H, a->dt, x, a->sx, a->wu, H, 1, acc, gu + tr * I * e);   /* up */
    if (!rc) rc = silu_mul32(tr, I, a->dt, gu, I, gu + tr * I * e, I, h);
    if (!rc) rc = linear_rows(a->pairs, solo, tr, H, I, a->dt, h, I, a->wd, I, 1, acc, a->out + t0 * H * e);
    return rc;
}

int mlp32(int64_t T, int64_t H, int64_t I, int dt, const char *x, int64_t sx, const char *wg, const char *wu,
          const char *wd, int pairs, char *out) {
    const struct mlp a = {H, I, dt, pairs, x, sx, wg, wu, wd, out};
    return fused_chunks(T, (double)T * 3 * H * I, (size_t)((I > H ? I : H) * 4 + 3 * I * ELEM[dt]), mlp_chunk, &a);
}

/* models/qwen3.py DecoderLayer.forward for a step of one new token per sequence against a paged cache
 * (CPU inference, fp32/bf16 realisations: the rollout's decode steps), in one call instead of a Python
 * call per op: x (+ res) -> RMSNorm (rms_norm_rows32; no res: the residual is x), the attention prologue
 * (attn_prologue32), the K/V write (write_kv), the attention of token s as sequence s (attend_lanes over
 * tok/qpos/seq_len, as native.attend; its rows rounded to dt, as attention_paged returns them),
 * o_proj + residual add + RMSNorm (linear_add_norm32), then the dense MLP (mlp32: wg, wu, wd) or, when
 * E > 0, the MoE block (moe_router32 with router wg, moe_experts32 over the stacks gu/dn, combined): the
 * calls the ops make one by one, so the same bits. Every field 8 bytes (native.py packs them in this
 * order). out [T, H] is the MLP's output, res_out [T, H] the residual after attention. Intermediates in
 * the calling thread's scratch slot 3. Returns 0, -1 when out of memory, -2 when a slot falls past the
 * cache's pages. */
struct decode_layer {
    int64_t T, H, D, hq, hkv, I, E, top_k, moe_norm, dt, pairs;
    const char *x, *res, *in_norm, *wq, *wk, *wv;
    int64_t sw;
    const char *qn, *kn;
    const float *cos, *sin;
    char *kc, *vc;
    int64_t cs[4];                                  /* the caches' strides {page, position, head, dim} */
    const int64_t *slots;
    int64_t pages, ps;
    const int64_t *tok;
    int64_t L;
    const int64_t *qpos, *seq_len;
    int64_t kv_block, chunk;
    const char *wo, *post_norm, *wg, *wu, *wd;     /* MoE: wg the router [E, H], wu / wd the stacks */
    int64_t sgu[3], sdn[3];                         /* MoE: the stacks' strides {expert, n, k} */
    char *out, *res_out;
};

int decode_layer32(const struct decode_layer *a, float eps_in, float eps_qk, float eps_post, float scale) {
    const int64_t T = a->T, H = a->H, D = a->D, e = ELEM[a->dt], hd = a->hq * D, kd = a->hkv * D, k = a->top_k;
    const int dt = (int)a->dt, pairs = (int)a->pairs;
    const size_t acts = (size_t)(T * (2 * H + hd + 2 * kd + hd + H) * e), moe = a->E ? (size_t)(T * k * (8 + 4 + 4 * H + 1)) : 0;
    char *h = scratch_slot(3, acts + moe + 64);
    if (!h) return -1;
    char *res1 = h + T * H * e, *q = res1 + T * H * e, *kk = q + T * hd * e, *v = kk + T * kd * e, *heads = v + T * kd * e;
    char *h2 = heads + T * hd * e;
    int64_t *ids = (int64_t *)(((uintptr_t)(h2 + T * H * e) + 63) & ~(uintptr_t)63);   /* MoE: routing, contributions */
    if (a->res) rms_norm_rows32(T, H, dt, a->x, H, a->res, H, a->in_norm, eps_in, h, res1);
    else rms_norm_rows32(T, H, dt, a->x, H, NULL, 0, a->in_norm, eps_in, h, NULL);
    const char *res = a->res ? res1 : a->x;
    int rc = attn_prologue32(T, H, D, a->hq, a->hkv, dt, h, H, a->wq, a->wk, a->wv, a->sw, a->qn, a->kn, eps_qk, a->cos,
                             a->sin, pairs, q, kk, v);
    if (rc) return rc;
    const int64_t ks[3] = {kd, D, 1};
    if (write_kv(T, a->hkv, D, e, kk, ks, v, ks, a->kc, a->vc, a->cs, a->slots, a->pages, a->ps)) return -2;
    const int64_t G = a->hq / a->hkv;
    const int64_t dims[8] = {T, a->hkv, G, D, a->L, a->kv_block, a->chunk, 1}, qs[4] = {hd, G * D, D, 0};
    const int64_t kvs[2] = {a->cs[2], a->cs[3]};
    rc = attend_lanes(dims, q, dt, qs, a->kc, a->vc, dt, a->tok, kvs, a->qpos, a->seq_len, scale, heads, dt, qs, pairs);
    if (rc) return rc;
    rc = linear_add_norm32(T, hd, H, dt, heads, hd, a->wo, hd, res, H, a->post_norm, eps_post, pairs, h2, a->res_out);
    if (rc) return rc;
    if (!a->E) return mlp32(T, H, a->I, dt, h2, H, a->wg, a->wu, a->wd, pairs, a->out);
    float *w = (float *)(ids + T * k), *contrib = w + T * k;
    uint8_t *owned = (uint8_t *)(contrib + T * k * H);
    rc = moe_router32(T, a->E, H, dt, h2, H, a->wg, H, pairs, k, (int)a->moe_norm, ids, w);
    if (rc) return rc;
    return moe_experts32(T, k, H, a->I, dt, h2, H, ids, w, 0, a->E, a->wu, a->sgu, a->wd, a->sdn, pairs, contrib, owned,
                         a->out);
}

/* reference/logprobs.py log_softmax on CPU in the fp32/bf16 realisations (contract CPU_ACCUMULATION
 * "logprobs"), per row r of logits [R, V] fp32 (row stride sl), each row alone: z = l / t[r * ts] (IEEE
 * fp32 division; ts = 0: one temperature for every row), columns >= limit -inf; m = max z (NaN if one is,
 * as torch.amax); zs = z - m (fp32); e = exp32(zs) by exp32_rows (the attention's polynomial, rounded to
 * fp32); s = the fp64 sum of e in 8 lanes (lane j: columns j, j + 8, ... ascending, from +0) reduced as
 * ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7)); lse = fp32(log(s)) (libm log, fp64); out = zs - lse
 * (fp32). Rows split over the threads. Returns 0, or -1 when out of memory. */
int log_softmax32(int64_t R, int64_t V, const float *logits, int64_t sl, const float *t, int64_t ts, int64_t limit,
                  float *out) {
    const int nt = threads_for((double)R * V * 16);
    int fail = 0;
#pragma omp parallel num_threads(nt) if (nt > 1) reduction(| : fail)
    {
        float *e = scratch_bytes((size_t)(V > 0 ? V : 1) * sizeof(float));
        int64_t lo, hi;
        share(R, 1, &lo, &hi);
        fail = !e;
        if (!e) hi = lo;
        for (int64_t r = lo; r < hi; r++) {
            const float *l = logits + r * sl, temp = t[r * ts];
            float *o = out + r * V, m = -INFINITY;
            int nan = 0;
            for (int64_t i = 0; i < V; i++) {
                o[i] = i < limit ? l[i] / temp : -INFINITY;
                nan |= o[i] != o[i];
                m = o[i] > m ? o[i] : m;
            }
            if (nan) m = NAN;
            for (int64_t i = 0; i < V; i++) o[i] = o[i] - m;
            exp32_rows(o, e, V);
            double lane[8] = {0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0};
            for (int64_t i = 0; i < V; i++) lane[i % 8] += (double)e[i];
            const float lse = (float)log(((lane[0] + lane[4]) + (lane[2] + lane[6])) + ((lane[1] + lane[5]) + (lane[3] + lane[7])));
            for (int64_t i = 0; i < V; i++) o[i] = o[i] - lse;
        }
    }
    return fail ? -1 : 0;
}
