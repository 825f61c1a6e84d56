/* Row arithmetic several kernels share (codebook.c, decode.c, intcache.c, paged.c), each the same bits on every call: a dot
 * product, sixteen-lane vectors and their sums, the softmax's exponentials. */
#ifndef KVLAB_ROWMATH_H
#define KVLAB_ROWMATH_H
#include <math.h>
#include <stdint.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include <string.h>

/* the cache lines of [p, p + bytes) asked for ahead of their reads (a hint: no fault, nothing waits on it). The caches'
 * reads ask for a head's next rows while they compute on the current ones: one head's run of rows is a few KiB, too
 * short for the hardware prefetcher to ramp up on before it ends. */
static inline void kvlab_prefetch_lines(const void *p, int64_t bytes) {
    const uintptr_t end = (uintptr_t)p + (uintptr_t)(bytes > 0 ? bytes : 0);
    for (uintptr_t a = (uintptr_t)p & ~(uintptr_t)63; a < end; a += 64) __builtin_prefetch((const void *)a, 0, 3);
}

/* sixteen floats in a vector (GCC's vector extension: AVX-512, two AVX registers or scalar code, as the build has) */
typedef float kvlab_lanes16 __attribute__((vector_size(64)));

static inline kvlab_lanes16 kvlab_lanes_at(const float *p) {
    kvlab_lanes16 v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* one vector of the pairwise sums of a's lanes (lanes 0-7) and of b's (8-15): fold(a, b)[i] = a[2i] + a[2i + 1];
 * sixteen vectors folded in four rounds give one whose lane i is vector i's sum, each by the same tree */
static inline kvlab_lanes16 kvlab_fold16(kvlab_lanes16 a, kvlab_lanes16 b) {
    return __builtin_shufflevector(a, b, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30)
         + __builtin_shufflevector(a, b, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
/* the four sums of four rows' two eight-lane chains (lo: lanes 0-7 of the sixteen, hi: 8-15), each by the
 * pairwise tree kvlab_scores4 sums by (below) */
static inline __m128 kvlab_fold4(__m256 l0, __m256 l1, __m256 l2, __m256 l3, __m256 h0, __m256 h1, __m256 h2, __m256 h3) {
    const __m256 l = _mm256_hadd_ps(_mm256_hadd_ps(l0, l1), _mm256_hadd_ps(l2, l3));
    const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(h0, h1), _mm256_hadd_ps(h2, h3));
    return _mm_add_ps(_mm_add_ps(_mm256_castps256_ps128(l), _mm256_extractf128_ps(l, 1)),
                      _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
}

/* AVX2: q . rows[i] (i < 4; d a multiple of 16) by the sums sixteen vectors folded with kvlab_fold16 make: lane l of
 * row i accumulates q[c + l] rows[i][c + l] over c = 0, 16, .. in order, and the sixteen lanes are added by the same
 * pairwise tree (two horizontal adds and a 128-bit add a half, the halves added last), so the same bits. Sixteen rows'
 * two-register vectors do not fit AVX2's sixteen registers, and GCC builds the fold's shuffles of two-register vectors
 * through memory: this is ~7x faster at d = 64. */
static inline __m128 kvlab_scores4(const float *q, const float *const *rows, int d) {
    __m256 lo[4], hi[4];
    for (int i = 0; i < 4; i++) lo[i] = hi[i] = _mm256_setzero_ps();
    for (int c = 0; c < d; c += 16) {
        const __m256 q0 = _mm256_loadu_ps(q + c), q1 = _mm256_loadu_ps(q + c + 8);
        for (int i = 0; i < 4; i++) {
            lo[i] = _mm256_fmadd_ps(q0, _mm256_loadu_ps(rows[i] + c), lo[i]);
            hi[i] = _mm256_fmadd_ps(q1, _mm256_loadu_ps(rows[i] + c + 8), hi[i]);
        }
    }
    return kvlab_fold4(lo[0], lo[1], lo[2], lo[3], hi[0], hi[1], hi[2], hi[3]);
}

/* sixteen rows' scores (kvlab_scores4's, four at a time) as one vector */
static inline kvlab_lanes16 kvlab_scores16(const float *q, const float *const *rows, int d) {
    float out[16];
    for (int j = 0; j < 16; j += 4) _mm_storeu_ps(out + j, kvlab_scores4(q, rows + j, d));
    return kvlab_lanes_at(out);
}
#endif

/* sixteen rows of kpad channels (a multiple of 16), kpad apart, transposed to kt (kt[c * 16 + j] = row j's channel c),
 * sixteen channels at a time: four rounds of swapping blocks of S = 8, 4, 2, 1 lanes
 * between rows i and i + S: row i's lanes l with bit S set take row i + S's lanes l - S, and row i + S's lanes l
 * without it take row i's lanes l + S */
#define LANE_LO(l, S) (((l) & (S)) ? 16 + (l) - (S) : (l))
#define LANE_HI(l, S) (((l) & (S)) ? 16 + (l) : (l) + (S))
#define SWAP_BLOCKS(S) \
    for (int i = 0; i < 16; i++) \
        if (!(i & (S))) { \
            const kvlab_lanes16 a = r[i], b = r[i + (S)]; \
            r[i] = __builtin_shufflevector(a, b, \
                    LANE_LO(0, S), LANE_LO(1, S), LANE_LO(2, S), LANE_LO(3, S), LANE_LO(4, S), LANE_LO(5, S), \
                    LANE_LO(6, S), LANE_LO(7, S), LANE_LO(8, S), LANE_LO(9, S), LANE_LO(10, S), LANE_LO(11, S), \
                    LANE_LO(12, S), LANE_LO(13, S), LANE_LO(14, S), LANE_LO(15, S)); \
            r[i + (S)] = __builtin_shufflevector(a, b, \
                    LANE_HI(0, S), LANE_HI(1, S), LANE_HI(2, S), LANE_HI(3, S), LANE_HI(4, S), LANE_HI(5, S), \
                    LANE_HI(6, S), LANE_HI(7, S), LANE_HI(8, S), LANE_HI(9, S), LANE_HI(10, S), LANE_HI(11, S), \
                    LANE_HI(12, S), LANE_HI(13, S), LANE_HI(14, S), LANE_HI(15, S)); \
        }
#if !defined(__AVX512F__) && defined(__AVX2__)
/* AVX2: eight rows' channels c .. c + 7 into kt[(c + l) * 16 + half .. + 7], the unpack / shuffle / lane-swap 8 x 8
 * transpose (GCC's two-register sixteen-lane vectors spill in the rounds below) */
static inline void kvlab_transpose8(const float *const *rows, int c, float *kt, int half) {
    __m256 r[8], t[8], u[8];
    for (int i = 0; i < 8; i++) r[i] = _mm256_loadu_ps(rows[i] + c);
    for (int i = 0; i < 8; i += 2) t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]), t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    for (int i = 0; i < 8; i += 4) {
        u[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);           /* channels 0 / 4 of rows i .. i + 3 */
        u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);       /* 1 / 5 */
        u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);   /* 2 / 6 */
        u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);   /* 3 / 7 */
    }
    for (int l = 0; l < 4; l++) {
        _mm256_storeu_ps(kt + (c + l) * 16 + half, _mm256_permute2f128_ps(u[l], u[4 + l], 0x20));
        _mm256_storeu_ps(kt + (c + l + 4) * 16 + half, _mm256_permute2f128_ps(u[l], u[4 + l], 0x31));
    }
}
#endif
static inline void kvlab_transpose_rows(const float *const *rows, int kpad, float *kt) {   /* rows by pointer */
#if !defined(__AVX512F__) && defined(__AVX2__)
    for (int c = 0; c < kpad; c += 8) kvlab_transpose8(rows, c, kt, 0), kvlab_transpose8(rows + 8, c, kt, 8);
#else
    for (int c = 0; c < kpad; c += 16) {
        kvlab_lanes16 r[16];
        for (int j = 0; j < 16; j++) r[j] = kvlab_lanes_at(rows[j] + c);
        SWAP_BLOCKS(8) SWAP_BLOCKS(4) SWAP_BLOCKS(2) SWAP_BLOCKS(1)
        for (int l = 0; l < 16; l++) memcpy(kt + (c + l) * 16, &r[l], sizeof r[l]);
    }
#endif
}
static inline void kvlab_transpose_tile(const float *rows, int kpad, float *kt) {
    const float *each[16];
    for (int j = 0; j < 16; j++) each[j] = rows + j * kpad;
    kvlab_transpose_rows(each, kpad, kt);
}
#undef SWAP_BLOCKS
#undef LANE_HI
#undef LANE_LO

/* the largest of s[0..n), n > 0: sixteen (AVX-512) or eight (AVX2) lanes at a time, not a serial chain of compares (a
 * nan score may or may not be taken; the exponentials make the row's output nan either way) */
static inline float kvlab_row_max(const float *s, int64_t n) {
    float top = s[0];
    int64_t j = 1;
#if defined(__AVX512F__)
    if (n >= 16) {
        __m512 lanes = _mm512_loadu_ps(s);
        for (j = 16; j + 16 <= n; j += 16) lanes = _mm512_max_ps(_mm512_loadu_ps(s + j), lanes);   /* a > b ? a : b */
        top = _mm512_reduce_max_ps(lanes);
    }
#elif defined(__AVX2__)
    if (n >= 8) {   /* eight lanes (a serial chain of compares is one max per three cycles) */
        __m256 lanes = _mm256_loadu_ps(s);
        for (j = 8; j + 8 <= n; j += 8) lanes = _mm256_max_ps(_mm256_loadu_ps(s + j), lanes);
        __m128 half = _mm_max_ps(_mm256_castps256_ps128(lanes), _mm256_extractf128_ps(lanes, 1));
        half = _mm_max_ps(half, _mm_movehl_ps(half, half));
        half = _mm_max_ss(half, _mm_movehdup_ps(half));
        top = _mm_cvtss_f32(half);
    }
#endif
    for (; j < n; j++) top = s[j] > top ? s[j] : top;
    return top;
}

/* o (dv,) += Σ_j p[j] v[j] for j < n, rows by pointer, in order of j for every column: four 16-column blocks at a
 * time held in registers across the rows (one block would make every row wait for the previous one's adds) */
static inline void kvlab_rows_mix(float *o, const float *p, const float *const *v, int n, int dv) {
    int c = 0;
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
    /* AVX2: the same sums in the same order with explicit registers (GCC's two-register vectors spill here, and it
     * builds the row pointers into vectors) */
    for (; c + 64 <= dv; c += 64) {
        __m256 a[8];
        for (int k = 0; k < 8; k++) a[k] = _mm256_loadu_ps(o + c + 8 * k);
        for (int j = 0; j < n; j++) {
            const __m256 w = _mm256_set1_ps(p[j]);
            const float *row = v[j] + c;
            for (int k = 0; k < 8; k++) a[k] = _mm256_fmadd_ps(w, _mm256_loadu_ps(row + 8 * k), a[k]);
        }
        for (int k = 0; k < 8; k++) _mm256_storeu_ps(o + c + 8 * k, a[k]);
    }
#endif
    for (; c + 64 <= dv; c += 64) {
        kvlab_lanes16 a0 = kvlab_lanes_at(o + c), a1 = kvlab_lanes_at(o + c + 16), a2 = kvlab_lanes_at(o + c + 32),
                      a3 = kvlab_lanes_at(o + c + 48);
        for (int j = 0; j < n; j++) {
            a0 += p[j] * kvlab_lanes_at(v[j] + c);
            a1 += p[j] * kvlab_lanes_at(v[j] + c + 16);
            a2 += p[j] * kvlab_lanes_at(v[j] + c + 32);
            a3 += p[j] * kvlab_lanes_at(v[j] + c + 48);
        }
        memcpy(o + c, &a0, sizeof a0);
        memcpy(o + c + 16, &a1, sizeof a1);
        memcpy(o + c + 32, &a2, sizeof a2);
        memcpy(o + c + 48, &a3, sizeof a3);
    }
    for (; c + 16 <= dv; c += 16) {
        kvlab_lanes16 a = kvlab_lanes_at(o + c);
        for (int j = 0; j < n; j++) a += p[j] * kvlab_lanes_at(v[j] + c);
        memcpy(o + c, &a, sizeof a);
    }
    for (; c < dv; c++)
        for (int j = 0; j < n; j++) o[c] += p[j] * v[j][c];
}

#if defined(__AVX512F__)
/* a . b: 16-lane FMAs into two accumulators, then a fixed reduction tree */
static inline float kvlab_row_dot(const float *a, const float *b, int64_t n) {
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
#else
/* a . b in 16 fixed partial sums, added in a fixed order: the same bits whatever the compiler vectorizes
 * and wherever the buffers lie (a reduction the compiler may reorder could depend on their alignment). */
static inline float kvlab_row_dot(const float *a, const float *b, int64_t n) {
    float acc[16] = {0};
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        for (int j = 0; j < 16; j++) acc[j] += a[i + j] * b[i + j];
    for (; i < n; i++) acc[i % 16] += a[i] * b[i];
    for (int width = 8; width > 0; width /= 2)     /* a pairwise tree, not a serial chain */
        for (int j = 0; j < width; j++) acc[j] += acc[j + width];
    return acc[0];
}
#endif

/* s[t] = e^(s[t] - top) for t < n (every s[t] <= top, finite), times times[t] where `times` is given (a softmax's
 * weights times its values' scales, one pass); returns the sum of the e^(s[t] - top). Sixteen (AVX-512) or eight (AVX2)
 * at a time: e^x = 2^k e^r, k = round(x log2 e), r = x - k ln 2 in two parts, e^r by Cephes' expf polynomial (about
 * one ulp); x below -87 gives 0 or a subnormal, as expf. The sum: lane partials added in a fixed order. */
#if defined(__AVX512F__)
static inline __m512 kvlab_exp_lanes(__m512 x) {
    x = _mm512_max_ps(_mm512_set1_ps(-87.5f), x);   /* a nan x stays nan (MAXPS returns its second operand) */
    const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(k, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, k);
}

/* the lanes [0, n - t) of the sixteen from t */
static inline __mmask16 kvlab_live_lanes(int t, int n) { return n - t >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - t)) - 1u); }

static inline float kvlab_row_exp_weighted(float *s, int n, float top, const float *times) {
    __m512 total = _mm512_setzero_ps();
    const __m512 shift = _mm512_set1_ps(top);
    for (int t = 0; t < n; t += 16) {
        const __mmask16 live = kvlab_live_lanes(t, n);
        const __m512 e = _mm512_maskz_mov_ps(live, kvlab_exp_lanes(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, s + t), shift)));
        _mm512_mask_storeu_ps(s + t, live, times ? _mm512_mul_ps(e, _mm512_maskz_loadu_ps(live, times + t)) : e);
        total = _mm512_add_ps(total, e);
    }
    return _mm512_reduce_add_ps(total);
}
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
static inline __m256 kvlab_exp_lanes(__m256 x) {
    x = _mm256_max_ps(_mm256_set1_ps(-87.0f), x);   /* a nan x stays nan */
    const __m256 k = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(k, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(k, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i scale = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);  /* 2^k */
    return _mm256_mul_ps(p, _mm256_castsi256_ps(scale));
}

static inline float kvlab_row_exp_weighted(float *s, int n, float top, const float *times) {
    __m256 total = _mm256_setzero_ps();
    const __m256 shift = _mm256_set1_ps(top);
    int t = 0;
    for (; t + 8 <= n; t += 8) {
        const __m256 e = kvlab_exp_lanes(_mm256_sub_ps(_mm256_loadu_ps(s + t), shift));
        _mm256_storeu_ps(s + t, times ? _mm256_mul_ps(e, _mm256_loadu_ps(times + t)) : e);
        total = _mm256_add_ps(total, e);
    }
    float lanes[8], sum = 0.0f;
    _mm256_storeu_ps(lanes, total);
    for (int j = 0; j < 8; j++) sum += lanes[j];
    for (; t < n; t++) {
        const float e = expf(s[t] - top);
        s[t] = times ? e * times[t] : e;
        sum += e;
    }
    return sum;
}
#else
static inline float kvlab_row_exp_weighted(float *s, int n, float top, const float *times) {
    float total = 0.0f;
    for (int t = 0; t < n; t++) {
        const float e = expf(s[t] - top);
        s[t] = times ? e * times[t] : e;
        total += e;
    }
    return total;
}
#endif

static inline float kvlab_row_exp_shifted(float *s, int n, float top) { return kvlab_row_exp_weighted(s, n, top, NULL); }

/* h[i] = silu(gate[i]) * up[i] for i < n (h apart from gate and up): e^-gate by the softmax's exponentials above
 * (about 2 ulp from expf), -gate capped at 88 so that e^-gate stays finite (silu of a gate below -88 is then -0 or a
 * tiny negative, as with expf: gate / inf); a nan gate stays nan. The fused step and the batched step both call it. */
static inline void kvlab_swiglu(const float *gate, const float *up, int64_t n, float *h) {
    for (int64_t i = 0; i < n; i++) h[i] = -gate[i] < 88.0f ? -gate[i] : 88.0f;   /* a vector min (fminf: a call each) */
    kvlab_row_exp_shifted(h, (int)n, 0.0f);
    for (int64_t i = 0; i < n; i++) h[i] = gate[i] / (1.0f + h[i]) * up[i];
}
#endif
