/*
 * INT2 / INT4 asymmetric group quantization of K/V blocks (HACK).
 *
 * A block is T tokens x D dims of ONE kv head. Values are split into groups
 * of PI (Π) consecutive values; each group stores an fp16 `min`, an fp16
 * `scale` and the uint16 sum of its codes (the sum lets homomorphic attention
 * correct an integer dot product without touching the codes again):
 *
 *     x ~= min + scale * code,    code in [0, 2^bits - 1]
 *
 * Two grouping axes:
 *
 *   KVD_QAXIS_TOKEN   groups run along head_dim inside one token row (K, and
 *                     V in KIVI mode). D must be a multiple of PI; any T >= 0.
 *   KVD_QAXIS_CHANNEL groups run along tokens inside one channel (V in HACK
 *                     mode). T must be a multiple of PI (a page is); any D >= 0.
 *
 * FIXED LAYOUTS (all arrays contiguous, row-major; CUDA uses the same bytes):
 *
 *   input / dequantized output: (T, D) f32|f16|bf16, any byte strides
 *
 *   token axis:
 *     codes  (T, D*bits/8) uint8   value j of token row t is in byte
 *                                  j / (8/bits) at bit offset
 *                                  (j % (8/bits)) * bits (little-endian in
 *                                  the byte: value 0 in the low bits)
 *     min    (T, D/PI) f16         group g covers dims [g*PI, (g+1)*PI)
 *     scale  (T, D/PI) f16
 *     sum    (T, D/PI) u16         sum of the PI codes of the group
 *
 *   channel axis:
 *     codes  (D, T*bits/8) uint8   row d packs tokens t = 0..T-1 of channel d
 *                                  the same way (token t in byte t/(8/bits),
 *                                  bit offset (t % (8/bits)) * bits)
 *     min    (D, T/PI) f16         group g covers tokens [g*PI, (g+1)*PI)
 *     scale  (D, T/PI) f16
 *     sum    (D, T/PI) u16
 *
 * Quantization of one group (kvd_quantize_ref is the specification; every
 * fast path and backend produces identical bytes):
 *
 *   qmax = 2^bits - 1
 *   lo, hi = min and max over the FINITE values of the group (NaN and +-Inf
 *            are ignored); a group with no finite value uses lo = hi = 0;
 *            lo and hi are then clamped to the f16 range [-65504, 65504]
 *   min    = lo rounded DOWN to f16 (so min <= every finite value)
 *   scale  = (hi - min) / qmax in f32, rounded UP to f16 (so the grid
 *            min + scale*[0, qmax] covers [lo, hi] despite the f16 rounding)
 *   inv    = scale > 0 ? 1.0f / scale : 0  (f32; a constant group, max == min,
 *            gets scale 0, every code 0, sum 0, and dequantizes to min exactly)
 *   v      = (x - min) * inv                     (f32, no fused multiply-add)
 *   code   = floor(v + 0.5f)                     round to nearest, or
 *            floor(v + u(seed, t*D + d))         stochastic rounding,
 *            then clamped to [0, qmax]; a NaN code becomes 0.
 *   So: NaN -> 0, -Inf -> 0, +Inf -> qmax (0 if scale == 0), finite values
 *   beyond the f16 range -> 0 or qmax.
 *   sum    = sum of the codes of the group.
 *
 * Stochastic rounding draws u in [0, 1) from a counter-based hash of the seed
 * and the element's index t*D + d in the (T, D) block (whatever the axis), so
 * the result does not depend on thread count, vector width or backend:
 *
 *   mix(x):  x ^= x >> 16; x *= 0x7feb352d; x ^= x >> 15;
 *            x *= 0x846ca68b; x ^= x >> 16              (uint32 arithmetic)
 *   key    = mix((uint32)seed ^ mix((uint32)(seed >> 32) + 0x9e3779b9))
 *   u      = (mix((uint32)(t*D + d) * 0x9e3779b9 + key) >> 8) * 2^-24
 *
 * floor(v + u) rounds up with probability frac(v), so E[code] = v inside the
 * grid: the rounding is unbiased. Callers quantizing several blocks should
 * vary the seed per block (e.g. hash of sequence, layer, head, page).
 *
 * Dequantization: y = min + scale * code, as f32 multiply then add (no fused
 * multiply-add), then rounded to the output dtype (round-to-nearest-even).
 * With round-to-nearest, |x - y| <= scale/2 for every finite x in range (up
 * to f32 rounding).
 */
#ifndef KVDEPOT_QUANT_H
#define KVDEPOT_QUANT_H

#include <stddef.h>
#include <stdint.h>

#include "kvdepot/backend.h"
#include "kvdepot/status.h"
#include "kvdepot/tensor.h"

typedef enum kvd_quant_axis {
    KVD_QAXIS_TOKEN = 0,   /* groups along head_dim per token (K; V in KIVI mode) */
    KVD_QAXIS_CHANNEL = 1, /* groups along tokens per channel (V in HACK mode; K in KIVI mode) */
} kvd_quant_axis;

typedef enum kvd_rounding {
    KVD_ROUND_NEAREST = 0,
    KVD_ROUND_STOCHASTIC = 1,
} kvd_rounding;

/*
 * A quantized block: format plus pointers to its four arrays (memory of the
 * backend that runs the op; not owned). Layouts as described above.
 */
typedef struct kvd_qtensor {
    int bits;            /* 2 or 4 */
    int group;           /* PI: 8, 16, 32, 64 or 128 */
    kvd_quant_axis axis;
    int64_t ntok;        /* T */
    int64_t dim;         /* D */
    uint8_t *codes;      /* token axis (T, D*bits/8); channel axis (D, T*bits/8) */
    uint16_t *min;       /* f16 bits; token axis (T, D/PI); channel axis (D, T/PI) */
    uint16_t *scale;     /* f16 bits, same shape as min */
    uint16_t *sum;       /* u16, same shape as min */
} kvd_qtensor;

/* Byte sizes of the arrays of one block. */
typedef struct kvd_quant_sizes {
    size_t codes_bytes;  /* T * D * bits / 8 */
    size_t ngroups;      /* groups in the block: T*D/PI */
    size_t params_bytes; /* 3 * ngroups * 2: min, scale and sum */
    size_t total_bytes;  /* codes_bytes + params_bytes */
} kvd_quant_sizes;

/*
 * Sizes of a block with this format. Returns KVD_EINVAL (message naming the
 * problem) when bits is not 2/4, PI not 8/16/32/64/128, sizes negative, or the
 * grouped dimension (D for the token axis, T for the channel axis) is not a
 * multiple of PI. @param[out] out zeroed on failure.
 */
int kvd_quant_size(int64_t ntok, int64_t dim, int bits, int group, kvd_quant_axis axis,
                   kvd_quant_sizes *out, kvd_error *err);

/*
 * Fill q with the format and point its arrays into one buffer `buf` of at
 * least sizes.total_bytes, in the order codes | min | scale | sum (the
 * "packed block" order; every section starts at an even offset). buf may be
 * NULL to only fill the format (pointers NULL). Returns as kvd_quant_size.
 */
int kvd_qtensor_init(kvd_qtensor *q, int64_t ntok, int64_t dim, int bits, int group,
                     kvd_quant_axis axis, void *buf, kvd_error *err);

/* The stochastic-rounding draw u(seed, index) in [0, 1) described above. */
float kvd_quant_stochastic_u(uint64_t seed, uint32_t index);

/*
 * Backend op table. The wrappers below validate, then call these; a backend
 * may assume valid arguments.
 */
struct kvd_quant_ops {
    /* x (T, D) float of any strides -> q (format, T and D already set). */
    int (*quantize)(kvd_backend *be, const kvd_tensor *x, const kvd_qtensor *q,
                    kvd_rounding rounding, uint64_t seed, kvd_error *err);
    /* q -> y (T, D) f32|f16|bf16 of any strides. */
    int (*dequantize)(kvd_backend *be, const kvd_qtensor *q, const kvd_tensor *y,
                      kvd_error *err);
    /* n blocks of one format (kvd_quantize_batch). NULL: quantize each. */
    int (*quantize_batch)(kvd_backend *be, int n, const kvd_tensor *x, const kvd_qtensor *q,
                          kvd_rounding rounding, const uint64_t *seeds, kvd_error *err);
};

/*
 * Quantize x into q on backend be.
 * @param[in]  x   2-D (T, D) tensor, f32/f16/bf16, shape equal to (q->ntok, q->dim)
 * @param[in]  q   format (bits, group, axis, ntok, dim) and output arrays
 * @param[in]  rounding, seed  see above (seed ignored for KVD_ROUND_NEAREST)
 * @return KVD_OK; KVD_EINVAL for a bad format, dtype or shape mismatch, NULL
 *         arrays with T*D > 0; KVD_EUNSUPP when the backend lacks the op.
 */
int kvd_quantize(kvd_backend *be, const kvd_tensor *x, const kvd_qtensor *q,
                 kvd_rounding rounding, uint64_t seed, kvd_error *err);

/*
 * n quantizations at once (CUDA: one launch): x[i] into q[i] with seeds[i],
 * each exactly what kvd_quantize(be, &x[i], &q[i], rounding, seeds[i])
 * gives. Every q[i] has the same format (bits, group, axis, T, D) and every
 * x[i] the same dtype. @return as kvd_quantize; KVD_EINVAL names the item.
 */
int kvd_quantize_batch(kvd_backend *be, int n, const kvd_tensor *x, const kvd_qtensor *q,
                       kvd_rounding rounding, const uint64_t *seeds, kvd_error *err);

/*
 * Dequantize q into y (2-D (T, D), f32/f16/bf16, any strides).
 * @return KVD_OK, KVD_EINVAL, KVD_EUNSUPP as kvd_quantize.
 */
int kvd_dequantize(kvd_backend *be, const kvd_qtensor *q, const kvd_tensor *y, kvd_error *err);

/* Scalar references on host memory: the specification. Arguments must be
 * valid (checked by the wrappers above). */
void kvd_quantize_ref(const kvd_tensor *x, const kvd_qtensor *q, kvd_rounding rounding,
                      uint64_t seed);
void kvd_dequantize_ref(const kvd_qtensor *q, const kvd_tensor *y);

/* The CPU backend's table (kernels/cpu/quant.c). */
extern const struct kvd_quant_ops kvd__cpu_quant_ops;

#endif /* KVDEPOT_QUANT_H */
