/* lmhead's coded matrix product: y = x · Wᵀ where W is stored as the GGUF file stored it — small integer
 * codes with one scale (and, for some formats, one offset) per group of G weights of a row:
 *
 *     W[n, g·G + i] = scale[n, g] · code[n, g·G + i] + offset[n, g]
 *
 *     y[m, n] = Σ_k W[n, k] · x[m, k]
 *
 * in float32 from the weights' own codes and scales (models/gguf_codes.py checks, weight by weight, that they
 * give back the float32 matrix). The group's scale is factored out, Σ_g scale_g·Σ_i code_i·x_i, one multiply per
 * weight instead of two. Every query row is summed in one fixed order, the one-row (decode) product's, whatever
 * the number of rows or threads: a row's value is the same bits alone, as one of a server round's rows, a
 * position of a draft's verification or of a prefill chunk (batch invariance; float32 additions in another
 * order would change the 6th digit of a request's logprobs with what else is in the batch). Offsets of 4-bit
 * codes are factored out around the codes' middle, Σ_g scale_g·Σ_i (code_i − 8)·x_i + Σ_g (offset_g +
 * 8·scale_g)·Σ_i x_i: the plain split, offset_g·Σ_i x_i, cancels against the codes' sum (for the usual
 * zero-centred weights offset ≈ −8·scale) and doubled the error against float64 on Gemma's logits; int8 codes
 * with offsets are rebuilt. Nothing is approximated; only the rounding of the float32 additions differs from a
 * plain product (tests bound it against float64). A decode step reads 0.6–1.1 bytes per weight instead of
 * float32's 4, and on a CPU whose memory is the limit that is the time.
 *
 * Codes are int8 [N, K] (row-major), or — `packed`, for unsigned 4-bit codes, G = 32 and K a multiple of 64 —
 * two per byte [N, K/2]: each pair of groups (64 codes) is 32 bytes read as eight uint32 lanes, nibble i of
 * lane l holding code 8·i + l XOR 8 (code − 8 as a signed nibble), so that two shifts give eight consecutive
 * codes − 8 in the eight lanes
 * (no byte shuffles: unpacking was what bounded the product, not memory); `flags & LMHEAD_SIGNED4` — signed 4-bit
 * codes −8..7 (Q4_0) — the nibble holds the code itself, the same two shifts give it, and there is nothing to
 * centre; `flags & LMHEAD_IQ4` — IQ4_NL's sixteen levels (IQ4_NL, IQ4_XS) — it holds the level's index XOR 8, and a
 * permute from the levels gives the code. Either way a row is a run of 32-byte
 * units (32 int8 codes, or 64 packed ones); `flags & LMHEAD_ROWS4` (G = 32, or G = 16 for int8 codes — Q6_K,
 * Q3_K, Q2_K: two groups to a unit —, N a multiple of 4) stores each
 * block of four rows unit by unit — unit u of rows 4b..4b+3 side by side — so that the decode product reads
 * four rows in one forward stream (four rows at once from four separate streams measured slower than one
 * row at a time: the prefetcher, not the arithmetic, was the limit). Scale and offset [N, K/G], float32,
 * or — `flags & LMHEAD_HALF`, where every one of them is a float16 number (the d and m of Q4_0, Q4_1, Q5_0,
 * Q8_0 blocks are) — float16, converted to the same float32 values per row; offset may be NULL; G is 16 or 32;
 * x float32 [M, K]; y float32 [M, N]. Rows n are split over `threads` OpenMP threads (the same libgomp as
 * torch's, so the two share one pool). Built once per machine by models/coded_linear.py with the system C
 * compiler (-O3 -march=native); without AVX2 the plain loop below is what the compiler vectorises; with AVX-512
 * the one-row (decode) products of every layout run in 512-bit lanes (rows4_*_512, dense16_row512): half the
 * instructions per weight, the same products and scales summed in another order.
 */
#include <float.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif

#include "kernel_results.h"
#include "quant_types.h"
#include "thread_shares.h"

/* the integer path of packed products (sliced_kernel.h) is built where the CPU has AVX-512 VNNI */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define LMHEAD_SLICED_BUILT 1
#endif

#ifndef PREFETCH_AHEAD
#define PREFETCH_AHEAD 2 /* blocks of four rows: see the decode product below */
#endif
#define DENSE_AHEAD 512 /* bytes: see dense_fetch1 */
#define DENSE_FETCH_BYTES (8 << 20)
#define DENSE_ROUND 16 /* weight rows a thread takes at once in a one-row product (thread_shares.h) */
#define MB 8 /* query rows per pass over a weight row (the row stays in L1 between passes) */
/* a product's body written once with its row count as a parameter, inlined where each caller passes a constant:
 * the copy's loops over rows unroll and its accumulators stay in registers */
#define KERNEL_INLINE static inline __attribute__((always_inline))
#define HALF_MAX_GROUPS 1024 /* float16 scales: a row's groups converted on the stack */

/* the sixteen numbers a packed nibble n stands for, in nibble order: n as a signed 4-bit number (code − 8 of
 * unsigned codes, the code of signed ones), and each level table's levels (quant_types.h: n = level index ^ 8),
 * as floats and as bytes. `packed` names a layout: 1 unsigned codes, 2 signed ones, 3 + t table t */
static const float SIGNED_NIBBLES[16] = {0, 1, 2, 3, 4, 5, 6, 7, -8, -7, -6, -5, -4, -3, -2, -1};
#define NIBBLE_ROW_(flag, ...) {LMHEAD_NIBBLE_ORDER(__VA_ARGS__)},
static const float NIBBLE_LEVELS[LMHEAD_N_TABLES][16] = {LMHEAD_LEVEL_TABLES(NIBBLE_ROW_)};
static const int8_t NIBBLE_LEVEL_BYTES[LMHEAD_N_TABLES][16] = {LMHEAD_LEVEL_TABLES(NIBBLE_ROW_)};
#undef NIBBLE_ROW_
#define TABLE_OF(packed) ((packed) >= 3 ? (packed) - 3 : 0)

/* float16 bits → float32 (exact: every float16 is a float32) */
static inline float half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF;
    union { uint32_t u; float f; } v;
    if (exp == 0) { /* zero or subnormal: man · 2⁻²⁴ */
        v.f = (float)man * 5.9604644775390625e-8f;
        v.u |= sign;
        return v.f;
    }
    v.u = sign | (exp == 31 ? 0x7F800000u | (man << 13) : ((exp + 112) << 23) | (man << 13));
    return v.f;
}

/* E8M0 scale bytes → their float32 numbers (lmhead_e8m0), eight at a time: (e − 1) << 23, or the two subnormals */
static void e8m0_to_floats(const uint8_t* e, float* f, int64_t n) {
    int64_t i = 0;
#ifdef __AVX2__
    const __m256i one = _mm256_set1_epi32(1), two = _mm256_set1_epi32(2), sub = _mm256_set1_epi32(0x00200000);
    for (; i + 8 <= n; i += 8) {
        const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(e + i)));
        const __m256i normal = _mm256_slli_epi32(_mm256_sub_epi32(v, one), 23);
        const __m256i tiny = _mm256_sllv_epi32(sub, v); /* e = 0, 1: 0x00200000 << e */
        const __m256i small = _mm256_cmpgt_epi32(two, v);
        _mm256_storeu_ps(f + i, _mm256_castsi256_ps(_mm256_blendv_epi8(normal, tiny, small)));
    }
#endif
    for (; i < n; i++) f[i] = lmhead_e8m0(e[i]);
}

static void halves_to_floats(const uint16_t* h, float* f, int64_t n) {
    int64_t i = 0;
#if defined(__AVX2__) && defined(__F16C__)
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(f + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(h + i))));
#endif
    for (; i < n; i++) f[i] = half_to_float(h[i]);
}

/* LMHEAD_SUB: a scale (or offset) buffer holds float32 d [N, K/256] — a K-quant block's d (or −dmin) — followed
 * by int8 sub [N, ng], the block's small integer per group, and the group's scale is d·sub, the float32 product
 * gguf's dequantiser makes (exact: an 11-bit float16 d times an integer of at most 8 bits). A matrix's scales
 * then take one byte per group and four per 256 weights instead of four per group. sub_floats: rows n0 ..
 * n0 + nr − 1's scales as float32 [nr, ng] into f. */
static void sub_floats(const void* buf, int64_t N, int64_t K, int64_t ng, int64_t n0, int64_t nr, float* f) {
    const int64_t nsup = K / 256, per = ng / nsup;
    const float* d = (const float*)buf + n0 * nsup;
    const int8_t* sub = (const int8_t*)((const float*)buf + N * nsup) + n0 * ng;
#ifdef __AVX512F__
    if (per == 8 || per == 16) {
        /* the rows' groups side by side: group t of the nr rows takes d[t / per] (ng = nsup·per), sixteen at a time
         * — one superblock's d for groups of 16, two superblocks' for groups of 32 (lanes 0-7 and 8-15) */
        const int64_t total = nr * ng;
        const __m512i pair = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
        int64_t t = 0;
        for (; t + 16 <= total; t += 16) {
            const __m512 sv = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(sub + t))));
            const __m512 dv = per == 16 ? _mm512_set1_ps(d[t / 16])
                                        : _mm512_permutexvar_ps(pair, _mm512_castps128_ps512(_mm_castsi128_ps(
                                              _mm_loadl_epi64((const __m128i*)(d + t / 8)))));
            _mm512_storeu_ps(f + t, _mm512_mul_ps(dv, sv));
        }
        for (; t < total; t++) f[t] = d[t / per] * (float)sub[t];
        return;
    }
#endif
    for (int64_t r = 0; r < nr; r++)
        for (int64_t j = 0; j < nsup; j++) {
            const float dj = d[r * nsup + j];
            const int8_t* sj = sub + r * ng + j * per;
            float* fj = f + r * ng + j * per;
            int64_t i = 0;
#ifdef __AVX2__
            const __m256 dv = _mm256_set1_ps(dj);
            for (; i + 8 <= per; i += 8)
                _mm256_storeu_ps(fj + i, _mm256_mul_ps(dv, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                                                               _mm_loadl_epi64((const __m128i*)(sj + i))))));
#endif
            for (; i < per; i++) fj[i] = dj * (float)sj[i];
        }
}

/* how a matrix holds its scales (and offsets) where they are not SUB's: float32 numbers, float16 ones (HALF) or
 * exponent bytes (E8M0) */
enum { STORED_F32 = 0, STORED_F16 = 1, STORED_E8M0 = 2 };

/* rows n0 .. n0 + nr − 1's scales (or offsets) as float32 [nr, ng]: the stored floats themselves, or converted
 * into tmp (STORED_F16: HALF; STORED_E8M0: E8M0; d·sub: SUB) */
static inline const float* rows_scales(const void* base, int64_t N, int64_t K, int64_t ng, int64_t n0, int64_t nr,
                                       int stored, int sub, float* tmp) {
    if (sub) {
        sub_floats(base, N, K, ng, n0, nr, tmp);
        return tmp;
    }
    if (stored == STORED_E8M0) {
        e8m0_to_floats((const uint8_t*)base + n0 * ng, tmp, nr * ng);
        return tmp;
    }
    if (stored == STORED_F16) {
        halves_to_floats((const uint16_t*)base + n0 * ng, tmp, nr * ng);
        return tmp;
    }
    return (const float*)base + n0 * ng;
}

/* a cache-line fetch of rows n0 .. n0 + nr − 1's stored scales (or offsets), as rows_scales reads them */
static inline void fetch_scales(const void* base, int64_t N, int64_t K, int64_t ng, int64_t n0, int64_t nr, int stored,
                                int sub) {
#ifdef __AVX2__
    if (sub) {
        const int64_t nsup = K / 256;
        const char* d = (const char*)((const float*)base + n0 * nsup);
        const char* sb = (const char*)((const float*)base + N * nsup) + n0 * ng;
        for (int64_t p = 0; p < nr * nsup * 4; p += 64) _mm_prefetch(d + p, _MM_HINT_T0);
        for (int64_t p = 0; p < nr * ng; p += 64) _mm_prefetch(sb + p, _MM_HINT_T0);
        return;
    }
    const size_t bytes = stored == STORED_E8M0 ? 1 : stored == STORED_F16 ? 2 : 4;
    const char* b = (const char*)base + (size_t)n0 * ng * bytes;
    for (int64_t p = 0; p < nr * ng * (int64_t)bytes; p += 64) _mm_prefetch(b + p, _MM_HINT_T0);
#else
    (void)base, (void)N, (void)K, (void)ng, (void)n0, (void)nr, (void)stored, (void)sub;
#endif
}

int lmhead_coded_abi(void) { return 34; }

/* whether sub_floats makes sixteen d·sub products an instruction (AVX-512): where it does, a dense matrix of a
 * K-quant with groups of 32 holds its scales as the blocks do too (models/gguf_file.py) */
int lmhead_sub_sixteen(void) {
#ifdef __AVX512F__
    return 1;
#else
    return 0;
#endif
}

/* which products take the integer path (sliced_kernel.h) where it is built: bit 1 packed 4-bit codes, bit 2 int8
 * codes without offsets; `set` 0 … 3 chooses, −1 asks; returns the mode now (always 0 where the CPU has no AVX-512
 * VNNI). Chosen once per machine by kernels/paths.py (measured, or LMHEAD_SLICED) */
#define SLICED_PACKED 1
#define SLICED_INT8 2
#ifdef LMHEAD_SLICED_BUILT
static int sliced_mode = SLICED_PACKED | SLICED_INT8;
#else
static const int sliced_mode = 0;
#endif
/* whether the integer path by groups (LMHEAD_GROUPS16) is built: 1 with VNNI, 2 with AMX's tiles as well */
int lmhead_groups16(void) {
#if defined(LMHEAD_SLICED_BUILT) && defined(__AMX_INT8__) && defined(__AMX_TILE__)
    return 2;
#elif defined(LMHEAD_SLICED_BUILT)
    return 1;
#else
    return 0;
#endif
}

int lmhead_sliced(int set) {
#ifdef LMHEAD_SLICED_BUILT
    if (set >= 0 && set <= 3) sliced_mode = set;
#else
    (void)set;
#endif
    return sliced_mode;
}

/* the flags and level tables this library was built with, for kernels/native.py's check against its mirror */
int lmhead_flag_values(int64_t* out, int cap) {
    static const int64_t values[LMHEAD_N_FLAGS] = {LMHEAD_FLAG_VALUES};
    for (int i = 0; i < LMHEAD_N_FLAGS && i < cap; i++) out[i] = values[i];
    return LMHEAD_N_FLAGS;
}
int lmhead_level_table(int flag, int8_t* out) {
    const int t = lmhead_table_of(flag);
    if (t < 0 || (flag & (flag - 1))) return -1;
    for (int i = 0; i < 16; i++) out[i] = NIBBLE_LEVEL_BYTES[t][i ^ 8];
    return 0;
}

/* half_to_float for the other source file (decode_kernels.c's embedding rows) */
float lmhead_half(uint16_t h) { return half_to_float(h); }

/* the code a packed nibble stands for, as stored (`packed` 1: unsigned codes, 2: signed, 3 + t: table t) — for the
 * scalar paths here and decode_kernels.c's embedding rows */
float lmhead_nibble_code(int nib, int packed) {
    return packed >= 3 ? NIBBLE_LEVELS[packed - 3][nib] : packed == 2 ? SIGNED_NIBBLES[nib] : (float)(nib ^ 8);
}

#ifdef __AVX2__
int lmhead_coded_avx2(void) { return 1; }

static inline float hsum8(__m256 v) {
    __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
    return _mm_cvtss_f32(lo);
}

/* Packed nibbles hold code ^ 8, i.e. code − 8 as a signed 4-bit number. NIBC: codes 8·i .. 8·i+7 of a packed
 * pair of groups (v: its 32 bytes) minus 8, as floats (sign-extended by a shift pair: no more work than a mask);
 * NIB: the codes themselves, from v already XORed back (FLIP). */
#define NIBC(v, i) _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32((v), 28 - 4 * (i)), 28))
#define NIB(v, i) _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32((v), 4 * (i)), _mm256_set1_epi32(15)))
#define FLIP(v) _mm256_xor_si256((v), _mm256_set1_epi32((int)0x88888888u))
/* a table's levels of nibbles 8·i .. 8·i+7 of v as stored (lo, hi: its NIBBLE_LEVELS' two halves; tb: the same
 * sixteen as bytes in both 128-bit halves): one two-table permute (AVX-512VL); or, with AVX2 alone, a byte
 * shuffle of the unit's low or high nibbles through tb — nibble i of a lane is the low (i even) or high half of
 * its byte i/2, so one shuffle gives the levels of four nibbles of every lane, shared by their four calls — and
 * the byte's level sign-extended in its lane by a shift pair, as NIBC does the code: the same integer levels as
 * two permutes and a blend, with fewer operations */
#ifdef __AVX512VL__
#define TAB8(v, i, lo, hi) _mm256_permutex2var_ps((lo), _mm256_srli_epi32((v), 4 * (i)), (hi))
#else
static inline __m256 tab8_bytes(__m256i v, int i, __m256i tb) {
    const __m256i low = _mm256_set1_epi8(15);
    const __m256i nib = (i & 1) ? _mm256_and_si256(_mm256_srli_epi16(v, 4), low) : _mm256_and_si256(v, low);
    const __m256i level = _mm256_shuffle_epi8(tb, nib);
    return _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(level, 24 - 8 * (i >> 1)), 24));
}
#define TAB8(v, i, lo, hi) tab8_bytes((v), (i), tb)
#endif
/* `packed` is 1 for unsigned codes, 2 for signed ones (LMHEAD_SIGNED4), 3 + t for level table t (the
 * functions that read them hold the table as tlo, thi). CODEC: codes 8·i .. 8·i+7 of a unit as stored, as the
 * one-row products use them (unsigned: code − 8). UNIT4: a packed unit at p made ready for CODES8, which gives
 * the codes themselves: XORed back and masked (unsigned), as CODEC (signed, IQ4) */
#define CODEC(v, i, packed) ((packed) >= 3 ? TAB8(v, i, tlo, thi) : NIBC(v, i))
#define UNIT4(p, packed) \
    ((packed) >= 2 ? _mm256_loadu_si256((const __m256i*)(p)) : FLIP(_mm256_loadu_si256((const __m256i*)(p))))
#define CODES8(v, i, packed) ((packed) == 1 ? NIB(v, i) : CODEC(v, i, packed))
#define LEVEL_TABLE(packed)                                                                              \
    const __m256 tlo __attribute__((unused)) = _mm256_loadu_ps(NIBBLE_LEVELS[TABLE_OF(packed)]);         \
    const __m256 thi __attribute__((unused)) = _mm256_loadu_ps(NIBBLE_LEVELS[TABLE_OF(packed)] + 8);     \
    const __m256i tb __attribute__((unused)) =                                                           \
        _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)NIBBLE_LEVEL_BYTES[TABLE_OF(packed)]))
/* eight int8 codes from memory as floats */
#define BYTES8(p) _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(p))))
#endif

/* a row's codes: code k (unpacked) and the pair of groups holding group g (packed, g even), the row starting at
 * c and its 32-byte units `us` bytes apart (32 in a plain row, 128 in a block of four) */
#define CODE(c, us, k) ((c) + ((k) >> 5) * (us) + ((k) & 31))
#define PAIR(c, us, g) ((c) + ((g) >> 1) * (us))

/* whether a product sums its offsets after the loop over the codes (from the query's group sums xs): packed
 * codes that are unsigned, or signed with offsets */
#define SPLIT_OFFSETS(packed, o) ((packed) == 1 || ((packed) == 2 && (o) != NULL))
#define CENTRE(packed) ((packed) == 1 ? 8.0f : 0.0f)

#ifdef __AVX2__

/* No product here is left for the compiler to fuse with an addition (-O3 contracts a multiply feeding an add into
 * one FMA where it sees one, and may choose differently in two copies of the same source): every fused
 * multiply-add is written, so the one-row product and its several-row copies do the same operations. */
/* groups of 16 without offsets (int8 codes: Q6_K, Q3_K, a 32-byte unit holding two groups; packed codes: Q3_K, Q2_K,
 * four to a unit), each with its own scale */
#define DOT2C(c0, c1, xa, xb, acc, sg)                                                                   \
    do {                                                                                                 \
        const __m256 d_ = _mm256_fmadd_ps((c1), (xb), _mm256_mul_ps((c0), (xa)));                        \
        (acc) = _mm256_fmadd_ps(_mm256_set1_ps(sg), d_, (acc));                                          \
    } while (0)

/* Σ_g (offset_g + centre·scale_g)·xs_g for a row (offset may be NULL), added to acc's lanes; scalar leftovers
 * into *tail. The centre is 8 for unsigned packed codes (the loop summed code − 8), 0 for signed ones with
 * offsets (Q2_K's codes 0..3, Q3_K's fused with offsets: the loop summed the codes themselves) */
static inline __m256 centred_offsets(const float* s, const float* o, const float* xs, int64_t ng, float centre,
                                     __m256 acc, float* tail) {
    int64_t g = 0;
    const __m256 c8 = _mm256_set1_ps(centre);
    for (; g + 8 <= ng; g += 8) {
        const __m256 ov = o ? _mm256_loadu_ps(o + g) : _mm256_setzero_ps();
        acc = _mm256_fmadd_ps(_mm256_fmadd_ps(c8, _mm256_loadu_ps(s + g), ov), _mm256_loadu_ps(xs + g), acc);
    }
    for (; g < ng; g++) *tail += ((o ? o[g] : 0.0f) + centre * s[g]) * xs[g];
    return acc;
}


/* one query row: Σ_g scale_g·(Σ_i code_i·x_i) — int8 codes without offsets, signed packed codes — or, unsigned
 * packed, the centred form above (xs [ng]: the query's group sums) */
static inline float row_dot1(const float* x, const int8_t* c, int64_t us, const float* s, const float* o,
                             const float* xs, int64_t ng, int64_t G, int packed) {
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    LEVEL_TABLE(packed);
    if (packed && G == 16) { /* four groups to a unit: codes 16j .. 16j + 15 of it (nibbles 2j, 2j + 1) group j */
        for (int64_t u = 0; u < ng / 4; u++) {
            const __m256i v = _mm256_loadu_si256((const __m256i*)(c + u * us));
            const float* xg = x + u * 64;
            DOT2C(CODEC(v, 0, packed), CODEC(v, 1, packed), _mm256_loadu_ps(xg), _mm256_loadu_ps(xg + 8), acc0,
                  s[4 * u]);
            DOT2C(CODEC(v, 2, packed), CODEC(v, 3, packed), _mm256_loadu_ps(xg + 16), _mm256_loadu_ps(xg + 24),
                  acc1, s[4 * u + 1]);
            DOT2C(CODEC(v, 4, packed), CODEC(v, 5, packed), _mm256_loadu_ps(xg + 32), _mm256_loadu_ps(xg + 40),
                  acc0, s[4 * u + 2]);
            DOT2C(CODEC(v, 6, packed), CODEC(v, 7, packed), _mm256_loadu_ps(xg + 48), _mm256_loadu_ps(xg + 56),
                  acc1, s[4 * u + 3]);
        }
    } else if (packed) {
        for (int64_t g = 0; g < ng; g += 2) {
            const __m256i v = _mm256_loadu_si256((const __m256i*)PAIR(c, us, g));
            const float* xg = x + g * 32;
            __m256 d0 = _mm256_mul_ps(CODEC(v, 0, packed), _mm256_loadu_ps(xg));
            __m256 d1 = _mm256_mul_ps(CODEC(v, 1, packed), _mm256_loadu_ps(xg + 8));
            __m256 e0 = _mm256_mul_ps(CODEC(v, 4, packed), _mm256_loadu_ps(xg + 32));
            __m256 e1 = _mm256_mul_ps(CODEC(v, 5, packed), _mm256_loadu_ps(xg + 40));
            d0 = _mm256_fmadd_ps(CODEC(v, 2, packed), _mm256_loadu_ps(xg + 16), d0);
            d1 = _mm256_fmadd_ps(CODEC(v, 3, packed), _mm256_loadu_ps(xg + 24), d1);
            e0 = _mm256_fmadd_ps(CODEC(v, 6, packed), _mm256_loadu_ps(xg + 48), e0);
            e1 = _mm256_fmadd_ps(CODEC(v, 7, packed), _mm256_loadu_ps(xg + 56), e1);
            acc0 = _mm256_fmadd_ps(_mm256_set1_ps(s[g]), _mm256_add_ps(d0, d1), acc0);
            acc1 = _mm256_fmadd_ps(_mm256_set1_ps(s[g + 1]), _mm256_add_ps(e0, e1), acc1);
        }
    } else if (G == 32) {
        for (int64_t g = 0; g < ng; g++) {
            const float* xg = x + g * 32;
            const int8_t* cg = c + g * us;
            __m256 d0 = _mm256_mul_ps(BYTES8(cg), _mm256_loadu_ps(xg));
            __m256 d1 = _mm256_mul_ps(BYTES8(cg + 8), _mm256_loadu_ps(xg + 8));
            d0 = _mm256_fmadd_ps(BYTES8(cg + 16), _mm256_loadu_ps(xg + 16), d0);
            d1 = _mm256_fmadd_ps(BYTES8(cg + 24), _mm256_loadu_ps(xg + 24), d1);
            if (g & 1)
                acc1 = _mm256_fmadd_ps(_mm256_set1_ps(s[g]), _mm256_add_ps(d0, d1), acc1);
            else
                acc0 = _mm256_fmadd_ps(_mm256_set1_ps(s[g]), _mm256_add_ps(d0, d1), acc0);
        }
    } else {
        for (int64_t g = 0; g < ng; g++) {
            __m256 d0 = _mm256_setzero_ps(), d1 = _mm256_setzero_ps();
            for (int64_t j = 0; j < G; j += 16) {
                d0 = _mm256_fmadd_ps(BYTES8(CODE(c, us, g * G + j)), _mm256_loadu_ps(x + g * G + j), d0);
                d1 = _mm256_fmadd_ps(BYTES8(CODE(c, us, g * G + j + 8)), _mm256_loadu_ps(x + g * G + j + 8), d1);
            }
            if (g & 1)
                acc1 = _mm256_fmadd_ps(_mm256_set1_ps(s[g]), _mm256_add_ps(d0, d1), acc1);
            else
                acc0 = _mm256_fmadd_ps(_mm256_set1_ps(s[g]), _mm256_add_ps(d0, d1), acc0);
        }
    }
    float tail = 0.f;
    if (SPLIT_OFFSETS(packed, o)) acc0 = centred_offsets(s, o, xs, ng, CENTRE(packed), acc0, &tail);
    return hsum8(_mm256_add_ps(acc0, acc1)) + tail;
}

/* a block of four weight rows (LMHEAD_ROWS4 layout) against one query row (decode, G = 32): each x vector is
 * loaded once for the four rows and the four sums are reduced together — with rows of a few hundred weights the
 * per-row loop and reduction cost as much as the products. c: the block's codes; s, o: [4, ng] floats (o may be
 * NULL); xs: the query's group sums (unsigned packed codes). Same arithmetic as row_dot1 (int8 codes without
 * offsets, packed codes), or as the rebuilt weights of rows_n for one row (int8 codes with offsets), row by row. */
/* int8 codes with offsets: Σ (code·scale + offset)·x over a group, each weight rebuilt exactly */
#define DOT4R(c0, c1, c2, c3, acc, sg, og)                                                               \
    do {                                                                                                 \
        const __m256 s_ = _mm256_set1_ps(sg), o_ = _mm256_set1_ps(og);                                   \
        __m256 d_ = _mm256_mul_ps(_mm256_fmadd_ps((c0), s_, o_), x0);                                    \
        d_ = _mm256_fmadd_ps(_mm256_fmadd_ps((c1), s_, o_), x1, d_);                                     \
        d_ = _mm256_fmadd_ps(_mm256_fmadd_ps((c2), s_, o_), x2, d_);                                     \
        d_ = _mm256_fmadd_ps(_mm256_fmadd_ps((c3), s_, o_), x3, d_);                                     \
        (acc) = _mm256_add_ps(d_, (acc));                                                                \
    } while (0)
/* Σ scale·code·x: codes without offsets, or packed codes − 8 (their offsets come after the loop); two chains
 * of two products each, not one of four: the shorter chains keep more groups in flight (1.05–1.1× a thread) */
#define DOT4C(c0, c1, c2, c3, acc, sg)                                                                   \
    do {                                                                                                 \
        __m256 d_ = _mm256_mul_ps((c0), x0);                                                             \
        __m256 e_ = _mm256_mul_ps((c1), x1);                                                             \
        d_ = _mm256_fmadd_ps((c2), x2, d_);                                                              \
        e_ = _mm256_fmadd_ps((c3), x3, e_);                                                              \
        (acc) = _mm256_fmadd_ps(_mm256_set1_ps(sg), _mm256_add_ps(d_, e_), (acc));                       \
    } while (0)

/* the 128 bytes of unit u (four rows' 32) of the block at pf, fetched while this block's unit u is computed: the
 * next block arrives spread over this one's loop (NULL: nothing). Always inlined: a call left to a function that
 * only prefetches is one GCC may judge to do nothing (it writes no memory) and delete. */
KERNEL_INLINE void fetch_unit(const char* pf, int64_t u) {
    if (pf) {
        _mm_prefetch(pf + u * 128, _MM_HINT_T0);
        _mm_prefetch(pf + u * 128 + 64, _MM_HINT_T0);
    }
}

/* int8 codes of a four-row block, group by group: x0..x3 the group's x, cg row r's 32 codes; STEP adds them
 * (unit g of the next block, at the caller's pf, fetched meanwhile) */
#define INT8_GROUPS(STEP)                                                                                \
    for (int64_t g = 0; g < ng; g++) {                                                                   \
        fetch_unit(pf, g);                                                                               \
        const float* xg = x + g * 32;                                                                    \
        const __m256 x0 = _mm256_loadu_ps(xg), x1 = _mm256_loadu_ps(xg + 8);                             \
        const __m256 x2 = _mm256_loadu_ps(xg + 16), x3 = _mm256_loadu_ps(xg + 24);                       \
        for (int r = 0; r < 4; r++) {                                                                    \
            const int8_t* cg = c + (g * 4 + r) * 32;                                                     \
            STEP;                                                                                        \
        }                                                                                                \
    }

/* Q2_K's groups of 16 with offsets: each weight rebuilt exactly (code·scale + offset), as DOT4R */
#define DOT2R(c0, c1, xa, xb, acc, sg, og)                                                               \
    do {                                                                                                 \
        const __m256 s_ = _mm256_set1_ps(sg), o_ = _mm256_set1_ps(og);                                   \
        const __m256 d_ = _mm256_mul_ps(_mm256_fmadd_ps((c0), s_, o_), (xa));                            \
        (acc) = _mm256_add_ps(_mm256_fmadd_ps(_mm256_fmadd_ps((c1), s_, o_), (xb), d_), (acc));          \
    } while (0)

#ifdef __AVX512F__
static inline __m256 fold512(__m512 v) { /* sixteen lanes added pairwise into eight */
    return _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}

/* the common case of rows4_dot1 (int8 codes, no offsets, G = 32: Q8_0, Q5_0) in 512-bit lanes: a group's 32 codes
 * are two conversions of sixteen, not four of eight — half the instructions per weight, which is what bounds a
 * decode product on two cores once its rows come from memory at the prefetcher's rate. The same products and
 * scales as DOT4C, summed in another order (float32 rounding; tests bound it against float64, and the screen's
 * bound holds for any order of the sums). acc[r] receives row r's sixteen lanes folded to eight. */
static inline void rows4_int8_512(const float* x, const int8_t* c, const float* s, int64_t ng, const char* pf,
                                  __m256* acc) {
    __m512 a[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    for (int64_t g = 0; g < ng; g++) {
        fetch_unit(pf, g);
        const __m512 x0 = _mm512_loadu_ps(x + g * 32), x1 = _mm512_loadu_ps(x + g * 32 + 16);
        for (int r = 0; r < 4; r++) {
            const int8_t* cg = c + (g * 4 + r) * 32;
            const __m512 c0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)cg)));
            const __m512 c1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(cg + 16))));
            a[r] = _mm512_fmadd_ps(_mm512_set1_ps(s[r * ng + g]), _mm512_fmadd_ps(c1, x1, _mm512_mul_ps(c0, x0)),
                                   a[r]);
        }
    }
    for (int r = 0; r < 4; r++) acc[r] = fold512(a[r]);
}

/* Q6_K's and Q3_K's groups of 16 (int8 codes, no offsets; unit u holds groups 2u and 2u + 1): one conversion is
 * one group, its scale one multiply; two sums per row (a, b) so that a row's two groups do not wait on each other */
static inline void rows4_g16_512(const float* x, const int8_t* c, const float* s, int64_t ng, const char* pf,
                                 __m256* acc) {
    __m512 a[4], b[4];
    for (int r = 0; r < 4; r++) a[r] = b[r] = _mm512_setzero_ps();
    for (int64_t u = 0; u < ng / 2; u++) {
        fetch_unit(pf, u);
        const __m512 x0 = _mm512_loadu_ps(x + u * 32), x1 = _mm512_loadu_ps(x + u * 32 + 16);
        for (int r = 0; r < 4; r++) {
            const int8_t* cg = c + (u * 4 + r) * 32;
            const int64_t i = r * ng + 2 * u;
            const __m512 c0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)cg)));
            const __m512 c1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(cg + 16))));
            a[r] = _mm512_fmadd_ps(_mm512_set1_ps(s[i]), _mm512_mul_ps(c0, x0), a[r]);
            b[r] = _mm512_fmadd_ps(_mm512_set1_ps(s[i + 1]), _mm512_mul_ps(c1, x1), b[r]);
        }
    }
    for (int r = 0; r < 4; r++) acc[r] = fold512(_mm512_add_ps(a[r], b[r]));
}

/* int8 codes with offsets (Q5_1, Q5_K; G = 16: Q2_K, and q/k/v fused from Q3_K and Q4_K rows) in 512-bit lanes:
 * each weight rebuilt exactly, code·scale + offset in one rounding (as DOT4R and DOT2R), sixteen at a time. G = 32:
 * a group is two conversions with one scale and offset; G = 16 (unit u holds groups 2u and 2u + 1): one
 * conversion is one group */
static inline void rows4_offsets_512(const float* x, const int8_t* c, const float* s, const float* o, int64_t ng,
                                     int g16, const char* pf, __m256* acc) {
    __m512 a[4], b[4];
    for (int r = 0; r < 4; r++) a[r] = b[r] = _mm512_setzero_ps();
    const int64_t units = g16 ? ng / 2 : ng;
    for (int64_t u = 0; u < units; u++) {
        fetch_unit(pf, u);
        const __m512 x0 = _mm512_loadu_ps(x + u * 32), x1 = _mm512_loadu_ps(x + u * 32 + 16);
        for (int r = 0; r < 4; r++) {
            const int8_t* cg = c + (u * 4 + r) * 32;
            const int64_t i0 = r * ng + (g16 ? 2 * u : u), i1 = i0 + g16;
            const __m512 c0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)cg)));
            const __m512 c1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(cg + 16))));
            const __m512 w0 = _mm512_fmadd_ps(c0, _mm512_set1_ps(s[i0]), _mm512_set1_ps(o[i0]));
            const __m512 w1 = _mm512_fmadd_ps(c1, _mm512_set1_ps(s[i1]), _mm512_set1_ps(o[i1]));
            a[r] = _mm512_fmadd_ps(w0, x0, a[r]);
            b[r] = _mm512_fmadd_ps(w1, x1, b[r]);
        }
    }
    for (int r = 0; r < 4; r++) acc[r] = fold512(_mm512_add_ps(a[r], b[r]));
}

/* packed 4-bit codes (Q4_1, Q4_K; Q4_0; IQ4_NL, IQ4_XS) in 512-bit lanes: units 2q and 2q + 1 of a row (64 codes
 * each, 32 bytes, 128 apart in the block) side by side in one register, so that one shift and one permute from the
 * sixteen values a nibble stands for (`values`: SIGNED_NIBBLES — code − 8 of unsigned codes, the code of signed
 * ones — or a level table's NIBBLE_LEVELS) give sixteen codes — eight of each unit — for one multiply (the permute reads a lane's
 * low four bits: no mask; NIBC's shift pair and conversion took one more operation). xp: the query row laid out
 * to match (xp_layout), once per product;
 * the lanes' two halves belong to two groups, so the scale vector carries both (s of groups 4q and 4q + 2 for
 * nibbles 0–3, 4q + 1 and 4q + 3 for 4–7). Returns the first group it left: a row with an odd number of units
 * leaves its last one to rows4_dot1's 256-bit loop. The same products and scales as DOT4C, summed in another
 * order; the offsets follow in rows4_dot1 (centred_offsets) as for the 256-bit loop. */
static inline __m512 nibble512(__m512i v, int i, __m512 values) {
    return _mm512_permutexvar_ps(i ? _mm512_srli_epi32(v, 4 * i) : v, values);
}
static inline int64_t rows4_packed_512(const float* xp, const int8_t* c, const float* s, int64_t ng, const char* pf,
                                       int packed, __m256* acc) {
    const __m512i lo = _mm512_set_epi32(2, 2, 2, 2, 2, 2, 2, 2, 0, 0, 0, 0, 0, 0, 0, 0);
    const __m512i hi = _mm512_set_epi32(3, 3, 3, 3, 3, 3, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1);
    const __m512 values = _mm512_loadu_ps(packed >= 3 ? NIBBLE_LEVELS[packed - 3] : SIGNED_NIBBLES);
    __m512 a[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    const int64_t units = ng / 2, pairs = units / 2;
    for (int64_t q = 0; q < pairs; q++) {
        fetch_unit(pf, 2 * q);
        fetch_unit(pf, 2 * q + 1);
        const float* xq = xp + q * 128;
        for (int r = 0; r < 4; r++) {
            const int8_t* u0 = c + (2 * q * 4 + r) * 32;
            const __m512i v = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)u0)),
                                                 _mm256_loadu_si256((const __m256i*)(u0 + 128)), 1);
            const __m512 sv = _mm512_castps128_ps512(_mm_loadu_ps(s + r * ng + 4 * q));
            __m512 d = _mm512_mul_ps(nibble512(v, 0, values), _mm512_loadu_ps(xq));
            __m512 e = _mm512_mul_ps(nibble512(v, 1, values), _mm512_loadu_ps(xq + 16));
            d = _mm512_fmadd_ps(nibble512(v, 2, values), _mm512_loadu_ps(xq + 32), d);
            e = _mm512_fmadd_ps(nibble512(v, 3, values), _mm512_loadu_ps(xq + 48), e);
            a[r] = _mm512_fmadd_ps(_mm512_permutexvar_ps(lo, sv), _mm512_add_ps(d, e), a[r]);
            d = _mm512_mul_ps(nibble512(v, 4, values), _mm512_loadu_ps(xq + 64));
            e = _mm512_mul_ps(nibble512(v, 5, values), _mm512_loadu_ps(xq + 80));
            d = _mm512_fmadd_ps(nibble512(v, 6, values), _mm512_loadu_ps(xq + 96), d);
            e = _mm512_fmadd_ps(nibble512(v, 7, values), _mm512_loadu_ps(xq + 112), e);
            a[r] = _mm512_fmadd_ps(_mm512_permutexvar_ps(hi, sv), _mm512_add_ps(d, e), a[r]);
        }
    }
    for (int r = 0; r < 4; r++) acc[r] = fold512(a[r]);
    return 4 * pairs;
}

/* x [K] (K a multiple of 64) → xp [(K/128)·128]: for units 2q and 2q + 1 and nibble i, sixteen floats — x of
 * codes 8i..8i+7 of unit 2q, then of unit 2q + 1 (rows4_packed_512's lanes) */
static void xp_layout(const float* x, int64_t K, float* xp) {
    for (int64_t q = 0; q < K / 128; q++)
        for (int i = 0; i < 8; i++)
            for (int h = 0; h < 2; h++)
                for (int l = 0; l < 8; l++) xp[q * 128 + i * 16 + h * 8 + l] = x[(2 * q + h) * 64 + 8 * i + l];
}
#endif

#include "sliced_kernel.h"
#ifdef LMHEAD_SLICED_BUILT
/* each level table's levels as the integer path reads them: plus the table's bias (−its smallest level), unsigned
 * bytes in stored-nibble order */
#define SLICED_MIN16_(a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15) \
    MIN2_(MIN2_(MIN2_(MIN2_(a0, a1), MIN2_(a2, a3)), MIN2_(MIN2_(a4, a5), MIN2_(a6, a7))),   \
          MIN2_(MIN2_(MIN2_(a8, a9), MIN2_(a10, a11)), MIN2_(MIN2_(a12, a13), MIN2_(a14, a15))))
#define MIN2_(a, b) ((a) < (b) ? (a) : (b))
#define SLICED_BIAS_(flag, ...) -(SLICED_MIN16_(__VA_ARGS__)),
static const int SLICED_BIAS[LMHEAD_N_TABLES] = {LMHEAD_LEVEL_TABLES(SLICED_BIAS_)};
#undef SLICED_BIAS_
static int8_t SLICED_LEVELS[LMHEAD_N_TABLES][16];
static int SLICED_NARROW[LMHEAD_N_TABLES]; /* every level + bias ≤ 31: sliced_rows4's one chain (tab 2) */
__attribute__((constructor)) static void sliced_levels(void) {
    for (int t = 0; t < LMHEAD_N_TABLES; t++) {
        SLICED_NARROW[t] = 1;
        for (int n = 0; n < 16; n++) {
            SLICED_LEVELS[t][n] = (int8_t)(uint8_t)(NIBBLE_LEVEL_BYTES[t][n] + SLICED_BIAS[t]);
            if (NIBBLE_LEVEL_BYTES[t][n] + SLICED_BIAS[t] > 31) SLICED_NARROW[t] = 0;
        }
    }
}
#endif

/* rows4_dot1's 256-bit loop over packed codes from group g0 on, with `packed` and g16 constants in each copy: the
 * nibbles' decoding is chosen when it is compiled, not tested per unit, and a copy that reads no IQ4 table holds
 * none in its registers; each row's products read x from L1 rather than holding it for the four rows (the
 * shared loop held x and the table, tested `packed` in the loop and spilled the rows' sums to the stack: IQ4
 * 1.18x, Q4_0 and Q4_1 1.03-1.06x a thread). G = 32: unit u holds groups 2u, 2u + 1 (four nibbles each); G = 16
 * (g16): groups 4u .. 4u + 3 (two each). */
KERNEL_INLINE void rows4_packed_n(const int kind, const int g16, const int table, const float* x, const int8_t* c,
                                  const float* s, int64_t ng, int64_t g0, const char* pf, __m256* acc) {
    /* kind: 1 unsigned, 2 signed, 3 a level table (`table`: the layout's `packed`, 3 + t) */
    const int packed = kind;
    LEVEL_TABLE(table);
    const int64_t gpu = g16 ? 4 : 2;
    for (int64_t u = g0 / gpu; u < ng / gpu; u++) {
        fetch_unit(pf, u);
        for (int half = 0; half < 2; half++) { /* nibbles 0–3, then 4–7 */
            const float* xh = x + u * 64 + 32 * half;
            const int i = 4 * half;
            for (int r = 0; r < 4; r++) {
                const __m256i v = _mm256_loadu_si256((const __m256i*)(c + (u * 4 + r) * 32));
                const float* sr = s + r * ng + u * gpu;
                const __m256 x0 = _mm256_loadu_ps(xh), x1 = _mm256_loadu_ps(xh + 8);
                const __m256 x2 = _mm256_loadu_ps(xh + 16), x3 = _mm256_loadu_ps(xh + 24);
                if (g16) {
                    DOT2C(CODEC(v, i, packed), CODEC(v, i + 1, packed), x0, x1, acc[r], sr[2 * half]);
                    DOT2C(CODEC(v, i + 2, packed), CODEC(v, i + 3, packed), x2, x3, acc[r], sr[2 * half + 1]);
                } else {
                    DOT4C(CODEC(v, i, packed), CODEC(v, i + 1, packed), CODEC(v, i + 2, packed),
                          CODEC(v, i + 3, packed), acc[r], sr[half]);
                }
            }
        }
    }
}

/* a block's four sums acc[r] to out[4]: the offsets that follow the loop (packed codes), then the lanes */
KERNEL_INLINE void rows4_finish(__m256* acc, const float* s, const float* o, const float* xs, int64_t ng, int packed,
                                float* out) {
    float tail[4] = {0.f, 0.f, 0.f, 0.f};
    if (SPLIT_OFFSETS(packed, o))
        for (int r = 0; r < 4; r++)
            acc[r] = centred_offsets(s + r * ng, o ? o + r * ng : NULL, xs, ng, CENTRE(packed), acc[r], tail + r);
    const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(acc[0], acc[1]), _mm256_hadd_ps(acc[2], acc[3]));
    const __m128 four = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    _mm_storeu_ps(out, _mm_add_ps(four, _mm_loadu_ps(tail)));
}

#ifdef LMHEAD_SLICED_BUILT
/* Q sliced query rows (each ok) of a block on the integer path (sliced_kernel.h: packed codes of every layout, int8
 * codes without offsets), then the offsets as rows4_dot1 adds them: out [Q][4] */
KERNEL_INLINE void sliced_q(const int Q, const sliced_row* sr, const int8_t* c, const float* s, const float* o,
                            const float* xs, int64_t ng, int packed, int g16, const char* pf, float* out) {
    __m256 acc[8][4];
    if (!packed && g16)
        sliced8_rows4(Q, 1, sr, c, s, ng, pf, acc);
    else if (!packed)
        sliced8_rows4(Q, 0, sr, c, s, ng, pf, acc);
    else if (packed >= 3 && SLICED_NARROW[packed - 3])
        sliced_rows4(Q, 0, 2, SLICED_LEVELS[packed - 3], sr, c, s, ng, pf, acc);
    else if (packed >= 3)
        sliced_rows4(Q, 0, 1, SLICED_LEVELS[packed - 3], sr, c, s, ng, pf, acc);
    else if (g16)
        sliced_rows4(Q, 1, 0, NULL, sr, c, s, ng, pf, acc);
    else
        sliced_rows4(Q, 0, 0, NULL, sr, c, s, ng, pf, acc);
    for (int m = 0; m < Q; m++) rows4_finish(acc[m], s, o, xs ? xs + m * ng : NULL, ng, packed, out + 4 * m);
}
#endif

KERNEL_INLINE void rows4_dot1(const float* x, const float* xp, const int8_t* c, const float* s, const float* o,
                              const float* xs, int64_t ng, int packed, int g16, const char* pf, const sliced_row* sr,
                              float* out) {
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
#ifdef LMHEAD_SLICED_BUILT
    if (sr && sr->ok) { /* sr: only for the layouts the integer path takes (sliced_make) */
        sliced_q(1, sr, c, s, o, xs, ng, packed, g16, pf, out);
        return;
    }
#else
    (void)sr;
#endif
    if (packed) {
        int64_t g0 = 0; /* groups before g0 done in 512-bit lanes (xp: the query row in their layout) */
#ifdef __AVX512F__
        if (xp && !g16) g0 = rows4_packed_512(xp, c, s, ng, pf, packed, acc);
#else
        (void)xp;
#endif
        switch (2 * (packed >= 3 ? 3 : packed) + g16) {
            case 2: rows4_packed_n(1, 0, packed, x, c, s, ng, g0, pf, acc); break;
            case 3: rows4_packed_n(1, 1, packed, x, c, s, ng, g0, pf, acc); break;
            case 4: rows4_packed_n(2, 0, packed, x, c, s, ng, g0, pf, acc); break;
            case 5: rows4_packed_n(2, 1, packed, x, c, s, ng, g0, pf, acc); break;
            case 6: rows4_packed_n(3, 0, packed, x, c, s, ng, g0, pf, acc); break;
            default: rows4_packed_n(3, 1, packed, x, c, s, ng, g0, pf, acc); break;
        }
#ifdef __AVX512F__
    } else if (o) {
        rows4_offsets_512(x, c, s, o, ng, g16, pf, acc);
#else
    } else if (o && g16) { /* ng = K/16: unit u holds groups 2u and 2u + 1 */
        for (int64_t u = 0; u < ng / 2; u++) {
            fetch_unit(pf, u);
            const float* xg = x + u * 32;
            const __m256 x0 = _mm256_loadu_ps(xg), x1 = _mm256_loadu_ps(xg + 8);
            const __m256 x2 = _mm256_loadu_ps(xg + 16), x3 = _mm256_loadu_ps(xg + 24);
            for (int r = 0; r < 4; r++) {
                const int8_t* cg = c + (u * 4 + r) * 32;
                const int64_t i = r * ng + 2 * u;
                DOT2R(BYTES8(cg), BYTES8(cg + 8), x0, x1, acc[r], s[i], o[i]);
                DOT2R(BYTES8(cg + 16), BYTES8(cg + 24), x2, x3, acc[r], s[i + 1], o[i + 1]);
            }
        }
    } else if (o) {
        INT8_GROUPS(DOT4R(BYTES8(cg), BYTES8(cg + 8), BYTES8(cg + 16), BYTES8(cg + 24), acc[r], s[r * ng + g],
                          o[r * ng + g]));
#endif
    } else if (g16) { /* ng = K/16: unit u holds groups 2u and 2u + 1 */
#ifdef __AVX512F__
        rows4_g16_512(x, c, s, ng, pf, acc);
#else
        for (int64_t u = 0; u < ng / 2; u++) {
            fetch_unit(pf, u);
            const float* xg = x + u * 32;
            const __m256 x0 = _mm256_loadu_ps(xg), x1 = _mm256_loadu_ps(xg + 8);
            const __m256 x2 = _mm256_loadu_ps(xg + 16), x3 = _mm256_loadu_ps(xg + 24);
            for (int r = 0; r < 4; r++) {
                const int8_t* cg = c + (u * 4 + r) * 32;
                DOT2C(BYTES8(cg), BYTES8(cg + 8), x0, x1, acc[r], s[r * ng + 2 * u]);
                DOT2C(BYTES8(cg + 16), BYTES8(cg + 24), x2, x3, acc[r], s[r * ng + 2 * u + 1]);
            }
        }
#endif
    } else { /* the common case (Q8_0, Q5_0): a loop of its own, no test of o inside */
#ifdef __AVX512F__
        rows4_int8_512(x, c, s, ng, pf, acc);
#else
        INT8_GROUPS(DOT4C(BYTES8(cg), BYTES8(cg + 8), BYTES8(cg + 16), BYTES8(cg + 24), acc[r], s[r * ng + g]));
#endif
    }
    rows4_finish(acc, s, o, xs, ng, packed, out);
}

/* ---- several query rows of a block, each summed as rows4_dot1 sums it alone ------------------------------------
 * Q query rows (x, xp: Q rows K apart; xs: Q rows ng apart) against a block of four weight rows, one weight row at
 * a time: each unit's codes are converted once and used for the Q rows, and every row's sums take the one-row
 * product's operations in its order (row r of the block and query m: the same products, scales and additions
 * over the groups as rows4_dot1 makes for m alone — the block's rows are independent sums there too), so a row's
 * value is the same bits alone or among others. acc [Q][4] receives what rows4_dot1's acc holds before
 * rows4_finish. */
#ifdef __AVX512F__
KERNEL_INLINE void rows4_int8_q(const int Q, const float* x, int64_t K, const int8_t* c, const float* s, int64_t ng,
                                __m256 (*acc)[4]) {
    for (int r = 0; r < 4; r++) {
        __m512 a[8];
        for (int m = 0; m < Q; m++) a[m] = _mm512_setzero_ps();
        for (int64_t g = 0; g < ng; g++) {
            const int8_t* cg = c + (g * 4 + r) * 32;
            const __m512 c0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)cg)));
            const __m512 c1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(cg + 16))));
            const __m512 sv = _mm512_set1_ps(s[r * ng + g]);
            for (int m = 0; m < Q; m++) {
                const __m512 x0 = _mm512_loadu_ps(x + m * K + g * 32), x1 = _mm512_loadu_ps(x + m * K + g * 32 + 16);
                a[m] = _mm512_fmadd_ps(sv, _mm512_fmadd_ps(c1, x1, _mm512_mul_ps(c0, x0)), a[m]);
            }
        }
        for (int m = 0; m < Q; m++) acc[m][r] = fold512(a[m]);
    }
}

/* rows4_g16_512's and rows4_offsets_512's sums (groups of 16 without offsets; int8 codes with offsets) */
KERNEL_INLINE void rows4_pair_q(const int Q, const float* x, int64_t K, const int8_t* c, const float* s,
                                const float* o, int64_t ng, int g16, __m256 (*acc)[4]) {
    const int64_t units = g16 ? ng / 2 : ng;
    for (int r = 0; r < 4; r++) {
        __m512 a[8], b[8];
        for (int m = 0; m < Q; m++) a[m] = b[m] = _mm512_setzero_ps();
        for (int64_t u = 0; u < units; u++) {
            const int8_t* cg = c + (u * 4 + r) * 32;
            const int64_t i0 = r * ng + (g16 ? 2 * u : u), i1 = i0 + g16;
            const __m512 c0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)cg)));
            const __m512 c1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(cg + 16))));
            if (o) {
                const __m512 w0 = _mm512_fmadd_ps(c0, _mm512_set1_ps(s[i0]), _mm512_set1_ps(o[i0]));
                const __m512 w1 = _mm512_fmadd_ps(c1, _mm512_set1_ps(s[i1]), _mm512_set1_ps(o[i1]));
                for (int m = 0; m < Q; m++) {
                    a[m] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x + m * K + u * 32), a[m]);
                    b[m] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(x + m * K + u * 32 + 16), b[m]);
                }
            } else {
                const __m512 s0 = _mm512_set1_ps(s[i0]), s1 = _mm512_set1_ps(s[i1]);
                for (int m = 0; m < Q; m++) {
                    a[m] = _mm512_fmadd_ps(s0, _mm512_mul_ps(c0, _mm512_loadu_ps(x + m * K + u * 32)), a[m]);
                    b[m] = _mm512_fmadd_ps(s1, _mm512_mul_ps(c1, _mm512_loadu_ps(x + m * K + u * 32 + 16)), b[m]);
                }
            }
        }
        for (int m = 0; m < Q; m++) acc[m][r] = fold512(_mm512_add_ps(a[m], b[m]));
    }
}

#else
/* the 256-bit loops of rows4_dot1 over int8 codes (INT8_GROUPS with DOT4C or DOT4R; groups of 16: DOT2C or DOT2R) */
KERNEL_INLINE void rows4_int8_q(const int Q, const float* x, int64_t K, const int8_t* c, const float* s,
                                const float* o, int64_t ng, int g16, __m256 (*acc)[4]) {
    for (int r = 0; r < 4; r++) {
        __m256 t[8];
        for (int m = 0; m < Q; m++) t[m] = _mm256_setzero_ps();
        for (int64_t u = 0; u < (g16 ? ng / 2 : ng); u++) {
            const int8_t* cg = c + (u * 4 + r) * 32;
            const __m256 c0 = BYTES8(cg), c1 = BYTES8(cg + 8), c2 = BYTES8(cg + 16), c3 = BYTES8(cg + 24);
            const int64_t i = r * ng + (g16 ? 2 * u : u);
            for (int m = 0; m < Q; m++) {
                const float* xg = x + m * K + u * 32;
                const __m256 x0 = _mm256_loadu_ps(xg), x1 = _mm256_loadu_ps(xg + 8);
                const __m256 x2 = _mm256_loadu_ps(xg + 16), x3 = _mm256_loadu_ps(xg + 24);
                if (g16 && o) {
                    DOT2R(c0, c1, x0, x1, t[m], s[i], o[i]);
                    DOT2R(c2, c3, x2, x3, t[m], s[i + 1], o[i + 1]);
                } else if (g16) {
                    DOT2C(c0, c1, x0, x1, t[m], s[i]);
                    DOT2C(c2, c3, x2, x3, t[m], s[i + 1]);
                } else if (o) {
                    DOT4R(c0, c1, c2, c3, t[m], s[i], o[i]);
                } else {
                    DOT4C(c0, c1, c2, c3, t[m], s[i]);
                }
            }
        }
        for (int m = 0; m < Q; m++) acc[m][r] = t[m];
    }
}
#endif

/* rows4_packed_512's sums (packed codes, G = 32; with AVX-512) and then rows4_packed_n's 256-bit ones from the
 * group it left (g16, or AVX2 alone: all of them) */
KERNEL_INLINE void rows4_packed_q(const int Q, const float* x, const float* xp, int64_t K, const int8_t* c,
                                  const float* s, int64_t ng, int packed, int g16, __m256 (*acc)[4]) {
    const int kind = packed >= 3 ? 3 : packed;
    LEVEL_TABLE(packed);
    const int64_t gpu = g16 ? 4 : 2;
#ifdef __AVX512F__
    const __m512i lo = _mm512_set_epi32(2, 2, 2, 2, 2, 2, 2, 2, 0, 0, 0, 0, 0, 0, 0, 0);
    const __m512i hi = _mm512_set_epi32(3, 3, 3, 3, 3, 3, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1);
    const __m512 values = _mm512_loadu_ps(packed >= 3 ? NIBBLE_LEVELS[packed - 3] : SIGNED_NIBBLES);
    const int64_t pairs = (xp && !g16) ? ng / 4 : 0;
#else
    const int64_t pairs = 0;
    (void)xp;
#endif
    for (int r = 0; r < 4; r++) {
        __m256 t[8];
#ifdef __AVX512F__
        __m512 a[8];
        for (int m = 0; m < Q; m++) a[m] = _mm512_setzero_ps();
        for (int64_t q = 0; q < pairs; q++) {
            const int8_t* u0 = c + (2 * q * 4 + r) * 32;
            const __m512i v = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)u0)),
                                                 _mm256_loadu_si256((const __m256i*)(u0 + 128)), 1);
            const __m512 sv = _mm512_castps128_ps512(_mm_loadu_ps(s + r * ng + 4 * q));
            const __m512 slo = _mm512_permutexvar_ps(lo, sv), shi = _mm512_permutexvar_ps(hi, sv);
            __m512 n[8];
            for (int i = 0; i < 8; i++) n[i] = nibble512(v, i, values);
            for (int m = 0; m < Q; m++) {
                const float* xq = xp + m * K + q * 128;
                __m512 d = _mm512_mul_ps(n[0], _mm512_loadu_ps(xq));
                __m512 e = _mm512_mul_ps(n[1], _mm512_loadu_ps(xq + 16));
                d = _mm512_fmadd_ps(n[2], _mm512_loadu_ps(xq + 32), d);
                e = _mm512_fmadd_ps(n[3], _mm512_loadu_ps(xq + 48), e);
                a[m] = _mm512_fmadd_ps(slo, _mm512_add_ps(d, e), a[m]);
                d = _mm512_mul_ps(n[4], _mm512_loadu_ps(xq + 64));
                e = _mm512_mul_ps(n[5], _mm512_loadu_ps(xq + 80));
                d = _mm512_fmadd_ps(n[6], _mm512_loadu_ps(xq + 96), d);
                e = _mm512_fmadd_ps(n[7], _mm512_loadu_ps(xq + 112), e);
                a[m] = _mm512_fmadd_ps(shi, _mm512_add_ps(d, e), a[m]);
            }
        }
        for (int m = 0; m < Q; m++) t[m] = pairs ? fold512(a[m]) : _mm256_setzero_ps();
#else
        for (int m = 0; m < Q; m++) t[m] = _mm256_setzero_ps();
#endif
        for (int64_t u = (4 * pairs) / gpu; u < ng / gpu; u++) {
            const __m256i v = _mm256_loadu_si256((const __m256i*)(c + (u * 4 + r) * 32));
            const float* sr = s + r * ng + u * gpu;
            for (int half = 0; half < 2; half++) { /* nibbles 0–3, then 4–7 */
                const int i = 4 * half;
                const __m256 n0 = CODEC(v, i, kind), n1 = CODEC(v, i + 1, kind);
                const __m256 n2 = CODEC(v, i + 2, kind), n3 = CODEC(v, i + 3, kind);
                for (int m = 0; m < Q; m++) {
                    const float* xh = x + m * K + u * 64 + 32 * half;
                    const __m256 x0 = _mm256_loadu_ps(xh), x1 = _mm256_loadu_ps(xh + 8);
                    const __m256 x2 = _mm256_loadu_ps(xh + 16), x3 = _mm256_loadu_ps(xh + 24);
                    if (g16) {
                        DOT2C(n0, n1, x0, x1, t[m], sr[2 * half]);
                        DOT2C(n2, n3, x2, x3, t[m], sr[2 * half + 1]);
                    } else {
                        DOT4C(n0, n1, n2, n3, t[m], sr[half]);
                    }
                }
            }
        }
        for (int m = 0; m < Q; m++) acc[m][r] = t[m];
    }
}

/* Q query rows of a block (Q a constant in each copy): out [Q][4] (stride 4) */
KERNEL_INLINE void rows4_q(const int Q, const float* x, const float* xp, int64_t K, const int8_t* c, const float* s,
                           const float* o, const float* xs, int64_t ng, int packed, int g16, float* out) {
    __m256 acc[8][4];
    if (packed)
        rows4_packed_q(Q, x, xp, K, c, s, ng, packed, g16, acc);
#ifdef __AVX512F__
    else if (o || g16)
        rows4_pair_q(Q, x, K, c, s, o, ng, g16, acc);
    else
        rows4_int8_q(Q, x, K, c, s, ng, acc);
#else
    else
        rows4_int8_q(Q, x, K, c, s, o, ng, g16, acc);
#endif
    for (int m = 0; m < Q; m++) rows4_finish(acc[m], s, o, xs ? xs + m * ng : NULL, ng, packed, out + 4 * m);
}
static void rows4_q8(const float* x, const float* xp, int64_t K, const int8_t* c, const float* s, const float* o,
                     const float* xs, int64_t ng, int packed, int g16, float* out) {
    rows4_q(8, x, xp, K, c, s, o, xs, ng, packed, g16, out);
}
static void rows4_q4(const float* x, const float* xp, int64_t K, const int8_t* c, const float* s, const float* o,
                     const float* xs, int64_t ng, int packed, int g16, float* out) {
    rows4_q(4, x, xp, K, c, s, o, xs, ng, packed, g16, out);
}
static void rows4_q2(const float* x, const float* xp, int64_t K, const int8_t* c, const float* s, const float* o,
                     const float* xs, int64_t ng, int packed, int g16, float* out) {
    rows4_q(2, x, xp, K, c, s, o, xs, ng, packed, g16, out);
}

/* rows4_dot1 as a function of its own, for the callers that run it once per query row of a block (several rows,
 * the screen's rescoring): the decode loop keeps its inlined copy. The same source, so the same operations: a
 * row's value is the same bits from either (tests/test_gguf_file.py compares them) */
__attribute__((noinline)) static void rows4_dot1_call(const float* x, const float* xp, const int8_t* c,
                                                      const float* s, const float* o, const float* xs, int64_t ng,
                                                      int packed, int g16, const char* pf, const sliced_row* sr,
                                                      float* out) {
    rows4_dot1(x, xp, c, s, o, xs, ng, packed, g16, pf, sr, out);
}

/* several query rows of a block where the integer path is on: the rows that are ok eight, four, two or one at a time
 * through the integer product, the others through the float one, each as it is alone; y: the block's first column
 * of [M, N] */
static void sliced_block(const float* x, const float* xp, int64_t K, const int8_t* c, const float* s,
                         const float* o, const float* xs, int64_t ng, int packed, int g16, const sliced_row* sr,
                         int64_t M, int64_t N, float* y) {
    int64_t m = 0;
    while (m < M) {
        float out[32];
        int64_t q = 0;
#ifdef LMHEAD_SLICED_BUILT
        while (q < 8 && m + q < M && sr[m + q].ok) q++;
        const float* xsm = xs ? xs + m * ng : NULL;
        if (q >= 8) q = 8, sliced_q(8, sr + m, c, s, o, xsm, ng, packed, g16, NULL, out);
        else if (q >= 4) q = 4, sliced_q(4, sr + m, c, s, o, xsm, ng, packed, g16, NULL, out);
        else if (q >= 2) q = 2, sliced_q(2, sr + m, c, s, o, xsm, ng, packed, g16, NULL, out);
        else if (q == 1) sliced_q(1, sr + m, c, s, o, xsm, ng, packed, g16, NULL, out);
#endif
        if (q == 0) {
            rows4_dot1_call(x + m * K, xp ? xp + m * K : NULL, c, s, o, xs ? xs + m * ng : NULL, ng, packed, g16,
                            NULL, sr + m, out);
            q = 1;
        }
        for (int64_t j = 0; j < q; j++)
            for (int r = 0; r < 4; r++) y[(m + j) * N + r] = out[4 * j + r];
        m += q;
    }
}

/* eight weights rebuilt exactly: code·scale (+ offset) in one rounding, as gguf's dequantiser computes them
 * (code·scale is exact in float32 for every format we store: ≤ 17 + 8 significant bits) */
static inline __m256 rebuild8(__m256 cf, __m256 sv, __m256 ov, int has_offset) {
    return has_offset ? _mm256_fmadd_ps(cf, sv, ov) : _mm256_mul_ps(cf, sv);
}

/* one weight row against R ≤ MB query rows (R a constant in each copy: the accumulators stay in registers),
 * each weight rebuilt once for all R rows. Up to 4 rows, two accumulators per row so that successive products
 * do not wait on each other; from 5 rows one each. Called with R = 1 only (row_dot: plain rows of int8 codes with
 * offsets, every query row alone, so that a row sums in one order whatever the batch). */
KERNEL_INLINE void rows_n(const int R, const float* x, int64_t K, const int8_t* c, int64_t us, const float* s,
                           const float* o, int64_t ng, int64_t G, int packed, float* out) {
    __m256 a[MB], b[4]; /* b: the second accumulators of R ≤ 4 rows */
    const __m256 zero = _mm256_setzero_ps();
    for (int m = 0; m < R; m++) a[m] = zero;
    for (int m = 0; m < R && m < 4; m++) b[m] = zero;
    LEVEL_TABLE(packed);
    if (packed) { /* unit u: groups u·gpu .. u·gpu + gpu − 1 (two of 32, or four of 16), eight codes per nibble i */
        const int64_t gpu = 64 / G;
        for (int64_t u = 0; u < K / 64; u++) {
            const __m256i v = UNIT4(c + u * us, packed);
#pragma GCC unroll 8
            for (int i = 0; i < 8; i++) {
                const int64_t gi = u * gpu + i * gpu / 8;
                const __m256 w = rebuild8(CODES8(v, i, packed), _mm256_set1_ps(s[gi]),
                                          o ? _mm256_set1_ps(o[gi]) : zero, o != NULL);
                for (int m = 0; m < R; m++) {
                    const __m256 xv = _mm256_loadu_ps(x + m * K + u * 64 + 8 * i);
                    if (R <= 4 && (i & 1))
                        b[m] = _mm256_fmadd_ps(w, xv, b[m]);
                    else
                        a[m] = _mm256_fmadd_ps(w, xv, a[m]);
                }
            }
        }
    } else {
        for (int64_t g = 0; g < ng; g++) {
            const __m256 sv = _mm256_set1_ps(s[g]);
            const __m256 ov = o ? _mm256_set1_ps(o[g]) : zero;
            for (int64_t j = 0; j < G; j += 16) {
                const __m256 w0 = rebuild8(BYTES8(CODE(c, us, g * G + j)), sv, ov, o != NULL);
                const __m256 w1 = rebuild8(BYTES8(CODE(c, us, g * G + j + 8)), sv, ov, o != NULL);
                for (int m = 0; m < R; m++) {
                    const float* xm = x + m * K + g * G + j;
                    a[m] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xm), a[m]);
                    if (R <= 4)
                        b[m] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xm + 8), b[m]);
                    else
                        a[m] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xm + 8), a[m]);
                }
            }
        }
    }
    for (int m = 0; m < R; m++) out[m] = hsum8(_mm256_add_ps(a[m], R <= 4 ? b[m] : zero));
}


/* one query row against one weight row: int8 codes with offsets rebuilt (rows_n), the rest factored (row_dot1) */
static inline float row_dot(const float* x, int64_t K, const int8_t* c, int64_t us, const float* s, const float* o,
                            const float* xs, int64_t ng, int64_t G, int packed) {
    if (o && !packed) {
        float out;
        rows_n(1, x, K, c, us, s, o, ng, G, packed, &out);
        return out;
    }
    return row_dot1(x, c, us, s, o, xs, ng, G, packed);
}
#else
int lmhead_coded_avx2(void) { return 0; }

/* code k of a row (k = g·G + i): as stored, or from the packed layout described above */
static inline int code_at(const int8_t* c, int64_t us, int64_t k, int packed) {
    if (!packed) return *CODE(c, us, k);
    const int64_t r = k % 64;
    const uint8_t* lane = (const uint8_t*)c + (k / 64) * us + (r % 8) * 4;
    const uint32_t word =
        (uint32_t)lane[0] | (uint32_t)lane[1] << 8 | (uint32_t)lane[2] << 16 | (uint32_t)lane[3] << 24;
    return (int)lmhead_nibble_code((int)((word >> (4 * (r / 8))) & 15), packed);
}

static inline float row_dot(const float* x, int64_t K, const int8_t* c, int64_t us, const float* s, const float* o,
                            const float* xs, int64_t ng, int64_t G, int packed) {
    (void)xs, (void)K;
    float r = 0.f;
    for (int64_t g = 0; g < ng; g++)
        for (int64_t i = 0; i < G; i++) {
            const float code = (float)code_at(c, us, g * G + i, packed);
            const float w = o ? fmaf(code, s[g], o[g]) : code * s[g];
            r += w * x[g * G + i];
        }
    return r;
}
#endif

/* ---- float16 and bfloat16 weights (F16 and BF16 files) -------------------------------------------------------
 * No scale to factor out: each weight is converted to the float32 number it is (exact, as gguf-py's dequantiser
 * converts it) and multiplied as float32 weights are, from half their bytes. Several query rows share each
 * conversion (R rows per pass over a weight row, as rows_n). */
static inline float bf16_to_float(uint16_t b) {
    union { uint32_t u; float f; } v;
    v.u = (uint32_t)b << 16;
    return v.f;
}
static inline float w16(const uint16_t* w, int64_t k, int bf16) {
    return bf16 ? bf16_to_float(w[k]) : half_to_float(w[k]);
}

#if defined(__AVX2__) && defined(__F16C__)
#define LOADH(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(p)))
#define LOADB(p) _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)(p))), 16))
/* one weight row against R query rows; two accumulators per row up to 4 rows (as rows_n) */
KERNEL_INLINE void dense_rows_n(const int R, const int bf16, const float* x, int64_t K, const uint16_t* w, float* out) {
    __m256 a[MB], b[4]; /* b: the second accumulators of R ≤ 4 rows */
    const __m256 zero = _mm256_setzero_ps();
    for (int m = 0; m < R; m++) a[m] = zero;
    for (int m = 0; m < R && m < 4; m++) b[m] = zero;
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) {
        const __m256 w0 = bf16 ? LOADB(w + k) : LOADH(w + k), w1 = bf16 ? LOADB(w + k + 8) : LOADH(w + k + 8);
        for (int m = 0; m < R; m++) {
            a[m] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + m * K + k), a[m]);
            if (R <= 4)
                b[m] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + m * K + k + 8), b[m]);
            else
                a[m] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + m * K + k + 8), a[m]);
        }
    }
    for (int m = 0; m < R; m++) {
        float t = hsum8(_mm256_add_ps(a[m], R <= 4 ? b[m] : zero));
        for (int64_t j = k; j < K; j++) t += w16(w, j, bf16) * x[m * K + j];
        out[m] = t;
    }
}

#ifdef __AVX512F__
/* sixteen float16 or bfloat16 weights at w as float32 (exact) */
static inline __m512 w16x16(const uint16_t* w, int bf16) {
    const __m256i h = _mm256_loadu_si256((const __m256i*)w);
    return bf16 ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)) : _mm512_cvtph_ps(h);
}

/* thirty-two bfloat16 weights at w as float32 (exact): the even ones (each 32-bit word's low half shifted up) and
 * the odd ones (its high half, the low bits cleared) — one load, a shift and an and for the 32, where a widening
 * per sixteen took two shuffles and two shifts (the one-row product's arithmetic, not its reads, bounded it) */
static inline void bf16_pairs(const uint16_t* w, __m512* even, __m512* odd) {
    const __m512i v = _mm512_loadu_si512((const void*)w);
    *even = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
    *odd = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32((int)0xffff0000u)));
}

/* a query row as bf16_pairs meets its weights: each whole 32 values x[c + 2j] then x[c + 2j + 1] (j < 16), the rest
 * as they are */
static void bf16_pair_layout(const float* x, int64_t K, float* xp) {
    int64_t k = 0;
    for (; k + 32 <= K; k += 32)
        for (int j = 0; j < 16; j++) xp[k + j] = x[k + 2 * j], xp[k + 16 + j] = x[k + 2 * j + 1];
    for (; k < K; k++) xp[k] = x[k];
}

/* one query row (decode) in 512-bit lanes: sixteen weights a conversion, two sums (bfloat16: x in
 * bf16_pair_layout, the even and the odd weights of each 32 the two sums') */
KERNEL_INLINE void dense16_row512(const float* x, int64_t K, const uint16_t* w, int bf16, int ahead, float* out) {
    __m512 a = _mm512_setzero_ps(), b = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
        if (ahead) _mm_prefetch((const char*)(w + k) + DENSE_AHEAD, _MM_HINT_T0);
        __m512 w0, w1;
        if (bf16)
            bf16_pairs(w + k, &w0, &w1);
        else
            w0 = w16x16(w + k, 0), w1 = w16x16(w + k + 16, 0);
        a = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x + k), a);
        b = _mm512_fmadd_ps(w1, _mm512_loadu_ps(x + k + 16), b);
    }
    float t = hsum8(fold512(_mm512_add_ps(a, b)));
    for (; k < K; k++) t += w16(w, k, bf16) * x[k];
    *out = t;
}

/* Q query rows (x: Q rows K apart; out: Q values `stride` apart) against a weight row, each summed as
 * dense16_row512 sums it alone (the same two sums of the same products, the same tail), each conversion used for
 * the Q rows */
KERNEL_INLINE void dense16_q512(const int Q, const float* x, int64_t K, const uint16_t* w, int bf16, float* out,
                                int64_t stride) {
    __m512 a[8], b[8];
    for (int m = 0; m < Q; m++) a[m] = b[m] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
        __m512 w0, w1;
        if (bf16)
            bf16_pairs(w + k, &w0, &w1);
        else
            w0 = w16x16(w + k, 0), w1 = w16x16(w + k + 16, 0);
        for (int m = 0; m < Q; m++) {
            a[m] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x + m * K + k), a[m]);
            b[m] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(x + m * K + k + 16), b[m]);
        }
    }
    for (int m = 0; m < Q; m++) {
        float t = hsum8(fold512(_mm512_add_ps(a[m], b[m])));
        for (int64_t j = k; j < K; j++) t += w16(w, j, bf16) * x[m * K + j];
        out[m * stride] = t;
    }
}
static void dense_q8(const float* x, int64_t K, const uint16_t* w, int bf16, float* out, int64_t stride) {
    if (bf16)
        dense16_q512(8, x, K, w, 1, out, stride);
    else
        dense16_q512(8, x, K, w, 0, out, stride);
}
static void dense_q4(const float* x, int64_t K, const uint16_t* w, int bf16, float* out, int64_t stride) {
    if (bf16)
        dense16_q512(4, x, K, w, 1, out, stride);
    else
        dense16_q512(4, x, K, w, 0, out, stride);
}
static void dense_q2(const float* x, int64_t K, const uint16_t* w, int bf16, float* out, int64_t stride) {
    if (bf16)
        dense16_q512(2, x, K, w, 1, out, stride);
    else
        dense16_q512(2, x, K, w, 0, out, stride);
}
#endif

/* one query row against a weight row: each type a copy with its constants */
#ifdef __AVX512F__
static void dense_pass1(const float* x, int64_t K, const uint16_t* w, int bf16, float* out) {
    if (bf16)
        dense16_row512(x, K, w, 1, 0, out);
    else
        dense16_row512(x, K, w, 0, 0, out);
}
/* one query row with the stream's bytes DENSE_AHEAD ahead fetched: for a matrix whose share per thread is short
 * (DENSE_FETCH_BYTES), which the hardware's prefetcher has hardly begun to follow when it ends (a small body's
 * products, each read from memory once a token); a long one it follows better alone */
static void dense_fetch1(const float* x, int64_t K, const uint16_t* w, int bf16, float* out) {
    if (bf16)
        dense16_row512(x, K, w, 1, 1, out);
    else
        dense16_row512(x, K, w, 0, 1, out);
}
#else
static void dense_pass1(const float* x, int64_t K, const uint16_t* w, int bf16, float* out) {
    if (bf16)
        dense_rows_n(1, 1, x, K, w, out);
    else
        dense_rows_n(1, 0, x, K, w, out);
}
#endif
typedef void (*dense_pass)(const float*, int64_t, const uint16_t*, int, float*);
#endif

static int dense_matmul(const float* x, int64_t M, int64_t K, const uint16_t* w, int64_t N, int bf16, float* y,
                        int threads) {
    if (threads < 1) threads = 1;
    /* several query rows: chunks of rows as lmhead_coded_matmul's; one: the rows in shares (thread_shares.h) */
    const int64_t chunk = M == 1 ? (N + threads - 1) / threads : (N / (8 * threads) > 1 ? N / (8 * threads) : 1);
#if defined(__AVX2__) && defined(__F16C__)
    dense_pass one = dense_pass1;
#ifdef __AVX512F__
    if (M == 1 && chunk * K * 2 < DENSE_FETCH_BYTES) one = dense_fetch1; /* the same sums, the stream fetched ahead */
    float xp_stack[4096];
    float* xp = NULL;
    if (bf16) { /* each query row in bf16_pair_layout, once for all N weight rows */
        xp = M * K <= 4096 ? xp_stack : (float*)malloc((size_t)(M * K) * sizeof(float));
        if (!xp) return LMHEAD_NO_MEMORY;
        for (int64_t m = 0; m < M; m++) bf16_pair_layout(x + m * K, K, xp + m * K);
        x = xp;
    }
#endif
#endif
    int status = 0;
#if defined(__AVX2__) && defined(__F16C__)
    shares rows;
    if (M == 1 && shares_open(&rows, N, DENSE_ROUND, threads)) {
        status = LMHEAD_NO_MEMORY;
    } else if (M == 1) {
#pragma omp parallel num_threads(threads)
        {
            share_cursor cursor = share_start();
            for (int64_t n; (n = shares_unit(&rows, &cursor)) >= 0;) one(x, K, w + n * K, bf16, y + n);
        }
        shares_close(&rows);
    } else
#endif
    {
    /* each query row as the one-row pass computes it (the weight row from L1 after the first): a row's product is
     * the same bits whatever else is in the batch */
#pragma omp parallel for num_threads(threads) schedule(dynamic, chunk)
    for (int64_t n = 0; n < N; n++) {
        const uint16_t* wn = w + n * K;
        for (int64_t m = 0; m < M; m++) {
#if defined(__AVX2__) && defined(__F16C__)
#ifdef __AVX512F__
            /* 8, 4 or 2 rows sharing each conversion: which rows go together changes no row's sums */
            if (M - m >= 8) {
                dense_q8(x + m * K, K, wn, bf16, y + m * N + n, N);
                m += 7;
                continue;
            }
            if (M - m >= 4) {
                dense_q4(x + m * K, K, wn, bf16, y + m * N + n, N);
                m += 3;
                continue;
            }
            if (M - m >= 2) {
                dense_q2(x + m * K, K, wn, bf16, y + m * N + n, N);
                m += 1;
                continue;
            }
#endif
            one(x + m * K, K, wn, bf16, y + m * N + n);
#else
            float t = 0.f;
            for (int64_t k = 0; k < K; k++) t += w16(wn, k, bf16) * x[m * K + k];
            y[m * N + n] = t;
#endif
        }
    }
    }
#if defined(__AVX2__) && defined(__F16C__) && defined(__AVX512F__)
    if (xp && xp != xp_stack) free(xp);
#endif
    return status;
}

/* ---- float32 weights (F32 files, a float32 model's own matrices) -----------------------------------------------
 * The weights are the model's numbers as they are. Each (query row, weight row) pair is summed in one order
 * whatever M, N or the threads: with AVX-512 one sum of sixteen lanes over K in steps of 16, folded at the end,
 * the last K mod 16 products one by one (dot32_row for one query row, a weight row after another: one stream a
 * thread; dot32_tile for several: RW weight rows by RX query rows share their loads — a tile of four by six runs a
 * prefill's products at the FMA units' rate); with AVX2 four sums of eight lanes added at the end (dot32). */
static inline float dot32_tail(float t, const float* x, const float* w, int64_t k, int64_t K) {
    for (; k < K; k++) t = fmaf(w[k], x[k], t);
    return t;
}

#ifdef __AVX512F__
/* y[m·N + r] = the pair (x + m·K, w + r·K)'s sum, for r < RW, m < RX */
KERNEL_INLINE void dot32_tile(const int RW, const int RX, const float* x, int64_t K, const float* w, float* y,
                              int64_t N) {
    __m512 a[4][6];
    for (int m = 0; m < RX; m++)
        for (int r = 0; r < RW; r++) a[r][m] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) {
        __m512 v[4];
        for (int r = 0; r < RW; r++) v[r] = _mm512_loadu_ps(w + r * K + k);
        for (int m = 0; m < RX; m++) {
            const __m512 u = _mm512_loadu_ps(x + m * K + k);
            for (int r = 0; r < RW; r++) a[r][m] = _mm512_fmadd_ps(v[r], u, a[r][m]);
        }
    }
    for (int m = 0; m < RX; m++)
        for (int r = 0; r < RW; r++)
            y[m * N + r] = dot32_tail(hsum8(fold512(a[r][m])), x + m * K, w + r * K, k, K);
}
#define DOT32_TILE(RW, RX) \
    static void dot32_##RW##x##RX(const float* x, int64_t K, const float* w, float* y, int64_t N) { \
        dot32_tile(RW, RX, x, K, w, y, N); \
    }
DOT32_TILE(4, 1) DOT32_TILE(4, 2) DOT32_TILE(4, 3) DOT32_TILE(4, 4) DOT32_TILE(4, 5) DOT32_TILE(4, 6)
DOT32_TILE(1, 1)

/* one query row against one weight row, the sum dot32_tile makes of the pair: a decode step's weight rows read one
 * after another, each thread's share one sequential stream (four rows a tile were four interleaved streams, which
 * the prefetchers of some CPUs follow more slowly than one: docs/decode.md) */
static void dot32_row(const float* x, int64_t K, const float* w, float* out) {
    __m512 a = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) a = _mm512_fmadd_ps(_mm512_loadu_ps(w + k), _mm512_loadu_ps(x + k), a);
    *out = dot32_tail(hsum8(fold512(a)), x, w, k, K);
}
typedef void (*dot32_fn)(const float*, int64_t, const float*, float*, int64_t);
static const dot32_fn DOT32_4X[7] = {0, dot32_4x1, dot32_4x2, dot32_4x3, dot32_4x4, dot32_4x5, dot32_4x6};

static int dense32_matmul(const float* x, int64_t M, int64_t K, const float* w, int64_t N, float* y, int threads) {
    if (threads < 1) threads = 1;
    /* one query row: the rows in shares (thread_shares.h), rounds of DENSE_ROUND rows, one at a time; several:
     * chunks of about 64 weight rows (L2), as many as a multiple of the threads, over which each six query rows
     * (L1) pass before the next six. Which pairs share a tile changes none of their sums */
    if (M == 1) {
        shares rows;
        if (shares_open(&rows, N, DENSE_ROUND, threads)) return LMHEAD_NO_MEMORY;
#pragma omp parallel num_threads(threads)
        {
            share_cursor cursor = share_start();
            int64_t count;
            for (int64_t n0; (n0 = shares_next(&rows, &cursor, &count)) >= 0;)
                for (int64_t n = n0; n < n0 + count; n++) dot32_row(x, K, w + n * K, y + n);
        }
        shares_close(&rows);
        return 0;
    }
    const int64_t want = ((N + 63) / 64 + threads - 1) / threads * threads;
    const int64_t per = ((N + want - 1) / want + 3) / 4 * 4, chunks = (N + per - 1) / per;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
    for (int64_t c = 0; c < chunks; c++) {
        const int64_t n0 = c * per, n1 = n0 + per < N ? n0 + per : N;
        for (int64_t m = 0; m < M; m += 6) {
            const int64_t rx = M - m < 6 ? M - m : 6;
            int64_t n = n0;
            for (; n + 4 <= n1; n += 4) DOT32_4X[rx](x + m * K, K, w + n * K, y + m * N + n, N);
            for (; n < n1; n++)
                for (int64_t i = 0; i < rx; i++) dot32_1x1(x + (m + i) * K, K, w + n * K, y + (m + i) * N + n, N);
        }
    }
    return 0;
}
#else
static float dot32(const float* x, const float* w, int64_t K) {
    int64_t k = 0;
    float t = 0.f;
#ifdef __AVX2__
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (; k + 32 <= K; k += 32) {
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w + k), _mm256_loadu_ps(x + k), a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(w + k + 8), _mm256_loadu_ps(x + k + 8), a1);
        a2 = _mm256_fmadd_ps(_mm256_loadu_ps(w + k + 16), _mm256_loadu_ps(x + k + 16), a2);
        a3 = _mm256_fmadd_ps(_mm256_loadu_ps(w + k + 24), _mm256_loadu_ps(x + k + 24), a3);
    }
    for (; k + 8 <= K; k += 8) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w + k), _mm256_loadu_ps(x + k), a0);
    t = hsum8(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
#endif
    return dot32_tail(t, x, w, k, K);
}

static int dense32_matmul(const float* x, int64_t M, int64_t K, const float* w, int64_t N, float* y, int threads) {
    if (threads < 1) threads = 1;
    /* one query row: the rows in shares (thread_shares.h), rounds of DENSE_ROUND rows; several: chunks as threads
     * come for them */
    if (M == 1) {
        shares rows;
        if (shares_open(&rows, N, DENSE_ROUND, threads)) return LMHEAD_NO_MEMORY;
#pragma omp parallel num_threads(threads)
        {
            share_cursor cursor = share_start();
            for (int64_t n; (n = shares_unit(&rows, &cursor)) >= 0;) y[n] = dot32(x, w + n * K, K);
        }
        shares_close(&rows);
        return 0;
    }
    const int64_t chunk = N / (8 * threads) > 1 ? N / (8 * threads) : 1;
#pragma omp parallel for num_threads(threads) schedule(dynamic, chunk)
    for (int64_t n = 0; n < N; n++)
        for (int64_t m = 0; m < M; m++) y[m * N + n] = dot32(x + m * K, w + n * K, K);
    return 0;
}
#endif

/* y [M, N] = x [M, K] · Wᵀ, W given by codes/scale/offset as above (or, LMHEAD_F16 / LMHEAD_BF16, by 16-bit
 * weights: dense_matmul; LMHEAD_F32, by float32 weights: dense32_matmul). Returns 0, or -1 for arguments it cannot
 * take (G not a multiple of 16, K not a multiple of G; packed: G ≠ 32 or K not a multiple of 64; SIGNED4 or IQ4
 * without PACKED, with offsets, or both; rows4: N or K/32
 * not whole, or G neither 32 nor 16 unpacked (Q6_K, Q3_K, Q2_K: two groups per unit); float16
 * scales: more than HALF_MAX_GROUPS groups per row). */
#ifdef __AVX2__ /* where the four-row products are */
/* each query row's slices (x [M, K]) where this product takes the integer path — packed codes of any layout (a
 * level table's in groups of 32), or int8 codes without offsets — and this machine's mode turns it on (lmhead_sliced);
 * NULL otherwise (or where the memory is not to be had: the float path). Freed by sliced_free. */
static sliced_row* sliced_make(const float* x, int64_t M, int64_t K, int packed, int64_t G, int has_offset) {
#ifdef LMHEAD_SLICED_BUILT
    if (M <= 0 || !(packed ? (sliced_mode & SLICED_PACKED) && (packed < 3 || G == 32)
                           : (sliced_mode & SLICED_INT8) && !has_offset))
        return NULL;
    const int64_t unit_bytes = packed ? (K / 64) * SLICED_UNIT : (K / 32) * SLICED8_UNIT;
    int8_t* slices = (int8_t*)aligned_alloc(64, (size_t)(M * unit_bytes));
    sliced_row* srows = (sliced_row*)malloc((size_t)M * sizeof(sliced_row));
    if (!slices || !srows) {
        free(slices), free(srows);
        return NULL;
    }
    for (int64_t m = 0; m < M; m++) {
        int8_t* u = slices + m * unit_bytes;
        srows[m].units = u;
        srows[m].ok = packed ? sliced_prepare(x + m * K, K, packed >= 3 ? SLICED_BIAS[packed - 3] : 8, u)
                             : sliced_prepare8(x + m * K, K, u);
    }
    return srows;
#else
    (void)x, (void)M, (void)K, (void)packed, (void)G, (void)has_offset;
    return NULL;
#endif
}

static void sliced_free(sliced_row* srows) {
    if (srows) free((void*)srows[0].units), free(srows); /* row 0's units begin the rows' one buffer */
}
#endif

#ifdef LMHEAD_SLICED_BUILT
#include "groups_kernel.h"
#endif

/* row n of a matrix in the integer path by groups' layout as float32 (decode_kernels.c's coded_row: the C step's
 * embedding rows, CodedLinear.rows) → 0; -1 where the path is not built (nor then the layout) */
int lmhead_groups_row(const void* codes, const void* scale, const void* offset, int64_t N, int64_t K, int64_t G,
                      int flags, int64_t n, float* out) {
#ifdef LMHEAD_SLICED_BUILT
    const int skind = (flags & LMHEAD_SUB) ? G16_SUB : (flags & LMHEAD_E8M0) ? G16_E8M0 : G16_HALF;
    if (g16_high_bits(flags) < 0) return -1;
    g16_row((const uint8_t*)codes, scale, offset, skind, G == 16, (flags & LMHEAD_PACKED) != 0,
            (flags & LMHEAD_SIGNED4) != 0, lmhead_table_of(flags), g16_high_bits(flags), N, K, n, out);
    return 0;
#else
    (void)codes, (void)scale, (void)offset, (void)N, (void)K, (void)G, (void)flags, (void)n, (void)out;
    return -1;
#endif
}

int lmhead_coded_matmul(const float* x, int64_t M, int64_t K, const int8_t* codes, const void* scale,
                        const void* offset, int64_t N, int64_t G, int flags, float* y, int threads) {
    if (flags & LMHEAD_GROUPS16) {
#ifdef LMHEAD_SLICED_BUILT
        /* a K-quant's scales, float16 ones or exponent bytes: one of the three */
        const int sub = (flags & LMHEAD_SUB) != 0, half = (flags & LMHEAD_HALF) != 0, e8m0 = (flags & LMHEAD_E8M0) != 0;
        if ((G != 32 && !(G == 16 && sub)) || sub + half + e8m0 != 1 ||
            (flags & ~(LMHEAD_GROUPS16 | LMHEAD_HALF | LMHEAD_SUB | LMHEAD_E8M0 | LMHEAD_PACKED | LMHEAD_SIGNED4 |
                       LMHEAD_TABLE_FLAGS | LMHEAD_HIGH1 | LMHEAD_HIGH2)))
            return -1;
        return groups16_matmul(x, M, K, (const uint8_t*)codes, scale, offset,
                               sub ? G16_SUB : e8m0 ? G16_E8M0 : G16_HALF, G == 16, N,
                               (flags & LMHEAD_PACKED) != 0, (flags & LMHEAD_SIGNED4) != 0, lmhead_table_of(flags),
                               g16_high_bits(flags), y, threads);
#else
        return -1; /* not built here: the layout is made only where it is */
#endif
    }
    if (flags & LMHEAD_F32) {
        if (M < 0 || N < 0 || K < 0 || flags != LMHEAD_F32) return -1;
        return dense32_matmul(x, M, K, (const float*)codes, N, y, threads);
    }
    if (flags & (LMHEAD_F16 | LMHEAD_BF16)) {
        if (M < 0 || N < 0 || K < 0 || (flags & ~(LMHEAD_F16 | LMHEAD_BF16)) || flags == (LMHEAD_F16 | LMHEAD_BF16))
            return -1;
        return dense_matmul(x, M, K, (const uint16_t*)codes, N, (flags & LMHEAD_BF16) != 0, y, threads);
    }
    const int table = lmhead_table_of(flags);
    const int packed = !(flags & LMHEAD_PACKED) ? 0 : table >= 0 ? 3 + table : (flags & LMHEAD_SIGNED4) ? 2 : 1;
    const int stored = (flags & LMHEAD_HALF) ? STORED_F16 : (flags & LMHEAD_E8M0) ? STORED_E8M0 : STORED_F32;
    const int rows4 = (flags & LMHEAD_ROWS4) != 0;
    if ((flags & LMHEAD_HALF) && (flags & LMHEAD_E8M0)) return -1;
    if (stored == STORED_E8M0 && offset) return -1;
    /* the nibbles' meaning: at most one of SIGNED4 and the tables, only with PACKED; a table without offsets */
    const int levels = flags & (LMHEAD_SIGNED4 | LMHEAD_TABLE_FLAGS);
    if (levels && (!packed || (offset && levels != LMHEAD_SIGNED4) || (levels & (levels - 1)))) return -1;
    if (G <= 0 || G % 16 != 0 || K % G != 0 || M < 0 || N < 0 || (packed && ((G != 32 && G != 16) || K % 64 != 0)) ||
        (rows4 && (N % 4 != 0 || K % 32 != 0 || !(G == 32 || G == 16))))
        return -1;
    const int64_t row_bytes = packed ? K / 2 : K, us = rows4 ? 128 : 32;
    const int64_t ng = K / G;
    const int sub = (flags & LMHEAD_SUB) != 0;
    if (sub && (stored != STORED_F32 || K % 256 != 0 || (G != 16 && G != 32))) return -1;
    if ((stored != STORED_F32 || sub) && ng > HALF_MAX_GROUPS) return -1;
    if (threads < 1) threads = 1;
    /* blocks of four rows in shares (thread_shares.h): each thread's contiguous share taken in rounds from its
     * front, one forward stream each (chunks handed out in turn, interleaving the streams, were slower for one
     * row), the rounds left of another's share from its back — so that on a shared machine a thread that loses its
     * core for a moment does not hold the product back. A round: DENSE_ROUND rows for one query row
     * (memory-bound), ~1/8 of a thread's share for several (compute-bound); other layouts' rows: one contiguous
     * share per thread for one query row, else chunks as threads come for them */
    const int64_t units = rows4 ? N / 4 : N;
    const int64_t chunk = M == 1 ? (rows4 ? DENSE_ROUND / 4 : (units + threads - 1) / threads)
                                 : (units / (8 * threads) > 1 ? units / (8 * threads) : 1);
    /* packed codes whose offsets follow the loop: each query row's group sums xs [M, ng], once for all N weight
     * rows */
    float xs_stack[256];
    float* xs = NULL;
    if (SPLIT_OFFSETS(packed, offset) && M > 0) {
        xs = M * ng <= 256 ? xs_stack : (float*)malloc((size_t)(M * ng) * sizeof(float));
        if (!xs) return LMHEAD_NO_MEMORY;
        for (int64_t m = 0; m < M; m++)
            for (int64_t g = 0; g < ng; g++) {
                float t = 0.f;
                for (int64_t i = 0; i < G; i++) t += x[m * K + g * G + i];
                xs[m * ng + g] = t;
            }
    }
#ifdef __AVX2__
    if (rows4 && M > 0) { /* weight rows four at a time */
        const int64_t blocks = N / 4;
#ifdef __AVX512F__
        float xp_stack[4096];
        float* xp = NULL;
        if (packed && G == 32 && K >= 128) { /* rows4_packed_512's layout of each query row, once for all N rows */
            xp = M * K <= 4096 ? xp_stack : (float*)malloc((size_t)(M * K) * sizeof(float));
            if (!xp) {
                if (xs && xs != xs_stack) free(xs);
                return LMHEAD_NO_MEMORY;
            }
            for (int64_t m = 0; m < M; m++) xp_layout(x + m * K, K, xp + m * K);
        }
#else
        const float* const xp = NULL;
#endif
        /* the integer product's slices of each query row (sliced_kernel.h), once for all N rows */
        sliced_row* srows = sliced_make(x, M, K, packed, G, offset != NULL);
        shares shared;
        if (shares_open(&shared, blocks, chunk, threads)) {
            if (xs && xs != xs_stack) free(xs);
#ifdef __AVX512F__
            if (xp && xp != xp_stack) free(xp);
#endif
            sliced_free(srows);
            return LMHEAD_NO_MEMORY;
        }
#pragma omp parallel num_threads(threads)
        {
            share_cursor cursor = share_start();
            for (int64_t b; (b = shares_unit(&shared, &cursor)) >= 0;) {
                const int64_t n0 = b * 4, nr = 4;
                float s32[4 * HALF_MAX_GROUPS], o32[4 * HALF_MAX_GROUPS];
                /* the block PREFETCH_AHEAD blocks on, fetched while this one is computed: with the unpacking's
                 * arithmetic between its loads, the hardware prefetcher alone left one thread at ~60% of the rate it
                 * computes at from cache (SmolLM2's MLP matrices, one thread, out of cache: 6.7 → 10.5 G weights/s).
                 * Its codes are fetched two lines per 128-byte unit of this block's loop (fetch_unit), not all at
                 * once before it: a block's 20–130 prefetches issued together stalled the loop behind them, so that
                 * the arithmetic and the reads took turns. Spread, every decode product of both models' bodies at
                 * two threads went 1.07–1.3× faster and Gemma's head 1.14× (interleaved in one process; the scales'
                 * few lines still go at once) */
                const char* spread = NULL;
                if (b + PREFETCH_AHEAD < blocks) {
                    spread = (const char*)(codes + (n0 + 4 * PREFETCH_AHEAD) * row_bytes);
                    fetch_scales(scale, N, K, ng, n0 + 4 * PREFETCH_AHEAD, nr, stored, sub);
                    if (offset) fetch_scales(offset, N, K, ng, n0 + 4 * PREFETCH_AHEAD, nr, stored, sub);
                }
                const float* s = rows_scales(scale, N, K, ng, n0, nr, stored, sub, s32);
                const float* o = offset ? rows_scales(offset, N, K, ng, n0, nr, stored, sub, o32) : NULL;
                if (M == 1 && (!srows || srows[0].ok)) {
                    rows4_dot1(x, xp, codes + n0 * row_bytes, s, o, xs, ng, packed, G == 16, spread, srows, y + n0);
                    continue;
                }
                /* each query row as alone: the integer product or, where its row is not ok, the float one */
                if (srows) {
                    sliced_block(x, xp, K, codes + n0 * row_bytes, s, o, xs, ng, packed, G == 16, srows, M, N, y + n0);
                    continue;
                }
                /* several query rows (verification, batched decode, prefill): each row's product is the one-row
                 * product's, the same operations in the same order (bit for bit what the row gets alone, whatever else
                 * is in the batch and however the threads share it); the block is read from L1 after the first row */
                for (int64_t m = 0; m < M;) {
                    float out[32];
                    int64_t q = 1;
                    const float* xm = x + m * K;
                    const float* xpm = xp ? xp + m * K : NULL;
                    const float* xsm = xs ? xs + m * ng : NULL;
                    /* 8, 4 or 2 rows at a time, each weight converted once for them: which rows go together changes
                     * no row's sums */
                    q = M - m >= 8 ? 8 : M - m >= 4 ? 4 : M - m >= 2 ? 2 : 1;
                    if (q == 8) rows4_q8(xm, xpm, K, codes + n0 * row_bytes, s, o, xsm, ng, packed, G == 16, out);
                    else if (q == 4) rows4_q4(xm, xpm, K, codes + n0 * row_bytes, s, o, xsm, ng, packed, G == 16, out);
                    else if (q == 2) rows4_q2(xm, xpm, K, codes + n0 * row_bytes, s, o, xsm, ng, packed, G == 16, out);
                    else
                        rows4_dot1_call(xm, xpm, codes + n0 * row_bytes, s, o, xsm, ng, packed, G == 16,
                                        m == 0 ? spread : NULL, NULL, out);
                    for (int64_t j = 0; j < q; j++)
                        for (int r = 0; r < 4; r++) y[(m + j) * N + n0 + r] = out[4 * j + r];
                    m += q;
                }
            }
        }
        shares_close(&shared);
        if (xs && xs != xs_stack) free(xs);
#ifdef __AVX512F__
        if (xp && xp != xp_stack) free(xp);
#endif
        sliced_free(srows);
        return 0;
    }
#endif
#pragma omp parallel for num_threads(threads) schedule(dynamic, chunk)
    for (int64_t n = 0; n < N; n++) {
        const int8_t* c = rows4 ? codes + (n / 4) * 4 * row_bytes + (n % 4) * 32 : codes + n * row_bytes;
        float s32[HALF_MAX_GROUPS], o32[HALF_MAX_GROUPS];
        const float* s = rows_scales(scale, N, K, ng, n, 1, stored, sub, s32);
        const float* o = offset ? rows_scales(offset, N, K, ng, n, 1, stored, sub, o32) : NULL;
        /* each query row as the one-row product computes it (the weight row from L1 after the first) */
        for (int64_t m = 0; m < M; m++)
            y[m * N + n] = row_dot(x + m * K, K, c, us, s, o, xs ? xs + m * ng : NULL, ng, G, packed);
    }
    if (xs && xs != xs_stack) free(xs);
    return 0;
}

/* ---- the screen: which logits can be in a row's top k, without computing them all exactly ------------------
 *
 * For int8 codes without offsets in blocks of four rows with float16 scales (Q8_0, Q5_0: Gemma 3's head), x is
 * put on one int16 grid per query row, x̂ = d·q with d = max|x| / 32767 (with VNNI: a grid per group of 32, see
 * screen_block_n), and each weight row's approximate value ŷ = d · Σ_g scale_g · Σ_i code_i·q_i is summed in
 * int32 (exact: a lane adds four products of at most 128·32767, below 2^24, so its conversion to float is exact
 * too) — several query rows then cost less than the exact float32 product (integer multiply-adds, not one float32
 * FMA per weight). The exact value e (rows4_dot1's, the one-row product's own numbers) is within
 *
 *     |e − ŷ| ≤ ‖w‖₂ · β,   β = ‖x − x̂‖₂ + γ·(‖x‖₂ + ‖x̂‖₂),   γ = n·u / (1 − n·u), n = K + K/32 + 8, u = 2⁻²⁴
 *
 * (Cauchy–Schwarz on w·(x − x̂); γ·Σ|w||x| bounds each float32 sum's rounding, and Σ|w||x| ≤ ‖w‖‖x‖). With L
 * the k-th largest lower bound ŷ − ‖w‖β of a row, every token whose exact value can reach the row's top k has
 * ŷ + ‖w‖β ≥ L: those candidates get their exact values (rows4_dot1 of their block), every other token keeps ŷ,
 * which is below L, so below the top k's exact values. lmhead_screen_norms gives ‖w‖ per row (rounded up),
 * lmhead_screen gives ŷ [M, N] and β [M], lmhead_screen_select the candidates, lmhead_screen_rescore their
 * exact values. */
#define SCREEN_ROWS 8 /* query rows per pass over a block */

/* √total, a weight row's ‖w‖₂ from its Σw² in double, rounded up to a float (never below the exact norm) */
static inline float norm_up(double total) {
    const double r = sqrt(total) * (1.0 + 1e-12);
    float f = (float)r;
    if ((double)f < r) f = nextafterf(f, INFINITY);
    return f;
}

/* ‖w_n‖₂ of every weight row, in double, rounded up to float */
int lmhead_screen_norms(const int8_t* codes, const uint16_t* scale, int64_t N, int64_t K, float* out, int threads) {
    if (K % 32 != 0 || N % 4 != 0 || K / 32 > HALF_MAX_GROUPS) return -1;
    const int64_t ng = K / 32;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const int8_t* c = codes + (n / 4) * 4 * K + (n % 4) * 32;
        double total = 0.0;
        for (int64_t g = 0; g < ng; g++) {
            const double s = (double)half_to_float(scale[n * ng + g]);
            int64_t sq = 0;
            for (int i = 0; i < 32; i++) sq += (int64_t)c[g * 128 + i] * c[g * 128 + i];
            total += s * s * (double)sq;
        }
        out[n] = norm_up(total);
    }
    return 0;
}

#ifdef __AVX2__
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VNNI__)
/* With VNNI each group of 32 activations has a grid of its own, x̂ᵢ = d_g·qᵢ with d_g = max|x_g| / 127 and qᵢ
 * signed bytes: vpdpbusd multiplies the codes biased by 128 (unsigned bytes) with q, sixty-four products a
 * lane of four, into an accumulator that starts at −128 times the lane's four q — so each int32 lane is exactly
 * Σ cᵢqᵢ of its four weights (at most 4·128·127 in magnitude, exact in float32). A lane's value times
 * fl(s_g·d_g) is one term of ŷ = Σ_g s_g·d_g·Σᵢ cᵢqᵢ; the bound above holds as it is, with x̂ these grids and
 * Σ|terms| ≤ Σ|w||x̂| (every lane is a sum of its own weights' products). Per group grids keep a row's
 * candidates few where one int8 grid for the row would not (outlier channels). */
#define SCREEN_INT8 1
/* A query row's share of a pair of groups: its 64 grid values (bytes), the sixteen lanes' starting values and the
 * sixteen lanes' grid steps, side by side, so that one pointer walks every query row's data. */
typedef struct {
    int8_t q[64];
    int32_t start[16];
    float step[16];
} screen_pair;

/* a pair of groups' codes a (biased to unsigned bytes) and scales sv against the Q query rows' pg[m] */
KERNEL_INLINE void screen_pair_step(const int Q, const screen_pair* pg, __m512i a, __m512 sv, __m512* acc) {
    for (int m = 0; m < Q; m++) {
        const __m512i p = _mm512_dpbusd_epi32(_mm512_load_si512(pg[m].start), a, _mm512_load_si512(pg[m].q));
        acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_mul_ps(sv, _mm512_load_ps(pg[m].step)), acc[m]);
    }
}

/* one block of four weight rows against Q ≤ SCREEN_ROWS query rows: pairs [(ng + 1)/2][M] (this pass's rows
 * first; an odd last group's pair is zero past it); out [Q, 4] (stride 4) */
KERNEL_INLINE void screen_block_n(const int Q, const screen_pair* pairs, int64_t M, const int8_t* c, const float* s,
                                   int64_t ng, const char* pf, float* out) {
    const __m512i bias = _mm512_set1_epi8((char)0x80);
    int64_t line = 0; /* of the block at pf (2·ng lines), one fetched a pair of groups */
    for (int r = 0; r < 4; r++) {
        __m512 acc[SCREEN_ROWS];
        for (int m = 0; m < Q; m++) acc[m] = _mm512_setzero_ps();
        const screen_pair* pg = pairs;
        int64_t g = 0;
        for (; g + 1 < ng; g += 2, pg += M) {
            if (pf && line < 2 * ng) _mm_prefetch(pf + 64 * line++, _MM_HINT_T0);
            const __m256i lo = _mm256_loadu_si256((const __m256i*)(c + (g * 4 + r) * 32));
            const __m256i hi = _mm256_loadu_si256((const __m256i*)(c + ((g + 1) * 4 + r) * 32));
            const __m512i a = _mm512_xor_si512(_mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1), bias);
            screen_pair_step(Q, pg, a,
                             _mm512_insertf32x8(_mm512_set1_ps(s[r * ng + g]), _mm256_set1_ps(s[r * ng + g + 1]), 1),
                             acc);
        }
        if (g < ng) { /* the odd last group: its pair's other half is zero (q, starts and steps) */
            const __m256i lo = _mm256_loadu_si256((const __m256i*)(c + (g * 4 + r) * 32));
            const __m512i a = _mm512_xor_si512(_mm512_zextsi256_si512(lo), bias);
            screen_pair_step(Q, pg, a, _mm512_set1_ps(s[r * ng + g]), acc);
        }
        for (int m = 0; m < Q; m++) out[m * 4 + r] = _mm512_reduce_add_ps(acc[m]);
    }
}
#define SCREEN_PASS_ARGS const screen_pair* pairs, int64_t M, const int8_t* c, const float* s, int64_t ng, \
                         const char* pf, float* out
#define SCREEN_PASS_CALL pairs, M, c, s, ng, pf, out
#else
/* one block of four weight rows against Q ≤ SCREEN_ROWS query rows on their int16 grids: out [Q, 4] (stride 4),
 * without the grids' steps d */
KERNEL_INLINE void screen_block_n(const int Q, const int16_t* q, int64_t K, const int8_t* c, const float* s,
                                   int64_t ng, const char* pf, float* out) {
    int64_t line = 0; /* of the block at pf (2·ng lines), one fetched every other group */
    for (int r = 0; r < 4; r++) {
        __m256 acc[SCREEN_ROWS];
        for (int m = 0; m < Q; m++) acc[m] = _mm256_setzero_ps();
        for (int64_t g = 0; g < ng; g++) {
            if (pf && (g & 1) == 0 && line < 2 * ng) _mm_prefetch(pf + 64 * line++, _MM_HINT_T0);
            const int8_t* cg = c + (g * 4 + r) * 32;
            const __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)cg));
            const __m256i w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(cg + 16)));
            const __m256 sv = _mm256_set1_ps(s[r * ng + g]);
            const int16_t* qg = q + g * 32;
            for (int m = 0; m < Q; m++) {
                const __m256i p = _mm256_add_epi32(
                    _mm256_madd_epi16(w0, _mm256_loadu_si256((const __m256i*)(qg + m * K))),
                    _mm256_madd_epi16(w1, _mm256_loadu_si256((const __m256i*)(qg + m * K + 16))));
                acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), sv, acc[m]);
            }
        }
        for (int m = 0; m < Q; m++) out[m * 4 + r] = hsum8(acc[m]);
    }
}
#define SCREEN_PASS_ARGS const int16_t* q, int64_t K, const int8_t* c, const float* s, int64_t ng, const char* pf, \
                         float* out
#define SCREEN_PASS_CALL q, K, c, s, ng, pf, out
#endif

/* the pass for Q query rows of a block: one function per Q, the copy with Q a constant */
static void screen_pass1(SCREEN_PASS_ARGS) { screen_block_n(1, SCREEN_PASS_CALL); }
static void screen_pass2(SCREEN_PASS_ARGS) { screen_block_n(2, SCREEN_PASS_CALL); }
static void screen_pass3(SCREEN_PASS_ARGS) { screen_block_n(3, SCREEN_PASS_CALL); }
static void screen_pass4(SCREEN_PASS_ARGS) { screen_block_n(4, SCREEN_PASS_CALL); }
static void screen_pass5(SCREEN_PASS_ARGS) { screen_block_n(5, SCREEN_PASS_CALL); }
static void screen_pass6(SCREEN_PASS_ARGS) { screen_block_n(6, SCREEN_PASS_CALL); }
static void screen_pass7(SCREEN_PASS_ARGS) { screen_block_n(7, SCREEN_PASS_CALL); }
static void screen_pass8(SCREEN_PASS_ARGS) { screen_block_n(8, SCREEN_PASS_CALL); }
typedef void (*screen_pass)(SCREEN_PASS_ARGS);

/* the fewest query rows from which the screen pays (decode/logits.py): its int8 grids' products cost about half
 * the exact ones' from two rows on; the int16 grids' only from about four (bench_kernels.py's screen table) */
#ifdef SCREEN_INT8
int lmhead_screen_min_rows(void) { return 2; }
#else
int lmhead_screen_min_rows(void) { return 4; }
#endif
static const screen_pass SCREEN_PASS[SCREEN_ROWS + 1] = {NULL, screen_pass1, screen_pass2, screen_pass3, screen_pass4,
                                                         screen_pass5, screen_pass6, screen_pass7, screen_pass8};

/* β of a query row from its sums over k of (x − x̂)², x² and x̂² (see above) */
static inline double screen_beta(double dd, double xx, double hh, int64_t K) {
    const double n = (double)(K + K / 32 + 8), u = ldexp(1.0, -24), gamma = n * u / (1.0 - n * u);
    return (sqrt(dd) + gamma * (sqrt(xx) + sqrt(hh))) * (1.0 + 1e-9);
}

/* a grid's step for values up to `top` in magnitude on `levels` levels each side: top / levels, or 1 where that is
 * 0 (all zeros, or a top so small that the step underflows: the values then round to 0 and their whole size is
 * the grid's error, which β counts) */
static inline float grid_step(float top, float levels) {
    const float step = top / levels;
    return step > 0.f ? step : 1.0f;
}

/* whether the bound above holds for query row x [K]: every value finite, and the largest magnitude 0 or at least
 * 2⁻⁶⁰ — below that, products and sums of the exact and the screened values may fall under float32's normal range,
 * whose absolute rounding the relative γ does not count (rows that small are computed exactly) */
static inline int screen_row_ok(const float* x, int64_t K) {
    float top = 0.f;
    for (int64_t k = 0; k < K; k++) {
        if (!isfinite(x[k])) return 0;
        top = fabsf(x[k]) > top ? fabsf(x[k]) : top;
    }
    return top == 0.f || top >= 0x1p-60f;
}

#ifdef SCREEN_INT8
/* x [M, K] on its groups' int8 grids, into pairs [(ng + 1)/2][M] (zeroed: an odd last group's pair stays zero past
 * it), and β [M]; 0, or -1 for a row the bound does not hold for (screen_row_ok) */
static int screen_grids(const float* x, int64_t M, int64_t K, screen_pair* pairs, double* beta) {
    const int64_t ng = K / 32;
    for (int64_t m = 0; m < M; m++) {
        const float* xm = x + m * K;
        if (!screen_row_ok(xm, K)) return -1;
        double dd = 0.0, xx = 0.0, hh = 0.0;
        for (int64_t g = 0; g < ng; g++) {
            screen_pair* pair = pairs + (g / 2) * M + m;
            const int half = (int)(g % 2);
            float top = 0.f;
            for (int i = 0; i < 32; i++) top = fabsf(xm[g * 32 + i]) > top ? fabsf(xm[g * 32 + i]) : top;
            const float step = grid_step(top, 127.0f);
            for (int i = 0; i < 32; i++) {
                const float v = xm[g * 32 + i];
                float t = rintf(v / step);
                t = t > 127.f ? 127.f : (t < -127.f ? -127.f : t);
                pair->q[half * 32 + i] = (int8_t)t;
                const double xh = (double)step * (double)t, e = (double)v - xh;
                dd += e * e;
                xx += (double)v * v;
                hh += xh * xh;
            }
            for (int j = 0; j < 8; j++) {
                const int8_t* q4 = pair->q + half * 32 + 4 * j;
                pair->start[half * 8 + j] = -128 * (q4[0] + q4[1] + q4[2] + q4[3]);
                pair->step[half * 8 + j] = step;
            }
        }
        beta[m] = screen_beta(dd, xx, hh, K);
    }
    return 0;
}
#else
/* x [M, K] on one int16 grid per row: q [M, K], its steps d [M], and β [M]; 0, or -1 for a row the bound does not
 * hold for (screen_row_ok) */
static int screen_grids(const float* x, int64_t M, int64_t K, int16_t* q, float* d, double* beta) {
    for (int64_t m = 0; m < M; m++) {
        const float* xm = x + m * K;
        if (!screen_row_ok(xm, K)) return -1;
        float top = 0.f;
        for (int64_t k = 0; k < K; k++) top = fabsf(xm[k]) > top ? fabsf(xm[k]) : top;
        d[m] = grid_step(top, 32767.0f);
        double dd = 0.0, xx = 0.0, hh = 0.0;
        for (int64_t k = 0; k < K; k++) {
            float t = rintf(xm[k] / d[m]);
            t = t > 32767.f ? 32767.f : (t < -32767.f ? -32767.f : t);
            q[m * K + k] = (int16_t)t;
            const double xh = (double)d[m] * (double)t, e = (double)xm[k] - xh;
            dd += e * e;
            xx += (double)xm[k] * xm[k];
            hh += xh * xh;
        }
        /* the grid's step d multiplies the float32 sum once more: one more rounding, inside γ's 8 spare terms */
        beta[m] = screen_beta(dd, xx, hh, K);
    }
    return 0;
}
#endif

/* ŷ [M, N] and β [M] (see above) for x [M, K]; codes, scale as lmhead_coded_matmul's with flags HALF | ROWS4
 * (int8 codes, no offsets). Returns 0; -1 for shapes it does not take or a row of x the bound does not hold for
 * (not all finite, or all below 2⁻⁶⁰: screen_row_ok; the caller computes exactly); -2 if it could not allocate. */
int lmhead_screen(const float* x, int64_t M, int64_t K, const int8_t* codes, const uint16_t* scale, int64_t N,
                  float* y, double* beta, int threads) {
    if (K % 32 != 0 || N % 4 != 0 || K / 32 > HALF_MAX_GROUPS || M < 1) return -1;
    const int64_t ng = K / 32;
#ifdef SCREEN_INT8
    const size_t pair_bytes = (size_t)M * (size_t)((ng + 1) / 2) * sizeof(screen_pair);
    screen_pair* pairs = (screen_pair*)aligned_alloc(64, pair_bytes);
    if (!pairs) return -2;
    memset(pairs, 0, pair_bytes);
    const int bad = screen_grids(x, M, K, pairs, beta);
#else
    int16_t* q = (int16_t*)aligned_alloc(32, (size_t)(M * K * 2 + 31) / 32 * 32);
    float* d = (float*)malloc((size_t)M * sizeof(float));
    const int bad = q && d ? screen_grids(x, M, K, q, d, beta) : -2;
#endif
    if (!bad) {
        const int64_t blocks = N / 4;
        const int64_t chunk = blocks / (8 * threads) > 1 ? blocks / (8 * threads) : 1;
#pragma omp parallel for num_threads(threads) schedule(dynamic, chunk)
        for (int64_t b = 0; b < blocks; b++) {
            const int8_t* c = codes + b * 4 * K;
            float s32[4 * HALF_MAX_GROUPS];
            halves_to_floats(scale + b * 4 * ng, s32, 4 * ng);
            for (int64_t m0 = 0; m0 < M; m0 += SCREEN_ROWS) {
                const int64_t Q = M - m0 < SCREEN_ROWS ? M - m0 : SCREEN_ROWS;
                float out[4 * SCREEN_ROWS];
                /* the block two ahead, a line at a time through the first pass over this one (all of its lines at
                 * once waited on the line-fill buffers) */
                const char* fetch = m0 == 0 && b + 2 < blocks ? (const char*)c + 8 * K : NULL;
#ifdef SCREEN_INT8
                SCREEN_PASS[Q](pairs + m0, M, c, s32, ng, fetch, out);
                for (int64_t m = 0; m < Q; m++)
                    for (int r = 0; r < 4; r++) y[(m0 + m) * N + b * 4 + r] = out[m * 4 + r];
#else
                SCREEN_PASS[Q](q + m0 * K, K, c, s32, ng, fetch, out);
                for (int64_t m = 0; m < Q; m++)
                    for (int r = 0; r < 4; r++) y[(m0 + m) * N + b * 4 + r] = out[m * 4 + r] * d[m0 + m];
#endif
            }
        }
    }
#ifdef SCREEN_INT8
    free(pairs);
#else
    free(q);
    free(d);
#endif
    return bad;
}

/* the k largest values so far, ascending (low[0] the k-th), with `lo` offered */
static inline void keep_largest(double* low, int64_t* have, int64_t k, double lo) {
    int64_t i;
    if (*have < k) {
        i = (*have)++;
        while (i > 0 && low[i - 1] > lo) {
            low[i] = low[i - 1];
            i--;
        }
    } else {
        if (lo <= low[0]) return;
        i = 0;
        while (i + 1 < k && low[i + 1] < lo) {
            low[i] = low[i + 1];
            i++;
        }
    }
    low[i] = lo;
}

/* the candidates of each row m: ids [M, cap] of every n with ŷ + ‖w_n‖β ≥ L_m, L_m the ks[m]-th largest
 * ŷ − ‖w_n‖β (1 ≤ ks[m] ≤ 256), in id order; counts [M] (-1: more than cap, the caller computes that row
 * exactly). Both bounds in double, four at a time: a group of four is looked at one by one only when one of
 * them passes the test. Returns 0, or -1 for a k out of range. */
int lmhead_screen_select(const float* y, int64_t M, int64_t N, const float* norms, const double* beta,
                         const int64_t* ks, int64_t cap, int64_t* ids, int64_t* counts, int threads) {
    if (N % 4 != 0) return -1;
    for (int64_t m = 0; m < M; m++)
        if (ks[m] < 1 || ks[m] > 256 || ks[m] > N) return -1;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
    for (int64_t m = 0; m < M; m++) {
        const float* ym = y + m * N;
        const __m256d b = _mm256_set1_pd(beta[m]);
        const int64_t k = ks[m];
        double low[256], four[4];
        int64_t have = 0;
        for (int64_t n = 0; n < N; n += 4) {
            const __m256d w = _mm256_mul_pd(_mm256_cvtps_pd(_mm_loadu_ps(norms + n)), b);
            const __m256d lo = _mm256_sub_pd(_mm256_cvtps_pd(_mm_loadu_ps(ym + n)), w);
            if (have == k && !_mm256_movemask_pd(_mm256_cmp_pd(lo, _mm256_set1_pd(low[0]), _CMP_GT_OQ))) continue;
            _mm256_storeu_pd(four, lo);
            for (int i = 0; i < 4; i++) keep_largest(low, &have, k, four[i]);
        }
        const __m256d L = _mm256_set1_pd(low[0]);
        int64_t count = 0;
        for (int64_t n = 0; n < N; n += 4) {
            const __m256d w = _mm256_mul_pd(_mm256_cvtps_pd(_mm_loadu_ps(norms + n)), b);
            const __m256d up = _mm256_add_pd(_mm256_cvtps_pd(_mm_loadu_ps(ym + n)), w);
            int mask = _mm256_movemask_pd(_mm256_cmp_pd(up, L, _CMP_GE_OQ));
            while (mask) {
                const int i = __builtin_ctz(mask);
                mask &= mask - 1;
                if (count < cap) ids[m * cap + count] = n + i;
                count++;
            }
        }
        counts[m] = count > cap ? -1 : count;
    }
    return 0;
}

/* y[m, ids[m, j]] = the exact value of each candidate (rows4_dot1 of its block: the one-row product's numbers),
 * for rows with counts[m] ≥ 0 */
int lmhead_screen_rescore(const float* x, int64_t M, int64_t K, const int8_t* codes, const uint16_t* scale,
                          int64_t N, const int64_t* ids, const int64_t* counts, int64_t cap, float* y, int threads) {
    if (K % 32 != 0 || N % 4 != 0 || K / 32 > HALF_MAX_GROUPS) return -1;
    const int64_t ng = K / 32;
    /* the path the whole product takes for these rows (the integer one where it is on), so that a candidate's value
     * is the product's */
    sliced_row* srows = sliced_make(x, M, K, 0, 32, 0);
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
    for (int64_t m = 0; m < M; m++) {
        for (int64_t j = 0; j < counts[m]; j++) {
            const int64_t n = ids[m * cap + j], b = n / 4;
            float s32[4 * HALF_MAX_GROUPS], out[4];
            halves_to_floats(scale + b * 4 * ng, s32, 4 * ng);
            rows4_dot1_call(x + m * K, NULL, codes + b * 4 * K, s32, NULL, NULL, ng, 0, 0, NULL,
                            srows ? srows + m : NULL, out);
            y[m * N + n] = out[n % 4];
        }
    }
    sliced_free(srows);
    return 0;
}
#else
int lmhead_screen_min_rows(void) { return 0; } /* no screen */
int lmhead_screen(const float* x, int64_t M, int64_t K, const int8_t* codes, const uint16_t* scale, int64_t N,
                  float* y, double* beta, int threads) {
    (void)x, (void)M, (void)K, (void)codes, (void)scale, (void)N, (void)y, (void)beta, (void)threads;
    return -1; /* without AVX2 the exact product serves (the caller's fallback) */
}
int lmhead_screen_select(const float* y, int64_t M, int64_t N, const float* norms, const double* beta,
                         const int64_t* ks, int64_t cap, int64_t* ids, int64_t* counts, int threads) {
    (void)y, (void)M, (void)N, (void)norms, (void)beta, (void)ks, (void)cap, (void)ids, (void)counts, (void)threads;
    return -1;
}
int lmhead_screen_rescore(const float* x, int64_t M, int64_t K, const int8_t* codes, const uint16_t* scale,
                          int64_t N, const int64_t* ids, const int64_t* counts, int64_t cap, float* y, int threads) {
    (void)x, (void)M, (void)K, (void)codes, (void)scale, (void)N, (void)ids, (void)counts, (void)cap, (void)y,
        (void)threads;
    return -1;
}
#endif

#if defined(SCREEN_INT8) && defined(LMHEAD_SLICED_BUILT)
#include "groups_screen.h"
#else
/* no layout by groups here (it is made only where the path is built): nothing for these to read */
int lmhead_screen_norms16(const uint8_t* codes, const uint16_t* scale, int64_t N, int64_t K, float* out,
                          int threads) {
    (void)codes, (void)scale, (void)N, (void)K, (void)out, (void)threads;
    return -1;
}
int lmhead_screen16(const float* x, int64_t M, int64_t K, const uint8_t* codes, const uint16_t* scale, int64_t N,
                    float* y, double* beta, int threads) {
    (void)x, (void)M, (void)K, (void)codes, (void)scale, (void)N, (void)y, (void)beta, (void)threads;
    return -1;
}
int lmhead_screen_rescore16(const float* x, int64_t M, int64_t K, const uint8_t* codes, const uint16_t* scale,
                            int64_t N, const int64_t* ids, const int64_t* counts, int64_t cap, float* y, int threads) {
    (void)x, (void)M, (void)K, (void)codes, (void)scale, (void)N, (void)ids, (void)counts, (void)cap, (void)y,
        (void)threads;
    return -1;
}
#endif
