/*
 * CUDA backend: device selection, device memory, a stream per worker thread,
 * pinned staging for transfers, cuBLAS handles, error mapping.
 *
 * Every CUDA/cuBLAS error becomes a kvd status with a message; nothing
 * aborts the process. An error that leaves the context unusable (a "sticky"
 * error such as an illegal address) marks the backend unhealthy: every later
 * call fails with KVD_EUNAVAIL so the service can fall back or restart
 * cleanly. How threads map to streams is described in cuda_internal.h.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <atomic>
#include <vector>

#include "cuda_internal.h"

namespace {

int is_sticky(cudaError_t e)
{
    switch (e) {
    case cudaErrorIllegalAddress:
    case cudaErrorLaunchFailure:
    case cudaErrorHardwareStackError:
    case cudaErrorIllegalInstruction:
    case cudaErrorMisalignedAddress:
    case cudaErrorInvalidAddressSpace:
    case cudaErrorInvalidPc:
    case cudaErrorECCUncorrectable:
    case cudaErrorLaunchTimeout:
        return 1;
    default:
        return 0;
    }
}

/* Thread -> slot: a ticket drawn once per thread. */
std::atomic<unsigned> g_ticket{0};
thread_local int t_slot = -1;

int slot_index(void)
{
    if (t_slot < 0)
        t_slot = (int)(g_ticket.fetch_add(1) % KVD_CUDA_SLOTS);
    return t_slot;
}

kvd_cuda_ctx *ctx_of(kvd_backend *be) { return static_cast<kvd_cuda_ctx *>(be->ctx); }

void cuda_free_backend(kvd_backend *be)
{
    kvd_cuda_ctx *c = ctx_of(be);
    if (c) {
        cudaSetDevice(c->device);
        for (int i = 0; i < KVD_CUDA_SLOTS; i++) {
            kvd_cuda_slot *s = &c->slots[i];
            if (s->stream)
                cudaStreamSynchronize(s->stream);
            if (s->blas)
                kvd__blas.Destroy(s->blas);
            if (s->pinned)
                cudaFreeHost(s->pinned);
            for (int j = 0; j < 2; j++)
                if (s->ev[j])
                    cudaEventDestroy(s->ev[j]);
            if (s->stream)
                cudaStreamDestroy(s->stream);
            pthread_mutex_destroy(&s->mu);
        }
        pthread_mutex_destroy(&c->pinned_mu);
        free(c);
    }
    free(be);
}

int cuda_alloc(kvd_backend *be, size_t bytes, void **out, kvd_error *err)
{
    *out = NULL;
    kvd_cuda_call call;
    int rc = kvd__cuda_begin(be, &call, err);
    if (rc)
        return rc;
    /* cudaMalloc returns 256-byte aligned memory: every kernel may use
     * 16-byte vector accesses on a tensor that starts an allocation. */
    cudaError_t e = cudaMalloc(out, bytes ? bytes : 1);
    if (e != cudaSuccess) {
        *out = NULL;
        cudaGetLastError(); /* an allocation failure is not sticky: clear it */
    }
    return kvd__cuda_status(call.c, e, "cudaMalloc", err);
}

void cuda_dealloc(kvd_backend *be, void *ptr)
{
    if (ptr) {
        cudaSetDevice(ctx_of(be)->device);
        cudaFree(ptr); /* synchronises the device: memory is never freed under a kernel */
    }
}

/* Pinned staging buffer of the slot (slot->mu held). */
int slot_pinned(kvd_cuda_call *call, kvd_error *err)
{
    kvd_cuda_slot *s = call->slot;
    if (s->pinned)
        return KVD_OK;
    int rc = kvd__cuda_status(call->c, cudaHostAlloc(&s->pinned, KVD_CUDA_STAGE_BYTES,
                                                     cudaHostAllocPortable),
                              "cudaHostAlloc", err);
    if (rc) {
        s->pinned = NULL;
        return rc;
    }
    for (int j = 0; j < 2 && !rc; j++)
        rc = kvd__cuda_status(call->c, cudaEventCreateWithFlags(&s->ev[j], cudaEventDisableTiming),
                              "cudaEventCreate", err);
    return rc;
}

/*
 * Host -> device through the pinned halves: copy chunk i into half i%2 once
 * that half's previous DMA finished (its event), then queue its DMA. The
 * memcpy of one chunk overlaps the DMA of the previous one.
 */
int staged_upload(kvd_cuda_call *call, char *dst, const char *src, size_t bytes, kvd_error *err)
{
    kvd_cuda_slot *s = call->slot;
    const size_t half = KVD_CUDA_STAGE_BYTES / 2;
    int rc = KVD_OK;
    int used[2] = {0, 0};
    for (size_t off = 0, i = 0; off < bytes && !rc; off += half, i++) {
        size_t n = bytes - off < half ? bytes - off : half;
        int h = (int)(i & 1);
        char *stage = static_cast<char *>(s->pinned) + h * half;
        if (used[h])
            rc = kvd__cuda_status(call->c, cudaEventSynchronize(s->ev[h]), "cudaEventSynchronize",
                                  err);
        if (rc)
            break;
        memcpy(stage, src + off, n);
        rc = kvd__cuda_status(call->c,
                              cudaMemcpyAsync(dst + off, stage, n, cudaMemcpyHostToDevice, s->stream),
                              "cudaMemcpyAsync", err);
        if (!rc)
            rc = kvd__cuda_status(call->c, cudaEventRecord(s->ev[h], s->stream), "cudaEventRecord",
                                  err);
        used[h] = 1;
    }
    if (!rc)
        rc = kvd__cuda_wait(call, "upload", err);
    else
        cudaStreamSynchronize(s->stream); /* no DMA may still read the staging buffer */
    return rc;
}

/* Device -> host: DMA chunk i+1 runs while chunk i is copied out. */
int staged_download(kvd_cuda_call *call, char *dst, const char *src, size_t bytes, kvd_error *err)
{
    kvd_cuda_slot *s = call->slot;
    const size_t half = KVD_CUDA_STAGE_BYTES / 2;
    size_t nchunks = (bytes + half - 1) / half;
    int rc = KVD_OK;
    for (size_t i = 0; i <= nchunks && !rc; i++) {
        if (i < nchunks) { /* queue chunk i */
            size_t off = i * half, n = bytes - off < half ? bytes - off : half;
            char *stage = static_cast<char *>(s->pinned) + (i & 1) * half;
            rc = kvd__cuda_status(call->c,
                                  cudaMemcpyAsync(stage, src + off, n, cudaMemcpyDeviceToHost,
                                                  s->stream),
                                  "cudaMemcpyAsync", err);
            if (!rc)
                rc = kvd__cuda_status(call->c, cudaEventRecord(s->ev[i & 1], s->stream),
                                      "cudaEventRecord", err);
        }
        if (!rc && i > 0) { /* drain chunk i-1 */
            size_t j = i - 1, off = j * half, n = bytes - off < half ? bytes - off : half;
            rc = kvd__cuda_status(call->c, cudaEventSynchronize(s->ev[j & 1]),
                                  "cudaEventSynchronize", err);
            if (!rc)
                memcpy(dst + off, static_cast<char *>(s->pinned) + (j & 1) * half, n);
        }
    }
    if (rc)
        cudaStreamSynchronize(s->stream); /* no DMA may still write the staging buffer */
    return rc;
}

/* Does [p, p + n) lie in a pinned block of host_alloc? */
int in_pinned(kvd_cuda_ctx *c, const void *p, size_t n)
{
    const char *a = static_cast<const char *>(p);
    int in = 0;
    pthread_mutex_lock(&c->pinned_mu);
    for (int i = 0; i < KVD_CUDA_PINNED_BLOCKS && !in; i++)
        in = c->pinned[i].p && a >= c->pinned[i].p && n <= c->pinned[i].n &&
             (size_t)(a - c->pinned[i].p) <= c->pinned[i].n - n;
    pthread_mutex_unlock(&c->pinned_mu);
    return in;
}

int cuda_copy(kvd_backend *be, void *dst, const void *src, size_t bytes, cudaMemcpyKind kind,
              kvd_error *err)
{
    kvd_cuda_call call;
    int rc = kvd__cuda_begin(be, &call, err);
    if (rc || bytes == 0)
        return rc;
    const void *host = kind == cudaMemcpyHostToDevice ? src : dst;
    if (bytes >= KVD_CUDA_STAGE_MIN && !in_pinned(call.c, host, bytes)) {
        pthread_mutex_lock(&call.slot->mu);
        rc = slot_pinned(&call, err);
        if (!rc)
            rc = kind == cudaMemcpyHostToDevice
                     ? staged_upload(&call, static_cast<char *>(dst),
                                     static_cast<const char *>(src), bytes, err)
                     : staged_download(&call, static_cast<char *>(dst),
                                       static_cast<const char *>(src), bytes, err);
        pthread_mutex_unlock(&call.slot->mu);
        return rc;
    }
    rc = kvd__cuda_status(call.c, cudaMemcpyAsync(dst, src, bytes, kind, call.s),
                          "cudaMemcpyAsync", err);
    if (rc)
        return rc;
    /* Copies are synchronous for the caller: host buffers may be reused at once. */
    return kvd__cuda_wait(&call, "copy", err);
}

int cuda_upload(kvd_backend *be, void *dst, const void *host_src, size_t bytes, kvd_error *err)
{
    return cuda_copy(be, dst, host_src, bytes, cudaMemcpyHostToDevice, err);
}

int cuda_download(kvd_backend *be, void *host_dst, const void *src, size_t bytes, kvd_error *err)
{
    return cuda_copy(be, host_dst, src, bytes, cudaMemcpyDeviceToHost, err);
}

/* Waits for every slot's stream: "everything issued so far", by any thread. */
int cuda_sync(kvd_backend *be, kvd_error *err)
{
    kvd_cuda_call call;
    int rc = kvd__cuda_begin(be, &call, err);
    for (int i = 0; i < KVD_CUDA_SLOTS && !rc; i++)
        rc = kvd__cuda_status(call.c, cudaStreamSynchronize(call.c->slots[i].stream),
                              "cudaStreamSynchronize", err);
    return rc;
}

void cuda_describe(const kvd_backend *be, kvd_backend_desc *out)
{
    const kvd_cuda_ctx *c = static_cast<const kvd_cuda_ctx *>(be->ctx);
    snprintf(out->device, sizeof out->device, "%s", c->device_name);
    out->memory_bytes = c->total_mem;
    out->healthy = !c->unhealthy;
    size_t free_b = 0, total_b = 0;
    if (!c->unhealthy && cudaSetDevice(c->device) == cudaSuccess &&
        cudaMemGetInfo(&free_b, &total_b) == cudaSuccess)
        out->free_bytes = free_b;
    cudaGetLastError(); /* not sticky */
}

int cuda_scratch(kvd_backend *be, size_t bytes, void **out, kvd_error *err)
{
    kvd_cuda_call call;
    int rc = kvd__cuda_begin(be, &call, err);
    return rc ? rc : kvd__cuda_scratch(&call, bytes, out, err);
}

void cuda_scratch_free(kvd_backend *be, void *ptr)
{
    if (!ptr)
        return;
    kvd_cuda_call call;
    if (kvd__cuda_begin(be, &call, NULL) == 0) {
        kvd__cuda_scratch_free(&call, ptr);
        return;
    }
    /* An unusable device still gets its memory back (a dead context
     * refuses, which changes nothing). */
    cudaSetDevice(ctx_of(be)->device);
    cudaFree(ptr);
    cudaGetLastError();
}

int cuda_host_alloc(kvd_backend *be, size_t bytes, void **out, kvd_error *err)
{
    kvd_cuda_call call;
    int rc = kvd__cuda_begin(be, &call, err);
    if (rc)
        return rc;
    kvd_cuda_ctx *c = call.c;
    pthread_mutex_lock(&c->pinned_mu);
    int slot = -1;
    for (int i = 0; i < KVD_CUDA_PINNED_BLOCKS && slot < 0; i++)
        if (!c->pinned[i].p)
            slot = i;
    if (slot < 0) {
        pthread_mutex_unlock(&c->pinned_mu);
        return kvd_error_set(err, KVD_ENOMEM, "cuda: more than %d pinned host blocks",
                             KVD_CUDA_PINNED_BLOCKS);
    }
    cudaError_t e = cudaHostAlloc(out, bytes ? bytes : 1, cudaHostAllocPortable);
    if (e == cudaSuccess) {
        c->pinned[slot].p = static_cast<char *>(*out);
        c->pinned[slot].n = bytes;
    } else {
        *out = NULL;
        cudaGetLastError(); /* not sticky */
    }
    pthread_mutex_unlock(&c->pinned_mu);
    return kvd__cuda_status(c, e, "cudaHostAlloc", err);
}

void cuda_host_free(kvd_backend *be, void *ptr)
{
    kvd_cuda_ctx *c = ctx_of(be);
    pthread_mutex_lock(&c->pinned_mu);
    for (int i = 0; i < KVD_CUDA_PINNED_BLOCKS; i++)
        if (c->pinned[i].p == ptr)
            c->pinned[i].p = NULL;
    pthread_mutex_unlock(&c->pinned_mu);
    cudaSetDevice(c->device);
    cudaFreeHost(ptr);
    cudaGetLastError();
}

int cuda_copy2d(kvd_backend *be, void *dst, size_t dpitch, const void *src, size_t spitch,
                size_t width, size_t height, kvd_error *err)
{
    kvd_cuda_call call;
    int rc = kvd__cuda_begin(be, &call, err);
    if (rc)
        return rc;
    return kvd__cuda_status(call.c,
                            cudaMemcpy2DAsync(dst, dpitch, src, spitch, width, height,
                                              cudaMemcpyDeviceToDevice, call.s),
                            "cudaMemcpy2DAsync", err);
}

/* A piece of a device -> host copy waiting in a staging half. */
struct StagedPiece {
    char *host;
    size_t off; /* in its half */
    size_t n;
};

/*
 * The copies of a batch on the thread's stream, waited for once. Copies
 * within the device go straight on the stream. Host sides
 * inside host_alloc blocks are DMA'd directly; the others travel through
 * the slot's two pinned staging halves as one stream of pieces, several
 * copies sharing a half: a half is closed by an event, and reused (its
 * downloaded pieces copied out first) once that event has passed, so the
 * memcpy into or out of one half overlaps the DMA of the other.
 */
int cuda_copy_batch(kvd_backend *be, const kvd_copy *ops, size_t n, kvd_error *err)
{
    kvd_cuda_call call;
    int rc = kvd__cuda_begin(be, &call, err);
    if (rc)
        return rc;
    size_t staged = 0;
    for (size_t i = 0; i < n && !rc; i++) {
        const kvd_copy *o = &ops[i];
        const void *host = o->to_device ? o->src : o->dst;
        if (!o->bytes)
            continue;
        if (!o->within && !in_pinned(call.c, host, o->bytes)) {
            staged++;
            continue;
        }
        rc = kvd__cuda_status(call.c,
                              cudaMemcpyAsync(o->dst, o->src, o->bytes,
                                              o->within      ? cudaMemcpyDeviceToDevice
                                              : o->to_device ? cudaMemcpyHostToDevice
                                                             : cudaMemcpyDeviceToHost,
                                              call.s),
                              "cudaMemcpyAsync", err);
    }
    if (!rc && staged) {
        kvd_cuda_slot *sl = call.slot;
        pthread_mutex_lock(&sl->mu);
        rc = slot_pinned(&call, err);
        const size_t half = KVD_CUDA_STAGE_BYTES / 2;
        std::vector<StagedPiece> pend[2];
        int cur = 0, used[2] = {0, 0};
        size_t fill = 0;
        for (size_t i = 0; i < n && !rc; i++) {
            const kvd_copy *o = &ops[i];
            if (!o->bytes || o->within || in_pinned(call.c, o->to_device ? o->src : o->dst, o->bytes))
                continue;
            for (size_t off = 0; off < o->bytes && !rc;) {
                if (fill == half) { /* close this half, take the other once free */
                    rc = kvd__cuda_status(call.c, cudaEventRecord(sl->ev[cur], call.s),
                                          "cudaEventRecord", err);
                    used[cur] = 1;
                    cur ^= 1;
                    fill = 0;
                    if (!rc && used[cur])
                        rc = kvd__cuda_status(call.c, cudaEventSynchronize(sl->ev[cur]),
                                              "cudaEventSynchronize", err);
                    char *base = static_cast<char *>(sl->pinned) + cur * half;
                    for (const StagedPiece &p : pend[cur])
                        if (!rc)
                            memcpy(p.host, base + p.off, p.n);
                    pend[cur].clear();
                    if (rc)
                        break;
                }
                const size_t m = o->bytes - off < half - fill ? o->bytes - off : half - fill;
                char *stage = static_cast<char *>(sl->pinned) + cur * half + fill;
                if (o->to_device) {
                    memcpy(stage, static_cast<const char *>(o->src) + off, m);
                    rc = kvd__cuda_status(call.c,
                                          cudaMemcpyAsync(static_cast<char *>(o->dst) + off, stage,
                                                          m, cudaMemcpyHostToDevice, call.s),
                                          "cudaMemcpyAsync", err);
                } else {
                    rc = kvd__cuda_status(
                        call.c,
                        cudaMemcpyAsync(stage, static_cast<const char *>(o->src) + off, m,
                                        cudaMemcpyDeviceToHost, call.s),
                        "cudaMemcpyAsync", err);
                    pend[cur].push_back({static_cast<char *>(o->dst) + off, fill, m});
                }
                fill += m;
                off += m;
            }
        }
        if (!rc)
            rc = kvd__cuda_wait(&call, "copy batch", err);
        else
            cudaStreamSynchronize(call.s); /* no DMA may still use the staging halves */
        for (int h = 0; h < 2 && !rc; h++)
            for (const StagedPiece &p : pend[h])
                memcpy(p.host, static_cast<char *>(sl->pinned) + h * half + p.off, p.n);
        pthread_mutex_unlock(&sl->mu);
        return rc;
    }
    if (rc) {
        cudaStreamSynchronize(call.s); /* nothing queued may outlive the call */
        return rc;
    }
    return kvd__cuda_wait(&call, "copy batch", err);
}

const kvd_backend_iface cuda_iface = {
    "cuda",
    cuda_free_backend,
    cuda_alloc,
    cuda_dealloc,
    cuda_upload,
    cuda_download,
    cuda_sync,
    &kvd__cuda_convert_ops,
    &kvd__cuda_quant_ops,
    &kvd__cuda_kmeans_ops,
    &kvd__cuda_vq_ops,
    &kvd__cuda_pq_ops,
    &kvd__cuda_svd_ops, /* projections; the eigendecomposition stays on the host */
    &kvd__cuda_attn_ops,
    cuda_describe,
    cuda_scratch,
    cuda_scratch_free,
    cuda_copy2d,
    cuda_host_alloc,
    cuda_host_free,
    cuda_copy_batch,
};

} /* namespace */

/* ---- helpers shared by the op files ------------------------------------- */

int kvd__cuda_status(kvd_cuda_ctx *c, cudaError_t e, const char *what, kvd_error *err)
{
    if (e == cudaSuccess)
        return KVD_OK;
    int code = e == cudaErrorMemoryAllocation ? KVD_ENOMEM : KVD_EINTERNAL;
    if (c && is_sticky(e)) {
        c->unhealthy = 1;
        code = KVD_EUNAVAIL;
    }
    return kvd_error_set(err, code, "cuda: %s: %s", what, cudaGetErrorString(e));
}

int kvd__cublas_status(kvd_cuda_ctx *c, cublasStatus_t e, const char *what, kvd_error *err)
{
    (void)c;
    if (e == CUBLAS_STATUS_SUCCESS)
        return KVD_OK;
    int code = e == CUBLAS_STATUS_ALLOC_FAILED ? KVD_ENOMEM
               : e == CUBLAS_STATUS_NOT_SUPPORTED || e == CUBLAS_STATUS_ARCH_MISMATCH
                   ? KVD_EUNSUPP
                   : KVD_EINTERNAL;
    if (c && e == CUBLAS_STATUS_EXECUTION_FAILED) {
        /* The kernel failed; the runtime tells whether the context survived. */
        cudaError_t ce = cudaGetLastError();
        if (is_sticky(ce)) {
            c->unhealthy = 1;
            code = KVD_EUNAVAIL;
        }
    }
    return kvd_error_set(err, code, "cublas: %s: %s", what, kvd__blas.GetStatusString(e));
}

int kvd__cuda_begin(kvd_backend *be, kvd_cuda_call *call, kvd_error *err)
{
    kvd_cuda_ctx *c = ctx_of(be);
    call->c = c;
    call->slot = NULL;
    call->s = NULL;
    if (c->unhealthy)
        return kvd_error_set(err, KVD_EUNAVAIL,
                             "cuda: device %d is unhealthy after an earlier error", c->device);
    int rc = kvd__cuda_status(c, cudaSetDevice(c->device), "cudaSetDevice", err);
    if (rc)
        return rc;
    call->slot = &c->slots[slot_index()];
    call->s = call->slot->stream;
    return KVD_OK;
}

int kvd__cuda_launched(kvd_cuda_call *call, const char *what, kvd_error *err)
{
    return kvd__cuda_status(call->c, cudaGetLastError(), what, err);
}

int kvd__cuda_blas(kvd_cuda_call *call, cublasHandle_t *h, kvd_error *err)
{
    kvd_cuda_slot *s = call->slot;
    *h = NULL;
    if (!s->blas) {
        int rc = kvd__cublas_status(call->c, kvd__blas.Create(&s->blas), "cublasCreate", err);
        if (rc) {
            s->blas = NULL;
            return rc;
        }
    }
    int rc = kvd__cublas_status(call->c, kvd__blas.SetStream(s->blas, s->stream), "cublasSetStream",
                                err);
    if (!rc)
        *h = s->blas;
    return rc;
}

int kvd__cuda_scratch(kvd_cuda_call *call, size_t bytes, void **p, kvd_error *err)
{
    *p = NULL;
    cudaError_t e = cudaMallocAsync(p, bytes ? bytes : 1, call->s);
    if (e != cudaSuccess) {
        *p = NULL;
        cudaGetLastError();
    }
    return kvd__cuda_status(call->c, e, "cudaMallocAsync", err);
}

void kvd__cuda_scratch_free(kvd_cuda_call *call, void *p)
{
    if (p)
        cudaFreeAsync(p, call->s);
}

int kvd__cuda_wait(kvd_cuda_call *call, const char *what, kvd_error *err)
{
    return kvd__cuda_status(call->c, cudaStreamSynchronize(call->s), what, err);
}

/* ---- creation ----------------------------------------------------------- */

extern "C" int kvd_backend_cuda_create(int device, kvd_backend **out, kvd_error *err)
{
    *out = NULL;
    int count = 0;
    cudaError_t e = cudaGetDeviceCount(&count);
    if (e != cudaSuccess || count == 0) {
        cudaGetLastError();
        return kvd_error_set(err, KVD_EUNAVAIL, "cuda: no device found (%s)",
                             e == cudaSuccess ? "0 devices" : cudaGetErrorString(e));
    }
    if (device < 0)
        device = 0;
    if (device >= count)
        return kvd_error_set(err, KVD_EINVAL, "cuda: device %d requested, %d present", device,
                             count);
    int lrc = kvd__cuda_blas_load(NULL, err);
    if (lrc)
        return lrc;

    kvd_cuda_ctx *c = static_cast<kvd_cuda_ctx *>(calloc(1, sizeof *c));
    kvd_backend *be = static_cast<kvd_backend *>(calloc(1, sizeof *be));
    if (!c || !be) {
        free(c);
        free(be);
        return kvd_error_set(err, KVD_ENOMEM, "cuda: out of host memory");
    }
    c->device = device;
    for (int i = 0; i < KVD_CUDA_SLOTS; i++)
        pthread_mutex_init(&c->slots[i].mu, NULL);
    pthread_mutex_init(&c->pinned_mu, NULL);
    be->iface = &cuda_iface;
    be->ctx = c;
    be->nthreads = 1;

    cudaDeviceProp prop;
    int rc = kvd__cuda_status(c, cudaSetDevice(device), "cudaSetDevice", err);
    if (!rc)
        rc = kvd__cuda_status(c, cudaGetDeviceProperties(&prop, device), "cudaGetDeviceProperties",
                              err);
    for (int i = 0; i < KVD_CUDA_SLOTS && !rc; i++)
        rc = kvd__cuda_status(c, cudaStreamCreateWithFlags(&c->slots[i].stream,
                                                           cudaStreamNonBlocking),
                              "cudaStreamCreate", err);
    if (rc) {
        cuda_free_backend(be);
        return rc;
    }
    /* Scratch comes from the device's default pool (cudaMallocAsync). With
     * its default release threshold of 0 the pool hands memory back to the
     * driver at every synchronisation, and the next op pays a fresh
     * allocation; keeping up to 512 MiB cached makes scratch a pointer bump. */
    cudaMemPool_t pool;
    if (cudaDeviceGetDefaultMemPool(&pool, device) == cudaSuccess) {
        uint64_t keep = 512ull << 20;
        cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep);
    }
    cudaGetLastError();
    strncpy(c->device_name, prop.name, sizeof c->device_name - 1);
    c->total_mem = prop.totalGlobalMem;
    c->sm_count = prop.multiProcessorCount;
    c->smem_optin = prop.sharedMemPerBlockOptin;
    /* Memory clock (kHz) and bus width are attributes (the cudaDeviceProp
     * fields are gone in CUDA 13). Peak = 2 transfers per clock (DDR). */
    int clk = 0, bus = 0;
    if (cudaDeviceGetAttribute(&clk, cudaDevAttrMemoryClockRate, device) == cudaSuccess &&
        cudaDeviceGetAttribute(&bus, cudaDevAttrGlobalMemoryBusWidth, device) == cudaSuccess)
        c->hbm_peak_gbs = 2.0 * clk * 1e3 * (bus / 8.0) / 1e9;
    cudaGetLastError();
    *out = be;
    return KVD_OK;
}

extern "C" const char *kvd_backend_cuda_device_name(const kvd_backend *be)
{
    return be && be->iface == &cuda_iface ? static_cast<kvd_cuda_ctx *>(be->ctx)->device_name
                                          : "";
}

/* Peak memory bandwidth in GB/s from the memory clock and bus width (0 when
 * the driver does not report them); for benchmarks. */
extern "C" double kvd_backend_cuda_hbm_peak_gbs(const kvd_backend *be)
{
    return be && be->iface == &cuda_iface ? static_cast<kvd_cuda_ctx *>(be->ctx)->hbm_peak_gbs
                                          : 0.0;
}
