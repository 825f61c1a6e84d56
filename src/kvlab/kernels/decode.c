/* One decode step of a Llama-family decoder in one call: batch 1, one new token, fp32, K/V in kvlab's
 * DenseCache buffers. It is the Python Decoder's T = 1 path (kvlab/model/llama.py) with the per-layer
 * interpreter and small-op overhead taken out, and it is tested against that path.
 *
 * For every layer:  h = rms_norm(x) ; q|k|v = W_qkv h (+ bias) ; [q/k head norms] ; RoPE(q, k) at `pos` ;
 *                   K/V written at `pos` (after a finiteness check) ; attention of each query head over its
 *                   KV head's positions [start, pos] ; x += W_out a ;
 *                   h = rms_norm(x) ; g|u = W_gate_up h ; x += W_down (silu(g) * u)
 * then logits = W_head rms_norm(x). Matrices are GGUF blocks (Q4_0/Q4_1/Q8_0, read by blockgemv.c's row
 * kernels) or fp32 rows. One OpenMP parallel region spans the whole step: matrix rows and attention heads
 * are shared between the threads, the small vector work is done by one of them.
 *
 * K/V storage: fp32, f16 or bf16 (kvlab's dense, dense-f16, dense-bf16 caches). A new token's K/V are
 * rounded to nearest-even as torch's .to() rounds them; f16/bf16 keys and values are read back one key chunk
 * at a time, converted to fp32 into a per-thread scratch that stays in cache (F16C / a 16-bit shift, 16 or 8
 * lanes at a time under AVX-512 / AVX2, one value at a time in plain C), and the chunk's attention is the
 * fp32 arithmetic of the fp32 cache: exact conversions, so the step equals the module path's upcast reads.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "blockgemv.h"

/* Attention reads the keys in chunks of KEY_CHUNK positions per KV head (flash-decoding): a chunk's K/V
 * (64 KB each at head_dim 64) stay in cache while every query head of the group reads them, the chunks
 * share out between the threads even when there are fewer KV heads than threads, and the chunks' partial
 * softmax sums are combined in a fixed order, so the result does not depend on the thread count. */
#define KEY_CHUNK 256

enum { KV_F32 = 0, KV_F16 = 1, KV_BF16 = 2 };   /* how the cache stores K/V */

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

/* dst (n,) fp32 = the f16 / bf16 values at src, exactly */
static void kv_load(int kv_type, const uint16_t *src, int64_t n, float *dst) {
    int64_t i = 0;
#if defined(__AVX512F__)
    if (kv_type == KV_F16)
        for (; i + 16 <= n; i += 16) _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(src + i))));
    else
        for (; i + 16 <= n; i += 16)
            _mm512_storeu_ps(dst + i, _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(src + i))), 16)));
#elif defined(__AVX2__) && defined(__F16C__)
    if (kv_type == KV_F16)
        for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + i))));
    else
        for (; i + 8 <= n; i += 8)
            _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(_mm256_slli_epi32(
                _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(src + i))), 16)));
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

typedef struct {
    int32_t type;            /* F32, Q4_0, Q4_1 or Q8_0 */
    int64_t rows, cols;
    const uint8_t *data;     /* rows × row bytes: fp32 values or consecutive blocks */
    const float *bias;       /* (rows,) or NULL */
} Matrix;

typedef struct {
    const float *attn_norm, *ffn_norm;   /* (d_model,) */
    const float *q_norm, *k_norm;        /* (head_dim,) or NULL */
    Matrix qkv, out, gate_up, down;      /* q|k|v rows fused, gate|up rows fused */
} Layer;

typedef struct {
    int32_t n_layers, d_model, n_heads, n_kv_heads, head_dim, d_ff;
    int32_t window;                      /* sliding window in tokens, 0 for none */
    float rms_eps, attn_scale;
    const Layer *layers;
    const float *final_norm;             /* (d_model,) */
    Matrix head;                         /* (vocab, d_model) */
} Model;

/* Rotate pairs (i, i + D/2) of one head, as llama.py's apply_rope: x*cos + (-x2 | x1)*sin */
static void rope(float *x, const float *cos_, const float *sin_, int d) {
    const int half = d / 2;
    for (int i = 0; i < half; i++) {
        const float x1 = x[i], x2 = x[i + half];
        x[i] = x1 * cos_[i] - x2 * sin_[i];
        x[i + half] = x2 * cos_[i + half] + x1 * sin_[i + half];
    }
}

#if defined(__AVX512F__)
/* a . b: 16-lane FMAs into two accumulators, then a fixed reduction tree: the same bits on every call */
static float dot(const float *a, const float *b, int64_t n) {
    __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        acc0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc0);
        acc1 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i + 16), _mm512_loadu_ps(b + i + 16), acc1);
    }
    for (; i < n; i += 16) {
        const __mmask16 live = n - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - i)) - 1u);
        acc0 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(live, a + i), _mm512_maskz_loadu_ps(live, b + i), acc0);
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
}

/* out (d,) = sum_t p[t] * values[t] over t in [start, end): 16 output lanes at a time, four positions at a
 * time into four accumulators (one would make every position wait for the previous FMA) */
static void weighted_sum(const float *p, const float *values, int start, int end, int d, float *out) {
    for (int c = 0; c < d; c += 16) {
        const __mmask16 live = d - c >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (d - c)) - 1u);
        const float *v = values + c;
        __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
        int t = start;
        for (; t + 4 <= end; t += 4)
            for (int j = 0; j < 4; j++)
                acc[j] = _mm512_fmadd_ps(_mm512_set1_ps(p[t + j]), _mm512_maskz_loadu_ps(live, v + (int64_t)(t + j) * d), acc[j]);
        for (; t < end; t++)
            acc[0] = _mm512_fmadd_ps(_mm512_set1_ps(p[t]), _mm512_maskz_loadu_ps(live, v + (int64_t)t * d), acc[0]);
        _mm512_mask_storeu_ps(out + c, live, _mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3])));
    }
}

/* One step of folding 16 vectors into one: lanes `lo` of (a, b) plus lanes `hi` of (a, b) */
static inline __m512 fold(__m512 a, __m512 b, __m512i lo, __m512i hi) {
    return _mm512_add_ps(_mm512_permutex2var_ps(a, lo, b), _mm512_permutex2var_ps(a, hi, b));
}

/* scores[t] = q . keys[t] * scale for t in [start, end). Sixteen keys at a time: each key's 16 lane partial
 * sums, then four folds that halve the partials per key and pack the keys (16 vectors -> 8 -> 4 -> 2 -> 1),
 * instead of a horizontal sum per key. The rest one key at a time. */
static void key_scores(const float *q, const float *keys, int start, int end, int d, float scale, float *scores) {
    int t = start;
    if (d % 16 == 0) {
        __m512i lo[4], hi[4];
        for (int step = 0, w = 8; step < 4; step++, w /= 2) {   /* fold step: each key holds 2w partials */
            int32_t l[16], h[16];
            for (int j = 0; j < 16; j++) {
                l[j] = (j < 8 ? 0 : 16) + (j % 8) / w * 2 * w + j % w;
                h[j] = l[j] + w;
            }
            lo[step] = _mm512_loadu_si512(l);
            hi[step] = _mm512_loadu_si512(h);
        }
        for (; t + 16 <= end; t += 16) {
            __m512 v[16];
            for (int k = 0; k < 16; k++) {
                const float *key = keys + (int64_t)(t + k) * d;
                __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(q), _mm512_loadu_ps(key));
                for (int c = 16; c < d; c += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + c), _mm512_loadu_ps(key + c), acc);
                v[k] = acc;
            }
            for (int step = 0, n = 16; step < 4; step++, n /= 2)
                for (int k = 0; k < n / 2; k++) v[k] = fold(v[2 * k], v[2 * k + 1], lo[step], hi[step]);
            _mm512_storeu_ps(scores + t, _mm512_mul_ps(v[0], _mm512_set1_ps(scale)));
        }
    }
    for (; t < end; t++) scores[t] = dot(q, keys + (int64_t)t * d, d) * scale;
}
#else
#define LANES 16
/* a . b in LANES fixed partial sums, added in a fixed order: the same bits whatever the compiler vectorizes
 * and wherever the buffers lie (a reduction the compiler may reorder could depend on their alignment). */
static float dot(const float *a, const float *b, int64_t n) {
    float acc[LANES] = {0};
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int j = 0; j < LANES; j++) acc[j] += a[i + j] * b[i + j];
    for (; i < n; i++) acc[i % LANES] += a[i] * b[i];
    for (int width = LANES / 2; width > 0; width /= 2)     /* a pairwise tree, not a serial chain */
        for (int j = 0; j < width; j++) acc[j] += acc[j + width];
    return acc[0];
}

static void weighted_sum(const float *p, const float *values, int start, int end, int d, float *out) {
    memset(out, 0, sizeof(float) * (size_t)d);
    for (int t = start; t < end; t++) {
        const float *v = values + (int64_t)t * d;
        for (int i = 0; i < d; i++) out[i] += p[t] * v[i];
    }
}

static void key_scores(const float *q, const float *keys, int start, int end, int d, float scale, float *scores) {
    for (int t = start; t < end; t++) scores[t] = dot(q, keys + (int64_t)t * d, d) * scale;
}
#endif

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

/* y = M x (+ bias), rows shared between the threads of the enclosing parallel region. xsum: scratch. */
static void matvec(const Matrix *m, const float *x, float *xsum, float *y) {
    const int64_t nblocks = m->cols / QK;
    const int64_t row_bytes = m->type == F32 ? m->cols * 4 : nblocks * kvlab_block_bytes(m->type);
    if (m->type == Q4_0 || m->type == Q4_1) {
        #pragma omp single
        kvlab_block_sums(x, m->cols, xsum);
    }
    #pragma omp for schedule(static)
    for (int64_t r = 0; r < m->rows; r++) {
        const uint8_t *row = m->data + r * row_bytes;
        const float v = m->type == F32 ? dot((const float *)row, x, m->cols)
                                       : kvlab_block_row_dot(m->type, row, x, xsum, nblocks);
        y[r] = m->bias ? v + m->bias[r] : v;
    }
}

/* Attention of one query over n consecutive keys/values of one KV head, not yet normalized:
 * part (d + 2,) = [sum_t e^(s_t - top) v_t | top | sum_t e^(s_t - top)], s_t = q . k_t * scale. scores: (n,) */
static void attend_part(const float *q, const float *keys, const float *values, int n, int d, float scale,
                        float *scores, float *part) {
    key_scores(q, keys, 0, n, d, scale, scores);
    float top = -INFINITY;
    for (int t = 0; t < n; t++) top = scores[t] > top ? scores[t] : top;
    float total = 0.0f;
    for (int t = 0; t < n; t++) {
        scores[t] = expf(scores[t] - top);
        total += scores[t];
    }
    weighted_sum(scores, values, 0, n, d, part);
    part[d] = top;
    part[d + 1] = total;
}

/* out (d,) = the softmax-weighted sum over all keys, from the parts of n_parts key chunks (in order) */
static void combine_parts(const float *parts, int n_parts, int d, float *out) {
    float top = -INFINITY, total = 0.0f;
    for (int c = 0; c < n_parts; c++) top = parts[c * (d + 2) + d] > top ? parts[c * (d + 2) + d] : top;
    for (int i = 0; i < d; i++) out[i] = 0.0f;
    for (int c = 0; c < n_parts; c++) {
        const float *part = parts + c * (d + 2);
        const float w = expf(part[d] - top);
        total += w * part[d + 1];
        for (int i = 0; i < d; i++) out[i] += w * part[i];
    }
    const float inv = 1.0f / total;
    for (int i = 0; i < d; i++) out[i] *= inv;
}

static int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

/* x (d_model,): the token's embedding (not modified). k_cache/v_cache: (n_layers, n_kv_heads, capacity,
 * head_dim) of `kv_type` (KV_F32, KV_F16, KV_BF16), positions [0, pos) filled; position `pos` is written.
 * cos/sin: (head_dim,) at `pos`. logits: (vocab,). Returns 0; L + 1 when layer L's new K/V hold a NaN/Inf
 * (or round to Inf in f16/bf16: layers < L were written, L and later were not); -1 for bad arguments or
 * no memory. */
int kvlab_decode_step(const Model *m, const float *x_in, int32_t pos, const float *cos_, const float *sin_,
                      void *k_cache, void *v_cache, int32_t capacity, float *logits, int n_threads, int kv_type) {
    const int d = m->d_model, hd = m->head_dim, H = m->n_heads, Hkv = m->n_kv_heads;
    if (pos < 0 || pos >= capacity || Hkv <= 0 || H % Hkv != 0 || hd % 2 != 0 || n_threads < 1) return -1;
    if (kv_type != KV_F32 && kv_type != KV_F16 && kv_type != KV_BF16) return -1;
    const size_t elem = kv_type == KV_F32 ? 4 : 2;
    const int q_dim = H * hd, kv_dim = Hkv * hd, group = H / Hkv;
    const int start = m->window > 0 && pos + 1 > m->window ? pos + 1 - m->window : 0;
    const int64_t widest = max64(max64(d, m->d_ff), q_dim);
    float *x = malloc(sizeof(float) * (size_t)d);
    float *h = malloc(sizeof(float) * (size_t)widest);
    float *y = malloc(sizeof(float) * (size_t)d);
    float *qkv = malloc(sizeof(float) * (size_t)(q_dim + 2 * kv_dim));
    float *att = malloc(sizeof(float) * (size_t)q_dim);
    float *gu = malloc(sizeof(float) * 2 * (size_t)m->d_ff);
    float *xsum = malloc(sizeof(float) * (size_t)(widest / QK + 1));
    const int n_chunks = (pos + 1 - start + KEY_CHUNK - 1) / KEY_CHUNK;
    float *scores = malloc(sizeof(float) * (size_t)H * (size_t)n_chunks * KEY_CHUNK);
    float *parts = malloc(sizeof(float) * (size_t)H * (size_t)n_chunks * (size_t)(hd + 2));
    /* f16/bf16: each thread's fp32 copy of one key chunk's keys and values; the new token's rounded K|V */
    float *chunk_kv = kv_type == KV_F32 ? NULL : malloc(sizeof(float) * (size_t)n_threads * 2 * KEY_CHUNK * (size_t)hd);
    uint16_t *rounded = kv_type == KV_F32 ? NULL : malloc(sizeof(uint16_t) * 2 * (size_t)kv_dim);
    int status = 0;
    if (!x || !h || !y || !qkv || !att || !gu || !xsum || !scores || !parts
        || (kv_type != KV_F32 && (!chunk_kv || !rounded))) status = -1;
    else memcpy(x, x_in, sizeof(float) * (size_t)d);

    #pragma omp parallel num_threads(n_threads) if(status == 0)
    for (int l = 0; l < m->n_layers && status == 0; l++) {
        const Layer *L = &m->layers[l];
        const int64_t layer_at = (int64_t)l * Hkv * capacity;
        #pragma omp single
        rms_norm(x, L->attn_norm, m->rms_eps, d, h);
        matvec(&L->qkv, h, xsum, qkv);
        #pragma omp single
        {
            float *q = qkv, *k = qkv + q_dim, *v = qkv + q_dim + kv_dim;
            for (int i = 0; i < H && L->q_norm; i++) rms_norm(q + i * hd, L->q_norm, m->rms_eps, hd, q + i * hd);
            for (int i = 0; i < Hkv && L->k_norm; i++) rms_norm(k + i * hd, L->k_norm, m->rms_eps, hd, k + i * hd);
            for (int i = 0; i < H; i++) rope(q + i * hd, cos_, sin_, hd);
            for (int i = 0; i < Hkv; i++) rope(k + i * hd, cos_, sin_, hd);
            const void *k_new = k, *v_new = v;       /* what is stored: fp32, or the rounded 16-bit values */
            int ok = all_finite(k, kv_dim) && all_finite(v, kv_dim);
            if (ok && kv_type != KV_F32) {
                ok = kv_store(kv_type, k, kv_dim, rounded) & kv_store(kv_type, v, kv_dim, rounded + kv_dim);
                k_new = rounded;
                v_new = rounded + kv_dim;
            }
            if (!ok) {
                status = l + 1;
            } else {
                for (int i = 0; i < Hkv; i++) {
                    const int64_t at = (layer_at + (int64_t)i * capacity + pos) * hd;
                    memcpy((uint8_t *)k_cache + at * elem, (const uint8_t *)k_new + (size_t)i * hd * elem, elem * (size_t)hd);
                    memcpy((uint8_t *)v_cache + at * elem, (const uint8_t *)v_new + (size_t)i * hd * elem, elem * (size_t)hd);
                }
            }
        }   /* the barrier here makes `status` the same for every thread */
        if (status != 0) break;
        #pragma omp for schedule(static)
        for (int item = 0; item < Hkv * n_chunks; item++) {       /* (KV head, key chunk) */
            const int g = item / n_chunks, c = item % n_chunks;
            const int t0 = start + c * KEY_CHUNK, n = pos + 1 - t0 < KEY_CHUNK ? pos + 1 - t0 : KEY_CHUNK;
            const int64_t chunk_at = ((layer_at + (int64_t)g * capacity) + t0) * hd;
            const float *keys = (const float *)k_cache + chunk_at, *values = (const float *)v_cache + chunk_at;
            if (kv_type != KV_F32) {   /* this chunk only, upcast once for the whole query group */
#ifdef _OPENMP
                float *mine = chunk_kv + (size_t)omp_get_thread_num() * 2 * KEY_CHUNK * (size_t)hd;
#else
                float *mine = chunk_kv;
#endif
                kv_load(kv_type, (const uint16_t *)k_cache + chunk_at, (int64_t)n * hd, mine);
                kv_load(kv_type, (const uint16_t *)v_cache + chunk_at, (int64_t)n * hd, mine + (size_t)KEY_CHUNK * hd);
                keys = mine;
                values = mine + (size_t)KEY_CHUNK * hd;
            }
            for (int i = g * group; i < (g + 1) * group; i++)
                attend_part(qkv + i * hd, keys, values, n, hd, m->attn_scale,
                            scores + ((int64_t)i * n_chunks + c) * KEY_CHUNK, parts + ((int64_t)i * n_chunks + c) * (hd + 2));
        }
        #pragma omp for schedule(static)
        for (int i = 0; i < H; i++)
            combine_parts(parts + (int64_t)i * n_chunks * (hd + 2), n_chunks, hd, att + i * hd);
        matvec(&L->out, att, xsum, y);
        #pragma omp single
        {
            for (int i = 0; i < d; i++) x[i] += y[i];
            rms_norm(x, L->ffn_norm, m->rms_eps, d, h);
        }
        matvec(&L->gate_up, h, xsum, gu);
        #pragma omp for schedule(static)
        for (int i = 0; i < m->d_ff; i++) {
            const float g = gu[i];
            h[i] = g / (1.0f + expf(-g)) * gu[m->d_ff + i];   /* silu(gate) * up */
        }
        matvec(&L->down, h, xsum, y);
        #pragma omp single
        for (int i = 0; i < d; i++) x[i] += y[i];
    }
    if (status == 0) {
        rms_norm(x, m->final_norm, m->rms_eps, d, h);
        #pragma omp parallel num_threads(n_threads)
        matvec(&m->head, h, xsum, logits);
    }
    free(x); free(h); free(y); free(qkv); free(att); free(gu); free(xsum); free(scores); free(parts); free(chunk_kv); free(rounded);
    return status;
}
