/* What the library's C sources share: the block GEMV's row kernels (blockgemv.c, used by decode.c for a
 * whole decode step per call), the multi-row products (blockgemm.c, q8gemm.c; used by batchstep.c) and the
 * fp16 -> fp32 conversion (blockgemv.c, intcache.c). */
#ifndef KVLAB_BLOCKGEMV_H
#define KVLAB_BLOCKGEMV_H
#include <stdint.h>
#include <string.h>
#if defined(__F16C__) || defined(__AVX2__)
#include <immintrin.h>
#endif

enum { F32 = 0, Q4_0 = 2, Q4_1 = 3, Q8_0 = 8 };   /* GGML type ids */
#define QK 32                                      /* weights per block */

/* bytes of one 32-weight block of `type` (0 for a type without blocks) */
int kvlab_block_bytes(int type);
/* A row of nb blocks, as kvlab holds it (model/blockquant.py split_rows): the GGUF blocks' bytes with their scales in
 * front, [fp16 d of every block | fp16 m of every block (Q4_1) | every block's quants], so that sixteen blocks' scales
 * are one vector load. Block b's d, m and quants (16 bytes of nibbles: weight j low, j + 16 high; Q8_0: 32 int8): */
static inline const uint8_t *kvlab_row_d(const uint8_t *row, int64_t b) { return row + 2 * b; }
static inline const uint8_t *kvlab_row_m(const uint8_t *row, int64_t nb, int64_t b) { return row + 2 * (nb + b); }
static inline const uint8_t *kvlab_row_quants(int type, const uint8_t *row, int64_t nb, int64_t b) {
    return row + (type == Q4_1 ? 4 : 2) * nb + (type == Q8_0 ? 32 : 16) * b;
}
/* sums[b] = x[32b] + ... + x[32b + 31], b < cols / 32: what the Q4_0/Q4_1 row dot needs for its offsets */
void kvlab_block_sums(const float *x, int64_t cols, float *sums);
/* one row of `nblocks` blocks . x; xsum from kvlab_block_sums (unused by Q8_0) */
float kvlab_block_row_dot(int type, const uint8_t *row, const float *x, const float *xsum, int64_t nblocks);
/* out (rows, cols) fp32 = the weights the blocks encode, exactly d * q + m; 0, or -1 for a bad type or shape */
int kvlab_block_dequantize(int type, const uint8_t *blocks, int64_t rows, int64_t cols, float *out, int n_threads);

/* Y (M, N) = X (M, K) W^T for W (N, K) as blocks of `type` (blockgemm.c; q8gemm.c with X quantized to int8 per
 * 32-block): 0, -1 for a bad type or shape, -2 without scratch memory */
int kvlab_block_gemm(int type, const uint8_t *blocks, int64_t N, int64_t K, const float *x, int64_t M, float *y,
                     int n_threads);
int kvlab_q8_gemm(int type, const uint8_t *blocks, int64_t N, int64_t K, const float *x, int64_t M, float *y,
                  int n_threads);
/* One row x (K,) with int8 activations (q8gemm.c, the row dots of a few rows): kvlab_q8_prepare writes what the row
 * dot reads of x into `prepared` (kvlab_q8_row_floats(K) floats); kvlab_q8_row_dot is one row of nb blocks . x */
int64_t kvlab_q8_row_floats(int64_t K);
void kvlab_q8_prepare(const float *x, int64_t K, float *prepared);
float kvlab_q8_row_dot(int type, const uint8_t *row, const float *prepared, int64_t nb);

#if defined(__AVX2__)
/* the sum of eight lanes by a fixed tree, ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7)): a 16-lane sum's tree
 * (halves added, four times) once its two halves are added */
static inline float kvlab_sum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
#endif

/* IEEE half -> float, exact for every bit pattern (subnormals, inf, nan): F16C when the CPU has it */
static inline float kvlab_fp16_to_fp32(uint16_t h) {
#ifdef __F16C__
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t man = h & 0x3ffu;
    uint32_t bits;
    if (exp == 0x1f) {                      /* inf / nan */
        bits = sign | 0x7f800000u | (man << 13);
    } else if (exp != 0) {                  /* normal */
        bits = sign | ((exp + 112) << 23) | (man << 13);
    } else if (man == 0) {                  /* zero */
        bits = sign;
    } else {                                /* subnormal: normalize */
        int e = -1;
        do { man <<= 1; e++; } while ((man & 0x400u) == 0);
        bits = sign | ((uint32_t)(112 - e) << 23) | ((man & 0x3ffu) << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
#endif
}
#endif
