/*
 * kvd_backend_cuda_create() for programs that do not link the CUDA backend
 * library (kvd_kernels_cuda). The symbol is weak so that, when that library
 * is linked, its definition wins and this one is dropped.
 */
#include "kvdepot/backend.h"

#ifndef KVD_HAVE_CUDA
__attribute__((weak)) int kvd_backend_cuda_create(int device, kvd_backend **out, kvd_error *err)
{
    (void)device;
    if (out)
        *out = NULL;
    return kvd_error_set(err, KVD_EUNSUPP,
                         "cuda backend not available: this program was built without CUDA");
}
#endif
