/*
 * CUDA backend plumbing: device discovery, memory round trip, error mapping.
 * Exits 77 (reported by ctest as skipped) when there is no GPU.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvdepot/backend.h"

#define CHECK(cond)                                                        \
    do {                                                                   \
        if (!(cond)) {                                                     \
            fprintf(stderr, "%s:%d: check failed: %s\n", __FILE__, __LINE__, #cond); \
            exit(1);                                                       \
        }                                                                  \
    } while (0)

int main(void)
{
    kvd_error err;
    kvd_error_clear(&err);
    kvd_backend *be = NULL;
    int rc = kvd_backend_cuda_create(-1, &be, &err);
#ifndef KVD_CUDA_EMU /* the emulated device is always there */
    if (rc == KVD_EUNAVAIL || rc == KVD_EUNSUPP) {
        CHECK(be == NULL);
        CHECK(err.msg[0] != '\0');
        printf("skipped: %s\n", err.msg);
        return 77;
    }
#endif
    CHECK(rc == KVD_OK && be != NULL);
    CHECK(strcmp(be->iface->name, "cuda") == 0);

    /* Asking for a device that does not exist is an argument error. */
    kvd_backend *none = NULL;
    CHECK(kvd_backend_cuda_create(1 << 20, &none, &err) == KVD_EINVAL && none == NULL);

    size_t n = 1 << 20;
    unsigned char *host = malloc(n), *back = malloc(n);
    CHECK(host && back);
    for (size_t i = 0; i < n; i++)
        host[i] = (unsigned char)(i * 131u + 7u);
    void *dev = NULL;
    CHECK(kvd_backend_alloc(be, n, &dev, &err) == KVD_OK && dev != NULL);
    CHECK(kvd_backend_upload(be, dev, host, n, &err) == KVD_OK);
    memset(back, 0, n);
    CHECK(kvd_backend_download(be, back, dev, n, &err) == KVD_OK);
    CHECK(memcmp(host, back, n) == 0);
    CHECK(kvd_backend_sync(be, &err) == KVD_OK);
    kvd_backend_dealloc(be, dev);

    /* An impossible allocation is RESOURCE_EXHAUSTED, not a crash. */
    void *huge = NULL;
    rc = kvd_backend_alloc(be, (size_t)1 << 62, &huge, &err);
    CHECK(rc == KVD_ENOMEM && huge == NULL);
    /* ...and does not make the device unusable. */
    CHECK(kvd_backend_alloc(be, 4096, &dev, &err) == KVD_OK);
    kvd_backend_dealloc(be, dev);

    kvd_backend_free(be);
    free(host);
    free(back);
    printf("1 passed, 0 failed\n");
    return 0;
}
