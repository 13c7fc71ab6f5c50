/*
 * The sequence, range and read helpers of service/compute
 * (compute_internal.h).
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "compute_internal.h"
#include "validate.h"

int kvd__cseq_load(const kvd_compute *c, const void *id, size_t id_len, const char *field,
                   uint32_t layer, kvd__cseq *out, kvd_error *err)
{
    int rc;
    if ((rc = kvd_check_key_id(id, id_len, field, err)))
        return rc;
    kvd_seq_info info;
    memset(&info, 0, sizeof info);
    if ((rc = kvd_store_seq_stat(c->store, id, id_len, &info, err)))
        return rc;
    const kvd_compute_guard *g = c->guard;
    if ((g && g->check_model && (rc = g->check_model(g->arg, info.model, err))) ||
        (rc = kvd_store_model_get(c->store, info.model, &out->model, err)))
        goto done;
    if (layer >= info.num_layers) {
        rc = kvd_error_set(err, KVD_EINVAL, "layer: %u, model %s has %u layers", layer, info.model,
                           info.num_layers);
        goto done;
    }
    out->layer_tokens = info.layer_tokens[layer];
    out->stored_bytes = info.stored_bytes;
    out->activation_tokens = info.activation_tokens;
    out->activation_bytes = info.activation_bytes;
    out->num_tokens = info.num_tokens;
    out->num_layers = info.num_layers;
done:
    kvd_seq_info_clear(&info);
    return rc;
}

int kvd__query_finite(const char *field, const float *q, size_t n, uint32_t head_dim,
                      kvd_error *err)
{
    for (size_t i = 0; i < n; i++)
        if (!isfinite(q[i]))
            return kvd_error_set(
                err, KVD_EINVAL, "%s: not finite (%g at q head %zu, dimension %zu)", field,
                (double)q[i], head_dim ? i / head_dim : 0, head_dim ? i % head_dim : i);
    return 0;
}

int kvd__token_range(const char *what, uint64_t start, uint64_t *count, uint64_t stored,
                     kvd_error *err)
{
    int rc = kvd_check_range(start, *count, 64, "token_start", "num_tokens", err);
    if (rc)
        return rc;
    if (start > stored)
        return kvd_error_set(err, KVD_ERANGE, "%s: token_start %llu past the %llu tokens stored",
                             what, (unsigned long long)start, (unsigned long long)stored);
    if (*count == 0)
        *count = stored - start;
    if (start + *count > stored)
        return kvd_error_set(err, KVD_ERANGE, "%s: tokens [%llu, %llu) past the %llu stored", what,
                             (unsigned long long)start, (unsigned long long)(start + *count),
                             (unsigned long long)stored);
    return 0;
}

int kvd__read_window(kvd_store *st, const void *id, size_t id_len, uint32_t layer, uint64_t start,
                     uint64_t n, uint8_t *buf, uint64_t bytes, kvd_error *err)
{
    kvd_read_spec rs = {id, id_len, layer, 1, start, n, 0};
    kvd_read *rd = NULL;
    kvd_read_shape shape;
    int rc = kvd_store_read_begin(st, &rs, &rd, &shape, err);
    if (rc)
        return rc;
    if (shape.total_bytes != bytes) {
        kvd_store_read_end(rd);
        return kvd_error_set(err, KVD_EINTERNAL, "read of %llu bytes, expected %llu",
                             (unsigned long long)shape.total_bytes, (unsigned long long)bytes);
    }
    uint64_t got = 0;
    while (got < bytes) {
        size_t len = 0;
        if ((rc = kvd_store_read_next(rd, buf + got, (size_t)(bytes - got), &len, err)))
            break;
        if (len == 0) {
            rc = kvd_error_set(err, KVD_EINTERNAL, "read ended after %llu of %llu bytes",
                               (unsigned long long)got, (unsigned long long)bytes);
            break;
        }
        got += len;
    }
    kvd_store_read_end(rd);
    return rc;
}

float kvd__default_scale(float scale, uint32_t D)
{
    return scale != 0.0f ? scale : 1.0f / sqrtf((float)D);
}
