/* TurboQuant attention straight from b-bit codebook codes (kvlab/cache/turboquant.py, `RotatedCodes`), any width.
 *
 * A row (one stored vector) is the concatenation of its parts: part p holds channels [lo, hi) at `bits` bits,
 * its codes bit-sliced into power-of-two planes, widest first (kvlab/cache/packing.py: 5 = 4 + 1, 3 = 2 + 1); a
 * w-bit plane packs 8/w codes per byte, code c at bits (c*w) % 8 of byte c*w/8. The value of channel c is the
 * part's centroid table[code]. Fractional widths are two parts (outlier channels at one more bit), QJL sign
 * bits a 1-bit part whose table is {-1, +1}.
 *
 * The entry points decode a few rows at a time into a small float tile (L1-resident) and work on that, or, under
 * AVX-512 for scalar parts of 1 to 5 bits (any channel count: a part that ends inside a 16-channel block, as a
 * fractional width's 8 channels do, reads that block's bytes alone), score and sum the rows straight from their codes
 * in registers (kvlab_cb_dot_rows, kvlab_cb_mix_rows, or through a pool's block table kvlab_cb_dot_tiles,
 * kvlab_cb_mix_tiles; see "rows used straight from their codes" below); the dots, the
 * mix and the row decoder read block parts (+vq) in registers too, any block count ("block parts" below):
 *   dots   out[h, i, t] = q[h, i] . value(row start + t)                    (scores; per row tile, all queries)
 *   mix    out[h, i]    = sum_t w[h, i, t] value(row start + t)             (values; fixed row segments, summed
 *                                                                             in segment order: same result for
 *                                                                             any thread count)
 *   decode out[h, t]    = value(row start + t)                              (a chunk's transient for a GEMM)
 * Sixteen (AVX-512) or eight (AVX2) channels of a plane are unpacked at once (widen the bytes, spread them to
 * the lanes, shift, mask), then looked up in the table: a register permute when the table fits one or two
 * registers, a gather otherwise (AVX2 decodes a 4-bit part by byte tables instead: part_rows4). The plain-C build
 * does the same one channel at a time. Norms, offsets and the
 * rotation stay in torch.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include "codebook.h"
#include "rowmath.h"

#define CB_SEGMENT 256      /* rows per partial sum of the mix */
#define CB_SERIAL_WORK (1 << 17)   /* below this many multiply-adds one thread does it (a region costs more) */
#if defined(__GNUC__)
#define CB_INLINE static inline __attribute__((always_inline))   /* the register kernels: each width and head count its own
                                                                    copy, its constants folded in */
#else
#define CB_INLINE static inline
#endif

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

/* floats of a part's table: padded centroids, or a block part's points */
static int table_size(int bits, int block) { return block ? (1 << (CB_BLOCK * bits - CB_BLOCK)) * CB_BLOCK : bits < 4 ? 16 : 1 << bits; }

int kvlab_cb_layout(cb_layout *L, int d, int n_parts, const int32_t *spec, const float *tables, int64_t row_bytes) {
    if (d <= 0 || d > CB_MAX_DIM || n_parts <= 0 || n_parts > CB_MAX_PARTS) return -1;
    L->n_parts = n_parts;
    L->d = d;
    L->dpad = (d + 15) / 16 * 16;
    int64_t offset = 0;
    int expect_lo = 0;
    for (int p = 0; p < n_parts; p++) {
        cb_part *P = &L->part[p];
        P->lo = spec[4 * p];
        P->hi = spec[4 * p + 1];
        P->bits = spec[4 * p + 2];
        P->block = spec[4 * p + 3];
        if (P->lo != expect_lo || P->hi <= P->lo || P->bits < 1 || P->bits > 8 || (P->block != 0 && P->block != 1)) return -1;
        if (P->block && ((P->bits != 2 && P->bits != 3) || (P->hi - P->lo) % CB_BLOCK)) return -1;
        expect_lo = P->hi;
        P->table = tables;
        tables += table_size(P->bits, P->block);
        /* the codes the planes hold: a block part's 8-bit indices (2 bits) or their 6-bit halves (3 bits) */
        P->code_bits = !P->block ? P->bits : P->bits == 2 ? 8 : 6;
        P->n_codes = !P->block ? P->hi - P->lo : (P->hi - P->lo) / CB_BLOCK * (P->bits == 2 ? 1 : 2);
        P->n_planes = 0;
        int shift = P->code_bits;
        for (int w = 8; w >= 1; w /= 2)
            if (P->code_bits & w) {
                shift -= w;
                P->width[P->n_planes] = w;
                P->shift[P->n_planes] = shift;
                P->offset[P->n_planes] = offset;
                offset += ((int64_t)P->n_codes * w + 7) / 8;
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
/* ---- rows used straight from their codes in registers: the mix (values) and the dots (keys) ----------------------
 * A block is the 16 channels [16b, 16b + 16) of a part (the last may hold fewer). Its values come from broadcast loads, a shift and the table
 * in a register (the permute reads only the low 4 bits of each index, so bits of other channels above the code need
 * no mask when the table repeats with the code's period):
 *   2 bits  the block's 4 bytes in every lane, lane i shifted right by 2i; the table repeated every 4 entries
 *   3 bits  the 2-bit plane as above (the code's high bits h), looked up in two tables, the centroids 2h and 2h + 1
 *           (each repeated every 4 entries): the second where the 1-bit plane's two bytes, a lane mask, have the
 *           low bit set
 *   4 bits  the block's 8 bytes in every 64-bit lane, lane k shifted right by 4k: 32-bit lane 2k holds channel k
 *           and lane 2k + 1 channel 8 + k (`block4_order`); the queries and sums are put in that order too
 *   1 bit   the block's 2 bytes as a lane mask
 *   5 bits  the 4-bit plane's 8 bytes spread to the lanes (a byte shuffle), the 1-bit plane's 2 bytes a lane mask
 *           (channels in order) */
typedef struct {
    __m512 t0, t1;                 /* the table as the block's indices read it; t1: the odd centroids (3 bits) or
                                      entries 16-31 (5 bits) */
} block_table;

CB_INLINE block_table prepare_table(const cb_part *P, const int bits) {
    const __m512 t = _mm512_loadu_ps(P->table);   /* the first 16 entries (every table holds at least 16) */
    if (bits == 2) {
        const __m512 r = _mm512_permutexvar_ps(_mm512_setr_epi32(0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3), t);
        const block_table T = {r, r};
        return T;
    }
    if (bits == 3) {
        const block_table T = {_mm512_permutexvar_ps(_mm512_setr_epi32(0, 2, 4, 6, 0, 2, 4, 6, 0, 2, 4, 6, 0, 2, 4, 6), t),
                               _mm512_permutexvar_ps(_mm512_setr_epi32(1, 3, 5, 7, 1, 3, 5, 7, 1, 3, 5, 7, 1, 3, 5, 7), t)};
        return T;
    }
    const block_table T = {t, bits == 5 ? _mm512_loadu_ps(P->table + 16) : t};
    return T;
}

/* lane j of a 4-bit block holds channel block4_order[j]; a vector of 16 channels x in order goes to block order as
 * permutexvar(block4_order, x) and back as permutexvar(block4_back, y) */
CB_INLINE __m512i block4_order(void) { return _mm512_setr_epi32(0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15); }
CB_INLINE __m512i block4_back(void) { return _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15); }

/* the first n (1 to 8) bytes at p as the low bytes of a 64-bit word, zeros above (x86: little-endian); n is a
 * constant for whole blocks, so their loads are single loads */
CB_INLINE uint64_t load_bytes(const uint8_t *p, const int n) {
    uint64_t x = 0;
    switch (n) {
        case 8: memcpy(&x, p, 8); break;
        case 4: memcpy(&x, p, 4); break;
        case 2: memcpy(&x, p, 2); break;
        default: for (int i = 0; i < n; i++) x |= (uint64_t)p[i] << 8 * i; break;
    }
    return x;
}

/* the widest plane's width for a part of `bits` (1 to 5): 5 = 4 + 1, 3 = 2 + 1 */
CB_INLINE int first_width(const int bits) { return bits >= 4 ? 4 : bits >= 2 ? 2 : 1; }

/* the values of one block from its planes' bytes, in the block's lane order: x0 the widest plane's 2w bytes, x1 the
 * 1-bit plane's two bytes (3 and 5 bits) */
CB_INLINE __m512 values_of(uint64_t x0, uint32_t x1, const int bits, block_table T) {
    if (bits == 4) {
        const __m512i codes = _mm512_srlv_epi64(_mm512_set1_epi64((int64_t)x0), _mm512_setr_epi64(0, 4, 8, 12, 16, 20, 24, 28));
        return _mm512_permutexvar_ps(codes, T.t0);
    }
    if (bits == 2 || bits == 3) {
        const __m512i high = _mm512_srlv_epi32(_mm512_set1_epi32((int32_t)x0),
                                               _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30));
        if (bits == 2) return _mm512_permutexvar_ps(high, T.t0);
        /* the 1-bit plane's bits of the block: a lane mask */
        return _mm512_mask_permutexvar_ps(_mm512_permutexvar_ps(high, T.t0), (__mmask16)x1, high, T.t1);
    }
    const __m512i one = _mm512_set1_epi32(1);
    if (bits == 1) return _mm512_permutexvar_ps(_mm512_maskz_mov_epi32((__mmask16)x0, one), T.t0);
    const __m128i spread = _mm_setr_epi8(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);   /* 5 bits: the 4-bit plane */
    const __m512i nibbles = _mm512_and_si512(
        _mm512_srlv_epi32(_mm512_cvtepu8_epi32(_mm_shuffle_epi8(_mm_cvtsi64_si128((int64_t)x0), spread)),
                          _mm512_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4)), _mm512_set1_epi32(15));
    const __m512i high = _mm512_slli_epi32(nibbles, 1);
    return _mm512_permutex2var_ps(T.t0, _mm512_mask_or_epi32(high, (__mmask16)x1, high, one), T.t1);
}

/* the values of block b of one row's part (planes at o0 and o1 of the row), in the block's lane order; `tail` < 16:
 * the part ends inside the block after `tail` channels, whose bytes alone are read (the lanes past it read code 0) */
CB_INLINE __m512 block_values(const uint8_t *row, int64_t o0, int64_t o1, int b, const int bits, block_table T, int tail) {
    const int w = first_width(bits), low = bits == 3 || bits == 5;
    const uint8_t *p0 = row + o0 + 2 * w * b, *p1 = row + o1 + 2 * b;
    if (tail < 16) return values_of(load_bytes(p0, (tail * w + 7) / 8), low ? (uint32_t)load_bytes(p1, (tail + 7) / 8) : 0, bits, T);
    return values_of(load_bytes(p0, 2 * w), low ? (uint32_t)load_bytes(p1, 2) : 0, bits, T);
}

/* lanes [0, tail) */
CB_INLINE __mmask16 lanes(int tail) { return (__mmask16)((1u << tail) - 1); }

/* row r of a read: rows + r * row_bytes, or, through a block table, tiles[r / CB_TILE] + (r % CB_TILE) * row_bytes (a
 * pool's blocks of CB_TILE rows; kvlab_cb_dot_tiles, kvlab_cb_mix_tiles) */
CB_INLINE const uint8_t *row_at(const uint8_t *rows, const uint8_t *const *tiles, int64_t row_bytes, int64_t r) {
    return tiles ? tiles[r / CB_TILE] + r % CB_TILE * row_bytes : rows + r * row_bytes;
}

/* rows of one part whose width (1 to 5 bits, a constant where this is inlined) the register blocks read: the table is
 * set up once for all the rows; a part that ends inside a block (a fractional width's 8 channels at d = 64) has that
 * block's bytes read alone and its channels stored under a lane mask */
static inline void part_rows(const cb_part *P, const uint8_t *rows, int64_t row_bytes, int64_t count, float *out,
                             int64_t stride, const int bits) {
    const int n = P->hi - P->lo;
    const block_table T = prepare_table(P, bits);
    const int64_t o0 = P->offset[0], o1 = P->n_planes > 1 ? P->offset[1] : 0;
    for (int64_t r = 0; r < count; r++) {
        const uint8_t *row = rows + r * row_bytes;
        float *o = out + r * stride + P->lo;
        for (int c = 0; c < n; c += 16) {
            const int tail = n - c < 16 ? n - c : 16;
            const __m512 v = block_values(row, o0, o1, c / 16, bits, T, tail);
            _mm512_mask_storeu_ps(o + c, lanes(tail), bits == 4 ? _mm512_permutexvar_ps(block4_back(), v) : v);
        }
    }
}

/* rows of one scalar part of 1 to 5 bits through part_rows, its width a constant in each case; 0 where the part is
 * another kind (a block part, 6 to 8 bits), which the caller decodes otherwise */
static int scalar_part_rows(const cb_part *P, const uint8_t *rows, int64_t row_bytes, int64_t count, float *out, int64_t stride) {
    if (P->block) return 0;
    switch (P->bits) {
        case 1: part_rows(P, rows, row_bytes, count, out, stride, 1); return 1;
        case 2: part_rows(P, rows, row_bytes, count, out, stride, 2); return 1;
        case 3: part_rows(P, rows, row_bytes, count, out, stride, 3); return 1;
        case 4: part_rows(P, rows, row_bytes, count, out, stride, 4); return 1;
        case 5: part_rows(P, rows, row_bytes, count, out, stride, 5); return 1;
        default: return 0;
    }
}
#elif defined(__AVX2__)
/* AVX2: eight channels of a 2-, 3- or 4-bit part at a time straight from their bytes: the plane's bytes of the eight
 * broadcast, lane k shifted right by k codes (the permute reads only an index's low 3 bits), the table in one register
 * (2, 3 bits) or two, the second where the code's bit 3 is set (4 bits); decode_row's codes stored apart and gathered
 * cost a read of tq4's keys a third of its time on an AVX2 AMD EPYC */
CB_INLINE __m256 values8(const uint8_t *row, const cb_part *P, int c, const int bits, __m256 t0, __m256 t1) {
    if (bits == 4) {
        uint32_t x;
        memcpy(&x, row + P->offset[0] + c / 2, 4);
        const __m256i codes = _mm256_srlv_epi32(_mm256_set1_epi32((int32_t)x), _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28));
        return _mm256_blendv_ps(_mm256_permutevar8x32_ps(t0, codes), _mm256_permutevar8x32_ps(t1, codes),
                                _mm256_castsi256_ps(_mm256_slli_epi32(codes, 28)));
    }
    uint16_t x;
    memcpy(&x, row + P->offset[0] + c / 4, 2);
    __m256i codes = _mm256_srlv_epi32(_mm256_set1_epi32(x), _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14));
    if (bits == 3) {   /* the 2-bit plane the code's high bits, the 1-bit plane its low bit */
        const __m256i low = _mm256_srlv_epi32(_mm256_set1_epi32(row[P->offset[1] + c / 8]), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        codes = _mm256_or_si256(_mm256_slli_epi32(_mm256_and_si256(codes, _mm256_set1_epi32(3)), 1), _mm256_and_si256(low, _mm256_set1_epi32(1)));
    }
    else
        codes = _mm256_and_si256(codes, _mm256_set1_epi32(3));   /* the permute would read the next code's low bit */
    return _mm256_permutevar8x32_ps(t0, codes);
}

CB_INLINE void part_rows8(const cb_part *P, const uint8_t *rows, int64_t row_bytes, int64_t count, float *out, int64_t stride,
                          const int bits) {
    const __m256 t0 = _mm256_loadu_ps(P->table), t1 = _mm256_loadu_ps(P->table + 8);
    for (int64_t r = 0; r < count; r++)
        for (int c = 0; c < P->hi - P->lo; c += 8)
            _mm256_storeu_ps(out + r * stride + P->lo + c, values8(rows + r * row_bytes, P, c, bits, t0, t1));
}

/* A 4-bit part's values straight from their bytes as exact floats without a permute per eight channels: the four
 * bytes of each centroid are four 16-byte tables (`bytes4`), looked up by the codes with vpshufb and interleaved back
 * into floats (unpack bytes, then words). The codes are first put in the order those in-lane unpacks undo: channels
 * c .. c + 31 as bytes, four-channel groups [0, 2, 4, 6 | 1, 3, 5, 7] (`arranged`). 34 instructions a row of 64
 * channels where values8 takes 48. */
typedef struct { __m256i b[4]; } bytes4;

/* byte k of each of the 16 centroids, in both lanes: each four centroids' bytes gathered by byte k (dword k), then
 * the 4 x 4 dwords transposed */
static bytes4 centroid_bytes(const float *table) {
    const __m128i by_byte = _mm_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    __m128 q[4];
    for (int j = 0; j < 4; j++)
        q[j] = _mm_castsi128_ps(_mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)(table + 4 * j)), by_byte));
    _MM_TRANSPOSE4_PS(q[0], q[1], q[2], q[3]);   /* q[k]: byte k of centroids 0-3, 4-7, 8-11, 12-15 */
    bytes4 out;
    for (int k = 0; k < 4; k++) out.b[k] = _mm256_broadcastsi128_si256(_mm_castps_si128(q[k]));
    return out;
}

/* out[0 .. 32) = the values of 32 channels whose codes are `arranged` (one byte each, see above) */
CB_INLINE void floats32(__m256i arranged, const bytes4 *T, float *out) {
    const __m256i b0 = _mm256_shuffle_epi8(T->b[0], arranged), b1 = _mm256_shuffle_epi8(T->b[1], arranged);
    const __m256i b2 = _mm256_shuffle_epi8(T->b[2], arranged), b3 = _mm256_shuffle_epi8(T->b[3], arranged);
    const __m256i lo01 = _mm256_unpacklo_epi8(b0, b1), lo23 = _mm256_unpacklo_epi8(b2, b3);
    const __m256i hi01 = _mm256_unpackhi_epi8(b0, b1), hi23 = _mm256_unpackhi_epi8(b2, b3);
    _mm256_storeu_si256((__m256i *)out, _mm256_unpacklo_epi16(lo01, lo23));        /* channels 0 .. 7 */
    _mm256_storeu_si256((__m256i *)(out + 8), _mm256_unpackhi_epi16(lo01, lo23));  /* 8 .. 15 */
    _mm256_storeu_si256((__m256i *)(out + 16), _mm256_unpacklo_epi16(hi01, hi23)); /* 16 .. 23 */
    _mm256_storeu_si256((__m256i *)(out + 24), _mm256_unpackhi_epi16(hi01, hi23)); /* 24 .. 31 */
}

/* the values of a 4-bit part of a multiple of 32 channels, rows at a time */
static void part_rows4(const cb_part *P, const uint8_t *rows, int64_t row_bytes, int64_t count, float *out, int64_t stride) {
    const bytes4 T = centroid_bytes(P->table);
    const __m256i low = _mm256_set1_epi8(0x0f), order = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
    const int n = P->hi - P->lo;
    for (int64_t r = 0; r < count; r++) {
        const uint8_t *codes = rows + r * row_bytes + P->offset[0];
        float *o = out + r * stride + P->lo;
        int c = 0;
        for (; c + 64 <= n; c += 64) {   /* 32 bytes: the low nibbles even channels, the high ones odd */
            const __m256i x = _mm256_loadu_si256((const __m256i *)(codes + c / 2));
            const __m256i even = _mm256_and_si256(x, low), odd = _mm256_and_si256(_mm256_srli_epi16(x, 4), low);
            /* as groups of four channels: a = [0 1 2 3 | 8 9 10 11], b = [4 5 6 7 | 12 13 14 15] */
            const __m256 a = _mm256_castsi256_ps(_mm256_unpacklo_epi8(even, odd)), b = _mm256_castsi256_ps(_mm256_unpackhi_epi8(even, odd));
            const __m256 s02 = _mm256_shuffle_ps(a, b, _MM_SHUFFLE(2, 0, 2, 0)), s13 = _mm256_shuffle_ps(a, b, _MM_SHUFFLE(3, 1, 3, 1));
            floats32(_mm256_castps_si256(_mm256_permute2f128_ps(s02, s13, 0x20)), &T, o + c);
            floats32(_mm256_castps_si256(_mm256_permute2f128_ps(s02, s13, 0x31)), &T, o + c + 32);
        }
        if (c < n) {   /* 32 channels: 16 bytes */
            const __m128i x = _mm_loadu_si128((const __m128i *)(codes + c / 2)), low16 = _mm256_castsi256_si128(low);
            const __m128i even = _mm_and_si128(x, low16), odd = _mm_and_si128(_mm_srli_epi16(x, 4), low16);
            const __m256i natural = _mm256_setr_m128i(_mm_unpacklo_epi8(even, odd), _mm_unpackhi_epi8(even, odd));
            floats32(_mm256_permutevar8x32_epi32(natural, order), &T, o + c);
        }
    }
}

/* whether part_rows8 reads a part: scalar, 2 to 4 bits, its channels whole bytes of each plane (lo, hi multiples of 8) */
static int part_in_lanes8(const cb_part *P) { return !P->block && P->lo % 8 == 0 && P->hi % 8 == 0 && P->bits >= 2 && P->bits <= 4; }

/* rows of one part part_in_lanes8 takes through part_rows8; 0 for any other part, which the caller decodes otherwise */
static int scalar_part_rows(const cb_part *P, const uint8_t *rows, int64_t row_bytes, int64_t count, float *out, int64_t stride) {
    if (!part_in_lanes8(P)) return 0;
    switch (P->bits) {
        case 2: part_rows8(P, rows, row_bytes, count, out, stride, 2); return 1;
        case 3: part_rows8(P, rows, row_bytes, count, out, stride, 3); return 1;
        default:
            if ((P->hi - P->lo) % 32 == 0) part_rows4(P, rows, row_bytes, count, out, stride);
            else part_rows8(P, rows, row_bytes, count, out, stride, 4);
            return 1;
    }
}
#else
static int scalar_part_rows(const cb_part *P, const uint8_t *rows, int64_t row_bytes, int64_t count, float *out, int64_t stride) {
    (void)P, (void)rows, (void)row_bytes, (void)count, (void)out, (void)stride;
    return 0;
}
#endif

#if defined(__AVX512F__)
/* ---- block parts (+vq, 2 or 3 bits) in registers ------------------------------------------------------------------
 * A group is up to 16 blocks of a part (64 channels; the last group of a part may hold fewer, its bytes alone read).
 * A block's index is its magnitude point << 4 | its 4 sign bits, read from the planes' bytes:
 *   2 bits  byte i of the 8-bit plane is block i's index
 *   3 bits  byte i of the 4-bit plane holds the top 4 bits of block i's two 6-bit halves (the high half in the low
 *           nibble), bits 4 (i % 2) .. of byte i / 2 of the 2-bit plane their low 2 bits (the high half's first): the
 *           sixteen points' offsets are worked out in one vector and read back from memory (a lane extract costs two
 *           vector operations, a load none), the signs gathered from the bytes by scalar bit instructions
 * then four blocks' values at a time (a quad, 16 channels): lane 4i + j coordinate j of block i's point, looked up in
 * the points (2 bits: 64 floats in four registers; 3 bits: one 16-byte load per block, twice as fast as a gather
 * here), sign bit j of the block xor'd in under one 64-bit lane mask of the group's signs. */
typedef struct {
    __m512 t[4];                   /* 2 bits: the 16 points' 64 floats */
} block_points;

CB_INLINE block_points prepare_points(const cb_part *P, const int bits) {
    block_points T;
    for (int k = 0; k < 4; k++) T.t[k] = bits == 2 ? _mm512_loadu_ps(P->table + 16 * k) : _mm512_setzero_ps();
    return T;
}

/* 2 bits: the indices of the n (1 to 16) blocks from block g (a multiple of 16) of a row's block part, its 8-bit plane at
 * o0 of the row (byte i: block i's index); the lanes past n hold 0 */
CB_INLINE __m512i block_indices(const uint8_t *row, int64_t o0, int g, int n) {
    return _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(lanes(n), row + o0 + g));
}

/* the sign bits of the 16 blocks whose indices are `index`, one lane mask: bit 4i + j is sign bit j of block i (quad k's
 * lanes are bits 16k .. 16k + 15) */
CB_INLINE uint64_t sign_bits(__m512i index) {
    const __m128i low = _mm512_cvtepi32_epi8(index);   /* byte i: block i's index, its signs in the low 4 bits */
    const uint64_t a = (uint64_t)_mm_cvtsi128_si64(low), b = (uint64_t)_mm_extract_epi64(low, 1);
#if defined(__BMI2__)
    return _pext_u64(a, 0x0f0f0f0f0f0f0f0full) | _pext_u64(b, 0x0f0f0f0f0f0f0f0full) << 32;
#else
    uint64_t bits = 0;
    for (int i = 0; i < 8; i++) bits |= (a >> 8 * i & 15) << 4 * i | (b >> 8 * i & 15) << (32 + 4 * i);
    return bits;
#endif
}

/* the magnitudes of quad k (blocks 4k .. 4k + 3) of a group whose indices are `index` (`points`: the 3-bit blocks'
 * point numbers, as vq3_points packs them): lane 4i + j coordinate j of block 4k + i's point */
CB_INLINE __m512 quad_points(const cb_part *P, __m512i index, const uint64_t *points, int k, const int bits, block_points T) {
    if (bits == 2) {   /* point * 4 + j < 64: entries 0-31 or 32-63 by bit 5 */
        const __m512i coord = _mm512_setr_epi32(0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3);
        const __m512i mine = _mm512_permutexvar_epi32(
            _mm512_add_epi32(_mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3), _mm512_set1_epi32(4 * k)), index);
        const __m512i at2 = _mm512_add_epi32(_mm512_slli_epi32(_mm512_srli_epi32(mine, CB_BLOCK), 2), coord);
        return _mm512_mask_blend_ps(_mm512_test_epi32_mask(at2, _mm512_set1_epi32(32)), _mm512_permutex2var_ps(T.t[0], at2, T.t[1]),
                                    _mm512_permutex2var_ps(T.t[2], at2, T.t[3]));
    }
    /* each block's point: one 16-byte load, at 4 floats times its number (byte 4 (k & 1) + j of points[k / 2]) */
    const uint64_t four = points[k / 2] >> 32 * (k & 1);
#define POINT(j) _mm_loadu_ps(P->table + 4 * (int64_t)(four >> 8 * (j) & 255))
    const __m256 low = _mm256_insertf128_ps(_mm256_castps128_ps256(POINT(0)), POINT(1), 1);
    const __m256 high = _mm256_insertf128_ps(_mm256_castps128_ps256(POINT(2)), POINT(3), 1);
#undef POINT
    return _mm512_insertf32x8(_mm512_castps256_ps512(low), high, 1);
}

/* lanes of quad k of a group of n blocks: 4 per block in it */
CB_INLINE __mmask16 quad_lanes(int n, int k) { return lanes(n - 4 * k >= 4 ? 16 : 4 * (n - 4 * k)); }

/* 3 bits: the planes' bytes of the n (1 to 16) blocks from block g of a row's block part (planes at o0 and o1): the
 * 2-bit plane's nibble i for block i (`low`), the 4-bit plane's byte i for blocks 0-7 (`a`) and 8-15 (`b`) */
typedef struct { uint64_t low, a, b; } vq3_bytes;
CB_INLINE vq3_bytes vq3_bytes_of(const uint8_t *row, int64_t o0, int64_t o1, int g, const int n) {
    return (vq3_bytes){load_bytes(row + o1 + g / 2, (n + 1) / 2), load_bytes(row + o0 + g, n < 8 ? n : 8),
                       n > 8 ? load_bytes(row + o0 + g + 8, n - 8) : 0};
}

/* 3 bits: the n blocks' sign bits as sign_bits gives them: signs 0 and 1 of block i are bits 2 and 3 of nibble i of
 * the 2-bit plane, signs 2 and 3 bits 4 and 5 of byte i of the 4-bit plane (scalar bit gathers, no vector work) */
CB_INLINE uint64_t vq3_signs(vq3_bytes x, const int n) {
    const uint64_t low = x.low, a = x.a, b = x.b;
#if defined(__BMI2__)
    (void)n;   /* the blocks past n read as zero bytes */
    const uint64_t s01 = _pext_u64(low, 0xccccccccccccccccull);   /* bits 2i, 2i + 1: signs 0, 1 of block i */
    const uint64_t s23 = _pext_u64(a, 0x3030303030303030ull) | _pext_u64(b, 0x3030303030303030ull) << 16;
    return _pdep_u64(s01, 0x3333333333333333ull) | _pdep_u64(s23, 0xccccccccccccccccull);
#else
    uint64_t bits = 0;
    for (int i = 0; i < n; i++) {
        const uint64_t byte = (i < 8 ? a >> 8 * i : b >> 8 * (i - 8)) & 255;
        bits |= (low >> (4 * i + 2) & 3) << 4 * i | (byte >> 4 & 3) << (4 * i + 2);
    }
    return bits;
#endif
}

/* 3 bits: the blocks' point numbers, byte i of points[0] (blocks 0-7) or points[1] (8-15), from the planes' bytes:
 * block i's point is its 6-bit high half's 6 bits then the low half's top 2 (block_indices), i.e. bits 0-3 of byte i
 * of the 4-bit plane, bits 0-1 of nibble i of the 2-bit plane and bits 6-7 of that byte, high to low. Eight blocks a
 * 64-bit word in general-purpose registers: each point's address is a shift and a mask away, with no vector lane to
 * extract and no store to read back. */
CB_INLINE void vq3_points(vq3_bytes x, uint64_t *points) {
    const uint64_t bytes[2] = {x.a, x.b};
    for (int h = 0; h < 2; h++) {
        const uint64_t b = bytes[h], nibbles = x.low >> 32 * h;
#if defined(__BMI2__)
        const uint64_t middle = _pdep_u64(_pext_u64(nibbles, 0x33333333ull), 0x0c0c0c0c0c0c0c0cull);
#else
        uint64_t middle = 0;
        for (int i = 0; i < 8; i++) middle |= (nibbles >> 4 * i & 3) << (8 * i + 2);
#endif
        points[h] = (b & 0x0f0f0f0f0f0f0f0full) << 4 | middle | (b >> 6 & 0x0303030303030303ull);
    }
}

/* v[k] = the values of quad k of the n (1 to 16) blocks from block g (a multiple of 16) of a row's block part, 4k < n:
 * lane 4i + j coordinate j of block 4k + i, its sign bit j applied (an xor under the row's sign mask: -x bit for bit) */
CB_INLINE void group_values(const cb_part *P, const uint8_t *row, int g, int n, const int bits, block_points T, __m512 *v) {
    const int64_t o0 = P->offset[0], o1 = P->n_planes > 1 ? P->offset[1] : 0;
    __m512i index = _mm512_setzero_si512();
    uint64_t signs;
    uint64_t points[2] = {0, 0};
    if (bits == 3) {
        const vq3_bytes x = vq3_bytes_of(row, o0, o1, g, n);
        vq3_points(x, points);
        signs = vq3_signs(x, n);
    } else {
        index = block_indices(row, o0, g, n);
        signs = sign_bits(index);
    }
    const __m512i sign = _mm512_set1_epi32((int32_t)0x80000000u);
    for (int k = 0; k < 4; k++)
        if (4 * k < n) {
            const __m512i x = _mm512_castps_si512(quad_points(P, index, points, k, bits, T));
            v[k] = _mm512_castsi512_ps(_mm512_mask_xor_epi32(x, (__mmask16)(signs >> 16 * k), x, sign));
        }
}

/* rows of one block part (bits a constant where this is inlined) into out + r * stride + lo */
static inline void block_rows(const cb_part *P, const uint8_t *rows, int64_t row_bytes, int64_t count, float *out,
                              int64_t stride, const int bits) {
    const int n_blocks = (P->hi - P->lo) / CB_BLOCK;
    const block_points T = prepare_points(P, bits);
    for (int64_t r = 0; r < count; r++)
        for (int g = 0; g < n_blocks; g += 16) {
            const int n = n_blocks - g < 16 ? n_blocks - g : 16;
            __m512 v[4];
            group_values(P, rows + r * row_bytes, g, n, bits, T, v);
            for (int k = 0; 4 * k < n; k++) _mm512_mask_storeu_ps(out + r * stride + P->lo + CB_BLOCK * (g + 4 * k), quad_lanes(n, k), v[k]);
        }
}

/* rows of one block part through block_rows, its width a constant in each case; 0 where the part is scalar */
static int block_part_rows(const cb_part *P, const uint8_t *rows, int64_t row_bytes, int64_t count, float *out, int64_t stride) {
    if (!P->block) return 0;
    if (P->bits == 2) block_rows(P, rows, row_bytes, count, out, stride, 2);
    else block_rows(P, rows, row_bytes, count, out, stride, 3);
    return 1;
}
#elif defined(__AVX2__)
/* AVX2: block b's index (decode_blocks' codes[b], or codes[2b] << 6 | codes[2b + 1] at 3 bits) straight from the
 * planes' bytes: 2 bits one byte; 3 bits the halves' high 4 bits the two nibbles of byte b of the 4-bit plane, their
 * low 2 bits nibble b of the 2-bit plane */
static inline int stored_block_index(const cb_part *P, const uint8_t *row, int b) {
    if (P->bits == 2) return row[P->offset[0] + b];
    const int nibbles = row[P->offset[0] + b], low = row[P->offset[1] + b / 2] >> 4 * (b % 2);
    return ((nibbles & 15) << 2 | (low & 3)) << 6 | (nibbles >> 4) << 2 | (low >> 2 & 3);
}

/* the xor that applies sign bits j (bit j: channel j negative) to a block's four floats: sign bit of lane j set */
#define SIGN_LANES(j) {(j) & 1 ? 0x80000000u : 0, (j) & 2 ? 0x80000000u : 0, (j) & 4 ? 0x80000000u : 0, (j) & 8 ? 0x80000000u : 0}
static const uint32_t BLOCK_SIGNS[16][CB_BLOCK] = {SIGN_LANES(0), SIGN_LANES(1), SIGN_LANES(2), SIGN_LANES(3), SIGN_LANES(4),
    SIGN_LANES(5), SIGN_LANES(6), SIGN_LANES(7), SIGN_LANES(8), SIGN_LANES(9), SIGN_LANES(10), SIGN_LANES(11), SIGN_LANES(12),
    SIGN_LANES(13), SIGN_LANES(14), SIGN_LANES(15)};
#undef SIGN_LANES

/* block b's values: its point (4 floats) loaded by its index, its signs applied as decode_blocks does (-x bit for bit) */
static inline __m128 block_values4(const float *table, int point, int signs) {
    return _mm_xor_ps(_mm_loadu_ps(table + point * CB_BLOCK), _mm_loadu_ps((const float *)BLOCK_SIGNS[signs]));
}

#if defined(__BMI2__)
/* eight blocks from block g: byte i of *points block g + i's point number, nibble i of *signs its sign bits, by scalar
 * bit gathers from the planes' bytes (as the AVX-512 vq3_points / vq3_signs) */
static inline void block_words(const cb_part *P, const uint8_t *row, int g, uint64_t *points, uint64_t *signs) {
    uint64_t a;
    memcpy(&a, row + P->offset[0] + g, 8);
    if (P->bits == 2) {
        *points = a >> 4 & 0x0f0f0f0f0f0f0f0full;
        *signs = _pext_u64(a, 0x0f0f0f0f0f0f0f0full);
        return;
    }
    uint32_t low;   /* the 2-bit plane's nibble i: the low bits of block i's halves */
    memcpy(&low, row + P->offset[1] + g / 2, 4);
    *points = (a & 0x0f0f0f0f0f0f0f0full) << 4 | _pdep_u64(_pext_u64(low, 0x33333333u), 0x0c0c0c0c0c0c0c0cull) |
              (a >> 6 & 0x0303030303030303ull);
    *signs = _pdep_u64(_pext_u64(low, 0xccccccccu), 0x33333333u) | _pdep_u64(_pext_u64(a, 0x3030303030303030ull), 0xccccccccu);
}
#endif

/* rows of one block part, two blocks a vector, the indices never passing through a scratch of codes */
static int block_part_rows(const cb_part *P, const uint8_t *rows, int64_t row_bytes, int64_t count, float *out, int64_t stride) {
    if (!P->block) return 0;
    const int n_blocks = (P->hi - P->lo) / CB_BLOCK;
    const float *table = P->table;
    for (int64_t r = 0; r < count; r++) {
        const uint8_t *row = rows + r * row_bytes;
        float *o = out + r * stride + P->lo;
        int b = 0;
#if defined(__BMI2__)
        for (; b + 8 <= n_blocks; b += 8) {
            uint64_t points, signs;
            block_words(P, row, b, &points, &signs);
            for (int i = 0; i < 8; i += 2)
                _mm256_storeu_ps(o + (b + i) * CB_BLOCK,
                                 _mm256_setr_m128(block_values4(table, (int)(points >> 8 * i & 255), (int)(signs >> 4 * i & 15)),
                                                  block_values4(table, (int)(points >> 8 * (i + 1) & 255), (int)(signs >> 4 * (i + 1) & 15))));
        }
#endif
        for (; b < n_blocks; b++) {
            const int index = stored_block_index(P, row, b);
            _mm_storeu_ps(o + b * CB_BLOCK, block_values4(table, index >> CB_BLOCK, index & 15));
        }
    }
    return 1;
}
#else
static int block_part_rows(const cb_part *P, const uint8_t *rows, int64_t row_bytes, int64_t count, float *out, int64_t stride) {
    (void)P, (void)rows, (void)row_bytes, (void)count, (void)out, (void)stride;
    return 0;
}
#endif

/* out (n,) = a block part's values: each block's point, its signs applied (turboquant.py _block_decode); the builds
 * without block_part_rows (neither AVX-512 nor AVX2) */
static void decode_blocks(const cb_part *P, const uint8_t *row, float *out, int32_t *codes) {
    for (int k = 0; k < P->n_planes; k++) plane_codes(row + P->offset[k], P->n_codes, P->width[k], P->shift[k], k == 0, codes);
    for (int b = 0; b < (P->hi - P->lo) / CB_BLOCK; b++) {
        const int index = P->bits == 2 ? codes[b] : codes[2 * b] << 6 | codes[2 * b + 1];
        const float *point = P->table + (index >> CB_BLOCK) * CB_BLOCK;
        for (int j = 0; j < CB_BLOCK; j++) {   /* the sign bit flipped (-x bit for bit), no branch on random signs */
            uint32_t x;
            memcpy(&x, point + j, 4);
            x ^= (uint32_t)(index >> j & 1) << 31;
            memcpy(out + b * CB_BLOCK + j, &x, 4);
        }
    }
}

/* out[0 .. dpad) = the row's values, zero past d; codes: dpad ints of scratch */
static void decode_row(const cb_layout *L, const uint8_t *row, float *out, int32_t *codes) {
    for (int p = 0; p < L->n_parts; p++) {
        const cb_part *P = &L->part[p];
        const int n = P->hi - P->lo;
        if (scalar_part_rows(P, row, 0, 1, out, 0) || block_part_rows(P, row, 0, 1, out, 0)) continue;   /* in registers */
        if (P->block) {
            decode_blocks(P, row, out + P->lo, codes + P->lo);
            continue;
        }
        for (int k = 0; k < P->n_planes; k++) plane_codes(row + P->offset[k], n, P->width[k], P->shift[k], k == 0, codes + P->lo);
        for (int c = lookup_blocks(P->table, P->bits, codes + P->lo, n, out + P->lo); c < n; c++) out[P->lo + c] = P->table[codes[P->lo + c]];
    }
    for (int c = L->d; c < L->dpad; c++) out[c] = 0.0f;
}

/* whether the dots, the mix and the row decoder read a layout in registers (AVX-512): every part scalar, 1 to 5 bits
 * (a part is read in groups of up to four 16-channel blocks; one that ends inside a block, a fractional width's 8
 * channels, reads that block's bytes alone), or a block part (in groups of up to 16 blocks) */
static int register_layout(const cb_layout *L) {
    int ok = CB_LANES == 16;
    for (int p = 0; p < L->n_parts; p++) ok &= L->part[p].block || L->part[p].bits <= 5;
    return ok;
}

void kvlab_cb_decode_rows(const cb_layout *L, const uint8_t *rows, int64_t row_bytes, int64_t count, float *out, int64_t stride) {
    if (L->d == L->dpad && register_layout(L)) {   /* AVX-512, every part a block part or 1..5 bits: part by part */
        for (int p = 0; p < L->n_parts; p++)
            if (!scalar_part_rows(&L->part[p], rows, row_bytes, count, out, stride)) block_part_rows(&L->part[p], rows, row_bytes, count, out, stride);
        return;
    }
#if defined(__AVX2__) && !defined(__AVX512F__)
    int whole = L->d == L->dpad;   /* AVX2, every part one scalar_part_rows or block_part_rows reads: part by part, each
                                      table loaded once */
    for (int p = 0; p < L->n_parts; p++) whole &= part_in_lanes8(&L->part[p]) || L->part[p].block;
    if (whole) {
        for (int p = 0; p < L->n_parts; p++)
            if (!scalar_part_rows(&L->part[p], rows, row_bytes, count, out, stride)) block_part_rows(&L->part[p], rows, row_bytes, count, out, stride);
        return;
    }
#endif
    int32_t scratch[CB_MAX_DIM];
    for (int64_t r = 0; r < count; r++) decode_row(L, rows + r * row_bytes, out + r * stride, scratch);
}

#if defined(__AVX512F__)
/* acc[h][lo + 16 b0 ..) += sum_r w[h][r] value(r) for `gh` heads, one part, its blocks b0 .. b0 + nb - 1 (nb <= 4; the
 * last holds `tail` channels): the codes are unpacked and looked up in registers, each row's blocks read by every
 * head (bits and gh constants here; the loops over four blocks unroll, the blocks past nb skipped) */
CB_INLINE void mix_block(const cb_part *P, const uint8_t *rows, const uint8_t *const *tiles, int64_t row_bytes, int64_t count, const float *w,
                         int64_t w_stride, float *acc, int64_t acc_stride, int b0, int nb, int tail, const int bits, const int gh) {
    const block_table T = prepare_table(P, bits);
    const int64_t o0 = P->offset[0], o1 = P->n_planes > 1 ? P->offset[1] : 0;
    __m512 a[4][4];
    for (int h = 0; h < gh; h++)
        for (int b = 0; b < 4; b++)
            if (b < nb) {
                const __m512 x = _mm512_maskz_loadu_ps(lanes(b == nb - 1 ? tail : 16), acc + h * acc_stride + P->lo + 16 * (b0 + b));
                a[h][b] = bits == 4 ? _mm512_permutexvar_ps(block4_order(), x) : x;
            }
    const uint8_t *row = rows;
    for (int64_t r = 0; r < count; r++) {
        row = r % CB_TILE ? row + row_bytes : row_at(rows, tiles, row_bytes, r);   /* a tile's rows follow its first */
        __m512 value[4];
        for (int b = 0; b < 4; b++)
            if (b < nb) value[b] = block_values(row, o0, o1, b0 + b, bits, T, b == nb - 1 ? tail : 16);
        for (int h = 0; h < gh; h++) {
            const __m512 wr = _mm512_set1_ps(w[h * w_stride + r]);
            for (int b = 0; b < 4; b++)
                if (b < nb) a[h][b] = _mm512_fmadd_ps(wr, value[b], a[h][b]);
        }
    }
    for (int h = 0; h < gh; h++)
        for (int b = 0; b < 4; b++)
            if (b < nb)
                _mm512_mask_storeu_ps(acc + h * acc_stride + P->lo + 16 * (b0 + b), lanes(b == nb - 1 ? tail : 16),
                                      bits == 4 ? _mm512_permutexvar_ps(block4_back(), a[h][b]) : a[h][b]);
}

static void mix_heads(const cb_part *P, const uint8_t *rows, const uint8_t *const *tiles, int64_t row_bytes, int64_t count, const float *w,
                      int64_t w_stride, float *acc, int64_t acc_stride, int b0, int nb, int tail, int bits, int gh) {
#define MIX_CASE(B, NB, TAIL) switch (gh) { \
        case 1: mix_block(P, rows, tiles, row_bytes, count, w, w_stride, acc, acc_stride, b0, NB, TAIL, B, 1); break; \
        case 2: mix_block(P, rows, tiles, row_bytes, count, w, w_stride, acc, acc_stride, b0, NB, TAIL, B, 2); break; \
        case 3: mix_block(P, rows, tiles, row_bytes, count, w, w_stride, acc, acc_stride, b0, NB, TAIL, B, 3); break; \
        default: mix_block(P, rows, tiles, row_bytes, count, w, w_stride, acc, acc_stride, b0, NB, TAIL, B, 4); break; }
    if (bits == 4 && nb == 4 && tail == 16) {   /* 64 channels at 4 bits (tq4's values): the counts constants too */
        MIX_CASE(4, 4, 16)
        return;
    }
    switch (bits) {
        case 1: MIX_CASE(1, nb, tail) break;
        case 2: MIX_CASE(2, nb, tail) break;
        case 3: MIX_CASE(3, nb, tail) break;
        case 4: MIX_CASE(4, nb, tail) break;
        default: MIX_CASE(5, nb, tail) break;
    }
#undef MIX_CASE
}

/* acc[h][lo + 4g ..) += sum_r w[h][r] value(r) for `gh` heads over the n (<= 16) blocks from block g of a block part:
 * each row's quads looked up once and read by every head, one chain per head and quad (rows in order, as axpy_rows sums
 * a decoded tile); bits and gh constants here */
CB_INLINE void mix_group(const cb_part *P, const uint8_t *rows, const uint8_t *const *tiles, int64_t row_bytes, int64_t count, const float *w,
                         int64_t w_stride, float *acc, int64_t acc_stride, int g, int n, const int bits, const int gh) {
    const block_points T = prepare_points(P, bits);
    float *first = acc + P->lo + CB_BLOCK * g;
    __m512 a[4][4];
#pragma GCC unroll 4
    for (int h = 0; h < gh; h++)
#pragma GCC unroll 4
        for (int k = 0; k < 4; k++)
            a[h][k] = 4 * k < n ? _mm512_maskz_loadu_ps(quad_lanes(n, k), first + h * acc_stride + 16 * k) : _mm512_setzero_ps();
    const uint8_t *row = rows;
    for (int64_t r = 0; r < count; r++) {
        __m512 v[4];
        row = r % CB_TILE ? row + row_bytes : row_at(rows, tiles, row_bytes, r);   /* a tile's rows follow its first */
        group_values(P, row, g, n, bits, T, v);
#pragma GCC unroll 4
        for (int h = 0; h < gh; h++) {
            const __m512 wr = _mm512_set1_ps(w[h * w_stride + r]);
#pragma GCC unroll 4
            for (int k = 0; k < 4; k++)
                if (4 * k < n) a[h][k] = _mm512_fmadd_ps(wr, v[k], a[h][k]);
        }
    }
#pragma GCC unroll 4
    for (int h = 0; h < gh; h++)
#pragma GCC unroll 4
        for (int k = 0; k < 4; k++)
            if (4 * k < n) _mm512_mask_storeu_ps(first + h * acc_stride + 16 * k, quad_lanes(n, k), a[h][k]);
}

static void mix_group_heads(const cb_part *P, const uint8_t *rows, const uint8_t *const *tiles, int64_t row_bytes, int64_t count, const float *w,
                            int64_t w_stride, float *acc, int64_t acc_stride, int g, int n, int gh) {
#define GROUP_CASE(B, N) switch (gh) { \
        case 1: mix_group(P, rows, tiles, row_bytes, count, w, w_stride, acc, acc_stride, g, N, B, 1); break; \
        case 2: mix_group(P, rows, tiles, row_bytes, count, w, w_stride, acc, acc_stride, g, N, B, 2); break; \
        case 3: mix_group(P, rows, tiles, row_bytes, count, w, w_stride, acc, acc_stride, g, N, B, 3); break; \
        default: mix_group(P, rows, tiles, row_bytes, count, w, w_stride, acc, acc_stride, g, N, B, 4); break; }
    if (P->bits == 3 && n == 16) {   /* 64 channels at 3 bits (tq3's values): the count a constant too */
        GROUP_CASE(3, 16)
    } else if (P->bits == 2) {
        GROUP_CASE(2, n)
    } else {
        GROUP_CASE(3, n)
    }
#undef GROUP_CASE
}

/* The dots: a row's partial sums per head (16 lanes: its products summed over the part's blocks), sixteen rows'
 * partials folded into one vector of sixteen dots instead of a horizontal sum per row. A fold of two vectors a, b whose
 * rows hold 2g partials each (g = 8, 4, 2, 1) gives rows of g: its lane block k (g lanes) is the sum of the blocks k and
 * k ^ 1 of a (k even) or b (k odd), the first in place (a blend) and the second moved (one permute), so a's and b's rows
 * interleave. Four levels (16 vectors -> 8 -> 4 -> 2 -> 1) leave the row at position p in lane bitrev(p): the rows go in
 * at bit-reversed positions to come out in order. Folded as the rows come (quads, then pairs of quads) to keep the
 * partials in registers. */
CB_INLINE __m512 fold(__m512 a, __m512 b, const int s) {
    /* level s (g = 8 >> s): lane j of block k = j / g moved from lane (k & 1) * 16 + (k ^ 1) * g + j % g; the blocks
     * with k odd are b's in place */
    static const int32_t other[4][16] = {
        {8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23}, {4, 5, 6, 7, 16, 17, 18, 19, 12, 13, 14, 15, 24, 25, 26, 27},
        {2, 3, 16, 17, 6, 7, 20, 21, 10, 11, 24, 25, 14, 15, 28, 29}, {1, 16, 3, 18, 5, 20, 7, 22, 9, 24, 11, 26, 13, 28, 15, 30}};
    static const __mmask16 from_b[4] = {0xff00, 0xf0f0, 0xcccc, 0xaaaa};
    return _mm512_add_ps(_mm512_mask_blend_ps(from_b[s], a, b), _mm512_permutex2var_ps(a, _mm512_loadu_si512(other[s]), b));
}

/* p[h] = the partials of q_h . value(row) over the nb blocks from b0 (the last holding `tail` channels); qb: each
 * head's 64 channels in block order, zero past the part, qs floats apart. With vq, a block part's nb (<= 16) blocks of 4
 * coordinates from block b0 instead: up to four quads, qb's channels in order */
CB_INLINE void row_partials(const cb_part *P, const uint8_t *row, int64_t o0, int64_t o1, int b0, int nb, int tail,
                            const float *qb, int64_t qs, const int bits, const int gh, block_table T, block_points V,
                            const int vq, __m512 *p) {
    if (vq) {
        __m512 v[4];
        group_values(P, row, b0, nb, bits, V, v);
        for (int h = 0; h < gh; h++) p[h] = _mm512_mul_ps(_mm512_loadu_ps(qb + h * qs), v[0]);
        for (int k = 1; k < 4; k++)
            if (4 * k < nb)
                for (int h = 0; h < gh; h++) p[h] = _mm512_fmadd_ps(_mm512_loadu_ps(qb + h * qs + 16 * k), v[k], p[h]);
        return;
    }
    const __m512 v = block_values(row, o0, o1, b0, bits, T, nb == 1 ? tail : 16);
    for (int h = 0; h < gh; h++) p[h] = _mm512_mul_ps(_mm512_loadu_ps(qb + h * qs), v);
    for (int b = 1; b < 4; b++)
        if (b < nb) {
            const __m512 vb = block_values(row, o0, o1, b0 + b, bits, T, b == nb - 1 ? tail : 16);
            for (int h = 0; h < gh; h++) p[h] = _mm512_fmadd_ps(_mm512_loadu_ps(qb + h * qs + 16 * b), vb, p[h]);
        }
}

/* x[h] = the partials of the quad k of the sixteen rows from `rows`, folded twice: positions 4k .. 4k + 3 (the rows
 * bitrev(4k + j) = 8 (j & 1) + 4 (j >> 1) + 2 (k & 1) + (k >> 1)), four lanes a row */
CB_INLINE void quad_partials(const cb_part *P, const uint8_t *rows, int64_t row_bytes, int k, int64_t o0, int64_t o1, int b0,
                             int nb, int tail, const float *qb, int64_t qs, const int bits, const int gh, block_table T,
                             block_points V, const int vq, __m512 *x) {
    __m512 p[4][4];   /* [row of the quad][head] */
    for (int j = 0; j < 4; j++)
        row_partials(P, rows + (8 * (j & 1) + 4 * (j >> 1) + 2 * (k & 1) + (k >> 1)) * row_bytes, o0, o1, b0, nb, tail, qb,
                     qs, bits, gh, T, V, vq, p[j]);
    for (int h = 0; h < gh; h++) x[h] = fold(fold(p[0][h], p[1][h], 0), fold(p[2][h], p[3][h], 0), 1);
}

/* out[h * out_stride + r] (+)= q_h . value(row r) over the blocks b0 .. b0 + nb - 1 of one part (nb <= 4, the last
 * holding `tail` channels; vq: a block part's nb <= 16 blocks), r < count, for `gh` heads (bits, gh and vq constants
 * here); qb as row_partials reads it */
CB_INLINE void dot_block(const cb_part *P, const uint8_t *rows, const uint8_t *const *tiles, int64_t row_bytes, int64_t count, int b0, int nb, int tail,
                         const float *qb, int64_t qs, int add, float *out, int64_t out_stride, const int bits, const int gh,
                         const int vq) {
    const block_table T = vq ? (block_table){_mm512_setzero_ps(), _mm512_setzero_ps()} : prepare_table(P, bits);
    const block_points V = vq ? prepare_points(P, bits) : (block_points){{_mm512_setzero_ps()}};
    const int64_t o0 = P->offset[0], o1 = P->n_planes > 1 ? P->offset[1] : 0;
    int64_t r = 0;
    for (; r + 16 <= count; r += 16) {
        const uint8_t *at = row_at(rows, tiles, row_bytes, r);   /* sixteen rows, one tile */
        __m512 x[4], y[4], half[4];
        quad_partials(P, at, row_bytes, 0, o0, o1, b0, nb, tail, qb, qs, bits, gh, T, V, vq, x);
        quad_partials(P, at, row_bytes, 1, o0, o1, b0, nb, tail, qb, qs, bits, gh, T, V, vq, y);
        for (int h = 0; h < gh; h++) half[h] = fold(x[h], y[h], 2);
        quad_partials(P, at, row_bytes, 2, o0, o1, b0, nb, tail, qb, qs, bits, gh, T, V, vq, x);
        quad_partials(P, at, row_bytes, 3, o0, o1, b0, nb, tail, qb, qs, bits, gh, T, V, vq, y);
        for (int h = 0; h < gh; h++) {
            float *o = out + h * out_stride + r;
            const __m512 dots = fold(half[h], fold(x[h], y[h], 2), 3);
            _mm512_storeu_ps(o, add ? _mm512_add_ps(_mm512_loadu_ps(o), dots) : dots);
        }
    }
    for (; r < count; r++) {   /* the last rows one at a time */
        __m512 p[4];
        row_partials(P, row_at(rows, tiles, row_bytes, r), o0, o1, b0, nb, tail, qb, qs, bits, gh, T, V, vq, p);
        for (int h = 0; h < gh; h++) {
            const float dot = _mm512_reduce_add_ps(p[h]);
            out[h * out_stride + r] = add ? out[h * out_stride + r] + dot : dot;
        }
    }
}

/* rows [lo, hi) of each run of `ahead` asked for, lo and hi the share of rows [r, r + 16) of a read of `count` rows */
CB_INLINE void ask_ahead(const cb_ahead *ahead, int n_ahead, int64_t r, int64_t count) {
    for (int a = 0; a < n_ahead; a++) {
        const int64_t lo = r * ahead[a].count / count, hi = (r + 16 < count ? r + 16 : count) * ahead[a].count / count;
        for (int64_t j = lo; j < hi;) {   /* a tile's rows at a time (one span where the rows are contiguous) */
            const int64_t end = ahead[a].tiles && (j / CB_TILE + 1) * CB_TILE < hi ? (j / CB_TILE + 1) * CB_TILE : hi;
            kvlab_prefetch_lines(row_at(ahead[a].rows, ahead[a].tiles, ahead[a].row_bytes, j), (end - j) * ahead[a].row_bytes);
            j = end;
        }
    }
}

/* quad_partials for 64 channels at 4 bits (o0: the first code byte of the part's block b0 in a row) or, `mixed`, for tq3's
 * keys: channels [0, 32) at 4 bits (part P, o0 its first code byte) and [32, 64) 3-bit blocks of 4 (+vq, part V); the
 * queries qv in registers: each head's four 16-channel blocks, the 4-bit ones in block order */
CB_INLINE void quad_partials4(const cb_part *V, const uint8_t *rows, int64_t row_bytes, int k, int64_t o0, const __m512 (*qv)[4],
                              const int gh, block_table T, const int mixed, __m512 *x) {
    __m512 p[4][4];   /* [row of the quad][head] */
    for (int j = 0; j < 4; j++) {
        const uint8_t *row = rows + (8 * (j & 1) + 4 * (j >> 1) + 2 * (k & 1) + (k >> 1)) * row_bytes;
        __m512 v[4];
        for (int b = 0; b < (mixed ? 2 : 4); b++) v[b] = values_of(load_bytes(row + o0 + 8 * b, 8), 0, 4, T);
        if (mixed) group_values(V, row, 0, 8, 3, (block_points){{_mm512_setzero_ps()}}, v + 2);
        for (int b = 0; b < 4; b++)
            for (int h = 0; h < gh; h++) p[j][h] = b ? _mm512_fmadd_ps(qv[h][b], v[b], p[j][h]) : _mm512_mul_ps(qv[h][b], v[b]);
        /* tq4's keys fold each pair of rows as it comes, the same sums with fewer registers live (1.11x the reads of
         * this path on a Zen 5; tq3's, whose block points take registers of their own, ran slower so) */
        if (!mixed && (j & 1))
            for (int h = 0; h < gh; h++) p[j - 1][h] = fold(p[j - 1][h], p[j][h], 0);
    }
    for (int h = 0; h < gh; h++)
        x[h] = mixed ? fold(fold(p[0][h], p[1][h], 0), fold(p[2][h], p[3][h], 0), 1) : fold(p[0][h], p[2][h], 1);
}

/* dot_block for 64 channels at 4 bits from block b0 (one 32-byte run of codes a row) or, `mixed`, for tq3's keys (parts
 * P and V as quad_partials4 reads them; qb: [32, 64) in order after the 4-bit blocks), its counts constants and the
 * queries loaded into registers once; the runs of `ahead` asked for a share with each sixteen rows */
CB_INLINE void dot_rows4(const cb_part *P, const cb_part *V, const uint8_t *rows, const uint8_t *const *tiles, int64_t row_bytes, int64_t count, int b0,
                         const float *qb, int64_t qs, int add, float *out, int64_t out_stride, const cb_ahead *ahead,
                         int n_ahead, const int gh, const int mixed) {
    const block_table T = prepare_table(P, 4);
    const int64_t o0 = P->offset[0] + 8 * b0;
    __m512 qv[4][4];
    for (int h = 0; h < gh; h++)
        for (int b = 0; b < 4; b++) qv[h][b] = _mm512_loadu_ps(qb + h * qs + 16 * b);
    int64_t r = 0;
    for (; r + 16 <= count; r += 16) {
        const uint8_t *at = row_at(rows, tiles, row_bytes, r);   /* sixteen rows, one tile */
        __m512 x[4], y[4], half[4];
        ask_ahead(ahead, n_ahead, r, count);
        quad_partials4(V, at, row_bytes, 0, o0, qv, gh, T, mixed, x);
        quad_partials4(V, at, row_bytes, 1, o0, qv, gh, T, mixed, y);
        for (int h = 0; h < gh; h++) half[h] = fold(x[h], y[h], 2);
        quad_partials4(V, at, row_bytes, 2, o0, qv, gh, T, mixed, x);
        quad_partials4(V, at, row_bytes, 3, o0, qv, gh, T, mixed, y);
        for (int h = 0; h < gh; h++) {
            float *o = out + h * out_stride + r;
            const __m512 dots = fold(half[h], fold(x[h], y[h], 2), 3);
            _mm512_storeu_ps(o, add ? _mm512_add_ps(_mm512_loadu_ps(o), dots) : dots);
        }
    }
    if (r < count) {   /* the last rows one at a time */
        ask_ahead(ahead, n_ahead, r, count);
        const uint8_t *last = row_at(rows, tiles, row_bytes, r);   /* fewer than sixteen rows: within one tile */
        if (mixed) {
            dot_block(P, last, NULL, row_bytes, count - r, 0, 2, 16, qb, qs, add, out + r, out_stride, 4, gh, 0);
            dot_block(V, last, NULL, row_bytes, count - r, 0, 8, 16, qb + 32, qs, 1, out + r, out_stride, 3, gh, 1);
        } else {
            dot_block(P, last, NULL, row_bytes, count - r, b0, 4, 16, qb, qs, add, out + r, out_stride, 4, gh, 0);
        }
    }
}

/* whether a layout is tq4's keys: 64 channels at 4 bits, one part (dot_heads' `rows4`) */
static int rows4_keys(const cb_layout *L) {
    return L->n_parts == 1 && L->d == 64 && !L->part[0].block && L->part[0].bits == 4;
}

/* whether a layout is tq3's keys: 64 channels, [0, 32) at 4 bits and [32, 64) 3-bit blocks of 4 (dot_rows4's `mixed`) */
static int tq3_keys(const cb_layout *L) {
    const cb_part *A = &L->part[0], *B = &L->part[1];
    return L->n_parts == 2 && L->d == 64 && !A->block && A->bits == 4 && A->hi == 32 && B->block && B->bits == 3;
}

static void dot_heads(const cb_part *P, const uint8_t *rows, const uint8_t *const *tiles, int64_t row_bytes, int64_t count, int b0, int nb, int tail,
                      const float *qb, int64_t qs, int add, float *out, int64_t out_stride, int bits, int gh,
                      const cb_ahead *ahead, int n_ahead) {
#define DOT_CASE(B, VQ) switch (gh) { \
        case 1: dot_block(P, rows, tiles, row_bytes, count, b0, nb, tail, qb, qs, add, out, out_stride, B, 1, VQ); break; \
        case 2: dot_block(P, rows, tiles, row_bytes, count, b0, nb, tail, qb, qs, add, out, out_stride, B, 2, VQ); break; \
        case 3: dot_block(P, rows, tiles, row_bytes, count, b0, nb, tail, qb, qs, add, out, out_stride, B, 3, VQ); break; \
        default: dot_block(P, rows, tiles, row_bytes, count, b0, nb, tail, qb, qs, add, out, out_stride, B, 4, VQ); break; }
    const int rows4 = !P->block && bits == 4 && nb == 4 && tail == 16;   /* 64 channels at 4 bits (tq4's keys) */
    if (!rows4) ask_ahead(ahead, n_ahead, 0, 16);   /* all of `ahead` at the start; dot_rows4 a share with each 16 rows */
    if (P->block) {   /* +vq: 2 or 3 bits */
        if (bits == 2) {
            DOT_CASE(2, 1)
        } else {
            DOT_CASE(3, 1)
        }
        return;
    }
    if (rows4) {   /* the counts constants */
        switch (gh) {
            case 1: dot_rows4(P, NULL, rows, tiles, row_bytes, count, b0, qb, qs, add, out, out_stride, ahead, n_ahead, 1, 0); break;
            case 2: dot_rows4(P, NULL, rows, tiles, row_bytes, count, b0, qb, qs, add, out, out_stride, ahead, n_ahead, 2, 0); break;
            case 3: dot_rows4(P, NULL, rows, tiles, row_bytes, count, b0, qb, qs, add, out, out_stride, ahead, n_ahead, 3, 0); break;
            default: dot_rows4(P, NULL, rows, tiles, row_bytes, count, b0, qb, qs, add, out, out_stride, ahead, n_ahead, 4, 0); break;
        }
        return;
    }
    switch (bits) {
        case 1: DOT_CASE(1, 0) break;
        case 2: DOT_CASE(2, 0) break;
        case 3: DOT_CASE(3, 0) break;
        case 4: DOT_CASE(4, 0) break;
        default: DOT_CASE(5, 0) break;
    }
#undef DOT_CASE
}

/* ---- many queries (a prompt chunk's call): each sixteen rows decoded once ------------------------------------------
 * The register reads above unpack a row's codes once for up to four queries. A call with MANY_QUERIES or more decodes
 * each sixteen rows once for all of them (kvlab_cb_decode_rows: the same values), then
 *   dots  of tq4's keys (64 channels at 4 bits) and tq3's (dot_rows4's `mixed`): the tile transposed, keys in lanes.
 *         Lane j of block b of the register read is one vector over the sixteen rows; its four products are chained
 *         in block order as row_partials chains them and the sixteen lane sums added by the fold's tree (lane j and
 *         j + 8, then j + 4, j + 2, j + 1: _mm512_reduce_add_ps's order too), so each score is the register read's to
 *         the bit, without a fold per query. The last rows of a read (fewer than sixteen) of tq3's keys sum blocks
 *         0-1 and 2-3 apart, as dot_rows4's last rows do;
 *   mix   of any register layout of 64-channel rows: each row loaded once for four queries, each channel's sum in
 *         row order as mix_block's. */
#define MANY_QUERIES 8

/* the channel in lane j of block b of the register read of tq4's keys (4-bit blocks: block4_order) or, `mixed`, of
 * tq3's (blocks 0-1 at 4 bits, 2-3 +vq quads in order) */
CB_INLINE int lane_channel(int b, int j, const int mixed) { return 16 * b + (mixed && b >= 2 ? j : (j >> 1) + 8 * (j & 1)); }

/* sixteen lane sums added by the fold's tree */
CB_INLINE __m512 lane_tree(const __m512 *s8) {   /* s8[j] = p[j] + p[j + 8] */
    const __m512 t0 = _mm512_add_ps(s8[0], s8[4]), t1 = _mm512_add_ps(s8[1], s8[5]), t2 = _mm512_add_ps(s8[2], s8[6]),
                 t3 = _mm512_add_ps(s8[3], s8[7]);
    return _mm512_add_ps(_mm512_add_ps(t0, t2), _mm512_add_ps(t1, t3));
}

/* the chain of lane j over blocks [b0, b1) for query q (64 channels in order), kt the tile transposed (kt[c * 16 + r]) */
CB_INLINE __m512 lane_chain(const float *kt, const float *q, int j, const int b0, const int b1, const int mixed) {
    int c = lane_channel(b0, j, mixed);
    __m512 p = _mm512_mul_ps(_mm512_set1_ps(q[c]), _mm512_loadu_ps(kt + 16 * c));
#pragma GCC unroll 4
    for (int b = b0 + 1; b < b1; b++) {
        c = lane_channel(b, j, mixed);
        p = _mm512_fmadd_ps(_mm512_set1_ps(q[c]), _mm512_loadu_ps(kt + 16 * c), p);
    }
    return p;
}

/* the scores of sixteen rows (kt transposed) for `nq` (1 or 2, a constant) queries, blocks [b0, b1) */
CB_INLINE void lane_scores(const float *kt, const float *q0, const float *q1, const int nq, const int b0, const int b1,
                           const int mixed, __m512 *out) {
    __m512 s[2][8];
#pragma GCC unroll 8
    for (int j = 0; j < 8; j++) {
        s[0][j] = _mm512_add_ps(lane_chain(kt, q0, j, b0, b1, mixed), lane_chain(kt, q0, j + 8, b0, b1, mixed));
        if (nq == 2) s[1][j] = _mm512_add_ps(lane_chain(kt, q1, j, b0, b1, mixed), lane_chain(kt, q1, j + 8, b0, b1, mixed));
    }
    out[0] = lane_tree(s[0]);
    if (nq == 2) out[1] = lane_tree(s[1]);
}

/* out[h * out_stride + r] = q_h . value(row r) for every head (q_stride apart), r < count, of tq4's or (`mixed`) tq3's
 * keys: sixteen rows decoded and transposed once, then scored with keys in lanes, two heads at a time */
CB_INLINE void dot_many(const cb_layout *L, const uint8_t *rows, const uint8_t *const *tiles, int64_t row_bytes, int64_t count,
                        const float *q, int64_t q_stride, int heads, float *out, int64_t out_stride, const cb_ahead *ahead,
                        int n_ahead, const int mixed) {
    float tile[CB_TILE * 64], kt[64 * CB_TILE];
    for (int64_t r = 0; r < count; r += CB_TILE) {   /* sixteen rows, one tile */
        const int n = count - r < CB_TILE ? (int)(count - r) : CB_TILE;
        ask_ahead(ahead, n_ahead, r, count);
        kvlab_cb_decode_rows(L, row_at(rows, tiles, row_bytes, r), row_bytes, n, tile, 64);
        if (n < CB_TILE) memset(tile + n * 64, 0, sizeof(float) * (size_t)(CB_TILE - n) * 64);   /* scored, not stored */
        kvlab_transpose_tile(tile, 64, kt);
        const __mmask16 live = lanes(n);
        for (int h = 0; h < heads; h += 2) {
            const float *q0 = q + h * q_stride, *q1 = q0 + q_stride;
            __m512 s[2];
            if (mixed && n < CB_TILE) {   /* dot_rows4's last rows: the 4-bit blocks' sums, then the +vq quads' added */
                __m512 rest[2];
                if (h + 1 < heads) lane_scores(kt, q0, q1, 2, 0, 2, 1, s), lane_scores(kt, q0, q1, 2, 2, 4, 1, rest);
                else lane_scores(kt, q0, q0, 1, 0, 2, 1, s), lane_scores(kt, q0, q0, 1, 2, 4, 1, rest);
                s[0] = _mm512_add_ps(s[0], rest[0]), s[1] = _mm512_add_ps(s[1], rest[1]);
            } else if (h + 1 < heads) {
                lane_scores(kt, q0, q1, 2, 0, 4, mixed, s);
            } else {
                lane_scores(kt, q0, q0, 1, 0, 4, mixed, s);
            }
            _mm512_mask_storeu_ps(out + h * out_stride + r, live, s[0]);
            if (h + 1 < heads) _mm512_mask_storeu_ps(out + (h + 1) * out_stride + r, live, s[1]);
        }
    }
}

/* acc[h][0 .. 64) += sum_r w[h][r] tile row r, r < count (rows 64 floats apart) for `gh` (a constant, <= 4) heads */
CB_INLINE void mix_decoded(const float *tile, int count, const float *w, int64_t w_stride, float *acc,
                           int64_t acc_stride, const int gh) {
    __m512 a[4][4];
#pragma GCC unroll 4
    for (int h = 0; h < gh; h++)
#pragma GCC unroll 4
        for (int x = 0; x < 4; x++) a[h][x] = _mm512_loadu_ps(acc + h * acc_stride + 16 * x);
    for (int r = 0; r < count; r++) {
        __m512 v[4];
#pragma GCC unroll 4
        for (int x = 0; x < 4; x++) v[x] = _mm512_loadu_ps(tile + r * 64 + 16 * x);
#pragma GCC unroll 4
        for (int h = 0; h < gh; h++) {
            const __m512 wr = _mm512_set1_ps(w[h * w_stride + r]);
#pragma GCC unroll 4
            for (int x = 0; x < 4; x++) a[h][x] = _mm512_fmadd_ps(wr, v[x], a[h][x]);
        }
    }
#pragma GCC unroll 4
    for (int h = 0; h < gh; h++)
#pragma GCC unroll 4
        for (int x = 0; x < 4; x++) _mm512_storeu_ps(acc + h * acc_stride + 16 * x, a[h][x]);
}

/* acc[h] += sum_r w[h][r] value(row r) for every head, d = 64: sixteen rows decoded once, then mixed four heads at a time */
static void mix_many(const cb_layout *L, const uint8_t *rows, const uint8_t *const *tiles, int64_t row_bytes, int64_t count,
                     const float *w, int64_t w_stride, int heads, float *acc, int64_t acc_stride) {
    float tile[CB_TILE * 64];
    for (int64_t r = 0; r < count; r += CB_TILE) {   /* sixteen rows, one tile */
        const int n = count - r < CB_TILE ? (int)(count - r) : CB_TILE;
        kvlab_cb_decode_rows(L, row_at(rows, tiles, row_bytes, r), row_bytes, n, tile, 64);
        for (int h0 = 0; h0 < heads; h0 += 4) {
            const float *wh = w + h0 * w_stride + r;
            float *ah = acc + h0 * acc_stride;
            switch (heads - h0 < 4 ? heads - h0 : 4) {
                case 1: mix_decoded(tile, n, wh, w_stride, ah, acc_stride, 1); break;
                case 2: mix_decoded(tile, n, wh, w_stride, ah, acc_stride, 2); break;
                case 3: mix_decoded(tile, n, wh, w_stride, ah, acc_stride, 3); break;
                default: mix_decoded(tile, n, wh, w_stride, ah, acc_stride, 4); break;
            }
        }
    }
}
#endif

#if defined(__AVX512F__)
/* a part's channels from c0 as a group of blocks: how many (up to four) and the channels in the last */
static void group_of(const cb_part *P, int c0, int *nb, int *tail) {
    const int left = P->hi - P->lo - c0;
    *nb = left >= 64 ? 4 : (left + 15) / 16;
    *tail = left >= 64 ? 16 : left - 16 * (*nb - 1);
}
#endif

/* kvlab_cb_mix_rows over rows + r * row_bytes, or (tiles not NULL) through a block table (row_at) */
static int mix_any(const cb_layout *L, const uint8_t *rows, const uint8_t *const *tiles, int64_t row_bytes, int64_t count,
                   const float *w, int64_t w_stride, int heads, float *acc, int64_t acc_stride) {
#if defined(__AVX512F__)
    if (!register_layout(L)) return -1;
    if (heads >= MANY_QUERIES && L->d == 64 && L->dpad == 64) {
        mix_many(L, rows, tiles, row_bytes, count, w, w_stride, heads, acc, acc_stride);
        return 0;
    }
    for (int p = 0; p < L->n_parts; p++) {
        const cb_part *P = &L->part[p];
        if (P->block) {
            const int n_blocks = (P->hi - P->lo) / CB_BLOCK;
            for (int g = 0; g < n_blocks; g += 16)
                for (int h0 = 0; h0 < heads; h0 += 4)
                    mix_group_heads(P, rows, tiles, row_bytes, count, w + h0 * w_stride, w_stride, acc + h0 * acc_stride, acc_stride,
                                    g, n_blocks - g < 16 ? n_blocks - g : 16, heads - h0 < 4 ? heads - h0 : 4);
            continue;
        }
        for (int c0 = 0; c0 < P->hi - P->lo; c0 += 64) {
            int nb, tail;
            group_of(P, c0, &nb, &tail);
            for (int h0 = 0; h0 < heads; h0 += 4)
                mix_heads(P, rows, tiles, row_bytes, count, w + h0 * w_stride, w_stride, acc + h0 * acc_stride, acc_stride,
                          c0 / 16, nb, tail, P->bits, heads - h0 < 4 ? heads - h0 : 4);
        }
    }
    return 0;
#else
    (void)L, (void)rows, (void)tiles, (void)row_bytes, (void)count, (void)w, (void)w_stride, (void)heads, (void)acc, (void)acc_stride;
    return -1;
#endif
}

int kvlab_cb_mix_rows(const cb_layout *L, const uint8_t *rows, int64_t row_bytes, int64_t count, const float *w,
                      int64_t w_stride, int heads, float *acc, int64_t acc_stride) {
    return mix_any(L, rows, NULL, row_bytes, count, w, w_stride, heads, acc, acc_stride);
}

int kvlab_cb_mix_tiles(const cb_layout *L, const uint8_t *const *tiles, int64_t row_bytes, int64_t count, const float *w,
                       int64_t w_stride, int heads, float *acc, int64_t acc_stride) {
    return mix_any(L, NULL, tiles, row_bytes, count, w, w_stride, heads, acc, acc_stride);
}

/* kvlab_cb_dot_rows over rows + r * row_bytes, or (tiles not NULL) through a block table (row_at) */
static int dot_any(const cb_layout *L, const uint8_t *rows, const uint8_t *const *tiles, int64_t row_bytes, int64_t count,
                   const float *q, int64_t q_stride, int heads, float *out, int64_t out_stride, const cb_ahead *ahead, int n_ahead) {
#if defined(__AVX512F__)
    if (!register_layout(L)) return -1;
    if (heads >= MANY_QUERIES && L->d == 64 && L->dpad == 64 && (tq3_keys(L) || rows4_keys(L))) {
        if (tq3_keys(L)) dot_many(L, rows, tiles, row_bytes, count, q, q_stride, heads, out, out_stride, ahead, n_ahead, 1);
        else dot_many(L, rows, tiles, row_bytes, count, q, q_stride, heads, out, out_stride, ahead, n_ahead, 0);
        return 0;
    }
    float qb[4 * 64];   /* up to four heads' 64 channels, in block order (+vq: in order) */
    for (int h0 = 0; h0 < heads; h0 += 4) {
        const int gh = heads - h0 < 4 ? heads - h0 : 4;
        if (tq3_keys(L)) {   /* both parts in one pass, one fold of the sixteen rows' partials */
            for (int h = 0; h < gh; h++)
                for (int b = 0; b < 4; b++) {
                    const __m512 x = _mm512_loadu_ps(q + (h0 + h) * q_stride + 16 * b);
                    _mm512_storeu_ps(qb + h * 64 + 16 * b, b < 2 ? _mm512_permutexvar_ps(block4_order(), x) : x);
                }
            const cb_ahead *first = h0 == 0 ? ahead : NULL;   /* the one pass that asks for the runs ahead */
            switch (gh) {
#define MIXED_CASE(GH) dot_rows4(&L->part[0], &L->part[1], rows, tiles, row_bytes, count, 0, qb, 64, 0, out + h0 * out_stride, \
                                 out_stride, first, first ? n_ahead : 0, GH, 1)
                case 1: MIXED_CASE(1); break;
                case 2: MIXED_CASE(2); break;
                case 3: MIXED_CASE(3); break;
                default: MIXED_CASE(4); break;
#undef MIXED_CASE
            }
            continue;
        }
        for (int p = 0; p < L->n_parts; p++) {
            const cb_part *P = &L->part[p];
            if (P->block) {   /* groups of up to 16 blocks of 4 coordinates (zero past the part) */
                const int n_blocks = (P->hi - P->lo) / CB_BLOCK;
                for (int g = 0; g < n_blocks; g += 16) {
                    const int n = n_blocks - g < 16 ? n_blocks - g : 16;
                    for (int h = 0; h < gh; h++)
                        for (int k = 0; k < 4; k++)
                            _mm512_storeu_ps(qb + h * 64 + 16 * k, _mm512_maskz_loadu_ps(4 * k < n ? quad_lanes(n, k) : 0,
                                             q + (h0 + h) * q_stride + P->lo + CB_BLOCK * g + 16 * k));
                    const int first = h0 == 0 && p == 0 && g == 0;   /* the one pass that asks for the runs ahead */
                    dot_heads(P, rows, tiles, row_bytes, count, g, n, 16, qb, 64, p > 0 || g > 0, out + h0 * out_stride, out_stride,
                              P->bits, gh, first ? ahead : NULL, first ? n_ahead : 0);
                }
                continue;
            }
            for (int c0 = 0; c0 < P->hi - P->lo; c0 += 64) {
                int nb, tail;
                group_of(P, c0, &nb, &tail);
                for (int h = 0; h < gh; h++)
                    for (int b = 0; b < nb; b++) {   /* zero past the part (a masked load reads nothing there) */
                        const __m512 x = _mm512_maskz_loadu_ps(lanes(b == nb - 1 ? tail : 16), q + (h0 + h) * q_stride + P->lo + c0 + 16 * b);
                        _mm512_storeu_ps(qb + h * 64 + 16 * b, P->bits == 4 ? _mm512_permutexvar_ps(block4_order(), x) : x);
                    }
                const int first = h0 == 0 && p == 0 && c0 == 0;   /* the one pass that asks for the runs ahead */
                dot_heads(P, rows, tiles, row_bytes, count, c0 / 16, nb, tail, qb, 64, p > 0 || c0 > 0, out + h0 * out_stride,
                          out_stride, P->bits, gh, first ? ahead : NULL, first ? n_ahead : 0);
            }
        }
    }
    return 0;
#else
    (void)L, (void)rows, (void)tiles, (void)row_bytes, (void)count, (void)q, (void)q_stride, (void)heads, (void)out, (void)out_stride;
    (void)ahead, (void)n_ahead;
    return -1;
#endif
}

int kvlab_cb_dot_rows(const cb_layout *L, const uint8_t *rows, int64_t row_bytes, int64_t count, const float *q,
                      int64_t q_stride, int heads, float *out, int64_t out_stride, const cb_ahead *ahead, int n_ahead) {
    return dot_any(L, rows, NULL, row_bytes, count, q, q_stride, heads, out, out_stride, ahead, n_ahead);
}

int kvlab_cb_dot_tiles(const cb_layout *L, const uint8_t *const *tiles, int64_t row_bytes, int64_t count, const float *q,
                       int64_t q_stride, int heads, float *out, int64_t out_stride, const cb_ahead *ahead, int n_ahead) {
    return dot_any(L, NULL, tiles, row_bytes, count, q, q_stride, heads, out, out_stride, ahead, n_ahead);
}

/* index of the first of n = 2^k - 1 increasing bounds >= y (n when none is): torch.bucketize(y, bounds, right=False) */
static int bucket(const float *bounds, int n, float y) {
    int lo = 0;   /* n = 2^bits - 1: halving steps of 2^(bits-1) .. 1, each a conditional move, not a branch */
    for (int step = (n + 1) / 2; step > 0; step /= 2) lo += bounds[lo + step - 1] < y ? step : 0;
    return lo;
}

/* code number c of a part into its planes: plane k holds bits [shift, shift + width) at c*width of its bytes */
static void put_code(const cb_part *P, uint8_t *row, int c, int code) {
    for (int k = 0; k < P->n_planes; k++) {
        const int w = P->width[k], bits = (code >> P->shift[k]) & ((1 << w) - 1);
        row[P->offset[k] + (int64_t)c * w / 8] |= (uint8_t)(bits << (c * w % 8));
    }
}

/* the first of the n_points points (CB_BLOCK coordinates each) with the highest 2<a, p> - |p|^2 (a = |y|), -inf and
 * nan scores passed over: the point's index, 0 when none scores above -inf. Each score is summed from the first
 * coordinate on, one rounding per multiply-add, the same bits in the scalar loop and in the sixteen lanes. */
static int nearest_point(const float *points, int n_points, const float *a) {
#if defined(__AVX512F__)
    if (n_points % 16 == 0 && n_points <= 256) {   /* sixteen points a time, their coordinates turned into lanes */
        static const int32_t XY[16] = {0, 4, 8, 12, 16, 20, 24, 28, 1, 5, 9, 13, 17, 21, 25, 29};
        static const int32_t LO[16] = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
        const __m512i xy = _mm512_loadu_si512(XY), zw = _mm512_add_epi32(xy, _mm512_set1_epi32(2));
        const __m512i lo = _mm512_loadu_si512(LO), hi = _mm512_add_epi32(lo, _mm512_set1_epi32(8));
        const __m512 a0 = _mm512_set1_ps(a[0]), a1 = _mm512_set1_ps(a[1]), a2 = _mm512_set1_ps(a[2]), a3 = _mm512_set1_ps(a[3]);
        float scores[256];
        __m512 top = _mm512_set1_ps(-INFINITY);
        for (int i = 0; i < n_points; i += 16) {
            const float *p = points + i * CB_BLOCK;   /* (16, 4): points i .. i + 15 */
            const __m512 xy01 = _mm512_permutex2var_ps(_mm512_loadu_ps(p), xy, _mm512_loadu_ps(p + 16));
            const __m512 xy23 = _mm512_permutex2var_ps(_mm512_loadu_ps(p + 32), xy, _mm512_loadu_ps(p + 48));
            const __m512 zw01 = _mm512_permutex2var_ps(_mm512_loadu_ps(p), zw, _mm512_loadu_ps(p + 16));
            const __m512 zw23 = _mm512_permutex2var_ps(_mm512_loadu_ps(p + 32), zw, _mm512_loadu_ps(p + 48));
            const __m512 p0 = _mm512_permutex2var_ps(xy01, lo, xy23), p1 = _mm512_permutex2var_ps(xy01, hi, xy23);
            const __m512 p2 = _mm512_permutex2var_ps(zw01, lo, zw23), p3 = _mm512_permutex2var_ps(zw01, hi, zw23);
            __m512 cross = _mm512_mul_ps(a0, p0), norm = _mm512_mul_ps(p0, p0);
            cross = _mm512_fmadd_ps(a1, p1, cross), norm = _mm512_fmadd_ps(p1, p1, norm);
            cross = _mm512_fmadd_ps(a2, p2, cross), norm = _mm512_fmadd_ps(p2, p2, norm);
            cross = _mm512_fmadd_ps(a3, p3, cross), norm = _mm512_fmadd_ps(p3, p3, norm);
            const __m512 score = _mm512_fmsub_ps(cross, _mm512_set1_ps(2.0f), norm);
            _mm512_storeu_ps(scores + i, score);
            top = _mm512_max_ps(score, top);   /* a nan score keeps top (MAXPS returns its second operand) */
        }
        const float best = _mm512_reduce_max_ps(top);
        if (best == -INFINITY) return 0;
        for (int i = 0; i < n_points; i += 16) {
            const __mmask16 at = _mm512_cmp_ps_mask(_mm512_loadu_ps(scores + i), _mm512_set1_ps(best), _CMP_EQ_OQ);
            if (at) return i + __builtin_ctz(at);
        }
        return 0;
    }
#endif
    int best = 0;
    float best_score = -INFINITY;
    for (int i = 0; i < n_points; i++) {
        const float *point = points + i * CB_BLOCK;
        float cross = 0.0f, norm = 0.0f;
        for (int j = 0; j < CB_BLOCK; j++) {   /* with FMA (-march=native), a multiply-add each: the lanes' bits */
            cross += a[j] * point[j];
            norm += point[j] * point[j];
        }
        const float score = 2.0f * cross - norm;
        if (score > best_score) best_score = score, best = i;
    }
    return best;
}

/* the index of block y (CB_BLOCK,) in a block part: its nearest magnitude point << 4 | its sign bits (the argmax of
 * 2<|y|, p> - |p|^2, vector_codebook.nearest_point); y_hat its value */
static int block_index(const cb_part *P, const float *y, float *y_hat) {
    float a[CB_BLOCK];
    for (int j = 0; j < CB_BLOCK; j++) a[j] = fabsf(y[j]);
    const int best = nearest_point(P->table, 1 << (CB_BLOCK * P->bits - CB_BLOCK), a);
    int signs = 0;
    for (int j = 0; j < CB_BLOCK; j++) {
        const float value = P->table[best * CB_BLOCK + j];
        signs |= (y[j] < 0.0f) << j;
        y_hat[j] = y[j] < 0.0f ? -value : value;
    }
    return best << CB_BLOCK | signs;
}

void kvlab_cb_encode_row(const cb_layout *L, const float *bounds, const float *y, uint8_t *row, float *y_hat) {
    for (int p = 0; p < L->n_parts; p++) {
        const cb_part *P = &L->part[p];
        const int n = P->hi - P->lo;
        for (int k = 0; k < P->n_planes; k++) memset(row + P->offset[k], 0, (size_t)(((int64_t)P->n_codes * P->width[k] + 7) / 8));
        if (P->block) {
            for (int b = 0; b < n / CB_BLOCK; b++) {
                const int index = block_index(P, y + P->lo + b * CB_BLOCK, y_hat + P->lo + b * CB_BLOCK);
                if (P->bits == 2) put_code(P, row, b, index);
                else put_code(P, row, 2 * b, index >> 6), put_code(P, row, 2 * b + 1, index & 63);
            }
            continue;
        }
        const int n_bounds = (1 << P->bits) - 1;
        int32_t codes[CB_MAX_DIM];
        if (P->bits <= 5) {   /* each code counts the bounds below its value: every channel's compares at once */
            for (int c = 0; c < n; c++) codes[c] = 0;
            for (int i = 0; i < n_bounds; i++)
                for (int c = 0; c < n; c++) codes[c] += bounds[i] < y[P->lo + c];
        } else
            for (int c = 0; c < n; c++) codes[c] = bucket(bounds, n_bounds, y[P->lo + c]);
        for (int c = 0; c < n; c++) {
            y_hat[P->lo + c] = P->table[codes[c]];
            put_code(P, row, c, codes[c]);
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
    const int in_registers = register_layout(&L);   /* then a work item is a segment, scored in registers */
    const int64_t span = in_registers ? CB_SEGMENT : CB_TILE, tiles = (n + span - 1) / span;
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
                const int64_t t0 = tile * span, count = n - t0 < span ? n - t0 : span;
                if (in_registers) {
                    kvlab_cb_dot_rows(&L, codes + ((int64_t)h * slots + start + t0) * row_bytes, row_bytes, count,
                                      q + (int64_t)h * nq * d, d, nq, out + (int64_t)h * nq * n + t0, n, NULL, 0);
                    continue;
                }
                float *rows = buf, *qpad = buf + (size_t)dpad * CB_TILE;
                kvlab_cb_decode_rows(&L, codes + ((int64_t)h * slots + start + t0) * row_bytes, row_bytes, count, rows, dpad);
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
                if (kvlab_cb_mix_rows(&L, codes + ((int64_t)h * slots + start + s * CB_SEGMENT) * row_bytes, row_bytes,
                                      end - s * CB_SEGMENT, w + (int64_t)h * nq * w_stride + s * CB_SEGMENT, w_stride, nq, acc, dpad) == 0)
                    continue;   /* summed in registers */
                for (int64_t t0 = s * CB_SEGMENT; t0 < end; t0 += CB_TILE) {
                    const int64_t count = end - t0 < CB_TILE ? end - t0 : CB_TILE;
                    kvlab_cb_decode_rows(&L, codes + ((int64_t)h * slots + start + t0) * row_bytes, row_bytes, count, rows, dpad);
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

/* out (heads, n, d) = value(row start + t): a chunk's decoded transient, a tile of rows at a time (dpad apart, then
 * copied out d apart). 0, -1, or -2 (memory). */
int kvlab_codebook_decode(const uint8_t *codes, int heads, int64_t slots, int64_t row_bytes, int64_t start, int64_t n,
                          int d, int n_parts, const int32_t *spec, const float *tables, float *out, int n_threads) {
    cb_layout L;
    if (kvlab_cb_layout(&L, d, n_parts, spec, tables, row_bytes) || check(heads, slots, start, n, 0)) return -1;
    const int64_t tiles = (n + CB_TILE - 1) / CB_TILE;
    int failed = 0;
    #pragma omp parallel num_threads(threads_for((int64_t)heads * n * d, n_threads))
    {
        float *rows = malloc(sizeof(float) * (size_t)L.dpad * CB_TILE);
        if (!rows) {
            #pragma omp atomic write
            failed = 1;
        }
        #pragma omp for schedule(static) collapse(2)
        for (int h = 0; h < heads; h++)
            for (int64_t tile = 0; tile < tiles; tile++) {
                if (!rows) continue;
                const int64_t t0 = tile * CB_TILE, count = n - t0 < CB_TILE ? n - t0 : CB_TILE;
                kvlab_cb_decode_rows(&L, codes + ((int64_t)h * slots + start + t0) * row_bytes, row_bytes, count, rows, L.dpad);
                for (int64_t r = 0; r < count; r++) memcpy(out + ((int64_t)h * n + t0 + r) * d, rows + r * L.dpad, sizeof(float) * d);
            }
        free(rows);
    }
    return failed ? -2 : 0;
}

/* more exported entry points of codebook.h (paged.c's ragged attention over blocks): the routines above */
void kvlab_cb_decode_row(const cb_layout *L, const uint8_t *row, float *out, int32_t *codes) { decode_row(L, row, out, codes); }

void kvlab_cb_dot8(const float *a, const float *rows, int dpad, float *out) { dot8(a, rows, dpad, out); }

void kvlab_cb_axpy_rows(const float *w, const float *rows, int64_t count, float *y, int dpad) { axpy_rows(w, rows, count, y, dpad); }

int kvlab_cb_threads(int64_t work, int n_threads) { return threads_for(work, n_threads); }
