/*
 * Element-wise and per-row transforms on float tensors: dtype conversion,
 * Walsh-Hadamard transform, per-channel scaling.
 *
 * All three take tensors of any byte strides (up to KVD_MAX_DIMS dims, f32,
 * f16 or bf16 each, independently for source and destination) and compute in
 * f32. Narrowing to f16/bf16 rounds to nearest even; NaN stays NaN (quiet),
 * +-Inf stays +-Inf, f16 subnormals are kept (no flush to zero).
 *
 * In place: dst may alias src only when both describe the very same memory
 * (same data pointer, dtype, shape and strides). Partial overlap is undefined.
 */
#ifndef KVDEPOT_CONVERT_H
#define KVDEPOT_CONVERT_H

#include "kvdepot/backend.h"
#include "kvdepot/status.h"
#include "kvdepot/tensor.h"

/*
 * Backend op table; the wrappers validate, a backend may assume valid input.
 *
 *  convert        dst[i] = (dst dtype) src[i]
 *  hadamard       each row r along the last dim (length n, a power of two,
 *                 n >= 1): dst[r] = H_n src[r] / sqrt(n), where H_n is the
 *                 Sylvester Hadamard matrix in natural order,
 *                 H_n[i][j] = (-1)^popcount(i & j). With the 1/sqrt(n)
 *                 scaling the transform is orthonormal and its own inverse
 *                 (H_n H_n = n I), so applying it twice gives back the input
 *                 and q.k is preserved when both q and k are transformed.
 *  channel_scale  dst[..., j] = src[..., j] * s[j]   (divide = 0)
 *                 dst[..., j] = src[..., j] / s[j]   (divide = 1, a true
 *                 division, not a multiply by the reciprocal)
 *                 s: 1-D tensor of length n (last dim), f32/f16/bf16, any stride.
 */
struct kvd_convert_ops {
    int (*convert)(kvd_backend *be, const kvd_tensor *dst, const kvd_tensor *src,
                   kvd_error *err);
    int (*hadamard)(kvd_backend *be, const kvd_tensor *dst, const kvd_tensor *src,
                    kvd_error *err);
    int (*channel_scale)(kvd_backend *be, const kvd_tensor *dst, const kvd_tensor *src,
                         const kvd_tensor *s, int divide, kvd_error *err);
    /* appended */
    int (*gather_rows)(kvd_backend *be, void *dst, const uint64_t *src, int64_t n, size_t row,
                       kvd_error *err);
};

/*
 * Convert src into dst (same shape; dtypes f32/f16/bf16).
 * @return KVD_OK; KVD_EINVAL (message names the mismatch) for a non-float
 *         dtype, a shape mismatch, ndim outside 1..KVD_MAX_DIMS, negative
 *         sizes or NULL data with elements; KVD_EUNSUPP if the backend lacks it.
 */
int kvd_convert(kvd_backend *be, const kvd_tensor *dst, const kvd_tensor *src, kvd_error *err);

/*
 * Orthonormal Walsh-Hadamard transform of every row along the last dim.
 * @return as kvd_convert; also KVD_EINVAL when the last dim is not a power of
 *         two (1, 2, 4, ... are accepted; 0-sized rows need none).
 */
int kvd_hadamard(kvd_backend *be, const kvd_tensor *dst, const kvd_tensor *src, kvd_error *err);

/*
 * Multiply (divide = 0) or divide (divide = 1) each channel of the last dim
 * by s (1-D, length = last dim of src).
 * @return as kvd_convert; also KVD_EINVAL when s is not 1-D of that length.
 */
int kvd_channel_scale(kvd_backend *be, const kvd_tensor *dst, const kvd_tensor *src,
                      const kvd_tensor *s, int divide, kvd_error *err);

/*
 * Gather n rows of `row` bytes: row i is copied from the address src[i] to
 * dst + i * row. dst, the array src and every row it points at are memory
 * of be (on CUDA: device memory; one launch however many rows, e.g. tokens
 * picked from many pages of the device tier).
 * @return KVD_OK; KVD_EINVAL (NULL pointer, n < 0, row 0); KVD_EUNSUPP.
 */
int kvd_gather_rows(kvd_backend *be, void *dst, const uint64_t *src, int64_t n, size_t row,
                    kvd_error *err);

/* Scalar references on host memory: the specification. Arguments must be
 * valid. kvd_hadamard_ref is the O(n^2) matrix product of the definition,
 * summed in double; it returns KVD_OK or KVD_ENOMEM (row scratch). */
void kvd_convert_ref(const kvd_tensor *dst, const kvd_tensor *src);
int kvd_hadamard_ref(const kvd_tensor *dst, const kvd_tensor *src);
void kvd_channel_scale_ref(const kvd_tensor *dst, const kvd_tensor *src, const kvd_tensor *s,
                           int divide);

/* The CPU backend's table (kernels/cpu/convert.c). */
extern const struct kvd_convert_ops kvd__cpu_convert_ops;

#endif /* KVDEPOT_CONVERT_H */
