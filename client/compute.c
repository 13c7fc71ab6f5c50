/*
 * libkvdepot compute calls: Attend and PlanFetch, plus local attention and
 * merge with the same CPU kernels the server runs, so a caller can check or
 * extend a server result (attention over the tokens it still holds).
 *
 * The calls go through kvdepot__call_messages: one request message (or the
 * AppendPages stream), one response.
 */
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "codec.h"
#include "internal.h"
#include "kvdepot.h"
#include "kvdepot/attention.h"
#include "kvdepot/backend.h"
#include "kvdepot/convert.h"
#include "kvdepot/v1/kvdepot.pb-c.h"
#include "page.h"

#define PATH_ATTEND "/kvdepot.v1.KVDepot/Attend"
#define PATH_PLAN_FETCH "/kvdepot.v1.KVDepot/PlanFetch"
#define PATH_PQ_CENTROIDS "/kvdepot.v1.KVDepot/GetPQCentroids"
#define PATH_PQ_REBUILD "/kvdepot.v1.KVDepot/RebuildPQIndex"
#define PATH_SEARCH "/kvdepot.v1.KVDepot/Search"
#define PATH_APPEND_PAGES "/kvdepot.v1.KVDepot/AppendPages"
#define PATH_SPARSE_ATTEND "/kvdepot.v1.KVDepot/SparseAttend"
#define ATTEND_MAX_BATCH 1024

/* One request -> one response of type rdesc (*resp: free with
 * protobuf_c_message_free_unpacked). */
static const ProtobufCMessage *the_request(size_t i, void *req)
{
    (void)i;
    return req;
}

static int call_unary(kvdepot_client *c, const char *path, const ProtobufCMessage *req,
                      const ProtobufCMessageDescriptor *rdesc, ProtobufCMessage **resp)
{
    return kvdepot__call_messages(c, path, path, 1, the_request, (void *)req, rdesc, resp);
}

/* ---- local kernels --------------------------------------------------------- */

static pthread_once_t cpu_once = PTHREAD_ONCE_INIT;
static kvd_backend *cpu_be;

/* One CPU backend per process, created at first use; one thread, because a
 * client library should not take the caller's cores unasked. */
static void cpu_init(void)
{
    kvd_cpu_options opt = {1, 0, 0, 0};
    if (kvd_backend_cpu_create(&opt, &cpu_be, NULL) != 0)
        cpu_be = NULL;
}

kvd_backend *kvdepot__cpu_backend(void)
{
    pthread_once(&cpu_once, cpu_init);
    return cpu_be;
}

int kvdepot_attention_local(kvdepot_dtype dtype, uint32_t num_q_heads, uint32_t num_kv_heads,
                            uint32_t head_dim, float scale, const float *q, const void *k,
                            const void *v, uint64_t num_tokens, float *out, float *lse)
{
    kvdepot__clear_error();
    if (!q || !out || !lse || (num_tokens && (!k || !v)))
        return kvdepot__fail(NULL, KVDEPOT_EINVAL, "attention: NULL buffer");
    if (kvdepot_dtype_size(dtype) == 0 || !num_kv_heads || !head_dim ||
        num_q_heads % num_kv_heads || !num_q_heads)
        return kvdepot__fail(NULL, KVDEPOT_EINVAL,
                             "attention: bad shape (dtype %d, %u q heads, %u kv heads, dim %u)",
                             (int)dtype, num_q_heads, num_kv_heads, head_dim);
    kvd_backend *be = kvdepot__cpu_backend();
    if (!be)
        return kvdepot__fail(NULL, KVDEPOT_ENOMEM, "attention: no CPU backend");
    const int64_t H = num_kv_heads, D = head_dim, T = (int64_t)num_tokens;
    kvd_attn_dense_args a;
    memset(&a, 0, sizeof a);
    a.dims.n_q_heads = (int)num_q_heads;
    a.dims.n_kv_heads = (int)H;
    a.dims.head_dim = a.dims.v_dim = (int)D;
    a.dims.softmax_scale = scale != 0.0f ? scale : 1.0f / sqrtf((float)D);
    int64_t qs[2] = {num_q_heads, D}, ls[1] = {num_q_heads}, ks[3] = {H, T, D};
    a.q = kvd_tensor_make(KVD_DTYPE_F32, (void *)q, 2, qs);
    /* [token][kv_head][dim] seen as (kv_head, token, dim). */
    a.k = kvd_tensor_make((kvd_dtype)dtype, (void *)k, 3, ks);
    const int64_t es = (int64_t)kvdepot_dtype_size(dtype); /* strides in bytes */
    a.k.stride[0] = D * es;
    a.k.stride[1] = H * D * es;
    a.k.stride[2] = es;
    a.v = a.k;
    a.v.data = (void *)v;
    a.out = kvd_tensor_make(KVD_DTYPE_F32, out, 2, qs);
    a.lse = kvd_tensor_make(KVD_DTYPE_F32, lse, 1, ls);
    kvd_error err;
    kvd_error_clear(&err);
    if (kvd_attn_dense(be, 1, &a, &err) != 0)
        return kvdepot__fail(NULL, KVDEPOT_EINVAL, "attention: %s", err.msg);
    return KVDEPOT_OK;
}

int kvdepot_attention_merge(uint32_t num_q_heads, uint32_t head_dim, float *out_a, float *lse_a,
                            const float *out_b, const float *lse_b)
{
    kvdepot__clear_error();
    if (!out_a || !lse_a || !out_b || !lse_b)
        return kvdepot__fail(NULL, KVDEPOT_EINVAL, "attention merge: NULL buffer");
    kvd_backend *be = kvdepot__cpu_backend();
    if (!be)
        return kvdepot__fail(NULL, KVDEPOT_ENOMEM, "attention merge: no CPU backend");
    kvd_error err;
    kvd_error_clear(&err);
    if (kvd_attn_merge_into(be, num_q_heads, head_dim, out_a, lse_a, out_b, lse_b, &err) != 0)
        return kvdepot__fail(NULL, KVDEPOT_EINVAL, "attention merge: %s", err.msg);
    return KVDEPOT_OK;
}

/* ---- Attend ------------------------------------------------------------------ */

void kvdepot_attend_results_free(kvdepot_attend_result *r, size_t n)
{
    if (!r)
        return;
    for (size_t i = 0; i < n; i++) {
        free(r[i].output);
        free(r[i].lse);
        memset(&r[i], 0, sizeof r[i]);
    }
}

int kvdepot_attend(kvdepot_client *c, uint32_t layer, float scale,
                   const kvdepot_attend_query *queries, size_t n, kvdepot_attend_result *out)
{
    return kvdepot_attend_dtype(c, layer, scale, KVDEPOT_DTYPE_F32, queries, n, out);
}

int kvdepot_attend_dtype(kvdepot_client *c, uint32_t layer, float scale, kvdepot_dtype odt,
                         const kvdepot_attend_query *queries, size_t n, kvdepot_attend_result *out)
{
    kvdepot__clear_error();
    if (out && queries)
        memset(out, 0, n * sizeof *out);
    if (!c || !queries || !out)
        return kvdepot__fail(c, KVDEPOT_EINVAL, "attend: NULL argument");
    if (n == 0 || n > ATTEND_MAX_BATCH)
        return kvdepot__fail(c, KVDEPOT_EINVAL, "attend: %zu queries, 1..%d per call", n,
                             ATTEND_MAX_BATCH);
    if (odt != KVDEPOT_DTYPE_UNSPECIFIED && odt != KVDEPOT_DTYPE_F32 && odt != KVDEPOT_DTYPE_F16 &&
        odt != KVDEPOT_DTYPE_BF16)
        return kvdepot__fail(c, KVDEPOT_EINVAL, "attend: q_dtype %d, want F16, BF16 or F32",
                             (int)odt);
    if (c->cluster)
        return kvdepot__cluster_attend(c, layer, scale, odt, queries, n, out);
    Kvdepot__V1__AttendQuery *qs = calloc(n, sizeof *qs);
    Kvdepot__V1__AttendQuery **qp = calloc(n, sizeof *qp);
    if (!qs || !qp) {
        free(qs);
        free(qp);
        return kvdepot__fail(c, KVDEPOT_ENOMEM, "attend: out of memory");
    }
    /* 16-bit queries go packed, their outputs come back in 16 bits */
    const int half = odt == KVDEPOT_DTYPE_F16 || odt == KVDEPOT_DTYPE_BF16;
    for (size_t i = 0; i < n; i++) {
        const kvdepot_dtype dt = odt;
        kvdepot__v1__attend_query__init(&qs[i]);
        qs[i].sequence_id.data = (uint8_t *)queries[i].id;
        qs[i].sequence_id.len = queries[i].id_len;
        if (dt == KVDEPOT_DTYPE_F16 || dt == KVDEPOT_DTYPE_BF16) {
            qs[i].q_bytes.data = (uint8_t *)queries[i].q; /* little-endian hosts */
            qs[i].q_bytes.len = queries[i].q ? 2 * queries[i].q_len : 0;
            qs[i].q_dtype = (Kvdepot__V1__DType)dt;
        } else {
            qs[i].q = (float *)queries[i].q;
            qs[i].n_q = queries[i].q ? queries[i].q_len : 0;
        }
        qs[i].token_start = queries[i].token_start;
        qs[i].num_tokens = queries[i].num_tokens;
        qp[i] = &qs[i];
    }
    Kvdepot__V1__AttendRequest req = KVDEPOT__V1__ATTEND_REQUEST__INIT;
    req.layer = layer;
    req.scale = scale;
    req.n_queries = n;
    req.queries = qp;
    if (half)
        req.output_dtype = (Kvdepot__V1__DType)odt;
    /* The request, and the answer (an output as large as each query, plus
     * its LSE: one float per head, taken as 1/32 of the query), must each
     * fit in one gRPC message: name the limit and the batch that fits
     * rather than let gRPC refuse the call. */
    const size_t req_bytes = protobuf_c_message_get_packed_size(&req.base);
    size_t q_values = 0;
    for (size_t i = 0; i < n; i++)
        q_values += queries[i].q ? queries[i].q_len : 0;
    const size_t resp_bytes = (half ? 2 : 4) * q_values + 4 * (q_values / 32) + 32 * n;
    Kvdepot__V1__AttendResponse *resp = NULL;
    int rc;
    if (req_bytes > c->max_message_bytes || resp_bytes > c->max_message_bytes) {
        const size_t worst = req_bytes > resp_bytes ? req_bytes : resp_bytes;
        rc = kvdepot__fail(c, KVDEPOT_ENOMEM,
                           "attend: %zu queries make a %s of about %zu bytes, over the %zu-byte "
                           "message limit (max_message_bytes of kvdepot_connect; kvdepotd's "
                           "max-message-bytes): at most %zu such queries fit in one call",
                           n, req_bytes >= resp_bytes ? "request" : "reply", worst,
                           c->max_message_bytes,
                           (size_t)((double)n * (double)c->max_message_bytes / (double)worst));
    } else {
        rc = call_unary(c, PATH_ATTEND, &req.base, &kvdepot__v1__attend_response__descriptor,
                        (ProtobufCMessage **)&resp);
        unsigned long got = 0, max = 0;
        const char *m =
            rc == KVDEPOT_ENOMEM ? strstr(kvdepot_errmsg(c), "larger than max (") : NULL;
        if (m && sscanf(m, "larger than max (%lu vs. %lu)", &got, &max) == 2 && got > max) {
            const double worst = (double)(got > resp_bytes ? got : resp_bytes);
            rc = kvdepot__fail(c, KVDEPOT_ENOMEM,
                               "attend: the server takes messages of up to %lu bytes "
                               "(max-message-bytes) and %zu queries made %lu: at most %zu such "
                               "queries fit in one call",
                               max, n, got, (size_t)((double)n * (double)max / worst));
        }
    }
    free(qs);
    free(qp);
    if (rc)
        return rc;
    if (resp->n_results != n) {
        rc = kvdepot__fail(c, KVDEPOT_EINTERNAL, "attend: %zu results for %zu queries",
                           resp->n_results, n);
        goto done;
    }
    for (size_t i = 0; i < n; i++) {
        const Kvdepot__V1__AttendResult *r = resp->results[i];
        const size_t no = half ? r->output_bytes.len / 2 : r->n_output;
        if (!r->n_lse || no % r->n_lse || (half && (r->n_output || r->output_bytes.len % 2))) {
            rc = kvdepot__fail(c, KVDEPOT_EINTERNAL, "attend: result %zu malformed", i);
            goto done;
        }
        out[i].num_q_heads = r->n_lse;
        out[i].head_dim = no / r->n_lse;
        out[i].num_tokens = r->num_tokens;
        out[i].output = malloc(sizeof(float) * (no ? no : 1));
        out[i].lse = malloc(sizeof(float) * r->n_lse);
        if (!out[i].output || !out[i].lse) {
            rc = kvdepot__fail(c, KVDEPOT_ENOMEM, "attend: out of memory");
            goto done;
        }
        if (half) { /* little-endian hosts */
            const int64_t len = (int64_t)no;
            const kvd_tensor d = kvd_tensor_make(KVD_DTYPE_F32, out[i].output, 1, &len);
            const kvd_tensor s = kvd_tensor_make((kvd_dtype)odt, r->output_bytes.data, 1, &len);
            kvd_convert_ref(&d, &s);
        } else {
            memcpy(out[i].output, r->output, sizeof(float) * no);
        }
        memcpy(out[i].lse, r->lse, sizeof(float) * r->n_lse);
    }
done:
    if (rc)
        kvdepot_attend_results_free(out, n);
    protobuf_c_message_free_unpacked(&resp->base, NULL);
    return rc;
}

/* ---- PlanFetch ---------------------------------------------------------------- */

int kvdepot_plan_fetch(kvdepot_client *c, const void *id, size_t id_len,
                       double bandwidth_bytes_per_s, double compute_flops_per_s,
                       uint32_t layer_start, uint32_t num_layers, int assume_activations,
                       kvdepot_fetch_plan *out)
{
    kvdepot__clear_error();
    if (out)
        memset(out, 0, sizeof *out);
    if (!c || !out || (!id && id_len))
        return kvdepot__fail(c, KVDEPOT_EINVAL, "plan fetch: NULL argument");
    if (c->cluster)
        return kvdepot__cluster_plan_fetch(c, id, id_len, bandwidth_bytes_per_s,
                                           compute_flops_per_s, layer_start, num_layers,
                                           assume_activations, out);
    Kvdepot__V1__PlanFetchRequest req = KVDEPOT__V1__PLAN_FETCH_REQUEST__INIT;
    req.sequence_id.data = (uint8_t *)id;
    req.sequence_id.len = id_len;
    req.bandwidth_bytes_per_s = bandwidth_bytes_per_s;
    req.compute_flops_per_s = compute_flops_per_s;
    req.layer_start = layer_start;
    req.num_layers = num_layers;
    req.assume_activations = assume_activations != 0;
    Kvdepot__V1__PlanFetchResponse *r = NULL;
    int rc = call_unary(c, PATH_PLAN_FETCH, &req.base,
                        &kvdepot__v1__plan_fetch_response__descriptor, (ProtobufCMessage **)&r);
    if (rc)
        return rc;
    out->split_tokens = r->split_tokens;
    out->num_tokens = r->num_tokens;
    out->predicted_seconds = r->predicted_seconds;
    out->kv_only_seconds = r->kv_only_seconds;
    out->recompute_seconds = r->recompute_seconds;
    out->activation_bytes = r->activation_bytes;
    out->kv_bytes = r->kv_bytes;
    out->kv_bytes_per_token = r->kv_bytes_per_token;
    out->activation_bytes_per_token = r->activation_bytes_per_token;
    out->flops_per_token = r->flops_per_token;
    protobuf_c_message_free_unpacked(&r->base, NULL);
    return KVDEPOT_OK;
}

int kvdepot_pq_centroids_get(kvdepot_client *c, const void *id, size_t id_len, uint32_t layer,
                             kvdepot_pq_centroids *out)
{
    kvdepot__clear_error();
    if (out)
        memset(out, 0, sizeof *out);
    if (!c || !out || (!id && id_len))
        return kvdepot__fail(c, KVDEPOT_EINVAL, "pq centroids: NULL argument");
    if (c->cluster)
        return kvdepot__cluster_pq_centroids(c, id, id_len, layer, out);
    Kvdepot__V1__GetPQCentroidsRequest req = KVDEPOT__V1__GET_PQCENTROIDS_REQUEST__INIT;
    req.sequence_id.data = (uint8_t *)id;
    req.sequence_id.len = id_len;
    req.layer = layer;
    Kvdepot__V1__GetPQCentroidsResponse *r = NULL;
    int rc =
        call_unary(c, PATH_PQ_CENTROIDS, &req.base,
                   &kvdepot__v1__get_pqcentroids_response__descriptor, (ProtobufCMessage **)&r);
    if (rc)
        return rc;
    const uint64_t want = r->bits <= 16 && r->m && r->head_dim % r->m == 0
                              ? (uint64_t)r->num_kv_heads * ((uint64_t)1 << r->bits) * r->head_dim
                              : 0;
    if (!want || r->centroids.len != want * sizeof(float)) {
        rc = kvdepot__fail(c, KVDEPOT_EINTERNAL,
                           "pq centroids: %zu bytes for %u kv heads x 2^%u x %u, m %u",
                           r->centroids.len, r->num_kv_heads, r->bits, r->head_dim, r->m);
    } else if (!(out->data = malloc(r->centroids.len))) {
        rc = kvdepot__fail(c, KVDEPOT_ENOMEM, "pq centroids: out of memory");
    } else {
        memcpy(out->data, r->centroids.data, r->centroids.len); /* little-endian f32 */
        out->count = (size_t)want;
        out->layer = r->layer;
        out->num_kv_heads = r->num_kv_heads;
        out->head_dim = r->head_dim;
        out->m = r->m;
        out->bits = r->bits;
        out->centroids_id = r->centroids_id;
    }
    protobuf_c_message_free_unpacked(&r->base, NULL);
    return rc;
}

int kvdepot_pq_rebuild(kvdepot_client *c, const void *id, size_t id_len, uint32_t layer_start,
                       uint32_t num_layers, uint32_t *layers_rebuilt, uint64_t *tokens_indexed,
                       kvdepot_sequence_info *info)
{
    kvdepot__clear_error();
    if (layers_rebuilt)
        *layers_rebuilt = 0;
    if (tokens_indexed)
        *tokens_indexed = 0;
    if (info)
        memset(info, 0, sizeof *info);
    if (!c || (!id && id_len))
        return kvdepot__fail(c, KVDEPOT_EINVAL, "pq rebuild: NULL argument");
    if (c->cluster)
        return kvdepot__cluster_pq_rebuild(c, id, id_len, layer_start, num_layers, layers_rebuilt,
                                           tokens_indexed, info);
    Kvdepot__V1__RebuildPQIndexRequest req = KVDEPOT__V1__REBUILD_PQINDEX_REQUEST__INIT;
    req.sequence_id.data = (uint8_t *)id;
    req.sequence_id.len = id_len;
    req.layer_start = layer_start;
    req.num_layers = num_layers;
    Kvdepot__V1__RebuildPQIndexResponse *r = NULL;
    int rc =
        call_unary(c, PATH_PQ_REBUILD, &req.base,
                   &kvdepot__v1__rebuild_pqindex_response__descriptor, (ProtobufCMessage **)&r);
    if (rc)
        return rc;
    if (layers_rebuilt)
        *layers_rebuilt = r->layers_rebuilt;
    if (tokens_indexed)
        *tokens_indexed = r->tokens_indexed;
    if (info && r->sequence)
        rc = kvdepot__info_from_pb(c, r->sequence, info);
    protobuf_c_message_free_unpacked(&r->base, NULL);
    return rc;
}

void kvdepot_pq_centroids_free(kvdepot_pq_centroids *c)
{
    if (!c)
        return;
    free(c->data);
    memset(c, 0, sizeof *c);
}

/* ---- codecs ---------------------------------------------------------------------- */

typedef struct codecs_msgs {
    Kvdepot__V1__SequenceCodecs c;
    Kvdepot__V1__CodecSpec k, v;
    Kvdepot__V1__QuantSpec kq, vq;
    Kvdepot__V1__PQSpec pq;
    Kvdepot__V1__VQSpec kvq, vvq;
    Kvdepot__V1__SVDSpec ksvd, vsvd;
} codecs_msgs;

_Static_assert(sizeof(codecs_msgs) <= sizeof(((kvdepot__codecs_pb *)0)->storage),
               "kvdepot__codecs_pb storage too small");

static void spec_to_pb(const kvdepot_codec_spec *s, Kvdepot__V1__CodecSpec *out,
                       Kvdepot__V1__QuantSpec *q, Kvdepot__V1__VQSpec *vq,
                       Kvdepot__V1__SVDSpec *svd)
{
    kvdepot__v1__codec_spec__init(out);
    kvdepot__v1__quant_spec__init(q);
    out->codec = (Kvdepot__V1__Codec)s->codec;
    q->group_size = s->group_size;
    q->rounding = s->stochastic ? KVDEPOT__V1__ROUNDING__ROUNDING_STOCHASTIC
                                : KVDEPOT__V1__ROUNDING__ROUNDING_NEAREST;
    q->axis = (Kvdepot__V1__QuantAxis)s->axis;
    q->seed = s->seed;
    out->quant = q;
    if (s->codec == KVDEPOT_CODEC_VQ || s->vq_sub_dim || s->vq_bits) {
        kvdepot__v1__vqspec__init(vq);
        vq->sub_dim = s->vq_sub_dim;
        vq->bits = s->vq_bits;
        out->vq = vq;
    }
    if (s->svd_removal_rate != 0 || s->svd_num_widths) {
        kvdepot__v1__svdspec__init(svd);
        svd->removal_rate = s->svd_removal_rate;
        svd->n_widths = s->svd_num_widths;
        svd->widths = (uint32_t *)s->svd_widths; /* the message is only packed */
        svd->align = s->svd_align;
        out->svd = svd;
    }
}

void *kvdepot__codecs_to_pb(const kvdepot_codecs *c, kvdepot__codecs_pb *pb)
{
    pb->msg = NULL;
    if (!c)
        return NULL;
    codecs_msgs *m = (codecs_msgs *)(void *)pb->storage;
    kvdepot__v1__sequence_codecs__init(&m->c);
    spec_to_pb(&c->k, &m->k, &m->kq, &m->kvq, &m->ksvd);
    spec_to_pb(&c->v, &m->v, &m->vq, &m->vvq, &m->vsvd);
    m->c.k = &m->k;
    m->c.v = &m->v;
    m->c.raw_sink_tokens = c->raw_sink_tokens;
    m->c.store_activations = c->store_activations != 0;
    if (c->pq_m) {
        kvdepot__v1__pqspec__init(&m->pq);
        m->pq.m = c->pq_m;
        m->pq.bits = c->pq_bits;
        m->pq.iterations = c->pq_iterations;
        m->pq.min_train_tokens = c->pq_min_train_tokens;
        m->c.pq = &m->pq;
    }
    pb->msg = &m->c.base;
    return &m->c;
}

/* ---- Search / SparseAttend --------------------------------------------------------- */

void kvdepot_search_result_free(kvdepot_search_result *r)
{
    if (!r)
        return;
    for (size_t i = 0; i < r->num_heads; i++) {
        free(r->heads[i].tokens);
        free(r->heads[i].scores);
    }
    free(r->heads);
    memset(r, 0, sizeof *r);
}

static void search_req(const kvdepot_search_args *a, Kvdepot__V1__SearchRequest *req)
{
    kvdepot__v1__search_request__init(req);
    req->sequence_id.data = (uint8_t *)a->id;
    req->sequence_id.len = a->id_len;
    req->layer = a->layer;
    req->q = (float *)a->q;
    req->n_q = a->q ? a->q_len : 0;
    req->k = a->k;
    req->initial_tokens = a->initial_tokens;
    req->recent_tokens = a->recent_tokens;
    req->token_start = a->token_start;
    req->num_tokens = a->num_tokens;
}

static int heads_from_pb(kvdepot_client *c, Kvdepot__V1__HeadTokens **in, size_t n,
                         kvdepot_search_result *out)
{
    out->heads = calloc(n ? n : 1, sizeof *out->heads);
    if (!out->heads)
        return kvdepot__fail(c, KVDEPOT_ENOMEM, "search: out of memory");
    out->num_heads = n;
    for (size_t i = 0; i < n; i++) {
        kvdepot_head_tokens *h = &out->heads[i];
        if (in[i]->n_tokens != in[i]->n_scores)
            return kvdepot__fail(c, KVDEPOT_EINTERNAL, "search: malformed head %zu", i);
        h->kv_head = in[i]->kv_head;
        h->count = in[i]->n_tokens;
        h->tokens = malloc(sizeof(uint64_t) * (h->count ? h->count : 1));
        h->scores = malloc(sizeof(float) * (h->count ? h->count : 1));
        if (!h->tokens || !h->scores)
            return kvdepot__fail(c, KVDEPOT_ENOMEM, "search: out of memory");
        if (h->count) { /* an empty repeated field unpacks as NULL */
            memcpy(h->tokens, in[i]->tokens, sizeof(uint64_t) * h->count);
            memcpy(h->scores, in[i]->scores, sizeof(float) * h->count);
        }
    }
    return KVDEPOT_OK;
}

int kvdepot_search(kvdepot_client *c, const kvdepot_search_args *a, kvdepot_search_result *out)
{
    kvdepot__clear_error();
    if (out)
        memset(out, 0, sizeof *out);
    if (!c || !a || !out || (!a->id && a->id_len))
        return kvdepot__fail(c, KVDEPOT_EINVAL, "search: NULL argument");
    if (c->cluster)
        return kvdepot__cluster_search(c, a, out);
    Kvdepot__V1__SearchRequest req;
    search_req(a, &req);
    Kvdepot__V1__SearchResponse *r = NULL;
    int rc = call_unary(c, PATH_SEARCH, &req.base, &kvdepot__v1__search_response__descriptor,
                        (ProtobufCMessage **)&r);
    if (rc)
        return rc;
    rc = heads_from_pb(c, r->heads, r->n_heads, out);
    if (rc)
        kvdepot_search_result_free(out);
    protobuf_c_message_free_unpacked(&r->base, NULL);
    return rc;
}

int kvdepot_sparse_attend(kvdepot_client *c, const kvdepot_search_args *a, float scale,
                          kvdepot_attend_result *out, kvdepot_search_result *tokens)
{
    kvdepot__clear_error();
    if (out)
        memset(out, 0, sizeof *out);
    if (tokens)
        memset(tokens, 0, sizeof *tokens);
    if (!c || !a || !out || (!a->id && a->id_len))
        return kvdepot__fail(c, KVDEPOT_EINVAL, "sparse attend: NULL argument");
    if (c->cluster)
        return kvdepot__cluster_sparse_attend(c, a, scale, out, tokens);
    Kvdepot__V1__SearchRequest sreq;
    search_req(a, &sreq);
    Kvdepot__V1__SparseAttendRequest req = KVDEPOT__V1__SPARSE_ATTEND_REQUEST__INIT;
    req.search = &sreq;
    req.scale = scale;
    Kvdepot__V1__SparseAttendResponse *r = NULL;
    int rc = call_unary(c, PATH_SPARSE_ATTEND, &req.base,
                        &kvdepot__v1__sparse_attend_response__descriptor,
                        (ProtobufCMessage **)&r);
    if (rc)
        return rc;
    const Kvdepot__V1__AttendResult *res = r->result;
    if (!res || !res->n_lse || res->n_output % res->n_lse) {
        rc = kvdepot__fail(c, KVDEPOT_EINTERNAL, "sparse attend: malformed result");
        goto done;
    }
    out->num_q_heads = res->n_lse;
    out->head_dim = res->n_output / res->n_lse;
    out->num_tokens = res->num_tokens;
    out->output = malloc(sizeof(float) * res->n_output);
    out->lse = malloc(sizeof(float) * res->n_lse);
    if (!out->output || !out->lse) {
        rc = kvdepot__fail(c, KVDEPOT_ENOMEM, "sparse attend: out of memory");
        goto done;
    }
    memcpy(out->output, res->output, sizeof(float) * res->n_output);
    memcpy(out->lse, res->lse, sizeof(float) * res->n_lse);
    if (tokens)
        rc = heads_from_pb(c, r->heads, r->n_heads, tokens);
done:
    if (rc) {
        kvdepot_attend_results_free(out, 1);
        kvdepot_search_result_free(tokens);
    }
    protobuf_c_message_free_unpacked(&r->base, NULL);
    return rc;
}

/* ---- client-side encoding and AppendPages ---------------------------------------- */

void kvdepot_pages_free(kvdepot_page *pages, size_t count)
{
    if (!pages)
        return;
    for (size_t i = 0; i < count; i++)
        free(pages[i].data);
    free(pages);
}

static void spec_to_kvd(const kvdepot_codec_spec *in, kvd_codec_spec *out)
{
    memset(out, 0, sizeof *out);
    if (!in)
        return;
    out->codec = (uint8_t)in->codec;
    out->group = (uint16_t)(in->group_size > 65535 ? 65535 : in->group_size);
    out->rounding = in->stochastic ? 1 : 0;
    out->seed = in->seed;
    out->axis = in->axis == KVDEPOT_AXIS_DEFAULT   ? KVD_CODEC_AXIS_DEFAULT
                : in->axis == KVDEPOT_AXIS_TOKEN   ? 0
                : in->axis == KVDEPOT_AXIS_CHANNEL ? 1
                                                   : 255;
    out->vq_sub_dim = (uint8_t)(in->vq_sub_dim > 255 ? 255 : in->vq_sub_dim);
    out->vq_bits = (uint8_t)(in->vq_bits > 255 ? 255 : in->vq_bits);
    if (in->svd_removal_rate != 0 || in->svd_num_widths) {
        out->svd = 1;
        out->svd_rate = in->svd_removal_rate;
        out->svd_align = in->svd_align;
        out->svd_nwidths = (uint32_t)in->svd_num_widths;
        out->svd_widths = in->svd_widths;
    }
}

int kvdepot_encode_pages(const kvdepot_model *m, const kvdepot_codecs *codecs,
                         uint32_t page_tokens, uint32_t layer, uint64_t token_start,
                         uint64_t num_tokens, const void *k, const void *v, kvdepot_page **pages,
                         size_t *count)
{
    return kvdepot_encode_pages_with_artifacts(m, codecs, NULL, 0, page_tokens, layer,
                                               token_start, num_tokens, k, v, pages, count);
}

int kvdepot_encode_pages_with_artifacts(const kvdepot_model *m, const kvdepot_codecs *codecs,
                                        const kvdepot_artifact *arts, size_t n_arts,
                                        uint32_t page_tokens, uint32_t layer,
                                        uint64_t token_start, uint64_t num_tokens, const void *k,
                                        const void *v, kvdepot_page **pages, size_t *count)
{
    kvdepot__clear_error();
    if (pages)
        *pages = NULL;
    if (count)
        *count = 0;
    if (!m || !pages || !count || (num_tokens && (!k || !v)))
        return kvdepot__fail(NULL, KVDEPOT_EINVAL, "encode pages: NULL argument");
    const size_t es = kvdepot_dtype_size(m->dtype);
    if (!es || !page_tokens || !m->num_kv_heads || !m->head_dim)
        return kvdepot__fail(NULL, KVDEPOT_EINVAL, "encode pages: bad shape");
    kvd_codec_spec ks, vs;
    spec_to_kvd(codecs ? &codecs->k : NULL, &ks);
    spec_to_kvd(codecs ? &codecs->v : NULL, &vs);
    kvd_error err;
    kvd_error_clear(&err);
    if (kvd_codec_spec_check(&ks, 0, page_tokens, m->head_dim, &err) ||
        kvd_codec_spec_check(&vs, 1, page_tokens, m->head_dim, &err))
        return kvdepot__fail(NULL, KVDEPOT_EINVAL, "encode pages: %s", err.msg);
    /* VQ / SVD: the same snapshot the server took at CreateSequence, built
     * from the artifacts the caller fetched (same bytes, same fingerprint). */
    kvd_codec_arts *snap = NULL;
    if (ks.codec == KVD_CODEC_VQ || vs.codec == KVD_CODEC_VQ || ks.svd || vs.svd) {
        if (layer >= m->num_layers)
            return kvdepot__fail(NULL, KVDEPOT_EINVAL, "encode pages: layer %u of %u", layer,
                                 m->num_layers);
        kvd_art_ref *refs = calloc(n_arts ? n_arts : 1, sizeof *refs);
        if (!refs)
            return kvdepot__fail(NULL, KVDEPOT_ENOMEM, "encode pages: out of memory");
        for (size_t i = 0; i < n_arts; i++) {
            refs[i].kind = arts[i].kind;
            refs[i].layer = arts[i].layer;
            refs[i].kv_head = arts[i].kv_head;
            refs[i].ndim = arts[i].ndim;
            refs[i].shape[0] = arts[i].shape[0];
            refs[i].shape[1] = arts[i].shape[1];
            refs[i].data = arts[i].data;
        }
        int brc = kvd_codec_arts_build(&ks, &vs, m->num_layers, m->num_kv_heads, m->head_dim,
                                       refs, n_arts, &snap, &err);
        free(refs);
        if (brc)
            return kvdepot__fail(NULL, brc == KVD_ENOMEM ? KVDEPOT_ENOMEM : KVDEPOT_EINVAL,
                                 "encode pages: %s%s", err.msg,
                                 n_arts ? ""
                                        : " (VQ/SVD pages need the model's artifacts: "
                                          "kvdepot_encode_pages_with_artifacts)");
        ks.arts = vs.arts = snap;
    }
    kvd_backend *be = kvdepot__cpu_backend();
    if (!be)
        return kvdepot__fail(NULL, KVDEPOT_ENOMEM, "encode pages: no CPU backend");
    const uint64_t B = page_tokens, end = token_start + num_tokens;
    const uint64_t sink_end = codecs ? ((uint64_t)codecs->raw_sink_tokens + B - 1) / B * B : 0;
    const uint32_t H = m->num_kv_heads, D = m->head_dim;
    const size_t row = (size_t)H * D * es, hrow = (size_t)D * es;
    size_t np = 0, cap = (size_t)(num_tokens / B + 2);
    kvdepot_page *out = calloc(cap, sizeof *out);
    uint8_t *hk = NULL, *hv = NULL; /* head-major K and V for the codecs, when a page is coded */
    int rc = KVDEPOT_OK;
    if (!out) {
        rc = kvdepot__fail(NULL, KVDEPOT_ENOMEM, "encode pages: out of memory");
        goto done;
    }
    /* both sides raw (no codec, no SVD): every page is written in place */
    const int all_raw =
        ks.codec == KVD_CODEC_RAW && vs.codec == KVD_CODEC_RAW && !ks.svd && !vs.svd;
    for (uint64_t t = token_start; t < end; np++) {
        uint64_t bend = (t / B + 1) * B, pe = bend < end ? bend : end;
        uint32_t T = (uint32_t)(pe - t);
        kvd_page_desc d = {.dtype = (kvd_dtype)m->dtype,
                           .layer = layer,
                           .token_start = t,
                           .num_tokens = T,
                           .page_tokens = page_tokens,
                           .num_kv_heads = H,
                           .head_dim = D};
        int keep_raw = t < sink_end || T < B || all_raw;
        uint8_t *dk, *dv, *page = NULL;
        size_t len = 0;
        if (keep_raw) { /* the page's own K and V sections take the rows */
            const uint64_t total = kvd_page_raw_size(&d);
            page = total <= SIZE_MAX ? malloc((size_t)total) : NULL;
            if (!page) {
                rc = kvdepot__fail(NULL, KVDEPOT_ENOMEM, "encode pages: out of memory");
                goto done;
            }
            if (kvd_page_init_raw(&d, page, (size_t)total, &dk, &dv, &err)) {
                free(page);
                rc = kvdepot__fail(NULL, KVDEPOT_EINVAL, "encode pages: %s", err.msg);
                goto done;
            }
            len = (size_t)total;
        } else {
            if (!hk && (!(hk = malloc((size_t)B * row)) || !(hv = malloc((size_t)B * row)))) {
                rc = kvdepot__fail(NULL, KVDEPOT_ENOMEM, "encode pages: out of memory");
                goto done;
            }
            dk = hk;
            dv = hv;
        }
        /* wire [token][head][dim] -> head-major [head][token][dim] */
        for (uint32_t i = 0; i < T; i++)
            for (uint32_t h = 0; h < H; h++) {
                size_t src = (size_t)(t - token_start + i) * row + h * hrow;
                memcpy(dk + ((size_t)h * T + i) * hrow, (const uint8_t *)k + src, hrow);
                memcpy(dv + ((size_t)h * T + i) * hrow, (const uint8_t *)v + src, hrow);
            }
        if (keep_raw) {
            kvd_page_finish(page, len);
        } else if (kvd_page_encode(be, &d, &ks, &vs, hk, hv, &page, &len, &err)) {
            rc = kvdepot__fail(NULL, KVDEPOT_EINVAL, "encode pages: %s", err.msg);
            goto done;
        }
        out[np].data = page;
        out[np].len = len;
        t = pe;
    }
done:
    free(hk);
    free(hv);
    kvd_codec_arts_free(snap);
    if (rc) {
        kvdepot_pages_free(out, np);
        return rc;
    }
    *pages = out;
    *count = np;
    return KVDEPOT_OK;
}

/* AppendPages messages: the header with the first page, then one page each. */
struct pages_msgs {
    Kvdepot__V1__AppendPagesHeader hdr;
    Kvdepot__V1__AppendPagesRequest req;
    ProtobufCBinaryData page;
    const kvdepot_page *pages;
    size_t count;
};

static const ProtobufCMessage *pages_msg(size_t i, void *ctx)
{
    struct pages_msgs *x = ctx;
    kvdepot__v1__append_pages_request__init(&x->req);
    if (i == 0)
        x->req.header = &x->hdr;
    if (x->count) {
        x->page.data = x->pages[i].data;
        x->page.len = x->pages[i].len;
        x->req.n_pages = 1;
        x->req.pages = &x->page;
    }
    return &x->req.base;
}

int kvdepot_append_pages(kvdepot_client *c, const void *id, size_t id_len,
                         const kvdepot_page *pages, size_t count, kvdepot_sequence_info *out)
{
    kvdepot_append_pages_args a = {.id = id, .id_len = id_len, .pages = pages, .count = count};
    return kvdepot_sequence_append_pages(c, &a, out);
}

int kvdepot_sequence_append_pages(kvdepot_client *c, const kvdepot_append_pages_args *a,
                                  kvdepot_sequence_info *out)
{
    kvdepot__clear_error();
    if (out)
        memset(out, 0, sizeof *out);
    if (a && a->created)
        *a->created = 0;
    if (!c || !a || (!a->id && a->id_len) || (!a->pages && a->count))
        return kvdepot__fail(c, KVDEPOT_EINVAL, "append pages: NULL argument");
    if (c->cluster)
        return kvdepot__cluster_append_pages(c, a, out);
    /* One message per page (pages are at most a few MiB), the header with
     * the first. */
    struct pages_msgs x = {
        .hdr = KVDEPOT__V1__APPEND_PAGES_HEADER__INIT, .pages = a->pages, .count = a->count};
    x.hdr.sequence_id.data = (uint8_t *)a->id;
    x.hdr.sequence_id.len = a->id_len;
    Kvdepot__V1__CreateSequenceRequest cr;
    kvdepot__codecs_pb cpb;
    kvdepot__v1__create_sequence_request__init(&cr);
    int rc;
    if (a->create) {
        if ((rc = kvdepot__create_pb(c, a->create, "append pages: create", &cr, &cpb)))
            return rc;
        cr.sequence_id.data = NULL; /* the header's id serves for both */
        cr.sequence_id.len = 0;
        x.hdr.create = &cr;
    }
    ProtobufCMessage *resp;
    rc = kvdepot__call_messages(c, "append pages", PATH_APPEND_PAGES, a->count ? a->count : 1,
                                pages_msg, &x, &kvdepot__v1__append_pages_response__descriptor,
                                &resp);
    free(cr.engine_prefix_hashes);
    if (rc == KVDEPOT_OK) {
        Kvdepot__V1__AppendPagesResponse *r = (Kvdepot__V1__AppendPagesResponse *)resp;
        if (a->created)
            *a->created = r->created;
        if (out && r->sequence)
            rc = kvdepot__info_from_pb(c, r->sequence, out);
        protobuf_c_message_free_unpacked(resp, NULL);
    }
    return rc;
}
