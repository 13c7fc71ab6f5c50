/*
 * AVX2/F16C kernels for kernels/cpu/convert.c and the row conversions other
 * CPU ops share (kvd__row_to_f32_avx2 / kvd__row_from_f32_avx2).
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "common/convert_impl.h"
#include "common/cpu_internal.h"
#include "common/simd_avx2.h"

KVD_AVX2_TARGET
void kvd__row_to_f32_avx2(float *dst, const void *src, kvd_dtype t, int64_t n)
{
    if (t == KVD_DTYPE_F32) {
        memmove(dst, src, (size_t)n * sizeof(float));
        return;
    }
    const uint16_t *s = src;
    int64_t i = 0;
    if (t == KVD_DTYPE_F16) {
        for (; i + 8 <= n; i += 8)
            _mm256_storeu_ps(dst + i, kvd__ld8_f16(s + i));
        for (; i < n; i++)
            dst[i] = kvd_f16_to_f32(s[i]);
    } else {
        for (; i + 8 <= n; i += 8)
            _mm256_storeu_ps(dst + i, kvd__ld8_bf16(s + i));
        for (; i < n; i++)
            dst[i] = kvd_bf16_to_f32(s[i]);
    }
}

KVD_AVX2_TARGET
void kvd__row_from_f32_avx2(void *dst, kvd_dtype t, const float *src, int64_t n)
{
    if (t == KVD_DTYPE_F32) {
        memmove(dst, src, (size_t)n * sizeof(float));
        return;
    }
    uint16_t *d = dst;
    int64_t i = 0;
    if (t == KVD_DTYPE_F16) {
        for (; i + 8 <= n; i += 8)
            kvd__st8_f16(d + i, _mm256_loadu_ps(src + i));
        for (; i < n; i++)
            d[i] = kvd_f32_to_f16(src[i]);
    } else {
        for (; i + 8 <= n; i += 8)
            kvd__st8_bf16(d + i, _mm256_loadu_ps(src + i));
        for (; i < n; i++)
            d[i] = kvd_f32_to_bf16(src[i]);
    }
}

/* Contiguous row: dst (dtype td) = src (dtype ts), n elements, no staging. */
KVD_AVX2_TARGET
void kvd__convert_row_avx2(void *dst, kvd_dtype td, const void *src, kvd_dtype ts, int64_t n)
{
    const size_t es = kvd_dtype_size(ts), ed = kvd_dtype_size(td);
    const char *s = src;
    char *d = dst;
    if (td == ts) {
        memmove(d, s, (size_t)n * es);
        return;
    }
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        kvd__st8(d + i * ed, td, kvd__ld8(s + i * es, ts));
    for (; i < n; i++)
        kvd__store_float(d + i * ed, td, kvd__load_float(s + i * es, ts));
}

/*
 * In-place fast Walsh-Hadamard transform of an f32 row of length n (a power
 * of two >= 8), natural (Sylvester) order, then scaled by `norm`.
 * Stages h = 1, 2, 4 run inside one vector with lane swaps; the others pair
 * whole vectors.
 */
KVD_AVX2_TARGET
void kvd__fwht_avx2(float *x, int64_t n, float norm)
{
    for (int64_t i = 0; i < n; i += 8) {
        __m256 a = _mm256_loadu_ps(x + i), b;
        /* h = 1: lanes (2j, 2j+1) -> (x0 + x1, x0 - x1) */
        b = _mm256_permute_ps(a, 0xB1);
        a = _mm256_blend_ps(_mm256_add_ps(a, b), _mm256_sub_ps(b, a), 0xAA);
        /* h = 2 */
        b = _mm256_permute_ps(a, 0x4E);
        a = _mm256_blend_ps(_mm256_add_ps(a, b), _mm256_sub_ps(b, a), 0xCC);
        /* h = 4 */
        b = _mm256_permute2f128_ps(a, a, 0x01);
        a = _mm256_blend_ps(_mm256_add_ps(a, b), _mm256_sub_ps(b, a), 0xF0);
        _mm256_storeu_ps(x + i, a);
    }
    for (int64_t h = 8; h < n; h *= 2) {
        for (int64_t i = 0; i < n; i += 2 * h) {
            for (int64_t j = i; j < i + h; j += 8) {
                __m256 a = _mm256_loadu_ps(x + j), b = _mm256_loadu_ps(x + j + h);
                _mm256_storeu_ps(x + j, _mm256_add_ps(a, b));
                _mm256_storeu_ps(x + j + h, _mm256_sub_ps(a, b));
            }
        }
    }
    const __m256 vn = _mm256_set1_ps(norm);
    for (int64_t i = 0; i < n; i += 8)
        _mm256_storeu_ps(x + i, _mm256_mul_ps(_mm256_loadu_ps(x + i), vn));
}

/* y[j] = x[j] * s[j] or x[j] / s[j], all f32 contiguous. */
KVD_AVX2_TARGET
void kvd__scale_row_avx2(float *y, const float *x, const float *s, int64_t n, int divide)
{
    int64_t i = 0;
    if (divide) {
        for (; i + 8 <= n; i += 8)
            _mm256_storeu_ps(y + i, _mm256_div_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(s + i)));
        for (; i < n; i++)
            y[i] = x[i] / s[i];
    } else {
        for (; i + 8 <= n; i += 8)
            _mm256_storeu_ps(y + i, _mm256_mul_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(s + i)));
        for (; i < n; i++)
            y[i] = x[i] * s[i];
    }
}
