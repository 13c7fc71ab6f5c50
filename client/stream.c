/*
 * libkvdepot: the streaming RPCs. Append sends K then V in messages of
 * chunk_bytes; Read receives the server's chunks straight into the caller's
 * K and V buffers.
 *
 * The data fields are encoded and decoded by hand rather than through
 * protobuf-c, which would copy every chunk once more: an AppendRequest is
 *     0x0a varint(len) AppendHeader      (field 1, first message only)
 *     0x12 varint(len) data bytes        (field 2)
 * and a ReadResponse has the same shape with ReadHeader.
 */
#include "internal.h"

#include "kvdepot/status.h"
#include "kvdepot/v1/kvdepot.pb-c.h"

#include <grpc/byte_buffer.h>
#include <grpc/byte_buffer_reader.h>
#include <grpc/slice.h>

#include <stdlib.h>
#include <string.h>

#define TAG_HEADER 0x0a /* field 1, length-delimited */
#define TAG_DATA 0x12   /* field 2, length-delimited */

/* Distinct addresses used as completion-queue tags within one call. */
static char tag_send, tag_recv, tag_close, tag_status;

static size_t varint_put(uint8_t *p, uint64_t v)
{
    size_t n = 0;
    while (v >= 0x80) {
        p[n++] = (uint8_t)(v | 0x80);
        v >>= 7;
    }
    p[n++] = (uint8_t)v;
    return n;
}

static size_t varint_len(uint64_t v)
{
    size_t n = 1;
    while (v >= 0x80) {
        v >>= 7;
        n++;
    }
    return n;
}

/* ------------------------------------------------------------------------ */
/* Append                                                                    */
/* ------------------------------------------------------------------------ */

/* K then V (then X) seen as one byte range, without concatenating them. */
typedef struct kv_src {
    const uint8_t *k, *v, *x;
    size_t k_bytes, v_bytes, x_bytes;
} kv_src;

static void kv_copy_out(const kv_src *s, uint64_t off, uint8_t *dst, size_t n)
{
    const uint8_t *part[3] = {s->k, s->v, s->x};
    size_t len[3] = {s->k_bytes, s->v_bytes, s->x_bytes};
    for (int i = 0; i < 3 && n; i++) {
        if (off >= len[i]) {
            off -= len[i];
            continue;
        }
        size_t m = len[i] - off < n ? (size_t)(len[i] - off) : n;
        memcpy(dst, part[i] + off, m);
        dst += m;
        n -= m;
        off = 0;
    }
}

/* Bytes of one AppendRequest carrying (optionally) the header and dlen data bytes. */
static size_t append_msg_len(size_t hlen, int with_header, size_t dlen)
{
    size_t n = 0;
    if (with_header)
        n += 1 + varint_len(hlen) + hlen;
    if (dlen)
        n += 1 + varint_len(dlen) + dlen;
    return n;
}

static size_t append_msg_write(uint8_t *p, const uint8_t *hdr, size_t hlen, int with_header,
                               const kv_src *src, uint64_t off, size_t dlen)
{
    size_t n = 0;
    if (with_header) {
        p[n++] = TAG_HEADER;
        n += varint_put(p + n, hlen);
        memcpy(p + n, hdr, hlen);
        n += hlen;
    }
    if (dlen) {
        p[n++] = TAG_DATA;
        n += varint_put(p + n, dlen);
        kv_copy_out(src, off, p + n, dlen);
        n += dlen;
    }
    return n;
}

/* The packed header of an append (malloc'd, *hlen bytes), or NULL with c
 * failed (KVDEPOT_EINVAL, KVDEPOT_ENOMEM) and *rc set. */
static uint8_t *pack_header(kvdepot_client *c, const kvdepot_append_args *a, size_t *hlen, int *rc)
{
    Kvdepot__V1__AppendHeader h;
    kvdepot__v1__append_header__init(&h);
    h.sequence_id.data = (uint8_t *)a->id;
    h.sequence_id.len = a->id_len;
    h.layer_start = a->layer_start;
    h.num_layers = a->num_layers;
    h.token_start = a->token_start;
    h.num_tokens = a->num_tokens;
    h.dtype = (Kvdepot__V1__DType)a->dtype;
    h.token_ids = (uint32_t *)a->token_ids;
    h.n_token_ids = a->num_token_ids;
    h.block_hashes = (uint64_t *)a->block_hashes;
    h.n_block_hashes = a->num_block_hashes;
    h.with_activations = a->x != NULL;
    h.engine_block_tokens = a->engine_hashes.block_tokens;
    h.n_engine_block_hashes = a->engine_hashes.num;
    Kvdepot__V1__CreateSequenceRequest cr;
    kvdepot__codecs_pb cpb;
    kvdepot__v1__create_sequence_request__init(&cr);
    if ((*rc = kvdepot__engine_pb(c, &a->engine_hashes, "append", &h.engine_block_hashes)))
        return NULL;
    if (a->create) {
        if ((*rc = kvdepot__create_pb(c, a->create, "append: create", &cr, &cpb))) {
            free(h.engine_block_hashes);
            return NULL;
        }
        /* the header's id serves for both */
        cr.sequence_id.data = NULL;
        cr.sequence_id.len = 0;
        h.create = &cr;
    }
    *hlen = protobuf_c_message_get_packed_size(&h.base);
    uint8_t *hdr = malloc(*hlen ? *hlen : 1);
    if (hdr)
        protobuf_c_message_pack(&h.base, hdr);
    else
        *rc = kvdepot__fail(c, KVDEPOT_ENOMEM, "append: out of memory");
    free(h.engine_block_hashes);
    free(cr.engine_prefix_hashes);
    return hdr;
}

void *kvdepot__encode_append(const kvdepot_append_args *a, const void *data, size_t data_len,
                             int with_header, size_t *len)
{
    size_t hlen;
    int rc;
    uint8_t *hdr = pack_header(NULL, a, &hlen, &rc);
    if (!hdr)
        return NULL;
    kv_src src = {.k = data, .k_bytes = data_len};
    size_t n = append_msg_len(hlen, with_header, data_len);
    uint8_t *p = malloc(n ? n : 1);
    if (p)
        *len = append_msg_write(p, hdr, hlen, with_header, &src, 0, data_len);
    free(hdr);
    return p;
}

/* Send the message bb once the one in flight (*in_flight) has gone: gRPC
 * takes one send at a time, so a caller builds the next message while the
 * previous one is on its way. With md, the call's initial metadata go in
 * the same batch. Returns 1 when bb is on its way (now *in_flight); 0 when
 * the previous send failed (the call is over: its status says why); -1
 * when gRPC refused the batch (the call is cancelled: nothing else would
 * end it, the server waits for more). bb is destroyed unless on its way. */
static int send_next(kvdepot_client *c, kvdepot__call *k, grpc_byte_buffer **in_flight, int md,
                     grpc_byte_buffer *bb)
{
    if (*in_flight) {
        int ok = kvdepot__call_wait(k, &tag_send) == 1;
        grpc_byte_buffer_destroy(*in_flight);
        *in_flight = NULL;
        if (!ok) {
            grpc_byte_buffer_destroy(bb);
            return 0;
        }
    }
    grpc_op ops[2];
    memset(ops, 0, sizeof ops);
    size_t nops = 0;
    if (md) {
        ops[nops].op = GRPC_OP_SEND_INITIAL_METADATA;
        ops[nops].flags = c->wait_for_ready ? GRPC_INITIAL_METADATA_WAIT_FOR_READY : 0;
        kvdepot__initial_md(c, &ops[nops]);
        nops++;
    }
    ops[nops].op = GRPC_OP_SEND_MESSAGE;
    ops[nops].data.send_message.send_message = bb;
    nops++;
    if (kvdepot__call_start_batch(k, ops, nops, &tag_send) != 0) {
        grpc_byte_buffer_destroy(bb);
        grpc_call_cancel(k->call, NULL);
        return -1;
    }
    *in_flight = bb;
    return 1;
}

int kvdepot_sequence_append(kvdepot_client *c, const kvdepot_append_args *a,
                            kvdepot_sequence_info *out)
{
    if (c && c->cluster)
        return kvdepot__cluster_sequence_append(c, a, out);
    return kvdepot__append(c, a, out, c ? c->progress : NULL, c ? c->progress_user : NULL);
}

int kvdepot__append(kvdepot_client *c, const kvdepot_append_args *a, kvdepot_sequence_info *out,
                    kvdepot_progress_fn progress, void *progress_user)
{
    kvdepot__clear_error();
    if (out)
        memset(out, 0, sizeof *out);
    if (!c || !a)
        return kvdepot__fail(c, KVDEPOT_EINVAL, "append: NULL argument");
    if (a->created)
        *a->created = 0;
    if ((!a->id && a->id_len) || (!a->k && a->k_bytes) || (!a->v && a->v_bytes) ||
        (!a->token_ids && a->num_token_ids) || (!a->block_hashes && a->num_block_hashes) ||
        (!a->x && a->x_bytes))
        return kvdepot__fail(c, KVDEPOT_EINVAL, "append: NULL pointer with a nonzero length");

    size_t hlen;
    int rc;
    uint8_t *hdr = pack_header(c, a, &hlen, &rc);
    if (!hdr)
        return rc;

    kvdepot__call k;
    rc = kvdepot__call_start(c, KVDEPOT__APPEND, NULL, &k);
    if (rc) {
        kvdepot__call_end(&k);
        free(hdr);
        return rc;
    }

    /* The response and status are awaited from the start, so a server that
     * rejects the header early ends the stream instead of letting us send
     * every byte first. */
    grpc_byte_buffer *resp_bb = NULL;
    grpc_op rops[3];
    memset(rops, 0, sizeof rops);
    rops[0].op = GRPC_OP_RECV_INITIAL_METADATA;
    rops[0].data.recv_initial_metadata.recv_initial_metadata = &k.initial_md;
    rops[1].op = GRPC_OP_RECV_MESSAGE;
    rops[1].data.recv_message.recv_message = &resp_bb;
    rops[2].op = GRPC_OP_RECV_STATUS_ON_CLIENT;
    rops[2].data.recv_status_on_client.trailing_metadata = &k.trailing_md;
    rops[2].data.recv_status_on_client.status = &k.status;
    rops[2].data.recv_status_on_client.status_details = &k.details;
    if (kvdepot__call_start_batch(&k, rops, 3, &tag_recv) != 0) {
        kvdepot__call_end(&k);
        free(hdr);
        return kvdepot__fail(c, KVDEPOT_EINTERNAL, "append: gRPC refused the call");
    }

    kv_src src = {.k = a->k,
                  .v = a->v,
                  .x = a->x,
                  .k_bytes = a->k_bytes,
                  .v_bytes = a->v_bytes,
                  .x_bytes = a->x ? a->x_bytes : 0};
    uint64_t total = (uint64_t)a->k_bytes + a->v_bytes + src.x_bytes;
    uint64_t off = 0;
    int first = 1, send_ok = 1;
    grpc_byte_buffer *in_flight = NULL;
    /* A header too big to share a message with a full chunk goes alone. */
    int header_alone = hlen + 16 + c->chunk_bytes > c->max_message_bytes;
    while (send_ok && (first || off < total)) {
        size_t dlen = total - off < c->chunk_bytes ? (size_t)(total - off) : c->chunk_bytes;
        if (first && header_alone)
            dlen = 0;
        size_t mlen = append_msg_len(hlen, first, dlen);
        grpc_slice s = grpc_slice_malloc(mlen);
        append_msg_write(GRPC_SLICE_START_PTR(s), hdr, hlen, first, &src, off, dlen);
        grpc_byte_buffer *bb = grpc_raw_byte_buffer_create(&s, 1);
        grpc_slice_unref(s);
        send_ok = send_next(c, &k, &in_flight, first, bb) == 1;
        if (!send_ok)
            break;
        off += dlen;
        first = 0;
        if (progress && off < total)
            progress(progress_user, off, total);
    }
    if (in_flight) {
        send_ok = kvdepot__call_wait(&k, &tag_send) == 1 && send_ok;
        grpc_byte_buffer_destroy(in_flight);
    }
    if (progress && send_ok)
        progress(progress_user, total, total);
    if (send_ok) {
        grpc_op op;
        memset(&op, 0, sizeof op);
        op.op = GRPC_OP_SEND_CLOSE_FROM_CLIENT;
        if (kvdepot__call_batch(&k, &op, 1, &tag_close) != 1)
            send_ok = 0;
    }
    free(hdr);
    /* When a send failed the call is over (the server answered early, the
     * deadline passed or the connection dropped); its status says which. */
    kvdepot__call_wait(&k, &tag_recv);
    rc = kvdepot__call_result(&k);
    if (rc == KVDEPOT_OK) {
        if (!resp_bb) {
            rc = kvdepot__fail(c, KVDEPOT_EINTERNAL, "append: server sent no response");
        } else if (out || a->created) {
            grpc_byte_buffer_reader r;
            grpc_slice s = grpc_empty_slice();
            if (grpc_byte_buffer_reader_init(&r, resp_bb)) {
                s = grpc_byte_buffer_reader_readall(&r);
                grpc_byte_buffer_reader_destroy(&r);
            }
            Kvdepot__V1__AppendResponse *resp =
                kvdepot__v1__append_response__unpack(NULL, GRPC_SLICE_LENGTH(s), GRPC_SLICE_START_PTR(s));
            grpc_slice_unref(s);
            if (!resp) {
                rc = kvdepot__fail(c, KVDEPOT_EINTERNAL, "append: malformed response");
            } else {
                if (a->created)
                    *a->created = resp->created;
                if (out)
                    rc = kvdepot__info_from_pb(c, resp->sequence, out);
                kvdepot__v1__append_response__free_unpacked(resp, NULL);
            }
        }
    }
    if (resp_bb)
        grpc_byte_buffer_destroy(resp_bb);
    kvdepot__call_end(&k);
    kvdepot__log(c, KVDEPOT_LOG_DEBUG, "Append %llu bytes: %s", (unsigned long long)total,
                 kvd_status_name(rc));
    return rc;
}

/* ------------------------------------------------------------------------ */
/* Read                                                                      */
/* ------------------------------------------------------------------------ */

/* Walks a received message slice by slice, so data is copied once, from the
 * transport's slices into the destination. */
typedef struct bb_cursor {
    grpc_byte_buffer_reader reader;
    grpc_slice slice;
    size_t off;
    int have;
} bb_cursor;

static int cur_init(bb_cursor *cu, grpc_byte_buffer *bb)
{
    memset(cu, 0, sizeof *cu);
    return grpc_byte_buffer_reader_init(&cu->reader, bb) ? 0 : -1;
}

static void cur_destroy(bb_cursor *cu)
{
    if (cu->have)
        grpc_slice_unref(cu->slice);
    grpc_byte_buffer_reader_destroy(&cu->reader);
}

/* Make sure the current slice has unread bytes; 0 at the end of the message. */
static int cur_fill(bb_cursor *cu)
{
    while (!cu->have || cu->off == GRPC_SLICE_LENGTH(cu->slice)) {
        if (cu->have)
            grpc_slice_unref(cu->slice);
        cu->have = grpc_byte_buffer_reader_next(&cu->reader, &cu->slice);
        cu->off = 0;
        if (!cu->have)
            return 0;
    }
    return 1;
}

static int cur_varint(bb_cursor *cu, uint64_t *v)
{
    *v = 0;
    for (int shift = 0; shift < 64; shift += 7) {
        if (!cur_fill(cu))
            return -1;
        uint8_t b = GRPC_SLICE_START_PTR(cu->slice)[cu->off++];
        *v |= (uint64_t)(b & 0x7f) << shift;
        if (!(b & 0x80))
            return 0;
    }
    return -1;
}

/* Hand the next n bytes to fn (NULL = skip them). */
typedef void (*cur_sink)(void *user, const uint8_t *p, size_t n);

static int cur_take(bb_cursor *cu, uint64_t n, cur_sink fn, void *user)
{
    while (n) {
        if (!cur_fill(cu))
            return -1;
        size_t avail = GRPC_SLICE_LENGTH(cu->slice) - cu->off;
        size_t m = n < avail ? (size_t)n : avail;
        if (fn)
            fn(user, GRPC_SLICE_START_PTR(cu->slice) + cu->off, m);
        cu->off += m;
        n -= m;
    }
    return 0;
}

typedef struct read_state {
    kvdepot_client *c;
    kvdepot_read_result *out;
    int have_header;
    uint64_t total;     /* X + K + V bytes announced */
    uint64_t received;  /* data bytes so far */
    uint8_t *hdr_buf;   /* gathers the header's bytes */
    size_t hdr_len;
    int too_small;      /* the caller's buffers cannot hold the range */
} read_state;

static void sink_header(void *user, const uint8_t *p, size_t n)
{
    read_state *st = user;
    memcpy(st->hdr_buf + st->hdr_len, p, n);
    st->hdr_len += n;
}

static void sink_data(void *user, const uint8_t *p, size_t n)
{
    read_state *st = user;
    kvdepot_read_result *o = st->out;
    uint64_t off = st->received;
    /* An activation-first stream starts with X. */
    if (off < o->x_bytes) {
        size_t m = o->x_bytes - off < n ? (size_t)(o->x_bytes - off) : n;
        memcpy((uint8_t *)o->x + off, p, m);
        p += m;
        n -= m;
        st->received = off + m;
        if (!n)
            return;
    }
    off = st->received - o->x_bytes;
    if (off < o->kv_bytes) {
        size_t m = o->kv_bytes - off < n ? (size_t)(o->kv_bytes - off) : n;
        memcpy((uint8_t *)o->k + off, p, m);
        p += m;
        off += m;
        n -= m;
    }
    if (n)
        memcpy((uint8_t *)o->v + (off - o->kv_bytes), p, n);
    st->received = o->x_bytes + off + n;
}

/* Accept the stream's header: check it describes what follows and set up
 * the destination. Returns 0 or a status with the error set. */
static int read_header(read_state *st, const kvdepot_read_args *a, const Kvdepot__V1__ReadHeader *h)
{
    kvdepot_client *c = st->c;
    kvdepot_read_result *o = st->out;
    o->layer_start = h->layer_start;
    o->num_layers = h->num_layers;
    o->token_start = h->token_start;
    o->num_tokens = h->num_tokens;
    o->num_kv_heads = h->num_kv_heads;
    o->head_dim = h->head_dim;
    o->dtype = (kvdepot_dtype)h->dtype;
    kvdepot_model shape = {.num_kv_heads = h->num_kv_heads, .head_dim = h->head_dim,
                           .dtype = o->dtype};
    /* K and V cover the tokens after the activation ones. */
    uint64_t act = h->activation_tokens;
    if (act != a->activation_tokens || act > h->num_tokens ||
        (act && (h->hidden_size == 0 ||
                 h->activation_bytes != (uint64_t)h->num_layers * act * h->hidden_size *
                                            kvdepot_dtype_size(o->dtype))) ||
        (!act && h->activation_bytes))
        return kvdepot__fail(c, KVDEPOT_EINTERNAL,
                             "read: server header announces %llu activation tokens (%llu bytes, "
                             "hidden_size %u) for %llu asked",
                             (unsigned long long)act, (unsigned long long)h->activation_bytes,
                             h->hidden_size, (unsigned long long)a->activation_tokens);
    o->activation_tokens = act;
    o->hidden_size = h->hidden_size;
    size_t kv = kvdepot_kv_bytes(&shape, h->num_layers, h->num_tokens - act);
    int empty = h->num_layers == 0 || h->num_tokens == act || h->num_kv_heads == 0 ||
                h->head_dim == 0;
    if ((kv == 0 && !empty) || kvdepot_dtype_size(o->dtype) == 0 || h->total_bytes != 2 * (uint64_t)kv)
        return kvdepot__fail(c, KVDEPOT_EINTERNAL,
                             "read: server header announces %llu bytes for %u layers x %llu tokens "
                             "x %u heads x %u dims of %s",
                             (unsigned long long)h->total_bytes, h->num_layers,
                             (unsigned long long)h->num_tokens, h->num_kv_heads, h->head_dim,
                             kvdepot_dtype_name(o->dtype));
    o->kv_bytes = kv;
    size_t xb = (size_t)h->activation_bytes;
    o->x_bytes = xb;
    st->total = h->total_bytes + h->activation_bytes;
    if (a->k) {
        if (a->capacity < kv || (xb && a->x_capacity < xb)) {
            st->too_small = 1;
            return kvdepot__fail(c, KVDEPOT_EINVAL,
                                 "read: buffers hold %zu bytes (X: %zu), K and V need %zu each, "
                                 "X %zu",
                                 a->capacity, a->x_capacity, kv, xb);
        }
        o->k = a->k;
        o->v = a->v;
        o->x = xb ? a->x : NULL;
    } else {
        o->owned = malloc(kv || xb ? 2 * kv + xb : 1);
        if (!o->owned)
            return kvdepot__fail(c, KVDEPOT_ENOMEM, "read: cannot allocate %zu bytes",
                                 2 * kv + xb);
        o->k = o->owned;
        o->v = (uint8_t *)o->owned + kv;
        o->x = xb ? (uint8_t *)o->owned + 2 * kv : NULL;
    }
    st->have_header = 1;
    return KVDEPOT_OK;
}

/* A length-delimited field of a received message: fn consumes its len
 * bytes from cu. Returns 0, a status with the error set, or FIELD_SKIP for
 * a field it does not read (walk_message skips its bytes). */
#define FIELD_SKIP 1 /* (statuses are 0 or negative) */
typedef int (*field_fn)(void *user, bb_cursor *cu, uint32_t field, uint64_t len);

/* Walk a received message field by field at the wire level: numbers and
 * fixed-width fields are skipped, every length-delimited one goes to fn.
 * `what` prefixes the errors ("read"). 0 or a status with the error set. */
static int walk_message(kvdepot_client *c, grpc_byte_buffer *bb, const char *what, field_fn fn,
                        void *user)
{
    bb_cursor cu;
    if (cur_init(&cu, bb) != 0)
        return kvdepot__fail(c, KVDEPOT_EINTERNAL, "%s: cannot read a response message", what);
    int rc = KVDEPOT_OK;
    while (rc == KVDEPOT_OK && cur_fill(&cu)) {
        uint64_t key, len;
        if (cur_varint(&cu, &key) != 0) {
            rc = kvdepot__fail(c, KVDEPOT_EINTERNAL, "%s: malformed response", what);
            break;
        }
        const uint32_t wt = (uint32_t)(key & 7);
        if (wt == 0 || wt == 1 || wt == 5) {
            uint64_t ignored;
            if (wt == 0 ? cur_varint(&cu, &ignored) != 0
                        : cur_take(&cu, wt == 1 ? 8 : 4, NULL, NULL) != 0)
                rc = kvdepot__fail(c, KVDEPOT_EINTERNAL, "%s: malformed response", what);
        } else if (wt != 2) {
            rc = kvdepot__fail(c, KVDEPOT_EINTERNAL, "%s: malformed response (wire type %u)", what,
                               wt);
        } else if (cur_varint(&cu, &len) != 0) {
            rc = kvdepot__fail(c, KVDEPOT_EINTERNAL, "%s: malformed response", what);
        } else if ((rc = fn(user, &cu, (uint32_t)(key >> 3), len)) == FIELD_SKIP) {
            rc = cur_take(&cu, len, NULL, NULL) == 0
                     ? KVDEPOT_OK
                     : kvdepot__fail(c, KVDEPOT_EINTERNAL, "%s: malformed response", what);
        }
    }
    cur_destroy(&cu);
    return rc;
}

typedef struct read_msg {
    read_state *st;
    const kvdepot_read_args *a;
} read_msg;

/* One field of a ReadResponse: the header (1) or a chunk of data (2). */
static int read_field(void *user, bb_cursor *cu, uint32_t field, uint64_t len)
{
    read_state *st = ((read_msg *)user)->st;
    kvdepot_client *c = st->c;
    if (field == 1) {
        if (st->have_header)
            return kvdepot__fail(c, KVDEPOT_EINTERNAL, "read: server sent a second header");
        if (len > (1u << 20))
            return kvdepot__fail(c, KVDEPOT_EINTERNAL, "read: oversized header");
        st->hdr_buf = malloc(len ? len : 1);
        st->hdr_len = 0;
        if (!st->hdr_buf)
            return kvdepot__fail(c, KVDEPOT_ENOMEM, "read: out of memory");
        int rc = cur_take(cu, len, sink_header, st);
        Kvdepot__V1__ReadHeader *h =
            rc ? NULL : kvdepot__v1__read_header__unpack(NULL, st->hdr_len, st->hdr_buf);
        free(st->hdr_buf);
        st->hdr_buf = NULL;
        if (rc)
            return kvdepot__fail(c, KVDEPOT_EINTERNAL, "read: truncated header");
        if (!h)
            return kvdepot__fail(c, KVDEPOT_EINTERNAL, "read: malformed header");
        rc = read_header(st, ((read_msg *)user)->a, h);
        kvdepot__v1__read_header__free_unpacked(h, NULL);
        return rc;
    }
    if (field == 2) {
        if (!st->have_header)
            return kvdepot__fail(c, KVDEPOT_EINTERNAL, "read: data before the header");
        if (len > st->total - st->received)
            return kvdepot__fail(c, KVDEPOT_EINTERNAL,
                                 "read: server sent more than the %llu bytes it announced",
                                 (unsigned long long)st->total);
        if (cur_take(cu, len, sink_data, st) != 0)
            return kvdepot__fail(c, KVDEPOT_EINTERNAL, "read: truncated data");
        return KVDEPOT_OK;
    }
    return FIELD_SKIP;
}

/* Parse one ReadResponse. Returns 0 or a status with the error set. */
static int read_message(read_state *st, const kvdepot_read_args *a, grpc_byte_buffer *bb)
{
    read_msg m = {st, a};
    return walk_message(st->c, bb, "read", read_field, &m);
}

int kvdepot_sequence_read(kvdepot_client *c, const kvdepot_read_args *a, kvdepot_read_result *out)
{
    if (c && c->cluster)
        return kvdepot__cluster_sequence_read(c, a, out);
    return kvdepot__read(c, a, out, c ? c->progress : NULL, c ? c->progress_user : NULL);
}

int kvdepot__read(kvdepot_client *c, const kvdepot_read_args *a, kvdepot_read_result *out,
                  kvdepot_progress_fn progress, void *progress_user)
{
    kvdepot__clear_error();
    if (out)
        memset(out, 0, sizeof *out);
    if (!c || !a || !out)
        return kvdepot__fail(c, KVDEPOT_EINVAL, "read: NULL argument");
    if ((!a->id && a->id_len) || (!a->k != !a->v))
        return kvdepot__fail(c, KVDEPOT_EINVAL, "read: give both K and V buffers or neither");
    if (a->k && a->activation_tokens && !a->x)
        return kvdepot__fail(c, KVDEPOT_EINVAL,
                             "read: activation_tokens with caller buffers needs an X buffer");

    Kvdepot__V1__ReadRequest req = KVDEPOT__V1__READ_REQUEST__INIT;
    req.sequence_id.data = (uint8_t *)a->id;
    req.sequence_id.len = a->id_len;
    req.layer_start = a->layer_start;
    req.num_layers = a->num_layers;
    req.token_start = a->token_start;
    req.num_tokens = a->num_tokens;
    req.max_chunk_bytes = (uint32_t)c->chunk_bytes;
    req.activation_tokens = a->activation_tokens;

    kvdepot__call k;
    int rc = kvdepot__call_start(c, KVDEPOT__READ, NULL, &k);
    if (rc) {
        kvdepot__call_end(&k);
        return rc;
    }
    grpc_byte_buffer *send = kvdepot__pack(&req.base);
    int ok = kvdepot__call_send_request(&k, send, &tag_send);
    grpc_byte_buffer_destroy(send);

    read_state st = {.c = c, .out = out};
    int local = KVDEPOT_OK; /* a failure found here rather than by the server */
    if (ok < 0)
        local = kvdepot__fail(c, KVDEPOT_EINTERNAL, "read: gRPC refused the call");
    while (ok == 1 && local == KVDEPOT_OK) {
        grpc_byte_buffer *bb = kvdepot__call_recv(&k, &tag_recv);
        if (!bb)
            break; /* end of stream or failure: the status tells */
        local = read_message(&st, a, bb);
        grpc_byte_buffer_destroy(bb);
        if (progress && local == KVDEPOT_OK && st.have_header)
            progress(progress_user, st.received, st.total);
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
    if (local != KVDEPOT_OK) {
        rc = local;
    } else {
        rc = kvdepot__call_result(&k);
        if (rc == KVDEPOT_OK && !st.have_header)
            rc = kvdepot__fail(c, KVDEPOT_EINTERNAL, "read: server sent no header");
        else if (rc == KVDEPOT_OK && st.received != st.total)
            rc = kvdepot__fail(c, KVDEPOT_EINTERNAL,
                               "read: stream ended after %llu of %llu bytes",
                               (unsigned long long)st.received, (unsigned long long)st.total);
    }
    kvdepot__call_end(&k);
    if (rc != KVDEPOT_OK) {
        free(out->owned);
        /* A too-small buffer keeps the header so the caller can size a retry. */
        if (st.too_small)
            out->k = out->v = out->x = out->owned = NULL;
        else
            memset(out, 0, sizeof *out);
    }
    kvdepot__log(c, KVDEPOT_LOG_DEBUG, "Read %llu bytes: %s", (unsigned long long)st.received,
                 kvd_status_name(rc));
    return rc;
}

/* ------------------------------------------------------------------------ */
/* Unary and client-streaming calls of protobuf messages                     */
/* ------------------------------------------------------------------------ */

/* Message i of a call_slices call, in a slice the caller then owns. */
typedef grpc_slice (*next_slice_fn)(size_t i, void *ctx);

/* A client-streaming or unary call of n messages, each asked of next(i)
 * while message i-1 is on its way (gRPC takes one send at a time): so a
 * message is built while the previous one is sent. The response as
 * kvdepot__call_raw gives it. */
static int call_slices(kvdepot_client *c, const char *path, size_t n, next_slice_fn next, void *ctx,
                       int cancel, void **resp, size_t *resp_len)
{
    kvdepot__clear_error();
    if (resp)
        *resp = NULL;
    if (resp_len)
        *resp_len = 0;
    kvdepot__call k;
    int rc = kvdepot__call_start(c, -1, path, &k);
    if (rc) {
        kvdepot__call_end(&k);
        return rc;
    }
    grpc_byte_buffer *resp_bb = NULL;
    grpc_op rops[3];
    memset(rops, 0, sizeof rops);
    rops[0].op = GRPC_OP_RECV_INITIAL_METADATA;
    rops[0].data.recv_initial_metadata.recv_initial_metadata = &k.initial_md;
    rops[1].op = GRPC_OP_RECV_MESSAGE;
    rops[1].data.recv_message.recv_message = &resp_bb;
    rops[2].op = GRPC_OP_RECV_STATUS_ON_CLIENT;
    rops[2].data.recv_status_on_client.trailing_metadata = &k.trailing_md;
    rops[2].data.recv_status_on_client.status = &k.status;
    rops[2].data.recv_status_on_client.status_details = &k.details;
    if (kvdepot__call_start_batch(&k, rops, 3, &tag_recv) != 0) {
        kvdepot__call_end(&k);
        return kvdepot__fail(c, KVDEPOT_EINTERNAL, "raw call: gRPC refused the call");
    }
    int ok = 1, sent = 0;
    grpc_byte_buffer *in_flight = NULL;
    if (n == 0) { /* no message: the initial metadata alone */
        grpc_op op0;
        memset(&op0, 0, sizeof op0);
        op0.op = GRPC_OP_SEND_INITIAL_METADATA;
        op0.flags = c->wait_for_ready ? GRPC_INITIAL_METADATA_WAIT_FOR_READY : 0;
        kvdepot__initial_md(c, &op0);
        ok = kvdepot__call_batch(&k, &op0, 1, &tag_send) == 1;
    }
    for (size_t i = 0; ok && i < n; i++) {
        grpc_slice s = next(i, ctx);
        grpc_byte_buffer *bb = grpc_raw_byte_buffer_create(&s, 1);
        grpc_slice_unref(s);
        sent = send_next(c, &k, &in_flight, i == 0, bb);
        ok = sent == 1;
    }
    if (in_flight) {
        ok = kvdepot__call_wait(&k, &tag_send) == 1 && ok;
        grpc_byte_buffer_destroy(in_flight);
    }
    if (cancel && sent >= 0) {
        grpc_call_cancel(k.call, NULL);
    } else if (ok) {
        grpc_op op;
        memset(&op, 0, sizeof op);
        op.op = GRPC_OP_SEND_CLOSE_FROM_CLIENT;
        kvdepot__call_batch(&k, &op, 1, &tag_close);
    }
    kvdepot__call_wait(&k, &tag_recv);
    rc = kvdepot__call_result(&k);
    if (resp_bb) {
        grpc_byte_buffer_reader r;
        if (resp && grpc_byte_buffer_reader_init(&r, resp_bb)) {
            grpc_slice s = grpc_byte_buffer_reader_readall(&r);
            grpc_byte_buffer_reader_destroy(&r);
            size_t len = GRPC_SLICE_LENGTH(s);
            *resp = malloc(len ? len : 1);
            if (*resp) {
                memcpy(*resp, GRPC_SLICE_START_PTR(s), len);
                if (resp_len)
                    *resp_len = len;
            }
            grpc_slice_unref(s);
        }
        grpc_byte_buffer_destroy(resp_bb);
    }
    kvdepot__call_end(&k);
    return rc;
}

static grpc_slice copied_slice(size_t i, void *ctx)
{
    const kvdepot__raw_msg *msgs = ctx;
    return grpc_slice_from_copied_buffer(msgs[i].data, msgs[i].len);
}

int kvdepot__call_raw(kvdepot_client *c, const char *path, const kvdepot__raw_msg *msgs, size_t n,
                      int cancel, void **resp, size_t *resp_len)
{
    return call_slices(c, path, n, copied_slice, (void *)msgs, cancel, resp, resp_len);
}

typedef struct packed_msgs {
    kvdepot__msg_fn msg;
    void *ctx;
} packed_msgs;

/* Message i packed by protobuf-c straight into the slice that is sent. */
static grpc_slice packed_slice(size_t i, void *ctx)
{
    const packed_msgs *x = ctx;
    const ProtobufCMessage *m = x->msg(i, x->ctx);
    grpc_slice s = grpc_slice_malloc_large(protobuf_c_message_get_packed_size(m));
    protobuf_c_message_pack(m, GRPC_SLICE_START_PTR(s)); /* (gRPC aborts when out of memory) */
    return s;
}

int kvdepot__call_messages(kvdepot_client *c, const char *what, const char *path, size_t n,
                           kvdepot__msg_fn msg, void *ctx, const ProtobufCMessageDescriptor *rdesc,
                           ProtobufCMessage **resp)
{
    *resp = NULL;
    packed_msgs x = {msg, ctx};
    void *rb = NULL;
    size_t rlen = 0;
    int rc = call_slices(c, path, n, packed_slice, &x, 0, &rb, &rlen);
    if (rc == KVDEPOT_OK) {
        *resp = protobuf_c_message_unpack(rdesc, NULL, rlen, rb);
        if (!*resp)
            rc = kvdepot__fail(c, KVDEPOT_EINTERNAL, "%s: malformed response", what);
    }
    free(rb);
    return rc;
}

/* The bytes of a received message, malloc'd (caller frees); NULL on ENOMEM. */
static uint8_t *bb_bytes(grpc_byte_buffer *bb, size_t *len)
{
    grpc_byte_buffer_reader r;
    *len = 0;
    if (!grpc_byte_buffer_reader_init(&r, bb))
        return NULL;
    grpc_slice s = grpc_byte_buffer_reader_readall(&r);
    grpc_byte_buffer_reader_destroy(&r);
    *len = GRPC_SLICE_LENGTH(s);
    uint8_t *p = malloc(*len ? *len : 1);
    if (p)
        memcpy(p, GRPC_SLICE_START_PTR(s), *len);
    grpc_slice_unref(s);
    return p;
}

static void sink_copy(void *user, const uint8_t *p, size_t n)
{
    uint8_t **dst = user;
    memcpy(*dst, p, n);
    *dst += n;
}

typedef struct page_msg {
    kvdepot_client *c;
    uint8_t *page; /* malloc'd */
    size_t len;
} page_msg;

/* One field of a page-format Read's data message: the page (2) is copied
 * once from the transport's slices; a header (1) is refused. A page given
 * twice keeps the last, as protobuf's merge does. */
static int page_field(void *user, bb_cursor *cu, uint32_t field, uint64_t len)
{
    page_msg *m = user;
    if (field == 1)
        return kvdepot__fail(m->c, KVDEPOT_EINTERNAL, "read pages: message without one page");
    if (field != 2)
        return FIELD_SKIP;
    uint8_t *d = len <= SIZE_MAX ? malloc(len ? (size_t)len : 1) : NULL, *at = d;
    if (!d)
        return kvdepot__fail(m->c, KVDEPOT_ENOMEM, "read pages: out of memory");
    if (cur_take(cu, len, sink_copy, &at) != 0) {
        free(d);
        return kvdepot__fail(m->c, KVDEPOT_EINTERNAL, "read pages: truncated page");
    }
    free(m->page);
    m->page = d;
    m->len = (size_t)len;
    return KVDEPOT_OK;
}

/* The page of a page-format Read's data message, in *page (malloc'd). 0 or
 * a status with the error set. */
static int page_data(kvdepot_client *c, grpc_byte_buffer *bb, uint8_t **page, size_t *page_len)
{
    page_msg m = {c, NULL, 0};
    int rc = walk_message(c, bb, "read pages", page_field, &m);
    if (rc == KVDEPOT_OK && m.len == 0)
        rc = kvdepot__fail(c, KVDEPOT_EINTERNAL, "read pages: message without one page");
    if (rc != KVDEPOT_OK) {
        free(m.page);
        m.page = NULL;
        m.len = 0;
    }
    *page = m.page;
    *page_len = m.len;
    return rc;
}

/* Keep one page message of a page-format Read. 0 or a status with the error set. */
static int pages_message(kvdepot_client *c, grpc_byte_buffer *bb, int first,
                         kvdepot_page **pages, size_t *count, size_t *cap)
{
    if (!first) {
        if (*count == *cap) {
            size_t ncap = *cap ? 2 * *cap : 16;
            kvdepot_page *np = realloc(*pages, ncap * sizeof *np);
            if (!np)
                return kvdepot__fail(c, KVDEPOT_ENOMEM, "read pages: out of memory");
            *pages = np;
            *cap = ncap;
        }
        uint8_t *d;
        size_t len;
        int rc = page_data(c, bb, &d, &len);
        if (rc == KVDEPOT_OK) {
            (*pages)[*count].data = d;
            (*pages)[*count].len = len;
            (*count)++;
        }
        return rc;
    }
    size_t len;
    uint8_t *raw = bb_bytes(bb, &len);
    if (!raw)
        return kvdepot__fail(c, KVDEPOT_ENOMEM, "read pages: out of memory");
    Kvdepot__V1__ReadResponse *r = kvdepot__v1__read_response__unpack(NULL, len, raw);
    free(raw);
    if (!r)
        return kvdepot__fail(c, KVDEPOT_EINTERNAL, "read pages: malformed response");
    int rc = KVDEPOT_OK;
    if (!r->header || r->header->format != KVDEPOT__V1__READ_FORMAT__READ_FORMAT_PAGES)
        rc = kvdepot__fail(c, KVDEPOT_EINTERNAL, "read pages: no page-format header");
    kvdepot__v1__read_response__free_unpacked(r, NULL);
    return rc;
}

int kvdepot_sequence_read_pages(kvdepot_client *c, const kvdepot_read_args *a,
                                kvdepot_page **pages, size_t *count)
{
    kvdepot__clear_error();
    if (pages)
        *pages = NULL;
    if (count)
        *count = 0;
    if (!c || !a || !pages || !count || (!a->id && a->id_len))
        return kvdepot__fail(c, KVDEPOT_EINVAL, "read pages: NULL argument");
    if (c->cluster)
        return kvdepot__cluster_read_pages(c, a, pages, count);
    Kvdepot__V1__ReadRequest req = KVDEPOT__V1__READ_REQUEST__INIT;
    req.sequence_id.data = (uint8_t *)a->id;
    req.sequence_id.len = a->id_len;
    req.layer_start = a->layer_start;
    req.num_layers = a->num_layers;
    req.token_start = a->token_start;
    req.num_tokens = a->num_tokens;
    req.format = KVDEPOT__V1__READ_FORMAT__READ_FORMAT_PAGES;
    /* Activation-first reads are decoded only: the server says so. */
    req.activation_tokens = a->activation_tokens;

    kvdepot__call k;
    int rc = kvdepot__call_start(c, KVDEPOT__READ, NULL, &k);
    if (rc) {
        kvdepot__call_end(&k);
        return rc;
    }
    grpc_byte_buffer *send = kvdepot__pack(&req.base);
    int ok = kvdepot__call_send_request(&k, send, &tag_send);
    grpc_byte_buffer_destroy(send);

    kvdepot_page *got = NULL;
    size_t n = 0, cap = 0, msgs = 0;
    int local = KVDEPOT_OK;
    if (ok < 0)
        local = kvdepot__fail(c, KVDEPOT_EINTERNAL, "read pages: gRPC refused the call");
    while (ok == 1 && local == KVDEPOT_OK) {
        grpc_byte_buffer *bb = kvdepot__call_recv(&k, &tag_recv);
        if (!bb)
            break; /* end of stream or failure: the status tells */
        local = pages_message(c, bb, msgs++ == 0, &got, &n, &cap);
        grpc_byte_buffer_destroy(bb);
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
    if (local != KVDEPOT_OK)
        rc = local;
    else if ((rc = kvdepot__call_result(&k)) == KVDEPOT_OK && msgs == 0)
        rc = kvdepot__fail(c, KVDEPOT_EINTERNAL, "read pages: server sent no header");
    kvdepot__call_end(&k);
    if (rc != KVDEPOT_OK) {
        kvdepot_pages_free(got, n);
        return rc;
    }
    *pages = got;
    *count = n;
    return KVDEPOT_OK;
}
