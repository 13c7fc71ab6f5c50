/*
 * cuBLAS is loaded when a CUDA device is opened, never before: a process
 * that finds no GPU does not map it (its ~150 MiB). Runs on any machine
 * with the toolkit; with a GPU present the open itself loads it.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvdepot/backend.h"

int kvd__cuda_blas_load(const char **where, kvd_error *err);

#define CHECK(cond)                                                                                \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            fprintf(stderr, "%s:%d: check failed: %s\n", __FILE__, __LINE__, #cond);               \
            exit(1);                                                                               \
        }                                                                                          \
    } while (0)

/* Whether a library whose path contains `name` is mapped in this process. */
static int mapped(const char *name)
{
    FILE *f = fopen("/proc/self/maps", "r");
    CHECK(f != NULL);
    char line[4096];
    int found = 0;
    while (!found && fgets(line, sizeof line, f))
        found = strstr(line, name) != NULL;
    fclose(f);
    return found;
}

int main(void)
{
    kvd_error err;
    kvd_error_clear(&err);
    CHECK(!mapped("libcublas"));

    kvd_backend *be = NULL;
    int rc = kvd_backend_cuda_create(-1, &be, &err);
    if (rc == KVD_OK) {
        CHECK(mapped("libcublas.so"));
        kvd_backend_free(be);
    } else {
        /* No device (the usual case here): nothing of cuBLAS loaded. */
        CHECK(be == NULL && err.msg[0] != '\0');
        CHECK(!mapped("libcublas"));
        printf("no device (%s): cuBLAS not loaded\n", err.msg);
    }

    const char *where = NULL;
    rc = kvd__cuda_blas_load(&where, &err);
    if (rc != KVD_OK)
        fprintf(stderr, "%s\n", err.msg);
    CHECK(rc == KVD_OK && where != NULL && where[0] != '\0');
    CHECK(mapped("libcublas.so"));
    printf("cuBLAS loaded from %s\n", where);
    /* Once per process: a second call answers the same. */
    const char *again = NULL;
    CHECK(kvd__cuda_blas_load(&again, &err) == KVD_OK && again == where);
    return 0;
}
