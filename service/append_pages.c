/*
 * AppendPages: client-streamed pages the client encoded (kvdepot.proto).
 *
 * The pages are collected as they arrive (bounded by max-append-bytes), then
 * checked as a whole when the stream ends, before anything is stored:
 *   - each page decodes with its checksum (else DATA_LOSS) and coded
 *     sections parse against the page's shape (else DATA_LOSS);
 *   - shape: kv heads, head_dim, dtype, page size equal to the model's and
 *     the server's (else INVALID_ARGUMENT);
 *   - codecs: a sealed page carries the sequence's codecs (a raw page only
 *     where the sequence keeps pages raw: raw codecs or sink blocks), a
 *     partial page is raw (else INVALID_ARGUMENT);
 *   - the pages of every layer tile the same token range, starting at the
 *     layer's stored token count, and the layers are contiguous.
 * The decoded tokens then go through the ordinary append transaction, with
 * every sealed page handed over as is: the stored bytes are the client's,
 * except the PQ section of a sequence with a PQ index, which the store
 * writes from the decoded keys (store/pqindex.h), replacing the client's.
 */
#include <stdlib.h>
#include <string.h>

#include "codec.h"
#include "convert.h"
#include "page.h"
#include "rpc.h"
#include "seqcodec.h"
#include "validate.h"

typedef struct ap_page {
    uint8_t *bytes;
    size_t len;
    kvd_page_view view;
} ap_page;

typedef struct pages_state {
    Kvdepot__V1__AppendPagesHeader *hdr; /* from the first message (owned) */
    Kvdepot__V1__AppendPagesRequest *first;
    ap_page *pages;
    size_t n, cap;
    uint64_t bytes;
} pages_state;

static void pages_release(void *state)
{
    pages_state *st = state;
    if (!st)
        return;
    for (size_t i = 0; i < st->n; i++)
        free(st->pages[i].bytes);
    free(st->pages);
    if (st->first)
        protobuf_c_message_free_unpacked(&st->first->base, NULL);
    free(st);
}

static int pages_recv(kvd_req_ctx *ctx, void **state, grpc_byte_buffer *msg, kvd_error *err)
{
    pages_state *st = *state;
    if (!st) {
        st = calloc(1, sizeof *st);
        if (!st)
            return kvd_error_set(err, KVD_ENOMEM, "out of memory");
        *state = st;
    }
    Kvdepot__V1__AppendPagesRequest *m = (Kvdepot__V1__AppendPagesRequest *)kvd_bb_unpack(
        &kvdepot__v1__append_pages_request__descriptor, msg);
    if (!m)
        return kvd_error_set(err, KVD_EINVAL, "message %zu does not parse as AppendPagesRequest",
                             st->n);
    int rc = 0;
    if (!st->first) {
        if (!m->header) {
            protobuf_c_message_free_unpacked(&m->base, NULL);
            return kvd_error_set(err, KVD_EINVAL, "the first message carries no header");
        }
        st->first = m;
        st->hdr = m->header;
    } else if (m->header) {
        rc = kvd_error_set(err, KVD_EINVAL, "header repeated after the first message");
    }
    for (size_t i = 0; rc == 0 && i < m->n_pages; i++) {
        st->bytes += m->pages[i].len;
        if (st->bytes > ctx->svc->cfg->max_append_bytes) {
            rc = kvd_error_set(err, KVD_ENOMEM, "pages exceed max-append-bytes (%llu)",
                               (unsigned long long)ctx->svc->cfg->max_append_bytes);
            break;
        }
        if (st->n == st->cap) {
            size_t nc = st->cap ? 2 * st->cap : 16;
            ap_page *np = realloc(st->pages, nc * sizeof *np);
            if (!np) {
                rc = kvd_error_set(err, KVD_ENOMEM, "out of memory");
                break;
            }
            st->pages = np;
            st->cap = nc;
        }
        ap_page *p = &st->pages[st->n];
        memset(p, 0, sizeof *p);
        p->bytes = malloc(m->pages[i].len ? m->pages[i].len : 1);
        if (!p->bytes) {
            rc = kvd_error_set(err, KVD_ENOMEM, "out of memory");
            break;
        }
        memcpy(p->bytes, m->pages[i].data, m->pages[i].len);
        p->len = m->pages[i].len;
        st->n++;
    }
    if (m != st->first)
        protobuf_c_message_free_unpacked(&m->base, NULL);
    return rc;
}

static int cmp_page(const void *a, const void *b)
{
    const kvd_page_header *x = &((const ap_page *)a)->view.h, *y = &((const ap_page *)b)->view.h;
    if (x->layer != y->layer)
        return x->layer < y->layer ? -1 : 1;
    return x->token_start < y->token_start ? -1 : x->token_start > y->token_start;
}

/* Does the section of a sealed page carry the codec the sequence asks for? */
/* Does the section of a sealed page carry the codec the sequence asks for?
 * VQ and SVD sections are also checked against the sequence's artifact
 * snapshot (fingerprint, widths): a page coded with other artifacts is
 * KVD_EPRECOND. */
static int codec_matches(const kvd_page_view *v, int which, const kvd_codec_arts *arts,
                         const kvd_codec_spec *want, int raw_ok, kvd_error *err)
{
    const char *w = which == KVD_SECTION_K ? "K" : "V";
    const unsigned want_codec = want->svd ? KVD_CODEC_SVD : want->codec;
    const unsigned got = which == KVD_SECTION_K ? v->h.k_codec : v->h.v_codec;
    /* Another codec than the sequence's is a bad argument whatever the
     * section holds; only then are its bytes and artifacts checked. */
    if (got != want_codec && !(got == KVD_CODEC_RAW && raw_ok))
        return kvd_error_set(err, KVD_EINVAL,
                             "page of layer %u tokens %llu+%u: %s codec %u is not the "
                             "sequence's (%u)",
                             v->h.layer, (unsigned long long)v->h.token_start, v->h.num_tokens, w,
                             got, want_codec);
    kvd_codec_section *cs = malloc(sizeof *cs);
    if (!cs)
        return kvd_error_set(err, KVD_ENOMEM, "out of memory");
    int rc = kvd_codec_section_parse(v, which, arts, cs, err);
    if (rc) {
        free(cs);
        return rc == KVD_EUNSUPP ? kvd_error_set(err, KVD_EINVAL, "%s", err ? err->msg : "") : rc;
    }
    const int is_int = want->codec == KVD_CODEC_INT2 || want->codec == KVD_CODEC_INT4;
    const int inner = cs->codec == KVD_CODEC_SVD ? cs->inner : cs->codec;
    if (cs->codec == KVD_CODEC_RAW && (raw_ok || want_codec == KVD_CODEC_RAW))
        rc = 0;
    else if (cs->codec != want_codec || inner != want->codec ||
             (is_int && (cs->group != want->group || cs->axis != want->axis)))
        rc = kvd_error_set(err, KVD_EINVAL,
                           "page of layer %u tokens %llu+%u: %s codec %u/%d (group %d, axis %d) "
                           "is not the sequence's (codec %u/%u, group %u, axis %u)",
                           v->h.layer, (unsigned long long)v->h.token_start, v->h.num_tokens, w,
                           cs->codec, inner, cs->group, cs->axis, want_codec, want->codec,
                           want->group, want->axis);
    free(cs);
    return rc;
}

static int pages_finish(kvd_req_ctx *ctx, void **state, grpc_byte_buffer **reply,
                        kvd_error *err)
{
    pages_state *st = *state;
    if (!st || !st->hdr)
        return kvd_error_set(err, KVD_EINVAL, "empty AppendPages stream");
    const Kvdepot__V1__AppendPagesHeader *h = st->hdr;
    int rc;
    if ((rc = kvd_check_seq_id(h->sequence_id.data, h->sequence_id.len, "header.sequence_id",
                               err)))
        return rc;
    if (st->n == 0)
        return kvd_error_set(err, KVD_EINVAL, "pages: none sent");
    kvd_store *store = ctx->svc->store;
    kvd_seq_info info;
    memset(&info, 0, sizeof info);
    kvd_model_info m;
    kvd_seq_codecs codecs;
    memset(&codecs, 0, sizeof codecs);
    int found = 0;
    if ((rc = kvd_store_seq_stat(store, h->sequence_id.data, h->sequence_id.len, &info, err)))
        return rc;
    if ((rc = kvd_ctx_check_model(ctx, info.model, err)) ||
        (rc = kvd_store_model_get(store, info.model, &m, err)) ||
        (rc = kvd_store_seq_codecs_get(store, h->sequence_id.data, h->sequence_id.len, &codecs,
                                       &found, err)) ||
        (found && (rc = kvd_seq_codecs_load_arts(store, h->sequence_id.data,
                                                 h->sequence_id.len, &codecs, err))))
        goto out;
    const uint32_t B = ctx->svc->page_tokens;
    const uint64_t sink_end = ((uint64_t)codecs.raw_sink_tokens + B - 1) / B * B;
    /* 1. every page on its own */
    for (size_t i = 0; i < st->n; i++) {
        ap_page *p = &st->pages[i];
        if ((rc = kvd_page_decode(p->bytes, p->len, &p->view, err)))
            goto out;
        const kvd_page_header *ph = &p->view.h;
        if (ph->num_kv_heads != m.num_kv_heads || ph->head_dim != m.head_dim ||
            ph->dtype != m.dtype || ph->page_tokens != B || ph->layer >= m.num_layers) {
            rc = kvd_error_set(err, KVD_EINVAL,
                               "pages[%zu]: layer %u, %u kv heads x %u dims, %s, %u-token pages; "
                               "model %s has %u layers, %u x %u, %s; server pages are %u",
                               i, ph->layer, ph->num_kv_heads, ph->head_dim,
                               kvd_dtype_name(ph->dtype), ph->page_tokens, m.name, m.num_layers,
                               m.num_kv_heads, m.head_dim, kvd_dtype_name(m.dtype), B);
            goto out;
        }
        if (ph->flags & KVD_PAGE_SEALED) {
            int raw_ok = ph->token_start < sink_end;
            if ((rc = codec_matches(&p->view, KVD_SECTION_K, codecs.arts, &codecs.k, raw_ok,
                                    err)) ||
                (rc = codec_matches(&p->view, KVD_SECTION_V, codecs.arts, &codecs.v, raw_ok,
                                    err)))
                goto out;
        } else if (ph->k_codec != KVD_CODEC_RAW || ph->v_codec != KVD_CODEC_RAW) {
            rc = kvd_error_set(err, KVD_EINVAL, "pages[%zu]: a partial page must be raw", i);
            goto out;
        }
    }
    /* 2. the pages tile one token range on contiguous layers */
    qsort(st->pages, st->n, sizeof *st->pages, cmp_page);
    uint32_t l0 = st->pages[0].view.h.layer, nl = 0;
    uint64_t t0 = st->pages[0].view.h.token_start, n = 0;
    size_t i = 0;
    while (i < st->n) {
        uint32_t l = st->pages[i].view.h.layer;
        if (l != l0 + nl) {
            rc = kvd_error_set(err, KVD_EINVAL, "pages: layer %u follows layer %u", l,
                               l0 + nl - 1);
            goto out;
        }
        uint64_t t = t0;
        if (st->pages[i].view.h.token_start != info.layer_tokens[l] || info.layer_tokens[l] != t0) {
            rc = kvd_error_set(err, KVD_EPRECOND,
                               "pages of layer %u start at token %llu; the layer holds %llu "
                               "(and every layer must start at %llu)",
                               l, (unsigned long long)st->pages[i].view.h.token_start,
                               (unsigned long long)info.layer_tokens[l], (unsigned long long)t0);
            goto out;
        }
        for (; i < st->n && st->pages[i].view.h.layer == l; i++) {
            if (st->pages[i].view.h.token_start != t) {
                rc = kvd_error_set(err, KVD_EINVAL,
                                   "pages of layer %u: a page starts at token %llu, expected %llu",
                                   l, (unsigned long long)st->pages[i].view.h.token_start,
                                   (unsigned long long)t);
                goto out;
            }
            t += st->pages[i].view.h.num_tokens;
        }
        if (nl == 0)
            n = t - t0;
        else if (t - t0 != n) {
            rc = kvd_error_set(err, KVD_EINVAL, "layer %u gets %llu tokens, layer %u %llu", l,
                               (unsigned long long)(t - t0), l0, (unsigned long long)n);
            goto out;
        }
        nl++;
    }
    /* 3. decoded tokens into the wire layout, then the append transaction */
    const size_t es = kvd_dtype_size(m.dtype), row = (size_t)m.num_kv_heads * m.head_dim * es;
    const size_t half = (size_t)nl * n * row;
    uint8_t *wire = malloc(2 * half), *tmp = malloc((size_t)B * row);
    kvd_append *ap = NULL;
    if (!wire || !tmp) {
        free(wire);
        free(tmp);
        rc = kvd_error_set(err, KVD_ENOMEM, "out of memory");
        goto out;
    }
    for (size_t j = 0; j < st->n && rc == 0; j++) {
        const kvd_page_view *v = &st->pages[j].view;
        uint32_t T = v->h.num_tokens, H = v->h.num_kv_heads;
        size_t hrow = (size_t)v->h.head_dim * es;
        for (int which = 0; which < 2 && rc == 0; which++) {
            if ((rc = kvd_page_decode_section(kvd_store_coding_backend(ctx->svc->store), v,
                                              which ? KVD_SECTION_V : KVD_SECTION_K, codecs.arts,
                                              m.dtype, tmp, err)))
                break;
            uint8_t *dst = wire + (size_t)which * half +
                           ((size_t)(v->h.layer - l0) * n + (v->h.token_start - t0)) * row;
            for (uint32_t t = 0; t < T; t++)
                for (uint32_t hh = 0; hh < H; hh++)
                    memcpy(dst + (size_t)t * row + hh * hrow, tmp + ((size_t)hh * T + t) * hrow,
                           hrow);
        }
    }
    free(tmp);
    kvd_append_spec spec = {h->sequence_id.data, h->sequence_id.len, l0, nl, t0, n, m.dtype,
                            h->n_token_ids ? h->token_ids : NULL, h->n_token_ids,
                            h->n_block_hashes ? h->block_hashes : NULL, h->n_block_hashes, 0};
    uint64_t expected = 0;
    int reserved = 0;
    if (rc == 0 && (rc = kvd_store_append_begin(store, &spec, &ap, &expected, err)) == 0) {
        /* Quota counts the decoded K/V, as for Append. */
        if ((rc = kvd_ctx_quota_reserve(ctx, m.name, 0, expected, err)) == 0)
            reserved = 1;
        for (size_t j = 0; j < st->n && rc == 0; j++) {
            const kvd_page_view *v = &st->pages[j].view;
            if (v->h.flags & KVD_PAGE_SEALED)
                rc = kvd_store_append_give_page(ap, v->h.layer, v->h.token_start / B,
                                                st->pages[j].bytes, st->pages[j].len, err);
        }
        if (rc == 0)
            rc = kvd_store_append_write(ap, wire, 2 * half, err);
        if (rc) {
            kvd_store_append_abort(ap);
        } else {
            kvd_seq_info_clear(&info);
            rc = kvd_store_append_commit(ap, &info, err);
        }
        if (rc && reserved)
            kvd_quota_release(ctx->auth, m.name, 0, expected);
    }
    free(wire);
    if (rc == 0) {
        Kvdepot__V1__SequenceInfo si;
        kvd_seq_info_to_pb(&info, &si);
        Kvdepot__V1__AppendPagesResponse resp = KVDEPOT__V1__APPEND_PAGES_RESPONSE__INIT;
        resp.sequence = &si;
        resp.pages_received = st->n;
        resp.bytes_received = st->bytes;
        *reply = kvd_pack(&resp.base);
        if (!*reply)
            rc = kvd_error_set(err, KVD_ENOMEM, "out of memory packing the reply");
    }
out:
    kvd_seq_codecs_clear(&codecs);
    kvd_seq_info_clear(&info);
    return rc;
}

const kvd_stream_ops kvd_append_pages_ops = {
    .recv = pages_recv,
    .finish = pages_finish,
    .release = pages_release,
};
