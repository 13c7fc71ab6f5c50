/*
 * Decode attention on the CUDA backend: every form of kvdepot/attention.h
 * (dense, sparse, INT2/INT4 homomorphic, fused VQ, reduced-dimension SVD,
 * merge) with the semantics of the CPU references.
 *
 * Work decomposition (flash-decoding style). A call of n items becomes a
 * list of work units, one thread block each:
 *
 *     unit = (item, kv head h, query heads g0 .. g0+gn-1 of h, tokens [t0, t1))
 *
 * The gn <= 8 query heads of a unit share every K/V load (GQA). The token
 * axis of a long sequence is cut into splits so that a call fills the
 * device (about 4 units per SM); items of different lengths mix freely in
 * one launch. A unit that covers a whole (item, head group) writes out and
 * lse directly; otherwise it writes a partial (lse_s, out_s) into a slot and
 * one combine launch merges the slots of each query head exactly as
 * kvd_attn_merge() does. Raw tail tokens of the INT and VQ forms are just
 * more splits of the same head group (run by the dense kernel), so the tail
 * costs no extra pass. Units are launched longest first (ZACK's load
 * balancing: ragged SVD heads and mixed-length batches do not leave a long
 * unit to start last).
 *
 * Paged caches: an engine's pages map to items (one item per page, or per
 * run of contiguous pages); their partial results merge with kvd_attn_merge
 * or, within one sequence, by passing the pages of a sequence as the
 * consecutive items of one call and merging the per-item results.
 *
 * Inside a unit every kernel runs the same blocked online softmax as the CPU
 * driver (kvd__attn_head_run): a tile of tokens is scored for the gn heads,
 * the running (max, sum) of each head is updated (earlier sums rescaled
 * when the max grows), and the tile's probabilities are folded into the
 * accumulator. NaN/Inf follow the CPU rules: a NaN score makes the head NaN,
 * a zero probability contributes nothing (not 0 * Inf).
 *
 * Kernels:
 *   dense_fast   f16/bf16/f32 K/V, D and Dv = 4..32 x (16-byte vector):
 *                each thread holds one 16-byte chunk of q (all gn heads) in
 *                registers; D/VEC lanes share a key row (butterfly sum), the
 *                block streams NT*16 bytes per step with 4 rows in flight
 *                per thread; V is accumulated in registers per (head, chunk)
 *                and summed across row lanes once per unit. Also sparse
 *                (rows through the index list) and the raw tails.
 *   dense_any    any width and alignment (q and the accumulator in shared
 *                memory, a warp per key row, a thread per value channel);
 *                also the SVD form at its ragged per-head widths.
 *   int          INT2/INT4 (HACK Eq. 4). Keys, token axis: a thread per
 *                token, the int8 query pre-arranged per code plane so each
 *                32-bit code word feeds __dp4a directly, corrected per
 *                group with scale, min and the query sums. Keys, channel
 *                axis: per key group the query folded with the group's
 *                scales is quantized to int8 in shared memory; a thread per
 *                token packs 4 channel codes per __dp4a. Values, channel
 *                axis: the tile's probabilities are quantized per group to
 *                uint8 and laid out per code plane, a thread per channel
 *                runs __dp4a along its code row, corrected with the stored
 *                code sums. Values, token axis: scale folded into the
 *                probability, in float. Nothing is dequantized to memory.
 *   vq           codebooks' score LUT[pos][code][head] built per unit in
 *                shared memory from the transformed query (smoothing and
 *                Walsh-Hadamard in shared memory); probabilities are
 *                accumulated per (position, value code, head) in shared
 *                memory (shared-memory atomic adds, a thread per token
 *                and position), kept in units of a
 *                per-head multiplier so a growing max costs nothing, then
 *                one pass over the value codebook. When the LUT or the
 *                accumulators do not fit shared memory (large codebooks),
 *                the kernel reads codebook rows instead.
 *   combine      merge of a head group's split partials.
 *   merge        kvd_attn_merge.
 */
#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include <algorithm>
#include <vector>

#include "cuda_internal.h"

namespace {

constexpr int NT = 128;       /* threads per block */
constexpr int NW = NT / 32;   /* warps per block */
constexpr int MAXGB = 8;      /* query heads per unit */
constexpr int DTILE = 64;     /* tokens per tile, dense kernels */
constexpr int MAXSPLIT = 512; /* splits per head group (combine keeps weights in smem) */

/* ---------------------------------------------------------------------- */
/* Descriptors (by value in device memory)                                */
/* ---------------------------------------------------------------------- */

struct OutDesc {
    char *out; /* row hq at out + hq * os, f32 */
    long long os;
    char *lse; /* lse + hq * ls */
    long long ls;
};

/* Dense / sparse / raw tail / SVD head block. Row (h, t) of K at
 * k + h*ks0 + t*ks1. */
struct DItem {
    const char *q; /* (Hq, D) f32, row stride qs */
    long long qs;
    const char *k;
    long long ks0, ks1;
    const char *v;
    long long vs0, vs1;
    const int *idx; /* sparse: row h at idx + h*is0 bytes; NULL = dense */
    long long is0;
    int kdt, vdt, D, Dv, G;
    float scale;
    OutDesc o;
};

struct P16 { /* an f16/u16 parameter tensor (Hkv, rows, groups) */
    const char *p;
    long long s0, s1;
};

struct QSide {
    const unsigned char *codes;
    long long cs0, cs1;
    P16 mn, sc, sum;
    int bits, group, axis, w4; /* w4: rows may be read as aligned 32-bit words */
    int w16;                     /* ... and as aligned 16-byte vectors */
};

struct QItem {
    const char *q;
    long long qs;
    QSide k, v;
    int D, Dv, G, tb; /* tb: tokens per tile (a multiple of every group) */
    float scale;
    OutDesc o;
};

struct VItem {
    const char *q;
    long long qs;
    const char *kc; /* k codes (Hkv, T, kpos) u8/u16 */
    long long kcs0, kcs1;
    const char *kcb; /* (Hkv, 2^bk, dk) f32 */
    long long kcbs0, kcbs1;
    const char *lam; /* (Hkv, D) f32 or NULL */
    long long lams0;
    const char *vc;
    long long vcs0, vcs1;
    const char *vcb;
    long long vcbs0, vcbs1;
    int had, dk, kK, k16, dv, vK, v16, D, Dv, G, lut, acc;
    int kvec; /* key code rows read 16 bytes at a time (u8 codes, kpos % 16 == 0, aligned) */
    float scale;
    OutDesc o;
};

struct Unit {
    int item, h, g0, gn;
    long long t0, t1;
    int slot; /* first partial slot (slot + gi), -1: write out/lse */
    int pad;
};

struct Comb {
    char *out; /* row of the query head */
    char *lse;
    int Dv, nsplit, slot0, stride;
};

struct Parts {
    float *out; /* (slots, dvmax) */
    float *lse; /* (slots) */
    int dvmax;
};

/* ---------------------------------------------------------------------- */
/* Device helpers                                                         */
/* ---------------------------------------------------------------------- */

__device__ __forceinline__ float nanmax(float a, float b)
{
    return a != a ? a : b != b ? b : fmaxf(a, b);
}

__device__ __forceinline__ float warp_sum(float x)
{
#pragma unroll
    for (int o = 16; o; o >>= 1)
        x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
}

__device__ __forceinline__ float warp_max(float x)
{
#pragma unroll
    for (int o = 16; o; o >>= 1)
        x = nanmax(x, __shfl_xor_sync(0xffffffffu, x, o));
    return x;
}

__device__ __forceinline__ float ld_f16(const char *p)
{
    return __half2float(*reinterpret_cast<const __half *>(p));
}

__device__ __forceinline__ unsigned ld_u16(const char *p)
{
    return *reinterpret_cast<const unsigned short *>(p);
}

/*
 * Online-softmax step for a tile (the CPU driver's rules): s[g*ld + i],
 * i < n, holds scores of head g and becomes p = exp(s - m_new); m, l
 * updated; f[g] = factor the accumulators must be multiplied by. Called by
 * all threads between two __syncthreads.
 */
__device__ void tile_softmax(float *s, int ld, int n, int gn, float *m, float *l, float *f)
{
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = blockDim.x >> 5;
    for (int g = warp; g < gn; g += nw) {
        float *sg = s + (size_t)g * ld;
        float bm = -INFINITY;
        for (int i = lane; i < n; i += 32)
            bm = nanmax(bm, sg[i]);
        bm = warp_max(bm);
        float mo = m[g];
        float nm = (mo != mo || bm != bm) ? NAN : fmaxf(bm, mo);
        float fg = 1.0f;
        if (nm == -INFINITY) {
            for (int i = lane; i < n; i += 32)
                sg[i] = 0.0f;
        } else {
            if (!(nm == mo))
                fg = mo == -INFINITY ? 0.0f : expf(mo - nm);
            float sum = 0.0f;
            for (int i = lane; i < n; i += 32) {
                float p = expf(sg[i] - nm);
                sg[i] = p;
                sum += p;
            }
            sum = warp_sum(sum);
            if (lane == 0) {
                l[g] = l[g] * fg + sum;
                m[g] = nm;
            }
        }
        if (lane == 0)
            f[g] = fg;
    }
}

/* One element of a unit's result: final (slot < 0) or partial. */
__device__ __forceinline__ void store_out(const OutDesc &o, int hq, int slot, const Parts &P, int d,
                                          float acc, float m, float l)
{
    float v = m == -INFINITY ? 0.0f : acc * (1.0f / l);
    if (slot < 0)
        reinterpret_cast<float *>(o.out + (long long)hq * o.os)[d] = v;
    else
        P.out[(size_t)slot * P.dvmax + d] = v;
}

__device__ __forceinline__ void store_lse(const OutDesc &o, int hq, int slot, const Parts &P, float m,
                                          float l)
{
    float v = m == -INFINITY ? -INFINITY : m + logf(l);
    if (slot < 0)
        *reinterpret_cast<float *>(o.lse + (long long)hq * o.ls) = v;
    else
        P.lse[slot] = v;
}

/* Result of a unit whose accumulator acc[g*Dv + d] is in shared memory. */
__device__ void unit_store_smem(const OutDesc &o, const Unit &u, int G, int Dv, const Parts &P,
                                const float *acc, const float *m, const float *l)
{
    for (int e = threadIdx.x; e < u.gn * Dv; e += blockDim.x) {
        int g = e / Dv, d = e - g * Dv;
        store_out(o, u.h * G + u.g0 + g, u.slot < 0 ? -1 : u.slot + g, P, d, acc[e], m[g], l[g]);
    }
    const int g = (int)threadIdx.x;
    if (g < u.gn)
        store_lse(o, u.h * G + u.g0 + g, u.slot < 0 ? -1 : u.slot + g, P, m[g], l[g]);
}

/* 16 bytes of K/V as floats. */
template <int DT> struct VecT;
template <> struct VecT<KVD_DTYPE_F16> {
    static constexpr int N = 8;
    static __device__ __forceinline__ void cvt(const uint4 &r, float *x)
    {
        const __half2 *h = reinterpret_cast<const __half2 *>(&r);
#pragma unroll
        for (int i = 0; i < 4; i++) {
            float2 f = __half22float2(h[i]);
            x[2 * i] = f.x;
            x[2 * i + 1] = f.y;
        }
    }
};
template <> struct VecT<KVD_DTYPE_BF16> {
    static constexpr int N = 8;
    static __device__ __forceinline__ void cvt(const uint4 &r, float *x)
    {
        const unsigned w[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
        for (int i = 0; i < 4; i++) {
            x[2 * i] = __uint_as_float(w[i] << 16);
            x[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
        }
    }
};
template <> struct VecT<KVD_DTYPE_F32> {
    static constexpr int N = 4;
    static __device__ __forceinline__ void cvt(const uint4 &r, float *x)
    {
        x[0] = __uint_as_float(r.x);
        x[1] = __uint_as_float(r.y);
        x[2] = __uint_as_float(r.z);
        x[3] = __uint_as_float(r.w);
    }
};

__device__ __forceinline__ uint4 ldg16(const char *p)
{
    return __ldg(reinterpret_cast<const uint4 *>(p));
}

__device__ __forceinline__ long long token_of(const DItem &it, int h, long long t)
{
    return it.idx ? (long long)__ldg(reinterpret_cast<const int *>(reinterpret_cast<const char *>(it.idx) +
                                                                   (long long)h * it.is0) +
                                     t)
                  : t;
}

/* ---------------------------------------------------------------------- */
/* Dense: fast kernel                                                     */
/* ---------------------------------------------------------------------- */

constexpr int UNROLL = 4; /* key/value rows in flight per thread */

/*
 * Shared memory: s (GB, DTILE) | m, l, f (3 GB), then at the end of the unit
 * the reduction buffer red (NT/LV, GB, Dv) laid over s.
 */
template <int DT, int GB>
__global__ void __launch_bounds__(NT, GB >= 8 ? 2 : 4) dense_fast_kernel(const DItem *__restrict__ items,
                                                        const Unit *__restrict__ units, Parts P)
{
    constexpr int VEC = VecT<DT>::N, ESZ = DT == KVD_DTYPE_F32 ? 4 : 2;
    extern __shared__ float sm[];
    const Unit u = units[blockIdx.x];
    const DItem &it = items[u.item];
    const int D = it.D, Dv = it.Dv, G = it.G, h = u.h, gn = u.gn;
    const int LK = D / VEC, LV = Dv / VEC, RK = NT / LK, RV = NT / LV;
    const int tid = threadIdx.x, rk = tid / LK, lk = tid % LK, rv = tid / LV, lv = tid % LV;
    float *s = sm, *mm = sm + GB * DTILE, *ll = mm + GB, *ff = ll + GB;
    const char *kb = it.k + h * it.ks0 + (long long)lk * VEC * ESZ;
    const char *vb = it.v + h * it.vs0 + (long long)lv * VEC * ESZ;

    float q[GB][VEC], acc[GB][VEC];
#pragma unroll
    for (int g = 0; g < GB; g++) {
        const float *qr = reinterpret_cast<const float *>(it.q + (long long)(h * G + u.g0 + g) * it.qs) + lk * VEC;
#pragma unroll
        for (int j = 0; j < VEC; j++) {
            q[g][j] = g < gn ? qr[j] * it.scale : 0.0f;
            acc[g][j] = 0.0f;
        }
    }
    if (tid < GB) {
        mm[tid] = -INFINITY;
        ll[tid] = 0.0f;
    }
    __syncthreads();
    for (long long t0 = u.t0; t0 < u.t1; t0 += DTILE) {
        const int n = (int)min((long long)DTILE, u.t1 - t0);
        /* scores: UNROLL rows loaded before any is used */
        for (int i0 = 0; i0 < n; i0 += RK * UNROLL) {
            uint4 raw[UNROLL];
#pragma unroll
            for (int r = 0; r < UNROLL; r++) {
                int i = i0 + r * RK + rk;
                raw[r] = i < n ? ldg16(kb + token_of(it, h, t0 + i) * it.ks1) : make_uint4(0, 0, 0, 0);
            }
#pragma unroll
            for (int r = 0; r < UNROLL; r++) {
                float kf[VEC], dot[GB];
                VecT<DT>::cvt(raw[r], kf);
#pragma unroll
                for (int g = 0; g < GB; g++) {
                    float a = 0.0f;
#pragma unroll
                    for (int j = 0; j < VEC; j++)
                        a = __fmaf_rn(q[g][j], kf[j], a);
                    dot[g] = a;
                }
                for (int o = LK >> 1; o; o >>= 1)
#pragma unroll
                    for (int g = 0; g < GB; g++)
                        dot[g] += __shfl_xor_sync(0xffffffffu, dot[g], o);
                int i = i0 + r * RK + rk;
                if (lk == 0 && i < n)
#pragma unroll
                    for (int g = 0; g < GB; g++)
                        s[g * DTILE + i] = dot[g];
            }
        }
        __syncthreads();
        tile_softmax(s, DTILE, n, gn, mm, ll, ff);
        __syncthreads();
#pragma unroll
        for (int g = 0; g < GB; g++) {
            float fg = g < gn ? ff[g] : 1.0f;
#pragma unroll
            for (int j = 0; j < VEC; j++)
                acc[g][j] *= fg;
        }
        for (int i0 = 0; i0 < n; i0 += RV * UNROLL) {
            uint4 raw[UNROLL];
#pragma unroll
            for (int r = 0; r < UNROLL; r++) {
                int i = i0 + r * RV + rv;
                raw[r] = i < n ? ldg16(vb + token_of(it, h, t0 + i) * it.vs1) : make_uint4(0, 0, 0, 0);
            }
#pragma unroll
            for (int r = 0; r < UNROLL; r++) {
                int i = i0 + r * RV + rv;
                if (i >= n)
                    continue;
                float vf[VEC];
                VecT<DT>::cvt(raw[r], vf);
#pragma unroll
                for (int g = 0; g < GB; g++) {
                    float p = s[g * DTILE + i];
                    if (g < gn && p != 0.0f)
#pragma unroll
                        for (int j = 0; j < VEC; j++)
                            acc[g][j] = __fmaf_rn(p, vf[j], acc[g][j]);
                }
            }
        }
        __syncthreads();
    }
    /* sum the RV row lanes: red (RV, GB, Dv) laid over s, m, l, f (copied
     * to registers first) */
    float *red = sm + 4 * GB;
    float mg[GB], lg[GB];
#pragma unroll
    for (int g = 0; g < GB; g++) {
        mg[g] = mm[g];
        lg[g] = ll[g];
    }
    __syncthreads();
#pragma unroll
    for (int g = 0; g < GB; g++)
#pragma unroll
        for (int j = 0; j < VEC; j++)
            red[((size_t)rv * GB + g) * Dv + lv * VEC + j] = acc[g][j];
    __syncthreads();
    for (int e = tid; e < gn * Dv; e += NT) {
        int g = e / Dv, d = e - g * Dv;
        float a = 0.0f;
        for (int r = 0; r < RV; r++)
            a += red[((size_t)r * GB + g) * Dv + d];
        float mx = 0.0f, lx = 0.0f;
#pragma unroll
        for (int gg = 0; gg < GB; gg++)
            if (gg == g) {
                mx = mg[gg];
                lx = lg[gg];
            }
        store_out(it.o, h * G + u.g0 + g, u.slot < 0 ? -1 : u.slot + g, P, d, a, mx, lx);
    }
    if (tid < gn) {
        float mx = 0.0f, lx = 0.0f;
#pragma unroll
        for (int gg = 0; gg < GB; gg++)
            if (gg == tid) {
                mx = mg[gg];
                lx = lg[gg];
            }
        store_lse(it.o, h * G + u.g0 + tid, u.slot < 0 ? -1 : u.slot + tid, P, mx, lx);
    }
}


/* ---------------------------------------------------------------------- */
/* Dense: any width, dtype and alignment                                  */
/* ---------------------------------------------------------------------- */

/* Shared: q (gn, D) | acc (gn, Dv) | s (gn, DTILE) | m, l, f (3 * MAXGB) */
__global__ void __launch_bounds__(NT, 4) dense_any_kernel(const DItem *__restrict__ items,
                                                       const Unit *__restrict__ units, Parts P)
{
    extern __shared__ float sm[];
    const Unit u = units[blockIdx.x];
    const DItem &it = items[u.item];
    const int D = it.D, Dv = it.Dv, G = it.G, h = u.h, gn = u.gn;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    float *qs = sm, *acc = qs + (size_t)gn * D, *s = acc + (size_t)gn * Dv, *mm = s + (size_t)gn * DTILE,
          *ll = mm + MAXGB, *ff = ll + MAXGB;
    const int ke = it.kdt == KVD_DTYPE_F32 ? 4 : 2, ve = it.vdt == KVD_DTYPE_F32 ? 4 : 2;
    for (int e = tid; e < gn * D; e += NT) {
        int g = e / D, j = e - g * D;
        qs[e] = reinterpret_cast<const float *>(it.q + (long long)(h * G + u.g0 + g) * it.qs)[j] * it.scale;
    }
    for (int e = tid; e < gn * Dv; e += NT)
        acc[e] = 0.0f;
    if (tid < MAXGB) {
        mm[tid] = -INFINITY;
        ll[tid] = 0.0f;
    }
    __syncthreads();
    for (long long t0 = u.t0; t0 < u.t1; t0 += DTILE) {
        const int n = (int)min((long long)DTILE, u.t1 - t0);
        for (int i = warp; i < n; i += NW) {
            const char *kr = it.k + h * it.ks0 + token_of(it, h, t0 + i) * it.ks1;
            float dot[MAXGB];
#pragma unroll
            for (int g = 0; g < MAXGB; g++)
                dot[g] = 0.0f;
            for (int j = lane; j < D; j += 32) {
                float x = kvd_ld_float(kr + (long long)j * ke, it.kdt);
#pragma unroll
                for (int g = 0; g < MAXGB; g++)
                    if (g < gn)
                        dot[g] = __fmaf_rn(qs[g * D + j], x, dot[g]);
            }
#pragma unroll
            for (int g = 0; g < MAXGB; g++) {
                float d = warp_sum(dot[g]);
                if (lane == 0 && g < gn)
                    s[g * DTILE + i] = d;
            }
        }
        __syncthreads();
        tile_softmax(s, DTILE, n, gn, mm, ll, ff);
        __syncthreads();
        for (int d = tid; d < Dv; d += NT) {
            float a[MAXGB];
#pragma unroll
            for (int g = 0; g < MAXGB; g++)
                a[g] = g < gn ? acc[g * Dv + d] * ff[g] : 0.0f;
            for (int i = 0; i < n; i++) {
                float x = kvd_ld_float(it.v + h * it.vs0 + token_of(it, h, t0 + i) * it.vs1 + (long long)d * ve,
                                       it.vdt);
#pragma unroll
                for (int g = 0; g < MAXGB; g++) {
                    float p = g < gn ? s[g * DTILE + i] : 0.0f;
                    if (p != 0.0f)
                        a[g] = __fmaf_rn(p, x, a[g]);
                }
            }
#pragma unroll
            for (int g = 0; g < MAXGB; g++)
                if (g < gn)
                    acc[g * Dv + d] = a[g];
        }
        __syncthreads();
    }
    unit_store_smem(it.o, u, G, Dv, P, acc, mm, ll);
}

size_t dense_any_smem(int D, int Dv, int gn)
{
    return sizeof(float) * ((size_t)gn * (D + Dv + DTILE) + 3 * MAXGB);
}

/* ---------------------------------------------------------------------- */
/* Combine, merge, sparse index check                                     */
/* ---------------------------------------------------------------------- */

__global__ void __launch_bounds__(NT) combine_kernel(const Comb *__restrict__ cs, Parts P)
{
    __shared__ float w[MAXSPLIT];
    __shared__ float M, L;
    const Comb c = cs[blockIdx.x];
    if (threadIdx.x == 0) {
        float mx = -INFINITY;
        for (int s = 0; s < c.nsplit; s++)
            mx = nanmax(mx, P.lse[c.slot0 + s * c.stride]);
        float sum = 0.0f;
        if (mx != -INFINITY)
            for (int s = 0; s < c.nsplit; s++) {
                float e = expf(P.lse[c.slot0 + s * c.stride] - mx); /* -inf side -> 0 */
                w[s] = e;
                sum += e;
            }
        M = mx;
        L = sum;
    }
    __syncthreads();
    float *out = reinterpret_cast<float *>(c.out);
    if (M == -INFINITY) {
        for (int d = threadIdx.x; d < c.Dv; d += NT)
            out[d] = 0.0f;
        if (threadIdx.x == 0)
            *reinterpret_cast<float *>(c.lse) = -INFINITY;
        return;
    }
    const float inv = 1.0f / L;
    for (int d = threadIdx.x; d < c.Dv; d += NT) {
        float a = 0.0f;
        for (int s = 0; s < c.nsplit; s++) {
            float ws = w[s] * inv;
            if (ws != 0.0f || ws != ws)
                a = __fmaf_rn(ws, P.out[(size_t)(c.slot0 + s * c.stride) * P.dvmax + d], a);
        }
        out[d] = a;
    }
    if (threadIdx.x == 0)
        *reinterpret_cast<float *>(c.lse) = M + logf(L);
}

struct MRow {
    const char *oa, *ob, *la, *lb;
    char *o, *l;
    int Dv;
};

/* One block per row; lse is written after every thread read both sides, so
 * out/lse may alias a or b. The arithmetic is the CPU fast path's. */
__global__ void __launch_bounds__(NT) merge_kernel(const MRow *__restrict__ rows)
{
    const MRow r = rows[blockIdx.x];
    float la = *reinterpret_cast<const float *>(r.la), lb = *reinterpret_cast<const float *>(r.lb);
    float m = la > lb ? la : lb, wa, wb, l;
    if (la != la || lb != lb)
        m = NAN;
    if (m == -INFINITY) {
        wa = wb = 0.0f;
        l = -INFINITY;
    } else {
        float ea = expf(la - m), eb = expf(lb - m);
        l = m + logf(ea + eb);
        wa = ea / (ea + eb);
        wb = eb / (ea + eb);
    }
    const float *oa = reinterpret_cast<const float *>(r.oa), *ob = reinterpret_cast<const float *>(r.ob);
    float *o = reinterpret_cast<float *>(r.o);
    for (int j = threadIdx.x; j < r.Dv; j += NT) {
        float x = 0.0f;
        if (wa != 0.0f || wa != wa)
            x += wa * oa[j];
        if (wb != 0.0f || wb != wb)
            x += wb * ob[j];
        o[j] = x;
    }
    __syncthreads();
    if (threadIdx.x == 0)
        *reinterpret_cast<float *>(r.l) = l;
}

struct IdxJob {
    const char *idx;
    long long s0;
    int Hkv;
    int item;
    long long n, T;
};

__global__ void idx_check_kernel(const IdxJob *__restrict__ jobs, int *bad)
{
    const IdxJob j = jobs[blockIdx.y];
    long long total = (long long)j.Hkv * j.n;
    for (long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x; e < total;
         e += (long long)gridDim.x * blockDim.x) {
        long long h = e / j.n, i = e - h * j.n;
        int t = reinterpret_cast<const int *>(j.idx + h * j.s0)[i];
        if (t < 0 || t >= j.T)
            atomicMin(bad, j.item);
    }
}

/* ---------------------------------------------------------------------- */
/* INT2 / INT4                                                            */
/* ---------------------------------------------------------------------- */

__device__ __forceinline__ unsigned code_word(const QSide &q, const unsigned char *row, int w)
{
    if (q.w4)
        return __ldg(reinterpret_cast<const unsigned *>(row) + w);
    const unsigned char *b = row + 4 * w;
    return (unsigned)b[0] | (unsigned)b[1] << 8 | (unsigned)b[2] << 16 | (unsigned)b[3] << 24;
}

__device__ __forceinline__ int code_at(const unsigned char *row, long long j, int bits)
{
    int per = 8 / bits;
    return (row[j / per] >> ((j % per) * bits)) & ((1 << bits) - 1);
}

__device__ __forceinline__ float p16f(const P16 &p, int h, long long r, long long g)
{
    return ld_f16(p.p + h * p.s0 + r * p.s1 + g * 2);
}

__device__ __forceinline__ float p16u(const P16 &p, int h, long long r, long long g)
{
    return (float)ld_u16(p.p + h * p.s0 + r * p.s1 + g * 2);
}

/* kvd_attn_quantize_q8 for x[0..n) in shared memory, by one warp: codes to
 * q8[0..n), returns the scale (0 for all-zero x, amax for NaN/Inf). */
__device__ float warp_quantize_q8(const float *x, int n, signed char *q8)
{
    const int lane = threadIdx.x & 31;
    float amax = 0.0f;
    for (int i = lane; i < n; i += 32) {
        float a = fabsf(x[i]);
        amax = (a > amax || a != a) ? a : amax;
    }
    amax = warp_max(amax);
    if (!(amax > 0.0f) || isinf(amax)) {
        for (int i = lane; i < n; i += 32)
            q8[i] = 0;
        return amax > 0.0f || amax != amax ? amax : 0.0f;
    }
    float s = amax / 127.0f;
    for (int i = lane; i < n; i += 32) {
        float v = rintf(x[i] / s);
        v = v > 127.0f ? 127.0f : v < -127.0f ? -127.0f : v;
        q8[i] = (signed char)v;
    }
    return s;
}

constexpr int KW_MAX = 16; /* code words of a key row held in registers (D*bits <= 512) */
constexpr int VW_CHUNK = 16; /* code words of a value row loaded at once */

/* `nw` code words of a row into registers: 16-byte loads when aligned and
 * whole, else 32-bit loads. */
template <int MAXW>
__device__ __forceinline__ void load_words(const unsigned char *row, int nw, int v16, unsigned *x)
{
    if (v16 && nw % 4 == 0) {
#pragma unroll
        for (int c = 0; c < MAXW / 4; c++)
            if (4 * c < nw) {
                uint4 q = ldg16(reinterpret_cast<const char *>(row) + 16 * c);
                x[4 * c] = q.x, x[4 * c + 1] = q.y, x[4 * c + 2] = q.z, x[4 * c + 3] = q.w;
            }
    } else {
#pragma unroll
        for (int w = 0; w < MAXW; w++)
            if (w < nw)
                x[w] = __ldg(reinterpret_cast<const unsigned *>(row) + w);
    }
}

/*
 * Scores of one token from a token-axis key row (kw <= KW_MAX words, groups
 * of wpg words): the whole row is loaded first, the group loop runs on
 * registers. dot[g] as in the generic loop of int_kernel.
 */
template <int BITS>
__device__ __forceinline__ void key_row_dots(const QSide &K, const unsigned char *row, int h, long long t, int kw,
                                             int wpg, int kng, int gn, const int *qpat, const float *qsum,
                                             float *dot)
{
    constexpr int PER = 8 / BITS;
    constexpr unsigned M = BITS == 2 ? 0x03030303u : 0x0f0f0f0fu;
    unsigned x[KW_MAX];
    load_words<KW_MAX>(row, kw, K.w16, x);
    int ic[MAXGB];
#pragma unroll
    for (int g = 0; g < MAXGB; g++)
        ic[g] = 0;
#pragma unroll
    for (int w = 0; w < KW_MAX; w++) {
        if (w >= kw)
            break;
#pragma unroll
        for (int k = 0; k < PER; k++) {
            int pl = (int)((x[w] >> (k * BITS)) & M);
#pragma unroll
            for (int g = 0; g < MAXGB; g++)
                if (g < gn)
                    ic[g] = __dp4a(pl, qpat[(g * kw + w) * PER + k], ic[g]);
        }
        if ((w + 1) % wpg == 0) {
            const int grp = w / wpg;
            float scv = p16f(K.sc, h, t, grp), mnv = p16f(K.mn, h, t, grp);
#pragma unroll
            for (int g = 0; g < MAXGB; g++)
                if (g < gn) {
                    dot[g] = __fmaf_rn((float)ic[g], scv, dot[g]);
                    dot[g] = __fmaf_rn(qsum[g * kng + grp], mnv, dot[g]);
                    ic[g] = 0;
                }
        }
    }
}

/*
 * One channel's tile of channel-axis value codes (vw words, groups of wpg
 * words), folded into a[g] with Eq. 4's corrections; the words come in 16 at
 * a time (four 16-byte loads) before any is used.
 */
template <int BITS>
__device__ __forceinline__ void value_row_acc(const QSide &V, const unsigned char *row, int h, int d,
                                              long long grp0, int vw, int wpg, int gn, int ng, const unsigned *vpat,
                                              int vps, const float *sP, const float *mP, const float *corr, float *a)
{
    /* 16-byte loads need the tile's start aligned too (tiles of 160 tokens
     * start 40 bytes apart at INT2) */
    const int v16 = V.w16 && ((uintptr_t)row & 15) == 0;
    constexpr int PER = 8 / BITS;
    constexpr unsigned M = BITS == 2 ? 0x03030303u : 0x0f0f0f0fu;
    unsigned ic[MAXGB];
#pragma unroll
    for (int g = 0; g < MAXGB; g++)
        ic[g] = 0;
    for (int w0 = 0; w0 < vw; w0 += VW_CHUNK) {
        const int nw = min(VW_CHUNK, vw - w0);
        unsigned x[VW_CHUNK];
        load_words<VW_CHUNK>(row + 4 * w0, nw, v16, x);
#pragma unroll
        for (int w = 0; w < VW_CHUNK; w++) {
            if (w >= nw)
                break;
#pragma unroll
            for (int k = 0; k < PER; k++) {
                unsigned pl = (x[w] >> (k * BITS)) & M;
#pragma unroll
                for (int g = 0; g < MAXGB; g++)
                    if (g < gn)
                        ic[g] = __dp4a(pl, vpat[g * vps + (w0 + w) * PER + k], ic[g]);
            }
            if ((w0 + w + 1) % wpg == 0) {
                const int gi = (w0 + w) / wpg;
                float scv = p16f(V.sc, h, d, grp0 + gi), mnv = p16f(V.mn, h, d, grp0 + gi),
                      csv = p16u(V.sum, h, d, grp0 + gi);
#pragma unroll
                for (int g = 0; g < MAXGB; g++)
                    if (g < gn) {
                        /* sc * (sP*S + mP*cs) + mn * (sP*sum8 + P*mP) */
                        float tt = __fmaf_rn(sP[g * ng + gi], (float)ic[g], mP[g * ng + gi] * csv);
                        a[g] = __fmaf_rn(scv, tt, a[g]);
                        a[g] = __fmaf_rn(mnv, corr[g * ng + gi], a[g]);
                        ic[g] = 0;
                    }
            }
        }
    }
}

/*
 * Shared memory (bytes, each part 16-aligned; sizes from int_smem()):
 *   s     (GB, tb) f32       scores, then probabilities
 *   m l f sq (4 * MAXGB) f32
 *   acc   (GB, Dv) f32
 *   K token axis:   qpat (GB, kwords*per) i32 plane patterns of q8,
 *                   qsum (GB, D/Pk) f32, q8 (GB, D) i8, qf (GB, D) f32
 *   K channel axis: qf (GB, D) f32, w (GB, D) f32 scratch,
 *                   w8 (tb/Pk, GB, D) i8, sw, bias (tb/Pk, GB) f32
 *   V channel axis: p8 (GB, tb) u8, vpat (GB, tb/4) u32,
 *                   mP, sP, corr (GB, tb/Pv) f32
 */
struct IntLayout {
    size_t s, mlf, acc, qpat, qsum, q8, qf, w, w8, sw, bias, p8, vpat, mP, sP, corr, total;
};

__host__ __device__ inline size_t al16(size_t x) { return (x + 15) & ~(size_t)15; }

__host__ __device__ inline IntLayout int_layout(int GB, int D, int Dv, int tb, int kbits, int kP, int kaxis,
                                                int vP, int vaxis)
{
    IntLayout L;
    size_t o = 0;
    L.s = o, o += al16(4u * GB * tb);
    L.mlf = o, o += al16(4u * 4 * MAXGB);
    L.acc = o, o += al16(4u * GB * Dv);
    L.qf = o, o += al16(4u * GB * D);
    L.qpat = L.qsum = L.q8 = L.w = L.w8 = L.sw = L.bias = L.p8 = L.vpat = L.mP = L.sP = L.corr = o;
    if (kaxis == KVD_ATTN_AXIS_TOKEN) {
        int kw = (D * kbits + 31) / 32, per = 8 / kbits;
        L.qpat = o, o += al16(4u * GB * kw * per);
        L.qsum = o, o += al16(4u * GB * (D / kP));
        L.q8 = o, o += al16((size_t)GB * D);
    } else {
        int ng = tb / kP;
        L.w = o, o += al16(4u * NW * D);
        L.w8 = o, o += al16((size_t)ng * GB * ((D + 3) & ~3));
        L.sw = o, o += al16(4u * ng * GB);
        L.bias = o, o += al16(4u * ng * GB);
    }
    if (vaxis == KVD_ATTN_AXIS_CHANNEL) {
        int ng = tb / vP;
        L.p8 = o, o += al16((size_t)GB * tb);
        L.vpat = o, o += al16(4u * GB * (tb / 4 + 1));
        L.mP = o, o += al16(4u * GB * ng);
        L.sP = o, o += al16(4u * GB * ng);
        L.corr = o, o += al16(4u * GB * ng);
    }
    L.total = o;
    return L;
}

/*
 * FB, FG, FD != 0 fix at compile time what every item of the launch has:
 * both sides FB % 10-bit with values per channel and keys per token (FB < 10)
 * or per channel (FB > 10, the default layout), FG query heads in every
 * unit, D = Dv = FD. Index arithmetic and head loops then fold away (the
 * shared pattern reads become immediate-offset, vectorised loads); 0, 0, 0
 * is the kernel for everything else.
 */
template <int FB, int FG, int FD>
__global__ void __launch_bounds__(NT, 4) int_kernel(const QItem *__restrict__ items, const Unit *__restrict__ units,
                                                 Parts P)
{
    extern __shared__ __align__(16) unsigned char smb[];
    const Unit u = units[blockIdx.x];
    const QItem &it = items[u.item];
    const QSide &K = it.k, &V = it.v;
    const int D = FD ? FD : it.D, Dv = FD ? FD : it.Dv, G = it.G, h = u.h, gn = FG ? FG : u.gn, tb = it.tb;
    /* read where used, as the general kernel always did (held in registers
     * they cost the general kernel spills) */
#define kbits (FB ? FB % 10 : K.bits)
#define vbits (FB ? FB % 10 : V.bits)
#define kaxis (FB ? (FB > 10 ? (int)KVD_ATTN_AXIS_CHANNEL : (int)KVD_ATTN_AXIS_TOKEN) : (int)K.axis)
#define vaxis (FB ? (int)KVD_ATTN_AXIS_CHANNEL : (int)V.axis)
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const IntLayout L = int_layout(gn, D, Dv, tb, kbits, K.group, kaxis, V.group, vaxis);
    float *s = reinterpret_cast<float *>(smb + L.s), *mm = reinterpret_cast<float *>(smb + L.mlf), *ll = mm + MAXGB,
          *ff = ll + MAXGB, *sq = ff + MAXGB, *acc = reinterpret_cast<float *>(smb + L.acc),
          *qf = reinterpret_cast<float *>(smb + L.qf);
    const int kper = 8 / kbits, kP = K.group, kng = D / kP;

    /* the query heads of the unit, f32 */
    for (int e = tid; e < gn * D; e += NT) {
        int g = e / D, j = e - g * D;
        qf[e] = reinterpret_cast<const float *>(it.q + (long long)(h * G + u.g0 + g) * it.qs)[j];
    }
    for (int e = tid; e < gn * Dv; e += NT)
        acc[e] = 0.0f;
    if (tid < MAXGB) {
        mm[tid] = -INFINITY;
        ll[tid] = 0.0f;
    }
    __syncthreads();
    /* key axis TOKEN: q8 per head, its plane patterns and group sums */
    const int kw = (D * kbits + 31) / 32, kfast = (D * kbits) % 32 == 0 && (kP * kbits) % 32 == 0;
    int *qpat = reinterpret_cast<int *>(smb + L.qpat);
    float *qsum = reinterpret_cast<float *>(smb + L.qsum);
    signed char *q8 = reinterpret_cast<signed char *>(smb + L.q8);
    if (kaxis == KVD_ATTN_AXIS_TOKEN) {
        for (int g = warp; g < gn; g += NW) {
            float sc = warp_quantize_q8(qf + g * D, D, q8 + g * D);
            if (lane == 0)
                sq[g] = sc * it.scale;
        }
        __syncthreads();
        for (int e = tid; e < gn * kng; e += NT) {
            int g = e / kng, grp = e - g * kng, sum = 0;
            for (int j = grp * kP; j < (grp + 1) * kP; j++)
                sum += q8[g * D + j];
            qsum[e] = (float)sum;
        }
        /* pattern (w, k): byte b = q8[(4w + b) * per + k] */
        for (int e = tid; kfast && e < gn * kw * kper; e += NT) {
            int g = e / (kw * kper), r = e - g * kw * kper, w = r / kper, k = r - w * kper;
            unsigned x = 0;
            for (int b = 0; b < 4; b++)
                x |= (unsigned)(unsigned char)q8[g * D + (4 * w + b) * kper + k] << (8 * b);
            qpat[e] = (int)x;
        }
        __syncthreads();
    }
    float *wsc = reinterpret_cast<float *>(smb + L.w);
    signed char *w8 = reinterpret_cast<signed char *>(smb + L.w8);
    float *sw = reinterpret_cast<float *>(smb + L.sw), *bias = reinterpret_cast<float *>(smb + L.bias);
    unsigned char *p8 = smb + L.p8;
    unsigned *vpat = reinterpret_cast<unsigned *>(smb + L.vpat);
    float *mP = reinterpret_cast<float *>(smb + L.mP), *sP = reinterpret_cast<float *>(smb + L.sP),
          *corr = reinterpret_cast<float *>(smb + L.corr);
    const int vP = V.group, vper = 8 / vbits;
    const int D4 = (D + 3) & ~3; /* w8 rows, 4-byte aligned for __dp4a */

    for (long long t0 = u.t0; t0 < u.t1; t0 += tb) {
        const int n = (int)min((long long)tb, u.t1 - t0);
        /* ---- scores ---- */
        if (kaxis == KVD_ATTN_AXIS_TOKEN) {
            for (int i = tid; i < n; i += NT) {
                const long long t = t0 + i;
                const unsigned char *row = K.codes + h * K.cs0 + t * K.cs1;
                float dot[MAXGB];
#pragma unroll
                for (int g = 0; g < MAXGB; g++)
                    dot[g] = 0.0f;
                const int wpg = kfast ? kP * kbits / 32 : 0;
                if (kfast && K.w4 && kw <= KW_MAX) {
                    if (kbits == 2)
                        key_row_dots<2>(K, row, h, t, kw, wpg, kng, gn, qpat, qsum, dot);
                    else
                        key_row_dots<4>(K, row, h, t, kw, wpg, kng, gn, qpat, qsum, dot);
                }
                for (int grp = 0; !(kfast && K.w4 && kw <= KW_MAX) && grp < kng; grp++) {
                    int ic[MAXGB];
#pragma unroll
                    for (int g = 0; g < MAXGB; g++)
                        ic[g] = 0;
                    if (kfast) {
                        for (int w = grp * wpg; w < (grp + 1) * wpg; w++) {
                            unsigned x = code_word(K, row, w);
                            for (int k = 0; k < kper; k++) {
                                int pl = (int)((x >> (k * kbits)) & (kbits == 2 ? 0x03030303u : 0x0f0f0f0fu));
#pragma unroll
                                for (int g = 0; g < MAXGB; g++)
                                    if (g < gn)
                                        ic[g] = __dp4a(pl, qpat[(g * kw + w) * kper + k], ic[g]);
                            }
                        }
                    } else {
                        for (int j = grp * kP; j < (grp + 1) * kP; j++) {
                            int c = code_at(row, j, kbits);
#pragma unroll
                            for (int g = 0; g < MAXGB; g++)
                                if (g < gn)
                                    ic[g] += q8[g * D + j] * c;
                        }
                    }
                    float scv = p16f(K.sc, h, t, grp), mnv = p16f(K.mn, h, t, grp);
#pragma unroll
                    for (int g = 0; g < MAXGB; g++)
                        if (g < gn) {
                            dot[g] = __fmaf_rn((float)ic[g], scv, dot[g]);
                            dot[g] = __fmaf_rn(qsum[g * kng + grp], mnv, dot[g]);
                        }
                }
#pragma unroll
                for (int g = 0; g < MAXGB; g++)
                    if (g < gn)
                        s[g * tb + i] = dot[g] * sq[g];
            }
        } else {
            /* channel-grouped keys: per key group of the tile and head,
             * w = q * scale (f32), bias = sum q * min, w -> int8 */
            const int ng = n / kP;
            for (int e = warp; e < ng * gn; e += NW) {
                int gi = e / gn, g = e - gi * gn;
                long long grp = t0 / kP + gi;
                float b = 0.0f;
                float *wg = wsc + warp * D; /* this warp's scratch */
                for (int j = lane; j < D; j += 32) {
                    float qv = qf[g * D + j];
                    wg[j] = qv * p16f(K.sc, h, j, grp);
                    b = __fmaf_rn(qv, p16f(K.mn, h, j, grp), b);
                }
                b = warp_sum(b);
                __syncwarp();
                float swv = warp_quantize_q8(wg, D, w8 + ((size_t)gi * gn + g) * D4);
                if (lane == 0) {
                    sw[gi * gn + g] = swv;
                    bias[gi * gn + g] = b;
                }
                __syncwarp();
            }
            __syncthreads();
            for (int i = tid; i < n; i += NT) {
                const long long t = t0 + i;
                const int gi = i / kP;
                const unsigned char *cb = K.codes + h * K.cs0 + t / kper;
                const int sh = (int)(t % kper) * kbits, msk = (1 << kbits) - 1;
                int ic[MAXGB];
#pragma unroll
                for (int g = 0; g < MAXGB; g++)
                    ic[g] = 0;
                int j = 0;
                for (; j + 4 <= D; j += 4) {
                    int c4 = ((cb[(long long)j * K.cs1] >> sh) & msk) | ((cb[(long long)(j + 1) * K.cs1] >> sh) & msk) << 8 |
                             ((cb[(long long)(j + 2) * K.cs1] >> sh) & msk) << 16 |
                             ((cb[(long long)(j + 3) * K.cs1] >> sh) & msk) << 24;
#pragma unroll
                    for (int g = 0; g < MAXGB; g++)
                        if (g < gn)
                            ic[g] = __dp4a(c4, *reinterpret_cast<const int *>(w8 + ((size_t)gi * gn + g) * D4 + j), ic[g]);
                }
                for (; j < D; j++) {
                    int c = (cb[(long long)j * K.cs1] >> sh) & msk;
#pragma unroll
                    for (int g = 0; g < MAXGB; g++)
                        if (g < gn)
                            ic[g] += w8[((size_t)gi * gn + g) * D4 + j] * c;
                }
#pragma unroll
                for (int g = 0; g < MAXGB; g++)
                    if (g < gn)
                        s[g * tb + i] = (bias[gi * gn + g] + sw[gi * gn + g] * (float)ic[g]) * it.scale;
            }
        }
        __syncthreads();
        tile_softmax(s, tb, n, gn, mm, ll, ff);
        __syncthreads();
        /* ---- values ---- */
        if (vaxis == KVD_ATTN_AXIS_CHANNEL) {
            const int ng = n / vP;
            /* uint8 probabilities per (head, group), as quantize_p8 */
            for (int e = warp; e < gn * ng; e += NW) {
                int g = e / ng, gi = e - g * ng;
                const float *pg = s + g * tb + gi * vP;
                float lo = pg[0], hi = pg[0];
                for (int i = lane; i < vP; i += 32) {
                    lo = fminf(lo, pg[i]);
                    hi = fmaxf(hi, pg[i]);
                }
#pragma unroll
                for (int o = 16; o; o >>= 1) {
                    lo = fminf(lo, __shfl_xor_sync(0xffffffffu, lo, o));
                    hi = fmaxf(hi, __shfl_xor_sync(0xffffffffu, hi, o));
                }
                /* a step below FLT_MIN: coded as lo (as the CPU's quantize_p8) */
                float sc = (hi - lo) / 255.0f, inv = sc >= FLT_MIN ? 1.0f / sc : 0.0f;
                int sum = 0;
                for (int i = lane; i < vP; i += 32) {
                    float v = rintf((pg[i] - lo) * inv);
                    v = v > 0.0f ? (v > 255.0f ? 255.0f : v) : 0.0f; /* NaN (a NaN head): 0 */
                    int c = (int)v;
                    p8[g * tb + gi * vP + i] = (unsigned char)c;
                    sum += c;
                }
#pragma unroll
                for (int o = 16; o; o >>= 1)
                    sum += __shfl_xor_sync(0xffffffffu, sum, o);
                if (lane == 0) {
                    mP[g * ng + gi] = lo;
                    sP[g * ng + gi] = sc;
                    corr[g * ng + gi] = sc * (float)sum + (float)vP * lo;
                }
            }
            __syncthreads();
            /* plane patterns: word w of a code row holds tokens
             * (32/bits)*w + per*b + k at byte b, plane k */
            const int vw = n * vbits / 32, vfast = V.w4 && (vP * vbits) % 32 == 0 && (n * vbits) % 32 == 0;
            for (int e = tid; vfast && e < gn * vw * vper; e += NT) {
                int g = e / (vw * vper), r = e - g * vw * vper, w = r / vper, k = r - w * vper;
                unsigned x = 0;
                for (int b = 0; b < 4; b++)
                    x |= (unsigned)p8[g * tb + (32 / vbits) * w + vper * b + k] << (8 * b);
                vpat[g * (tb / 4 + 1) + r] = x;
            }
            __syncthreads();
            const int wpg = vP * vbits / 32;
            for (int d = tid; d < Dv; d += NT) {
                float a[MAXGB];
#pragma unroll
                for (int g = 0; g < MAXGB; g++)
                    a[g] = g < gn ? acc[g * Dv + d] * ff[g] : 0.0f;
                const unsigned char *row = V.codes + h * V.cs0 + d * V.cs1 + t0 * vbits / 8;
                const int vreg = vfast;
                if (vreg) {
                    if (vbits == 2)
                        value_row_acc<2>(V, row, h, d, t0 / vP, vw, wpg, gn, ng, vpat, tb / 4 + 1, sP, mP, corr, a);
                    else
                        value_row_acc<4>(V, row, h, d, t0 / vP, vw, wpg, gn, ng, vpat, tb / 4 + 1, sP, mP, corr, a);
                }
                for (int gi = 0; !vreg && gi < ng; gi++) {
                    const long long grp = t0 / vP + gi;
                    unsigned ic[MAXGB];
#pragma unroll
                    for (int g = 0; g < MAXGB; g++)
                        ic[g] = 0;
                    if (vfast) {
                        for (int w = gi * wpg; w < (gi + 1) * wpg; w++) {
                            unsigned x = __ldg(reinterpret_cast<const unsigned *>(row) + w);
                            for (int k = 0; k < vper; k++) {
                                unsigned pl = (x >> (k * vbits)) & (vbits == 2 ? 0x03030303u : 0x0f0f0f0fu);
#pragma unroll
                                for (int g = 0; g < MAXGB; g++)
                                    if (g < gn)
                                        ic[g] = __dp4a(pl, vpat[g * (tb / 4 + 1) + w * vper + k], ic[g]);
                            }
                        }
                    } else {
                        for (int i = gi * vP; i < (gi + 1) * vP; i++) {
                            unsigned c = (unsigned)code_at(row, i, vbits);
#pragma unroll
                            for (int g = 0; g < MAXGB; g++)
                                if (g < gn)
                                    ic[g] += p8[g * tb + i] * c;
                        }
                    }
                    float scv = p16f(V.sc, h, d, grp), mnv = p16f(V.mn, h, d, grp), csv = p16u(V.sum, h, d, grp);
#pragma unroll
                    for (int g = 0; g < MAXGB; g++)
                        if (g < gn) {
                            /* sc * (sP*S + mP*cs) + mn * (sP*sum8 + P*mP) */
                            float tt = __fmaf_rn(sP[g * ng + gi], (float)ic[g], mP[g * ng + gi] * csv);
                            a[g] = __fmaf_rn(scv, tt, a[g]);
                            a[g] = __fmaf_rn(mnv, corr[g * ng + gi], a[g]);
                        }
                }
#pragma unroll
                for (int g = 0; g < MAXGB; g++)
                    if (g < gn)
                        acc[g * Dv + d] = a[g];
            }
        } else {
            /* token axis (KIVI): out_d += (p*scale) * c + p*min */
            for (int d = tid; d < Dv; d += NT) {
                float a[MAXGB];
#pragma unroll
                for (int g = 0; g < MAXGB; g++)
                    a[g] = g < gn ? acc[g * Dv + d] * ff[g] : 0.0f;
                const int grp = d / vP;
                for (int i = 0; i < n; i++) {
                    const long long t = t0 + i;
                    float c = (float)code_at(V.codes + h * V.cs0 + t * V.cs1, d, vbits);
                    float scv = p16f(V.sc, h, t, grp), mnv = p16f(V.mn, h, t, grp);
#pragma unroll
                    for (int g = 0; g < MAXGB; g++) {
                        float p = g < gn ? s[g * tb + i] : 0.0f;
                        if (p != 0.0f)
                            a[g] = __fmaf_rn(p * scv, c, a[g]) + p * mnv;
                    }
                }
#pragma unroll
                for (int g = 0; g < MAXGB; g++)
                    if (g < gn)
                        acc[g * Dv + d] = a[g];
            }
        }
        __syncthreads();
    }
    unit_store_smem(it.o, u, G, Dv, P, acc, mm, ll);
}
#undef kbits
#undef vbits
#undef kaxis
#undef vaxis


/* ---------------------------------------------------------------------- */
/* VQ                                                                     */
/* ---------------------------------------------------------------------- */

constexpr int VTILE = 256; /* tokens per tile, VQ */
constexpr int VNT = 256;   /* threads per block, VQ: one block per SM fits the
                            * shared tables, so the block itself hides latency */

struct VqLayout {
    size_t s, mlf, qt, lut, A, acc, total;
};

__host__ __device__ inline VqLayout vq_layout(int GB, int D, int Dv, int kpos, int kK, int vpos, int vK, int lut,
                                              int accA)
{
    VqLayout L;
    size_t o = 0;
    L.s = o, o += al16(4u * GB * VTILE);
    L.mlf = o, o += al16(4u * 6 * MAXGB);
    L.qt = o, o += al16(4u * GB * D);
    L.lut = o, o += lut ? al16(4u * (size_t)kpos * kK * GB) : 0;
    L.A = o, o += accA ? al16(4u * (size_t)vpos * vK * GB) : 0;
    L.acc = o, o += al16(4u * GB * Dv);
    L.total = o;
    return L;
}

__device__ __forceinline__ unsigned vq_code(const char *row, int pos, int wide)
{
    return wide ? (unsigned)reinterpret_cast<const unsigned short *>(row)[pos]
                : (unsigned)reinterpret_cast<const unsigned char *>(row)[pos];
}

/*
 * The start of a VQ unit, by all threads: the transformed query heads
 * qt (gn, D) and, when the item has one, the score table
 * lut[(pos * kK + code) * gn + g] = qt_g[pos] . C_k[code].
 */
/* q~ = H (q * lambda) * softmax_scale of the unit's gn query heads, (gn, D)
 * in shared memory, by all threads. */
__device__ void vq_query(const VItem &it, int h, int g0, int gn, float *qt)
{
    const int D = it.D, G = it.G, tid = threadIdx.x;
    const float *lam = it.lam ? reinterpret_cast<const float *>(it.lam + h * it.lams0) : nullptr;
    for (int e = tid; e < gn * D; e += VNT) {
        int g = e / D, j = e - g * D;
        float x = reinterpret_cast<const float *>(it.q + (long long)(h * G + g0 + g) * it.qs)[j];
        qt[e] = lam ? x * lam[j] : x;
    }
    __syncthreads();
    if (it.had) {
        for (int len = 1; len < D; len <<= 1) {
            for (int e = tid; e < gn * (D / 2); e += VNT) {
                int g = e / (D / 2), r = e - g * (D / 2);
                int i = (r / len) * 2 * len + r % len;
                float a = qt[g * D + i], b = qt[g * D + i + len];
                qt[g * D + i] = a + b;
                qt[g * D + i + len] = a - b;
            }
            __syncthreads();
        }
        const float hs = 1.0f / sqrtf((float)D);
        for (int e = tid; e < gn * D; e += VNT)
            qt[e] *= hs;
        __syncthreads();
    }
    for (int e = tid; e < gn * D; e += VNT)
        qt[e] *= it.scale;
    __syncthreads();
}

__device__ void vq_prologue(const VItem &it, int h, int g0, int gn, float *qt, float *lut)
{
    const int D = it.D, tid = threadIdx.x, kpos = D / it.dk, kK = it.kK;
    vq_query(it, h, g0, gn, qt);
    const float *kcb = reinterpret_cast<const float *>(it.kcb + h * it.kcbs0);
    const long long kcbr = it.kcbs1 / 4;
    if (it.lut)
        for (int e = tid; e < kpos * kK; e += VNT) {
            int pos = e / kK, c = e - pos * kK;
            const float *cr = kcb + c * kcbr;
            float a[MAXGB];
#pragma unroll
            for (int g = 0; g < MAXGB; g++)
                a[g] = 0.0f;
            for (int i = 0; i < it.dk; i++) {
                float x = cr[i];
#pragma unroll
                for (int g = 0; g < MAXGB; g++)
                    if (g < gn)
                        a[g] = __fmaf_rn(qt[g * D + pos * it.dk + i], x, a[g]);
            }
#pragma unroll
            for (int g = 0; g < MAXGB; g++)
                if (g < gn)
                    lut[(size_t)e * gn + g] = a[g];
        }
    __syncthreads();
}

__global__ void __launch_bounds__(VNT, 1) vq_kernel(const VItem *__restrict__ items, const Unit *__restrict__ units,
                                                Parts P)
{
    extern __shared__ __align__(16) unsigned char smb[];
    const Unit u = units[blockIdx.x];
    const VItem &it = items[u.item];
    const int D = it.D, Dv = it.Dv, G = it.G, h = u.h, gn = u.gn, tid = threadIdx.x;
    const int kpos = D / it.dk, vpos = Dv / it.dv, kK = it.kK, vK = it.vK;
    const VqLayout L = vq_layout(gn, D, Dv, kpos, kK, vpos, vK, it.lut, it.acc);
    float *s = reinterpret_cast<float *>(smb + L.s), *mm = reinterpret_cast<float *>(smb + L.mlf), *ll = mm + MAXGB,
          *ff = ll + MAXGB, *mult = ff + MAXGB, *qt = reinterpret_cast<float *>(smb + L.qt),
          *lut = reinterpret_cast<float *>(smb + L.lut), *A = reinterpret_cast<float *>(smb + L.A),
          *acc = reinterpret_cast<float *>(smb + L.acc);
    int *resc = reinterpret_cast<int *>(mult + MAXGB);

    vq_prologue(it, h, u.g0, gn, qt, lut);
    const long long vcbr = it.vcbs1 / 4;
    const float *kcb = reinterpret_cast<const float *>(it.kcb + h * it.kcbs0);
    const long long kcbr = it.kcbs1 / 4;
    const float *vcb = reinterpret_cast<const float *>(it.vcb + h * it.vcbs0);
    if (it.acc)
        for (size_t e = tid; e < (size_t)vpos * vK * gn; e += VNT)
            A[e] = 0.0f;
    for (int e = tid; e < gn * Dv; e += VNT)
        acc[e] = 0.0f;
    if (tid < MAXGB) {
        mm[tid] = -INFINITY;
        ll[tid] = 0.0f;
        mult[tid] = 1.0f;
    }
    __syncthreads();
    for (long long t0 = u.t0; t0 < u.t1; t0 += VTILE) {
        const int n = (int)min((long long)VTILE, u.t1 - t0);
        for (int i = tid; i < n; i += VNT) {
            const char *row = it.kc + h * it.kcs0 + (t0 + i) * it.kcs1;
            float a[MAXGB];
#pragma unroll
            for (int g = 0; g < MAXGB; g++)
                a[g] = 0.0f;
            if (it.lut && it.kvec) {
                for (int p0 = 0; p0 < kpos; p0 += 16) {
                    const uint4 v = ldg16(row + p0);
                    const unsigned wv[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
                    for (int j = 0; j < 16; j++) {
                        const unsigned c = (wv[j >> 2] >> (8 * (j & 3))) & 0xffu;
                        const float *lr = lut + ((size_t)(p0 + j) * kK + c) * gn;
#pragma unroll
                        for (int g = 0; g < MAXGB; g++)
                            if (g < gn)
                                a[g] += lr[g];
                    }
                }
            }
            for (int pos = 0; !(it.lut && it.kvec) && pos < kpos; pos++) {
                unsigned c = vq_code(row, pos, it.k16);
                if (it.lut) {
                    const float *lr = lut + ((size_t)pos * kK + c) * gn;
#pragma unroll
                    for (int g = 0; g < MAXGB; g++)
                        if (g < gn)
                            a[g] += lr[g];
                } else {
                    const float *cr = kcb + c * kcbr;
                    for (int i2 = 0; i2 < it.dk; i2++) {
                        float x = cr[i2];
#pragma unroll
                        for (int g = 0; g < MAXGB; g++)
                            if (g < gn)
                                a[g] = __fmaf_rn(qt[g * D + pos * it.dk + i2], x, a[g]);
                    }
                }
            }
#pragma unroll
            for (int g = 0; g < MAXGB; g++)
                if (g < gn)
                    s[g * VTILE + i] = a[g];
        }
        __syncthreads();
        tile_softmax(s, VTILE, n, gn, mm, ll, ff);
        __syncthreads();
        if (it.acc) {
            /* A holds A_true / mult: a growing max only changes mult; fold
             * mult into A when it gets small enough to risk overflow */
            if (tid < gn) {
                float mu = mult[tid] * ff[tid];
                resc[tid] = !(mu >= 1e-30f);
                mult[tid] = mu;
            }
            __syncthreads();
            for (int g = 0; g < gn; g++)
                if (resc[g]) {
                    float mu = mult[g];
                    for (size_t e = tid; e < (size_t)vpos * vK; e += VNT) {
                        float x = A[e * gn + g];
                        A[e * gn + g] = x != 0.0f ? x * mu : x;
                    }
                }
            __syncthreads();
            if (tid < gn && resc[tid])
                mult[tid] = 1.0f;
            __syncthreads();
            /* a thread per (token, position): the lanes of a warp take the
             * positions of one token (coalesced code bytes, distinct
             * accumulator rows); shared-memory atomic adds keep every
             * thread busy instead of a chain of dependent updates */
            float inv[MAXGB];
#pragma unroll
            for (int g = 0; g < MAXGB; g++)
                inv[g] = g < gn ? 1.0f / mult[g] : 0.0f;
            for (int e = tid; e < n * vpos; e += VNT) {
                const int i = e / vpos, pos = e - i * vpos;
                const unsigned c = vq_code(it.vc + h * it.vcs0 + (t0 + i) * it.vcs1, pos, it.v16);
                float *dst = A + ((size_t)pos * vK + c) * gn;
#pragma unroll
                for (int g = 0; g < MAXGB; g++)
                    if (g < gn) {
                        float p = s[g * VTILE + i];
                        if (p != 0.0f)
                            atomicAdd(dst + g, p * inv[g]);
                    }
            }
        } else {
            for (int d = tid; d < Dv; d += VNT) {
                const int pos = d / it.dv, di = d - pos * it.dv;
                float a[MAXGB];
#pragma unroll
                for (int g = 0; g < MAXGB; g++)
                    a[g] = g < gn ? acc[g * Dv + d] * ff[g] : 0.0f;
                for (int i = 0; i < n; i++) {
                    unsigned c = vq_code(it.vc + h * it.vcs0 + (t0 + i) * it.vcs1, pos, it.v16);
                    float x = vcb[c * vcbr + di];
#pragma unroll
                    for (int g = 0; g < MAXGB; g++) {
                        float p = g < gn ? s[g * VTILE + i] : 0.0f;
                        if (p != 0.0f)
                            a[g] = __fmaf_rn(p, x, a[g]);
                    }
                }
#pragma unroll
                for (int g = 0; g < MAXGB; g++)
                    if (g < gn)
                        acc[g * Dv + d] = a[g];
            }
        }
        __syncthreads();
    }
    if (it.acc) {
        /* one pass over the value codebook: out = sum_c A[pos][c] C_v[c] */
        for (int e = tid; e < gn * Dv; e += VNT) {
            int g = e / Dv, d = e - g * Dv, pos = d / it.dv, di = d - pos * it.dv;
            float a = 0.0f;
            const float *Ap = A + (size_t)pos * vK * gn + g;
            for (int c = 0; c < vK; c++) {
                float w = Ap[(size_t)c * gn];
                if (w != 0.0f)
                    a = __fmaf_rn(w, vcb[c * vcbr + di], a);
            }
            acc[e] = a * mult[g];
        }
        __syncthreads();
    }
    unit_store_smem(it.o, u, G, Dv, P, acc, mm, ll);
}

/*
 * VQ with the value side gathered, for GB (1, 2, 4) query heads per unit
 * (a unit with fewer computes the missing heads on a zero query and stores
 * none of them): the value codebook (vK, DV) and a tile's value codes live in
 * shared memory, and a thread per (position, token stripe) adds
 * p * C_v[code] for every head into registers. No atomics and no per-code
 * accumulators, so the score table takes every query head of a kv head (the
 * codes are read once). Key rows (u8 codes, kpos % 16 == 0) and value code
 * rows (u8, 16-byte rows) of the next tile are loaded into registers while
 * the current one is computed. When the value codebook is finite (checked
 * per unit) a zero probability adds exactly nothing and the loop needs no
 * test; else each head's term is skipped at p = 0, as everywhere.
 *
 * Shared memory (vqg_layout): s (GB, VTILE) | m, l, f | qt (GB, D) |
 * lut (kpos, kK, GB) | cb (vK, DV) | vcode (VTILE, vpos) u8 |
 * pt (VTILE, GB) probabilities token-major | acc (GB, Dv).
 */
constexpr int VQG_CH = 4;   /* 16-byte chunks of a key row / of a thread's value codes */
constexpr int VQG_DK = 8;   /* widest key sub-vector the table build holds in registers */

struct VqgLayout {
    size_t s, mlf, qt, lut, cb, vcode, pt, acc, total;
};

__host__ __device__ inline VqgLayout vqg_layout(int GB, int D, int Dv, int kpos, int kK, int vpos, int vK, int dv)
{
    VqgLayout L;
    size_t o = 0;
    L.s = o, o += al16(4u * GB * VTILE);
    L.mlf = o, o += al16(4u * 6 * MAXGB);
    L.qt = o, o += al16(4u * GB * D);
    L.lut = o, o += al16(4u * (size_t)kpos * kK * GB);
    L.cb = o, o += al16(4u * (size_t)vK * dv);
    L.vcode = o, o += al16((size_t)VTILE * vpos);
    L.pt = o, o += al16(4u * (size_t)VTILE * GB);
    L.acc = o, o += al16(4u * GB * Dv);
    L.total = o;
    return L;
}

template <int GB> __device__ __forceinline__ void ld_heads(const float *p, float *x)
{
    if (GB == 4) {
        const float4 v = *reinterpret_cast<const float4 *>(p);
        x[0] = v.x, x[1] = v.y, x[2] = v.z, x[3] = v.w;
    } else if (GB == 2) {
        const float2 v = *reinterpret_cast<const float2 *>(p);
        x[0] = v.x, x[1] = v.y;
    } else {
#pragma unroll
        for (int g = 0; g < GB; g++)
            x[g] = p[g];
    }
}

template <int DV, int GB>
__global__ void __launch_bounds__(VNT, 1) vq_gather_kernel(const VItem *__restrict__ items,
                                                       const Unit *__restrict__ units, Parts P)
{
    extern __shared__ __align__(16) unsigned char smb[];
    __shared__ int cb_bad;
    const Unit u = units[blockIdx.x];
    const VItem &it = items[u.item];
    const int D = it.D, Dv = it.Dv, G = it.G, h = u.h, gn = u.gn, tid = threadIdx.x, dk = it.dk;
    const int kpos = D / dk, vpos = Dv / DV, kK = it.kK, vK = it.vK;
    const VqgLayout L = vqg_layout(GB, D, Dv, kpos, kK, vpos, vK, DV);
    float *s = reinterpret_cast<float *>(smb + L.s), *mm = reinterpret_cast<float *>(smb + L.mlf), *ll = mm + MAXGB,
          *ff = ll + MAXGB, *qt = reinterpret_cast<float *>(smb + L.qt), *lut = reinterpret_cast<float *>(smb + L.lut),
          *cb = reinterpret_cast<float *>(smb + L.cb), *pt = reinterpret_cast<float *>(smb + L.pt),
          *acc = reinterpret_cast<float *>(smb + L.acc);
    unsigned char *vcode = smb + L.vcode;

    /* the query heads (zero beyond gn), then the score table: a thread
     * keeps one position's query values in registers and runs over codes */
    for (int e = gn * D + tid; e < GB * D; e += VNT)
        qt[e] = 0.0f;
    if (tid == 0)
        cb_bad = 0;
    vq_query(it, h, u.g0, gn, qt);
    {
        const float *kcb = reinterpret_cast<const float *>(it.kcb + h * it.kcbs0);
        const long long kcbr = it.kcbs1 / 4;
        const int pos = tid % kpos, c0 = tid / kpos, cs = VNT / kpos;
        float qv[GB][VQG_DK];
#pragma unroll
        for (int g = 0; g < GB; g++)
#pragma unroll
            for (int i = 0; i < VQG_DK; i++)
                qv[g][i] = i < dk ? qt[g * D + pos * dk + i] : 0.0f;
        for (int c = c0; c < kK; c += cs) {
            const float *cr = kcb + c * kcbr;
            float a[GB];
#pragma unroll
            for (int g = 0; g < GB; g++)
                a[g] = 0.0f;
#pragma unroll
            for (int i = 0; i < VQG_DK; i++) {
                if (i >= dk)
                    break;
                const float x = __ldg(cr + i);
#pragma unroll
                for (int g = 0; g < GB; g++)
                    a[g] = __fmaf_rn(qv[g][i], x, a[g]);
            }
#pragma unroll
            for (int g = 0; g < GB; g++)
                lut[((size_t)pos * kK + c) * GB + g] = a[g];
        }
    }
    const float *vcb = reinterpret_cast<const float *>(it.vcb + h * it.vcbs0);
    const long long vcbr = it.vcbs1 / 4;
    int bad = 0;
    for (int e = tid; e < vK * DV; e += VNT) {
        int c = e / DV, j = e - c * DV;
        const float x = vcb[c * vcbr + j];
        cb[e] = x;
        bad |= !isfinite(x);
    }
    if (bad)
        cb_bad = 1;
    for (int e = tid; e < GB * Dv; e += VNT)
        acc[e] = 0.0f;
    if (tid < MAXGB) {
        mm[tid] = -INFINITY;
        ll[tid] = 0.0f;
    }
    const int kch = kpos / 16, vcpr = vpos / 16; /* 16-byte chunks per key / value row */
    const char *kbase = it.kc + h * it.kcs0, *vbase = it.vc + h * it.vcs0;
    uint4 kr[VQG_CH], vr[VQG_CH];
    auto fetch = [&](long long t0, int n) {
#pragma unroll
        for (int j = 0; j < VQG_CH; j++)
            if (j < kch && tid < n)
                kr[j] = ldg16(kbase + (t0 + tid) * it.kcs1 + 16 * j);
#pragma unroll
        for (int r = 0; r < VQG_CH; r++) {
            const int e = tid + r * VNT;
            if (r < vcpr && e < n * vcpr)
                vr[r] = ldg16(vbase + (t0 + e / vcpr) * it.vcs1 + 16 * (e % vcpr));
        }
    };
    fetch(u.t0, (int)min((long long)VTILE, u.t1 - u.t0));
    __syncthreads();
    const int finite = !cb_bad;

    const int nsub = VNT / vpos, pos = tid % vpos, sub = tid / vpos;
    float a[GB][DV];
#pragma unroll
    for (int g = 0; g < GB; g++)
#pragma unroll
        for (int j = 0; j < DV; j++)
            a[g][j] = 0.0f;
    for (long long t0 = u.t0; t0 < u.t1; t0 += VTILE) {
        const int n = (int)min((long long)VTILE, u.t1 - t0);
        /* this tile's value codes to shared memory, its scores from the
         * key rows in registers */
#pragma unroll
        for (int r = 0; r < VQG_CH; r++) {
            const int e = tid + r * VNT;
            if (r < vcpr && e < n * vcpr)
                *reinterpret_cast<uint4 *>(vcode + 16 * (size_t)e) = vr[r];
        }
        if (tid < n) {
            float sc[GB];
#pragma unroll
            for (int g = 0; g < GB; g++)
                sc[g] = 0.0f;
#pragma unroll
            for (int j = 0; j < VQG_CH; j++) {
                if (j >= kch)
                    break;
                const unsigned wv[4] = {kr[j].x, kr[j].y, kr[j].z, kr[j].w};
#pragma unroll
                for (int b = 0; b < 16; b++) {
                    const unsigned c = (wv[b >> 2] >> (8 * (b & 3))) & 0xffu;
                    float x[GB];
                    ld_heads<GB>(lut + ((size_t)(16 * j + b) * kK + c) * GB, x);
#pragma unroll
                    for (int g = 0; g < GB; g++)
                        sc[g] += x[g];
                }
            }
#pragma unroll
            for (int g = 0; g < GB; g++)
                if (g < gn)
                    s[g * VTILE + tid] = sc[g];
        }
        if (t0 + VTILE < u.t1)
            fetch(t0 + VTILE, (int)min((long long)VTILE, u.t1 - t0 - VTILE));
        __syncthreads();
        tile_softmax(s, VTILE, n, gn, mm, ll, ff);
        __syncthreads();
        /* probabilities token-major (zero for the heads beyond gn) */
        if (tid < n)
#pragma unroll
            for (int g = 0; g < GB; g++)
                pt[tid * GB + g] = g < gn ? s[g * VTILE + tid] : 0.0f;
#pragma unroll
        for (int g = 0; g < GB; g++) {
            const float f = g < gn ? ff[g] : 0.0f;
#pragma unroll
            for (int j = 0; j < DV; j++)
                a[g][j] *= f;
        }
        __syncthreads();
        /* values: this thread's position over tokens sub, sub + nsub, ... */
#pragma unroll 2
        for (int i = sub; i < n; i += nsub) {
            const unsigned c = vcode[(size_t)i * vpos + pos];
            float x[DV], p[GB];
#pragma unroll
            for (int j = 0; j < DV; j += 4) {
                const float4 v = *reinterpret_cast<const float4 *>(cb + c * DV + j);
                x[j] = v.x, x[j + 1] = v.y, x[j + 2] = v.z, x[j + 3] = v.w;
            }
            ld_heads<GB>(pt + i * GB, p);
#pragma unroll
            for (int g = 0; g < GB; g++)
                if (finite || p[g] != 0.0f)
#pragma unroll
                    for (int j = 0; j < DV; j++)
                        a[g][j] = __fmaf_rn(p[g], x[j], a[g][j]);
        }
        __syncthreads();
    }
    /* the token stripes' sums, in stripe order */
    for (int r = 0; r < nsub; r++) {
        if (sub == r)
#pragma unroll
            for (int g = 0; g < GB; g++)
#pragma unroll
                for (int j = 0; j < DV; j++)
                    acc[g * Dv + pos * DV + j] += a[g][j];
        __syncthreads();
    }
    unit_store_smem(it.o, u, G, Dv, P, acc, mm, ll);
}

/* ---------------------------------------------------------------------- */
/* SVD: query projection and output rotation                              */
/* ---------------------------------------------------------------------- */

struct SvdHead {
    const float *q;  /* query row */
    const float *R;  /* (D, D) rotation of the head, row-major */
    float *y;        /* projected query (rk) / reduced output (rv) */
    float *out;      /* output row (Dv) */
    int D, w;        /* full width, kept width */
};

/* y[j] = sum_i q[i] R[i][j], j < w */
__global__ void svd_project_kernel(const SvdHead *__restrict__ hs)
{
    const SvdHead t = hs[blockIdx.x];
    for (int j = threadIdx.x; j < t.w; j += blockDim.x) {
        float a = 0.0f;
        for (int i = 0; i < t.D; i++)
            a = __fmaf_rn(t.q[i], t.R[(size_t)i * t.D + j], a);
        t.y[j] = a;
    }
}

/* out[i] = sum_j y[j] R[i][j], j < w */
__global__ void svd_unproject_kernel(const SvdHead *__restrict__ hs)
{
    const SvdHead t = hs[blockIdx.x];
    for (int i = threadIdx.x; i < t.D; i += blockDim.x) {
        float a = 0.0f;
        for (int j = 0; j < t.w; j++)
            a = __fmaf_rn(t.y[j], t.R[(size_t)i * t.D + j], a);
        t.out[i] = a;
    }
}

/* ---------------------------------------------------------------------- */
/* Host: planning                                                         */
/* ---------------------------------------------------------------------- */

/* One token source of a head group (the coded tokens, or the raw tail). */
struct Src {
    int list;      /* which launch runs it */
    int item;      /* index into that launch's items */
    long long T;
    int gran;      /* split boundaries are multiples of this */
};

struct Plan {
    std::vector<Unit> units[2];
    std::vector<Comb> comb;
    int nslots = 0, dvmax = 1;
    long long chunk = 1;
};

OutDesc out_desc(const kvd_tensor &out, const kvd_tensor &lse)
{
    OutDesc o;
    o.out = static_cast<char *>(out.data);
    o.os = out.stride[0];
    o.lse = static_cast<char *>(lse.data);
    o.ls = lse.stride[0];
    return o;
}

/* Split size for a call: about 4 units per SM over all head groups, at
 * least 256 tokens (a batch-1 16K sequence of 8 kv heads
 * still fills an H100), at most MAXSPLIT splits per source. */
long long plan_chunk(kvd_cuda_ctx *c, long long work, long long least = 256)
{
    long long target = 4LL * (c->sm_count > 0 ? c->sm_count : 1);
    long long ch = (work + target - 1) / target;
    return ch < least ? least : ch;
}

/* Add the units of one head group (item's kv head h, heads g0..g0+gn-1 of
 * the group) drawn from nsrc sources. */
void plan_group(Plan &pl, const Src *src, int nsrc, int h, int g0, int gn, int G, const OutDesc &o, int Dv)
{
    long long cs[4];
    int ns[4], total = 0;
    for (int i = 0; i < nsrc; i++) {
        long long T = src[i].T, ch = pl.chunk;
        if (ch < (T + MAXSPLIT - 1) / MAXSPLIT)
            ch = (T + MAXSPLIT - 1) / MAXSPLIT;
        ch = (ch + src[i].gran - 1) / src[i].gran * src[i].gran;
        cs[i] = ch;
        ns[i] = T > 0 ? (int)((T + ch - 1) / ch) : 0;
        total += ns[i];
    }
    if (total > MAXSPLIT) { /* several sources at their cap: widen */
        for (int i = 0; i < nsrc; i++) {
            cs[i] *= 2;
            ns[i] = src[i].T > 0 ? (int)((src[i].T + cs[i] - 1) / cs[i]) : 0;
        }
        total = 0;
        for (int i = 0; i < nsrc; i++)
            total += ns[i];
    }
    int base = -1;
    if (total != 1) {
        base = pl.nslots;
        pl.nslots += total * gn;
        for (int gi = 0; gi < gn; gi++) {
            Comb cb;
            int hq = h * G + g0 + gi;
            cb.out = o.out + (long long)hq * o.os;
            cb.lse = o.lse + (long long)hq * o.ls;
            cb.Dv = Dv;
            cb.nsplit = total;
            cb.slot0 = base + gi;
            cb.stride = gn;
            pl.comb.push_back(cb);
        }
    }
    if (Dv > pl.dvmax)
        pl.dvmax = Dv;
    int k = 0;
    for (int i = 0; i < nsrc; i++)
        for (int sp = 0; sp < ns[i]; sp++, k++) {
            Unit u;
            u.item = src[i].item;
            u.h = h;
            u.g0 = g0;
            u.gn = gn;
            u.t0 = sp * cs[i];
            u.t1 = std::min(src[i].T, (sp + 1) * cs[i]);
            u.slot = base < 0 ? -1 : base + k * gn;
            u.pad = 0;
            pl.units[src[i].list].push_back(u);
        }
}

/* Longest first (ZACK): big units start before the small ones fill in. */
void order_units(std::vector<Unit> &u)
{
    std::stable_sort(u.begin(), u.end(), [](const Unit &a, const Unit &b) {
        return (a.t1 - a.t0) * a.gn > (b.t1 - b.t0) * b.gn;
    });
}

/* Host arrays gathered into one upload. */
struct Upload {
    std::vector<unsigned char> buf;
    template <class T> size_t add(const std::vector<T> &v)
    {
        size_t off = (buf.size() + 15) & ~(size_t)15;
        buf.resize(off + v.size() * sizeof(T));
        if (!v.empty())
            memcpy(buf.data() + off, v.data(), v.size() * sizeof(T));
        return off;
    }
};

/* Scratch of one call: freed stream-ordered, so it outlives the launches. */
struct Scratch {
    kvd_cuda_call *call;
    std::vector<void *> ptrs;
    explicit Scratch(kvd_cuda_call *c) : call(c) {}
    ~Scratch()
    {
        for (void *p : ptrs)
            kvd__cuda_scratch_free(call, p);
    }
    int get(size_t bytes, void **p, kvd_error *err)
    {
        int rc = kvd__cuda_scratch(call, bytes, p, err);
        if (!rc)
            ptrs.push_back(*p);
        return rc;
    }
};

int upload(kvd_cuda_call *call, Scratch &sc, const Upload &up, unsigned char **dev, kvd_error *err)
{
    void *p = nullptr;
    int rc = sc.get(up.buf.size() + 16, &p, err);
    if (rc)
        return rc;
    *dev = static_cast<unsigned char *>(p);
    if (up.buf.empty())
        return 0;
    return kvd__cuda_status(call->c,
                            cudaMemcpyAsync(p, up.buf.data(), up.buf.size(), cudaMemcpyHostToDevice, call->s),
                            "attention descriptors", err);
}

int set_smem(const void *fn, size_t bytes, kvd_cuda_call *call, kvd_error *err)
{
    if (bytes <= 48 * 1024)
        return 0;
    if (bytes > call->c->smem_optin)
        return kvd_error_set(err, KVD_EUNSUPP, "cuda attention: %zu bytes of shared memory needed, %zu available",
                             bytes, call->c->smem_optin);
    return kvd__cuda_status(call->c, cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes),
                            "cudaFuncSetAttribute", err);
}

/* One launch of int_kernel<FB, FG, FD>. */
template <int FB, int FG, int FD>
int launch_int(unsigned nu, size_t smem, kvd_cuda_call *call, const QItem *dq, const Unit *du, const Parts &P,
               kvd_error *err)
{
    int r = set_smem((const void *)int_kernel<FB, FG, FD>, smem, call, err);
    if (r)
        return r;
    int_kernel<FB, FG, FD><<<nu, NT, smem, call->s>>>(dq, du, P);
    return 0;
}

/* One launch of the gathered VQ kernel for DV-wide value sub-vectors and GB
 * heads per unit. */
template <int DV, int GB>
int launch_vqg(unsigned nu, size_t smem, kvd_cuda_call *call, const VItem *di, const Unit *du, const Parts &P,
               kvd_error *err)
{
    int r = set_smem((const void *)vq_gather_kernel<DV, GB>, smem, call, err);
    if (r)
        return r;
    vq_gather_kernel<DV, GB><<<nu, VNT, smem, call->s>>>(di, du, P);
    return 0;
}

int dense_vec_of(const DItem &d)
{
    return d.kdt == KVD_DTYPE_F32 ? 4 : 8;
}

int is_pow2(int x) { return x > 0 && (x & (x - 1)) == 0; }

/* Whether dense_fast can run an item (at gn <= 8). */
int dense_fast_ok(const DItem &d)
{
    if (d.kdt != d.vdt)
        return 0;
    int vec = dense_vec_of(d), esz = d.kdt == KVD_DTYPE_F32 ? 4 : 2;
    if (d.D % vec || d.Dv % vec || !is_pow2(d.D / vec) || !is_pow2(d.Dv / vec) || d.D / vec > 32 || d.Dv / vec > 32)
        return 0;
    uintptr_t bits = (uintptr_t)d.k | (uintptr_t)d.v | (uintptr_t)d.ks0 | (uintptr_t)d.ks1 | (uintptr_t)d.vs0 |
                     (uintptr_t)d.vs1;
    return (bits & 15) == 0 && esz > 0;
}

/* Dense-kernel launches over one unit list: fast items, then the rest. The
 * caller split items into two lists already (fast[] says which). */
int launch_dense(kvd_cuda_call *call, const DItem *ditems, const std::vector<Unit> &units, const Unit *dunits,
                 const std::vector<DItem> &hitems, const Parts &P, kvd_error *err)
{
    if (units.empty())
        return 0;
    /* group consecutive runs by kernel configuration (items of one call
     * normally share it: one launch) */
    size_t i = 0;
    while (i < units.size()) {
        const DItem &d0 = hitems[units[i].item];
        int fast = dense_fast_ok(d0);
        int cfg = fast ? d0.kdt * 16 + (units[i].gn > 4 ? 8 : units[i].gn > 2 ? 4 : units[i].gn > 1 ? 2 : 1) : 0;
        size_t j = i + 1;
        size_t smax = 0;
        auto smem_of = [&](const Unit &u) -> size_t {
            const DItem &d = hitems[u.item];
            if (!fast)
                return dense_any_smem(d.D, d.Dv, u.gn);
            int GB = cfg & 15;
            int vec = dense_vec_of(d);
            size_t a = (size_t)GB * DTILE, b = (size_t)(NT / (d.Dv / vec)) * GB * d.Dv;
            return sizeof(float) * (4 * GB + (a > b ? a : b));
        };
        smax = smem_of(units[i]);
        while (j < units.size()) {
            const DItem &dj = hitems[units[j].item];
            int fj = dense_fast_ok(dj);
            int cj = fj ? dj.kdt * 16 + (units[j].gn > 4 ? 8 : units[j].gn > 2 ? 4 : units[j].gn > 1 ? 2 : 1) : 0;
            if (cj != cfg)
                break;
            smax = std::max(smax, smem_of(units[j]));
            j++;
        }
        unsigned nb = (unsigned)(j - i);
        const Unit *du = dunits + i;
        int rc;
#define KVD__DF(DT, GB)                                                                            \
    if (cfg == DT * 16 + GB) {                                                                     \
        if ((rc = set_smem((const void *)dense_fast_kernel<DT, GB>, smax, call, err)))             \
            return rc;                                                                             \
        dense_fast_kernel<DT, GB><<<nb, NT, smax, call->s>>>(ditems, du, P);                       \
    } else
        KVD__DF(KVD_DTYPE_F16, 1) KVD__DF(KVD_DTYPE_F16, 2) KVD__DF(KVD_DTYPE_F16, 4) KVD__DF(KVD_DTYPE_F16, 8)
        KVD__DF(KVD_DTYPE_BF16, 1) KVD__DF(KVD_DTYPE_BF16, 2) KVD__DF(KVD_DTYPE_BF16, 4) KVD__DF(KVD_DTYPE_BF16, 8)
        KVD__DF(KVD_DTYPE_F32, 1) KVD__DF(KVD_DTYPE_F32, 2) KVD__DF(KVD_DTYPE_F32, 4) KVD__DF(KVD_DTYPE_F32, 8)
        {
            if ((rc = set_smem((const void *)dense_any_kernel, smax, call, err)))
                return rc;
            dense_any_kernel<<<nb, NT, smax, call->s>>>(ditems, du, P);
        }
#undef KVD__DF
        if ((rc = kvd__cuda_launched(call, "dense attention", err)))
            return rc;
        i = j;
    }
    return 0;
}

/* Keep the units of one kernel configuration together (one launch each),
 * longest first inside a configuration. */
void order_dense(std::vector<Unit> &u, const std::vector<DItem> &items)
{
    auto key = [&](const Unit &x) {
        const DItem &d = items[x.item];
        return dense_fast_ok(d) ? d.kdt * 16 + (x.gn > 4 ? 8 : x.gn > 2 ? 4 : x.gn > 1 ? 2 : 1) : 0;
    };
    std::stable_sort(u.begin(), u.end(), [&](const Unit &a, const Unit &b) {
        int ka = key(a), kb = key(b);
        if (ka != kb)
            return ka < kb;
        return (a.t1 - a.t0) * a.gn > (b.t1 - b.t0) * b.gn;
    });
}

/* Query heads per unit of the dense kernels. */
int dense_gcap(const DItem &d)
{
    if (dense_fast_ok(d))
        return MAXGB;
    int c = 11264 / std::max(1, d.D + d.Dv);
    return std::max(1, std::min(MAXGB, c));
}

DItem ditem_of(const kvd_attn_dims &dm, const kvd_tensor &q, const kvd_tensor &k, const kvd_tensor &v,
               const kvd_tensor *idx, const OutDesc &o)
{
    DItem d;
    memset(&d, 0, sizeof d);
    d.q = static_cast<const char *>(q.data);
    d.qs = q.stride[0];
    d.k = static_cast<const char *>(k.data);
    d.ks0 = k.ndim == 3 ? k.stride[0] : 0;
    d.ks1 = k.ndim == 3 ? k.stride[1] : 0;
    d.v = static_cast<const char *>(v.data);
    d.vs0 = v.ndim == 3 ? v.stride[0] : 0;
    d.vs1 = v.ndim == 3 ? v.stride[1] : 0;
    d.idx = idx ? static_cast<const int *>(idx->data) : nullptr;
    d.is0 = idx ? idx->stride[0] : 0;
    d.kdt = k.dtype;
    d.vdt = v.dtype;
    d.D = dm.head_dim;
    d.Dv = dm.v_dim;
    d.G = dm.n_q_heads / dm.n_kv_heads;
    d.scale = dm.softmax_scale;
    d.o = o;
    return d;
}

/*
 * Run a plan: list 0 has kernel-specific units (INT, VQ; none for dense),
 * list 1 dense units. launch0 launches list 0 given its device units.
 */
template <class L0>
int run_plan(kvd_cuda_call *call, Plan &pl, Upload &up, const std::vector<DItem> &ditems, L0 launch0, kvd_error *err)
{
    order_dense(pl.units[1], ditems);
    size_t o_u0 = up.add(pl.units[0]), o_u1 = up.add(pl.units[1]), o_cb = up.add(pl.comb),
           o_di = up.add(ditems);
    Scratch sc(call);
    unsigned char *dev = nullptr;
    int rc = upload(call, sc, up, &dev, err);
    if (rc)
        return rc;
    Parts P;
    P.dvmax = pl.dvmax;
    P.out = nullptr;
    P.lse = nullptr;
    if (pl.nslots > 0) {
        void *p = nullptr;
        if ((rc = sc.get(sizeof(float) * (size_t)pl.nslots * (pl.dvmax + 1), &p, err)))
            return rc;
        P.out = static_cast<float *>(p);
        P.lse = P.out + (size_t)pl.nslots * pl.dvmax;
    }
    if (!pl.units[0].empty() && (rc = launch0(dev, reinterpret_cast<const Unit *>(dev + o_u0), P)))
        return rc;
    if ((rc = launch_dense(call, reinterpret_cast<const DItem *>(dev + o_di), pl.units[1],
                           reinterpret_cast<const Unit *>(dev + o_u1), ditems, P, err)))
        return rc;
    if (!pl.comb.empty()) {
        combine_kernel<<<(unsigned)pl.comb.size(), NT, 0, call->s>>>(reinterpret_cast<const Comb *>(dev + o_cb), P);
        if ((rc = kvd__cuda_launched(call, "attention combine", err)))
            return rc;
    }
    return 0;
}

/* ---------------------------------------------------------------------- */
/* Host: ops                                                              */
/* ---------------------------------------------------------------------- */

int no_launch(unsigned char *, const Unit *, const Parts &) { return 0; }

int dense_common(kvd_backend *be, int n, const kvd_attn_dims *const *dims, const kvd_tensor *const *q,
                 const kvd_tensor *const *k, const kvd_tensor *const *v, const kvd_tensor *const *idx,
                 const kvd_tensor *const *out, const kvd_tensor *const *lse, kvd_error *err)
{
    kvd_cuda_call call;
    int rc = kvd__cuda_begin(be, &call, err);
    if (rc)
        return rc;
    std::vector<DItem> items;
    long long work = 0;
    for (int i = 0; i < n; i++) {
        items.push_back(ditem_of(*dims[i], *q[i], *k[i], *v[i], idx[i], out_desc(*out[i], *lse[i])));
        long long T = idx[i] ? idx[i]->shape[1] : k[i]->shape[1];
        work += T * dims[i]->n_kv_heads;
    }
    Plan pl;
    pl.chunk = plan_chunk(call.c, work);
    for (int i = 0; i < n; i++) {
        const DItem &d = items[i];
        long long T = idx[i] ? idx[i]->shape[1] : k[i]->shape[1];
        int gcap = dense_gcap(d);
        Src s = {1, i, T, DTILE};
        for (int h = 0; h < dims[i]->n_kv_heads; h++)
            for (int g0 = 0; g0 < d.G; g0 += gcap)
                plan_group(pl, &s, 1, h, g0, std::min(gcap, d.G - g0), d.G, d.o, d.Dv);
    }
    Upload up;
    return run_plan(&call, pl, up, items, no_launch, err);
}

int cuda_dense(kvd_backend *be, int n, const kvd_attn_dense_args *a, kvd_error *err)
{
    std::vector<const kvd_attn_dims *> dm(n);
    std::vector<const kvd_tensor *> q(n), k(n), v(n), ix(n), o(n), l(n);
    for (int i = 0; i < n; i++) {
        dm[i] = &a[i].dims;
        q[i] = &a[i].q, k[i] = &a[i].k, v[i] = &a[i].v, ix[i] = nullptr, o[i] = &a[i].out, l[i] = &a[i].lse;
    }
    return dense_common(be, n, dm.data(), q.data(), k.data(), v.data(), ix.data(), o.data(), l.data(), err);
}

/* Index lists are validated on the device (the checked wrapper does not
 * read device memory): an index outside [0, T) fails the call with
 * KVD_EINVAL before any output is written. */
int cuda_sparse(kvd_backend *be, int n, const kvd_attn_sparse_args *a, kvd_error *err)
{
    kvd_cuda_call call;
    int rc = kvd__cuda_begin(be, &call, err);
    if (rc)
        return rc;
    std::vector<IdxJob> jobs;
    long long most = 0;
    for (int i = 0; i < n; i++) {
        if (a[i].idx.shape[1] == 0)
            continue;
        IdxJob j = {static_cast<const char *>(a[i].idx.data), a[i].idx.stride[0], a[i].dims.n_kv_heads, i,
                    a[i].idx.shape[1], a[i].k.shape[1]};
        jobs.push_back(j);
        most = std::max(most, j.n * j.Hkv);
    }
    if (!jobs.empty()) {
        Upload up;
        size_t oj = up.add(jobs);
        std::vector<int> init(1, 0x7fffffff);
        size_t of = up.add(init);
        Scratch sc(&call);
        unsigned char *dev = nullptr;
        if ((rc = upload(&call, sc, up, &dev, err)))
            return rc;
        int *flag = reinterpret_cast<int *>(dev + of);
        dim3 grid(kvd__cuda_blocks(most, 256) > 1024 ? 1024 : kvd__cuda_blocks(most, 256), (unsigned)jobs.size());
        idx_check_kernel<<<grid, 256, 0, call.s>>>(reinterpret_cast<const IdxJob *>(dev + oj), flag);
        if ((rc = kvd__cuda_launched(&call, "sparse index check", err)))
            return rc;
        int bad = 0;
        if ((rc = kvd__cuda_status(call.c, cudaMemcpyAsync(&bad, flag, 4, cudaMemcpyDeviceToHost, call.s),
                                   "sparse index check", err)) ||
            (rc = kvd__cuda_wait(&call, "sparse index check", err)))
            return rc;
        if (bad != 0x7fffffff)
            return kvd_error_set(err, KVD_EINVAL, "sparse attention item %d: an index is outside [0, T)", bad);
    }
    std::vector<const kvd_attn_dims *> dm(n);
    std::vector<const kvd_tensor *> q(n), k(n), v(n), ix(n), o(n), l(n);
    for (int i = 0; i < n; i++) {
        dm[i] = &a[i].dims;
        q[i] = &a[i].q, k[i] = &a[i].k, v[i] = &a[i].v, ix[i] = &a[i].idx, o[i] = &a[i].out, l[i] = &a[i].lse;
    }
    return dense_common(be, n, dm.data(), q.data(), k.data(), v.data(), ix.data(), o.data(), l.data(), err);
}

int cuda_merge(kvd_backend *be, int n, const kvd_attn_merge_args *a, kvd_error *err)
{
    kvd_cuda_call call;
    int rc = kvd__cuda_begin(be, &call, err);
    if (rc)
        return rc;
    std::vector<MRow> rows;
    for (int i = 0; i < n; i++)
        for (int64_t hq = 0; hq < a[i].out_a.shape[0]; hq++) {
            MRow r;
            r.oa = static_cast<const char *>(a[i].out_a.data) + hq * a[i].out_a.stride[0];
            r.ob = static_cast<const char *>(a[i].out_b.data) + hq * a[i].out_b.stride[0];
            r.la = static_cast<const char *>(a[i].lse_a.data) + hq * a[i].lse_a.stride[0];
            r.lb = static_cast<const char *>(a[i].lse_b.data) + hq * a[i].lse_b.stride[0];
            r.o = static_cast<char *>(a[i].out.data) + hq * a[i].out.stride[0];
            r.l = static_cast<char *>(a[i].lse.data) + hq * a[i].lse.stride[0];
            r.Dv = (int)a[i].out_a.shape[1];
            rows.push_back(r);
        }
    if (rows.empty())
        return 0;
    Upload up;
    size_t o = up.add(rows);
    Scratch sc(&call);
    unsigned char *dev = nullptr;
    if ((rc = upload(&call, sc, up, &dev, err)))
        return rc;
    merge_kernel<<<(unsigned)rows.size(), NT, 0, call.s>>>(reinterpret_cast<const MRow *>(dev + o));
    return kvd__cuda_launched(&call, "attention merge", err);
}

/* Raw tail of an INT/VQ item as a dense item (the same q, out, lse). */
int add_tail(std::vector<DItem> &ditems, const kvd_attn_dims &dm, const kvd_tensor &q, const kvd_tensor &kt,
             const kvd_tensor &vt, const OutDesc &o, long long *Tt)
{
    *Tt = kt.ndim == 3 ? kt.shape[1] : 0;
    if (*Tt == 0)
        return -1;
    ditems.push_back(ditem_of(dm, q, kt, vt, nullptr, o));
    return (int)ditems.size() - 1;
}

QSide qside_of(const kvd_attn_qdata &q)
{
    QSide s;
    s.codes = static_cast<const unsigned char *>(q.codes.data);
    s.cs0 = q.codes.stride[0];
    s.cs1 = q.codes.stride[1];
    s.mn = {static_cast<const char *>(q.min.data), q.min.stride[0], q.min.stride[1]};
    s.sc = {static_cast<const char *>(q.scale.data), q.scale.stride[0], q.scale.stride[1]};
    s.sum = {static_cast<const char *>(q.sum.data), q.sum.stride[0], q.sum.stride[1]};
    s.bits = q.bits;
    s.group = q.group;
    s.axis = q.axis;
    uintptr_t al = (uintptr_t)q.codes.data | (uintptr_t)q.codes.stride[0] | (uintptr_t)q.codes.stride[1];
    s.w4 = (al & 3) == 0;
    s.w16 = (al & 15) == 0;
    return s;
}

long long lcm_ll(long long a, long long b)
{
    long long x = a, y = b;
    while (y) {
        long long t = x % y;
        x = y;
        y = t;
    }
    return a / x * b;
}

int cuda_quant(kvd_backend *be, int n, const kvd_attn_int_args *a, kvd_error *err)
{
    for (int i = 0; i < n; i++)
        if (a[i].n_segments)
            return kvd_error_set(err, KVD_EUNSUPP,
                                 "INT attention item %d: segmented codes are a host-memory form "
                                 "(the CPU backend's)",
                                 i);
    kvd_cuda_call call;
    int rc = kvd__cuda_begin(be, &call, err);
    if (rc)
        return rc;
    std::vector<QItem> qitems;
    std::vector<DItem> ditems;
    std::vector<int> qidx(n, -1), didx(n, -1);
    std::vector<long long> tails(n, 0);
    long long work = 0;
    size_t smax = 0;
    for (int i = 0; i < n; i++) {
        const kvd_attn_int_args &x = a[i];
        OutDesc o = out_desc(x.out, x.lse);
        didx[i] = add_tail(ditems, x.dims, x.q, x.k_tail, x.v_tail, o, &tails[i]);
        work += (x.n_tokens + tails[i]) * x.dims.n_kv_heads;
        if (x.n_tokens == 0)
            continue;
        QItem qi;
        memset(&qi, 0, sizeof qi);
        qi.q = static_cast<const char *>(x.q.data);
        qi.qs = x.q.stride[0];
        qi.k = qside_of(x.k);
        qi.v = qside_of(x.v);
        qi.D = x.dims.head_dim;
        qi.Dv = x.dims.v_dim;
        qi.G = x.dims.n_q_heads / x.dims.n_kv_heads;
        qi.scale = x.dims.softmax_scale;
        qi.o = o;
        /* tile: whole groups of both axes that group along tokens */
        long long g = 32;
        if (x.k.axis == KVD_ATTN_AXIS_CHANNEL)
            g = lcm_ll(g, x.k.group);
        if (x.v.axis == KVD_ATTN_AXIS_CHANNEL)
            g = lcm_ll(g, x.v.group);
        long long tb = g >= 256 ? g : 256 / g * g;
        if (tb > 2048)
            return kvd_error_set(err, KVD_EUNSUPP, "cuda INT attention item %d: groups %d/%d need a %lld-token tile",
                                 i, x.k.group, x.v.group, tb);
        qi.tb = (int)tb;
        IntLayout L = int_layout(std::min(MAXGB, qi.G), qi.D, qi.Dv, qi.tb, qi.k.bits, qi.k.group, qi.k.axis,
                                 qi.v.group, qi.v.axis);
        smax = std::max(smax, L.total);
        qidx[i] = (int)qitems.size();
        qitems.push_back(qi);
    }
    /* the kernel fixed at compile time for what every item shares (100 x
     * keys per channel + 10 x bits + heads per unit: 24, 28, 44, 48, 124,
     * 128, 144, 148), else the general one (0) */
    int fix = -1;
    for (int i = 0; i < n && fix != 0; i++) {
        if (qidx[i] < 0)
            continue;
        const QItem &qi = qitems[qidx[i]];
        int gc = didx[i] >= 0 ? std::min(MAXGB, dense_gcap(ditems[didx[i]])) : MAXGB;
        int f = qi.k.bits == qi.v.bits && (qi.k.bits == 2 || qi.k.bits == 4) &&
                        qi.v.axis == KVD_ATTN_AXIS_CHANNEL && qi.D == 128 && qi.Dv == 128 &&
                        (qi.G == 4 || qi.G == 8) && gc >= qi.G
                    ? 100 * (qi.k.axis == KVD_ATTN_AXIS_CHANNEL) + 10 * qi.k.bits + qi.G
                    : 0;
        fix = fix < 0 || fix == f ? f : 0;
    }
    Plan pl;
    pl.chunk = plan_chunk(call.c, work);
    for (int i = 0; i < n; i++) {
        const kvd_attn_int_args &x = a[i];
        int G = x.dims.n_q_heads / x.dims.n_kv_heads, gc = MAXGB;
        if (didx[i] >= 0)
            gc = std::min(gc, dense_gcap(ditems[didx[i]]));
        Src src[2];
        int ns = 0;
        if (qidx[i] >= 0)
            src[ns++] = {0, qidx[i], x.n_tokens, qitems[qidx[i]].tb};
        if (didx[i] >= 0)
            src[ns++] = {1, didx[i], tails[i], DTILE};
        for (int h = 0; h < x.dims.n_kv_heads; h++)
            for (int g0 = 0; g0 < G; g0 += gc)
                plan_group(pl, src, ns, h, g0, std::min(gc, G - g0), G, out_desc(x.out, x.lse), x.dims.v_dim);
    }
    order_units(pl.units[0]);
    Upload up;
    size_t oq = up.add(qitems);
    auto launch0 = [&](unsigned char *dev, const Unit *du, const Parts &P) -> int {
        const unsigned nu = (unsigned)pl.units[0].size();
        const QItem *dq = reinterpret_cast<const QItem *>(dev + oq);
        int r = fix == 24    ? launch_int<2, 4, 128>(nu, smax, &call, dq, du, P, err)
                : fix == 28  ? launch_int<2, 8, 128>(nu, smax, &call, dq, du, P, err)
                : fix == 44  ? launch_int<4, 4, 128>(nu, smax, &call, dq, du, P, err)
                : fix == 48  ? launch_int<4, 8, 128>(nu, smax, &call, dq, du, P, err)
                : fix == 124 ? launch_int<12, 4, 128>(nu, smax, &call, dq, du, P, err)
                : fix == 128 ? launch_int<12, 8, 128>(nu, smax, &call, dq, du, P, err)
                : fix == 144 ? launch_int<14, 4, 128>(nu, smax, &call, dq, du, P, err)
                : fix == 148 ? launch_int<14, 8, 128>(nu, smax, &call, dq, du, P, err)
                             : launch_int<0, 0, 0>(nu, smax, &call, dq, du, P, err);
        if (r)
            return r;
        return kvd__cuda_launched(&call, "INT attention", err);
    };
    return run_plan(&call, pl, up, ditems, launch0, err);
}

int cuda_vq(kvd_backend *be, int n, const kvd_attn_vq_args *a, kvd_error *err)
{
    for (int i = 0; i < n; i++)
        if (a[i].n_segments)
            return kvd_error_set(err, KVD_EUNSUPP,
                                 "VQ attention item %d: segmented codes are a host-memory form "
                                 "(the CPU backend's)",
                                 i);
    kvd_cuda_call call;
    int rc = kvd__cuda_begin(be, &call, err);
    if (rc)
        return rc;
    std::vector<VItem> vitems;
    std::vector<DItem> ditems;
    std::vector<int> vidx(n, -1), didx(n, -1), gcap(n, MAXGB), ggcap(n, 0);
    std::vector<long long> tails(n, 0);
    long long work = 0;
    int gdv = -1; /* the gathered kernel's DV when every item takes it, else 0 */
    int gGB = 1;  /* and its heads per unit */
    size_t smax = 0, gsmax = 0, budget = call.c->smem_optin > 0 ? call.c->smem_optin : 48 * 1024;
    for (int i = 0; i < n; i++) {
        const kvd_attn_vq_args &x = a[i];
        OutDesc o = out_desc(x.out, x.lse);
        didx[i] = add_tail(ditems, x.dims, x.q, x.k_tail, x.v_tail, o, &tails[i]);
        work += (x.n_tokens + tails[i]) * x.dims.n_kv_heads;
        if (x.n_tokens == 0)
            continue;
        VItem v;
        memset(&v, 0, sizeof v);
        v.q = static_cast<const char *>(x.q.data);
        v.qs = x.q.stride[0];
        v.kc = static_cast<const char *>(x.k_codes.data);
        v.kcs0 = x.k_codes.stride[0];
        v.kcs1 = x.k_codes.stride[1];
        v.kcb = static_cast<const char *>(x.k_codebook.data);
        v.kcbs0 = x.k_codebook.stride[0];
        v.kcbs1 = x.k_codebook.stride[1];
        v.lam = static_cast<const char *>(x.k_lambda.data);
        v.lams0 = x.k_lambda.data ? x.k_lambda.stride[0] : 0;
        v.vc = static_cast<const char *>(x.v_codes.data);
        v.vcs0 = x.v_codes.stride[0];
        v.vcs1 = x.v_codes.stride[1];
        v.vcb = static_cast<const char *>(x.v_codebook.data);
        v.vcbs0 = x.v_codebook.stride[0];
        v.vcbs1 = x.v_codebook.stride[1];
        v.had = x.k_hadamard;
        v.dk = x.k_sub_dim;
        v.kK = 1 << x.k_bits;
        v.k16 = x.k_bits > 8;
        v.dv = x.v_sub_dim;
        v.vK = 1 << x.v_bits;
        v.v16 = x.v_bits > 8;
        v.D = x.dims.head_dim;
        v.Dv = x.dims.v_dim;
        v.G = x.dims.n_q_heads / x.dims.n_kv_heads;
        v.scale = x.dims.softmax_scale;
        v.o = o;
        v.kvec = !v.k16 && (v.D / v.dk) % 16 == 0 &&
                 (((uintptr_t)x.k_codes.data | (uintptr_t)x.k_codes.stride[0] | (uintptr_t)x.k_codes.stride[1]) & 15) == 0;
        if ((x.k_codebook.stride[1] & 3) || (x.v_codebook.stride[1] & 3))
            return kvd_error_set(err, KVD_EUNSUPP, "cuda VQ attention item %d: codebook rows not 4-byte aligned", i);
        /* heads per unit and what lives in shared memory: the gathered
         * form (score table, value codebook and codes) when it fits and the
         * codes take its 16-byte rows; else LUT and per-code accumulators
         * when they fit, with as many heads as fit */
        int kpos = v.D / v.dk, vpos = v.Dv / v.dv, best = 0;
        const int vrow16 = !v.v16 && vpos % 16 == 0 && vpos / 16 <= VQG_CH &&
                           (((uintptr_t)x.v_codes.data | (uintptr_t)x.v_codes.stride[0] |
                             (uintptr_t)x.v_codes.stride[1]) & 15) == 0;
        int ggb = 0;
        if (v.kvec && kpos / 16 <= VQG_CH && VNT % kpos == 0 && v.dk <= VQG_DK && vrow16 &&
            (v.dv == 4 || v.dv == 8) && VNT % vpos == 0)
            for (int gb = 4; gb >= 1 && !ggb; gb /= 2)
                if (vqg_layout(gb, v.D, v.Dv, kpos, v.kK, vpos, v.vK, v.dv).total <= budget)
                    ggb = gb;
        const int want = ggb ? v.dv : 0;
        gdv = gdv < 0 ? want : gdv == want ? gdv : 0;
        ggcap[i] = ggb;
        for (int mode = 3; mode >= 0 && !best; mode--) {
            int lut = mode & 2 ? 1 : 0, acc = mode & 1;
            for (int gb = std::min(MAXGB, v.G); gb >= 1; gb--)
                if (vq_layout(gb, v.D, v.Dv, kpos, v.kK, vpos, v.vK, lut, acc).total <= budget) {
                    /* LUT+A with one head at a time rereads the codes G times:
                     * prefer it only down to 2 heads per unit when G > 1 */
                    if (mode == 3 && gb < std::min(2, v.G))
                        break;
                    v.lut = lut;
                    v.acc = acc;
                    /* balanced head chunks: G = 4 at a cap of 3 runs 2 + 2 */
                    int nch = (v.G + gb - 1) / gb;
                    gcap[i] = (v.G + nch - 1) / nch;
                    best = 1;
                    break;
                }
        }
        if (!best)
            return kvd_error_set(err, KVD_EUNSUPP, "cuda VQ attention item %d: widths too large for shared memory", i);
        smax = std::max(smax, vq_layout(gcap[i], v.D, v.Dv, kpos, v.kK, vpos, v.vK, v.lut, v.acc).total);
        if (ggb) {
            int nch = (v.G + ggb - 1) / ggb;
            ggcap[i] = (v.G + nch - 1) / nch;
            while (ggb / 2 >= ggcap[i])
                ggb /= 2; /* heads the kernel computes: a power of two */
            gGB = std::max(gGB, ggb);
        }
        vidx[i] = (int)vitems.size();
        vitems.push_back(v);
    }
    if (gdv > 0) {
        for (int i = 0; i < n; i++)
            if (vidx[i] >= 0) {
                const VItem &v = vitems[vidx[i]];
                gsmax = std::max(gsmax, vqg_layout(gGB, v.D, v.Dv, v.D / v.dk, v.kK, v.Dv / v.dv, v.vK, v.dv).total);
            }
        if (gsmax > budget)
            gdv = 0;
    }
    if (gdv > 0)
        for (int i = 0; i < n; i++)
            if (vidx[i] >= 0) {
                gcap[i] = ggcap[i];
                vitems[vidx[i]].lut = 1;
                vitems[vidx[i]].acc = 0;
            }
    Plan pl;
    /* a VQ unit pays for its score table and the codebook pass: at least
     * 1024 tokens per split keep that under a quarter of its work */
    pl.chunk = plan_chunk(call.c, work, 1024);
    for (int i = 0; i < n; i++) {
        const kvd_attn_vq_args &x = a[i];
        int G = x.dims.n_q_heads / x.dims.n_kv_heads, gc = gcap[i];
        if (didx[i] >= 0)
            gc = std::min(gc, dense_gcap(ditems[didx[i]]));
        Src src[2];
        int ns = 0;
        if (vidx[i] >= 0)
            src[ns++] = {0, vidx[i], x.n_tokens, VTILE};
        if (didx[i] >= 0)
            src[ns++] = {1, didx[i], tails[i], DTILE};
        for (int h = 0; h < x.dims.n_kv_heads; h++)
            for (int g0 = 0; g0 < G; g0 += gc)
                plan_group(pl, src, ns, h, g0, std::min(gc, G - g0), G, out_desc(x.out, x.lse), x.dims.v_dim);
    }
    order_units(pl.units[0]);
    Upload up;
    size_t ov = up.add(vitems);
    auto launch0 = [&](unsigned char *dev, const Unit *du, const Parts &P) -> int {
        const unsigned nu = (unsigned)pl.units[0].size();
        const VItem *di = reinterpret_cast<const VItem *>(dev + ov);
        int r;
        if (gdv > 0) {
            const int v8 = gdv == 8;
            r = gGB == 4 ? (v8 ? launch_vqg<8, 4> : launch_vqg<4, 4>)(nu, gsmax, &call, di, du, P, err)
                : gGB == 2 ? (v8 ? launch_vqg<8, 2> : launch_vqg<4, 2>)(nu, gsmax, &call, di, du, P, err)
                           : (v8 ? launch_vqg<8, 1> : launch_vqg<4, 1>)(nu, gsmax, &call, di, du, P, err);
            if (r)
                return r;
        } else {
            if ((r = set_smem((const void *)vq_kernel, smax, &call, err)))
                return r;
            vq_kernel<<<nu, VNT, smax, call.s>>>(di, du, P);
        }
        return kvd__cuda_launched(&call, "VQ attention", err);
    };
    return run_plan(&call, pl, up, ditems, launch0, err);
}

/*
 * SVD: project the queries (one block per query head), attend over each
 * (item, kv head) block at its own widths with the dense kernels (one item
 * per head block, units longest first), rotate the outputs back. The
 * reduced outputs o' live in scratch; lse goes straight to the caller.
 * k_width / v_width are host arrays (per-model metadata).
 */
int cuda_svd(kvd_backend *be, int n, const kvd_attn_svd_args *a, kvd_error *err)
{
    for (int i = 0; i < n; i++)
        if (a[i].n_segments)
            return kvd_error_set(err, KVD_EUNSUPP,
                                 "SVD attention item %d: segmented blocks are a host-memory form "
                                 "(the CPU backend's)",
                                 i);
    kvd_cuda_call call;
    int rc = kvd__cuda_begin(be, &call, err);
    if (rc)
        return rc;
    size_t qrows = 0, Dmax = 1;
    for (int i = 0; i < n; i++) {
        qrows += (size_t)a[i].dims.n_q_heads;
        Dmax = std::max(Dmax, (size_t)std::max(a[i].dims.head_dim, a[i].dims.v_dim));
    }
    Scratch sc(&call);
    void *qp = nullptr;
    /* per query head: projected query (Dmax) and reduced output (Dmax) */
    if ((rc = sc.get(sizeof(float) * qrows * 2 * Dmax, &qp, err)))
        return rc;
    float *qbuf = static_cast<float *>(qp), *obuf = qbuf + qrows * Dmax;
    std::vector<SvdHead> proj, unproj;
    std::vector<DItem> ditems;
    long long work = 0;
    size_t row = 0;
    for (int i = 0; i < n; i++) {
        const kvd_attn_svd_args &x = a[i];
        const kvd_attn_dims &dm = x.dims;
        int G = dm.n_q_heads / dm.n_kv_heads, D = dm.head_dim, Dv = dm.v_dim;
        size_t es = kvd_dtype_size(x.dtype);
        long long ko = 0, vo = 0;
        for (int h = 0; h < dm.n_kv_heads; h++) {
            int rk = x.k_width[h], rv = x.v_width[h];
            for (int g = 0; g < G; g++) {
                int hq = h * G + g;
                SvdHead p;
                p.q = reinterpret_cast<const float *>(static_cast<const char *>(x.q.data) + (long long)hq * x.q.stride[0]);
                p.R = static_cast<const float *>(x.rk.data) + (size_t)h * D * D;
                p.y = qbuf + (row + hq) * Dmax;
                p.out = nullptr;
                p.D = D;
                p.w = rk;
                proj.push_back(p);
                SvdHead b;
                b.q = nullptr;
                b.R = static_cast<const float *>(x.rv.data) + (size_t)h * Dv * Dv;
                b.y = obuf + (row + hq) * Dmax;
                b.out = reinterpret_cast<float *>(static_cast<char *>(x.out.data) + (long long)hq * x.out.stride[0]);
                b.D = Dv;
                b.w = rv;
                unproj.push_back(b);
            }
            /* the head block as a one-head dense item (stride over heads 0) */
            DItem d;
            memset(&d, 0, sizeof d);
            d.q = reinterpret_cast<const char *>(qbuf + row * Dmax);
            d.qs = (long long)(Dmax * sizeof(float));
            d.k = static_cast<const char *>(x.k_red) + (size_t)(x.n_tokens * ko) * es;
            d.ks1 = (long long)(rk * es);
            d.v = static_cast<const char *>(x.v_red) + (size_t)(x.n_tokens * vo) * es;
            d.vs1 = (long long)(rv * es);
            d.kdt = d.vdt = x.dtype;
            d.D = rk;
            d.Dv = rv;
            d.G = G;
            d.scale = dm.softmax_scale;
            d.o.out = reinterpret_cast<char *>(obuf + row * Dmax);
            d.o.os = (long long)(Dmax * sizeof(float));
            d.o.lse = static_cast<char *>(x.lse.data);
            d.o.ls = x.lse.stride[0];
            ditems.push_back(d);
            work += x.n_tokens;
            ko += rk;
            vo += rv;
        }
        row += (size_t)dm.n_q_heads;
    }
    Plan pl;
    pl.chunk = plan_chunk(call.c, work);
    size_t di = 0;
    for (int i = 0; i < n; i++) {
        const kvd_attn_dims &dm = a[i].dims;
        int G = dm.n_q_heads / dm.n_kv_heads;
        for (int h = 0; h < dm.n_kv_heads; h++, di++) {
            const DItem &d = ditems[di];
            int gc = dense_gcap(d);
            Src s = {1, (int)di, a[i].n_tokens, DTILE};
            for (int g0 = 0; g0 < G; g0 += gc)
                plan_group(pl, &s, 1, h, g0, std::min(gc, G - g0), G, d.o, d.Dv);
        }
    }
    Upload up;
    size_t op = up.add(proj), ou = up.add(unproj);
    unsigned char *dev = nullptr;
    if ((rc = upload(&call, sc, up, &dev, err)))
        return rc;
    if (!proj.empty()) {
        svd_project_kernel<<<(unsigned)proj.size(), NT, 0, call.s>>>(reinterpret_cast<const SvdHead *>(dev + op));
        if ((rc = kvd__cuda_launched(&call, "SVD query projection", err)))
            return rc;
    }
    Upload up2;
    if ((rc = run_plan(&call, pl, up2, ditems, no_launch, err)))
        return rc;
    if (!unproj.empty()) {
        svd_unproject_kernel<<<(unsigned)unproj.size(), NT, 0, call.s>>>(reinterpret_cast<const SvdHead *>(dev + ou));
        if ((rc = kvd__cuda_launched(&call, "SVD output rotation", err)))
            return rc;
    }
    return 0;
}

} /* namespace */

const struct kvd_attn_ops kvd__cuda_attn_ops = {
    cuda_dense, cuda_sparse, cuda_quant, cuda_vq, cuda_svd, cuda_merge,
};
