/* The integer KV cache's packed code rows (kvlab/cache/packing.py), read and written: what intcache.c (attention over
 * int8/int4 codes) and decode.c (the fused step's integer layers, any width 1..8) share.
 *
 * A width that divides 8 (1, 2, 4, 8) packs 8/b codes per byte, low bits first: code c sits in byte c*b/8 at bit
 * (c*b) % 8. Other widths are bit planes, widest first (3 = 2 + 1, 5 = 4 + 1, 6 = 4 + 2, 7 = 4 + 2 + 1): the plane of
 * width w holds bits [s, s + w) of every code packed like a w-bit code, ceil(d*w/8) bytes, and the planes follow each
 * other in the row.
 *
 * `Quantized` describes an integer layer's codes, a single cache's or a serving pool's: decode.c codes tokens into it
 * (the fused step, kvlab_int_code_tokens) and paged.c reads and writes a pool layer of it (kvlab_int_pool_layer). */
#ifndef KVLAB_INTCODES_H
#define KVLAB_INTCODES_H
#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

typedef struct {                   /* an integer layer's codes (kvlab/cache/quantized.py QuantizedCache) */
    int32_t bits;                  /* code width, 1..8 */
    int32_t group;                 /* G: tokens per key group */
    int32_t value_group;           /* Gv: channels per value group */
    int32_t slots;                 /* coded rows per KV head */
    int64_t k_row_bytes, v_row_bytes;
    uint8_t *k_codes, *v_codes;    /* (Hkv, slots, row bytes), packed as intcodes.h reads them */
    uint16_t *k_scale, *k_zero;    /* (Hkv, ceil(slots / G), hd) f16: one per channel per key group */
    uint16_t *v_scale, *v_zero;    /* (Hkv, slots, hd / Gv) f16: one per value group per token */
    float *k_stage;                /* (stages, G, Hkv, hd) fp32: each sequence's keys of its open (incomplete) group */
    int32_t overflow_what;         /* written on a range error: 0 the keys, 1 the values ... */
    float overflow;                /* ... and the magnitude the module path names */
    /* where head g's rows lie (int_row): slot t is row o = t % block_rows of block b = t / block_rows; its codes and
     * value scales at row b * block_stride + g * head_stride + o * slot_stride, its key group's scales at
     * b * meta_block_stride + g * meta_head_stride + (o / G) * meta_group_stride rows of hd; stage row r at
     * g * stage_head_stride + r * stage_row_stride rows of hd. A single cache (Hkv, slots, ...), one block:
     * head (slots, ⌈slots/G⌉), slot and group 1, stage (G, 1); the serving pool's blocks (n_blocks, Hkv, block_rows,
     * ...), cache/blocks.py's layout: block (Hkv·block_rows, Hkv·block_rows/G), head (block_rows, block_rows/G), slot
     * and group 1, and a sequence's stage (G, Hkv, hd): (1, Hkv) */
    int64_t head_stride, slot_stride, meta_head_stride, meta_group_stride, stage_head_stride, stage_row_stride;
    int64_t block_rows, block_stride, meta_block_stride;
    int64_t stages;                /* stage rows k_stage holds: one per sequence, each (G, Hkv, hd) */
} Quantized;

/* decode.c: 1 when Q describes an integer layer of heads of d channels that C codes and reads, else 0 */
int kvlab_int_layout_ok(const Quantized *Q, int d);
/* decode.c: n tokens' K/V coded into Q (see its comment there). 0; 1 not finite; 2 beyond float16; -1 refused */
int kvlab_int_code_tokens(Quantized *Q, int Hkv, int d, int64_t n, const float *k, const float *v, int64_t kv_stride,
                          const int64_t *slots, const int64_t *positions, const int64_t *stages, int64_t stage_stride,
                          int n_threads);

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
