/* The coded kernel's layout flags and the level tables a packed nibble indexes, declared once for every source
 * that reads a coded matrix (coded_kernel.c, decode_kernels.c). Mirrored in kernels/native.py (flags, LEVELS) and
 * checked against this library when it loads (lmhead_flag_values, lmhead_level_table); which GGUF type takes
 * which layout is models/quant_types.py's. A new level table is one LMHEAD_LEVEL_TABLES entry here. */
#ifndef LMHEAD_QUANT_TYPES_H
#define LMHEAD_QUANT_TYPES_H

#include <stdint.h>

#define LMHEAD_PACKED 1   /* 4-bit codes two per byte (see coded_kernel.c for the nibbles' order) */
#define LMHEAD_HALF 2     /* float16 scales and offsets */
#define LMHEAD_ROWS4 4    /* rows stored in blocks of four, 32-byte unit by unit */
#define LMHEAD_F16 8      /* codes: the file's float16 weights [N, K] (no scales): see dense_matmul */
#define LMHEAD_BF16 16    /* codes: bfloat16 weights [N, K] */
#define LMHEAD_SIGNED4 32 /* with PACKED: the nibbles are signed 4-bit codes themselves (Q4_0, Q3_K, Q2_K) */
#define LMHEAD_IQ4 64     /* with PACKED: the nibbles index IQ4_NL's sixteen levels (IQ4_NL, IQ4_XS), no offsets */
#define LMHEAD_SUB 128    /* scales (and offsets) as a K-quant file holds them: see coded_kernel.c's sub_floats */
#define LMHEAD_F32 256    /* codes: the file's float32 weights [N, K] (no scales): see dense32_matmul */
#define LMHEAD_MXFP4 512  /* with PACKED: the nibbles index MXFP4's sixteen levels (e2m1 doubled), no offsets */
#define LMHEAD_E8M0 1024  /* scales: one byte e a group, the number 2^(e − 128) (MXFP4's exponents; lmhead_e8m0) */
#define LMHEAD_GROUPS16 2048 /* codes sixteen rows a vector, float16 scales (HALF) or a K-quant's (SUB): the
                              * integer path by groups (groups_kernel.h; int8 codes, or PACKED unsigned with
                              * offsets or SIGNED4) */
#define LMHEAD_HIGH1 4096 /* with GROUPS16: 5-bit codes, their low four bits as PACKED's nibbles and the top bit in a
                           * plane after them (Q5_1, Q5_K; SIGNED4: codes −16 … 15) */
#define LMHEAD_HIGH2 8192 /* with GROUPS16: 6-bit codes so, the top two bits in the plane (Q6_K: SIGNED4, −32 … 31) */

/* every flag, in native.py's order */
#define LMHEAD_FLAG_VALUES                                                                                    \
    LMHEAD_PACKED, LMHEAD_HALF, LMHEAD_ROWS4, LMHEAD_F16, LMHEAD_BF16, LMHEAD_SIGNED4, LMHEAD_IQ4, LMHEAD_SUB, \
        LMHEAD_F32, LMHEAD_MXFP4, LMHEAD_E8M0, LMHEAD_GROUPS16, LMHEAD_HIGH1, LMHEAD_HIGH2
#define LMHEAD_N_FLAGS 14

/* the level tables (X(flag, sixteen integer levels in index order)): the code of a weight whose nibble holds
 * index i is the table's i-th integer, its number code·scale. Table t of the kernels is the t-th entry; packed
 * nibbles hold index ^ 8, so the kernels' tables are stored in nibble order (NIBBLE_ORDER) */
#define LMHEAD_LEVEL_TABLES(X)                                                                          \
    X(LMHEAD_IQ4, -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)              \
    X(LMHEAD_MXFP4, 0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)
#define LMHEAD_N_TABLES 2
#define LMHEAD_TABLE_FLAG_(flag, ...) | (flag)
#define LMHEAD_TABLE_FLAGS (0 LMHEAD_LEVEL_TABLES(LMHEAD_TABLE_FLAG_)) /* every table's flag */

#define LMHEAD_NIBBLE_ORDER(a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15) \
    a8, a9, a10, a11, a12, a13, a14, a15, a0, a1, a2, a3, a4, a5, a6, a7

/* an E8M0 scale byte as the float32 2^(e − 128) the doubled e2m1 levels are multiplied by (ggml's
 * ggml_e8m0_to_fp32_half): e ≥ 2 a normal number, e < 2 the subnormals 2^−128 and 2^−127 — every one exact */
static inline float lmhead_e8m0(uint8_t e) {
    union { uint32_t u; float f; } v;
    v.u = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
    return v.f;
}

/* the table index of a layout's flags (−1: none) */
static inline int lmhead_table_of(int flags) {
    int t = 0;
#define LMHEAD_TABLE_INDEX_(flag, ...) \
    if (flags & (flag)) return t;      \
    t++;
    LMHEAD_LEVEL_TABLES(LMHEAD_TABLE_INDEX_)
#undef LMHEAD_TABLE_INDEX_
    return -1;
}

#endif
