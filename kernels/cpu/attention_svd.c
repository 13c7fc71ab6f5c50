/*
 * Reduced-dimension attention (ZACK), see kvdepot/attention.h: the query is
 * rotated into the key space of its kv head and truncated to rk_h dims, the
 * scores are taken there without decompressing K, the output is summed in
 * the rv_h-dim value space and rotated back once per query head.
 */
#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "common/cpu_internal.h"
#include "kvdepot/attention.h"
#include "kvdepot/svd.h"

static int64_t width_offset(const int32_t *w, int h)
{
    int64_t o = 0;
    for (int i = 0; i < h; i++)
        o += w[i];
    return o;
}

/* The reduced rows of a segmented call in one ragged block per side, as a
 * call without segments; *kb / *vb are to be freed. */
static int svd_flatten(const kvd_attn_svd_args *a, kvd_attn_svd_args *f, void **kb, void **vb)
{
    const int H = a->dims.n_kv_heads;
    const int64_t T = a->n_tokens, es = (int64_t)kvd_dtype_size(a->dtype);
    const int64_t wk = width_offset(a->k_width, H), wv = width_offset(a->v_width, H);
    char *k = malloc((size_t)(T * wk * es) + 1), *v = malloc((size_t)(T * wv * es) + 1);
    if (!k || !v) {
        free(k), free(v);
        return KVD_ENOMEM;
    }
    for (int h = 0; h < H; h++) {
        const int64_t rk = a->k_width[h], rv = a->v_width[h];
        char *kd = k + T * width_offset(a->k_width, h) * es;
        char *vd = v + T * width_offset(a->v_width, h) * es;
        for (int i = 0; i < a->n_segments; i++) {
            const kvd_attn_svd_segment *g = &a->segments[i];
            const int64_t n = g->n_tokens;
            memcpy(kd, (const char *)g->k_red + n * width_offset(a->k_width, h) * es,
                   (size_t)(n * rk * es));
            memcpy(vd, (const char *)g->v_red + n * width_offset(a->v_width, h) * es,
                   (size_t)(n * rv * es));
            kd += n * rk * es;
            vd += n * rv * es;
        }
    }
    *f = *a;
    f->k_red = k;
    f->v_red = v;
    f->n_segments = 0;
    f->segments = NULL;
    *kb = k;
    *vb = v;
    return 0;
}

int kvd_cpu_attn_svd_ref(const kvd_attn_svd_args *a)
{
    if (a->n_segments) { /* the specification: the segments' rows in one block */
        kvd_attn_svd_args f;
        void *kb, *vb;
        int rc = svd_flatten(a, &f, &kb, &vb);
        if (rc)
            return rc;
        rc = kvd_cpu_attn_svd_ref(&f);
        free(kb), free(vb);
        return rc;
    }
    const kvd_attn_dims *d = &a->dims;
    int G = d->n_q_heads / d->n_kv_heads, D = d->head_dim, Dv = d->v_dim;
    int64_t T = a->n_tokens;
    size_t es = kvd_dtype_size(a->dtype);
    double *s = malloc(sizeof(double) * (size_t)(T + 1));
    float *vals = malloc(sizeof(float) * (size_t)(T * Dv + 1));
    float *qr = malloc(sizeof(float) * (size_t)(D + Dv + 1)), *ored = qr + D;
    if (!s || !vals || !qr) {
        free(s), free(vals), free(qr);
        return KVD_ENOMEM;
    }
    for (int h = 0; h < d->n_kv_heads; h++) {
        int rk = a->k_width[h], rv = a->v_width[h];
        const float *Rk = (const float *)a->rk.data + (size_t)h * D * D;
        const float *Rv = (const float *)a->rv.data + (size_t)h * Dv * Dv;
        const char *kb = (const char *)a->k_red + (size_t)(T * width_offset(a->k_width, h)) * es;
        const char *vb = (const char *)a->v_red + (size_t)(T * width_offset(a->v_width, h)) * es;
        for (int64_t t = 0; t < T; t++)
            for (int j = 0; j < rv; j++)
                vals[t * rv + j] = kvd__load_float(vb + (size_t)(t * rv + j) * es, a->dtype);
        for (int g = 0; g < G; g++) {
            int hq = h * G + g;
            const float *q = (const float *)((const char *)a->q.data + hq * a->q.stride[0]);
            float *out = (float *)((char *)a->out.data + hq * a->out.stride[0]);
            float *lse = (float *)((char *)a->lse.data + hq * a->lse.stride[0]);
            /* q' = q R_k[:, :rk] */
            for (int j = 0; j < rk; j++) {
                double acc = 0.0;
                for (int i = 0; i < D; i++)
                    acc += (double)q[i] * Rk[(size_t)i * D + j];
                qr[j] = (float)acc;
            }
            for (int64_t t = 0; t < T; t++) {
                double dot = 0.0;
                for (int j = 0; j < rk; j++)
                    dot += (double)qr[j] * kvd__load_float(kb + (size_t)(t * rk + j) * es, a->dtype);
                s[t] = dot * d->softmax_scale;
            }
            kvd__attn_ref_finish(s, T, vals, rv, ored, lse);
            /* out = o' R_v[:, :rv]^T */
            for (int i = 0; i < Dv; i++) {
                double acc = 0.0;
                for (int j = 0; j < rv; j++)
                    acc += (double)ored[j] * Rv[(size_t)i * Dv + j];
                out[i] = (float)acc;
            }
        }
    }
    free(s), free(vals), free(qr);
    return 0;
}

/* One kv head of kvd_cpu_attn_svd_fast (kvd__par_for). */
typedef struct svd_job {
    const kvd_attn_svd_args *a;
    int G, D, Dv, simd;
    int64_t T, es;
    atomic_int rc;
} svd_job;

static void svd_head(void *arg, int h)
{
    svd_job *job = arg;
    const kvd_attn_svd_args *a = job->a;
    const kvd_attn_dims *d = &a->dims;
    const int G = job->G, D = job->D, Dv = job->Dv, simd = job->simd;
    const int64_t T = job->T, es = job->es;
    int rk = a->k_width[h], rv = a->v_width[h];
    const float *Rk = (const float *)a->rk.data + (size_t)h * D * D;
    const float *Rv = (const float *)a->rv.data + (size_t)h * Dv * Dv;
    float *buf = malloc(sizeof(float) * ((size_t)G * (rk + rv + 1) + 16));
    if (!buf) {
        atomic_store(&job->rc, KVD_ENOMEM);
        return;
    }
    float *qp = buf, *ored = buf + (size_t)G * rk + 8;
    for (int g = 0; g < G; g++) {
        const float *q =
            (const float *)((const char *)a->q.data + (int64_t)(h * G + g) * a->q.stride[0]);
        kvd_cpu_svd_project_fast(Rk, D, rk, q, KVD_DTYPE_F32, 1, D * 4, qp + (size_t)g * rk, 1);
        for (int j = 0; j < rk; j++)
            qp[(size_t)g * rk + j] *= d->softmax_scale;
    }
    /* views of this head's ragged blocks as (1, T_i, r) tensors, one dense
     * source per segment (or the one block) */
    const int nseg = a->n_segments ? a->n_segments : 1;
    typedef struct {
        _Alignas(8) char ctx[KVD__ATTN_DENSE_CTX_BYTES];
        kvd_tensor k, v;
    } seg_src;
    seg_src one, *ss = nseg > 1 ? malloc((size_t)nseg * sizeof *ss) : &one;
    kvd__attn_src src1, *src = nseg > 1 ? malloc((size_t)nseg * sizeof *src) : &src1;
    if (!ss || !src) {
        atomic_store(&job->rc, KVD_ENOMEM);
        if (nseg > 1)
            free(ss), free(src);
        free(buf);
        return;
    }
    const int64_t wk = width_offset(a->k_width, h), wv = width_offset(a->v_width, h);
    int nsrc = 0;
    for (int i = 0; i < nseg; i++) {
        const kvd_attn_svd_segment *sg = a->n_segments ? &a->segments[i] : NULL;
        const int64_t n = sg ? sg->n_tokens : T;
        const char *k = sg ? sg->k_red : a->k_red, *v = sg ? sg->v_red : a->v_red;
        if (n == 0 && nseg > 1)
            continue;
        int64_t ks[3] = {1, n, rk}, vs[3] = {1, n, rv};
        ss[nsrc].k = kvd_tensor_make(a->dtype, (char *)k + n * wk * es, 3, ks);
        ss[nsrc].v = kvd_tensor_make(a->dtype, (char *)v + n * wv * es, 3, vs);
        kvd__attn_dense_src(&src[nsrc], ss[nsrc].ctx, &ss[nsrc].k, &ss[nsrc].v, NULL, n, qp, G, rk,
                            rv, 0, simd);
        nsrc++;
    }
    float *o[KVD__ATTN_MAXG], *l[KVD__ATTN_MAXG], *ofull[KVD__ATTN_MAXG];
    kvd__attn_out_ptrs(d, &a->out, &a->lse, h, ofull, l);
    for (int g = 0; g < G; g++)
        o[g] = ored + (size_t)g * rv;
    int r = kvd__attn_head_run(src, nsrc, G, rv, o, l, simd);
    if (r) {
        atomic_store(&job->rc, r);
    }
    if (nseg > 1)
        free(ss), free(src);
    for (int g = 0; g < G; g++)
        for (int i = 0; i < Dv; i++) {
            float acc = 0.0f;
            const float *Ri = Rv + (size_t)i * Dv;
            for (int j = 0; j < rv; j++)
                acc += o[g][j] * Ri[j];
            ofull[g][i] = acc;
        }
    free(buf);
}

/* More query heads per kv head than one pass takes: each kv head's query
 * heads, KVD__ATTN_MAXG at a time, as calls of their own (one kv head each:
 * its rotations, widths and ragged blocks). */
static int svd_part(const void *arg, int i)
{
    const kvd_attn_svd_args *a = arg;
    const int64_t Hkv = a->dims.n_kv_heads, T = a->n_tokens;
    const int64_t es = (int64_t)kvd_dtype_size(a->dtype);
    kvd_attn_svd_args s = *a;
    const int64_t h = kvd__attn_part(i, KVD__ATTN_MAXG, &s.dims, &s.q, &s.out, &s.lse);
    s.rk = kvd__attn_rows(a->rk, Hkv, h, 1);
    s.rv = kvd__attn_rows(a->rv, Hkv, h, 1);
    s.k_width = a->k_width + h;
    s.v_width = a->v_width + h;
    s.k_red = (const char *)a->k_red + T * width_offset(a->k_width, (int)h) * es;
    s.v_red = (const char *)a->v_red + T * width_offset(a->v_width, (int)h) * es;
    kvd_attn_svd_segment *segs = NULL;
    if (a->n_segments) {
        if (!(segs = malloc((size_t)a->n_segments * sizeof *segs)))
            return KVD_ENOMEM;
        for (int k = 0; k < a->n_segments; k++) {
            const kvd_attn_svd_segment *g = &a->segments[k];
            segs[k].n_tokens = g->n_tokens;
            segs[k].k_red =
                (const char *)g->k_red + g->n_tokens * width_offset(a->k_width, (int)h) * es;
            segs[k].v_red =
                (const char *)g->v_red + g->n_tokens * width_offset(a->v_width, (int)h) * es;
        }
        s.segments = segs;
    }
    int rc = kvd_cpu_attn_svd_fast(&s, 1);
    free(segs);
    return rc;
}

int kvd_cpu_attn_svd_fast(const kvd_attn_svd_args *a, int nthreads)
{
    const kvd_attn_dims *d = &a->dims;
    int G = d->n_q_heads / d->n_kv_heads, D = d->head_dim, Dv = d->v_dim;
    if (G > KVD__ATTN_MAXG)
        return kvd__attn_split(d, KVD__ATTN_MAXG, nthreads, svd_part, a);
    int64_t T = a->n_tokens;
    int64_t es = (int64_t)kvd_dtype_size(a->dtype);
    int simd = kvd__attn_simd(), rc = 0;
    svd_job j = {.a = a, .G = G, .D = D, .Dv = Dv, .simd = simd, .T = T, .es = es};
    atomic_init(&j.rc, 0);
    kvd__par_for(d->n_kv_heads, nthreads, svd_head, &j);
    rc = atomic_load(&j.rc);
    return rc;
}
