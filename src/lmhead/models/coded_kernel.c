/* lmhead's coded matrix product: y = x · Wᵀ where W is stored as the GGUF file stored it — small integer
 * codes with one scale (and, for some formats, one offset) per group of G weights of a row:
 *
 *     W[n, g·G + i] = scale[n, g] · code[n, g·G + i] + offset[n, g]
 *
 *     y[m, n] = Σ_k W[n, k] · x[m, k]
 *
 * in float32, each weight rebuilt in registers from its code exactly as the float32 model holds it (the codes
 * and scales are the weights' own: models/gguf_codes.py checks, weight by weight, that they give back the
 * float32 matrix). Nothing is approximated; only the order of the float32 additions differs from a plain
 * product. A decode step reads 1–1.25 bytes per weight instead of float32's 4, and on a CPU whose memory is
 * the limit that is the time.
 *
 * Codes are int8 [N, K] (row-major), or — `packed`, for unsigned 4-bit codes and G = 32 — two per byte
 * [N, K/2] (in each group's 16 bytes the low nibbles are its codes 0..15, the high nibbles 16..31: half the
 * bytes again); scale and offset float32 [N, K/G]; offset may be NULL; G is 16 or 32;
 * x float32 [M, K]; y float32 [M, N]. Rows n are split over `threads` OpenMP threads (the same libgomp as
 * torch's, so the two share one pool). Built once per machine by models/coded_linear.py with the system C
 * compiler (-O3 -march=native); without AVX2 the plain loop below is what the compiler vectorises.
 */
#include <stddef.h>
#include <stdint.h>
#include <math.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif

#define MB 8 /* query rows per pass over a weight row (the row stays in L1 between passes) */

int lmhead_coded_abi(void) { return 3; }

#ifdef __AVX2__
int lmhead_coded_avx2(void) { return 1; }

static inline float hsum8(__m256 v) {
    __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
    return _mm_cvtss_f32(lo);
}

/* codes j..j+15 of group g as 16 int8 lanes: read as stored, or — packed — from the group's 16 bytes, whose low
 * nibbles are codes 0..15 and high nibbles codes 16..31 (unsigned 4-bit codes, G = 32) */
static inline __m128i codes16(const int8_t* c, int64_t g, int64_t G, int64_t j, int packed) {
    if (!packed) return _mm_loadu_si128((const __m128i*)(c + g * G + j));
    const __m128i v = _mm_loadu_si128((const __m128i*)(c + g * 16));
    const __m128i low4 = _mm_set1_epi8(0x0F);
    return j == 0 ? _mm_and_si128(v, low4) : _mm_and_si128(_mm_srli_epi16(v, 4), low4);
}

/* eight weights (the low 8 lanes of c8), rebuilt exactly: code·scale (+ offset) in one rounding, as gguf's
 * dequantiser computes them (code·scale is exact in float32 for every format we store: ≤ 17 + 8 significant
 * bits) */
static inline __m256 weights8(__m128i c8, __m256 sv, __m256 ov, int has_offset) {
    const __m256 cf = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(c8));
    return has_offset ? _mm256_fmadd_ps(cf, sv, ov) : _mm256_mul_ps(cf, sv);
}

/* one weight row against R ≤ MB query rows (R a constant in each copy: the accumulators stay in registers).
 * Up to 4 rows, two accumulators per row so that successive products do not wait on each other; from 5 rows
 * one each (R independent chains already hide the FMA latency, and 2·R would not fit the 16 registers).
 * G a multiple of 16. */
#define ROWS(R)                                                                                              \
    static inline void rows##R(const float* x, int64_t K, const int8_t* c, const float* s, const float* o, \
                               int64_t ng, int64_t G, int packed, float* out) {                            \
        __m256 a[R], b[R];                                                                                  \
        for (int m = 0; m < R; m++) a[m] = b[m] = _mm256_setzero_ps();                                      \
        for (int64_t g = 0; g < ng; g++) {                                                                  \
            const __m256 sv = _mm256_set1_ps(s[g]);                                                         \
            const __m256 ov = o ? _mm256_set1_ps(o[g]) : _mm256_setzero_ps();                               \
            for (int64_t j = 0; j < G; j += 16) {                                                           \
                const __m128i c16 = codes16(c, g, G, j, packed);                                            \
                const __m256 w0 = weights8(c16, sv, ov, o != NULL);                                         \
                const __m256 w1 = weights8(_mm_srli_si128(c16, 8), sv, ov, o != NULL);                      \
                for (int m = 0; m < R; m++) {                                                               \
                    const float* xm = x + m * K + g * G + j;                                                \
                    a[m] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xm), a[m]);                                  \
                    if (R <= 4)                                                                             \
                        b[m] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xm + 8), b[m]);                          \
                    else                                                                                    \
                        a[m] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xm + 8), a[m]);                          \
                }                                                                                           \
            }                                                                                               \
        }                                                                                                   \
        for (int m = 0; m < R; m++) out[m] = hsum8(_mm256_add_ps(a[m], b[m]));                              \
    }
ROWS(1) ROWS(2) ROWS(3) ROWS(4) ROWS(5) ROWS(6) ROWS(7) ROWS(8)

static inline void row_dot(const float* x, int64_t K, const int8_t* c, const float* s, const float* o,
                           int64_t ng, int64_t G, int packed, int mb, float* out) {
    switch (mb) {
        case 1: rows1(x, K, c, s, o, ng, G, packed, out); break;
        case 2: rows2(x, K, c, s, o, ng, G, packed, out); break;
        case 3: rows3(x, K, c, s, o, ng, G, packed, out); break;
        case 4: rows4(x, K, c, s, o, ng, G, packed, out); break;
        case 5: rows5(x, K, c, s, o, ng, G, packed, out); break;
        case 6: rows6(x, K, c, s, o, ng, G, packed, out); break;
        case 7: rows7(x, K, c, s, o, ng, G, packed, out); break;
        default: rows8(x, K, c, s, o, ng, G, packed, out); break;
    }
}

/* the common decode case, one query row and G = 32: four independent chains */
static inline float row_dot1_g32(const float* x, const int8_t* c, const float* s, const float* o, int64_t ng,
                                 int packed) {
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
    for (int64_t g = 0; g < ng; g++) {
        const float* xg = x + g * 32;
        const __m256 sv = _mm256_set1_ps(s[g]);
        const __m256 ov = o ? _mm256_set1_ps(o[g]) : _mm256_setzero_ps();
        const __m128i lo = codes16(c, g, 32, 0, packed), hi = codes16(c, g, 32, 16, packed);
        a0 = _mm256_fmadd_ps(weights8(lo, sv, ov, o != NULL), _mm256_loadu_ps(xg), a0);
        a1 = _mm256_fmadd_ps(weights8(_mm_srli_si128(lo, 8), sv, ov, o != NULL), _mm256_loadu_ps(xg + 8), a1);
        a2 = _mm256_fmadd_ps(weights8(hi, sv, ov, o != NULL), _mm256_loadu_ps(xg + 16), a2);
        a3 = _mm256_fmadd_ps(weights8(_mm_srli_si128(hi, 8), sv, ov, o != NULL), _mm256_loadu_ps(xg + 24), a3);
    }
    return hsum8(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
}
#else
int lmhead_coded_avx2(void) { return 0; }

static inline int code_at(const int8_t* c, int64_t g, int64_t G, int64_t i, int packed) {
    if (!packed) return c[g * G + i];
    const uint8_t byte = (uint8_t)c[g * 16 + (i & 15)];
    return i < 16 ? (byte & 0x0F) : (byte >> 4);
}

static inline void row_dot(const float* x, int64_t K, const int8_t* c, const float* s, const float* o,
                           int64_t ng, int64_t G, int packed, int mb, float* out) {
    for (int m = 0; m < mb; m++) {
        const float* xm = x + m * K;
        float r = 0.f;
        for (int64_t g = 0; g < ng; g++)
            for (int64_t i = 0; i < G; i++) {
                const float code = (float)code_at(c, g, G, i, packed);
                const float w = o ? fmaf(code, s[g], o[g]) : code * s[g];
                r += w * xm[g * G + i];
            }
        out[m] = r;
    }
}
#endif

/* y [M, N] = x [M, K] · Wᵀ, W given by codes/scale/offset as above. Returns 0, or -1 for arguments it cannot
 * take (G not a multiple of 16, K not a multiple of G). */
int lmhead_coded_matmul(const float* x, int64_t M, int64_t K, const int8_t* codes, const float* scale,
                        const float* offset, int64_t N, int64_t G, int packed, float* y, int threads) {
    if (G <= 0 || G % 16 != 0 || K % G != 0 || M < 0 || N < 0 || (packed && G != 32)) return -1;
    const int64_t ng = K / G;
    if (threads < 1) threads = 1;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const int8_t* c = codes + n * (packed ? K / 2 : K);
        const float* s = scale + n * ng;
        const float* o = offset ? offset + n * ng : NULL;
        for (int64_t m0 = 0; m0 < M; m0 += MB) {
            const int mb = (int)(M - m0 < MB ? M - m0 : MB);
            float out[MB];
#ifdef __AVX2__
            if (mb == 1 && G == 32)
                out[0] = row_dot1_g32(x + m0 * K, c, s, o, ng, packed);
            else
#endif
                row_dot(x + m0 * K, K, c, s, o, ng, G, packed, mb, out);
            for (int m = 0; m < mb; m++) y[(m0 + m) * N + n] = out[m];
        }
    }
    return 0;
}
