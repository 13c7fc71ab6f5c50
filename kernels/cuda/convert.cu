/*
 * dtype conversion, Walsh-Hadamard transform and per-channel scaling on the
 * GPU (semantics in kvdepot/convert.h).
 *
 * Launch shapes:
 *   convert, channel_scale  grid-stride, 256 threads, one element per thread
 *                           step; tensors of any strides (up to 4 dims) are
 *                           addressed through the row-major linear index,
 *                           so in-place calls (identical views) are safe.
 *   hadamard                one block per row (grid-stride over rows), the
 *                           row in shared memory as f32 (n * 4 bytes,
 *                           n <= 8192), log2(n) butterfly stages with a
 *                           barrier each, then the 1/sqrt(n) scale. Rows
 *                           longer than 8192 answer KVD_EUNSUPP.
 * The library is compiled with --fmad=false: a*b+c is never contracted, so
 * element-wise results match the CPU's separate multiply and add.
 */
#include "cuda_internal.h"

namespace {

constexpr int kThreads = 256;
constexpr int kMaxHadamard = 8192;

__global__ void convert_kernel(kvd_dview dst, kvd_dview src, long long n)
{
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        float v = kvd_ld_float(src.data + kvd_offset(src, i), src.dtype);
        kvd_st_float(dst.data + kvd_offset(dst, i), dst.dtype, v);
    }
}

__global__ void scale_kernel(kvd_dview dst, kvd_dview src, kvd_dview s, long long n, int divide)
{
    const long long last = src.shape[src.ndim - 1];
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        float v = kvd_ld_float(src.data + kvd_offset(src, i), src.dtype);
        float f = kvd_ld_float(s.data + (i % last) * s.stride[0], s.dtype);
        v = divide ? __fdiv_rn(v, f) : __fmul_rn(v, f);
        kvd_st_float(dst.data + kvd_offset(dst, i), dst.dtype, v);
    }
}

/*
 * Row r of a tensor whose last dim has length n: elements r*n .. r*n+n-1 in
 * linear order. Optional per-channel scaling (s, divide) before the
 * transform (the VQ key/query transforms), output either into a view or a
 * contiguous f32 buffer.
 */
__global__ void hadamard_kernel(kvd_dview dst, float *dst_f32, kvd_dview src, kvd_dview s,
                                int has_s, int divide, long long rows, int n, int logn)
{
    extern __shared__ float row[];
    const float norm = 1.0f / sqrtf((float)n); /* IEEE sqrt and divide, not rsqrtf */
    for (long long r = blockIdx.x; r < rows; r += gridDim.x) {
        for (int j = threadIdx.x; j < n; j += blockDim.x) {
            float v = kvd_ld_float(src.data + kvd_offset(src, r * n + j), src.dtype);
            if (has_s) {
                float f = kvd_ld_float(s.data + j * s.stride[0], s.dtype);
                v = divide ? __fdiv_rn(v, f) : __fmul_rn(v, f);
            }
            row[j] = v;
        }
        __syncthreads();
        for (int l = 0; l < logn; l++) {
            const int h = 1 << l;
            /* n/2 butterflies: pair (i, i + h) with i's bit l clear */
            for (int p = threadIdx.x; p < n / 2; p += blockDim.x) {
                int i = ((p >> l) << (l + 1)) | (p & (h - 1));
                float a = row[i], b = row[i + h];
                row[i] = a + b;
                row[i + h] = a - b;
            }
            __syncthreads();
        }
        for (int j = threadIdx.x; j < n; j += blockDim.x) {
            float v = row[j] * norm;
            if (dst_f32)
                dst_f32[r * n + j] = v;
            else
                kvd_st_float(dst.data + kvd_offset(dst, r * n + j), dst.dtype, v);
        }
        __syncthreads();
    }
}

int ilog2(int64_t n)
{
    int l = 0;
    while ((int64_t)1 << l < n)
        l++;
    return l;
}

int run_hadamard(kvd_cuda_call *call, const kvd_tensor *dst, float *dst_f32,
                 const kvd_tensor *src, const kvd_tensor *s, int divide, kvd_error *err)
{
    const int64_t n = src->shape[src->ndim - 1];
    const int64_t total = kvd_tensor_nelem(src);
    if (n == 0 || total == 0)
        return KVD_OK;
    if (n > kMaxHadamard)
        return kvd_error_set(err, KVD_EUNSUPP,
                             "cuda: hadamard rows longer than %d are not supported (got %lld)",
                             kMaxHadamard, (long long)n);
    const int64_t rows = total / n;
    kvd_dview dv = dst ? kvd__dview(dst) : kvd_dview{}, sv = kvd__dview(src);
    kvd_dview scale = s ? kvd__dview(s) : kvd_dview{};
    int threads = n >= 512 ? 256 : n >= 64 ? 64 : 32;
    unsigned grid = (unsigned)(rows < (1 << 20) ? rows : (1 << 20));
    hadamard_kernel<<<grid, threads, (size_t)n * sizeof(float), call->s>>>(
        dv, dst_f32, sv, scale, s != NULL, divide, rows, (int)n, ilog2(n));
    return kvd__cuda_launched(call, "hadamard", err);
}

int cuda_convert(kvd_backend *be, const kvd_tensor *dst, const kvd_tensor *src, kvd_error *err)
{
    kvd_cuda_call call;
    int rc = kvd__cuda_begin(be, &call, err);
    if (rc)
        return rc;
    long long n = kvd_tensor_nelem(src);
    if (n == 0)
        return KVD_OK;
    convert_kernel<<<kvd__cuda_blocks(n, kThreads), kThreads, 0, call.s>>>(kvd__dview(dst),
                                                                          kvd__dview(src), n);
    return kvd__cuda_launched(&call, "convert", err);
}

int cuda_hadamard(kvd_backend *be, const kvd_tensor *dst, const kvd_tensor *src, kvd_error *err)
{
    kvd_cuda_call call;
    int rc = kvd__cuda_begin(be, &call, err);
    if (rc)
        return rc;
    return run_hadamard(&call, dst, NULL, src, NULL, 0, err);
}

int cuda_channel_scale(kvd_backend *be, const kvd_tensor *dst, const kvd_tensor *src,
                       const kvd_tensor *s, int divide, kvd_error *err)
{
    kvd_cuda_call call;
    int rc = kvd__cuda_begin(be, &call, err);
    if (rc)
        return rc;
    long long n = kvd_tensor_nelem(src);
    if (n == 0)
        return KVD_OK;
    scale_kernel<<<kvd__cuda_blocks(n, kThreads), kThreads, 0, call.s>>>(
        kvd__dview(dst), kvd__dview(src), kvd__dview(s), n, divide);
    return kvd__cuda_launched(&call, "channel_scale", err);
}

/* One warp per row: 16-byte words when the row and both ends allow, else
 * bytes. */
__global__ void gather_kernel(char *dst, const unsigned long long *src, long long n,
                              unsigned long long row)
{
    const long long warps = (long long)gridDim.x * (blockDim.x / 32);
    const int lane = threadIdx.x & 31;
    for (long long i = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32; i < n; i += warps) {
        const char *s = (const char *)src[i];
        char *d = dst + i * row;
        if ((((unsigned long long)s | (unsigned long long)d | row) & 15) == 0) {
            const uint4 *s4 = (const uint4 *)s;
            uint4 *d4 = (uint4 *)d;
            for (unsigned long long j = lane; j < row / 16; j += 32)
                d4[j] = s4[j];
        } else {
            for (unsigned long long j = lane; j < row; j += 32)
                d[j] = s[j];
        }
    }
}

int cuda_gather_rows(kvd_backend *be, void *dst, const uint64_t *src, int64_t n, size_t row,
                     kvd_error *err)
{
    kvd_cuda_call call;
    int rc = kvd__cuda_begin(be, &call, err);
    if (rc)
        return rc;
    gather_kernel<<<kvd__cuda_blocks(n * 32, kThreads), kThreads, 0, call.s>>>(
        static_cast<char *>(dst), reinterpret_cast<const unsigned long long *>(src), n, row);
    return kvd__cuda_launched(&call, "gather_rows", err);
}

} /* namespace */

int kvd__cuda_scale_hadamard(kvd_cuda_call *call, const kvd_tensor *src, const kvd_tensor *s,
                             int divide, float *out, kvd_error *err)
{
    return run_hadamard(call, NULL, out, src, s, divide, err);
}

const struct kvd_convert_ops kvd__cuda_convert_ops = {
    cuda_convert,
    cuda_hadamard,
    cuda_channel_scale,
    cuda_gather_rows,
};
