/* The body's element-wise work and attention (body_kernels.c), declared for the whole step (decode_kernels.c). */
#ifndef LMHEAD_BODY_KERNELS_H
#define LMHEAD_BODY_KERNELS_H

#include <stddef.h>
#include <stdint.h>

#include "kernel_results.h"

void lmhead_rms_norm(const float* x, const float* w, float* y, int64_t rows, int64_t dim, int64_t wrows,
                     float eps, int plus_one);
void lmhead_add_norm(const float* x, const float* a, const float* w_post, const float* w_pre, float* x_out,
                     float* h, int64_t rows, int64_t dim, float eps, int plus_one);
/* the gated activations' codes (lmhead_gated's `act`; the experts' and the decode step's), mirrored by
 * kernels/abi.py's ACTIVATIONS and checked against this library when it loads (lmhead_act_values) */
#define LMHEAD_ACT_GELU_TANH 0  /* Gemma's gelu_pytorch_tanh */
#define LMHEAD_ACT_SILU 1       /* Llama's silu */
#define LMHEAD_ACT_SWIGLU_OAI 2 /* gpt-oss's clamped SwiGLU (lmhead_swiglu_oai, with its α and limit) */
int lmhead_act_values(int* out, int cap);

void lmhead_gated(const float* gate_up, float* out, int64_t rows, int64_t f, int act);
void lmhead_swiglu_oai(const float* gate_up, float* out, int64_t rows, int64_t f, float alpha, float limit);

/* Columns that rows read from memory they share instead of their own (a prefix-cache hit's stored blocks:
 * models/kv_cache.py's SharedColumns; kernels/abi.py's SharedArgs mirrors it): row b's columns start[b] ..
 * start[b] + len[b] − 1 are, in order, those of its blocks keys[b·n + k] (values likewise), each [layers, H_kv,
 * block, hd], the layer's part `layer` · H_kv·block·hd numbers in. What the row's own cache holds at those
 * columns is never read. */
typedef struct {
    const float* const* keys;    /* [B·n] block addresses (NULL past a row's own) */
    const float* const* values;
    const int64_t* start;        /* [B] */
    const int64_t* len;          /* [B] shared columns (0: none), at most n·block */
    int64_t n, block;
} lmhead_shared;

/* lmhead_attend's arguments (kernels/native.py's AttendArgs mirrors them, field for field) */
typedef struct {
    const float* qk;     /* [B,T] tokens of (H + H_kv)·hd numbers at qk_stride apart: q and k, before rope */
    const float* v;      /* [B,T] tokens of H_kv·hd numbers at v_stride apart */
    const float* cos;    /* [B,T,hd] */
    const float* sin;    /* [B,T,hd], signed: (−sin₁, sin₂) */
    float* keys;         /* the layer's cache [B,H_kv,cap,hd] */
    float* values;
    const float* mask;   /* [B,T,start+T] additive, or NULL */
    float* out;          /* [B,T,H·hd] */
    int64_t qk_stride, v_stride, B, T, H, Hkv, hd, cap, start;
    float scaling, softcap; /* softcap 0: none */
    int threads;
    const lmhead_shared* shared; /* NULL: every column is the row's own */
    int64_t layer;               /* which layer's part of the shared blocks */
    const float* sinks;          /* [H]: a logit per query head in the softmax's denominator (gpt-oss), or NULL */
} lmhead_attend_args;

int lmhead_attend(const lmhead_attend_args* args);
size_t lmhead_attend_args_size(void);

#endif
