/* Attention straight from the integer KV cache's codes (kvlab/cache/quantized.py, int8 and int4).
 *
 * Keys:   k[t][c] = zero[t/G][c] + code[t][c] * scale[t/G][c]    (fp16 scale/zero per channel per G tokens)
 * Values: v[t][c] = zero[t][c/Gv] + code[t][c] * scale[t][c/Gv]   (fp16 scale/zero per Gv channels per token)
 * int4 codes are two per byte, code 2j in the low nibble of byte j, 2j+1 in the high one; int8 one per byte.
 *
 * kvlab_int_scores, kvlab_int_mix (the reads beside sink and recent tokens):
 * scores: q . k[t] = q . zero_g + (q * scale_g) . code[t]: per key group the query is folded into the
 *         group's scales once, and each key costs one dot product with its unpacked codes.
 * mix:    sum_t p[t] v[t] = sum_t (p[t] scale[t]) code[t] + sum_t p[t] zero[t], per value group.
 * Nothing is dequantized into memory: each step reads the packed bytes and the fp16 metadata only.
 * Heads (batch × KV heads) are independent and shared between OpenMP threads.
 * kvlab_int_attend (intcache.h) is the whole read of a block of queries, scores, softmax and mix, any width 1..8,
 * each tile of sixteen keys and values decoded once for them: the single cache (kvlab_int_attention) and the serving
 * pool (paged.c) both call it, so they agree to the bit.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "blockgemv.h"
#include "rowmath.h"    /* kvlab_row_dot, kvlab_row_exp_shifted */
#include "intcache.h"
#include "intcodes.h"   /* the packed rows: int_code_at, int_row_bytes */

/* w . codes(row) over d channels. For int4, w is given split: w[0:d/2] the even channels (low nibbles),
 * w[d/2:d] the odd ones (high nibbles), matching the byte layout. */
static float code_dot(const float *w, const uint8_t *row, int bits, int d) {
#if defined(__AVX512F__)
    if (d % 32 == 0) {
        __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
        if (bits == 8) {
            for (int c = 0; c < d; c += 32) {
                acc0 = _mm512_fmadd_ps(_mm512_loadu_ps(w + c), _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(row + c)))), acc0);
                acc1 = _mm512_fmadd_ps(_mm512_loadu_ps(w + c + 16), _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(row + c + 16)))), acc1);
            }
        } else {
            const __m512i low4 = _mm512_set1_epi32(0x0f);
            for (int j = 0; j < d / 2; j += 16) {
                const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(row + j)));
                acc0 = _mm512_fmadd_ps(_mm512_loadu_ps(w + j), _mm512_cvtepi32_ps(_mm512_and_si512(q, low4)), acc0);
                acc1 = _mm512_fmadd_ps(_mm512_loadu_ps(w + d / 2 + j), _mm512_cvtepi32_ps(_mm512_srli_epi32(q, 4)), acc1);
            }
        }
        return _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
    }
#endif
    float acc[16] = {0};
    if (bits == 8) {
        for (int c = 0; c < d; c++) acc[c & 15] += w[c] * (float)row[c];
    } else {
        for (int j = 0; j < d / 2; j++) {
            acc[j & 15] += w[j] * (float)(row[j] & 0x0f);
            acc[(j + 8) & 15] += w[d / 2 + j] * (float)(row[j] >> 4);
        }
    }
    for (int width = 8; width > 0; width /= 2)
        for (int j = 0; j < width; j++) acc[j] += acc[j + width];
    return acc[0];
}

/* scores (heads, nq, n) = q (heads, nq, d) . keys(t) * attn_scale for t < n.
 * codes (heads, slots, row bytes); scale/zero (heads, ceil(slots / G), d) fp16. Returns 0, or -1. */
int kvlab_int_scores(int bits, const uint8_t *codes, const uint16_t *scale, const uint16_t *zero, int heads,
                     int64_t slots, int64_t n, int d, int group, const float *q, int nq, float attn_scale,
                     float *scores, int n_threads) {
    if ((bits != 4 && bits != 8) || group <= 0 || n > slots || d <= 0 || (bits == 4 && d % 2)) return -1;
    const int row_bytes = (int)int_row_bytes(bits, d);
    const int64_t n_groups_slots = (slots + group - 1) / group;
    int status = 0;
    #pragma omp parallel num_threads(n_threads)
    {
        float *folded = malloc(sizeof(float) * (size_t)d);
        if (folded == NULL) {
            #pragma omp atomic write
            status = -1;
        }
        #pragma omp for schedule(static) collapse(2)
        for (int h = 0; h < heads; h++)
            for (int i = 0; i < nq; i++) {
                if (folded == NULL) continue;
                const float *qi = q + ((int64_t)h * nq + i) * d;
                float *out = scores + ((int64_t)h * nq + i) * n;
                for (int64_t g0 = 0; g0 < n; g0 += group) {
                    const int64_t g = g0 / group, at = ((int64_t)h * n_groups_slots + g) * d;
                    float base = 0.0f;
                    for (int c = 0; c < d; c++) {   /* int4: even channels first, then odd (see code_dot) */
                        const int to = bits == 8 ? c : (c & 1) * (d / 2) + c / 2;
                        folded[to] = qi[c] * kvlab_fp16_to_fp32(scale[at + c]);
                        base += qi[c] * kvlab_fp16_to_fp32(zero[at + c]);
                    }
                    const int64_t end = g0 + group < n ? g0 + group : n;
                    for (int64_t t = g0; t < end; t++)
                        out[t] = (base + code_dot(folded, codes + ((int64_t)h * slots + t) * row_bytes, bits, d)) * attn_scale;
                }
            }
        free(folded);
    }
    return status;
}

/* out (gv,) = sum_t p[t] * (zero[t] + code[t][c0 + c] * scale[t]) for one value group: channels
 * [c0, c0 + gv) of every row, scale/zero read every `meta_stride` fp16 values. */
static void mix_group(int bits, const uint8_t *rows, int row_bytes, int d, const uint16_t *scale, const uint16_t *zero,
                      int meta_stride, int64_t n, int c0, int gv, const float *p, float *out) {
    float shift = 0.0f;
#if defined(__AVX512F__)
    if (gv == 32) {   /* the default group: 32 channels = 2 vectors (int8: 32 bytes; int4: 16 bytes) */
        __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
        const __m512i low4 = _mm512_set1_epi32(0x0f);
        for (int64_t t = 0; t < n; t++) {
            const __m512 w = _mm512_set1_ps(p[t] * kvlab_fp16_to_fp32(scale[t * meta_stride]));
            shift += p[t] * kvlab_fp16_to_fp32(zero[t * meta_stride]);
            if (bits == 8) {
                const uint8_t *q = rows + t * row_bytes + c0;
                acc0 = _mm512_fmadd_ps(w, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)q))), acc0);
                acc1 = _mm512_fmadd_ps(w, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(q + 16)))), acc1);
            } else {
                const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(rows + t * row_bytes + c0 / 2)));
                acc0 = _mm512_fmadd_ps(w, _mm512_cvtepi32_ps(_mm512_and_si512(q, low4)), acc0);   /* even channels */
                acc1 = _mm512_fmadd_ps(w, _mm512_cvtepi32_ps(_mm512_srli_epi32(q, 4)), acc1);     /* odd channels */
            }
        }
        float a[16], b[16];
        _mm512_storeu_ps(a, acc0);
        _mm512_storeu_ps(b, acc1);
        for (int j = 0; j < 16; j++) {
            if (bits == 8) {
                out[j] = a[j] + shift;
                out[16 + j] = b[j] + shift;
            } else {
                out[2 * j] = a[j] + shift;
                out[2 * j + 1] = b[j] + shift;
            }
        }
        return;
    }
#endif
    for (int c = 0; c < gv; c++) out[c] = 0.0f;
    for (int64_t t = 0; t < n; t++) {
        const float w = p[t] * kvlab_fp16_to_fp32(scale[t * meta_stride]);
        shift += p[t] * kvlab_fp16_to_fp32(zero[t * meta_stride]);
        const uint8_t *row = rows + t * row_bytes;
        for (int c = 0; c < gv; c++) out[c] += w * (float)int_code_at(row, bits, d, c0 + c);
    }
    for (int c = 0; c < gv; c++) out[c] += shift;
}

/* out (heads, nq, d) = sum_t p[h, i, t] * values(t) for t < n. p rows are `p_stride` floats apart.
 * codes (heads, slots, row bytes); scale/zero (heads, slots, d / gv) fp16. Returns 0, or -1. */
int kvlab_int_mix(int bits, const uint8_t *codes, const uint16_t *scale, const uint16_t *zero, int heads,
                  int64_t slots, int64_t n, int d, int gv, const float *p, int64_t p_stride, int nq, float *out,
                  int n_threads) {
    if ((bits != 4 && bits != 8) || gv <= 0 || d % gv != 0 || n > slots) return -1;
    if (bits == 4 && gv % 2 != 0) return -1;
    const int row_bytes = (int)int_row_bytes(bits, d), n_vg = d / gv;
    #pragma omp parallel for schedule(static) collapse(2) num_threads(n_threads)
    for (int h = 0; h < heads; h++)
        for (int i = 0; i < nq; i++) {
            const float *pi = p + ((int64_t)h * nq + i) * p_stride;
            float *o = out + ((int64_t)h * nq + i) * d;
            for (int k = 0; k < n_vg; k++)
                mix_group(bits, codes + (int64_t)h * slots * row_bytes, row_bytes, d, scale + (int64_t)h * slots * n_vg + k,
                          zero + (int64_t)h * slots * n_vg + k, n_vg, n, k * gv, gv, pi, o + k * gv);
        }
    return 0;
}

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
    return *slot = (int64_t)R->table[t / R->block_size] * R->block_stride + t % R->block_size;
}

/* out (dpad,) = the d codes of a packed row as floats, zero past d */
static inline void code_floats(const uint8_t *row, int bits, int d, int dpad, float *out) {
    int c = 0;
#if defined(__AVX512F__)
    if (bits == 8 || bits == 4)
        for (; c + 16 <= d; c += 16) _mm512_storeu_ps(out + c, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(int_codes16(row, bits, c))));
#elif defined(__AVX2__)
    if (bits == 8 || bits == 4)
        for (; c + 16 <= d; c += 16) {
            const __m128i codes = int_codes16(row, bits, c);
            _mm256_storeu_ps(out + c, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(codes)));
            _mm256_storeu_ps(out + c + 8, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(codes, 8))));
        }
#endif
    for (; c < d; c++) out[c] = (float)int_code_at(row, bits, d, c);
    for (; c < dpad; c++) out[c] = 0.0f;
}

/* out (dpad,) = n fp16 values as floats, zero past n */
static inline void half_floats(const uint16_t *in, int n, int dpad, float *out) {
    int c = 0;
    for (; c < n; c++) out[c] = kvlab_fp16_to_fp32(in[c]);
    for (; c < dpad; c++) out[c] = 0.0f;
}

/* The read of intcache.h, in tiles of sixteen positions. Each tile's keys are decoded once for every query (coded:
 * zero + code x scale per channel; exact: as given), and each query's score of a key is its sixteen lane sums folded
 * (kvlab_fold16: one tree for every key) times scale. Then each query's softmax over its positions. Each tile's values
 * are decoded once (zero + code x scale per value group), and each query adds p_t v_t to its sums in t order, over its
 * own positions only. Channels sixteen at a time, padded with zeros (0 x 0 adds nothing). */
void kvlab_int_attend(const IntHead *R, const IntQuery *Q, int nq, float scale, float *scratch) {
    const int dk = R->dk, dv = R->dv, bits = R->bits, G = R->key_group, gv = R->value_group, n_vg = dv / gv;
    const int kpad = KVLAB_INT_PAD(dk), vpad = KVLAB_INT_PAD(dv);
    int64_t lo = Q[0].lo, hi = Q[0].hi, coded[KVLAB_INT_QUERIES], most_coded = 0, least_coded = INT64_MAX;
    for (int i = 0; i < nq; i++) {
        lo = Q[i].lo < lo ? Q[i].lo : lo;
        hi = Q[i].hi > hi ? Q[i].hi : hi;
        coded[i] = Q[i].coded < Q[i].lo ? Q[i].lo : Q[i].coded > Q[i].hi ? Q[i].hi : Q[i].coded;
        most_coded = coded[i] > most_coded ? coded[i] : most_coded;
        least_coded = coded[i] < Q[i].hi && coded[i] < least_coded ? coded[i] : least_coded;
    }
    const int64_t n = hi - lo;
    float *s = scratch, *vacc = s + nq * n, *keys = vacc + nq * vpad, *exact = keys + 16 * kpad, *none = exact + 16 * kpad;
    float *values = none + kpad;                            /* tiles: 16 rows of kpad (keys, exact) or vpad (values) */
    float zero[KVLAB_INT_MAX_DIM], step[KVLAB_INT_MAX_DIM];            /* the current key group's, or a value row's */
    memset(none, 0, sizeof(float) * kpad);
    int64_t slot = 0, left = 0;
    for (int64_t t0 = lo; t0 < hi; t0 += 16) {               /* scores */
        const int m = hi - t0 < 16 ? (int)(hi - t0) : 16;
        for (int j = 0; j < m; j++) {
            const int64_t t = t0 + j;
            if (t < most_coded) {
                const int64_t at = walk_slot(R, t, &slot, &left);
                if (t == lo || t % G == 0) {
                    const int64_t group = at / G * R->k_meta_stride;
                    half_floats(R->k_zero + group, dk, kpad, zero);
                    half_floats(R->k_scale + group, dk, kpad, step);
                }
                float *k = keys + j * kpad;
                code_floats(R->k_codes + at * R->k_row_stride, bits, dk, kpad, k);
                for (int c = 0; c < kpad; c++) k[c] = zero[c] + k[c] * step[c];
            }
            if (t >= least_coded) {
                memcpy(exact + j * kpad, R->exact + (t - R->exact_first) * R->exact_stride, sizeof(float) * dk);
                memset(exact + j * kpad + dk, 0, sizeof(float) * (kpad - dk));
            }
        }
        for (int i = 0; i < nq; i++) {
            const float *row[16];                           /* query i's version of each key (none: not read) */
            for (int j = 0; j < 16; j++) {
                const int64_t t = t0 + j;
                row[j] = j >= m || t < Q[i].lo || t >= Q[i].hi ? none : t < coded[i] ? keys + j * kpad : exact + j * kpad;
            }
            kvlab_lanes16 acc[16];
            for (int j = 0; j < 16; j++) acc[j] = (kvlab_lanes16){0};
            for (int c = 0; c < kpad; c += 16) {
                const kvlab_lanes16 qc = kvlab_lanes_at_partial(Q[i].q, c, dk);
                for (int j = 0; j < 16; j++) acc[j] += qc * kvlab_lanes_at(row[j] + c);
            }
            for (int width = 16; width > 1; width /= 2)
                for (int j = 0; j < width / 2; j++) acc[j] = kvlab_fold16(acc[2 * j], acc[2 * j + 1]);
            for (int j = 0; j < m; j++) s[i * n + t0 - lo + j] = acc[0][j] * scale;
        }
    }
    for (int i = 0; i < nq; i++) {                          /* softmax over the query's own positions */
        float *si = s + i * n + (Q[i].lo - lo), top = si[0];
        const int64_t len = Q[i].hi - Q[i].lo;
        for (int64_t j = 1; j < len; j++) top = si[j] > top ? si[j] : top;
        const float inv = 1.0f / kvlab_row_exp_shifted(si, (int)len, top);
        for (int64_t j = 0; j < len; j++) si[j] *= inv;
    }
    memset(vacc, 0, sizeof(float) * nq * vpad);
    left = 0;
    for (int64_t t0 = lo; t0 < hi; t0 += 16) {               /* values */
        const int m = hi - t0 < 16 ? (int)(hi - t0) : 16;
        for (int j = 0; j < m; j++) {
            const int64_t at = walk_slot(R, t0 + j, &slot, &left);
            const uint16_t *vs = R->v_scale + at * R->v_meta_stride, *vz = R->v_zero + at * R->v_meta_stride;
            float *v = values + j * vpad;
            code_floats(R->v_codes + at * R->v_row_stride, bits, dv, vpad, v);
            for (int k = 0; k < n_vg; k++) {
                const float z = kvlab_fp16_to_fp32(vz[k]), sc = kvlab_fp16_to_fp32(vs[k]);
                for (int c = k * gv; c < (k + 1) * gv; c++) v[c] = z + v[c] * sc;
            }
        }
        for (int i = 0; i < nq; i++) {
            const int j0 = Q[i].lo > t0 ? (int)(Q[i].lo - t0) : 0, j1 = Q[i].hi - t0 < m ? (int)(Q[i].hi - t0) : m;
            const float *p = s + i * n + t0 - lo;
            for (int c = 0; c < vpad; c += 16) {
                kvlab_lanes16 a = kvlab_lanes_at(vacc + i * vpad + c);
                for (int j = j0; j < j1; j++) a += p[j] * kvlab_lanes_at(values + j * vpad + c);
                memcpy(vacc + i * vpad + c, &a, sizeof a);
            }
        }
    }
    for (int i = 0; i < nq; i++) memcpy(Q[i].out, vacc + i * vpad, sizeof(float) * dv);
}

/* The single cache's attention over its n compressed tokens (QuantizedCache without sink or recent tokens): the G
 * query heads of a KV head at a block of positions in one kvlab_int_attend call (G <= KVLAB_INT_QUERIES). codes (heads, slots, row bytes) for heads =
 * batch × KV heads, k_scale / k_zero (heads, ceil(slots / group), dk), v_scale / v_zero (heads, slots, dv / gv) fp16;
 * exact (heads, n - exact_first, dk) fp32 the keys of positions [exact_first, n) (the open groups'); q (heads, nq, dk)
 * with nq = G × T, row g T + i the query head g of the token at position n - T + i; window > 0: the query at p sees
 * positions > p - window. out (heads, nq, dv). Returns 0, -1, -2 (no memory). */
int kvlab_int_attention(int bits, const uint8_t *k_codes, const uint16_t *k_scale, const uint16_t *k_zero,
                        const uint8_t *v_codes, const uint16_t *v_scale, const uint16_t *v_zero, int heads, int64_t slots,
                        int64_t n, int dk, int dv, int group, int value_group, const float *exact, int64_t exact_first,
                        const float *q, int nq, int T, int window, float attn_scale, float *out, int n_threads) {
    if (bits < 1 || bits > 8 || group <= 0 || value_group <= 0 || dk <= 0 || dv <= 0 || dk > KVLAB_INT_MAX_DIM ||
        dv > KVLAB_INT_MAX_DIM || dv % value_group || n <= 0 || n > slots || T <= 0 || T > n || nq % T ||
        exact_first < 0 || exact_first > n || exact_first > (n - T + 1) / group * group)
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
                                   .exact = exact ? exact + h * (n - exact_first) * dk : NULL, .exact_first = exact_first, .exact_stride = dk};
                IntQuery Q[KVLAB_INT_QUERIES];
                int count = 0;
                for (int i = r0; i < T && i < r0 + rows; i++)
                    for (int g = 0; g < G; g++) {
                        const int64_t row = (int64_t)h * nq + (int64_t)g * T + i;
                        Q[count++] = kvlab_int_query(q + row * dk, out + row * dv, n - T + i, window, group);
                    }
                kvlab_int_attend(&R, Q, count, attn_scale, scratch);
            }
        free(scratch);
    }
    return status;
}
