/* Multi-row product straight from GGUF quantized blocks (Q4_0, Q4_1, Q8_0), for kvlab.
 *
 *   Y (M, N) = X (M, K) @ W^T,   W (N, K) held as blocks (N rows of K / 32 blocks, laid out as blockgemv.h says)
 *
 * No fp32 copy of W is ever made, not even of a slab: the micro-kernel dequantizes one block of two W rows into
 * registers (the exact values d * q + m: d * q is exact in fp32, so one fused multiply-add rounds like the
 * dequantizer's multiply-then-add) and multiplies it against the same 32 columns of up to 8 rows of X, keeping
 * 2 x 8 vectors of per-lane partial sums (lanes run along k). Each dequantized block is used 8 times and each
 * loaded X vector twice; per 32 weights x 8 rows the work is 4 conversions and 32 multiply-adds, and W needs
 * no packing or transposing. At the end the 16 accumulators are summed across their lanes.
 *
 * Order: X is first packed into groups of 8 rows, block-major (the 8 rows' block b side by side), so the
 * micro-kernel reads one sequential stream. Where two groups fit in L1 (K up to 640) and there are more than 8 rows,
 * row_kernel takes one W row against 16 rows instead (each dequantized block used 16 times: ~1.2-1.4x at 16-48 rows),
 * accumulating every sum in the same order. Each thread takes a static range of W row pairs; for each group
 * (which stays in L1) it sweeps its W rows past it. Every output Y[i][j] is the sum of its own 16 lane partial
 * sums, each summed over the blocks in order, whatever thread computes it: results do not depend on the
 * thread count, and differ from dequantize-then-matmul only by the fp32 summation order.
 *
 * Measured (bench/block_gemm.py, 1 thread): 3.3x dequantize + F.linear at 2-8 rows, 1.8x at 16, 1.3x at 32,
 * 0.93x at 64 and 0.6x at 512, where torch's blocked GEMM on an fp32 copy wins; BlockQuantLinear sends
 * more than GEMM_MAX_ROWS rows there.
 *
 * One row takes the GEMV's row dot (bit for bit kvlab_block_gemv's).
 *
 * The micro-kernel is written once with GCC/Clang vector extensions (16-float vectors), which the compiler emits as
 * AVX-512 or scalar code for whatever -march the library is built with. AVX2 has its own (narrow_kernel, intrinsics):
 * one W row against four rows at a time, the same sums in the same order (1 thread, AMD EPYC Zen 3, a 3,072 x 576 Q4_1
 * matrix: 67 us a row at 4-48 rows against the GEMV's 170, where the vector-extension code took 420-1,500 us a row).
 * OpenMP: threads split the W row pairs statically.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "blockgemv.h"
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#define GROUP 8                    /* rows of X per micro-kernel call */
#define AHEAD 2                    /* W row pairs prefetched ahead of the micro-kernel */
#define FEW_ROWS 2                 /* fewer rows of X than this: the GEMV's row dot */
#define MAX_K ((int64_t)1 << 26)
#define PAIR_BYTES (40 * 1024)      /* two groups of X at most this large: one W row against both (row_kernel) */

typedef float vf16 __attribute__((vector_size(64)));
typedef int32_t vi16 __attribute__((vector_size(64)));
typedef uint8_t vu8x16 __attribute__((vector_size(16), aligned(1)));   /* loads at any address */
typedef int8_t vi8x16 __attribute__((vector_size(16), aligned(1)));
typedef float vf16_at __attribute__((vector_size(64), aligned(4)));

/* 64-byte aligned buffer of n floats (rounded up, as aligned_alloc requires), or NULL */
static float *alloc_floats(int64_t n) {
    size_t bytes = ((size_t)(n > 0 ? n : 1) * sizeof(float) + 63) & ~(size_t)63;
    return (float *)aligned_alloc(64, bytes);
}

static inline vf16 load16(const float *p) { return *(const vf16_at *)p; }   /* (a memcpy was sixteen scalar moves) */

/* the sum of the 16 lanes as a fixed tree (halves added, four times): a few shuffles, no serial chain of adds */
static inline float lane_sum(vf16 v) {
    v += __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
    v += __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
    v += __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
    v += __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
    return v[0];
}

static inline float fp16_at(const uint8_t *p) {
    return kvlab_fp16_to_fp32((uint16_t)(p[0] | (p[1] << 8)));
}

/* 16 bytes at p -> 16 int32 lanes, zero- or sign-extended (vpmovzxbd / vpmovsxbd where the CPU has AVX-512) */
static inline vi16 widen_u8(const uint8_t *p) {
#if defined(__AVX512F__)
    return (vi16)_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
#else
    return __builtin_convertvector(*(const vu8x16 *)p, vi16);
#endif
}

static inline vi16 widen_i8(const uint8_t *p) {
#if defined(__AVX512F__)
    return (vi16)_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p));
#else
    return __builtin_convertvector(*(const vi8x16 *)p, vi16);
#endif
}

/* Block b (32 weights) of a row of nblocks blocks of `type` -> lo (weights 0-15) and hi (16-31), exactly d * q + m */
static inline __attribute__((always_inline)) void block_weights(const int type, const uint8_t *row, int64_t nblocks,
                                                                int64_t b, vf16 *lo, vf16 *hi) {
    const float d = fp16_at(kvlab_row_d(row, b));
    const uint8_t *qs = kvlab_row_quants(type, row, nblocks, b);
    if (type == Q8_0) {
        *lo = d * __builtin_convertvector(widen_i8(qs), vf16);
        *hi = d * __builtin_convertvector(widen_i8(qs + 16), vf16);
        return;
    }
    const vi16 q = widen_u8(qs);
    const float m = type == Q4_1 ? fp16_at(kvlab_row_m(row, nblocks, b)) : -8.0f * d;   /* Q4_0: d * (q - 8) = d * q - 8d, both exact */
    *lo = d * __builtin_convertvector(q & 0x0f, vf16) + m;
    *hi = d * __builtin_convertvector(q >> 4, vf16) + m;
}

/* y[i * N] and y[i * N + 1] (the latter only if `two`) for the rows i < n of one packed group of X rows, xg
 * (block b of row i at xg + (b * GROUP + i) * 32): W rows w0 and w1, `nblocks` blocks each.
 * `n` is a constant in each inlined copy, so the 2n sums stay in registers. */
static inline __attribute__((always_inline)) void micro_kernel(const int type, const int n, const uint8_t *w0,
                                                              const uint8_t *w1, int64_t nblocks,
                                                              const float *xg, float *y, int64_t N, int two) {
    vf16 acc0[GROUP], acc1[GROUP];
    for (int i = 0; i < n; i++) acc0[i] = acc1[i] = (vf16){0};
    for (int64_t b = 0; b < nblocks; b++) {
        vf16 a_lo, a_hi, b_lo, b_hi;
        block_weights(type, w0, nblocks, b, &a_lo, &a_hi);
        block_weights(type, w1, nblocks, b, &b_lo, &b_hi);
        const float *xb = xg + b * GROUP * QK;
        for (int i = 0; i < n; i++) {
            const vf16 x_lo = load16(xb + i * QK), x_hi = load16(xb + i * QK + 16);
            acc0[i] += a_lo * x_lo;
            acc1[i] += b_lo * x_lo;
            acc0[i] += a_hi * x_hi;
            acc1[i] += b_hi * x_hi;
        }
    }
    for (int i = 0; i < n; i++) {
        y[i * N] = lane_sum(acc0[i]);
        if (two) y[i * N + 1] = lane_sum(acc1[i]);
    }
}

/* The group's row count as a compile-time constant, so each copy of the micro-kernel keeps its sums in registers */
static inline __attribute__((always_inline)) void group_kernel(const int type, int n, const uint8_t *w0, const uint8_t *w1,
                                                               int64_t nblocks, const float *xg,
                                                               float *y, int64_t N, int two) {
    switch (n) {
    case 8: micro_kernel(type, 8, w0, w1, nblocks, xg, y, N, two); break;
    case 7: micro_kernel(type, 7, w0, w1, nblocks, xg, y, N, two); break;
    case 6: micro_kernel(type, 6, w0, w1, nblocks, xg, y, N, two); break;
    case 5: micro_kernel(type, 5, w0, w1, nblocks, xg, y, N, two); break;
    case 4: micro_kernel(type, 4, w0, w1, nblocks, xg, y, N, two); break;
    case 3: micro_kernel(type, 3, w0, w1, nblocks, xg, y, N, two); break;
    case 2: micro_kernel(type, 2, w0, w1, nblocks, xg, y, N, two); break;
    default: micro_kernel(type, 1, w0, w1, nblocks, xg, y, N, two); break;
    }
}

/* y[i * N] for the 8 rows i of packed group xa and the rows 8 + i (i < n) of group xb, against one W row w0: each
 * dequantized block serves 8 + n rows (two W rows x 8 rows dequantize twice as often per multiply-add). Every sum is
 * accumulated exactly as micro_kernel accumulates it, so the results are the same bits. */
static inline __attribute__((always_inline)) void row_kernel(const int type, const int n, const uint8_t *w0,
                                                            int64_t nblocks, const float *xa,
                                                            const float *xb, float *y, int64_t N) {
    vf16 acc[2 * GROUP];
    for (int i = 0; i < GROUP + n; i++) acc[i] = (vf16){0};
    for (int64_t b = 0; b < nblocks; b++) {
        vf16 w_lo, w_hi;
        block_weights(type, w0, nblocks, b, &w_lo, &w_hi);
        const float *x0 = xa + b * GROUP * QK, *x1 = xb + b * GROUP * QK;
        for (int i = 0; i < GROUP; i++) {
            acc[i] += w_lo * load16(x0 + i * QK);
            acc[i] += w_hi * load16(x0 + i * QK + 16);
        }
        for (int i = 0; i < n; i++) {
            acc[GROUP + i] += w_lo * load16(x1 + i * QK);
            acc[GROUP + i] += w_hi * load16(x1 + i * QK + 16);
        }
    }
    for (int i = 0; i < GROUP + n; i++) y[i * N] = lane_sum(acc[i]);
}

/* row_kernel with the second group's row count as a compile-time constant */
static inline __attribute__((always_inline)) void two_group_kernel(const int type, int n, const uint8_t *w0,
                                                                  int64_t nblocks, const float *xa,
                                                                  const float *xb, float *y, int64_t N) {
    switch (n) {
    case 8: row_kernel(type, 8, w0, nblocks, xa, xb, y, N); break;
    case 7: row_kernel(type, 7, w0, nblocks, xa, xb, y, N); break;
    case 6: row_kernel(type, 6, w0, nblocks, xa, xb, y, N); break;
    case 5: row_kernel(type, 5, w0, nblocks, xa, xb, y, N); break;
    case 4: row_kernel(type, 4, w0, nblocks, xa, xb, y, N); break;
    case 3: row_kernel(type, 3, w0, nblocks, xa, xb, y, N); break;
    case 2: row_kernel(type, 2, w0, nblocks, xa, xb, y, N); break;
    default: row_kernel(type, 1, w0, nblocks, xa, xb, y, N); break;
    }
}

/* y[i * N] for the rows i < n (n <= NARROW) of a packed group of X rows, xg (block b of row i at xg + (b * GROUP + i) *
 * 32), against one W row w0: the micro-kernel for AVX2, in intrinsics. GCC lowers the 16-lane vector code above to
 * AVX2 through the stack (the nibbles widened byte by byte, every broadcast sixteen stores, and two W rows x 8 rows of
 * sums are 32 registers where AVX2 has 16): a product of a few rows ran 3-9x slower per row than the GEMV. Here one W
 * row meets at most four rows (8 registers of sums), each dequantized block serving them all, and every 16-lane sum is
 * two 8-lane halves accumulated exactly as micro_kernel accumulates it (lane c: + w[c] x[c], then + w[16 + c] x[16 +
 * c]; lane_sum's tree), so the results are the same bits. */
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#include <immintrin.h>
#define NARROW 4

/* block b's 32 weights as four vectors of eight (weights 0-7, 8-15, 16-23, 24-31), exactly d * q + m */
static inline __attribute__((always_inline)) void block_weights8(const int type, const uint8_t *row, int64_t nblocks,
                                                                 int64_t b, __m256 w[4]) {
    const float d = fp16_at(kvlab_row_d(row, b));
    const __m256 dv = _mm256_set1_ps(d);
    const uint8_t *qs = kvlab_row_quants(type, row, nblocks, b);
    if (type == Q8_0) {
        for (int h = 0; h < 4; h++)
            w[h] = _mm256_mul_ps(dv, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(qs + 8 * h)))));
        return;
    }
    const __m256 m = _mm256_set1_ps(type == Q4_1 ? fp16_at(kvlab_row_m(row, nblocks, b)) : -8.0f * d);
    const __m256i low4 = _mm256_set1_epi32(0x0f);
    const __m256i a = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)qs));
    const __m256i c = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(qs + 8)));
    w[0] = _mm256_fmadd_ps(dv, _mm256_cvtepi32_ps(_mm256_and_si256(a, low4)), m);
    w[1] = _mm256_fmadd_ps(dv, _mm256_cvtepi32_ps(_mm256_and_si256(c, low4)), m);
    w[2] = _mm256_fmadd_ps(dv, _mm256_cvtepi32_ps(_mm256_srli_epi32(a, 4)), m);
    w[3] = _mm256_fmadd_ps(dv, _mm256_cvtepi32_ps(_mm256_srli_epi32(c, 4)), m);
}

static inline __attribute__((always_inline)) void narrow_kernel(const int type, const int n, const uint8_t *w0,
                                                               int64_t nblocks, const float *xg, float *y, int64_t N) {
    __m256 acc[NARROW][2];
    for (int i = 0; i < n; i++) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nblocks; b++) {
        __m256 w[4];
        block_weights8(type, w0, nblocks, b, w);
        const float *xb = xg + b * GROUP * QK;
        for (int i = 0; i < n; i++) {
            const float *xi = xb + i * QK;
            acc[i][0] = _mm256_fmadd_ps(w[0], _mm256_loadu_ps(xi), acc[i][0]);
            acc[i][1] = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(xi + 8), acc[i][1]);
            acc[i][0] = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(xi + 16), acc[i][0]);
            acc[i][1] = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xi + 24), acc[i][1]);
        }
    }
    for (int i = 0; i < n; i++) y[i * N] = kvlab_sum8(_mm256_add_ps(acc[i][0], acc[i][1]));   /* lane_sum's tree */
}

/* narrow_kernel with the row count as a compile-time constant */
static inline __attribute__((always_inline)) void narrow_rows(const int type, int n, const uint8_t *w0, int64_t nblocks,
                                                             const float *xg, float *y, int64_t N) {
    switch (n) {
    case 4: narrow_kernel(type, 4, w0, nblocks, xg, y, N); break;
    case 3: narrow_kernel(type, 3, w0, nblocks, xg, y, N); break;
    case 2: narrow_kernel(type, 2, w0, nblocks, xg, y, N); break;
    default: narrow_kernel(type, 1, w0, nblocks, xg, y, N); break;
    }
}
#endif

/* X (M, K) -> groups of GROUP rows, each block-major: xp[((g * nblocks + b) * GROUP + i) * 32 + c] = X[g * GROUP + i][32b + c] */
static void pack_groups(const float *x, int64_t M, int64_t K, float *xp) {
    const int64_t nblocks = K / QK;
    for (int64_t r = 0; r < M; r++) {
        const int64_t g = r / GROUP, i = r % GROUP;
        for (int64_t b = 0; b < nblocks; b++)
            memcpy(xp + ((g * nblocks + b) * GROUP + i) * QK, x + r * K + b * QK, QK * sizeof(float));
    }
}

/* Every packed group of X against W row pairs [p0, p1): one thread's work. The group (8 rows) stays in L1 while the
 * thread sweeps its W rows past it; W streams from L2 (or beyond), 40 bytes or fewer per 32 multiply-adds. */
static void thread_rows(const int type, const uint8_t *blocks, int64_t N, int64_t K, const float *xp, int64_t M,
                        int64_t p0, int64_t p1, float *y) {
    const int64_t nblocks = K / QK, row_bytes = nblocks * kvlab_block_bytes(type);
    int64_t i = 0;
#if defined(NARROW)
    const int64_t j1 = 2 * p1 < N ? 2 * p1 : N;
    for (; i < M; i += GROUP) {   /* each group against one W row at a time, four rows of it at a time */
        const int n = M - i < GROUP ? (int)(M - i) : GROUP;
        for (int64_t j = 2 * p0; j < j1; j++) {
            if (j + 2 * AHEAD < j1)
                for (int64_t at = 0; at < row_bytes; at += 64) __builtin_prefetch(blocks + (j + 2 * AHEAD) * row_bytes + at, 0, 3);
            for (int s = 0; s < n; s += NARROW)
                narrow_rows(type, n - s < NARROW ? n - s : NARROW, blocks + j * row_bytes, nblocks, xp + i * K + s * QK,
                            y + (i + s) * N + j, N);
        }
    }
#else
    /* a full group and part or all of the next, while both stay in L1: one W row at a time (a K of 1,536 rows of
     * 96 KiB made it slower) */
    for (; M - i > GROUP && 2 * GROUP * K * (int64_t)sizeof(float) <= PAIR_BYTES; i += 2 * GROUP) {
        const int n = M - i - GROUP < GROUP ? (int)(M - i - GROUP) : GROUP;
        const int64_t j1 = 2 * p1 < N ? 2 * p1 : N;
        for (int64_t j = 2 * p0; j < j1; j++) {
            if (j + 2 * AHEAD < j1)
                for (int64_t at = 0; at < row_bytes; at += 64) __builtin_prefetch(blocks + (j + 2 * AHEAD) * row_bytes + at, 0, 3);
            two_group_kernel(type, n, blocks + j * row_bytes, nblocks, xp + i * K, xp + (i + GROUP) * K, y + i * N + j, N);
        }
    }
    for (; i < M; i += GROUP) {
        const int n = M - i < GROUP ? (int)(M - i) : GROUP;
        for (int64_t p = p0; p < p1; p++) {
            const int64_t j = 2 * p;
            const int two = j + 1 < N;
            const uint8_t *w0 = blocks + j * row_bytes, *w1 = two ? w0 + row_bytes : w0;
            if (p + AHEAD < p1)   /* the pair AHEAD pairs on: once y outgrows L2, W comes from L3 for every group */
                for (int64_t at = 0; at < 2 * row_bytes; at += 64) __builtin_prefetch(w0 + AHEAD * 2 * row_bytes + at, 0, 3);
            group_kernel(type, n, w0, w1, nblocks, xp + i * K, y + i * N + j, N, two);
        }
    }
#endif
}

/* one instantiation per block type, so the type is a constant inside the micro-kernels */
static void thread_rows_q4_0(const uint8_t *w, int64_t N, int64_t K, const float *xp, int64_t M, int64_t p0, int64_t p1,
                             float *y) { thread_rows(Q4_0, w, N, K, xp, M, p0, p1, y); }
static void thread_rows_q4_1(const uint8_t *w, int64_t N, int64_t K, const float *xp, int64_t M, int64_t p0, int64_t p1,
                             float *y) { thread_rows(Q4_1, w, N, K, xp, M, p0, p1, y); }
static void thread_rows_q8_0(const uint8_t *w, int64_t N, int64_t K, const float *xp, int64_t M, int64_t p0, int64_t p1,
                             float *y) { thread_rows(Q8_0, w, N, K, xp, M, p0, p1, y); }

/* Fewer than FEW_ROWS rows: the GEMV's row dot (blockgemv.c) for each row of X against each row of W, the W row
 * still in L1 for the next X row, so W is read once; each output equals kvlab_block_gemv's bit for bit. */
static int few_rows(int type, const uint8_t *blocks, int64_t N, int64_t K, const float *x, int64_t M, float *y,
                    int n_threads) {
    const int64_t nblocks = K / QK, row_bytes = nblocks * kvlab_block_bytes(type);
    float *xsum = alloc_floats(M * nblocks);
    if (xsum == NULL) return -2;
    for (int64_t i = 0; i < M; i++) kvlab_block_sums(x + i * K, K, xsum + i * nblocks);
    #pragma omp parallel for schedule(static) num_threads(n_threads) if(N * K >= 32768)
    for (int64_t r = 0; r < N; r++)
        for (int64_t i = 0; i < M; i++)
            y[i * N + r] = kvlab_block_row_dot(type, blocks + r * row_bytes, x + i * K, xsum + i * nblocks, nblocks);
    free(xsum);
    return 0;
}

/* Y (M, N) = X (M, K) @ W^T with W (N, K) as blocks of `type`. X and Y contiguous fp32. Returns 0, -1 for a
 * bad type or shape, -2 when scratch memory could not be had. */
int kvlab_block_gemm(int type, const uint8_t *blocks, int64_t N, int64_t K, const float *x, int64_t M, float *y,
                     int n_threads) {
    const int stride = kvlab_block_bytes(type);
    if (stride == 0 || K % QK != 0 || K <= 0 || K > MAX_K || N < 0 || M < 0) return -1;
    if (N == 0 || M == 0) return 0;
    if (M < FEW_ROWS) return few_rows(type, blocks, N, K, x, M, y, n_threads);
    if (n_threads < 1) n_threads = 1;
    void (*rows_fn)(const uint8_t *, int64_t, int64_t, const float *, int64_t, int64_t, int64_t, float *) =
        type == Q4_0 ? thread_rows_q4_0 : type == Q4_1 ? thread_rows_q4_1 : thread_rows_q8_0;
    float *xp = alloc_floats((M + GROUP - 1) / GROUP * GROUP * K);
    if (xp == NULL) return -2;
    pack_groups(x, M, K, xp);
    const int64_t pairs = (N + 1) / 2;
    #pragma omp parallel num_threads(n_threads) if(N * K * M >= 65536)
    {
        int t = 0, nt = 1;
#ifdef _OPENMP
        t = omp_get_thread_num();
        nt = omp_get_num_threads();
#endif
        const int64_t p0 = pairs * t / nt, p1 = pairs * (t + 1) / nt;
        rows_fn(blocks, N, K, xp, M, p0, p1, y);
    }
    free(xp);
    return 0;
}
