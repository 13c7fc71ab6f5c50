/*
 * Raw tail pages and their fragments.
 *
 * Rewriting a whole tail page for every decode step would write up to a full
 * page per layer per token. Instead an append that leaves a tail page still
 * partial stores only the new tokens, as a tail fragment: a page in the same
 * format whose token_start lies inside the block, under the key
 *     'T' be64(page_id) be32(offset of its first token in the block)
 * so the fragments of one page sort in token order right after each other.
 * The tail page proper (the "base", key 'P' be64(page_id)) plus its
 * fragments tile the block's stored tokens without gap. Once a page has
 * KVD__MAX_FRAGS fragments, or an append fills the block, the next append
 * merges base and fragments into one page written under the same id and
 * deletes the fragments, in the same WriteBatch.
 */
#include "store_internal.h"

#include <stdlib.h>
#include <string.h>

void kvd__frag_key(uint8_t key[KVD__FRAG_KEY_LEN], uint64_t page_id, uint32_t off)
{
    key[0] = KVD__KEY_FRAG;
    for (int i = 0; i < 8; i++)
        key[1 + i] = (uint8_t)(page_id >> (56 - 8 * i));
    for (int i = 0; i < 4; i++)
        key[9 + i] = (uint8_t)(off >> (24 - 8 * i));
}

void kvd__frag_delete_all(rocksdb_writebatch_t *b, uint64_t page_id)
{
    uint8_t lo[KVD__FRAG_KEY_LEN], hi[KVD__FRAG_KEY_LEN];
    kvd__frag_key(lo, page_id, 0);
    kvd__frag_key(hi, page_id, UINT32_MAX);
    rocksdb_writebatch_delete_range(b, (const char *)lo, sizeof lo, (const char *)hi, sizeof hi);
    rocksdb_writebatch_delete(b, (const char *)hi, sizeof hi);
}

void kvd__tail_release(kvd__tail *t)
{
    if (t->ps)
        rocksdb_pinnableslice_destroy(t->ps);
    free(t->buf);
    memset(t, 0, sizeof *t);
}

/* Check that a decoded page or fragment is what the page table says. */
static int check_piece(const kvd_page_view *v, const kvd__tail_want *w, uint64_t start,
                       const char *what, kvd_error *err)
{
    if (v->h.layer != w->layer || v->h.token_start != start || v->h.page_tokens != w->B ||
        v->h.num_kv_heads != w->H || v->h.head_dim != w->D || v->h.dtype != w->dtype)
        return kvd_error_set(err, KVD_ECORRUPT,
                             "%s of page %llu does not hold layer %u tokens from %llu in this "
                             "shape",
                             what, (unsigned long long)w->page_id, w->layer,
                             (unsigned long long)start);
    /* Coded sections occur only in sealed pages, which never have fragments;
     * their readers decode them (codec.h). */
    if ((v->h.k_codec != KVD_CODEC_RAW || v->h.v_codec != KVD_CODEC_RAW) &&
        !(v->h.flags & KVD_PAGE_SEALED))
        return kvd_error_set(err, KVD_EUNSUPP,
                             "%s of page %llu uses a codec this build "
                             "cannot decode",
                             what, (unsigned long long)w->page_id);
    return 0;
}

int kvd__tail_load(kvd_store *st, const rocksdb_readoptions_t *ro, const kvd__tail_want *w,
                   kvd__tail *out, kvd_error *err)
{
    memset(out, 0, sizeof *out);
    uint8_t key[KVD__PAGE_KEY_LEN];
    kvd__page_key(key, w->page_id);
    char *e = NULL;
    out->ps = rocksdb_get_pinned(st->db, ro, (const char *)key, sizeof key, &e);
    if (e) {
        /* A damaged file (a checksum that fails) or a missing one (a blob
         * file deleted or lost) loses this page's bytes: DATA_LOSS for it,
         * not an outage. Other errors (descriptors, I/O) may pass. */
        int lost = strstr(e, "Corruption") || strstr(e, "No such file or directory");
        int rc = kvd_error_set(err, lost ? KVD_ECORRUPT : KVD_EINTERNAL,
                               lost ? "page %llu is unreadable, a file of the store is damaged or "
                                      "missing: %s"
                                    : "rocksdb read of page %llu failed: %s",
                               (unsigned long long)w->page_id, e);
        rocksdb_free(e);
        return rc;
    }
    if (!out->ps)
        return kvd_error_set(err, KVD_ECORRUPT, "page %llu (layer %u, tokens from %llu) is missing",
                             (unsigned long long)w->page_id, w->layer, (unsigned long long)w->p0);
    size_t len;
    const char *bytes = rocksdb_pinnableslice_value(out->ps, &len);
    kvd_page_view base;
    int rc = kvd_page_decode(bytes, len, &base, err);
    if (!rc)
        rc = check_piece(&base, w, w->p0, "base", err);
    if (rc) {
        kvd__tail_release(out);
        return rc;
    }
    out->k = base.k;
    out->v = base.v;
    out->num_tokens = base.h.num_tokens;
    out->base_tokens = base.h.num_tokens;
    if (out->num_tokens >= w->need)
        return 0;

    /* Gather the fragments in token order; each is verified like a page. */
    size_t row = (size_t)w->D * kvd_dtype_size(w->dtype);
    size_t cap_tokens = w->B;
    out->buf = malloc(2 * cap_tokens * w->H * row);
    if (!out->buf) {
        kvd__tail_release(out);
        return kvd_error_set(err, KVD_ENOMEM, "out of memory assembling a tail page");
    }
    uint8_t *K = out->buf, *V = out->buf + cap_tokens * w->H * row;
    uint32_t n = out->num_tokens;
    for (uint32_t h = 0; h < w->H; h++) {
        memcpy(K + (size_t)h * cap_tokens * row, base.k + (size_t)h * n * row, n * row);
        memcpy(V + (size_t)h * cap_tokens * row, base.v + (size_t)h * n * row, n * row);
    }
    uint8_t lo[KVD__FRAG_KEY_LEN], hi[KVD__FRAG_KEY_LEN];
    kvd__frag_key(lo, w->page_id, 0);
    kvd__frag_key(hi, w->page_id, UINT32_MAX);
    rocksdb_readoptions_t *iro = rocksdb_readoptions_create();
    /* Same snapshot as the caller's reads, bounded to this page's fragments. */
    if (w->snap)
        rocksdb_readoptions_set_snapshot(iro, w->snap);
    rocksdb_readoptions_set_iterate_upper_bound(iro, (const char *)hi, sizeof hi);
    rocksdb_readoptions_set_verify_checksums(iro, 0);
    rocksdb_iterator_t *it = rocksdb_create_iterator(st->db, iro);
    uint32_t nfrags = 0;
    for (rocksdb_iter_seek(it, (const char *)lo, sizeof lo); rocksdb_iter_valid(it) && n < w->need;
         rocksdb_iter_next(it)) {
        size_t klen, vlen;
        const char *k = rocksdb_iter_key(it, &klen);
        const char *v = rocksdb_iter_value(it, &vlen);
        kvd_page_view fv;
        uint8_t want_key[KVD__FRAG_KEY_LEN];
        kvd__frag_key(want_key, w->page_id, n);
        if (klen != sizeof want_key || memcmp(k, want_key, klen) != 0) {
            rc = kvd_error_set(err, KVD_ECORRUPT,
                               "tail fragments of page %llu do not continue at token %u",
                               (unsigned long long)w->page_id, n);
            break;
        }
        if ((rc = kvd_page_decode(v, vlen, &fv, err)) ||
            (rc = check_piece(&fv, w, w->p0 + n, "tail fragment", err)))
            break;
        if (nfrags == KVD__MAX_FRAGS) {
            rc = kvd_error_set(err, KVD_ECORRUPT, "page %llu has more than %d tail fragments",
                               (unsigned long long)w->page_id, KVD__MAX_FRAGS);
            break;
        }
        out->frag_off[nfrags] = n;
        uint32_t fn = fv.h.num_tokens; /* n + fn <= B: checked by the decoder */
        for (uint32_t h = 0; h < w->H; h++) {
            memcpy(K + ((size_t)h * cap_tokens + n) * row, fv.k + (size_t)h * fn * row, fn * row);
            memcpy(V + ((size_t)h * cap_tokens + n) * row, fv.v + (size_t)h * fn * row, fn * row);
        }
        n += fn;
        nfrags++;
    }
    if (!rc) {
        char *ie = NULL;
        rocksdb_iter_get_error(it, &ie);
        if (ie) {
            rc = kvd_error_set(err, KVD_EINTERNAL, "rocksdb scan of tail fragments failed: %s", ie);
            rocksdb_free(ie);
        }
    }
    rocksdb_iter_destroy(it);
    rocksdb_readoptions_destroy(iro);
    if (!rc && n < w->need)
        rc = kvd_error_set(err, KVD_ECORRUPT, "page %llu of layer %u holds %u tokens, %u expected",
                           (unsigned long long)w->page_id, w->layer, n, w->need);
    if (rc) {
        kvd__tail_release(out);
        return rc;
    }
    /* Compact the heads from the B-token stride to n tokens, the layout of
     * a page section, so callers index every loaded page the same way. */
    for (uint32_t h = 1; h < w->H; h++)
        memmove(K + (size_t)h * n * row, K + (size_t)h * cap_tokens * row, n * row);
    for (uint32_t h = 0; h < w->H; h++)
        memmove(K + ((size_t)w->H + h) * n * row, V + (size_t)h * cap_tokens * row, n * row);
    out->k = K;
    out->v = K + (size_t)w->H * n * row;
    out->num_tokens = n;
    out->nfrags = nfrags;
    return 0;
}
