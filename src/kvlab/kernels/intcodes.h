/* The integer KV cache's packed code rows (kvlab/cache/packing.py), read and written: what intcache.c (attention over
 * int8/int4 codes) and decode.c (the fused step's integer layers, any width 1..8) share.
 *
 * A width that divides 8 (1, 2, 4, 8) packs 8/b codes per byte, low bits first: code c sits in byte c*b/8 at bit
 * (c*b) % 8. Other widths are bit planes, widest first (3 = 2 + 1, 5 = 4 + 1, 6 = 4 + 2, 7 = 4 + 2 + 1): the plane of
 * width w holds bits [s, s + w) of every code packed like a w-bit code, ceil(d*w/8) bytes, and the planes follow each
 * other in the row. */
#ifndef KVLAB_INTCODES_H
#define KVLAB_INTCODES_H
#include <stdint.h>
#include <string.h>

/* bytes of one row of d codes of `bits` bits (packing.packed_nbytes) */
static inline int64_t int_row_bytes(int bits, int d) {
    int64_t bytes = 0;
    for (int w = 8; w >= 1; w /= 2)
        if (bits & w) bytes += ((int64_t)d * w + 7) / 8;
    return bytes;
}

/* code c of a packed row of d codes */
static inline int int_code_at(const uint8_t *row, int bits, int d, int c) {
    if (bits == 8) return row[c];
    if (bits == 4) return (row[c >> 1] >> ((c & 1) * 4)) & 0x0f;
    int code = 0, shift = bits;
    int64_t offset = 0;
    for (int w = 8; w >= 1; w /= 2) {
        if (!(bits & w)) continue;
        shift -= w;
        const int64_t bit = (int64_t)c * w;
        code |= ((row[offset + bit / 8] >> (bit % 8)) & ((1 << w) - 1)) << shift;
        offset += ((int64_t)d * w + 7) / 8;
    }
    return code;
}

/* codes (d,) = every code of a packed row */
static inline void int_unpack_row(const uint8_t *row, int bits, int d, uint8_t *codes) {
    if (bits == 8) {
        memcpy(codes, row, (size_t)d);
    } else if (bits == 4) {
        for (int j = 0; j < d / 2; j++) {
            codes[2 * j] = row[j] & 0x0f;
            codes[2 * j + 1] = row[j] >> 4;
        }
        if (d % 2) codes[d - 1] = row[d / 2] & 0x0f;
    } else {
        for (int c = 0; c < d; c++) codes[c] = (uint8_t)int_code_at(row, bits, d, c);
    }
}

/* row (int_row_bytes(bits, d),) = the d codes packed (each code < 2^bits) */
static inline void int_pack_row(const uint8_t *codes, int bits, int d, uint8_t *row) {
    memset(row, 0, (size_t)int_row_bytes(bits, d));
    int shift = bits;
    int64_t offset = 0;
    for (int w = 8; w >= 1; w /= 2) {
        if (!(bits & w)) continue;
        shift -= w;
        for (int c = 0; c < d; c++) {
            const int64_t bit = (int64_t)c * w;
            row[offset + bit / 8] |= (uint8_t)(((codes[c] >> shift) & ((1 << w) - 1)) << (bit % 8));
        }
        offset += ((int64_t)d * w + 7) / 8;
    }
}
#endif
