/* The integer path by groups (LMHEAD_GROUPS16), included by coded_kernel.c where it builds the integer path
 * (AVX-512 VNNI): codes in groups of 32 or 16 — int8 codes (Q8_0, Q5_0, Q6_K; with offsets Q5_1, Q5_K), packed signed
 * (Q4_0, Q3_K; with offsets Q2_K), packed unsigned with offsets (Q4_1, Q4_K) and packed indices of a level table
 * (IQ4_NL, IQ4_XS, MXFP4: index XOR 8, each nibble read as its level + 128 by a byte shuffle of coded_kernel.c's
 * NIBBLE_LEVEL_BYTES) — laid out sixteen weight rows a
 * vector. Weights in groups of 16 (`halves`) are groups of their own for the scales and the slices' sums; the
 * activations are sliced per 32 either way.
 *
 *   x [M, K] ──each row's groups of 32 sliced: x̂ = d₂·(2¹⁶·a₀ + 2⁸·a₁ + a₂), d₂ a power of two, a₀ in
 *              −127 … 127, a₁, a₂ in −128 … 127──▶ each (query row, weight row, group): the slices' exact int32 sums S₀, S₁, S₂ with
 *              the codes (VNNI's vpdpbusd, or AMX's tiles for whole blocks of sixteen query rows)
 *            ──one fixed sequence of float operations a group: v = fma(S₀, 2¹⁶, float(2⁸·S₁ + S₂)),
 *              acc = fma(v, d·d₂, [fma(m, d₂·Σx̂/d₂, acc)]) over the groups (halves: each half) in order──▶ y [M, N]
 *
 * Integer sums are exact in any order and on any unit, so a row's value is the same bits alone (VNNI), as one of
 * sixteen rows of a tile (AMX), under any thread count. The representation error of a group is at most
 * 32·d₂/2 < 2⁻¹⁸·max|x| times its weights, within half the float32 dot product's bound (K·2⁻²⁵·Σ|x| for weights
 * alike in size) once K ≥ 256, whatever the group's values: the layout is made only for such matrices. A row with a
 * non-finite value, or a group whose largest value is below 2⁻⁶⁰ (a scale times d₂ would leave float32's normal
 * range), takes g16_plain: the float32 sums of the same weights.
 *
 * Layout: codes [N/16][K/32][8][16][4] bytes, the codes as unsigned bytes c + bias (int8: 128), or packed
 * [N/16][K/32][4][64] where byte 4r + j of vector p holds row r's codes of steps 2p (low nibble) and 2p + 1 (high),
 * each c + bias (Q4_0: 8; Q4_1, Q4_K: 0), or 5- and 6-bit codes (HIGH1, HIGH2) [N/16][K/32][4 + hb][64]: the packed
 * nibbles of c + bias (unsigned: 0; signed: 16, 32), then hb vectors of their top bits, step q's at bit
 * hb·(q mod 8/hb) of vector q / (8/hb); scales and offsets [N/16][K/32][16] float16 (MXFP4's scales may be its
 * exponent bytes, [N/16][K/32][16] uint8), or a K-quant's as its
 * blocks hold them (sub): d [N/16][K/256][16] float32 then sub [N/16][K/group][16] int8, a group's scale the float32
 * product d·sub (exact: the four-row layout's SUB numbers). N a multiple of 16. */
#ifndef LMHEAD_GROUPS_KERNEL_H
#define LMHEAD_GROUPS_KERNEL_H

#include <sys/syscall.h>
#include <unistd.h>

#include "thread_shares.h"

enum { G16_NB = 4 }; /* blocks of sixteen weight rows a query row takes at once: independent chains, shared loads */
/* the codes are prefetched this many groups ahead along each block's stream, into L2, by a round's first query row:
 * three dot products a code vector fill the out-of-order window before enough loads are in flight to stream the
 * codes from memory at the rate a plain read does. A block's stream is short (K/32 groups of 512 or 256 bytes) and
 * four run at once, so packed codes too — half the bytes for the same arithmetic — fell behind the read where left
 * to the CPU's prefetchers alone (AMD's Zen 4): each of their lines is fetched once, ahead of the two steps it holds */
enum { G16_AHEAD = 8 };

/* what the layout adds to a code to make it an unsigned byte: `hb` the top bits in a plane (1: 5-bit codes, 2: 6-bit)
 * — half their range where signed, as for signed nibbles */
static inline int g16_bias(int packed, int signed4, int table, int hb) {
    if (hb) return signed4 ? 8 << hb : 0;
    return !packed || table >= 0 ? 128 : signed4 ? 8 : 0;
}

/* table t's sixteen levels in nibble order as the bytes level + 128 (level XOR 0x80), in each 128-bit lane: a
 * shuffle's table; zero where t < 0 */
static inline __m512i g16_lut(int t) {
    if (t < 0) return _mm512_setzero_si512();
    return _mm512_xor_si512(_mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)NIBBLE_LEVEL_BYTES[t])),
                            _mm512_set1_epi8((char)0x80));
}

/* a query row's slices: slice k's group g at a + k·plane + g·gstride (the rows' layout: plane M·K, gstride 32, this
 * row at offset m·K; the tiles': plane G16_TILE_SLICE, gstride G16_TILE_GROUP), d2 [G], t [G][3][3] (each slice's
 * sum over the group, its first and its second sixteen), vx [G][3] (x̂'s sums over the same, in units of d₂);
 * returns whether the row takes the integer path. Per group, d₀ the smallest power of two with max|x|/d₀ ≤ 127,
 * d₂ = d₀·2⁻¹⁶, R = ⌊x/d₂ + ½⌋ (x/d₂ is exact: a power of two's multiple, |x/d₂| < 2²³), and R + 32896 split into
 * bytes: a₀ its bits from 16 up (arithmetic shift), a₁ and a₂ its second and first byte less 128, so that
 * x̂ = d₂·(2¹⁶·a₀ + 2⁸·a₁ + a₂) = d₂·R and |x − x̂| ≤ d₂/2 (sliced_kernel.h's slicing, per group, in integers) */
static int g16_slice(const float* x, int64_t K, int8_t* a, int64_t plane, int64_t gstride, float* d2, int32_t* t,
                     float* vx) {
    const int64_t G = K / 32;
    const __m512 abs_mask = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
    const __m512i center = _mm512_set1_epi32(32896), byte = _mm512_set1_epi32(255), half = _mm512_set1_epi32(128);
    int ok = 1;
    for (int64_t g = 0; g < G; g++) {
        const __m512 x0 = _mm512_loadu_ps(x + g * 32), x1 = _mm512_loadu_ps(x + g * 32 + 16);
        const float mx = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_and_ps(x0, abs_mask), _mm512_and_ps(x1, abs_mask)));
        const int nan = (_mm512_cmp_ps_mask(x0, x0, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(x1, x1, _CMP_UNORD_Q)) != 0;
        /* (max_ps passes a NaN over); below 2⁻⁶⁰ a scale times d₂ would leave float32's normal range */
        if (nan || mx > FLT_MAX || (mx > 0.f && mx < 0x1p-60f)) ok = 0;
        /* d₀ = 2^(e − 7) for mx = f·2^e, f in [0.5, 1) (its exponent bits), doubled where mx / d₀ > 127; a power
         * of two from 2⁻⁶⁷ to 2¹²², so d₂ and 1/d₂ are float32 normals */
        float d0 = 1.f;
        if (ok && mx > 0.f) {
            union { float f; uint32_t u; } v = {mx}, p;
            p.u = (uint32_t)((int32_t)((v.u >> 23) & 0xff) - 6) << 23;
            d0 = p.f;
            if (mx > 127.f * d0) d0 *= 2.f;
        }
        d2[g] = d0 * 0x1p-16f;
        const __m512 inv = _mm512_set1_ps(0x1p16f / d0);
        int32_t* tg = t + g * 9;
        for (int s = 0; s < 2; s++) {
            const __m512 u = ok ? _mm512_mul_ps(s ? x1 : x0, inv) : _mm512_setzero_ps();
            const __m512 fl = _mm512_roundscale_ps(u, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
            /* u − ⌊u⌋ is exact (or, for u a hair below 0, rounds to 1: R is 0 either way) */
            const __mmask16 up = _mm512_cmp_ps_mask(_mm512_sub_ps(u, fl), _mm512_set1_ps(0.5f), _CMP_GE_OQ);
            __m512i r = _mm512_add_epi32(_mm512_cvtps_epi32(fl), center);
            r = _mm512_mask_add_epi32(r, up, r, _mm512_set1_epi32(1));
            const __m512i q[3] = {_mm512_srai_epi32(r, 16),
                                  _mm512_sub_epi32(_mm512_and_si512(_mm512_srai_epi32(r, 8), byte), half),
                                  _mm512_sub_epi32(_mm512_and_si512(r, byte), half)};
            for (int k = 0; k < 3; k++) {
                _mm_storeu_si128((__m128i*)(a + k * plane + g * gstride + 16 * s), _mm512_cvtepi32_epi8(q[k]));
                tg[3 + 3 * s + k] = _mm512_reduce_add_epi32(q[k]);
            }
        }
        for (int k = 0; k < 3; k++) tg[k] = tg[3 + k] + tg[6 + k];
        for (int p = 0; p < 3; p++) vx[g * 3 + p] = fmaf((float)tg[3 * p], 65536.f, (float)(tg[3 * p + 1] * 256 + tg[3 * p + 2]));
    }
    return ok;
}

/* a group's value into a row's sum: the one sequence both paths take (s0..s2 the slices' exact sums) */
static inline __m512 g16_add(__m512 acc, __m512i s0, __m512i s1, __m512i s2, __m512 d, __m512 m, float d2, float vx,
                             int offsets) {
    const __m512 v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s0), _mm512_set1_ps(65536.f),
                                     _mm512_cvtepi32_ps(_mm512_add_epi32(_mm512_slli_epi32(s1, 8), s2)));
    if (offsets) acc = _mm512_fmadd_ps(m, _mm512_set1_ps(vx * d2), acc);
    return _mm512_fmadd_ps(v, _mm512_mul_ps(d, _mm512_set1_ps(d2)), acc);
}

static inline __m512 g16_halves(const uint16_t* h) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)h)); }

/* how a layout holds its scales: float16 numbers, a K-quant's d and sub, or exponent bytes e (MXFP4's E8M0, the
 * number 2^(e − 128); laid out only for the scales within float16's range, layout16.EXPONENTS, so that each scale's
 * product with d₂ stays normal as a float16 scale's does) */
enum { G16_HALF, G16_SUB, G16_E8M0 };

/* the scales (or offsets) s of block b's weight group g (of GS a row), sixteen rows, of kind `skind`: float16, d·sub
 * (N rows; `per` groups to a d: 8 for groups of 32, 16 for groups of 16), or 2^(e − 128) — lmhead_e8m0's number
 * for every byte: the float32 whose exponent bits are e − 1, or for e < 2 the subnormal 0x00200000 << e */
static inline __m512 g16_scales(const void* s, int skind, int64_t N, int64_t GS, int per, int64_t b, int64_t g) {
    if (skind == G16_E8M0) {
        const __m512i e = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)((const uint8_t*)s + (b * GS + g) * 16)));
        const __m512i normal = _mm512_slli_epi32(_mm512_sub_epi32(e, _mm512_set1_epi32(1)), 23);
        const __mmask16 tiny = _mm512_cmplt_epi32_mask(e, _mm512_set1_epi32(2));
        return _mm512_castsi512_ps(_mm512_mask_sllv_epi32(normal, tiny, _mm512_set1_epi32(0x00200000), e));
    }
    if (skind == G16_HALF) return g16_halves((const uint16_t*)s + (b * GS + g) * 16);
    const float* d = (const float*)s;
    const int8_t* sb = (const int8_t*)(d + N * (GS / per)) + (b * GS + g) * 16;
    return _mm512_mul_ps(_mm512_loadu_ps(d + (b * (GS / per) + g / per) * 16),
                         _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)sb))));
}

/* one row's (n) scale of weight group g: g16_scales' lane */
static inline float g16_scale1(const void* s, int skind, int64_t N, int64_t GS, int per, int64_t n, int64_t g) {
    const int64_t b = n / 16, lane = n % 16;
    if (skind == G16_E8M0) return lmhead_e8m0(((const uint8_t*)s)[(b * GS + g) * 16 + lane]);
    if (skind == G16_HALF) return half_to_float(((const uint16_t*)s)[(b * GS + g) * 16 + lane]);
    const float* d = (const float*)s;
    const int8_t* sb = (const int8_t*)(d + N * (GS / per));
    return d[(b * (GS / per) + g / per) * 16 + lane] * (float)sb[(b * GS + g) * 16 + lane];
}

/* the codes of step q of a group's unit, as unsigned bytes (`levels`: the nibbles' levels + 128, by `lut`; `hb`:
 * the nibbles' top bits from the plane after them — step q's hb bits at bit hb·(q % (8/hb)) of vector
 * q / (8/hb) — moved to bits 4 … 3 + hb and joined by one bitwise select) */
static inline __m512i g16_step(const uint8_t* unit, int q, int packed, int levels, __m512i lut, int hb) {
    if (!packed && !hb) return _mm512_loadu_si512(unit + q * 64);
    const __m512i b = _mm512_loadu_si512(unit + (q / 2) * 64);
    const __m512i nib = _mm512_and_si512(q % 2 ? _mm512_srli_epi16(b, 4) : b, _mm512_set1_epi8(15));
    if (hb) {
        const int per = 8 / hb, at = hb * (q % per); /* the step's bits in its plane byte */
        const __m512i h = _mm512_loadu_si512(unit + 256 + (q / per) * 64);
        /* 16-bit shifts: the bits that cross from a neighbouring byte fall outside the mask */
        const __m512i up = at < 4 ? _mm512_slli_epi16(h, 4 - at) : at > 4 ? _mm512_srli_epi16(h, at - 4) : h;
        return _mm512_ternarylogic_epi32(nib, up, _mm512_set1_epi8((char)(((1 << hb) - 1) << 4)), 0xF8); /* a | b & c */
    }
    return levels ? _mm512_shuffle_epi8(lut, nib) : nib;
}

/* the codes: int8, packed nibbles, packed indices of a table, packed nibbles with one or two top bits in a plane */
enum { G16_INT8, G16_NIBBLES, G16_LEVELS_KIND, G16_HIGH1, G16_HIGH2, G16_KINDS };

/* the top bits a layout's flags put in a plane (HIGH1, HIGH2; −1 for both) */
static inline int g16_high_bits(int flags) {
    const int hb = ((flags & LMHEAD_HIGH1) ? 1 : 0) + ((flags & LMHEAD_HIGH2) ? 2 : 0);
    return hb == 3 ? -1 : hb;
}

/* bytes of a group's unit (sixteen rows by 32 codes): int8 codes, nibbles, nibbles and a plane of hb bits */
static inline int64_t g16_unit(int packed, int hb) { return !packed && !hb ? 512 : 256 + 64 * hb; }

/* the copies of g16_rows by how the scales are held (MODE): float16, a K-quant's d and sub in groups of 32,
 * exponent bytes, d and sub in groups of 16 (two halves a group of 32) — a constant in each copy, so that no copy
 * holds another's scale code */
enum { G16_M_HALF, G16_M_SUB, G16_M_E8M0, G16_M_SUB16, G16_MODES };

/* one query row (its slices a, plane apart) against weight rows 16·b0 .. 16·(b0 + NB) − 1 — NB ≤ G16_NB, MODE
 * and KIND constants in each copy below, so that a group's steps unroll; `ahead`: the codes prefetched G16_AHEAD
 * groups ahead of each block (past a block's last group, the next round's block in its place) */
KERNEL_INLINE void g16_rows(const int NB, const int MODE, const int KIND, const int8_t* a, int64_t plane,
                            const float* d2, const int32_t* t, const float* vx, int64_t K, const uint8_t* codes,
                            const void* s16, const void* m16, int64_t N, int table, int32_t bias, int64_t b0,
                            float* y, int ahead) {
    const int H = MODE == G16_M_SUB16 ? 2 : 1;
    const int skind = MODE == G16_M_HALF ? G16_HALF : MODE == G16_M_E8M0 ? G16_E8M0 : G16_SUB;
    const int hb = KIND == G16_HIGH1 ? 1 : KIND == G16_HIGH2 ? 2 : 0;
    const int packed = KIND == G16_NIBBLES || KIND == G16_LEVELS_KIND, halves = H == 2;
    const int64_t G = K / 32, unit = g16_unit(packed, hb), GS = G * H;
    const __m512i lut = g16_lut(KIND == G16_LEVELS_KIND ? table : -1);
    const int per = halves ? 16 : 8;
    const int32_t* ap[3] = {(const int32_t*)a, (const int32_t*)(a + plane), (const int32_t*)(a + 2 * plane)};
    __m512 acc[4];
    for (int j = 0; j < NB; j++) acc[j] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; g++)
        for (int h = 0; h < H; h++) {
            const int32_t* th = t + g * 9 + (halves ? 3 + 3 * h : 0);
            const int64_t next = g + G16_AHEAD < G ? b0 * G + g + G16_AHEAD : (b0 + NB) * G + g + G16_AHEAD - G;
            __m512i r[4][3];
            for (int j = 0; j < NB; j++)
                for (int s = 0; s < 3; s++) r[j][s] = _mm512_set1_epi32(-bias * th[s]);
#pragma GCC unroll 8
            for (int q = h * 8 / H; q < (h + 1) * 8 / H; q++) {
                __m512i sv[3];
                for (int s = 0; s < 3; s++) sv[s] = _mm512_set1_epi32(ap[s][g * 8 + q]);
                for (int j = 0; j < NB; j++) {
                    /* each line of the unit once: packed, vector q/2 holds steps q, q+1 */
                    if (ahead && (packed ? q % 2 == 0 : q < unit / 64))
                        _mm_prefetch((const char*)(codes + (next + j * G) * unit + (packed ? q / 2 : q) * 64),
                                     _MM_HINT_T1);
                    const __m512i c = g16_step(codes + ((b0 + j) * G + g) * unit, q, packed,
                                               KIND == G16_LEVELS_KIND, lut, hb);
                    for (int s = 0; s < 3; s++) r[j][s] = _mm512_dpbusd_epi32(r[j][s], c, sv[s]);
                }
            }
            const int64_t gs = g * H + h;
            const float vh = vx[g * 3 + (halves ? 1 + h : 0)];
            for (int j = 0; j < NB; j++)
                acc[j] = g16_add(acc[j], r[j][0], r[j][1], r[j][2], g16_scales(s16, skind, N, GS, per, b0 + j, gs),
                                 m16 ? g16_scales(m16, skind, N, GS, per, b0 + j, gs) : _mm512_setzero_ps(), d2[g], vh,
                                 m16 != NULL);
        }
    for (int j = 0; j < NB; j++) _mm512_storeu_ps(y + (b0 + j) * 16, acc[j]);
}

#define G16_ROWS(NB, MODE, KIND)                                                                                  \
    static void g16_rows_##NB##_##MODE##_##KIND(const int8_t* a, int64_t plane, const float* d2, const int32_t* t,    \
                                                const float* vx, int64_t K, const uint8_t* codes, const void* s16,    \
                                                const void* m16, int64_t N, int table, int32_t bias, int64_t b0,      \
                                                float* y, int ahead) {                                                \
        g16_rows(NB, MODE, KIND, a, plane, d2, t, vx, K, codes, s16, m16, N, table, bias, b0, y, ahead);             \
    }
#define G16_ROWS_NB(MODE, KIND) \
    G16_ROWS(1, MODE, KIND) G16_ROWS(2, MODE, KIND) G16_ROWS(3, MODE, KIND) G16_ROWS(4, MODE, KIND)
#define G16_ROWS_KIND(KIND) G16_ROWS_NB(0, KIND) G16_ROWS_NB(1, KIND) G16_ROWS_NB(2, KIND) G16_ROWS_NB(3, KIND)
G16_ROWS_KIND(0) G16_ROWS_KIND(1) G16_ROWS_KIND(2) G16_ROWS_KIND(3) G16_ROWS_KIND(4)
typedef void (*g16_rows_fn)(const int8_t*, int64_t, const float*, const int32_t*, const float*, int64_t,
                            const uint8_t*, const void*, const void*, int64_t, int, int32_t, int64_t, float*, int);
#define G16_ROWS_ROW(MODE, KIND)                                                                 \
    {NULL, g16_rows_1_##MODE##_##KIND, g16_rows_2_##MODE##_##KIND, g16_rows_3_##MODE##_##KIND, \
     g16_rows_4_##MODE##_##KIND}
#define G16_ROWS_MODES(KIND) {G16_ROWS_ROW(0, KIND), G16_ROWS_ROW(1, KIND), G16_ROWS_ROW(2, KIND), G16_ROWS_ROW(3, KIND)}
/* [KIND][MODE][NB] */
static const g16_rows_fn G16_ROWS_OF[G16_KINDS][G16_MODES][G16_NB + 1] = {
    G16_ROWS_MODES(0), G16_ROWS_MODES(1), G16_ROWS_MODES(2), G16_ROWS_MODES(3), G16_ROWS_MODES(4)};

/* weight k of row n's code (K/32 = G groups a row): its stored byte (or nibble and top bits) less the bias, or a
 * table's level */
static inline int g16_code(const uint8_t* codes, int64_t G, int packed, int table, int32_t bias, int hb, int64_t n,
                           int64_t k) {
    const uint8_t* u = codes + ((n / 16) * G + k / 32) * g16_unit(packed, hb);
    const int q = (int)(k % 32) / 4, at = (int)(n % 16) * 4 + (int)(k % 4);
    if (!packed && !hb) return u[q * 64 + at] - bias;
    const int byte = u[(q / 2) * 64 + at];
    const int nib = q % 2 ? byte >> 4 : byte & 15;
    if (hb) {
        const int per = 8 / hb, top = (u[256 + (q / per) * 64 + at] >> (hb * (q % per))) & ((1 << hb) - 1);
        return (nib | top << 4) - bias;
    }
    return table >= 0 ? NIBBLE_LEVEL_BYTES[table][nib] : nib - bias;
}

/* a row the integer path refuses: float32 sums over the same weights, group by group */
static void g16_plain(const float* x, int64_t K, const uint8_t* codes, const void* s16, const void* m16, int skind,
                      int halves, int packed, int table, int32_t bias, int hb, int64_t N, float* y) {
    const int64_t G = K / 32, group = halves ? 16 : 32, GS = K / group;
    const int per = halves ? 16 : 8;
    for (int64_t n = 0; n < N; n++) {
        float acc = 0.f;
        for (int64_t gs = 0; gs < GS; gs++) {
            float cx = 0.f, sx = 0.f;
            for (int64_t k = gs * group; k < (gs + 1) * group; k++) {
                const int c = g16_code(codes, G, packed, table, bias, hb, n, k);
                cx = fmaf((float)c, x[k], cx);
                sx += x[k];
            }
            acc = fmaf(g16_scale1(s16, skind, N, GS, per, n, gs), cx, acc);
            if (m16) acc = fmaf(g16_scale1(m16, skind, N, GS, per, n, gs), sx, acc);
        }
        y[n] = acc;
    }
}

/* row n as float32 (an embedding's row: lmhead_groups_row): w = code·scale + offset of its group, two float32
 * operations never fused, as layout16's dequantize — the model's weights bit for bit */
__attribute__((optimize("fp-contract=off")))
static void g16_row(const uint8_t* codes, const void* s16, const void* m16, int skind, int halves, int packed,
                    int signed4, int table, int hb, int64_t N, int64_t K, int64_t n, float* out) {
    const int64_t G = K / 32, group = halves ? 16 : 32, GS = K / group;
    const int per = halves ? 16 : 8;
    const int32_t bias = g16_bias(packed, signed4, table, hb);
    for (int64_t k = 0; k < K; k++) {
        const int64_t gs = k / group;
        float w = (float)g16_code(codes, G, packed, table, bias, hb, n, k) * g16_scale1(s16, skind, N, GS, per, n, gs);
        if (m16) w = w + g16_scale1(m16, skind, N, GS, per, n, gs);
        out[k] = w;
    }
}

/* the tiles' slices: per sixteen query rows and group, the three slices' [16][32] bytes one after another, so that a
 * tile's load reads eight whole lines in a row (from the rows' layout a tile's sixteen rows are K bytes apart: half a
 * line each, and for K a multiple of 1024 all in a few of L1's sets) */
enum { G16_TILE_SLICE = 16 * 32, G16_TILE_GROUP = 3 * G16_TILE_SLICE };
/* the tiles' query rows are taken in chunks whose slices stay in L2 while each block of the matrix passes them
 * (a whole prefill chunk's slices of a wide matrix, 3·M·K bytes, do not) */
enum { G16_TILE_CHUNK_BYTES = 384 << 10 };

#if defined(__AMX_INT8__) && defined(__AMX_TILE__)
#define G16_AMX 1
typedef struct {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} g16_tile_config;

/* whether this process may use AMX's tiles: asked of the kernel once (a tile instruction without its grant is an
 * illegal instruction) */
static int g16_amx_granted(void) {
    static int granted = 0; /* 0 not asked, 1 granted, -1 refused */
    if (granted == 0) granted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0 ? 1 : -1;
    return granted == 1;
}

/* H 1: a group of 32 at a time; H 2: each sixteen of it (weights in groups of 16) */
static void g16_tiles_configure(int H) {
    g16_tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    for (int i = 0; i < 3; i++) cfg.rows[i] = 16, cfg.colsb[i] = 64;     /* the three slices' sums: 16 x 16 int32 */
    for (int i = 3; i < 6; i++) cfg.rows[i] = 16, cfg.colsb[i] = 32 / H; /* the slices: 16 query rows x 32/H bytes */
    cfg.rows[6] = 8 / H, cfg.colsb[6] = 64;                              /* the codes: 8/H x (16 rows x 4) */
    _tile_loadconfig(&cfg);
}

/* query rows m0 .. m0+15 (their slices `ta`: the layout above) against weight rows 16b .. 16b+15, whose codes are
 * bytes [G][8][64]: signed (int8 codes, a level table's levels: tdpbssd, nothing to subtract) or unsigned (other
 * packed codes: tdpbsud, the bias times the slices' sums subtracted) */
static void g16_tile(const int8_t* ta, const float* d2, const int32_t* t, const float* vx, int64_t m0,
                     int64_t K, const uint8_t* u8, int unsigned_codes, int32_t bias, const void* s16, const void* m16,
                     int skind, int halves, int64_t b, float* y, int64_t N) {
    const int64_t G = K / 32, H = halves ? 2 : 1, GS = G * H;
    const int per = halves ? 16 : 8;
    int32_t S[3][256] __attribute__((aligned(64)));
    __m512 acc[16];
    for (int i = 0; i < 16; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t gs = 0; gs < GS; gs++) {
        const int64_t g = gs / H, h = gs % H;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        const int8_t* tg = ta + (m0 / 16 * G + g) * G16_TILE_GROUP + h * 16;
        _tile_loadd(6, u8 + g * 512 + h * 256, 64);
        _tile_loadd(3, tg, 32);
        _tile_loadd(4, tg + G16_TILE_SLICE, 32);
        _tile_loadd(5, tg + 2 * G16_TILE_SLICE, 32);
        if (!unsigned_codes) {
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
        const __m512 dv = g16_scales(s16, skind, N, GS, per, b, gs);
        const __m512 mv = m16 ? g16_scales(m16, skind, N, GS, per, b, gs) : dv;
        for (int i = 0; i < 16; i++) {
            const int64_t mg = (m0 + i) * G + g;
            const int32_t* th = t + mg * 9 + (halves ? 3 + 3 * h : 0);
            __m512i s[3];
            for (int q = 0; q < 3; q++) {
                s[q] = _mm512_load_si512(S[q] + 16 * i);
                if (unsigned_codes && bias) s[q] = _mm512_sub_epi32(s[q], _mm512_set1_epi32(bias * th[q]));
            }
            acc[i] = g16_add(acc[i], s[0], s[1], s[2], dv, mv, d2[mg], vx[mg * 3 + (halves ? 1 + h : 0)], m16 != NULL);
        }
    }
    for (int i = 0; i < 16; i++) _mm512_storeu_ps(y + (m0 + i) * N + b * 16, acc[i]);
}
#endif

/* y [M, N] = x [M, K] · Wᵀ over the layout above (m16 NULL: no offsets; `skind`: how the scales are held; `halves`:
 * the weights in groups of 16, sub-scaled). Returns 0, -1 for shapes it does not take, LMHEAD_NO_MEMORY */
static int groups16_matmul(const float* x, int64_t M, int64_t K, const uint8_t* codes, const void* s16,
                           const void* m16, int skind, int halves, int64_t N, int packed, int signed4, int table,
                           int hb, float* y, int threads) {
    if (N % 16 || K % 32 || K < 256 || M < 0 || (signed4 && !packed && !hb) || (skind == G16_SUB && K % 256) ||
        (halves && skind != G16_SUB) || (skind == G16_E8M0 && m16) ||
        (table >= 0 && (!packed || signed4 || m16)) || hb < 0 || hb > 2 || (hb && (packed || table >= 0)))
        return -1;
    if (M == 0 || N == 0) return 0;
    if (threads < 1) threads = 1;
    const int64_t G = K / 32, unit = g16_unit(packed, hb);
    const int32_t bias = g16_bias(packed, signed4, table, hb);
    const int unsigned_codes = (packed && table < 0) || hb; /* the tiles' codes: signed (the bias taken off) or not */
    const __m512i lut = g16_lut(table);
    const int mode = halves ? G16_M_SUB16 : skind == G16_HALF ? G16_M_HALF : skind == G16_E8M0 ? G16_M_E8M0 : G16_M_SUB;
    const int kind = hb ? G16_HIGH1 + hb - 1 : !packed ? G16_INT8 : table >= 0 ? G16_LEVELS_KIND : G16_NIBBLES;
    const g16_rows_fn* rows_of = G16_ROWS_OF[kind][mode];
    int64_t tiled = 0; /* the rows AMX's tiles take, sixteen at a time */
#ifdef G16_AMX
    if (M >= 16 && g16_amx_granted()) tiled = M / 16 * 16;
#endif
    const int64_t plane = (M - tiled) * K; /* the other rows' slices: the rows' layout, [3][M − tiled][K] */
    /* the slices (the tiles' layout, then the rows') and their sums in one buffer: on the stack for a decode step's
     * row (a call's bookkeeping is a visible share of a small model's step) */
    const size_t need = (size_t)(3 * M * K) + (size_t)(M * G) * (4 * sizeof(float) + 9 * sizeof(int32_t)) + (size_t)M;
    _Alignas(64) unsigned char stack[16384];
    unsigned char* buf = need <= sizeof stack ? stack : aligned_alloc(64, (need + 63) / 64 * 64);
    if (!buf) return LMHEAD_NO_MEMORY;
    int8_t* ta = (int8_t*)buf;
    int8_t* a = ta + 3 * tiled * K;
    float* d2 = (float*)(a + 3 * plane);
    float* vx = d2 + M * G;
    int32_t* t = (int32_t*)(vx + M * G * 3);
    unsigned char* ok = (unsigned char*)(t + M * G * 9);
    int all_ok = 1;
    if (M == 1) {
        all_ok = ok[0] = (unsigned char)g16_slice(x, K, a, plane, 32, d2, t, vx);
    } else {
#pragma omp parallel for num_threads(threads) schedule(static) reduction(& : all_ok)
        for (int64_t m = 0; m < M; m++) {
            const int in_tile = m < tiled;
            int8_t* am = in_tile ? ta + m / 16 * G * G16_TILE_GROUP + m % 16 * 32 : a + (m - tiled) * K;
            ok[m] = (unsigned char)g16_slice(x + m * K, K, am, in_tile ? G16_TILE_SLICE : plane,
                                             in_tile ? G16_TILE_GROUP : 32, d2 + m * G, t + m * G * 9, vx + m * G * 3);
            all_ok &= ok[m];
        }
    }
    int failed = 0;
    /* the blocks of sixteen weight rows: four (a round) at a time; for the tiles one block against one chunk of
     * query rows a round, chunk by chunk */
    int64_t chunk = G16_TILE_CHUNK_BYTES / (3 * K) / 16 * 16;
    if (chunk < 16) chunk = 16;
    if (chunk > tiled) chunk = tiled;
    const int64_t chunks = tiled ? (tiled + chunk - 1) / chunk : 0, NB16 = N / 16;
    shares blocks, tiles;
    if (shares_open(&blocks, NB16, G16_NB, threads)) {
        if (buf != stack) free(buf);
        return LMHEAD_NO_MEMORY;
    }
    if (shares_open(&tiles, chunks * NB16, 1, threads)) {
        shares_close(&blocks);
        if (buf != stack) free(buf);
        return LMHEAD_NO_MEMORY;
    }
#pragma omp parallel num_threads(threads)
    {
#ifdef G16_AMX
        uint8_t* u8 = tiled ? malloc((size_t)G * 512) : NULL; /* a block's codes a byte each, for the tiles */
        if (tiled && !u8) {
#pragma omp atomic write
            failed = 1;
        }
        if (u8) g16_tiles_configure(halves ? 2 : 1);
        share_cursor tile_cursor = share_start();
        for (int64_t u; u8 && (u = shares_unit(&tiles, &tile_cursor)) >= 0;) {
            const int64_t b = u % NB16, first = u / NB16 * chunk, end = first + chunk < tiled ? first + chunk : tiled;
            const __m512i flip = _mm512_set1_epi8(unsigned_codes ? 0 : (char)0x80); /* c + 128 back to c */
            for (int64_t g = 0; g < G; g++)
                for (int q = 0; q < 8; q++)
                    _mm512_storeu_si512(u8 + g * 512 + q * 64,
                                        _mm512_xor_si512(g16_step(codes + (b * G + g) * unit, q, packed, table >= 0,
                                                                  lut, hb), flip));
            for (int64_t m0 = first; m0 < end; m0 += 16)
                g16_tile(ta, d2, t, vx, m0, K, u8, unsigned_codes, bias, s16, m16, skind, halves, b, y, N);
        }
#endif
        /* the rest of the rows: each thread a share of the blocks (one stream, thread_shares.h), four blocks at a
         * time, every query row against them before the next four — a round's rows read the matrix from memory
         * once, not once a row (each block's sums are its own: the same bits whichever thread takes it) */
        share_cursor cursor = share_start();
        int64_t nb;
        for (int64_t b0; tiled < M && (b0 = shares_next(&blocks, &cursor, &nb)) >= 0;)
            for (int64_t m = tiled; m < M; m++)
                rows_of[nb](a + (m - tiled) * K, plane, d2 + m * G, t + m * G * 9, vx + m * G * 3, K, codes, s16, m16,
                            N, table, bias, b0, y + m * N, m == tiled);
#ifdef G16_AMX
        if (u8) _tile_release();
        free(u8);
#endif
    }
    if (!all_ok)
        for (int64_t m = 0; m < M; m++)
            if (!ok[m])
                g16_plain(x + m * K, K, codes, s16, m16, skind, halves, packed, table, bias, hb, N, y + m * N);
    if (buf != stack) free(buf);
    shares_close(&blocks);
    shares_close(&tiles);
    return failed ? LMHEAD_NO_MEMORY : 0;
}

#endif
