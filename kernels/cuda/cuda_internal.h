/*
 * Internal state and helpers shared by the CUDA backend's op files
 * (kernels/cuda/*.cu). Not installed, not used outside kernels/cuda.
 *
 * Streams: the backend owns a fixed pool of KVD_CUDA_SLOTS "slots", each a
 * non-blocking stream with its own cuBLAS handle and pinned staging buffer.
 * A calling thread is bound to one slot the first time it touches any CUDA
 * backend (a thread-local ticket taken from a global counter, modulo the
 * pool size) and keeps it for its life. Every op and copy a thread issues
 * goes to its slot's stream, so the ops of one worker run in order and the
 * workers of a server (one completion-queue thread each) overlap on the
 * device without callers passing streams: the public interface is unchanged.
 * With more threads than slots, threads share a slot; the slot mutex
 * serialises what is not thread-safe (the cuBLAS handle, the staging buffer).
 *
 * Ops are asynchronous on the slot's stream unless they must return a host
 * value (K-means inertia, a corrupt-code flag); kvd_backend_sync() waits for
 * every slot. Temporary device memory comes from the stream-ordered
 * allocator (cudaMallocAsync/cudaFreeAsync on the slot's stream), so it is
 * neither leaked on error nor freed under a running kernel.
 */
#ifndef KVDEPOT_CUDA_INTERNAL_H
#define KVDEPOT_CUDA_INTERNAL_H

#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <pthread.h>
#include <stdint.h>

extern "C" {
#include "kvdepot/attention.h"
#include "kvdepot/backend.h"
#include "kvdepot/convert.h"
#include "kvdepot/kmeans.h"
#include "kvdepot/pq.h"
#include "kvdepot/quant.h"
#include "kvdepot/svd.h"
#include "kvdepot/vq.h"
}

#define KVD_CUDA_SLOTS 16
/* Pinned staging per slot: two halves, so the memcpy into one overlaps the
 * DMA out of the other. Copies smaller than KVD_CUDA_STAGE_MIN go straight
 * from pageable memory (the driver stages them itself, no win in ours). */
#define KVD_CUDA_STAGE_BYTES (8u << 20)
#define KVD_CUDA_STAGE_MIN (256u << 10)
#define KVD_CUDA_PINNED_BLOCKS 8 /* host_alloc blocks a backend tracks */

struct kvd_cuda_slot {
    cudaStream_t stream;
    cublasHandle_t blas;  /* created on first use */
    void *pinned;         /* KVD_CUDA_STAGE_BYTES, created on first use */
    cudaEvent_t ev[2];    /* staging halves free again */
    pthread_mutex_t mu;
};

struct kvd_cuda_ctx {
    int device;
    volatile int unhealthy; /* set once by a sticky error, never cleared */
    char device_name[256];
    size_t total_mem;
    int sm_count;
    size_t smem_optin;      /* max dynamic shared memory per block after opt-in */
    double hbm_peak_gbs;    /* 2 * memory clock * bus width, GB/s */
    kvd_cuda_slot slots[KVD_CUDA_SLOTS];
    /* Pinned host blocks of host_alloc: copies from or to inside one go
     * straight to the DMA engine. */
    pthread_mutex_t pinned_mu;
    struct {
        char *p;
        size_t n;
    } pinned[KVD_CUDA_PINNED_BLOCKS];
};

/* What an op needs: the context, the calling thread's slot and stream. */
struct kvd_cuda_call {
    kvd_cuda_ctx *c;
    kvd_cuda_slot *slot;
    cudaStream_t s;
};

/* Map a CUDA error to a status (never aborts). A sticky error marks the
 * backend unhealthy and answers KVD_EUNAVAIL. */
int kvd__cuda_status(kvd_cuda_ctx *c, cudaError_t e, const char *what, kvd_error *err);
int kvd__cublas_status(kvd_cuda_ctx *c, cublasStatus_t e, const char *what, kvd_error *err);
/* Check health, select the device, find the calling thread's slot. */
int kvd__cuda_begin(kvd_backend *be, kvd_cuda_call *call, kvd_error *err);
/* After a launch: turn a launch error into a status. */
int kvd__cuda_launched(kvd_cuda_call *call, const char *what, kvd_error *err);
/* The cuBLAS calls the ops make, resolved by kvd__cuda_blas_load (blas.cu):
 * cuBLAS is loaded when a device is opened, not linked. */
struct kvd__blas_api {
    decltype(&cublasCreate) Create;
    decltype(&cublasDestroy) Destroy;
    decltype(&cublasSetStream) SetStream;
    decltype(&cublasGetStatusString) GetStatusString;
    decltype(&cublasSgemm) Sgemm;
    decltype(&cublasSgemmStridedBatched) SgemmStridedBatched;
};
extern kvd__blas_api kvd__blas;
/* Load cuBLAS once per process (later calls answer the first's outcome);
 * *where, if asked, names what was loaded. KVD_EUNAVAIL when it cannot be. */
extern "C" int kvd__cuda_blas_load(const char **where, kvd_error *err);
/* The slot's cuBLAS handle bound to its stream; the caller holds slot->mu. */
int kvd__cuda_blas(kvd_cuda_call *call, cublasHandle_t *h, kvd_error *err);
/* Stream-ordered scratch. */
int kvd__cuda_scratch(kvd_cuda_call *call, size_t bytes, void **p, kvd_error *err);
void kvd__cuda_scratch_free(kvd_cuda_call *call, void *p);
/* Wait for the calling thread's stream. */
int kvd__cuda_wait(kvd_cuda_call *call, const char *what, kvd_error *err);

/* Blocks for a 1-D grid over n items, capped so the grid stays legal; the
 * kernels are grid-stride loops. */
static inline unsigned kvd__cuda_blocks(int64_t n, int threads)
{
    int64_t b = (n + threads - 1) / threads;
    if (b < 1)
        b = 1;
    if (b > (1 << 20))
        b = 1 << 20;
    return (unsigned)b;
}

/* ---- device helpers ---------------------------------------------------- */

/* A tensor view as a kernel argument (by value). Strides in bytes. */
struct kvd_dview {
    char *data;
    int dtype;
    int ndim;
    long long shape[KVD_MAX_DIMS];
    long long stride[KVD_MAX_DIMS];
};

static inline kvd_dview kvd__dview(const kvd_tensor *t)
{
    kvd_dview v;
    v.data = (char *)t->data;
    v.dtype = t->dtype;
    v.ndim = t->ndim;
    for (int i = 0; i < KVD_MAX_DIMS; i++) {
        v.shape[i] = i < t->ndim ? t->shape[i] : 1;
        v.stride[i] = i < t->ndim ? t->stride[i] : 0;
    }
    return v;
}

#ifdef __CUDACC__
#include <cuda_bf16.h>
#include <cuda_fp16.h>

__device__ __forceinline__ float kvd_ld_float(const char *p, int dtype)
{
    switch (dtype) {
    case KVD_DTYPE_F16:
        return __half2float(*reinterpret_cast<const __half *>(p));
    case KVD_DTYPE_BF16:
        return __bfloat162float(*reinterpret_cast<const __nv_bfloat16 *>(p));
    default:
        return *reinterpret_cast<const float *>(p);
    }
}

__device__ __forceinline__ void kvd_st_float(char *p, int dtype, float v)
{
    switch (dtype) {
    case KVD_DTYPE_F16:
        *reinterpret_cast<__half *>(p) = __float2half_rn(v);
        break;
    case KVD_DTYPE_BF16:
        *reinterpret_cast<__nv_bfloat16 *>(p) = __float2bfloat16_rn(v);
        break;
    default:
        *reinterpret_cast<float *>(p) = v;
    }
}

/* Byte offset of the element with row-major linear index i. */
__device__ __forceinline__ long long kvd_offset(const kvd_dview &v, long long i)
{
    long long off = 0;
#pragma unroll
    for (int d = KVD_MAX_DIMS - 1; d >= 0; d--) {
        if (d < v.ndim) {
            long long c = i % v.shape[d];
            i /= v.shape[d];
            off += c * v.stride[d];
        }
    }
    return off;
}
#endif

/* Family tables (one per .cu file). */
extern const struct kvd_convert_ops kvd__cuda_convert_ops;
extern const struct kvd_quant_ops kvd__cuda_quant_ops;
extern const struct kvd_kmeans_ops kvd__cuda_kmeans_ops;
extern const struct kvd_vq_ops kvd__cuda_vq_ops;
extern const struct kvd_pq_ops kvd__cuda_pq_ops;
extern const struct kvd_svd_ops kvd__cuda_svd_ops;
extern const struct kvd_attn_ops kvd__cuda_attn_ops;

/* Shared between kmeans.cu, vq.cu and pq.cu: K-means on device points
 * x (n, d) f32 with row stride ldx floats, centroids (k, d) f32 on device. */
int kvd__cuda_kmeans_train(kvd_cuda_call *call, const kvd_kmeans_params *p, int64_t n, int d,
                           const float *x, int64_t ldx, float *centroids, double *inertia,
                           kvd_error *err);
/* m K-means at once on the column slices j*dsub.. of x (n, m*dsub), row
 * stride ldx floats: the device-resident driver (device seeding, batched
 * SGEMM, fixed-point sums). centroids (m, k, dsub). Seeds from p->seed;
 * not the CPU's draws. */
int kvd__cuda_kmeans_train_multi(kvd_cuda_call *call, const kvd_kmeans_params *p, int m,
                                 int64_t n, int dsub, const float *x, int64_t ldx,
                                 float *centroids, double *inertia, kvd_error *err);
/* 1 when KVD_CUDA_KMEANS_EXACT=1 asks for the host-driven driver (the CPU's
 * draws, bitwise-equal seeding; slow). */
int kvd__cuda_kmeans_exact(void);
/* One K-means: the device-resident driver (m = 1), or the exact one when
 * asked for. inertia as in kvdepot/kmeans.h (may be NULL). */
int kvd__cuda_kmeans_train_auto(kvd_cuda_call *call, const kvd_kmeans_params *p, int64_t n, int d,
                                const float *x, int64_t ldx, float *centroids, double *inertia,
                                kvd_error *err);
/* Nearest centroid per point, direct sum of squared differences in the
 * order of the CPU reference (bitwise its result). dist2 may be NULL. */
int kvd__cuda_kmeans_assign(kvd_cuda_call *call, int64_t n, int d, const float *x, int64_t ldx,
                            int k, const float *centroids, uint32_t *assign, float *dist2,
                            kvd_error *err);
/* Orthonormal Hadamard of `rows` contiguous f32 rows of length n in place,
 * optionally scaling (multiply or divide by s) and converting from src first. */
int kvd__cuda_scale_hadamard(kvd_cuda_call *call, const kvd_tensor *src, const kvd_tensor *s,
                             int divide, float *out, kvd_error *err);

#endif /* KVDEPOT_CUDA_INTERNAL_H */
