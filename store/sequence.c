/*
 * Sequences: records, create/stat/list/delete, and recovery at open.
 *
 * Sequence record (key 'S' id), little-endian:
 *   u8  version (2)
 *   u8  model_len, model name
 *   u64 created_unix_ms
 *   u64 prefix_blocks
 *   u32 num_layers
 *   u64 n_hashes, then n_hashes x u64   block hashes 0..n_hashes-1
 *   u64 n_ids,    then n_ids x u32      token ids from token n_hashes*B on
 *   per layer: u64 tokens, u32 npages, then npages x (u64 page id,
 *              u64 page bytes)
 * npages must be ceil(tokens / B); page i of a layer covers tokens
 * [i*B, min((i+1)*B, tokens)). Page bytes are the page's stored size,
 * tail fragments included (kvd__page.bytes), so that stored_bytes and the
 * disk count survive a restart without reading the pages (coded pages are
 * smaller than raw ones). Version 1 records (page ids only) still read;
 * their pages count at the raw size of their tokens until the next append
 * rewrites the record.
 */
#include "pqindex.h"
#include "seqcodec.h"
#include "store_internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define SEQ_RECORD_VERSION 2

/* ---- little helpers ---------------------------------------------------- */

typedef struct wbuf {
    uint8_t *p;
    size_t n, cap;
    int oom;
} wbuf;

static void wb_reserve(wbuf *w, size_t more)
{
    if (w->oom || w->n + more <= w->cap)
        return;
    size_t nc = w->cap ? w->cap : 256;
    while (nc < w->n + more)
        nc *= 2;
    uint8_t *np = realloc(w->p, nc);
    if (!np) {
        w->oom = 1;
        return;
    }
    w->p = np;
    w->cap = nc;
}
static void wb_bytes(wbuf *w, const void *d, size_t n)
{
    wb_reserve(w, n);
    if (!w->oom) {
        memcpy(w->p + w->n, d, n);
        w->n += n;
    }
}
static void wb_uint(wbuf *w, uint64_t v, int nbytes)
{
    uint8_t b[8];
    for (int i = 0; i < nbytes; i++)
        b[i] = (uint8_t)(v >> (8 * i));
    wb_bytes(w, b, (size_t)nbytes);
}

typedef struct rbuf {
    const uint8_t *p;
    size_t n, off;
    int bad;
} rbuf;

static uint64_t rb_uint(rbuf *r, int nbytes)
{
    if (r->bad || r->n - r->off < (size_t)nbytes) {
        r->bad = 1;
        return 0;
    }
    uint64_t v = 0;
    for (int i = 0; i < nbytes; i++)
        v |= (uint64_t)r->p[r->off + i] << (8 * i);
    r->off += (size_t)nbytes;
    return v;
}

/* A count of `elem`-byte items that must fit in the rest of the record. */
static uint64_t rb_count(rbuf *r, int nbytes, size_t elem)
{
    uint64_t n = rb_uint(r, nbytes);
    if (!r->bad && n > (r->n - r->off) / elem)
        r->bad = 1;
    return r->bad ? 0 : n;
}

int kvd__check_seq_id(const void *id, size_t len, kvd_error *err)
{
    if (!id || len == 0)
        return kvd_error_set(err, KVD_EINVAL, "sequence id is empty");
    if (len > KVD_SEQ_ID_MAX)
        return kvd_error_set(err, KVD_EINVAL, "sequence id longer than %d bytes (%zu)",
                             KVD_SEQ_ID_MAX, len);
    return 0;
}

const char *kvd__id_str(const void *id, size_t len, char *out, size_t cap)
{
    const uint8_t *p = id;
    size_t o = 0;
    out[o++] = '"';
    for (size_t i = 0; i < len; i++) {
        /* Room for this byte (up to 4), the closing quote, "..." and NUL. */
        if (o + 4 + 5 > cap) {
            memcpy(out + o, "\"...", 4);
            o += 4;
            out[o] = '\0';
            return out;
        }
        if (p[i] >= 0x20 && p[i] < 0x7f && p[i] != '"' && p[i] != '\\')
            out[o++] = (char)p[i];
        else
            o += (size_t)snprintf(out + o, cap - o, "\\x%02x", p[i]);
    }
    out[o++] = '"';
    out[o] = '\0';
    return out;
}

static int id_cmp(const void *a, size_t alen, const void *b, size_t blen)
{
    int c = memcmp(a, b, alen < blen ? alen : blen);
    if (c)
        return c;
    return alen < blen ? -1 : alen > blen;
}

kvd__seq *kvd__seq_find(kvd_store *st, const void *id, size_t id_len, size_t *pos)
{
    size_t lo = 0, hi = st->nseqs;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        int c = id_cmp(st->seqs[mid]->id, st->seqs[mid]->id_len, id, id_len);
        if (c == 0) {
            if (pos)
                *pos = mid;
            return st->seqs[mid];
        }
        if (c < 0)
            lo = mid + 1;
        else
            hi = mid;
    }
    if (pos)
        *pos = lo;
    return NULL;
}

static int seq_insert(kvd_store *st, kvd__seq *s, size_t pos)
{
    if (st->nseqs == st->cap_seqs) {
        size_t nc = st->cap_seqs ? 2 * st->cap_seqs : 64;
        kvd__seq **ns = realloc(st->seqs, nc * sizeof *ns);
        if (!ns)
            return KVD_ENOMEM;
        st->seqs = ns;
        st->cap_seqs = nc;
    }
    memmove(st->seqs + pos + 1, st->seqs + pos, (st->nseqs - pos) * sizeof *st->seqs);
    st->seqs[pos] = s;
    st->nseqs++;
    return 0;
}

void kvd__seq_key(const kvd__seq *s, uint8_t *key, size_t *klen)
{
    key[0] = KVD__KEY_SEQ;
    memcpy(key + 1, s->id, s->id_len);
    *klen = s->id_len + 1;
}

/* Free a sequence's memory. Its pages are not touched: they belong to the
 * store's refcounting. */
void kvd__seq_free(kvd__seq *s)
{
    if (!s)
        return;
    for (uint32_t l = 0; l < s->num_layers && s->layers; l++)
        free(s->layers[l].pages);
    free(s->layers);
    free(s->hashes);
    free(s->ids);
    free(s->act_tokens);
    pthread_mutex_destroy(&s->mu);
    free(s);
}

void kvd__seq_unref(kvd__seq *s)
{
    if (s && atomic_fetch_sub(&s->refs, 1) == 1)
        kvd__seq_free(s);
}

static kvd__seq *seq_alloc(const void *id, size_t id_len, kvd__model *m)
{
    kvd__seq *s = calloc(1, sizeof *s);
    if (!s)
        return NULL;
    s->layers = calloc(m->info.num_layers, sizeof *s->layers);
    if (!s->layers) {
        free(s);
        return NULL;
    }
    memcpy(s->id, id, id_len);
    s->id_len = id_len;
    s->model = m;
    s->num_layers = m->info.num_layers;
    pthread_mutex_init(&s->mu, NULL);
    atomic_init(&s->refs, 1);
    atomic_init(&s->expires_ms, 0);
    atomic_init(&s->last_access_ms, kvd__now_ms());
    return s;
}

int kvd__seq_encode(const kvd_store *st, const kvd__seq *s, const kvd__layer *layers,
                    const uint64_t *hashes, uint64_t n_hashes, const uint32_t *ids, uint64_t n_ids,
                    uint8_t **buf, size_t *len, kvd_error *err)
{
    (void)st;
    wbuf w = {0};
    size_t ml = strlen(s->model->info.name);
    wb_uint(&w, SEQ_RECORD_VERSION, 1);
    wb_uint(&w, ml, 1);
    wb_bytes(&w, s->model->info.name, ml);
    wb_uint(&w, s->created_ms, 8);
    wb_uint(&w, s->prefix_blocks, 8);
    wb_uint(&w, s->num_layers, 4);
    wb_uint(&w, n_hashes, 8);
    for (uint64_t i = 0; i < n_hashes; i++)
        wb_uint(&w, hashes[i], 8);
    wb_uint(&w, n_ids, 8);
    for (uint64_t i = 0; i < n_ids; i++)
        wb_uint(&w, ids[i], 4);
    for (uint32_t l = 0; l < s->num_layers; l++) {
        wb_uint(&w, layers[l].tokens, 8);
        wb_uint(&w, layers[l].npages, 4);
        for (uint32_t i = 0; i < layers[l].npages; i++) {
            wb_uint(&w, layers[l].pages[i]->id, 8);
            wb_uint(&w, layers[l].pages[i]->bytes, 8);
        }
    }
    if (w.oom) {
        free(w.p);
        *buf = NULL;
        return kvd_error_set(err, KVD_ENOMEM, "out of memory encoding a sequence record");
    }
    *buf = w.p;
    *len = w.n;
    return 0;
}

/* Page bytes of a page of n tokens in model m. */
static uint64_t page_bytes(const kvd__model *m, uint32_t page_tokens, uint32_t n)
{
    kvd_page_desc d = {.dtype = m->info.dtype,
                       .num_tokens = n,
                       .page_tokens = page_tokens,
                       .num_kv_heads = m->info.num_kv_heads,
                       .head_dim = m->info.head_dim};
    return kvd_page_raw_size(&d);
}

int64_t kvd__seq_record_tokens(const uint8_t *v, size_t vlen)
{
    rbuf r = {v, vlen, 0, 0};
    uint64_t ver = rb_uint(&r, 1);
    if (ver != SEQ_RECORD_VERSION && ver != 1)
        return -2;
    uint64_t ml = rb_count(&r, 1, 1);
    r.off += ml;
    rb_uint(&r, 8); /* created */
    rb_uint(&r, 8); /* prefix blocks */
    uint32_t nl = (uint32_t)rb_uint(&r, 4);
    r.off += rb_count(&r, 8, 8) * 8; /* block hashes */
    r.off += rb_count(&r, 8, 4) * 4; /* token ids */
    uint64_t min = UINT64_MAX;
    const size_t per = ver == 1 ? 8 : 16;
    for (uint32_t l = 0; l < nl && !r.bad; l++) {
        uint64_t t = rb_uint(&r, 8);
        r.off += rb_count(&r, 4, per) * per;
        if (t < min)
            min = t;
    }
    return r.bad || r.off != r.n || nl == 0 || min > INT64_MAX ? -2 : (int64_t)min;
}

int kvd__seq_fill_info(kvd_store *st, const kvd__seq *s, kvd_seq_info *out, kvd_error *err)
{
    memset(out, 0, sizeof *out);
    memcpy(out->id, s->id, s->id_len);
    out->id_len = s->id_len;
    snprintf(out->model, sizeof out->model, "%s", s->model->info.name);
    out->num_layers = s->num_layers;
    out->page_tokens = st->page_tokens;
    out->created_unix_ms = s->created_ms;
    out->prefix_blocks = s->prefix_blocks;
    out->layer_tokens = malloc(s->num_layers * sizeof *out->layer_tokens);
    if (!out->layer_tokens)
        return kvd_error_set(err, KVD_ENOMEM, "out of memory");
    uint64_t min = UINT64_MAX;
    for (uint32_t l = 0; l < s->num_layers; l++) {
        const kvd__layer *L = &s->layers[l];
        out->layer_tokens[l] = L->tokens;
        if (L->tokens < min)
            min = L->tokens;
        for (uint32_t i = 0; i < L->npages; i++) {
            if (L->pages[i]->num_tokens == st->page_tokens)
                out->sealed_pages++;
            out->stored_bytes += L->pages[i]->bytes;
        }
    }
    out->num_tokens = min;
    kvd__act_info(s, &out->activation_tokens, &out->activation_bytes);
    out->stores_activations = s->act_tokens != NULL;
    out->stored_bytes += out->activation_bytes;
    for (uint32_t l = 0; l < s->num_layers; l++)
        out->pq_bytes += s->layers[l].pq.bytes;
    out->stored_bytes += out->pq_bytes;
    /* Complete blocks with a known hash are all in the prefix index (this
     * sequence's copy or an identical one registered first). */
    uint64_t nb = s->registered_blocks;
    if (nb) {
        out->block_hashes = malloc(nb * sizeof *out->block_hashes);
        if (!out->block_hashes) {
            free(out->layer_tokens);
            out->layer_tokens = NULL;
            return kvd_error_set(err, KVD_ENOMEM, "out of memory");
        }
        memcpy(out->block_hashes, s->hashes, nb * sizeof *out->block_hashes);
        out->n_block_hashes = nb;
    }
    return 0;
}

void kvd_seq_info_clear(kvd_seq_info *info)
{
    if (!info)
        return;
    free(info->layer_tokens);
    free(info->block_hashes);
    info->layer_tokens = NULL;
    info->block_hashes = NULL;
    info->n_block_hashes = 0;
}

/* ---- create ------------------------------------------------------------- */

int kvd_store_seq_create(kvd_store *st, const void *id, size_t id_len, const char *model,
                         const uint64_t *prefix_hashes, size_t n_prefix,
                         const uint32_t *prefix_token_ids, size_t n_prefix_token_ids,
                         kvd_seq_info *out, kvd_error *err)
{
    return kvd_store_seq_create_ex(st, id, id_len, model, prefix_hashes, n_prefix,
                                   prefix_token_ids, n_prefix_token_ids, NULL, out, err);
}

/*
 * One RocksDB write creates the sequence: its record, and from opts its
 * codec record with the reference on a shared artifact snapshot (the
 * snapshot itself when it is the first), its expiry record and its
 * activation counts. The snapshot is built first, without st->lock (it
 * reads the model's artifacts); then, under st->lock exclusive, the batch is
 * filled, the reference counts are read and stay locked (refs_mu, after
 * st->lock as in a delete) until the write, and the sequence enters the map
 * only for that write: nobody sees it before it succeeded, and a failure
 * takes it out again with nothing written and no reference taken.
 */
int kvd_store_seq_create_ex(kvd_store *st, const void *id, size_t id_len, const char *model,
                            const uint64_t *prefix_hashes, size_t n_prefix,
                            const uint32_t *prefix_token_ids, size_t n_prefix_token_ids,
                            const kvd_seq_create_opts *opts, kvd_seq_info *out,
                            kvd_error *err)
{
    if (out)
        memset(out, 0, sizeof *out);
    int rc = kvd__check_seq_id(id, id_len, err);
    if (rc)
        return rc;
    if (!st || !model || !model[0])
        return kvd_error_set(err, KVD_EINVAL, "sequence create: model name is empty");
    if (n_prefix && !prefix_hashes)
        return kvd_error_set(err, KVD_EINVAL, "sequence create: prefix hashes are NULL");
    static const kvd_seq_create_opts no_opts;
    if (!opts)
        opts = &no_opts;
    if (opts->store_activations && n_prefix)
        return kvd_error_set(err, KVD_EINVAL,
                             "sequence create: activations must start at token 0, not with a "
                             "prefix");
    uint32_t B = st->page_tokens;
    if (n_prefix_token_ids) {
        if (!prefix_token_ids)
            return kvd_error_set(err, KVD_EINVAL, "sequence create: prefix token ids are NULL");
        if (n_prefix_token_ids != (uint64_t)n_prefix * B)
            return kvd_error_set(err, KVD_EINVAL,
                                 "%zu prefix token ids given; %zu prefix blocks of %u tokens "
                                 "need %llu",
                                 n_prefix_token_ids, n_prefix, B, (unsigned long long)n_prefix * B);
        uint64_t parent = 0;
        for (size_t i = 0; i < n_prefix; i++) {
            parent = kvd_prefix_hash(parent, prefix_token_ids + i * B, B);
            if (parent != prefix_hashes[i])
                return kvd_error_set(err, KVD_EINVAL,
                                     "prefix token ids of block %zu hash to %016llx, not the "
                                     "given %016llx",
                                     i, (unsigned long long)parent,
                                     (unsigned long long)prefix_hashes[i]);
        }
    }
    if (st->max_seq_tokens && (uint64_t)n_prefix * B > st->max_seq_tokens)
        return kvd_error_set(err, KVD_ENOMEM, "prefix of %llu tokens exceeds the limit of %llu",
                             (unsigned long long)n_prefix * B,
                             (unsigned long long)st->max_seq_tokens);

    /* VQ / SVD: snapshot the model's artifacts of this moment (the codec
     * record names it by content), before st->lock. */
    kvd_model_info mi;
    uint8_t *arts = NULL;
    size_t arts_len = 0;
    uint64_t arts_hash = 0;
    if (opts->codecs && kvd_seq_codecs_need_arts(opts->codecs) &&
        ((rc = kvd_store_model_get(st, model, &mi, err)) ||
         (rc = kvd__seq_codecs_snapshot(st, &mi, opts->codecs, &arts, &arts_len, &arts_hash,
                                        err))))
        return rc;
    kvd__pending *pend = NULL;
    if (opts->pending && !(pend = kvd__pending_new(id, id_len))) {
        free(arts);
        return kvd_error_set(err, KVD_ENOMEM, "out of memory creating a sequence");
    }

    pthread_rwlock_wrlock(&st->lock);
    kvd__model *m = kvd__model_find(st, model);
    size_t pos;
    kvd__seq *s = NULL;
    kvd__prefix **ents = NULL;
    uint8_t *rec = NULL;
    size_t rlen = 0;
    uint64_t *act_counts = NULL;
    rocksdb_writebatch_t *b = NULL;
    int refs_locked = 0;
    if (!m) {
        rc = kvd_error_set(err, KVD_ENOTFOUND, "model %s not found", model);
        goto out;
    }
    if (arts && (m->info.num_layers != mi.num_layers || m->info.num_kv_heads != mi.num_kv_heads ||
                 m->info.head_dim != mi.head_dim)) {
        rc = kvd_error_set(err, KVD_EPRECOND,
                           "model %s changed shape while the sequence was created", model);
        goto out;
    }
    if (opts->store_activations && !m->info.hidden_size) {
        rc = kvd_error_set(err, KVD_EPRECOND,
                           "model %s has no hidden_size: activations cannot be stored", model);
        goto out;
    }
    if (kvd__seq_find(st, id, id_len, &pos)) {
        char idb[KVD__ID_STR_MAX];
        rc = kvd_error_set(err, KVD_EEXIST, "sequence %s already exists",
                           kvd__id_str(id, id_len, idb, sizeof idb));
        goto out;
    }
    ents = n_prefix ? malloc(n_prefix * sizeof *ents) : NULL;
    if (n_prefix && !ents) {
        rc = kvd_error_set(err, KVD_ENOMEM, "out of memory");
        goto out;
    }
    for (size_t i = 0; i < n_prefix; i++) {
        ents[i] = kvd__map_get(&m->prefixes, prefix_hashes[i]);
        if (!ents[i] || ents[i]->block != i) {
            rc = kvd_error_set(err, KVD_ENOTFOUND,
                               "prefix block %zu (hash %016llx) is not stored for model %s", i,
                               (unsigned long long)prefix_hashes[i], model);
            goto out;
        }
    }
    s = seq_alloc(id, id_len, m);
    if (!s)
        goto oom;
    s->created_ms = kvd__now_ms();
    s->prefix_blocks = n_prefix;
    if (n_prefix) {
        s->hashes = malloc(n_prefix * sizeof *s->hashes);
        if (!s->hashes)
            goto oom;
        memcpy(s->hashes, prefix_hashes, n_prefix * sizeof *s->hashes);
        s->n_hashes = s->cap_hashes = n_prefix;
        s->registered_blocks = n_prefix;
        for (uint32_t l = 0; l < s->num_layers; l++) {
            kvd__layer *L = &s->layers[l];
            L->pages = malloc(n_prefix * sizeof *L->pages);
            if (!L->pages)
                goto oom;
            L->cap = L->npages = (uint32_t)n_prefix;
            L->tokens = (uint64_t)n_prefix * B;
            for (size_t i = 0; i < n_prefix; i++)
                L->pages[i] = ents[i]->pages[l];
        }
    }
    if ((rc = kvd__seq_encode(st, s, s->layers, s->hashes, s->n_hashes, NULL, 0, &rec, &rlen, err)))
        goto out;
    uint8_t key[1 + KVD_SEQ_ID_MAX];
    size_t klen;
    kvd__seq_key(s, key, &klen);
    b = rocksdb_writebatch_create();
    rocksdb_writebatch_put(b, (const char *)key, klen, (const char *)rec, rlen);
    uint64_t expires = opts->ttl_ms ? kvd__now_ms() + opts->ttl_ms : 0;
    if (opts->ttl_ms)
        kvd__expiry_put(b, s, opts->ttl_ms, expires);
    if (opts->store_activations && (rc = kvd__act_enable_stage(b, s, &act_counts, err)))
        goto out;
    /* Last: from here the reference counts stay locked until the write. */
    if (opts->codecs) {
        if ((rc = kvd__seq_codecs_stage(st, b, id, id_len, opts->codecs, arts, arts_len,
                                        arts_hash, err)))
            goto out;
        refs_locked = 1;
    }
    if (seq_insert(st, s, pos))
        goto oom;
    rc = kvd__db_write(st, b, err);
    if (refs_locked)
        kvd__seq_arts_release_done();
    refs_locked = 0;
    if (rc) {
        memmove(st->seqs + pos, st->seqs + pos + 1, (st->nseqs - pos - 1) * sizeof *st->seqs);
        st->nseqs--;
        goto out;
    }
    /* Durable: publish the expiry and activation counts, and take the
     * references on the shared pages. */
    s->ttl_ms = opts->ttl_ms;
    atomic_store(&s->expires_ms, expires);
    s->act_tokens = act_counts;
    act_counts = NULL;
    for (uint32_t l = 0; l < s->num_layers; l++)
        for (uint32_t i = 0; i < s->layers[l].npages; i++)
            s->layers[l].pages[i]->refs++;
    m->nseqs++;
    if (pend) { /* under st->lock: a backup sees it pending or not made */
        pend->created_ms = s->created_ms;
        kvd__pending_add(st, pend);
    }
    pend = NULL;
    if (out)
        rc = kvd__seq_fill_info(st, s, out, err);
    s = NULL;
    goto out;
oom:
    rc = kvd_error_set(err, KVD_ENOMEM, "out of memory creating a sequence");
out:
    if (refs_locked)
        kvd__seq_arts_release_done();
    pthread_rwlock_unlock(&st->lock);
    if (b)
        rocksdb_writebatch_destroy(b);
    if (s)
        kvd__seq_free(s);
    free(act_counts);
    free(ents);
    free(rec);
    free(arts);
    free(pend);
    return rc;
}

int kvd_store_seq_stat(kvd_store *st, const void *id, size_t id_len, kvd_seq_info *out,
                       kvd_error *err)
{
    if (out)
        memset(out, 0, sizeof *out);
    int rc = kvd__check_seq_id(id, id_len, err);
    if (rc)
        return rc;
    if (!st || !out)
        return kvd_error_set(err, KVD_EINVAL, "sequence stat: NULL argument");
    pthread_rwlock_rdlock(&st->lock);
    kvd__seq *s = kvd__seq_find(st, id, id_len, NULL);
    char idb[KVD__ID_STR_MAX];
    if (!s)
        rc = kvd_error_set(err, KVD_ENOTFOUND, "sequence %s not found",
                           kvd__id_str(id, id_len, idb, sizeof idb));
    else if ((rc = kvd__seq_fill_info(st, s, out, err)) == 0)
        out->recovery_loss = kvd__loss_get(st, id, id_len, &out->loss_acknowledged,
                                           &out->loss_recovered, &out->loss_at_unix_ms);
    pthread_rwlock_unlock(&st->lock);
    return rc;
}

int kvd_store_seq_list(kvd_store *st, const char *model, const void *after, size_t after_len,
                       size_t limit, kvd_seq_info **out, size_t *n, int *more, kvd_error *err)
{
    *out = NULL;
    *n = 0;
    if (more)
        *more = 0;
    if (after && after_len > KVD_SEQ_ID_MAX)
        return kvd_error_set(err, KVD_EINVAL, "list: page token longer than %d bytes",
                             KVD_SEQ_ID_MAX);
    if (limit == 0)
        limit = SIZE_MAX;
    int rc = 0;
    pthread_rwlock_rdlock(&st->lock);
    kvd__model *m = NULL;
    if (model && model[0]) {
        m = kvd__model_find(st, model);
        if (!m) {
            pthread_rwlock_unlock(&st->lock);
            return kvd_error_set(err, KVD_ENOTFOUND, "model %s not found", model);
        }
    }
    size_t start = 0;
    if (after && after_len) {
        if (kvd__seq_find(st, after, after_len, &start))
            start++;
    }
    size_t cap = 0, k = 0;
    kvd_seq_info *arr = NULL;
    size_t i = start;
    for (; i < st->nseqs; i++) {
        kvd__seq *s = st->seqs[i];
        if (m && s->model != m)
            continue;
        if (k == limit) {
            if (more)
                *more = 1;
            break;
        }
        if (k == cap) {
            size_t nc = cap ? 2 * cap : 16;
            if (nc > limit)
                nc = limit;
            kvd_seq_info *na = realloc(arr, nc * sizeof *na);
            if (!na) {
                rc = kvd_error_set(err, KVD_ENOMEM, "out of memory listing sequences");
                break;
            }
            arr = na;
            cap = nc;
        }
        if ((rc = kvd__seq_fill_info(st, s, &arr[k], err)))
            break;
        k++;
    }
    pthread_rwlock_unlock(&st->lock);
    if (rc) {
        for (size_t j = 0; j < k; j++)
            kvd_seq_info_clear(&arr[j]);
        free(arr);
        if (more)
            *more = 0;
        return rc;
    }
    *out = arr;
    *n = k;
    return 0;
}

int kvd__seq_acquire(kvd_store *st, const void *id, size_t id_len, kvd__seq **out,
                     kvd_error *err)
{
    *out = NULL;
    int rc = kvd__check_seq_id(id, id_len, err);
    if (rc)
        return rc;
    pthread_rwlock_rdlock(&st->lock);
    kvd__seq *s = kvd__seq_find(st, id, id_len, NULL);
    if (s)
        atomic_fetch_add(&s->refs, 1);
    pthread_rwlock_unlock(&st->lock);
    char idb[KVD__ID_STR_MAX];
    if (!s)
        return kvd_error_set(err, KVD_ENOTFOUND, "sequence %s not found",
                             kvd__id_str(id, id_len, idb, sizeof idb));
    *out = s;
    return 0;
}

/* ---- delete ------------------------------------------------------------- */

/* unchanged: delete only a sequence still as kvd_store_seq_delete_unchanged
 * describes it (NULL = any). */
static int seq_delete(kvd_store *st, const void *id, size_t id_len, const kvd_seq_info *unchanged,
                      uint64_t *freed_pages, kvd_error *err)
{
    if (freed_pages)
        *freed_pages = 0;
    kvd__seq *s;
    int rc = kvd__seq_acquire(st, id, id_len, &s, err);
    if (rc)
        return rc;
    char idb[KVD__ID_STR_MAX];

    pthread_mutex_lock(&s->mu);
    pthread_rwlock_wrlock(&st->lock);
    if (s->dead) {
        rc = kvd_error_set(err, KVD_ENOTFOUND, "sequence %s not found",
                           kvd__id_str(id, id_len, idb, sizeof idb));
        goto out;
    }
    if (unchanged) {
        uint64_t tokens = 0;
        for (uint32_t l = 0; l < s->num_layers; l++)
            tokens += s->layers[l].tokens;
        if (s->created_ms != unchanged->created_unix_ms || tokens != unchanged->num_tokens) {
            rc = kvd_error_set(err, KVD_EPRECOND, "sequence %s changed; not deleted",
                               kvd__id_str(id, id_len, idb, sizeof idb));
            goto out;
        }
    }
    /* A page is freed when this sequence holds its last reference; every
     * page appears once in one sequence's tables, so refs == 1 says it. */
    uint64_t npages = 0, nfree = 0;
    for (uint32_t l = 0; l < s->num_layers; l++)
        npages += s->layers[l].npages;
    uint64_t *dropped = malloc((npages ? npages : 1) * sizeof *dropped);
    if (!dropped) {
        rc = kvd_error_set(err, KVD_ENOMEM, "out of memory");
        goto out;
    }
    rocksdb_writebatch_t *b = rocksdb_writebatch_create();
    /* Codec record, own artifact snapshot, reference on a shared one. */
    if ((rc = kvd__seq_arts_release(st, b, s->id, s->id_len, err))) {
        rocksdb_writebatch_destroy(b);
        free(dropped);
        goto out;
    }
    uint8_t key[1 + KVD_SEQ_ID_MAX];
    size_t klen;
    kvd__seq_key(s, key, &klen);
    rocksdb_writebatch_delete(b, (const char *)key, klen);
    if (s->ttl_ms)
        kvd__expiry_delete(b, s);
    kvd__pq_delete(b, s); /* PQ centroids (pqindex.h) */
    kvd__act_delete(b, s);
    kvd__loss_delete(b, s); /* what a WAL recovery dropped of it (walscan.c) */
    for (uint32_t l = 0; l < s->num_layers; l++) {
        for (uint32_t i = 0; i < s->layers[l].npages; i++) {
            kvd__page *p = s->layers[l].pages[i];
            if (p->refs == 1) {
                uint8_t pk[KVD__PAGE_KEY_LEN];
                kvd__page_key(pk, p->id);
                rocksdb_writebatch_delete(b, (const char *)pk, sizeof pk);
                if (p->nfrags)
                    kvd__frag_delete_all(b, p->id);
                nfree++;
            }
        }
    }
    rc = kvd__db_write(st, b, err);
    kvd__seq_arts_release_done();
    rocksdb_writebatch_destroy(b);
    if (rc) {
        free(dropped);
        goto out;
    }
    kvd__act_forget(st, s);
    kvd__pq_forget(st, s);
    kvd__model *m = s->model;
    size_t ndropped = 0;
    for (uint32_t l = 0; l < s->num_layers; l++) {
        for (uint32_t i = 0; i < s->layers[l].npages; i++)
            kvd__page_drop(st, m, s->layers[l].pages[i], dropped, &ndropped);
        s->layers[l].npages = 0;
    }
    size_t pos;
    if (kvd__seq_find(st, s->id, s->id_len, &pos) == s) {
        memmove(st->seqs + pos, st->seqs + pos + 1, (st->nseqs - pos - 1) * sizeof *st->seqs);
        st->nseqs--;
    }
    m->nseqs--;
    s->dead = 1;
    kvd__prefix_reregister(st, m, dropped, ndropped);
    free(dropped);
    kvd__seq_unref(s); /* the map's reference */
    if (freed_pages)
        *freed_pages = nfree;
out:
    pthread_rwlock_unlock(&st->lock);
    pthread_mutex_unlock(&s->mu);
    kvd__seq_unref(s);
    return rc;
}

int kvd_store_seq_delete(kvd_store *st, const void *id, size_t id_len, uint64_t *freed_pages,
                         kvd_error *err)
{
    return seq_delete(st, id, id_len, NULL, freed_pages, err);
}

int kvd_store_seq_delete_unchanged(kvd_store *st, const void *id, size_t id_len,
                                   uint64_t created_unix_ms, uint64_t tokens, kvd_error *err)
{
    kvd_seq_info was = {.created_unix_ms = created_unix_ms, .num_tokens = tokens};
    return seq_delete(st, id, id_len, &was, NULL, err);
}

/* ---- recovery ------------------------------------------------------------ */

static int load_one(kvd_store *st, const uint8_t *key, size_t klen, const uint8_t *v, size_t vlen,
                    kvd__map *pages, uint64_t *max_page, kvd_error *err)
{
    uint32_t B = st->page_tokens;
    rbuf r = {v, vlen, 0, 0};
    size_t id_len = klen - 1;
    if (id_len == 0 || id_len > KVD_SEQ_ID_MAX)
        return kvd_error_set(err, KVD_ECORRUPT, "sequence key of %zu bytes", klen);
    uint64_t ver = rb_uint(&r, 1);
    if (ver != SEQ_RECORD_VERSION && ver != 1)
        return kvd_error_set(err, KVD_ECORRUPT, "sequence record with unknown version");
    uint64_t ml = rb_uint(&r, 1);
    char name[KVD_MODEL_NAME_MAX + 1] = {0};
    if (r.bad || ml == 0 || ml > KVD_MODEL_NAME_MAX || vlen - r.off < ml)
        return kvd_error_set(err, KVD_ECORRUPT, "sequence record: bad model name");
    memcpy(name, v + r.off, ml);
    r.off += ml;
    kvd__model *m = kvd__model_find(st, name);
    if (!m)
        return kvd_error_set(err, KVD_ECORRUPT, "sequence record names unknown model %s", name);
    kvd__seq *s = seq_alloc(key + 1, id_len, m);
    if (!s)
        return kvd_error_set(err, KVD_ENOMEM, "out of memory loading sequences");
    s->created_ms = rb_uint(&r, 8);
    s->prefix_blocks = rb_uint(&r, 8);
    uint32_t nl = (uint32_t)rb_uint(&r, 4);
    if (!r.bad && nl != m->info.num_layers)
        r.bad = 1;
    s->n_hashes = s->cap_hashes = rb_count(&r, 8, 8);
    if (s->n_hashes) {
        if (!(s->hashes = malloc(s->n_hashes * 8)))
            goto oom;
        for (uint64_t i = 0; i < s->n_hashes; i++)
            s->hashes[i] = rb_uint(&r, 8);
    }
    s->n_ids = s->cap_ids = rb_count(&r, 8, 4);
    if (s->n_ids) {
        if (!(s->ids = malloc(s->n_ids * 4)))
            goto oom;
        for (uint64_t i = 0; i < s->n_ids; i++)
            s->ids[i] = (uint32_t)rb_uint(&r, 4);
    }
    for (uint32_t l = 0; l < s->num_layers && !r.bad; l++) {
        kvd__layer *L = &s->layers[l];
        L->tokens = rb_uint(&r, 8);
        uint64_t np = rb_count(&r, 4, ver == 1 ? 8 : 16);
        if (r.bad || np != (L->tokens + B - 1) / B) {
            r.bad = 1;
            break;
        }
        L->npages = L->cap = (uint32_t)np;
        if (np && !(L->pages = calloc(np, sizeof *L->pages)))
            goto oom;
        for (uint32_t i = 0; i < np; i++) {
            uint64_t pid = rb_uint(&r, 8);
            uint64_t left = L->tokens - (uint64_t)i * B;
            uint32_t nt = left < B ? (uint32_t)left : B;
            uint64_t pbytes = ver == 1 ? page_bytes(m, B, nt) : rb_uint(&r, 8);
            if (pbytes == 0) {
                r.bad = 1;
                break;
            }
            kvd__page *p = kvd__map_get(pages, pid);
            if (p) {
                /* Shared pages are sealed blocks at the same position, of
                 * one size (a version 1 record knows only the raw one). */
                if (p->num_tokens != B || nt != B) {
                    r.bad = 1;
                    break;
                }
                if (ver != 1)
                    p->bytes = pbytes;
            } else {
                if (!(p = calloc(1, sizeof *p)) || kvd__map_put(pages, pid, p)) {
                    free(p);
                    goto oom;
                }
                p->id = pid;
                p->num_tokens = nt;
                p->bytes = pbytes;
                /* Found, and merged, at the next append to the layer. */
                p->nfrags = nt < B ? KVD__FRAGS_UNKNOWN : 0;
            }
            p->refs++;
            L->pages[i] = p;
            if (pid > *max_page)
                *max_page = pid;
        }
    }
    if (r.bad || r.off != r.n) {
        /* Drop the references taken so far; the caller frees orphan pages. */
        for (uint32_t l = 0; l < s->num_layers; l++)
            for (uint32_t i = 0; i < s->layers[l].npages; i++)
                if (s->layers[l].pages[i])
                    s->layers[l].pages[i]->refs--;
        kvd__seq_free(s);
        return kvd_error_set(err, KVD_ECORRUPT, "sequence record is malformed (%zu bytes)", vlen);
    }
    if (seq_insert(st, s, st->nseqs)) /* keys arrive in id order */
        goto oom;
    m->nseqs++;
    return 0;
oom:
    for (uint32_t l = 0; l < s->num_layers; l++)
        for (uint32_t i = 0; i < s->layers[l].npages; i++)
            if (s->layers[l].pages[i])
                s->layers[l].pages[i]->refs--;
    kvd__seq_free(s);
    return kvd_error_set(err, KVD_ENOMEM, "out of memory loading sequences");
}

/* Salvage: a sequence record that does not load is deleted and listed. */
static int salvage_drop(kvd_store *st, const char *key, size_t klen, kvd_error *err)
{
    kvd_recovery_loss *nl = realloc(st->losses, (st->nlosses + 1) * sizeof *nl);
    if (!nl)
        return kvd_error_set(err, KVD_ENOMEM, "out of memory");
    st->losses = nl;
    kvd_recovery_loss *l = &st->losses[st->nlosses++];
    memset(l, 0, sizeof *l);
    l->kind = KVD_LOSS_UNREADABLE;
    l->id_len = klen - 1 < KVD_SEQ_ID_MAX ? klen - 1 : KVD_SEQ_ID_MAX;
    memcpy(l->id, key + 1, l->id_len);
    char *e = NULL;
    rocksdb_delete(st->db, st->wopt, key, klen, &e);
    if (!e)
        return 0;
    int rc = kvd_error_set(err, KVD_EINTERNAL, "deleting an unreadable sequence record: %s", e);
    rocksdb_free(e);
    return rc;
}

int kvd__load_sequences(kvd_store *st, kvd_error *err)
{
    kvd__map pages = {0};
    uint64_t max_page = 0;
    int rc = 0;
    char start = KVD__KEY_SEQ;
    kvd__scan sc;
    rocksdb_iterator_t *it = kvd__scan_open(st, &sc, &start, 1);
    for (rocksdb_iter_seek(it, &start, 1); rocksdb_iter_valid(it); rocksdb_iter_next(it)) {
        size_t klen, vlen;
        const char *k = rocksdb_iter_key(it, &klen);
        if (klen == 0 || k[0] != KVD__KEY_SEQ)
            break;
        const char *v = rocksdb_iter_value(it, &vlen);
        if ((rc = load_one(st, (const uint8_t *)k, klen, (const uint8_t *)v, vlen, &pages,
                           &max_page, err))) {
            if (rc != KVD_ECORRUPT || !st->salvage || (rc = salvage_drop(st, k, klen, err)))
                break;
        }
    }
    if (!rc) {
        char *e = NULL;
        rocksdb_iter_get_error(it, &e);
        if (e) {
            rc = kvd_error_set(err, KVD_EINTERNAL, "rocksdb scan of sequences failed: %s", e);
            rocksdb_free(e);
        }
    }
    kvd__scan_close(&sc);
    /* Pages now belong to the sequences; free those left unreferenced by a
     * failed load. */
    uint64_t disk = 0, ndisk = 0;
    for (size_t i = 0; i < pages.cap; i++) {
        kvd__page *p = pages.vals[i];
        if (p && p->refs == 0)
            free(p);
        else if (p) {
            disk += p->bytes;
            ndisk++;
        }
    }
    atomic_store(&st->disk_bytes, disk);
    atomic_store(&st->disk_pages, ndisk);
    kvd__map_free(&pages);
    if (rc)
        return rc;
    atomic_init(&st->next_page_id, max_page + 1);
    for (size_t i = 0; i < st->nseqs; i++)
        kvd__prefix_register(st, st->seqs[i]);
    return 0;
}
