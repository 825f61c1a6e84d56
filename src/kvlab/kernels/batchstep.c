/* One step of the serving engine in one call: every layer of the model for a stack of N rows of S sequences
 * (kvlab/serve/fused_batch.py), over the engine's dense block pool (kvlab/serve/blocks.py BlockPool), its TurboQuant
 * pool (kvlab/serve/coded.py TurboPool: each layer through kvlab_tq_pool_layer, tqcodes.h) or its integer pool
 * (IntPool: each layer through kvlab_int_pool_layer, paged.h). It is
 * Runner.run's module path (kvlab/serve/runner.py: the Decoder's Blocks over a BatchView) with the per-layer
 * Python and small torch operations taken out, and it is tested against that path.
 *
 * Rows: sequence s owns rows [query_start[s], query_start[s+1]), its newest tokens (one decode token, or a
 * prefill chunk): row j of them sits at position context_len[s] - n_s + j, and its K/V go to the slot its block
 * table gives for that position. For every layer:
 *     h = rms_norm(x) ; q|k|v = h W_qkv^T (+ bias) ; [q/k head norms] ; RoPE(q, k) at each row's position ;
 *     K/V written to each row's slot (rounded to f16 / bf16 as torch's .to() rounds, for such a pool) ;
 *     a = each row's attention over its sequence's blocks (paged.c) ; x += a W_out^T ;
 *     (TurboQuant: K/V coded into their slots or sink rows, and a read from the codes, by kvlab_tq_pool_layer;
 *      integer codes: K/V coded into their slots and stages, and a read from the codes, by kvlab_int_pool_layer)
 *     h = rms_norm(x) ; g|u = h W_gate_up^T ; x += (silu(g) * u) W_down^T
 * x (N, d_model) is updated in place. kvlab_batch_head then takes the rows the step samples: the final norm, the
 * output head (the same product as the layers': the model's choice of kernel) and each row's argmax (the greedy token).
 *
 * Products: GGUF blocks through blockgemm.c, or q8gemm.c for a matrix whose activations are int8 (the choice
 * BlockQuantLinear makes); fp32 rows through one fixed-order dot per (weight row, input row).
 * Every product and the attention split their work between threads in their own parallel region, the row work
 * (norms, RoPE, SwiGLU) is split by rows: no result depends on the thread count. A step of one row over dense
 * blocks (a lone decode token) runs in one parallel region instead (one_row_layers), as decode.c's step does.
 *
 * Before anything is written, every size is checked: the weights' shapes against the model's, the pool's against
 * the model's, and every block id, length and offset of the layout (paged.c's check), so every slot written or
 * read lies inside the pool.
 */
#define _GNU_SOURCE   /* syscall(): the step barrier's futex (decode.h) */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "blockgemv.h"
#include "decode.h"
#include "paged.h"
#include "rowmath.h"   /* kvlab_swiglu */
#include "tqcodes.h"

/* values a loop of the step must touch before its work is shared out between threads: below it, opening the parallel
 * region costs more than the loop (a one-sequence decode step opened ~150 of them per token, and ran slower on two
 * threads than on one) */
#define ROWS_IN_PARALLEL 65536

enum { POOL_TQ = 4, POOL_INT = 5 };   /* Pool.type of coded blocks: each layer read and written through its descriptor */

typedef struct {
    int32_t type;              /* POOL_F32, POOL_F16, POOL_BF16 (k, v), POOL_TQ (tq, tq_step), POOL_INT (ints, stage_rows) */
    int32_t n_layers, n_kv_heads, head_dim;
    int64_t slots;             /* n_blocks * block_size */
    void *k, *v;               /* (n_layers, n_blocks, n_kv_heads, block_size, head_dim) each (cache/blocks.py) */
    const TqPoolLayer *const *tq;  /* POOL_TQ: (n_layers,) each layer's codes, sink rows and codec state */
    const TqStep *tq_step;     /* POOL_TQ: the step's sink entries and RoPE table */
    Quantized *const *ints;    /* POOL_INT: (n_layers,) each layer's codes and key stages */
    const int32_t *stage_rows; /* POOL_INT: (n_seqs,) each sequence's stage row */
    int32_t failed_layer;      /* written by a step that stops at a layer (status 1 or 2): that layer */
} Pool;

enum { QKV = 0, OUT = 1, GATE_UP = 2, DOWN = 3 };   /* a layer's matrices, in the order of the int8 flags */
static const uint8_t fp32_activations[4] = {0, 0, 0, 0};

static int shape_is(const Matrix *W, int64_t rows, int64_t cols) {
    if (W->rows != rows || W->cols != cols || W->data == NULL) return 0;
    return W->type == F32 || (kvlab_block_bytes(W->type) > 0 && cols % QK == 0);
}

static int sizes_ok(const Model *m, const Pool *P, const Ragged *R, int64_t n_rows) {
    const int64_t d = m->d_model, hd = m->head_dim, ff = m->d_ff;
    if (m->n_layers <= 0 || d <= 0 || hd <= 0 || hd % 2 || ff <= 0 || m->n_kv_heads <= 0 || m->n_heads % m->n_kv_heads
        || n_rows < 0 || m->layers == NULL)
        return 0;
    if (P->n_layers != m->n_layers || P->n_kv_heads != m->n_kv_heads || P->head_dim != hd) return 0;
    if (P->type == POOL_TQ ? !P->tq || !P->tq_step : P->type == POOL_INT ? !P->ints || !P->stage_rows : !P->k || !P->v)
        return 0;
    const int64_t q_dim = (int64_t)m->n_heads * hd, kv_dim = (int64_t)m->n_kv_heads * hd;
    for (int l = 0; l < m->n_layers; l++) {
        const Layer *W = &m->layers[l];
        if (!W->attn_norm || !W->ffn_norm || !shape_is(&W->qkv, q_dim + 2 * kv_dim, d) || !shape_is(&W->out, d, q_dim)
            || !shape_is(&W->gate_up, 2 * ff, d) || !shape_is(&W->down, d, ff))
            return 0;
        if (P->type == POOL_TQ && kvlab_tq_pool_layer_ok(P->tq[l], m->n_heads, m->n_kv_heads, (int)hd, R, n_rows, P->tq_step))
            return 0;
        if (P->type == POOL_INT && kvlab_int_pool_layer_ok(P->ints[l], m->n_heads, m->n_kv_heads, (int)hd, R, n_rows,
                                                           P->stage_rows))
            return 0;
    }
    return P->type == POOL_TQ || P->type == POOL_INT
        || kvlab_paged_layout_ok(n_rows, m->n_heads, m->n_kv_heads, (int)hd, (int)hd, P->type, P->slots, R->block_tables,
                                 R->n_seqs, R->max_blocks, R->block_size, R->query_start, R->context_len) == 0;
}

/* y (M, W.rows) = x (M, W.cols) W^T (+ bias): 0, or the product kernel's error */
static int product(const Matrix *W, const float *x, int64_t M, float *y, int int8, int n_threads) {
    int status = 0;
    if (W->type == F32) {
        const float *w = (const float *)W->data;
        #pragma omp parallel for schedule(static) num_threads(n_threads) if(W->rows * W->cols * M >= ROWS_IN_PARALLEL)
        for (int64_t j = 0; j < W->rows; j++)
            for (int64_t i = 0; i < M; i++) y[i * W->rows + j] = kvlab_dot(w + j * W->cols, x + i * W->cols, W->cols);
    } else if (int8) {
        status = kvlab_q8_gemm(W->type, W->data, W->rows, W->cols, x, M, y, n_threads);
    } else {
        status = kvlab_block_gemm(W->type, W->data, W->rows, W->cols, x, M, y, n_threads);
    }
    if (status == 0 && W->bias)
        for (int64_t i = 0; i < M; i++)
            for (int64_t j = 0; j < W->rows; j++) y[i * W->rows + j] += W->bias[j];
    return status;
}

/* K or V of one row (Hkv heads of hd values) into its slot of a layer's blocks (n_blocks, Hkv, block_size, hd) */
static void store_row(int type, const float *src, int Hkv, int hd, void *layer, int64_t slot, int block_size) {
    const int64_t block = slot / block_size, offset = slot % block_size;
    for (int g = 0; g < Hkv; g++) {
        const int64_t at = ((block * Hkv + g) * block_size + offset) * hd;   /* row `offset` of head g of the block */
        if (type == POOL_F32)
            memcpy((float *)layer + at, src + (int64_t)g * hd, sizeof(float) * (size_t)hd);
        else
            kvlab_kv_store(type, src + (int64_t)g * hd, hd, (uint16_t *)layer + at);   /* non-finite: stored as is */
    }
}

/* One row's queries and keys as attention reads them: q (H, hd) = the row's query part of qkv, each head RMS-normed
 * (q_norm) and turned (RoPE at cos_/sin_), the keys in qkv likewise in place */
static void queries_and_keys(const Model *m, const Layer *W, const float *cos_, const float *sin_, float *qkv, float *q) {
    const int H = m->n_heads, Hkv = m->n_kv_heads, hd = m->head_dim;
    float *k = qkv + (int64_t)H * hd;
    memcpy(q, qkv, sizeof(float) * (size_t)H * hd);
    for (int i = 0; i < H; i++) {
        if (W->q_norm) kvlab_rms_norm(q + i * hd, W->q_norm, m->rms_eps, hd, q + i * hd);
        kvlab_rope(q + i * hd, cos_, sin_, hd);
    }
    for (int g = 0; g < Hkv; g++) {
        if (W->k_norm) kvlab_rms_norm(k + g * hd, W->k_norm, m->rms_eps, hd, k + g * hd);
        kvlab_rope(k + g * hd, cos_, sin_, hd);
    }
}

/* kvlab_batch_step for one row over dense blocks in one parallel region, as decode.c's step runs a token: the
 * threads share each matrix's rows and the attention's KV heads, cross decode.h's step barrier between them (not a
 * region's fork and join: on an idle core each of those is a futex wake-up) and each keeps its own copy of the
 * residual, the norms and the blocks' sums. Each product row, attention item and row operation is the one the path
 * for many rows computes (kvlab_matrix_row is few_rows' and the F32 product's dot, kvlab_paged_attend_item the
 * attention's item). */
static int one_row_layers(const Model *m, float *x, const float *cos_, const float *sin_, const Pool *P, const Ragged *R,
                          float scale, int window, int64_t slot, size_t layer_bytes, const uint8_t *int8_matrices,
                          int n_threads) {
    const int H = m->n_heads, Hkv = m->n_kv_heads, hd = m->head_dim;
    const int64_t d = m->d_model, ff = m->d_ff, q_dim = (int64_t)H * hd, kv_dim = (int64_t)Hkv * hd;
    const int64_t qkv_dim = q_dim + 2 * kv_dim, wide = d > ff ? d : ff, own_floats = d + 2 * wide + kvlab_matrix_scratch(wide);
    float *qkv = malloc(sizeof(float) * (size_t)qkv_dim), *q = malloc(sizeof(float) * (size_t)q_dim);
    float *att = malloc(sizeof(float) * (size_t)q_dim), *y = malloc(sizeof(float) * (size_t)d);
    float *gu = malloc(sizeof(float) * 2 * (size_t)ff), *own = malloc(sizeof(float) * (size_t)(n_threads * own_floats));
    if (!qkv || !q || !att || !y || !gu || !own) {
        free(qkv); free(q); free(att); free(y); free(gu); free(own);
        return -2;
    }
    StepBarrier barrier = {.n_threads = 1};
    #pragma omp parallel num_threads(n_threads)
    {
        const int me = step_thread(&barrier);
        int sense = 0;
        float *my_x = own + (int64_t)me * own_floats, *my_h = my_x + d, *my_ff = my_h + wide, *my_sums = my_ff + wide;
        memcpy(my_x, x, sizeof(float) * (size_t)d);
        for (int l = 0; l < m->n_layers; l++) {
            const Layer *W = &m->layers[l];
            const uint8_t *int8 = int8_matrices ? int8_matrices + 4 * (size_t)l : fp32_activations;
            void *k_layer = (uint8_t *)P->k + (size_t)l * layer_bytes, *v_layer = (uint8_t *)P->v + (size_t)l * layer_bytes;
            kvlab_rms_norm(my_x, W->attn_norm, m->rms_eps, (int)d, my_h);
            kvlab_matrix_prepare(&W->qkv, int8[QKV], my_h, my_sums);
            kvlab_matrix_rows(&W->qkv, int8[QKV], my_h, my_sums, qkv);
            step_barrier(&barrier, &sense);
            if (me == 0) {   /* q and k normed and turned, K/V into the row's slot */
                queries_and_keys(m, W, cos_, sin_, qkv, q);
                store_row(P->type, qkv + q_dim, Hkv, hd, k_layer, slot, R->block_size);
                store_row(P->type, qkv + q_dim + kv_dim, Hkv, hd, v_layer, slot, R->block_size);
            }
            step_barrier(&barrier, &sense);
            #pragma omp for schedule(static) nowait
            for (int g = 0; g < Hkv; g++)
                kvlab_paged_attend_item(q, H, Hkv, hd, hd, k_layer, v_layer, P->type, R->block_tables, R->n_seqs,
                                        R->max_blocks, R->block_size, R->query_start, R->context_len, scale, window, att, g);
            step_barrier(&barrier, &sense);
            kvlab_matrix_prepare(&W->out, int8[OUT], att, my_sums);
            kvlab_matrix_rows(&W->out, int8[OUT], att, my_sums, y);
            step_barrier(&barrier, &sense);
            for (int64_t i = 0; i < d; i++) my_x[i] += y[i];
            kvlab_rms_norm(my_x, W->ffn_norm, m->rms_eps, (int)d, my_h);
            kvlab_matrix_prepare(&W->gate_up, int8[GATE_UP], my_h, my_sums);
            kvlab_matrix_rows(&W->gate_up, int8[GATE_UP], my_h, my_sums, gu);
            step_barrier(&barrier, &sense);
            kvlab_swiglu(gu, gu + ff, ff, my_ff);
            kvlab_matrix_prepare(&W->down, int8[DOWN], my_ff, my_sums);
            kvlab_matrix_rows(&W->down, int8[DOWN], my_ff, my_sums, y);
            step_barrier(&barrier, &sense);
            for (int64_t i = 0; i < d; i++) my_x[i] += y[i];
        }
        #pragma omp master
        memcpy(x, my_x, sizeof(float) * (size_t)d);
    }
    free(qkv); free(q); free(att); free(y); free(gu); free(own);
    return 0;
}

/* Every layer for the N rows of x (N, d_model), in place. cos_, sin_ (N, head_dim): each row's RoPE.
 * int8_matrices: a flag per matrix (n_layers x 4, QKV..DOWN) for int8 activations, or NULL for none.
 * Returns 0; -1 (nothing written) when a size or index is refused; -2 without scratch memory; 1 when a TurboQuant
 * scale or an integer layer's K/V are not finite, 2 when an integer layer's K/V exceed float16's range (the step stops
 * at that layer, P->failed_layer). */
int kvlab_batch_step(const Model *m, float *x, int64_t n_rows, const float *cos_, const float *sin_, Pool *P,
                     const Ragged *R, float scale, int window, const uint8_t *int8_matrices, int n_threads) {
    if (!sizes_ok(m, P, R, n_rows) || window < 0) return -1;
    if (n_rows == 0) return 0;
    if (n_threads < 1) n_threads = 1;
    const int H = m->n_heads, Hkv = m->n_kv_heads, hd = m->head_dim;
    const int64_t N = n_rows, d = m->d_model, ff = m->d_ff, q_dim = (int64_t)H * hd, kv_dim = (int64_t)Hkv * hd;
    const int64_t qkv_dim = q_dim + 2 * kv_dim, wide = d > ff ? d : ff;
    const int coded = P->type == POOL_TQ || P->type == POOL_INT;
    const size_t elem = P->type == POOL_F32 ? 4 : 2, layer_bytes = coded ? 0 : (size_t)P->slots * (size_t)kv_dim * elem;
    if (N == 1 && !coded) {   /* one row (a lone decode token) */
        int s = 0;                                       /* its sequence: the one that owns row 0 */
        while (s < R->n_seqs - 1 && R->query_start[s + 1] <= 0) s++;
        return one_row_layers(m, x, cos_, sin_, P, R, scale, window, kvlab_ragged_slot(R, s, R->context_len[s] - 1),
                              layer_bytes, int8_matrices, n_threads);
    }
    int64_t *slot = malloc(sizeof(int64_t) * (size_t)N);
    float *h = malloc(sizeof(float) * (size_t)(N * wide));
    float *qkv = malloc(sizeof(float) * (size_t)(N * qkv_dim));
    float *q = malloc(sizeof(float) * (size_t)(N * q_dim));
    float *att = malloc(sizeof(float) * (size_t)(N * q_dim));
    float *y = malloc(sizeof(float) * (size_t)(N * d));
    float *gu = malloc(sizeof(float) * (size_t)(N * 2 * ff));
    int status = !slot || !h || !qkv || !q || !att || !y || !gu ? -2 : 0;
    /* each row's slot, from its position (inside its table's checked blocks: position < context_len[s]) */
    for (int s = 0; s < R->n_seqs && status == 0; s++) {
        const int64_t r0 = R->query_start[s], r1 = R->query_start[s + 1], first = R->context_len[s] - (r1 - r0);
        for (int64_t r = r0; r < r1; r++) slot[r] = kvlab_ragged_slot(R, s, first + (r - r0));
    }
    for (int l = 0; l < m->n_layers && status == 0; l++) {
        const Layer *W = &m->layers[l];
        const uint8_t *flags = int8_matrices ? int8_matrices + 4 * (size_t)l : fp32_activations;
        void *k_layer = coded ? NULL : (uint8_t *)P->k + (size_t)l * layer_bytes;
        void *v_layer = coded ? NULL : (uint8_t *)P->v + (size_t)l * layer_bytes;
        #pragma omp parallel for schedule(static) num_threads(n_threads) if(N * d >= ROWS_IN_PARALLEL)
        for (int64_t r = 0; r < N; r++) kvlab_rms_norm(x + r * d, W->attn_norm, m->rms_eps, (int)d, h + r * d);
        if ((status = product(&W->qkv, h, N, qkv, flags[QKV], n_threads))) break;
        #pragma omp parallel for schedule(static) num_threads(n_threads) if(N * qkv_dim >= ROWS_IN_PARALLEL)
        for (int64_t r = 0; r < N; r++) {
            float *k = qkv + r * qkv_dim + q_dim, *v = k + kv_dim;
            queries_and_keys(m, W, cos_ + r * hd, sin_ + r * hd, qkv + r * qkv_dim, q + r * q_dim);
            if (!coded) {
                store_row(P->type, k, Hkv, hd, k_layer, slot[r], R->block_size);
                store_row(P->type, v, Hkv, hd, v_layer, slot[r], R->block_size);
            }
        }
        if (P->type == POOL_TQ)   /* K/V coded into slots (sink positions: sink rows), attention in the model's domain */
            status = kvlab_tq_pool_layer(P->tq[l], H, Hkv, hd, R, N, P->tq_step, q, qkv + q_dim, qkv + q_dim + kv_dim,
                                         qkv_dim, scale, window, att, n_threads);
        else if (P->type == POOL_INT)   /* K/V coded into their slots and stages, attention on the codes */
            status = kvlab_int_pool_layer(P->ints[l], H, Hkv, hd, R, N, P->stage_rows, q, qkv + q_dim, qkv + q_dim + kv_dim,
                                          qkv_dim, scale, window, att, n_threads);
        else
            status = kvlab_paged_attention(q, N, H, Hkv, hd, hd, k_layer, v_layer, P->type, P->slots, R->block_tables,
                                           R->n_seqs, R->max_blocks, R->block_size, R->query_start, R->context_len,
                                           scale, window, att, n_threads);
        if (status) {
            P->failed_layer = l;
            break;
        }
        if ((status = product(&W->out, att, N, y, flags[OUT], n_threads))) break;
        #pragma omp parallel for schedule(static) num_threads(n_threads) if(N * d >= ROWS_IN_PARALLEL)
        for (int64_t r = 0; r < N; r++) {
            for (int64_t i = 0; i < d; i++) x[r * d + i] += y[r * d + i];
            kvlab_rms_norm(x + r * d, W->ffn_norm, m->rms_eps, (int)d, h + r * d);
        }
        if ((status = product(&W->gate_up, h, N, gu, flags[GATE_UP], n_threads))) break;
        #pragma omp parallel for schedule(static) num_threads(n_threads) if(N * ff >= ROWS_IN_PARALLEL / 4)
        for (int64_t r = 0; r < N; r++) kvlab_swiglu(gu + r * 2 * ff, gu + r * 2 * ff + ff, ff, h + r * ff);
        if ((status = product(&W->down, h, N, y, flags[DOWN], n_threads))) break;
        #pragma omp parallel for schedule(static) num_threads(n_threads) if(N * d >= ROWS_IN_PARALLEL)
        for (int64_t r = 0; r < N; r++)
            for (int64_t i = 0; i < d; i++) x[r * d + i] += y[r * d + i];
    }
    free(slot); free(h); free(qkv); free(q); free(att); free(y); free(gu);
    return status;
}

/* the first i < n with x[i] == top (ordered: never a nan); -1 when there is none */
static int64_t first_equal(const float *x, int64_t n, float top) {
    int64_t i = 0;
#if defined(__AVX512F__)
    for (; i + 16 <= n; i += 16) {
        const __mmask16 hit = _mm512_cmp_ps_mask(_mm512_loadu_ps(x + i), _mm512_set1_ps(top), _CMP_EQ_OQ);
        if (hit) return i + __builtin_ctz(hit);
    }
#endif
    for (; i < n; i++)
        if (x[i] == top) return i;
    return -1;
}

/* The index of the largest of x[0..n), n > 0, as torch.argmax: the first of equal largest values; the first nan
 * where there is one. One pass for the largest value (and whether a nan is present), one for its first place. */
static int64_t argmax_row(const float *x, int64_t n) {
    float top = -INFINITY;
    int nan = 0;
    int64_t i = 0;
#if defined(__AVX512F__)
    __m512 lanes = _mm512_set1_ps(-INFINITY);
    __mmask16 unordered = 0;
    for (; i + 16 <= n; i += 16) {
        const __m512 v = _mm512_loadu_ps(x + i);
        lanes = _mm512_max_ps(lanes, v);                          /* meaningless where a nan came by: then unused */
        unordered |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    }
    top = _mm512_reduce_max_ps(lanes);
    nan = unordered != 0;
#endif
    for (; i < n; i++) {
        nan |= x[i] != x[i];
        top = x[i] > top ? x[i] : top;
    }
    if (nan)
        for (i = 0; i < n; i++)
            if (x[i] != x[i]) return i;
    i = first_equal(x, n, top);
    return i < 0 ? 0 : i;                                         /* every value -inf: top is -inf, found at 0 */
}

/* out (R,) = the argmax of each row of x (R, V), as torch.argmax(x, dim=-1); 0, or -1 for V < 1 or R < 0 */
int kvlab_rows_argmax(const float *x, int64_t R, int64_t V, int64_t *out, int n_threads) {
    if (V < 1 || R < 0) return -1;
    if (n_threads < 1) n_threads = 1;
    #pragma omp parallel for schedule(static) num_threads(n_threads) if(R * V >= ROWS_IN_PARALLEL)
    for (int64_t r = 0; r < R; r++) out[r] = argmax_row(x + r * V, V);
    return 0;
}

/* The sampled rows' logits, as Runner.sample's model.logits computes them: logits (R, vocab) = the output head of
 * rms_norm(x) (final norm) for the R rows of x (R, d_model), through product() (int8: the head takes int8
 * activations, as its BlockQuantLinear does); tokens (R,) = each row's argmax, or NULL.
 * Returns 0; -1 (nothing written) for a head or norm not shaped for the model; -2 without scratch memory. */
int kvlab_batch_head(const Model *m, const float *x, int64_t R, int int8, float *logits, int64_t *tokens,
                     int n_threads) {
    const int64_t d = m->d_model, vocab = m->head.rows;
    if (d <= 0 || R < 0 || m->final_norm == NULL || vocab < 1 || !shape_is(&m->head, vocab, d)) return -1;
    if (R == 0) return 0;
    if (n_threads < 1) n_threads = 1;
    float *h = malloc(sizeof(float) * (size_t)(R * d));
    if (h == NULL) return -2;
    for (int64_t r = 0; r < R; r++) kvlab_rms_norm(x + r * d, m->final_norm, m->rms_eps, (int)d, h + r * d);
    int status = product(&m->head, h, R, logits, int8, n_threads);
    free(h);
    if (status == 0 && tokens != NULL) status = kvlab_rows_argmax(logits, R, vocab, tokens, n_threads);
    return status;
}
