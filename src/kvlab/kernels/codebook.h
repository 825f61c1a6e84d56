/* What codebook.c shares with the rest of the library: a row's code layout, and decoding / coding / using whole
 * rows with it (decode.c's fused step on TurboQuant caches; paged.c's ragged attention over TurboQuant blocks).
 * The definitions live in codebook.c (exported wrappers of its own inlined code); see it for the packing. */
#ifndef KVLAB_CODEBOOK_H
#define KVLAB_CODEBOOK_H
#include <stdint.h>

#define CB_MAX_PARTS 4
#define CB_MAX_DIM 1024
#define CB_TILE 16          /* rows decoded at once */

typedef struct {
    int lo, hi, bits, n_planes;
    int width[4], shift[4];
    int64_t offset[4];      /* byte offset of each plane in a row */
    const float *table;     /* centroids, padded to max(16, 2^bits) entries */
} cb_part;

typedef struct {
    int n_parts, d, dpad;   /* dpad: d rounded up to 16, the stride of decoded rows */
    cb_part part[CB_MAX_PARTS];
} cb_layout;

/* spec: n_parts x (lo, hi, bits), parts in channel order covering [0, d); tables: each part's padded table in
 * turn. 0 when the layout is valid and its rows are exactly row_bytes long, else -1. */
int kvlab_cb_layout(cb_layout *L, int d, int n_parts, const int32_t *spec, const float *tables, int64_t row_bytes);

/* out + r * stride (stride >= d) = the values of row r of `rows` (count rows, row_bytes apart), r < count.
 * Each row writes dpad floats (zeros past d): the buffer needs dpad - d floats of room after the last row. */
void kvlab_cb_decode_rows(const cb_layout *L, const uint8_t *rows, int64_t row_bytes, int64_t count, float *out, int64_t stride);

/* acc[h * acc_stride + c] += sum_r w[h * w_stride + r] value(row r)[c] for h < heads, c < d, r < count: the rows decoded
 * in registers. 0, or -1 where this build or layout has no such path (the caller decodes rows into a tile instead). */
int kvlab_cb_mix_rows(const cb_layout *L, const uint8_t *rows, int64_t row_bytes, int64_t count, const float *w,
                      int64_t w_stride, int heads, float *acc, int64_t acc_stride);

/* out[h * out_stride + r] = q_h . value(row r) for h < heads, r < count (q_h at q + h * q_stride, d floats): the rows
 * decoded in registers, sixteen rows' dots summed at once. 0, or -1 where this build or layout has no such path (the
 * caller decodes rows into a tile instead). */
int kvlab_cb_dot_rows(const cb_layout *L, const uint8_t *rows, int64_t row_bytes, int64_t count, const float *q,
                      int64_t q_stride, int heads, float *out, int64_t out_stride);

/* Code one vector y (d,): each channel's code is the number of its part's boundaries below y (torch.bucketize,
 * right=False; `bounds`: each part's 2^bits - 1 increasing boundaries in turn), packed into `row` as
 * kvlab/cache/packing.py packs it; y_hat (d,) = the codes' centroids. */
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
