/*
 * VQ codec on the GPU (VecInfer; layouts in kvdepot/vq.h).
 *
 *   smooth_factors    grid (D/128, min(T, 1024)): a block reads 128
 *                     adjacent channels of every gridDim.y-th row
 *                     (coalesced), maxima meet in atomicMax on the float
 *                     bits; lambda = sqrt(max finite |k|), 1 for an all-zero
 *                     channel.
 *   transform_keys /  one fused kernel per row: scale (divide by / multiply
 *   transform_queries by lambda) while loading into shared memory, Hadamard
 *                     butterflies there, one f32 store (convert.cu).
 *   train             the GPU K-means (kmeans.cu) on x viewed as
 *                     (T*D/d, d) points.
 *   encode            one thread per sub-vector, direct squared distance to
 *                     every codebook row in the CPU reference's operation
 *                     order (bitwise its codes; ties to the lower row). The
 *                     codebook sits in shared memory when it fits in 48 KiB
 *                     (every d at b <= 8, and d2/d4 at b <= 10); otherwise
 *                     rows are read through the cache (all lanes of a warp
 *                     read the same row: one broadcast transaction).
 *   decode            one thread per sub-vector; a code >= 2^b sets a device
 *                     flag read back after the launch (KVD_ECORRUPT), which
 *                     makes decode the one synchronous op of the family.
 */
#include "cuda_internal.h"

namespace {

constexpr int kThreads = 256;
constexpr size_t kSmemCodebook = 48 << 10;

/* Max finite |k| per channel: threads of a block = adjacent channels of one
 * row (coalesced), blocks along y stride over the rows; per-thread maxima
 * meet in an atomicMax on the float bits (non-negative floats order as
 * unsigned integers, and a max does not depend on the order: the CPU's
 * bits). */
__global__ void smooth_max_kernel(const char *k, int dtype, long long T, int D, unsigned *maxbits)
{
    const size_t es = dtype == KVD_DTYPE_F32 ? 4 : 2;
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= D)
        return;
    float m = 0.0f;
    for (long long t = blockIdx.y; t < T; t += gridDim.y) {
        float a = fabsf(kvd_ld_float(k + ((size_t)t * D + i) * es, dtype));
        if (isfinite(a) && a > m)
            m = a;
    }
    atomicMax(&maxbits[i], __float_as_uint(m));
}

__global__ void smooth_final_kernel(const unsigned *maxbits, int D, float *lambda)
{
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < D; i += gridDim.x * blockDim.x) {
        float m = __uint_as_float(maxbits[i]);
        lambda[i] = m > 0.0f ? sqrtf(m) : 1.0f;
    }
}

template <int DSUB, bool SMEM>
__global__ void encode_kernel(long long npts, int ksub, const float *__restrict__ x,
                              const float *__restrict__ cb, uint8_t *codes8, uint16_t *codes16)
{
    extern __shared__ float scb[];
    const float *book = cb;
    if (SMEM) {
        for (int i = threadIdx.x; i < ksub * DSUB; i += blockDim.x)
            scb[i] = cb[i];
        __syncthreads();
        book = scb;
    }
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < npts;
         i += (long long)gridDim.x * blockDim.x) {
        float v[DSUB];
#pragma unroll
        for (int t = 0; t < DSUB; t++)
            v[t] = x[i * DSUB + t];
        float best = INFINITY;
        int bi = 0;
        for (int c = 0; c < ksub; c++) {
            float acc = 0.0f;
#pragma unroll
            for (int t = 0; t < DSUB; t++) {
                float diff = __fsub_rn(v[t], book[c * DSUB + t]);
                acc = __fadd_rn(acc, __fmul_rn(diff, diff));
            }
            if (acc < best) {
                best = acc;
                bi = c;
            }
        }
        if (codes16)
            codes16[i] = (uint16_t)bi;
        else
            codes8[i] = (uint8_t)bi;
    }
}

template <int DSUB>
__global__ void decode_kernel(long long npts, int ksub, const uint8_t *codes8,
                              const uint16_t *codes16, const float *__restrict__ cb, float *out,
                              int *bad)
{
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < npts;
         i += (long long)gridDim.x * blockDim.x) {
        int c = codes16 ? codes16[i] : codes8[i];
        if (c >= ksub) {
            *bad = 1;
            continue;
        }
#pragma unroll
        for (int t = 0; t < DSUB; t++)
            out[i * DSUB + t] = cb[c * DSUB + t];
    }
}

int cuda_smooth_factors(kvd_backend *be, const kvd_tensor *k, kvd_tensor *lambda, kvd_error *err)
{
    kvd_cuda_call call;
    int rc = kvd__cuda_begin(be, &call, err);
    if (rc)
        return rc;
    const int D = (int)k->shape[1];
    const long long T = k->shape[0];
    unsigned *bits = NULL;
    if ((rc = kvd__cuda_scratch(&call, sizeof(unsigned) * (size_t)D, (void **)&bits, err)))
        return rc;
    rc = kvd__cuda_status(call.c, cudaMemsetAsync(bits, 0, sizeof(unsigned) * (size_t)D, call.s),
                          "cudaMemsetAsync", err);
    if (!rc) {
        const unsigned gy = (unsigned)(T < 1024 ? T : 1024);
        smooth_max_kernel<<<dim3((unsigned)((D + 127) / 128), gy), 128, 0, call.s>>>(
            (const char *)k->data, k->dtype, T, D, bits);
        smooth_final_kernel<<<kvd__cuda_blocks(D, 128), 128, 0, call.s>>>(bits, D,
                                                                          (float *)lambda->data);
        rc = kvd__cuda_launched(&call, "vq smooth", err);
    }
    kvd__cuda_scratch_free(&call, bits);
    return rc;
}

int transform(kvd_backend *be, const kvd_tensor *x, const kvd_tensor *lambda, kvd_tensor *out,
              int divide, kvd_error *err)
{
    kvd_cuda_call call;
    int rc = kvd__cuda_begin(be, &call, err);
    if (rc)
        return rc;
    return kvd__cuda_scale_hadamard(&call, x, lambda, divide, (float *)out->data, err);
}

int cuda_transform_keys(kvd_backend *be, const kvd_tensor *k, const kvd_tensor *lambda,
                        kvd_tensor *out, kvd_error *err)
{
    return transform(be, k, lambda, out, 1, err);
}

int cuda_transform_queries(kvd_backend *be, const kvd_tensor *q, const kvd_tensor *lambda,
                           kvd_tensor *out, kvd_error *err)
{
    return transform(be, q, lambda, out, 0, err);
}

int cuda_train(kvd_backend *be, const kvd_tensor *x, const kvd_kmeans_params *km,
               kvd_tensor *codebook, double *inertia, kvd_error *err)
{
    kvd_cuda_call call;
    int rc = kvd__cuda_begin(be, &call, err);
    if (rc)
        return rc;
    kvd_kmeans_params p = *km;
    const int d = (int)codebook->shape[1];
    p.k = (int)codebook->shape[0];
    const int64_t npts = x->shape[0] * (x->shape[1] / d);
    return kvd__cuda_kmeans_train_auto(&call, &p, npts, d, (const float *)x->data, d,
                                       (float *)codebook->data, inertia, err);
}

template <int DSUB>
void launch_encode(kvd_cuda_call *call, long long npts, int ksub, const float *x, const float *cb,
                   uint8_t *c8, uint16_t *c16)
{
    const size_t smem = (size_t)ksub * DSUB * sizeof(float);
    const unsigned grid = kvd__cuda_blocks(npts, kThreads);
    if (smem <= kSmemCodebook)
        encode_kernel<DSUB, true><<<grid, kThreads, smem, call->s>>>(npts, ksub, x, cb, c8, c16);
    else
        encode_kernel<DSUB, false><<<grid, kThreads, 0, call->s>>>(npts, ksub, x, cb, c8, c16);
}

int cuda_encode(kvd_backend *be, const kvd_tensor *x, const kvd_tensor *codebook,
                kvd_tensor *codes, kvd_error *err)
{
    kvd_cuda_call call;
    int rc = kvd__cuda_begin(be, &call, err);
    if (rc)
        return rc;
    const int d = (int)codebook->shape[1], ksub = (int)codebook->shape[0];
    const long long npts = x->shape[0] * (x->shape[1] / d);
    if (npts == 0)
        return KVD_OK;
    uint8_t *c8 = ksub > 256 ? NULL : (uint8_t *)codes->data;
    uint16_t *c16 = ksub > 256 ? (uint16_t *)codes->data : NULL;
    const float *xp = (const float *)x->data, *cb = (const float *)codebook->data;
    if (d == 2)
        launch_encode<2>(&call, npts, ksub, xp, cb, c8, c16);
    else if (d == 4)
        launch_encode<4>(&call, npts, ksub, xp, cb, c8, c16);
    else
        launch_encode<8>(&call, npts, ksub, xp, cb, c8, c16);
    return kvd__cuda_launched(&call, "vq encode", err);
}

int cuda_decode(kvd_backend *be, const kvd_tensor *codes, const kvd_tensor *codebook,
                kvd_tensor *out, kvd_error *err)
{
    kvd_cuda_call call;
    int rc = kvd__cuda_begin(be, &call, err);
    if (rc)
        return rc;
    const int d = (int)codebook->shape[1], ksub = (int)codebook->shape[0];
    const long long npts = out->shape[0] * (out->shape[1] / d);
    if (npts == 0)
        return KVD_OK;
    const uint8_t *c8 = ksub > 256 ? NULL : (const uint8_t *)codes->data;
    const uint16_t *c16 = ksub > 256 ? (const uint16_t *)codes->data : NULL;
    const float *cb = (const float *)codebook->data;
    float *o = (float *)out->data;
    int *bad = NULL;
    if ((rc = kvd__cuda_scratch(&call, sizeof(int), (void **)&bad, err)))
        return rc;
    int hbad = 0;
    rc = kvd__cuda_status(call.c, cudaMemsetAsync(bad, 0, sizeof(int), call.s), "cudaMemsetAsync",
                          err);
    if (!rc) {
        const unsigned grid = kvd__cuda_blocks(npts, kThreads);
        if (d == 2)
            decode_kernel<2><<<grid, kThreads, 0, call.s>>>(npts, ksub, c8, c16, cb, o, bad);
        else if (d == 4)
            decode_kernel<4><<<grid, kThreads, 0, call.s>>>(npts, ksub, c8, c16, cb, o, bad);
        else
            decode_kernel<8><<<grid, kThreads, 0, call.s>>>(npts, ksub, c8, c16, cb, o, bad);
        rc = kvd__cuda_launched(&call, "vq decode", err);
    }
    if (!rc)
        rc = kvd__cuda_status(call.c,
                              cudaMemcpyAsync(&hbad, bad, sizeof(int), cudaMemcpyDeviceToHost,
                                              call.s),
                              "cudaMemcpyAsync", err);
    kvd__cuda_scratch_free(&call, bad);
    if (!rc)
        rc = kvd__cuda_wait(&call, "vq decode", err);
    if (!rc && hbad)
        rc = kvd_error_set(err, KVD_ECORRUPT, "vq: decode: a code is >= 2^b = %d", ksub);
    return rc;
}

} /* namespace */

const struct kvd_vq_ops kvd__cuda_vq_ops = {
    cuda_smooth_factors, cuda_transform_keys, cuda_transform_queries,
    cuda_train,          cuda_encode,         cuda_decode,
};
