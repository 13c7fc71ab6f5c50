/*
 * Read: server-streaming download of a layer range x token range.
 *
 * The first message carries only the header; then each message carries one
 * chunk of data. A data message is built in place: the store copies the
 * chunk into a slice we allocate with room in front, and the protobuf tag and
 * length are written just before the bytes once their count is known. The
 * slice goes to gRPC as is, so the payload is copied once (store -> slice).
 *
 * With activation_tokens a (decoded format only) the store's cursor yields
 * X of the first a tokens of the range ([layer][token][hidden_size]), then K
 * and V of the rest; the header says how many of the bytes are X.
 *
 * READ_FORMAT_PAGES streams the stored pages instead, one per message, in
 * (layer, block) order: every page holding a token of the range, so a range
 * that does not start or end on a block boundary brings the whole first and
 * last blocks. Pages are acquired one at a time from the store's tiers (as
 * Attend does), so the message is that page, encoded and checksummed as it
 * is kept; the header's total_bytes is 0 because page lengths are not known
 * before each page is loaded.
 */
#include <stdlib.h>
#include <string.h>

#include <grpc/slice.h>

#include "convert.h"
#include "rpc.h"
#include "validate.h"

#define CHUNK_DEFAULT (1u << 20)
#define CHUNK_MAX (4u << 20)
/* Tag byte plus the longest varint length of a chunk (< 2^35). */
#define PREFIX_ROOM 6
/* Bytes of framing besides the payload that a send limit must leave room for. */
#define MESSAGE_SLACK 64

typedef struct read_state {
    kvd_read *rd;
    kvd_read_shape shape;
    uint8_t id[KVD_SEQ_ID_MAX];
    size_t id_len;
    size_t chunk;
    uint64_t sent;
    int header_sent;
    /* READ_FORMAT_PAGES: the next page to send and the end of the blocks. */
    int pages;
    kvd_store *store;
    uint32_t layer, layer_end;
    uint64_t block, block_first, block_end;
    /* The header's codecs, converted before a page-format read drops its
     * cursor (which holds the codecs) */
    kvd_codecs_pb codecs;
} read_state;

static int read_start(kvd_req_ctx *ctx, const ProtobufCMessage *msg, void **state,
                      kvd_error *err)
{
    const Kvdepot__V1__ReadRequest *req = (const Kvdepot__V1__ReadRequest *)msg;
    int rc;
    kvd_seq_key key;
    if ((rc = kvd_ctx_seq_key(ctx, &req->sequence_id, "sequence_id", &key, err)) ||
        (rc = kvd_check_range(req->token_start, req->num_tokens, 64, "token_start", "num_tokens",
                              err)) ||
        (rc = kvd_check_range(req->layer_start, req->num_layers, 32, "layer_start", "num_layers",
                              err)))
        return rc;
    const int pages = req->format == KVDEPOT__V1__READ_FORMAT__READ_FORMAT_PAGES;
    if (!pages && req->format != KVDEPOT__V1__READ_FORMAT__READ_FORMAT_DECODED)
        return kvd_error_set(err, KVD_EINVAL, "format: unknown value %d", (int)req->format);
    if (pages && req->activation_tokens)
        return kvd_error_set(err, KVD_EINVAL,
                             "activation_tokens: activation-first reads are decoded only");
    if (req->max_chunk_bytes > CHUNK_MAX)
        return kvd_error_set(err, KVD_EINVAL, "max_chunk_bytes: %u exceeds the limit %u",
                             req->max_chunk_bytes, CHUNK_MAX);
    if ((rc = kvd_ctx_check_seq(ctx, key.id, key.len, err)))
        return rc;
    size_t chunk = req->max_chunk_bytes ? req->max_chunk_bytes : CHUNK_DEFAULT;
    uint64_t send_limit = ctx->svc->cfg->max_message_bytes;
    if (chunk > send_limit - MESSAGE_SLACK)
        chunk = (size_t)(send_limit - MESSAGE_SLACK);

    read_state *st = calloc(1, sizeof *st);
    if (!st)
        return kvd_error_set(err, KVD_ENOMEM, "out of memory");
    kvd_read_spec spec = {
        .seq_id = key.id,
        .seq_id_len = key.len,
        .layer_start = req->layer_start,
        .num_layers = req->num_layers,
        .token_start = req->token_start,
        .num_tokens = req->num_tokens,
        .activation_tokens = req->activation_tokens,
    };
    if ((rc = kvd_store_read_begin(ctx->svc->store, &spec, &st->rd, &st->shape, err))) {
        free(st);
        return rc;
    }
    memcpy(st->id, key.id, key.len);
    st->id_len = key.len;
    st->chunk = chunk;
    kvd_codecs_to_pb(st->shape.codecs, st->shape.stores_activations, &st->codecs);
    st->shape.codecs = NULL; /* the cursor's: not used past here */
    if (pages) {
        /* The shape (and the range check) come from the cursor; the pages
         * themselves are acquired as they are sent. */
        kvd_store_read_end(st->rd);
        st->rd = NULL;
        const uint64_t B = ctx->svc->page_tokens;
        st->pages = 1;
        st->store = ctx->svc->store;
        st->layer = st->shape.layer_start;
        st->layer_end = st->shape.layer_start + st->shape.num_layers;
        st->block_first = st->shape.token_start / B;
        st->block_end = st->shape.num_tokens
                            ? (st->shape.token_start + st->shape.num_tokens + B - 1) / B
                            : st->block_first;
        st->block = st->block_first;
        st->shape.total_bytes = 0;
    }
    *state = st;
    return 0;
}

static size_t put_varint(uint8_t *p, uint64_t v)
{
    size_t n = 0;
    do {
        uint8_t b = v & 0x7f;
        v >>= 7;
        p[n++] = b | (v ? 0x80 : 0);
    } while (v);
    return n;
}

/* ReadResponse.data = field 2, wire type 2 (length-delimited), over `len`
 * bytes already at base + PREFIX_ROOM of slice s (consumed). */
static grpc_byte_buffer *data_message(grpc_slice s, size_t len)
{
    uint8_t *base = GRPC_SLICE_START_PTR(s);
    uint8_t prefix[PREFIX_ROOM];
    prefix[0] = (2 << 3) | 2;
    size_t plen = 1 + put_varint(prefix + 1, len);
    memcpy(base + PREFIX_ROOM - plen, prefix, plen);
    grpc_slice msg_slice = grpc_slice_sub(s, PREFIX_ROOM - plen, PREFIX_ROOM + len);
    grpc_slice_unref(s);
    grpc_byte_buffer *bb = grpc_raw_byte_buffer_create(&msg_slice, 1);
    grpc_slice_unref(msg_slice);
    return bb;
}

/* The next page of a READ_FORMAT_PAGES read; *msg stays NULL after the last. */
static int next_page(read_state *st, grpc_byte_buffer **msg, kvd_error *err)
{
    if (st->block >= st->block_end) {
        st->layer++;
        st->block = st->block_first;
    }
    if (st->layer >= st->layer_end || st->block >= st->block_end)
        return 0;
    kvd_page_handle h;
    int rc = kvd_store_page_acquire(st->store, st->id, st->id_len, st->layer, st->block, &h,
                                    err);
    if (rc)
        return rc;
    grpc_slice s = grpc_slice_malloc_large(PREFIX_ROOM + h.len);
    memcpy(GRPC_SLICE_START_PTR(s) + PREFIX_ROOM, h.bytes, h.len);
    size_t len = h.len;
    kvd_store_page_release(st->store, &h);
    *msg = data_message(s, len);
    st->sent += len;
    st->block++;
    return *msg ? 0 : kvd_error_set(err, KVD_ENOMEM, "out of memory");
}

static int read_next(kvd_req_ctx *ctx, void *state, grpc_byte_buffer **msg, kvd_error *err)
{
    read_state *st = state;
    *msg = NULL;
    if (!st->header_sent) {
        Kvdepot__V1__ReadHeader h = KVDEPOT__V1__READ_HEADER__INIT;
        h.sequence_id.data = st->id;
        h.sequence_id.len = st->id_len;
        kvd_ctx_seq_wire(ctx, &h.sequence_id);
        h.layer_start = st->shape.layer_start;
        h.num_layers = st->shape.num_layers;
        h.token_start = st->shape.token_start;
        h.num_tokens = st->shape.num_tokens;
        h.num_kv_heads = st->shape.num_kv_heads;
        h.head_dim = st->shape.head_dim;
        h.dtype = (Kvdepot__V1__DType)st->shape.dtype;
        h.total_bytes = st->shape.total_bytes;
        h.format = st->pages ? KVDEPOT__V1__READ_FORMAT__READ_FORMAT_PAGES
                             : KVDEPOT__V1__READ_FORMAT__READ_FORMAT_DECODED;
        h.activation_tokens = st->shape.activation_tokens;
        h.hidden_size = st->shape.hidden_size;
        h.activation_bytes = st->shape.activation_bytes;
        h.codecs = &st->codecs.c;
        Kvdepot__V1__ReadResponse r = KVDEPOT__V1__READ_RESPONSE__INIT;
        r.header = &h;
        *msg = kvd_pack(&r.base);
        st->header_sent = 1;
        return *msg ? 0 : kvd_error_set(err, KVD_ENOMEM, "out of memory");
    }
    if (st->pages)
        return next_page(st, msg, err);
    /* An activation-first read streams X, then K and V. */
    uint64_t left = st->shape.activation_bytes + st->shape.total_bytes - st->sent;
    if (left == 0)
        return 0;
    size_t want = left < st->chunk ? (size_t)left : st->chunk;
    grpc_slice s = grpc_slice_malloc_large(PREFIX_ROOM + want);
    uint8_t *base = GRPC_SLICE_START_PTR(s);
    size_t got = 0;
    while (got < want) {
        size_t n = 0;
        int rc = kvd_store_read_next(st->rd, base + PREFIX_ROOM + got, want - got, &n, err);
        if (rc) {
            grpc_slice_unref(s);
            return rc;
        }
        if (n == 0)
            break;
        got += n;
    }
    if (got == 0) {
        grpc_slice_unref(s);
        return kvd_error_set(err, KVD_EINTERNAL,
                             "store ended the read after %llu of %llu bytes",
                             (unsigned long long)st->sent,
                             (unsigned long long)(st->shape.activation_bytes +
                                                  st->shape.total_bytes));
    }
    *msg = data_message(s, got);
    st->sent += got;
    return 0;
}

static void read_release(void *state)
{
    read_state *st = state;
    if (!st)
        return;
    kvd_store_read_end(st->rd);
    kvd_codecs_pb_clear(&st->codecs);
    free(st);
}

const kvd_stream_ops kvd_read_ops = {
    .start = read_start,
    .next = read_next,
    .release = read_release,
};
