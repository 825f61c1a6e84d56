/* Multi-row product straight from GGUF quantized blocks (Q4_0, Q4_1, Q8_0), for kvlab.
 *
 *   Y (M, N) = X (M, K) @ W^T,   W (N, K) held as blocks (N rows of K / 32 blocks, see blockgemv.c)
 *
 * No fp32 copy of W is ever made whole: each thread dequantizes a slab of W's rows (at most SLAB_BYTES of
 * fp32, so it stays in L2) with the library's own dequantizer (kvlab_block_dequantize: the exact values
 * d * q + m), and multiplies every row of X against it. X is first packed into panels of 32 rows stored
 * k-major (xp[k][0..31], zero rows past M), so the micro-kernel reads 32 rows of X for one k as two vectors.
 *
 * Micro-kernel: 8 rows of W x 32 rows of X over a slice of KC values of k. For each k it broadcasts W[j][k]
 * (j < 8) and does 16 FMAs into 16 accumulators (AVX-512; AVX2 and plain C do the same sums in smaller
 * pieces). Every output Y[i][j] is the same fp32 sum whatever thread or tile computes it: the in-order sum
 * of each KC slice of k, the slices added in order. Results do not depend on the thread count, and differ
 * from dequantize-then-matmul only by the fp32 summation order.
 *
 * Fewer than FEW_ROWS rows (a decode step for a few sequences) take the GEMV's row dots instead, reading each
 * W row once for all of them: each output then equals kvlab_block_gemv's for that row, bit for bit.
 *
 * OpenMP: thread t takes a contiguous range of 8-row W tiles, dequantizes them a slab at a time, and for
 * each slab walks all X panels (each panel reused across the slab's tiles while it sits in L1/L2).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "blockgemv.h"
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

#define PANEL 32                   /* rows of X per packed panel */
#define TILE 8                     /* rows of W per micro-kernel call */
#define SLAB_BYTES (512 * 1024)    /* fp32 bytes of dequantized W a thread holds at once */
#define FEW_ROWS 8                 /* fewer rows of X than this: the GEMV's row dots (a 32-row panel would be mostly padding) */
#define MAX_K ((int64_t)1 << 26)   /* the gathers' int32 offsets (up to 15 K) must not overflow */
#define KC 128                     /* k per micro-kernel call: 32 x 128 floats of X stay in L1 */

/* 64-byte aligned buffer of n floats (rounded up, as aligned_alloc requires), or NULL */
static float *alloc_floats(int64_t n) {
    size_t bytes = ((size_t)(n > 0 ? n : 1) * sizeof(float) + 63) & ~(size_t)63;
    return (float *)aligned_alloc(64, bytes);
}

/* xp[k * 32 + l] = x[(row0 + l) * K + k] for l < rows (<= 32), 0 for the padding rows */
static void pack_panel(const float *x, int64_t K, int64_t row0, int rows, float *xp) {
#if defined(__AVX512F__)
    /* two 16-row gathers per k (masked past `rows`): sequential writes, 32 read streams */
    const __m512i at = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                          _mm512_set1_epi32((int)K));
    const __mmask16 live0 = (__mmask16)(rows >= 16 ? 0xffffu : (1u << rows) - 1u);
    const __mmask16 live1 = (__mmask16)(rows <= 16 ? 0u : rows >= 32 ? 0xffffu : (1u << (rows - 16)) - 1u);
    const float *base = x + row0 * K;
    for (int64_t k = 0; k < K; k++) {
        _mm512_store_ps(xp + k * PANEL, _mm512_mask_i32gather_ps(_mm512_setzero_ps(), live0, at, base + k, 4));
        _mm512_store_ps(xp + k * PANEL + 16, _mm512_mask_i32gather_ps(_mm512_setzero_ps(), live1, at, base + 16 * K + k, 4));
    }
#else
    const float *src[PANEL];
    for (int l = 0; l < PANEL; l++) src[l] = x + (row0 + (l < rows ? l : 0)) * K;
    for (int64_t k = 0; k < K; k++) {          /* sequential writes; 32 read streams, each line read 16 times */
        float *dst = xp + k * PANEL;
        for (int l = 0; l < PANEL; l++) dst[l] = l < rows ? src[l][k] : 0.0f;
    }
#endif
}

/* One tile of W: rows [r0, r0 + rows) dequantized exactly (rows <= 8) into `rowwise` (8, K), then stored
 * k-major as wp[k * 8 + j], zero for j >= rows. */
static void pack_tile(int type, const uint8_t *blocks, int64_t row_bytes, int64_t r0, int rows, int64_t K,
                      float *rowwise, float *wp) {
    kvlab_block_dequantize(type, blocks + r0 * row_bytes, rows, K, rowwise, 1);
    if (rows < TILE) memset(rowwise + rows * K, 0, (size_t)(TILE - rows) * K * sizeof(float));
#if defined(__AVX2__)
    const __m256i at = _mm256_mullo_epi32(_mm256_set_epi32(7, 6, 5, 4, 3, 2, 1, 0), _mm256_set1_epi32((int)K));
    for (int64_t k = 0; k < K; k++) _mm256_store_ps(wp + k * TILE, _mm256_i32gather_ps(rowwise + k, at, 4));
#else
    for (int64_t k = 0; k < K; k++)
        for (int j = 0; j < TILE; j++) wp[k * TILE + j] = rowwise[j * K + k];
#endif
}

/* acc[j][l] += (sum_k w[k * 8 + j] * xp[k * 32 + l] over k < kc, in order) for j < 8, l < 32: one packed W tile
 * against one packed X panel (two sequential streams). Each KC slice is summed on its own and then added, so an
 * output is a sum of K / KC slice sums (rounding error ~ KC + K / KC terms, not K). acc is (8, 32). */
#if defined(__AVX512F__)
static void micro_kernel(const float *w, const float *xp, int64_t kc, float *acc_io) {
    __m512 acc[TILE][2];
    for (int j = 0; j < TILE; j++) acc[j][0] = acc[j][1] = _mm512_setzero_ps();
    for (int64_t k = 0; k < kc; k++) {
        const __m512 x0 = _mm512_load_ps(xp + k * PANEL), x1 = _mm512_load_ps(xp + k * PANEL + 16);
        for (int j = 0; j < TILE; j++) {
            const __m512 wj = _mm512_set1_ps(w[k * TILE + j]);
            acc[j][0] = _mm512_fmadd_ps(wj, x0, acc[j][0]);
            acc[j][1] = _mm512_fmadd_ps(wj, x1, acc[j][1]);
        }
    }
    for (int j = 0; j < TILE; j++) {
        _mm512_store_ps(acc_io + j * PANEL, _mm512_add_ps(_mm512_load_ps(acc_io + j * PANEL), acc[j][0]));
        _mm512_store_ps(acc_io + j * PANEL + 16, _mm512_add_ps(_mm512_load_ps(acc_io + j * PANEL + 16), acc[j][1]));
    }
}
#elif defined(__AVX2__) && defined(__FMA__)
/* 16 registers: 4 W rows x 16 X rows (8 accumulators) per pass, four passes */
static void micro_kernel(const float *w, const float *xp, int64_t kc, float *acc_io) {
    for (int jg = 0; jg < TILE; jg += 4) {
        for (int h = 0; h < PANEL; h += 16) {
            __m256 acc[4][2];
            for (int j = 0; j < 4; j++) acc[j][0] = acc[j][1] = _mm256_setzero_ps();
            for (int64_t k = 0; k < kc; k++) {
                const __m256 x0 = _mm256_load_ps(xp + k * PANEL + h), x1 = _mm256_load_ps(xp + k * PANEL + h + 8);
                for (int j = 0; j < 4; j++) {
                    const __m256 wj = _mm256_set1_ps(w[k * TILE + jg + j]);
                    acc[j][0] = _mm256_fmadd_ps(wj, x0, acc[j][0]);
                    acc[j][1] = _mm256_fmadd_ps(wj, x1, acc[j][1]);
                }
            }
            for (int j = 0; j < 4; j++) {
                float *out = acc_io + (jg + j) * PANEL + h;
                _mm256_store_ps(out, _mm256_add_ps(_mm256_load_ps(out), acc[j][0]));
                _mm256_store_ps(out + 8, _mm256_add_ps(_mm256_load_ps(out + 8), acc[j][1]));
            }
        }
    }
}
#else
static void micro_kernel(const float *w, const float *xp, int64_t kc, float *acc_io) {
    for (int j = 0; j < TILE; j++) {
        float acc[PANEL] = {0};
        for (int64_t k = 0; k < kc; k++) {
            const float wj = w[k * TILE + j];
            for (int l = 0; l < PANEL; l++) acc[l] += wj * xp[k * PANEL + l];
        }
        for (int l = 0; l < PANEL; l++) acc_io[j * PANEL + l] += acc[l];
    }
}
#endif

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
    const int64_t row_bytes = K / QK * stride;
    const int64_t n_panels = (M + PANEL - 1) / PANEL, n_tiles = (N + TILE - 1) / TILE;
    int64_t slab_tiles = SLAB_BYTES / ((int64_t)sizeof(float) * K * TILE);
    if (slab_tiles < 1) slab_tiles = 1;
    if (n_threads < 1) n_threads = 1;

    float *xp = alloc_floats(n_panels * PANEL * K);
    if (xp == NULL) return -2;
    int failed = 0;
    #pragma omp parallel num_threads(n_threads)
    {
        int t = 0, nt = 1;
#ifdef _OPENMP
        t = omp_get_thread_num();
        nt = omp_get_num_threads();
#endif
        #pragma omp for schedule(static)
        for (int64_t p = 0; p < n_panels; p++) {
            const int rows = M - p * PANEL < PANEL ? (int)(M - p * PANEL) : PANEL;
            pack_panel(x, K, p * PANEL, rows, xp + p * PANEL * K);
        }   /* implicit barrier: every panel is packed before any thread multiplies */

        const int64_t tile0 = n_tiles * t / nt, tile1 = n_tiles * (t + 1) / nt;
        /* per thread: slab_tiles packed W tiles, one row-major tile, and a (8, 32) accumulator per slab tile */
        float *slab = tile1 > tile0 ? alloc_floats((slab_tiles + 1) * TILE * K + slab_tiles * TILE * PANEL) : NULL;
        if (tile1 > tile0 && slab == NULL) {
            #pragma omp atomic write
            failed = 1;
        }
        for (int64_t s = tile0; slab != NULL && s < tile1; s += slab_tiles) {
            const int64_t s_end = s + slab_tiles < tile1 ? s + slab_tiles : tile1;
            float *rowwise = slab + slab_tiles * TILE * K, *accs = rowwise + TILE * K;
            for (int64_t tile = s; tile < s_end; tile++) {
                const int rows = N - tile * TILE < TILE ? (int)(N - tile * TILE) : TILE;
                pack_tile(type, blocks, row_bytes, tile * TILE, rows, K, rowwise, slab + (tile - s) * TILE * K);
            }
            for (int64_t p = 0; p < n_panels; p++) {
                const int64_t i0 = p * PANEL;
                const int rows = M - i0 < PANEL ? (int)(M - i0) : PANEL;
                const float *panel = xp + p * PANEL * K;
                memset(accs, 0, (size_t)(s_end - s) * TILE * PANEL * sizeof(float));
                for (int64_t k0 = 0; k0 < K; k0 += KC) {   /* a KC slice of the panel stays in L1 across the tiles */
                    const int64_t kc = K - k0 < KC ? K - k0 : KC;
                    for (int64_t tile = s; tile < s_end; tile++)
                        micro_kernel(slab + (tile - s) * TILE * K + k0 * TILE, panel + k0 * PANEL, kc,
                                     accs + (tile - s) * TILE * PANEL);
                }
                for (int64_t tile = s; tile < s_end; tile++) {
                    const int64_t j0 = tile * TILE;
                    const int cols = N - j0 < TILE ? (int)(N - j0) : TILE;
                    const float *acc = accs + (tile - s) * TILE * PANEL;
                    for (int l = 0; l < rows; l++)
                        for (int j = 0; j < cols; j++) y[(i0 + l) * N + j0 + j] = acc[j * PANEL + l];
                }
            }
        }
        free(slab);
    }
    free(xp);
    return failed ? -2 : 0;
}
