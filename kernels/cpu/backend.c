/*
 * The CPU backend: host memory, synchronous ops, the process's compute pool.
 *
 * Threads: an op uses up to be->nthreads threads of the pool (par.c: its
 * caller and idle helpers, never waiting for one that has not started), and
 * only for inputs big enough to repay the hand-off (see each family). An
 * attention call of at least as many items as threads (a sequence's pages)
 * runs its items side by side, one thread each (attention.c).
 *
 * Op families plug in by defining their table (kvd__cpu_<family>_ops) in
 * kernels/cpu/<family>.c, next to that family's checked wrappers. The
 * references below are strong on purpose: they make every program that
 * creates a CPU backend link every family, so an op table can never be
 * silently NULL because the static-archive linker skipped its object file
 * (a weak reference would not pull it in). A family that is not written yet
 * declares its table as a NULL-member table rather than leaving it out.
 */
#include <sched.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/cpu_internal.h"
#include "kvdepot/backend.h"

extern const struct kvd_convert_ops kvd__cpu_convert_ops;
extern const struct kvd_quant_ops kvd__cpu_quant_ops;
extern const struct kvd_kmeans_ops kvd__cpu_kmeans_ops;
extern const struct kvd_vq_ops kvd__cpu_vq_ops;
extern const struct kvd_pq_ops kvd__cpu_pq_ops;
extern const struct kvd_svd_ops kvd__cpu_svd_ops;
extern const struct kvd_attn_ops kvd__cpu_attn_ops;

/* Alignment of kvd_backend_alloc on the CPU: a cache line, which also suits
 * every vector load the fast paths issue. */
#define KVD_CPU_ALIGN 64

int kvd_cpu_has_avx2_fma(void)
{
    static int cached = -1;
    int v = __atomic_load_n(&cached, __ATOMIC_RELAXED);
    if (v < 0) {
        __builtin_cpu_init();
        v = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
        __atomic_store_n(&cached, v, __ATOMIC_RELAXED);
    }
    return v;
}

int kvd__cpu_has(int features)
{
    static int cached = -1;
    int v = __atomic_load_n(&cached, __ATOMIC_RELAXED);
    if (v < 0) {
        __builtin_cpu_init();
        v = (__builtin_cpu_supports("avx512f") ? KVD__CPU_AVX512F : 0) |
            (__builtin_cpu_supports("avx512bw") ? KVD__CPU_AVX512BW : 0) |
            (__builtin_cpu_supports("avx512vl") ? KVD__CPU_AVX512VL : 0) |
            (__builtin_cpu_supports("avx512vbmi") ? KVD__CPU_AVX512VBMI : 0) |
            (__builtin_cpu_supports("avx512vnni") ? KVD__CPU_AVX512VNNI : 0) |
            (__builtin_cpu_supports("bmi2") ? KVD__CPU_BMI2 : 0);
        __atomic_store_n(&cached, v, __ATOMIC_RELAXED);
    }
    return (v & features) == features;
}

int kvd__cpu_has_avx512f(void)
{
    return kvd__cpu_has(KVD__CPU_AVX512F);
}

int kvd__cpu_has_avx2_fma_f16c(void)
{
    static int cached = -1;
    int v = __atomic_load_n(&cached, __ATOMIC_RELAXED);
    if (v < 0) {
        /* __builtin_cpu_supports has no "f16c" on every compiler we build
         * with, so read CPUID leaf 1, ECX bit 29, directly. */
        unsigned a, b, c, d;
        __asm__ volatile("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(1), "c"(0));
        v = kvd_cpu_has_avx2_fma() && ((c >> 29) & 1u);
        __atomic_store_n(&cached, v, __ATOMIC_RELAXED);
    }
    return v;
}

static void cpu_free(kvd_backend *be)
{
    free(be->ctx);
    free(be);
}

static int cpu_alloc(kvd_backend *be, size_t bytes, void **out, kvd_error *err)
{
    (void)be;
    *out = NULL;
    /* aligned_alloc wants a multiple of the alignment; also never ask for 0. */
    size_t rounded = (bytes + KVD_CPU_ALIGN - 1) & ~(size_t)(KVD_CPU_ALIGN - 1);
    /* Beyond 2^48 bytes no host can answer; refuse without asking the
     * allocator (which may abort instead of failing under sanitizers). */
    if (rounded < bytes || bytes > ((size_t)1 << 48))
        return kvd_error_set(err, KVD_ENOMEM, "cpu: cannot allocate %zu bytes", bytes);
    if (rounded == 0)
        rounded = KVD_CPU_ALIGN;
    void *p = NULL;
    if (posix_memalign(&p, KVD_CPU_ALIGN, rounded) != 0 || !p)
        return kvd_error_set(err, KVD_ENOMEM, "cpu: cannot allocate %zu bytes", bytes);
    *out = p;
    return KVD_OK;
}

static void cpu_dealloc(kvd_backend *be, void *ptr)
{
    (void)be;
    free(ptr);
}

static int cpu_copy(kvd_backend *be, void *dst, const void *src, size_t bytes, kvd_error *err)
{
    (void)be;
    if (bytes && (!dst || !src))
        return kvd_error_set(err, KVD_EINVAL, "cpu: copy of %zu bytes with a NULL pointer", bytes);
    if (bytes)
        memmove(dst, src, bytes);
    return KVD_OK;
}

static int cpu_sync(kvd_backend *be, kvd_error *err)
{
    (void)be;
    (void)err;
    return KVD_OK; /* every CPU op has finished when it returns */
}

static const kvd_backend_iface cpu_iface = {
    .name = "cpu",
    .free = cpu_free,
    .alloc = cpu_alloc,
    .dealloc = cpu_dealloc,
    .upload = cpu_copy,
    .download = cpu_copy,
    .sync = cpu_sync,
    .convert = &kvd__cpu_convert_ops,
    .quant = &kvd__cpu_quant_ops,
    .kmeans = &kvd__cpu_kmeans_ops,
    .vq = &kvd__cpu_vq_ops,
    .pq = &kvd__cpu_pq_ops,
    .svd = &kvd__cpu_svd_ops,
    .attn = &kvd__cpu_attn_ops,
};

/* CPUs this process may run on (cpusets of containers included), falling
 * back to the online count. */
static int cpus_allowed(void)
{
    cpu_set_t set;
    CPU_ZERO(&set);
    if (sched_getaffinity(0, sizeof set, &set) == 0 && CPU_COUNT(&set) > 0)
        return CPU_COUNT(&set);
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n > 0 ? (int)n : 1;
}

int kvd_backend_cpu_create(const kvd_cpu_options *opt, kvd_backend **out, kvd_error *err)
{
    if (!out)
        return kvd_error_set(err, KVD_EINVAL, "cpu: out is NULL");
    *out = NULL;
    int nthreads = opt ? opt->nthreads : 0;
    if (nthreads < 0)
        return kvd_error_set(err, KVD_EINVAL, "cpu: nthreads must be >= 0 (0 = all CPUs), got %d",
                             nthreads);
    const int nslots = opt ? opt->slots : 0;
    if (nslots < 0)
        return kvd_error_set(err, KVD_EINVAL, "cpu: slots must be >= 0 (0 = all CPUs), got %d",
                             nslots);
    const int bg_nice = opt ? opt->background_nice : 0;
    if (bg_nice < -1 || bg_nice > KVD_CPU_BACKGROUND_IDLE)
        return kvd_error_set(err, KVD_EINVAL,
                             "cpu: background_nice must be -1 (never), 0 (as set before), 1..19 "
                             "(a nice value) or %d (SCHED_IDLE), got %d",
                             KVD_CPU_BACKGROUND_IDLE, bg_nice);
    const int ncpu = cpus_allowed();
    if (nthreads == 0)
        nthreads = ncpu;
    kvd_backend *be = calloc(1, sizeof *be);
    kvd__cpu_ctx *ctx = calloc(1, sizeof *ctx);
    if (!be || !ctx) {
        free(be);
        free(ctx);
        return kvd_error_set(err, KVD_ENOMEM, "cpu: out of memory creating the backend");
    }
    ctx->force_ref = opt ? (opt->force_ref != 0) : 0;
    ctx->fast = !ctx->force_ref && kvd__cpu_has_avx2_fma_f16c();
    be->iface = &cpu_iface;
    be->ctx = ctx;
    be->nthreads = nthreads;
    kvd__par_size(nthreads, nslots ? nslots : ncpu + 1);
    if (bg_nice)
        kvd__par_background_nice(bg_nice);
    *out = be;
    return KVD_OK;
}

/* ---- generic wrappers: any backend ---- */

void kvd_backend_free(kvd_backend *be)
{
    if (be && be->iface && be->iface->free)
        be->iface->free(be);
}

kvd_backend kvd_backend_narrow(const kvd_backend *be, int nthreads)
{
    kvd_backend view = *be;
    if (nthreads >= 1 && nthreads < be->nthreads)
        view.nthreads = nthreads;
    return view;
}

int kvd_backend_alloc(kvd_backend *be, size_t bytes, void **out, kvd_error *err)
{
    if (!out)
        return kvd_error_set(err, KVD_EINVAL, "backend alloc: out is NULL");
    *out = NULL;
    if (!be || !be->iface || !be->iface->alloc)
        return kvd_error_set(err, KVD_EINVAL, "backend alloc: no backend");
    return be->iface->alloc(be, bytes, out, err);
}

void kvd_backend_dealloc(kvd_backend *be, void *ptr)
{
    if (be && ptr && be->iface && be->iface->dealloc)
        be->iface->dealloc(be, ptr);
}

int kvd_backend_upload(kvd_backend *be, void *dst, const void *host_src, size_t bytes,
                       kvd_error *err)
{
    if (!be || !be->iface || !be->iface->upload)
        return kvd_error_set(err, KVD_EINVAL, "backend upload: no backend");
    if (bytes && (!dst || !host_src))
        return kvd_error_set(err, KVD_EINVAL, "backend upload: NULL pointer for %zu bytes", bytes);
    return bytes ? be->iface->upload(be, dst, host_src, bytes, err) : KVD_OK;
}

int kvd_backend_download(kvd_backend *be, void *host_dst, const void *src, size_t bytes,
                         kvd_error *err)
{
    if (!be || !be->iface || !be->iface->download)
        return kvd_error_set(err, KVD_EINVAL, "backend download: no backend");
    if (bytes && (!host_dst || !src))
        return kvd_error_set(err, KVD_EINVAL, "backend download: NULL pointer for %zu bytes",
                             bytes);
    return bytes ? be->iface->download(be, host_dst, src, bytes, err) : KVD_OK;
}

int kvd_backend_scratch(kvd_backend *be, size_t bytes, void **out, kvd_error *err)
{
    if (be && be->iface && be->iface->scratch && out) {
        *out = NULL;
        return be->iface->scratch(be, bytes, out, err);
    }
    return kvd_backend_alloc(be, bytes, out, err);
}

int kvd_backend_host_alloc(kvd_backend *be, size_t bytes, void **out, kvd_error *err)
{
    if (!out)
        return kvd_error_set(err, KVD_EINVAL, "host alloc: out is NULL");
    *out = NULL;
    if (be && be->iface && be->iface->host_alloc)
        return be->iface->host_alloc(be, bytes, out, err);
    *out = aligned_alloc(64, (bytes + 63) / 64 * 64 + (bytes == 0) * 64);
    return *out ? KVD_OK
                : kvd_error_set(err, KVD_ENOMEM, "host alloc: out of memory (%zu bytes)", bytes);
}

void kvd_backend_host_free(kvd_backend *be, void *ptr)
{
    if (be && ptr && be->iface && be->iface->host_free)
        be->iface->host_free(be, ptr);
    else
        free(ptr);
}

void kvd_backend_scratch_free(kvd_backend *be, void *ptr)
{
    if (be && ptr && be->iface && be->iface->scratch_free)
        be->iface->scratch_free(be, ptr);
    else
        kvd_backend_dealloc(be, ptr);
}

int kvd_backend_copy2d(kvd_backend *be, void *dst, size_t dpitch, const void *src, size_t spitch,
                       size_t width, size_t height, kvd_error *err)
{
    if (!be || !be->iface)
        return kvd_error_set(err, KVD_EINVAL, "backend copy: no backend");
    if (width && height && (!dst || !src))
        return kvd_error_set(err, KVD_EINVAL, "backend copy: NULL pointer");
    if (be->iface->copy2d)
        return width && height ? be->iface->copy2d(be, dst, dpitch, src, spitch, width, height, err)
                               : KVD_OK;
    for (size_t r = 0; r < height; r++)
        memcpy((char *)dst + r * dpitch, (const char *)src + r * spitch, width);
    return KVD_OK;
}

int kvd_backend_copy_batch(kvd_backend *be, const kvd_copy *ops, size_t n, kvd_error *err)
{
    if (!be || !be->iface)
        return kvd_error_set(err, KVD_EINVAL, "backend copy: no backend");
    if (n && !ops)
        return kvd_error_set(err, KVD_EINVAL, "backend copy: NULL copies");
    for (size_t i = 0; i < n; i++)
        if (ops[i].bytes && (!ops[i].dst || !ops[i].src))
            return kvd_error_set(err, KVD_EINVAL, "backend copy %zu: NULL pointer", i);
    if (be->iface->copy_batch)
        return n ? be->iface->copy_batch(be, ops, n, err) : KVD_OK;
    int rc = KVD_OK;
    for (size_t i = 0; i < n && !rc; i++)
        rc = ops[i].within ? kvd_backend_copy2d(be, ops[i].dst, ops[i].bytes, ops[i].src,
                                                ops[i].bytes, ops[i].bytes, 1, err)
             : ops[i].to_device
                 ? kvd_backend_upload(be, ops[i].dst, ops[i].src, ops[i].bytes, err)
                 : kvd_backend_download(be, ops[i].dst, ops[i].src, ops[i].bytes, err);
    return rc;
}

void kvd_backend_describe(const kvd_backend *be, kvd_backend_desc *out)
{
    memset(out, 0, sizeof *out);
    out->healthy = 1;
    if (be && be->iface && be->iface->describe)
        be->iface->describe(be, out);
}

int kvd_backend_sync(kvd_backend *be, kvd_error *err)
{
    if (!be || !be->iface || !be->iface->sync)
        return kvd_error_set(err, KVD_EINVAL, "backend sync: no backend");
    return be->iface->sync(be, err);
}
