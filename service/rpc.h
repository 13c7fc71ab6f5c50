/*
 * kvdepotd method table: how a request path maps to a handler.
 *
 * The server loop (server.c) owns the gRPC calls and their state machines;
 * handlers only see decoded requests and hand back packed replies, so they can
 * be exercised without a network. Three shapes exist:
 *
 *   unary             one request message -> one reply message
 *   client streaming  messages fed one at a time to recv(), then finish()
 *                     at half-close produces the single reply
 *   server streaming  one request message -> start(), then next() is asked
 *                     for one message at a time (the server keeps at most one
 *                     send in flight and one message prepared)
 *
 * Every handler returns 0 or a negative kvd_status with `err` filled; the
 * server turns that into the gRPC status -rc with err->msg as details.
 */
#ifndef KVDEPOT_SERVICE_RPC_H
#define KVDEPOT_SERVICE_RPC_H

#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include <grpc/grpc.h>
#include <protobuf-c/protobuf-c.h>

#include "auth.h"
#include "compute.h"
#include "config.h"
#include "kvdepot/status.h"
#include "store.h"

/* State shared by every call: set up by main() before the server starts. */
typedef struct kvd_service {
    kvd_store *store;
    const kvd_config *cfg;
    uint32_t page_tokens;
    atomic_int serving; /* 1 once ready, 0 again when shutdown begins: health
                           and /readyz report it */
    /* The tokens and quota table; replaced on SIGHUP. NULL = no checks (unit
     * tests). Read it with kvd_service_auth(), which takes a reference. */
    kvd_auth *auth;
    pthread_mutex_t auth_mu;
} kvd_service;

/* 0 when the store's device (if any) was left unusable by an error. */
int kvd_service_device_ok(kvd_store *st);
/* 0 when the store cannot write (kvd_store_broken) or its device is
 * unusable: health and readiness say NOT_SERVING. */
int kvd_service_store_ok(kvd_store *st);

/* Per-call context handed to handlers. */
typedef struct kvd_req_ctx {
    kvd_service *svc;
    uint64_t req_id;
    /* The table the call was authenticated against (a reference, released
     * when the call ends) and the caller; both NULL = unrestricted. */
    kvd_auth *auth;
    const kvd_principal *principal;
    /* The caller's deadline (gpr_inf_future when none was set; an all-zero
     * value, as in a context built outside a call, also means none). */
    gpr_timespec deadline;
} kvd_req_ctx;

/* 1 when the call's deadline has passed: the caller has already been told
 * DEADLINE_EXCEEDED, so work whose result it would never see (such as
 * committing an Append) must not take effect. */
int kvd_ctx_expired(const kvd_req_ctx *ctx);

/* What a method does to stored data, for the token's access rights. */
typedef enum kvd_access {
    KVD_ACCESS_READ = 0,
    KVD_ACCESS_WRITE = 1,
    KVD_ACCESS_OPEN = 2, /* no token needed: health checks */
} kvd_access;

/* A reference to the current tokens table (NULL when none); release with
 * kvd_auth_unref(). */
kvd_auth *kvd_service_auth(kvd_service *svc);

/* A sequence id as the store keys it. With a tokens file, ids live in a
 * namespace per tenant: "<tenant>/" then the id the client gave, so two
 * tenants can each own "req-1" and another tenant's sequence is, to a
 * caller, one that does not exist. Without one, the id as given. */
typedef struct kvd_seq_key {
    uint8_t id[KVD_SEQ_ID_MAX];
    size_t len;
    size_t ns; /* namespace bytes before the client's id */
} kvd_seq_key;

/* Check a wire id (kvd_check_seq_id, naming `field`) and key it. */
int kvd_ctx_seq_key(const kvd_req_ctx *ctx, const ProtobufCBinaryData *wire, const char *field,
                    kvd_seq_key *out, kvd_error *err);
/* The caller's namespace alone (ns == len): every id in it sorts after. */
void kvd_ctx_seq_ns(const kvd_req_ctx *ctx, kvd_seq_key *out);
/* A store id of the caller's namespace as the caller knows it (id->data
 * and id->len moved past the namespace). */
void kvd_ctx_seq_wire(const kvd_req_ctx *ctx, ProtobufCBinaryData *id);

/* Longest engine block hash (proto: "Engine block hashes"). */
#define KVD_ENGINE_HASH_MAX 64

/*
 * Engine block hashes as the prefix index's page hashes. h[0..n) name the
 * engine blocks first_block .. first_block + n - 1 of block_tokens tokens
 * each (block_tokens must divide the server's page size); *out (malloc'd,
 * *nout entries, NULL when none) gets, in order, the hash of every page
 * whose last engine block is among them: the name of that block keyed by
 * the caller's tenant (XXH3-64 of tenant, 0, name; seed
 * KVD_ENGINE_HASH_SEED). Errors (KVD_EINVAL) name `field`.
 */
#define KVD_ENGINE_HASH_SEED 0x6b76646570656e67ull
int kvd_ctx_engine_pages(const kvd_req_ctx *ctx, const ProtobufCBinaryData *h, size_t n,
                         uint32_t block_tokens, uint64_t first_block, const char *field,
                         uint64_t **out, size_t *nout, kvd_error *err);

/* PERMISSION_DENIED unless the caller may use `model`. */
int kvd_ctx_check_model(kvd_req_ctx *ctx, const char *model, kvd_error *err);
/* The same for the model of a stored sequence (NOT_FOUND when there is
 * none); free when the caller is unrestricted. */
int kvd_ctx_check_seq(kvd_req_ctx *ctx, const void *id, size_t id_len, kvd_error *err);

typedef enum kvd_rpc_kind {
    KVD_RPC_UNARY,
    KVD_RPC_CLIENT_STREAM,
    KVD_RPC_SERVER_STREAM,
} kvd_rpc_kind;

/* Returned by a server-streaming next() that has nothing to send now and
 * wants the call kept open until the client or the shutdown ends it. */
#define KVD_STREAM_HOLD 1

typedef int (*kvd_unary_fn)(kvd_req_ctx *ctx, const ProtobufCMessage *req,
                            grpc_byte_buffer **reply, kvd_error *err);

typedef struct kvd_stream_ops {
    /* Client streaming. recv() is given each message as received (the server
     * destroys it afterwards); finish() runs at half-close and fills *reply. */
    int (*recv)(kvd_req_ctx *ctx, void **state, grpc_byte_buffer *msg, kvd_error *err);
    int (*finish)(kvd_req_ctx *ctx, void **state, grpc_byte_buffer **reply, kvd_error *err);
    /* Server streaming. start() sees the decoded request (freed after it
     * returns, so copy what must outlive it); next() fills *msg with the next
     * message, or NULL at the end of the stream, or returns KVD_STREAM_HOLD. */
    int (*start)(kvd_req_ctx *ctx, const ProtobufCMessage *req, void **state, kvd_error *err);
    int (*next)(kvd_req_ctx *ctx, void *state, grpc_byte_buffer **msg, kvd_error *err);
    /* For a stream held open (KVD_STREAM_HOLD): the message to send when the
     * server shuts down, or NULL for none. Called from the shutdown thread. */
    grpc_byte_buffer *(*last)(kvd_req_ctx *ctx, void *state);
    /* Called exactly once when the call ends, however it ends (NULL state is
     * possible): an unfinished append is aborted here. */
    void (*release)(void *state);
} kvd_stream_ops;

typedef struct kvd_method {
    const char *path; /* "/kvdepot.v1.KVDepot/Append" */
    const char *name; /* "Append", for logs */
    kvd_rpc_kind kind;
    /* Request type for unary and server-streaming methods (the server
     * decodes it); client-streaming handlers decode their own messages. */
    const ProtobufCMessageDescriptor *request;
    kvd_unary_fn unary;
    const kvd_stream_ops *stream;
    kvd_access access;
} kvd_method;

/* The method table (methods.c). */
extern const kvd_method kvd_methods[];
extern const size_t kvd_methods_count;

/* Find a method by its full path; NULL when unknown. */
const kvd_method *kvd_method_find(const char *path, size_t len);

/* Pack a message into a fresh byte buffer (one slice, one copy). Returns NULL
 * when out of memory. */
grpc_byte_buffer *kvd_pack(const ProtobufCMessage *msg);
/* kvd_pack with the packed size already known (protobuf_c_message_get_packed_size
 * walks every element of repeated fields: a reply's tokens, once is enough). */
grpc_byte_buffer *kvd_pack_n(const ProtobufCMessage *msg, size_t n);

/* Recount quota usage and the store gauges from the store (after a forced
 * model delete took sequences with it). */
void kvd_usage_rescan(kvd_req_ctx *ctx);

/* Reserve quota for the caller's tenant(s) (kvd_quota_reserve). Before
 * refusing, recount from the store, at most once a second, since sequences
 * the store removed by itself (TTL, disk limit) count until recounted.
 * Refusals are counted in the metrics. */
int kvd_ctx_quota_reserve(kvd_req_ctx *ctx, const char *model, uint64_t sequences,
                          uint64_t bytes, kvd_error *err);

struct Kvdepot__V1__CreateSequenceRequest;
/* CreateSequence's work for the sequence `key` (req->sequence_id is not
 * read): checks, quota, the store's create, the gauges. *info is the new
 * sequence (kvd_seq_info_clear it) on success. pending: made for an append
 * (kvd_seq_create_opts.pending; kvd_store_seq_pending_done when it ends). */
int kvd_ctx_create_sequence(kvd_req_ctx *ctx, const struct Kvdepot__V1__CreateSequenceRequest *req,
                            const kvd_seq_key *key, int pending, kvd_seq_info *info,
                            kvd_error *err);
/* The sequence `key` of an append with header.create: stat it, or create
 * it from `create` (pending) when it does not exist: *made is then 1 and
 * *info the new sequence, else *info as it is (kvd_seq_info_clear it
 * either way on success). create->sequence_id, when not empty, must be
 * the header's `wire_id`; an existing sequence must be of create->model
 * (else KVD_EPRECOND). */
int kvd_ctx_stat_or_create(kvd_req_ctx *ctx, const struct Kvdepot__V1__CreateSequenceRequest *cr,
                           const ProtobufCBinaryData *wire_id, const kvd_seq_key *key,
                           kvd_seq_info *info, int *made, kvd_error *err);
/* Undo kvd_ctx_create_sequence when the sequence is still as `was`
 * describes it (created then, no tokens added since): delete it and give
 * back its quota and gauges. 0, or why it stayed. */
int kvd_undo_create_sequence(kvd_service *svc, kvd_auth *auth, const kvd_seq_key *key,
                             const kvd_seq_info *was, kvd_error *err);

/* What service/compute runs a call with: the store, its backend, and a
 * guard *g made of the call's tenant check and byte quota (g must outlive
 * *c's use). */
void kvd_ctx_compute(kvd_req_ctx *ctx, kvd_compute_guard *g, kvd_compute *c);

/* Handlers, by file. */
int kvd_h_put_model(kvd_req_ctx *, const ProtobufCMessage *, grpc_byte_buffer **, kvd_error *);
int kvd_h_get_model(kvd_req_ctx *, const ProtobufCMessage *, grpc_byte_buffer **, kvd_error *);
int kvd_h_list_models(kvd_req_ctx *, const ProtobufCMessage *, grpc_byte_buffer **, kvd_error *);
int kvd_h_delete_model(kvd_req_ctx *, const ProtobufCMessage *, grpc_byte_buffer **,
                       kvd_error *);
int kvd_h_create_sequence(kvd_req_ctx *, const ProtobufCMessage *, grpc_byte_buffer **,
                          kvd_error *);
int kvd_h_lookup(kvd_req_ctx *, const ProtobufCMessage *, grpc_byte_buffer **, kvd_error *);
int kvd_h_stat_sequence(kvd_req_ctx *, const ProtobufCMessage *, grpc_byte_buffer **,
                        kvd_error *);
int kvd_h_list_sequences(kvd_req_ctx *, const ProtobufCMessage *, grpc_byte_buffer **,
                         kvd_error *);
int kvd_h_delete_sequence(kvd_req_ctx *, const ProtobufCMessage *, grpc_byte_buffer **,
                          kvd_error *);
int kvd_h_health_check(kvd_req_ctx *, const ProtobufCMessage *, grpc_byte_buffer **,
                       kvd_error *);
/* compute.c */
int kvd_h_attend(kvd_req_ctx *, const ProtobufCMessage *, grpc_byte_buffer **, kvd_error *);
int kvd_h_plan_fetch(kvd_req_ctx *, const ProtobufCMessage *, grpc_byte_buffer **, kvd_error *);
int kvd_h_search(kvd_req_ctx *, const ProtobufCMessage *, grpc_byte_buffer **, kvd_error *);
int kvd_h_sparse_attend(kvd_req_ctx *, const ProtobufCMessage *, grpc_byte_buffer **,
                        kvd_error *);
int kvd_h_pq_centroids(kvd_req_ctx *, const ProtobufCMessage *, grpc_byte_buffer **, kvd_error *);
int kvd_h_pq_rebuild(kvd_req_ctx *, const ProtobufCMessage *, grpc_byte_buffer **, kvd_error *);
/* tiers.c */
int kvd_h_stats(kvd_req_ctx *, const ProtobufCMessage *, grpc_byte_buffer **, kvd_error *);
int kvd_h_backup(kvd_req_ctx *, const ProtobufCMessage *, grpc_byte_buffer **, kvd_error *);
int kvd_h_evict_sequence(kvd_req_ctx *, const ProtobufCMessage *, grpc_byte_buffer **,
                         kvd_error *);
extern const kvd_stream_ops kvd_append_ops;
extern const kvd_stream_ops kvd_append_pages_ops; /* append_pages.c */
extern const kvd_stream_ops kvd_read_ops;
extern const kvd_stream_ops kvd_health_watch_ops;
extern const kvd_stream_ops kvd_upload_artifacts_ops; /* artifacts.c */
extern const kvd_stream_ops kvd_get_artifacts_ops;
extern const kvd_stream_ops kvd_calibrate_ops; /* calibrate.c */

#endif /* KVDEPOT_SERVICE_RPC_H */
