/*
 * VQ codec (VecInfer): smooth + Hadamard transform of keys, then vector
 * quantization of d-dimensional sub-vectors with a 2^b-entry codebook.
 *
 * Transform (one (layer, kv head), head_dim D a power of two):
 *
 *   lambda_i = sqrt(max_t |K_t,i|)           smoothing factors, (D) f32,
 *                                            from calibration keys K (T, D);
 *                                            non-finite values are ignored,
 *                                            a channel whose max is 0 gets
 *                                            lambda_i = 1
 *   K~ = K diag(lambda)^-1 H_D               keys:    K~_t,: = H_D (K_t,: / lambda)
 *   q~ = q diag(lambda)    H_D               queries: q~ = H_D (q * lambda)
 *
 * H_D is the normalised Walsh-Hadamard matrix (entries +-1/sqrt(D)): it is
 * symmetric and orthogonal, so q~ . K~_t = q . K_t exactly in real
 * arithmetic: attention scores are unchanged, while the division by lambda
 * flattens the per-channel outliers and the rotation spreads what is left
 * over all channels, which is what makes a shared codebook fit. lambda from
 * several calibration batches combines with an element-wise max (sqrt is
 * monotone). Values are quantized without a transform (VecInfer does the
 * same): call encode/decode on V directly with a V codebook.
 *
 * Layouts (one (layer, kv head)):
 *   smoothing   lambda     (D) f32
 *   codebook    C          (2^b, d) f32, d in {2, 4, 8}, b in {4..12};
 *                          ONE codebook shared by all D/d sub-vector
 *                          positions. After the Hadamard rotation every
 *                          position sees the same distribution, so one
 *                          codebook fits them all; it is trained on T*D/d
 *                          points instead of T, and stays small (d8b12:
 *                          128 KiB) so the attention kernel keeps it in cache.
 *   codes       (T, D/d)   uint8 when b <= 8, uint16 when b > 8; code
 *                          [t][p] is the codebook row nearest to sub-vector
 *                          x[t][p*d : (p+1)*d] (ties to the lower row).
 *                          Bits per value = b/d (d4b8 = 2, d8b12 = 1.5).
 *   decode      x^[t][p*d + i] = C[codes[t][p]][i]
 *
 * Codes >= 2^b never come out of encode; decode validates every code and
 * returns KVD_ECORRUPT for one out of range (codes may come from the wire).
 */
#ifndef KVDEPOT_VQ_H
#define KVDEPOT_VQ_H

#include <stdint.h>

#include "kvdepot/backend.h"
#include "kvdepot/kmeans.h"

struct kvd_vq_ops {
    int (*smooth_factors)(kvd_backend *be, const kvd_tensor *k, kvd_tensor *lambda,
                          kvd_error *err);
    int (*transform_keys)(kvd_backend *be, const kvd_tensor *k, const kvd_tensor *lambda,
                          kvd_tensor *out, kvd_error *err);
    int (*transform_queries)(kvd_backend *be, const kvd_tensor *q, const kvd_tensor *lambda,
                             kvd_tensor *out, kvd_error *err);
    int (*train)(kvd_backend *be, const kvd_tensor *x, const kvd_kmeans_params *km,
                 kvd_tensor *codebook, double *inertia, kvd_error *err);
    int (*encode)(kvd_backend *be, const kvd_tensor *x, const kvd_tensor *codebook,
                  kvd_tensor *codes, kvd_error *err);
    int (*decode)(kvd_backend *be, const kvd_tensor *codes, const kvd_tensor *codebook,
                  kvd_tensor *out, kvd_error *err);
};

/*
 * Smoothing factors from calibration keys.
 * @param[in]  k       (T, D) f16/bf16/f32 contiguous, T >= 1
 * @param[out] lambda  (D) f32
 * @return 0; KVD_EINVAL; KVD_EUNSUPP.
 */
int kvd_vq_smooth_factors(kvd_backend *be, const kvd_tensor *k, kvd_tensor *lambda,
                          kvd_error *err);

/*
 * K~ = (K / lambda) H_D for every row. lambda NULL = no smoothing (Hadamard
 * only). D must be a power of two.
 * @param[in]  k       (T, D) f16/bf16/f32 contiguous
 * @param[in]  lambda  (D) f32 or NULL
 * @param[out] out     (T, D) f32 contiguous (may not alias k)
 * @return 0; KVD_EINVAL; KVD_EUNSUPP.
 */
int kvd_vq_transform_keys(kvd_backend *be, const kvd_tensor *k, const kvd_tensor *lambda,
                          kvd_tensor *out, kvd_error *err);

/* q~ = (q * lambda) H_D for every row; q (H, D) f16/bf16/f32, out (H, D) f32. */
int kvd_vq_transform_queries(kvd_backend *be, const kvd_tensor *q, const kvd_tensor *lambda,
                             kvd_tensor *out, kvd_error *err);

/*
 * Train a codebook: K-means (kvdepot/kmeans.h) with k = 2^b over all the
 * d-dimensional sub-vectors of x, i.e. x viewed as (T*D/d, d). km->k is
 * ignored (taken from codebook's shape).
 * @param[in]  x         (T, D) f32 contiguous (transformed keys, or values)
 * @param[out] codebook  (2^b, d) f32; D % d == 0
 * @return 0; KVD_EINVAL; KVD_ENOMEM; KVD_EUNSUPP.
 */
int kvd_vq_train(kvd_backend *be, const kvd_tensor *x, const kvd_kmeans_params *km,
                 kvd_tensor *codebook, double *inertia, kvd_error *err);

/*
 * Encode: nearest codebook row of every sub-vector (squared L2, ties to the
 * lower row).
 * @param[in]  x         (T, D) f32 contiguous
 * @param[in]  codebook  (2^b, d) f32
 * @param[out] codes     (T, D/d) u8 (b <= 8) or u16 (b > 8)
 * @return 0; KVD_EINVAL; KVD_EUNSUPP.
 */
int kvd_vq_encode(kvd_backend *be, const kvd_tensor *x, const kvd_tensor *codebook,
                  kvd_tensor *codes, kvd_error *err);

/*
 * Decode: out[t][p*d + i] = codebook[codes[t][p]][i].
 * @return 0; KVD_EINVAL (shapes); KVD_ECORRUPT (a code >= 2^b); KVD_EUNSUPP.
 */
int kvd_vq_decode(kvd_backend *be, const kvd_tensor *codes, const kvd_tensor *codebook,
                  kvd_tensor *out, kvd_error *err);

/* ---- CPU implementation, plain pointers (host memory) ------------------ */

/* Scalar references (the specification). x/k/q rows are f32 here; D a power
 * of two for the transforms. codes16 is used when b > 8, codes8 otherwise. */
void kvd_vq_smooth_factors_ref(int64_t T, int D, const float *k, float *lambda);
void kvd_vq_transform_keys_ref(int64_t T, int D, const float *k, const float *lambda,
                               float *out);
void kvd_vq_transform_queries_ref(int64_t H, int D, const float *q, const float *lambda,
                                  float *out);
void kvd_vq_encode_ref(int64_t T, int D, int d, int b, const float *x, const float *codebook,
                       uint8_t *codes8, uint16_t *codes16);
/* Returns 0 or KVD_ECORRUPT (out is then partly written). */
int kvd_vq_decode_ref(int64_t T, int D, int d, int b, const uint8_t *codes8,
                      const uint16_t *codes16, const float *codebook, float *out);

/* The CPU backend's paths (AVX2 when simd != 0 and available; nthreads). */
void kvd__vq_encode_cpu(int nthreads, int simd, int64_t T, int D, int d, int b, const float *x,
                        const float *codebook, uint8_t *codes8, uint16_t *codes16);
int kvd__vq_decode_cpu(int nthreads, int64_t T, int D, int d, int b, const uint8_t *codes8,
                       const uint16_t *codes16, const float *codebook, float *out);

#endif /* KVDEPOT_VQ_H */
