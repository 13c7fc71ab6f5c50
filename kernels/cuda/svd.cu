/*
 * CUDA backend: the SVD projections (kvdepot/svd.h). R (D, D) f32 is
 * row-major in device memory.
 *   project    y (n, r) = x (n, D) R[:, :r]: one thread per output value,
 *              a product and a sum, each rounded, per input dimension in
 *              order from 0: the operations of the CPU backend's fast path
 *              (C11, no contraction into FMA), so a page coded here has the
 *              bytes the CPU codes.
 *   unproject  x (n, D) = y (n, r) R[:, :r]^T: one thread per output value,
 *              summed in double in order, as the CPU backend does.
 * Threads of a warp take adjacent output columns of one row: they read the
 * same x (or y) value and adjacent R values. These run at page coding and
 * per query (O(T D r) per head-page), far from the cost of attention; the
 * host-side parts of the SVD (the Gram matrix's eigendecomposition, kept
 * widths) stay on the CPU, once per calibration.
 */
#include "cuda_internal.h"

namespace
{

constexpr int kThreads = 256;

__global__ void project_kernel(const float *__restrict__ R, int D, int r, const char *x, int dtype,
                               long long stride, long long n, float *y)
{
    const size_t es = dtype == KVD_DTYPE_F32 ? 4 : 2;
    for (long long o = blockIdx.x * (long long)blockDim.x + threadIdx.x; o < n * r;
         o += (long long)gridDim.x * blockDim.x) {
        const long long t = o / r;
        const int j = (int)(o % r);
        const char *xr = x + t * stride;
        float acc = 0.0f;
        for (int i = 0; i < D; i++)
            acc = __fadd_rn(
                acc, __fmul_rn(kvd_ld_float(xr + (size_t)i * es, dtype), R[(size_t)i * D + j]));
        y[o] = acc;
    }
}

__global__ void unproject_kernel(const float *__restrict__ R, int D, int r, const float *y,
                                 long long n, float *x)
{
    for (long long o = blockIdx.x * (long long)blockDim.x + threadIdx.x; o < n * D;
         o += (long long)gridDim.x * blockDim.x) {
        const long long t = o / D;
        const int i = (int)(o % D);
        double acc = 0.0;
        for (int j = 0; j < r; j++)
            acc += (double)y[t * r + j] * R[(size_t)i * D + j];
        x[o] = (float)acc;
    }
}

int cuda_project(kvd_backend *be, const float *R, int D, int r, const void *x, kvd_dtype dtype,
                 int64_t n, int64_t x_stride, float *y, kvd_error *err)
{
    kvd_cuda_call call;
    int rc = kvd__cuda_begin(be, &call, err);
    if (rc || n == 0 || r == 0)
        return rc;
    project_kernel<<<kvd__cuda_blocks(n * r, kThreads), kThreads, 0, call.s>>>(
        R, D, r, (const char *)x, dtype, (long long)x_stride, (long long)n, y);
    return kvd__cuda_launched(&call, "svd project", err);
}

int cuda_unproject(kvd_backend *be, const float *R, int D, int r, const float *y, int64_t n,
                   float *x, kvd_error *err)
{
    kvd_cuda_call call;
    int rc = kvd__cuda_begin(be, &call, err);
    if (rc || n == 0)
        return rc;
    unproject_kernel<<<kvd__cuda_blocks(n * D, kThreads), kThreads, 0, call.s>>>(R, D, r, y,
                                                                                 (long long)n, x);
    return kvd__cuda_launched(&call, "svd unproject", err);
}

} /* namespace */

const struct kvd_svd_ops kvd__cuda_svd_ops = {cuda_project, cuda_unproject};
