/*
 * SVD reduction (ZACK) building blocks: Gram accumulation, the Jacobi
 * eigen-decomposition (reconstruction, orthonormality, order, a hand case),
 * kept widths from a removal rate, projection fast = reference and its
 * inverse. Attention on reduced dims is tested in kernels_attn.c.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kvdepot/svd.h"
#include "testutil.h"

static void test_eigen(tu_rng *rng)
{
    /* eigen-decomposition reconstructs, R orthonormal, eigenvalues descending */
    const int ns[] = {1, 2, 5, 64, 128};
    for (size_t ni = 0; ni < sizeof ns / sizeof *ns; ni++) {
        int n = ns[ni];
        double *a = calloc((size_t)n * n, sizeof(double)), *ev = malloc(sizeof(double) * n),
               *V = malloc(sizeof(double) * n * n);
        float *x = malloc(sizeof(float) * (size_t)3 * n * n);
        tu_fill_normal(rng, x, (size_t)3 * n * n, 1.0f);
        TU_CHECK(kvd_svd_gram_accumulate(a, n, x, KVD_DTYPE_F32, 3 * n, 4 * n, 1.0, NULL) == 0, "gram");
        TU_CHECK(kvd_svd_eigh(a, n, ev, V, NULL) == 0, "eigh n=%d", n);
        double anorm = 0, rerr = 0, oerr = 0;
        for (int i = 0; i < n; i++)
            for (int j = 0; j < n; j++) {
                double r = 0, o = 0;
                for (int k = 0; k < n; k++) {
                    r += V[i * n + k] * ev[k] * V[j * n + k];
                    o += V[k * n + i] * V[k * n + j];
                }
                anorm += a[i * n + j] * a[i * n + j];
                rerr += (r - a[i * n + j]) * (r - a[i * n + j]);
                oerr = fmax(oerr, fabs(o - (i == j)));
            }
        TU_CHECK(sqrt(rerr / anorm) < 1e-10, "eigh n=%d reconstruction %.3g", n, sqrt(rerr / anorm));
        TU_CHECK(oerr < 1e-10, "eigh n=%d orthonormality %.3g", n, oerr);
        for (int i = 1; i < n; i++)
            TU_CHECK(ev[i] <= ev[i - 1], "eigh n=%d order", n);
        free(a), free(ev), free(V), free(x);
    }
    /* hand case: diag(1, 4, 2) -> 4, 2, 1 with unit vectors e1, e2, e0 */
    double dm[9] = {1, 0, 0, 0, 4, 0, 0, 0, 2}, ev[3], V[9];
    TU_CHECK(kvd_svd_eigh(dm, 3, ev, V, NULL) == 0, "eigh diag");
    TU_CHECK(ev[0] == 4 && ev[1] == 2 && ev[2] == 1 && V[1 * 3 + 0] == 1 && V[2 * 3 + 1] == 1 && V[0 * 3 + 2] == 1,
             "eigh diag values");
    /* kept widths */
    float sv[4] = {4, 3, 2, 1};
    TU_CHECK(kvd_svd_kept_width(sv, 4, 0.0, 1) == 4, "rate 0 keeps all");
    TU_CHECK(kvd_svd_kept_width(sv, 4, 0.1, 1) == 3, "rate 0.1 -> 3, got %d", kvd_svd_kept_width(sv, 4, 0.1, 1));
    TU_CHECK(kvd_svd_kept_width(sv, 4, 0.3, 1) == 2, "rate 0.3 -> 2");
    TU_CHECK(kvd_svd_kept_width(sv, 4, 0.3, 3) == 3, "rate 0.3 align 3 -> 3");
    TU_CHECK(kvd_svd_kept_width(sv, 4, 1.0, 1) == 1, "rate 1 keeps 1");

}

/* The Gram matrix, accumulated onto what it held, equals the plain loop's
 * sums bit for bit: weight != 1, an odd width, zero entries skipped. */
static void test_gram_bits(tu_rng *rng)
{
    const int D = 37, n = 50;
    const double w = 0.7;
    float *x = malloc(sizeof(float) * n * D);
    double *g = malloc(sizeof(double) * D * D), *want = malloc(sizeof(double) * D * D);
    tu_fill_normal(rng, x, (size_t)n * D, 1.0f);
    x[5] = 0.0f;
    for (int i = 0; i < D * D; i++)
        g[i] = want[i] = 0.25 * (i % 7);
    for (int i = 0; i < D; i++) /* symmetric start: the sums read the upper triangle */
        for (int j = 0; j < i; j++)
            g[i * D + j] = want[i * D + j] = g[j * D + i];
    for (int t = 0; t < n; t++)
        for (int i = 0; i < D; i++) {
            double wi = w * (double)x[t * D + i];
            if (wi == 0.0)
                continue;
            for (int j = i; j < D; j++)
                want[i * D + j] += wi * (double)x[t * D + j];
        }
    for (int i = 0; i < D; i++)
        for (int j = 0; j < i; j++)
            want[i * D + j] = want[j * D + i];
    TU_CHECK(kvd_svd_gram_accumulate(g, D, x, KVD_DTYPE_F32, n, 4 * D, w, NULL) == 0, "gram");
    TU_CHECK(memcmp(g, want, sizeof(double) * D * D) == 0, "gram = the plain loop, bit for bit");
    free(x), free(g), free(want);
}

static void test_project(tu_rng *rng, kvd_backend *fast, kvd_backend *ref)
{
    const int D = 128;
    const int64_t n = 333;
    float *R = malloc(sizeof(float) * D * D), *x = malloc(sizeof(float) * n * D);
    float *y1 = malloc(sizeof(float) * n * D), *y2 = malloc(sizeof(float) * n * D), *xb = malloc(sizeof(float) * n * D);
    double *g = calloc((size_t)D * D, sizeof(double));
    float sv[128];
    tu_fill_normal(rng, x, (size_t)n * D, 1.0f);
    TU_CHECK(kvd_svd_gram_accumulate(g, D, x, KVD_DTYPE_F32, n, 4 * D, 1.0, NULL) == 0, "gram");
    TU_CHECK(kvd_svd_rotation(g, D, R, sv, NULL) == 0, "rotation");
    for (int i = 1; i < D; i++)
        TU_CHECK(sv[i] <= sv[i - 1] && sv[i] >= 0, "singular values descending");
    const int rs[] = {0, 1, 31, 64, 128};
    for (int ri = 0; ri < 5; ri++) {
        int r = rs[ri];
        TU_CHECK(kvd_svd_project(fast, R, D, r, x, KVD_DTYPE_F32, n, 4 * D, y1, NULL) == 0, "project fast");
        TU_CHECK(kvd_svd_project(ref, R, D, r, x, KVD_DTYPE_F32, n, 4 * D, y2, NULL) == 0, "project ref");
        TU_CHECK(tu_nmse(y2, y1, (size_t)n * r) < 1e-12, "project r=%d fast vs ref", r);
    }
    /* full width: unproject(project(x)) = x; energy is kept (R orthonormal) */
    TU_CHECK(kvd_svd_unproject(fast, R, D, D, y1, n, xb, NULL) == 0, "unproject");
    TU_CHECK(tu_max_abs_diff(x, xb, (size_t)n * D) < 1e-4, "round trip");
    /* The fast back-projection (tiles of four rows, blocks of 8 output
     * dimensions, the rows and dimensions left over) gives the reference's
     * bits: widths 0, 1, 37 and D; an odd head_dim below. */
    {
        const int ru[] = {0, 1, 37, 128};
        float *z = malloc(sizeof(float) * n * D);
        for (int ri = 0; ri < 4; ri++) {
            TU_CHECK(kvd_svd_unproject(fast, R, D, ru[ri], y1, n, xb, NULL) == 0, "unproject fast");
            TU_CHECK(kvd_svd_unproject(ref, R, D, ru[ri], y1, n, z, NULL) == 0, "unproject ref");
            TU_CHECK(memcmp(xb, z, sizeof(float) * (size_t)n * D) == 0,
                     "unproject r=%d: fast = reference, bit for bit", ru[ri]);
        }
        const int Do = 44, ro = 27;
        const int64_t no = 11;
        float *Ro = malloc(sizeof(float) * Do * Do), *yo = malloc(sizeof(float) * no * ro);
        float *xo = malloc(sizeof(float) * no * Do);
        tu_fill_normal(rng, Ro, (size_t)Do * Do, 0.3f);
        tu_fill_normal(rng, yo, (size_t)no * ro, 1.0f);
        TU_CHECK(kvd_svd_unproject(fast, Ro, Do, ro, yo, no, xo, NULL) == 0, "unproject odd fast");
        kvd_cpu_svd_unproject_ref(Ro, Do, ro, yo, no, z);
        TU_CHECK(memcmp(xo, z, sizeof(float) * (size_t)no * Do) == 0,
                 "unproject D=44 r=27: fast = reference, bit for bit");
        free(Ro), free(yo), free(xo), free(z);
        /* Sums that cancel: 1e20 - 1e20 + 1 is 1 only summed from j = 0. */
        float Rc[16 * 16] = {0}, yc[4 * 3], xc[4 * 16];
        for (int i = 0; i < 16; i++)
            for (int jj = 0; jj < 3; jj++)
                Rc[i * 16 + jj] = 1.0f;
        for (int t = 0; t < 4; t++)
            yc[t * 3] = 1e20f, yc[t * 3 + 1] = -1e20f, yc[t * 3 + 2] = 1.0f;
        TU_CHECK(kvd_svd_unproject(fast, Rc, 16, 3, yc, 4, xc, NULL) == 0, "unproject cancel");
        int ones = 0;
        for (int i = 0; i < 4 * 16; i++)
            ones += xc[i] == 1.0f;
        TU_CHECK(ones == 4 * 16, "unproject sums in the reference's order (%d of 64 are 1)", ones);
    }
    /* The tiles of four rows (R's 16-column blocks packed, 8-column
     * blocks and the column tail read in place) give the bits of the
     * one-row path, row by row. */
    {
        const int rb[] = {64, 37};
        for (int ri = 0; ri < 2; ri++) {
            const int r = rb[ri];
            TU_CHECK(kvd_svd_project(fast, R, D, r, x, KVD_DTYPE_F32, n, 4 * D, y1, NULL) == 0,
                     "project tiles");
            for (int64_t t = 0; t < n; t++)
                TU_CHECK(kvd_svd_project(fast, R, D, r, x + t * D, KVD_DTYPE_F32, 1, 4 * D,
                                         y2 + t * r, NULL) == 0,
                         "project one row");
            TU_CHECK(memcmp(y1, y2, sizeof(float) * (size_t)n * r) == 0,
                     "project r=%d: tiles = one row at a time, bit for bit", r);
        }
    }
    /* f16 input equals f32 input of the same values */
    uint16_t *xh = malloc(2u * n * D);
    tu_f32_to_f16(xh, x, (size_t)n * D);
    tu_f16_to_f32(x, xh, (size_t)n * D);
    TU_CHECK(kvd_svd_project(fast, R, D, 64, xh, KVD_DTYPE_F16, n, 2 * D, y1, NULL) == 0, "project f16");
    kvd_cpu_svd_project_ref(R, D, 64, x, KVD_DTYPE_F32, n, 4 * D, y2);
    TU_CHECK(tu_nmse(y2, y1, (size_t)n * 64) < 1e-12, "project f16 = f32");
    /* An odd head_dim and width, rows with padding between them, every
     * dtype: the four-row tiles, their 16- and 8-column blocks, the column
     * tail and the rows left over, against the reference. */
    {
        const int Do = 44, ro = 27, ld = 50;
        const int64_t no = 11;
        float *Ro = malloc(sizeof(float) * Do * Do), *xo = malloc(sizeof(float) * no * ld);
        float *yo = malloc(sizeof(float) * no * ro), *yr = malloc(sizeof(float) * no * ro);
        uint16_t *xo16 = malloc(2u * no * ld);
        tu_fill_normal(rng, Ro, (size_t)Do * Do, 0.3f);
        tu_fill_normal(rng, xo, (size_t)no * ld, 1.0f);
        for (int dt = 0; dt < 3; dt++) {
            kvd_dtype t = dt == 0 ? KVD_DTYPE_F32 : dt == 1 ? KVD_DTYPE_F16 : KVD_DTYPE_BF16;
            const void *src = xo;
            if (dt) { /* the f32 rows hold the 16-bit values exactly */
                if (dt == 1) {
                    tu_f32_to_f16(xo16, xo, (size_t)no * ld);
                    tu_f16_to_f32(xo, xo16, (size_t)no * ld);
                } else {
                    tu_f32_to_bf16(xo16, xo, (size_t)no * ld);
                    tu_bf16_to_f32(xo, xo16, (size_t)no * ld);
                }
                src = xo16;
            }
            TU_CHECK(kvd_svd_project(fast, Ro, Do, ro, src, t, no, (int64_t)ld * (dt ? 2 : 4), yo,
                                     NULL) == 0,
                     "project odd shape");
            kvd_cpu_svd_project_ref(Ro, Do, ro, xo, KVD_DTYPE_F32, no, (int64_t)ld * 4, yr);
            TU_CHECK(tu_nmse(yr, yo, (size_t)no * ro) < 1e-12, "project D=44 r=27 dtype %d", dt);
        }
        free(Ro), free(xo), free(yo), free(yr), free(xo16);
    }
    /* bad arguments */
    TU_CHECK(kvd_svd_project(fast, R, D, D + 1, x, KVD_DTYPE_F32, n, 4 * D, y1, NULL) == KVD_EINVAL, "r > D");
    TU_CHECK(kvd_svd_project(fast, R, D, 4, x, KVD_DTYPE_I32, n, 4 * D, y1, NULL) == KVD_EINVAL, "dtype");
    double bad[4] = {1, NAN, NAN, 1}, ev[2], V[4];
    TU_CHECK(kvd_svd_eigh(bad, 2, ev, V, NULL) == KVD_EINVAL, "NaN matrix rejected");
    free(R), free(x), free(y1), free(y2), free(xb), free(g), free(xh);
}

int main(void)
{
    tu_rng rng;
    tu_rng_seed(&rng, 77);
    kvd_backend *fast = tu_cpu_backend(2, 0), *ref = tu_cpu_backend(1, 1);
    test_eigen(&rng);
    test_gram_bits(&rng);
    test_project(&rng, fast, ref);
    kvd_backend_free(fast);
    kvd_backend_free(ref);
    return tu_report("kernels_svd");
}
