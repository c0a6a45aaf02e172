/* amx_probe: which order and rounding does TDPBF16PS (Intel AMX-BF16) really use? (issue 30)
 *
 * An AMX realisation of the contract needs TDPBF16PS's order written down and checked bit for bit,
 * as the "bf16" realisation's VDPBF16PS was (dot32.c pair16). This runs TDPBF16PS on seeded random
 * and adversarial tiles and compares every output bitwise with scalar C emulations (the candidates
 * below). Built and run by scripts/amx_probe.sh; tests/test_amx_probe.py runs --self-test here.
 *
 * One instruction: C (16 x 16 fp32) += A (16 x 32 bf16) . B (32 x 16 bf16), B VNNI-packed (tile row
 * k holds the pairs (b[2k][n], b[2k+1][n]) for n = 0..15). K of 32, 64, 96 or 128: 1-4 instructions
 * into one C tile kept in the tile register (C is fp32 between instructions, so each candidate is
 * applied per instruction). For output (m, n) and instruction s, p_k = a[m][k] * b[k][n] (exact:
 * 8-bit significands; the emulations take it in double or inside fmaf), pairs (p_2k, p_2k+1).
 *
 * Candidates ("flush" = bf16 denormal inputs and the starting C read as zero (DAZ), each rounded
 * result below 2^-126 flushed to a zero of its sign (FTZ); every rounding is RNE):
 *   a  SDM order: k ascending, acc = fma(p_2k), then fma(p_2k+1), one rounding each, flush
 *   b  pair element 1 then 0 (VDPBF16PS's order, dot32.c pair16), flush
 *   c  each pair's two products added exactly, then to acc with one rounding, flush
 *   d  a without DAZ/FTZ (gradual underflow everywhere)
 *   e  C + all 32 products of the instruction summed exactly, one rounding, flush
 *   f  the newer SDM text's temp1 (2 partial sums per output): E = sum of p_2k, O = sum of p_2k+1,
 *      each from +0 by fma in k order; then C + round(E + O), flush
 *   g  the 32 products summed exactly and rounded once, then added to C (a second rounding), flush
 *   h  each pair's sum rounded to fp32, then added to acc (two roundings a pair), flush
 *   i  a, but a denormal starting C is kept (DAZ on bf16 inputs only; FTZ on every result)
 *
 * Exit: 0 exactly one candidate matched every output; 1 none or several; 2 usage / setup error;
 * 3 no AMX-BF16 here (one line). --self-test (no AMX needed): the candidates differ pairwise on
 * these inputs and the exact-sum helper agrees with fmaf; exit 0 if so, else 1.
 * --dump FILE: each run as written (Case, then the 16 x 16 fp32 result), for offline study.
 * --emulate X: candidate X stands in for TDPBF16PS (no AMX needed): tests the comparison and the
 * exit status here (it must name X alone).
 * Build: -O2 -ffp-contract=off (every multiply and add a separate IEEE op), no FMA/AVX-512 needed.
 */
#define _GNU_SOURCE
#include <cpuid.h>
#include <errno.h>
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

enum { M = 16, N = 16, KT = 32, PAIRS = 16, MAXSTEPS = 4, NCAND = 9, NKIND = 6 };

typedef struct {
    int32_t steps, kind;
    uint16_t a[MAXSTEPS][M][KT];         /* A tile of instruction s: row m = a[m][0..31] */
    uint16_t b[MAXSTEPS][PAIRS][2 * N];  /* B tile s, VNNI: row k = b[2k][n], b[2k+1][n] for n */
    float c[M][N];                        /* C before the first instruction */
} Case;

static const char *KIND[NKIND] = {"plain", "cancel", "mixed", "bf16-denormal", "near-denormal", "ties"};

/* ---- bf16 / fp32 helpers ---- */
static float bf(uint16_t h) { uint32_t u = (uint32_t)h << 16; float f; memcpy(&f, &u, 4); return f; }
static float daz_bf(uint16_t h) { return (h & 0x7F80) ? bf(h) : copysignf(0.0f, bf(h)); }
static float ftz(float x) { return fabsf(x) < 0x1p-126f ? copysignf(0.0f, x) : x; }
static uint32_t bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }

/* ---- exact sums: a 640-bit fixed-point integer, bit i weighing 2^(i - OFF) ----
 * Every term here is a bf16 product (16 significant bits, 2^-266 .. 2^256) or an fp32 value,
 * so each is one int64 mantissa at one position; the sum is exact, then rounded once. */
enum { LIMBS = 20, OFF = 300 };
typedef struct { int64_t l[LIMBS]; int negzero; } Exact;   /* 32 bits a limb, carries kept */

static void ex_init(Exact *e) { memset(e, 0, sizeof *e); e->negzero = 1; }
static void ex_add(Exact *e, double x) {
    if (x == 0) { if (!signbit(x)) e->negzero = 0; return; }   /* sum of -0s only is -0 */
    e->negzero = 0;
    int ex;
    const double f = frexp(x, &ex);
    const int64_t m = (int64_t)ldexp(f, 25);
    const int pos = ex - 25 + OFF;
    if (ldexp((double)m, ex - 25) != x || pos < 0 || pos / 32 + 1 >= LIMBS - 1) { fprintf(stderr, "ex_add: %a\n", x); exit(2); }
    const int64_t v = m * ((int64_t)1 << (pos & 31));          /* |v| < 2^57 */
    e->l[pos / 32] += v & 0xffffffff;
    e->l[pos / 32 + 1] += v >> 32;                              /* arithmetic: floor */
}
static int ex_bit(const int64_t *l, int i) { return (int)((l[i / 32] >> (i % 32)) & 1); }
static float ex_round(const Exact *e, int flush) {
    int64_t l[LIMBS];
    memcpy(l, e->l, sizeof l);
    for (int i = 0; i < LIMBS - 1; i++) { l[i + 1] += l[i] >> 32; l[i] &= 0xffffffff; }
    const int neg = l[LIMBS - 1] < 0;
    if (neg) {                                                   /* magnitude: negate, renormalise */
        for (int i = 0; i < LIMBS; i++) l[i] = -l[i];
        for (int i = 0; i < LIMBS - 1; i++) { l[i + 1] += l[i] >> 32; l[i] &= 0xffffffff; }
    }
    int top = -1;
    for (int i = LIMBS - 1; i >= 0 && top < 0; i--)
        if (l[i]) top = i * 32 + 63 - __builtin_clzll((uint64_t)l[i]);
    if (top < 0) return e->negzero ? -0.0f : 0.0f;
    int lsb = top - 23;
    if (lsb < OFF - 149) lsb = OFF - 149;                        /* fp32 denormal spacing */
    uint64_t mant = 0;
    for (int i = top; i >= lsb; i--) mant = mant << 1 | (uint64_t)ex_bit(l, i);
    const int rnd = lsb > 0 && ex_bit(l, lsb - 1);
    int sticky = 0;
    for (int i = 0; i < (lsb - 1) / 32 && !sticky; i++) sticky = l[i] != 0;
    for (int i = (lsb - 1) / 32 * 32; i < lsb - 1 && !sticky; i++) sticky = ex_bit(l, i);
    if (rnd && (sticky || (mant & 1))) mant++;
    float r = (float)ldexp((double)mant, lsb - OFF);            /* exact, or overflow to inf */
    if (neg) r = -r;
    return flush ? ftz(r) : r;
}
static float ex_sum3(double x, double y, double z, int flush) {
    Exact e;
    ex_init(&e); ex_add(&e, x); ex_add(&e, y); ex_add(&e, z);
    return ex_round(&e, flush);
}

/* ---- the candidates: one instruction for output (m, n): acc in, acc out ---- */
#define AV(k) (fl ? daz_bf(a[k]) : bf(a[k]))
#define BV(k) (fl ? daz_bf(b[(k) / 2][2 * n + (k) % 2]) : bf(b[(k) / 2][2 * n + (k) % 2]))
#define P(k) ((double)AV(k) * (double)BV(k))   /* exact in double */
#define FL(x) (fl ? ftz(x) : (x))
typedef float (*Step)(float acc, const uint16_t *a, const uint16_t (*b)[2 * N], int n);

static float sdm_order(float acc, const uint16_t *a, const uint16_t (*b)[2 * N], int n, int fl, int odd_first) {
    if (fl != 2) acc = FL(acc);                                  /* fl 2: flush, but not C on entry */
    for (int k = 0; k < KT; k += 2) {
        const int f = k + odd_first, s = k + !odd_first;
        acc = FL(fmaf(AV(f), BV(f), acc));
        acc = FL(fmaf(AV(s), BV(s), acc));
    }
    return acc;
}
static float cand_a(float acc, const uint16_t *a, const uint16_t (*b)[2 * N], int n) { return sdm_order(acc, a, b, n, 1, 0); }
static float cand_b(float acc, const uint16_t *a, const uint16_t (*b)[2 * N], int n) { return sdm_order(acc, a, b, n, 1, 1); }
static float cand_i(float acc, const uint16_t *a, const uint16_t (*b)[2 * N], int n) { return sdm_order(acc, a, b, n, 2, 0); }
static float cand_d(float acc, const uint16_t *a, const uint16_t (*b)[2 * N], int n) { return sdm_order(acc, a, b, n, 0, 0); }
static float cand_c(float acc, const uint16_t *a, const uint16_t (*b)[2 * N], int n) {
    const int fl = 1;
    acc = ftz(acc);
    for (int k = 0; k < KT; k += 2) acc = ex_sum3(acc, P(k), P(k + 1), 1);
    return acc;
}
static float cand_e(float acc, const uint16_t *a, const uint16_t (*b)[2 * N], int n) {
    const int fl = 1;
    Exact e;
    ex_init(&e);
    ex_add(&e, ftz(acc));
    for (int k = 0; k < KT; k++) ex_add(&e, P(k));
    return ex_round(&e, 1);
}
static float cand_f(float acc, const uint16_t *a, const uint16_t (*b)[2 * N], int n) {
    const int fl = 1;
    float ev = 0.0f, od = 0.0f;
    for (int k = 0; k < KT; k += 2) {
        ev = ftz(fmaf(AV(k), BV(k), ev));
        od = ftz(fmaf(AV(k + 1), BV(k + 1), od));
    }
    return ftz(ftz(acc) + ftz(ev + od));
}
static float cand_g(float acc, const uint16_t *a, const uint16_t (*b)[2 * N], int n) {
    const int fl = 1;
    Exact e;
    ex_init(&e);
    for (int k = 0; k < KT; k++) ex_add(&e, P(k));
    return ftz(ftz(acc) + ex_round(&e, 1));
}
static float cand_h(float acc, const uint16_t *a, const uint16_t (*b)[2 * N], int n) {
    const int fl = 1;
    acc = ftz(acc);
    for (int k = 0; k < KT; k += 2) acc = ftz(acc + ex_sum3(P(k), P(k + 1), 0.0, 1));
    return acc;
}

static const Step CAND[NCAND] = {cand_a, cand_b, cand_c, cand_d, cand_e, cand_f, cand_g, cand_h, cand_i};
static const char *CNAME[NCAND] = {
    "SDM order: fma p_2k then p_2k+1, flush", "p_2k+1 then p_2k, flush",
    "pair summed exactly, one rounding into acc, flush", "SDM order without DAZ/FTZ",
    "C + 32 products exactly, one rounding, flush", "even and odd partial sums from 0, C + (E + O), flush",
    "32 products exactly, rounded, then + C, flush", "pair sum rounded, then + acc, flush",
    "a, but a denormal starting C kept"};

static float emulate(int cand, const Case *cs, int m, int n) {
    float acc = cs->c[m][n];
    for (int s = 0; s < cs->steps; s++) acc = CAND[cand](acc, cs->a[s][m], (const uint16_t (*)[2 * N])cs->b[s], n);
    return acc;
}

/* ---- seeded inputs ---- */
static uint64_t rng_state;
static uint64_t rnd64(void) {                                   /* splitmix64 */
    uint64_t z = (rng_state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}
static int rint_in(int lo, int hi) { return lo + (int)(rnd64() % (uint64_t)(hi - lo + 1)); }
static uint16_t mkbf(int e) {                                    /* random sign and mantissa, 2^e scale */
    if (e < -126) e = -126;
    return (uint16_t)((rnd64() & 1) << 15 | (uint16_t)(e + 127) << 7 | (rnd64() & 0x7F));
}
static uint16_t denorm_bf(void) { return (uint16_t)((rnd64() & 1) << 15 | (1 + rnd64() % 0x7F)); }
static uint16_t nudge(uint16_t h) { return (uint16_t)(h + (uint16_t)rint_in(-2, 2)); }   /* a few ulps, same binade mostly */
static float mkf32(int e) {
    const uint32_t u = (uint32_t)(rnd64() & 1) << 31 | (uint32_t)(e + 127) << 23 | (uint32_t)(rnd64() & 0x7FFFFF);
    float f; memcpy(&f, &u, 4); return f;
}

/* Kinds (each separates some candidates): plain; cancel (p_2k+1 ~ -p_2k, large, small C: order and
 * rounding count); mixed (exponents over 2^-60..2^60); bf16-denormal (denormal operands against
 * large partners: DAZ decides); near-denormal (products and C around 2^-126, fp32 denormal C: FTZ
 * decides); ties (C near 1, products of half and quarter ulps: which sums round where). Exponents
 * stay below 2^110 a product: no output overflows. */
static void make_case(Case *cs, int kind) {
    memset(cs, 0, sizeof *cs);
    cs->kind = kind;
    cs->steps = rint_in(1, MAXSTEPS);
    for (int s = 0; s < cs->steps; s++) {
        int sa[KT], sb[KT];                                      /* per-k scales of A's and B's columns */
        for (int k = 0; k < KT; k++) {
            switch (kind) {
            case 0: sa[k] = rint_in(-4, 4); sb[k] = rint_in(-4, 4); break;
            case 1: sa[k] = rint_in(0, 20); sb[k] = rint_in(0, 20); break;
            case 2: sa[k] = rint_in(-30, 30); sb[k] = rint_in(-30, 30); break;
            case 3: {                                            /* products ~2^-26 */
                const int r = rint_in(0, 2);
                sa[k] = r == 0 ? -13 : r == 1 ? -125 : 100;
                sb[k] = r == 0 ? -13 : r == 1 ? 100 : -125;
                break;
            }
            case 4: sa[k] = rint_in(-66, -60); sb[k] = rint_in(-66, -60); break;
            default: sa[k] = rint_in(-14, -12); sb[k] = rint_in(-13, -11); break;
            }
        }
        for (int m = 0; m < M; m++)
            for (int k = 0; k < KT; k++) {
                uint16_t v = mkbf(sa[k] + rint_in(-1, 1));
                if (kind == 3 && sb[k] == 100 && rnd64() % 3 == 0) v = denorm_bf();   /* x 2^100: ~2^-30 */
                if (kind == 5) v = (uint16_t)(v & 0xFFF0);           /* short mantissas: exact ties */
                cs->a[s][m][k] = v;
            }
        for (int k = 0; k < KT; k++)
            for (int n = 0; n < N; n++) {
                uint16_t v = mkbf(sb[k] + rint_in(-1, 1));
                if (kind == 3 && sa[k] == 100 && rnd64() % 3 == 0) v = denorm_bf();
                if (kind == 5) v = (uint16_t)(v & 0xFFF0);
                cs->b[s][k / 2][2 * n + k % 2] = v;
            }
        if (kind == 1 || kind == 4)                              /* pair element 1 ~ -element 0 */
            for (int k = 0; k < KT; k += 2) {
                for (int m = 0; m < M; m++)
                    cs->a[s][m][k + 1] = (rnd64() % 4 ? nudge(cs->a[s][m][k]) : cs->a[s][m][k]) ^ 0x8000;
                for (int n = 0; n < N; n++)
                    cs->b[s][k / 2][2 * n + 1] = rnd64() % 4 ? nudge(cs->b[s][k / 2][2 * n]) : cs->b[s][k / 2][2 * n];
            }
    }
    for (int m = 0; m < M; m++)
        for (int n = 0; n < N; n++) {
            float c;
            switch (kind) {
            case 0: c = mkf32(rint_in(-4, 12)); break;
            case 1: c = mkf32(rint_in(-10, 10)); break;
            case 2: c = mkf32(rint_in(-60, 60)); break;
            case 3: c = mkf32(rint_in(-30, -22)); break;
            case 4: { const uint32_t u = (uint32_t)(rnd64() & 0x807FFFFF) | (uint32_t)rint_in(0, 2) << 23;
                      memcpy(&c, &u, 4); break; }             /* fp32 denormals and the lowest binades */
            default: c = ldexpf(1.0f + (float)rint_in(0, 7) * 0x1p-23f, rint_in(0, 2)) * (rnd64() % 2 ? 1 : -1); break;
            }
            if (rnd64() % 16 == 0) c = 0.0f;
            cs->c[m][n] = c;
        }
}

/* ---- AMX ---- */
typedef struct __attribute__((aligned(64))) {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileCfg;

static int amx_setup(void) {
    unsigned ea, eb, ec, ed;
    if (!__get_cpuid_count(7, 0, &ea, &eb, &ec, &ed) || !(ed & (1u << 22)) || !(ed & (1u << 24))) {
        printf("amx_probe: no AMX-BF16 on this CPU (CPUID.7.0:EDX bits 22/24 clear): nothing to probe\n");
        return 3;
    }
    if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */)) {
        printf("amx_probe: the CPU has AMX-BF16 but Linux refused tile data (arch_prctl ARCH_REQ_XCOMP_PERM: %s)\n",
               strerror(errno));
        return 2;
    }
    static TileCfg cfg;
    cfg.palette = 1;
    for (int t = 0; t < 3; t++) { cfg.rows[t] = 16; cfg.colsb[t] = 64; }   /* tmm0 C, tmm1 A, tmm2 B */
    _tile_loadconfig(&cfg);
    return 0;
}

/* C kept in tmm0 across the K steps, as a blocked GEMM would. */
static void amx_run(const Case *cs, float out[M][N]) {
    _tile_loadd(0, cs->c, 64);
    for (int s = 0; s < cs->steps; s++) {
        _tile_loadd(1, cs->a[s], 64);
        _tile_loadd(2, cs->b[s], 64);
        _tile_dpbf16ps(0, 1, 2);
    }
    _tile_stored(0, out, 64);
}

/* ---- main ---- */
static int self_test(int runs) {
    long diff[NCAND][NCAND] = {{0}}, outputs = 0, steps = 0, bad = 0;
    Case cs;
    for (int r = 0; r < runs; r++) {
        make_case(&cs, r % NKIND);
        for (int m = 0; m < M; m++)
            for (int n = 0; n < N; n++) {
                uint32_t v[NCAND];
                for (int c = 0; c < NCAND; c++) v[c] = bits(emulate(c, &cs, m, n));
                for (int i = 0; i < NCAND; i++)
                    for (int j = i + 1; j < NCAND; j++) diff[i][j] += v[i] != v[j];
                outputs++;
                /* the exact-sum helper against fmaf and the float add, on this case's own steps */
                float acc = cs.c[m][n];
                for (int s = 0; s < cs.steps; s++)
                    for (int k = 0; k < KT; k++) {
                        const float x = bf(cs.a[s][m][k]), y = bf(cs.b[s][k / 2][2 * n + k % 2]);
                        const float f = fmaf(x, y, acc), sum = acc + x;
                        bad += bits(ex_sum3(acc, (double)x * y, 0.0, 0)) != bits(f);
                        bad += bits(ex_sum3(acc, x, 0.0, 0)) != bits(sum);
                        steps += 2;
                        acc = f;
                    }
            }
    }
    printf("amx_probe --self-test: %d runs, %ld outputs (K 32-128, %d kinds), emulations only\n", runs, outputs, NKIND);
    for (int c = 0; c < NCAND; c++) printf("  %c  %s\n", 'a' + c, CNAME[c]);
    printf("outputs where two candidates differ (row < column):\n     ");
    for (int j = 0; j < NCAND; j++) printf(" %7c", 'a' + j);
    printf("\n");
    int same = 0;
    for (int i = 0; i < NCAND; i++) {
        printf("  %c  ", 'a' + i);
        for (int j = 0; j < NCAND; j++) {
            if (j <= i) { printf(" %7s", "."); continue; }
            printf(" %7ld", diff[i][j]);
            same += diff[i][j] == 0;
        }
        printf("\n");
    }
    printf("exact-sum helper vs fmaf / fp32 add: %ld of %ld steps differ\n", bad, steps);
    printf("%s\n", same || bad ? "FAIL: the probe could not tell some candidates apart (or its exact sum is wrong)"
                               : "ok: every pair of candidates differs somewhere; the probe can tell them apart");
    return same || bad ? 1 : 0;
}

int main(int argc, char **argv) {
    int runs = 600, selftest = 0, fake = -1;
    uint64_t seed = 30;
    const char *dump = NULL;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--self-test")) selftest = 1;
        else if (!strcmp(argv[i], "--runs") && i + 1 < argc) runs = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--seed") && i + 1 < argc) seed = strtoull(argv[++i], NULL, 0);
        else if (!strcmp(argv[i], "--dump") && i + 1 < argc) dump = argv[++i];
        else if (!strcmp(argv[i], "--emulate") && i + 1 < argc && argv[i + 1][0] >= 'a' && argv[i + 1][0] < 'a' + NCAND)
            fake = argv[++i][0] - 'a';
        else { fprintf(stderr, "usage: amx_probe [--self-test] [--runs N] [--seed S] [--dump FILE] [--emulate a-i]\n"); return 2; }
    }
    if (runs < 1) runs = 1;
    rng_state = seed;
    if (selftest) return self_test(runs);

    const int rc = fake < 0 ? amx_setup() : 0;
    if (rc) return rc;
    FILE *df = dump ? fopen(dump, "wb") : NULL;
    if (dump && !df) { fprintf(stderr, "amx_probe: cannot write %s\n", dump); return 2; }
    long equal[NCAND] = {0}, differ[NCAND][NKIND] = {{0}}, outputs = 0, nonfinite = 0;
    int shown = 0;
    Case cs;
    static float out[M][N] __attribute__((aligned(64)));
    for (int r = 0; r < runs; r++) {
        make_case(&cs, r % NKIND);
        if (fake < 0) amx_run(&cs, out);
        else for (int m = 0; m < M; m++) for (int n = 0; n < N; n++) out[m][n] = emulate(fake, &cs, m, n);
        if (df) { fwrite(&cs, sizeof cs, 1, df); fwrite(out, sizeof out, 1, df); }
        for (int m = 0; m < M; m++)
            for (int n = 0; n < N; n++) {
                float v[NCAND];
                int finite = isfinite(out[m][n]);
                for (int c = 0; c < NCAND; c++) { v[c] = emulate(c, &cs, m, n); finite &= isfinite(v[c]); }
                if (!finite) { nonfinite++; continue; }                /* reported, not compared */
                outputs++;
                for (int c = 0; c < NCAND; c++) {
                    const int eq = bits(v[c]) == bits(out[m][n]);
                    equal[c] += eq;
                    differ[c][cs.kind] += !eq;
                }
                if (bits(v[0]) != bits(out[m][n]) && shown < 5) {      /* a few, for a person to read */
                    shown++;
                    printf("  run %d (%s, K %d) m %d n %d: C %a  TDPBF16PS %a  a %a b %a c %a d %a e %a f %a g %a h %a i %a\n",
                           r, KIND[cs.kind], KT * cs.steps, m, n, cs.c[m][n], out[m][n], v[0], v[1], v[2], v[3], v[4],
                           v[5], v[6], v[7], v[8]);
                }
            }
    }
    if (fake < 0) _tile_release();
    if (df) fclose(df);
    printf("amx_probe: %d runs (seed %llu), %ld outputs compared, %ld non-finite skipped%s\n", runs,
           (unsigned long long)seed, outputs, nonfinite, fake < 0 ? "" : " (--emulate: no TDPBF16PS ran)");
    int matched = 0;
    char names[2 * NCAND + 1] = "";
    for (int c = 0; c < NCAND; c++) {
        printf("candidate %c: %ld of %ld outputs equal  [%s; differ by kind:", 'a' + c, equal[c], outputs, CNAME[c]);
        for (int k = 0; k < NKIND; k++) printf(" %s %ld", KIND[k], differ[c][k]);
        printf("]\n");
        if (equal[c] == outputs && outputs) { names[strlen(names)] = (char)('a' + c); matched++; }   /* "a", "ab".. */
    }
    printf("matched every output: %s\n", matched ? names : "none");
    return matched == 1 ? 0 : 1;
}
