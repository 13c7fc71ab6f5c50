/*
 * GPU benchmarks of the CUDA backend (a program that prints tables, not a
 * test). Run on an H100/H200 with tests/bench/bench_cuda_run.sh, which also
 * runs the plain-PyTorch PQ search (bench_pq_torch.py) and prints both in
 * one table. Without a GPU it says so and exits 0.
 *
 *   pq search    n = 4K..1M tokens, m x b in {2x6, 4x8, 8x4, 16x8},
 *                k = 64..2048, D = 128, G = 4 query heads (summed), sink 4,
 *                window 64. Time per search (median of trials, each the
 *                mean of `reps` back-to-back searches after a warm-up) and
 *                code-streaming bandwidth n*m bytes / time, as % of the HBM
 *                peak (2 x memory clock x bus width, read off the device)
 *                and of the measured device-to-device copy rate. A second
 *                table runs 64 (sequence, kv head) pairs per call through
 *                the batched entry point.
 *   kmeans       PQ training of one (layer, kv head) of a 32K-token
 *                prefill (D = 128, m x b = 16x8 and 4x8, 10 Lloyd
 *                iterations; the device-resident driver, with and without
 *                sub-sampling, and the host-driven exact one; the device
 *                driver's seeding alone), next to an estimate of that prefill's
 *                attention time for the same (layer, kv head): causal
 *                attention is 2*T^2*D*G flops, timed at the fp16 tensor-
 *                core rate measured here with one large cublasGemmEx.
 *   encode       INT2/INT4 quantize (token and channel axes, f16 input),
 *                VQ encode (d4b8), PQ encode (16x8): GB/s of bytes read
 *                + written and % of the HBM peak.
 *
 * Options: --quick (fewer sizes), --csv FILE (machine-readable rows:
 * table,n,mxb,k,us,gbs,pct), --only pq|kmeans|encode (one table, e.g. for a
 * profiler).
 */
#define _POSIX_C_SOURCE 200809L /* setenv */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include "kvdepot/backend.h"
#include "kvdepot/pq.h"
#include "kvdepot/quant.h"
#include "kvdepot/vq.h"
#include "testutil.h"

const char *kvd_backend_cuda_device_name(const kvd_backend *be);
double kvd_backend_cuda_hbm_peak_gbs(const kvd_backend *be);

static kvd_backend *be;
static FILE *csv;
static double peak_gbs, copy_gbs;

static void fail(const char *what, const kvd_error *e)
{
    fprintf(stderr, "bench_cuda: %s: %s\n", what, e ? e->msg : "");
    exit(1);
}

static void *dev_alloc(size_t bytes)
{
    void *p = NULL;
    kvd_error e;
    if (kvd_backend_alloc(be, bytes, &p, &e))
        fail("alloc", &e);
    return p;
}

static void *dev_from(const void *h, size_t bytes)
{
    void *p = dev_alloc(bytes);
    kvd_error e;
    if (kvd_backend_upload(be, p, h, bytes, &e))
        fail("upload", &e);
    return p;
}

static void sync_or_die(void)
{
    kvd_error e;
    if (kvd_backend_sync(be, &e))
        fail("sync", &e);
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* Median over `trials` of the mean time of `reps` calls of fn, seconds. */
typedef int (*bench_fn)(void *arg, kvd_error *e);
static double time_op(bench_fn fn, void *arg, int reps, int trials)
{
    kvd_error e;
    for (int i = 0; i < 2; i++) /* warm-up: module load, pools, handles */
        if (fn(arg, &e))
            fail("op", &e);
    sync_or_die();
    double t[16];
    if (trials > 16)
        trials = 16;
    for (int tr = 0; tr < trials; tr++) {
        double t0 = tu_now();
        for (int r = 0; r < reps; r++)
            if (fn(arg, &e))
                fail("op", &e);
        sync_or_die();
        t[tr] = (tu_now() - t0) / reps;
    }
    qsort(t, (size_t)trials, sizeof t[0], cmp_double);
    return t[trials / 2];
}

static void row_csv(const char *table, long long n, const char *mxb, long long k, double us,
                    double gbs)
{
    if (csv)
        fprintf(csv, "%s,%lld,%s,%lld,%.3f,%.2f,%.2f\n", table, n, mxb, k, us, gbs,
                peak_gbs > 0 ? 100.0 * gbs / peak_gbs : 0.0);
}

/* ---- device ceilings ----------------------------------------------------- */

static void measure_copy(void)
{
    const size_t bytes = (size_t)1 << 30;
    void *a = NULL, *b = NULL;
    if (cudaMalloc(&a, bytes) || cudaMalloc(&b, bytes)) {
        cudaGetLastError();
        return;
    }
    cudaMemset(a, 1, bytes);
    cudaMemcpy(b, a, bytes, cudaMemcpyDeviceToDevice);
    cudaEvent_t e0, e1;
    cudaEventCreate(&e0);
    cudaEventCreate(&e1);
    cudaEventRecord(e0, 0);
    for (int i = 0; i < 10; i++)
        cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice, 0);
    cudaEventRecord(e1, 0);
    cudaEventSynchronize(e1);
    float ms = 0;
    cudaEventElapsedTime(&ms, e0, e1);
    copy_gbs = 2.0 * bytes * 10 / (ms * 1e-3) / 1e9; /* read + write */
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
    cudaFree(a);
    cudaFree(b);
}

/* fp16 tensor-core rate (TFLOP/s) from one large GEMM, f32 accumulation. */
static double measure_fp16_tflops(void)
{
    const int N = 8192;
    void *a = NULL, *b = NULL, *c = NULL;
    cublasHandle_t h = NULL;
    double tflops = 0;
    if (cudaMalloc(&a, (size_t)N * N * 2) || cudaMalloc(&b, (size_t)N * N * 2) ||
        cudaMalloc(&c, (size_t)N * N * 2) || cublasCreate(&h) != CUBLAS_STATUS_SUCCESS)
        goto out;
    cudaMemset(a, 0x33, (size_t)N * N * 2); /* 0x3333 = 0.2249 in f16: not zeros */
    cudaMemset(b, 0x33, (size_t)N * N * 2);
    {
        const float one = 1.0f, zero = 0.0f;
        cudaEvent_t e0, e1;
        cudaEventCreate(&e0);
        cudaEventCreate(&e1);
        for (int it = 0; it < 2; it++) {
            cudaEventRecord(e0, 0);
            for (int r = 0; r < 5; r++)
                cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_N, N, N, N, &one, a, CUDA_R_16F, N, b,
                             CUDA_R_16F, N, &zero, c, CUDA_R_16F, N, CUBLAS_COMPUTE_32F,
                             CUBLAS_GEMM_DEFAULT);
            cudaEventRecord(e1, 0);
            cudaEventSynchronize(e1);
        }
        float ms = 0;
        cudaEventElapsedTime(&ms, e0, e1);
        tflops = 2.0 * N * N * (double)N * 5 / (ms * 1e-3) / 1e12;
        cudaEventDestroy(e0);
        cudaEventDestroy(e1);
    }
out:
    if (h)
        cublasDestroy(h);
    cudaFree(a);
    cudaFree(b);
    cudaFree(c);
    cudaGetLastError();
    return tflops;
}

/* ---- PQ search ----------------------------------------------------------- */

typedef struct search_arg {
    kvd_tensor cent, codes, q, idx, sc;
    kvd_pq_search_params p;
    kvd_pq_search_job *jobs;
    int64_t njobs;
} search_arg;

static int run_search(void *a, kvd_error *e)
{
    search_arg *s = a;
    int64_t nout;
    return kvd_pq_search(be, &s->cent, &s->codes, &s->q, &s->p, &s->idx, &s->sc, &nout, e);
}

static int run_batch(void *a, kvd_error *e)
{
    search_arg *s = a;
    return kvd_pq_search_batch(be, s->jobs, s->njobs, &s->p, e);
}

static const int kMB[4][2] = {{2, 6}, {4, 8}, {8, 4}, {16, 8}};

static void bench_pq(int quick)
{
    const int D = 128, G = 4;
    const int64_t ns_full[] = {4096, 16384, 65536, 262144, 1048576};
    const int64_t ns_quick[] = {16384, 262144};
    const int64_t ks[] = {64, 256, 1024, 2048};
    const int64_t *ns = quick ? ns_quick : ns_full;
    const int nn = quick ? 2 : 5;
    tu_rng r;
    tu_rng_seed(&r, 1);
    printf("\n## PQ search, one (sequence, kv head) per call: D=%d G=%d sink=4 window=64\n", D, G);
    printf("%8s %5s %5s %10s %9s %7s %9s\n", "n", "mxb", "k", "us", "GB/s", "%HBM", "k/k256");
    for (int c = 0; c < 4; c++) {
        const int m = kMB[c][0], b = kMB[c][1], K = 1 << b, dsub = D / m;
        char mxb[16];
        snprintf(mxb, sizeof mxb, "%dx%d", m, b);
        float *cent = malloc((size_t)m * K * dsub * 4), *q = malloc((size_t)G * D * 4);
        tu_fill_normal(&r, cent, (size_t)m * K * dsub, 1.0f);
        tu_fill_normal(&r, q, (size_t)G * D, 1.0f);
        void *dcent = dev_from(cent, (size_t)m * K * dsub * 4), *dq = dev_from(q, (size_t)G * D * 4);
        for (int ni = 0; ni < nn; ni++) {
            const int64_t n = ns[ni];
            uint8_t *codes = malloc((size_t)(n * m));
            for (int64_t i = 0; i < n * m; i++)
                codes[i] = (uint8_t)tu_rng_below(&r, (uint32_t)K);
            void *dcodes = dev_from(codes, (size_t)(n * m));
            void *didx = dev_alloc(4 * 4096), *dsc = dev_alloc(4 * 4096);
            double t256 = 0;
            for (int ki = 0; ki < 4; ki++) {
                search_arg a;
                int64_t sh3[3] = {m, K, dsub}, shc[2] = {n, m}, shq[2] = {G, D}, sho[1] = {4096};
                a.cent = kvd_tensor_make(KVD_DTYPE_F32, dcent, 3, sh3);
                a.codes = kvd_tensor_make(KVD_DTYPE_U8, dcodes, 2, shc);
                a.q = kvd_tensor_make(KVD_DTYPE_F32, dq, 2, shq);
                a.idx = kvd_tensor_make(KVD_DTYPE_U32, didx, 1, sho);
                a.sc = kvd_tensor_make(KVD_DTYPE_F32, dsc, 1, sho);
                a.p = (kvd_pq_search_params){ks[ki], 4, 64, KVD_PQ_AGG_SUM};
                double t = time_op(run_search, &a, 20, 7);
                if (ks[ki] == 256)
                    t256 = t;
                double gbs = (double)n * m / t / 1e9;
                char ratio[16] = "";
                if (ks[ki] >= 1024 && t256 > 0) /* target: k=1024 <= 1.8x k=256 */
                    snprintf(ratio, sizeof ratio, "%.2f", t / t256);
                printf("%8lld %5s %5lld %10.1f %9.1f %6.1f%% %9s\n", (long long)n, mxb,
                       (long long)ks[ki], t * 1e6, gbs, peak_gbs > 0 ? 100 * gbs / peak_gbs : 0,
                       ratio);
                row_csv("pq_search", n, mxb, ks[ki], t * 1e6, gbs);
            }
            kvd_backend_dealloc(be, dcodes);
            kvd_backend_dealloc(be, didx);
            kvd_backend_dealloc(be, dsc);
            free(codes);
        }
        kvd_backend_dealloc(be, dcent);
        kvd_backend_dealloc(be, dq);
        free(cent);
        free(q);
    }

    /* batched: 64 pairs of 32K tokens (e.g. 8 sequences x 8 kv heads) */
    const int J = 64;
    const int64_t n = 32768;
    printf("\n## PQ search, %d (sequence, kv head) pairs of %lld tokens per call\n", J,
           (long long)n);
    printf("%5s %5s %10s %9s %7s\n", "mxb", "k", "us", "GB/s", "%HBM");
    for (int c = 0; c < 4; c++) {
        const int m = kMB[c][0], b = kMB[c][1], K = 1 << b, dsub = D / m;
        char mxb[16];
        snprintf(mxb, sizeof mxb, "%dx%d", m, b);
        float *cent = malloc((size_t)m * K * dsub * 4), *q = malloc((size_t)G * D * 4);
        tu_fill_normal(&r, cent, (size_t)m * K * dsub, 1.0f);
        tu_fill_normal(&r, q, (size_t)G * D, 1.0f);
        uint8_t *codes = malloc((size_t)(n * m));
        for (int64_t i = 0; i < n * m; i++)
            codes[i] = (uint8_t)tu_rng_below(&r, (uint32_t)K);
        void *dcent = dev_from(cent, (size_t)m * K * dsub * 4), *dq = dev_from(q, (size_t)G * D * 4);
        void *dcodes = dev_alloc((size_t)(n * m) * J);
        kvd_error e;
        for (int j = 0; j < J; j++)
            if (kvd_backend_upload(be, (char *)dcodes + (size_t)(n * m) * j, codes, (size_t)(n * m), &e))
                fail("upload", &e);
        void *didx = dev_alloc((size_t)4 * 4096 * J);
        kvd_tensor tc[1], tcodes[64], tq[1], tidx[64];
        kvd_pq_search_job jobs[64];
        int64_t sh3[3] = {m, K, dsub}, shc[2] = {n, m}, shq[2] = {G, D}, sho[1] = {4096};
        tc[0] = kvd_tensor_make(KVD_DTYPE_F32, dcent, 3, sh3);
        tq[0] = kvd_tensor_make(KVD_DTYPE_F32, dq, 2, shq);
        for (int j = 0; j < J; j++) {
            tcodes[j] = kvd_tensor_make(KVD_DTYPE_U8, (char *)dcodes + (size_t)(n * m) * j, 2, shc);
            tidx[j] = kvd_tensor_make(KVD_DTYPE_U32, (char *)didx + (size_t)4 * 4096 * j, 1, sho);
            jobs[j] =
                (kvd_pq_search_job){&tc[0], &tcodes[j], &tq[0], &tidx[j], NULL, 0, NULL, NULL};
        }
        for (int ki = 0; ki < 4; ki++) {
            search_arg a;
            memset(&a, 0, sizeof a);
            a.jobs = jobs;
            a.njobs = J;
            a.p = (kvd_pq_search_params){ks[ki], 4, 64, KVD_PQ_AGG_SUM};
            double t = time_op(run_batch, &a, 10, 7);
            double gbs = (double)n * m * J / t / 1e9;
            printf("%5s %5lld %10.1f %9.1f %6.1f%%\n", mxb, (long long)ks[ki], t * 1e6, gbs,
                   peak_gbs > 0 ? 100 * gbs / peak_gbs : 0);
            row_csv("pq_search_batch64", n, mxb, ks[ki], t * 1e6, gbs);
        }
        kvd_backend_dealloc(be, dcent);
        kvd_backend_dealloc(be, dq);
        kvd_backend_dealloc(be, dcodes);
        kvd_backend_dealloc(be, didx);
        free(cent), free(q), free(codes);
    }
}

/* ---- K-means ------------------------------------------------------------- */

typedef struct train_arg {
    kvd_tensor keys, cent;
    kvd_kmeans_params km;
} train_arg;

static int run_train(void *a, kvd_error *e)
{
    train_arg *t = a;
    return kvd_pq_train(be, &t->keys, &t->km, &t->cent, e);
}

static void bench_kmeans(void)
{
    const int64_t T = 32768;
    const int D = 128, G = 4;
    tu_rng r;
    tu_rng_seed(&r, 2);
    float *keys = malloc((size_t)T * D * 4);
    tu_kv_opts o = {4, 10.0f, 0.3f, 1};
    tu_gen_kv(&r, keys, T, D, &o);
    void *dkeys = dev_from(keys, (size_t)T * D * 4);
    double tflops = measure_fp16_tflops();
    double attn_s = tflops > 0 ? 2.0 * T * T * D * G / (tflops * 1e12) : 0;
    printf("\n## K-means (PQ train) for one (layer, kv head) of a %lld-token prefill, D=%d\n",
           (long long)T, D);
    printf("measured fp16 GEMM rate %.0f TFLOP/s -> causal attention of that (layer, kv head), "
           "G=%d: %.3f ms (estimate)\n", tflops, G, attn_s * 1e3);
    printf("%5s %6s %11s %7s %10s %12s\n", "mxb", "iters", "max_points", "driver", "ms",
           "ms/attn");
    const int cfgs[2][2] = {{16, 8}, {4, 8}};
    for (int c = 0; c < 2; c++)
        for (int sub = 0; sub < 4; sub++) {
            /* sub 2: the host-driven driver with the CPU's draws, for contrast;
               sub 3: the device driver's k-means++ seeding alone (no Lloyd
               iteration), so the two rows above split into seeding and Lloyd */
            setenv("KVD_CUDA_KMEANS_EXACT", sub == 2 ? "1" : "0", 1);
            const int m = cfgs[c][0], b = cfgs[c][1], K = 1 << b, dsub = D / m;
            void *dcent = dev_alloc((size_t)m * K * dsub * 4);
            train_arg a;
            int64_t shk[2] = {T, D}, shc[3] = {m, K, dsub};
            a.keys = kvd_tensor_make(KVD_DTYPE_F32, dkeys, 2, shk);
            a.cent = kvd_tensor_make(KVD_DTYPE_F32, dcent, 3, shc);
            a.km = (kvd_kmeans_params){K, sub == 3 ? 0 : 10, 42, sub == 1 ? 64 * K : 0};
            double t = time_op(run_train, &a, 1, 3);
            char mxb[16];
            snprintf(mxb, sizeof mxb, "%dx%d", m, b);
            printf("%5s %6d %11lld %7s %10.2f %12.2f\n", mxb, a.km.niter,
                   (long long)a.km.max_points, sub == 2 ? "exact" : "device", t * 1e3,
                   attn_s > 0 ? t / attn_s : 0);
            row_csv(sub == 2   ? "kmeans_exact"
                    : sub == 3 ? "kmeans_seed"
                               : "kmeans",
                    T, mxb, a.km.max_points, t * 1e6, 0);
            kvd_backend_dealloc(be, dcent);
        }
    kvd_backend_dealloc(be, dkeys);
    free(keys);
}

/* ---- encode ------------------------------------------------------------------ */

typedef struct quant_arg {
    kvd_tensor x;
    kvd_qtensor q;
} quant_arg;

static int run_quant(void *a, kvd_error *e)
{
    quant_arg *q = a;
    return kvd_quantize(be, &q->x, &q->q, KVD_ROUND_STOCHASTIC, 7, e);
}

typedef struct enc_arg {
    kvd_tensor x, book, codes;
    int pq;
} enc_arg;

static int run_enc(void *a, kvd_error *e)
{
    enc_arg *v = a;
    return v->pq ? kvd_pq_encode(be, &v->x, &v->book, &v->codes, e)
                 : kvd_vq_encode(be, &v->x, &v->book, &v->codes, e);
}

static void enc_row(const char *name, double bytes_in, double bytes_out, double t)
{
    double gbs = (bytes_in + bytes_out) / t / 1e9;
    printf("%-24s %10.1f %9.1f %9.1f %6.1f%%\n", name, t * 1e6, bytes_in / t / 1e9, gbs,
           peak_gbs > 0 ? 100 * gbs / peak_gbs : 0);
    row_csv("encode", 0, name, 0, t * 1e6, gbs);
}

static void bench_encode(void)
{
    const int64_t T = 1 << 20; /* tokens of one (T, D) block: 256 MiB of f16 */
    const int D = 128;
    tu_rng r;
    tu_rng_seed(&r, 3);
    float *x = malloc((size_t)T * D * 4);
    tu_fill_normal(&r, x, (size_t)T * D, 1.0f);
    uint16_t *x16 = malloc((size_t)T * D * 2);
    tu_f32_to_f16(x16, x, (size_t)T * D);
    void *dx16 = dev_from(x16, (size_t)T * D * 2);
    printf("\n## Encode throughput, (T=%lld, D=%d) blocks\n", (long long)T, D);
    printf("%-24s %10s %9s %9s %7s\n", "codec", "us", "in GB/s", "GB/s", "%HBM");
    int64_t sh[2] = {T, D};
    for (int bits = 2; bits <= 4; bits += 2)
        for (int ax = 0; ax < 2; ax++) {
            kvd_quant_sizes s;
            kvd_error e;
            kvd_quant_axis axis = ax ? KVD_QAXIS_CHANNEL : KVD_QAXIS_TOKEN;
            if (kvd_quant_size(T, D, bits, ax ? 128 : 32, axis, &s, &e))
                fail("quant size", &e);
            void *dq = dev_alloc(s.total_bytes);
            quant_arg a;
            a.x = kvd_tensor_make(KVD_DTYPE_F16, dx16, 2, sh);
            kvd_qtensor_init(&a.q, T, D, bits, ax ? 128 : 32, axis, dq, NULL);
            double t = time_op(run_quant, &a, 10, 7);
            char name[64];
            snprintf(name, sizeof name, "INT%d %s f16 (PI=%d)", bits, ax ? "V/chan" : "K/token",
                     ax ? 128 : 32);
            enc_row(name, (double)T * D * 2, (double)s.total_bytes, t);
            kvd_backend_dealloc(be, dq);
        }
    kvd_backend_dealloc(be, dx16);
    free(x16);

    /* VQ d4b8 and PQ 16x8 on f32 inputs (transformed keys) */
    const int64_t Tv = 1 << 18;
    void *dx = dev_from(x, (size_t)Tv * D * 4);
    float *book = malloc(256 * 8 * 4 * 16);
    tu_fill_normal(&r, book, 256 * 8 * 16, 1.0f);
    {
        void *dbook = dev_from(book, 256 * 4 * 4), *dcodes = dev_alloc((size_t)Tv * (D / 4));
        enc_arg a;
        int64_t shx[2] = {Tv, D}, shb[2] = {256, 4}, shc[2] = {Tv, D / 4};
        a.x = kvd_tensor_make(KVD_DTYPE_F32, dx, 2, shx);
        a.book = kvd_tensor_make(KVD_DTYPE_F32, dbook, 2, shb);
        a.codes = kvd_tensor_make(KVD_DTYPE_U8, dcodes, 2, shc);
        a.pq = 0;
        double t = time_op(run_enc, &a, 5, 5);
        enc_row("VQ d4b8 f32", (double)Tv * D * 4, (double)Tv * D / 4, t);
        kvd_backend_dealloc(be, dbook);
        kvd_backend_dealloc(be, dcodes);
    }
    {
        void *dbook = dev_from(book, 16 * 256 * 8 * 4), *dcodes = dev_alloc((size_t)Tv * 16);
        enc_arg a;
        int64_t shx[2] = {Tv, D}, shb[3] = {16, 256, 8}, shc[2] = {Tv, 16};
        a.x = kvd_tensor_make(KVD_DTYPE_F32, dx, 2, shx);
        a.book = kvd_tensor_make(KVD_DTYPE_F32, dbook, 3, shb);
        a.codes = kvd_tensor_make(KVD_DTYPE_U8, dcodes, 2, shc);
        a.pq = 1;
        double t = time_op(run_enc, &a, 5, 5);
        enc_row("PQ 16x8 f32", (double)Tv * D * 4, (double)Tv * 16, t);
        kvd_backend_dealloc(be, dbook);
        kvd_backend_dealloc(be, dcodes);
    }
    kvd_backend_dealloc(be, dx);
    free(book);
    free(x);
}

int main(int argc, char **argv)
{
    int quick = 0;
    const char *only = NULL;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--quick"))
            quick = 1;
        else if (!strcmp(argv[i], "--only") && i + 1 < argc && !only &&
                 (!strcmp(argv[i + 1], "pq") || !strcmp(argv[i + 1], "kmeans") ||
                  !strcmp(argv[i + 1], "encode")))
            only = argv[++i];
        else if (!strcmp(argv[i], "--csv") && i + 1 < argc)
            csv = fopen(argv[++i], "w");
        else {
            fprintf(stderr, "usage: %s [--quick] [--csv FILE] [--only pq|kmeans|encode]\n",
                    argv[0]);
            return 2;
        }
    }
    kvd_error err;
    if (kvd_backend_cuda_create(-1, &be, &err)) {
        printf("bench_cuda: no CUDA device (%s); nothing to measure.\n", err.msg);
        return 0;
    }
    peak_gbs = kvd_backend_cuda_hbm_peak_gbs(be);
    measure_copy();
    printf("# bench_cuda on %s: HBM peak %.0f GB/s (memory clock x bus width), "
           "device copy %.0f GB/s (read + write)\n",
           kvd_backend_cuda_device_name(be), peak_gbs, copy_gbs);
    if (csv)
        fprintf(csv, "table,n,mxb,k,us,gbs,pct_hbm\n");
    if (!only || !strcmp(only, "pq"))
        bench_pq(quick);
    if (!only || !strcmp(only, "kmeans"))
        bench_kmeans();
    if (!only || !strcmp(only, "encode"))
        bench_encode();
    kvd_backend_free(be);
    if (csv)
        fclose(csv);
    return 0;
}
