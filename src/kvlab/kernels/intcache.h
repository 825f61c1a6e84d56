/* Queries' attention over one KV head of an integer layer's codes (kvlab/cache/quantized.py), with the rule of
 * QuantizedCache: keys of the groups complete at a query's position read from their codes, the later ones exact.
 * The single cache (intcache.c kvlab_int_attention), the fused decode step (decode.c) and the serving pool (paged.c
 * kvlab_paged_int_attention) all read through kvlab_int_attend, one compiled function: for the same codes and keys a
 * query's output is the same bits, whatever the batch or the block tables. */
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
    const int32_t *table;                     /* position t's slot: table[t / block_size] * block_stride + t % block_size */
    int64_t block_size, block_stride;         /* (the head's rows of its blocks are block_stride apart); NULL: slot t */
    const float *exact;                       /* the exact key of position t >= exact_first: dk floats at */
    int64_t exact_first, exact_stride;        /* exact + (t - exact_first) * exact_stride */
    const float *exact_v;                     /* NULL, or the exact value of position t >= exact_v_first: dv floats at */
    int64_t exact_v_first, exact_v_stride;    /* exact_v + (t - exact_v_first) * exact_v_stride (a recent window's) */
} IntHead;

typedef struct {                              /* one query of a kvlab_int_attend call */
    const float *q;                           /* dk floats */
    float *out;                               /* dv floats */
    int64_t lo, coded, hi;                    /* it reads positions [lo, hi), those below `coded` from their codes */
    int64_t v_coded;                          /* with the head's exact_v: values at or after v_coded exact, not coded */
    float *lse;                               /* NULL, or where the log-sum-exp of its scores goes */
} IntQuery;

#define KVLAB_INT_QUERIES 64                        /* queries per kvlab_int_attend call, at most */
#define KVLAB_INT_MAX_DIM 512                       /* key and value head dims, at most */
#define KVLAB_INT_PAD(d) (((d) + 15) / 16 * 16)     /* channels as the read holds them: whole vectors of sixteen */

/* For each query (nq <= KVLAB_INT_QUERIES, lo < hi): out = Σ_t p_t v_t over positions t in [lo, hi),
 * p = softmax_t(q · k_t · scale): k_t = zero + code × scale per channel of its key group for t < coded, exact (from
 * `exact`) for t >= coded; v_t = zero + code × scale per value group (with the head's exact_v: for t < v_coded, and
 * exact from exact_v after: tokens still in the query's recent window when it came, QuantizedCache +recentN). The queries share each key's and value's
 * decoding; a query's output is the same bits whatever the other queries of the call (its scores, softmax and sums
 * are its own, in a fixed order), except that an int4 call whose queries all read the same positions (a decode step's
 * query heads) reads the codes in registers instead of through tiles (intcache.c int4_registers), rounded apart; a query with `lse` also gets log Σ_t exp(q · k_t · scale), to merge this read with
 * another part of its keys. dk, dv <= KVLAB_INT_MAX_DIM. scratch: kvlab_int_scratch(n, dk, dv) floats, n = the largest hi
 * less the smallest lo. */
void kvlab_int_attend(const IntHead *R, const IntQuery *Q, int nq, float scale, float *scratch);

/* the query of the token at position pos (QuantizedCache's rule): it reads positions (pos - window, pos] (window > 0)
 * or [0, pos], those of the key groups complete at pos from their codes, the rest exact */
static inline IntQuery kvlab_int_query(const float *q, float *out, int64_t pos, int window, int key_group) {
    const int64_t lo = window > 0 && pos - window + 1 > 0 ? pos - window + 1 : 0;
    return (IntQuery){.q = q, .out = out, .lo = lo, .coded = (pos + 1) / key_group * key_group, .hi = pos + 1};
}

static inline int64_t kvlab_int_scratch(int64_t n, int dk, int dv) {
    return KVLAB_INT_QUERIES * (n + KVLAB_INT_PAD(dv) + KVLAB_INT_PAD(dk)) + 65 * KVLAB_INT_PAD(dk) + 32 * KVLAB_INT_PAD(dv);
}
#endif
