/* Multi-row product of int8-quantized activations with GGUF blocks (Q4_0, Q4_1, Q8_0), for kvlab.
 *
 *   Y (M, N) ~ X (M, K) @ W^T,   W (N, K) held as blocks (laid out as blockgemv.h says)
 *
 * Activations. Each 32-element block of each row of X is quantized to int8 with one fp32 scale, like
 * llama.cpp's Q8_1: amax = max |x|, d = amax / 127, q = round-half-even(x * (127 / amax)) in [-127, 127], and
 * its code sum s = sum q. A block whose amax is below 2^-100 becomes all zeros (d = 0); a block holding inf or nan
 * gets d = nan, so the rows it touches come out nan instead of silently wrong. Every variant computes these
 * exactly the same (fp32 division and product, round-to-nearest-even): quantize_block.
 *
 * Products. Per output, per block b: an exact integer dot isum_b of the weight codes with the activation codes
 * (Q4_0's weights are q - 8: isum = sum q * a - 8 s), then, in fp32, in block order,
 *     acc = fma(float(isum_b), d_w * d_a, acc)            and for Q4_1 also   acc = fma(m_w, d_a * s, acc).
 * The integer sums are exact, so every variant (AVX-512 VNNI, AVX-512BW, AVX2, plain C) gives the same bits, for
 * any thread count (each output is computed whole by one thread, in this order).
 *
 * Layout. X is quantized into groups of 16 rows ("lanes"), block-major: per (group, block) a 640-byte chunk of
 * 8 steps x 16 lanes x 4 codes (step t, lane l: row l's codes 4t .. 4t + 3), then the 16 scales d_a, then 16
 * aux words (Q4_0 / Q8_0: the integer start value of the dot, -8 s resp. -128 s or 0; Q4_1: d_a * s in fp32).
 * The weights are read straight from the blocks: 4 weight codes of one row are broadcast to all lanes and
 * multiplied with 4 codes of each of 16 rows at once (one vpdpbusd: u8 weights x s8 activations, summed into
 * int32 lanes), so after 8 steps each lane holds one row's full block dot, and the fp32 work (convert, scale,
 * fma) is once per block per 16 rows. The nibble codes (0..15) are the unsigned operand as they are; Q8_0's
 * signed codes are offset by 128 (the start value -128 s takes it back out) with VNNI, and elsewhere multiplied
 * by sign: |w| x sign(w) * a, which cannot saturate vpmaddubsw's 16-bit pair sums (2 x 128 x 127 < 32768).
 *
 * Threads split the weight rows (pairs) statically; each thread sweeps its rows past 64 rows (four groups) of X at
 * a time (they stay in L1/L2).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "blockgemv.h"
#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define Q8_AVX512 1
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__)
#define Q8_AVX2 1
#include <immintrin.h>
#endif

#define LANES 16                               /* rows of X per packed group */
#define STEPS 8                                /* 4-code steps per 32-code block */
#define CODES_AT 0
#define SCALES_AT (LANES * QK)                 /* 512 */
#define AUX_AT (SCALES_AT + LANES * 4)         /* 576 */
#define CHUNK (AUX_AT + LANES * 4)             /* 640 bytes per (group, block) */
#define TINY 7.888609052210118e-31f            /* 2^-100: a block with a smaller amax quantizes to zeros */
#define AHEAD 2                                /* weight row pairs prefetched ahead */
#define MAX_K ((int64_t)1 << 26)
#define MAX_PASS 4                             /* packed groups per pass, at most (AVX-512: 4, else 1) */

/* 3: AVX-512 with VNNI, 2: AVX-512BW, 1: AVX2, 0: plain C */
int kvlab_q8_variant(void) {
#if defined(Q8_AVX512) && defined(__AVX512VNNI__)
    return 3;
#elif defined(Q8_AVX512)
    return 2;
#elif defined(Q8_AVX2)
    return 1;
#else
    return 0;
#endif
}

/* bytes of one block of `type`, 0 for another type (kept here so this file also builds alone, for the tests) */
static int block_bytes(int type) {
    return type == Q4_0 ? 18 : type == Q4_1 ? 20 : type == Q8_0 ? 34 : 0;
}

static inline float fp16_at(const uint8_t *p) {
    return kvlab_fp16_to_fp32((uint16_t)(p[0] | (p[1] << 8)));
}

static inline uint32_t load32(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* x[0..32) -> codes q[0..32) and their sum; returns the scale d (see the top of the file) */
static float quantize_block(const float *x, int8_t *q, int32_t *sum) {
#if defined(Q8_AVX512)
    const __m512 lo = _mm512_loadu_ps(x), hi = _mm512_loadu_ps(x + 16), zero = _mm512_setzero_ps();
    const __mmask16 bad = _mm512_cmp_ps_mask(_mm512_sub_ps(lo, lo), zero, _CMP_NEQ_UQ)     /* inf - inf, nan: nan */
                        | _mm512_cmp_ps_mask(_mm512_sub_ps(hi, hi), zero, _CMP_NEQ_UQ);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
    if (bad || amax < TINY) {
        memset(q, 0, QK);
        *sum = 0;
        return bad ? NAN : 0.0f;
    }
    const __m512 inv = _mm512_set1_ps(127.0f / amax);
    const __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, inv));    /* round to nearest even (MXCSR default) */
    const __m512i qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, inv));
    _mm_storeu_si128((__m128i *)q, _mm512_cvtepi32_epi8(qlo));
    _mm_storeu_si128((__m128i *)(q + 16), _mm512_cvtepi32_epi8(qhi));
    *sum = _mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi));
    return amax / 127.0f;
#else
    float amax = 0.0f;
    int finite = 1;
    for (int c = 0; c < QK; c++) {
        const float a = fabsf(x[c]);
        finite &= a <= 3.4028234663852886e38f;                     /* false for inf and nan */
        amax = a > amax ? a : amax;
    }
    if (!finite || amax < TINY) {
        memset(q, 0, QK);
        *sum = 0;
        return finite ? 0.0f : NAN;
    }
    const float inv = 127.0f / amax;
    int32_t s = 0;
    for (int c = 0; c < QK; c++) {
        const int v = (int)nearbyintf(x[c] * inv);
        q[c] = (int8_t)v;
        s += v;
    }
    *sum = s;
    return amax / 127.0f;
#endif
}

/* codes (M, K) int8, scales and sums (M, K / 32): the activation quantization alone (what the tests compare with
 * the torch reference). 0, or -1 for a bad shape. */
int kvlab_q8_quantize(const float *x, int64_t M, int64_t K, int8_t *codes, float *scales, int32_t *sums) {
    if (K <= 0 || K % QK != 0 || K > MAX_K || M < 0) return -1;
    const int64_t nb = K / QK;
    for (int64_t r = 0; r < M; r++)
        for (int64_t b = 0; b < nb; b++)
            scales[r * nb + b] = quantize_block(x + r * K + b * QK, codes + r * K + b * QK, sums + r * nb + b);
    return 0;
}

/* -- a few rows of X: one row dot per output --------------------------------------------------------------------
 * Below Q8_FEW_ROWS rows most of the packed kernel's 16 lanes would idle, so each output is one row dot, as
 * llama.cpp's decode computes it: X's row is prepared once (kvlab_q8_prepare: its codes, and per block d_a and d_a * s
 * in fp32, layout [d_a of every block | d_a * s of every block | the codes]), then per weight block the integer dot in
 * eight int32 lanes (lane l: weights 4l .. 4l + 3; vpmaddubsw + vpmaddwd, or vpdpbusd), each lane times d_w * d_a
 * added into that lane's fp32 sum (even blocks into one set of eight sums, odd blocks into another), and
 * sum_b m_b * (d_a * s) beside them (Q4_1's m; Q4_0's m = -8 d_w). The lanes' integer sums are exact and every
 * variant adds the same fp32 terms in the same order, so AVX-512, AVX2 and plain C give the same bits; against the
 * packed kernel (one fp32 sum per output, a whole block's integer dot at a time) only the fp32 summation differs. */
#define Q8_FEW_ROWS 4
#define ROW_CHUNK 64   /* blocks whose scales are turned to fp32 at once */

int64_t kvlab_q8_row_floats(int64_t K) { return 2 * (K / QK) + K / 4; }

void kvlab_q8_prepare(const float *x, int64_t K, float *prepared) {
    const int64_t nb = K / QK;
    int8_t *codes = (int8_t *)(prepared + 2 * nb);
    for (int64_t b = 0; b < nb; b++) {
        int32_t s;
        prepared[b] = quantize_block(x + b * QK, codes + b * QK, &s);
        prepared[nb + b] = prepared[b] * (float)s;
    }
}

/* blocks b0 .. b0 + n of a row: dd[j] = d_w * d_a, m[j] = the weight's offset per unit of activation code sum (eight
 * blocks a conversion where F16C is at hand: one scalar conversion per block cost more than the block's dot) */
static void row_scales(int type, const uint8_t *row, int64_t nb, int64_t b0, int n, const float *d_a, float *dd,
                       float *m) {
    int j = 0;
#if defined(__AVX2__) && defined(__F16C__)
    for (; j + 8 <= n; j += 8) {
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)kvlab_row_d(row, b0 + j)));
        _mm256_storeu_ps(dd + j, _mm256_mul_ps(d, _mm256_loadu_ps(d_a + b0 + j)));
        _mm256_storeu_ps(m + j, type == Q4_1 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)kvlab_row_m(row, nb, b0 + j)))
                                             : _mm256_mul_ps(d, _mm256_set1_ps(-8.0f)));
    }
#endif
    for (; j < n; j++) {
        const float d = fp16_at(kvlab_row_d(row, b0 + j));
        dd[j] = d * d_a[b0 + j];
        m[j] = type == Q4_1 ? fp16_at(kvlab_row_m(row, nb, b0 + j)) : -8.0f * d;
    }
}

#if defined(__AVX2__) && defined(__FMA__)
/* one block's integer dot in eight int32 lanes (lane l: weights 4l .. 4l + 3): the weights as the unsigned operand
 * (nibbles as they are; Q8_0 by the sign trick, |w| x sign(w) a, whose pair sums stay below 2^15) */
static inline __m256i block_lanes(int type, const uint8_t *qs, const int8_t *a) {
    __m256i act = _mm256_loadu_si256((const __m256i *)a), w;
    if (type == Q8_0) {
        const __m256i q = _mm256_loadu_si256((const __m256i *)qs);
        w = _mm256_sign_epi8(q, q);
        act = _mm256_sign_epi8(act, q);
    } else {
        const __m128i bytes = _mm_loadu_si128((const __m128i *)qs), low4 = _mm_set1_epi8(0x0f);
        w = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(bytes, 4), low4), _mm_and_si128(bytes, low4));
    }
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), w, act);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(w, act), _mm256_set1_epi16(1));
#endif
}

float kvlab_q8_row_dot(int type, const uint8_t *row, const float *prepared, int64_t nb) {
    const float *d_a = prepared, *ds = prepared + nb;
    const int8_t *codes = (const int8_t *)(prepared + 2 * nb);
    const int step = type == Q8_0 ? QK : QK / 2;
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    float offsets = 0.0f, dd[ROW_CHUNK], m[ROW_CHUNK];
    for (int64_t b0 = 0; b0 < nb; b0 += ROW_CHUNK) {
        const int n = nb - b0 < ROW_CHUNK ? (int)(nb - b0) : ROW_CHUNK;
        row_scales(type, row, nb, b0, n, d_a, dd, m);
        if (type != Q8_0) {
            __m256 off = _mm256_setzero_ps();
            int j = 0;
            for (; j + 8 <= n; j += 8) off = _mm256_fmadd_ps(_mm256_loadu_ps(m + j), _mm256_loadu_ps(ds + b0 + j), off);
            offsets += kvlab_sum8(off);
            for (; j < n; j++) offsets = fmaf(m[j], ds[b0 + j], offsets);
        }
        const uint8_t *qs = kvlab_row_quants(type, row, nb, b0);
        const int8_t *a = codes + b0 * QK;
        int j = 0;
        for (; j + 1 < n; j += 2, qs += 2 * step, a += 2 * QK) {
            __builtin_prefetch(qs + 2048, 0, 3);
            acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(block_lanes(type, qs, a)), _mm256_broadcast_ss(dd + j), acc0);
            acc1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(block_lanes(type, qs + step, a + QK)), _mm256_broadcast_ss(dd + j + 1),
                                   acc1);
        }
        if (j < n) acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(block_lanes(type, qs, a)), _mm256_broadcast_ss(dd + j), acc0);
    }
    return kvlab_sum8(_mm256_add_ps(acc0, acc1)) + offsets;
}

#else
static float lane_total(const float *v) {   /* kvlab_sum8's tree */
    return ((v[0] + v[4]) + (v[2] + v[6])) + ((v[1] + v[5]) + (v[3] + v[7]));
}

/* the AVX2 code's arithmetic lane by lane */
float kvlab_q8_row_dot(int type, const uint8_t *row, const float *prepared, int64_t nb) {
    const float *d_a = prepared, *ds = prepared + nb;
    const int8_t *codes = (const int8_t *)(prepared + 2 * nb);
    float acc[2][8] = {{0}}, offsets = 0.0f, dd[ROW_CHUNK], m[ROW_CHUNK];
    for (int64_t b0 = 0; b0 < nb; b0 += ROW_CHUNK) {
        const int n = nb - b0 < ROW_CHUNK ? (int)(nb - b0) : ROW_CHUNK;
        row_scales(type, row, nb, b0, n, d_a, dd, m);
        if (type != Q8_0) {
            float off[8] = {0};
            int j = 0;
            for (; j + 8 <= n; j += 8)
                for (int l = 0; l < 8; l++) off[l] = fmaf(m[j + l], ds[b0 + j + l], off[l]);
            offsets += lane_total(off);
            for (; j < n; j++) offsets = fmaf(m[j], ds[b0 + j], offsets);
        }
        for (int j = 0; j < n; j++) {
            const uint8_t *qs = kvlab_row_quants(type, row, nb, b0 + j);
            const int8_t *a = codes + (b0 + j) * QK;
            for (int l = 0; l < 8; l++) {
                int32_t lane = 0;
                for (int c = 4 * l; c < 4 * l + 4; c++) {
                    const int w = type == Q8_0 ? (int8_t)qs[c] : c < QK / 2 ? qs[c] & 0x0f : qs[c - QK / 2] >> 4;
                    lane += w * a[c];
                }
                acc[j % 2][l] = fmaf((float)lane, dd[j], acc[j % 2][l]);
            }
        }
    }
    float total[8];
    for (int l = 0; l < 8; l++) total[l] = acc[0][l] + acc[1][l];
    return lane_total(total) + offsets;
}
#endif

/* Y (M, N) for M < Q8_FEW_ROWS: each X row prepared once, then every output one row dot */
static int few_rows(int type, const uint8_t *blocks, int64_t N, int64_t K, const float *x, int64_t M, float *y,
                    int n_threads) {
    const int64_t per_row = kvlab_q8_row_floats(K), nb = K / QK, row_bytes = nb * block_bytes(type);
    float *prepared = malloc(sizeof(float) * (size_t)(M * per_row));
    if (prepared == NULL) return -2;
    for (int64_t i = 0; i < M; i++) kvlab_q8_prepare(x + i * K, K, prepared + i * per_row);
    #pragma omp parallel for schedule(static) num_threads(n_threads) if(N * K * M >= 65536)
    for (int64_t r = 0; r < N; r++)
        for (int64_t i = 0; i < M; i++)
            y[i * N + r] = kvlab_q8_row_dot(type, blocks + r * row_bytes, prepared + i * per_row, nb);
    free(prepared);
    return 0;
}

/* The dot's integer start value for a block with code sum s: Q4_0's -8 offset; Q8_0's +128 offset under VNNI */
static inline int32_t start_value(int type, int32_t s) {
    if (type == Q4_0) return -8 * s;
#if defined(Q8_AVX512) && defined(__AVX512VNNI__)
    if (type == Q8_0) return -128 * s;
#endif
    return 0;
}

/* X (M, K) -> packed groups (see Layout); padding lanes past M stay zero */
static void pack_groups(int type, const float *x, int64_t M, int64_t K, uint8_t *xp) {
    const int64_t nb = K / QK;
    int8_t q[QK];
    for (int64_t r = 0; r < M; r++) {
        const int64_t g = r / LANES, l = r % LANES;
        for (int64_t b = 0; b < nb; b++) {
            uint8_t *chunk = xp + (g * nb + b) * CHUNK;
            int32_t s;
            const float d = quantize_block(x + r * K + b * QK, q, &s);
            for (int t = 0; t < STEPS; t++) memcpy(chunk + CODES_AT + (t * LANES + l) * 4, q + 4 * t, 4);
            memcpy(chunk + SCALES_AT + l * 4, &d, 4);
            if (type == Q4_1) {
                const float ds = d * (float)s;
                memcpy(chunk + AUX_AT + l * 4, &ds, 4);
            } else {
                const int32_t start = start_value(type, s);
                memcpy(chunk + AUX_AT + l * 4, &start, 4);
            }
        }
    }
}

/* Weight codes 4t .. 4t + 3 of one block (its quants at qs) as the dot's first operand: nibbles as they are (0..15);
 * Q8_0's signed codes + 128 under VNNI, else as they are (the sign trick takes them) */
static inline uint32_t weight_word(const int type, const uint8_t *qs, int t) {
    if (type == Q8_0) {
        const uint32_t w = load32(qs + 4 * t);
#if defined(Q8_AVX512) && defined(__AVX512VNNI__)
        return w ^ 0x80808080u;
#else
        return w;
#endif
    }
    const uint32_t raw = load32(qs + 4 * (t & 3));
    return (t < 4 ? raw : raw >> 4) & 0x0f0f0f0fu;
}

#if defined(Q8_AVX512)
/* acc + the 4-code dots of weight word w (in every lane) with each lane's 4 activation codes */
static inline __m512i dot4(const int type, __m512i acc, __m512i w, __m512i a) {
#if defined(__AVX512VNNI__)
    (void)type;
    return _mm512_dpbusd_epi32(acc, w, a);
#else
    if (type == Q8_0) {
        a = _mm512_mask_sub_epi8(a, _mm512_movepi8_mask(w), _mm512_setzero_si512(), a);
        w = _mm512_abs_epi8(w);
    }
    return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(w, a), _mm512_set1_epi16(1)));
#endif
}

/* out[r][a][l] for weight rows w0, w1 (r) and the 16 lanes of A packed groups (a) starting at xg */
static inline __attribute__((always_inline)) void micro_kernel(const int type, const int A, const uint8_t *w0,
                                                              const uint8_t *w1, int64_t nb,
                                                              const uint8_t *xg, int64_t group_bytes,
                                                              float out[2][MAX_PASS][LANES]) {
    __m512 acc[2][MAX_PASS];
    for (int r = 0; r < 2; r++)
        for (int a = 0; a < A; a++) acc[r][a] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *qs[2] = {kvlab_row_quants(type, w0, nb, b), kvlab_row_quants(type, w1, nb, b)};
        const uint8_t *chunk[MAX_PASS];
        for (int a = 0; a < A; a++) chunk[a] = xg + a * group_bytes + b * CHUNK;
        __m512i s[2][MAX_PASS];
        for (int a = 0; a < A; a++) {
            const __m512i start = type == Q4_1 ? _mm512_setzero_si512() : _mm512_load_si512(chunk[a] + AUX_AT);
            s[0][a] = s[1][a] = start;
        }
        for (int t = 0; t < STEPS; t++) {
            const __m512i w[2] = {_mm512_set1_epi32((int)weight_word(type, qs[0], t)),
                                  _mm512_set1_epi32((int)weight_word(type, qs[1], t))};
            for (int a = 0; a < A; a++) {
                const __m512i codes = _mm512_load_si512(chunk[a] + CODES_AT + t * 64);
                s[0][a] = dot4(type, s[0][a], w[0], codes);
                s[1][a] = dot4(type, s[1][a], w[1], codes);
            }
        }
        for (int r = 0; r < 2; r++) {
            const uint8_t *row = r ? w1 : w0;
            const __m512 dw = _mm512_set1_ps(fp16_at(kvlab_row_d(row, b)));
            for (int a = 0; a < A; a++) {
                const __m512 scale = _mm512_mul_ps(dw, _mm512_load_ps((const float *)(chunk[a] + SCALES_AT)));
                acc[r][a] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[r][a]), scale, acc[r][a]);
                if (type == Q4_1)
                    acc[r][a] = _mm512_fmadd_ps(_mm512_set1_ps(fp16_at(kvlab_row_m(row, nb, b))),
                                                _mm512_load_ps((const float *)(chunk[a] + AUX_AT)), acc[r][a]);
            }
        }
    }
    for (int r = 0; r < 2; r++)
        for (int a = 0; a < A; a++) _mm512_storeu_ps(out[r][a], acc[r][a]);
}
#define GROUPS_PER_PASS 4

#elif defined(Q8_AVX2)
/* AVX2: the 16 lanes of a group as two 8-lane halves; one group per pass (16 ymm registers) */
static inline __m256i dot4(const int type, __m256i acc, __m256i w, __m256i a) {
    if (type == Q8_0) {
        a = _mm256_sign_epi8(a, w);
        w = _mm256_abs_epi8(w);
    }
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, a), _mm256_set1_epi16(1)));
}

static inline __attribute__((always_inline)) void micro_kernel(const int type, const int A, const uint8_t *w0,
                                                              const uint8_t *w1, int64_t nb,
                                                              const uint8_t *xg, int64_t group_bytes,
                                                              float out[2][MAX_PASS][LANES]) {
    (void)A;
    (void)group_bytes;
    __m256 acc[2][2];
    for (int r = 0; r < 2; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *qs[2] = {kvlab_row_quants(type, w0, nb, b), kvlab_row_quants(type, w1, nb, b)};
        const uint8_t *chunk = xg + b * CHUNK;
        __m256i s[2][2];
        for (int h = 0; h < 2; h++) {
            const __m256i start = type == Q4_1 ? _mm256_setzero_si256()
                                               : _mm256_load_si256((const __m256i *)(chunk + AUX_AT + 32 * h));
            s[0][h] = s[1][h] = start;
        }
        for (int t = 0; t < STEPS; t++) {
            const __m256i w[2] = {_mm256_set1_epi32((int)weight_word(type, qs[0], t)),
                                  _mm256_set1_epi32((int)weight_word(type, qs[1], t))};
            for (int h = 0; h < 2; h++) {
                const __m256i codes = _mm256_load_si256((const __m256i *)(chunk + CODES_AT + t * 64 + 32 * h));
                s[0][h] = dot4(type, s[0][h], w[0], codes);
                s[1][h] = dot4(type, s[1][h], w[1], codes);
            }
        }
        for (int r = 0; r < 2; r++) {
            const uint8_t *row = r ? w1 : w0;
            const __m256 dw = _mm256_set1_ps(fp16_at(kvlab_row_d(row, b)));
            for (int h = 0; h < 2; h++) {
                const __m256 scale = _mm256_mul_ps(dw, _mm256_load_ps((const float *)(chunk + SCALES_AT + 32 * h)));
                acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[r][h]), scale, acc[r][h]);
                if (type == Q4_1)
                    acc[r][h] = _mm256_fmadd_ps(_mm256_set1_ps(fp16_at(kvlab_row_m(row, nb, b))),
                                                _mm256_load_ps((const float *)(chunk + AUX_AT + 32 * h)), acc[r][h]);
            }
        }
    }
    for (int r = 0; r < 2; r++)
        for (int h = 0; h < 2; h++) _mm256_storeu_ps(out[r][0] + 8 * h, acc[r][h]);
}
#define GROUPS_PER_PASS 1

#else
/* Plain C: the same integer dots and the same fp32 operations, lane by lane (fmaf: one rounding, as above) */
static inline int weight_code(const int type, uint32_t word, int c) {
    const uint8_t byte = (uint8_t)(word >> (8 * c));
    return type == Q8_0 ? (int)(int8_t)byte : (int)byte;
}

static void micro_kernel(const int type, const int A, const uint8_t *w0, const uint8_t *w1, int64_t nb,
                         const uint8_t *xg, int64_t group_bytes, float out[2][MAX_PASS][LANES]) {
    (void)A;
    (void)group_bytes;
    for (int r = 0; r < 2; r++) {
        const uint8_t *row = r ? w1 : w0;
        for (int l = 0; l < LANES; l++) {
            float acc = 0.0f;
            for (int64_t b = 0; b < nb; b++) {
                const uint8_t *qs = kvlab_row_quants(type, row, nb, b), *chunk = xg + b * CHUNK;
                int32_t s = 0;
                if (type != Q4_1) memcpy(&s, chunk + AUX_AT + l * 4, 4);
                for (int t = 0; t < STEPS; t++) {
                    const uint32_t word = weight_word(type, qs, t);
                    const int8_t *a = (const int8_t *)(chunk + CODES_AT + (t * LANES + l) * 4);
                    for (int c = 0; c < 4; c++) s += weight_code(type, word, c) * a[c];
                }
                float da, aux;
                memcpy(&da, chunk + SCALES_AT + l * 4, 4);
                acc = fmaf((float)s, fp16_at(kvlab_row_d(row, b)) * da, acc);
                if (type == Q4_1) {
                    memcpy(&aux, chunk + AUX_AT + l * 4, 4);
                    acc = fmaf(fp16_at(kvlab_row_m(row, nb, b)), aux, acc);
                }
            }
            out[r][0][l] = acc;
        }
    }
}
#define GROUPS_PER_PASS 1
#endif

/* The group count of a pass as a constant in each inlined copy of the micro-kernel */
static inline __attribute__((always_inline)) void pass_kernel(const int type, int A, const uint8_t *w0,
                                                             const uint8_t *w1, int64_t nb,
                                                             const uint8_t *xg, int64_t group_bytes,
                                                             float out[2][MAX_PASS][LANES]) {
    switch (A) {
    case 4: micro_kernel(type, 4, w0, w1, nb, xg, group_bytes, out); break;
    case 3: micro_kernel(type, 3, w0, w1, nb, xg, group_bytes, out); break;
    case 2: micro_kernel(type, 2, w0, w1, nb, xg, group_bytes, out); break;
    default: micro_kernel(type, 1, w0, w1, nb, xg, group_bytes, out); break;
    }
}

/* Every pass of packed groups against weight row pairs [p0, p1): one thread's work */
static inline __attribute__((always_inline)) void thread_rows(const int type, const uint8_t *blocks, int64_t N,
                                                              int64_t K, const uint8_t *xp, int64_t M, int64_t p0,
                                                              int64_t p1, float *y) {
    const int64_t nb = K / QK, row_bytes = nb * block_bytes(type), group_bytes = nb * CHUNK;
    const int64_t groups = (M + LANES - 1) / LANES;
    float out[2][MAX_PASS][LANES];
    for (int64_t g = 0; g < groups; g += GROUPS_PER_PASS) {
        const int A = groups - g < GROUPS_PER_PASS ? (int)(groups - g) : GROUPS_PER_PASS;
        for (int64_t p = p0; p < p1; p++) {
            const int64_t j = 2 * p;
            const int two = j + 1 < N;
            const uint8_t *w0 = blocks + j * row_bytes, *w1 = two ? w0 + row_bytes : w0;
            if (p + AHEAD < p1)
                for (int64_t at = 0; at < 2 * row_bytes; at += 64) __builtin_prefetch(w0 + AHEAD * 2 * row_bytes + at, 0, 3);
            pass_kernel(type, A, w0, w1, nb, xp + g * group_bytes, group_bytes, out);
            for (int a = 0; a < A; a++)
                for (int l = 0; l < LANES; l++) {
                    const int64_t i = (g + a) * LANES + l;
                    if (i >= M) break;
                    y[i * N + j] = out[0][a][l];
                    if (two) y[i * N + j + 1] = out[1][a][l];
                }
        }
    }
}

/* one instantiation per block type, so the type is a constant inside the micro-kernels */
static void thread_rows_q4_0(const uint8_t *w, int64_t N, int64_t K, const uint8_t *xp, int64_t M, int64_t p0,
                             int64_t p1, float *y) { thread_rows(Q4_0, w, N, K, xp, M, p0, p1, y); }
static void thread_rows_q4_1(const uint8_t *w, int64_t N, int64_t K, const uint8_t *xp, int64_t M, int64_t p0,
                             int64_t p1, float *y) { thread_rows(Q4_1, w, N, K, xp, M, p0, p1, y); }
static void thread_rows_q8_0(const uint8_t *w, int64_t N, int64_t K, const uint8_t *xp, int64_t M, int64_t p0,
                             int64_t p1, float *y) { thread_rows(Q8_0, w, N, K, xp, M, p0, p1, y); }

/* Y (M, N) from X (M, K) quantized to int8 per block and W (N, K) as blocks of `type`; X and Y contiguous fp32.
 * Returns 0, -1 for a bad type or shape, -2 when scratch memory could not be had. */
int kvlab_q8_gemm(int type, const uint8_t *blocks, int64_t N, int64_t K, const float *x, int64_t M, float *y,
                  int n_threads) {
    if (block_bytes(type) == 0 || K % QK != 0 || K <= 0 || K > MAX_K || N < 0 || M < 0) return -1;
    if (N == 0 || M == 0) return 0;
    if (n_threads < 1) n_threads = 1;
    if (M < Q8_FEW_ROWS) return few_rows(type, blocks, N, K, x, M, y, n_threads);
    const int64_t groups = (M + LANES - 1) / LANES, nb = K / QK;
    const size_t bytes = (size_t)groups * (size_t)nb * CHUNK;                  /* a multiple of 64 */
    uint8_t *xp = (uint8_t *)aligned_alloc(64, bytes);
    if (xp == NULL) return -2;
    memset(xp, 0, bytes);
    pack_groups(type, x, M, K, xp);
    void (*rows_fn)(const uint8_t *, int64_t, int64_t, const uint8_t *, int64_t, int64_t, int64_t, float *) =
        type == Q4_0 ? thread_rows_q4_0 : type == Q4_1 ? thread_rows_q4_1 : thread_rows_q8_0;
    const int64_t pairs = (N + 1) / 2;
    #pragma omp parallel num_threads(n_threads) if(N * K * M >= 65536)
    {
        int t = 0, nt = 1;
#ifdef _OPENMP
        t = omp_get_thread_num();
        nt = omp_get_num_threads();
#endif
        rows_fn(blocks, N, K, xp, M, pairs * t / nt, pairs * (t + 1) / nt, y);
    }
    free(xp);
    return 0;
}
