/*
 * VQ codec (VecInfer) on the CPU: smoothing factors, smooth + Hadamard
 * transforms, codebook training, encode, decode; scalar references, the
 * backend's vq table and the checked wrappers. Formulas and layouts are in
 * kvdepot/vq.h.
 *
 * The backend path reuses the other families instead of duplicating them:
 * the transforms are the convert family's channel scaling (a true division
 * for keys) followed by its Walsh-Hadamard transform in place; training and
 * encoding are the K-means trainer and nearest-centroid search on the
 * sub-vectors, which for a contiguous (T, D) tensor are simply the rows of
 * the same memory viewed as (T*D/d, d). Encode is bitwise the reference (see
 * kmeans.c); the transforms agree with the O(D^2) reference to rounding.
 */
#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "common/convert_impl.h"
#include "common/cpu_internal.h"
#include "kvdepot/convert.h"
#include "kvdepot/vq.h"

/* ---- references -------------------------------------------------------- */

void kvd_vq_smooth_factors_ref(int64_t T, int D, const float *k, float *lambda)
{
    for (int i = 0; i < D; i++) {
        float mx = 0.0f;
        for (int64_t t = 0; t < T; t++) {
            float a = fabsf(k[t * D + i]);
            if (isfinite(a) && a > mx)
                mx = a;
        }
        lambda[i] = mx > 0.0f ? sqrtf(mx) : 1.0f;
    }
}

/* H_D[i][j] = (-1)^popcount(i & j) / sqrt(D) */
static inline float hadamard_entry(int i, int j, float inv_sqrt)
{
    return (__builtin_popcount((unsigned)(i & j)) & 1) ? -inv_sqrt : inv_sqrt;
}

/* out[t] = (x[t] (*|/) lambda) H_D, the matrix product of the definition. */
static void transform_ref(int64_t T, int D, const float *x, const float *lambda, int divide,
                          float *out)
{
    float inv_sqrt = 1.0f / sqrtf((float)D);
    float *row = malloc(sizeof(float) * (size_t)D);
    if (!row)
        return;
    for (int64_t t = 0; t < T; t++) {
        for (int i = 0; i < D; i++) {
            float v = x[t * D + i];
            row[i] = !lambda ? v : divide ? v / lambda[i] : v * lambda[i];
        }
        for (int j = 0; j < D; j++) {
            float acc = 0.0f;
            for (int i = 0; i < D; i++)
                acc += row[i] * hadamard_entry(i, j, inv_sqrt);
            out[t * D + j] = acc;
        }
    }
    free(row);
}

void kvd_vq_transform_keys_ref(int64_t T, int D, const float *k, const float *lambda, float *out)
{
    transform_ref(T, D, k, lambda, 1, out);
}

void kvd_vq_transform_queries_ref(int64_t H, int D, const float *q, const float *lambda,
                                  float *out)
{
    transform_ref(H, D, q, lambda, 0, out);
}

void kvd_vq_encode_ref(int64_t T, int D, int d, int b, const float *x, const float *codebook,
                       uint8_t *codes8, uint16_t *codes16)
{
    int P = D / d;
    for (int64_t t = 0; t < T; t++)
        for (int p = 0; p < P; p++) {
            uint32_t a;
            kvd_kmeans_assign_ref(1, d, x + t * D + (int64_t)p * d, d, 1 << b, codebook, &a, NULL);
            if (b > 8)
                codes16[t * P + p] = (uint16_t)a;
            else
                codes8[t * P + p] = (uint8_t)a;
        }
}

int kvd_vq_decode_ref(int64_t T, int D, int d, int b, const uint8_t *codes8,
                      const uint16_t *codes16, const float *codebook, float *out)
{
    int P = D / d;
    uint32_t K = 1u << b;
    for (int64_t t = 0; t < T; t++)
        for (int p = 0; p < P; p++) {
            uint32_t c = b > 8 ? codes16[t * P + p] : codes8[t * P + p];
            if (c >= K)
                return KVD_ECORRUPT;
            memcpy(out + t * D + (int64_t)p * d, codebook + (size_t)c * d, sizeof(float) * d);
        }
    return KVD_OK;
}

/* ---- CPU paths --------------------------------------------------------- */

void kvd__vq_encode_cpu(int nthreads, int simd, int64_t T, int D, int d, int b, const float *x,
                        const float *codebook, uint8_t *codes8, uint16_t *codes16)
{
    const int64_t P = D / d, chunk = 8192; /* sub-vectors per step: bounded scratch */
    int64_t npts = T * P;
    uint32_t *a = malloc(sizeof(uint32_t) * chunk);
    if (!a) {
        kvd_vq_encode_ref(T, D, d, b, x, codebook, codes8, codes16);
        return;
    }
    for (int64_t i0 = 0; i0 < npts; i0 += chunk) {
        int64_t nb = npts - i0 < chunk ? npts - i0 : chunk;
        kvd__kmeans_assign_cpu(nthreads, simd, nb, d, x + i0 * d, d, 1 << b, codebook, a, NULL);
        if (b > 8)
            for (int64_t i = 0; i < nb; i++)
                codes16[i0 + i] = (uint16_t)a[i];
        else
            for (int64_t i = 0; i < nb; i++)
                codes8[i0 + i] = (uint8_t)a[i];
    }
    free(a);
}

/* Tokens [lo, hi) of kvd__vq_decode_cpu (kvd__par_ranges). */
typedef struct decode_job {
    int D, d, b;
    const uint8_t *codes8;
    const uint16_t *codes16;
    const float *codebook;
    float *out;
    atomic_int bad;
} decode_job;

static void decode_part(void *arg, int64_t lo, int64_t hi)
{
    decode_job *j = arg;
    const int D = j->D, d = j->d, b = j->b, P = D / d;
    const uint32_t K = 1u << b;
    int bad = 0;
    for (int64_t t = lo; t < hi; t++) {
        float *o = j->out + t * D;
        for (int p = 0; p < P; p++) {
            uint32_t c = b > 8 ? j->codes16[t * P + p] : j->codes8[t * P + p];
            if (c >= K) {
                bad = 1;
                c = 0;
            }
            const float *src = j->codebook + (size_t)c * d;
            for (int i = 0; i < d; i++)
                o[p * d + i] = src[i];
        }
    }
    if (bad)
        atomic_store(&j->bad, 1);
}

int kvd__vq_decode_cpu(int nthreads, int64_t T, int D, int d, int b, const uint8_t *codes8,
                       const uint16_t *codes16, const float *codebook, float *out)
{
    int nt = T * D < 65536 ? 1 : (nthreads < 1 ? 1 : nthreads);
    decode_job j = {.D = D,
                    .d = d,
                    .b = b,
                    .codes8 = codes8,
                    .codes16 = codes16,
                    .codebook = codebook,
                    .out = out};
    atomic_init(&j.bad, 0);
    kvd__par_ranges(T, 64, nt, decode_part, &j);
    return atomic_load(&j.bad) ? KVD_ECORRUPT : KVD_OK;
}

/* ---- tensors ----------------------------------------------------------- */

static int is_pow2(int64_t v) { return v > 0 && (v & (v - 1)) == 0; }

static int check_rows(const kvd_tensor *t, int any_float, int64_t cols, const char *what,
                      kvd_error *err)
{
    int dt_ok = any_float ? kvd_dtype_is_float(t ? t->dtype : KVD_DTYPE_INVALID)
                          : (t && t->dtype == KVD_DTYPE_F32);
    if (!t || !dt_ok || t->ndim != 2 || t->shape[0] < 0 || t->shape[1] < 1 ||
        (cols > 0 && t->shape[1] != cols) || t->shape[1] > 65536 ||
        !kvd_tensor_is_contiguous(t) || (t->shape[0] > 0 && !t->data))
        return kvd_error_set(err, KVD_EINVAL, "vq: %s must be a contiguous (rows, %s) %s tensor",
                             what, cols > 0 ? "D" : "cols", any_float ? "f16/bf16/f32" : "f32");
    return KVD_OK;
}

static int check_lambda(const kvd_tensor *l, int64_t D, kvd_error *err)
{
    if (l && (l->dtype != KVD_DTYPE_F32 || l->ndim != 1 || l->shape[0] != D ||
              !kvd_tensor_is_contiguous(l) || !l->data))
        return kvd_error_set(err, KVD_EINVAL, "vq: lambda must be a contiguous (%lld) f32 tensor",
                             (long long)D);
    return KVD_OK;
}

/* codebook (2^b, d): b in 4..12, d in {2, 4, 8} */
static int check_codebook(const kvd_tensor *cb, int *d, int *b, kvd_error *err)
{
    if (!cb || cb->dtype != KVD_DTYPE_F32 || cb->ndim != 2 || !kvd_tensor_is_contiguous(cb) ||
        !cb->data || !is_pow2(cb->shape[0]) || cb->shape[0] < 16 || cb->shape[0] > 4096 ||
        (cb->shape[1] != 2 && cb->shape[1] != 4 && cb->shape[1] != 8))
        return kvd_error_set(err, KVD_EINVAL,
                             "vq: codebook must be a contiguous (2^b, d) f32 tensor, b in 4..12, "
                             "d in {2, 4, 8}");
    *d = (int)cb->shape[1];
    *b = __builtin_ctzll((unsigned long long)cb->shape[0]);
    return KVD_OK;
}

static int check_codes(const kvd_tensor *c, int64_t T, int64_t P, int b, kvd_error *err)
{
    kvd_dtype want = b > 8 ? KVD_DTYPE_U16 : KVD_DTYPE_U8;
    if (!c || c->dtype != want || c->ndim != 2 || c->shape[0] != T || c->shape[1] != P ||
        !kvd_tensor_is_contiguous(c) || (T > 0 && !c->data))
        return kvd_error_set(err, KVD_EINVAL, "vq: codes must be a contiguous (%lld, %lld) %s tensor",
                             (long long)T, (long long)P, kvd_dtype_name(want));
    return KVD_OK;
}

/* ---- backend table ----------------------------------------------------- */

static int cpu_smooth_factors(kvd_backend *be, const kvd_tensor *k, kvd_tensor *lambda,
                              kvd_error *err)
{
    (void)be;
    (void)err;
    int64_t T = k->shape[0], D = k->shape[1];
    float *l = (float *)lambda->data;
    size_t es = kvd_dtype_size(k->dtype);
    for (int64_t i = 0; i < D; i++)
        l[i] = 0.0f;
    for (int64_t t = 0; t < T; t++) /* row order: streams through memory */
        for (int64_t i = 0; i < D; i++) {
            float a = fabsf(kvd__load_float((const char *)k->data + ((size_t)t * D + i) * es, k->dtype));
            if (isfinite(a) && a > l[i])
                l[i] = a;
        }
    for (int64_t i = 0; i < D; i++)
        l[i] = l[i] > 0.0f ? sqrtf(l[i]) : 1.0f;
    return KVD_OK;
}

static int cpu_transform(kvd_backend *be, const kvd_tensor *x, const kvd_tensor *lambda,
                         kvd_tensor *out, int divide, kvd_error *err)
{
    int rc = lambda ? kvd_channel_scale(be, out, x, lambda, divide, err) : kvd_convert(be, out, x, err);
    if (rc)
        return rc;
    return kvd_hadamard(be, out, out, err);
}

static int cpu_transform_keys(kvd_backend *be, const kvd_tensor *k, const kvd_tensor *lambda,
                              kvd_tensor *out, kvd_error *err)
{
    return cpu_transform(be, k, lambda, out, 1, err);
}

static int cpu_transform_queries(kvd_backend *be, const kvd_tensor *q, const kvd_tensor *lambda,
                                 kvd_tensor *out, kvd_error *err)
{
    return cpu_transform(be, q, lambda, out, 0, err);
}

static int cpu_train(kvd_backend *be, const kvd_tensor *x, const kvd_kmeans_params *km,
                     kvd_tensor *codebook, double *inertia, kvd_error *err)
{
    int d = 0, b = 0;
    check_codebook(codebook, &d, &b, NULL);
    kvd_kmeans_params p = *km;
    p.k = 1 << b;
    int64_t npts = x->shape[0] * (x->shape[1] / d);
    int rc = kvd__kmeans_train_cpu(kvd__cpu_threads(be), kvd__cpu_fast(be), &p, npts, d,
                                   (const float *)x->data, d, (float *)codebook->data, inertia);
    return rc ? kvd_error_set(err, rc, "vq: train: %s", kvd_strerror(rc)) : KVD_OK;
}

static int cpu_encode(kvd_backend *be, const kvd_tensor *x, const kvd_tensor *codebook,
                      kvd_tensor *codes, kvd_error *err)
{
    (void)err;
    int d = 0, b = 0;
    check_codebook(codebook, &d, &b, NULL);
    int64_t T = x->shape[0];
    int D = (int)x->shape[1];
    uint8_t *c8 = b > 8 ? NULL : (uint8_t *)codes->data;
    uint16_t *c16 = b > 8 ? (uint16_t *)codes->data : NULL;
    if (kvd__cpu_fast(be))
        kvd__vq_encode_cpu(kvd__cpu_threads(be), 1, T, D, d, b, (const float *)x->data,
                           (const float *)codebook->data, c8, c16);
    else
        kvd_vq_encode_ref(T, D, d, b, (const float *)x->data, (const float *)codebook->data, c8,
                          c16);
    return KVD_OK;
}

static int cpu_decode(kvd_backend *be, const kvd_tensor *codes, const kvd_tensor *codebook,
                      kvd_tensor *out, kvd_error *err)
{
    int d = 0, b = 0;
    check_codebook(codebook, &d, &b, NULL);
    int64_t T = out->shape[0];
    int D = (int)out->shape[1];
    const uint8_t *c8 = b > 8 ? NULL : (const uint8_t *)codes->data;
    const uint16_t *c16 = b > 8 ? (const uint16_t *)codes->data : NULL;
    int rc = kvd__cpu_fast(be)
                 ? kvd__vq_decode_cpu(kvd__cpu_threads(be), T, D, d, b, c8, c16,
                                      (const float *)codebook->data, (float *)out->data)
                 : kvd_vq_decode_ref(T, D, d, b, c8, c16, (const float *)codebook->data,
                                     (float *)out->data);
    return rc ? kvd_error_set(err, rc, "vq: decode: a code is >= 2^%d", b) : KVD_OK;
}

const struct kvd_vq_ops kvd__cpu_vq_ops = {
    .smooth_factors = cpu_smooth_factors,
    .transform_keys = cpu_transform_keys,
    .transform_queries = cpu_transform_queries,
    .train = cpu_train,
    .encode = cpu_encode,
    .decode = cpu_decode,
};

/* ---- wrappers ---------------------------------------------------------- */

#define VQ_GET_OP(op)                                                                        \
    do {                                                                                     \
        if (!be || !be->iface)                                                               \
            return kvd_error_set(err, KVD_EINVAL, "vq: backend is NULL");                    \
        if (!be->iface->vq || !be->iface->vq->op)                                            \
            return kvd_error_set(err, KVD_EUNSUPP, "vq: " #op " not supported by the %s backend", \
                                 be->iface->name);                                           \
    } while (0)

int kvd_vq_smooth_factors(kvd_backend *be, const kvd_tensor *k, kvd_tensor *lambda,
                          kvd_error *err)
{
    VQ_GET_OP(smooth_factors);
    int rc = check_rows(k, 1, 0, "k", err);
    if (rc)
        return rc;
    if (k->shape[0] < 1)
        return kvd_error_set(err, KVD_EINVAL, "vq: smoothing factors need at least one key");
    if (!lambda || (rc = check_lambda(lambda, k->shape[1], err)))
        return rc ? rc : kvd_error_set(err, KVD_EINVAL, "vq: lambda is NULL");
    return be->iface->vq->smooth_factors(be, k, lambda, err);
}

static int check_transform(const kvd_tensor *x, const kvd_tensor *lambda, const kvd_tensor *out,
                           const char *what, kvd_error *err)
{
    int rc = check_rows(x, 1, 0, what, err);
    if (rc)
        return rc;
    if (!is_pow2(x->shape[1]))
        return kvd_error_set(err, KVD_EINVAL, "vq: head_dim %lld is not a power of two",
                             (long long)x->shape[1]);
    if ((rc = check_lambda(lambda, x->shape[1], err)) || (rc = check_rows(out, 0, x->shape[1], "out", err)))
        return rc;
    if (out->shape[0] != x->shape[0])
        return kvd_error_set(err, KVD_EINVAL, "vq: out has %lld rows, %s %lld",
                             (long long)out->shape[0], what, (long long)x->shape[0]);
    return KVD_OK;
}

int kvd_vq_transform_keys(kvd_backend *be, const kvd_tensor *k, const kvd_tensor *lambda,
                          kvd_tensor *out, kvd_error *err)
{
    VQ_GET_OP(transform_keys);
    int rc = check_transform(k, lambda, out, "k", err);
    return rc ? rc : be->iface->vq->transform_keys(be, k, lambda, out, err);
}

int kvd_vq_transform_queries(kvd_backend *be, const kvd_tensor *q, const kvd_tensor *lambda,
                             kvd_tensor *out, kvd_error *err)
{
    VQ_GET_OP(transform_queries);
    int rc = check_transform(q, lambda, out, "q", err);
    return rc ? rc : be->iface->vq->transform_queries(be, q, lambda, out, err);
}

int kvd_vq_train(kvd_backend *be, const kvd_tensor *x, const kvd_kmeans_params *km,
                 kvd_tensor *codebook, double *inertia, kvd_error *err)
{
    VQ_GET_OP(train);
    int d = 0, b = 0;
    int rc = check_codebook(codebook, &d, &b, err);
    if (rc || (rc = check_rows(x, 0, 0, "x", err)))
        return rc;
    if (x->shape[1] % d || x->shape[0] < 1)
        return kvd_error_set(err, KVD_EINVAL, "vq: x needs >= 1 row and D a multiple of d=%d", d);
    if (!km || km->niter < 0 || km->max_points < 0)
        return kvd_error_set(err, KVD_EINVAL, "vq: train needs niter >= 0 and max_points >= 0");
    return be->iface->vq->train(be, x, km, codebook, inertia, err);
}

int kvd_vq_encode(kvd_backend *be, const kvd_tensor *x, const kvd_tensor *codebook,
                  kvd_tensor *codes, kvd_error *err)
{
    VQ_GET_OP(encode);
    int d = 0, b = 0;
    int rc = check_codebook(codebook, &d, &b, err);
    if (rc || (rc = check_rows(x, 0, 0, "x", err)))
        return rc;
    if (x->shape[1] % d)
        return kvd_error_set(err, KVD_EINVAL, "vq: D=%lld is not a multiple of d=%d",
                             (long long)x->shape[1], d);
    if ((rc = check_codes(codes, x->shape[0], x->shape[1] / d, b, err)))
        return rc;
    return be->iface->vq->encode(be, x, codebook, codes, err);
}

int kvd_vq_decode(kvd_backend *be, const kvd_tensor *codes, const kvd_tensor *codebook,
                  kvd_tensor *out, kvd_error *err)
{
    VQ_GET_OP(decode);
    int d = 0, b = 0;
    int rc = check_codebook(codebook, &d, &b, err);
    if (rc || (rc = check_rows(out, 0, 0, "out", err)))
        return rc;
    if (out->shape[1] % d)
        return kvd_error_set(err, KVD_EINVAL, "vq: D=%lld is not a multiple of d=%d",
                             (long long)out->shape[1], d);
    if ((rc = check_codes(codes, out->shape[0], out->shape[1] / d, b, err)))
        return rc;
    return be->iface->vq->decode(be, codes, codebook, out, err);
}
