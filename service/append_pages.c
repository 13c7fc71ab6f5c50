/*
 * AppendPages: client-streamed pages the client encoded (kvdepot.proto). The
 * pages are collected as they arrive (bounded by max-append-bytes, and
 * charged to append-memory-bytes with the appends in flight), in the
 * unpacked messages that carry them (no copy of their own); when the stream
 * ends, service/compute checks them as a whole and appends them in one
 * transaction (kvd_compute_append_pages).
 */
#include <stdlib.h>
#include <string.h>

#include "convert.h"
#include "rpc.h"

typedef struct pages_state {
    Kvdepot__V1__AppendPagesRequest **msgs; /* every message received (owned) */
    size_t nmsg, capmsg;
    kvd_page_in *pages; /* their bytes lie in msgs */
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
    for (size_t i = 0; i < st->nmsg; i++)
        protobuf_c_message_free_unpacked(&st->msgs[i]->base, NULL);
    kvd_store_append_memory_give(st->store, st->charged);
    free(st->msgs);
    free(st->pages);
    free(st);
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
    Kvdepot__V1__AppendPagesRequest *m = (Kvdepot__V1__AppendPagesRequest *)kvd_bb_unpack(
        &kvdepot__v1__append_pages_request__descriptor, msg, err);
    if (!m)
        return err && err->code
                   ? err->code
                   : kvd_error_set(err, KVD_EINVAL,
                                   "message %zu does not parse as AppendPagesRequest", st->n);
    if (st->nmsg == st->capmsg) {
        size_t nc = st->capmsg ? 2 * st->capmsg : 16;
        Kvdepot__V1__AppendPagesRequest **nm = realloc(st->msgs, nc * sizeof *nm);
        if (!nm) {
            protobuf_c_message_free_unpacked(&m->base, NULL);
            return kvd_error_set(err, KVD_ENOMEM, "out of memory");
        }
        st->msgs = nm;
        st->capmsg = nc;
    }
    st->msgs[st->nmsg++] = m; /* freed with the state */
    if (st->nmsg == 1 && !m->header)
        return kvd_error_set(err, KVD_EINVAL, "the first message carries no header");
    if (st->nmsg > 1 && m->header)
        return kvd_error_set(err, KVD_EINVAL, "header repeated after the first message");
    /* the pages are held until the stream ends: within what calls in
     * flight may hold together */
    uint64_t held = 0;
    for (size_t i = 0; i < m->n_pages; i++)
        held += m->pages[i].len;
    int rc = kvd_store_append_memory_take(st->store, held, err);
    if (rc)
        return rc;
    st->charged += held;
    for (size_t i = 0; rc == 0 && i < m->n_pages; i++) {
        st->bytes += m->pages[i].len;
        if (st->bytes > ctx->svc->cfg->max_append_bytes) {
            rc = kvd_error_set(err, KVD_ENOMEM, "pages exceed max-append-bytes (%llu)",
                               (unsigned long long)ctx->svc->cfg->max_append_bytes);
            break;
        }
        if (st->n == st->cap) {
            size_t nc = st->cap ? 2 * st->cap : 16;
            kvd_page_in *np = realloc(st->pages, nc * sizeof *np);
            if (!np) {
                rc = kvd_error_set(err, KVD_ENOMEM, "out of memory");
                break;
            }
            st->pages = np;
            st->cap = nc;
        }
        /* an empty page (no data) is refused with the others, never read */
        static const uint8_t none[1];
        st->pages[st->n++] =
            (kvd_page_in){m->pages[i].data ? m->pages[i].data : none, m->pages[i].len};
    }
    return rc;
}

static int pages_finish(kvd_req_ctx *ctx, void **state, grpc_byte_buffer **reply,
                        kvd_error *err)
{
    pages_state *st = *state;
    if (!st || !st->nmsg || !st->msgs[0]->header)
        return kvd_error_set(err, KVD_EINVAL, "empty AppendPages stream");
    const Kvdepot__V1__AppendPagesHeader *h = st->msgs[0]->header;
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
