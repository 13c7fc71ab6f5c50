/*
 * Activation storage (activation.h): records, the Append and delete hooks,
 * recovery, and the cursor an activation-first Read streams X from.
 */
#include <stdlib.h>
#include <string.h>

#define XXH_STATIC_LINKING_ONLY
#include <xxhash.h>

#include "activation.h"
#include "store_internal.h"

#define META_VERSION 1
#define DATA_PREFIX_MAX (1 + 2 + KVD_SEQ_ID_MAX)
#define DATA_KEY_MAX (DATA_PREFIX_MAX + 4 + 8)
#define SUM_BYTES 8

/* 'A' be16 id_len id: the key range of one sequence's data records. */
static size_t data_prefix(uint8_t *key, const uint8_t *id, size_t id_len)
{
    key[0] = KVD__KEY_ACT;
    key[1] = (uint8_t)(id_len >> 8);
    key[2] = (uint8_t)id_len;
    memcpy(key + 3, id, id_len);
    return 3 + id_len;
}

static size_t data_key(uint8_t *key, const uint8_t *id, size_t id_len, uint32_t layer,
                       uint64_t token)
{
    size_t n = data_prefix(key, id, id_len);
    for (int i = 0; i < 4; i++)
        key[n++] = (uint8_t)(layer >> (24 - 8 * i));
    for (int i = 0; i < 8; i++)
        key[n++] = (uint8_t)(token >> (56 - 8 * i));
    return n;
}

static size_t meta_key(uint8_t *key, const uint8_t *id, size_t id_len)
{
    key[0] = KVD__KEY_ACT_META;
    memcpy(key + 1, id, id_len);
    return 1 + id_len;
}

static uint64_t x_sum(const uint8_t *x, size_t len, uint32_t layer, uint64_t token)
{
    return XXH3_64bits_withSeed(x, len, ((uint64_t)layer << 48) ^ token);
}

uint64_t kvd__act_token_bytes(const kvd__seq *s)
{
    const kvd_model_info *m = &s->model->info;
    return (uint64_t)m->hidden_size * kvd_dtype_size(m->dtype);
}

void kvd__act_info(const kvd__seq *s, uint64_t *tokens, uint64_t *bytes)
{
    *tokens = 0;
    *bytes = 0;
    if (!s->act_tokens)
        return;
    uint64_t min = UINT64_MAX, sum = 0;
    for (uint32_t l = 0; l < s->num_layers; l++) {
        if (s->act_tokens[l] < min)
            min = s->act_tokens[l];
        sum += s->act_tokens[l];
    }
    *tokens = s->num_layers ? min : 0;
    *bytes = sum * kvd__act_token_bytes(s);
}

/* The meta record of s with the counts `counts` into b. */
static int put_meta(rocksdb_writebatch_t *b, const kvd__seq *s, const uint64_t *counts,
                    kvd_error *err)
{
    size_t len = 5 + 8 * (size_t)s->num_layers;
    uint8_t *rec = malloc(len);
    if (!rec)
        return kvd_error_set(err, KVD_ENOMEM, "out of memory");
    rec[0] = META_VERSION;
    for (int i = 0; i < 4; i++)
        rec[1 + i] = (uint8_t)(s->num_layers >> (8 * i));
    for (uint32_t l = 0; l < s->num_layers; l++)
        for (int i = 0; i < 8; i++)
            rec[5 + 8 * (size_t)l + i] = (uint8_t)(counts[l] >> (8 * i));
    uint8_t key[1 + KVD_SEQ_ID_MAX];
    size_t klen = meta_key(key, s->id, s->id_len);
    rocksdb_writebatch_put(b, (const char *)key, klen, (const char *)rec, len);
    free(rec);
    return 0;
}

int kvd__act_enable_stage(rocksdb_writebatch_t *b, const kvd__seq *s, uint64_t **counts,
                          kvd_error *err)
{
    *counts = calloc(s->num_layers ? s->num_layers : 1, sizeof **counts);
    if (!*counts)
        return kvd_error_set(err, KVD_ENOMEM, "out of memory");
    int rc = put_meta(b, s, *counts, err);
    if (rc) {
        free(*counts);
        *counts = NULL;
    }
    return rc;
}

int kvd_store_seq_activations_enable(kvd_store *st, const void *id, size_t id_len, kvd_error *err)
{
    char idb[KVD__ID_STR_MAX];
    kvd__seq *s;
    int rc = kvd__seq_acquire(st, id, id_len, &s, err);
    if (rc)
        return rc;
    pthread_mutex_lock(&s->mu);
    uint64_t *counts = NULL;
    rocksdb_writebatch_t *b = NULL;
    if (s->dead) {
        rc = kvd_error_set(err, KVD_ENOTFOUND, "sequence %s not found",
                           kvd__id_str(id, id_len, idb, sizeof idb));
        goto out;
    }
    if (!s->model->info.hidden_size) {
        rc = kvd_error_set(err, KVD_EPRECOND,
                           "model %s has no hidden_size: activations cannot be stored",
                           s->model->info.name);
        goto out;
    }
    if (s->act_tokens)
        goto out; /* already on */
    for (uint32_t l = 0; l < s->num_layers; l++)
        if (s->layers[l].tokens) {
            rc = kvd_error_set(err, KVD_EPRECOND,
                               "sequence %s already holds %llu tokens on layer %u; activations "
                               "must start at token 0",
                               kvd__id_str(id, id_len, idb, sizeof idb),
                               (unsigned long long)s->layers[l].tokens, l);
            goto out;
        }
    b = rocksdb_writebatch_create();
    if ((rc = kvd__act_enable_stage(b, s, &counts, err)) || (rc = kvd__db_write(st, b, err)))
        goto out;
    pthread_rwlock_wrlock(&st->lock);
    s->act_tokens = counts;
    counts = NULL;
    pthread_rwlock_unlock(&st->lock);
out:
    if (b)
        rocksdb_writebatch_destroy(b);
    free(counts);
    pthread_mutex_unlock(&s->mu);
    kvd__seq_unref(s);
    return rc;
}

int kvd__act_check(const kvd__seq *s, uint32_t ls, uint32_t nl, uint64_t ts, uint64_t n,
                   uint64_t *x_bytes, kvd_error *err)
{
    char idb[KVD__ID_STR_MAX];
    if (!s->act_tokens)
        return kvd_error_set(err, KVD_EPRECOND,
                             "with_activations: sequence %s was not created with "
                             "store_activations",
                             kvd__id_str(s->id, s->id_len, idb, sizeof idb));
    for (uint32_t l = ls; l < ls + nl; l++)
        if (s->act_tokens[l] != ts)
            return kvd_error_set(err, KVD_EPRECOND,
                                 "with_activations: layer %u has activations for its first "
                                 "%llu tokens only, so tokens from %llu cannot have them "
                                 "(every earlier token must)",
                                 l, (unsigned long long)s->act_tokens[l], (unsigned long long)ts);
    uint64_t row = kvd__act_token_bytes(s) * nl;
    if (row && n > UINT64_MAX / 4 / row)
        return kvd_error_set(err, KVD_ENOMEM, "activations of %llu tokens are too large",
                             (unsigned long long)n);
    *x_bytes = row * n;
    return 0;
}

/*
 * X of tokens [p0, t0) of `layer` (p0 a block start), gathered from the
 * records earlier appends wrote in that block, each checksum-verified, into
 * *out (malloc'd, freed by the caller). Their deletions go into b: the
 * append completing the block replaces them with one record, so a sealed
 * block costs one seek to read whatever its appends were. s->mu held.
 */
static int take_block_head(kvd_store *st, const kvd__seq *s, uint32_t layer, uint64_t p0,
                           uint64_t t0, size_t row, rocksdb_writebatch_t *b, uint8_t **out,
                           kvd_error *err)
{
    *out = NULL;
    uint8_t *buf = malloc((size_t)(t0 - p0) * row);
    if (!buf)
        return kvd_error_set(err, KVD_ENOMEM, "out of memory");
    uint8_t key[DATA_KEY_MAX];
    size_t klen = data_key(key, s->id, s->id_len, layer, p0);
    rocksdb_iterator_t *it = rocksdb_create_iterator(st->db, st->ropt);
    uint64_t t = p0;
    int rc = 0;
    char idb[KVD__ID_STR_MAX];
    kvd__id_str(s->id, s->id_len, idb, sizeof idb);
    for (rocksdb_iter_seek(it, (const char *)key, klen); t < t0 && rocksdb_iter_valid(it);
         rocksdb_iter_next(it)) {
        size_t fklen, vlen;
        const uint8_t *fk = (const uint8_t *)rocksdb_iter_key(it, &fklen);
        if (fklen != klen || memcmp(fk, key, klen - 8) != 0)
            break;
        uint64_t r0 = 0;
        for (int i = 0; i < 8; i++)
            r0 = r0 << 8 | fk[klen - 8 + i];
        if (r0 != t)
            break;
        const uint8_t *v = (const uint8_t *)rocksdb_iter_value(it, &vlen);
        size_t len = vlen > SUM_BYTES ? vlen - SUM_BYTES : 0;
        uint64_t want = 0;
        for (int i = 0; len && i < SUM_BYTES; i++)
            want |= (uint64_t)v[len + i] << (8 * i);
        if (!len || len % row || r0 + len / row > t0 || x_sum(v, len, layer, r0) != want) {
            if (len && len % row == 0 && r0 + len / row <= t0)
                atomic_fetch_add(&st->tiers.checksum_failures, 1);
            rc = kvd_error_set(err, KVD_ECORRUPT,
                               "activation record of sequence %s, layer %u, token %llu is "
                               "damaged (%zu bytes)",
                               idb, layer, (unsigned long long)r0, vlen);
            break;
        }
        memcpy(buf + (size_t)(t - p0) * row, v, len);
        rocksdb_writebatch_delete(b, (const char *)fk, fklen);
        t = r0 + len / row;
    }
    if (!rc) {
        char *e = NULL;
        rocksdb_iter_get_error(it, &e);
        if (e) {
            rc = kvd_error_set(err, KVD_EINTERNAL, "reading activations: %s", e);
            rocksdb_free(e);
        } else if (t != t0) {
            rc = kvd_error_set(err, KVD_ECORRUPT,
                               "activations of sequence %s, layer %u, token %llu are missing "
                               "from the store",
                               idb, layer, (unsigned long long)t);
        }
    }
    rocksdb_iter_destroy(it);
    if (rc)
        free(buf);
    else
        *out = buf;
    return rc;
}

int kvd__act_stage(kvd_store *st, const kvd__seq *s, uint32_t ls, uint32_t nl, uint64_t ts,
                   uint64_t n, const uint8_t *x, rocksdb_writebatch_t *b, uint64_t **counts,
                   kvd_error *err)
{
    *counts = NULL;
    uint64_t xb;
    int rc = kvd__act_check(s, ls, nl, ts, n, &xb, err);
    if (rc)
        return rc;
    uint64_t *c = malloc(s->num_layers * sizeof *c);
    if (!c)
        return kvd_error_set(err, KVD_ENOMEM, "out of memory");
    memcpy(c, s->act_tokens, s->num_layers * sizeof *c);
    const uint32_t B = st->page_tokens;
    const size_t row = (size_t)kvd__act_token_bytes(s);
    for (uint32_t l = ls; l < ls + nl; l++) {
        const uint8_t *lx = x + (size_t)(l - ls) * n * row;
        for (uint64_t t0 = ts; t0 < ts + n;) {
            uint64_t t1 = (t0 / B + 1) * B;
            if (t1 > ts + n)
                t1 = ts + n;
            const uint8_t *p = lx + (size_t)(t0 - ts) * row;
            size_t len = (size_t)(t1 - t0) * row;
            uint64_t r0 = t0;
            uint8_t *merged = NULL;
            if (t0 % B && t1 % B == 0) {
                /* This append completes a block earlier appends began:
                 * one record for the whole block replaces theirs. */
                r0 = t0 / B * B;
                if ((rc = take_block_head(st, s, l, r0, t0, row, b, &merged, err))) {
                    free(c);
                    return rc;
                }
                size_t head = (size_t)(t0 - r0) * row;
                uint8_t *m = realloc(merged, head + len);
                if (!m) {
                    free(merged);
                    free(c);
                    return kvd_error_set(err, KVD_ENOMEM, "out of memory");
                }
                memcpy(m + head, p, len);
                merged = m;
                p = m;
                len += head;
            }
            uint8_t key[DATA_KEY_MAX], sum[SUM_BYTES];
            size_t klen = data_key(key, s->id, s->id_len, l, r0);
            uint64_t h = x_sum(p, len, l, r0);
            for (int i = 0; i < SUM_BYTES; i++)
                sum[i] = (uint8_t)(h >> (8 * i));
            const char *keys[1] = {(const char *)key};
            size_t klens[1] = {klen};
            const char *vals[2] = {(const char *)p, (const char *)sum};
            size_t vlens[2] = {len, SUM_BYTES};
            rocksdb_writebatch_putv(b, 1, keys, klens, 2, vals, vlens);
            free(merged);
            t0 = t1;
        }
        c[l] = ts + n;
    }
    if ((rc = put_meta(b, s, c, err))) {
        free(c);
        return rc;
    }
    *counts = c;
    return 0;
}

void kvd__act_publish(kvd_store *st, kvd__seq *s, uint64_t *counts)
{
    uint64_t t, before, after;
    kvd__act_info(s, &t, &before);
    free(s->act_tokens);
    s->act_tokens = counts;
    kvd__act_info(s, &t, &after);
    atomic_fetch_add(&st->disk_bytes, after - before);
}

void kvd__act_delete(rocksdb_writebatch_t *b, const kvd__seq *s)
{
    uint8_t key[DATA_PREFIX_MAX + 1];
    size_t klen = meta_key(key, s->id, s->id_len);
    rocksdb_writebatch_delete(b, (const char *)key, klen);
    /* [prefix, prefix ‖ 0xff): every data key of the sequence is the prefix
     * and 12 more bytes, the first of them a layer's top byte (< 0xff,
     * layers being at most 1024). */
    uint8_t hi[DATA_PREFIX_MAX + 1];
    klen = data_prefix(key, s->id, s->id_len);
    memcpy(hi, key, klen);
    hi[klen] = 0xff;
    rocksdb_writebatch_delete_range(b, (const char *)key, klen, (const char *)hi, klen + 1);
}

void kvd__act_forget(kvd_store *st, kvd__seq *s)
{
    uint64_t t, bytes;
    kvd__act_info(s, &t, &bytes);
    uint64_t have = atomic_load(&st->disk_bytes);
    atomic_fetch_sub(&st->disk_bytes, bytes < have ? bytes : have);
    free(s->act_tokens);
    s->act_tokens = NULL;
}

int kvd__act_load(kvd_store *st, kvd_error *err)
{
    int rc = 0;
    uint64_t total = 0;
    char start = KVD__KEY_ACT_META;
    kvd__scan sc;
    rocksdb_iterator_t *it = kvd__scan_open(st, &sc, &start, 1);
    for (rocksdb_iter_seek(it, &start, 1); rocksdb_iter_valid(it); rocksdb_iter_next(it)) {
        size_t klen, vlen;
        const char *k = rocksdb_iter_key(it, &klen);
        if (klen == 0 || k[0] != KVD__KEY_ACT_META)
            break;
        const uint8_t *v = (const uint8_t *)rocksdb_iter_value(it, &vlen);
        kvd__seq *s = klen > 1 ? kvd__seq_find(st, k + 1, klen - 1, NULL) : NULL;
        if (!s)
            continue; /* no such sequence (cannot happen: both go in one batch) */
        if (vlen != 5 + 8 * (size_t)s->num_layers || v[0] != META_VERSION ||
            (uint32_t)(v[1] | v[2] << 8 | v[3] << 16 | (uint32_t)v[4] << 24) != s->num_layers) {
            char idb[KVD__ID_STR_MAX];
            rc = kvd_error_set(err, KVD_ECORRUPT,
                               "activation record of sequence %s is malformed (%zu bytes)",
                               kvd__id_str(s->id, s->id_len, idb, sizeof idb), vlen);
            break;
        }
        uint64_t *c = calloc(s->num_layers ? s->num_layers : 1, sizeof *c);
        if (!c) {
            rc = kvd_error_set(err, KVD_ENOMEM, "out of memory loading activation records");
            break;
        }
        for (uint32_t l = 0; l < s->num_layers; l++)
            for (int i = 0; i < 8; i++)
                c[l] |= (uint64_t)v[5 + 8 * (size_t)l + i] << (8 * i);
        free(s->act_tokens);
        s->act_tokens = c;
        uint64_t t, bytes;
        kvd__act_info(s, &t, &bytes);
        total += bytes;
    }
    if (!rc) {
        char *e = NULL;
        rocksdb_iter_get_error(it, &e);
        if (e) {
            rc = kvd_error_set(err, KVD_EINTERNAL, "rocksdb scan of activation records: %s", e);
            rocksdb_free(e);
        }
    }
    kvd__scan_close(&sc);
    atomic_fetch_add(&st->disk_bytes, total);
    return rc;
}

/* ---- the cursor ---------------------------------------------------------- */

struct kvd__act_cursor {
    kvd_store *st;
    const rocksdb_snapshot_t *snap;
    rocksdb_readoptions_t *ropt;
    rocksdb_iterator_t *it;
    uint8_t id[KVD_SEQ_ID_MAX];
    size_t id_len;
    uint32_t ls, nl;
    uint64_t ts, n;
    size_t row;
    uint32_t l;  /* layer now (relative) */
    uint64_t t;  /* next token of it */
    size_t boff; /* bytes of token t already produced */
    /* The record holding token t, verified: tokens [r0, r1) at rec, the
     * iterator's value (valid while the iterator stays on it). */
    const uint8_t *rec;
    uint64_t r0, r1;
    uint32_t rl;
    int failed;
    kvd_error saved;
};

void kvd__act_cursor_close(kvd__act_cursor *c)
{
    if (!c)
        return;
    if (c->it)
        rocksdb_iter_destroy(c->it);
    if (c->ropt)
        rocksdb_readoptions_destroy(c->ropt);
    if (c->snap)
        rocksdb_release_snapshot(c->st->db, c->snap);
    free(c);
}

int kvd__act_cursor_open(kvd_store *st, const kvd__seq *s, uint32_t ls, uint32_t nl, uint64_t ts,
                         uint64_t n, kvd__act_cursor **out, kvd_error *err)
{
    *out = NULL;
    char idb[KVD__ID_STR_MAX];
    if (!s->act_tokens)
        return kvd_error_set(err, KVD_EPRECOND,
                             "activation_tokens: sequence %s stores no activations (create it "
                             "with store_activations)",
                             kvd__id_str(s->id, s->id_len, idb, sizeof idb));
    for (uint32_t l = ls; l < ls + nl; l++)
        if (ts + n > s->act_tokens[l])
            return kvd_error_set(err, KVD_ERANGE,
                                 "activation_tokens: tokens %llu..%llu asked, but layer %u has "
                                 "activations for its first %llu tokens only",
                                 (unsigned long long)ts, (unsigned long long)(ts + n - 1), l,
                                 (unsigned long long)s->act_tokens[l]);
    kvd__act_cursor *c = calloc(1, sizeof *c);
    if (!c)
        return kvd_error_set(err, KVD_ENOMEM, "out of memory");
    c->st = st;
    memcpy(c->id, s->id, s->id_len);
    c->id_len = s->id_len;
    c->ls = ls;
    c->nl = nl;
    c->ts = ts;
    c->n = n;
    c->t = ts;
    c->row = (size_t)kvd__act_token_bytes(s);
    c->ropt = rocksdb_readoptions_create();
    c->snap = rocksdb_create_snapshot(st->db);
    rocksdb_readoptions_set_snapshot(c->ropt, c->snap);
    rocksdb_readoptions_set_fill_cache(c->ropt, 0);
    /* Every record carries its own XXH3, verified below (as pages do). */
    rocksdb_readoptions_set_verify_checksums(c->ropt, 0);
    /* Records are read in key order: let RocksDB read ahead. */
    rocksdb_readoptions_set_readahead_size(c->ropt, 4u << 20);
    c->it = rocksdb_create_iterator(st->db, c->ropt);
    *out = c;
    return 0;
}

uint64_t kvd__act_cursor_bytes(const kvd__act_cursor *c)
{
    return (uint64_t)c->nl * c->n * c->row;
}

/* Load and verify the record holding token c->t of layer ls + c->l. */
static int load_record(kvd__act_cursor *c, kvd_error *err)
{
    uint32_t layer = c->ls + c->l;
    uint8_t key[DATA_KEY_MAX];
    size_t klen = data_key(key, c->id, c->id_len, layer, c->t);
    /* Reading on from the end of the record before: it is the next key. */
    if (c->rec && c->rl == layer && c->t == c->r1)
        rocksdb_iter_next(c->it);
    else
        rocksdb_iter_seek_for_prev(c->it, (const char *)key, klen);
    c->rec = NULL;
    char idb[KVD__ID_STR_MAX];
    kvd__id_str(c->id, c->id_len, idb, sizeof idb);
    if (!rocksdb_iter_valid(c->it)) {
        char *e = NULL;
        rocksdb_iter_get_error(c->it, &e);
        if (e) {
            int rc = kvd_error_set(err, KVD_EINTERNAL, "reading activations: %s", e);
            rocksdb_free(e);
            return rc;
        }
        goto missing;
    }
    size_t fklen, vlen;
    const uint8_t *fk = (const uint8_t *)rocksdb_iter_key(c->it, &fklen);
    if (fklen != klen || memcmp(fk, key, klen - 8) != 0)
        goto missing;
    uint64_t r0 = 0;
    for (int i = 0; i < 8; i++)
        r0 = r0 << 8 | fk[klen - 8 + i];
    const uint8_t *v = (const uint8_t *)rocksdb_iter_value(c->it, &vlen);
    if (vlen < SUM_BYTES || (vlen - SUM_BYTES) % c->row || vlen == SUM_BYTES)
        return kvd_error_set(err, KVD_ECORRUPT,
                             "activation record of sequence %s, layer %u, token %llu has %zu "
                             "bytes, not whole tokens of %zu",
                             idb, layer, (unsigned long long)r0, vlen, c->row);
    size_t len = vlen - SUM_BYTES;
    uint64_t r1 = r0 + len / c->row;
    if (c->t < r0 || c->t >= r1)
        goto missing;
    uint64_t want = 0;
    for (int i = 0; i < SUM_BYTES; i++)
        want |= (uint64_t)v[len + i] << (8 * i);
    if (x_sum(v, len, layer, r0) != want) {
        /* Counted with the pages refused as DATA_LOSS (Stats). */
        atomic_fetch_add(&c->st->tiers.checksum_failures, 1);
        return kvd_error_set(err, KVD_ECORRUPT,
                             "activation record of sequence %s, layer %u, token %llu fails its "
                             "checksum",
                             idb, layer, (unsigned long long)r0);
    }
    c->rec = v;
    c->r0 = r0;
    c->r1 = r1;
    c->rl = layer;
    return 0;
missing:
    return kvd_error_set(err, KVD_ECORRUPT,
                         "activations of sequence %s, layer %u, token %llu are missing from "
                         "the store",
                         idb, layer, (unsigned long long)c->t);
}

int kvd__act_cursor_read(kvd__act_cursor *c, uint8_t *buf, size_t cap, size_t *len, kvd_error *err)
{
    *len = 0;
    if (c->failed) {
        if (err)
            *err = c->saved;
        return c->saved.code;
    }
    size_t done = 0;
    while (done < cap && c->l < c->nl) {
        if (c->t == c->ts + c->n) {
            c->l++;
            c->t = c->ts;
            continue;
        }
        if (!c->rec || c->rl != c->ls + c->l || c->t < c->r0 || c->t >= c->r1) {
            int rc = load_record(c, &c->saved);
            if (rc) {
                c->saved.code = rc;
                c->failed = 1;
                if (err)
                    *err = c->saved;
                return rc;
            }
        }
        uint64_t end = c->r1 < c->ts + c->n ? c->r1 : c->ts + c->n;
        size_t off = (size_t)(c->t - c->r0) * c->row + c->boff;
        size_t avail = (size_t)(end - c->t) * c->row - c->boff;
        size_t take = avail < cap - done ? avail : cap - done;
        memcpy(buf + done, c->rec + off, take);
        done += take;
        size_t adv = c->boff + take;
        c->t += adv / c->row;
        c->boff = adv % c->row;
    }
    *len = done;
    return 0;
}
