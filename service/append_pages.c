/*
 * AppendPages: client-streamed pages the client encoded (kvdepot.proto). The
 * pages are collected as they arrive (bounded by max-append-bytes, and
 * charged to append-memory-bytes with the appends in flight); when the
 * stream ends, service/compute checks them as a whole and appends them in
 * one transaction (kvd_compute_append_pages).
 *
 * A message is read into one buffer of its own (one copy out of the
 * transport's slices) and scanned at the wire level: its pages are used
 * where they lie in it, and only its header goes through protobuf-c.
 * Messages a standard encoder would not produce (a header given twice, a
 * group, a field of the wrong wire type) are unpacked by protobuf-c whole,
 * which applies the protobuf rules.
 */
#include <stdlib.h>
#include <string.h>

#include <grpc/byte_buffer_reader.h>

#include "convert.h"
#include "rpc.h"

typedef struct pages_state {
    Kvdepot__V1__AppendPagesHeader *hdr; /* the first message's (owned) */
    grpc_slice *bufs; /* every message received, as read (the pages lie in them) */
    size_t nbuf, capbuf;
    Kvdepot__V1__AppendPagesRequest **msgs; /* those unpacked whole (owned) */
    size_t nmsg, capmsg;
    size_t received;    /* messages */
    kvd_page_in *pages; /* their bytes lie in bufs or msgs */
    size_t n, cap;
    uint64_t bytes;
    kvd_store *store; /* charged with the pages' bytes (append-memory-bytes) */
    uint64_t charged;
} pages_state;

static void pages_release(void *state)
{
    pages_state *st = state;
    if (!st)
        return;
    if (st->hdr)
        kvdepot__v1__append_pages_header__free_unpacked(st->hdr, NULL);
    for (size_t i = 0; i < st->nbuf; i++)
        grpc_slice_unref(st->bufs[i]);
    for (size_t i = 0; i < st->nmsg; i++)
        protobuf_c_message_free_unpacked(&st->msgs[i]->base, NULL);
    kvd_store_append_memory_give(st->store, st->charged);
    free(st->bufs);
    free(st->msgs);
    free(st->pages);
    free(st);
}

/* Room for one more element in *arr (of *cap, *n used); 0 or -1. */
static int grow(void **arr, size_t *cap, size_t n, size_t size)
{
    if (n < *cap)
        return 0;
    size_t nc = *cap ? 2 * *cap : 16;
    void *na = realloc(*arr, nc * size);
    if (!na)
        return -1;
    *arr = na;
    *cap = nc;
    return 0;
}

/* One page of the message at hand: checked against max-append-bytes and
 * kept (its bytes stay where they are). */
static int add_page(kvd_req_ctx *ctx, pages_state *st, const uint8_t *p, size_t len, kvd_error *err)
{
    st->bytes += len;
    if (st->bytes > ctx->svc->cfg->max_append_bytes)
        return kvd_error_set(err, KVD_ENOMEM, "pages exceed max-append-bytes (%llu)",
                             (unsigned long long)ctx->svc->cfg->max_append_bytes);
    if (grow((void **)&st->pages, &st->cap, st->n, sizeof *st->pages))
        return kvd_error_set(err, KVD_ENOMEM, "out of memory");
    /* an empty page (no data) is refused with the others, never read */
    static const uint8_t none[1];
    st->pages[st->n++] = (kvd_page_in){len ? p : none, len};
    return 0;
}

/* The fields of an AppendPagesRequest in p[0, n): its header's bytes (*hdr
 * NULL when it has none) and the bytes of its pages. 0 when protobuf-c must
 * decide instead (see the top of the file). */
static int scan(const uint8_t *p, size_t n, const uint8_t **hdr, size_t *hlen, uint64_t *pbytes)
{
    *hdr = NULL;
    *hlen = 0;
    *pbytes = 0;
    size_t i = 0;
    while (i < n) {
        uint64_t tag, v;
        if (!kvd_wire_varint(p, n, &i, &tag))
            return 0;
        const uint64_t field = tag >> 3;
        switch (tag & 7) {
        case 0:
            if (field == 1 || field == 2 || !kvd_wire_varint(p, n, &i, &v))
                return 0;
            continue;
        case 1:
        case 5:
            if (field == 1 || field == 2 || n - i < ((tag & 7) == 1 ? 8u : 4u))
                return 0;
            i += (tag & 7) == 1 ? 8 : 4;
            continue;
        case 2:
            if (!kvd_wire_varint(p, n, &i, &v) || v > n - i)
                return 0;
            break;
        default:
            return 0;
        }
        if (field == 1) {
            if (*hdr)
                return 0; /* given twice: merged, as protobuf does */
            *hdr = p + i;
            *hlen = (size_t)v;
        } else if (field == 2) {
            *pbytes += v;
        }
        i += (size_t)v;
    }
    return 1;
}

/* A message protobuf-c unpacks whole; its pages stay in it. */
static int recv_unpacked(kvd_req_ctx *ctx, pages_state *st, const uint8_t *p, size_t n,
                         kvd_error *err)
{
    Kvdepot__V1__AppendPagesRequest *m = (Kvdepot__V1__AppendPagesRequest *)kvd_unpack(
        &kvdepot__v1__append_pages_request__descriptor, p, n, "", err);
    if (!m)
        return err && err->code ? err->code
                                : kvd_error_set(err, KVD_EINVAL,
                                                "message %zu does not parse as AppendPagesRequest",
                                                st->received);
    if (grow((void **)&st->msgs, &st->capmsg, st->nmsg, sizeof *st->msgs)) {
        protobuf_c_message_free_unpacked(&m->base, NULL);
        return kvd_error_set(err, KVD_ENOMEM, "out of memory");
    }
    st->msgs[st->nmsg++] = m; /* freed with the state */
    if (st->received == 1 && m->header) {
        st->hdr = m->header; /* now the state's */
        m->header = NULL;
    } else if (m->header) {
        return kvd_error_set(err, KVD_EINVAL, "header repeated after the first message");
    }
    if (!st->hdr)
        return kvd_error_set(err, KVD_EINVAL, "the first message carries no header");
    uint64_t held = 0;
    for (size_t i = 0; i < m->n_pages; i++)
        held += m->pages[i].len;
    int rc = kvd_store_append_memory_take(st->store, held, err);
    if (rc)
        return rc;
    st->charged += held;
    for (size_t i = 0; rc == 0 && i < m->n_pages; i++)
        rc = add_page(ctx, st, m->pages[i].data, m->pages[i].len, err);
    return rc;
}

static int pages_recv(kvd_req_ctx *ctx, void **state, grpc_byte_buffer *msg, kvd_error *err)
{
    pages_state *st = *state;
    if (!st) {
        st = calloc(1, sizeof *st);
        if (!st)
            return kvd_error_set(err, KVD_ENOMEM, "out of memory");
        st->store = ctx->svc->store;
        *state = st;
    }
    kvd_error_clear(err);
    st->received++;
    grpc_byte_buffer_reader rd;
    if (!grpc_byte_buffer_reader_init(&rd, msg))
        return kvd_error_set(err, KVD_EINVAL, "message %zu cannot be read (decompression failed)",
                             st->received);
    /* one copy, of exactly the message: the state holds it to the end */
    grpc_slice s = grpc_byte_buffer_reader_readall(&rd);
    grpc_byte_buffer_reader_destroy(&rd);
    if (grow((void **)&st->bufs, &st->capbuf, st->nbuf, sizeof *st->bufs)) {
        grpc_slice_unref(s);
        return kvd_error_set(err, KVD_ENOMEM, "out of memory");
    }
    st->bufs[st->nbuf++] = s;
    const uint8_t *p = GRPC_SLICE_START_PTR(s), *hp;
    const size_t n = GRPC_SLICE_LENGTH(s);
    size_t hlen;
    uint64_t held;
    if (!scan(p, n, &hp, &hlen, &held))
        return recv_unpacked(ctx, st, p, n, err);
    if (hp && st->received > 1)
        return kvd_error_set(err, KVD_EINVAL, "header repeated after the first message");
    if (hp) {
        st->hdr = (Kvdepot__V1__AppendPagesHeader *)kvd_unpack(
            &kvdepot__v1__append_pages_header__descriptor, hp, hlen, "header", err);
        if (!st->hdr)
            return err && err->code ? err->code
                                    : kvd_error_set(err, KVD_EINVAL,
                                                    "message 1 does not parse as "
                                                    "AppendPagesRequest (its header)");
    }
    if (!st->hdr)
        return kvd_error_set(err, KVD_EINVAL, "the first message carries no header");
    /* the pages are held until the stream ends: within what calls in
     * flight may hold together */
    int rc = kvd_store_append_memory_take(st->store, held, err);
    if (rc)
        return rc;
    st->charged += held;
    for (size_t i = 0; rc == 0 && i < n;) { /* the pages, as scan found them */
        uint64_t tag, v;
        kvd_wire_varint(p, n, &i, &tag);
        if ((tag & 7) != 2) { /* (scan checked every field) */
            uint64_t skip;
            if ((tag & 7) == 0)
                kvd_wire_varint(p, n, &i, &skip);
            else
                i += (tag & 7) == 1 ? 8 : 4;
            continue;
        }
        kvd_wire_varint(p, n, &i, &v);
        if (tag >> 3 == 2)
            rc = add_page(ctx, st, p + i, (size_t)v, err);
        i += (size_t)v;
    }
    return rc;
}

static int pages_finish(kvd_req_ctx *ctx, void **state, grpc_byte_buffer **reply,
                        kvd_error *err)
{
    pages_state *st = *state;
    if (!st || !st->hdr)
        return kvd_error_set(err, KVD_EINVAL, "empty AppendPages stream");
    const Kvdepot__V1__AppendPagesHeader *h = st->hdr;
    kvd_seq_key key;
    int rc = kvd_ctx_seq_key(ctx, &h->sequence_id, "header.sequence_id", &key, err);
    if (rc)
        return rc;
    kvd_seq_info was; /* with header.create: the sequence as this call made it */
    memset(&was, 0, sizeof was);
    int made = 0;
    if (h->create &&
        (rc = kvd_ctx_stat_or_create(ctx, h->create, &h->sequence_id, &key, &was, &made, err)))
        return rc;
    kvd_pages_args a = {key.id,       key.len,        st->pages,       st->n,
                        h->token_ids, h->n_token_ids, h->block_hashes, h->n_block_hashes};
    kvd_compute_guard g;
    kvd_compute c;
    kvd_ctx_compute(ctx, &g, &c);
    kvd_seq_info info;
    rc = kvd_compute_append_pages(&c, &a, &info, err);
    if (made) { /* refused pages leave no sequence behind */
        kvd_error e;
        kvd_error_clear(&e);
        if (rc && kvd_undo_create_sequence(ctx->svc, ctx->auth, &key, &was, &e))
            KVD_LOG(KVD_LOG_WARN, "the sequence a failed AppendPages created was kept", "reason=%s",
                    e.msg);
        kvd_store_seq_pending_done(ctx->svc->store, key.id, key.len);
    }
    kvd_seq_info_clear(&was);
    if (rc)
        return rc;
    Kvdepot__V1__SequenceInfo si;
    kvd_seq_info_to_pb(&info, &si);
    kvd_codecs_pb cp;
    kvd_error cerr; /* stored already: an unreadable codec record leaves them out */
    kvd_seq_info_codecs_pb(ctx->svc->store, &info, 1, &si, &cp, &cerr);
    kvd_ctx_seq_wire(ctx, &si.sequence_id);
    Kvdepot__V1__AppendPagesResponse resp = KVDEPOT__V1__APPEND_PAGES_RESPONSE__INIT;
    resp.sequence = &si;
    resp.pages_received = st->n;
    resp.bytes_received = st->bytes;
    resp.created = made;
    *reply = kvd_pack(&resp.base);
    if (!*reply)
        rc = kvd_error_set(err, KVD_ENOMEM, "out of memory packing the reply");
    kvd_codecs_pb_clear(&cp);
    kvd_seq_info_clear(&info);
    return rc;
}

const kvd_stream_ops kvd_append_pages_ops = {
    .recv = pages_recv,
    .finish = pages_finish,
    .release = pages_release,
};
