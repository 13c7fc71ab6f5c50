/*
 * PQ index (PQCache): product quantization of keys and top-k token search.
 *
 * One index per (layer, kv head). head_dim D is split into m sub-spaces of
 * dsub = D/m dims; sub-space j has 2^b centroids, b in {4, 6, 8}, trained by
 * K-means (kvdepot/kmeans.h) on the j-th slices of the keys.
 *
 * Layouts:
 *   centroids  (m, 2^b, dsub) f32      C[j][c][t]
 *   codes      (n, m) uint8            code[i][j] = nearest centroid of
 *                                      key i's slice j (ties: lower c);
 *                                      one byte per code for every b
 *   queries    (G, D) f32              the G query heads sharing the kv head
 *   result     indices (cap) u32, scores (cap) f32
 *
 * Search, for one kv head:
 *   1. GQA aggregation: the G query heads are summed, qbar = q_0 + ... + q_{G-1}
 *      (in that order). Ranking by qbar.k is ranking by the sum of the
 *      per-head logits, i.e. by the mean query: tokens that matter to the
 *      group as a whole come first. It costs one lookup table and one scan,
 *      independent of G. (KVD_PQ_AGG_MAX ranks by max_h q_h.k instead: a token
 *      needed by any single head is kept; G tables, G times the lookups.)
 *   2. Lookup table LUT[j][c] = sum_{t<dsub} qbar[j*dsub + t] * C[j][c][t]
 *      (sequential float sum over t), (m, 2^b) f32.
 *   3. Approximate score of token i: s_i = sum_{j<m} LUT[j][code[i][j]],
 *      a float sum in order j = 0..m-1. Every path computes exactly these
 *      floats, so fast and reference results are bitwise equal.
 *   4. Forced tokens: the first `sink` tokens and the last `window` tokens
 *      are always returned, IN ADDITION to the k best of the middle tokens
 *      [sink, n - window) (PQCache's initial + local tokens; they are
 *      attended anyway, so spending top-k slots on them would waste them).
 *      The result holds min(n, sink + window) + min(k, middle) entries
 *      (kvd_pq_search_count()); k >= middle returns every token.
 *   5. Order: all returned entries (forced ones with their own scores) sorted
 *      by score descending, ties by lower index. NaN scores rank below every
 *      number; -0 and +0 are equal.
 *   Codes >= 2^b are not validated per search (decoders of untrusted pages
 *   must); they read a table entry of -inf and rank last.
 */
#ifndef KVDEPOT_PQ_H
#define KVDEPOT_PQ_H

#include <stdint.h>

#include "kvdepot/backend.h"
#include "kvdepot/kmeans.h"

typedef enum kvd_pq_agg {
    KVD_PQ_AGG_SUM = 0, /* score of the summed query heads (default) */
    KVD_PQ_AGG_MAX = 1, /* max over heads of the per-head score */
} kvd_pq_agg;

typedef struct kvd_pq_search_params {
    int64_t k;      /* best middle tokens to return, >= 0 */
    int64_t sink;   /* first tokens always returned, >= 0 */
    int64_t window; /* last tokens always returned, >= 0 */
    kvd_pq_agg agg;
} kvd_pq_search_params;

struct kvd_pq_search_job;

struct kvd_pq_ops {
    int (*train)(kvd_backend *be, const kvd_tensor *keys, const kvd_kmeans_params *km,
                 kvd_tensor *centroids, kvd_error *err);
    int (*encode)(kvd_backend *be, const kvd_tensor *keys, const kvd_tensor *centroids,
                  kvd_tensor *codes, kvd_error *err);
    int (*search)(kvd_backend *be, const kvd_tensor *centroids, const kvd_tensor *codes,
                  const kvd_tensor *queries, const kvd_pq_search_params *p,
                  kvd_tensor *indices, kvd_tensor *scores, int64_t *nout, kvd_error *err);
    /* See kvd_pq_search_batch(). May be NULL: the wrapper then loops over
     * search. Appended member. */
    int (*search_batch)(kvd_backend *be, struct kvd_pq_search_job *jobs, int64_t njobs,
                        const kvd_pq_search_params *p, kvd_error *err);
};

/*
 * One search of a batch: one (sequence, kv head) pair. Tensors as for
 * kvd_pq_search(); nout is written by the search.
 */
typedef struct kvd_pq_search_job {
    const kvd_tensor *centroids; /* (m, 2^b, D/m) f32 */
    const kvd_tensor *codes;     /* (n, m) u8, n may differ per job */
    const kvd_tensor *queries;   /* (G, D) f32 */
    kvd_tensor *indices;         /* (cap) u32 */
    kvd_tensor *scores;          /* (cap) f32, or NULL */
    int64_t nout;                /* [out] entries written */
    /* Optional (NULL: none): called once before the job's search reads its
     * codes, on the thread that then runs the search where the backend has
     * threads (the CPU's: so a caller that gathers the codes from elsewhere
     * has them in that thread's caches), else before the batch starts.
     * Returns 0, or a KVD_* code that fails the batch. Appended members. */
    int (*fill)(void *arg);
    void *fill_arg;
} kvd_pq_search_job;

/* Number of entries a search returns for n tokens. */
int64_t kvd_pq_search_count(int64_t n, const kvd_pq_search_params *p);

/*
 * Train the centroids: K-means per sub-space on the keys' slices. km->k is
 * ignored (2^b from centroids' shape); km->max_points sub-samples (0 = all
 * keys; 256 * 2^b is plenty), km->seed + j seeds sub-space j.
 * @param[in]  keys       (n, D) f32 contiguous, n >= 1
 * @param[out] centroids  (m, 2^b, D/m) f32, b in {4, 6, 8}, D % m == 0
 * @return 0; KVD_EINVAL; KVD_ENOMEM; KVD_EUNSUPP.
 */
int kvd_pq_train(kvd_backend *be, const kvd_tensor *keys, const kvd_kmeans_params *km,
                 kvd_tensor *centroids, kvd_error *err);

/*
 * Encode keys: code[i][j] = nearest centroid of slice j (squared L2, ties to
 * the lower index).
 * @param[in]  keys       (n, D) f32 contiguous (n may be 0)
 * @param[in]  centroids  (m, 2^b, D/m) f32
 * @param[out] codes      (n, m) u8
 */
int kvd_pq_encode(kvd_backend *be, const kvd_tensor *keys, const kvd_tensor *centroids,
                  kvd_tensor *codes, kvd_error *err);

/*
 * Top-k search (see the top of this file).
 * @param[in]  centroids  (m, 2^b, D/m) f32
 * @param[in]  codes      (n, m) u8, n >= 0
 * @param[in]  queries    (G, D) f32, G >= 1
 * @param[out] indices    (cap) u32, cap >= kvd_pq_search_count(n, p)
 * @param[out] scores     (cap) f32, same cap, or NULL
 * @param[out] nout       entries written
 * @return 0; KVD_EINVAL; KVD_ENOMEM; KVD_EUNSUPP.
 */
int kvd_pq_search(kvd_backend *be, const kvd_tensor *centroids, const kvd_tensor *codes,
                  const kvd_tensor *queries, const kvd_pq_search_params *p,
                  kvd_tensor *indices, kvd_tensor *scores, int64_t *nout, kvd_error *err);

/*
 * Many searches with the same parameters in one call: on the CUDA backend
 * one set of launches for the whole batch (the Search RPC's many sequences
 * and kv heads of one layer), elsewhere a loop over kvd_pq_search().
 * Every job must have the same m, b, D and G (one layer of one model); each
 * job is checked as kvd_pq_search() checks its arguments.
 * @param[in,out] jobs   njobs searches; jobs[i].nout set on success
 * @param[in]     njobs  >= 0
 * @return 0; KVD_EINVAL (message names the job); KVD_ENOMEM; KVD_EUNSUPP.
 *         On failure the nout of every job is 0.
 */
int kvd_pq_search_batch(kvd_backend *be, kvd_pq_search_job *jobs, int64_t njobs,
                        const kvd_pq_search_params *p, kvd_error *err);

/* ---- CPU implementation, plain pointers (host memory) ------------------ */

/* Lookup table (m, 256) f32 for one query vector q (D): entries c >= 2^b are
 * -inf (see above). Shared by every CPU path. */
void kvd_pq_lut_ref(int m, int b, int D, const float *centroids, const float *q, float *lut);

/* Scalar reference search: scores every token, sorts. idx/scores hold
 * kvd_pq_search_count() entries (scores may be NULL). Returns 0 or KVD_ENOMEM. */
int kvd_pq_search_ref(int64_t n, int m, int b, int D, const float *centroids,
                      const uint8_t *codes, int G, const float *queries,
                      const kvd_pq_search_params *p, uint32_t *idx, float *scores,
                      int64_t *nout);
void kvd_pq_encode_ref(int64_t n, int m, int b, int D, const float *keys, const float *centroids,
                       uint8_t *codes);

/* The CPU backend's paths: quantized tables looked up in registers with
 * exact re-scoring (AVX-512 VBMI where the CPU has it, else AVX2 pshufb;
 * m = 2, 4, 8, 16 once a starting threshold is known; m = 2 with b = 4
 * tests each token against the threshold exactly, through a table of the
 * 256 possible scores), AVX2 gathers otherwise, + threshold-pruned top-k,
 * nthreads threads over tokens.
 * Bitwise the reference's result.
 * kvd__pq_search_cpu: simd 0 = scalar scan, 1 = the best the CPU has,
 * 2 = AVX2 only (tests and benchmarks). */
int kvd__pq_search_cpu(int nthreads, int simd, int64_t n, int m, int b, int D,
                       const float *centroids, const uint8_t *codes, int G,
                       const float *queries, const kvd_pq_search_params *p, uint32_t *idx,
                       float *scores, int64_t *nout);
/*
 * Packed 4-bit codes (b = 4), the layout of the CPU's blocked scan: tokens in
 * blocks of 32, block t = tokens 32 t .. 32 t + 31 (the last one padded with
 * code 0), 16 bytes a sub-space, m rounded up to even (a padding sub-space
 * of zeros). Byte i < 16 of sub-space j holds code j of token 32 t + i in its
 * low nibble and of token 32 t + 16 + i in its high nibble. Half the bytes of
 * rows, and each pair of sub-spaces is one 32-byte load whose nibbles index
 * 16-entry tables held in registers.
 * kvd_pq_packed4_bytes: the size for n tokens; kvd_pq_pack4 packs rows
 * (n, m) of codes < 16 (the low 4 bits of each code are kept).
 * kvd__pq_search_packed4_cpu: kvd__pq_search_cpu with b = 4 on packed codes;
 * bitwise the reference's result on the rows that were packed. The blocked
 * scan runs for m <= 16 and KVD_PQ_AGG_SUM with AVX2 (simd 1 or 2; with
 * simd 1 on a CPU with AVX-512BW, four sub-spaces a 64-byte load); other
 * cases unpack the codes and search the rows.
 */
int64_t kvd_pq_packed4_bytes(int64_t n, int m);
void kvd_pq_pack4(int64_t n, int m, const uint8_t *codes, uint8_t *packed);
int kvd__pq_search_packed4_cpu(int nthreads, int simd, int64_t n, int m, int D,
                               const float *centroids, const uint8_t *packed, int G,
                               const float *queries, const kvd_pq_search_params *p, uint32_t *idx,
                               float *scores, int64_t *nout);
/* What the quantized-table scans did since the process started (tests:
 * their filter must stay tight, which results alone do not show, since a
 * start that admits too few tokens is caught and scanned again).
 * steps: blocks of 64 tokens scanned; rescored: tokens whose bound passed
 * and were scored exactly; rescans: searches scanned a second time without
 * a starting threshold. */
typedef struct kvd__pq_counters {
    uint64_t steps, rescored, rescans;
} kvd__pq_counters;
void kvd__pq_counters_get(kvd__pq_counters *out);
/* Codes a thread of one search must scan at least (default 4 MiB; tests
 * lower it to reach the threaded paths on short ranges). */
extern int64_t kvd__pq_thread_bytes;
int kvd__pq_train_cpu(int nthreads, int simd, const kvd_kmeans_params *km, int64_t n, int m,
                      int b, int D, const float *keys, float *centroids);
void kvd__pq_encode_cpu(int nthreads, int simd, int64_t n, int m, int b, int D,
                        const float *keys, const float *centroids, uint8_t *codes);

#endif /* KVDEPOT_PQ_H */
