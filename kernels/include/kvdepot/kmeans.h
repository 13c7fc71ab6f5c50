/*
 * K-means clustering: the trainer behind VQ codebooks (kvdepot/vq.h) and PQ
 * centroids (kvdepot/pq.h).
 *
 * Algorithm (the same on every backend):
 *   1. Optional sub-sampling: when max_points > 0 and n > max_points, a
 *      seeded random subset of max_points rows is clustered instead of x.
 *   2. k-means++ seeding: the first centroid is a uniformly drawn point; each
 *      next one is drawn with probability proportional to the squared
 *      distance to the nearest centroid chosen so far (D^2 sampling).
 *   3. Lloyd iterations: assign every point to its nearest centroid (ties to
 *      the lower centroid index), move each centroid to the mean of its
 *      points. Stops after niter iterations or when no assignment changed.
 *   4. Empty-cluster repair after each update: an empty cluster takes the
 *      centroid of the currently largest cluster moved by a small seeded
 *      perturbation (relative 2^-10 per coordinate), and the largest
 *      cluster's size is halved for the purpose of the next repair. The next
 *      assignment then splits the most populated cluster, where a second
 *      centroid lowers the inertia most; the original centroid stays put, so
 *      a repair never raises the inertia.
 *   5. A final assignment against the returned centroids gives the inertia:
 *      the sum over the clustered points of the squared distance to their
 *      nearest centroid (double precision).
 *
 * Determinism: all random choices come from `seed` through one sequential
 * generator, the centroid sums are accumulated in a fixed order (double), and
 * the threads only split the per-point distance work. The result therefore
 * does not depend on the number of threads. The scalar reference and the
 * AVX2 path compute distances differently (|x|^2 - 2 x.c + |c|^2 in blocks vs
 * sum of squared differences), so they agree to float rounding, not bitwise.
 *
 * When n < k the points are all used as centroids and the remaining
 * centroids are filled by the repair rule (duplicates, slightly perturbed).
 */
#ifndef KVDEPOT_KMEANS_H
#define KVDEPOT_KMEANS_H

#include <stdint.h>

#include "kvdepot/backend.h"

typedef struct kvd_kmeans_params {
    int k;              /* clusters, >= 1 */
    int niter;          /* max Lloyd iterations; 0 = k-means++ seeding only */
    uint64_t seed;      /* every random choice derives from it */
    int64_t max_points; /* cluster a seeded subset of this many points when n is
                           larger; 0 = all points */
} kvd_kmeans_params;

struct kvd_kmeans_ops {
    /* See kvd_kmeans_train(). Arguments are validated by the wrapper. */
    int (*train)(kvd_backend *be, const kvd_kmeans_params *p, const kvd_tensor *x,
                 kvd_tensor *centroids, double *inertia, kvd_error *err);
    /* See kvd_kmeans_assign(). */
    int (*assign)(kvd_backend *be, const kvd_tensor *x, const kvd_tensor *centroids,
                  kvd_tensor *assign, kvd_tensor *dist2, kvd_error *err);
};

/*
 * Cluster the rows of x.
 *
 * @param[in]  be         backend that owns x and centroids
 * @param[in]  p          k, iterations, seed, sub-sampling
 * @param[in]  x          points, (n, d) f32; rows may be strided (stride[0] any
 *                        multiple of 4 >= 4*d), elements contiguous
 * @param[out] centroids  (k, d) f32, contiguous
 * @param[out] inertia    final inertia (see above), or NULL
 * @return 0; KVD_EINVAL (shape, dtype, k < 1, n == 0, niter < 0);
 *         KVD_ENOMEM; KVD_EUNSUPP when the backend lacks the op.
 */
int kvd_kmeans_train(kvd_backend *be, const kvd_kmeans_params *p, const kvd_tensor *x,
                     kvd_tensor *centroids, double *inertia, kvd_error *err);

/*
 * Nearest centroid of every row of x (ties to the lower index).
 *
 * @param[in]  x          (n, d) f32, row stride as for train
 * @param[in]  centroids  (k, d) f32 contiguous
 * @param[out] assign     (n) u32
 * @param[out] dist2      (n) f32 squared distances, or NULL
 * @return 0; KVD_EINVAL; KVD_ENOMEM; KVD_EUNSUPP.
 */
int kvd_kmeans_assign(kvd_backend *be, const kvd_tensor *x, const kvd_tensor *centroids,
                      kvd_tensor *assign, kvd_tensor *dist2, kvd_error *err);

/* ---- CPU implementation, plain pointers (host memory) ------------------ */

/* Scalar reference: the specification. x is (n, d) with row stride ldx floats;
 * centroids (k, d) contiguous. Returns 0, KVD_EINVAL or KVD_ENOMEM. */
int kvd_kmeans_train_ref(const kvd_kmeans_params *p, int64_t n, int d, const float *x,
                         int64_t ldx, float *centroids, double *inertia);
void kvd_kmeans_assign_ref(int64_t n, int d, const float *x, int64_t ldx, int k,
                           const float *centroids, uint32_t *assign, float *dist2);

/* The CPU backend's path: AVX2/FMA blocked distances when simd != 0 and the
 * CPU has them (nearest-centroid search with AVX-512 where the CPU has it,
 * unless simd == 2: AVX2 only, for tests), nthreads threads of the compute
 * pool (>= 1). Same contract as the ref, bit for bit. */
int kvd__kmeans_train_cpu(int nthreads, int simd, const kvd_kmeans_params *p, int64_t n, int d,
                          const float *x, int64_t ldx, float *centroids, double *inertia);
int kvd__kmeans_assign_cpu(int nthreads, int simd, int64_t n, int d, const float *x,
                           int64_t ldx, int k, const float *centroids, uint32_t *assign,
                           float *dist2);

#endif /* KVDEPOT_KMEANS_H */
