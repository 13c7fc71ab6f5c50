/*
 * Prefix index: content-addressed blocks shared between sequences.
 *
 * Each model has a map hash -> kvd__prefix naming the sealed pages (one per
 * layer) of block `block` of some sequence. An entry is added when every
 * layer of a block of a sequence is sealed and the block's hash is known. It
 * holds no reference of its own: it lives exactly as long as its pages, i.e.
 * while some sequence (the one that wrote the block, or one created from the
 * prefix) still holds them. When the last holder goes, another sequence with
 * its own copy of a block with the same hash takes over the entry.
 *
 * The index is not persisted: kvd_store_open rebuilds it from the sequences'
 * page tables and block hashes.
 */
#include "store_internal.h"

#include <stdlib.h>
#include <string.h>

/* Complete blocks of a sequence: every layer holds that many sealed pages. */
static uint64_t complete_blocks(const kvd_store *st, const kvd__seq *s)
{
    uint64_t min = UINT64_MAX;
    for (uint32_t l = 0; l < s->num_layers; l++)
        if (s->layers[l].tokens < min)
            min = s->layers[l].tokens;
    return min / st->page_tokens;
}

static int add_entry(kvd__model *m, const kvd__seq *s, uint64_t block)
{
    kvd__prefix *e = calloc(1, sizeof *e);
    kvd__page **pages = calloc(s->num_layers, sizeof *pages);
    if (!e || !pages || kvd__map_put(&m->prefixes, s->hashes[block], e)) {
        free(e);
        free(pages);
        return KVD_ENOMEM;
    }
    e->hash = s->hashes[block];
    e->block = block;
    e->pages = pages;
    for (uint32_t l = 0; l < s->num_layers; l++) {
        pages[l] = s->layers[l].pages[block];
        pages[l]->prefix = e;
    }
    return 0;
}

void kvd__prefix_register(kvd_store *st, kvd__seq *s)
{
    uint64_t limit = complete_blocks(st, s);
    if (limit > s->n_hashes)
        limit = s->n_hashes;
    kvd__model *m = s->model;
    for (uint64_t i = s->registered_blocks; i < limit; i++) {
        /* A hash already present (this prefix is shared, or another sequence
         * stored the same tokens first) keeps its entry. */
        if (!kvd__map_get(&m->prefixes, s->hashes[i]) && add_entry(m, s, i))
            return; /* out of memory: retried at the next commit */
        s->registered_blocks = i + 1;
    }
}

void kvd__page_drop(kvd_store *st, kvd__model *m, kvd__page *p, uint64_t *dropped, size_t *ndropped)
{
    if (--p->refs > 0)
        return;
    /* The page left RocksDB with its last holder: out of the tiers too. */
    kvd__cache_drop(st, p->id);
    atomic_fetch_sub(&st->disk_bytes, p->bytes);
    atomic_fetch_sub(&st->disk_pages, 1);
    kvd__prefix *e = p->prefix;
    if (e) {
        kvd__map_del(&m->prefixes, e->hash);
        dropped[(*ndropped)++] = e->hash;
        /* Every layer's page of the block goes with this holder; unlink all so
         * none points at the freed entry. */
        for (uint32_t l = 0; l < m->info.num_layers; l++)
            if (e->pages[l])
                e->pages[l]->prefix = NULL;
        free(e->pages);
        free(e);
    }
    free(p);
}

void kvd__prefix_reregister(kvd_store *st, kvd__model *m, const uint64_t *dropped, size_t n)
{
    for (size_t k = 0; k < n; k++) {
        uint64_t h = dropped[k];
        if (kvd__map_get(&m->prefixes, h))
            continue;
        for (size_t i = 0; i < st->nseqs; i++) {
            kvd__seq *s = st->seqs[i];
            if (s->model != m)
                continue;
            uint64_t lim = s->registered_blocks;
            for (uint64_t b = 0; b < lim; b++) {
                if (s->hashes[b] == h) {
                    add_entry(m, s, b);
                    goto next;
                }
            }
        }
    next:;
    }
}

int kvd_store_lookup(kvd_store *st, const char *model, const uint64_t *hashes, size_t n,
                     uint64_t *matched, kvd_error *err)
{
    if (matched)
        *matched = 0;
    if (!st || !model || !matched || (n && !hashes))
        return kvd_error_set(err, KVD_EINVAL, "lookup: NULL argument");
    pthread_rwlock_rdlock(&st->lock);
    kvd__model *m = kvd__model_find(st, model);
    if (!m) {
        pthread_rwlock_unlock(&st->lock);
        return kvd_error_set(err, KVD_ENOTFOUND, "model %s not found", model);
    }
    uint64_t i = 0;
    for (; i < n; i++) {
        kvd__prefix *e = kvd__map_get(&m->prefixes, hashes[i]);
        if (!e || e->block != i)
            break;
    }
    pthread_rwlock_unlock(&st->lock);
    *matched = i;
    return 0;
}
