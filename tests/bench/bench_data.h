/*
 * What the compute benchmarks (bench_compute, bench_attend_e2e) share: a
 * monotonic clock and the K/V data they store.
 */
#ifndef KVDEPOT_TESTS_BENCH_DATA_H
#define KVDEPOT_TESTS_BENCH_DATA_H

#include <stddef.h>
#include <stdint.h>
#include <time.h>

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

#endif /* KVDEPOT_TESTS_BENCH_DATA_H */
