/*
 * Encode throughput of the CPU backend core ops, in GB/s of input bytes
 * (fp16 input for the codecs, as engines hand it over).
 *
 *   bench_encode [--tokens T] [--min-time S] [--csv]
 *
 * One block is T tokens x 128 dims of one kv head (default T = 4096, 1 MiB
 * of fp16). Each op runs on the CPU backend with 1 thread and with all
 * threads; "ref" rows run the scalar reference for scale. Quote ratios from
 * one run: the machine's load moves absolute figures. The kmeans_train rows
 * (a PQ sub-space's and a VQ codebook's training) give the time of one
 * training in their detail and have no reference timing. The
 * svd_unproject rows (the decode of SVD-coded rows) count the f16 bytes of
 * their output.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kvdepot/backend.h"
#include "kvdepot/convert.h"
#include "kvdepot/kmeans.h"
#include "kvdepot/quant.h"
#include "kvdepot/svd.h"
#include "kvdepot/vq.h"
#include "testutil.h"

static double min_time = 0.25;
static int csv = 0;

typedef int (*bench_fn)(kvd_backend *be, void *arg);

typedef struct timing {
    double wall; /* seconds per call */
    double cpu;  /* process CPU seconds per call (all threads, spinning included) */
} timing;

static double cpu_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/*
 * Per-call time: 5 batches of calls, each lasting min_time/5 (at least 2
 * calls); the fastest batch counts, which filters out the time this process
 * spent descheduled on a shared machine.
 */
static timing time_op(kvd_backend *be, bench_fn fn, void *arg)
{
    if (fn(be, arg) != KVD_OK) { /* warm-up, and fail loudly */
        fprintf(stderr, "op failed\n");
        exit(1);
    }
    timing best = {1e30, 1e30};
    for (int b = 0; b < 5; b++) {
        int reps = 0;
        double t0 = tu_now(), c0 = cpu_now(), t;
        do {
            fn(be, arg);
            reps++;
            t = tu_now() - t0;
        } while (t < min_time / 5 || reps < 2);
        double c = cpu_now() - c0;
        if (t / reps < best.wall) {
            best.wall = t / reps;
            best.cpu = c / reps;
        }
    }
    return best;
}

typedef struct qarg {
    kvd_tensor x;
    kvd_qtensor q;
    kvd_tensor y;
    kvd_rounding rnd;
} qarg;

static int run_quant(kvd_backend *be, void *a)
{
    qarg *p = a;
    return kvd_quantize(be, &p->x, &p->q, p->rnd, 42, NULL);
}

static int run_dequant(kvd_backend *be, void *a)
{
    qarg *p = a;
    return kvd_dequantize(be, &p->q, &p->y, NULL);
}

typedef struct carg {
    kvd_tensor dst, src, s;
    int which; /* 0 convert, 1 hadamard, 2 channel scale */
} carg;

static int run_conv(kvd_backend *be, void *a)
{
    carg *p = a;
    if (p->which == 0)
        return kvd_convert(be, &p->dst, &p->src, NULL);
    if (p->which == 1)
        return kvd_hadamard(be, &p->dst, &p->src, NULL);
    return kvd_channel_scale(be, &p->dst, &p->src, &p->s, 0, NULL);
}

typedef struct sarg {
    const float *R;
    int r;
    const uint16_t *x;
    int64_t T;
    float *y, *out;
} sarg;

/* SVD encode: fp16 rows projected on the first r columns of R (D = 128). */
static int run_svd(kvd_backend *be, void *a)
{
    sarg *p = a;
    return kvd_svd_project(be, p->R, 128, p->r, p->x, KVD_DTYPE_F16, p->T, 2 * 128, p->y, NULL);
}

/* SVD decode: the r-wide rows back-projected to D = 128 (into x's bytes,
 * as f32: the rows a page's decode turns into f16). */
static int run_unsvd(kvd_backend *be, void *a)
{
    sarg *p = a;
    return kvd_svd_unproject(be, p->R, 128, p->r, p->y, p->T, p->out, NULL);
}

typedef struct varg {
    kvd_tensor x, cb, codes;
} varg;

/* VQ encode: nearest codebook row of every d-wide sub-vector of f32 rows
 * (the keys after smoothing and the Hadamard transform). */
static int run_vq(kvd_backend *be, void *a)
{
    varg *p = a;
    return kvd_vq_encode(be, &p->x, &p->cb, &p->codes, NULL);
}

typedef struct karg {
    kvd_kmeans_params p;
    kvd_tensor x, c;
} karg;

/* K-means training (a PQ sub-space's or a VQ codebook's centroids). */
static int run_kmeans(kvd_backend *be, void *a)
{
    karg *p = a;
    double inertia;
    return kvd_kmeans_train(be, &p->p, &p->x, &p->c, &inertia, NULL);
}

static void row(const char *op, const char *detail, int threads, double bytes, timing t,
                timing base)
{
    double gbs = bytes / t.wall / 1e9, gbc = bytes / t.cpu / 1e9;
    double x = base.wall > 0 ? base.wall / t.wall : 0;
    if (csv)
        printf("%s,%s,%d,%.3f,%.3f,%.3f\n", op, detail, threads, gbs, gbc, x);
    else
        printf("%-16s %-26s %7d %9.2f %11.2f %8.1f\n", op, detail, threads, gbs, gbc, x);
}

int main(int argc, char **argv)
{
    int64_t T = 4096;
    const int64_t D = 128;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--tokens") && i + 1 < argc)
            T = atoll(argv[++i]);
        else if (!strcmp(argv[i], "--min-time") && i + 1 < argc)
            min_time = atof(argv[++i]);
        else if (!strcmp(argv[i], "--csv"))
            csv = 1;
        else {
            fprintf(stderr, "usage: %s [--tokens T] [--min-time S] [--csv]\n", argv[0]);
            return 2;
        }
    }
    T = (T + 127) / 128 * 128;
    kvd_backend *ref = tu_cpu_backend(1, 1), *one = tu_cpu_backend(1, 0), *all = tu_cpu_backend(0, 0);
    const int nall = all->nthreads;

    size_t n = (size_t)(T * D);
    float *xf = malloc(n * 4);
    uint16_t *xh = malloc(n * 2), *yh = malloc(n * 2);
    float *yf = malloc(n * 4);
    tu_rng r;
    tu_rng_seed(&r, 1);
    tu_kv_opts o = {4, 20.0f, 0.3f, 1};
    tu_gen_kv(&r, xf, T, D, &o);
    tu_f32_to_f16(xh, xf, n);
    unsigned char *qbuf = malloc(n + 4 * n / 32 * 6);

    if (csv)
        printf("op,detail,threads,GB_per_s_wall,GB_per_cpu_s,speedup_vs_ref\n");
    else {
        printf("kvdepot encode throughput: block %lld tokens x %lld dims (one kv head), fp16 "
               "input = %.2f MiB; CPU fast path %s; all threads = %d\n",
               (long long)T, (long long)D, (double)n * 2 / 1048576.0,
               kvd_cpu_has_avx2_fma() ? "AVX2/FMA/F16C" : "unavailable (reference)", nall);
        printf("%-16s %-26s %7s %9s %11s %8s\n", "op", "detail", "threads", "GB/s", "GB/cpu-s",
               "x ref");
        printf("%-16s %-26s %7s %9s %11s %8s\n", "----------------", "--------------------------",
               "-------", "---------", "-----------", "--------");
    }

    int64_t shape[2] = {T, D};
    const int Ps[3] = {32, 64, 128};
    for (int axis = 0; axis < 2; axis++)
        for (int bits = 2; bits <= 4; bits += 2)
            for (int pi = 0; pi < 3; pi++) {
                qarg a;
                a.x = kvd_tensor_make(KVD_DTYPE_F16, xh, 2, shape);
                a.y = kvd_tensor_make(KVD_DTYPE_F16, yh, 2, shape);
                a.rnd = KVD_ROUND_NEAREST;
                kvd_qtensor_init(&a.q, T, D, bits, Ps[pi], (kvd_quant_axis)axis, qbuf, NULL);
                char detail[64];
                snprintf(detail, sizeof detail, "INT%d %s P=%d", bits,
                         axis == KVD_QAXIS_TOKEN ? "token (K)" : "channel (V)", Ps[pi]);
                timing tr = time_op(ref, run_quant, &a);
                row("quantize", detail, 1, (double)n * 2, time_op(one, run_quant, &a), tr);
                row("quantize", detail, nall, (double)n * 2, time_op(all, run_quant, &a), tr);
                if (pi == 1) {
                    a.rnd = KVD_ROUND_STOCHASTIC;
                    char d2[80];
                    snprintf(d2, sizeof d2, "%s stoch", detail);
                    timing trs = time_op(ref, run_quant, &a);
                    row("quantize", d2, 1, (double)n * 2, time_op(one, run_quant, &a), trs);
                    row("quantize", d2, nall, (double)n * 2, time_op(all, run_quant, &a), trs);
                    a.rnd = KVD_ROUND_NEAREST;
                    kvd_quantize(one, &a.x, &a.q, a.rnd, 42, NULL);
                    timing trd = time_op(ref, run_dequant, &a);
                    row("dequant->f16", detail, 1, (double)n * 2, time_op(one, run_dequant, &a), trd);
                    row("dequant->f16", detail, nall, (double)n * 2, time_op(all, run_dequant, &a), trd);
                }
            }

    /* conversions and transforms on the same block */
    struct {
        const char *op, *detail;
        int which;
        kvd_dtype sd, dd;
    } cs[] = {
        {"convert", "f16 -> f32", 0, KVD_DTYPE_F16, KVD_DTYPE_F32},
        {"convert", "f32 -> f16", 0, KVD_DTYPE_F32, KVD_DTYPE_F16},
        {"convert", "bf16 -> f32", 0, KVD_DTYPE_BF16, KVD_DTYPE_F32},
        {"convert", "f32 -> bf16", 0, KVD_DTYPE_F32, KVD_DTYPE_BF16},
        {"hadamard", "f16 -> f16, n=128", 1, KVD_DTYPE_F16, KVD_DTYPE_F16},
        {"hadamard", "f32 in place, n=128", 1, KVD_DTYPE_F32, KVD_DTYPE_F32},
        {"channel_scale", "f16 -> f16 (multiply)", 2, KVD_DTYPE_F16, KVD_DTYPE_F16},
    };
    float sc[128];
    for (int j = 0; j < 128; j++)
        sc[j] = 0.5f + (float)j / 128.0f;
    int64_t s1[1] = {128};
    for (size_t i = 0; i < sizeof cs / sizeof cs[0]; i++) {
        carg a;
        void *src = cs[i].sd == KVD_DTYPE_F32 ? (void *)xf : (void *)xh;
        void *dst = cs[i].dd == KVD_DTYPE_F32 ? (void *)yf : (void *)yh;
        if (cs[i].which == 1 && cs[i].sd == KVD_DTYPE_F32)
            dst = src = yf;
        if (cs[i].sd == KVD_DTYPE_F32)
            memcpy(yf, xf, n * 4);
        a.src = kvd_tensor_make(cs[i].sd, src, 2, shape);
        a.dst = kvd_tensor_make(cs[i].dd, dst, 2, shape);
        a.s = kvd_tensor_make(KVD_DTYPE_F32, sc, 1, s1);
        a.which = cs[i].which;
        double bytes = (double)n * (double)kvd_dtype_size(cs[i].sd);
        timing tr = time_op(ref, run_conv, &a);
        row(cs[i].op, cs[i].detail, 1, bytes, time_op(one, run_conv, &a), tr);
        row(cs[i].op, cs[i].detail, nall, bytes, time_op(all, run_conv, &a), tr);
    }
    /* VQ encode (VecInfer), d4b8 and d8b12: codebooks of distinct rows
     * drawn from the block (a trained codebook lies among the data the same
     * way, without repeats). */
    {
        const int ds[2] = {4, 8}, bs[2] = {8, 12};
        void *codes = malloc(n * 2);
        for (int i = 0; i < 2; i++) {
            const int d = ds[i], K = 1 << bs[i];
            float *cb = malloc(sizeof(float) * (size_t)K * d);
            for (int c = 0; c < K; c++) /* every 16th sub-vector from a random start */
                memcpy(cb + (size_t)c * d,
                       xf + ((tu_rng_u64(&r) % 16 + 16 * (size_t)c) % (n / d)) * d,
                       sizeof(float) * d);
            int64_t cbs[2] = {K, d}, cs[2] = {T, D / d};
            varg a = {kvd_tensor_make(KVD_DTYPE_F32, xf, 2, shape),
                      kvd_tensor_make(KVD_DTYPE_F32, cb, 2, cbs),
                      kvd_tensor_make(bs[i] > 8 ? KVD_DTYPE_U16 : KVD_DTYPE_U8, codes, 2, cs)};
            char detail[64];
            snprintf(detail, sizeof detail, "d%db%d, f32 rows", d, bs[i]);
            timing tr = time_op(ref, run_vq, &a);
            row("vq_encode", detail, 1, (double)n * 2, time_op(one, run_vq, &a), tr);
            row("vq_encode", detail, nall, (double)n * 2, time_op(all, run_vq, &a), tr);
            free(cb);
        }
        free(codes);
    }
    /* K-means training on 32K sub-vectors of the block, 4 Lloyd steps
     * after the k-means++ seeding: a PQ sub-space of m = 16 (d = 8, 6-bit
     * codes) and a VQ d4b8 codebook. GB/s of the points' f32 bytes. */
    {
        const int ds[2] = {8, 4}, ks[2] = {64, 256};
        for (int i = 0; i < 2; i++) {
            const int64_t np = (int64_t)(n / ds[i]) < 32768 ? (int64_t)(n / ds[i]) : 32768;
            float *cb = malloc(sizeof(float) * (size_t)ks[i] * ds[i]);
            int64_t xs[2] = {np, ds[i]}, cs[2] = {ks[i], ds[i]};
            karg a = {{ks[i], 4, 7, 0},
                      kvd_tensor_make(KVD_DTYPE_F32, xf, 2, xs),
                      kvd_tensor_make(KVD_DTYPE_F32, cb, 2, cs)};
            const timing none = {0, 0};
            for (int th = 0; th < 2; th++) {
                const timing t = time_op(th ? all : one, run_kmeans, &a);
                char detail[64];
                snprintf(detail, sizeof detail, "d%d k%d 32K pts: %.1f ms", ds[i], ks[i],
                         t.wall * 1e3);
                row("kmeans_train", detail, th ? nall : 1, (double)np * ds[i] * 4, t, none);
            }
            free(cb);
        }
    }
    /* SVD encode (ZACK): a rotation from the block's own Gram matrix. */
    {
        float *R = malloc(sizeof(float) * D * D), sv[128], *ob = malloc(sizeof(float) * n);
        double *g = calloc((size_t)D * D, sizeof(double));
        kvd_svd_gram_accumulate(g, (int)D, xf, KVD_DTYPE_F32, T, 4 * D, 1.0, NULL);
        kvd_svd_rotation(g, (int)D, R, sv, NULL);
        const int rs[3] = {32, 64, 128};
        for (int i = 0; i < 3; i++) {
            sarg a = {R, rs[i], xh, T, yf, ob};
            char detail[64];
            snprintf(detail, sizeof detail, "f16 -> f32, width %d", rs[i]);
            timing tr = time_op(ref, run_svd, &a);
            row("svd_project", detail, 1, (double)n * 2, time_op(one, run_svd, &a), tr);
            row("svd_project", detail, nall, (double)n * 2, time_op(all, run_svd, &a), tr);
            snprintf(detail, sizeof detail, "width %d -> f32", rs[i]);
            tr = time_op(ref, run_unsvd, &a);
            row("svd_unproject", detail, 1, (double)n * 2, time_op(one, run_unsvd, &a), tr);
            row("svd_unproject", detail, nall, (double)n * 2, time_op(all, run_unsvd, &a), tr);
        }
        free(R);
        free(ob);
        free(g);
    }
    if (!csv)
        printf("GB/s: input bytes per wall second (fp16 = 2 bytes per value unless the detail "
               "says f32), best of 5 batches.\nGB/cpu-s: input bytes per second of process CPU "
               "time (per busy core; includes OpenMP spinning).\nx ref: wall-time speed-up over "
               "the scalar reference on 1 thread. Target for INT2/INT4 encode: >= 1 GB/s per "
               "core.\nOpenMP wait policy: %s\n",
               getenv("OMP_WAIT_POLICY") ? getenv("OMP_WAIT_POLICY") : "(default)");
    free(xf);
    free(xh);
    free(yh);
    free(yf);
    free(qbuf);
    kvd_backend_free(ref);
    kvd_backend_free(one);
    kvd_backend_free(all);
    return 0;
}
