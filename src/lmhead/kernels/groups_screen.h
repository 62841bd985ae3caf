/* The screen (coded_kernel.c: which logits can be in a row's top k) over the integer path by groups' layout
 * (groups_kernel.h): int8 codes stored as c + 128, sixteen weight rows a vector, float16 scales [N/16][K/32][16] —
 * a head of Q8_0 or Q5_0 codes laid out for its one-row product by groups.
 *
 *   x [M, K] ──screen_grids (the same int8 grid per group of 32, the same β)──▶ per block of sixteen weight rows
 *   and group g: S = Σᵢ cᵢ·qᵢ, an exact int32 for the sixteen rows at once (vpdpbusd of the stored c + 128 with q,
 *   from −128·Σq), ŷ += S · fl(s_g·d_g) ──▶ ŷ [M, N]
 *
 * Each group's term is S (exact, |S| ≤ 32·128·127 < 2²⁴) times one rounded product, added with one rounding: G + 1
 * roundings a term, inside γ's n = K + K/32 + 8, and Σ|terms| ≤ Σ|w||x̂| — the bound of coded_kernel.c's screen
 * holds as it is, so its candidates (lmhead_screen_select, layout-free) are chosen the same way. A candidate's
 * exact value is its block's g16_rows (or g16_plain for a row the integer path refuses): the operations the whole
 * product takes for that row, so the same bits.
 *
 * Included by coded_kernel.c after its screen, where both the screen's int8 grids and the path by groups are built. */
#ifndef LMHEAD_GROUPS_SCREEN_H
#define LMHEAD_GROUPS_SCREEN_H

/* ‖w_n‖₂ of every weight row, in double, rounded up to float (norm_up: lmhead_screen_norms' numbers over this
 * layout) */
int lmhead_screen_norms16(const uint8_t* codes, const uint16_t* scale, int64_t N, int64_t K, float* out,
                          int threads) {
    if (K % 32 != 0 || N % 16 != 0) return -1;
    const int64_t G = K / 32;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const int64_t b = n / 16, r = n % 16;
        double total = 0.0;
        for (int64_t g = 0; g < G; g++) {
            const uint8_t* u = codes + (b * G + g) * 512 + r * 4;
            int64_t sq = 0;
            for (int q = 0; q < 8; q++)
                for (int j = 0; j < 4; j++) {
                    const int64_t c = (int64_t)u[q * 64 + j] - 128;
                    sq += c * c;
                }
            const double s = (double)half_to_float(scale[(b * G + g) * 16 + r]);
            total += s * s * (double)sq;
        }
        out[n] = norm_up(total);
    }
    return 0;
}

/* ŷ [M, N] and β [M] for x [M, K] over this layout; the return values of lmhead_screen */
int lmhead_screen16(const float* x, int64_t M, int64_t K, const uint8_t* codes, const uint16_t* scale, int64_t N,
                    float* y, double* beta, int threads) {
    if (K % 32 != 0 || N % 16 != 0 || M < 1) return -1;
    const int64_t G = K / 32;
    const size_t pair_bytes = (size_t)M * (size_t)((G + 1) / 2) * sizeof(screen_pair);
    screen_pair* pairs = (screen_pair*)aligned_alloc(64, pair_bytes);
    int32_t* start = (int32_t*)malloc((size_t)(G * M) * sizeof(int32_t)); /* [G][M]: −128·Σq of the group */
    float* step = (float*)malloc((size_t)(G * M) * sizeof(float));         /* [G][M]: the group's grid step */
    int bad = pairs && start && step ? 0 : -2;
    if (!bad) {
        memset(pairs, 0, pair_bytes);
        bad = screen_grids(x, M, K, pairs, beta);
    }
    if (!bad) {
        for (int64_t g = 0; g < G; g++)
            for (int64_t m = 0; m < M; m++) {
                const screen_pair* p = pairs + (g / 2) * M + m;
                const int half = (int)(g % 2);
                int32_t s = 0;
                for (int j = 0; j < 8; j++) s += p->start[half * 8 + j];
                start[g * M + m] = s;
                step[g * M + m] = p->step[half * 8];
            }
        const int64_t blocks = N / 16;
#pragma omp parallel for num_threads(threads) schedule(static)
        for (int64_t b = 0; b < blocks; b++)
            for (int64_t m0 = 0; m0 < M; m0 += SCREEN_ROWS) {
                const int64_t Q = M - m0 < SCREEN_ROWS ? M - m0 : SCREEN_ROWS;
                __m512 acc[SCREEN_ROWS];
                for (int64_t m = 0; m < Q; m++) acc[m] = _mm512_setzero_ps();
                for (int64_t g = 0; g < G; g++) {
                    const uint8_t* u = codes + (b * G + g) * 512;
                    /* the block two ahead, a group's lines with each group: the hardware's prefetch alone left
                     * a large head's screen waiting on memory (bench_kernels.py section 7) */
                    if (m0 == 0 && b + 2 < blocks)
                        for (int q = 0; q < 8; q++) _mm_prefetch((const char*)u + 2 * G * 512 + q * 64, _MM_HINT_T0);
                    __m512i c[8];
                    for (int q = 0; q < 8; q++) c[q] = _mm512_loadu_si512(u + q * 64);
                    const __m512 s = g16_halves(scale + (b * G + g) * 16);
                    for (int64_t m = 0; m < Q; m++) {
                        const screen_pair* p = pairs + (g / 2) * M + m0 + m;
                        const int32_t* q4 = (const int32_t*)(p->q + (g % 2) * 32);
                        __m512i S = _mm512_set1_epi32(start[g * M + m0 + m]);
                        for (int q = 0; q < 8; q++) S = _mm512_dpbusd_epi32(S, c[q], _mm512_set1_epi32(q4[q]));
                        acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(S),
                                                 _mm512_mul_ps(s, _mm512_set1_ps(step[g * M + m0 + m])), acc[m]);
                    }
                }
                for (int64_t m = 0; m < Q; m++) _mm512_storeu_ps(y + (m0 + m) * N + b * 16, acc[m]);
            }
    }
    free(pairs);
    free(start);
    free(step);
    return bad;
}

/* y[m, ids[m, j]] = the exact value of each candidate (its block's g16_rows: the whole product's numbers for that
 * row), for rows with counts[m] ≥ 0; lmhead_screen_rescore's arguments over this layout. Returns 0, -1 for shapes
 * it does not take, -2 if it could not allocate. */
int lmhead_screen_rescore16(const float* x, int64_t M, int64_t K, const uint8_t* codes, const uint16_t* scale,
                            int64_t N, const int64_t* ids, const int64_t* counts, int64_t cap, float* y, int threads) {
    if (K % 32 != 0 || N % 16 != 0 || K < 256) return -1;
    const int64_t G = K / 32;
    const g16_rows_fn block = G16_ROWS_OF[G16_INT8][G16_M_HALF][1];
    int failed = 0;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
    for (int64_t m = 0; m < M; m++) {
        if (counts[m] <= 0) continue;
        /* the row's slices and their sums, as groups16_matmul makes them for a row alone */
        unsigned char* buf = malloc((size_t)(3 * K) + (size_t)G * (4 * sizeof(float) + 9 * sizeof(int32_t)));
        if (!buf) {
#pragma omp atomic write
            failed = 1;
            continue;
        }
        float* d2 = (float*)buf;
        float* vx = d2 + G;
        int32_t* t = (int32_t*)(vx + G * 3);
        int8_t* a = (int8_t*)(t + G * 9);
        const int ok = g16_slice(x + m * K, K, a, K, 32, d2, t, vx);
        float vals[16];
        int64_t last = -1;
        for (int64_t j = 0; j < counts[m]; j++) {
            const int64_t n = ids[m * cap + j], b = n / 16;
            if (b != last) {
                const uint8_t* cb = codes + b * G * 512;
                const uint16_t* sb = scale + b * G * 16;
                if (ok)
                    block(a, K, d2, t, vx, K, cb, sb, NULL, 16, -1, 128, 0, vals, 0);
                else
                    g16_plain(x + m * K, K, cb, sb, NULL, G16_HALF, 0, 0, -1, 128, 0, 16, vals);
                last = b;
            }
            y[m * N + n] = vals[n % 16];
        }
        free(buf);
    }
    return failed ? -2 : 0;
}

#endif
