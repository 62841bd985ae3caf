/* The lean decode step's element-wise work in one pass each — RMSNorm, the residual add with the norms around
 * it, the gated activation — and one layer's attention (rope, the cache write, masked grouped attention). A
 * decode step of a small model is ~90 norms and ~18 activations on vectors of a few hundred numbers; as torch
 * ops each costs tens of microseconds of dispatch (and OpenMP wake-ups for the reductions), here about one.
 * Same float32 math as transformers' modules (Gemma 3, Llama), summed in another order. Called one by one by
 * models/lean.py's step-by-step path and together by decode_kernels.c's whole step; built with the other
 * sources into one library by kernels/native.py.
 */
#include <float.h>
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#include "body_kernels.h"
#include "simd_math.h"

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

int lmhead_act_values(int* out, int cap) {
    const int values[] = {LMHEAD_ACT_GELU_TANH, LMHEAD_ACT_SILU, LMHEAD_ACT_SWIGLU_OAI};
    const int n = (int)(sizeof values / sizeof values[0]);
    for (int i = 0; i < n && i < cap; i++) out[i] = values[i];
    return n;
}

/* out [rows, F] from gate_up [rows, 2F] = [gate | up]: act(gate) · up with the tanh-approximated GELU
 * (LMHEAD_ACT_GELU_TANH: tanh(y) = 1 − 2/(e^{2y} + 1)); SiLU (x/(1 + e^{−x})); or gpt-oss's clamped
 * SwiGLU (transformers' GptOssExperts): (up' + 1) · gate' · σ(α · gate'), gate' = min(gate, limit), up' = up
 * clamped to [−limit, limit] (a NaN stays a NaN, as torch's clamp keeps it), σ(z) = 1/(1 + e^{−z}) */
static void gated_rows(const float* gate_up, float* out, int64_t rows, int64_t f, int act, float alpha,
                       float limit) {
    const float k0 = 0.7978845608028654f, k1 = 0.044715f;
    for (int64_t r = 0; r < rows; r++) {
        const float* g = gate_up + r * 2 * f;
        const float* u = g + f;
        float* o = out + r * f;
        int64_t i = 0;
#ifdef __AVX2__
        const __m256 one = _mm256_set1_ps(1.0f), two = _mm256_set1_ps(2.0f), half = _mm256_set1_ps(0.5f);
        const __m256 a = _mm256_set1_ps(alpha), hi = _mm256_set1_ps(limit), lo = _mm256_set1_ps(-limit);
        for (; i + 8 <= f; i += 8) {
            const __m256 x = _mm256_loadu_ps(g + i), up = _mm256_loadu_ps(u + i);
            if (act == LMHEAD_ACT_SWIGLU_OAI) {
                /* min/max return their second operand where either is NaN: the NaN is that operand */
                const __m256 gate = _mm256_min_ps(hi, x);
                const __m256 upc = _mm256_max_ps(lo, _mm256_min_ps(hi, up));
                const __m256 z = _mm256_mul_ps(gate, a);
                const __m256 sg = _mm256_div_ps(one, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), z))));
                _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_add_ps(upc, one), _mm256_mul_ps(gate, sg)));
                continue;
            }
            __m256 av;
            if (act == LMHEAD_ACT_GELU_TANH) {
                const __m256 y = _mm256_mul_ps(_mm256_set1_ps(k0),
                                               _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(k1), x),
                                                               _mm256_mul_ps(x, x), x));
                const __m256 t = _mm256_sub_ps(one, _mm256_div_ps(two, _mm256_add_ps(exp8(_mm256_add_ps(y, y)), one)));
                av = _mm256_mul_ps(_mm256_mul_ps(half, x), _mm256_add_ps(one, t));
            } else {
                av = _mm256_div_ps(x, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), x))));
            }
            _mm256_storeu_ps(o + i, _mm256_mul_ps(av, up));
        }
#endif
        for (; i < f; i++) {
            const float x = g[i];
            if (act == LMHEAD_ACT_SWIGLU_OAI) {
                const float gate = x > limit ? limit : x;
                const float up = u[i] > limit ? limit : (u[i] < -limit ? -limit : u[i]);
                const float sg = 1.0f / (1.0f + expf(-(gate * alpha)));
                o[i] = (up + 1.0f) * (gate * sg);
            } else {
                o[i] = act == LMHEAD_ACT_GELU_TANH ? 0.5f * x * (1.0f + tanhf(k0 * (x + k1 * x * x * x))) * u[i]
                                : x / (1.0f + expf(-x)) * u[i];
            }
        }
    }
}

void lmhead_gated(const float* gate_up, float* out, int64_t rows, int64_t f, int act) {
    gated_rows(gate_up, out, rows, f, act == LMHEAD_ACT_GELU_TANH ? LMHEAD_ACT_GELU_TANH : LMHEAD_ACT_SILU, 0.f, 0.f);
}

void lmhead_swiglu_oai(const float* gate_up, float* out, int64_t rows, int64_t f, float alpha, float limit) {
    gated_rows(gate_up, out, rows, f, LMHEAD_ACT_SWIGLU_OAI, alpha, limit);
}

/* the most queries an attention work item takes together (lmhead_attend) */
#define ATTEND_RUN 32

/* Row b's keys (values: base and blocks the values') of key head kh from column j: the address of column j, and
 * through *end the column where the run of columns one hd apart that holds it ends — the row's own cache, or
 * one of its shared blocks (lmhead_shared; off: the layer's part of a block). */
static inline const float* kv_run(const float* base, const float* const* blocks, const lmhead_shared* sh,
                                  int64_t b, int64_t kh, int64_t j, int64_t Hkv, int64_t hd, int64_t cap,
                                  int64_t off, int64_t* end) {
    *end = cap;
    if (sh != NULL && sh->len[b] > 0) {
        const int64_t s = sh->start[b];
        if (j >= s && j < s + sh->len[b]) {
            const int64_t k = (j - s) / sh->block, i = (j - s) % sh->block;
            *end = s + (k + 1) * sh->block < s + sh->len[b] ? s + (k + 1) * sh->block : s + sh->len[b];
            return blocks[b * sh->n + k] + off + (kh * sh->block + i) * hd;
        }
        if (j < s) *end = s;
    }
    return base + ((b * Hkv + kh) * cap + j) * hd;
}

/* a score as the query's own: times scaling, softcapped, plus its mask's column; its maximum so far in *m */
static inline float score_at(float sc, float scaling, float softcap, const float* mrow, int64_t j, float* m) {
    sc *= scaling;
    if (softcap > 0.f) sc = tanhf(sc / softcap) * softcap;
    if (mrow) sc += mrow[j];
    if (sc > *m) *m = sc;
    return sc;
}

#ifdef __AVX512F__
/* q·k for eight columns k, k + hd, ..., k + 7·hd (hd a multiple of 16) → their eight scores in order, each the bits of the one-column
 * dot below: a 16-lane chain holds its two 8-lane chains side by side (lanes 0–7 the first, 8–15 the second),
 * and the eight columns' sum8 are one network of the same additions, lane pairs (i, i + 4), then (0, 2) and
 * (1, 3), then (0, 1) — eight independent chains and a shared reduction in place of one column at a time */
static inline __m256 dot8(const float* q, const float* k, int64_t hd) {
    __m512 acc[8];
    for (int c = 0; c < 8; c++) acc[c] = _mm512_setzero_ps();
    for (int64_t i = 0; i < hd; i += 16) {
        const __m512 qv = _mm512_loadu_ps(q + i);
        for (int c = 0; c < 8; c++) acc[c] = _mm512_fmadd_ps(qv, _mm512_loadu_ps(k + c * hd + i), acc[c]);
    }
    __m512 v[4]; /* v[c]: columns 2c and 2c + 1, each its two chains added */
    for (int c = 0; c < 4; c++)
        v[c] = _mm512_add_ps(_mm512_shuffle_f32x4(acc[2 * c], acc[2 * c + 1], 0x44),
                             _mm512_shuffle_f32x4(acc[2 * c], acc[2 * c + 1], 0xEE));
    /* lanes i + lanes i + 4: a quarter per column, 0–3 and 4–7 */
    const __m512 w0 = _mm512_add_ps(_mm512_shuffle_f32x4(v[0], v[1], 0x88), _mm512_shuffle_f32x4(v[0], v[1], 0xDD));
    const __m512 w1 = _mm512_add_ps(_mm512_shuffle_f32x4(v[2], v[3], 0x88), _mm512_shuffle_f32x4(v[2], v[3], 0xDD));
    /* quarter c: (0 + 2, 1 + 3) of column c, then of column c + 4 */
    const __m512 x = _mm512_add_ps(_mm512_shuffle_ps(w0, w1, 0x44), _mm512_shuffle_ps(w0, w1, 0xEE));
    /* quarter c: lane 0 column c's 0 + 1, lane 1 column c + 4's */
    const __m512 y = _mm512_add_ps(_mm512_shuffle_ps(x, x, 0x88), _mm512_shuffle_ps(x, x, 0xDD));
    return _mm512_castps512_ps256(_mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 0, 0, 0, 0, 0, 0, 0, 0), y));
}
#endif

#ifdef __AVX512F__
/* the value sums of Q queries (1 or 2) over one run of keys j .. r−1 (their value rows from vr), into o[q] for the
 * columns up to hd's last multiple of 64: four chains of multiply-adds a query, each in key order, the value rows
 * read once for the Q queries; returns the columns done */
static inline __attribute__((always_inline)) int64_t values512(const int Q, float* const* o, const float* const* pg,
                                                               const float* w, const float* vr, int64_t j, int64_t r,
                                                               int64_t hd) {
    int64_t i0 = 0;
    for (; i0 + 64 <= hd; i0 += 64) {
        __m512 acc[2][4];
        for (int q = 0; q < Q; q++)
            for (int k = 0; k < 4; k++) acc[q][k] = _mm512_loadu_ps(o[q] + i0 + 16 * k);
        const float* vj = vr + i0;
        for (int64_t jj = j; jj < r; jj++, vj += hd) {
            __m512 pj[2];
            for (int q = 0; q < Q; q++) pj[q] = _mm512_set1_ps(pg[q][jj] * w[q]);
            for (int k = 0; k < 4; k++) {
                const __m512 vk = _mm512_loadu_ps(vj + 16 * k);
                for (int q = 0; q < Q; q++) acc[q][k] = _mm512_fmadd_ps(pj[q], vk, acc[q][k]);
            }
        }
        for (int q = 0; q < Q; q++)
            for (int k = 0; k < 4; k++) _mm512_storeu_ps(o[q] + i0 + 16 * k, acc[q][k]);
    }
    return i0;
}
#endif

/* Σ_j (p_j·w)·v_j over keys a .. e−1 of key head kh (row b) into o [hd], carried in o from call to call: one
 * chain of multiply-adds per column in key order (w: the query's 1/Σ) */
static void attend_values(float* o, const float* pg, float w, const float* values, const lmhead_shared* sh, int64_t b,
                          int64_t kh, int64_t a, int64_t e, int64_t Hkv, int64_t hd, int64_t cap, int64_t off) {
    for (int64_t j = a, r; j < e;) {
        const float* vr = kv_run(values, sh ? sh->values : NULL, sh, b, kh, j, Hkv, hd, cap, off, &r);
        r = r < e ? r : e;
        int64_t i0 = 0;
#ifdef __AVX512F__
        i0 = values512(1, &o, &pg, &w, vr, j, r, hd); /* the same sums, sixteen lanes a register */
#endif
#ifdef __AVX2__
        /* Σ_j p_j·v_j for 64 columns at a time in eight registers (summed in memory, each column's
         * chain went through a store and a load per key), carried in `o` from run to run */
        for (; i0 + 64 <= hd; i0 += 64) {
            __m256 acc[8];
            for (int k = 0; k < 8; k++) acc[k] = _mm256_loadu_ps(o + i0 + 8 * k);
            const float* vj = vr + i0;
            for (int64_t jj = j; jj < r; jj++, vj += hd) {
                const __m256 pj = _mm256_set1_ps(pg[jj] * w);
                for (int k = 0; k < 8; k++) acc[k] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vj + 8 * k), acc[k]);
            }
            for (int k = 0; k < 8; k++) _mm256_storeu_ps(o + i0 + 8 * k, acc[k]);
        }
#endif
        if (i0 < hd) {
            const float* vj = vr;
            for (int64_t jj = j; jj < r; jj++, vj += hd) {
                const float pj = pg[jj] * w;
#pragma omp simd
                for (int64_t i = i0; i < hd; i++) o[i] += pj * vj[i];
            }
        }
        j = r;
    }
}

#ifdef __AVX512F__
/* attend_values for two queries of row b over the same keys (hd a multiple of 64): each query's chains as alone,
 * the value rows read once for both */
static void attend_values2(float* o, const float* pg, float w, float* o2, const float* pg2, float w2,
                           const float* values, const lmhead_shared* sh, int64_t b, int64_t kh, int64_t a, int64_t e,
                           int64_t Hkv, int64_t hd, int64_t cap, int64_t off) {
    float* const os[2] = {o, o2};
    const float* const pgs[2] = {pg, pg2};
    const float ws[2] = {w, w2};
    for (int64_t j = a, r; j < e;) {
        const float* vr = kv_run(values, sh ? sh->values : NULL, sh, b, kh, j, Hkv, hd, cap, off, &r);
        r = r < e ? r : e;
        values512(2, os, pgs, ws, vr, j, r, hd);
        j = r;
    }
}
#endif

/* One layer's attention for T new tokens of B rows, from the q/k heads (normed, before rope) and v:
 *   rope (x·cos + rotate_half(x)·sin, rotate_half(x) = (−x₂, x₁), given as the swapped halves (x₂, x₁) times
 *   the signed sin (−sin₁, sin₂)) on q and k; k and v written at the cache's
 *   columns start..start+T; then per query head h (key head h / (H/H_kv)) and token t over the L = start+T
 *   filled columns: scores = q·k·scaling (softcap·tanh(scores/softcap) when softcap > 0) + mask[b,t,:],
 *   softmax (with the head's sink logit in its denominator where `sinks` is given: gpt-oss, as transformers'
 *   GptOss — the maximum over the scores and the sink subtracted, the sink's share going to no value),
 *   out = Σ p·v.
 * The arguments are lmhead_attend_args' (body_kernels.h: shapes and layouts). Returns 0, or -1 without memory. */
int lmhead_attend(const lmhead_attend_args* args) {
    const float *qk = args->qk, *v = args->v, *cos = args->cos, *sin = args->sin, *mask = args->mask;
    float *keys = args->keys, *values = args->values, *out = args->out;
    const int64_t qk_stride = args->qk_stride, v_stride = args->v_stride, B = args->B, T = args->T, H = args->H;
    const int64_t Hkv = args->Hkv, hd = args->hd, cap = args->cap, start = args->start;
    const float scaling = args->scaling, softcap = args->softcap;
    const float* sinks = args->sinks;
    const int threads = args->threads;
    const int64_t half = hd / 2, L = start + T, group = H / Hkv;
    float* q = (float*)malloc(sizeof(float) * (size_t)(B * T * H * hd));
    if (q == NULL) return LMHEAD_NO_MEMORY;
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
    /* per query row: lo, hi and whether its mask drops a column between them (the softmax's kept columns) */
    int64_t span_stack[3 * 64];
    int64_t* span = B * T <= 64 ? span_stack : (int64_t*)malloc(sizeof(int64_t) * 3 * (size_t)(B * T));
    if (span == NULL) {
        free(q);
        return LMHEAD_NO_MEMORY;
    }
    for (int64_t r = 0; r < B * T; r++) {
        int64_t lo = 0, hi = L, holes = 0;
        if (mask) {
            const float* mrow = mask + r * L;
            while (lo < L && mrow[lo] <= -FLT_MAX) lo++;
            while (hi > lo && mrow[hi - 1] <= -FLT_MAX) hi--;
            if (lo == L) lo = 0, hi = L; /* nothing kept: every column, as before (transformers' numbers) */
            for (int64_t j = lo; j < hi && !holes; j++) holes = mrow[j] <= -FLT_MAX;
        }
        span[3 * r] = lo;
        span[3 * r + 1] = hi;
        span[3 * r + 2] = holes;
    }
    /* Work items: (key head, a run of its queries). A key head's queries are taken in the order (row, token,
     * query head of the group), cut into runs of at most ATTEND_RUN as even as still share the threads evenly
     * (items a multiple of the threads, or at least four per thread: a decode step of Gemma 3, one key head and
     * four query heads, gives two items of two heads; SmolLM2's three key heads of three, six of one or two). A
     * run is taken key block by key block: each block of keys and values (≤ 16 KB) is read from memory once for
     * every query of the run that reads it and again from L1 for the others — the query heads that share a key
     * head (Gemma 3's 256-wide heads had read each value row four times, once per 64 columns: its attention at
     * 2,048 columns 5.9 → 5.1 ms a token), the tokens of a row's prefill piece, and the rows whose columns are
     * the same shared blocks (`lmhead_shared`: several requests' common prefix is read once for all their
     * queries, as one [queries, columns] product, instead of once per row from a copy of its own). Each query's
     * arithmetic is the same sequence whatever the run it is in (scores, maximum, exponentials and the value
     * sums in column order; a partial sum waits in `out` between blocks and runs), so the numbers are the same
     * bits alone, in a prefill piece, in a server round, with its columns shared or its own. */
    const int64_t heads_work = B * H * T, nq = B * T * group;
    /* both threads from a few columns on: after the products the keys and values come cold from L3 or memory,
     * and two threads read them at twice the rate (decode steps interleaved in one process measured both models'
     * attention faster on two threads than with a one-thread threshold; docs/decode.md) */
    int nt = (L * hd * heads_work > (int64_t)1 << 13) ? threads : 1;
    const lmhead_shared* sh = args->shared;
    /* a run spans rows only where rows share blocks: rows of their own read nothing in common, and a run's
     * scores are held for all its queries at once */
    const int64_t unit = sh ? nq : T * group, units = nq / unit;
    int64_t sub = unit < ATTEND_RUN ? unit : ATTEND_RUN;
    while (sub > 1) {
        const int64_t items = Hkv * units * ((unit + sub - 1) / sub);
        if (items % nt == 0 || items >= 4 * (int64_t)nt) break;
        sub--;
    }
    const int64_t per = (unit + sub - 1) / sub, work = Hkv * units * per; /* runs per key head and unit, items */
    const int64_t block = hd >= 1024 ? 4 : 4096 / hd; /* keys per block: ≤ 16 KB of keys, as many of values */
    const int64_t sh_off = sh ? args->layer * Hkv * sh->block * hd : 0;
    int failed = 0;
#pragma omp parallel num_threads(nt)
    {
        /* each thread's scores for its run of queries, on the stack up to 4,096 numbers (a malloc per head was a
         * third of the time) */
        float stack_p[4096], stack_c[4096];
        float* p = sub * L <= 4096 ? stack_p : (float*)malloc(sizeof(float) * (size_t)(sub * L));
        /* a query's kept scores side by side, where its mask drops columns inside its span */
        float* kept = L <= 4096 ? stack_c : (float*)malloc(sizeof(float) * (size_t)L);
        if (p == NULL || kept == NULL) failed = 1;
        /* items handed out one at a time: a causal prefill's later queries read more columns than its earlier
         * ones, and equal shares of the items in order left the first thread waiting for the second */
#pragma omp for schedule(dynamic, 1)
        for (int64_t w = 0; w < work; w++) {
            if (p == NULL || kept == NULL) continue;
            const int64_t kh = w / (units * per), u = w / per % units, c = w % per;
            const int64_t q0 = u * unit + c * unit / per, n = (c + 1) * unit / per - c * unit / per;
            float mx[ATTEND_RUN], inv[ATTEND_RUN];
            int64_t jmin = L, jmax = 0;
            for (int64_t g = 0; g < n; g++) {
                const int64_t bt = (q0 + g) / group;
                mx[g] = -INFINITY;
                if (span[3 * bt] < jmin) jmin = span[3 * bt];
                if (span[3 * bt + 1] > jmax) jmax = span[3 * bt + 1];
            }
            for (int64_t j0 = jmin; j0 < jmax; j0 += block) {
                const int64_t j1 = j0 + block < jmax ? j0 + block : jmax;
                for (int64_t g = 0; g < n; g++) {
                    const int64_t bt = (q0 + g) / group, b = bt / T, h = kh * group + (q0 + g) % group;
                    const int64_t a = span[3 * bt] > j0 ? span[3 * bt] : j0;
                    const int64_t e = span[3 * bt + 1] < j1 ? span[3 * bt + 1] : j1;
                    const float* qv = q + (bt * H + h) * hd;
                    const float* mrow = mask ? mask + bt * L : NULL;
                    float* pg = p + g * L;
                    float m = mx[g];
                    for (int64_t j = a, r; j < e;) {
                        const float* kj = kv_run(keys, sh ? sh->keys : NULL, sh, b, kh, j, Hkv, hd, cap, sh_off, &r);
                        r = r < e ? r : e;
#ifdef __AVX512F__
                        if (hd % 16 == 0 && softcap == 0.f) { /* score_at's steps eight lanes at a time */
                            __m256 mv = _mm256_set1_ps(m);
                            for (; j + 8 <= r; j += 8, kj += 8 * hd) {
                                __m256 sv = _mm256_mul_ps(dot8(qv, kj, hd), _mm256_set1_ps(scaling));
                                if (mrow) sv = _mm256_add_ps(sv, _mm256_loadu_ps(mrow + j));
                                _mm256_storeu_ps(pg + j, sv);
                                mv = _mm256_max_ps(sv, mv); /* a NaN score leaves the maximum, as `sc > m` */
                            }
                            float lanes[8];
                            _mm256_storeu_ps(lanes, mv);
                            for (int c = 0; c < 8; c++)
                                if (lanes[c] > m) m = lanes[c];
                        } else if (hd % 16 == 0)
                            for (; j + 8 <= r; j += 8, kj += 8 * hd) {
                                float s8[8];
                                _mm256_storeu_ps(s8, dot8(qv, kj, hd));
                                for (int c = 0; c < 8; c++) pg[j + c] = score_at(s8[c], scaling, softcap, mrow, j + c, &m);
                            }
#endif
                        for (; j < r; j++, kj += hd) {
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
                                /* a vectorised sum (8 lanes, then the lanes): one serial chain of hd adds took most
                                 * of the step */
#pragma omp simd reduction(+ : sc)
                                for (int64_t i = 0; i < hd; i++) sc += qv[i] * kj[i];
                            }
                            pg[j] = score_at(sc, scaling, softcap, mrow, j, &m);
                        }
                    }
                    mx[g] = m;
                }
            }
            for (int64_t g = 0; g < n; g++) {
                const int64_t bt = (q0 + g) / group, h = kh * group + (q0 + g) % group;
                const int64_t lo = span[3 * bt], hi = span[3 * bt + 1];
                const float* mrow = mask && span[3 * bt + 2] ? mask + bt * L : NULL; /* holes: kept columns */
                float* pg = p + g * L;
                /* the scores summed: the span's, or where the mask drops columns inside it (a row of a batch
                 * whose drafts were rejected, beside rows that kept theirs) its kept columns' side by side, so
                 * that the sum is the one the query makes without the dropped columns (alone) */
                float* es = pg + lo;
                int64_t nk = hi - lo;
                if (mrow) {
                    nk = 0;
                    for (int64_t j = lo; j < hi; j++)
                        if (mrow[j] > -FLT_MAX) kept[nk++] = pg[j];
                    if (nk > 0 && nk < hi - lo) es = kept;
                    else nk = hi - lo; /* none dropped, or none kept (every column: transformers' uniform row) */
                }
                /* the row's maximum, the sink's logit counted */
                const float mg = sinks && sinks[h] > mx[g] ? sinks[h] : mx[g];
                float total = 0.f;
                int64_t j = 0, scalar_from = 0;
#ifdef __AVX2__
                /* e^(s − max) eight at a time (exp8: within 2 ulp of expf; one libm call per score was most of the
                 * attention's time on 30-layer models); a masked score of −inf gives e^−87 clamped, so it is set
                 * to 0 exactly. Kept column i goes to lane i mod 8 and the last nk mod 8 are added one by one: the
                 * sum's order is the query's own kept columns', whatever the cache's width L, the other queries
                 * of the chunk or the rows of the batch (the same bits alone, in a prefill chunk, a draft's
                 * verification or a server round; a decode step over every column, lo = 0 and hi = L, sums as
                 * before) */
                if (mg > -INFINITY) {
                    const int64_t vend = nk & ~(int64_t)7;
                    scalar_from = vend;
                    const __m256 mm = _mm256_set1_ps(mg), ninf = _mm256_set1_ps(-INFINITY);
                    __m256 tv = _mm256_setzero_ps();
                    for (; j + 8 <= vend; j += 8) {
                        const __m256 sv = _mm256_loadu_ps(es + j);
                        const __m256 e = _mm256_andnot_ps(_mm256_cmp_ps(sv, ninf, _CMP_EQ_OQ),
                                                          exp8(_mm256_sub_ps(sv, mm)));
                        _mm256_storeu_ps(es + j, e);
                        tv = _mm256_add_ps(tv, e);
                    }
                    float lanes[8];
                    _mm256_storeu_ps(lanes, tv);
                    for (int l = 0; l < 8; l++) total += lanes[l];
                }
#endif
                for (j = scalar_from; j < nk; j++) {
                    es[j] = expf(es[j] - mg);
                    total += es[j];
                }
                if (sinks) total += expf(sinks[h] - mg);
                if (es == kept) /* back to their columns; a dropped column's weight is 0 */
                    for (int64_t c2 = lo, i = 0; c2 < hi; c2++) pg[c2] = mrow[c2] > -FLT_MAX ? kept[i++] : 0.f;
                inv[g] = 1.0f / total;
                float* o = out + (bt * H + h) * hd;
                for (int64_t i = 0; i < hd; i++) o[i] = 0.f;
            }
            for (int64_t j0 = jmin; j0 < jmax; j0 += block) {
                const int64_t j1 = j0 + block < jmax ? j0 + block : jmax;
                for (int64_t g = 0; g < n; g++) {
                    const int64_t bt = (q0 + g) / group, b = bt / T, h = kh * group + (q0 + g) % group;
                    const int64_t a = span[3 * bt] > j0 ? span[3 * bt] : j0;
                    const int64_t e = span[3 * bt + 1] < j1 ? span[3 * bt + 1] : j1;
                    const float* pg = p + g * L;
                    float* o = out + (bt * H + h) * hd;
#ifdef __AVX512F__
                    /* two queries of the same row at once over the keys both read: eight chains of multiply-adds
                     * where one query's sixty-four columns are four, each a key's latency long (each query's own
                     * chains, in its own key order: the same sums) */
                    if (g + 1 < n && hd % 64 == 0 && (q0 + g + 1) / group / T == b) {
                        const int64_t bt2 = (q0 + g + 1) / group, h2 = kh * group + (q0 + g + 1) % group;
                        const int64_t a2 = span[3 * bt2] > j0 ? span[3 * bt2] : j0;
                        const int64_t e2 = span[3 * bt2 + 1] < j1 ? span[3 * bt2 + 1] : j1;
                        const int64_t from = a > a2 ? a : a2, to = e < e2 ? e : e2;
                        if (from < to) {
                            const float* pg2 = p + (g + 1) * L;
                            float* o2 = out + (bt2 * H + h2) * hd;
                            attend_values(o, pg, inv[g], values, sh, b, kh, a, from, Hkv, hd, cap, sh_off);
                            attend_values(o2, pg2, inv[g + 1], values, sh, b, kh, a2, from, Hkv, hd, cap, sh_off);
                            attend_values2(o, pg, inv[g], o2, pg2, inv[g + 1], values, sh, b, kh, from, to, Hkv, hd,
                                           cap, sh_off);
                            attend_values(o, pg, inv[g], values, sh, b, kh, to, e, Hkv, hd, cap, sh_off);
                            attend_values(o2, pg2, inv[g + 1], values, sh, b, kh, to, e2, Hkv, hd, cap, sh_off);
                            g++;
                            continue;
                        }
                    }
#endif
                    attend_values(o, pg, inv[g], values, sh, b, kh, a, e, Hkv, hd, cap, sh_off);
                }
            }
        }
        if (p != NULL && p != stack_p) free(p);
        if (kept != NULL && kept != stack_c) free(kept);
    }
    if (span != span_stack) free(span);
    free(q);
    return failed ? -1 : 0;
}

/* sizeof(lmhead_attend_args), which the loader compares with its ctypes mirror before any call */
size_t lmhead_attend_args_size(void) { return sizeof(lmhead_attend_args); }
