/*
 * K-means on the CPU: scalar reference, AVX2 path, checked wrappers and the
 * backend's kmeans table.
 *
 * Both paths share one driver (sub-sampling, k-means++, Lloyd, repair,
 * inertia); they differ only in the distance kernel. The AVX2 kernel works
 * on blocks of 32 points transposed to (d, 32), one centroid at a time, and
 * evaluates sum_t (x_t - c_t)^2 with separate multiply and add in the same
 * order as the scalar one, so encode results and trained centroids do not
 * depend on the CPU or the thread count, and the tests compare for equality.
 *
 * Nearest-centroid search over all k centroids (assignment, encode) ranks
 * by the expanded form |c|^2 - 2x.c instead (d fused multiply-adds a
 * centroid, a third of the direct form's work) and keeps each point's two
 * best: it rounds differently, by a bounded amount, so a winner ahead of its
 * runner-up by more than twice that bound is the direct form's winner too,
 * and every other point (near ties, values out of range) is decided by the
 * direct form. Results stay the reference's bit for bit ("nearest" below).
 */
#include <float.h>
#include <immintrin.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common/cpu_internal.h"
#include "kvdepot/kmeans.h"

/* ---- deterministic generator (splitmix64) ------------------------------ */

typedef struct km_rng {
    uint64_t s;
} km_rng;

static uint64_t km_next(km_rng *r)
{
    uint64_t z = (r->s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* Uniform double in [0, 1) with 53 random bits. */
static double km_uniform(km_rng *r) { return (double)(km_next(r) >> 11) * 0x1.0p-53; }

/* ---- distance kernels -------------------------------------------------- */

static inline float dist2_scalar(int d, const float *x, const float *c)
{
    float acc = 0.0f;
    for (int t = 0; t < d; t++) {
        float diff = x[t] - c[t];
        acc = acc + diff * diff;
    }
    return acc;
}

/* For nb points x (rows of stride ldx): best[i]/bidx[i] updated with the
 * centroids c0..c0+nc-1 that are strictly closer (ties keep the lower index). */
static void argmin_rows_scalar(int64_t nb, int d, const float *x, int64_t ldx, int c0, int nc,
                               const float *centroids, float *best, uint32_t *bidx)
{
    for (int64_t i = 0; i < nb; i++) {
        const float *xi = x + i * ldx;
        float b = best[i];
        uint32_t bi = bidx[i];
        for (int c = c0; c < c0 + nc; c++) {
            float dd = dist2_scalar(d, xi, centroids + (int64_t)c * d);
            if (dd < b) {
                b = dd;
                bi = (uint32_t)c;
            }
        }
        best[i] = b;
        bidx[i] = bi;
    }
}

#define KM_BLOCK 32

/* xt: (d, 32) transposed block of points. Same arithmetic as dist2_scalar. */
__attribute__((target("avx2,fma"))) static void argmin_block_avx2(int d, const float *xt, int c0,
                                                                  int nc, const float *centroids,
                                                                  float *best, uint32_t *bidx)
{
    __m256 b0 = _mm256_loadu_ps(best), b1 = _mm256_loadu_ps(best + 8);
    __m256 b2 = _mm256_loadu_ps(best + 16), b3 = _mm256_loadu_ps(best + 24);
    __m256i i0 = _mm256_loadu_si256((const __m256i *)bidx);
    __m256i i1 = _mm256_loadu_si256((const __m256i *)(bidx + 8));
    __m256i i2 = _mm256_loadu_si256((const __m256i *)(bidx + 16));
    __m256i i3 = _mm256_loadu_si256((const __m256i *)(bidx + 24));
    for (int c = c0; c < c0 + nc; c++) {
        const float *cc = centroids + (int64_t)c * d;
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (int t = 0; t < d; t++) {
            __m256 ct = _mm256_broadcast_ss(cc + t);
            const float *xr = xt + (int64_t)t * KM_BLOCK;
            __m256 d0 = _mm256_sub_ps(_mm256_loadu_ps(xr), ct);
            __m256 d1 = _mm256_sub_ps(_mm256_loadu_ps(xr + 8), ct);
            __m256 d2 = _mm256_sub_ps(_mm256_loadu_ps(xr + 16), ct);
            __m256 d3 = _mm256_sub_ps(_mm256_loadu_ps(xr + 24), ct);
            a0 = _mm256_add_ps(a0, _mm256_mul_ps(d0, d0));
            a1 = _mm256_add_ps(a1, _mm256_mul_ps(d1, d1));
            a2 = _mm256_add_ps(a2, _mm256_mul_ps(d2, d2));
            a3 = _mm256_add_ps(a3, _mm256_mul_ps(d3, d3));
        }
        __m256i ci = _mm256_set1_epi32(c);
        __m256 m0 = _mm256_cmp_ps(a0, b0, _CMP_LT_OQ), m1 = _mm256_cmp_ps(a1, b1, _CMP_LT_OQ);
        __m256 m2 = _mm256_cmp_ps(a2, b2, _CMP_LT_OQ), m3 = _mm256_cmp_ps(a3, b3, _CMP_LT_OQ);
        b0 = _mm256_blendv_ps(b0, a0, m0);
        b1 = _mm256_blendv_ps(b1, a1, m1);
        b2 = _mm256_blendv_ps(b2, a2, m2);
        b3 = _mm256_blendv_ps(b3, a3, m3);
        i0 = _mm256_castps_si256(
            _mm256_blendv_ps(_mm256_castsi256_ps(i0), _mm256_castsi256_ps(ci), m0));
        i1 = _mm256_castps_si256(
            _mm256_blendv_ps(_mm256_castsi256_ps(i1), _mm256_castsi256_ps(ci), m1));
        i2 = _mm256_castps_si256(
            _mm256_blendv_ps(_mm256_castsi256_ps(i2), _mm256_castsi256_ps(ci), m2));
        i3 = _mm256_castps_si256(
            _mm256_blendv_ps(_mm256_castsi256_ps(i3), _mm256_castsi256_ps(ci), m3));
    }
    _mm256_storeu_ps(best, b0);
    _mm256_storeu_ps(best + 8, b1);
    _mm256_storeu_ps(best + 16, b2);
    _mm256_storeu_ps(best + 24, b3);
    _mm256_storeu_si256((__m256i *)bidx, i0);
    _mm256_storeu_si256((__m256i *)(bidx + 8), i1);
    _mm256_storeu_si256((__m256i *)(bidx + 16), i2);
    _mm256_storeu_si256((__m256i *)(bidx + 24), i3);
}

/* Block blk of points [0, n) transposed into xt (row t holds dimension t
 * of the block's KM_BLOCK points); a short tail repeats its last point. */
static void transpose_block(const float *x, int64_t ldx, int d, int64_t n, int64_t blk, float *xt)
{
    const int64_t i0 = blk * KM_BLOCK, nb = n - i0 < KM_BLOCK ? n - i0 : KM_BLOCK;
    for (int l = 0; l < KM_BLOCK; l++) {
        const float *xr = x + (i0 + (l < nb ? l : nb - 1)) * ldx;
        for (int t = 0; t < d; t++)
            xt[t * KM_BLOCK + l] = xr[t];
    }
}

/* Blocks [b0, b1) of argmin_update's points (kvd__par_ranges). xt_all: the
 * points transposed block by block (transpose_blocks), or NULL. */
typedef struct argmin_job {
    int64_t n, ldx;
    int d, c0, nc;
    const float *x, *xt_all, *centroids;
    float *best;
    uint32_t *bidx;
} argmin_job;

static void argmin_scalar_part(void *arg, int64_t b0, int64_t b1)
{
    const argmin_job *j = arg;
    for (int64_t blk = b0; blk < b1; blk++) {
        int64_t i0 = blk * KM_BLOCK;
        int64_t nb = j->n - i0 < KM_BLOCK ? j->n - i0 : KM_BLOCK;
        argmin_rows_scalar(nb, j->d, j->x + i0 * j->ldx, j->ldx, j->c0, j->nc, j->centroids,
                           j->best + i0, j->bidx + i0);
    }
}

static void argmin_simd_part(void *arg, int64_t b0, int64_t b1)
{
    const argmin_job *j = arg;
    const int d = j->d;
    float *xt = j->xt_all ? NULL : malloc(sizeof(float) * (size_t)d * KM_BLOCK);
    float bb[KM_BLOCK];
    uint32_t bi[KM_BLOCK];
    for (int64_t blk = b0; blk < b1; blk++) {
        int64_t i0 = blk * KM_BLOCK;
        int64_t nb = j->n - i0 < KM_BLOCK ? j->n - i0 : KM_BLOCK;
        const float *bt = j->xt_all ? j->xt_all + blk * d * KM_BLOCK : xt;
        if (!bt) { /* no scratch: the scalar kernel gives the same bits */
            argmin_rows_scalar(nb, d, j->x + i0 * j->ldx, j->ldx, j->c0, j->nc, j->centroids,
                               j->best + i0, j->bidx + i0);
            continue;
        }
        if (!j->xt_all)
            transpose_block(j->x, j->ldx, d, j->n, blk, xt);
        if (nb == KM_BLOCK) {
            argmin_block_avx2(d, bt, j->c0, j->nc, j->centroids, j->best + i0, j->bidx + i0);
            continue;
        }
        for (int l = 0; l < KM_BLOCK; l++) {
            bb[l] = l < nb ? j->best[i0 + l] : INFINITY;
            bi[l] = l < nb ? j->bidx[i0 + l] : 0;
        }
        argmin_block_avx2(d, bt, j->c0, j->nc, j->centroids, bb, bi);
        memcpy(j->best + i0, bb, sizeof(float) * (size_t)nb);
        memcpy(j->bidx + i0, bi, sizeof(uint32_t) * (size_t)nb);
    }
    free(xt);
}

/*
 * Update best/bidx of points [0, n) with centroids [c0, c0+nc): the one
 * routine both the driver and encode use. simd selects the AVX2 block kernel
 * (bitwise equal to the scalar one); threads split the points (blocks of
 * KM_BLOCK, through the compute pool).
 */
static void argmin_update(int nthreads, int simd, int64_t n, int d, const float *x, int64_t ldx,
                          const float *xt_all, int c0, int nc, const float *centroids, float *best,
                          uint32_t *bidx)
{
    int64_t nblocks = (n + KM_BLOCK - 1) / KM_BLOCK;
    int nt = nthreads;
    if ((int64_t)nc * n * d < 200000 || nblocks < 2)
        nt = 1;
    argmin_job j = {n, ldx, d, c0, nc, x, simd ? xt_all : NULL, centroids, best, bidx};
    kvd__par_ranges(nblocks, 1, nt, simd ? argmin_simd_part : argmin_scalar_part, &j);
}

/* Points [0, n) transposed block by block (transpose_block; block b at
 * xt + b * d * KM_BLOCK): made once for the k-means++ seeding, whose every
 * step compares all points with one new centroid. NULL when out of
 * memory. */
static float *transpose_blocks(int64_t n, int d, const float *x, int64_t ldx)
{
    const int64_t nblocks = (n + KM_BLOCK - 1) / KM_BLOCK;
    float *xt = malloc(sizeof(float) * (size_t)(nblocks > 0 ? nblocks : 1) * d * KM_BLOCK);
    for (int64_t blk = 0; xt && blk < nblocks; blk++)
        transpose_block(x, ldx, d, n, blk, xt + blk * d * KM_BLOCK);
    return xt;
}

/* ---- nearest centroid by the expanded form ----------------------------- */

/*
 * Per centroid c: cn = |c|^2 and m2 = -2c (exact). For a point x the
 * ranking value a_c = fma chain of x_t * m2_t onto cn, and A_c = a_c +
 * |x|^2 estimates T_c = |x - c|^2. With u = 2^-24: A_c is off by at most
 * g (|x| + |c|)^2 <= g (6 |x|^2 + 3 T_c), g = (2d + 2) u (d + 1 roundings
 * in cn, one per fma, on values below (|x| + |c|)^2), and dist2_scalar's
 * r_c lies within (1 +- g2) T_c, g2 = (d + 2) u (non-negative terms). So
 * r_c > r_w for every c whose A_c is at least the runner-up's when
 *   (1 - g2) (B2 - 8 g X) / (1 + 4 g) > (1 + g2) (B1 + 8 g X) / (1 - 4 g)
 * (B1, B2: the best and second A, X = |x|^2; g and g2 rounded up, 8 for 6
 * to cover X's own rounding), evaluated in double; plus the absolute error
 * of gradual underflow. Relative to |x|^2 and the distances themselves,
 * not to the largest centroid.
 */
typedef struct near_bound {
    double hi, lo, e; /* (1 + g2) / (1 - 4g), (1 - g2) / (1 + 4g), 8g */
    double tiny;      /* the absolute error of results below FLT_MIN */
} near_bound;

static near_bound near_bound_of(int d)
{
    const double g = (2.0 * d + 4.0) * 0x1p-24, g2 = (d + 4.0) * 0x1p-24;
    /* Gradual underflow adds up to 2^-150 a rounding, besides the relative
     * error: 4d + 4 roundings on the two sides, doubled. */
    return (near_bound){(1.0 + g2) / (1.0 - 4.0 * g), (1.0 - g2) / (1.0 + 4.0 * g), 8.0 * g,
                        (8.0 * d + 8.0) * 0x1p-150};
}

typedef struct near_tab {
    int d, k;
    float *cn, *m2; /* k, k x d */
} near_tab;

/* 0, or -1 when out of memory or a centroid is not finite (the direct form
 * then decides every point). */
static int near_tab_init(near_tab *t, int d, int k, const float *centroids)
{
    t->d = d;
    t->k = k;
    t->cn = malloc(sizeof(float) * (size_t)k);
    t->m2 = malloc(sizeof(float) * (size_t)k * d);
    if (!t->cn || !t->m2)
        return -1;
    for (int c = 0; c < k; c++) {
        float s = 0.0f;
        for (int j = 0; j < d; j++) {
            float v = centroids[(int64_t)c * d + j];
            s += v * v;
            t->m2[(int64_t)c * d + j] = -2.0f * v;
        }
        if (!isfinite(s) || s > FLT_MAX / 64)
            return -1;
        t->cn[c] = s;
    }
    return 0;
}

static void near_tab_free(near_tab *t)
{
    free(t->cn);
    free(t->m2);
}

/* One lane set of the block kernels: best b1 (index i1) and second b2. */
#define NEAR_BLOCK 32
_Static_assert(NEAR_BLOCK == KM_BLOCK, "near_part transposes with transpose_block");

__attribute__((target("avx2,fma"), always_inline)) static inline void
near_block_avx2_d(const int d, const float *xt, const near_tab *t, float *b1o, float *b2o,
                  uint32_t *i1o, float *xxo)
{
    __m256 b1[4], b2[4];
    __m256i i1[4];
    _Pragma("GCC unroll 4") for (int j = 0; j < 4; j++)
    {
        b1[j] = b2[j] = _mm256_set1_ps(INFINITY);
        i1[j] = _mm256_setzero_si256();
    }
    const float *m2 = t->m2;
    __m256i ci = _mm256_setzero_si256(); /* c in every lane */
    const __m256i one = _mm256_set1_epi32(1);
    for (int c = 0; c < t->k; c++, m2 += d) {
        __m256 a[4];
        a[0] = a[1] = a[2] = a[3] = _mm256_broadcast_ss(t->cn + c);
#pragma GCC unroll 8
        for (int q = 0; q < d; q++) {
            __m256 w = _mm256_broadcast_ss(m2 + q);
            _Pragma("GCC unroll 4") for (int j = 0; j < 4; j++) a[j] =
                _mm256_fmadd_ps(_mm256_loadu_ps(xt + q * NEAR_BLOCK + 8 * j), w, a[j]);
        }
        _Pragma("GCC unroll 4") for (int j = 0; j < 4; j++)
        {
            __m256 lt = _mm256_cmp_ps(a[j], b1[j], _CMP_LT_OQ);
            b2[j] = _mm256_min_ps(b2[j], _mm256_max_ps(a[j], b1[j]));
            i1[j] = _mm256_castps_si256(
                _mm256_blendv_ps(_mm256_castsi256_ps(i1[j]), _mm256_castsi256_ps(ci), lt));
            b1[j] = _mm256_min_ps(b1[j], a[j]);
        }
        ci = _mm256_add_epi32(ci, one);
    }
    _Pragma("GCC unroll 4") for (int j = 0; j < 4; j++)
    {
        _mm256_storeu_ps(b1o + 8 * j, b1[j]);
        _mm256_storeu_ps(b2o + 8 * j, b2[j]);
        _mm256_storeu_si256((__m256i *)(i1o + 8 * j), i1[j]);
        __m256 xx = _mm256_setzero_ps();
        for (int q = 0; q < d; q++) {
            __m256 v = _mm256_loadu_ps(xt + q * NEAR_BLOCK + 8 * j);
            xx = _mm256_add_ps(xx, _mm256_mul_ps(v, v));
        }
        _mm256_storeu_ps(xxo + 8 * j, xx);
    }
}

__attribute__((target("avx2,fma"))) static void
near_block_avx2(const float *xt, const near_tab *t, float *b1, float *b2, uint32_t *i1, float *xx)
{
    switch (t->d) { /* the usual sub-vector widths, unrolled */
    case 2:
        near_block_avx2_d(2, xt, t, b1, b2, i1, xx);
        break;
    case 4:
        near_block_avx2_d(4, xt, t, b1, b2, i1, xx);
        break;
    case 8:
        near_block_avx2_d(8, xt, t, b1, b2, i1, xx);
        break;
    default:
        near_block_avx2_d(t->d, xt, t, b1, b2, i1, xx);
    }
}

/* One centroid's ranking values for the block's 32 points (two vectors)
 * onto a[]; x[] holds the block's d transposed rows. */
#define NEAR512_RANK(a, cnv, w)                                                                    \
    do {                                                                                           \
        (a)[0] = (a)[1] = _mm512_set1_ps(cnv);                                                     \
        _Pragma("GCC unroll 8") for (int q = 0; q < d; q++)                                        \
        {                                                                                          \
            __m512 wq = _mm512_set1_ps((w)[q]);                                                    \
            (a)[0] = _mm512_fmadd_ps(_mm512_loadu_ps(xt + q * NEAR_BLOCK), wq, (a)[0]);            \
            (a)[1] = _mm512_fmadd_ps(_mm512_loadu_ps(xt + q * NEAR_BLOCK + 16), wq, (a)[1]);       \
        }                                                                                          \
    } while (0)

/* Fold one centroid's values (index in every lane of ci) into the best two. */
#define NEAR512_KEEP(a, ci)                                                                        \
    do {                                                                                           \
        for (int j = 0; j < 2; j++) {                                                              \
            __mmask16 lt = _mm512_cmp_ps_mask((a)[j], b1[j], _CMP_LT_OQ);                          \
            b2[j] = _mm512_min_ps(b2[j], _mm512_max_ps((a)[j], b1[j]));                            \
            i1[j] = _mm512_mask_mov_epi32(i1[j], lt, ci);                                          \
            b1[j] = _mm512_min_ps(b1[j], (a)[j]);                                                  \
        }                                                                                          \
    } while (0)

__attribute__((target("avx512f"), always_inline)) static inline void
near_block_avx512_d(const int d, const float *xt, const near_tab *t, float *b1o, float *b2o,
                    uint32_t *i1o, float *xxo)
{
    __m512 b1[2], b2[2];
    __m512i i1[2];
    for (int j = 0; j < 2; j++) {
        b1[j] = b2[j] = _mm512_set1_ps(INFINITY);
        i1[j] = _mm512_setzero_si512();
    }
    const float *m2 = t->m2;
    __m512i ci = _mm512_setzero_si512(); /* c in every lane */
    const __m512i one = _mm512_set1_epi32(1), two = _mm512_set1_epi32(2);
    int c = 0;
    /* Two centroids a step: their fma chains interleave. */
    for (; c + 2 <= t->k; c += 2, m2 += 2 * d) {
        __m512 a[2], e[2];
        NEAR512_RANK(a, t->cn[c], m2);
        NEAR512_RANK(e, t->cn[c + 1], m2 + d);
        NEAR512_KEEP(a, ci);
        NEAR512_KEEP(e, _mm512_add_epi32(ci, one));
        ci = _mm512_add_epi32(ci, two);
    }
    if (c < t->k) {
        __m512 a[2];
        NEAR512_RANK(a, t->cn[c], m2);
        NEAR512_KEEP(a, ci);
    }
    for (int j = 0; j < 2; j++) {
        _mm512_storeu_ps(b1o + 16 * j, b1[j]);
        _mm512_storeu_ps(b2o + 16 * j, b2[j]);
        _mm512_storeu_si512(i1o + 16 * j, i1[j]);
        __m512 xx = _mm512_setzero_ps();
        for (int q = 0; q < d; q++) {
            __m512 v = _mm512_loadu_ps(xt + q * NEAR_BLOCK + 16 * j);
            xx = _mm512_add_ps(xx, _mm512_mul_ps(v, v));
        }
        _mm512_storeu_ps(xxo + 16 * j, xx);
    }
}

__attribute__((target("avx512f"))) static void
near_block_avx512(const float *xt, const near_tab *t, float *b1, float *b2, uint32_t *i1, float *xx)
{
    switch (t->d) {
    case 2:
        near_block_avx512_d(2, xt, t, b1, b2, i1, xx);
        break;
    case 4:
        near_block_avx512_d(4, xt, t, b1, b2, i1, xx);
        break;
    case 8:
        near_block_avx512_d(8, xt, t, b1, b2, i1, xx);
        break;
    default:
        near_block_avx512_d(t->d, xt, t, b1, b2, i1, xx);
    }
}

/* Which of a block's NEAR_BLOCK points near_bound decides: bit l set when
 * point l's winner is certain (four points at a time, in double). */
__attribute__((target("avx2,fma"))) static uint32_t
near_decide_block(const near_bound *nb, const float *b1, const float *b2, const float *xx)
{
    const __m256d hf = _mm256_set1_pd(nb->hi), lf = _mm256_set1_pd(nb->lo);
    const __m256d e = _mm256_set1_pd(nb->e), tiny = _mm256_set1_pd(nb->tiny);
    const __m256d big = _mm256_set1_pd(1e300);
    uint32_t mask = 0;
    for (int l = 0; l < NEAR_BLOCK; l += 4) {
        const __m256d x = _mm256_cvtps_pd(_mm_loadu_ps(xx + l));
        const __m256d ex = _mm256_mul_pd(e, x);
        __m256d hi = _mm256_add_pd(_mm256_add_pd(_mm256_cvtps_pd(_mm_loadu_ps(b1 + l)), x), ex);
        __m256d lo = _mm256_sub_pd(_mm256_add_pd(_mm256_cvtps_pd(_mm_loadu_ps(b2 + l)), x), ex);
        hi = _mm256_add_pd(_mm256_mul_pd(hf, hi), tiny);
        lo = _mm256_sub_pd(_mm256_mul_pd(lf, lo), tiny);
        const __m256d ok =
            _mm256_and_pd(_mm256_cmp_pd(lo, hi, _CMP_GT_OQ), _mm256_cmp_pd(hi, big, _CMP_LT_OQ));
        mask |= (uint32_t)_mm256_movemask_pd(ok) << l;
    }
    return mask;
}

/* Blocks [b0, b1) of nearest_impl's points (kvd__par_ranges). */
typedef struct near_job {
    int64_t n, ldx;
    const float *x, *centroids;
    const near_tab *t;
    uint32_t *assign;
    float *dist2;
    int avx512;
} near_job;

static void near_part(void *arg, int64_t blk0, int64_t blk1)
{
    const near_job *j = arg;
    const int d = j->t->d, k = j->t->k;
    const near_bound nbd = near_bound_of(d);
    void (*block)(const float *, const near_tab *, float *, float *, uint32_t *, float *) =
        j->avx512 ? near_block_avx512 : near_block_avx2;
    float *xt = malloc(sizeof(float) * (size_t)d * NEAR_BLOCK);
    float b1[NEAR_BLOCK], b2[NEAR_BLOCK], xx[NEAR_BLOCK];
    uint32_t i1[NEAR_BLOCK], decided = 0;
    for (int64_t blk = blk0; blk < blk1; blk++) {
        const int64_t i0 = blk * NEAR_BLOCK;
        const int64_t nb = j->n - i0 < NEAR_BLOCK ? j->n - i0 : NEAR_BLOCK;
        if (xt) {
            transpose_block(j->x, j->ldx, d, j->n, blk, xt);
            block(xt, j->t, b1, b2, i1, xx);
            decided = near_decide_block(&nbd, b1, b2, xx);
        }
        for (int64_t l = 0; l < nb; l++) {
            const float *xi = j->x + (i0 + l) * j->ldx;
            float b = INFINITY;
            uint32_t bi = 0;
            if (decided >> l & 1) {
                bi = i1[l];
                if (j->dist2)
                    b = dist2_scalar(d, xi, j->centroids + (int64_t)bi * d);
            } else { /* a near tie, or out of range: the direct form decides */
                argmin_rows_scalar(1, d, xi, j->ldx, 0, k, j->centroids, &b, &bi);
            }
            j->assign[i0 + l] = bi;
            if (j->dist2)
                j->dist2[i0 + l] = b;
        }
    }
    free(xt);
}

/*
 * assign/dist2 of points [0, n) over all k centroids: bitwise
 * argmin_rows_scalar's (ties to the lower index). 0, or -1 when the
 * expanded form cannot serve (no memory, a centroid not finite).
 */
static int nearest_impl(int nthreads, int simd, int64_t n, int d, const float *x, int64_t ldx,
                        int k, const float *centroids, uint32_t *assign, float *dist2)
{
    near_tab t;
    if (near_tab_init(&t, d, k, centroids)) {
        near_tab_free(&t);
        return -1;
    }
    int64_t nblocks = (n + NEAR_BLOCK - 1) / NEAR_BLOCK;
    int nt = nthreads;
    if ((int64_t)k * n * d < 200000 || nblocks < 2)
        nt = 1;
    near_job j = {n, ldx, x, centroids, &t, assign, dist2, simd != 2 && kvd__cpu_has_avx512f()};
    kvd__par_ranges(nblocks, 1, nt, near_part, &j);
    near_tab_free(&t);
    return 0;
}

static void assign_impl(int nthreads, int simd, int64_t n, int d, const float *x, int64_t ldx,
                        int k, const float *centroids, uint32_t *assign, float *dist2)
{
    /* Below 16 centroids the block's own work (its transposition, the
     * bound) outweighs what the expanded form saves. */
    if (simd && k >= 16 &&
        nearest_impl(nthreads, simd, n, d, x, ldx, k, centroids, assign, dist2) == 0)
        return;
    float *best = dist2;
    float *tmp = NULL;
    if (!best) {
        tmp = malloc(sizeof(float) * (size_t)(n > 0 ? n : 1));
        best = tmp;
    }
    if (!best) { /* keep going without the scratch: scalar, point by point */
        for (int64_t i = 0; i < n; i++) {
            float b = INFINITY;
            uint32_t bi = 0;
            argmin_rows_scalar(1, d, x + i * ldx, ldx, 0, k, centroids, &b, &bi);
            assign[i] = bi;
        }
        return;
    }
    for (int64_t i = 0; i < n; i++) {
        best[i] = INFINITY;
        assign[i] = 0;
    }
    argmin_update(nthreads, simd, n, d, x, ldx, NULL, 0, k, centroids, best, assign);
    free(tmp);
}

/* ---- the driver -------------------------------------------------------- */

/* Empty-cluster repair: see kmeans.h. count[] is updated as if the split
 * cluster's points were shared evenly. The largest cluster's centroid is left
 * where it is (the mean of its points), so a repair after the last update
 * does not change the inertia; the next assignment splits its points between
 * the two. */
static void repair_empty(int k, int d, float *centroids, int64_t *count, km_rng *rng)
{
    for (int j = 0; j < k; j++) {
        if (count[j] > 0)
            continue;
        int big = 0;
        for (int c = 1; c < k; c++)
            if (count[c] > count[big])
                big = c;
        float *cb = centroids + (int64_t)big * d;
        float *cj = centroids + (int64_t)j * d;
        double ss = 0.0;
        for (int t = 0; t < d; t++)
            ss += (double)cb[t] * cb[t];
        float rms = (float)sqrt(ss / (d > 0 ? d : 1));
        for (int t = 0; t < d; t++) {
            float eps = (1.0f / 1024.0f) * (fabsf(cb[t]) + rms + FLT_MIN);
            if (km_next(rng) & 1)
                eps = -eps;
            cj[t] = cb[t] + eps;
        }
        count[j] = count[big] / 2;
        count[big] -= count[j];
    }
}

static int kmeans_driver(int nthreads, int simd, const kvd_kmeans_params *p, int64_t n, int d,
                         const float *x, int64_t ldx, float *centroids, double *inertia)
{
    const int k = p->k;
    km_rng rng = {p->seed};
    int rc = KVD_OK;

    /* 1. points to cluster: all (in place) or a seeded subset (copied). */
    const float *xs = x;
    int64_t lds = ldx, ns = n;
    float *sub = NULL;
    if (p->max_points > 0 && n > p->max_points) {
        ns = p->max_points;
        int64_t *perm = malloc(sizeof(int64_t) * (size_t)n);
        sub = malloc(sizeof(float) * (size_t)ns * (size_t)d);
        if (!perm || !sub) {
            free(perm);
            free(sub);
            return KVD_ENOMEM;
        }
        for (int64_t i = 0; i < n; i++)
            perm[i] = i;
        for (int64_t i = 0; i < ns; i++) { /* partial Fisher-Yates */
            int64_t j = i + (int64_t)(km_next(&rng) % (uint64_t)(n - i));
            int64_t tmp = perm[i];
            perm[i] = perm[j];
            perm[j] = tmp;
            memcpy(sub + i * d, x + perm[i] * ldx, sizeof(float) * (size_t)d);
        }
        free(perm);
        xs = sub;
        lds = d;
    }

    float *mind = malloc(sizeof(float) * (size_t)ns);
    uint32_t *asg = malloc(sizeof(uint32_t) * (size_t)ns);
    uint32_t *prev = malloc(sizeof(uint32_t) * (size_t)ns);
    int64_t *count = calloc((size_t)k, sizeof(int64_t));
    double *sums = malloc(sizeof(double) * (size_t)k * (size_t)d);
    if (!mind || !asg || !prev || !count || !sums) {
        rc = KVD_ENOMEM;
        goto out;
    }

    /* 2. k-means++ seeding (D^2 sampling). With SIMD the points are
     * transposed once for all k steps. */
    float *xt = simd ? transpose_blocks(ns, d, xs, lds) : NULL;
    int64_t first = (int64_t)(km_next(&rng) % (uint64_t)ns);
    memcpy(centroids, xs + first * lds, sizeof(float) * (size_t)d);
    int chosen = 1;
    for (int64_t i = 0; i < ns; i++) {
        mind[i] = INFINITY;
        asg[i] = 0;
    }
    argmin_update(nthreads, simd, ns, d, xs, lds, xt, 0, 1, centroids, mind, asg);
    while (chosen < k) {
        double total = 0.0;
        for (int64_t i = 0; i < ns; i++)
            total += isfinite(mind[i]) ? (double)mind[i] : 0.0;
        if (!(total > 0.0))
            break; /* every point already sits on a centroid */
        double r = km_uniform(&rng) * total, acc = 0.0;
        int64_t pick = -1;
        for (int64_t i = 0; i < ns; i++) {
            if (!(isfinite(mind[i]) && mind[i] > 0.0f))
                continue;
            pick = i; /* last eligible point catches rounding at the end */
            acc += (double)mind[i];
            if (acc > r)
                break;
        }
        memcpy(centroids + (int64_t)chosen * d, xs + pick * lds, sizeof(float) * (size_t)d);
        argmin_update(nthreads, simd, ns, d, xs, lds, xt, chosen, 1, centroids, mind, asg);
        chosen++;
    }
    free(xt);
    if (chosen < k) { /* fewer distinct points than k: fill by splitting */
        for (int c = 0; c < k; c++)
            count[c] = c < chosen ? 1 : 0;
        repair_empty(k, d, centroids, count, &rng);
    }

    /* 3. Lloyd iterations. */
    for (int it = 0; it < p->niter; it++) {
        assign_impl(nthreads, simd, ns, d, xs, lds, k, centroids, asg, mind);
        if (it > 0 && memcmp(asg, prev, sizeof(uint32_t) * (size_t)ns) == 0)
            break;
        memcpy(prev, asg, sizeof(uint32_t) * (size_t)ns);
        memset(count, 0, sizeof(int64_t) * (size_t)k);
        memset(sums, 0, sizeof(double) * (size_t)k * (size_t)d);
        for (int64_t i = 0; i < ns; i++) { /* fixed order: thread-count independent */
            const float *xi = xs + i * lds;
            double *s = sums + (int64_t)asg[i] * d;
            for (int t = 0; t < d; t++)
                s[t] += xi[t];
            count[asg[i]]++;
        }
        for (int c = 0; c < k; c++) {
            if (count[c] == 0)
                continue;
            for (int t = 0; t < d; t++)
                centroids[(int64_t)c * d + t] = (float)(sums[(int64_t)c * d + t] / (double)count[c]);
        }
        repair_empty(k, d, centroids, count, &rng);
    }

    /* 4. inertia against the returned centroids. */
    if (inertia) {
        assign_impl(nthreads, simd, ns, d, xs, lds, k, centroids, asg, mind);
        double in = 0.0;
        for (int64_t i = 0; i < ns; i++)
            in += (double)mind[i];
        *inertia = in;
    }
out:
    free(mind);
    free(asg);
    free(prev);
    free(count);
    free(sums);
    free(sub);
    return rc;
}

static int check_plain(const kvd_kmeans_params *p, int64_t n, int d, const float *x, int64_t ldx,
                       const float *centroids)
{
    if (!p || p->k < 1 || p->niter < 0 || p->max_points < 0 || n < 1 || d < 1 || ldx < d || !x ||
        !centroids)
        return KVD_EINVAL;
    return KVD_OK;
}

int kvd_kmeans_train_ref(const kvd_kmeans_params *p, int64_t n, int d, const float *x,
                         int64_t ldx, float *centroids, double *inertia)
{
    int rc = check_plain(p, n, d, x, ldx, centroids);
    return rc ? rc : kmeans_driver(1, 0, p, n, d, x, ldx, centroids, inertia);
}

void kvd_kmeans_assign_ref(int64_t n, int d, const float *x, int64_t ldx, int k,
                           const float *centroids, uint32_t *assign, float *dist2)
{
    for (int64_t i = 0; i < n; i++) {
        float b = INFINITY;
        uint32_t bi = 0;
        argmin_rows_scalar(1, d, x + i * ldx, ldx, 0, k, centroids, &b, &bi);
        assign[i] = bi;
        if (dist2)
            dist2[i] = b;
    }
}

int kvd__kmeans_train_cpu(int nthreads, int simd, const kvd_kmeans_params *p, int64_t n, int d,
                          const float *x, int64_t ldx, float *centroids, double *inertia)
{
    int rc = check_plain(p, n, d, x, ldx, centroids);
    if (rc)
        return rc;
    return kmeans_driver(nthreads < 1 ? 1 : nthreads, simd && kvd_cpu_has_avx2_fma(), p, n, d, x,
                         ldx, centroids, inertia);
}

int kvd__kmeans_assign_cpu(int nthreads, int simd, int64_t n, int d, const float *x,
                           int64_t ldx, int k, const float *centroids, uint32_t *assign,
                           float *dist2)
{
    if (n < 0 || d < 1 || k < 1 || ldx < d)
        return KVD_EINVAL;
    assign_impl(nthreads < 1 ? 1 : nthreads, simd && kvd_cpu_has_avx2_fma() ? simd : 0, n, d, x,
                ldx, k, centroids, assign, dist2);
    return KVD_OK;
}

/* ---- tensors, wrappers, backend table ---------------------------------- */

/* (n, d) f32 with contiguous rows of any stride. */
static int check_points(const kvd_tensor *x, const char *name, kvd_error *err)
{
    if (!x || x->dtype != KVD_DTYPE_F32 || x->ndim != 2 || x->shape[0] < 0 || x->shape[1] < 1 ||
        x->shape[1] > INT32_MAX || x->stride[1] != 4 || x->stride[0] % 4 != 0 ||
        x->stride[0] < 4 * x->shape[1] || (x->shape[0] > 0 && !x->data))
        return kvd_error_set(err, KVD_EINVAL,
                             "kmeans: %s must be a (n, d) f32 tensor with contiguous rows", name);
    return KVD_OK;
}

static int cpu_train(kvd_backend *be, const kvd_kmeans_params *p, const kvd_tensor *x,
                     kvd_tensor *centroids, double *inertia, kvd_error *err)
{
    int rc = kvd__kmeans_train_cpu(kvd__cpu_threads(be), kvd__cpu_fast(be), p, x->shape[0],
                                   (int)x->shape[1], (const float *)x->data, x->stride[0] / 4,
                                   (float *)centroids->data, inertia);
    if (rc)
        return kvd_error_set(err, rc, "kmeans: %s", kvd_strerror(rc));
    return KVD_OK;
}

static int cpu_assign(kvd_backend *be, const kvd_tensor *x, const kvd_tensor *centroids,
                      kvd_tensor *assign, kvd_tensor *dist2, kvd_error *err)
{
    int rc = kvd__kmeans_assign_cpu(kvd__cpu_threads(be), kvd__cpu_fast(be), x->shape[0],
                                    (int)x->shape[1], (const float *)x->data, x->stride[0] / 4,
                                    (int)centroids->shape[0], (const float *)centroids->data,
                                    (uint32_t *)assign->data,
                                    dist2 ? (float *)dist2->data : NULL);
    if (rc)
        return kvd_error_set(err, rc, "kmeans: %s", kvd_strerror(rc));
    return KVD_OK;
}

const struct kvd_kmeans_ops kvd__cpu_kmeans_ops = {
    .train = cpu_train,
    .assign = cpu_assign,
};

static int get_ops(kvd_backend *be, const struct kvd_kmeans_ops **ops, kvd_error *err)
{
    if (!be || !be->iface)
        return kvd_error_set(err, KVD_EINVAL, "kmeans: backend is NULL");
    *ops = be->iface->kmeans;
    if (!*ops)
        return kvd_error_set(err, KVD_EUNSUPP, "kmeans: not supported by the %s backend",
                             be->iface->name);
    return KVD_OK;
}

int kvd_kmeans_train(kvd_backend *be, const kvd_kmeans_params *p, const kvd_tensor *x,
                     kvd_tensor *centroids, double *inertia, kvd_error *err)
{
    const struct kvd_kmeans_ops *ops;
    int rc = get_ops(be, &ops, err);
    if (rc)
        return rc;
    if (!ops->train)
        return kvd_error_set(err, KVD_EUNSUPP, "kmeans: train not supported by the %s backend",
                             be->iface->name);
    if (!p || p->k < 1 || p->niter < 0 || p->max_points < 0)
        return kvd_error_set(err, KVD_EINVAL, "kmeans: need k >= 1, niter >= 0, max_points >= 0");
    if ((rc = check_points(x, "x", err)))
        return rc;
    if (x->shape[0] < 1)
        return kvd_error_set(err, KVD_EINVAL, "kmeans: no points to cluster");
    if (!centroids || centroids->dtype != KVD_DTYPE_F32 || centroids->ndim != 2 ||
        centroids->shape[0] != p->k || centroids->shape[1] != x->shape[1] ||
        !kvd_tensor_is_contiguous(centroids) || !centroids->data)
        return kvd_error_set(err, KVD_EINVAL,
                             "kmeans: centroids must be a contiguous (k=%d, d=%lld) f32 tensor",
                             p->k, (long long)x->shape[1]);
    return ops->train(be, p, x, centroids, inertia, err);
}

int kvd_kmeans_assign(kvd_backend *be, const kvd_tensor *x, const kvd_tensor *centroids,
                      kvd_tensor *assign, kvd_tensor *dist2, kvd_error *err)
{
    const struct kvd_kmeans_ops *ops;
    int rc = get_ops(be, &ops, err);
    if (rc)
        return rc;
    if (!ops->assign)
        return kvd_error_set(err, KVD_EUNSUPP, "kmeans: assign not supported by the %s backend",
                             be->iface->name);
    if ((rc = check_points(x, "x", err)))
        return rc;
    if (!centroids || centroids->dtype != KVD_DTYPE_F32 || centroids->ndim != 2 ||
        centroids->shape[0] < 1 || centroids->shape[0] > INT32_MAX ||
        centroids->shape[1] != x->shape[1] || !kvd_tensor_is_contiguous(centroids) ||
        !centroids->data)
        return kvd_error_set(err, KVD_EINVAL, "kmeans: centroids must be a contiguous (k, d) f32 tensor");
    int64_t n = x->shape[0];
    if (!assign || assign->dtype != KVD_DTYPE_U32 || assign->ndim != 1 || assign->shape[0] != n ||
        !kvd_tensor_is_contiguous(assign) || (n && !assign->data))
        return kvd_error_set(err, KVD_EINVAL, "kmeans: assign must be a contiguous (n) u32 tensor");
    if (dist2 && (dist2->dtype != KVD_DTYPE_F32 || dist2->ndim != 1 || dist2->shape[0] != n ||
                  !kvd_tensor_is_contiguous(dist2) || (n && !dist2->data)))
        return kvd_error_set(err, KVD_EINVAL, "kmeans: dist2 must be a contiguous (n) f32 tensor");
    return ops->assign(be, x, centroids, assign, dist2, err);
}
