/* TurboQuant attention on 4-bit codebook codes (kvlab/cache/turboquant.py, `RotatedCodes` with one 4-bit part).
 *
 * A stored vector is norm * Pi^T c[code], c the 16 Lloyd-Max centroids, code two per byte (code 2j in the low
 * nibble of byte j, 2j + 1 in the high one). In the rotated domain the scores are q_rot . c[code[t]] and the
 * mix is sum_t w[t] c[code[t]]: each needs one table lookup per code, which AVX-512 does sixteen at a time with
 * one permute (the 16 centroids fit one register). Norms, offsets and the rotation stay in torch.
 */
#include <stdint.h>
#include <stdlib.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

/* dots (heads, nq, n) = q (heads, nq, d) . c[code[t]], codes (heads, slots, d / 2). Returns 0, or -1. */
int kvlab_codebook4_dots(const uint8_t *codes, int heads, int64_t slots, int64_t n, int d, const float *centroids,
                         const float *q, int nq, float *out, int n_threads) {
    if (d % 2 || n > slots) return -1;
    const int row_bytes = d / 2;
    #pragma omp parallel for schedule(static) collapse(2) num_threads(n_threads)
    for (int h = 0; h < heads; h++)
        for (int i = 0; i < nq; i++) {
            const float *qi = q + ((int64_t)h * nq + i) * d;
            float *o = out + ((int64_t)h * nq + i) * n;
            const uint8_t *rows = codes + (int64_t)h * slots * row_bytes;
#if defined(__AVX512F__)
            if (d % 32 == 0 && d <= 512) {
                /* the query's even channels (low nibbles) and odd channels (high nibbles), 16 at a time */
                float even[256], odd[256];
                for (int j = 0; j < d / 2; j++) {
                    even[j] = qi[2 * j];
                    odd[j] = qi[2 * j + 1];
                }
                const __m512 table = _mm512_loadu_ps(centroids);
                const __m512i low4 = _mm512_set1_epi32(0x0f);
                for (int64_t t = 0; t < n; t++) {
                    const uint8_t *row = rows + t * row_bytes;
                    __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
                    for (int j = 0; j < d / 2; j += 16) {
                        const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(row + j)));
                        acc0 = _mm512_fmadd_ps(_mm512_loadu_ps(even + j), _mm512_permutexvar_ps(_mm512_and_si512(b, low4), table), acc0);
                        acc1 = _mm512_fmadd_ps(_mm512_loadu_ps(odd + j), _mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), table), acc1);
                    }
                    o[t] = _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
                }
                continue;
            }
#endif
            for (int64_t t = 0; t < n; t++) {
                const uint8_t *row = rows + t * row_bytes;
                float acc = 0.0f;
                for (int j = 0; j < d / 2; j++)
                    acc += qi[2 * j] * centroids[row[j] & 0x0f] + qi[2 * j + 1] * centroids[row[j] >> 4];
                o[t] = acc;
            }
        }
    return 0;
}

/* out (heads, nq, d) = sum_t w[h, i, t] c[code[t]], codes (heads, slots, d / 2); w rows `w_stride` floats
 * apart. Returns 0, or -1. */
int kvlab_codebook4_mix(const uint8_t *codes, int heads, int64_t slots, int64_t n, int d, const float *centroids,
                        const float *w, int64_t w_stride, int nq, float *out, int n_threads) {
    if (d % 2 || n > slots) return -1;
    const int row_bytes = d / 2;
    #pragma omp parallel for schedule(static) collapse(2) num_threads(n_threads)
    for (int h = 0; h < heads; h++)
        for (int i = 0; i < nq; i++) {
            const float *wi = w + ((int64_t)h * nq + i) * w_stride;
            float *o = out + ((int64_t)h * nq + i) * d;
            const uint8_t *rows = codes + (int64_t)h * slots * row_bytes;
#if defined(__AVX512F__)
            if (d % 32 == 0) {
                const __m512 table = _mm512_loadu_ps(centroids);
                const __m512i low4 = _mm512_set1_epi32(0x0f);
                for (int j = 0; j < d / 2; j += 16) {   /* 16 bytes: 16 even and 16 odd channels */
                    __m512 even = _mm512_setzero_ps(), odd = _mm512_setzero_ps();
                    for (int64_t t = 0; t < n; t++) {
                        const __m512 wt = _mm512_set1_ps(wi[t]);
                        const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(rows + t * row_bytes + j)));
                        even = _mm512_fmadd_ps(wt, _mm512_permutexvar_ps(_mm512_and_si512(b, low4), table), even);
                        odd = _mm512_fmadd_ps(wt, _mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), table), odd);
                    }
                    float e[16], f[16];
                    _mm512_storeu_ps(e, even);
                    _mm512_storeu_ps(f, odd);
                    for (int k = 0; k < 16; k++) {
                        o[2 * (j + k)] = e[k];
                        o[2 * (j + k) + 1] = f[k];
                    }
                }
                continue;
            }
#endif
            for (int c = 0; c < d; c++) o[c] = 0.0f;
            for (int64_t t = 0; t < n; t++) {
                const uint8_t *row = rows + t * row_bytes;
                for (int j = 0; j < d / 2; j++) {
                    o[2 * j] += wi[t] * centroids[row[j] & 0x0f];
                    o[2 * j + 1] += wi[t] * centroids[row[j] >> 4];
                }
            }
        }
    return 0;
}
