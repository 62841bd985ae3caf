/* The whole decode step's descriptions of the model (decode_kernels.c; kernels/native.py mirrors them as
 * ctypes structures) and coded_kernel.c's entry points that it calls. */
#ifndef LMHEAD_DECODE_KERNELS_H
#define LMHEAD_DECODE_KERNELS_H

#include <stddef.h>
#include <stdint.h>

#include "body_kernels.h"
#include "experts_kernel.h"

int lmhead_coded_matmul(const float* x, int64_t M, int64_t K, const int8_t* codes, const void* scale,
                        const void* offset, int64_t N, int64_t G, int flags, float* y, int threads);
float lmhead_half(uint16_t h);
float lmhead_nibble_code(int nib, int packed);
int lmhead_groups_row(const void* codes, const void* scale, const void* offset, int64_t N, int64_t K, int64_t G,
                      int flags, int64_t n, float* out);
int lmhead_groups16(void);

typedef struct lmhead_mat {
    const int8_t* codes;
    const void* scale;  /* float32, or float16 (flags) */
    const void* offset; /* NULL when the format has none */
    int64_t group, n, k, flags; /* flags: coded_kernel.c's LMHEAD_* (PACKED, HALF, ROWS4, F16, BF16, SIGNED4, IQ4, SUB, F32) */
    /* the matrix's next row block, of its own layout (same k; its rows after these), or NULL: a fused product
     * whose parts a file gives in different types (models/row_blocks.py) */
    const struct lmhead_mat* more;
} lmhead_mat;

typedef struct {
    lmhead_mat qkv, o, gate_up, down;
    const float* qkv_bias;                                  /* NULL: none */
    const float *input_norm, *post_attn_norm, *pre_mlp_norm, *post_mlp_norm; /* post norms NULL: Llama */
    const float* qk_norm;                                   /* [H + H_kv, hd] or NULL */
    int64_t rope, sliding;                                  /* which cos/sin and which mask */
    const float* o_bias;                                    /* NULL: none */
    const float* sinks;                                     /* [H]: gpt-oss's sink logits, or NULL */
    /* a mixture of experts in place of gate_up and down (NULL: the dense MLP): its experts' products, their
     * biases [E, 2F] and [E, D] (or NULL), top_k experts a row — chosen by the step's `route` —, their
     * activation (lmhead_gated's code or LMHEAD_ACT_SWIGLU_OAI, with alpha and limit) */
    const lmhead_experts_mat* experts_gate_up;
    const lmhead_experts_mat* experts_down;
    const float* experts_gate_up_bias;
    const float* experts_down_bias;
    int64_t top_k, experts_act;
    float alpha, limit;
    /* the mixture's shared expert (Qwen2-MoE; codes NULL: none): its dense gate_up and down, its output scaled
     * by the gate the router call gives */
    lmhead_mat shared_gate_up, shared_down;
} lmhead_layer;

/* a mixture's router, called back by lmhead_step for layer `layer`'s rows h [rows, D] (after the norm before the
 * MLP): fills chosen [rows, top_k] int64 expert ids and their weights [rows, top_k], and — where `shared` is not
 * NULL — the shared expert's gate per row, σ(h·g) [rows]; 0, or nonzero to stop the step (the router is the
 * model's own operation, the same bits as the step-by-step path's) */
typedef int (*lmhead_route_fn)(int64_t layer, const float* h, int64_t rows, int64_t* chosen, float* weights,
                               float* shared);

/* lmhead_step's arguments: the model, the step's buffers and its shape (kernels/native.py's StepArgs mirrors
 * them, field for field) */
typedef struct {
    const lmhead_layer* layers;  /* [n_layers] */
    const float* final_norm;     /* [D] */
    float* x;                    /* [B·T, D]: the new tokens' embeddings, overwritten by the residual stream */
    float* h;                    /* [B·T, D]: the hidden states after the final norm */
    float* keys;                 /* layer i's cache [B,H_kv,cap,hd] at i·layer_stride floats */
    float* values;
    const float* const* cos;     /* per rope kind (lmhead_layer.rope): [B,T,hd] */
    const float* const* sin;     /* likewise, signed (lmhead_attend) */
    const float* const* masks;   /* [2]: full attention's, sliding layers' ([B,T,start+T] additive, or NULL) */
    float* scratch;              /* lmhead_step's comment: how many floats */
    int64_t n_layers, layer_stride, B, T, D, H, Hkv, hd, F, cap, start;
    float eps, scaling, softcap; /* softcap 0: none */
    int plus_one, act, threads;  /* plus_one: norms scale by (1 + w); act: lmhead_gated's */
    const lmhead_shared* shared; /* rows' shared columns (body_kernels.h), or NULL */
    lmhead_route_fn route;       /* the routers of the layers with experts (NULL where there are none) */
} lmhead_step_args;

/* lmhead_decode's arguments: a step's (its cos, sin and masks unused: made here from the tables) and what the
 * step's bookkeeping reads and writes (kernels/native.py's DecodeArgs mirrors them) */
typedef struct {
    lmhead_step_args step;
    const float* embed;              /* [vocab, D], or NULL with embed_codes */
    const lmhead_mat* embed_codes;   /* the embedding's codes, or NULL */
    const int64_t* ids;              /* [B,T] */
    const int64_t* positions;        /* [B,T] rope positions */
    const uint8_t* new_valid;        /* [B,T] 0/1, or NULL: all valid */
    uint8_t* cache_valid;            /* [B,cap] */
    int64_t* cache_pos;              /* [B,cap] */
    int64_t* cache_tokens;           /* [B,cap] */
    const float* const* cos_tables;  /* per rope kind: [table_rows, hd], row = position */
    const float* const* sin_tables;
    float* work;                     /* lmhead_decode's comment: how many floats */
    int64_t vocab, n_kinds, table_rows, window;
    float embed_scale;
    int has_scale, sliding_kinds;
} lmhead_decode_args;

int lmhead_step(const lmhead_step_args* args);
int lmhead_decode(const lmhead_decode_args* args);
size_t lmhead_step_args_size(void);
size_t lmhead_decode_args_size(void);

#endif
