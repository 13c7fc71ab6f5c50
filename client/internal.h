/*
 * libkvdepot internals shared by client.c and stream.c, and the test-only
 * raw call entry point. Not installed.
 */
#ifndef KVDEPOT_CLIENT_INTERNAL_H
#define KVDEPOT_CLIENT_INTERNAL_H

#include "kvdepot.h"

#include <grpc/grpc.h>
#include <protobuf-c/protobuf-c.h>

/* RPC methods, index into the client's registered-call table. */
enum kvdepot__method {
    KVDEPOT__PUT_MODEL,
    KVDEPOT__GET_MODEL,
    KVDEPOT__LIST_MODELS,
    KVDEPOT__DELETE_MODEL,
    KVDEPOT__CREATE_SEQUENCE,
    KVDEPOT__APPEND,
    KVDEPOT__READ,
    KVDEPOT__LOOKUP,
    KVDEPOT__STAT_SEQUENCE,
    KVDEPOT__LIST_SEQUENCES,
    KVDEPOT__DELETE_SEQUENCE,
    KVDEPOT__HEALTH_CHECK,
    KVDEPOT__EVICT_SEQUENCE,
    KVDEPOT__STATS,
    KVDEPOT__BACKUP,
    KVDEPOT__METHOD_COUNT
};

typedef struct kvdepot__cluster kvdepot__cluster;

struct kvdepot_client {
    /* Non-NULL for a client over several servers (shard.c); channel and
     * methods are then unused and every call is forwarded to members. */
    kvdepot__cluster *cluster;
    grpc_channel *channel;
    void *methods[KVDEPOT__METHOD_COUNT]; /* grpc_channel_register_call handles */
    char *address;
    uint32_t deadline_ms;
    size_t max_message_bytes;
    size_t chunk_bytes;
    int wait_for_ready;
    kvdepot_log_fn log;
    void *log_user;
    kvdepot_log_level log_level;
    kvdepot_progress_fn progress; /* kvdepot_set_progress */
    void *progress_user;
    /* `authorization` metadata sent with every call (token set), else
     * n_md == 0. The value slice points into auth_value. */
    char *auth_value;
    grpc_metadata auth_md;
    size_t n_md;
};

/* kvdepot_sequence_append / _read on one server, reporting progress to fn
 * (a cluster passes its own, its members' are unused). */
int kvdepot__append(kvdepot_client *c, const kvdepot_append_args *a, kvdepot_sequence_info *out,
                    kvdepot_progress_fn fn, void *user);
int kvdepot__read(kvdepot_client *c, const kvdepot_read_args *a, kvdepot_read_result *out,
                  kvdepot_progress_fn fn, void *user);

/* Attach the client's per-call metadata (the bearer token) to a
 * SEND_INITIAL_METADATA op. */
void kvdepot__initial_md(const kvdepot_client *c, grpc_op *op);

/*
 * One in-flight call: its own pluck completion queue, so any number of
 * threads can run calls on one channel without sharing a queue.
 */
typedef struct kvdepot__call {
    kvdepot_client *client;
    const char *name; /* method name for messages */
    grpc_completion_queue *cq;
    grpc_call *call;
    grpc_metadata_array initial_md;
    grpc_metadata_array trailing_md;
    grpc_status_code status;
    grpc_slice details;
} kvdepot__call;

/* Start a call of a registered method (method >= 0) or of an arbitrary path
 * (method < 0, path used). Returns 0 or a status with the error set. */
int kvdepot__call_start(kvdepot_client *c, int method, const char *path, kvdepot__call *k);
/* Run one batch and wait for it; returns the completion's success flag, or
 * -1 when gRPC refused the batch. */
int kvdepot__call_batch(kvdepot__call *k, const grpc_op *ops, size_t nops, void *tag);
/* Open a server-streaming call: send the initial metadata, the request and
 * the half-close, and receive the initial metadata, in one batch. Returns
 * the completion's success flag, or -1 when gRPC refused the batch (or send
 * is NULL). The caller keeps ownership of send. */
int kvdepot__call_send_request(kvdepot__call *k, grpc_byte_buffer *send, void *tag);
/* Receive the next message of a streaming response; NULL at the end of the
 * stream or on failure (the call's status then tells which). */
grpc_byte_buffer *kvdepot__call_recv(kvdepot__call *k, void *tag);
/* Wait for a batch started earlier with kvdepot__call_start_batch. */
int kvdepot__call_wait(kvdepot__call *k, void *tag);
/* Start a batch without waiting; 0 or -1. */
int kvdepot__call_start_batch(kvdepot__call *k, const grpc_op *ops, size_t nops, void *tag);
/* Map the received status to a return code, setting the thread's error
 * message from the status details. */
int kvdepot__call_result(kvdepot__call *k);
/* Release everything the call holds. Safe after a failed start. */
void kvdepot__call_end(kvdepot__call *k);

/* Serialize a protobuf message into a byte buffer; NULL on allocation failure. */
grpc_byte_buffer *kvdepot__pack(const ProtobufCMessage *msg);

/* Set the thread's error message and return code. */
int kvdepot__fail(kvdepot_client *c, int code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
/* Clear the thread's error message (start of every call). */
void kvdepot__clear_error(void);
/* Log through the client's callback when level is enabled. */
void kvdepot__log(kvdepot_client *c, kvdepot_log_level level, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/*
 * Several servers (shard.c). kvdepot__cluster_wanted tells whether an
 * address names several endpoints; kvdepot__cluster_connect builds the
 * client for it. The public functions forward to the kvdepot__cluster_*
 * twin of the same arguments when client->cluster is set.
 */
int kvdepot__cluster_wanted(const char *address);
int kvdepot__cluster_connect(const kvdepot_options *opt, kvdepot_client **out);
void kvdepot__cluster_close(kvdepot_client *c);
int kvdepot__cluster_health_check(kvdepot_client *c, const char *service, kvdepot_serving *out);
int kvdepot__cluster_model_put(kvdepot_client *c, const kvdepot_model *model, int replace,
                               kvdepot_model *out, int *created);
int kvdepot__cluster_model_get(kvdepot_client *c, const char *name, kvdepot_model *out);
int kvdepot__cluster_model_list(kvdepot_client *c, kvdepot_model **out, size_t *count);
int kvdepot__cluster_model_delete(kvdepot_client *c, const char *name, int force,
                                  uint64_t *deleted);
int kvdepot__cluster_sequence_create(kvdepot_client *c, const kvdepot_create_args *a,
                                     kvdepot_sequence_info *out);
int kvdepot__cluster_sequence_stat(kvdepot_client *c, const void *id, size_t id_len,
                                   kvdepot_sequence_info *out);
int kvdepot__cluster_sequence_list(kvdepot_client *c, const char *model,
                                   kvdepot_sequence_info **out, size_t *count);
int kvdepot__cluster_sequence_delete(kvdepot_client *c, const void *id, size_t id_len,
                                     uint64_t *freed);
int kvdepot__cluster_sequence_append(kvdepot_client *c, const kvdepot_append_args *a,
                                     kvdepot_sequence_info *out);
int kvdepot__cluster_sequence_read(kvdepot_client *c, const kvdepot_read_args *a,
                                   kvdepot_read_result *out);
int kvdepot__cluster_sequence_evict(kvdepot_client *c, const void *id, size_t id_len,
                                    uint64_t *pages, uint64_t *bytes);
int kvdepot__cluster_prefix_lookup(kvdepot_client *c, const char *model, const uint64_t *hashes,
                                   size_t n, uint64_t *matched_blocks, uint64_t *matched_tokens);
int kvdepot__cluster_engine_lookup(kvdepot_client *c, const char *model,
                                   const kvdepot_engine_hashes *h, uint64_t *matched_blocks,
                                   uint64_t *matched_tokens);
int kvdepot__cluster_attend(kvdepot_client *c, uint32_t layer, float scale, kvdepot_dtype q_dtype,
                            const kvdepot_attend_query *queries, size_t n,
                            kvdepot_attend_result *out);
int kvdepot__cluster_plan_fetch(kvdepot_client *c, const void *id, size_t id_len, double bw,
                                double flops, uint32_t layer_start, uint32_t num_layers,
                                int assume_activations, kvdepot_fetch_plan *out);
int kvdepot__cluster_search(kvdepot_client *c, const kvdepot_search_args *a,
                            kvdepot_search_result *out);
int kvdepot__cluster_pq_rebuild(kvdepot_client *c, const void *id, size_t id_len,
                                uint32_t layer_start, uint32_t num_layers, uint32_t *layers_rebuilt,
                                uint64_t *tokens_indexed, kvdepot_sequence_info *info);
int kvdepot__cluster_pq_centroids(kvdepot_client *c, const void *id, size_t id_len, uint32_t layer,
                                  kvdepot_pq_centroids *out);
int kvdepot__cluster_sparse_attend(kvdepot_client *c, const kvdepot_search_args *a, float scale,
                                   kvdepot_attend_result *out, kvdepot_search_result *tokens);
int kvdepot__cluster_read_pages(kvdepot_client *c, const kvdepot_read_args *a,
                                kvdepot_page **pages, size_t *count);
int kvdepot__cluster_append_pages(kvdepot_client *c, const kvdepot_append_pages_args *a,
                                  kvdepot_sequence_info *out);
int kvdepot__cluster_artifacts_upload(kvdepot_client *c, const char *model,
                                      const kvdepot_artifact *a, size_t count, uint32_t *stored);
int kvdepot__cluster_artifacts_get(kvdepot_client *c, const char *model, const int *kinds,
                                   size_t nkinds, kvdepot_artifact **out, size_t *count);
int kvdepot__cluster_calibrate(kvdepot_client *c, const kvdepot_calibrate_args *a,
                               const kvdepot_calibrate_sample *samples, size_t count,
                               kvdepot_calibrate_result *out);

/* Fill a public sequence info from the wire form; 0 or KVDEPOT_ENOMEM. */
int kvdepot__info_from_pb(kvdepot_client *c, const void *pb_info, kvdepot_sequence_info *out);
/* A wire CodecSpec (Kvdepot__V1__CodecSpec) into out (zeroed by the caller);
 * svd_widths malloc'd when reported. 0 or -1 (memory). */
int kvdepot__spec_from_pb(const void *pb, kvdepot_codec_spec *out);

/*
 * A client-streaming or unary call with arbitrary message bytes: the
 * transport of kvdepot__call_messages, and for tests the way to send what
 * libkvdepot itself never sends (truncated or oversized Append streams,
 * garbage bytes, messages over the size limit, streams cancelled half-way).
 *
 * Sends msgs[0..n) as raw messages to `path` (e.g.
 * "/kvdepot.v1.KVDepot/Append"). When cancel is nonzero the call is
 * cancelled after the last message instead of half-closed. The response
 * message, if any, is returned in *resp (malloc'ed, free()) with its length.
 * Returns the call's status as a kvdepot return code.
 */
typedef struct kvdepot__raw_msg {
    const void *data;
    size_t len;
} kvdepot__raw_msg;

int kvdepot__call_raw(kvdepot_client *c, const char *path, const kvdepot__raw_msg *msgs,
                      size_t n, int cancel, void **resp, size_t *resp_len);

/*
 * A unary or client-streaming call of n protobuf messages, sent as
 * kvdepot__call_raw sends: msg(i, ctx) gives message i, packed straight into
 * the slice that is sent, while message i-1 is on its way, and before
 * message i+1 is asked for (so msg may reuse its storage). The one response is unpacked
 * with rdesc into *resp (free with protobuf_c_message_free_unpacked); `what`
 * names the call in error messages.
 */
typedef const ProtobufCMessage *(*kvdepot__msg_fn)(size_t i, void *ctx);
int kvdepot__call_messages(kvdepot_client *c, const char *what, const char *path, size_t n,
                           kvdepot__msg_fn msg, void *ctx, const ProtobufCMessageDescriptor *rdesc,
                           ProtobufCMessage **resp);

/*
 * Test-only: encode the first Append message (header + the first data
 * bytes), as libkvdepot does, so tests can build malformed streams from
 * well-formed pieces. Returns a malloc'ed buffer (free()) and its length.
 */
void *kvdepot__encode_append(const kvdepot_append_args *a, const void *data, size_t data_len,
                             int with_header, size_t *len);

/* The process-wide single-thread CPU backend of the local kernels
 * (compute.c); NULL when it cannot be created. */
struct kvd_backend;
struct kvd_backend *kvdepot__cpu_backend(void);

/* The wire form of kvdepot_codecs: NULL for NULL, else a message pointing
 * into *storage (compute.c). */
typedef struct kvdepot__codecs_pb {
    ProtobufCMessage *msg; /* the SequenceCodecs, or NULL */
    _Alignas(16) unsigned char storage[1024];
} kvdepot__codecs_pb;
void *kvdepot__codecs_to_pb(const kvdepot_codecs *c, kvdepot__codecs_pb *pb);
/* CreateSequenceRequest *req from a (its engine prefix names malloc'd, to
 * free once packed; codecs in *cpb); KVDEPOT_EINVAL for NULL arguments,
 * naming `what`, failing c. */
struct Kvdepot__V1__CreateSequenceRequest;
int kvdepot__create_pb(kvdepot_client *c, const kvdepot_create_args *a, const char *what,
                       struct Kvdepot__V1__CreateSequenceRequest *req, kvdepot__codecs_pb *cpb);
/* Engine block names as repeated bytes fields: *out (malloc'd; NULL when
 * there are none) points into h->bytes. KVDEPOT_OK, KVDEPOT_EINVAL (NULL
 * bytes, a length outside 1..64) or KVDEPOT_ENOMEM, failing c. */
int kvdepot__engine_pb(kvdepot_client *c, const kvdepot_engine_hashes *h, const char *what,
                       ProtobufCBinaryData **out);

#endif /* KVDEPOT_CLIENT_INTERNAL_H */
