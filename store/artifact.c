/*
 * Model artifacts: validation and persistence (layout in artifact.h).
 */
#include "artifact.h"
#include "store_internal.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#define KVD__KEY_ARTIFACT 'A'
#define ARTIFACT_RECORD_VERSION 1
#define ARTIFACT_KEY_MAX (2 + KVD_MODEL_NAME_MAX + 9)

static const char *kind_name(int k)
{
    static const char *const names[] = {"unspecified",    "key_smoothing",  "vq_codebook_k",
                                        "vq_codebook_v",  "svd_rotation_k", "svd_rotation_v",
                                        "svd_spectrum_k", "svd_spectrum_v"};
    return k >= 0 && k <= KVD_ARTIFACT_KIND_MAX ? names[k] : "unknown";
}

static size_t prefix_key(const char *model, uint8_t *key)
{
    size_t nl = strlen(model);
    key[0] = KVD__KEY_ARTIFACT;
    key[1] = (uint8_t)nl;
    memcpy(key + 2, model, nl);
    return nl + 2;
}

static size_t artifact_key(const char *model, const kvd_artifact *a, uint8_t *key)
{
    size_t n = prefix_key(model, key);
    key[n++] = (uint8_t)a->kind;
    for (int i = 3; i >= 0; i--)
        key[n++] = (uint8_t)(a->layer >> (8 * i));
    for (int i = 3; i >= 0; i--)
        key[n++] = (uint8_t)(a->kv_head >> (8 * i));
    return n;
}

static uint64_t elems(const kvd_artifact *a)
{
    uint64_t n = 1;
    for (uint32_t i = 0; i < a->ndim; i++)
        n *= a->shape[i];
    return n;
}

int kvd_artifact_validate(const kvd_model_info *m, const kvd_artifact *a, kvd_error *err)
{
    if (a->kind < 1 || a->kind > KVD_ARTIFACT_KIND_MAX)
        return kvd_error_set(err, KVD_EINVAL, "artifact kind %d is not one of 1..%d", a->kind,
                             KVD_ARTIFACT_KIND_MAX);
    const char *kn = kind_name(a->kind);
    if (a->layer >= m->num_layers || a->kv_head >= m->num_kv_heads)
        return kvd_error_set(err, KVD_EINVAL,
                             "%s artifact for layer %u kv head %u: model %s has %u layers and "
                             "%u kv heads",
                             kn, a->layer, a->kv_head, m->name, m->num_layers, m->num_kv_heads);
    uint32_t D = m->head_dim;
    switch (a->kind) {
    case KVD_ARTIFACT_KEY_SMOOTHING:
    case KVD_ARTIFACT_SVD_SPECTRUM_K:
    case KVD_ARTIFACT_SVD_SPECTRUM_V:
        if (a->ndim != 1 || a->shape[0] != D)
            return kvd_error_set(err, KVD_EINVAL, "%s artifact must have shape [%u] (head_dim)",
                                 kn, D);
        break;
    case KVD_ARTIFACT_SVD_ROTATION_K:
    case KVD_ARTIFACT_SVD_ROTATION_V:
        if (a->ndim != 2 || a->shape[0] != D || a->shape[1] != D)
            return kvd_error_set(err, KVD_EINVAL,
                                 "%s artifact must have shape [%u, %u] (head_dim squared)", kn, D,
                                 D);
        break;
    default: { /* VQ codebooks */
        uint32_t rows = a->ndim == 2 ? a->shape[0] : 0, d = a->ndim == 2 ? a->shape[1] : 0;
        int pow2 = rows >= 16 && rows <= 4096 && (rows & (rows - 1)) == 0;
        if (!pow2 || (d != 2 && d != 4 && d != 8) || D % d != 0)
            return kvd_error_set(err, KVD_EINVAL,
                                 "%s artifact must have shape [2^b, d] with b in 4..12, d in "
                                 "{2, 4, 8} dividing head_dim %u",
                                 kn, D);
        break;
    }
    }
    if (!a->data)
        return kvd_error_set(err, KVD_EINVAL, "%s artifact has no data", kn);
    uint64_t n = elems(a);
    for (uint64_t i = 0; i < n; i++)
        if (!isfinite(a->data[i]))
            return kvd_error_set(err, KVD_EINVAL,
                                 "%s artifact (layer %u, kv head %u) value %llu is not finite", kn,
                                 a->layer, a->kv_head, (unsigned long long)i);
    return 0;
}

void kvd__artifacts_delete_all(struct rocksdb_writebatch_t *b, const char *model)
{
    uint8_t lo[ARTIFACT_KEY_MAX], hi[ARTIFACT_KEY_MAX];
    size_t n = prefix_key(model, lo);
    memcpy(hi, lo, n);
    hi[n] = 0xff; /* above every kind byte */
    rocksdb_writebatch_delete_range(b, (const char *)lo, n, (const char *)hi, n + 1);
}

int kvd_store_artifacts_put(kvd_store *st, const char *model, const kvd_artifact *a, size_t n,
                            kvd_error *err)
{
    if (!st || !model || (!a && n))
        return kvd_error_set(err, KVD_EINVAL, "artifacts put: NULL argument");
    /* Hold the store lock shared for the whole write so the model cannot be
     * deleted (or replaced with another shape) between check and write. */
    pthread_rwlock_rdlock(&st->lock);
    kvd__model *m = kvd__model_find(st, model);
    int rc = 0;
    if (!m) {
        rc = kvd_error_set(err, KVD_ENOTFOUND, "model %.128s not found", model);
        goto out;
    }
    for (size_t i = 0; i < n; i++) {
        kvd_error e2;
        if (kvd_artifact_validate(&m->info, &a[i], &e2)) {
            rc = kvd_error_set(err, KVD_EINVAL, "artifact %zu: %s", i, e2.msg);
            goto out;
        }
    }
    rocksdb_writebatch_t *b = rocksdb_writebatch_create();
    for (size_t i = 0; i < n && !rc; i++) {
        uint8_t key[ARTIFACT_KEY_MAX];
        size_t klen = artifact_key(model, &a[i], key);
        uint64_t ne = elems(&a[i]);
        size_t vlen = 2 + 4 * (size_t)a[i].ndim + 4 * (size_t)ne;
        uint8_t *v = malloc(vlen);
        if (!v) {
            rc = kvd_error_set(err, KVD_ENOMEM, "out of memory");
            break;
        }
        v[0] = ARTIFACT_RECORD_VERSION;
        v[1] = (uint8_t)a[i].ndim;
        uint8_t *p = v + 2;
        for (uint32_t d = 0; d < a[i].ndim; d++, p += 4)
            for (int j = 0; j < 4; j++)
                p[j] = (uint8_t)(a[i].shape[d] >> (8 * j));
        for (uint64_t e = 0; e < ne; e++, p += 4) {
            uint32_t u;
            memcpy(&u, &a[i].data[e], 4);
            for (int j = 0; j < 4; j++)
                p[j] = (uint8_t)(u >> (8 * j));
        }
        rocksdb_writebatch_put(b, (const char *)key, klen, (const char *)v, vlen);
        free(v);
    }
    if (!rc)
        rc = kvd__db_write(st, b, err);
    rocksdb_writebatch_destroy(b);
out:
    pthread_rwlock_unlock(&st->lock);
    return rc;
}

void kvd_artifacts_free(kvd_artifact *a, size_t n)
{
    if (!a)
        return;
    for (size_t i = 0; i < n; i++)
        free(a[i].data);
    free(a);
}

static uint32_t le32(const uint8_t *p)
{
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) |
           ((uint32_t)p[3] << 24);
}

/* Decode one record into *a (data malloc'ed). */
static int decode(const kvd_model_info *m, const uint8_t *k, size_t klen, size_t plen,
                  const uint8_t *v, size_t vlen, kvd_artifact *a, kvd_error *err)
{
    memset(a, 0, sizeof *a);
    if (klen != plen + 9 || vlen < 2 || v[0] != ARTIFACT_RECORD_VERSION || v[1] < 1 || v[1] > 2 ||
        vlen < 2 + 4 * (size_t)v[1])
        goto bad;
    a->kind = k[plen];
    a->layer = (uint32_t)k[plen + 1] << 24 | (uint32_t)k[plen + 2] << 16 |
               (uint32_t)k[plen + 3] << 8 | k[plen + 4];
    a->kv_head = (uint32_t)k[plen + 5] << 24 | (uint32_t)k[plen + 6] << 16 |
                 (uint32_t)k[plen + 7] << 8 | k[plen + 8];
    a->ndim = v[1];
    for (uint32_t d = 0; d < a->ndim; d++)
        a->shape[d] = le32(v + 2 + 4 * d);
    uint64_t ne = elems(a);
    const uint8_t *p = v + 2 + 4 * a->ndim;
    if (ne > (1u << 20) || (size_t)(v + vlen - p) != 4 * ne)
        goto bad;
    a->data = malloc(ne ? 4 * ne : 1);
    if (!a->data)
        return kvd_error_set(err, KVD_ENOMEM, "out of memory");
    for (uint64_t e = 0; e < ne; e++) {
        uint32_t u = le32(p + 4 * e);
        memcpy(&a->data[e], &u, 4);
    }
    kvd_error e2;
    if (kvd_artifact_validate(m, a, &e2)) {
        free(a->data);
        a->data = NULL;
        return kvd_error_set(err, KVD_ECORRUPT, "stored artifact of model %s is invalid: %s",
                             m->name, e2.msg);
    }
    return 0;
bad:
    return kvd_error_set(err, KVD_ECORRUPT, "stored artifact record of model %s is malformed",
                         m->name);
}

int kvd_store_artifacts_get(kvd_store *st, const char *model, const int *kinds, size_t nkinds,
                            kvd_artifact **out, size_t *n, kvd_error *err)
{
    *out = NULL;
    *n = 0;
    if (!st || !model || (!kinds && nkinds))
        return kvd_error_set(err, KVD_EINVAL, "artifacts get: NULL argument");
    if (strnlen(model, KVD_MODEL_NAME_MAX + 1) > KVD_MODEL_NAME_MAX)
        return kvd_error_set(err, KVD_EINVAL, "model name longer than %d bytes",
                             KVD_MODEL_NAME_MAX);
    pthread_rwlock_rdlock(&st->lock);
    kvd__model *m = kvd__model_find(st, model);
    if (!m) {
        pthread_rwlock_unlock(&st->lock);
        return kvd_error_set(err, KVD_ENOTFOUND, "model %.128s not found", model);
    }
    kvd_model_info info = m->info;
    uint8_t pre[ARTIFACT_KEY_MAX];
    size_t plen = prefix_key(model, pre);
    kvd_artifact *arr = NULL;
    size_t cnt = 0, cap = 0;
    int rc = 0;
    rocksdb_iterator_t *it = rocksdb_create_iterator(st->db, st->ropt);
    for (rocksdb_iter_seek(it, (const char *)pre, plen); rocksdb_iter_valid(it);
         rocksdb_iter_next(it)) {
        size_t klen, vlen;
        const uint8_t *k = (const uint8_t *)rocksdb_iter_key(it, &klen);
        if (klen < plen || memcmp(k, pre, plen) != 0)
            break;
        if (klen > plen && nkinds) {
            size_t j = 0;
            while (j < nkinds && kinds[j] != k[plen])
                j++;
            if (j == nkinds)
                continue;
        }
        if (cnt == cap) {
            size_t nc = cap ? 2 * cap : 16;
            kvd_artifact *na = realloc(arr, nc * sizeof *na);
            if (!na) {
                rc = kvd_error_set(err, KVD_ENOMEM, "out of memory");
                break;
            }
            arr = na;
            cap = nc;
        }
        const uint8_t *v = (const uint8_t *)rocksdb_iter_value(it, &vlen);
        if ((rc = decode(&info, k, klen, plen, v, vlen, &arr[cnt], err)))
            break;
        cnt++;
    }
    if (!rc) {
        char *e = NULL;
        rocksdb_iter_get_error(it, &e);
        if (e) {
            rc = kvd_error_set(err, KVD_EINTERNAL, "rocksdb scan of artifacts failed: %s", e);
            rocksdb_free(e);
        }
    }
    rocksdb_iter_destroy(it);
    pthread_rwlock_unlock(&st->lock);
    if (rc) {
        kvd_artifacts_free(arr, cnt);
        return rc;
    }
    *out = arr;
    *n = cnt;
    return 0;
}
