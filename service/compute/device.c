/*
 * Attention over pages that lie in the device tier, on the device.
 *
 * The pages of one step are the items of one call per kind of page (raw
 * pages: the dense kernel, INT2/INT4 pages: the homomorphic kernel on their
 * codes), each item pointing into the device pool where its page lies (the
 * page layout the store keeps says where). Every item writes its own
 * (out, lse) slot; the slots are then merged on the device pairwise, half
 * of them per launch, so n pages take ceil(log2 n) merge launches. Only the
 * query and the merged (out, lse) cross the bus.
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

int kvd__attend_device(kvd_backend *dev, const kvd_page_handle *hs, size_t n,
                       const kvd_attn_dims *dims, const float *q, float *out, float *lse,
                       kvd_error *err)
{
    const int Hq = dims->n_q_heads, H = dims->n_kv_heads, D = dims->head_dim;
    const size_t qf = (size_t)Hq * D;
    if (n == 0) {
        for (size_t i = 0; i < qf; i++)
            out[i] = 0.0f;
        for (int h = 0; h < Hq; h++)
            lse[h] = -INFINITY;
        return 0;
    }
    kvd_attn_int_args *ia = calloc(n, sizeof *ia);
    kvd_attn_dense_args *da = calloc(n, sizeof *da);
    kvd_attn_merge_args *ma = calloc(n, sizeof *ma);
    float *buf = NULL; /* device: q, then n slots of out, then n of lse */
    int rc = 0;
    if (!ia || !da || !ma) {
        rc = kvd_error_set(err, KVD_ENOMEM, "out of memory");
        goto done;
    }
    if ((rc = kvd_backend_alloc(dev, sizeof(float) * (qf + n * qf + n * (size_t)Hq), (void **)&buf,
                                err)) ||
        (rc = kvd_backend_upload(dev, buf, q, sizeof(float) * qf, err)))
        goto done;
    float *dq = buf, *douts = buf + qf, *dlses = douts + n * qf;
    int64_t qs[2] = {Hq, D}, ls[1] = {Hq}, es[3] = {H, 0, D};
    size_t ni = 0, nd = 0;
    for (size_t i = 0; i < n; i++) {
        const kvd_page_layout *l = hs[i].layout;
        if ((int)l->num_kv_heads != H || (int)l->head_dim != D) {
            rc = kvd_error_set(err, KVD_EINVAL,
                               "page of %u kv heads x %u dims, attention wants %d x %d",
                               l->num_kv_heads, l->head_dim, H, D);
            goto done;
        }
        kvd_tensor tq = kvd_tensor_make(KVD_DTYPE_F32, dq, 2, qs);
        kvd_tensor to = kvd_tensor_make(KVD_DTYPE_F32, douts + i * qf, 2, qs);
        kvd_tensor tl = kvd_tensor_make(KVD_DTYPE_F32, dlses + i * Hq, 1, ls);
        kvd_attn_qdata k, v;
        kvd_page_layout_at(l, hs[i].device, &k, &v);
        if (l->k_codec == KVD_CODEC_RAW) {
            kvd_attn_dense_args *a = &da[nd++];
            a->dims = *dims;
            a->q = tq;
            a->k = k.codes;
            a->v = v.codes;
            a->out = to;
            a->lse = tl;
        } else {
            kvd_attn_int_args *a = &ia[ni++];
            a->dims = *dims;
            a->q = tq;
            a->n_tokens = l->num_tokens;
            a->k = k;
            a->v = v;
            a->k_tail = kvd_tensor_make(KVD_DTYPE_F32, NULL, 3, es);
            a->v_tail = a->k_tail;
            a->out = to;
            a->lse = tl;
        }
    }
    if ((rc = kvd_attn_quant(dev, (int)ni, ia, err)) ||
        (rc = kvd_attn_dense(dev, (int)nd, da, err)))
        goto done;
    /* Slot i takes in slot i + half until one is left. */
    for (size_t m = n; m > 1;) {
        size_t half = (m + 1) / 2, np = 0;
        for (size_t i = 0; i + half < m; i++) {
            kvd_attn_merge_args *a = &ma[np++];
            a->out_a = kvd_tensor_make(KVD_DTYPE_F32, douts + i * qf, 2, qs);
            a->lse_a = kvd_tensor_make(KVD_DTYPE_F32, dlses + i * Hq, 1, ls);
            a->out_b = kvd_tensor_make(KVD_DTYPE_F32, douts + (i + half) * qf, 2, qs);
            a->lse_b = kvd_tensor_make(KVD_DTYPE_F32, dlses + (i + half) * Hq, 1, ls);
            a->out = a->out_a;
            a->lse = a->lse_a;
        }
        if ((rc = kvd_attn_merge(dev, (int)np, ma, err)))
            goto done;
        m = half;
    }
    if ((rc = kvd_backend_download(dev, out, douts, sizeof(float) * qf, err)) == 0 &&
        (rc = kvd_backend_download(dev, lse, dlses, sizeof(float) * Hq, err)) == 0)
        atomic_fetch_add(&device_pages, n);
done:
    if (buf)
        kvd_backend_dealloc(dev, buf);
    free(ia);
    free(da);
    free(ma);
    return rc;
}
