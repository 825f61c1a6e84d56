/* One query's attention over one KV head of an integer layer's codes (kvlab/cache/quantized.py), with the rule of
 * QuantizedCache: keys of the groups complete at the query's position read from their codes, the later ones exact.
 * The single cache (intcache.c kvlab_int_attention) and the serving pool (paged.c kvlab_paged_int_attention) both
 * read through kvlab_int_attend, one compiled function: for the same codes and keys their outputs are the same bits,
 * whatever the batch, the chunking or the block tables. */
#ifndef KVLAB_INTCACHE_H
#define KVLAB_INTCACHE_H
#include <stdint.h>

typedef struct {
    int bits, dk, dv, key_group, value_group;
    const uint8_t *k_codes, *v_codes;         /* slot s's packed row at codes + s * row_stride (bytes) */
    int64_t k_row_stride, v_row_stride;
    const uint16_t *k_scale, *k_zero;         /* fp16: key group s / key_group's dk values at + (s / key_group) * k_meta_stride */
    int64_t k_meta_stride;
    const uint16_t *v_scale, *v_zero;         /* fp16: slot s's dv / value_group values at + s * v_meta_stride */
    int64_t v_meta_stride;
    const int32_t *table;                     /* position t's slot: table[t / block_size] * block_size + t % block_size; */
    int64_t block_size;                       /* NULL: slot t */
    const float *exact;                       /* the exact key of position t >= exact_first: dk floats at */
    int64_t exact_first, exact_stride;        /* exact + (t - exact_first) * exact_stride */
} IntHead;

/* out (dv,) = Σ_t p_t v_t over positions t in [lo, hi), p = softmax_t(q · k_t · scale): k_t from its codes for
 * t < coded (zero + code × scale, read as the query folded into the group's scales), exact from `exact` for
 * t >= coded; v_t = zero + code × scale per value group, read as Σ_t (p_t scale_t) code_t + Σ_t p_t zero_t.
 * scratch: hi - lo floats. lo < hi. */
void kvlab_int_attend(const IntHead *R, const float *q, int64_t lo, int64_t coded, int64_t hi, float scale,
                      float *scratch, float *out);
#endif
