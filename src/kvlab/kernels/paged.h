/* paged.c's entry points for the other C sources (batchstep.c): ragged attention over K/V blocks, an integer pool
 * layer of a step (TurboQuant pool layers: tqcodes.h). */
#ifndef KVLAB_PAGED_H
#define KVLAB_PAGED_H
#include <stdint.h>

#include "intcodes.h"   /* Quantized */

enum { POOL_F32 = 0, POOL_F16 = 1, POOL_BF16 = 2 };   /* how a pool stores K/V */

typedef struct {                   /* where the rows of a step's sequences live (kvlab/serve/attention.py RaggedLayout) */
    int32_t n_seqs, max_blocks, block_size;
    const int32_t *block_tables;   /* (n_seqs, max_blocks) */
    const int32_t *query_start;    /* (n_seqs + 1,): sequence s owns rows [query_start[s], query_start[s + 1]) */
    const int32_t *context_len;    /* (n_seqs,): tokens it attends to, its new rows included */
} Ragged;

/* the slot of sequence s's position pos: row pos % block_size of block table[pos / block_size] (pos inside the
 * sequence's checked blocks) */
static inline int64_t kvlab_ragged_slot(const Ragged *R, int s, int64_t pos) {
    return (int64_t)R->block_tables[(int64_t)s * R->max_blocks + pos / R->block_size] * R->block_size + pos % R->block_size;
}

/* 0 when every index a ragged layout gives (block ids, lengths, query offsets) lies inside a pool of n_slots
 * slots and the sizes are ones kvlab_paged_attention takes; -1 otherwise */
int kvlab_paged_layout_ok(int64_t n_rows, int n_heads, int n_kv_heads, int d, int dv, int dtype, int64_t n_slots,
                          const int32_t *block_tables, int n_seqs, int max_blocks, int block_size,
                          const int32_t *query_start, const int32_t *context_len);

/* out (n_rows, n_heads, dv) = each query row's causal (and window) attention over its sequence's blocks; 0, or -1
 * (nothing touched) when kvlab_paged_layout_ok refuses the layout */
int kvlab_paged_attention(const float *q, int64_t n_rows, int n_heads, int n_kv_heads, int d, int dv,
                          const void *k_pool, const void *v_pool, int dtype, int64_t n_slots,
                          const int32_t *block_tables, int n_seqs, int max_blocks, int block_size,
                          const int32_t *query_start, const int32_t *context_len,
                          float scale, int window, float *out, int n_threads);
/* kvlab_paged_attention's work item `item` = (query row item / n_kv_heads, KV head item % n_kv_heads): the G query
 * heads of that KV head attend over the row's keys; the layout checked by the caller (kvlab_paged_layout_ok) */
void kvlab_paged_attend_item(const float *q, int n_heads, int n_kv_heads, int d, int dv, const void *k_pool,
                             const void *v_pool, int dtype, const int32_t *block_tables, int n_seqs, int max_blocks,
                             int block_size, const int32_t *query_start, const int32_t *context_len, float scale,
                             int window, float *out, int64_t item);

/* 0 when kvlab_int_pool_layer takes these sizes: Q laid out as cache/blocks.py IntBlocks' blocks (R->block_size rows
 * each) with its stages, each sequence's stage row (stage_rows (n_seqs,)) below Q->stages, every block id inside Q */
int kvlab_int_pool_layer_ok(const Quantized *Q, int n_heads, int n_kv_heads, int hd, const Ragged *R, int64_t n_rows,
                            const int32_t *stage_rows);
/* One integer pool layer of a step (serve/coded.py IntPool): each row's K/V (k, v rows `kv_stride` floats apart, (Hkv,
 * hd) each, keys after RoPE) coded into its slot, its key staged in its sequence's stage row (kvlab_int_code_tokens),
 * then out (n_rows, H, hd) = each row's attention over its sequence's codes, q (n_rows, H, hd) after RoPE, the keys
 * from the row's open group on exact (kvlab_paged_int_attention). 0; -1 refused (nothing written); -2 no memory; 1
 * K/V not finite, 2 beyond float16's range (Q's overflow fields set) (nothing written, nothing attended). */
int kvlab_int_pool_layer(Quantized *Q, int n_heads, int n_kv_heads, int hd, const Ragged *R, int64_t n_rows,
                         const int32_t *stage_rows, const float *q, const float *k, const float *v, int64_t kv_stride,
                         float scale, int window, float *out, int n_threads);
#endif
