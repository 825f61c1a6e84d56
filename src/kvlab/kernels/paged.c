/* Attention over a ragged batch whose K/V live in blocks of a shared pool (kvlab/serve/attention.py).
 *
 * Pools: k (n_blocks, Hkv, block_size, D), v (n_blocks, Hkv, block_size, Dv) in fp32, fp16 or bf16 (cache/blocks.py):
 * slot = block * block_size + offset, and a head's rows of a block are contiguous.
 * Sequence s owns query rows [qs[s], qs[s+1]) of q (N, H, D) fp32 and attends to its first ctx[s] tokens
 * through block_tables[s] (max_blocks ids). Its query row r sits at position ctx[s] - (qs[s+1] - qs[s]) +
 * (r - qs[s]) and sees keys [pos - window + 1 (window > 0), pos]: the lower-right causal mask.
 * One work item = (a tile of up to TILE_QUERIES / G query rows of one sequence, KV head): the G = H / Hkv query heads
 * sharing that KV head, for every row of the tile, read each key once, in chunks of DENSE_READ_KEYS keys, each one
 * kvlab_dense_read (decode.c, the single cache's fused step reads its chunks with it too), merged in order as that step
 * merges them (decode.h kvlab_merge_part); everything is computed in fp32. A prompt chunk's rows thus share each
 * key's conversion and load; the single dense cache's module path reads through here too (cache/dense.py).
 * Every index is checked before the loop: a bad table or length returns -1 and touches nothing (-2: no memory).
 *
 * kvlab_tq_attention does the same over TurboQuant blocks (kvlab/serve/coded.py TurboPool), described by the
 * layer's Coded (tqcodes.h; cache/blocks.py TqBlocks' layout, head-major inside a block like the dense pool's): per
 * token and KV head, b-bit codebook codes (codebook.h's row layout; each head its own layout and width with +halloc,
 * the heads' codes side by side in the token's row) and a 16-bit norm, for K and for V. The queries come rotated
 * (and weighted) as the codes are read; the output stays in the rotated domain (kvlab_tq_pool_layer, which codes the
 * step's tokens and reads them so, turns it back in C). A work item is (sequence, query tile, KV head, key
 * chunk of CODE_CHUNK keys) and is one kvlab_tq_read (decode.c), the read the single cache's fused step makes of
 * its one block too: each tile of CB_TILE keys and values decoded once for all the item's queries (rows x the G
 * heads of the KV head), one softmax per query over the chunk. Chunks are separate items (flash-decoding: a long
 * context splits over threads), merged per query in chunk order, so the result is the same for any thread count.
 *
 * kvlab_paged_int_attention reads integer blocks (IntPool) with the single integer cache's own per-query function
 * (intcache.h kvlab_int_attend: one softmax over the whole context, no split), so that the pool's output is the
 * single cache's to the bit: int codes would turn a rounding difference into a different code now and then.
 * kvlab_int_pool_layer is one integer pool layer of a step (batchstep.c): the step's K/V coded by the coder of the
 * single cache and the fused decode step (decode.c kvlab_int_code_tokens), then that read.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "blockgemv.h"
#include "codebook.h"
#include "decode.h"
#include "intcache.h"
#include "intcodes.h"
#include "paged.h"
#include "rowmath.h"
#include "tqcodes.h"

#define MAX_DIM 512
#define MAX_GROUP 64

/* row `index` of a pool of `d`-wide rows as fp32: a pointer into an fp32 pool, else converted into buf */
static inline const float *pool_row(const void *pool, int dtype, int64_t index, int d, float *buf) {
    if (dtype == POOL_F32) return (const float *)pool + index * d;
    kvlab_kv_load(dtype, (const uint16_t *)pool + index * d, d, buf);   /* POOL_F16 / POOL_BF16 are decode.c's KV_* */
    return buf;
}

/* multiply-adds a dense read must do before its work items are shared out between threads: opening a parallel region
 * costs more than a one-query read of a few hundred keys */
#define PARALLEL_WORK 262144

static int check_layout(int64_t n_rows, int n_heads, int n_kv_heads, int d, int dv, int dtype, int64_t n_slots,
                        const int32_t *block_tables, int n_seqs, int max_blocks, int block_size,
                        const int32_t *query_start, const int32_t *context_len, int64_t key_end) {
    if (n_kv_heads <= 0 || n_heads % n_kv_heads || n_heads / n_kv_heads > MAX_GROUP) return -1;
    if (d <= 0 || dv <= 0 || d > MAX_DIM || dv > MAX_DIM || dtype < POOL_F32 || dtype > POOL_BF16) return -1;
    if (n_seqs < 0 || max_blocks <= 0 || block_size <= 0 || n_slots % block_size) return -1;
    if (query_start[0] != 0 || query_start[n_seqs] != n_rows) return -1;
    const int64_t n_blocks = n_slots / block_size;
    for (int s = 0; s < n_seqs; s++) {
        const int64_t n_q = (int64_t)query_start[s + 1] - query_start[s], ctx = context_len[s];
        const int64_t read = ctx < key_end ? ctx : key_end;   /* the keys it reads: its blocks */
        if (n_q < 0 || n_q > ctx || read > (int64_t)max_blocks * block_size) return -1;
        for (int64_t b = 0; b < (read + block_size - 1) / block_size; b++) {
            const int32_t id = block_tables[(int64_t)s * max_blocks + b];
            if (id < 0 || id >= n_blocks) return -1;
        }
    }
    return 0;
}

int kvlab_paged_layout_ok(int64_t n_rows, int n_heads, int n_kv_heads, int d, int dv, int dtype, int64_t n_slots,
                          const int32_t *block_tables, int n_seqs, int max_blocks, int block_size,
                          const int32_t *query_start, const int32_t *context_len) {
    return check_layout(n_rows, n_heads, n_kv_heads, d, dv, dtype, n_slots, block_tables, n_seqs, max_blocks, block_size,
                        query_start, context_len, INT64_MAX);
}

/* a . b over d values: sixteen lane sums (one vector register), then a fixed tree over the lanes; a serial
 * chain of sixteen scalar adds per dot made this kernel ~5x slower at decode. AVX2: the sixteen sums as two
 * eight-lane halves and the same tree (GCC keeps a 16-lane vector on the stack where there is no AVX-512: the
 * TurboQuant pool's inverse rotation, d dots a row, took 16% of a tq4 pool's prompt time). */
static inline float dot(const float *a, const float *b, int d) {
    int c = 0;
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
    __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
    for (; c + 16 <= d; c += 16) {
        lo = _mm256_fmadd_ps(_mm256_loadu_ps(a + c), _mm256_loadu_ps(b + c), lo);
        hi = _mm256_fmadd_ps(_mm256_loadu_ps(a + c + 8), _mm256_loadu_ps(b + c + 8), hi);
    }
    float sum = kvlab_sum8(_mm256_add_ps(lo, hi));
#else
    kvlab_lanes16 acc = {0};
    for (; c + 16 <= d; c += 16) acc += kvlab_lanes_at(a + c) * kvlab_lanes_at(b + c);
    acc += __builtin_shufflevector(acc, acc, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
    acc += __builtin_shufflevector(acc, acc, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
    acc += __builtin_shufflevector(acc, acc, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
    acc += __builtin_shufflevector(acc, acc, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
    float sum = acc[0];
#endif
    for (; c < d; c++) sum += a[c] * b[c];
    return sum;
}

/* the sequence owning query row `row`: the last s with query_start[s] <= row (binary search) */
static int owner(const int32_t *query_start, int n_seqs, int64_t row) {
    int lo = 0, hi = n_seqs - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (query_start[mid] <= row) lo = mid; else hi = mid - 1;
    }
    while (lo < n_seqs - 1 && query_start[lo + 1] <= row) lo++;   /* skip sequences with no queries */
    return lo;
}

/* Query rows of one sequence read together: a tile's keys are converted (fp16 / bf16) and scored once for all its rows'
 * queries, at most TILE_QUERIES of them (rows x the KV head's G query heads). */
#define TILE_QUERIES 32

/* One work item: the G query heads of KV head kv_head for query rows [r0, r1) of sequence s (rows at positions p0 ..
 * p0 + r1 - r0 - 1). Each row reads its keys in chunks of DENSE_READ_KEYS, each chunk one kvlab_dense_read, merged in
 * position order (decode.h kvlab_merge_part): the keys every row of the tile sees ([first key of the last row, p0]) in
 * one read of all the tile's queries, the keys only some rows see (a window's older keys, the causal diagonal) by each
 * row apart. A tile of one row is the one-query-row read the batched step makes (kvlab_paged_attend_item). */
typedef struct {            /* a tile's read (attend_tile): what each of its key ranges needs */
    const DenseHead *h;
    const int32_t *table;
    int n_heads, group, kv_head, dv;
    int64_t r0;             /* the tile's first query row */
    float scale;
    float *scratch, *parts, *top, *sum, *out;   /* top, sum: each query's running merge; out (N, H, Dv) */
} tile_read;

/* the first key a query at position pos sees */
static inline int64_t first_key(int64_t pos, int window) { return window > 0 && pos - window + 1 > 0 ? pos - window + 1 : 0; }

/* keys [first, last] for `count` queries from query `at` of the tile (q: theirs, side by side), chunk by chunk, each
 * chunk merged into its queries' running sums */
static void read_keys(const tile_read *T, int64_t first, int64_t last, const float *q, int at, int count) {
    for (int64_t c0 = first; c0 <= last; c0 += DENSE_READ_KEYS) {
        const int64_t c1 = last + 1 - c0 < DENSE_READ_KEYS ? last + 1 : c0 + DENSE_READ_KEYS;
        kvlab_dense_read(T->h, T->table, c0, c1, q, count, T->scale, T->scratch, T->parts, T->dv + 2);
        for (int i = 0; i < count; i++) {
            const int row = (at + i) / T->group, g = (at + i) % T->group;
            float weight;
            kvlab_merge_part(T->out + ((T->r0 + row) * T->n_heads + (int64_t)T->kv_head * T->group + g) * T->dv,
                             &T->top[at + i], &T->sum[at + i], T->parts + (int64_t)i * (T->dv + 2), T->dv, &weight);
        }
    }
}

static void attend_tile(const float *q, int n_heads, int n_kv_heads, int d, int dv, const void *k_pool,
                        const void *v_pool, int dtype, const int32_t *table, int block_size, int64_t r0, int64_t r1,
                        int64_t p0, int kv_head, float scale, int window, float *out) {
    const int group = n_heads / n_kv_heads, rows = (int)(r1 - r0), nq = rows * group;
    const size_t elem = dtype == POOL_F32 ? 4 : 2, head = (size_t)kv_head * (size_t)block_size;   /* its first row */
    const DenseHead h = {.type = dtype, .d = d, .dv = dv, .k = (const uint8_t *)k_pool + head * (size_t)d * elem,
                         .v = (const uint8_t *)v_pool + head * (size_t)dv * elem, .block_rows = block_size,
                         .block_stride = (int64_t)n_kv_heads * block_size};
    float top[nq], sum[nq], parts[nq * (dv + 2)], scratch[kvlab_dense_read_floats(nq, d, dv)];
    float queries[rows > 1 ? nq * d : 1];   /* (rows, G, D): the tile's queries side by side */
    for (int i = 0; i < nq; i++) top[i] = -INFINITY, sum[i] = 0.0f;
    for (int r = 0; r < rows; r++) {
        memset(out + ((r0 + r) * n_heads + (int64_t)kv_head * group) * dv, 0, sizeof(float) * (size_t)group * (size_t)dv);
        if (rows > 1)
            memcpy(queries + (int64_t)r * group * d, q + ((r0 + r) * n_heads + (int64_t)kv_head * group) * d,
                   sizeof(float) * (size_t)group * (size_t)d);
    }
    const float *all = rows > 1 ? queries : q + (r0 * n_heads + (int64_t)kv_head * group) * d;
    const tile_read T = {.h = &h, .table = table, .n_heads = n_heads, .group = group, .kv_head = kv_head, .dv = dv,
                         .r0 = r0, .scale = scale, .scratch = scratch, .parts = parts, .top = top, .sum = sum, .out = out};
    /* row r sees keys [first_key(p0 + r), p0 + r]; every row sees [shared, p0] (empty when a window is shorter than the
     * tile); what a row sees before that and after it, it reads alone */
    const int64_t shared = first_key(p0 + rows - 1, window);
    for (int r = 0; r < rows; r++)
        read_keys(&T, first_key(p0 + r, window), shared - 1 < p0 + r ? shared - 1 : p0 + r, all + (int64_t)r * group * d,
                  r * group, group);
    read_keys(&T, shared, p0, all, 0, nq);
    for (int r = 1; r < rows; r++)
        read_keys(&T, shared > p0 + 1 ? shared : p0 + 1, p0 + r, all + (int64_t)r * group * d, r * group, group);
    for (int i = 0; i < nq; i++) {
        float *o = out + ((r0 + i / group) * n_heads + (int64_t)kv_head * group + i % group) * dv;
        const float inv = 1.0f / sum[i];
        for (int c = 0; c < dv; c++) o[c] *= inv;
    }
}

/* the position of sequence s's query row `row` */
static inline int64_t row_position(const int32_t *query_start, const int32_t *context_len, int s, int64_t row) {
    return context_len[s] - (query_start[s + 1] - query_start[s]) + (row - query_start[s]);
}

void kvlab_paged_attend_item(const float *q, int n_heads, int n_kv_heads, int d, int dv, const void *k_pool,
                             const void *v_pool, int dtype, const int32_t *block_tables, int n_seqs, int max_blocks,
                             int block_size, const int32_t *query_start, const int32_t *context_len, float scale,
                             int window, float *out, int64_t item) {
    const int64_t row = item / n_kv_heads;
    const int s = owner(query_start, n_seqs, row);
    attend_tile(q, n_heads, n_kv_heads, d, dv, k_pool, v_pool, dtype, block_tables + (int64_t)s * max_blocks, block_size,
                row, row + 1, row_position(query_start, context_len, s, row), (int)(item % n_kv_heads), scale, window, out);
}

int kvlab_paged_attention(const float *q, int64_t n_rows, int n_heads, int n_kv_heads, int d, int dv,
                          const void *k_pool, const void *v_pool, int dtype, int64_t n_slots,
                          const int32_t *block_tables, int n_seqs, int max_blocks, int block_size,
                          const int32_t *query_start, const int32_t *context_len,
                          float scale, int window, float *out, int n_threads) {
    if (check_layout(n_rows, n_heads, n_kv_heads, d, dv, dtype, n_slots, block_tables, n_seqs, max_blocks, block_size,
                     query_start, context_len, INT64_MAX))
        return -1;
    const int group = n_heads / n_kv_heads, tile_rows = group < TILE_QUERIES ? TILE_QUERIES / group : 1;
    int64_t work = 0, n_tiles = 0;   /* query heads x keys x channels: a step this small runs on one thread (PARALLEL_WORK) */
    for (int s = 0; s < n_seqs; s++) {
        const int64_t n_q = query_start[s + 1] - query_start[s];
        work += n_q * context_len[s];
        n_tiles += (n_q + tile_rows - 1) / tile_rows;
    }
    work *= (int64_t)n_heads * d;
    int32_t *tile_seq = (int32_t *)malloc(sizeof(int32_t) * (size_t)(n_tiles > 0 ? n_tiles : 1));   /* each tile's sequence */
    if (tile_seq == NULL) return -2;
    int64_t *tile_row = (int64_t *)malloc(sizeof(int64_t) * (size_t)(n_tiles > 0 ? n_tiles : 1));   /* ... and first row */
    if (tile_row == NULL) {
        free(tile_seq);
        return -2;
    }
    for (int s = 0, t = 0; s < n_seqs; s++)
        for (int64_t r = query_start[s]; r < query_start[s + 1]; r += tile_rows, t++) tile_seq[t] = s, tile_row[t] = r;
    #pragma omp parallel for schedule(dynamic, 1) num_threads(n_threads) if(work >= PARALLEL_WORK)
    for (int64_t item = 0; item < n_tiles * n_kv_heads; item++) {
        const int64_t t = item / n_kv_heads, r0 = tile_row[t];
        const int s = tile_seq[t];
        const int64_t r1 = r0 + tile_rows < query_start[s + 1] ? r0 + tile_rows : query_start[s + 1];
        attend_tile(q, n_heads, n_kv_heads, d, dv, k_pool, v_pool, dtype, block_tables + (int64_t)s * max_blocks, block_size,
                    r0, r1, row_position(query_start, context_len, s, r0), (int)(item % n_kv_heads), scale, window, out);
    }
    free(tile_seq);
    free(tile_row);
    return 0;
}

/* -- coded blocks: TurboQuant codes ------------------------------------------------------------------------ */
#define CODE_CHUNK 256   /* keys per work item (flash-decoding split of a long context), at most TQ_READ_KEYS */
_Static_assert(CODE_CHUNK <= TQ_READ_KEYS, "a work item is one read");
#define CODE_QUERIES 64          /* query vectors (rows x group) per work item, at most */

typedef struct {
    int s, h;               /* sequence, KV head */
    int64_t r0, r1;         /* query rows [r0, r1) of the flat batch */
    int64_t k0, k1;         /* key positions [k0, k1) of the sequence */
} code_item;

typedef struct {            /* a read of a coded layer over a ragged batch (kvlab_tq_attention) */
    int n_heads, n_kv_heads, group, d, dpad, window;
    int64_t first_key, key_end;           /* keys at positions [first_key, key_end) are read */
    const Ragged *R;
    const Coded *C;
    const cb_layout *layouts;             /* (2 Hkv,) each head's key and value layouts */
    const PreRope *pre;                   /* +prerope: (Hkv,) each head's rebuild, cos/sin rows of position 0; or NULL */
    const float *turn_coef;               /* +ropemean: (n_rows, H, d) each query's [A | B], else NULL; ... */
    const float *rope_cos, *rope_sin;     /* ... with the cos/sin rows of position 0 */
    float scale;
} code_pool;

/* Enumerate the work items in (sequence, query tile, KV head, key chunk) order into items (when not NULL) and
 * each (sequence, query tile, KV head) group's first item into group_first (n_groups + 1 entries); returns the
 * number of items and sets *n_groups. Only key chunks some query of the tile sees (causal, window) are items. */
static int64_t code_items(const code_pool *P, int n_seqs, int64_t rows_per_tile, code_item *items, int64_t *group_first,
                          int64_t *n_groups) {
    int64_t n = 0, groups = 0;
    for (int s = 0; s < n_seqs; s++) {
        const int64_t q0 = P->R->query_start[s], q1 = P->R->query_start[s + 1], first_pos = P->R->context_len[s] - (q1 - q0);
        for (int64_t r0 = q0; r0 < q1; r0 += rows_per_tile) {
            const int64_t r1 = r0 + rows_per_tile < q1 ? r0 + rows_per_tile : q1;
            const int64_t p0 = first_pos + (r0 - q0), p1 = first_pos + (r1 - 1 - q0);
            const int64_t from = P->window > 0 && p0 - P->window + 1 > 0 ? p0 - P->window + 1 : 0;
            const int64_t hi = p1 + 1 < P->key_end ? p1 + 1 : P->key_end;
            const int64_t lo = from > P->first_key ? from : P->first_key;
            for (int h = 0; h < P->n_kv_heads; h++) {
                if (group_first) group_first[groups] = n;
                groups++;
                if (lo >= hi) {   /* no key read (every row below first_key): one empty item, the rows' output 0 */
                    if (items) items[n] = (code_item){.s = s, .h = h, .r0 = r0, .r1 = r1, .k0 = hi, .k1 = hi};
                    n++;
                    continue;
                }
                for (int64_t c = lo / CODE_CHUNK * CODE_CHUNK; c < hi; c += CODE_CHUNK) {
                    if (items) {
                        code_item *it = &items[n];
                        it->s = s, it->h = h, it->r0 = r0, it->r1 = r1;
                        it->k0 = c > lo ? c : lo;
                        it->k1 = c + CODE_CHUNK < hi ? c + CODE_CHUNK : hi;
                    }
                    n++;
                }
            }
        }
    }
    if (group_first) group_first[groups] = n;
    *n_groups = groups;
    return n;
}

/* One item through kvlab_tq_read: each of its nq = rows x G queries reads the keys its position sees (causal, window,
 * from first_key on, before key_end). parts: nq x (d + 2), kvlab_tq_read's. */
static void code_item_attend(const code_pool *P, const float *q, const code_item *it, float *scratch, float *parts) {
    const int G = P->group;
    const Ragged *R = P->R;
    const int64_t first_pos = R->context_len[it->s] - (R->query_start[it->s + 1] - R->query_start[it->s]);   /* of its row 0 */
    const int nq = (int)(it->r1 - it->r0) * G;
    int64_t lo[CODE_QUERIES], hi[CODE_QUERIES];
    for (int i = 0; i < nq; i++) {
        const int64_t pos = first_pos + (it->r0 + i / G - R->query_start[it->s]);
        const int64_t from = P->window > 0 ? pos - P->window + 1 : 0;
        lo[i] = from > P->first_key ? from : P->first_key;
        hi[i] = pos + 1 < P->key_end ? pos + 1 : P->key_end;
    }
    const int64_t first_query = (it->r0 * P->n_heads + (int64_t)it->h * G) * P->d;
    const KeyTurn turn = {P->turn_coef ? P->turn_coef + first_query : NULL, P->rope_cos, P->rope_sin, P->C->rope_steps};
    const TqHead head = {.C = P->C, .layout = {&P->layouts[2 * it->h], &P->layouts[2 * it->h + 1]}, .g = it->h,
                         .scale = P->scale, .pre = P->pre ? &P->pre[it->h] : NULL, .turn = P->turn_coef ? &turn : NULL};
    kvlab_tq_read(&head, R->block_tables + (int64_t)it->s * R->max_blocks, it->k0, it->k1,
                  q + first_query, G, (int64_t)P->n_heads * P->d, nq, lo, hi, scratch,
                  parts, P->d + 2);
}

/* Every item, then each query's chunks merged in chunk order: out = sum_c e^(m_c - M) o_c / sum_c e^(m_c - M) l_c,
 * and (lse not NULL) lse = M + log sum_c e^(m_c - M) l_c, the log of the softmax's sum (-inf, out 0: no key read).
 * 0, or -2 (no memory). */
static int code_attention(const code_pool *P, const float *q, int n_seqs, float *out, float *lse, int n_threads) {
    const int G = P->group, d = P->d;
    const int64_t rows_per_tile = CODE_QUERIES / G > 1 ? CODE_QUERIES / G : 1;
    const int64_t max_queries = rows_per_tile * G, part_floats = max_queries * (d + 2);
    int64_t n_groups;
    const int64_t n_items = code_items(P, n_seqs, rows_per_tile, NULL, NULL, &n_groups);
    code_item *items = malloc(sizeof(code_item) * (size_t)(n_items + 1));
    int64_t *group_first = malloc(sizeof(int64_t) * (size_t)(n_groups + 1));
    float *parts = malloc(sizeof(float) * (size_t)(n_items * part_floats + 1));
    int failed = !items || !group_first || !parts;
    if (!failed) {
        code_items(P, n_seqs, rows_per_tile, items, group_first, &n_groups);
        int64_t work = 0;
        for (int64_t i = 0; i < n_items; i++) work += (items[i].r1 - items[i].r0) * G * (items[i].k1 - items[i].k0) * 2 * d;
        #pragma omp parallel num_threads(kvlab_cb_threads(work, n_threads))
        {
            float *scratch = malloc(sizeof(float) * (size_t)kvlab_tq_read_floats((int)max_queries, P->dpad));
            if (!scratch) {
                #pragma omp atomic write
                failed = 1;
            }
            #pragma omp for schedule(dynamic, 1)
            for (int64_t i = 0; i < n_items; i++)
                if (scratch) code_item_attend(P, q, &items[i], scratch, parts + i * part_floats);
            free(scratch);
            #pragma omp for schedule(static)
            for (int64_t g = 0; g < n_groups; g++) {
                if (failed) continue;
                const code_item *first = &items[group_first[g]];
                const int64_t nq = (first->r1 - first->r0) * G, chunks = group_first[g + 1] - group_first[g];
                for (int64_t i = 0; i < nq; i++) {
                    const int64_t at = (first->r0 + i / G) * P->n_heads + (int64_t)first->h * G + i % G;
                    float top, *o = out + at * d;
                    const float sum = kvlab_merge_parts(parts + group_first[g] * part_floats + i * (d + 2), part_floats,
                                                        chunks, d, 0, 0, o, NULL, NULL, &top);
                    const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
                    for (int k = 0; k < d; k++) o[k] *= inv;
                    if (lse) lse[at] = sum > 0.0f ? top + logf(sum) : -INFINITY;
                }
            }
        }
    }
    free(items);
    free(group_first);
    free(parts);
    return failed ? -2 : 0;
}

/* Integer blocks (kvlab/serve/coded.py IntPool; codes packed as kvlab/cache/packing.py; head-major inside a block as
 * cache/blocks.py lays blocks out: codes (n_blocks, Hkv, block_size, row), value scales (n_blocks, Hkv, block_size,
 * dv / value_group), key scales (n_blocks, Hkv, block_size / key_group, dk)): every query row and head
 * through kvlab_int_attend (intcache.h), the single cache's read, so a sequence's output is bitwise the single cache's.
 * Keys zero + code x scale per channel per key group of key_group tokens, values per value group of value_group
 * channels; exact (rows, Hkv, dk) fp32 holds each sequence's keys from its open key group on (exact_start: its rows,
 * the last of its context): the query at position p reads the keys of the groups complete at p from their codes, the
 * rest exact. One work item = (a block of a sequence's query rows, KV head): its rows' G query heads, each key decoded
 * once for them. q (n_rows, H, dk), out (n_rows, H, dv).
 * 0, -1 (nothing read), -2 (no memory). */
int kvlab_paged_int_attention(const float *q, int64_t n_rows, int n_heads, int n_kv_heads, int dk, int dv, int bits,
                              const uint8_t *k_codes, const uint16_t *k_scale, const uint16_t *k_zero, int key_group,
                              const uint8_t *v_codes, const uint16_t *v_scale, const uint16_t *v_zero, int value_group,
                              int64_t n_slots, const float *exact, const int64_t *exact_start, int64_t exact_rows,
                              const int32_t *block_tables, int n_seqs, int max_blocks, int block_size,
                              const int32_t *query_start, const int32_t *context_len,
                              float scale, int window, float *out, int n_threads) {
    if (bits < 1 || bits > 8 || key_group <= 0 || block_size % key_group || value_group <= 0 || dv % value_group
        || dk > KVLAB_INT_MAX_DIM || dv > KVLAB_INT_MAX_DIM)
        return -1;
    if (check_layout(n_rows, n_heads, n_kv_heads, dk, dv, POOL_F32, n_slots, block_tables, n_seqs, max_blocks, block_size,
                     query_start, context_len, INT64_MAX))
        return -1;
    if (exact_start[0] != 0 || exact_start[n_seqs] != exact_rows) return -1;
    int64_t longest = 1;
    for (int s = 0; s < n_seqs; s++) {   /* the exact keys cover every key some query reads exact: from its open group */
        const int64_t n_exact = exact_start[s + 1] - exact_start[s], start = context_len[s] - (query_start[s + 1] - query_start[s]);
        if (n_exact < 0 || n_exact > context_len[s] || context_len[s] - n_exact > (start + 1) / key_group * key_group) return -1;
        longest = context_len[s] > longest ? context_len[s] : longest;
    }
    const int G = n_heads / n_kv_heads, n_vg = dv / value_group, rows = G > KVLAB_INT_QUERIES ? 0 : KVLAB_INT_QUERIES / G;
    if (!rows) return -1;
    const int64_t k_bytes = int_row_bytes(bits, dk), v_bytes = int_row_bytes(bits, dv);
    int64_t n_blocks = 0;                  /* work items: (block of at most `rows` query rows of a sequence, KV head) */
    for (int s = 0; s < n_seqs; s++) n_blocks += (query_start[s + 1] - query_start[s] + rows - 1) / rows;
    int64_t *block_row = malloc(sizeof(int64_t) * (size_t)(n_blocks + 1));
    int32_t *block_seq = malloc(sizeof(int32_t) * (size_t)(n_blocks + 1));
    int status = block_row && block_seq ? 0 : -2;
    if (!status) {
        int64_t b = 0;
        for (int s = 0; s < n_seqs; s++)
            for (int64_t r = query_start[s]; r < query_start[s + 1]; r += rows) block_row[b] = r, block_seq[b++] = s;
        #pragma omp parallel num_threads(n_threads)
        {
            float *scratch = malloc(sizeof(float) * (size_t)kvlab_int_scratch(longest, dk, dv));
            if (!scratch) {
                #pragma omp atomic write
                status = -2;
            }
            #pragma omp for schedule(dynamic, 1)
            for (int64_t item = 0; item < n_blocks * n_kv_heads; item++) {
                if (!scratch) continue;
                const int64_t r0 = block_row[item / n_kv_heads];
                const int h = (int)(item % n_kv_heads), s = block_seq[item / n_kv_heads];
                const int64_t ctx = context_len[s], r1 = r0 + rows < query_start[s + 1] ? r0 + rows : query_start[s + 1];
                /* head h's rows of block b: codes and value scales from row (b * Hkv + h) * block_size, key scales
                 * from group row (b * Hkv + h) * block_size / key_group (cache/blocks.py's layout) */
                const int64_t bs = block_size, groups = bs / key_group;
                const IntHead R = {.bits = bits, .dk = dk, .dv = dv, .key_group = key_group, .value_group = value_group,
                                   .k_codes = k_codes + h * bs * k_bytes, .k_row_stride = k_bytes,
                                   .v_codes = v_codes + h * bs * v_bytes, .v_row_stride = v_bytes,
                                   .k_scale = k_scale + h * groups * dk, .k_zero = k_zero + h * groups * dk,
                                   .k_meta_stride = dk, .v_scale = v_scale + h * bs * n_vg,
                                   .v_zero = v_zero + h * bs * n_vg, .v_meta_stride = n_vg,
                                   .table = block_tables + (int64_t)s * max_blocks, .block_size = bs,
                                   .block_stride = n_kv_heads * bs,
                                   .exact = exact ? exact + (exact_start[s] * n_kv_heads + h) * dk : NULL,
                                   .exact_first = ctx - (exact_start[s + 1] - exact_start[s]),
                                   .exact_stride = (int64_t)n_kv_heads * dk};
                IntQuery Q[KVLAB_INT_QUERIES];
                int count = 0;
                for (int64_t row = r0; row < r1; row++) {
                    const int64_t pos = ctx - (query_start[s + 1] - query_start[s]) + (row - query_start[s]);
                    for (int g = 0; g < G; g++) {
                        const int64_t head = row * n_heads + (int64_t)h * G + g;
                        Q[count++] = kvlab_int_query(q + head * dk, out + head * dv, pos, window, key_group);
                    }
                }
                kvlab_int_attend(&R, Q, count, scale, scratch);
            }
            free(scratch);
        }
    }
    free(block_row);
    free(block_seq);
    return status;
}

/* -- an integer pool layer of a step (batchstep.c): its tokens coded, then read ------------------------------------ */
int kvlab_int_pool_layer_ok(const Quantized *Q, int n_heads, int n_kv_heads, int hd, const Ragged *R, int64_t n_rows,
                            const int32_t *stage_rows) {
    if (!Q || !R || !stage_rows || n_kv_heads <= 0 || !kvlab_int_layout_ok(Q, hd) || hd > KVLAB_INT_MAX_DIM) return -1;
    const int64_t bs = R->block_size, groups = bs / Q->group;   /* cache/blocks.py IntBlocks' layout, its stages' */
    if (Q->block_rows != bs || bs % Q->group || Q->head_stride != bs || Q->slot_stride != 1
        || Q->block_stride != n_kv_heads * bs || Q->meta_head_stride != groups || Q->meta_group_stride != 1
        || Q->meta_block_stride != n_kv_heads * groups || Q->stage_head_stride != 1 || Q->stage_row_stride != n_kv_heads)
        return -1;
    for (int s = 0; s < R->n_seqs; s++)
        if (stage_rows[s] < 0 || stage_rows[s] >= Q->stages) return -1;
    return check_layout(n_rows, n_heads, n_kv_heads, hd, hd, POOL_F32, Q->slots, R->block_tables, R->n_seqs,
                        R->max_blocks, R->block_size, R->query_start, R->context_len, INT64_MAX);
}

int kvlab_int_pool_layer(Quantized *Q, int n_heads, int n_kv_heads, int hd, const Ragged *R, int64_t n_rows,
                         const int32_t *stage_rows, const float *q, const float *k, const float *v, int64_t kv_stride,
                         float scale, int window, float *out, int n_threads) {
    if (kvlab_int_pool_layer_ok(Q, n_heads, n_kv_heads, hd, R, n_rows, stage_rows) || kv_stride < (int64_t)n_kv_heads * hd)
        return -1;
    const int G = Q->group, S = R->n_seqs;
    const int64_t kv = (int64_t)n_kv_heads * hd, stage_floats = G * kv;   /* a stage: (G, Hkv, hd) */
    int64_t *exact_start = malloc(sizeof(int64_t) * (size_t)(S + 1));
    int64_t *at = malloc(sizeof(int64_t) * (3 * (size_t)n_rows + 1));   /* each row's slot, position and stage row */
    int status = exact_start && at ? 0 : -2;
    float *exact = NULL;
    if (status == 0) {   /* each sequence's keys from its open group on: the group's staged keys, then its rows' */
        exact_start[0] = 0;
        for (int s = 0; s < S; s++) {
            const int64_t n = R->query_start[s + 1] - R->query_start[s];
            exact_start[s + 1] = exact_start[s] + (R->context_len[s] - n) % G + n;
        }
        exact = malloc(sizeof(float) * (size_t)(exact_start[S] * kv + 1));
        status = exact ? 0 : -2;
    }
    int64_t *slots = at, *positions = at + n_rows, *stages = at + 2 * n_rows;
    for (int s = 0; s < S && status == 0; s++) {
        const int64_t r0 = R->query_start[s], start = R->context_len[s] - (R->query_start[s + 1] - r0), have = start % G;
        const float *stage = Q->k_stage + stage_rows[s] * stage_floats;
        memcpy(exact + exact_start[s] * kv, stage, sizeof(float) * (size_t)(have * kv));
        for (int64_t r = r0; r < R->query_start[s + 1]; r++) {
            memcpy(exact + (exact_start[s] + have + r - r0) * kv, k + r * kv_stride, sizeof(float) * (size_t)kv);
            positions[r] = start + r - r0;
            slots[r] = kvlab_ragged_slot(R, s, positions[r]);
            stages[r] = stage_rows[s];
        }
    }
    if (status == 0)
        status = kvlab_int_code_tokens(Q, n_kv_heads, hd, n_rows, k, v, kv_stride, slots, positions, stages, stage_floats,
                                       n_threads);
    if (status == 0)
        status = kvlab_paged_int_attention(q, n_rows, n_heads, n_kv_heads, hd, hd, Q->bits, Q->k_codes, Q->k_scale,
                                           Q->k_zero, G, Q->v_codes, Q->v_scale, Q->v_zero, Q->value_group, Q->slots,
                                           exact, exact_start, exact_start[S], R->block_tables, S, R->max_blocks,
                                           R->block_size, R->query_start, R->context_len, scale, window, out, n_threads);
    free(exact_start);
    free(at);
    free(exact);
    return status;
}

/* -- TurboQuant codes in blocks, read and coded through a layer's Coded (tqcodes.h) ------------------------------- */
/* The checks of a read of C over R (keys below key_end; INT64_MAX: all): each KV head's key and value layouts into L
 * (2 Hkv); 0 or -1 */
static int coded_check(const Coded *C, int n_heads, int n_kv_heads, int hd, const Ragged *R, int64_t n_rows,
                       const TqStep *S, int64_t key_end, cb_layout *L) {
    if (!C || !R || !S || n_kv_heads <= 0) return -1;
    if (C->slots <= 0 || C->block_rows != R->block_size || !C->rotation) return -1;
    if (check_layout(n_rows, n_heads, n_kv_heads, hd, hd, POOL_F32, C->slots, R->block_tables, R->n_seqs, R->max_blocks,
                     R->block_size, R->query_start, R->context_len, key_end))
        return -1;
    if (kvlab_tq_layouts(C, n_kv_heads, hd, L)) return -1;
    for (int h = 0; h < 2 * n_kv_heads; h++)
        if (L[h].dpad != L[0].dpad) return -1;
    const int pre = kvlab_tq_pre_rope(C);
    if (pre || C->rope_mean) {   /* +prerope (the rebuild) and +ropemean: a RoPE row for every position */
        if ((pre && (hd % 16 || (C->unrotation_signs && (hd & (hd - 1))))) || !S->rope_cos || !S->rope_sin) return -1;
        if (C->rope_mean && !C->rope_steps) return -1;
        for (int s = 0; s < R->n_seqs; s++)
            if ((R->context_len[s] < key_end ? R->context_len[s] : key_end) > S->rope_rows) return -1;
    }
    return 0;
}

/* code_attention over C's blocks (checked: coded_check): q as kvlab_tq_attention takes it. 0, or -2 (no memory) */
static int coded_read(const Coded *C, const cb_layout *L, int n_heads, int n_kv_heads, int hd, const Ragged *R,
                      const TqStep *S, const float *q, int64_t first_key, int64_t key_end, float scale, int window,
                      float *out, float *lse, int n_threads) {
    const int Hkv = n_kv_heads, pre = kvlab_tq_pre_rope(C), turn = C->rope_mean;
    const int64_t n_queries = (int64_t)R->query_start[R->n_seqs] * n_heads;
    float *state = pre || turn ? malloc(sizeof(float) * 2 * (size_t)Hkv * hd) : NULL;   /* key weights, key offset */
    PreRope *rebuild = pre ? malloc(sizeof(PreRope) * (size_t)Hkv) : NULL;
    /* +ropemean: the queries as the codes read them, then each one's [A | B] */
    float *turned = turn ? malloc(sizeof(float) * 2 * (size_t)(n_queries * hd + 1)) : NULL;
    if ((pre || turn) && (!state || (pre && !rebuild) || (turn && !turned))) {
        free(state);
        free(rebuild);
        free(turned);
        return -2;
    }
    if (turn) {   /* plain q in: read as the codes are (kvlab_tq_query), the offset's term per key */
        kvlab_tq_state(C, Hkv, hd, NULL, state + (int64_t)Hkv * hd, NULL);
        #pragma omp parallel for schedule(static) num_threads(n_threads < 1 ? 1 : n_threads) if(n_queries * hd * hd >= 65536)
        for (int64_t i = 0; i < n_queries; i++) {
            const int g = (int)(i % n_heads) / (n_heads / Hkv);
            kvlab_tq_query(C, g, hd, q + i * hd, turned + i * hd);
            kvlab_tq_turn_coef(q + i * hd, state + (int64_t)(Hkv + g) * hd, hd, 1.0f, turned + (n_queries + i) * hd);
        }
        q = turned;
    }
    if (pre) {   /* keys rebuilt from the codec's state and turned to their positions (decode.c) */
        kvlab_tq_state(C, Hkv, hd, state, state + (int64_t)Hkv * hd, NULL);
        for (int h = 0; h < Hkv; h++)
            rebuild[h] = (PreRope){.unrotation = C->unrotation, .signs = C->unrotation_signs,
                                   .weights = C->weight_codes ? state + (int64_t)h * hd : NULL,
                                   .offset = C->offset[0] ? state + (int64_t)(Hkv + h) * hd : NULL,
                                   .cos_ = S->rope_cos, .sin_ = S->rope_sin};
    }
    const code_pool P = {.n_heads = n_heads, .n_kv_heads = Hkv, .group = n_heads / Hkv, .d = hd, .dpad = L[0].dpad,
                         .window = window, .first_key = first_key, .key_end = key_end, .R = R, .C = C, .layouts = L, .pre = rebuild,
                         .turn_coef = turn ? turned + n_queries * hd : NULL, .rope_cos = S->rope_cos, .rope_sin = S->rope_sin,
                         .scale = scale};
    const int status = code_attention(&P, q, R->n_seqs, out, lse, n_threads < 1 ? 1 : n_threads);
    free(state);
    free(rebuild);
    free(turned);
    return status;
}

int kvlab_tq_attention(const Coded *C, int n_heads, int n_kv_heads, int hd, const Ragged *R, int64_t n_rows,
                       const TqStep *S, const float *q, int64_t first_key, int64_t key_end, float scale, int window,
                       float *out, float *lse, int n_threads) {
    if (n_kv_heads <= 0 || n_kv_heads > CB_MAX_DIM || first_key < 0) return -1;
    cb_layout *L = malloc(sizeof(cb_layout) * 2 * (size_t)n_kv_heads);
    if (!L) return -2;
    int status = coded_check(C, n_heads, n_kv_heads, hd, R, n_rows, S, key_end < 0 ? INT64_MAX : key_end, L);
    if (!status && n_rows > 0)
        status = coded_read(C, L, n_heads, n_kv_heads, hd, R, S, q, first_key, key_end < 0 ? INT64_MAX : key_end, scale,
                            window, out, lse, n_threads);
    free(L);
    return status;
}

/* -- a layer of a TurboQuant pool in one call (tqcodes.h) -------------------------------------------------------- */
/* kvlab_tq_pool_layer_ok's checks, each KV head's key and value layouts into L (2 Hkv) */
static int tq_layer_check(const TqPoolLayer *T, int n_heads, int n_kv_heads, int hd, const Ragged *R, int64_t n_rows,
                          const TqStep *S, cb_layout *L) {
    if (!T || coded_check(T->coded, n_heads, n_kv_heads, hd, R, n_rows, S, INT64_MAX, L)) return -1;
    if (T->sink < 0) return -1;
    if (T->sink > 0) {
        if (!T->sink_k || !T->sink_v || !S->entries || T->sink_type < POOL_F32 || T->sink_type > POOL_BF16) return -1;
        for (int s = 0; s < R->n_seqs; s++)
            if (S->entries[s] < 0 || S->entries[s] >= T->sink_entries) return -1;
    }
    return 0;
}

int kvlab_tq_pool_layer_ok(const TqPoolLayer *T, int n_heads, int n_kv_heads, int hd, const Ragged *R, int64_t n_rows,
                           const TqStep *S) {
    if (n_kv_heads <= 0 || n_kv_heads > CB_MAX_DIM) return -1;
    cb_layout *L = malloc(sizeof(cb_layout) * 2 * (size_t)n_kv_heads);
    if (!L) return -2;
    const int status = tq_layer_check(T, n_heads, n_kv_heads, hd, R, n_rows, S, L);
    free(L);
    return status;
}

/* K or V of one row (Hkv x hd values) into sink row `row` of `rows` (sink_type), rounded as torch's .to() rounds */
static void store_sink_row(int type, const float *src, int64_t n, void *rows, int64_t row) {
    if (type == POOL_F32)
        memcpy((float *)rows + row * n, src, sizeof(float) * (size_t)n);
    else
        kvlab_kv_store(type, src, n, (uint16_t *)rows + row * n);
}

/* Row i = (row, head) of the output: y (d,) in the rotated domain -> o = y Mᵀ (+ the value offset); with sink rows,
 * one softmax over the sink rows the row sees (positions [lo, hi)) and the coded keys, whose log-sum-exp is lse
 * (plus q·μ·scale where the keys were coded less their offset and q is not turned back with them). */
static void tq_finish(const TqPoolLayer *T, int n_kv_heads, int g, int d, const float *y, const float *q, float lse,
                      const float *k_offset, const float *v_offset, int entry, int64_t lo, int64_t hi, float scale,
                      float *o) {
    const Coded *C = T->coded;
    for (int c = 0; c < d; c++) o[c] = dot(C->rotation + (int64_t)c * d, y, d);
    if (v_offset)
        for (int c = 0; c < d; c++) o[c] += v_offset[c];
    if (T->sink == 0) return;
    if (k_offset) lse += dot(q, k_offset, d) * scale;
    float top = lse, buf[MAX_DIM], acc[MAX_DIM];
    const int64_t first = (int64_t)entry * T->sink * n_kv_heads + g;   /* sink row t of KV head g: first + t Hkv */
    for (int64_t t = lo; t < hi; t++) {
        const float s = dot(q, pool_row(T->sink_k, T->sink_type, first + t * n_kv_heads, d, buf), d) * scale;
        top = s > top ? s : top;
    }
    const float w_coded = expf(lse - top);                            /* 0 where no coded key was read (lse -inf) */
    float total = w_coded;
    for (int c = 0; c < d; c++) acc[c] = w_coded * o[c];
    for (int64_t t = lo; t < hi; t++) {
        const float w = expf(dot(q, pool_row(T->sink_k, T->sink_type, first + t * n_kv_heads, d, buf), d) * scale - top);
        const float *v = pool_row(T->sink_v, T->sink_type, first + t * n_kv_heads, d, buf);
        total += w;
        for (int c = 0; c < d; c++) acc[c] += w * v[c];
    }
    for (int c = 0; c < d; c++) o[c] = acc[c] / total;
}

int kvlab_tq_pool_layer(const TqPoolLayer *T, int n_heads, int n_kv_heads, int hd, const Ragged *R, int64_t n_rows,
                        const TqStep *S, const float *q, const float *k, const float *v, int64_t kv_stride, float scale,
                        int window, float *out, int n_threads) {
    if (n_kv_heads <= 0 || n_kv_heads > CB_MAX_DIM || kv_stride < (int64_t)n_kv_heads * hd) return -1;
    cb_layout *L = malloc(sizeof(cb_layout) * 2 * (size_t)n_kv_heads);
    if (!L) return -2;
    int status = tq_layer_check(T, n_heads, n_kv_heads, hd, R, n_rows, S, L);
    if (status || n_rows == 0) {
        free(L);
        return status;
    }
    if (n_threads < 1) n_threads = 1;
    const Coded *C = T->coded;
    const int H = n_heads, Hkv = n_kv_heads, G = H / Hkv, d = hd, sink = T->sink;
    const int pre = kvlab_tq_pre_rope(C), plain = pre || C->rope_mean;   /* plain q to coded_read */
    const int64_t N = n_rows, kv_dim = (int64_t)Hkv * d;
    int64_t *slot = malloc(sizeof(int64_t) * (size_t)N), *position = malloc(sizeof(int64_t) * (size_t)N);
    int *entry = malloc(sizeof(int) * (size_t)N);
    float *queries = plain ? NULL : malloc(sizeof(float) * (size_t)(N * H * d));   /* (N, H, d) as the codes are read */
    float *rotated = malloc(sizeof(float) * (size_t)(N * H * d));                  /* (N, H, d) attention, rotated */
    float *lse = sink ? malloc(sizeof(float) * (size_t)(N * H)) : NULL;
    float *state = malloc(sizeof(float) * (size_t)(2 * kv_dim));                   /* key, value offsets */
    if (!slot || !position || !entry || (!plain && !queries) || !rotated || (sink && !lse) || !state) status = -2;
    if (!status) {   /* each row's position and slot; a sink position's K/V into its sequence's sink rows */
        for (int s = 0; s < R->n_seqs; s++) {
            const int64_t r0 = R->query_start[s], r1 = R->query_start[s + 1], first = R->context_len[s] - (r1 - r0);
            for (int64_t r = r0; r < r1; r++) {
                const int64_t pos = first + (r - r0);
                position[r] = pos;
                entry[r] = sink ? S->entries[s] : 0;
                slot[r] = pos < sink ? -1 : kvlab_ragged_slot(R, s, pos);
                if (pos < sink) {
                    const int64_t row = (int64_t)entry[r] * sink + pos;
                    store_sink_row(T->sink_type, k + r * kv_stride, kv_dim, T->sink_k, row);
                    store_sink_row(T->sink_type, v + r * kv_stride, kv_dim, T->sink_v, row);
                }
            }
        }
        status = kvlab_tq_code_rows(C, L, Hkv, d, N, k, v, kv_stride, slot, plain ? S->rope_cos : NULL,
                                    plain ? S->rope_sin : NULL, position, n_threads);
    }
    float *k_offset = state, *v_offset = state + kv_dim;
    if (!status) {   /* the codes read in place: the read of kvlab_tq_attention */
        kvlab_tq_state(C, Hkv, d, NULL, k_offset, v_offset);
        if (!plain) {
            #pragma omp parallel for schedule(static) num_threads(n_threads) if(N * H * d * d >= 65536)
            for (int64_t i = 0; i < N * H; i++) kvlab_tq_query(C, (int)(i % H) / G, d, q + i * d, queries + i * d);
        }
        status = coded_read(C, L, H, Hkv, d, R, S, plain ? q : queries, sink, INT64_MAX, scale, window, rotated, lse, n_threads);
    }
    if (!status) {   /* back to the model's domain, merged with the sink rows */
        #pragma omp parallel for schedule(static) num_threads(n_threads)
        for (int64_t i = 0; i < N * H; i++) {
            const int64_t r = i / H, pos = position[r];
            const int g = (int)(i % H) / G;
            const int64_t lo = window > 0 && pos - window + 1 > 0 ? pos - window + 1 : 0, hi = pos + 1 < sink ? pos + 1 : sink;
            tq_finish(T, Hkv, g, d, rotated + i * d, q + i * d, sink ? lse[i] : 0.0f,
                      C->offset[0] && !plain ? k_offset + (int64_t)g * d : NULL, C->offset[1] ? v_offset + (int64_t)g * d : NULL,
                      entry[r], lo, hi, scale, out + i * d);
        }
    }
    free(L); free(slot); free(position); free(entry); free(queries); free(rotated); free(lse); free(state);
    return status;
}
