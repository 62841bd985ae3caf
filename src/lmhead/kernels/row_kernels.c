/* The decode loop's passes over whole rows of logits: each row's normaliser and the rank of its chosen token
 * (`row_scores`), a greedy row's argmax and normaliser (`greedy_rows`), a row's exact top-p set (`top_p_row`),
 * an unseeded row's draw after its cuts (`sample_row`) and the positions at or above a threshold (`select_ge`,
 * for `topk`). After a decode step has streamed the weights through the caches, the torch ops around a row
 * cost more than its arithmetic; here a row is one call, a wide one cut into pieces over the threads. Built
 * with the other sources into one library by kernels/native.py.
 */
#include <float.h>
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#include "kernel_results.h"
#include "row_pieces.h"
#include "simd_math.h"

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

/* The decode loop's score of each row's token (kernels/native.py `row_scores`): per row b of logits x [B, V],
 * lse[b] = log Σ_v e^x[b,v] (the raw log-probability of token t is x[b,t] − lse[b]) and greater[b] = the number
 * of logits > x[b, ids[b]] (its rank − 1). One pass for the maximum and the count, one for Σ e^(x − max); the
 * row is cut into pieces (score_pieces) that go to the threads (a 262,144-token row: one pass of a log-softmax was
 * 0.33 ms per row). Pieces are combined in double, in order. A NaN anywhere makes lse NaN, an
 * infinite maximum makes it that maximum (the caller then takes torch's path). */
void lmhead_row_scores(const float* x, int64_t B, int64_t V, const int64_t* ids, double* lse, int64_t* greater,
                       int threads) {
    if (threads < 1) threads = 1;
    const int64_t pieces = score_pieces(V), n = B * pieces;
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

/* A greedy row's choice and score (kernels/native.py `greedy_rows`): per row b of logits x [B, V], ids[b] = the
 * first position of the row's maximum (torch.argmax's tie rule) and lse[b] = log Σ_v e^x[b,v], so that its raw
 * log-probability is x[b, ids[b]] − lse[b] and its rank 1. One pass for the maximum, one for Σ e^(x − max); a
 * row is cut into pieces (score_pieces) that go to the threads, pieces combined in double, in order.
 * A NaN anywhere makes lse NaN, an infinite maximum makes it that maximum (the caller then takes torch's path). */
void lmhead_row_greedy(const float* x, int64_t B, int64_t V, int64_t* ids, double* lse, int threads) {
    if (threads < 1) threads = 1;
    const int64_t pieces = score_pieces(V), n = B * pieces;
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

/* An unseeded top-p-alone row's exact kept set (kernels/native.py `top_p_row`, for sampling/top_p.py's `top_p_parts`):
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

/* max(x)/T over the row, its pieces over the threads → 0, or -2 for a NaN or a maximum not finite (over T) */
static int row_top(const float* x, int64_t V, float T, int threads, float* top) {
    const int pieces = row_pieces(V);
    float pmax[ROW_PIECES];
    int pnan[ROW_PIECES];
#pragma omp parallel for num_threads(piece_threads(pieces, threads)) schedule(static)
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
    const int pieces = row_pieces(V);
    double psum[ROW_PIECES][TOP_P_SPANS + 1];
#pragma omp parallel for num_threads(piece_threads(pieces, threads)) schedule(static)
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

/* An unseeded sampled row's draw (kernels/native.py `sample_row`: the decode loop's plain sampled rows, whose
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
    if (heap == NULL) return LMHEAD_NO_MEMORY;
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
    if (c == NULL) return LMHEAD_NO_MEMORY;
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
            return LMHEAD_NO_MEMORY;
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
    if (c == NULL) return LMHEAD_NO_MEMORY;
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
            return LMHEAD_NO_MEMORY;
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
    const int pieces = row_pieces(V);
    double psum[ROW_PIECES];
#pragma omp parallel for num_threads(piece_threads(pieces, threads)) schedule(static)
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

/* A seeded row's top k (kernels/native.py `top_k_row`, for sampling/draw.py's `seeded_top_k_row`): x [V] logits at
 * temperature T → every token whose x/T (float32, as x / T in torch) is at least the k-th largest of them, sorted
 * by value descending, ties by id, into ids/vals (room for `cap`) → their count (≥ k), or -1 (more than SAMPLE_CAP
 * of them, k not in 1 … min(V − 1, SAMPLE_CAP), or a cap below SAMPLE_CAP), -2 (a NaN, a value +inf over T, fewer
 * than k finite), -3 (no memory). x / T is monotone, so the first k + 1 values are torch.topk(x, k + 1)'s over T:
 * the cut's own numbers, in one pass instead of a threshold pass and two sorts. */
int64_t lmhead_top_k_row(const float* x, int64_t V, float T, int64_t k, int64_t* ids, float* vals, int64_t cap) {
    if (k < 1 || k >= V || k > SAMPLE_CAP || cap < SAMPLE_CAP || !(T > 0.f)) return -1;
    return top_k_cut(x, V, T, k, 1.0, ids, vals);
}

/* The positions i of x [n] with x[i] ≥ thr, ascending, into out (at most cap of them) → their count; -1 when
 * there are more than cap, -2 when x holds a NaN (kernels/native.py `topk`: the candidates of a top-k). */
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

typedef struct {
    int64_t id, at; /* a kept candidate's token and its place in the caller's vals */
} lmhead_kept;

static int kept_by_id(const void* a, const void* b) {
    const lmhead_kept *x = (const lmhead_kept*)a, *y = (const lmhead_kept*)b;
    return x->id < y->id ? -1 : (x->id > y->id);
}

/* A seeded row's exponential race (sampling/race.py's `draw_part`): candidates vals [m] (x/T, -inf where the cut
 * dropped them) and their ids [m], in any order; noise [n] the Exp(1) draws of the n kept candidates in id order. Each
 * kept candidate's key is e^(v − max) / max(E, FLT_MIN) in double — p / E with p's common normaliser left out, which
 * moves no argmax — and the winner is the first largest key in id order. Returns the winner's place in vals, or -1
 * where n is not the count of finite candidates (or no memory). */
int64_t lmhead_race_row(const float* vals, const int64_t* ids, int64_t m, const float* noise, int64_t n) {
    if (m < 1 || n < 1 || n > m) return -1;
    lmhead_kept* c = (lmhead_kept*)malloc((size_t)n * sizeof(lmhead_kept));
    if (c == NULL) return -1;
    int64_t k = 0;
    float top = -INFINITY;
    for (int64_t j = 0; j < m && k <= n; j++) {
        if (!isfinite(vals[j])) continue; /* dropped */
        if (k < n) c[k].id = ids[j], c[k].at = j;
        k++;
        top = vals[j] > top ? vals[j] : top;
    }
    int64_t won = -1;
    if (k == n) {
        qsort(c, (size_t)n, sizeof(lmhead_kept), kept_by_id);
        double best = -1.0;
        for (int64_t j = 0; j < n; j++) {
            const double e = noise[j] > FLT_MIN ? (double)noise[j] : (double)FLT_MIN;
            const double key = exp((double)vals[c[j].at] - (double)top) / e;
            if (key > best) best = key, won = c[j].at;
        }
    }
    free(c);
    return won;
}
