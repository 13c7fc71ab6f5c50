/*
 * What the compute benchmarks (bench_compute, bench_attend_e2e,
 * bench_attend_load) share: a monotonic clock, the K/V data they store, the
 * sequences they store it in, and the Calibrate of their model.
 */
#ifndef KVDEPOT_TESTS_BENCH_DATA_H
#define KVDEPOT_TESTS_BENCH_DATA_H

#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kvdepot.h"
#include "kvdepot/tensor.h"

static inline double bench_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* n f16 values, roughly normal (sum of two uniforms, std ~0.6), from seed. */
static inline void bench_fill_f16(uint16_t *x, size_t n, uint64_t seed)
{
    uint64_t s = seed * 0x9e3779b97f4a7c15ull + 1;
    for (size_t i = 0; i < n; i++) {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        float a = (float)((s >> 40) & 0xffffff) / (float)(1 << 24);
        float b = (float)((s >> 16) & 0xffffff) / (float)(1 << 24);
        x[i] = kvd_f32_to_f16((a + b - 1.0f) * 1.5f);
    }
}

/* Sequence id of model `model` (one layer of h kv heads x d, f16) with
 * codecs cs (NULL: raw): n tokens of bench_fill_f16 data, appended `chunk`
 * tokens at a time (n a multiple of chunk). 0 or the client's error. */
static inline int bench_make_seq(kvdepot_client *c, const char *model, const char *id, uint64_t n,
                                 uint64_t chunk, int h, int d, const kvdepot_codecs *cs)
{
    kvdepot_create_args ca;
    memset(&ca, 0, sizeof ca);
    ca.id = id;
    ca.id_len = strlen(id);
    ca.model = model;
    ca.codecs = cs;
    int rc = kvdepot_sequence_create(c, &ca, NULL);
    size_t cnt = (size_t)chunk * h * d;
    uint16_t *k = malloc(cnt * 2), *v = malloc(cnt * 2);
    if (!k || !v)
        rc = KVDEPOT_ENOMEM;
    for (uint64_t t = 0; rc == 0 && t < n; t += chunk) {
        bench_fill_f16(k, cnt, 2 * t + 1);
        bench_fill_f16(v, cnt, 2 * t + 2);
        kvdepot_append_args aa;
        memset(&aa, 0, sizeof aa);
        aa.id = id;
        aa.id_len = strlen(id);
        aa.token_start = t;
        aa.num_tokens = chunk;
        aa.dtype = KVDEPOT_DTYPE_F16;
        aa.k = k;
        aa.v = v;
        aa.k_bytes = aa.v_bytes = cnt * 2;
        rc = kvdepot_sequence_append(c, &aa, NULL);
    }
    free(k);
    free(v);
    return rc;
}

/* Calibrate VQ d4 b8 (and SVD when svd) for a one-layer model of h kv
 * heads x d dims on 1024 tokens of bench_fill_f16 data (one Calibrate
 * message stays under 8 MiB). Returns the kvdepot status. */
static inline int bench_calibrate(kvdepot_client *c, const char *model, int h, int d, int svd)
{
    const uint64_t ns = 1024;
    size_t cnt = (size_t)ns * (size_t)h * (size_t)d;
    uint16_t *k = malloc(cnt * 2), *v = malloc(cnt * 2);
    if (!k || !v) {
        free(k);
        free(v);
        return KVDEPOT_ENOMEM;
    }
    bench_fill_f16(k, cnt, 101);
    bench_fill_f16(v, cnt, 102);
    kvdepot_calibrate_sample smp;
    memset(&smp, 0, sizeof smp);
    smp.num_tokens = ns;
    smp.k = k;
    smp.v = v;
    smp.kv_bytes = cnt * 2;
    kvdepot_calibrate_args ca;
    memset(&ca, 0, sizeof ca);
    ca.model = model;
    ca.vq_sub_dim = 4;
    ca.vq_bits = 8;
    ca.svd = svd;
    ca.iterations = 4;
    int rc = kvdepot_calibrate(c, &ca, &smp, 1, NULL);
    free(k);
    free(v);
    return rc;
}

#endif /* KVDEPOT_TESTS_BENCH_DATA_H */
