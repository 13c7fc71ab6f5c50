/*
 * Codecs of a sequence (seqcodec.h): persistence and the store's backend.
 */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "seqcodec.h"
#include "store_internal.h"

#define KEY_CODECS 'C'
#define REC_VERSION 1
#define SPEC_BYTES 13
#define REC_BYTES (1 + 2 * SPEC_BYTES + 4 + 9)

static pthread_once_t be_once = PTHREAD_ONCE_INIT;
static kvd_backend *codec_be;

static void be_init(void)
{
    kvd_cpu_options opt = {1, 0};
    if (kvd_backend_cpu_create(&opt, &codec_be, NULL) != 0)
        codec_be = NULL;
}

kvd_backend *kvd__codec_backend(void)
{
    pthread_once(&be_once, be_init);
    return codec_be;
}

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
    if (head_dim % c->pq_m)
        return kvd_error_set(err, KVD_EINVAL, "pq.m: %u does not divide head_dim %u", c->pq_m,
                             head_dim);
    if (c->pq_bits != 4 && c->pq_bits != 6 && c->pq_bits != 8)
        return kvd_error_set(err, KVD_EINVAL, "pq.bits: %u, want 4, 6 or 8", c->pq_bits);
    if (c->pq_iterations > 1000)
        return kvd_error_set(err, KVD_EINVAL, "pq.iterations: %u, at most 1000",
                             c->pq_iterations);
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

int kvd_store_seq_codecs_set(kvd_store *st, const void *id, size_t id_len,
                             const kvd_seq_codecs *c, kvd_error *err)
{
    int rc = kvd__check_seq_id(id, id_len, err);
    if (rc)
        return rc;
    pthread_rwlock_rdlock(&st->lock);
    int found = kvd__seq_find(st, id, id_len, NULL) != NULL;
    pthread_rwlock_unlock(&st->lock);
    if (!found)
        return kvd_error_set(err, KVD_ENOTFOUND, "sequence not found");
    uint8_t key[1 + KVD_SEQ_ID_MAX], rec[REC_BYTES];
    size_t klen = codec_key(key, id, id_len);
    rec[0] = REC_VERSION;
    put_spec(rec + 1, &c->k);
    put_spec(rec + 1 + SPEC_BYTES, &c->v);
    for (int i = 0; i < 4; i++) {
        rec[1 + 2 * SPEC_BYTES + i] = (uint8_t)(c->raw_sink_tokens >> (8 * i));
        rec[5 + 2 * SPEC_BYTES + i] = (uint8_t)(c->pq_m >> (8 * i));
        rec[10 + 2 * SPEC_BYTES + i] = (uint8_t)(c->pq_iterations >> (8 * i));
    }
    rec[9 + 2 * SPEC_BYTES] = c->pq_bits;
    char *e = NULL;
    rocksdb_put(st->db, st->wopt, (const char *)key, klen, (const char *)rec, sizeof rec, &e);
    if (e) {
        rc = kvd_error_set(err, KVD_EINTERNAL, "storing sequence codecs: %s", e);
        free(e);
    }
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
    if (len != REC_BYTES || (uint8_t)v[0] != REC_VERSION) {
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
    free(v);
    *found = 1;
    return 0;
}
