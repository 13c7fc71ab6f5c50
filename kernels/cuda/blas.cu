/*
 * cuBLAS, loaded when a device is opened.
 *
 * cuBLAS is large: mapped into a process it costs about 150 MiB of memory
 * (84 MiB of its own zero-initialised data resident at load, plus its
 * code and cuBLASLt's), whether or not a GPU is ever used. A kvdepotd built
 * with CUDA on a machine without a GPU must not pay for it, so the backend
 * does not link cuBLAS: kvd_backend_cuda_create() loads it with dlopen once
 * a device has been found, and the ops call it through kvd__blas.
 *
 * The library is looked up by its soname (libcublas.so.<major> of the
 * headers built against: the dynamic linker's search path, as a linked
 * library would be), then in the toolkit's library directory found at
 * build time. Without it the device cannot be used (K-means runs on cuBLAS):
 * the backend is unavailable, with the loader's message. Under the CPU emulation of CUDA the table
 * points at the emulated functions.
 */
#include <dlfcn.h>
#include <stdio.h>
#include <string.h>

#include "cuda_internal.h"

kvd__blas_api kvd__blas;

namespace
{

pthread_once_t g_once = PTHREAD_ONCE_INIT;
int g_rc = KVD_OK;
char g_msg[512];
char g_path[256];

#define KVD__STR2(x) #x
#define KVD__STR(x) KVD__STR2(x)

#ifdef KVD_CUDA_EMU_H

void load(void)
{
    kvd__blas.Create = &cublasCreate;
    kvd__blas.Destroy = &cublasDestroy;
    kvd__blas.SetStream = &cublasSetStream;
    kvd__blas.GetStatusString = &cublasGetStatusString;
    kvd__blas.Sgemm = &cublasSgemm;
    kvd__blas.SgemmStridedBatched = &cublasSgemmStridedBatched;
    snprintf(g_path, sizeof g_path, "(emulated)");
}

#else

#define KVD__SONAME "libcublas.so." KVD__STR(CUBLAS_VER_MAJOR)

void *open_lib(void)
{
    void *h = dlopen(KVD__SONAME, RTLD_NOW | RTLD_LOCAL);
    if (h) {
        snprintf(g_path, sizeof g_path, "%s", KVD__SONAME);
        return h;
    }
    const char *first = dlerror();
    snprintf(g_msg, sizeof g_msg, "%s", first ? first : KVD__SONAME ": not found");
#ifdef KVD_CUBLAS_DIR
    snprintf(g_path, sizeof g_path, "%s/%s", KVD_CUBLAS_DIR, KVD__SONAME);
    h = dlopen(g_path, RTLD_NOW | RTLD_LOCAL);
    if (h)
        return h;
#endif
    g_path[0] = '\0';
    return NULL;
}

/* Resolve one symbol by the name the headers map the call to (cublasCreate
 * is cublasCreate_v2, and so on). */
template <typename F> int sym(void *h, F *slot, const char *name)
{
    *slot = reinterpret_cast<F>(dlsym(h, name));
    if (*slot)
        return 0;
    snprintf(g_msg, sizeof g_msg, "%s has no %s", g_path, name);
    return -1;
}

void load(void)
{
    void *h = open_lib();
    if (!h) {
        g_rc = KVD_EUNAVAIL;
        return;
    }
    if (sym(h, &kvd__blas.Create, KVD__STR(cublasCreate)) ||
        sym(h, &kvd__blas.Destroy, KVD__STR(cublasDestroy)) ||
        sym(h, &kvd__blas.SetStream, KVD__STR(cublasSetStream)) ||
        sym(h, &kvd__blas.GetStatusString, KVD__STR(cublasGetStatusString)) ||
        sym(h, &kvd__blas.Sgemm, KVD__STR(cublasSgemm)) ||
        sym(h, &kvd__blas.SgemmStridedBatched, KVD__STR(cublasSgemmStridedBatched))) {
        memset(&kvd__blas, 0, sizeof kvd__blas);
        dlclose(h);
        g_rc = KVD_EUNAVAIL;
        return;
    }
    /* Never closed: handles created from it live as long as the backends. */
}

#endif

} // namespace

extern "C" int kvd__cuda_blas_load(const char **where, kvd_error *err)
{
    pthread_once(&g_once, load);
    if (where)
        *where = g_rc ? NULL : g_path;
    if (g_rc)
        return kvd_error_set(err, g_rc,
                             "cuda: cannot load cuBLAS (%s); it comes with the CUDA toolkit "
                             "or the CUDA runtime image: put its directory on the library path",
                             g_msg);
    return KVD_OK;
}
