/* Attention straight from the integer KV cache's codes (kvlab/cache/quantized.py, int8 and int4).
 *
 * Keys:   k[t][c] = zero[t/G][c] + code[t][c] * scale[t/G][c]    (fp16 scale/zero per channel per G tokens)
 * Values: v[t][c] = zero[t][c/Gv] + code[t][c] * scale[t][c/Gv]   (fp16 scale/zero per Gv channels per token)
 * int4 codes are two per byte, code 2j in the low nibble of byte j, 2j+1 in the high one; int8 one per byte.
 *
 * scores: q . k[t] = q . zero_g + (q * scale_g) . code[t]: per key group the query is folded into the
 *         group's scales once, and each key costs one dot product with its unpacked codes.
 * mix:    sum_t p[t] v[t] = sum_t (p[t] scale[t]) code[t] + sum_t p[t] zero[t], per value group.
 * Nothing is dequantized into memory: each step reads the packed bytes and the fp16 metadata only.
 * Heads (batch × KV heads) are independent and shared between OpenMP threads.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "blockgemv.h"
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
