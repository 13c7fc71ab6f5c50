#include "validate.h"

#include <string.h>

#include "kvdepot/tensor.h"
#include "store.h"

int kvd_check_seq_id(const uint8_t *id, size_t len, const char *field, kvd_error *err)
{
    (void)id;
    if (len == 0)
        return kvd_error_set(err, KVD_EINVAL, "%s: must not be empty", field);
    if (len > KVD_WIRE_SEQ_ID_MAX)
        return kvd_error_set(err, KVD_EINVAL, "%s: %zu bytes, at most %d allowed", field, len,
                             KVD_WIRE_SEQ_ID_MAX);
    return 0;
}

int kvd_check_key_id(const uint8_t *id, size_t len, const char *field, kvd_error *err)
{
    (void)id;
    if (len == 0)
        return kvd_error_set(err, KVD_EINVAL, "%s: must not be empty", field);
    if (len > KVD_SEQ_ID_MAX)
        return kvd_error_set(err, KVD_EINVAL, "%s: %zu bytes, at most %d allowed", field, len,
                             KVD_SEQ_ID_MAX);
    return 0;
}

int kvd_check_model_name(const char *name, const char *field, kvd_error *err)
{
    size_t len = name ? strlen(name) : 0;
    if (len == 0)
        return kvd_error_set(err, KVD_EINVAL, "%s: must not be empty", field);
    if (len > KVD_MODEL_NAME_MAX)
        return kvd_error_set(err, KVD_EINVAL, "%s: %zu bytes, at most %d allowed", field, len,
                             KVD_MODEL_NAME_MAX);
    for (size_t i = 0; i < len; i++) {
        char c = name[i];
        int ok = (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') ||
                 c == '.' || c == '_' || c == '-';
        if (!ok)
            return kvd_error_set(err, KVD_EINVAL,
                                 "%s: byte %zu (0x%02x) is not one of [A-Za-z0-9._-]", field, i,
                                 (unsigned char)c);
    }
    if (strcmp(name, ".") == 0 || strcmp(name, "..") == 0)
        return kvd_error_set(err, KVD_EINVAL, "%s: '%s' is not a model name", field, name);
    return 0;
}

int kvd_check_dtype(int dtype, const char *field, kvd_error *err)
{
    if (dtype == KVD_DTYPE_F16 || dtype == KVD_DTYPE_BF16 || dtype == KVD_DTYPE_F32)
        return 0;
    if (dtype == 0)
        return kvd_error_set(err, KVD_EINVAL, "%s: unspecified (use F16, BF16 or F32)", field);
    return kvd_error_set(err, KVD_EINVAL, "%s: unknown dtype %d (use F16, BF16 or F32)", field,
                         dtype);
}

int kvd_check_range(uint64_t start, uint64_t count, unsigned bits, const char *start_field,
                    const char *count_field, kvd_error *err)
{
    uint64_t max = bits >= 64 ? UINT64_MAX : (UINT64_C(1) << bits) - 1;
    if (start > max || count > max || count > max - start)
        return kvd_error_set(err, KVD_EINVAL,
                             "%s + %s: %llu + %llu overflows a %u-bit count", start_field,
                             count_field, (unsigned long long)start, (unsigned long long)count,
                             bits);
    return 0;
}
