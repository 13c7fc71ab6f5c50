/*
 * The method table: every RPC kvdepotd serves, in one place.
 */
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <xxhash.h>

#include "grpc/health/v1/health.pb-c.h"
#include "kvdepot/v1/kvdepot.pb-c.h"
#include "metrics.h"
#include "rpc.h"
#include "validate.h"

#define KVD_SVC "/kvdepot.v1.KVDepot/"
#define HEALTH_SVC "/grpc.health.v1.Health/"

#define UNARY(svc, name, req, fn, acc) {svc #name, #name, KVD_RPC_UNARY, &(req), fn, NULL, acc}
#define R KVD_ACCESS_READ
#define W KVD_ACCESS_WRITE

const kvd_method kvd_methods[] = {
    UNARY(KVD_SVC, PutModel, kvdepot__v1__put_model_request__descriptor, kvd_h_put_model, W),
    UNARY(KVD_SVC, GetModel, kvdepot__v1__get_model_request__descriptor, kvd_h_get_model, R),
    UNARY(KVD_SVC, ListModels, kvdepot__v1__list_models_request__descriptor, kvd_h_list_models, R),
    UNARY(KVD_SVC, DeleteModel, kvdepot__v1__delete_model_request__descriptor, kvd_h_delete_model,
          W),
    UNARY(KVD_SVC, CreateSequence, kvdepot__v1__create_sequence_request__descriptor,
          kvd_h_create_sequence, W),
    {KVD_SVC "Append", "Append", KVD_RPC_CLIENT_STREAM, NULL, NULL, &kvd_append_ops, W},
    {KVD_SVC "Read", "Read", KVD_RPC_SERVER_STREAM, &kvdepot__v1__read_request__descriptor, NULL,
     &kvd_read_ops, R},
    UNARY(KVD_SVC, Lookup, kvdepot__v1__lookup_request__descriptor, kvd_h_lookup, R),
    UNARY(KVD_SVC, StatSequence, kvdepot__v1__stat_sequence_request__descriptor,
          kvd_h_stat_sequence, R),
    UNARY(KVD_SVC, ListSequences, kvdepot__v1__list_sequences_request__descriptor,
          kvd_h_list_sequences, R),
    UNARY(KVD_SVC, DeleteSequence, kvdepot__v1__delete_sequence_request__descriptor,
          kvd_h_delete_sequence, W),
    {KVD_SVC "AppendPages", "AppendPages", KVD_RPC_CLIENT_STREAM, NULL, NULL, &kvd_append_pages_ops,
     W},
    {KVD_SVC "Calibrate", "Calibrate", KVD_RPC_CLIENT_STREAM, NULL, NULL, &kvd_calibrate_ops, W},
    {KVD_SVC "UploadArtifacts", "UploadArtifacts", KVD_RPC_CLIENT_STREAM, NULL, NULL,
     &kvd_upload_artifacts_ops, W},
    {KVD_SVC "GetArtifacts", "GetArtifacts", KVD_RPC_SERVER_STREAM,
     &kvdepot__v1__get_artifacts_request__descriptor, NULL, &kvd_get_artifacts_ops, R},
    UNARY(KVD_SVC, Attend, kvdepot__v1__attend_request__descriptor, kvd_h_attend, R),
    UNARY(KVD_SVC, PlanFetch, kvdepot__v1__plan_fetch_request__descriptor, kvd_h_plan_fetch, R),
    UNARY(KVD_SVC, Search, kvdepot__v1__search_request__descriptor, kvd_h_search, R),
    UNARY(KVD_SVC, SparseAttend, kvdepot__v1__sparse_attend_request__descriptor,
          kvd_h_sparse_attend, R),
    UNARY(KVD_SVC, GetPQCentroids, kvdepot__v1__get_pqcentroids_request__descriptor,
          kvd_h_pq_centroids, R),
    UNARY(KVD_SVC, RebuildPQIndex, kvdepot__v1__rebuild_pqindex_request__descriptor,
          kvd_h_pq_rebuild, W),
    UNARY(KVD_SVC, EvictSequence, kvdepot__v1__evict_sequence_request__descriptor,
          kvd_h_evict_sequence, W),
    UNARY(KVD_SVC, Stats, kvdepot__v1__stats_request__descriptor, kvd_h_stats, R),
    UNARY(KVD_SVC, Backup, kvdepot__v1__backup_request__descriptor, kvd_h_backup, W),
    UNARY(HEALTH_SVC, Check, grpc__health__v1__health_check_request__descriptor, kvd_h_health_check,
          KVD_ACCESS_OPEN),
    {HEALTH_SVC "Watch", "Watch", KVD_RPC_SERVER_STREAM,
     &grpc__health__v1__health_check_request__descriptor, NULL, &kvd_health_watch_ops,
     KVD_ACCESS_OPEN},
};

#undef R
#undef W

const size_t kvd_methods_count = sizeof kvd_methods / sizeof kvd_methods[0];

const kvd_method *kvd_method_find(const char *path, size_t len)
{
    for (size_t i = 0; i < kvd_methods_count; i++)
        if (strlen(kvd_methods[i].path) == len && memcmp(kvd_methods[i].path, path, len) == 0)
            return &kvd_methods[i];
    return NULL;
}

kvd_auth *kvd_service_auth(kvd_service *svc)
{
    pthread_mutex_lock(&svc->auth_mu);
    kvd_auth *a = svc->auth;
    if (a)
        kvd_auth_ref(a);
    pthread_mutex_unlock(&svc->auth_mu);
    return a;
}

/* The caller's namespace: "<tenant>/", or "" without a tokens file. */
static size_t seq_ns(const kvd_req_ctx *ctx, char *out, size_t cap)
{
    if (!ctx->principal)
        return 0;
    int n = snprintf(out, cap, "%s/", kvd_auth_tenant(ctx->auth, ctx->principal));
    return n > 0 && (size_t)n < cap ? (size_t)n : 0;
}

int kvd_ctx_seq_key(const kvd_req_ctx *ctx, const ProtobufCBinaryData *wire, const char *field,
                    kvd_seq_key *out, kvd_error *err)
{
    out->len = out->ns = 0;
    int rc = kvd_check_seq_id(wire->data, wire->len, field, err);
    if (rc)
        return rc;
    char ns[KVD_SEQ_ID_MAX - KVD_WIRE_SEQ_ID_MAX + 1];
    out->ns = seq_ns(ctx, ns, sizeof ns);
    memcpy(out->id, ns, out->ns);
    memcpy(out->id + out->ns, wire->data, wire->len);
    out->len = out->ns + wire->len;
    return 0;
}

void kvd_ctx_seq_ns(const kvd_req_ctx *ctx, kvd_seq_key *out)
{
    out->ns = out->len = seq_ns(ctx, (char *)out->id, sizeof out->id);
}

void kvd_ctx_seq_wire(const kvd_req_ctx *ctx, ProtobufCBinaryData *id)
{
    char ns[KVD_SEQ_ID_MAX - KVD_WIRE_SEQ_ID_MAX + 1];
    size_t n = seq_ns(ctx, ns, sizeof ns);
    if (n && id->len >= n && memcmp(id->data, ns, n) == 0) {
        id->data += n;
        id->len -= n;
    }
}

int kvd_ctx_engine_pages(const kvd_req_ctx *ctx, const ProtobufCBinaryData *h, size_t n,
                         uint32_t block_tokens, uint64_t first_block, const char *field,
                         uint64_t **out, size_t *nout, kvd_error *err)
{
    *out = NULL;
    *nout = 0;
    const uint32_t pt = ctx->svc->page_tokens;
    if (!block_tokens || pt % block_tokens)
        return kvd_error_set(err, KVD_EINVAL,
                             "%s: engine_block_tokens %u must divide the server's page size %u",
                             field, block_tokens, pt);
    for (size_t i = 0; i < n; i++)
        if (h[i].len < 1 || h[i].len > KVD_ENGINE_HASH_MAX)
            return kvd_error_set(err, KVD_EINVAL, "%s[%zu]: %zu bytes; a hash is 1..%d bytes",
                                 field, i, h[i].len, KVD_ENGINE_HASH_MAX);
    const uint64_t r = pt / block_tokens, end = first_block + n;
    /* Pages whose last block ((p + 1) * r - 1) lies in [first_block, end). */
    const uint64_t p0 = first_block / r, p1 = end / r;
    if (p1 <= p0)
        return 0;
    uint64_t *hs = malloc(sizeof *hs * (size_t)(p1 - p0));
    if (!hs)
        return kvd_error_set(err, KVD_ENOMEM, "out of memory");
    const char *tenant = ctx->principal ? kvd_auth_tenant(ctx->auth, ctx->principal) : "";
    XXH3_state_t *x = XXH3_createState();
    if (!x) {
        free(hs);
        return kvd_error_set(err, KVD_ENOMEM, "out of memory");
    }
    for (uint64_t p = p0; p < p1; p++) {
        const ProtobufCBinaryData *name = &h[(p + 1) * r - 1 - first_block];
        XXH3_64bits_reset_withSeed(x, KVD_ENGINE_HASH_SEED);
        XXH3_64bits_update(x, tenant, strlen(tenant) + 1); /* with its NUL */
        XXH3_64bits_update(x, name->data, name->len);
        hs[p - p0] = XXH3_64bits_digest(x);
    }
    XXH3_freeState(x);
    *out = hs;
    *nout = (size_t)(p1 - p0);
    return 0;
}

int kvd_ctx_check_model(kvd_req_ctx *ctx, const char *model, kvd_error *err)
{
    if (kvd_auth_model_allowed(ctx->principal, model))
        return 0;
    return kvd_error_set(err, KVD_EPERM, "tenant %s may not use model '%.128s'",
                         kvd_auth_tenant(ctx->auth, ctx->principal), model);
}

int kvd_ctx_check_seq(kvd_req_ctx *ctx, const void *id, size_t id_len, kvd_error *err)
{
    if (!ctx->principal)
        return 0;
    kvd_seq_info info;
    memset(&info, 0, sizeof info);
    int rc = kvd_store_seq_stat(ctx->svc->store, id, id_len, &info, err);
    if (rc == 0)
        rc = kvd_ctx_check_model(ctx, info.model, err);
    kvd_seq_info_clear(&info);
    return rc;
}

int kvd_ctx_quota_reserve(kvd_req_ctx *ctx, const char *model, uint64_t sequences,
                          uint64_t bytes, kvd_error *err)
{
    int rc = kvd_quota_reserve(ctx->auth, model, sequences, bytes, err);
    if (rc != KVD_ENOMEM || !ctx->auth)
        return rc;
    static _Atomic int64_t last_recount_ms;
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    int64_t now = (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
    int64_t prev = atomic_load(&last_recount_ms);
    if ((prev == 0 || now - prev >= 1000) &&
        atomic_compare_exchange_strong(&last_recount_ms, &prev, now)) {
        kvd_usage_rescan(ctx);
        kvd_error_clear(err);
        rc = kvd_quota_reserve(ctx->auth, model, sequences, bytes, err);
    }
    if (rc == KVD_ENOMEM)
        KVD_METRIC_ADD(quota_rejections_total, 1);
    return rc;
}

static int guard_check_model(void *arg, const char *model, kvd_error *err)
{
    return kvd_ctx_check_model(arg, model, err);
}

static int guard_reserve(void *arg, const char *model, uint64_t bytes, kvd_error *err)
{
    return kvd_ctx_quota_reserve(arg, model, 0, bytes, err);
}

static void guard_commit_lock(void *arg, int on)
{
    if (on)
        kvd_quota_lock(((kvd_req_ctx *)arg)->auth);
    else
        kvd_quota_unlock(((kvd_req_ctx *)arg)->auth);
}

static void guard_settle(void *arg, const char *model, uint64_t bytes)
{
    kvd_quota_settle(((kvd_req_ctx *)arg)->auth, model, 0, bytes);
}

static void guard_release(void *arg, const char *model, uint64_t bytes)
{
    kvd_quota_release(((kvd_req_ctx *)arg)->auth, model, 0, bytes);
}

int kvd_service_store_ok(kvd_store *st)
{
    return !st || (kvd_store_broken(st) == NULL && kvd_service_device_ok(st));
}

int kvd_service_device_ok(kvd_store *st)
{
    kvd_backend *dev = st ? kvd_store_device_opened(st) : NULL;
    if (!dev)
        return 1;
    kvd_backend_desc d;
    kvd_backend_describe(dev, &d);
    return d.healthy;
}

void kvd_ctx_compute(kvd_req_ctx *ctx, kvd_compute_guard *g, kvd_compute *c)
{
    *g = (kvd_compute_guard){guard_check_model, guard_reserve, guard_commit_lock,
                             guard_settle,      guard_release, ctx};
    *c = (kvd_compute){ctx->svc->store, kvd_store_backend(ctx->svc->store), g,
                       kvd_store_device(ctx->svc->store)};
}
