/* One decode step of a Llama-family decoder in one call: batch 1, one new token, fp32, K/V in kvlab's
 * DenseCache buffers. It is the Python Decoder's T = 1 path (kvlab/model/llama.py) with the per-layer
 * interpreter and small-op overhead taken out, and it is tested against that path.
 *
 * For every layer:  h = rms_norm(x) ; q|k|v = W_qkv h (+ bias) ; [q/k head norms] ; RoPE(q, k) at `pos` ;
 *                   K/V written at `pos` (after a finiteness check) ; attention of each query head over its
 *                   KV head's positions [start, pos] ; x += W_out a ;
 *                   h = rms_norm(x) ; g|u = W_gate_up h ; x += W_down (silu(g) * u)
 * then logits = W_head rms_norm(x). Matrices are GGUF blocks (Q4_0/Q4_1/Q8_0, read by blockgemv.c's row
 * kernels, or with int8 activations where the model's matrix takes them by q8gemm.c's) or fp32 rows. One OpenMP parallel region spans the whole step: matrix rows and attention heads
 * are shared between the threads; the small vector work between two matrices (the residual, RMS norms, the
 * blocks' sums) is done by every thread alike on its own copy, so a layer crosses seven barriers (one per matrix,
 * the new token's K/V and the attention's two passes), each decode.h's step barrier: it spins before it sleeps, where
 * OpenMP's under kvlab/__init__.py's passive wait policy is a futex wake-up of an idle core, some tens of microseconds.
 * A gate row and its up row are one thread's.
 *
 * K/V storage: fp32, f16 or bf16 (kvlab's dense, dense-f16, dense-bf16 caches). A new token's K/V are
 * rounded to nearest-even as torch's .to() rounds them. A key chunk of dense rows is read by kvlab_dense_read, the
 * one read of dense rows (the serving pool's too; the cache is its one block): in place, f16/bf16 converted to fp32
 * in registers (AVX-512, and AVX2 for a decode step's few queries), or a tile of rows at a time into the thread's
 * scratch elsewhere; exact conversions, so the step equals the module path's upcast reads.
 *
 * TurboQuant layers (kvlab/cache/turboquant.py; LayerKV with `coded` set): a sink and a recent window of fp32
 * rows around the coded rows. The new token (or the row leaving the window) is coded here as
 * TurboQuantCache.code codes it: x' = (x - mu) / w, scale ||x'|| * factor in 16 bits, codes of y = x' M / ||x'||
 * (codebook.c's encoder). A coded chunk is read by kvlab_tq_read, the one read of TurboQuant codes (the serving
 * pool's too; the cache is its one block): q' = (q w) M * scale for every query head, keys scored straight from
 * their codes in registers by every head of the group (AVX-512; elsewhere decoded a tile at a time into L1), the
 * scores times the keys' scales, `top` shifted by q . mu * scale (the same for every coded key), values summed
 * straight from their codes times their scales; the coded chunks' sum turns back once per head (x = y Mᵀ) when
 * the parts combine.
 * The softmax's exponentials are vectorized (about 2 ulp, AVX-512 / AVX2; expf in plain C).
 *
 * Integer layers (kvlab/cache/quantized.py, int1..int8 with any group; LayerKV with `quant` set): the same sink and
 * recent window around the integer codes. A key chunk of codes is read by kvlab_int_attend (intcache.h), the one read
 * of integer codes (the single cache's module path and the serving pool's too): tiles of sixteen rows decoded once for
 * every query head of the group, the open group's keys from the fp32 stage. The new token (or the row leaving the
 * window) is coded as QuantizedCache._store codes it (see int_store).
 */
#define _GNU_SOURCE   /* syscall(): the step barrier's futex (decode.h) */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "blockgemv.h"
#include "codebook.h"
#include "decode.h"
#include "intcache.h"
#include "intcodes.h"
#include "rowmath.h"
#include "tqcodes.h"

/* Attention reads the keys in chunks of KEY_CHUNK positions per KV head (flash-decoding): a chunk's K/V
 * (64 KB each at head_dim 64) stay in cache while every query head of the group reads them, the chunks
 * share out between the threads even when there are fewer KV heads than threads, and the chunks' partial
 * softmax sums are combined in a fixed order, so the result does not depend on the thread count. */
#define KEY_CHUNK 256
_Static_assert(KEY_CHUNK <= TQ_READ_KEYS && KEY_CHUNK <= DENSE_READ_KEYS, "a key chunk is one read");
/* A TurboQuant layer holding at least CODED_LONG coded rows reads them in chunks of TQ_READ_KEYS (512): half the reads
 * and what each costs besides its keys, while there are still four chunks a KV head to share out between the threads
 * (tq4's step at 8k tokens, 1 thread: ~2% faster in alternating runs) */
#define CODED_LONG (4 * TQ_READ_KEYS)
#define SWIGLU_PIECE 64   /* the feed-forward's gate and up rows a thread computes before their SwiGLU (kvlab_swiglu) */

enum { KV_F32 = 0, KV_F16 = 1, KV_BF16 = 2 };   /* how the cache stores K/V */
enum { NORM_LOG8 = 3 };                         /* a coded layer's scales as 8-bit log codes (+norms8, decode.h) */

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__F16C__))
#include <immintrin.h>
#endif

static inline float bf16_to_f32(uint16_t h) {
    const uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* round to nearest, ties to even (torch's float -> bfloat16), for finite x; a finite x past bf16's largest
 * value becomes Inf */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t x;
    memcpy(&x, &f, sizeof x);
    x += 0x7fffu + ((x >> 16) & 1u);
    return (uint16_t)(x >> 16);
}

/* round to nearest, ties to even (torch's float -> float16): |x| >= 65520 becomes Inf, below 2^-14 a subnormal */
static inline uint16_t f32_to_f16(float f) {
#ifdef __F16C__
    return (uint16_t)_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
#else
    uint32_t x;
    memcpy(&x, &f, sizeof x);
    const uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
    const uint32_t ax = x & 0x7fffffffu;
    if (ax > 0x7f800000u) return sign | 0x7e00u;                        /* nan */
    if (ax >= 0x477ff000u) return sign | 0x7c00u;                       /* >= 65520 (or inf): inf */
    if (ax < 0x38800000u) {                                             /* below 2^-14: units of 2^-24 */
        float a;
        memcpy(&a, &ax, sizeof a);
        return sign | (uint16_t)lrintf(a * 16777216.0f);                /* exact scaling; lrintf rounds to even */
    }
    uint32_t m = ax - 0x38000000u;                                      /* exponent bias 127 -> 15 */
    m += 0x0fffu + ((m >> 13) & 1u);                                    /* 23 -> 10 mantissa bits, ties to even */
    return sign | (uint16_t)(m >> 13);
#endif
}

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__F16C__)
/* eight f16 / bf16 values at src as fp32, exactly */
static inline __attribute__((always_inline)) __m256 kv_load8(int kv_type, const uint16_t *src) {
    const __m128i x = _mm_loadu_si128((const __m128i *)src);
    return kv_type == KV_F16 ? _mm256_cvtph_ps(x) : _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(x), 16));
}
#endif

/* dst (n,) fp32 = the f16 / bf16 values at src, exactly */
static inline __attribute__((always_inline)) void kv_load(int kv_type, const uint16_t *src, int64_t n, float *dst) {
    int64_t i = 0;
#if defined(__AVX512F__)
    if (kv_type == KV_F16)
        for (; i + 16 <= n; i += 16) _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(src + i))));
    else
        for (; i + 16 <= n; i += 16)
            _mm512_storeu_ps(dst + i, _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(src + i))), 16)));
#elif defined(__AVX2__) && defined(__F16C__)
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, kv_load8(kv_type, src + i));
#endif
    for (; i < n; i++) dst[i] = kv_type == KV_F16 ? kvlab_fp16_to_fp32(src[i]) : bf16_to_f32(src[i]);
}

/* dst (n,) = src rounded to f16 / bf16; returns 1 when every stored value is finite */
static int kv_store(int kv_type, const float *src, int64_t n, uint16_t *dst) {
    const uint16_t inf = kv_type == KV_F16 ? 0x7c00u : 0x7f80u;
    int ok = 1;
    for (int64_t i = 0; i < n; i++) {
        dst[i] = kv_type == KV_F16 ? f32_to_f16(src[i]) : f32_to_bf16(src[i]);
        ok &= (dst[i] & inf) != inf;
    }
    return ok;
}

/* The conversions on their own, for the tests: to f16/bf16 (0 when all finite, 1 otherwise) and back. */
int kvlab_kv_store(int kv_type, const float *src, int64_t n, uint16_t *dst) {
    if (kv_type != KV_F16 && kv_type != KV_BF16) return -1;
    return kv_store(kv_type, src, n, dst) ? 0 : 1;
}

int kvlab_kv_load(int kv_type, const uint16_t *src, int64_t n, float *dst) {
    if (kv_type != KV_F16 && kv_type != KV_BF16) return -1;
    kv_load(kv_type, src, n, dst);
    return 0;
}

/* Matrix, Layer, Model: the weights' structs (decode.h) */

/* Rotate pairs (i, i + D/2) of one head, as llama.py's apply_rope: x*cos + (-x2 | x1)*sin */
static void rope(float *x, const float *cos_, const float *sin_, int d) {
    const int half = d / 2;
    for (int i = 0; i < half; i++) {
        const float x1 = x[i], x2 = x[i + half];
        x[i] = x1 * cos_[i] - x2 * sin_[i];
        x[i + half] = x2 * cos_[i + half] + x1 * sin_[i + half];
    }
}

static float dot(const float *a, const float *b, int64_t n) { return kvlab_row_dot(a, b, n); }

#if defined(__AVX512F__)
/* 16 values of a row at p as fp32: fp32 (kv_type KV_F32) as they are, f16 / bf16 exactly (kv_load's conversion) */
static inline __attribute__((always_inline)) __m512 load_lanes(int kv_type, const void *p, int64_t i) {
    if (kv_type == KV_F32) return _mm512_loadu_ps((const float *)p + i);
    const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i));
    return kv_type == KV_F16 ? _mm512_cvtph_ps(h) : _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* One step of folding 16 vectors into one: lanes `lo` of (a, b) plus lanes `hi` of (a, b) */
static inline __m512 fold(__m512 a, __m512 b, __m512i lo, __m512i hi) {
    return _mm512_add_ps(_mm512_permutex2var_ps(a, lo, b), _mm512_permutex2var_ps(a, hi, b));
}

/* scores[t] = q . row t of keys (kv_type rows, d a multiple of 16) * scale for t in [start, end). Sixteen keys at a
 * time: each key's 16 lane partial sums, then four folds that halve the partials per key and pack the keys (16
 * vectors -> 8 -> 4 -> 2 -> 1), instead of a horizontal sum per key. The rest one key at a time, as dot() sums. */
/* the permutes of the four fold steps: step s (w = 8, 4, 2, 1: each key holds 2w partials) takes into lane j lane
 * (j < 8 ? 0 : 16) + (j % 8) / w * 2w + j % w of the pair (lo), and that + w (hi) */
static inline __attribute__((always_inline)) void fold_indices(__m512i *lo, __m512i *hi) {
    static const int32_t fold_lo[4][16] = {
        {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23}, {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27},
        {0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29}, {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30}};
    for (int step = 0, w = 8; step < 4; step++, w /= 2) {
        lo[step] = _mm512_loadu_si512(fold_lo[step]);
        hi[step] = _mm512_add_epi32(lo[step], _mm512_set1_epi32(w));
    }
}

static inline __attribute__((always_inline)) void key_scores_rows(int kv_type, const float *q, const void *keys, int start,
                                                                  int end, int d, float scale, float *scores) {
    __m512i lo[4], hi[4];
    fold_indices(lo, hi);
    int t = start;
    for (; t + 16 <= end; t += 16) {
        __m512 v[16];
        for (int k = 0; k < 16; k++) {
            const int64_t key = (int64_t)(t + k) * d;
            __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(q), load_lanes(kv_type, keys, key));
            for (int c = 16; c < d; c += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + c), load_lanes(kv_type, keys, key + c), acc);
            v[k] = acc;
        }
        for (int step = 0, m = 16; step < 4; step++, m /= 2)
            for (int k = 0; k < m / 2; k++) v[k] = fold(v[2 * k], v[2 * k + 1], lo[step], hi[step]);
        _mm512_storeu_ps(scores + t, _mm512_mul_ps(v[0], _mm512_set1_ps(scale)));
    }
    for (; t < end; t++) {           /* dot(): two accumulators, the same reduction */
        const int64_t key = (int64_t)t * d;
        __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
        int c = 0;
        for (; c + 32 <= d; c += 32) {
            acc0 = _mm512_fmadd_ps(_mm512_loadu_ps(q + c), load_lanes(kv_type, keys, key + c), acc0);
            acc1 = _mm512_fmadd_ps(_mm512_loadu_ps(q + c + 16), load_lanes(kv_type, keys, key + c + 16), acc1);
        }
        for (; c < d; c += 16) acc0 = _mm512_fmadd_ps(_mm512_loadu_ps(q + c), load_lanes(kv_type, keys, key + c), acc0);
        scores[t] = _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1)) * scale;
    }
}

/* scores[t] = q . keys[t] * scale for t in [start, end) */
static void key_scores(const float *q, const float *keys, int start, int end, int d, float scale, float *scores) {
    if (d % 16 == 0) {
        key_scores_rows(KV_F32, q, keys, start, end, d, scale, scores);
        return;
    }
    for (int t = start; t < end; t++) scores[t] = dot(q, keys + (int64_t)t * d, d) * scale;
}

static float exp_shifted(float *s, int n, float top);

/* The attention of a decode step's queries over one run of rows of kv_type read in place (d a multiple of 16, at most
 * 128): fp32 rows, or 16-bit rows converted in registers. The queries of a KV head's group go through in passes of up
 * to GROUP_PASS, each row loaded (and converted) once a pass and read by every query of it:
 *   scores  sixteen keys a tile; each key's lane partials (its 16-channel blocks chained in order), then the fold tree
 *           of key_scores_rows (keys 2k and 2k + 1 folded, then those pairs, ...), closed as the keys come; the last
 *           n % 16 keys one at a time as key_scores_rows sums them;
 *   values  each 16-channel block of the output in four chains, key t into chain t % 4 (the last n % 4 keys into the
 *           first), then (c0 + c1) + (c2 + c3).
 * A query's products and sums do not depend on the queries beside it in a pass, so its part is the same bits whether
 * it reads alone (one query a KV head) or in a group. Inlined per kv_type, per pass size and per common head dim. */
#define GROUP_PASS 3
static inline __attribute__((always_inline)) void group_scores(int kv_type, const float *q, const int P, const void *keys,
                                                               int n, const int d, float scale, float *scores,
                                                               const void *ahead) {
    __m512i lo[4], hi[4];
    fold_indices(lo, hi);
    const int64_t row_bytes = (int64_t)d * (kv_type == KV_F32 ? 4 : 2);
    int t = 0;
    for (; t + 16 <= n; t += 16) {
        if (ahead) {   /* the keys two tiles on and this tile's values, asked for while these are scored */
            if (t + 48 <= n) kvlab_prefetch_lines((const uint8_t *)keys + (t + 32) * row_bytes, 16 * row_bytes);
            kvlab_prefetch_lines((const uint8_t *)ahead + t * row_bytes, 16 * row_bytes);
        }
        __m512 level[GROUP_PASS][4];   /* level[i][s]: query i's fold waiting at step s */
#pragma GCC unroll 16
        for (int r = 0; r < 16; r++) {
            __m512 row[8];
            for (int b = 0; b < d / 16; b++) row[b] = load_lanes(kv_type, keys, (int64_t)(t + r) * d + 16 * b);
            for (int i = 0; i < P; i++) {
                __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(q + i * d), row[0]);
                for (int b = 1; b < d / 16; b++) acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + i * d + 16 * b), row[b], acc);
                int step = 0;   /* key r closes the folds of steps s while bit s of r is set */
                for (; step < 4 && (r >> step & 1); step++) acc = fold(level[i][step], acc, lo[step], hi[step]);
                if (step < 4) level[i][step] = acc;
                else _mm512_storeu_ps(scores + (int64_t)i * DENSE_READ_KEYS + t, _mm512_mul_ps(acc, _mm512_set1_ps(scale)));
            }
        }
    }
    for (int i = 0; i < P && t < n; i++)   /* the last keys one at a time */
        key_scores_rows(kv_type, q + i * d, keys, t, n, d, scale, scores + (int64_t)i * DENSE_READ_KEYS);
}

/* value t of a pass's mix into chain j (a constant) of each query's lane blocks */
static inline __attribute__((always_inline)) void mix_row(int kv_type, const float *p, const int P, const void *values,
                                                          int t, const int d, int c0, int blocks, const int j,
                                                          __m512 (*acc)[2][4]) {
    __m512 v[2];
    for (int b = 0; b < blocks; b++) v[b] = load_lanes(kv_type, values, (int64_t)t * d + c0 + 16 * b);
    for (int i = 0; i < P; i++) {
        const __m512 w = _mm512_set1_ps(p[(int64_t)i * DENSE_READ_KEYS + t]);
        for (int b = 0; b < blocks; b++) acc[i][b][j] = _mm512_fmadd_ps(w, v[b], acc[i][b][j]);
    }
}

/* parts[i][0 .. d) = sum_t p_i[t] value t for the P queries of a pass (p_i = p + i * DENSE_READ_KEYS), two lane blocks
 * at a time (a pass's chains, 2 x 4 a query, stay in registers) */
static inline __attribute__((always_inline)) void group_mix(int kv_type, const float *p, const int P, const void *values,
                                                            int n, const int d, float *parts, int64_t part_stride) {
    for (int c0 = 0; c0 < d; c0 += 32) {
        const int blocks = d - c0 >= 32 ? 2 : 1;
        __m512 acc[GROUP_PASS][2][4];   /* [query][lane block][t mod 4] */
        for (int i = 0; i < P; i++)
            for (int b = 0; b < 2; b++)
                for (int j = 0; j < 4; j++) acc[i][b][j] = _mm512_setzero_ps();
        int t = 0;
        for (; t + 4 <= n; t += 4) {
            mix_row(kv_type, p, P, values, t, d, c0, blocks, 0, acc);
            mix_row(kv_type, p, P, values, t + 1, d, c0, blocks, 1, acc);
            mix_row(kv_type, p, P, values, t + 2, d, c0, blocks, 2, acc);
            mix_row(kv_type, p, P, values, t + 3, d, c0, blocks, 3, acc);
        }
        for (; t < n; t++) mix_row(kv_type, p, P, values, t, d, c0, blocks, 0, acc);
        for (int i = 0; i < P; i++)
            for (int b = 0; b < blocks; b++)
                _mm512_storeu_ps(parts + i * part_stride + c0 + 16 * b, _mm512_add_ps(_mm512_add_ps(acc[i][b][0], acc[i][b][1]),
                                                                                      _mm512_add_ps(acc[i][b][2], acc[i][b][3])));
    }
}

/* one pass of P queries: scores, each query's softmax, the value mix; `first`: the first pass over the rows, which
 * asks for them ahead */
static inline __attribute__((always_inline)) void group_pass(int kv_type, const float *q, const int P, const void *keys,
                                                             const void *values, int n, const int d, float scale,
                                                             float *scores, float *parts, int64_t part_stride, int first) {
    group_scores(kv_type, q, P, keys, n, d, scale, scores, first ? values : NULL);
    for (int i = 0; i < P; i++) {
        float *s = scores + (int64_t)i * DENSE_READ_KEYS, *part = parts + i * part_stride;
        const float top = kvlab_row_max(s, n);
        part[d + 1] = exp_shifted(s, n, top);
        part[d] = top;
    }
    group_mix(kv_type, scores, P, values, n, d, parts, part_stride);
}

#define GROUP_D(type, P) \
    (d == 64 ? group_pass(type, q, P, keys, values, n, 64, scale, scores, parts, part_stride, first) \
     : d == 128 ? group_pass(type, q, P, keys, values, n, 128, scale, scores, parts, part_stride, first) \
     : group_pass(type, q, P, keys, values, n, d, scale, scores, parts, part_stride, first))
#define GROUP_P(type) \
    switch (P) { case 1: GROUP_D(type, 1); break; case 2: GROUP_D(type, 2); break; default: GROUP_D(type, 3); break; }
/* the attention of nq queries (queries + i * d) over n rows: parts as kvlab_dense_read's, scores nq rows of
 * DENSE_READ_KEYS floats */
static void attend_rows(int kv_type, const float *queries, int nq, const void *keys, const void *values, int n, int d,
                        float scale, float *scores, float *parts_, int64_t part_stride) {
    const int passes = (nq + GROUP_PASS - 1) / GROUP_PASS;
    for (int i0 = 0, pass = 0; i0 < nq; pass++) {   /* passes of sizes as even as they go: 4 = 2 + 2, 8 = 3 + 3 + 2 */
        const int P = (nq - i0 + passes - pass - 1) / (passes - pass), first = pass == 0;
        const float *q = queries + (int64_t)i0 * d;
        float *parts = parts_ + i0 * part_stride;
        if (kv_type == KV_F32) GROUP_P(KV_F32)
        else if (kv_type == KV_F16) GROUP_P(KV_F16)
        else GROUP_P(KV_BF16)
        i0 += P;
    }
}
#undef GROUP_P
#undef GROUP_D
#define HAVE_ATTEND_ROWS 1
#endif

static float exp_shifted(float *s, int n, float top) { return kvlab_row_exp_shifted(s, n, top); }

/* y = rms_norm(x) * w over n values, as torch.nn.functional.rms_norm (y may be x) */
static void rms_norm(const float *x, const float *w, float eps, int n, float *y) {
    const float inv = 1.0f / sqrtf(dot(x, x, n) / (float)n + eps);
    for (int i = 0; i < n; i++) y[i] = x[i] * inv * w[i];
}

static int all_finite(const float *x, int n) {
    int ok = 1;
    for (int i = 0; i < n; i++) ok &= isfinite(x[i]) != 0;
    return ok;
}

/* y = M x (+ bias), x prepared by one thread (prepared: shared scratch), y whole when it returns */
static void matvec(const Matrix *m, int int8, const float *x, float *prepared, float *y) {
    if (int8 || m->type == Q4_0 || m->type == Q4_1) {
        #pragma omp single
        kvlab_matrix_prepare(m, int8, x, prepared);
    }
    kvlab_matrix_rows(m, int8, x, prepared, y);
    #pragma omp barrier
}

/* -- the one read of dense rows (decode.h) ------------------------------------------------------------------- */
/* s[j] = scale * (q . k[j]) for j < n, rows by pointer. Sixteen keys at a time: each key's 16 lane partial sums, then
 * all sixteen folded pairwise in four rounds (15 folds) into one vector whose lane i is key i's sum: a fixed tree,
 * far fewer shuffles than a lane tree per key. The rest (and d not a multiple of 16): dot(), one key at a time. */
static void row_scores(const float *q, const float *const *k, int n, int d, float scale, float *s) {
    int j = 0;
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
    /* AVX2: four keys at a time by the same tree (kvlab_scores4, the same bits); the keys past the last sixteen
     * through dot(), as below */
    if (d % 16 == 0)
        for (; j + 4 <= n / 16 * 16; j += 4) _mm_storeu_ps(s + j, _mm_mul_ps(kvlab_scores4(q, k + j, d), _mm_set1_ps(scale)));
#else
    if (d % 16 == 0)
        for (; j + 16 <= n; j += 16) {
            kvlab_lanes16 acc[16];
            for (int i = 0; i < 16; i++) acc[i] = (kvlab_lanes16){0};
            for (int c = 0; c < d; c += 16) {
                const kvlab_lanes16 qc = kvlab_lanes_at(q + c);
                for (int i = 0; i < 16; i++) acc[i] += qc * kvlab_lanes_at(k[j + i] + c);
            }
            for (int width = 16; width > 1; width /= 2)
                for (int i = 0; i < width / 2; i++) acc[i] = kvlab_fold16(acc[2 * i], acc[2 * i + 1]);
            const kvlab_lanes16 sums = acc[0] * scale;
            memcpy(s + j, &sums, sizeof sums);
        }
#endif
    for (; j < n; j++) s[j] = dot(q, k[j], d) * scale;
}

/* keys t0 .. t0 + n - 1 of `rows_of` (`width` elements a row) asked for ahead of their read, a block's run at a time */
static void prefetch_dense_rows(const DenseHead *h, const void *rows_of, int width, const int32_t *table, int64_t t0, int n) {
    const int64_t elem = h->type == KV_F32 ? 4 : 2;
    for (int64_t t = t0; t < t0 + n;) {
        const int64_t offset = t % h->block_rows, run = h->block_rows - offset < t0 + n - t ? h->block_rows - offset : t0 + n - t;
        kvlab_prefetch_lines((const uint8_t *)rows_of + ((int64_t)table[t / h->block_rows] * h->block_stride + offset) * width * elem,
                             run * width * elem);
        t += run;
    }
}

/* rows[j] = keys t0 + j (j < n) of `rows_of` (h->k or h->v, `width` elements a row) as fp32: pointers into fp32 rows,
 * else the rows converted into tile */
static void dense_rows(const DenseHead *h, const void *rows_of, int width, const int32_t *table, int64_t t0, int n,
                       float *tile, const float **rows) {
    int64_t block = t0 / h->block_rows, offset = t0 % h->block_rows;   /* key t0 + j: no division per key */
    for (int j = 0; j < n; j++) {
        const int64_t at = ((int64_t)table[block] * h->block_stride + offset) * width;
        if (h->type == KV_F32)
            rows[j] = (const float *)rows_of + at;
        else {
            kv_load(h->type, (const uint16_t *)rows_of + at, width, tile + (int64_t)j * width);
            rows[j] = tile + (int64_t)j * width;
        }
        if (++offset == h->block_rows) offset = 0, block++;
    }
}


/* A read of more than FEW_QUERIES queries (a prompt chunk's tile of query rows) computes like a matrix product:
 * the scores of BLOCK_QUERIES queries x sixteen keys at a time from the keys transposed, each score one FMA chain over
 * the channels, and the value mix of BLOCK_QUERIES queries x sixteen channels at a time, each channel's sum in key
 * order, so that every key and value row is loaded once per block of queries instead of once per query. */
#define FEW_QUERIES 8


#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
#define BLOCK_QUERIES 6   /* 6 queries x 16 keys or channels: twelve accumulators of the sixteen AVX registers */
/* A <= BLOCK_QUERIES queries' scores against the sixteen transposed keys kt, each an FMA chain over the channels in two
 * eight-key halves */
static inline __attribute__((always_inline)) void scores_block(int A, const float *q, int d, const float *kt, float scale,
                                                               float *out) {
    __m256 lo[BLOCK_QUERIES], hi[BLOCK_QUERIES];
    for (int a = 0; a < A; a++) lo[a] = hi[a] = _mm256_setzero_ps();
    for (int c = 0; c < d; c++) {
        const __m256 k_lo = _mm256_loadu_ps(kt + c * 16), k_hi = _mm256_loadu_ps(kt + c * 16 + 8);
        for (int a = 0; a < A; a++) {
            const __m256 qa = _mm256_broadcast_ss(q + a * d + c);
            lo[a] = _mm256_fmadd_ps(qa, k_lo, lo[a]);
            hi[a] = _mm256_fmadd_ps(qa, k_hi, hi[a]);
        }
    }
    for (int a = 0; a < A; a++) {
        _mm256_storeu_ps(out + a * DENSE_READ_KEYS, _mm256_mul_ps(lo[a], _mm256_set1_ps(scale)));
        _mm256_storeu_ps(out + a * DENSE_READ_KEYS + 8, _mm256_mul_ps(hi[a], _mm256_set1_ps(scale)));
    }
}

/* A queries' value mix over m rows, channels c .. c + 15 (o[a]: query a's sums, p[a]: its weights) */
static inline __attribute__((always_inline)) void mix_block(int A, float *const *o, const float *const *p,
                                                            const float *const *rows, int m, int c) {
    __m256 lo[BLOCK_QUERIES], hi[BLOCK_QUERIES];
    for (int a = 0; a < A; a++) lo[a] = _mm256_loadu_ps(o[a] + c), hi[a] = _mm256_loadu_ps(o[a] + c + 8);
    for (int j = 0; j < m; j++) {
        const __m256 v_lo = _mm256_loadu_ps(rows[j] + c), v_hi = _mm256_loadu_ps(rows[j] + c + 8);
        for (int a = 0; a < A; a++) {
            const __m256 w = _mm256_broadcast_ss(p[a] + j);
            lo[a] = _mm256_fmadd_ps(w, v_lo, lo[a]);
            hi[a] = _mm256_fmadd_ps(w, v_hi, hi[a]);
        }
    }
    for (int a = 0; a < A; a++) _mm256_storeu_ps(o[a] + c, lo[a]), _mm256_storeu_ps(o[a] + c + 8, hi[a]);
}
#else
#define BLOCK_QUERIES 4
static inline __attribute__((always_inline)) void scores_block(int A, const float *q, int d, const float *kt, float scale,
                                                               float *out) {
    kvlab_lanes16 acc[BLOCK_QUERIES];
    for (int a = 0; a < A; a++) acc[a] = (kvlab_lanes16){0};
    for (int c = 0; c < d; c++) {
        const kvlab_lanes16 k = kvlab_lanes_at(kt + c * 16);
        for (int a = 0; a < A; a++) acc[a] += q[a * d + c] * k;
    }
    for (int a = 0; a < A; a++) {
        acc[a] *= scale;
        memcpy(out + a * DENSE_READ_KEYS, &acc[a], sizeof acc[a]);
    }
}

static inline __attribute__((always_inline)) void mix_block(int A, float *const *o, const float *const *p,
                                                            const float *const *rows, int m, int c) {
    kvlab_lanes16 acc[BLOCK_QUERIES];
    for (int a = 0; a < A; a++) acc[a] = kvlab_lanes_at(o[a] + c);
    for (int j = 0; j < m; j++) {
        const kvlab_lanes16 v = kvlab_lanes_at(rows[j] + c);
        for (int a = 0; a < A; a++) acc[a] += p[a][j] * v;
    }
    for (int a = 0; a < A; a++) memcpy(o[a] + c, &acc[a], sizeof acc[a]);
}
#endif

/* scores[i * DENSE_READ_KEYS + j] = scale * (q_i . k_j) for the m <= DENSE_TILE keys rows[j], i < nq (keys past m up to
 * the next sixteen get scores that are not read); kt: scratch for sixteen keys transposed (d x 16) */
static void many_scores(const float *queries, int nq, const float *const *rows, int m, int d, float scale, float *kt,
                        float *scores) {
    for (int j = 0; j < m; j += 16) {
        const float *group[16];
        for (int r = 0; r < 16; r++) group[r] = rows[j + r < m ? j + r : m - 1];
        kvlab_transpose_rows(group, d, kt);
        for (int i = 0; i < nq; i += BLOCK_QUERIES) {   /* the last block's size a constant in each call */
            const float *q = queries + (int64_t)i * d;
            float *out = scores + (int64_t)i * DENSE_READ_KEYS + j;
            switch (nq - i < BLOCK_QUERIES ? nq - i : BLOCK_QUERIES) {
            case 1: scores_block(1, q, d, kt, scale, out); break;
            case 2: scores_block(2, q, d, kt, scale, out); break;
            case 3: scores_block(3, q, d, kt, scale, out); break;
            case 4: scores_block(4, q, d, kt, scale, out); break;
#if BLOCK_QUERIES > 4
            case 5: scores_block(5, q, d, kt, scale, out); break;
            default: scores_block(6, q, d, kt, scale, out); break;
#endif
            }
        }
    }
}

/* parts[i * part_stride + c] += sum_j p_i[j] v_j[c] for the m value rows rows[j], p_i = p + i * DENSE_READ_KEYS, i < nq */
static void many_mix(float *parts, int64_t part_stride, int nq, const float *p, const float *const *rows, int m, int dv) {
    for (int i = 0; i < nq; i += BLOCK_QUERIES) {
        const int A = nq - i < BLOCK_QUERIES ? nq - i : BLOCK_QUERIES;
        float *o[BLOCK_QUERIES];
        const float *pa[BLOCK_QUERIES];
        for (int a = 0; a < A; a++) o[a] = parts + (i + a) * part_stride, pa[a] = p + (int64_t)(i + a) * DENSE_READ_KEYS;
        for (int c = 0; c < dv; c += 16)
            switch (A) {   /* the block's size a constant in each call */
            case 1: mix_block(1, o, pa, rows, m, c); break;
            case 2: mix_block(2, o, pa, rows, m, c); break;
            case 3: mix_block(3, o, pa, rows, m, c); break;
            case 4: mix_block(4, o, pa, rows, m, c); break;
#if BLOCK_QUERIES > 4
            case 5: mix_block(5, o, pa, rows, m, c); break;
            default: mix_block(6, o, pa, rows, m, c); break;
#endif
            }
    }
}

/* each query's scores (nq, DENSE_READ_KEYS) over n keys -> e^(s - top) in place, and its part's top and sum, its sums
 * zeroed for the value mix */
static void softmax_parts(float *scores, int nq, int n, int dv, float *parts, int64_t part_stride) {
    for (int i = 0; i < nq; i++) {
        float *s = scores + (int64_t)i * DENSE_READ_KEYS, *part = parts + i * part_stride, top = kvlab_row_max(s, n);
        part[dv + 1] = exp_shifted(s, n, top);
        part[dv] = top;
        memset(part, 0, sizeof(float) * (size_t)dv);
    }
}

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
/* AVX2, a decode step's few queries: the rows read in place, each 16-bit row converted in registers as it is used by a
 * pass of up to FEW_PASS queries (no tile of converted rows stored and read back per query). Every key's score is
 * summed as kvlab_scores4 sums it (two eight-lane FMA chains over the channels, folded by one tree; the tile read takes
 * the keys past the last sixteen through dot() instead) and each channel's value sum runs over the keys in order, as
 * in kvlab_rows_mix. */
#define HAVE_FEW_READ 1
#define FEW_AHEAD 8   /* keys scored between two rounds of asking for rows ahead */
#define FEW_PASS 3   /* queries a pass: 3 x 2 keys x 2 chains, or 3 x 32 channels: twelve accumulators */
#define AI static inline __attribute__((always_inline))

/* channels c .. c + 7 of a stored row as fp32 (exact) */
AI __m256 row8(int type, const uint8_t *row, int c) {
    return type == KV_F32 ? _mm256_loadu_ps((const float *)row + c) : kv_load8(type, (const uint16_t *)row + c);
}

/* out[i * DENSE_READ_KEYS + r] = scale * (q_i . row r) for P queries (queries + i * d) and R keys */
AI void few_scores(int type, int P, int R, const float *queries, int d, const uint8_t *const *rows, float scale, float *out) {
    __m256 lo[FEW_PASS][2], hi[FEW_PASS][2];
    for (int i = 0; i < P; i++)
        for (int r = 0; r < R; r++) lo[i][r] = hi[i][r] = _mm256_setzero_ps();
    for (int c = 0; c < d; c += 16) {
        __m256 k_lo[2], k_hi[2];
        for (int r = 0; r < R; r++) k_lo[r] = row8(type, rows[r], c), k_hi[r] = row8(type, rows[r], c + 8);
        for (int i = 0; i < P; i++) {
            const __m256 q0 = _mm256_loadu_ps(queries + (int64_t)i * d + c), q1 = _mm256_loadu_ps(queries + (int64_t)i * d + c + 8);
            for (int r = 0; r < R; r++) {
                lo[i][r] = _mm256_fmadd_ps(q0, k_lo[r], lo[i][r]);
                hi[i][r] = _mm256_fmadd_ps(q1, k_hi[r], hi[i][r]);
            }
        }
    }
    for (int i = 0; i < P; i++) {   /* a key's sum does not depend on the keys folded beside it */
        float sums[4];
        _mm_storeu_ps(sums, _mm_mul_ps(kvlab_fold4(lo[i][0], lo[i][R - 1], lo[i][0], lo[i][0], hi[i][0], hi[i][R - 1], hi[i][0], hi[i][0]),
                                       _mm_set1_ps(scale)));
        for (int r = 0; r < R; r++) out[(int64_t)i * DENSE_READ_KEYS + r] = sums[r];
    }
}

/* o_i[c .. c + 32) += sum_j p_i[j] row_j[c ..] for P queries (o_i = parts + i * part_stride, p_i = p + i * DENSE_READ_KEYS)
 * over m rows */
AI void few_mix(int type, int P, float *parts, int64_t part_stride, const float *p, const uint8_t *const *rows, int m, int c) {
    __m256 a[FEW_PASS][4];
    for (int i = 0; i < P; i++)
        for (int k = 0; k < 4; k++) a[i][k] = _mm256_loadu_ps(parts + i * part_stride + c + 8 * k);
    for (int j = 0; j < m; j++) {
        __m256 v[4];
        for (int k = 0; k < 4; k++) v[k] = row8(type, rows[j], c + 8 * k);
        for (int i = 0; i < P; i++) {
            const __m256 w = _mm256_broadcast_ss(p + (int64_t)i * DENSE_READ_KEYS + j);
            for (int k = 0; k < 4; k++) a[i][k] = _mm256_fmadd_ps(w, v[k], a[i][k]);
        }
    }
    for (int i = 0; i < P; i++)
        for (int k = 0; k < 4; k++) _mm256_storeu_ps(parts + i * part_stride + c + 8 * k, a[i][k]);
}

/* one pass's scores over m keys and its mix, each query count, key count and storage type its own copy */
#define FEW_TYPES(call, type) \
    switch (type) { case KV_F32: call(KV_F32); break; case KV_F16: call(KV_F16); break; default: call(KV_BF16); break; }
static void few_pass_scores(int type, int P, const float *q, int d, const uint8_t *const *rows, int m, float scale, float *out) {
    for (int j = 0; j < m; j += 2) {
#define SCORES(T) \
        switch (P * 2 + (m - j > 1)) { \
        case 2: few_scores(T, 1, 1, q, d, rows + j, scale, out + j); break; case 3: few_scores(T, 1, 2, q, d, rows + j, scale, out + j); break; \
        case 4: few_scores(T, 2, 1, q, d, rows + j, scale, out + j); break; case 5: few_scores(T, 2, 2, q, d, rows + j, scale, out + j); break; \
        case 6: few_scores(T, 3, 1, q, d, rows + j, scale, out + j); break; default: few_scores(T, 3, 2, q, d, rows + j, scale, out + j); break; }
        FEW_TYPES(SCORES, type)
#undef SCORES
    }
}

static void few_pass_mix(int type, int P, float *parts, int64_t part_stride, const float *p, const uint8_t *const *rows, int m, int dv) {
    for (int c = 0; c < dv; c += 32) {
#define MIX(T) \
        switch (P) { case 1: few_mix(T, 1, parts, part_stride, p, rows, m, c); break; \
                     case 2: few_mix(T, 2, parts, part_stride, p, rows, m, c); break; \
                     default: few_mix(T, 3, parts, part_stride, p, rows, m, c); break; }
        FEW_TYPES(MIX, type)
#undef MIX
    }
}

/* kvlab_dense_read of up to FEW_QUERIES queries, d a multiple of 16 and dv of 32: passes of up to FEW_PASS queries over
 * the rows where they are stored, FEW_AHEAD keys scored at a time while the FEW_AHEAD keys after them and their own
 * values are asked for (a few lines each time: asking for a whole tile at once stalled the read), then the values
 * mixed DENSE_TILE rows at a time */
static void few_read(const DenseHead *h, const int32_t *table, int64_t k0, int64_t k1, const float *queries, int nq,
                     float scale, float *scores, float *parts, int64_t part_stride) {
    const int d = h->d, dv = h->dv, n = (int)(k1 - k0), elem = h->type == KV_F32 ? 4 : 2;
    const uint8_t *keys[DENSE_READ_KEYS], *values[DENSE_READ_KEYS];
    int64_t block = k0 / h->block_rows, offset = k0 % h->block_rows;   /* key k0 + j: no division per key */
    for (int j = 0; j < n; j++) {
        const int64_t row = (int64_t)table[block] * h->block_stride + offset;
        keys[j] = (const uint8_t *)h->k + row * d * elem, values[j] = (const uint8_t *)h->v + row * dv * elem;
        if (++offset == h->block_rows) offset = 0, block++;
    }
    const int passes = (nq + FEW_PASS - 1) / FEW_PASS;
    const int64_t key_bytes = (int64_t)d * elem, value_bytes = (int64_t)dv * elem;
    for (int j0 = 0; j0 < n; j0 += FEW_AHEAD) {
        const int m = n - j0 < FEW_AHEAD ? n - j0 : FEW_AHEAD;
        for (int j = j0; j < j0 + m; j++) {   /* keys FEW_AHEAD ahead and this run's values, a few lines at a time */
            if (j + FEW_AHEAD < n) kvlab_prefetch_lines(keys[j + FEW_AHEAD], key_bytes);
            kvlab_prefetch_lines(values[j], value_bytes);
        }
        for (int i = 0, pass = 0; i < nq; pass++) {   /* passes of sizes as even as they go: 4 = 2 + 2, 8 = 3 + 3 + 2 */
            const int P = (nq - i + passes - pass - 1) / (passes - pass);
            few_pass_scores(h->type, P, queries + (int64_t)i * d, d, keys + j0, m, scale, scores + (int64_t)i * DENSE_READ_KEYS + j0);
            i += P;
        }
    }
    softmax_parts(scores, nq, n, dv, parts, part_stride);
    for (int j0 = 0; j0 < n; j0 += DENSE_TILE) {
        const int m = n - j0 < DENSE_TILE ? n - j0 : DENSE_TILE;
        for (int i = 0, pass = 0; i < nq; pass++) {
            const int P = (nq - i + passes - pass - 1) / (passes - pass);
            few_pass_mix(h->type, P, parts + i * part_stride, part_stride, scores + (int64_t)i * DENSE_READ_KEYS + j0, values + j0, m, dv);
            i += P;
        }
    }
}
#undef AI
#endif

void kvlab_dense_read(const DenseHead *h, const int32_t *table, int64_t k0, int64_t k1, const float *queries, int nq,
                      float scale, float *scratch, float *parts, int64_t part_stride) {
    const int d = h->d, dv = h->dv, n = (int)(k1 - k0);
#ifdef HAVE_ATTEND_ROWS
    /* one run of a block: in place, the queries in passes that share each row's load (a decode step's few queries;
     * the many of a prompt chunk's tile share each tile below) */
    if (d == dv && d % 16 == 0 && d <= 128 && k0 / h->block_rows == (k1 - 1) / h->block_rows && nq <= FEW_QUERIES) {
        const size_t elem = h->type == KV_F32 ? 4 : 2;
        const int64_t at = ((int64_t)table[k0 / h->block_rows] * h->block_stride + k0 % h->block_rows) * d;
        attend_rows(h->type, queries, nq, (const uint8_t *)h->k + at * elem, (const uint8_t *)h->v + at * elem, n, d, scale,
                    scratch, parts, part_stride);
        return;
    }
#endif
#ifdef HAVE_FEW_READ
    if (nq <= FEW_QUERIES && d % 16 == 0 && dv % 32 == 0) {
        few_read(h, table, k0, k1, queries, nq, scale, scratch, parts, part_stride);
        return;
    }
#endif
    float *scores = scratch, *tile = scratch + (int64_t)nq * DENSE_READ_KEYS;   /* (nq, DENSE_READ_KEYS), a tile */
    float *kt = tile + (int64_t)DENSE_TILE * (d > dv ? d : dv);                  /* (d, 16): sixteen keys transposed */
    const int blocked = nq > FEW_QUERIES && d % 16 == 0 && dv % 16 == 0;
    const float *rows[DENSE_TILE];
    for (int j0 = 0; j0 < n; j0 += DENSE_TILE) {
        const int m = n - j0 < DENSE_TILE ? n - j0 : DENSE_TILE;
        if (j0 + m < n) prefetch_dense_rows(h, h->k, d, table, k0 + j0 + m, n - j0 - m < DENSE_TILE ? n - j0 - m : DENSE_TILE);
        prefetch_dense_rows(h, h->v, dv, table, k0 + j0, m);
        dense_rows(h, h->k, d, table, k0 + j0, m, tile, rows);
        if (blocked)
            many_scores(queries, nq, rows, m, d, scale, kt, scores + j0);
        else
            for (int i = 0; i < nq; i++) row_scores(queries + (int64_t)i * d, rows, m, d, scale, scores + (int64_t)i * DENSE_READ_KEYS + j0);
    }
    softmax_parts(scores, nq, n, dv, parts, part_stride);
    for (int j0 = 0; j0 < n; j0 += DENSE_TILE) {
        const int m = n - j0 < DENSE_TILE ? n - j0 : DENSE_TILE;
        dense_rows(h, h->v, dv, table, k0 + j0, m, tile, rows);
        if (blocked)
            many_mix(parts, part_stride, nq, scores + j0, rows, m, dv);
        else
            for (int i = 0; i < nq; i++) kvlab_rows_mix(parts + i * part_stride, scores + (int64_t)i * DENSE_READ_KEYS + j0, rows, m, dv);
    }
}

/* x (d,) = y Mᵀ = Σ_j y_j Mᵀ[j]: rows of Mᵀ (`unrotation`) added in order, 64 lanes at a time in eight independent
 * FMA chains (even and odd j apart) under AVX-512 when d is a multiple of 64, else a loop the compiler vectorizes */
static void unrotate(const float *y, const float *unrotation, int d, float *x) {
#if defined(__AVX512F__)
    if (d % 64 == 0) {
        for (int c = 0; c < d; c += 64) {
            __m512 acc[8] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(),
                             _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
            for (int j = 0; j < d; j += 2)
                for (int h = 0; h < 2; h++) {
                    const __m512 yj = _mm512_set1_ps(y[j + h]);
                    const float *row = unrotation + (int64_t)(j + h) * d + c;
                    for (int b = 0; b < 4; b++) acc[4 * h + b] = _mm512_fmadd_ps(yj, _mm512_loadu_ps(row + 16 * b), acc[4 * h + b]);
                }
            for (int b = 0; b < 4; b++) _mm512_storeu_ps(x + c + 16 * b, _mm512_add_ps(acc[b], acc[4 + b]));
        }
        return;
    }
#endif
    for (int c = 0; c < d; c++) x[c] = 0.0f;
    for (int j = 0; j < d; j++) {
        const float yj = y[j], *row = unrotation + (int64_t)j * d;
        for (int c = 0; c < d; c++) x[c] += yj * row[c];
    }
}

/* x (d,) = H y in place for each of `rows` rows of d floats, H the Sylvester Hadamard matrix of order d (a power of
 * two): log2 d butterfly stages, (a, b) -> (a + b, a - b) for each pair h apart. The plain reference of
 * rebuild_hadamard_rows. */
static void hadamard_rows(float *rows_, int rows, int d) {
    for (int r = 0; r < rows; r++) {
        float *x = rows_ + (int64_t)r * d;
        for (int h = 1; h < d; h *= 2)
            for (int i = 0; i < d; i += 2 * h)
                for (int j = i; j < i + h; j++) {
                    const float a = x[j], b = x[j + h];
                    x[j] = a + b;
                    x[j + h] = a - b;
                }
    }
}

/* RoPE of one rebuilt key, pairs (i, i + d/2) as rope(), reading only the first half of the cos / sin rows (the
 * second repeats it) */
static void rope_half_table(float *x, const float *cos_, const float *sin_, int d) {
    const int half = d / 2;
    for (int i = 0; i < half; i++) {
        const float x1 = x[i], x2 = x[i + half];
        x[i] = x1 * cos_[i] - x2 * sin_[i];
        x[i + half] = x2 * cos_[i] + x1 * sin_[i];
    }
}

/* factor (d,) = s/√d (a randomized Hadamard's signs) times the key channel weight w, per channel: what a rebuilt key's
 * channel is multiplied by besides its scale */
static void prerope_factor(const PreRope *pre, int d, float *factor) {
    for (int c = 0; c < d; c++) factor[c] = (pre->signs ? pre->signs[c] : 1.0f) * (pre->weights ? pre->weights[c] : 1.0f);
}

#if defined(__AVX512F__)
#define REBUILD_INLINE static inline __attribute__((always_inline))
/* the sign vectors of the Hadamard stages inside a 16-lane block: +1 below, -1 on the lanes whose bit h is set */
REBUILD_INLINE void hadamard_signs(__m512 *sign) {
    static const __mmask16 upper[4] = {0xaaaa, 0xcccc, 0xf0f0, 0xff00};
    for (int step = 0; step < 4; step++) sign[step] = _mm512_mask_blend_ps(upper[step], _mm512_set1_ps(1.0f), _mm512_set1_ps(-1.0f));
}

/* v[0 .. d/16) = one decoded row ŷ (d floats at y) rebuilt as the plain path makes it (hadamard_rows, then
 * x · factor · scale + offset, then rope_half_table with the row's cos / sin), in registers: the Hadamard stages
 * h = 1, 2, 4, 8 inside each 16-lane block as one shuffle and one FMA (x ± partner: lanes whose bit h is set take
 * partner - x), the wider ones between blocks. d a multiple of 32 (RoPE halves of whole blocks); inlined with d = 64,
 * every block stays in a register. */
REBUILD_INLINE void rebuild_row(const float *y, int d, const __m512 *sign, const float *factor, float scale,
                                const float *offset, const float *c_row, const float *s_row, __m512 *v) {
    const int blocks = d / 16, half = blocks / 2;
    for (int b = 0; b < blocks; b++) v[b] = _mm512_loadu_ps(y + 16 * b);
    /* partner j ^ h: h = 1, 2 inside 128-bit lanes, h = 4, 8 whole 128-bit lanes (cheaper than a full permute) */
    for (int b = 0; b < blocks; b++) v[b] = _mm512_fmadd_ps(v[b], sign[0], _mm512_permute_ps(v[b], 0xb1));
    for (int b = 0; b < blocks; b++) v[b] = _mm512_fmadd_ps(v[b], sign[1], _mm512_permute_ps(v[b], 0x4e));
    for (int b = 0; b < blocks; b++) v[b] = _mm512_fmadd_ps(v[b], sign[2], _mm512_shuffle_f32x4(v[b], v[b], 0xb1));
    for (int b = 0; b < blocks; b++) v[b] = _mm512_fmadd_ps(v[b], sign[3], _mm512_shuffle_f32x4(v[b], v[b], 0x4e));
    if (blocks == 4) {   /* pairs of blocks 1 apart, then 2 apart, spelled out: GCC keeps the loop's blocks on the stack */
        const __m512 a = _mm512_add_ps(v[0], v[1]), b = _mm512_sub_ps(v[0], v[1]);
        const __m512 c = _mm512_add_ps(v[2], v[3]), e = _mm512_sub_ps(v[2], v[3]);
        v[0] = _mm512_add_ps(a, c), v[2] = _mm512_sub_ps(a, c), v[1] = _mm512_add_ps(b, e), v[3] = _mm512_sub_ps(b, e);
    } else {
        for (int h = 1; h < blocks; h *= 2)        /* pairs of blocks h apart */
            for (int i = 0; i < blocks; i += 2 * h)
                for (int j = i; j < i + h; j++) {
                    const __m512 a = v[j], c = v[j + h];
                    v[j] = _mm512_add_ps(a, c);
                    v[j + h] = _mm512_sub_ps(a, c);
                }
    }
    const __m512 s = _mm512_set1_ps(scale);
    for (int b = 0; b < blocks; b++) {
        const __m512 f = _mm512_mul_ps(_mm512_loadu_ps(factor + 16 * b), s);
        v[b] = offset ? _mm512_fmadd_ps(v[b], f, _mm512_loadu_ps(offset + 16 * b)) : _mm512_mul_ps(v[b], f);
    }
    for (int b = 0; b < half; b++) {
        const __m512 x1 = v[b], x2 = v[b + half];
        const __m512 c = _mm512_loadu_ps(c_row + 16 * b), sn = _mm512_loadu_ps(s_row + 16 * b);
        v[b] = _mm512_fnmadd_ps(x2, sn, _mm512_mul_ps(x1, c));
        v[b + half] = _mm512_fmadd_ps(x1, sn, _mm512_mul_ps(x2, c));
    }
}

/* rows (rows, d) of decoded ŷ -> rebuilt keys in place (rebuild_row) */
static void rebuild_hadamard_rows(float *rows, int count, int d, const float *factor, const float *scale,
                                  const float *offset, const float *cos_, const float *sin_) {
    __m512 sign[4], v[CB_MAX_DIM / 16];
    hadamard_signs(sign);
    for (int r = 0; r < count; r++) {
        float *x = rows + (int64_t)r * d;
        if (d == 64) rebuild_row(x, 64, sign, factor, scale[r], offset, cos_ + (int64_t)r * d, sin_ + (int64_t)r * d, v);
        else rebuild_row(x, d, sign, factor, scale[r], offset, cos_ + (int64_t)r * d, sin_ + (int64_t)r * d, v);
        for (int b = 0; b < d / 16; b++) _mm512_storeu_ps(x + 16 * b, v[b]);
    }
}

/* out[i * out_stride + r] = q_i . (row r rebuilt) for the nq (<= 4) queries q_i = queries + i * q_stride and the 16
 * rows of decoded ŷ (64 floats each) from `rows`, each rebuilt once in registers and read by every query: the same bits
 * as rebuild_hadamard_rows, then key_scores_rows on the tile (each key's partials, then the same fold tree, folded as
 * the keys come); nq a constant where inlined */
REBUILD_INLINE void prerope_scores16(const float *rows, const float *factor, const float *scale, const float *offset,
                                     const float *cos_, const float *sin_, const float *queries, int64_t q_stride,
                                     const int nq, float *out, int64_t out_stride) {
    __m512 sign[4], q[4][4], level[4][4];   /* level[i][s]: query i's fold waiting at step s */
    __m512i lo[4], hi[4];
    hadamard_signs(sign);
    fold_indices(lo, hi);
    for (int i = 0; i < nq; i++)
        for (int b = 0; b < 4; b++) q[i][b] = _mm512_loadu_ps(queries + i * q_stride + 16 * b);
    for (int r = 0; r < 16; r++) {
        __m512 v[4];
        rebuild_row(rows + 64 * r, 64, sign, factor, scale[r], offset, cos_ + 64 * r, sin_ + 64 * r, v);
        for (int i = 0; i < nq; i++) {
            __m512 acc = _mm512_mul_ps(q[i][0], v[0]);
            for (int b = 1; b < 4; b++) acc = _mm512_fmadd_ps(q[i][b], v[b], acc);
            /* key r closes the folds of steps s while bit s of r is set (key_scores_rows' tree, depth first) */
            int step = 0;
            for (; step < 4 && (r >> step & 1); step++) acc = fold(level[i][step], acc, lo[step], hi[step]);
            if (step < 4) level[i][step] = acc;
            else _mm512_storeu_ps(out + i * out_stride, acc);
        }
    }
}

/* prerope_scores16 for nq queries, four at a time */
static void prerope_scores(const float *rows, const float *factor, const float *scale, const float *offset,
                           const float *cos_, const float *sin_, const float *queries, int64_t q_stride, int nq,
                           float *out, int64_t out_stride) {
    for (int i0 = 0; i0 < nq; i0 += 4) {
        const float *qi = queries + i0 * q_stride;
        float *oi = out + i0 * out_stride;
        switch (nq - i0 < 4 ? nq - i0 : 4) {
            case 1: prerope_scores16(rows, factor, scale, offset, cos_, sin_, qi, q_stride, 1, oi, out_stride); break;
            case 2: prerope_scores16(rows, factor, scale, offset, cos_, sin_, qi, q_stride, 2, oi, out_stride); break;
            case 3: prerope_scores16(rows, factor, scale, offset, cos_, sin_, qi, q_stride, 3, oi, out_stride); break;
            default: prerope_scores16(rows, factor, scale, offset, cos_, sin_, qi, q_stride, 4, oi, out_stride); break;
        }
    }
}
#define HAVE_PREROPE_SCORES 1
#endif

/* rows (count, d) of decoded ŷ -> the keys as TurboQuantCache._keys rebuilds them, in place: k = (ŷ Mᵀ · scale) ⊙ w
 * + μ, then RoPE at the row's position (row r: pre->cos_/sin_ + r * d, its scale scale[r]). ŷ Mᵀ is a Hadamard
 * transform and a sign per channel where M is a randomized Hadamard (pre->signs), the d x d product otherwise; the
 * signs and weights are one factor per channel (prerope_factor). kvlab_tq_read's tiles that prerope_scores does not
 * take (a block's last rows, head dims other than 64, builds without AVX-512). */
static void prerope_rebuild(float *rows, int count, int d, const PreRope *pre, const float *factor, const float *scale) {
    float key[CB_MAX_DIM];
#if defined(__AVX512F__)
    if (pre->signs && d % 32 == 0) {
        rebuild_hadamard_rows(rows, count, d, factor, scale, pre->offset, pre->cos_, pre->sin_);
        return;
    }
#endif
    if (pre->signs) hadamard_rows(rows, count, d);
    for (int r = 0; r < count; r++) {
        float *row = rows + (int64_t)r * d;
        const float *x = row;
        if (!pre->signs) {
            unrotate(row, pre->unrotation, d, key);
            x = key;
        }
        if (pre->offset)
            for (int c = 0; c < d; c++) row[c] = x[c] * (factor[c] * scale[r]) + pre->offset[c];
        else
            for (int c = 0; c < d; c++) row[c] = x[c] * (factor[c] * scale[r]);
        rope_half_table(row, pre->cos_ + (int64_t)r * d, pre->sin_ + (int64_t)r * d, d);
    }
}

/* out (d,) = the softmax-weighted sum over all keys, from the parts of n_parts key chunks (in order). Parts
 * [rot_lo, rot_hi) are coded chunks, summed in the rotated domain (y = x M): that sum turns back once, x = y Mᵀ,
 * and gains the value offset (if any) times the coded keys' share of the attention. */
static void combine_parts(const float *parts, int n_parts, int d, int rot_lo, int rot_hi, const float *rotation,
                          const float *v_offset, float *out) {
    float top, coded = 0.0f, rot[CB_MAX_DIM];
    const float total = kvlab_merge_parts(parts, d + 2, n_parts, d, rot_lo, rot_hi, out, rot, &coded, &top);
    if (rot_hi > rot_lo)
        for (int i = 0; i < d; i++) out[i] += dot(rotation + (int64_t)i * d, rot, d);
    const float inv = 1.0f / total;
    for (int i = 0; i < d; i++) out[i] *= inv;
    if (rot_hi > rot_lo && v_offset)
        for (int i = 0; i < d; i++) out[i] += coded * inv * v_offset[i];
}

/* ---- the K/V of a layer ---------------------------------------------------------------------------------
 * A layer's attention reads up to three parts in turn: `first` (full-precision rows: a dense cache's layer, or a
 * TurboQuant layer's sink), `coded` (TurboQuant codes, NULL for a dense layer) and `recent` (full-precision rows:
 * TurboQuant's recent window). The new token goes into one of them (`Fill.write`). */
#define ROW_ROOM CB_MAX_DIM   /* bytes of one coded row at most (d <= CB_MAX_DIM channels of <= 8 bits) */
enum { WRITE_FIRST = 0, WRITE_CODED = 1, WRITE_RECENT = 2, WRITE_SPILL = 3 };  /* SPILL: the window's oldest row is
                                                                                  coded, the new one joins the window */
enum { SCALE_NORM = 0, SCALE_RENORM = 1, SCALE_LSQ = 2, SCALE_UNBIASED = 3 };  /* turboquant.py SCALE_MODES */

/* HeadCodes, Coded: a TurboQuant layer's codes (tqcodes.h); Quantized: an integer layer's (intcodes.h) */

typedef struct {
    int32_t type;                  /* KV_F32, KV_F16 or KV_BF16: how `first` stores K/V */
    int32_t capacity;              /* rows per KV head of first */
    void *k, *v;                   /* first: (Hkv, capacity, hd) */
    const Coded *coded;            /* NULL: a dense layer (first only) */
    int32_t window;                /* rows per KV head of recent (0: none) */
    float *win_k, *win_v;          /* recent: (Hkv, window, hd) fp32 */
    Quantized *quant;              /* an integer layer's codes (then `coded` is NULL), or NULL */
} LayerKV;

typedef struct {                   /* rows a coded layer's parts hold before the step (every coded layer alike), and */
    int32_t first, coded, recent;  /* where the new token goes (WRITE_*); dense layers hold `pos` rows and write there */
    int32_t write;
} Fill;

/* KV head g's coded row of slot t: keys (i = 0) or values (1); the rows after it in its block follow slot_bytes apart */
static uint8_t *coded_row(const Coded *C, int i, int g, int64_t t) {
    return C->codes[i] + t / C->block_rows * C->block_bytes[i] + C->heads[i][g].at + t % C->block_rows * C->slot_bytes[i];
}

/* where KV head g's scale of slot t lies in norms[i]; the rows after it in its block follow */
static int64_t scale_at(const Coded *C, int g, int64_t t) {
    return t / C->block_rows * C->norm_block_stride + (int64_t)g * C->norm_head_stride + t % C->block_rows;
}

/* y (d,) = x M, M (d, d) row-major */
static void rotate(const float *x, const float *M, int d, float *y) {
    for (int j = 0; j < d; j++) y[j] = 0.0f;
    for (int i = 0; i < d; i++)
        for (int j = 0; j < d; j++) y[j] += x[i] * M[(int64_t)i * d + j];
}

static float key_weight(const Coded *C, int g, int d, int c) {
    const uint8_t byte = C->weight_codes[(int64_t)g * (d / 2) + c / 2];
    return C->weight_values[c % 2 ? byte >> 4 : byte & 15];
}

static float log_centre(const Coded *C, int which, int g) { return kvlab_fp16_to_fp32(C->norm_centres[which][g]); }

/* *out = KV head g's key (which = 0) or value (1) scale as stored: f16 / bf16, or with NORM_LOG8 its code
 * round((log2 s - centre)·16) + 128 clamped to 1..255, 0 for a zero scale (turboquant.py _log_norm_codes);
 * returns 1 when the scale is finite (and, 16-bit, stays finite) */
static int store_scale(const Coded *C, int which, int g, float scale, uint16_t *out) {
    if (C->norm_type != NORM_LOG8) return kv_store(C->norm_type, &scale, 1, out);
    if (!isfinite(scale)) return 0;
    float step = nearbyintf((log2f(scale > 1e-30f ? scale : 1e-30f) - log_centre(C, which, g)) * LOG_NORM_STEPS) + LOG_NORM_ZERO;
    step = step < 1.0f ? 1.0f : step > 255.0f ? 255.0f : step;
    *out = scale > 1e-30f ? (uint16_t)step : 0;
    return 1;
}

/* KV head g's key (i = 0) or value (1) scale of slot t = a value store_scale made */
static void put_scale(const Coded *C, int i, int g, int64_t t, uint16_t value) {
    const int64_t slot = scale_at(C, g, t);
    if (C->norm_type == NORM_LOG8) ((uint8_t *)C->norms[i])[slot] = (uint8_t)value;
    else ((uint16_t *)C->norms[i])[slot] = value;
}

/* dst (n,) fp32 = KV head g's key (i = 0) or value (1) scales of slots [t0, t0 + n), rows of one block */
static void load_scales(const Coded *C, int i, int g, int64_t t0, int n, float *dst) {
    const int64_t slot = scale_at(C, g, t0);
    if (C->norm_type != NORM_LOG8) {
        kv_load(C->norm_type, (const uint16_t *)C->norms[i] + slot, n, dst);
        return;
    }
    const uint8_t *codes = (const uint8_t *)C->norms[i] + slot;
    const float centre = log_centre(C, i, g);
    int t = 0;
#if defined(__AVX512F__)
    /* kvlab_log_scale sixteen codes at a time: the step 2^((e mod 16)/16) a lookup in one register, floor(e / 16)
     * an arithmetic shift, the power of two's bits built, code 0 -> 0 (the same floats) */
    const __m512 steps = _mm512_loadu_ps(KVLAB_LOG_STEP_POWERS);
    const __m512i base = _mm512_set1_epi32((int)lrintf(centre * LOG_NORM_STEPS) - LOG_NORM_ZERO);
    for (; t + 16 <= n; t += 16) {
        const __m512i code = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(codes + t)));
        const __m512i e = _mm512_add_epi32(code, base);
        const __m512i octave = _mm512_max_epi32(_mm512_min_epi32(_mm512_srai_epi32(e, 4), _mm512_set1_epi32(127)), _mm512_set1_epi32(-126));
        const __m512 power = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(octave, _mm512_set1_epi32(127)), 23));
        const __m512 value = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_and_si512(e, _mm512_set1_epi32(15)), steps), power);
        _mm512_storeu_ps(dst + t, _mm512_maskz_mov_ps(_mm512_test_epi32_mask(code, code), value));
    }
#elif defined(__AVX2__) && defined(__F16C__)
    /* the same eight at a time: the step from two registers of eight (bit 3 of e picks), code 0 -> 0 */
    const __m256 steps_lo = _mm256_loadu_ps(KVLAB_LOG_STEP_POWERS), steps_hi = _mm256_loadu_ps(KVLAB_LOG_STEP_POWERS + 8);
    const __m256i base = _mm256_set1_epi32((int)lrintf(centre * LOG_NORM_STEPS) - LOG_NORM_ZERO);
    for (; t + 8 <= n; t += 8) {
        const __m256i code = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(codes + t)));
        const __m256i e = _mm256_add_epi32(code, base);
        const __m256i octave = _mm256_max_epi32(_mm256_min_epi32(_mm256_srai_epi32(e, 4), _mm256_set1_epi32(127)), _mm256_set1_epi32(-126));
        const __m256 power = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(octave, _mm256_set1_epi32(127)), 23));
        const __m256i high = _mm256_slli_epi32(e, 28);   /* bit 3 of e in the sign bit: blendv's choice */
        const __m256 step = _mm256_blendv_ps(_mm256_permutevar8x32_ps(steps_lo, e), _mm256_permutevar8x32_ps(steps_hi, e),
                                             _mm256_castsi256_ps(high));
        const __m256 zero = _mm256_castsi256_ps(_mm256_cmpeq_epi32(code, _mm256_setzero_si256()));
        _mm256_storeu_ps(dst + t, _mm256_andnot_ps(zero, _mm256_mul_ps(step, power)));
    }
#endif
    for (; t < n; t++) dst[t] = kvlab_log_scale(codes[t], centre);
}

/* -- +ropemean: each coded key's offset turned to its position (tqcodes.h KeyTurn) ---------------------------------- */
void kvlab_tq_turn_coef(const float *q, const float *mu, int d, float scale, float *out) {
    const int half = d / 2;
    for (int j = 0; j < half; j++) {
        out[j] = (q[j] * mu[j] + q[j + half] * mu[j + half]) * scale;
        out[half + j] = (q[j + half] * mu[j] - q[j] * mu[j + half]) * scale;
    }
}

/* out[i * TQ_READ_KEYS + j] = q_i . R_t μ for keys t = k0 + j < k0 + n: query i's [A | B] (T->coef, laid out as the
 * queries) against key t's cos and sin (first halves). Where AVX-512 or AVX2 is there, runs of TQ_TURN_KEYS keys, then of 16:
 * the coefficients turned once to a key c of the run (A' = A cos cθ + B sin cθ, B' = B cos cθ - A sin cθ), then read
 * against T->steps' columns r = [cos rθ | sin rθ] for keys c ± r, which stay in L1 (the position rows of a long
 * context do not: each key's would cost more bytes than its codes); the rest from the key's own rows. */
#if defined(__AVX512F__)
/* A whole run of TQ_TURN_KEYS keys from t0 for nq (<= 4) queries, by the symmetry of RoPE about its middle key c = t0 +
 * TQ_TURN_KEYS/2: with [A' | B'] turned to c, key c ± u scores E(u) ± O(u), E(u) = Σ_x A'_x cos uθ_x and O(u) = Σ_x
 * B'_x sin uθ_x, so u = 0 .. 31 (steps' first 32 columns) give keys t0 + 1 .. t0 + 63, and key t0 (u = -32) is scored
 * from its own cos / sin rows: half the multiply-adds of turning to t0 and reading 64 columns. cos_/sin_: key t0's rows
 * (d apart per key), half = 16 * blocks. */
/* turned (d,) = [A' | B'], a query's [A | B] (coef) turned to the key whose cos / sin rows (first halves) are given:
 * A' = A cos cθ + B sin cθ, B' = B cos cθ - A sin cθ; half = 16 * blocks */
REBUILD_INLINE void turn_to(const float *coef, const float *cos_, const float *sin_, const int blocks, float *turned) {
    const int half = 16 * blocks;
    for (int b = 0; b < blocks; b++) {
        const __m512 c = _mm512_loadu_ps(cos_ + 16 * b), sn = _mm512_loadu_ps(sin_ + 16 * b);
        const __m512 a = _mm512_loadu_ps(coef + 16 * b), e = _mm512_loadu_ps(coef + half + 16 * b);
        _mm512_storeu_ps(turned + 16 * b, _mm512_fmadd_ps(e, sn, _mm512_mul_ps(a, c)));
        _mm512_storeu_ps(turned + half + 16 * b, _mm512_fnmadd_ps(a, sn, _mm512_mul_ps(e, c)));
    }
}

_Static_assert(TQ_TURN_STEPS == TQ_TURN_KEYS / 2 && TQ_TURN_STEPS == 32, "a run's steps: two vectors of columns");
REBUILD_INLINE void turn_scores_mirrored(const float *cos_, const float *sin_, const float *steps, const float *const *coef,
                                         const int nq, const int blocks, float *const *out) {
    const int half = 16 * blocks, d = 2 * half, mid = TQ_TURN_KEYS / 2;
    const float *cm = cos_ + (int64_t)mid * d, *sm = sin_ + (int64_t)mid * d;   /* the middle key's rows */
    float turned[4][CB_MAX_DIM];   /* each query's [A' | B'] at the middle key */
    float first[4];                /* each query's score of key t0, straight from its rows */
    for (int i = 0; i < nq; i++) {
        turn_to(coef[i], cm, sm, blocks, turned[i]);
        __m512 own = _mm512_setzero_ps();
        for (int b = 0; b < blocks; b++)
            own = _mm512_fmadd_ps(_mm512_loadu_ps(coef[i] + half + 16 * b), _mm512_loadu_ps(sin_ + 16 * b),
                                  _mm512_fmadd_ps(_mm512_loadu_ps(coef[i] + 16 * b), _mm512_loadu_ps(cos_ + 16 * b), own));
        first[i] = _mm512_reduce_add_ps(own);
    }
    __m512 even[4][2], odd[4][2];   /* E(u), O(u) for u = 0..15, 16..31 */
    for (int i = 0; i < nq; i++) even[i][0] = even[i][1] = odd[i][0] = odd[i][1] = _mm512_setzero_ps();
    for (int x = 0; x < half; x++) {   /* steps' rows x (cos) and half + x (sin), columns u = 0 .. 31, read once */
        const float *cx = steps + TQ_TURN_STEPS * (int64_t)x, *sx = steps + TQ_TURN_STEPS * (int64_t)(half + x);
        const __m512 c0 = _mm512_loadu_ps(cx), c1 = _mm512_loadu_ps(cx + 16), s0 = _mm512_loadu_ps(sx), s1 = _mm512_loadu_ps(sx + 16);
        for (int i = 0; i < nq; i++) {
            const __m512 a = _mm512_set1_ps(turned[i][x]), e = _mm512_set1_ps(turned[i][half + x]);
            even[i][0] = _mm512_fmadd_ps(a, c0, even[i][0]);
            even[i][1] = _mm512_fmadd_ps(a, c1, even[i][1]);
            odd[i][0] = _mm512_fmadd_ps(e, s0, odd[i][0]);
            odd[i][1] = _mm512_fmadd_ps(e, s1, odd[i][1]);
        }
    }
    /* key t0 + 32 + u scores E(u) + O(u), key t0 + 32 - u E(u) - O(u): keys t0 + 16 + j are u = 16 - j, keys t0 + j
     * (j >= 1) u = 32 - j, each a permute of the differences */
    const __m512i back_hi = _mm512_setr_epi32(16, 15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1);
    const __m512i back_lo = _mm512_setr_epi32(0, 31, 30, 29, 28, 27, 26, 25, 24, 23, 22, 21, 20, 19, 18, 17);
    for (int i = 0; i < nq; i++) {
        const __m512 lo = _mm512_sub_ps(even[i][0], odd[i][0]), hi = _mm512_sub_ps(even[i][1], odd[i][1]);
        float *o = out[i];
        _mm512_storeu_ps(o, _mm512_mask_mov_ps(_mm512_permutex2var_ps(lo, back_lo, hi), 1, _mm512_set1_ps(first[i])));
        _mm512_storeu_ps(o + 16, _mm512_permutex2var_ps(lo, back_hi, hi));
        _mm512_storeu_ps(o + 32, _mm512_add_ps(even[i][0], odd[i][0]));
        _mm512_storeu_ps(o + 48, _mm512_add_ps(even[i][1], odd[i][1]));
    }
}

/* sixteen keys from t0 (c = t0) for nq (<= 4) queries, half = 16 * blocks: each query's sixteen scores in one vector, a
 * channel's row of steps loaded once for every query, one chain a query */
REBUILD_INLINE void turn_scores_16(const float *cos_, const float *sin_, const float *steps, const float *const *coef,
                                   const int nq, const int blocks, float *const *out) {
    const int half = 16 * blocks;
    float turned[4][CB_MAX_DIM];   /* each query's [A' | B'] */
    for (int i = 0; i < nq; i++) turn_to(coef[i], cos_, sin_, blocks, turned[i]);
    __m512 acc[4];
    for (int i = 0; i < nq; i++) acc[i] = _mm512_setzero_ps();
    for (int x = 0; x < 2 * half; x++) {   /* d = 2 half */
        const __m512 s = _mm512_loadu_ps(steps + TQ_TURN_STEPS * (int64_t)x);
        for (int i = 0; i < nq; i++) acc[i] = _mm512_fmadd_ps(_mm512_set1_ps(turned[i][x]), s, acc[i]);
    }
    for (int i = 0; i < nq; i++) _mm512_storeu_ps(out[i], acc[i]);
}

/* a run of `keys` (TQ_TURN_KEYS or 16) from t0 for m queries (1 to 4), their counts constants */
static void turn_scores_at(const float *c, const float *sn, const float *steps, const float *const *coef, int m, int half,
                           int keys, float *const *o) {
#define TURN_CASE(RUN, BLOCKS) switch (m) { \
        case 1: RUN(c, sn, steps, coef, 1, BLOCKS, o); break; \
        case 2: RUN(c, sn, steps, coef, 2, BLOCKS, o); break; \
        case 3: RUN(c, sn, steps, coef, 3, BLOCKS, o); break; \
        default: RUN(c, sn, steps, coef, 4, BLOCKS, o); break; }
    if (keys == TQ_TURN_KEYS && half == 32) {
        TURN_CASE(turn_scores_mirrored, 2)
    } else if (keys == TQ_TURN_KEYS) {
        TURN_CASE(turn_scores_mirrored, half / 16)
    } else if (half == 32) {
        TURN_CASE(turn_scores_16, 2)
    } else {
        turn_scores_16(c, sn, steps, coef, m, half / 16, o);
    }
#undef TURN_CASE
}

/* whether a head's keys are scored in runs (turn_scores_at), and how many keys the run from j0 of n takes */
static inline int turn_in_runs(int half) { return half % 16 == 0 && half <= 64; }
static inline int turn_run_keys(int j0, int n) { return j0 + TQ_TURN_KEYS <= n ? TQ_TURN_KEYS : 16; }
#elif defined(__AVX2__) && defined(__FMA__)
/* AVX2: turn_scores_mirrored's arithmetic eight lanes a vector (the same sums lane by lane), one query at a time: its
 * eight sums and the broadcasts fill the sixteen registers, steps' columns come from L1 */
static void turn_scores_mirrored(const float *cos_, const float *sin_, const float *steps, const float *coef, int half, float *out) {
    const int d = 2 * half, mid = TQ_TURN_KEYS / 2;
    const float *cm = cos_ + (int64_t)mid * d, *sm = sin_ + (int64_t)mid * d;   /* the middle key's rows */
    float turned[CB_MAX_DIM];   /* [A' | B'] at the middle key */
    __m256 own = _mm256_setzero_ps();
    for (int x = 0; x < half; x += 8) {
        const __m256 c = _mm256_loadu_ps(cm + x), sn = _mm256_loadu_ps(sm + x);
        const __m256 a = _mm256_loadu_ps(coef + x), e = _mm256_loadu_ps(coef + half + x);
        _mm256_storeu_ps(turned + x, _mm256_fmadd_ps(e, sn, _mm256_mul_ps(a, c)));
        _mm256_storeu_ps(turned + half + x, _mm256_fnmadd_ps(a, sn, _mm256_mul_ps(e, c)));
        own = _mm256_fmadd_ps(e, _mm256_loadu_ps(sin_ + x), _mm256_fmadd_ps(a, _mm256_loadu_ps(cos_ + x), own));
    }
    __m256 even[4], odd[4];   /* E(u), O(u) for u = 0..7, .., 24..31 */
    for (int k = 0; k < 4; k++) even[k] = odd[k] = _mm256_setzero_ps();
    for (int x = 0; x < half; x++) {
        const float *cx = steps + TQ_TURN_STEPS * (int64_t)x, *sx = steps + TQ_TURN_STEPS * (int64_t)(half + x);
        const __m256 a = _mm256_broadcast_ss(turned + x), e = _mm256_broadcast_ss(turned + half + x);
        for (int k = 0; k < 4; k++) {
            even[k] = _mm256_fmadd_ps(a, _mm256_loadu_ps(cx + 8 * k), even[k]);
            odd[k] = _mm256_fmadd_ps(e, _mm256_loadu_ps(sx + 8 * k), odd[k]);
        }
    }
    /* key t0 + 32 - u scores E(u) - O(u): out[j] = difference 32 - j for j = 1 .. 31, eight reversed lanes a store (the
     * last, out[32] = E(0) - O(0) with O(0) = 0, is written again below as E(0) + O(0)); key t0 + 32 + u E(u) + O(u) */
    const __m256i reverse = _mm256_setr_epi32(7, 6, 5, 4, 3, 2, 1, 0);
    for (int k = 3; k >= 0; k--)
        _mm256_storeu_ps(out + 1 + 8 * (3 - k), _mm256_permutevar8x32_ps(_mm256_sub_ps(even[k], odd[k]), reverse));
    for (int k = 0; k < 4; k++) _mm256_storeu_ps(out + 32 + 8 * k, _mm256_add_ps(even[k], odd[k]));
    float lanes[8], first = 0.0f;   /* key t0 (u = -32), from its own rows: its lanes added in a fixed order */
    _mm256_storeu_ps(lanes, own);
    for (int j = 0; j < 8; j++) first += lanes[j];
    out[0] = first;
}

/* sixteen keys from t0 for nq (<= 4) queries, each query's coefficients turned to key t0 (half a multiple of 8), its
 * sixteen scores in two vectors (scoring each key from its own rows is a serial sum per key and query: a third of
 * tq4's read on an AVX2 AMD EPYC) */
static void turn_scores_16(const float *cos_, const float *sin_, const float *steps, const float *const *coef, int nq,
                           int half, float *const *out) {
    float turned[4][CB_MAX_DIM];   /* each query's [A' | B'] */
    for (int i = 0; i < nq; i++)
        for (int x = 0; x < half; x += 8) {
            const __m256 c = _mm256_loadu_ps(cos_ + x), sn = _mm256_loadu_ps(sin_ + x);
            const __m256 a = _mm256_loadu_ps(coef[i] + x), e = _mm256_loadu_ps(coef[i] + half + x);
            _mm256_storeu_ps(turned[i] + x, _mm256_fmadd_ps(e, sn, _mm256_mul_ps(a, c)));
            _mm256_storeu_ps(turned[i] + half + x, _mm256_fnmadd_ps(a, sn, _mm256_mul_ps(e, c)));
        }
    __m256 lo[4], hi[4];
    for (int i = 0; i < nq; i++) lo[i] = hi[i] = _mm256_setzero_ps();
    for (int x = 0; x < 2 * half; x++) {
        const __m256 s0 = _mm256_loadu_ps(steps + TQ_TURN_STEPS * (int64_t)x), s1 = _mm256_loadu_ps(steps + TQ_TURN_STEPS * (int64_t)x + 8);
        for (int i = 0; i < nq; i++) {
            const __m256 t = _mm256_set1_ps(turned[i][x]);
            lo[i] = _mm256_fmadd_ps(t, s0, lo[i]);
            hi[i] = _mm256_fmadd_ps(t, s1, hi[i]);
        }
    }
    for (int i = 0; i < nq; i++) {
        _mm256_storeu_ps(out[i], lo[i]);
        _mm256_storeu_ps(out[i] + 8, hi[i]);
    }
}

/* a run of `keys` (TQ_TURN_KEYS or 16) from t0 for nq (1 to 4) queries */
static void turn_scores_at(const float *cos_, const float *sin_, const float *steps, const float *const *coef, int nq,
                           int half, int keys, float *const *out) {
    if (keys == TQ_TURN_KEYS)
        for (int i = 0; i < nq; i++) turn_scores_mirrored(cos_, sin_, steps, coef[i], half, out[i]);
    else
        turn_scores_16(cos_, sin_, steps, coef, nq, half, out);
}

static inline int turn_in_runs(int half) { return half % 8 == 0 && 2 * half <= CB_MAX_DIM; }
static inline int turn_run_keys(int j0, int n) { return j0 + TQ_TURN_KEYS <= n ? TQ_TURN_KEYS : 16; }
#endif

static void turn_scores(const KeyTurn *T, int group, int64_t row_stride, int nq, int d, int64_t k0, int n, float *out) {
    const int half = d / 2;
    int j0 = 0;
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
    if (turn_in_runs(half))
        while (j0 + 16 <= n) {
            const int keys = turn_run_keys(j0, n);
            const float *c = T->cos_ + (k0 + j0) * d, *sn = T->sin_ + (k0 + j0) * d;
            for (int i0 = 0; i0 < nq; i0 += 4) {
                const int m = nq - i0 < 4 ? nq - i0 : 4;
                const float *coef[4];
                float *o[4];
                for (int i = 0; i < m; i++) {
                    coef[i] = T->coef + ((i0 + i) / group) * row_stride + (int64_t)((i0 + i) % group) * d;
                    o[i] = out + (int64_t)(i0 + i) * TQ_READ_KEYS + j0;
                }
                turn_scores_at(c, sn, T->steps, coef, m, half, keys, o);
            }
            j0 += keys;
        }
#endif
    for (int i = 0; i < nq; i++) {
        const float *a = T->coef + (i / group) * row_stride + (int64_t)(i % group) * d, *b = a + half;
        for (int j = j0; j < n; j++) {
            const float *c = T->cos_ + (k0 + j) * d, *sn = T->sin_ + (k0 + j) * d;
            float sum = 0.0f;
            for (int x = 0; x < half; x++) sum += a[x] * c[x] + b[x] * sn[x];
            out[(int64_t)i * TQ_READ_KEYS + j] = sum;
        }
    }
}

/* -- +qjl and +outliersN: what a key holds besides its codes (tqcodes.h Coded) ------------------------------------ */
#define QJL_FACTOR 1.2533141373155003f   /* √(π/2): E|⟨s, r⟩| = √(2/π)‖r‖ for a Gaussian row s */

/* Σ_j v_j · (+1 where bit j of signs is set, else -1), over d values */
static float signed_sum(const uint8_t *signs, const float *v, int d) {
    int j = 0;
    float total = 0.0f;
#if defined(__AVX512F__)
    __m512 acc = _mm512_setzero_ps();
    for (; j + 16 <= d; j += 16) {
        const __mmask16 m = (__mmask16)(signs[j / 8] | (unsigned)signs[j / 8 + 1] << 8);
        const __m512 x = _mm512_loadu_ps(v + j);
        acc = _mm512_add_ps(acc, _mm512_mask_blend_ps(m, _mm512_sub_ps(_mm512_setzero_ps(), x), x));
    }
    total = _mm512_reduce_add_ps(acc);
#endif
    for (; j < d; j++) total += (signs[j >> 3] >> (j & 7) & 1) ? v[j] : -v[j];
    return total;
}

/* +qjl: the signs of KV head g's rows from slot `slot` on (one block's run, ⌈d/8⌉ bytes a row) and each row's factor
 * √(π/2)/d · ‖r‖ into coef (n <= TQ_READ_KEYS) */
static const uint8_t *qjl_residuals(const Coded *C, int g, int64_t slot, int n, int d, float *coef) {
    const int64_t at = scale_at(C, g, slot);
    kv_load(C->norm_type, (const uint16_t *)C->qjl_norms + at, n, coef);
    for (int r = 0; r < n; r++) coef[r] *= QJL_FACTOR / (float)d;
    return C->qjl_signs + at * ((d + 7) / 8);
}

/* +qjl, codes read as they are: scores[i * stride + r] += √(π/2)/d · ‖r‖ · (S q_i)·sign, rows r < n of KV head g from
 * slot `slot` on, sketched + i * dpad = S q_i */
static void qjl_scores(const Coded *C, int g, int64_t slot, int n, int d, const float *sketched, int dpad, int nq,
                       float *scores, int64_t stride) {
    float coef[TQ_READ_KEYS];
    const uint8_t *signs = qjl_residuals(C, g, slot, n, d, coef);
    for (int r = 0; r < n; r++)
        for (int i = 0; i < nq; i++)
            scores[i * stride + r] += coef[r] * signed_sum(signs + (int64_t)r * ((d + 7) / 8), sketched + (int64_t)i * dpad, d);
}

/* +qjl, keys rebuilt (+prerope): rows r < n of a decoded tile (dpad apart) += √(π/2)/d · ‖r‖ · Sᵀ sign, the
 * residual's estimate in the rotated domain, for KV head g's slots from `slot` on */
static void qjl_rows(const Coded *C, int g, int64_t slot, int n, int d, int dpad, float *tile) {
    float coef[TQ_READ_KEYS];
    const uint8_t *signs = qjl_residuals(C, g, slot, n, d, coef);
    for (int r = 0; r < n; r++) {
        const uint8_t *row_signs = signs + (int64_t)r * ((d + 7) / 8);
        float *row = tile + (int64_t)r * dpad;
        for (int j = 0; j < d; j++) {
            const float w = (row_signs[j >> 3] >> (j & 7) & 1) ? coef[r] : -coef[r];
            const float *s_j = C->qjl_matrix + (int64_t)j * d;
            for (int c = 0; c < d; c++) row[c] += w * s_j[c];
        }
    }
}

/* +outliersN: out[i * TQ_READ_KEYS + r] = q_i . (row r's kept entries), rows r < n of KV head g from slot `slot` on;
 * plain + i * dpad = q_i as the model has it. With cos_/sin_ (+prerope: the rows' positions, d apart) the entries are
 * turned to their key's position first: R_t e_c. */
static void outlier_scores(const Coded *C, int g, int64_t slot, int n, int d, const float *plain, int dpad, int nq,
                           const float *cos_, const float *sin_, float *out) {
    const int N = C->outliers, half = d / 2;
    const int64_t at = scale_at(C, g, slot);
    for (int r = 0; r < n; r++) {
        const uint8_t *channel = C->outlier_channels + (at + r) * N;
        const uint16_t *value = C->outlier_values + (at + r) * N;
        const float *cs = cos_ ? cos_ + (int64_t)r * d : NULL, *sn = cos_ ? sin_ + (int64_t)r * d : NULL;
        for (int i = 0; i < nq; i++) {
            const float *q = plain + (int64_t)i * dpad;
            float total = 0.0f;
            for (int e = 0; e < N; e++) {
                const int c = channel[e];
                const float v = kvlab_fp16_to_fp32(value[e]);
                if (!cs) total += q[c] * v;
                else if (c < half) total += v * (q[c] * cs[c] + q[c + half] * sn[c + half]);   /* rope(): pairs (c, c + d/2) */
                else total += v * (q[c] * cs[c] - q[c - half] * sn[c - half]);
            }
            out[(int64_t)i * TQ_READ_KEYS + r] = total;
        }
    }
}

/* -- kvlab_tq_read (tqcodes.h): one KV head's coded keys read by a few queries ------------------------------------- */
#define TQ_REGISTER_ROWS 16  /* blocks of this many rows or more (a single cache's one, a pool's of 16) are read from
                                 their codes in registers; shorter ones are decoded a tile at a time */

int64_t kvlab_tq_read_floats(int nq, int dpad) {   /* scores, key and value scales, queries, sums, a tile (+ room), each
                                                    key's own terms, the queries' sketches and plain queries */
    return 2 * (int64_t)nq * TQ_READ_KEYS + 2 * TQ_READ_KEYS + 4 * (int64_t)nq * dpad + (int64_t)CB_TILE * dpad + CB_MAX_DIM;
}

/* out[r] = q . row r of the tile (count <= CB_TILE rows, dpad apart, zero past d like q) */
static void tile_scores(const float *q, const float *tile, int count, int d, int dpad, float *out) {
#if defined(__AVX512F__)
    if (dpad == d) {
        key_scores(q, tile, 0, count, d, 1.0f, out);
        return;
    }
#else
    (void)d;
#endif
    /* eight rows at a time, one tree of adds for the eight (key_scores' one row at a time folds each row's lanes apart:
     * as costly as the row's multiply-adds where a vector is 8 lanes); a whole tile straight into out */
    if (count == CB_TILE) {
        kvlab_cb_dot8(q, tile, dpad, out);
        kvlab_cb_dot8(q, tile + 8 * (int64_t)dpad, dpad, out + 8);
        return;
    }
    float all[CB_TILE];
    kvlab_cb_dot8(q, tile, dpad, all);
    if (count > 8) kvlab_cb_dot8(q, tile + 8 * (int64_t)dpad, dpad, all + 8);
    memcpy(out, all, sizeof(float) * (size_t)count);
}

/* the slot of key t in a block table of blocks `block_rows` rows long */
static inline int64_t slot_at(const int32_t *table, int64_t block_rows, int64_t t) {
    return (int64_t)table[t / block_rows] * block_rows + t % block_rows;
}

/* rows [r0, min(r1, run)) of a run of rows `bytes` apart asked for ahead of their read (kvlab_prefetch_lines) */
static inline void prefetch_ahead(const uint8_t *rows, int64_t bytes, int r0, int r1, int run) {
    if (r1 > run) r1 = run;
    if (r0 < r1) kvlab_prefetch_lines(rows + r0 * bytes, (r1 - r0) * bytes);
}

/* scores (nq, TQ_READ_KEYS) of a run of `run` keys from `slot` read from their codes in registers, READ_PIECE rows at a
 * time, the next piece's key codes and this piece's value codes asked for alongside (kvlab_cb_dot_rows' cb_ahead);
 * -1 (nothing read) where the key layout is not read in registers */
#define READ_PIECE 64
static int register_dots(const TqHead *h, int g, int64_t slot, int run, const float *qpad, int nq, float *scores) {
    const Coded *C = h->C;
    const uint8_t *keys = coded_row(C, 0, g, slot), *values = coded_row(C, 1, g, slot);
    prefetch_ahead(keys, C->slot_bytes[0], 0, READ_PIECE, run);
    for (int r0 = 0; r0 < run; r0 += READ_PIECE) {
        const int count = run - r0 < READ_PIECE ? run - r0 : READ_PIECE;
        const int next = run - r0 - count < READ_PIECE ? run - r0 - count : READ_PIECE;
        const cb_ahead ahead[2] = {{keys + (r0 + count) * C->slot_bytes[0], C->slot_bytes[0], next, NULL},
                                   {values + r0 * C->slot_bytes[1], C->slot_bytes[1], count, NULL}};
        if (kvlab_cb_dot_rows(h->layout[0], keys + r0 * C->slot_bytes[0], C->slot_bytes[0], count, qpad, h->layout[0]->dpad,
                              nq, scores + r0, TQ_READ_KEYS, ahead, 2) != 0)
            return -1;   /* at the first piece: the layout is checked before anything is read */
    }
    return 0;
}

/* s[j] = (s[j] k_scale[j] + extra[j]) scale (without k_scale the factor 1; without extra s[j] (k_scale[j] scale)) for
 * j < n (n > 0), in one pass that also returns their largest: a query's scores before its softmax, which
 * kvlab_row_exp_weighted then takes with the values' scales in one more pass */
#if defined(__AVX512F__)
static float scaled_scores(float *s, const float *k_scale, const float *extra, float scale, int n) {
    const __m512 by = _mm512_set1_ps(scale);
    __m512 top = _mm512_set1_ps(-INFINITY);
    for (int t = 0; t < n; t += 16) {
        const __mmask16 live = kvlab_live_lanes(t, n);
        const __m512 x = _mm512_maskz_loadu_ps(live, s + t);
        const __m512 k = k_scale ? _mm512_maskz_loadu_ps(live, k_scale + t) : _mm512_set1_ps(1.0f);
        const __m512 y = !extra ? _mm512_mul_ps(x, k_scale ? _mm512_mul_ps(k, by) : by)
                       : k_scale ? _mm512_mul_ps(_mm512_fmadd_ps(x, k, _mm512_maskz_loadu_ps(live, extra + t)), by)
                       : _mm512_mul_ps(_mm512_add_ps(x, _mm512_maskz_loadu_ps(live, extra + t)), by);
        _mm512_mask_storeu_ps(s + t, live, y);
        top = _mm512_mask_max_ps(top, live, y, top);
    }
    return _mm512_reduce_max_ps(top);
}
#elif defined(__AVX2__) && defined(__FMA__)
static float scaled_scores(float *s, const float *k_scale, const float *extra, float scale, int n) {
    const __m256 by = _mm256_set1_ps(scale);
    int j = 0;
    for (; j + 8 <= n; j += 8) {   /* the scalar loop's arithmetic below, eight at a time */
        const __m256 x = _mm256_loadu_ps(s + j), k = k_scale ? _mm256_loadu_ps(k_scale + j) : _mm256_set1_ps(1.0f);
        const __m256 y = !extra ? _mm256_mul_ps(x, k_scale ? _mm256_mul_ps(k, by) : by)
                       : k_scale ? _mm256_mul_ps(_mm256_fmadd_ps(x, k, _mm256_loadu_ps(extra + j)), by)
                       : _mm256_mul_ps(_mm256_add_ps(x, _mm256_loadu_ps(extra + j)), by);
        _mm256_storeu_ps(s + j, y);
    }
    for (; j < n; j++)
        s[j] = !extra ? s[j] * (k_scale ? k_scale[j] * scale : scale) : ((k_scale ? s[j] * k_scale[j] : s[j]) + extra[j]) * scale;
    return kvlab_row_max(s, n);
}
#else
static float scaled_scores(float *s, const float *k_scale, const float *extra, float scale, int n) {
    for (int j = 0; j < n; j++)
        s[j] = !extra ? s[j] * (k_scale ? k_scale[j] * scale : scale) : ((k_scale ? s[j] * k_scale[j] : s[j]) + extra[j]) * scale;
    return kvlab_row_max(s, n);
}
#endif

#define KEYS_AHEAD 2   /* a read through a block table asks for the key codes this many blocks ahead of the one it scores */
void kvlab_tq_read(const TqHead *h, const int32_t *table, int64_t k0, int64_t k1, const float *queries, int group,
                   int64_t row_stride, int nq, const int64_t *lo, const int64_t *hi, float *scratch, float *parts,
                   int64_t part_stride) {
    const Coded *C = h->C;
    const cb_layout *KL = h->layout[0], *VL = h->layout[1];
    const int d = KL->d, dpad = KL->dpad, g = h->g;
    const int64_t block_rows = C->block_rows;
    /* a pool's blocks of CB_TILE rows are read whole, from a block's start: keys [k0 - k0 % CB_TILE, k0) join the read and
     * weigh 0 (every query's lo is k0 or later), so that every query's scores and sums go through the block table in one
     * read, the queries and the sums held in registers across the blocks (kvlab_cb_dot_tiles, kvlab_cb_mix_tiles); only
     * where the widened read still fits TQ_READ_KEYS, the size of the scratch and of the tile lists */
    const int tiled = !h->pre && block_rows == CB_TILE && k1 - (k0 - k0 % CB_TILE) <= TQ_READ_KEYS;
    if (tiled && k0 < k1) k0 -= k0 % CB_TILE;
    float *scores = scratch, *k_scale = scores + (int64_t)nq * TQ_READ_KEYS, *v_scale = k_scale + TQ_READ_KEYS;
    float *qpad = v_scale + TQ_READ_KEYS, *acc = qpad + (int64_t)nq * dpad, *tile = acc + (int64_t)nq * dpad;
    /* each key's own term besides its codes, (nq, TQ_READ_KEYS): +ropemean's q . R_t μ or +outliersN's q . entries */
    float *own = tile + (int64_t)CB_TILE * dpad + CB_MAX_DIM;
    float *sketched = own + (int64_t)nq * TQ_READ_KEYS;   /* +qjl read on the codes: (nq, dpad) S q */
    float *plain = sketched + (int64_t)nq * dpad;          /* +outliersN: (nq, dpad) the queries as the model has them */
    const int qjl_on_codes = C->qjl_matrix && !h->pre, owns = h->turn || C->outliers;
    float factor[CB_MAX_DIM];        /* +prerope: each channel's sign and weight */
    if (h->pre) prerope_factor(h->pre, d, factor);
    for (int i = 0; i < nq; i++) {   /* the queries dpad apart, zero past d; their sums */
        float *q = qpad + (int64_t)i * dpad;
        memcpy(q, queries + (i / group) * row_stride + (int64_t)(i % group) * d, sizeof(float) * (size_t)d);
        memset(q + d, 0, sizeof(float) * (size_t)(dpad - d));
        memset(acc + (int64_t)i * dpad, 0, sizeof(float) * (size_t)dpad);
        if (qjl_on_codes)
            for (int j = 0; j < d; j++) sketched[(int64_t)i * dpad + j] = dot(C->qjl_matrix + (int64_t)j * d, q, d);
        if (C->outliers && h->pre)   /* +prerope: q itself */
            memcpy(plain + (int64_t)i * dpad, q, sizeof(float) * (size_t)d);
        else if (C->outliers)        /* q' = (q ⊙ w) M: q = q' Mᵀ / w */
            for (int c = 0; c < d; c++) {
                const float x = dot(C->rotation + (int64_t)c * d, q, d);
                plain[(int64_t)i * dpad + c] = C->weight_codes ? x / key_weight(C, g, d, c) : x;
            }
    }
    const int n = (int)(k1 - k0);
    const uint8_t *key_tiles[TQ_READ_KEYS / CB_TILE + 1], *value_tiles[TQ_READ_KEYS / CB_TILE + 1];
    if (tiled)
        for (int i = 0; i * CB_TILE < n; i++) {
            const int64_t slot = slot_at(table, block_rows, k0 + (int64_t)i * CB_TILE);
            key_tiles[i] = coded_row(C, 0, g, slot), value_tiles[i] = coded_row(C, 1, g, slot);
            if (i < KEYS_AHEAD) prefetch_ahead(key_tiles[i], C->slot_bytes[0], 0, CB_TILE, n - i * CB_TILE);
        }
    const cb_ahead ahead[2] = {{NULL, C->slot_bytes[1], n, value_tiles},   /* this block's values */
                               {NULL, C->slot_bytes[0], n - KEYS_AHEAD * CB_TILE, key_tiles + KEYS_AHEAD}};   /* keys ahead */
    const int scored = tiled && kvlab_cb_dot_tiles(KL, key_tiles, C->slot_bytes[0], n, qpad, dpad, nq, scores, TQ_READ_KEYS,
                                                   ahead, n > KEYS_AHEAD * CB_TILE ? 2 : 1) == 0;
    /* every query's scores, a run of one block's rows at a time (+prerope: the keys rebuilt with their scales) */
    for (int64_t t = k0; t < k1;) {
        const int64_t slot = slot_at(table, block_rows, t);
        const int run = (int)(block_rows - t % block_rows < k1 - t ? block_rows - t % block_rows : k1 - t), j0 = (int)(t - k0);
        const uint8_t *rows = coded_row(C, 0, g, slot);
        if (!scored && t + run < k1) {   /* the next run's first key codes (a pool's blocks lie apart; a run ends at its block's end) */
            prefetch_ahead(coded_row(C, 0, g, slot_at(table, block_rows, t + run)), C->slot_bytes[0], 0, CB_TILE,
                           (int)(k1 - t - run));
        }
        load_scales(C, 0, g, slot, run, k_scale + j0);
        load_scales(C, 1, g, slot, run, v_scale + j0);
        if (!scored && (h->pre || block_rows < TQ_REGISTER_ROWS || register_dots(h, g, slot, run, qpad, nq, scores + j0) != 0))
            for (int r0 = 0; r0 < run; r0 += CB_TILE) {
                const int count = run - r0 < CB_TILE ? run - r0 : CB_TILE;
                prefetch_ahead(rows, C->slot_bytes[0], r0 + CB_TILE, r0 + 2 * CB_TILE, run);
                prefetch_ahead(coded_row(C, 1, g, slot), C->slot_bytes[1], r0, r0 + CB_TILE, run);
                kvlab_cb_decode_rows(KL, rows + r0 * C->slot_bytes[0], C->slot_bytes[0], count, tile, dpad);
                if (h->pre && C->qjl_matrix) qjl_rows(C, g, slot + r0, count, d, dpad, tile);
                if (h->pre) {   /* dpad == d (+prerope takes d a multiple of 16) */
                    PreRope sub = *h->pre;
                    sub.cos_ += (t + r0) * d, sub.sin_ += (t + r0) * d;
#ifdef HAVE_PREROPE_SCORES
                    if (count == 16 && d == 64 && sub.signs) {   /* rebuilt in registers, scored by every query */
                        prerope_scores(tile, factor, k_scale + j0 + r0, sub.offset, sub.cos_, sub.sin_, qpad, dpad, nq,
                                       scores + j0 + r0, TQ_READ_KEYS);
                        continue;
                    }
#endif
                    prerope_rebuild(tile, count, d, &sub, factor, k_scale + j0 + r0);
                }
                for (int i = 0; i < nq; i++)
                    tile_scores(qpad + (int64_t)i * dpad, tile, count, d, dpad, scores + (int64_t)i * TQ_READ_KEYS + j0 + r0);
            }
        if (qjl_on_codes) qjl_scores(C, g, slot, run, d, sketched, dpad, nq, scores + j0, TQ_READ_KEYS);
        if (C->outliers)
            outlier_scores(C, g, slot, run, d, plain, dpad, nq, h->pre ? h->pre->cos_ + t * d : NULL,
                           h->pre ? h->pre->sin_ + t * d : NULL, own + j0);
        t += run;
    }
    if (h->turn) turn_scores(h->turn, group, row_stride, nq, d, k0, n, own);
    /* each query's softmax over the keys it reads, its weights times the values' scales (0 for keys it does not read) */
    for (int i = 0; i < nq; i++) {
        float *s = scores + (int64_t)i * TQ_READ_KEYS, *part = parts + i * part_stride;
        const int a = lo[i] > k0 ? (int)(lo[i] - k0) : 0, b = hi[i] < k1 ? (int)(hi[i] - k0) : n;
        float top = -INFINITY, total = 0.0f;
        if (a < b) {   /* +prerope: the keys' scales are in their rebuilt rows */
            top = scaled_scores(s + a, h->pre ? NULL : k_scale + a, owns ? own + (int64_t)i * TQ_READ_KEYS + a : NULL, h->scale, b - a);
            total = kvlab_row_exp_weighted(s + a, b - a, top, v_scale + a);
        }
        if (a > 0) memset(s, 0, sizeof(float) * (size_t)(a < n ? a : n));   /* the keys it does not read weigh 0 */
        if (b < n) memset(s + (b > 0 ? b : 0), 0, sizeof(float) * (size_t)(n - (b > 0 ? b : 0)));
        part[d] = top;
        part[d + 1] = total;
    }
    /* the values: every query's weighted sum, through the block table in one read or a run at a time */
    for (int64_t t = tiled && kvlab_cb_mix_tiles(VL, value_tiles, C->slot_bytes[1], n, scores, TQ_READ_KEYS, nq, acc, dpad) == 0 ? k1 : k0;
         t < k1;) {
        const int64_t slot = slot_at(table, block_rows, t);
        const int run = (int)(block_rows - t % block_rows < k1 - t ? block_rows - t % block_rows : k1 - t), j0 = (int)(t - k0);
        const uint8_t *rows = coded_row(C, 1, g, slot);
        if (block_rows < TQ_REGISTER_ROWS
            || kvlab_cb_mix_rows(VL, rows, C->slot_bytes[1], run, scores + j0, TQ_READ_KEYS, nq, acc, dpad) != 0)
            for (int r0 = 0; r0 < run; r0 += CB_TILE) {
                const int count = run - r0 < CB_TILE ? run - r0 : CB_TILE;
                kvlab_cb_decode_rows(VL, rows + r0 * C->slot_bytes[1], C->slot_bytes[1], count, tile, dpad);
                for (int i = 0; i < nq; i++)
                    kvlab_cb_axpy_rows(scores + (int64_t)i * TQ_READ_KEYS + j0 + r0, tile, count, acc + (int64_t)i * dpad, dpad);
            }
        t += run;
    }
    for (int i = 0; i < nq; i++) memcpy(parts + i * part_stride, acc + (int64_t)i * dpad, sizeof(float) * (size_t)d);
}

typedef struct {                   /* what a key stores besides its codes and scale (tqcodes.h Coded) */
    uint8_t signs[CB_MAX_DIM / 8]; /* +qjl: the signs of S r */
    uint16_t residual;             /* +qjl: ‖r‖ as the scales are stored */
    uint8_t channels[CB_MAX_DIM];  /* +outliersN: the kept entries' channels ... */
    uint16_t values[CB_MAX_DIM];   /* ... and their values k_c - μ_c, float16 */
} KeyExtras;

/* +outliersN: the N entries of x (d,) largest in magnitude (the first of equals) into e, their centred values from
 * `centred`, and zero in x (turboquant.py _split_outliers). 1, or 0 when a kept value is not finite in float16. */
static int keep_outliers(const Coded *C, float *x, const float *centred, int d, KeyExtras *e) {
    uint8_t taken[CB_MAX_DIM] = {0};
    for (int n = 0; n < C->outliers; n++) {
        int best = -1;
        for (int c = 0; c < d; c++)
            if (!taken[c] && (best < 0 || fabsf(x[c]) > fabsf(x[best]))) best = c;
        taken[best] = 1;
        e->channels[n] = (uint8_t)best;
        e->values[n] = f32_to_f16(centred[best]);
        if ((e->values[n] & 0x7c00u) == 0x7c00u) return 0;
        x[best] = 0.0f;
    }
    return 1;
}

/* +qjl: the signs of S r and ‖r‖ of a key's residual r = y - ŷ (d,) into e. 1, or 0 when ‖r‖ is not finite. */
static int qjl_sketch(const Coded *C, const float *y, const float *y_hat, int d, KeyExtras *e) {
    float r[CB_MAX_DIM];
    for (int c = 0; c < d; c++) r[c] = y[c] - y_hat[c];
    memset(e->signs, 0, (size_t)(d + 7) / 8);
    for (int j = 0; j < d; j++)
        if (dot(C->qjl_matrix + (int64_t)j * d, r, d) >= 0.0f) e->signs[j >> 3] |= (uint8_t)(1u << (j & 7));
    const float norm = sqrtf(dot(r, r, d));
    return kv_store(C->norm_type, &norm, 1, &e->residual);
}

/* Code x (d,), KV head g's key (which = 0) or value (1), as TurboQuantCache.code: x' = (x - mu) [/ w] (a +ropemean key:
 * then turned by RoPE with cos_/sin_, its position's rows; +outliersN: its largest entries kept in e and zero in x'),
 * the stored scale ||x'|| * factor (store_scale), the codes of y = x' M / ||x'|| (+qjl: the sketch of the residual into
 * e). 0, or 1 when a scale is not finite. */
static int code_vector(const Coded *C, const cb_layout *L, int which, int g, const float *x_in, int d,
                       const float *cos_, const float *sin_, uint8_t *row, uint16_t *scale_out, KeyExtras *e) {
    const float *bounds = C->heads[which][g].bounds;
    float x[CB_MAX_DIM], y[CB_MAX_DIM], y_hat[CB_MAX_DIM], centred[CB_MAX_DIM];
    const uint8_t *offset = C->offset[which] ? C->offset[which] + (int64_t)g * d : NULL;
    for (int c = 0; c < d; c++) {
        x[c] = centred[c] = offset ? x_in[c] - C->fp8_values[offset[c]] : x_in[c];
        if (which == 0 && C->weight_codes) x[c] /= key_weight(C, g, d, c);
    }
    if (which == 0 && C->rope_mean) rope_half_table(x, cos_, sin_, d);
    if (which == 0 && C->outliers && !keep_outliers(C, x, centred, d, e)) return 1;
    const float norm = sqrtf(dot(x, x, d)), inv = norm > 1e-30f ? norm : 1e-30f;
    rotate(x, C->rotation, d, y);
    for (int c = 0; c < d; c++) y[c] /= inv;
    kvlab_cb_encode_row(L, bounds, y, row, y_hat);
    if (which == 0 && C->qjl_matrix && !qjl_sketch(C, y, y_hat, d, e)) return 1;
    float factor = 1.0f;
    if (C->scale_mode[which] != SCALE_NORM) {
        const float sq_raw = dot(y_hat, y_hat, d), sq = sq_raw > 1e-30f ? sq_raw : 1e-30f, yy = dot(y, y_hat, d);
        factor = C->scale_mode[which] == SCALE_RENORM ? 1.0f / sqrtf(sq)
               : C->scale_mode[which] == SCALE_LSQ ? yy / sq
               : 1.0f / (fabsf(yy) > 1e-30f ? yy : 1.0f);
    }
    return !store_scale(C, which, g, norm * factor, scale_out);
}

/* x (d,) = y with RoPE turned back at one position (cos_/sin_ as rope() takes them), as llama.py's apply_rope with -sin */
static void unrope(const float *y, const float *cos_, const float *sin_, int d, float *x) {
    const int half = d / 2;
    for (int i = 0; i < half; i++) {
        x[i] = y[i] * cos_[i] + y[i + half] * sin_[i];
        x[i + half] = y[i + half] * cos_[i + half] - y[i] * sin_[i + half];
    }
}

/* The codes and scales of one KV head of one token, before they are stored: k (after RoPE; with +prerope and +ropemean,
 * cos_ not NULL, turned back with cos_/sin_ of its position) and v (hd,) each coded as TurboQuantCache.code codes them into
 * codes[0 .. ROW_ROOM) (key) and codes[ROW_ROOM ..) (value), scales[0..1]. 0, or 1 when a scale is not finite. */
static int code_head(const Coded *C, const cb_layout *head_layouts, int g, int hd, const float *k, const float *v,
                     const float *cos_, const float *sin_, uint8_t *codes, uint16_t *scales, KeyExtras *extras) {
    float pre_rope_k[CB_MAX_DIM];
    if (cos_) {
        unrope(k, cos_, sin_, hd, pre_rope_k);
        k = pre_rope_k;
    }
    return code_vector(C, &head_layouts[2 * g], 0, g, k, hd, cos_, sin_, codes, &scales[0], extras)
        || code_vector(C, &head_layouts[2 * g + 1], 1, g, v, hd, NULL, NULL, codes + ROW_ROOM, &scales[1], NULL);
}

/* code_head's codes, scales and key extras of KV head g into slot t */
static void store_head(const Coded *C, int g, int hd, int64_t t, const uint8_t *codes, const uint16_t *scales,
                       const KeyExtras *extras) {
    memcpy(coded_row(C, 0, g, t), codes, (size_t)C->heads[0][g].row_bytes);
    memcpy(coded_row(C, 1, g, t), codes + ROW_ROOM, (size_t)C->heads[1][g].row_bytes);
    put_scale(C, 0, g, t, scales[0]);
    put_scale(C, 1, g, t, scales[1]);
    const int64_t at = scale_at(C, g, t);   /* the key's extras lie where its scale does */
    if (C->qjl_matrix) {
        memcpy(C->qjl_signs + at * ((hd + 7) / 8), extras->signs, (size_t)(hd + 7) / 8);
        ((uint16_t *)C->qjl_norms)[at] = extras->residual;
    }
    if (C->outliers) {
        memcpy(C->outlier_channels + at * C->outliers, extras->channels, (size_t)C->outliers);
        memcpy(C->outlier_values + at * C->outliers, extras->values, sizeof(uint16_t) * (size_t)C->outliers);
    }
}

int kvlab_tq_layouts(const Coded *C, int Hkv, int hd, cb_layout *layouts) {
    if ((C->norm_type != KV_F16 && C->norm_type != KV_BF16 && C->norm_type != NORM_LOG8)
        || (C->norm_type == NORM_LOG8 && (!C->norm_centres[0] || !C->norm_centres[1])) || hd % 2 || hd > CB_MAX_DIM)
        return -1;
    if (C->block_rows <= 0 || C->slots % C->block_rows || C->norm_head_stride < C->block_rows
        || C->norm_block_stride < (int64_t)Hkv * C->norm_head_stride)
        return -1;
    if (C->qjl_matrix && (!C->qjl_signs || !C->qjl_norms || C->norm_type == NORM_LOG8)) return -1;
    if (C->outliers < 0 || C->outliers > hd || (C->outliers && (hd > 256 || !C->outlier_channels || !C->outlier_values
                                                                 || C->rope_mean)))
        return -1;
    for (int i = 0; i < 2; i++) {
        if (C->scale_mode[i] < SCALE_NORM || C->scale_mode[i] > SCALE_UNBIASED || !C->heads[i]
            || C->block_bytes[i] < C->block_rows * C->slot_bytes[i])
            return -1;
        for (int g = 0; g < Hkv; g++) {
            const HeadCodes *h = &C->heads[i][g];
            if (kvlab_cb_layout(&layouts[2 * g + i], hd, h->n_parts, h->spec, h->tables, h->row_bytes)
                || h->row_bytes > ROW_ROOM || h->at < 0 || h->row_bytes > C->slot_bytes[i]
                || h->at + (C->block_rows - 1) * C->slot_bytes[i] + h->row_bytes > C->block_bytes[i]) return -1;
        }
    }
    return 0;
}

int kvlab_tq_code_rows(const Coded *C, const cb_layout *layouts, int Hkv, int hd, int64_t n, const float *k,
                       const float *v, int64_t stride, const int64_t *slots, const float *cos_, const float *sin_,
                       const int64_t *rope_at, int n_threads) {
    int failed = 0;
    #pragma omp parallel for schedule(static) num_threads(kvlab_cb_threads(n * Hkv * hd * hd, n_threads))
    for (int64_t r = 0; r < n; r++) {
        if (slots[r] < 0) continue;
        const int64_t at = rope_at ? rope_at[r] : r;
        uint8_t codes[2 * ROW_ROOM];
        uint16_t scales[2];
        KeyExtras extras;
        for (int g = 0; g < Hkv; g++) {
            const int64_t row = r * stride + (int64_t)g * hd;
            if (code_head(C, layouts, g, hd, k + row, v + row, cos_ ? cos_ + at * hd : NULL, cos_ ? sin_ + at * hd : NULL,
                          codes, scales, &extras)) {
                #pragma omp atomic write
                failed = 1;
                break;
            }
            store_head(C, g, hd, slots[r], codes, scales, &extras);
        }
    }
    return failed;
}

/* Code n tokens' K/V into coded layer C: k, v (n, Hkv, hd) fp32, keys after RoPE; token r goes to slot slots[r]
 * (< C->slots) and, with +prerope (C has an inverse rotation), is turned back with its row of cos_/sin_ (n, hd),
 * else they are NULL. The
 * one coder of a token's K/V: the fused step codes its token so, and the serving pool its step's tokens.
 * 0; -1 for a layer it cannot code (nothing stored); 1 when a token's scale is not finite (that token's heads are
 * not all stored, others may be). */
int kvlab_tq_code_tokens(const Coded *C, int Hkv, int hd, int64_t n, const float *k, const float *v,
                         const int64_t *slots, const float *cos_, const float *sin_, int n_threads) {
    const int turns = kvlab_tq_pre_rope(C) || C->rope_mean;   /* +prerope, +ropemean */
    if (Hkv <= 0 || Hkv > CB_MAX_DIM || n < 0 || turns != (cos_ && sin_) || n_threads < 1) return -1;
    cb_layout layouts[2 * 8];
    cb_layout *L = Hkv <= 8 ? layouts : malloc(2 * (size_t)Hkv * sizeof(cb_layout));
    if (!L) return -1;
    int status = kvlab_tq_layouts(C, Hkv, hd, L);
    for (int64_t r = 0; r < n && status == 0; r++)
        if (slots[r] < 0 || slots[r] >= C->slots) status = -1;
    if (status == 0) status = kvlab_tq_code_rows(C, L, Hkv, hd, n, k, v, (int64_t)Hkv * hd, slots, turns ? cos_ : NULL,
                                                 sin_, NULL, n_threads);
    if (L != layouts) free(L);
    return status;
}

void kvlab_tq_query(const Coded *C, int g, int hd, const float *q, float *out) {
    float qw[CB_MAX_DIM];
    for (int c = 0; c < hd; c++) qw[c] = C->weight_codes ? q[c] * key_weight(C, g, hd, c) : q[c];
    rotate(qw, C->rotation, hd, out);
}

void kvlab_tq_state(const Coded *C, int Hkv, int hd, float *weights, float *k_offset, float *v_offset) {
    for (int g = 0; g < Hkv; g++)
        for (int c = 0; c < hd; c++) {
            const int64_t at = (int64_t)g * hd + c;
            if (weights) weights[at] = C->weight_codes ? key_weight(C, g, hd, c) : 1.0f;
            if (k_offset) k_offset[at] = C->offset[0] ? C->fp8_values[C->offset[0][at]] : 0.0f;
            if (v_offset) v_offset[at] = C->offset[1] ? C->fp8_values[C->offset[1][at]] : 0.0f;
        }
}

static int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }
static int chunks_of(int rows) { return (rows + KEY_CHUNK - 1) / KEY_CHUNK; }
/* keys a chunk of a TurboQuant layer's `coded` rows reads, and the chunks they make */
static int coded_chunk(int coded) { return coded >= CODED_LONG ? TQ_READ_KEYS : KEY_CHUNK; }
static int coded_chunks(int coded) { return (coded + coded_chunk(coded) - 1) / coded_chunk(coded); }

/* A coded layer's fill is possible: the parts hold what they can and the write has room */
static int fill_fits(const LayerKV *kv, const Fill *f) {
    const int slots = kv->coded ? kv->coded->slots : kv->quant->slots;
    if (f->first < 0 || f->coded < 0 || f->recent < 0 || f->first > kv->capacity || f->coded > slots || f->recent > kv->window)
        return 0;
    switch (f->write) {
        case WRITE_FIRST: return f->first < kv->capacity;
        case WRITE_CODED: return f->coded < slots;
        case WRITE_RECENT: return f->recent < kv->window;
        case WRITE_SPILL: return kv->window > 0 && f->recent == kv->window && f->coded < slots;
        default: return 0;
    }
}

/* ---- integer layers ------------------------------------------------------------------------------------ */
#define F16_MAX 65504.0f   /* float16's largest value: the scales and zero points cannot follow K/V beyond it */

int kvlab_int_layout_ok(const Quantized *Q, int d) {
    return Q && Q->bits >= 1 && Q->bits <= 8 && Q->group > 0 && Q->value_group > 0 && d % Q->value_group == 0 && Q->slots >= 0
        && Q->block_rows > 0 && (Q->block_rows >= Q->slots || Q->block_rows % Q->group == 0)
        && Q->k_row_bytes == int_row_bytes(Q->bits, d) && Q->v_row_bytes == int_row_bytes(Q->bits, d)
        && Q->k_codes && Q->v_codes && Q->k_scale && Q->k_zero && Q->v_scale && Q->v_zero && Q->k_stage && Q->stages >= 1;
}

/* 0 when `heads` key and value rows (`stride` floats apart) fit float16's range; else 1 with Q->overflow_what and
 * Q->overflow set as quantized._check_range reports it: the largest |key|, else the largest |min| of a value group,
 * else the largest |max| of one (the order of its checks). */
static int int_range_error(Quantized *Q, const float *k, const float *v, int64_t stride, int heads, int d) {
    float big_k = 0.0f, big_lo = 0.0f, big_hi = 0.0f;
    const int gv = Q->value_group;
    for (int h = 0; h < heads; h++)
        for (int c0 = 0; c0 < d; c0 += gv) {
            const float *kh = k + h * stride + c0, *vh = v + h * stride + c0;
            float lo = vh[0], hi = vh[0];
            for (int c = 0; c < gv; c++) {
                big_k = fabsf(kh[c]) > big_k ? fabsf(kh[c]) : big_k;
                lo = vh[c] < lo ? vh[c] : lo;
                hi = vh[c] > hi ? vh[c] : hi;
            }
            big_lo = fabsf(lo) > big_lo ? fabsf(lo) : big_lo;
            big_hi = fabsf(hi) > big_hi ? fabsf(hi) : big_hi;
        }
    Q->overflow_what = big_k > F16_MAX ? 0 : 1;
    Q->overflow = big_k > F16_MAX ? big_k : big_lo > F16_MAX ? big_lo : big_hi;
    return big_k > F16_MAX || big_lo > F16_MAX || big_hi > F16_MAX;
}

/* f16 (scale, zero) of the range [lo, hi] in 2^bits levels, as quantized._affine: zero = f16(lo),
 * scale = f16((hi - zero) / (2^bits - 1)), both rounded to nearest even */
static void int_affine(float lo, float hi, int bits, uint16_t *scale, uint16_t *zero) {
    *zero = f32_to_f16(lo);
    *scale = f32_to_f16((hi - kvlab_fp16_to_fp32(*zero)) / (float)((1 << bits) - 1));
}

/* x's code, as quantized._encode: round((x - zero) / scale) (ties to even) clamped to [0, 2^bits); 0 for a scale <= 0 */
static uint8_t int_encode(float x, float scale, float zero, int bits) {
    if (!(scale > 0.0f)) return 0;
    const float top = (float)((1 << bits) - 1), r = nearbyintf((x - zero) / scale);
    return (uint8_t)(r < 0.0f ? 0.0f : r > top ? top : r);
}

/* Token `index` of KV head g's coded part, as QuantizedCache._store stores it one token at a time: its values coded
 * (per value group: min/max -> f16 scale/zero -> codes); its key into the stage, or, when it completes a group, the
 * group's G keys (the stage's G - 1 rows and this one) coded with one f16 scale/zero per channel from their min/max.
 * The stage keeps its rows (the module path leaves them too). k, v: (d,) within float16's range (int_range_error). */
/* the row of KV head g's codes and value scales that slot `slot` is (see Quantized) */
static inline int64_t int_row(const Quantized *Q, int g, int64_t slot) {
    return slot / Q->block_rows * Q->block_stride + g * Q->head_stride + slot % Q->block_rows * Q->slot_stride;
}

/* the row of KV head g's key scales that slot `slot`'s key group is */
static inline int64_t int_group_row(const Quantized *Q, int g, int64_t slot) {
    return slot / Q->block_rows * Q->meta_block_stride + g * Q->meta_head_stride
        + slot % Q->block_rows / Q->group * Q->meta_group_stride;
}

static void int_store(const Quantized *Q, float *k_stage, int g, int64_t slot, int have, const float *k, const float *v,
                      int d) {
    const int G = Q->group, bits = Q->bits, gv = Q->value_group, n_vg = d / gv;
    uint8_t codes[CB_MAX_DIM];
    const int64_t at = int_row(Q, g, slot);
    for (int j = 0; j < n_vg; j++) {
        const float *x = v + j * gv;
        float lo = x[0], hi = x[0];
        for (int c = 1; c < gv; c++) {
            lo = x[c] < lo ? x[c] : lo;
            hi = x[c] > hi ? x[c] : hi;
        }
        uint16_t *scale = Q->v_scale + at * n_vg + j, *zero = Q->v_zero + at * n_vg + j;
        int_affine(lo, hi, bits, scale, zero);
        const float s = kvlab_fp16_to_fp32(*scale), z = kvlab_fp16_to_fp32(*zero);
        for (int c = 0; c < gv; c++) codes[j * gv + c] = int_encode(x[c], s, z, bits);
    }
    int_pack_row(codes, bits, d, Q->v_codes + at * Q->v_row_bytes);
    const float *stage = k_stage + g * Q->stage_head_stride * d;   /* row r at r * stage_row_stride rows */
    const int64_t row = Q->stage_row_stride * d;
    if (have < G - 1) {
        memcpy(k_stage + (g * Q->stage_head_stride + have * Q->stage_row_stride) * d, k, sizeof(float) * (size_t)d);
        return;
    }
    const int64_t meta = int_group_row(Q, g, slot) * d;
    float s[CB_MAX_DIM], z[CB_MAX_DIM];
    for (int c = 0; c < d; c++) {
        float lo = k[c], hi = k[c];
        for (int r = 0; r < G - 1; r++) {
            const float x = stage[r * row + c];
            lo = x < lo ? x : lo;
            hi = x > hi ? x : hi;
        }
        int_affine(lo, hi, bits, Q->k_scale + meta + c, Q->k_zero + meta + c);
        s[c] = kvlab_fp16_to_fp32(Q->k_scale[meta + c]);
        z[c] = kvlab_fp16_to_fp32(Q->k_zero[meta + c]);
    }
    for (int r = 0; r < G; r++) {   /* the group's slots: consecutive, G dividing the block size */
        const float *x = r < G - 1 ? stage + r * row : k;
        for (int c = 0; c < d; c++) codes[c] = int_encode(x[c], s[c], z[c], bits);
        int_pack_row(codes, bits, d, Q->k_codes + int_row(Q, g, slot - have + r) * Q->k_row_bytes);
    }
}

/* The integer store on its own, for the tests: token `index` of each of `heads` KV heads (k, v: (heads, d)), checked
 * and stored as the fused step does. 0; 1 when the K/V exceed float16's range (overflow fields set, nothing
 * written); -1 for bad arguments. */
int kvlab_int_append(Quantized *Q, int heads, int d, int32_t index, const float *k, const float *v) {
    if (heads <= 0 || d <= 0 || d > CB_MAX_DIM || index < 0 || index >= Q->slots || !kvlab_int_layout_ok(Q, d)) return -1;
    if (!all_finite(k, heads * d) || !all_finite(v, heads * d)) return -1;
    if (int_range_error(Q, k, v, d, heads, d)) return 1;
    for (int g = 0; g < heads; g++) int_store(Q, Q->k_stage, g, index, index % Q->group, k + (int64_t)g * d, v + (int64_t)g * d, d);
    return 0;
}

/* Code n tokens' K/V into integer layer Q (the serving pool's layout, see Quantized): token r's keys at k + r * kv_stride
 * and values at v + r * kv_stride, (Hkv, d) each; it is at position positions[r] of its sequence, goes to slot slots[r]
 * (< Q->slots; a key group's G slots consecutive) and stages its key in stage row stages[r] (< Q->stages) at Q->k_stage
 * + stages[r] * stage_stride floats (its sequence's, (G, Hkv, d)). The tokens of one sequence come in position order.
 * The one coder of an integer token, as the fused step stores one (int_store). 0; 1 when the K/V are not finite; 2
 * when they exceed float16's range (Q's overflow fields say how) (nothing written either way: the caller's reference
 * names it); -1 for bad arguments. */
int kvlab_int_code_tokens(Quantized *Q, int Hkv, int d, int64_t n, const float *k, const float *v, int64_t kv_stride,
                          const int64_t *slots, const int64_t *positions, const int64_t *stages, int64_t stage_stride,
                          int n_threads) {
    if (Hkv <= 0 || d <= 0 || d > CB_MAX_DIM || n < 0 || n_threads < 1 || !kvlab_int_layout_ok(Q, d) || stage_stride < 0
        || kv_stride < (int64_t)Hkv * d)
        return -1;
    for (int64_t r = 0; r < n; r++)
        if (slots[r] < 0 || slots[r] >= Q->slots || positions[r] < 0 || stages[r] < 0 || stages[r] >= Q->stages
            || slots[r] % Q->group != positions[r] % Q->group)
            return -1;
    for (int64_t r = 0; r < n; r++)
        if (!all_finite(k + r * kv_stride, Hkv * d) || !all_finite(v + r * kv_stride, Hkv * d)) return 1;
    for (int64_t r = 0; r < n; r++)
        if (int_range_error(Q, k + r * kv_stride, v + r * kv_stride, d, Hkv, d)) return 2;
    #pragma omp parallel for schedule(static) num_threads(n_threads < Hkv ? n_threads : Hkv)
    for (int g = 0; g < Hkv; g++)   /* a head's tokens in order: a group completes after its staged keys */
        for (int64_t r = 0; r < n; r++)
            int_store(Q, Q->k_stage + stages[r] * stage_stride, g, slots[r], (int)(positions[r] % Q->group),
                      k + r * kv_stride + (int64_t)g * d, v + r * kv_stride + (int64_t)g * d, d);
    return 0;
}


/* x (d_model,): the token's embedding (not modified). kv: (n_layers,) each layer's K/V (see LayerKV); dense layers
 * hold positions [0, pos) and `pos` is written; coded layers hold and write as `fill` says. cos/sin: (head_dim,) at
 * `pos`. int8_matrices: a flag per matrix (n_layers x 4, QKV..DOWN, then the head) for int8 activations, or NULL for
 * none. logits: (vocab,). Returns 0; L + 1 when layer L's new K/V hold a NaN/Inf (or round to Inf in f16/bf16);
 * n_layers + L + 1 when a coded layer L's new 16-bit scale overflows, or the K/V an integer layer L stores exceed
 * float16's range (its Quantized says which and how far) (layers < L were written, L and later were not); -1 for
 * bad arguments or no memory. */
int kvlab_decode_step(const Model *m, const float *x_in, int32_t pos, const float *cos_, const float *sin_,
                      const LayerKV *kv, const Fill *fill, const uint8_t *int8_matrices, float *logits, int n_threads) {
    static const uint8_t fp32_activations[4] = {0, 0, 0, 0};
    const int d = m->d_model, hd = m->head_dim, H = m->n_heads, Hkv = m->n_kv_heads, n_layers = m->n_layers;
    if (pos < 0 || Hkv <= 0 || H % Hkv != 0 || hd % 2 != 0 || hd > CB_MAX_DIM || n_threads < 1) return -1;
    int any_coded = 0, any_int = 0, max_chunks = 0;
    cb_layout *layouts = calloc(2 * (size_t)n_layers * (size_t)Hkv, sizeof(cb_layout));   /* K, V layout of each coded layer's heads */
    if (!layouts) return -1;
    for (int l = 0; l < n_layers; l++) {
        const LayerKV *L = &kv[l];
        int chunks;
        if (L->type != KV_F32 && L->type != KV_F16 && L->type != KV_BF16) { free(layouts); return -1; }
        if (L->coded) {
            const Coded *C = L->coded;
            const int turns = kvlab_tq_pre_rope(C) || C->rope_mean;   /* it reads each slot's RoPE row */
            if (L->type != KV_F32 || !fill || !fill_fits(L, fill) || C->block_rows != C->slots
                || (turns && (!C->rope_cos || !C->rope_sin)) || (C->rope_mean && !C->rope_steps)
                || kvlab_tq_layouts(C, Hkv, hd, &layouts[2 * (int64_t)l * Hkv])) { free(layouts); return -1; }
            const int spill = fill->write == WRITE_SPILL;
            chunks = chunks_of(fill->first + (fill->write == WRITE_FIRST)) + coded_chunks(fill->coded + (fill->write == WRITE_CODED || spill))
                   + chunks_of(fill->recent + (fill->write == WRITE_RECENT));
            any_coded = 1;
        } else if (L->quant) {
            if (L->type != KV_F32 || !fill || !fill_fits(L, fill) || !kvlab_int_layout_ok(L->quant, hd)
                || hd > KVLAB_INT_MAX_DIM || H / Hkv > KVLAB_INT_QUERIES) { free(layouts); return -1; }
            chunks = chunks_of(fill->first + (fill->write == WRITE_FIRST))
                   + chunks_of(fill->coded + (fill->write == WRITE_CODED || fill->write == WRITE_SPILL))
                   + chunks_of(fill->recent + (fill->write == WRITE_RECENT));
            any_int = 1;
        } else {
            if (pos >= L->capacity) { free(layouts); return -1; }
            const int start = m->window > 0 && pos + 1 > m->window ? pos + 1 - m->window : 0;
            chunks = chunks_of(pos + 1 - start);
        }
        max_chunks = chunks > max_chunks ? chunks : max_chunks;
    }
    const int q_dim = H * hd, kv_dim = Hkv * hd, group = H / Hkv;
    const int64_t widest = max64(max64(d, m->d_ff), q_dim);
    float *x = malloc(sizeof(float) * (size_t)d);
    float *h = malloc(sizeof(float) * (size_t)widest);
    float *y = malloc(sizeof(float) * (size_t)d);
    float *qkv = malloc(sizeof(float) * (size_t)(q_dim + 2 * kv_dim));
    float *att = malloc(sizeof(float) * (size_t)q_dim);
    float *xsum = malloc(sizeof(float) * (size_t)kvlab_matrix_scratch(widest));
    /* each thread's own copy of the residual x, of the normalized input h and of its block sums: the small vector
     * work between two matrices is done by every thread alike (the same bits), so no thread waits for another there */
    const int64_t own_floats = d + widest + kvlab_matrix_scratch(widest);
    float *own = malloc(sizeof(float) * (size_t)(n_threads * own_floats));
    float *parts = malloc(sizeof(float) * (size_t)H * (size_t)max_chunks * (size_t)(hd + 2));
    /* each thread's scratch for one key chunk's read (dense, TurboQuant or integer rows); the new token's rounded K|V */
    const size_t dense_tile = (size_t)kvlab_dense_read_floats(group, hd, hd);
    const size_t read_tile = any_coded ? (size_t)kvlab_tq_read_floats(group, (hd + 15) / 16 * 16) : 0;
    const size_t int_tile = any_int ? (size_t)kvlab_int_scratch(KEY_CHUNK, hd, hd) : 0;
    const size_t tile = max64(max64(dense_tile, read_tile), int_tile);
    float *chunk_kv = malloc(sizeof(float) * (size_t)n_threads * tile);
    uint16_t *rounded = malloc(sizeof(uint16_t) * 2 * (size_t)kv_dim);
    /* coded layers: the queries as the codes read them, q' = (q w) M * scale, and q . mu * scale per query head
     * (+ropemean: then each query's [A | B] * scale, kvlab_tq_turn_coef); the new token's codes and scales before
     * they are stored */
    float *q_coded = malloc(sizeof(float) * (2 * (size_t)q_dim + H));
    uint8_t *new_codes = any_coded ? malloc((size_t)Hkv * 2 * ROW_ROOM) : NULL;
    uint16_t *new_scales = malloc(sizeof(uint16_t) * 2 * (size_t)Hkv);
    KeyExtras *new_extras = any_coded ? malloc(sizeof(KeyExtras) * (size_t)Hkv) : NULL;
    int status = 0;
    if (!x || !h || !y || !qkv || !att || !xsum || !own || !parts || !rounded || !q_coded || !new_scales
        || !chunk_kv || (any_coded && (!new_codes || !new_extras))) status = -1;
    else memcpy(x, x_in, sizeof(float) * (size_t)d);

    StepBarrier barrier = {.n_threads = 1};
    #pragma omp parallel num_threads(n_threads) if(status == 0)
    {
    const int me = step_thread(&barrier);
    int sense = 0;
    float *my_x = own + (int64_t)me * own_floats;
    float *my_h = my_x + d, *my_sums = my_h + widest;
    memcpy(my_x, x, sizeof(float) * (size_t)d);
    for (int l = 0; l < n_layers && status == 0; l++) {
        const Layer *W = &m->layers[l];
        const uint8_t *int8 = int8_matrices ? int8_matrices + 4 * (size_t)l : fp32_activations;   /* QKV, OUT, GATE_UP, DOWN */
        const LayerKV *L = &kv[l];
        const Coded *C = L->coded;
        Quantized *Q = L->quant;
        const cb_layout *head_layouts = &layouts[2 * (int64_t)l * Hkv];   /* head g's keys at [2g], values at [2g + 1] */
        const size_t elem = L->type == KV_F32 ? 4 : 2;
        /* rows of each part once this token is in, and their chunks */
        int start = 0, n_first, n_coded = 0, n_recent = 0;
        if (C || Q) {
            n_first = fill->first + (fill->write == WRITE_FIRST);
            n_coded = fill->coded + (fill->write == WRITE_CODED || fill->write == WRITE_SPILL);
            n_recent = fill->recent + (fill->write == WRITE_RECENT);
        } else {
            start = m->window > 0 && pos + 1 > m->window ? pos + 1 - m->window : 0;
            n_first = pos + 1 - start;
        }
        const int c_first = chunks_of(n_first), c_coded = C ? coded_chunks(n_coded) : chunks_of(n_coded);
        const int n_chunks = c_first + c_coded + chunks_of(n_recent), per_coded = coded_chunk(n_coded);
        rms_norm(my_x, W->attn_norm, m->rms_eps, d, my_h);
        kvlab_matrix_prepare(&W->qkv, int8[0], my_h, my_sums);
        kvlab_matrix_rows(&W->qkv, int8[0], my_h, my_sums, qkv);
        step_barrier(&barrier, &sense);
        if (me == 0) {
            float *q = qkv, *k = qkv + q_dim, *v = qkv + q_dim + kv_dim;
            for (int i = 0; i < H && W->q_norm; i++) rms_norm(q + i * hd, W->q_norm, m->rms_eps, hd, q + i * hd);
            for (int i = 0; i < Hkv && W->k_norm; i++) rms_norm(k + i * hd, W->k_norm, m->rms_eps, hd, k + i * hd);
            for (int i = 0; i < H; i++) rope(q + i * hd, cos_, sin_, hd);
            for (int i = 0; i < Hkv; i++) rope(k + i * hd, cos_, sin_, hd);
            const void *k_new = k, *v_new = v;       /* what is stored: fp32, or the rounded 16-bit values */
            int ok = all_finite(k, kv_dim) && all_finite(v, kv_dim);
            if (ok && L->type != KV_F32) {
                ok = kv_store(L->type, k, kv_dim, rounded) & kv_store(L->type, v, kv_dim, rounded + kv_dim);
                k_new = rounded;
                v_new = rounded + kv_dim;
            }
            const int write = C || Q ? fill->write : WRITE_FIRST;
            const int row_first = C || Q ? fill->first : pos;
            if (ok && C && (write == WRITE_CODED || write == WRITE_SPILL)) {   /* code every head before storing any */
                const int64_t at = (int64_t)fill->coded * hd;   /* +prerope: the slot's position turns the key back */
                for (int g = 0; g < Hkv && status == 0; g++) {
                    const float *src_k = write == WRITE_CODED ? k + g * hd : L->win_k + (int64_t)g * L->window * hd;
                    const float *src_v = write == WRITE_CODED ? v + g * hd : L->win_v + (int64_t)g * L->window * hd;
                    if (code_head(C, head_layouts, g, hd, src_k, src_v, C->rope_cos ? C->rope_cos + at : NULL,
                                  C->rope_cos ? C->rope_sin + at : NULL, new_codes + (size_t)g * 2 * ROW_ROOM, &new_scales[2 * g], &new_extras[g]))
                        status = n_layers + l + 1;
                }
            }
            if (ok && Q && (write == WRITE_CODED || write == WRITE_SPILL)   /* the rows the integer store takes */
                && int_range_error(Q, write == WRITE_CODED ? k : L->win_k, write == WRITE_CODED ? v : L->win_v,
                                   write == WRITE_CODED ? hd : (int64_t)L->window * hd, Hkv, hd))
                status = n_layers + l + 1;
            if (!ok) status = l + 1;
            if (status == 0) {
                for (int g = 0; g < Hkv; g++) {
                    if (write == WRITE_FIRST) {
                        const int64_t at = ((int64_t)g * L->capacity + row_first) * hd;
                        memcpy((uint8_t *)L->k + at * elem, (const uint8_t *)k_new + (size_t)g * hd * elem, elem * (size_t)hd);
                        memcpy((uint8_t *)L->v + at * elem, (const uint8_t *)v_new + (size_t)g * hd * elem, elem * (size_t)hd);
                        continue;
                    }
                    float *wk = L->win_k + (int64_t)g * L->window * hd, *wv = L->win_v + (int64_t)g * L->window * hd;
                    if (Q && (write == WRITE_CODED || write == WRITE_SPILL))   /* before the window moves */
                        int_store(Q, Q->k_stage, g, fill->coded, fill->coded % Q->group, write == WRITE_CODED ? k + g * hd : wk,
                                  write == WRITE_CODED ? v + g * hd : wv, hd);
                    else if (write == WRITE_CODED || write == WRITE_SPILL)
                        store_head(C, g, hd, fill->coded, new_codes + (size_t)g * 2 * ROW_ROOM, &new_scales[2 * g], &new_extras[g]);
                    if (write == WRITE_SPILL) {   /* the window moves up one row */
                        memmove(wk, wk + hd, sizeof(float) * (size_t)(L->window - 1) * hd);
                        memmove(wv, wv + hd, sizeof(float) * (size_t)(L->window - 1) * hd);
                    }
                    if (write == WRITE_RECENT || write == WRITE_SPILL) {
                        const int row = write == WRITE_RECENT ? fill->recent : L->window - 1;
                        memcpy(wk + (int64_t)row * hd, k + g * hd, sizeof(float) * (size_t)hd);
                        memcpy(wv + (int64_t)row * hd, v + g * hd, sizeof(float) * (size_t)hd);
                    }
                }
                if (C && n_coded > 0 && kvlab_tq_pre_rope(C))   /* +prerope: the rebuilt keys read by q */
                    for (int i = 0; i < H; i++) {
                        for (int c = 0; c < hd; c++) q_coded[(int64_t)i * hd + c] = q[i * hd + c] * m->attn_scale;
                        q_coded[q_dim + i] = 0.0f;
                    }
                else if (C && n_coded > 0)   /* the queries as the codes read them */
                    for (int i = 0; i < H; i++) {
                        const int g = i / group;
                        float qw[CB_MAX_DIM];
                        for (int c = 0; c < hd; c++) qw[c] = C->weight_codes ? q[i * hd + c] * key_weight(C, g, hd, c) : q[i * hd + c];
                        rotate(qw, C->rotation, hd, q_coded + (int64_t)i * hd);
                        for (int c = 0; c < hd; c++) q_coded[(int64_t)i * hd + c] *= m->attn_scale;
                        float shift = 0.0f, mu[CB_MAX_DIM];
                        for (int c = 0; c < hd; c++) mu[c] = C->offset[0] ? C->fp8_values[C->offset[0][(int64_t)g * hd + c]] : 0.0f;
                        if (C->rope_mean)   /* the offset turns with each key: its term per key (kvlab_tq_read) */
                            kvlab_tq_turn_coef(q + i * hd, mu, hd, m->attn_scale, q_coded + q_dim + H + (int64_t)i * hd);
                        else if (C->offset[0])
                            shift = dot(q + i * hd, mu, hd) * m->attn_scale;
                        q_coded[q_dim + i] = shift;
                    }
            }
        }
        step_barrier(&barrier, &sense);   /* `status` is the same for every thread after it */
        if (status != 0) break;
        #pragma omp for schedule(static) nowait
        for (int item = 0; item < Hkv * n_chunks; item++) {       /* (KV head, key chunk) */
            const int g = item / n_chunks, c = item % n_chunks;
#ifdef _OPENMP
            float *mine = chunk_kv ? chunk_kv + (size_t)omp_get_thread_num() * tile : NULL;
#else
            float *mine = chunk_kv;
#endif
            static const int32_t one_block = 0;   /* a single cache's rows: one block */
            if (c < c_first || c >= c_first + c_coded) {   /* full-precision rows of first or of the recent window */
                const int in_first = c < c_first;
                const int64_t t0 = in_first ? start + (int64_t)c * KEY_CHUNK : (int64_t)(c - c_first - c_coded) * KEY_CHUNK;
                const int64_t end = in_first ? start + n_first : n_recent, rows = in_first ? L->capacity : L->window;
                const int type = in_first ? L->type : KV_F32;
                const size_t at = (size_t)g * (size_t)rows * (size_t)hd * (type == KV_F32 ? 4 : 2);   /* head g's rows */
                const DenseHead dense = {.type = type, .d = hd, .dv = hd, .block_rows = rows,
                                         .k = (const uint8_t *)(in_first ? L->k : (void *)L->win_k) + at,
                                         .v = (const uint8_t *)(in_first ? L->v : (void *)L->win_v) + at};
                kvlab_dense_read(&dense, &one_block, t0, end - t0 < KEY_CHUNK ? end : t0 + KEY_CHUNK, qkv + (int64_t)g * group * hd,
                                 group, m->attn_scale, mine, parts + ((int64_t)g * group * max_chunks + c) * (hd + 2),
                                 (int64_t)max_chunks * (hd + 2));
            } else if (c < c_first + c_coded && Q) {   /* integer codes: kvlab_int_attend, the one block of a single cache */
                const int64_t t0 = (int64_t)(c - c_first) * KEY_CHUNK, complete = n_coded / Q->group * Q->group;
                const int n_vg = hd / Q->value_group;
                const int64_t head = (int64_t)g * Q->head_stride, meta = (int64_t)g * Q->meta_head_stride * hd;
                const IntHead R = {.bits = Q->bits, .dk = hd, .dv = hd, .key_group = Q->group, .value_group = Q->value_group,
                                   .k_codes = Q->k_codes + head * Q->k_row_bytes, .k_row_stride = Q->slot_stride * Q->k_row_bytes,
                                   .v_codes = Q->v_codes + head * Q->v_row_bytes, .v_row_stride = Q->slot_stride * Q->v_row_bytes,
                                   .k_scale = Q->k_scale + meta, .k_zero = Q->k_zero + meta, .k_meta_stride = Q->meta_group_stride * hd,
                                   .v_scale = Q->v_scale + head * n_vg, .v_zero = Q->v_zero + head * n_vg,
                                   .v_meta_stride = Q->slot_stride * n_vg,
                                   .exact = Q->k_stage + (int64_t)g * Q->stage_head_stride * hd, .exact_first = complete,
                                   .exact_stride = Q->stage_row_stride * hd};
                IntQuery reads[KVLAB_INT_QUERIES];   /* each query head of the group: the chunk, its part normalized */
                for (int i = 0; i < group; i++) {
                    float *part = parts + ((int64_t)(g * group + i) * max_chunks + c) * (hd + 2);
                    reads[i] = (IntQuery){.q = qkv + (int64_t)(g * group + i) * hd, .out = part, .lo = t0, .coded = complete,
                                          .hi = n_coded - t0 < KEY_CHUNK ? n_coded : t0 + KEY_CHUNK, .lse = part + hd};
                    part[hd + 1] = 1.0f;
                }
                kvlab_int_attend(&R, reads, group, m->attn_scale, mine);
            } else {   /* coded rows: kvlab_tq_read, the one block of a single cache */
                const int64_t t0 = (int64_t)(c - c_first) * per_coded;
                const int n = n_coded - t0 < per_coded ? n_coded - (int)t0 : per_coded;
                float weights[CB_MAX_DIM], offset[CB_MAX_DIM];
                PreRope pre;
                if (kvlab_tq_pre_rope(C)) {   /* +prerope: this KV head's weights and offset, slot RoPE rows */
                    for (int i = 0; i < hd && C->weight_codes; i++) weights[i] = key_weight(C, g, hd, i);
                    for (int i = 0; i < hd && C->offset[0]; i++) offset[i] = C->fp8_values[C->offset[0][(int64_t)g * hd + i]];
                    pre = (PreRope){C->unrotation, C->unrotation_signs, C->weight_codes ? weights : NULL, C->offset[0] ? offset : NULL,
                                    C->rope_cos, C->rope_sin};
                }
                const KeyTurn turn = {q_coded + q_dim + H + (int64_t)g * group * hd, C->rope_cos, C->rope_sin,
                                      C->rope_steps};   /* +ropemean */
                const TqHead head = {.C = C, .layout = {&head_layouts[2 * g], &head_layouts[2 * g + 1]}, .g = g, .scale = 1.0f,
                                     .pre = kvlab_tq_pre_rope(C) ? &pre : NULL,
                                     .turn = C->rope_mean ? &turn : NULL};
                int64_t lo[CB_MAX_DIM], hi[CB_MAX_DIM];   /* every query of the group reads the whole chunk */
                for (int i = 0; i < group; i++) lo[i] = t0, hi[i] = t0 + n;
                float *part = parts + ((int64_t)g * group * max_chunks + c) * (hd + 2);
                const int64_t part_stride = (int64_t)max_chunks * (hd + 2);
                kvlab_tq_read(&head, &one_block, t0, t0 + n, q_coded + (int64_t)g * group * hd, group, 0, group, lo, hi, mine,
                              part, part_stride);
                for (int i = 0; i < group; i++) part[i * part_stride + hd] += q_coded[q_dim + g * group + i];   /* q . mu */
            }
        }
        step_barrier(&barrier, &sense);
        #pragma omp for schedule(static) nowait
        for (int i = 0; i < H; i++) {
            const int g = i / group;
            float v_offset[CB_MAX_DIM];
            const int has_offset = C && C->offset[1];
            for (int c = 0; has_offset && c < hd; c++) v_offset[c] = C->fp8_values[C->offset[1][(int64_t)g * hd + c]];
            combine_parts(parts + (int64_t)i * max_chunks * (hd + 2), n_chunks, hd, c_first, C ? c_first + c_coded : c_first,
                          C ? C->rotation : NULL, has_offset ? v_offset : NULL, att + i * hd);
        }
        step_barrier(&barrier, &sense);
        kvlab_matrix_prepare(&W->out, int8[1], att, my_sums);
        kvlab_matrix_rows(&W->out, int8[1], att, my_sums, y);
        step_barrier(&barrier, &sense);
        for (int i = 0; i < d; i++) my_x[i] += y[i];
        rms_norm(my_x, W->ffn_norm, m->rms_eps, d, my_h);
        kvlab_matrix_prepare(&W->gate_up, int8[2], my_h, my_sums);
        /* a piece of gate rows and their up rows by one thread, then silu(gate) * up as the batched step takes it */
        #pragma omp for schedule(static) nowait
        for (int p = 0; p < (m->d_ff + SWIGLU_PIECE - 1) / SWIGLU_PIECE; p++) {
            const int i0 = p * SWIGLU_PIECE, n = m->d_ff - i0 < SWIGLU_PIECE ? m->d_ff - i0 : SWIGLU_PIECE;
            float gate[SWIGLU_PIECE], up[SWIGLU_PIECE];
            for (int i = 0; i < n; i++) {
                gate[i] = kvlab_matrix_row(&W->gate_up, int8[2], i0 + i, my_h, my_sums);
                up[i] = kvlab_matrix_row(&W->gate_up, int8[2], m->d_ff + i0 + i, my_h, my_sums);
            }
            kvlab_swiglu(gate, up, n, h + i0);
        }
        step_barrier(&barrier, &sense);
        kvlab_matrix_prepare(&W->down, int8[3], h, my_sums);
        kvlab_matrix_rows(&W->down, int8[3], h, my_sums, y);
        step_barrier(&barrier, &sense);
        for (int i = 0; i < d; i++) my_x[i] += y[i];
    }
    #pragma omp master
    memcpy(x, my_x, sizeof(float) * (size_t)d);
    }
    if (status == 0) {
        rms_norm(x, m->final_norm, m->rms_eps, d, h);
        #pragma omp parallel num_threads(n_threads)
        matvec(&m->head, int8_matrices && int8_matrices[4 * (size_t)n_layers], h, xsum, logits);
    }
    free(x); free(h); free(y); free(qkv); free(att); free(xsum); free(own); free(parts); free(chunk_kv); free(rounded);
    free(q_coded); free(new_codes); free(new_scales); free(new_extras); free(layouts);
    return status;
}

/* The row helpers above for the batched step (batchstep.c, declared in decode.h) */
float kvlab_dot(const float *a, const float *b, int64_t n) { return dot(a, b, n); }
float kvlab_exp_shifted(float *s, int n, float top) { return exp_shifted(s, n, top); }
void kvlab_rms_norm(const float *x, const float *w, float eps, int n, float *y) { rms_norm(x, w, eps, n, y); }
void kvlab_rope(float *x, const float *cos_, const float *sin_, int d) { rope(x, cos_, sin_, d); }
