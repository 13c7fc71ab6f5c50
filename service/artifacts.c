/*
 * UploadArtifacts (client streaming) and GetArtifacts (server streaming):
 * a model's calibration artifacts as f32 arrays (kvdepot.proto).
 *
 * Uploads are collected until the stream ends, validated as a whole against
 * the model and stored in one write, so a malformed artifact anywhere in the
 * stream leaves the stored ones as they were.
 */
#include <stdlib.h>
#include <string.h>

#include "artifact.h"
#include "convert.h"
#include "rpc.h"

typedef struct upload_state {
    char model[KVD_MODEL_NAME_MAX + 1];
    int have_model;
    kvd_artifact *a;
    size_t n, cap;
    uint64_t bytes;
    kvd_store *store; /* charged with the artifacts' bytes (append-memory-bytes) */
    uint64_t charged;
} upload_state;

static void upload_release(void *state)
{
    upload_state *st = state;
    if (!st)
        return;
    kvd_artifacts_free(st->a, st->n);
    kvd_store_append_memory_give(st->store, st->charged);
    free(st);
}

/* Copy one wire artifact; shape and length are checked here, the rest
 * against the model at the end. */
static int take(upload_state *st, const Kvdepot__V1__Artifact *w, kvd_error *err)
{
    size_t idx = st->n;
    if (w->n_shape < 1 || w->n_shape > 2)
        return kvd_error_set(err, KVD_EINVAL, "artifact %zu has %zu dimensions, not 1 or 2", idx,
                             w->n_shape);
    uint64_t ne = 1;
    for (size_t d = 0; d < w->n_shape; d++)
        ne *= w->shape[d];
    if (ne == 0 || ne > (1u << 20) || w->data.len != 4 * ne)
        return kvd_error_set(err, KVD_EINVAL,
                             "artifact %zu: %zu data bytes for shape of %llu f32 values", idx,
                             w->data.len, (unsigned long long)ne);
    if (st->n == st->cap) {
        size_t nc = st->cap ? 2 * st->cap : 16;
        kvd_artifact *na = realloc(st->a, nc * sizeof *na);
        if (!na)
            return kvd_error_set(err, KVD_ENOMEM, "out of memory");
        st->a = na;
        st->cap = nc;
    }
    kvd_artifact *a = &st->a[st->n];
    memset(a, 0, sizeof *a);
    a->kind = (int)w->kind;
    a->layer = w->layer;
    a->kv_head = w->kv_head;
    a->ndim = (uint32_t)w->n_shape;
    for (size_t d = 0; d < w->n_shape; d++)
        a->shape[d] = w->shape[d];
    a->data = malloc(w->data.len);
    if (!a->data)
        return kvd_error_set(err, KVD_ENOMEM, "out of memory");
    /* The wire is little-endian f32, as is every host kvdepot builds for. */
    memcpy(a->data, w->data.data, w->data.len);
    st->n++;
    return 0;
}

static int upload_recv(kvd_req_ctx *ctx, void **state, grpc_byte_buffer *msg, kvd_error *err)
{
    upload_state *st = *state;
    if (!st) {
        st = calloc(1, sizeof *st);
        if (!st)
            return kvd_error_set(err, KVD_ENOMEM, "out of memory");
        *state = st;
    }
    kvd_error_clear(err);
    Kvdepot__V1__UploadArtifactsRequest *m = (Kvdepot__V1__UploadArtifactsRequest *)kvd_bb_unpack(
        &kvdepot__v1__upload_artifacts_request__descriptor, msg, err);
    if (!m)
        return err && err->code
                   ? err->code
                   : kvd_error_set(err, KVD_EINVAL,
                                   "a message does not parse as UploadArtifactsRequest");
    int rc = 0;
    if (!st->have_model) {
        size_t nl = m->model ? strlen(m->model) : 0;
        if (nl == 0 || nl > KVD_MODEL_NAME_MAX)
            rc = kvd_error_set(err, KVD_EINVAL, "the first message names no valid model");
        else {
            memcpy(st->model, m->model, nl + 1);
            st->have_model = 1;
            rc = kvd_ctx_check_model(ctx, st->model, err);
        }
    } else if (m->model && m->model[0] && strcmp(m->model, st->model) != 0) {
        rc = kvd_error_set(err, KVD_EINVAL, "model changed from %s to %.128s within the stream",
                           st->model, m->model);
    }
    for (size_t i = 0; rc == 0 && i < m->n_artifacts; i++) {
        st->bytes += m->artifacts[i]->data.len;
        if (st->bytes > ctx->svc->cfg->max_append_bytes)
            rc = kvd_error_set(err, KVD_ENOMEM, "artifacts exceed max-append-bytes (%llu)",
                               (unsigned long long)ctx->svc->cfg->max_append_bytes);
        else if ((rc = kvd_store_append_memory_take(ctx->svc->store, m->artifacts[i]->data.len,
                                                    err)) == 0) {
            /* held until the stream ends, with the appends in flight */
            st->store = ctx->svc->store;
            st->charged += m->artifacts[i]->data.len;
            rc = take(st, m->artifacts[i], err);
        }
    }
    protobuf_c_message_free_unpacked(&m->base, NULL);
    return rc;
}

static int upload_finish(kvd_req_ctx *ctx, void **state, grpc_byte_buffer **reply,
                         kvd_error *err)
{
    upload_state *st = *state;
    if (!st || !st->have_model)
        return kvd_error_set(err, KVD_EINVAL, "empty UploadArtifacts stream (no model)");
    if (kvd_ctx_expired(ctx))
        return kvd_error_set(err, KVD_ETIMEDOUT, "deadline passed before the artifacts were stored");
    int rc = kvd_store_artifacts_put(ctx->svc->store, st->model, st->a, st->n, err);
    if (rc)
        return rc;
    Kvdepot__V1__UploadArtifactsResponse resp = KVDEPOT__V1__UPLOAD_ARTIFACTS_RESPONSE__INIT;
    resp.artifacts = (uint32_t)st->n;
    *reply = kvd_pack(&resp.base);
    return *reply ? 0 : kvd_error_set(err, KVD_ENOMEM, "out of memory packing the reply");
}

const kvd_stream_ops kvd_upload_artifacts_ops = {
    .recv = upload_recv,
    .finish = upload_finish,
    .release = upload_release,
};

typedef struct get_state {
    kvd_artifact *a;
    size_t n, next;
} get_state;

static void get_release(void *state)
{
    get_state *st = state;
    if (!st)
        return;
    kvd_artifacts_free(st->a, st->n);
    free(st);
}

static int get_start(kvd_req_ctx *ctx, const ProtobufCMessage *req, void **state, kvd_error *err)
{
    const Kvdepot__V1__GetArtifactsRequest *r = (const Kvdepot__V1__GetArtifactsRequest *)req;
    if (!r->model || !r->model[0])
        return kvd_error_set(err, KVD_EINVAL, "model name is empty");
    int rc = kvd_ctx_check_model(ctx, r->model, err);
    if (rc)
        return rc;
    int kinds[KVD_ARTIFACT_KIND_MAX];
    size_t nk = 0;
    for (size_t i = 0; i < r->n_kinds; i++) {
        int k = (int)r->kinds[i];
        if (k < 1 || k > KVD_ARTIFACT_KIND_MAX)
            return kvd_error_set(err, KVD_EINVAL, "artifact kind %d is not one of 1..%d", k,
                                 KVD_ARTIFACT_KIND_MAX);
        if (nk < KVD_ARTIFACT_KIND_MAX)
            kinds[nk++] = k;
    }
    get_state *st = calloc(1, sizeof *st);
    if (!st)
        return kvd_error_set(err, KVD_ENOMEM, "out of memory");
    rc = kvd_store_artifacts_get(ctx->svc->store, r->model, kinds, nk, &st->a, &st->n, err);
    if (rc) {
        free(st);
        return rc;
    }
    *state = st;
    return 0;
}

static int get_next(kvd_req_ctx *ctx, void *state, grpc_byte_buffer **msg, kvd_error *err)
{
    (void)ctx;
    get_state *st = state;
    *msg = NULL;
    if (st->next == st->n)
        return 0;
    const kvd_artifact *a = &st->a[st->next++];
    Kvdepot__V1__Artifact w = KVDEPOT__V1__ARTIFACT__INIT;
    uint32_t shape[2] = {a->shape[0], a->shape[1]};
    w.kind = (Kvdepot__V1__ArtifactKind)a->kind;
    w.layer = a->layer;
    w.kv_head = a->kv_head;
    w.n_shape = a->ndim;
    w.shape = shape;
    uint64_t ne = a->ndim == 2 ? (uint64_t)a->shape[0] * a->shape[1] : a->shape[0];
    w.data.data = (uint8_t *)a->data;
    w.data.len = 4 * ne;
    Kvdepot__V1__GetArtifactsResponse resp = KVDEPOT__V1__GET_ARTIFACTS_RESPONSE__INIT;
    resp.artifact = &w;
    *msg = kvd_pack(&resp.base);
    return *msg ? 0 : kvd_error_set(err, KVD_ENOMEM, "out of memory packing an artifact");
}

const kvd_stream_ops kvd_get_artifacts_ops = {
    .start = get_start,
    .next = get_next,
    .release = get_release,
};
