/* The integer KV cache's packed code rows (kvlab/cache/packing.py), read and written: what intcache.c (attention over
 * int8/int4 codes) and decode.c (the fused step's integer layers, any width 1..8) share.
 *
 * A width that divides 8 (1, 2, 4, 8) packs 8/b codes per byte, low bits first: code c sits in byte c*b/8 at bit
 * (c*b) % 8. Other widths are bit planes, widest first (3 = 2 + 1, 5 = 4 + 1, 6 = 4 + 2, 7 = 4 + 2 + 1): the plane of
 * width w holds bits [s, s + w) of every code packed like a w-bit code, ceil(d*w/8) bytes, and the planes follow each
 * other in the row. */
#ifndef KVLAB_INTCODES_H
#define KVLAB_INTCODES_H
#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

/* bytes of one row of d codes of `bits` bits (packing.packed_nbytes) */
static inline int64_t int_row_bytes(int bits, int d) {
    int64_t bytes = 0;
    for (int w = 8; w >= 1; w /= 2)
        if (bits & w) bytes += ((int64_t)d * w + 7) / 8;
    return bytes;
}

/* code c of a packed row of d codes */
static inline int int_code_at(const uint8_t *row, int bits, int d, int c) {
    if (bits == 8) return row[c];
    if (bits == 4) return (row[c >> 1] >> ((c & 1) * 4)) & 0x0f;
    int code = 0, shift = bits;
    int64_t offset = 0;
    for (int w = 8; w >= 1; w /= 2) {
        if (!(bits & w)) continue;
        shift -= w;
        const int64_t bit = (int64_t)c * w;
        code |= ((row[offset + bit / 8] >> (bit % 8)) & ((1 << w) - 1)) << shift;
        offset += ((int64_t)d * w + 7) / 8;
    }
    return code;
}

/* row (int_row_bytes(bits, d),) = the d codes packed (each code < 2^bits) */
static inline void int_pack_row(const uint8_t *codes, int bits, int d, uint8_t *row) {
    memset(row, 0, (size_t)int_row_bytes(bits, d));
    int shift = bits;
    int64_t offset = 0;
    for (int w = 8; w >= 1; w /= 2) {
        if (!(bits & w)) continue;
        shift -= w;
        for (int c = 0; c < d; c++) {
            const int64_t bit = (int64_t)c * w;
            row[offset + bit / 8] |= (uint8_t)(((codes[c] >> shift) & ((1 << w) - 1)) << (bit % 8));
        }
        offset += ((int64_t)d * w + 7) / 8;
    }
}
#if defined(__AVX512F__) || defined(__AVX2__)
/* codes c0 .. c0 + 15 of an int8 or int4 row (c0 even), one per byte in channel order */
static inline __m128i int_codes16(const uint8_t *row, int bits, int c0) {
    if (bits == 8) return _mm_loadu_si128((const __m128i *)(row + c0));
    const __m128i bytes = _mm_loadl_epi64((const __m128i *)(row + c0 / 2)), low4 = _mm_set1_epi8(0x0f);
    return _mm_unpacklo_epi8(_mm_and_si128(bytes, low4), _mm_and_si128(_mm_srli_epi16(bytes, 4), low4));
}
#endif

/* out (d,) = z + code * s for every code of a packed row, s and z per channel (per = 1) or per `per` consecutive
 * channels (a value group); 16 channels at a time for int8 / int4 under AVX-512 / AVX2 */
static inline void int_dequant_row(const uint8_t *row, int bits, int d, const float *s, const float *z, int per, float *out) {
    int c = 0;
#if defined(__AVX512F__) || defined(__AVX2__)
    if ((bits == 8 || bits == 4) && (per == 1 || per % 16 == 0))
        for (int k = 0; c + 16 <= d; c += 16) {   /* k: the value group of channel c (per > 1) */
            const __m128i codes = int_codes16(row, bits, c);
            k += per > 1 && c > 0 && c % per == 0;
#if defined(__AVX512F__)
            const __m512 sv = per == 1 ? _mm512_loadu_ps(s + c) : _mm512_set1_ps(s[k]);
            const __m512 zv = per == 1 ? _mm512_loadu_ps(z + c) : _mm512_set1_ps(z[k]);
            _mm512_storeu_ps(out + c, _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(codes)), sv), zv));
#else
            for (int half = 0; half < 2; half++) {
                const __m256 sv = per == 1 ? _mm256_loadu_ps(s + c + 8 * half) : _mm256_set1_ps(s[k]);
                const __m256 zv = per == 1 ? _mm256_loadu_ps(z + c + 8 * half) : _mm256_set1_ps(z[k]);
                const __m256 x = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(half ? _mm_srli_si128(codes, 8) : codes));
                _mm256_storeu_ps(out + c + 8 * half, _mm256_add_ps(_mm256_mul_ps(x, sv), zv));
            }
#endif
        }
#endif
    for (; c < d; c++) out[c] = z[c / per] + (float)int_code_at(row, bits, d, c) * s[c / per];
}
#endif
