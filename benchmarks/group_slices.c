/* A candidate for the integer products (Q8_0's and Q4_1's codes here), measured by bench_group_slices.py beside the
 * library's float32 path and its integer path (slices per lane of activations): the query rows sliced per group of 32
 * activations — one power-of-two scale a group, x̂ = d₂·(2¹⁴·a₀ + 2⁷·a₁ + a₂), |a₀| ≤ 127, |a₁|, |a₂| ≤ 64 —
 * and each (query row, weight row, group) given its three slices' exact int32 sums, S₀, S₁, S₂, however they are
 * computed; a group's value is then one fixed sequence of float operations, v = fma(S₀, 2¹⁴, float(2⁷·S₁ + S₂)),
 * and a row's sum fma(v, scale·d₂, acc) over its groups in order. Integer sums are exact in any order and on any
 * unit, so the sequence gives the same bits from
 *   - gs_product(..., amx = 0): vpdpbusd over codes laid out sixteen weight rows a vector (each lane a row's four
 *     codes: no horizontal sums), the activations' slices broadcast four bytes at a time (as unsigned bytes, a + 128,
 *     the codes' sums times 128 subtracted), four blocks of sixteen rows at once;
 *   - gs_product(..., amx = 1): AMX's tdpbssd (where the kernel grants the tiles: gs_amx) over sixteen query rows by
 *     sixteen weight rows a tile, a group of 32 bytes a product, for the whole blocks of sixteen query rows (the rest
 *     as above).
 * Packed 4-bit codes with offsets (Q4_1: w = d·c + m, c in 0..15; Q4_0 is m = −8·d) take the same slices: a group's
 * Σ c·x̂ from the codes as unsigned bytes (vpdpbusd's, or tdpbsud's with the slices signed), its Σ x̂ from the slices'
 * own sums (one per query row and group), and the row's sum fma(v_c, d·d₂, fma(m, Σx̂, acc)) (gs4_product).
 * Not the library's code: a measurement of what a prefill and a decode step would gain (docs/decode.md).
 *
 * Layouts: int8 codes (gs_layout): w16 [N/16][K/32][8][16][4] int8 codes; corr [N/16][K/32][16] int32 (128·Σ codes
 * of a row's group); s16 [N/16][K/32][16] float32 scales. Packed (gs4_layout): w4 [N/16][K/32][4][64] bytes, byte
 * 4r + j of vector p holding the codes of steps 2p (low nibble) and 2p + 1 (high) of row r; d16 and m16 as s16.
 * N a multiple of 64, K of 32. */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

void gs_layout(const int8_t* codes, const float* scales, int64_t N, int64_t K, int8_t* w16, int32_t* corr,
               float* s16) {
    const int64_t G = K / 32;
    for (int64_t n = 0; n < N; n++)
        for (int64_t g = 0; g < G; g++) {
            const int64_t bg = (n / 16) * G + g;
            int32_t sum = 0;
            for (int k = 0; k < 32; k++) {
                const int8_t c = codes[n * K + g * 32 + k];
                sum += c;
                w16[bg * 512 + (k / 4) * 64 + (n % 16) * 4 + k % 4] = c;
            }
            corr[bg * 16 + n % 16] = 128 * sum;
            s16[bg * 16 + n % 16] = scales[n * G + g];
        }
}

void gs4_layout(const int8_t* codes, const float* scales, const float* mins, int64_t N, int64_t K, uint8_t* w4,
                float* d16, float* m16) {
    const int64_t G = K / 32;
    for (int64_t n = 0; n < N; n++)
        for (int64_t g = 0; g < G; g++) {
            const int64_t bg = (n / 16) * G + g;
            for (int k = 0; k < 32; k++) {
                const int q = k / 4, j = k % 4;
                uint8_t* byte = w4 + bg * 256 + (q / 2) * 64 + (n % 16) * 4 + j;
                const uint8_t c = (uint8_t)codes[n * K + g * 32 + k] & 15;
                *byte = q % 2 ? (uint8_t)((*byte & 15) | (c << 4)) : (uint8_t)((*byte & 0xF0) | c);
            }
            d16[bg * 16 + n % 16] = scales[n * G + g];
            m16[bg * 16 + n % 16] = mins[n * G + g];
        }
}

/* each query row's groups: a (int8 slices, [3][M][K]), u (a + 128 as unsigned bytes, [3][M][K]), d2 [M][G] */
static void slice_rows(const float* x, int64_t M, int64_t K, int8_t* a, uint8_t* u, float* d2) {
    const int64_t G = K / 32, plane = M * K;
    const __m512 abs_mask = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
    for (int64_t m = 0; m < M; m++)
        for (int64_t g = 0; g < G; g++) {
            const float* xg = x + m * K + g * 32;
            const __m512 x0 = _mm512_loadu_ps(xg), x1 = _mm512_loadu_ps(xg + 16);
            const float mx = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_and_ps(x0, abs_mask), _mm512_and_ps(x1, abs_mask)));
            int e = 0;
            if (mx > 0) frexpf(mx / 127.f, &e);
            const float d0 = mx > 0 ? ldexpf(1.f, e) : 1.f; /* 2^e ≥ mx/127 */
            d2[m * G + g] = ldexpf(d0, -14);
            const __m512 inv = _mm512_set1_ps(1.f / d0), step = _mm512_set1_ps(128.f);
            for (int h = 0; h < 2; h++) {
                const __m512 r = _mm512_mul_ps(h ? x1 : x0, inv); /* exact: a power of two */
                const __m512 a0 = _mm512_roundscale_ps(r, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
                const __m512 r1 = _mm512_mul_ps(_mm512_sub_ps(r, a0), step); /* exact, |r1| ≤ 64 */
                const __m512 a1 = _mm512_roundscale_ps(r1, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
                const __m512 r2 = _mm512_mul_ps(_mm512_sub_ps(r1, a1), step);
                const __m512 a2 = _mm512_roundscale_ps(r2, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
                const __m512 sl[3] = {a0, a1, a2};
                for (int s = 0; s < 3; s++) {
                    const __m512i v = _mm512_cvtps_epi32(sl[s]);
                    _mm_storeu_si128((__m128i*)(a + s * plane + m * K + g * 32 + 16 * h), _mm512_cvtepi32_epi8(v));
                    _mm_storeu_si128((__m128i*)(u + s * plane + m * K + g * 32 + 16 * h),
                                     _mm512_cvtepi32_epi8(_mm512_add_epi32(v, _mm512_set1_epi32(128))));
                }
            }
        }
}

static inline __m512 combine(__m512i s0, __m512i s1, __m512i s2) {
    const __m512i t = _mm512_add_epi32(_mm512_slli_epi32(s1, 7), s2);
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(s0), _mm512_set1_ps(16384.f), _mm512_cvtepi32_ps(t));
}

enum { NB = 4 }; /* blocks of sixteen weight rows at once: independent chains, the broadcasts shared */

static void vnni_row(const uint8_t* u, int64_t plane, const float* d2, int64_t K, const int8_t* w16,
                     const int32_t* corr, const float* s16, int64_t b0, float* y) {
    const int64_t G = K / 32;
    const uint32_t* u0 = (const uint32_t*)u;
    const uint32_t* u1 = (const uint32_t*)(u + plane);
    const uint32_t* u2 = (const uint32_t*)(u + 2 * plane);
    __m512 acc[NB];
    for (int j = 0; j < NB; j++) acc[j] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        __m512i r[NB][3];
        for (int j = 0; j < NB; j++) r[j][0] = r[j][1] = r[j][2] = _mm512_setzero_si512();
        for (int q = 0; q < 8; q++) {
            const __m512i a0 = _mm512_set1_epi32((int)u0[g * 8 + q]), a1 = _mm512_set1_epi32((int)u1[g * 8 + q]);
            const __m512i a2 = _mm512_set1_epi32((int)u2[g * 8 + q]);
            for (int j = 0; j < NB; j++) {
                const __m512i w = _mm512_loadu_si512(w16 + ((b0 + j) * G + g) * 512 + q * 64);
                r[j][0] = _mm512_dpbusd_epi32(r[j][0], a0, w);
                r[j][1] = _mm512_dpbusd_epi32(r[j][1], a1, w);
                r[j][2] = _mm512_dpbusd_epi32(r[j][2], a2, w);
            }
        }
        const __m512 d = _mm512_set1_ps(d2[g]);
        for (int j = 0; j < NB; j++) {
            const int64_t bg = (b0 + j) * G + g;
            const __m512i c = _mm512_loadu_si512(corr + bg * 16);
            const __m512 v = combine(_mm512_sub_epi32(r[j][0], c), _mm512_sub_epi32(r[j][1], c),
                                     _mm512_sub_epi32(r[j][2], c));
            acc[j] = _mm512_fmadd_ps(v, _mm512_mul_ps(_mm512_loadu_ps(s16 + bg * 16), d), acc[j]);
        }
    }
    for (int j = 0; j < NB; j++) _mm512_storeu_ps(y + (b0 + j) * 16, acc[j]);
}

#ifdef __AMX_INT8__
typedef struct {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

static void amx_configure(void) {
    tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    for (int t = 0; t < 3; t++) cfg.rows[t] = 16, cfg.colsb[t] = 64;     /* the three slices' sums: 16 x 16 int32 */
    for (int t = 3; t < 6; t++) cfg.rows[t] = 16, cfg.colsb[t] = 32;     /* the slices: 16 query rows x 32 bytes */
    cfg.rows[6] = 8, cfg.colsb[6] = 64;                                  /* a group's codes: 8 x (16 rows x 4) */
    _tile_loadconfig(&cfg);
}

/* query rows m0 .. m0+15 against weight rows 16b .. 16b+15 */
static void amx_tile(const int8_t* a, int64_t plane, const float* d2, int64_t m0, int64_t K, const int8_t* w16,
                     const float* s16, int64_t b, float* y, int64_t N) {
    const int64_t G = K / 32;
    int32_t S[3][256] __attribute__((aligned(64)));
    __m512 acc[16];
    for (int i = 0; i < 16; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_loadd(6, w16 + (b * G + g) * 512, 64);
        _tile_loadd(3, a + m0 * K + g * 32, K);
        _tile_loadd(4, a + plane + m0 * K + g * 32, K);
        _tile_loadd(5, a + 2 * plane + m0 * K + g * 32, K);
        _tile_dpbssd(0, 3, 6);
        _tile_dpbssd(1, 4, 6);
        _tile_dpbssd(2, 5, 6);
        _tile_stored(0, S[0], 64);
        _tile_stored(1, S[1], 64);
        _tile_stored(2, S[2], 64);
        const __m512 sv = _mm512_loadu_ps(s16 + (b * G + g) * 16);
        for (int i = 0; i < 16; i++) {
            const __m512 v = combine(_mm512_load_si512(S[0] + 16 * i), _mm512_load_si512(S[1] + 16 * i),
                                     _mm512_load_si512(S[2] + 16 * i));
            acc[i] = _mm512_fmadd_ps(v, _mm512_mul_ps(sv, _mm512_set1_ps(d2[(m0 + i) * G + g])), acc[i]);
        }
    }
    for (int i = 0; i < 16; i++) _mm512_storeu_ps(y + (m0 + i) * N + b * 16, acc[i]);
}
#endif

/* Σx̂/d₂ of a query row's group from its slices: the same float operations as a product's group */
static void slice_sums(const int8_t* a, int64_t plane, int64_t M, int64_t K, float* vx) {
    const int64_t G = K / 32;
    for (int64_t m = 0; m < M; m++)
        for (int64_t g = 0; g < G; g++) {
            int32_t t[3] = {0, 0, 0};
            for (int s = 0; s < 3; s++)
                for (int k = 0; k < 32; k++) t[s] += a[s * plane + m * K + g * 32 + k];
            vx[m * G + g] = fmaf((float)t[0], 16384.f, (float)(t[1] * 128 + t[2]));
        }
}

static inline void nibbles(const uint8_t* v, __m512i* lo, __m512i* hi) {
    const __m512i b = _mm512_loadu_si512(v), f = _mm512_set1_epi8(15);
    *lo = _mm512_and_si512(b, f);
    *hi = _mm512_and_si512(_mm512_srli_epi16(b, 4), f);
}

static void vnni4_row(const int8_t* a, int64_t plane, const float* d2, const float* vx, int64_t K, const uint8_t* w4,
                      const float* d16, const float* m16, int64_t b0, float* y) {
    const int64_t G = K / 32;
    const int32_t* a0p = (const int32_t*)a;
    const int32_t* a1p = (const int32_t*)(a + plane);
    const int32_t* a2p = (const int32_t*)(a + 2 * plane);
    __m512 acc[NB];
    for (int j = 0; j < NB; j++) acc[j] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        __m512i r[NB][3];
        for (int j = 0; j < NB; j++) r[j][0] = r[j][1] = r[j][2] = _mm512_setzero_si512();
        for (int p = 0; p < 4; p++) {
            __m512i c[NB][2];
            for (int j = 0; j < NB; j++) nibbles(w4 + ((b0 + j) * G + g) * 256 + p * 64, &c[j][0], &c[j][1]);
            for (int h = 0; h < 2; h++) {
                const int q = 2 * p + h;
                const __m512i s0 = _mm512_set1_epi32(a0p[g * 8 + q]), s1 = _mm512_set1_epi32(a1p[g * 8 + q]);
                const __m512i s2 = _mm512_set1_epi32(a2p[g * 8 + q]);
                for (int j = 0; j < NB; j++) {
                    r[j][0] = _mm512_dpbusd_epi32(r[j][0], c[j][h], s0);
                    r[j][1] = _mm512_dpbusd_epi32(r[j][1], c[j][h], s1);
                    r[j][2] = _mm512_dpbusd_epi32(r[j][2], c[j][h], s2);
                }
            }
        }
        const __m512 d = _mm512_set1_ps(d2[g]), sx = _mm512_set1_ps(vx[g] * d2[g]);
        for (int j = 0; j < NB; j++) {
            const int64_t bg = (b0 + j) * G + g;
            const __m512 v = combine(r[j][0], r[j][1], r[j][2]);
            acc[j] = _mm512_fmadd_ps(v, _mm512_mul_ps(_mm512_loadu_ps(d16 + bg * 16), d),
                                     _mm512_fmadd_ps(_mm512_loadu_ps(m16 + bg * 16), sx, acc[j]));
        }
    }
    for (int j = 0; j < NB; j++) _mm512_storeu_ps(y + (b0 + j) * 16, acc[j]);
}

#ifdef __AMX_INT8__
/* query rows m0 .. m0+15 against weight rows 16b .. 16b+15, the block's codes unpacked to bytes once (u8 [G][512]) */
static void amx4_tile(const int8_t* a, int64_t plane, const float* d2, const float* vx, int64_t m0, int64_t K,
                      const uint8_t* u8, const float* d16, const float* m16, int64_t b, float* y, int64_t N) {
    const int64_t G = K / 32;
    int32_t S[3][256] __attribute__((aligned(64)));
    __m512 acc[16];
    for (int i = 0; i < 16; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_loadd(6, u8 + g * 512, 64);
        _tile_loadd(3, a + m0 * K + g * 32, K);
        _tile_loadd(4, a + plane + m0 * K + g * 32, K);
        _tile_loadd(5, a + 2 * plane + m0 * K + g * 32, K);
        _tile_dpbsud(0, 3, 6);
        _tile_dpbsud(1, 4, 6);
        _tile_dpbsud(2, 5, 6);
        _tile_stored(0, S[0], 64);
        _tile_stored(1, S[1], 64);
        _tile_stored(2, S[2], 64);
        const __m512 dv = _mm512_loadu_ps(d16 + (b * G + g) * 16), mv = _mm512_loadu_ps(m16 + (b * G + g) * 16);
        for (int i = 0; i < 16; i++) {
            const float dd = d2[(m0 + i) * G + g];
            const __m512 v = combine(_mm512_load_si512(S[0] + 16 * i), _mm512_load_si512(S[1] + 16 * i),
                                     _mm512_load_si512(S[2] + 16 * i));
            acc[i] = _mm512_fmadd_ps(v, _mm512_mul_ps(dv, _mm512_set1_ps(dd)),
                                     _mm512_fmadd_ps(mv, _mm512_set1_ps(vx[(m0 + i) * G + g] * dd), acc[i]));
        }
    }
    for (int i = 0; i < 16; i++) _mm512_storeu_ps(y + (m0 + i) * N + b * 16, acc[i]);
}
#endif

/* 0 where this process may use AMX's tiles (built with them, and the kernel grants the tile data), else -1; asked
 * once (a tile instruction without the grant is an illegal instruction) */
int gs_amx(void) {
#ifdef __AMX_INT8__
    static int granted = 0; /* 0 not asked, 1 granted, -1 refused */
    if (granted == 0) granted = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 1 : -1;
    return granted == 1 ? 0 : -1;
#else
    return -1;
#endif
}

/* y [M, N] = x [M, K] · Wᵀ over gs_layout's W. Returns 0, -1 for shapes it does not take, -2 without memory */
int gs_product(const float* x, int64_t M, int64_t K, const int8_t* w16, const int32_t* corr, const float* s16,
               int64_t N, float* y, int threads, int amx) {
    if (N % (16 * NB) || K % 32 || M < 1) return -1;
    const int64_t G = K / 32, plane = M * K;
    int8_t* a = aligned_alloc(64, (size_t)(3 * plane + 63) / 64 * 64);
    uint8_t* u = aligned_alloc(64, (size_t)(3 * plane + 63) / 64 * 64);
    float* d2 = malloc((size_t)(M * G) * sizeof(float));
    if (!a || !u || !d2) {
        free(a), free(u), free(d2);
        return -2;
    }
    slice_rows(x, M, K, a, u, d2);
    int64_t tiled = 0;
#ifdef __AMX_INT8__
    if (amx && gs_amx() == 0) tiled = M / 16 * 16;
#else
    (void)amx;
#endif
#pragma omp parallel num_threads(threads)
    {
#ifdef __AMX_INT8__
        if (tiled) amx_configure();
#pragma omp for schedule(static) nowait
        for (int64_t b = 0; b < N / 16; b++)
            for (int64_t m0 = 0; m0 < tiled; m0 += 16) amx_tile(a, plane, d2, m0, K, w16, s16, b, y, N);
#endif
#pragma omp for schedule(static)
        for (int64_t b0 = 0; b0 < N / 16; b0 += NB)
            for (int64_t m = tiled; m < M; m++)
                vnni_row(u + m * K, plane, d2 + m * G, K, w16, corr, s16, b0, y + m * N);
#ifdef __AMX_INT8__
        if (tiled) _tile_release();
#endif
    }
    free(a), free(u), free(d2);
    return 0;
}

/* y [M, N] = x [M, K] · Wᵀ over gs4_layout's W (w = d·c + m). Returns as gs_product */
int gs4_product(const float* x, int64_t M, int64_t K, const uint8_t* w4, const float* d16, const float* m16,
                int64_t N, float* y, int threads, int amx) {
    if (N % (16 * NB) || K % 32 || M < 1) return -1;
    const int64_t G = K / 32, plane = M * K;
    int8_t* a = aligned_alloc(64, (size_t)(3 * plane + 63) / 64 * 64);
    uint8_t* u = aligned_alloc(64, (size_t)(3 * plane + 63) / 64 * 64);
    float* d2 = malloc((size_t)(M * G) * sizeof(float));
    float* vx = malloc((size_t)(M * G) * sizeof(float));
    if (!a || !u || !d2 || !vx) {
        free(a), free(u), free(d2), free(vx);
        return -2;
    }
    slice_rows(x, M, K, a, u, d2);
    slice_sums(a, plane, M, K, vx);
    int64_t tiled = 0;
#ifdef __AMX_INT8__
    if (amx && gs_amx() == 0) tiled = M / 16 * 16;
#else
    (void)amx;
#endif
#pragma omp parallel num_threads(threads)
    {
#ifdef __AMX_INT8__
        uint8_t* u8 = tiled ? aligned_alloc(64, (size_t)G * 512) : NULL;
        if (tiled) amx_configure();
#pragma omp for schedule(static) nowait
        for (int64_t b = 0; b < N / 16; b++) {
            if (!tiled) continue;
            for (int64_t g = 0; g < G; g++)
                for (int p = 0; p < 4; p++) {
                    __m512i lo, hi;
                    nibbles(w4 + (b * G + g) * 256 + p * 64, &lo, &hi);
                    _mm512_storeu_si512(u8 + g * 512 + (2 * p) * 64, lo);
                    _mm512_storeu_si512(u8 + g * 512 + (2 * p + 1) * 64, hi);
                }
            for (int64_t m0 = 0; m0 < tiled; m0 += 16) amx4_tile(a, plane, d2, vx, m0, K, u8, d16, m16, b, y, N);
        }
#endif
#pragma omp for schedule(static)
        for (int64_t b0 = 0; b0 < N / 16; b0 += NB)
            for (int64_t m = tiled; m < M; m++)
                vnni4_row(a + m * K, plane, d2 + m * G, vx + m * G, K, w4, d16, m16, b0, y + m * N);
#ifdef __AMX_INT8__
        if (tiled) _tile_release();
        free(u8);
#endif
    }
    free(a), free(u), free(d2), free(vx);
    return 0;
}
