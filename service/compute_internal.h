/*
 * Helpers shared by the compute handlers: Attend and PlanFetch (compute.c),
 * Search and SparseAttend (search.c). Internal to kvd_service.
 */
#ifndef KVDEPOT_SERVICE_COMPUTE_INTERNAL_H
#define KVDEPOT_SERVICE_COMPUTE_INTERNAL_H

#include <stdint.h>

#include "kvdepot/backend.h"
#include "rpc.h"

/* What a compute request needs to know about one sequence. */
typedef struct kvd__seq_ctx {
    kvd_model_info model;
    uint64_t layer_tokens; /* tokens stored in the layer asked for */
    uint64_t stored_bytes;
    uint64_t num_tokens;
    uint32_t num_layers;
    uint64_t activation_tokens; /* on every layer */
    uint64_t activation_bytes;  /* part of stored_bytes */
} kvd__seq_ctx;

/* Check `id` (named `field` in errors) and `layer`, fill *out from the
 * sequence's stat and model. KVD_ENOTFOUND, KVD_EINVAL. */
int kvd__load_seq(kvd_req_ctx *ctx, const ProtobufCBinaryData *id, const char *field,
                  uint32_t layer, kvd__seq_ctx *out, kvd_error *err);

/* Resolve [start, start + *count) against the tokens stored (count 0 = to
 * the end). KVD_ERANGE past the end. */
int kvd__token_range(const char *what, uint64_t start, uint64_t *count, uint64_t stored,
                     kvd_error *err);

/* Pack m into *reply; KVD_ENOMEM when it exceeds max-message-bytes. */
int kvd__reply_msg(kvd_req_ctx *ctx, const ProtobufCMessage *m, grpc_byte_buffer **reply,
                   kvd_error *err);

/* Read tokens [start, start + n) of one layer (K then V, each
 * [token][kv_head][head_dim], model dtype) into buf of `bytes` bytes. */
int kvd__read_window(kvd_store *st, const ProtobufCBinaryData *id, uint32_t layer, uint64_t start,
                     uint64_t n, uint8_t *buf, uint64_t bytes, kvd_error *err);

/* scale, or 1/sqrt(D) when 0. */
float kvd__default_scale(float scale, uint32_t D);

#endif /* KVDEPOT_SERVICE_COMPUTE_INTERNAL_H */
