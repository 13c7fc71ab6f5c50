/*
 * Helpers shared by the files of service/compute: what a call needs to know
 * of one sequence, token ranges, reading a window of one layer. Internal to
 * kvd_compute.
 */
#ifndef KVDEPOT_SERVICE_COMPUTE_INTERNAL_H
#define KVDEPOT_SERVICE_COMPUTE_INTERNAL_H

#include <stdint.h>

#include "codec.h"
#include "compute.h"
#include "kvdepot/attention.h"

/* What a compute call needs to know about one sequence. */
typedef struct kvd__cseq {
    kvd_model_info model;
    uint64_t layer_tokens; /* tokens stored in the layer asked for */
    uint64_t stored_bytes;
    uint64_t num_tokens;
    uint32_t num_layers;
    uint64_t activation_tokens; /* on every layer */
    uint64_t activation_bytes;  /* part of stored_bytes */
} kvd__cseq;

/* Check `id` (named `field` in errors), the caller's right to its model and
 * `layer`; fill *out from the sequence's stat and model. KVD_EINVAL,
 * KVD_ENOTFOUND, KVD_EPERM. */
int kvd__cseq_load(const kvd_compute *c, const void *id, size_t id_len, const char *field,
                   uint32_t layer, kvd__cseq *out, kvd_error *err);

/* 0 when the n floats of query `field` are all finite, else KVD_EINVAL
 * naming the query, the head and the value: a NaN or infinite query would
 * answer NaN. */
int kvd__query_finite(const char *field, const float *q, size_t n, uint32_t head_dim,
                      kvd_error *err);

/* Resolve [start, start + *count) against the tokens stored (count 0 = to
 * the end). KVD_ERANGE past the end, KVD_EINVAL when it overflows. */
int kvd__token_range(const char *what, uint64_t start, uint64_t *count, uint64_t stored,
                     kvd_error *err);

/* Read tokens [start, start + n) of one layer (K then V, each
 * [token][kv_head][head_dim], model dtype) into buf of `bytes` bytes. */
int kvd__read_window(kvd_store *st, const void *id, size_t id_len, uint32_t layer, uint64_t start,
                     uint64_t n, uint8_t *buf, uint64_t bytes, kvd_error *err);

/* One query of kvd__attend_device_batch: its whole pages on the device,
 * and tokens outside whole pages (the partial pages at both ends of its
 * range, the raw tail) read on the host, attended there as one more item. */
typedef struct kvd__devq {
    kvd_attn_dims dims;
    const float *q;               /* host, Hq x D */
    const kvd_page_handle *pages; /* np pages, each with a layout */
    size_t np;
    float *out, *lse;             /* host: the merged result (nothing to attend: empty) */
    const kvd_codec_arts *arts;   /* the sequence's snapshot: VQ pages' codebooks */
    uint32_t layer;
    const uint8_t *raw;  /* host: raw_tokens of K, then of V, each [token][kv_head][dim] */
    uint64_t raw_tokens; /* 0: none */
    kvd_dtype raw_dtype;
} kvd__devq;

/* Attention of nq queries over their pages on the device dev: every page
 * of every query is an item of one launch per kind, each query's slots are
 * merged on the device (ceil(log2 max np) + 1 merge launches for all), and
 * the results come down in one copy. 0 or the backend's status. */
int kvd__attend_device_batch(kvd_backend *dev, kvd__devq *qs, size_t nq, kvd_error *err);

/* After a computation on dev (NULL: none) ended with rc: 1 when it is to be
 * done again on the CPU, err cleared: the device was lost (KVD_EUNAVAIL,
 * the store then drops its device tier) or had no memory for it
 * (KVD_ENOMEM); counted (kvd_store_device_fallback). 0 otherwise. */
int kvd__device_fallback(kvd_store *st, kvd_backend *dev, int rc, kvd_error *err);

/* Count pages a computation read where they lie on the device
 * (kvd_compute_device_pages). */
void kvd__device_pages_add(uint64_t n);

/* scale, or 1/sqrt(D) when 0. */
float kvd__default_scale(float scale, uint32_t D);

#endif /* KVDEPOT_SERVICE_COMPUTE_INTERNAL_H */
