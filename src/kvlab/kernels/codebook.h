/* What codebook.c shares with the library's other sources (paged.c reads TurboQuant codes from a block pool):
 * the row layout of b-bit codebook codes and the tile routines that decode and use them. The definitions live
 * in codebook.c (exported wrappers of its own inlined code); see its header comment for the row format. */
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

/* spec: n_parts x (lo, hi, bits) covering [0, d); tables: each part's padded table in turn. 0 when valid and
 * its rows are exactly row_bytes long, else -1. */
int kvlab_cb_layout(cb_layout *L, int d, int n_parts, const int32_t *spec, const float *tables, int64_t row_bytes);
/* out[0 .. dpad) = the row's codebook values, zero past d; codes: dpad ints of scratch */
void kvlab_cb_decode_row(const cb_layout *L, const uint8_t *row, float *out, int32_t *codes);
/* out[r] = a . rows[r] for 8 rows dpad floats apart (a and rows zero past d) */
void kvlab_cb_dot8(const float *a, const float *rows, int dpad, float *out);
/* y[0 .. dpad) += sum_r w[r] rows[r] over `count` rows dpad floats apart */
void kvlab_cb_axpy_rows(const float *w, const float *rows, int64_t count, float *y, int dpad);
/* threads for a call of `work` multiply-adds: one below a threshold (a parallel region costs more) */
int kvlab_cb_threads(int64_t work, int n_threads);
#endif
