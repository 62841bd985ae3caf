/* A mixture of experts' products as experts_kernel.c reads them, declared for the whole step (decode_kernels.c;
 * kernels/experts.py mirrors lmhead_experts_mat as ExpertsMat). */
#ifndef LMHEAD_EXPERTS_KERNEL_H
#define LMHEAD_EXPERTS_KERNEL_H

#include <stdint.h>

/* one product of a layer's experts: expert e's codes at codes + e·codes_stride bytes (scale, offset alike; NULL
 * where the layout has none); each expert [n, k], groups of `group`, the coded kernel's `flags` */
typedef struct lmhead_experts_mat {
    const int8_t* codes;
    const void* scale;
    const void* offset;
    int64_t codes_stride, scale_stride, offset_stride;
    int64_t experts, n, k, group, flags;
} lmhead_experts_mat;

/* out [rows, d] += w[r] · y [rows, d] row by row: the product rounded, then the sum (torch's `out + w * y`: a
 * shared expert's output scaled by its gate) */
void lmhead_add_scaled_rows(float* out, const float* y, const float* w, int64_t rows, int64_t d);

int lmhead_experts_mlp(const float* x, int64_t N, int64_t k, const int64_t* chosen, const float* weights,
                       const lmhead_experts_mat* gu, const lmhead_experts_mat* dn, int act, float alpha, float limit,
                       const float* gate_up_bias, const float* down_bias, float* out, int threads);

#endif
