/*
 * A CPU emulation of the small part of CUDA that kernels/cuda/attn.cu uses,
 * so its kernels run (slowly, exactly) on a machine without a GPU: every
 * thread of a block is a fiber (ucontext) on one OS thread, scheduled round
 * robin; __syncthreads, __syncwarp and the warp shuffles are barriers over
 * the block or the warp; shared memory is a per-block buffer (poisoned with
 * NaN bytes before each block); device memory is host memory. Blocks run one
 * after another. Launches are synchronous.
 *
 * Only for test_cuda_attn_emu (tests/backend/cuda_attn.cmake): the
 * translated attn.cu (translate.py) includes this through the stub
 * cuda_runtime.h / cuda_fp16.h / cuda_bf16.h / cublas_v2.h beside it.
 */
#ifndef KVD_CUDA_ATTN_EMU_H
#define KVD_CUDA_ATTN_EMU_H

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

/* ---- runtime API ---------------------------------------------------------- */

typedef int cudaError_t;
typedef void *cudaStream_t;
typedef void *cudaEvent_t;
enum { cudaSuccess = 0, cudaErrorMemoryAllocation = 2 };
enum cudaMemcpyKind { cudaMemcpyHostToDevice = 1, cudaMemcpyDeviceToHost = 2, cudaMemcpyDeviceToDevice = 3 };
enum cudaFuncAttribute { cudaFuncAttributeMaxDynamicSharedMemorySize = 8 };

typedef void *cublasHandle_t;
typedef int cublasStatus_t;

static inline cudaError_t cudaMemcpyAsync(void *d, const void *s, size_t n, int, cudaStream_t)
{
    memcpy(d, s, n);
    return cudaSuccess;
}
static inline cudaError_t cudaFuncSetAttribute(const void *, int, int) { return cudaSuccess; }
static inline cudaError_t cudaGetLastError(void) { return cudaSuccess; }

struct dim3 {
    unsigned x, y, z;
    dim3(unsigned a = 1, unsigned b = 1, unsigned c = 1) : x(a), y(b), z(c) {}
};

struct uint4 {
    unsigned x, y, z, w;
};
static inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return uint4{a, b, c, d}; }
struct float2 {
    float x, y;
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
static inline float __half2float(__half h) { return kvd_f16_to_f32(h.b); }
static inline __half __float2half_rn(float f) { return __half{kvd_f32_to_f16(f)}; }
static inline float2 __half22float2(__half2 h) { return float2{__half2float(h.x), __half2float(h.y)}; }
static inline float __bfloat162float(__nv_bfloat16 h) { return kvd_bf16_to_f32(h.b); }
static inline __nv_bfloat16 __float2bfloat16_rn(float f) { return __nv_bfloat16{kvd_f32_to_bf16(f)}; }

/* ---- arithmetic intrinsics ------------------------------------------------------ */

static inline float __uint_as_float(unsigned u)
{
    float f;
    memcpy(&f, &u, 4);
    return f;
}
static inline float __fmaf_rn(float a, float b, float c) { return fmaf(a, b, c); }
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
/* misaligned vector and word loads fault on a GPU: here too */
void emu_misaligned(const void *p, size_t align);
template <class T> static inline T __ldg(const T *p)
{
    if ((uintptr_t)p % sizeof(T) && sizeof(T) <= 16)
        emu_misaligned(p, sizeof(T));
    return *p;
}
static inline float atomicAdd(float *p, float v)
{
    float o = *p;
    *p = o + v;
    return o;
}
static inline int atomicMin(int *p, int v)
{
    int o = *p;
    if (v < o)
        *p = v;
    return o;
}

/* ---- threads, barriers, shuffles ----------------------------------------------- */

extern dim3 threadIdx, blockIdx, blockDim, gridDim;
extern void *emu_smem;

void emu_syncthreads(void);
void emu_syncwarp(void);
/* lane's value published, then the partner lane's value read */
uint32_t emu_exchange(uint32_t v, int src_lane);

static inline void __syncthreads(void) { emu_syncthreads(); }
static inline void __syncwarp(unsigned = 0xffffffffu) { emu_syncwarp(); }

static inline float __shfl_xor_sync(unsigned, float v, int o)
{
    uint32_t u;
    memcpy(&u, &v, 4);
    u = emu_exchange(u, (int)(threadIdx.x & 31) ^ o);
    float r;
    memcpy(&r, &u, 4);
    return r;
}
static inline int __shfl_xor_sync(unsigned, int v, int o)
{
    return (int)emu_exchange((uint32_t)v, (int)(threadIdx.x & 31) ^ o);
}

void emu_run(dim3 grid, dim3 block, size_t smem, const std::function<void()> &body);

template <class F> static inline void emu_launch(dim3 grid, dim3 block, size_t smem, cudaStream_t, F f)
{
    emu_run(grid, block, smem, std::function<void()>(f));
}

#endif
