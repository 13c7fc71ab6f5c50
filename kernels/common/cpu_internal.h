/*
 * Internal helpers shared by the CPU backend's op families (not installed).
 *
 * Every CPU op has a scalar reference and, where it pays, an AVX2/FMA/F16C
 * fast path compiled with __attribute__((target(...))) so the library stays
 * baseline x86-64. An op takes the fast path when kvd__cpu_fast(be) is true:
 * the CPU has the features and the backend was not created with force_ref.
 */
#ifndef KVDEPOT_CPU_INTERNAL_H
#define KVDEPOT_CPU_INTERNAL_H

#include <stdint.h>
#include <string.h>

#include "kvdepot/backend.h"
#include "kvdepot/tensor.h"

/* be->ctx of the CPU backend. */
typedef struct kvd__cpu_ctx {
    int force_ref; /* 1: every op runs its scalar reference */
    int fast;      /* 1: AVX2 + FMA + F16C present and force_ref == 0 */
} kvd__cpu_ctx;

/* 1 when `be` is a CPU backend whose ops should take their fast paths. */
static inline int kvd__cpu_fast(const kvd_backend *be)
{
    return be && be->ctx && ((const kvd__cpu_ctx *)be->ctx)->fast;
}

/* Threads a CPU op may use (>= 1). */
static inline int kvd__cpu_threads(const kvd_backend *be)
{
    return (be && be->nthreads > 0) ? be->nthreads : 1;
}

/* 1 when the CPU has AVX2, FMA and F16C (the fast paths use all three). */
int kvd__cpu_has_avx2_fma_f16c(void);

/* 1 when the CPU (and the OS) run AVX-512F. */
int kvd__cpu_has_avx512f(void);

/* 1 when the CPU (and the OS) have every feature of the mask (read once). */
enum {
    KVD__CPU_AVX512F = 1,
    KVD__CPU_AVX512BW = 2,
    KVD__CPU_AVX512VL = 4,
    KVD__CPU_AVX512VBMI = 8,
    KVD__CPU_AVX512VNNI = 16,
    KVD__CPU_BMI2 = 32
};
int kvd__cpu_has(int features);

/* fn(arg, i) for every i in [0, n), on the calling thread and on up to
 * threads - 1 idle threads of the process's compute pool (par.c), in no
 * particular order; returns once all are done. The caller takes every item
 * no helper has taken, so a helper that is not running costs nothing;
 * except for a task ranked long while others compute: its items run on up
 * to `threads` background helpers of lower priority, the caller waiting. */
typedef void (*kvd__par_fn)(void *arg, int i);
void kvd__par_for(int n, int threads, kvd__par_fn fn, void *arg);
/* fn(arg, lo, hi) over [0, n) cut into ranges of at least grain (about four
 * per thread, for balance) through kvd__par_for: one range, [0, n), with a
 * single thread. */
typedef void (*kvd__par_range_fn)(void *arg, int64_t lo, int64_t hi);
void kvd__par_ranges(int64_t n, int64_t grain, int threads, kvd__par_range_fn fn, void *arg);
/* A CPU backend of `threads` threads exists: the pool may hold threads - 1
 * helpers, and `slots` threads (at least `threads`) may compute at once,
 * callers and helpers together (the largest asked of each). */
void kvd__par_size(int threads, int slots);
/* Background helpers under SCHED_IDLE (0 or KVD_CPU_BACKGROUND_IDLE, the
 * default), this much nicer than the process (1..19), or none (< 0): a long
 * task then computes on its own thread as any other. Helpers apply it at
 * their next job; leaving SCHED_IDLE or a nice value for a higher priority
 * needs the privilege to, so without it set it before the first job. */
void kvd__par_background_nice(int nice);
/* How long (ns) a lane that went off for starving stays off before it is
 * tried again, the first time (30 s by default, for tests; 0: the
 * default); kvd__par_background_nice sets it back. */
void kvd__par_background_retry(int64_t ns);
/* Helpers started so far (on first use), 0 when none. */
int kvd__par_pool_threads(void);

/* Read / write one float element of dtype f32, f16 or bf16. */
static inline float kvd__load_float(const void *p, kvd_dtype t)
{
    uint16_t h;
    float f;
    switch (t) {
    case KVD_DTYPE_F16:
        memcpy(&h, p, 2);
        return kvd_f16_to_f32(h);
    case KVD_DTYPE_BF16:
        memcpy(&h, p, 2);
        return kvd_bf16_to_f32(h);
    default:
        memcpy(&f, p, 4);
        return f;
    }
}

static inline void kvd__store_float(void *p, kvd_dtype t, float v)
{
    uint16_t h;
    switch (t) {
    case KVD_DTYPE_F16:
        h = kvd_f32_to_f16(v);
        memcpy(p, &h, 2);
        break;
    case KVD_DTYPE_BF16:
        h = kvd_f32_to_bf16(v);
        memcpy(p, &h, 2);
        break;
    default:
        memcpy(p, &v, 4);
        break;
    }
}

/* Address of element (i0, i1, ...) of a tensor: data + sum(idx[k] * stride[k]). */
static inline char *kvd__elem_ptr(const kvd_tensor *t, const int64_t *idx)
{
    char *p = (char *)t->data;
    for (int k = 0; k < t->ndim; k++)
        p += idx[k] * t->stride[k];
    return p;
}

#endif /* KVDEPOT_CPU_INTERNAL_H */
