/*
 * AVX2/F16C helpers shared by the CPU fast paths (internal).
 *
 * Functions here carry KVD_AVX2_TARGET and may only be called from functions
 * with the same target, after kvd__cpu_fast() said yes. The conversions are
 * bit-identical to the scalar kvd_f32_to_f16 / kvd_f32_to_bf16 /
 * kvd_f16_to_f32 / kvd_bf16_to_f32 for every finite and infinite value and
 * keep NaN a (quiet) NaN.
 */
#ifndef KVDEPOT_SIMD_AVX2_H
#define KVDEPOT_SIMD_AVX2_H

#include <immintrin.h>
#include <stdint.h>

#include "kvdepot/tensor.h"

#define KVD_AVX2_TARGET __attribute__((target("avx2,fma,f16c")))

/* 8 f16 -> 8 f32 */
KVD_AVX2_TARGET static inline __m256 kvd__ld8_f16(const uint16_t *p)
{
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
}

/* 8 bf16 -> 8 f32: a bf16 is the top half of an f32 */
KVD_AVX2_TARGET static inline __m256 kvd__ld8_bf16(const uint16_t *p)
{
    __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}

/* 8 f32 -> 8 f16, round to nearest even */
KVD_AVX2_TARGET static inline void kvd__st8_f16(uint16_t *p, __m256 v)
{
    _mm_storeu_si128((__m128i *)p, _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
}

/* 8 f32 -> 8 bf16, round to nearest even; NaN -> quiet NaN (top half | 0x40),
 * exactly as kvd_f32_to_bf16. */
KVD_AVX2_TARGET static inline __m128i kvd__cvt8_bf16(__m256 v)
{
    __m256i u = _mm256_castps_si256(v);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb));
    r = _mm256_srli_epi32(r, 16);
    __m256i nanv = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
    __m256i absu = _mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff));
    __m256i isnan = _mm256_cmpgt_epi32(absu, _mm256_set1_epi32(0x7f800000));
    r = _mm256_blendv_epi8(r, nanv, isnan);
    r = _mm256_and_si256(r, _mm256_set1_epi32(0xffff));
    /* pack 8 x u32 (each < 65536) to 8 x u16 */
    __m128i lo = _mm256_castsi256_si128(r), hi = _mm256_extracti128_si256(r, 1);
    return _mm_packus_epi32(lo, hi);
}

KVD_AVX2_TARGET static inline void kvd__st8_bf16(uint16_t *p, __m256 v)
{
    _mm_storeu_si128((__m128i *)p, kvd__cvt8_bf16(v));
}

/* Load 8 elements of dtype t (f32/f16/bf16) as f32. */
KVD_AVX2_TARGET static inline __m256 kvd__ld8(const void *p, kvd_dtype t)
{
    if (t == KVD_DTYPE_F16)
        return kvd__ld8_f16((const uint16_t *)p);
    if (t == KVD_DTYPE_BF16)
        return kvd__ld8_bf16((const uint16_t *)p);
    return _mm256_loadu_ps((const float *)p);
}

/* Store 8 f32 as dtype t. */
KVD_AVX2_TARGET static inline void kvd__st8(void *p, kvd_dtype t, __m256 v)
{
    if (t == KVD_DTYPE_F16)
        kvd__st8_f16((uint16_t *)p, v);
    else if (t == KVD_DTYPE_BF16)
        kvd__st8_bf16((uint16_t *)p, v);
    else
        _mm256_storeu_ps((float *)p, v);
}

/* Contiguous row conversions (n any; tail done scalar with the exact scalar
 * conversions, which agree with the vector ones). */
void kvd__row_to_f32_avx2(float *dst, const void *src, kvd_dtype t, int64_t n);
void kvd__row_from_f32_avx2(void *dst, kvd_dtype t, const float *src, int64_t n);

#endif /* KVDEPOT_SIMD_AVX2_H */
