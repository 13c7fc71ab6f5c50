/*
 * Calibrate: client-streamed Q/K/V samples of a model in, calibration
 * artifacts out (kvdepot.proto).
 *
 * Samples are converted to f32 as they arrive and kept per layer in a
 * seeded reservoir of max_samples tokens, so any stream length takes
 * bounded memory and the kept tokens are a uniform sample. At half-close,
 * for every (layer, kv head) that received samples:
 *   - key smoothing factors lambda (kvdepot/vq.h), always;
 *   - with a VQ spec: K-means codebooks for the smoothed + Hadamard-rotated
 *     keys and for the values, and their reconstruction error measured in
 *     the original space (keys rotated back and re-scaled);
 *   - with svd: rotations and spectra from the Gram matrix of the keys plus
 *     the queries of the heads reading them (when samples carry Q), and of
 *     the values; the error is the energy share dropped at removal rate 0.01.
 * With an error budget (codec advice, advise.h), the last quarter of each
 * layer's kept tokens (at most 1024, a multiple of 128) is held out: the
 * artifacts are trained on the rest and every codec is measured on it.
 * All artifacts are stored in one write; nothing is stored on any error.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "advise.h"
#include "artifact.h"
#include "convert.h"
#include "kvdepot/kmeans.h"
#include "kvdepot/svd.h"
#include "kvdepot/tensor.h"
#include "kvdepot/vq.h"
#include "rpc.h"

#define CAL_DEFAULT_SAMPLES 65536
#define CAL_DEFAULT_ITERS 10
#define CAL_SVD_RATE 0.01
#define CAL_SVD_ALIGN 8
/* K-means sees at most this many sub-vectors per codebook (a seeded
 * subset beyond it), bounding the time of one Calibrate. */
#define CAL_KMEANS_POINTS 262144
#define CAL_EVAL_MAX 1024
#define CAL_EVAL_QUERIES 16

typedef struct cal_layer {
    uint64_t seen, kept, rows; /* rows: allocated token rows */
    uint64_t train;            /* kept tokens the artifacts are trained on */
    float *k, *v, *q;          /* kept tokens: [token][head][D] */
    int q_state;      /* 0 no samples yet, 1 all carried Q, 2 none did */
} cal_layer;

typedef struct cal_state {
    int have_header;
    kvd_model_info model;
    uint32_t vq_d, vq_b; /* 0 = no VQ */
    int svd;
    uint32_t iters;
    uint64_t seed, max_samples, rng, samples, kept_bytes;
    double budget; /* > 0: codec advice */
    uint32_t page_tokens;
    uint32_t eval_queries;
    int exhaustive;
    cal_layer *layers;
    kvd_store *store; /* charged with the kept samples (append-memory-bytes) */
    uint64_t charged;
    kvd_backend be; /* the store's CPU backend on one thread */
} cal_state;

static void cal_release(void *state)
{
    cal_state *st = state;
    if (!st)
        return;
    for (uint32_t l = 0; st->layers && l < st->model.num_layers; l++) {
        free(st->layers[l].k);
        free(st->layers[l].v);
        free(st->layers[l].q);
    }
    free(st->layers);
    kvd_store_append_memory_give(st->store, st->charged);
    free(st);
}

static uint64_t rng_next(uint64_t *s)
{
    uint64_t x = *s += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

/* n values of dtype dt to f32; 0, or KVD_EINVAL on a non-finite value. */
static int to_f32(const uint8_t *src, kvd_dtype dt, size_t n, float *dst)
{
    for (size_t i = 0; i < n; i++) {
        float f;
        if (dt == KVD_DTYPE_F32)
            memcpy(&f, src + 4 * i, 4);
        else {
            uint16_t h = (uint16_t)(src[2 * i] | (src[2 * i + 1] << 8));
            f = dt == KVD_DTYPE_F16 ? kvd_f16_to_f32(h) : kvd_bf16_to_f32(h);
        }
        if (!isfinite(f))
            return KVD_EINVAL;
        dst[i] = f;
    }
    return 0;
}

static int header(kvd_req_ctx *ctx, cal_state *st, const Kvdepot__V1__CalibrateHeader *h,
                  kvd_error *err)
{
    if (!h->model || !h->model[0])
        return kvd_error_set(err, KVD_EINVAL, "calibrate header names no model");
    int rc = kvd_ctx_check_model(ctx, h->model, err);
    if (rc || (rc = kvd_store_model_get(ctx->svc->store, h->model, &st->model, err)))
        return rc;
    st->be = kvd_backend_narrow(kvd_store_backend(ctx->svc->store), 1);
    uint32_t D = st->model.head_dim;
    if (h->vq && (h->vq->sub_dim || h->vq->bits)) {
        uint32_t d = h->vq->sub_dim, b = h->vq->bits;
        if ((d != 2 && d != 4 && d != 8) || b < 4 || b > 12)
            return kvd_error_set(err, KVD_EINVAL,
                                 "VQ spec d%ub%u: d must be 2, 4 or 8 and b in 4..12", d, b);
        if (D % d != 0 || (D & (D - 1)) != 0)
            return kvd_error_set(err, KVD_EINVAL,
                                 "VQ needs head_dim a power of two divisible by d=%u; model %s "
                                 "has head_dim %u",
                                 d, st->model.name, D);
        st->vq_d = d;
        st->vq_b = b;
    }
    st->svd = h->svd;
    st->iters = h->iterations ? h->iterations : CAL_DEFAULT_ITERS;
    if (st->iters > 1000)
        return kvd_error_set(err, KVD_EINVAL, "iterations %u over 1000", st->iters);
    if (!(h->error_budget >= 0 && h->error_budget <= 1))
        return kvd_error_set(err, KVD_EINVAL, "error_budget %g: want 0 (no codec advice) to 1",
                             h->error_budget);
    if (h->eval_queries > 256)
        return kvd_error_set(err, KVD_EINVAL, "eval_queries %u over 256", h->eval_queries);
    st->budget = h->error_budget;
    st->page_tokens = ctx->svc->page_tokens;
    st->eval_queries = h->eval_queries ? h->eval_queries : CAL_EVAL_QUERIES;
    st->exhaustive = h->exhaustive;
    st->seed = h->seed;
    st->rng = h->seed ^ 0x6a09e667f3bcc909ull;
    st->max_samples = h->max_samples ? h->max_samples : CAL_DEFAULT_SAMPLES;
    st->layers = calloc(st->model.num_layers, sizeof *st->layers);
    if (!st->layers)
        return kvd_error_set(err, KVD_ENOMEM, "out of memory");
    st->have_header = 1;
    return 0;
}

static int sample(kvd_req_ctx *ctx, cal_state *st, const Kvdepot__V1__CalibrateSample *s,
                  kvd_error *err)
{
    const kvd_model_info *m = &st->model;
    if (s->layer >= m->num_layers)
        return kvd_error_set(err, KVD_EINVAL, "sample for layer %u; model %s has %u layers",
                             s->layer, m->name, m->num_layers);
    uint64_t n = s->num_tokens;
    size_t es = kvd_dtype_size(m->dtype);
    size_t krow = (size_t)m->num_kv_heads * m->head_dim, qrow = (size_t)m->num_q_heads * m->head_dim;
    if (n == 0 || n > (1u << 24) || s->k.len != n * krow * es || s->v.len != n * krow * es)
        return kvd_error_set(err, KVD_EINVAL,
                             "layer %u sample: K %zu and V %zu bytes for %llu tokens; want "
                             "%llu each ([token][%u kv heads][%u] %s)",
                             s->layer, s->k.len, s->v.len, (unsigned long long)n,
                             (unsigned long long)(n * krow * es), m->num_kv_heads, m->head_dim,
                             kvd_dtype_name(m->dtype));
    int has_q = s->q.len != 0;
    if (has_q && s->q.len != n * qrow * es)
        return kvd_error_set(err, KVD_EINVAL,
                             "layer %u sample: Q %zu bytes; want %llu ([token][%u q heads][%u])",
                             s->layer, s->q.len, (unsigned long long)(n * qrow * es),
                             m->num_q_heads, m->head_dim);
    cal_layer *L = &st->layers[s->layer];
    if (L->q_state && L->q_state != (has_q ? 1 : 2))
        return kvd_error_set(err, KVD_EINVAL,
                             "layer %u: Q given with some samples and not others", s->layer);
    L->q_state = has_q ? 1 : 2;
    uint64_t cap = st->max_samples;
    uint64_t need = L->kept + n < cap ? L->kept + n : cap;
    if (need > L->rows) {
        /* Grow geometrically up to the cap, so short streams stay small;
         * the kept samples of all layers are bounded by 4 x max-append-bytes. */
        uint64_t rows = 2 * L->rows > need ? 2 * L->rows : need;
        if (rows > cap)
            rows = cap;
        uint64_t row_bytes = (2 * krow + (has_q ? qrow : 0)) * sizeof(float);
        uint64_t more = (rows - L->rows) * row_bytes;
        if (st->kept_bytes + more > 4 * ctx->svc->cfg->max_append_bytes)
            return kvd_error_set(err, KVD_ENOMEM,
                                 "calibration samples would take %llu bytes, over the limit "
                                 "(4 x max-append-bytes); lower max_samples",
                                 (unsigned long long)(st->kept_bytes + more));
        /* held until the stream ends, with the appends in flight */
        int rc = kvd_store_append_memory_take(ctx->svc->store, more, err);
        if (rc)
            return rc;
        st->store = ctx->svc->store;
        st->charged += more;
        float *nk = realloc(L->k, rows * krow * sizeof(float));
        if (nk)
            L->k = nk;
        float *nv = nk ? realloc(L->v, rows * krow * sizeof(float)) : NULL;
        if (nv)
            L->v = nv;
        float *nq = nv && has_q ? realloc(L->q, rows * qrow * sizeof(float)) : NULL;
        if (nq)
            L->q = nq;
        if (!nk || !nv || (has_q && !nq))
            return kvd_error_set(err, KVD_ENOMEM, "out of memory for samples");
        st->kept_bytes += more;
        L->rows = rows;
    }
    for (uint64_t t = 0; t < n; t++) {
        uint64_t slot = L->kept < cap ? L->kept : rng_next(&st->rng) % (L->seen + 1);
        L->seen++;
        if (slot >= cap)
            continue;
        if (to_f32(s->k.data + t * krow * es, m->dtype, krow, L->k + slot * krow) ||
            to_f32(s->v.data + t * krow * es, m->dtype, krow, L->v + slot * krow) ||
            (has_q && to_f32(s->q.data + t * qrow * es, m->dtype, qrow, L->q + slot * qrow)))
            return kvd_error_set(err, KVD_EINVAL,
                                 "layer %u sample: token %llu has a non-finite value", s->layer,
                                 (unsigned long long)t);
        if (slot == L->kept)
            L->kept++;
    }
    st->samples += n;
    return 0;
}

static int cal_recv(kvd_req_ctx *ctx, void **state, grpc_byte_buffer *msg, kvd_error *err)
{
    cal_state *st = *state;
    if (!st) {
        st = calloc(1, sizeof *st);
        if (!st)
            return kvd_error_set(err, KVD_ENOMEM, "out of memory");
        *state = st;
    }
    kvd_error_clear(err);
    Kvdepot__V1__CalibrateRequest *m = (Kvdepot__V1__CalibrateRequest *)kvd_bb_unpack(
        &kvdepot__v1__calibrate_request__descriptor, msg, err);
    if (!m)
        return err && err->code
                   ? err->code
                   : kvd_error_set(err, KVD_EINVAL, "a message does not parse as CalibrateRequest");
    int rc = 0;
    if (!st->have_header) {
        if (!m->header)
            rc = kvd_error_set(err, KVD_EINVAL, "the first message carries no header");
        else
            rc = header(ctx, st, m->header, err);
    } else if (m->header) {
        rc = kvd_error_set(err, KVD_EINVAL, "header repeated after the first message");
    }
    if (!rc && m->sample)
        rc = sample(ctx, st, m->sample, err);
    protobuf_c_message_free_unpacked(&m->base, NULL);
    return rc;
}

/* Copy rows of head h out of [token][head][D] into (n, D). */
static void gather(const float *src, uint64_t n, uint32_t heads, uint32_t h, uint32_t D,
                   float *dst)
{
    for (uint64_t t = 0; t < n; t++)
        memcpy(dst + t * D, src + (t * heads + h) * D, D * sizeof(float));
}

static double rel_err(const float *x, const float *y, size_t n)
{
    double num = 0, den = 0;
    for (size_t i = 0; i < n; i++) {
        double d = (double)x[i] - y[i];
        num += d * d;
        den += (double)x[i] * x[i];
    }
    return den > 0 ? num / den : 0;
}

/* Train a (2^b, d) codebook on x (n, D) and reconstruct x into y. */
static int vq_fit(const cal_state *st, uint64_t seed, const float *x, uint64_t n, float *cb,
                  float *y, kvd_error *err)
{
    uint32_t D = st->model.head_dim, d = st->vq_d, b = st->vq_b;
    kvd_kmeans_params p = {.k = 1 << b,
                           .niter = (int)st->iters,
                           .seed = seed,
                           .max_points = CAL_KMEANS_POINTS};
    int64_t pts = (int64_t)(n * D / d);
    int rc = kvd__kmeans_train_cpu(1, 1, &p, pts, (int)d, x, (int64_t)d, cb, NULL);
    if (rc)
        return kvd_error_set(err, rc, "K-means of a VQ codebook failed");
    size_t P = D / d;
    uint8_t *c8 = b <= 8 ? malloc(n * P) : NULL;
    uint16_t *c16 = b > 8 ? malloc(n * P * 2) : NULL;
    if (!c8 && !c16)
        return kvd_error_set(err, KVD_ENOMEM, "out of memory");
    kvd__vq_encode_cpu(1, 1, (int64_t)n, (int)D, (int)d, (int)b, x, cb, c8, c16);
    rc = kvd_vq_decode_ref((int64_t)n, (int)D, (int)d, (int)b, c8, c16, cb, y);
    free(c8);
    free(c16);
    return rc ? kvd_error_set(err, rc, "VQ decode of calibration samples failed") : 0;
}

/* Energy share of the rows x (n rows, `stride` floats apart) outside the
 * first r columns of R. */
static double svd_err(const float *R, uint32_t D, int r, const float *x, uint64_t n,
                      size_t stride, float *tmp)
{
    kvd_cpu_svd_project_fast(R, (int)D, r, x, KVD_DTYPE_F32, (int64_t)n,
                             (int64_t)(stride * sizeof(float)), tmp, 1);
    double tot = 0, kept = 0;
    for (uint64_t t = 0; t < n; t++)
        for (uint32_t i = 0; i < D; i++)
            tot += (double)x[t * stride + i] * x[t * stride + i];
    for (size_t i = 0; i < n * (size_t)r; i++)
        kept += (double)tmp[i] * tmp[i];
    return tot > 0 ? fmax(0.0, 1.0 - kept / tot) : 0;
}

typedef struct cal_out {
    kvd_artifact *a;
    size_t n, cap;
    Kvdepot__V1__CalibrationError *errs;
    size_t nerrs;
} cal_out;

static float *add(cal_out *o, int kind, uint32_t l, uint32_t h, uint32_t r, uint32_t c)
{
    if (o->n == o->cap) {
        size_t nc = o->cap ? 2 * o->cap : 16;
        kvd_artifact *na = realloc(o->a, nc * sizeof *na);
        if (!na)
            return NULL;
        o->a = na;
        o->cap = nc;
    }
    kvd_artifact *a = &o->a[o->n];
    memset(a, 0, sizeof *a);
    a->kind = kind;
    a->layer = l;
    a->kv_head = h;
    a->ndim = c ? 2 : 1;
    a->shape[0] = r;
    a->shape[1] = c;
    a->data = calloc((size_t)r * (c ? c : 1), sizeof(float));
    if (!a->data)
        return NULL;
    o->n++;
    return a->data;
}

/* Everything for one (layer, head). */
static int calibrate_head(const cal_state *st, uint32_t l, uint32_t h, cal_out *o,
                          Kvdepot__V1__CalibrationError *e, kvd_error *err)
{
    const cal_layer *L = &st->layers[l];
    uint32_t D = st->model.head_dim, H = st->model.num_kv_heads, Hq = st->model.num_q_heads;
    uint64_t n = L->train;
    float *kx = malloc(n * D * sizeof(float)), *vx = malloc(n * D * sizeof(float));
    float *t1 = malloc(n * D * sizeof(float)), *t2 = malloc(n * D * sizeof(float));
    double *gram = calloc((size_t)D * D, sizeof(double));
    int rc = 0;
    if (!kx || !vx || !t1 || !t2 || !gram) {
        rc = kvd_error_set(err, KVD_ENOMEM, "out of memory");
        goto out;
    }
    gather(L->k, n, H, h, D, kx);
    gather(L->v, n, H, h, D, vx);
    e->layer = l;
    e->kv_head = h;
    float *lambda = add(o, KVD_ARTIFACT_KEY_SMOOTHING, l, h, D, 0);
    if (!lambda) {
        rc = kvd_error_set(err, KVD_ENOMEM, "out of memory");
        goto out;
    }
    kvd_vq_smooth_factors_ref((int64_t)n, (int)D, kx, lambda);
    uint64_t seed = st->seed ^ ((uint64_t)l << 32 | h) * 0x9e3779b97f4a7c15ull;
    if (st->vq_d) {
        uint32_t rows = 1u << st->vq_b;
        float *cbk = add(o, KVD_ARTIFACT_VQ_CODEBOOK_K, l, h, rows, st->vq_d);
        float *cbv = cbk ? add(o, KVD_ARTIFACT_VQ_CODEBOOK_V, l, h, rows, st->vq_d) : NULL;
        if (!cbv) {
            rc = kvd_error_set(err, KVD_ENOMEM, "out of memory");
            goto out;
        }
        /* Keys: train in the smoothed + rotated space; measure the error
         * after rotating back (H_D is its own inverse) and re-scaling. */
        kvd_backend *be = (kvd_backend *)&st->be;
        if ((rc = kvd_advise_rotate_keys(be, (int64_t)n, (int)D, kx, lambda, t1, err)) ||
            (rc = vq_fit(st, seed, t1, n, cbk, t2, err)) ||
            (rc = kvd_advise_unrotate_keys(be, (int64_t)n, (int)D, t2, lambda, t1, err)))
            goto out;
        e->vq_k = rel_err(kx, t1, n * D);
        if ((rc = vq_fit(st, seed + 1, vx, n, cbv, t2, err)))
            goto out;
        e->vq_v = rel_err(vx, t2, n * D);
    }
    if (st->svd) {
        for (int which = 0; which < 2; which++) {
            const float *x = which ? vx : kx;
            memset(gram, 0, (size_t)D * D * sizeof(double));
            if ((rc = kvd_svd_gram_accumulate(gram, (int)D, x, KVD_DTYPE_F32, (int64_t)n,
                                              (int64_t)D * 4, 1.0, err)))
                goto out;
            /* Keys: the queries of every head reading this kv head share R. */
            for (uint32_t j = 0; !which && L->q && j < Hq; j++)
                if (j / (Hq / H) == h &&
                    (rc = kvd_svd_gram_accumulate(gram, (int)D, L->q + (size_t)j * D,
                                                  KVD_DTYPE_F32, (int64_t)n,
                                                  (int64_t)Hq * D * 4, 1.0, err)))
                    goto out;
            float *R = add(o, which ? KVD_ARTIFACT_SVD_ROTATION_V : KVD_ARTIFACT_SVD_ROTATION_K,
                           l, h, D, D);
            float *sv = R ? add(o, which ? KVD_ARTIFACT_SVD_SPECTRUM_V
                                         : KVD_ARTIFACT_SVD_SPECTRUM_K,
                                l, h, D, 0)
                          : NULL;
            if (!sv) {
                rc = kvd_error_set(err, KVD_ENOMEM, "out of memory");
                goto out;
            }
            if ((rc = kvd_svd_rotation(gram, (int)D, R, sv, err)))
                goto out;
            int r = kvd_svd_kept_width(sv, (int)D, CAL_SVD_RATE, CAL_SVD_ALIGN);
            double er = svd_err(R, D, r, x, n, D, t1);
            if (which) {
                e->svd_v = er;
                e->svd_width_v = (uint32_t)r;
            } else {
                e->svd_k = er;
                e->svd_width_k = (uint32_t)r;
            }
        }
    }
out:
    free(kx);
    free(vx);
    free(t1);
    free(t2);
    free(gram);
    return rc;
}

/* The artifact of (kind, layer, head) trained by this call, or NULL. */
static const float *trained(const cal_out *o, int kind, uint32_t l, uint32_t h)
{
    for (size_t i = 0; i < o->n; i++)
        if (o->a[i].kind == kind && o->a[i].layer == l && o->a[i].kv_head == h)
            return o->a[i].data;
    return NULL;
}

/* Codec advice on the held-out tokens of every layer with samples. */
static int advise(const cal_state *st, const cal_out *o, kvd_advice *adv, kvd_error *err)
{
    const kvd_model_info *m = &st->model;
    const uint32_t H = m->num_kv_heads;
    const size_t krow = (size_t)H * m->head_dim, qrow = (size_t)m->num_q_heads * m->head_dim;
    kvd_advise_layer *ls = calloc(m->num_layers, sizeof *ls);
    const float **arts = calloc((size_t)m->num_layers * 7 * H, sizeof *arts);
    if (!ls || !arts) {
        free(ls);
        free(arts);
        return kvd_error_set(err, KVD_ENOMEM, "out of memory");
    }
    static const int kinds[7] = {KVD_ARTIFACT_KEY_SMOOTHING,  KVD_ARTIFACT_VQ_CODEBOOK_K,
                                 KVD_ARTIFACT_VQ_CODEBOOK_V,  KVD_ARTIFACT_SVD_ROTATION_K,
                                 KVD_ARTIFACT_SVD_SPECTRUM_K, KVD_ARTIFACT_SVD_ROTATION_V,
                                 KVD_ARTIFACT_SVD_SPECTRUM_V};
    uint32_t n = 0;
    for (uint32_t l = 0; l < m->num_layers; l++) {
        const cal_layer *cl = &st->layers[l];
        if (!cl->kept)
            continue;
        kvd_advise_layer *x = &ls[n++];
        x->layer = l;
        x->k = cl->k + cl->train * krow;
        x->v = cl->v + cl->train * krow;
        x->q = cl->q + cl->train * qrow;
        x->n = cl->kept - cl->train;
        const float ***slot[7] = {&x->lambda, &x->cb_k,  &x->cb_v, &x->rot_k,
                                  &x->sv_k,   &x->rot_v, &x->sv_v};
        for (int k = 0; k < 7; k++) {
            const float **a = arts + ((size_t)l * 7 + (size_t)k) * H;
            for (uint32_t h = 0; h < H; h++)
                a[h] = trained(o, kinds[k], l, h);
            *slot[k] = a;
        }
    }
    kvd_advise_params p = {.kv_heads = H,
                           .q_heads = m->num_q_heads,
                           .head_dim = m->head_dim,
                           .dtype = m->dtype,
                           .page_tokens = st->page_tokens,
                           .vq_d = st->vq_d,
                           .vq_b = st->vq_b,
                           .svd = st->svd,
                           .budget = st->budget,
                           .queries = st->eval_queries,
                           .exhaustive = st->exhaustive,
                           .be = (kvd_backend *)&st->be};
    int rc = kvd_advise(&p, ls, n, adv, err);
    free(ls);
    free(arts);
    return rc;
}

static int cal_finish(kvd_req_ctx *ctx, void **state, grpc_byte_buffer **reply, kvd_error *err)
{
    cal_state *st = *state;
    if (!st || !st->have_header)
        return kvd_error_set(err, KVD_EINVAL, "empty Calibrate stream (no header)");
    if (st->samples == 0)
        return kvd_error_set(err, KVD_EINVAL, "Calibrate stream carried no samples");
    cal_out o = {0};
    uint32_t L = st->model.num_layers, H = st->model.num_kv_heads;
    size_t nheads = 0;
    for (uint32_t l = 0; l < L; l++) {
        cal_layer *cl = &st->layers[l];
        nheads += cl->kept ? H : 0;
        cl->train = cl->kept;
        if (!cl->kept || st->budget <= 0)
            continue;
        if (cl->q_state != 1)
            return kvd_error_set(err, KVD_EINVAL,
                                 "codec advice (error_budget) needs Q in the samples; layer %u "
                                 "has none",
                                 l);
        uint64_t ne = cl->kept / 4 < CAL_EVAL_MAX ? cl->kept / 4 : CAL_EVAL_MAX;
        ne -= ne % 128;
        if (ne < 128)
            return kvd_error_set(err, KVD_EINVAL,
                                 "codec advice (error_budget) holds out a quarter of a layer's "
                                 "tokens, at least 128: layer %u kept %llu tokens, want 512 or "
                                 "more",
                                 l, (unsigned long long)cl->kept);
        cl->train = cl->kept - ne;
    }
    o.errs = calloc(nheads, sizeof *o.errs);
    int rc = o.errs ? 0 : kvd_error_set(err, KVD_ENOMEM, "out of memory");
    for (uint32_t l = 0; !rc && l < L; l++) {
        for (uint32_t h = 0; !rc && st->layers[l].kept && h < H; h++) {
            Kvdepot__V1__CalibrationError *e = &o.errs[o.nerrs++];
            kvdepot__v1__calibration_error__init(e);
            rc = calibrate_head(st, l, h, &o, e, err);
        }
    }
    kvd_advice adv = {0};
    if (!rc && st->budget > 0)
        rc = advise(st, &o, &adv, err);
    if (!rc && kvd_ctx_expired(ctx))
        rc = kvd_error_set(err, KVD_ETIMEDOUT, "deadline passed before the artifacts were stored");
    if (!rc)
        rc = kvd_store_artifacts_put(ctx->svc->store, st->model.name, o.a, o.n, err);
    if (!rc) {
        Kvdepot__V1__CalibrationError **ep = malloc((o.nerrs ? o.nerrs : 1) * sizeof *ep);
        if (!ep)
            rc = kvd_error_set(err, KVD_ENOMEM, "out of memory");
        else {
            for (size_t i = 0; i < o.nerrs; i++)
                ep[i] = &o.errs[i];
            Kvdepot__V1__CalibrateResponse resp = KVDEPOT__V1__CALIBRATE_RESPONSE__INIT;
            resp.samples = st->samples;
            resp.artifacts = (uint32_t)o.n;
            resp.n_errors = o.nerrs;
            resp.errors = ep;
            if (st->budget > 0)
                resp.advice = &adv.msg;
            *reply = kvd_pack(&resp.base);
            if (!*reply)
                rc = kvd_error_set(err, KVD_ENOMEM, "out of memory packing the reply");
            free(ep);
        }
    }
    kvd_advice_free(&adv);
    kvd_artifacts_free(o.a, o.n);
    free(o.errs);
    return rc;
}

const kvd_stream_ops kvd_calibrate_ops = {
    .recv = cal_recv,
    .finish = cal_finish,
    .release = cal_release,
};
