/*
 * K-means on the GPU (algorithm in kvdepot/kmeans.h).
 *
 * The driver runs on the host and follows the CPU driver step for step with
 * the same splitmix64 stream, so sub-sampling, k-means++ picks and repairs
 * draw the same numbers. The device does the distance work:
 *
 *   k-means++   after each pick, one kernel lowers every point's distance
 *               to its nearest centroid with the new one (direct sum of
 *               squared differences, the CPU's operation order, so the D^2
 *               weights and therefore the picks are the CPU's); the host
 *               reads the (n) f32 distances back to draw the next pick.
 *   Lloyd       distances through cuBLAS: dots = X C^T as one SGEMM per
 *               chunk of points (column-major: C^T (k x d) times X^T (d x n)
 *               gives a (k, n) block, i.e. row i = point i's k dots), then
 *               dist = |x|^2 - 2 x.c + |c|^2 and an argmin kernel (ties to
 *               the lower index). This rounds differently from the direct
 *               form, so near-ties may be assigned differently from the CPU:
 *               the comparison tests compare inertia, not centroids.
 *               Assignments come back to the host, which updates the
 *               centroids in double in point order (as the CPU does),
 *               repairs empty clusters and uploads them again.
 *   inertia     direct-form assignment against the returned centroids.
 *
 * Launch shapes: point kernels one thread per point, 256 threads, grid-
 * stride; SGEMM chunks of at most kChunkFloats outputs (64 MiB).
 */
#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_internal.h"

namespace {

constexpr int kThreads = 256;
constexpr int64_t kChunkFloats = 16 << 20;

struct rng {
    uint64_t s;
};

uint64_t rng_next(rng *r)
{
    uint64_t z = (r->s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

double rng_uniform(rng *r) { return (double)(rng_next(r) >> 11) * 0x1.0p-53; }

__device__ __forceinline__ float dist2(int d, const float *x, const float *c)
{
    float acc = 0.0f;
    for (int t = 0; t < d; t++) {
        float diff = __fsub_rn(x[t], c[t]);
        acc = __fadd_rn(acc, __fmul_rn(diff, diff));
    }
    return acc;
}

/* best/bidx lowered with centroids c0..c0+nc-1 that are strictly closer. */
__global__ void argmin_update_kernel(long long n, int d, const float *x, long long ldx, int c0,
                                     int nc, const float *cent, float *best, uint32_t *bidx)
{
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        const float *xi = x + i * ldx;
        float b = best[i];
        uint32_t bi = bidx[i];
        for (int c = c0; c < c0 + nc; c++) {
            float dd = dist2(d, xi, cent + (long long)c * d);
            if (dd < b) {
                b = dd;
                bi = (uint32_t)c;
            }
        }
        best[i] = b;
        bidx[i] = bi;
    }
}

__global__ void init_best_kernel(long long n, float *best, uint32_t *bidx)
{
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        best[i] = INFINITY;
        bidx[i] = 0;
    }
}

__global__ void norms_kernel(long long n, int d, const float *x, long long ldx, float *out)
{
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        const float *xi = x + i * ldx;
        float s = 0.0f;
        for (int t = 0; t < d; t++)
            s += xi[t] * xi[t];
        out[i] = s;
    }
}

/* dots: (n, k) row-major block for points i0.. of the chunk. */
__global__ void gemm_argmin_kernel(long long n, int k, const float *dots, const float *xn,
                                   const float *cn, uint32_t *asg)
{
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        const float *row = dots + i * k;
        float best = INFINITY;
        uint32_t bi = 0;
        for (int c = 0; c < k; c++) {
            float dd = xn[i] - 2.0f * row[c] + cn[c];
            if (dd < best) {
                best = dd;
                bi = (uint32_t)c;
            }
        }
        asg[i] = bi;
    }
}

/* Empty-cluster repair, identical to the CPU driver's. */
void repair_empty(int k, int d, float *centroids, int64_t *count, rng *r)
{
    for (int j = 0; j < k; j++) {
        if (count[j] > 0)
            continue;
        int big = 0;
        for (int c = 1; c < k; c++)
            if (count[c] > count[big])
                big = c;
        float *cb = centroids + (int64_t)big * d;
        float *cj = centroids + (int64_t)j * d;
        double ss = 0.0;
        for (int t = 0; t < d; t++)
            ss += (double)cb[t] * cb[t];
        float rms = (float)sqrt(ss / (d > 0 ? d : 1));
        for (int t = 0; t < d; t++) {
            float eps = (1.0f / 1024.0f) * (fabsf(cb[t]) + rms + FLT_MIN);
            if (rng_next(r) & 1)
                eps = -eps;
            cj[t] = cb[t] + eps;
        }
        count[j] = count[big] / 2;
        count[big] -= count[j];
    }
}

/* Scratch of one training run, released in one place. */
struct km_buffers {
    float *hx = nullptr;     /* host copy of the clustered points (ns, d) */
    float *hmind = nullptr;  /* (ns) */
    uint32_t *hasg = nullptr, *hprev = nullptr;
    int64_t *count = nullptr;
    double *sums = nullptr;
    float *hcent = nullptr;  /* (k, d) host centroids */
    float *dx = nullptr;     /* device points, packed (ns, d) (or the caller's) */
    float *dmind = nullptr, *dxn = nullptr, *dcn = nullptr, *ddots = nullptr;
    uint32_t *dasg = nullptr;
    int owns_dx = 0;
};

void free_buffers(kvd_cuda_call *call, km_buffers *b)
{
    free(b->hx);
    free(b->hmind);
    free(b->hasg);
    free(b->hprev);
    free(b->count);
    free(b->sums);
    free(b->hcent);
    if (b->owns_dx)
        kvd__cuda_scratch_free(call, b->dx);
    kvd__cuda_scratch_free(call, b->dmind);
    kvd__cuda_scratch_free(call, b->dxn);
    kvd__cuda_scratch_free(call, b->dcn);
    kvd__cuda_scratch_free(call, b->ddots);
    kvd__cuda_scratch_free(call, b->dasg);
}

#define TRY(expr)                                                                                \
    do {                                                                                         \
        if ((rc = (expr)) != KVD_OK)                                                             \
            goto out;                                                                            \
    } while (0)

int copy(kvd_cuda_call *call, void *dst, const void *src, size_t bytes, cudaMemcpyKind kind,
         kvd_error *err)
{
    return kvd__cuda_status(call->c, cudaMemcpyAsync(dst, src, bytes, kind, call->s),
                            "cudaMemcpyAsync", err);
}

} /* namespace */

int kvd__cuda_kmeans_assign(kvd_cuda_call *call, int64_t n, int d, const float *x, int64_t ldx,
                            int k, const float *centroids, uint32_t *assign, float *dist2,
                            kvd_error *err)
{
    if (n == 0)
        return KVD_OK;
    float *best = dist2;
    int rc = KVD_OK;
    if (!best && (rc = kvd__cuda_scratch(call, sizeof(float) * (size_t)n, (void **)&best, err)))
        return rc;
    const unsigned grid = kvd__cuda_blocks(n, kThreads);
    init_best_kernel<<<grid, kThreads, 0, call->s>>>(n, best, assign);
    argmin_update_kernel<<<grid, kThreads, 0, call->s>>>(n, d, x, ldx, 0, k, centroids, best,
                                                         assign);
    rc = kvd__cuda_launched(call, "kmeans assign", err);
    if (!dist2)
        kvd__cuda_scratch_free(call, best);
    return rc;
}

int kvd__cuda_kmeans_train(kvd_cuda_call *call, const kvd_kmeans_params *p, int64_t n, int d,
                           const float *x, int64_t ldx, float *centroids, double *inertia,
                           kvd_error *err)
{
    const int k = p->k;
    rng r = {p->seed};
    km_buffers b;
    int rc = KVD_OK;
    int64_t ns = n;
    const unsigned threads = kThreads;
    unsigned grid;
    int chosen = 1;
    int64_t chunk;
    cublasHandle_t blas = nullptr;
    int locked = 0;

    /* 1. the points, on the host (for the centroid update) and packed on
     *    the device; a seeded subset when max_points asks for one. */
    if (p->max_points > 0 && n > p->max_points)
        ns = p->max_points;
    b.hx = (float *)malloc(sizeof(float) * (size_t)ns * (size_t)d);
    b.hmind = (float *)malloc(sizeof(float) * (size_t)ns);
    b.hasg = (uint32_t *)malloc(sizeof(uint32_t) * (size_t)ns);
    b.hprev = (uint32_t *)malloc(sizeof(uint32_t) * (size_t)ns);
    b.count = (int64_t *)calloc((size_t)k, sizeof(int64_t));
    b.sums = (double *)malloc(sizeof(double) * (size_t)k * (size_t)d);
    b.hcent = (float *)malloc(sizeof(float) * (size_t)k * (size_t)d);
    if (!b.hx || !b.hmind || !b.hasg || !b.hprev || !b.count || !b.sums || !b.hcent) {
        rc = kvd_error_set(err, KVD_ENOMEM, "cuda: kmeans: out of host memory");
        goto out;
    }
    if (ns < n) {
        float *all = (float *)malloc(sizeof(float) * (size_t)n * (size_t)d);
        int64_t *perm = (int64_t *)malloc(sizeof(int64_t) * (size_t)n);
        if (!all || !perm) {
            free(all);
            free(perm);
            rc = kvd_error_set(err, KVD_ENOMEM, "cuda: kmeans: out of host memory");
            goto out;
        }
        rc = kvd__cuda_status(call->c,
                              cudaMemcpy2DAsync(all, sizeof(float) * d, x, sizeof(float) * ldx,
                                                sizeof(float) * d, n, cudaMemcpyDeviceToHost,
                                                call->s),
                              "cudaMemcpy2DAsync", err);
        if (!rc)
            rc = kvd__cuda_wait(call, "kmeans points", err);
        if (!rc) {
            for (int64_t i = 0; i < n; i++)
                perm[i] = i;
            for (int64_t i = 0; i < ns; i++) { /* partial Fisher-Yates, as the CPU */
                int64_t j = i + (int64_t)(rng_next(&r) % (uint64_t)(n - i));
                int64_t tmp = perm[i];
                perm[i] = perm[j];
                perm[j] = tmp;
                memcpy(b.hx + i * d, all + perm[i] * d, sizeof(float) * (size_t)d);
            }
        }
        free(all);
        free(perm);
        if (rc)
            goto out;
        TRY(kvd__cuda_scratch(call, sizeof(float) * (size_t)ns * d, (void **)&b.dx, err));
        b.owns_dx = 1;
        TRY(copy(call, b.dx, b.hx, sizeof(float) * (size_t)ns * d, cudaMemcpyHostToDevice, err));
    } else {
        TRY(kvd__cuda_status(call->c,
                             cudaMemcpy2DAsync(b.hx, sizeof(float) * d, x, sizeof(float) * ldx,
                                               sizeof(float) * d, n, cudaMemcpyDeviceToHost,
                                               call->s),
                             "cudaMemcpy2DAsync", err));
        TRY(kvd__cuda_wait(call, "kmeans points", err));
        if (ldx == d) {
            b.dx = const_cast<float *>(x);
        } else {
            TRY(kvd__cuda_scratch(call, sizeof(float) * (size_t)ns * d, (void **)&b.dx, err));
            b.owns_dx = 1;
            TRY(kvd__cuda_status(call->c,
                                 cudaMemcpy2DAsync(b.dx, sizeof(float) * d, x, sizeof(float) * ldx,
                                                   sizeof(float) * d, n, cudaMemcpyDeviceToDevice,
                                                   call->s),
                                 "cudaMemcpy2DAsync", err));
        }
    }
    TRY(kvd__cuda_scratch(call, sizeof(float) * (size_t)ns, (void **)&b.dmind, err));
    TRY(kvd__cuda_scratch(call, sizeof(uint32_t) * (size_t)ns, (void **)&b.dasg, err));
    grid = kvd__cuda_blocks(ns, threads);

    /* 2. k-means++ seeding: the new centroid's distances on the device. */
    {
        int64_t first = (int64_t)(rng_next(&r) % (uint64_t)ns);
        TRY(copy(call, centroids, b.dx + first * d, sizeof(float) * d, cudaMemcpyDeviceToDevice,
                 err));
        memcpy(b.hcent, b.hx + first * d, sizeof(float) * d);
        init_best_kernel<<<grid, threads, 0, call->s>>>(ns, b.dmind, b.dasg);
        argmin_update_kernel<<<grid, threads, 0, call->s>>>(ns, d, b.dx, d, 0, 1, centroids,
                                                            b.dmind, b.dasg);
        TRY(kvd__cuda_launched(call, "kmeans++", err));
        while (chosen < k) {
            TRY(copy(call, b.hmind, b.dmind, sizeof(float) * ns, cudaMemcpyDeviceToHost, err));
            TRY(kvd__cuda_wait(call, "kmeans++", err));
            double total = 0.0;
            for (int64_t i = 0; i < ns; i++)
                total += isfinite(b.hmind[i]) ? (double)b.hmind[i] : 0.0;
            if (!(total > 0.0))
                break;
            double u = rng_uniform(&r) * total, acc = 0.0;
            int64_t pick = -1;
            for (int64_t i = 0; i < ns; i++) {
                if (!(isfinite(b.hmind[i]) && b.hmind[i] > 0.0f))
                    continue;
                pick = i;
                acc += (double)b.hmind[i];
                if (acc > u)
                    break;
            }
            memcpy(b.hcent + (int64_t)chosen * d, b.hx + pick * d, sizeof(float) * d);
            TRY(copy(call, centroids + (int64_t)chosen * d, b.dx + pick * d, sizeof(float) * d,
                     cudaMemcpyDeviceToDevice, err));
            argmin_update_kernel<<<grid, threads, 0, call->s>>>(ns, d, b.dx, d, chosen, 1,
                                                                centroids, b.dmind, b.dasg);
            TRY(kvd__cuda_launched(call, "kmeans++", err));
            chosen++;
        }
        if (chosen < k) {
            for (int c = 0; c < k; c++)
                b.count[c] = c < chosen ? 1 : 0;
            repair_empty(k, d, b.hcent, b.count, &r);
            TRY(copy(call, centroids, b.hcent, sizeof(float) * (size_t)k * d,
                     cudaMemcpyHostToDevice, err));
        }
    }

    /* 3. Lloyd iterations, distances through SGEMM. */
    chunk = kChunkFloats / k;
    if (chunk < 1)
        chunk = 1;
    if (chunk > ns)
        chunk = ns;
    if (p->niter > 0) {
        TRY(kvd__cuda_scratch(call, sizeof(float) * (size_t)ns, (void **)&b.dxn, err));
        TRY(kvd__cuda_scratch(call, sizeof(float) * (size_t)k, (void **)&b.dcn, err));
        TRY(kvd__cuda_scratch(call, sizeof(float) * (size_t)chunk * k, (void **)&b.ddots, err));
        norms_kernel<<<grid, threads, 0, call->s>>>(ns, d, b.dx, d, b.dxn);
        TRY(kvd__cuda_launched(call, "kmeans norms", err));
        pthread_mutex_lock(&call->slot->mu);
        locked = 1;
        TRY(kvd__cuda_blas(call, &blas, err));
    }
    for (int it = 0; it < p->niter; it++) {
        norms_kernel<<<kvd__cuda_blocks(k, threads), threads, 0, call->s>>>(k, d, centroids, d,
                                                                            b.dcn);
        TRY(kvd__cuda_launched(call, "kmeans norms", err));
        for (int64_t i0 = 0; i0 < ns; i0 += chunk) {
            const int64_t nc = ns - i0 < chunk ? ns - i0 : chunk;
            const float one = 1.0f, zero = 0.0f;
            /* column-major: dots(k, nc) = C^T(k, d) . Xchunk^T(d, nc) */
            TRY(kvd__cublas_status(call->c,
                                   kvd__blas.Sgemm(blas, CUBLAS_OP_T, CUBLAS_OP_N, k, (int)nc, d, &one,
                                               centroids, d, b.dx + i0 * d, d, &zero, b.ddots, k),
                                   "cublasSgemm", err));
            gemm_argmin_kernel<<<kvd__cuda_blocks(nc, threads), threads, 0, call->s>>>(
                nc, k, b.ddots, b.dxn + i0, b.dcn, b.dasg + i0);
            TRY(kvd__cuda_launched(call, "kmeans argmin", err));
        }
        TRY(copy(call, b.hasg, b.dasg, sizeof(uint32_t) * ns, cudaMemcpyDeviceToHost, err));
        TRY(kvd__cuda_wait(call, "kmeans assign", err));
        if (it > 0 && memcmp(b.hasg, b.hprev, sizeof(uint32_t) * (size_t)ns) == 0)
            break;
        memcpy(b.hprev, b.hasg, sizeof(uint32_t) * (size_t)ns);
        memset(b.count, 0, sizeof(int64_t) * (size_t)k);
        memset(b.sums, 0, sizeof(double) * (size_t)k * d);
        for (int64_t i = 0; i < ns; i++) { /* fixed order, as the CPU */
            const float *xi = b.hx + i * d;
            double *s = b.sums + (int64_t)b.hasg[i] * d;
            for (int t = 0; t < d; t++)
                s[t] += xi[t];
            b.count[b.hasg[i]]++;
        }
        for (int c = 0; c < k; c++) {
            if (b.count[c] == 0)
                continue;
            for (int t = 0; t < d; t++)
                b.hcent[(int64_t)c * d + t] =
                    (float)(b.sums[(int64_t)c * d + t] / (double)b.count[c]);
        }
        repair_empty(k, d, b.hcent, b.count, &r);
        TRY(copy(call, centroids, b.hcent, sizeof(float) * (size_t)k * d, cudaMemcpyHostToDevice,
                 err));
    }
    if (locked) {
        pthread_mutex_unlock(&call->slot->mu);
        locked = 0;
    }

    /* 4. inertia against the returned centroids (direct form). */
    if (inertia) {
        TRY(kvd__cuda_kmeans_assign(call, ns, d, b.dx, d, k, centroids, b.dasg, b.dmind, err));
        TRY(copy(call, b.hmind, b.dmind, sizeof(float) * ns, cudaMemcpyDeviceToHost, err));
        TRY(kvd__cuda_wait(call, "kmeans inertia", err));
        double in = 0.0;
        for (int64_t i = 0; i < ns; i++)
            in += (double)b.hmind[i];
        *inertia = in;
    }
    /* host buffers are freed below: make sure no copy still reads them */
    rc = kvd__cuda_wait(call, "kmeans", err);
out:
    if (locked)
        pthread_mutex_unlock(&call->slot->mu);
    if (rc)
        cudaStreamSynchronize(call->s); /* queued copies may still touch host buffers */
    free_buffers(call, &b);
    return rc;
}

namespace {

int cuda_train(kvd_backend *be, const kvd_kmeans_params *p, const kvd_tensor *x,
               kvd_tensor *centroids, double *inertia, kvd_error *err)
{
    kvd_cuda_call call;
    int rc = kvd__cuda_begin(be, &call, err);
    if (rc)
        return rc;
    return kvd__cuda_kmeans_train_auto(&call, p, x->shape[0], (int)x->shape[1],
                                       (const float *)x->data, x->stride[0] / 4,
                                       (float *)centroids->data, inertia, err);
}

int cuda_assign(kvd_backend *be, const kvd_tensor *x, const kvd_tensor *centroids,
                kvd_tensor *assign, kvd_tensor *dist2, kvd_error *err)
{
    kvd_cuda_call call;
    int rc = kvd__cuda_begin(be, &call, err);
    if (rc)
        return rc;
    return kvd__cuda_kmeans_assign(&call, x->shape[0], (int)x->shape[1], (const float *)x->data,
                                   x->stride[0] / 4, (int)centroids->shape[0],
                                   (const float *)centroids->data, (uint32_t *)assign->data,
                                   dist2 ? (float *)dist2->data : NULL, err);
}

} /* namespace */

const struct kvd_kmeans_ops kvd__cuda_kmeans_ops = {
    cuda_train,
    cuda_assign,
};

/* ======================================================================
 * Device-resident K-means over many sub-spaces at once (PQ training).
 *
 * The exact driver above mirrors the CPU step for step but is host-bound:
 * one round trip per k-means++ pick and per Lloyd iteration, sub-space after
 * sub-space. PQ training of one (layer, kv head) needs m trainings on the
 * same keys, so this driver runs all m sub-spaces together and keeps the
 * work on the device:
 *
 *   points    copied once per sub-space, (m, n, dsub): a warp's 32 points
 *             of one sub-space are one contiguous span (in the (n, D) rows
 *             each thread's dsub floats sat 4*D bytes from its neighbour's,
 *             so every warp load touched 32 cache lines).
 *   seeding   per pick, one launch for all sub-spaces (seed_step_kernel):
 *             blocks of 256 threads fold the last centroid into their chunk
 *             of points' D^2 weights and write the chunk's sum; the last
 *             block of a sub-space to finish (a counter and fences) draws
 *             the next centroid with a device splitmix64 draw: a chunk by
 *             the chunk sums (double), then a point of it by its weights,
 *             each a block scan. No host round trip.
 *   Lloyd     for dsub in {2, 4, 8, 16, 32} and k <= 256, one fused kernel
 *             per iteration (multi_lloyd_kernel): a block holds one
 *             sub-space's centroids in shared memory, a thread takes a point
 *             at a time, computes its k direct-form distances (x - c)^2, keeps
 *             the argmin (ties to the lower index) and adds the point to its
 *             centroid's sums and count in shared memory; each block then
 *             adds its non-empty centroids' sums to the global ones. Other
 *             shapes: one strided-batched SGEMM per chunk of points (batch =
 *             m) and an argmin kernel. Either way the new centroid sums are
 *             64-bit fixed point (integer adds: the sums do not depend on the
 *             order, so the result is deterministic), then a finalize
 *             kernel; only the m*k counts and m change flags come back per
 *             iteration (the empty-cluster repair runs on the host).
 *
 * The random draws are not the CPU driver's (device generator, one shared
 * subset when sub-sampling), so the centroids differ from the CPU's; the
 * comparison tests bound the quantization error instead.
 * Fixed point: each sub-space's values are scaled by 2^30 / max|x|, so a
 * sum of up to 2^31 points stays below 2^61. Non-finite values count as 0.
 * ====================================================================== */

namespace {

__device__ __forceinline__ uint64_t dev_rng_next(uint64_t *s)
{
    uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* Per sub-space state of the seeding. */
struct seed_state {
    uint64_t rng;
    int stopped; /* 0, or the number of centroids chosen when the D^2 weights ran out */
    float maxabs_bits_pad;
};

__global__ void multi_init_kernel(int m, long long n, int k, int dsub, const float *xs, int D,
                                  float *cent, seed_state *st, uint64_t seed)
{
    const int j = blockIdx.x;
    __shared__ long long first;
    if (threadIdx.x == 0) {
        st[j].rng = seed + (uint64_t)j;
        st[j].stopped = 0;
        first = (long long)(dev_rng_next(&st[j].rng) % (uint64_t)n);
    }
    __syncthreads();
    for (int t = threadIdx.x; t < dsub; t += blockDim.x)
        cent[(long long)j * k * dsub + t] = xs[first * D + (long long)j * dsub + t];
}

/* xt[j][i][t] = xs[i][j * dsub + t]: each sub-space's points end to end. */
__global__ void multi_split_kernel(long long n, int dsub, const float *xs, int D, float *xt)
{
    for (long long e = blockIdx.x * (long long)blockDim.x + threadIdx.x; e < n * D;
         e += (long long)gridDim.x * blockDim.x) {
        const long long i = e / D;
        const int c = (int)(e - i * D), j = c / dsub;
        xt[((long long)j * n + i) * dsub + (c - j * dsub)] = xs[e];
    }
}

/* dist2 with 16-byte loads (d % 4 == 0, 16-byte aligned rows): the same sum,
 * in the same order. */
__device__ __forceinline__ float dist2_v4(int d, const float *x, const float *c)
{
    float acc = 0.0f;
    for (int t = 0; t < d; t += 4) {
        const float4 a = *reinterpret_cast<const float4 *>(x + t);
        const float4 b = *reinterpret_cast<const float4 *>(c + t);
        float df = __fsub_rn(a.x, b.x);
        acc = __fadd_rn(acc, __fmul_rn(df, df));
        df = __fsub_rn(a.y, b.y);
        acc = __fadd_rn(acc, __fmul_rn(df, df));
        df = __fsub_rn(a.z, b.z);
        acc = __fadd_rn(acc, __fmul_rn(df, df));
        df = __fsub_rn(a.w, b.w);
        acc = __fadd_rn(acc, __fmul_rn(df, df));
    }
    return acc;
}

__device__ __forceinline__ bool seed_weight(double v) { return isfinite(v) && v > 0.0; }

/* Inclusive prefix sum over the 32 lanes. */
__device__ __forceinline__ double warp_scan(double v, int lane)
{
    for (int o = 1; o < 32; o <<= 1) {
        double y = __shfl_up_sync(0xffffffffu, v, o);
        if (lane >= o)
            v += y;
    }
    return v;
}

__device__ __forceinline__ long long warp_max(long long v)
{
    for (int o = 16; o > 0; o >>= 1) {
        const long long y = __shfl_xor_sync(0xffffffffu, v, o);
        v = y > v ? y : v;
    }
    return v;
}

constexpr int kSeedWarps = kThreads / 32;

struct draw_smem {
    double wsum[kSeedWarps], wend[kSeedWarps];
    long long wlast[kSeedWarps];
    double rr, total, before;
    long long res, last_all;
    int owner;
};

/* A D^2 draw among the weights w[0, L) (a weight counts when finite and > 0),
 * by the whole block (kThreads threads): thread t owns the entries
 * [t * seg, (t + 1) * seg), laid end to end in that order. The target is
 * u * total when u >= 0, else rr. Leaves in sh: total; res, the first entry
 * whose running sum exceeds the target (rounding past its owner's last
 * weighted entry: that entry; no owner: the last weighted entry of all; -1
 * when nothing has weight); before, the running sum ahead of res; rr. */
template <class T>
__device__ void block_draw(const volatile T *w, long long L, double u, double rr, draw_smem *sh)
{
    const int t = threadIdx.x, lane = t & 31, wp = t >> 5;
    const long long seg = (L + kThreads - 1) / kThreads, b0 = t * seg;
    const long long b1 = b0 + seg < L ? b0 + seg : L;
    double own = 0.0;
    long long own_last = -1;
    for (long long i = b0; i < b1; i++) {
        const double v = (double)w[i];
        if (seed_weight(v)) {
            own += v;
            own_last = i;
        }
    }
    /* block scan: excl = thread t-1's incl bit for bit, so the intervals
       [excl, incl) chain from 0 to the total: every target below the total
       lies in one of them (rounding may leave some empty, never a gap) */
    double incl = warp_scan(own, lane);
    own_last = warp_max(own_last);
    if (lane == 31)
        sh->wsum[wp] = incl;
    if (lane == 0)
        sh->wlast[wp] = own_last;
    __syncthreads();
    if (wp == 0) {
        const double v = warp_scan(lane < kSeedWarps ? sh->wsum[lane] : 0.0, lane);
        const long long y = warp_max(lane < kSeedWarps ? sh->wlast[lane] : -1);
        if (lane < kSeedWarps)
            sh->wsum[lane] = v;
        if (lane == 0) {
            sh->last_all = y;
            sh->owner = kThreads;
        }
    }
    __syncthreads();
    if (wp > 0)
        incl += sh->wsum[wp - 1];
    if (lane == 31)
        sh->wend[wp] = incl;
    __syncthreads();
    double excl = __shfl_up_sync(0xffffffffu, incl, 1);
    if (lane == 0)
        excl = wp > 0 ? sh->wend[wp - 1] : 0.0;
    const double total = sh->wend[kSeedWarps - 1];
    if (u >= 0.0) {
        rr = u * total;
        if (!(rr < total))
            rr = total * (1.0 - 0x1.0p-50);
    }
    if (rr >= excl && rr < incl)
        atomicMin(&sh->owner, t); /* the first, should intervals overlap */
    __syncthreads();
    if (t == sh->owner) { /* walk the segment */
        double acc = excl, bef = excl;
        long long res = -1, last = -1;
        for (long long i = b0; i < b1 && res < 0; i++) {
            const double v = (double)w[i];
            if (!seed_weight(v))
                continue;
            if (acc + v > rr)
                res = i;
            else
                last = i;
            bef = acc;
            acc += v;
        }
        sh->res = res >= 0 ? res : last;
        sh->before = bef;
    }
    __syncthreads();
    if (t == 0) {
        sh->total = total;
        sh->rr = rr;
        if (sh->owner == kThreads || sh->res < 0) { /* cannot happen while total > 0 */
            sh->res = sh->last_all;
            sh->before = rr;
        }
    }
    __syncthreads();
}

/* One k-means++ step for every sub-space (grid (chunks, m), kThreads threads):
 * every block folds centroid `fold` into its chunk's D^2 weights mind[j]
 * (fold 0 starts them) and writes the chunk's weight sum; the last block of
 * a sub-space to finish (a counter) then draws centroid `fold + 1`: a chunk
 * by the chunk sums, a point of that chunk by its weights. One launch per
 * pick; no host round trip. Chunk b holds points [b * ch, (b + 1) * ch),
 * thread t the points b * ch + q * kThreads + t. */
__global__ void __launch_bounds__(kThreads)
    seed_step_kernel(long long n, int k, int dsub, const float *xt, float *cent, seed_state *st,
                     int fold, long long ch, int v4, float *mind, double *part,
                     unsigned *arrived)
{
    __shared__ double red[kSeedWarps];
    __shared__ int s_last;
    __shared__ draw_smem sh;
    const int j = blockIdx.y, t = threadIdx.x, lane = t & 31, wp = t >> 5;
    if (st[j].stopped)
        return;
    const long long nb = gridDim.x, c0 = blockIdx.x * ch;
    const float *cc = cent + ((long long)j * k + fold) * dsub;
    const float *xj = xt + (long long)j * n * dsub;
    float *md = mind + (long long)j * n;
    double sum = 0.0;
    for (long long i = c0 + t; i < c0 + ch && i < n; i += kThreads) {
        const float dd =
            v4 ? dist2_v4(dsub, xj + i * dsub, cc) : dist2(dsub, xj + i * dsub, cc);
        const float cur = fold == 0 || dd < md[i] ? dd : md[i];
        md[i] = cur;
        if (seed_weight(cur))
            sum += (double)cur;
    }
    for (int o = 16; o > 0; o >>= 1)
        sum += __shfl_xor_sync(0xffffffffu, sum, o);
    if (lane == 0)
        red[wp] = sum;
    __threadfence(); /* this thread's weights, before the block reports */
    __syncthreads();
    if (t == 0) {
        double b = 0.0;
        for (int q = 0; q < kSeedWarps; q++)
            b += red[q];
        part[(long long)j * nb + blockIdx.x] = b;
        __threadfence();
        s_last = atomicAdd(&arrived[j], 1u) == (unsigned)nb - 1;
    }
    __syncthreads();
    if (!s_last)
        return;
    /* the last block of sub-space j: every chunk's weights and sum are in */
    __threadfence();
    const int chosen = fold + 1;
    if (t == 0) {
        arrived[j] = 0; /* for the next launch */
        sh.rr = (double)(dev_rng_next(&st[j].rng) >> 11) * 0x1.0p-53;
    }
    __syncthreads();
    const double u = sh.rr;
    __syncthreads();
    block_draw<double>(part + (long long)j * nb, nb, u, 0.0, &sh);
    if (!(sh.total > 0.0)) { /* every point sits on a centroid: stop, repair later */
        if (t == 0)
            st[j].stopped = chosen;
        return;
    }
    const long long b = sh.res, lo = b * ch;
    const double r2 = sh.rr - sh.before;
    __syncthreads();
    block_draw<float>(md + lo, (lo + ch < n ? lo + ch : n) - lo, -1.0, r2 > 0.0 ? r2 : 0.0, &sh);
    const long long pick = lo + (sh.res >= 0 ? sh.res : 0);
    for (int d = t; d < dsub; d += blockDim.x)
        cent[((long long)j * k + chosen) * dsub + d] = xj[pick * dsub + d];
}

__global__ void multi_maxabs_kernel(long long n, int dsub, const float *xs, int D,
                                    unsigned *maxbits)
{
    const int j = blockIdx.y;
    unsigned best = 0;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x)
        for (int t = 0; t < dsub; t++) {
            float a = fabsf(xs[i * D + (long long)j * dsub + t]);
            if (isfinite(a) && __float_as_uint(a) > best)
                best = __float_as_uint(a); /* non-negative floats order as integers */
        }
    atomicMax(&maxbits[j], best);
}

__global__ void multi_norms_kernel(long long n, int dsub, const float *x, long long ldx,
                                   long long jstride, float *out)
{
    const int j = blockIdx.y;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        const float *xi = x + i * ldx + (long long)j * jstride;
        float s = 0.0f;
        for (int t = 0; t < dsub; t++)
            s += xi[t] * xi[t];
        out[(long long)j * n + i] = s;
    }
}

/* dots (m, nc, k): argmin, change count, fixed-point sums and counts. */
__global__ void multi_assign_kernel(long long n, long long i0, long long nc, int k, int dsub,
                                    const float *dots, long long dstride, const float *xn,
                                    const float *cn, const float *xs, int D,
                                    const unsigned *maxbits, uint32_t *asg,
                                    unsigned long long *sums, unsigned *counts, unsigned *changed,
                                    int first_iter)
{
    const int j = blockIdx.y;
    const float mx = __uint_as_float(maxbits[j]);
    const float scale = mx > 0.0f ? 1073741824.0f / mx : 1.0f;
    for (long long r = blockIdx.x * (long long)blockDim.x + threadIdx.x; r < nc;
         r += (long long)gridDim.x * blockDim.x) {
        const long long i = i0 + r;
        const float *row = dots + (long long)j * dstride + r * k;
        const float xni = xn[(long long)j * n + i];
        const float *cnj = cn + (long long)j * k;
        float best = INFINITY;
        uint32_t bi = 0;
        for (int c = 0; c < k; c++) {
            float dd = xni - 2.0f * row[c] + cnj[c];
            if (dd < best) {
                best = dd;
                bi = (uint32_t)c;
            }
        }
        uint32_t *a = asg + (long long)j * n + i;
        if (first_iter || *a != bi)
            atomicAdd(&changed[j], 1u);
        *a = bi;
        atomicAdd(&counts[(long long)j * k + bi], 1u);
        const float *xi = xs + i * D + (long long)j * dsub;
        unsigned long long *s = sums + ((long long)j * k + bi) * dsub;
        for (int t = 0; t < dsub; t++) {
            float v = xi[t];
            long long q = isfinite(v) ? __float2ll_rn(v * scale) : 0;
            atomicAdd(&s[t], (unsigned long long)q); /* two's complement: signed sum */
        }
    }
}

/* A point's dsub values into registers (16-byte loads where the width allows). */
template <int DS> __device__ __forceinline__ void load_point(const float *p, float *x)
{
    if constexpr (DS % 4 == 0) {
#pragma unroll
        for (int t = 0; t < DS; t += 4) {
            const float4 v = *reinterpret_cast<const float4 *>(p + t);
            x[t] = v.x, x[t + 1] = v.y, x[t + 2] = v.z, x[t + 3] = v.w;
        }
    } else {
#pragma unroll
        for (int t = 0; t < DS; t++)
            x[t] = p[t];
    }
}

/* One Lloyd assignment step of sub-space blockIdx.y over the points (m, n, DS):
 * argmin of the direct-form distances to the k centroids (shared memory),
 * change count, fixed-point sums and counts gathered per block in shared
 * memory and added to the global ones once per block. A point's fixed-point
 * value fits 32 bits (|q| <= 2^30); the block's 64-bit sums are kept as two
 * 32-bit words with 32-bit atomics (the carry out of the low word goes to
 * the high one), exact in any order. Dynamic shared memory: k * DS u32 low
 * and high words, k * DS f32 centroids, k u32 counts. */
template <int DS>
__global__ void __launch_bounds__(kThreads)
    multi_lloyd_kernel(long long n, int k, const float *xt, const float *cent,
                       const unsigned *maxbits, uint32_t *asg, unsigned long long *sums,
                       unsigned *counts, unsigned *changed, int first_iter)
{
    extern __shared__ __align__(16) unsigned char smb[];
    unsigned *s_lo = (unsigned *)smb, *s_hi = s_lo + (size_t)k * DS;
    float *s_cent = (float *)(s_hi + (size_t)k * DS);
    unsigned *s_cnt = (unsigned *)(s_cent + (size_t)k * DS);
    __shared__ unsigned s_changed;
    const int j = blockIdx.y;
    const float *cj = cent + (long long)j * k * DS;
    for (int e = threadIdx.x; e < k * DS; e += blockDim.x) {
        s_cent[e] = cj[e];
        s_lo[e] = s_hi[e] = 0;
    }
    for (int c = threadIdx.x; c < k; c += blockDim.x)
        s_cnt[c] = 0;
    if (threadIdx.x == 0)
        s_changed = 0;
    __syncthreads();
    const float mx = __uint_as_float(maxbits[j]);
    const float scale = mx > 0.0f ? 1073741824.0f / mx : 1.0f;
    const float *xj = xt + (long long)j * n * DS;
    uint32_t *aj = asg + (long long)j * n;
    unsigned moved = 0;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        float x[DS];
        load_point<DS>(xj + i * DS, x);
        float best = INFINITY;
        uint32_t bi = 0;
        for (int c = 0; c < k; c++) {
            float cc[DS];
            load_point<DS>(s_cent + c * DS, cc);
            float dd = 0.0f;
#pragma unroll
            for (int t = 0; t < DS; t++) {
                const float df = x[t] - cc[t];
                dd = __fmaf_rn(df, df, dd);
            }
            if (dd < best) {
                best = dd;
                bi = (uint32_t)c;
            }
        }
        if (first_iter || aj[i] != bi)
            moved++;
        aj[i] = bi;
        atomicAdd(&s_cnt[bi], 1u);
#pragma unroll
        for (int t = 0; t < DS; t++) {
            const int q = isfinite(x[t]) ? (int)__float2ll_rn(x[t] * scale) : 0;
            const unsigned old = atomicAdd(&s_lo[bi * DS + t], (unsigned)q);
            /* high word: q's sign extension plus the carry out of the low word */
            const unsigned hi = (q < 0 ? 0xffffffffu : 0u) + (old + (unsigned)q < old ? 1u : 0u);
            if (hi)
                atomicAdd(&s_hi[bi * DS + t], hi);
        }
    }
    for (int o = 16; o > 0; o >>= 1)
        moved += __shfl_xor_sync(0xffffffffu, moved, o);
    if ((threadIdx.x & 31) == 0 && moved)
        atomicAdd(&s_changed, moved);
    __syncthreads();
    unsigned long long *gs = sums + (long long)j * k * DS;
    for (int e = threadIdx.x; e < k * DS; e += blockDim.x)
        if (s_cnt[e / DS])
            atomicAdd(&gs[e], (unsigned long long)s_hi[e] << 32 | s_lo[e]);
    for (int c = threadIdx.x; c < k; c += blockDim.x)
        if (s_cnt[c])
            atomicAdd(&counts[(long long)j * k + c], s_cnt[c]);
    if (threadIdx.x == 0 && s_changed)
        atomicAdd(&changed[j], s_changed);
}

size_t lloyd_smem(int k, int dsub) { return (size_t)k * dsub * (4 + 4 + 4) + (size_t)k * 4; }

/* The widths multi_lloyd_kernel is compiled for, within the device's shared
 * memory (dsub 32, k 256: 97 KiB). */
bool lloyd_fused(const kvd_cuda_ctx *c, int k, int dsub)
{
    return k <= 256 && (dsub == 2 || dsub == 4 || dsub == 8 || dsub == 16 || dsub == 32) &&
           lloyd_smem(k, dsub) <= c->smem_optin;
}

/* One Lloyd step's arguments (multi_lloyd_kernel). */
struct lloyd_args {
    int m, k, first_iter;
    long long n;
    const float *xt, *cent;
    const unsigned *maxbits;
    uint32_t *asg;
    unsigned long long *sums;
    unsigned *counts, *changed;
};

template <int DS> int launch_lloyd_t(kvd_cuda_call *call, const lloyd_args &a, kvd_error *err)
{
    const size_t smem = lloyd_smem(a.k, DS);
    if (smem > 48 * 1024) {
        int rc = kvd__cuda_status(call->c,
                                  cudaFuncSetAttribute(multi_lloyd_kernel<DS>,
                                                       cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                       (int)smem),
                                  "cudaFuncSetAttribute", err);
        if (rc)
            return rc;
    }
    /* about 4 blocks per SM in all: each block adds its sums once */
    const int sms = call->c->sm_count > 0 ? call->c->sm_count : 1;
    long long per = (4LL * sms + a.m - 1) / a.m, need = (a.n + kThreads - 1) / kThreads;
    if (per > need)
        per = need;
    if (per < 1)
        per = 1;
    multi_lloyd_kernel<DS><<<dim3((unsigned)per, (unsigned)a.m), kThreads, smem, call->s>>>(
        a.n, a.k, a.xt, a.cent, a.maxbits, a.asg, a.sums, a.counts, a.changed, a.first_iter);
    return kvd__cuda_launched(call, "kmeans lloyd", err);
}

int launch_lloyd(kvd_cuda_call *call, int dsub, const lloyd_args &a, kvd_error *err)
{
    switch (dsub) {
    case 2:
        return launch_lloyd_t<2>(call, a, err);
    case 4:
        return launch_lloyd_t<4>(call, a, err);
    case 8:
        return launch_lloyd_t<8>(call, a, err);
    case 16:
        return launch_lloyd_t<16>(call, a, err);
    default:
        return launch_lloyd_t<32>(call, a, err);
    }
}

__global__ void multi_finalize_kernel(int m, int k, int dsub, const unsigned long long *sums,
                                      const unsigned *counts, const unsigned *maxbits,
                                      float *cent)
{
    for (long long e = blockIdx.x * (long long)blockDim.x + threadIdx.x;
         e < (long long)m * k * dsub; e += (long long)gridDim.x * blockDim.x) {
        const long long jc = e / dsub;
        const int j = (int)(jc / k);
        const unsigned cnt = counts[jc];
        if (cnt == 0)
            continue;
        const float mx = __uint_as_float(maxbits[j]);
        const double scale = mx > 0.0f ? 1073741824.0 / mx : 1.0;
        cent[e] = (float)((double)(long long)sums[e] / scale / (double)cnt);
    }
}

__global__ void gather_rows_kernel(long long ns, int D, const float *x, long long ldx,
                                   const long long *rows, float *out)
{
    for (long long e = blockIdx.x * (long long)blockDim.x + threadIdx.x; e < ns * D;
         e += (long long)gridDim.x * blockDim.x)
        out[e] = x[rows[e / D] * ldx + e % D];
}

} /* namespace */

int kvd__cuda_kmeans_train_multi(kvd_cuda_call *call, const kvd_kmeans_params *p, int m,
                                 int64_t n, int dsub, const float *x, int64_t ldx,
                                 float *centroids, double *inertia, kvd_error *err)
{
    const int k = p->k, D = m * dsub;
    const unsigned threads = kThreads;
    int rc = KVD_OK, locked = 0;
    int64_t ns = p->max_points > 0 && n > p->max_points ? p->max_points : n;
    const float *xs = x;
    float *xpack = nullptr, *xt = nullptr, *mind = nullptr, *xn = nullptr, *cn = nullptr,
          *dots = nullptr;
    const bool fused = lloyd_fused(call->c, k, dsub);
    double *part = nullptr;
    unsigned *arrived = nullptr;
    long long *rows = nullptr;
    uint32_t *asg = nullptr;
    unsigned long long *sums = nullptr;
    unsigned *counts = nullptr, *changed = nullptr, *maxbits = nullptr;
    seed_state *st = nullptr;
    unsigned *hcounts = nullptr;
    float *hcent = nullptr;
    int64_t chunk;
    cublasHandle_t blas = nullptr;
    dim3 pgrid;

    /* 1. points: a seeded subset (one for all sub-spaces) or x packed to ld D */
    if (ns < n || ldx != D) { /* from here on the points are (ns, D), ld D */
        TRY(kvd__cuda_scratch(call, sizeof(float) * (size_t)ns * D, (void **)&xpack, err));
        if (ns < n) {
            long long *perm = (long long *)malloc(sizeof(long long) * (size_t)n);
            if (!perm) {
                rc = kvd_error_set(err, KVD_ENOMEM, "cuda: kmeans: out of host memory");
                goto out;
            }
            rng r = {p->seed};
            for (int64_t i = 0; i < n; i++)
                perm[i] = i;
            for (int64_t i = 0; i < ns; i++) {
                int64_t jx = i + (int64_t)(rng_next(&r) % (uint64_t)(n - i));
                long long tmp = perm[i];
                perm[i] = perm[jx];
                perm[jx] = tmp;
            }
            rc = kvd__cuda_scratch(call, sizeof(long long) * (size_t)ns, (void **)&rows, err);
            if (!rc)
                rc = copy(call, rows, perm, sizeof(long long) * (size_t)ns, cudaMemcpyHostToDevice,
                          err);
            free(perm);
            if (rc)
                goto out;
            gather_rows_kernel<<<kvd__cuda_blocks(ns * D, threads), threads, 0, call->s>>>(
                ns, D, x, ldx, rows, xpack);
        } else {
            TRY(kvd__cuda_status(call->c,
                                 cudaMemcpy2DAsync(xpack, sizeof(float) * D, x, sizeof(float) * ldx,
                                                   sizeof(float) * D, n, cudaMemcpyDeviceToDevice,
                                                   call->s),
                                 "cudaMemcpy2DAsync", err));
        }
        TRY(kvd__cuda_launched(call, "kmeans gather", err));
        xs = xpack;
    }
    TRY(kvd__cuda_scratch(call, sizeof(float) * (size_t)ns * D, (void **)&xt, err));
    multi_split_kernel<<<kvd__cuda_blocks(ns * D, threads), threads, 0, call->s>>>(ns, dsub, xs, D,
                                                                                 xt);
    TRY(kvd__cuda_launched(call, "kmeans split", err));
    TRY(kvd__cuda_scratch(call, sizeof(float) * (size_t)m * ns, (void **)&mind, err));
    TRY(kvd__cuda_scratch(call, sizeof(seed_state) * (size_t)m, (void **)&st, err));
    pgrid = dim3(kvd__cuda_blocks(ns, threads) < 4096 ? kvd__cuda_blocks(ns, threads) : 4096,
                 (unsigned)m);

    /* 2. k-means++ on the device, all sub-spaces per launch */
    multi_init_kernel<<<m, 32, 0, call->s>>>(m, ns, k, dsub, xs, D, centroids, st, p->seed);
    { /* chunks of whole blocks, at most 4096 per sub-space */
        const long long per = (long long)threads * 4096;
        const long long ch = (ns + per - 1) / per * threads;
        const unsigned nb = (unsigned)((ns + ch - 1) / ch);
        /* 16-byte loads: xt is scratch (aligned), the centroids the caller's */
        const int v4 = dsub % 4 == 0 && (uintptr_t)centroids % 16 == 0;
        TRY(kvd__cuda_scratch(call, sizeof(double) * (size_t)m * nb + sizeof(unsigned) * m,
                              (void **)&part, err));
        arrived = (unsigned *)(part + (size_t)m * nb);
        TRY(kvd__cuda_status(call->c, cudaMemsetAsync(arrived, 0, sizeof(unsigned) * m, call->s),
                             "cudaMemsetAsync", err));
        for (int c = 1; c < k; c++)
            seed_step_kernel<<<dim3(nb, (unsigned)m), threads, 0, call->s>>>(
                ns, k, dsub, xt, centroids, st, c - 1, ch, v4, mind, part, arrived);
    }
    TRY(kvd__cuda_launched(call, "kmeans++", err));

    hcounts = (unsigned *)malloc(sizeof(unsigned) * (size_t)m * k + sizeof(seed_state) * m);
    hcent = (float *)malloc(sizeof(float) * (size_t)m * k * dsub);
    if (!hcounts || !hcent) {
        rc = kvd_error_set(err, KVD_ENOMEM, "cuda: kmeans: out of host memory");
        goto out;
    }
    { /* sub-spaces whose D^2 weights ran out: fill by splitting, on the host */
        seed_state *hst = (seed_state *)(hcounts + (size_t)m * k);
        TRY(copy(call, hst, st, sizeof(seed_state) * m, cudaMemcpyDeviceToHost, err));
        TRY(kvd__cuda_wait(call, "kmeans++", err));
        int any = 0;
        for (int j = 0; j < m; j++)
            any |= hst[j].stopped != 0;
        if (any) {
            TRY(copy(call, hcent, centroids, sizeof(float) * (size_t)m * k * dsub,
                     cudaMemcpyDeviceToHost, err));
            TRY(kvd__cuda_wait(call, "kmeans++", err));
            for (int j = 0; j < m; j++) {
                if (!hst[j].stopped)
                    continue;
                int64_t *cnt = (int64_t *)calloc((size_t)k, sizeof(int64_t));
                if (!cnt) {
                    rc = kvd_error_set(err, KVD_ENOMEM, "cuda: kmeans: out of host memory");
                    goto out;
                }
                for (int c = 0; c < k; c++)
                    cnt[c] = c < hst[j].stopped ? 1 : 0;
                rng r = {p->seed + (uint64_t)j};
                repair_empty(k, dsub, hcent + (size_t)j * k * dsub, cnt, &r);
                free(cnt);
            }
            TRY(copy(call, centroids, hcent, sizeof(float) * (size_t)m * k * dsub,
                     cudaMemcpyHostToDevice, err));
        }
    }

    /* 3. Lloyd: the fused kernel, or batched SGEMM + argmin; fixed-point sums */
    if (p->niter > 0) {
        chunk = (kChunkFloats * 4) / ((int64_t)k * m);
        if (chunk < 1)
            chunk = 1;
        if (chunk > ns)
            chunk = ns;
        if (!fused) {
            TRY(kvd__cuda_scratch(call, sizeof(float) * (size_t)m * ns, (void **)&xn, err));
            TRY(kvd__cuda_scratch(call, sizeof(float) * (size_t)m * k, (void **)&cn, err));
            TRY(kvd__cuda_scratch(call, sizeof(float) * (size_t)m * chunk * k, (void **)&dots,
                                  err));
        }
        TRY(kvd__cuda_scratch(call, sizeof(uint32_t) * (size_t)m * ns, (void **)&asg, err));
        TRY(kvd__cuda_scratch(call, sizeof(unsigned long long) * (size_t)m * k * dsub,
                              (void **)&sums, err));
        TRY(kvd__cuda_scratch(call, sizeof(unsigned) * ((size_t)m * k + 2 * m), (void **)&counts,
                              err));
        changed = counts + (size_t)m * k;
        maxbits = changed + m;
        TRY(kvd__cuda_status(call->c, cudaMemsetAsync(maxbits, 0, sizeof(unsigned) * m, call->s),
                             "cudaMemsetAsync", err));
        multi_maxabs_kernel<<<pgrid, threads, 0, call->s>>>(ns, dsub, xs, D, maxbits);
        if (!fused) {
            multi_norms_kernel<<<pgrid, threads, 0, call->s>>>(ns, dsub, xs, D, dsub, xn);
            TRY(kvd__cuda_launched(call, "kmeans prep", err));
            pthread_mutex_lock(&call->slot->mu);
            locked = 1;
            TRY(kvd__cuda_blas(call, &blas, err));
        }
        TRY(kvd__cuda_launched(call, "kmeans prep", err));
    }
    for (int it = 0; it < p->niter; it++) {
        if (!fused)
            multi_norms_kernel<<<dim3(kvd__cuda_blocks(k, threads), m), threads, 0, call->s>>>(
                k, dsub, centroids, dsub, (long long)k * dsub, cn);
        TRY(kvd__cuda_status(call->c,
                             cudaMemsetAsync(sums, 0, sizeof(unsigned long long) * (size_t)m * k * dsub,
                                             call->s),
                             "cudaMemsetAsync", err));
        TRY(kvd__cuda_status(call->c,
                             cudaMemsetAsync(counts, 0, sizeof(unsigned) * ((size_t)m * k + m),
                                             call->s),
                             "cudaMemsetAsync", err));
        TRY(kvd__cuda_launched(call, "kmeans norms", err));
        if (fused)
            TRY(launch_lloyd(call, dsub,
                             lloyd_args{m, k, it == 0, ns, xt, centroids, maxbits, asg, sums,
                                        counts, changed},
                             err));
        for (int64_t i0 = 0; !fused && i0 < ns; i0 += chunk) {
            const int64_t nc = ns - i0 < chunk ? ns - i0 : chunk;
            const float one = 1.0f, zero = 0.0f;
            /* per sub-space j (batch): dots_j (k, nc) = C_j^T (k, dsub) . X_j^T (dsub, nc),
             * X_j = columns j*dsub.. of the packed (ns, D) points, ld D */
            TRY(kvd__cublas_status(
                call->c,
                kvd__blas.SgemmStridedBatched(blas, CUBLAS_OP_T, CUBLAS_OP_N, k, (int)nc, dsub, &one,
                                          centroids, dsub, (long long)k * dsub, xs + i0 * D, D,
                                          dsub, &zero, dots, k, (long long)chunk * k, m),
                "cublasSgemmStridedBatched", err));
            multi_assign_kernel<<<dim3(kvd__cuda_blocks(nc, threads), m), threads, 0, call->s>>>(
                ns, i0, nc, k, dsub, dots, (long long)chunk * k, xn, cn, xs, D, maxbits, asg,
                sums, counts, changed, it == 0);
            TRY(kvd__cuda_launched(call, "kmeans assign", err));
        }
        TRY(copy(call, hcounts, counts, sizeof(unsigned) * ((size_t)m * k + m),
                 cudaMemcpyDeviceToHost, err));
        TRY(kvd__cuda_wait(call, "kmeans iteration", err));
        int moved = 0;
        for (int j = 0; j < m; j++)
            moved |= hcounts[(size_t)m * k + j] != 0;
        if (it > 0 && !moved)
            break; /* no assignment changed: centroids are already the means */
        multi_finalize_kernel<<<kvd__cuda_blocks((int64_t)m * k * dsub, threads), threads, 0,
                                call->s>>>(m, k, dsub, sums, counts, maxbits, centroids);
        TRY(kvd__cuda_launched(call, "kmeans update", err));
        int empty = 0;
        for (size_t e = 0; e < (size_t)m * k; e++)
            empty |= hcounts[e] == 0;
        if (empty) { /* repair on the host, as the CPU rule */
            TRY(copy(call, hcent, centroids, sizeof(float) * (size_t)m * k * dsub,
                     cudaMemcpyDeviceToHost, err));
            TRY(kvd__cuda_wait(call, "kmeans repair", err));
            for (int j = 0; j < m; j++) {
                int64_t *cnt = (int64_t *)malloc(sizeof(int64_t) * (size_t)k);
                if (!cnt) {
                    rc = kvd_error_set(err, KVD_ENOMEM, "cuda: kmeans: out of host memory");
                    goto out;
                }
                for (int c = 0; c < k; c++)
                    cnt[c] = hcounts[(size_t)j * k + c];
                rng r = {p->seed + (uint64_t)j * 0x9E3779B97F4A7C15ull + (uint64_t)it};
                repair_empty(k, dsub, hcent + (size_t)j * k * dsub, cnt, &r);
                free(cnt);
            }
            TRY(copy(call, centroids, hcent, sizeof(float) * (size_t)m * k * dsub,
                     cudaMemcpyHostToDevice, err));
        }
    }
    if (locked) {
        pthread_mutex_unlock(&call->slot->mu);
        locked = 0;
    }
    /* inertia (m == 1): direct-form distances of the clustered points */
    if (inertia && m == 1) {
        float *hd = (float *)malloc(sizeof(float) * (size_t)ns);
        uint32_t *da = asg;
        if (!hd) {
            rc = kvd_error_set(err, KVD_ENOMEM, "cuda: kmeans: out of host memory");
            goto out;
        }
        if (!da)
            rc = kvd__cuda_scratch(call, sizeof(uint32_t) * (size_t)ns, (void **)&asg, err);
        if (!rc)
            rc = kvd__cuda_kmeans_assign(call, ns, dsub, xs, xs == x ? ldx : D, k, centroids, asg,
                                         mind, err);
        if (!rc)
            rc = copy(call, hd, mind, sizeof(float) * (size_t)ns, cudaMemcpyDeviceToHost, err);
        if (!rc)
            rc = kvd__cuda_wait(call, "kmeans inertia", err);
        if (!rc) {
            double in = 0.0;
            for (int64_t i = 0; i < ns; i++)
                in += (double)hd[i];
            *inertia = in;
        }
        free(hd);
        if (rc)
            goto out;
    }
    rc = kvd__cuda_wait(call, "kmeans", err);
out:
    if (locked)
        pthread_mutex_unlock(&call->slot->mu);
    if (rc)
        cudaStreamSynchronize(call->s);
    free(hcounts);
    free(hcent);
    kvd__cuda_scratch_free(call, xpack);
    kvd__cuda_scratch_free(call, xt);
    kvd__cuda_scratch_free(call, rows);
    kvd__cuda_scratch_free(call, mind);
    kvd__cuda_scratch_free(call, st);
    kvd__cuda_scratch_free(call, part);
    kvd__cuda_scratch_free(call, xn);
    kvd__cuda_scratch_free(call, cn);
    kvd__cuda_scratch_free(call, dots);
    kvd__cuda_scratch_free(call, asg);
    kvd__cuda_scratch_free(call, sums);
    kvd__cuda_scratch_free(call, counts);
    return rc;
}

int kvd__cuda_kmeans_exact(void)
{
    const char *e = getenv("KVD_CUDA_KMEANS_EXACT");
    return e && e[0] == '1';
}

int kvd__cuda_kmeans_train_auto(kvd_cuda_call *call, const kvd_kmeans_params *p, int64_t n, int d,
                                const float *x, int64_t ldx, float *centroids, double *inertia,
                                kvd_error *err)
{
    if (kvd__cuda_kmeans_exact())
        return kvd__cuda_kmeans_train(call, p, n, d, x, ldx, centroids, inertia, err);
    return kvd__cuda_kmeans_train_multi(call, p, 1, n, d, x, ldx, centroids, inertia, err);
}
