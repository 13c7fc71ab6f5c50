/*
 * Search and SparseAttend: top-k token search over a sequence's PQ index and
 * sparse attention over the tokens it picks (kvdepot.proto, SearchRequest).
 * Shared request checks and the read helper live in compute.c
 * (compute_internal.h).
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "compute_internal.h"
#include "kvdepot/attention.h"
#include "kvdepot/backend.h"
#include "kvdepot/convert.h"
#include "kvdepot/pq.h"
#include "kvdepot/v1/kvdepot.pb-c.h"
#include "rpc.h"
#include "seqcodec.h"

#define SEARCH_MAX_TOKENS (1u << 20)
#define PQ_TRAIN_TOKENS 4096

/* State of one search, kept for SparseAttend's attention step. */
typedef struct search_run {
    kvd__seq_ctx sc;
    kvd_seq_codecs codecs;
    uint64_t start, n; /* token range */
    uint8_t *kv;       /* K then V of the range, wire layout, model dtype */
    int64_t per_head;  /* entries per kv head */
    int32_t *idx;      /* (Hkv, per_head) positions within the range */
    float *scores;     /* (Hkv, per_head) */
} search_run;

static void search_run_free(search_run *r)
{
    free(r->kv);
    free(r->idx);
    free(r->scores);
}

/*
 * The PQ index of a token range, and its top-k (kvdepot.proto, SearchRequest):
 * per kv head, centroids are trained on the keys of the first
 * min(n, PQ_TRAIN_TOKENS) tokens of the range (K-means seeded with
 * layer * 65536 + kv_head, the sequence's pq iterations), every key of the
 * range is encoded, and the summed queries of the head's GQA group rank them.
 */
static int run_search(kvd_req_ctx *ctx, kvd_backend *be, const Kvdepot__V1__SearchRequest *req,
                      search_run *r, kvd_error *err)
{
    memset(r, 0, sizeof *r);
    int rc;
    if ((rc = kvd__load_seq(ctx, &req->sequence_id, "sequence_id", req->layer, &r->sc, err)))
        return rc;
    const kvd_model_info *m = &r->sc.model;
    int found = 0;
    if ((rc = kvd_store_seq_codecs_get(ctx->svc->store, req->sequence_id.data, req->sequence_id.len,
                                       &r->codecs, &found, err)))
        return rc;
    if (!r->codecs.pq_m)
        return kvd_error_set(err, KVD_EPRECOND,
                             "sequence has no PQ index (create it with codecs.pq)");
    size_t want = (size_t)m->num_q_heads * m->head_dim;
    if (req->n_q != want)
        return kvd_error_set(err, KVD_EINVAL,
                             "q: %zu floats, model %s needs num_q_heads x head_dim = %u x %u",
                             req->n_q, m->name, m->num_q_heads, m->head_dim);
    r->start = req->token_start;
    r->n = req->num_tokens;
    if ((rc = kvd__token_range("search", r->start, &r->n, r->sc.layer_tokens, err)))
        return rc;
    if (r->n == 0)
        return kvd_error_set(err, KVD_EINVAL, "search: empty token range");
    if (r->n > SEARCH_MAX_TOKENS)
        return kvd_error_set(err, KVD_EINVAL, "search: %llu tokens, at most %u per call",
                             (unsigned long long)r->n, SEARCH_MAX_TOKENS);
    if (req->k > r->n)
        return kvd_error_set(err, KVD_EINVAL, "k: %u is larger than the %llu tokens searched",
                             req->k, (unsigned long long)r->n);
    const int H = (int)m->num_kv_heads, D = (int)m->head_dim, G = (int)(m->num_q_heads / H);
    const int M = (int)r->codecs.pq_m, nb = r->codecs.pq_bits, K = 1 << nb;
    const size_t es = kvd_dtype_size(m->dtype);
    const uint64_t bytes = 2 * r->n * (uint64_t)H * D * es;
    kvd_pq_search_params sp = {req->k, req->initial_tokens, req->recent_tokens, KVD_PQ_AGG_SUM};
    r->per_head = kvd_pq_search_count((int64_t)r->n, &sp);
    r->kv = malloc(bytes);
    float *keys = malloc(sizeof(float) * r->n * D);
    float *cent = malloc(sizeof(float) * (size_t)M * K * (D / M));
    uint8_t *codes = malloc(r->n * (size_t)M);
    r->idx = malloc(sizeof(int32_t) * (size_t)(r->per_head ? r->per_head : 1) * H);
    r->scores = malloc(sizeof(float) * (size_t)(r->per_head ? r->per_head : 1) * H);
    uint32_t *uidx = malloc(sizeof(uint32_t) * (size_t)(r->per_head ? r->per_head : 1));
    if (!r->kv || !keys || !cent || !codes || !r->idx || !r->scores || !uidx) {
        rc = kvd_error_set(err, KVD_ENOMEM, "out of memory for a %llu-token search",
                           (unsigned long long)r->n);
        goto done;
    }
    if ((rc = kvd__read_window(ctx->svc->store, &req->sequence_id, req->layer, r->start, r->n,
                               r->kv, bytes, err)))
        goto done;
    for (int h = 0; h < H && rc == 0; h++) {
        /* Keys of head h: rows of the wire layout [token][kv_head][dim]. */
        int64_t ks[2] = {(int64_t)r->n, D};
        kvd_tensor src = kvd_tensor_make(m->dtype, r->kv + (size_t)h * D * es, 2, ks);
        src.stride[0] = (int64_t)H * D * (int64_t)es;
        kvd_tensor dst = kvd_tensor_make(KVD_DTYPE_F32, keys, 2, ks);
        if ((rc = kvd_convert(be, &dst, &src, err)))
            break;
        int64_t ntrain = r->n < PQ_TRAIN_TOKENS ? (int64_t)r->n : PQ_TRAIN_TOKENS;
        int64_t ts[2] = {ntrain, D}, cs[3] = {M, K, D / M}, cds[2] = {(int64_t)r->n, M};
        kvd_tensor train = kvd_tensor_make(KVD_DTYPE_F32, keys, 2, ts);
        kvd_tensor tc = kvd_tensor_make(KVD_DTYPE_F32, cent, 3, cs);
        kvd_tensor tcodes = kvd_tensor_make(KVD_DTYPE_U8, codes, 2, cds);
        kvd_kmeans_params km = {K, (int)r->codecs.pq_iterations,
                                (uint64_t)req->layer * 65536 + (uint64_t)h, 0};
        if ((rc = kvd_pq_train(be, &train, &km, &tc, err)) ||
            (rc = kvd_pq_encode(be, &dst, &tc, &tcodes, err)))
            break;
        int64_t qs[2] = {G, D}, os[1] = {r->per_head};
        kvd_tensor tq = kvd_tensor_make(KVD_DTYPE_F32, (void *)(req->q + (size_t)h * G * D), 2, qs);
        kvd_tensor ti = kvd_tensor_make(KVD_DTYPE_U32, uidx, 1, os);
        kvd_tensor tsc = kvd_tensor_make(KVD_DTYPE_F32, r->scores + (size_t)h * r->per_head, 1, os);
        int64_t nout = 0;
        if ((rc = kvd_pq_search(be, &tc, &tcodes, &tq, &sp, &ti, &tsc, &nout, err)))
            break;
        if (nout != r->per_head) {
            rc = kvd_error_set(err, KVD_EINTERNAL, "search returned %lld of %lld entries",
                               (long long)nout, (long long)r->per_head);
            break;
        }
        for (int64_t i = 0; i < nout; i++)
            r->idx[(size_t)h * r->per_head + i] = (int32_t)uidx[i];
    }
done:
    free(keys);
    free(cent);
    free(codes);
    free(uidx);
    return rc;
}

/* HeadTokens of a run (pointing into heads_tok / the run's scores). */
static int heads_to_pb(const search_run *r, Kvdepot__V1__HeadTokens *heads,
                       Kvdepot__V1__HeadTokens **hp, uint64_t *tok, kvd_error *err)
{
    const int H = (int)r->sc.model.num_kv_heads;
    for (int h = 0; h < H; h++) {
        kvdepot__v1__head_tokens__init(&heads[h]);
        heads[h].kv_head = (uint32_t)h;
        heads[h].n_tokens = (size_t)r->per_head;
        heads[h].tokens = tok + (size_t)h * r->per_head;
        heads[h].n_scores = (size_t)r->per_head;
        heads[h].scores = r->scores + (size_t)h * r->per_head;
        for (int64_t i = 0; i < r->per_head; i++)
            heads[h].tokens[i] = r->start + (uint64_t)r->idx[(size_t)h * r->per_head + i];
        hp[h] = &heads[h];
    }
    (void)err;
    return 0;
}

int kvd_h_search(kvd_req_ctx *ctx, const ProtobufCMessage *msg, grpc_byte_buffer **reply,
                 kvd_error *err)
{
    const Kvdepot__V1__SearchRequest *req = (const Kvdepot__V1__SearchRequest *)msg;
    kvd_backend *be;
    int rc = kvd__compute_backend(&be, err);
    if (rc)
        return rc;
    search_run r;
    if ((rc = run_search(ctx, be, req, &r, err))) {
        search_run_free(&r);
        return rc;
    }
    const int H = (int)r.sc.model.num_kv_heads;
    Kvdepot__V1__HeadTokens *heads = calloc((size_t)H, sizeof *heads);
    Kvdepot__V1__HeadTokens **hp = calloc((size_t)H, sizeof *hp);
    uint64_t *tok = malloc(sizeof(uint64_t) * (size_t)(r.per_head ? r.per_head : 1) * H);
    if (!heads || !hp || !tok)
        rc = kvd_error_set(err, KVD_ENOMEM, "out of memory");
    else {
        heads_to_pb(&r, heads, hp, tok, err);
        Kvdepot__V1__SearchResponse resp = KVDEPOT__V1__SEARCH_RESPONSE__INIT;
        resp.n_heads = (size_t)H;
        resp.heads = hp;
        rc = kvd__reply_msg(ctx, &resp.base, reply, err);
    }
    free(heads);
    free(hp);
    free(tok);
    search_run_free(&r);
    return rc;
}

int kvd_h_sparse_attend(kvd_req_ctx *ctx, const ProtobufCMessage *msg, grpc_byte_buffer **reply,
                        kvd_error *err)
{
    const Kvdepot__V1__SparseAttendRequest *req = (const Kvdepot__V1__SparseAttendRequest *)msg;
    if (!req->search)
        return kvd_error_set(err, KVD_EINVAL, "search: missing");
    if (!isfinite(req->scale))
        return kvd_error_set(err, KVD_EINVAL, "scale: not finite");
    kvd_backend *be;
    int rc = kvd__compute_backend(&be, err);
    if (rc)
        return rc;
    search_run r;
    if ((rc = run_search(ctx, be, req->search, &r, err))) {
        search_run_free(&r);
        return rc;
    }
    const kvd_model_info *m = &r.sc.model;
    const int H = (int)m->num_kv_heads, D = (int)m->head_dim, Hq = (int)m->num_q_heads;
    const size_t es = kvd_dtype_size(m->dtype);
    float *out = malloc(sizeof(float) * (size_t)Hq * D), *lse = malloc(sizeof(float) * Hq);
    Kvdepot__V1__HeadTokens *heads = calloc((size_t)H, sizeof *heads);
    Kvdepot__V1__HeadTokens **hp = calloc((size_t)H, sizeof *hp);
    uint64_t *tok = malloc(sizeof(uint64_t) * (size_t)(r.per_head ? r.per_head : 1) * H);
    if (!out || !lse || !heads || !hp || !tok) {
        rc = kvd_error_set(err, KVD_ENOMEM, "out of memory");
        goto done;
    }
    kvd_attn_sparse_args a;
    memset(&a, 0, sizeof a);
    a.dims = (kvd_attn_dims){Hq, H, D, D, kvd__default_scale(req->scale, m->head_dim)};
    int64_t qs[2] = {Hq, D}, ls[1] = {Hq}, ks[3] = {H, (int64_t)r.n, D}, is[2] = {H, r.per_head};
    a.q = kvd_tensor_make(KVD_DTYPE_F32, req->search->q, 2, qs);
    a.k = kvd_tensor_make(m->dtype, r.kv, 3, ks);
    a.k.stride[0] = (int64_t)D * (int64_t)es;
    a.k.stride[1] = (int64_t)H * D * (int64_t)es;
    a.k.stride[2] = (int64_t)es;
    a.v = a.k;
    a.v.data = r.kv + r.n * (size_t)H * D * es;
    a.idx = kvd_tensor_make(KVD_DTYPE_I32, r.idx, 2, is);
    a.out = kvd_tensor_make(KVD_DTYPE_F32, out, 2, qs);
    a.lse = kvd_tensor_make(KVD_DTYPE_F32, lse, 1, ls);
    if ((rc = kvd_attn_sparse(be, 1, &a, err)))
        goto done;
    heads_to_pb(&r, heads, hp, tok, err);
    Kvdepot__V1__AttendResult res = KVDEPOT__V1__ATTEND_RESULT__INIT;
    res.n_output = (size_t)Hq * D;
    res.output = out;
    res.n_lse = (size_t)Hq;
    res.lse = lse;
    res.num_tokens = (uint64_t)r.per_head;
    Kvdepot__V1__SparseAttendResponse resp = KVDEPOT__V1__SPARSE_ATTEND_RESPONSE__INIT;
    resp.result = &res;
    resp.n_heads = (size_t)H;
    resp.heads = hp;
    rc = kvd__reply_msg(ctx, &resp.base, reply, err);
done:
    free(out);
    free(lse);
    free(heads);
    free(hp);
    free(tok);
    search_run_free(&r);
    return rc;
}
