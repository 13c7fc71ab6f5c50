/*
 * SVD dimension reduction of keys and values (ZACK).
 *
 * Offline, per (layer, kv head): accumulate the Gram matrix G = X^T X of
 * calibration rows X, eigen-decompose it, G = R diag(e) R^T, and keep the
 * leading columns of the rotation R. The singular values of X are
 * s_i = sqrt(e_i). Rows projected with R[:, :r] keep the r directions of
 * largest energy; since R is orthonormal, (x R)(y R)^T = x y^T at full width,
 * and the truncated product drops only the small components.
 *
 * Which rows go into G:
 *   keys   - the Q-K pair: the key rows of the kv head AND the query rows of
 *            every query head that reads it (ZACK concatenates Q and K along
 *            the sequence axis), so one R serves both sides of q.k.
 *   values - the V rows; optionally also the rows of W_O^h (the head's slice
 *            of the output projection, one row of width Dv per hidden unit),
 *            the V-W_O pair. Both are plain calls to
 *            kvd_svd_gram_accumulate() with different inputs; a weight lets
 *            callers balance the two sides.
 *
 * Kept width: ZACK's singular-value removal rate: the smallest r such that
 * (sum_{i>=r} s_i) / (sum_i s_i) <= rate (sums of singular values, not of
 * energies, as ZACK Eq. 6), rounded up to a multiple of `align` (so the
 * reduced vectors can be INT2-grouped or VQ-split) and capped at D.
 * rate <= 0 keeps the full width D.
 *
 * Matrices are row-major; R is (D, D) with column i the i-th eigenvector
 * (descending eigenvalue), sign fixed so that its largest |entry| is positive
 * (deterministic output).
 */
#ifndef KVDEPOT_SVD_H
#define KVDEPOT_SVD_H

#include <stdint.h>

#include "kvdepot/backend.h"
#include "kvdepot/status.h"
#include "kvdepot/tensor.h"

/* gram (D, D) f64 += weight * x^T x for x (n, D), float dtype, rows `row_stride`
 * bytes apart. Host memory. Returns 0 or KVD_EINVAL. */
int kvd_svd_gram_accumulate(double *gram, int D, const void *x, kvd_dtype dtype, int64_t n,
                            int64_t row_stride, double weight, kvd_error *err);

/* Symmetric eigen-decomposition of a (n, n) f64 (cyclic Jacobi, offline;
 * n <= 1024). evals (n) descending, evecs (n, n) columns = eigenvectors.
 * a is not modified. Returns 0, KVD_EINVAL, KVD_ENOMEM, or KVD_EINTERNAL when
 * the sweeps do not converge (never seen for finite input). */
int kvd_svd_eigh(const double *a, int n, double *evals, double *evecs, kvd_error *err);

/* Rotation and singular values from a Gram matrix: R (D, D) f32, sv (D) f32
 * descending (sqrt of clamped eigenvalues). */
int kvd_svd_rotation(const double *gram, int D, float *R, float *sv, kvd_error *err);

/* Kept width for a removal rate (see above). */
int kvd_svd_kept_width(const float *sv, int D, double rate, int align);

/* y (n, r) f32 = x (n, D) R[:, :r]. x f32/f16/bf16 rows x_stride bytes apart;
 * y contiguous. The *_ref is the plain triple loop. */
int kvd_svd_project(kvd_backend *be, const float *R, int D, int r, const void *x, kvd_dtype dtype,
                    int64_t n, int64_t x_stride, float *y, kvd_error *err);
/* x (n, D) f32 = y (n, r) R[:, :r]^T (back-projection; exact inverse at r = D). */
int kvd_svd_unproject(kvd_backend *be, const float *R, int D, int r, const float *y, int64_t n,
                      float *x, kvd_error *err);

typedef struct kvd_svd_ops {
    int (*project)(kvd_backend *be, const float *R, int D, int r, const void *x, kvd_dtype dtype,
                   int64_t n, int64_t x_stride, float *y, kvd_error *err);
    int (*unproject)(kvd_backend *be, const float *R, int D, int r, const float *y, int64_t n,
                     float *x, kvd_error *err);
} kvd_svd_ops;

/* CPU implementations (no argument checks). */
void kvd_cpu_svd_project_ref(const float *R, int D, int r, const void *x, kvd_dtype dtype,
                             int64_t n, int64_t x_stride, float *y);
void kvd_cpu_svd_project_fast(const float *R, int D, int r, const void *x, kvd_dtype dtype,
                              int64_t n, int64_t x_stride, float *y, int nthreads);
void kvd_cpu_svd_unproject_ref(const float *R, int D, int r, const float *y, int64_t n, float *x);
/* The reference's bits: sums in double, in the same order. */
void kvd_cpu_svd_unproject_fast(const float *R, int D, int r, const float *y, int64_t n, float *x,
                                int nthreads);

#endif /* KVDEPOT_SVD_H */
