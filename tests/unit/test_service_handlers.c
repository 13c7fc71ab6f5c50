/*
 * Handler-level tests of kvdepotd against a real store in a temporary
 * directory, without a network: the Append wire scan over messages split
 * into many slices, its slow path, every way an Append stream can be wrong
 * (and that the sequence is unchanged afterwards), and Read chunking.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <grpc/byte_buffer.h>
#include <grpc/byte_buffer_reader.h>
#include <grpc/grpc.h>
#include <grpc/slice.h>

#include "auth.h"
#include "convert.h"
#include "kvdepot/v1/kvdepot.pb-c.h"
#include "rpc.h"

static int failures;

#define CHECK(cond)                                                                                \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond);               \
            failures++;                                                                            \
        }                                                                                          \
    } while (0)

#define L 3
#define H 2
#define D 8
#define ROW (H * D * 2) /* f16 */

static kvd_service svc;
static kvd_config cfg;

/* A byte buffer holding `len` bytes split into slices of `piece` bytes. */
static grpc_byte_buffer *bb_split(const uint8_t *p, size_t len, size_t piece)
{
    size_t n = piece ? (len + piece - 1) / piece : 1;
    if (n == 0)
        n = 1;
    grpc_slice *s = calloc(n, sizeof *s);
    for (size_t i = 0; i < n; i++) {
        size_t off = i * piece, take = len - off < piece ? len - off : piece;
        s[i] = grpc_slice_from_copied_buffer((const char *)p + off, piece ? take : len);
    }
    grpc_byte_buffer *bb = grpc_raw_byte_buffer_create(s, n);
    for (size_t i = 0; i < n; i++)
        grpc_slice_unref(s[i]);
    free(s);
    return bb;
}

static grpc_byte_buffer *msg_split(const ProtobufCMessage *m, size_t piece)
{
    size_t n = protobuf_c_message_get_packed_size(m);
    uint8_t *buf = malloc(n ? n : 1);
    protobuf_c_message_pack(m, buf);
    grpc_byte_buffer *bb = bb_split(buf, n, piece);
    free(buf);
    return bb;
}

static int unary(kvd_unary_fn fn, const ProtobufCMessage *req, kvd_error *err)
{
    kvd_req_ctx ctx = {.svc = &svc, .req_id = 1};
    grpc_byte_buffer *reply = NULL;
    /* Round-trip the request through the wire, as the server does. */
    grpc_byte_buffer *bb = msg_split(req, 3);
    ProtobufCMessage *m = kvd_bb_unpack(req->descriptor, bb, NULL);
    grpc_byte_buffer_destroy(bb);
    int rc = fn(&ctx, m, &reply, err);
    protobuf_c_message_free_unpacked(m, NULL);
    if (reply)
        grpc_byte_buffer_destroy(reply);
    return rc;
}

static uint64_t stat_tokens(const char *id)
{
    kvd_seq_info info;
    memset(&info, 0, sizeof info);
    kvd_error err;
    if (kvd_store_seq_stat(svc.store, id, strlen(id), &info, &err) != 0)
        return UINT64_MAX;
    uint64_t n = info.num_tokens;
    kvd_seq_info_clear(&info);
    return n;
}

/* Run one Append stream of already-encoded messages; returns its status. */
static int run_append(grpc_byte_buffer **msgs, size_t n, kvd_error *err)
{
    kvd_req_ctx ctx = {.svc = &svc, .req_id = 2};
    void *state = NULL;
    int rc = 0;
    kvd_error_clear(err);
    for (size_t i = 0; i < n && rc == 0; i++)
        rc = kvd_append_ops.recv(&ctx, &state, msgs[i], err);
    if (rc == 0) {
        grpc_byte_buffer *reply = NULL;
        rc = kvd_append_ops.finish(&ctx, &state, &reply, err);
        if (reply)
            grpc_byte_buffer_destroy(reply);
    }
    kvd_append_ops.release(state);
    for (size_t i = 0; i < n; i++)
        grpc_byte_buffer_destroy(msgs[i]);
    return rc;
}

static grpc_byte_buffer *append_msg(const Kvdepot__V1__AppendHeader *h, const uint8_t *data,
                                    size_t len, size_t piece)
{
    Kvdepot__V1__AppendRequest r = KVDEPOT__V1__APPEND_REQUEST__INIT;
    r.header = (Kvdepot__V1__AppendHeader *)h;
    r.data.data = (uint8_t *)data;
    r.data.len = len;
    return msg_split(&r.base, piece);
}

/* Read the whole sequence back through the Read handler. */
static uint8_t *read_all(const char *id, uint64_t token_start, uint64_t num_tokens, uint32_t chunk,
                         size_t *len, int *nmsgs)
{
    kvd_req_ctx ctx = {.svc = &svc, .req_id = 3};
    Kvdepot__V1__ReadRequest req = KVDEPOT__V1__READ_REQUEST__INIT;
    req.sequence_id.data = (uint8_t *)id;
    req.sequence_id.len = strlen(id);
    req.token_start = token_start;
    req.num_tokens = num_tokens;
    req.max_chunk_bytes = chunk;
    void *state = NULL;
    kvd_error err;
    *len = 0;
    *nmsgs = 0;
    if (kvd_read_ops.start(&ctx, &req.base, &state, &err) != 0) {
        fprintf(stderr, "read start: %s\n", err.msg);
        return NULL;
    }
    uint8_t *out = NULL;
    uint64_t total = 0;
    for (;;) {
        grpc_byte_buffer *m = NULL;
        if (kvd_read_ops.next(&ctx, state, &m, &err) != 0) {
            fprintf(stderr, "read next: %s\n", err.msg);
            break;
        }
        if (!m)
            break;
        Kvdepot__V1__ReadResponse *r = (Kvdepot__V1__ReadResponse *)kvd_bb_unpack(
            &kvdepot__v1__read_response__descriptor, m, NULL);
        grpc_byte_buffer_destroy(m);
        CHECK(r != NULL);
        if (!r)
            break;
        if (*nmsgs == 0) {
            CHECK(r->header != NULL && r->data.len == 0);
            total = r->header ? r->header->total_bytes : 0;
            out = malloc(total ? total : 1);
        } else {
            CHECK(r->header == NULL);
            CHECK(chunk == 0 || r->data.len <= chunk);
            CHECK(*len + r->data.len <= total);
            if (*len + r->data.len <= total)
                memcpy(out + *len, r->data.data, r->data.len);
            *len += r->data.len;
        }
        (*nmsgs)++;
        kvdepot__v1__read_response__free_unpacked(r, NULL);
    }
    kvd_read_ops.release(state);
    CHECK(*len == total);
    return out;
}

/* The default tenant (no tokens file), its usage counted from the store;
 * NULL when it cannot be made. */
static kvd_auth *one_tenant(void)
{
    kvd_auth *auth = NULL;
    char e[256];
    kvd_error err;
    CHECK(kvd_auth_load(NULL, 0, 0, &auth, e, sizeof e) == 0 && auth && auth->n_tenants == 1);
    if (auth)
        CHECK(kvd_auth_scan(auth, svc.store, NULL, &err) == 0);
    return auth;
}

/*
 * Two appends that overlap and together exceed the tenant's byte quota:
 * exactly one may succeed, even though the second one's refusal makes the
 * service recount usage from the store while the first is still in flight
 * (the recount must keep what the first reserved).
 */
static void test_quota_overlap(void)
{
    const uint64_t T = 64;
    const size_t bytes = 2 * L * T * ROW;
    kvd_auth *auth = one_tenant();
    kvd_error err;
    if (!auth)
        return;
    const uint64_t before = auth->tenants[0].bytes;
    auth->tenants[0].max_bytes = before + bytes * 3 / 2; /* room for one of the two */
    const char *ids[2] = {"q1", "q2"};
    for (int i = 0; i < 2; i++) {
        Kvdepot__V1__CreateSequenceRequest cs = KVDEPOT__V1__CREATE_SEQUENCE_REQUEST__INIT;
        cs.sequence_id.data = (uint8_t *)ids[i];
        cs.sequence_id.len = 2;
        cs.model = "tm";
        CHECK(unary(kvd_h_create_sequence, &cs.base, &err) == 0);
    }
    uint8_t *data = calloc(1, bytes);
    svc.auth = auth; /* what a refused reservation recounts */
    kvd_req_ctx ctx = {.svc = &svc, .req_id = 9, .auth = auth};
    void *state[2] = {NULL, NULL};
    int rc[2];
    for (int i = 0; i < 2; i++) {
        Kvdepot__V1__AppendHeader h = KVDEPOT__V1__APPEND_HEADER__INIT;
        h.sequence_id.data = (uint8_t *)ids[i];
        h.sequence_id.len = 2;
        h.num_tokens = T;
        h.dtype = KVDEPOT__V1__DTYPE__DTYPE_F16;
        grpc_byte_buffer *m = append_msg(&h, data, bytes / 2, 4096); /* half sent */
        kvd_error_clear(&err);
        rc[i] = kvd_append_ops.recv(&ctx, &state[i], m, &err);
        grpc_byte_buffer_destroy(m);
    }
    for (int i = 0; i < 2; i++) {
        if (rc[i] == 0) {
            grpc_byte_buffer *m = append_msg(NULL, data + bytes / 2, bytes - bytes / 2, 4096);
            rc[i] = kvd_append_ops.recv(&ctx, &state[i], m, &err);
            grpc_byte_buffer_destroy(m);
        }
        if (rc[i] == 0) {
            grpc_byte_buffer *reply = NULL;
            rc[i] = kvd_append_ops.finish(&ctx, &state[i], &reply, &err);
            if (reply)
                grpc_byte_buffer_destroy(reply);
        }
        kvd_append_ops.release(state[i]);
    }
    CHECK(rc[0] == 0 && rc[1] == KVD_ENOMEM);
    CHECK(stat_tokens("q1") == T && stat_tokens("q2") == 0);
    /* Usage is exact afterwards: what is stored, nothing in flight. */
    CHECK(auth->tenants[0].bytes == before + bytes);
    CHECK(auth->tenants[0].inflight_bytes == 0 && auth->tenants[0].inflight_sequences == 0);
    CHECK(kvd_auth_scan(auth, svc.store, NULL, &err) == 0 &&
          auth->tenants[0].bytes == before + bytes);
    free(data);
    svc.auth = NULL;
    kvd_auth_unref(auth);
}

/* One Append stream carrying header h and the first `sent` data bytes,
 * then finish (cancel: the stream is cut off instead), as ctx's caller. */
static int stream_as(kvd_req_ctx *ctx, const Kvdepot__V1__AppendHeader *h, const uint8_t *data,
                     size_t sent, int cancel, kvd_error *err)
{
    void *state = NULL;
    grpc_byte_buffer *m = append_msg(h, data, sent, 4096);
    kvd_error_clear(err);
    int rc = kvd_append_ops.recv(ctx, &state, m, err);
    grpc_byte_buffer_destroy(m);
    if (rc == 0 && !cancel) {
        grpc_byte_buffer *reply = NULL;
        rc = kvd_append_ops.finish(ctx, &state, &reply, err);
        if (reply)
            grpc_byte_buffer_destroy(reply);
    }
    kvd_append_ops.release(state);
    return rc;
}

/* An Append with header.create of T tokens as ctx's caller: the first
 * `sent` data bytes, then finish (cancel: the stream is cut off instead). */
static int create_append_as(kvd_req_ctx *ctx, const char *id, uint64_t T, const uint8_t *data,
                            size_t bytes, size_t sent, int cancel, kvd_error *err)
{
    Kvdepot__V1__CreateSequenceRequest cs = KVDEPOT__V1__CREATE_SEQUENCE_REQUEST__INIT;
    cs.model = "tm";
    Kvdepot__V1__AppendHeader h = KVDEPOT__V1__APPEND_HEADER__INIT;
    h.sequence_id.data = (uint8_t *)id;
    h.sequence_id.len = strlen(id);
    h.num_tokens = T;
    h.dtype = KVDEPOT__V1__DTYPE__DTYPE_F16;
    h.create = &cs;
    return stream_as(ctx, &h, data, sent < bytes ? sent : bytes, cancel, err);
}

/*
 * An Append that creates its sequence counts one sequence of the tenant's
 * quota (refused past it, nothing created), and one that fails after the
 * create, or is cut off, gives the sequence and its quota back.
 */
static void test_quota_create_append(void)
{
    const uint64_t T = 16;
    const size_t bytes = 2 * L * T * ROW;
    kvd_auth *auth = one_tenant();
    kvd_error err;
    if (!auth)
        return;
    const uint64_t seqs = auth->tenants[0].sequences, used = auth->tenants[0].bytes;
    uint8_t *data = calloc(1, bytes);
    svc.auth = auth;
    kvd_req_ctx ctx = {.svc = &svc, .req_id = 11, .auth = auth};
    auth->tenants[0].max_sequences = seqs + 1;
    CHECK(create_append_as(&ctx, "ca1", T, data, bytes, bytes, 0, &err) == 0);
    CHECK(stat_tokens("ca1") == T && auth->tenants[0].sequences == seqs + 1 &&
          auth->tenants[0].bytes == used + bytes);
    CHECK(create_append_as(&ctx, "ca2", T, data, bytes, bytes, 0, &err) == KVD_ENOMEM);
    CHECK(stat_tokens("ca2") == UINT64_MAX);
    auth->tenants[0].max_sequences = seqs + 2;
    /* short data, then a cut-off stream: created, then undone */
    CHECK(create_append_as(&ctx, "ca2", T, data, bytes, bytes / 2, 0, &err) == KVD_EINVAL);
    CHECK(stat_tokens("ca2") == UINT64_MAX);
    CHECK(create_append_as(&ctx, "ca2", T, data, bytes, bytes / 2, 1, &err) == 0);
    CHECK(stat_tokens("ca2") == UINT64_MAX);
    CHECK(auth->tenants[0].sequences == seqs + 1 && auth->tenants[0].bytes == used + bytes &&
          auth->tenants[0].inflight_sequences == 0 && auth->tenants[0].inflight_bytes == 0);
    CHECK(kvd_auth_scan(auth, svc.store, NULL, &err) == 0 &&
          auth->tenants[0].sequences == seqs + 1 && auth->tenants[0].bytes == used + bytes);
    /* and the room given back takes the next one */
    CHECK(create_append_as(&ctx, "ca2", T, data, bytes, bytes, 0, &err) == 0);
    CHECK(stat_tokens("ca2") == T && auth->tenants[0].sequences == seqs + 2);
    free(data);
    svc.auth = NULL;
    kvd_auth_unref(auth);
}

/* One whole Append of T tokens of every layer of `id` as ctx's caller. */
static int append_as(kvd_req_ctx *ctx, const char *id, uint64_t T, const uint8_t *data,
                     size_t bytes, kvd_error *err)
{
    Kvdepot__V1__AppendHeader h = KVDEPOT__V1__APPEND_HEADER__INIT;
    h.sequence_id.data = (uint8_t *)id;
    h.sequence_id.len = strlen(id);
    h.token_start = stat_tokens(id);
    h.num_tokens = T;
    h.dtype = KVDEPOT__V1__DTYPE__DTYPE_F16;
    return stream_as(ctx, &h, data, bytes, 0, err);
}

/*
 * The PQ index's centroids count in the tenant's byte quota: an append that
 * trains them needs room for them as well as for its payload (one byte short
 * is refused, nothing stored); usage then holds both exactly, also after a
 * rescan; a later append trains none and needs room for its payload only.
 */
static int unary_as(kvd_req_ctx *ctx, kvd_unary_fn fn, const ProtobufCMessage *req,
                    grpc_byte_buffer **reply, kvd_error *err);

static void test_quota_pq(void)
{
    const uint64_t T = 32; /* two pages of 16 */
    const size_t bytes = 2 * L * T * ROW;
    const uint64_t rec = 12 + 4ull * H * 16 * D; /* m 2, 4 bits: 2^4 centroids per sub-space */
    kvd_auth *auth = one_tenant();
    kvd_error err;
    if (!auth)
        return;
    const uint64_t before = auth->tenants[0].bytes;
    Kvdepot__V1__PQSpec pq = KVDEPOT__V1__PQSPEC__INIT;
    pq.m = 2;
    pq.bits = 4;
    pq.min_train_tokens = 1; /* trained by the first append, which seals pages */
    Kvdepot__V1__SequenceCodecs codecs = KVDEPOT__V1__SEQUENCE_CODECS__INIT;
    codecs.pq = &pq;
    Kvdepot__V1__CreateSequenceRequest cs = KVDEPOT__V1__CREATE_SEQUENCE_REQUEST__INIT;
    cs.sequence_id.data = (uint8_t *)"pq1";
    cs.sequence_id.len = 3;
    cs.model = "tm";
    cs.codecs = &codecs;
    CHECK(unary(kvd_h_create_sequence, &cs.base, &err) == 0);
    uint8_t *data = malloc(bytes);
    for (size_t i = 0; i < bytes / 2; i++) /* f16 values in [-1, 1) */
        ((uint16_t *)data)[i] = (uint16_t)(0x3000 + (i * 7919 % 0x0c00)) | (i & 1 ? 0x8000 : 0);
    svc.auth = auth;
    kvd_req_ctx ctx = {.svc = &svc, .req_id = 10, .auth = auth};
    auth->tenants[0].max_bytes = before + bytes + L * rec - 1;
    CHECK(append_as(&ctx, "pq1", T, data, bytes, &err) == KVD_ENOMEM);
    CHECK(stat_tokens("pq1") == 0 && auth->tenants[0].bytes == before &&
          auth->tenants[0].inflight_bytes == 0);
    auth->tenants[0].max_bytes = before + bytes + L * rec;
    CHECK(append_as(&ctx, "pq1", T, data, bytes, &err) == 0);
    CHECK(stat_tokens("pq1") == T);
    CHECK(auth->tenants[0].bytes == before + bytes + L * rec &&
          auth->tenants[0].inflight_bytes == 0);
    CHECK(kvd_auth_scan(auth, svc.store, NULL, &err) == 0 &&
          auth->tenants[0].bytes == before + bytes + L * rec);
    kvd_seq_info info;
    CHECK(kvd_store_seq_stat(svc.store, "pq1", 3, &info, &err) == 0 && info.pq_bytes == L * rec &&
          info.stored_bytes > L * rec);
    kvd_seq_info_clear(&info);
    auth->tenants[0].max_bytes = before + 2 * bytes + L * rec;
    CHECK(append_as(&ctx, "pq1", T, data, bytes, &err) == 0);
    CHECK(auth->tenants[0].bytes == before + 2 * bytes + L * rec &&
          auth->tenants[0].inflight_bytes == 0);

    /* Trained at 48 tokens: the first append (32) trains nothing and needs
     * room for its payload only; the second also for the centroids and the
     * codes record of the 32 tokens sealed before (16 + H x 32 x m bytes a
     * layer), one byte short refused. */
    const uint64_t base = auth->tenants[0].bytes;
    const uint64_t codes = 16 + (uint64_t)H * T * 2;
    pq.min_train_tokens = 48;
    cs.sequence_id.data = (uint8_t *)"pq2";
    CHECK(unary(kvd_h_create_sequence, &cs.base, &err) == 0);
    auth->tenants[0].max_bytes = base + bytes;
    CHECK(append_as(&ctx, "pq2", T, data, bytes, &err) == 0);
    CHECK(auth->tenants[0].bytes == base + bytes);
    auth->tenants[0].max_bytes = base + 2 * bytes + L * (rec + codes) - 1;
    CHECK(append_as(&ctx, "pq2", T, data, bytes, &err) == KVD_ENOMEM);
    CHECK(stat_tokens("pq2") == T && auth->tenants[0].bytes == base + bytes &&
          auth->tenants[0].inflight_bytes == 0);
    auth->tenants[0].max_bytes = base + 2 * bytes + L * (rec + codes);
    CHECK(append_as(&ctx, "pq2", T, data, bytes, &err) == 0);
    CHECK(auth->tenants[0].bytes == base + 2 * bytes + L * (rec + codes) &&
          auth->tenants[0].inflight_bytes == 0);
    CHECK(kvd_auth_scan(auth, svc.store, NULL, &err) == 0 &&
          auth->tenants[0].bytes == base + 2 * bytes + L * (rec + codes));
    CHECK(kvd_store_seq_stat(svc.store, "pq2", 3, &info, &err) == 0 &&
          info.pq_bytes == L * (rec + codes));
    kvd_seq_info_clear(&info);

    /* RebuildPQIndex codes all 64 sealed tokens (32 more a layer): the
     * quota counts the growth, one byte short refused with nothing changed */
    const uint64_t grow = L * (uint64_t)H * T * 2, held = auth->tenants[0].bytes;
    Kvdepot__V1__RebuildPQIndexRequest rq = KVDEPOT__V1__REBUILD_PQINDEX_REQUEST__INIT;
    rq.sequence_id.data = (uint8_t *)"pq2";
    rq.sequence_id.len = 3;
    grpc_byte_buffer *reply = NULL;
    auth->tenants[0].max_bytes = held + grow - 1;
    CHECK(unary_as(&ctx, kvd_h_pq_rebuild, &rq.base, &reply, &err) == KVD_ENOMEM);
    CHECK(auth->tenants[0].bytes == held && auth->tenants[0].inflight_bytes == 0);
    CHECK(kvd_store_seq_stat(svc.store, "pq2", 3, &info, &err) == 0 &&
          info.pq_bytes == L * (rec + codes));
    kvd_seq_info_clear(&info);
    auth->tenants[0].max_bytes = held + grow;
    CHECK(unary_as(&ctx, kvd_h_pq_rebuild, &rq.base, &reply, &err) == 0 && reply);
    if (reply)
        grpc_byte_buffer_destroy(reply);
    CHECK(auth->tenants[0].bytes == held + grow && auth->tenants[0].inflight_bytes == 0);
    CHECK(kvd_auth_scan(auth, svc.store, NULL, &err) == 0 && auth->tenants[0].bytes == held + grow);
    CHECK(kvd_store_seq_stat(svc.store, "pq2", 3, &info, &err) == 0 &&
          info.pq_bytes == L * (rec + codes) + grow);
    kvd_seq_info_clear(&info);
    free(data);
    svc.auth = NULL;
    kvd_auth_unref(auth);
}

/* A unary handler run as the caller of ctx, the request through the wire. */
static int unary_as(kvd_req_ctx *ctx, kvd_unary_fn fn, const ProtobufCMessage *req,
                    grpc_byte_buffer **reply, kvd_error *err)
{
    grpc_byte_buffer *bb = msg_split(req, 3);
    ProtobufCMessage *m = kvd_bb_unpack(req->descriptor, bb, NULL);
    grpc_byte_buffer_destroy(bb);
    int rc = fn(ctx, m, reply, err);
    protobuf_c_message_free_unpacked(m, NULL);
    return rc;
}

/* Lookup of engine names as ctx's caller: matched blocks, or -1. */
static int64_t engine_lookup_as(kvd_req_ctx *ctx, ProtobufCBinaryData *names, size_t n)
{
    Kvdepot__V1__LookupRequest q = KVDEPOT__V1__LOOKUP_REQUEST__INIT;
    q.model = "tm";
    q.engine_block_hashes = names;
    q.n_engine_block_hashes = n;
    q.engine_block_tokens = 4;
    grpc_byte_buffer *reply = NULL;
    kvd_error err;
    if (unary_as(ctx, kvd_h_lookup, &q.base, &reply, &err) != 0)
        return -1;
    Kvdepot__V1__LookupResponse *r = (Kvdepot__V1__LookupResponse *)kvd_bb_unpack(
        &kvdepot__v1__lookup_response__descriptor, reply, NULL);
    grpc_byte_buffer_destroy(reply);
    int64_t blocks = r ? (int64_t)r->matched_blocks : -1;
    if (r)
        kvdepot__v1__lookup_response__free_unpacked(r, NULL);
    return blocks;
}

/*
 * Engine block hashes are keyed by tenant: team-a appends a sequence whose
 * two pages (16 tokens, engine blocks of 4) are named by 8 engine hashes;
 * team-a finds both pages by them and starts a sequence from them, team-b
 * and a caller without a token find nothing and cannot start from them.
 */
static void test_engine_tenants(const char *dir)
{
    char path[512];
    snprintf(path, sizeof path, "%s/tokens.yaml", dir);
    FILE *f = fopen(path, "w");
    CHECK(f != NULL);
    if (!f)
        return;
    fputs("tokens:\n"
          "  - token: \"tok-engine-a-0123456789\"\n    tenant: team-a\n    namespaces: [\"*\"]\n"
          "  - token: \"tok-engine-b-0123456789\"\n    tenant: team-b\n    namespaces: [\"*\"]\n",
          f);
    fclose(f);
    kvd_auth *auth = NULL;
    char e[256];
    CHECK(kvd_auth_load(path, 0, 0, &auth, e, sizeof e) == 0 && auth && auth->n_tokens == 2);
    if (!auth || auth->n_tokens != 2) {
        fprintf(stderr, "tokens: %s\n", e);
        kvd_auth_unref(auth);
        return;
    }
    kvd_error err;
    CHECK(kvd_auth_scan(auth, svc.store, NULL, &err) == 0);
    kvd_req_ctx a = {.svc = &svc, .req_id = 20, .auth = auth, .principal = &auth->tokens[0]};
    kvd_req_ctx b = {.svc = &svc, .req_id = 21, .auth = auth, .principal = &auth->tokens[1]};
    kvd_req_ctx anon = {.svc = &svc, .req_id = 22};
    CHECK(strcmp(kvd_auth_tenant(auth, a.principal), "team-a") == 0 &&
          strcmp(kvd_auth_tenant(auth, b.principal), "team-b") == 0);

    enum { NB = 8 };
    uint8_t bytes[NB][32];
    ProtobufCBinaryData names[NB];
    for (int j = 0; j < NB; j++) {
        for (int i = 0; i < 32; i++)
            bytes[j][i] = (uint8_t)(j * 37 + i * 11 + 5);
        names[j] = (ProtobufCBinaryData){32, bytes[j]};
    }
    /* The same names give each tenant its own page keys. */
    uint64_t *ka = NULL, *kb = NULL, *kn = NULL;
    size_t na = 0, nb2 = 0, nn = 0;
    CHECK(kvd_ctx_engine_pages(&a, names, NB, 4, 0, "t", &ka, &na, &err) == 0 && na == 2);
    CHECK(kvd_ctx_engine_pages(&b, names, NB, 4, 0, "t", &kb, &nb2, &err) == 0 && nb2 == 2);
    CHECK(kvd_ctx_engine_pages(&anon, names, NB, 4, 0, "t", &kn, &nn, &err) == 0 && nn == 2);
    if (na == 2 && nb2 == 2 && nn == 2)
        CHECK(ka[0] != kb[0] && ka[1] != kb[1] && ka[0] != kn[0] && kb[0] != kn[0] &&
              ka[0] != ka[1]);
    free(ka), free(kb), free(kn);

    Kvdepot__V1__CreateSequenceRequest cs = KVDEPOT__V1__CREATE_SEQUENCE_REQUEST__INIT;
    cs.sequence_id.data = (uint8_t *)"eng";
    cs.sequence_id.len = 3;
    cs.model = "tm";
    grpc_byte_buffer *reply = NULL;
    CHECK(unary_as(&a, kvd_h_create_sequence, &cs.base, &reply, &err) == 0);
    if (reply)
        grpc_byte_buffer_destroy(reply);
    const uint64_t T = 32;
    const size_t total = 2 * L * T * ROW;
    uint8_t *data = calloc(1, total);
    Kvdepot__V1__AppendHeader h = KVDEPOT__V1__APPEND_HEADER__INIT;
    h.sequence_id = cs.sequence_id;
    h.num_tokens = T;
    h.dtype = KVDEPOT__V1__DTYPE__DTYPE_F16;
    h.engine_block_hashes = names;
    h.n_engine_block_hashes = NB;
    h.engine_block_tokens = 4;
    void *state = NULL;
    grpc_byte_buffer *m = append_msg(&h, data, total, 4096);
    int rc = kvd_append_ops.recv(&a, &state, m, &err);
    grpc_byte_buffer_destroy(m);
    if (rc == 0) {
        rc = kvd_append_ops.finish(&a, &state, &reply, &err);
        if (reply)
            grpc_byte_buffer_destroy(reply);
    }
    kvd_append_ops.release(state);
    CHECK(rc == 0);
    if (rc)
        fprintf(stderr, "engine append: %s\n", err.msg);

    CHECK(engine_lookup_as(&a, names, NB) == 8);
    CHECK(engine_lookup_as(&b, names, NB) == 0);
    CHECK(engine_lookup_as(&anon, names, NB) == 0);
    /* Starting from the prefix: team-a may, team-b finds no such prefix. */
    Kvdepot__V1__CreateSequenceRequest cp = KVDEPOT__V1__CREATE_SEQUENCE_REQUEST__INIT;
    cp.sequence_id.data = (uint8_t *)"eng2";
    cp.sequence_id.len = 4;
    cp.model = "tm";
    cp.engine_prefix_hashes = names;
    cp.n_engine_prefix_hashes = NB;
    cp.engine_block_tokens = 4;
    reply = NULL;
    CHECK(unary_as(&b, kvd_h_create_sequence, &cp.base, &reply, &err) == KVD_ENOTFOUND);
    CHECK(unary_as(&a, kvd_h_create_sequence, &cp.base, &reply, &err) == 0);
    if (reply)
        grpc_byte_buffer_destroy(reply);
    CHECK(stat_tokens("team-a/eng2") == T);
    free(data);
    kvd_auth_unref(auth);
}

int main(void)
{
    grpc_init();
    char dir[] = "/tmp/kvd-service-test.XXXXXX";
    if (!mkdtemp(dir)) {
        perror("mkdtemp");
        return 1;
    }
    kvd_config_defaults(&cfg);
    cfg.max_append_bytes = 1u << 20;
    kvd_store_options so = {.data_dir = dir, .page_tokens = 16};
    kvd_error err;
    if (kvd_store_open(&so, &svc.store, &err) != 0) {
        fprintf(stderr, "store open: %s\n", err.msg);
        return 1;
    }
    svc.cfg = &cfg;
    svc.page_tokens = kvd_store_page_tokens(svc.store);
    atomic_init(&svc.serving, 1);

    Kvdepot__V1__Model model = KVDEPOT__V1__MODEL__INIT;
    model.name = "tm";
    model.num_layers = L;
    model.num_kv_heads = H;
    model.head_dim = D;
    model.dtype = KVDEPOT__V1__DTYPE__DTYPE_F16;
    Kvdepot__V1__PutModelRequest pm = KVDEPOT__V1__PUT_MODEL_REQUEST__INIT;
    pm.model = &model;
    CHECK(unary(kvd_h_put_model, &pm.base, &err) == 0);
    Kvdepot__V1__CreateSequenceRequest cs = KVDEPOT__V1__CREATE_SEQUENCE_REQUEST__INIT;
    cs.sequence_id.data = (uint8_t *)"s";
    cs.sequence_id.len = 1;
    cs.model = "tm";
    CHECK(unary(kvd_h_create_sequence, &cs.base, &err) == 0);
    CHECK(unary(kvd_h_create_sequence, &cs.base, &err) == KVD_EEXIST);

    const uint64_t T = 40;
    size_t total = 2 * L * T * ROW;
    uint8_t *data = calloc(1, total + 16); /* slack: one test sends a byte too many */
    for (size_t i = 0; i < total; i++)
        data[i] = (uint8_t)(i * 131 + (i >> 8));
    Kvdepot__V1__AppendHeader h = KVDEPOT__V1__APPEND_HEADER__INIT;
    h.sequence_id.data = (uint8_t *)"s";
    h.sequence_id.len = 1;
    h.num_tokens = T;
    h.dtype = KVDEPOT__V1__DTYPE__DTYPE_F16;

    /* Bad streams: each fails with INVALID_ARGUMENT and changes nothing. */
    {
        grpc_byte_buffer *m[3];
        m[0] = append_msg(&h, data, total / 2, 7);
        m[1] = append_msg(NULL, data + total / 2, total - total / 2 + 1, 5); /* one too many */
        CHECK(run_append(m, 2, &err) == KVD_EINVAL && strstr(err.msg, "data:"));
        m[0] = append_msg(&h, data, total - 1, 1000); /* one short */
        CHECK(run_append(m, 1, &err) == KVD_EINVAL && strstr(err.msg, "data:"));
        m[0] = append_msg(NULL, data, 10, 1000); /* no header */
        CHECK(run_append(m, 1, &err) == KVD_EINVAL && strstr(err.msg, "header"));
        m[0] = append_msg(&h, data, 10, 1000);
        m[1] = append_msg(&h, data + 10, 10, 1000); /* second header */
        CHECK(run_append(m, 2, &err) == KVD_EINVAL && strstr(err.msg, "header"));
        static const uint8_t garbage[] = {0x12, 0xff, 0xff, 0xff, 0x0f, 1, 2};
        m[0] = append_msg(&h, data, 10, 1000);
        m[1] = bb_split(garbage, sizeof garbage, 2);
        CHECK(run_append(m, 2, &err) == KVD_EINVAL && strstr(err.msg, "parse"));
        Kvdepot__V1__AppendHeader bad = h;
        bad.num_tokens = 0;
        m[0] = append_msg(&bad, NULL, 0, 1000);
        CHECK(run_append(m, 1, &err) == KVD_EINVAL && strstr(err.msg, "num_tokens"));
        bad = h;
        bad.token_start = UINT64_MAX;
        m[0] = append_msg(&bad, NULL, 0, 1000);
        CHECK(run_append(m, 1, &err) == KVD_EINVAL && strstr(err.msg, "token_start"));
        bad = h;
        bad.dtype = 42;
        m[0] = append_msg(&bad, NULL, 0, 1000);
        CHECK(run_append(m, 1, &err) == KVD_EINVAL && strstr(err.msg, "dtype"));
        bad = h;
        bad.num_tokens = 100000; /* above max_append_bytes */
        m[0] = append_msg(&bad, NULL, 0, 1000);
        CHECK(run_append(m, 1, &err) == KVD_ENOMEM);
        CHECK(run_append(m, 0, &err) == KVD_EINVAL); /* empty stream */
        CHECK(stat_tokens("s") == 0);
    }

    /* Good stream: header message with some data, then slices of odd sizes
     * (including 1-byte slices that split tags and varints). */
    {
        grpc_byte_buffer *m[8];
        size_t n = 0, off = 0;
        size_t sizes[] = {5, 1000, 1, 333, 4096};
        size_t pieces[] = {1, 2, 1, 7, 4095};
        m[n++] = append_msg(&h, data, sizes[0], pieces[0]);
        off = sizes[0];
        for (int i = 1; i < 5; i++) {
            m[n++] = append_msg(NULL, data + off, sizes[i], pieces[i]);
            off += sizes[i];
        }
        m[n++] = append_msg(NULL, data + off, total - off, 64);
        CHECK(run_append(m, n, &err) == 0);
        if (err.code)
            fprintf(stderr, "append: %s\n", err.msg);
        CHECK(stat_tokens("s") == T);
    }

    /* Slow path: the data field twice in one message (the last wins), as a
     * protobuf parser must accept. */
    {
        uint8_t one[2 * L * ROW];
        memset(one, 0xab, sizeof one);
        Kvdepot__V1__AppendHeader h2 = h;
        h2.token_start = T;
        h2.num_tokens = 1;
        Kvdepot__V1__AppendRequest a = KVDEPOT__V1__APPEND_REQUEST__INIT, b = a;
        a.header = &h2;
        a.data.data = (uint8_t *)"junk";
        a.data.len = 4;
        b.data.data = one;
        b.data.len = sizeof one;
        size_t na = protobuf_c_message_get_packed_size(&a.base);
        size_t nb = protobuf_c_message_get_packed_size(&b.base);
        uint8_t *buf = malloc(na + nb);
        protobuf_c_message_pack(&a.base, buf);
        protobuf_c_message_pack(&b.base, buf + na);
        grpc_byte_buffer *m[1] = {bb_split(buf, na + nb, 9)};
        free(buf);
        CHECK(run_append(m, 1, &err) == 0);
        CHECK(stat_tokens("s") == T + 1);
    }

    /* Read back the first T tokens in chunks of several sizes. */
    uint32_t chunks[] = {0, 1, 100, 4096};
    for (size_t i = 0; i < sizeof chunks / sizeof chunks[0]; i++) {
        size_t len;
        int nmsgs;
        uint8_t *out = read_all("s", 0, T, chunks[i], &len, &nmsgs);
        CHECK(out && len == total && memcmp(out, data, total) == 0);
        if (chunks[i])
            CHECK((size_t)nmsgs == 1 + (total + chunks[i] - 1) / chunks[i]);
        free(out);
    }
    {
        kvd_req_ctx ctx = {.svc = &svc, .req_id = 4};
        Kvdepot__V1__ReadRequest req = KVDEPOT__V1__READ_REQUEST__INIT;
        void *state = NULL;
        req.sequence_id.data = (uint8_t *)"s";
        req.sequence_id.len = 1;
        req.max_chunk_bytes = (4u << 20) + 1;
        CHECK(kvd_read_ops.start(&ctx, &req.base, &state, &err) == KVD_EINVAL &&
              strstr(err.msg, "max_chunk_bytes"));
        req.max_chunk_bytes = 0;
        req.token_start = 1000;
        CHECK(kvd_read_ops.start(&ctx, &req.base, &state, &err) == KVD_ERANGE);
        req.sequence_id.len = 0;
        CHECK(kvd_read_ops.start(&ctx, &req.base, &state, &err) == KVD_EINVAL &&
              strstr(err.msg, "sequence_id"));
    }

    test_quota_overlap();
    test_quota_pq();
    test_quota_create_append();
    test_engine_tenants(dir);
    free(data);
    kvd_store_close(svc.store);
    kvd_config_free(&cfg);
    grpc_shutdown();
    char cmd[256];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    if (system(cmd) != 0)
        fprintf(stderr, "could not remove %s\n", dir);
    if (failures) {
        fprintf(stderr, "%d check(s) failed\n", failures);
        return 1;
    }
    printf("service handler tests passed\n");
    return 0;
}
