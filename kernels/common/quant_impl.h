/*
 * Pieces of the INT2/INT4 quantizer shared by the scalar reference and the
 * fast paths (internal). Sharing them, rather than re-deriving them per path,
 * is what makes every path produce the same bytes: the per-group parameters
 * come from the same scalar code and the per-element arithmetic is the same
 * IEEE sequence (sub, mul, add, floor) in every path. See kvdepot/quant.h for
 * the specification.
 */
#ifndef KVDEPOT_QUANT_IMPL_H
#define KVDEPOT_QUANT_IMPL_H

#include <math.h>
#include <stdint.h>

#include "kvdepot/quant.h"
#include "kvdepot/tensor.h"

#define KVD__F16_MAX 65504.0f

/*
 * Per-group parameters from the finite min/max (lo > hi when the group had no
 * finite value). Outputs the stored f16 min and scale and the f32 values the
 * element loop uses: mn = min and inv = 1 / scale (0 for a zero scale).
 *
 * The function is generated from one body for each pair of f16 conversions:
 * the portable scalar ones for the reference, F16C instructions for the fast
 * path. Both round to nearest even and agree on every finite value, which is
 * all this code converts, so both produce the same parameters.
 *
 * min is lo rounded DOWN to f16 (one f16 step toward -inf when round-to-
 * nearest went above lo); scale is (hi - min) / qmax rounded UP to f16.
 */
typedef struct kvd__qgroup {
    uint16_t min_h, scale_h;
    float mn, inv;
} kvd__qgroup;

#define KVD__DEFINE_QGROUP_MAKE(NAME, ATTR, TO16, FROM16)                             \
    ATTR static inline kvd__qgroup NAME(float lo, float hi, int bits)                 \
    {                                                                                 \
        kvd__qgroup g;                                                                \
        if (!(lo <= hi)) /* no finite value */                                        \
            lo = hi = 0.0f;                                                           \
        lo = lo < -KVD__F16_MAX ? -KVD__F16_MAX : lo > KVD__F16_MAX ? KVD__F16_MAX : lo; \
        hi = hi < -KVD__F16_MAX ? -KVD__F16_MAX : hi > KVD__F16_MAX ? KVD__F16_MAX : hi; \
        const float qmax = (float)((1 << bits) - 1);                                  \
        uint16_t h = TO16(lo);                                                        \
        if (FROM16(h) > lo) /* toward -inf: magnitude up if negative, down if not */  \
            h = (h & 0x8000u) ? (uint16_t)(h + 1) : (uint16_t)(h - 1);                \
        g.min_h = h;                                                                  \
        g.mn = FROM16(h);                                                             \
        float s = (hi - g.mn) / qmax;                                                 \
        if (!(s > 0.0f))                                                              \
            s = 0.0f;                                                                 \
        h = TO16(s);                                                                  \
        if (FROM16(h) < s) /* s >= 0: one step up */                                  \
            h = (uint16_t)(h + 1);                                                    \
        g.scale_h = h;                                                                \
        const float sc = FROM16(h);                                                   \
        g.inv = sc > 0.0f ? 1.0f / sc : 0.0f;                                         \
        return g;                                                                     \
    }

KVD__DEFINE_QGROUP_MAKE(kvd__qgroup_make, , kvd_f32_to_f16, kvd_f16_to_f32)

/* Stochastic rounding hash (see kvdepot/quant.h). */
static inline uint32_t kvd__qmix(uint32_t x)
{
    x ^= x >> 16;
    x *= 0x7feb352du;
    x ^= x >> 15;
    x *= 0x846ca68bu;
    x ^= x >> 16;
    return x;
}

static inline uint32_t kvd__qkey(uint64_t seed)
{
    return kvd__qmix((uint32_t)seed ^ kvd__qmix((uint32_t)(seed >> 32) + 0x9e3779b9u));
}

static inline float kvd__qdraw(uint32_t key, uint32_t index)
{
    uint32_t h = kvd__qmix(index * 0x9e3779b9u + key);
    return (float)(h >> 8) * (1.0f / 16777216.0f);
}

/* One code, exactly as the specification: r = v + 0.5 or v + u. */
static inline uint32_t kvd__qcode(float x, float mn, float inv, float add, float qmax)
{
    float v = (x - mn) * inv;
    float c = floorf(v + add);
    if (!(c > 0.0f)) /* also NaN */
        c = 0.0f;
    if (c > qmax)
        c = qmax;
    return (uint32_t)c;
}

/*
 * Fast-path row kernels (kernels/cpu/quant_avx2.c). A "row" is n = ngroups*PI
 * contiguous values (f32/f16/bf16 for quantize, f32 out for dequantize)
 * forming consecutive groups of one row of the code layout:
 * element k of the row has stochastic index idx0 + k * idx_step.
 */
void kvd__quant_row_avx2(const void *x, kvd_dtype dt, int64_t n, int bits, int group,
                         int stochastic,
                         uint32_t key, uint32_t idx0, uint32_t idx_step, uint8_t *codes,
                         uint16_t *min, uint16_t *scale, uint16_t *sum);
void kvd__dequant_row_avx2(float *y, int64_t n, int bits, int group, const uint8_t *codes,
                           const uint16_t *min, const uint16_t *scale);

/* Channel-axis tile kernels (D % 8 == 0, contiguous channels); see
 * kernels/cpu/quant_avx2.c for the arguments. */
void kvd__quant_tile_channel_avx2(const char *x0, int64_t xs, kvd_dtype dt, int64_t D, int bits,
                                  int group, int stochastic, uint32_t key, uint32_t idx0,
                                  uint8_t *codes, int64_t crow, uint16_t *min, uint16_t *scale,
                                  uint16_t *sum, int64_t prow);
void kvd__dequant_tile_channel_avx2(char *y0, int64_t ys, kvd_dtype dt, int64_t D, int bits,
                                    int group, const uint8_t *codes, int64_t crow,
                                    const uint16_t *min, const uint16_t *scale, int64_t prow);

#endif /* KVDEPOT_QUANT_IMPL_H */
