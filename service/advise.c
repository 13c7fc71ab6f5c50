/* Codec advice for Calibrate (advise.h). */
#include "advise.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kvdepot/quant.h"
#include "kvdepot/svd.h"
#include "kvdepot/vq.h"

#define ADV_SVD_RATE 0.01
#define ADV_SVD_ALIGN 8
#define ADV_MAX_CANDS 16
/* Pairs measured with both sides coded before settling on raw/raw. */
#define ADV_TRIES 16

enum { C_RAW, C_INT, C_VQ, C_SVD };

typedef struct cand {
    int kind, bits, group;
    kvd_quant_axis axis;
    Kvdepot__V1__CodecSpec spec;
    Kvdepot__V1__QuantSpec quant;
    Kvdepot__V1__VQSpec vq;
    Kvdepot__V1__SVDSpec svd;
} cand;

typedef struct adv_mem {
    cand c[2][ADV_MAX_CANDS];
    size_t nc[2];
    Kvdepot__V1__CodecLayerAdvice *la, **lap;
    Kvdepot__V1__CodecEvaluation *ev, **evp;
    double *err[2], *bits[2]; /* [layer][candidate] */
} adv_mem;

/* The held-out data of one layer, per head, and exact attention over it. */
typedef struct ev {
    const kvd_advise_params *p;
    const kvd_advise_layer *L;
    uint32_t H, Hq, D, G, Q;
    uint64_t n;
    float *k, *v, *q; /* [h][t][D], [h][t][D], [j][qi][D] */
    float *o0, *p0;   /* exact outputs [j][qi][D] and probabilities [j][qi][t] */
    float *hat[2];    /* reconstructions of K and V [h][t][D] */
    float *pk;        /* probabilities from a reconstructed K */
    float *t1, *t2;   /* (n, D) scratch */
    double den;
} ev;

static void cand_spec(cand *c)
{
    kvdepot__v1__codec_spec__init(&c->spec);
    switch (c->kind) {
    case C_INT:
        c->spec.codec =
            c->bits == 2 ? KVDEPOT__V1__CODEC__CODEC_INT2 : KVDEPOT__V1__CODEC__CODEC_INT4;
        kvdepot__v1__quant_spec__init(&c->quant);
        c->quant.group_size = (uint32_t)c->group;
        c->quant.axis = c->axis == KVD_QAXIS_TOKEN ? KVDEPOT__V1__QUANT_AXIS__QUANT_AXIS_TOKEN
                                                   : KVDEPOT__V1__QUANT_AXIS__QUANT_AXIS_CHANNEL;
        c->spec.quant = &c->quant;
        break;
    case C_VQ:
        c->spec.codec = KVDEPOT__V1__CODEC__CODEC_VQ;
        kvdepot__v1__vqspec__init(&c->vq);
        c->spec.vq = &c->vq;
        break;
    case C_SVD:
        kvdepot__v1__svdspec__init(&c->svd);
        c->svd.removal_rate = ADV_SVD_RATE;
        c->svd.align = ADV_SVD_ALIGN;
        c->spec.svd = &c->svd;
        break;
    default:
        break;
    }
}

/* The candidates of one side (0 = K, 1 = V), raw first. */
static size_t candidates(const kvd_advise_params *p, int side, cand *c)
{
    static const int groups[] = {128, 64, 32};
    size_t n = 0;
    c[n++] = (cand){.kind = C_RAW};
    for (int bits = 4; bits >= 2; bits -= 2)
        for (int g = 0; g < 3; g++)
            for (int a = 0; a < 2; a++) {
                kvd_quant_axis axis = a ? KVD_QAXIS_TOKEN : KVD_QAXIS_CHANNEL;
                int grp = groups[g];
                if (axis == KVD_QAXIS_TOKEN && p->head_dim % (uint32_t)grp)
                    continue;
                if (axis == KVD_QAXIS_CHANNEL &&
                    (p->page_tokens % (uint32_t)grp || (side == 0 && 256 % grp)))
                    continue;
                c[n++] = (cand){.kind = C_INT, .bits = bits, .group = grp, .axis = axis};
            }
    if (p->vq_d)
        c[n++] = (cand){.kind = C_VQ};
    if (p->svd)
        c[n++] = (cand){.kind = C_SVD};
    for (size_t i = 0; i < n; i++) {
        cand_spec(&c[i]);
        if (c[i].kind == C_VQ) {
            c[i].vq.sub_dim = p->vq_d;
            c[i].vq.bits = p->vq_b;
        }
    }
    return n;
}

static int svd_width(const ev *e, const float *sv)
{
    return kvd_svd_kept_width(sv, (int)e->D, ADV_SVD_RATE, ADV_SVD_ALIGN);
}

/* Bits per value of c as a sealed page stores it. */
static double cand_bits(const ev *e, const cand *c, int side)
{
    const kvd_advise_params *p = e->p;
    double raw = 8.0 * (double)kvd_dtype_size(p->dtype);
    if (c->kind == C_INT) {
        kvd_quant_sizes qs;
        kvd_error err;
        if (kvd_quant_size(p->page_tokens, p->head_dim, c->bits, c->group, c->axis, &qs, &err))
            return raw;
        return 8.0 * (double)qs.total_bytes / ((double)p->page_tokens * p->head_dim);
    }
    if (c->kind == C_VQ)
        return (double)p->vq_b / p->vq_d;
    if (c->kind == C_SVD) {
        const float **sv = side ? e->L->sv_v : e->L->sv_k;
        double w = 0;
        for (uint32_t h = 0; h < e->H; h++)
            w += sv && sv[h] ? (double)svd_width(e, sv[h]) : (double)e->D;
        return raw * w / ((double)e->H * e->D);
    }
    return raw;
}

/* x (n, D) as candidate c stores and decodes it, into y. */
static int recon_head(ev *e, const cand *c, int side, uint32_t h, const float *x, float *y,
                      kvd_error *err)
{
    const int64_t n = (int64_t)e->n;
    const int D = (int)e->D;
    const kvd_advise_layer *L = e->L;
    if (c->kind == C_RAW) {
        memcpy(y, x, (size_t)n * D * sizeof(float));
        return 0;
    }
    if (c->kind == C_INT) {
        kvd_quant_sizes qs;
        int rc = kvd_quant_size(n, D, c->bits, c->group, c->axis, &qs, err);
        void *buf = rc ? NULL : malloc(qs.total_bytes);
        if (rc || !buf)
            return rc ? rc : kvd_error_set(err, KVD_ENOMEM, "out of memory");
        kvd_qtensor q;
        kvd_qtensor_init(&q, n, D, c->bits, c->group, c->axis, buf, err);
        const int64_t shape[2] = {n, D};
        kvd_tensor xt = kvd_tensor_make(KVD_DTYPE_F32, (void *)x, 2, shape);
        kvd_tensor yt = kvd_tensor_make(KVD_DTYPE_F32, y, 2, shape);
        kvd_quantize_ref(&xt, &q, KVD_ROUND_NEAREST, 0);
        kvd_dequantize_ref(&q, &yt);
        free(buf);
        return 0;
    }
    if (c->kind == C_VQ) {
        const float *cb = side ? L->cb_v[h] : L->cb_k[h];
        const float *lambda = side ? NULL : L->lambda[h];
        const int d = (int)e->p->vq_d, b = (int)e->p->vq_b;
        size_t P = (size_t)n * (size_t)D / (size_t)d;
        uint8_t *c8 = b <= 8 ? malloc(P) : NULL;
        uint16_t *c16 = b > 8 ? malloc(P * 2) : NULL;
        if (!c8 && !c16)
            return kvd_error_set(err, KVD_ENOMEM, "out of memory");
        const float *src = x;
        int rc = 0;
        if (!side) { /* keys: smoothed and rotated, as the store codes them */
            rc = kvd_advise_rotate_keys(e->p->be, n, D, x, lambda, e->t1, err);
            src = e->t1;
        }
        if (rc == 0) {
            kvd__vq_encode_cpu(1, 1, n, D, d, b, src, cb, c8, c16);
            if ((rc = kvd_vq_decode_ref(n, D, d, b, c8, c16, cb, side ? y : e->t2)))
                kvd_error_set(err, rc, "VQ decode of held-out samples failed");
        }
        free(c8);
        free(c16);
        if (rc)
            return rc;
        if (!side && (rc = kvd_advise_unrotate_keys(e->p->be, n, D, e->t2, lambda, y, err)))
            return rc;
        return 0;
    }
    const float *R = side ? L->rot_v[h] : L->rot_k[h];
    int r = svd_width(e, side ? L->sv_v[h] : L->sv_k[h]);
    /* the store's CPU kernels: its bits */
    kvd_cpu_svd_project_fast(R, D, r, x, KVD_DTYPE_F32, n, (int64_t)D * 4, e->t1, 1);
    kvd_cpu_svd_unproject_fast(R, D, r, e->t1, n, y, 1);
    return 0;
}

static int recon(ev *e, const cand *c, int side, kvd_error *err)
{
    const float *src = side ? e->v : e->k;
    size_t hs = (size_t)e->n * e->D;
    for (uint32_t h = 0; h < e->H; h++) {
        int rc = recon_head(e, c, side, h, src + h * hs, e->hat[side] + h * hs, err);
        if (rc)
            return rc;
    }
    return 0;
}

/* Attention probabilities of every held-out query over keys K [h][t][D]. */
static void probs(const ev *e, const float *K, float *P)
{
    const uint64_t n = e->n;
    const uint32_t D = e->D;
    const float scale = 1.0f / sqrtf((float)D);
    for (uint32_t j = 0; j < e->Hq; j++) {
        const float *Kh = K + (size_t)(j / e->G) * n * D;
        for (uint32_t qi = 0; qi < e->Q; qi++) {
            const float *q = e->q + ((size_t)j * e->Q + qi) * D;
            float *p = P + ((size_t)j * e->Q + qi) * n, mx = -INFINITY;
            for (uint64_t t = 0; t < n; t++) {
                float s = 0;
                for (uint32_t i = 0; i < D; i++)
                    s += q[i] * Kh[t * D + i];
                p[t] = s * scale;
                mx = p[t] > mx ? p[t] : mx;
            }
            double sum = 0;
            for (uint64_t t = 0; t < n; t++)
                sum += p[t] = expf(p[t] - mx);
            for (uint64_t t = 0; t < n; t++)
                p[t] = (float)(p[t] / sum);
        }
    }
}

/* Outputs P V for values V [h][t][D]: into o0 (o0 != NULL), or their error
 * ||o - o0||^2 / ||o0||^2 against e->o0. */
static double outputs(ev *e, const float *P, const float *V, float *o0)
{
    const uint64_t n = e->n;
    const uint32_t D = e->D;
    double num = 0, den = 0;
    float *o = malloc(D * sizeof(float));
    if (!o)
        return INFINITY;
    for (uint32_t j = 0; j < e->Hq; j++) {
        const float *Vh = V + (size_t)(j / e->G) * n * D;
        for (uint32_t qi = 0; qi < e->Q; qi++) {
            const float *p = P + ((size_t)j * e->Q + qi) * n;
            memset(o, 0, D * sizeof(float));
            for (uint64_t t = 0; t < n; t++)
                for (uint32_t i = 0; i < D; i++)
                    o[i] += p[t] * Vh[t * D + i];
            float *ref = (o0 ? o0 : e->o0) + ((size_t)j * e->Q + qi) * D;
            for (uint32_t i = 0; i < D; i++) {
                if (o0)
                    ref[i] = o[i];
                double d = (double)o[i] - ref[i];
                num += d * d;
                den += (double)ref[i] * ref[i];
            }
        }
    }
    free(o);
    if (o0) {
        e->den = den;
        return 0;
    }
    return e->den > 0 ? num / e->den : 0;
}

static void ev_free(ev *e)
{
    free(e->k);
    free(e->v);
    free(e->q);
    free(e->o0);
    free(e->p0);
    free(e->hat[0]);
    free(e->hat[1]);
    free(e->pk);
    free(e->t1);
    free(e->t2);
    memset(e, 0, sizeof *e);
}

/* Gather one layer's held-out data per head and attend it exactly. */
static int ev_init(ev *e, const kvd_advise_params *p, const kvd_advise_layer *L, kvd_error *err)
{
    memset(e, 0, sizeof *e);
    e->p = p;
    e->L = L;
    e->H = p->kv_heads;
    e->Hq = p->q_heads;
    e->D = p->head_dim;
    e->G = p->q_heads / p->kv_heads;
    e->n = L->n;
    e->Q = p->queries < L->n ? p->queries : (uint32_t)L->n;
    const size_t hs = (size_t)e->n * e->D, kv = hs * e->H, pq = (size_t)e->Hq * e->Q;
    e->k = malloc(kv * sizeof(float));
    e->v = malloc(kv * sizeof(float));
    e->q = malloc(pq * e->D * sizeof(float));
    e->o0 = malloc(pq * e->D * sizeof(float));
    e->p0 = malloc(pq * e->n * sizeof(float));
    e->hat[0] = malloc(kv * sizeof(float));
    e->hat[1] = malloc(kv * sizeof(float));
    e->pk = malloc(pq * e->n * sizeof(float));
    e->t1 = malloc(hs * sizeof(float));
    e->t2 = malloc(hs * sizeof(float));
    if (!e->k || !e->v || !e->q || !e->o0 || !e->p0 || !e->hat[0] || !e->hat[1] || !e->pk ||
        !e->t1 || !e->t2) {
        ev_free(e);
        return kvd_error_set(err, KVD_ENOMEM, "out of memory for the codec evaluation");
    }
    for (uint32_t h = 0; h < e->H; h++)
        for (uint64_t t = 0; t < e->n; t++) {
            memcpy(e->k + h * hs + t * e->D, L->k + (t * e->H + h) * e->D, e->D * sizeof(float));
            memcpy(e->v + h * hs + t * e->D, L->v + (t * e->H + h) * e->D, e->D * sizeof(float));
        }
    for (uint32_t j = 0; j < e->Hq; j++)
        for (uint32_t qi = 0; qi < e->Q; qi++) {
            uint64_t t = (uint64_t)qi * e->n / e->Q;
            memcpy(e->q + ((size_t)j * e->Q + qi) * e->D, L->q + (t * e->Hq + j) * e->D,
                   e->D * sizeof(float));
        }
    probs(e, e->k, e->p0);
    outputs(e, e->p0, e->v, e->o0);
    return 0;
}

typedef struct pair {
    uint32_t k, v;
    double bits, est;
} pair;

static int by_bits(const void *a, const void *b)
{
    const pair *x = a, *y = b;
    if (x->bits != y->bits)
        return x->bits < y->bits ? -1 : 1;
    return x->est < y->est ? -1 : x->est > y->est;
}

/* Both sides coded: the measured error of (kc, vc) on the layer of e. */
static int joint(ev *e, adv_mem *m, uint32_t kc, uint32_t vc, double *out, kvd_error *err)
{
    int rc = recon(e, &m->c[0][kc], 0, err);
    if (!rc)
        rc = recon(e, &m->c[1][vc], 1, err);
    if (rc)
        return rc;
    probs(e, e->hat[0], e->pk);
    *out = outputs(e, e->pk, e->hat[1], NULL);
    return 0;
}

static void evaluation(adv_mem *m, size_t *used, int side, uint32_t c, double bits, double err,
                       Kvdepot__V1__CodecEvaluation ***list, size_t *n)
{
    Kvdepot__V1__CodecEvaluation *x = &m->ev[*used];
    kvdepot__v1__codec_evaluation__init(x);
    x->codec = &m->c[side][c].spec;
    x->bits_per_value = bits;
    x->attention_error = err;
    m->evp[*used] = x;
    if (!*list)
        *list = &m->evp[*used];
    (*used)++;
    (*n)++;
}

/* One layer: single-side errors of every candidate, the recommended pair,
 * and with p->exhaustive the best of all pairs. */
static int layer_advice(ev *e, adv_mem *m, uint32_t li, size_t *used,
                        Kvdepot__V1__CodecLayerAdvice *la, kvd_error *err)
{
    const kvd_advise_params *p = e->p;
    const size_t nk = m->nc[0], nv = m->nc[1], pq = (size_t)e->Hq * e->Q * e->n;
    double *ek = m->err[0] + li * ADV_MAX_CANDS, *evv = m->err[1] + li * ADV_MAX_CANDS;
    double *bk = m->bits[0] + li * ADV_MAX_CANDS, *bv = m->bits[1] + li * ADV_MAX_CANDS;
    float *pall = p->exhaustive ? malloc(nk * pq * sizeof(float)) : NULL;
    double *tab = p->exhaustive ? malloc(nk * nv * sizeof(double)) : NULL;
    pair *pairs = malloc(nk * nv * sizeof *pairs);
    int rc = 0;
    if (!pairs || (p->exhaustive && (!pall || !tab))) {
        rc = kvd_error_set(err, KVD_ENOMEM, "out of memory for the codec evaluation");
        goto out;
    }
    for (uint32_t c = 0; c < nk && !rc; c++) {
        bk[c] = cand_bits(e, &m->c[0][c], 0);
        if ((rc = recon(e, &m->c[0][c], 0, err)))
            break;
        float *P = pall ? pall + c * pq : e->pk;
        probs(e, e->hat[0], P);
        ek[c] = outputs(e, P, e->v, NULL);
        evaluation(m, used, 0, c, bk[c], ek[c], &la->k, &la->n_k);
    }
    for (uint32_t c = 0; c < nv && !rc; c++) {
        bv[c] = cand_bits(e, &m->c[1][c], 1);
        if ((rc = recon(e, &m->c[1][c], 1, err)))
            break;
        evv[c] = outputs(e, e->p0, e->hat[1], NULL);
        evaluation(m, used, 1, c, bv[c], evv[c], &la->v, &la->n_v);
        for (uint32_t kc = 0; tab && kc < nk; kc++)
            tab[kc * nv + c] = outputs(e, pall + kc * pq, e->hat[1], NULL);
    }
    if (rc)
        goto out;
    size_t np = 0;
    for (uint32_t kc = 0; kc < nk; kc++)
        for (uint32_t vc = 0; vc < nv; vc++)
            pairs[np++] = (pair){kc, vc, (bk[kc] + bv[vc]) / 2, ek[kc] + evv[vc]};
    qsort(pairs, np, sizeof *pairs, by_bits);
    uint32_t rk = 0, rv = 0;
    double rerr = 0;
    for (size_t i = 0, tries = 0; i < np && tries < ADV_TRIES; i++) {
        if (pairs[i].est > p->budget)
            continue;
        double je;
        if (tab)
            je = tab[pairs[i].k * nv + pairs[i].v];
        else if ((rc = joint(e, m, pairs[i].k, pairs[i].v, &je, err)))
            goto out;
        tries++;
        if (je <= p->budget) {
            rk = pairs[i].k;
            rv = pairs[i].v;
            rerr = je;
            break;
        }
    }
    la->layer = e->L->layer;
    la->k_recommended = &m->c[0][rk].spec;
    la->v_recommended = &m->c[1][rv].spec;
    la->bits_per_value = (bk[rk] + bv[rv]) / 2;
    la->attention_error = rerr;
    if (tab) {
        size_t best = SIZE_MAX;
        for (size_t i = 0; i < np; i++) {
            double je = tab[pairs[i].k * nv + pairs[i].v];
            if (je <= p->budget && (best == SIZE_MAX || pairs[i].bits < pairs[best].bits ||
                                    (pairs[i].bits == pairs[best].bits &&
                                     je < tab[pairs[best].k * nv + pairs[best].v])))
                best = i;
        }
        /* raw/raw always meets it (error 0) */
        la->k_best = &m->c[0][pairs[best].k].spec;
        la->v_best = &m->c[1][pairs[best].v].spec;
        la->best_bits_per_value = pairs[best].bits;
        la->best_attention_error = tab[pairs[best].k * nv + pairs[best].v];
    }
out:
    free(pall);
    free(tab);
    free(pairs);
    return rc;
}

void kvd_advice_free(kvd_advice *a)
{
    adv_mem *m = a->mem;
    if (m) {
        free(m->la);
        free(m->lap);
        free(m->ev);
        free(m->evp);
        for (int s = 0; s < 2; s++) {
            free(m->err[s]);
            free(m->bits[s]);
        }
        free(m);
    }
    memset(a, 0, sizeof *a);
}

int kvd_advise_rotate_keys(kvd_backend *be, int64_t n, int D, const float *k, const float *lambda,
                           float *out, kvd_error *err)
{
    int64_t rows[2] = {n, D}, ch[1] = {D};
    kvd_tensor kt = kvd_tensor_make(KVD_DTYPE_F32, (void *)k, 2, rows);
    kvd_tensor ot = kvd_tensor_make(KVD_DTYPE_F32, out, 2, rows);
    kvd_tensor lt = kvd_tensor_make(KVD_DTYPE_F32, (void *)lambda, 1, ch);
    return kvd_vq_transform_keys(be, &kt, lambda ? &lt : NULL, &ot, err);
}

int kvd_advise_unrotate_keys(kvd_backend *be, int64_t n, int D, const float *k, const float *lambda,
                             float *out, kvd_error *err)
{
    int rc = kvd_advise_rotate_keys(be, n, D, k, NULL, out, err);
    for (int64_t t = 0; rc == 0 && t < n; t++)
        for (int i = 0; i < D; i++)
            out[t * D + i] *= lambda[i];
    return rc;
}

int kvd_advise(const kvd_advise_params *p, const kvd_advise_layer *layers, uint32_t nlayers,
               kvd_advice *out, kvd_error *err)
{
    memset(out, 0, sizeof *out);
    kvdepot__v1__codec_advice__init(&out->msg);
    adv_mem *m = calloc(1, sizeof *m);
    if (!m)
        return kvd_error_set(err, KVD_ENOMEM, "out of memory");
    out->mem = m;
    m->nc[0] = candidates(p, 0, m->c[0]);
    m->nc[1] = candidates(p, 1, m->c[1]);
    size_t nl = nlayers ? nlayers : 1, nev = nl * (m->nc[0] + m->nc[1]);
    m->la = calloc(nl, sizeof *m->la);
    m->lap = calloc(nl, sizeof *m->lap);
    m->ev = calloc(nev, sizeof *m->ev);
    m->evp = calloc(nev, sizeof *m->evp);
    for (int s = 0; s < 2; s++) {
        m->err[s] = calloc(nl * ADV_MAX_CANDS, sizeof(double));
        m->bits[s] = calloc(nl * ADV_MAX_CANDS, sizeof(double));
    }
    if (!m->la || !m->lap || !m->ev || !m->evp || !m->err[0] || !m->err[1] || !m->bits[0] ||
        !m->bits[1])
        return kvd_error_set(err, KVD_ENOMEM, "out of memory");
    Kvdepot__V1__CodecAdvice *a = &out->msg;
    a->error_budget = p->budget;
    a->eval_tokens = nlayers ? (uint32_t)layers[0].n : 0;
    a->eval_queries = nlayers ? (p->queries < layers[0].n ? p->queries : (uint32_t)layers[0].n) : 0;
    a->layers = m->lap;
    size_t used = 0;
    int rc = 0;
    for (uint32_t l = 0; l < nlayers && !rc; l++) {
        ev e;
        if ((rc = ev_init(&e, p, &layers[l], err)))
            break;
        kvdepot__v1__codec_layer_advice__init(&m->la[l]);
        rc = layer_advice(&e, m, l, &used, &m->la[l], err);
        m->lap[l] = &m->la[l];
        a->n_layers = l + 1;
        ev_free(&e);
    }
    if (rc || !nlayers)
        return rc;

    /* One pair for the model: in order of bits (mean over the layers),
     * among the pairs whose single-side errors meet the budget on every
     * layer, the first whose measured error does on every layer. */
    const size_t nk = m->nc[0], nv = m->nc[1];
    pair *pairs = malloc(nk * nv * sizeof *pairs);
    double *worst = calloc(ADV_TRIES, sizeof *worst);
    if (!pairs || !worst) {
        free(pairs);
        free(worst);
        return kvd_error_set(err, KVD_ENOMEM, "out of memory");
    }
    size_t np = 0;
    for (uint32_t kc = 0; kc < nk; kc++)
        for (uint32_t vc = 0; vc < nv; vc++) {
            double bits = 0, est = 0;
            for (uint32_t l = 0; l < nlayers; l++) {
                bits +=
                    (m->bits[0][l * ADV_MAX_CANDS + kc] + m->bits[1][l * ADV_MAX_CANDS + vc]) / 2;
                double s = m->err[0][l * ADV_MAX_CANDS + kc] + m->err[1][l * ADV_MAX_CANDS + vc];
                est = s > est ? s : est;
            }
            if (est <= p->budget)
                pairs[np++] = (pair){kc, vc, bits / nlayers, est};
        }
    qsort(pairs, np, sizeof *pairs, by_bits);
    if (np > ADV_TRIES)
        np = ADV_TRIES;
    for (uint32_t l = 0; l < nlayers && !rc; l++) {
        ev e;
        if ((rc = ev_init(&e, p, &layers[l], err)))
            break;
        for (size_t i = 0; i < np && !rc; i++) {
            double je = 0;
            rc = joint(&e, m, pairs[i].k, pairs[i].v, &je, err);
            worst[i] = je > worst[i] ? je : worst[i];
        }
        ev_free(&e);
    }
    size_t pick = SIZE_MAX;
    for (size_t i = 0; !rc && i < np && pick == SIZE_MAX; i++)
        if (worst[i] <= p->budget)
            pick = i;
    if (!rc) {
        uint32_t kc = pick == SIZE_MAX ? 0 : pairs[pick].k,
                 vc = pick == SIZE_MAX ? 0 : pairs[pick].v;
        double bits = 0;
        for (uint32_t l = 0; l < nlayers; l++)
            bits += (m->bits[0][l * ADV_MAX_CANDS + kc] + m->bits[1][l * ADV_MAX_CANDS + vc]) / 2;
        a->k = &m->c[0][kc].spec;
        a->v = &m->c[1][vc].spec;
        a->bits_per_value = bits / nlayers;
        a->max_attention_error = pick == SIZE_MAX ? 0 : worst[pick];
    }
    free(pairs);
    free(worst);
    return rc;
}
