/* The block GEMV's row kernels, shared by blockgemv.c (one matrix-vector product per call) and decode.c
 * (a whole decode step per call). */
#ifndef KVLAB_BLOCKGEMV_H
#define KVLAB_BLOCKGEMV_H
#include <stdint.h>

enum { F32 = 0, Q4_0 = 2, Q4_1 = 3, Q8_0 = 8 };   /* GGML type ids */
#define QK 32                                      /* weights per block */

/* bytes of one 32-weight block of `type` (0 for a type without blocks) */
int kvlab_block_bytes(int type);
/* sums[b] = x[32b] + ... + x[32b + 31], b < cols / 32: what the Q4_0/Q4_1 row dot needs for its offsets */
void kvlab_block_sums(const float *x, int64_t cols, float *sums);
/* one row of `nblocks` blocks . x; xsum from kvlab_block_sums (unused by Q8_0) */
float kvlab_block_row_dot(int type, const uint8_t *row, const float *x, const float *xsum, int64_t nblocks);
#endif
