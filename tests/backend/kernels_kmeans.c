/*
 * K-means tests: hand-computed clusters, the fast path bitwise equal to the
 * reference and independent of the thread count, empty-cluster repair,
 * sub-sampling, nearest-centroid ties, strided inputs, wrapper errors.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kvdepot/kmeans.h"
#include "testutil.h"

static void test_hand(void)
{
    float x[4] = {0, 1, 10, 11};
    float c[2];
    double in = -1;
    kvd_kmeans_params p = {2, 10, 1, 0};
    TU_CHECK(kvd_kmeans_train_ref(&p, 4, 1, x, 1, c, &in) == 0, "train");
    float lo = c[0] < c[1] ? c[0] : c[1], hi = c[0] < c[1] ? c[1] : c[0];
    TU_CHECK(lo == 0.5f && hi == 10.5f && in == 1.0, "hand: %g %g inertia %g", lo, hi, in);
    /* 2-D: four corners of two squares */
    float y[16] = {0, 0, 0, 2, 2, 0, 2, 2, 100, 100, 100, 102, 102, 100, 102, 102};
    float cy[4];
    TU_CHECK(kvd__kmeans_train_cpu(2, 1, &p, 8, 2, y, 2, cy, &in) == 0, "train 2d");
    int a = cy[0] < 50 ? 0 : 1;
    TU_CHECK(cy[2 * a] == 1 && cy[2 * a + 1] == 1 && cy[2 * (1 - a)] == 101 &&
                 cy[2 * (1 - a) + 1] == 101 && in == 16.0,
             "2d: (%g,%g) (%g,%g) inertia %g", cy[0], cy[1], cy[2], cy[3], in);
}

static void test_fast_vs_ref(void)
{
    tu_rng r;
    tu_rng_seed(&r, 8);
    const int ds[] = {1, 2, 3, 8, 17, 64};
    const int ks[] = {1, 2, 16, 256};
    const int64_t ns[] = {1, 5, 100, 3001};
    for (size_t di = 0; di < 6; di++)
        for (size_t ki = 0; ki < 4; ki++)
            for (size_t ni = 0; ni < 4; ni++) {
                int d = ds[di], k = ks[ki];
                int64_t n = ns[ni], ldx = d + (int)(di & 1) * 3;
                if ((int64_t)k * n * d > 20000000)
                    continue;
                float *x = malloc(sizeof(float) * n * ldx);
                tu_fill_normal(&r, x, n * ldx, 1.0f);
                float *c0 = malloc(sizeof(float) * k * d), *c1 = malloc(sizeof(float) * k * d);
                double i0 = 0, i1 = 0;
                kvd_kmeans_params p = {k, 6, 1000 + di, n > 1000 ? 700 : 0};
                TU_CHECK(kvd_kmeans_train_ref(&p, n, d, x, ldx, c0, &i0) == 0, "ref");
                for (int thr = 1; thr <= 3; thr++) {
                    TU_CHECK(kvd__kmeans_train_cpu(thr, 1, &p, n, d, x, ldx, c1, &i1) == 0, "fast");
                    TU_CHECK(!memcmp(c0, c1, sizeof(float) * k * d) && i0 == i1,
                             "fast != ref: n=%lld d=%d k=%d threads=%d inertia %g vs %g",
                             (long long)n, d, k, thr, i0, i1);
                }
                int finite = 1;
                for (int i = 0; i < k * d; i++)
                    finite &= isfinite(c0[i]);
                TU_CHECK(finite, "non-finite centroid n=%lld d=%d k=%d", (long long)n, d, k);
                /* assignment: fast == ref */
                uint32_t *a0 = malloc(4 * n), *a1 = malloc(4 * n);
                float *e0 = malloc(4 * n), *e1 = malloc(4 * n);
                kvd_kmeans_assign_ref(n, d, x, ldx, k, c0, a0, e0);
                kvd__kmeans_assign_cpu(2, 1, n, d, x, ldx, k, c0, a1, e1);
                TU_CHECK(!memcmp(a0, a1, 4 * n) && !memcmp(e0, e1, 4 * n), "assign fast != ref");
                free(a0);
                free(a1);
                free(e0);
                free(e1);
                free(x);
                free(c0);
                free(c1);
            }
}

/*
 * Nearest-centroid search ranks by |c|^2 - 2x.c and lets the direct form
 * decide near ties: points where the two forms disagree must still get the
 * reference's centroid and distance, bit for bit. Midpoints of two
 * centroids, points on a centroid and on duplicated ones, clusters far from
 * the origin (cancellation), far outliers, values that overflow, NaN, Inf,
 * subnormals; odd k and d; the AVX-512 and the AVX2 kernels.
 */
static void test_nearest_hard(void)
{
    tu_rng r;
    tu_rng_seed(&r, 21);
    const int ds[] = {2, 4, 5, 8}, ks[] = {9, 16, 64, 255};
    const int64_t n = 1003, ldx_pad = 3;
    for (int di = 0; di < 4; di++)
        for (int ki = 0; ki < 4; ki++)
            for (int variant = 0; variant < 3; variant++) { /* plain, a NaN centroid, tiny */
                const int bad_cb = variant == 1;
                const int d = ds[di], k = ks[ki];
                const int64_t ldx = d + (di & 1) * ldx_pad;
                float *c = malloc(sizeof(float) * k * d), *x = malloc(sizeof(float) * n * ldx);
                tu_fill_normal(&r, c, (int64_t)k * d, 1.0f);
                tu_fill_normal(&r, x, n * ldx, 1.0f);
                /* Rows in close pairs (2i, 2i + 1): the points midway between
                 * a pair are near ties of the two forms. Rows 0 and 1 equal. */
                for (int i = 2; i + 1 < k - 3; i += 2)
                    for (int t = 0; t < d; t++)
                        c[(i + 1) * d + t] = c[i * d + t] + 1e-3f * c[(i + 1) * d + t];
                memcpy(c + d, c, sizeof(float) * d);
                for (int t = 0; t < d; t++) {
                    c[(k - 1) * d + t] *= 1e4f;                                /* an outlier */
                    c[(k - 2) * d + t] = 1000.0f + c[(k - 2) * d + t] * 1e-3f; /* far, tight */
                    c[(k - 3) * d + t] = 1000.0f + c[(k - 3) * d + t] * 1e-3f;
                }
                if (bad_cb)
                    c[5 * d + 1 % d] = NAN;
                for (int64_t i = 0; i < n; i++) {
                    float *xi = x + i * ldx;
                    /* p: a pair's first row (p + 1 < k also for odd k) */
                    const int a = (int)(tu_rng_u64(&r) % k), p = 2 * (a / 2) % (k - 1);
                    switch (i % 10) {
                    case 0: /* midway between the two rows of a pair */
                    case 7:
                        for (int t = 0; t < d; t++)
                            xi[t] = 0.5f * (c[p * d + t] + c[(p + 1) * d + t]);
                        break;
                    case 1: /* on one (and on the duplicated pair) */
                        memcpy(xi, c + (i % 20 == 1 ? 0 : a) * d, sizeof(float) * d);
                        break;
                    case 2: /* by the outlier */
                        for (int t = 0; t < d; t++)
                            xi[t] = c[(k - 1) * d + t] + xi[t];
                        break;
                    case 3: /* between the two far, tight centroids */
                        for (int t = 0; t < d; t++)
                            xi[t] =
                                0.5f * (c[(k - 2) * d + t] + c[(k - 3) * d + t]) + xi[t] * 1e-7f;
                        break;
                    case 4:
                        xi[d - 1] = i % 20 == 4 ? NAN : INFINITY;
                        break;
                    case 5: /* squares overflow */
                        xi[0] = 3e19f;
                        break;
                    case 6: /* subnormal */
                        for (int t = 0; t < d; t++)
                            xi[t] *= 1e-40f;
                        break;
                    }
                }
                if (variant == 2) { /* squares and distances below FLT_MIN */
                    for (int64_t i = 0; i < (int64_t)k * d; i++)
                        c[i] *= 1e-22f;
                    for (int64_t i = 0; i < n * ldx; i++)
                        x[i] *= 1e-22f;
                }
                uint32_t *a0 = malloc(4 * n), *a1 = malloc(4 * n);
                float *e0 = malloc(4 * n), *e1 = malloc(4 * n);
                kvd_kmeans_assign_ref(n, d, x, ldx, k, c, a0, e0);
                for (int simd = 1; simd <= 2; simd++)
                    for (int thr = 1; thr <= 2; thr++) {
                        memset(a1, 0xee, 4 * n);
                        memset(e1, 0xee, 4 * n);
                        kvd__kmeans_assign_cpu(thr, simd, n, d, x, ldx, k, c, a1, e1);
                        int64_t bad = -1;
                        for (int64_t i = 0; i < n && bad < 0; i++)
                            if (a0[i] != a1[i] || memcmp(e0 + i, e1 + i, 4))
                                bad = i;
                        TU_CHECK(bad < 0,
                                 "nearest d=%d k=%d variant %d simd=%d threads=%d: point "
                                 "%lld (case %lld) got %u (%g), reference %u (%g)",
                                 d, k, variant, simd, thr, (long long)bad,
                                 (long long)(bad < 0 ? 0 : bad % 10), bad < 0 ? 0 : a1[bad],
                                 bad < 0 ? 0.0 : e1[bad], bad < 0 ? 0 : a0[bad],
                                 bad < 0 ? 0.0 : e0[bad]);
                    }
                free(a0);
                free(a1);
                free(e0);
                free(e1);
                free(x);
                free(c);
            }
}

static void test_repair(void)
{
    /* 3 distinct points (repeated) into 8 clusters: every centroid finite,
     * all distinct, inertia 0 */
    float x[30];
    for (int i = 0; i < 10; i++) {
        x[3 * i + 0] = 1.0f;
        x[3 * i + 1] = i % 3 == 0 ? 5.0f : -2.0f;
        x[3 * i + 2] = (float)(i % 3);
    }
    float c[8 * 3];
    double in = -1;
    kvd_kmeans_params p = {8, 10, 5, 0};
    TU_CHECK(kvd__kmeans_train_cpu(2, 1, &p, 10, 3, x, 3, c, &in) == 0, "repair train");
    int ok = 1;
    for (int i = 0; i < 8; i++)
        for (int j = 0; j < i; j++)
            ok &= memcmp(c + 3 * i, c + 3 * j, 12) != 0;
    for (int i = 0; i < 24; i++)
        ok &= isfinite(c[i]);
    TU_CHECK(ok, "repair: duplicate or non-finite centroids");
    TU_CHECK(in == 0.0, "repair: inertia %g", in);
    /* one point, k = 4 */
    float one[2] = {3, 4}, c4[8];
    kvd_kmeans_params p4 = {4, 3, 1, 0};
    TU_CHECK(kvd_kmeans_train_ref(&p4, 1, 2, one, 2, c4, &in) == 0 && in == 0.0, "n=1 k=4");
    /* all points identical */
    float same[40];
    for (int i = 0; i < 40; i++)
        same[i] = 2.5f;
    float cs[5 * 4];
    kvd_kmeans_params p5 = {5, 4, 9, 0};
    TU_CHECK(kvd__kmeans_train_cpu(1, 1, &p5, 10, 4, same, 4, cs, &in) == 0 && in == 0.0,
             "identical points: inertia %g", in);
}

static void test_blobs(void)
{
    /* 16 well-separated blobs in 8-D: k-means++ + Lloyd finds them */
    tu_rng r;
    tu_rng_seed(&r, 4);
    const int d = 8, k = 16;
    const int64_t n = 16 * 200;
    float centers[16 * 8], *x = malloc(sizeof(float) * n * d);
    tu_fill_uniform(&r, centers, sizeof centers / sizeof *centers, -100, 100);
    double truth = 0;
    for (int64_t i = 0; i < n; i++)
        for (int t = 0; t < d; t++) {
            float e = tu_rng_normal(&r);
            x[i * d + t] = centers[(i % k) * d + t] + e;
            truth += (double)e * e;
        }
    float c[16 * 8];
    double in = 0;
    kvd_kmeans_params p = {k, 20, 3, 0};
    TU_CHECK(kvd__kmeans_train_cpu(2, 1, &p, n, d, x, d, c, &in) == 0, "blobs");
    TU_CHECK(in < 1.1 * truth, "blobs: inertia %g vs %g", in, truth);
    free(x);
}

static void test_wrappers(void)
{
    kvd_backend *be = tu_cpu_backend(2, 0);
    tu_rng r;
    tu_rng_seed(&r, 2);
    float x[100 * 6];
    tu_fill_normal(&r, x, 600, 1.0f);
    /* (100, 4) view with a row stride of 6 floats */
    kvd_tensor tx = {KVD_DTYPE_F32, 2, {100, 4}, {24, 4}, x};
    float c[8 * 4];
    int64_t cs[2] = {8, 4};
    kvd_tensor tc = kvd_tensor_make(KVD_DTYPE_F32, c, 2, cs);
    kvd_kmeans_params p = {8, 5, 1, 0};
    kvd_error err;
    double in;
    TU_CHECK(kvd_kmeans_train(be, &p, &tx, &tc, &in, &err) == 0, "train: %s", err.msg);
    float cr[8 * 4];
    double inr;
    kvd_kmeans_train_ref(&p, 100, 4, x, 6, cr, &inr);
    TU_CHECK(!memcmp(c, cr, sizeof c) && in == inr, "strided wrapper != ref");
    tu_buf a = tu_buf_new(4 * 100), dd = tu_buf_new(4 * 100);
    int64_t n = 100;
    kvd_tensor ta = kvd_tensor_make(KVD_DTYPE_U32, a.data, 1, &n);
    kvd_tensor td = kvd_tensor_make(KVD_DTYPE_F32, dd.data, 1, &n);
    TU_CHECK(kvd_kmeans_assign(be, &tx, &tc, &ta, &td, &err) == 0 && tu_guard_ok(&a) &&
                 tu_guard_ok(&dd),
             "assign: %s", err.msg);
    kvd_kmeans_params bad = {0, 5, 1, 0};
    TU_CHECK(kvd_kmeans_train(be, &bad, &tx, &tc, &in, &err) == KVD_EINVAL, "k=0 accepted");
    kvd_kmeans_params p9 = {9, 5, 1, 0};
    TU_CHECK(kvd_kmeans_train(be, &p9, &tx, &tc, &in, &err) == KVD_EINVAL, "k mismatch accepted");
    kvd_tensor t0 = {KVD_DTYPE_F32, 2, {0, 4}, {16, 4}, x};
    TU_CHECK(kvd_kmeans_train(be, &p, &t0, &tc, &in, &err) == KVD_EINVAL, "n=0 accepted");
    tu_buf_free(&a);
    tu_buf_free(&dd);
    kvd_backend_free(be);
}

int main(void)
{
    test_hand();
    test_fast_vs_ref();
    test_nearest_hard();
    test_repair();
    test_blobs();
    test_wrappers();
    return tu_report("kernels_kmeans");
}
