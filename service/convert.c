#include "convert.h"

#include <stdlib.h>
#include <string.h>

#include <grpc/byte_buffer_reader.h>
#include <grpc/slice.h>

#include "kvdepot/quant.h"
#include "rpc.h"

void kvd_seq_info_to_pb(const kvd_seq_info *in, Kvdepot__V1__SequenceInfo *out)
{
    kvdepot__v1__sequence_info__init(out);
    out->sequence_id.data = (uint8_t *)in->id;
    out->sequence_id.len = in->id_len;
    out->model = (char *)in->model;
    out->num_tokens = in->num_tokens;
    out->n_layer_tokens = in->layer_tokens ? in->num_layers : 0;
    out->layer_tokens = in->layer_tokens;
    out->page_tokens = in->page_tokens;
    out->sealed_pages = in->sealed_pages;
    out->stored_bytes = in->stored_bytes;
    out->created_unix_ms = in->created_unix_ms;
    out->prefix_blocks = in->prefix_blocks;
    out->n_block_hashes = in->block_hashes ? in->n_block_hashes : 0;
    out->block_hashes = in->block_hashes;
    out->activation_tokens = in->activation_tokens;
    out->pq_index_bytes = in->pq_bytes;
}

void kvd_seq_loss_to_pb(const kvd_seq_info *in, Kvdepot__V1__WalRecoveryLoss *out,
                        Kvdepot__V1__SequenceInfo *info)
{
    kvdepot__v1__wal_recovery_loss__init(out);
    if (!in->recovery_loss)
        return;
    out->acknowledged_tokens = in->loss_acknowledged;
    out->recovered_tokens = in->loss_recovered;
    out->recovered_unix_ms = in->loss_at_unix_ms;
    info->recovery_loss = out;
}

void kvd_model_to_pb(const kvd_model_info *in, Kvdepot__V1__Model *out)
{
    kvdepot__v1__model__init(out);
    out->name = (char *)in->name;
    out->revision = (char *)in->revision;
    out->num_layers = in->num_layers;
    out->num_kv_heads = in->num_kv_heads;
    out->num_q_heads = in->num_q_heads;
    out->head_dim = in->head_dim;
    out->hidden_size = in->hidden_size;
    out->dtype = (Kvdepot__V1__DType)in->dtype;
    out->created_unix_ms = in->created_unix_ms;
}

int kvd_model_from_pb(const Kvdepot__V1__Model *in, kvd_model_info *out, kvd_error *err)
{
    memset(out, 0, sizeof *out);
    size_t nlen = in->name ? strlen(in->name) : 0;
    size_t rlen = in->revision ? strlen(in->revision) : 0;
    if (nlen == 0)
        return kvd_error_set(err, KVD_EINVAL, "model.name: must not be empty");
    if (nlen > KVD_MODEL_NAME_MAX)
        return kvd_error_set(err, KVD_EINVAL, "model.name: %zu bytes, at most %d allowed", nlen,
                             KVD_MODEL_NAME_MAX);
    if (rlen > KVD_REVISION_MAX)
        return kvd_error_set(err, KVD_EINVAL, "model.revision: %zu bytes, at most %d allowed",
                             rlen, KVD_REVISION_MAX);
    memcpy(out->name, in->name, nlen);
    if (rlen)
        memcpy(out->revision, in->revision, rlen);
    out->num_layers = in->num_layers;
    out->num_kv_heads = in->num_kv_heads;
    out->num_q_heads = in->num_q_heads;
    out->head_dim = in->head_dim;
    out->hidden_size = in->hidden_size;
    out->dtype = (kvd_dtype)in->dtype;
    return 0;
}

int kvd_bb_flatten(grpc_byte_buffer *bb, grpc_slice *out)
{
    if (bb->type == GRPC_BB_RAW && bb->data.raw.compression == GRPC_COMPRESS_NONE &&
        bb->data.raw.slice_buffer.count == 1) {
        *out = grpc_slice_ref(bb->data.raw.slice_buffer.slices[0]);
        return 0;
    }
    grpc_byte_buffer_reader rd;
    if (!grpc_byte_buffer_reader_init(&rd, bb))
        return -1;
    *out = grpc_byte_buffer_reader_readall(&rd);
    grpc_byte_buffer_reader_destroy(&rd);
    return 0;
}

int kvd_wire_varint(const uint8_t *p, size_t n, size_t *i, uint64_t *v)
{
    *v = 0;
    for (int shift = 0; shift < 64 && *i < n; shift += 7) {
        uint8_t b = p[(*i)++];
        *v |= (uint64_t)(b & 0x7f) << shift;
        if (!(b & 0x80))
            return 1;
    }
    return 0;
}

/* Offset of the first byte that is not valid UTF-8 (RFC 3629: no overlong
 * forms, no surrogates, nothing past U+10FFFF), or n. */
static size_t utf8_bad(const uint8_t *s, size_t n)
{
    size_t i = 0;
    while (i < n) {
        uint8_t c = s[i];
        size_t k;
        uint32_t cp, min;
        if (c < 0x80) {
            i++;
            continue;
        } else if ((c & 0xe0) == 0xc0) {
            k = 1, cp = c & 0x1f, min = 0x80;
        } else if ((c & 0xf0) == 0xe0) {
            k = 2, cp = c & 0x0f, min = 0x800;
        } else if ((c & 0xf8) == 0xf0) {
            k = 3, cp = c & 0x07, min = 0x10000;
        } else {
            return i;
        }
        for (size_t j = 1; j <= k; j++) {
            if (i + j >= n || (s[i + j] & 0xc0) != 0x80)
                return i;
            cp = (cp << 6) | (s[i + j] & 0x3f);
        }
        if (cp < min || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff))
            return i;
        i += k + 1;
    }
    return n;
}

/*
 * Every string field of a message that protobuf-c parsed, checked on the
 * wire, where its length is known: protobuf-c hands strings over
 * NUL-terminated, so "a\0b" would be taken for "a". A NUL byte or bytes
 * that are not UTF-8 (proto3 strings are UTF-8) are KVD_EINVAL naming the
 * field (path "model.name"). Nested messages are walked too.
 */
static int check_wire_strings(const ProtobufCMessageDescriptor *d, const uint8_t *p, size_t n,
                              const char *prefix, int depth, kvd_error *err)
{
    size_t i = 0;
    while (i < n) {
        uint64_t tag, len;
        if (!kvd_wire_varint(p, n, &i, &tag))
            return 0; /* protobuf-c parsed it: nothing of ours to say */
        switch (tag & 7) {
        case 0:
            if (!kvd_wire_varint(p, n, &i, &len))
                return 0;
            continue;
        case 1:
            i += 8;
            continue;
        case 5:
            i += 4;
            continue;
        case 2:
            break;
        default:
            return 0;
        }
        if (!kvd_wire_varint(p, n, &i, &len) || len > n - i)
            return 0;
        const ProtobufCFieldDescriptor *f =
            tag >> 3 <= UINT32_MAX
                ? protobuf_c_message_descriptor_get_field(d, (unsigned)(tag >> 3))
                : NULL;
        const uint8_t *v = p + i;
        i += len;
        if (!f)
            continue;
        char path[192];
        snprintf(path, sizeof path, "%s%s%s", prefix, prefix[0] ? "." : "", f->name);
        if (f->type == PROTOBUF_C_TYPE_STRING) {
            const uint8_t *nul = memchr(v, 0, len);
            if (nul)
                return kvd_error_set(err, KVD_EINVAL, "%s: NUL byte at offset %zu", path,
                                     (size_t)(nul - v));
            size_t bad = utf8_bad(v, len);
            if (bad < len)
                return kvd_error_set(err, KVD_EINVAL, "%s: not UTF-8 at byte %zu (0x%02x)", path,
                                     bad, v[bad]);
        } else if (f->type == PROTOBUF_C_TYPE_MESSAGE && depth < 16) {
            int rc = check_wire_strings(f->descriptor, v, len, path, depth + 1, err);
            if (rc)
                return rc;
        }
    }
    return 0;
}

ProtobufCMessage *kvd_unpack(const ProtobufCMessageDescriptor *desc, const uint8_t *p, size_t n,
                             const char *path, kvd_error *why)
{
    ProtobufCMessage *m = protobuf_c_message_unpack(desc, NULL, n, p);
    if (m && check_wire_strings(desc, p, n, path, 0, why)) {
        protobuf_c_message_free_unpacked(m, NULL);
        m = NULL;
    }
    return m;
}

ProtobufCMessage *kvd_bb_unpack(const ProtobufCMessageDescriptor *desc, grpc_byte_buffer *bb,
                                kvd_error *why)
{
    grpc_slice s;
    if (kvd_bb_flatten(bb, &s) != 0)
        return NULL;
    ProtobufCMessage *m = kvd_unpack(desc, GRPC_SLICE_START_PTR(s), GRPC_SLICE_LENGTH(s), "", why);
    grpc_slice_unref(s);
    return m;
}

grpc_byte_buffer *kvd_pack(const ProtobufCMessage *msg)
{
    return kvd_pack_n(msg, protobuf_c_message_get_packed_size(msg));
}

grpc_byte_buffer *kvd_pack_n(const ProtobufCMessage *msg, size_t n)
{
    grpc_slice s = grpc_slice_malloc(n);
    protobuf_c_message_pack(msg, GRPC_SLICE_START_PTR(s));
    grpc_byte_buffer *bb = grpc_raw_byte_buffer_create(&s, 1);
    grpc_slice_unref(s);
    return bb;
}

/* ---- codec specs ------------------------------------------------------------- */

/* One side of the stored codecs in wire form; widths: the kept SVD widths,
 * [layer][kv head] (NULL when the side has no SVD). */
static void spec_to_pb(const kvd_codec_spec *in, const kvd_layer_arts *la, const kvd_codec_arts *a,
                       kvd_codecs_pb *p, int i)
{
    Kvdepot__V1__CodecSpec *o = &p->side[i];
    kvdepot__v1__codec_spec__init(o);
    o->codec = (Kvdepot__V1__Codec)in->codec;
    if (in->codec == KVD_CODEC_INT2 || in->codec == KVD_CODEC_INT4) {
        Kvdepot__V1__QuantSpec *q = &p->quant[i];
        kvdepot__v1__quant_spec__init(q);
        q->group_size = in->group ? in->group : 64;
        q->rounding = (Kvdepot__V1__Rounding)in->rounding;
        q->axis = in->axis == KVD_QAXIS_CHANNEL ? KVDEPOT__V1__QUANT_AXIS__QUANT_AXIS_CHANNEL
                                                : KVDEPOT__V1__QUANT_AXIS__QUANT_AXIS_TOKEN;
        q->seed = in->seed;
        o->quant = q;
    }
    if (in->codec == KVD_CODEC_VQ) {
        Kvdepot__V1__VQSpec *v = &p->vq[i];
        kvdepot__v1__vqspec__init(v);
        v->sub_dim = in->vq_sub_dim;
        v->bits = in->vq_bits;
        o->vq = v;
    }
    if (in->svd) {
        Kvdepot__V1__SVDSpec *d = &p->svd[i];
        kvdepot__v1__svdspec__init(d);
        if (la && a) {
            size_t n = (size_t)a->num_layers * a->num_kv_heads;
            p->widths[i] = n ? malloc(sizeof(uint32_t) * n) : NULL;
            for (uint32_t l = 0; p->widths[i] && l < a->num_layers; l++)
                for (uint32_t h = 0; h < a->num_kv_heads; h++)
                    p->widths[i][(size_t)l * a->num_kv_heads + h] =
                        la[l].widths ? (uint32_t)la[l].widths[h] : a->head_dim;
            d->n_kept_widths = p->widths[i] ? n : 0;
            d->kept_widths = p->widths[i];
        }
        o->svd = d;
    }
}

void kvd_codecs_to_pb(const kvd_seq_codecs *c, int stores_activations, kvd_codecs_pb *out)
{
    memset(out, 0, sizeof *out);
    kvdepot__v1__sequence_codecs__init(&out->c);
    const kvd_codec_arts *a = c->arts;
    spec_to_pb(&c->k, a ? a->k : NULL, a, out, 0);
    spec_to_pb(&c->v, a ? a->v : NULL, a, out, 1);
    out->c.k = &out->side[0];
    out->c.v = &out->side[1];
    if (c->pq_m) {
        kvdepot__v1__pqspec__init(&out->pq);
        out->pq.m = c->pq_m;
        out->pq.bits = c->pq_bits;
        out->pq.iterations = c->pq_iterations;
        out->pq.min_train_tokens = c->pq_min_train_tokens;
        out->c.pq = &out->pq;
    }
    out->c.raw_sink_tokens = c->raw_sink_tokens;
    out->c.store_activations = stores_activations != 0;
    out->c.artifacts_fingerprint = c->arts_hash;
}

int kvd_codecs_pb_get(kvd_store *st, const void *id, size_t id_len, int stores_activations,
                      int with_widths, kvd_codecs_pb *out, kvd_error *err)
{
    memset(out, 0, sizeof *out);
    kvd_seq_codecs c;
    int found = 0;
    int rc = kvd_store_seq_codecs_get(st, id, id_len, &c, &found, err);
    if (!rc && found && with_widths && (c.k.svd || c.v.svd))
        rc = kvd_seq_codecs_load_arts(st, id, id_len, &c, err);
    if (!rc)
        kvd_codecs_to_pb(&c, stores_activations, out);
    kvd_seq_codecs_clear(&c);
    return rc;
}

int kvd_seq_info_codecs_pb(kvd_store *st, const kvd_seq_info *info, int with_widths,
                           Kvdepot__V1__SequenceInfo *si, kvd_codecs_pb *cp, kvd_error *err)
{
    int rc = kvd_codecs_pb_get(st, info->id, info->id_len, info->stores_activations, with_widths,
                               cp, err);
    if (!rc)
        si->codecs = &cp->c;
    return rc;
}

void kvd_codecs_pb_clear(kvd_codecs_pb *p)
{
    free(p->widths[0]);
    free(p->widths[1]);
    p->widths[0] = p->widths[1] = NULL;
}

static void spec_from_pb(const Kvdepot__V1__CodecSpec *in, kvd_codec_spec *out)
{
    memset(out, 0, sizeof *out);
    if (!in)
        return;
    out->codec = (uint8_t)(in->codec > 255 ? 255 : in->codec);
    if (in->quant) {
        out->group = (uint16_t)(in->quant->group_size > 65535 ? 65535 : in->quant->group_size);
        out->rounding = (uint8_t)(in->quant->rounding > 255 ? 255 : in->quant->rounding);
        out->seed = in->quant->seed;
        /* Wire axis: 0 default (kvd_codec_spec_check resolves it), 1 token,
         * 2 channel. */
        unsigned ax = in->quant->axis;
        out->axis = ax == 0   ? KVD_CODEC_AXIS_DEFAULT
                    : ax == 1 ? KVD_QAXIS_TOKEN
                    : ax == 2 ? KVD_QAXIS_CHANNEL
                              : 255;
    } else {
        out->group = 0;
        out->axis = KVD_CODEC_AXIS_DEFAULT;
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

int kvd_codecs_from_pb(const Kvdepot__V1__SequenceCodecs *c, const kvd_model_info *m,
                       uint32_t page_tokens, kvd_seq_codecs *out, kvd_error *err)
{
    memset(out, 0, sizeof *out);
    if (!c)
        return 0;
    spec_from_pb(c->k, &out->k);
    spec_from_pb(c->v, &out->v);
    out->raw_sink_tokens = c->raw_sink_tokens;
    const Kvdepot__V1__CodecSpec *sp[2] = {c->k, c->v};
    for (int i = 0; i < 2; i++) {
        const Kvdepot__V1__QuantSpec *q = sp[i] ? sp[i]->quant : NULL;
        if (q && (q->group_size || q->rounding || q->axis || q->seed) &&
            sp[i]->codec != KVDEPOT__V1__CODEC__CODEC_INT2 &&
            sp[i]->codec != KVDEPOT__V1__CODEC__CODEC_INT4)
            return kvd_error_set(err, KVD_EINVAL,
                                 "codecs.%s.quant: set for a codec other than INT2/INT4 (group "
                                 "size, rounding, axis and seed have no meaning there)",
                                 i ? "v" : "k");
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
        if (sp[i] && sp[i]->svd && !(sp[i]->svd->removal_rate >= 0 && sp[i]->svd->removal_rate < 1))
            return kvd_error_set(err, KVD_EINVAL, "codecs.%s.svd.removal_rate: %g not in [0, 1)",
                                 i ? "v" : "k", sp[i]->svd->removal_rate);
    }
    if (c->pq) {
        out->pq_m = c->pq->m;
        out->pq_bits = (uint8_t)(c->pq->bits > 255 ? 255 : c->pq->bits);
        out->pq_iterations = c->pq->iterations;
        out->pq_min_train_tokens = c->pq->min_train_tokens;
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
