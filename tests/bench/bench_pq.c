/*
 * PQ top-k search benchmark: one kv head, head_dim 128, a GQA group of 4
 * query heads, n in {32K, 128K}, m in {2, 4, 8, 16}, b in {8, 6, 4},
 * k in {256, 2048}. Prints M codes/s (n * m / seconds, best of --reps runs)
 * with one thread, with all threads, on the AVX2-only path and, for b = 4,
 * on the codes packed in blocks of 32 tokens (kvd_pq_pack4, packed before
 * the clock starts, as FAISS's FastScan index packs its codes when they are
 * added), and checks every result against the scalar reference (a
 * brute-force scan of the same codes).
 *
 *   bench_pq [--reps N] [--csv FILE] [--dump DIR]
 *
 * --dump writes the exact inputs for tests/bench/run_pq_bench.sh, which runs
 * FAISS on the same codes and queries:
 *   DIR/pq_m<m>_b<b>.centroids  (m, 2^b, 128/m) f32
 *   DIR/pq_m<m>_b<b>.codes      (131072, m) u8
 *   DIR/queries.f32             (4, 128) f32 (the GQA group)
 * (FAISS searches one query per kv head: the sum of the 4, which is what our
 * KVD_PQ_AGG_SUM ranks by; see kvdepot/pq.h.)
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kvdepot/pq.h"
#include "testutil.h"

enum { D = 128, G = 4, NMAX = 131072 };

static int write_file(const char *dir, const char *name, const void *p, size_t bytes)
{
    char path[1024];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "wb");
    if (!f || fwrite(p, 1, bytes, f) != bytes) {
        fprintf(stderr, "bench_pq: cannot write %s\n", path);
        if (f)
            fclose(f);
        return -1;
    }
    fclose(f);
    return 0;
}

static double time_search(kvd_backend *be, const kvd_tensor *tc, const kvd_tensor *tcode,
                          const kvd_tensor *tq, const kvd_pq_search_params *p, kvd_tensor *ti,
                          kvd_tensor *ts, int reps)
{
    double best = 1e30;
    int64_t nout;
    kvd_error err;
    for (int r = 0; r < reps; r++) {
        double t0 = tu_now();
        if (kvd_pq_search(be, tc, tcode, tq, p, ti, ts, &nout, &err)) {
            fprintf(stderr, "bench_pq: search failed: %s\n", err.msg);
            exit(1);
        }
        double t = tu_now() - t0;
        if (t < best)
            best = t;
    }
    return best;
}

/* One thread, no backend: rows on the AVX2-only path (what CPUs without
 * AVX-512 VBMI run), or 4-bit codes packed by kvd_pq_pack4. */
static double time_cpu(int64_t n, int m, int b, const float *cent, const uint8_t *codes, int packed,
                       const float *q, const kvd_pq_search_params *p, uint32_t *idx, float *sc,
                       int reps)
{
    double best = 1e30;
    int64_t nout;
    for (int r = 0; r < reps; r++) {
        double t0 = tu_now();
        int rc =
            packed ? kvd__pq_search_packed4_cpu(1, 1, n, m, D, cent, codes, G, q, p, idx, sc, &nout)
                   : kvd__pq_search_cpu(1, 2, n, m, b, D, cent, codes, G, q, p, idx, sc, &nout);
        if (rc) {
            fprintf(stderr, "bench_pq: search failed (%d)\n", rc);
            exit(1);
        }
        double t = tu_now() - t0;
        if (t < best)
            best = t;
    }
    return best;
}

int main(int argc, char **argv)
{
    int reps = 20;
    const char *csv = NULL, *dump = NULL;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--reps") && i + 1 < argc)
            reps = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--csv") && i + 1 < argc)
            csv = argv[++i];
        else if (!strcmp(argv[i], "--dump") && i + 1 < argc)
            dump = argv[++i];
        else {
            fprintf(stderr, "usage: bench_pq [--reps N] [--csv FILE] [--dump DIR]\n");
            return 2;
        }
    }
    long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
    int nall = ncpu > 0 ? (int)ncpu : 1;
    kvd_backend *be1 = tu_cpu_backend(1, 0), *bea = tu_cpu_backend(nall, 0);

    /* LLM-like keys; queries correlated with some keys so that the top
     * scores stand out as they do in real attention. */
    tu_rng rng;
    tu_rng_seed(&rng, 2024);
    float *keys = malloc(sizeof(float) * (size_t)NMAX * D);
    tu_kv_opts o = {4, 20.0f, 0.3f, 1};
    tu_gen_kv(&rng, keys, NMAX, D, &o);
    float q[G * D];
    for (int h = 0; h < G; h++) {
        const float *src = keys + (size_t)tu_rng_below(&rng, NMAX) * D;
        for (int t = 0; t < D; t++)
            q[h * D + t] = src[t] + 0.5f * tu_rng_normal(&rng);
    }
    if (dump && write_file(dump, "queries.f32", q, sizeof q))
        return 1;

    FILE *fc = csv ? fopen(csv, "w") : NULL;
    if (fc)
        fprintf(fc, "n,m,b,k,threads,mcodes_per_s,seconds\n");
    printf("kvdepot PQ search, head_dim %d, GQA group %d, best of %d runs, %d threads max\n", D, G,
           reps, nall);
    printf("%7s %3s %2s %5s | %12s %12s %14s %16s | %s\n", "n", "m", "b", "k", "1 thr Mc/s",
           "all Mc/s", "AVX2 1thr Mc/s", "packed 1thr Mc/s", "= brute force");

    const int ms[] = {2, 4, 8, 16}, bs[] = {8, 6, 4}, ks[] = {256, 2048};
    /* BENCH_PQ_ONLY="B M": only b-bit codes with m sub-spaces (for perf) */
    int only_b = 0, only_m = 0;
    if (getenv("BENCH_PQ_ONLY"))
        sscanf(getenv("BENCH_PQ_ONLY"), "%d %d", &only_b, &only_m);
    const int64_t ns[] = {32768, 131072};
    int bad = 0;
    for (int bi = 0; bi < 3; bi++)
        for (int mi = 0; mi < 4; mi++) {
            int m = ms[mi], b = bs[bi], ksub = 1 << b;
            if ((only_b && b != only_b) || (only_m && m != only_m))
                continue;
            float *cent = malloc(sizeof(float) * (size_t)ksub * D);
            uint8_t *codes = malloc((size_t)NMAX * m);
            int64_t cs[3] = {m, ksub, D / m}, kshape[2] = {NMAX, D}, cds[2] = {NMAX, m};
            kvd_tensor tc = kvd_tensor_make(KVD_DTYPE_F32, cent, 3, cs);
            kvd_tensor tk = kvd_tensor_make(KVD_DTYPE_F32, keys, 2, kshape);
            kvd_tensor tcode = kvd_tensor_make(KVD_DTYPE_U8, codes, 2, cds);
            kvd_kmeans_params km = {0, 10, 7, 64 * ksub};
            kvd_error err;
            if (kvd_pq_train(bea, &tk, &km, &tc, &err) || kvd_pq_encode(bea, &tk, &tc, &tcode, &err)) {
                fprintf(stderr, "bench_pq: train/encode: %s\n", err.msg);
                return 1;
            }
            uint8_t *packed = NULL;
            if (b == 4) {
                packed = malloc((size_t)kvd_pq_packed4_bytes(NMAX, m));
                kvd_pq_pack4(NMAX, m, codes, packed);
            }
            if (dump) {
                char name[64];
                snprintf(name, sizeof name, "pq_m%d_b%d.centroids", m, b);
                if (write_file(dump, name, cent, sizeof(float) * (size_t)ksub * D))
                    return 1;
                snprintf(name, sizeof name, "pq_m%d_b%d.codes", m, b);
                if (write_file(dump, name, codes, (size_t)NMAX * m))
                    return 1;
            }
            for (int ni = 0; ni < 2; ni++)
                for (int ki = 0; ki < 2; ki++) {
                    int64_t n = ns[ni];
                    int64_t qs[2] = {G, D}, cdn[2] = {n, m}, kk = ks[ki];
                    kvd_tensor tq = kvd_tensor_make(KVD_DTYPE_F32, q, 2, qs);
                    kvd_tensor tcn = kvd_tensor_make(KVD_DTYPE_U8, codes, 2, cdn);
                    kvd_pq_search_params p = {kk, 0, 0, KVD_PQ_AGG_SUM};
                    uint32_t *idx = malloc(4 * kk), *ridx = malloc(4 * kk);
                    float *sc = malloc(4 * kk), *rsc = malloc(4 * kk);
                    kvd_tensor ti = kvd_tensor_make(KVD_DTYPE_U32, idx, 1, &kk);
                    kvd_tensor ts = kvd_tensor_make(KVD_DTYPE_F32, sc, 1, &kk);
                    double t1 = time_search(be1, &tc, &tcn, &tq, &p, &ti, &ts, reps);
                    double ta = time_search(bea, &tc, &tcn, &tq, &p, &ti, &ts, reps);
                    double t2 = time_cpu(n, m, b, cent, codes, 0, q, &p, idx, sc, reps);
                    int64_t rn = 0;
                    kvd_pq_search_ref(n, m, b, D, cent, codes, G, q, &p, ridx, rsc, &rn);
                    int ok = rn == kk && !memcmp(ridx, idx, 4 * kk) && !memcmp(rsc, sc, 4 * kk);
                    double t3 = 0;
                    if (packed) { /* the first n tokens of the packed blocks */
                        t3 = time_cpu(n, m, b, cent, packed, 1, q, &p, idx, sc, reps);
                        ok = ok && !memcmp(ridx, idx, 4 * kk) && !memcmp(rsc, sc, 4 * kk);
                    }
                    bad += !ok;
                    double codes_n = (double)n * m;
                    char pk[32] = "-";
                    if (packed)
                        snprintf(pk, sizeof pk, "%.0f", codes_n / t3 / 1e6);
                    printf("%7lld %3d %2d %5lld | %12.0f %12.0f %14.0f %16s | %s\n", (long long)n,
                           m, b, (long long)kk, codes_n / t1 / 1e6, codes_n / ta / 1e6,
                           codes_n / t2 / 1e6, pk, ok ? "yes" : "NO");
                    if (fc) {
                        fprintf(fc, "%lld,%d,%d,%lld,1,%.1f,%.9f\n", (long long)n, m, b,
                                (long long)kk, codes_n / t1 / 1e6, t1);
                        fprintf(fc, "%lld,%d,%d,%lld,%d,%.1f,%.9f\n", (long long)n, m, b,
                                (long long)kk, nall, codes_n / ta / 1e6, ta);
                        fprintf(fc, "%lld,%d,%d,%lld,avx2,%.1f,%.9f\n", (long long)n, m, b,
                                (long long)kk, codes_n / t2 / 1e6, t2);
                        if (packed)
                            fprintf(fc, "%lld,%d,%d,%lld,packed,%.1f,%.9f\n", (long long)n, m, b,
                                    (long long)kk, codes_n / t3 / 1e6, t3);
                    }
                    free(idx);
                    free(ridx);
                    free(sc);
                    free(rsc);
                }
            free(cent);
            free(codes);
            free(packed);
        }
    if (fc)
        fclose(fc);
    free(keys);
    kvd_backend_free(be1);
    kvd_backend_free(bea);
    if (bad)
        fprintf(stderr, "bench_pq: %d results differ from brute force\n", bad);
    return bad ? 1 : 0;
}
