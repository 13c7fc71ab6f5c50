/*
 * Accuracy report: attention-output error of every compressed cache form
 * against exact fp32 attention, and PQ top-k recall against exact scores,
 * on synthetic K/V shaped like real LLM caches (see make_data()).
 *
 *   kvd_accuracy [max_tokens]       (default 32768; runs 4096 and 32768)
 *
 * Prints Markdown tables (docs/kernels-accuracy.md holds a copy).
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvdepot/attention.h"
#include "kvdepot/pq.h"
#include "kvdepot/quant.h"
#include "kvdepot/svd.h"
#include "kvdepot/vq.h"
#include "testutil.h"

enum { HKV = 2, G = 4, HQ = HKV * G, D = 128 };

static kvd_backend *be;

static kvd_tensor tn(kvd_dtype dt, void *data, int nd, int64_t a, int64_t b, int64_t c)
{
    int64_t s[3] = {a, b, c};
    return kvd_tensor_make(dt, data, nd, s);
}

/*
 * Synthetic cache of one layer, HKV kv heads, T tokens:
 *  - low-rank structure: K = Z W_k + noise with a decaying spectrum (rank
 *    ~48 of 128), V likewise (rank ~64); queries live in the key subspace
 *    (z_q W_k), as ZACK observes for the Q-K pair;
 *  - 4 key channels with ~10x larger values and a bias (the outlier channels
 *    of real key caches);
 *  - per-token scale (log-normal, sigma 0.3);
 *  - rotary position structure (pairs of channels rotated by t * 10000^(-2i/D));
 *  - heavy-tailed attention: 4 "sink" tokens at the start aligned with the
 *    common direction of the queries, and per query head 8 "needle" tokens it
 *    points at.
 */
typedef struct data {
    int64_t T;
    float *k, *v; /* (HKV, T, D) */
    float *q;     /* (HQ, D) */
    float *qcal;  /* (HKV, NCAL, D) calibration queries for SVD */
} data;

enum { NCAL = 512 };

/* query scale: sets how peaked attention is (see the statistics printed) */
static float qtemp = 1.0f;
#define PPL_FRAC 0.02
static float NEEDLE = 1.0f, SINK = 0.3f, QU = 0.2f;

static void gen_lowrank(tu_rng *r, float *x, int64_t T, int L, const float *W, float noise, float tsig,
                        const int *outl, int nout, int rotary)
{
    float z[128];
    for (int64_t t = 0; t < T; t++) {
        for (int l = 0; l < L; l++)
            z[l] = tu_rng_normal(r);
        float ts = expf(tsig * tu_rng_normal(r));
        float *row = x + t * D;
        for (int j = 0; j < D; j++) {
            float acc = 0;
            for (int l = 0; l < L; l++)
                acc += z[l] * W[l * D + j];
            row[j] = ts * (acc + noise * tu_rng_normal(r));
        }
        for (int o = 0; o < nout; o++)
            row[outl[o]] = ts * (8.0f + 10.0f * row[outl[o]]);
        if (rotary)
            for (int j = 0; j + 1 < D; j += 2) {
                double th = (double)t * pow(10000.0, -(double)j / D);
                float c = (float)cos(th), s = (float)sin(th), a = row[j], b = row[j + 1];
                row[j] = a * c - b * s;
                row[j + 1] = a * s + b * c;
            }
    }
}

static data make_data(int64_t T, uint64_t seed)
{
    /* rm draws the "model" (subspaces, outlier channels), shared by every
     * call so calibration and evaluation data come from the same model; r
     * draws the tokens and queries */
    tu_rng r, rm;
    tu_rng_seed(&r, seed);
    tu_rng_seed(&rm, 20251122);
    data dd;
    dd.T = T;
    dd.k = malloc(sizeof(float) * HKV * T * D);
    dd.v = malloc(sizeof(float) * HKV * T * D);
    dd.q = malloc(sizeof(float) * HQ * D);
    dd.qcal = malloc(sizeof(float) * HKV * NCAL * D);
    const int LK = 48, LV = 64;
    float *Wk = malloc(sizeof(float) * LK * D), *Wv = malloc(sizeof(float) * LV * D);
    for (int h = 0; h < HKV; h++) {
        /* head-specific subspaces with a decaying spectrum */
        for (int l = 0; l < LK; l++)
            for (int j = 0; j < D; j++)
                Wk[l * D + j] = tu_rng_normal(&rm) / (1.0f + l / 6.0f) / sqrtf((float)LK);
        for (int l = 0; l < LV; l++)
            for (int j = 0; j < D; j++)
                Wv[l * D + j] = tu_rng_normal(&rm) / (1.0f + l / 10.0f) / sqrtf((float)LV);
        int outl[4];
        for (int o = 0; o < 4; o++)
            outl[o] = (int)tu_rng_below(&rm, D);
        float *K = dd.k + (size_t)h * T * D, *V = dd.v + (size_t)h * T * D;
        gen_lowrank(&r, K, T, LK, Wk, 0.05f, 0.3f, outl, 4, 1);
        gen_lowrank(&r, V, T, LV, Wv, 0.05f, 0.2f, NULL, 0, 0);
        /* common query direction u: the mean key direction */
        float u[D] = {0}, un = 0;
        for (int64_t t = 0; t < T; t++)
            for (int j = 0; j < D; j++)
                u[j] += K[t * D + j];
        for (int j = 0; j < D; j++)
            un += u[j] * u[j];
        un = sqrtf(un);
        for (int j = 0; j < D; j++)
            u[j] /= un;
        double kn = 0;
        for (int64_t t = 0; t < T; t++)
            for (int j = 0; j < D; j++)
                kn += (double)K[t * D + j] * K[t * D + j];
        float krms = (float)sqrt(kn / (double)T);
        /* sinks: the first 4 tokens lean on u */
        for (int t = 0; t < 4 && t < T; t++)
            for (int j = 0; j < D; j++)
                K[t * D + j] += SINK * krms * u[j];
        /* queries in the key subspace, + u, + needles; calibration queries
         * drawn the same way (without needles) */
        for (int g = 0; g < G + NCAL; g++) {
            float *qg = g < G ? dd.q + (size_t)(h * G + g) * D : dd.qcal + ((size_t)h * NCAL + g - G) * D;
            float z[48];
            for (int l = 0; l < LK; l++)
                z[l] = tu_rng_normal(&r);
            for (int j = 0; j < D; j++) {
                float acc = 0;
                for (int l = 0; l < LK; l++)
                    acc += z[l] * Wk[l * D + j];
                qg[j] = 0.8f * acc * sqrtf((float)D) / krms * 4.0f + QU * sqrtf((float)D) / krms * 4.0f * u[j];
            }
            if (g < G && T > 16)
                for (int nd = 0; nd < 8; nd++) {
                    int64_t t = 4 + (int64_t)tu_rng_below(&r, (uint32_t)(T - 4));
                    float kk = 0;
                    for (int j = 0; j < D; j++)
                        kk += K[t * D + j] * K[t * D + j];
                    for (int j = 0; j < D; j++)
                        qg[j] += NEEDLE * sqrtf((float)D) * 4.0f * K[t * D + j] / kk * krms / sqrtf((float)D);
                }
        }
    }
    /* set the logit scale: per query head, q is scaled so that the
     * attention perplexity exp(entropy) is PPL_FRAC * T tokens (bisection on
     * the scale): heavy-tailed, neither uniform nor one-hot */
    double *lg = malloc(sizeof(double) * T);
    for (int hq = 0; hq < HQ; hq++) {
        const float *K = dd.k + (size_t)(hq / G) * T * D;
        float *qg = dd.q + (size_t)hq * D;
        for (int64_t t = 0; t < T; t++) {
            double l = 0;
            for (int j = 0; j < D; j++)
                l += (double)qg[j] * K[t * D + j];
            lg[t] = l / sqrt((double)D);
        }
        double lo = -30, hi = 10, target = log(PPL_FRAC * (double)T);
        for (int it = 0; it < 60; it++) {
            double c = exp(0.5 * (lo + hi)), m = -INFINITY, z = 0, e = 0;
            for (int64_t t = 0; t < T; t++)
                m = c * lg[t] > m ? c * lg[t] : m;
            for (int64_t t = 0; t < T; t++) {
                double w = exp(c * lg[t] - m);
                z += w;
                e += w * (c * lg[t] - m);
            }
            double H = log(z) - e / z; /* entropy in nats */
            if (H > target)
                lo = 0.5 * (lo + hi); /* too flat: sharpen */
            else
                hi = 0.5 * (lo + hi);
        }
        double c = exp(0.5 * (lo + hi)) * qtemp;
        for (int j = 0; j < D; j++)
            qg[j] *= (float)c;
    }
    free(lg);
    free(Wk), free(Wv);
    return dd;
}

static void free_data(data *d)
{
    free(d->k), free(d->v), free(d->q), free(d->qcal);
}

static kvd_attn_dims dims(int hd)
{
    kvd_attn_dims d = {HQ, HKV, hd, hd, 1.0f / sqrtf((float)D)};
    return d;
}

/* rms of the V rows of the current data set: a second error scale. A
 * softmax-weighted average of many zero-mean value rows is short (about
 * rms(v) / sqrt(effective number of tokens)), so the relative error grows
 * with how spread attention is even when the output moves little compared
 * to a value vector; both are printed. */
static double v_rms, ref_norm;

/* relative L2 error of the whole output */
static double rel_err(const float *ref, const float *x, size_t n)
{
    double num = 0, den = 0;
    for (size_t i = 0; i < n; i++) {
        num += ((double)x[i] - ref[i]) * ((double)x[i] - ref[i]);
        den += (double)ref[i] * ref[i];
    }
    return sqrt(num / den);
}

static void exact(const data *d, float *out, float *lse)
{
    kvd_attn_dense_args a = {dims(D), tn(KVD_DTYPE_F32, d->q, 2, HQ, D, 0), tn(KVD_DTYPE_F32, d->k, 3, HKV, d->T, D),
                             tn(KVD_DTYPE_F32, d->v, 3, HKV, d->T, D), tn(KVD_DTYPE_F32, out, 2, HQ, D, 0),
                             tn(KVD_DTYPE_F32, lse, 1, HQ, 0, 0)};
    if (kvd_cpu_attn_dense_ref(&a))
        abort();
}

/* attention statistics of the exact run: mean top-1 weight, mean number of
 * tokens holding 90% of the mass */
static double sink_mass; /* mean softmax mass of the first 4 tokens (set by attn_stats) */

static void attn_stats(const data *d, double *top1, double *n90)
{
    sink_mass = 0;
    double s1 = 0, s90 = 0;
    int64_t T = d->T;
    double *p = malloc(sizeof(double) * T);
    for (int hq = 0; hq < HQ; hq++) {
        int h = hq / G;
        double m = -INFINITY, l = 0;
        for (int64_t t = 0; t < T; t++) {
            double dot = 0;
            for (int j = 0; j < D; j++)
                dot += (double)d->q[hq * D + j] * d->k[((size_t)h * T + t) * D + j];
            p[t] = dot / sqrt((double)D);
            m = p[t] > m ? p[t] : m;
        }
        for (int64_t t = 0; t < T; t++) {
            p[t] = exp(p[t] - m);
            l += p[t];
        }
        for (int64_t t = 0; t < T; t++)
            p[t] /= l;
        for (int t = 0; t < 4 && t < T; t++)
            sink_mass += p[t] / HQ;
        /* sort descending (partial: selection of mass) */
        int cmp(const void *a, const void *b);
        qsort(p, (size_t)T, sizeof *p, cmp);
        s1 += p[0];
        double acc = 0;
        int64_t n = 0;
        while (acc < 0.9 && n < T)
            acc += p[n++];
        s90 += (double)n;
    }
    *top1 = s1 / HQ;
    *n90 = s90 / HQ;
    free(p);
}

int cmp(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? 1 : x > y ? -1 : 0;
}

/* ---- INT ---- */

typedef struct qarr {
    kvd_attn_qdata qd;
    void *mem;
} qarr;

static qarr quant_all(const float *x, int64_t T, int W, int bits, int P, int axis, int64_t row_stride)
{
    qarr q;
    memset(&q, 0, sizeof q);
    int64_t rows = axis == KVD_ATTN_AXIS_TOKEN ? T : W, along = axis == KVD_ATTN_AXIS_TOKEN ? W : T;
    size_t cb = (size_t)(rows * along * bits / 8), pn = (size_t)(rows * along / P);
    q.mem = malloc(HKV * (cb + 6 * pn) + 64);
    uint8_t *codes = q.mem;
    uint16_t *mn = (uint16_t *)(codes + HKV * cb), *sc = mn + HKV * pn, *sm = sc + HKV * pn;
    for (int h = 0; h < HKV; h++) {
        kvd_qtensor qt;
        kvd_qtensor_init(&qt, T, W, bits, P, axis == KVD_ATTN_AXIS_TOKEN ? KVD_QAXIS_TOKEN : KVD_QAXIS_CHANNEL, NULL,
                         NULL);
        qt.codes = codes + h * cb;
        qt.min = mn + h * pn;
        qt.scale = sc + h * pn;
        qt.sum = sm + h * pn;
        kvd_tensor xt = tn(KVD_DTYPE_F32, (void *)(x + h * row_stride), 2, T, W, 0);
        kvd_error err;
        if (kvd_quantize(be, &xt, &qt, KVD_ROUND_NEAREST, 0, &err)) {
            fprintf(stderr, "quantize: %s\n", err.msg);
            exit(1);
        }
    }
    q.qd.bits = bits;
    q.qd.group = P;
    q.qd.axis = axis;
    q.qd.codes = tn(KVD_DTYPE_U8, codes, 3, HKV, rows, along * bits / 8);
    q.qd.min = tn(KVD_DTYPE_F16, mn, 3, HKV, rows, along / P);
    q.qd.scale = tn(KVD_DTYPE_F16, sc, 3, HKV, rows, along / P);
    q.qd.sum = tn(KVD_DTYPE_U16, sm, 3, HKV, rows, along / P);
    return q;
}

/* INT attention over tokens [s, T) of k/v (width W, rows of D floats apart
 * in k/v: kv row stride), plus sinks [0, s) raw merged by log-sum-exp. */
/* keys (and queries) through the VQ transform (smooth by lam, Hadamard), or
 * dequantized K/V attended in float (deq), see main() */
static const float *int_lam;
static int int_deq;   /* 1: K and V dequantized; 2: only K (V exact); 3: only V (K exact) */
static int int_kaxis; /* KVD_ATTN_AXIS_TOKEN (HACK) or KVD_ATTN_AXIS_CHANNEL (KIVI-style keys) */

static void row(const char *name, double bpv, double e)
{
    printf("| %s | %.2f | %.4f | %.4f |\n", name, bpv, e, e * ref_norm / (sqrt((double)HQ) * v_rms));
}

static double run_int(const data *d0, const float *ref, int bits, int P, int vaxis, int sinks)
{
    data tmp = *d0, *d = &tmp;
    kvd_error err;
    if (int_lam) {
        tmp.k = malloc(sizeof(float) * HKV * d0->T * D);
        tmp.q = malloc(sizeof(float) * HQ * D);
        for (int h = 0; h < HKV; h++) {
            kvd_tensor k = tn(KVD_DTYPE_F32, d0->k + h * d0->T * D, 2, d0->T, D, 0);
            kvd_tensor kt = tn(KVD_DTYPE_F32, tmp.k + h * d0->T * D, 2, d0->T, D, 0);
            kvd_tensor q = tn(KVD_DTYPE_F32, d0->q + h * G * D, 2, G, D, 0);
            kvd_tensor qt = tn(KVD_DTYPE_F32, tmp.q + h * G * D, 2, G, D, 0);
            kvd_tensor lam = tn(KVD_DTYPE_F32, (void *)(int_lam + h * D), 1, D, 0, 0);
            if (kvd_vq_transform_keys(be, &k, &lam, &kt, &err) || kvd_vq_transform_queries(be, &q, &lam, &qt, &err)) {
                fprintf(stderr, "transform: %s\n", err.msg);
                exit(1);
            }
        }
    }
    int64_t T = d->T, Tq = T - sinks;
    float *k = d->k + sinks * D, *v = d->v + sinks * D;
    qarr kq = quant_all(k, Tq, D, bits, P, int_kaxis, T * D);
    qarr vq = quant_all(v, Tq, D, bits, P, vaxis, T * D);
    float out[HQ * D], lse[HQ];
    kvd_attn_int_args a;
    memset(&a, 0, sizeof a);
    a.dims = dims(D);
    a.q = tn(KVD_DTYPE_F32, d->q, 2, HQ, D, 0);
    a.n_tokens = Tq;
    a.k = kq.qd;
    a.v = vq.qd;
    a.out = tn(KVD_DTYPE_F32, out, 2, HQ, D, 0);
    a.lse = tn(KVD_DTYPE_F32, lse, 1, HQ, 0, 0);
    if (int_deq) {
        /* the same codes dequantized, attended in float: what the int8
         * rounding of q and P in the homomorphic kernel adds */
        float *kd = malloc(sizeof(float) * HKV * Tq * D), *vd = malloc(sizeof(float) * HKV * Tq * D);
        for (int h = 0; h < HKV; h++) {
            kvd_qtensor qk, qv;
            kvd_qtensor_init(&qk, Tq, D, bits, P, int_kaxis == KVD_ATTN_AXIS_TOKEN ? KVD_QAXIS_TOKEN : KVD_QAXIS_CHANNEL,
                             NULL, NULL);
            kvd_qtensor_init(&qv, Tq, D, bits, P, vaxis == KVD_ATTN_AXIS_TOKEN ? KVD_QAXIS_TOKEN : KVD_QAXIS_CHANNEL,
                             NULL, NULL);
            const kvd_attn_qdata *sq[2] = {&kq.qd, &vq.qd};
            kvd_qtensor *dq[2] = {&qk, &qv};
            for (int s2 = 0; s2 < 2; s2++) {
                dq[s2]->codes = (uint8_t *)sq[s2]->codes.data + h * sq[s2]->codes.stride[0];
                dq[s2]->min = (uint16_t *)((char *)sq[s2]->min.data + h * sq[s2]->min.stride[0]);
                dq[s2]->scale = (uint16_t *)((char *)sq[s2]->scale.data + h * sq[s2]->scale.stride[0]);
                dq[s2]->sum = (uint16_t *)((char *)sq[s2]->sum.data + h * sq[s2]->sum.stride[0]);
            }
            kvd_tensor yk = tn(KVD_DTYPE_F32, kd + h * Tq * D, 2, Tq, D, 0), yv = tn(KVD_DTYPE_F32, vd + h * Tq * D, 2, Tq, D, 0);
            kvd_dequantize_ref(&qk, &yk);
            kvd_dequantize_ref(&qv, &yv);
            /* one side exact: which of K and V the error comes from */
            for (int64_t t = 0; t < Tq; t++)
                for (int j = 0; j < D; j++) {
                    if (int_deq == 3)
                        kd[(h * Tq + t) * D + j] = k[h * T * D + t * D + j];
                    if (int_deq == 2)
                        vd[(h * Tq + t) * D + j] = v[h * T * D + t * D + j];
                }
        }
        kvd_attn_dense_args da = {dims(D), a.q, tn(KVD_DTYPE_F32, kd, 3, HKV, Tq, D), tn(KVD_DTYPE_F32, vd, 3, HKV, Tq, D),
                                  a.out, a.lse};
        if (kvd_attn_dense(be, 1, &da, &err))
            exit(1);
        free(kd), free(vd);
    } else if (kvd_attn_quant(be, 1, &a, &err)) {
        fprintf(stderr, "int attention: %s\n", err.msg);
        exit(1);
    }
    if (sinks) {
        float so[HQ * D], sl[HQ];
        kvd_attn_dense_args da = {dims(D), a.q, tn(KVD_DTYPE_F32, d->k, 3, HKV, sinks, D),
                                  tn(KVD_DTYPE_F32, d->v, 3, HKV, sinks, D), tn(KVD_DTYPE_F32, so, 2, HQ, D, 0),
                                  tn(KVD_DTYPE_F32, sl, 1, HQ, 0, 0)};
        da.k.stride[0] = da.v.stride[0] = T * D * 4;
        kvd_attn_merge_args m = {a.out, a.lse, da.out, da.lse, a.out, a.lse};
        if (kvd_attn_dense(be, 1, &da, &err) || kvd_attn_merge(be, 1, &m, &err)) {
            fprintf(stderr, "sinks: %s\n", err.msg);
            exit(1);
        }
    }
    free(kq.mem), free(vq.mem);
    if (int_lam)
        free(tmp.k), free(tmp.q);
    return rel_err(ref, out, HQ * D);
}

/* ---- VQ ---- */

typedef struct vqcal {
    float *kcb, *vcb, *lam; /* (HKV, 2^b, d), (HKV, 2^b, d), (HKV, D) */
} vqcal;

static vqcal vq_calibrate(const data *cal, int d, int b, int transform)
{
    vqcal c;
    int K = 1 << b;
    c.kcb = malloc(sizeof(float) * HKV * K * d);
    c.vcb = malloc(sizeof(float) * HKV * K * d);
    c.lam = malloc(sizeof(float) * HKV * D);
    int64_t T = cal->T;
    float *kt = malloc(sizeof(float) * T * D);
    kvd_kmeans_params km = {K, 10, 42, b > 8 ? 32768 : 0};
    kvd_error err;
    for (int h = 0; h < HKV; h++) {
        kvd_tensor k = tn(KVD_DTYPE_F32, cal->k + h * T * D, 2, T, D, 0);
        kvd_tensor lam = tn(KVD_DTYPE_F32, c.lam + h * D, 1, D, 0, 0);
        kvd_tensor out = tn(KVD_DTYPE_F32, kt, 2, T, D, 0);
        kvd_tensor kcb = tn(KVD_DTYPE_F32, c.kcb + (size_t)h * K * d, 2, K, d, 0);
        kvd_tensor vcb = tn(KVD_DTYPE_F32, c.vcb + (size_t)h * K * d, 2, K, d, 0);
        kvd_tensor vv = tn(KVD_DTYPE_F32, cal->v + h * T * D, 2, T, D, 0);
        int rc = 0;
        if (transform) {
            rc = kvd_vq_smooth_factors(be, &k, &lam, &err);
            if (!rc)
                rc = kvd_vq_transform_keys(be, &k, &lam, &out, &err);
        } else
            memcpy(kt, k.data, sizeof(float) * T * D);
        if (!rc)
            rc = kvd_vq_train(be, &out, &km, &kcb, NULL, &err);
        if (!rc)
            rc = kvd_vq_train(be, &vv, &km, &vcb, NULL, &err);
        if (rc) {
            fprintf(stderr, "vq calibrate: %s\n", err.msg);
            exit(1);
        }
    }
    free(kt);
    return c;
}

static double run_vq(const data *dd, const float *ref, const vqcal *c, int d, int b, int transform)
{
    int64_t T = dd->T;
    int K = 1 << b, npos = D / d;
    size_t es = b <= 8 ? 1 : 2;
    void *kc = malloc(es * HKV * T * npos), *vc = malloc(es * HKV * T * npos);
    float *kt = malloc(sizeof(float) * T * D);
    kvd_error err;
    kvd_dtype cdt = b <= 8 ? KVD_DTYPE_U8 : KVD_DTYPE_U16;
    for (int h = 0; h < HKV; h++) {
        kvd_tensor k = tn(KVD_DTYPE_F32, dd->k + h * T * D, 2, T, D, 0);
        kvd_tensor lam = tn(KVD_DTYPE_F32, c->lam + h * D, 1, D, 0, 0);
        kvd_tensor out = tn(KVD_DTYPE_F32, kt, 2, T, D, 0);
        int rc = 0;
        if (transform)
            rc = kvd_vq_transform_keys(be, &k, &lam, &out, &err);
        else
            memcpy(kt, k.data, sizeof(float) * T * D);
        kvd_tensor kcb = tn(KVD_DTYPE_F32, c->kcb + (size_t)h * K * d, 2, K, d, 0);
        kvd_tensor vcb = tn(KVD_DTYPE_F32, c->vcb + (size_t)h * K * d, 2, K, d, 0);
        kvd_tensor kcodes = tn(cdt, (char *)kc + es * h * T * npos, 2, T, npos, 0);
        kvd_tensor vcodes = tn(cdt, (char *)vc + es * h * T * npos, 2, T, npos, 0);
        kvd_tensor vv = tn(KVD_DTYPE_F32, dd->v + h * T * D, 2, T, D, 0);
        if (!rc)
            rc = kvd_vq_encode(be, &out, &kcb, &kcodes, &err);
        if (!rc)
            rc = kvd_vq_encode(be, &vv, &vcb, &vcodes, &err);
        if (rc) {
            fprintf(stderr, "vq encode: %s\n", err.msg);
            exit(1);
        }
    }
    float o[HQ * D], l[HQ];
    kvd_attn_vq_args a;
    memset(&a, 0, sizeof a);
    a.dims = dims(D);
    a.q = tn(KVD_DTYPE_F32, dd->q, 2, HQ, D, 0);
    a.n_tokens = T;
    a.k_sub_dim = a.v_sub_dim = d;
    a.k_bits = a.v_bits = b;
    a.k_codes = tn(cdt, kc, 3, HKV, T, npos);
    a.v_codes = tn(cdt, vc, 3, HKV, T, npos);
    a.k_codebook = tn(KVD_DTYPE_F32, c->kcb, 3, HKV, K, d);
    a.v_codebook = tn(KVD_DTYPE_F32, c->vcb, 3, HKV, K, d);
    if (transform) {
        a.k_lambda = tn(KVD_DTYPE_F32, c->lam, 2, HKV, D, 0);
        a.k_hadamard = 1;
    }
    a.out = tn(KVD_DTYPE_F32, o, 2, HQ, D, 0);
    a.lse = tn(KVD_DTYPE_F32, l, 1, HQ, 0, 0);
    if (kvd_attn_vq(be, 1, &a, &err)) {
        fprintf(stderr, "vq attention: %s\n", err.msg);
        exit(1);
    }
    free(kc), free(vc), free(kt);
    return rel_err(ref, o, HQ * D);
}

/* ---- SVD ---- */

typedef struct svdcal {
    float *Rk, *Rv, svk[HKV][D], svv[HKV][D];
} svdcal;

static svdcal svd_calibrate(const data *cal)
{
    svdcal s;
    s.Rk = malloc(sizeof(float) * HKV * D * D);
    s.Rv = malloc(sizeof(float) * HKV * D * D);
    int64_t T = cal->T;
    for (int h = 0; h < HKV; h++) {
        double *gk = calloc(D * D, sizeof(double)), *gv = calloc(D * D, sizeof(double));
        /* Q-K pair: keys and calibration queries, balanced to equal total energy */
        double ek = 0, eq = 0;
        for (int64_t i = 0; i < T * D; i++)
            ek += (double)cal->k[h * T * D + i] * cal->k[h * T * D + i];
        for (int64_t i = 0; i < NCAL * D; i++)
            eq += (double)cal->qcal[h * NCAL * D + i] * cal->qcal[h * NCAL * D + i];
        kvd_svd_gram_accumulate(gk, D, cal->k + h * T * D, KVD_DTYPE_F32, T, 4 * D, 1.0, NULL);
        kvd_svd_gram_accumulate(gk, D, cal->qcal + h * NCAL * D, KVD_DTYPE_F32, NCAL, 4 * D, ek / eq, NULL);
        kvd_svd_gram_accumulate(gv, D, cal->v + h * T * D, KVD_DTYPE_F32, T, 4 * D, 1.0, NULL);
        if (kvd_svd_rotation(gk, D, s.Rk + h * D * D, s.svk[h], NULL) ||
            kvd_svd_rotation(gv, D, s.Rv + h * D * D, s.svv[h], NULL))
            exit(1);
        free(gk), free(gv);
    }
    return s;
}

/* SVD attention at a removal rate; returns the error, *width the mean kept
 * K/V width */
static double run_svd(const data *d, const float *ref, const svdcal *s, double rate, double *width)
{
    int64_t T = d->T;
    int32_t kw[HKV], vw[HKV];
    int64_t tk = 0, tv = 0;
    for (int h = 0; h < HKV; h++) {
        kw[h] = kvd_svd_kept_width(s->svk[h], D, rate, 1);
        vw[h] = kvd_svd_kept_width(s->svv[h], D, rate, 1);
        tk += kw[h];
        tv += vw[h];
    }
    float *kr = malloc(sizeof(float) * T * tk), *vr = malloc(sizeof(float) * T * tv);
    for (int h = 0, ko = 0, vo = 0; h < HKV; ko += kw[h] * (int)T, vo += vw[h] * (int)T, h++) {
        kvd_svd_project(be, s->Rk + h * D * D, D, kw[h], d->k + h * T * D, KVD_DTYPE_F32, T, 4 * D, kr + ko, NULL);
        kvd_svd_project(be, s->Rv + h * D * D, D, vw[h], d->v + h * T * D, KVD_DTYPE_F32, T, 4 * D, vr + vo, NULL);
    }
    float o[HQ * D], l[HQ];
    kvd_attn_svd_args a;
    memset(&a, 0, sizeof a);
    a.dims = dims(D);
    a.q = tn(KVD_DTYPE_F32, d->q, 2, HQ, D, 0);
    a.rk = tn(KVD_DTYPE_F32, s->Rk, 3, HKV, D, D);
    a.rv = tn(KVD_DTYPE_F32, s->Rv, 3, HKV, D, D);
    a.k_width = kw;
    a.v_width = vw;
    a.n_tokens = T;
    a.dtype = KVD_DTYPE_F32;
    a.k_red = kr;
    a.v_red = vr;
    a.out = tn(KVD_DTYPE_F32, o, 2, HQ, D, 0);
    a.lse = tn(KVD_DTYPE_F32, l, 1, HQ, 0, 0);
    kvd_error err;
    if (kvd_attn_svd(be, 1, &a, &err)) {
        fprintf(stderr, "svd attention: %s\n", err.msg);
        exit(1);
    }
    free(kr), free(vr);
    *width = (double)(tk + tv) / (2.0 * HKV);
    return rel_err(ref, o, HQ * D);
}

/* SVD to a common width r (multiple of 32) then INT2 P=32 on the reduced
 * vectors; q projected per kv head, output rotated back per kv head. */
static double run_svd_int2(const data *d, const float *ref, const svdcal *s, double rate, int *rout)
{
    int64_t T = d->T;
    int r = 0;
    for (int h = 0; h < HKV; h++) {
        int a = kvd_svd_kept_width(s->svk[h], D, rate, 32), b = kvd_svd_kept_width(s->svv[h], D, rate, 32);
        r = a > r ? a : r;
        r = b > r ? b : r;
    }
    *rout = r;
    float *kr = malloc(sizeof(float) * HKV * T * r), *vr = malloc(sizeof(float) * HKV * T * r);
    float qr[HQ * D], orr[HQ * D], o[HQ * D], l[HQ];
    for (int h = 0; h < HKV; h++) {
        kvd_svd_project(be, s->Rk + h * D * D, D, r, d->k + h * T * D, KVD_DTYPE_F32, T, 4 * D, kr + h * T * r, NULL);
        kvd_svd_project(be, s->Rv + h * D * D, D, r, d->v + h * T * D, KVD_DTYPE_F32, T, 4 * D, vr + h * T * r, NULL);
        kvd_svd_project(be, s->Rk + h * D * D, D, r, d->q + h * G * D, KVD_DTYPE_F32, G, 4 * D, qr + h * G * r, NULL);
    }
    qarr kq = quant_all(kr, T, r, 2, 32, KVD_ATTN_AXIS_TOKEN, T * r);
    qarr vq = quant_all(vr, T, r, 2, 32, KVD_ATTN_AXIS_CHANNEL, T * r);
    kvd_attn_int_args a;
    memset(&a, 0, sizeof a);
    a.dims = dims(r);
    a.q = tn(KVD_DTYPE_F32, qr, 2, HQ, r, 0);
    a.n_tokens = T;
    a.k = kq.qd;
    a.v = vq.qd;
    a.out = tn(KVD_DTYPE_F32, orr, 2, HQ, r, 0);
    a.lse = tn(KVD_DTYPE_F32, l, 1, HQ, 0, 0);
    kvd_error err;
    if (kvd_attn_quant(be, 1, &a, &err)) {
        fprintf(stderr, "svd+int2: %s\n", err.msg);
        exit(1);
    }
    for (int h = 0; h < HKV; h++)
        kvd_svd_unproject(be, s->Rv + h * D * D, D, r, orr + h * G * r, G, o + h * G * D, NULL);
    free(kr), free(vr), free(kq.mem), free(vq.mem);
    return rel_err(ref, o, HQ * D);
}

/* ---- PQ recall ---- */

static int cmp_desc_idx(const void *a, const void *b);
static const double *g_sc;

static int cmp_desc_idx(const void *a, const void *b)
{
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return g_sc[x] < g_sc[y] ? 1 : g_sc[x] > g_sc[y] ? -1 : (x > y) - (x < y);
}

/* recall of PQ top-k vs exact top-k of the group score sum_g q_g.k, and the
 * share of the exact softmax mass (mean over query heads) the PQ set covers */
static void run_pq(const data *d, int m, int b, int64_t k, double *recall, double *mass)
{
    int64_t T = d->T;
    double rsum = 0, msum = 0;
    float *cent = malloc(sizeof(float) * m * (1 << b) * (D / m));
    uint8_t *codes = malloc((size_t)T * m);
    uint32_t *idx = malloc(sizeof(uint32_t) * T);
    double *sc = malloc(sizeof(double) * T);
    int64_t *ord = malloc(sizeof(int64_t) * T);
    char *in = malloc((size_t)T);
    kvd_error err;
    for (int h = 0; h < HKV; h++) {
        kvd_tensor keys = tn(KVD_DTYPE_F32, d->k + h * T * D, 2, T, D, 0);
        kvd_tensor ct = tn(KVD_DTYPE_F32, cent, 3, m, 1 << b, D / m);
        kvd_tensor cd = tn(KVD_DTYPE_U8, codes, 2, T, m, 0);
        kvd_kmeans_params km = {1 << b, 12, 7, 256 << b};
        kvd_tensor qs = tn(KVD_DTYPE_F32, d->q + h * G * D, 2, G, D, 0);
        kvd_tensor it = tn(KVD_DTYPE_U32, idx, 1, T, 0, 0);
        kvd_pq_search_params sp = {k, 0, 0, KVD_PQ_AGG_SUM};
        int64_t nout = 0;
        if (kvd_pq_train(be, &keys, &km, &ct, &err) || kvd_pq_encode(be, &keys, &ct, &cd, &err) ||
            kvd_pq_search(be, &ct, &cd, &qs, &sp, &it, NULL, &nout, &err)) {
            fprintf(stderr, "pq: %s\n", err.msg);
            exit(1);
        }
        for (int64_t t = 0; t < T; t++) {
            double s = 0;
            for (int g = 0; g < G; g++)
                for (int j = 0; j < D; j++)
                    s += (double)d->q[(h * G + g) * D + j] * d->k[(h * T + t) * D + j];
            sc[t] = s;
            ord[t] = t;
        }
        g_sc = sc;
        qsort(ord, (size_t)T, sizeof *ord, cmp_desc_idx);
        memset(in, 0, (size_t)T);
        for (int64_t i = 0; i < k; i++)
            in[ord[i]] = 1;
        int64_t hit = 0;
        for (int64_t i = 0; i < nout; i++)
            hit += in[idx[i]];
        rsum += (double)hit / (double)k;
        /* mass covered, per query head */
        memset(in, 0, (size_t)T);
        for (int64_t i = 0; i < nout; i++)
            in[idx[i]] = 1;
        for (int g = 0; g < G; g++) {
            double mx = -INFINITY, tot = 0, cov = 0;
            for (int64_t t = 0; t < T; t++) {
                double s = 0;
                for (int j = 0; j < D; j++)
                    s += (double)d->q[(h * G + g) * D + j] * d->k[(h * T + t) * D + j];
                sc[t] = s / sqrt((double)D);
                mx = sc[t] > mx ? sc[t] : mx;
            }
            for (int64_t t = 0; t < T; t++) {
                double e = exp(sc[t] - mx);
                tot += e;
                if (in[t])
                    cov += e;
            }
            msum += cov / tot;
        }
    }
    *recall = rsum / HKV;
    *mass = msum / HQ;
    free(cent), free(codes), free(idx), free(sc), free(ord), free(in);
}

/* KVD_ACC_DUMP=DIR: the Calibrate sample of the codec-advice table
 * (tests/bench/run_advise_accuracy.sh), one layer, f16, as the CLI's
 * calibrate reads it: the 4096-token calibration draw the tables above
 * calibrate on, then a 1024-token evaluation draw (Calibrate holds out the
 * last 1024 tokens). DIR/kv.bin: K then V, [token][kv head][D]; DIR/q.bin:
 * [token][q head][D], the calibration queries on the first part, the
 * evaluation draw's decode queries on every token of the second. */
static int dump(const char *dir)
{
    data cal = make_data(4096, 99), ev = make_data(1024, 1000);
    const data *part[2] = {&cal, &ev};
    char path[1024];
    snprintf(path, sizeof path, "%s/kv.bin", dir);
    FILE *f = fopen(path, "wb");
    snprintf(path, sizeof path, "%s/q.bin", dir);
    FILE *fq = fopen(path, "wb");
    if (!f || !fq) {
        perror(path);
        return 1;
    }
    for (int side = 0; side < 2; side++)
        for (int p = 0; p < 2; p++)
            for (int64_t t = 0; t < part[p]->T; t++)
                for (int h = 0; h < HKV; h++)
                    for (int j = 0; j < D; j++) {
                        const float *x = side ? part[p]->v : part[p]->k;
                        uint16_t b = kvd_f32_to_f16(x[((size_t)h * part[p]->T + t) * D + j]);
                        fwrite(&b, 2, 1, f);
                    }
    for (int p = 0; p < 2; p++)
        for (int64_t t = 0; t < part[p]->T; t++)
            for (int hq = 0; hq < HQ; hq++)
                for (int j = 0; j < D; j++) {
                    float x = p ? ev.q[(size_t)hq * D + j]
                                : cal.qcal[((size_t)(hq / G) * NCAL + t % NCAL) * D + j];
                    uint16_t b = kvd_f32_to_f16(x);
                    fwrite(&b, 2, 1, fq);
                }
    int bad = fclose(f) != 0;
    bad |= fclose(fq) != 0;
    free_data(&cal);
    free_data(&ev);
    return bad;
}

int main(int argc, char **argv)
{
    if (getenv("KVD_ACC_DUMP"))
        return dump(getenv("KVD_ACC_DUMP"));
    int64_t maxT = argc > 1 ? atoll(argv[1]) : 32768;
    be = tu_cpu_backend(0, 0);
    if (getenv("KVD_ACC_TEMP"))
        qtemp = (float)atof(getenv("KVD_ACC_TEMP"));
    if (getenv("KVD_ACC_NEEDLE"))
        NEEDLE = (float)atof(getenv("KVD_ACC_NEEDLE"));
    if (getenv("KVD_ACC_SINK"))
        SINK = (float)atof(getenv("KVD_ACC_SINK"));
    if (getenv("KVD_ACC_QU"))
        QU = (float)atof(getenv("KVD_ACC_QU"));
    if (getenv("KVD_ACC_STATS")) {
        data d = make_data(maxT, 1000);
        double top1, n90;
        attn_stats(&d, &top1, &n90);
        printf("T %lld temp %.3f: top-1 %.3f, 90%% mass in %.0f tokens\n", (long long)maxT, qtemp, top1, n90);
        return 0;
    }
    /* calibration set: a separate draw (same generator, other seed) */
    data cal = make_data(4096, 99);
    svdcal sv = svd_calibrate(&cal);
    vqcal vq48t = vq_calibrate(&cal, 4, 8, 1), vq48 = vq_calibrate(&cal, 4, 8, 0);
    vqcal vq812t = {0}, vq812 = {0};
    if (!getenv("KVD_ACC_INT_ONLY")) { /* the 4096-entry codebooks take most of the run */
        vq812t = vq_calibrate(&cal, 8, 12, 1);
        vq812 = vq_calibrate(&cal, 8, 12, 0);
    }
    const int64_t Ts[2] = {4096, 32768};
    for (int ti = 0; ti < 2 && Ts[ti] <= maxT; ti++) {
        data d = make_data(Ts[ti], 1000 + ti);
        float ref[HQ * D], lse[HQ];
        exact(&d, ref, lse);
        {
            double vv = 0, rr = 0;
            for (size_t i = 0; i < (size_t)HKV * d.T * D; i++)
                vv += (double)d.v[i] * d.v[i];
            for (int i = 0; i < HQ * D; i++)
                rr += (double)ref[i] * ref[i];
            v_rms = sqrt(vv / ((double)HKV * d.T));
            ref_norm = sqrt(rr);
        }
        double top1, n90;
        attn_stats(&d, &top1, &n90);
        printf("\n### T = %lld tokens (head_dim %d, %d kv heads x %d query heads)\n\n", (long long)d.T, D, HKV, G);
        printf("Exact attention: mean top-1 weight %.3f, mean tokens holding 90%% of the mass %.0f (%.2f%% of T), "
               "mass on the 4 sink tokens %.3f.\n\n",
               top1, n90, 100.0 * n90 / (double)d.T, sink_mass);
        printf("|out| / (sqrt(Hq) rms(v)) = %.3f: the exact output is that short next to a value row.\n\n",
               ref_norm / (sqrt((double)HQ) * v_rms));
        printf("| form | bits/value (K, V) | rel. L2 error of output | error / rms(v) |\n|---|---|---|---|\n");
        enum { KT = KVD_ATTN_AXIS_TOKEN, KC = KVD_ATTN_AXIS_CHANNEL };
        struct {
            const char *name;
            int bits, P, vaxis, sinks, kaxis, deq;
        } ints[] = {
            {"INT2 P=32 (K per token, V per channel)", 2, 32, KVD_ATTN_AXIS_CHANNEL, 0, KT, 0},
            {"INT2 P=64", 2, 64, KVD_ATTN_AXIS_CHANNEL, 0, KT, 0},
            {"INT2 P=128", 2, 128, KVD_ATTN_AXIS_CHANNEL, 0, KT, 0},
            {"INT2 P=32, V per token (KIVI)", 2, 32, KVD_ATTN_AXIS_TOKEN, 0, KT, 0},
            {"INT2 P=32 + first 64 tokens raw", 2, 32, KVD_ATTN_AXIS_CHANNEL, 64, KT, 0},
            {"INT4 P=32", 4, 32, KVD_ATTN_AXIS_CHANNEL, 0, KT, 0},
            {"INT4 P=128", 4, 128, KVD_ATTN_AXIS_CHANNEL, 0, KT, 0},
            {"INT2 P=32, same codes dequantized + float attention", 2, 32, KVD_ATTN_AXIS_CHANNEL, 0, KT, 1},
            {"INT2 P=32, only K quantized (V exact, float attention)", 2, 32, KVD_ATTN_AXIS_CHANNEL, 0, KT, 2},
            {"INT2 P=32, only V quantized (K exact, float attention)", 2, 32, KVD_ATTN_AXIS_CHANNEL, 0, KT, 3},
            {"INT2 P=32, keys smooth+Hadamard first", 2, 32, KVD_ATTN_AXIS_CHANNEL, -2, KT, 0},
            {"INT2 P=128, keys smooth+Hadamard first", 2, 128, KVD_ATTN_AXIS_CHANNEL, -2, KT, 0},
            {"INT4 P=128, keys smooth+Hadamard first", 4, 128, KVD_ATTN_AXIS_CHANNEL, -2, KT, 0},
            {"INT2 P=32, K per channel (KIVI-style), V per channel", 2, 32, KVD_ATTN_AXIS_CHANNEL, 0, KC, 0},
            {"INT2 P=64, K per channel, V per channel", 2, 64, KVD_ATTN_AXIS_CHANNEL, 0, KC, 0},
            {"INT2 P=128, K per channel, V per channel", 2, 128, KVD_ATTN_AXIS_CHANNEL, 0, KC, 0},
            {"INT2 P=32, K per channel, V per token (KIVI)", 2, 32, KVD_ATTN_AXIS_TOKEN, 0, KC, 0},
            {"INT2 P=32, K per channel + first 64 tokens raw", 2, 32, KVD_ATTN_AXIS_CHANNEL, 64, KC, 0},
            {"INT2 P=32, K per channel, only K quantized (V exact)", 2, 32, KVD_ATTN_AXIS_CHANNEL, 0, KC, 2},
            {"INT2 P=32, K per channel after smooth+Hadamard", 2, 32, KVD_ATTN_AXIS_CHANNEL, -2, KC, 0},
            {"INT4 P=32, K per channel", 4, 32, KVD_ATTN_AXIS_CHANNEL, 0, KC, 0},
            {"INT4 P=128, K per channel", 4, 128, KVD_ATTN_AXIS_CHANNEL, 0, KC, 0},
        };
        for (size_t i = 0; i < sizeof ints / sizeof *ints; i++) {
            int_deq = ints[i].deq;
            int_kaxis = ints[i].kaxis;
            int_lam = ints[i].sinks == -2 ? vq48t.lam : NULL;
            double e = run_int(&d, ref, ints[i].bits, ints[i].P, ints[i].vaxis, ints[i].sinks > 0 ? ints[i].sinks : 0);
            int_deq = 0;
            int_kaxis = KT;
            int_lam = NULL;
            double bpv = ints[i].bits + 48.0 / ints[i].P; /* + f16 min, f16 scale, u16 sum per group */
            row(ints[i].name, bpv, e);
        }
        if (getenv("KVD_ACC_INT_ONLY")) {
            free_data(&d);
            continue;
        }
        row("VQ d4b8, smooth+Hadamard keys", 2.0, run_vq(&d, ref, &vq48t, 4, 8, 1));
        row("VQ d4b8, plain keys", 2.0, run_vq(&d, ref, &vq48, 4, 8, 0));
        row("VQ d8b12, smooth+Hadamard keys", 1.5, run_vq(&d, ref, &vq812t, 8, 12, 1));
        row("VQ d8b12, plain keys", 1.5, run_vq(&d, ref, &vq812, 8, 12, 0));
        const double rates[] = {0.01, 0.05, 0.1, 0.2, 0.3};
        for (int i = 0; i < 5; i++) {
            double w;
            double e = run_svd(&d, ref, &sv, rates[i], &w);
            char nm[128];
            snprintf(nm, sizeof nm, "SVD removal rate %.2f (mean kept width %.1f of %d), fp32", rates[i], w, D);
            row(nm, 32.0 * w / D, e);
        }
        const double srates[] = {0.01, 0.1, 0.2};
        for (int i = 0; i < 3; i++) {
            int r;
            double e = run_svd_int2(&d, ref, &sv, srates[i], &r);
            char nm[128];
            snprintf(nm, sizeof nm, "SVD rate %.2f (width %d) + INT2 P=32", srates[i], r);
            row(nm, (2.0 + 48.0 / 32) * r / D, e);
        }
        printf("\nPQ top-k recall against the exact top-k of the group score sum_g q_g.k (and share of the exact softmax mass the PQ selection covers, mean over query heads):\n\n");
        printf("| m x b | k = n/10: recall | mass | k = n/5: recall | mass |\n|---|---|---|---|---|\n");
        const int mb[3][2] = {{2, 6}, {4, 8}, {8, 4}};
        for (int i = 0; i < 3; i++) {
            double r1, m1, r2, m2;
            run_pq(&d, mb[i][0], mb[i][1], d.T / 10, &r1, &m1);
            run_pq(&d, mb[i][0], mb[i][1], d.T / 5, &r2, &m2);
            printf("| %d x %d | %.3f | %.3f | %.3f | %.3f |\n", mb[i][0], mb[i][1], r1, m1, r2, m2);
        }
        fflush(stdout);
        free_data(&d);
    }
    free_data(&cal);
    kvd_backend_free(be);
    return 0;
}
