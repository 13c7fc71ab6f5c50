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
                                   cublasSgemm(blas, CUBLAS_OP_T, CUBLAS_OP_N, k, (int)nc, d, &one,
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
    return kvd__cuda_kmeans_train(&call, p, x->shape[0], (int)x->shape[1],
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
