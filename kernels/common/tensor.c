#include "kvdepot/tensor.h"

#include <string.h>

size_t kvd_dtype_size(kvd_dtype t)
{
    switch (t) {
    case KVD_DTYPE_F16:
    case KVD_DTYPE_BF16:
    case KVD_DTYPE_U16:
        return 2;
    case KVD_DTYPE_F32:
    case KVD_DTYPE_I32:
    case KVD_DTYPE_U32:
        return 4;
    case KVD_DTYPE_U8:
    case KVD_DTYPE_I8:
        return 1;
    default:
        return 0;
    }
}

const char *kvd_dtype_name(kvd_dtype t)
{
    static const char *const names[KVD_DTYPE_COUNT] = {
        "invalid", "f16", "bf16", "f32", "u8", "i8", "u16", "i32", "u32",
    };
    return (t > 0 && t < KVD_DTYPE_COUNT) ? names[t] : "invalid";
}

int kvd_dtype_is_float(kvd_dtype t)
{
    return t == KVD_DTYPE_F16 || t == KVD_DTYPE_BF16 || t == KVD_DTYPE_F32;
}

kvd_tensor kvd_tensor_make(kvd_dtype dtype, void *data, int ndim, const int64_t *shape)
{
    kvd_tensor t;
    memset(&t, 0, sizeof t);
    t.dtype = dtype;
    t.data = data;
    if (ndim < 0 || ndim > KVD_MAX_DIMS)
        ndim = 0;
    t.ndim = ndim;
    int64_t stride = (int64_t)kvd_dtype_size(dtype);
    for (int i = ndim - 1; i >= 0; i--) {
        t.shape[i] = shape[i];
        t.stride[i] = stride;
        stride *= shape[i];
    }
    return t;
}

int64_t kvd_tensor_nelem(const kvd_tensor *t)
{
    int64_t n = 1;
    for (int i = 0; i < t->ndim; i++)
        n *= t->shape[i];
    return n;
}

int kvd_tensor_is_contiguous(const kvd_tensor *t)
{
    int64_t stride = (int64_t)kvd_dtype_size(t->dtype);
    for (int i = t->ndim - 1; i >= 0; i--) {
        if (t->shape[i] != 1 && t->stride[i] != stride)
            return 0;
        stride *= t->shape[i];
    }
    return 1;
}

static uint32_t f32_bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static float bits_f32(uint32_t u)
{
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

float kvd_f16_to_f32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1f;
    uint32_t man = h & 0x3ffu;
    if (exp == 0x1f) /* inf / nan: keep the payload */
        return bits_f32(sign | 0x7f800000u | (man << 13));
    if (exp == 0) {
        if (man == 0)
            return bits_f32(sign);
        /* subnormal: value = man * 2^-24 */
        float v = (float)man * 5.9604644775390625e-08f;
        return sign ? -v : v;
    }
    return bits_f32(sign | ((exp + 112) << 23) | (man << 13));
}

uint16_t kvd_f32_to_f16(float f)
{
    uint32_t u = f32_bits(f);
    uint32_t sign = (u >> 16) & 0x8000u;
    uint32_t exp = (u >> 23) & 0xff;
    uint32_t man = u & 0x7fffffu;
    if (exp == 0xff) /* inf stays inf; nan stays a quiet nan */
        return (uint16_t)(sign | 0x7c00u | (man ? (0x200u | (man >> 13)) : 0));
    int32_t e = (int32_t)exp - 127 + 15;
    if (e >= 0x1f)
        return (uint16_t)(sign | 0x7c00u);
    if (e <= 0) {
        if (e < -10)
            return (uint16_t)sign;
        /* subnormal half: shift the full mantissa, round to nearest even */
        man |= 0x800000u;
        uint32_t shift = (uint32_t)(14 - e);
        uint32_t half = man >> shift;
        uint32_t rem = man & ((1u << shift) - 1);
        uint32_t mid = 1u << (shift - 1);
        if (rem > mid || (rem == mid && (half & 1)))
            half++;
        return (uint16_t)(sign | half);
    }
    uint32_t half = sign | ((uint32_t)e << 10) | (man >> 13);
    uint32_t rem = man & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (half & 1)))
        half++; /* may carry into the exponent, which rounds up to inf correctly */
    return (uint16_t)half;
}

float kvd_bf16_to_f32(uint16_t h) { return bits_f32((uint32_t)h << 16); }

uint16_t kvd_f32_to_bf16(float f)
{
    uint32_t u = f32_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) /* nan: keep it a quiet nan */
        return (uint16_t)((u >> 16) | 0x40u);
    uint32_t lsb = (u >> 16) & 1u;
    u += 0x7fffu + lsb;
    return (uint16_t)(u >> 16);
}
