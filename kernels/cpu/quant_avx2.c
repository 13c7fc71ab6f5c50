/*
 * AVX2 row kernels of the INT2/INT4 quantizer. Same arithmetic as the scalar
 * reference (kvdepot/quant.h): per-group parameters from the shared scalar
 * kvd__qgroup_make, then per element sub, mul, add, floor, clamp; no fused
 * multiply-add anywhere, so the bytes equal the reference's.
 */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "common/quant_impl.h"
#include "common/simd_avx2.h"

KVD_AVX2_TARGET static inline float f16c_to_f32(uint16_t h) { return _cvtsh_ss(h); }

/* f16 element i of p as f32: p may be any address (a page's parameters lie
 * where its layout puts them, an odd offset included). */
KVD_AVX2_TARGET static inline float f16c_at(const uint16_t *p, int64_t i)
{
    uint16_t h;
    memcpy(&h, (const char *)p + 2 * i, 2);
    return _cvtsh_ss(h);
}

KVD_AVX2_TARGET static inline float hmin8(__m256 v)
{
    __m128 m = _mm_min_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_min_ps(m, _mm_movehl_ps(m, m));
    m = _mm_min_ss(m, _mm_shuffle_ps(m, m, 1));
    return _mm_cvtss_f32(m);
}

KVD_AVX2_TARGET static inline float hmax8(__m256 v)
{
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
    return _mm_cvtss_f32(m);
}

KVD_AVX2_TARGET static inline uint32_t hsum8_epi32(__m256i v)
{
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
    return (uint32_t)_mm_cvtsi128_si32(s);
}

/* kvd__qmix on 8 lanes */
KVD_AVX2_TARGET static inline __m256i mix8(__m256i x)
{
    x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
    x = _mm256_mullo_epi32(x, _mm256_set1_epi32((int)0x7feb352du));
    x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 15));
    x = _mm256_mullo_epi32(x, _mm256_set1_epi32((int)0x846ca68bu));
    x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
    return x;
}

/* kvd__qdraw on 8 lanes of indices */
KVD_AVX2_TARGET static inline __m256 draw8(__m256i idx, __m256i key)
{
    __m256i h = _mm256_add_epi32(_mm256_mullo_epi32(idx, _mm256_set1_epi32((int)0x9e3779b9u)), key);
    h = _mm256_srli_epi32(mix8(h), 8);
    return _mm256_mul_ps(_mm256_cvtepi32_ps(h), _mm256_set1_ps(1.0f / 16777216.0f));
}

/*
 * kvd__qgroup_make for 8 groups at once: the same IEEE operations lane by
 * lane (F16C conversions round to nearest even like the scalar ones), so the
 * parameters are bit-identical to the scalar function's.
 */
typedef struct qgroup8 {
    uint16_t min_h[8], scale_h[8];
    float mn[8], inv[8];
} qgroup8;

KVD_AVX2_TARGET static inline __m256i f16_round_dir(__m256 v, __m256i h, int down)
{
    /* h: 8 f16 (one per 32-bit lane) that round-to-nearest gave for v; step
     * one f16 toward -inf (down) or +inf (up, v >= 0) where it overshot */
    __m128i h16 = _mm_packus_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
    __m256 back = _mm256_cvtph_ps(h16);
    if (down) {
        __m256i over = _mm256_castps_si256(_mm256_cmp_ps(back, v, _CMP_GT_OQ));
        __m256i neg = _mm256_cmpgt_epi32(_mm256_and_si256(h, _mm256_set1_epi32(0x8000)),
                                         _mm256_setzero_si256());
        __m256i step = _mm256_blendv_epi8(_mm256_set1_epi32(-1), _mm256_set1_epi32(1), neg);
        return _mm256_add_epi32(h, _mm256_and_si256(step, over));
    }
    __m256i under = _mm256_castps_si256(_mm256_cmp_ps(back, v, _CMP_LT_OQ));
    return _mm256_sub_epi32(h, under); /* under is -1 where true */
}

KVD_AVX2_TARGET static inline void qgroup_make8(__m256 lo, __m256 hi, int bits, qgroup8 *g)
{
    const __m256 fmax = _mm256_set1_ps(65504.0f), fmin = _mm256_set1_ps(-65504.0f);
    const __m256 zero = _mm256_setzero_ps();
    __m256 valid = _mm256_cmp_ps(lo, hi, _CMP_LE_OQ); /* else no finite value: 0, 0 */
    lo = _mm256_and_ps(lo, valid);
    hi = _mm256_and_ps(hi, valid);
    lo = _mm256_min_ps(_mm256_max_ps(lo, fmin), fmax);
    hi = _mm256_min_ps(_mm256_max_ps(hi, fmin), fmax);
    __m256i hmin = _mm256_cvtepu16_epi32(_mm256_cvtps_ph(lo, _MM_FROUND_TO_NEAREST_INT));
    hmin = f16_round_dir(lo, hmin, 1);
    __m128i hmin16 = _mm_packus_epi32(_mm256_castsi256_si128(hmin), _mm256_extracti128_si256(hmin, 1));
    __m256 mn = _mm256_cvtph_ps(hmin16);
    __m256 s = _mm256_div_ps(_mm256_sub_ps(hi, mn), _mm256_set1_ps((float)((1 << bits) - 1)));
    s = _mm256_max_ps(s, zero); /* !(s > 0) -> 0, as the scalar code */
    __m256i hsc = _mm256_cvtepu16_epi32(_mm256_cvtps_ph(s, _MM_FROUND_TO_NEAREST_INT));
    hsc = f16_round_dir(s, hsc, 0);
    __m128i hsc16 = _mm_packus_epi32(_mm256_castsi256_si128(hsc), _mm256_extracti128_si256(hsc, 1));
    __m256 sc = _mm256_cvtph_ps(hsc16);
    __m256 inv = _mm256_and_ps(_mm256_div_ps(_mm256_set1_ps(1.0f), sc),
                               _mm256_cmp_ps(sc, zero, _CMP_GT_OQ));
    _mm_storeu_si128((__m128i *)g->min_h, hmin16);
    _mm_storeu_si128((__m128i *)g->scale_h, hsc16);
    _mm256_storeu_ps(g->mn, mn);
    _mm256_storeu_ps(g->inv, inv);
}

KVD_AVX2_TARGET
void kvd__quant_row_avx2(const void *x, kvd_dtype dt, int64_t n, int bits, int group,
                         int stochastic, uint32_t key, uint32_t idx0, uint32_t idx_step, uint8_t *codes,
                         uint16_t *min, uint16_t *scale, uint16_t *sum)
{
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    const __m256 pinf = _mm256_set1_ps(INFINITY), ninf = _mm256_set1_ps(-INFINITY);
    const __m256 zero = _mm256_setzero_ps(), half = _mm256_set1_ps(0.5f);
    const __m256 vq = _mm256_set1_ps((float)((1 << bits) - 1));
    const __m256i vkey = _mm256_set1_epi32((int)key);
    const __m256i lane_step = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
                                                 _mm256_set1_epi32((int)idx_step));
    const __m256i perm = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    const __m256i pick4 = _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                           -1, -1, 0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1,
                                           -1, -1, -1, -1);
    const int64_t ng = n / group;
    const int64_t es = (int64_t)kvd_dtype_size(dt);

    qgroup8 P8;
    for (int64_t g = 0; g < ng; g++) {
        const char *xg = (const char *)x + g * group * es;
        const int lane = (int)(g & 7);
        if (lane == 0) {
            /* parameters of the next (up to) 8 groups in one vector pass */
            float lo8[8] = {0}, hi8[8] = {0};
            for (int l = 0; l < 8 && g + l < ng; l++) {
                const char *xl = xg + l * group * es;
                __m256 lo = pinf, hi = ninf;
                for (int k = 0; k < group; k += 8) {
                    __m256 v = kvd__ld8(xl + k * es, dt);
                    __m256 fin = _mm256_cmp_ps(_mm256_and_ps(v, absmask), pinf, _CMP_LT_OQ);
                    lo = _mm256_min_ps(lo, _mm256_blendv_ps(pinf, v, fin));
                    hi = _mm256_max_ps(hi, _mm256_blendv_ps(ninf, v, fin));
                }
                lo8[l] = hmin8(lo);
                hi8[l] = hmax8(hi);
            }
            qgroup_make8(_mm256_loadu_ps(lo8), _mm256_loadu_ps(hi8), bits, &P8);
        }
        min[g] = P8.min_h[lane];
        scale[g] = P8.scale_h[lane];
        const __m256 vmn = _mm256_set1_ps(P8.mn[lane]), vinv = _mm256_set1_ps(P8.inv[lane]);
        __m256i vsum = _mm256_setzero_si256();
        uint8_t *out = codes + g * group * bits / 8;

        for (int k = 0; k < group; k += 32) {
            __m256i ci[4];
            if (group - k < 32) {
                /* groups of 8 or 16: 8 codes at a time, packed in order */
                for (int j = 0; 8 * j < group - k; j++) {
                    __m256 v = kvd__ld8(xg + (k + 8 * j) * es, dt);
                    v = _mm256_mul_ps(_mm256_sub_ps(v, vmn), vinv);
                    __m256 add = half;
                    if (stochastic) {
                        uint32_t base = idx0 + (uint32_t)(g * group + k + 8 * j) * idx_step;
                        add = draw8(_mm256_add_epi32(_mm256_set1_epi32((int)base), lane_step),
                                    vkey);
                    }
                    __m256 c = _mm256_floor_ps(_mm256_add_ps(v, add));
                    c = _mm256_min_ps(_mm256_max_ps(c, zero), vq);
                    __m256i c8 = _mm256_cvttps_epi32(c);
                    vsum = _mm256_add_epi32(vsum, c8);
                    uint32_t cs[8], w = 0;
                    _mm256_storeu_si256((__m256i *)cs, c8);
                    for (int l = 0; l < 8; l++)
                        w |= cs[l] << (l * bits);
                    memcpy(out + (k + 8 * j) * bits / 8, &w, (size_t)bits);
                }
                break;
            }
            for (int j = 0; j < 4; j++) {
                __m256 v = kvd__ld8(xg + (k + 8 * j) * es, dt);
                v = _mm256_mul_ps(_mm256_sub_ps(v, vmn), vinv);
                __m256 add = half;
                if (stochastic) {
                    uint32_t base = idx0 + (uint32_t)(g * group + k + 8 * j) * idx_step;
                    add = draw8(_mm256_add_epi32(_mm256_set1_epi32((int)base), lane_step), vkey);
                }
                __m256 c = _mm256_floor_ps(_mm256_add_ps(v, add));
                c = _mm256_max_ps(c, zero); /* NaN -> 0 (second operand wins) */
                c = _mm256_min_ps(c, vq);
                ci[j] = _mm256_cvttps_epi32(c);
                vsum = _mm256_add_epi32(vsum, ci[j]);
            }
            /* 32 codes -> 32 bytes in order */
            __m256i p = _mm256_packus_epi16(_mm256_packs_epi32(ci[0], ci[1]),
                                            _mm256_packs_epi32(ci[2], ci[3]));
            p = _mm256_permutevar8x32_epi32(p, perm);
            if (bits == 2) {
                /* bytes (c0,c1) -> c0 + 4 c1; pairs of those -> + 16 (c2 + 4 c3) */
                __m256i m = _mm256_maddubs_epi16(p, _mm256_set1_epi16(0x0401));
                m = _mm256_madd_epi16(m, _mm256_set1_epi32(0x00100001));
                m = _mm256_shuffle_epi8(m, pick4);
                uint32_t a = (uint32_t)_mm_cvtsi128_si32(_mm256_castsi256_si128(m));
                uint32_t b = (uint32_t)_mm_cvtsi128_si32(_mm256_extracti128_si256(m, 1));
                memcpy(out + k / 4, &a, 4);
                memcpy(out + k / 4 + 4, &b, 4);
            } else {
                __m256i m = _mm256_maddubs_epi16(p, _mm256_set1_epi16(0x1001));
                m = _mm256_packus_epi16(m, m);
                m = _mm256_permute4x64_epi64(m, 0x08);
                _mm_storeu_si128((__m128i *)(out + k / 2), _mm256_castsi256_si128(m));
            }
        }
        sum[g] = (uint16_t)hsum8_epi32(vsum);
    }
}

KVD_AVX2_TARGET
void kvd__dequant_row_avx2(float *y, int64_t n, int bits, int group, const uint8_t *codes,
                           const uint16_t *min, const uint16_t *scale)
{
    const int64_t ng = n / group;
    const __m256i sh2 = _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14);
    const __m256i sh4 = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
    const __m256i m2 = _mm256_set1_epi32(3), m4 = _mm256_set1_epi32(15);
    for (int64_t g = 0; g < ng; g++) {
        const __m256 vmn = _mm256_set1_ps(f16c_at(min, g));
        const __m256 vsc = _mm256_set1_ps(f16c_at(scale, g));
        const uint8_t *cg = codes + g * group * bits / 8;
        float *yg = y + g * group;
        if (bits == 2) {
            for (int k = 0; k < group; k += 8) {
                uint16_t w;
                memcpy(&w, cg + k / 4, 2);
                __m256i c = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(w), sh2), m2);
                __m256 f = _mm256_cvtepi32_ps(c);
                _mm256_storeu_ps(yg + k, _mm256_add_ps(vmn, _mm256_mul_ps(vsc, f)));
            }
        } else {
            for (int k = 0; k < group; k += 8) {
                uint32_t w;
                memcpy(&w, cg + k / 2, 4);
                __m256i c = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int)w), sh4), m4);
                __m256 f = _mm256_cvtepi32_ps(c);
                _mm256_storeu_ps(yg + k, _mm256_add_ps(vmn, _mm256_mul_ps(vsc, f)));
            }
        }
    }
}

/*
 * Channel-axis kernels: one tile of `group` tokens, all D channels, vectors
 * across 8 channels at a time so the token-major input is read in place (no
 * transpose). Requires D % 8 == 0 and contiguous channels. Codes of one
 * channel are gathered into 32-bit words (32/bits tokens each) and stored
 * into that channel's code row.
 *
 *   x0: row of the tile's first token; xs: bytes between token rows
 *   idx0: t0 * D, the stochastic index of element (t0, 0)
 *   codes: channel 0's code row at the tile's first byte; crow: bytes per
 *          code row (T * bits / 8)
 *   min/scale/sum: channel 0's parameter of this tile; prow: parameters per
 *          channel row (T / group)
 */
KVD_AVX2_TARGET
void kvd__quant_tile_channel_avx2(const char *x0, int64_t xs, kvd_dtype dt, int64_t D, int bits,
                                  int group, int stochastic, uint32_t key, uint32_t idx0,
                                  uint8_t *codes, int64_t crow, uint16_t *min, uint16_t *scale,
                                  uint16_t *sum, int64_t prow)
{
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    const __m256 pinf = _mm256_set1_ps(INFINITY), ninf = _mm256_set1_ps(-INFINITY);
    const __m256 zero = _mm256_setzero_ps(), half = _mm256_set1_ps(0.5f);
    const __m256 vq = _mm256_set1_ps((float)((1 << bits) - 1));
    const __m256i vkey = _mm256_set1_epi32((int)key);
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const int64_t es = (int64_t)kvd_dtype_size(dt);
    /* tokens per code word: 32 bits' worth, or the whole group (8 INT2
     * tokens, a 16-bit word) */
    const int per = group < 32 / bits ? group : 32 / bits;
    const size_t wbytes = (size_t)per * (size_t)bits / 8;

    for (int64_t d0 = 0; d0 < D; d0 += 8) {
        const char *xc = x0 + d0 * es;
        __m256 lo = pinf, hi = ninf;
        for (int k = 0; k < group; k++) {
            __m256 v = kvd__ld8(xc + k * xs, dt);
            __m256 fin = _mm256_cmp_ps(_mm256_and_ps(v, absmask), pinf, _CMP_LT_OQ);
            lo = _mm256_min_ps(lo, _mm256_blendv_ps(pinf, v, fin));
            hi = _mm256_max_ps(hi, _mm256_blendv_ps(ninf, v, fin));
        }
        qgroup8 P8;
        qgroup_make8(lo, hi, bits, &P8);
        for (int l = 0; l < 8; l++) {
            min[(d0 + l) * prow] = P8.min_h[l];
            scale[(d0 + l) * prow] = P8.scale_h[l];
        }
        const __m256 vmn = _mm256_loadu_ps(P8.mn), vinv = _mm256_loadu_ps(P8.inv);
        __m256i vsum = _mm256_setzero_si256();
        for (int k0 = 0; k0 < group; k0 += per) {
            __m256i acc = _mm256_setzero_si256();
            for (int kk = 0; kk < per; kk++) {
                const int k = k0 + kk;
                __m256 v = kvd__ld8(xc + k * xs, dt);
                v = _mm256_mul_ps(_mm256_sub_ps(v, vmn), vinv);
                __m256 add = half;
                if (stochastic) {
                    uint32_t base = idx0 + (uint32_t)k * (uint32_t)D + (uint32_t)d0;
                    add = draw8(_mm256_add_epi32(_mm256_set1_epi32((int)base), lanes), vkey);
                }
                __m256 c = _mm256_floor_ps(_mm256_add_ps(v, add));
                c = _mm256_max_ps(c, zero); /* NaN -> 0 */
                c = _mm256_min_ps(c, vq);
                __m256i ci = _mm256_cvttps_epi32(c);
                vsum = _mm256_add_epi32(vsum, ci);
                acc = _mm256_or_si256(acc, _mm256_sll_epi32(ci, _mm_cvtsi32_si128(kk * bits)));
            }
            uint32_t w[8];
            _mm256_storeu_si256((__m256i *)w, acc);
            for (int l = 0; l < 8; l++)
                memcpy(codes + (d0 + l) * crow + k0 * bits / 8, &w[l], wbytes);
        }
        uint32_t s8[8];
        _mm256_storeu_si256((__m256i *)s8, vsum);
        for (int l = 0; l < 8; l++)
            sum[(d0 + l) * prow] = (uint16_t)s8[l];
    }
}

/* Inverse of the above: writes `group` token rows (y0, ys bytes apart,
 * dtype dt, contiguous channels) of the tile. */
KVD_AVX2_TARGET
void kvd__dequant_tile_channel_avx2(char *y0, int64_t ys, kvd_dtype dt, int64_t D, int bits,
                                    int group, const uint8_t *codes, int64_t crow,
                                    const uint16_t *min, const uint16_t *scale, int64_t prow)
{
    const int64_t es = (int64_t)kvd_dtype_size(dt);
    const int per = group < 32 / bits ? group : 32 / bits; /* as the quantizer */
    const size_t wbytes = (size_t)per * (size_t)bits / 8;
    const __m256i mask = _mm256_set1_epi32((1 << bits) - 1);
    for (int64_t d0 = 0; d0 < D; d0 += 8) {
        float mn8[8], sc8[8];
        for (int l = 0; l < 8; l++) {
            mn8[l] = f16c_at(min, (d0 + l) * prow);
            sc8[l] = f16c_at(scale, (d0 + l) * prow);
        }
        const __m256 vmn = _mm256_loadu_ps(mn8), vsc = _mm256_loadu_ps(sc8);
        char *yc = y0 + d0 * es;
        for (int k0 = 0; k0 < group; k0 += per) {
            uint32_t w[8] = {0};
            for (int l = 0; l < 8; l++)
                memcpy(&w[l], codes + (d0 + l) * crow + k0 * bits / 8, wbytes);
            const __m256i vw = _mm256_loadu_si256((const __m256i *)w);
            for (int kk = 0; kk < per; kk++) {
                __m256i c = _mm256_and_si256(_mm256_srl_epi32(vw, _mm_cvtsi32_si128(kk * bits)), mask);
                __m256 y = _mm256_add_ps(vmn, _mm256_mul_ps(vsc, _mm256_cvtepi32_ps(c)));
                kvd__st8(yc + (k0 + kk) * ys, dt, y);
            }
        }
    }
}
