/* GEMV and dequantization straight from GGUF quantized blocks (Q4_0, Q4_1, Q8_0), for kvlab.
 *
 * Block layouts (32 weights per block, little-endian, packed):
 *   Q4_0: fp16 d, 16 bytes of nibbles          weight = d * (q - 8)
 *   Q4_1: fp16 d, fp16 m, 16 bytes of nibbles  weight = d * q + m
 *   Q8_0: fp16 d, 32 int8                      weight = d * q
 * In the nibble formats byte j holds weight j in its low nibble and weight j + 16 in its high nibble.
 *
 * A matrix is `rows` rows of `cols / 32` blocks, each row with its blocks' scales in front (blockgemv.h kvlab_row_d:
 * [d of every block | m of every block (Q4_1) | every block's quants]). The GEMV keeps x in fp32 (it is not
 * quantized): y[r] = sum_b d_b * (q_b . x_b) + m_b * sum(x_b), so only the fp32 summation order differs
 * from multiplying by the dequantized matrix. Parallel over rows with OpenMP (the runtime torch uses).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "blockgemv.h"
#ifdef _OPENMP
#include <omp.h>
#endif
#ifdef __F16C__
#include <immintrin.h>
#endif

#ifndef PREFETCH_AHEAD
#define PREFETCH_AHEAD 4096
#endif
#ifndef PREFETCH_HINT
#define PREFETCH_HINT 3
#endif
/* Reading 4 KB ahead of the blocks into all cache levels: with the hardware prefetcher alone the GEMV over
 * blocks that are not in cache ran at ~2.5 GB/s per core (measured; 2-3x slower than with this), and a decode step
 * at 16 tokens of context took 1.07x as long with 2 KB as with 3-4 KB ahead (Zen 5 EPYC, 1 thread; 8 KB: 1.09x). */
#define PREFETCH(p) __builtin_prefetch((const char *)(p) + PREFETCH_AHEAD, 0, PREFETCH_HINT)
#define HALF 16

static int block_bytes(int type) {
    switch (type) {
    case Q4_0: return 2 + HALF;
    case Q4_1: return 4 + HALF;
    case Q8_0: return 2 + QK;
    default: return 0;
    }
}

/* the little-endian fp16 at p */
static inline float fp16_to_fp32(const uint8_t *p) {
    return kvlab_fp16_to_fp32((uint16_t)(p[0] | (p[1] << 8)));
}

/* sum of each 32-element block of x: (cols / 32,) */
void kvlab_block_sums(const float *x, int64_t cols, float *sums) {
    for (int64_t b = 0; b < cols / QK; b++) {
        float s = 0.0f;
        for (int j = 0; j < QK; j++) s += x[b * QK + j];
        sums[b] = s;
    }
}

/* One row . x for each format. Three versions of the same arithmetic, picked at compile time by the
 * -march the library is built with: AVX-512 (16 lanes), AVX2 (8 lanes) and plain C. Each keeps a vector of
 * per-lane partial sums: acc += d_b * (q_b . x_b), and the nibble formats add m_b * sum(x_b) at the end. */
#if defined(__AVX512F__)
#include <immintrin.h>

/* The sixteen fp16 values at p (blocks' d or m, side by side in the row) as fp32; `n` < 16 masks off blocks past
 * the row's end. One load: with the scales inside each block (the file's layout) this was a gather of sixteen
 * blocks' first words, and the GEMV ran at 0.6-0.7x this layout's speed on an AMD EPYC (bench/block_gemv.py). */
static inline __m512 load_fp16x16(const uint8_t *p, int n) {
    return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16((__mmask16)((1u << n) - 1u), p));
}

/* q_b . x_b for one nibble block as 16 fp32 lane partial sums (low nibbles . x[0:16] + high . x[16:32]) */
static inline __m512 nibble_dot(const uint8_t *qs, const float *xb) {
    const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)qs));
    const __m512 part = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_and_si512(q, _mm512_set1_epi32(0x0f))), _mm512_loadu_ps(xb));
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(q, 4)), _mm512_loadu_ps(xb + HALF), part);
}

/* q_b . x_b for one Q8_0 block as 16 fp32 lane partial sums */
static inline __m512 int8_dot(const uint8_t *qs, const float *xb) {
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)qs)));
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(qs + HALF))));
    return _mm512_fmadd_ps(hi, _mm512_loadu_ps(xb + HALF), _mm512_mul_ps(lo, _mm512_loadu_ps(xb)));
}

/* Sixteen blocks at a time: their scales are one load each (d, and m for Q4_1) and the offsets term
 * sum_b m_b * sum(x_b) is a vector FMA; each block costs one widening load, two int->float conversions and three
 * FMAs. Blocks go in pairs into two accumulators, so consecutive blocks do not wait on each other. */
static float dot_row_q4(const uint8_t *row, const float *x, const float *xsum, int64_t nblocks, int type) {
    const int has_m = type == Q4_1;
    __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps(), offsets = _mm512_setzero_ps();
    float scales[16];
    for (int64_t b0 = 0; b0 < nblocks; b0 += 16) {
        const int n = nblocks - b0 < 16 ? (int)(nblocks - b0) : 16;
        const __m512 d = load_fp16x16(kvlab_row_d(row, b0), n);
        const __m512 m = has_m ? load_fp16x16(kvlab_row_m(row, nblocks, b0), n) : _mm512_mul_ps(d, _mm512_set1_ps(-8.0f));
        offsets = _mm512_fmadd_ps(m, _mm512_maskz_loadu_ps((__mmask16)((1u << n) - 1u), xsum + b0), offsets);
        _mm512_storeu_ps(scales, d);
        const uint8_t *blk = kvlab_row_quants(type, row, nblocks, b0);
        const float *xb = x + b0 * QK;
        int j = 0;
        for (; j + 1 < n; j += 2, blk += 2 * HALF, xb += 2 * QK) {
            PREFETCH(blk);
            acc0 = _mm512_fmadd_ps(_mm512_set1_ps(scales[j]), nibble_dot(blk, xb), acc0);
            acc1 = _mm512_fmadd_ps(_mm512_set1_ps(scales[j + 1]), nibble_dot(blk + HALF, xb + QK), acc1);
        }
        if (j < n) acc0 = _mm512_fmadd_ps(_mm512_set1_ps(scales[j]), nibble_dot(blk, xb), acc0);
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1)) + _mm512_reduce_add_ps(offsets);
}

static float dot_row_q8(const uint8_t *row, const float *x, int64_t nblocks) {
    __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
    float scales[16];
    for (int64_t b0 = 0; b0 < nblocks; b0 += 16) {
        const int n = nblocks - b0 < 16 ? (int)(nblocks - b0) : 16;
        _mm512_storeu_ps(scales, load_fp16x16(kvlab_row_d(row, b0), n));
        const uint8_t *blk = kvlab_row_quants(Q8_0, row, nblocks, b0);
        const float *xb = x + b0 * QK;
        int j = 0;
        for (; j + 1 < n; j += 2, blk += 2 * QK, xb += 2 * QK) {
            PREFETCH(blk);
            acc0 = _mm512_fmadd_ps(_mm512_set1_ps(scales[j]), int8_dot(blk, xb), acc0);
            acc1 = _mm512_fmadd_ps(_mm512_set1_ps(scales[j + 1]), int8_dot(blk + QK, xb + QK), acc1);
        }
        if (j < n) acc0 = _mm512_fmadd_ps(_mm512_set1_ps(scales[j]), int8_dot(blk, xb), acc0);
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
}

#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

/* the 8 bytes at p zero- / sign-extended to eight int32 lanes (one load-and-widen instruction) */
#define U8X8_AT(p) _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p)))
#define I8X8_AT(p) _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p)))

/* q_b . x_b of one nibble block as 8 fp32 lane partial sums: bytes 0-7 and 8-15 widened once each, their low
 * nibbles (weights 0-15) and high nibbles (weights 16-31) split in the int32 lanes */
static inline __m256 nibble_dot8(const uint8_t *qs, const float *xb) {
    const __m256i low4 = _mm256_set1_epi32(0x0f);
    const __m256i a = U8X8_AT(qs), b = U8X8_AT(qs + 8);
    __m256 part = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_and_si256(a, low4)), _mm256_loadu_ps(xb));
    part = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(b, low4)), _mm256_loadu_ps(xb + 8), part);
    part = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(a, 4)), _mm256_loadu_ps(xb + 16), part);
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4)), _mm256_loadu_ps(xb + 24), part);
}

/* q_b . x_b of one Q8_0 block as 8 fp32 lane partial sums */
static inline __m256 int8_dot8(const uint8_t *qs, const float *xb) {
    __m256 part = _mm256_mul_ps(_mm256_cvtepi32_ps(I8X8_AT(qs)), _mm256_loadu_ps(xb));
    part = _mm256_fmadd_ps(_mm256_cvtepi32_ps(I8X8_AT(qs + 8)), _mm256_loadu_ps(xb + 8), part);
    part = _mm256_fmadd_ps(_mm256_cvtepi32_ps(I8X8_AT(qs + 16)), _mm256_loadu_ps(xb + 16), part);
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(I8X8_AT(qs + 24)), _mm256_loadu_ps(xb + 24), part);
}

/* n fp16 values at p -> fp32 at out: eight per conversion, the rest one by one */
static inline void fp16_row(const uint8_t *p, int64_t n, float *out) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 2 * i))));
    for (; i < n; i++) out[i] = fp16_to_fp32(p + 2 * i);
}

#define SCALE_CHUNK 64   /* blocks whose scales are converted at once */

/* A chunk of blocks at a time: its scales converted to fp32 up front (eight per instruction; one scalar conversion
 * per block, moved between register files, cost more than the block's arithmetic), the offsets term
 * sum_b m_b * sum(x_b) as a vector dot, then the blocks in pairs into two accumulators, so consecutive blocks do
 * not wait on each other. A block costs two widening loads, four int->float conversions and five FMAs:
 * ~1.4-1.75x the block-at-a-time loop's speed on an AVX2 AMD EPYC (Zen 3). */
static float dot_row_q4(const uint8_t *row, const float *x, const float *xsum, int64_t nblocks, int type) {
    const int has_m = type == Q4_1;
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    float offsets = 0.0f;
    float d[SCALE_CHUNK], m[SCALE_CHUNK];
    for (int64_t b0 = 0; b0 < nblocks; b0 += SCALE_CHUNK) {
        const int n = nblocks - b0 < SCALE_CHUNK ? (int)(nblocks - b0) : SCALE_CHUNK;
        fp16_row(kvlab_row_d(row, b0), n, d);
        if (has_m) fp16_row(kvlab_row_m(row, nblocks, b0), n, m);
        else for (int j = 0; j < n; j++) m[j] = -8.0f * d[j];
        __m256 off = _mm256_setzero_ps();
        int j = 0;
        for (; j + 8 <= n; j += 8) off = _mm256_fmadd_ps(_mm256_loadu_ps(m + j), _mm256_loadu_ps(xsum + b0 + j), off);
        offsets += kvlab_sum8(off);
        for (; j < n; j++) offsets += m[j] * xsum[b0 + j];
        const uint8_t *blk = kvlab_row_quants(type, row, nblocks, b0);
        const float *xb = x + b0 * QK;
        for (j = 0; j + 1 < n; j += 2, blk += 2 * HALF, xb += 2 * QK) {
            PREFETCH(blk);
            acc0 = _mm256_fmadd_ps(_mm256_broadcast_ss(d + j), nibble_dot8(blk, xb), acc0);
            acc1 = _mm256_fmadd_ps(_mm256_broadcast_ss(d + j + 1), nibble_dot8(blk + HALF, xb + QK), acc1);
        }
        if (j < n) acc0 = _mm256_fmadd_ps(_mm256_broadcast_ss(d + j), nibble_dot8(blk, xb), acc0);
    }
    return kvlab_sum8(_mm256_add_ps(acc0, acc1)) + offsets;
}

static float dot_row_q8(const uint8_t *row, const float *x, int64_t nblocks) {
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    float d[SCALE_CHUNK];
    for (int64_t b0 = 0; b0 < nblocks; b0 += SCALE_CHUNK) {
        const int n = nblocks - b0 < SCALE_CHUNK ? (int)(nblocks - b0) : SCALE_CHUNK;
        fp16_row(kvlab_row_d(row, b0), n, d);
        const uint8_t *blk = kvlab_row_quants(Q8_0, row, nblocks, b0);
        const float *xb = x + b0 * QK;
        int j = 0;
        for (; j + 1 < n; j += 2, blk += 2 * QK, xb += 2 * QK) {
            PREFETCH(blk);
            acc0 = _mm256_fmadd_ps(_mm256_broadcast_ss(d + j), int8_dot8(blk, xb), acc0);
            acc1 = _mm256_fmadd_ps(_mm256_broadcast_ss(d + j + 1), int8_dot8(blk + QK, xb + QK), acc1);
        }
        if (j < n) acc0 = _mm256_fmadd_ps(_mm256_broadcast_ss(d + j), int8_dot8(blk, xb), acc0);
    }
    return kvlab_sum8(_mm256_add_ps(acc0, acc1));
}

#else  /* plain C: 16 independent lanes, which compilers vectorize for whatever SIMD there is */

static float dot_row_q4(const uint8_t *row, const float *x, const float *xsum, int64_t nblocks, int type) {
    const int has_m = type == Q4_1;
    float acc[HALF] = {0};
    float offsets = 0.0f;
    for (int64_t b = 0; b < nblocks; b++) {
        const uint8_t *qs = kvlab_row_quants(type, row, nblocks, b);
        PREFETCH(qs);
        const float d = fp16_to_fp32(kvlab_row_d(row, b));
        offsets += (has_m ? fp16_to_fp32(kvlab_row_m(row, nblocks, b)) : -8.0f * d) * xsum[b];
        const float *xb = x + b * QK;
        for (int j = 0; j < HALF; j++)
            acc[j] += d * ((float)(qs[j] & 0x0f) * xb[j] + (float)(qs[j] >> 4) * xb[j + HALF]);
    }
    float total = 0.0f;
    for (int j = 0; j < HALF; j++) total += acc[j];
    return total + offsets;
}

static float dot_row_q8(const uint8_t *row, const float *x, int64_t nblocks) {
    float acc[HALF] = {0};
    for (int64_t b = 0; b < nblocks; b++) {
        const int8_t *qs = (const int8_t *)kvlab_row_quants(Q8_0, row, nblocks, b);
        PREFETCH(qs);
        const float d = fp16_to_fp32(kvlab_row_d(row, b));
        const float *xb = x + b * QK;
        for (int j = 0; j < HALF; j++)
            acc[j] += d * ((float)qs[j] * xb[j] + (float)qs[j + HALF] * xb[j + HALF]);
    }
    float total = 0.0f;
    for (int j = 0; j < HALF; j++) total += acc[j];
    return total;
}
#endif

int kvlab_block_bytes(int type) { return block_bytes(type); }

float kvlab_block_row_dot(int type, const uint8_t *row, const float *x, const float *xsum, int64_t nblocks) {
    return type == Q8_0 ? dot_row_q8(row, x, nblocks) : dot_row_q4(row, x, xsum, nblocks, type);
}

/* y (rows,) = W (rows, cols as blocks) @ x (cols,). Returns 0, or -1 for a bad type or shape. */
int kvlab_block_gemv(int type, const uint8_t *blocks, int64_t rows, int64_t cols, const float *x, float *y,
                     int n_threads) {
    const int stride = block_bytes(type);
    if (stride == 0 || cols % QK != 0 || rows < 0) return -1;
    const int64_t nblocks = cols / QK;
    const int64_t row_bytes = nblocks * stride;
    float *xsum = NULL;
    if (type != Q8_0) {
        xsum = (float *)malloc((size_t)(nblocks > 0 ? nblocks : 1) * sizeof(float));
        if (xsum == NULL) return -1;
        kvlab_block_sums(x, cols, xsum);
    }
    #pragma omp parallel for schedule(static) num_threads(n_threads) if(rows * cols >= 32768)
    for (int64_t r = 0; r < rows; r++)
        y[r] = kvlab_block_row_dot(type, blocks + r * row_bytes, x, xsum, nblocks);
    free(xsum);
    return 0;
}

/* One row of blocks -> fp32, d * q + m per weight. Bit-exact whatever the order or fusing: d has 11
 * significant bits and q at most 8, so d * q is exact in fp32 and only "+ m" rounds. */
#if defined(__AVX512F__)
/* sixteen weights per instruction, the scales of sixteen blocks from one load */
static void dequantize_row(int type, const uint8_t *row, int64_t nblocks, float *out) {
    const __m512i low4 = _mm512_set1_epi32(0x0f), eight = _mm512_set1_epi32(type == Q4_0 ? 8 : 0);
    float d16[16], m16[16];
    for (int64_t b0 = 0; b0 < nblocks; b0 += 16) {
        const int n = nblocks - b0 < 16 ? (int)(nblocks - b0) : 16;
        _mm512_storeu_ps(d16, load_fp16x16(kvlab_row_d(row, b0), n));
        _mm512_storeu_ps(m16, type == Q4_1 ? load_fp16x16(kvlab_row_m(row, nblocks, b0), n) : _mm512_setzero_ps());
        for (int j = 0; j < n; j++) {
            const uint8_t *qs = kvlab_row_quants(type, row, nblocks, b0 + j);
            float *o = out + (b0 + j) * QK;
            const __m512 d = _mm512_set1_ps(d16[j]);
            __m512i lo, hi;
            if (type == Q8_0) {
                lo = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)qs));
                hi = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(qs + HALF)));
            } else {
                const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)qs));
                lo = _mm512_sub_epi32(_mm512_and_si512(q, low4), eight);
                hi = _mm512_sub_epi32(_mm512_srli_epi32(q, 4), eight);
            }
            __m512 wlo = _mm512_mul_ps(d, _mm512_cvtepi32_ps(lo)), whi = _mm512_mul_ps(d, _mm512_cvtepi32_ps(hi));
            if (type == Q4_1) {
                wlo = _mm512_add_ps(wlo, _mm512_set1_ps(m16[j]));
                whi = _mm512_add_ps(whi, _mm512_set1_ps(m16[j]));
            }
            _mm512_storeu_ps(o, wlo);
            _mm512_storeu_ps(o + HALF, whi);
        }
    }
}
#else
static void dequantize_row(int type, const uint8_t *row, int64_t nblocks, float *out) {
    for (int64_t b = 0; b < nblocks; b++) {
        const uint8_t *qs = kvlab_row_quants(type, row, nblocks, b);
        float *o = out + b * QK;
        const float d = fp16_to_fp32(kvlab_row_d(row, b));
        if (type == Q8_0) {
            for (int j = 0; j < QK; j++) o[j] = d * (float)(int8_t)qs[j];
        } else if (type == Q4_1) {
            const float m = fp16_to_fp32(kvlab_row_m(row, nblocks, b));
            for (int j = 0; j < HALF; j++) {
                o[j] = d * (float)(qs[j] & 0x0f) + m;
                o[j + HALF] = d * (float)(qs[j] >> 4) + m;
            }
        } else {
            for (int j = 0; j < HALF; j++) {
                o[j] = d * (float)((int)(qs[j] & 0x0f) - 8);
                o[j + HALF] = d * (float)((int)(qs[j] >> 4) - 8);
            }
        }
    }
}

#endif

/* out (rows, cols) fp32 = the weights the blocks encode, computed exactly as d * q + m (bit-exact). */
int kvlab_block_dequantize(int type, const uint8_t *blocks, int64_t rows, int64_t cols, float *out, int n_threads) {
    const int stride = block_bytes(type);
    if (stride == 0 || cols % QK != 0 || rows < 0) return -1;
    const int64_t nblocks = cols / QK;
    const int64_t row_bytes = nblocks * stride;
    #pragma omp parallel for schedule(static) num_threads(n_threads) if(rows * cols >= 32768)
    for (int64_t r = 0; r < rows; r++)
        dequantize_row(type, blocks + r * row_bytes, nblocks, out + r * cols);
    return 0;
}

/* Threads in a parallel region of this library (0 without OpenMP): lets kvlab check which runtime it got. */
int kvlab_block_omp_threads(int n_threads) {
    int seen = 0;
#ifdef _OPENMP
    #pragma omp parallel num_threads(n_threads)
    {
        #pragma omp single
        seen = omp_get_num_threads();
    }
#else
    (void)n_threads;
#endif
    return seen;
}
