/*
 * Unary kvdepot.v1.KVDepot handlers: validate every field, call the store,
 * pack the reply. Replies point into store structs until packed, so nothing
 * is copied twice.
 */
#include <stdlib.h>
#include <string.h>

#include "activation.h"
#include "convert.h"
#include "metrics.h"
#include "rpc.h"
#include "validate.h"

#define LIST_PAGE_DEFAULT 1000
#define LIST_PAGE_MAX 10000

/* A reply that no longer fits the send limit is an error for the caller to
 * page around, never a truncated message. */
static int reply_or_oom(grpc_byte_buffer **reply, const ProtobufCMessage *m, kvd_req_ctx *ctx,
                        kvd_error *err)
{
    size_t n = protobuf_c_message_get_packed_size(m);
    if (n > ctx->svc->cfg->max_message_bytes)
        return kvd_error_set(err, KVD_ENOMEM,
                             "reply of %zu bytes exceeds max-message-bytes (%llu)", n,
                             (unsigned long long)ctx->svc->cfg->max_message_bytes);
    *reply = kvd_pack_n(m, n);
    if (!*reply)
        return kvd_error_set(err, KVD_ENOMEM, "out of memory packing the reply");
    return 0;
}

void kvd_usage_rescan(kvd_req_ctx *ctx)
{
    kvd_auth *a = kvd_service_auth(ctx->svc);
    kvd_store_totals tot;
    kvd_error err;
    kvd_error_clear(&err);
    if (a && kvd_auth_scan(a, ctx->svc->store, &tot, &err) == 0) {
        KVD_METRIC_SET(sequences_stored, tot.sequences);
        KVD_METRIC_SET(payload_bytes_stored, tot.payload_bytes);
        KVD_METRIC_SET(stored_bytes, tot.stored_bytes);
        KVD_METRIC_SET(pages_sealed, tot.sealed_pages);
    }
    kvd_auth_unref(a);
}

int kvd_h_put_model(kvd_req_ctx *ctx, const ProtobufCMessage *msg, grpc_byte_buffer **reply,
                    kvd_error *err)
{
    const Kvdepot__V1__PutModelRequest *req = (const Kvdepot__V1__PutModelRequest *)msg;
    if (!req->model)
        return kvd_error_set(err, KVD_EINVAL, "model: missing");
    kvd_model_info in, out;
    int rc = kvd_model_from_pb(req->model, &in, err);
    if (rc)
        return rc;
    if ((rc = kvd_check_model_name(in.name, "model.name", err)) ||
        (rc = kvd_check_dtype(in.dtype, "model.dtype", err)) ||
        (rc = kvd_ctx_check_model(ctx, in.name, err)))
        return rc;
    if ((rc = kvd_model_validate(&in, err)))
        return rc;
    int created = 0;
    if ((rc = kvd_store_model_put(ctx->svc->store, &in, req->replace, &out, &created, err)))
        return rc;
    Kvdepot__V1__Model pm;
    kvd_model_to_pb(&out, &pm);
    Kvdepot__V1__PutModelResponse resp = KVDEPOT__V1__PUT_MODEL_RESPONSE__INIT;
    resp.model = &pm;
    resp.created = created != 0;
    return reply_or_oom(reply, &resp.base, ctx, err);
}

int kvd_h_get_model(kvd_req_ctx *ctx, const ProtobufCMessage *msg, grpc_byte_buffer **reply,
                    kvd_error *err)
{
    const Kvdepot__V1__GetModelRequest *req = (const Kvdepot__V1__GetModelRequest *)msg;
    int rc;
    if ((rc = kvd_check_model_name(req->name, "name", err)) ||
        (rc = kvd_ctx_check_model(ctx, req->name, err)))
        return rc;
    kvd_model_info out;
    if ((rc = kvd_store_model_get(ctx->svc->store, req->name, &out, err)))
        return rc;
    Kvdepot__V1__Model pm;
    kvd_model_to_pb(&out, &pm);
    Kvdepot__V1__GetModelResponse resp = KVDEPOT__V1__GET_MODEL_RESPONSE__INIT;
    resp.model = &pm;
    return reply_or_oom(reply, &resp.base, ctx, err);
}

int kvd_h_list_models(kvd_req_ctx *ctx, const ProtobufCMessage *msg, grpc_byte_buffer **reply,
                      kvd_error *err)
{
    (void)msg;
    kvd_model_info *models = NULL;
    size_t n = 0;
    int rc = kvd_store_model_list(ctx->svc->store, &models, &n, err);
    if (rc)
        return rc;
    Kvdepot__V1__Model *pms = n ? calloc(n, sizeof *pms) : NULL;
    Kvdepot__V1__Model **ptrs = n ? calloc(n, sizeof *ptrs) : NULL;
    if (n && (!pms || !ptrs)) {
        rc = kvd_error_set(err, KVD_ENOMEM, "out of memory listing %zu models", n);
    } else {
        /* A tenant sees the models of its namespaces only. */
        size_t k = 0;
        for (size_t i = 0; i < n; i++) {
            if (!kvd_auth_model_allowed(ctx->principal, models[i].name))
                continue;
            kvd_model_to_pb(&models[i], &pms[k]);
            ptrs[k] = &pms[k];
            k++;
        }
        Kvdepot__V1__ListModelsResponse resp = KVDEPOT__V1__LIST_MODELS_RESPONSE__INIT;
        resp.n_models = k;
        resp.models = ptrs;
        rc = reply_or_oom(reply, &resp.base, ctx, err);
    }
    free(ptrs);
    free(pms);
    free(models);
    return rc;
}

int kvd_h_delete_model(kvd_req_ctx *ctx, const ProtobufCMessage *msg, grpc_byte_buffer **reply,
                       kvd_error *err)
{
    const Kvdepot__V1__DeleteModelRequest *req = (const Kvdepot__V1__DeleteModelRequest *)msg;
    int rc;
    if ((rc = kvd_check_model_name(req->name, "name", err)) ||
        (rc = kvd_ctx_check_model(ctx, req->name, err)))
        return rc;
    uint64_t deleted = 0;
    if ((rc = kvd_store_model_delete(ctx->svc->store, req->name, req->force, &deleted, err)))
        return rc;
    if (deleted)
        kvd_usage_rescan(ctx);
    Kvdepot__V1__DeleteModelResponse resp = KVDEPOT__V1__DELETE_MODEL_RESPONSE__INIT;
    resp.deleted_sequences = deleted;
    return reply_or_oom(reply, &resp.base, ctx, err);
}

/* The gauges lose a sequence that held `bytes` of payload. */
static void seq_gauges_drop(const kvd_seq_info *info, uint64_t bytes)
{
    KVD_METRIC_ADD(sequences_stored, -1);
    KVD_METRIC_ADD(payload_bytes_stored, -(int64_t)bytes);
    KVD_METRIC_ADD(stored_bytes, -(int64_t)info->stored_bytes);
    KVD_METRIC_ADD(pages_sealed, -(int64_t)info->sealed_pages);
}

int kvd_h_create_sequence(kvd_req_ctx *ctx, const ProtobufCMessage *msg,
                          grpc_byte_buffer **reply, kvd_error *err)
{
    const Kvdepot__V1__CreateSequenceRequest *req =
        (const Kvdepot__V1__CreateSequenceRequest *)msg;
    int rc;
    kvd_seq_key key;
    if ((rc = kvd_ctx_seq_key(ctx, &req->sequence_id, "sequence_id", &key, err)))
        return rc;
    kvd_seq_info info;
    if ((rc = kvd_ctx_create_sequence(ctx, req, &key, 0, &info, err)))
        return rc;
    Kvdepot__V1__SequenceInfo si;
    kvd_seq_info_to_pb(&info, &si);
    kvd_codecs_pb cp;
    rc = kvd_seq_info_codecs_pb(ctx->svc->store, &info, 1, &si, &cp, err);
    kvd_ctx_seq_wire(ctx, &si.sequence_id);
    Kvdepot__V1__CreateSequenceResponse resp = KVDEPOT__V1__CREATE_SEQUENCE_RESPONSE__INIT;
    resp.sequence = &si;
    if (!rc)
        rc = reply_or_oom(reply, &resp.base, ctx, err);
    kvd_codecs_pb_clear(&cp);
    kvd_seq_info_clear(&info);
    return rc;
}

static int create_sequence(kvd_req_ctx *ctx, const Kvdepot__V1__CreateSequenceRequest *req,
                           const kvd_seq_key *kp, const uint64_t *prefix, size_t n_prefix,
                           int pending, kvd_seq_info *info, kvd_error *err);

int kvd_ctx_create_sequence(kvd_req_ctx *ctx, const Kvdepot__V1__CreateSequenceRequest *req,
                            const kvd_seq_key *key, int pending, kvd_seq_info *info, kvd_error *err)
{
    int rc;
    memset(info, 0, sizeof *info);
    if ((rc = kvd_check_model_name(req->model, "model", err)) ||
        (rc = kvd_ctx_check_model(ctx, req->model, err)))
        return rc;
    uint32_t pt = ctx->svc->page_tokens;
    /* The prefix's page hashes: given, or from engine block hashes. */
    const uint64_t *prefix = req->n_prefix_hashes ? req->prefix_hashes : NULL;
    size_t n_prefix = req->n_prefix_hashes;
    uint64_t *engine = NULL;
    if (req->n_engine_prefix_hashes || req->engine_block_tokens) {
        const uint32_t bt = req->engine_block_tokens;
        if (req->n_prefix_hashes)
            return kvd_error_set(err, KVD_EINVAL,
                                 "prefix_hashes and engine_prefix_hashes are exclusive");
        if (bt && pt % bt == 0 && req->n_engine_prefix_hashes % (pt / bt))
            return kvd_error_set(err, KVD_EINVAL,
                                 "engine_prefix_hashes: %zu blocks of %u tokens are not whole "
                                 "pages of %u tokens (give a multiple of %u)",
                                 req->n_engine_prefix_hashes, bt, pt, pt / bt);
        if ((rc = kvd_ctx_engine_pages(ctx, req->engine_prefix_hashes, req->n_engine_prefix_hashes,
                                       bt, 0, "engine_prefix_hashes", &engine, &n_prefix, err)))
            return rc;
        prefix = engine;
    }
    rc = create_sequence(ctx, req, key, prefix, n_prefix, pending, info, err);
    free(engine);
    return rc;
}

int kvd_ctx_stat_or_create(kvd_req_ctx *ctx, const Kvdepot__V1__CreateSequenceRequest *cr,
                           const ProtobufCBinaryData *wire_id, const kvd_seq_key *key,
                           kvd_seq_info *info, int *made, kvd_error *err)
{
    *made = 0;
    if (cr->sequence_id.len && (cr->sequence_id.len != wire_id->len ||
                                memcmp(cr->sequence_id.data, wire_id->data, wire_id->len)))
        return kvd_error_set(err, KVD_EINVAL,
                             "header.create.sequence_id: differs from header.sequence_id (leave "
                             "it empty)");
    for (int tries = 0;; tries++) {
        int rc = kvd_store_seq_stat(ctx->svc->store, key->id, key->len, info, err);
        if (rc != KVD_ENOTFOUND) {
            if (rc == 0 && strcmp(info->model, cr->model ? cr->model : "")) {
                rc = kvd_error_set(err, KVD_EPRECOND,
                                   "header.create: the sequence exists, of model \"%s\", not "
                                   "\"%s\"",
                                   info->model, cr->model ? cr->model : "");
                kvd_seq_info_clear(info);
            }
            return rc;
        }
        kvd_error_clear(err);
        rc = kvd_ctx_create_sequence(ctx, cr, key, 1, info, err);
        if (rc == 0)
            *made = 1;
        if (rc != KVD_EEXIST || tries)
            return rc;
        kvd_error_clear(err); /* another call created it meanwhile: append to it */
    }
}

static int create_sequence(kvd_req_ctx *ctx, const Kvdepot__V1__CreateSequenceRequest *req,
                           const kvd_seq_key *kp, const uint64_t *prefix, size_t n_prefix,
                           int pending, kvd_seq_info *info, kvd_error *err)
{
    int rc;
    uint32_t pt = ctx->svc->page_tokens;
    if (req->n_prefix_token_ids && req->n_prefix_token_ids != n_prefix * pt)
        return kvd_error_set(err, KVD_EINVAL,
                             "prefix_token_ids: %zu ids given, %zu prefix blocks of %u tokens "
                             "need %llu (or none)",
                             req->n_prefix_token_ids, n_prefix, pt,
                             (unsigned long long)n_prefix * pt);
    /* A sequence started from a prefix holds the prefix's tokens from the
     * start: they count against the byte quota like appended ones. */
    uint64_t bytes = 0;
    kvd_model_info mi;
    if ((rc = kvd_store_model_get(ctx->svc->store, req->model, &mi, err)))
        return rc;
    kvd_seq_codecs codecs;
    if ((rc = kvd_codecs_from_pb(req->codecs, &mi, pt, &codecs, err)))
        return rc;
    const int store_x = req->codecs && req->codecs->store_activations;
    if (store_x && n_prefix)
        return kvd_error_set(err, KVD_EINVAL,
                             "codecs.store_activations: not with prefix_hashes (activations "
                             "must start at token 0, and a shared prefix carries none)");
    if (n_prefix) {
        kvd_seq_info shape;
        memset(&shape, 0, sizeof shape);
        uint64_t tokens = (uint64_t)n_prefix * pt * mi.num_layers;
        shape.num_layers = 1;
        shape.layer_tokens = &tokens;
        bytes = kvd_seq_payload_bytes(&shape, &mi);
    }
    if ((rc = kvd_ctx_quota_reserve(ctx, req->model, 1, bytes, err)))
        return rc;
    /* One write creates the sequence with its codecs (always recorded, raw
     * too), its TTL and its activation counts: a crash never leaves a
     * sequence without them, and a failure leaves nothing. */
    kvd_seq_create_opts opts;
    memset(&opts, 0, sizeof opts);
    opts.codecs = &codecs;
    opts.store_activations = store_x;
    opts.pending = pending;
    if (req->ttl_seconds)
        opts.ttl_ms = req->ttl_seconds > UINT64_MAX / 1000 ? UINT64_MAX / 2
                                                          : req->ttl_seconds * 1000;
    kvd_quota_lock(ctx->auth);
    rc = kvd_store_seq_create_ex(ctx->svc->store, kp->id, kp->len, req->model, prefix, n_prefix,
                                 req->n_prefix_token_ids ? req->prefix_token_ids : NULL,
                                 req->n_prefix_token_ids, &opts, info, err);
    if (rc == 0)
        kvd_quota_settle(ctx->auth, req->model, 1, bytes);
    kvd_quota_unlock(ctx->auth);
    if (rc) {
        kvd_quota_release(ctx->auth, req->model, 1, bytes);
        return rc;
    }
    KVD_METRIC_ADD(sequences_stored, 1);
    KVD_METRIC_ADD(payload_bytes_stored, kvd_seq_payload_bytes(info, &mi));
    KVD_METRIC_ADD(stored_bytes, info->stored_bytes);
    KVD_METRIC_ADD(pages_sealed, info->sealed_pages);
    return 0;
}

int kvd_undo_create_sequence(kvd_service *svc, kvd_auth *auth, const kvd_seq_key *key,
                             const kvd_seq_info *was, kvd_error *err)
{
    uint64_t tokens = 0;
    for (uint32_t l = 0; l < was->num_layers; l++)
        tokens += was->layer_tokens[l];
    kvd_model_info mi;
    kvd_quota_lock(auth);
    int rc = kvd_store_model_get(svc->store, was->model, &mi, err);
    if (!rc)
        rc = kvd_store_seq_delete_unchanged(svc->store, key->id, key->len, was->created_unix_ms,
                                            tokens, err);
    const uint64_t bytes = rc ? 0 : kvd_seq_payload_bytes(was, &mi);
    if (!rc)
        kvd_quota_forget(auth, was->model, 1, bytes);
    kvd_quota_unlock(auth);
    if (rc)
        return rc;
    seq_gauges_drop(was, bytes);
    return 0;
}

int kvd_h_lookup(kvd_req_ctx *ctx, const ProtobufCMessage *msg, grpc_byte_buffer **reply,
                 kvd_error *err)
{
    const Kvdepot__V1__LookupRequest *req = (const Kvdepot__V1__LookupRequest *)msg;
    int rc;
    if ((rc = kvd_check_model_name(req->model, "model", err)) ||
        (rc = kvd_ctx_check_model(ctx, req->model, err)))
        return rc;
    uint64_t matched = 0, per = 1; /* blocks of the request per page */
    if (req->n_block_hashes && (req->n_engine_block_hashes || req->engine_block_tokens))
        return kvd_error_set(err, KVD_EINVAL, "block_hashes and engine_block_hashes are exclusive");
    if (req->n_engine_block_hashes || req->engine_block_tokens) {
        uint64_t *hs = NULL;
        size_t n = 0;
        if ((rc = kvd_ctx_engine_pages(ctx, req->engine_block_hashes, req->n_engine_block_hashes,
                                       req->engine_block_tokens, 0, "engine_block_hashes", &hs, &n,
                                       err)))
            return rc;
        per = ctx->svc->page_tokens / req->engine_block_tokens;
        if (n)
            rc = kvd_store_lookup(ctx->svc->store, req->model, hs, n, &matched, err);
        else {
            kvd_model_info mi;
            rc = kvd_store_model_get(ctx->svc->store, req->model, &mi, err);
        }
        free(hs);
    } else if (req->n_block_hashes) {
        rc = kvd_store_lookup(ctx->svc->store, req->model, req->block_hashes,
                              req->n_block_hashes, &matched, err);
    } else {
        /* An empty chain still names a model that must exist. */
        kvd_model_info mi;
        rc = kvd_store_model_get(ctx->svc->store, req->model, &mi, err);
    }
    if (rc)
        return rc;
    Kvdepot__V1__LookupResponse resp = KVDEPOT__V1__LOOKUP_RESPONSE__INIT;
    resp.matched_blocks = matched * per;
    resp.matched_tokens = matched * ctx->svc->page_tokens;
    return reply_or_oom(reply, &resp.base, ctx, err);
}

int kvd_h_stat_sequence(kvd_req_ctx *ctx, const ProtobufCMessage *msg,
                        grpc_byte_buffer **reply, kvd_error *err)
{
    const Kvdepot__V1__StatSequenceRequest *req = (const Kvdepot__V1__StatSequenceRequest *)msg;
    int rc;
    kvd_seq_key key;
    if ((rc = kvd_ctx_seq_key(ctx, &req->sequence_id, "sequence_id", &key, err)))
        return rc;
    kvd_seq_info info;
    memset(&info, 0, sizeof info);
    if ((rc = kvd_store_seq_stat(ctx->svc->store, key.id, key.len, &info, err)))
        return rc;
    if ((rc = kvd_ctx_check_model(ctx, info.model, err))) {
        kvd_seq_info_clear(&info);
        return rc;
    }
    Kvdepot__V1__SequenceInfo si;
    kvd_seq_info_to_pb(&info, &si);
    kvd_ctx_seq_wire(ctx, &si.sequence_id);
    Kvdepot__V1__WalRecoveryLoss loss;
    kvd_seq_loss_to_pb(&info, &loss, &si);
    kvd_codecs_pb cp;
    rc = kvd_seq_info_codecs_pb(ctx->svc->store, &info, 1, &si, &cp, err);
    Kvdepot__V1__StatSequenceResponse resp = KVDEPOT__V1__STAT_SEQUENCE_RESPONSE__INIT;
    resp.sequence = &si;
    if (!rc)
        rc = reply_or_oom(reply, &resp.base, ctx, err);
    kvd_codecs_pb_clear(&cp);
    kvd_seq_info_clear(&info);
    return rc;
}

int kvd_h_list_sequences(kvd_req_ctx *ctx, const ProtobufCMessage *msg,
                         grpc_byte_buffer **reply, kvd_error *err)
{
    const Kvdepot__V1__ListSequencesRequest *req =
        (const Kvdepot__V1__ListSequencesRequest *)msg;
    int rc;
    if (req->model && req->model[0] &&
        ((rc = kvd_check_model_name(req->model, "model", err)) ||
         (rc = kvd_ctx_check_model(ctx, req->model, err))))
        return rc;
    if (req->page_token.len > KVD_WIRE_SEQ_ID_MAX)
        return kvd_error_set(err, KVD_EINVAL, "page_token: %zu bytes, not one this server issued",
                             req->page_token.len);
    /* A tenant lists its own namespace: from its start, or from the page
     * token (an id in it) on. */
    kvd_seq_key after;
    if (req->page_token.len) {
        if ((rc = kvd_ctx_seq_key(ctx, &req->page_token, "page_token", &after, err)))
            return rc;
    } else {
        kvd_ctx_seq_ns(ctx, &after); /* "" without a tokens file: from the start */
    }
    size_t limit = req->page_size ? req->page_size : LIST_PAGE_DEFAULT;
    if (limit > LIST_PAGE_MAX)
        limit = LIST_PAGE_MAX;
    kvd_seq_info *seqs = NULL;
    size_t n = 0;
    int more = 0;
    rc = kvd_store_seq_list(ctx->svc->store, req->model && req->model[0] ? req->model : NULL,
                            after.len ? after.id : NULL, after.len, limit, &seqs, &n, &more, err);
    if (rc)
        return rc;
    /* Past the namespace's ids: the list ends there. */
    for (size_t i = 0; i < n && after.ns; i++)
        if (seqs[i].id_len < after.ns || memcmp(seqs[i].id, after.id, after.ns) != 0) {
            for (size_t j = i; j < n; j++)
                kvd_seq_info_clear(&seqs[j]);
            n = i;
            more = 0;
        }
    /* A tenant sees the sequences of its namespaces only. The page token
     * stays the last id scanned, so a page filtered down to nothing still
     * lets the caller go on. */
    uint8_t last_id[KVD_SEQ_ID_MAX];
    size_t last_len = n ? seqs[n - 1].id_len : 0;
    if (n)
        memcpy(last_id, seqs[n - 1].id, last_len);
    if (ctx->principal) {
        size_t k = 0;
        for (size_t i = 0; i < n; i++) {
            if (kvd_auth_model_allowed(ctx->principal, seqs[i].model))
                seqs[k++] = seqs[i];
            else
                kvd_seq_info_clear(&seqs[i]);
        }
        n = k;
    }
    Kvdepot__V1__SequenceInfo *sis = n ? calloc(n, sizeof *sis) : NULL;
    Kvdepot__V1__SequenceInfo **ptrs = n ? calloc(n, sizeof *ptrs) : NULL;
    kvd_codecs_pb *cps = n ? calloc(n, sizeof *cps) : NULL;
    if (n && (!sis || !ptrs || !cps)) {
        rc = kvd_error_set(err, KVD_ENOMEM, "out of memory listing %zu sequences", n);
        goto out;
    }
    for (size_t i = 0; i < n; i++) {
        kvd_seq_info_to_pb(&seqs[i], &sis[i]);
        /* a sequence deleted since the scan lists without codecs; no SVD
         * widths (each would load its artifact snapshot) */
        kvd_error cerr;
        kvd_seq_info_codecs_pb(ctx->svc->store, &seqs[i], 0, &sis[i], &cps[i], &cerr);
        kvd_ctx_seq_wire(ctx, &sis[i].sequence_id);
        ptrs[i] = &sis[i];
    }
    Kvdepot__V1__ListSequencesResponse resp = KVDEPOT__V1__LIST_SEQUENCES_RESPONSE__INIT;
    resp.sequences = ptrs;
    resp.n_sequences = n;
    /* Long page-token chains of big sequences can outgrow the send limit:
     * return fewer per page rather than fail. */
    size_t keep = n;
    for (;;) {
        resp.n_sequences = keep;
        int cut = keep < n || more;
        resp.next_page_token.data =
            cut && keep ? (uint8_t *)seqs[keep - 1].id : cut && more ? last_id : NULL;
        resp.next_page_token.len =
            cut && keep ? seqs[keep - 1].id_len : cut && more ? last_len : 0;
        kvd_ctx_seq_wire(ctx, &resp.next_page_token); /* the id in the caller's terms */
        size_t sz = protobuf_c_message_get_packed_size(&resp.base);
        if (sz <= ctx->svc->cfg->max_message_bytes || keep <= 1)
            break;
        keep /= 2;
    }
    rc = reply_or_oom(reply, &resp.base, ctx, err);
out:
    for (size_t i = 0; i < n; i++) {
        kvd_seq_info_clear(&seqs[i]);
        if (cps)
            kvd_codecs_pb_clear(&cps[i]);
    }
    free(seqs);
    free(sis);
    free(ptrs);
    free(cps);
    return rc;
}

int kvd_h_delete_sequence(kvd_req_ctx *ctx, const ProtobufCMessage *msg,
                          grpc_byte_buffer **reply, kvd_error *err)
{
    const Kvdepot__V1__DeleteSequenceRequest *req =
        (const Kvdepot__V1__DeleteSequenceRequest *)msg;
    int rc;
    kvd_seq_key key;
    if ((rc = kvd_ctx_seq_key(ctx, &req->sequence_id, "sequence_id", &key, err)))
        return rc;
    /* What the sequence holds when it goes leaves the quotas and gauges
     * with it: one stat and the delete under the quota's commit lock. */
    kvd_seq_info info;
    memset(&info, 0, sizeof info);
    kvd_model_info mi;
    uint64_t freed = 0, bytes = 0;
    kvd_quota_lock(ctx->auth);
    if ((rc = kvd_store_seq_stat(ctx->svc->store, key.id, key.len, &info, err)) == 0 &&
        (rc = kvd_ctx_check_model(ctx, info.model, err)) == 0 &&
        (rc = kvd_store_model_get(ctx->svc->store, info.model, &mi, err)) == 0 &&
        (rc = kvd_store_seq_delete(ctx->svc->store, key.id, key.len, &freed, err)) == 0) {
        bytes = kvd_seq_payload_bytes(&info, &mi);
        kvd_quota_forget(ctx->auth, info.model, 1, bytes);
    }
    kvd_quota_unlock(ctx->auth);
    if (rc) {
        kvd_seq_info_clear(&info);
        return rc;
    }
    seq_gauges_drop(&info, bytes);
    kvd_seq_info_clear(&info);
    Kvdepot__V1__DeleteSequenceResponse resp = KVDEPOT__V1__DELETE_SEQUENCE_RESPONSE__INIT;
    resp.freed_pages = freed;
    return reply_or_oom(reply, &resp.base, ctx, err);
}
