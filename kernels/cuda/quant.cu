/*
 * INT2/INT4 group quantization on the GPU: one fused pass per group (finite
 * min/max, f16 min and scale, stochastic or nearest rounding, packed codes,
 * code sum) and dequantization. Layouts and the arithmetic are specified in
 * kvdepot/quant.h; every step below is the same IEEE operation sequence as
 * kvd_quantize_ref (explicit _rn intrinsics, no contraction), and the
 * stochastic draw is the same counter-based hash of (seed, t*D + d), so the
 * bytes equal the CPU's.
 *
 * Launch shapes:
 *   token axis     one warp per group (PI consecutive values of one token
 *                  row); lane l holds values l*V .. l*V+V-1, V = PI/32, so
 *                  a warp reads one contiguous 64..512-byte span. min/max
 *                  and the sum are warp shuffles; each lane's codes are
 *                  OR-reduced into 32-bit words across the lanes that share
 *                  the word, and the word's first lane stores its 4 bytes.
 *                  256 threads (8 groups) per block, grid-stride.
 *   channel axis   one thread per (channel, group): adjacent threads are
 *                  adjacent channels, so each of the PI token steps reads
 *                  a contiguous run of the token row (coalesced); the
 *                  thread writes its group's PI*bits/8 code bytes.
 *   token axis,    PI = 8 or 16 (small heads): the same thread per group,
 *   small groups   adjacent threads adjacent groups of a token row.
 *   dequantize     one thread per element, grid-stride over T*D.
 */
#include <vector>

#include "cuda_internal.h"

namespace {

constexpr int kThreads = 256;
constexpr float kF16Max = 65504.0f;

__device__ __forceinline__ uint32_t qmix(uint32_t x)
{
    x ^= x >> 16;
    x *= 0x7feb352du;
    x ^= x >> 15;
    x *= 0x846ca68bu;
    x ^= x >> 16;
    return x;
}

__device__ __forceinline__ float qdraw(uint32_t key, uint32_t index)
{
    uint32_t h = qmix(index * 0x9e3779b9u + key);
    return (float)(h >> 8) * (1.0f / 16777216.0f);
}

uint32_t host_qmix(uint32_t x)
{
    x ^= x >> 16;
    x *= 0x7feb352du;
    x ^= x >> 15;
    x *= 0x846ca68bu;
    x ^= x >> 16;
    return x;
}

uint32_t host_qkey(uint64_t seed)
{
    return host_qmix((uint32_t)seed ^ host_qmix((uint32_t)(seed >> 32) + 0x9e3779b9u));
}

__device__ __forceinline__ uint16_t to16(float f)
{
    return __half_as_ushort(__float2half_rn(f));
}

__device__ __forceinline__ float from16(uint16_t h) { return __half2float(__ushort_as_half(h)); }

struct qgroup {
    uint16_t min_h, scale_h;
    float mn, inv;
};

/* kvd__qgroup_make, step for step. */
__device__ qgroup qgroup_make(float lo, float hi, int bits)
{
    qgroup g;
    if (!(lo <= hi))
        lo = hi = 0.0f;
    lo = lo < -kF16Max ? -kF16Max : lo > kF16Max ? kF16Max : lo;
    hi = hi < -kF16Max ? -kF16Max : hi > kF16Max ? kF16Max : hi;
    const float qmax = (float)((1 << bits) - 1);
    uint16_t h = to16(lo);
    if (from16(h) > lo)
        h = (h & 0x8000u) ? (uint16_t)(h + 1) : (uint16_t)(h - 1);
    g.min_h = h;
    g.mn = from16(h);
    float s = __fdiv_rn(__fsub_rn(hi, g.mn), qmax);
    if (!(s > 0.0f))
        s = 0.0f;
    h = to16(s);
    if (from16(h) < s)
        h = (uint16_t)(h + 1);
    g.scale_h = h;
    const float sc = from16(h);
    g.inv = sc > 0.0f ? __fdiv_rn(1.0f, sc) : 0.0f;
    return g;
}

__device__ __forceinline__ uint32_t qcode(float x, float mn, float inv, float add, float qmax)
{
    float v = __fmul_rn(__fsub_rn(x, mn), inv);
    float c = floorf(__fadd_rn(v, add));
    if (!(c > 0.0f))
        c = 0.0f;
    if (c > qmax)
        c = qmax;
    return (uint32_t)c;
}

/* Token axis: warp per group. V values per lane (1, 2 or 4). */
template <int V>
__device__ void quant_token_body(const kvd_dview &x, uint8_t *codes, uint16_t *mins,
                                 uint16_t *scales, uint16_t *sums, long long T, long long D,
                                 int bits, int stochastic, uint32_t key)
{
    const int P = 32 * V;
    const long long ng = D / P, groups = T * ng, rowbytes = D * bits / 8;
    const int lane = threadIdx.x & 31;
    const float qmax = (float)((1 << bits) - 1);
    const long long wstride = (long long)gridDim.x * (blockDim.x / 32);
    for (long long gi = blockIdx.x * (long long)(blockDim.x / 32) + threadIdx.x / 32; gi < groups;
         gi += wstride) {
        const long long t = gi / ng, g = gi % ng;
        const long long d0 = g * P + lane * V;
        float v[V];
        float lo = INFINITY, hi = -INFINITY;
#pragma unroll
        for (int i = 0; i < V; i++) {
            v[i] = kvd_ld_float(x.data + t * x.stride[0] + (d0 + i) * x.stride[1], x.dtype);
            if (isfinite(v[i])) {
                lo = fminf(lo, v[i]);
                hi = fmaxf(hi, v[i]);
            }
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            lo = fminf(lo, __shfl_xor_sync(0xffffffffu, lo, o));
            hi = fmaxf(hi, __shfl_xor_sync(0xffffffffu, hi, o));
        }
        const qgroup q = qgroup_make(lo, hi, bits);
        uint32_t word = 0, s = 0;
#pragma unroll
        for (int i = 0; i < V; i++) {
            float add = stochastic ? qdraw(key, (uint32_t)(t * D + d0 + i)) : 0.5f;
            uint32_t c = qcode(v[i], q.mn, q.inv, add, qmax);
            s += c;
            word |= c << (i * bits);
        }
        /* Lane l's V*bits bits sit at bit (l*V*bits) % 32 of word l*V*bits/32. */
        const int lbits = V * bits, lanes_per_word = 32 / lbits;
        word <<= (lane * lbits) & 31;
        for (int o = 1; o < lanes_per_word; o <<= 1)
            word |= __shfl_xor_sync(0xffffffffu, word, o);
#pragma unroll
        for (int o = 16; o > 0; o >>= 1)
            s += __shfl_xor_sync(0xffffffffu, s, o);
        if (lane % lanes_per_word == 0) {
            uint8_t *dst = codes + t * rowbytes + (g * P * bits) / 8 + (lane * lbits) / 8;
            dst[0] = (uint8_t)word;
            dst[1] = (uint8_t)(word >> 8);
            dst[2] = (uint8_t)(word >> 16);
            dst[3] = (uint8_t)(word >> 24);
        }
        if (lane == 0) {
            mins[gi] = q.min_h;
            scales[gi] = q.scale_h;
            sums[gi] = (uint16_t)s;
        }
    }
}

template <int V>
__global__ void quant_token_kernel(kvd_dview x, uint8_t *codes, uint16_t *mins, uint16_t *scales,
                                   uint16_t *sums, long long T, long long D, int bits,
                                   int stochastic, uint32_t key)
{
    quant_token_body<V>(x, codes, mins, scales, sums, T, D, bits, stochastic, key);
}

/* One block of a batch (quantize_batch): the input and arrays of one
 * item, its rounding key. */
struct QItem {
    kvd_dview x;
    uint8_t *codes;
    uint16_t *mins, *scales, *sums;
    uint32_t key;
};

/* The items of a batch along grid y. */
template <int V>
__global__ void quant_token_batch_kernel(const QItem *items, long long T, long long D, int bits,
                                         int stochastic)
{
    const QItem it = items[blockIdx.y];
    quant_token_body<V>(it.x, it.codes, it.mins, it.scales, it.sums, T, D, bits, stochastic,
                        it.key);
}

/* Thread per group: the channel axis (adjacent threads, adjacent channels:
 * coalesced loads), and the token axis for groups of 8 or 16 values, less
 * than the warp kernel's unit (adjacent threads, adjacent groups of a row).
 * Code row r is channel r (channel axis) or token r (token axis). */
__device__ void quant_group_body(const kvd_dview &x, uint8_t *codes, uint16_t *mins,
                                 uint16_t *scales, uint16_t *sums, long long T, long long D,
                                 int bits, int P, int stochastic, uint32_t key, int token)
{
    const long long rows = token ? T : D, along = token ? D : T;
    const long long ng = along / P, rowbytes = along * bits / 8;
    const long long step = token ? x.stride[1] : x.stride[0]; /* between a group's values */
    const float qmax = (float)((1 << bits) - 1);
    const int per = 8 / bits;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < ng * rows;
         i += (long long)gridDim.x * blockDim.x) {
        const long long r = token ? i / ng : i % D, g = token ? i % ng : i / D;
        const char *first = x.data + (token ? r * x.stride[0] + g * P * x.stride[1]
                                            : r * x.stride[1] + g * P * x.stride[0]);
        float lo = INFINITY, hi = -INFINITY;
        for (int k = 0; k < P; k++) {
            float v = kvd_ld_float(first + k * step, x.dtype);
            if (isfinite(v)) {
                lo = fminf(lo, v);
                hi = fmaxf(hi, v);
            }
        }
        const qgroup q = qgroup_make(lo, hi, bits);
        uint8_t *row = codes + r * rowbytes + g * P / per;
        uint32_t s = 0, byte = 0;
        for (int k = 0; k < P; k++) {
            const long long t = token ? r : g * P + k, d = token ? g * P + k : r;
            float add = stochastic ? qdraw(key, (uint32_t)(t * D + d)) : 0.5f;
            uint32_t c = qcode(kvd_ld_float(first + k * step, x.dtype), q.mn, q.inv, add, qmax);
            s += c;
            byte |= c << ((k % per) * bits);
            if (k % per == per - 1) {
                row[k / per] = (uint8_t)byte;
                byte = 0;
            }
        }
        const long long gi = r * ng + g;
        mins[gi] = q.min_h;
        scales[gi] = q.scale_h;
        sums[gi] = (uint16_t)s;
    }
}

__global__ void quant_group_kernel(kvd_dview x, uint8_t *codes, uint16_t *mins, uint16_t *scales,
                                   uint16_t *sums, long long T, long long D, int bits, int P,
                                   int stochastic, uint32_t key, int token)
{
    quant_group_body(x, codes, mins, scales, sums, T, D, bits, P, stochastic, key, token);
}

__global__ void quant_group_batch_kernel(const QItem *items, long long T, long long D, int bits,
                                         int P, int stochastic, int token)
{
    const QItem it = items[blockIdx.y];
    quant_group_body(it.x, it.codes, it.mins, it.scales, it.sums, T, D, bits, P, stochastic,
                     it.key, token);
}

__global__ void dequant_kernel(const uint8_t *codes, const uint16_t *mins,
                               const uint16_t *scales, kvd_dview y, long long T, long long D,
                               int bits, int P, int channel)
{
    const int per = 8 / bits;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < T * D;
         i += (long long)gridDim.x * blockDim.x) {
        const long long t = i / D, d = i % D;
        long long row, pos, gi, rowbytes;
        if (!channel) {
            row = t, pos = d, gi = t * (D / P) + d / P, rowbytes = D * bits / 8;
        } else {
            row = d, pos = t, gi = d * (T / P) + t / P, rowbytes = T * bits / 8;
        }
        uint32_t c = (codes[row * rowbytes + pos / per] >> ((pos % per) * bits)) &
                     ((1u << bits) - 1);
        float v = __fadd_rn(from16(mins[gi]), __fmul_rn(from16(scales[gi]), (float)c));
        kvd_st_float(y.data + t * y.stride[0] + d * y.stride[1], y.dtype, v);
    }
}

int cuda_quantize(kvd_backend *be, const kvd_tensor *x, const kvd_qtensor *q,
                  kvd_rounding rounding, uint64_t seed, kvd_error *err)
{
    kvd_cuda_call call;
    int rc = kvd__cuda_begin(be, &call, err);
    if (rc)
        return rc;
    const long long T = q->ntok, D = q->dim;
    if (T * D == 0)
        return KVD_OK;
    const int st = rounding == KVD_ROUND_STOCHASTIC;
    const uint32_t key = host_qkey(seed);
    const kvd_dview xv = kvd__dview(x);
    if (q->axis == KVD_QAXIS_TOKEN && q->group >= 32) {
        const long long groups = T * (D / q->group);
        const unsigned grid = kvd__cuda_blocks(groups, kThreads / 32);
        switch (q->group) {
        case 32:
            quant_token_kernel<1><<<grid, kThreads, 0, call.s>>>(xv, q->codes, q->min, q->scale,
                                                                 q->sum, T, D, q->bits, st, key);
            break;
        case 64:
            quant_token_kernel<2><<<grid, kThreads, 0, call.s>>>(xv, q->codes, q->min, q->scale,
                                                                 q->sum, T, D, q->bits, st, key);
            break;
        default:
            quant_token_kernel<4><<<grid, kThreads, 0, call.s>>>(xv, q->codes, q->min, q->scale,
                                                                 q->sum, T, D, q->bits, st, key);
        }
    } else {
        const long long n = T * D / q->group;
        quant_group_kernel<<<kvd__cuda_blocks(n, kThreads), kThreads, 0, call.s>>>(
            xv, q->codes, q->min, q->scale, q->sum, T, D, q->bits, q->group, st, key,
            q->axis == KVD_QAXIS_TOKEN);
    }
    return kvd__cuda_launched(&call, "quantize", err);
}

int cuda_dequantize(kvd_backend *be, const kvd_qtensor *q, const kvd_tensor *y, kvd_error *err)
{
    kvd_cuda_call call;
    int rc = kvd__cuda_begin(be, &call, err);
    if (rc)
        return rc;
    const long long T = q->ntok, D = q->dim;
    if (T * D == 0)
        return KVD_OK;
    dequant_kernel<<<kvd__cuda_blocks(T * D, kThreads), kThreads, 0, call.s>>>(
        q->codes, q->min, q->scale, kvd__dview(y), T, D, q->bits, q->group,
        q->axis == KVD_QAXIS_CHANNEL);
    return kvd__cuda_launched(&call, "dequantize", err);
}

} /* namespace */

/* The items go up in one copy into stream-ordered scratch; one launch per
 * 65535 of them (grid y). */
int cuda_quantize_batch(kvd_backend *be, int n, const kvd_tensor *x, const kvd_qtensor *q,
                        kvd_rounding rounding, const uint64_t *seeds, kvd_error *err)
{
    kvd_cuda_call call;
    int rc = kvd__cuda_begin(be, &call, err);
    if (rc || n == 0)
        return rc;
    const long long T = q[0].ntok, D = q[0].dim;
    const int st = rounding == KVD_ROUND_STOCHASTIC, bits = q[0].bits, P = q[0].group;
    std::vector<QItem> items((size_t)n);
    for (int i = 0; i < n; i++)
        items[(size_t)i] = {kvd__dview(&x[i]), q[i].codes, q[i].min, q[i].scale, q[i].sum,
                            host_qkey(seeds[i])};
    void *d = NULL;
    if ((rc = kvd__cuda_scratch(&call, sizeof(QItem) * (size_t)n, &d, err)))
        return rc;
    QItem *dv = static_cast<QItem *>(d);
    rc = kvd__cuda_status(call.c,
                          cudaMemcpyAsync(dv, items.data(), sizeof(QItem) * (size_t)n,
                                          cudaMemcpyHostToDevice, call.s),
                          "cudaMemcpyAsync", err);
    for (int i0 = 0; i0 < n && !rc; i0 += 65535) {
        const unsigned ny = (unsigned)(n - i0 < 65535 ? n - i0 : 65535);
        if (q[0].axis == KVD_QAXIS_TOKEN && P >= 32) {
            const dim3 grid(kvd__cuda_blocks(T * (D / P), kThreads / 32), ny);
            switch (P) {
            case 32:
                quant_token_batch_kernel<1><<<grid, kThreads, 0, call.s>>>(dv + i0, T, D, bits, st);
                break;
            case 64:
                quant_token_batch_kernel<2><<<grid, kThreads, 0, call.s>>>(dv + i0, T, D, bits, st);
                break;
            default:
                quant_token_batch_kernel<4><<<grid, kThreads, 0, call.s>>>(dv + i0, T, D, bits, st);
            }
        } else {
            const dim3 grid(kvd__cuda_blocks(T * D / P, kThreads), ny);
            quant_group_batch_kernel<<<grid, kThreads, 0, call.s>>>(dv + i0, T, D, bits, P, st,
                                                                    q[0].axis == KVD_QAXIS_TOKEN);
        }
        rc = kvd__cuda_launched(&call, "quantize batch", err);
    }
    if (rc == 0) /* the items array of the host: the copy above must be done */
        rc = kvd__cuda_wait(&call, "quantize batch", err);
    kvd__cuda_scratch_free(&call, d);
    return rc;
}

const struct kvd_quant_ops kvd__cuda_quant_ops = {
    cuda_quantize,
    cuda_dequantize,
    cuda_quantize_batch,
};
