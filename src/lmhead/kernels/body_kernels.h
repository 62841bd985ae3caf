/* The body's element-wise work and attention (body_kernels.c), declared for the whole step (decode_kernels.c). */
#ifndef LMHEAD_BODY_KERNELS_H
#define LMHEAD_BODY_KERNELS_H

#include <stdint.h>

void lmhead_rms_norm(const float* x, const float* w, float* y, int64_t rows, int64_t dim, int64_t wrows,
                     float eps, int plus_one);
void lmhead_add_norm(const float* x, const float* a, const float* w_post, const float* w_pre, float* x_out,
                     float* h, int64_t rows, int64_t dim, float eps, int plus_one);
void lmhead_gated(const float* gate_up, float* out, int64_t rows, int64_t f, int act);
int lmhead_attend(const float* qk, int64_t qk_stride, const float* v, int64_t v_stride, const float* cos,
                  const float* sin, float* keys, float* values, const float* mask, float* out, int64_t B,
                  int64_t T, int64_t H, int64_t Hkv, int64_t hd, int64_t cap, int64_t start, float scaling,
                  float softcap, int threads);

#endif
