/*
 * Conversions between store structs and wire messages, and byte-buffer
 * helpers shared by the handlers.
 */
#ifndef KVDEPOT_SERVICE_CONVERT_H
#define KVDEPOT_SERVICE_CONVERT_H

#include <grpc/grpc.h>

#include "kvdepot/v1/kvdepot.pb-c.h"
#include "seqcodec.h"
#include "store.h"

/* Fill `out` (initialised here) so that it points into `in`: no copies, so
 * `in` must outlive every use of `out` (typically until it is packed). */
void kvd_seq_info_to_pb(const kvd_seq_info *in, Kvdepot__V1__SequenceInfo *out);
/* in's recovery loss into out, and info->recovery_loss = out when it has one. */
void kvd_seq_loss_to_pb(const kvd_seq_info *in, Kvdepot__V1__WalRecoveryLoss *out,
                        Kvdepot__V1__SequenceInfo *info);
void kvd_model_to_pb(const kvd_model_info *in, Kvdepot__V1__Model *out);

/* A sequence's codecs in wire form: the messages SequenceInfo.codecs and
 * ReadHeader.codecs point at, with the kept SVD widths they own. */
typedef struct kvd_codecs_pb {
    Kvdepot__V1__SequenceCodecs c;
    Kvdepot__V1__CodecSpec side[2];
    Kvdepot__V1__QuantSpec quant[2];
    Kvdepot__V1__VQSpec vq[2];
    Kvdepot__V1__SVDSpec svd[2];
    Kvdepot__V1__PQSpec pq;
    uint32_t *widths[2];
} kvd_codecs_pb;

/* Fill out (initialised here) with the stored codecs of sequence id, as
 * SequenceInfo and ReadHeader report them (see SequenceCodecs): with_widths,
 * the kept SVD widths from its artifact snapshot (loaded for that; without,
 * an SVD side reports none). stores_activations from the sequence's info.
 * Free with kvd_codecs_pb_clear, also after a failure. KVD_ECORRUPT for a
 * damaged codec record or snapshot. */
int kvd_codecs_pb_get(kvd_store *st, const void *id, size_t id_len, int stores_activations,
                      int with_widths, kvd_codecs_pb *out, kvd_error *err);
/* The conversion itself: c as loaded (with its snapshot for SVD widths). */
void kvd_codecs_to_pb(const kvd_seq_codecs *c, int stores_activations, kvd_codecs_pb *out);
void kvd_codecs_pb_clear(kvd_codecs_pb *p);
/* si->codecs = the codecs of the sequence of info (kvd_codecs_pb_get into
 * cp, which must outlive si's use). */
int kvd_seq_info_codecs_pb(kvd_store *st, const kvd_seq_info *info, int with_widths,
                           Kvdepot__V1__SequenceInfo *si, kvd_codecs_pb *cp, kvd_error *err);

/* Copy a wire model into a store model, checking string lengths (the store
 * checks the rest). Returns 0 or KVD_EINVAL naming the field. */
int kvd_model_from_pb(const Kvdepot__V1__Model *in, kvd_model_info *out, kvd_error *err);

/* The codecs of a CreateSequenceRequest (NULL for all raw), checked against
 * the model and page size. KVD_EINVAL naming the field; KVD_EPRECOND for
 * activations on a model without a hidden_size. */
int kvd_codecs_from_pb(const Kvdepot__V1__SequenceCodecs *c, const kvd_model_info *m,
                       uint32_t page_tokens, kvd_seq_codecs *out, kvd_error *err);

/* The contents of a received message as one contiguous slice: a new
 * reference to the single slice when there is one, else a merged copy.
 * Unref the result with grpc_slice_unref. Returns 0, or -1 when the buffer
 * cannot be read (e.g. it fails to decompress). */
int kvd_bb_flatten(grpc_byte_buffer *bb, grpc_slice *out);

/* Decode a received message of the given type; NULL when it does not parse,
 * or when one of its string fields (nested ones too) holds a NUL byte or
 * bytes that are not UTF-8: then *why (may be NULL) says which, with
 * KVD_EINVAL; otherwise why->code stays 0. Free the message with
 * protobuf_c_message_free_unpacked(msg, NULL). */
ProtobufCMessage *kvd_bb_unpack(const ProtobufCMessageDescriptor *desc, grpc_byte_buffer *bb,
                                kvd_error *why);

/* kvd_bb_unpack of the message in p[0, n); a string field found wrong is
 * named under `path` (e.g. "header": "header.create.model"; "" for none). */
ProtobufCMessage *kvd_unpack(const ProtobufCMessageDescriptor *desc, const uint8_t *p, size_t n,
                             const char *path, kvd_error *why);

/* One protobuf varint at p[*i], bounds-checked, *i moved past it: 1, or 0
 * when it is malformed or runs past n. */
int kvd_wire_varint(const uint8_t *p, size_t n, size_t *i, uint64_t *v);

#endif /* KVDEPOT_SERVICE_CONVERT_H */
