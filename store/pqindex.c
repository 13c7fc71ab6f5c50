/*
 * The stored PQ index (pqindex.h): centroid records and the append hook that
 * writes the PQ-codes section of every sealing page.
 */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#define XXH_INLINE_ALL
#include <xxhash.h>

#include "kvdepot/convert.h"
#include "kvdepot/pq.h"
#include "pqindex.h"
#include "store_internal.h"

#define KEY_PQ 'Q'
#define REC_VERSION 1
#define REC_HEADER 12
#define CODES_VERSION 1
#define CODES_HEADER 16
#define CODES_KEY_EXTRA 12 /* be64 token_start be32 num_tokens after the record key */

struct kvd__pq_append {
    uint32_t num_layers;
    struct pq_layer {
        int known; /* centroids loaded or trained */
        uint32_t trained; /* bytes of the records this append's batch writes, or 0 */
        uint32_t codes_n; /* tokens [codes_t0, + codes_n) in its codes record, if any */
        uint64_t codes_t0;
        kvd_pq_centroids c;
        float *dev_c; /* c.data in the device's memory (scratch of dev), or NULL */
    } * layers;
    float *keys; /* page keys of one head, f32 (page_tokens, head_dim) */
    size_t cap_keys;
    kvd_backend *dev; /* holds the layers' dev_c */
};

static size_t pq_key(uint8_t *key, const void *id, size_t id_len, uint32_t layer)
{
    key[0] = KEY_PQ;
    key[1] = (uint8_t)(id_len >> 8);
    key[2] = (uint8_t)id_len;
    memcpy(key + 3, id, id_len);
    for (int i = 0; i < 4; i++)
        key[3 + id_len + i] = (uint8_t)(layer >> (24 - 8 * i));
    return 3 + id_len + 4;
}

/* The key of the codes record of tokens [t0, t0 + n) of a layer. */
static size_t codes_key(uint8_t *key, const void *id, size_t id_len, uint32_t layer, uint64_t t0,
                        uint32_t n)
{
    size_t k = pq_key(key, id, id_len, layer);
    for (int i = 0; i < 8; i++)
        key[k + i] = (uint8_t)(t0 >> (56 - 8 * i));
    for (int i = 0; i < 4; i++)
        key[k + 8 + i] = (uint8_t)(n >> (24 - 8 * i));
    return k + CODES_KEY_EXTRA;
}

uint64_t kvd__pq_codes_bytes(uint32_t H, uint32_t m, uint64_t n)
{
    return CODES_HEADER + (uint64_t)H * n * m;
}

void kvd_pq_codes_clear(kvd_pq_codes *c)
{
    if (!c)
        return;
    free(c->codes);
    memset(c, 0, sizeof *c);
}

void kvd_pq_centroids_clear(kvd_pq_centroids *c)
{
    if (!c)
        return;
    free(c->data);
    memset(c, 0, sizeof *c);
}

static uint64_t cent_floats(uint32_t H, uint32_t D, uint32_t bits)
{
    return (uint64_t)H * D * ((uint64_t)1 << bits); /* H * m * 2^bits * (D/m) */
}

static uint32_t ld32(const uint8_t *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static uint32_t ld32be(const uint8_t *p)
{
    return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | (uint32_t)p[3];
}

static void st32(uint8_t *p, uint32_t v)
{
    for (int i = 0; i < 4; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}

/* ---- the cache of centroid records ----------------------------------------
 * Keyed by the record's version (kvd__pq_index.gen), unique in the store: a
 * record rewritten (a later training, a rebuild) or deleted with its
 * sequence is never found again, so nothing has to be invalidated; slots
 * go least recently used first. Entries hold what the reader returns. */
struct kvd__pq_cached {
    uint64_t gen, tick;
    kvd_pq_centroids c; /* c.data: cent_floats(...) floats */
    size_t bytes;
};

void kvd__pq_cache_init(kvd_store *st)
{
    pthread_mutex_init(&st->pqc_mu, NULL);
    st->pqc = calloc(KVD__PQ_CACHE_ENTRIES, sizeof *st->pqc); /* NULL: no cache */
}

void kvd__pq_cache_fini(kvd_store *st)
{
    for (size_t i = 0; st->pqc && i < KVD__PQ_CACHE_ENTRIES; i++)
        free(st->pqc[i].c.data);
    free(st->pqc);
    st->pqc = NULL;
    pthread_mutex_destroy(&st->pqc_mu);
}

uint64_t kvd__pq_new_gen(kvd_store *st)
{
    return atomic_fetch_add(&st->pq_gen, 1) + 1;
}

uint64_t kvd__pq_cache_hits(kvd_store *st)
{
    return atomic_load(&st->pqc_hits);
}

/* 1 and *out a copy of the record of version gen when the cache has it. */
static int cache_get(kvd_store *st, uint64_t gen, kvd_pq_centroids *out)
{
    int hit = 0;
    pthread_mutex_lock(&st->pqc_mu);
    for (size_t i = 0; st->pqc && i < KVD__PQ_CACHE_ENTRIES && !hit; i++) {
        struct kvd__pq_cached *e = &st->pqc[i];
        if (e->gen != gen || !e->c.data)
            continue;
        float *d = malloc(e->bytes);
        if (d) {
            memcpy(d, e->c.data, e->bytes);
            *out = e->c;
            out->data = d;
            e->tick = ++st->pqc_tick;
            hit = 1;
        }
        break;
    }
    pthread_mutex_unlock(&st->pqc_mu);
    if (hit)
        atomic_fetch_add(&st->pqc_hits, 1);
    return hit;
}

static void cache_put(kvd_store *st, uint64_t gen, const kvd_pq_centroids *c, size_t bytes)
{
    if (bytes > KVD__PQ_CACHE_BYTES / 4)
        return;
    float *d = malloc(bytes);
    if (!d)
        return;
    memcpy(d, c->data, bytes);
    pthread_mutex_lock(&st->pqc_mu);
    struct kvd__pq_cached *slot = NULL;
    for (;;) { /* a free slot within the budget, evicting the least recent */
        struct kvd__pq_cached *lru = NULL, *free_slot = NULL;
        for (size_t i = 0; st->pqc && i < KVD__PQ_CACHE_ENTRIES; i++) {
            struct kvd__pq_cached *e = &st->pqc[i];
            if (e->c.data && e->gen == gen) { /* another reader put it */
                lru = free_slot = NULL;
                break;
            }
            if (!e->c.data)
                free_slot = free_slot ? free_slot : e;
            else if (!lru || e->tick < lru->tick)
                lru = e;
        }
        if (!free_slot && !lru)
            break;
        if (free_slot && st->pqc_bytes + bytes <= KVD__PQ_CACHE_BYTES) {
            slot = free_slot;
            break;
        }
        if (!lru)
            break;
        st->pqc_bytes -= lru->bytes;
        free(lru->c.data);
        memset(lru, 0, sizeof *lru);
    }
    if (slot) {
        slot->gen = gen;
        slot->tick = ++st->pqc_tick;
        slot->c = *c;
        slot->c.data = d;
        slot->bytes = bytes;
        st->pqc_bytes += bytes;
        d = NULL;
    }
    pthread_mutex_unlock(&st->pqc_mu);
    free(d);
}

int kvd_store_pq_centroids_get(kvd_store *st, const void *seq_id, size_t id_len, uint32_t layer,
                               kvd_pq_centroids *out, int *found, kvd_error *err)
{
    memset(out, 0, sizeof *out);
    *found = 0;
    int rc = kvd__check_seq_id(seq_id, id_len, err);
    if (rc)
        return rc;
    /* The version of the layer's record, read before the record itself:
     * a record written meanwhile is then kept under the version it
     * replaced, which no later reader asks for. */
    uint64_t gen = 0;
    pthread_rwlock_rdlock(&st->lock);
    const kvd__seq *s = kvd__seq_find(st, seq_id, id_len, NULL);
    if (s && layer < s->num_layers)
        gen = s->layers[layer].pq.gen;
    pthread_rwlock_unlock(&st->lock);
    if (gen && cache_get(st, gen, out)) {
        *found = 1;
        return 0;
    }
    uint8_t key[3 + KVD_SEQ_ID_MAX + 4];
    size_t klen = pq_key(key, seq_id, id_len, layer), len = 0;
    char *e = NULL;
    char *v = rocksdb_get(st->db, st->ropt, (const char *)key, klen, &len, &e);
    if (e) {
        rc = kvd_error_set(err, KVD_EINTERNAL, "reading PQ centroids: %s", e);
        free(e);
        return rc;
    }
    if (!v)
        return 0;
    const uint8_t *p = (const uint8_t *)v;
    if (len < REC_HEADER || p[0] != REC_VERSION) {
        free(v);
        return kvd_error_set(err, KVD_ECORRUPT, "PQ centroid record of layer %u: %zu bytes", layer,
                             len);
    }
    out->bits = p[1];
    out->m = (uint32_t)p[2] | (uint32_t)p[3] << 8;
    out->num_kv_heads = ld32(p + 4);
    out->head_dim = ld32(p + 8);
    if ((out->bits != 4 && out->bits != 6 && out->bits != 8) || out->m == 0 || out->head_dim == 0 ||
        out->head_dim > KVD_PAGE_MAX_HEAD_DIM || out->head_dim % out->m || out->num_kv_heads == 0 ||
        out->num_kv_heads > KVD_PAGE_MAX_HEADS ||
        len != REC_HEADER + 4 * cent_floats(out->num_kv_heads, out->head_dim, out->bits)) {
        free(v);
        memset(out, 0, sizeof *out);
        return kvd_error_set(err, KVD_ECORRUPT, "PQ centroid record of layer %u is malformed",
                             layer);
    }
    out->data = malloc(len - REC_HEADER);
    if (!out->data) {
        free(v);
        memset(out, 0, sizeof *out);
        return kvd_error_set(err, KVD_ENOMEM, "out of memory for PQ centroids");
    }
    memcpy(out->data, p + REC_HEADER, len - REC_HEADER); /* little-endian host */
    out->id = XXH3_64bits(p, len);
    free(v);
    *found = 1;
    if (gen)
        cache_put(st, gen, out, len - REC_HEADER);
    return 0;
}

int kvd_pq_train_head(kvd_backend *be, const float *keys, int64_t n, uint32_t head_dim, uint32_t m,
                      uint32_t bits, uint32_t iterations, uint32_t layer, uint32_t h, float *cent,
                      kvd_error *err)
{
    int64_t ntrain = n < KVD_PQ_TRAIN_TOKENS ? n : KVD_PQ_TRAIN_TOKENS;
    int64_t ts[2] = {ntrain, head_dim}, cs[3] = {m, (int64_t)1 << bits, head_dim / m};
    kvd_tensor train = kvd_tensor_make(KVD_DTYPE_F32, (void *)keys, 2, ts);
    kvd_tensor tc = kvd_tensor_make(KVD_DTYPE_F32, cent, 3, cs);
    kvd_kmeans_params km = {1 << bits, (int)iterations, (uint64_t)layer * 65536 + h, 0};
    return kvd_pq_train(be, &train, &km, &tc, err);
}

/* rows (n, D) of dtype at src with a row stride of `stride` bytes -> f32 dst. */
static int to_f32(kvd_backend *be, kvd_dtype dt, const uint8_t *src, int64_t n, uint32_t D,
                  int64_t stride, float *dst, kvd_error *err)
{
    if (n == 0)
        return 0;
    int64_t sh[2] = {n, D};
    kvd_tensor s = kvd_tensor_make(dt, (void *)src, 2, sh);
    s.stride[0] = stride;
    kvd_tensor d = kvd_tensor_make(KVD_DTYPE_F32, dst, 2, sh);
    return kvd_convert(be, &d, &s, err);
}

static size_t align256(size_t x)
{
    return (x + 255) & ~(size_t)255;
}

/* kvd_pq_train_head on the device: the keys (host) go up, the centroids
 * (host) come down. */
static int train_head_device(kvd_backend *dev, const float *keys, int64_t n, uint32_t D,
                             const kvd_seq_codecs *c, uint32_t layer, uint32_t h, float *cent,
                             kvd_error *err)
{
    const int64_t ntrain = n < KVD_PQ_TRAIN_TOKENS ? n : KVD_PQ_TRAIN_TOKENS;
    const size_t kb = align256(sizeof(float) * (size_t)ntrain * D),
                 cb = sizeof(float) * (size_t)cent_floats(1, D, c->pq_bits);
    uint8_t *m = NULL;
    int rc = kvd_backend_scratch(dev, kb + cb, (void **)&m, err);
    if (rc)
        return rc;
    float *dk = (float *)(void *)m, *dc = (float *)(void *)(m + kb);
    if ((rc = kvd_backend_upload(dev, dk, keys, sizeof(float) * (size_t)ntrain * D, err)) == 0 &&
        (rc = kvd_pq_train_head(dev, dk, ntrain, D, c->pq_m, c->pq_bits, c->pq_iterations, layer, h,
                                dc, err)) == 0)
        rc = kvd_backend_download(dev, cent, dc, cb, err);
    kvd_backend_scratch_free(dev, m);
    return rc;
}

/* The ids of sealed pages [first, first + n) of a layer: id[blk - first]. */
typedef struct page_ids {
    uint64_t first, n;
    uint64_t *id;
} page_ids;

/* Pages [first, first + n) of layer `layer` of s (under s->mu), which must
 * be sealed, into *out (free out->id). */
static int layer_page_ids(const kvd__seq *s, uint32_t layer, uint32_t B, uint64_t first, uint64_t n,
                          page_ids *out, kvd_error *err)
{
    const kvd__layer *L = &s->layers[layer];
    out->first = first;
    out->n = n;
    out->id = malloc(sizeof(uint64_t) * (n ? n : 1));
    if (!out->id)
        return kvd_error_set(err, KVD_ENOMEM, "out of memory");
    for (uint64_t i = 0; i < n; i++) {
        const uint64_t blk = first + i;
        if (blk >= L->npages || !L->pages[blk] || L->pages[blk]->num_tokens != B) {
            free(out->id);
            out->id = NULL;
            return kvd_error_set(err, KVD_EINTERNAL,
                                 "PQ index: page %llu of layer %u is not sealed",
                                 (unsigned long long)blk, layer);
        }
        out->id[i] = L->pages[blk]->id;
    }
    return 0;
}

/*
 * Keys of tokens [t0, t0 + n) of layer d->layer, in the sealed pages of pi
 * (whole pages, t0 a page start), decoded to f32 head-major into out
 * (H, n, D): the keys the pages give back (exact for raw K, the decoded
 * values of a lossy K codec).
 */
static int stored_keys(kvd_store *st, kvd_backend *be, const kvd_seq_codecs *c, const page_ids *pi,
                       const kvd_page_desc *d, uint64_t t0, uint64_t n, float *out, kvd_error *err)
{
    const uint32_t H = d->num_kv_heads, D = d->head_dim, B = d->page_tokens;
    float *page = malloc(sizeof(float) * (size_t)H * B * D);
    if (!page)
        return kvd_error_set(err, KVD_ENOMEM, "out of memory reading keys for PQ training");
    int rc = 0;
    for (uint64_t t = t0; t < t0 + n && rc == 0; t += B) {
        const uint64_t blk = t / B, take = t0 + n - t < B ? t0 + n - t : B;
        if (blk < pi->first || blk >= pi->first + pi->n) {
            rc = kvd_error_set(err, KVD_EINTERNAL, "PQ index: page %llu of layer %u not known",
                               (unsigned long long)blk, d->layer);
            break;
        }
        kvd__tail_want w = {.page_id = pi->id[blk - pi->first],
                            .layer = d->layer,
                            .p0 = blk * B,
                            .need = B,
                            .B = B,
                            .H = H,
                            .D = D,
                            .dtype = d->dtype};
        kvd__tail pg = {0};
        if ((rc = kvd__tail_load(st, st->ropt, &w, &pg, err))) {
            if (rc == KVD_ECORRUPT)
                kvd__note_corrupt(st, w.page_id, err);
            break;
        }
        size_t vlen = 0;
        const char *v = pg.ps ? rocksdb_pinnableslice_value(pg.ps, &vlen) : NULL;
        kvd_page_view view;
        if (!v || pg.nfrags)
            rc = kvd_error_set(err, KVD_ECORRUPT, "PQ training: page %llu is not whole",
                               (unsigned long long)w.page_id);
        else if ((rc = kvd_page_decode_trusted(v, vlen, &view, err)) == 0)
            rc = kvd_page_decode_section(be, &view, KVD_SECTION_K, c->arts, KVD_DTYPE_F32, page,
                                         err);
        kvd__tail_release(&pg);
        for (uint32_t h = 0; h < H && rc == 0; h++)
            memcpy(out + ((size_t)h * n + (t - t0)) * D, page + (size_t)h * B * D,
                   sizeof(float) * take * D);
    }
    free(page);
    return rc;
}

/* The header of a centroid record of H kv heads x D into rec; the
 * centroids follow (12-byte offset: float-aligned). */
static float *rec_header(uint8_t *rec, const kvd_seq_codecs *c, uint32_t H, uint32_t D)
{
    rec[0] = REC_VERSION;
    rec[1] = c->pq_bits;
    rec[2] = (uint8_t)c->pq_m;
    rec[3] = (uint8_t)(c->pq_m >> 8);
    st32(rec + 4, H);
    st32(rec + 8, D);
    return (float *)(void *)(rec + REC_HEADER);
}

/* Centroids of kv head h of `layer` from n keys (n, D) f32 (host): on the
 * store's device when it has one (the CPU when the device fails in a way
 * kvd_store_device_fallback takes), else on train_be. */
static int train_head(kvd_store *st, kvd_backend *train_be, const kvd_seq_codecs *c, uint32_t layer,
                      uint32_t h, const float *keys, int64_t n, uint32_t D, float *cent,
                      kvd_error *err)
{
    kvd_backend *dev = kvd_store_device(st);
    int rc = -1;
    if (dev && (rc = train_head_device(dev, keys, n, D, c, layer, h, cent, err)) &&
        !kvd_store_device_fallback(st, rc, err))
        return rc;
    if (rc)
        rc = kvd_pq_train_head(train_be, keys, n, D, c->pq_m, c->pq_bits, c->pq_iterations, layer,
                               h, cent, err);
    return rc;
}

/* Train the centroids of layer d->layer from the keys of the sequence's own
 * pages sealed before this append (stored without codes while the layer
 * held fewer than pq_min_train_tokens tokens), the page keys and the wire
 * keys after the page, and put the record into b. */
/* Training runs once per (sequence, layer) but is the heaviest step of an
 * append (K-means over up to KVD_PQ_TRAIN_TOKENS keys per kv head): it runs
 * on the store's backend with every thread (train_be), where the conversions
 * keep the one-thread coding backend (be). K-means does not depend on the
 * thread count. With a device (the store's) it runs there (the GPU's
 * K-means: other centroids than the CPU's, of the same quality), or on the
 * CPU when the device fails. */
static int early_codes(kvd_store *st, kvd_backend *be, kvd_backend *train_be,
                       const kvd_seq_codecs *c, struct rocksdb_writebatch_t *b, const kvd__seq *s,
                       const page_ids *pi, const float *known, uint64_t nknown,
                       const kvd_page_desc *d, uint64_t own, const kvd_pq_centroids *cent,
                       uint32_t *bytes, kvd_error *err);

/* What the codes record of a training append holds (early_codes). */
typedef struct codes_made {
    uint32_t bytes, n;
    uint64_t t0;
} codes_made;

static int train_layer(kvd_store *st, kvd_backend *be, kvd_backend *train_be,
                       const kvd_seq_codecs *c, struct rocksdb_writebatch_t *b, const kvd__seq *s,
                       const kvd_page_desc *d, const uint8_t *k_page, const uint8_t *wire_k,
                       uint64_t wire_ts, uint64_t wire_end, kvd_pq_centroids *out, codes_made *made,
                       kvd_error *err)
{
    const uint32_t H = d->num_kv_heads, D = d->head_dim, B = d->page_tokens;
    const size_t es = kvd_dtype_size(d->dtype);
    /* The sequence's own pages start after a shared prefix. */
    const uint64_t own = s->prefix_blocks * B;
    const uint64_t early = d->token_start > own ? d->token_start - own : 0;
    uint64_t p1 = d->token_start + B, more = wire_end > p1 ? wire_end - p1 : 0;
    int64_t n = (int64_t)early + (int64_t)B + (int64_t)more;
    if (n > KVD_PQ_TRAIN_TOKENS)
        n = KVD_PQ_TRAIN_TOKENS;
    int64_t from_early = (int64_t)early < n ? (int64_t)early : n;
    int64_t from_page = n - from_early < (int64_t)B ? n - from_early : (int64_t)B;
    int64_t from_wire = n - from_early - from_page;
    uint64_t nf = cent_floats(H, D, c->pq_bits);
    size_t rlen = (size_t)kvd__pq_record_bytes(H, D, c->pq_bits);
    uint8_t *rec = malloc(rlen);
    float *keys = malloc(sizeof(float) * (size_t)n * D);
    float *ek = from_early ? malloc(sizeof(float) * (size_t)from_early * H * D) : NULL;
    page_ids pi = {0};
    int rc = 0;
    if (!rec || !keys || (from_early && !ek)) {
        rc = kvd_error_set(err, KVD_ENOMEM, "out of memory training PQ centroids");
        goto done;
    }
    if (early && (rc = layer_page_ids(s, d->layer, B, own / B, early / B, &pi, err)))
        goto done;
    if (from_early && (rc = stored_keys(st, be, c, &pi, d, own, (uint64_t)from_early, ek, err)))
        goto done;
    float *cent = rec_header(rec, c, H, D);
    for (uint32_t h = 0; h < H && rc == 0; h++) {
        const uint8_t *ph = k_page + (size_t)h * B * D * es;
        const uint8_t *wh = wire_k + ((size_t)(p1 - wire_ts) * H + h) * D * es;
        if (from_early)
            memcpy(keys, ek + (size_t)h * from_early * D, sizeof(float) * from_early * D);
        if ((from_page && (rc = to_f32(be, d->dtype, ph, from_page, D, (int64_t)(D * es),
                                       keys + (size_t)from_early * D, err))) ||
            (from_wire && (rc = to_f32(be, d->dtype, wh, from_wire, D, (int64_t)(H * D * es),
                                       keys + (size_t)(from_early + from_page) * D, err))))
            break;
        rc = train_head(st, train_be, c, d->layer, h, keys, n, D, cent + (size_t)h * (nf / H), err);
    }
    if (rc)
        goto done;
    uint8_t key[3 + KVD_SEQ_ID_MAX + 4];
    size_t klen = pq_key(key, s->id, s->id_len, d->layer);
    rocksdb_writebatch_put((rocksdb_writebatch_t *)b, (const char *)key, klen, (const char *)rec,
                           rlen);
    out->num_kv_heads = H;
    out->head_dim = D;
    out->m = c->pq_m;
    out->bits = c->pq_bits;
    out->id = XXH3_64bits(rec, rlen);
    out->data = malloc(4 * (size_t)nf);
    if (!out->data) {
        rc = kvd_error_set(err, KVD_ENOMEM, "out of memory for PQ centroids");
        goto done;
    }
    memcpy(out->data, cent, 4 * (size_t)nf);
    if (early &&
        (rc = early_codes(st, be, train_be, c, b, s, &pi, ek, (uint64_t)from_early, d, own, out,
                          &made->bytes, err)) == 0 &&
        made->bytes) {
        made->t0 = own;
        made->n = (uint32_t)early;
    }
done:
    free(rec);
    free(keys);
    free(ek);
    free(pi.id);
    return rc;
}

/*
 * The codes of the pages the sequence sealed before its layer was trained,
 * tokens [own, d->token_start), under the centroids just trained, into b as
 * the layer's codes record (pqindex.h), so that Search scans them like the
 * PQ sections of later pages. known (H, nknown, D) f32: the keys of tokens
 * [own, own + nknown) as the training read them (not read again; NULL, 0:
 * none). *bytes: the record's size.
 */
static int early_codes(kvd_store *st, kvd_backend *be, kvd_backend *train_be,
                       const kvd_seq_codecs *c, struct rocksdb_writebatch_t *b, const kvd__seq *s,
                       const page_ids *pi, const float *known, uint64_t nknown,
                       const kvd_page_desc *d, uint64_t own, const kvd_pq_centroids *cent,
                       uint32_t *bytes, kvd_error *err)
{
    const uint32_t H = d->num_kv_heads, D = d->head_dim, B = d->page_tokens, M = c->pq_m;
    const uint64_t n = d->token_start - own, per_head = cent_floats(1, D, c->pq_bits);
    *bytes = 0;
    if (kvd__pq_codes_bytes(H, M, n) > KVD_PQ_CODES_MAX_BYTES)
        return 0; /* too many: Search codes those pages at call time */
    const size_t rlen = (size_t)kvd__pq_codes_bytes(H, M, n);
    uint8_t *rec = malloc(rlen);
    float *keys = malloc(sizeof(float) * (size_t)H * B * D);
    int rc = 0;
    if (!rec || !keys) {
        rc = kvd_error_set(err, KVD_ENOMEM, "out of memory coding %llu earlier keys",
                           (unsigned long long)n);
        goto done;
    }
    memset(rec, 0, CODES_HEADER);
    rec[0] = CODES_VERSION;
    rec[2] = (uint8_t)M;
    rec[3] = (uint8_t)(M >> 8);
    st32(rec + 4, H);
    for (int i = 0; i < 8; i++)
        rec[8 + i] = (uint8_t)(cent->id >> (8 * i));
    uint8_t *codes = rec + CODES_HEADER; /* (H, n, M) */
    for (uint64_t t = own; t < d->token_start && rc == 0; t += B) {
        /* the keys the training read already, or the page's */
        const int have = t - own + B <= nknown;
        if (!have && (rc = stored_keys(st, be, c, pi, d, t, B, keys, err)))
            break;
        for (uint32_t h = 0; h < H && rc == 0; h++) {
            int64_t ks[2] = {B, D}, cs[3] = {M, (int64_t)1 << c->pq_bits, D / M}, ds[2] = {B, M};
            const float *kh =
                have ? known + ((size_t)h * nknown + (t - own)) * D : keys + (size_t)h * B * D;
            kvd_tensor tk = kvd_tensor_make(KVD_DTYPE_F32, (float *)kh, 2, ks);
            kvd_tensor tc = kvd_tensor_make(KVD_DTYPE_F32, cent->data + h * per_head, 3, cs);
            kvd_tensor td =
                kvd_tensor_make(KVD_DTYPE_U8, codes + ((size_t)h * n + (t - own)) * M, 2, ds);
            rc = kvd_pq_encode(train_be, &tk, &tc, &td, err);
        }
    }
    if (rc == 0) {
        uint8_t key[3 + KVD_SEQ_ID_MAX + 4 + CODES_KEY_EXTRA];
        size_t klen = codes_key(key, s->id, s->id_len, d->layer, own, (uint32_t)n);
        rocksdb_writebatch_put((rocksdb_writebatch_t *)b, (const char *)key, klen,
                               (const char *)rec, rlen);
        *bytes = (uint32_t)rlen;
    }
done:
    free(rec);
    free(keys);
    return rc;
}

/* The layer's centroids in the device's memory, copied up at the first page
 * coded there and kept for the append. */
static int layer_on_device(struct kvd__pq_append *ps, struct pq_layer *L, kvd_backend *dev,
                           const float **out, kvd_error *err)
{
    if (!L->dev_c) {
        size_t bytes = 4 * (size_t)cent_floats(L->c.num_kv_heads, L->c.head_dim, L->c.bits);
        void *p;
        int rc = kvd_backend_scratch(dev, bytes, &p, err);
        if (rc)
            return rc;
        if ((rc = kvd_backend_upload(dev, p, L->c.data, bytes, err))) {
            kvd_backend_scratch_free(dev, p);
            return rc;
        }
        L->dev_c = p;
        ps->dev = dev;
    }
    *out = L->dev_c;
    return 0;
}

/* PQ codes (H, B, M) into codes (host) of a page's keys (head-major
 * (H, B, D) in d->dtype, host memory) with centroids cent (H, M, 2^bits,
 * D/M) in memory of be. On the device the keys go up once and the codes
 * come down; keys is work space of B * D floats in be's memory (NULL on a
 * device: taken from its scratch). */
static int page_codes(kvd_backend *be, int on_dev, const kvd_page_desc *d, uint32_t M,
                      uint32_t bits, const float *cent, const uint8_t *k_page, float *keys,
                      uint8_t *codes, kvd_error *err)
{
    const uint32_t H = d->num_kv_heads, D = d->head_dim, B = d->page_tokens;
    const size_t es = kvd_dtype_size(d->dtype), raw = (size_t)H * B * D * es;
    const uint64_t per_head = cent_floats(1, D, bits);
    uint8_t *m = NULL, *dst = codes;
    const uint8_t *src = k_page;
    int rc = 0;
    if (on_dev) {
        const size_t o_keys = align256(raw), o_codes = o_keys + align256(sizeof(float) * B * D);
        if ((rc = kvd_backend_scratch(be, o_codes + (size_t)H * B * M, (void **)&m, err)))
            return rc;
        if ((rc = kvd_backend_upload(be, m, k_page, raw, err))) {
            kvd_backend_scratch_free(be, m);
            return rc;
        }
        src = m;
        keys = (float *)(void *)(m + o_keys);
        dst = m + o_codes;
    }
    for (uint32_t h = 0; h < H && rc == 0; h++) {
        if ((rc = to_f32(be, d->dtype, src + (size_t)h * B * D * es, B, D, (int64_t)(D * es), keys,
                         err)))
            break;
        int64_t ks[2] = {B, D}, cs[3] = {M, (int64_t)1 << bits, D / M}, ds[2] = {B, M};
        kvd_tensor tk = kvd_tensor_make(KVD_DTYPE_F32, keys, 2, ks);
        kvd_tensor tc = kvd_tensor_make(KVD_DTYPE_F32, (float *)cent + h * per_head, 3, cs);
        kvd_tensor td = kvd_tensor_make(KVD_DTYPE_U8, dst + (size_t)h * B * M, 2, ds);
        rc = kvd_pq_encode(be, &tk, &tc, &td, err);
    }
    if (on_dev) {
        if (rc == 0)
            rc = kvd_backend_download(be, codes, dst, (size_t)H * B * M, err);
        kvd_backend_scratch_free(be, m);
    }
    return rc;
}

/* The append's state and layer d->layer's centroids, loaded or trained
 * (from this page and the append's keys after it) at its first page. */
static int layer_ready(struct kvd__pq_append **state, kvd_store *st, const kvd__seq *s,
                       const kvd_seq_codecs *c, struct rocksdb_writebatch_t *b,
                       const kvd_page_desc *d, const uint8_t *k_page, const uint8_t *wire_k,
                       uint64_t wire_ts, uint64_t wire_end, struct pq_layer **out, kvd_error *err)
{
    if (d->layer >= s->num_layers || d->num_tokens != d->page_tokens)
        return kvd_error_set(err, KVD_EINVAL, "PQ codes for a page that does not seal");
    int rc;
    struct kvd__pq_append *ps = *state;
    if (!ps) {
        ps = calloc(1, sizeof *ps);
        if (ps && !(ps->layers = calloc(s->num_layers, sizeof *ps->layers))) {
            free(ps);
            ps = NULL;
        }
        if (!ps)
            return kvd_error_set(err, KVD_ENOMEM, "out of memory");
        ps->num_layers = s->num_layers;
        *state = ps;
    }
    const uint32_t H = d->num_kv_heads, D = d->head_dim, M = c->pq_m;
    struct pq_layer *L = &ps->layers[d->layer];
    if (!L->known) {
        int found = 0;
        if ((rc = kvd_store_pq_centroids_get(st, s->id, s->id_len, d->layer, &L->c, &found, err)))
            return rc;
        codes_made made = {0};
        if (!found &&
            (rc = train_layer(st, kvd_store_coding_backend(st), kvd_store_backend(st), c, b, s, d,
                              k_page, wire_k, wire_ts, wire_end, &L->c, &made, err))) {
            kvd_pq_centroids_clear(&L->c);
            return rc;
        }
        if (!found) {
            L->trained = (uint32_t)kvd__pq_record_bytes(H, D, c->pq_bits) + made.bytes;
            L->codes_t0 = made.t0;
            L->codes_n = made.n;
        }
        L->known = 1;
    }
    if (L->c.num_kv_heads != H || L->c.head_dim != D || L->c.m != M || L->c.bits != c->pq_bits)
        return kvd_error_set(err, KVD_ECORRUPT,
                             "stored PQ centroids of layer %u (%u heads x %u, m %u, %u bits) do "
                             "not match the sequence",
                             d->layer, L->c.num_kv_heads, L->c.head_dim, L->c.m, L->c.bits);
    *out = L;
    return 0;
}

int kvd__pq_pages_codes(struct kvd__pq_append **state, kvd_store *st, const kvd__seq *s,
                        const kvd_seq_codecs *c, struct rocksdb_writebatch_t *b,
                        const kvd_page_desc *train_d, const uint8_t *train_k, const uint8_t *wire_k,
                        uint64_t wire_ts, uint64_t wire_end, size_t n, const kvd_page_desc *d,
                        const void *const *k_dev, uint8_t *codes, kvd_error *err)
{
    struct pq_layer *L = NULL;
    int rc = layer_ready(state, st, s, c, b, train_d, train_k, wire_k, wire_ts, wire_end, &L, err);
    kvd_backend *dev = kvd_store_device(st);
    if (rc || !n)
        return rc;
    if (!dev)
        return kvd_error_set(err, KVD_EINVAL, "PQ codes on the device: the store has none");
    const uint32_t H = d[0].num_kv_heads, D = d[0].head_dim, B = d[0].page_tokens, M = c->pq_m;
    const size_t es = kvd_dtype_size(d[0].dtype), per = (size_t)H * B * M;
    const float *dc = NULL;
    uint8_t *m = NULL;
    const size_t o_codes = align256(sizeof(float) * B * D);
    if ((rc = layer_on_device(*state, L, dev, &dc, err)) ||
        (rc = kvd_backend_scratch(dev, o_codes + n * per, (void **)&m, err)))
        return rc;
    float *keys = (float *)(void *)m;
    const uint64_t per_head = cent_floats(1, D, c->pq_bits);
    for (size_t p = 0; p < n && rc == 0; p++) {
        if (d[p].layer != train_d->layer || d[p].num_tokens != B || d[p].num_kv_heads != H ||
            d[p].head_dim != D) {
            rc = kvd_error_set(err, KVD_EINVAL,
                               "PQ codes: page %zu is not a sealing page of "
                               "the layer",
                               p);
            break;
        }
        for (uint32_t h = 0; h < H && rc == 0; h++) {
            if ((rc = to_f32(dev, d[p].dtype, (const uint8_t *)k_dev[p] + (size_t)h * B * D * es, B,
                             D, (int64_t)(D * es), keys, err)))
                break;
            int64_t ks[2] = {B, D}, cs[3] = {M, (int64_t)1 << c->pq_bits, D / M}, ds[2] = {B, M};
            kvd_tensor tk = kvd_tensor_make(KVD_DTYPE_F32, keys, 2, ks);
            kvd_tensor tc = kvd_tensor_make(KVD_DTYPE_F32, (float *)dc + h * per_head, 3, cs);
            kvd_tensor td =
                kvd_tensor_make(KVD_DTYPE_U8, m + o_codes + p * per + (size_t)h * B * M, 2, ds);
            rc = kvd_pq_encode(dev, &tk, &tc, &td, err);
        }
    }
    if (rc == 0)
        rc = kvd_backend_download(dev, codes, m + o_codes, n * per, err);
    kvd_backend_scratch_free(dev, m);
    return rc;
}

int kvd__pq_page_section(struct kvd__pq_append **state, kvd_store *st, const kvd__seq *s,
                         const kvd_seq_codecs *c, struct rocksdb_writebatch_t *b,
                         const kvd_page_desc *d, const uint8_t *k_page, const uint8_t *ready,
                         const uint8_t *wire_k, uint64_t wire_ts, uint64_t wire_end,
                         const uint8_t *in, size_t in_len, uint8_t **out, size_t *out_len,
                         kvd_error *err)
{
    *out = NULL;
    *out_len = 0;
    kvd_backend *be = kvd_store_coding_backend(st);
    struct pq_layer *L = NULL;
    int rc = layer_ready(state, st, s, c, b, d, k_page, wire_k, wire_ts, wire_end, &L, err);
    if (rc)
        return rc;
    struct kvd__pq_append *ps = *state;
    const uint32_t H = d->num_kv_heads, D = d->head_dim, B = d->page_tokens, M = c->pq_m;
    if (ps->cap_keys < (size_t)B * D) {
        float *k = realloc(ps->keys, sizeof(float) * (size_t)B * D);
        if (!k)
            return kvd_error_set(err, KVD_ENOMEM, "out of memory");
        ps->keys = k;
        ps->cap_keys = (size_t)B * D;
    }
    uint8_t *page = NULL, *sec = NULL;
    size_t plen = 0;
    if ((rc = kvd_page_put_section(in, in_len, KVD_SECTION_PQ_CODES,
                                   KVD_PAGE_PQ_HEADER + (uint64_t)H * B * M, &page, &plen, &sec,
                                   err)))
        return rc;
    sec[0] = (uint8_t)M;
    sec[1] = (uint8_t)(M >> 8);
    sec[2] = (uint8_t)c->pq_bits;
    for (int i = 0; i < 8; i++)
        sec[8 + i] = (uint8_t)(L->c.id >> (8 * i));
    uint8_t *codes = sec + KVD_PAGE_PQ_HEADER;
    kvd_backend *dev = kvd_store_device(st);
    rc = -1;
    if (ready) {
        memcpy(codes, ready, (size_t)H * B * M);
        rc = 0;
    } else if (dev) {
        /* On the device (the CPU's codes), or on the CPU when it fails. */
        const float *dc = NULL;
        if ((rc = layer_on_device(ps, L, dev, &dc, err)) == 0)
            rc = page_codes(dev, 1, d, M, c->pq_bits, dc, k_page, NULL, codes, err);
        if (rc == 0 && c->k.codec == KVD_CODEC_RAW && c->v.codec == KVD_CODEC_RAW)
            atomic_fetch_add(&st->tiers.device_pages_encoded, 1); /* else counted by its codec */
        if (rc && !kvd_store_device_fallback(st, rc, err)) {
            free(page);
            return rc;
        }
    }
    if (rc)
        rc = page_codes(be, 0, d, M, c->pq_bits, L->c.data, k_page, ps->keys, codes, err);
    if (rc) {
        free(page);
        return rc;
    }
    kvd_page_finish(page, plen);
    *out = page;
    *out_len = plen;
    return 0;
}

void kvd__pq_append_free(struct kvd__pq_append *state)
{
    if (!state)
        return;
    for (uint32_t l = 0; l < state->num_layers; l++) {
        kvd_pq_centroids_clear(&state->layers[l].c);
        if (state->layers[l].dev_c)
            kvd_backend_scratch_free(state->dev, state->layers[l].dev_c);
    }
    free(state->layers);
    free(state->keys);
    free(state);
}

uint64_t kvd__pq_record_bytes(uint32_t H, uint32_t D, uint32_t bits)
{
    return REC_HEADER + 4 * cent_floats(H, D, bits);
}

uint64_t kvd__pq_append_done(struct kvd__pq_append *state, kvd_store *st, kvd__seq *s)
{
    uint64_t added = 0;
    for (uint32_t l = 0; state && l < state->num_layers && l < s->num_layers; l++) {
        uint32_t now = state->layers[l].trained, was = s->layers[l].pq.bytes;
        if (!now)
            continue;
        /* two appends that both trained the layer: the later records stay */
        s->layers[l].pq = (kvd__pq_index){now, state->layers[l].codes_n, state->layers[l].codes_t0,
                                          kvd__pq_new_gen(st)};
        if (now >= was) {
            atomic_fetch_add(&st->disk_bytes, now - was);
            added += now - was;
        } else {
            atomic_fetch_sub(&st->disk_bytes, was - now);
        }
    }
    return added;
}

void kvd__pq_forget(kvd_store *st, kvd__seq *s)
{
    uint64_t bytes = 0;
    for (uint32_t l = 0; l < s->num_layers; l++) {
        bytes += s->layers[l].pq.bytes;
        s->layers[l].pq = (kvd__pq_index){0};
    }
    uint64_t have = atomic_load(&st->disk_bytes);
    atomic_fetch_sub(&st->disk_bytes, bytes < have ? bytes : have);
}

int kvd__pq_load(kvd_store *st, kvd_error *err)
{
    int rc = 0;
    uint64_t total = 0, rec = 0;
    uint32_t pq_m = 0;
    const kvd__seq *last = NULL;
    char start = KEY_PQ;
    kvd__scan sc;
    rocksdb_iterator_t *it = kvd__scan_open(st, &sc, &start, 1);
    for (rocksdb_iter_seek(it, &start, 1); rocksdb_iter_valid(it); rocksdb_iter_next(it)) {
        size_t klen;
        const uint8_t *k = (const uint8_t *)rocksdb_iter_key(it, &klen);
        if (klen == 0 || k[0] != KEY_PQ)
            break;
        size_t id_len = klen >= 3 ? (size_t)k[1] << 8 | k[2] : 0;
        const int is_codes = klen == 3 + id_len + 4 + CODES_KEY_EXTRA;
        if (klen < 3 || (klen != 3 + id_len + 4 && !is_codes))
            continue; /* not a record key of this layout */
        kvd__seq *s = kvd__seq_find(st, k + 3, id_len, NULL);
        uint32_t layer = (uint32_t)k[3 + id_len] << 24 | (uint32_t)k[4 + id_len] << 16 |
                         (uint32_t)k[5 + id_len] << 8 | k[6 + id_len];
        if (!s || layer >= s->num_layers)
            continue; /* deleted with its sequence in one batch: cannot happen */
        if (s != last) {
            /* the size follows from the sequence's spec: the values (1 MiB
             * a layer for 8 x 128 heads) are not read at open */
            kvd_seq_codecs c;
            int found = 0;
            if ((rc = kvd_store_seq_codecs_get(st, s->id, s->id_len, &c, &found, err)))
                break;
            const kvd_model_info *m = &s->model->info;
            rec = found && c.pq_m ? kvd__pq_record_bytes(m->num_kv_heads, m->head_dim,
                                                         c.pq_bits ? c.pq_bits : 8)
                                  : 0;
            pq_m = found ? c.pq_m : 0;
            kvd_seq_codecs_clear(&c);
            last = s;
        }
        /* a codes record's size follows from its key (its token count) */
        const uint32_t n = is_codes ? ld32be(k + klen - 4) : 0;
        const uint64_t bytes = !is_codes ? rec
                               : pq_m    ? kvd__pq_codes_bytes(s->model->info.num_kv_heads, pq_m, n)
                                         : 0;
        s->layers[layer].pq.bytes += (uint32_t)bytes;
        if (!is_codes)
            s->layers[layer].pq.gen = kvd__pq_new_gen(st);
        if (is_codes && pq_m) {
            uint64_t t0 = 0;
            for (int i = 0; i < 8; i++)
                t0 = t0 << 8 | k[3 + id_len + 4 + i];
            s->layers[layer].pq.codes_t0 = t0;
            s->layers[layer].pq.codes_n = n;
        }
        total += bytes;
    }
    if (!rc) {
        char *e = NULL;
        rocksdb_iter_get_error(it, &e);
        if (e) {
            rc = kvd_error_set(err, KVD_EINTERNAL, "rocksdb scan of PQ centroid records: %s", e);
            rocksdb_free(e);
        }
    }
    kvd__scan_close(&sc);
    atomic_fetch_add(&st->disk_bytes, total);
    return rc;
}

void kvd__pq_delete(struct rocksdb_writebatch_t *b, const kvd__seq *s)
{
    uint8_t key[3 + KVD_SEQ_ID_MAX + 4];
    for (uint32_t l = 0; l < s->num_layers; l++) {
        size_t klen = pq_key(key, s->id, s->id_len, l);
        rocksdb_writebatch_delete((rocksdb_writebatch_t *)b, (const char *)key, klen);
        const kvd__layer *L = &s->layers[l];
        if (L->pq.codes_n) {
            uint8_t ck[3 + KVD_SEQ_ID_MAX + 4 + CODES_KEY_EXTRA];
            klen = codes_key(ck, s->id, s->id_len, l, L->pq.codes_t0, L->pq.codes_n);
            rocksdb_writebatch_delete((rocksdb_writebatch_t *)b, (const char *)ck, klen);
        }
    }
}

int kvd_store_pq_codes_get(kvd_store *st, const void *seq_id, size_t id_len, uint32_t layer,
                           kvd_pq_codes *out, int *found, kvd_error *err)
{
    memset(out, 0, sizeof *out);
    *found = 0;
    int rc = kvd__check_seq_id(seq_id, id_len, err);
    if (rc)
        return rc;
    uint8_t prefix[3 + KVD_SEQ_ID_MAX + 4 + 1];
    size_t plen = pq_key(prefix, seq_id, id_len, layer);
    kvd__scan sc;
    rocksdb_iterator_t *it = kvd__scan_open(st, &sc, prefix, plen);
    /* From the first key past the centroid record (the prefix itself):
     * landing on that record would read its value, a blob of H x m x 2^bits
     * x D/m floats, only to step over it. */
    prefix[plen] = 0;
    for (rocksdb_iter_seek(it, (const char *)prefix, plen + 1); rocksdb_iter_valid(it) && !*found;
         rocksdb_iter_next(it)) {
        size_t klen, vlen;
        const uint8_t *k = (const uint8_t *)rocksdb_iter_key(it, &klen);
        if (klen < plen || memcmp(k, prefix, plen))
            break;
        if (klen != plen + CODES_KEY_EXTRA)
            continue; /* the centroid record */
        const uint8_t *v = (const uint8_t *)rocksdb_iter_value(it, &vlen);
        uint64_t t0 = 0;
        for (int i = 0; i < 8; i++)
            t0 = t0 << 8 | k[plen + i];
        const uint32_t n = ld32be(k + plen + 8);
        const uint32_t m = vlen >= CODES_HEADER ? (uint32_t)v[2] | (uint32_t)v[3] << 8 : 0;
        const uint32_t H = vlen >= CODES_HEADER ? ld32(v + 4) : 0;
        if (vlen < CODES_HEADER || v[0] != CODES_VERSION || !m || !H || H > KVD_PAGE_MAX_HEADS ||
            vlen != kvd__pq_codes_bytes(H, m, n)) {
            rc =
                kvd_error_set(err, KVD_ECORRUPT, "PQ codes record of layer %u is malformed", layer);
            break;
        }
        out->codes = malloc(vlen - CODES_HEADER ? vlen - CODES_HEADER : 1);
        if (!out->codes) {
            rc = kvd_error_set(err, KVD_ENOMEM, "out of memory for PQ codes");
            break;
        }
        memcpy(out->codes, v + CODES_HEADER, vlen - CODES_HEADER);
        for (int i = 0; i < 8; i++)
            out->centroids_id |= (uint64_t)v[8 + i] << (8 * i);
        out->token_start = t0;
        out->num_tokens = n;
        out->num_kv_heads = H;
        out->m = m;
        *found = 1;
    }
    if (!rc) {
        char *e = NULL;
        rocksdb_iter_get_error(it, &e);
        if (e) {
            rc = kvd_error_set(err, KVD_EINTERNAL, "reading PQ codes: %s", e);
            rocksdb_free(e);
        }
    }
    kvd__scan_close(&sc);
    if (rc) {
        kvd_pq_codes_clear(out);
        *found = 0;
    }
    return rc;
}

/* ---- rebuild --------------------------------------------------------------- */

/* Per layer of a rebuild: what begin saw (checked again at commit) and
 * what the rebuild writes. */
struct rebuild_layer_state {
    uint64_t n;     /* own sealed tokens to index (0 = layer skipped) */
    page_ids pages; /* their pages */
    uint32_t bytes; /* the layer's records after the rebuild */
    kvd__pq_index was;
};

struct kvd_pq_rebuild {
    kvd_store *st;
    kvd__seq *s; /* referenced; s->mu held only in begin and commit */
    kvd_seq_codecs c;
    uint32_t ls, nl;
    uint64_t own; /* first token of the sequence's own pages */
    struct rebuild_layer_state *ly;
    uint64_t old_bytes, new_bytes;
    rocksdb_writebatch_t *b;
    int ran;
    int locked; /* s->mu held: in begin and commit */
};

int kvd_store_pq_rebuild_begin(kvd_store *st, const void *id, size_t id_len, uint32_t layer_start,
                               uint32_t num_layers, kvd_pq_rebuild **out, uint64_t *bound,
                               kvd_error *err)
{
    *out = NULL;
    *bound = 0;
    kvd__seq *s = NULL;
    int rc = kvd__seq_acquire(st, id, id_len, &s, err);
    if (rc)
        return rc;
    kvd_pq_rebuild *rb = calloc(1, sizeof *rb);
    if (!rb) {
        kvd__seq_unref(s);
        return kvd_error_set(err, KVD_ENOMEM, "out of memory");
    }
    rb->st = st;
    rb->s = s;
    pthread_mutex_lock(&s->mu);
    rb->locked = 1;
    int found = 0;
    const uint32_t L = s->num_layers, B = st->page_tokens;
    if (s->dead)
        rc = kvd_error_set(err, KVD_ENOTFOUND, "sequence not found");
    else if ((rc = kvd_store_seq_codecs_get(st, id, id_len, &rb->c, &found, err)) == 0 &&
             !rb->c.pq_m)
        rc =
            kvd_error_set(err, KVD_EPRECOND, "sequence has no PQ index (create it with codecs.pq)");
    else if (rc == 0 && (layer_start >= L || num_layers > L - layer_start))
        rc = kvd_error_set(err, KVD_EINVAL, "layers [%u, %llu): the model has %u", layer_start,
                           (unsigned long long)layer_start + (num_layers ? num_layers : 1), L);
    if (rc == 0 && kvd_seq_codecs_need_arts(&rb->c))
        rc = kvd_seq_codecs_load_arts(st, id, id_len, &rb->c, err);
    if (rc) {
        kvd_store_pq_rebuild_abort(rb);
        return rc;
    }
    rb->ls = layer_start;
    rb->nl = num_layers ? num_layers : L - layer_start;
    rb->own = s->prefix_blocks * B;
    rb->ly = calloc(rb->nl, sizeof *rb->ly);
    rb->b = rocksdb_writebatch_create();
    if (!rb->ly) {
        kvd_store_pq_rebuild_abort(rb);
        return kvd_error_set(err, KVD_ENOMEM, "out of memory");
    }
    const kvd_model_info *m = &s->model->info;
    const uint64_t rec = kvd__pq_record_bytes(m->num_kv_heads, m->head_dim, rb->c.pq_bits);
    for (uint32_t i = 0; i < rb->nl && rc == 0; i++) {
        const kvd__layer *Ly = &s->layers[rb->ls + i];
        struct rebuild_layer_state *y = &rb->ly[i];
        const uint64_t sealed = Ly->tokens / B * B;
        y->n = sealed > rb->own ? sealed - rb->own : 0;
        if (kvd__pq_codes_bytes(m->num_kv_heads, rb->c.pq_m, y->n) > KVD_PQ_CODES_MAX_BYTES) {
            rc = kvd_error_set(
                err, KVD_EINVAL,
                "PQ rebuild: the codes of layer %u's %llu tokens would take %llu "
                "bytes, more than the %u an index holds",
                rb->ls + i, (unsigned long long)y->n,
                (unsigned long long)kvd__pq_codes_bytes(m->num_kv_heads, rb->c.pq_m, y->n),
                KVD_PQ_CODES_MAX_BYTES);
            break;
        }
        y->was = Ly->pq;
        y->bytes = y->n ? (uint32_t)(rec + kvd__pq_codes_bytes(m->num_kv_heads, rb->c.pq_m, y->n))
                        : Ly->pq.bytes;
        rb->old_bytes += Ly->pq.bytes;
        rb->new_bytes += y->bytes;
        if (y->n)
            rc = layer_page_ids(s, rb->ls + i, B, rb->own / B, y->n / B, &y->pages, err);
    }
    if (rc) {
        kvd_store_pq_rebuild_abort(rb);
        return rc;
    }
    /* The work runs without the sequence's lock: appends go on meanwhile
     * (commit checks that none trained a layer of the range). */
    pthread_mutex_unlock(&s->mu);
    rb->locked = 0;
    *bound = rb->new_bytes > rb->old_bytes ? rb->new_bytes - rb->old_bytes : 0;
    const uint64_t have = atomic_load(&st->disk_bytes);
    if (st->disk_limit && have + *bound > st->disk_limit) {
        rc = kvd_error_set(err, KVD_ENOMEM,
                           "the store holds %llu page bytes; the rebuilt index needs %llu more, "
                           "past the disk limit of %llu",
                           (unsigned long long)have, (unsigned long long)*bound,
                           (unsigned long long)st->disk_limit);
        kvd_store_pq_rebuild_abort(rb);
        *bound = 0;
        return rc;
    }
    *out = rb;
    return 0;
}

/* One layer of a rebuild: centroids trained on KVD_PQ_TRAIN_TOKENS keys
 * spread evenly over the own sealed pages (token own + floor(i * n / T)),
 * then the codes of every one of those pages, both records into rb->b. */
static int rebuild_layer(kvd_pq_rebuild *rb, uint32_t layer, const struct rebuild_layer_state *y,
                         kvd_error *err)
{
    const uint64_t n = y->n;
    kvd_store *st = rb->st;
    const kvd__seq *s = rb->s;
    const kvd_seq_codecs *c = &rb->c;
    const kvd_model_info *m = &s->model->info;
    const uint32_t H = m->num_kv_heads, D = m->head_dim, B = st->page_tokens, M = c->pq_m;
    const int64_t T = n < KVD_PQ_TRAIN_TOKENS ? (int64_t)n : KVD_PQ_TRAIN_TOKENS;
    kvd_backend *be = kvd_store_coding_backend(st), *train_be = kvd_store_backend(st);
    const kvd_page_desc d = {.dtype = m->dtype,
                             .layer = layer,
                             .page_tokens = B,
                             .num_tokens = B,
                             .num_kv_heads = H,
                             .head_dim = D};
    const uint64_t nf = cent_floats(H, D, c->pq_bits), per_head = nf / H;
    const size_t rlen = (size_t)kvd__pq_record_bytes(H, D, c->pq_bits);
    uint8_t *rec = malloc(rlen);
    float *page = malloc(sizeof(float) * (size_t)H * B * D);
    float *sample = malloc(sizeof(float) * (size_t)H * T * D);
    float *keys = malloc(sizeof(float) * (size_t)T * D);
    kvd_pq_centroids cent = {.num_kv_heads = H, .head_dim = D, .m = M, .bits = c->pq_bits};
    int rc = 0;
    if (!rec || !page || !sample || !keys) {
        rc = kvd_error_set(err, KVD_ENOMEM, "out of memory rebuilding the PQ index");
        goto done;
    }
    /* 1. the sample: token i of T is own + floor(i * n / T), in order */
    int64_t i = 0;
    for (uint64_t t = rb->own; t < rb->own + n && i < T && rc == 0; t += B) {
        if ((rc = stored_keys(st, be, c, &y->pages, &d, t, B, page, err)))
            break;
        for (; i < T; i++) {
            /* i < 4096 and n bounded by the 256 MiB record: no overflow */
            const uint64_t ti = rb->own + (uint64_t)i * n / (uint64_t)T;
            if (ti >= t + B)
                break;
            for (uint32_t h = 0; h < H; h++)
                memcpy(sample + ((size_t)h * T + i) * D, page + ((size_t)h * B + (ti - t)) * D,
                       sizeof(float) * D);
        }
    }
    if (rc)
        goto done;
    /* 2. the centroids, in a record of the usual form */
    float *cd = rec_header(rec, c, H, D);
    for (uint32_t h = 0; h < H && rc == 0; h++) {
        memcpy(keys, sample + (size_t)h * T * D, sizeof(float) * (size_t)T * D);
        rc = train_head(st, train_be, c, layer, h, keys, T, D, cd + (size_t)h * per_head, err);
    }
    if (rc)
        goto done;
    cent.id = XXH3_64bits(rec, rlen);
    cent.data = cd;
    uint8_t key[3 + KVD_SEQ_ID_MAX + 4 + CODES_KEY_EXTRA];
    size_t klen = pq_key(key, s->id, s->id_len, layer);
    rocksdb_writebatch_put(rb->b, (const char *)key, klen, (const char *)rec, rlen);
    /* 3. the codes of every own sealed page, replacing the layer's record */
    if (y->was.codes_n) {
        klen = codes_key(key, s->id, s->id_len, layer, y->was.codes_t0, y->was.codes_n);
        rocksdb_writebatch_delete(rb->b, (const char *)key, klen);
    }
    kvd_page_desc at = d;
    at.token_start = rb->own + n; /* early_codes codes [own, token_start) */
    uint32_t bytes = 0;
    rc = early_codes(st, be, train_be, c, (struct rocksdb_writebatch_t *)rb->b, s, &y->pages, NULL,
                     0, &at, rb->own, &cent, &bytes, err);
done:
    free(rec);
    free(page);
    free(sample);
    free(keys);
    return rc;
}

int kvd_store_pq_rebuild_run(kvd_pq_rebuild *rb, kvd_error *err)
{
    int rc = 0;
    for (uint32_t i = 0; i < rb->nl && rc == 0; i++)
        if (rb->ly[i].n)
            rc = rebuild_layer(rb, rb->ls + i, &rb->ly[i], err);
    rb->ran = rc == 0;
    return rc;
}

int kvd_store_pq_rebuild_commit(kvd_pq_rebuild *rb, kvd_pq_rebuild_info *info, kvd_error *err)
{
    if (info)
        memset(info, 0, sizeof *info);
    kvd__seq *s = rb->s;
    pthread_mutex_lock(&s->mu);
    rb->locked = 1; /* released by the abort below */
    int rc = 0;
    if (!rb->ran)
        rc = kvd_error_set(err, KVD_EINVAL, "PQ rebuild: commit before run");
    else if (s->dead)
        rc = kvd_error_set(err, KVD_ENOTFOUND, "sequence was deleted during the PQ rebuild");
    for (uint32_t i = 0; i < rb->nl && rc == 0; i++) {
        const kvd__layer *Ly = &s->layers[rb->ls + i];
        const struct rebuild_layer_state *y = &rb->ly[i];
        if (Ly->pq.bytes != y->was.bytes || Ly->pq.codes_n != y->was.codes_n ||
            Ly->pq.codes_t0 != y->was.codes_t0)
            rc = kvd_error_set(err, KVD_EABORTED,
                               "an append trained the PQ index of layer %u during the rebuild; "
                               "nothing was changed: rebuild again",
                               rb->ls + i);
    }
    if (rc == 0)
        rc = kvd__db_write(rb->st, rb->b, err);
    if (rc == 0) {
        pthread_rwlock_wrlock(&rb->st->lock); /* what stat and list read under it */
        for (uint32_t i = 0; i < rb->nl; i++) {
            kvd__layer *Ly = &s->layers[rb->ls + i];
            const struct rebuild_layer_state *y = &rb->ly[i];
            if (!y->n)
                continue;
            Ly->pq = (kvd__pq_index){y->bytes, (uint32_t)y->n, rb->own, kvd__pq_new_gen(rb->st)};
            if (info) {
                info->layers_rebuilt++;
                info->tokens_indexed += y->n;
            }
        }
        pthread_rwlock_unlock(&rb->st->lock);
        if (rb->new_bytes >= rb->old_bytes)
            atomic_fetch_add(&rb->st->disk_bytes, rb->new_bytes - rb->old_bytes);
        else
            atomic_fetch_sub(&rb->st->disk_bytes, rb->old_bytes - rb->new_bytes);
        if (info) {
            info->index_bytes_before = rb->old_bytes;
            info->index_bytes_after = rb->new_bytes;
        }
    }
    kvd_store_pq_rebuild_abort(rb);
    return rc;
}

void kvd_store_pq_rebuild_abort(kvd_pq_rebuild *rb)
{
    if (!rb)
        return;
    if (rb->b)
        rocksdb_writebatch_destroy(rb->b);
    kvd_seq_codecs_clear(&rb->c);
    for (uint32_t i = 0; rb->ly && i < rb->nl; i++)
        free(rb->ly[i].pages.id);
    free(rb->ly);
    if (rb->locked)
        pthread_mutex_unlock(&rb->s->mu);
    kvd__seq_unref(rb->s);
    free(rb);
}
