/* What codebook.c shares with the rest of the library: a row's code layout, and decoding / coding / using whole
 * rows with it (decode.c's fused step on TurboQuant caches; paged.c's ragged attention over TurboQuant blocks).
 * The definitions live in codebook.c (exported wrappers of its own inlined code); see it for the packing. */
#ifndef KVLAB_CODEBOOK_H
#define KVLAB_CODEBOOK_H
#include <stdint.h>

#define CB_MAX_PARTS 4
#define CB_MAX_DIM 1024
#define CB_TILE 16          /* rows decoded at once */

#define CB_BLOCK 4          /* +vq: coordinates coded together in a block part */

typedef struct {
    int lo, hi, bits, n_planes;
    int block;              /* 1: a block part (+vq, 2 or 3 bits): each block of CB_BLOCK channels is one 4·bits-bit
                               index, (magnitude point << 4) | sign bits (bit j: channel j negative), packed as
                               n/4 8-bit codes (2 bits) or n/2 6-bit halves, high half first (3 bits) */
    int n_codes, code_bits; /* the packed codes of the planes: n channels at `bits` (scalar), as above (block) */
    int width[4], shift[4];
    int64_t offset[4];      /* byte offset of each plane in a row */
    const float *table;     /* scalar: centroids, padded to max(16, 2^bits) entries; block: 2^(4·bits-4) points x 4 */
} cb_part;

typedef struct {
    int n_parts, d, dpad;   /* dpad: d rounded up to 16, the stride of decoded rows */
    cb_part part[CB_MAX_PARTS];
} cb_layout;

/* spec: n_parts x (lo, hi, bits, block), parts in channel order covering [0, d); tables: each part's table
 * (padded centroids, or a block part's points) in turn. 0 when the layout is valid and its rows are exactly row_bytes long, else -1. */
int kvlab_cb_layout(cb_layout *L, int d, int n_parts, const int32_t *spec, const float *tables, int64_t row_bytes);

/* out + r * stride (stride >= d) = the values of row r of `rows` (count rows, row_bytes apart), r < count.
 * Each row writes dpad floats (zeros past d): the buffer needs dpad - d floats of room after the last row. */
void kvlab_cb_decode_rows(const cb_layout *L, const uint8_t *rows, int64_t row_bytes, int64_t count, float *out, int64_t stride);

/* acc[h * acc_stride + c] += sum_r w[h * w_stride + r] value(row r)[c] for h < heads, c < d, r < count: the rows decoded
 * in registers (a call of many heads at d = 64: each sixteen rows decoded once for all of them; each sum the same bits
 * either way). 0, or -1 where this build or layout has no such path (the caller decodes rows into a tile instead). */
int kvlab_cb_mix_rows(const cb_layout *L, const uint8_t *rows, int64_t row_bytes, int64_t count, const float *w,
                      int64_t w_stride, int heads, float *acc, int64_t acc_stride);

/* Rows a read asks for ahead of their use: `count` rows `row_bytes` apart from `rows`, or (tiles not NULL) row j at
 * tiles[j / CB_TILE] + (j % CB_TILE) * row_bytes */
typedef struct {
    const uint8_t *rows;
    int64_t row_bytes, count;
    const uint8_t *const *tiles;
} cb_ahead;

/* out[h * out_stride + r] = q_h . value(row r) for h < heads, r < count (q_h at q + h * q_stride, d floats): the rows
 * decoded in registers, sixteen rows' dots summed at once. The n_ahead runs of `ahead` are asked for meanwhile (a
 * share with each sixteen rows where the layout is 64 channels at 4 bits or tq3's keys (32 channels at 4 bits beside 8
 * blocks of 4 at 3 bits, scored in one pass), so the loads overlap the arithmetic instead
 * of stalling in one burst; else all at the start). A call of many heads over those two layouts decodes each sixteen
 * rows once and scores them with the keys in lanes, the same bits as a call of one. 0, or -1 where this build or layout
 * has no such path (the caller decodes rows into a tile instead). */
int kvlab_cb_dot_rows(const cb_layout *L, const uint8_t *rows, int64_t row_bytes, int64_t count, const float *q,
                      int64_t q_stride, int heads, float *out, int64_t out_stride, const cb_ahead *ahead, int n_ahead);

/* kvlab_cb_dot_rows and kvlab_cb_mix_rows over rows read through a block table: row r at tiles[r / CB_TILE] +
 * (r % CB_TILE) * row_bytes (a pool's blocks of CB_TILE rows), the queries / accumulators held in registers across the
 * tiles; -1 where the layout is not read in registers (the caller reads the tiles one by one otherwise) */
int kvlab_cb_dot_tiles(const cb_layout *L, const uint8_t *const *tiles, int64_t row_bytes, int64_t count, const float *q,
                       int64_t q_stride, int heads, float *out, int64_t out_stride, const cb_ahead *ahead, int n_ahead);
int kvlab_cb_mix_tiles(const cb_layout *L, const uint8_t *const *tiles, int64_t row_bytes, int64_t count, const float *w,
                       int64_t w_stride, int heads, float *acc, int64_t acc_stride);

/* Code one vector y (d,): each channel's code is the number of its part's boundaries below y (torch.bucketize,
 * right=False; `bounds`: each scalar part's 2^bits - 1 increasing boundaries in turn, none for a block part), a
 * block's the nearest magnitude point (argmax of 2<|y|, p> - |p|^2, the first on ties) and the signs of y,
 * packed into `row` as kvlab/cache/packing.py packs it; y_hat (d,) = the codes' values. */
void kvlab_cb_encode_row(const cb_layout *L, const float *bounds, const float *y, uint8_t *row, float *y_hat);

/* out[0 .. dpad) = one row's codebook values, zero past d; codes: dpad ints of scratch */
void kvlab_cb_decode_row(const cb_layout *L, const uint8_t *row, float *out, int32_t *codes);
/* out[r] = a . rows[r] for 8 rows dpad floats apart (a and rows zero past d) */
void kvlab_cb_dot8(const float *a, const float *rows, int dpad, float *out);
/* y[0 .. dpad) += sum_r w[r] rows[r] over `count` rows dpad floats apart */
void kvlab_cb_axpy_rows(const float *w, const float *rows, int64_t count, float *y, int dpad);
/* threads for a call of `work` multiply-adds: one below a threshold (a parallel region costs more) */
int kvlab_cb_threads(int64_t work, int n_threads);
#endif
