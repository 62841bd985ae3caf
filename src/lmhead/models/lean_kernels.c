/* The lean decode step's element-wise work in one pass each: RMSNorm, the residual add with the norms around
 * it, the gated activation. A decode step of a small model is ~90 norms and ~18 activations on vectors of a
 * few hundred numbers; as torch ops each costs tens of microseconds of dispatch (and OpenMP wake-ups for the
 * reductions), here about one. Same float32 math as transformers' modules (Gemma 3, Llama), summed in
 * another order. Built with coded_kernel.c into one library by models/native.py.
 */
#include <float.h>
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

/* rows of `dim` numbers; weight row r % wrows; Gemma scales by (1 + w), Llama by w */
static inline void norm_row(const float* x, const float* w, float* y, int64_t dim, float eps, int plus_one) {
    float ss = 0.f;
#pragma omp simd reduction(+ : ss)
    for (int64_t i = 0; i < dim; i++) ss += x[i] * x[i];
    const float inv = 1.0f / sqrtf(ss / (float)dim + eps);
    if (plus_one)
        for (int64_t i = 0; i < dim; i++) y[i] = (x[i] * inv) * (1.0f + w[i]);
    else
        for (int64_t i = 0; i < dim; i++) y[i] = w[i] * (x[i] * inv);
}

void lmhead_rms_norm(const float* x, const float* w, float* y, int64_t rows, int64_t dim, int64_t wrows,
                     float eps, int plus_one) {
    for (int64_t r = 0; r < rows; r++) norm_row(x + r * dim, w + (r % wrows) * dim, y + r * dim, dim, eps, plus_one);
}

/* x_out = x + norm(a, w_post) (or x + a when w_post is NULL); h = norm(x_out, w_pre) */
void lmhead_add_norm(const float* x, const float* a, const float* w_post, const float* w_pre, float* x_out,
                     float* h, int64_t rows, int64_t dim, float eps, int plus_one) {
    for (int64_t r = 0; r < rows; r++) {
        const float* xr = x + r * dim;
        const float* ar = a + r * dim;
        float* xo = x_out + r * dim;
        if (w_post != NULL) {
            norm_row(ar, w_post, xo, dim, eps, plus_one);
            for (int64_t i = 0; i < dim; i++) xo[i] = xr[i] + xo[i];
        } else {
            for (int64_t i = 0; i < dim; i++) xo[i] = xr[i] + ar[i];
        }
        norm_row(xo, w_pre, h + r * dim, dim, eps, plus_one);
    }
}

#ifdef __AVX2__
#include <immintrin.h>

/* e^x for eight floats: x = n·ln2 + r (ln2 in two parts, |r| ≤ ln2/2), e^r by Cephes' degree-6 polynomial,
 * 2^n into the exponent; x clamped to [−87, 88] (finite, normal results). Within 2 ulp of expf: the activations
 * below were one libm call per element (a third of a millisecond per step on these models). */
static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

static inline float sum8(__m256 v) {
    __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
    return _mm_cvtss_f32(lo);
}
#endif

/* Σ_{i in [lo, hi)} e^(row[i] − m) for a finite m: float32 lanes (exp8), summed in double */
static double piece_exp_sum(const float* row, int64_t lo, int64_t hi, float m) {
    double sum = 0.0;
    int64_t i = lo;
#ifdef __AVX2__
    const __m256 mm = _mm256_set1_ps(m);
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
    for (; i + 16 <= hi; i += 16) {
        s0 = _mm256_add_ps(s0, exp8(_mm256_sub_ps(_mm256_loadu_ps(row + i), mm)));
        s1 = _mm256_add_ps(s1, exp8(_mm256_sub_ps(_mm256_loadu_ps(row + i + 8), mm)));
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, _mm256_add_ps(s0, s1));
    for (int l = 0; l < 8; l++) sum += lanes[l];
#endif
    for (; i < hi; i++) sum += expf(row[i] - m);
    return sum;
}

/* pass over x[lo, hi): the maximum and whether a NaN is there */
static void piece_max(const float* x, int64_t lo, int64_t hi, float* max_out, int* nan_out) {
    float m = -INFINITY;
    int nan = 0;
    int64_t i = lo;
#ifdef __AVX2__
    __m256 mv = _mm256_set1_ps(-INFINITY), un = _mm256_setzero_ps();
    for (; i + 8 <= hi; i += 8) {
        const __m256 t = _mm256_loadu_ps(x + i);
        mv = _mm256_max_ps(mv, t);
        un = _mm256_or_ps(un, _mm256_cmp_ps(t, t, _CMP_UNORD_Q));
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, mv);
    for (int l = 0; l < 8; l++) m = lanes[l] > m ? lanes[l] : m;
    nan = _mm256_movemask_ps(un) != 0;
#endif
    for (; i < hi; i++) {
        if (x[i] != x[i]) nan = 1;
        if (x[i] > m) m = x[i];
    }
    *max_out = m, *nan_out = nan;
}

/* a row's log Σ e^x from its pieces' maxima and Σ e^(x − piece max), given the row's maximum m (NaN for a NaN
 * in the row; an infinite maximum is the answer itself) */
static double pieces_lse(const float* pmax, const double* psum, int64_t pieces, float m, int nan) {
    if (nan) return NAN;
    if (!isfinite(m)) return m;
    double s = 0.0;
    for (int64_t p = 0; p < pieces; p++)
        if (pmax[p] > -INFINITY) s += psum[p] * exp((double)pmax[p] - (double)m);
    return (double)m + log(s);
}

/* The decode loop's score of each row's token (models/native.py `row_scores`): per row b of logits x [B, V],
 * lse[b] = log Σ_v e^x[b,v] (the raw log-probability of token t is x[b,t] − lse[b]) and greater[b] = the number
 * of logits > x[b, ids[b]] (its rank − 1). One pass for the maximum and the count, one for Σ e^(x − max); the
 * row is cut into pieces over the threads when there are fewer rows than threads (a 262,144-token row: one
 * pass of a log-softmax was 0.33 ms per row). Pieces are combined in double. A NaN anywhere makes lse NaN, an
 * infinite maximum makes it that maximum (the caller then takes torch's path). */
void lmhead_row_scores(const float* x, int64_t B, int64_t V, const int64_t* ids, double* lse, int64_t* greater,
                       int threads) {
    if (threads < 1) threads = 1;
    const int64_t pieces = B >= threads ? 1 : threads, n = B * pieces;
    float* pmax = (float*)malloc((size_t)n * sizeof(float));
    double* psum = (double*)malloc((size_t)n * sizeof(double));
    int64_t* pcnt = (int64_t*)malloc((size_t)n * sizeof(int64_t));
    int* pnan = (int*)malloc((size_t)n * sizeof(int));
    if (!pmax || !psum || !pcnt || !pnan) { /* no memory: NaN asks the caller for its own path */
        for (int64_t b = 0; b < B; b++) lse[b] = NAN, greater[b] = 0;
        free(pmax), free(psum), free(pcnt), free(pnan);
        return;
    }
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t j = 0; j < n; j++) {
        const int64_t b = j / pieces, p = j % pieces;
        const float* row = x + b * V;
        const float v = row[ids[b]];
        const int64_t lo = V * p / pieces, hi = V * (p + 1) / pieces;
        int64_t i = lo, cnt = 0;
        float m = -INFINITY;
        int nan = 0;
#ifdef __AVX2__
        __m256 mv = _mm256_set1_ps(-INFINITY), un = _mm256_setzero_ps();
        const __m256 vv = _mm256_set1_ps(v);
        for (; i + 8 <= hi; i += 8) {
            const __m256 t = _mm256_loadu_ps(row + i);
            mv = _mm256_max_ps(mv, t);
            un = _mm256_or_ps(un, _mm256_cmp_ps(t, t, _CMP_UNORD_Q));
            cnt += __builtin_popcount((unsigned)_mm256_movemask_ps(_mm256_cmp_ps(t, vv, _CMP_GT_OQ)));
        }
        float lanes[8];
        _mm256_storeu_ps(lanes, mv);
        for (int l = 0; l < 8; l++) m = lanes[l] > m ? lanes[l] : m;
        nan = _mm256_movemask_ps(un) != 0;
#endif
        for (; i < hi; i++) {
            const float t = row[i];
            if (t != t) nan = 1;
            if (t > m) m = t;
            cnt += t > v;
        }
        pmax[j] = m, psum[j] = isfinite(m) ? piece_exp_sum(row, lo, hi, m) : 0.0, pcnt[j] = cnt, pnan[j] = nan;
    }
    for (int64_t b = 0; b < B; b++) {
        float m = -INFINITY;
        int64_t cnt = 0;
        int nan = 0;
        for (int64_t p = 0; p < pieces; p++) {
            const int64_t j = b * pieces + p;
            m = pmax[j] > m ? pmax[j] : m;
            cnt += pcnt[j];
            nan |= pnan[j];
        }
        greater[b] = cnt;
        lse[b] = pieces_lse(pmax + b * pieces, psum + b * pieces, pieces, m, nan);
    }
    free(pmax), free(psum), free(pcnt), free(pnan);
}

/* A greedy row's choice and score (models/native.py `greedy_rows`): per row b of logits x [B, V], ids[b] = the
 * first position of the row's maximum (torch.argmax's tie rule) and lse[b] = log Σ_v e^x[b,v], so that its raw
 * log-probability is x[b, ids[b]] − lse[b] and its rank 1. One pass for the maximum, one for Σ e^(x − max); a
 * row is cut into pieces over the threads when there are fewer rows than threads, pieces combined in double.
 * A NaN anywhere makes lse NaN, an infinite maximum makes it that maximum (the caller then takes torch's path). */
void lmhead_row_greedy(const float* x, int64_t B, int64_t V, int64_t* ids, double* lse, int threads) {
    if (threads < 1) threads = 1;
    const int64_t pieces = B >= threads ? 1 : threads, n = B * pieces;
    float pmax_stack[64];
    double psum_stack[64];
    int64_t parg_stack[64];
    int pnan_stack[64];
    const int heap = n > 64;
    float* pmax = heap ? (float*)malloc((size_t)n * sizeof(float)) : pmax_stack;
    double* psum = heap ? (double*)malloc((size_t)n * sizeof(double)) : psum_stack;
    int64_t* parg = heap ? (int64_t*)malloc((size_t)n * sizeof(int64_t)) : parg_stack;
    int* pnan = heap ? (int*)malloc((size_t)n * sizeof(int)) : pnan_stack;
    if (!pmax || !psum || !parg || !pnan) {
        for (int64_t b = 0; b < B; b++) lse[b] = NAN, ids[b] = 0;
        if (heap) free(pmax), free(psum), free(parg), free(pnan);
        return;
    }
    /* one small region: a decode step's row of 49,152–262,144 logits is ~20–100 µs of work */
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t j = 0; j < n; j++) {
        const int64_t b = j / pieces, p = j % pieces;
        const float* row = x + b * V;
        const int64_t lo = V * p / pieces, hi = V * (p + 1) / pieces;
        float m;
        int nan;
        piece_max(row, lo, hi, &m, &nan);
        int64_t arg = lo;
        while (arg < hi && !(row[arg] == m)) arg++; /* the first position holding it */
        const double sum = isfinite(m) ? piece_exp_sum(row, lo, hi, m) : 0.0;
        pmax[j] = m, psum[j] = sum, parg[j] = arg < hi ? arg : lo, pnan[j] = nan;
    }
    for (int64_t b = 0; b < B; b++) {
        float m = -INFINITY;
        int64_t arg = -1;
        int nan = 0;
        for (int64_t p = 0; p < pieces; p++) { /* pieces in order: the first piece holding the maximum wins */
            const int64_t j = b * pieces + p;
            if (pmax[j] > m || (arg < 0 && pmax[j] == m)) m = pmax[j], arg = parg[j];
            nan |= pnan[j];
        }
        ids[b] = arg < 0 ? 0 : arg;
        lse[b] = pieces_lse(pmax + b * pieces, psum + b * pieces, pieces, m, nan);
    }
    if (heap) free(pmax), free(psum), free(parg), free(pnan);
}

/* An unseeded top-p-alone row's exact kept set (models/native.py `top_p_row`, for sampling/top_p.py's `top_p_parts`):
 * x [V] logits, temperature T, top_p p → the kept tokens' ids and x/T (float32 division, as x / T in torch),
 * sorted by x/T descending (ties by position) → their count, or -1 (more than `cap` candidates, or the mass is
 * too flat for the thresholds below: the caller's histogram path), -2 (a NaN, or a maximum that is not finite
 * or not finite over T: the caller's path raises the error).
 *
 * The rule is sampling/top_p.py's `top_p_sorted` (HF's): in descending order, a token is dropped when the mass of it
 * and of every token below it is ≤ 1 − p, a tie group taking the mass at its first position, the first token
 * always kept. Pass 1: the maximum. Pass 2: the normaliser Σ e^(x/T − max/T) (float32 lanes, summed in double)
 * and, in the same pass, the mass within d = 1, 2, 4, 8, 16 and 32 of max/T. The smallest d whose mass reaches
 * p (+ a margin) bounds the set: pass 3 collects the tokens within d, which are sorted, their masses taken in
 * double (e^ in double over the float32 x/T, as `top_p_parts`). The candidates are cut by a threshold, so every
 * other token (ties included) lies strictly below all of them: once their mass reaches p (+ margin), the mass
 * above any token outside is at least p and it is dropped — `top_p_parts`'s test of a window, which a top-k
 * must make against its smallest value because a top-k can split a tie. */
typedef struct {
    float v;
    int64_t i;
} lmhead_cand;

static int cand_desc(const void* a, const void* b) {
    const lmhead_cand *x = (const lmhead_cand*)a, *y = (const lmhead_cand*)b;
    if (x->v != y->v) return x->v > y->v ? -1 : 1;
    return x->i < y->i ? -1 : (x->i > y->i);
}

/* token j joins the candidates when x/T − top ≥ limit → 1, or 0 when there is no room for it */
static inline int take_candidate(const float* x, int64_t j, float T, float top, float limit, lmhead_cand* c,
                                 int64_t* n, int64_t cap) {
    const float xt = x[j] / T;
    if (!(xt - top >= limit)) return 1;
    if (*n == cap) return 0;
    c[*n].v = xt, c[*n].i = j, (*n)++;
    return 1;
}

#define TOP_P_SPANS 6
/* pass 2 over x[lo, hi): Σ e^(x/T − top) (float32 lanes over 1,024 numbers, then double) and the same sum over
 * the tokens within each span of top (sums[1 + k]) */
static void top_p_sums(const float* x, int64_t lo, int64_t hi, float T, float top, const float* spans, int nspans,
                       double* sums) {
    int64_t i = lo;
    for (int k = 0; k <= nspans; k++) sums[k] = 0.0;
#ifdef __AVX2__
    const __m256 tv = _mm256_set1_ps(T), topv = _mm256_set1_ps(top);
    __m256 sum = _mm256_setzero_ps(), w[8];
    for (int k = 0; k < nspans; k++) w[k] = _mm256_setzero_ps();
    int64_t block = 0;
    for (; i + 8 <= hi; i += 8) {
        const __m256 d = _mm256_sub_ps(_mm256_div_ps(_mm256_loadu_ps(x + i), tv), topv); /* x/T − top ≤ 0 */
        const __m256 e = exp8(d);
        sum = _mm256_add_ps(sum, e);
        for (int k = 0; k < nspans; k++)
            w[k] = _mm256_add_ps(w[k], _mm256_and_ps(e, _mm256_cmp_ps(d, _mm256_set1_ps(-spans[k]), _CMP_GE_OQ)));
        if (++block == 128) {
            sums[0] += sum8(sum);
            for (int k = 0; k < nspans; k++) sums[1 + k] += sum8(w[k]), w[k] = _mm256_setzero_ps();
            sum = _mm256_setzero_ps();
            block = 0;
        }
    }
    sums[0] += sum8(sum);
    for (int k = 0; k < nspans; k++) sums[1 + k] += sum8(w[k]);
#endif
    for (; i < hi; i++) {
        const float d = x[i] / T - top;
        const float e = expf(d);
        sums[0] += e;
        for (int k = 0; k < nspans; k++)
            if (d >= -spans[k]) sums[1 + k] += e;
    }
}

/* how many pieces a pass over a row of V logits is cut into over the threads (a row of a small vocabulary: one) */
static inline int row_pieces(int64_t V, int threads) {
    const int pieces = threads < 1 ? 1 : (threads > 8 ? 8 : threads);
    return V < 32768 ? 1 : pieces;
}

/* max(x)/T over the row, its pieces over the threads → 0, or -2 for a NaN or a maximum not finite (over T) */
static int row_top(const float* x, int64_t V, float T, int threads, float* top) {
    const int pieces = row_pieces(V, threads);
    float pmax[8];
    int pnan[8];
#pragma omp parallel for num_threads(pieces) schedule(static)
    for (int j = 0; j < pieces; j++) piece_max(x, V * j / pieces, V * (j + 1) / pieces, pmax + j, pnan + j);
    float m = -INFINITY;
    int nan = 0;
    for (int j = 0; j < pieces; j++) m = pmax[j] > m ? pmax[j] : m, nan |= pnan[j];
    *top = m / T;
    return nan || !isfinite(m) || !isfinite(*top) ? -2 : 0;
}

int64_t lmhead_top_p_row(const float* x, int64_t V, float T, double p, int64_t* ids, float* vals, int64_t cap,
                         int threads) {
    static const float spans[TOP_P_SPANS] = {1.f, 2.f, 4.f, 8.f, 16.f, 32.f};
    const double margin = 1e-5; /* sampling/top_p.py's _WINDOW_MARGIN */
    /* passes 1 and 2 in pieces over the threads for a wide row (a 262,144-token row: ~0.4 ms on one) */
    float top;
    if (row_top(x, V, T, threads, &top)) return -2;
    const int pieces = row_pieces(V, threads);
    double psum[8][TOP_P_SPANS + 1];
#pragma omp parallel for num_threads(pieces) schedule(static)
    for (int j = 0; j < pieces; j++)
        top_p_sums(x, V * j / pieces, V * (j + 1) / pieces, T, top, spans, TOP_P_SPANS, psum[j]);
    double norm = 0.0, within[TOP_P_SPANS] = {0};
    for (int j = 0; j < pieces; j++) {
        norm += psum[j][0];
        for (int k = 0; k < TOP_P_SPANS; k++) within[k] += psum[j][1 + k];
    }
    int64_t i;
    int span = -1;
    for (int k = 0; k < TOP_P_SPANS && span < 0; k++)
        if (within[k] / norm >= p + 2 * margin) span = k;
    if (span < 0) return -1;
    lmhead_cand* c = (lmhead_cand*)malloc((size_t)cap * sizeof(lmhead_cand));
    if (c == NULL) return -1;
    int64_t n = 0;
    const float limit = -spans[span];
    /* the candidates: x/T − top ≥ limit. x/T is monotone in x, so a token passes iff x ≥ the least logit that
     * does — found from a threshold on x a little below it, then each passer's own x/T (ties in x stay ties) */
    const float below = (top + limit) * T - fabsf((top + limit) * T) * 1e-5f - 1e-30f;
    i = 0;
#ifdef __AVX2__
    {
        const __m256 thr = _mm256_set1_ps(below);
        for (; i + 8 <= V; i += 8) {
            unsigned bits = (unsigned)_mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), thr, _CMP_GE_OQ));
            while (bits) {
                const int64_t j = i + __builtin_ctz(bits);
                bits &= bits - 1;
                if (!take_candidate(x, j, T, top, limit, c, &n, cap)) {
                    free(c);
                    return -1;
                }
            }
        }
    }
#endif
    for (; i < V; i++) {
        if (x[i] >= below && !take_candidate(x, i, T, top, limit, c, &n, cap)) {
            free(c);
            return -1;
        }
    }
    qsort(c, (size_t)n, sizeof(lmhead_cand), cand_desc);
    /* masses in double; the candidates' mass must settle the set (see above) */
    double* pr = (double*)malloc((size_t)n * sizeof(double));
    if (pr == NULL) {
        free(c);
        return -1;
    }
    double inside = 0.0;
    for (int64_t j = 0; j < n; j++) {
        pr[j] = exp((double)c[j].v - (double)top) / norm;
        inside += pr[j];
    }
    if (inside < p + margin) {
        free(c), free(pr);
        return -1;
    }
    double tail = 1.0 - inside; /* the mass outside the candidates */
    if (tail < 0.0) tail = 0.0;
    /* pr[j] becomes the mass of position j and of every position below it (summed from the bottom, as
     * `top_p_sorted`, so that small tails keep their precision), plus the mass outside */
    double suffix = 0.0;
    for (int64_t j = n - 1; j >= 0; j--) {
        suffix += pr[j];
        pr[j] = suffix + tail;
    }
    /* a tie group is kept or dropped whole, by the mass at its first position; the first token always stays */
    int64_t kept = 1, group = 0;
    for (int64_t j = 1; j < n; j++) {
        if (c[j].v != c[j - 1].v) group = j;
        if (pr[group] <= 1.0 - p) break;
        kept = j + 1;
    }
    for (int64_t j = 0; j < kept; j++) ids[j] = c[j].i, vals[j] = c[j].v;
    free(c), free(pr);
    return kept;
}

/* An unseeded sampled row's draw (models/native.py `sample_row`: the decode loop's plain sampled rows, whose
 * ~20 torch ops around the cut cost more than the cut after a step has streamed the weights through the caches):
 * x [V] logits, temperature T, top_k k (0: none), top_p p (1: none), min_p (0: none), u uniform in [0, 1) → *id
 * drawn by inverse
 * CDF from the processed distribution and *logprob its processed log-probability (double) → 0, or < 0 with
 * nothing drawn: -2 for a NaN or a maximum that is not finite (over T), -1 where the cut is not settled here (a
 * flat row's top-p set: lmhead_top_p_row declines; a top-k, or a min-p alone, keeping more than SAMPLE_CAP tokens),
 * -3 if it could not allocate — the caller's torch path then answers.
 *
 * The cut, on x/T in float32 as x / T in torch: top-k keeps every token ≥ the k-th largest (ties with it), sorted
 * by value descending, ties by id, and top-p then drops, as `top_p_sorted`, a token (a tie group by its first
 * position) whose mass with every token below it is ≤ 1 − p — masses over the top-k set, in double; top-p alone
 * is lmhead_top_p_row's kept set; min-p then keeps the tokens with e^(v − v_0) ≥ min_p (alone: the tokens within
 * log(min_p) of the maximum, by a threshold pass). Over the kept tokens q_j = e^(v_j − v_0) in double, the draw is the first j
 * whose running sum exceeds u·Σq. No cut: the whole row, e_i = e^(x_i/T − max/T) (the float32 exp of
 * top_p_sums), Σe from its pass (float32 lanes, double blocks), then a walk in id order summing e_i in double
 * until it exceeds u·Σe (a row whose walk falls short of Σe by the sums' rounding takes its last token of nonzero
 * mass). Either way token j is drawn with probability q_j / Σq, up to the rounding of those sums;
 * logprob = (v_j − v_0) − log(Σq), in double. */
#define SAMPLE_CAP 8192

/* draw from kept tokens sorted by value descending (vals = x/T): see above */
static void draw_sorted(const int64_t* ids, const float* vals, int64_t n, double u, int64_t* id, double* logprob) {
    double total = 0.0;
    for (int64_t j = 0; j < n; j++) total += exp((double)vals[j] - (double)vals[0]);
    const double target = u * total;
    double run = 0.0;
    int64_t j = 0;
    for (; j < n - 1; j++) {
        run += exp((double)vals[j] - (double)vals[0]);
        if (run > target) break;
    }
    *id = ids[j];
    *logprob = ((double)vals[j] - (double)vals[0]) - log(total);
}

/* the top k of x/T (ties with the k-th kept; k < V, k ≤ SAMPLE_CAP) then top-p, into ids/vals sorted descending
 * → their count, or -1 (more than SAMPLE_CAP tokens tie in), -2 (a NaN or +inf), -3 (no memory) */
/* offer v to the min-heap of the k largest (have of them so far) */
static inline void heap_offer(float* heap, int64_t* have, int64_t k, float v) {
    int64_t at;
    if (*have < k) { /* sift up */
        at = (*have)++;
        while (at > 0 && heap[(at - 1) / 2] > v) heap[at] = heap[(at - 1) / 2], at = (at - 1) / 2;
    } else { /* replace the root, sift down */
        if (!(v > heap[0])) return;
        at = 0;
        for (;;) {
            int64_t child = 2 * at + 1;
            if (child >= k) break;
            if (child + 1 < k && heap[child + 1] < heap[child]) child++;
            if (!(heap[child] < v)) break;
            heap[at] = heap[child], at = child;
        }
    }
    heap[at] = v;
}

/* every token with x/T ≥ floor, sorted by value descending (ties by id), into c (room for SAMPLE_CAP) → their
 * count, or -1 when there are more (eight logits compared at a time: most are below) */
static int64_t collect_at_least(const float* x, int64_t V, float T, float floor, lmhead_cand* c) {
    int64_t n = 0;
    for (int64_t j = 0; j < V; j++) {
#ifdef __AVX2__
        if (j + 8 <= V && !_mm256_movemask_ps(_mm256_cmp_ps(_mm256_div_ps(_mm256_loadu_ps(x + j), _mm256_set1_ps(T)),
                                                            _mm256_set1_ps(floor), _CMP_GE_OQ))) {
            j += 7; /* none of these eight */
            continue;
        }
#endif
        const float v = x[j] / T;
        if (v >= floor) {
            if (n == SAMPLE_CAP) return -1;
            c[n].v = v, c[n].i = j, n++;
        }
    }
    qsort(c, (size_t)n, sizeof(lmhead_cand), cand_desc);
    return n;
}

static int64_t top_k_cut(const float* x, int64_t V, float T, int64_t k, double p, int64_t* ids, float* vals) {
    float* heap = (float*)malloc((size_t)k * sizeof(float)); /* min-heap of the k largest so far */
    if (heap == NULL) return -3;
    int64_t have = 0, i = 0;
    int bad = 0;
#ifdef __AVX2__
    /* eight at a time once the heap is full: most tokens are below its least and only compared */
    const __m256 tv = _mm256_set1_ps(T), inf = _mm256_set1_ps(INFINITY);
    __m256 odd = _mm256_setzero_ps();
    for (; i + 8 <= V; i += 8) {
        const __m256 v = _mm256_div_ps(_mm256_loadu_ps(x + i), tv);
        odd = _mm256_or_ps(odd, _mm256_or_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q), _mm256_cmp_ps(v, inf, _CMP_EQ_OQ)));
        unsigned hit = have < k ? 0xFFu
                                : (unsigned)_mm256_movemask_ps(_mm256_cmp_ps(v, _mm256_set1_ps(heap[0]), _CMP_GT_OQ));
        if (hit) {
            float lanes[8];
            _mm256_storeu_ps(lanes, v);
            for (int l = 0; l < 8; l++)
                if (hit >> l & 1) heap_offer(heap, &have, k, lanes[l]);
        }
    }
    bad = _mm256_movemask_ps(odd) != 0;
#endif
    for (; i < V; i++) {
        const float v = x[i] / T;
        if (v != v || v == INFINITY) bad = 1;
        heap_offer(heap, &have, k, v);
    }
    if (bad) {
        free(heap);
        return -2;
    }
    const float kth = heap[0];
    free(heap);
    if (kth == -INFINITY) return -2; /* fewer than k finite tokens: torch's path */
    lmhead_cand* c = (lmhead_cand*)malloc((size_t)SAMPLE_CAP * sizeof(lmhead_cand));
    if (c == NULL) return -3;
    const int64_t n = collect_at_least(x, V, T, kth, c);
    if (n < 0) {
        free(c);
        return -1;
    }
    int64_t kept = n;
    if (p < 1.0) { /* `top_p_sorted` over the top-k set: masses from the bottom, a tie group by its first */
        double* below = (double*)malloc((size_t)n * sizeof(double));
        if (below == NULL) {
            free(c);
            return -3;
        }
        double total = 0.0;
        for (int64_t j = 0; j < n; j++) total += exp((double)c[j].v - (double)c[0].v);
        double suffix = 0.0;
        for (int64_t j = n - 1; j >= 0; j--) suffix += exp((double)c[j].v - (double)c[0].v), below[j] = suffix / total;
        kept = 1;
        int64_t group = 0;
        for (int64_t j = 1; j < n; j++) {
            if (c[j].v != c[j - 1].v) group = j;
            if (below[group] <= 1.0 - p) break;
            kept = j + 1;
        }
        free(below);
    }
    for (int64_t j = 0; j < kept; j++) ids[j] = c[j].i, vals[j] = c[j].v;
    free(c);
    return kept;
}

/* min-p on kept tokens sorted descending (vals = x/T): the first of them whose e^(v − v_0) < min_p ends them
 * (`_min_p_sorted`: p ≥ min_p · p_max, here in double) → how many stay (at least one) */
static int64_t min_p_prefix(const float* vals, int64_t n, double min_p) {
    int64_t kept = 1;
    while (kept < n && exp((double)vals[kept] - (double)vals[0]) >= min_p) kept++;
    return kept;
}

/* min-p alone over the whole row: every token within log(min_p) of max/T (a threshold on x/T, a little below the
 * exact test's), sorted, then min_p_prefix → the count, -1 (more than SAMPLE_CAP within the threshold), -2 (a NaN,
 * a maximum not finite over T), -3 (no memory) */
static int64_t min_p_cut(const float* x, int64_t V, float T, double min_p, int64_t* ids, float* vals, int threads) {
    float top;
    if (row_top(x, V, T, threads, &top)) return -2;
    const double floor_d = (double)top + log(min_p) - 1e-3 * (1.0 + fabs((double)top));
    if (!(floor_d > -1e30)) return -1; /* min_p too small to cut here: the whole row, torch's path */
    lmhead_cand* c = (lmhead_cand*)malloc((size_t)SAMPLE_CAP * sizeof(lmhead_cand));
    if (c == NULL) return -3;
    const int64_t n = collect_at_least(x, V, T, (float)floor_d, c);
    for (int64_t j = 0; j < n; j++) ids[j] = c[j].i, vals[j] = c[j].v;
    free(c);
    return n < 0 ? -1 : min_p_prefix(vals, n, min_p);
}

int lmhead_sample_row(const float* x, int64_t V, float T, int64_t top_k, double p, double min_p, double u,
                      int64_t* id, double* logprob, int threads) {
    if (V < 1 || !(T > 0.f) || !(u >= 0.0 && u < 1.0) || top_k < 0 || !(min_p >= 0.0 && min_p <= 1.0)) return -2;
    if ((top_k > 0 && top_k < V) || p < 1.0 || min_p > 0.0) {
        if (top_k > SAMPLE_CAP) return -1;
        int64_t* ids = (int64_t*)malloc(SAMPLE_CAP * sizeof(int64_t));
        float* vals = (float*)malloc(SAMPLE_CAP * sizeof(float));
        if (ids == NULL || vals == NULL) {
            free(ids), free(vals);
            return -3;
        }
        int64_t n;
        if (top_k > 0 && top_k < V)
            n = top_k_cut(x, V, T, top_k, p, ids, vals);
        else if (p < 1.0)
            n = lmhead_top_p_row(x, V, T, p, ids, vals, SAMPLE_CAP, threads);
        else
            n = min_p_cut(x, V, T, min_p, ids, vals, threads);
        if (n >= 1 && min_p > 0.0) n = min_p_prefix(vals, n, min_p);
        if (n >= 1) draw_sorted(ids, vals, n, u, id, logprob);
        free(ids), free(vals);
        return n >= 1 ? 0 : (n < 0 ? (int)n : -1);
    }
    float top;
    if (row_top(x, V, T, threads, &top)) return -2;
    const int pieces = row_pieces(V, threads);
    double psum[8];
#pragma omp parallel for num_threads(pieces) schedule(static)
    for (int j = 0; j < pieces; j++) top_p_sums(x, V * j / pieces, V * (j + 1) / pieces, T, top, NULL, 0, psum + j);
    double total = 0.0;
    for (int j = 0; j < pieces; j++) total += psum[j];
    const double target = u * total;
    double run = 0.0;
    int64_t i = 0, last = -1;
#ifdef __AVX2__
    const __m256 tv = _mm256_set1_ps(T), topv = _mm256_set1_ps(top);
    for (; i + 8 <= V; i += 8) {
        float e[8];
        _mm256_storeu_ps(e, exp8(_mm256_sub_ps(_mm256_div_ps(_mm256_loadu_ps(x + i), tv), topv)));
        double block = 0.0;
        for (int l = 0; l < 8; l++) block += e[l];
        if (run + block <= target) {
            run += block;
            for (int l = 7; l >= 0; l--)
                if (e[l] > 0.f) {
                    last = i + l;
                    break;
                }
            continue;
        }
        for (int l = 0; l < 8; l++) {
            run += e[l];
            if (e[l] > 0.f) last = i + l;
            if (run > target) {
                i += l;
                goto found;
            }
        }
    }
#endif
    for (; i < V; i++) {
        const float e = expf(x[i] / T - top);
        run += e;
        if (e > 0.f) last = i;
        if (run > target) goto found;
    }
    i = last; /* the walk fell short of the pass's sum by rounding: the last token of nonzero mass */
    if (i < 0) return -2;
found:
    *id = i;
    *logprob = ((double)(x[i] / T) - (double)top) - log(total);
    return 0;
}

/* The positions i of x [n] with x[i] ≥ thr, ascending, into out (at most cap of them) → their count; -1 when
 * there are more than cap, -2 when x holds a NaN (models/native.py `topk`: the candidates of a top-k). */
int64_t lmhead_select_ge(const float* x, int64_t n, float thr, int64_t* out, int64_t cap) {
    int64_t count = 0, i = 0;
    int nan = 0;
#ifdef __AVX2__
    const __m256 t = _mm256_set1_ps(thr);
    __m256 un = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) {
        const __m256 v = _mm256_loadu_ps(x + i);
        un = _mm256_or_ps(un, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        unsigned bits = (unsigned)_mm256_movemask_ps(_mm256_cmp_ps(v, t, _CMP_GE_OQ));
        if (!bits) continue;
        if (count + 8 > cap) { /* the last slots: one at a time */
            while (bits) {
                if (count == cap) return -1;
                out[count++] = i + __builtin_ctz(bits);
                bits &= bits - 1;
            }
            continue;
        }
        while (bits) {
            out[count++] = i + __builtin_ctz(bits);
            bits &= bits - 1;
        }
    }
    nan = _mm256_movemask_ps(un) != 0;
#endif
    for (; i < n; i++) {
        if (x[i] != x[i]) nan = 1;
        if (x[i] >= thr) {
            if (count == cap) return nan ? -2 : -1;
            out[count++] = i;
        }
    }
    return nan ? -2 : count;
}

/* out [rows, F] = act(gate) · up with gate_up [rows, 2F] = [gate | up]; act 0: tanh-approximated GELU
 * (Gemma's gelu_pytorch_tanh, tanh(y) = 1 − 2/(e^{2y} + 1)), 1: SiLU (Llama, x/(1 + e^{−x})) */
void lmhead_gated(const float* gate_up, float* out, int64_t rows, int64_t f, int act) {
    const float k0 = 0.7978845608028654f, k1 = 0.044715f;
    for (int64_t r = 0; r < rows; r++) {
        const float* g = gate_up + r * 2 * f;
        const float* u = g + f;
        float* o = out + r * f;
        int64_t i = 0;
#ifdef __AVX2__
        const __m256 one = _mm256_set1_ps(1.0f), two = _mm256_set1_ps(2.0f), half = _mm256_set1_ps(0.5f);
        for (; i + 8 <= f; i += 8) {
            const __m256 x = _mm256_loadu_ps(g + i), up = _mm256_loadu_ps(u + i);
            __m256 a;
            if (act == 0) {
                const __m256 y = _mm256_mul_ps(_mm256_set1_ps(k0),
                                               _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(k1), x),
                                                               _mm256_mul_ps(x, x), x));
                const __m256 t = _mm256_sub_ps(one, _mm256_div_ps(two, _mm256_add_ps(exp8(_mm256_add_ps(y, y)), one)));
                a = _mm256_mul_ps(_mm256_mul_ps(half, x), _mm256_add_ps(one, t));
            } else {
                a = _mm256_div_ps(x, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), x))));
            }
            _mm256_storeu_ps(o + i, _mm256_mul_ps(a, up));
        }
#endif
        for (; i < f; i++) {
            const float x = g[i];
            o[i] = act == 0 ? 0.5f * x * (1.0f + tanhf(k0 * (x + k1 * x * x * x))) * u[i]
                            : x / (1.0f + expf(-x)) * u[i];
        }
    }
}

/* One layer's attention for T new tokens of B rows, from the q/k heads (normed, before rope) and v:
 *   rope (x·cos + rotate_half(x)·sin, rotate_half(x) = (−x₂, x₁), given as the swapped halves (x₂, x₁) times
 *   the signed sin (−sin₁, sin₂)) on q and k; k and v written at the cache's
 *   columns start..start+T; then per query head h (key head h / (H/H_kv)) and token t over the L = start+T
 *   filled columns: scores = q·k·scaling (softcap·tanh(scores/softcap) when softcap > 0) + mask[b,t,:],
 *   softmax, out = Σ p·v.
 * qk: [B,T] tokens of (H + H_kv)·hd numbers at `qk_stride` apart; v: H_kv·hd numbers at `v_stride` apart;
 * cos, signed sin: [B,T,hd]; keys, values: the layer's cache [B,H_kv,cap,hd]; mask: [B,T,L] additive or NULL;
 * out: [B,T,H·hd]. Returns 0, or -1 without memory. */
int lmhead_attend(const float* qk, int64_t qk_stride, const float* v, int64_t v_stride, const float* cos,
                  const float* sin, float* keys, float* values, const float* mask, float* out, int64_t B,
                  int64_t T, int64_t H, int64_t Hkv, int64_t hd, int64_t cap, int64_t start, float scaling,
                  float softcap, int threads) {
    const int64_t half = hd / 2, L = start + T, group = H / Hkv;
    float* q = (float*)malloc(sizeof(float) * (size_t)(B * T * H * hd));
    if (q == NULL) return -1;
    for (int64_t b = 0; b < B; b++)
        for (int64_t t = 0; t < T; t++) {
            const float* src = qk + (b * T + t) * qk_stride;
            const float* c = cos + (b * T + t) * hd;
            const float* s = sin + (b * T + t) * hd;
            for (int64_t h = 0; h < H + Hkv; h++) {
                const float* x = src + h * hd;
                float* y = h < H ? q + ((b * T + t) * H + h) * hd
                                 : keys + ((b * Hkv + (h - H)) * cap + start + t) * hd;
                for (int64_t i = 0; i < half; i++) {
                    y[i] = x[i] * c[i] + x[i + half] * s[i];
                    y[i + half] = x[i + half] * c[i + half] + x[i] * s[i + half];
                }
            }
            const float* vs = v + (b * T + t) * v_stride;
            for (int64_t h = 0; h < Hkv; h++) {
                float* dst = values + ((b * Hkv + h) * cap + start + t) * hd;
                for (int64_t i = 0; i < hd; i++) dst[i] = vs[h * hd + i];
            }
        }
    /* each query's span of columns: from the first to the last one its mask keeps (all L without a mask, or
     * where it keeps none). A column outside is dropped (−FLT_MAX or −inf: torch.finfo's min, as transformers'
     * masks). Its e^(s − max) had been at most e^−87 ≈ 1.7e−38 (exp8's clamp) beside the kept maximum's 1 and
     * torch's softmax gives it exactly 0; the sum of the exponentials below keeps the whole row's lanes, so only
     * an output within ~1e−30 of zero can change. What it saves is the reading: a sliding-window layer (Gemma 3:
     * 15 of 18, window 512) attends over 512 columns instead of the whole context (its attention at 2,048
     * columns 13.2 → 5.9 ms a token, interleaved), and a verification's queries skip the columns after them. */
    int64_t span_stack[2 * 64];
    int64_t* span = B * T <= 64 ? span_stack : (int64_t*)malloc(sizeof(int64_t) * 2 * (size_t)(B * T));
    if (span == NULL) {
        free(q);
        return -1;
    }
    for (int64_t r = 0; r < B * T; r++) {
        int64_t lo = 0, hi = L;
        if (mask) {
            const float* mrow = mask + r * L;
            while (lo < L && mrow[lo] <= -FLT_MAX) lo++;
            while (hi > lo && mrow[hi - 1] <= -FLT_MAX) hi--;
            if (lo == L) lo = 0, hi = L; /* nothing kept: every column, as before (transformers' numbers) */
        }
        span[2 * r] = lo;
        span[2 * r + 1] = hi;
    }
    /* Work items: (row, token, key head, a set of `sub` of its query heads). The query heads that share a key
     * head are taken together, key block by key block: each block of keys and values (≤ 16 KB) is read from
     * memory once for the set and again from L1 for each head, instead of once per head from L3 or memory
     * (Gemma 3's 256-wide heads read each value row four times, once per 64 columns: its attention at 2,048
     * columns 5.9 → 5.1 ms a token with the sets, interleaved; SmolLM2's unchanged). Each
     * head's arithmetic is the same sequence as head by head (scores, maximum, exponentials and the value sums
     * in column order; a partial sum waits in `out` between blocks), so the numbers are unchanged. The sets are
     * as large as still share the threads evenly (items a multiple of the threads, or at least four per thread):
     * a decode step of Gemma 3 (one key head, four query heads) gives two items of two heads; SmolLM2's three
     * key heads of three give nine items of one (three items of three left one thread a third idle, 1.1x slower
     * at 1,024 columns where a head's keys and values still fit L2). */
    const int64_t per = B * T * Hkv, heads_work = B * H * T;
    /* both threads from a few columns on: after the products the keys and values come cold from L3 or memory,
     * and two threads read them at twice the rate (decode steps interleaved in one process measured both models'
     * attention faster on two threads than with a one-thread threshold; docs/decode.md) */
    int nt = (L * hd * heads_work > (int64_t)1 << 13) ? threads : 1;
    int64_t sub = group;
    while (sub > 1) {
        const int64_t items = per * (group / sub);
        if (sub <= 64 && (items % nt == 0 || items >= 4 * (int64_t)nt)) break; /* ≤ 64: the maxima below */
        do sub--;
        while (sub > 1 && group % sub != 0);
    }
    const int64_t sets = group / sub, work = per * sets;
    const int64_t block = hd >= 1024 ? 4 : 4096 / hd; /* keys per block: ≤ 16 KB of keys, as many of values */
    int failed = 0;
#pragma omp parallel num_threads(nt)
    {
        /* each thread's scores for its set of heads, on the stack up to 4,096 numbers (a malloc per head was a
         * third of the time) */
        float stack_p[4096];
        float* p = sub * L <= 4096 ? stack_p : (float*)malloc(sizeof(float) * (size_t)(sub * L));
        if (p == NULL) failed = 1;
#pragma omp for schedule(static)
        for (int64_t w = 0; w < work; w++) {
            if (p == NULL) continue;
            const int64_t b = w / (T * Hkv * sets), t = (w / (Hkv * sets)) % T, kh = (w / sets) % Hkv;
            const int64_t h0 = kh * group + (w % sets) * sub;
            const float* kb = keys + (b * Hkv + kh) * cap * hd;
            const float* vb = values + (b * Hkv + kh) * cap * hd;
            const float* mrow = mask ? mask + (b * T + t) * L : NULL;
            const int64_t lo = span[2 * (b * T + t)], hi = span[2 * (b * T + t) + 1];
            float mx[64], inv[64];
            for (int64_t g = 0; g < sub; g++) mx[g] = -INFINITY;
            for (int64_t j0 = lo; j0 < hi; j0 += block) {
                const int64_t j1 = j0 + block < hi ? j0 + block : hi;
                for (int64_t g = 0; g < sub; g++) {
                    const float* qv = q + ((b * T + t) * H + h0 + g) * hd;
                    float* pg = p + g * L;
                    float m = mx[g];
                    for (int64_t j = j0; j < j1; j++) {
                        const float* kj = kb + j * hd;
                        float sc = 0.f;
#ifdef __AVX2__
                        if (hd % 16 == 0) { /* two chains of multiply-adds, not one of hd/8: the dot's latency bound it */
                            __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
                            for (int64_t i = 0; i < hd; i += 16) {
                                a0 = _mm256_fmadd_ps(_mm256_loadu_ps(qv + i), _mm256_loadu_ps(kj + i), a0);
                                a1 = _mm256_fmadd_ps(_mm256_loadu_ps(qv + i + 8), _mm256_loadu_ps(kj + i + 8), a1);
                            }
                            sc = sum8(_mm256_add_ps(a0, a1));
                        } else
#endif
                        {
                            /* a vectorised sum (8 lanes, then the lanes): one serial chain of hd adds took most of
                             * the step */
#pragma omp simd reduction(+ : sc)
                            for (int64_t i = 0; i < hd; i++) sc += qv[i] * kj[i];
                        }
                        sc *= scaling;
                        if (softcap > 0.f) sc = tanhf(sc / softcap) * softcap;
                        if (mrow) sc += mrow[j];
                        pg[j] = sc;
                        if (sc > m) m = sc;
                    }
                    mx[g] = m;
                }
            }
            for (int64_t g = 0; g < sub; g++) {
                float* pg = p + g * L;
                float total = 0.f;
                int64_t j = lo, scalar_from = lo;
#ifdef __AVX2__
                /* e^(s − max) eight at a time (exp8: within 2 ulp of expf; one libm call per score was most of the
                 * attention's time on 30-layer models); a masked score of −inf gives e^−87 clamped, so it is set
                 * to 0 exactly. Column j goes to lane j mod 8 and the columns from L rounded down to 8 are added
                 * one by one, as over the whole row: the span's ends are filled with −inf (0) up to the eight
                 * around them, so that the sum's rounding is the whole row's */
                if (mx[g] > -INFINITY) {
                    const int64_t whole = L & ~(int64_t)7, up = (hi + 7) & ~(int64_t)7;
                    const int64_t vend = up < whole ? up : whole;
                    for (j = lo & ~(int64_t)7; j < lo; j++) pg[j] = -INFINITY;
                    for (j = hi; j < vend; j++) pg[j] = -INFINITY;
                    j = lo & ~(int64_t)7;
                    scalar_from = vend > lo ? vend : lo;
                    const __m256 mm = _mm256_set1_ps(mx[g]), ninf = _mm256_set1_ps(-INFINITY);
                    __m256 tv = _mm256_setzero_ps();
                    for (; j + 8 <= vend; j += 8) {
                        const __m256 sv = _mm256_loadu_ps(pg + j);
                        const __m256 e = _mm256_andnot_ps(_mm256_cmp_ps(sv, ninf, _CMP_EQ_OQ),
                                                          exp8(_mm256_sub_ps(sv, mm)));
                        _mm256_storeu_ps(pg + j, e);
                        tv = _mm256_add_ps(tv, e);
                    }
                    float lanes[8];
                    _mm256_storeu_ps(lanes, tv);
                    for (int l = 0; l < 8; l++) total += lanes[l];
                }
#endif
                for (j = scalar_from; j < hi; j++) {
                    pg[j] = expf(pg[j] - mx[g]);
                    total += pg[j];
                }
                inv[g] = 1.0f / total;
                float* o = out + (b * T + t) * H * hd + (h0 + g) * hd;
                for (int64_t i = 0; i < hd; i++) o[i] = 0.f;
            }
            for (int64_t j0 = lo; j0 < hi; j0 += block) {
                const int64_t j1 = j0 + block < hi ? j0 + block : hi;
                for (int64_t g = 0; g < sub; g++) {
                    const float* pg = p + g * L;
                    float* o = out + (b * T + t) * H * hd + (h0 + g) * hd;
                    int64_t i0 = 0;
#ifdef __AVX2__
                    /* Σ_j p_j·v_j for 64 columns at a time in eight registers (summed in memory, each column's
                     * chain went through a store and a load per key), carried in `o` from block to block */
                    for (; i0 + 64 <= hd; i0 += 64) {
                        __m256 acc[8];
                        for (int k = 0; k < 8; k++) acc[k] = _mm256_loadu_ps(o + i0 + 8 * k);
                        for (int64_t j = j0; j < j1; j++) {
                            const __m256 pj = _mm256_set1_ps(pg[j] * inv[g]);
                            const float* vj = vb + j * hd + i0;
                            for (int k = 0; k < 8; k++) acc[k] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vj + 8 * k), acc[k]);
                        }
                        for (int k = 0; k < 8; k++) _mm256_storeu_ps(o + i0 + 8 * k, acc[k]);
                    }
#endif
                    if (i0 < hd)
                        for (int64_t j = j0; j < j1; j++) {
                            const float pj = pg[j] * inv[g];
                            const float* vj = vb + j * hd;
#pragma omp simd
                            for (int64_t i = i0; i < hd; i++) o[i] += pj * vj[i];
                        }
                }
            }
        }
        if (p != NULL && p != stack_p) free(p);
    }
    if (span != span_stack) free(span);
    free(q);
    return failed ? -1 : 0;
}

/* --- the whole decode step: every block in one call ------------------------------------------------------ */

int lmhead_coded_matmul(const float* x, int64_t M, int64_t K, const int8_t* codes, const void* scale,
                        const void* offset, int64_t N, int64_t G, int flags, float* y, int threads);

typedef struct {
    const int8_t* codes;
    const void* scale;  /* float32, or float16 (flags) */
    const void* offset; /* NULL when the format has none */
    int64_t group, n, k, flags; /* flags: coded_kernel.c's LMHEAD_* (PACKED, HALF, ROWS4, F16, BF16) */
} lmhead_mat;

typedef struct {
    lmhead_mat qkv, o, gate_up, down;
    const float* qkv_bias;                                  /* NULL: none */
    const float *input_norm, *post_attn_norm, *pre_mlp_norm, *post_mlp_norm; /* post norms NULL: Llama */
    const float* qk_norm;                                   /* [H + H_kv, hd] or NULL */
    int64_t rope, sliding;                                  /* which cos/sin and which mask */
} lmhead_layer;

float lmhead_half(uint16_t h);

/* Row `n` of a coded matrix as float32: w[k] = code·scale + offset of its group, the same two float32 operations
 * (never fused into one: the function is built without contraction) as CodedLinear.dequantize, so the row is the
 * model's weight bit for bit. Reads every layout of coded_kernel.c: int8 or packed 4-bit codes (PACKED: each 64
 * codes 32 bytes, byte 4·l + b holding codes 16·b + l (low nibble) and 16·b + 8 + l (high), XOR 8), rows stored
 * in blocks of four (ROWS4: the block's rows 32 bytes each, unit by unit), float32 or float16 (HALF) scales; or
 * a row of the file's own float16 or bfloat16 weights (F16, BF16: flags 8, 16). */
__attribute__((optimize("fp-contract=off")))
static void coded_row(const lmhead_mat* m, int64_t n, float* out) {
    if (m->flags & (8 | 16)) { /* LMHEAD_F16 / LMHEAD_BF16: the row's 16-bit weights, converted exactly */
        const uint16_t* w = (const uint16_t*)m->codes + n * m->k;
        for (int64_t k = 0; k < m->k; k++) {
            union { uint32_t u; float f; } v;
            v.u = (uint32_t)w[k] << 16;
            out[k] = (m->flags & 16) ? v.f : lmhead_half(w[k]);
        }
        return;
    }
    const int packed = (m->flags & 1) != 0, half = (m->flags & 2) != 0, rows4 = (m->flags & 4) != 0;
    const int64_t K = m->k, R = packed ? K / 2 : K, ng = K / m->group;
    const uint8_t* base = (const uint8_t*)m->codes;
    for (int64_t k = 0; k < K; k++) {
        int64_t p = packed ? (k / 64) * 32 + ((k % 16) % 8) * 4 + (k % 64) / 16 : k;
        const uint8_t* byte = rows4 ? base + (n / 4) * 4 * R + (p / 32) * 128 + (n % 4) * 32 + p % 32
                                    : base + n * R + p;
        float code = packed ? (float)((((*byte) >> (4 * ((k % 16) / 8))) & 15) ^ 8) : (float)(int8_t)(*byte);
        const int64_t g = n * ng + k / m->group;
        float s = half ? lmhead_half(((const uint16_t*)m->scale)[g]) : ((const float*)m->scale)[g];
        float w = code * s;
        if (m->offset) w = w + (half ? lmhead_half(((const uint16_t*)m->offset)[g]) : ((const float*)m->offset)[g]);
        out[k] = w;
    }
}

/* out [rows, k] = rows ids[0..rows−1] of the coded matrix `m` (coded_row); −2 for an id outside [0, n). */
int lmhead_coded_rows(const lmhead_mat* m, const int64_t* ids, int64_t rows, float* out) {
    for (int64_t r = 0; r < rows; r++)
        if (ids[r] < 0 || ids[r] >= m->n) return -2;
    for (int64_t r = 0; r < rows; r++) coded_row(m, ids[r], out + r * m->k);
    return 0;
}

static int matmul(const float* x, int64_t rows, const lmhead_mat* m, float* y, int threads) {
    return lmhead_coded_matmul(x, rows, m->k, m->codes, m->scale, m->offset, m->n, m->group, (int)m->flags, y,
                               threads);
}

/* The blocks of models/lean.py's forward for `rows` = B·T new tokens whose embeddings are in x [rows, D]
 * (overwritten: the residual stream); h [rows, D] receives the hidden states after the final norm. The same
 * functions as the step-by-step path, composed here so that a step is one call. keys, values: layer i's cache
 * [B,H_kv,cap,hd] in one piece at i·layer_stride floats (B·H_kv·cap·hd for a whole cache; more for B rows of a
 * larger one: models/lean.py's StaticCache.view). scratch: at least
 * rows·(D + 2·(H + 2·H_kv)·hd + H·hd + 3·F) floats. Returns 0, or -1 (a kernel refused its arguments). */
int lmhead_step(const lmhead_layer* layers, int64_t n_layers, const float* final_norm, float* x, float* h,
                float* keys, float* values, int64_t layer_stride, const float* const* cos, const float* const* sin,
                const float* const* masks, float* scratch, int64_t B, int64_t T, int64_t D, int64_t H,
                int64_t Hkv, int64_t hd, int64_t F, int64_t cap, int64_t start, float eps, int plus_one, int act,
                float scaling, float softcap, int threads) {
    const int64_t rows = B * T, width = (H + 2 * Hkv) * hd, qk_width = (H + Hkv) * hd;
    float* qkv = scratch;
    float* qk = qkv + rows * width;
    float* att = qk + rows * qk_width;
    float* x2 = att + rows * H * hd;
    float* gu = x2 + rows * D;
    float* g = gu + rows * 2 * F;
    float* branch = qk; /* o and down outputs: qk is free by then and at least rows·D */
    if (qk_width < D) branch = g + rows * F;
    lmhead_rms_norm(x, layers[0].input_norm, h, rows, D, 1, eps, plus_one);
    for (int64_t i = 0; i < n_layers; i++) {
        const lmhead_layer* L = layers + i;
        if (matmul(h, rows, &L->qkv, qkv, threads)) return -1;
        if (L->qkv_bias)
            for (int64_t r = 0; r < rows; r++)
                for (int64_t j = 0; j < width; j++) qkv[r * width + j] += L->qkv_bias[j];
        const float* qk_in = qkv;
        int64_t qk_stride = width;
        if (L->qk_norm) {
            for (int64_t r = 0; r < rows; r++)
                lmhead_rms_norm(qkv + r * width, L->qk_norm, qk + r * qk_width, H + Hkv, hd, H + Hkv, eps, plus_one);
            qk_in = qk;
            qk_stride = qk_width;
        }
        if (lmhead_attend(qk_in, qk_stride, qkv + qk_width, width, cos[L->rope], sin[L->rope],
                          keys + i * layer_stride, values + i * layer_stride, masks[L->sliding], att, B, T, H, Hkv,
                          hd, cap, start, scaling, softcap, threads))
            return -1;
        if (matmul(att, rows, &L->o, branch, threads)) return -1;
        lmhead_add_norm(x, branch, L->post_attn_norm, L->pre_mlp_norm, x2, h, rows, D, eps, plus_one);
        if (matmul(h, rows, &L->gate_up, gu, threads)) return -1;
        lmhead_gated(gu, g, rows, F, act);
        if (matmul(g, rows, &L->down, branch, threads)) return -1;
        const float* next = i + 1 < n_layers ? layers[i + 1].input_norm : final_norm;
        lmhead_add_norm(x2, branch, L->post_mlp_norm, next, x, h, rows, D, eps, plus_one);
    }
    return 0;
}

/* --- a decode call from token ids: the step's bookkeeping in C too ----------------------------------------- */

/* lmhead_step for `B`·`T` new tokens given as ids, with what models/lean.py's forward does around it: the cache's
 * columns start..start+T−1 get their validity (new_valid [B,T], or all valid when NULL), rope positions and ids
 * (cache_valid [B,cap] bytes 0/1, cache_pos and cache_tokens [B,cap] int64); x = embed[ids] (times embed_scale
 * when has_scale: Gemma's √D, the same float32 product as the model's; from the rows of `embed_codes` instead
 * where that is not NULL: coded_row); cos/sin rows are taken from the tables
 * ([table_rows, hd] per rope kind, row = position) and the additive masks built per kind — a column is kept when
 * it is valid, at or before the query's column, and (sliding layers) less than `window` positions before the
 * query's position (masks for the layers' kinds in `sliding_kinds`: bit 0 full attention, bit 1 sliding);
 * dropped columns add −FLT_MAX (finite, as transformers' masks: a query with nothing to attend
 * to gives numbers), and a kind whose every column is kept gets no mask. After a step has streamed the weights
 * through the caches, each torch operation of this bookkeeping cost 50–300 µs (its code and data evicted from
 * the shared L3): ~1 ms of a 10 ms step. x, h [B·T, D]; work: at least B·T·(2·n_kinds·hd + 2·(start+T)) floats
 * beside the step's scratch; keys, values and layer_stride as lmhead_step's. Returns 0; −2 for an id outside
 * [0, vocab) or a position outside [0, table_rows)
 * (nothing written: the caller's general path raises or grows its tables); −1 as lmhead_step. */
int lmhead_decode(const lmhead_layer* layers, int64_t n_layers, const float* final_norm, const float* embed,
                  const lmhead_mat* embed_codes, int64_t vocab, float embed_scale, int has_scale, const int64_t* ids,
                  const int64_t* positions,
                  const uint8_t* new_valid, uint8_t* cache_valid, int64_t* cache_pos, int64_t* cache_tokens,
                  const float* const* cos_tables, const float* const* sin_tables, int64_t n_kinds,
                  int64_t table_rows, int sliding_kinds, int64_t window, float* x, float* h,
                  float* keys, float* values, int64_t layer_stride, float* work, float* scratch, int64_t B, int64_t T,
                  int64_t D, int64_t H, int64_t Hkv, int64_t hd, int64_t F, int64_t cap, int64_t start, float eps,
                  int plus_one, int act, float scaling, float softcap, int threads) {
    const int64_t rows = B * T, L = start + T;
    if (n_kinds < 1 || n_kinds > 8 || L > cap) return -2;
    for (int64_t r = 0; r < rows; r++)
        if (ids[r] < 0 || ids[r] >= vocab || positions[r] < 0 || positions[r] >= table_rows) return -2;
    for (int64_t b = 0; b < B; b++)
        for (int64_t t = 0; t < T; t++) {
            const int64_t c = b * cap + start + t, r = b * T + t;
            cache_valid[c] = new_valid ? (new_valid[r] != 0) : 1;
            cache_pos[c] = positions[r];
            cache_tokens[c] = ids[r];
        }
    for (int64_t r = 0; r < rows; r++) {
        float* xr = x + r * D;
        const float* e = embed + ids[r] * D;
        if (embed_codes) { /* the embedding read from its codes (a model loaded straight from its GGUF file) */
            coded_row(embed_codes, ids[r], xr);
            e = xr;
        }
        if (has_scale)
            for (int64_t i = 0; i < D; i++) xr[i] = e[i] * embed_scale;
        else
            for (int64_t i = 0; i < D; i++) xr[i] = e[i];
    }
    const float* cos[8];
    const float* sin[8];
    const float* masks[2] = {NULL, NULL};
    float* w = work;
    for (int64_t k = 0; k < n_kinds; k++) {
        float* c = w;
        float* s = w + rows * hd;
        w += 2 * rows * hd;
        for (int64_t r = 0; r < rows; r++)
            for (int64_t i = 0; i < hd; i++) {
                c[r * hd + i] = cos_tables[k][positions[r] * hd + i];
                s[r * hd + i] = sin_tables[k][positions[r] * hd + i];
            }
        cos[k] = c;
        sin[k] = s;
    }
    for (int sliding = 0; sliding < 2; sliding++) {
        if (!(sliding_kinds >> sliding & 1)) continue;
        float* m = w;
        int dropped = 0;
        for (int64_t b = 0; b < B; b++)
            for (int64_t t = 0; t < T; t++) {
                const int64_t qpos = cache_pos[b * cap + start + t];
                float* mr = m + (b * T + t) * L;
                for (int64_t j = 0; j < L; j++) {
                    int keep = cache_valid[b * cap + j] && j <= start + t;
                    if (keep && sliding) keep = qpos - cache_pos[b * cap + j] < window;
                    mr[j] = keep ? 0.f : -FLT_MAX;
                    dropped |= !keep;
                }
            }
        if (dropped) {
            masks[sliding] = m;
            w += rows * L;
        }
    }
    return lmhead_step(layers, n_layers, final_norm, x, h, keys, values, layer_stride, cos, sin, masks, scratch, B, T,
                       D, H, Hkv, hd, F, cap, start, eps, plus_one, act, scaling, softcap, threads);
}
