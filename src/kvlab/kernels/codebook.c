/* TurboQuant attention straight from b-bit codebook codes (kvlab/cache/turboquant.py, `RotatedCodes`), any width.
 *
 * A row (one stored vector) is the concatenation of its parts: part p holds channels [lo, hi) at `bits` bits,
 * its codes bit-sliced into power-of-two planes, widest first (kvlab/cache/packing.py: 5 = 4 + 1, 3 = 2 + 1); a
 * w-bit plane packs 8/w codes per byte, code c at bits (c*w) % 8 of byte c*w/8. The value of channel c is the
 * part's centroid table[code]. Fractional widths are two parts (outlier channels at one more bit), QJL sign
 * bits a 1-bit part whose table is {-1, +1}.
 *
 * Every entry point decodes a few rows at a time into a small float tile (L1-resident) and works on that:
 *   dots   out[h, i, t] = q[h, i] . value(row start + t)                    (scores; per row tile, all queries)
 *   mix    out[h, i]    = sum_t w[h, i, t] value(row start + t)             (values; fixed row segments, summed
 *                                                                             in segment order: same result for
 *                                                                             any thread count)
 *   decode out[h, t]    = value(row start + t)                              (a chunk's transient for a GEMM)
 * Sixteen (AVX-512) or eight (AVX2) channels of a plane are unpacked at once (widen the bytes, spread them to
 * the lanes, shift, mask), then looked up in the table: a register permute when the table fits one or two
 * registers, a gather otherwise. The plain-C build does the same one channel at a time. Norms, offsets and the
 * rotation stay in torch.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#define CB_MAX_PARTS 4
#define CB_MAX_DIM 1024
#define CB_TILE 16          /* rows decoded at once */
#define CB_SEGMENT 256      /* rows per partial sum of the mix */

typedef struct {
    int lo, hi, bits, n_planes;
    int width[4], shift[4];
    int64_t offset[4];      /* byte offset of each plane in a row */
    const float *table;     /* centroids, padded to max(16, 2^bits) entries */
} cb_part;

typedef struct {
    int n_parts, d, dpad;
    cb_part part[CB_MAX_PARTS];
} cb_layout;

/* Which variant this build is: 512 (AVX-512), 256 (AVX2) or 0 (plain C). */
int kvlab_codebook_variant(void) {
#if defined(__AVX512F__)
    return 512;
#elif defined(__AVX2__)
    return 256;
#else
    return 0;
#endif
}

static int table_size(int bits) { return bits < 4 ? 16 : 1 << bits; }

/* spec: n_parts x (lo, hi, bits), parts in channel order covering [0, d); tables: each part's padded table in
 * turn. Returns 0 when the layout is valid and its rows are exactly row_bytes long, else -1. */
static int make_layout(cb_layout *L, int d, int n_parts, const int32_t *spec, const float *tables, int64_t row_bytes) {
    if (d <= 0 || d > CB_MAX_DIM || n_parts <= 0 || n_parts > CB_MAX_PARTS) return -1;
    L->n_parts = n_parts;
    L->d = d;
    L->dpad = (d + 15) / 16 * 16;
    int64_t offset = 0;
    int expect_lo = 0;
    for (int p = 0; p < n_parts; p++) {
        cb_part *P = &L->part[p];
        P->lo = spec[3 * p];
        P->hi = spec[3 * p + 1];
        P->bits = spec[3 * p + 2];
        if (P->lo != expect_lo || P->hi <= P->lo || P->bits < 1 || P->bits > 8) return -1;
        expect_lo = P->hi;
        P->table = tables;
        tables += table_size(P->bits);
        P->n_planes = 0;
        int shift = P->bits;
        for (int w = 8; w >= 1; w /= 2)
            if (P->bits & w) {
                shift -= w;
                P->width[P->n_planes] = w;
                P->shift[P->n_planes] = shift;
                P->offset[P->n_planes] = offset;
                offset += ((int64_t)(P->hi - P->lo) * w + 7) / 8;
                P->n_planes++;
            }
    }
    return expect_lo == d && offset == row_bytes ? 0 : -1;
}

static inline int scalar_code(const cb_part *P, const uint8_t *row, int c) {
    int code = 0;
    for (int k = 0; k < P->n_planes; k++) {
        const int w = P->width[k];
        const int byte = row[P->offset[k] + (c * w) / 8];
        code |= ((byte >> ((c * w) % 8)) & ((1 << w) - 1)) << P->shift[k];
    }
    return code;
}

#if defined(__AVX512F__)
#define CB_LANES 16
/* codes of channels c .. c+15 (c a multiple of 16) of the w-bit plane at `plane` */
static inline __m512i plane_codes(const uint8_t *plane, int c, int w) {
    const uint8_t *p = plane + c * w / 8;
    __m128i bytes;
    if (w == 8) return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    if (w == 4) {
        bytes = _mm_loadl_epi64((const __m128i *)p);
    } else if (w == 2) {
        int32_t v;
        memcpy(&v, p, 4);
        bytes = _mm_cvtsi32_si128(v);
    } else {
        uint16_t v;
        memcpy(&v, p, 2);
        bytes = _mm_cvtsi32_si128(v);
    }
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i bits = _mm512_mullo_epi32(lane, _mm512_set1_epi32(w));        /* lane i: bit i*w of the block */
    const __m512i spread = _mm512_permutexvar_epi32(_mm512_srli_epi32(bits, 3), _mm512_cvtepu8_epi32(bytes));
    const __m512i shifted = _mm512_srlv_epi32(spread, _mm512_and_si512(bits, _mm512_set1_epi32(7)));
    return _mm512_and_si512(shifted, _mm512_set1_epi32((1 << w) - 1));
}

static inline __m512 lookup(const cb_part *P, __m512i code) {
    if (P->bits <= 4) return _mm512_permutexvar_ps(code, _mm512_loadu_ps(P->table));
    if (P->bits == 5) return _mm512_permutex2var_ps(_mm512_loadu_ps(P->table), code, _mm512_loadu_ps(P->table + 16));
    return _mm512_i32gather_ps(code, P->table, 4);
}

static inline void decode_block(const cb_part *P, const uint8_t *row, int c, float *out) {
    __m512i code = _mm512_slli_epi32(plane_codes(row + P->offset[0], c, P->width[0]), P->shift[0]);
    for (int k = 1; k < P->n_planes; k++)
        code = _mm512_or_si512(code, _mm512_slli_epi32(plane_codes(row + P->offset[k], c, P->width[k]), P->shift[k]));
    _mm512_storeu_ps(out, lookup(P, code));
}

static inline float dot(const float *a, const float *b, int dpad) {   /* dpad: a multiple of 16 */
    __m512 acc = _mm512_setzero_ps();
    for (int c = 0; c < dpad; c += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + c), _mm512_loadu_ps(b + c), acc);
    return _mm512_reduce_add_ps(acc);
}

static inline void axpy(float w, const float *x, float *y, int dpad) {
    const __m512 wv = _mm512_set1_ps(w);
    for (int c = 0; c < dpad; c += 16) _mm512_storeu_ps(y + c, _mm512_fmadd_ps(wv, _mm512_loadu_ps(x + c), _mm512_loadu_ps(y + c)));
}

#elif defined(__AVX2__)
#define CB_LANES 8
/* codes of channels c .. c+7 (c a multiple of 8) of the w-bit plane at `plane` */
static inline __m256i plane_codes(const uint8_t *plane, int c, int w) {
    const uint8_t *p = plane + c * w / 8;
    __m128i bytes;
    if (w == 8) return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    if (w == 4) {
        int32_t v;
        memcpy(&v, p, 4);
        bytes = _mm_cvtsi32_si128(v);
    } else if (w == 2) {
        uint16_t v;
        memcpy(&v, p, 2);
        bytes = _mm_cvtsi32_si128(v);
    } else {
        bytes = _mm_cvtsi32_si128(p[0]);
    }
    const __m256i bits = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(w));
    const __m256i spread = _mm256_permutevar8x32_epi32(_mm256_cvtepu8_epi32(bytes), _mm256_srli_epi32(bits, 3));
    const __m256i shifted = _mm256_srlv_epi32(spread, _mm256_and_si256(bits, _mm256_set1_epi32(7)));
    return _mm256_and_si256(shifted, _mm256_set1_epi32((1 << w) - 1));
}

static inline __m256 lookup(const cb_part *P, __m256i code) {
    if (P->bits <= 3) return _mm256_permutevar8x32_ps(_mm256_loadu_ps(P->table), code);
    return _mm256_i32gather_ps(P->table, code, 4);
}

static inline void decode_block(const cb_part *P, const uint8_t *row, int c, float *out) {
    __m256i code = _mm256_slli_epi32(plane_codes(row + P->offset[0], c, P->width[0]), P->shift[0]);
    for (int k = 1; k < P->n_planes; k++)
        code = _mm256_or_si256(code, _mm256_slli_epi32(plane_codes(row + P->offset[k], c, P->width[k]), P->shift[k]));
    _mm256_storeu_ps(out, lookup(P, code));
}

static inline float dot(const float *a, const float *b, int dpad) {
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    for (int c = 0; c < dpad; c += 16) {
        acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + c), _mm256_loadu_ps(b + c), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + c + 8), _mm256_loadu_ps(b + c + 8), acc1);
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, _mm256_add_ps(acc0, acc1));
    return ((lanes[0] + lanes[4]) + (lanes[1] + lanes[5])) + ((lanes[2] + lanes[6]) + (lanes[3] + lanes[7]));
}

static inline void axpy(float w, const float *x, float *y, int dpad) {
    const __m256 wv = _mm256_set1_ps(w);
    for (int c = 0; c < dpad; c += 8) _mm256_storeu_ps(y + c, _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + c), _mm256_loadu_ps(y + c)));
}

#else
#define CB_LANES 0
static inline float dot(const float *a, const float *b, int dpad) {
    float acc = 0.0f;
    for (int c = 0; c < dpad; c++) acc += a[c] * b[c];
    return acc;
}

static inline void axpy(float w, const float *x, float *y, int dpad) {
    for (int c = 0; c < dpad; c++) y[c] += w * x[c];
}
#endif

/* out[0 .. dpad) = the row's values, zero past d */
static void decode_row(const cb_layout *L, const uint8_t *row, float *out) {
    for (int p = 0; p < L->n_parts; p++) {
        const cb_part *P = &L->part[p];
        const int n = P->hi - P->lo;
        int c = 0;
#if CB_LANES
        for (; c + CB_LANES <= n; c += CB_LANES) decode_block(P, row, c, out + P->lo + c);
#endif
        for (; c < n; c++) out[P->lo + c] = P->table[scalar_code(P, row, c)];
    }
    for (int c = L->d; c < L->dpad; c++) out[c] = 0.0f;
}

static int check(int heads, int64_t slots, int64_t start, int64_t n, int nq) {
    return heads < 0 || nq < 0 || start < 0 || n < 0 || start + n > slots ? -1 : 0;
}

/* out (heads, nq, n) = q (heads, nq, d) . value(row start + t), codes (heads, slots, row_bytes). 0, or -1. */
int kvlab_codebook_dots(const uint8_t *codes, int heads, int64_t slots, int64_t row_bytes, int64_t start, int64_t n,
                        int d, int n_parts, const int32_t *spec, const float *tables, const float *q, int nq,
                        float *out, int n_threads) {
    cb_layout L;
    if (make_layout(&L, d, n_parts, spec, tables, row_bytes) || check(heads, slots, start, n, nq)) return -1;
    const int64_t tiles = (n + CB_TILE - 1) / CB_TILE;
    const int dpad = L.dpad;
    int failed = 0;
    #pragma omp parallel num_threads(n_threads)
    {
        float *buf = malloc(sizeof(float) * (size_t)dpad * (CB_TILE + (size_t)nq));
        if (!buf) {
            #pragma omp atomic write
            failed = 1;
        }
        #pragma omp for schedule(static) collapse(2)
        for (int h = 0; h < heads; h++)
            for (int64_t tile = 0; tile < tiles; tile++) {
                if (!buf) continue;
                float *rows = buf, *qpad = buf + (size_t)dpad * CB_TILE;
                const int64_t t0 = tile * CB_TILE, count = n - t0 < CB_TILE ? n - t0 : CB_TILE;
                for (int64_t r = 0; r < count; r++)
                    decode_row(&L, codes + ((int64_t)h * slots + start + t0 + r) * row_bytes, rows + r * dpad);
                for (int i = 0; i < nq; i++) {
                    float *qi = qpad + (size_t)i * dpad;   /* the query, zero-padded (cheap next to the tile) */
                    memcpy(qi, q + ((int64_t)h * nq + i) * d, sizeof(float) * d);
                    for (int c = d; c < dpad; c++) qi[c] = 0.0f;
                    float *o = out + ((int64_t)h * nq + i) * n + t0;
                    for (int64_t r = 0; r < count; r++) o[r] = dot(qi, rows + r * dpad, dpad);
                }
            }
        free(buf);
    }
    return failed ? -2 : 0;
}

/* out (heads, nq, d) = sum_t w[h, i, t] value(row start + t); w rows `w_stride` floats apart. 0, -1, or -2 (memory). */
int kvlab_codebook_mix(const uint8_t *codes, int heads, int64_t slots, int64_t row_bytes, int64_t start, int64_t n,
                       int d, int n_parts, const int32_t *spec, const float *tables, const float *w, int64_t w_stride,
                       int nq, float *out, int n_threads) {
    cb_layout L;
    if (make_layout(&L, d, n_parts, spec, tables, row_bytes) || check(heads, slots, start, n, nq) || w_stride < n) return -1;
    const int dpad = L.dpad;
    const int64_t segments = n ? (n + CB_SEGMENT - 1) / CB_SEGMENT : 1;
    float *partial = calloc((size_t)heads * segments * nq * dpad + 1, sizeof(float));   /* (heads, segments, nq, dpad) */
    if (!partial) return -2;
    int failed = 0;
    #pragma omp parallel num_threads(n_threads)
    {
        float *rows = malloc(sizeof(float) * (size_t)dpad * CB_TILE);
        if (!rows) {
            #pragma omp atomic write
            failed = 1;
        }
        #pragma omp for schedule(static) collapse(2)
        for (int h = 0; h < heads; h++)
            for (int64_t s = 0; s < segments; s++) {
                if (!rows) continue;
                float *acc = partial + ((size_t)h * segments + s) * nq * dpad;
                const int64_t end = (s + 1) * CB_SEGMENT < n ? (s + 1) * CB_SEGMENT : n;
                for (int64_t t0 = s * CB_SEGMENT; t0 < end; t0 += CB_TILE) {
                    const int64_t count = end - t0 < CB_TILE ? end - t0 : CB_TILE;
                    for (int64_t r = 0; r < count; r++)
                        decode_row(&L, codes + ((int64_t)h * slots + start + t0 + r) * row_bytes, rows + r * dpad);
                    for (int i = 0; i < nq; i++) {
                        const float *wi = w + ((int64_t)h * nq + i) * w_stride + t0;
                        for (int64_t r = 0; r < count; r++) axpy(wi[r], rows + r * dpad, acc + (size_t)i * dpad, dpad);
                    }
                }
            }
        free(rows);
        #pragma omp for schedule(static) collapse(2)
        for (int h = 0; h < heads; h++)
            for (int i = 0; i < nq; i++) {
                float *o = out + ((int64_t)h * nq + i) * d;
                const float *first = partial + ((size_t)h * segments * nq + i) * dpad;
                for (int c = 0; c < d; c++) o[c] = first[c];
                for (int64_t s = 1; s < segments; s++) {
                    const float *part = partial + (((size_t)h * segments + s) * nq + i) * dpad;
                    for (int c = 0; c < d; c++) o[c] += part[c];
                }
            }
    }
    free(partial);
    return failed ? -2 : 0;
}

/* out (heads, n, d) = value(row start + t): a chunk's decoded transient. 0, or -1. */
int kvlab_codebook_decode(const uint8_t *codes, int heads, int64_t slots, int64_t row_bytes, int64_t start, int64_t n,
                          int d, int n_parts, const int32_t *spec, const float *tables, float *out, int n_threads) {
    cb_layout L;
    if (make_layout(&L, d, n_parts, spec, tables, row_bytes) || check(heads, slots, start, n, 0)) return -1;
    #pragma omp parallel for schedule(static) collapse(2) num_threads(n_threads)
    for (int h = 0; h < heads; h++)
        for (int64_t t = 0; t < n; t++) {
            float row[CB_MAX_DIM];
            decode_row(&L, codes + ((int64_t)h * slots + start + t) * row_bytes, row);
            memcpy(out + ((int64_t)h * n + t) * d, row, sizeof(float) * d);
        }
    return 0;
}
