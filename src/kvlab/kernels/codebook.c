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

#include "codebook.h"

#define CB_TILE 16          /* rows decoded at once */
#define CB_SEGMENT 256      /* rows per partial sum of the mix */
#define CB_SERIAL_WORK (1 << 17)   /* below this many multiply-adds one thread does it (a region costs more) */

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

int kvlab_cb_layout(cb_layout *L, int d, int n_parts, const int32_t *spec, const float *tables, int64_t row_bytes) {
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

#if defined(__AVX512F__)
#define CB_LANES 16
/* codes of a w-bit plane, n channels, into codes[] (shifted left by `shift`; OR-ed into what is there unless
 * `first`), sixteen at a time: widen the 2w bytes of a block to lanes, spread byte i*w/8 to lane i, shift it
 * right by (i*w)%8, mask. w is a constant where this is inlined, so the spread is a constant too. */
static inline int plane_blocks(const uint8_t *plane, int n, const int w, int shift, int first, int32_t *codes) {
    int32_t spread_lanes[16], bit_lanes[16];
    for (int i = 0; i < 16; i++) {
        spread_lanes[i] = i * w / 8;
        bit_lanes[i] = i * w % 8;
    }
    const __m512i spread = _mm512_loadu_si512(spread_lanes), bit = _mm512_loadu_si512(bit_lanes);
    const __m512i mask = _mm512_set1_epi32((1 << w) - 1);
    int c = 0;
    for (; c + 16 <= n; c += 16) {
        const uint8_t *p = plane + c * w / 8;
        __m512i v;
        if (w == 8) {
            v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
        } else {
            __m128i bytes;
            if (w == 4) {
                bytes = _mm_loadl_epi64((const __m128i *)p);
            } else if (w == 2) {
                int32_t x;
                memcpy(&x, p, 4);
                bytes = _mm_cvtsi32_si128(x);
            } else {
                uint16_t x;
                memcpy(&x, p, 2);
                bytes = _mm_cvtsi32_si128(x);
            }
            v = _mm512_and_si512(_mm512_srlv_epi32(_mm512_permutexvar_epi32(spread, _mm512_cvtepu8_epi32(bytes)), bit), mask);
        }
        if (shift) v = _mm512_slli_epi32(v, shift);
        if (!first) v = _mm512_or_si512(v, _mm512_loadu_si512(codes + c));
        _mm512_storeu_si512(codes + c, v);
    }
    return c;
}

/* out[c] = table[codes[c]] for c < n, sixteen at a time; returns how many were done */
static inline int lookup_blocks(const float *table, int bits, const int32_t *codes, int n, float *out) {
    int c = 0;
    if (bits <= 4) {
        const __m512 t = _mm512_loadu_ps(table);
        for (; c + 16 <= n; c += 16) _mm512_storeu_ps(out + c, _mm512_permutexvar_ps(_mm512_loadu_si512(codes + c), t));
    } else if (bits == 5) {
        const __m512 t0 = _mm512_loadu_ps(table), t1 = _mm512_loadu_ps(table + 16);
        for (; c + 16 <= n; c += 16) _mm512_storeu_ps(out + c, _mm512_permutex2var_ps(t0, _mm512_loadu_si512(codes + c), t1));
    } else {
        for (; c + 16 <= n; c += 16) _mm512_storeu_ps(out + c, _mm512_i32gather_ps(_mm512_loadu_si512(codes + c), table, 4));
    }
    return c;
}

/* out[r] = a . rows[r] for 8 rows dpad floats apart (dpad a multiple of 16): the eight sums reduced together */
static inline void dot8(const float *a, const float *rows, int dpad, float *out) {
    __m512 acc[8];   /* eight independent chains: rows inside, channels outside */
    for (int r = 0; r < 8; r++) acc[r] = _mm512_setzero_ps();
    for (int c = 0; c < dpad; c += 16) {
        const __m512 av = _mm512_loadu_ps(a + c);
        for (int r = 0; r < 8; r++) acc[r] = _mm512_fmadd_ps(av, _mm512_loadu_ps(rows + r * dpad + c), acc[r]);
    }
    __m256 half[8];
    for (int r = 0; r < 8; r++)
        half[r] = _mm256_add_ps(_mm512_castps512_ps256(acc[r]), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[r]), 1)));
    const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(half[0], half[1]), _mm256_hadd_ps(half[2], half[3]));
    const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(half[4], half[5]), _mm256_hadd_ps(half[6], half[7]));
    _mm256_storeu_ps(out, _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31)));
}

/* y[0 .. dpad) += sum_r w[r] rows[r] over `count` rows dpad floats apart */
static inline void axpy_rows(const float *w, const float *rows, int64_t count, float *y, int dpad) {
    int c = 0;
    for (; c + 64 <= dpad; c += 64) {   /* four independent chains */
        __m512 acc[4];
        for (int k = 0; k < 4; k++) acc[k] = _mm512_loadu_ps(y + c + 16 * k);
        for (int64_t r = 0; r < count; r++) {
            const __m512 wr = _mm512_set1_ps(w[r]);
            for (int k = 0; k < 4; k++) acc[k] = _mm512_fmadd_ps(wr, _mm512_loadu_ps(rows + r * dpad + c + 16 * k), acc[k]);
        }
        for (int k = 0; k < 4; k++) _mm512_storeu_ps(y + c + 16 * k, acc[k]);
    }
    for (; c < dpad; c += 16) {
        __m512 acc = _mm512_loadu_ps(y + c);
        for (int64_t r = 0; r < count; r++) acc = _mm512_fmadd_ps(_mm512_set1_ps(w[r]), _mm512_loadu_ps(rows + r * dpad + c), acc);
        _mm512_storeu_ps(y + c, acc);
    }
}

#elif defined(__AVX2__)
#define CB_LANES 8
/* as the AVX-512 version, eight channels at a time */
static inline int plane_blocks(const uint8_t *plane, int n, const int w, int shift, int first, int32_t *codes) {
    int32_t spread_lanes[8], bit_lanes[8];
    for (int i = 0; i < 8; i++) {
        spread_lanes[i] = i * w / 8;
        bit_lanes[i] = i * w % 8;
    }
    const __m256i spread = _mm256_loadu_si256((const __m256i *)spread_lanes), bit = _mm256_loadu_si256((const __m256i *)bit_lanes);
    const __m256i mask = _mm256_set1_epi32((1 << w) - 1);
    int c = 0;
    for (; c + 8 <= n; c += 8) {
        const uint8_t *p = plane + c * w / 8;
        __m256i v;
        if (w == 8) {
            v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
        } else {
            __m128i bytes;
            if (w == 4) {
                int32_t x;
                memcpy(&x, p, 4);
                bytes = _mm_cvtsi32_si128(x);
            } else if (w == 2) {
                uint16_t x;
                memcpy(&x, p, 2);
                bytes = _mm_cvtsi32_si128(x);
            } else {
                bytes = _mm_cvtsi32_si128(p[0]);
            }
            v = _mm256_and_si256(_mm256_srlv_epi32(_mm256_permutevar8x32_epi32(_mm256_cvtepu8_epi32(bytes), spread), bit), mask);
        }
        if (shift) v = _mm256_slli_epi32(v, shift);
        if (!first) v = _mm256_or_si256(v, _mm256_loadu_si256((const __m256i *)(codes + c)));
        _mm256_storeu_si256((__m256i *)(codes + c), v);
    }
    return c;
}

static inline int lookup_blocks(const float *table, int bits, const int32_t *codes, int n, float *out) {
    int c = 0;
    if (bits <= 3) {
        const __m256 t = _mm256_loadu_ps(table);
        for (; c + 8 <= n; c += 8) _mm256_storeu_ps(out + c, _mm256_permutevar8x32_ps(t, _mm256_loadu_si256((const __m256i *)(codes + c))));
    } else {
        for (; c + 8 <= n; c += 8) _mm256_storeu_ps(out + c, _mm256_i32gather_ps(table, _mm256_loadu_si256((const __m256i *)(codes + c)), 4));
    }
    return c;
}

static inline void dot8(const float *a, const float *rows, int dpad, float *out) {
    __m256 acc[8];
    for (int r = 0; r < 8; r++) acc[r] = _mm256_setzero_ps();
    for (int c = 0; c < dpad; c += 8) {
        const __m256 av = _mm256_loadu_ps(a + c);
        for (int r = 0; r < 8; r++) acc[r] = _mm256_fmadd_ps(av, _mm256_loadu_ps(rows + r * dpad + c), acc[r]);
    }
    const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(acc[0], acc[1]), _mm256_hadd_ps(acc[2], acc[3]));
    const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(acc[4], acc[5]), _mm256_hadd_ps(acc[6], acc[7]));
    _mm256_storeu_ps(out, _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31)));
}

static inline void axpy_rows(const float *w, const float *rows, int64_t count, float *y, int dpad) {
    int c = 0;
    for (; c + 32 <= dpad; c += 32) {   /* four independent chains */
        __m256 acc[4];
        for (int k = 0; k < 4; k++) acc[k] = _mm256_loadu_ps(y + c + 8 * k);
        for (int64_t r = 0; r < count; r++) {
            const __m256 wr = _mm256_set1_ps(w[r]);
            for (int k = 0; k < 4; k++) acc[k] = _mm256_fmadd_ps(wr, _mm256_loadu_ps(rows + r * dpad + c + 8 * k), acc[k]);
        }
        for (int k = 0; k < 4; k++) _mm256_storeu_ps(y + c + 8 * k, acc[k]);
    }
    for (; c < dpad; c += 8) {
        __m256 acc = _mm256_loadu_ps(y + c);
        for (int64_t r = 0; r < count; r++) acc = _mm256_fmadd_ps(_mm256_set1_ps(w[r]), _mm256_loadu_ps(rows + r * dpad + c), acc);
        _mm256_storeu_ps(y + c, acc);
    }
}

#else
#define CB_LANES 0
static inline int plane_blocks(const uint8_t *plane, int n, const int w, int shift, int first, int32_t *codes) {
    (void)plane, (void)n, (void)w, (void)shift, (void)first, (void)codes;
    return 0;
}

static inline int lookup_blocks(const float *table, int bits, const int32_t *codes, int n, float *out) {
    (void)table, (void)bits, (void)codes, (void)n, (void)out;
    return 0;
}

static inline void dot8(const float *a, const float *rows, int dpad, float *out) {
    for (int r = 0; r < 8; r++) {
        float acc = 0.0f;
        for (int c = 0; c < dpad; c++) acc += a[c] * rows[r * dpad + c];
        out[r] = acc;
    }
}

static inline void axpy_rows(const float *w, const float *rows, int64_t count, float *y, int dpad) {
    for (int64_t r = 0; r < count; r++)
        for (int c = 0; c < dpad; c++) y[c] += w[r] * rows[r * dpad + c];
}
#endif

/* codes[0 .. n) of one plane (see plane_blocks), the SIMD blocks then the rest one channel at a time */
static void plane_codes(const uint8_t *plane, int n, int w, int shift, int first, int32_t *codes) {
    int c;
    switch (w) {   /* a constant width in each call: its spread and masks are constants */
        case 8: c = plane_blocks(plane, n, 8, shift, first, codes); break;
        case 4: c = plane_blocks(plane, n, 4, shift, first, codes); break;
        case 2: c = plane_blocks(plane, n, 2, shift, first, codes); break;
        default: c = plane_blocks(plane, n, 1, shift, first, codes); break;
    }
    for (; c < n; c++) {
        const int v = ((plane[c * w / 8] >> (c * w % 8)) & ((1 << w) - 1)) << shift;
        codes[c] = first ? v : codes[c] | v;
    }
}

#if defined(__AVX512F__)
/* the 16 codes of channels [c, c + 16) of a w-bit plane (c a multiple of 16), in registers: each lane's byte
 * (pshufb), shifted right to its bits, masked */
static inline __m512i plane16(const uint8_t *plane, int c, const int w) {
    const uint8_t *p = plane + c * w / 8;
    if (w == 8) return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    __m128i bytes, spread;
    __m512i bit;
    if (w == 4) {
        bytes = _mm_loadl_epi64((const __m128i *)p);
        spread = _mm_setr_epi8(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
        bit = _mm512_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4);
    } else if (w == 2) {
        int32_t x;
        memcpy(&x, p, 4);
        bytes = _mm_cvtsi32_si128(x);
        spread = _mm_setr_epi8(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
        bit = _mm512_setr_epi32(0, 2, 4, 6, 0, 2, 4, 6, 0, 2, 4, 6, 0, 2, 4, 6);
    } else {
        uint16_t x;
        memcpy(&x, p, 2);
        bytes = _mm_cvtsi32_si128(x);
        spread = _mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
        bit = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7);
    }
    const __m512i v = _mm512_cvtepu8_epi32(_mm_shuffle_epi8(bytes, spread));
    return _mm512_and_si512(_mm512_srlv_epi32(v, bit), _mm512_set1_epi32((1 << w) - 1));
}

/* high | the 1-bit plane's bits of channels [c, c + 16) as the low bit: the two bytes are a lane mask */
static inline __m512i low_plane16(__m512i high, const uint8_t *plane, int c) {
    uint16_t bits;
    memcpy(&bits, plane + c / 8, 2);
    return _mm512_mask_or_epi32(high, (__mmask16)bits, high, _mm512_set1_epi32(1));
}

/* out[c] = the part's values for whole blocks of 16 channels, planes combined and looked up in registers, for the
 * widths of one or two planes with a one- or two-register table (1 to 5 bits); returns the channels done (0: none) */
static inline int fast_part(const cb_part *P, const uint8_t *row, float *out) {
    const int n = P->hi - P->lo;
    const uint8_t *p0 = row + P->offset[0], *p1 = P->n_planes > 1 ? row + P->offset[1] : NULL;
    const __m512 t0 = _mm512_loadu_ps(P->table), t1 = P->bits == 5 ? _mm512_loadu_ps(P->table + 16) : t0;
    int c = 0;
    switch (P->bits) {   /* constant plane widths in each loop */
        case 1: for (; c + 16 <= n; c += 16) _mm512_storeu_ps(out + c, _mm512_permutexvar_ps(low_plane16(_mm512_setzero_si512(), p0, c), t0)); break;
        case 2: for (; c + 16 <= n; c += 16) _mm512_storeu_ps(out + c, _mm512_permutexvar_ps(plane16(p0, c, 2), t0)); break;
        case 4: for (; c + 16 <= n; c += 16) _mm512_storeu_ps(out + c, _mm512_permutexvar_ps(plane16(p0, c, 4), t0)); break;
        case 3:
            for (; c + 16 <= n; c += 16) {
                const __m512i code = low_plane16(_mm512_slli_epi32(plane16(p0, c, 2), 1), p1, c);
                _mm512_storeu_ps(out + c, _mm512_permutexvar_ps(code, t0));
            }
            break;
        case 5:
            for (; c + 16 <= n; c += 16) {
                const __m512i code = low_plane16(_mm512_slli_epi32(plane16(p0, c, 4), 1), p1, c);
                _mm512_storeu_ps(out + c, _mm512_permutex2var_ps(t0, code, t1));
            }
            break;
        default: break;
    }
    return c;
}
#else
static inline int fast_part(const cb_part *P, const uint8_t *row, float *out) {
    (void)P, (void)row, (void)out;
    return 0;
}
#endif

/* out[0 .. dpad) = the row's values, zero past d; codes: dpad ints of scratch */
static void decode_row(const cb_layout *L, const uint8_t *row, float *out, int32_t *codes) {
    for (int p = 0; p < L->n_parts; p++) {
        const cb_part *P = &L->part[p];
        const int n = P->hi - P->lo;
        int c = fast_part(P, row, out + P->lo);
        if (c == 0) {
            for (int k = 0; k < P->n_planes; k++) plane_codes(row + P->offset[k], n, P->width[k], P->shift[k], k == 0, codes + P->lo);
            for (c = lookup_blocks(P->table, P->bits, codes + P->lo, n, out + P->lo); c < n; c++) out[P->lo + c] = P->table[codes[P->lo + c]];
        }
        for (; c < n; c++) {   /* the channels after the last whole block */
            int code = 0;
            for (int k = 0; k < P->n_planes; k++) {
                const int w = P->width[k];
                code |= ((row[P->offset[k] + c * w / 8] >> (c * w % 8)) & ((1 << w) - 1)) << P->shift[k];
            }
            out[P->lo + c] = P->table[code];
        }
    }
    for (int c = L->d; c < L->dpad; c++) out[c] = 0.0f;
}

#if defined(__AVX512F__)
/* rows of one part whose width (1 to 5 bits, a constant where this is inlined) and channel count (a multiple of 16)
 * fast_part reads: the planes and table are set up once for all the rows */
static inline void part_rows(const cb_part *P, const uint8_t *rows, int64_t row_bytes, int64_t count, float *out,
                             int64_t stride, const int bits) {
    const int n = P->hi - P->lo;
    const __m512 t0 = _mm512_loadu_ps(P->table), t1 = bits == 5 ? _mm512_loadu_ps(P->table + 16) : t0;
    const int64_t o0 = P->offset[0], o1 = P->n_planes > 1 ? P->offset[1] : 0;
    for (int64_t r = 0; r < count; r++) {
        const uint8_t *row = rows + r * row_bytes;
        float *o = out + r * stride + P->lo;
        for (int c = 0; c < n; c += 16) {
            __m512i code;
            if (bits == 3) code = low_plane16(_mm512_slli_epi32(plane16(row + o0, c, 2), 1), row + o1, c);
            else if (bits == 5) code = low_plane16(_mm512_slli_epi32(plane16(row + o0, c, 4), 1), row + o1, c);
            else if (bits == 1) code = low_plane16(_mm512_setzero_si512(), row + o0, c);
            else code = plane16(row + o0, c, bits);
            _mm512_storeu_ps(o + c, bits == 5 ? _mm512_permutex2var_ps(t0, code, t1) : _mm512_permutexvar_ps(code, t0));
        }
    }
}
#endif

void kvlab_cb_decode_rows(const cb_layout *L, const uint8_t *rows, int64_t row_bytes, int64_t count, float *out, int64_t stride) {
#if defined(__AVX512F__)
    int fast = L->d == L->dpad;   /* every part 1..5 bits over whole blocks of 16 channels: part by part, tight loops */
    for (int p = 0; p < L->n_parts; p++) fast &= L->part[p].bits <= 5 && (L->part[p].hi - L->part[p].lo) % 16 == 0;
    if (fast) {
        for (int p = 0; p < L->n_parts; p++) {
            const cb_part *P = &L->part[p];
            switch (P->bits) {
                case 1: part_rows(P, rows, row_bytes, count, out, stride, 1); break;
                case 2: part_rows(P, rows, row_bytes, count, out, stride, 2); break;
                case 3: part_rows(P, rows, row_bytes, count, out, stride, 3); break;
                case 4: part_rows(P, rows, row_bytes, count, out, stride, 4); break;
                default: part_rows(P, rows, row_bytes, count, out, stride, 5); break;
            }
        }
        return;
    }
#endif
    int32_t scratch[CB_MAX_DIM];
    for (int64_t r = 0; r < count; r++) decode_row(L, rows + r * row_bytes, out + r * stride, scratch);
}

#if defined(__AVX512F__)
/* acc[h][lo + c0 .. + 64) += sum_r w[h][r] value(r) for `gh` heads, one part, 64 channels from c0: the codes are
 * unpacked and looked up in registers, each row's four blocks read by every head (bits and gh constants here) */
static inline void mix_block(const cb_part *P, const uint8_t *rows, int64_t row_bytes, int64_t count, const float *w,
                             int64_t w_stride, float *acc, int64_t acc_stride, int c0, const int bits, const int gh) {
    const __m512 t0 = _mm512_loadu_ps(P->table), t1 = bits == 5 ? _mm512_loadu_ps(P->table + 16) : t0;
    const int64_t o0 = P->offset[0], o1 = P->n_planes > 1 ? P->offset[1] : 0;
    __m512 a[4][4];
    for (int h = 0; h < gh; h++)
        for (int b = 0; b < 4; b++) a[h][b] = _mm512_loadu_ps(acc + h * acc_stride + P->lo + c0 + 16 * b);
    for (int64_t r = 0; r < count; r++) {
        const uint8_t *row = rows + r * row_bytes;
        __m512 value[4];
        for (int b = 0; b < 4; b++) {
            const int c = c0 + 16 * b;
            __m512i code;
            if (bits == 3) code = low_plane16(_mm512_slli_epi32(plane16(row + o0, c, 2), 1), row + o1, c);
            else if (bits == 5) code = low_plane16(_mm512_slli_epi32(plane16(row + o0, c, 4), 1), row + o1, c);
            else if (bits == 1) code = low_plane16(_mm512_setzero_si512(), row + o0, c);
            else code = plane16(row + o0, c, bits);
            value[b] = bits == 5 ? _mm512_permutex2var_ps(t0, code, t1) : _mm512_permutexvar_ps(code, t0);
        }
        for (int h = 0; h < gh; h++) {
            const __m512 wr = _mm512_set1_ps(w[h * w_stride + r]);
            for (int b = 0; b < 4; b++) a[h][b] = _mm512_fmadd_ps(wr, value[b], a[h][b]);
        }
    }
    for (int h = 0; h < gh; h++)
        for (int b = 0; b < 4; b++) _mm512_storeu_ps(acc + h * acc_stride + P->lo + c0 + 16 * b, a[h][b]);
}

static void mix_heads(const cb_part *P, const uint8_t *rows, int64_t row_bytes, int64_t count, const float *w,
                      int64_t w_stride, float *acc, int64_t acc_stride, int c0, int bits, int gh) {
#define MIX_CASE(B) switch (gh) { \
        case 1: mix_block(P, rows, row_bytes, count, w, w_stride, acc, acc_stride, c0, B, 1); break; \
        case 2: mix_block(P, rows, row_bytes, count, w, w_stride, acc, acc_stride, c0, B, 2); break; \
        case 3: mix_block(P, rows, row_bytes, count, w, w_stride, acc, acc_stride, c0, B, 3); break; \
        default: mix_block(P, rows, row_bytes, count, w, w_stride, acc, acc_stride, c0, B, 4); break; }
    switch (bits) {
        case 1: MIX_CASE(1) break;
        case 2: MIX_CASE(2) break;
        case 3: MIX_CASE(3) break;
        case 4: MIX_CASE(4) break;
        default: MIX_CASE(5) break;
    }
#undef MIX_CASE
}
#endif

int kvlab_cb_mix_rows(const cb_layout *L, const uint8_t *rows, int64_t row_bytes, int64_t count, const float *w,
                      int64_t w_stride, int heads, float *acc, int64_t acc_stride) {
#if defined(__AVX512F__)
    for (int p = 0; p < L->n_parts; p++)
        if (L->part[p].bits > 5 || (L->part[p].hi - L->part[p].lo) % 64) return -1;
    for (int p = 0; p < L->n_parts; p++)
        for (int c0 = 0; c0 < L->part[p].hi - L->part[p].lo; c0 += 64)
            for (int h0 = 0; h0 < heads; h0 += 4)
                mix_heads(&L->part[p], rows, row_bytes, count, w + h0 * w_stride, w_stride, acc + h0 * acc_stride, acc_stride,
                          c0, L->part[p].bits, heads - h0 < 4 ? heads - h0 : 4);
    return 0;
#else
    (void)L, (void)rows, (void)row_bytes, (void)count, (void)w, (void)w_stride, (void)heads, (void)acc, (void)acc_stride;
    return -1;
#endif
}

/* index of the first of n increasing bounds >= y (n when none is): torch.bucketize(y, bounds, right=False) */
static int bucket(const float *bounds, int n, float y) {
    int lo = 0, hi = n;
    while (lo < hi) {
        const int mid = (lo + hi) / 2;
        if (bounds[mid] < y) lo = mid + 1;
        else hi = mid;
    }
    return lo;
}

void kvlab_cb_encode_row(const cb_layout *L, const float *bounds, const float *y, uint8_t *row, float *y_hat) {
    for (int p = 0; p < L->n_parts; p++) {
        const cb_part *P = &L->part[p];
        const int n_bounds = (1 << P->bits) - 1, n = P->hi - P->lo;
        for (int k = 0; k < P->n_planes; k++) memset(row + P->offset[k], 0, (size_t)(((int64_t)n * P->width[k] + 7) / 8));
        for (int c = 0; c < n; c++) {
            const int code = bucket(bounds, n_bounds, y[P->lo + c]);
            y_hat[P->lo + c] = P->table[code];
            for (int k = 0; k < P->n_planes; k++) {   /* plane k holds bits [shift, shift + width) at c*width of its bytes */
                const int w = P->width[k], bits = (code >> P->shift[k]) & ((1 << w) - 1);
                row[P->offset[k] + (int64_t)c * w / 8] |= (uint8_t)(bits << (c * w % 8));
            }
        }
        bounds += n_bounds;
    }
}

static int check(int heads, int64_t slots, int64_t start, int64_t n, int nq) {
    return heads < 0 || nq < 0 || start < 0 || n < 0 || start + n > slots ? -1 : 0;
}

/* threads for a call of `work` multiply-adds: one for small calls (decode steps of short contexts, tests) */
static int threads_for(int64_t work, int n_threads) {
    return work < CB_SERIAL_WORK || n_threads < 1 ? 1 : n_threads;
}

/* out (heads, nq, n) = q (heads, nq, d) . value(row start + t), codes (heads, slots, row_bytes). 0, or -1. */
int kvlab_codebook_dots(const uint8_t *codes, int heads, int64_t slots, int64_t row_bytes, int64_t start, int64_t n,
                        int d, int n_parts, const int32_t *spec, const float *tables, const float *q, int nq,
                        float *out, int n_threads) {
    cb_layout L;
    if (kvlab_cb_layout(&L, d, n_parts, spec, tables, row_bytes) || check(heads, slots, start, n, nq)) return -1;
    const int64_t tiles = (n + CB_TILE - 1) / CB_TILE;
    const int dpad = L.dpad;
    int failed = 0;
    #pragma omp parallel num_threads(threads_for((int64_t)heads * n * (nq + 1) * d, n_threads))
    {
        float *buf = calloc((size_t)dpad * (CB_TILE + (size_t)nq), sizeof(float));
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
                int32_t scratch[CB_MAX_DIM];
                for (int64_t r = 0; r < count; r++)
                    decode_row(&L, codes + ((int64_t)h * slots + start + t0 + r) * row_bytes, rows + r * dpad, scratch);
                for (int i = 0; i < nq; i++) {
                    float *qi = qpad + (size_t)i * dpad;   /* the query, zero-padded (cheap next to the tile) */
                    memcpy(qi, q + ((int64_t)h * nq + i) * d, sizeof(float) * d);
                    for (int c = d; c < dpad; c++) qi[c] = 0.0f;
                    float *o = out + ((int64_t)h * nq + i) * n + t0, sums[CB_TILE];
                    for (int r = 0; r < CB_TILE; r += 8) dot8(qi, rows + r * dpad, dpad, sums + r);
                    memcpy(o, sums, sizeof(float) * count);
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
    if (kvlab_cb_layout(&L, d, n_parts, spec, tables, row_bytes) || check(heads, slots, start, n, nq) || w_stride < n) return -1;
    const int dpad = L.dpad;
    const int64_t segments = n ? (n + CB_SEGMENT - 1) / CB_SEGMENT : 1;
    float *partial = calloc((size_t)heads * segments * nq * dpad + 1, sizeof(float));   /* (heads, segments, nq, dpad) */
    if (!partial) return -2;
    int failed = 0;
    #pragma omp parallel num_threads(threads_for((int64_t)heads * n * (nq + 1) * d, n_threads))
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
                    int32_t scratch[CB_MAX_DIM];
                    for (int64_t r = 0; r < count; r++)
                        decode_row(&L, codes + ((int64_t)h * slots + start + t0 + r) * row_bytes, rows + r * dpad, scratch);
                    for (int i = 0; i < nq; i++)
                        axpy_rows(w + ((int64_t)h * nq + i) * w_stride + t0, rows, count, acc + (size_t)i * dpad, dpad);
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
    if (kvlab_cb_layout(&L, d, n_parts, spec, tables, row_bytes) || check(heads, slots, start, n, 0)) return -1;
    #pragma omp parallel for schedule(static) collapse(2) num_threads(threads_for((int64_t)heads * n * d, n_threads))
    for (int h = 0; h < heads; h++)
        for (int64_t t = 0; t < n; t++) {
            float row[CB_MAX_DIM];
            int32_t scratch[CB_MAX_DIM];
            decode_row(&L, codes + ((int64_t)h * slots + start + t) * row_bytes, row, scratch);
            memcpy(out + ((int64_t)h * n + t) * d, row, sizeof(float) * d);
        }
    return 0;
}

/* more exported entry points of codebook.h (paged.c's ragged attention over blocks): the routines above */
void kvlab_cb_decode_row(const cb_layout *L, const uint8_t *row, float *out, int32_t *codes) { decode_row(L, row, out, codes); }

void kvlab_cb_dot8(const float *a, const float *rows, int dpad, float *out) { dot8(a, rows, dpad, out); }

void kvlab_cb_axpy_rows(const float *w, const float *rows, int64_t count, float *y, int dpad) { axpy_rows(w, rows, count, y, dpad); }

int kvlab_cb_threads(int64_t work, int n_threads) { return threads_for(work, n_threads); }
