/*
 * Compute handlers: Attend (decode attention on stored pages) and PlanFetch
 * (KVPR split). See compute.h for the backend choice and the cost model.
 *
 * Attend reads one layer of each sequence in windows of ATTEND_WINDOW tokens
 * through the store's read cursor, runs the dense kernel on each window
 * straight from the cursor's wire layout (no transpose: the kernel takes any
 * stride on the two outer dimensions) and folds the windows together with
 * the log-sum-exp merge. Memory per call is therefore bounded by one window,
 * whatever the sequence length, and a window's pages are checksum-verified
 * before any of their bytes reach the kernel.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "compute.h"
#include "compute_internal.h"
#include "convert.h"
#include "kvdepot/attention.h"
#include "kvdepot/backend.h"
#include "kvdepot/convert.h"
#include "kvdepot/pq.h"
#include "kvdepot/quant.h"
#include "codec.h"
#include "log.h"
#include "rpc.h"
#include "seqcodec.h"
#include "validate.h"

#define ATTEND_MAX_BATCH 1024
/* Tokens read per kernel call: large enough that the cursor and the kernel
 * run at full speed, small enough (8 KiB tokens x 8 heads x 128 dims x f16
 * x K,V = 32 MiB) to keep a batch of long sequences in memory bounds. */
#define ATTEND_WINDOW 8192

/* ---- shared checks --------------------------------------------------------- */

int kvd__load_seq(kvd_req_ctx *ctx, const ProtobufCBinaryData *id, const char *field,
                  uint32_t layer, kvd__seq_ctx *out, kvd_error *err)
{
    int rc;
    if ((rc = kvd_check_seq_id(id->data, id->len, field, err)))
        return rc;
    kvd_seq_info info;
    memset(&info, 0, sizeof info);
    if ((rc = kvd_store_seq_stat(ctx->svc->store, id->data, id->len, &info, err)))
        return rc;
    if ((rc = kvd_ctx_check_model(ctx, info.model, err)) ||
        (rc = kvd_store_model_get(ctx->svc->store, info.model, &out->model, err)))
        goto done;
    if (layer >= info.num_layers) {
        rc = kvd_error_set(err, KVD_EINVAL, "layer: %u, model %s has %u layers", layer,
                           info.model, info.num_layers);
        goto done;
    }
    out->layer_tokens = info.layer_tokens[layer];
    out->stored_bytes = info.stored_bytes;
    out->activation_tokens = info.activation_tokens;
    out->activation_bytes = info.activation_bytes;
    out->num_tokens = info.num_tokens;
    out->num_layers = info.num_layers;
done:
    kvd_seq_info_clear(&info);
    return rc;
}

/* Resolve [start, start + *count) against the tokens stored (count 0 = to
 * the end). KVD_ERANGE past the end. */
int kvd__token_range(const char *what, uint64_t start, uint64_t *count, uint64_t stored,
                     kvd_error *err)
{
    int rc = kvd_check_range(start, *count, 64, "token_start", "num_tokens", err);
    if (rc)
        return rc;
    if (start > stored)
        return kvd_error_set(err, KVD_ERANGE, "%s: token_start %llu past the %llu tokens stored",
                             what, (unsigned long long)start, (unsigned long long)stored);
    if (*count == 0)
        *count = stored - start;
    if (start + *count > stored)
        return kvd_error_set(err, KVD_ERANGE, "%s: tokens [%llu, %llu) past the %llu stored", what,
                             (unsigned long long)start, (unsigned long long)(start + *count),
                             (unsigned long long)stored);
    return 0;
}

int kvd__reply_msg(kvd_req_ctx *ctx, const ProtobufCMessage *m, grpc_byte_buffer **reply,
                   kvd_error *err)
{
    size_t n = protobuf_c_message_get_packed_size(m);
    if (n > ctx->svc->cfg->max_message_bytes)
        return kvd_error_set(err, KVD_ENOMEM,
                             "reply of %zu bytes exceeds max-message-bytes (%llu): send fewer "
                             "queries per call",
                             n, (unsigned long long)ctx->svc->cfg->max_message_bytes);
    *reply = kvd_pack(m);
    if (!*reply)
        return kvd_error_set(err, KVD_ENOMEM, "out of memory packing the reply");
    return 0;
}

/* ---- attention over a stored token range ------------------------------------- */

/* Read tokens [start, start + n) of one layer (K then V, each
 * [token][kv_head][head_dim]) into buf, which holds the whole range. */
int kvd__read_window(kvd_store *st, const ProtobufCBinaryData *id, uint32_t layer,
                     uint64_t start, uint64_t n, uint8_t *buf, uint64_t bytes, kvd_error *err)
{
    kvd_read_spec rs = {id->data, id->len, layer, 1, start, n, 0};
    kvd_read *rd = NULL;
    kvd_read_shape shape;
    int rc = kvd_store_read_begin(st, &rs, &rd, &shape, err);
    if (rc)
        return rc;
    if (shape.total_bytes != bytes) {
        kvd_store_read_end(rd);
        return kvd_error_set(err, KVD_EINTERNAL, "read of %llu bytes, expected %llu",
                             (unsigned long long)shape.total_bytes, (unsigned long long)bytes);
    }
    uint64_t got = 0;
    while (got < bytes) {
        size_t len = 0;
        if ((rc = kvd_store_read_next(rd, buf + got, (size_t)(bytes - got), &len, err)))
            break;
        if (len == 0) {
            rc = kvd_error_set(err, KVD_EINTERNAL, "read ended after %llu of %llu bytes",
                               (unsigned long long)got, (unsigned long long)bytes);
            break;
        }
        got += len;
    }
    kvd_store_read_end(rd);
    return rc;
}

/*
 * out (Hq, D) / lse (Hq) = attention of q (Hq, D) f32 over tokens
 * [start, start + n) of `layer`, window by window, merged by log-sum-exp.
 */
static int attend_range(kvd_req_ctx *ctx, kvd_backend *be, const ProtobufCBinaryData *id,
                        const kvd_model_info *m, uint32_t layer, uint64_t start, uint64_t n,
                        const float *q, float scale, float *out, float *lse, kvd_error *err)
{
    const int Hq = (int)m->num_q_heads, H = (int)m->num_kv_heads, D = (int)m->head_dim;
    const size_t es = kvd_dtype_size(m->dtype);
    for (int h = 0; h < Hq; h++) {
        lse[h] = -INFINITY;
        for (int d = 0; d < D; d++)
            out[(size_t)h * D + d] = 0.0f;
    }
    if (n == 0)
        return 0;
    uint64_t win = n < ATTEND_WINDOW ? n : ATTEND_WINDOW;
    size_t half = (size_t)win * H * D * es;
    uint8_t *buf = malloc(2 * half);
    float *wout = malloc(sizeof(float) * (size_t)Hq * D);
    float *wlse = malloc(sizeof(float) * (size_t)Hq);
    int rc = 0;
    if (!buf || !wout || !wlse) {
        rc = kvd_error_set(err, KVD_ENOMEM, "out of memory for a %llu-token window",
                           (unsigned long long)win);
        goto done;
    }
    kvd_attn_dims dims = {Hq, H, D, D, scale};
    int64_t qshape[2] = {Hq, D}, lshape[1] = {Hq};
    for (uint64_t t0 = 0; t0 < n && rc == 0; t0 += win) {
        uint64_t T = n - t0 < win ? n - t0 : win;
        uint64_t bytes = 2 * (uint64_t)T * H * D * es;
        if ((rc = kvd__read_window(ctx->svc->store, id, layer, start + t0, T, buf, bytes, err)))
            break;
        kvd_attn_dense_args a;
        memset(&a, 0, sizeof a);
        a.dims = dims;
        a.q = kvd_tensor_make(KVD_DTYPE_F32, (void *)q, 2, qshape);
        /* Wire layout [token][kv_head][dim] seen as (kv_head, token, dim). */
        int64_t kshape[3] = {H, (int64_t)T, D};
        a.k = kvd_tensor_make(m->dtype, buf, 3, kshape);
        a.k.stride[0] = (int64_t)D * (int64_t)es; /* strides in bytes */
        a.k.stride[1] = (int64_t)H * D * (int64_t)es;
        a.k.stride[2] = (int64_t)es;
        a.v = a.k;
        a.v.data = buf + bytes / 2;
        a.out = kvd_tensor_make(KVD_DTYPE_F32, t0 == 0 ? out : wout, 2, qshape);
        a.lse = kvd_tensor_make(KVD_DTYPE_F32, t0 == 0 ? lse : wlse, 1, lshape);
        if ((rc = kvd_attn_dense(be, 1, &a, err)))
            break;
        if (t0 > 0)
            rc = kvd_attn_merge_into(be, Hq, D, out, lse, wout, wlse, err);
    }
done:
    free(buf);
    free(wout);
    free(wlse);
    return rc;
}

#define PAGES_PER_STEP 64

/*
 * Attention over tokens [start, start + n): whole sealed pages are acquired
 * from the store (pinned in their memory tier) and attended in their stored
 * form (kvd_page_attend: INT2/INT4 homomorphic, VQ fused, SVD at the reduced
 * widths, raw dense); the partial blocks at both ends (and the raw tail) go
 * through the read cursor.
 */
static int attend_pages(kvd_req_ctx *ctx, kvd_backend *be, const ProtobufCBinaryData *id,
                        const kvd_model_info *m, uint32_t layer, uint64_t start, uint64_t n,
                        uint64_t layer_tokens, const float *q, float scale, float *out,
                        float *lse, kvd_error *err)
{
    const uint64_t B = ctx->svc->page_tokens, end = start + n;
    uint64_t f0 = (start + B - 1) / B, f1 = end / B; /* whole blocks [f0, f1) */
    if (f1 > layer_tokens / B)
        f1 = layer_tokens / B;
    if (f0 >= f1)
        return attend_range(ctx, be, id, m, layer, start, n, q, scale, out, lse, err);
    const int Hq = (int)m->num_q_heads, D = (int)m->head_dim;
    float *po = malloc(sizeof(float) * (size_t)Hq * D), *pl = malloc(sizeof(float) * Hq);
    kvd_page_handle *hs = calloc(PAGES_PER_STEP, sizeof *hs);
    kvd_page_view *vs = calloc(PAGES_PER_STEP, sizeof *vs);
    kvd_seq_codecs codecs;
    memset(&codecs, 0, sizeof codecs);
    int rc = 0, found = 0;
    if (!po || !pl || !hs || !vs) {
        rc = kvd_error_set(err, KVD_ENOMEM, "out of memory");
        goto done;
    }
    /* VQ/SVD pages attend with the sequence's artifact snapshot. */
    if ((rc = kvd_store_seq_codecs_get(ctx->svc->store, id->data, id->len, &codecs, &found,
                                       err)) ||
        (found && (rc = kvd_seq_codecs_load_arts(ctx->svc->store, id->data, id->len, &codecs,
                                                 err))))
        goto done;
    /* Head: [start, f0*B) */
    if ((rc = attend_range(ctx, be, id, m, layer, start, f0 * B - start, q, scale, out, lse, err)))
        goto done;
    kvd_attn_dims dims = {Hq, (int)m->num_kv_heads, D, D, scale};
    for (uint64_t b0 = f0; b0 < f1 && rc == 0; b0 += PAGES_PER_STEP) {
        size_t np = (size_t)(f1 - b0 < PAGES_PER_STEP ? f1 - b0 : PAGES_PER_STEP), got = 0;
        for (; got < np; got++) {
            if ((rc = kvd_store_page_acquire(ctx->svc->store, id->data, id->len, layer,
                                             b0 + got, &hs[got], err)))
                break;
            if ((rc = kvd_page_decode_nocheck(hs[got].bytes, hs[got].len, &vs[got], err))) {
                got++;
                break;
            }
        }
        if (rc == 0 &&
            (rc = kvd_page_attend(be, vs, np, codecs.arts, &dims, q, po, pl, err)) == 0)
            rc = kvd_attn_merge_into(be, Hq, D, out, lse, po, pl, err);
        for (size_t i = 0; i < got; i++)
            kvd_store_page_release(ctx->svc->store, &hs[i]);
    }
    /* Tail: [f1*B, end) */
    if (rc == 0 && f1 * B < end &&
        (rc = attend_range(ctx, be, id, m, layer, f1 * B, end - f1 * B, q, scale, po, pl,
                           err)) == 0)
        rc = kvd_attn_merge_into(be, Hq, D, out, lse, po, pl, err);
done:
    kvd_seq_codecs_clear(&codecs);
    free(po);
    free(pl);
    free(hs);
    free(vs);
    return rc;
}

float kvd__default_scale(float scale, uint32_t D)
{
    return scale != 0.0f ? scale : 1.0f / sqrtf((float)D);
}

/* ---- codec specs ------------------------------------------------------------- */

static void spec_from_pb(const Kvdepot__V1__CodecSpec *in, int is_v, kvd_codec_spec *out)
{
    memset(out, 0, sizeof *out);
    if (!in)
        return;
    out->codec = (uint8_t)(in->codec > 255 ? 255 : in->codec);
    if (in->quant) {
        out->group = (uint16_t)(in->quant->group_size > 65535 ? 65535 : in->quant->group_size);
        out->rounding = (uint8_t)(in->quant->rounding > 255 ? 255 : in->quant->rounding);
        out->seed = in->quant->seed;
        /* Wire axis: 0 default (K token, V channel), 1 token, 2 channel. */
        unsigned ax = in->quant->axis;
        out->axis = ax == 0 ? (is_v ? KVD_QAXIS_CHANNEL : KVD_QAXIS_TOKEN)
                    : ax == 1 ? KVD_QAXIS_TOKEN
                    : ax == 2 ? KVD_QAXIS_CHANNEL
                              : 255;
    } else {
        out->group = 0;
        out->axis = is_v ? KVD_QAXIS_CHANNEL : KVD_QAXIS_TOKEN;
    }
    if (in->vq) {
        out->vq_sub_dim = (uint8_t)(in->vq->sub_dim > 255 ? 255 : in->vq->sub_dim);
        out->vq_bits = (uint8_t)(in->vq->bits > 255 ? 255 : in->vq->bits);
    }
    /* The widths point into the request: they are resolved into the
     * sequence's artifact snapshot before the handler returns. */
    if (in->svd && (in->svd->n_widths || in->svd->removal_rate != 0)) {
        out->svd = 1;
        out->svd_rate = in->svd->removal_rate;
        out->svd_align = in->svd->align;
        out->svd_nwidths = (uint32_t)in->svd->n_widths;
        out->svd_widths = in->svd->widths;
    }
}

int kvd_codecs_from_pb(const void *pb, const kvd_model_info *m, uint32_t page_tokens,
                       kvd_seq_codecs *out, kvd_error *err)
{
    const Kvdepot__V1__SequenceCodecs *c = pb;
    memset(out, 0, sizeof *out);
    if (!c)
        return 0;
    spec_from_pb(c->k, 0, &out->k);
    spec_from_pb(c->v, 1, &out->v);
    out->raw_sink_tokens = c->raw_sink_tokens;
    const Kvdepot__V1__CodecSpec *sp[2] = {c->k, c->v};
    for (int i = 0; i < 2; i++) {
        if (sp[i] && sp[i]->vq && sp[i]->codec != KVDEPOT__V1__CODEC__CODEC_VQ)
            return kvd_error_set(err, KVD_EINVAL, "codecs.%s.vq: set for a codec other than VQ",
                                 i ? "v" : "k");
        if (sp[i] && sp[i]->codec == KVDEPOT__V1__CODEC__CODEC_VQ && !sp[i]->vq)
            return kvd_error_set(err, KVD_EINVAL,
                                 "codecs.%s.vq: required for CODEC_VQ (sub_dim, bits)",
                                 i ? "v" : "k");
        if (sp[i] && sp[i]->svd && sp[i]->svd->n_widths && sp[i]->svd->removal_rate != 0)
            return kvd_error_set(err, KVD_EINVAL,
                                 "codecs.%s.svd: give removal_rate or widths, not both",
                                 i ? "v" : "k");
        if (sp[i] && sp[i]->svd &&
            !(sp[i]->svd->removal_rate >= 0 && sp[i]->svd->removal_rate < 1))
            return kvd_error_set(err, KVD_EINVAL, "codecs.%s.svd.removal_rate: %g not in [0, 1)",
                                 i ? "v" : "k", sp[i]->svd->removal_rate);
    }
    if (c->pq) {
        out->pq_m = c->pq->m;
        out->pq_bits = (uint8_t)(c->pq->bits > 255 ? 255 : c->pq->bits);
        out->pq_iterations = c->pq->iterations;
    }
    /* Activation storage is recorded by the CreateSequence handler (in the
     * write that creates the sequence); only the model can refuse it. */
    if (c->store_activations && !m->hidden_size)
        return kvd_error_set(err, KVD_EPRECOND,
                             "codecs.store_activations: model %s has no hidden_size (put the "
                             "model with one to store activations)",
                             m->name);
    int rc = kvd_seq_codecs_check(out, page_tokens, m->head_dim, err);
    if (rc && err) {
        char msg[sizeof err->msg];
        memcpy(msg, err->msg, sizeof msg);
        msg[sizeof msg - 16] = '\0'; /* room for the prefix */
        return kvd_error_set(err, rc, "codecs.%s", msg);
    }
    return rc;
}

/* ---- Attend ------------------------------------------------------------------ */

int kvd_h_attend(kvd_req_ctx *ctx, const ProtobufCMessage *msg, grpc_byte_buffer **reply,
                 kvd_error *err)
{
    const Kvdepot__V1__AttendRequest *req = (const Kvdepot__V1__AttendRequest *)msg;
    size_t n = req->n_queries;
    if (n == 0)
        return kvd_error_set(err, KVD_EINVAL, "queries: empty");
    if (n > ATTEND_MAX_BATCH)
        return kvd_error_set(err, KVD_EINVAL, "queries: %zu, at most %d per call", n,
                             ATTEND_MAX_BATCH);
    if (!isfinite(req->scale))
        return kvd_error_set(err, KVD_EINVAL, "scale: not finite");
    kvd_backend *be = kvd_store_backend(ctx->svc->store);
    int rc = 0;

    /* Check every query before computing any: a bad batch fails as a whole. */
    kvd__seq_ctx *sc = calloc(n, sizeof *sc);
    uint64_t *count = calloc(n, sizeof *count);
    Kvdepot__V1__AttendResult *res = calloc(n, sizeof *res);
    Kvdepot__V1__AttendResult **resp_p = calloc(n, sizeof *resp_p);
    if (!sc || !count || !res || !resp_p) {
        rc = kvd_error_set(err, KVD_ENOMEM, "out of memory");
        goto done;
    }
    for (size_t i = 0; i < n; i++) {
        const Kvdepot__V1__AttendQuery *qy = req->queries[i];
        char field[48];
        snprintf(field, sizeof field, "queries[%zu].sequence_id", i);
        if ((rc = kvd__load_seq(ctx, &qy->sequence_id, field, req->layer, &sc[i], err)))
            goto done;
        size_t want = (size_t)sc[i].model.num_q_heads * sc[i].model.head_dim;
        if (qy->n_q != want) {
            rc = kvd_error_set(err, KVD_EINVAL,
                               "queries[%zu].q: %zu floats, model %s needs num_q_heads x "
                               "head_dim = %u x %u",
                               i, qy->n_q, sc[i].model.name, sc[i].model.num_q_heads,
                               sc[i].model.head_dim);
            goto done;
        }
        count[i] = qy->num_tokens;
        snprintf(field, sizeof field, "queries[%zu]", i);
        if ((rc = kvd__token_range(field, qy->token_start, &count[i], sc[i].layer_tokens, err)))
            goto done;
    }
    for (size_t i = 0; i < n; i++) {
        const kvd_model_info *m = &sc[i].model;
        kvdepot__v1__attend_result__init(&res[i]);
        resp_p[i] = &res[i];
        res[i].n_output = (size_t)m->num_q_heads * m->head_dim;
        res[i].n_lse = m->num_q_heads;
        res[i].output = malloc(sizeof(float) * res[i].n_output);
        res[i].lse = malloc(sizeof(float) * res[i].n_lse);
        res[i].num_tokens = count[i];
        if (!res[i].output || !res[i].lse) {
            rc = kvd_error_set(err, KVD_ENOMEM, "out of memory");
            goto done;
        }
        const Kvdepot__V1__AttendQuery *qy = req->queries[i];
        if ((rc = attend_pages(ctx, be, &qy->sequence_id, m, req->layer, qy->token_start,
                               count[i], sc[i].layer_tokens, qy->q,
                               kvd__default_scale(req->scale, m->head_dim), res[i].output,
                               res[i].lse, err)))
            goto done;
    }
    Kvdepot__V1__AttendResponse resp = KVDEPOT__V1__ATTEND_RESPONSE__INIT;
    resp.n_results = n;
    resp.results = resp_p;
    rc = kvd__reply_msg(ctx, &resp.base, reply, err);
done:
    if (res)
        for (size_t i = 0; i < n; i++) {
            free(res[i].output);
            free(res[i].lse);
        }
    free(res);
    free(resp_p);
    free(count);
    free(sc);
    return rc;
}

/* ---- PlanFetch ---------------------------------------------------------------- */

double kvd_fetch_time(const kvd_fetch_cost *c, uint64_t l)
{
    double x = (double)l * c->x_bytes / c->bandwidth;
    double rc = (double)l * c->flops / c->rate;
    double kv = (double)(c->n - l) * c->kv_bytes / c->bandwidth;
    return x + (rc > kv ? rc : kv);
}

uint64_t kvd_plan_fetch(const kvd_fetch_cost *c)
{
    uint64_t hi = c->max_l < c->n ? c->max_l : c->n;
    uint64_t cand[4] = {0, hi, 0, 0};
    /* Recompute of l tokens takes as long as the transfer of the other n - l
     * at l* = n * (kv/bw) / (flops/rate + kv/bw). */
    double a = c->flops / c->rate, b = c->kv_bytes / c->bandwidth;
    double ls = a + b > 0 ? (double)c->n * b / (a + b) : 0.0;
    if (ls > (double)hi)
        ls = (double)hi;
    cand[2] = (uint64_t)floor(ls);
    cand[3] = cand[2] < hi ? cand[2] + 1 : cand[2];
    uint64_t best = 0;
    double tbest = kvd_fetch_time(c, 0);
    for (int i = 1; i < 4; i++) {
        double t = kvd_fetch_time(c, cand[i]);
        if (t < tbest || (t == tbest && cand[i] < best)) {
            tbest = t;
            best = cand[i];
        }
    }
    return best;
}

int kvd_h_plan_fetch(kvd_req_ctx *ctx, const ProtobufCMessage *msg, grpc_byte_buffer **reply,
                     kvd_error *err)
{
    const Kvdepot__V1__PlanFetchRequest *req = (const Kvdepot__V1__PlanFetchRequest *)msg;
    int rc;
    if (!(req->bandwidth_bytes_per_s > 0) || !isfinite(req->bandwidth_bytes_per_s))
        return kvd_error_set(err, KVD_EINVAL, "bandwidth_bytes_per_s: must be finite and > 0");
    if (!(req->compute_flops_per_s > 0) || !isfinite(req->compute_flops_per_s))
        return kvd_error_set(err, KVD_EINVAL, "compute_flops_per_s: must be finite and > 0");
    if ((rc = kvd_check_range(req->layer_start, req->num_layers, 32, "layer_start",
                              "num_layers", err)))
        return rc;
    kvd__seq_ctx sc;
    if ((rc = kvd__load_seq(ctx, &req->sequence_id, "sequence_id", 0, &sc, err)))
        return rc;
    uint32_t L = req->num_layers ? req->num_layers : sc.num_layers - req->layer_start;
    if (req->layer_start >= sc.num_layers || L > sc.num_layers - req->layer_start)
        return kvd_error_set(err, KVD_EINVAL, "layers [%u, %u): model %s has %u layers",
                             req->layer_start, req->layer_start + L, sc.model.name,
                             sc.num_layers);
    const kvd_model_info *m = &sc.model;
    double es = (double)kvd_dtype_size(m->dtype);
    kvd_fetch_cost c;
    c.n = sc.num_tokens;
    /* Stored page bytes are attributed per token and layer: pages of every
     * layer hold the same tokens, so the share of L layers is L / num_layers.
     * Stored activations are not K/V: they are left out. */
    c.kv_bytes = sc.num_tokens ? (double)(sc.stored_bytes - sc.activation_bytes) /
                                     (double)sc.num_tokens * L / sc.num_layers
                               : 0.0;
    c.x_bytes = (double)m->hidden_size * es * L;
    c.flops = 2.0 * m->hidden_size * (2.0 * m->num_kv_heads * m->head_dim) * L;
    c.bandwidth = req->bandwidth_bytes_per_s;
    c.rate = req->compute_flops_per_s;
    /* Activations are only usable where the model declares a hidden size:
     * for every token when the caller says the receiver has them, else for
     * the leading tokens whose activations the sequence stores (an
     * activation-first Read serves exactly those). */
    c.max_l = !m->hidden_size            ? 0
              : req->assume_activations  ? c.n
              : sc.activation_tokens < c.n ? sc.activation_tokens
                                           : c.n;
    uint64_t l = kvd_plan_fetch(&c);
    Kvdepot__V1__PlanFetchResponse resp = KVDEPOT__V1__PLAN_FETCH_RESPONSE__INIT;
    resp.split_tokens = l;
    resp.num_tokens = c.n;
    resp.predicted_seconds = kvd_fetch_time(&c, l);
    resp.kv_only_seconds = kvd_fetch_time(&c, 0);
    resp.activation_bytes = (uint64_t)((double)l * c.x_bytes);
    resp.kv_bytes = (uint64_t)((double)(c.n - l) * c.kv_bytes);
    resp.recompute_seconds = (double)l * c.flops / c.rate;
    resp.kv_bytes_per_token = c.kv_bytes;
    resp.activation_bytes_per_token = c.x_bytes;
    resp.flops_per_token = c.flops;
    return kvd__reply_msg(ctx, &resp.base, reply, err);
}
