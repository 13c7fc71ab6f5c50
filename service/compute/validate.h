/*
 * Request field checks done before anything reaches the store. Each returns 0
 * or KVD_EINVAL with a message that starts with the field's name, so a client
 * can tell which part of its request was wrong.
 */
#ifndef KVDEPOT_SERVICE_VALIDATE_H
#define KVDEPOT_SERVICE_VALIDATE_H

#include <stddef.h>
#include <stdint.h>

#include "kvdepot/status.h"

/* What a client may name a sequence: 1..256 bytes of anything (kvdepotd
 * puts a tenant's namespace before it, up to KVD_SEQ_ID_MAX in all). */
#define KVD_WIRE_SEQ_ID_MAX 256
/* A store id (the service's key of one: compute takes those), 1 to
 * KVD_SEQ_ID_MAX bytes. */
int kvd_check_key_id(const uint8_t *id, size_t len, const char *field, kvd_error *err);
int kvd_check_seq_id(const uint8_t *id, size_t len, const char *field, kvd_error *err);

/* Non-empty, at most KVD_MODEL_NAME_MAX bytes, [A-Za-z0-9._-]. */
int kvd_check_model_name(const char *name, const char *field, kvd_error *err);

/* One of the dtypes engines exchange (f16, bf16, f32). */
int kvd_check_dtype(int dtype, const char *field, kvd_error *err);

/* start + count must not overflow the field's width (bits = 32 or 64). */
int kvd_check_range(uint64_t start, uint64_t count, unsigned bits, const char *start_field,
                    const char *count_field, kvd_error *err);

#endif /* KVDEPOT_SERVICE_VALIDATE_H */
