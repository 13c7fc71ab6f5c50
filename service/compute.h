/*
 * Compute on stored caches: Attend and PlanFetch (compute.c).
 *
 * The handlers read the pages of one layer through the store's read cursor
 * (a consistent snapshot, every page checksum-verified) and run the store's
 * compute backend (kvd_store_backend: the one kvdepotd creates at start, the
 * CPU backend while pages live in host memory) on them.
 */
#ifndef KVDEPOT_SERVICE_COMPUTE_H
#define KVDEPOT_SERVICE_COMPUTE_H

#include <stdint.h>

/*
 * KVPR fetch plan. For n tokens, with per-token costs
 *
 *   x_bytes   activation bytes of one token over the layers fetched
 *             (hidden_size * sizeof(dtype) * num_layers)
 *   kv_bytes  stored K/V bytes of one token over the layers fetched
 *   flops     recompute work of one token: 2 * hidden_size *
 *             (2 * num_kv_heads * head_dim) * num_layers  (X W_K and X W_V)
 *
 * sending the activations of the first l tokens and the K/V of the rest costs
 *
 *   t(l) = l*x_bytes/bw + max(l*flops/rate, (n - l)*kv_bytes/bw)
 *
 * t is convex and piecewise linear in l (slope x_bytes/bw - kv_bytes/bw left
 * of the point where recompute and transfer take equally long, x_bytes/bw +
 * flops/rate right of it), so its minimum over [0, max_l] lies at 0, max_l
 * or one of the two integers around that crossing. kvd_plan_fetch evaluates
 * those and returns the smallest l reaching the minimum.
 */
typedef struct kvd_fetch_cost {
    uint64_t n;           /* tokens */
    uint64_t max_l;       /* tokens with activations available (<= n) */
    double x_bytes;       /* per token */
    double kv_bytes;      /* per token */
    double flops;         /* per token */
    double bandwidth;     /* bytes/s, > 0 */
    double rate;          /* receiver flop/s, > 0 */
} kvd_fetch_cost;

/* t(l) of the model above. */
double kvd_fetch_time(const kvd_fetch_cost *c, uint64_t l);

/* The split l in [0, min(max_l, n)] minimising kvd_fetch_time (ties: the
 * smallest l). */
uint64_t kvd_plan_fetch(const kvd_fetch_cost *c);

#include "seqcodec.h"

/* The codecs of a CreateSequenceRequest (a Kvdepot__V1__SequenceCodecs, or
 * NULL for all raw), checked against the model and page size. KVD_EINVAL
 * naming the field; KVD_EUNSUPP for parts this server does not produce yet
 * (VQ, SVD, PQ, activations). */
int kvd_codecs_from_pb(const void *pb, const kvd_model_info *m, uint32_t page_tokens,
                       kvd_seq_codecs *out, kvd_error *err);

#endif /* KVDEPOT_SERVICE_COMPUTE_H */
