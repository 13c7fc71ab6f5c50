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
 *   seeding   per pick, two launches for all sub-spaces: pick_kernel (one
 *             1024-thread block per sub-space: segment sums of the D^2
 *             weights in double, a block scan, a device splitmix64 draw,
 *             the owning thread walks its segment) and seed_update_kernel
 *             (grid (points, m)). No host round trip.
 *   Lloyd     one strided-batched SGEMM per chunk of points (batch = m),
 *             an argmin kernel that also accumulates the new centroid sums
 *             in 64-bit fixed point (integer atomics: the sums do not depend
 *             on the order, so the result is deterministic), a finalize
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

/* mind[j][i] = min(mind, |x_i^j - c_j[c]|^2); c = 0 starts from +inf. */
__global__ void seed_update_kernel(long long n, int k, int dsub, const float *xs, int D,
                                   const float *cent, const seed_state *st, int c, float *mind)
{
    const int j = blockIdx.y;
    if (st[j].stopped)
        return;
    const float *cc = cent + ((long long)j * k + c) * dsub;
    float *md = mind + (long long)j * n;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        float dd = dist2(dsub, xs + i * D + (long long)j * dsub, cc);
        if (c == 0 || dd < md[i])
            md[i] = dd;
    }
}

constexpr int kPickThreads = 1024;

__global__ void __launch_bounds__(kPickThreads)
    pick_kernel(long long n, int k, int dsub, const float *xs, int D, float *cent,
                seed_state *st, int chosen, const float *mind)
{
    __shared__ double scan[kPickThreads];
    __shared__ double s_r;
    __shared__ long long s_pick;
    const int j = blockIdx.x, t = threadIdx.x;
    if (st[j].stopped)
        return;
    const float *md = mind + (long long)j * n;
    const long long seg = (n + kPickThreads - 1) / kPickThreads;
    const long long b0 = t * seg, b1 = b0 + seg < n ? b0 + seg : n;
    double own = 0.0;
    for (long long i = b0; i < b1; i++)
        if (isfinite(md[i]) && md[i] > 0.0f)
            own += (double)md[i];
    scan[t] = own;
    __syncthreads();
    for (int o = 1; o < kPickThreads; o <<= 1) { /* inclusive scan */
        double v = t >= o ? scan[t - o] : 0.0;
        __syncthreads();
        scan[t] += v;
        __syncthreads();
    }
    const double total = scan[kPickThreads - 1];
    if (!(total > 0.0)) { /* every point sits on a centroid: stop, repair later */
        if (t == 0)
            st[j].stopped = chosen;
        return;
    }
    if (t == 0) {
        double u = (double)(dev_rng_next(&st[j].rng) >> 11) * 0x1.0p-53;
        double r = u * total;
        s_r = r < total ? r : total * (1.0 - 0x1.0p-50);
        s_pick = -1;
    }
    __syncthreads();
    const double r = s_r, incl = scan[t], excl = incl - own;
    if (own > 0.0 && r >= excl && r < incl) {
        double acc = excl;
        long long last = -1, pick = -1;
        for (long long i = b0; i < b1; i++) {
            if (!(isfinite(md[i]) && md[i] > 0.0f))
                continue;
            last = i;
            acc += (double)md[i];
            if (acc > r) {
                pick = i;
                break;
            }
        }
        s_pick = pick >= 0 ? pick : last;
    }
    __syncthreads();
    long long pick = s_pick;
    if (pick < 0) /* rounding left r in no segment: the last eligible point */
        for (long long i = n - 1; i >= 0 && pick < 0; i--)
            if (isfinite(md[i]) && md[i] > 0.0f)
                pick = i;
    if (pick < 0)
        pick = 0;
    for (int d = t; d < dsub; d += blockDim.x)
        cent[((long long)j * k + chosen) * dsub + d] = xs[pick * D + (long long)j * dsub + d];
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
    float *xpack = nullptr, *mind = nullptr, *xn = nullptr, *cn = nullptr, *dots = nullptr;
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
    TRY(kvd__cuda_scratch(call, sizeof(float) * (size_t)m * ns, (void **)&mind, err));
    TRY(kvd__cuda_scratch(call, sizeof(seed_state) * (size_t)m, (void **)&st, err));
    pgrid = dim3(kvd__cuda_blocks(ns, threads) < 4096 ? kvd__cuda_blocks(ns, threads) : 4096,
                 (unsigned)m);

    /* 2. k-means++ on the device, all sub-spaces per launch */
    multi_init_kernel<<<m, 32, 0, call->s>>>(m, ns, k, dsub, xs, D, centroids, st, p->seed);
    seed_update_kernel<<<pgrid, threads, 0, call->s>>>(ns, k, dsub, xs, D, centroids, st, 0,
                                                      mind);
    for (int c = 1; c < k; c++) {
        pick_kernel<<<m, kPickThreads, 0, call->s>>>(ns, k, dsub, xs, D, centroids, st, c, mind);
        seed_update_kernel<<<pgrid, threads, 0, call->s>>>(ns, k, dsub, xs, D, centroids, st, c,
                                                          mind);
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

    /* 3. Lloyd: batched SGEMM, fused argmin + fixed-point sums */
    if (p->niter > 0) {
        chunk = (kChunkFloats * 4) / ((int64_t)k * m);
        if (chunk < 1)
            chunk = 1;
        if (chunk > ns)
            chunk = ns;
        TRY(kvd__cuda_scratch(call, sizeof(float) * (size_t)m * ns, (void **)&xn, err));
        TRY(kvd__cuda_scratch(call, sizeof(float) * (size_t)m * k, (void **)&cn, err));
        TRY(kvd__cuda_scratch(call, sizeof(float) * (size_t)m * chunk * k, (void **)&dots, err));
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
        multi_norms_kernel<<<pgrid, threads, 0, call->s>>>(ns, dsub, xs, D, dsub, xn);
        TRY(kvd__cuda_launched(call, "kmeans prep", err));
        pthread_mutex_lock(&call->slot->mu);
        locked = 1;
        TRY(kvd__cuda_blas(call, &blas, err));
    }
    for (int it = 0; it < p->niter; it++) {
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
        for (int64_t i0 = 0; i0 < ns; i0 += chunk) {
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
    kvd__cuda_scratch_free(call, rows);
    kvd__cuda_scratch_free(call, mind);
    kvd__cuda_scratch_free(call, st);
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
