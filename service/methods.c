/*
 * The method table: every RPC kvdepotd serves, in one place.
 */
#include <string.h>

#include "grpc/health/v1/health.pb-c.h"
#include "kvdepot/v1/kvdepot.pb-c.h"
#include "rpc.h"

#define KVD_SVC "/kvdepot.v1.KVDepot/"
#define HEALTH_SVC "/grpc.health.v1.Health/"

#define UNARY(svc, name, req, fn) {svc #name, #name, KVD_RPC_UNARY, &(req), fn, NULL}

const kvd_method kvd_methods[] = {
    UNARY(KVD_SVC, PutModel, kvdepot__v1__put_model_request__descriptor, kvd_h_put_model),
    UNARY(KVD_SVC, GetModel, kvdepot__v1__get_model_request__descriptor, kvd_h_get_model),
    UNARY(KVD_SVC, ListModels, kvdepot__v1__list_models_request__descriptor, kvd_h_list_models),
    UNARY(KVD_SVC, DeleteModel, kvdepot__v1__delete_model_request__descriptor,
          kvd_h_delete_model),
    UNARY(KVD_SVC, CreateSequence, kvdepot__v1__create_sequence_request__descriptor,
          kvd_h_create_sequence),
    {KVD_SVC "Append", "Append", KVD_RPC_CLIENT_STREAM, NULL, NULL, &kvd_append_ops},
    {KVD_SVC "Read", "Read", KVD_RPC_SERVER_STREAM, &kvdepot__v1__read_request__descriptor,
     NULL, &kvd_read_ops},
    UNARY(KVD_SVC, Lookup, kvdepot__v1__lookup_request__descriptor, kvd_h_lookup),
    UNARY(KVD_SVC, StatSequence, kvdepot__v1__stat_sequence_request__descriptor,
          kvd_h_stat_sequence),
    UNARY(KVD_SVC, ListSequences, kvdepot__v1__list_sequences_request__descriptor,
          kvd_h_list_sequences),
    UNARY(KVD_SVC, DeleteSequence, kvdepot__v1__delete_sequence_request__descriptor,
          kvd_h_delete_sequence),
    UNARY(HEALTH_SVC, Check, grpc__health__v1__health_check_request__descriptor,
          kvd_h_health_check),
    {HEALTH_SVC "Watch", "Watch", KVD_RPC_SERVER_STREAM,
     &grpc__health__v1__health_check_request__descriptor, NULL, &kvd_health_watch_ops},
};

const size_t kvd_methods_count = sizeof kvd_methods / sizeof kvd_methods[0];

const kvd_method *kvd_method_find(const char *path, size_t len)
{
    for (size_t i = 0; i < kvd_methods_count; i++)
        if (strlen(kvd_methods[i].path) == len && memcmp(kvd_methods[i].path, path, len) == 0)
            return &kvd_methods[i];
    return NULL;
}
