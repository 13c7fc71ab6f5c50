/*
 * SVD dimension reduction (ZACK): Gram accumulation, symmetric
 * eigen-decomposition, rotation, kept width, projection. See kvdepot/svd.h.
 *
 * The eigen-decomposition is offline (once per model calibration) on
 * head_dim x head_dim matrices, so a cyclic Jacobi in double precision is
 * used: simple, unconditionally stable for symmetric input, and accurate to
 * a few ulps of the largest eigenvalue. (LAPACK's dsyev would do the same
 * work; it is not a dependency of kvdepot.)
 */
#include "kvdepot/svd.h"

#include <immintrin.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common/cpu_internal.h"

/* gi[j] += wi * row[j] for j in [j0, D): 4 at a time, the product and the
 * sum rounded apart as the scalar loop rounds them (no FMA): its bits. */
__attribute__((target("avx2"))) static void gram_row_avx2(double *gi, double wi, const double *row,
                                                          int j0, int D)
{
    const __m256d w = _mm256_set1_pd(wi);
    int j = j0;
    for (; j + 4 <= D; j += 4)
        _mm256_storeu_pd(gi + j, _mm256_add_pd(_mm256_loadu_pd(gi + j),
                                               _mm256_mul_pd(w, _mm256_loadu_pd(row + j))));
    for (; j < D; j++)
        gi[j] += wi * row[j];
}

int kvd_svd_gram_accumulate(double *gram, int D, const void *x, kvd_dtype dtype, int64_t n,
                            int64_t row_stride, double weight, kvd_error *err)
{
    const int simd = kvd__cpu_has_avx2_fma_f16c();
    if (!gram || D <= 0 || n < 0 || !kvd_dtype_is_float(dtype) || (n > 0 && !x))
        return kvd_error_set(err, KVD_EINVAL, "svd gram: bad arguments (D %d, n %lld, dtype %s)", D,
                             (long long)n, kvd_dtype_name(dtype));
    size_t es = kvd_dtype_size(dtype);
    double *row = malloc(sizeof(double) * (size_t)D);
    if (!row)
        return kvd_error_set(err, KVD_ENOMEM, "svd gram: out of memory");
    for (int64_t t = 0; t < n; t++) {
        const char *xr = (const char *)x + t * row_stride;
        for (int i = 0; i < D; i++)
            row[i] = kvd__load_float(xr + (size_t)i * es, dtype);
        /* upper triangle, mirrored below */
        for (int i = 0; i < D; i++) {
            double wi = weight * row[i];
            if (wi == 0.0)
                continue;
            double *gi = gram + (size_t)i * D;
            if (simd) {
                gram_row_avx2(gi, wi, row, i, D);
                continue;
            }
            for (int j = i; j < D; j++)
                gi[j] += wi * row[j];
        }
    }
    for (int i = 0; i < D; i++)
        for (int j = 0; j < i; j++)
            gram[(size_t)i * D + j] = gram[(size_t)j * D + i];
    free(row);
    return 0;
}

int kvd_svd_eigh(const double *a, int n, double *evals, double *evecs, kvd_error *err)
{
    if (!a || n <= 0 || n > 1024 || !evals || !evecs)
        return kvd_error_set(err, KVD_EINVAL, "svd eigh: bad arguments (n %d)", n);
    for (size_t i = 0; i < (size_t)n * n; i++)
        if (!isfinite(a[i]))
            return kvd_error_set(err, KVD_EINVAL, "svd eigh: matrix has a non-finite entry");
    double *m = malloc(sizeof(double) * (size_t)n * n);
    if (!m)
        return kvd_error_set(err, KVD_ENOMEM, "svd eigh: out of memory");
    memcpy(m, a, sizeof(double) * (size_t)n * n);
    double *v = evecs;
    for (int i = 0; i < n; i++)
        for (int j = 0; j < n; j++)
            v[(size_t)i * n + j] = i == j;
    int converged = 0;
    for (int sweep = 0; sweep < 100 && !converged; sweep++) {
        double off = 0.0, diag = 0.0;
        for (int i = 0; i < n; i++) {
            diag += m[(size_t)i * n + i] * m[(size_t)i * n + i];
            for (int j = i + 1; j < n; j++)
                off += m[(size_t)i * n + j] * m[(size_t)i * n + j];
        }
        if (off <= 1e-30 * diag || off == 0.0) {
            converged = 1;
            break;
        }
        for (int p = 0; p < n - 1; p++)
            for (int q = p + 1; q < n; q++) {
                double apq = m[(size_t)p * n + q];
                if (fabs(apq) < 1e-300)
                    continue;
                double app = m[(size_t)p * n + p], aqq = m[(size_t)q * n + q];
                /* rotation angle that zeroes m[p][q] (Golub & Van Loan 8.4) */
                double tau = (aqq - app) / (2.0 * apq);
                double t = (tau >= 0 ? 1.0 : -1.0) / (fabs(tau) + sqrt(1.0 + tau * tau));
                double c = 1.0 / sqrt(1.0 + t * t), s = t * c;
                for (int k = 0; k < n; k++) { /* columns p, q */
                    double mkp = m[(size_t)k * n + p], mkq = m[(size_t)k * n + q];
                    m[(size_t)k * n + p] = c * mkp - s * mkq;
                    m[(size_t)k * n + q] = s * mkp + c * mkq;
                }
                for (int k = 0; k < n; k++) { /* rows p, q */
                    double mpk = m[(size_t)p * n + k], mqk = m[(size_t)q * n + k];
                    m[(size_t)p * n + k] = c * mpk - s * mqk;
                    m[(size_t)q * n + k] = s * mpk + c * mqk;
                }
                for (int k = 0; k < n; k++) {
                    double vkp = v[(size_t)k * n + p], vkq = v[(size_t)k * n + q];
                    v[(size_t)k * n + p] = c * vkp - s * vkq;
                    v[(size_t)k * n + q] = s * vkp + c * vkq;
                }
            }
    }
    if (!converged) {
        free(m);
        return kvd_error_set(err, KVD_EINTERNAL, "svd eigh: Jacobi did not converge");
    }
    for (int i = 0; i < n; i++)
        evals[i] = m[(size_t)i * n + i];
    free(m);
    /* sort descending (selection sort: n is small), columns follow */
    for (int i = 0; i < n; i++) {
        int best = i;
        for (int j = i + 1; j < n; j++)
            if (evals[j] > evals[best])
                best = j;
        if (best != i) {
            double e = evals[i];
            evals[i] = evals[best];
            evals[best] = e;
            for (int k = 0; k < n; k++) {
                double x = v[(size_t)k * n + i];
                v[(size_t)k * n + i] = v[(size_t)k * n + best];
                v[(size_t)k * n + best] = x;
            }
        }
    }
    /* deterministic sign: the largest |entry| of each column is positive */
    for (int i = 0; i < n; i++) {
        int arg = 0;
        for (int k = 1; k < n; k++)
            if (fabs(v[(size_t)k * n + i]) > fabs(v[(size_t)arg * n + i]))
                arg = k;
        if (v[(size_t)arg * n + i] < 0)
            for (int k = 0; k < n; k++)
                v[(size_t)k * n + i] = -v[(size_t)k * n + i];
    }
    return 0;
}

int kvd_svd_rotation(const double *gram, int D, float *R, float *sv, kvd_error *err)
{
    if (!R || !sv)
        return kvd_error_set(err, KVD_EINVAL, "svd rotation: NULL output");
    double *ev = malloc(sizeof(double) * (size_t)D), *vec = malloc(sizeof(double) * (size_t)D * D);
    if (!ev || !vec) {
        free(ev);
        free(vec);
        return kvd_error_set(err, KVD_ENOMEM, "svd rotation: out of memory");
    }
    int rc = kvd_svd_eigh(gram, D, ev, vec, err);
    if (!rc) {
        for (int i = 0; i < D; i++)
            sv[i] = (float)sqrt(ev[i] > 0.0 ? ev[i] : 0.0);
        for (size_t i = 0; i < (size_t)D * D; i++)
            R[i] = (float)vec[i];
    }
    free(ev);
    free(vec);
    return rc;
}

int kvd_svd_kept_width(const float *sv, int D, double rate, int align)
{
    if (D <= 0)
        return 0;
    if (align < 1)
        align = 1;
    if (!(rate > 0.0))
        return D;
    double total = 0.0;
    for (int i = 0; i < D; i++)
        total += sv[i] > 0 ? sv[i] : 0;
    if (total <= 0.0)
        return align < D ? align : D;
    /* smallest r with sum_{i >= r} s_i <= rate * total */
    int r = D;
    double tail = 0.0;
    for (int i = D - 1; i >= 0; i--) {
        double s = sv[i] > 0 ? sv[i] : 0;
        if (tail + s > rate * total)
            break;
        tail += s;
        r = i;
    }
    r = (r + align - 1) / align * align;
    if (r < align)
        r = align;
    return r > D ? D : r;
}

void kvd_cpu_svd_project_ref(const float *R, int D, int r, const void *x, kvd_dtype dtype,
                             int64_t n, int64_t x_stride, float *y)
{
    size_t es = kvd_dtype_size(dtype);
    for (int64_t t = 0; t < n; t++) {
        const char *xr = (const char *)x + t * x_stride;
        for (int j = 0; j < r; j++) {
            double acc = 0.0;
            for (int i = 0; i < D; i++)
                acc += (double)kvd__load_float(xr + (size_t)i * es, dtype) * R[(size_t)i * D + j];
            y[t * r + j] = (float)acc;
        }
    }
}

/* y_t = sum_i x_ti R[i, :r]: rows of R stream contiguously, the compiler
 * vectorises the inner loop with AVX2/FMA. */
__attribute__((target("avx2,fma"))) static void project_rows_avx2(const float *R, int D, int r,
                                                                  const float *x, float *y)
{
    for (int j = 0; j < r; j++)
        y[j] = 0.0f;
    for (int i = 0; i < D; i++) {
        float xi = x[i];
        const float *Ri = R + (size_t)i * D;
        for (int j = 0; j < r; j++)
            y[j] += xi * Ri[j];
    }
}

/* The first r / 16 blocks of 16 columns of R, each block's D rows of 16
 * side by side (Rp[(j / 16) * 16 * D + i * 16 + j % 16] = R[i * D + j]).
 * In R itself a block's rows lie D floats apart; at D = 128 (512 bytes)
 * they fall into 8 of the 64 sets of a 32 KiB L1 cache and evict each
 * other, so every load of the tile loop came from L2. NULL when r < 16 or
 * out of memory: the tiles then read R as it is. */
static float *pack_blocks16(const float *R, int D, int r)
{
    const int nb = r / 16;
    float *Rp = nb ? malloc(sizeof(float) * 16 * (size_t)D * (size_t)nb) : NULL;
    for (int b = 0; Rp && b < nb; b++)
        for (int i = 0; i < D; i++)
            memcpy(Rp + ((size_t)b * D + (size_t)i) * 16, R + (size_t)i * D + (size_t)b * 16,
                   sizeof(float) * 16);
    return Rp;
}

/* Four rows at once (x: 4 rows of D, y: 4 rows of r): every load of a row
 * of R serves the four tokens and every broadcast of x 16 columns, with
 * the 4 x 16 sums in registers; columns past the last multiple of 8 are
 * summed one by one. A product and a sum, each rounded, per input dimension
 * in order from 0 (no FMA): the bits of the one-row path, and of the CUDA
 * backend's projection, so a page codes to the same bytes everywhere. Rp:
 * R's 16-column blocks packed (pack_blocks16), or NULL. */
__attribute__((target("avx2"))) static void project4_avx2(const float *R, const float *Rp, int D,
                                                          int r, const float *x, float *y)
{
    const float *x0 = x, *x1 = x + D, *x2 = x + 2 * (size_t)D, *x3 = x + 3 * (size_t)D;
    const size_t rs = Rp ? 16 : (size_t)D;
    int j = 0;
    for (; j + 16 <= r; j += 16) {
        const float *Rb = Rp ? Rp + (size_t)j * D : R + j;
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0,
               a7 = a0;
        for (int i = 0; i < D; i++) {
            const float *Ri = Rb + (size_t)i * rs;
            const __m256 r0 = _mm256_loadu_ps(Ri), r1 = _mm256_loadu_ps(Ri + 8);
            __m256 s = _mm256_broadcast_ss(x0 + i);
            a0 = _mm256_add_ps(a0, _mm256_mul_ps(s, r0));
            a1 = _mm256_add_ps(a1, _mm256_mul_ps(s, r1));
            s = _mm256_broadcast_ss(x1 + i);
            a2 = _mm256_add_ps(a2, _mm256_mul_ps(s, r0));
            a3 = _mm256_add_ps(a3, _mm256_mul_ps(s, r1));
            s = _mm256_broadcast_ss(x2 + i);
            a4 = _mm256_add_ps(a4, _mm256_mul_ps(s, r0));
            a5 = _mm256_add_ps(a5, _mm256_mul_ps(s, r1));
            s = _mm256_broadcast_ss(x3 + i);
            a6 = _mm256_add_ps(a6, _mm256_mul_ps(s, r0));
            a7 = _mm256_add_ps(a7, _mm256_mul_ps(s, r1));
        }
        _mm256_storeu_ps(y + j, a0);
        _mm256_storeu_ps(y + j + 8, a1);
        _mm256_storeu_ps(y + r + j, a2);
        _mm256_storeu_ps(y + r + j + 8, a3);
        _mm256_storeu_ps(y + 2 * r + j, a4);
        _mm256_storeu_ps(y + 2 * r + j + 8, a5);
        _mm256_storeu_ps(y + 3 * r + j, a6);
        _mm256_storeu_ps(y + 3 * r + j + 8, a7);
    }
    for (; j + 8 <= r; j += 8) {
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (int i = 0; i < D; i++) {
            const __m256 r0 = _mm256_loadu_ps(R + (size_t)i * D + j);
            a0 = _mm256_add_ps(a0, _mm256_mul_ps(_mm256_broadcast_ss(x0 + i), r0));
            a1 = _mm256_add_ps(a1, _mm256_mul_ps(_mm256_broadcast_ss(x1 + i), r0));
            a2 = _mm256_add_ps(a2, _mm256_mul_ps(_mm256_broadcast_ss(x2 + i), r0));
            a3 = _mm256_add_ps(a3, _mm256_mul_ps(_mm256_broadcast_ss(x3 + i), r0));
        }
        _mm256_storeu_ps(y + j, a0);
        _mm256_storeu_ps(y + r + j, a1);
        _mm256_storeu_ps(y + 2 * r + j, a2);
        _mm256_storeu_ps(y + 3 * r + j, a3);
    }
    for (; j < r; j++)
        for (int t = 0; t < 4; t++) {
            float s = 0.0f;
            for (int i = 0; i < D; i++)
                s += x[(size_t)t * D + i] * R[(size_t)i * D + j];
            y[(size_t)t * r + j] = s;
        }
}

/* One row of x (f16, bf16 or f32) into f32: F16C / shifts, 8 at a time. */
__attribute__((target("avx2,f16c"))) static void load_row_avx2(const char *src, kvd_dtype dt, int D,
                                                               float *dst)
{
    int i = 0;
    if (dt == KVD_DTYPE_F32) {
        memcpy(dst, src, sizeof(float) * (size_t)D);
        return;
    }
    for (; i + 8 <= D; i += 8) {
        __m128i h = _mm_loadu_si128((const __m128i *)(src + 2 * (size_t)i));
        __m256 f = dt == KVD_DTYPE_F16
                       ? _mm256_cvtph_ps(h)
                       : _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
        _mm256_storeu_ps(dst + i, f);
    }
    for (; i < D; i++)
        dst[i] = kvd__load_float(src + 2 * (size_t)i, dt);
}

static void project_rows_plain(const float *R, int D, int r, const float *x, float *y)
{
    for (int j = 0; j < r; j++)
        y[j] = 0.0f;
    for (int i = 0; i < D; i++) {
        float xi = x[i];
        const float *Ri = R + (size_t)i * D;
        for (int j = 0; j < r; j++)
            y[j] += xi * Ri[j];
    }
}

/* Rows [lo, hi) of kvd_cpu_svd_project_fast (kvd__par_ranges). */
typedef struct project_job {
    const float *R, *Rp;
    int D, r, simd;
    const void *x;
    kvd_dtype dtype;
    int64_t x_stride;
    float *y;
} project_job;

static void project_part(void *arg, int64_t lo, int64_t hi)
{
    const project_job *j = arg;
    const int D = j->D, r = j->r;
    const size_t es = kvd_dtype_size(j->dtype);
    if (j->simd && r > 0) {
        /* Tiles of four rows, converted to f32 first. */
        float *tile = malloc(sizeof(float) * 4 * (size_t)D);
        for (int64_t t = lo; tile && t + 4 <= hi; t += 4) {
            for (int k = 0; k < 4; k++)
                load_row_avx2((const char *)j->x + (t + k) * j->x_stride, j->dtype, D,
                              tile + (size_t)k * D);
            project4_avx2(j->R, j->Rp, D, r, tile, j->y + t * r);
        }
        if (tile)
            lo = hi - (hi - lo) % 4; /* the rows left over go one by one */
        free(tile);
    }
    float *row = malloc(sizeof(float) * (size_t)D + 4);
    for (int64_t t = lo; t < hi; t++) {
        const char *xr = (const char *)j->x + t * j->x_stride;
        const float *xf = (const float *)xr;
        if (j->dtype != KVD_DTYPE_F32 || !row) {
            for (int i = 0; i < D && row; i++)
                row[i] = kvd__load_float(xr + (size_t)i * es, j->dtype);
            xf = row;
        }
        if (!xf) { /* no memory for the conversion row: go element-wise */
            kvd_cpu_svd_project_ref(j->R, D, r, xr, j->dtype, 1, j->x_stride, j->y + t * r);
            continue;
        }
        if (j->simd)
            project_rows_avx2(j->R, D, r, xf, j->y + t * r);
        else
            project_rows_plain(j->R, D, r, xf, j->y + t * r);
    }
    free(row);
}

void kvd_cpu_svd_project_fast(const float *R, int D, int r, const void *x, kvd_dtype dtype,
                              int64_t n, int64_t x_stride, float *y, int nthreads)
{
    const int simd = kvd__cpu_has_avx2_fma_f16c();
    /* Packing costs a pass over r x D floats: worth it past a few tiles. */
    float *Rp = simd && n >= 16 ? pack_blocks16(R, D, r) : NULL;
    project_job j = {R, Rp, D, r, simd, x, dtype, x_stride, y};
    kvd__par_ranges(n, 64, nthreads > 1 && n >= 256 ? nthreads : 1, project_part, &j);
    free(Rp);
}

/* Output dimension i of one row: y (r values) times row i of R, summed in
 * double over j from 0. Both paths below compute every output this way. */
static float unproject_one(const float *R, int D, int r, const float *y, int i)
{
    double acc = 0.0;
    for (int j = 0; j < r; j++)
        acc += (double)y[j] * R[(size_t)i * D + j];
    return (float)acc;
}

void kvd_cpu_svd_unproject_ref(const float *R, int D, int r, const float *y, int64_t n, float *x)
{
    for (int64_t t = 0; t < n; t++)
        for (int i = 0; i < D; i++)
            x[t * D + i] = unproject_one(R, D, r, y + t * r, i);
}

/* R[:, :r]^T in blocks of 8 output dimensions: Rb[(i / 8) * 8 r + j * 8 +
 * i % 8] = R[i * D + j], for the first D / 8 * 8 rows of R. */
static float *pack_rows8(const float *R, int D, int r)
{
    const int nb = D / 8;
    float *Rb = nb && r ? malloc(sizeof(float) * 8 * (size_t)r * (size_t)nb) : NULL;
    for (int b = 0; Rb && b < nb; b++)
        for (int j = 0; j < r; j++)
            for (int l = 0; l < 8; l++)
                Rb[((size_t)b * r + (size_t)j) * 8 + (size_t)l] = R[(size_t)(8 * b + l) * D + j];
    return Rb;
}

/* Four rows of x, 8 output dimensions (one block of pack_rows8) at a time:
 * yd holds the four rows of y in double. The product of two floats is
 * exact in double, so an FMA rounds as the reference's product and sum do,
 * and every sum runs over j from 0 as the reference's: the same bits. */
__attribute__((target("avx2,fma"))) static void unproject4_avx2(const float *Rb, int r,
                                                                const double *yd, float *x, int D)
{
    __m256d a0 = _mm256_setzero_pd(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    for (int j = 0; j < r; j++) {
        const __m256 rv = _mm256_loadu_ps(Rb + (size_t)j * 8);
        const __m256d r0 = _mm256_cvtps_pd(_mm256_castps256_ps128(rv));
        const __m256d r1 = _mm256_cvtps_pd(_mm256_extractf128_ps(rv, 1));
        __m256d s = _mm256_broadcast_sd(yd + j);
        a0 = _mm256_fmadd_pd(s, r0, a0);
        a1 = _mm256_fmadd_pd(s, r1, a1);
        s = _mm256_broadcast_sd(yd + r + j);
        a2 = _mm256_fmadd_pd(s, r0, a2);
        a3 = _mm256_fmadd_pd(s, r1, a3);
        s = _mm256_broadcast_sd(yd + 2 * (size_t)r + j);
        a4 = _mm256_fmadd_pd(s, r0, a4);
        a5 = _mm256_fmadd_pd(s, r1, a5);
        s = _mm256_broadcast_sd(yd + 3 * (size_t)r + j);
        a6 = _mm256_fmadd_pd(s, r0, a6);
        a7 = _mm256_fmadd_pd(s, r1, a7);
    }
    _mm_storeu_ps(x, _mm256_cvtpd_ps(a0));
    _mm_storeu_ps(x + 4, _mm256_cvtpd_ps(a1));
    _mm_storeu_ps(x + D, _mm256_cvtpd_ps(a2));
    _mm_storeu_ps(x + D + 4, _mm256_cvtpd_ps(a3));
    _mm_storeu_ps(x + 2 * (size_t)D, _mm256_cvtpd_ps(a4));
    _mm_storeu_ps(x + 2 * (size_t)D + 4, _mm256_cvtpd_ps(a5));
    _mm_storeu_ps(x + 3 * (size_t)D, _mm256_cvtpd_ps(a6));
    _mm_storeu_ps(x + 3 * (size_t)D + 4, _mm256_cvtpd_ps(a7));
}

/* Rows [lo, hi) of kvd_cpu_svd_unproject_fast (kvd__par_ranges). */
typedef struct unproject_job {
    const float *R, *Rb, *y;
    int D, r;
    float *x;
} unproject_job;

static void unproject_part(void *arg, int64_t lo, int64_t hi)
{
    const unproject_job *j = arg;
    const int D = j->D, r = j->r, nb = D / 8;
    double *yd = j->Rb ? malloc(sizeof(double) * 4 * (size_t)r) : NULL;
    for (int64_t t = lo; yd && t + 4 <= hi; t += 4) {
        for (size_t i = 0; i < 4 * (size_t)r; i++)
            yd[i] = j->y[t * r + (int64_t)i];
        float *xt = j->x + t * D;
        for (int b = 0; b < nb; b++)
            unproject4_avx2(j->Rb + (size_t)b * 8 * r, r, yd, xt + 8 * b, D);
        /* output dimensions past the last block of 8: as the reference */
        for (int k = 0; k < 4; k++)
            for (int i = 8 * nb; i < D; i++)
                xt[(size_t)k * D + i] = unproject_one(j->R, D, r, j->y + (t + k) * r, i);
    }
    if (yd)
        lo = hi - (hi - lo) % 4; /* the rows left over go through the reference */
    free(yd);
    if (lo < hi)
        kvd_cpu_svd_unproject_ref(j->R, D, r, j->y + lo * r, hi - lo, j->x + lo * D);
}

void kvd_cpu_svd_unproject_fast(const float *R, int D, int r, const float *y, int64_t n, float *x,
                                int nthreads)
{
    float *Rb = n >= 4 && kvd__cpu_has_avx2_fma_f16c() ? pack_rows8(R, D, r) : NULL;
    if (!Rb) { /* no AVX2, no memory, r = 0, D < 8 or fewer than 4 rows */
        kvd_cpu_svd_unproject_ref(R, D, r, y, n, x);
        return;
    }
    unproject_job j = {R, Rb, y, D, r, x};
    kvd__par_ranges(n, 64, nthreads > 1 && n >= 256 ? nthreads : 1, unproject_part, &j);
    free(Rb);
}

static int check_proj(const float *R, int D, int r, const void *a, const void *b, int64_t n,
                      kvd_error *err)
{
    if (!R || D <= 0 || r < 0 || r > D || n < 0 || (n > 0 && (!a || !b)))
        return kvd_error_set(err, KVD_EINVAL, "svd projection: bad arguments (D %d, r %d, n %lld)", D,
                             r, (long long)n);
    return 0;
}

static int cpu_project(kvd_backend *be, const float *R, int D, int r, const void *x, kvd_dtype dtype,
                       int64_t n, int64_t x_stride, float *y, kvd_error *err)
{
    (void)err;
    if (kvd__cpu_fast(be))
        kvd_cpu_svd_project_fast(R, D, r, x, dtype, n, x_stride, y, kvd__cpu_threads(be));
    else
        kvd_cpu_svd_project_ref(R, D, r, x, dtype, n, x_stride, y);
    return 0;
}

static int cpu_unproject(kvd_backend *be, const float *R, int D, int r, const float *y, int64_t n,
                         float *x, kvd_error *err)
{
    (void)err;
    if (kvd__cpu_fast(be))
        kvd_cpu_svd_unproject_fast(R, D, r, y, n, x, kvd__cpu_threads(be));
    else
        kvd_cpu_svd_unproject_ref(R, D, r, y, n, x);
    return 0;
}

const struct kvd_svd_ops kvd__cpu_svd_ops = {
    .project = cpu_project,
    .unproject = cpu_unproject,
};

int kvd_svd_project(kvd_backend *be, const float *R, int D, int r, const void *x, kvd_dtype dtype,
                    int64_t n, int64_t x_stride, float *y, kvd_error *err)
{
    int rc = check_proj(R, D, r, x, y, n, err);
    if (rc)
        return rc;
    if (!kvd_dtype_is_float(dtype) || x_stride < (int64_t)(D * kvd_dtype_size(dtype)))
        return kvd_error_set(err, KVD_EINVAL, "svd project: dtype %s / row stride %lld",
                             kvd_dtype_name(dtype), (long long)x_stride);
    if (!be || !be->iface || !be->iface->svd || !be->iface->svd->project)
        return kvd_error_set(err, KVD_EUNSUPP, "svd project: not supported by backend");
    return be->iface->svd->project(be, R, D, r, x, dtype, n, x_stride, y, err);
}

int kvd_svd_unproject(kvd_backend *be, const float *R, int D, int r, const float *y, int64_t n,
                      float *x, kvd_error *err)
{
    int rc = check_proj(R, D, r, y, x, n, err);
    if (rc)
        return rc;
    if (!be || !be->iface || !be->iface->svd || !be->iface->svd->unproject)
        return kvd_error_set(err, KVD_EUNSUPP, "svd unproject: not supported by backend");
    return be->iface->svd->unproject(be, R, D, r, y, n, x, err);
}
