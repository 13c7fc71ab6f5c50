/*
 * Shared helpers for the kernel tests (tests/backend) and benchmarks:
 * a deterministic PRNG, generators of LLM-like K/V data, error metrics,
 * NaN/Inf parity, and output buffers with guard bytes.
 *
 * Link testutil.c into the test program (see tests/backend/kernels_core.cmake).
 */
#ifndef KVDEPOT_TESTUTIL_H
#define KVDEPOT_TESTUTIL_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "kvdepot/backend.h"
#include "kvdepot/tensor.h"

/* ---- checks: count failures, keep going, print a summary ---- */

extern int tu_failures;
extern int tu_checks;

#define TU_CHECK(cond, ...)                                                  \
    do {                                                                     \
        tu_checks++;                                                         \
        if (!(cond)) {                                                       \
            tu_failures++;                                                   \
            if (tu_failures <= 50) {                                         \
                fprintf(stderr, "%s:%d: FAILED %s: ", __FILE__, __LINE__, #cond); \
                fprintf(stderr, __VA_ARGS__);                                \
                fputc('\n', stderr);                                         \
            }                                                                \
        }                                                                    \
    } while (0)

/* Print "<checks> passed, <failures> failed" and return the exit status. */
int tu_report(const char *name);

/* ---- deterministic PRNG (splitmix64): same stream on every machine ---- */

typedef struct tu_rng {
    uint64_t s;
} tu_rng;

void tu_rng_seed(tu_rng *r, uint64_t seed);
uint64_t tu_rng_u64(tu_rng *r);
/* Uniform in [0, 1) with 24 random bits. */
float tu_rng_uniform(tu_rng *r);
/* Standard normal (Box-Muller). */
float tu_rng_normal(tu_rng *r);
/* Integer in [0, n). */
uint32_t tu_rng_below(tu_rng *r, uint32_t n);

/* ---- generators ---- */

/* x[i] = normal * sigma for n values. */
void tu_fill_normal(tu_rng *r, float *x, size_t n, float sigma);
/* x[i] uniform in [lo, hi). */
void tu_fill_uniform(tu_rng *r, float *x, size_t n, float lo, float hi);

/*
 * LLM-like K or V block (T, D) row-major f32, shaped like real caches:
 *  - every channel has its own bias and spread;
 *  - `n_outliers` channels (chosen by the rng) have values `outlier_mag`
 *    times larger (key caches have a few such channels);
 *  - each token has its own scale (log-normal, sigma `token_scale_sigma`);
 *  - with `rotary` set, pairs of channels (2i, 2i+1) carry a rotation by a
 *    position-dependent angle, as rotary embeddings produce.
 */
typedef struct tu_kv_opts {
    int n_outliers;          /* e.g. 4 */
    float outlier_mag;       /* e.g. 20 */
    float token_scale_sigma; /* e.g. 0.3 */
    int rotary;              /* 0 or 1 */
} tu_kv_opts;

void tu_gen_kv(tu_rng *r, float *x, int64_t T, int64_t D, const tu_kv_opts *opt);

/* Sprinkle `count` NaN/+Inf/-Inf (in turn) at random positions of x[0..n). */
void tu_inject_nonfinite(tu_rng *r, float *x, size_t n, size_t count);

/* ---- conversions of whole arrays (scalar, exact; for building inputs) ---- */

void tu_f32_to_f16(uint16_t *dst, const float *src, size_t n);
void tu_f16_to_f32(float *dst, const uint16_t *src, size_t n);
void tu_f32_to_bf16(uint16_t *dst, const float *src, size_t n);
void tu_bf16_to_f32(float *dst, const uint16_t *src, size_t n);

/* ---- metrics ---- */

/*
 * Normalised mean squared error sum((x - ref)^2) / sum(ref^2) over the
 * positions where both are finite (0 when ref is all zero and x equals it;
 * sum((x-ref)^2) itself when ref is all zero). Use tu_nonfinite_parity for
 * the other positions.
 */
double tu_nmse(const float *ref, const float *x, size_t n);

/* Max |x - ref| over positions where both are finite. */
double tu_max_abs_diff(const float *ref, const float *x, size_t n);

/*
 * NaN/Inf parity: returns -1 when, at every position, ref and x are both NaN,
 * both the same infinity, or both finite; otherwise the first bad index.
 */
long tu_nonfinite_parity(const float *ref, const float *x, size_t n);

/* ---- output buffers with guard bytes ---- */

/*
 * A heap buffer of `bytes` usable bytes between two guard zones of
 * TU_GUARD bytes filled with a known pattern. The usable bytes are filled
 * with a poison pattern (0xCD) so reads of unwritten output show up.
 * tu_guard_ok() tells whether both guards are intact: check it after every op
 * that wrote into the buffer.
 */
#define TU_GUARD 64

typedef struct tu_buf {
    void *data;   /* usable bytes, 64-byte aligned */
    size_t bytes;
    unsigned char *base;
} tu_buf;

tu_buf tu_buf_new(size_t bytes);
void tu_buf_free(tu_buf *b);
void tu_buf_poison(tu_buf *b);
int tu_guard_ok(const tu_buf *b);

/* ---- backends ---- */

/* CPU backend with the given thread count and force_ref; aborts on failure. */
kvd_backend *tu_cpu_backend(int nthreads, int force_ref);

/* Monotonic wall clock in seconds (benchmarks). */
double tu_now(void);

#endif /* KVDEPOT_TESTUTIL_H */
