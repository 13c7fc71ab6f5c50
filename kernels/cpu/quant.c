/*
 * INT2/INT4 group quantization on the CPU: argument checks, the scalar
 * reference (the specification in kvdepot/quant.h, written per element), and
 * the multithreaded driver of the AVX2 row kernels in quant_avx2.c.
 */
#include "kvdepot/quant.h"

#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "common/cpu_internal.h"
#include "common/quant_impl.h"
#include "common/simd_avx2.h"

/* ---- format ---- */

static int check_format(int64_t ntok, int64_t dim, int bits, int group, kvd_quant_axis axis,
                        kvd_error *err)
{
    if (bits != 2 && bits != 4)
        return kvd_error_set(err, KVD_EINVAL, "quant: bits must be 2 or 4, got %d", bits);
    if (group != 8 && group != 16 && group != 32 && group != 64 && group != 128)
        return kvd_error_set(err, KVD_EINVAL,
                             "quant: group size must be 8, 16, 32, 64 or 128, got %d", group);
    if (axis != KVD_QAXIS_TOKEN && axis != KVD_QAXIS_CHANNEL)
        return kvd_error_set(err, KVD_EINVAL, "quant: unknown axis %d", (int)axis);
    if (ntok < 0 || dim < 0 || ntok > INT32_MAX || dim > INT32_MAX)
        return kvd_error_set(err, KVD_EINVAL,
                             "quant: tokens (%lld) and dims (%lld) must be in [0, 2^31)",
                             (long long)ntok, (long long)dim);
    if (axis == KVD_QAXIS_TOKEN && dim % group != 0)
        return kvd_error_set(err, KVD_EINVAL,
                             "quant: token-axis grouping needs head_dim (%lld) to be a multiple "
                             "of the group size %d",
                             (long long)dim, group);
    if (axis == KVD_QAXIS_CHANNEL && ntok % group != 0)
        return kvd_error_set(err, KVD_EINVAL,
                             "quant: channel-axis grouping needs the token count (%lld) to be a "
                             "multiple of the group size %d",
                             (long long)ntok, group);
    return KVD_OK;
}

int kvd_quant_size(int64_t ntok, int64_t dim, int bits, int group, kvd_quant_axis axis,
                   kvd_quant_sizes *out, kvd_error *err)
{
    if (out)
        memset(out, 0, sizeof *out);
    int rc = check_format(ntok, dim, bits, group, axis, err);
    if (rc)
        return rc;
    if (!out)
        return kvd_error_set(err, KVD_EINVAL, "quant: out is NULL");
    size_t n = (size_t)ntok * (size_t)dim;
    out->codes_bytes = n * (size_t)bits / 8;
    out->ngroups = n / (size_t)group;
    out->params_bytes = 3 * out->ngroups * sizeof(uint16_t);
    out->total_bytes = out->codes_bytes + out->params_bytes;
    return KVD_OK;
}

int kvd_qtensor_init(kvd_qtensor *q, int64_t ntok, int64_t dim, int bits, int group,
                     kvd_quant_axis axis, void *buf, kvd_error *err)
{
    if (!q)
        return kvd_error_set(err, KVD_EINVAL, "quant: q is NULL");
    memset(q, 0, sizeof *q);
    kvd_quant_sizes s;
    int rc = kvd_quant_size(ntok, dim, bits, group, axis, &s, err);
    if (rc)
        return rc;
    q->bits = bits;
    q->group = group;
    q->axis = axis;
    q->ntok = ntok;
    q->dim = dim;
    if (buf) {
        /* codes_bytes = T*D*bits/8 is even: T*D is a multiple of 32. */
        uint8_t *p = buf;
        q->codes = p;
        q->min = (uint16_t *)(p + s.codes_bytes);
        q->scale = q->min + s.ngroups;
        q->sum = q->scale + s.ngroups;
    }
    return KVD_OK;
}

float kvd_quant_stochastic_u(uint64_t seed, uint32_t index)
{
    return kvd__qdraw(kvd__qkey(seed), index);
}

/* ---- scalar reference ---- */

static inline float ld2(const kvd_tensor *x, int64_t t, int64_t d)
{
    return kvd__load_float((const char *)x->data + t * x->stride[0] + d * x->stride[1], x->dtype);
}

/* Quantize one group of `group` values: element k is (t0 + k*dt, d0 + k*dd). */
static void quant_group_ref(const kvd_tensor *x, const kvd_qtensor *q, int64_t t0, int64_t d0,
                            int64_t dt, int64_t dd, int stochastic, uint32_t key, uint8_t *codes,
                            int64_t code0, uint16_t *min, uint16_t *scale, uint16_t *sum)
{
    const int P = q->group, bits = q->bits, per = 8 / bits;
    const float qmax = (float)((1 << bits) - 1);
    float lo = INFINITY, hi = -INFINITY;
    for (int k = 0; k < P; k++) {
        float v = ld2(x, t0 + k * dt, d0 + k * dd);
        if (isfinite(v)) {
            if (v < lo)
                lo = v;
            if (v > hi)
                hi = v;
        }
    }
    kvd__qgroup g = kvd__qgroup_make(lo, hi, bits);
    *min = g.min_h;
    *scale = g.scale_h;
    uint32_t s = 0;
    for (int k = 0; k < P; k++) {
        int64_t t = t0 + k * dt, d = d0 + k * dd;
        float add = stochastic ? kvd__qdraw(key, (uint32_t)(t * q->dim + d)) : 0.5f;
        uint32_t c = kvd__qcode(ld2(x, t, d), g.mn, g.inv, add, qmax);
        s += c;
        int64_t pos = code0 + k; /* position of this value inside its code row */
        uint8_t *byte = codes + pos / per;
        int shift = (int)(pos % per) * bits;
        if (shift == 0)
            *byte = 0;
        *byte |= (uint8_t)(c << shift);
    }
    *sum = (uint16_t)s;
}

void kvd_quantize_ref(const kvd_tensor *x, const kvd_qtensor *q, kvd_rounding rounding,
                      uint64_t seed)
{
    const int64_t T = q->ntok, D = q->dim;
    const int P = q->group;
    const int stochastic = rounding == KVD_ROUND_STOCHASTIC;
    const uint32_t key = kvd__qkey(seed);
    if (q->axis == KVD_QAXIS_TOKEN) {
        const int64_t ng = D / P, rowbytes = D * q->bits / 8;
        for (int64_t t = 0; t < T; t++)
            for (int64_t g = 0; g < ng; g++)
                quant_group_ref(x, q, t, g * P, 0, 1, stochastic, key, q->codes + t * rowbytes,
                                g * P, &q->min[t * ng + g], &q->scale[t * ng + g],
                                &q->sum[t * ng + g]);
    } else {
        const int64_t ng = T / P, rowbytes = T * q->bits / 8;
        for (int64_t d = 0; d < D; d++)
            for (int64_t g = 0; g < ng; g++)
                quant_group_ref(x, q, g * P, d, 1, 0, stochastic, key, q->codes + d * rowbytes,
                                g * P, &q->min[d * ng + g], &q->scale[d * ng + g],
                                &q->sum[d * ng + g]);
    }
}

/* Code of the value at position pos of a code row. */
static inline uint32_t code_at(const uint8_t *row, int64_t pos, int bits)
{
    int per = 8 / bits;
    return (row[pos / per] >> ((pos % per) * bits)) & ((1u << bits) - 1);
}

void kvd_dequantize_ref(const kvd_qtensor *q, const kvd_tensor *y)
{
    const int64_t T = q->ntok, D = q->dim;
    const int P = q->group, bits = q->bits;
    for (int64_t t = 0; t < T; t++) {
        for (int64_t d = 0; d < D; d++) {
            int64_t row, pos, gi;
            if (q->axis == KVD_QAXIS_TOKEN) {
                row = t;
                pos = d;
                gi = t * (D / P) + d / P;
            } else {
                row = d;
                pos = t;
                gi = d * (T / P) + t / P;
            }
            int64_t rowbytes = (q->axis == KVD_QAXIS_TOKEN ? D : T) * bits / 8;
            uint32_t c = code_at(q->codes + row * rowbytes, pos, bits);
            uint16_t mh, sh; /* the parameters may lie at any address of a page */
            memcpy(&mh, (const char *)q->min + 2 * gi, 2);
            memcpy(&sh, (const char *)q->scale + 2 * gi, 2);
            float mn = kvd_f16_to_f32(mh), sc = kvd_f16_to_f32(sh);
            float prod = sc * (float)c;
            float v = mn + prod;
            kvd__store_float((char *)y->data + t * y->stride[0] + d * y->stride[1], y->dtype, v);
        }
    }
}

/* ---- fast path driver ---- */

/* Below this many elements a block runs on one thread: the fork costs more. */
#define PAR_MIN_ELEMS (64 * 1024)

/* Load row t of x (D values) as f32 into dst. */
KVD_AVX2_TARGET static void load_row(float *dst, const kvd_tensor *x, int64_t t, int64_t D)
{
    const char *src = (const char *)x->data + t * x->stride[0];
    if (x->stride[1] == (int64_t)kvd_dtype_size(x->dtype)) {
        kvd__row_to_f32_avx2(dst, src, x->dtype, D);
    } else {
        for (int64_t d = 0; d < D; d++)
            dst[d] = kvd__load_float(src + d * x->stride[1], x->dtype);
    }
}

KVD_AVX2_TARGET static void store_row(const kvd_tensor *y, int64_t t, const float *src,
                                      int64_t D)
{
    char *dst = (char *)y->data + t * y->stride[0];
    if (y->stride[1] == (int64_t)kvd_dtype_size(y->dtype)) {
        kvd__row_from_f32_avx2(dst, y->dtype, src, D);
    } else {
        for (int64_t d = 0; d < D; d++)
            kvd__store_float(dst + d * y->stride[1], y->dtype, src[d]);
    }
}

/* Tokens or tiles [lo, hi) of quantize_fast / dequantize_fast
 * (kvd__par_ranges); out of memory for scratch sets failed. */
typedef struct qjob {
    const kvd_tensor *x, *y;
    const kvd_qtensor *q;
    int64_t T, D, ng, ntile, rowbytes;
    int P, bits, stochastic;
    uint32_t key;
    atomic_int failed;
} qjob;

static float *scratch(int64_t n)
{
    return aligned_alloc(64, ((size_t)n * sizeof(float) + 63) & ~(size_t)63);
}

static void quant_tokens(void *arg, int64_t lo, int64_t hi)
{
    qjob *j = arg;
    const kvd_tensor *x = j->x;
    const kvd_qtensor *q = j->q;
    const int64_t D = j->D, ng = j->ng;
    float *rowf = scratch(D);
    if (!rowf) {
        atomic_store(&j->failed, 1);
        return;
    }
    for (int64_t t = lo; t < hi; t++) {
        const void *src = rowf;
        kvd_dtype st = KVD_DTYPE_F32;
        if (x->stride[1] == (int64_t)kvd_dtype_size(x->dtype)) {
            src = (const char *)x->data + t * x->stride[0]; /* read in place */
            st = x->dtype;
        } else {
            load_row(rowf, x, t, D);
        }
        kvd__quant_row_avx2(src, st, D, j->bits, j->P, j->stochastic, j->key, (uint32_t)(t * D), 1,
                            q->codes + t * j->rowbytes, q->min + t * ng, q->scale + t * ng,
                            q->sum + t * ng);
    }
    free(rowf);
}

static void quant_tiles(void *arg, int64_t lo, int64_t hi)
{
    const qjob *j = arg;
    const kvd_tensor *x = j->x;
    const kvd_qtensor *q = j->q;
    for (int64_t i = lo; i < hi; i++) {
        const int64_t t0 = i * j->P;
        kvd__quant_tile_channel_avx2((const char *)x->data + t0 * x->stride[0], x->stride[0],
                                     x->dtype, j->D, j->bits, j->P, j->stochastic, j->key,
                                     (uint32_t)(t0 * j->D), q->codes + t0 * j->bits / 8,
                                     j->rowbytes, q->min + i, q->scale + i, q->sum + i, j->ntile);
    }
}

static void quant_tiles_strided(void *arg, int64_t lo, int64_t hi)
{
    qjob *j = arg;
    const kvd_qtensor *q = j->q;
    const int64_t D = j->D, ntile = j->ntile;
    const int P = j->P, bits = j->bits;
    float *rowf = scratch(D), *tile = scratch(D * P);
    for (int64_t i = lo; i < hi && rowf && tile; i++) {
        const int64_t t0 = i * P;
        for (int k = 0; k < P; k++) {
            load_row(rowf, j->x, t0 + k, D);
            for (int64_t d = 0; d < D; d++)
                tile[d * P + k] = rowf[d];
        }
        for (int64_t d = 0; d < D; d++)
            kvd__quant_row_avx2(tile + d * P, KVD_DTYPE_F32, P, bits, P, j->stochastic, j->key,
                                (uint32_t)(t0 * D + d), (uint32_t)D,
                                q->codes + d * j->rowbytes + t0 * bits / 8, q->min + d * ntile + i,
                                q->scale + d * ntile + i, q->sum + d * ntile + i);
    }
    if (!rowf || !tile)
        atomic_store(&j->failed, 1);
    free(rowf);
    free(tile);
}

static int quantize_fast(kvd_backend *be, const kvd_tensor *x, const kvd_qtensor *q,
                         kvd_rounding rounding, uint64_t seed, kvd_error *err)
{
    const int64_t T = q->ntok, D = q->dim;
    const int P = q->group, bits = q->bits;
    const int nth = kvd__cpu_threads(be);
    const int threads = T * D >= PAR_MIN_ELEMS && nth > 1 ? nth : 1;
    qjob j = {.x = x,
              .q = q,
              .T = T,
              .D = D,
              .ng = D / P,
              .ntile = T / P,
              .P = P,
              .bits = bits,
              .stochastic = rounding == KVD_ROUND_STOCHASTIC,
              .key = kvd__qkey(seed)};
    atomic_init(&j.failed, 0);
    if (q->axis == KVD_QAXIS_TOKEN) {
        j.rowbytes = D * bits / 8;
        kvd__par_ranges(T, 16, threads, quant_tokens, &j);
    } else if (D % 8 == 0 && x->stride[1] == (int64_t)kvd_dtype_size(x->dtype)) {
        /* Tiles of P tokens, vectors across channels, input read in place. */
        j.rowbytes = T * bits / 8;
        kvd__par_ranges(j.ntile, 1, threads, quant_tiles, &j);
    } else {
        /* Odd channel counts or strided channels: convert each token row,
         * transpose the tile to channel-major, then each channel is one group
         * of the code layout. */
        j.rowbytes = T * bits / 8;
        kvd__par_ranges(j.ntile, 1, threads, quant_tiles_strided, &j);
    }
    if (atomic_load(&j.failed))
        return kvd_error_set(err, KVD_ENOMEM, "quantize: out of memory for scratch rows");
    return KVD_OK;
}

static void dequant_tokens(void *arg, int64_t lo, int64_t hi)
{
    qjob *j = arg;
    const kvd_qtensor *q = j->q;
    float *rowf = scratch(j->D);
    if (!rowf) {
        atomic_store(&j->failed, 1);
        return;
    }
    for (int64_t t = lo; t < hi; t++) {
        kvd__dequant_row_avx2(rowf, j->D, j->bits, j->P, q->codes + t * j->rowbytes,
                              q->min + t * j->ng, q->scale + t * j->ng);
        store_row(j->y, t, rowf, j->D);
    }
    free(rowf);
}

static void dequant_tiles(void *arg, int64_t lo, int64_t hi)
{
    const qjob *j = arg;
    const kvd_tensor *y = j->y;
    const kvd_qtensor *q = j->q;
    for (int64_t i = lo; i < hi; i++) {
        const int64_t t0 = i * j->P;
        kvd__dequant_tile_channel_avx2((char *)y->data + t0 * y->stride[0], y->stride[0], y->dtype,
                                       j->D, j->bits, j->P, q->codes + t0 * j->bits / 8,
                                       j->rowbytes, q->min + i, q->scale + i, j->ntile);
    }
}

static void dequant_tiles_strided(void *arg, int64_t lo, int64_t hi)
{
    qjob *j = arg;
    const kvd_qtensor *q = j->q;
    const int64_t D = j->D, ntile = j->ntile;
    const int P = j->P, bits = j->bits;
    float *rowf = scratch(D), *tile = scratch(D * P);
    for (int64_t i = lo; i < hi && rowf && tile; i++) {
        const int64_t t0 = i * P;
        for (int64_t d = 0; d < D; d++)
            kvd__dequant_row_avx2(tile + d * P, P, bits, P,
                                  q->codes + d * j->rowbytes + t0 * bits / 8,
                                  q->min + d * ntile + i, q->scale + d * ntile + i);
        for (int k = 0; k < P; k++) {
            for (int64_t d = 0; d < D; d++)
                rowf[d] = tile[d * P + k];
            store_row(j->y, t0 + k, rowf, D);
        }
    }
    if (!rowf || !tile)
        atomic_store(&j->failed, 1);
    free(rowf);
    free(tile);
}

static int dequantize_fast(kvd_backend *be, const kvd_qtensor *q, const kvd_tensor *y,
                           kvd_error *err)
{
    const int64_t T = q->ntok, D = q->dim;
    const int P = q->group, bits = q->bits;
    const int nth = kvd__cpu_threads(be);
    const int threads = T * D >= PAR_MIN_ELEMS && nth > 1 ? nth : 1;
    qjob j = {.y = y, .q = q, .T = T, .D = D, .ng = D / P, .ntile = T / P, .P = P, .bits = bits};
    atomic_init(&j.failed, 0);
    if (q->axis == KVD_QAXIS_TOKEN) {
        j.rowbytes = D * bits / 8;
        kvd__par_ranges(T, 16, threads, dequant_tokens, &j);
    } else if (D % 8 == 0 && y->stride[1] == (int64_t)kvd_dtype_size(y->dtype)) {
        j.rowbytes = T * bits / 8;
        kvd__par_ranges(j.ntile, 1, threads, dequant_tiles, &j);
    } else {
        j.rowbytes = T * bits / 8;
        kvd__par_ranges(j.ntile, 1, threads, dequant_tiles_strided, &j);
    }
    if (atomic_load(&j.failed))
        return kvd_error_set(err, KVD_ENOMEM, "dequantize: out of memory for scratch rows");
    return KVD_OK;
}

/* ---- CPU ops ---- */

static int cpu_quantize(kvd_backend *be, const kvd_tensor *x, const kvd_qtensor *q,
                        kvd_rounding rounding, uint64_t seed, kvd_error *err)
{
    if (!kvd__cpu_fast(be)) {
        kvd_quantize_ref(x, q, rounding, seed);
        return KVD_OK;
    }
    return quantize_fast(be, x, q, rounding, seed, err);
}

static int cpu_dequantize(kvd_backend *be, const kvd_qtensor *q, const kvd_tensor *y,
                          kvd_error *err)
{
    if (!kvd__cpu_fast(be)) {
        kvd_dequantize_ref(q, y);
        return KVD_OK;
    }
    return dequantize_fast(be, q, y, err);
}

const struct kvd_quant_ops kvd__cpu_quant_ops = {
    .quantize = cpu_quantize,
    .dequantize = cpu_dequantize,
};

/* ---- checked wrappers ---- */

static int check_qtensor(const kvd_qtensor *q, const char *op, kvd_error *err)
{
    if (!q)
        return kvd_error_set(err, KVD_EINVAL, "%s: q is NULL", op);
    int rc = check_format(q->ntok, q->dim, q->bits, q->group, q->axis, err);
    if (rc)
        return rc;
    if (q->ntok * q->dim > 0 && (!q->codes || !q->min || !q->scale || !q->sum))
        return kvd_error_set(err, KVD_EINVAL, "%s: q has a NULL codes/min/scale/sum array", op);
    return KVD_OK;
}

static int check_dense(const kvd_tensor *t, const kvd_qtensor *q, const char *op,
                       const char *name, kvd_error *err)
{
    if (!t)
        return kvd_error_set(err, KVD_EINVAL, "%s: %s is NULL", op, name);
    if (!kvd_dtype_is_float(t->dtype))
        return kvd_error_set(err, KVD_EINVAL, "%s: %s has dtype %s, want f32, f16 or bf16", op,
                             name, kvd_dtype_name(t->dtype));
    if (t->ndim != 2)
        return kvd_error_set(err, KVD_EINVAL, "%s: %s must be 2-D (tokens, head_dim), has %d dims",
                             op, name, t->ndim);
    if (t->shape[0] != q->ntok || t->shape[1] != q->dim)
        return kvd_error_set(err, KVD_EINVAL,
                             "%s: %s shape (%lld, %lld) does not match the quantized block "
                             "(%lld tokens, %lld dims)",
                             op, name, (long long)t->shape[0], (long long)t->shape[1],
                             (long long)q->ntok, (long long)q->dim);
    if (q->ntok * q->dim > 0 && !t->data)
        return kvd_error_set(err, KVD_EINVAL, "%s: %s data is NULL", op, name);
    return KVD_OK;
}

int kvd_quantize(kvd_backend *be, const kvd_tensor *x, const kvd_qtensor *q,
                 kvd_rounding rounding, uint64_t seed, kvd_error *err)
{
    int rc = check_qtensor(q, "quantize", err);
    if (rc)
        return rc;
    rc = check_dense(x, q, "quantize", "x", err);
    if (rc)
        return rc;
    if (rounding != KVD_ROUND_NEAREST && rounding != KVD_ROUND_STOCHASTIC)
        return kvd_error_set(err, KVD_EINVAL, "quantize: unknown rounding mode %d", (int)rounding);
    if (!be || !be->iface || !be->iface->quant || !be->iface->quant->quantize)
        return kvd_error_set(err, KVD_EUNSUPP, "quantize: not supported by backend %s",
                             be && be->iface ? be->iface->name : "(none)");
    if (q->ntok * q->dim == 0)
        return KVD_OK;
    return be->iface->quant->quantize(be, x, q, rounding, seed, err);
}

int kvd_quantize_batch(kvd_backend *be, int n, const kvd_tensor *x, const kvd_qtensor *q,
                       kvd_rounding rounding, const uint64_t *seeds, kvd_error *err)
{
    if (n < 0 || (n > 0 && (!x || !q || !seeds)))
        return kvd_error_set(err, KVD_EINVAL, "quantize batch: %d items, or NULL arrays", n);
    for (int i = 0; i < n; i++) {
        int rc;
        kvd_error e;
        if ((rc = check_qtensor(&q[i], "quantize", &e)) ||
            (rc = check_dense(&x[i], &q[i], "quantize", "x", &e)))
            return kvd_error_set(err, rc, "quantize batch item %d: %s", i, e.msg);
        if (q[i].bits != q[0].bits || q[i].group != q[0].group || q[i].axis != q[0].axis ||
            q[i].ntok != q[0].ntok || q[i].dim != q[0].dim || x[i].dtype != x[0].dtype)
            return kvd_error_set(err, KVD_EINVAL,
                                 "quantize batch item %d: format or dtype differs from item 0", i);
    }
    if (rounding != KVD_ROUND_NEAREST && rounding != KVD_ROUND_STOCHASTIC)
        return kvd_error_set(err, KVD_EINVAL, "quantize: unknown rounding mode %d", (int)rounding);
    if (!be || !be->iface || !be->iface->quant || !be->iface->quant->quantize)
        return kvd_error_set(err, KVD_EUNSUPP, "quantize: not supported by backend %s",
                             be && be->iface ? be->iface->name : "(none)");
    if (n == 0 || q[0].ntok * q[0].dim == 0)
        return KVD_OK;
    if (be->iface->quant->quantize_batch)
        return be->iface->quant->quantize_batch(be, n, x, q, rounding, seeds, err);
    for (int i = 0; i < n; i++) {
        int rc = be->iface->quant->quantize(be, &x[i], &q[i], rounding, seeds[i], err);
        if (rc)
            return rc;
    }
    return KVD_OK;
}

int kvd_dequantize(kvd_backend *be, const kvd_qtensor *q, const kvd_tensor *y, kvd_error *err)
{
    int rc = check_qtensor(q, "dequantize", err);
    if (rc)
        return rc;
    rc = check_dense(y, q, "dequantize", "y", err);
    if (rc)
        return rc;
    if (!be || !be->iface || !be->iface->quant || !be->iface->quant->dequantize)
        return kvd_error_set(err, KVD_EUNSUPP, "dequantize: not supported by backend %s",
                             be && be->iface ? be->iface->name : "(none)");
    if (q->ntok * q->dim == 0)
        return KVD_OK;
    return be->iface->quant->dequantize(be, q, y, err);
}
