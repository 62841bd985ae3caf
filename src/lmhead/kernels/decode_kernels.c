/* The whole decode step in one call: every block of models/lean.py's forward over the coded matrices
 * (`lmhead_step`), and from token ids with the step's bookkeeping around it (`lmhead_decode`: the cache's
 * columns, the embedding rows, the rope rows and the masks); a coded matrix's rows as float32
 * (`lmhead_coded_rows`). Composed from coded_kernel.c's product and body_kernels.c's norms, activation and
 * attention. Built with the other sources into one library by kernels/native.py.
 */
#include <float.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "body_kernels.h"
#include "decode_kernels.h"
#include "quant_types.h"

/* Row `n` of a coded matrix as float32: w[k] = code·scale + offset of its group, the same two float32 operations
 * (never fused into one: the function is built without contraction) as CodedLinear.dequantize, so the row is the
 * model's weight bit for bit. Reads every layout of coded_kernel.c: int8 or packed 4-bit codes (PACKED: each 64
 * codes 32 bytes, byte 4·l + b holding codes 16·b + l (low nibble) and 16·b + 8 + l (high), XOR 8, or as signed
 * nibbles: SIGNED4, or a level table's indices: quant_types.h), rows stored
 * in blocks of four (ROWS4: the block's rows 32 bytes each, unit by unit), float32, float16 (HALF) or K-quant
 * (SUB: d·sub) scales; the integer path by groups' layout (GROUPS16: coded_kernel.c's lmhead_groups_row); or
 * a row of the file's own float16, bfloat16 or float32 weights (F16, BF16, F32). */
/* group g of row n's scale (or offset) held as a K-quant's d [N, K/256] and int8 sub [N, ng] (SUB,
 * coded_kernel.c's sub_floats): d·sub, the same float32 product */
static float sub_value(const void* buf, int64_t N, int64_t K, int64_t ng, int64_t n, int64_t g) {
    const int64_t nsup = K / 256;
    const float d = ((const float*)buf)[n * nsup + g / (ng / nsup)];
    return d * (float)((const int8_t*)((const float*)buf + N * nsup))[n * ng + g];
}

__attribute__((optimize("fp-contract=off")))
static void coded_row(const lmhead_mat* m, int64_t n, float* out) {
    if (m->flags & LMHEAD_GROUPS16) { /* made only where the path is built: lmhead_coded_rows checks */
        lmhead_groups_row(m->codes, m->scale, m->offset, m->n, m->k, m->group, (int)m->flags, n, out);
        return;
    }
    if (m->flags & LMHEAD_F32) { /* the row's float32 weights as they are */
        const float* w = (const float*)m->codes + n * m->k;
        for (int64_t k = 0; k < m->k; k++) out[k] = w[k];
        return;
    }
    if (m->flags & (LMHEAD_F16 | LMHEAD_BF16)) { /* the row's 16-bit weights, converted exactly */
        const uint16_t* w = (const uint16_t*)m->codes + n * m->k;
        for (int64_t k = 0; k < m->k; k++) {
            union { uint32_t u; float f; } v;
            v.u = (uint32_t)w[k] << 16;
            out[k] = (m->flags & LMHEAD_BF16) ? v.f : lmhead_half(w[k]);
        }
        return;
    }
    const int packed = (m->flags & LMHEAD_PACKED) != 0, half = (m->flags & LMHEAD_HALF) != 0;
    const int rows4 = (m->flags & LMHEAD_ROWS4) != 0, sub = (m->flags & LMHEAD_SUB) != 0;
    /* unsigned codes, signed ones (SIGNED4) or a table's levels, read as coded_kernel.c reads them */
    const int table = lmhead_table_of((int)m->flags);
    const int kind = table >= 0 ? 3 + table : (m->flags & LMHEAD_SIGNED4) ? 2 : 1;
    const int64_t K = m->k, R = packed ? K / 2 : K, ng = K / m->group;
    const uint8_t* base = (const uint8_t*)m->codes;
    for (int64_t k = 0; k < K; k++) {
        int64_t p = packed ? (k / 64) * 32 + ((k % 16) % 8) * 4 + (k % 64) / 16 : k;
        const uint8_t* byte = rows4 ? base + (n / 4) * 4 * R + (p / 32) * 128 + (n % 4) * 32 + p % 32
                                    : base + n * R + p;
        const float code = packed ? lmhead_nibble_code(((*byte) >> (4 * ((k % 16) / 8))) & 15, kind)
                                  : (float)(int8_t)(*byte);
        const int64_t g = n * ng + k / m->group;
        float s = sub ? sub_value(m->scale, m->n, K, ng, n, k / m->group)
                      : half ? lmhead_half(((const uint16_t*)m->scale)[g])
                      : (m->flags & LMHEAD_E8M0) ? lmhead_e8m0(((const uint8_t*)m->scale)[g])
                                                 : ((const float*)m->scale)[g];
        float w = code * s;
        if (m->offset)
            w = w + (sub ? sub_value(m->offset, m->n, K, ng, n, k / m->group)
                         : half ? lmhead_half(((const uint16_t*)m->offset)[g]) : ((const float*)m->offset)[g]);
        out[k] = w;
    }
}

/* out [rows, k] = rows ids[0..rows−1] of the coded matrix `m` (coded_row); −2 for an id outside [0, n), −1 for the
 * layout by groups where its path is not built. */
int lmhead_coded_rows(const lmhead_mat* m, const int64_t* ids, int64_t rows, float* out) {
    if ((m->flags & LMHEAD_GROUPS16) && lmhead_groups16() == 0) return -1;
    for (int64_t r = 0; r < rows; r++)
        if (ids[r] < 0 || ids[r] >= m->n) return -2;
    for (int64_t r = 0; r < rows; r++) coded_row(m, ids[r], out + r * m->k);
    return 0;
}

static int block_matmul(const float* x, int64_t rows, const lmhead_mat* m, float* y, int threads) {
    return lmhead_coded_matmul(x, rows, m->k, m->codes, m->scale, m->offset, m->n, m->group, (int)m->flags, y,
                               threads);
}

/* y [rows, n] = x [rows, k] · mᵀ over all of m's row blocks: each block's product (the numbers it gives alone),
 * its columns placed after the blocks before it (one row: written in place; several: gathered row by row) */
static int matmul(const float* x, int64_t rows, const lmhead_mat* m, float* y, int threads) {
    if (!m->more) return block_matmul(x, rows, m, y, threads);
    int64_t n = 0;
    for (const lmhead_mat* b = m; b; b = b->more) {
        if (b->k != m->k) return -1;
        n += b->n;
    }
    if (rows == 1) {
        for (const lmhead_mat* b = m; b; b = b->more) {
            const int rc = block_matmul(x, 1, b, y, threads);
            if (rc) return rc;
            y += b->n;
        }
        return 0;
    }
    float* part = (float*)malloc((size_t)(rows * n) * sizeof(float));
    if (!part) return LMHEAD_NO_MEMORY;
    int rc = 0;
    int64_t at = 0;
    for (const lmhead_mat* b = m; b && rc == 0; b = b->more) {
        rc = block_matmul(x, rows, b, part, threads);
        for (int64_t r = 0; r < rows && rc == 0; r++)
            memcpy(y + r * n + at, part + r * b->n, (size_t)b->n * sizeof(float));
        at += b->n;
    }
    free(part);
    return rc;
}

/* The blocks of models/lean.py's forward for `rows` = B·T new tokens whose embeddings are in x [rows, D]
 * (overwritten: the residual stream); h [rows, D] receives the hidden states after the final norm. The same
 * functions as the step-by-step path, composed here so that a step is one call. keys, values: layer i's cache
 * [B,H_kv,cap,hd] in one piece at i·layer_stride floats (B·H_kv·cap·hd for a whole cache; more for B rows of a
 * larger one: models/lean.py's StaticCache.view). scratch: at least
 * rows·(2·D + 2·(H + 2·H_kv)·hd + H·hd + 3·F) floats (F the widest MLP's: dense, experts' or shared expert's).
 * The arguments are lmhead_step_args' (decode_kernels.h).
 * Returns 0, -1 (a kernel refused its arguments, or the router failed: the caller holds its error) or
 * LMHEAD_NO_MEMORY. */
int lmhead_step(const lmhead_step_args* args) {
    const lmhead_layer* layers = args->layers;
    const float *final_norm = args->final_norm, *const *cos = args->cos, *const *sin = args->sin;
    const float* const* masks = args->masks;
    float *x = args->x, *h = args->h, *keys = args->keys, *values = args->values, *scratch = args->scratch;
    const int64_t n_layers = args->n_layers, layer_stride = args->layer_stride, B = args->B, T = args->T;
    const int64_t D = args->D, H = args->H, Hkv = args->Hkv, hd = args->hd, F = args->F, cap = args->cap;
    const int64_t start = args->start;
    const float eps = args->eps, scaling = args->scaling, softcap = args->softcap;
    const int plus_one = args->plus_one, act = args->act, threads = args->threads;
    const int64_t rows = B * T, width = (H + 2 * Hkv) * hd, qk_width = (H + Hkv) * hd;
    float* qkv = scratch;
    float* qk = qkv + rows * width;
    float* att = qk + rows * qk_width;
    float* x2 = att + rows * H * hd;
    float* gu = x2 + rows * D;
    float* g = gu + rows * 2 * F;
    float* branch = qk; /* o and down outputs: qk is free by then and at least rows·D */
    if (qk_width < D) branch = g + rows * F;
    lmhead_rms_norm(x, layers[0].input_norm, h, rows, D, 1, eps, plus_one);
    for (int64_t i = 0; i < n_layers; i++) {
        const lmhead_layer* L = layers + i;
        int rc = matmul(h, rows, &L->qkv, qkv, threads);
        if (rc) return rc;
        if (L->qkv_bias)
            for (int64_t r = 0; r < rows; r++)
                for (int64_t j = 0; j < width; j++) qkv[r * width + j] += L->qkv_bias[j];
        const float* qk_in = qkv;
        int64_t qk_stride = width;
        if (L->qk_norm) {
            for (int64_t r = 0; r < rows; r++)
                lmhead_rms_norm(qkv + r * width, L->qk_norm, qk + r * qk_width, H + Hkv, hd, H + Hkv, eps, plus_one);
            qk_in = qk;
            qk_stride = qk_width;
        }
        const lmhead_attend_args attend = {
            .qk = qk_in, .v = qkv + qk_width, .cos = cos[L->rope], .sin = sin[L->rope],
            .keys = keys + i * layer_stride, .values = values + i * layer_stride, .mask = masks[L->sliding],
            .out = att, .qk_stride = qk_stride, .v_stride = width, .B = B, .T = T, .H = H, .Hkv = Hkv, .hd = hd,
            .cap = cap, .start = start, .scaling = scaling, .softcap = softcap, .threads = threads,
            .shared = args->shared, .layer = i, .sinks = L->sinks};
        if ((rc = lmhead_attend(&attend)) || (rc = matmul(att, rows, &L->o, branch, threads))) return rc;
        if (L->o_bias)
            for (int64_t r = 0; r < rows; r++)
                for (int64_t j = 0; j < D; j++) branch[r * D + j] += L->o_bias[j];
        lmhead_add_norm(x, branch, L->post_attn_norm, L->pre_mlp_norm, x2, h, rows, D, eps, plus_one);
        if (L->experts_gate_up) { /* the router (the caller's), then the chosen experts in one call */
            const int64_t k = L->top_k;
            if (!args->route || k < 1) return -1;
            const int shared = L->shared_gate_up.codes != NULL;
            int64_t* chosen = (int64_t*)malloc((size_t)(rows * k) * sizeof(int64_t));
            float* weights = (float*)malloc((size_t)(rows * (k + 1)) * sizeof(float));
            float* gate = weights ? weights + rows * k : NULL; /* the shared expert's, per row */
            if (!chosen || !weights) rc = LMHEAD_NO_MEMORY;
            else if (args->route(i, h, rows, chosen, weights, shared ? gate : NULL) != 0) rc = -1; /* its own error:
                                                                                              * the caller raises it */
            if (!rc)
                rc = lmhead_experts_mlp(h, rows, k, chosen, weights, L->experts_gate_up, L->experts_down,
                                        (int)L->experts_act, L->alpha, L->limit, L->experts_gate_up_bias,
                                        L->experts_down_bias, branch, threads);
            if (!rc && shared) { /* out + σ(h·g)·down(act(gate_up·h)), the layer-by-layer path's ops */
                float* y = g + rows * F + rows * D; /* the scratch's last rows·D */
                const int64_t fs = L->shared_down.k;
                rc = matmul(h, rows, &L->shared_gate_up, gu, threads);
                if (!rc) lmhead_gated(gu, g, rows, fs, act);
                if (!rc) rc = matmul(g, rows, &L->shared_down, y, threads);
                if (!rc) lmhead_add_scaled_rows(branch, y, gate, rows, D);
            }
            free(chosen);
            free(weights);
            if (rc) return rc;
        } else {
            if ((rc = matmul(h, rows, &L->gate_up, gu, threads))) return rc;
            lmhead_gated(gu, g, rows, F, act);
            if ((rc = matmul(g, rows, &L->down, branch, threads))) return rc;
        }
        const float* next = i + 1 < n_layers ? layers[i + 1].input_norm : final_norm;
        lmhead_add_norm(x2, branch, L->post_mlp_norm, next, x, h, rows, D, eps, plus_one);
    }
    return 0;
}

/* --- a decode call from token ids: the step's bookkeeping in C too ----------------------------------------- */

/* lmhead_step for `B`·`T` new tokens given as ids, with what models/lean.py's forward does around it: the cache's
 * columns start..start+T−1 get their validity (new_valid [B,T], or all valid when NULL), rope positions and ids
 * (cache_valid [B,cap] bytes 0/1, cache_pos and cache_tokens [B,cap] int64); x = embed[ids] (times embed_scale
 * when has_scale: Gemma's √D, the same float32 product as the model's; from the rows of `embed_codes` instead
 * where that is not NULL: coded_row); cos/sin rows are taken from the tables
 * ([table_rows, hd] per rope kind, row = position) and the additive masks built per kind — a column is kept when
 * it is valid, at or before the query's column, and (sliding layers) less than `window` positions before the
 * query's position (masks for the layers' kinds in `sliding_kinds`: bit 0 full attention, bit 1 sliding);
 * dropped columns add −FLT_MAX (finite, as transformers' masks: a query with nothing to attend
 * to gives numbers), and a kind whose every column is kept gets no mask. After a step has streamed the weights
 * through the caches, each torch operation of this bookkeeping cost 50–300 µs (its code and data evicted from
 * the shared L3): ~1 ms of a 10 ms step. x, h [B·T, D]; work: at least B·T·(2·n_kinds·hd + 2·(start+T)) floats
 * beside the step's scratch; keys, values and layer_stride as lmhead_step's. Returns 0; −2 for an id outside
 * [0, vocab) or a position outside [0, table_rows)
 * (nothing written: the caller's general path raises or grows its tables); −1 as lmhead_step. The arguments are
 * lmhead_decode_args' (decode_kernels.h); the step's cos, sin and masks are made here. */
int lmhead_decode(const lmhead_decode_args* args) {
    const lmhead_mat* embed_codes = args->embed_codes;
    const float *embed = args->embed, *const *cos_tables = args->cos_tables, *const *sin_tables = args->sin_tables;
    const int64_t *ids = args->ids, *positions = args->positions;
    const uint8_t* new_valid = args->new_valid;
    uint8_t* cache_valid = args->cache_valid;
    int64_t *cache_pos = args->cache_pos, *cache_tokens = args->cache_tokens;
    float *x = args->step.x, *work = args->work;
    const int64_t vocab = args->vocab, n_kinds = args->n_kinds, table_rows = args->table_rows;
    const int64_t window = args->window, B = args->step.B, T = args->step.T, D = args->step.D;
    const int64_t hd = args->step.hd, cap = args->step.cap, start = args->step.start;
    const float embed_scale = args->embed_scale;
    const int has_scale = args->has_scale, sliding_kinds = args->sliding_kinds;
    const int64_t rows = B * T, L = start + T;
    if (n_kinds < 1 || n_kinds > 8 || L > cap) return -2;
    for (int64_t r = 0; r < rows; r++)
        if (ids[r] < 0 || ids[r] >= vocab || positions[r] < 0 || positions[r] >= table_rows) return -2;
    for (int64_t b = 0; b < B; b++)
        for (int64_t t = 0; t < T; t++) {
            const int64_t c = b * cap + start + t, r = b * T + t;
            cache_valid[c] = new_valid ? (new_valid[r] != 0) : 1;
            cache_pos[c] = positions[r];
            cache_tokens[c] = ids[r];
        }
    for (int64_t r = 0; r < rows; r++) {
        float* xr = x + r * D;
        const float* e = embed + ids[r] * D;
        if (embed_codes) { /* the embedding read from its codes (a model loaded straight from its GGUF file) */
            coded_row(embed_codes, ids[r], xr);
            e = xr;
        }
        if (has_scale)
            for (int64_t i = 0; i < D; i++) xr[i] = e[i] * embed_scale;
        else
            for (int64_t i = 0; i < D; i++) xr[i] = e[i];
    }
    const float* cos[8];
    const float* sin[8];
    const float* masks[2] = {NULL, NULL};
    float* w = work;
    for (int64_t k = 0; k < n_kinds; k++) {
        float* c = w;
        float* s = w + rows * hd;
        w += 2 * rows * hd;
        for (int64_t r = 0; r < rows; r++)
            for (int64_t i = 0; i < hd; i++) {
                c[r * hd + i] = cos_tables[k][positions[r] * hd + i];
                s[r * hd + i] = sin_tables[k][positions[r] * hd + i];
            }
        cos[k] = c;
        sin[k] = s;
    }
    for (int sliding = 0; sliding < 2; sliding++) {
        if (!(sliding_kinds >> sliding & 1)) continue;
        float* m = w;
        int dropped = 0;
        for (int64_t b = 0; b < B; b++)
            for (int64_t t = 0; t < T; t++) {
                const int64_t qpos = cache_pos[b * cap + start + t];
                float* mr = m + (b * T + t) * L;
                for (int64_t j = 0; j < L; j++) {
                    int keep = cache_valid[b * cap + j] && j <= start + t;
                    if (keep && sliding) keep = qpos - cache_pos[b * cap + j] < window;
                    mr[j] = keep ? 0.f : -FLT_MAX;
                    dropped |= !keep;
                }
            }
        if (dropped) {
            masks[sliding] = m;
            w += rows * L;
        }
    }
    lmhead_step_args step = args->step;
    step.cos = cos, step.sin = sin, step.masks = masks;
    return lmhead_step(&step);
}

/* sizeof each arguments' struct, which the loader compares with its ctypes mirrors before any call */
size_t lmhead_mat_size(void) { return sizeof(lmhead_mat); }
size_t lmhead_layer_size(void) { return sizeof(lmhead_layer); }
size_t lmhead_step_args_size(void) { return sizeof(lmhead_step_args); }
size_t lmhead_decode_args_size(void) { return sizeof(lmhead_decode_args); }
