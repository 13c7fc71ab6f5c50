/*
 * Attention over pages that lie in the device tier, on the device.
 *
 * The pages of every query of a call are the items of one launch per kind
 * of page (raw pages: the dense kernel, INT2/INT4 pages: the homomorphic
 * kernel on their codes, VQ pages: the fused VQ kernel with the sequence's
 * codebooks, SVD + raw pages: the reduced-dimension kernel with its
 * rotations), each item pointing into the device pool where
 * its page lies (the page layout the store keeps says where). Every item
 * writes its own (out, lse) slot; each query's slots are then merged on the
 * device pairwise, half of them per launch and all queries in the same
 * launches, so a call whose longest query has n pages takes ceil(log2 n)
 * merge launches, plus one that gathers the results. Only the queries
 * (with the tokens of a query outside whole pages, read on the host, and
 * the codebooks or rotations its pages need) and the merged results cross
 * the bus, one copy each way.
 */
#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "codec.h"
#include "compute_internal.h"
#include "kvdepot/attention.h"
#include "kvdepot/svd.h"

static _Atomic uint64_t device_pages;

int kvd__device_fallback(kvd_store *st, kvd_backend *dev, int rc, kvd_error *err)
{
    return dev && kvd_store_device_fallback(st, rc, err);
}

void kvd__device_pages_add(uint64_t n)
{
    atomic_fetch_add(&device_pages, n);
}

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
    const size_t qf = (size_t)d->n_q_heads * (size_t)d->v_dim;
    int64_t qsh[2] = {d->n_q_heads, d->v_dim}, lsh[1] = {d->n_q_heads};
    m->out_a = kvd_tensor_make(KVD_DTYPE_F32, a, 2, qsh);
    m->lse_a = kvd_tensor_make(KVD_DTYPE_F32, a + qf, 1, lsh);
    m->out_b = kvd_tensor_make(KVD_DTYPE_F32, b, 2, qsh);
    m->lse_b = kvd_tensor_make(KVD_DTYPE_F32, b + (b_lse_at ? b_lse_at : qf), 1, lsh);
    m->out = kvd_tensor_make(KVD_DTYPE_F32, out, 2, qsh);
    m->lse = kvd_tensor_make(KVD_DTYPE_F32, out + qf, 1, lsh);
}

/* A query's VQ codebooks (k NULL: it has no VQ page) and SVD rotations
 * (sk NULL: no SVD page): the sequence's artifacts of the layer, where they
 * go in the call's device memory (in floats), and there. */
typedef struct vq_books {
    const kvd_layer_arts *k, *v;
    size_t at, n_lambda, n_kbook, n_vbook;
    int shared; /* placed already for an earlier query */
    float *k_lambda, *k_book, *v_book;
    const kvd_layer_arts *sk, *sv;
    size_t s_at, n_rot;
    int s_shared;
    float *rk, *rv;
} vq_books;

/* A VQ page of query q is attended with the sequence's codebooks of its
 * layer: they must be there and be the ones the page was coded with (as
 * kvd_codec_section_parse checks on the CPU). Sets b on the first page. */
static int vq_check(const kvd__devq *q, const kvd_page_layout *l, vq_books *b, kvd_error *err)
{
    const kvd_codec_arts *a = q->arts;
    if (!a || q->layer >= a->num_layers || !a->k || !a->v || !a->k[q->layer].codebook ||
        !a->v[q->layer].codebook)
        return kvd_error_set(err, KVD_EPRECOND,
                             "VQ page of layer %u, but the sequence has no VQ codebooks for it",
                             q->layer);
    const kvd_layer_arts *k = &a->k[q->layer], *v = &a->v[q->layer];
    if (k->vq_sub_dim != l->k_sub_dim || k->vq_bits != l->k_bits || v->vq_sub_dim != l->v_sub_dim ||
        v->vq_bits != l->v_bits)
        return kvd_error_set(err, KVD_EPRECOND,
                             "VQ page coded as K d%db%d / V d%db%d, the sequence's codebooks are "
                             "K d%ub%u / V d%ub%u",
                             l->k_sub_dim, l->k_bits, l->v_sub_dim, l->v_bits, k->vq_sub_dim,
                             k->vq_bits, v->vq_sub_dim, v->vq_bits);
    if (k->fingerprint != l->k_fingerprint || v->fingerprint != l->v_fingerprint)
        return kvd_error_set(err, KVD_EPRECOND,
                             "VQ page: artifact fingerprints differ from the sequence's (coded "
                             "with other artifacts)");
    if (!b->k) {
        const size_t H = (size_t)q->dims.n_kv_heads;
        b->k = k;
        b->v = v;
        b->n_lambda = k->lambda ? H * (size_t)q->dims.head_dim : 0;
        b->n_kbook = H * ((size_t)1 << k->vq_bits) * k->vq_sub_dim;
        b->n_vbook = H * ((size_t)1 << v->vq_bits) * v->vq_sub_dim;
    }
    return 0;
}

/* An SVD page of query q is attended with the sequence's rotations and
 * kept widths of its layer: they must be there and be the ones the page was
 * coded with (its fingerprints). Sets b on the first page. */
static int svd_check(const kvd__devq *q, const kvd_page_layout *l, vq_books *b, kvd_error *err)
{
    const kvd_codec_arts *a = q->arts;
    if (!a || q->layer >= a->num_layers || !a->k || !a->v || !a->k[q->layer].rotation ||
        !a->v[q->layer].rotation || !a->k[q->layer].widths || !a->v[q->layer].widths)
        return kvd_error_set(err, KVD_EPRECOND,
                             "SVD page of layer %u, but the sequence has no rotations for it",
                             q->layer);
    const kvd_layer_arts *k = &a->k[q->layer], *v = &a->v[q->layer];
    if (k->fingerprint != l->k_fingerprint || v->fingerprint != l->v_fingerprint)
        return kvd_error_set(err, KVD_EPRECOND,
                             "SVD page: artifact fingerprints differ from the sequence's (coded "
                             "with other artifacts)");
    if (!kvd_page_layout_svd_fits(l, k->widths, v->widths))
        return kvd_error_set(err, KVD_EPRECOND,
                             "SVD page: its kept widths differ from the sequence's");
    if (!b->sk) {
        b->sk = k;
        b->sv = v;
        b->n_rot = (size_t)q->dims.n_kv_heads * (size_t)q->dims.head_dim * q->dims.head_dim;
    }
    return 0;
}

/* Copy b's codebooks into the host image at b->at (unless an earlier
 * query's placement is b's), and point b at where they will lie in buf. */
static void books_place(vq_books *b, float *host, float *buf)
{
    if (!b->shared) {
        memcpy(host + b->at, b->k->lambda ? b->k->lambda : host, sizeof(float) * b->n_lambda);
        memcpy(host + b->at + b->n_lambda, b->k->codebook, sizeof(float) * b->n_kbook);
        memcpy(host + b->at + b->n_lambda + b->n_kbook, b->v->codebook, sizeof(float) * b->n_vbook);
    }
    b->k_lambda = b->n_lambda ? buf + b->at : NULL;
    b->k_book = buf + b->at + b->n_lambda;
    b->v_book = buf + b->at + b->n_lambda + b->n_kbook;
}

/* The same for b's rotations at b->s_at. */
static void rotations_place(vq_books *b, float *host, float *buf)
{
    if (!b->s_shared) {
        memcpy(host + b->s_at, b->sk->rotation, sizeof(float) * b->n_rot);
        memcpy(host + b->s_at + b->n_rot, b->sv->rotation, sizeof(float) * b->n_rot);
    }
    b->rk = buf + b->s_at;
    b->rv = buf + b->s_at + b->n_rot;
}

/* The item of one page: dense for raw pages, homomorphic for INT2/INT4,
 * fused VQ with the query's codebooks, reduced-dimension for SVD + raw with
 * its rotations. */
/* An item's query (q) and its (out, lse) slot, as tensors. */
static void item_io(const kvd_attn_dims *d, float *q, float *slot, kvd_tensor *tq, kvd_tensor *to,
                    kvd_tensor *tl)
{
    const size_t qf = (size_t)d->n_q_heads * (size_t)d->head_dim;
    int64_t qsh[2] = {d->n_q_heads, d->head_dim}, lsh[1] = {d->n_q_heads};
    *tq = kvd_tensor_make(KVD_DTYPE_F32, q, 2, qsh);
    *to = kvd_tensor_make(KVD_DTYPE_F32, slot, 2, qsh);
    *tl = kvd_tensor_make(KVD_DTYPE_F32, slot + qf, 1, lsh);
}

static void page_item(const kvd_page_handle *h, const kvd_attn_dims *d, float *q, float *slot,
                      const vq_books *vb, kvd_attn_dense_args *da, size_t *nd,
                      kvd_attn_int_args *ia, size_t *ni, kvd_attn_vq_args *va, size_t *nv,
                      kvd_attn_svd_args *sa, size_t *ns)
{
    const kvd_page_layout *l = h->layout;
    int64_t esh[3] = {d->n_kv_heads, 0, d->head_dim};
    kvd_tensor tq, to, tl;
    item_io(d, q, slot, &tq, &to, &tl);
    kvd_attn_qdata k, v;
    kvd_page_layout_at(l, h->device, &k, &v);
    if (l->k_codec == KVD_CODEC_SVD) {
        int64_t rs[3] = {d->n_kv_heads, d->head_dim, d->head_dim};
        kvd_attn_svd_args *a = &sa[(*ns)++];
        a->dims = *d;
        a->q = tq;
        a->rk = kvd_tensor_make(KVD_DTYPE_F32, vb->rk, 3, rs);
        a->rv = kvd_tensor_make(KVD_DTYPE_F32, vb->rv, 3, rs);
        a->k_width = vb->sk->widths;
        a->v_width = vb->sv->widths;
        a->n_tokens = l->num_tokens;
        a->dtype = l->dtype;
        a->k_red = k.codes.data;
        a->v_red = v.codes.data;
        a->out = to;
        a->lse = tl;
        return;
    }
    if (l->k_codec == KVD_CODEC_VQ) {
        const int64_t H = d->n_kv_heads, D = d->head_dim;
        int64_t kb[3] = {H, (int64_t)1 << l->k_bits, l->k_sub_dim};
        int64_t vbs[3] = {H, (int64_t)1 << l->v_bits, l->v_sub_dim};
        int64_t ls[2] = {H, D};
        kvd_attn_vq_args *a = &va[(*nv)++];
        a->dims = *d;
        a->q = tq;
        a->n_tokens = l->num_tokens;
        a->k_sub_dim = l->k_sub_dim;
        a->k_bits = l->k_bits;
        a->k_codes = k.codes;
        a->k_codebook = kvd_tensor_make(KVD_DTYPE_F32, vb->k_book, 3, kb);
        a->k_lambda = kvd_tensor_make(KVD_DTYPE_F32, vb->k_lambda, 2, ls);
        a->k_hadamard = 1;
        a->v_sub_dim = l->v_sub_dim;
        a->v_bits = l->v_bits;
        a->v_codes = v.codes;
        a->v_codebook = kvd_tensor_make(KVD_DTYPE_F32, vb->v_book, 3, vbs);
        a->k_tail = kvd_tensor_make(KVD_DTYPE_F32, NULL, 3, esh);
        a->v_tail = a->k_tail;
        a->out = to;
        a->lse = tl;
        return;
    }
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

/* Bytes of the tokens q brings outside whole pages (K and V). */
static size_t raw_bytes(const kvd__devq *q)
{
    return 2 * (size_t)q->raw_tokens * (size_t)q->dims.n_kv_heads * (size_t)q->dims.head_dim *
           kvd_dtype_size(q->raw_dtype);
}

/* q's raw tokens into the host image at dst, head-major as in a raw page:
 * K (kv_head, token, dim), then V. */
static void raw_place(const kvd__devq *q, uint8_t *dst)
{
    const size_t H = (size_t)q->dims.n_kv_heads, T = (size_t)q->raw_tokens;
    const size_t row = (size_t)q->dims.head_dim * kvd_dtype_size(q->raw_dtype);
    for (size_t part = 0; part < 2; part++) {
        const uint8_t *src = q->raw + part * T * H * row;
        uint8_t *out = dst + part * T * H * row;
        for (size_t h = 0; h < H; h++)
            for (size_t t = 0; t < T; t++)
                memcpy(out + (h * T + t) * row, src + (t * H + h) * row, row);
    }
}

/* The dense item of q's raw tokens (at raw on the device) into slot. */
static void raw_item(const kvd__devq *q, float *dq, uint8_t *raw, float *slot,
                     kvd_attn_dense_args *a)
{
    const kvd_attn_dims *d = &q->dims;
    int64_t ksh[3] = {d->n_kv_heads, (int64_t)q->raw_tokens, d->head_dim};
    a->dims = *d;
    item_io(d, dq, slot, &a->q, &a->out, &a->lse);
    a->k = kvd_tensor_make(q->raw_dtype, raw, 3, ksh);
    a->v = kvd_tensor_make(q->raw_dtype, raw + raw_bytes(q) / 2, 3, ksh);
}

/* Query i of a device_batch that stands for kv head h of an SVD + INT
 * query (parent >= 0): its q is the parent's projected, its pages the
 * parent's SVD + INT pages, read at head h's block. */
typedef struct sub_head {
    long parent;
    uint32_t h;
} sub_head;

/* The INT item of kv head sh->h of an SVD + INT page, at its widths. */
static void svd_int_item(const kvd_page_handle *ph, const kvd__devq *q, const sub_head *sh,
                         float *dq, float *slot, kvd_attn_int_args *a)
{
    const kvd_page_layout *l = ph->layout;
    const kvd_layer_arts *k = &q->arts->k[q->layer], *v = &q->arts->v[q->layer];
    const int G = q->dims.n_q_heads, rk = q->dims.head_dim, rv = q->dims.v_dim;
    int64_t qs[2] = {G, rk}, os[2] = {G, rv}, ls[1] = {G};
    int64_t kt[3] = {1, 0, rk}, vt[3] = {1, 0, rv};
    a->dims = q->dims;
    a->q = kvd_tensor_make(KVD_DTYPE_F32, dq, 2, qs);
    a->n_tokens = l->num_tokens;
    kvd_page_layout_svd_head(l, ph->device, KVD_SECTION_K, k->widths, sh->h, &a->k);
    kvd_page_layout_svd_head(l, ph->device, KVD_SECTION_V, v->widths, sh->h, &a->v);
    a->k_tail = kvd_tensor_make(KVD_DTYPE_F32, NULL, 3, kt);
    a->v_tail = kvd_tensor_make(KVD_DTYPE_F32, NULL, 3, vt);
    a->out = kvd_tensor_make(KVD_DTYPE_F32, slot, 2, os);
    a->lse = kvd_tensor_make(KVD_DTYPE_F32, slot + (size_t)G * rv, 1, ls);
}

static int device_batch(kvd_backend *dev, kvd__devq *qs, size_t nq, const sub_head *sub,
                        kvd_error *err)
{
    /* Device memory, in floats: per query its q and one slot (out, lse) per
     * page; then every query's result, back to back; then one empty result
     * (out 0, lse -inf) that the last merge takes in. */
    size_t npages = 0, counted = 0, hq_max = 0, of_max = 0, total = 0;
    size_t *off = calloc(4 * nq + 1, sizeof *off); /* q, slots, result, raw tokens of query i */
    vq_books *books = calloc(nq + 1, sizeof *books);
    size_t *m = calloc(nq + 1, sizeof *m); /* slots still to merge */
    kvd_attn_int_args *ia = NULL;
    kvd_attn_dense_args *da = NULL;
    kvd_attn_vq_args *va = NULL;
    kvd_attn_svd_args *sa = NULL;
    kvd_attn_merge_args *ma = NULL;
    float *host = NULL, *buf = NULL;
    int rc = 0;
    if (!off || !m || !books) {
        rc = kvd_error_set(err, KVD_ENOMEM, "out of memory");
        goto done;
    }
    for (size_t i = 0; i < nq; i++) {
        const size_t hq = (size_t)qs[i].dims.n_q_heads, qf = hq * (size_t)qs[i].dims.head_dim;
        const size_t of = hq * (size_t)qs[i].dims.v_dim;
        for (size_t p = 0; p < qs[i].np && sub[i].parent < 0; p++)
            if (qs[i].pages[p].layout->num_kv_heads != (uint32_t)qs[i].dims.n_kv_heads ||
                qs[i].pages[p].layout->head_dim != (uint32_t)qs[i].dims.head_dim) {
                rc = kvd_error_set(
                    err, KVD_EINVAL, "page of %u kv heads x %u dims, attention wants %d x %d",
                    qs[i].pages[p].layout->num_kv_heads, qs[i].pages[p].layout->head_dim,
                    qs[i].dims.n_kv_heads, qs[i].dims.head_dim);
                goto done;
            }
        for (size_t p = 0; p < qs[i].np && sub[i].parent < 0; p++) {
            const kvd_page_layout *l = qs[i].pages[p].layout;
            if ((l->k_codec == KVD_CODEC_VQ && (rc = vq_check(&qs[i], l, &books[i], err))) ||
                (l->k_codec == KVD_CODEC_SVD && (rc = svd_check(&qs[i], l, &books[i], err))))
                goto done;
        }
        const size_t slots = qs[i].np + (qs[i].raw_tokens > 0);
        npages += slots;
        counted += sub[i].parent < 0 || sub[i].h == 0 ? qs[i].np : 0;
        hq_max = hq > hq_max ? hq : hq_max;
        of_max = of > of_max ? of : of_max;
        off[3 * i] = total;
        off[3 * i + 1] = total + qf;
        total += qf + slots * (of + hq);
    }
    const size_t res_base = total;
    for (size_t i = 0; i < nq; i++) {
        off[3 * i + 2] = total;
        total += (size_t)qs[i].dims.n_q_heads * ((size_t)qs[i].dims.v_dim + 1);
    }
    /* The codebooks of the queries with VQ pages, the rotations of those
     * with SVD pages: once per snapshot layer (sequences made from the same
     * artifacts share their parsed snapshot, store/seqcodec.c), however
     * many queries of the call use it. */
    for (size_t i = 0; i < nq; i++) {
        if (books[i].k) {
            size_t j = 0;
            while (j < i && (books[j].k != books[i].k || books[j].v != books[i].v))
                j++;
            books[i].at = j < i ? books[j].at : total;
            books[i].shared = j < i;
            total += j < i ? 0 : books[i].n_lambda + books[i].n_kbook + books[i].n_vbook;
        }
        if (books[i].sk) {
            size_t j = 0;
            while (j < i && (books[j].sk != books[i].sk || books[j].sv != books[i].sv))
                j++;
            books[i].s_at = j < i ? books[j].s_at : total;
            books[i].s_shared = j < i;
            total += j < i ? 0 : 2 * books[i].n_rot;
        }
    }
    /* the tokens of the queries outside whole pages, head-major */
    for (size_t i = 0; i < nq; i++) {
        off[3 * nq + i] = total;
        total += (raw_bytes(&qs[i]) + sizeof(float) - 1) / sizeof(float);
    }
    const size_t empty = total;
    total += of_max + hq_max;
    ia = calloc(npages + 1, sizeof *ia);
    da = calloc(npages + 1, sizeof *da);
    va = calloc(npages + 1, sizeof *va);
    sa = calloc(npages + 1, sizeof *sa);
    ma = calloc(npages + nq + 1, sizeof *ma);
    host = malloc(sizeof(float) * total); /* what goes up, then what comes down */
    if (!ia || !da || !va || !sa || !ma || !host) {
        rc = kvd_error_set(err, KVD_ENOMEM, "out of memory for %zu pages", npages);
        goto done;
    }
    for (size_t i = 0; i < nq; i++)
        memcpy(host + off[3 * i], qs[i].q,
               sizeof(float) * (size_t)qs[i].dims.n_q_heads * (size_t)qs[i].dims.head_dim);
    for (size_t j = 0; j < of_max; j++)
        host[empty + j] = 0.0f;
    for (size_t j = 0; j < hq_max; j++)
        host[empty + of_max + j] = -INFINITY;
    for (size_t i = 0; i < nq; i++)
        if (qs[i].raw_tokens)
            raw_place(&qs[i], (uint8_t *)(host + off[3 * nq + i]));
    if ((rc = kvd_backend_scratch(dev, sizeof(float) * total, (void **)&buf, err)))
        goto done;
    for (size_t i = 0; i < nq; i++) {
        if (books[i].k)
            books_place(&books[i], host, buf);
        if (books[i].sk)
            rotations_place(&books[i], host, buf);
    }
    if ((rc = kvd_backend_upload(dev, buf, host, sizeof(float) * total, err)))
        goto done;
    /* Every page of every query is one item: one launch per kind. */
    size_t ni = 0, nd = 0, nv = 0, ns = 0;
    for (size_t i = 0; i < nq; i++) {
        const kvd_attn_dims *d = &qs[i].dims;
        const size_t sl = (size_t)d->n_q_heads * ((size_t)d->v_dim + 1);
        for (size_t p = 0; p < qs[i].np; p++)
            if (sub[i].parent >= 0)
                svd_int_item(&qs[i].pages[p], &qs[i], &sub[i], buf + off[3 * i],
                             buf + off[3 * i + 1] + p * sl, &ia[ni++]);
            else
                page_item(&qs[i].pages[p], d, buf + off[3 * i], buf + off[3 * i + 1] + p * sl,
                          &books[i], da, &nd, ia, &ni, va, &nv, sa, &ns);
        if (qs[i].raw_tokens)
            raw_item(&qs[i], buf + off[3 * i], (uint8_t *)(buf + off[3 * nq + i]),
                     buf + off[3 * i + 1] + qs[i].np * sl, &da[nd++]);
        m[i] = qs[i].np + (qs[i].raw_tokens > 0);
    }
    if ((rc = kvd_attn_quant(dev, (int)ni, ia, err)) ||
        (rc = kvd_attn_dense(dev, (int)nd, da, err)) || (rc = kvd_attn_vq(dev, (int)nv, va, err)) ||
        (rc = kvd_attn_svd(dev, (int)ns, sa, err)))
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
            const size_t sl = (size_t)d->n_q_heads * ((size_t)d->v_dim + 1);
            float *slots = buf + off[3 * i + 1];
            if (!last && m[i] > 1) {
                size_t half = (m[i] + 1) / 2;
                for (size_t j = 0; j + half < m[i]; j++)
                    merge_item(&ma[n++], d, slots + j * sl, slots + (j + half) * sl, 0,
                               slots + j * sl);
                m[i] = half;
            } else if (last && m[i] == 1) {
                merge_item(&ma[n++], d, slots, buf + empty, of_max, buf + off[3 * i + 2]);
            }
        }
        if ((rc = kvd_attn_merge(dev, (int)n, ma, err)))
            goto done;
    }
    if ((rc = kvd_backend_download(dev, host + res_base, buf + res_base,
                                   sizeof(float) * (empty - res_base), err)))
        goto done;
    for (size_t i = 0; i < nq; i++) {
        const size_t hq = (size_t)qs[i].dims.n_q_heads, qf = hq * (size_t)qs[i].dims.v_dim;
        if (qs[i].np == 0 && qs[i].raw_tokens == 0) {
            memset(qs[i].out, 0, sizeof(float) * qf);
            for (size_t h = 0; h < hq; h++)
                qs[i].lse[h] = -INFINITY;
            continue;
        }
        memcpy(qs[i].out, host + off[3 * i + 2], sizeof(float) * qf);
        memcpy(qs[i].lse, host + off[3 * i + 2] + qf, sizeof(float) * hq);
    }
    atomic_fetch_add(&device_pages, counted);
done:
    kvd_backend_scratch_free(dev, buf);
    free(host);
    free(ia);
    free(da);
    free(va);
    free(sa);
    free(ma);
    free(m);
    free(off);
    free(books);
    return rc;
}

static int is_svd_int(const kvd_page_layout *l)
{
    return l->k_codec == KVD_CODEC_SVD && l->k_svd.codec != KVD_CODEC_RAW;
}

/* (out, lse) of hq heads x dv takes in (ob, lb): the log-sum-exp merge. */
static void merge_host(size_t hq, size_t dv, float *out, float *lse, const float *ob,
                       const float *lb)
{
    for (size_t g = 0; g < hq; g++) {
        const float m = lse[g] > lb[g] ? lse[g] : lb[g];
        if (m == -INFINITY)
            continue;
        const double wa = exp((double)lse[g] - m), wb = exp((double)lb[g] - m), s = wa + wb;
        for (size_t j = 0; j < dv; j++)
            out[g * dv + j] = (float)((wa * out[g * dv + j] + wb * ob[g * dv + j]) / s);
        lse[g] = (float)(m + log(s));
    }
}

/*
 * The SVD + INT pages of a query attend per kv head h, as the CPU does:
 * the query heads of h projected with h's key rotation at its kept width
 * (here, on the host: a few hundred values), the INT kernel over h's block
 * of every page at the reduced widths, the output rotated back with h's
 * value rotation. Each (query, kv head) becomes a query of its own in
 * device_batch, after the queries themselves; their results are rotated
 * back and merged into their query's here.
 */
int kvd__attend_device_batch(kvd_backend *dev, kvd__devq *qs, size_t nq, kvd_error *err)
{
    size_t nsub = 0, nsvd = 0;
    for (size_t i = 0; i < nq; i++)
        for (size_t p = 0; p < qs[i].np; p++)
            if (is_svd_int(qs[i].pages[p].layout)) {
                nsub += (size_t)qs[i].dims.n_kv_heads;
                nsvd += qs[i].np;
                break;
            }
    const size_t na = nq + nsub;
    kvd__devq *all = calloc(na, sizeof *all);
    sub_head *sub = calloc(na, sizeof *sub);
    kvd_page_handle *split = calloc(nsvd + 1, sizeof *split);
    float *work = NULL; /* per sub query: q, out, lse; per query with SVD + INT pages: out, lse */
    size_t nwork = 0;
    int rc = 0;
    if (!all || !sub || !split) {
        rc = kvd_error_set(err, KVD_ENOMEM, "out of memory");
        goto done;
    }
    for (size_t i = 0; i < nq; i++) {
        all[i] = qs[i];
        sub[i].parent = -1;
        const size_t D = (size_t)qs[i].dims.head_dim, hq = (size_t)qs[i].dims.n_q_heads;
        for (size_t p = 0; p < qs[i].np; p++)
            if (is_svd_int(qs[i].pages[p].layout)) {
                nwork += hq * (3 * D + 2) + hq * (D + 1);
                break;
            }
    }
    if (nsub && !(work = malloc(sizeof(float) * nwork))) {
        rc = kvd_error_set(err, KVD_ENOMEM, "out of memory");
        goto done;
    }
    /* Split each query's pages: the others stay its own, its SVD + INT
     * pages (put after them in split) go to its per-head queries. */
    size_t k = nq, at = 0, w = 0;
    for (size_t i = 0; i < nq && rc == 0; i++) {
        kvd_page_handle *mine = split + at;
        size_t nmine = 0, nsv = 0;
        vq_books b;
        memset(&b, 0, sizeof b);
        for (size_t p = 0; p < qs[i].np; p++)
            if (is_svd_int(qs[i].pages[p].layout)) {
                if ((rc = svd_check(&qs[i], qs[i].pages[p].layout, &b, err)))
                    break;
                nsv++;
            }
        if (rc || !nsv)
            continue;
        for (size_t p = 0; p < qs[i].np; p++)
            if (!is_svd_int(qs[i].pages[p].layout))
                mine[nmine++] = qs[i].pages[p];
        for (size_t p = 0; p < qs[i].np; p++)
            if (is_svd_int(qs[i].pages[p].layout))
                mine[nmine++] = qs[i].pages[p];
        at += nmine;
        const size_t nd = nmine - nsv;
        all[i].pages = mine;
        all[i].np = nd;
        const kvd_layer_arts *ka = &qs[i].arts->k[qs[i].layer], *va = &qs[i].arts->v[qs[i].layer];
        const int H = qs[i].dims.n_kv_heads, G = qs[i].dims.n_q_heads / H;
        const int D = qs[i].dims.head_dim;
        for (int h = 0; h < H; h++, k++) {
            const int rk = ka->widths[h], rv = va->widths[h];
            float *q = work + w, *o = q + (size_t)G * rk, *l = o + (size_t)G * rv;
            w += (size_t)G * (rk + rv + 1);
            kvd_cpu_svd_project_fast(ka->rotation + (size_t)h * D * D, D, rk,
                                     qs[i].q + (size_t)h * G * D, KVD_DTYPE_F32, G, (int64_t)D * 4,
                                     q, 1);
            all[k] = (kvd__devq){.dims = {G, 1, rk, rv, qs[i].dims.softmax_scale},
                                 .q = q,
                                 .pages = mine + nd,
                                 .np = nsv,
                                 .out = o,
                                 .lse = l,
                                 .arts = qs[i].arts,
                                 .layer = qs[i].layer};
            sub[k] = (sub_head){(long)i, (uint32_t)h};
        }
    }
    if (rc == 0)
        rc = device_batch(dev, all, na, sub, err);
    /* Rotate each head's output back and merge it into its query's. */
    for (size_t j = nq; j < na && rc == 0;) {
        const size_t i = (size_t)sub[j].parent;
        const int H = qs[i].dims.n_kv_heads, G = qs[i].dims.n_q_heads / H;
        const size_t D = (size_t)qs[i].dims.head_dim, hq = (size_t)qs[i].dims.n_q_heads;
        float *out = work + w, *lse = out + hq * D;
        const kvd_layer_arts *va = &qs[i].arts->v[qs[i].layer];
        for (int h = 0; h < H; h++, j++) {
            const int rv = all[j].dims.v_dim;
            kvd_cpu_svd_unproject_ref(va->rotation + (size_t)h * D * D, (int)D, rv, all[j].out, G,
                                      out + (size_t)h * G * D);
            memcpy(lse + (size_t)h * G, all[j].lse, sizeof(float) * (size_t)G);
        }
        merge_host(hq, D, qs[i].out, qs[i].lse, out, lse);
        w += hq * (D + 1);
    }
done:
    free(all);
    free(sub);
    free(split);
    free(work);
    return rc;
}
