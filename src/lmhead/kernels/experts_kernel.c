/* A mixture-of-experts MLP over the chosen experts of one layer in one call (models/moe.py's step, as llama.cpp's
 * mul_mat_id does it): for rows x [N, D], each with k chosen experts and their router weights,
 *
 *   pairs (row, slot) ──grouped by expert, ascending; within an expert its rows ascending──▶ per expert e:
 *       the rows that chose it xg [n_e, D] ──gate_up_e (lmhead_coded_matmul)──▶ [n_e, 2F] (+ the expert's bias)
 *       ──lmhead_gated (act), or gpt-oss's lmhead_swiglu_oai──▶ [n_e, F] ──down_e (lmhead_coded_matmul)──▶
 *       y [n_e, D] (+ the expert's bias)
 *   out [N, D]: per row, 0 + y_e·w_e + ... over its experts in ascending expert order (a product then a sum, each
 *       rounded once: the torch sum `out[rows] += y * w` of models/moe.py, bit for bit)
 *
 * Each expert's products are the coded kernel's over the same rows as the per-expert path's calls (the same M),
 * so every number is those calls' bits. Where there are many experts with few rows each (a decode step), the
 * experts are shared out among the threads, each computing whole experts single-threaded (a row's product does
 * not depend on the thread count): one parallel region a layer instead of two per expert.
 * The experts' buffers: expert e's codes, scales and offsets at e times a stride from their bases (a slice of
 * models/expert_layout.py's `ExpertMatrices`). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "body_kernels.h"
#include "experts_kernel.h"

#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off") /* y·w then + out, each rounded, as torch's two ops */
#endif

int lmhead_coded_matmul(const float* x, int64_t M, int64_t K, const int8_t* codes, const void* scale,
                        const void* offset, int64_t N, int64_t G, int flags, float* y, int threads);

int lmhead_experts_abi(void) { return 2; }
size_t lmhead_experts_mat_size(void) { return sizeof(lmhead_experts_mat); }

static inline int product(const lmhead_experts_mat* m, int64_t e, const float* x, int64_t rows, float* y,
                          int threads) {
    const char* s = (const char*)m->scale;
    const char* o = (const char*)m->offset;
    return lmhead_coded_matmul(x, rows, m->k, m->codes + e * m->codes_stride, s ? s + e * m->scale_stride : NULL,
                               o ? o + e * m->offset_stride : NULL, m->n, m->group, (int)m->flags, y, threads);
}

/* the experts' activation (`act`: lmhead_gated's code, or LMHEAD_ACT_SWIGLU_OAI with its α and limit) and
 * biases: gate_up [E, 2F] and down [E, D] float32, expert e's row e (NULL: none) */
typedef struct {
    const float* gate_up_bias;
    const float* down_bias;
    int act;
    float alpha, limit;
} experts_act;

/* y [rows, n] += b, each row: torch's `y + b` */
static inline void add_bias(float* y, const float* b, int64_t rows, int64_t n) {
    if (!b) return;
    for (int64_t i = 0; i < rows; i++)
        for (int64_t j = 0; j < n; j++) y[i * n + j] = y[i * n + j] + b[j];
}

/* expert e over its `rows` rows (their indices `which` into x): y [rows, D]; scratch holds rows·(D + 3F) floats */
static int one_expert(const lmhead_experts_mat* gu, const lmhead_experts_mat* dn, int64_t e, const float* x,
                      const int64_t* which, int64_t rows, const experts_act* a, float* y, float* scratch,
                      int threads) {
    const int64_t d = gu->k, f = dn->k;
    const float* xg = x + which[0] * d;
    if (rows > 1) { /* the rows that chose it, side by side (the per-expert path's x[rows]) */
        float* g = scratch + rows * 3 * f;
        for (int64_t i = 0; i < rows; i++) memcpy(g + i * d, x + which[i] * d, (size_t)d * sizeof(float));
        xg = g;
    }
    float* gate_up = scratch;             /* [rows, 2F] */
    float* hidden = scratch + rows * 2 * f; /* [rows, F] */
    int rc = product(gu, e, xg, rows, gate_up, threads);
    if (rc != 0) return rc;
    add_bias(gate_up, a->gate_up_bias ? a->gate_up_bias + e * 2 * f : NULL, rows, 2 * f);
    if (a->act == LMHEAD_ACT_SWIGLU_OAI)
        lmhead_swiglu_oai(gate_up, hidden, rows, f, a->alpha, a->limit);
    else
        lmhead_gated(gate_up, hidden, rows, f, a->act);
    rc = product(dn, e, hidden, rows, y, threads);
    if (rc != 0) return rc;
    add_bias(y, a->down_bias ? a->down_bias + e * d : NULL, rows, d);
    return 0;
}

/* o += y·w over d floats: the product rounded, then the sum (torch's `y * w` then `+`) */
static inline void add_weighted(float* o, const float* y, float w, int64_t d) {
    for (int64_t j = 0; j < d; j++) {
        const float t = y[j] * w;
        o[j] = o[j] + t;
    }
}

void lmhead_add_scaled_rows(float* out, const float* y, const float* w, int64_t rows, int64_t d) {
    for (int64_t r = 0; r < rows; r++) add_weighted(out + r * d, y + r * d, w[r], d);
}

/* x [N, D] float32; chosen [N, k] int64 expert ids (distinct within a row); weights [N, k] float32; gate_up: each
 * expert [2F, D] (gate rows first), down: [D, F]; act: lmhead_gated's code (0, 1) or 2, gpt-oss's clamped SwiGLU
 * with `alpha` and `limit`; gate_up_bias [E, 2F], down_bias [E, D] float32 or NULL; out [N, D]. 0, or -1 for
 * arguments the kernel does not take (an id out of range, a repeated id in a row, mismatched shapes, a product
 * refused). */
int lmhead_experts_mlp(const float* x, int64_t N, int64_t k, const int64_t* chosen, const float* weights,
                       const lmhead_experts_mat* gu, const lmhead_experts_mat* dn, int act, float alpha, float limit,
                       const float* gate_up_bias, const float* down_bias, float* out, int threads) {
    const int64_t E = gu->experts, d = gu->k, f = dn->k, P = N * k;
    if (N < 0 || k < 1 || E < 1 || dn->experts != E || gu->n != 2 * f || dn->n != d || act < 0 ||
        act > LMHEAD_ACT_SWIGLU_OAI)
        return -1;
    const experts_act acts = {gate_up_bias, down_bias, act, alpha, limit};
    if (threads < 1) threads = 1;
    for (int64_t p = 0; p < P; p++) {
        if (chosen[p] < 0 || chosen[p] >= E) return -1;
        for (int64_t j = p - p % k; j < p; j++)
            if (chosen[j] == chosen[p]) return -1;
    }
    if (N == 0) return 0;
    /* counting sort of the pairs by expert (stable: an expert's rows ascending) */
    int64_t* start = (int64_t*)calloc((size_t)(E + 1), sizeof(int64_t));
    int64_t* rows_of = (int64_t*)malloc((size_t)P * sizeof(int64_t));  /* the pairs' rows, grouped */
    int64_t* slot_of = (int64_t*)malloc((size_t)P * sizeof(int64_t));  /* pair p's place in the grouping */
    int64_t* groups = (int64_t*)malloc((size_t)P * sizeof(int64_t));   /* the chosen experts, ascending */
    float* weight_of = (float*)malloc((size_t)P * sizeof(float));     /* the pairs' weights, grouped */
    float* y = NULL; /* each pair's expert output, grouped (experts shared out among the threads) */
    int rc = 0;
    if (!start || !rows_of || !slot_of || !groups || !weight_of) {
        rc = LMHEAD_NO_MEMORY;
        goto done;
    }
    for (int64_t p = 0; p < P; p++) start[chosen[p] + 1]++;
    int64_t ngroups = 0, most = 0;
    for (int64_t e = 0; e < E; e++) {
        const int64_t c = start[e + 1];
        if (c) groups[ngroups++] = e;
        if (c > most) most = c;
        start[e + 1] += start[e];
    }
    {
        int64_t* fill = (int64_t*)malloc((size_t)E * sizeof(int64_t));
        if (!fill) {
            rc = LMHEAD_NO_MEMORY;
            goto done;
        }
        memcpy(fill, start, (size_t)E * sizeof(int64_t));
        for (int64_t p = 0; p < P; p++) {
            const int64_t at = fill[chosen[p]]++;
            rows_of[at] = p / k;
            weight_of[at] = weights[p];
            slot_of[p] = at;
        }
        free(fill);
    }
    const int64_t per = most * (d + 3 * f); /* one expert's scratch */
    const int by_expert = threads > 1 && ngroups >= 2 * threads && most <= 4;
    if (by_expert) {
        y = (float*)malloc((size_t)(P * d) * sizeof(float));
        float* scratch = (float*)malloc((size_t)(threads * per) * sizeof(float));
        if (!scratch || !y) {
            free(scratch);
            rc = LMHEAD_NO_MEMORY;
            goto done;
        }
        int worst = 0; /* the most telling failure: no memory (−3) before a refusal (−1) */
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1) reduction(min : worst)
        for (int64_t g = 0; g < ngroups; g++) {
#ifdef _OPENMP
            extern int omp_get_thread_num(void);
            float* mine = scratch + (int64_t)omp_get_thread_num() * per;
#else
            float* mine = scratch;
#endif
            const int64_t e = groups[g], a = start[e];
            const int rc_e = one_expert(gu, dn, e, x, rows_of + a, start[e + 1] - a, &acts, y + a * d, mine, 1);
            worst = rc_e < worst ? rc_e : worst;
        }
        free(scratch);
        rc = worst;
    } else { /* expert by expert, ascending, each added into its rows as it is done: each row's sum in ascending
              * expert order, from zero */
        float* scratch = (float*)malloc((size_t)(per + most * d) * sizeof(float));
        if (!scratch) {
            rc = LMHEAD_NO_MEMORY;
            goto done;
        }
        float* ye = scratch + per;
        memset(out, 0, (size_t)(N * d) * sizeof(float));
        for (int64_t g = 0; g < ngroups && rc == 0; g++) {
            const int64_t e = groups[g], a = start[e], n = start[e + 1] - a;
            rc = one_expert(gu, dn, e, x, rows_of + a, n, &acts, ye, scratch, threads);
            for (int64_t i = 0; i < n && rc == 0; i++)
                add_weighted(out + rows_of[a + i] * d, ye + i * d, weight_of[a + i], d);
        }
        free(scratch);
        goto done;
    }
    if (rc != 0) goto done;
    /* the weighted sum: each row's experts in ascending expert order, from zero */
#pragma omp parallel for num_threads(threads) schedule(static) if (N > 1)
    for (int64_t r = 0; r < N; r++) {
        const int64_t* c = chosen + r * k;
        float* o = out + r * d;
        for (int64_t j = 0; j < d; j++) o[j] = 0.0f;
        for (int64_t done_ = 0, last = -1; done_ < k; done_++) { /* the next expert above `last` (k is small) */
            int64_t best = -1;
            for (int64_t s = 0; s < k; s++)
                if (c[s] > last && (best < 0 || c[s] < c[best])) best = s;
            last = c[best];
            add_weighted(o, y + slot_of[r * k + best] * d, weights[r * k + best], d);
        }
    }
done:
    free(start);
    free(rows_of);
    free(slot_of);
    free(groups);
    free(weight_of);
    free(y);
    return rc;
}
