/*
 * Attend: decode attention over a stored token range of one layer
 * (compute.h).
 *
 * Whole sealed pages are pinned in their memory tier and attended in their
 * stored form (kvd_page_attend); the partial blocks at both ends and the raw
 * tail are read through the store's cursor in windows of ATTEND_WINDOW
 * tokens, run through the dense kernel straight from the cursor's wire layout
 * (no transpose: the kernel takes any stride on the two outer dimensions),
 * and the parts are folded together with the log-sum-exp merge. A window's
 * pages are checksum-verified before any of their bytes reach the kernel.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "codec.h"
#include "compute_internal.h"
#include "kvdepot/attention.h"
#include "seqcodec.h"

/* Tokens read per kernel call: large enough that the cursor and the kernel
 * run at full speed, small enough (8 KiB tokens x 8 heads x 128 dims x f16
 * x K,V = 32 MiB) to keep a batch of long sequences in memory bounds. */
#define ATTEND_WINDOW 8192
#define PAGES_PER_STEP 64

/*
 * out (Hq, D) / lse (Hq) = attention of q (Hq, D) f32 over tokens
 * [start, start + n) of `layer`, window by window, merged by log-sum-exp.
 */
static int attend_range(const kvd_compute *c, const kvd_attend_query *qy, const kvd_model_info *m,
                        uint32_t layer, uint64_t start, uint64_t n, float scale, float *out,
                        float *lse, kvd_error *err)
{
    const int Hq = (int)m->num_q_heads, H = (int)m->num_kv_heads, D = (int)m->head_dim;
    const size_t es = kvd_dtype_size(m->dtype);
    for (int h = 0; h < Hq; h++) {
        lse[h] = -INFINITY;
        for (int d = 0; d < D; d++)
            out[(size_t)h * D + d] = 0.0f;
    }
    if (n == 0)
        return 0;
    uint64_t win = n < ATTEND_WINDOW ? n : ATTEND_WINDOW;
    size_t half = (size_t)win * H * D * es;
    uint8_t *buf = malloc(2 * half);
    float *wout = malloc(sizeof(float) * (size_t)Hq * D);
    float *wlse = malloc(sizeof(float) * (size_t)Hq);
    int rc = 0;
    if (!buf || !wout || !wlse) {
        rc = kvd_error_set(err, KVD_ENOMEM, "out of memory for a %llu-token window",
                           (unsigned long long)win);
        goto done;
    }
    kvd_attn_dims dims = {Hq, H, D, D, scale};
    int64_t qshape[2] = {Hq, D}, lshape[1] = {Hq};
    for (uint64_t t0 = 0; t0 < n && rc == 0; t0 += win) {
        uint64_t T = n - t0 < win ? n - t0 : win;
        uint64_t bytes = 2 * (uint64_t)T * H * D * es;
        if ((rc = kvd__read_window(c->store, qy->id, qy->id_len, layer, start + t0, T, buf, bytes,
                                   err)))
            break;
        kvd_attn_dense_args a;
        memset(&a, 0, sizeof a);
        a.dims = dims;
        a.q = kvd_tensor_make(KVD_DTYPE_F32, (void *)qy->q, 2, qshape);
        /* Wire layout [token][kv_head][dim] seen as (kv_head, token, dim). */
        int64_t kshape[3] = {H, (int64_t)T, D};
        a.k = kvd_tensor_make(m->dtype, buf, 3, kshape);
        a.k.stride[0] = (int64_t)D * (int64_t)es; /* strides in bytes */
        a.k.stride[1] = (int64_t)H * D * (int64_t)es;
        a.k.stride[2] = (int64_t)es;
        a.v = a.k;
        a.v.data = buf + bytes / 2;
        a.out = kvd_tensor_make(KVD_DTYPE_F32, t0 == 0 ? out : wout, 2, qshape);
        a.lse = kvd_tensor_make(KVD_DTYPE_F32, t0 == 0 ? lse : wlse, 1, lshape);
        if ((rc = kvd_attn_dense(c->be, 1, &a, err)))
            break;
        if (t0 > 0)
            rc = kvd_attn_merge_into(c->be, Hq, D, out, lse, wout, wlse, err);
    }
done:
    free(buf);
    free(wout);
    free(wlse);
    return rc;
}

/* Scratch of attend_pages: PAGES_PER_STEP handles and views, and two
 * partial results. */
typedef struct step_bufs {
    kvd_page_handle *hs, *dv; /* acquired; copies of those on the device */
    kvd_page_view *vs;
    float *po, *pl, *po2, *pl2;
} step_bufs;

/*
 * Attention over whole pages [b0, b0 + np) into (sb->po, sb->pl): pages
 * that lie in dev's memory (dev non-NULL) are attended there, the others on
 * the CPU, and the two parts merged. Every page is released on return.
 */
static int attend_step(const kvd_compute *c, kvd_backend *dev, const kvd_attend_query *qy,
                       uint32_t layer, uint64_t b0, size_t np, const kvd_seq_codecs *codecs,
                       const kvd_attn_dims *dims, step_bufs *sb, kvd_error *err)
{
    size_t got = 0, nd = 0, nv = 0; /* pages attended on the device / on the host */
    int rc = kvd_store_pages_acquire_device(c->store, qy->id, qy->id_len, layer, b0, np,
                                            dev ? KVD_ON_DEVICE_ATTEND : 0, sb->hs, err);
    if (rc == 0)
        got = np;
    for (size_t i = 0; i < got && rc == 0; i++) {
        const kvd_page_handle *h = &sb->hs[i];
        if (h->layout)
            sb->dv[nd++] = *h;
        else
            rc = kvd_page_decode_trusted(h->bytes, h->len, &sb->vs[nv++], err);
    }
    const int Hq = dims->n_q_heads, D = dims->head_dim;
    if (rc == 0)
        rc = kvd_page_attend(c->be, sb->vs, nv, codecs->arts, dims, qy->q, sb->po, sb->pl, err);
    kvd__devq dq = {.dims = *dims,
                    .q = qy->q,
                    .pages = sb->dv,
                    .np = nd,
                    .out = sb->po2,
                    .lse = sb->pl2,
                    .arts = codecs->arts,
                    .layer = layer};
    if (rc == 0 && nd > 0 && (rc = kvd__attend_device_batch(dev, &dq, 1, err)) == 0)
        rc = kvd_attn_merge_into(c->be, Hq, D, sb->po, sb->pl, sb->po2, sb->pl2, err);
    for (size_t i = 0; i < got; i++)
        kvd_store_page_release(c->store, &sb->hs[i]);
    return rc;
}

/*
 * Attention over tokens [start, start + n): whole sealed pages are acquired
 * from the store (pinned in their memory tier) and attended in their stored
 * form (kvd_page_attend: INT2/INT4 homomorphic, VQ fused, SVD at the reduced
 * widths, raw dense); pages that lie in the device tier of a device
 * (c->dev) are attended there, where they lie (kvd__attend_device_batch). A step
 * the device fails (kvd__device_fallback) is attended again on the CPU. The
 * partial blocks at both ends (and the raw tail) go through the read cursor.
 */
static int attend_pages(const kvd_compute *c, const kvd_attend_query *qy, const kvd_model_info *m,
                        uint32_t layer, uint64_t start, uint64_t n, uint64_t layer_tokens,
                        float scale, float *out, float *lse, kvd_error *err)
{
    const uint64_t B = kvd_store_page_tokens(c->store), end = start + n;
    uint64_t f0 = (start + B - 1) / B, f1 = end / B; /* whole blocks [f0, f1) */
    if (f1 > layer_tokens / B)
        f1 = layer_tokens / B;
    if (f0 >= f1)
        return attend_range(c, qy, m, layer, start, n, scale, out, lse, err);
    const int Hq = (int)m->num_q_heads, D = (int)m->head_dim;
    const size_t qf = (size_t)Hq * D;
    step_bufs sb = {calloc(PAGES_PER_STEP, sizeof *sb.hs),
                    calloc(PAGES_PER_STEP, sizeof *sb.dv),
                    calloc(PAGES_PER_STEP, sizeof *sb.vs),
                    malloc(sizeof(float) * qf),
                    malloc(sizeof(float) * Hq),
                    malloc(sizeof(float) * qf),
                    malloc(sizeof(float) * Hq)};
    kvd_seq_codecs codecs;
    memset(&codecs, 0, sizeof codecs);
    int rc = 0, found = 0;
    if (!sb.hs || !sb.dv || !sb.vs || !sb.po || !sb.pl || !sb.po2 || !sb.pl2) {
        rc = kvd_error_set(err, KVD_ENOMEM, "out of memory");
        goto done;
    }
    /* VQ/SVD pages attend with the sequence's artifact snapshot. */
    if ((rc = kvd_store_seq_codecs_get(c->store, qy->id, qy->id_len, &codecs, &found, err)) ||
        (found && (rc = kvd_seq_codecs_load_arts(c->store, qy->id, qy->id_len, &codecs, err))))
        goto done;
    /* Head: [start, f0*B) */
    if ((rc = attend_range(c, qy, m, layer, start, f0 * B - start, scale, out, lse, err)))
        goto done;
    kvd_attn_dims dims = {Hq, (int)m->num_kv_heads, D, D, scale};
    for (uint64_t b0 = f0; b0 < f1 && rc == 0; b0 += PAGES_PER_STEP) {
        size_t np = (size_t)(f1 - b0 < PAGES_PER_STEP ? f1 - b0 : PAGES_PER_STEP);
        kvd_backend *dev = c->dev ? kvd_store_device(c->store) : NULL; /* NULL once lost */
        rc = attend_step(c, dev, qy, layer, b0, np, &codecs, &dims, &sb, err);
        if (kvd__device_fallback(c->store, dev, rc, err))
            rc = attend_step(c, NULL, qy, layer, b0, np, &codecs, &dims, &sb, err);
        if (rc == 0)
            rc = kvd_attn_merge_into(c->be, Hq, D, out, lse, sb.po, sb.pl, err);
    }
    /* Tail: [f1*B, end) */
    if (rc == 0 && f1 * B < end &&
        (rc = attend_range(c, qy, m, layer, f1 * B, end - f1 * B, scale, sb.po, sb.pl, err)) == 0)
        rc = kvd_attn_merge_into(c->be, Hq, D, out, lse, sb.po, sb.pl, err);
done:
    kvd_seq_codecs_clear(&codecs);
    free(sb.hs);
    free(sb.dv);
    free(sb.vs);
    free(sb.po);
    free(sb.pl);
    free(sb.po2);
    free(sb.pl2);
    return rc;
}

/* Pages a batch pins at once on the device path (a query with more runs
 * alone, step by step). */
#define DEVICE_BATCH_PAGES 16384

/* Whole pages [*f0, *f1) of tokens [start, start + n) of a layer holding
 * layer_tokens. */
static void whole_pages(uint64_t B, uint64_t start, uint64_t n, uint64_t layer_tokens, uint64_t *f0,
                        uint64_t *f1)
{
    *f0 = (start + B - 1) / B;
    *f1 = (start + n) / B;
    if (*f1 > layer_tokens / B)
        *f1 = layer_tokens / B;
    if (*f1 < *f0)
        *f1 = *f0;
}

/* The pages one query of a device batch holds. */
typedef struct batch_q {
    kvd_seq_codecs codecs; /* with the artifacts: VQ and SVD pages */
    kvd_page_handle *hs;   /* acquired */
    size_t got;
    kvd_page_handle *dv; /* copies of those on the device */
    kvd_page_view *vs;   /* views of the others */
    size_t nd, nv;
    uint8_t *raw; /* the tokens outside whole pages (kvd__devq.raw) */
} batch_q;

/* Tokens [start, f0 * B) and [f1 * B, start + n) of a query (the partial
 * pages at both ends, the raw tail) into *raw as kvd__devq wants them: K of
 * both, then V of both, [token][kv_head][dim]. *raw NULL when there are
 * none. */
static int read_ends(const kvd_compute *c, const kvd_attend_query *qy, const kvd_model_info *m,
                     uint32_t layer, uint64_t B, uint64_t start, uint64_t n, uint64_t f0,
                     uint64_t f1, uint8_t **raw, uint64_t *tokens, kvd_error *err)
{
    const uint64_t nh = f0 * B - start, nt = start + n - f1 * B, T = nh + nt;
    const size_t row = (size_t)m->num_kv_heads * m->head_dim * kvd_dtype_size(m->dtype);
    *raw = NULL;
    *tokens = T;
    if (!T)
        return 0;
    uint8_t *r = malloc(2 * T * row), *tmp = malloc(2 * (nh > nt ? nh : nt) * row);
    int rc = r && tmp ? 0 : kvd_error_set(err, KVD_ENOMEM, "out of memory");
    const uint64_t s0[2] = {start, f1 * B}, len[2] = {nh, nt};
    for (int part = 0, at = 0; part < 2 && rc == 0; at += (int)len[part], part++) {
        if (!len[part])
            continue;
        rc = kvd__read_window(c->store, qy->id, qy->id_len, layer, s0[part], len[part], tmp,
                              2 * len[part] * row, err);
        if (rc == 0) {
            memcpy(r + (size_t)at * row, tmp, len[part] * row);                         /* K */
            memcpy(r + (T + (size_t)at) * row, tmp + len[part] * row, len[part] * row); /* V */
        }
    }
    free(tmp);
    if (rc)
        free(r);
    else
        *raw = r;
    return rc;
}

/*
 * Queries [i0, i1) of an Attend on the device dev: each query's whole pages
 * are acquired; those in the device tier become items of one device batch
 * (kvd__attend_device_batch) over all the queries, with the tokens of the
 * partial pages at both ends and the raw tail (read on the host, sent up
 * with the query), the other pages are attended on the CPU, and the
 * parts of each query are merged by log-sum-exp. When the device fails
 * (kvd__device_fallback) the queries are attended again on the CPU.
 */
static int attend_group(const kvd_compute *c, kvd_backend *dev, uint32_t layer, float scale,
                        const kvd_attend_query *qs, const kvd__cseq *sc, const uint64_t *count,
                        size_t i0, size_t i1, kvd_attend_result *res, kvd_error *err)
{
    const uint64_t B = kvd_store_page_tokens(c->store);
    const size_t nq = i1 - i0;
    batch_q *bq = calloc(nq, sizeof *bq);
    kvd__devq *dq = calloc(nq, sizeof *dq);
    size_t tmp_floats = 0;
    for (size_t i = i0; i < i1; i++)
        tmp_floats += (size_t)sc[i].model.num_q_heads * (sc[i].model.head_dim + 1);
    float *dres = malloc(sizeof(float) * (tmp_floats + 1)); /* device results */
    float *po = NULL, *pl = NULL;
    int rc = 0;
    if (!bq || !dq || !dres) {
        rc = kvd_error_set(err, KVD_ENOMEM, "out of memory");
        goto done;
    }
    float *dnext = dres;
    for (size_t k = 0; k < nq && rc == 0; k++) {
        const size_t i = i0 + k;
        const kvd_model_info *m = &sc[i].model;
        const int Hq = (int)m->num_q_heads, D = (int)m->head_dim;
        const float sc_i = kvd__default_scale(scale, m->head_dim);
        kvd_attn_dims dims = {Hq, (int)m->num_kv_heads, D, D, sc_i};
        const uint64_t start = qs[i].token_start, n = count[i];
        uint64_t f0, f1;
        whole_pages(B, start, n, sc[i].layer_tokens, &f0, &f1);
        dq[k] = (kvd__devq){.dims = dims,
                            .q = qs[i].q,
                            .out = dnext,
                            .lse = dnext + (size_t)Hq * D,
                            .layer = layer};
        dnext += (size_t)Hq * (D + 1);
        if (f0 == f1) {
            rc = attend_range(c, &qs[i], m, layer, start, n, sc_i, res[i].out, res[i].lse, err);
            continue;
        }
        free(po);
        free(pl);
        po = malloc(sizeof(float) * (size_t)Hq * D);
        pl = malloc(sizeof(float) * Hq);
        batch_q *b = &bq[k];
        size_t np = (size_t)(f1 - f0);
        b->hs = calloc(np, sizeof *b->hs);
        b->dv = calloc(np, sizeof *b->dv);
        b->vs = calloc(np, sizeof *b->vs);
        if (!po || !pl || !b->hs || !b->dv || !b->vs) {
            rc = kvd_error_set(err, KVD_ENOMEM, "out of memory");
            break;
        }
        /* VQ and SVD pages attend with the sequence's artifact snapshot. */
        int found = 0;
        if ((rc = kvd_store_seq_codecs_get(c->store, qs[i].id, qs[i].id_len, &b->codecs, &found,
                                           err)) ||
            (found &&
             (rc = kvd_seq_codecs_load_arts(c->store, qs[i].id, qs[i].id_len, &b->codecs, err))))
            break;
        dq[k].arts = b->codecs.arts;
        /* Head [start, f0*B) and tail [f1*B, end), on the device. */
        if ((rc = read_ends(c, &qs[i], m, layer, B, start, n, f0, f1, &b->raw, &dq[k].raw_tokens,
                            err)))
            break;
        dq[k].raw = b->raw;
        dq[k].raw_dtype = m->dtype;
        for (int h = 0; h < Hq; h++) { /* the parts merge into an empty result */
            res[i].lse[h] = -INFINITY;
            memset(res[i].out + (size_t)h * D, 0, sizeof(float) * (size_t)D);
        }
        if (np && (rc = kvd_store_pages_acquire_device(c->store, qs[i].id, qs[i].id_len, layer, f0,
                                                       np, KVD_ON_DEVICE_ATTEND, b->hs, err)))
            break;
        b->got = np;
        for (size_t j = 0; j < np && rc == 0; j++) {
            const kvd_page_handle *h = &b->hs[j];
            if (h->layout)
                b->dv[b->nd++] = *h;
            else
                rc = kvd_page_decode_trusted(h->bytes, h->len, &b->vs[b->nv++], err);
        }
        dq[k].pages = b->dv;
        dq[k].np = b->nd;
        if (rc)
            break;
        /* Pages not on the device, on the CPU. */
        if (b->nv > 0 &&
            ((rc = kvd_page_attend(c->be, b->vs, b->nv, b->codecs.arts, &dims, qs[i].q, po, pl,
                                   err)) ||
             (rc = kvd_attn_merge_into(c->be, Hq, D, res[i].out, res[i].lse, po, pl, err))))
            break;
    }
    if (rc == 0)
        rc = kvd__attend_device_batch(dev, dq, nq, err);
    for (size_t k = 0; k < nq && rc == 0; k++)
        if (dq[k].np > 0 || dq[k].raw_tokens > 0)
            rc = kvd_attn_merge_into(c->be, dq[k].dims.n_q_heads, dq[k].dims.head_dim,
                                     res[i0 + k].out, res[i0 + k].lse, dq[k].out, dq[k].lse, err);
done:
    for (size_t k = 0; bq && k < nq; k++) {
        for (size_t j = 0; j < bq[k].got; j++)
            kvd_store_page_release(c->store, &bq[k].hs[j]);
        free(bq[k].hs);
        free(bq[k].dv);
        free(bq[k].vs);
        free(bq[k].raw);
        kvd_seq_codecs_clear(&bq[k].codecs);
    }
    free(bq);
    free(dq);
    free(dres);
    free(po);
    free(pl);
    if (kvd__device_fallback(c->store, dev, rc, err)) {
        kvd_compute cpu = *c;
        cpu.dev = NULL;
        rc = 0;
        for (size_t i = i0; i < i1 && rc == 0; i++)
            rc = attend_pages(&cpu, &qs[i], &sc[i].model, layer, qs[i].token_start, count[i],
                              sc[i].layer_tokens, kvd__default_scale(scale, sc[i].model.head_dim),
                              res[i].out, res[i].lse, err);
    }
    return rc;
}

void kvd_attend_results_clear(kvd_attend_result *res, size_t n)
{
    if (!res)
        return;
    for (size_t i = 0; i < n; i++) {
        free(res[i].out);
        free(res[i].lse);
        memset(&res[i], 0, sizeof res[i]);
    }
}

int kvd_compute_attend(const kvd_compute *c, uint32_t layer, float scale,
                       const kvd_attend_query *qs, size_t n, kvd_attend_result *res, kvd_error *err)
{
    if (n == 0)
        return kvd_error_set(err, KVD_EINVAL, "queries: empty");
    if (n > KVD_ATTEND_MAX_BATCH)
        return kvd_error_set(err, KVD_EINVAL, "queries: %zu, at most %d per call", n,
                             KVD_ATTEND_MAX_BATCH);
    if (!isfinite(scale))
        return kvd_error_set(err, KVD_EINVAL, "scale: not finite");

    /* Check every query before computing any: a bad batch fails as a whole. */
    kvd__cseq *sc = calloc(n, sizeof *sc);
    uint64_t *count = calloc(n, sizeof *count);
    int rc = 0;
    if (!sc || !count) {
        rc = kvd_error_set(err, KVD_ENOMEM, "out of memory");
        goto done;
    }
    for (size_t i = 0; i < n; i++) {
        const kvd_attend_query *qy = &qs[i];
        char field[48];
        snprintf(field, sizeof field, "queries[%zu].sequence_id", i);
        if ((rc = kvd__cseq_load(c, qy->id, qy->id_len, field, layer, &sc[i], err)))
            goto done;
        size_t want = (size_t)sc[i].model.num_q_heads * sc[i].model.head_dim;
        if (qy->n_q != want) {
            rc = kvd_error_set(err, KVD_EINVAL,
                               "queries[%zu].q: %zu floats, model %s needs num_q_heads x "
                               "head_dim = %u x %u",
                               i, qy->n_q, sc[i].model.name, sc[i].model.num_q_heads,
                               sc[i].model.head_dim);
            goto done;
        }
        snprintf(field, sizeof field, "queries[%zu].q", i);
        if ((rc = kvd__query_finite(field, qy->q, qy->n_q, sc[i].model.head_dim, err)))
            goto done;
        count[i] = qy->num_tokens;
        snprintf(field, sizeof field, "queries[%zu]", i);
        if ((rc = kvd__token_range(field, qy->token_start, &count[i], sc[i].layer_tokens, err)))
            goto done;
    }
    uint64_t kv_bytes = 0; /* what the CPU slots rank the request by */
    for (size_t i = 0; i < n; i++)
        kv_bytes += count[i] * sc[i].model.num_kv_heads * sc[i].model.head_dim * 4;
    kvd_cpu_task_expect(kv_bytes);
    for (size_t i = 0; i < n; i++) {
        const kvd_model_info *m = &sc[i].model;
        res[i].num_q_heads = m->num_q_heads;
        res[i].head_dim = m->head_dim;
        res[i].num_tokens = count[i];
        res[i].out = malloc(sizeof(float) * (size_t)m->num_q_heads * m->head_dim);
        res[i].lse = malloc(sizeof(float) * m->num_q_heads);
        if (!res[i].out || !res[i].lse) {
            rc = kvd_error_set(err, KVD_ENOMEM, "out of memory");
            goto done;
        }
    }
    /* With a device: queries in batches of up to DEVICE_BATCH_PAGES whole
     * pages, one set of launches each; a query with more pages, and every
     * query without a device, page step by page step. */
    kvd_backend *dev = c->dev ? kvd_store_device(c->store) : NULL;
    const uint64_t B = kvd_store_page_tokens(c->store);
    for (size_t i0 = 0; i0 < n && rc == 0;) {
        size_t i1 = i0;
        uint64_t pages = 0, f0, f1;
        for (; dev && i1 < n; i1++) {
            whole_pages(B, qs[i1].token_start, count[i1], sc[i1].layer_tokens, &f0, &f1);
            if (pages + (f1 - f0) > DEVICE_BATCH_PAGES)
                break;
            pages += f1 - f0;
        }
        if (i1 > i0) {
            rc = attend_group(c, dev, layer, scale, qs, sc, count, i0, i1, res, err);
            i0 = i1;
            continue;
        }
        const kvd_model_info *m = &sc[i0].model;
        rc = attend_pages(c, &qs[i0], m, layer, qs[i0].token_start, count[i0], sc[i0].layer_tokens,
                          kvd__default_scale(scale, m->head_dim), res[i0].out, res[i0].lse, err);
        i0++;
    }
done:
    free(count);
    free(sc);
    return rc;
}
