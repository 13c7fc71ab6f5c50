/*
 * Element types and tensor descriptors shared by every kvdepot module.
 */
#ifndef KVDEPOT_TENSOR_H
#define KVDEPOT_TENSOR_H

#include <stddef.h>
#include <stdint.h>

/* Element types. F16/BF16/F32 carry the same numbers as kvdepot.v1.DType on
 * the wire, so a wire dtype converts with a cast. */
typedef enum kvd_dtype {
    KVD_DTYPE_INVALID = 0,
    KVD_DTYPE_F16 = 1,  /* IEEE binary16 */
    KVD_DTYPE_BF16 = 2, /* bfloat16 (top half of a binary32) */
    KVD_DTYPE_F32 = 3,  /* IEEE binary32 */
    KVD_DTYPE_U8 = 4,
    KVD_DTYPE_I8 = 5,
    KVD_DTYPE_U16 = 6,
    KVD_DTYPE_I32 = 7,
    KVD_DTYPE_U32 = 8,
    KVD_DTYPE_COUNT
} kvd_dtype;

/* Bytes per element; 0 for an invalid dtype. */
size_t kvd_dtype_size(kvd_dtype t);
/* "f16", "bf16", "f32", ...; "invalid" for anything else. */
const char *kvd_dtype_name(kvd_dtype t);
/* 1 for the float types engines exchange (f16, bf16, f32). */
int kvd_dtype_is_float(kvd_dtype t);

#define KVD_MAX_DIMS 4

/*
 * A strided view of memory owned elsewhere (host memory for the CPU backend,
 * device memory for the CUDA backend: whatever the backend that runs the op
 * allocated). Shapes are row-major: shape[0] is the outermost dimension,
 * shape[ndim-1] the innermost. stride[i] is the distance in BYTES between
 * consecutive indices of dimension i; a contiguous tensor has
 * stride[ndim-1] = elem size, stride[i] = stride[i+1] * shape[i+1].
 */
typedef struct kvd_tensor {
    kvd_dtype dtype;
    int ndim;
    int64_t shape[KVD_MAX_DIMS];
    int64_t stride[KVD_MAX_DIMS];
    void *data;
} kvd_tensor;

/* Describe contiguous memory of the given shape (ndim <= KVD_MAX_DIMS). */
kvd_tensor kvd_tensor_make(kvd_dtype dtype, void *data, int ndim, const int64_t *shape);
/* Number of elements. */
int64_t kvd_tensor_nelem(const kvd_tensor *t);
/* 1 when strides are those of a contiguous row-major tensor. */
int kvd_tensor_is_contiguous(const kvd_tensor *t);

/* Scalar float conversions, exact for every finite, infinite and NaN input
 * (round-to-nearest-even on narrowing). */
float kvd_f16_to_f32(uint16_t h);
uint16_t kvd_f32_to_f16(float f);
float kvd_bf16_to_f32(uint16_t h);
uint16_t kvd_f32_to_bf16(float f);

#endif /* KVDEPOT_TENSOR_H */
