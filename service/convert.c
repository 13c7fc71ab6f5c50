#include "convert.h"

#include <string.h>

#include <grpc/byte_buffer_reader.h>
#include <grpc/slice.h>

#include "rpc.h"

void kvd_seq_info_to_pb(const kvd_seq_info *in, Kvdepot__V1__SequenceInfo *out)
{
    kvdepot__v1__sequence_info__init(out);
    out->sequence_id.data = (uint8_t *)in->id;
    out->sequence_id.len = in->id_len;
    out->model = (char *)in->model;
    out->num_tokens = in->num_tokens;
    out->n_layer_tokens = in->layer_tokens ? in->num_layers : 0;
    out->layer_tokens = in->layer_tokens;
    out->page_tokens = in->page_tokens;
    out->sealed_pages = in->sealed_pages;
    out->stored_bytes = in->stored_bytes;
    out->created_unix_ms = in->created_unix_ms;
    out->prefix_blocks = in->prefix_blocks;
    out->n_block_hashes = in->block_hashes ? in->n_block_hashes : 0;
    out->block_hashes = in->block_hashes;
    out->activation_tokens = in->activation_tokens;
}

void kvd_model_to_pb(const kvd_model_info *in, Kvdepot__V1__Model *out)
{
    kvdepot__v1__model__init(out);
    out->name = (char *)in->name;
    out->revision = (char *)in->revision;
    out->num_layers = in->num_layers;
    out->num_kv_heads = in->num_kv_heads;
    out->num_q_heads = in->num_q_heads;
    out->head_dim = in->head_dim;
    out->hidden_size = in->hidden_size;
    out->dtype = (Kvdepot__V1__DType)in->dtype;
    out->created_unix_ms = in->created_unix_ms;
}

int kvd_model_from_pb(const Kvdepot__V1__Model *in, kvd_model_info *out, kvd_error *err)
{
    memset(out, 0, sizeof *out);
    size_t nlen = in->name ? strlen(in->name) : 0;
    size_t rlen = in->revision ? strlen(in->revision) : 0;
    if (nlen == 0)
        return kvd_error_set(err, KVD_EINVAL, "model.name: must not be empty");
    if (nlen > KVD_MODEL_NAME_MAX)
        return kvd_error_set(err, KVD_EINVAL, "model.name: %zu bytes, at most %d allowed", nlen,
                             KVD_MODEL_NAME_MAX);
    if (rlen > KVD_REVISION_MAX)
        return kvd_error_set(err, KVD_EINVAL, "model.revision: %zu bytes, at most %d allowed",
                             rlen, KVD_REVISION_MAX);
    memcpy(out->name, in->name, nlen);
    if (rlen)
        memcpy(out->revision, in->revision, rlen);
    out->num_layers = in->num_layers;
    out->num_kv_heads = in->num_kv_heads;
    out->num_q_heads = in->num_q_heads;
    out->head_dim = in->head_dim;
    out->hidden_size = in->hidden_size;
    out->dtype = (kvd_dtype)in->dtype;
    return 0;
}

int kvd_bb_flatten(grpc_byte_buffer *bb, grpc_slice *out)
{
    if (bb->type == GRPC_BB_RAW && bb->data.raw.compression == GRPC_COMPRESS_NONE &&
        bb->data.raw.slice_buffer.count == 1) {
        *out = grpc_slice_ref(bb->data.raw.slice_buffer.slices[0]);
        return 0;
    }
    grpc_byte_buffer_reader rd;
    if (!grpc_byte_buffer_reader_init(&rd, bb))
        return -1;
    *out = grpc_byte_buffer_reader_readall(&rd);
    grpc_byte_buffer_reader_destroy(&rd);
    return 0;
}

ProtobufCMessage *kvd_bb_unpack(const ProtobufCMessageDescriptor *desc, grpc_byte_buffer *bb)
{
    grpc_slice s;
    if (kvd_bb_flatten(bb, &s) != 0)
        return NULL;
    ProtobufCMessage *m =
        protobuf_c_message_unpack(desc, NULL, GRPC_SLICE_LENGTH(s), GRPC_SLICE_START_PTR(s));
    grpc_slice_unref(s);
    return m;
}

grpc_byte_buffer *kvd_pack(const ProtobufCMessage *msg)
{
    size_t n = protobuf_c_message_get_packed_size(msg);
    grpc_slice s = grpc_slice_malloc(n);
    protobuf_c_message_pack(msg, GRPC_SLICE_START_PTR(s));
    grpc_byte_buffer *bb = grpc_raw_byte_buffer_create(&s, 1);
    grpc_slice_unref(s);
    return bb;
}
