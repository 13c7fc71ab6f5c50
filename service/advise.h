/*
 * Codec advice for Calibrate (kvdepot.proto, CalibrateHeader.error_budget):
 * every codec kvdepot can store is applied to the held-out K/V of each
 * layer's sample, decode attention of held-out queries over them is
 * compared with exact attention, and the K/V pair with the fewest bits
 * that meets the caller's error budget is recommended, per layer and for
 * the whole model.
 */
#ifndef KVDEPOT_SERVICE_ADVISE_H
#define KVDEPOT_SERVICE_ADVISE_H

#include <stdint.h>

#include "kvdepot/backend.h"
#include "kvdepot/status.h"
#include "kvdepot/tensor.h"
#include "kvdepot/v1/kvdepot.pb-c.h"

/* The held-out part of one layer's sample and the artifacts trained on the
 * rest (per kv head; NULL where not trained). */
typedef struct kvd_advise_layer {
    uint32_t layer;
    const float *k, *v; /* [token][kv head][D], n tokens */
    const float *q;     /* [token][q head][D], n tokens */
    uint64_t n;
    const float **lambda, **cb_k, **cb_v;         /* VQ: key smoothing, codebooks */
    const float **rot_k, **sv_k, **rot_v, **sv_v; /* SVD rotations and spectra */
} kvd_advise_layer;

typedef struct kvd_advise_params {
    uint32_t kv_heads, q_heads, head_dim;
    kvd_dtype dtype;      /* of raw pages */
    uint32_t page_tokens; /* the store's page size (channel-axis groups) */
    uint32_t vq_d, vq_b;  /* 0 = no VQ candidate */
    int svd;              /* 1 = an SVD candidate */
    double budget;
    uint32_t queries; /* held-out queries per layer */
    int exhaustive;
    kvd_backend *be; /* one-thread CPU backend: the VQ keys' rotation */
} kvd_advise_params;

/* The advice and the memory its messages point into. */
typedef struct kvd_advice {
    Kvdepot__V1__CodecAdvice msg;
    void *mem; /* private */
} kvd_advice;

/* K~ = (K / lambda) H_D of n rows of D floats (lambda NULL: H_D alone)
 * on be (kvd_vq_transform_keys): Calibrate rotates the VQ keys with the
 * CPU backend's bits, those the store codes them with. out may not alias k. */
int kvd_advise_rotate_keys(kvd_backend *be, int64_t n, int D, const float *k, const float *lambda,
                           float *out, kvd_error *err);

/* The inverse on be: K = (K~ H_D) * lambda, H_D being its own inverse. */
int kvd_advise_unrotate_keys(kvd_backend *be, int64_t n, int D, const float *k, const float *lambda,
                             float *out, kvd_error *err);

/* Fill out (free with kvd_advice_free, also after a failure). 0,
 * KVD_ENOMEM, or the status of a kernel that refused (message in err). */
int kvd_advise(const kvd_advise_params *p, const kvd_advise_layer *layers, uint32_t nlayers,
               kvd_advice *out, kvd_error *err);
void kvd_advice_free(kvd_advice *out);

#endif /* KVDEPOT_SERVICE_ADVISE_H */
