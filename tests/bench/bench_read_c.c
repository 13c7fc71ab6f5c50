/*
 * bench_read_c: the C client's Read throughput, for bench_python_read.py to
 * compare the Python package with in the same run. Reads sequence ID of a
 * running kvdepotd REPS times, into the library's buffer and into the
 * caller's, and prints the median seconds of each as JSON.
 *
 *   bench_read_c ADDR ID REPS
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kvdepot.h"

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static int cmp(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

int main(int argc, char **argv)
{
    if (argc != 4) {
        fprintf(stderr, "usage: bench_read_c ADDR ID REPS\n");
        return 2;
    }
    int reps = atoi(argv[3]);
    if (reps < 1 || reps > 1000)
        return 2;
    kvdepot_options o;
    kvdepot_options_init(&o);
    o.address = argv[1];
    kvdepot_client *c;
    if (kvdepot_connect(&o, &c) != KVDEPOT_OK) {
        fprintf(stderr, "connect: %s\n", kvdepot_errmsg(NULL));
        return 1;
    }
    double *t[2] = {calloc(reps, sizeof(double)), calloc(reps, sizeof(double))};
    size_t bytes = 0;
    void *kb = NULL, *vb = NULL;
    for (int mode = 0; mode < 2; mode++)
        for (int r = 0; r < reps; r++) {
            kvdepot_read_args a = {.id = argv[2], .id_len = strlen(argv[2])};
            if (mode == 1) {
                a.k = kb, a.v = vb, a.capacity = bytes;
            }
            kvdepot_read_result res;
            double t0 = now_s();
            if (kvdepot_sequence_read(c, &a, &res) != KVDEPOT_OK) {
                fprintf(stderr, "read: %s\n", kvdepot_errmsg(c));
                return 1;
            }
            t[mode][r] = now_s() - t0;
            bytes = res.kv_bytes;
            kvdepot_free(res.owned);
            if (!kb) {
                kb = malloc(bytes);
                vb = malloc(bytes);
                memset(kb, 1, bytes), memset(vb, 1, bytes); /* fault the pages in */
            }
        }
    qsort(t[0], reps, sizeof(double), cmp);
    qsort(t[1], reps, sizeof(double), cmp);
    printf("{\"bytes\": %zu, \"library_buffer_s\": %.6f, \"caller_buffer_s\": %.6f}\n", 2 * bytes,
           t[0][reps / 2], t[1][reps / 2]);
    kvdepot_close(c);
    return 0;
}
