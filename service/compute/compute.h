/*
 * service/compute: what the Attend, Search, SparseAttend, PlanFetch and
 * AppendPages RPCs compute over stored pages, with no gRPC, no protobuf and
 * no request context: a store, the backend its pages are computed on, and
 * plain arrays. The service's handlers decode a request, call one entry point
 * and encode its answer.
 *
 * Every entry point checks all of its arguments before computing anything (a
 * batch with one bad query fails as a whole) and answers with a kvd status
 * and a message naming the field, in the words of kvdepot.proto. Nothing
 * here changes stored data except kvd_compute_append_pages, which is all or
 * nothing.
 *
 * Attention reads one layer of a sequence through the store: whole sealed
 * pages are pinned in their memory tier and attended in their stored form
 * (kvd_page_attend: INT2/INT4 homomorphic, VQ fused, SVD reduced, raw dense),
 * the partial blocks at both ends and the raw tail through the read cursor in
 * windows, and the parts are merged by their log-sum-exp. Memory per call is
 * bounded by a window, whatever the sequence length.
 */
#ifndef KVDEPOT_SERVICE_COMPUTE_COMPUTE_H
#define KVDEPOT_SERVICE_COMPUTE_COMPUTE_H

#include <stddef.h>
#include <stdint.h>

#include "kvdepot/backend.h"
#include "kvdepot/status.h"
#include "store.h"

/* What the caller may do: the service's tenant check on a sequence's model
 * (KVD_EPERM) and its quota on appended bytes: reserve may refuse; the store
 * commit then runs between commit_lock(arg, 1) and commit_lock(arg, 0), with
 * settle(model, bytes) inside when it committed, and release gives back what
 * a failed append reserved. A NULL guard, or NULL members, allow
 * everything. */
typedef struct kvd_compute_guard {
    int (*check_model)(void *arg, const char *model, kvd_error *err);
    int (*reserve)(void *arg, const char *model, uint64_t bytes, kvd_error *err);
    void (*commit_lock)(void *arg, int on);
    void (*settle)(void *arg, const char *model, uint64_t bytes);
    void (*release)(void *arg, const char *model, uint64_t bytes);
    void *arg;
} kvd_compute_guard;

/* Where compute runs: the store, its compute backend (kvd_store_backend),
 * the caller's guard (may be NULL), and the device whose memory holds the
 * store's device tier (kvd_store_device; NULL = none): pages that lie there
 * are attended on it, the rest on be. */
typedef struct kvd_compute {
    kvd_store *store;
    kvd_backend *be;
    const kvd_compute_guard *guard;
    kvd_backend *dev;
} kvd_compute;

/* Pages Attend and SparseAttend read where they lie in a device's memory, and pages whose
 * PQ codes Search (and SparseAttend) read there, since start. */
uint64_t kvd_compute_device_pages(void);
uint64_t kvd_compute_device_search_pages(void);

/* ---- Attend -------------------------------------------------------------- */

#define KVD_ATTEND_MAX_BATCH 1024

typedef struct kvd_attend_query {
    const void *id;
    size_t id_len;
    const float *q; /* (num_q_heads, head_dim) of the sequence's model */
    size_t n_q;     /* floats in q */
    uint64_t token_start;
    uint64_t num_tokens; /* 0 = to the layer's end */
} kvd_attend_query;

typedef struct kvd_attend_result {
    float *out; /* (num_q_heads, head_dim), malloc'd */
    float *lse; /* (num_q_heads); -inf for an empty range */
    uint32_t num_q_heads, head_dim;
    uint64_t num_tokens; /* tokens attended */
} kvd_attend_result;

/*
 * Decode attention at `layer` for n (sequence, query) pairs:
 *   out_h = sum_t softmax_t(scale q_h . k_{t,g(h)}) v_{t,g(h)}, lse_h its
 * log-normaliser, GQA g(h) = h / (num_q_heads / num_kv_heads). scale 0 =
 * 1/sqrt(head_dim).
 * @param[out] res  n results, zeroed by the caller; clear them with
 *                  kvd_attend_results_clear, also after a failure
 * @return 0; KVD_EINVAL (empty or too large batch, q size, layer, scale);
 *         KVD_ENOTFOUND; KVD_ERANGE (tokens past the stored ones); KVD_EPERM;
 *         KVD_ECORRUPT (a page failed its checksum); KVD_ENOMEM.
 */
int kvd_compute_attend(const kvd_compute *c, uint32_t layer, float scale,
                       const kvd_attend_query *qs, size_t n, kvd_attend_result *res,
                       kvd_error *err);
void kvd_attend_results_clear(kvd_attend_result *res, size_t n);

/* ---- Search and SparseAttend ----------------------------------------------- */

typedef struct kvd_search_args {
    const void *id;
    size_t id_len;
    uint32_t layer;
    const float *q; /* (num_q_heads, head_dim) */
    size_t n_q;
    uint32_t k, initial_tokens, recent_tokens;
    uint64_t token_start;
    uint64_t num_tokens; /* 0 = to the layer's end */
} kvd_search_args;

typedef struct kvd_search_result {
    uint32_t num_kv_heads;
    uint64_t per_head; /* tokens selected per kv head */
    uint64_t *tokens;  /* (num_kv_heads, per_head) absolute positions, best first */
    float *scores;     /* (num_kv_heads, per_head) approximate q.k (summed over the group) */
    /* kvd_compute_sparse_attend: attention over the selected tokens */
    float *out; /* (num_q_heads, head_dim) */
    float *lse; /* (num_q_heads) */
    uint32_t num_q_heads, head_dim;
} kvd_search_result;

/*
 * PQ top-k over a sequence's index at one layer, per kv head (the queries of
 * its GQA group summed), plus the first initial_tokens and the last
 * recent_tokens of the range (kvdepot.proto, SearchRequest, says which
 * centroids and codes). kvd_compute_sparse_attend then attends every query
 * head over its kv head's selected tokens (scale 0 = 1/sqrt(head_dim)).
 * @param[out] r  zeroed by the caller; clear with kvd_search_result_clear,
 *                also after a failure
 * @return 0; KVD_EPRECOND (no PQ index); KVD_EINVAL (q size, k larger than
 *         the range, empty or too long range, layer, scale); KVD_ENOTFOUND;
 *         KVD_ERANGE; KVD_EPERM; KVD_ECORRUPT; KVD_ENOMEM.
 */
int kvd_compute_search(const kvd_compute *c, const kvd_search_args *a, kvd_search_result *r,
                       kvd_error *err);
int kvd_compute_sparse_attend(const kvd_compute *c, const kvd_search_args *a, float scale,
                              kvd_search_result *r, kvd_error *err);
void kvd_search_result_clear(kvd_search_result *r);

/*
 * The stored PQ centroids of `layer` of sequence id (store/pqindex.h) into
 * *out (clear with kvd_pq_centroids_clear, also after a failure).
 * @return 0; KVD_EPRECOND (no PQ index, or none of the layer's pages has
 *         sealed yet); KVD_EINVAL (id, layer); KVD_ENOTFOUND; KVD_EPERM;
 *         KVD_ECORRUPT; KVD_ENOMEM.
 */
struct kvd_pq_centroids;
int kvd_compute_pq_centroids(const kvd_compute *c, const void *id, size_t id_len, uint32_t layer,
                             struct kvd_pq_centroids *out, kvd_error *err);

/*
 * Rebuild the PQ index of layers [layer_start, + num_layers) (0 = to the
 * last) of sequence id (kvd_store_pq_rebuild_begin, store/pqindex.h), the
 * index's growth reserved with the guard first.
 * @return 0; KVD_EPRECOND (no PQ index); KVD_EINVAL (id, layers);
 *         KVD_ENOTFOUND; KVD_EPERM; KVD_ENOMEM (quota, disk limit, memory);
 *         KVD_ECORRUPT; kernel errors.
 */
struct kvd_pq_rebuild_info;
int kvd_compute_pq_rebuild(const kvd_compute *c, const void *id, size_t id_len,
                           uint32_t layer_start, uint32_t num_layers,
                           struct kvd_pq_rebuild_info *info, kvd_error *err);

/* ---- PlanFetch ------------------------------------------------------------- */

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
    uint64_t n;       /* tokens */
    uint64_t max_l;   /* tokens with activations available (<= n) */
    double x_bytes;   /* per token */
    double kv_bytes;  /* per token */
    double flops;     /* per token */
    double bandwidth; /* bytes/s, > 0 */
    double rate;      /* receiver flop/s, > 0 */
} kvd_fetch_cost;

/* t(l) of the model above. */
double kvd_fetch_time(const kvd_fetch_cost *c, uint64_t l);

/* The split l in [0, min(max_l, n)] minimising kvd_fetch_time (ties: the
 * smallest l). */
uint64_t kvd_plan_fetch(const kvd_fetch_cost *c);

typedef struct kvd_plan_args {
    const void *id;
    size_t id_len;
    double bandwidth; /* bytes/s, finite and > 0 */
    double flops;     /* receiver flop/s, finite and > 0 */
    uint32_t layer_start;
    uint32_t num_layers;    /* 0 = all from layer_start */
    int assume_activations; /* the receiver holds the activations of every token */
} kvd_plan_args;

typedef struct kvd_plan {
    kvd_fetch_cost cost;   /* the model's terms for this sequence */
    uint64_t split_tokens; /* l */
    double predicted_seconds, kv_only_seconds, recompute_seconds;
    uint64_t activation_bytes, kv_bytes;
} kvd_plan;

/* The plan of a stored sequence (kvdepot.proto, PlanFetchRequest): the
 * stored (encoded) page bytes per token for kv_bytes, and activations
 * available for every token with assume_activations, else for the leading
 * tokens the sequence stores them for. 0; KVD_EINVAL; KVD_ENOTFOUND;
 * KVD_EPERM. */
int kvd_compute_plan_fetch(const kvd_compute *c, const kvd_plan_args *a, kvd_plan *out,
                           kvd_error *err);

/* ---- AppendPages ----------------------------------------------------------- */

typedef struct kvd_page_in {
    const uint8_t *bytes; /* one encoded page (docs/page-format.md) */
    size_t len;
} kvd_page_in;

typedef struct kvd_pages_args {
    const void *id;
    size_t id_len;
    const kvd_page_in *pages;
    size_t n;
    const uint32_t *token_ids; /* optional, as in an Append */
    size_t n_token_ids;
    const uint64_t *block_hashes;
    size_t n_block_hashes;
} kvd_pages_args;

/*
 * Append pages a client encoded (kvdepot.proto, AppendPagesRequest). Every
 * page is checked before anything is stored: its checksum and coded sections
 * (KVD_ECORRUPT), its shape against the model and the server's page size,
 * its codecs against the sequence's (a sealed page carries them, raw only in
 * sink blocks; a partial page is raw) (KVD_EINVAL; other artifacts
 * KVD_EPRECOND), and the tiling: on contiguous layers, each layer's pages
 * cover one token range starting at its stored token count (else
 * KVD_EPRECOND), the same on every layer. Sealed pages are stored as sent
 * (the store writes the PQ section of an indexed sequence); the decoded
 * tokens go through the append transaction, quota reserved through the
 * guard. All or nothing.
 * @param[out] out  the sequence after the append; clear with
 *                  kvd_seq_info_clear (zeroed on failure)
 */
int kvd_compute_append_pages(const kvd_compute *c, const kvd_pages_args *a, kvd_seq_info *out,
                             kvd_error *err);

#endif /* KVDEPOT_SERVICE_COMPUTE_COMPUTE_H */
