/* The passes over one row of logits that the declared sampler steps make (lmhead/sampling/steps/moments.py):
 * the row's moments in float64 (maximum, count of finite logits, Σ e^(x − max) and Σ e^(x − max)·(x − max),
 * from which the log-normaliser and the entropy follow; mean and standard deviation of the finite logits),
 * locally typical sampling's kept set, and a threshold cut. The steps' references (tests/reference.py) compute in
 * float64: so do these, with one exp of the row's own (below) instead of torch's float64 exp, so that a cut
 * decided here is the reference's cut up to float64 rounding — never a float32 approximation of it. Each pass
 * reads the float32 row once; a wide row is cut into pieces over the threads, the pieces' sums combined in order.
 * Built with the other kernels into one library by kernels/native.py, which tests every entry point on load.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif

#include "kernel_results.h"
#include "row_pieces.h"
#include "simd_math.h"

/* e^d for d ≤ 0 in double: d = (32q + j)·ln2/32 + r (ln2/32 in two parts, so that n·hi is exact; |r| ≤ ln2/64),
 * e^d = 2^q · 2^(j/32) · e^r, 2^(j/32) from a table (correctly rounded), e^r − 1 by its Taylor polynomial to r^6/6!
 * (the next term is below 4e-18), 2^q into the exponent. Within two ulp of libm's exp. d below −708 (or −inf)
 * gives 0: e^−708 is below 1e−307 of the row's maximum, nothing a sum or a comparison of float64 masses can see.
 * The vector and the scalar forms round every step alike, so a value does not depend on the lane or the position
 * it is computed in. */
#define EXP_LOW (-708.0)
static const double EXP_HI = 0.021660849392446835, EXP_LO = 5.145609244655338e-14, EXP_K = 46.16624130844683;
static const double EXP_TABLE[32] = {
    1.0, 1.0218971486541166, 1.0442737824274138, 1.0671404006768237,
    1.0905077326652577, 1.1143867425958924, 1.1387886347566916, 1.1637248587775775,
    1.189207115002721, 1.215247359980469, 1.241857812073484, 1.2690509571917332,
    1.2968395546510096, 1.3252366431597413, 1.3542555469368927, 1.383909881963832,
    1.4142135623730951, 1.4451808069770467, 1.4768261459394993, 1.5091644275934228,
    1.5422108254079407, 1.5759808451078865, 1.6104903319492543, 1.645755478153965,
    1.681792830507429, 1.718619298122478, 1.7562521603732995, 1.7947090750031072,
    1.8340080864093424, 1.8741676341103, 1.9152065613971474, 1.9571441241754002};
static const double TAYLOR[6] = {1.0 / 720.0, 1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0};

static inline double exp_neg(double d) {
    if (!(d >= EXP_LOW)) return 0.0;
    const double n = nearbyint(d * EXP_K);
    double r = fma(-n, EXP_HI, d);
    r = fma(-n, EXP_LO, r);
    double p = TAYLOR[0];
    for (int j = 1; j < 6; j++) p = fma(p, r, TAYLOR[j]);
    const int ni = (int)n;
    const double t = EXP_TABLE[ni & 31];
    return ldexp(fma(t, p * r, t), ni >> 5);
}

#ifdef __AVX2__
static inline __m256d exp_neg4(__m256d d) {
    const __m256d live = _mm256_cmp_pd(d, _mm256_set1_pd(EXP_LOW), _CMP_GE_OQ);
    d = _mm256_max_pd(d, _mm256_set1_pd(EXP_LOW));
    const __m256d n = _mm256_round_pd(_mm256_mul_pd(d, _mm256_set1_pd(EXP_K)),
                                      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256d r = _mm256_fnmadd_pd(n, _mm256_set1_pd(EXP_HI), d);
    r = _mm256_fnmadd_pd(n, _mm256_set1_pd(EXP_LO), r);
    __m256d p = _mm256_set1_pd(TAYLOR[0]);
    for (int j = 1; j < 6; j++) p = _mm256_fmadd_pd(p, r, _mm256_set1_pd(TAYLOR[j]));
    const __m128i ni = _mm256_cvtpd_epi32(n);
    const __m256d t = _mm256_i32gather_pd(EXP_TABLE, _mm_and_si128(ni, _mm_set1_epi32(31)), 8);
    const __m256i e = _mm256_slli_epi64(
        _mm256_add_epi64(_mm256_cvtepi32_epi64(_mm_srai_epi32(ni, 5)), _mm256_set1_epi64x(1023)), 52);
    const __m256d v = _mm256_fmadd_pd(t, _mm256_mul_pd(p, r), t);
    return _mm256_and_pd(_mm256_mul_pd(v, _mm256_castsi256_pd(e)), live);
}

static inline double hsum4(__m256d v) {
    double lanes[4];
    _mm256_storeu_pd(lanes, v);
    return (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
}

/* simd_math.h's float32 e^x for eight floats (Cephes' polynomial; x clamped to [−87, 88]), for the passes
 * whose error is bounded below: over every float32 x in [−87, 0] its result is within EXP8_ERROR of e^x
 * (relatively; checked against exp in double, input by input) */
#define EXP8_ERROR 1.19e-7
#endif

typedef struct {
    float max, min; /* the maximum; the least finite logit (+inf when there is none) */
    int64_t finite; /* logits > −inf */
    int bad;        /* a NaN or +inf */
    double sum;     /* Σ of the finite logits, in double */
} row_scan;

static void scan_piece(const float* x, int64_t lo, int64_t hi, row_scan* s) {
    float m = -INFINITY, mn = INFINITY;
    int64_t finite = 0, i = lo;
    int bad = 0;
    double sum = 0.0;
#ifdef __AVX2__
    __m256 mv = _mm256_set1_ps(-INFINITY), nv = _mm256_set1_ps(INFINITY), badv = _mm256_setzero_ps();
    __m256d s0 = _mm256_setzero_pd(), s1 = _mm256_setzero_pd();
    const __m256 ninf = _mm256_set1_ps(-INFINITY), pinf = _mm256_set1_ps(INFINITY);
    for (; i + 8 <= hi; i += 8) {
        const __m256 t = _mm256_loadu_ps(x + i);
        const __m256 fin = _mm256_cmp_ps(t, ninf, _CMP_GT_OQ); /* NaN: false */
        mv = _mm256_max_ps(mv, t);
        nv = _mm256_min_ps(nv, _mm256_blendv_ps(pinf, t, fin));
        badv = _mm256_or_ps(badv, _mm256_or_ps(_mm256_cmp_ps(t, t, _CMP_UNORD_Q), _mm256_cmp_ps(t, pinf, _CMP_EQ_OQ)));
        finite += __builtin_popcount((unsigned)_mm256_movemask_ps(fin));
        const __m256 tf = _mm256_and_ps(t, fin);
        s0 = _mm256_add_pd(s0, _mm256_cvtps_pd(_mm256_castps256_ps128(tf)));
        s1 = _mm256_add_pd(s1, _mm256_cvtps_pd(_mm256_extractf128_ps(tf, 1)));
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, mv);
    for (int l = 0; l < 8; l++) m = lanes[l] > m ? lanes[l] : m;
    _mm256_storeu_ps(lanes, nv);
    for (int l = 0; l < 8; l++) mn = lanes[l] < mn ? lanes[l] : mn;
    bad = _mm256_movemask_ps(badv) != 0;
    sum = hsum4(_mm256_add_pd(s0, s1));
#endif
    for (; i < hi; i++) {
        const float t = x[i];
        if (t != t || t == INFINITY) bad = 1;
        if (t > m) m = t;
        if (t > -INFINITY) finite++, sum += t, mn = t < mn ? t : mn;
    }
    s->max = m, s->min = mn, s->finite = finite, s->bad = bad, s->sum = sum;
}

/* the whole row's scan, its pieces over the threads → 0, or -2 for a NaN, +inf, or no finite logit */
static int scan_row(const float* x, int64_t V, int threads, row_scan* out) {
    const int pieces = row_pieces(V);
    row_scan part[ROW_PIECES];
#pragma omp parallel for num_threads(piece_threads(pieces, threads)) schedule(static)
    for (int j = 0; j < pieces; j++) scan_piece(x, V * j / pieces, V * (j + 1) / pieces, part + j);
    *out = part[0];
    for (int j = 1; j < pieces; j++) {
        out->max = part[j].max > out->max ? part[j].max : out->max;
        out->min = part[j].min < out->min ? part[j].min : out->min;
        out->finite += part[j].finite, out->bad |= part[j].bad, out->sum += part[j].sum;
    }
    return out->bad || out->finite == 0 ? -2 : 0;
}

/* Σ e^(x − m) and Σ e^(x − m)·(x − m) over x[lo, hi), in double */
static void exp_piece(const float* x, int64_t lo, int64_t hi, double m, double* s_out, double* a_out) {
    double s = 0.0, a = 0.0;
    int64_t i = lo;
#ifdef __AVX2__
    const __m256d mv = _mm256_set1_pd(m), low = _mm256_set1_pd(EXP_LOW);
    __m256d s0 = _mm256_setzero_pd(), a0 = _mm256_setzero_pd(), s1 = _mm256_setzero_pd(), a1 = _mm256_setzero_pd();
    for (; i + 8 <= hi; i += 8) {
        const __m256 t = _mm256_loadu_ps(x + i);
        const __m256d d0 = _mm256_sub_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(t)), mv);
        const __m256d d1 = _mm256_sub_pd(_mm256_cvtps_pd(_mm256_extractf128_ps(t, 1)), mv);
        const __m256d e0 = exp_neg4(d0), e1 = exp_neg4(d1);
        s0 = _mm256_add_pd(s0, e0), s1 = _mm256_add_pd(s1, e1);
        /* −inf − m is −inf: e = 0, and 0·(−inf) would be NaN, so the product takes d ≥ EXP_LOW */
        a0 = _mm256_fmadd_pd(e0, _mm256_max_pd(d0, low), a0);
        a1 = _mm256_fmadd_pd(e1, _mm256_max_pd(d1, low), a1);
    }
    s = hsum4(_mm256_add_pd(s0, s1)), a = hsum4(_mm256_add_pd(a0, a1));
#endif
    for (; i < hi; i++) {
        const double d = (double)x[i] - m;
        const double v = exp_neg(d);
        s += v;
        a = fma(v, d > EXP_LOW ? d : EXP_LOW, a);
    }
    *s_out = s, *a_out = a;
}

/* the moments below into out[0..5] (out[6] = 0; S and A NaN without `exps`) → 0 or -2 */
static int row_moments(const float* x, int64_t V, int exps, double* out, int threads) {
    row_scan sc;
    if (scan_row(x, V, threads, &sc)) return -2;
    const int pieces = row_pieces(V);
    const double m = sc.max;
    double s = NAN, a = NAN;
    if (exps) {
        double ps[ROW_PIECES], pa[ROW_PIECES];
#pragma omp parallel for num_threads(piece_threads(pieces, threads)) schedule(static)
        for (int j = 0; j < pieces; j++) exp_piece(x, V * j / pieces, V * (j + 1) / pieces, m, ps + j, pa + j);
        s = 0.0, a = 0.0;
        for (int j = 0; j < pieces; j++) s += ps[j], a += pa[j];
    }
    out[0] = m, out[1] = (double)sc.finite, out[2] = s, out[3] = a, out[4] = sc.min;
    out[5] = sc.sum / (double)sc.finite, out[6] = 0.0;
    return 0;
}

/* The row's moments (kernels/native.py `row_moments`): out[0] the maximum, out[1] the count of finite logits,
 * out[2] S = Σ e^(x − max), out[3] A = Σ e^(x − max)·(x − max) (with `what` & 1; else NaN), out[4] the least
 * finite logit, out[5] the mean of the finite logits and, with `what` & 2, out[6] their population standard
 * deviation (a second pass about the mean, in double) → 0, or -2 for a NaN, +inf or a row without a finite
 * logit. log-normaliser = max + log S; entropy = log S − A/S; the mean of x under softmax(x) = max + A/S. */
int lmhead_row_moments(const float* x, int64_t V, int what, double* out, int threads) {
    const int sigma = what & 2;
    if (row_moments(x, V, what & 1, out, threads)) return -2;
    const int pieces = row_pieces(V);
    const double mean = out[5];
    if (sigma) {
        double pv[ROW_PIECES];
#pragma omp parallel for num_threads(piece_threads(pieces, threads)) schedule(static)
        for (int j = 0; j < pieces; j++) {
            const int64_t lo = V * j / pieces, hi = V * (j + 1) / pieces;
            double v = 0.0;
            int64_t i = lo;
#ifdef __AVX2__
            const __m256d mv = _mm256_set1_pd(mean), ninf = _mm256_set1_pd(-INFINITY);
            __m256d v0 = _mm256_setzero_pd(), v1 = _mm256_setzero_pd();
            for (; i + 8 <= hi; i += 8) {
                const __m256 t = _mm256_loadu_ps(x + i);
                const __m256d t0 = _mm256_cvtps_pd(_mm256_castps256_ps128(t));
                const __m256d t1 = _mm256_cvtps_pd(_mm256_extractf128_ps(t, 1));
                const __m256d z0 = _mm256_and_pd(_mm256_sub_pd(t0, mv), _mm256_cmp_pd(t0, ninf, _CMP_GT_OQ));
                const __m256d z1 = _mm256_and_pd(_mm256_sub_pd(t1, mv), _mm256_cmp_pd(t1, ninf, _CMP_GT_OQ));
                v0 = _mm256_fmadd_pd(z0, z0, v0), v1 = _mm256_fmadd_pd(z1, z1, v1);
            }
            v = hsum4(_mm256_add_pd(v0, v1));
#endif
            for (; i < hi; i++)
                if (x[i] > -INFINITY) {
                    const double d = (double)x[i] - mean;
                    v = fma(d, d, v);
                }
            pv[j] = v;
        }
        double v = 0.0;
        for (int j = 0; j < pieces; j++) v += pv[j];
        out[6] = sqrt(v / out[1]);
    }
    return 0;
}

/* The log-normaliser and the entropy at float32 cost, with bounds on their errors (kernels/native.py
 * `row_lse_bounded`): out[0] the maximum m, out[1] log S' with S' = Σ exp8(fl32(x − m)) summed in double, out[2]
 * a bound on |log S − log S'| for the exact S = Σ e^(x − m), out[3] the entropy H' = log S' − A'/S' (A' = Σ e'·d'),
 * out[4] a bound on |H − H'| → 0, or -2 for a NaN, +inf, a row without a finite logit, or a CPU without AVX2 (the
 * caller takes the float64 moments).
 *
 * The bounds: d' = fl32(x − m) is within 2^−24·|d| of d = x − m, so e^d' within that much of e^d relatively, and
 * exp8 adds EXP8_ERROR; a logit more than 87 below m counts as e^−87 instead of its (smaller) mass. Summed:
 * |S' − S| ≤ EXP8_ERROR·S + 2^−24·Σ e·|d| + V·e^−87, and |A' − A| ≤ (EXP8_ERROR + 2^−24)·Σ e·|d| +
 * 2^−24·Σ e·d² + V·87·e^−87, with Σ e·|d| = −A' and Σ e·d² = B' = Σ e'·d'² up to those errors again (room of
 * 1.001 covers them); the double sums' own rounding is below V·2^−53 of each. A threshold on the logit decided
 * from these is the exact one wherever no logit lies within the bound of it (the callers check). */
int lmhead_row_lse_bounded(const float* x, int64_t V, double* out, int threads) {
#ifdef __AVX2__
    row_scan sc;
    if (scan_row(x, V, threads, &sc)) return -2;
    const int pieces = row_pieces(V);
    const float m = sc.max;
    double ps[ROW_PIECES], pa[ROW_PIECES], pb[ROW_PIECES];
#pragma omp parallel for num_threads(piece_threads(pieces, threads)) schedule(static)
    for (int j = 0; j < pieces; j++) {
        const int64_t lo = V * j / pieces, hi = V * (j + 1) / pieces;
        int64_t i = lo;
        const __m256 mv = _mm256_set1_ps(m);
        __m256d s0 = _mm256_setzero_pd(), s1 = _mm256_setzero_pd(), a0 = _mm256_setzero_pd(), a1 = _mm256_setzero_pd(),
                b0 = _mm256_setzero_pd(), b1 = _mm256_setzero_pd();
        for (; i + 8 <= hi; i += 8) {
            const __m256 t = _mm256_loadu_ps(x + i);
            /* d below −87 (−inf too) counts as −87: e^−87 for a token of (nearly) nothing, within the bound */
            const __m256 d = _mm256_max_ps(_mm256_sub_ps(t, mv), _mm256_set1_ps(-87.0f));
            const __m256 e = exp8(d);
            const __m256d e0 = _mm256_cvtps_pd(_mm256_castps256_ps128(e)), e1 = _mm256_cvtps_pd(_mm256_extractf128_ps(e, 1));
            const __m256d d0 = _mm256_cvtps_pd(_mm256_castps256_ps128(d)), d1 = _mm256_cvtps_pd(_mm256_extractf128_ps(d, 1));
            const __m256d ed0 = _mm256_mul_pd(e0, d0), ed1 = _mm256_mul_pd(e1, d1);
            s0 = _mm256_add_pd(s0, e0), s1 = _mm256_add_pd(s1, e1);
            a0 = _mm256_add_pd(a0, ed0), a1 = _mm256_add_pd(a1, ed1);
            b0 = _mm256_fmadd_pd(ed0, d0, b0), b1 = _mm256_fmadd_pd(ed1, d1, b1);
        }
        double s = hsum4(_mm256_add_pd(s0, s1)), a = hsum4(_mm256_add_pd(a0, a1)), b = hsum4(_mm256_add_pd(b0, b1));
        for (; i < hi; i++) { /* the tail through the same vector exp, one lane used */
            float d = x[i] - m;
            d = d > -87.0f ? d : -87.0f;
            float lanes[8];
            _mm256_storeu_ps(lanes, exp8(_mm256_set1_ps(d)));
            s += lanes[0], a += (double)lanes[0] * d, b += (double)lanes[0] * d * d;
        }
        ps[j] = s, pa[j] = a, pb[j] = b;
    }
    double s = 0.0, a = 0.0, b = 0.0;
    for (int j = 0; j < pieces; j++) s += ps[j], a += pa[j], b += pb[j];
    const double n = (double)V, round = n * 0x1p-53;
    const double err_s = 1.001 * (EXP8_ERROR * s + 0x1p-24 * fabs(a)) + n * 2e-38 + round * s;
    const double err_a = 1.001 * ((EXP8_ERROR + 0x1p-24) * fabs(a) + 0x1p-24 * b) + n * 2e-36 + round * fabs(a);
    const double rel = err_s / s;
    if (!(rel < 0.5)) {
        out[0] = m, out[1] = log(s), out[2] = out[4] = INFINITY, out[3] = log(s) - a / s;
        return 0;
    }
    const double d_log = 1.01 * rel + 1e-15;
    /* |A/S − A'/S'| ≤ (|A − A'| + |A'|·|S − S'|/S')/S, and S ≥ S'(1 − rel) */
    const double d_mean = (err_a + fabs(a) * rel) / (s * (1.0 - rel)) + 1e-15 * (1.0 + fabs(a / s));
    out[0] = m, out[1] = log(s), out[2] = d_log, out[3] = log(s) - a / s, out[4] = d_log + d_mean;
    return 0;
#else
    (void)x, (void)V, (void)out, (void)threads;
    return -2;
#endif
}

/* out[i] = x[i] if x[i] ≥ t, else −inf, as lmhead_keep_ge → the count of logits in [lo, hi] below m (those a
 * threshold known only to lie in [lo, hi] may not have decided; the maximum is kept either way) */
int64_t lmhead_keep_ge_unsure(const float* x, int64_t V, float t, float lo, float hi, float m, float* out) {
    int64_t unsure = 0, i = 0;
#ifdef __AVX2__
    const __m256 tv = _mm256_set1_ps(t), lov = _mm256_set1_ps(lo), hiv = _mm256_set1_ps(hi), mv = _mm256_set1_ps(m),
                 ninf = _mm256_set1_ps(-INFINITY);
    for (; i + 8 <= V; i += 8) {
        const __m256 v = _mm256_loadu_ps(x + i);
        _mm256_storeu_ps(out + i, _mm256_blendv_ps(ninf, v, _mm256_cmp_ps(v, tv, _CMP_GE_OQ)));
        const __m256 in = _mm256_and_ps(_mm256_and_ps(_mm256_cmp_ps(v, lov, _CMP_GE_OQ), _mm256_cmp_ps(v, hiv, _CMP_LE_OQ)),
                                        _mm256_cmp_ps(v, mv, _CMP_LT_OQ));
        unsure += __builtin_popcount((unsigned)_mm256_movemask_ps(in));
    }
#endif
    for (; i < V; i++) {
        out[i] = x[i] >= t ? x[i] : -INFINITY;
        unsure += x[i] >= lo && x[i] <= hi && x[i] < m;
    }
    return unsure;
}

/* out[i] = x[i] if x[i] ≥ t, else −inf (a cut at a threshold; NaN compares false) */
void lmhead_keep_ge(const float* x, int64_t V, float t, float* out) {
    int64_t i = 0;
#ifdef __AVX2__
    const __m256 tv = _mm256_set1_ps(t), ninf = _mm256_set1_ps(-INFINITY);
    for (; i + 8 <= V; i += 8) {
        const __m256 v = _mm256_loadu_ps(x + i);
        _mm256_storeu_ps(out + i, _mm256_blendv_ps(ninf, v, _mm256_cmp_ps(v, tv, _CMP_GE_OQ)));
    }
#endif
    for (; i < V; i++) out[i] = x[i] >= t ? x[i] : -INFINITY;
}

/* Locally typical sampling's kept set (kernels/native.py `typical_row`; transformers' TypicalLogitsWarper, the
 * reference's `sampling_typical` in float64): with p = softmax(x) and H its entropy, a token's score is
 * |−log p − H| = |x − c|, c = max + A/S (the mean of x under p); in order of score the kept set ends at the first
 * token whose cumulative mass reaches `mass`, and every token scoring at most that token's is kept (ties whole).
 * x [V] → out [V] (x where kept, −inf elsewhere) → the count kept, or -2 (a NaN, +inf, or no finite logit), -3
 * (no memory).
 *
 * The tokens scoring at most s are the logits in [c − s, c + s], so the mass M(s) of the kept set is the mass of an
 * interval of logits. The pass that sums S and A also sums the masses e^(x − max) of a grid of bins over the logits
 * (uniform over the 80 below the maximum, the rest in the last bin), before c is known. The bins wholly inside the
 * interval bound M(s) from below and the bins it touches from above, so bisections find s_lo, the largest s whose
 * upper bound stays under mass·S, and s_hi, the least s whose lower bound reaches it: the crossing score lies in
 * (s_lo, s_hi]. Only the tokens of the bins the interval touches at s_hi but does not hold wholly at s_lo (a few
 * bins at either end) are sorted by (score, id) and walked from the mass of the bins it holds wholly at s_lo; every
 * other token scores at most s_lo (counted) or above s_hi (after the crossing). Bin edges are padded by more than
 * the rounding of a token's bin, and scores are |(double)x − c| wherever they are compared, computed alike in the
 * vector and the scalar code. */
#define TYPICAL_BINS 4096
#define TYPICAL_REACH 80.0
#define TYPICAL_LANES 4

typedef struct {
    double score;
    double e;
    int64_t i;
} typical_cand;

static int typical_order(const void* a, const void* b) {
    const typical_cand *x = (const typical_cand*)a, *y = (const typical_cand*)b;
    if (x->score != y->score) return x->score < y->score ? -1 : 1;
    return x->i < y->i ? -1 : (x->i > y->i);
}

/* the bin of a logit: ⌊(max − x)·k⌋, the last bin for everything past it (−inf included) */
static inline int typical_bin(double m, double v, double k) {
    const double b = (m - v) * k;
    return b < (double)(TYPICAL_BINS - 1) ? (int)b : TYPICAL_BINS - 1;
}

/* Σ e^(x − m), Σ e^(x − m)·(x − m) and the bins' masses over x[lo, hi) (TYPICAL_LANES histograms side by side,
 * so that a run of tokens in one bin is not one chain of dependent additions) */
static void typical_sums(const float* x, int64_t lo, int64_t hi, double m, double k, double* s_out, double* a_out,
                         double* hist) {
    double s = 0.0, a = 0.0;
    int64_t i = lo;
#ifdef __AVX2__
    const __m256d mv = _mm256_set1_pd(m), kv = _mm256_set1_pd(k), low = _mm256_set1_pd(EXP_LOW),
                  last = _mm256_set1_pd((double)(TYPICAL_BINS - 1));
    __m256d s0 = _mm256_setzero_pd(), a0 = _mm256_setzero_pd();
    for (; i + 4 <= hi; i += 4) {
        const __m256d v = _mm256_cvtps_pd(_mm_loadu_ps(x + i));
        const __m256d d = _mm256_sub_pd(v, mv);
        const __m256d e = exp_neg4(d);
        s0 = _mm256_add_pd(s0, e);
        a0 = _mm256_fmadd_pd(e, _mm256_max_pd(d, low), a0);
        /* (m − v)·k, then the last bin for anything at or past it (−inf: +inf there) */
        const __m128i b = _mm256_cvttpd_epi32(_mm256_min_pd(_mm256_mul_pd(_mm256_sub_pd(mv, v), kv), last));
        int bins[4];
        double es[4];
        _mm_storeu_si128((__m128i*)bins, b);
        _mm256_storeu_pd(es, e);
        for (int l = 0; l < 4; l++) hist[l * TYPICAL_BINS + bins[l]] += es[l];
    }
    s = hsum4(s0), a = hsum4(a0);
#endif
    for (; i < hi; i++) {
        const double v = (double)x[i], d = v - m, e = exp_neg(d);
        s += e;
        a = fma(e, d > EXP_LOW ? d : EXP_LOW, a);
        hist[typical_bin(m, v, k)] += e;
    }
    *s_out = s, *a_out = a;
}

/* the bins [*first, *last] that the interval [c − s, c + s] touches (whole: only those it holds wholly), from the
 * bins' edges max − j/k padded by `pad`; an empty range has *first > *last */
static void typical_span(double m, double c, double k, double pad, double s, int whole, int* first, int* last) {
    /* bin j holds logits in [m − (j + 1)/k − pad, m − j/k + pad]; the last bin reaches −inf */
    double hi, lo;
    if (whole) {
        hi = floor((m - c + s - pad) * k) - 1.0; /* m − (j + 1)/k − pad ≥ c − s */
        lo = ceil((m - c - s + pad) * k);        /* m − j/k + pad ≤ c + s */
        hi = hi < (double)(TYPICAL_BINS - 2) ? hi : (double)(TYPICAL_BINS - 2);
    } else {
        hi = floor((m - c + s + pad) * k);     /* m − j/k + pad ≥ c − s */
        lo = ceil((m - c - s - pad) * k) - 1.0; /* m − (j + 1)/k − pad ≤ c + s */
        hi = hi < (double)(TYPICAL_BINS - 1) ? hi : (double)(TYPICAL_BINS - 1);
    }
    lo = lo > 0.0 ? lo : 0.0;
    *first = (int)lo, *last = hi >= lo ? (int)hi : (int)lo - 1;
}

static double typical_mass(const double* prefix, int first, int last) {
    return last < first ? 0.0 : prefix[last + 1] - prefix[first];
}

/* token i joins the candidates when its bin is in [a0, a1] or [b0, b1] (and it is finite) → 0, or -3 for no memory */
static inline int typical_take(const float* x, int64_t i, double m, double c, double k, int a0, int a1, int b0, int b1,
                               typical_cand** out, int64_t* have, int64_t* room) {
    const int b = typical_bin(m, (double)x[i], k);
    if (!(x[i] > -INFINITY) || !((b >= a0 && b <= a1) || (b >= b0 && b <= b1))) return 0;
    if (*have == *room) {
        typical_cand* grown = (typical_cand*)realloc(*out, (size_t)(*room *= 2) * sizeof(typical_cand));
        if (!grown) return LMHEAD_NO_MEMORY;
        *out = grown;
    }
    (*out)[*have].score = fabs((double)x[i] - c), (*out)[*have].e = exp_neg((double)x[i] - m), (*out)[*have].i = i;
    (*have)++;
    return 0;
}

/* the finite tokens of x whose bin is in [a0, a1] or [b0, b1] → cand (grown as needed), their count; -3 for no
 * memory. The vector loop finds each token's bin in float32, which can differ from the bin in double by one:
 * it passes every token within one bin of the ranges to the exact test. */
static int64_t typical_collect(const float* x, int64_t V, double m, double c, double k, int a0, int a1, int b0,
                               int b1, typical_cand** cand) {
    int64_t have = 0, room = 1024, i = 0;
    typical_cand* out = (typical_cand*)malloc((size_t)room * sizeof(typical_cand));
    if (!out) return LMHEAD_NO_MEMORY;
#ifdef __AVX2__
    const __m256 mv = _mm256_set1_ps((float)m), kv = _mm256_set1_ps((float)k),
                 last = _mm256_set1_ps((float)TYPICAL_BINS);
    const __m256i lo_a = _mm256_set1_epi32(a0 - 2), hi_a = _mm256_set1_epi32(a1 + 2), lo_b = _mm256_set1_epi32(b0 - 2),
                  hi_b = _mm256_set1_epi32(b1 + 2);
    for (; i + 8 <= V; i += 8) {
        const __m256 v = _mm256_loadu_ps(x + i);
        const __m256i b = _mm256_cvttps_epi32(_mm256_min_ps(_mm256_mul_ps(_mm256_sub_ps(mv, v), kv), last));
        const __m256i in = _mm256_or_si256(_mm256_and_si256(_mm256_cmpgt_epi32(b, lo_a), _mm256_cmpgt_epi32(hi_a, b)),
                                           _mm256_and_si256(_mm256_cmpgt_epi32(b, lo_b), _mm256_cmpgt_epi32(hi_b, b)));
        unsigned bits = (unsigned)_mm256_movemask_ps(_mm256_castsi256_ps(in));
        while (bits) {
            const int64_t j = i + __builtin_ctz(bits);
            bits &= bits - 1;
            if (typical_take(x, j, m, c, k, a0, a1, b0, b1, &out, &have, &room)) return free(out), -3;
        }
    }
#endif
    for (; i < V; i++)
        if (typical_take(x, i, m, c, k, a0, a1, b0, b1, &out, &have, &room)) return free(out), -3;
    *cand = out;
    return have;
}

/* out = x where |(double)x − c| ≤ limit, −inf elsewhere → the count kept. The score is monotone in x on either side
 * of c, so the kept logits are the float32 values in [lo, hi]: the float32 numbers nearest c ± limit, moved by a
 * step at a time until they are the outermost that pass the test itself. */
static int64_t typical_write(const float* x, int64_t V, double c, double limit, float* out) {
    float hi = (float)(c + limit), lo = (float)(c - limit);
    while (hi > -INFINITY && fabs((double)hi - c) > limit) hi = nextafterf(hi, -INFINITY);
    while (hi < INFINITY && fabs((double)nextafterf(hi, INFINITY) - c) <= limit) hi = nextafterf(hi, INFINITY);
    while (lo < INFINITY && fabs((double)lo - c) > limit) lo = nextafterf(lo, INFINITY);
    while (lo > -INFINITY && fabs((double)nextafterf(lo, -INFINITY) - c) <= limit) lo = nextafterf(lo, -INFINITY);
    if (lo == -INFINITY) lo = -FLT_MAX; /* −inf scores inf: never kept */
    int64_t kept = 0, i = 0;
#ifdef __AVX2__
    const __m256 lov = _mm256_set1_ps(lo), hiv = _mm256_set1_ps(hi), ninf = _mm256_set1_ps(-INFINITY);
    for (; i + 8 <= V; i += 8) {
        const __m256 v = _mm256_loadu_ps(x + i);
        const __m256 keep = _mm256_and_ps(_mm256_cmp_ps(v, lov, _CMP_GE_OQ), _mm256_cmp_ps(v, hiv, _CMP_LE_OQ));
        _mm256_storeu_ps(out + i, _mm256_blendv_ps(ninf, v, keep));
        kept += __builtin_popcount((unsigned)_mm256_movemask_ps(keep));
    }
#endif
    for (; i < V; i++) {
        const int keep = x[i] >= lo && x[i] <= hi;
        out[i] = keep ? x[i] : -INFINITY;
        kept += keep;
    }
    return kept;
}

/* row_pieces for the typical pass: each piece clears and merges its own histograms (TYPICAL_LANES ×
 * TYPICAL_BINS doubles), so a cut row's pieces hold at least 65,536 logits (2 to ROW_PIECES) — by its width alone */
static inline int typical_pieces(int64_t V) {
    const int64_t p = V / 65536;
    return row_pieces(V) == 1 ? 1 : p < 2 ? 2 : p > ROW_PIECES ? ROW_PIECES : (int)p;
}

int64_t lmhead_typical_row(const float* x, int64_t V, double mass, float* out, int threads) {
    row_scan sc;
    if (scan_row(x, V, threads, &sc)) return -2;
    const double m = sc.max, floor_ = sc.min > m - TYPICAL_REACH ? sc.min : m - TYPICAL_REACH, width = m - floor_;
    if (!(width > 0.0)) { /* every finite logit is the maximum: all score 0, all kept */
        memcpy(out, x, (size_t)V * sizeof(float));
        return sc.finite;
    }
    const double k = (double)(TYPICAL_BINS - 1) / width;
    const int pieces = typical_pieces(V), hists = pieces * TYPICAL_LANES;
    double* hist = (double*)calloc((size_t)hists * TYPICAL_BINS + TYPICAL_BINS + 1, sizeof(double));
    if (!hist) return LMHEAD_NO_MEMORY;
    double ps[ROW_PIECES], pa[ROW_PIECES];
#pragma omp parallel for num_threads(piece_threads(pieces, threads)) schedule(static)
    for (int j = 0; j < pieces; j++)
        typical_sums(x, V * j / pieces, V * (j + 1) / pieces, m, k, ps + j, pa + j,
                     hist + (size_t)j * TYPICAL_LANES * TYPICAL_BINS);
    double s = 0.0, a = 0.0;
    for (int j = 0; j < pieces; j++) s += ps[j], a += pa[j];
    for (int j = 1; j < hists; j++)
        for (int b = 0; b < TYPICAL_BINS; b++) hist[b] += hist[(size_t)j * TYPICAL_BINS + b];
    double* prefix = hist + (size_t)hists * TYPICAL_BINS;
    prefix[0] = 0.0;
    for (int b = 0; b < TYPICAL_BINS; b++) prefix[b + 1] = prefix[b] + hist[b];
    const double c = m + a / s, target = mass * s;
    const double pad = 0x1p-40 * (width + fabs(m - c) + fabs(m) + 1.0);
    const double far = width + fabs(m - c) + 1.0; /* beyond it every bin is touched, every bin but the last held */
    int t0, t1, h0, h1;
    typical_span(m, c, k, pad, far, 0, &t0, &t1);
    if (typical_mass(prefix, t0, t1) < target) { /* the whole mass falls short by rounding: every token is kept */
        free(hist);
        memcpy(out, x, (size_t)V * sizeof(float));
        return sc.finite;
    }
    /* s_lo: the largest s whose touched bins hold less than the target (−1: none, the crossing may be at 0) */
    double s_lo = -1.0, lo = 0.0, hi = far;
    typical_span(m, c, k, pad, 0.0, 0, &t0, &t1);
    if (typical_mass(prefix, t0, t1) < target) {
        for (int it = 0; it < 80; it++) {
            const double mid = 0.5 * (lo + hi);
            typical_span(m, c, k, pad, mid, 0, &t0, &t1);
            if (typical_mass(prefix, t0, t1) < target) lo = mid; else hi = mid;
        }
        s_lo = lo;
    }
    /* s_hi: the least s whose wholly held bins reach the target; the last bin is never held wholly, so past `far`
     * the touched bins are the bound */
    double s_hi = far;
    typical_span(m, c, k, pad, far, 1, &h0, &h1);
    if (typical_mass(prefix, h0, h1) >= target) {
        lo = s_lo > 0.0 ? s_lo : 0.0, hi = far;
        for (int it = 0; it < 80; it++) {
            const double mid = 0.5 * (lo + hi);
            typical_span(m, c, k, pad, mid, 1, &h0, &h1);
            if (typical_mass(prefix, h0, h1) >= target) hi = mid; else lo = mid;
        }
        s_hi = hi;
    } else {
        s_hi = INFINITY;
    }
    /* the bins touched at s_hi, less those held wholly at s_lo; their tokens are walked from the held bins' mass */
    if (isfinite(s_hi)) typical_span(m, c, k, pad, s_hi, 0, &t0, &t1); else t0 = 0, t1 = TYPICAL_BINS - 1;
    if (s_lo >= 0.0) typical_span(m, c, k, pad, s_lo, 1, &h0, &h1); else h0 = 1, h1 = 0;
    double base = 0.0;
    for (int b = h0; b <= h1; b++) base += hist[b];
    free(hist);
    typical_cand* cand = NULL;
    const int64_t have = h1 < h0 ? typical_collect(x, V, m, c, k, t0, t1, 1, 0, &cand)
                                 : typical_collect(x, V, m, c, k, t0, h0 - 1, h1 + 1, t1, &cand);
    if (have < 0) return LMHEAD_NO_MEMORY;
    qsort(cand, (size_t)have, sizeof(typical_cand), typical_order);
    /* the crossing: the first token past s_lo at which the running mass reaches the target; a walk that falls
     * short by the rounding of the sums ends at its last token within s_hi */
    double run = base, limit = -1.0;
    for (int64_t j = 0; j < have; j++) {
        run += cand[j].e;
        if (cand[j].score <= s_hi) limit = cand[j].score;
        if (cand[j].score > s_lo && run >= target) {
            limit = cand[j].score;
            break;
        }
    }
    free(cand);
    if (limit < 0.0) limit = s_hi; /* nothing walked: a rounding tie at the edge of the grid */
    return typical_write(x, V, c, limit, out);
}
