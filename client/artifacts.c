/*
 * libkvdepot: model artifacts (UploadArtifacts, GetArtifacts).
 */
#include <stdlib.h>
#include <string.h>

#include "internal.h"
#include "kvdepot/v1/kvdepot.pb-c.h"

#include <grpc/byte_buffer.h>
#include <grpc/byte_buffer_reader.h>
#include <grpc/slice.h>

#define PATH_UPLOAD "/kvdepot.v1.KVDepot/UploadArtifacts"
#define PATH_GET "/kvdepot.v1.KVDepot/GetArtifacts"
/* Artifacts per upload message: a d8b12 codebook is 128 KiB, a 1024-wide
 * rotation 4 MiB, so a few per message stay well under message limits. */
#define UPLOAD_PER_MSG 8

static char tag_send, tag_recv, tag_status;

static uint64_t elems(const kvdepot_artifact *a)
{
    uint64_t n = a->ndim >= 1 ? a->shape[0] : 0;
    if (a->ndim == 2)
        n *= a->shape[1];
    return n;
}

void kvdepot_artifacts_free(kvdepot_artifact *a, size_t count)
{
    if (!a)
        return;
    for (size_t i = 0; i < count; i++)
        free(a[i].data);
    free(a);
}

/* UploadArtifacts messages: UPLOAD_PER_MSG artifacts each, the model in the
 * first. */
struct upload_msgs {
    const char *model;
    Kvdepot__V1__Artifact *w;
    Kvdepot__V1__Artifact **wp;
    size_t count;
    Kvdepot__V1__UploadArtifactsRequest req;
};

static const ProtobufCMessage *upload_msg(size_t m, void *ctx)
{
    struct upload_msgs *x = ctx;
    kvdepot__v1__upload_artifacts_request__init(&x->req);
    if (m == 0)
        x->req.model = (char *)x->model;
    size_t first = m * UPLOAD_PER_MSG;
    x->req.n_artifacts = x->count - first < UPLOAD_PER_MSG ? x->count - first : UPLOAD_PER_MSG;
    x->req.artifacts = x->count ? x->wp + first : NULL;
    return &x->req.base;
}

int kvdepot_artifacts_upload(kvdepot_client *c, const char *model, const kvdepot_artifact *a,
                             size_t count, uint32_t *stored)
{
    kvdepot__clear_error();
    if (stored)
        *stored = 0;
    if (!c || !model || (!a && count))
        return kvdepot__fail(c, KVDEPOT_EINVAL, "upload artifacts: NULL argument");
    if (c->cluster)
        return kvdepot__cluster_artifacts_upload(c, model, a, count, stored);
    for (size_t i = 0; i < count; i++)
        if (a[i].ndim < 1 || a[i].ndim > 2 || !a[i].data)
            return kvdepot__fail(c, KVDEPOT_EINVAL,
                                 "upload artifacts: artifact %zu needs 1 or 2 dims and data", i);
    size_t nmsg = count ? (count + UPLOAD_PER_MSG - 1) / UPLOAD_PER_MSG : 1;
    struct upload_msgs x = {.model = model, .count = count};
    x.w = calloc(count ? count : 1, sizeof *x.w);
    x.wp = calloc(count ? count : 1, sizeof *x.wp);
    uint32_t(*shapes)[2] = calloc(count ? count : 1, sizeof *shapes);
    int rc = KVDEPOT_OK;
    if (!x.w || !x.wp || !shapes)
        rc = kvdepot__fail(c, KVDEPOT_ENOMEM, "upload artifacts: out of memory");
    for (size_t i = 0; rc == KVDEPOT_OK && i < count; i++) {
        Kvdepot__V1__Artifact *w = &x.w[i];
        kvdepot__v1__artifact__init(w);
        w->kind = (Kvdepot__V1__ArtifactKind)a[i].kind;
        w->layer = a[i].layer;
        w->kv_head = a[i].kv_head;
        shapes[i][0] = a[i].shape[0];
        shapes[i][1] = a[i].shape[1];
        w->n_shape = a[i].ndim;
        w->shape = shapes[i];
        w->data.data = (uint8_t *)a[i].data;
        w->data.len = 4 * elems(&a[i]);
        x.wp[i] = w;
    }
    ProtobufCMessage *resp = NULL;
    if (rc == KVDEPOT_OK)
        rc = kvdepot__call_messages(c, "upload artifacts", PATH_UPLOAD, nmsg, upload_msg, &x,
                                    &kvdepot__v1__upload_artifacts_response__descriptor, &resp);
    free(x.w);
    free(x.wp);
    free(shapes);
    if (rc == KVDEPOT_OK) {
        if (stored)
            *stored = ((Kvdepot__V1__UploadArtifactsResponse *)resp)->artifacts;
        protobuf_c_message_free_unpacked(resp, NULL);
    }
    return rc;
}

/* Append one received artifact to the growing array. */
static int take(kvdepot_client *c, const Kvdepot__V1__Artifact *w, kvdepot_artifact **arr,
                size_t *n, size_t *cap)
{
    if (w->n_shape < 1 || w->n_shape > 2)
        return kvdepot__fail(c, KVDEPOT_EINTERNAL, "get artifacts: server sent a %zu-d artifact",
                             w->n_shape);
    kvdepot_artifact a;
    memset(&a, 0, sizeof a);
    a.kind = (int)w->kind;
    a.layer = w->layer;
    a.kv_head = w->kv_head;
    a.ndim = (uint32_t)w->n_shape;
    for (size_t d = 0; d < w->n_shape; d++)
        a.shape[d] = w->shape[d];
    if (w->data.len != 4 * elems(&a))
        return kvdepot__fail(c, KVDEPOT_EINTERNAL,
                             "get artifacts: data length does not match the shape");
    if (*n == *cap) {
        size_t nc = *cap ? 2 * *cap : 16;
        kvdepot_artifact *na = realloc(*arr, nc * sizeof *na);
        if (!na)
            return kvdepot__fail(c, KVDEPOT_ENOMEM, "get artifacts: out of memory");
        *arr = na;
        *cap = nc;
    }
    a.data = malloc(w->data.len ? w->data.len : 1);
    if (!a.data)
        return kvdepot__fail(c, KVDEPOT_ENOMEM, "get artifacts: out of memory");
    memcpy(a.data, w->data.data, w->data.len);
    (*arr)[(*n)++] = a;
    return KVDEPOT_OK;
}

int kvdepot_artifacts_get(kvdepot_client *c, const char *model, const int *kinds, size_t nkinds,
                          kvdepot_artifact **out, size_t *count)
{
    kvdepot__clear_error();
    if (out)
        *out = NULL;
    if (count)
        *count = 0;
    if (!c || !model || !out || !count || (!kinds && nkinds))
        return kvdepot__fail(c, KVDEPOT_EINVAL, "get artifacts: NULL argument");
    if (c->cluster)
        return kvdepot__cluster_artifacts_get(c, model, kinds, nkinds, out, count);
    Kvdepot__V1__GetArtifactsRequest req = KVDEPOT__V1__GET_ARTIFACTS_REQUEST__INIT;
    Kvdepot__V1__ArtifactKind kbuf[16];
    if (nkinds > 16)
        return kvdepot__fail(c, KVDEPOT_EINVAL, "get artifacts: more than 16 kinds");
    for (size_t i = 0; i < nkinds; i++)
        kbuf[i] = (Kvdepot__V1__ArtifactKind)kinds[i];
    req.model = (char *)model;
    req.n_kinds = nkinds;
    req.kinds = kbuf;

    kvdepot__call k;
    int rc = kvdepot__call_start(c, -1, PATH_GET, &k);
    if (rc) {
        kvdepot__call_end(&k);
        return rc;
    }
    grpc_byte_buffer *send = kvdepot__pack(&req.base);
    if (!send) {
        kvdepot__call_end(&k);
        return kvdepot__fail(c, KVDEPOT_ENOMEM, "get artifacts: out of memory");
    }
    int ok = kvdepot__call_send_request(&k, send, &tag_send);
    grpc_byte_buffer_destroy(send);

    kvdepot_artifact *arr = NULL;
    size_t n = 0, cap = 0;
    int local = KVDEPOT_OK;
    if (ok < 0)
        local = kvdepot__fail(c, KVDEPOT_EINTERNAL, "get artifacts: gRPC refused the call");
    while (ok == 1 && local == KVDEPOT_OK) {
        grpc_byte_buffer *bb = kvdepot__call_recv(&k, &tag_recv);
        if (!bb)
            break; /* end of stream or failure: the status tells */
        grpc_byte_buffer_reader r;
        Kvdepot__V1__GetArtifactsResponse *m = NULL;
        if (grpc_byte_buffer_reader_init(&r, bb)) {
            grpc_slice s = grpc_byte_buffer_reader_readall(&r);
            grpc_byte_buffer_reader_destroy(&r);
            m = (Kvdepot__V1__GetArtifactsResponse *)protobuf_c_message_unpack(
                &kvdepot__v1__get_artifacts_response__descriptor, NULL, GRPC_SLICE_LENGTH(s),
                GRPC_SLICE_START_PTR(s));
            grpc_slice_unref(s);
        }
        grpc_byte_buffer_destroy(bb);
        if (!m || !m->artifact)
            local = kvdepot__fail(c, KVDEPOT_EINTERNAL, "get artifacts: malformed message");
        else
            local = take(c, m->artifact, &arr, &n, &cap);
        if (m)
            protobuf_c_message_free_unpacked(&m->base, NULL);
    }
    if (local != KVDEPOT_OK && ok >= 0)
        grpc_call_cancel(k.call, NULL);
    if (ok >= 0) {
        grpc_op op;
        memset(&op, 0, sizeof op);
        op.op = GRPC_OP_RECV_STATUS_ON_CLIENT;
        op.data.recv_status_on_client.trailing_metadata = &k.trailing_md;
        op.data.recv_status_on_client.status = &k.status;
        op.data.recv_status_on_client.status_details = &k.details;
        kvdepot__call_batch(&k, &op, 1, &tag_status);
    }
    rc = local != KVDEPOT_OK ? local : kvdepot__call_result(&k);
    kvdepot__call_end(&k);
    if (rc != KVDEPOT_OK) {
        kvdepot_artifacts_free(arr, n);
        return rc;
    }
    *out = arr;
    *count = n;
    return KVDEPOT_OK;
}

/* ---- Calibrate ------------------------------------------------------------- */

#define PATH_CALIBRATE "/kvdepot.v1.KVDepot/Calibrate"

static void advice_free(kvdepot_codec_advice *a)
{
    if (!a)
        return;
    for (size_t l = 0; a->layers && l < a->n_layers; l++) {
        kvdepot_layer_advice *x = &a->layers[l];
        for (size_t i = 0; x->k && i < x->n_k; i++)
            free((uint32_t *)x->k[i].codec.svd_widths);
        for (size_t i = 0; x->v && i < x->n_v; i++)
            free((uint32_t *)x->v[i].codec.svd_widths);
        free(x->k);
        free(x->v);
        kvdepot_codec_spec *s[] = {&x->k_recommended, &x->v_recommended, &x->k_best, &x->v_best};
        for (int i = 0; i < 4; i++)
            free((uint32_t *)s[i]->svd_widths);
    }
    free(a->layers);
    free((uint32_t *)a->k.svd_widths);
    free((uint32_t *)a->v.svd_widths);
    free(a);
}

void kvdepot_calibrate_result_clear(kvdepot_calibrate_result *r)
{
    if (!r)
        return;
    free(r->errors);
    advice_free(r->advice);
    memset(r, 0, sizeof *r);
}

static int evals_from_pb(Kvdepot__V1__CodecEvaluation **in, size_t n, kvdepot_codec_eval **out,
                         size_t *nout)
{
    *out = calloc(n ? n : 1, sizeof **out);
    if (!*out)
        return -1;
    *nout = n;
    for (size_t i = 0; i < n; i++) {
        (*out)[i].bits_per_value = in[i]->bits_per_value;
        (*out)[i].attention_error = in[i]->attention_error;
        if (kvdepot__spec_from_pb(in[i]->codec, &(*out)[i].codec))
            return -1;
    }
    return 0;
}

/* The wire advice into a new struct; NULL when out of memory. */
static kvdepot_codec_advice *advice_from_pb(const Kvdepot__V1__CodecAdvice *pb)
{
    kvdepot_codec_advice *a = calloc(1, sizeof *a);
    if (!a)
        return NULL;
    a->error_budget = pb->error_budget;
    a->eval_tokens = pb->eval_tokens;
    a->eval_queries = pb->eval_queries;
    a->bits_per_value = pb->bits_per_value;
    a->max_attention_error = pb->max_attention_error;
    a->layers = calloc(pb->n_layers ? pb->n_layers : 1, sizeof *a->layers);
    int bad =
        !a->layers || kvdepot__spec_from_pb(pb->k, &a->k) || kvdepot__spec_from_pb(pb->v, &a->v);
    for (size_t l = 0; !bad && l < pb->n_layers; l++) {
        const Kvdepot__V1__CodecLayerAdvice *in = pb->layers[l];
        kvdepot_layer_advice *x = &a->layers[l];
        a->n_layers = l + 1;
        x->layer = in->layer;
        x->bits_per_value = in->bits_per_value;
        x->attention_error = in->attention_error;
        x->best_bits_per_value = in->best_bits_per_value;
        x->best_attention_error = in->best_attention_error;
        bad = evals_from_pb(in->k, in->n_k, &x->k, &x->n_k) ||
              evals_from_pb(in->v, in->n_v, &x->v, &x->n_v) ||
              kvdepot__spec_from_pb(in->k_recommended, &x->k_recommended) ||
              kvdepot__spec_from_pb(in->v_recommended, &x->v_recommended) ||
              kvdepot__spec_from_pb(in->k_best, &x->k_best) ||
              kvdepot__spec_from_pb(in->v_best, &x->v_best);
    }
    if (bad) {
        advice_free(a);
        return NULL;
    }
    return a;
}

/* Calibrate messages: the header, then one per sample. */
struct calibrate_msgs {
    Kvdepot__V1__CalibrateHeader hdr;
    Kvdepot__V1__VQSpec vq;
    const kvdepot_calibrate_sample *samples;
    Kvdepot__V1__CalibrateRequest req;
    Kvdepot__V1__CalibrateSample s;
};

static const ProtobufCMessage *calibrate_msg(size_t i, void *ctx)
{
    struct calibrate_msgs *x = ctx;
    kvdepot__v1__calibrate_request__init(&x->req);
    if (i == 0) {
        x->req.header = &x->hdr;
        return &x->req.base;
    }
    const kvdepot_calibrate_sample *in = &x->samples[i - 1];
    kvdepot__v1__calibrate_sample__init(&x->s);
    x->s.layer = in->layer;
    x->s.num_tokens = in->num_tokens;
    x->s.k.data = (uint8_t *)in->k;
    x->s.k.len = in->k ? in->kv_bytes : 0;
    x->s.v.data = (uint8_t *)in->v;
    x->s.v.len = in->v ? in->kv_bytes : 0;
    x->s.q.data = (uint8_t *)in->q;
    x->s.q.len = in->q ? in->q_bytes : 0;
    x->req.sample = &x->s;
    return &x->req.base;
}

int kvdepot_calibrate(kvdepot_client *c, const kvdepot_calibrate_args *a,
                      const kvdepot_calibrate_sample *samples, size_t count,
                      kvdepot_calibrate_result *out)
{
    kvdepot__clear_error();
    if (out)
        memset(out, 0, sizeof *out);
    if (!c || !a || !a->model || (!samples && count))
        return kvdepot__fail(c, KVDEPOT_EINVAL, "calibrate: NULL argument");
    if (c->cluster)
        return kvdepot__cluster_calibrate(c, a, samples, count, out);
    /* The header alone, then one message per sample. */
    struct calibrate_msgs x = {.hdr = KVDEPOT__V1__CALIBRATE_HEADER__INIT,
                               .vq = KVDEPOT__V1__VQSPEC__INIT,
                               .samples = samples};
    x.hdr.model = (char *)a->model;
    if (a->vq_sub_dim || a->vq_bits) {
        x.vq.sub_dim = a->vq_sub_dim;
        x.vq.bits = a->vq_bits;
        x.hdr.vq = &x.vq;
    }
    x.hdr.svd = a->svd != 0;
    x.hdr.iterations = a->iterations;
    x.hdr.seed = a->seed;
    x.hdr.max_samples = a->max_samples;
    x.hdr.error_budget = a->error_budget;
    x.hdr.eval_queries = a->eval_queries;
    x.hdr.exhaustive = a->exhaustive != 0;
    ProtobufCMessage *resp;
    int rc = kvdepot__call_messages(c, "calibrate", PATH_CALIBRATE, count + 1, calibrate_msg, &x,
                                    &kvdepot__v1__calibrate_response__descriptor, &resp);
    if (rc == KVDEPOT_OK) {
        Kvdepot__V1__CalibrateResponse *r = (Kvdepot__V1__CalibrateResponse *)resp;
        if (out) {
            out->samples = r->samples;
            out->artifacts = r->artifacts;
            out->errors = calloc(r->n_errors ? r->n_errors : 1, sizeof *out->errors);
            if (!out->errors)
                rc = kvdepot__fail(c, KVDEPOT_ENOMEM, "calibrate: out of memory");
            for (size_t i = 0; out->errors && i < r->n_errors; i++) {
                const Kvdepot__V1__CalibrationError *e = r->errors[i];
                kvdepot_calibration_error *o = &out->errors[i];
                o->layer = e->layer;
                o->kv_head = e->kv_head;
                o->vq_k = e->vq_k;
                o->vq_v = e->vq_v;
                o->svd_k = e->svd_k;
                o->svd_v = e->svd_v;
                o->svd_width_k = e->svd_width_k;
                o->svd_width_v = e->svd_width_v;
            }
            if (out->errors)
                out->n_errors = r->n_errors;
            if (rc == KVDEPOT_OK && r->advice && !(out->advice = advice_from_pb(r->advice)))
                rc = kvdepot__fail(c, KVDEPOT_ENOMEM, "calibrate: out of memory");
        }
        protobuf_c_message_free_unpacked(&r->base, NULL);
    }
    return rc;
}
