/*
 * Codecs of a sequence (seqcodec.h): persistence and the store's backend.
 */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#define XXH_STATIC_LINKING_ONLY
#include <xxhash.h>

#include "artifact.h"
#include "seqcodec.h"
#include "store_internal.h"

#define KEY_CODECS 'C'
#define KEY_ARTS 'Z'
#define KEY_SHARED 'z'
#define KEY_SHARED_REFS 'y'
#define REC_VERSION_OWN 2 /* snapshot under 'Z' id */
#define REC_VERSION 3     /* snapshot shared under 'z' hash */
#define SPEC_BYTES 13
#define REC1_BYTES (1 + 2 * SPEC_BYTES + 4 + 9)
#define REC_BYTES (REC1_BYTES + 6 + 8)
#define REC_PQ_BYTES (REC_BYTES + 4) /* with pq_min_train_tokens */
#define ARTS_CACHE 8 /* snapshots kept in memory, shared by content */

int kvd_seq_codecs_check(kvd_seq_codecs *c, uint32_t page_tokens, uint32_t head_dim,
                         kvd_error *err)
{
    int rc = kvd_codec_spec_check(&c->k, 0, page_tokens, head_dim, err);
    if (!rc)
        rc = kvd_codec_spec_check(&c->v, 1, page_tokens, head_dim, err);
    if (rc || !c->pq_m)
        return rc;
    if (c->pq_bits == 0)
        c->pq_bits = 8;
    if (c->pq_iterations == 0)
        c->pq_iterations = 10;
    if (c->pq_min_train_tokens == 0)
        c->pq_min_train_tokens = KVD_PQ_MIN_TRAIN_TOKENS;
    if (head_dim % c->pq_m)
        return kvd_error_set(err, KVD_EINVAL, "pq.m: %u does not divide head_dim %u", c->pq_m,
                             head_dim);
    if (c->pq_bits != 4 && c->pq_bits != 6 && c->pq_bits != 8)
        return kvd_error_set(err, KVD_EINVAL, "pq.bits: %u, want 4, 6 or 8", c->pq_bits);
    if (c->pq_iterations > 1000)
        return kvd_error_set(err, KVD_EINVAL, "pq.iterations: %u, at most 1000",
                             c->pq_iterations);
    if (c->pq_min_train_tokens > KVD_PQ_MIN_TRAIN_MAX)
        return kvd_error_set(err, KVD_EINVAL, "pq.min_train_tokens: %u, at most %u",
                             c->pq_min_train_tokens, KVD_PQ_MIN_TRAIN_MAX);
    return 0;
}

static void put_spec(uint8_t *p, const kvd_codec_spec *s)
{
    p[0] = s->codec;
    p[1] = (uint8_t)s->group;
    p[2] = (uint8_t)(s->group >> 8);
    p[3] = s->axis;
    p[4] = s->rounding;
    for (int i = 0; i < 8; i++)
        p[5 + i] = (uint8_t)(s->seed >> (8 * i));
}

static void get_spec(const uint8_t *p, kvd_codec_spec *s)
{
    s->codec = p[0];
    s->group = (uint16_t)(p[1] | p[2] << 8);
    s->axis = p[3];
    s->rounding = p[4];
    s->seed = 0;
    for (int i = 0; i < 8; i++)
        s->seed |= (uint64_t)p[5 + i] << (8 * i);
}

static size_t codec_key(uint8_t *key, const void *id, size_t id_len)
{
    key[0] = KEY_CODECS;
    memcpy(key + 1, id, id_len);
    return id_len + 1;
}

/* 'Z' ‖ id: a sequence's own snapshot (records of version 2). */
static size_t arts_key(uint8_t *key, const void *id, size_t id_len)
{
    key[0] = KEY_ARTS;
    memcpy(key + 1, id, id_len);
    return id_len + 1;
}

/* 'z' ‖ be64 hash (snapshot bytes) or 'y' ‖ be64 hash (reference count). */
static void shared_key(uint8_t key[9], uint8_t kind, uint64_t hash)
{
    key[0] = kind;
    for (int i = 0; i < 8; i++)
        key[1 + i] = (uint8_t)(hash >> (56 - 8 * i));
}

/*
 * Serialises the read-modify-write of shared snapshots' reference counts:
 * held from reading a count until the batch that changes it is written.
 * Process-wide (rarely contended: sequence create and delete).
 */
static pthread_mutex_t refs_mu = PTHREAD_MUTEX_INITIALIZER;

/* The reference count of shared snapshot `hash` (0 when it has none). */
static int refs_get(kvd_store *st, uint64_t hash, uint64_t *n, kvd_error *err)
{
    uint8_t key[9];
    shared_key(key, KEY_SHARED_REFS, hash);
    size_t len = 0;
    char *e = NULL;
    char *v = rocksdb_get(st->db, st->ropt, (const char *)key, sizeof key, &len, &e);
    *n = 0;
    if (e) {
        int rc = kvd_error_set(err, KVD_EINTERNAL, "reading a snapshot's reference count: %s", e);
        free(e);
        return rc;
    }
    if (!v)
        return 0;
    if (len != 8) {
        free(v);
        return kvd_error_set(err, KVD_ECORRUPT, "snapshot reference count of %zu bytes", len);
    }
    for (int i = 0; i < 8; i++)
        *n |= (uint64_t)(uint8_t)v[i] << (8 * i);
    free(v);
    return 0;
}

/* Add to b the change of snapshot `hash`'s count by delta (+1 or -1); at
 * 0 the snapshot and its count are deleted. Under refs_mu. */
static int refs_stage(kvd_store *st, rocksdb_writebatch_t *b, uint64_t hash, int delta,
                      kvd_error *err)
{
    uint64_t n;
    int rc = refs_get(st, hash, &n, err);
    if (rc)
        return rc;
    /* (A count already 0 drops nothing: a sequence's delete never fails
     * for it, and the keys it deletes are absent.) */
    n = delta > 0 ? n + 1 : n ? n - 1 : 0;
    uint8_t key[9];
    shared_key(key, KEY_SHARED_REFS, hash);
    if (n == 0) {
        rocksdb_writebatch_delete(b, (const char *)key, sizeof key);
        shared_key(key, KEY_SHARED, hash);
        rocksdb_writebatch_delete(b, (const char *)key, sizeof key);
        return 0;
    }
    uint8_t v[8];
    for (int i = 0; i < 8; i++)
        v[i] = (uint8_t)(n >> (8 * i));
    rocksdb_writebatch_put(b, (const char *)key, sizeof key, (const char *)v, sizeof v);
    return 0;
}

/*
 * Add to b the put of snapshot bytes buf[0..len) (XXH3 hash) for a sequence:
 * a new reference on the shared record of that hash, written first when
 * none exists. *shared = 0 when a record of that hash holds other bytes
 * (an XXH3 collision, or a hash of 0): the snapshot is then stored under
 * the sequence's own 'Z' key instead. Under refs_mu; `drop` is the hash of a shared snapshot
 * whose reference the same batch drops (0 = none), so that the count is
 * read once.
 */
static int arts_stage(kvd_store *st, rocksdb_writebatch_t *b, const void *id, size_t id_len,
                      const uint8_t *buf, size_t len, uint64_t hash, uint64_t drop, int *shared,
                      kvd_error *err)
{
    uint64_t n = 0;
    int rc = hash ? refs_get(st, hash, &n, err) : 0;
    if (rc)
        return rc;
    uint8_t key[9];
    shared_key(key, KEY_SHARED, hash);
    *shared = hash != 0; /* (hash 0 names no snapshot in a codec record) */
    int put = !n;
    if (n) {
        char *e = NULL;
        rocksdb_pinnableslice_t *ps =
            rocksdb_get_pinned(st->db, st->ropt, (const char *)key, sizeof key, &e);
        if (e) {
            rc = kvd_error_set(err, KVD_EINTERNAL, "reading an artifact snapshot: %s", e);
            free(e);
            return rc;
        }
        size_t have = 0;
        const char *v = ps ? rocksdb_pinnableslice_value(ps, &have) : NULL;
        /* Counted but missing (damage): these bytes have its hash, so they
         * put it back for the sequences counted. */
        put = !v;
        *shared = !v || (have == len && memcmp(v, buf, len) == 0);
        rocksdb_pinnableslice_destroy(ps);
    }
    if (!*shared) {
        uint8_t okey[1 + KVD_SEQ_ID_MAX];
        size_t klen = arts_key(okey, id, id_len);
        rocksdb_writebatch_put(b, (const char *)okey, klen, (const char *)buf, len);
        return drop ? refs_stage(st, b, drop, -1, err) : 0;
    }
    if (put)
        rocksdb_writebatch_put(b, (const char *)key, sizeof key, (const char *)buf, len);
    if (drop == hash)
        return 0; /* the sequence keeps its reference */
    if ((rc = refs_stage(st, b, hash, +1, err)))
        return rc;
    return drop ? refs_stage(st, b, drop, -1, err) : 0;
}

/*
 * The shared snapshot a sequence's codec record references: *hash (0 when
 * the sequence has no record, or one of an older version, or one whose
 * snapshot is its own).
 */
static int shared_ref_get(kvd_store *st, const void *id, size_t id_len, uint64_t *hash,
                          kvd_error *err)
{
    kvd_seq_codecs c;
    int found = 0;
    *hash = 0;
    int rc = kvd_store_seq_codecs_get(st, id, id_len, &c, &found, err);
    if (rc == KVD_ECORRUPT) /* a damaged record holds no reference */
        return 0;
    if (!rc && found && c.arts_shared)
        *hash = c.arts_hash;
    return rc;
}

/* The snapshot of the model's artifacts the codecs of c need. */
static int build_snapshot(kvd_store *st, const kvd_model_info *mi, const kvd_seq_codecs *c,
                          kvd_codec_arts **out, kvd_error *err)
{
    int kinds[7];
    size_t nk = 0;
    const kvd_codec_spec *sp[2] = {&c->k, &c->v};
    for (int i = 0; i < 2; i++) {
        if (sp[i]->codec == KVD_CODEC_VQ) {
            kinds[nk++] = i ? KVD_ARTIFACT_VQ_CODEBOOK_V : KVD_ARTIFACT_VQ_CODEBOOK_K;
            if (!i)
                kinds[nk++] = KVD_ARTIFACT_KEY_SMOOTHING;
        }
        if (sp[i]->svd) {
            kinds[nk++] = i ? KVD_ARTIFACT_SVD_ROTATION_V : KVD_ARTIFACT_SVD_ROTATION_K;
            if (!sp[i]->svd_nwidths)
                kinds[nk++] = i ? KVD_ARTIFACT_SVD_SPECTRUM_V : KVD_ARTIFACT_SVD_SPECTRUM_K;
        }
    }
    kvd_artifact *a = NULL;
    size_t n = 0;
    int rc = kvd_store_artifacts_get(st, mi->name, kinds, nk, &a, &n, err);
    if (rc)
        return rc;
    kvd_art_ref *r = calloc(n ? n : 1, sizeof *r);
    if (!r) {
        kvd_artifacts_free(a, n);
        return kvd_error_set(err, KVD_ENOMEM, "out of memory");
    }
    for (size_t i = 0; i < n; i++) {
        r[i].kind = a[i].kind;
        r[i].layer = a[i].layer;
        r[i].kv_head = a[i].kv_head;
        r[i].ndim = a[i].ndim;
        r[i].shape[0] = a[i].shape[0];
        r[i].shape[1] = a[i].shape[1];
        r[i].data = a[i].data;
    }
    rc = kvd_codec_arts_build(&c->k, &c->v, mi->num_layers, mi->num_kv_heads, mi->head_dim, r, n,
                              out, err);
    if (rc == KVD_EPRECOND && err) {
        char msg[sizeof err->msg];
        memcpy(msg, err->msg, sizeof msg);
        msg[sizeof msg - 24] = '\0';
        kvd_error_set(err, rc, "codecs: model %s: %s", mi->name, msg);
    }
    free(r);
    kvd_artifacts_free(a, n);
    return rc;
}

int kvd__seq_codecs_snapshot(kvd_store *st, const kvd_model_info *mi, const kvd_seq_codecs *c,
                             uint8_t **buf, size_t *len, uint64_t *hash, kvd_error *err)
{
    *buf = NULL;
    *len = 0;
    *hash = 0;
    if (!kvd_seq_codecs_need_arts(c))
        return 0;
    kvd_codec_arts *arts = NULL;
    int rc = build_snapshot(st, mi, c, &arts, err);
    if (rc)
        return rc;
    rc = kvd_codec_arts_serialize(arts, buf, len, err);
    kvd_codec_arts_free(arts);
    if (rc) {
        *buf = NULL;
        return rc;
    }
    *hash = XXH3_64bits(*buf, *len);
    return 0;
}

int kvd__seq_codecs_stage(kvd_store *st, rocksdb_writebatch_t *b, const void *id, size_t id_len,
                          const kvd_seq_codecs *c, const uint8_t *buf, size_t len,
                          uint64_t arts_hash, kvd_error *err)
{
    /* The snapshot reference (and the release of the one of an earlier
     * record of this id, and the removal of an own snapshot left by one),
     * and the codec record go in b, counts read here and written with b
     * under refs_mu. */
    pthread_mutex_lock(&refs_mu);
    uint64_t drop = 0;
    int shared = 0;
    uint8_t okey[1 + KVD_SEQ_ID_MAX];
    size_t oklen = arts_key(okey, id, id_len);
    rocksdb_writebatch_delete(b, (const char *)okey, oklen);
    int rc = shared_ref_get(st, id, id_len, &drop, err);
    if (!rc && buf)
        rc = arts_stage(st, b, id, id_len, buf, len, arts_hash, drop, &shared, err);
    else if (!rc && drop)
        rc = refs_stage(st, b, drop, -1, err);
    if (rc) {
        pthread_mutex_unlock(&refs_mu);
        return rc;
    }
    if (!shared)
        arts_hash = 0; /* an own snapshot of a colliding hash: never shared in memory either */
    uint8_t key[1 + KVD_SEQ_ID_MAX], rec[REC_PQ_BYTES];
    size_t klen = codec_key(key, id, id_len);
    rec[0] = shared ? REC_VERSION : REC_VERSION_OWN;
    put_spec(rec + 1, &c->k);
    put_spec(rec + 1 + SPEC_BYTES, &c->v);
    for (int i = 0; i < 4; i++) {
        rec[1 + 2 * SPEC_BYTES + i] = (uint8_t)(c->raw_sink_tokens >> (8 * i));
        rec[5 + 2 * SPEC_BYTES + i] = (uint8_t)(c->pq_m >> (8 * i));
        rec[10 + 2 * SPEC_BYTES + i] = (uint8_t)(c->pq_iterations >> (8 * i));
    }
    rec[9 + 2 * SPEC_BYTES] = c->pq_bits;
    const kvd_codec_spec *sp[2] = {&c->k, &c->v};
    for (int i = 0; i < 2; i++) {
        rec[REC1_BYTES + 3 * i] = sp[i]->vq_sub_dim;
        rec[REC1_BYTES + 3 * i + 1] = sp[i]->vq_bits;
        rec[REC1_BYTES + 3 * i + 2] = sp[i]->svd;
    }
    for (int i = 0; i < 8; i++)
        rec[REC1_BYTES + 6 + i] = (uint8_t)(arts_hash >> (8 * i));
    /* pq_min_train_tokens only where there is an index: the other records
     * keep the length every earlier version reads. */
    for (int i = 0; i < 4; i++)
        rec[REC_BYTES + i] = (uint8_t)(c->pq_min_train_tokens >> (8 * i));
    rocksdb_writebatch_put(b, (const char *)key, klen, (const char *)rec,
                           c->pq_m ? REC_PQ_BYTES : REC_BYTES);
    return 0;
}

int kvd_store_seq_codecs_set(kvd_store *st, const void *id, size_t id_len,
                             const kvd_seq_codecs *c, kvd_error *err)
{
    int rc = kvd__check_seq_id(id, id_len, err);
    if (rc)
        return rc;
    pthread_rwlock_rdlock(&st->lock);
    kvd__seq *s = kvd__seq_find(st, id, id_len, NULL);
    kvd_model_info mi;
    if (s) {
        mi = s->model->info;
        atomic_fetch_add(&s->refs, 1);
    }
    pthread_rwlock_unlock(&st->lock);
    if (!s)
        return kvd_error_set(err, KVD_ENOTFOUND, "sequence not found");
    /* VQ / SVD: snapshot the model's artifacts of this moment; the codec
     * record names it by content (XXH3 of its bytes). */
    uint64_t arts_hash = 0;
    uint8_t *buf = NULL;
    size_t len = 0;
    if ((rc = kvd__seq_codecs_snapshot(st, &mi, c, &buf, &len, &arts_hash, err))) {
        kvd__seq_unref(s);
        return rc;
    }
    /* s->mu keeps a delete of the sequence out until the write, so a
     * reference is never taken for a sequence already gone. */
    pthread_mutex_lock(&s->mu);
    if (s->dead) {
        pthread_mutex_unlock(&s->mu);
        kvd__seq_unref(s);
        free(buf);
        return kvd_error_set(err, KVD_ENOTFOUND, "sequence not found");
    }
    rocksdb_writebatch_t *b = rocksdb_writebatch_create();
    rc = kvd__seq_codecs_stage(st, b, id, id_len, c, buf, len, arts_hash, err);
    free(buf);
    if (!rc) {
        rc = kvd__db_write(st, b, err);
        kvd__seq_arts_release_done();
    }
    pthread_mutex_unlock(&s->mu);
    kvd__seq_unref(s);
    rocksdb_writebatch_destroy(b);
    return rc;
}

int kvd_store_seq_codecs_get(kvd_store *st, const void *id, size_t id_len, kvd_seq_codecs *c,
                             int *found, kvd_error *err)
{
    memset(c, 0, sizeof *c);
    *found = 0;
    int rc = kvd__check_seq_id(id, id_len, err);
    if (rc)
        return rc;
    uint8_t key[1 + KVD_SEQ_ID_MAX];
    size_t klen = codec_key(key, id, id_len), len = 0;
    char *e = NULL;
    char *v = rocksdb_get(st->db, st->ropt, (const char *)key, klen, &len, &e);
    if (e) {
        rc = kvd_error_set(err, KVD_EINTERNAL, "reading sequence codecs: %s", e);
        free(e);
        return rc;
    }
    if (!v)
        return 0;
    uint8_t ver = len ? (uint8_t)v[0] : 0;
    if (!(((len == REC_BYTES || len == REC_PQ_BYTES) &&
           (ver == REC_VERSION || ver == REC_VERSION_OWN)) ||
          (len == REC_BYTES - 8 && ver == REC_VERSION_OWN) || /* without the hash */
          (len == REC1_BYTES && (uint8_t)v[0] == 1))) {
        free(v);
        return kvd_error_set(err, KVD_ECORRUPT, "sequence codec record of %zu bytes", len);
    }
    const uint8_t *p = (const uint8_t *)v;
    get_spec(p + 1, &c->k);
    get_spec(p + 1 + SPEC_BYTES, &c->v);
    c->raw_sink_tokens = 0;
    for (int i = 0; i < 4; i++) {
        c->raw_sink_tokens |= (uint32_t)p[1 + 2 * SPEC_BYTES + i] << (8 * i);
        c->pq_m |= (uint32_t)p[5 + 2 * SPEC_BYTES + i] << (8 * i);
        c->pq_iterations |= (uint32_t)p[10 + 2 * SPEC_BYTES + i] << (8 * i);
    }
    c->pq_bits = p[9 + 2 * SPEC_BYTES];
    if (len > REC1_BYTES) {
        kvd_codec_spec *sp[2] = {&c->k, &c->v};
        for (int i = 0; i < 2; i++) {
            sp[i]->vq_sub_dim = p[REC1_BYTES + 3 * i];
            sp[i]->vq_bits = p[REC1_BYTES + 3 * i + 1];
            sp[i]->svd = p[REC1_BYTES + 3 * i + 2];
        }
        for (int i = 0; len >= REC_BYTES && i < 8; i++)
            c->arts_hash |= (uint64_t)p[REC1_BYTES + 6 + i] << (8 * i);
    }
    for (int i = 0; len == REC_PQ_BYTES && i < 4; i++)
        c->pq_min_train_tokens |= (uint32_t)p[REC_BYTES + i] << (8 * i);
    if (c->pq_m && !c->pq_min_train_tokens)
        c->pq_min_train_tokens = 1; /* written before the field: trained at the first page */
    c->arts_shared = ver == REC_VERSION;
    free(v);
    *found = 1;
    return 0;
}

/* ---- artifact snapshots ------------------------------------------------------ */


int kvd_seq_codecs_coded(const kvd_seq_codecs *c)
{
    return c->k.codec != KVD_CODEC_RAW || c->v.codec != KVD_CODEC_RAW || c->k.svd || c->v.svd;
}

int kvd_seq_codecs_need_arts(const kvd_seq_codecs *c)
{
    return c->k.codec == KVD_CODEC_VQ || c->v.codec == KVD_CODEC_VQ || c->k.svd || c->v.svd;
}

/*
 * Snapshots in memory, shared by content: sequences created from the same
 * artifacts have byte-identical snapshots (same XXH3), so one parsed copy
 * serves them all, and an Attend or Read does not parse the snapshot again.
 * An entry lives while the cache or a kvd_seq_codecs holds it.
 */
typedef struct arts_ent {
    uint64_t hash, tick;
    kvd_codec_arts *a;
    int refs, in_cache;
} arts_ent;

static pthread_mutex_t cache_mu = PTHREAD_MUTEX_INITIALIZER;
static arts_ent *cache[ARTS_CACHE];
static uint64_t cache_tick;

static void ent_unref_locked(arts_ent *e)
{
    if (--e->refs == 0 && !e->in_cache) {
        kvd_codec_arts_free(e->a);
        free(e);
    }
}

/* The cached snapshot of this content (a new reference), or NULL. */
static arts_ent *cache_get(uint64_t hash)
{
    arts_ent *r = NULL;
    pthread_mutex_lock(&cache_mu);
    for (int i = 0; i < ARTS_CACHE && !r; i++)
        if (cache[i] && cache[i]->hash == hash) {
            r = cache[i];
            r->refs++;
            r->tick = ++cache_tick;
        }
    pthread_mutex_unlock(&cache_mu);
    return r;
}

/* Insert a (takes ownership); returns the entry to use with a reference:
 * a's, or one a concurrent load inserted first (a is then freed). */
static arts_ent *cache_put(uint64_t hash, kvd_codec_arts *a)
{
    arts_ent *r = cache_get(hash);
    if (r) {
        kvd_codec_arts_free(a);
        return r;
    }
    arts_ent *e = calloc(1, sizeof *e);
    if (!e)
        return NULL;
    e->hash = hash;
    e->a = a;
    e->refs = 2; /* the cache's and the caller's */
    e->in_cache = 1;
    pthread_mutex_lock(&cache_mu);
    e->tick = ++cache_tick;
    int slot = 0;
    for (int i = 0; i < ARTS_CACHE; i++) {
        if (!cache[i]) {
            slot = i;
            break;
        }
        if (cache[i]->tick < cache[slot]->tick)
            slot = i;
    }
    if (cache[slot]) { /* evict the least recently used */
        cache[slot]->in_cache = 0;
        ent_unref_locked(cache[slot]);
    }
    cache[slot] = e;
    pthread_mutex_unlock(&cache_mu);
    return e;
}

int kvd_seq_codecs_load_arts(kvd_store *st, const void *id, size_t id_len, kvd_seq_codecs *c,
                             kvd_error *err)
{
    c->k.arts = c->v.arts = NULL;
    c->arts = NULL;
    c->arts_ent = NULL;
    if (!kvd_seq_codecs_need_arts(c))
        return 0;
    arts_ent *hit = c->arts_hash ? cache_get(c->arts_hash) : NULL;
    if (hit) {
        c->arts_ent = hit;
        c->arts = hit->a;
        c->k.arts = c->v.arts = c->arts;
        return 0;
    }
    uint8_t key[1 + KVD_SEQ_ID_MAX];
    size_t klen = 9, len = 0;
    if (c->arts_shared)
        shared_key(key, KEY_SHARED, c->arts_hash);
    else
        klen = arts_key(key, id, id_len);
    char *e = NULL;
    char *v = rocksdb_get(st->db, st->ropt, (const char *)key, klen, &len, &e);
    if (e) {
        int rc = kvd_error_set(err, KVD_EINTERNAL, "reading the sequence's artifacts: %s", e);
        free(e);
        return rc;
    }
    if (!v)
        return kvd_error_set(err, KVD_ECORRUPT,
                             "the sequence's VQ/SVD artifact snapshot is missing");
    if (c->arts_hash && XXH3_64bits(v, len) != c->arts_hash) {
        free(v);
        return kvd_error_set(err, KVD_ECORRUPT,
                             "the sequence's artifact snapshot does not match its hash");
    }
    kvd_codec_arts *a = NULL;
    int rc = kvd_codec_arts_parse((const uint8_t *)v, len, &a, err);
    free(v);
    if (rc)
        return rc;
    if (c->arts_hash && (hit = cache_put(c->arts_hash, a))) {
        c->arts_ent = hit;
        c->arts = hit->a;
    } else {
        c->arts = a; /* owned: freed by kvd_seq_codecs_clear */
    }
    c->k.arts = c->v.arts = c->arts;
    return 0;
}

void kvd_seq_codecs_clear(kvd_seq_codecs *c)
{
    if (!c)
        return;
    if (c->arts_ent) {
        pthread_mutex_lock(&cache_mu);
        ent_unref_locked(c->arts_ent);
        pthread_mutex_unlock(&cache_mu);
    } else {
        kvd_codec_arts_free(c->arts);
    }
    c->arts_ent = NULL;
    c->arts = NULL;
    c->k.arts = c->v.arts = NULL;
}

int kvd__seq_arts_release(kvd_store *st, rocksdb_writebatch_t *b, const void *id, size_t id_len,
                          kvd_error *err)
{
    pthread_mutex_lock(&refs_mu);
    uint64_t hash = 0;
    int rc = shared_ref_get(st, id, id_len, &hash, err);
    if (!rc && hash)
        rc = refs_stage(st, b, hash, -1, err);
    if (rc) {
        pthread_mutex_unlock(&refs_mu);
        return rc;
    }
    uint8_t key[1 + KVD_SEQ_ID_MAX];
    size_t klen = arts_key(key, id, id_len);
    rocksdb_writebatch_delete(b, (const char *)key, klen);
    klen = codec_key(key, id, id_len);
    rocksdb_writebatch_delete(b, (const char *)key, klen);
    return 0;
}

void kvd__seq_arts_release_done(void)
{
    pthread_mutex_unlock(&refs_mu);
}
