/*
 * AppendPages: pages a client encoded, checked as a whole and appended in
 * one transaction (compute.h):
 *   1. each page decodes with its checksum and its coded sections parse
 *      against its shape (KVD_ECORRUPT); shape, codecs and the raw rule of
 *      partial pages against the sequence (KVD_EINVAL; a VQ/SVD page coded
 *      with other artifacts KVD_EPRECOND);
 *   2. the pages tile one token range on contiguous layers, starting at each
 *      layer's stored token count (KVD_EPRECOND) and the same on every layer;
 *   3. the pages go through the ordinary append transaction, every sealed
 *      page handed over as is: the stored bytes are the client's, except
 *      the PQ section of a sequence with a PQ index, which the store writes
 *      from the decoded keys (store/pqindex.h). Only the tokens the store
 *      reads are decoded: those of partial pages, and with a PQ index all.
 */
#include <stdlib.h>
#include <string.h>

#include "codec.h"
#include "compute_internal.h"
#include "page.h"
#include "seqcodec.h"
#include "validate.h"

typedef struct in_page {
    const uint8_t *bytes;
    size_t len;
    kvd_page_view view;
} in_page;

static int cmp_page(const void *a, const void *b)
{
    const kvd_page_header *x = &((const in_page *)a)->view.h, *y = &((const in_page *)b)->view.h;
    if (x->layer != y->layer)
        return x->layer < y->layer ? -1 : 1;
    return x->token_start < y->token_start ? -1 : x->token_start > y->token_start;
}

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

/* Step 1: every page on its own, against the model and the codecs. */
static int check_each(in_page *pg, size_t n, const kvd_model_info *m, const kvd_seq_codecs *codecs,
                      uint32_t B, kvd_error *err)
{
    const uint64_t sink_end = ((uint64_t)codecs->raw_sink_tokens + B - 1) / B * B;
    int rc;
    for (size_t i = 0; i < n; i++) {
        if ((rc = kvd_page_decode(pg[i].bytes, pg[i].len, &pg[i].view, err)))
            return rc;
        const kvd_page_header *ph = &pg[i].view.h;
        if (ph->num_kv_heads != m->num_kv_heads || ph->head_dim != m->head_dim ||
            ph->dtype != m->dtype || ph->page_tokens != B || ph->layer >= m->num_layers)
            return kvd_error_set(err, KVD_EINVAL,
                                 "pages[%zu]: layer %u, %u kv heads x %u dims, %s, %u-token "
                                 "pages; model %s has %u layers, %u x %u, %s; server pages are %u",
                                 i, ph->layer, ph->num_kv_heads, ph->head_dim,
                                 kvd_dtype_name(ph->dtype), ph->page_tokens, m->name, m->num_layers,
                                 m->num_kv_heads, m->head_dim, kvd_dtype_name(m->dtype), B);
        if (ph->flags & KVD_PAGE_SEALED) {
            int raw_ok = ph->token_start < sink_end;
            if ((rc = codec_matches(&pg[i].view, KVD_SECTION_K, codecs->arts, &codecs->k, raw_ok,
                                    err)) ||
                (rc = codec_matches(&pg[i].view, KVD_SECTION_V, codecs->arts, &codecs->v, raw_ok,
                                    err)))
                return rc;
        } else if (ph->k_codec != KVD_CODEC_RAW || ph->v_codec != KVD_CODEC_RAW) {
            return kvd_error_set(err, KVD_EINVAL, "pages[%zu]: a partial page must be raw", i);
        }
    }
    return 0;
}

/* Step 2: sorted by (layer, token), the pages tile tokens [*t0, *t0 + *n) of
 * layers [*l0, *l0 + *nl), each layer starting at its stored count. */
static int check_tiling(in_page *pg, size_t np, const uint64_t *layer_tokens, uint32_t *l0_out,
                        uint32_t *nl_out, uint64_t *t0_out, uint64_t *n_out, kvd_error *err)
{
    qsort(pg, np, sizeof *pg, cmp_page);
    uint32_t l0 = pg[0].view.h.layer, nl = 0;
    uint64_t t0 = pg[0].view.h.token_start, n = 0;
    size_t i = 0;
    while (i < np) {
        uint32_t l = pg[i].view.h.layer;
        if (l != l0 + nl)
            return kvd_error_set(err, KVD_EINVAL, "pages: layer %u follows layer %u", l,
                                 l0 + nl - 1);
        uint64_t t = t0;
        if (pg[i].view.h.token_start != layer_tokens[l] || layer_tokens[l] != t0)
            return kvd_error_set(err, KVD_EPRECOND,
                                 "pages of layer %u start at token %llu; the layer holds %llu "
                                 "(and every layer must start at %llu)",
                                 l, (unsigned long long)pg[i].view.h.token_start,
                                 (unsigned long long)layer_tokens[l], (unsigned long long)t0);
        for (; i < np && pg[i].view.h.layer == l; i++) {
            if (pg[i].view.h.token_start != t)
                return kvd_error_set(err, KVD_EINVAL,
                                     "pages of layer %u: a page starts at token %llu, expected "
                                     "%llu",
                                     l, (unsigned long long)pg[i].view.h.token_start,
                                     (unsigned long long)t);
            t += pg[i].view.h.num_tokens;
        }
        if (nl == 0)
            n = t - t0;
        else if (t - t0 != n)
            return kvd_error_set(err, KVD_EINVAL, "layer %u gets %llu tokens, layer %u %llu", l,
                                 (unsigned long long)(t - t0), l0, (unsigned long long)n);
        nl++;
    }
    *l0_out = l0;
    *nl_out = nl;
    *t0_out = t0;
    *n_out = n;
    return 0;
}

/* Step 3: the payload of the append, in its order (K then V, each
 * [layer][token][kv_head][head_dim]): the pages' decoded tokens, page by
 * page. The tokens of sealed pages are skipped instead when skip_sealed
 * (the store stores those pages as given and does not read them). */
static int feed_pages(const kvd_compute *c, kvd_append *ap, const in_page *pg, size_t np,
                      const kvd_model_info *m, const kvd_codec_arts *arts, int skip_sealed,
                      kvd_error *err)
{
    const uint32_t B = kvd_store_page_tokens(c->store);
    const size_t es = kvd_dtype_size(m->dtype), row = (size_t)m->num_kv_heads * m->head_dim * es;
    uint8_t *tmp = NULL, *rows = NULL;
    int rc = 0;
    for (int which = 0; which < 2 && rc == 0; which++)
        for (size_t j = 0; j < np && rc == 0; j++) {
            const kvd_page_view *v = &pg[j].view;
            const uint32_t T = v->h.num_tokens, H = v->h.num_kv_heads;
            const size_t hrow = (size_t)v->h.head_dim * es;
            if (skip_sealed && (v->h.flags & KVD_PAGE_SEALED)) {
                rc = kvd_store_append_skip(ap, (size_t)T * row, err);
                continue;
            }
            if (!tmp && (!(tmp = malloc((size_t)B * row)) || !(rows = malloc((size_t)B * row)))) {
                rc = kvd_error_set(err, KVD_ENOMEM, "out of memory");
                break;
            }
            if ((rc = kvd_page_decode_section(kvd_store_coding_backend(c->store), v,
                                              which ? KVD_SECTION_V : KVD_SECTION_K, arts, m->dtype,
                                              tmp, err)))
                break;
            for (uint32_t t = 0; t < T; t++)
                for (uint32_t hh = 0; hh < H; hh++)
                    memcpy(rows + (size_t)t * row + hh * hrow, tmp + ((size_t)hh * T + t) * hrow,
                           hrow);
            rc = kvd_store_append_write(ap, rows, (size_t)T * row, err);
        }
    free(tmp);
    free(rows);
    return rc;
}

int kvd_compute_append_pages(const kvd_compute *c, const kvd_pages_args *a, kvd_seq_info *out,
                             kvd_error *err)
{
    memset(out, 0, sizeof *out);
    int rc;
    if ((rc = kvd_check_key_id(a->id, a->id_len, "header.sequence_id", err)))
        return rc;
    if (a->n == 0)
        return kvd_error_set(err, KVD_EINVAL, "pages: none sent");
    kvd_store *store = c->store;
    const kvd_compute_guard *g = c->guard;
    kvd_seq_info info;
    memset(&info, 0, sizeof info);
    kvd_model_info m;
    kvd_seq_codecs codecs;
    memset(&codecs, 0, sizeof codecs);
    in_page *pg = NULL;
    int found = 0;
    if ((rc = kvd_store_seq_stat(store, a->id, a->id_len, &info, err)))
        return rc;
    if ((g && g->check_model && (rc = g->check_model(g->arg, info.model, err))) ||
        (rc = kvd_store_model_get(store, info.model, &m, err)) ||
        (rc = kvd_store_seq_codecs_get(store, a->id, a->id_len, &codecs, &found, err)) ||
        (found && (rc = kvd_seq_codecs_load_arts(store, a->id, a->id_len, &codecs, err))))
        goto out;
    if (!(pg = calloc(a->n, sizeof *pg))) {
        rc = kvd_error_set(err, KVD_ENOMEM, "out of memory");
        goto out;
    }
    for (size_t i = 0; i < a->n; i++) {
        pg[i].bytes = a->pages[i].bytes;
        pg[i].len = a->pages[i].len;
    }
    const uint32_t B = kvd_store_page_tokens(store);
    uint32_t l0 = 0, nl = 0;
    uint64_t t0 = 0, n = 0;
    if ((rc = check_each(pg, a->n, &m, &codecs, B, err)) ||
        (rc = check_tiling(pg, a->n, info.layer_tokens, &l0, &nl, &t0, &n, err)))
        goto out;
    kvd_append_spec spec = {a->id,
                            a->id_len,
                            l0,
                            nl,
                            t0,
                            n,
                            m.dtype,
                            a->n_token_ids ? a->token_ids : NULL,
                            a->n_token_ids,
                            a->n_block_hashes ? a->block_hashes : NULL,
                            a->n_block_hashes,
                            0};
    kvd_append *ap = NULL;
    uint64_t expected = 0, bound = 0;
    int reserved = 0;
    if ((rc = kvd_store_append_begin(store, &spec, &ap, &expected, err)))
        goto out;
    /* The quota counts the decoded K/V, as for Append, and the PQ centroids
     * the append may train. */
    bound = kvd_store_append_index_bound(ap);
    expected += bound;
    if (!(g && g->reserve) || (rc = g->reserve(g->arg, m.name, expected, err)) == 0)
        reserved = 1;
    for (size_t j = 0; j < a->n && rc == 0; j++) {
        const kvd_page_view *v = &pg[j].view;
        if (v->h.flags & KVD_PAGE_SEALED)
            rc = kvd_store_append_give_page(ap, v->h.layer, v->h.token_start / B, pg[j].bytes,
                                            pg[j].len, err);
    }
    /* Without a PQ index the store keeps sealed pages as sent and never
     * reads their tokens: only partial pages are decoded (they are raw). */
    if (rc == 0)
        rc = feed_pages(c, ap, pg, a->n, &m, codecs.arts, !codecs.pq_m, err);
    if (rc) {
        kvd_store_append_abort(ap);
    } else {
        if (g && g->commit_lock)
            g->commit_lock(g->arg, 1);
        rc = kvd_store_append_commit(ap, out, err);
        if (rc == 0 && reserved && g && g->settle) {
            /* centroids reserved but not trained are given back */
            uint64_t unused = bound > out->pq_bytes_added ? bound - out->pq_bytes_added : 0;
            if (unused && g->release)
                g->release(g->arg, m.name, unused);
            g->settle(g->arg, m.name, expected - unused);
        }
        if (g && g->commit_lock)
            g->commit_lock(g->arg, 0);
    }
    if (rc && reserved && g && g->release)
        g->release(g->arg, m.name, expected);
out:
    free(pg);
    kvd_seq_codecs_clear(&codecs);
    kvd_seq_info_clear(&info);
    return rc;
}
