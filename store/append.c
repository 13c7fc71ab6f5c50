/*
 * Append: a transaction fed with bytes.
 *
 * begin validates the spec and returns the exact byte count; write buffers
 * the bytes (no lock held); commit, under the sequence's lock:
 *   1. re-checks the spec against the current sequence,
 *   2. plans the new block hashes and pending token ids,
 *   3. builds the pages of each appended layer, transposed from the wire
 *      layout [token][kv_head][head_dim] to the page layout
 *      [kv_head][token][head_dim]: a tail fragment holding just the new
 *      tokens when the tail page stays partial, else the old raw tail (page
 *      and fragments, read back and checksum-verified) merged with the new
 *      tokens and cut at page boundaries (build_layer),
 *   4. writes pages and the new sequence record in one RocksDB WriteBatch,
 *   5. only then publishes the new page tables under st->lock.
 * Any failure before step 5 leaves the sequence exactly as it was. The raw
 * tail page keeps its page id when rewritten, so a concurrent read snapshot
 * sees either the old or the new bytes under that id, both valid for the
 * tokens it reads.
 */
#include "store_internal.h"
#include "seqcodec.h"
#include "pqindex.h"

#include <stdlib.h>
#include <string.h>

struct kvd_append {
    kvd_store *st;
    kvd__seq *s; /* holds a reference */
    uint32_t ls, nl;
    uint64_t ts, n;
    uint32_t H, D;
    size_t es;
    kvd_dtype dtype;
    uint32_t *ids;
    size_t n_ids;
    uint64_t *bh;
    size_t n_bh;
    uint8_t *buf;
    uint64_t have, expected, cap;
    int failed;
    /* The pages built by commit, put in the memory tiers once the batch is
     * durable (an append writes what is about to be read): a copy, or where
     * the page lies in the commit's batch. */
    struct built_page {
        uint64_t id;
        uint8_t *bytes; /* the copy, or NULL: in the batch at off */
        size_t off;
        size_t len;
        uint32_t num_tokens;
        kvd__slot slot; /* where a page coded on the device was put there, or none */
    } *built;
    size_t nbuilt, capbuilt;
    /* Codecs of the sequence (seqcodec.h): full pages are encoded with them
     * as they seal, except those of blocks before sink_end. */
    kvd_seq_codecs codecs;
    int coded;
    uint64_t sink_end;
    struct kvd__pq_append *pq; /* PQ centroids this append loaded or trained (pqindex.h) */
    /* Pages encoded by the client (AppendPages), stored verbatim in place of
     * the page the commit would build for (layer, block). */
    struct given_page {
        uint32_t layer;
        uint64_t block;
        uint8_t *bytes;
        size_t len;
    } *given;
    size_t ngiven;
    /* Payload ranges counted without their bytes (kvd_store_append_skip):
     * [off, off + len) of buf holds nothing. */
    struct skipped_range {
        uint64_t off, len;
    } * skipped;
    size_t nskipped;
    /* Activations (activation.c): the bytes carry X from x_off on. */
    int with_x;
    uint64_t x_off;
};

int kvd_store_append_give_page(kvd_append *ap, uint32_t layer, uint64_t block,
                               const uint8_t *page, size_t len, kvd_error *err)
{
    struct given_page *g = realloc(ap->given, (ap->ngiven + 1) * sizeof *g);
    if (!g)
        return kvd_error_set(err, KVD_ENOMEM, "out of memory");
    ap->given = g;
    g[ap->ngiven].bytes = malloc(len ? len : 1);
    if (!g[ap->ngiven].bytes)
        return kvd_error_set(err, KVD_ENOMEM, "out of memory");
    memcpy(g[ap->ngiven].bytes, page, len);
    g[ap->ngiven].layer = layer;
    g[ap->ngiven].block = block;
    g[ap->ngiven].len = len;
    ap->ngiven++;
    return 0;
}

/* Whether any byte of buf's [off, off + len) was skipped. */
static int skipped(const kvd_append *ap, uint64_t off, uint64_t len)
{
    for (size_t i = 0; i < ap->nskipped; i++)
        if (off < ap->skipped[i].off + ap->skipped[i].len && ap->skipped[i].off < off + len)
            return 1;
    return 0;
}

/* Whether any byte of tokens [t0, t1) of layer l, K or V, was skipped. */
static int tokens_skipped(const kvd_append *ap, uint32_t l, uint64_t t0, uint64_t t1)
{
    const uint64_t tb = (uint64_t)ap->H * ap->D * ap->es, half = (uint64_t)ap->nl * ap->n * tb;
    const uint64_t off = ((uint64_t)(l - ap->ls) * ap->n + (t0 - ap->ts)) * tb,
                   len = (t1 - t0) * tb;
    return ap->nskipped && t1 > t0 && (skipped(ap, off, len) || skipped(ap, half + off, len));
}

static const struct given_page *given_page(const kvd_append *ap, uint32_t layer, uint64_t block)
{
    for (size_t i = 0; i < ap->ngiven; i++)
        if (ap->given[i].layer == layer && ap->given[i].block == block)
            return &ap->given[i];
    return NULL;
}

/* Room for one more finished page for the tiers, or NULL (best effort:
 * without it, the page is read from RocksDB when wanted). */
static struct built_page *next_built(kvd_append *ap, size_t len)
{
    kvd__cache *c = &ap->st->tiers;
    if (len > c->tier[KVD_TIER_DEVICE].limit && len > c->tier[KVD_TIER_HOST].limit)
        return NULL;
    if (ap->nbuilt == ap->capbuilt) {
        size_t nc = ap->capbuilt ? 2 * ap->capbuilt : 16;
        struct built_page *n = realloc(ap->built, nc * sizeof *n);
        if (!n)
            return NULL;
        ap->built = n;
        ap->capbuilt = nc;
    }
    return &ap->built[ap->nbuilt];
}

/* Keep a copy of a finished page for the tiers: the copy, or NULL. */
static struct built_page *keep_built(kvd_append *ap, uint64_t id, const uint8_t *page, size_t len,
                                     uint32_t num_tokens)
{
    struct built_page *bp = next_built(ap, len);
    uint8_t *copy = bp ? malloc(len) : NULL;
    if (!copy)
        return NULL;
    memcpy(copy, page, len);
    *bp = (struct built_page){id, copy, 0, len, num_tokens, {0, 0, NULL}};
    ap->nbuilt++;
    return bp;
}

/* Keep a page built in place in the commit's batch (at off) for the tiers. */
static void keep_batched(kvd_append *ap, uint64_t id, size_t off, size_t len, uint32_t num_tokens)
{
    struct built_page *bp = next_built(ap, len);
    if (!bp)
        return;
    *bp = (struct built_page){id, NULL, off, len, num_tokens, {0, 0, NULL}};
    ap->nbuilt++;
}

/* New hash and token-id state of a sequence after an append. */
typedef struct id_plan {
    uint64_t *hashes, n_hashes;
    uint32_t *ids;
    uint64_t n_ids;
} id_plan;

static void plan_free(id_plan *p)
{
    free(p->hashes);
    free(p->ids);
    memset(p, 0, sizeof *p);
}

/* Drop the ids of the oldest pending block once its hash is known. */
static void plan_shift(id_plan *p, uint32_t B)
{
    if (p->n_ids > B) {
        memmove(p->ids, p->ids + B, (p->n_ids - B) * sizeof *p->ids);
        p->n_ids -= B;
    } else {
        p->n_ids = 0;
    }
}

/*
 * Compute the block hashes and pending ids the sequence will have after the
 * append (read-only on s; the caller holds s->mu or st->lock).
 * Engine-supplied hashes come first (they override token-id hashing for
 * their blocks); then token ids extend the pending window and every block it
 * completes is hashed with kvd_prefix_hash, chained from the previous block.
 */
static int plan_ids(const kvd_store *st, const kvd__seq *s, const kvd_append *ap, id_plan *p,
                    kvd_error *err)
{
    uint32_t B = st->page_tokens;
    memset(p, 0, sizeof *p);
    uint64_t end = ap->ts + ap->n;
    /* Sized by what the append carries, never by num_tokens alone: a header
     * announcing a huge append must not cost memory before its data. */
    uint64_t icap = s->n_ids + ap->n_ids + 1;
    uint64_t hcap = s->n_hashes + ap->n_bh + icap / B + 1;
    p->hashes = malloc(hcap * sizeof *p->hashes);
    p->ids = malloc(icap * sizeof *p->ids);
    if (!p->hashes || !p->ids) {
        plan_free(p);
        return kvd_error_set(err, KVD_ENOMEM, "out of memory");
    }
    if (s->n_hashes)
        memcpy(p->hashes, s->hashes, s->n_hashes * sizeof *p->hashes);
    p->n_hashes = s->n_hashes;
    if (s->n_ids)
        memcpy(p->ids, s->ids, s->n_ids * sizeof *p->ids);
    p->n_ids = s->n_ids;

    if (ap->n_bh) {
        uint64_t first = ap->ts / B, count = end / B - first;
        if (ap->n_bh != count) {
            plan_free(p);
            return kvd_error_set(err, KVD_EINVAL,
                                 "%zu block hashes given, but tokens %llu..%llu complete %llu "
                                 "blocks of %u tokens",
                                 ap->n_bh, (unsigned long long)ap->ts, (unsigned long long)end,
                                 (unsigned long long)count, B);
        }
        for (uint64_t k = 0; k < count; k++) {
            uint64_t i = first + k;
            if (i < p->n_hashes) {
                if (p->hashes[i] != ap->bh[k]) {
                    int rc = kvd_error_set(err, KVD_EINVAL,
                                           "hash %016llx given for block %llu differs from the "
                                           "stored %016llx",
                                           (unsigned long long)ap->bh[k], (unsigned long long)i,
                                           (unsigned long long)p->hashes[i]);
                    plan_free(p);
                    return rc;
                }
            } else if (i == p->n_hashes) {
                p->hashes[p->n_hashes++] = ap->bh[k];
                plan_shift(p, B);
            } else {
                int rc = kvd_error_set(err, KVD_EINVAL,
                                       "hash given for block %llu but block %llu has none",
                                       (unsigned long long)i, (unsigned long long)p->n_hashes);
                plan_free(p);
                return rc;
            }
        }
    }
    if (ap->n_ids) {
        uint64_t base = p->n_hashes * B, idpos = base + p->n_ids;
        if (ap->ts > idpos) {
            int rc = kvd_error_set(err, KVD_EINVAL,
                                   "token ids given from token %llu, but ids are known only "
                                   "for the first %llu tokens",
                                   (unsigned long long)ap->ts, (unsigned long long)idpos);
            plan_free(p);
            return rc;
        }
        for (uint64_t t = ap->ts; t < end; t++) {
            uint32_t id = ap->ids[t - ap->ts];
            if (t < base)
                continue; /* already hashed */
            if (t < idpos) {
                if (p->ids[t - base] != id) {
                    int rc = kvd_error_set(err, KVD_EINVAL,
                                           "token id %u at token %llu differs from the id %u "
                                           "given before",
                                           id, (unsigned long long)t, p->ids[t - base]);
                    plan_free(p);
                    return rc;
                }
                continue;
            }
            p->ids[p->n_ids++] = id;
        }
        while (p->n_ids >= B) {
            uint64_t parent = p->n_hashes ? p->hashes[p->n_hashes - 1] : 0;
            p->hashes[p->n_hashes++] = kvd_prefix_hash(parent, p->ids, B);
            plan_shift(p, B);
        }
    }
    return 0;
}

/* Check the spec against the sequence's current state (s->mu or st->lock held). */
static int check_state(const kvd_store *st, const kvd__seq *s, const kvd_append *ap, kvd_error *err)
{
    for (uint32_t l = ap->ls; l < ap->ls + ap->nl; l++) {
        if (s->layers[l].tokens != ap->ts)
            return kvd_error_set(err, KVD_EPRECOND, "token_start %llu != layer %u length %llu",
                                 (unsigned long long)ap->ts, l,
                                 (unsigned long long)s->layers[l].tokens);
    }
    if (st->max_seq_tokens && ap->ts + ap->n > st->max_seq_tokens)
        return kvd_error_set(err, KVD_ENOMEM,
                             "appending %llu tokens at %llu exceeds the limit of %llu tokens",
                             (unsigned long long)ap->n, (unsigned long long)ap->ts,
                             (unsigned long long)st->max_seq_tokens);
    return 0;
}

void kvd_store_append_abort(kvd_append *ap)
{
    if (!ap)
        return;
    for (size_t i = 0; i < ap->nbuilt; i++) {
        kvd__cache_unreserve(ap->st, &ap->built[i].slot);
        free(ap->built[i].bytes);
    }
    kvd__seq_unref(ap->s);
    free(ap->built);
    for (size_t i = 0; i < ap->ngiven; i++)
        free(ap->given[i].bytes);
    free(ap->given);
    free(ap->skipped);
    kvd__pq_append_free(ap->pq);
    free(ap->ids);
    free(ap->bh);
    kvd__buf_give(ap->st, ap->buf, (size_t)ap->cap);
    atomic_fetch_sub(&ap->st->append_buf_bytes, ap->cap);
    kvd_seq_codecs_clear(&ap->codecs);
    free(ap);
}

int kvd_store_append_begin(kvd_store *st, const kvd_append_spec *spec, kvd_append **out,
                           uint64_t *expected_bytes, kvd_error *err)
{
    if (out)
        *out = NULL;
    if (expected_bytes)
        *expected_bytes = 0;
    if (!st || !spec || !out)
        return kvd_error_set(err, KVD_EINVAL, "append: NULL argument");
    int rc = kvd__check_seq_id(spec->seq_id, spec->seq_id_len, err);
    if (rc)
        return rc;
    if (spec->num_tokens == 0)
        return kvd_error_set(err, KVD_EINVAL, "append of 0 tokens");
    if (spec->n_token_ids && spec->n_token_ids != spec->num_tokens)
        return kvd_error_set(err, KVD_EINVAL, "%zu token ids given for %llu tokens",
                             spec->n_token_ids, (unsigned long long)spec->num_tokens);
    if ((spec->n_token_ids && !spec->token_ids) || (spec->n_block_hashes && !spec->block_hashes))
        return kvd_error_set(err, KVD_EINVAL, "append: token ids or block hashes are NULL");
    if (spec->token_start > UINT64_MAX / 2 || spec->num_tokens > UINT64_MAX / 2)
        return kvd_error_set(err, KVD_EINVAL, "append: token range too large");

    kvd_append *ap = calloc(1, sizeof *ap);
    if (!ap)
        return kvd_error_set(err, KVD_ENOMEM, "out of memory");
    ap->st = st;
    ap->ts = spec->token_start;
    ap->n = spec->num_tokens;
    ap->ls = spec->layer_start;
    if ((rc = kvd_store_seq_codecs_get(st, spec->seq_id, spec->seq_id_len, &ap->codecs,
                                       &ap->coded, err))) {
        free(ap);
        return rc;
    }
    ap->coded = ap->coded && kvd_seq_codecs_coded(&ap->codecs);
    ap->sink_end = ((uint64_t)ap->codecs.raw_sink_tokens + st->page_tokens - 1) /
                   st->page_tokens * st->page_tokens;

    pthread_rwlock_rdlock(&st->lock);
    kvd__seq *s = kvd__seq_find(st, spec->seq_id, spec->seq_id_len, NULL);
    if (!s) {
        pthread_rwlock_unlock(&st->lock);
        free(ap);
        char idb[KVD__ID_STR_MAX];
        return kvd_error_set(err, KVD_ENOTFOUND, "sequence %s not found",
                             kvd__id_str(spec->seq_id, spec->seq_id_len, idb, sizeof idb));
    }
    const kvd_model_info *mi = &s->model->info;
    if (spec->dtype != mi->dtype) {
        rc = kvd_error_set(err, KVD_EINVAL, "dtype %s does not match model dtype %s",
                           kvd_dtype_name(spec->dtype), kvd_dtype_name(mi->dtype));
        goto fail;
    }
    if (spec->layer_start >= mi->num_layers) {
        rc = kvd_error_set(err, KVD_EINVAL, "layer_start %u out of the model's %u layers",
                           spec->layer_start, mi->num_layers);
        goto fail;
    }
    ap->nl = spec->num_layers ? spec->num_layers : mi->num_layers - spec->layer_start;
    if (ap->nl > mi->num_layers - spec->layer_start) {
        rc = kvd_error_set(err, KVD_EINVAL, "layers %u..%u exceed the model's %u layers",
                           spec->layer_start, spec->layer_start + ap->nl - 1, mi->num_layers);
        goto fail;
    }
    ap->H = mi->num_kv_heads;
    ap->D = mi->head_dim;
    ap->dtype = mi->dtype;
    ap->es = kvd_dtype_size(mi->dtype);
    /* VQ/SVD pages code with the sequence's artifact snapshot (seqcodec.h). */
    if (ap->coded &&
        (rc = kvd_seq_codecs_load_arts(st, spec->seq_id, spec->seq_id_len, &ap->codecs, err)))
        goto fail;
    uint64_t row = 2ull * ap->nl * ap->H * ap->D * ap->es; /* K and V bytes per token */
    if (ap->n > UINT64_MAX / row) {
        rc = kvd_error_set(err, KVD_ENOMEM, "append of %llu tokens is too large",
                           (unsigned long long)ap->n);
        goto fail;
    }
    ap->expected = row * ap->n;
    if ((rc = check_state(st, s, ap, err)))
        goto fail;
    if (spec->with_activations) {
        uint64_t xb;
        if ((rc = kvd__act_check(s, ap->ls, ap->nl, ap->ts, ap->n, &xb, err)))
            goto fail;
        if (xb > UINT64_MAX - ap->expected) {
            rc = kvd_error_set(err, KVD_ENOMEM, "append of %llu tokens is too large",
                               (unsigned long long)ap->n);
            goto fail;
        }
        ap->with_x = 1;
        ap->x_off = ap->expected;
        ap->expected += xb;
    }
    if (spec->n_token_ids) {
        ap->ids = malloc(spec->n_token_ids * sizeof *ap->ids);
        if (!ap->ids)
            goto oom;
        memcpy(ap->ids, spec->token_ids, spec->n_token_ids * sizeof *ap->ids);
        ap->n_ids = spec->n_token_ids;
    }
    if (spec->n_block_hashes) {
        ap->bh = malloc(spec->n_block_hashes * sizeof *ap->bh);
        if (!ap->bh)
            goto oom;
        memcpy(ap->bh, spec->block_hashes, spec->n_block_hashes * sizeof *ap->bh);
        ap->n_bh = spec->n_block_hashes;
    }
    /* Check hashes and ids now for an early error; commit checks again. */
    id_plan pl;
    if ((rc = plan_ids(st, s, ap, &pl, err)))
        goto fail;
    plan_free(&pl);
    atomic_fetch_add(&s->refs, 1);
    ap->s = s;
    pthread_rwlock_unlock(&st->lock);
    *out = ap;
    if (expected_bytes)
        *expected_bytes = ap->expected;
    return 0;
oom:
    rc = kvd_error_set(err, KVD_ENOMEM, "out of memory");
fail:
    pthread_rwlock_unlock(&st->lock);
    kvd_store_append_abort(ap);
    return rc;
}

int kvd_store_append_memory_take(kvd_store *st, uint64_t bytes, kvd_error *err)
{
    /* charged first, so that calls in flight cannot pass the cap together */
    const uint64_t had = atomic_fetch_add(&st->append_buf_bytes, bytes);
    if (st->append_limit && (had + bytes > st->append_limit || had + bytes < had)) {
        atomic_fetch_sub(&st->append_buf_bytes, bytes);
        return kvd_error_set(err, KVD_ENOMEM,
                             "calls in flight hold %llu bytes of buffers; %llu more for this "
                             "one exceed append-memory-bytes (%llu): retry later, or send "
                             "less in one call",
                             (unsigned long long)had, (unsigned long long)bytes,
                             (unsigned long long)st->append_limit);
    }
    return 0;
}

void kvd_store_append_memory_give(kvd_store *st, uint64_t bytes)
{
    if (st && bytes)
        atomic_fetch_sub(&st->append_buf_bytes, bytes);
}

/* Room in buf for len more bytes: 0, or an error with the append failed. */
static int append_room(kvd_append *ap, size_t len, kvd_error *err)
{
    if (ap->failed)
        return kvd_error_set(err, KVD_EINVAL, "append already failed");
    if (len > ap->expected - ap->have) {
        ap->failed = 1;
        return kvd_error_set(err, KVD_EINVAL, "append data exceeds the expected %llu bytes",
                             (unsigned long long)ap->expected);
    }
    if (ap->have + len > ap->cap) {
        /* Grow with the data actually received, so a header announcing a
         * huge append costs nothing until the bytes arrive. */
        uint64_t nc = ap->cap ? ap->cap : (64u << 20);
        while (nc < ap->have + len)
            nc *= 2;
        if (nc > ap->expected)
            nc = ap->expected;
        /* Within what calls in flight may hold together. */
        kvd_store *st = ap->st;
        const uint64_t more = nc - ap->cap;
        if (kvd_store_append_memory_take(st, more, err)) {
            ap->failed = 1;
            return KVD_ENOMEM;
        }
        size_t ncap = (size_t)nc;
        uint8_t *nb = nc > SIZE_MAX ? NULL
                      : ap->buf     ? realloc(ap->buf, (size_t)nc)
                                    : kvd__buf_take(st, (size_t)nc, &ncap);
        if (!nb) {
            atomic_fetch_sub(&st->append_buf_bytes, more);
            ap->failed = 1;
            return kvd_error_set(err, KVD_ENOMEM, "out of memory buffering %llu append bytes",
                                 (unsigned long long)nc);
        }
        if (ncap > nc) /* a kept buffer, larger: held all the same */
            atomic_fetch_add(&st->append_buf_bytes, ncap - nc);
        ap->buf = nb;
        ap->cap = ncap;
    }
    return 0;
}

int kvd_store_append_write(kvd_append *ap, const void *data, size_t len, kvd_error *err)
{
    if (!ap || (len && !data))
        return kvd_error_set(err, KVD_EINVAL, "append write: NULL argument");
    int rc = append_room(ap, len, err);
    if (rc || len == 0)
        return rc;
    memcpy(ap->buf + ap->have, data, len);
    ap->have += len;
    return 0;
}

int kvd_store_append_skip(kvd_append *ap, size_t len, kvd_error *err)
{
    if (!ap)
        return kvd_error_set(err, KVD_EINVAL, "append skip: NULL append");
    int rc = append_room(ap, len, err);
    if (rc || len == 0)
        return rc;
    if (ap->with_x && ap->have + len > ap->x_off) {
        ap->failed = 1;
        return kvd_error_set(err, KVD_EINVAL, "append skip: activation bytes cannot be skipped");
    }
    struct skipped_range *r = NULL;
    if (ap->nskipped && ap->skipped[ap->nskipped - 1].off + ap->skipped[ap->nskipped - 1].len ==
                            ap->have) { /* extends the last range */
        ap->skipped[ap->nskipped - 1].len += len;
    } else if ((r = realloc(ap->skipped, (ap->nskipped + 1) * sizeof *r)) == NULL) {
        ap->failed = 1;
        return kvd_error_set(err, KVD_ENOMEM, "out of memory");
    } else {
        ap->skipped = r;
        ap->skipped[ap->nskipped++] = (struct skipped_range){ap->have, len};
    }
    ap->have += len;
    return 0;
}

/* Copy tokens [t0, t1) of one part (K or V) of layer data into a page
 * section, head-major. Tokens below `old_end` come from the old tail (`old`,
 * old_n tokens per head, starting at token p0), the rest from the wire block
 * `w` ([token][kv_head][head_dim], starting at token ts). */
static void fill_section(const kvd_append *ap, uint8_t *dst, uint64_t t0, uint64_t t1,
                         const uint8_t *old, uint32_t old_n, uint64_t p0, uint64_t old_end,
                         const uint8_t *w)
{
    size_t row = (size_t)ap->D * ap->es; /* one head of one token */
    size_t tok_bytes = (size_t)ap->H * row;
    for (uint32_t h = 0; h < ap->H; h++) {
        for (uint64_t t = t0; t < t1; t++) {
            const uint8_t *src;
            if (t < old_end)
                src = old + ((size_t)h * old_n + (size_t)(t - p0)) * row;
            else
                src = w + (size_t)(t - ap->ts) * tok_bytes + (size_t)h * row;
            memcpy(dst, src, row);
            dst += row;
        }
    }
}

/*
 * Build the new pages of one layer into batch and return the layer's new
 * page table in *nl (new kvd__page structs for the tail and the new pages;
 * older entries are shared with the current table).
 *
 * An append that leaves the current tail page partial, while that page has
 * fewer than KVD__MAX_FRAGS fragments, only adds a tail fragment with the new
 * tokens. Otherwise the old tail (page and fragments) is read back, merged
 * with the new tokens, cut at page boundaries, and its fragments deleted.
 */
/* Sealing pages a device codes together (kvd_pages_encode), at most: the
 * raw pages of one window are held at once. */
#define KVD__ENCODE_WINDOW 32

/* The raw K and V of the pages a window codes on the device, put there
 * once for their coding and their PQ codes (NULL m: none there). */
typedef struct dev_raw {
    kvd_backend *dev;
    uint8_t *m;
    const void *k[KVD__ENCODE_WINDOW], *v[KVD__ENCODE_WINDOW];
} dev_raw;

static void dev_raw_free(dev_raw *r)
{
    if (r->m)
        kvd_backend_scratch_free(r->dev, r->m);
    r->m = NULL;
}

/* Put the raw sections of n pages (n <= KVD__ENCODE_WINDOW) on dev, as
 * one batch of copies. */
static int dev_raw_up(kvd_backend *dev, size_t n, const kvd_page_desc *d, const void *const *kp,
                      const void *const *vp, dev_raw *r, kvd_error *err)
{
    const size_t sec =
        (size_t)d[0].num_kv_heads * d[0].num_tokens * d[0].head_dim * kvd_dtype_size(d[0].dtype);
    const size_t step = (sec + 255) & ~(size_t)255;
    kvd_copy ops[2 * KVD__ENCODE_WINDOW];
    r->dev = dev;
    int rc = kvd_backend_scratch(dev, 2 * n * step, (void **)&r->m, err);
    if (rc) {
        r->m = NULL;
        return rc;
    }
    for (size_t p = 0; p < n; p++) {
        r->k[p] = r->m + 2 * p * step;
        r->v[p] = r->m + (2 * p + 1) * step;
        ops[2 * p] = (kvd_copy){.dst = (void *)r->k[p], .src = kp[p], .bytes = sec, .to_device = 1};
        ops[2 * p + 1] =
            (kvd_copy){.dst = (void *)r->v[p], .src = vp[p], .bytes = sec, .to_device = 1};
    }
    if ((rc = kvd_backend_copy_batch(dev, ops, 2 * n, err)))
        dev_raw_free(r);
    return rc;
}

/* Code n sealing pages: on the store's device when it codes them
 * (kvd_store_device), their raw sections put there once (r, kept for their PQ
 * codes) and their coded arrays left there (*keep, to put the pages in the
 * device tier from), else, or when the device fails
 * (kvd_store_device_fallback), on the CPU with the thread's coding backend
 * (*keep zeroed). Same bytes either way. */
static int encode_pages(kvd_store *st, size_t n, const kvd_page_desc *d, const kvd_seq_codecs *c,
                        const void *const *kp, const void *const *vp, uint8_t **out, size_t *len,
                        dev_raw *r, kvd_dev_sections *keep, kvd_error *err)
{
    kvd_backend *dev = kvd_store_device(st);
    memset(keep, 0, sizeof *keep);
    if (dev) {
        int rc = dev_raw_up(dev, n, d, kp, vp, r, err);
        if (rc == 0)
            rc = kvd_pages_encode_device(dev, n, d, &c->k, &c->v, r->k, r->v, out, len, keep, err);
        if (rc == 0) {
            atomic_fetch_add(&st->tiers.device_pages_encoded, n);
            return 0;
        }
        dev_raw_free(r);
        if (!kvd_store_device_fallback(st, rc, err))
            return rc;
    }
    return kvd_pages_encode(kvd_store_coding_backend(st), n, d, &c->k, &c->v, kp, vp, out, len,
                            err);
}

/*
 * A page coded on the device, finished (bp: its bytes, with any section
 * added since), goes where it will stay in the device tier: a range is
 * reserved for it (bp->slot) and the copies that write it there are added
 * to ops (its arrays copied within the device from where the coding left
 * them, page ci of keep; the rest up), to run with the window's, and its
 * index to placed. Copies added; none when the tier has no room for it (it
 * goes up at the insert).
 */
static size_t place_coded(kvd_append *ap, struct built_page *bp, const kvd_dev_sections *keep,
                          size_t ci, kvd_copy *ops, size_t *placed, size_t *nplaced)
{
    size_t n = 0;
    if (kvd__cache_reserve(ap->st, bp->len, &bp->slot) != 0)
        return 0;
    if (kvd_page_image_copies(bp->bytes, bp->len, keep, ci, bp->slot.data, ops, &n, NULL) != 0) {
        kvd__cache_unreserve(ap->st, &bp->slot);
        return 0;
    }
    placed[(*nplaced)++] = (size_t)(bp - ap->built);
    return n;
}

/*
 * The PQ codes of the nc pages a window coded on the device (cd, their keys
 * there in r), made together (kvd__pq_pages_codes) into *codes (malloc'd,
 * nc x pq bytes): the layer's centroids are trained, if need be, from the
 * window's first page that seals (ds, kps: its n pages), as the page-by-page
 * path would. When the device fails in a way kvd_store_device_fallback
 * takes, *codes is NULL and each page's codes are made on its own.
 */
static int pq_window(kvd_append *ap, rocksdb_writebatch_t *b, const kvd_page_desc *ds,
                     uint8_t *const *kps, uint64_t n, const kvd_page_desc *cd, size_t nc,
                     const dev_raw *r, uint8_t **codes, kvd_error *err)
{
    *codes = NULL;
    uint64_t first = 0;
    while (first < n && ds[first].num_tokens != ds[first].page_tokens)
        first++;
    const size_t tok_bytes = (size_t)ap->H * ap->D * ap->es;
    const uint8_t *wk = ap->buf + (size_t)(cd[0].layer - ap->ls) * ap->n * tok_bytes;
    uint8_t *c = malloc(nc * (size_t)ap->H * cd[0].page_tokens * ap->codecs.pq_m);
    if (!c)
        return kvd_error_set(err, KVD_ENOMEM, "out of memory for PQ codes");
    int rc = kvd__pq_pages_codes(&ap->pq, ap->st, ap->s, &ap->codecs, b, &ds[first], kps[first], wk,
                                 ap->ts, ap->ts + ap->n, nc, cd, r->k, c, err);
    if (rc == 0) {
        *codes = c;
        return 0;
    }
    free(c);
    return kvd_store_device_fallback(ap->st, rc, err) ? 0 : rc;
}

static int build_layer(kvd_append *ap, uint32_t l, const id_plan *pl, kvd__batch *wb,
                       rocksdb_writebatch_t *b, kvd__layer *nl, kvd_error *err)
{
    kvd_store *st = ap->st;
    kvd__seq *s = ap->s;
    const kvd__layer *L = &s->layers[l];
    uint32_t B = st->page_tokens;
    uint64_t end = ap->ts + ap->n;
    uint64_t first = L->tokens / B;
    uint32_t tail_n = (uint32_t)(L->tokens % B);
    uint64_t npages = (end + B - 1) / B;
    size_t tok_bytes = (size_t)ap->H * ap->D * ap->es;
    const kvd__page *tail = tail_n ? L->pages[first] : NULL;
    /* The pages this append seals carry PQ codes once the layer has
     * centroids, or when this append takes it to pq_min_train_tokens (and
     * trains them); before, they seal without (pqindex.h). */
    const int pq = ap->codecs.pq_m && (L->pq.bytes || end >= ap->codecs.pq_min_train_tokens);
    int rc = 0;
    kvd__tail old = {0};

    memset(nl, 0, sizeof *nl);
    if (npages > UINT32_MAX)
        return kvd_error_set(err, KVD_ENOMEM, "layer %u would have too many pages", l);
    nl->pages = calloc(npages, sizeof *nl->pages);
    if (!nl->pages)
        return kvd_error_set(err, KVD_ENOMEM, "out of memory");
    nl->tokens = end;
    nl->npages = nl->cap = (uint32_t)npages;
    if (first)
        memcpy(nl->pages, L->pages, first * sizeof *nl->pages);
    /* Pages given whole are not built, and their bytes not read, unless
     * their keys make PQ codes; every byte read must have been received. */
    if (pq && ap->nskipped) {
        rc = kvd_error_set(err, KVD_EINVAL,
                           "append: payload bytes were skipped, but layer %u needs every key for "
                           "its PQ index",
                           l);
        goto fail;
    }

    /* Wire K and V blocks of this layer. */
    const uint8_t *wk = ap->buf + (size_t)(l - ap->ls) * ap->n * tok_bytes;
    const uint8_t *wv = wk + (size_t)ap->nl * ap->n * tok_bytes;

    if (tail && end < (first + 1) * B && tail->nfrags < KVD__MAX_FRAGS) {
        if (tokens_skipped(ap, l, ap->ts, end)) {
            rc = kvd_error_set(err, KVD_EINVAL,
                               "append: the bytes of layer %u tokens %llu..%llu were skipped, "
                               "but no page was given for them",
                               l, (unsigned long long)ap->ts, (unsigned long long)end);
            goto fail;
        }
        kvd_page_desc d = {.dtype = ap->dtype,
                           .layer = l,
                           .token_start = ap->ts,
                           .num_tokens = (uint32_t)ap->n,
                           .page_tokens = B,
                           .num_kv_heads = ap->H,
                           .head_dim = ap->D};
        uint64_t size = kvd_page_raw_size(&d);
        uint8_t key[KVD__FRAG_KEY_LEN];
        kvd__frag_key(key, tail->id, tail_n);
        kvd__page *np = calloc(1, sizeof *np);
        /* built where the batch holds it */
        uint8_t *page = np ? kvd__batch_put(wb, b, key, sizeof key, (size_t)size) : NULL;
        if (!np || !page) {
            free(np);
            rc = kvd_error_set(err, KVD_ENOMEM, "out of memory building a tail fragment");
            goto fail;
        }
        nl->pages[first] = np;
        np->id = tail->id;
        np->refs = 1;
        np->num_tokens = (uint32_t)(end - first * B);
        np->bytes = tail->bytes + size;
        np->nfrags = tail->nfrags + 1;
        uint8_t *kp, *vp;
        if ((rc = kvd_page_init_raw(&d, page, (size_t)size, &kp, &vp, err)))
            goto fail;
        fill_section(ap, kp, ap->ts, end, NULL, 0, 0, 0, wk);
        fill_section(ap, vp, ap->ts, end, NULL, 0, 0, 0, wv);
        kvd_page_finish(page, (size_t)size);
        return 0;
    }

    if (tail) {
        kvd__tail_want w = {.page_id = tail->id,
                            .layer = l,
                            .p0 = first * B,
                            .need = tail_n,
                            .B = B,
                            .H = ap->H,
                            .D = ap->D,
                            .dtype = ap->dtype};
        if ((rc = kvd__tail_load(st, st->ropt, &w, &old, err))) {
            if (rc == KVD_ECORRUPT)
                kvd__note_corrupt(st, tail->id, err);
            goto fail;
        }
        if (old.num_tokens != tail_n) {
            rc = kvd_error_set(err, KVD_ECORRUPT,
                               "tail page %llu of layer %u holds %u tokens, "
                               "not %u",
                               (unsigned long long)tail->id, l, old.num_tokens, tail_n);
            goto fail;
        }
        for (uint32_t i = 0; i < old.nfrags; i++) {
            uint8_t key[KVD__FRAG_KEY_LEN];
            kvd__frag_key(key, tail->id, old.frag_off[i]);
            rocksdb_writebatch_delete(b, (const char *)key, sizeof key);
        }
    }

    /* The pages go in windows: built raw, the sealing ones to code coded
     * together (one page per window without a coding device), then written. */
    const uint64_t W = ap->coded && kvd_store_device(st) ? KVD__ENCODE_WINDOW : 1;
    kvd_page_desc full = {.dtype = ap->dtype,
                          .page_tokens = B,
                          .num_tokens = B,
                          .num_kv_heads = ap->H,
                          .head_dim = ap->D};
    const size_t full_size = (size_t)kvd_page_raw_size(&full);
    uint8_t *raw[KVD__ENCODE_WINDOW] = {0}, *coded[KVD__ENCODE_WINDOW] = {0};
    const void *ck[KVD__ENCODE_WINDOW], *cv[KVD__ENCODE_WINDOW];
    uint8_t *kps[KVD__ENCODE_WINDOW];
    kvd_page_desc ds[KVD__ENCODE_WINDOW], cd[KVD__ENCODE_WINDOW];
    size_t clen[KVD__ENCODE_WINDOW];
    int code_it[KVD__ENCODE_WINDOW];
    size_t in_batch[KVD__ENCODE_WINDOW]; /* built in place in wb, at this offset; or 0 */
    const struct given_page *given[KVD__ENCODE_WINDOW];
    dev_raw draw = {0};
    kvd_dev_sections keep = {0}; /* where the window's coded arrays lie on the device */
    kvd_copy img[KVD__ENCODE_WINDOW * KVD_PAGE_IMAGE_COPIES];
    size_t placed[KVD__ENCODE_WINDOW]; /* built pages given a device range */
    uint8_t *pqc = NULL; /* the PQ codes of a window's coded pages, or NULL */
    const size_t pq_bytes = (size_t)ap->H * B * ap->codecs.pq_m;
    for (uint64_t w0 = first; w0 < npages && rc == 0; w0 += W) {
        const uint64_t w1 = w0 + W < npages ? w0 + W : npages;
        size_t nc = 0;
        for (uint64_t pi = w0; pi < w1; pi++) {
            const size_t at = (size_t)(pi - w0);
            uint64_t p0 = pi * B, p1 = p0 + B < end ? p0 + B : end;
            kvd_page_desc d = {.dtype = ap->dtype,
                               .layer = l,
                               .token_start = p0,
                               .num_tokens = (uint32_t)(p1 - p0),
                               .page_tokens = B,
                               .num_kv_heads = ap->H,
                               .head_dim = ap->D};
            if (d.num_tokens == B && pi < pl->n_hashes) {
                d.has_prefix_hash = 1;
                d.prefix_hash = pl->hashes[pi];
            }
            uint64_t size = kvd_page_raw_size(&d);
            /* A page that seals is stored encoded (the raw tail rule),
             * unless the client encoded it (given_page). */
            given[at] = d.num_tokens == B ? given_page(ap, l, pi) : NULL;
            code_it[at] = ap->coded && d.num_tokens == B && p0 >= ap->sink_end && !given[at];
            /* A page given whole is stored as given: built only for its
             * PQ codes. */
            const int build = !given[at] || pq;
            if (build && tokens_skipped(ap, l, p0 > ap->ts ? p0 : ap->ts, p1)) {
                rc = kvd_error_set(err, KVD_EINVAL,
                                   "append: the bytes of layer %u tokens %llu..%llu were "
                                   "skipped, but no page was given for them",
                                   l, (unsigned long long)p0, (unsigned long long)p1);
                break;
            }
            /* A page stored as built (raw, no PQ section) is built where
             * the batch holds it; the others in a window buffer. */
            const int direct = !given[at] && !code_it[at] && !(pq && d.num_tokens == B);
            kvd__page *np = calloc(1, sizeof *np);
            /* One buffer per window slot, sized for a full page, serves
             * every page built there: the batch keeps its own copy. */
            if (build && !direct && !raw[at])
                raw[at] = malloc(full_size);
            if (!np || (build && !direct && !raw[at])) {
                free(np);
                rc = kvd_error_set(err, KVD_ENOMEM, "out of memory building pages");
                break;
            }
            nl->pages[pi] = np;
            np->id = (pi == first && tail) ? tail->id : atomic_fetch_add(&st->next_page_id, 1);
            np->refs = 1;
            np->num_tokens = d.num_tokens;
            np->bytes = size;
            np->nfrags = 0;
            uint8_t *dst = raw[at];
            in_batch[at] = 0;
            if (direct) {
                uint8_t key[KVD__PAGE_KEY_LEN];
                kvd__page_key(key, np->id);
                if (!(dst = kvd__batch_put(wb, b, key, sizeof key, (size_t)size))) {
                    rc = kvd_error_set(err, KVD_ENOMEM, "out of memory building pages");
                    break;
                }
                in_batch[at] = (size_t)(dst - wb->buf);
            }
            uint8_t *kp = NULL, *vp = NULL;
            if (build) {
                if ((rc = kvd_page_init_raw(&d, dst, (size_t)size, &kp, &vp, err)))
                    break;
                fill_section(ap, kp, p0, p1, old.k, tail_n, p0, L->tokens, wk);
                fill_section(ap, vp, p0, p1, old.v, tail_n, p0, L->tokens, wv);
                kvd_page_finish(dst, (size_t)size);
            }
            ds[at] = d;
            kps[at] = kp; /* (used only for pages not built in the batch) */
            if (code_it[at]) {
                cd[nc] = d;
                ck[nc] = kp;
                cv[nc] = vp;
                nc++;
            }
        }
        if (rc == 0 && nc)
            rc = encode_pages(st, nc, cd, &ap->codecs, ck, cv, coded, clen, &draw, &keep, err);
        size_t nimg = 0, nplaced = 0;
        if (rc == 0 && nc && draw.m && pq)
            rc = pq_window(ap, b, ds, kps, w1 - w0, cd, nc, &draw, &pqc, err);
        for (uint64_t pi = w0, ci = 0; pi < w1 && rc == 0; pi++) {
            const size_t at = (size_t)(pi - w0);
            const kvd_page_desc *d = &ds[at];
            kvd__page *np = nl->pages[pi];
            if (in_batch[at]) { /* already in the batch */
                keep_batched(ap, np->id, in_batch[at], (size_t)np->bytes, d->num_tokens);
                continue;
            }
            const uint8_t *wbytes = raw[at];
            size_t wlen = (size_t)np->bytes;
            uint8_t *own = NULL;
            const uint8_t *ready = NULL; /* its PQ codes, made with the window's */
            const struct given_page *gp = given[at];
            if (gp) {
                /* Encoded once at the client: these bytes are what is stored. */
                wbytes = gp->bytes;
                wlen = gp->len;
            } else if (code_it[at]) {
                wbytes = own = coded[ci];
                wlen = clen[ci];
                ready = pqc ? pqc + ci * pq_bytes : NULL;
                coded[ci++] = NULL;
            }
            np->bytes = wlen;
            if (pq && d->num_tokens == B) {
                /* The page seals: add its PQ codes (pqindex.h). */
                uint8_t *withpq = NULL;
                rc = kvd__pq_page_section(&ap->pq, st, s, &ap->codecs, b, d, kps[at], ready, wk,
                                          ap->ts, end, wbytes, wlen, &withpq, &wlen, err);
                free(own);
                own = NULL;
                if (rc)
                    break;
                wbytes = own = withpq;
                np->bytes = wlen;
            }
            uint8_t key[KVD__PAGE_KEY_LEN];
            kvd__page_key(key, np->id);
            uint8_t *dst = kvd__batch_put(wb, b, key, sizeof key, wlen);
            if (!dst) {
                free(own);
                rc = kvd_error_set(err, KVD_ENOMEM, "out of memory building pages");
                break;
            }
            memcpy(dst, wbytes, wlen);
            if (code_it[at] && keep.scratch) {
                /* its device copies read a copy of their own */
                struct built_page *bp = keep_built(ap, np->id, wbytes, wlen, d->num_tokens);
                if (bp)
                    nimg += place_coded(ap, bp, &keep, ci - 1, img + nimg, placed, &nplaced);
            } else {
                keep_batched(ap, np->id, (size_t)(dst - wb->buf), wlen, d->num_tokens);
            }
            free(own);
        }
        if (nimg && kvd_backend_copy_batch(kvd_store_device(st), img, nimg, NULL) != 0)
            for (size_t i = 0; i < nplaced; i++) /* they go up at the insert */
                kvd__cache_unreserve(st, &ap->built[placed[i]].slot);
        for (size_t i = 0; i < nc; i++) {
            free(coded[i]);
            coded[i] = NULL;
        }
        kvd_dev_sections_free(&keep);
        dev_raw_free(&draw);
        free(pqc);
        pqc = NULL;
    }
    for (size_t i = 0; i < KVD__ENCODE_WINDOW; i++)
        free(raw[i]);
    if (rc)
        goto fail;
    kvd__tail_release(&old);
    return 0;
fail:
    kvd__tail_release(&old);
    for (uint64_t pi = first; pi < npages; pi++)
        free(nl->pages[pi]);
    free(nl->pages);
    memset(nl, 0, sizeof *nl);
    return rc;
}

uint64_t kvd_store_append_index_bound(const kvd_append *ap)
{
    if (!ap || !ap->codecs.pq_m)
        return 0;
    const kvd_store *st = ap->st;
    const uint64_t B = st->page_tokens;
    if ((ap->ts + ap->n) / B == ap->ts / B)
        return 0; /* seals no page */
    if (ap->ts + ap->n < ap->codecs.pq_min_train_tokens)
        return 0; /* trains nothing yet */
    const uint64_t rec = kvd__pq_record_bytes(ap->H, ap->D, ap->codecs.pq_bits);
    uint64_t bound = 0;
    pthread_mutex_lock(&ap->s->mu);
    const uint64_t own = ap->s->prefix_blocks * B; /* its first own page */
    for (uint32_t l = ap->ls; l < ap->ls + ap->nl && l < ap->s->num_layers; l++) {
        if (ap->s->layers[l].pq.bytes)
            continue;
        /* and the codes of its own pages sealed before (pqindex.h) */
        const uint64_t sealed = ap->s->layers[l].tokens / B * B;
        bound +=
            rec + (sealed > own ? kvd__pq_codes_bytes(ap->H, ap->codecs.pq_m, sealed - own) : 0);
    }
    pthread_mutex_unlock(&ap->s->mu);
    return bound;
}

int kvd_store_append_commit(kvd_append *ap, kvd_seq_info *info, kvd_error *err)
{
    if (info)
        memset(info, 0, sizeof *info);
    if (!ap)
        return kvd_error_set(err, KVD_EINVAL, "append commit: NULL append");
    kvd_store *st = ap->st;
    kvd__seq *s = ap->s;
    int rc = 0;
    if (ap->failed) {
        rc = kvd_error_set(err, KVD_EINVAL, "append failed earlier; nothing was stored");
        kvd_store_append_abort(ap);
        return rc;
    }
    if (ap->have != ap->expected) {
        rc =
            kvd_error_set(err, KVD_EINVAL, "append received %llu of %llu bytes; nothing was stored",
                          (unsigned long long)ap->have, (unsigned long long)ap->expected);
        kvd_store_append_abort(ap);
        return rc;
    }

    if (st->disk_limit) {
        /* Page bytes this append adds at most: its payload plus one header
         * per page or fragment it writes. */
        uint64_t pages = ap->nl * (ap->n / st->page_tokens + 2);
        uint64_t need = ap->expected + pages * (64 + 3 * 24);
        if (ap->codecs.pq_m) /* and the PQ section of every page that seals */
            need += pages * (24 + KVD_PAGE_PQ_HEADER +
                             (uint64_t)ap->H * st->page_tokens * ap->codecs.pq_m);
        need += kvd_store_append_index_bound(ap); /* and centroids it may train */
        if (st->durability == KVD_DURABILITY_NONE)
            kvd__disk_make_room(st, s, need);
        uint64_t have = atomic_load(&st->disk_bytes);
        if (have + need > st->disk_limit) {
            rc = kvd_error_set(err, KVD_ENOMEM,
                               "the store holds %llu page bytes; %llu more exceed the disk limit "
                               "of %llu",
                               (unsigned long long)have, (unsigned long long)need,
                               (unsigned long long)st->disk_limit);
            kvd_store_append_abort(ap);
            return rc;
        }
    }

    pthread_mutex_lock(&s->mu);
    id_plan pl = {0};
    kvd__layer *nls = NULL;
    uint8_t *rec = NULL;
    size_t rlen = 0;
    rocksdb_writebatch_t *b = NULL;
    kvd__batch wb = {0};  /* the pages, and b's records after them */
    uint64_t *act = NULL; /* new activation counts */
    if (s->dead) {
        char idb[KVD__ID_STR_MAX];
        rc = kvd_error_set(err, KVD_ENOTFOUND, "sequence %s was deleted during the append",
                           kvd__id_str(s->id, s->id_len, idb, sizeof idb));
        goto out;
    }
    if ((rc = check_state(st, s, ap, err)) || (rc = plan_ids(st, s, ap, &pl, err)))
        goto out;
    nls = calloc(s->num_layers, sizeof *nls);
    if (!nls) {
        rc = kvd_error_set(err, KVD_ENOMEM, "out of memory");
        goto out;
    }
    b = rocksdb_writebatch_create();
    /* room for the pages (as large as the payload when raw) and their keys
     * and headers: one buffer, not one doubling after another */
    kvd__batch_init(&wb, st,
                    (size_t)ap->expected + (size_t)ap->nl * (ap->n / st->page_tokens + 2) * 256);
    for (uint32_t l = 0; l < s->num_layers; l++) {
        if (l < ap->ls || l >= ap->ls + ap->nl) {
            nls[l] = s->layers[l]; /* shallow: unchanged */
            continue;
        }
        if ((rc = build_layer(ap, l, &pl, &wb, b, &nls[l], err)))
            goto out;
    }
    if (ap->with_x && (rc = kvd__act_stage(st, s, ap->ls, ap->nl, ap->ts, ap->n,
                                           ap->buf + ap->x_off, b, &act, err)))
        goto out;
    if ((rc = kvd__seq_encode(st, s, nls, pl.hashes, pl.n_hashes, pl.ids, pl.n_ids, &rec, &rlen,
                              err)))
        goto out;
    uint8_t key[1 + KVD_SEQ_ID_MAX];
    size_t klen;
    kvd__seq_key(s, key, &klen);
    rocksdb_writebatch_put(b, (const char *)key, klen, (const char *)rec, rlen);
    uint64_t now = kvd__now_ms();
    if (s->ttl_ms)
        kvd__expiry_put(b, s, s->ttl_ms, now + s->ttl_ms);
    if ((rc = kvd__batch_write(&wb, b, err)))
        goto out;
    if (s->ttl_ms)
        atomic_store(&s->expires_ms, now + s->ttl_ms);
    atomic_store(&s->last_access_ms, now);

    /* Durable: publish. Nothing below can fail. */
    pthread_rwlock_wrlock(&st->lock);
    int64_t dbytes = 0, dpages = 0;
    for (uint32_t l = ap->ls; l < ap->ls + ap->nl; l++) {
        kvd__layer *L = &s->layers[l];
        uint64_t first = L->tokens / st->page_tokens;
        for (uint32_t i = (uint32_t)first; i < nls[l].npages; i++) {
            dbytes += (int64_t)nls[l].pages[i]->bytes;
            dpages++;
        }
        if (L->tokens % st->page_tokens) {
            dbytes -= (int64_t)L->pages[first]->bytes;
            dpages--;
            free(L->pages[first]); /* the old tail, private to this sequence */
        }
        free(L->pages);
        const kvd__pq_index pq = L->pq; /* unchanged here (kvd__pq_append_done) */
        *L = nls[l];
        L->pq = pq;
    }
    free(s->hashes);
    free(s->ids);
    s->hashes = pl.hashes;
    s->n_hashes = s->cap_hashes = pl.n_hashes;
    s->ids = pl.ids;
    s->n_ids = s->cap_ids = pl.n_ids;
    memset(&pl, 0, sizeof pl);
    free(nls);
    nls = NULL;
    kvd__prefix_register(st, s);
    if (act) {
        kvd__act_publish(st, s, act);
        act = NULL;
    }
    atomic_fetch_add(&st->disk_bytes, (uint64_t)dbytes);
    atomic_fetch_add(&st->disk_pages, (uint64_t)dpages);
    const uint64_t pq_added = kvd__pq_append_done(ap->pq, st, s); /* centroids trained */
    if (info) {
        rc = kvd__seq_fill_info(st, s, info, err);
        info->pq_bytes_added = pq_added;
    }
    pthread_rwlock_unlock(&st->lock);
    /* Durable and published: the new pages enter the device tier. Still
     * under s->mu, so a delete of this sequence cannot drop them first. */
    kvd__cache_put *puts = ap->nbuilt ? malloc(ap->nbuilt * sizeof *puts) : NULL;
    for (size_t i = 0; puts && i < ap->nbuilt; i++) {
        const struct built_page *bp = &ap->built[i];
        puts[i] = (kvd__cache_put){bp->id, bp->bytes ? bp->bytes : wb.buf + bp->off, bp->len,
                                   bp->num_tokens, bp->slot};
        memset(&ap->built[i].slot, 0, sizeof ap->built[i].slot); /* the insert's now */
    }
    if (puts) /* (without, they are read from RocksDB when wanted) */
        kvd__cache_insert_batch(st, puts, ap->nbuilt, 0, NULL);
    free(puts);
out:
    if (nls) {
        for (uint32_t l = ap->ls; l < ap->ls + ap->nl && l < s->num_layers; l++) {
            if (!nls[l].pages)
                continue;
            uint64_t first = s->layers[l].tokens / st->page_tokens;
            for (uint32_t i = (uint32_t)first; i < nls[l].npages; i++)
                free(nls[l].pages[i]);
            free(nls[l].pages);
        }
        free(nls);
    }
    if (b)
        rocksdb_writebatch_destroy(b);
    kvd__batch_release(&wb);
    free(rec);
    free(act);
    plan_free(&pl);
    pthread_mutex_unlock(&s->mu);
    kvd_store_append_abort(ap);
    return rc;
}
