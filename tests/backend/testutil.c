#include "testutil.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

int tu_failures = 0;
int tu_checks = 0;

int tu_report(const char *name)
{
    printf("%s: %d passed, %d failed\n", name, tu_checks - tu_failures, tu_failures);
    return tu_failures ? 1 : 0;
}

void tu_rng_seed(tu_rng *r, uint64_t seed) { r->s = seed ^ 0x5DEECE66Dull; }

uint64_t tu_rng_u64(tu_rng *r)
{
    uint64_t z = (r->s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

float tu_rng_uniform(tu_rng *r) { return (float)(tu_rng_u64(r) >> 40) * (1.0f / 16777216.0f); }

float tu_rng_normal(tu_rng *r)
{
    /* Box-Muller on (0, 1]: 1 - u avoids log(0). */
    double u1 = 1.0 - (double)(tu_rng_u64(r) >> 11) * (1.0 / 9007199254740992.0);
    double u2 = (double)(tu_rng_u64(r) >> 11) * (1.0 / 9007199254740992.0);
    return (float)(sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2));
}

uint32_t tu_rng_below(tu_rng *r, uint32_t n) { return n ? (uint32_t)(tu_rng_u64(r) % n) : 0; }

void tu_fill_normal(tu_rng *r, float *x, size_t n, float sigma)
{
    for (size_t i = 0; i < n; i++)
        x[i] = tu_rng_normal(r) * sigma;
}

void tu_fill_uniform(tu_rng *r, float *x, size_t n, float lo, float hi)
{
    for (size_t i = 0; i < n; i++)
        x[i] = lo + (hi - lo) * tu_rng_uniform(r);
}

void tu_gen_kv(tu_rng *r, float *x, int64_t T, int64_t D, const tu_kv_opts *opt)
{
    tu_kv_opts def = {4, 20.0f, 0.3f, 0};
    if (!opt)
        opt = &def;
    if (T <= 0 || D <= 0)
        return;
    float *bias = malloc((size_t)D * sizeof *bias);
    float *spread = malloc((size_t)D * sizeof *spread);
    if (!bias || !spread)
        abort();
    for (int64_t d = 0; d < D; d++) {
        bias[d] = 0.5f * tu_rng_normal(r);
        spread[d] = 0.5f + tu_rng_uniform(r);
    }
    for (int i = 0; i < opt->n_outliers && D > 0; i++) {
        int64_t d = tu_rng_below(r, (uint32_t)D);
        spread[d] *= opt->outlier_mag;
        bias[d] *= opt->outlier_mag;
    }
    for (int64_t t = 0; t < T; t++) {
        float ts = expf(opt->token_scale_sigma * tu_rng_normal(r));
        float *row = x + t * D;
        for (int64_t d = 0; d < D; d++)
            row[d] = ts * (bias[d] + spread[d] * tu_rng_normal(r));
        if (opt->rotary) {
            for (int64_t d = 0; d + 1 < D; d += 2) {
                /* theta_i = t / 10000^(2i/D), as rotary embeddings use */
                double th = (double)t * pow(10000.0, -(double)d / (double)D);
                float c = (float)cos(th), s = (float)sin(th);
                float a = row[d], b = row[d + 1];
                row[d] = a * c - b * s;
                row[d + 1] = a * s + b * c;
            }
        }
    }
    free(bias);
    free(spread);
}

void tu_inject_nonfinite(tu_rng *r, float *x, size_t n, size_t count)
{
    if (!n)
        return;
    for (size_t i = 0; i < count; i++) {
        size_t at = (size_t)(tu_rng_u64(r) % n);
        x[at] = (i % 3 == 0) ? NAN : (i % 3 == 1) ? INFINITY : -INFINITY;
    }
}

void tu_f32_to_f16(uint16_t *dst, const float *src, size_t n)
{
    for (size_t i = 0; i < n; i++)
        dst[i] = kvd_f32_to_f16(src[i]);
}

void tu_f16_to_f32(float *dst, const uint16_t *src, size_t n)
{
    for (size_t i = 0; i < n; i++)
        dst[i] = kvd_f16_to_f32(src[i]);
}

void tu_f32_to_bf16(uint16_t *dst, const float *src, size_t n)
{
    for (size_t i = 0; i < n; i++)
        dst[i] = kvd_f32_to_bf16(src[i]);
}

void tu_bf16_to_f32(float *dst, const uint16_t *src, size_t n)
{
    for (size_t i = 0; i < n; i++)
        dst[i] = kvd_bf16_to_f32(src[i]);
}

double tu_nmse(const float *ref, const float *x, size_t n)
{
    double num = 0, den = 0;
    for (size_t i = 0; i < n; i++) {
        if (!isfinite(ref[i]) || !isfinite(x[i]))
            continue;
        double d = (double)x[i] - (double)ref[i];
        num += d * d;
        den += (double)ref[i] * (double)ref[i];
    }
    return den > 0 ? num / den : num;
}

double tu_max_abs_diff(const float *ref, const float *x, size_t n)
{
    double m = 0;
    for (size_t i = 0; i < n; i++) {
        if (!isfinite(ref[i]) || !isfinite(x[i]))
            continue;
        double d = fabs((double)x[i] - (double)ref[i]);
        if (d > m)
            m = d;
    }
    return m;
}

long tu_nonfinite_parity(const float *ref, const float *x, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        float a = ref[i], b = x[i];
        if (isnan(a) || isnan(b)) {
            if (!(isnan(a) && isnan(b)))
                return (long)i;
        } else if (isinf(a) || isinf(b)) {
            if (a != b)
                return (long)i;
        }
    }
    return -1;
}

static const unsigned char guard_byte = 0xA7;

tu_buf tu_buf_new(size_t bytes)
{
    tu_buf b;
    /* 64-byte alignment of data: guard zones are 64 bytes. */
    size_t total = bytes + 2 * TU_GUARD;
    total = (total + 63) & ~(size_t)63;
    void *p = NULL;
    if (posix_memalign(&p, 64, total) != 0)
        abort();
    b.base = p;
    b.data = b.base + TU_GUARD;
    b.bytes = bytes;
    memset(b.base, guard_byte, TU_GUARD);
    memset(b.base + TU_GUARD + bytes, guard_byte, TU_GUARD);
    memset(b.data, 0xCD, bytes);
    return b;
}

void tu_buf_free(tu_buf *b)
{
    free(b->base);
    b->base = NULL;
    b->data = NULL;
    b->bytes = 0;
}

void tu_buf_poison(tu_buf *b) { memset(b->data, 0xCD, b->bytes); }

int tu_guard_ok(const tu_buf *b)
{
    for (size_t i = 0; i < TU_GUARD; i++)
        if (b->base[i] != guard_byte || b->base[TU_GUARD + b->bytes + i] != guard_byte)
            return 0;
    return 1;
}

kvd_backend *tu_cpu_backend(int nthreads, int force_ref)
{
    kvd_cpu_options o = {nthreads, force_ref, 0, 0};
    kvd_backend *be = NULL;
    kvd_error err;
    if (kvd_backend_cpu_create(&o, &be, &err) != KVD_OK) {
        fprintf(stderr, "cannot create cpu backend: %s\n", err.msg);
        abort();
    }
    return be;
}

double tu_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}
