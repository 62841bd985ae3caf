/* The whole decode step's descriptions of the model (decode_kernels.c; kernels/native.py mirrors them as
 * ctypes structures) and coded_kernel.c's entry points that it calls. */
#ifndef LMHEAD_DECODE_KERNELS_H
#define LMHEAD_DECODE_KERNELS_H

#include <stdint.h>

int lmhead_coded_matmul(const float* x, int64_t M, int64_t K, const int8_t* codes, const void* scale,
                        const void* offset, int64_t N, int64_t G, int flags, float* y, int threads);
float lmhead_half(uint16_t h);

typedef struct {
    const int8_t* codes;
    const void* scale;  /* float32, or float16 (flags) */
    const void* offset; /* NULL when the format has none */
    int64_t group, n, k, flags; /* flags: coded_kernel.c's LMHEAD_* (PACKED, HALF, ROWS4, F16, BF16) */
} lmhead_mat;

typedef struct {
    lmhead_mat qkv, o, gate_up, down;
    const float* qkv_bias;                                  /* NULL: none */
    const float *input_norm, *post_attn_norm, *pre_mlp_norm, *post_mlp_norm; /* post norms NULL: Llama */
    const float* qk_norm;                                   /* [H + H_kv, hd] or NULL */
    int64_t rope, sliding;                                  /* which cos/sin and which mask */
} lmhead_layer;

#endif
