/* TurboQuant codes as the C code holds them (kvlab/cache/turboquant.py; described by kvlab/cache/tq_kernel.py):
 * decode.c codes a layer's tokens and reads a single cache's, paged.c reads and runs a serving pool's layers
 * (kvlab/serve/coded.py TurboPool), batchstep.c runs every layer of an engine step over such a pool. */
#ifndef KVLAB_TQCODES_H
#define KVLAB_TQCODES_H
#include <stdint.h>

#include "codebook.h"
#include "paged.h"

typedef struct {                   /* one KV head's key or value codes in a TurboQuant layer: its width's packing */
    int64_t at;                    /* byte offset of the head's slot 0 in `codes` */
    int64_t row_bytes;             /* bytes of one of its rows */
    int32_t n_parts;
    const int32_t *spec;           /* n_parts x (lo, hi, bits, block) (codebook.h) */
    const float *tables;           /* each part's centroids, padded, or its block points (codebook.c) */
    const float *bounds;           /* each scalar part's 2^bits - 1 boundaries in turn */
} HeadCodes;

typedef struct {                   /* a TurboQuant layer's codes (kvlab/cache/turboquant.py); [0] keys, [1] values */
    int32_t slots;                 /* coded rows per KV head: n_blocks x block_rows */
    int32_t norm_type;             /* KV_F16, KV_BF16 or NORM_LOG8 */
    uint8_t *codes[2];             /* (n_blocks, Hkv, block_rows, row_bytes), or (n_blocks, 1, block_rows, Σ heads' row
                                      bytes) with +halloc (kvlab/cache/blocks.py TqBlocks) */
    void *norms[2];                /* (n_blocks, Hkv, block_rows): the stored scales, 16-bit, or uint8 log codes (NORM_LOG8) */
    const uint16_t *norm_centres[2];  /* NORM_LOG8: (Hkv,) f16 log2 centre of each head's codes, else NULL */
    int64_t slot_bytes[2];         /* bytes from one row of a head to its next */
    const HeadCodes *heads[2];     /* (Hkv,): each head's packing (one width for all but with +halloc) */
    int32_t scale_mode[2];
    const float *rotation;         /* (hd, hd) M: the rotated vector is y = x M */
    const uint8_t *offset[2];      /* (Hkv, hd) float8 e4m3 offsets, or NULL */
    const uint8_t *weight_codes;   /* (Hkv, hd / 2) 4-bit codes of the key channel weights, low nibble first, or NULL */
    const float *fp8_values;       /* (256,) the value of each float8 e4m3 byte */
    const float *weight_values;    /* (16,) the weight of each 4-bit code */
    const float *rope_cos, *rope_sin;  /* +prerope, +ropemean: (slots, hd) cos / sin of each coded slot's position, as
                                          rope() takes them; NULL otherwise (and in a pool: its TqStep's rows) */
    const float *unrotation;       /* +prerope, M not a randomized Hadamard: (hd, hd) Mᵀ, row-major (x = y Mᵀ), else NULL */
    const float *unrotation_signs; /* +prerope with a randomized Hadamard M = H diag(s)/√d: (hd,) s/√d, else NULL */
    /* slot t is row o = t % block_rows of block b = t / block_rows: head g's codes at codes[i] + b * block_bytes[i] +
     * heads[i][g].at + o * slot_bytes[i], its scale at norms[i][b * norm_block_stride + g * norm_head_stride + o].
     * A single cache is one block (block_rows = slots), a serving pool many (block_rows = its block size). */
    int64_t block_rows;
    int64_t block_bytes[2];
    int64_t norm_head_stride, norm_block_stride;
    int32_t rope_mean;             /* +ropemean: keys coded as (k - R_t μ)/w, R_t RoPE at the key's position t (rope_cos,
                                      rope_sin; the pool's TqStep rows), read on the codes plus q . R_t μ per key */
    const float *rope_steps;       /* +ropemean: (hd, TQ_TURN_STEPS), column r = [cos rθ | sin rθ] over the d/2 RoPE
                                      frequencies θ: sixteen keys' factors of one channel in one vector */
    /* +qjl: a key's codes have one bit fewer, plus the sketch S r of its residual r = y - ŷ as signs and ‖r‖; a score
     * adds √(π/2)/d · ‖r‖ · (S q)·sign(S r) to q·ŷ before the key's scale (turboquant.py). Each token's signs and ‖r‖
     * lie where its scale does (scale_at), ⌈d/8⌉ bytes (bit j of byte j/8: (S r)_j >= 0) and one 16-bit value. */
    const float *qjl_matrix;       /* (hd, hd) S, or NULL without +qjl */
    uint8_t *qjl_signs;            /* (n_blocks, Hkv, block_rows, ⌈hd/8⌉) */
    void *qjl_norms;               /* (n_blocks, Hkv, block_rows) ‖r‖, stored as the scales (norm_type, 16-bit) */
    /* +outliersN: each key's N entries largest in magnitude (as the coder sees the key: centred, weighted, before
     * RoPE with +prerope) kept exactly, their channel and k_c - μ_c, and zero in what is coded; a score adds q·those
     * entries (turned to the key's position with +prerope). Each token's entries lie where its scale does, N apart. */
    int32_t outliers;              /* N, or 0 */
    uint8_t *outlier_channels;     /* (n_blocks, Hkv, block_rows, N) */
    uint16_t *outlier_values;      /* (n_blocks, Hkv, block_rows, N) float16 */
} Coded;

/* +prerope: C's keys are rebuilt before RoPE when read (it holds the inverse rotation) */
static inline int kvlab_tq_pre_rope(const Coded *C) { return C->unrotation || C->unrotation_signs; }

typedef struct {                   /* +prerope: how coded keys are rebuilt, then turned to their positions */
    const float *unrotation;       /* (d, d) Mᵀ: the key before its scale is x = y Mᵀ = Σ_j y_j Mᵀ[j] ... */
    const float *signs;            /* ... or, for a randomized Hadamard M = H diag(s)/√d, (d,) s/√d: x = (H y) ⊙ s/√d */
    const float *weights;          /* (d,) the key channel weights, or NULL */
    const float *offset;           /* (d,) the key offset, or NULL */
    const float *cos_, *sin_;      /* (rows, d) of the rows' positions, as rope() takes them */
} PreRope;

typedef struct {                   /* +ropemean: each coded key's offset turned to its position, as a read scores it */
    const float *coef;             /* query i's [A | B] (d/2 each, kvlab_tq_turn_coef) at coef + (i / group) * row_stride
                                      + (i % group) * d: laid out as the queries */
    const float *cos_, *sin_;      /* (rows, d) of the keys' positions, as rope() takes them, key index 0's row first */
    const float *steps;            /* Coded.rope_steps: the turns of 0 .. TQ_TURN_STEPS - 1 positions, (d, TQ_TURN_STEPS) */
} KeyTurn;

/* out (d,) = [A | B] of query q (d,) and offset mu (d,) (scaled by `scale`): q . R_t mu = Σ_j A_j cos_t[j] + B_j sin_t[j]
 * over the RoPE pairs j < d/2 (turboquant.py's +ropemean) */
void kvlab_tq_turn_coef(const float *q, const float *mu, int d, float scale, float *out);

/* -- reading one KV head's codes: the one read of a TurboQuant layer ------------------------------------------------ */
#define TQ_TURN_KEYS 64            /* keys scored at once from one turn of +ropemean's coefficients, to the run's middle */
#define TQ_TURN_STEPS 32           /* the turns a run reads (keys up to 32 from its middle; Coded.rope_steps' columns) */
#define TQ_READ_KEYS 512           /* keys of one kvlab_tq_read call, at most (a work item of a long context) */
typedef struct {                   /* KV head g of a coded layer as a read sees it */
    const Coded *C;
    const cb_layout *layout[2];    /* its keys' and values' layouts (kvlab_tq_layouts) */
    int g;
    float scale;                   /* each score's factor besides the key's stored scale */
    const PreRope *pre;            /* +prerope: the head's weights and offset, cos_/sin_ the rows of key index 0; else NULL */
    const KeyTurn *turn;           /* +ropemean: the queries' offset terms; else NULL */
} TqHead;
/* floats of scratch kvlab_tq_read takes for nq queries (dpad: the layouts' padded row) */
int64_t kvlab_tq_read_floats(int nq, int dpad);
/* The attention of nq queries over keys [k0, k1) of one sequence of head h (k1 - k0 <= TQ_READ_KEYS), key t at slot
 * table[t / block_rows] * block_rows + t % block_rows of h->C (a single cache: one block, table {0}). Query i = (row
 * i / group, head i % group of the KV head's group) lies at queries + (i / group) * row_stride + (i % group) * d, as
 * the codes are read (kvlab_tq_query; with +prerope q itself), and reads keys [lo[i], hi[i]). Its part, d + 2 floats at
 * parts + i * part_stride = [sum_t e^(s_t - top) v'_t | top | sum_t e^(s_t - top)] (none read: top -inf, sum 0), s_t
 * = (q_i . k_t * scale_t [+ q . R_t μ, h->turn]) * h->scale, v'_t the value's codebook vector times its scale (the
 * rotated domain). Blocks of 16 rows or more (a single cache's one, a pool's) are read straight from their codes in
 * registers where codebook.c has that path (a pool's blocks of 16 from the start of k0's block: the keys before k0 are
 * read and weigh 0); shorter ones, and +prerope keys, are decoded a tile at a time, read by every query while in L1. */
void kvlab_tq_read(const TqHead *h, const int32_t *table, int64_t k0, int64_t k1, const float *queries, int group,
                   int64_t row_stride, int nq, const int64_t *lo, const int64_t *hi, float *scratch, float *parts,
                   int64_t part_stride);

/* layouts[2g + i] = KV head g's key (i = 0) or value (1) layout of C; 0, or -1 when C cannot be read or coded */
int kvlab_tq_layouts(const Coded *C, int Hkv, int hd, cb_layout *layouts);
/* Code rows r < n whose slots[r] >= 0 into C (layouts: kvlab_tq_layouts): K/V of KV head g at k/v + r * stride + g * hd
 * (keys after RoPE); +prerope: turned back with the cos_/sin_ row rope_at[r] (rope_at NULL: row r). 0, or 1 when a
 * scale is not finite (that row's heads are not all stored). Slots are not checked: the caller's. */
int kvlab_tq_code_rows(const Coded *C, const cb_layout *layouts, int Hkv, int hd, int64_t n, const float *k,
                       const float *v, int64_t stride, const int64_t *slots, const float *cos_, const float *sin_,
                       const int64_t *rope_at, int n_threads);
/* out (hd,) = (q ⊙ w) M: query q (hd,) of KV head g as C's codes are read (w: the key channel weights, if any) */
void kvlab_tq_query(const Coded *C, int g, int hd, const float *q, float *out);
/* the float values of C's state, (Hkv, hd) each where not NULL: key channel weights (1 without), key and value
 * offsets (0 without) */
void kvlab_tq_state(const Coded *C, int Hkv, int hd, float *weights, float *k_offset, float *v_offset);

/* -- a layer of the serving pool ------------------------------------------------------------------------------ */
typedef struct {                   /* one layer of a TurboQuant pool, checked once where it is made */
    const Coded *coded;            /* its codes in blocks of the pool's block size; the codec's state */
    int32_t sink;                  /* +sinkN: positions below it live in the sink rows, not in blocks; 0 without */
    int32_t sink_type;             /* POOL_F32, POOL_F16 or POOL_BF16 */
    int32_t sink_entries;
    void *sink_k, *sink_v;         /* (sink_entries, sink, Hkv, hd) each */
} TqPoolLayer;

typedef struct {                   /* what every layer of one step reads besides its descriptor */
    const int32_t *entries;        /* +sinkN: (n_seqs,) each sequence's entry of sink rows; else NULL */
    const float *rope_cos, *rope_sin;  /* +prerope, +ropemean: (rope_rows, hd) of positions 0, 1, ..; else NULL */
    int64_t rope_rows;
} TqStep;

/* Attention straight from C's codes through the block tables of R (R->block_size == C->block_rows): q (n_rows, H, hd)
 * as the codes are read (kvlab_tq_query: rotated, key weights applied; with +prerope q itself, each key rebuilt and
 * turned to its position with S's RoPE rows; with +ropemean q itself, read as the codes are plus its offset term),
 * keys at positions [first_key, key_end) (key_end < 0: no end; a single cache's recent window follows its codes) ->
 * out (n_rows, H, hd) in the rotated domain and, lse not NULL, (n_rows, H) the log of each row's softmax sum (-inf: no
 * key read, out 0). 0; -1 refused (nothing read); -2 no memory. The one read of a TurboQuant layer's codes over a
 * block table: the pool's (kvlab_tq_pool_layer) and a single cache's. */
int kvlab_tq_attention(const Coded *C, int n_heads, int n_kv_heads, int hd, const Ragged *R, int64_t n_rows,
                       const TqStep *S, const float *q, int64_t first_key, int64_t key_end, float scale, int window,
                       float *out, float *lse, int n_threads);

/* 0 when kvlab_tq_pool_layer takes these sizes and every index they give (slots, sink entries, RoPE rows) lies
 * inside the layer's buffers; -1 otherwise; -2 without memory */
int kvlab_tq_pool_layer_ok(const TqPoolLayer *T, int n_heads, int n_kv_heads, int hd, const Ragged *R, int64_t n_rows,
                           const TqStep *S);
/* One layer of a step: each row's K/V (k, v rows `kv_stride` floats apart, (Hkv, hd) each, keys after RoPE) coded
 * into its slot (positions below T->sink into its sequence's sink rows), then out (n_rows, H, hd) = each row's
 * attention over its sequence's keys, q (n_rows, H, hd) after RoPE. 0; -1 refused (nothing written); -2 no memory;
 * 1 a scale not finite (nothing attended). */
int kvlab_tq_pool_layer(const TqPoolLayer *T, int n_heads, int n_kv_heads, int hd, const Ragged *R, int64_t n_rows,
                        const TqStep *S, const float *q, const float *k, const float *v, int64_t kv_stride, float scale,
                        int window, float *out, int n_threads);
#endif
