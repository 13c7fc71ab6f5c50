/*
 * Attention over pages that lie in the device tier, on the device.
 *
 * The pages of every query of a call are the items of one launch per kind
 * of page (raw pages: the dense kernel, INT2/INT4 pages: the homomorphic
 * kernel on their codes), each item pointing into the device pool where
 * its page lies (the page layout the store keeps says where). Every item
 * writes its own (out, lse) slot; each query's slots are then merged on the
 * device pairwise, half of them per launch and all queries in the same
 * launches, so a call whose longest query has n pages takes ceil(log2 n)
 * merge launches, plus one that gathers the results. Only the queries and
 * the merged results cross the bus, one copy each way.
 */
#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "codec.h"
#include "compute_internal.h"
#include "kvdepot/attention.h"

static _Atomic uint64_t device_pages;

uint64_t kvd_compute_device_pages(void)
{
    return atomic_load(&device_pages);
}

/* out = the merge of the results at a and b (device floats: Hq x D
 * outputs, then Hq lse; b's lse at b + b_lse_at, or right after its
 * outputs when b_lse_at is 0). */
static void merge_item(kvd_attn_merge_args *m, const kvd_attn_dims *d, float *a, float *b,
                       size_t b_lse_at, float *out)
{
    const size_t qf = (size_t)d->n_q_heads * (size_t)d->head_dim;
    int64_t qsh[2] = {d->n_q_heads, d->head_dim}, lsh[1] = {d->n_q_heads};
    m->out_a = kvd_tensor_make(KVD_DTYPE_F32, a, 2, qsh);
    m->lse_a = kvd_tensor_make(KVD_DTYPE_F32, a + qf, 1, lsh);
    m->out_b = kvd_tensor_make(KVD_DTYPE_F32, b, 2, qsh);
    m->lse_b = kvd_tensor_make(KVD_DTYPE_F32, b + (b_lse_at ? b_lse_at : qf), 1, lsh);
    m->out = kvd_tensor_make(KVD_DTYPE_F32, out, 2, qsh);
    m->lse = kvd_tensor_make(KVD_DTYPE_F32, out + qf, 1, lsh);
}

/* The item of one page: dense for raw pages, homomorphic for INT2/INT4. */
static void page_item(const kvd_page_handle *h, const kvd_attn_dims *d, float *q, float *slot,
                      kvd_attn_dense_args *da, size_t *nd, kvd_attn_int_args *ia, size_t *ni)
{
    const kvd_page_layout *l = h->layout;
    const size_t qf = (size_t)d->n_q_heads * (size_t)d->head_dim;
    int64_t qsh[2] = {d->n_q_heads, d->head_dim}, lsh[1] = {d->n_q_heads};
    int64_t esh[3] = {d->n_kv_heads, 0, d->head_dim};
    kvd_tensor tq = kvd_tensor_make(KVD_DTYPE_F32, q, 2, qsh);
    kvd_tensor to = kvd_tensor_make(KVD_DTYPE_F32, slot, 2, qsh);
    kvd_tensor tl = kvd_tensor_make(KVD_DTYPE_F32, slot + qf, 1, lsh);
    kvd_attn_qdata k, v;
    kvd_page_layout_at(l, h->device, &k, &v);
    if (l->k_codec == KVD_CODEC_RAW) {
        kvd_attn_dense_args *a = &da[(*nd)++];
        a->dims = *d;
        a->q = tq;
        a->k = k.codes;
        a->v = v.codes;
        a->out = to;
        a->lse = tl;
        return;
    }
    kvd_attn_int_args *a = &ia[(*ni)++];
    a->dims = *d;
    a->q = tq;
    a->n_tokens = l->num_tokens;
    a->k = k;
    a->v = v;
    a->k_tail = kvd_tensor_make(KVD_DTYPE_F32, NULL, 3, esh);
    a->v_tail = a->k_tail;
    a->out = to;
    a->lse = tl;
}

int kvd__attend_device_batch(kvd_backend *dev, kvd__devq *qs, size_t nq, kvd_error *err)
{
    /* Device memory, in floats: per query its q and one slot (out, lse) per
     * page; then every query's result, back to back; then one empty result
     * (out 0, lse -inf) that the last merge takes in. */
    size_t npages = 0, hq_max = 0, qf_max = 0, total = 0;
    size_t *off = calloc(3 * nq + 1, sizeof *off); /* q, slots, result of query i */
    size_t *m = calloc(nq + 1, sizeof *m);         /* slots still to merge */
    kvd_attn_int_args *ia = NULL;
    kvd_attn_dense_args *da = NULL;
    kvd_attn_merge_args *ma = NULL;
    float *host = NULL, *buf = NULL;
    int rc = 0;
    if (!off || !m) {
        rc = kvd_error_set(err, KVD_ENOMEM, "out of memory");
        goto done;
    }
    for (size_t i = 0; i < nq; i++) {
        const size_t hq = (size_t)qs[i].dims.n_q_heads, qf = hq * (size_t)qs[i].dims.head_dim;
        for (size_t p = 0; p < qs[i].np; p++)
            if (qs[i].pages[p].layout->num_kv_heads != (uint32_t)qs[i].dims.n_kv_heads ||
                qs[i].pages[p].layout->head_dim != (uint32_t)qs[i].dims.head_dim) {
                rc = kvd_error_set(
                    err, KVD_EINVAL, "page of %u kv heads x %u dims, attention wants %d x %d",
                    qs[i].pages[p].layout->num_kv_heads, qs[i].pages[p].layout->head_dim,
                    qs[i].dims.n_kv_heads, qs[i].dims.head_dim);
                goto done;
            }
        npages += qs[i].np;
        hq_max = hq > hq_max ? hq : hq_max;
        qf_max = qf > qf_max ? qf : qf_max;
        off[3 * i] = total;
        off[3 * i + 1] = total + qf;
        total += qf + qs[i].np * (qf + hq);
    }
    const size_t res_base = total;
    for (size_t i = 0; i < nq; i++) {
        off[3 * i + 2] = total;
        total += (size_t)qs[i].dims.n_q_heads * ((size_t)qs[i].dims.head_dim + 1);
    }
    const size_t empty = total;
    total += qf_max + hq_max;
    ia = calloc(npages + 1, sizeof *ia);
    da = calloc(npages + 1, sizeof *da);
    ma = calloc(npages + nq + 1, sizeof *ma);
    host = malloc(sizeof(float) * total); /* what goes up, then what comes down */
    if (!ia || !da || !ma || !host) {
        rc = kvd_error_set(err, KVD_ENOMEM, "out of memory for %zu pages", npages);
        goto done;
    }
    for (size_t i = 0; i < nq; i++)
        memcpy(host + off[3 * i], qs[i].q,
               sizeof(float) * (size_t)qs[i].dims.n_q_heads * (size_t)qs[i].dims.head_dim);
    for (size_t j = 0; j < qf_max; j++)
        host[empty + j] = 0.0f;
    for (size_t j = 0; j < hq_max; j++)
        host[empty + qf_max + j] = -INFINITY;
    if ((rc = kvd_backend_scratch(dev, sizeof(float) * total, (void **)&buf, err)) ||
        (rc = kvd_backend_upload(dev, buf, host, sizeof(float) * total, err)))
        goto done;
    /* Every page of every query is one item: one launch per kind. */
    size_t ni = 0, nd = 0;
    for (size_t i = 0; i < nq; i++) {
        const kvd_attn_dims *d = &qs[i].dims;
        const size_t sl = (size_t)d->n_q_heads * ((size_t)d->head_dim + 1);
        for (size_t p = 0; p < qs[i].np; p++)
            page_item(&qs[i].pages[p], d, buf + off[3 * i], buf + off[3 * i + 1] + p * sl, da, &nd,
                      ia, &ni);
        m[i] = qs[i].np;
    }
    if ((rc = kvd_attn_quant(dev, (int)ni, ia, err)) ||
        (rc = kvd_attn_dense(dev, (int)nd, da, err)))
        goto done;
    /* Per query, slot j takes in slot j + half until one is left, all
     * queries in each launch; the last launch moves every result into
     * place (merged with the empty result). */
    for (int last = 0; !last;) {
        size_t n = 0;
        last = 1;
        for (size_t i = 0; i < nq; i++)
            last &= m[i] <= 1;
        for (size_t i = 0; i < nq; i++) {
            const kvd_attn_dims *d = &qs[i].dims;
            const size_t sl = (size_t)d->n_q_heads * ((size_t)d->head_dim + 1);
            float *slots = buf + off[3 * i + 1];
            if (!last && m[i] > 1) {
                size_t half = (m[i] + 1) / 2;
                for (size_t j = 0; j + half < m[i]; j++)
                    merge_item(&ma[n++], d, slots + j * sl, slots + (j + half) * sl, 0,
                               slots + j * sl);
                m[i] = half;
            } else if (last && m[i] == 1) {
                merge_item(&ma[n++], d, slots, buf + empty, qf_max, buf + off[3 * i + 2]);
            }
        }
        if ((rc = kvd_attn_merge(dev, (int)n, ma, err)))
            goto done;
    }
    if ((rc = kvd_backend_download(dev, host + res_base, buf + res_base,
                                   sizeof(float) * (empty - res_base), err)))
        goto done;
    for (size_t i = 0; i < nq; i++) {
        const size_t hq = (size_t)qs[i].dims.n_q_heads, qf = hq * (size_t)qs[i].dims.head_dim;
        if (qs[i].np == 0) {
            memset(qs[i].out, 0, sizeof(float) * qf);
            for (size_t h = 0; h < hq; h++)
                qs[i].lse[h] = -INFINITY;
            continue;
        }
        memcpy(qs[i].out, host + off[3 * i + 2], sizeof(float) * qf);
        memcpy(qs[i].lse, host + off[3 * i + 2] + qf, sizeof(float) * hq);
    }
    atomic_fetch_add(&device_pages, npages);
done:
    kvd_backend_scratch_free(dev, buf);
    free(host);
    free(ia);
    free(da);
    free(ma);
    free(m);
    free(off);
    return rc;
}

int kvd__attend_device(kvd_backend *dev, const kvd_page_handle *hs, size_t n,
                       const kvd_attn_dims *dims, const float *q, float *out, float *lse,
                       kvd_error *err)
{
    kvd__devq one = {*dims, q, hs, n, out, lse};
    return kvd__attend_device_batch(dev, &one, 1, err);
}
