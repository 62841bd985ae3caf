/* Coded products on the CPU's integer dot-product units (AVX-512 VNNI's vpdpbusd), within the float32 product's
 * error bound: the query row is split into three 8-bit slices, the weights' codes are already small integers, and
 * each slice's products are summed exactly in int32. Packed 4-bit codes first (sliced_prepare, sliced_rows4); int8
 * codes without offsets below (sliced_prepare8, sliced8_rows4), the same slices per lane of four.
 *
 * The activations are taken eight at a time — the eight a 32-bit lane of the product multiplies (below) — and for
 * each such lane d₀ is the smallest power of two with max|x| / d₀ ≤ 127, d₂ = d₀·2⁻¹⁶, and in double (exact)
 *
 *     x + d₂/2 + 32896·d₂ = d₂·(2¹⁶·b₀ + 2⁸·b₁ + b₂) + r,   each bₖ a floor, b₁, b₂ in 0 … 255, 0 ≤ r < d₂
 *
 * so that x̂ = d₂·(2¹⁶·a₀ + 2⁸·a₁ + a₂) with a₀ = b₀ (−127 … 127), a₁ = b₁ − 128, a₂ = b₂ − 128 (−128 … 127: the
 * 32896·d₂ = 128·(2⁸ + 1)·d₂ makes them signed bytes) and |x − x̂| ≤ d₂/2 ≤ 2⁻²³·max|x| over the lane. Then
 *
 *     Σᵢ cᵢ·x̂ᵢ = d₂·Σᵢ cᵢ·(2¹⁶·a₀ᵢ + 2⁸·a₁ᵢ + a₂ᵢ)
 *
 * is an integer times d₂: vpdpbusd multiplies the unsigned codes (0 … 15: the code of unsigned ones, Q4_1 and Q4_K,
 * the code + 8 of signed ones, Q4_0, Q3_K, Q2_K) by each signed slice, four products to a 32-bit lane, the slices
 * combined by shifts in the same lanes (Horner's way; a lane's eight products stay below 2³¹), and 8·Σ x̂'s integers
 * per lane (`bias`, per query row) is subtracted, so that c is the centred code (code − 8 of unsigned codes, the
 * code of signed ones): the sum coded_kernel.c's float loop makes, its offsets following as there (rows4_finish).
 * The lane's integer becomes a float once, times its scale and d₂. A level table (IQ4_NL, IQ4_XS, MXFP4) gives its
 * levels plus the table's bias (−its smallest level) as the unsigned bytes, by one byte shuffle of the stored
 * nibbles; IQ4's reach 240, so slices (0, 1) and slice 2 are summed apart and joined in float.
 *
 * The bound, stated in docs/decode.md: a float32 dot product of length K is within γ_K·Σ|w·x| (γ_K ≈ K·2⁻²⁴) of
 * the exact one; the representation error here is at most d₂/2 per activation, within half of that bound for a
 * lane whenever 8·d₂/2 ≤ (K·2⁻²⁵)·Σ|x| over the lane (its weights alike) — true for every lane once K ≥ 32, as
 * max|x| ≤ Σ|x|, and checked. A query row with a non-finite value, or one near float32's smallest, takes the float32
 * product instead (`ok`): a row's path depends on that row alone, so its value is the same bits alone or in a
 * batch, as are its integers, whatever the order they were summed in.
 *
 * The codes stay in the packed layout of coded_kernel.c (byte 4·l + b of a 64-code unit holds codes 16·b + l, low
 * nibble, and 16·b + 8 + l, high, each XOR 8): one byte shuffle per 16 bytes puts the bytes of equal b together,
 * so that a 32-bit lane's four products belong to one group (G = 32: b = 0, 1 group 2u, b = 2, 3 group 2u + 1;
 * G = 16 — Q3_K, Q2_K —: b group 4u + b), and the slices are laid out once per query row in that order.
 *
 * Included by coded_kernel.c only. */
#ifndef LMHEAD_SLICED_KERNEL_H
#define LMHEAD_SLICED_KERNEL_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#define SLICES 3
/* bytes a query row's slices take per 64-code unit: for each slice the low and high nibbles' activations in the
 * shuffled order (32 bytes each, stored twice: the two weight rows of a 512-bit vector), then per lane (each
 * twice) d₂, the codes' bias times the slices' sums for slices (0, 1) and for slice 2 (the split sums of level
 * tables), and combined (8 floats, 3 × 8 int32) */
#define SLICED_UNIT 640

typedef struct {
    const int8_t* units; /* [K/64][SLICED_UNIT], 64-byte aligned */
    int ok;              /* 0: this row takes the float32 product */
} sliced_row;

/* in-lane byte order that gathers the bytes of equal b (byte 4·l + b → position 4·b + l within each 16 bytes) */
static const int8_t SLICED_GATHER[16] = {0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15};

/* The three slices of eight activations x[0..7] — the first four of a lane whose centre and 1/d₀ are cen[0],
 * inv[0], the last four of one with cen[1], inv[1] — into a[k·stride + i]: floors in double of
 * (x + d₂/2 + 32896·d₂) / d₀, each slice's remainder times 2⁸ the next (below, sliced_prepare) */
static inline void slice8(const float* x, const double* cen, const double* inv, int32_t* a, int64_t stride) {
#ifdef __AVX512F__
    const __m512d c = _mm512_insertf64x4(_mm512_set1_pd(cen[0]), _mm256_set1_pd(cen[1]), 1);
    const __m512d v = _mm512_insertf64x4(_mm512_set1_pd(inv[0]), _mm256_set1_pd(inv[1]), 1);
    __m512d t = _mm512_mul_pd(_mm512_add_pd(_mm512_cvtps_pd(_mm256_loadu_ps(x)), c), v);
    for (int k = 0; k < SLICES; k++) {
        const __m512d q = _mm512_roundscale_pd(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
        __m256i qi = _mm512_cvtpd_epi32(q);
        if (k > 0) qi = _mm256_sub_epi32(qi, _mm256_set1_epi32(128));
        _mm256_storeu_si256((__m256i*)(a + k * stride), qi);
        t = _mm512_mul_pd(_mm512_sub_pd(t, q), _mm512_set1_pd(256.0));
    }
#else
    for (int i = 0; i < 8; i++) {
        double t = ((double)x[i] + cen[i / 4]) * inv[i / 4];
        for (int k = 0; k < SLICES; k++) {
            const double q = floor(t);
            a[k * stride + i] = (int32_t)q - (k == 0 ? 0 : 128);
            t = (t - q) * 256.0;
        }
    }
#endif
}

/* One query row x [K] into its slices (out: [K/64][SLICED_UNIT] bytes) for codes biased by `bias` (8: packed
 * codes; a level table's −min: its levels + bias are the unsigned bytes); returns whether the row can take the
 * integer product (see the bound above). K a multiple of 64. */
__attribute__((unused)) static int sliced_prepare(const float* x, int64_t K, int bias_by, int8_t* out) {
    /* element i = 16b + 8h + 4c + j of a unit belongs to lane 4c + b and goes to byte 16c + 4b + j of the low
     * (h = 0) or high (h = 1) nibbles' row (+ 64 for the high row) */
    static const int8_t LANE_OF[64] = {0, 0, 0, 0, 4, 4, 4, 4, 0, 0, 0, 0, 4, 4, 4, 4, 1, 1, 1, 1, 5, 5, 5, 5, 1, 1,
        1, 1, 5, 5, 5, 5, 2, 2, 2, 2, 6, 6, 6, 6, 2, 2, 2, 2, 6, 6, 6, 6, 3, 3, 3, 3, 7, 7, 7, 7, 3, 3, 3, 3, 7, 7, 7,
        7};
    static const int8_t POS_OF[64] = {0, 1, 2, 3, 16, 17, 18, 19, 64, 65, 66, 67, 80, 81, 82, 83, 4, 5, 6, 7, 20, 21,
        22, 23, 68, 69, 70, 71, 84, 85, 86, 87, 8, 9, 10, 11, 24, 25, 26, 27, 72, 73, 74, 75, 88, 89, 90, 91, 12, 13,
        14, 15, 28, 29, 30, 31, 76, 77, 78, 79, 92, 93, 94, 95};
    (void)LANE_OF, (void)POS_OF; /* read by the loops without AVX-512 (VBMI) */
    int ok = 1;
    for (int64_t u = 0; u < K / 64; u++) {
        const float* xu = x + u * 64;
        int8_t* dst = out + u * SLICED_UNIT;
        float m[8] = {0}, l1[8] = {0}, dv[8];
        int32_t bias[16];
#ifdef __AVX512F__
        for (int b = 0; b < 4; b++) { /* elements 16b + 8h + 4c + j: over h, then over j, for c = 0, 1 */
            const __m512 v = _mm512_abs_ps(_mm512_loadu_ps(xu + 16 * b));
            const __m256 lo = _mm512_castps512_ps256(v);
            const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
            __m256 mx = _mm256_max_ps(lo, hi), sm = _mm256_add_ps(lo, hi);
            mx = _mm256_max_ps(mx, _mm256_permute_ps(mx, 0x4E)), sm = _mm256_add_ps(sm, _mm256_permute_ps(sm, 0x4E));
            mx = _mm256_max_ps(mx, _mm256_permute_ps(mx, 0xB1)), sm = _mm256_add_ps(sm, _mm256_permute_ps(sm, 0xB1));
            float mv[8], sv[8];
            _mm256_storeu_ps(mv, mx), _mm256_storeu_ps(sv, sm);
            m[b] = mv[0], m[4 + b] = mv[4], l1[b] = sv[0], l1[4 + b] = sv[4];
        }
#else
        for (int i = 0; i < 64; i++) {
            const float v = fabsf(xu[i]);
            m[LANE_OF[i]] = v > m[LANE_OF[i]] ? v : m[LANE_OF[i]];
            l1[LANE_OF[i]] += v;
        }
#endif
        double inv8[8], cen8[8];
        for (int lane = 0; lane < 8; lane++) {
            /* d₀: the smallest power of two with max|x| / d₀ ≤ 127 (from max|x|'s exponent bits: m = f·2^e, f in
             * [0.5, 1), d₀ = 2^(e − 7), doubled where m / d₀ > 127); d₂ = d₀·2⁻¹⁶ the last slice's unit */
            const float mm = m[lane];
            int lane_ok = mm < 1e30f && !(mm > 0.f && mm < 1e-25f); /* inf, NaN, near the subnormals */
            union { float f; uint32_t u; } bits = {mm}, d0 = {0.f};
            const int e = lane_ok && mm > 0.f ? (int)((bits.u >> 23) & 0xFF) - 126 : 1;
            d0.u = (uint32_t)(e - 7 + 127) << 23;
            if (mm / d0.f > 127.f) d0.u += 1u << 23;
            dv[lane] = d0.f * 1.52587890625e-5f; /* 2⁻¹⁶: exact, d₂ is a normal number (mm ≥ 1e-25) */
            inv8[lane] = 1.0 / (double)d0.f;
            cen8[lane] = 32896.5 * (double)dv[lane];
            /* 8 · d₂/2 ≤ K·2⁻²⁵ · Σ|x| over the lane, in float32 with room */
            if (mm > 0.f && 4.f * dv[lane] > (float)K * 2.98023224e-8f * l1[lane]) lane_ok = 0;
            ok &= lane_ok;
        }
        if (!ok) return 0;
        /* in double, exact: y = x + d₂/2 + 32896·d₂ = d₂·(2¹⁶·b₀ + 2⁸·b₁ + b₂) + r' with each bₖ a floor (b₁, b₂ in
         * 0 … 255, 0 ≤ r' < d₂); then x + d₂/2 = d₂·(2¹⁶·a₀ + 2⁸·a₁ + a₂) + r' with a₀ = b₀ in −127 … 127 and
         * a₁ = b₁ − 128, a₂ = b₂ − 128 in −128 … 127: three signed bytes, |x − x̂| ≤ d₂/2 */
        int32_t a[SLICES][64];
        for (int i = 0; i < 64; i += 8) { /* elements i .. i + 7: lanes 4c + b, c = 0 (four), then 1 (four) */
            const double cen[2] = {cen8[i / 16], cen8[4 + i / 16]}, inv[2] = {inv8[i / 16], inv8[4 + i / 16]};
            slice8(xu + i, cen, inv, &a[0][i], 64);
        }
#if defined(__AVX512VBMI__) && defined(__AVX512VNNI__)
        /* each slice's 64 bytes in the natural order, permuted into its low and high rows (each twice); the lanes'
         * sums of a slice are its bytes' four-byte sums, one dot product with ones per row */
        /* byte i of the natural order to its place in the low and the high row, each twice (POS_OF) */
        static const int8_t PERM_LO[64] = {0, 1, 2, 3, 16, 17, 18, 19, 32, 33, 34, 35, 48, 49, 50, 51, 4, 5, 6, 7, 20,
            21, 22, 23, 36, 37, 38, 39, 52, 53, 54, 55, 0, 1, 2, 3, 16, 17, 18, 19, 32, 33, 34, 35, 48, 49, 50, 51, 4,
            5, 6, 7, 20, 21, 22, 23, 36, 37, 38, 39, 52, 53, 54, 55};
        static const int8_t PERM_HI[64] = {8, 9, 10, 11, 24, 25, 26, 27, 40, 41, 42, 43, 56, 57, 58, 59, 12, 13, 14,
            15, 28, 29, 30, 31, 44, 45, 46, 47, 60, 61, 62, 63, 8, 9, 10, 11, 24, 25, 26, 27, 40, 41, 42, 43, 56, 57,
            58, 59, 12, 13, 14, 15, 28, 29, 30, 31, 44, 45, 46, 47, 60, 61, 62, 63};
        const __m512i perm_lo = _mm512_loadu_si512(PERM_LO), perm_hi = _mm512_loadu_si512(PERM_HI);
        const __m512i ones = _mm512_set1_epi8(1);
        __m512i comb = _mm512_setzero_si512();
        for (int k = 0; k < SLICES; k++) {
            const __m512i nat = _mm512_inserti64x4(
                _mm512_castsi256_si512(_mm256_setr_m128i(_mm512_cvtepi32_epi8(_mm512_loadu_si512(a[k])),
                                                         _mm512_cvtepi32_epi8(_mm512_loadu_si512(a[k] + 16)))),
                _mm256_setr_m128i(_mm512_cvtepi32_epi8(_mm512_loadu_si512(a[k] + 32)),
                                  _mm512_cvtepi32_epi8(_mm512_loadu_si512(a[k] + 48))), 1);
            const __m512i lo = _mm512_permutexvar_epi8(perm_lo, nat), hi = _mm512_permutexvar_epi8(perm_hi, nat);
            _mm512_store_si512(dst + k * 128, lo);
            _mm512_store_si512(dst + k * 128 + 64, hi);
            comb = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_slli_epi32(comb, 8), ones, lo), ones, hi);
        }
        /* the codes' bias times Σ a, combined; and for the split sums (tables), slices (0, 1) and 2 apart */
        const __m512i by = _mm512_set1_epi32(bias_by);
        _mm512_storeu_si512(bias, _mm512_mullo_epi32(comb, by));
        const __m512i s2 = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), ones,
                                                                   _mm512_load_si512(dst + 256)),
                                               ones, _mm512_load_si512(dst + 320));
        _mm512_store_si512(dst + SLICES * 128 + 64, _mm512_mullo_epi32(_mm512_srai_epi32(_mm512_sub_epi32(comb, s2), 8),
                                                                        by));
        _mm512_store_si512(dst + SLICES * 128 + 128, _mm512_mullo_epi32(s2, by));
#else
        int32_t sums[SLICES][8] = {{0}};
        for (int k = 0; k < SLICES; k++) {
            int8_t* sk = dst + k * 128; /* slice k: low nibbles' row, then high's, each stored twice */
            for (int i = 0; i < 64; i++) {
                const int p = POS_OF[i];
                sk[p] = sk[p + 32] = (int8_t)a[k][i];
                sums[k][LANE_OF[i]] += a[k][i];
            }
        }
        int32_t split[32];
        for (int lane = 0; lane < 8; lane++) { /* the codes' bias: Σ (code − bias)·a = Σ code·a − bias·Σ a */
            int32_t t = 0;
            for (int k = 0; k < SLICES; k++) t = t * 256 + sums[k][lane];
            bias[lane] = bias[lane + 8] = bias_by * t;
            split[lane] = split[lane + 8] = bias_by * (256 * sums[0][lane] + sums[1][lane]);
            split[16 + lane] = split[24 + lane] = bias_by * sums[2][lane];
        }
        memcpy(dst + SLICES * 128 + 64, split, 128);
#endif
        memcpy(dst + SLICES * 128, dv, 32);
        memcpy(dst + SLICES * 128 + 32, dv, 32);
        memcpy(dst + SLICES * 128 + 192, bias, 64);
    }
    return ok;
}

/* Int8 codes (one a byte: Q8_0, Q5_0, Q6_K without offsets) read 32 codes a row per unit, a 32-bit lane four
 * consecutive codes of one group: their slices are taken per lane of four activations, in order, each 32 bytes
 * stored twice (the two weight rows of a 512-bit vector), then per lane (twice) d₂ and 128 times the slices' sums
 * for slices (0, 1) and for slice 2 — the codes are read as code + 128 (unsigned bytes), and their products summed
 * in two parts so that no lane passes 2³¹ */
#define SLICED8_UNIT (SLICES * 64 + 192)

__attribute__((unused)) static int sliced_prepare8(const float* x, int64_t K, int8_t* out) {
    int ok = 1;
    for (int64_t u = 0; u < K / 32; u++) {
        const float* xu = x + u * 32;
        int8_t* dst = out + u * SLICED8_UNIT;
        float dv[16];
        double inv8[8], cen8[8];
        for (int l = 0; l < 8; l++) { /* d₀ and d₂ of lane l (activations 4l .. 4l + 3), as sliced_prepare */
            float m = 0.f, l1 = 0.f;
            for (int j = 0; j < 4; j++) {
                const float v = fabsf(xu[4 * l + j]);
                m = v > m ? v : m;
                l1 += v;
            }
            int lane_ok = m < 1e30f && !(m > 0.f && m < 1e-25f);
            union { float f; uint32_t u; } bits = {m}, d0 = {0.f};
            const int e = lane_ok && m > 0.f ? (int)((bits.u >> 23) & 0xFF) - 126 : 1;
            d0.u = (uint32_t)(e - 7 + 127) << 23;
            if (m / d0.f > 127.f) d0.u += 1u << 23;
            dv[l] = dv[l + 8] = d0.f * 1.52587890625e-5f;
            inv8[l] = 1.0 / (double)d0.f;
            cen8[l] = 32896.5 * (double)dv[l];
            /* 4 · d₂/2 ≤ K·2⁻²⁵ · Σ|x| over the lane, in float32 with room */
            if (m > 0.f && 2.f * dv[l] > (float)K * 2.98023224e-8f * l1) lane_ok = 0;
            ok &= lane_ok;
        }
        if (!ok) return 0;
        int32_t a[SLICES][32];
        for (int i = 0; i < 32; i += 8) slice8(xu + i, cen8 + i / 4, inv8 + i / 4, &a[0][i], 32); /* lanes i/4, +1 */
        int32_t sums[SLICES][8] = {{0}}, hi[16], lo[16];
#if defined(__AVX512F__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
        for (int k = 0; k < SLICES; k++) { /* the slice's 32 bytes, twice; its lanes' sums, four bytes each */
            const __m256i b = _mm256_setr_m128i(_mm512_cvtepi32_epi8(_mm512_loadu_si512(a[k])),
                                                _mm512_cvtepi32_epi8(_mm512_loadu_si512(a[k] + 16)));
            _mm256_store_si256((__m256i*)(dst + 64 * k), b);
            _mm256_store_si256((__m256i*)(dst + 64 * k + 32), b);
            _mm256_storeu_si256((__m256i*)sums[k], _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_set1_epi8(1), b));
        }
#else
        for (int k = 0; k < SLICES; k++)
            for (int i = 0; i < 32; i++) {
                dst[64 * k + i] = dst[64 * k + 32 + i] = (int8_t)a[k][i];
                sums[k][i / 4] += a[k][i];
            }
#endif
        for (int l = 0; l < 8; l++) { /* the codes' bias (128) times the slices' sums, slices (0, 1) and 2 */
            hi[l] = hi[l + 8] = 128 * (256 * sums[0][l] + sums[1][l]);
            lo[l] = lo[l + 8] = 128 * sums[2][l];
        }
        memcpy(dst + SLICES * 64, dv, 64);
        memcpy(dst + SLICES * 64 + 64, hi, 64);
        memcpy(dst + SLICES * 64 + 128, lo, 64);
    }
    return ok;
}

#ifdef LMHEAD_SLICED_BUILT

/* the scales of groups i, i + 1 of a block's rows (s [4, ng]) in the lanes `lanes` names (0, 1: row r's; 2, 3: row
 * r + 1's), for rows 0, 1 (w01) and 2, 3 (w23) */
static inline void lane_scales2(const float* s, int64_t ng, int64_t i, __m512i lanes, __m512* w01, __m512* w23) {
    const __m128 s01 = _mm_castpd_ps(_mm_loadh_pd(_mm_load_sd((const double*)(s + i)), (const double*)(s + ng + i)));
    const __m128 s23 = _mm_castpd_ps(_mm_loadh_pd(_mm_load_sd((const double*)(s + 2 * ng + i)),
                                                  (const double*)(s + 3 * ng + i)));
    *w01 = _mm512_permutexvar_ps(lanes, _mm512_castps128_ps512(s01));
    *w23 = _mm512_permutexvar_ps(lanes, _mm512_castps128_ps512(s23));
}

/* a block of four weight rows (ROWS4, packed, G = 32, or G = 16: `g16`) against Q sliced query rows (sr[0 .. Q − 1], each ok; Q a
 * constant in each inlined copy): acc[m][r] receives row r's Σ_g scale_g·Σ (code − 8)·x̂ (unsigned codes) or
 * Σ_g scale_g·Σ code·x̂ (signed) for query row m in eight lanes, as rows4_packed_n's loop leaves it for
 * rows4_finish. The codes are unpacked once for the Q rows; each row's sums are the same operations in the same
 * order whatever Q is (its integers are exact, its float multiply-adds go unit by unit), so a row's value is the
 * same bits alone or among others. `tab`: 0 no level table; 1 a table whose levels + bias reach past 31 (IQ4's
 * 240): slices (0, 1) and 2 summed apart and joined in float; 2 a narrow one (MXFP4's 0 … 24): the three slices
 * in one int32 chain, as the codes' — a lane's 8·31·128·(2¹⁶ + 2⁸ + 1) stays below 2³¹ — converted once. */
static inline __attribute__((always_inline)) void sliced_rows4(const int Q, const int g16, const int tab,
                                                               const int8_t* levels, const sliced_row* sr,
                                                               const int8_t* c, const float* s, int64_t ng,
                                                               const char* pf, __m256 (*acc)[4]) {
    const __m512i gather = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)SLICED_GATHER));
    /* lane (chunk, b) of rows r, r + 1: the scale of group 2u + b/2 (G = 32) or 4u + b (G = 16) of its row */
    const __m512i lanes = g16 ? _mm512_set_epi32(7, 6, 5, 4, 7, 6, 5, 4, 3, 2, 1, 0, 3, 2, 1, 0)
                              : _mm512_set_epi32(3, 3, 2, 2, 3, 3, 2, 2, 1, 1, 0, 0, 1, 1, 0, 0);
    const int64_t gpu = g16 ? 4 : 2; /* groups a unit */
    const __m512i low = _mm512_set1_epi8(15), flip = _mm512_set1_epi8((char)(tab ? 0 : 0x88));
    /* a level table (`tab`): its levels + bias as unsigned bytes, indexed by the stored nibble */
    const __m512i table = tab ? _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)levels)) : low;
    __m512 a01[8], a23[8];
    for (int m = 0; m < Q; m++) a01[m] = a23[m] = _mm512_setzero_ps();
    for (int64_t u = 0; u < ng / gpu; u++) {
        fetch_unit(pf, u);
        const int8_t* cu = c + u * 128;
        const __m512i v01 = _mm512_shuffle_epi8(_mm512_xor_si512(_mm512_loadu_si512(cu), flip), gather);
        const __m512i v23 = _mm512_shuffle_epi8(_mm512_xor_si512(_mm512_loadu_si512(cu + 64), flip), gather);
        /* the codes as unsigned bytes: 0 … 15 (the code, or the code + 8 of signed ones), or a table's level + bias */
        __m512i lo01 = _mm512_and_si512(v01, low), hi01 = _mm512_and_si512(_mm512_srli_epi16(v01, 4), low);
        __m512i lo23 = _mm512_and_si512(v23, low), hi23 = _mm512_and_si512(_mm512_srli_epi16(v23, 4), low);
        if (tab) {
            lo01 = _mm512_shuffle_epi8(table, lo01), hi01 = _mm512_shuffle_epi8(table, hi01);
            lo23 = _mm512_shuffle_epi8(table, lo23), hi23 = _mm512_shuffle_epi8(table, hi23);
        }
        const __m512i z = _mm512_setzero_si512();
        /* the lanes' scales: rows r, r + 1's groups of the unit in the lanes' order */
        __m512 w01, w23;
        if (g16) {
            const __m256 s01 = _mm256_insertf128_ps(_mm256_castps128_ps256(_mm_loadu_ps(s + 4 * u)),
                                                    _mm_loadu_ps(s + ng + 4 * u), 1);
            const __m256 s23 = _mm256_insertf128_ps(_mm256_castps128_ps256(_mm_loadu_ps(s + 2 * ng + 4 * u)),
                                                    _mm_loadu_ps(s + 3 * ng + 4 * u), 1);
            w01 = _mm512_permutexvar_ps(lanes, _mm512_castps256_ps512(s01));
            w23 = _mm512_permutexvar_ps(lanes, _mm512_castps256_ps512(s23));
        } else {
            lane_scales2(s, ng, 2 * u, lanes, &w01, &w23);
        }
        for (int m = 0; m < Q; m++) {
            const int8_t* sl = sr[m].units + u * SLICED_UNIT;
            const __m512 d = _mm512_load_ps((const float*)(sl + SLICES * 128));
            if (tab == 1) { /* levels up to 240 (IQ4): slices (0, 1) and 2 summed apart, so that no lane passes 2³¹ */
                const __m512i x0l = _mm512_load_si512(sl), x0h = _mm512_load_si512(sl + 64);
                const __m512i x1l = _mm512_load_si512(sl + 128), x1h = _mm512_load_si512(sl + 192);
                const __m512i x2l = _mm512_load_si512(sl + 256), x2h = _mm512_load_si512(sl + 320);
                const __m512i bh = _mm512_load_si512(sl + SLICES * 128 + 64);
                const __m512i bl = _mm512_load_si512(sl + SLICES * 128 + 128);
                __m512i h01 = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(z, lo01, x0l), hi01, x0h);
                __m512i h23 = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(z, lo23, x0l), hi23, x0h);
                h01 = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_slli_epi32(h01, 8), lo01, x1l), hi01, x1h);
                h23 = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_slli_epi32(h23, 8), lo23, x1l), hi23, x1h);
                const __m512i l01 = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(z, lo01, x2l), hi01, x2h);
                const __m512i l23 = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(z, lo23, x2l), hi23, x2h);
                const __m512 f01 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(h01, bh)),
                                                   _mm512_set1_ps(256.f), _mm512_cvtepi32_ps(_mm512_sub_epi32(l01, bl)));
                const __m512 f23 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(h23, bh)),
                                                   _mm512_set1_ps(256.f), _mm512_cvtepi32_ps(_mm512_sub_epi32(l23, bl)));
                a01[m] = _mm512_fmadd_ps(f01, _mm512_mul_ps(w01, d), a01[m]);
                a23[m] = _mm512_fmadd_ps(f23, _mm512_mul_ps(w23, d), a23[m]);
                continue;
            }
            __m512i t01 = z, t23 = z;
            for (int k = 0; k < SLICES; k++) {
                const __m512i xl = _mm512_load_si512(sl + 128 * k), xh = _mm512_load_si512(sl + 128 * k + 64);
                if (k > 0) t01 = _mm512_slli_epi32(t01, 8), t23 = _mm512_slli_epi32(t23, 8);
                t01 = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(t01, lo01, xl), hi01, xh);
                t23 = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(t23, lo23, xl), hi23, xh);
            }
            const __m512i bias = _mm512_load_si512(sl + SLICES * 128 + 192);
            a01[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(t01, bias)), _mm512_mul_ps(w01, d), a01[m]);
            a23[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(t23, bias)), _mm512_mul_ps(w23, d), a23[m]);
        }
    }
    for (int m = 0; m < Q; m++) {
        acc[m][0] = _mm512_castps512_ps256(a01[m]);
        acc[m][1] = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a01[m]), 1));
        acc[m][2] = _mm512_castps512_ps256(a23[m]);
        acc[m][3] = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a23[m]), 1));
    }
}

/* a block of four weight rows of int8 codes (ROWS4, no offsets, G = 32 or 16: `g16`) against Q sliced query rows
 * (sliced_prepare8's, each ok): acc[m][r] receives row r's Σ_g scale_g·Σ code·x̂ in eight lanes, as
 * rows4_int8_512 and rows4_g16_512 leave theirs. As sliced_rows4: the codes read once for the Q rows, each row's
 * sums the same operations in the same order whatever Q is. */
static inline __attribute__((always_inline)) void sliced8_rows4(const int Q, const int g16, const sliced_row* sr,
                                                                const int8_t* c, const float* s, int64_t ng,
                                                                const char* pf, __m256 (*acc)[4]) {
    /* lane l of rows r, r + 1 (eight each): group u (G = 32) or 2u + l/4 (G = 16) of its row */
    const __m512i lanes = g16 ? _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0)
                              : _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    const int64_t gpu = g16 ? 2 : 1; /* groups a unit */
    const __m512i flip = _mm512_set1_epi8((char)0x80), z = _mm512_setzero_si512();
    const __m512 f256 = _mm512_set1_ps(256.f);
    __m512 a01[8], a23[8];
    for (int m = 0; m < Q; m++) a01[m] = a23[m] = _mm512_setzero_ps();
    for (int64_t u = 0; u < ng / gpu; u++) {
        fetch_unit(pf, u);
        const __m512i u01 = _mm512_xor_si512(_mm512_loadu_si512(c + u * 128), flip); /* code + 128 */
        const __m512i u23 = _mm512_xor_si512(_mm512_loadu_si512(c + u * 128 + 64), flip);
        __m512 w01, w23;
        if (g16) {
            lane_scales2(s, ng, 2 * u, lanes, &w01, &w23);
        } else {
            w01 = _mm512_permutexvar_ps(lanes, _mm512_castps128_ps512(_mm_setr_ps(s[u], s[ng + u], 0.f, 0.f)));
            w23 = _mm512_permutexvar_ps(lanes, _mm512_castps128_ps512(_mm_setr_ps(s[2 * ng + u], s[3 * ng + u], 0.f,
                                                                                   0.f)));
        }
        for (int m = 0; m < Q; m++) {
            const int8_t* sl = sr[m].units + u * SLICED8_UNIT;
            const __m512i x0 = _mm512_load_si512(sl), x1 = _mm512_load_si512(sl + 64), x2 = _mm512_load_si512(sl + 128);
            const __m512 d = _mm512_load_ps((const float*)(sl + SLICES * 64));
            const __m512i bh = _mm512_load_si512(sl + SLICES * 64 + 64), bl = _mm512_load_si512(sl + SLICES * 64 + 128);
            const __m512i h01 = _mm512_dpbusd_epi32(_mm512_slli_epi32(_mm512_dpbusd_epi32(z, u01, x0), 8), u01, x1);
            const __m512i h23 = _mm512_dpbusd_epi32(_mm512_slli_epi32(_mm512_dpbusd_epi32(z, u23, x0), 8), u23, x1);
            const __m512i l01 = _mm512_dpbusd_epi32(z, u01, x2), l23 = _mm512_dpbusd_epi32(z, u23, x2);
            const __m512 f01 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(h01, bh)), f256,
                                               _mm512_cvtepi32_ps(_mm512_sub_epi32(l01, bl)));
            const __m512 f23 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(h23, bh)), f256,
                                               _mm512_cvtepi32_ps(_mm512_sub_epi32(l23, bl)));
            a01[m] = _mm512_fmadd_ps(f01, _mm512_mul_ps(w01, d), a01[m]);
            a23[m] = _mm512_fmadd_ps(f23, _mm512_mul_ps(w23, d), a23[m]);
        }
    }
    for (int m = 0; m < Q; m++) {
        acc[m][0] = _mm512_castps512_ps256(a01[m]);
        acc[m][1] = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a01[m]), 1));
        acc[m][2] = _mm512_castps512_ps256(a23[m]);
        acc[m][3] = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a23[m]), 1));
    }
}
#endif

#endif
