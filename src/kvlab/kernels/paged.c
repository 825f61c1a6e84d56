/* Attention over a ragged batch whose K/V live in blocks of a shared pool (kvlab/serve/attention.py).
 *
 * Pools: k (slots, Hkv, D), v (slots, Hkv, Dv) in fp32, fp16 or bf16; slot = block * block_size + offset.
 * Sequence s owns query rows [qs[s], qs[s+1]) of q (N, H, D) fp32 and attends to its first ctx[s] tokens
 * through block_tables[s] (max_blocks ids). Its query row r sits at position ctx[s] - (qs[s+1] - qs[s]) +
 * (r - qs[s]) and sees keys [pos - window + 1 (window > 0), pos]: the lower-right causal mask.
 * One work item = (query row, KV head): the G = H / Hkv query heads sharing that KV head read each key once.
 * Keys are scored in tiles of 64 with a running max (online softmax); everything is computed in fp32.
 * Every index is checked before the loop: a bad table or length returns -1 and touches nothing.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "blockgemv.h"

enum { POOL_F32 = 0, POOL_F16 = 1, POOL_BF16 = 2 };
#define TILE 64
#define MAX_DIM 512
#define MAX_GROUP 64

/* row `index` of a pool of `d`-wide rows as fp32: a pointer into an fp32 pool, else converted into buf */
static inline const float *pool_row(const void *pool, int dtype, int64_t index, int d, float *buf) {
    if (dtype == POOL_F32) return (const float *)pool + index * d;
    const uint16_t *row = (const uint16_t *)pool + index * d;
    if (dtype == POOL_F16) {
        for (int c = 0; c < d; c++) buf[c] = kvlab_fp16_to_fp32(row[c]);
    } else {
        for (int c = 0; c < d; c++) {
            uint32_t bits = (uint32_t)row[c] << 16;
            memcpy(buf + c, &bits, sizeof bits);
        }
    }
    return buf;
}

static int check_layout(int64_t n_rows, int n_heads, int n_kv_heads, int d, int dv, int dtype, int64_t n_slots,
                        const int32_t *block_tables, int n_seqs, int max_blocks, int block_size,
                        const int32_t *query_start, const int32_t *context_len) {
    if (n_kv_heads <= 0 || n_heads % n_kv_heads || n_heads / n_kv_heads > MAX_GROUP) return -1;
    if (d <= 0 || dv <= 0 || d > MAX_DIM || dv > MAX_DIM || dtype < POOL_F32 || dtype > POOL_BF16) return -1;
    if (n_seqs < 0 || max_blocks <= 0 || block_size <= 0 || n_slots % block_size) return -1;
    if (query_start[0] != 0 || query_start[n_seqs] != n_rows) return -1;
    const int64_t n_blocks = n_slots / block_size;
    for (int s = 0; s < n_seqs; s++) {
        const int64_t n_q = (int64_t)query_start[s + 1] - query_start[s], ctx = context_len[s];
        if (n_q < 0 || n_q > ctx || ctx > (int64_t)max_blocks * block_size) return -1;
        for (int64_t b = 0; b < (ctx + block_size - 1) / block_size; b++) {
            const int32_t id = block_tables[(int64_t)s * max_blocks + b];
            if (id < 0 || id >= n_blocks) return -1;
        }
    }
    return 0;
}

/* a . b over d values: sixteen lane sums (one vector register), then a fixed tree over the lanes; a serial
 * chain of sixteen scalar adds per dot made this kernel ~5x slower at decode */
typedef float lanes16 __attribute__((vector_size(64)));

static inline float dot(const float *a, const float *b, int d) {
    lanes16 acc = {0};
    int c = 0;
    for (; c + 16 <= d; c += 16) {
        lanes16 x, y;
        memcpy(&x, a + c, sizeof x);
        memcpy(&y, b + c, sizeof y);
        acc += x * y;
    }
    acc += __builtin_shufflevector(acc, acc, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
    acc += __builtin_shufflevector(acc, acc, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
    acc += __builtin_shufflevector(acc, acc, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
    acc += __builtin_shufflevector(acc, acc, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
    float sum = acc[0];
    for (; c < d; c++) sum += a[c] * b[c];
    return sum;
}

static inline lanes16 load_lanes(const float *p) {
    lanes16 v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* og (dv,) += sum_j p[j] * v[j] (dv,) for j < n, in order of j for every column: the same sums as a plain loop,
 * but four 16-column blocks at a time held in registers across the keys instead of stored back per key */
static inline void accumulate_values(float *og, const float *p, const float *const *v, int n, int dv) {
    int c = 0;
    for (; c + 64 <= dv; c += 64) {
        lanes16 a0 = load_lanes(og + c), a1 = load_lanes(og + c + 16), a2 = load_lanes(og + c + 32), a3 = load_lanes(og + c + 48);
        for (int j = 0; j < n; j++) {
            const float pj = p[j];
            a0 += pj * load_lanes(v[j] + c);
            a1 += pj * load_lanes(v[j] + c + 16);
            a2 += pj * load_lanes(v[j] + c + 32);
            a3 += pj * load_lanes(v[j] + c + 48);
        }
        memcpy(og + c, &a0, sizeof a0);
        memcpy(og + c + 16, &a1, sizeof a1);
        memcpy(og + c + 32, &a2, sizeof a2);
        memcpy(og + c + 48, &a3, sizeof a3);
    }
    for (; c + 16 <= dv; c += 16) {
        lanes16 a = load_lanes(og + c);
        for (int j = 0; j < n; j++) a += p[j] * load_lanes(v[j] + c);
        memcpy(og + c, &a, sizeof a);
    }
    for (; c < dv; c++)
        for (int j = 0; j < n; j++) og[c] += p[j] * v[j][c];
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

int kvlab_paged_attention(const float *q, int64_t n_rows, int n_heads, int n_kv_heads, int d, int dv,
                          const void *k_pool, const void *v_pool, int dtype, int64_t n_slots,
                          const int32_t *block_tables, int n_seqs, int max_blocks, int block_size,
                          const int32_t *query_start, const int32_t *context_len,
                          float scale, int window, float *out, int n_threads) {
    if (check_layout(n_rows, n_heads, n_kv_heads, d, dv, dtype, n_slots, block_tables, n_seqs, max_blocks, block_size,
                     query_start, context_len))
        return -1;
    const int group = n_heads / n_kv_heads;
    #pragma omp parallel for schedule(dynamic, 1) num_threads(n_threads)
    for (int64_t item = 0; item < n_rows * n_kv_heads; item++) {
        const int64_t row = item / n_kv_heads;
        const int kv_head = (int)(item % n_kv_heads);
        const int s = owner(query_start, n_seqs, row);
        const int32_t *table = block_tables + (int64_t)s * max_blocks;
        const int64_t pos = context_len[s] - (query_start[s + 1] - query_start[s]) + (row - query_start[s]);
        const int64_t first = window > 0 && pos - window + 1 > 0 ? pos - window + 1 : 0;
        const float *qh = q + (row * n_heads + (int64_t)kv_head * group) * d;   /* (G, D): this KV head's queries */
        float m[MAX_GROUP], l[MAX_GROUP];                                          /* running max, sum */
        float *o = out + (row * n_heads + (int64_t)kv_head * group) * dv;       /* (G, Dv): accumulated in place */
        float score[MAX_GROUP][TILE], buf[MAX_DIM], vbuf[TILE * MAX_DIM];
        const float *vrow[TILE];
        int64_t slot[TILE];
        for (int g = 0; g < group; g++) {
            m[g] = -INFINITY;
            l[g] = 0.0f;
            memset(o + (int64_t)g * dv, 0, dv * sizeof(float));
        }
        for (int64_t t0 = first; t0 <= pos; t0 += TILE) {
            const int n = (int)(pos + 1 - t0 < TILE ? pos + 1 - t0 : TILE);
            for (int j = 0; j < n; j++) {
                const int64_t t = t0 + j;
                slot[j] = (int64_t)table[t / block_size] * block_size + t % block_size;
                const float *k = pool_row(k_pool, dtype, slot[j] * n_kv_heads + kv_head, d, buf);
                for (int g = 0; g < group; g++) score[g][j] = dot(qh + (int64_t)g * d, k, d) * scale;
            }
            for (int g = 0; g < group; g++) {
                float tile_max = score[g][0];
                for (int j = 1; j < n; j++) tile_max = score[g][j] > tile_max ? score[g][j] : tile_max;
                const float new_max = tile_max > m[g] ? tile_max : m[g];
                const float correction = expf(m[g] - new_max);      /* 0 on the first tile (m = -inf) */
                float *og = o + (int64_t)g * dv;
                if (correction != 1.0f)
                    for (int c = 0; c < dv; c++) og[c] *= correction;
                l[g] *= correction;
                for (int j = 0; j < n; j++) {
                    score[g][j] = expf(score[g][j] - new_max);
                    l[g] += score[g][j];
                }
                m[g] = new_max;
            }
            for (int j = 0; j < n; j++)
                vrow[j] = pool_row(v_pool, dtype, slot[j] * n_kv_heads + kv_head, dv, vbuf + (int64_t)j * dv);
            for (int g = 0; g < group; g++) accumulate_values(o + (int64_t)g * dv, score[g], vrow, n, dv);
        }
        for (int g = 0; g < group; g++) {
            float *og = o + (int64_t)g * dv;
            const float inv = 1.0f / l[g];
            for (int c = 0; c < dv; c++) og[c] *= inv;
        }
    }
    return 0;
}
