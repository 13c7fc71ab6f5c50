/*
 * dtype conversion, Walsh-Hadamard transform and per-channel scaling on the
 * CPU: checked wrappers, scalar references (the specification, see
 * kvdepot/convert.h) and the multithreaded driver of the AVX2 kernels in
 * convert_avx2.c.
 *
 * Every op works row by row: a row is the last dimension; rows are numbered
 * in row-major order of the outer dimensions and located through the strides,
 * so any strided view works. The fast path handles contiguous rows with
 * vectors and stages strided ones through an f32 buffer.
 */
#include "kvdepot/convert.h"

#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "common/convert_impl.h"
#include "common/cpu_internal.h"
#include "common/simd_avx2.h"

/* Below this many elements an op runs on one thread. */
#define PAR_MIN_ELEMS (64 * 1024)

static int64_t row_len(const kvd_tensor *t) { return t->ndim ? t->shape[t->ndim - 1] : 1; }

static int64_t row_count(const kvd_tensor *t)
{
    int64_t n = 1;
    for (int k = 0; k + 1 < t->ndim; k++)
        n *= t->shape[k];
    return n;
}

/* Byte offset of row r (row-major over the outer dims). */
static int64_t row_offset(const kvd_tensor *t, int64_t r)
{
    int64_t off = 0;
    for (int k = t->ndim - 2; k >= 0; k--) {
        off += (r % t->shape[k]) * t->stride[k];
        r /= t->shape[k];
    }
    return off;
}

static inline int64_t inner_stride(const kvd_tensor *t) { return t->stride[t->ndim - 1]; }

static inline int row_contig(const kvd_tensor *t)
{
    return inner_stride(t) == (int64_t)kvd_dtype_size(t->dtype);
}

static void load_row_scalar(float *dst, const kvd_tensor *t, int64_t r, int64_t n)
{
    const char *p = (const char *)t->data + row_offset(t, r);
    for (int64_t j = 0; j < n; j++)
        dst[j] = kvd__load_float(p + j * inner_stride(t), t->dtype);
}

static void store_row_scalar(const kvd_tensor *t, int64_t r, const float *src, int64_t n)
{
    char *p = (char *)t->data + row_offset(t, r);
    for (int64_t j = 0; j < n; j++)
        kvd__store_float(p + j * inner_stride(t), t->dtype, src[j]);
}

/* ---- scalar references ---- */

void kvd_convert_ref(const kvd_tensor *dst, const kvd_tensor *src)
{
    const int64_t n = row_len(src), rows = row_count(src);
    for (int64_t r = 0; r < rows; r++) {
        const char *s = (const char *)src->data + row_offset(src, r);
        char *d = (char *)dst->data + row_offset(dst, r);
        for (int64_t j = 0; j < n; j++)
            kvd__store_float(d + j * inner_stride(dst), dst->dtype,
                             kvd__load_float(s + j * inner_stride(src), src->dtype));
    }
}

int kvd_hadamard_ref(const kvd_tensor *dst, const kvd_tensor *src)
{
    const int64_t n = row_len(src), rows = row_count(src);
    if (n == 0 || rows == 0)
        return KVD_OK;
    float *x = malloc((size_t)n * sizeof *x), *y = malloc((size_t)n * sizeof *y);
    if (!x || !y) {
        free(x);
        free(y);
        return KVD_ENOMEM;
    }
    const double norm = 1.0 / sqrt((double)n);
    for (int64_t r = 0; r < rows; r++) {
        load_row_scalar(x, src, r, n);
        for (int64_t i = 0; i < n; i++) {
            /* y_i = (1/sqrt(n)) sum_j (-1)^popcount(i & j) x_j */
            double acc = 0;
            for (int64_t j = 0; j < n; j++)
                acc += (__builtin_popcountll((unsigned long long)(i & j)) & 1) ? -(double)x[j]
                                                                                : (double)x[j];
            y[i] = (float)(acc * norm);
        }
        store_row_scalar(dst, r, y, n);
    }
    free(x);
    free(y);
    return KVD_OK;
}

void kvd_channel_scale_ref(const kvd_tensor *dst, const kvd_tensor *src, const kvd_tensor *s,
                           int divide)
{
    const int64_t n = row_len(src), rows = row_count(src);
    for (int64_t r = 0; r < rows; r++) {
        const char *xs = (const char *)src->data + row_offset(src, r);
        char *yd = (char *)dst->data + row_offset(dst, r);
        for (int64_t j = 0; j < n; j++) {
            float x = kvd__load_float(xs + j * inner_stride(src), src->dtype);
            float c = kvd__load_float((const char *)s->data + j * s->stride[0], s->dtype);
            kvd__store_float(yd + j * inner_stride(dst), dst->dtype, divide ? x / c : x * c);
        }
    }
}

/* ---- fast paths ---- */

static int par_ok(const kvd_backend *be, const kvd_tensor *t)
{
    return kvd__cpu_threads(be) > 1 && kvd_tensor_nelem(t) >= PAR_MIN_ELEMS;
}

static float *alloc_row(int64_t n)
{
    return aligned_alloc(64, (((size_t)(n > 0 ? n : 1)) * sizeof(float) + 63) & ~(size_t)63);
}

KVD_AVX2_TARGET static void load_row_fast(float *dst, const kvd_tensor *t, int64_t r, int64_t n)
{
    if (row_contig(t))
        kvd__row_to_f32_avx2(dst, (const char *)t->data + row_offset(t, r), t->dtype, n);
    else
        load_row_scalar(dst, t, r, n);
}

KVD_AVX2_TARGET static void store_row_fast(const kvd_tensor *t, int64_t r, const float *src,
                                           int64_t n)
{
    if (row_contig(t))
        kvd__row_from_f32_avx2((char *)t->data + row_offset(t, r), t->dtype, src, n);
    else
        store_row_scalar(t, r, src, n);
}

/* A row op over the rows of [lo, hi) (kvd__par_ranges), with a row buffer
 * of its own; out of memory sets failed. */
typedef struct rows_job {
    const kvd_tensor *dst, *src;
    int64_t n;
    const float *sf;
    float norm;
    int divide;
    atomic_int failed;
} rows_job;

static void flat_part(void *arg, int64_t lo, int64_t hi)
{
    const rows_job *j = arg;
    const size_t es = kvd_dtype_size(j->src->dtype), ed = kvd_dtype_size(j->dst->dtype);
    kvd__convert_row_avx2((char *)j->dst->data + lo * (int64_t)ed, j->dst->dtype,
                          (const char *)j->src->data + lo * (int64_t)es, j->src->dtype, hi - lo);
}

static void convert_rows(void *arg, int64_t lo, int64_t hi)
{
    rows_job *j = arg;
    float *buf = NULL;
    for (int64_t r = lo; r < hi; r++) {
        if (row_contig(j->src) && row_contig(j->dst)) {
            kvd__convert_row_avx2((char *)j->dst->data + row_offset(j->dst, r), j->dst->dtype,
                                  (const char *)j->src->data + row_offset(j->src, r), j->src->dtype,
                                  j->n);
            continue;
        }
        if (!buf && !(buf = alloc_row(j->n))) {
            atomic_store(&j->failed, 1);
            return;
        }
        load_row_fast(buf, j->src, r, j->n);
        store_row_fast(j->dst, r, buf, j->n);
    }
    free(buf);
}

static int convert_fast(kvd_backend *be, const kvd_tensor *dst, const kvd_tensor *src,
                        kvd_error *err)
{
    const int64_t n = row_len(src), rows = row_count(src);
    const int nth = par_ok(be, src) ? kvd__cpu_threads(be) : 1;
    rows_job j = {.dst = dst, .src = src, .n = n};
    atomic_init(&j.failed, 0);
    if (kvd_tensor_is_contiguous(src) && kvd_tensor_is_contiguous(dst)) {
        /* one flat row, cut in chunks so short rows cost no per-row overhead */
        kvd__par_ranges(n * rows, 16384, nth, flat_part, &j);
        return KVD_OK;
    }
    kvd__par_ranges(rows, 1, nth, convert_rows, &j);
    if (atomic_load(&j.failed))
        return kvd_error_set(err, KVD_ENOMEM, "convert: out of memory for a row buffer");
    return KVD_OK;
}

/* Scalar in-place butterflies, for rows shorter than one vector. */
static void fwht_small(float *x, int64_t n, float norm)
{
    for (int64_t h = 1; h < n; h *= 2)
        for (int64_t i = 0; i < n; i += 2 * h)
            for (int64_t j = i; j < i + h; j++) {
                float a = x[j], b = x[j + h];
                x[j] = a + b;
                x[j + h] = a - b;
            }
    for (int64_t i = 0; i < n; i++)
        x[i] *= norm;
}

/* Hadamard (sf NULL) or channel scale of rows [lo, hi), through a row
 * buffer in f32. */
static void transform_rows(void *arg, int64_t lo, int64_t hi)
{
    rows_job *j = arg;
    float *buf = alloc_row(j->n);
    if (!buf) {
        atomic_store(&j->failed, 1);
        return;
    }
    for (int64_t r = lo; r < hi; r++) {
        load_row_fast(buf, j->src, r, j->n);
        if (j->sf)
            kvd__scale_row_avx2(buf, buf, j->sf, j->n, j->divide);
        else if (j->n >= 8)
            kvd__fwht_avx2(buf, j->n, j->norm);
        else
            fwht_small(buf, j->n, j->norm);
        store_row_fast(j->dst, r, buf, j->n);
    }
    free(buf);
}

static int hadamard_fast(kvd_backend *be, const kvd_tensor *dst, const kvd_tensor *src,
                         kvd_error *err)
{
    const int64_t n = row_len(src), rows = row_count(src);
    if (n == 0 || rows == 0)
        return KVD_OK;
    rows_job j = {.dst = dst, .src = src, .n = n, .norm = (float)(1.0 / sqrt((double)n))};
    atomic_init(&j.failed, 0);
    kvd__par_ranges(rows, 1, par_ok(be, src) ? kvd__cpu_threads(be) : 1, transform_rows, &j);
    if (atomic_load(&j.failed))
        return kvd_error_set(err, KVD_ENOMEM, "hadamard: out of memory for a row buffer");
    return KVD_OK;
}

static int channel_scale_fast(kvd_backend *be, const kvd_tensor *dst, const kvd_tensor *src,
                              const kvd_tensor *s, int divide, kvd_error *err)
{
    const int64_t n = row_len(src), rows = row_count(src);
    if (n == 0 || rows == 0)
        return KVD_OK;
    float *sf = alloc_row(n);
    if (!sf)
        return kvd_error_set(err, KVD_ENOMEM, "channel_scale: out of memory");
    for (int64_t j = 0; j < n; j++)
        sf[j] = kvd__load_float((const char *)s->data + j * s->stride[0], s->dtype);
    rows_job j = {.dst = dst, .src = src, .n = n, .sf = sf, .divide = divide};
    atomic_init(&j.failed, 0);
    kvd__par_ranges(rows, 1, par_ok(be, src) ? kvd__cpu_threads(be) : 1, transform_rows, &j);
    free(sf);
    if (atomic_load(&j.failed))
        return kvd_error_set(err, KVD_ENOMEM, "channel_scale: out of memory for a row buffer");
    return KVD_OK;
}

/* ---- CPU ops ---- */

static int cpu_convert(kvd_backend *be, const kvd_tensor *dst, const kvd_tensor *src,
                       kvd_error *err)
{
    if (!kvd__cpu_fast(be)) {
        kvd_convert_ref(dst, src);
        return KVD_OK;
    }
    return convert_fast(be, dst, src, err);
}

static int cpu_hadamard(kvd_backend *be, const kvd_tensor *dst, const kvd_tensor *src,
                        kvd_error *err)
{
    if (!kvd__cpu_fast(be)) {
        if (kvd_hadamard_ref(dst, src) != KVD_OK)
            return kvd_error_set(err, KVD_ENOMEM, "hadamard: out of memory for a row buffer");
        return KVD_OK;
    }
    return hadamard_fast(be, dst, src, err);
}

static int cpu_channel_scale(kvd_backend *be, const kvd_tensor *dst, const kvd_tensor *src,
                             const kvd_tensor *s, int divide, kvd_error *err)
{
    if (!kvd__cpu_fast(be)) {
        kvd_channel_scale_ref(dst, src, s, divide);
        return KVD_OK;
    }
    return channel_scale_fast(be, dst, src, s, divide, err);
}

static int cpu_gather_rows(kvd_backend *be, void *dst, const uint64_t *src, int64_t n, size_t row,
                           kvd_error *err)
{
    (void)be;
    (void)err;
    for (int64_t i = 0; i < n; i++)
        memcpy((uint8_t *)dst + (size_t)i * row, (const void *)(uintptr_t)src[i], row);
    return KVD_OK;
}

const struct kvd_convert_ops kvd__cpu_convert_ops = {
    .convert = cpu_convert,
    .hadamard = cpu_hadamard,
    .channel_scale = cpu_channel_scale,
    .gather_rows = cpu_gather_rows,
};

/* ---- checked wrappers ---- */

static int check_float_tensor(const kvd_tensor *t, const char *op, const char *name,
                              kvd_error *err)
{
    if (!t)
        return kvd_error_set(err, KVD_EINVAL, "%s: %s is NULL", op, name);
    if (!kvd_dtype_is_float(t->dtype))
        return kvd_error_set(err, KVD_EINVAL, "%s: %s has dtype %s, want f32, f16 or bf16", op,
                             name, kvd_dtype_name(t->dtype));
    if (t->ndim < 1 || t->ndim > KVD_MAX_DIMS)
        return kvd_error_set(err, KVD_EINVAL, "%s: %s has %d dims, want 1..%d", op, name, t->ndim,
                             KVD_MAX_DIMS);
    for (int k = 0; k < t->ndim; k++)
        if (t->shape[k] < 0)
            return kvd_error_set(err, KVD_EINVAL, "%s: %s has negative size %lld in dim %d", op,
                                 name, (long long)t->shape[k], k);
    if (kvd_tensor_nelem(t) > 0 && !t->data)
        return kvd_error_set(err, KVD_EINVAL, "%s: %s data is NULL", op, name);
    return KVD_OK;
}

static int check_pair(const kvd_tensor *dst, const kvd_tensor *src, const char *op,
                      kvd_error *err)
{
    int rc = check_float_tensor(src, op, "src", err);
    if (rc)
        return rc;
    rc = check_float_tensor(dst, op, "dst", err);
    if (rc)
        return rc;
    if (dst->ndim != src->ndim)
        return kvd_error_set(err, KVD_EINVAL, "%s: dst has %d dims but src has %d", op, dst->ndim,
                             src->ndim);
    for (int k = 0; k < src->ndim; k++)
        if (dst->shape[k] != src->shape[k])
            return kvd_error_set(err, KVD_EINVAL,
                                 "%s: shape mismatch in dim %d: dst %lld, src %lld", op, k,
                                 (long long)dst->shape[k], (long long)src->shape[k]);
    return KVD_OK;
}

#define NEED_OP(be, member, op)                                                           \
    do {                                                                                  \
        if (!(be) || !(be)->iface || !(be)->iface->convert || !(be)->iface->convert->member) \
            return kvd_error_set(err, KVD_EUNSUPP, "%s: not supported by backend %s", op,  \
                                 (be) && (be)->iface ? (be)->iface->name : "(none)");     \
    } while (0)

int kvd_convert(kvd_backend *be, const kvd_tensor *dst, const kvd_tensor *src, kvd_error *err)
{
    int rc = check_pair(dst, src, "convert", err);
    if (rc)
        return rc;
    NEED_OP(be, convert, "convert");
    if (kvd_tensor_nelem(src) == 0)
        return KVD_OK;
    return be->iface->convert->convert(be, dst, src, err);
}

int kvd_hadamard(kvd_backend *be, const kvd_tensor *dst, const kvd_tensor *src, kvd_error *err)
{
    int rc = check_pair(dst, src, "hadamard", err);
    if (rc)
        return rc;
    int64_t n = row_len(src);
    if (n > 0 && (n & (n - 1)) != 0)
        return kvd_error_set(err, KVD_EINVAL,
                             "hadamard: last dim %lld is not a power of two", (long long)n);
    NEED_OP(be, hadamard, "hadamard");
    if (kvd_tensor_nelem(src) == 0)
        return KVD_OK;
    return be->iface->convert->hadamard(be, dst, src, err);
}

int kvd_channel_scale(kvd_backend *be, const kvd_tensor *dst, const kvd_tensor *src,
                      const kvd_tensor *s, int divide, kvd_error *err)
{
    int rc = check_pair(dst, src, "channel_scale", err);
    if (rc)
        return rc;
    rc = check_float_tensor(s, "channel_scale", "scale", err);
    if (rc)
        return rc;
    if (s->ndim != 1 || s->shape[0] != row_len(src))
        return kvd_error_set(err, KVD_EINVAL,
                             "channel_scale: scale must be 1-D of length %lld (last dim of src), "
                             "has %d dims and length %lld",
                             (long long)row_len(src), s->ndim, (long long)s->shape[0]);
    NEED_OP(be, channel_scale, "channel_scale");
    if (kvd_tensor_nelem(src) == 0)
        return KVD_OK;
    return be->iface->convert->channel_scale(be, dst, src, s, divide != 0, err);
}

int kvd_gather_rows(kvd_backend *be, void *dst, const uint64_t *src, int64_t n, size_t row,
                    kvd_error *err)
{
    if (n < 0 || row == 0 || (n > 0 && (!dst || !src)))
        return kvd_error_set(err, KVD_EINVAL, "gather_rows: n %lld, row %zu, dst %p, src %p",
                             (long long)n, row, dst, (const void *)src);
    NEED_OP(be, gather_rows, "gather_rows");
    return n ? be->iface->convert->gather_rows(be, dst, src, n, row, err) : KVD_OK;
}
