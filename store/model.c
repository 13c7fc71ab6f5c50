/*
 * Models: validation, records, put/get/list/delete.
 *
 * Model record (key 'M' name), little-endian:
 *   u8 version (1), u8 name_len, name, u8 revision_len, revision,
 *   u32 num_layers, u32 num_kv_heads, u32 num_q_heads, u32 head_dim,
 *   u32 hidden_size, u8 dtype, u64 created_unix_ms
 */
#include "artifact.h"
#include "store_internal.h"

#include <stdlib.h>
#include <string.h>

#define MODEL_RECORD_VERSION 1
#define MODEL_MAX_DIM 1024

static void put32(uint8_t *p, uint32_t v)
{
    for (int i = 0; i < 4; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}
static void put64(uint8_t *p, uint64_t v)
{
    for (int i = 0; i < 8; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}
static uint32_t get32(const uint8_t *p)
{
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}
static uint64_t get64(const uint8_t *p)
{
    return get32(p) | ((uint64_t)get32(p + 4) << 32);
}

int kvd_model_validate(kvd_model_info *m, kvd_error *err)
{
    if (!m)
        return kvd_error_set(err, KVD_EINVAL, "model is NULL");
    size_t nl = strnlen(m->name, sizeof m->name);
    if (nl == 0)
        return kvd_error_set(err, KVD_EINVAL, "model name is empty");
    if (nl > KVD_MODEL_NAME_MAX)
        return kvd_error_set(err, KVD_EINVAL, "model name longer than %d bytes",
                             KVD_MODEL_NAME_MAX);
    for (size_t i = 0; i < nl; i++) {
        char c = m->name[i];
        if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
              c == '.' || c == '_' || c == '-'))
            return kvd_error_set(err, KVD_EINVAL,
                                 "model name has character 0x%02x at %zu; allowed: "
                                 "[A-Za-z0-9._-]",
                                 (unsigned char)c, i);
    }
    if (strnlen(m->revision, sizeof m->revision) > KVD_REVISION_MAX)
        return kvd_error_set(err, KVD_EINVAL, "model revision longer than %d bytes",
                             KVD_REVISION_MAX);
    if (m->num_layers == 0 || m->num_layers > MODEL_MAX_DIM)
        return kvd_error_set(err, KVD_EINVAL, "num_layers %u not in 1..%d", m->num_layers,
                             MODEL_MAX_DIM);
    if (m->num_kv_heads == 0 || m->num_kv_heads > MODEL_MAX_DIM)
        return kvd_error_set(err, KVD_EINVAL, "num_kv_heads %u not in 1..%d", m->num_kv_heads,
                             MODEL_MAX_DIM);
    if (m->head_dim == 0 || m->head_dim > MODEL_MAX_DIM)
        return kvd_error_set(err, KVD_EINVAL, "head_dim %u not in 1..%d", m->head_dim,
                             MODEL_MAX_DIM);
    if (m->num_q_heads == 0)
        m->num_q_heads = m->num_kv_heads;
    if (m->num_q_heads % m->num_kv_heads != 0 || m->num_q_heads > 64 * MODEL_MAX_DIM)
        return kvd_error_set(err, KVD_EINVAL,
                             "num_q_heads %u is not a multiple of num_kv_heads %u (GQA)",
                             m->num_q_heads, m->num_kv_heads);
    if (!kvd_dtype_is_float(m->dtype))
        return kvd_error_set(err, KVD_EINVAL, "model dtype %s (%d) is not f16, bf16 or f32",
                             kvd_dtype_name(m->dtype), (int)m->dtype);
    return 0;
}

static size_t model_key(const char *name, uint8_t *key)
{
    size_t n = strlen(name);
    key[0] = KVD__KEY_MODEL;
    memcpy(key + 1, name, n);
    return n + 1;
}

static size_t model_encode(const kvd_model_info *m, uint8_t *buf)
{
    uint8_t *p = buf;
    size_t nl = strlen(m->name), rl = strlen(m->revision);
    *p++ = MODEL_RECORD_VERSION;
    *p++ = (uint8_t)nl;
    memcpy(p, m->name, nl);
    p += nl;
    *p++ = (uint8_t)rl;
    memcpy(p, m->revision, rl);
    p += rl;
    put32(p, m->num_layers);
    put32(p + 4, m->num_kv_heads);
    put32(p + 8, m->num_q_heads);
    put32(p + 12, m->head_dim);
    put32(p + 16, m->hidden_size);
    p[20] = (uint8_t)m->dtype;
    put64(p + 21, m->created_unix_ms);
    return (size_t)(p + 29 - buf);
}

#define MODEL_RECORD_MAX (3 + KVD_MODEL_NAME_MAX + KVD_REVISION_MAX + 29)

static int model_decode(const uint8_t *p, size_t len, kvd_model_info *m, kvd_error *err)
{
    memset(m, 0, sizeof *m);
    size_t off = 0;
    if (len < 2 || p[0] != MODEL_RECORD_VERSION)
        goto bad;
    size_t nl = p[1];
    off = 2;
    if (nl > KVD_MODEL_NAME_MAX || len < off + nl + 1)
        goto bad;
    memcpy(m->name, p + off, nl);
    off += nl;
    size_t rl = p[off++];
    if (rl > KVD_REVISION_MAX || len != off + rl + 29)
        goto bad;
    memcpy(m->revision, p + off, rl);
    off += rl;
    m->num_layers = get32(p + off);
    m->num_kv_heads = get32(p + off + 4);
    m->num_q_heads = get32(p + off + 8);
    m->head_dim = get32(p + off + 12);
    m->hidden_size = get32(p + off + 16);
    m->dtype = (kvd_dtype)p[off + 20];
    m->created_unix_ms = get64(p + off + 21);
    kvd_error e2;
    if (kvd_model_validate(m, &e2))
        return kvd_error_set(err, KVD_ECORRUPT, "stored model record is invalid: %s", e2.msg);
    return 0;
bad:
    return kvd_error_set(err, KVD_ECORRUPT, "stored model record is malformed (%zu bytes)", len);
}

kvd__model *kvd__model_find(kvd_store *st, const char *name)
{
    for (size_t i = 0; i < st->nmodels; i++)
        if (strcmp(st->models[i]->info.name, name) == 0)
            return st->models[i];
    return NULL;
}

static int model_add(kvd_store *st, const kvd_model_info *info, kvd__model **out)
{
    if (st->nmodels == st->cap_models) {
        size_t nc = st->cap_models ? 2 * st->cap_models : 8;
        kvd__model **nm = realloc(st->models, nc * sizeof *nm);
        if (!nm)
            return KVD_ENOMEM;
        st->models = nm;
        st->cap_models = nc;
    }
    kvd__model *m = calloc(1, sizeof *m);
    if (!m)
        return KVD_ENOMEM;
    m->info = *info;
    st->models[st->nmodels++] = m;
    *out = m;
    return 0;
}

int kvd__load_models(kvd_store *st, kvd_error *err)
{
    char start = KVD__KEY_MODEL;
    kvd__scan sc;
    rocksdb_iterator_t *it = kvd__scan_open(st, &sc, &start, 1);
    int rc = 0;
    for (rocksdb_iter_seek(it, &start, 1); rocksdb_iter_valid(it); rocksdb_iter_next(it)) {
        size_t klen, vlen;
        const char *k = rocksdb_iter_key(it, &klen);
        if (klen == 0 || k[0] != KVD__KEY_MODEL)
            break;
        const char *v = rocksdb_iter_value(it, &vlen);
        kvd_model_info info;
        if ((rc = model_decode((const uint8_t *)v, vlen, &info, err)))
            break;
        if (klen - 1 != strlen(info.name) || memcmp(k + 1, info.name, klen - 1) != 0) {
            rc = kvd_error_set(err, KVD_ECORRUPT, "model record key does not match its name %s",
                               info.name);
            break;
        }
        kvd__model *m;
        if (model_add(st, &info, &m)) {
            rc = kvd_error_set(err, KVD_ENOMEM, "out of memory loading models");
            break;
        }
    }
    if (!rc) {
        char *e = NULL;
        rocksdb_iter_get_error(it, &e);
        if (e) {
            rc = kvd_error_set(err, KVD_EINTERNAL, "rocksdb scan of models failed: %s", e);
            rocksdb_free(e);
        }
    }
    kvd__scan_close(&sc);
    return rc;
}

static int same_shape(const kvd_model_info *a, const kvd_model_info *b)
{
    return strcmp(a->revision, b->revision) == 0 && a->num_layers == b->num_layers &&
           a->num_kv_heads == b->num_kv_heads && a->num_q_heads == b->num_q_heads &&
           a->head_dim == b->head_dim && a->hidden_size == b->hidden_size && a->dtype == b->dtype;
}

int kvd_store_model_put(kvd_store *st, const kvd_model_info *m, int replace, kvd_model_info *out,
                        int *created, kvd_error *err)
{
    if (created)
        *created = 0;
    if (!st || !m)
        return kvd_error_set(err, KVD_EINVAL, "model put: NULL argument");
    kvd_model_info info = *m;
    int rc = kvd_model_validate(&info, err);
    if (rc)
        return rc;
    info.created_unix_ms = kvd__now_ms();
    /* A page is one RocksDB value, and values are limited to 4 GiB. */
    kvd_page_desc pd = {.dtype = info.dtype,
                        .num_tokens = st->page_tokens,
                        .page_tokens = st->page_tokens,
                        .num_kv_heads = info.num_kv_heads,
                        .head_dim = info.head_dim};
    uint64_t pbytes = kvd_page_raw_size(&pd);
    if (pbytes > KVD__MAX_PAGE_BYTES)
        return kvd_error_set(err, KVD_EINVAL,
                             "a page of %u tokens x %u heads x %u dims in %s would be %llu bytes, "
                             "over the %llu-byte limit",
                             st->page_tokens, info.num_kv_heads, info.head_dim,
                             kvd_dtype_name(info.dtype), (unsigned long long)pbytes,
                             (unsigned long long)KVD__MAX_PAGE_BYTES);

    pthread_rwlock_wrlock(&st->lock);
    kvd__model *cur = kvd__model_find(st, info.name);
    if (cur) {
        if (same_shape(&cur->info, &info)) {
            if (out)
                *out = cur->info;
            pthread_rwlock_unlock(&st->lock);
            return 0;
        }
        if (!replace) {
            pthread_rwlock_unlock(&st->lock);
            return kvd_error_set(err, KVD_EEXIST,
                                 "model %s already exists with another shape (set replace)",
                                 info.name);
        }
        if (cur->nseqs) {
            uint64_t n = cur->nseqs;
            pthread_rwlock_unlock(&st->lock);
            return kvd_error_set(err, KVD_EPRECOND,
                                 "model %s has %llu sequences; delete them before replacing it",
                                 info.name, (unsigned long long)n);
        }
    }
    uint8_t key[1 + KVD_MODEL_NAME_MAX], rec[MODEL_RECORD_MAX];
    size_t klen = model_key(info.name, key), rlen = model_encode(&info, rec);
    rocksdb_writebatch_t *b = rocksdb_writebatch_create();
    rocksdb_writebatch_put(b, (const char *)key, klen, (const char *)rec, rlen);
    if (cur) /* artifacts were computed for the old shape */
        kvd__artifacts_delete_all(b, info.name);
    if (!cur) {
        /* Reserve the slot first so a failure after the write cannot happen. */
        kvd__model *nm;
        if (model_add(st, &info, &nm)) {
            rocksdb_writebatch_destroy(b);
            pthread_rwlock_unlock(&st->lock);
            return kvd_error_set(err, KVD_ENOMEM, "out of memory");
        }
        if ((rc = kvd__db_write(st, b, err))) {
            st->nmodels--;
            free(nm);
        }
    } else if (!(rc = kvd__db_write(st, b, err))) {
        cur->info = info;
    }
    rocksdb_writebatch_destroy(b);
    if (!rc) {
        if (out)
            *out = info;
        if (created)
            *created = 1;
    }
    pthread_rwlock_unlock(&st->lock);
    return rc;
}

static int check_name(const char *name, kvd_error *err)
{
    if (!name || !name[0])
        return kvd_error_set(err, KVD_EINVAL, "model name is empty");
    if (strnlen(name, KVD_MODEL_NAME_MAX + 1) > KVD_MODEL_NAME_MAX)
        return kvd_error_set(err, KVD_EINVAL, "model name longer than %d bytes",
                             KVD_MODEL_NAME_MAX);
    return 0;
}

int kvd_store_model_get(kvd_store *st, const char *name, kvd_model_info *out, kvd_error *err)
{
    int rc = check_name(name, err);
    if (rc)
        return rc;
    pthread_rwlock_rdlock(&st->lock);
    kvd__model *m = kvd__model_find(st, name);
    if (m && out)
        *out = m->info;
    pthread_rwlock_unlock(&st->lock);
    if (!m)
        return kvd_error_set(err, KVD_ENOTFOUND, "model %s not found", name);
    return 0;
}

static int cmp_model(const void *a, const void *b)
{
    return strcmp(((const kvd_model_info *)a)->name, ((const kvd_model_info *)b)->name);
}

int kvd_store_model_list(kvd_store *st, kvd_model_info **out, size_t *n, kvd_error *err)
{
    *out = NULL;
    *n = 0;
    pthread_rwlock_rdlock(&st->lock);
    size_t k = st->nmodels;
    kvd_model_info *arr = k ? malloc(k * sizeof *arr) : NULL;
    if (k && !arr) {
        pthread_rwlock_unlock(&st->lock);
        return kvd_error_set(err, KVD_ENOMEM, "out of memory");
    }
    for (size_t i = 0; i < k; i++)
        arr[i] = st->models[i]->info;
    pthread_rwlock_unlock(&st->lock);
    if (k)
        qsort(arr, k, sizeof *arr, cmp_model);
    *out = arr;
    *n = k;
    return 0;
}

int kvd_store_model_delete(kvd_store *st, const char *name, int force, uint64_t *deleted_seqs,
                           kvd_error *err)
{
    if (deleted_seqs)
        *deleted_seqs = 0;
    int rc = check_name(name, err);
    if (rc)
        return rc;
    uint64_t ndel = 0;
    for (;;) {
        pthread_rwlock_rdlock(&st->lock);
        kvd__model *m = kvd__model_find(st, name);
        if (!m) {
            pthread_rwlock_unlock(&st->lock);
            if (deleted_seqs)
                *deleted_seqs = ndel;
            return kvd_error_set(err, KVD_ENOTFOUND, "model %s not found", name);
        }
        if (m->nseqs == 0) {
            pthread_rwlock_unlock(&st->lock);
            break;
        }
        if (!force) {
            uint64_t n = m->nseqs;
            pthread_rwlock_unlock(&st->lock);
            return kvd_error_set(err, KVD_EPRECOND,
                                 "model %s has %llu sequences (delete them or use force)", name,
                                 (unsigned long long)n);
        }
        /* Collect the sequences, then delete them one by one through the
         * ordinary path (it takes each sequence's lock before st->lock). */
        size_t k = 0;
        uint8_t(*ids)[KVD_SEQ_ID_MAX] = malloc(m->nseqs * sizeof *ids);
        size_t *lens = malloc(m->nseqs * sizeof *lens);
        if (!ids || !lens) {
            pthread_rwlock_unlock(&st->lock);
            free(ids);
            free(lens);
            return kvd_error_set(err, KVD_ENOMEM, "out of memory");
        }
        for (size_t i = 0; i < st->nseqs && k < m->nseqs; i++) {
            if (st->seqs[i]->model == m) {
                memcpy(ids[k], st->seqs[i]->id, st->seqs[i]->id_len);
                lens[k++] = st->seqs[i]->id_len;
            }
        }
        pthread_rwlock_unlock(&st->lock);
        for (size_t i = 0; i < k; i++) {
            kvd_error e2;
            rc = kvd_store_seq_delete(st, ids[i], lens[i], NULL, &e2);
            if (rc == 0)
                ndel++;
            else if (rc != KVD_ENOTFOUND) {
                free(ids);
                free(lens);
                if (deleted_seqs)
                    *deleted_seqs = ndel;
                return kvd_error_set(err, rc, "deleting a sequence of model %s: %s", name, e2.msg);
            }
        }
        free(ids);
        free(lens);
    }

    pthread_rwlock_wrlock(&st->lock);
    kvd__model *m = kvd__model_find(st, name);
    if (!m || m->nseqs) {
        /* Raced with another delete or a new sequence: report what is true now. */
        pthread_rwlock_unlock(&st->lock);
        if (deleted_seqs)
            *deleted_seqs = ndel;
        if (!m)
            return kvd_error_set(err, KVD_ENOTFOUND, "model %s not found", name);
        return kvd_error_set(err, KVD_EABORTED, "model %s gained sequences while being deleted",
                             name);
    }
    uint8_t key[1 + KVD_MODEL_NAME_MAX];
    size_t klen = model_key(name, key);
    rocksdb_writebatch_t *b = rocksdb_writebatch_create();
    rocksdb_writebatch_delete(b, (const char *)key, klen);
    kvd__artifacts_delete_all(b, name);
    rc = kvd__db_write(st, b, err);
    rocksdb_writebatch_destroy(b);
    if (!rc) {
        for (size_t i = 0; i < st->nmodels; i++) {
            if (st->models[i] == m) {
                st->models[i] = st->models[--st->nmodels];
                break;
            }
        }
        kvd__map_free(&m->prefixes); /* empty: its pages went with the sequences */
        free(m);
    }
    pthread_rwlock_unlock(&st->lock);
    if (deleted_seqs)
        *deleted_seqs = ndel;
    return rc;
}
