/*
 * CUDA backend: device selection, device memory, a stream, pinned staging.
 *
 * Every CUDA error becomes a kvd status with a message; nothing aborts the
 * process. An error that leaves the context unusable (a "sticky" error such
 * as an illegal address) marks the backend unhealthy: every later call fails
 * with KVD_EUNAVAIL so the service can fall back or restart cleanly.
 *
 * Op families are plugged in as they are ported; until then the family
 * pointers are NULL and the checked wrappers answer KVD_EUNSUPP.
 */
#include <cuda_runtime.h>

#include <stdlib.h>
#include <string.h>

extern "C" {
#include "kvdepot/backend.h"
}

namespace {

struct cuda_ctx {
    int device;
    cudaStream_t stream;
    int unhealthy; /* set by a sticky error */
    char device_name[256];
    size_t total_mem;
};

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
        return 1;
    default:
        return 0;
    }
}

int cuda_status(cuda_ctx *c, cudaError_t e, const char *what, kvd_error *err)
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

int check_healthy(cuda_ctx *c, kvd_error *err)
{
    if (c->unhealthy)
        return kvd_error_set(err, KVD_EUNAVAIL, "cuda: device %d is unhealthy after an earlier error",
                             c->device);
    return KVD_OK;
}

cuda_ctx *ctx_of(kvd_backend *be) { return static_cast<cuda_ctx *>(be->ctx); }

void cuda_free_backend(kvd_backend *be)
{
    cuda_ctx *c = ctx_of(be);
    if (c) {
        cudaSetDevice(c->device);
        if (c->stream)
            cudaStreamDestroy(c->stream);
        free(c);
    }
    free(be);
}

int cuda_alloc(kvd_backend *be, size_t bytes, void **out, kvd_error *err)
{
    cuda_ctx *c = ctx_of(be);
    *out = NULL;
    int rc = check_healthy(c, err);
    if (rc)
        return rc;
    cudaSetDevice(c->device);
    return cuda_status(c, cudaMalloc(out, bytes ? bytes : 1), "cudaMalloc", err);
}

void cuda_dealloc(kvd_backend *be, void *ptr)
{
    if (ptr) {
        cudaSetDevice(ctx_of(be)->device);
        cudaFree(ptr);
    }
}

int cuda_copy(kvd_backend *be, void *dst, const void *src, size_t bytes, cudaMemcpyKind kind,
              kvd_error *err)
{
    cuda_ctx *c = ctx_of(be);
    int rc = check_healthy(c, err);
    if (rc)
        return rc;
    cudaSetDevice(c->device);
    rc = cuda_status(c, cudaMemcpyAsync(dst, src, bytes, kind, c->stream), "cudaMemcpyAsync", err);
    if (rc)
        return rc;
    /* Copies are synchronous for the caller: host buffers may be reused at once. */
    return cuda_status(c, cudaStreamSynchronize(c->stream), "cudaStreamSynchronize", err);
}

int cuda_upload(kvd_backend *be, void *dst, const void *host_src, size_t bytes, kvd_error *err)
{
    return cuda_copy(be, dst, host_src, bytes, cudaMemcpyHostToDevice, err);
}

int cuda_download(kvd_backend *be, void *host_dst, const void *src, size_t bytes, kvd_error *err)
{
    return cuda_copy(be, host_dst, src, bytes, cudaMemcpyDeviceToHost, err);
}

int cuda_sync(kvd_backend *be, kvd_error *err)
{
    cuda_ctx *c = ctx_of(be);
    int rc = check_healthy(c, err);
    if (rc)
        return rc;
    cudaSetDevice(c->device);
    return cuda_status(c, cudaStreamSynchronize(c->stream), "cudaStreamSynchronize", err);
}

const kvd_backend_iface cuda_iface = {
    "cuda",         cuda_free_backend, cuda_alloc, cuda_dealloc, cuda_upload, cuda_download,
    cuda_sync,      NULL,              NULL,       NULL,         NULL,        NULL,
    NULL,           NULL,
};

} /* namespace */

extern "C" int kvd_backend_cuda_create(int device, kvd_backend **out, kvd_error *err)
{
    *out = NULL;
    int count = 0;
    cudaError_t e = cudaGetDeviceCount(&count);
    if (e != cudaSuccess || count == 0)
        return kvd_error_set(err, KVD_EUNAVAIL, "cuda: no device found (%s)",
                             e == cudaSuccess ? "0 devices" : cudaGetErrorString(e));
    if (device < 0)
        device = 0;
    if (device >= count)
        return kvd_error_set(err, KVD_EINVAL, "cuda: device %d requested, %d present", device,
                             count);

    cuda_ctx *c = static_cast<cuda_ctx *>(calloc(1, sizeof *c));
    kvd_backend *be = static_cast<kvd_backend *>(calloc(1, sizeof *be));
    if (!c || !be) {
        free(c);
        free(be);
        return kvd_error_set(err, KVD_ENOMEM, "cuda: out of host memory");
    }
    c->device = device;
    be->iface = &cuda_iface;
    be->ctx = c;
    be->nthreads = 1;

    cudaDeviceProp prop;
    int rc = cuda_status(c, cudaSetDevice(device), "cudaSetDevice", err);
    if (!rc)
        rc = cuda_status(c, cudaGetDeviceProperties(&prop, device), "cudaGetDeviceProperties", err);
    if (!rc)
        rc = cuda_status(c, cudaStreamCreateWithFlags(&c->stream, cudaStreamNonBlocking),
                         "cudaStreamCreate", err);
    if (rc) {
        cuda_free_backend(be);
        return rc;
    }
    strncpy(c->device_name, prop.name, sizeof c->device_name - 1);
    c->total_mem = prop.totalGlobalMem;
    *out = be;
    return KVD_OK;
}

extern "C" const char *kvd_backend_cuda_device_name(const kvd_backend *be)
{
    return be && be->iface == &cuda_iface ? static_cast<cuda_ctx *>(be->ctx)->device_name : "";
}
