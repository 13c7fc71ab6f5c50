/*
 * A CPU emulation of the part of CUDA that kernels/cuda uses, so the whole
 * CUDA backend (its host code in backend.cu and every kernel) runs, slowly
 * and exactly, on a machine without a GPU:
 *
 *  - kernels: every thread of a block is a fiber (ucontext) on one OS
 *    thread, scheduled round robin; __syncthreads, __syncwarp, the warp
 *    shuffles and votes are barriers over the block or the warp; shared
 *    memory is a per-block buffer (poisoned with NaN bytes before each
 *    block); blocks run one after another; launches are synchronous;
 *  - the runtime: device memory, pinned memory and memory pools are host
 *    memory; streams and events exist but every call has finished when it
 *    returns; one emulated device ("CUDA emulation", KVD_EMU_SMS SMs, 2 by
 *    default, so that a few thousand tokens are already split over SMs);
 *  - cuBLAS: SGEMM and strided batched SGEMM (column-major, as cuBLAS) by a
 *    plain loop.
 *
 * Every launch and runtime call holds one process-wide lock, so host threads
 * may call the backend concurrently, as kvdepotd's workers do.
 *
 * The .cu files are translated by translate.py (launch syntax and dynamic
 * shared memory only) and compiled as C++ with these headers in place of
 * CUDA's (the stubs cuda_runtime.h, cuda_fp16.h, cuda_bf16.h, cublas_v2.h).
 */
#ifndef KVD_CUDA_EMU_H
#define KVD_CUDA_EMU_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <functional>

extern "C" {
#include "kvdepot/tensor.h"
}

#define __CUDACC__ 1
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __restrict__ __restrict
#define __launch_bounds__(...)
#define __shared__ static
#define __grid_constant__

/* ---- runtime API ---------------------------------------------------------- */

typedef int cudaError_t;
enum {
    cudaSuccess = 0,
    cudaErrorInvalidValue = 1,
    cudaErrorMemoryAllocation = 2,
    cudaErrorNoDevice = 100,
    cudaErrorInvalidDevice = 101,
    cudaErrorECCUncorrectable = 214,
    cudaErrorIllegalAddress = 700,
    cudaErrorLaunchTimeout = 702,
    cudaErrorHardwareStackError = 714,
    cudaErrorIllegalInstruction = 715,
    cudaErrorMisalignedAddress = 716,
    cudaErrorInvalidAddressSpace = 717,
    cudaErrorInvalidPc = 718,
    cudaErrorLaunchFailure = 719,
};
typedef struct emu_stream *cudaStream_t;
typedef struct emu_event *cudaEvent_t;
typedef struct emu_pool *cudaMemPool_t;
enum cudaMemcpyKind {
    cudaMemcpyHostToHost = 0,
    cudaMemcpyHostToDevice = 1,
    cudaMemcpyDeviceToHost = 2,
    cudaMemcpyDeviceToDevice = 3,
    cudaMemcpyDefault = 4
};
enum cudaFuncAttribute { cudaFuncAttributeMaxDynamicSharedMemorySize = 8 };
enum cudaDeviceAttr { cudaDevAttrMemoryClockRate = 36, cudaDevAttrGlobalMemoryBusWidth = 37 };
enum cudaMemPoolAttr { cudaMemPoolAttrReleaseThreshold = 4 };
enum { cudaStreamNonBlocking = 1, cudaEventDisableTiming = 2, cudaHostAllocPortable = 1 };

struct cudaDeviceProp {
    char name[256];
    size_t totalGlobalMem;
    int multiProcessorCount;
    size_t sharedMemPerBlockOptin;
    int major, minor;
};

const char *cudaGetErrorString(cudaError_t e);
cudaError_t cudaGetLastError(void);
cudaError_t cudaGetDeviceCount(int *n);
cudaError_t cudaSetDevice(int device);
cudaError_t cudaGetDeviceProperties(cudaDeviceProp *p, int device);
cudaError_t cudaDeviceGetAttribute(int *v, cudaDeviceAttr attr, int device);
cudaError_t cudaDeviceGetDefaultMemPool(cudaMemPool_t *pool, int device);
cudaError_t cudaMemPoolSetAttribute(cudaMemPool_t pool, cudaMemPoolAttr attr, void *value);
cudaError_t cudaMalloc(void **p, size_t n);
cudaError_t cudaFree(void *p);
cudaError_t cudaMallocAsync(void **p, size_t n, cudaStream_t s);
cudaError_t cudaFreeAsync(void *p, cudaStream_t s);
cudaError_t cudaHostAlloc(void **p, size_t n, unsigned flags);
cudaError_t cudaFreeHost(void *p);
cudaError_t cudaMemGetInfo(size_t *free_bytes, size_t *total_bytes);
cudaError_t cudaMemcpy(void *d, const void *s, size_t n, cudaMemcpyKind k);
cudaError_t cudaMemcpyAsync(void *d, const void *s, size_t n, cudaMemcpyKind k, cudaStream_t st);
cudaError_t cudaMemcpy2DAsync(void *d, size_t dpitch, const void *s, size_t spitch, size_t width,
                              size_t height, cudaMemcpyKind k, cudaStream_t st);
cudaError_t cudaMemsetAsync(void *d, int v, size_t n, cudaStream_t st);
cudaError_t cudaStreamCreate(cudaStream_t *s);
cudaError_t cudaStreamCreateWithFlags(cudaStream_t *s, unsigned flags);
cudaError_t cudaStreamDestroy(cudaStream_t s);
cudaError_t cudaStreamSynchronize(cudaStream_t s);
cudaError_t cudaEventCreate(cudaEvent_t *e);
cudaError_t cudaEventCreateWithFlags(cudaEvent_t *e, unsigned flags);
cudaError_t cudaEventDestroy(cudaEvent_t e);
cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s);
cudaError_t cudaEventSynchronize(cudaEvent_t e);
template <class T> static inline cudaError_t cudaFuncSetAttribute(T *, cudaFuncAttribute, int)
{
    return cudaSuccess;
}

/* ---- cuBLAS ------------------------------------------------------------------ */

typedef struct emu_blas *cublasHandle_t;
typedef int cublasStatus_t;
enum {
    CUBLAS_STATUS_SUCCESS = 0,
    CUBLAS_STATUS_NOT_INITIALIZED = 1,
    CUBLAS_STATUS_ALLOC_FAILED = 3,
    CUBLAS_STATUS_INVALID_VALUE = 7,
    CUBLAS_STATUS_ARCH_MISMATCH = 8,
    CUBLAS_STATUS_EXECUTION_FAILED = 13,
    CUBLAS_STATUS_NOT_SUPPORTED = 15,
};
typedef enum cublasOperation_t { CUBLAS_OP_N = 0, CUBLAS_OP_T = 1 } cublasOperation_t;
cublasStatus_t cublasCreate(cublasHandle_t *h);
cublasStatus_t cublasDestroy(cublasHandle_t h);
cublasStatus_t cublasSetStream(cublasHandle_t h, cudaStream_t s);
const char *cublasGetStatusString(cublasStatus_t s);
cublasStatus_t cublasSgemm(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m,
                           int n, int k, const float *alpha, const float *A, int lda,
                           const float *B, int ldb, const float *beta, float *C, int ldc);
cublasStatus_t cublasSgemmStridedBatched(cublasHandle_t h, cublasOperation_t ta,
                                         cublasOperation_t tb, int m, int n, int k,
                                         const float *alpha, const float *A, int lda, long long sA,
                                         const float *B, int ldb, long long sB, const float *beta,
                                         float *C, int ldc, long long sC, int batch);

/* ---- vector types -------------------------------------------------------------- */

struct dim3 {
    unsigned x, y, z;
    dim3(unsigned a = 1, unsigned b = 1, unsigned c = 1) : x(a), y(b), z(c) {}
};
struct uint2 {
    unsigned x, y;
};
struct uint4 {
    unsigned x, y, z, w;
};
static inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d)
{
    return uint4{a, b, c, d};
}
struct float2 {
    float x, y;
};
/* 16-byte aligned, as on a GPU: a misaligned float4 access is UB the
 * sanitizer build reports */
struct alignas(16) float4 {
    float x, y, z, w;
};

/* ---- f16 / bf16 -------------------------------------------------------------- */

struct __half {
    unsigned short b;
};
struct __half2 {
    __half x, y;
};
struct __nv_bfloat16 {
    unsigned short b;
};
typedef __half half;
static inline float __half2float(__half h) { return kvd_f16_to_f32(h.b); }
static inline __half __float2half_rn(float f) { return __half{kvd_f32_to_f16(f)}; }
static inline float2 __half22float2(__half2 h)
{
    return float2{__half2float(h.x), __half2float(h.y)};
}
static inline float __bfloat162float(__nv_bfloat16 h) { return kvd_bf16_to_f32(h.b); }
static inline __nv_bfloat16 __float2bfloat16_rn(float f)
{
    return __nv_bfloat16{kvd_f32_to_bf16(f)};
}
static inline __half __ushort_as_half(unsigned short u)
{
    return __half{u};
}
static inline unsigned short __half_as_ushort(__half h)
{
    return h.b;
}

/* ---- arithmetic intrinsics ------------------------------------------------------ */

static inline float __uint_as_float(unsigned u)
{
    float f;
    memcpy(&f, &u, 4);
    return f;
}
static inline unsigned __float_as_uint(float f)
{
    unsigned u;
    memcpy(&u, &f, 4);
    return u;
}
/* Round-to-nearest operations: one IEEE rounding each, as the host's
 * (the emulation is built with -ffp-contract=off, like --fmad=false). */
static inline float __fadd_rn(float a, float b)
{
    return a + b;
}
static inline float __fsub_rn(float a, float b)
{
    return a - b;
}
static inline float __fmul_rn(float a, float b)
{
    return a * b;
}
static inline float __fdiv_rn(float a, float b)
{
    return a / b;
}
static inline float __fmaf_rn(float a, float b, float c) { return fmaf(a, b, c); }
static inline long long __float2ll_rn(float f)
{
    return llrintf(f);
}
static inline int __ffs(unsigned x)
{
    return x ? __builtin_ctz(x) + 1 : 0;
}
static inline int __clz(int x)
{
    return x ? __builtin_clz((unsigned)x) : 32;
}
static inline int __dp4a(int a, int b, int c)
{
    for (int i = 0; i < 4; i++)
        c += (int)(signed char)(a >> (8 * i)) * (int)(signed char)(b >> (8 * i));
    return c;
}
static inline unsigned __dp4a(unsigned a, unsigned b, unsigned c)
{
    for (int i = 0; i < 4; i++)
        c += ((a >> (8 * i)) & 0xffu) * ((b >> (8 * i)) & 0xffu);
    return c;
}
static inline long long min(long long a, long long b) { return a < b ? a : b; }
static inline int min(int a, int b) { return a < b ? a : b; }
static inline unsigned min(unsigned a, unsigned b)
{
    return a < b ? a : b;
}
static inline long long max(long long a, long long b)
{
    return a > b ? a : b;
}
static inline int max(int a, int b)
{
    return a > b ? a : b;
}
/* misaligned vector and word loads fault on a GPU: here too */
void emu_misaligned(const void *p, size_t align);
template <class T> static inline T __ldg(const T *p)
{
    if ((uintptr_t)p % sizeof(T) && sizeof(T) <= 16)
        emu_misaligned(p, sizeof(T));
    return *p;
}
/* Atomics: the threads of a launch run one at a time, so plain updates are
 * atomic; they return the old value, as CUDA's. */
template <class T, class U> static inline T atomicAdd(T *p, U v)
{
    T o = *p;
    *p = (T)(o + (T)v);
    return o;
}
template <class T, class U> static inline T atomicMin(T *p, U v)
{
    T o = *p;
    if ((T)v < o)
        *p = (T)v;
    return o;
}
template <class T, class U> static inline T atomicMax(T *p, U v)
{
    T o = *p;
    if ((T)v > o)
        *p = (T)v;
    return o;
}

/* ---- threads, barriers, shuffles, votes ----------------------------------------- */

extern dim3 threadIdx, blockIdx, blockDim, gridDim;
extern void *emu_smem;

void emu_syncthreads(void);
void emu_syncwarp(void);
/* lane's value published, then the partner lane's value read */
uint64_t emu_exchange(uint64_t v, int src_lane);

static inline void __syncthreads(void) { emu_syncthreads(); }
/* Blocks run one after another: memory is already ordered. */
static inline void __threadfence(void) {}
static inline void __syncwarp(unsigned = 0xffffffffu) { emu_syncwarp(); }

static inline int emu_lane(void)
{
    return (int)(threadIdx.x & 31);
}
template <class T> static inline T emu_shfl(T v, int src)
{
    uint64_t u = 0;
    memcpy(&u, &v, sizeof(T));
    u = emu_exchange(u, src);
    T r;
    memcpy(&r, &u, sizeof(T));
    return r;
}
/* A source lane outside the warp (up/down past its end) reads its own value,
 * as on the GPU. */
template <class T> static inline T __shfl_sync(unsigned, T v, int src)
{
    return emu_shfl(v, src & 31);
}
template <class T> static inline T __shfl_xor_sync(unsigned, T v, int o)
{
    return emu_shfl(v, emu_lane() ^ o);
}
template <class T> static inline T __shfl_up_sync(unsigned, T v, unsigned d)
{
    int src = emu_lane() - (int)d;
    return emu_shfl(v, src < 0 ? emu_lane() : src);
}
template <class T> static inline T __shfl_down_sync(unsigned, T v, unsigned d)
{
    int src = emu_lane() + (int)d;
    return emu_shfl(v, src > 31 ? emu_lane() : src);
}
unsigned emu_ballot(int pred);
static inline unsigned __ballot_sync(unsigned, int pred)
{
    return emu_ballot(pred);
}

void emu_run(dim3 grid, dim3 block, size_t smem, const std::function<void()> &body);

/* What translate.py makes of kernel<<<grid, block[, smem[, stream]]>>>(args). */
template <class F>
static inline void emu_launch(dim3 grid, dim3 block, size_t smem, cudaStream_t, F f)
{
    emu_run(grid, block, smem, std::function<void()>(f));
}
template <class F> static inline void emu_launch(dim3 grid, dim3 block, size_t smem, F f)
{
    emu_run(grid, block, smem, std::function<void()>(f));
}
template <class F> static inline void emu_launch(dim3 grid, dim3 block, F f)
{
    emu_run(grid, block, 0, std::function<void()>(f));
}

#endif
