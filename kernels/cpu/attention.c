/*
 * Decode attention on the CPU: argument checks and wrappers for every form,
 * the blocked online-softmax driver the fast paths share, dense and sparse
 * float attention, and the log-sum-exp merge. The INT, VQ and SVD forms live
 * in attention_int.c, attention_vq.c and attention_svd.c.
 *
 * Fast-path shape: one task per (item, kv head). The task streams the kv
 * head's tokens once in blocks of KVD__ATTN_BLOCK, computing the scores of
 * all G query heads of the group from each key row while it is in registers
 * (K is read once, not G times), then folds the block into G running
 * (max, sum, accumulator) triples and streams the V rows of the block the
 * same way. No buffer grows with T.
 */
#include "kvdepot/attention.h"

#include <immintrin.h>
#include <math.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include "common/cpu_internal.h"

/* ---------------------------------------------------------------------- */
/* Argument checks                                                        */
/* ---------------------------------------------------------------------- */

static int check_dims(const kvd_attn_dims *d, int item, kvd_error *err)
{
    if (d->n_kv_heads <= 0 || d->n_q_heads <= 0 || d->n_q_heads % d->n_kv_heads)
        return kvd_error_set(err, KVD_EINVAL,
                             "attention item %d: %d query heads not a positive multiple of %d kv heads",
                             item, d->n_q_heads, d->n_kv_heads);
    if (d->head_dim < 0 || d->v_dim < 0 || d->head_dim > 4096 || d->v_dim > 4096)
        return kvd_error_set(err, KVD_EINVAL, "attention item %d: head_dim %d / v_dim %d out of range",
                             item, d->head_dim, d->v_dim);
    if (!isfinite(d->softmax_scale))
        return kvd_error_set(err, KVD_EINVAL, "attention item %d: softmax_scale not finite", item);
    return 0;
}

/* Tensor of dtype (or any float dtype when dt == 0), rank nd, given shape
 * (-1 = any), innermost dimension contiguous, data non-NULL unless empty. */
static int check_tensor(const kvd_tensor *t, kvd_dtype dt, int nd, const int64_t *shape,
                        const char *name, int item, kvd_error *err)
{
    if (dt ? t->dtype != dt : !kvd_dtype_is_float(t->dtype))
        return kvd_error_set(err, KVD_EINVAL, "attention item %d: %s has dtype %s, want %s", item,
                             name, kvd_dtype_name(t->dtype), dt ? kvd_dtype_name(dt) : "f32|f16|bf16");
    if (t->ndim != nd)
        return kvd_error_set(err, KVD_EINVAL, "attention item %d: %s has %d dims, want %d", item,
                             name, t->ndim, nd);
    int64_t n = 1;
    for (int i = 0; i < nd; i++) {
        if (t->shape[i] < 0 || (shape[i] >= 0 && t->shape[i] != shape[i]))
            return kvd_error_set(err, KVD_EINVAL,
                                 "attention item %d: %s dim %d is %lld, want %lld", item, name, i,
                                 (long long)t->shape[i], (long long)shape[i]);
        n *= t->shape[i];
    }
    if (nd > 0 && t->shape[nd - 1] > 1 && t->stride[nd - 1] != (int64_t)kvd_dtype_size(t->dtype))
        return kvd_error_set(err, KVD_EINVAL, "attention item %d: %s innermost dim not contiguous",
                             item, name);
    if (n > 0 && !t->data)
        return kvd_error_set(err, KVD_EINVAL, "attention item %d: %s data is NULL", item, name);
    return 0;
}

static int check_qol(const kvd_attn_dims *d, const kvd_tensor *q, const kvd_tensor *out,
                     const kvd_tensor *lse, int item, kvd_error *err)
{
    int rc;
    int64_t qs[2] = {d->n_q_heads, d->head_dim}, os[2] = {d->n_q_heads, d->v_dim},
            ls[1] = {d->n_q_heads};
    if ((rc = check_dims(d, item, err)) || (rc = check_tensor(q, KVD_DTYPE_F32, 2, qs, "q", item, err)) ||
        (rc = check_tensor(out, KVD_DTYPE_F32, 2, os, "out", item, err)) ||
        (rc = check_tensor(lse, KVD_DTYPE_F32, 1, ls, "lse", item, err)))
        return rc;
    return 0;
}

static int check_kv(const kvd_attn_dims *d, const kvd_tensor *k, const kvd_tensor *v,
                    int64_t T, const char *kn, const char *vn, int item, kvd_error *err)
{
    int rc;
    int64_t ks[3] = {d->n_kv_heads, T, d->head_dim}, vs[3] = {d->n_kv_heads, T, d->v_dim};
    if ((rc = check_tensor(k, 0, 3, ks, kn, item, err)) || (rc = check_tensor(v, 0, 3, vs, vn, item, err)))
        return rc;
    return 0;
}

static int check_items(int n, const void *a, kvd_error *err)
{
    if (n < 0 || (n > 0 && !a))
        return kvd_error_set(err, KVD_EINVAL, "attention: %d items at %p", n, a);
    return 0;
}

int kvd_attn_dense_check(const kvd_attn_dense_args *a, kvd_error *err)
{
    int rc = check_qol(&a->dims, &a->q, &a->out, &a->lse, 0, err);
    if (rc)
        return rc;
    if (a->k.ndim != 3)
        return kvd_error_set(err, KVD_EINVAL, "attention: k must be (Hkv, T, D)");
    return check_kv(&a->dims, &a->k, &a->v, a->k.shape[1], "k", "v", 0, err);
}

/* Shapes and dtypes only: what can be checked without reading the index
 * list (device memory on a device backend). */
static int sparse_check_shapes(const kvd_attn_sparse_args *a, kvd_error *err)
{
    int rc = check_qol(&a->dims, &a->q, &a->out, &a->lse, 0, err);
    if (rc)
        return rc;
    if (a->k.ndim != 3)
        return kvd_error_set(err, KVD_EINVAL, "sparse attention: k must be (Hkv, T, D)");
    int64_t T = a->k.shape[1];
    if ((rc = check_kv(&a->dims, &a->k, &a->v, T, "k", "v", 0, err)))
        return rc;
    int64_t is[2] = {a->dims.n_kv_heads, -1};
    return check_tensor(&a->idx, KVD_DTYPE_I32, 2, is, "idx", 0, err);
}

int kvd_attn_sparse_check(const kvd_attn_sparse_args *a, kvd_error *err)
{
    int rc = sparse_check_shapes(a, err);
    if (rc)
        return rc;
    int64_t T = a->k.shape[1];
    for (int64_t h = 0; h < a->idx.shape[0]; h++)
        for (int64_t i = 0; i < a->idx.shape[1]; i++) {
            int32_t t;
            memcpy(&t, (const char *)a->idx.data + h * a->idx.stride[0] + i * 4, 4);
            if (t < 0 || t >= T)
                return kvd_error_set(err, KVD_EINVAL,
                                     "sparse attention: idx[%lld][%lld] = %d outside [0, %lld)",
                                     (long long)h, (long long)i, t, (long long)T);
        }
    return 0;
}

static int check_qdata(const kvd_attn_qdata *qd, int Hkv, int64_t T, int W, const char *name,
                       kvd_error *err)
{
    int rc;
    if (qd->bits != 2 && qd->bits != 4)
        return kvd_error_set(err, KVD_EINVAL, "INT attention: %s bits %d (want 2 or 4)", name, qd->bits);
    int per = 8 / qd->bits;
    int64_t along = qd->axis == KVD_ATTN_AXIS_TOKEN ? W : T;
    if (qd->axis != KVD_ATTN_AXIS_TOKEN && qd->axis != KVD_ATTN_AXIS_CHANNEL)
        return kvd_error_set(err, KVD_EINVAL, "INT attention: %s axis %d", name, qd->axis);
    if (qd->group <= 0 || qd->group % per || along % qd->group)
        return kvd_error_set(err, KVD_EINVAL,
                             "INT attention: %s group %d does not divide %lld or is not a multiple of %d",
                             name, qd->group, (long long)along, per);
    int64_t rows = qd->axis == KVD_ATTN_AXIS_TOKEN ? T : W;
    int64_t cs[3] = {Hkv, rows, along / per}, ps[3] = {Hkv, rows, along / qd->group};
    if ((rc = check_tensor(&qd->codes, KVD_DTYPE_U8, 3, cs, "codes", 0, err)) ||
        (rc = check_tensor(&qd->min, KVD_DTYPE_F16, 3, ps, "min", 0, err)) ||
        (rc = check_tensor(&qd->scale, KVD_DTYPE_F16, 3, ps, "scale", 0, err)) ||
        (rc = check_tensor(&qd->sum, KVD_DTYPE_U16, 3, ps, "sum", 0, err)))
        return rc;
    return 0;
}

/* The segments of a call (segs: n structs of `size` bytes, each starting
 * with its n_tokens) must add up to the call's n_tokens. */
_Static_assert(offsetof(kvd_attn_int_segment, n_tokens) == 0, "n_tokens first");
_Static_assert(offsetof(kvd_attn_vq_segment, n_tokens) == 0, "n_tokens first");
_Static_assert(offsetof(kvd_attn_svd_segment, n_tokens) == 0, "n_tokens first");
static int check_segment_tokens(const char *form, const void *segs, size_t size, int n,
                                int64_t n_tokens, kvd_error *err)
{
    if (n < 0 || (n > 0 && !segs))
        return kvd_error_set(err, KVD_EINVAL, "%s attention: %d segments at %p", form, n, segs);
    int64_t sum = 0;
    for (int i = 0; i < n; i++) {
        int64_t t;
        memcpy(&t, (const char *)segs + (size_t)i * size, sizeof t);
        if (t < 0 || t > n_tokens - sum)
            return kvd_error_set(err, KVD_EINVAL,
                                 "%s attention: segment %d of %lld tokens (%lld before it, "
                                 "n_tokens %lld)",
                                 form, i, (long long)t, (long long)sum, (long long)n_tokens);
        sum += t;
    }
    if (n && sum != n_tokens)
        return kvd_error_set(err, KVD_EINVAL,
                             "%s attention: the segments hold %lld tokens, n_tokens %lld", form,
                             (long long)sum, (long long)n_tokens);
    return 0;
}

int kvd_attn_int_check(const kvd_attn_int_args *a, kvd_error *err)
{
    int rc = check_qol(&a->dims, &a->q, &a->out, &a->lse, 0, err);
    if (rc)
        return rc;
    if (a->n_tokens < 0)
        return kvd_error_set(err, KVD_EINVAL, "INT attention: n_tokens %lld", (long long)a->n_tokens);
    if (a->n_tokens > 0 && a->k.axis == KVD_ATTN_AXIS_CHANNEL && KVD__ATTN_BLOCK % a->k.group)
        return kvd_error_set(err, KVD_EINVAL,
                             "INT attention: channel-grouped keys need a group dividing %d, got %d",
                             KVD__ATTN_BLOCK, a->k.group);
    if ((rc = check_segment_tokens("INT", a->segments, sizeof *a->segments, a->n_segments,
                                   a->n_tokens, err)))
        return rc;
    for (int i = 0; i < a->n_segments; i++) {
        const kvd_attn_int_segment *g = &a->segments[i];
        if (g->k.bits != a->k.bits || g->k.group != a->k.group || g->k.axis != a->k.axis ||
            g->v.bits != a->v.bits || g->v.group != a->v.group || g->v.axis != a->v.axis)
            return kvd_error_set(err, KVD_EINVAL,
                                 "INT attention: segment %d is coded otherwise than the call "
                                 "(bits, group, axis)",
                                 i);
        if (g->n_tokens > 0 && ((rc = check_qdata(&g->k, a->dims.n_kv_heads, g->n_tokens,
                                                  a->dims.head_dim, "segment k", err)) ||
                                (rc = check_qdata(&g->v, a->dims.n_kv_heads, g->n_tokens,
                                                  a->dims.v_dim, "segment v", err))))
            return rc;
    }
    if (!a->n_segments && a->n_tokens > 0 &&
        ((rc = check_qdata(&a->k, a->dims.n_kv_heads, a->n_tokens, a->dims.head_dim, "k", err)) ||
         (rc = check_qdata(&a->v, a->dims.n_kv_heads, a->n_tokens, a->dims.v_dim, "v", err))))
        return rc;
    int64_t Tt = a->k_tail.ndim == 3 ? a->k_tail.shape[1] : 0;
    if (a->k_tail.ndim == 0 && a->v_tail.ndim == 0)
        return 0;
    return check_kv(&a->dims, &a->k_tail, &a->v_tail, Tt, "k_tail", "v_tail", 0, err);
}

int kvd_attn_vq_check(const kvd_attn_vq_args *a, kvd_error *err)
{
    int rc = check_qol(&a->dims, &a->q, &a->out, &a->lse, 0, err);
    if (rc)
        return rc;
    const kvd_attn_dims *d = &a->dims;
    if (a->n_tokens < 0)
        return kvd_error_set(err, KVD_EINVAL, "VQ attention: n_tokens %lld", (long long)a->n_tokens);
    if ((rc = check_segment_tokens("VQ", a->segments, sizeof *a->segments, a->n_segments,
                                   a->n_tokens, err)))
        return rc;
    if (a->n_tokens > 0) {
        int sub[2] = {a->k_sub_dim, a->v_sub_dim}, bits[2] = {a->k_bits, a->v_bits},
            W[2] = {d->head_dim, d->v_dim};
        const kvd_tensor *codes[2] = {&a->k_codes, &a->v_codes}, *cb[2] = {&a->k_codebook, &a->v_codebook};
        for (int s = 0; s < 2; s++) {
            const char *nm = s ? "v" : "k";
            if (sub[s] <= 0 || W[s] % sub[s] || bits[s] < 1 || bits[s] > 16)
                return kvd_error_set(err, KVD_EINVAL, "VQ attention: %s sub_dim %d / bits %d invalid for width %d",
                                     nm, sub[s], bits[s], W[s]);
            int64_t cs[3] = {d->n_kv_heads, a->n_tokens, W[s] / sub[s]};
            int64_t bs[3] = {d->n_kv_heads, (int64_t)1 << bits[s], sub[s]};
            const kvd_dtype ct = bits[s] <= 8 ? KVD_DTYPE_U8 : KVD_DTYPE_U16;
            if ((!a->n_segments &&
                 (rc = check_tensor(codes[s], ct, 3, cs, s ? "v_codes" : "k_codes", 0, err))) ||
                (rc = check_tensor(cb[s], KVD_DTYPE_F32, 3, bs, s ? "v_codebook" : "k_codebook", 0,
                                   err)))
                return rc;
            for (int i = 0; i < a->n_segments; i++) {
                const kvd_attn_vq_segment *g = &a->segments[i];
                cs[1] = g->n_tokens;
                if ((rc = check_tensor(s ? &g->v_codes : &g->k_codes, ct, 3, cs,
                                       s ? "segment v_codes" : "segment k_codes", 0, err)))
                    return rc;
            }
        }
        if (a->k_lambda.data) {
            int64_t ls[2] = {d->n_kv_heads, d->head_dim};
            if ((rc = check_tensor(&a->k_lambda, KVD_DTYPE_F32, 2, ls, "k_lambda", 0, err)))
                return rc;
        }
        if (a->k_hadamard && (d->head_dim & (d->head_dim - 1)))
            return kvd_error_set(err, KVD_EINVAL, "VQ attention: Hadamard needs a power-of-two head_dim, got %d",
                                 d->head_dim);
    }
    if (a->k_tail.ndim == 0 && a->v_tail.ndim == 0)
        return 0;
    int64_t Tt = a->k_tail.ndim == 3 ? a->k_tail.shape[1] : 0;
    return check_kv(d, &a->k_tail, &a->v_tail, Tt, "k_tail", "v_tail", 0, err);
}

int kvd_attn_svd_check(const kvd_attn_svd_args *a, kvd_error *err)
{
    int rc = check_qol(&a->dims, &a->q, &a->out, &a->lse, 0, err);
    if (rc)
        return rc;
    const kvd_attn_dims *d = &a->dims;
    int64_t rk[3] = {d->n_kv_heads, d->head_dim, d->head_dim}, rv[3] = {d->n_kv_heads, d->v_dim, d->v_dim};
    if ((rc = check_tensor(&a->rk, KVD_DTYPE_F32, 3, rk, "rk", 0, err)) ||
        (rc = check_tensor(&a->rv, KVD_DTYPE_F32, 3, rv, "rv", 0, err)))
        return rc;
    if (!kvd_tensor_is_contiguous(&a->rk) || !kvd_tensor_is_contiguous(&a->rv))
        return kvd_error_set(err, KVD_EINVAL, "SVD attention: rotations must be contiguous");
    if (a->n_tokens < 0 || !kvd_dtype_is_float(a->dtype) || !a->k_width || !a->v_width)
        return kvd_error_set(err, KVD_EINVAL, "SVD attention: bad n_tokens, dtype or widths");
    for (int h = 0; h < d->n_kv_heads; h++)
        if (a->k_width[h] < 0 || a->k_width[h] > d->head_dim || a->v_width[h] < 0 ||
            a->v_width[h] > d->v_dim)
            return kvd_error_set(err, KVD_EINVAL, "SVD attention: kv head %d widths %d/%d out of range",
                                 h, a->k_width[h], a->v_width[h]);
    if ((rc = check_segment_tokens("SVD", a->segments, sizeof *a->segments, a->n_segments,
                                   a->n_tokens, err)))
        return rc;
    for (int i = 0; i < a->n_segments; i++)
        if (a->segments[i].n_tokens > 0 && (!a->segments[i].k_red || !a->segments[i].v_red))
            return kvd_error_set(err, KVD_EINVAL, "SVD attention: segment %d data is NULL", i);
    if (!a->n_segments && a->n_tokens > 0 && (!a->k_red || !a->v_red))
        return kvd_error_set(err, KVD_EINVAL, "SVD attention: reduced K/V data is NULL");
    return 0;
}

int kvd_attn_merge_check(const kvd_attn_merge_args *a, kvd_error *err)
{
    int rc;
    int64_t os[2] = {-1, -1};
    if ((rc = check_tensor(&a->out_a, KVD_DTYPE_F32, 2, os, "out_a", 0, err)))
        return rc;
    os[0] = a->out_a.shape[0];
    os[1] = a->out_a.shape[1];
    int64_t ls[1] = {os[0]};
    if ((rc = check_tensor(&a->out_b, KVD_DTYPE_F32, 2, os, "out_b", 0, err)) ||
        (rc = check_tensor(&a->out, KVD_DTYPE_F32, 2, os, "out", 0, err)) ||
        (rc = check_tensor(&a->lse_a, KVD_DTYPE_F32, 1, ls, "lse_a", 0, err)) ||
        (rc = check_tensor(&a->lse_b, KVD_DTYPE_F32, 1, ls, "lse_b", 0, err)) ||
        (rc = check_tensor(&a->lse, KVD_DTYPE_F32, 1, ls, "lse", 0, err)))
        return rc;
    return 0;
}

#define KVD__ATTN_WRAPPER(fn, argt, check, member)                                         \
    int fn(kvd_backend *be, int n, const argt *a, kvd_error *err)                          \
    {                                                                                      \
        int rc;                                                                            \
        if (!be || !be->iface)                                                             \
            return kvd_error_set(err, KVD_EINVAL, #fn ": no backend");                     \
        if ((rc = check_items(n, a, err)))                                                 \
            return rc;                                                                     \
        for (int i = 0; i < n; i++)                                                        \
            if ((rc = check(&a[i], err))) {                                                \
                if (err && n > 1) {                                                        \
                    char m[sizeof err->msg];                                               \
                    memcpy(m, err->msg, sizeof m);                                         \
                    kvd_error_set(err, rc, "item %d: %s", i, m);                           \
                }                                                                          \
                return rc;                                                                 \
            }                                                                              \
        if (!be->iface->attn || !be->iface->attn->member)                                  \
            return kvd_error_set(err, KVD_EUNSUPP, "backend %s: no " #member " attention", \
                                 be->iface->name);                                         \
        if (n == 0)                                                                        \
            return 0;                                                                      \
        return be->iface->attn->member(be, n, a, err);                                     \
    }

KVD__ATTN_WRAPPER(kvd_attn_dense, kvd_attn_dense_args, kvd_attn_dense_check, dense)
/* The index values live in backend memory: the CPU backend's wrapper checks
 * them here, a device backend checks them in its kernel (same error). */
static int sparse_check_device(const kvd_attn_sparse_args *a, kvd_error *err)
{
    return sparse_check_shapes(a, err);
}
static KVD__ATTN_WRAPPER(kvd__attn_sparse_host, kvd_attn_sparse_args, kvd_attn_sparse_check, sparse)
static KVD__ATTN_WRAPPER(kvd__attn_sparse_device, kvd_attn_sparse_args, sparse_check_device, sparse)

int kvd_attn_sparse(kvd_backend *be, int n, const kvd_attn_sparse_args *a, kvd_error *err)
{
    if (be && be->iface && be->iface->name && strcmp(be->iface->name, "cpu") != 0)
        return kvd__attn_sparse_device(be, n, a, err);
    return kvd__attn_sparse_host(be, n, a, err);
}
KVD__ATTN_WRAPPER(kvd_attn_quant, kvd_attn_int_args, kvd_attn_int_check, quant)
KVD__ATTN_WRAPPER(kvd_attn_vq, kvd_attn_vq_args, kvd_attn_vq_check, vq)
KVD__ATTN_WRAPPER(kvd_attn_svd, kvd_attn_svd_args, kvd_attn_svd_check, svd)
KVD__ATTN_WRAPPER(kvd_attn_merge, kvd_attn_merge_args, kvd_attn_merge_check, merge)

int kvd_attn_merge_into(kvd_backend *be, int64_t hq, int64_t dv, float *out, float *lse,
                        const float *out_b, const float *lse_b, kvd_error *err)
{
    int64_t os[2] = {hq, dv}, ls[1] = {hq};
    kvd_attn_merge_args m;
    m.out_a = kvd_tensor_make(KVD_DTYPE_F32, out, 2, os);
    m.lse_a = kvd_tensor_make(KVD_DTYPE_F32, lse, 1, ls);
    m.out_b = kvd_tensor_make(KVD_DTYPE_F32, (void *)out_b, 2, os);
    m.lse_b = kvd_tensor_make(KVD_DTYPE_F32, (void *)lse_b, 1, ls);
    m.out = m.out_a;
    m.lse = m.lse_a;
    return kvd_attn_merge(be, 1, &m, err);
}

/* ---------------------------------------------------------------------- */
/* Shared helpers                                                         */
/* ---------------------------------------------------------------------- */

float kvd_attn_quantize_q8(const float *x, int n, int8_t *q8)
{
    float amax = 0.0f;
    for (int i = 0; i < n; i++) {
        float a = fabsf(x[i]);
        if (a > amax || a != a)
            amax = a;
    }
    if (!(amax > 0.0f) || !isfinite(amax)) {
        /* all zero, or NaN/Inf in q: codes 0; the caller's scale carries the
         * NaN/Inf into every score so the result is NaN, as for float q. */
        for (int i = 0; i < n; i++)
            q8[i] = 0;
        return amax > 0.0f || amax != amax ? amax : 0.0f;
    }
    float s = amax / 127.0f;
    for (int i = 0; i < n; i++) {
        float v = rintf(x[i] / s);
        v = v > 127.0f ? 127.0f : v < -127.0f ? -127.0f : v;
        q8[i] = (int8_t)v;
    }
    return s;
}

static inline float row_elem(const void *row, kvd_dtype t, int64_t j)
{
    switch (t) {
    case KVD_DTYPE_F16:
        return kvd_f16_to_f32(((const uint16_t *)row)[j]);
    case KVD_DTYPE_BF16:
        return kvd_bf16_to_f32(((const uint16_t *)row)[j]);
    default:
        return ((const float *)row)[j];
    }
}

/* Row (h, t) of a (H, T, W) tensor. */
static inline const void *row3(const kvd_tensor *x, int64_t h, int64_t t)
{
    return (const char *)x->data + h * x->stride[0] + t * x->stride[1];
}

static inline float *out_row(const kvd_tensor *o, int64_t h)
{
    return (float *)((char *)o->data + h * o->stride[0]);
}

static inline float *lse_at(const kvd_tensor *l, int64_t h)
{
    return (float *)((char *)l->data + h * l->stride[0]);
}

/*
 * Reference softmax-and-sum for one query head given its scores over n
 * tokens (double): writes out (Dv) and lse. vrow(i) returns the value row
 * of token i as f32 via `vals` (n, Dv) already converted. Empty or all -inf
 * scores give lse = -inf and out = 0.
 */
void kvd__attn_ref_finish(const double *s, int64_t n, const float *vals, int Dv, float *out,
                          float *lse)
{
    double m = -INFINITY;
    int nan = 0;
    for (int64_t i = 0; i < n; i++) {
        if (s[i] != s[i])
            nan = 1;
        else if (s[i] > m)
            m = s[i];
    }
    if (nan) {
        *lse = NAN;
        for (int j = 0; j < Dv; j++)
            out[j] = NAN;
        return;
    }
    if (m == -INFINITY) {
        *lse = -INFINITY;
        memset(out, 0, sizeof(float) * (size_t)Dv);
        return;
    }
    double l = 0.0;
    double *acc = calloc((size_t)Dv + 1, sizeof *acc);
    for (int64_t i = 0; i < n; i++) {
        double p = exp(s[i] - m); /* NaN when s[i] = m = +inf, as float code */
        l += p;
        if (p != 0.0 || p != p)
            for (int j = 0; j < Dv; j++)
                acc[j] += p * (double)vals[i * Dv + j];
    }
    *lse = (float)(m + log(l));
    for (int j = 0; j < Dv; j++)
        out[j] = (float)(acc[j] / l);
    free(acc);
}

/* ---------------------------------------------------------------------- */
/* Dense / sparse references                                              */
/* ---------------------------------------------------------------------- */

static int dense_ref_common(const kvd_attn_dims *d, const kvd_tensor *q, const kvd_tensor *k,
                            const kvd_tensor *v, const kvd_tensor *idx, const kvd_tensor *out,
                            const kvd_tensor *lse)
{
    int G = d->n_q_heads / d->n_kv_heads, D = d->head_dim, Dv = d->v_dim;
    int64_t n = idx ? idx->shape[1] : k->shape[1];
    double *s = malloc(sizeof(double) * (size_t)(n + 1));
    float *vals = malloc(sizeof(float) * (size_t)(n * Dv + 1));
    if (!s || !vals) {
        free(s);
        free(vals);
        return KVD_ENOMEM;
    }
    for (int h = 0; h < d->n_kv_heads; h++) {
        const int32_t *ix = idx ? (const int32_t *)((const char *)idx->data + h * idx->stride[0]) : NULL;
        for (int64_t i = 0; i < n; i++) {
            int64_t t = ix ? ix[i] : i;
            const void *vr = row3(v, h, t);
            for (int j = 0; j < Dv; j++)
                vals[i * Dv + j] = row_elem(vr, v->dtype, j);
        }
        for (int g = 0; g < G; g++) {
            int hq = h * G + g;
            const float *qr = (const float *)((const char *)q->data + hq * q->stride[0]);
            for (int64_t i = 0; i < n; i++) {
                int64_t t = ix ? ix[i] : i;
                const void *kr = row3(k, h, t);
                double dot = 0.0;
                for (int j = 0; j < D; j++)
                    dot += (double)qr[j] * (double)row_elem(kr, k->dtype, j);
                s[i] = dot * (double)d->softmax_scale;
            }
            kvd__attn_ref_finish(s, n, vals, Dv, out_row(out, hq), lse_at(lse, hq));
        }
    }
    free(s);
    free(vals);
    return 0;
}

int kvd_cpu_attn_dense_ref(const kvd_attn_dense_args *a)
{
    return dense_ref_common(&a->dims, &a->q, &a->k, &a->v, NULL, &a->out, &a->lse);
}

int kvd_cpu_attn_sparse_ref(const kvd_attn_sparse_args *a)
{
    return dense_ref_common(&a->dims, &a->q, &a->k, &a->v, &a->idx, &a->out, &a->lse);
}

/* ---------------------------------------------------------------------- */
/* The blocked online-softmax driver                                      */
/* ---------------------------------------------------------------------- */

/* exp(x) for 8 floats: range reduction by ln 2, degree-6 polynomial,
 * relative error ~2 ulp; x < -87 gives 0, NaN stays NaN. */
__attribute__((target("avx2,fma"))) static inline __m256 exp8(__m256 x)
{
    const __m256 lo = _mm256_set1_ps(-87.0f), hi = _mm256_set1_ps(88.0f);
    __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    __m256 xc = _mm256_min_ps(hi, _mm256_max_ps(lo, x)); /* NaN x passes through */
    __m256 n = _mm256_round_ps(_mm256_mul_ps(xc, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), xc);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    __m256 y = _mm256_mul_ps(p, _mm256_castsi256_ps(e));
    return _mm256_andnot_ps(under, y);
}

/* p[i] = exp(s[i] - m) for i < n; returns sum p. */
static float exp_sub_sum(float *p, const float *s, int n, float m, int simd);

/* The 8 lanes of acc summed (pairwise), then p[i..n) = exp(s - m) one by
 * one added: the end of exp_sub_sum_avx2 and exp_sub_sum_512. */
__attribute__((target("avx2,fma"))) static inline float
exp_sum_rest(__m256 acc, float *p, const float *s, int i, int n, float m)
{
    float buf[8];
    _mm256_storeu_ps(buf, acc);
    float sum = ((buf[0] + buf[1]) + (buf[2] + buf[3])) + ((buf[4] + buf[5]) + (buf[6] + buf[7]));
    for (; i < n; i++) {
        p[i] = expf(s[i] - m);
        sum += p[i];
    }
    return sum;
}

__attribute__((target("avx2,fma"))) static float exp_sub_sum_avx2(float *p, const float *s, int n,
                                                                  float m)
{
    __m256 vm = _mm256_set1_ps(m), acc = _mm256_setzero_ps();
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + i), vm));
        _mm256_storeu_ps(p + i, e);
        acc = _mm256_add_ps(acc, e);
    }
    return exp_sum_rest(acc, p, s, i, n, m);
}

/* exp8 on 16 lanes: the same operations, so the same bits in each lane. */
__attribute__((target("avx512f"))) static inline __m512 exp16(__m512 x)
{
    const __m512 lo = _mm512_set1_ps(-87.0f), hi = _mm512_set1_ps(88.0f);
    const __mmask16 under = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
    /* NaN x passes through, as in exp8 (max/min return the second operand
     * when either is NaN) */
    __m512 xc = _mm512_min_ps(hi, _mm512_max_ps(lo, x));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(xc, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), xc);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    __m512i e =
        _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    __m512 y = _mm512_mul_ps(p, _mm512_castsi512_ps(e));
    return _mm512_maskz_mov_ps((__mmask16)~under, y);
}

/* exp_sub_sum_avx2 16 lanes a step: the same exponentials, and the sum in
 * exp_sub_sum_avx2's order (each half added into one 8-lane sum in turn):
 * the same bits. */
__attribute__((target("avx512f,avx2,fma"))) static float exp_sub_sum_512(float *p, const float *s,
                                                                         int n, float m)
{
    const __m512 vm = _mm512_set1_ps(m);
    __m256 acc = _mm256_setzero_ps();
    int i = 0;
    for (; i + 16 <= n; i += 16) {
        __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(s + i), vm));
        _mm512_storeu_ps(p + i, e);
        acc = _mm256_add_ps(acc, _mm512_castps512_ps256(e));
        acc = _mm256_add_ps(acc, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(e), 1)));
    }
    for (; i + 8 <= n; i += 8) {
        __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + i), _mm256_set1_ps(m)));
        _mm256_storeu_ps(p + i, e);
        acc = _mm256_add_ps(acc, e);
    }
    return exp_sum_rest(acc, p, s, i, n, m);
}

static float exp_sub_sum(float *p, const float *s, int n, float m, int simd)
{
    if (simd == 2)
        return exp_sub_sum_512(p, s, n, m);
    if (simd)
        return exp_sub_sum_avx2(p, s, n, m);
    float sum = 0.0f;
    for (int i = 0; i < n; i++) {
        p[i] = expf(s[i] - m);
        sum += p[i];
    }
    return sum;
}

/* max of s[0..n), NaN if any is NaN, -inf if n == 0 */
__attribute__((target("avx2,fma"))) static float block_max_avx2(const float *s, int n)
{
    __m256 m = _mm256_set1_ps(-INFINITY), bad = _mm256_setzero_ps();
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 x = _mm256_loadu_ps(s + i);
        m = _mm256_max_ps(m, x);
        bad = _mm256_or_ps(bad, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    }
    float b[8];
    _mm256_storeu_ps(b, m);
    float r = b[0];
    for (int j = 1; j < 8; j++)
        r = b[j] > r ? b[j] : r;
    int nan = _mm256_movemask_ps(bad) != 0;
    for (; i < n; i++) {
        r = s[i] > r ? s[i] : r;
        nan |= s[i] != s[i];
    }
    return nan ? NAN : r;
}

static float block_max(const float *s, int n, int simd)
{
    if (simd)
        return block_max_avx2(s, n);
    float r = -INFINITY;
    int nan = 0;
    for (int i = 0; i < n; i++) {
        r = s[i] > r ? s[i] : r;
        nan |= s[i] != s[i];
    }
    return nan ? NAN : r;
}

/*
 * Run one kv head over nsrc token sources in order (e.g. quantized blocks,
 * then the raw tail). For every block: src->scores writes G x n scaled
 * scores (row stride KVD__ATTN_BLOCK), the driver turns them into
 * probabilities relative to the running max (rescaling earlier sums when the
 * max grows), src->values adds sum_i p[g][i] v_i into acc (G x Dv). At the
 * end out_g = acc_g / l_g, lse_g = m_g + ln l_g.
 */
int kvd__attn_head_run(const kvd__attn_src *srcs, int nsrc, int G, int Dv, float *const *out,
                       float *const *lse, int simd)
{
    float *s = malloc(sizeof(float) * ((size_t)2 * G * KVD__ATTN_BLOCK + (size_t)G * Dv + 16));
    if (!s)
        return KVD_ENOMEM;
    float *p = s + (size_t)G * KVD__ATTN_BLOCK, *acc = p + (size_t)G * KVD__ATTN_BLOCK;
    float m[KVD__ATTN_MAXG], l[KVD__ATTN_MAXG];
    memset(acc, 0, sizeof(float) * (size_t)G * Dv);
    for (int g = 0; g < G; g++) {
        m[g] = -INFINITY;
        l[g] = 0.0f;
    }
    for (int si = 0; si < nsrc; si++) {
        const kvd__attn_src *src = &srcs[si];
        int B = src->block > 0 && src->block <= KVD__ATTN_BLOCK ? src->block : KVD__ATTN_BLOCK;
        for (int64_t t0 = 0; t0 < src->n; t0 += B) {
            int n = (int)(src->n - t0 < B ? src->n - t0 : B);
            src->scores(src->ctx, t0, n, s, KVD__ATTN_BLOCK);
            int any = 0;
            for (int g = 0; g < G; g++) {
                float *sg = s + (size_t)g * KVD__ATTN_BLOCK, *pg = p + (size_t)g * KVD__ATTN_BLOCK;
                float bm = block_max(sg, n, simd);
                float nm = (m[g] != m[g] || bm != bm) ? NAN : bm > m[g] ? bm : m[g];
                if (nm == -INFINITY) {
                    memset(pg, 0, sizeof(float) * (size_t)n);
                    continue; /* nothing so far counts */
                }
                if (!(nm == m[g])) {
                    /* the max grew (or became NaN): rescale what was summed */
                    float f = m[g] == -INFINITY ? 0.0f : expf(m[g] - nm);
                    l[g] *= f;
                    float *ag = acc + (size_t)g * Dv;
                    for (int j = 0; j < Dv; j++)
                        ag[j] *= f;
                    if (src->rescale)
                        src->rescale(src->ctx, g, f);
                    m[g] = nm;
                }
                l[g] += exp_sub_sum(pg, sg, n, m[g], simd);
                any = 1;
            }
            if (any)
                src->values(src->ctx, t0, n, p, KVD__ATTN_BLOCK, acc);
        }
        if (src->finish)
            src->finish(src->ctx, acc);
    }
    for (int g = 0; g < G; g++) {
        float *o = out[g], *ag = acc + (size_t)g * Dv;
        if (m[g] == -INFINITY) {
            *lse[g] = -INFINITY;
            memset(o, 0, sizeof(float) * (size_t)Dv);
            continue;
        }
        float inv = 1.0f / l[g];
        for (int j = 0; j < Dv; j++)
            o[j] = ag[j] * inv;
        *lse[g] = m[g] + logf(l[g]);
    }
    free(s);
    return 0;
}

/* ---------------------------------------------------------------------- */
/* Dense / sparse fast path                                               */
/* ---------------------------------------------------------------------- */

typedef struct dense_ctx dense_ctx;
_Static_assert(sizeof(void *) * 6 + 16 <= KVD__ATTN_DENSE_CTX_BYTES, "dense ctx size");
struct dense_ctx {
    const kvd_tensor *k, *v;
    const int32_t *idx;      /* NULL: dense */
    const void *const *krow; /* non-NULL: the head's rows lie here (k, v, idx unused) */
    const void *const *vrow;
    const float *q; /* G x D, already multiplied by softmax_scale */
    int G, D, Dv, h;
};

/* Rows that lie anywhere (krow/vrow): while tokens [i, i + tok) of a block
 * are scored, the K rows of the tokens KVD__ROW_AHEAD further on are asked
 * for, and these tokens' V rows, which the block's value pass reads next
 * (scattered rows defeat the hardware's prefetcher; each is a cache miss,
 * often a TLB miss too). */
#define KVD__ROW_AHEAD 8
static inline void prefetch_rows(const dense_ctx *c, int64_t t0, int i, int n, int tok, int kbytes,
                                 int vbytes)
{
    for (int u = 0; u < tok; u++) {
        if (i + u + KVD__ROW_AHEAD < n) {
            const char *k = c->krow[t0 + i + u + KVD__ROW_AHEAD];
            for (int o = 0; o < kbytes; o += 64)
                __builtin_prefetch(k + o);
        }
        const char *v = c->vrow[t0 + i + u];
        for (int o = 0; o < vbytes; o += 64)
            __builtin_prefetch(v + o);
    }
}

/* K and V rows of token t of the context's head. */
static inline const char *k_at(const dense_ctx *c, int64_t t)
{
    if (c->krow)
        return c->krow[t];
    return (const char *)c->k->data + c->h * c->k->stride[0] +
           (c->idx ? c->idx[t] : t) * c->k->stride[1];
}

static inline const char *v_at(const dense_ctx *c, int64_t t)
{
    if (c->vrow)
        return c->vrow[t];
    return (const char *)c->v->data + c->h * c->v->stride[0] +
           (c->idx ? c->idx[t] : t) * c->v->stride[1];
}

/* Convert 8 elements at p (dtype t) to f32. */
__attribute__((target("avx2,fma,f16c"))) static inline __m256 load8(const void *p, kvd_dtype t)
{
    if (t == KVD_DTYPE_F16)
        return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
    if (t == KVD_DTYPE_BF16)
        return _mm256_castsi256_ps(
            _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
    return _mm256_loadu_ps((const float *)p);
}

/* Horizontal sums of 8 vectors into one: r[i] = sum(v[i]). */
__attribute__((target("avx2,fma"))) static inline __m256 hsum8x8(const __m256 *v)
{
    __m256 a = _mm256_hadd_ps(v[0], v[1]), b = _mm256_hadd_ps(v[2], v[3]);
    __m256 c = _mm256_hadd_ps(v[4], v[5]), d = _mm256_hadd_ps(v[6], v[7]);
    __m256 ab = _mm256_hadd_ps(a, b), cd = _mm256_hadd_ps(c, d);
    /* ab = [s0 s1 s2 s3 | s0' s1' s2' s3'] (low/high 128-bit halves) */
    __m256 lo = _mm256_permute2f128_ps(ab, cd, 0x20), hi = _mm256_permute2f128_ps(ab, cd, 0x31);
    return _mm256_add_ps(lo, hi);
}

/*
 * Scores of a block. TOK = 8/GB tokens times GB query heads make 8
 * accumulators that stay in registers; every K chunk is converted once and
 * every q chunk loaded once per TOK tokens. GB and DT are compile-time
 * constants at every call (always_inline), so the loops unroll and the
 * dtype switch disappears.
 */
__attribute__((target("avx2,fma,f16c"), always_inline)) static inline void
scores_tile(const dense_ctx *c, int64_t t0, int n, float *s, int ld, int g0, const int GB,
            const kvd_dtype DT)
{
    const int TOK = 8 / GB, esz = DT == KVD_DTYPE_F32 ? 4 : 2, D = c->D;
    int i = 0;
    for (; i + TOK <= n; i += TOK) {
        if (c->krow && g0 == 0) /* once per token, in the first tile of heads */
            prefetch_rows(c, t0, i, n, TOK, D * esz, c->Dv * esz);
        const char *kr[8];
        _Pragma("GCC unroll 8") for (int u = 0; u < TOK; u++) kr[u] = k_at(c, t0 + i + u);
        __m256 acc[8];
        _Pragma("GCC unroll 8")
        for (int a = 0; a < 8; a++)
            acc[a] = _mm256_setzero_ps();
        for (int j = 0; j < D; j += 8) {
            __m256 kv[8], qv[8];
            _Pragma("GCC unroll 8")
            for (int u = 0; u < TOK; u++)
                kv[u] = load8(kr[u] + (size_t)j * esz, DT);
            _Pragma("GCC unroll 8")
            for (int g = 0; g < GB; g++)
                qv[g] = _mm256_loadu_ps(c->q + (size_t)(g0 + g) * D + j);
            _Pragma("GCC unroll 8")
            for (int u = 0; u < TOK; u++)
                _Pragma("GCC unroll 8")
                for (int g = 0; g < GB; g++)
                    acc[u * GB + g] = _mm256_fmadd_ps(kv[u], qv[g], acc[u * GB + g]);
        }
        float r[8];
        _mm256_storeu_ps(r, hsum8x8(acc));
        _Pragma("GCC unroll 8")
        for (int u = 0; u < TOK; u++)
            _Pragma("GCC unroll 8")
            for (int g = 0; g < GB; g++)
                s[(size_t)(g0 + g) * ld + i + u] = r[u * GB + g];
    }
    for (; i < n; i++) { /* leftover tokens, one at a time */
        const char *kr = k_at(c, t0 + i);
        __m256 acc[8];
        _Pragma("GCC unroll 8")
        for (int a = 0; a < 8; a++)
            acc[a] = _mm256_setzero_ps();
        for (int j = 0; j < D; j += 8) {
            __m256 kv = load8(kr + (size_t)j * esz, DT);
            _Pragma("GCC unroll 8")
            for (int g = 0; g < GB; g++)
                acc[g] = _mm256_fmadd_ps(kv, _mm256_loadu_ps(c->q + (size_t)(g0 + g) * D + j), acc[g]);
        }
        float r[8];
        _mm256_storeu_ps(r, hsum8x8(acc));
        _Pragma("GCC unroll 8")
        for (int g = 0; g < GB; g++)
            s[(size_t)(g0 + g) * ld + i] = r[g];
    }
}

#define KVD__SCORES_DT(DT)                                                 \
    __attribute__((target("avx2,fma,f16c"))) static void scores_##DT(     \
        void *vctx, int64_t t0, int n, float *s, int ld)                   \
    {                                                                      \
        const dense_ctx *c = vctx;                                         \
        int g0 = 0;                                                        \
        for (; g0 + 8 <= c->G; g0 += 8)                                    \
            scores_tile(c, t0, n, s, ld, g0, 8, KVD_DTYPE_##DT);           \
        if (c->G - g0 >= 4) {                                              \
            scores_tile(c, t0, n, s, ld, g0, 4, KVD_DTYPE_##DT);           \
            g0 += 4;                                                       \
        }                                                                  \
        if (c->G - g0 >= 2) {                                              \
            scores_tile(c, t0, n, s, ld, g0, 2, KVD_DTYPE_##DT);           \
            g0 += 2;                                                       \
        }                                                                  \
        if (c->G - g0 >= 1)                                                \
            scores_tile(c, t0, n, s, ld, g0, 1, KVD_DTYPE_##DT);           \
    }
KVD__SCORES_DT(F16)
KVD__SCORES_DT(BF16)
KVD__SCORES_DT(F32)

/* acc[g][:] += sum_i p[g][i] v_i for Dv % 8 == 0: tiles of 32 output dims x
 * GB <= 4 query heads live in registers while the block's rows stream by. */
__attribute__((target("avx2,fma,f16c"), always_inline)) static inline void
values_tile(const dense_ctx *c, const char *const *rows, int n, const float *p, int ld, float *acc,
            int g0, const int GB, const kvd_dtype DT)
{
    const int esz = DT == KVD_DTYPE_F32 ? 4 : 2, Dv = c->Dv;
    for (int j0 = 0; j0 < Dv; j0 += 32) {
        int jn = Dv - j0 < 32 ? (Dv - j0) / 8 : 4;
        __m256 a[4][4];
        if (jn == 4) {
            _Pragma("GCC unroll 8")
            for (int g = 0; g < GB; g++)
                _Pragma("GCC unroll 8")
                for (int jj = 0; jj < 4; jj++)
                    a[g][jj] = _mm256_loadu_ps(acc + (size_t)(g0 + g) * Dv + j0 + 8 * jj);
            for (int i = 0; i < n; i++) {
                const char *vr = rows[i] + (size_t)j0 * esz;
                __m256 v[4];
                _Pragma("GCC unroll 8")
                for (int jj = 0; jj < 4; jj++)
                    v[jj] = load8(vr + (size_t)8 * jj * esz, DT);
                _Pragma("GCC unroll 8")
                for (int g = 0; g < GB; g++) {
                    __m256 b = _mm256_broadcast_ss(p + (size_t)(g0 + g) * ld + i);
                    _Pragma("GCC unroll 8")
                    for (int jj = 0; jj < 4; jj++)
                        a[g][jj] = _mm256_fmadd_ps(b, v[jj], a[g][jj]);
                }
            }
            _Pragma("GCC unroll 8")
            for (int g = 0; g < GB; g++)
                _Pragma("GCC unroll 8")
                for (int jj = 0; jj < 4; jj++)
                    _mm256_storeu_ps(acc + (size_t)(g0 + g) * Dv + j0 + 8 * jj, a[g][jj]);
        } else {
            _Pragma("GCC unroll 8")
            for (int jj = 0; jj < jn; jj++) {
                _Pragma("GCC unroll 8")
                for (int g = 0; g < GB; g++)
                    a[g][0] = _mm256_loadu_ps(acc + (size_t)(g0 + g) * Dv + j0 + 8 * jj);
                for (int i = 0; i < n; i++) {
                    __m256 v = load8(rows[i] + (size_t)(j0 + 8 * jj) * esz, DT);
                    _Pragma("GCC unroll 8")
                    for (int g = 0; g < GB; g++)
                        a[g][0] = _mm256_fmadd_ps(_mm256_broadcast_ss(p + (size_t)(g0 + g) * ld + i), v, a[g][0]);
                }
                _Pragma("GCC unroll 8")
                for (int g = 0; g < GB; g++)
                    _mm256_storeu_ps(acc + (size_t)(g0 + g) * Dv + j0 + 8 * jj, a[g][0]);
            }
        }
    }
}

#define KVD__VALUES_DT(DT)                                                                         \
    __attribute__((target("avx2,fma,f16c"))) static void values_##DT(                              \
        void *vctx, int64_t t0, int n, const float *p, int ld, float *acc)                         \
    {                                                                                              \
        const dense_ctx *c = vctx;                                                                 \
        const char *rows[KVD__ATTN_BLOCK];                                                         \
        for (int i = 0; i < n; i++)                                                                \
            rows[i] = v_at(c, t0 + i);                                                             \
        int g0 = 0;                                                                                \
        for (; g0 + 4 <= c->G; g0 += 4)                                                            \
            values_tile(c, rows, n, p, ld, acc, g0, 4, KVD_DTYPE_##DT);                            \
        if (c->G - g0 >= 2) {                                                                      \
            values_tile(c, rows, n, p, ld, acc, g0, 2, KVD_DTYPE_##DT);                            \
            g0 += 2;                                                                               \
        }                                                                                          \
        if (c->G - g0 >= 1)                                                                        \
            values_tile(c, rows, n, p, ld, acc, g0, 1, KVD_DTYPE_##DT);                            \
    }
KVD__VALUES_DT(F16)
KVD__VALUES_DT(BF16)
KVD__VALUES_DT(F32)

/* Portable block callbacks (any D, Dv, dtype). */
static void dense_scores_scalar(void *vctx, int64_t t0, int n, float *s, int ld)
{
    const dense_ctx *c = vctx;
    for (int i = 0; i < n; i++) {
        const void *kr = k_at(c, t0 + i);
        for (int g = 0; g < c->G; g++) {
            const float *qg = c->q + (size_t)g * c->D;
            float dot = 0.0f;
            for (int j = 0; j < c->D; j++)
                dot += qg[j] * row_elem(kr, c->k->dtype, j);
            s[(size_t)g * ld + i] = dot;
        }
    }
}

static void dense_values_scalar(void *vctx, int64_t t0, int n, const float *p, int ld, float *acc)
{
    const dense_ctx *c = vctx;
    for (int i = 0; i < n; i++) {
        const void *vr = v_at(c, t0 + i);
        for (int g = 0; g < c->G; g++) {
            float pg = p[(size_t)g * ld + i];
            if (pg == 0.0f)
                continue;
            float *ag = acc + (size_t)g * c->Dv;
            for (int j = 0; j < c->Dv; j++)
                ag[j] += pg * row_elem(vr, c->v->dtype, j);
        }
    }
}

int kvd__attn_simd(void)
{
    if (!kvd__cpu_has_avx2_fma_f16c())
        return 0;
    return kvd__cpu_has(KVD__CPU_AVX512F | KVD__CPU_AVX512BW | KVD__CPU_AVX512VL) &&
                   !getenv("KVD_NO_AVX512")
               ? 2
               : 1;
}

/* Fill a dense/sparse token source for kv head h (also used for raw tails). */
void kvd__attn_dense_src(kvd__attn_src *src, void *ctxbuf, const kvd_tensor *k,
                         const kvd_tensor *v, const int32_t *idx, int64_t n, const float *qs,
                         int G, int D, int Dv, int h, int simd)
{
    dense_ctx *c = ctxbuf;
    c->k = k;
    c->v = v;
    c->idx = idx;
    c->krow = c->vrow = NULL;
    c->q = qs;
    c->G = G;
    c->D = D;
    c->Dv = Dv;
    c->h = h;
    src->ctx = c;
    src->n = n;
    src->block = KVD__ATTN_BLOCK;
    int vec = simd && D % 8 == 0 && Dv % 8 == 0 && G <= KVD__ATTN_MAXG;
    src->scores = dense_scores_scalar;
    src->values = dense_values_scalar;
    if (vec) {
        src->scores = k->dtype == KVD_DTYPE_F16 ? scores_F16 : k->dtype == KVD_DTYPE_BF16 ? scores_BF16 : scores_F32;
        src->values = v->dtype == KVD_DTYPE_F16 ? values_F16 : v->dtype == KVD_DTYPE_BF16 ? values_BF16 : values_F32;
    }
    src->rescale = NULL;
    src->finish = NULL;
}

kvd_tensor kvd__attn_rows(kvd_tensor t, int64_t all, int64_t i, int64_t n)
{
    if (t.ndim >= 1 && t.data && t.shape[0] == all) {
        t.data = (char *)t.data + i * t.stride[0];
        t.shape[0] = n;
    }
    return t;
}

int64_t kvd__attn_part(int i, int per, kvd_attn_dims *dims, kvd_tensor *q, kvd_tensor *out,
                       kvd_tensor *lse)
{
    const int G = dims->n_q_heads / dims->n_kv_heads, chunks = (G + per - 1) / per;
    const int64_t Hq = dims->n_q_heads, h = i / chunks;
    const int g0 = (i % chunks) * per, gn = G - g0 < per ? G - g0 : per;
    *q = kvd__attn_rows(*q, Hq, h * G + g0, gn);
    *out = kvd__attn_rows(*out, Hq, h * G + g0, gn);
    *lse = kvd__attn_rows(*lse, Hq, h * G + g0, gn);
    dims->n_q_heads = gn;
    dims->n_kv_heads = 1;
    return h;
}

/* The parts of kvd__attn_split on the pool; the first error kept. */
typedef struct split_job {
    kvd__attn_part_fn fn;
    const void *args;
    atomic_int rc;
} split_job;

static void split_item(void *arg, int i)
{
    split_job *j = arg;
    int rc = j->fn(j->args, i);
    if (rc)
        atomic_store(&j->rc, rc);
}

int kvd__attn_split(const kvd_attn_dims *d, int per, int nthreads, kvd__attn_part_fn fn,
                    const void *args)
{
    const int G = d->n_q_heads / d->n_kv_heads;
    split_job j = {.fn = fn, .args = args};
    atomic_init(&j.rc, 0);
    kvd__par_for(d->n_kv_heads * ((G + per - 1) / per), nthreads, split_item, &j);
    return atomic_load(&j.rc);
}

/* Scaled queries of kv head h: qs[g][j] = softmax_scale * q[h*G+g][j]. */
void kvd__attn_scaled_q(const kvd_attn_dims *d, const kvd_tensor *q, int h, float *qs)
{
    int G = d->n_q_heads / d->n_kv_heads;
    for (int g = 0; g < G; g++) {
        const float *qr = (const float *)((const char *)q->data + (int64_t)(h * G + g) * q->stride[0]);
        for (int j = 0; j < d->head_dim; j++)
            qs[(size_t)g * d->head_dim + j] = qr[j] * d->softmax_scale;
    }
}

void kvd__attn_out_ptrs(const kvd_attn_dims *d, const kvd_tensor *out, const kvd_tensor *lse,
                        int h, float **o, float **l)
{
    int G = d->n_q_heads / d->n_kv_heads;
    for (int g = 0; g < G; g++) {
        o[g] = out_row(out, h * G + g);
        l[g] = lse_at(lse, h * G + g);
    }
}

/* One kv head of dense_fast_common or kvd_cpu_attn_rows (kvd__par_for):
 * its query heads in groups of at most KVD__ATTN_MAXG (each query head's
 * sums are its own, so the grouping leaves every bit as it is). */
typedef struct dense_job {
    const kvd_attn_dims *d;
    const kvd_tensor *q, *k, *v, *idx, *out, *lse;
    const void *const *krows, *const *vrows; /* rows: head h's n at [h * n] */
    int G, D, Dv, simd;
    int64_t n;
    atomic_int rc;
} dense_job;

static void dense_head(void *arg, int h)
{
    dense_job *job = arg;
    const int G = job->G, D = job->D, Dv = job->Dv, simd = job->simd;
    float *qs = malloc(sizeof(float) * (size_t)G * D + 32);
    if (!qs) {
        atomic_store(&job->rc, KVD_ENOMEM);
        return;
    }
    kvd__attn_scaled_q(job->d, job->q, h, qs);
    const int32_t *ix =
        job->idx ? (const int32_t *)((const char *)job->idx->data + h * job->idx->stride[0]) : NULL;
    for (int g0 = 0; g0 < G; g0 += KVD__ATTN_MAXG) {
        const int gn = G - g0 < KVD__ATTN_MAXG ? G - g0 : KVD__ATTN_MAXG;
        dense_ctx c;
        kvd__attn_src src;
        kvd__attn_dense_src(&src, &c, job->k, job->v, ix, job->n, qs + (size_t)g0 * D, gn, D, Dv, h,
                            simd);
        if (job->krows) {
            c.krow = job->krows + (size_t)h * job->n;
            c.vrow = job->vrows + (size_t)h * job->n;
        }
        float *o[KVD__ATTN_MAXG], *l[KVD__ATTN_MAXG];
        for (int g = 0; g < gn; g++) {
            o[g] = out_row(job->out, (int64_t)h * G + g0 + g);
            l[g] = lse_at(job->lse, (int64_t)h * G + g0 + g);
        }
        int r = kvd__attn_head_run(&src, 1, gn, Dv, o, l, simd);
        if (r)
            atomic_store(&job->rc, r);
    }
    free(qs);
}

static int dense_fast_common(const kvd_attn_dims *d, const kvd_tensor *q, const kvd_tensor *k,
                             const kvd_tensor *v, const kvd_tensor *idx, const kvd_tensor *out,
                             const kvd_tensor *lse, int nthreads)
{
    int G = d->n_q_heads / d->n_kv_heads, D = d->head_dim, Dv = d->v_dim;
    dense_job j = {.d = d,
                   .q = q,
                   .k = k,
                   .v = v,
                   .idx = idx,
                   .out = out,
                   .lse = lse,
                   .G = G,
                   .D = D,
                   .Dv = Dv,
                   .simd = kvd__attn_simd(),
                   .n = idx ? idx->shape[1] : k->shape[1]};
    atomic_init(&j.rc, 0);
    kvd__par_for(d->n_kv_heads, nthreads, dense_head, &j);
    return atomic_load(&j.rc);
}

int kvd_cpu_attn_dense_fast(const kvd_attn_dense_args *a, int nthreads)
{
    return dense_fast_common(&a->dims, &a->q, &a->k, &a->v, NULL, &a->out, &a->lse, nthreads);
}

int kvd_cpu_attn_sparse_fast(const kvd_attn_sparse_args *a, int nthreads)
{
    return dense_fast_common(&a->dims, &a->q, &a->k, &a->v, &a->idx, &a->out, &a->lse, nthreads);
}

int kvd_cpu_attn_rows(const kvd_attn_dims *d, const kvd_tensor *q, kvd_dtype dtype,
                      const void *const *k_rows, const void *const *v_rows, int64_t n,
                      const kvd_tensor *out, const kvd_tensor *lse, int nthreads, kvd_error *err)
{
    int rc = check_qol(d, q, out, lse, 0, err);
    if (rc)
        return rc;
    if (dtype != KVD_DTYPE_F32 && dtype != KVD_DTYPE_F16 && dtype != KVD_DTYPE_BF16)
        return kvd_error_set(err, KVD_EINVAL, "attention over rows: dtype %s is not a float",
                             kvd_dtype_name(dtype));
    if (n < 0 || (n > 0 && (!k_rows || !v_rows)))
        return kvd_error_set(err, KVD_EINVAL, "attention over rows: %lld rows at %p / %p",
                             (long long)n, (const void *)k_rows, (const void *)v_rows);
    for (int64_t i = 0; i < n * d->n_kv_heads; i++)
        if (!k_rows[i] || !v_rows[i])
            return kvd_error_set(err, KVD_EINVAL, "attention over rows: row %lld is NULL",
                                 (long long)i);
    kvd_tensor kt = {.dtype = dtype}, vt = {.dtype = dtype}; /* dtype only: rows elsewhere */
    dense_job j = {.d = d,
                   .q = q,
                   .k = &kt,
                   .v = &vt,
                   .out = out,
                   .lse = lse,
                   .krows = k_rows,
                   .vrows = v_rows,
                   .G = d->n_q_heads / d->n_kv_heads,
                   .D = d->head_dim,
                   .Dv = d->v_dim,
                   .simd = kvd__attn_simd(),
                   .n = n};
    atomic_init(&j.rc, 0);
    kvd__par_for(d->n_kv_heads, nthreads, dense_head, &j);
    if ((rc = atomic_load(&j.rc)))
        return kvd_error_set(err, rc, "attention over rows: %s", kvd_strerror(rc));
    return 0;
}

/* ---------------------------------------------------------------------- */
/* Merge                                                                  */
/* ---------------------------------------------------------------------- */

int kvd_cpu_attn_merge_ref(const kvd_attn_merge_args *a)
{
    int64_t H = a->out_a.shape[0], Dv = a->out_a.shape[1];
    for (int64_t h = 0; h < H; h++) {
        double la = *lse_at(&a->lse_a, h), lb = *lse_at(&a->lse_b, h);
        const float *oa = out_row(&a->out_a, h), *ob = out_row(&a->out_b, h);
        float *o = out_row(&a->out, h);
        double m = la > lb ? la : lb, wa, wb, l;
        if (la != la || lb != lb) {
            m = NAN;
        }
        if (m == -INFINITY) {
            wa = wb = 0.0;
            l = -INFINITY;
        } else {
            double ea = exp(la - m), eb = exp(lb - m); /* -inf side -> 0 */
            l = m + log(ea + eb);
            wa = ea / (ea + eb);
            wb = eb / (ea + eb);
        }
        for (int64_t j = 0; j < Dv; j++) {
            double x = 0.0;
            if (wa != 0.0 || wa != wa)
                x += wa * oa[j];
            if (wb != 0.0 || wb != wb)
                x += wb * ob[j];
            o[j] = (float)x;
        }
        *lse_at(&a->lse, h) = (float)l;
    }
    return 0;
}

int kvd_cpu_attn_merge_fast(const kvd_attn_merge_args *a)
{
    /* O(Hq * Dv) per step: the reference in float is already at memory speed. */
    int64_t H = a->out_a.shape[0], Dv = a->out_a.shape[1];
    for (int64_t h = 0; h < H; h++) {
        float la = *lse_at(&a->lse_a, h), lb = *lse_at(&a->lse_b, h);
        const float *oa = out_row(&a->out_a, h), *ob = out_row(&a->out_b, h);
        float *o = out_row(&a->out, h);
        float m = la > lb ? la : lb, wa, wb, l;
        if (la != la || lb != lb)
            m = NAN;
        if (m == -INFINITY) {
            wa = wb = 0.0f;
            l = -INFINITY;
        } else {
            float ea = expf(la - m), eb = expf(lb - m);
            l = m + logf(ea + eb);
            wa = ea / (ea + eb);
            wb = eb / (ea + eb);
        }
        for (int64_t j = 0; j < Dv; j++) {
            float x = 0.0f;
            if (wa != 0.0f || wa != wa)
                x += wa * oa[j];
            if (wb != 0.0f || wb != wb)
                x += wb * ob[j];
            o[j] = x;
        }
        *lse_at(&a->lse, h) = l;
    }
    return 0;
}

/* ---------------------------------------------------------------------- */
/* The CPU backend's table                                                */
/* ---------------------------------------------------------------------- */

/* Items of one call: with at least as many items as threads (a sequence's
 * pages, say), the items run side by side, each on one thread (one fork
 * and join per call rather than one per item); fewer items run one after
 * another, each on every thread. Either way an item's bits are the same:
 * its kv heads are computed independently. */
typedef struct item_job {
    int (*one)(const void *a, int i);
    const void *a;
    atomic_int rc, bad;
} item_job;

static void item_run(void *arg, int i)
{
    item_job *j = arg;
    int rc = j->one(j->a, i);
    int zero = 0;
    if (rc && atomic_compare_exchange_strong(&j->rc, &zero, rc))
        atomic_store(&j->bad, i);
}

#define KVD__CPU_ATTN_OP(name, argt, ref, fast, fast1)                                             \
    static int name##_one(const void *arg, int i)                                                  \
    {                                                                                              \
        const argt *a = arg;                                                                       \
        return fast1;                                                                              \
    }                                                                                              \
    static int name(kvd_backend *be, int n, const argt *a, kvd_error *err)                         \
    {                                                                                              \
        int use_fast = kvd__cpu_fast(be), nt = kvd__cpu_threads(be);                               \
        if (use_fast && nt > 1 && n >= nt) {                                                       \
            item_job j = {.one = name##_one, .a = a};                                              \
            atomic_init(&j.rc, 0);                                                                 \
            atomic_init(&j.bad, 0);                                                                \
            kvd__par_for(n, nt, item_run, &j);                                                     \
            int rc = atomic_load(&j.rc);                                                           \
            return rc ? kvd_error_set(err, rc, "attention item %d: %s", atomic_load(&j.bad),       \
                                      kvd_strerror(rc))                                            \
                      : 0;                                                                         \
        }                                                                                          \
        for (int i = 0; i < n; i++) {                                                              \
            int rc = use_fast ? fast : ref;                                                        \
            if (rc)                                                                                \
                return kvd_error_set(err, rc, "attention item %d: %s", i, kvd_strerror(rc));       \
        }                                                                                          \
        return 0;                                                                                  \
    }

KVD__CPU_ATTN_OP(cpu_dense, kvd_attn_dense_args, kvd_cpu_attn_dense_ref(&a[i]),
                 kvd_cpu_attn_dense_fast(&a[i], nt), kvd_cpu_attn_dense_fast(&a[i], 1))
KVD__CPU_ATTN_OP(cpu_sparse, kvd_attn_sparse_args, kvd_cpu_attn_sparse_ref(&a[i]),
                 kvd_cpu_attn_sparse_fast(&a[i], nt), kvd_cpu_attn_sparse_fast(&a[i], 1))
KVD__CPU_ATTN_OP(cpu_quant, kvd_attn_int_args, kvd_cpu_attn_int_ref(&a[i]),
                 kvd_cpu_attn_int_fast(&a[i], nt), kvd_cpu_attn_int_fast(&a[i], 1))
KVD__CPU_ATTN_OP(cpu_vq, kvd_attn_vq_args, kvd_cpu_attn_vq_ref(&a[i]),
                 kvd_cpu_attn_vq_fast(&a[i], nt), kvd_cpu_attn_vq_fast(&a[i], 1))
KVD__CPU_ATTN_OP(cpu_svd, kvd_attn_svd_args, kvd_cpu_attn_svd_ref(&a[i]),
                 kvd_cpu_attn_svd_fast(&a[i], nt), kvd_cpu_attn_svd_fast(&a[i], 1))
KVD__CPU_ATTN_OP(cpu_merge, kvd_attn_merge_args, kvd_cpu_attn_merge_ref(&a[i]),
                 kvd_cpu_attn_merge_fast(&a[i]), kvd_cpu_attn_merge_fast(&a[i]))

const struct kvd_attn_ops kvd__cpu_attn_ops = {
    .dense = cpu_dense,
    .sparse = cpu_sparse,
    .quant = cpu_quant,
    .vq = cpu_vq,
    .svd = cpu_svd,
    .merge = cpu_merge,
};
