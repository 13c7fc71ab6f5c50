/*
 * Append: client-streaming K/V upload into one store append transaction.
 *
 * The first message must carry the header; the store then says exactly how
 * many data bytes the stream must carry. Data is fed to the store straight
 * from the received gRPC slices: AppendRequest is scanned at the wire level
 * (tag, length) so the payload is never copied into an unpacked message
 * first. Messages a standard encoder would not produce (a field repeated, a
 * group) take the slow path through protobuf-c, which merges them as the
 * protobuf rules say. Any error aborts the transaction, so the sequence is
 * left as it was.
 */
#include <stdlib.h>
#include <string.h>

#include <grpc/byte_buffer_reader.h>
#include <grpc/slice.h>

#include "convert.h"
#include "metrics.h"
#include "rpc.h"
#include "validate.h"

typedef struct append_state {
    kvd_append *ap;
    /* Kept until the append ends: the store spec points into it. */
    Kvdepot__V1__AppendHeader *hdr;
    kvd_seq_key key;
    uint64_t expected, received;
    uint64_t messages;
    /* Quota reserved at the header: `expected` bytes and the `index_bound`
     * bytes of PQ centroids it may train against the tenants of `model`,
     * given back unless the append commits (the untrained part then). */
    uint64_t index_bound;
    kvd_auth *quota;
    char model[KVD_MODEL_NAME_MAX + 1];
    int reserved, committed;
    uint64_t old_stored_bytes, old_sealed_pages;
    /* header.create made the sequence (`created`, as it was then): deleted
     * again unless the append commits. The service and tokens table it was
     * made under, for undoing it when the stream ends without a context. */
    int made;
    kvd_seq_info created;
    kvd_service *svc;
    kvd_auth *made_auth;
} append_state;

/* ---- wire-level scan of one AppendRequest -------------------------------- */

typedef struct cursor {
    const grpc_slice *s;
    size_t n;   /* slices */
    size_t i;   /* current slice */
    size_t off; /* offset in it */
} cursor;

typedef struct span {
    size_t i, off; /* where it starts */
    uint64_t len;
    int present;
} span;

static int cur_getc(cursor *c, uint8_t *b)
{
    while (c->i < c->n && c->off >= GRPC_SLICE_LENGTH(c->s[c->i])) {
        c->i++;
        c->off = 0;
    }
    if (c->i >= c->n)
        return -1;
    *b = GRPC_SLICE_START_PTR(c->s[c->i])[c->off++];
    return 0;
}

static int cur_at_end(cursor *c)
{
    while (c->i < c->n && c->off >= GRPC_SLICE_LENGTH(c->s[c->i])) {
        c->i++;
        c->off = 0;
    }
    return c->i >= c->n;
}

static int cur_varint(cursor *c, uint64_t *v)
{
    uint64_t r = 0;
    for (unsigned shift = 0; shift < 64; shift += 7) {
        uint8_t b;
        if (cur_getc(c, &b))
            return -1;
        r |= (uint64_t)(b & 0x7f) << shift;
        if (!(b & 0x80)) {
            *v = r;
            return 0;
        }
    }
    return -1;
}

static int cur_skip(cursor *c, uint64_t len)
{
    while (len) {
        if (c->i >= c->n)
            return -1;
        size_t avail = GRPC_SLICE_LENGTH(c->s[c->i]) - c->off;
        if (avail == 0) {
            c->i++;
            c->off = 0;
            continue;
        }
        size_t take = len < avail ? (size_t)len : avail;
        c->off += take;
        len -= take;
    }
    return 0;
}

enum scan_result { SCAN_OK, SCAN_SLOW, SCAN_BAD };

/* Find the header (field 1) and data (field 2) of an AppendRequest. */
static enum scan_result scan_append(const grpc_slice *s, size_t n, span *hdr, span *data)
{
    cursor c = {s, n, 0, 0};
    memset(hdr, 0, sizeof *hdr);
    memset(data, 0, sizeof *data);
    while (!cur_at_end(&c)) {
        uint64_t tag, v;
        if (cur_varint(&c, &tag))
            return SCAN_BAD;
        uint64_t field = tag >> 3;
        unsigned wt = (unsigned)(tag & 7);
        if (field == 0 || field > 0x1fffffff)
            return SCAN_BAD;
        switch (wt) {
        case 0:
            if (cur_varint(&c, &v))
                return SCAN_BAD;
            break;
        case 1:
            if (cur_skip(&c, 8))
                return SCAN_BAD;
            break;
        case 5:
            if (cur_skip(&c, 4))
                return SCAN_BAD;
            break;
        case 2: {
            if (cur_varint(&c, &v))
                return SCAN_BAD;
            span *sp = field == 1 ? hdr : field == 2 ? data : NULL;
            if (sp) {
                if (sp->present)
                    return SCAN_SLOW;
                cur_at_end(&c); /* normalise the position onto a non-empty slice */
                sp->present = 1;
                sp->i = c.i;
                sp->off = c.off;
                sp->len = v;
            }
            if (cur_skip(&c, v))
                return SCAN_BAD;
            break;
        }
        default: /* groups and invalid wire types */
            return SCAN_SLOW;
        }
        if ((field == 1 || field == 2) && wt != 2)
            return SCAN_BAD;
    }
    return SCAN_OK;
}

/* Call fn on each contiguous piece of a span. */
static int span_each(const grpc_slice *s, const span *sp,
                     int (*fn)(void *arg, const uint8_t *p, size_t len, kvd_error *err),
                     void *arg, kvd_error *err)
{
    size_t i = sp->i, off = sp->off;
    uint64_t left = sp->len;
    while (left) {
        size_t avail = GRPC_SLICE_LENGTH(s[i]) - off;
        size_t take = left < avail ? (size_t)left : avail;
        if (take) {
            int rc = fn(arg, GRPC_SLICE_START_PTR(s[i]) + off, take, err);
            if (rc)
                return rc;
        }
        left -= take;
        i++;
        off = 0;
    }
    return 0;
}

static int copy_piece(void *arg, const uint8_t *p, size_t len, kvd_error *err)
{
    (void)err;
    uint8_t **dst = arg;
    memcpy(*dst, p, len);
    *dst += len;
    return 0;
}

static int write_piece(void *arg, const uint8_t *p, size_t len, kvd_error *err)
{
    return kvd_store_append_write(arg, p, len, err);
}

/* ---- the handler ------------------------------------------------------- */

/* The sequence of an Append with header.create (kvd_ctx_stat_or_create);
 * one it made is kept in st, to be undone unless the append commits. */
static int stat_or_create(kvd_req_ctx *ctx, append_state *st, const Kvdepot__V1__AppendHeader *h,
                          kvd_seq_info *info, kvd_error *err)
{
    int rc =
        kvd_ctx_stat_or_create(ctx, h->create, &h->sequence_id, &st->key, info, &st->made, err);
    if (rc == 0 && st->made) {
        st->svc = ctx->svc;
        if (ctx->auth) {
            kvd_auth_ref(ctx->auth);
            st->made_auth = ctx->auth;
        }
    }
    return rc;
}

/* A sequence this Append created goes again when the append fails. */
static void undo_create(append_state *st)
{
    if (!st->made || st->committed)
        return;
    st->made = 0;
    kvd_error e;
    kvd_error_clear(&e);
    if (kvd_undo_create_sequence(st->svc, st->made_auth, &st->key, &st->created, &e))
        KVD_LOG(KVD_LOG_WARN, "the sequence a failed Append created was kept", "reason=%s", e.msg);
    kvd_store_seq_pending_done(st->svc->store, st->key.id, st->key.len);
}

static int begin(kvd_req_ctx *ctx, append_state *st, Kvdepot__V1__AppendHeader *h,
                 kvd_error *err)
{
    int rc;
    if ((rc = kvd_ctx_seq_key(ctx, &h->sequence_id, "header.sequence_id", &st->key, err)) ||
        (rc = kvd_check_dtype(h->dtype, "header.dtype", err)))
        return rc;
    if (h->num_tokens == 0)
        return kvd_error_set(err, KVD_EINVAL, "header.num_tokens: must be at least 1");
    if ((rc = kvd_check_range(h->token_start, h->num_tokens, 64, "header.token_start",
                              "header.num_tokens", err)) ||
        (rc = kvd_check_range(h->layer_start, h->num_layers, 32, "header.layer_start",
                              "header.num_layers", err)))
        return rc;
    if (h->n_token_ids && h->n_token_ids != h->num_tokens)
        return kvd_error_set(err, KVD_EINVAL,
                             "header.token_ids: %zu ids for %llu tokens (give all or none)",
                             h->n_token_ids, (unsigned long long)h->num_tokens);
    if (h->n_engine_block_hashes && h->n_block_hashes)
        return kvd_error_set(err, KVD_EINVAL,
                             "header: block_hashes and engine_block_hashes are exclusive");
    uint64_t *engine = NULL; /* page hashes from engine block hashes */
    size_t n_engine = 0;
    if (h->n_engine_block_hashes || h->engine_block_tokens) {
        const uint32_t bt = h->engine_block_tokens;
        const uint64_t end = h->token_start + h->num_tokens;
        if (bt && h->n_engine_block_hashes != end / bt - h->token_start / bt)
            return kvd_error_set(err, KVD_EINVAL,
                                 "header.engine_block_hashes: %zu given; tokens [%llu, %llu) end "
                                 "%llu blocks of %u tokens",
                                 h->n_engine_block_hashes, (unsigned long long)h->token_start,
                                 (unsigned long long)end,
                                 (unsigned long long)(end / bt - h->token_start / bt), bt);
        if ((rc = kvd_ctx_engine_pages(ctx, h->engine_block_hashes, h->n_engine_block_hashes, bt,
                                       bt ? h->token_start / bt : 0, "header.engine_block_hashes",
                                       &engine, &n_engine, err)))
            return rc;
    }
    kvd_append_spec spec = {
        .seq_id = st->key.id,
        .seq_id_len = st->key.len,
        .layer_start = h->layer_start,
        .num_layers = h->num_layers,
        .token_start = h->token_start,
        .num_tokens = h->num_tokens,
        .dtype = (kvd_dtype)h->dtype,
        .token_ids = h->n_token_ids ? h->token_ids : NULL,
        .n_token_ids = h->n_token_ids,
        .block_hashes = h->n_block_hashes ? h->block_hashes : engine,
        .n_block_hashes = h->n_block_hashes ? h->n_block_hashes : n_engine,
        .with_activations = h->with_activations,
    };
    /* The sequence's model decides the namespace check and whose quota the
     * bytes count against; its current size gives the gauges' deltas. */
    kvd_seq_info info;
    memset(&info, 0, sizeof info);
    rc = h->create ? stat_or_create(ctx, st, h, &info, err)
                   : kvd_store_seq_stat(ctx->svc->store, st->key.id, st->key.len, &info, err);
    if (rc) {
        free(engine);
        return rc;
    }
    snprintf(st->model, sizeof st->model, "%s", info.model);
    st->old_stored_bytes = info.stored_bytes;
    st->old_sealed_pages = info.sealed_pages;
    if (st->made)
        st->created = info; /* kept to undo the create */
    else
        kvd_seq_info_clear(&info);
    if ((rc = kvd_ctx_check_model(ctx, st->model, err))) {
        free(engine);
        return rc;
    }
    kvd_append *ap = NULL;
    uint64_t expected = 0;
    rc = kvd_store_append_begin(ctx->svc->store, &spec, &ap, &expected, err);
    free(engine); /* the append keeps its own copy */
    if (rc)
        return rc;
    uint64_t limit = ctx->svc->cfg->max_append_bytes;
    if (expected > limit) {
        kvd_store_append_abort(ap);
        return kvd_error_set(err, KVD_ENOMEM,
                             "header: append of %llu bytes exceeds max-append-bytes (%llu); "
                             "split it into several appends",
                             (unsigned long long)expected, (unsigned long long)limit);
    }
    /* the quota counts the payload and the PQ centroids the append may train */
    st->index_bound = kvd_store_append_index_bound(ap);
    if ((rc = kvd_ctx_quota_reserve(ctx, st->model, 0, expected + st->index_bound, err))) {
        kvd_store_append_abort(ap);
        return rc;
    }
    if (ctx->auth) {
        kvd_auth_ref(ctx->auth);
        st->quota = ctx->auth;
        st->reserved = 1;
    }
    st->ap = ap;
    st->hdr = h;
    st->expected = expected;
    return 0;
}

static int check_header_order(append_state *st, int has_header, kvd_error *err)
{
    if (has_header && st->messages > 0)
        return kvd_error_set(err, KVD_EINVAL,
                             "header: only the first message of an Append may carry it "
                             "(message %llu does)",
                             (unsigned long long)st->messages + 1);
    if (!has_header && st->messages == 0)
        return kvd_error_set(err, KVD_EINVAL, "header: missing from the first Append message");
    return 0;
}

static int check_room(append_state *st, uint64_t len, kvd_error *err)
{
    if (len > st->expected - st->received)
        return kvd_error_set(err, KVD_EINVAL,
                             "data: stream carries more than the %llu bytes the header "
                             "implies (%llu received, %llu more in this message)",
                             (unsigned long long)st->expected,
                             (unsigned long long)st->received, (unsigned long long)len);
    return 0;
}

/* The slow path: a full protobuf-c decode with its merge rules. */
static int recv_slow(kvd_req_ctx *ctx, append_state *st, grpc_byte_buffer *msg, kvd_error *err)
{
    kvd_error_clear(err);
    Kvdepot__V1__AppendRequest *req = (Kvdepot__V1__AppendRequest *)kvd_bb_unpack(
        &kvdepot__v1__append_request__descriptor, msg, err);
    if (!req)
        return err && err->code
                   ? err->code
                   : kvd_error_set(err, KVD_EINVAL, "AppendRequest: message %llu does not parse",
                                   (unsigned long long)st->messages + 1);
    int rc = check_header_order(st, req->header != NULL, err);
    if (!rc && req->header) {
        rc = begin(ctx, st, req->header, err);
        if (!rc)
            req->header = NULL; /* now owned by st */
    }
    if (!rc && req->data.len && !(rc = check_room(st, req->data.len, err))) {
        rc = kvd_store_append_write(st->ap, req->data.data, req->data.len, err);
        if (!rc)
            st->received += req->data.len;
    }
    if (!rc)
        st->messages++;
    kvdepot__v1__append_request__free_unpacked(req, NULL);
    return rc;
}

static int recv_one(kvd_req_ctx *ctx, void **state, grpc_byte_buffer *msg, kvd_error *err)
{
    append_state *st = *state;
    if (!st) {
        st = calloc(1, sizeof *st);
        if (!st)
            return kvd_error_set(err, KVD_ENOMEM, "out of memory");
        *state = st;
    }
    if (msg->type != GRPC_BB_RAW || msg->data.raw.compression != GRPC_COMPRESS_NONE)
        return recv_slow(ctx, st, msg, err);
    const grpc_slice *s = msg->data.raw.slice_buffer.slices;
    size_t n = msg->data.raw.slice_buffer.count;
    span hs, ds;
    switch (scan_append(s, n, &hs, &ds)) {
    case SCAN_BAD:
        return kvd_error_set(err, KVD_EINVAL, "AppendRequest: message %llu does not parse",
                             (unsigned long long)st->messages + 1);
    case SCAN_SLOW:
        return recv_slow(ctx, st, msg, err);
    case SCAN_OK:
        break;
    }
    int rc = check_header_order(st, hs.present, err);
    if (rc)
        return rc;
    if (hs.present) {
        uint8_t *buf = malloc(hs.len ? hs.len : 1), *p = buf;
        if (!buf)
            return kvd_error_set(err, KVD_ENOMEM, "out of memory");
        span_each(s, &hs, copy_piece, &p, err);
        Kvdepot__V1__AppendHeader *h = kvdepot__v1__append_header__unpack(NULL, hs.len, buf);
        free(buf);
        if (!h)
            return kvd_error_set(err, KVD_EINVAL, "header: does not parse");
        if ((rc = begin(ctx, st, h, err))) {
            kvdepot__v1__append_header__free_unpacked(h, NULL);
            return rc;
        }
    }
    if (ds.present && ds.len) {
        if ((rc = check_room(st, ds.len, err)) ||
            (rc = span_each(s, &ds, write_piece, st->ap, err)))
            return rc;
        st->received += ds.len;
    }
    st->messages++;
    return 0;
}

static int finish(kvd_req_ctx *ctx, void **state, grpc_byte_buffer **reply, kvd_error *err)
{
    append_state *st = *state;
    if (!st || !st->ap)
        return kvd_error_set(err, KVD_EINVAL, "header: the Append stream ended without one");
    if (st->received < st->expected)
        return kvd_error_set(err, KVD_EINVAL,
                             "data: stream ended after %llu of the %llu bytes the header "
                             "implies",
                             (unsigned long long)st->received, (unsigned long long)st->expected);
    /* A stream can arrive whole just as the caller's deadline fires. The
     * caller then reports DEADLINE_EXCEEDED, so committing would store an
     * append it believes failed: refuse instead. */
    if (kvd_ctx_expired(ctx))
        return kvd_error_set(err, KVD_ETIMEDOUT,
                             "deadline passed before the append could commit; nothing was stored");
    kvd_seq_info info;
    memset(&info, 0, sizeof info);
    kvd_append *ap = st->ap;
    st->ap = NULL; /* commit frees it in every case */
    /* The reservation becomes usage as the append commits: a usage rescan
     * sees it in one of the two, never both or neither. */
    kvd_quota_lock(st->quota);
    int rc = kvd_store_append_commit(ap, &info, err);
    if (rc == 0 && st->reserved) {
        /* centroids reserved but not trained are given back */
        uint64_t unused =
            st->index_bound > info.pq_bytes_added ? st->index_bound - info.pq_bytes_added : 0;
        if (unused)
            kvd_quota_release(st->quota, st->model, 0, unused);
        kvd_quota_settle(st->quota, st->model, 0, st->expected + st->index_bound - unused);
    }
    kvd_quota_unlock(st->quota);
    if (rc)
        return rc;
    st->committed = 1;
    if (st->made)
        kvd_store_seq_pending_done(ctx->svc->store, st->key.id, st->key.len);
    KVD_METRIC_ADD(payload_bytes_stored, st->expected + info.pq_bytes_added);
    KVD_METRIC_ADD(stored_bytes, (int64_t)info.stored_bytes - (int64_t)st->old_stored_bytes);
    KVD_METRIC_ADD(pages_sealed, (int64_t)info.sealed_pages - (int64_t)st->old_sealed_pages);
    Kvdepot__V1__SequenceInfo si;
    kvd_seq_info_to_pb(&info, &si);
    kvd_codecs_pb cp;
    /* the append is durable: a codec record that cannot be read now leaves
     * the answer without codecs rather than failing it */
    kvd_error cerr;
    kvd_seq_info_codecs_pb(ctx->svc->store, &info, 1, &si, &cp, &cerr);
    kvd_ctx_seq_wire(ctx, &si.sequence_id);
    Kvdepot__V1__AppendResponse resp = KVDEPOT__V1__APPEND_RESPONSE__INIT;
    resp.sequence = &si;
    resp.bytes_received = st->received;
    resp.created = st->made;
    *reply = kvd_pack(&resp.base);
    kvd_codecs_pb_clear(&cp);
    kvd_seq_info_clear(&info);
    if (!*reply)
        return kvd_error_set(err, KVD_ENOMEM, "out of memory packing the reply");
    return 0;
}

/* A failed call ends its transaction and undoes its create before its
 * status goes out, so that a retry finds the store as it was. */
static int failed(void *state, int rc)
{
    append_state *st = state;
    if (rc && st) {
        kvd_store_append_abort(st->ap);
        st->ap = NULL;
        undo_create(st);
    }
    return rc;
}

static int append_recv(kvd_req_ctx *ctx, void **state, grpc_byte_buffer *msg, kvd_error *err)
{
    int rc = recv_one(ctx, state, msg, err); /* it may set *state */
    return failed(*state, rc);
}

static int append_finish(kvd_req_ctx *ctx, void **state, grpc_byte_buffer **reply, kvd_error *err)
{
    int rc = finish(ctx, state, reply, err);
    return failed(*state, rc);
}

static void append_release(void *state)
{
    append_state *st = state;
    if (!st)
        return;
    kvd_store_append_abort(st->ap);
    st->ap = NULL;
    undo_create(st); /* a stream cut off */
    kvd_seq_info_clear(&st->created);
    kvd_auth_unref(st->made_auth);
    if (st->reserved && !st->committed)
        kvd_quota_release(st->quota, st->model, 0, st->expected + st->index_bound);
    kvd_auth_unref(st->quota);
    if (st->hdr)
        kvdepot__v1__append_header__free_unpacked(st->hdr, NULL);
    free(st);
}

const kvd_stream_ops kvd_append_ops = {
    .recv = append_recv,
    .finish = append_finish,
    .release = append_release,
};
