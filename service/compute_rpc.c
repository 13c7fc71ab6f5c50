/*
 * The compute RPCs: Attend, Search, SparseAttend and PlanFetch. Each handler
 * decodes its request into plain arrays, calls service/compute (compute.h),
 * and encodes the answer; what is computed, and every check of the
 * arguments, lives there.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "compute.h"
#include "convert.h"
#include "kvdepot/convert.h"
#include "kvdepot/tensor.h"
#include "kvdepot/v1/kvdepot.pb-c.h"
#include "pqindex.h"
#include "rpc.h"

/* Pack m into *reply; KVD_ENOMEM when it exceeds max-message-bytes. */
static int reply_msg(kvd_req_ctx *ctx, const ProtobufCMessage *m, grpc_byte_buffer **reply,
                     kvd_error *err)
{
    size_t n = protobuf_c_message_get_packed_size(m);
    if (n > ctx->svc->cfg->max_message_bytes)
        return kvd_error_set(err, KVD_ENOMEM,
                             "reply of %zu bytes exceeds max-message-bytes (%llu): send fewer "
                             "queries per call",
                             n, (unsigned long long)ctx->svc->cfg->max_message_bytes);
    *reply = kvd_pack_n(m, n);
    if (!*reply)
        return kvd_error_set(err, KVD_ENOMEM, "out of memory packing the reply");
    return 0;
}

/* The compute context of the call, and the caller's key of the sequence
 * named by the request's sequence_id. */
static int compute_for(kvd_req_ctx *ctx, const ProtobufCBinaryData *id, kvd_compute_guard *g,
                       kvd_compute *c, kvd_seq_key *key, kvd_error *err)
{
    kvd_ctx_compute(ctx, g, c);
    return kvd_ctx_seq_key(ctx, id, "sequence_id", key, err);
}

/* n values of dtype sdt at src as ddt at dst (little-endian hosts). */
static void convert_1d(void *dst, kvd_dtype ddt, const void *src, kvd_dtype sdt, size_t n)
{
    const int64_t len = (int64_t)n;
    const kvd_tensor d = kvd_tensor_make(ddt, dst, 1, &len);
    const kvd_tensor s = kvd_tensor_make(sdt, (void *)src, 1, &len);
    kvd_convert_ref(&d, &s);
}

/* Query i given packed (q_bytes in q_dtype) as f32 in *f (malloc'd), which
 * q->q then points at. */
static int unpack_query(const Kvdepot__V1__AttendQuery *q, size_t i, kvd_attend_query *out,
                        float **f, kvd_error *err)
{
    if (q->n_q)
        return kvd_error_set(err, KVD_EINVAL, "queries[%zu]: give q or q_bytes, not both", i);
    const kvd_dtype dt = (kvd_dtype)q->q_dtype; /* the wire's numbering */
    const size_t es = kvd_dtype_is_float(dt) ? kvd_dtype_size(dt) : 0;
    if (!es)
        return kvd_error_set(err, KVD_EINVAL, "queries[%zu].q_dtype: %d, want F16, BF16 or F32", i,
                             (int)dt);
    if (q->q_bytes.len % es)
        return kvd_error_set(err, KVD_EINVAL,
                             "queries[%zu].q_bytes: %zu bytes, not a whole number of %zu-byte "
                             "values",
                             i, q->q_bytes.len, es);
    const size_t nv = q->q_bytes.len / es;
    if (!(*f = malloc(sizeof(float) * (nv ? nv : 1))))
        return kvd_error_set(err, KVD_ENOMEM, "out of memory");
    convert_1d(*f, KVD_DTYPE_F32, q->q_bytes.data, dt, nv);
    out->q = *f;
    out->n_q = nv;
    return 0;
}

int kvd_h_attend(kvd_req_ctx *ctx, const ProtobufCMessage *msg, grpc_byte_buffer **reply,
                 kvd_error *err)
{
    const Kvdepot__V1__AttendRequest *req = (const Kvdepot__V1__AttendRequest *)msg;
    size_t n = req->n_queries;
    if (n > KVD_ATTEND_MAX_BATCH) /* before sizing anything by n */
        return kvd_error_set(err, KVD_EINVAL, "queries: %zu, at most %d per call", n,
                             KVD_ATTEND_MAX_BATCH);
    kvd_compute_guard g;
    kvd_compute c;
    kvd_ctx_compute(ctx, &g, &c);
    kvd_attend_query *qs = calloc(n ? n : 1, sizeof *qs);
    kvd_attend_result *res = calloc(n ? n : 1, sizeof *res);
    Kvdepot__V1__AttendResult *pr = calloc(n ? n : 1, sizeof *pr);
    Kvdepot__V1__AttendResult **pp = calloc(n ? n : 1, sizeof *pp);
    kvd_seq_key *keys = malloc((n ? n : 1) * sizeof *keys);
    float **unpacked = calloc(n ? n : 1, sizeof *unpacked); /* f32 of packed queries */
    uint16_t **packed = calloc(n ? n : 1, sizeof *packed);  /* 16-bit outputs */
    int rc = 0;
    if (!qs || !res || !pr || !pp || !keys || !unpacked || !packed) {
        rc = kvd_error_set(err, KVD_ENOMEM, "out of memory");
        goto done;
    }
    const int odt = req->output_dtype;
    if (odt != KVDEPOT__V1__DTYPE__DTYPE_UNSPECIFIED && odt != KVDEPOT__V1__DTYPE__DTYPE_F32 &&
        odt != KVDEPOT__V1__DTYPE__DTYPE_F16 && odt != KVDEPOT__V1__DTYPE__DTYPE_BF16) {
        rc = kvd_error_set(err, KVD_EINVAL, "output_dtype: %d, want F16, BF16 or F32", odt);
        goto done;
    }
    for (size_t i = 0; i < n && rc == 0; i++) {
        const Kvdepot__V1__AttendQuery *q = req->queries[i];
        char field[48];
        snprintf(field, sizeof field, "queries[%zu].sequence_id", i);
        rc = kvd_ctx_seq_key(ctx, &q->sequence_id, field, &keys[i], err);
        qs[i] = (kvd_attend_query){keys[i].id, keys[i].len,    q->q,
                                   q->n_q,     q->token_start, q->num_tokens};
        if (rc == 0 && (q->q_bytes.len || q->q_dtype))
            rc = unpack_query(q, i, &qs[i], &unpacked[i], err);
    }
    if (rc)
        goto done;
    if ((rc = kvd_compute_attend(&c, req->layer, req->scale, qs, n, res, err)))
        goto done;
    for (size_t i = 0; i < n && rc == 0; i++) {
        kvdepot__v1__attend_result__init(&pr[i]);
        const size_t no = (size_t)res[i].num_q_heads * res[i].head_dim;
        if (odt == KVDEPOT__V1__DTYPE__DTYPE_F16 || odt == KVDEPOT__V1__DTYPE__DTYPE_BF16) {
            uint16_t *o = malloc(2 * (no ? no : 1));
            if (!o) {
                rc = kvd_error_set(err, KVD_ENOMEM, "out of memory");
                break;
            }
            convert_1d(o, (kvd_dtype)odt, res[i].out, KVD_DTYPE_F32, no);
            packed[i] = o;
            pr[i].output_bytes.data = (uint8_t *)o;
            pr[i].output_bytes.len = 2 * no;
        } else {
            pr[i].n_output = no;
            pr[i].output = res[i].out;
        }
        pr[i].n_lse = res[i].num_q_heads;
        pr[i].lse = res[i].lse;
        pr[i].num_tokens = res[i].num_tokens;
        pp[i] = &pr[i];
    }
    if (rc)
        goto done;
    Kvdepot__V1__AttendResponse resp = KVDEPOT__V1__ATTEND_RESPONSE__INIT;
    resp.n_results = n;
    resp.results = pp;
    rc = reply_msg(ctx, &resp.base, reply, err);
done:
    kvd_attend_results_clear(res, res ? n : 0);
    for (size_t i = 0; i < n && unpacked && packed; i++) {
        free(unpacked[i]);
        free(packed[i]);
    }
    free(unpacked);
    free(packed);
    free(res);
    free(qs);
    free(keys);
    free(pr);
    free(pp);
    return rc;
}

static void search_args(const Kvdepot__V1__SearchRequest *req, const kvd_seq_key *key,
                        kvd_search_args *a)
{
    *a =
        (kvd_search_args){key->id,          key->len,       req->layer,          req->q,
                          req->n_q,         req->k,         req->initial_tokens, req->recent_tokens,
                          req->token_start, req->num_tokens};
}

/* HeadTokens of a result, pointing into it. */
static int heads_to_pb(const kvd_search_result *r, Kvdepot__V1__HeadTokens **heads_out,
                       Kvdepot__V1__HeadTokens ***hp_out, kvd_error *err)
{
    const size_t H = r->num_kv_heads;
    Kvdepot__V1__HeadTokens *heads = calloc(H ? H : 1, sizeof *heads);
    Kvdepot__V1__HeadTokens **hp = calloc(H ? H : 1, sizeof *hp);
    *heads_out = heads;
    *hp_out = hp;
    if (!heads || !hp)
        return kvd_error_set(err, KVD_ENOMEM, "out of memory");
    for (size_t h = 0; h < H; h++) {
        kvdepot__v1__head_tokens__init(&heads[h]);
        heads[h].kv_head = (uint32_t)h;
        heads[h].n_tokens = (size_t)r->per_head;
        heads[h].tokens = r->tokens + h * r->per_head;
        heads[h].n_scores = (size_t)r->per_head;
        heads[h].scores = r->scores + h * r->per_head;
        hp[h] = &heads[h];
    }
    return 0;
}

/* Search (sparse = 0) or SparseAttend (1) and its reply. */
static int search_rpc(kvd_req_ctx *ctx, const Kvdepot__V1__SearchRequest *req, int sparse,
                      float scale, grpc_byte_buffer **reply, kvd_error *err)
{
    kvd_compute_guard g;
    kvd_compute c;
    kvd_seq_key key;
    int rc = compute_for(ctx, &req->sequence_id, &g, &c, &key, err);
    if (rc)
        return rc;
    kvd_search_args a;
    search_args(req, &key, &a);
    kvd_search_result r;
    memset(&r, 0, sizeof r);
    Kvdepot__V1__HeadTokens *heads = NULL, **hp = NULL;
    rc = sparse ? kvd_compute_sparse_attend(&c, &a, scale, &r, err)
                : kvd_compute_search(&c, &a, &r, err);
    if (rc == 0 && (rc = heads_to_pb(&r, &heads, &hp, err)) == 0) {
        Kvdepot__V1__AttendResult res = KVDEPOT__V1__ATTEND_RESULT__INIT;
        res.n_output = (size_t)r.num_q_heads * r.head_dim;
        res.output = r.out;
        res.n_lse = r.num_q_heads;
        res.lse = r.lse;
        res.num_tokens = r.per_head;
        Kvdepot__V1__SparseAttendResponse sresp = KVDEPOT__V1__SPARSE_ATTEND_RESPONSE__INIT;
        sresp.result = &res;
        sresp.n_heads = r.num_kv_heads;
        sresp.heads = hp;
        Kvdepot__V1__SearchResponse resp = KVDEPOT__V1__SEARCH_RESPONSE__INIT;
        resp.n_heads = r.num_kv_heads;
        resp.heads = hp;
        rc = reply_msg(ctx, sparse ? &sresp.base : &resp.base, reply, err);
    }
    free(heads);
    free(hp);
    kvd_search_result_clear(&r);
    return rc;
}

int kvd_h_search(kvd_req_ctx *ctx, const ProtobufCMessage *msg, grpc_byte_buffer **reply,
                 kvd_error *err)
{
    return search_rpc(ctx, (const Kvdepot__V1__SearchRequest *)msg, 0, 0.0f, reply, err);
}

int kvd_h_sparse_attend(kvd_req_ctx *ctx, const ProtobufCMessage *msg, grpc_byte_buffer **reply,
                        kvd_error *err)
{
    const Kvdepot__V1__SparseAttendRequest *req = (const Kvdepot__V1__SparseAttendRequest *)msg;
    if (!req->search)
        return kvd_error_set(err, KVD_EINVAL, "search: missing");
    return search_rpc(ctx, req->search, 1, req->scale, reply, err);
}

int kvd_h_pq_centroids(kvd_req_ctx *ctx, const ProtobufCMessage *msg, grpc_byte_buffer **reply,
                       kvd_error *err)
{
    const Kvdepot__V1__GetPQCentroidsRequest *req = (const Kvdepot__V1__GetPQCentroidsRequest *)msg;
    kvd_compute_guard g;
    kvd_compute c;
    kvd_seq_key key;
    int rc = compute_for(ctx, &req->sequence_id, &g, &c, &key, err);
    if (rc)
        return rc;
    kvd_pq_centroids pc;
    rc = kvd_compute_pq_centroids(&c, key.id, key.len, req->layer, &pc, err);
    if (!rc) {
        Kvdepot__V1__GetPQCentroidsResponse resp = KVDEPOT__V1__GET_PQCENTROIDS_RESPONSE__INIT;
        resp.layer = req->layer;
        resp.num_kv_heads = pc.num_kv_heads;
        resp.head_dim = pc.head_dim;
        resp.m = pc.m;
        resp.bits = pc.bits;
        resp.centroids_id = pc.id;
        /* little-endian f32, as in memory on the hosts kvdepotd builds for */
        resp.centroids.data = (uint8_t *)pc.data;
        resp.centroids.len = sizeof(float) * pc.num_kv_heads * ((size_t)1 << pc.bits) * pc.head_dim;
        rc = reply_msg(ctx, &resp.base, reply, err);
    }
    kvd_pq_centroids_clear(&pc);
    return rc;
}

int kvd_h_pq_rebuild(kvd_req_ctx *ctx, const ProtobufCMessage *msg, grpc_byte_buffer **reply,
                     kvd_error *err)
{
    const Kvdepot__V1__RebuildPQIndexRequest *req = (const Kvdepot__V1__RebuildPQIndexRequest *)msg;
    kvd_compute_guard g;
    kvd_compute c;
    kvd_seq_key key;
    int rc = compute_for(ctx, &req->sequence_id, &g, &c, &key, err);
    if (rc)
        return rc;
    kvd_pq_rebuild_info ri;
    if ((rc = kvd_compute_pq_rebuild(&c, key.id, key.len, req->layer_start, req->num_layers, &ri,
                                     err)))
        return rc;
    kvd_seq_info info;
    memset(&info, 0, sizeof info);
    if ((rc = kvd_store_seq_stat(c.store, key.id, key.len, &info, err)))
        return rc;
    Kvdepot__V1__SequenceInfo si;
    kvd_seq_info_to_pb(&info, &si);
    kvd_codecs_pb cp;
    kvd_error cerr; /* rebuilt already: an unreadable codec record leaves them out */
    kvd_seq_info_codecs_pb(c.store, &info, 1, &si, &cp, &cerr);
    kvd_ctx_seq_wire(ctx, &si.sequence_id);
    Kvdepot__V1__RebuildPQIndexResponse resp = KVDEPOT__V1__REBUILD_PQINDEX_RESPONSE__INIT;
    resp.layers_rebuilt = ri.layers_rebuilt;
    resp.tokens_indexed = ri.tokens_indexed;
    resp.sequence = &si;
    rc = reply_msg(ctx, &resp.base, reply, err);
    kvd_codecs_pb_clear(&cp);
    kvd_seq_info_clear(&info);
    return rc;
}

int kvd_h_plan_fetch(kvd_req_ctx *ctx, const ProtobufCMessage *msg, grpc_byte_buffer **reply,
                     kvd_error *err)
{
    const Kvdepot__V1__PlanFetchRequest *req = (const Kvdepot__V1__PlanFetchRequest *)msg;
    kvd_compute_guard g;
    kvd_compute c;
    kvd_seq_key key;
    int rc = compute_for(ctx, &req->sequence_id, &g, &c, &key, err);
    if (rc)
        return rc;
    kvd_plan_args a = {
        key.id,           key.len,         req->bandwidth_bytes_per_s, req->compute_flops_per_s,
        req->layer_start, req->num_layers, req->assume_activations};
    kvd_plan p;
    rc = kvd_compute_plan_fetch(&c, &a, &p, err);
    if (rc)
        return rc;
    Kvdepot__V1__PlanFetchResponse resp = KVDEPOT__V1__PLAN_FETCH_RESPONSE__INIT;
    resp.split_tokens = p.split_tokens;
    resp.num_tokens = p.cost.n;
    resp.predicted_seconds = p.predicted_seconds;
    resp.kv_only_seconds = p.kv_only_seconds;
    resp.activation_bytes = p.activation_bytes;
    resp.kv_bytes = p.kv_bytes;
    resp.recompute_seconds = p.recompute_seconds;
    resp.kv_bytes_per_token = p.cost.kv_bytes;
    resp.activation_bytes_per_token = p.cost.x_bytes;
    resp.flops_per_token = p.cost.flops;
    return reply_msg(ctx, &resp.base, reply, err);
}
