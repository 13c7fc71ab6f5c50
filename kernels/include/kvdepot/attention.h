/*
 * Decode attention on every cache form kvdepot stores.
 *
 * One call computes, for one sequence at one layer and one decode step,
 *
 *     s_t   = softmax_scale * (q_h . k_t)            for every token t
 *     lse_h = ln sum_t exp(s_t)
 *     out_h = sum_t exp(s_t - lse_h) * v_t
 *
 * for every query head h, with grouped-query attention: Hq query heads share
 * Hkv key/value heads, G = Hq / Hkv, and query head h reads kv head h / G.
 * Results are returned as (output, log-sum-exp) so attention over disjoint
 * token ranges (pages held by different tiers, the raw tail held by the
 * engine) combines exactly with kvd_attn_merge().
 *
 * An empty token range gives lse = -inf and out = 0: the neutral element of
 * the merge, so an empty page never changes a merged result.
 *
 * Shapes shared by every form (all row-major, see kvdepot/tensor.h):
 *   q    (Hq, D)   f32       query of the current step (D = head_dim)
 *   out  (Hq, Dv)  f32       Dv = v_dim
 *   lse  (Hq)      f32       natural logarithm
 * Dense K/V are (Hkv, T, D) and (Hkv, T, Dv), f32, f16 or bf16; the two outer
 * dimensions may have any stride, the innermost must be contiguous.
 *
 * Every entry point takes an array of items (one per sequence) so a backend
 * can batch sequences into one launch; the CPU backend runs the items in
 * turn and parallelises over the kv heads of each.
 *
 * NaN/Inf: a NaN anywhere in q, K or V propagates to the affected outputs as
 * NaN, as in plain float attention; no form hides it.
 */
#ifndef KVDEPOT_ATTENTION_H
#define KVDEPOT_ATTENTION_H

#include <stdint.h>

#include "kvdepot/backend.h"
#include "kvdepot/status.h"
#include "kvdepot/tensor.h"

typedef struct kvd_attn_dims {
    int n_q_heads;       /* Hq, a multiple of n_kv_heads */
    int n_kv_heads;      /* Hkv */
    int head_dim;        /* D: width of q and K */
    int v_dim;           /* Dv: width of V and out */
    float softmax_scale; /* usually 1/sqrt(D) of the original model */
} kvd_attn_dims;

/* (a) Dense float K/V. T = k.shape[1] (may be 0; data may then be NULL). */
typedef struct kvd_attn_dense_args {
    kvd_attn_dims dims;
    kvd_tensor q;   /* (Hq, D) f32 */
    kvd_tensor k;   /* (Hkv, T, D)  f32 | f16 | bf16 */
    kvd_tensor v;   /* (Hkv, T, Dv) f32 | f16 | bf16 */
    kvd_tensor out; /* (Hq, Dv) f32, written */
    kvd_tensor lse; /* (Hq) f32, written */
} kvd_attn_dense_args;

/* (e) Sparse: attention over the tokens listed per kv head, gathered from
 * dense K/V. idx (Hkv, n) i32 holds token positions in [0, T); each entry
 * counts once per occurrence (pass distinct indices). n = 0 gives the empty
 * result. Typical input: the top-k list of a PQ search. An index outside
 * [0, T) fails the call with KVD_EINVAL: the checked wrapper reads the list
 * on the CPU backend; a device backend (its list is in device memory) checks
 * it on the device before writing any output. */
typedef struct kvd_attn_sparse_args {
    kvd_attn_dims dims;
    kvd_tensor q;   /* (Hq, D) f32 */
    kvd_tensor k;   /* (Hkv, T, D)  f32 | f16 | bf16 */
    kvd_tensor v;   /* (Hkv, T, Dv) f32 | f16 | bf16 */
    kvd_tensor idx; /* (Hkv, n) i32 */
    kvd_tensor out; /* (Hq, Dv) f32 */
    kvd_tensor lse; /* (Hq) f32 */
} kvd_attn_sparse_args;

/* Grouping axis of an INT2/INT4 block (layouts agreed with kvdepot/quant.h).
 *
 * KVD_ATTN_AXIS_TOKEN: groups of P consecutive channels of one token
 *   (keys as HACK groups them, and values in KIVI mode).
 *   codes (Hkv, T, W*bits/8) u8: value j of a row sits in byte j/(8/bits) at
 *         bit offset (j % (8/bits)) * bits.
 *   min, scale (Hkv, T, W/P) f16;  sum (Hkv, T, W/P) u16 = sum of the codes
 * KVD_ATTN_AXIS_CHANNEL: groups of P consecutive tokens of one channel
 *   (values as HACK groups them; keys as KIVI groups them, which keeps the
 *   few large-magnitude key channels from setting the scale of the others).
 *   T must be a multiple of P; for keys P must also divide 256.
 *   codes (Hkv, W, T*bits/8) u8 packed along tokens in the same bit order;
 *   min, scale (Hkv, W, T/P) f16;  sum (Hkv, W, T/P) u16.
 * W is D for keys and Dv for values; x ~ min + scale * code. */
typedef enum kvd_attn_axis {
    KVD_ATTN_AXIS_TOKEN = 0,
    KVD_ATTN_AXIS_CHANNEL = 1,
} kvd_attn_axis;

typedef struct kvd_attn_qdata {
    int bits;     /* 2 or 4 */
    int group;    /* P: 8, 16, 32, 64 or 128 (any multiple of 8/bits that divides the axis) */
    int axis;     /* kvd_attn_axis */
    kvd_tensor codes, min, scale, sum;
} kvd_attn_qdata;

/* (b) Homomorphic INT2/INT4 attention (HACK Eq. 4) over n_tokens quantized
 * tokens followed by the raw tail tokens k_tail/v_tail (the page that is not
 * sealed yet; shape (Hkv, Tt, D) / (Hkv, Tt, Dv), any float dtype, Tt >= 0).
 *
 * Scores: q_h is quantized per head to int8, symmetric: s_q = max|q_h| / 127,
 * q8 = round(q_h / s_q). For each K group g (P channels of token t),
 *     q.k ~ s_q * sum_g ( scale_g * sum_{j in g} q8_j c_j
 *                       +   min_g * sum_{j in g} q8_j )
 * i.e. Eq. 4 with a zero query minimum; the integer dot products run on the
 * 2/4-bit codes directly.
 * Keys, channel axis (KIVI-style): per token group gi (P tokens) and query
 * head, the query folded with the group's per-channel scales,
 * w_d = q_d * scale_{d,gi} (f32), is quantized like q above (s_w, w8), and
 *     q.k_t ~ sum_d q_d min_{d,gi} + s_w * sum_d w8_d c_{d,t}
 * so the integer dot products run along the channels of each token on the
 * 2/4-bit codes, with one float bias per group.
 * Values, channel axis: the unnormalised probabilities P_t = exp(s_t - max)
 * are quantized per group of P tokens to uint8, asymmetric
 * (mP = min, sP = (max - min) / 255, p8 = round((P - mP) / sP)); then per
 * channel d and group g
 *     sum_t P_t v_td ~ sP*scale * sum_t p8_t c_td + mP*scale * sum_t c_td (stored sum)
 *                    + sP*min * sum_t p8_t + P*mP*min                    (Eq. 4)
 * Values, token axis (KIVI): the per-token scale is folded into the
 * probability, out_d += (P_t*scale_tg) * c_td + P_t*min_tg, in float (there
 * is no long integer axis to multiply along).
 * Neither K nor V is ever dequantized into a buffer. */
/* A block of quantized tokens of a segmented INT call
 * (kvd_attn_int_args.segments): k and v over its n_tokens tokens, with the
 * call's bits, group and axis. */
typedef struct kvd_attn_int_segment {
    int64_t n_tokens;
    kvd_attn_qdata k, v;
} kvd_attn_int_segment;

typedef struct kvd_attn_int_args {
    kvd_attn_dims dims;
    kvd_tensor q;         /* (Hq, D) f32 */
    int64_t n_tokens;     /* T quantized tokens */
    kvd_attn_qdata k;     /* TOKEN (HACK) or CHANNEL (KIVI-style) */
    kvd_attn_qdata v;     /* TOKEN or CHANNEL */
    kvd_tensor k_tail;    /* (Hkv, Tt, D), Tt may be 0 */
    kvd_tensor v_tail;    /* (Hkv, Tt, Dv) */
    kvd_tensor out;       /* (Hq, Dv) f32 */
    kvd_tensor lse;       /* (Hq) f32 */
    /* n_segments > 0: the quantized tokens lie in segments[0..n), in order
     * (e.g. the pages of a sequence; n_tokens their sum), attended as one
     * sequence with the query prepared once; k and v then give only the
     * bits, group and axis, their tensors unused. Host memory: the CPU
     * backend takes them, others answer KVD_EUNSUPP. */
    int n_segments;
    const kvd_attn_int_segment *segments;
} kvd_attn_int_args;

/* (c) Fused VQ attention.
 *   k_codes (Hkv, T, D/dk) u8 (bits <= 8) or u16; k_codebook (Hkv, 2^bk, dk) f32
 *   v_codes (Hkv, T, Dv/dv) u8 or u16;            v_codebook (Hkv, 2^bv, dv) f32
 * Keys were coded after smoothing and rotation: k~ = H (k / lambda), with
 * lambda (Hkv, D) f32 (k_lambda.data NULL = no smoothing) and H the
 * orthonormal Walsh-Hadamard matrix (k_hadamard = 0: no rotation). The kernel
 * transforms the query to match, q~ = H (q * lambda), so q~.k~ = q.k.
 * Scores: s_t = sum_pos LUT[pos][code_t,pos] with LUT[pos][c] = q~_pos . C_k[c].
 * Output: probabilities are accumulated per (position, value code), then one
 * pass over the value codebook: out_pos = sum_c A[pos][c] * C_v[c].
 * Raw tail tokens (untransformed keys) may follow, as in the INT form.
 * The coded tokens may also lie in several blocks (segments, e.g. the pages
 * of a sequence): attended in order as one sequence, the score table built
 * and the value codebook folded once for all of them. */
typedef struct kvd_attn_vq_segment {
    int64_t n_tokens;            /* T_i >= 0 */
    kvd_tensor k_codes, v_codes; /* (Hkv, T_i, D/dk), (Hkv, T_i, Dv/dv) */
} kvd_attn_vq_segment;

typedef struct kvd_attn_vq_args {
    kvd_attn_dims dims;
    kvd_tensor q;          /* (Hq, D) f32, untransformed */
    int64_t n_tokens;      /* T coded tokens */
    int k_sub_dim, k_bits; /* dk, bk */
    kvd_tensor k_codes, k_codebook, k_lambda;
    int k_hadamard;        /* 1: keys were Hadamard-rotated (D a power of two) */
    int v_sub_dim, v_bits; /* dv, bv */
    kvd_tensor v_codes, v_codebook;
    kvd_tensor k_tail, v_tail; /* raw (Hkv, Tt, D) / (Hkv, Tt, Dv), Tt may be 0 */
    kvd_tensor out, lse;
    /* n_segments > 0: the coded tokens are those of segments[0..n) in
     * order (n_tokens their sum; k_codes and v_codes unused). Host memory:
     * the CPU backend takes them, others answer KVD_EUNSUPP. */
    int n_segments;
    const kvd_attn_vq_segment *segments;
} kvd_attn_vq_args;

/* (d) Reduced-dimension attention (ZACK). Keys and values are stored rotated
 * and truncated per kv head h: k' = k R_k[h][:, :rk_h], v' = v R_v[h][:, :rv_h]
 * (see kvdepot/svd.h). The query is projected with the key rotation of its kv
 * head, scores are computed in rk_h dims, the output is accumulated in rv_h
 * dims and rotated back: out = (sum_t p_t v'_t) R_v[h][:, :rv_h]^T.
 * Reduced K/V are ragged: the block of kv head h is (T, rk_h) and starts after
 * the blocks of heads 0..h-1 (element offset T * sum_{h'<h} rk_h'); the same
 * for V with rv_h. For codec compositions (SVD then INT2/VQ) callers project q
 * with kvd_svd_project(), run the codec's attention at the reduced width and
 * rotate the output back with kvd_svd_unproject(). The reduced tokens may
 * also lie in several blocks (segments, e.g. the pages of a sequence), each
 * ragged as above over its own tokens: attended in order as one sequence,
 * the query projected and the output rotated back once for all of them. */
typedef struct kvd_attn_svd_segment {
    int64_t n_tokens;          /* T_i >= 0 */
    const void *k_red, *v_red; /* ragged over T_i tokens */
} kvd_attn_svd_segment;

typedef struct kvd_attn_svd_args {
    kvd_attn_dims dims;    /* head_dim, v_dim: the full widths D, Dv */
    kvd_tensor q;          /* (Hq, D) f32 */
    kvd_tensor rk;         /* (Hkv, D, D) f32, columns by descending singular value */
    kvd_tensor rv;         /* (Hkv, Dv, Dv) f32 */
    const int32_t *k_width; /* (Hkv) rk_h in [0, D]; host memory on every backend */
    const int32_t *v_width; /* (Hkv) rv_h in [0, Dv]; host memory on every backend */
    int64_t n_tokens;      /* T */
    kvd_dtype dtype;       /* of k_red/v_red: f32, f16 or bf16 */
    const void *k_red;     /* ragged, see above */
    const void *v_red;
    kvd_tensor out, lse;
    /* n_segments > 0: the reduced tokens are those of segments[0..n) in
     * order (n_tokens their sum; k_red and v_red unused). Host memory: the
     * CPU backend takes them, others answer KVD_EUNSUPP. */
    int n_segments;
    const kvd_attn_svd_segment *segments;
} kvd_attn_svd_args;

/* (f) Merge of two partial results over disjoint token sets:
 *   lse = ln(exp(lse_a) + exp(lse_b)),
 *   out = exp(lse_a - lse) * out_a + exp(lse_b - lse) * out_b.
 * A side with lse = -inf contributes nothing. out/lse may alias a or b. */
typedef struct kvd_attn_merge_args {
    kvd_tensor out_a, lse_a; /* (Hq, Dv), (Hq) f32 */
    kvd_tensor out_b, lse_b;
    kvd_tensor out, lse;
} kvd_attn_merge_args;

/* Backend family table. Each op takes n items; NULL = unsupported. */
typedef struct kvd_attn_ops {
    int (*dense)(kvd_backend *be, int n, const kvd_attn_dense_args *a, kvd_error *err);
    int (*sparse)(kvd_backend *be, int n, const kvd_attn_sparse_args *a, kvd_error *err);
    int (*quant)(kvd_backend *be, int n, const kvd_attn_int_args *a, kvd_error *err);
    int (*vq)(kvd_backend *be, int n, const kvd_attn_vq_args *a, kvd_error *err);
    int (*svd)(kvd_backend *be, int n, const kvd_attn_svd_args *a, kvd_error *err);
    int (*merge)(kvd_backend *be, int n, const kvd_attn_merge_args *a, kvd_error *err);
} kvd_attn_ops;

/*
 * Checked wrappers: validate every item (dtypes, shapes, strides, head
 * counts, group sizes), then run the backend's op.
 * @param[in] be   backend whose memory holds every tensor
 * @param[in] n    number of items (n = 0 is a no-op)
 * @param[in] a    n items
 * @return 0, KVD_EINVAL (bad argument, err names the item and field) or
 *         KVD_EUNSUPP (backend lacks the op).
 */
int kvd_attn_dense(kvd_backend *be, int n, const kvd_attn_dense_args *a, kvd_error *err);
int kvd_attn_sparse(kvd_backend *be, int n, const kvd_attn_sparse_args *a, kvd_error *err);
int kvd_attn_quant(kvd_backend *be, int n, const kvd_attn_int_args *a, kvd_error *err);
int kvd_attn_vq(kvd_backend *be, int n, const kvd_attn_vq_args *a, kvd_error *err);
int kvd_attn_svd(kvd_backend *be, int n, const kvd_attn_svd_args *a, kvd_error *err);
int kvd_attn_merge(kvd_backend *be, int n, const kvd_attn_merge_args *a, kvd_error *err);

/* One merge into an accumulator: (out, lse) of hq heads x dv f32 takes in
 * (out_b, lse_b) in place, as kvd_attn_merge with out = out_a, lse = lse_a. */
int kvd_attn_merge_into(kvd_backend *be, int64_t hq, int64_t dv, float *out, float *lse,
                        const float *out_b, const float *lse_b, kvd_error *err);

/* Validation alone (the wrappers call these; exposed for other backends). */
int kvd_attn_dense_check(const kvd_attn_dense_args *a, kvd_error *err);
int kvd_attn_sparse_check(const kvd_attn_sparse_args *a, kvd_error *err);
int kvd_attn_int_check(const kvd_attn_int_args *a, kvd_error *err);
int kvd_attn_vq_check(const kvd_attn_vq_args *a, kvd_error *err);
int kvd_attn_svd_check(const kvd_attn_svd_args *a, kvd_error *err);
int kvd_attn_merge_check(const kvd_attn_merge_args *a, kvd_error *err);

/*
 * CPU implementations, one item each, on validated arguments. The *_ref
 * functions are the specification (scalar, double accumulation where it
 * matters); the *_fast ones are what the CPU backend runs (AVX2/FMA/F16C when
 * the CPU has them, scalar otherwise) with up to nthreads threads of the compute pool.
 * Return 0 or KVD_ENOMEM.
 */
int kvd_cpu_attn_dense_ref(const kvd_attn_dense_args *a);
int kvd_cpu_attn_dense_fast(const kvd_attn_dense_args *a, int nthreads);
int kvd_cpu_attn_sparse_ref(const kvd_attn_sparse_args *a);
int kvd_cpu_attn_sparse_fast(const kvd_attn_sparse_args *a, int nthreads);
int kvd_cpu_attn_int_ref(const kvd_attn_int_args *a);
int kvd_cpu_attn_int_fast(const kvd_attn_int_args *a, int nthreads);
int kvd_cpu_attn_vq_ref(const kvd_attn_vq_args *a);
int kvd_cpu_attn_vq_fast(const kvd_attn_vq_args *a, int nthreads);
int kvd_cpu_attn_svd_ref(const kvd_attn_svd_args *a);
int kvd_cpu_attn_svd_fast(const kvd_attn_svd_args *a, int nthreads);
int kvd_cpu_attn_merge_ref(const kvd_attn_merge_args *a);
int kvd_cpu_attn_merge_fast(const kvd_attn_merge_args *a);

/* Sparse attention over rows wherever they lie (CPU memory): for kv head h
 * the n tokens whose K row (head_dim elements of dtype) starts at
 * k_rows[h * n + i] and V row (v_dim elements) at v_rows[h * n + i]. The
 * same arithmetic, bit for bit, as kvd_cpu_attn_sparse_fast over a tensor
 * holding those rows in that order, without gathering them. Returns 0,
 * KVD_EINVAL (shapes, dtype, a NULL row) or KVD_ENOMEM. */
int kvd_cpu_attn_rows(const kvd_attn_dims *d, const kvd_tensor *q, kvd_dtype dtype,
                      const void *const *k_rows, const void *const *v_rows, int64_t n,
                      const kvd_tensor *out, const kvd_tensor *lse, int nthreads, kvd_error *err);

/* The int8 query quantization both INT paths use (exposed so tests can
 * rebuild the exact rounding): s = max|x| / 127 (0 when x is all zero),
 * q8_j = round-half-even(x_j / s). Returns s. */
float kvd_attn_quantize_q8(const float *x, int n, int8_t *q8);

/* ---- CPU backend internals shared by kernels/cpu/attention*.c ---------- */

#define KVD__ATTN_BLOCK 256 /* tokens per block of the online softmax (multiple of every group) */
#define KVD__ATTN_MAXG 16   /* query heads per kv head handled by the fast paths */

/* A run of tokens of one kv head, consumed block by block. scores() writes
 * the scaled scores of tokens [t0, t0+n) for the G query heads (row g at
 * s + g*ld); values() adds sum_i p[g*ld + i] * v_{t0+i} into acc (G, Dv). */
typedef struct kvd__attn_src {
    void *ctx;
    int64_t n;
    int block; /* tokens per call, <= KVD__ATTN_BLOCK */
    void (*scores)(void *ctx, int64_t t0, int n, float *s, int ld);
    void (*values)(void *ctx, int64_t t0, int n, const float *p, int ld, float *acc);
    /* optional (NULL): a source that keeps its own partial sums outside acc
     * (VQ's per-code accumulators) is told when query head g's sums are
     * scaled by f (the running max grew), and folds them into acc at the end */
    void (*rescale)(void *ctx, int g, float f);
    void (*finish)(void *ctx, float *acc);
} kvd__attn_src;

int kvd__attn_head_run(const kvd__attn_src *srcs, int nsrc, int G, int Dv, float *const *out,
                       float *const *lse, int simd);
/* The CPU's attention kernels for one call: 0 scalar, 1 AVX2 + FMA + F16C,
 * 2 those and AVX-512 F, BW and VL, unless KVD_NO_AVX512 is set in the
 * environment (the 256-bit kernels then; read once per call). */
int kvd__attn_simd(void);
/* ctxbuf: at least 64 bytes, 8-aligned, alive while src is used. */
#define KVD__ATTN_DENSE_CTX_BYTES 64
void kvd__attn_dense_src(kvd__attn_src *src, void *ctxbuf, const kvd_tensor *k,
                         const kvd_tensor *v, const int32_t *idx, int64_t n, const float *qs,
                         int G, int D, int Dv, int h, int simd);
void kvd__attn_scaled_q(const kvd_attn_dims *d, const kvd_tensor *q, int h, float *qs);
/* Rows [i, i + n) of t's first axis when it has `all` rows (any other
 * tensor, an absent one included, comes back as it is): one kv head's or
 * some query heads' part of an argument. */
kvd_tensor kvd__attn_rows(kvd_tensor t, int64_t all, int64_t i, int64_t n);
/* Part i of a call split into one kv head's query heads, `per` at a time
 * (parts: n_kv_heads x ceil(G / per)): dims, q, out and lse become that
 * part's (one kv head); returns the kv head. */
int64_t kvd__attn_part(int i, int per, kvd_attn_dims *dims, kvd_tensor *q, kvd_tensor *out,
                       kvd_tensor *lse);
/* A call with more query heads per kv head than a fast path takes at once,
 * run as its parts: fn(args, i) for i < n_kv_heads x ceil(G / per), on up
 * to nthreads threads of the pool (each part builds its call with
 * kvd__attn_part and runs it on one thread). Returns the first error. */
typedef int (*kvd__attn_part_fn)(const void *args, int i);
int kvd__attn_split(const kvd_attn_dims *d, int per, int nthreads, kvd__attn_part_fn fn,
                    const void *args);
void kvd__attn_out_ptrs(const kvd_attn_dims *d, const kvd_tensor *out, const kvd_tensor *lse,
                        int h, float **o, float **l);
void kvd__attn_ref_finish(const double *s, int64_t n, const float *vals, int Dv, float *out,
                          float *lse);

#endif /* KVDEPOT_ATTENTION_H */
