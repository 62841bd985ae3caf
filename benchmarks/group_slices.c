/* A candidate for the integer products (Q8_0's and Q4_1's codes here), measured by bench_group_slices.py beside the
 * library's float32 path and its integer path (slices per lane of activations): the query rows sliced per group of 32
 * activations — one power-of-two scale a group, x̂ = d₂·(2¹⁴·a₀ + 2⁷·a₁ + a₂), |a₀| ≤ 127, |a₁|, |a₂| ≤ 64 —
 * and each (query row, weight row, group) given its three slices' exact int32 sums S₀, S₁, S₂ with the codes,
 * however they are computed; a group's value is then one fixed sequence of float operations,
 * v = fma(S₀, 2¹⁴, float(2⁷·S₁ + S₂)), and a row's sum fma(v, d·d₂, acc) over its groups in order (with offsets,
 * w = d·c + m: fma(v, d·d₂, fma(m, d₂·Σx̂/d₂, acc)), Σx̂/d₂ the same combination of the slices' own sums). Integer
 * sums are exact in any order and on any unit, so the sequence gives the same bits from
 *   - VNNI (gs_product(..., amx = 0)): vpdpbusd over codes laid out sixteen weight rows a vector (each 32-bit lane a
 *     row's four codes: no horizontal sums), the slices broadcast four bytes at a time, four blocks of sixteen rows
 *     at once;
 *   - AMX (gs_product(..., amx = 1), where the kernel grants the tiles: gs_amx): tdpbssd (int8 codes) or tdpbsud
 *     (packed) over sixteen query rows by sixteen weight rows a tile, a group of 32 bytes a product, for the whole
 *     blocks of sixteen query rows (the rest as above).
 * VNNI multiplies the codes as unsigned bytes, c + bias (int8 codes: bias 128; packed 0..15 codes: 0), and subtracts
 * bias·Σa from each slice's sum. Not the library's code: a measurement of what a prefill and a decode step would gain
 * (docs/decode.md).
 *
 * Layout (gs_layout): codes [N/16][K/32][8][16][4] unsigned bytes (c + bias), or packed [N/16][K/32][4][64] where
 * byte 4r + j of vector p holds the codes of steps 2p (low nibble) and 2p + 1 (high) of row r; scales and offsets
 * [N/16][K/32][16] float32. N a multiple of 64, K of 32. */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

enum { NB = 4 }; /* blocks of sixteen weight rows at once: independent chains, the broadcasts shared */

/* codes [N, K] (int8; packed: 0..15), scales and offsets (or NULL) [N, K/32] into the layout above */
void gs_layout(const int8_t* codes, const float* scales, const float* offsets, int64_t N, int64_t K, int packed,
               uint8_t* out, float* s16, float* m16) {
    const int64_t G = K / 32, bias = packed ? 0 : 128, unit = packed ? 256 : 512;
    if (packed) memset(out, 0, (size_t)(N * K / 2));
    for (int64_t n = 0; n < N; n++)
        for (int64_t g = 0; g < G; g++) {
            const int64_t bg = (n / 16) * G + g;
            for (int k = 0; k < 32; k++) {
                const int q = k / 4, j = k % 4;
                const uint8_t c = (uint8_t)(codes[n * K + g * 32 + k] + bias);
                if (packed)
                    out[bg * unit + (q / 2) * 64 + (n % 16) * 4 + j] |= (uint8_t)((c & 15) << (4 * (q % 2)));
                else
                    out[bg * unit + q * 64 + (n % 16) * 4 + j] = c;
            }
            s16[bg * 16 + n % 16] = scales[n * G + g];
            if (offsets) m16[bg * 16 + n % 16] = offsets[n * G + g];
        }
}

/* each query row's groups: a (int8 slices, [3][M][K]), d2 [M][G], t (each slice's sum [M][G][3]) and vx (their
 * combination, Σx̂/d₂, [M][G]) */
static void slice_rows(const float* x, int64_t M, int64_t K, int8_t* a, float* d2, int32_t* t, float* vx) {
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
            __m512i sums[3] = {_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512()};
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
                    sums[s] = _mm512_add_epi32(sums[s], v);
                    _mm_storeu_si128((__m128i*)(a + s * plane + m * K + g * 32 + 16 * h), _mm512_cvtepi32_epi8(v));
                }
            }
            int32_t* tg = t + (m * G + g) * 3;
            for (int s = 0; s < 3; s++) tg[s] = _mm512_reduce_add_epi32(sums[s]);
            vx[m * G + g] = fmaf((float)tg[0], 16384.f, (float)(tg[1] * 128 + tg[2]));
        }
}

static inline __m512 combine(__m512i s0, __m512i s1, __m512i s2) {
    const __m512i t = _mm512_add_epi32(_mm512_slli_epi32(s1, 7), s2);
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(s0), _mm512_set1_ps(16384.f), _mm512_cvtepi32_ps(t));
}

/* a group's value into a row's sum: the one sequence both paths take (s0..s2 the slices' exact sums) */
static inline __m512 add_group(__m512 acc, __m512i s0, __m512i s1, __m512i s2, __m512 d, __m512 m, float d2,
                               float vx, int offsets) {
    if (offsets) acc = _mm512_fmadd_ps(m, _mm512_set1_ps(vx * d2), acc);
    return _mm512_fmadd_ps(combine(s0, s1, s2), _mm512_mul_ps(d, _mm512_set1_ps(d2)), acc);
}

/* the codes of step q of a group's unit (as unsigned bytes) */
static inline __m512i step_codes(const uint8_t* unit, int q, int packed) {
    if (!packed) return _mm512_loadu_si512(unit + q * 64);
    const __m512i b = _mm512_loadu_si512(unit + (q / 2) * 64);
    return _mm512_and_si512(q % 2 ? _mm512_srli_epi16(b, 4) : b, _mm512_set1_epi8(15));
}

/* one query row against weight rows 16·b0 .. 16·(b0 + NB) − 1 */
static void vnni_row(const int8_t* a, int64_t plane, const float* d2, const int32_t* t, const float* vx, int64_t K,
                     const uint8_t* codes, const float* s16, const float* m16, int packed, int32_t bias, int64_t b0,
                     float* y) {
    const int64_t G = K / 32, unit = packed ? 256 : 512;
    const int32_t* ap[3] = {(const int32_t*)a, (const int32_t*)(a + plane), (const int32_t*)(a + 2 * plane)};
    __m512 acc[NB];
    for (int j = 0; j < NB; j++) acc[j] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        __m512i r[NB][3];
        for (int j = 0; j < NB; j++)
            for (int s = 0; s < 3; s++) r[j][s] = _mm512_set1_epi32(-bias * t[g * 3 + s]);
        for (int q = 0; q < 8; q++) {
            __m512i sv[3];
            for (int s = 0; s < 3; s++) sv[s] = _mm512_set1_epi32(ap[s][g * 8 + q]);
            for (int j = 0; j < NB; j++) {
                const __m512i c = step_codes(codes + ((b0 + j) * G + g) * unit, q, packed);
                for (int s = 0; s < 3; s++) r[j][s] = _mm512_dpbusd_epi32(r[j][s], c, sv[s]);
            }
        }
        for (int j = 0; j < NB; j++) {
            const int64_t bg = (b0 + j) * G + g;
            acc[j] = add_group(acc[j], r[j][0], r[j][1], r[j][2], _mm512_loadu_ps(s16 + bg * 16),
                               m16 ? _mm512_loadu_ps(m16 + bg * 16) : _mm512_setzero_ps(), d2[g], vx[g], m16 != NULL);
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

/* query rows m0 .. m0+15 against weight rows 16b .. 16b+15, whose codes are bytes [G][8][64]: signed (int8 codes,
 * tdpbssd: no bias to subtract) or unsigned (packed codes, tdpbsud) */
static void amx_tile(const int8_t* a, int64_t plane, const float* d2, const float* vx, int64_t m0, int64_t K,
                     const uint8_t* u8, int signed_codes, const float* s16, const float* m16, int64_t b, float* y,
                     int64_t N) {
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
        if (signed_codes) {
            _tile_dpbssd(0, 3, 6);
            _tile_dpbssd(1, 4, 6);
            _tile_dpbssd(2, 5, 6);
        } else {
            _tile_dpbsud(0, 3, 6);
            _tile_dpbsud(1, 4, 6);
            _tile_dpbsud(2, 5, 6);
        }
        _tile_stored(0, S[0], 64);
        _tile_stored(1, S[1], 64);
        _tile_stored(2, S[2], 64);
        const int64_t bg = b * G + g;
        const __m512 dv = _mm512_loadu_ps(s16 + bg * 16), mv = m16 ? _mm512_loadu_ps(m16 + bg * 16) : dv;
        for (int i = 0; i < 16; i++) {
            const int64_t mg = (m0 + i) * G + g;
            acc[i] = add_group(acc[i], _mm512_load_si512(S[0] + 16 * i), _mm512_load_si512(S[1] + 16 * i),
                               _mm512_load_si512(S[2] + 16 * i), dv, mv, d2[mg], vx[mg], m16 != NULL);
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

/* y [M, N] = x [M, K] · Wᵀ over gs_layout's W (m16 NULL: no offsets). Returns 0, -1 for shapes it does not take,
 * -2 without memory */
int gs_product(const float* x, int64_t M, int64_t K, const uint8_t* codes, const float* s16, const float* m16,
               int64_t N, int packed, float* y, int threads, int amx) {
    if (N % (16 * NB) || K % 32 || M < 1) return -1;
    const int64_t G = K / 32, plane = M * K, unit = packed ? 256 : 512;
    const int32_t bias = packed ? 0 : 128;
    int8_t* a = aligned_alloc(64, (size_t)(3 * plane + 63) / 64 * 64);
    float* d2 = malloc((size_t)(M * G) * sizeof(float));
    float* vx = malloc((size_t)(M * G) * sizeof(float));
    int32_t* t = malloc((size_t)(M * G * 3) * sizeof(int32_t));
    if (!a || !d2 || !vx || !t) {
        free(a), free(d2), free(vx), free(t);
        return -2;
    }
    slice_rows(x, M, K, a, d2, t, vx);
    int64_t tiled = 0;
#ifdef __AMX_INT8__
    if (amx && gs_amx() == 0) tiled = M / 16 * 16;
#else
    (void)amx;
#endif
#pragma omp parallel num_threads(threads)
    {
#ifdef __AMX_INT8__
        uint8_t* u8 = tiled ? aligned_alloc(64, (size_t)G * 512) : NULL; /* a block's codes, one byte each */
        if (tiled) amx_configure();
#pragma omp for schedule(static) nowait
        for (int64_t b = 0; b < N / 16; b++) {
            if (!tiled) continue;
            const __m512i flip = _mm512_set1_epi8(packed ? 0 : (char)0x80); /* int8 codes: c + 128 back to c */
            for (int64_t g = 0; g < G; g++)
                for (int q = 0; q < 8; q++)
                    _mm512_storeu_si512(u8 + g * 512 + q * 64,
                                        _mm512_xor_si512(step_codes(codes + (b * G + g) * unit, q, packed), flip));
            for (int64_t m0 = 0; m0 < tiled; m0 += 16)
                amx_tile(a, plane, d2, vx, m0, K, u8, !packed, s16, m16, b, y, N);
        }
#endif
#pragma omp for schedule(static)
        for (int64_t b0 = 0; b0 < N / 16; b0 += NB)
            for (int64_t m = tiled; m < M; m++)
                vnni_row(a + m * K, plane, d2 + m * G, t + m * G * 3, vx + m * G, K, codes, s16, m16, packed, bias, b0,
                         y + m * N);
#ifdef __AMX_INT8__
        if (tiled) _tile_release();
        free(u8);
#endif
    }
    free(a), free(d2), free(vx), free(t);
    return 0;
}
