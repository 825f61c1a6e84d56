/* What the whole-model steps share: the model's weights as C structs (built by kvlab/model/fused.py) and
 * decode.c's row helpers. decode.c runs one token through every layer; batchstep.c runs a stack of rows of
 * many sequences over the serving engine's block pool. */
#ifndef KVLAB_DECODE_H
#define KVLAB_DECODE_H
#include <math.h>
#include <sched.h>
#include <stdint.h>
#include <string.h>

#include "blockgemv.h"
#ifdef _OPENMP
#include <omp.h>
#endif
#ifdef __linux__
#include <limits.h>
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

typedef struct {
    int32_t type;            /* F32, Q4_0, Q4_1 or Q8_0 */
    int64_t rows, cols;
    const uint8_t *data;     /* rows × row bytes: fp32 values or consecutive blocks */
    const float *bias;       /* (rows,) or NULL */
} Matrix;

typedef struct {
    const float *attn_norm, *ffn_norm;   /* (d_model,) */
    const float *q_norm, *k_norm;        /* (head_dim,) or NULL */
    Matrix qkv, out, gate_up, down;      /* q|k|v rows fused, gate|up rows fused */
} Layer;

typedef struct {
    int32_t n_layers, d_model, n_heads, n_kv_heads, head_dim, d_ff;
    int32_t window;                      /* sliding window in tokens, 0 for none */
    float rms_eps, attn_scale;
    const Layer *layers;
    const float *final_norm;             /* (d_model,) */
    Matrix head;                         /* (vocab, d_model) */
} Model;

/* a . b over n values, in a fixed order (the same bits on every call) */
float kvlab_dot(const float *a, const float *b, int64_t n);
/* s[t] = e^(s[t] - top) for t < n (s[t] <= top), sixteen at a time (about 2 ulp; a nan stays nan); returns their sum */
float kvlab_exp_shifted(float *s, int n, float top);
/* y (n,) = rms_norm(x) * w, as torch.nn.functional.rms_norm (y may be x) */
void kvlab_rms_norm(const float *x, const float *w, float eps, int n, float *y);
/* RoPE of one head of d values in place, as llama.py's apply_rope: pairs (i, i + d/2) */
void kvlab_rope(float *x, const float *cos_, const float *sin_, int d);
/* One input row x through a matrix, as the steps' products compute it (blockgemv.c's row dot for GGUF blocks, one
 * fixed-order dot for fp32 rows; with int8 activations, `int8`, q8gemm.c's row dot of x's int8 codes, as a product of
 * a few rows takes them). kvlab_matrix_prepare writes what the row dot needs of x besides x into `prepared`
 * (kvlab_matrix_scratch(cols) floats: Q4_0 / Q4_1 blocks' sums, or x's int8 codes and their scales); row r of W . x
 * (+ its bias) by kvlab_matrix_row; y = W x with W's rows shared between the threads of the enclosing parallel region
 * (no barrier after) by kvlab_matrix_rows. */
static inline int64_t kvlab_matrix_scratch(int64_t cols) { return kvlab_q8_row_floats(cols) + 1; }

static inline void kvlab_matrix_prepare(const Matrix *W, int int8, const float *x, float *prepared) {
    if (int8 && W->type != F32) kvlab_q8_prepare(x, W->cols, prepared);
    else if (W->type == Q4_0 || W->type == Q4_1) kvlab_block_sums(x, W->cols, prepared);
}

static inline float kvlab_matrix_row(const Matrix *W, int int8, int64_t r, const float *x, const float *prepared) {
    float v;
    if (W->type == F32) {
        v = kvlab_dot((const float *)W->data + r * W->cols, x, W->cols);
    } else {
        const int64_t nblocks = W->cols / QK;
        const uint8_t *row = W->data + r * nblocks * kvlab_block_bytes(W->type);
        v = int8 ? kvlab_q8_row_dot(W->type, row, prepared, nblocks) : kvlab_block_row_dot(W->type, row, x, prepared, nblocks);
    }
    return W->bias ? v + W->bias[r] : v;
}

static inline void kvlab_matrix_rows(const Matrix *W, int int8, const float *x, const float *prepared, float *y) {
    #pragma omp for schedule(static) nowait
    for (int64_t r = 0; r < W->rows; r++) y[r] = kvlab_matrix_row(W, int8, r, x, prepared);
}

/* +norms8 (turboquant.py LOG_NORM_STEPS, _LOG_NORM_ZERO): a scale's uint8 code c > 0 stands for
 * 2^(centre + (c - 128)/16), code 0 for a zero scale (_log_norm_values); decode.c and paged.c read them so.
 * A centre is a multiple of 1/16, so with e = 16·centre + c - 128 the scale is 2^(e mod 16 / 16) · 2^floor(e/16):
 * one of 16 float32 steps (turboquant.py LOG_STEP_POWERS, the same values) times a power of two, exact, so torch
 * and C decode a code to the same float whatever the vector length (exp2 differs by an ulp between SIMD and scalar) */
#define LOG_NORM_STEPS 16
#define LOG_NORM_ZERO 128
static const float KVLAB_LOG_STEP_POWERS[LOG_NORM_STEPS] = {
    0x1p+0f, 0x1.0b5586p+0f, 0x1.172b84p+0f, 0x1.2387a6p+0f, 0x1.306fep+0f, 0x1.3dea64p+0f, 0x1.4bfdaep+0f, 0x1.5ab07ep+0f,
    0x1.6a09e6p+0f, 0x1.7a1148p+0f, 0x1.8ace54p+0f, 0x1.9c4918p+0f, 0x1.ae89fap+0f, 0x1.c199bep+0f, 0x1.d5818ep+0f, 0x1.ea4afap+0f};
static inline float kvlab_log_scale(int code, float centre) {
    if (!code) return 0.0f;
    const int e = (int)lrintf(centre * LOG_NORM_STEPS) + code - LOG_NORM_ZERO;
    int octave = e >= 0 ? e / LOG_NORM_STEPS : -((LOG_NORM_STEPS - 1 - e) / LOG_NORM_STEPS);   /* floor(e / 16) */
    const float step = KVLAB_LOG_STEP_POWERS[e - octave * LOG_NORM_STEPS];
    octave = octave < -126 ? -126 : octave > 127 ? 127 : octave;   /* 2^octave a normal float, its bits built */
    const uint32_t bits = (uint32_t)(octave + 127) << 23;
    float power;
    memcpy(&power, &bits, sizeof power);
    return step * power;
}

/* One KV head's dense K/V rows of one sequence, a single cache's or a serving pool's: key t (and its value) at row
 * table[t / block_rows] * block_stride + t % block_rows of k (d elements a row) and v (dv), stored as `type`
 * (0 fp32, 1 f16, 2 bf16: decode.c's KV_*, paged.h's POOL_*). A single cache is one block: table {0}. */
typedef struct {
    int type, d, dv;
    const void *k, *v;
    int64_t block_rows, block_stride;
} DenseHead;
#define DENSE_READ_KEYS 256   /* keys of one kvlab_dense_read, at most */
#define DENSE_TILE 64         /* rows a short-block read converts at a time */
/* floats of scratch kvlab_dense_read takes for nq queries */
static inline int64_t kvlab_dense_read_floats(int nq, int d, int dv) {
    return (int64_t)nq * DENSE_READ_KEYS + (int64_t)DENSE_TILE * (d > dv ? d : dv) + 16 * (int64_t)d;   /* + 16 keys transposed */
}
/* The one read of dense rows (the fused step's chunks, the serving pool's items): the attention of nq queries
 * (queries + i * d) over keys [k0, k1) of h, k1 - k0 <= DENSE_READ_KEYS, each query's part
 * [Σ_t e^(s_t - top) v_t (dv) | top | Σ_t e^(s_t - top)] at parts + i * part_stride, s_t = q_i . k_t * scale.
 * Up to 8 queries (a decode step's): the rows are read in place, 16-bit ones converted in registers, by passes of up
 * to three queries, each row loaded once a pass: under AVX-512 a block run (a single cache's, head dim <= 128), under
 * AVX2 any rows (asked for a few at a time just ahead of their read); elsewhere a pool's short blocks converted
 * DENSE_TILE rows at a time. More (a prompt chunk's tile of rows): the rows DENSE_TILE at a time, scores and value
 * mix in blocks of queries (decode.c). */
void kvlab_dense_read(const DenseHead *h, const int32_t *table, int64_t k0, int64_t k1, const float *queries, int nq,
                      float scale, float *scratch, float *parts, int64_t part_stride);
/* One more part of a query's keys into its running merge, the parts taken in key order: a part is
 * [Σ_t e^(s_t - top) v_t (d) | top | Σ_t e^(s_t - top)] (kvlab_dense_read, kvlab_tq_read, kvlab_int_attend; top
 * -inf: no key read, skipped). acc (d) and *sum hold the parts so far weighted e^(top_c - M), M the largest top so far
 * (*top; -inf before the first part, with acc and *sum zero): both are rescaled as M grows. Returns the factor the
 * earlier parts were rescaled by (1 where M did not grow) and sets *weight to this part's, for a second accumulator of
 * the same query. Every merge of parts (the single cache's fused step, the serving pool's dense items and coded reads)
 * goes through here, so a query's output is the same bits whichever of them reads its keys in the same parts. */
static inline float kvlab_merge_part(float *acc, float *top, float *sum, const float *part, int d, float *weight) {
    *weight = 0.0f;
    if (part[d] == -INFINITY) return 1.0f;
    const float next = part[d] > *top ? part[d] : *top;
    const float old_w = expf(*top - next), new_w = expf(part[d] - next);   /* *top -inf: old_w 0 */
    for (int i = 0; i < d; i++) acc[i] = acc[i] * old_w + part[i] * new_w;
    *sum = *sum * old_w + part[d + 1] * new_w;
    *top = next;
    *weight = new_w;
    return old_w;
}
/* The merge of one query's n parts, `stride` floats apart, in order (kvlab_merge_part): parts [rot_lo, rot_hi) summed
 * into rot (a coded layer's, in its rotated domain; their weights' share into *coded), the others into out; *top = the
 * largest top; returns Σ_c e^(top_c - top) · sum_c. */
static inline float kvlab_merge_parts(const float *parts, int64_t stride, int64_t n, int d, int64_t rot_lo,
                                      int64_t rot_hi, float *out, float *rot, float *coded, float *top) {
    float m = -INFINITY, total = 0.0f, share = 0.0f;
    for (int i = 0; i < d; i++) out[i] = 0.0f;
    for (int i = 0; i < d && rot_hi > rot_lo; i++) rot[i] = 0.0f;
    for (int64_t c = 0; c < n; c++) {
        const float *part = parts + c * stride;
        const int rotated = c >= rot_lo && c < rot_hi;
        float w;
        const float old_w = kvlab_merge_part(rotated ? rot : out, &m, &total, part, d, &w);
        if (old_w != 1.0f)
            for (int i = 0; i < d && rot_hi > rot_lo; i++) (rotated ? out : rot)[i] *= old_w;   /* the other sum */
        share = share * old_w + (rotated ? part[d + 1] * w : 0.0f);
    }
    if (coded) *coded += share;
    *top = m;
    return total;
}
/* dst (n,) = src rounded to f16 (kv_type 1) or bf16 (2) as torch's .to() rounds: 0 when all stored values are
 * finite, 1 otherwise, -1 for another kv_type */
int kvlab_kv_store(int kv_type, const float *src, int64_t n, uint16_t *dst);
/* dst (n,) fp32 = the f16 (kv_type 1) or bf16 (2) values at src, exactly: 0, or -1 for another kv_type */
int kvlab_kv_load(int kv_type, const uint16_t *src, int64_t n, float *dst);
/* The whole-model steps' barrier (decode.c, batchstep.c): the threads of a step's one parallel region wait for each
 * other here between two pieces of work, about ten microseconds apart. A waiter spins (pause) for SPIN_ROUNDS rounds, some tens of microseconds, then
 * sleeps (a futex, Linux; elsewhere it yields its core each round) until the last thread arrives and wakes it. On an
 * idle machine the waits are shorter than the spin, so no waiter sleeps and none pays a futex wake-up of a halted
 * core (tens of microseconds on a VM, where OpenMP's passive policy, kvlab/__init__.py, pays it at every barrier);
 * on a busy one a waiter that spun long enough hands its core over, as the passive policy does. Sense-reversing:
 * `sense` flips once per crossing. */
#define SPIN_ROUNDS 2000
typedef struct {
    int n_threads;
    int arrived;
    int sense;
    int sleepers;
} StepBarrier;

/* This thread's number in the step's parallel region, which it first counts into b (every thread stores the same
 * team size) */
static inline int step_thread(StepBarrier *b) {
#ifdef _OPENMP
    __atomic_store_n(&b->n_threads, omp_get_num_threads(), __ATOMIC_RELAXED);
    return omp_get_thread_num();
#else
    (void)b;
    return 0;
#endif
}

static inline void step_barrier(StepBarrier *b, int *my_sense) {
    const int n_threads = __atomic_load_n(&b->n_threads, __ATOMIC_RELAXED);
    if (n_threads <= 1) return;
    const int sense = *my_sense = !*my_sense;
    if (__atomic_add_fetch(&b->arrived, 1, __ATOMIC_ACQ_REL) == n_threads) {   /* the last one releases the rest */
        __atomic_store_n(&b->arrived, 0, __ATOMIC_RELAXED);
        __atomic_store_n(&b->sense, sense, __ATOMIC_SEQ_CST);
#ifdef __linux__
        if (__atomic_load_n(&b->sleepers, __ATOMIC_SEQ_CST) > 0)
            syscall(SYS_futex, &b->sense, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
#endif
        return;
    }
    for (int round = 0; __atomic_load_n(&b->sense, __ATOMIC_ACQUIRE) != sense; round++) {
        if (round < SPIN_ROUNDS) {
#if defined(__x86_64__) || defined(__i386__)
            __builtin_ia32_pause();
#endif
            continue;
        }
#ifdef __linux__   /* sleep while sense is still the old one (the kernel checks it: no wake-up is lost) */
        __atomic_add_fetch(&b->sleepers, 1, __ATOMIC_SEQ_CST);
        if (__atomic_load_n(&b->sense, __ATOMIC_SEQ_CST) != sense)
            syscall(SYS_futex, &b->sense, FUTEX_WAIT_PRIVATE, !sense, NULL, NULL, 0);
        __atomic_sub_fetch(&b->sleepers, 1, __ATOMIC_SEQ_CST);
#else
        sched_yield();
#endif
    }
}

#endif
