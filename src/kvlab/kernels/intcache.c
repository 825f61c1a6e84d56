/* Attention straight from the integer KV cache's codes (kvlab/cache/quantized.py, int8 and int4).
 *
 * Keys:   k[t][c] = zero[t/G][c] + code[t][c] * scale[t/G][c]    (fp16 scale/zero per channel per G tokens)
 * Values: v[t][c] = zero[t][c/Gv] + code[t][c] * scale[t][c/Gv]   (fp16 scale/zero per Gv channels per token)
 * int4 codes are two per byte, code 2j in the low nibble of byte j, 2j+1 in the high one; int8 one per byte.
 *
 * kvlab_int_attend (intcache.h) is the one read of the codes: a block of queries, scores, softmax and mix, any
 * width 1..8, each tile of sixteen keys and values decoded once for them and read from there, so nothing is decoded
 * into memory beyond a tile; int4 queries that all read the same positions (a decode step) read the codes in
 * registers through codebook.c instead (int4_registers). The single cache (kvlab_int_attention), the fused decode
 * step (decode.c) and the serving pool (paged.c) all call it, so they agree to the bit. kvlab_int_decode decodes a span into a transient for the
 * long-chunk path (quantized.py's spans). Heads (batch × KV heads) are shared between OpenMP threads.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "blockgemv.h"
#include "codebook.h"   /* kvlab_cb_dot_rows, kvlab_cb_mix_rows: int4 rows read in registers */
#include "rowmath.h"    /* kvlab_row_dot, kvlab_row_exp_shifted */
#include "intcache.h"
#include "intcodes.h"   /* the packed rows: int_code_at, int_row_bytes */

/* out (heads, count, d) fp32 = zero + code * scale for rows [lo, lo + count) of codes (heads, slots, row bytes):
 * a span of the cache decoded into a transient (long prompts attend span by span, quantized.py). The (scale, zero)
 * of row t, channel c sit at [t / token_div][c / channel_div] of the head's (meta_rows, meta_cols) fp16 block:
 * keys token_div = G, channel_div = 1 (meta_cols = d); values token_div = 1, channel_div = Gv (meta_cols = d / Gv).
 * Returns 0, or -1 for arguments that do not describe such buffers. */
int kvlab_int_decode(int bits, const uint8_t *codes, const uint16_t *scale, const uint16_t *zero, int heads,
                     int64_t slots, int64_t meta_rows, int meta_cols, int64_t lo, int64_t count, int d, int token_div,
                     int channel_div, float *out, int n_threads) {
    if ((bits != 4 && bits != 8) || d <= 0 || (bits == 4 && d % 2) || token_div <= 0 || channel_div <= 0 ||
        d % channel_div || meta_cols != d / channel_div || lo < 0 || count < 0 || lo + count > slots ||
        (count > 0 && (lo + count - 1) / token_div >= meta_rows))
        return -1;
    const int row_bytes = (int)int_row_bytes(bits, d);
    #pragma omp parallel for schedule(static) collapse(2) num_threads(n_threads)
    for (int h = 0; h < heads; h++)
        for (int64_t i = 0; i < count; i++) {
            const int64_t t = lo + i, at = ((int64_t)h * meta_rows + t / token_div) * meta_cols;
            const uint8_t *row = codes + ((int64_t)h * slots + t) * row_bytes;
            float *o = out + ((int64_t)h * count + i) * d;
            for (int c = 0; c < d; c++) {
                const int m = c / channel_div;
                o[c] = kvlab_fp16_to_fp32(zero[at + m]) + int_code_at(row, bits, d, c) * kvlab_fp16_to_fp32(scale[at + m]);
            }
        }
    return 0;
}

/* -- one query over one KV head: what the single cache and the serving pool both read with (intcache.h) ---------- */
/* position t's slot */
static inline int64_t slot_of(const IntHead *R, int64_t t) {
    return R->table ? (int64_t)R->table[t / R->block_size] * R->block_stride + t % R->block_size : t;
}

/* position t's slot, for t walked upwards from where *left was last 0: *left counts the slots left in t's block */
static inline int64_t walk_slot(const IntHead *R, int64_t t, int64_t *slot, int64_t *left) {
    if (*left > 0) {
        (*left)--;
        return ++*slot;
    }
    if (!R->table) {
        *left = INT64_MAX;
        return *slot = t;
    }
    *left = R->block_size - 1 - t % R->block_size;
    return *slot = slot_of(R, t);
}

/* out (dpad,) = n fp16 values as floats, zero past n */
static inline void half_floats(const uint16_t *in, int n, int dpad, float *out) {
    int c = 0;
#if defined(__AVX512F__)
    for (; c + 16 <= n; c += 16) _mm512_storeu_ps(out + c, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(in + c))));
#endif
    for (; c < n; c++) out[c] = kvlab_fp16_to_fp32(in[c]);
    for (; c < dpad; c++) out[c] = 0.0f;
}

/* the lines of a head's key codes of the tile from position t (slot `at`, `left` slots after it in its block) and of
 * this tile's values (codes, scales, zeros), asked for ahead of their reads: a head's run of a block is a few KiB at
 * most, too short for the hardware prefetcher to ramp up, and a pool's blocks lie apart */
static inline void prefetch_tiles(const IntHead *R, int64_t t, int64_t at, int64_t left, int64_t hi) {
    const int64_t next = t + 16;
    if (next < hi) {
        const int64_t in_block = R->table ? R->block_size - next % R->block_size : 16;
        const int64_t n = in_block < 16 ? in_block : 16;
        kvlab_prefetch_lines(R->k_codes + slot_of(R, next) * R->k_row_stride, (hi - next < n ? hi - next : n) * R->k_row_stride);
    }
    const int64_t n = left < 15 ? left + 1 : 16, rows = hi - t < n ? hi - t : n;   /* left: INT64_MAX without a table */
    kvlab_prefetch_lines(R->v_codes + at * R->v_row_stride, rows * R->v_row_stride);
    kvlab_prefetch_lines(R->v_scale + at * R->v_meta_stride, rows * R->v_meta_stride * (int64_t)sizeof(uint16_t));
    kvlab_prefetch_lines(R->v_zero + at * R->v_meta_stride, rows * R->v_meta_stride * (int64_t)sizeof(uint16_t));
}

/* int4 read in registers, for a block of queries that all read the same positions (a decode step's query heads):
 * an int4 row is a 4-bit codebook row (codebook.h) whose table is the levels code - 7.5, so with mid = zero + 7.5 step
 *     q . (zero + code x step) = (q x step) . level + q . mid     (keys, a run inside one key group: step, mid per channel)
 *     Σ_t p_t (zero_t + code_t x step_t) = Σ_t (p_t step_t) level_t + Σ_t p_t mid_t     (values, per value group)
 * and kvlab_cb_dot_rows / kvlab_cb_mix_rows read the codes in registers (no tile of decoded keys or values). The levels
 * are centred so that neither sum is much larger than the key or value itself. Returns 0, or -1 (nothing written)
 * where the build or the shapes have no such path. */
/* s[0 .. len) = softmax of a query's scores, in place; lse (if not NULL) = their log-sum-exp */
static inline void softmax_scores(float *s, int64_t len, float *lse) {
    const float top = kvlab_row_max(s, len), sum = kvlab_row_exp_shifted(s, (int)len, top), inv = 1.0f / sum;
    for (int64_t j = 0; j < len; j++) s[j] *= inv;
    if (lse) *lse = top + logf(sum);
}

#define VALUE_RUN 64   /* value rows a mix call reads, at most */
#define INT4_MID 7.5f  /* the middle of the int4 codes: a level is code - INT4_MID */
#define INT4_LEVELS {-7.5f, -6.5f, -5.5f, -4.5f, -3.5f, -2.5f, -1.5f, -0.5f, 0.5f, 1.5f, 2.5f, 3.5f, 4.5f, 5.5f, 6.5f, 7.5f}
static int int4_registers(const IntHead *R, const IntQuery *Q, int nq, float scale, float *s) {
#if defined(__AVX512F__)
    const int dk = R->dk, dv = R->dv, G = R->key_group, gv = R->value_group, n_vg = dv / gv;
    if (R->bits != 4 || dk % 16 || dv % 16 || gv % 16 || nq > 16 || dk > KVLAB_INT_MAX_DIM || dv > KVLAB_INT_MAX_DIM) return -1;
    for (int i = 0; i < nq; i++)   /* the same positions for all, and no exact value among them */
        if (Q[i].lo != Q[0].lo || Q[i].hi != Q[0].hi || Q[i].coded != Q[0].coded || (R->exact_v && Q[i].v_coded < Q[i].hi))
            return -1;
    static const float levels[16] = INT4_LEVELS;
    cb_layout keys, values;
    const int32_t key_spec[4] = {0, dk, 4, 0}, value_spec[4] = {0, gv, 4, 0};
    if (kvlab_cb_layout(&keys, dk, 1, key_spec, levels, dk / 2) || kvlab_cb_layout(&values, gv, 1, value_spec, levels, gv / 2)) return -1;
    const int64_t lo = Q[0].lo, hi = Q[0].hi, coded = Q[0].coded < lo ? lo : Q[0].coded > hi ? hi : Q[0].coded, n = hi - lo;
    float qs[16 * KVLAB_INT_MAX_DIM], base[16], mid[KVLAB_INT_MAX_DIM];
    for (int64_t t = lo; t < coded;) {   /* keys from their codes: runs inside one key group and one block */
        const int64_t slot = slot_of(R, t), group_end = (t / G + 1) * G;
        int64_t end = group_end < coded ? group_end : coded;
        if (R->table && end - t > R->block_size - t % R->block_size) end = t + R->block_size - t % R->block_size;
        const int64_t meta = slot / G * R->k_meta_stride;
        for (int c = 0; c < dk; c += 16) {
            const __m512 st = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(R->k_scale + meta + c)));
            _mm512_storeu_ps(mid + c, _mm512_fmadd_ps(_mm512_set1_ps(INT4_MID), st,
                                                      _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(R->k_zero + meta + c)))));
            for (int i = 0; i < nq; i++) _mm512_storeu_ps(qs + i * dk + c, _mm512_mul_ps(_mm512_loadu_ps(Q[i].q + c), st));
        }
        for (int i = 0; i < nq; i++) base[i] = kvlab_row_dot(Q[i].q, mid, dk);
        const int64_t count = end - t;
        const cb_ahead ahead = {R->k_codes + slot_of(R, end < coded ? end : t) * R->k_row_stride, R->k_row_stride,
                                end < coded ? (coded - end < 16 ? coded - end : 16) : 0, NULL};
        if (kvlab_cb_dot_rows(&keys, R->k_codes + slot * R->k_row_stride, R->k_row_stride, count, qs, dk, nq, s + (t - lo), n,
                              &ahead, 1))
            return -1;   /* at the first run: nothing the caller reads has been written */
        for (int i = 0; i < nq; i++)
            for (int64_t j = 0; j < count; j++) s[i * n + t - lo + j] = (s[i * n + t - lo + j] + base[i]) * scale;
        t = end;
    }
    for (int64_t t = coded; t < hi; t++)   /* the open group's keys, exact */
        for (int i = 0; i < nq; i++)
            s[i * n + t - lo] = kvlab_row_dot(Q[i].q, R->exact + (t - R->exact_first) * R->exact_stride, dk) * scale;
    for (int i = 0; i < nq; i++) softmax_scores(s + i * n, n, Q[i].lse);
    float acc[16 * KVLAB_INT_MAX_DIM], w[16 * VALUE_RUN];
    __m512 mids[16][KVLAB_INT_MAX_DIM / 16];   /* each query's Σ p mid per value group, sixteen rows' lanes apart */
    memset(acc, 0, sizeof(float) * (size_t)(nq * dv));
    for (int i = 0; i < nq; i++)
        for (int k = 0; k < n_vg; k++) mids[i][k] = _mm512_setzero_ps();
    for (int64_t t = lo; t < hi;) {   /* values: runs of up to VALUE_RUN rows inside one block */
        const int64_t slot = slot_of(R, t);
        int64_t end = hi - t < VALUE_RUN ? hi : t + VALUE_RUN;
        if (R->table && end - t > R->block_size - t % R->block_size) end = t + R->block_size - t % R->block_size;
        const int count = (int)(end - t);
        for (int k = 0; k < n_vg; k++) {
            for (int j0 = 0; j0 < count; j0 += 16) {   /* sixteen rows' steps and mids in two vectors */
                const int m = count - j0 < 16 ? count - j0 : 16;
                uint16_t sc[16] = {0}, zr[16] = {0};
                for (int j = 0; j < m; j++) {
                    const int64_t meta = (slot + j0 + j) * R->v_meta_stride + k;
                    sc[j] = R->v_scale[meta], zr[j] = R->v_zero[meta];
                }
                const __mmask16 live = (__mmask16)((1u << m) - 1);
                const __m512 st = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)sc));
                const __m512 md = _mm512_fmadd_ps(_mm512_set1_ps(INT4_MID), st, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)zr)));
                for (int i = 0; i < nq; i++) {
                    const __m512 p = _mm512_maskz_loadu_ps(live, s + i * n + t - lo + j0);
                    _mm512_storeu_ps(w + i * VALUE_RUN + j0, _mm512_mul_ps(p, st));
                    mids[i][k] = _mm512_fmadd_ps(p, md, mids[i][k]);
                }
            }
            if (kvlab_cb_mix_rows(&values, R->v_codes + slot * R->v_row_stride + k * gv / 2, R->v_row_stride, count, w,
                                  VALUE_RUN, nq, acc + k * gv, dv))
                return -1;
        }
        t = end;
    }
    for (int i = 0; i < nq; i++)
        for (int k = 0; k < n_vg; k++) {
            const __m512 add = _mm512_set1_ps(_mm512_reduce_add_ps(mids[i][k]));
            for (int c = k * gv; c < (k + 1) * gv; c += 16)
                _mm512_storeu_ps(Q[i].out + c, _mm512_add_ps(_mm512_loadu_ps(acc + i * dv + c), add));
        }
    return 0;
#else
    (void)R, (void)Q, (void)nq, (void)scale, (void)s;
    return -1;
#endif
}

/* -- the tile read's kernels: each query's arithmetic is its own, whichever queries share a call with it ---------- */
/* the tile (keys or exact) a query reads all sixteen rows of, one way, or NULL (a partial tile, or one it reads mixed) */
static inline const float *tile_read_whole(const IntQuery *q, int64_t coded, int64_t t0, int m, const float *keys,
                                           const float *exact) {
    if (m < 16 || t0 < q->lo || t0 + 16 > q->hi) return NULL;
    return t0 + 16 <= coded ? keys : t0 >= coded ? exact : NULL;
}

/* a query's sums over eight rows, folded three rounds of kvlab_fold16's tree: lane l of row j's sum is
 * Σ_c q[c + l] row_j[c + l] over c = 0, 16, .. kpad - 16, in that order; two halves fold into sixteen scores */
static inline kvlab_lanes16 fold8(kvlab_lanes16 *a) {
    for (int width = 8; width > 1; width /= 2)
        for (int j = 0; j < width / 2; j++) a[j] = kvlab_fold16(a[2 * j], a[2 * j + 1]);
    return a[0];
}

static inline kvlab_lanes16 half_scores(const float *const *row, int kpad, const float *q) {
    kvlab_lanes16 acc[8];
    for (int j = 0; j < 8; j++) acc[j] = (kvlab_lanes16){0};
    for (int c = 0; c < kpad; c += 16) {
        const kvlab_lanes16 qc = kvlab_lanes_at(q + c);
        for (int j = 0; j < 8; j++) acc[j] += qc * kvlab_lanes_at(row[j] + c);
    }
    return fold8(acc);
}

/* the rows [*j0, *j1) of the tile of m positions from t0 that a query reads (its [lo, hi) there) */
static inline void tile_rows(const IntQuery *q, int64_t t0, int m, int *j0, int *j1) {
    *j0 = q->lo > t0 ? (int)(q->lo - t0) : 0;
    *j1 = q->hi - t0 < m ? (int)(q->hi - t0) : m;
}

/* a query's scores of sixteen rows (kvlab_fold16 of two half_scores) */
static inline kvlab_lanes16 row_scores16(const float *const *row, int kpad, const float *q) {
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
    return kvlab_scores16(q, row, kpad);   /* the same tree in AVX2 registers (rowmath.h) */
#else
    return kvlab_fold16(half_scores(row, kpad, q), half_scores(row + 8, kpad, q));
#endif
}

/* two queries' scores of a whole tile (sixteen rows kpad apart), each key row loaded once for both */
static inline void tile_scores(const float *tile, int kpad, const float *q0, const float *q1, kvlab_lanes16 out[2]) {
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
    const float *rows[16];   /* AVX2: query by query, four rows at a time (the same sums, rowmath.h kvlab_scores4) */
    for (int j = 0; j < 16; j++) rows[j] = tile + j * kpad;
    out[0] = kvlab_scores16(q0, rows, kpad);
    out[1] = kvlab_scores16(q1, rows, kpad);
#else
    kvlab_lanes16 halves[2][2];
    for (int h = 0; h < 2; h++) {
        const float *rows = tile + h * 8 * kpad;
        kvlab_lanes16 a[8], b[8];
        for (int j = 0; j < 8; j++) a[j] = b[j] = (kvlab_lanes16){0};
        for (int c = 0; c < kpad; c += 16) {
            const kvlab_lanes16 qa = kvlab_lanes_at(q0 + c), qb = kvlab_lanes_at(q1 + c);
            for (int j = 0; j < 8; j++) {
                const kvlab_lanes16 k = kvlab_lanes_at(rows + j * kpad + c);
                a[j] += qa * k;
                b[j] += qb * k;
            }
        }
        halves[0][h] = fold8(a), halves[1][h] = fold8(b);
    }
    out[0] = kvlab_fold16(halves[0][0], halves[0][1]);
    out[1] = kvlab_fold16(halves[1][0], halves[1][1]);
#endif
}

/* A tile transposed (kt[c * 16 + j] = row j's channel c, kpad channels) scores two queries with the keys in lanes:
 * lane j of A_l accumulates q[c + l] row_j[c + l] over c = 0, 16, .. as lane l of kvlab_fold16's sums of row j does,
 * and the sixteen A_l are added by the same tree (pairs of neighbours, four rounds), so the scores are the folding
 * read's to the bit, without a shuffle per query (a call with many queries: a prompt chunk's, TRANSPOSE_QUERIES) */
#define TRANSPOSE_QUERIES 8

/* the tree's first three rounds over eight lane sums A_0..A_7 (neighbours added pairwise) */
static inline kvlab_lanes16 tree8(const kvlab_lanes16 *a) {
    const kvlab_lanes16 b0 = a[0] + a[1], b1 = a[2] + a[3], b2 = a[4] + a[5], b3 = a[6] + a[7];
    return (b0 + b1) + (b2 + b3);
}

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
/* AVX2: each query and eight keys at a time in explicit registers (GCC's two-register vectors spill here): the same
 * lane sums, chained in channel order, and the same tree, so the same bits */
static inline __m256 tree8_avx2(const __m256 *a) {
    const __m256 b0 = _mm256_add_ps(a[0], a[1]), b1 = _mm256_add_ps(a[2], a[3]), b2 = _mm256_add_ps(a[4], a[5]),
                 b3 = _mm256_add_ps(a[6], a[7]);
    return _mm256_add_ps(_mm256_add_ps(b0, b1), _mm256_add_ps(b2, b3));
}

static __attribute__((noinline)) void transposed_scores(const float *kt, int kpad, const float *q0, const float *q1,
                                                        kvlab_lanes16 out[2]) {   /* apart: the decode read keeps its registers */
    const float *q[2] = {q0, q1};
    float sums[2][16];
    for (int i = 0; i < 2; i++)
        for (int keys = 0; keys < 16; keys += 8) {
            __m256 halves[2];
            for (int h = 0; h < 2; h++) {   /* lane sums l = 8h .. 8h + 7 */
                __m256 a[8];
                for (int l = 0; l < 8; l++) a[l] = _mm256_setzero_ps();
                for (int c = 0; c < kpad; c += 16)
                    for (int l = 0; l < 8; l++)
                        a[l] = _mm256_fmadd_ps(_mm256_broadcast_ss(q[i] + c + 8 * h + l),
                                               _mm256_loadu_ps(kt + (c + 8 * h + l) * 16 + keys), a[l]);
                halves[h] = tree8_avx2(a);
            }
            _mm256_storeu_ps(sums[i] + keys, _mm256_add_ps(halves[0], halves[1]));
        }
    out[0] = kvlab_lanes_at(sums[0]);
    out[1] = kvlab_lanes_at(sums[1]);
}
#else
static inline void transposed_scores(const float *kt, int kpad, const float *q0, const float *q1, kvlab_lanes16 out[2]) {
    kvlab_lanes16 halves[2][2];
    for (int h = 0; h < 2; h++) {   /* lanes sums l = 8h .. 8h + 7 */
        kvlab_lanes16 a[8], b[8];
        for (int l = 0; l < 8; l++) a[l] = b[l] = (kvlab_lanes16){0};
        for (int c = 0; c < kpad; c += 16)
            for (int l = 0; l < 8; l++) {
                const kvlab_lanes16 k = kvlab_lanes_at(kt + (c + 8 * h + l) * 16);
                a[l] += q0[c + 8 * h + l] * k;
                b[l] += q1[c + 8 * h + l] * k;
            }
        halves[0][h] = tree8(a), halves[1][h] = tree8(b);
    }
    out[0] = halves[0][0] + halves[0][1];
    out[1] = halves[1][0] + halves[1][1];
}
#endif

/* o[k] (vpad) += Σ_j w[k][j] v_j over rows [first, last), in j order, for MIX_QUERIES queries: each value row loaded
 * once for all of them (kvlab_rows_mix's sums, query by query; a zero weight adds nothing) */
#define MIX_QUERIES 4
#define MIX_VECTORS 4   /* sixteen-channel vectors of each query's sums held at a time */
static inline void rows_mix_block(float *const *o, const float w[][16], const float *const *v, int first, int last,
                                  int vpad) {
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
    /* AVX2: sixteen channels at a time (the four queries' sums in eight registers, a row's two loads shared): the same
     * sums in the same order; four vectors of two registers for four queries did not fit its sixteen registers */
    for (int c = 0; c < vpad; c += 16) {
        __m256 a[MIX_QUERIES][2];
        for (int k = 0; k < MIX_QUERIES; k++) a[k][0] = _mm256_loadu_ps(o[k] + c), a[k][1] = _mm256_loadu_ps(o[k] + c + 8);
        for (int j = first; j < last; j++) {
            const __m256 v0 = _mm256_loadu_ps(v[j] + c), v1 = _mm256_loadu_ps(v[j] + c + 8);
            for (int k = 0; k < MIX_QUERIES; k++) {
                const __m256 wk = _mm256_set1_ps(w[k][j]);
                a[k][0] = _mm256_fmadd_ps(wk, v0, a[k][0]);
                a[k][1] = _mm256_fmadd_ps(wk, v1, a[k][1]);
            }
        }
        for (int k = 0; k < MIX_QUERIES; k++) _mm256_storeu_ps(o[k] + c, a[k][0]), _mm256_storeu_ps(o[k] + c + 8, a[k][1]);
    }
#else
    for (int c = 0; c < vpad; c += 16 * MIX_VECTORS) {
        const int nv = (vpad - c) / 16 < MIX_VECTORS ? (vpad - c) / 16 : MIX_VECTORS;
        kvlab_lanes16 a[MIX_QUERIES][MIX_VECTORS];
        for (int k = 0; k < MIX_QUERIES; k++)
            for (int x = 0; x < MIX_VECTORS; x++) a[k][x] = kvlab_lanes_at(o[k] + c + 16 * (x < nv ? x : 0));
        for (int j = first; j < last; j++) {
            kvlab_lanes16 vx[MIX_VECTORS];
            for (int x = 0; x < MIX_VECTORS; x++) vx[x] = kvlab_lanes_at(v[j] + c + 16 * (x < nv ? x : 0));
            for (int k = 0; k < MIX_QUERIES; k++)
                for (int x = 0; x < MIX_VECTORS; x++) a[k][x] += w[k][j] * vx[x];
        }
        for (int k = 0; k < MIX_QUERIES; k++)
            for (int x = 0; x < nv; x++) memcpy(o[k] + c + 16 * x, &a[k][x], sizeof a[k][x]);
    }
#endif
}

/* The read of intcache.h, in tiles of sixteen positions. Each tile's keys are decoded once for every query (coded:
 * zero + code x scale per channel; exact: as given), and each query's score of a key is its sixteen lane sums folded
 * (kvlab_fold16: one tree for every key) times scale. Then each query's softmax over its positions. Each tile's values
 * are decoded once (zero + code x scale per value group), and each query adds p_t v_t to its sums in t order, over its
 * own positions only. Channels sixteen at a time, padded with zeros (0 x 0 adds nothing). Two queries that read a
 * whole tile the same way are scored together, and values are mixed MIX_QUERIES queries at a time, so that each row
 * is loaded once for several (a prompt chunk's call has up to KVLAB_INT_QUERIES): the sums are each query's own, in
 * the same order, whichever queries share its call. */
void kvlab_int_attend(const IntHead *R, const IntQuery *Q, int nq, float scale, float *scratch) {
    const int dk = R->dk, dv = R->dv, bits = R->bits, G = R->key_group, gv = R->value_group, n_vg = dv / gv;
    const int kpad = KVLAB_INT_PAD(dk), vpad = KVLAB_INT_PAD(dv);
    int64_t lo = Q[0].lo, hi = Q[0].hi, coded[KVLAB_INT_QUERIES], most_coded = 0, least_coded = INT64_MAX;
    int64_t v_coded[KVLAB_INT_QUERIES], least_v_coded = INT64_MAX;   /* values at or after v_coded: exact */
    for (int i = 0; i < nq; i++) {
        lo = Q[i].lo < lo ? Q[i].lo : lo;
        hi = Q[i].hi > hi ? Q[i].hi : hi;
        coded[i] = Q[i].coded < Q[i].lo ? Q[i].lo : Q[i].coded > Q[i].hi ? Q[i].hi : Q[i].coded;
        most_coded = coded[i] > most_coded ? coded[i] : most_coded;
        least_coded = coded[i] < Q[i].hi && coded[i] < least_coded ? coded[i] : least_coded;
        v_coded[i] = !R->exact_v ? Q[i].hi : Q[i].v_coded < Q[i].lo ? Q[i].lo : Q[i].v_coded > Q[i].hi ? Q[i].hi : Q[i].v_coded;
        least_v_coded = v_coded[i] < Q[i].hi && v_coded[i] < least_v_coded ? v_coded[i] : least_v_coded;
    }
    const int64_t n = hi - lo;
    if (int4_registers(R, Q, nq, scale, scratch) == 0) return;
    float *s = scratch, *vacc = s + nq * n, *keys = vacc + nq * vpad, *exact = keys + 16 * kpad, *none = exact + 16 * kpad;
    float *values = none + kpad;                            /* tiles: 16 rows of kpad (keys, exact) or vpad (values) */
    float *qpad = values + 16 * vpad;                         /* the queries, zeros past dk */
    float *keys_t = qpad + nq * kpad, *exact_t = keys_t + 16 * kpad;   /* the tiles transposed */
    float *exact_values = exact_t + 16 * kpad;                         /* a tile's exact values (recent window) */
    const int transposed = nq >= TRANSPOSE_QUERIES;
    for (int i = 0; i < nq; i++) {
        memcpy(qpad + i * kpad, Q[i].q, sizeof(float) * dk);
        memset(qpad + i * kpad + dk, 0, sizeof(float) * (kpad - dk));
    }
    float zero[KVLAB_INT_MAX_DIM], step[KVLAB_INT_MAX_DIM];            /* the current key group's, or a value row's */
    memset(none, 0, sizeof(float) * kpad);
    int64_t slot = 0, left = 0, next_group = lo;             /* the key group's scales are loaded at next_group */
    for (int64_t t0 = lo; t0 < hi; t0 += 16) {               /* scores */
        const int m = hi - t0 < 16 ? (int)(hi - t0) : 16;
        for (int j = 0; j < m; j++) {
            const int64_t t = t0 + j;
            if (t < most_coded) {
                const int64_t at = walk_slot(R, t, &slot, &left);
                if (j == 0) prefetch_tiles(R, t, at, left, hi);
                if (t == next_group) {
                    next_group = (t / G + 1) * G;
                    const int64_t group = at / G * R->k_meta_stride;
                    half_floats(R->k_zero + group, dk, kpad, zero);
                    half_floats(R->k_scale + group, dk, kpad, step);
                }
                float *k = keys + j * kpad;
                int_dequant_row(R->k_codes + at * R->k_row_stride, bits, dk, step, zero, 1, k);
                if (kpad > dk) memset(k + dk, 0, sizeof(float) * (kpad - dk));
            }
            if (t >= least_coded) {
                memcpy(exact + j * kpad, R->exact + (t - R->exact_first) * R->exact_stride, sizeof(float) * dk);
                memset(exact + j * kpad + dk, 0, sizeof(float) * (kpad - dk));
            }
        }
        if (transposed && m == 16) {
            if (t0 < most_coded) kvlab_transpose_tile(keys, kpad, keys_t);
            if (t0 + 16 > least_coded) kvlab_transpose_tile(exact, kpad, exact_t);
        }
        for (int i = 0; i < nq;) {
            /* a whole tile the query reads one way (most tiles): its rows straight from the tile, and so the next
             * query's too where it reads the tile the same way (their keys loaded once for both) */
            const float *same = tile_read_whole(Q + i, coded[i], t0, m, keys, exact);
            kvlab_lanes16 scores[2];
            int done = 1;
            if (same && i + 1 < nq && tile_read_whole(Q + i + 1, coded[i + 1], t0, m, keys, exact) == same) {
                if (transposed)
                    transposed_scores(same == keys ? keys_t : exact_t, kpad, qpad + i * kpad, qpad + (i + 1) * kpad, scores);
                else
                    tile_scores(same, kpad, qpad + i * kpad, qpad + (i + 1) * kpad, scores);
                done = 2;
            } else {
                const float *row[16];                       /* query i's version of each key (none: not read) */
                for (int j = 0; j < 16; j++) {
                    const int64_t t = t0 + j;
                    row[j] = same ? same + j * kpad
                           : j >= m || t < Q[i].lo || t >= Q[i].hi ? none : t < coded[i] ? keys + j * kpad : exact + j * kpad;
                }
                scores[0] = row_scores16(row, kpad, qpad + i * kpad);
            }
            for (int k = 0; k < done; k++) {
                const kvlab_lanes16 scaled = scores[k] * scale;
                if (m == 16) memcpy(s + (i + k) * n + t0 - lo, &scaled, sizeof scaled);   /* one store, not a call */
                else memcpy(s + (i + k) * n + t0 - lo, &scaled, sizeof(float) * (size_t)m);
            }
            i += done;
        }
    }
    for (int i = 0; i < nq; i++) softmax_scores(s + i * n + (Q[i].lo - lo), Q[i].hi - Q[i].lo, Q[i].lse);   /* its own positions */
    memset(vacc, 0, sizeof(float) * nq * vpad);
    left = 0;
    for (int64_t t0 = lo; t0 < hi; t0 += 16) {               /* values */
        const int m = hi - t0 < 16 ? (int)(hi - t0) : 16;
        for (int j = 0; j < m; j++) {
            const int64_t at = walk_slot(R, t0 + j, &slot, &left);
            const uint16_t *vs = R->v_scale + at * R->v_meta_stride, *vz = R->v_zero + at * R->v_meta_stride;
            float *v = values + j * vpad;
            for (int k = 0; k < n_vg; k++) zero[k] = kvlab_fp16_to_fp32(vz[k]), step[k] = kvlab_fp16_to_fp32(vs[k]);
            int_dequant_row(R->v_codes + at * R->v_row_stride, bits, dv, step, zero, gv, v);
            if (vpad > dv) memset(v + dv, 0, sizeof(float) * (vpad - dv));
        }
        const float *rows[16];
        for (int j = 0; j < m; j++) rows[j] = values + j * vpad;
        if (t0 + m > least_v_coded) {   /* some query reads some of this tile's values exact: each its own rows */
            for (int j = 0; j < m; j++)
                if (t0 + j >= least_v_coded) {
                    memcpy(exact_values + j * vpad, R->exact_v + (t0 + j - R->exact_v_first) * R->exact_v_stride,
                           sizeof(float) * dv);
                    memset(exact_values + j * vpad + dv, 0, sizeof(float) * (vpad - dv));
                }
            for (int i = 0; i < nq; i++) {
                int j0, j1;
                tile_rows(Q + i, t0, m, &j0, &j1);
                const float *mine[16];
                for (int j = j0; j < j1; j++) mine[j] = t0 + j < v_coded[i] ? values + j * vpad : exact_values + j * vpad;
                if (j1 > j0) kvlab_rows_mix(vacc + i * vpad, s + i * n + t0 - lo + j0, mine + j0, j1 - j0, vpad);
            }
            continue;
        }
        int i = 0;
        for (; i + MIX_QUERIES <= nq; i += MIX_QUERIES) {   /* MIX_QUERIES queries at a time, each over its own rows */
            float w[MIX_QUERIES][16] = {{0}};
            float *o[MIX_QUERIES];
            int first = m, last = 0;
            for (int k = 0; k < MIX_QUERIES; k++) {
                int j0, j1;
                tile_rows(Q + i + k, t0, m, &j0, &j1);
                if (j1 - j0 == 16) memcpy(w[k], s + (i + k) * n + t0 - lo, sizeof w[k]);
                else for (int j = j0; j < j1; j++) w[k][j] = s[(i + k) * n + t0 - lo + j];
                o[k] = vacc + (i + k) * vpad;
                first = j0 < first && j1 > j0 ? j0 : first;
                last = j1 > last ? j1 : last;
            }
            if (last > first) rows_mix_block(o, w, rows, first, last, vpad);
        }
        for (; i < nq; i++) {   /* the rest one by one: the same sums */
            int j0, j1;
            tile_rows(Q + i, t0, m, &j0, &j1);
            if (j1 > j0) kvlab_rows_mix(vacc + i * vpad, s + i * n + t0 - lo + j0, rows + j0, j1 - j0, vpad);
        }
    }
    for (int i = 0; i < nq; i++) memcpy(Q[i].out, vacc + i * vpad, sizeof(float) * dv);
}

/* The single cache's attention over its n compressed tokens (QuantizedCache's coded part; the sink and the recent
 * window are merged by the caller through `lse`): the G query heads of a KV head at a block of positions in one
 * kvlab_int_attend call (G <= KVLAB_INT_QUERIES). codes (heads, slots, row bytes) for heads = batch × KV heads,
 * k_scale / k_zero (heads, ceil(slots / group), dk), v_scale / v_zero (heads, slots, dv / gv) fp16; exact
 * (heads, n - exact_first, dk) fp32 the keys of positions [exact_first, n) (the open groups'); q (heads, nq, dk) with
 * nq = G × T, row g T + i the query head g of the chunk's token i, which reads positions [max(0, first_lo + i),
 * min(n, first_count + i + recent)), those of the key groups complete at first_count + i from their codes (first_count:
 * how many tokens were coded when the chunk's first token came; first_lo: the first position the model's window shows
 * it). With a recent window (recent > 0 tokens, +recentN), the positions from first_count + i on were still in the
 * window when its token came: it reads their keys and values exact, the values from exact_v (heads, n - exact_v_first,
 * dv) fp32, positions [exact_v_first, n). out (heads, nq, dv); lse (heads, nq) or NULL; a query that reads no position
 * gets zeros and lse -inf.
 * Returns 0, -1, -2 (no memory). */
int kvlab_int_attention(int bits, const uint8_t *k_codes, const uint16_t *k_scale, const uint16_t *k_zero,
                        const uint8_t *v_codes, const uint16_t *v_scale, const uint16_t *v_zero, int heads, int64_t slots,
                        int64_t n, int dk, int dv, int group, int value_group, const float *exact, int64_t exact_first,
                        const float *exact_v, int64_t exact_v_first, int recent,
                        const float *q, int nq, int T, int64_t first_count, int64_t first_lo, float attn_scale,
                        float *out, float *lse, int n_threads) {
    const int64_t first_read = first_count < 0 ? 0 : first_count > n ? n : first_count;
    if (bits < 1 || bits > 8 || group <= 0 || value_group <= 0 || dk <= 0 || dv <= 0 || dk > KVLAB_INT_MAX_DIM ||
        dv > KVLAB_INT_MAX_DIM || dv % value_group || n <= 0 || n > slots || T <= 0 || nq % T ||
        first_count > n || exact_first < 0 || exact_first > n || exact_first > first_read / group * group ||
        recent < 0 || (recent && (!exact_v || exact_v_first < 0 || exact_v_first > first_read)))
        return -1;
    const int64_t k_bytes = int_row_bytes(bits, dk), v_bytes = int_row_bytes(bits, dv), n_groups = (slots + group - 1) / group;
    const int n_vg = dv / value_group, G = nq / T, rows = G > KVLAB_INT_QUERIES ? 0 : KVLAB_INT_QUERIES / G;
    if (!rows) return -1;
    int status = 0;
    #pragma omp parallel num_threads(n_threads)
    {
        float *scratch = malloc(sizeof(float) * (size_t)kvlab_int_scratch(n, dk, dv));
        if (!scratch) {
            #pragma omp atomic write
            status = -2;
        }
        #pragma omp for schedule(static) collapse(2)
        for (int h = 0; h < heads; h++)
            for (int r0 = 0; r0 < T; r0 += rows) {
                if (!scratch) continue;
                const IntHead R = {.bits = bits, .dk = dk, .dv = dv, .key_group = group, .value_group = value_group,
                                   .k_codes = k_codes + h * slots * k_bytes, .k_row_stride = k_bytes,
                                   .v_codes = v_codes + h * slots * v_bytes, .v_row_stride = v_bytes,
                                   .k_scale = k_scale + h * n_groups * dk, .k_zero = k_zero + h * n_groups * dk, .k_meta_stride = dk,
                                   .v_scale = v_scale + h * slots * n_vg, .v_zero = v_zero + h * slots * n_vg, .v_meta_stride = n_vg,
                                   .exact = exact ? exact + h * (n - exact_first) * dk : NULL, .exact_first = exact_first, .exact_stride = dk,
                                   .exact_v = recent ? exact_v + h * (n - exact_v_first) * dv : NULL,
                                   .exact_v_first = exact_v_first, .exact_v_stride = dv};
                IntQuery Q[KVLAB_INT_QUERIES];
                int queries = 0;
                for (int i = r0; i < T && i < r0 + rows; i++)
                    for (int g = 0; g < G; g++) {
                        const int64_t row = (int64_t)h * nq + (int64_t)g * T + i, count = first_count + i;
                        const int64_t hi = count + recent < n ? count + recent : n, lo = first_lo + i > 0 ? first_lo + i : 0;
                        if (lo >= hi) {   /* nothing coded is in its sight */
                            memset(out + row * dv, 0, sizeof(float) * (size_t)dv);
                            if (lse) lse[row] = -INFINITY;
                            continue;
                        }
                        const int64_t stored = count < 0 ? 0 : count;   /* coded when its token came */
                        Q[queries++] = (IntQuery){.q = q + row * dk, .out = out + row * dv, .lo = lo,
                                                  .coded = stored / group * group, .hi = hi, .v_coded = stored,
                                                  .lse = lse ? lse + row : NULL};
                    }
                if (queries) kvlab_int_attend(&R, Q, queries, attn_scale, scratch);
            }
        free(scratch);
    }
    return status;
}
