/*
 * Homomorphic decode attention on INT2/INT4 blocks (HACK Eq. 4), see
 * kvdepot/attention.h for the equations and layouts.
 *
 * Fast path (AVX2): everything is computed "vertically" so no horizontal
 * reduction is needed per token or per channel.
 *
 *  scores  A tile of 8 tokens is transposed so that 32-bit lane i holds 4
 *          code bytes of token i. A code byte packs 8/bits values; shifting
 *          and masking gives one "plane" per value slot (plane k holds the
 *          values j = 4*byte*per + k ...). The int8 query is pre-arranged in
 *          the same plane order and broadcast, so _mm256_maddubs_epi16 of a
 *          plane with the query pattern, summed over planes and columns of a
 *          group, leaves lane i = sum_{j in group} q8_j c_ij. The float
 *          correction (scale, min, query sums) then runs on 8 tokens at once.
 *  values  (channel axis) The same trick with lanes = 8 channels: the uint8
 *          probabilities of a group of P tokens are the broadcast operand and
 *          the code planes of 8 channels the other; lane d ends up with
 *          sum_t p8_t c_dt, corrected with the stored code sums.
 *
 * Integer ranges: |q8| <= 127 and codes <= 3 (INT2) / 15 (INT4), so a
 * maddubs pair is <= 762 / 3810 and the int16 partial sums below are flushed
 * to int32 before they could pass 32767 (INT2: 8 columns = 24384, INT4: 4
 * columns = 30480; values: p8 <= 255, INT2 4 columns = 24480, INT4 2 = 30600).
 */
#include <float.h>
#include <immintrin.h>
#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "common/cpu_internal.h"
#include "kvdepot/attention.h"

static inline int code_at(const uint8_t *row, int64_t j, int bits)
{
    int per = 8 / bits;
    return (row[j / per] >> ((j % per) * bits)) & ((1 << bits) - 1);
}

static inline const uint8_t *qrow(const kvd_tensor *t, int64_t h, int64_t r)
{
    return (const uint8_t *)t->data + h * t->stride[0] + r * t->stride[1];
}

static inline float f16_at(const kvd_tensor *t, int64_t h, int64_t r, int64_t g)
{
    uint16_t x;
    memcpy(&x, (const char *)t->data + h * t->stride[0] + r * t->stride[1] + g * 2, 2);
    return kvd_f16_to_f32(x);
}

static inline uint16_t u16_at(const kvd_tensor *t, int64_t h, int64_t r, int64_t g)
{
    uint16_t x;
    memcpy(&x, (const char *)t->data + h * t->stride[0] + r * t->stride[1] + g * 2, 2);
    return x;
}

static inline float tail_elem(const kvd_tensor *x, int64_t h, int64_t t, int64_t j)
{
    const char *p = (const char *)x->data + h * x->stride[0] + t * x->stride[1];
    return kvd__load_float(p + j * (int64_t)kvd_dtype_size(x->dtype), x->dtype);
}

/* Quantize the probabilities of one group (uint8, asymmetric); shared by the
 * reference and the fast path so both round the same numbers the same way. */
static inline void quantize_p8(const float *p, int n, uint8_t *p8, float *mP, float *sP, int *sum8)
{
    float lo = p[0], hi = p[0];
    for (int i = 1; i < n; i++) {
        lo = p[i] < lo ? p[i] : lo;
        hi = p[i] > hi ? p[i] : hi;
    }
    /* A step below FLT_MIN (every p within ~3e-36 of lo) would overflow
     * 1/s to inf and (p - lo) * inf to NaN: such a group is coded as lo. */
    float s = (hi - lo) / 255.0f, inv = s >= FLT_MIN ? 1.0f / s : 0.0f;
    int sum = 0;
    for (int i = 0; i < n; i++) {
        float v = rintf((p[i] - lo) * inv);
        v = v < 0.0f ? 0.0f : v > 255.0f ? 255.0f : v;
        p8[i] = (uint8_t)v;
        sum += p8[i];
    }
    *mP = lo;
    *sP = s;
    *sum8 = sum;
}

/* ---------------------------------------------------------------------- */
/* Reference                                                              */
/* ---------------------------------------------------------------------- */

/* Per-group query weights of channel-grouped keys (KIVI-style: one min and
 * scale per channel and group of P tokens). For token group gi and query q,
 *     q.k_t = sum_d q_d min_{d,gi} + sum_d (q_d scale_{d,gi}) c_{d,t}
 * so the query folded with the group's scales, w_d = q_d * scale_{d,gi}
 * (f32 product), is what gets quantized to int8 (kvd_attn_quantize_q8: s_w,
 * w8) and the integer dot products run over the channel axis:
 *     q.k_t ~ bias_gi + s_w * sum_d w8_d c_{d,t},  bias_gi = sum_d q_d min_{d,gi}.
 * Returns s_w; w (D floats) is scratch. The fast path calls it too, so both
 * round w identically. */
static float kchan_weights(const kvd_attn_int_args *a, int h, int64_t gi, const float *q, float *w,
                           int8_t *w8, double *bias)
{
    int D = a->dims.head_dim;
    double b = 0.0;
    for (int d = 0; d < D; d++) {
        w[d] = q[d] * f16_at(&a->k.scale, h, d, gi);
        b += (double)q[d] * f16_at(&a->k.min, h, d, gi);
    }
    *bias = b;
    return kvd_attn_quantize_q8(w, D, w8);
}

/* Reference scores of every quantized token from channel-grouped keys. */
static void kchan_scores_ref(const kvd_attn_int_args *a, int h, const float *q, double *s, float *w,
                             int8_t *w8)
{
    int D = a->dims.head_dim, P = a->k.group;
    for (int64_t gi = 0; gi < a->n_tokens / P; gi++) {
        double bias;
        double sw = kchan_weights(a, h, gi, q, w, w8, &bias);
        for (int64_t t = gi * P; t < (gi + 1) * P; t++) {
            long ic = 0;
            for (int d = 0; d < D; d++)
                ic += (long)w8[d] * code_at(qrow(&a->k.codes, h, d), t, a->k.bits);
            s[t] = (bias + sw * (double)ic) * a->dims.softmax_scale;
        }
    }
}

/* The reference over segments: each segment, then the tail, as a call of
 * its own, their results merged by log-sum-exp in order (the attention over
 * their union). */
static int int_ref_segments(const kvd_attn_int_args *a)
{
    const int64_t Hq = a->dims.n_q_heads, Dv = a->dims.v_dim;
    float *po = malloc(sizeof(float) * (size_t)(Hq * Dv + Hq) + 4), *pl = po + Hq * Dv;
    if (!po)
        return KVD_ENOMEM;
    int64_t os[2] = {Hq, Dv}, ls[1] = {Hq};
    const kvd_tensor to = kvd_tensor_make(KVD_DTYPE_F32, po, 2, os),
                     tl = kvd_tensor_make(KVD_DTYPE_F32, pl, 1, ls);
    int rc = 0;
    for (int i = 0; i <= a->n_segments && rc == 0; i++) {
        kvd_attn_int_args s = *a;
        s.n_segments = 0;
        s.segments = NULL;
        if (i < a->n_segments) { /* the tail goes with the last part */
            s.n_tokens = a->segments[i].n_tokens;
            s.k = a->segments[i].k;
            s.v = a->segments[i].v;
            s.k_tail.ndim = s.v_tail.ndim = 0;
        } else {
            s.n_tokens = 0;
        }
        if (i > 0) {
            s.out = to;
            s.lse = tl;
        }
        rc = kvd_cpu_attn_int_ref(&s);
        if (rc == 0 && i > 0) {
            kvd_attn_merge_args m = {a->out, a->lse, to, tl, a->out, a->lse};
            rc = kvd_cpu_attn_merge_ref(&m);
        }
    }
    free(po);
    return rc;
}

int kvd_cpu_attn_int_ref(const kvd_attn_int_args *a)
{
    if (a->n_segments)
        return int_ref_segments(a);
    const kvd_attn_dims *d = &a->dims;
    int G = d->n_q_heads / d->n_kv_heads, D = d->head_dim, Dv = d->v_dim;
    int64_t T = a->n_tokens, Tt = a->k_tail.ndim == 3 ? a->k_tail.shape[1] : 0, N = T + Tt;
    double *s = malloc(sizeof(double) * (size_t)(N + 1));
    float *p = malloc(sizeof(float) * (size_t)(N + 1));
    int8_t *q8 = malloc((size_t)D + 1);
    uint8_t *p8 = malloc((size_t)(a->v.group > 0 ? a->v.group : 1));
    double *acc = malloc(sizeof(double) * ((size_t)Dv + 1));
    float *wbuf = malloc(sizeof(float) * ((size_t)D + 1));
    if (!s || !p || !q8 || !p8 || !acc || !wbuf) {
        free(s), free(p), free(q8), free(p8), free(acc), free(wbuf);
        return KVD_ENOMEM;
    }
    for (int h = 0; h < d->n_kv_heads; h++)
        for (int g = 0; g < G; g++) {
            int hq = h * G + g;
            const float *qr = (const float *)((const char *)a->q.data + hq * a->q.stride[0]);
            float *out = (float *)((char *)a->out.data + hq * a->out.stride[0]);
            float *lse = (float *)((char *)a->lse.data + hq * a->lse.stride[0]);
            double sq = kvd_attn_quantize_q8(qr, D, q8);
            /* scores: s_q * sum_g (scale_g sum q8 c + min_g sum q8) */
            for (int64_t t = 0; a->k.axis == KVD_ATTN_AXIS_TOKEN && t < T; t++) {
                const uint8_t *cr = qrow(&a->k.codes, h, t);
                double dot = 0.0;
                for (int grp = 0; grp < D / a->k.group; grp++) {
                    long ic = 0, iq = 0;
                    for (int j = grp * a->k.group; j < (grp + 1) * a->k.group; j++) {
                        ic += (long)q8[j] * code_at(cr, j, a->k.bits);
                        iq += q8[j];
                    }
                    dot += (double)f16_at(&a->k.scale, h, t, grp) * (double)ic +
                           (double)f16_at(&a->k.min, h, t, grp) * (double)iq;
                }
                s[t] = sq * dot * d->softmax_scale;
            }
            if (a->k.axis == KVD_ATTN_AXIS_CHANNEL)
                kchan_scores_ref(a, h, qr, s, wbuf, q8);
            for (int64_t t = 0; t < Tt; t++) {
                double dot = 0.0;
                for (int j = 0; j < D; j++)
                    dot += (double)qr[j] * tail_elem(&a->k_tail, h, t, j);
                s[T + t] = dot * d->softmax_scale;
            }
            double m = -INFINITY;
            int nan = 0;
            for (int64_t t = 0; t < N; t++) {
                nan |= s[t] != s[t];
                if (s[t] > m)
                    m = s[t];
            }
            if (nan || m == -INFINITY) {
                *lse = nan ? NAN : -INFINITY;
                for (int j = 0; j < Dv; j++)
                    out[j] = nan ? NAN : 0.0f;
                continue;
            }
            double l = 0.0;
            for (int64_t t = 0; t < N; t++) {
                p[t] = (float)exp(s[t] - m);
                l += p[t];
            }
            memset(acc, 0, sizeof(double) * (size_t)Dv);
            if (a->v.axis == KVD_ATTN_AXIS_CHANNEL) {
                int P = a->v.group;
                for (int64_t t0 = 0; t0 < T; t0 += P) {
                    float mP, sP;
                    int sum8;
                    quantize_p8(p + t0, P, p8, &mP, &sP, &sum8);
                    int64_t grp = t0 / P;
                    for (int dd = 0; dd < Dv; dd++) {
                        const uint8_t *cr = qrow(&a->v.codes, h, dd);
                        long ic = 0;
                        for (int i = 0; i < P; i++)
                            ic += (long)p8[i] * code_at(cr, t0 + i, a->v.bits);
                        double sc = f16_at(&a->v.scale, h, dd, grp), mn = f16_at(&a->v.min, h, dd, grp);
                        double cs = u16_at(&a->v.sum, h, dd, grp);
                        /* Eq. 4 with A = P (sP, mP) and B = V (scale, min), Z = P */
                        acc[dd] += (double)sP * sc * (double)ic + (double)mP * sc * cs +
                                   (double)sP * mn * (double)sum8 + (double)P * mP * mn;
                    }
                }
            } else {
                for (int64_t t = 0; t < T; t++) {
                    const uint8_t *cr = qrow(&a->v.codes, h, t);
                    for (int dd = 0; dd < Dv; dd++) {
                        int grp = dd / a->v.group;
                        acc[dd] += (double)p[t] * ((double)f16_at(&a->v.scale, h, t, grp) *
                                                       code_at(cr, dd, a->v.bits) +
                                                   (double)f16_at(&a->v.min, h, t, grp));
                    }
                }
            }
            for (int64_t t = 0; t < Tt; t++)
                for (int dd = 0; dd < Dv; dd++)
                    acc[dd] += (double)p[T + t] * tail_elem(&a->v_tail, h, t, dd);
            for (int dd = 0; dd < Dv; dd++)
                out[dd] = (float)(acc[dd] / l);
            *lse = (float)(m + log(l));
        }
    free(s), free(p), free(q8), free(p8), free(acc), free(wbuf);
    return 0;
}

/* ---------------------------------------------------------------------- */
/* Fast path                                                              */
/* ---------------------------------------------------------------------- */

typedef struct int_ctx {
    const kvd_attn_int_args *a;
    int h, G, D, Dv, simd, vnni;
    /* AVX-512 VNNI paths (vnni512): token-axis key scores 16 tokens a step,
     * channel-axis values in 16-channel tiles */
    int v512;
    int kch512; /* channel-axis key scores with 512-bit vpdpbusd (vnni512, VBMI) */
    /* the next segment of a run (its first block is asked for ahead of
     * time while the last block of this one is computed), or NULL */
    const kvd_attn_int_args *next;
    int kbits, kper, kP, kng, kcols; /* kcols: 32-bit code columns per K row */
    float *sq;                       /* (G) s_q * softmax_scale */
    int8_t *q8;                      /* (G, D) */
    float *qsum;                     /* (G, kng) sum of q8 per group */
    int32_t *qpat;                   /* (G, kcols, kper) plane-ordered q8 patterns */
    __m256i *qpatv;                  /* the same, each broadcast to 8 lanes (AVX2 path) */
    __m256i *vpatv;                  /* (block groups, G, cols, per) P patterns, broadcast */
    float *ktmp;                     /* (2 * kng * 8) scales/mins of a tile */
    /* channel-grouped keys: per token group of the current block and query
     * head, the int8 weights (interleaved by channel pairs as int16 so one
     * broadcast feeds maddubs), their scale and the bias (kchan_weights) */
    float *wtmp;                     /* (8, G, D) scratch */
    int8_t *kw8;                     /* (KVD__ATTN_BLOCK / kP, G, D) */
    float *ksw, *kbias;              /* (KVD__ATTN_BLOCK / kP, G) */
} int_ctx;

/* Pattern of column c, plane k: byte b holds q8[(4c + b) * per + k]. */
static void build_patterns_i8(const int8_t *x, int cols, int bits, int32_t *pat)
{
    int per = 8 / bits;
    for (int c = 0; c < cols; c++)
        for (int k = 0; k < per; k++) {
            uint32_t w = 0;
            for (int b = 0; b < 4; b++)
                w |= (uint32_t)(uint8_t)x[(4 * c + b) * per + k] << (8 * b);
            pat[c * per + k] = (int32_t)w;
        }
}


/* Scalar scores of tokens [t0, t0+n) into s (row g at s + g*ld). */
static void int_scores_scalar(const int_ctx *c, int64_t t0, int n, float *s, int ld)
{
    const kvd_attn_int_args *a = c->a;
    for (int i = 0; i < n; i++) {
        int64_t t = t0 + i;
        const uint8_t *cr = qrow(&a->k.codes, c->h, t);
        for (int g = 0; g < c->G; g++) {
            const int8_t *q8 = c->q8 + (size_t)g * c->D;
            float dot = 0.0f;
            for (int grp = 0; grp < c->kng; grp++) {
                int ic = 0;
                for (int j = grp * c->kP; j < (grp + 1) * c->kP; j++)
                    ic += q8[j] * code_at(cr, j, c->kbits);
                dot += f16_at(&a->k.scale, c->h, t, grp) * (float)ic +
                       f16_at(&a->k.min, c->h, t, grp) * c->qsum[g * c->kng + grp];
            }
            s[(size_t)g * ld + i] = dot * c->sq[g];
        }
    }
}

__attribute__((target("avx2"))) static inline void transpose8x8(__m256i *r)
{
    __m256i t0 = _mm256_unpacklo_epi32(r[0], r[1]), t1 = _mm256_unpackhi_epi32(r[0], r[1]);
    __m256i t2 = _mm256_unpacklo_epi32(r[2], r[3]), t3 = _mm256_unpackhi_epi32(r[2], r[3]);
    __m256i t4 = _mm256_unpacklo_epi32(r[4], r[5]), t5 = _mm256_unpackhi_epi32(r[4], r[5]);
    __m256i t6 = _mm256_unpacklo_epi32(r[6], r[7]), t7 = _mm256_unpackhi_epi32(r[6], r[7]);
    __m256i u0 = _mm256_unpacklo_epi64(t0, t2), u1 = _mm256_unpackhi_epi64(t0, t2);
    __m256i u2 = _mm256_unpacklo_epi64(t1, t3), u3 = _mm256_unpackhi_epi64(t1, t3);
    __m256i u4 = _mm256_unpacklo_epi64(t4, t6), u5 = _mm256_unpackhi_epi64(t4, t6);
    __m256i u6 = _mm256_unpacklo_epi64(t5, t7), u7 = _mm256_unpackhi_epi64(t5, t7);
    r[0] = _mm256_permute2x128_si256(u0, u4, 0x20);
    r[1] = _mm256_permute2x128_si256(u1, u5, 0x20);
    r[2] = _mm256_permute2x128_si256(u2, u6, 0x20);
    r[3] = _mm256_permute2x128_si256(u3, u7, 0x20);
    r[4] = _mm256_permute2x128_si256(u0, u4, 0x31);
    r[5] = _mm256_permute2x128_si256(u1, u5, 0x31);
    r[6] = _mm256_permute2x128_si256(u2, u6, 0x31);
    r[7] = _mm256_permute2x128_si256(u3, u7, 0x31);
}

#define KVD__INT_MAXCOLS 128

/* acc += per-32-bit-lane sum of 4 products u8 x i8 (vpdpbusd: exact, no
 * saturation, so the same sums as maddubs + madd where those cannot
 * saturate). FORM 1: AVX-VNNI's VEX encoding; FORM 2: AVX512-VNNI's EVEX
 * encoding of the same 256-bit instruction (with AVX512VL: Zen 4, Ice Lake
 * and later Xeons, which lack AVX-VNNI). Emitted with inline assembly so
 * this file needs no VNNI target attribute; only called when the CPU
 * reports the form (vnni_form). */
__attribute__((target("avx2"), always_inline)) static inline __m256i
dpbusd(__m256i acc, __m256i u8, __m256i i8, const int FORM)
{
    if (FORM == 2)
        __asm__("%{evex%} vpdpbusd %2, %1, %0" : "+x"(acc) : "x"(u8), "x"(i8));
    else
        __asm__("%{vex%} vpdpbusd %2, %1, %0" : "+x"(acc) : "x"(u8), "x"(i8));
    return acc;
} /* D * bits / 32 <= 128: D <= 2048 (INT2) / 1024 (INT4) */

/* 8 consecutive f16 at p as f32 */
__attribute__((target("avx2,fma,f16c"))) static inline __m256 f16x8(const void *p)
{
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
}

/* The u16 at p, p + st, ..., p + 7 st, in one vector (assembled in
 * registers: eight word stores and a vector reload would stall store
 * forwarding). */
__attribute__((target("avx2,fma,f16c"))) static inline __m128i gather8_u16(const char *p,
                                                                           int64_t st)
{
    uint16_t x[8];
    _Pragma("GCC unroll 8") for (int r = 0; r < 8; r++) memcpy(&x[r], p + r * st, 2);
    return _mm_setr_epi16((short)x[0], (short)x[1], (short)x[2], (short)x[3], (short)x[4],
                          (short)x[5], (short)x[6], (short)x[7]);
}

/* Scales (or mins) of 8 consecutive tokens, group grp, as one vector. When
 * a token row holds 1 or 2 groups and rows are contiguous, these are 8 or 16
 * consecutive f16 (deinterleaved for 2). */
__attribute__((target("avx2,fma,f16c"))) static inline __m256 params8(const kvd_tensor *t, int64_t h,
                                                                      int64_t t0, int grp, int ng)
{
    const char *base = (const char *)t->data + h * t->stride[0] + t0 * t->stride[1];
    if (ng == 1 && t->stride[1] == 2)
        return f16x8(base);
    if (ng == 2 && t->stride[1] == 4) {
        __m256 a = f16x8(base), b = f16x8(base + 16);
        /* a = [t0g0 t0g1 t1g0 t1g1 | t2.. t3..], b likewise for t4..t7 */
        __m256 e = grp ? _mm256_shuffle_ps(a, b, _MM_SHUFFLE(3, 1, 3, 1)) : _mm256_shuffle_ps(a, b, _MM_SHUFFLE(2, 0, 2, 0));
        return _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(e), _MM_SHUFFLE(3, 1, 2, 0)));
    }
    return _mm256_cvtph_ps(gather8_u16(base + grp * 2, t->stride[1]));
}

/* Eight rows of nw consecutive u16 (rows `stride` bytes apart, nw = 2, 4 or
 * 8), transposed: lane r of out[j] is element j of row r (j < nw). Reads
 * exactly nw elements per row. Used for the f16 parameters of 8 tokens (K)
 * or 8 channels (V): one vector per group instead of 8 scalar loads. */
__attribute__((target("avx2,fma,f16c"), always_inline)) static inline void
load_t8_u16(const char *base, int64_t stride, int nw, __m128i out[8])
{
    __m128i r[8];
    for (int i = 0; i < 8; i++) {
        const char *p = base + i * stride;
        if (nw == 8)
            r[i] = _mm_loadu_si128((const __m128i *)p);
        else if (nw == 4)
            r[i] = _mm_loadl_epi64((const __m128i *)p);
        else {
            int32_t x;
            memcpy(&x, p, 4);
            r[i] = _mm_cvtsi32_si128(x);
        }
    }
    __m128i a0 = _mm_unpacklo_epi16(r[0], r[1]), a1 = _mm_unpacklo_epi16(r[2], r[3]);
    __m128i a2 = _mm_unpacklo_epi16(r[4], r[5]), a3 = _mm_unpacklo_epi16(r[6], r[7]);
    __m128i b0 = _mm_unpacklo_epi32(a0, a1), b1 = _mm_unpackhi_epi32(a0, a1);
    __m128i b2 = _mm_unpacklo_epi32(a2, a3), b3 = _mm_unpackhi_epi32(a2, a3);
    out[0] = _mm_unpacklo_epi64(b0, b2);
    out[1] = _mm_unpackhi_epi64(b0, b2);
    out[2] = _mm_unpacklo_epi64(b1, b3);
    out[3] = _mm_unpackhi_epi64(b1, b3);
    if (nw == 8) {
        __m128i c0 = _mm_unpackhi_epi16(r[0], r[1]), c1 = _mm_unpackhi_epi16(r[2], r[3]);
        __m128i c2 = _mm_unpackhi_epi16(r[4], r[5]), c3 = _mm_unpackhi_epi16(r[6], r[7]);
        __m128i d0 = _mm_unpacklo_epi32(c0, c1), d1 = _mm_unpackhi_epi32(c0, c1);
        __m128i d2 = _mm_unpacklo_epi32(c2, c3), d3 = _mm_unpackhi_epi32(c2, c3);
        out[4] = _mm_unpacklo_epi64(d0, d2);
        out[5] = _mm_unpackhi_epi64(d0, d2);
        out[6] = _mm_unpacklo_epi64(d1, d3);
        out[7] = _mm_unpackhi_epi64(d1, d3);
    }
}

#define INT512_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")))
#define KCH512_TARGET                                                                              \
    __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi,avx2,fma,f16c")))
/* Two 8-lane halves as one 16-lane vector. */
#define CAT512I(lo, hi) _mm512_inserti64x4(_mm512_castsi256_si512(lo), (hi), 1)
#define CAT512F(lo, hi)                                                                            \
    _mm512_castpd_ps(                                                                              \
        _mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(lo)), _mm256_castps_pd(hi), 1))

/* Ask for the K code and parameter lines of tokens t + KVD__K_AHEAD ..
 * t + KVD__K_AHEAD + ntok - 1 (rows stored one after the other), a step of
 * the score loops at a time: a whole block asked for at once, at its start,
 * left the loads of the codes waiting on memory. */
#define KVD__K_AHEAD 128
static inline void prefetch_k_ahead(const int_ctx *c, int64_t t, int ntok)
{
    const kvd_attn_qdata *k = &c->a->k;
    int64_t r = t + KVD__K_AHEAD;
    if (r + ntok > k->codes.shape[1]) { /* past this segment: the next one's */
        if (!c->next || r < k->codes.shape[1])
            return;
        r -= k->codes.shape[1];
        k = &c->next->k;
        if (r + ntok > k->codes.shape[1])
            return;
    }
    const int64_t cb = k->codes.shape[2];
    if (k->codes.stride[1] == cb) {
        const char *p = (const char *)qrow(&k->codes, c->h, r);
        for (int64_t o = 0; o < ntok * cb; o += 64)
            __builtin_prefetch(p + o);
    }
    const kvd_tensor *pt[2] = {&k->scale, &k->min};
    for (int j = 0; j < 2; j++)
        if (pt[j]->stride[1] == 2 * pt[j]->shape[2]) {
            const char *p =
                (const char *)pt[j]->data + c->h * pt[j]->stride[0] + r * pt[j]->stride[1];
            for (int64_t o = 0; o < ntok * pt[j]->stride[1]; o += 64)
                __builtin_prefetch(p + o);
        }
}

/* The code columns of K rows t .. t + 7, transposed: X[col] lane r = dword
 * col of row t + r. */
__attribute__((target("avx2,fma,f16c"), always_inline)) static inline void
load_k8(const int_ctx *c, int64_t t, __m256i *X)
{
    const kvd_attn_int_args *a = c->a;
    const int cols = c->kcols;
    for (int c0 = 0; c0 < cols; c0 += 8) {
        if (cols - c0 >= 8) {
            for (int r = 0; r < 8; r++)
                X[c0 + r] =
                    _mm256_loadu_si256((const __m256i *)(qrow(&a->k.codes, c->h, t + r) + 4 * c0));
            transpose8x8(X + c0);
        } else {
            int32_t tmp[8][8];
            for (int cc = c0; cc < cols; cc++)
                for (int r = 0; r < 8; r++)
                    memcpy(&tmp[cc - c0][r], qrow(&a->k.codes, c->h, t + r) + 4 * cc, 4);
            for (int cc = c0; cc < cols; cc++)
                X[cc] = _mm256_loadu_si256((const __m256i *)tmp[cc - c0]);
        }
    }
}

/* Whether a block's key parameters are read as load_t8_u16 transposes
 * (else params8). */
static inline int kparams_t8(const int_ctx *c)
{
    const int ng = c->kng;
    return ng == 4 || ng == 8 || (ng == 2 && c->a->k.scale.stride[1] != 4);
}

/*
 * Scores of a block, BITS a compile-time constant. cols 32-bit code columns
 * per row, cpg per group.
 */
__attribute__((target("avx2,fma,f16c"), always_inline)) static inline void
int_scores_tpl(const int_ctx *c, int64_t t0, int n, float *s, int ld, const int BITS, const int VNNI)
{
    const kvd_attn_int_args *a = c->a;
    const int PER = 8 / BITS, FLUSH = BITS == 2 ? 8 : 4;
    int cols = c->kcols, ng = c->kng, cpg = cols / ng;
    const __m256i mask = _mm256_set1_epi8((char)((1 << BITS) - 1)), ones = _mm256_set1_epi16(1);
    __m256i X[KVD__INT_MAXCOLS];
    __m256i PL[KVD__INT_MAXCOLS][PER];
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        int64_t t = t0 + i;
        prefetch_k_ahead(c, t, 8);
        load_k8(c, t, X);
        for (int cc = 0; cc < cols; cc++)
            _Pragma("GCC unroll 4") for (int pl = 0; pl < PER; pl++)
                PL[cc][pl] = _mm256_and_si256(_mm256_srli_epi16(X[cc], pl * BITS), mask);
        __m256 sc[8], mn[8]; /* ng <= 8 on this path */
        if (kparams_t8(c)) {
            __m128i ts[8], tm[8];
            load_t8_u16((const char *)a->k.scale.data + c->h * a->k.scale.stride[0] + t * a->k.scale.stride[1],
                        a->k.scale.stride[1], ng, ts);
            load_t8_u16((const char *)a->k.min.data + c->h * a->k.min.stride[0] + t * a->k.min.stride[1],
                        a->k.min.stride[1], ng, tm);
            for (int grp = 0; grp < ng; grp++) {
                sc[grp] = _mm256_cvtph_ps(ts[grp]);
                mn[grp] = _mm256_cvtph_ps(tm[grp]);
            }
        } else
            for (int grp = 0; grp < ng; grp++) {
                sc[grp] = params8(&a->k.scale, c->h, t, grp, ng);
                mn[grp] = params8(&a->k.min, c->h, t, grp, ng);
            }
        for (int g = 0; g < c->G; g++) {
            const __m256i *patv = c->qpatv + (size_t)g * cols * PER;
            __m256 dot = _mm256_setzero_ps();
            for (int grp = 0; grp < ng; grp++) {
                __m256i acc32 = _mm256_setzero_si256(), acc16 = _mm256_setzero_si256();
                if (VNNI) {
                    /* one accumulator per plane: independent dependency chains */
                    __m256i ap[PER];
                    _Pragma("GCC unroll 4") for (int pl = 0; pl < PER; pl++)
                        ap[pl] = _mm256_setzero_si256();
                    for (int cc = grp * cpg; cc < (grp + 1) * cpg; cc++)
                        _Pragma("GCC unroll 4") for (int pl = 0; pl < PER; pl++) ap[pl] =
                            dpbusd(ap[pl], PL[cc][pl], patv[cc * PER + pl], VNNI);
                    _Pragma("GCC unroll 4") for (int pl = 0; pl < PER; pl++)
                        acc32 = _mm256_add_epi32(acc32, ap[pl]);
                }
                for (int cc = grp * cpg, k = 0; !VNNI && cc < (grp + 1) * cpg; cc++) {
                    _Pragma("GCC unroll 4") for (int pl = 0; pl < PER; pl++)
                        acc16 = _mm256_add_epi16(
                            acc16, _mm256_maddubs_epi16(PL[cc][pl], patv[cc * PER + pl]));
                    if (++k == FLUSH) {
                        acc32 = _mm256_add_epi32(acc32, _mm256_madd_epi16(acc16, ones));
                        acc16 = _mm256_setzero_si256();
                        k = 0;
                    }
                }
                acc32 = _mm256_add_epi32(acc32, _mm256_madd_epi16(acc16, ones));
                dot = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc32), sc[grp], dot);
                dot = _mm256_fmadd_ps(_mm256_set1_ps(c->qsum[g * ng + grp]), mn[grp], dot);
            }
            _mm256_storeu_ps(s + (size_t)g * ld + i, _mm256_mul_ps(dot, _mm256_set1_ps(c->sq[g])));
        }
    }
    if (i < n) {
        float tmp[KVD__ATTN_MAXG * 8];
        int_scores_scalar(c, t0 + i, n - i, tmp, 8);
        for (int g = 0; g < c->G; g++)
            for (int r = 0; r < n - i; r++)
                s[(size_t)g * ld + i + r] = tmp[g * 8 + r];
    }
}

__attribute__((target("avx2,fma,f16c"))) static void int_scores_avx2(void *vctx, int64_t t0, int n,
                                                                     float *s, int ld)
{
    const int_ctx *c = vctx;
    if (c->vnni == 2) {
        if (c->kbits == 2)
            int_scores_tpl(c, t0, n, s, ld, 2, 2);
        else
            int_scores_tpl(c, t0, n, s, ld, 4, 2);
    } else if (c->vnni) {
        if (c->kbits == 2)
            int_scores_tpl(c, t0, n, s, ld, 2, 1);
        else
            int_scores_tpl(c, t0, n, s, ld, 4, 1);
    } else if (c->kbits == 2)
        int_scores_tpl(c, t0, n, s, ld, 2, 0);
    else
        int_scores_tpl(c, t0, n, s, ld, 4, 0);
}

/* Query weights of every key group of the block [t0, t0+n). */
static void kchan_block_weights(const int_ctx *c, int64_t t0, int n)
{
    const kvd_attn_int_args *a = c->a;
    int P = c->kP, D = c->D;
    for (int gi = 0; gi < n / P; gi++)
        for (int g = 0; g < c->G; g++) {
            double bias;
            const float *qr = (const float *)((const char *)a->q.data + (int64_t)(c->h * c->G + g) * a->q.stride[0]);
            c->ksw[gi * c->G + g] = kchan_weights(a, c->h, t0 / P + gi, qr, c->wtmp,
                                                  c->kw8 + ((size_t)gi * c->G + g) * D, &bias);
            c->kbias[gi * c->G + g] = (float)bias;
        }
}

/* kvd_attn_quantize_q8 on 8-float vectors: identical codes (the same f32
 * division and round-half-even); returns 0 when w holds NaN/Inf or is all
 * zero, and the caller then uses the scalar routine. n % 8 == 0. */
__attribute__((target("avx2,fma"))) static int quantize_q8_avx2(const float *w, int n, int8_t *w8, float *scale)
{
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 mx = _mm256_setzero_ps(), nan = _mm256_setzero_ps();
    for (int i = 0; i < n; i += 8) {
        __m256 x = _mm256_loadu_ps(w + i);
        mx = _mm256_max_ps(mx, _mm256_and_ps(x, absmask));
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(x, x, _CMP_UNORD_Q)); /* max_ps drops NaN */
    }
    if (_mm256_movemask_ps(nan))
        return 0;
    float m8[8];
    _mm256_storeu_ps(m8, mx);
    float amax = 0.0f;
    for (int i = 0; i < 8; i++)
        amax = m8[i] > amax ? m8[i] : amax;
    if (!(amax > 0.0f) || !isfinite(amax))
        return 0;
    float sc = amax / 127.0f;
    const __m256 vs = _mm256_set1_ps(sc), hi = _mm256_set1_ps(127.0f), lo = _mm256_set1_ps(-127.0f);
    for (int i = 0; i < n; i += 8) {
        __m256 v = _mm256_round_ps(_mm256_div_ps(_mm256_loadu_ps(w + i), vs), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        v = _mm256_min_ps(_mm256_max_ps(v, lo), hi);
        __m256i q = _mm256_cvtps_epi32(v);
        __m128i q16 = _mm_packs_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1));
        _mm_storel_epi64((__m128i *)(w8 + i), _mm_packs_epi16(q16, q16));
    }
    *scale = sc;
    return 1;
}

/* quantize_q8_avx2 on 16-float vectors: the same codes (the same f32
 * division and round-half-even, vpmovsdb's saturation inside the clamp's
 * range). n % 16 == 0. */
INT512_TARGET static int quantize_q8_512(const float *w, int n, int8_t *w8, float *scale)
{
    __m512 mx = _mm512_setzero_ps();
    __mmask16 nan = 0;
    for (int i = 0; i < n; i += 16) {
        __m512 x = _mm512_loadu_ps(w + i);
        mx = _mm512_max_ps(mx, _mm512_abs_ps(x));
        nan |= _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q); /* max_ps drops NaN */
    }
    if (nan)
        return 0;
    float amax = _mm512_reduce_max_ps(mx);
    if (!(amax > 0.0f) || !isfinite(amax))
        return 0;
    float sc = amax / 127.0f;
    const __m512 vs = _mm512_set1_ps(sc), hi = _mm512_set1_ps(127.0f), lo = _mm512_set1_ps(-127.0f);
    for (int i = 0; i < n; i += 16) {
        __m512 v = _mm512_roundscale_ps(_mm512_div_ps(_mm512_loadu_ps(w + i), vs),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        v = _mm512_min_ps(_mm512_max_ps(v, lo), hi);
        _mm_storeu_si128((__m128i *)(w8 + i), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(v)));
    }
    *scale = sc;
    return 1;
}

/* The end of the channel-key weights of a block: each group's and head's
 * w (ngb, G, D) rounded to int8 (kw8, ksw; by quantize_q8_512 when W512,
 * else quantize_q8_avx2) and its 8-lane bias sum folded (kbias). */
__attribute__((target("avx2,fma,f16c"), always_inline)) static inline void
kchan_weights_finish(const int_ctx *c, int ngb, const float *w, __m256 (*bias)[KVD__ATTN_MAXG],
                     const int W512)
{
    const int G = c->G, D = c->D;
    for (int gi = 0; gi < ngb; gi++)
        for (int g = 0; g < G; g++) {
            const float *wr = w + ((size_t)gi * G + g) * D;
            int8_t *w8 = c->kw8 + ((size_t)gi * G + g) * D;
            float sw;
            if (!(W512 ? quantize_q8_512(wr, D, w8, &sw) : quantize_q8_avx2(wr, D, w8, &sw)))
                sw = kvd_attn_quantize_q8(wr, D, w8);
            float b8[8];
            _mm256_storeu_ps(b8, bias[gi][g]);
            c->ksw[gi * G + g] = sw;
            c->kbias[gi * G + g] =
                ((b8[0] + b8[1]) + (b8[2] + b8[3])) + ((b8[4] + b8[5]) + (b8[6] + b8[7]));
        }
}

/* Ask for the next block's (t0 + n ..) key scales and mins of channel rows
 * d0 .. d0 + nr (keys grouped per channel): each row's groups of a block lie
 * in a line of their own, a row apart from the next row's, too many
 * streams for the hardware prefetcher. */
static inline void prefetch_kparams_next(const int_ctx *c, int64_t t0, int n, int d0, int nr)
{
    const kvd_attn_int_args *a = c->a;
    if (t0 + 2 * (int64_t)n > a->n_tokens)
        return;
    const kvd_tensor *pt[2] = {&a->k.scale, &a->k.min};
    for (int k = 0; k < 2; k++) {
        const char *b = (const char *)pt[k]->data + c->h * pt[k]->stride[0] +
                        d0 * pt[k]->stride[1] + (t0 + n) / c->kP * 2;
        for (int r = 0; r < nr; r++)
            __builtin_prefetch(b + r * pt[k]->stride[1]);
    }
}

/* kchan_block_weights for blocks of 2, 4 or 8 key groups and D % 8 == 0: the
 * scales and mins of 8 channels x every group of the block come in with one
 * transpose (load_t8_u16), w = q * scale in f32 as in kchan_weights. */
__attribute__((target("avx2,fma,f16c"))) __attribute__((always_inline)) static inline void
kchan_block_weights_avx2_tpl(const int_ctx *c, int64_t t0, const int ngb)
{
    const kvd_attn_int_args *a = c->a;
    int P = c->kP, D = c->D, G = c->G;
    float *w = c->wtmp; /* (ngb, G, D) here: sized for it at allocation */
    __m256 bias[8][KVD__ATTN_MAXG];
    for (int gi = 0; gi < ngb; gi++)
        for (int g = 0; g < G; g++)
            bias[gi][g] = _mm256_setzero_ps();
    const kvd_tensor *ts = &a->k.scale, *tm = &a->k.min;
    for (int d0 = 0; d0 < D; d0 += 8) {
        __m128i sc[8], mn[8];
        prefetch_kparams_next(c, t0, ngb * P, d0, 8);
        load_t8_u16((const char *)ts->data + c->h * ts->stride[0] + d0 * ts->stride[1] + (t0 / P) * 2, ts->stride[1],
                    ngb, sc);
        load_t8_u16((const char *)tm->data + c->h * tm->stride[0] + d0 * tm->stride[1] + (t0 / P) * 2, tm->stride[1],
                    ngb, mn);
        for (int g = 0; g < G; g++) {
            __m256 qv = _mm256_loadu_ps((const float *)((const char *)a->q.data + (int64_t)(c->h * G + g) * a->q.stride[0]) + d0);
            for (int gi = 0; gi < ngb; gi++) {
                _mm256_storeu_ps(w + ((size_t)gi * G + g) * D + d0, _mm256_mul_ps(qv, _mm256_cvtph_ps(sc[gi])));
                bias[gi][g] = _mm256_fmadd_ps(qv, _mm256_cvtph_ps(mn[gi]), bias[gi][g]);
            }
        }
    }
    kchan_weights_finish(c, ngb, w, bias, 0);
}

/* the group count a constant for load_t8_u16 */
__attribute__((target("avx2,fma,f16c"))) static void kchan_block_weights_avx2(const int_ctx *c,
                                                                              int64_t t0, int n)
{
    const int ngb = n / c->kP;
    if (ngb == 8)
        kchan_block_weights_avx2_tpl(c, t0, 8);
    else if (ngb == 4)
        kchan_block_weights_avx2_tpl(c, t0, 4);
    else
        kchan_block_weights_avx2_tpl(c, t0, 2);
}

/* kchan_block_weights_avx2 with 16 channels a step (two 8-channel
 * transposes joined) and the codes by quantize_q8_512; the bias sums keep
 * the 8-lane order of kchan_block_weights_avx2: the same bits. D % 16 == 0. */
INT512_TARGET __attribute__((always_inline)) static inline void
kchan_block_weights_512_tpl(const int_ctx *c, int64_t t0, const int ngb)
{
    const kvd_attn_int_args *a = c->a;
    int P = c->kP, D = c->D, G = c->G;
    float *w = c->wtmp; /* (ngb, G, D) */
    __m256 bias[8][KVD__ATTN_MAXG];
    for (int gi = 0; gi < ngb; gi++)
        for (int g = 0; g < G; g++)
            bias[gi][g] = _mm256_setzero_ps();
    const kvd_tensor *ts = &a->k.scale, *tm = &a->k.min;
    for (int d0 = 0; d0 < D; d0 += 16) {
        __m128i sc[2][8], mn[2][8];
        prefetch_kparams_next(c, t0, ngb * P, d0, 16);
        for (int hf = 0; hf < 2; hf++) {
            const int64_t dd = d0 + 8 * hf;
            load_t8_u16((const char *)ts->data + c->h * ts->stride[0] + dd * ts->stride[1] +
                            (t0 / P) * 2,
                        ts->stride[1], ngb, sc[hf]);
            load_t8_u16((const char *)tm->data + c->h * tm->stride[0] + dd * tm->stride[1] +
                            (t0 / P) * 2,
                        tm->stride[1], ngb, mn[hf]);
        }
        for (int g = 0; g < G; g++) {
            const float *qr = (const float *)((const char *)a->q.data +
                                              (int64_t)(c->h * G + g) * a->q.stride[0]) +
                              d0;
            const __m512 qv = _mm512_loadu_ps(qr);
            const __m256 q0 = _mm256_loadu_ps(qr), q1 = _mm256_loadu_ps(qr + 8);
            for (int gi = 0; gi < ngb; gi++) {
                const __m512 sv = _mm512_cvtph_ps(
                    _mm256_inserti128_si256(_mm256_castsi128_si256(sc[0][gi]), sc[1][gi], 1));
                _mm512_storeu_ps(w + ((size_t)gi * G + g) * D + d0, _mm512_mul_ps(qv, sv));
                bias[gi][g] = _mm256_fmadd_ps(q0, _mm256_cvtph_ps(mn[0][gi]), bias[gi][g]);
                bias[gi][g] = _mm256_fmadd_ps(q1, _mm256_cvtph_ps(mn[1][gi]), bias[gi][g]);
            }
        }
    }
    kchan_weights_finish(c, ngb, w, bias, 1);
}

/* the group count a constant for load_t8_u16 */
INT512_TARGET static void kchan_block_weights_512(const int_ctx *c, int64_t t0, int n)
{
    const int ngb = n / c->kP;
    if (ngb == 8)
        kchan_block_weights_512_tpl(c, t0, 8);
    else if (ngb == 4)
        kchan_block_weights_512_tpl(c, t0, 4);
    else
        kchan_block_weights_512_tpl(c, t0, 2);
}

/* Scores of a block from channel-grouped keys, scalar. */
static void kchan_scores_scalar(const int_ctx *c, int64_t t0, int n, float *s, int ld)
{
    const kvd_attn_int_args *a = c->a;
    int P = c->kP, D = c->D;
    float ss = a->dims.softmax_scale;
    for (int i = 0; i < n; i++) {
        int gi = i / P;
        for (int g = 0; g < c->G; g++) {
            const int8_t *w8 = c->kw8 + ((size_t)gi * c->G + g) * D;
            int ic = 0;
            for (int d = 0; d < D; d++)
                ic += w8[d] * code_at(qrow(&a->k.codes, c->h, d), t0 + i, c->kbits);
            s[(size_t)g * ld + i] = (c->kbias[gi * c->G + g] + c->ksw[gi * c->G + g] * (float)ic) * ss;
        }
    }
}

/*
 * Scores of a block from channel-grouped keys, AVX2. Lanes are tokens: the
 * 16 code bytes of channels d and d+1 at the same tokens are interleaved
 * byte by byte, so after shifting out plane k every 16-bit lane holds the
 * pair (c_{d,t}, c_{d+1,t}) of one token and maddubs against the broadcast
 * pair (w8_d, w8_{d+1}) adds both channels' products. A 16-byte chunk of a
 * row covers 16*PER tokens; its low 8 bytes go to the low 128-bit lane and
 * the high 8 to the high lane, each inside one key group (P is a multiple
 * of 8*PER), so a lane's broadcast pair comes from its own group. Plane k,
 * lane half L, slot i holds token L*8*PER + PER*i + k of the chunk.
 * int16 sums: |w8| <= 127, a maddubs lane <= 2*127*3 = 762 (INT2) or 3810
 * (INT4); flushed to int32 every 32 / 8 channel pairs (24384 / 30480).
 */
__attribute__((target("avx2,fma,f16c"), always_inline)) static inline void
kchan_scores_tpl(const int_ctx *c, int64_t t0, int n, float *s, int ld, const int BITS,
                 const int GP)
{
    const kvd_attn_int_args *a = c->a;
    const int PER = 8 / BITS, TPL = 8 * PER, TPR = 16 * PER, FLUSH = BITS == 2 ? 32 : 8;
    const int P = c->kP, D = c->D, G = c->G;
    const __m256i mask = _mm256_set1_epi8((char)((1 << BITS) - 1));
    const kvd_tensor *ct = &a->k.codes;
    const uint8_t *cbase = (const uint8_t *)ct->data + c->h * ct->stride[0] + t0 / PER;
    const int64_t cst = ct->stride[1];
    float ss = a->dims.softmax_scale;
    /* GP query heads per pass share the loads and the plane unpacking of
     * every code pair. Their int16 sums stay in registers: KP planes at a
     * time (GP * KP <= 8 accumulators), the pairs read again for the next
     * KP (from L1). */
    const int KP = GP * PER > 8 ? 8 / GP : PER;
    /* the channel rows are T*bits/8 bytes apart (a page each in a long
     * run): the first pass over them asks for the next block's lines */
    const int ahead = t0 + 2 * (int64_t)n <= a->n_tokens && cst > 64;
    for (int c0 = 0; c0 < n; c0 += TPR) {
        int gA = c0 / P, gB = (c0 + TPL) / P;
        for (int g0 = 0; g0 < G; g0 += GP) {
            const int16_t *wA[4], *wB[4];
            _Alignas(32) int32_t a32[4][4][16];
            _Pragma("GCC unroll 4") for (int h = 0; h < GP; h++)
            {
                wA[h] = (const int16_t *)(c->kw8 + ((size_t)gA * G + g0 + h) * D);
                wB[h] = (const int16_t *)(c->kw8 + ((size_t)gB * G + g0 + h) * D);
                memset(a32[h], 0, sizeof a32[h]);
            }
            for (int k0 = 0; k0 < PER; k0 += KP) {
                __m256i acc[4][4];
                _Pragma("GCC unroll 4") for (int h = 0; h < GP; h++)
                    _Pragma("GCC unroll 4") for (int k = 0; k < KP; k++) acc[h][k] =
                        _mm256_setzero_si256();
                for (int pr = 0, cnt = 0; pr < D / 2; pr++) {
                    const uint8_t *r0 = cbase + (int64_t)(2 * pr) * cst + c0 / PER;
                    if (ahead && c0 == 0 && g0 == 0 && k0 == 0) {
                        for (int o = 0; o < n / PER; o += 64) {
                            __builtin_prefetch(r0 + n / PER + o);
                            __builtin_prefetch(r0 + cst + n / PER + o);
                        }
                    }
                    __m128i x0 = _mm_loadu_si128((const __m128i *)r0),
                            x1 = _mm_loadu_si128((const __m128i *)(r0 + cst));
                    __m256i X =
                        _mm256_set_m128i(_mm_unpackhi_epi8(x0, x1), _mm_unpacklo_epi8(x0, x1));
                    __m256i pl[4];
                    _Pragma("GCC unroll 4") for (int k = 0; k < KP; k++) pl[k] =
                        _mm256_and_si256(_mm256_srli_epi16(X, (k0 + k) * BITS), mask);
                    _Pragma("GCC unroll 4") for (int h = 0; h < GP; h++)
                    {
                        int16_t pa, pb;
                        memcpy(&pa, wA[h] + pr, 2);
                        memcpy(&pb, wB[h] + pr, 2);
                        __m256i W = _mm256_set_m128i(_mm_set1_epi16(pb), _mm_set1_epi16(pa));
                        _Pragma("GCC unroll 4") for (int k = 0; k < KP; k++) acc[h][k] =
                            _mm256_add_epi16(acc[h][k], _mm256_maddubs_epi16(pl[k], W));
                    }
                    if (++cnt == FLUSH || pr + 1 == D / 2) {
                        _Pragma("GCC unroll 4") for (int h = 0; h < GP; h++)
                            _Pragma("GCC unroll 4") for (int k = 0; k < KP; k++)
                        {
                            int32_t *o = a32[h][k0 + k];
                            __m256i lo = _mm256_cvtepi16_epi32(_mm256_castsi256_si128(acc[h][k]));
                            __m256i hi =
                                _mm256_cvtepi16_epi32(_mm256_extracti128_si256(acc[h][k], 1));
                            _mm256_store_si256(
                                (__m256i *)o,
                                _mm256_add_epi32(_mm256_load_si256((__m256i *)o), lo));
                            _mm256_store_si256(
                                (__m256i *)(o + 8),
                                _mm256_add_epi32(_mm256_load_si256((__m256i *)(o + 8)), hi));
                            acc[h][k] = _mm256_setzero_si256();
                        }
                        cnt = 0;
                    }
                }
            }
            for (int h = 0; h < GP; h++) {
                int g = g0 + h;
                float *sg = s + (size_t)g * ld + c0;
                for (int L = 0; L < 2; L++) {
                    int gi = L ? gB : gA;
                    float b = c->kbias[gi * G + g], sw = c->ksw[gi * G + g];
                    for (int k = 0; k < PER; k++)
                        for (int i = 0; i < 8; i++)
                            sg[L * TPL + PER * i + k] = (b + sw * (float)a32[h][k][L * 8 + i]) * ss;
                }
            }
        }
    }
}

/* kchan_scores512_tpl's sums for query heads g0 .. g0 + GP of one chunk
 * (c0): GP a constant where it can be, so that the 4 x PER int32 sums stay
 * in registers. */
KCH512_TARGET __attribute__((always_inline)) static inline void
kch512_heads(const int_ctx *c, const uint8_t *cbase, int64_t cst, int c0, int n, int g0, int gA,
             int gB, __m512i perm, __m512i mask, int ahead, float *s, int ld, const int BITS,
             const int GP)
{
    const int PER = 8 / BITS, TPL = 8 * PER, D = c->D, G = c->G;
    const float ss = c->a->dims.softmax_scale;
    __m512i acc[4][4];
    _Pragma("GCC unroll 4") for (int h = 0; h < 4; h++)
        _Pragma("GCC unroll 4") for (int k = 0; k < 4; k++) acc[h][k] = _mm512_setzero_si512();
    for (int q = 0; q < D / 4; q++) {
        const uint8_t *r0 = cbase + (int64_t)(4 * q) * cst + c0 / PER;
        if (ahead && c0 == 0 && g0 == 0)
            for (int r = 0; r < 4; r++)
                for (int o = 0; o < n / PER; o += 64)
                    __builtin_prefetch(r0 + r * cst + n / PER + o);
        __m512i X = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)r0));
        X = _mm512_inserti32x4(X, _mm_loadu_si128((const __m128i *)(r0 + cst)), 1);
        X = _mm512_inserti32x4(X, _mm_loadu_si128((const __m128i *)(r0 + 2 * cst)), 2);
        X = _mm512_inserti32x4(X, _mm_loadu_si128((const __m128i *)(r0 + 3 * cst)), 3);
        X = _mm512_permutexvar_epi8(perm, X);
        __m512i pl[4];
        _Pragma("GCC unroll 4") for (int k = 0; k < PER; k++) pl[k] =
            _mm512_and_si512(_mm512_srli_epi16(X, k * BITS), mask);
        _Pragma("GCC unroll 4") for (int h = 0; h < GP; h++)
        {
            int32_t wa, wb;
            memcpy(&wa, c->kw8 + ((size_t)gA * G + g0 + h) * D + 4 * q, 4);
            memcpy(&wb, c->kw8 + ((size_t)gB * G + g0 + h) * D + 4 * q, 4);
            const __m512i W = _mm512_mask_blend_epi32((__mmask16)0xFF00, _mm512_set1_epi32(wa),
                                                      _mm512_set1_epi32(wb));
            _Pragma("GCC unroll 4") for (int k = 0; k < PER; k++) acc[h][k] =
                _mm512_dpbusd_epi32(acc[h][k], pl[k], W);
        }
    }
    for (int h = 0; h < GP; h++) {
        const int g = g0 + h;
        _Alignas(64) int32_t a32[4][16];
        for (int k = 0; k < PER; k++)
            _mm512_store_si512((void *)a32[k], acc[h][k]);
        float *sg = s + (size_t)g * ld + c0;
        for (int L = 0; L < 2; L++) {
            const int gi = L ? gB : gA;
            const float b = c->kbias[gi * G + g], sw = c->ksw[gi * G + g];
            for (int k = 0; k < PER; k++)
                for (int i = 0; i < 8; i++)
                    sg[L * TPL + PER * i + k] = (b + sw * (float)a32[k][L * 8 + i]) * ss;
        }
    }
}

/*
 * kchan_scores_tpl with 512-bit vpdpbusd (AVX-512 VNNI, VBMI): four channel
 * rows at a time, their 16 bytes of a chunk interleaved by one vpermb so
 * that dword i holds byte i of the four rows; a plane's codes times the
 * four channels' int8 weights sum in one instruction into int32 lanes (no
 * int16 sums to widen). Lane i is byte i of the chunk, as in the 256-bit
 * kernel (bytes 0-7 take group gA's weights, 8-15 gB's), and the int32
 * sums are exact, so the scores come out of the same float expression:
 * the same bits.
 */
KCH512_TARGET __attribute__((always_inline)) static inline void
kchan_scores512_tpl(const int_ctx *c, int64_t t0, int n, float *s, int ld, const int BITS)
{
    const kvd_attn_int_args *a = c->a;
    const int PER = 8 / BITS, TPL = 8 * PER, TPR = 16 * PER;
    const int P = c->kP, G = c->G;
    const __m512i mask = _mm512_set1_epi8((char)((1 << BITS) - 1));
    _Alignas(64) uint8_t pidx[64]; /* out byte 4 i + r = in byte 16 r + i */
    for (int j = 0; j < 64; j++)
        pidx[j] = (uint8_t)(16 * (j % 4) + j / 4);
    const __m512i perm = _mm512_load_si512((const void *)pidx);
    const kvd_tensor *ct = &a->k.codes;
    const uint8_t *cbase = (const uint8_t *)ct->data + c->h * ct->stride[0] + t0 / PER;
    const int64_t cst = ct->stride[1];
    const int ahead = t0 + 2 * (int64_t)n <= a->n_tokens && cst > 64;
    for (int c0 = 0; c0 < n; c0 += TPR) {
        const int gA = c0 / P, gB = (c0 + TPL) / P;
        for (int g0 = 0; g0 < G; g0 += 4) {
            if (G - g0 >= 4)
                kch512_heads(c, cbase, cst, c0, n, g0, gA, gB, perm, mask, ahead, s, ld, BITS, 4);
            else
                kch512_heads(c, cbase, cst, c0, n, g0, gA, gB, perm, mask, ahead, s, ld, BITS,
                             G - g0);
        }
    }
}

KCH512_TARGET static void kchan_scores_512(const int_ctx *c, int64_t t0, int n, float *s, int ld)
{
    if (c->kbits == 2)
        kchan_scores512_tpl(c, t0, n, s, ld, 2);
    else
        kchan_scores512_tpl(c, t0, n, s, ld, 4);
}

__attribute__((target("avx2,fma,f16c"))) static void kchan_scores_avx2(const int_ctx *c, int64_t t0, int n,
                                                                       float *s, int ld)
{
    const int pairs = c->G % 2 == 0;
    if (c->kbits == 2 && c->G % 4 == 0)
        kchan_scores_tpl(c, t0, n, s, ld, 2, 4);
    else if (c->kbits == 2 && pairs)
        kchan_scores_tpl(c, t0, n, s, ld, 2, 2);
    else if (c->kbits == 2)
        kchan_scores_tpl(c, t0, n, s, ld, 2, 1);
    else if (pairs)
        kchan_scores_tpl(c, t0, n, s, ld, 4, 2);
    else
        kchan_scores_tpl(c, t0, n, s, ld, 4, 1);
}

/* Prefetch rows [r0, r0+n) of head h of a (Hkv, rows, bytes) tensor (codes
 * or group parameters). The block after the current one is requested while
 * the current one is computed: the kernel reads each byte once, and on a
 * busy machine the hardware prefetcher alone leaves the loads waiting. */
static void prefetch_rows(const kvd_tensor *t, int h, int64_t r0, int64_t n, int64_t rowbytes)
{
    if (r0 + n > t->shape[1] || n <= 0)
        return;
    const char *b = (const char *)t->data + h * t->stride[0] + r0 * t->stride[1];
    if (t->stride[1] == rowbytes) {
        for (int64_t o = 0; o < n * rowbytes; o += 64)
            __builtin_prefetch(b + o);
    } else {
        for (int64_t r = 0; r < n; r++)
            __builtin_prefetch(b + r * t->stride[1]);
    }
}

INT512_TARGET static void int_scores_512(const int_ctx *c, int64_t t0, int n, float *s, int ld);

static void int_scores_cb(void *vctx, int64_t t0, int n, float *s, int ld)
{
    const int_ctx *c = vctx;
    if (c->a->k.axis == KVD_ATTN_AXIS_CHANNEL) {
        int per = 8 / c->kbits, ngb = n / c->kP;
        if (c->kch512 && c->D % 16 == 0 && (ngb == 2 || ngb == 4 || ngb == 8))
            kchan_block_weights_512(c, t0, n);
        else if (c->simd && c->D % 8 == 0 && (ngb == 2 || ngb == 4 || ngb == 8))
            kchan_block_weights_avx2(c, t0, n);
        else
            kchan_block_weights(c, t0, n);
        if (c->kch512 && c->D % 4 == 0 && c->kP % (8 * per) == 0 && n % (16 * per) == 0)
            kchan_scores_512(c, t0, n, s, ld);
        else if (c->simd && c->D % 2 == 0 && c->kP % (8 * per) == 0 && n % (16 * per) == 0)
            kchan_scores_avx2(c, t0, n, s, ld);
        else
            kchan_scores_scalar(c, t0, n, s, ld);
        return;
    }
    if (c->simd && (c->D * c->kbits) % 32 == 0 && (c->kP * c->kbits) % 32 == 0 &&
        c->kcols <= KVD__INT_MAXCOLS && c->kng <= 8) {
        /* these ask for their K lines ahead step by step (prefetch_k_ahead) */
        if (c->v512)
            int_scores_512(c, t0, n, s, ld);
        else
            int_scores_avx2(vctx, t0, n, s, ld);
    } else {
        const kvd_attn_qdata *k = &c->a->k;
        prefetch_rows(&k->codes, c->h, t0 + n, n, k->codes.shape[2]);
        prefetch_rows(&k->scale, c->h, t0 + n, n, 2 * k->scale.shape[2]);
        prefetch_rows(&k->min, c->h, t0 + n, n, 2 * k->min.shape[2]);
        int_scores_scalar(c, t0, n, s, ld);
    }
}

/* Channel-axis values, scalar: the same equation as the reference. */
static void int_values_channel_scalar(const int_ctx *c, int64_t t0, int n, const float *p, int ld,
                                      float *acc)
{
    const kvd_attn_int_args *a = c->a;
    int P = a->v.group;
    uint8_t p8[256];
    for (int off = 0; off < n; off += P) {
        int64_t grp = (t0 + off) / P;
        for (int g = 0; g < c->G; g++) {
            float mP, sP;
            int sum8;
            quantize_p8(p + (size_t)g * ld + off, P, p8, &mP, &sP, &sum8);
            float *ag = acc + (size_t)g * c->Dv;
            for (int dd = 0; dd < c->Dv; dd++) {
                const uint8_t *cr = qrow(&a->v.codes, c->h, dd);
                int ic = 0;
                for (int i = 0; i < P; i++)
                    ic += p8[i] * code_at(cr, t0 + off + i, a->v.bits);
                float sc = f16_at(&a->v.scale, c->h, dd, grp), mn = f16_at(&a->v.min, c->h, dd, grp);
                float cs = u16_at(&a->v.sum, c->h, dd, grp);
                ag[dd] += sc * (sP * (float)ic + mP * cs) + mn * (sP * (float)sum8 + (float)P * mP);
            }
        }
    }
}

/* uint8 quantization of one group's probabilities, vectorised; the same
 * operations as quantize_p8 (min, max, (p - lo) * inv, round-half-even), so
 * the codes are identical. n % 8 == 0. */
__attribute__((target("avx2,fma"))) static void quantize_p8_avx2(const float *p, int n, uint8_t *p8,
                                                                 float *mP, float *sP, int *sum8)
{
    __m256 lo = _mm256_loadu_ps(p), hi = lo;
    for (int i = 8; i < n; i += 8) {
        __m256 x = _mm256_loadu_ps(p + i);
        lo = _mm256_min_ps(lo, x);
        hi = _mm256_max_ps(hi, x);
    }
    float l8[8], h8[8];
    _mm256_storeu_ps(l8, lo);
    _mm256_storeu_ps(h8, hi);
    float l = l8[0], h = h8[0];
    for (int i = 1; i < 8; i++) {
        l = l8[i] < l ? l8[i] : l;
        h = h8[i] > h ? h8[i] : h;
    }
    float s = (h - l) / 255.0f, inv = s >= FLT_MIN ? 1.0f / s : 0.0f; /* as quantize_p8 */
    __m256 vl = _mm256_set1_ps(l), vi = _mm256_set1_ps(inv), z = _mm256_setzero_ps(), top = _mm256_set1_ps(255.0f);
    __m256i sum = _mm256_setzero_si256();
    for (int i = 0; i < n; i += 8) {
        __m256 v = _mm256_round_ps(_mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(p + i), vl), vi),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        v = _mm256_min_ps(_mm256_max_ps(v, z), top);
        __m256i q = _mm256_cvtps_epi32(v);
        sum = _mm256_add_epi32(sum, q);
        __m128i q16 = _mm_packus_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1));
        _mm_storel_epi64((__m128i *)(p8 + i), _mm_packus_epi16(q16, q16));
    }
    int32_t sv[8];
    _mm256_storeu_si256((__m256i *)sv, sum);
    *sum8 = sv[0] + sv[1] + sv[2] + sv[3] + sv[4] + sv[5] + sv[6] + sv[7];
    *mP = l;
    *sP = s;
}

/* Element (h, d0 + r, grp) of a (Hkv, W, ng) u16 tensor for r = 0..7, as
 * f32 (f16 values, or integers when `integer`). */
__attribute__((target("avx2,fma,f16c"))) static inline __m256 param_col(const kvd_tensor *t, int64_t h, int64_t d0,
                                                                        int64_t grp, int integer)
{
    const char *b = (const char *)t->data + h * t->stride[0] + d0 * t->stride[1] + grp * 2;
    const __m128i v = gather8_u16(b, t->stride[1]);
    return integer ? _mm256_cvtepi32_ps(_mm256_cvtepu16_epi32(v)) : _mm256_cvtph_ps(v);
}

/* Code columns of 8 channel rows r0 + r * cst (COLS dwords each),
 * transposed so lane r of X[c] is dword c of row r. The row addresses are
 * formed where they are loaded (an array of them was built in vector
 * registers and taken out lane by lane). */
__attribute__((target("avx2,fma,f16c"), always_inline)) static inline void
load_cols(const uint8_t *r0, int64_t cst, __m256i *X, const int COLS)
{
#define KVD__ROW(r) (r0 + (r)*cst)
    if (COLS == 2) {
        __m256 A = _mm256_castsi256_ps(
            _mm256_set_epi64x(*(const long long *)KVD__ROW(3), *(const long long *)KVD__ROW(2),
                              *(const long long *)KVD__ROW(1), *(const long long *)KVD__ROW(0)));
        __m256 B = _mm256_castsi256_ps(
            _mm256_set_epi64x(*(const long long *)KVD__ROW(7), *(const long long *)KVD__ROW(6),
                              *(const long long *)KVD__ROW(5), *(const long long *)KVD__ROW(4)));
        __m256 lo = _mm256_shuffle_ps(A, B, _MM_SHUFFLE(2, 0, 2, 0)),
               hi = _mm256_shuffle_ps(A, B, _MM_SHUFFLE(3, 1, 3, 1));
        /* lo = [r0 r1 r4 r5 | r2 r3 r6 r7] */
        X[0] = _mm256_permute4x64_epi64(_mm256_castps_si256(lo), _MM_SHUFFLE(3, 1, 2, 0));
        X[1] = _mm256_permute4x64_epi64(_mm256_castps_si256(hi), _MM_SHUFFLE(3, 1, 2, 0));
    } else if (COLS == 4) {
        __m256i r[4];
        for (int i = 0; i < 4; i++)
            r[i] = _mm256_set_m128i(_mm_loadu_si128((const __m128i *)KVD__ROW(i + 4)),
                                    _mm_loadu_si128((const __m128i *)KVD__ROW(i)));
        __m256i t0 = _mm256_unpacklo_epi32(r[0], r[1]), t1 = _mm256_unpackhi_epi32(r[0], r[1]);
        __m256i t2 = _mm256_unpacklo_epi32(r[2], r[3]), t3 = _mm256_unpackhi_epi32(r[2], r[3]);
        X[0] = _mm256_unpacklo_epi64(t0, t2);
        X[1] = _mm256_unpackhi_epi64(t0, t2);
        X[2] = _mm256_unpacklo_epi64(t1, t3);
        X[3] = _mm256_unpackhi_epi64(t1, t3);
    } else {
        for (int c0 = 0; c0 < COLS; c0 += 8) {
            for (int r = 0; r < 8; r++)
                X[c0 + r] = _mm256_loadu_si256((const __m256i *)(KVD__ROW(r) + 4 * c0));
            transpose8x8(X + c0);
        }
    }
}
#undef KVD__ROW

/* The channel rows of a long run are T*bits/8 bytes apart (a page of the
 * store: 64 B, then the rows are contiguous; a whole 32K-token run: 8 KB,
 * one 4 KB page per row, which neither the TLB nor the stride prefetcher
 * follows). The value loops ask for the next block's code and parameter
 * lines of channels [d0, d1) as they start that tile, so that the lines of
 * the next block arrive while this one is computed, a tile's worth at a
 * time (every row asked for at the block's start was too many at once). */
static inline void prefetch_v_tile(const int_ctx *c, int64_t t0, int n, int d0, int d1,
                                   const int BITS, const int P)
{
    const kvd_attn_int_args *a = c->a;
    int64_t tn = t0 + n, nn = n; /* the next block: its first token, its tokens */
    if (tn + n > a->n_tokens) {
        /* this segment's last block: the first block of the next one, rows
         * near each other or not (pages: 64 B apart, but a new page) */
        if (!c->next)
            return;
        a = c->next;
        tn = 0;
        nn = a->n_tokens < n ? (int)a->n_tokens : n;
    } else if (a->v.codes.stride[1] <= 64)
        return; /* rows one after the other: the hardware follows them */
    const kvd_tensor *ct = &a->v.codes;
    const int64_t cst = ct->stride[1];
    const int PER = 8 / BITS;
    const char *cbase = (const char *)ct->data + c->h * ct->stride[0] + tn / PER;
    const kvd_tensor *pt[3] = {&a->v.scale, &a->v.min, &a->v.sum};
    /* the parameters' lines hold 32 groups: asked for when the next
     * block's first group starts a line it does not share with this one */
    const int new_line = a != c->a || (tn / P * 2) / 64 != ((tn - n) / P * 2) / 64;
    for (int d = d0; d < d1; d++) {
        for (int o = 0; o < nn / PER; o += 64)
            __builtin_prefetch(cbase + d * cst + o);
        for (int k = 0; new_line && k < 3; k++)
            __builtin_prefetch((const char *)pt[k]->data + c->h * pt[k]->stride[0] +
                               d * pt[k]->stride[1] + tn / P * 2);
    }
}

/* The part of a block's value pass shared by its tile loops (int_values_tpl,
 * int_values512_tpl): per group of the block and query head, the uint8 P
 * patterns (into c->vpatv) and the float corrections. */
typedef struct values_prep {
    float mP[KVD__ATTN_BLOCK / 32][KVD__ATTN_MAXG], sP[KVD__ATTN_BLOCK / 32][KVD__ATTN_MAXG],
        corr[KVD__ATTN_BLOCK / 32][KVD__ATTN_MAXG];
} values_prep;

__attribute__((target("avx2,fma,f16c"), always_inline)) static inline void
int_values_prep(const int_ctx *c, int n, const float *p, int ld, const int BITS, const int P,
                values_prep *vr)
{
    const int PER = 8 / BITS, COLS = P * BITS / 32;
    _Alignas(32) uint8_t p8[128];
    /* per group of the block and query head: uint8 P patterns and the float
     * corrections, computed once; then every tile walks all groups of the
     * block, so the tile's code rows (T*bits/8 bytes apart: a power-of-two
     * stride that maps them all to the same cache sets) are read once per
     * block as whole cache lines */
    /* [gi][g][COLS * PER] dwords, broadcast where used */
    int32_t *vp = (int32_t *)c->vpatv;
    int ngb = n / P;
    for (int gi = 0; gi < ngb; gi++)
        for (int g = 0; g < c->G; g++) {
            int sum8;
            quantize_p8_avx2(p + (size_t)g * ld + gi * P, P, p8, &vr->mP[gi][g], &vr->sP[gi][g],
                             &sum8);
            /* plane-order patterns (as build_patterns_i8) with one byte shuffle
             * per 16 bytes: out byte 4k+b of a column = in byte b*PER+k */
            int32_t *pat = vp + ((size_t)gi * c->G + g) * COLS * PER;
            const __m128i perm = BITS == 2 ? _mm_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15)
                                           : _mm_setr_epi8(0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15);
            for (int i = 0; i < P; i += 16)
                _mm_storeu_si128((__m128i *)(pat + i / 4),
                                 _mm_shuffle_epi8(_mm_load_si128((const __m128i *)(p8 + i)), perm));
            vr->corr[gi][g] = vr->sP[gi][g] * (float)sum8 + (float)P * vr->mP[gi][g];
        }
}

__attribute__((target("avx2,fma,f16c"), always_inline)) static inline void
int_values_tpl(const int_ctx *c, int64_t t0, int n, const float *p, int ld, float *acc,
               const int BITS, const int P, const int VNNI, const int GT)
{
    const kvd_attn_int_args *a = c->a;
    /* GT: the query heads per kv head as a compile-time constant (0: read
     * c->G), so a tile's G output vectors stay in registers over the groups
     * of the block */
    const int GG = GT ? GT : c->G;
    const int PER = 8 / BITS, COLS = P * BITS / 32, FLUSH = BITS == 2 ? 4 : 2;
    const __m256i mask = _mm256_set1_epi8((char)((1 << BITS) - 1)), ones = _mm256_set1_epi16(1);
    values_prep vr;
    int_values_prep(c, n, p, ld, BITS, P, &vr);
    const int32_t *vp = (const int32_t *)c->vpatv;
    const float(*mP)[KVD__ATTN_MAXG] = vr.mP, (*sP)[KVD__ATTN_MAXG] = vr.sP,
          (*corr)[KVD__ATTN_MAXG] = vr.corr;
    const kvd_tensor *ct = &a->v.codes;
    const int ngb = n / P;
    const uint8_t *cbase = (const uint8_t *)ct->data + c->h * ct->stride[0] + t0 / PER;
    const int64_t cst = ct->stride[1];
    /* a tile's parameters for every group of the block at once: the ngb
     * consecutive u16 of each of its 8 channel rows, transposed */
    const int tparams = ngb == 2 || ngb == 4 || ngb == 8;
    for (int d0 = 0; d0 < c->Dv; d0 += 8) {
        prefetch_v_tile(c, t0, n, d0, d0 + 8, BITS, P);
        __m128i tsc[8], tmn[8], tcs[8];
        __m256 o[KVD__ATTN_MAXG]; /* acc rows g, channels d0..d0+7 */
        if (tparams) {
            const kvd_tensor *pt[3] = {&a->v.scale, &a->v.min, &a->v.sum};
            __m128i *po[3] = {tsc, tmn, tcs};
            for (int k = 0; k < 3; k++)
                load_t8_u16((const char *)pt[k]->data + c->h * pt[k]->stride[0] + d0 * pt[k]->stride[1] +
                                (t0 / P) * 2,
                            pt[k]->stride[1], ngb, po[k]);
        }
        for (int gi = 0; gi < ngb; gi++) {
            int64_t grp = t0 / P + gi;
            const uint8_t *r0 = cbase + d0 * cst + gi * (P / PER);
            /* per-channel params of this group: 8 strided f16, assembled in
             * registers (a store/reload would stall store forwarding) */
            __m256 vsc, vmn, vcs;
            if (tparams) {
                vsc = _mm256_cvtph_ps(tsc[gi]);
                vmn = _mm256_cvtph_ps(tmn[gi]);
                vcs = _mm256_cvtepi32_ps(_mm256_cvtepu16_epi32(tcs[gi]));
            } else {
                vsc = param_col(&a->v.scale, c->h, d0, grp, 0);
                vmn = param_col(&a->v.min, c->h, d0, grp, 0);
                vcs = param_col(&a->v.sum, c->h, d0, grp, 1);
            }
            __m256i X[16], PL[16][4]; /* fixed sizes (COLS <= 16, PER <= 4): no variable-length arrays */
            if (gi == 0)
                for (int g = 0; g < GG; g++)
                    o[g] = _mm256_loadu_ps(acc + (size_t)g * c->Dv + d0);
            load_cols(r0, cst, X, COLS);
            _Pragma("GCC unroll 16") for (int cc = 0; cc < COLS; cc++)
                _Pragma("GCC unroll 4") for (int pl = 0; pl < PER; pl++) PL[cc][pl] =
                    _mm256_and_si256(_mm256_srli_epi16(X[cc], pl * BITS), mask);
            for (int g = 0; g < GG; g++) {
                __m256i acc32 = _mm256_setzero_si256(), acc16 = _mm256_setzero_si256();
                if (VNNI) {
                    __m256i ap[PER];
                    _Pragma("GCC unroll 4") for (int pl = 0; pl < PER; pl++)
                        ap[pl] = _mm256_setzero_si256();
                    _Pragma("GCC unroll 16") for (int cc = 0; cc < COLS; cc++)
                        _Pragma("GCC unroll 4") for (int pl = 0; pl < PER; pl++) ap[pl] =
                            dpbusd(ap[pl],
                                   _mm256_set1_epi32(
                                       vp[((size_t)gi * GG + g) * COLS * PER + cc * PER + pl]),
                                   PL[cc][pl], VNNI);
                    _Pragma("GCC unroll 4") for (int pl = 0; pl < PER; pl++)
                        acc32 = _mm256_add_epi32(acc32, ap[pl]);
                }
                for (int cc = 0; !VNNI && cc < COLS; cc++) {
                    _Pragma("GCC unroll 4") for (int pl = 0; pl < PER; pl++)
                        acc16 = _mm256_add_epi16(
                            acc16, _mm256_maddubs_epi16(_mm256_set1_epi32(vp[((size_t)gi * GG + g) * COLS * PER + cc * PER + pl]), PL[cc][pl]));
                    if ((cc + 1) % FLUSH == 0 || cc + 1 == COLS) {
                        acc32 = _mm256_add_epi32(acc32, _mm256_madd_epi16(acc16, ones));
                        acc16 = _mm256_setzero_si256();
                    }
                }
                /* sc * (sP*S + mP*cs) + mn * (sP*sum8 + P*mP) */
                __m256 t = _mm256_fmadd_ps(_mm256_set1_ps(sP[gi][g]), _mm256_cvtepi32_ps(acc32),
                                           _mm256_mul_ps(_mm256_set1_ps(mP[gi][g]), vcs));
                o[g] = _mm256_fmadd_ps(vsc, t, o[g]);
                o[g] = _mm256_fmadd_ps(vmn, _mm256_set1_ps(corr[gi][g]), o[g]);
            }
        }
        for (int g = 0; g < GG && ngb > 0; g++)
            _mm256_storeu_ps(acc + (size_t)g * c->Dv + d0, o[g]);
    }
}

/* load_cols for 16 channel rows r0 + r * cst, r = 0..15, on 512-bit
 * vectors: lane r of X[c] is dword c of row r. */
INT512_TARGET __attribute__((always_inline)) static inline void
load_cols16(const uint8_t *r0, int64_t cst, __m512i *X, const int COLS)
{
    if (COLS == 2) {
        __m512i A =
            _mm512_set_epi64(*(const long long *)(r0 + 7 * cst), *(const long long *)(r0 + 6 * cst),
                             *(const long long *)(r0 + 5 * cst), *(const long long *)(r0 + 4 * cst),
                             *(const long long *)(r0 + 3 * cst), *(const long long *)(r0 + 2 * cst),
                             *(const long long *)(r0 + cst), *(const long long *)r0);
        const uint8_t *r8 = r0 + 8 * cst;
        __m512i B =
            _mm512_set_epi64(*(const long long *)(r8 + 7 * cst), *(const long long *)(r8 + 6 * cst),
                             *(const long long *)(r8 + 5 * cst), *(const long long *)(r8 + 4 * cst),
                             *(const long long *)(r8 + 3 * cst), *(const long long *)(r8 + 2 * cst),
                             *(const long long *)(r8 + cst), *(const long long *)r8);
        const __m512i ev =
            _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
        X[0] = _mm512_permutex2var_epi32(A, ev, B);
        X[1] = _mm512_permutex2var_epi32(A, _mm512_add_epi32(ev, _mm512_set1_epi32(1)), B);
        return;
    }
    __m256i X0[16], X1[16];
    load_cols(r0, cst, X0, COLS);
    load_cols(r0 + 8 * cst, cst, X1, COLS);
    _Pragma("GCC unroll 16") for (int cc = 0; cc < COLS; cc++) X[cc] = CAT512I(X0[cc], X1[cc]);
}

/*
 * int_values_tpl's VNNI path in 16-channel tiles on AVX-512 (VNNI, BW):
 * two 8-row halves loaded and transposed as there, then joined, so that the
 * planes' masks, the dot products (512-bit vpdpbusd) and the float updates
 * take one instruction for 16 channels. Each lane computes what
 * int_values_tpl's does, in the same order: the same bits.
 */
INT512_TARGET __attribute__((always_inline)) static inline void
int_values512_tpl(const int_ctx *c, int64_t t0, int n, const float *p, int ld, float *acc,
                  const int BITS, const int P, const int GT)
{
    const kvd_attn_int_args *a = c->a;
    const int GG = GT ? GT : c->G;
    const int PER = 8 / BITS, COLS = P * BITS / 32;
    const __m512i mask = _mm512_set1_epi8((char)((1 << BITS) - 1));
    values_prep vr;
    int_values_prep(c, n, p, ld, BITS, P, &vr);
    const int32_t *vp = (const int32_t *)c->vpatv;
    const kvd_tensor *ct = &a->v.codes;
    const int ngb = n / P;
    const uint8_t *cbase = (const uint8_t *)ct->data + c->h * ct->stride[0] + t0 / PER;
    const int64_t cst = ct->stride[1];
    const int tparams = ngb == 2 || ngb == 4 || ngb == 8;
    const kvd_tensor *pt[3] = {&a->v.scale, &a->v.min, &a->v.sum};
    for (int d0 = 0; d0 < c->Dv; d0 += 16) {
        prefetch_v_tile(c, t0, n, d0, d0 + 16, BITS, P);
        __m128i tp[3][2][8]; /* scale, min, sum; channels d0.., d0 + 8..; group */
        __m512 o[KVD__ATTN_MAXG];
        for (int k = 0; tparams && k < 3; k++)
            for (int hf = 0; hf < 2; hf++)
                load_t8_u16((const char *)pt[k]->data + c->h * pt[k]->stride[0] +
                                (d0 + 8 * hf) * pt[k]->stride[1] + (t0 / P) * 2,
                            pt[k]->stride[1], ngb, tp[k][hf]);
        for (int gi = 0; gi < ngb; gi++) {
            int64_t grp = t0 / P + gi;
            const uint8_t *r0 = cbase + d0 * cst + gi * (P / PER);
            __m512 vsc, vmn, vcs;
            if (tparams) {
                vsc = _mm512_cvtph_ps(_mm256_set_m128i(tp[0][1][gi], tp[0][0][gi]));
                vmn = _mm512_cvtph_ps(_mm256_set_m128i(tp[1][1][gi], tp[1][0][gi]));
                vcs = _mm512_cvtepi32_ps(
                    _mm512_cvtepu16_epi32(_mm256_set_m128i(tp[2][1][gi], tp[2][0][gi])));
            } else {
                vsc = CAT512F(param_col(pt[0], c->h, d0, grp, 0),
                              param_col(pt[0], c->h, d0 + 8, grp, 0));
                vmn = CAT512F(param_col(pt[1], c->h, d0, grp, 0),
                              param_col(pt[1], c->h, d0 + 8, grp, 0));
                vcs = CAT512F(param_col(pt[2], c->h, d0, grp, 1),
                              param_col(pt[2], c->h, d0 + 8, grp, 1));
            }
            __m512i X[16], PL[16][4];
            if (gi == 0)
                for (int g = 0; g < GG; g++)
                    o[g] = _mm512_loadu_ps(acc + (size_t)g * c->Dv + d0);
            load_cols16(r0, cst, X, COLS);
            _Pragma("GCC unroll 16") for (int cc = 0; cc < COLS; cc++)
            {
                const __m512i x = X[cc];
                _Pragma("GCC unroll 4") for (int pl = 0; pl < PER; pl++) PL[cc][pl] =
                    _mm512_and_si512(_mm512_srli_epi16(x, pl * BITS), mask);
            }
            for (int g = 0; g < GG; g++) {
                const int32_t *pat = vp + ((size_t)gi * GG + g) * COLS * PER;
                __m512i ap[4], acc32 = _mm512_setzero_si512();
                _Pragma("GCC unroll 4") for (int pl = 0; pl < PER; pl++) ap[pl] =
                    _mm512_setzero_si512();
                _Pragma("GCC unroll 16") for (int cc = 0; cc < COLS; cc++) _Pragma(
                    "GCC unroll 4") for (int pl = 0; pl < PER; pl++) ap[pl] =
                    _mm512_dpbusd_epi32(ap[pl], _mm512_set1_epi32(pat[cc * PER + pl]), PL[cc][pl]);
                _Pragma("GCC unroll 4") for (int pl = 0; pl < PER; pl++) acc32 =
                    _mm512_add_epi32(acc32, ap[pl]);
                /* sc * (sP*S + mP*cs) + mn * (sP*sum8 + P*mP) */
                __m512 t = _mm512_fmadd_ps(_mm512_set1_ps(vr.sP[gi][g]), _mm512_cvtepi32_ps(acc32),
                                           _mm512_mul_ps(_mm512_set1_ps(vr.mP[gi][g]), vcs));
                o[g] = _mm512_fmadd_ps(vsc, t, o[g]);
                o[g] = _mm512_fmadd_ps(vmn, _mm512_set1_ps(vr.corr[gi][g]), o[g]);
            }
        }
        for (int g = 0; g < GG && ngb > 0; g++)
            _mm512_storeu_ps(acc + (size_t)g * c->Dv + d0, o[g]);
    }
}

INT512_TARGET static void int_values_channel_512(const int_ctx *c, int64_t t0, int n,
                                                 const float *p, int ld, float *acc)
{
    const int bits = c->a->v.bits, P = c->a->v.group;
#define KVD__VT(B, PP)                                                                             \
    else if (bits == B && P == PP)                                                                 \
    {                                                                                              \
        if (c->G == 4)                                                                             \
            int_values512_tpl(c, t0, n, p, ld, acc, B, PP, 4);                                     \
        else                                                                                       \
            int_values512_tpl(c, t0, n, p, ld, acc, B, PP, 0);                                     \
    }
    if (0) {
    }
    KVD__VT(2, 32) KVD__VT(2, 64) KVD__VT(2, 128) KVD__VT(4, 32) KVD__VT(4, 64) KVD__VT(4, 128)
#undef KVD__VT
}

/*
 * int_scores_tpl's VNNI path on AVX-512 (VNNI, BW): 16 tokens a step, two
 * 8-row halves loaded and transposed as there, then joined, so that the
 * planes' masks, the dot products and the float sums take one instruction
 * for 16 tokens; the tokens short of 16 go through int_scores_avx2. Each
 * lane computes what int_scores_tpl's does, in the same order: the same
 * bits.
 */
INT512_TARGET __attribute__((always_inline)) static inline void
int_scores512_tpl(const int_ctx *c, int64_t t0, int n, float *s, int ld, const int BITS)
{
    const kvd_attn_int_args *a = c->a;
    const int PER = 8 / BITS;
    const int cols = c->kcols, ng = c->kng, cpg = cols / ng;
    const __m512i mask = _mm512_set1_epi8((char)((1 << BITS) - 1));
    __m256i X0[KVD__INT_MAXCOLS], X1[KVD__INT_MAXCOLS];
    __m512i PL[KVD__INT_MAXCOLS][PER];
    const int t8 = kparams_t8(c);
    int i = 0;
    for (; i + 16 <= n; i += 16) {
        const int64_t t = t0 + i;
        prefetch_k_ahead(c, t, 16);
        load_k8(c, t, X0);
        load_k8(c, t + 8, X1);
        for (int cc = 0; cc < cols; cc++) {
            const __m512i x = CAT512I(X0[cc], X1[cc]);
            _Pragma("GCC unroll 4") for (int pl = 0; pl < PER; pl++) PL[cc][pl] =
                _mm512_and_si512(_mm512_srli_epi16(x, pl * BITS), mask);
        }
        __m512 sc[8], mn[8]; /* ng <= 8 on this path */
        if (t8) {
            __m128i ts[2][8], tm[2][8];
            for (int hf = 0; hf < 2; hf++) {
                load_t8_u16((const char *)a->k.scale.data + c->h * a->k.scale.stride[0] +
                                (t + 8 * hf) * a->k.scale.stride[1],
                            a->k.scale.stride[1], ng, ts[hf]);
                load_t8_u16((const char *)a->k.min.data + c->h * a->k.min.stride[0] +
                                (t + 8 * hf) * a->k.min.stride[1],
                            a->k.min.stride[1], ng, tm[hf]);
            }
            for (int grp = 0; grp < ng; grp++) {
                sc[grp] = _mm512_cvtph_ps(_mm256_set_m128i(ts[1][grp], ts[0][grp]));
                mn[grp] = _mm512_cvtph_ps(_mm256_set_m128i(tm[1][grp], tm[0][grp]));
            }
        } else
            for (int grp = 0; grp < ng; grp++) {
                sc[grp] = CAT512F(params8(&a->k.scale, c->h, t, grp, ng),
                                  params8(&a->k.scale, c->h, t + 8, grp, ng));
                mn[grp] = CAT512F(params8(&a->k.min, c->h, t, grp, ng),
                                  params8(&a->k.min, c->h, t + 8, grp, ng));
            }
        for (int g = 0; g < c->G; g++) {
            const int32_t *pat = c->qpat + (size_t)g * cols * PER;
            __m512 dot = _mm512_setzero_ps();
            for (int grp = 0; grp < ng; grp++) {
                __m512i ap[4], acc32 = _mm512_setzero_si512();
                _Pragma("GCC unroll 4") for (int pl = 0; pl < PER; pl++) ap[pl] =
                    _mm512_setzero_si512();
                for (int cc = grp * cpg; cc < (grp + 1) * cpg; cc++)
                    _Pragma("GCC unroll 4") for (int pl = 0; pl < PER; pl++) ap[pl] =
                        _mm512_dpbusd_epi32(ap[pl], PL[cc][pl],
                                            _mm512_set1_epi32(pat[cc * PER + pl]));
                _Pragma("GCC unroll 4") for (int pl = 0; pl < PER; pl++) acc32 =
                    _mm512_add_epi32(acc32, ap[pl]);
                dot = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc32), sc[grp], dot);
                dot = _mm512_fmadd_ps(_mm512_set1_ps(c->qsum[g * ng + grp]), mn[grp], dot);
            }
            _mm512_storeu_ps(s + (size_t)g * ld + i, _mm512_mul_ps(dot, _mm512_set1_ps(c->sq[g])));
        }
    }
    if (i < n)
        int_scores_avx2((void *)c, t0 + i, n - i, s + i, ld);
}

INT512_TARGET static void int_scores_512(const int_ctx *c, int64_t t0, int n, float *s, int ld)
{
    if (c->kbits == 2)
        int_scores512_tpl(c, t0, n, s, ld, 2);
    else
        int_scores512_tpl(c, t0, n, s, ld, 4);
}

__attribute__((target("avx2,fma,f16c"))) static void
int_values_channel_avx2(const int_ctx *c, int64_t t0, int n, const float *p, int ld, float *acc)
{
    int bits = c->a->v.bits, P = c->a->v.group;
    if (c->v512 && (bits == 2 || bits == 4) && (P == 32 || P == 64 || P == 128)) {
        int_values_channel_512(c, t0, n, p, ld, acc);
        return;
    }
#define KVD__VT(B, PP)                                                                             \
    else if (bits == B && P == PP)                                                                 \
    {                                                                                              \
        if (c->vnni == 2 && c->G == 4)                                                             \
            int_values_tpl(c, t0, n, p, ld, acc, B, PP, 2, 4);                                     \
        else if (c->vnni == 2)                                                                     \
            int_values_tpl(c, t0, n, p, ld, acc, B, PP, 2, 0);                                     \
        else if (c->vnni && c->G == 4)                                                             \
            int_values_tpl(c, t0, n, p, ld, acc, B, PP, 1, 4);                                     \
        else if (c->vnni)                                                                          \
            int_values_tpl(c, t0, n, p, ld, acc, B, PP, 1, 0);                                     \
        else if (c->G == 4)                                                                        \
            int_values_tpl(c, t0, n, p, ld, acc, B, PP, 0, 4);                                     \
        else                                                                                       \
            int_values_tpl(c, t0, n, p, ld, acc, B, PP, 0, 0);                                     \
    }
    if (0) {
    }
    KVD__VT(2, 32) KVD__VT(2, 64) KVD__VT(2, 128) KVD__VT(4, 32) KVD__VT(4, 64) KVD__VT(4, 128)
#undef KVD__VT
    else
        int_values_channel_scalar(c, t0, n, p, ld, acc);
}

/* Token-axis values (KIVI): out_d += (p*scale) * c_d + p*min, codes of one
 * row unpacked to floats once for all G heads. */
static void int_values_token(const int_ctx *c, int64_t t0, int n, const float *p, int ld, float *acc)
{
    const kvd_attn_int_args *a = c->a;
    int Dv = c->Dv, P = a->v.group, ng = Dv / P;
    float cf[4096];
    for (int i = 0; i < n; i++) {
        int64_t t = t0 + i;
        const uint8_t *cr = qrow(&a->v.codes, c->h, t);
        for (int dd = 0; dd < Dv; dd++)
            cf[dd] = (float)code_at(cr, dd, a->v.bits);
        for (int grp = 0; grp < ng; grp++) {
            float sc = f16_at(&a->v.scale, c->h, t, grp), mn = f16_at(&a->v.min, c->h, t, grp);
            for (int g = 0; g < c->G; g++) {
                float pg = p[(size_t)g * ld + i];
                if (pg == 0.0f)
                    continue;
                float w = pg * sc, b = pg * mn;
                float *ag = acc + (size_t)g * Dv + grp * P;
                const float *cg = cf + grp * P;
                for (int j = 0; j < P; j++)
                    ag[j] += w * cg[j] + b;
            }
        }
    }
}

/* The 8 codes at p (channels of one token row, 2 or 4 bits each, the first
 * in the lowest bits) as floats. */
__attribute__((target("avx2,fma,f16c"), always_inline)) static inline __m256
unpack8_codes(const uint8_t *p, __m256i shifts, __m256i mask, const int BITS)
{
    uint32_t x = 0;
    memcpy(&x, p, BITS); /* 2 bytes (INT2) or 4 (INT4) */
    return _mm256_cvtepi32_ps(
        _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int)x), shifts), mask));
}

/* The scales and mins of the block's tokens in all ng = 2, 4 or 8 channel
 * groups, as floats: prm[grp][i] the scale, prm[ng + grp][i] the min of
 * token i. A token row's ng values of 8 tokens come in by one transpose
 * (load_t8_u16). Tokens from n - n % 8 on are left to the caller. */
__attribute__((target("avx2,fma,f16c"), always_inline)) static inline void
vtok_params(const int_ctx *c, int64_t t0, int n, int ng, float (*prm)[KVD__ATTN_BLOCK])
{
    const kvd_tensor *pt[2] = {&c->a->v.scale, &c->a->v.min};
    for (int k = 0; k < 2; k++) {
        const int64_t rs = pt[k]->stride[1];
        const char *base = (const char *)pt[k]->data + c->h * pt[k]->stride[0] + t0 * rs;
        for (int i = 0; i + 8 <= n; i += 8) {
            __m128i x[8];
            load_t8_u16(base + i * rs, rs, ng, x);
            for (int grp = 0; grp < ng; grp++)
                _mm256_store_ps(&prm[k * ng + grp][i], _mm256_cvtph_ps(x[grp]));
        }
    }
}

/* The block after [t0, t0 + n): in this segment, or the first of the next
 * (a run's pages): its segment, first token and token count; 0 when there
 * is none. */
static inline int next_block(const int_ctx *c, int64_t t0, int n, const kvd_attn_int_args **seg,
                             int64_t *first, int64_t *count)
{
    const kvd_attn_int_args *a = c->a;
    int64_t f = t0 + n, left = a->n_tokens - f;
    if (left <= 0) {
        if (!c->next)
            return 0;
        a = c->next;
        f = 0;
        left = a->n_tokens;
    }
    *seg = a;
    *first = f;
    *count = left < n ? left : n;
    return *count > 0;
}

/* The token-axis value code rows of the block after [t0, t0 + n)
 * (next_block): *rows the first, *rs apart, *count of them (0: none). */
static inline void vtok_next_rows(const int_ctx *c, int64_t t0, int n, const uint8_t **rows,
                                  int64_t *rs, int64_t *count)
{
    const kvd_attn_int_args *a;
    int64_t first, cnt;
    if (!next_block(c, t0, n, &a, &first, &cnt))
        return;
    const kvd_tensor *tc = &a->v.codes;
    *rs = tc->stride[1];
    *rows = (const uint8_t *)tc->data + c->h * tc->stride[0] + first * *rs;
    *count = cnt;
}

/* Ask for the scales and mins of the block after [t0, t0 + n)
 * (next_block): their first loads missed as well. */
static inline void vtok_prefetch_next_params(const int_ctx *c, int64_t t0, int n)
{
    const kvd_attn_int_args *a;
    int64_t first, cnt;
    if (!next_block(c, t0, n, &a, &first, &cnt))
        return;
    const kvd_tensor *pt[2] = {&a->v.scale, &a->v.min};
    for (int k = 0; k < 2; k++) {
        const int64_t rs = pt[k]->stride[1];
        const char *b = (const char *)pt[k]->data + c->h * pt[k]->stride[0] + first * rs;
        if (rs <= 64)
            for (int64_t o = 0; o < cnt * rs; o += 64)
                __builtin_prefetch(b + o);
        else
            for (int64_t r = 0; r < cnt; r++)
                __builtin_prefetch(b + r * rs);
    }
}

/* vtok_params with the group count a constant (for load_t8_u16); 0 and
 * prm untouched when it is not 2, 4 or 8. */
__attribute__((target("avx2,fma,f16c"), always_inline)) static inline int
vtok_params_any(const int_ctx *c, int64_t t0, int n, int ng, float (*prm)[KVD__ATTN_BLOCK])
{
    if (ng == 4)
        vtok_params(c, t0, n, 4, prm);
    else if (ng == 2)
        vtok_params(c, t0, n, 2, prm);
    else if (ng == 8)
        vtok_params(c, t0, n, 8, prm);
    else
        return 0;
    return 1;
}

/* The weights p * scale of the block's tokens in channel group grp (w[g][i]
 * for head g and token i) and the sums p * min, one per head (bias[g] += ),
 * of the token-axis values. prm: vtok_params's, or NULL (each group's
 * parameters gathered by params8). */
__attribute__((target("avx2,fma,f16c"), always_inline)) static inline void
vtok_weights(const int_ctx *c, int64_t t0, int n, const float *p, int ld, int grp, const int GG,
             const float (*prm)[KVD__ATTN_BLOCK], float (*w)[KVD__ATTN_BLOCK], float *bias)
{
    const kvd_attn_int_args *a = c->a;
    const int ng = c->Dv / a->v.group;
    const kvd_tensor *ts = &a->v.scale, *tm = &a->v.min;
    const char *sp = (const char *)ts->data + c->h * ts->stride[0] + t0 * ts->stride[1] + grp * 2;
    const char *mp = (const char *)tm->data + c->h * tm->stride[0] + t0 * tm->stride[1] + grp * 2;
    __m256 bv[8];
    _Pragma("GCC unroll 8") for (int g = 0; g < 8; g++) bv[g] = _mm256_setzero_ps();
    int i = 0;
    /* scales and mins of 8 tokens at a time (params8: assembled in
     * registers, as a store/reload would stall store forwarding) */
    for (; i + 8 <= n; i += 8) {
        __m256 sc = prm ? _mm256_load_ps(&prm[grp][i]) : params8(ts, c->h, t0 + i, grp, ng);
        __m256 mn = prm ? _mm256_load_ps(&prm[ng + grp][i]) : params8(tm, c->h, t0 + i, grp, ng);
        _Pragma("GCC unroll 8") for (int g = 0; g < GG; g++)
        {
            __m256 pg = _mm256_loadu_ps(p + (size_t)g * ld + i);
            _mm256_store_ps(&w[g][i], _mm256_mul_ps(pg, sc));
            bv[g] = _mm256_fmadd_ps(pg, mn, bv[g]);
        }
    }
    _Pragma("GCC unroll 8") for (int g = 0; g < GG; g++)
    {
        __m128 h = _mm_add_ps(_mm256_castps256_ps128(bv[g]), _mm256_extractf128_ps(bv[g], 1));
        h = _mm_add_ps(h, _mm_movehl_ps(h, h));
        bias[g] += _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
    }
    for (; i < n; i++) {
        uint16_t xs, xm;
        memcpy(&xs, sp + i * ts->stride[1], 2);
        memcpy(&xm, mp + i * tm->stride[1], 2);
        float sc = kvd_f16_to_f32(xs), mn = kvd_f16_to_f32(xm);
        _Pragma("GCC unroll 8") for (int g = 0; g < GG; g++)
        {
            float pg = p[(size_t)g * ld + i];
            w[g][i] = pg * sc;
            bias[g] += pg * mn;
        }
    }
}

/* Token-axis values (KIVI), AVX2: out_{g,d} += sum_t (p_{g,t} sc_{t,grp}) c_{t,d}
 * + sum_t p_{g,t} mn_{t,grp}. The second sum is one number per query head
 * and channel group, added to the group's channels once per block. For each
 * group the weights p * scale of the block's tokens are formed once; then
 * every 8-channel tile keeps its GG accumulators in registers over the
 * block, unpacking each token's 8 codes once for all query heads.
 * GT: the query heads as a compile-time constant (0: the run-time gn <= 8).
 * Needs Dv % 8 == 0, group % 8 == 0. */
__attribute__((target("avx2,fma,f16c"), always_inline)) static inline void
int_values_token_tpl(const int_ctx *c, int64_t t0, int n, const float *p, int ld, float *acc,
                     const int BITS, const int GT, const int gn)
{
    const kvd_attn_int_args *a = c->a;
    const int Dv = c->Dv, P = a->v.group, ng = Dv / P, GG = GT ? GT : gn, PER = 8 / BITS;
    const __m256i shifts = BITS == 2 ? _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14)
                                     : _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
    const __m256i mask = _mm256_set1_epi32((1 << BITS) - 1);
    const kvd_tensor *tc = &a->v.codes;
    _Alignas(32) float w[8][KVD__ATTN_BLOCK];
    _Alignas(32) float prm[16][KVD__ATTN_BLOCK];
    vtok_prefetch_next_params(c, t0, n);
    const int by_row = vtok_params_any(c, t0, n, ng, prm);
    for (int grp = 0; grp < ng; grp++) {
        float bias[8] = {0};
        vtok_weights(c, t0, n, p, ld, grp, GG, by_row ? (const float(*)[KVD__ATTN_BLOCK])prm : NULL,
                     w, bias);
        int d0 = grp * P;
        /* Up to 4 heads: tiles of 16 channels, whose 8 sums stay in
         * registers; the codes of a token's 16 channels unpack from one
         * broadcast (INT2) or two (INT4), and each weight is broadcast once
         * for both halves. */
        for (; GG <= 4 && P % 16 == 0 && d0 < (grp + 1) * P; d0 += 16) {
            __m256 o[4][2];
            _Pragma("GCC unroll 4") for (int g = 0; g < 4; g++)
            {
                o[g][0] = _mm256_setzero_ps();
                o[g][1] = _mm256_setzero_ps();
            }
            const uint8_t *cp =
                (const uint8_t *)tc->data + c->h * tc->stride[0] + t0 * tc->stride[1] + d0 / PER;
            const int64_t rs = tc->stride[1];
            const __m256i shi = _mm256_add_epi32(shifts, _mm256_set1_epi32(16));
            /* the next block's code rows, asked for by the first tile */
            const uint8_t *nx = NULL;
            int64_t nrs = rs, ahead = 0;
            if (d0 == 0)
                vtok_next_rows(c, t0, n, &nx, &nrs, &ahead);
            for (int t = 0; t < n; t++, cp += rs) {
                if (t < ahead)
                    __builtin_prefetch(nx + t * nrs);
                uint32_t x0, x1 = 0;
                memcpy(&x0, cp, 4);
                if (BITS == 4)
                    memcpy(&x1, cp + 4, 4);
                const __m256i v0 = _mm256_set1_epi32((int)x0);
                const __m256i v1 = BITS == 2 ? v0 : _mm256_set1_epi32((int)x1);
                const __m256 c0 =
                    _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srlv_epi32(v0, shifts), mask));
                const __m256 c1 = _mm256_cvtepi32_ps(
                    _mm256_and_si256(_mm256_srlv_epi32(v1, BITS == 2 ? shi : shifts), mask));
                _Pragma("GCC unroll 4") for (int g = 0; g < GG; g++)
                {
                    const __m256 wb = _mm256_broadcast_ss(&w[g][t]);
                    o[g][0] = _mm256_fmadd_ps(wb, c0, o[g][0]);
                    o[g][1] = _mm256_fmadd_ps(wb, c1, o[g][1]);
                }
            }
            _Pragma("GCC unroll 4") for (int g = 0; g < GG; g++)
            {
                float *ag = acc + (size_t)g * Dv + d0;
                const __m256 b = _mm256_set1_ps(bias[g]);
                _mm256_storeu_ps(ag, _mm256_add_ps(_mm256_loadu_ps(ag), _mm256_add_ps(o[g][0], b)));
                _mm256_storeu_ps(ag + 8,
                                 _mm256_add_ps(_mm256_loadu_ps(ag + 8), _mm256_add_ps(o[g][1], b)));
            }
        }
        for (; d0 < (grp + 1) * P; d0 += 8) {
            /* two accumulators per head when there are few heads: more
             * independent FMA chains than the FMA latency needs */
            __m256 o[8], o2[8];
            _Pragma("GCC unroll 8") for (int g = 0; g < 8; g++)
            {
                o[g] = _mm256_setzero_ps();
                o2[g] = _mm256_setzero_ps();
            }
            const uint8_t *cp =
                (const uint8_t *)tc->data + c->h * tc->stride[0] + t0 * tc->stride[1] + d0 / PER;
            const int64_t rs = tc->stride[1];
            if (d0 == 0) { /* the next block's code rows, asked for by the first tile */
                const uint8_t *nx = NULL;
                int64_t nrs = rs, ahead = 0;
                vtok_next_rows(c, t0, n, &nx, &nrs, &ahead);
                for (int64_t t = 0; t < ahead; t++)
                    __builtin_prefetch(nx + t * nrs);
            }
            int t = 0;
            for (; GG <= 4 && t + 2 <= n; t += 2, cp += 2 * rs) {
                __m256 c0 = unpack8_codes(cp, shifts, mask, BITS),
                       c1 = unpack8_codes(cp + rs, shifts, mask, BITS);
                _Pragma("GCC unroll 8") for (int g = 0; g < GG; g++)
                {
                    o[g] = _mm256_fmadd_ps(_mm256_broadcast_ss(&w[g][t]), c0, o[g]);
                    o2[g] = _mm256_fmadd_ps(_mm256_broadcast_ss(&w[g][t + 1]), c1, o2[g]);
                }
            }
            for (; t < n; t++, cp += rs) {
                __m256 cf = unpack8_codes(cp, shifts, mask, BITS);
                _Pragma("GCC unroll 8") for (int g = 0; g < GG; g++) o[g] =
                    _mm256_fmadd_ps(_mm256_broadcast_ss(&w[g][t]), cf, o[g]);
            }
            _Pragma("GCC unroll 8") for (int g = 0; g < GG; g++)
            {
                float *ag = acc + (size_t)g * Dv + d0;
                __m256 sum = _mm256_add_ps(_mm256_add_ps(o[g], o2[g]), _mm256_set1_ps(bias[g]));
                _mm256_storeu_ps(ag, _mm256_add_ps(_mm256_loadu_ps(ag), sum));
            }
        }
    }
}

/* The query heads 8 at a time (the registers hold 8 heads' sums). */
__attribute__((target("avx2,fma,f16c"))) static void
int_values_token_avx2(const int_ctx *c, int64_t t0, int n, const float *p, int ld, float *acc)
{
    const int bits = c->a->v.bits;
    for (int g0 = 0; g0 < c->G; g0 += 8) {
        const int gn = c->G - g0 < 8 ? c->G - g0 : 8;
        const float *pg = p + (size_t)g0 * ld;
        float *ag = acc + (size_t)g0 * c->Dv;
#define KVD__VTT(B)                                                                                \
    if (bits == B) {                                                                               \
        if (gn == 4)                                                                               \
            int_values_token_tpl(c, t0, n, pg, ld, ag, B, 4, 4);                                   \
        else if (gn == 8)                                                                          \
            int_values_token_tpl(c, t0, n, pg, ld, ag, B, 8, 8);                                   \
        else                                                                                       \
            int_values_token_tpl(c, t0, n, pg, ld, ag, B, 0, gn);                                  \
        continue;                                                                                  \
    }
        KVD__VTT(2)
        KVD__VTT(4)
#undef KVD__VTT
    }
}

/*
 * int_values_token_tpl's path for up to 4 heads in tiles of 32 channels on
 * AVX-512: each of a token's two 16-channel halves unpacks once (the code
 * words spread over the lanes by vpermd, each lane's code turned into a float
 * by vpermps), and each head's weight is
 * broadcast once for both. Each lane computes what the 16-channel tiles of
 * int_values_token_tpl do, in the same order: the same bits. P % 32 == 0.
 */
INT512_TARGET __attribute__((always_inline)) static inline void
int_values_token512_tpl(const int_ctx *c, int64_t t0, int n, const float *p, int ld, float *acc,
                        const int BITS, const int GG)
{
    const kvd_attn_int_args *a = c->a;
    const int Dv = c->Dv, P = a->v.group, ng = Dv / P, PER = 8 / BITS;
    /* lane j of the first half: channel j of the tile, from 32-bit code
     * word j / (32 / BITS); the second half likewise from the words after */
    const __m512i shifts =
        BITS == 2 ? _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30)
                  : _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 0, 4, 8, 12, 16, 20, 24, 28);
    const __m512i i0 = BITS == 2
                           ? _mm512_set1_epi32(0)
                           : _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    const __m512i i1 = BITS == 2
                           ? _mm512_set1_epi32(1)
                           : _mm512_setr_epi32(2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    /* a code as a float: vpermps reads the low 4 bits of each lane */
    const __m512 lut = BITS == 2
                           ? _mm512_setr_ps(0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3)
                           : _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const kvd_tensor *tc = &a->v.codes;
    const int64_t rs = tc->stride[1];
    _Alignas(64) float w[8][KVD__ATTN_BLOCK];
    _Alignas(32) float prm[16][KVD__ATTN_BLOCK];
    vtok_prefetch_next_params(c, t0, n);
    const int by_row = vtok_params_any(c, t0, n, ng, prm);
    for (int grp = 0; grp < ng; grp++) {
        float bias[8] = {0};
        vtok_weights(c, t0, n, p, ld, grp, GG, by_row ? (const float(*)[KVD__ATTN_BLOCK])prm : NULL,
                     w, bias);
        for (int d0 = grp * P; d0 < (grp + 1) * P; d0 += 32) {
            __m512 o[4][2];
            _Pragma("GCC unroll 4") for (int g = 0; g < 4; g++)
            {
                o[g][0] = _mm512_setzero_ps();
                o[g][1] = _mm512_setzero_ps();
            }
            const uint8_t *cp =
                (const uint8_t *)tc->data + c->h * tc->stride[0] + t0 * rs + d0 / PER;
            /* the first tile asks for the next block's code rows, read
             * while this block is computed (the rows' first loads missed) */
            const uint8_t *nx = NULL;
            int64_t nrs = rs, ahead = 0;
            if (d0 == 0)
                vtok_next_rows(c, t0, n, &nx, &nrs, &ahead);
            for (int t = 0; t < n; t++, cp += rs) {
                if (t < ahead)
                    __builtin_prefetch(nx + t * nrs);
                const __m512i x =
                    _mm512_castsi128_si512(BITS == 2 ? _mm_loadl_epi64((const __m128i *)cp)
                                                     : _mm_loadu_si128((const __m128i *)cp));
                const __m512 c0 = _mm512_permutexvar_ps(
                    _mm512_srlv_epi32(_mm512_permutexvar_epi32(i0, x), shifts), lut);
                const __m512 c1 = _mm512_permutexvar_ps(
                    _mm512_srlv_epi32(_mm512_permutexvar_epi32(i1, x), shifts), lut);
                _Pragma("GCC unroll 4") for (int g = 0; g < GG; g++)
                {
                    const __m512 wb = _mm512_set1_ps(w[g][t]);
                    o[g][0] = _mm512_fmadd_ps(wb, c0, o[g][0]);
                    o[g][1] = _mm512_fmadd_ps(wb, c1, o[g][1]);
                }
            }
            _Pragma("GCC unroll 4") for (int g = 0; g < GG; g++)
            {
                float *ag = acc + (size_t)g * Dv + d0;
                const __m512 b = _mm512_set1_ps(bias[g]);
                _mm512_storeu_ps(ag, _mm512_add_ps(_mm512_loadu_ps(ag), _mm512_add_ps(o[g][0], b)));
                _mm512_storeu_ps(
                    ag + 16, _mm512_add_ps(_mm512_loadu_ps(ag + 16), _mm512_add_ps(o[g][1], b)));
            }
        }
    }
}

INT512_TARGET static void int_values_token_512(const int_ctx *c, int64_t t0, int n, const float *p,
                                               int ld, float *acc)
{
    const int bits = c->a->v.bits;
    if (c->G == 4) {
        if (bits == 2)
            int_values_token512_tpl(c, t0, n, p, ld, acc, 2, 4);
        else
            int_values_token512_tpl(c, t0, n, p, ld, acc, 4, 4);
    } else if (bits == 2)
        int_values_token512_tpl(c, t0, n, p, ld, acc, 2, c->G);
    else
        int_values_token512_tpl(c, t0, n, p, ld, acc, 4, c->G);
}

static void int_values_cb(void *vctx, int64_t t0, int n, const float *p, int ld, float *acc)
{
    const int_ctx *c = vctx;
    if (c->a->v.axis == KVD_ATTN_AXIS_CHANNEL) {
        if (c->simd && c->Dv % 8 == 0 && c->a->v.group <= 128 && (c->a->v.group * c->a->v.bits) % 32 == 0)
            int_values_channel_avx2(c, t0, n, p, ld, acc);
        else
            int_values_channel_scalar(c, t0, n, p, ld, acc);
    } else if (c->simd && c->Dv % 8 == 0 && c->a->v.group % 8 == 0 &&
               (c->a->v.bits == 2 || c->a->v.bits == 4)) {
        if (c->v512 && c->G <= 4 && c->a->v.group % 32 == 0)
            int_values_token_512(c, t0, n, p, ld, acc);
        else
            int_values_token_avx2(c, t0, n, p, ld, acc);
    } else {
        int_values_token(c, t0, n, p, ld, acc);
    }
}

/* *dst = x in all 8 lanes (dst 32-byte aligned; the caller checked AVX2) */
__attribute__((target("avx2"))) static void store_bcast32(__m256i *dst, int32_t x)
{
    _mm256_store_si256(dst, _mm256_set1_epi32(x));
}

/* Which vpdpbusd the CPU runs (dpbusd's FORM): 1 for AVX-VNNI (CPUID leaf
 * 7 sub-leaf 1, EAX bit 4), else 2 for AVX512-VNNI with AVX512VL (leaf 7
 * sub-leaf 0, ECX bit 11 and EBX bit 31) where the OS saves the AVX-512
 * state (XCR0 bits 1, 2 and 5-7), else 0. Read with cpuid directly:
 * __builtin_cpu_supports has no "avxvnni" in clang 14 or older gcc, and an
 * unknown feature name does not compile there. KVD_NO_VNNI set: 0. */
static int vnni_form(void)
{
    static atomic_int form = -1;
    int f = atomic_load(&form);
    if (f < 0) {
        unsigned a, b, c, d, max;
        f = 0;
        __asm__ volatile("cpuid" : "=a"(max), "=b"(b), "=c"(c), "=d"(d) : "a"(0), "c"(0));
        if (max >= 7) {
            __asm__ volatile("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(7), "c"(1));
            if ((a >> 4) & 1)
                f = 1;
            __asm__ volatile("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(1), "c"(0));
            const int osxsave = (c >> 27) & 1;
            __asm__ volatile("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(7), "c"(0));
            if (!f && osxsave && ((c >> 11) & 1) && ((b >> 31) & 1)) {
                unsigned lo, hi;
                __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
                if ((lo & 0xe6) == 0xe6)
                    f = 2;
            }
        }
        atomic_store(&form, f);
    }
    return getenv("KVD_NO_VNNI") ? 0 : f;
}

/* One kv head of kvd_cpu_attn_int_fast (kvd__par_for). */
typedef struct int_job {
    const kvd_attn_int_args *a;
    int G, D, Dv, simd, vnni, vblock;
    int v512, kch512; /* int_ctx's, the same for every head */
    int64_t Tt;
    atomic_int rc;
} int_job;

static void int_head(void *arg, int h)
{
    int_job *job = arg;
    const kvd_attn_int_args *a = job->a;
    const kvd_attn_dims *d = &a->dims;
    const int G = job->G, D = job->D, Dv = job->Dv, simd = job->simd, vnni = job->vnni,
              vblock = job->vblock;
    const int64_t Tt = job->Tt;
    int_ctx c;
    memset(&c, 0, sizeof c);
    c.a = a;
    c.h = h;
    c.G = G;
    c.D = D;
    c.Dv = Dv;
    c.simd = simd;
    c.vnni = vnni;
    c.v512 = job->v512;
    c.kch512 = job->kch512;
    int kb = a->k.bits ? a->k.bits : 2;
    c.kbits = kb;
    c.kper = 8 / kb;
    c.kP = a->k.group > 0 ? a->k.group : D;
    c.kng = c.kP > 0 ? D / c.kP : 0;
    c.kcols = D * kb / 32;
    size_t need = sizeof(float) * (size_t)G                              /* sq */
                  + (size_t)G * D                                        /* q8 */
                  + sizeof(float) * (size_t)G * (c.kng + 1)              /* qsum */
                  + sizeof(int32_t) * (size_t)G * (c.kcols + 1) * c.kper /* qpat */
                  + sizeof(float) * (size_t)16 * (c.kng + 1)             /* ktmp */
                  + sizeof(float) * (size_t)G * D                        /* scaled q */
                  + 32 * (size_t)G * (c.kcols + 1) * c.kper              /* qpatv */
                  + 32 * (size_t)G * 64                                  /* vpatv */
                  + 128;
    /* channel-grouped keys only: per-group query weights of a block
     * (kept out of the token-axis case: a page-by-page caller pays this
     * allocation once per page and kv head) */
    const int kch = a->k.axis == KVD_ATTN_AXIS_CHANNEL;
    size_t wbytes = kch ? sizeof(float) * (size_t)(8 * G * D + 1) : 0,
           sbytes = kch ? sizeof(float) * KVD__ATTN_BLOCK * (size_t)G : 0,
           w8bytes = kch ? (size_t)KVD__ATTN_BLOCK / 2 * G * (D + 2) : 0;
    need += wbytes + 2 * sbytes + w8bytes;
    char *buf = malloc(need);
    if (!buf) {
        atomic_store(&job->rc, KVD_ENOMEM);
        return;
    }
    char *b = buf;
    /* 32-byte aligned blocks first (malloc gives 16) */
    b = (char *)(((uintptr_t)b + 31) & ~(uintptr_t)31);
    c.qpatv = (__m256i *)b;
    b += 32 * (size_t)G * (c.kcols + 1) * c.kper;
    c.vpatv = (__m256i *)b;
    b += 32 * (size_t)G * 64;
    c.sq = (float *)b;
    b += sizeof(float) * (size_t)G;
    c.qsum = (float *)b;
    b += sizeof(float) * (size_t)G * (c.kng + 1);
    c.qpat = (int32_t *)b;
    b += sizeof(int32_t) * (size_t)G * (c.kcols + 1) * c.kper;
    c.ktmp = (float *)b;
    b += sizeof(float) * (size_t)16 * (c.kng + 1);
    float *qs = (float *)b;
    b += sizeof(float) * (size_t)G * D;
    c.wtmp = (float *)b;
    b += wbytes;
    c.ksw = (float *)b;
    b += sbytes;
    c.kbias = (float *)b;
    b += sbytes;
    c.q8 = (int8_t *)b;
    b += (size_t)G * D;
    c.kw8 = (int8_t *)(((uintptr_t)b + 1) & ~(uintptr_t)1); /* read as int16 pairs */
    for (int g = 0; g < G; g++) {
        const float *qr =
            (const float *)((const char *)a->q.data + (int64_t)(h * G + g) * a->q.stride[0]);
        int8_t *q8 = c.q8 + (size_t)g * D;
        /* per-item set-up is paid once per page and kv head when the
         * store runs a sequence page by page: keep it vectorised */
        float sq;
        if (!(simd && D % 8 == 0 && quantize_q8_avx2(qr, D, q8, &sq)))
            sq = kvd_attn_quantize_q8(qr, D, q8);
        c.sq[g] = sq * d->softmax_scale;
        if (a->k.axis == KVD_ATTN_AXIS_CHANNEL)
            continue; /* the token-axis patterns below are not used */
        for (int grp = 0; grp < c.kng; grp++) {
            int sum = 0;
            for (int j = grp * c.kP; j < (grp + 1) * c.kP; j++)
                sum += q8[j];
            c.qsum[g * c.kng + grp] = (float)sum;
        }
        if ((D * kb) % 32 == 0 && c.kcols <= KVD__INT_MAXCOLS) {
            int32_t *pt = c.qpat + (size_t)g * c.kcols * c.kper;
            build_patterns_i8(q8, c.kcols, kb, pt);
            for (int k = 0; simd && k < c.kcols * c.kper; k++)
                store_bcast32(&c.qpatv[(size_t)g * c.kcols * c.kper + k], pt[k]);
        }
    }
    kvd__attn_scaled_q(d, &a->q, h, qs);
    /* One source per segment: a copy of the context (the query's set-up
     * and scratch shared) over a copy of the arguments holding the
     * segment's codes. */
    const int nseg = a->n_segments ? a->n_segments : 1;
    kvd__attn_src src1[2], *src = src1;
    int_ctx *cs = &c;
    kvd_attn_int_args *as = NULL;
    if (a->n_segments) {
        src = malloc((size_t)(nseg + 1) * sizeof *src);
        cs = malloc((size_t)nseg * sizeof *cs);
        as = malloc((size_t)nseg * sizeof *as);
        if (!src || !cs || !as) {
            atomic_store(&job->rc, KVD_ENOMEM);
            free(src), free(cs), free(as), free(buf);
            return;
        }
    }
    int nsrc = 0;
    for (int i = 0; i < nseg && a->n_tokens > 0; i++) {
        int_ctx *ci = &c;
        if (a->n_segments) {
            const kvd_attn_int_segment *g = &a->segments[i];
            if (g->n_tokens == 0)
                continue;
            as[nsrc] = *a;
            as[nsrc].n_tokens = g->n_tokens;
            as[nsrc].k = g->k;
            as[nsrc].v = g->v;
            as[nsrc].n_segments = 0;
            cs[nsrc] = c;
            cs[nsrc].a = &as[nsrc];
            ci = &cs[nsrc];
        }
        src[nsrc].ctx = ci;
        src[nsrc].n = ci->a->n_tokens;
        src[nsrc].block = vblock;
        src[nsrc].scores = int_scores_cb;
        src[nsrc].values = int_values_cb;
        src[nsrc].rescale = NULL;
        src[nsrc].finish = NULL;
        nsrc++;
    }
    for (int i = 0; a->n_segments && i + 1 < nsrc; i++)
        cs[i].next = cs[i + 1].a; /* the dense tail is added below: not a segment */
    _Alignas(8) char tailctx[KVD__ATTN_DENSE_CTX_BYTES];
    if (Tt > 0) {
        kvd__attn_dense_src(&src[nsrc], tailctx, &a->k_tail, &a->v_tail, NULL, Tt, qs, G, D, Dv, h,
                            simd);
        nsrc++;
    }
    float *o[KVD__ATTN_MAXG], *l[KVD__ATTN_MAXG];
    kvd__attn_out_ptrs(d, &a->out, &a->lse, h, o, l);
    int r = kvd__attn_head_run(src, nsrc, G, Dv, o, l, simd);
    if (r) {
        atomic_store(&job->rc, r);
    }
    if (a->n_segments)
        free(src), free(cs), free(as);
    free(buf);
}

static kvd_attn_qdata qdata_head(kvd_attn_qdata q, int64_t Hkv, int64_t h)
{
    q.codes = kvd__attn_rows(q.codes, Hkv, h, 1);
    q.min = kvd__attn_rows(q.min, Hkv, h, 1);
    q.scale = kvd__attn_rows(q.scale, Hkv, h, 1);
    q.sum = kvd__attn_rows(q.sum, Hkv, h, 1);
    return q;
}

/* More query heads per kv head than the fast path takes at once: each kv
 * head's query heads, KVD__ATTN_MAXG at a time, as calls of their own (one
 * kv head each; every query head's arithmetic is its own, so the bits are
 * those of one call). */
static int int_part(const void *arg, int i)
{
    const kvd_attn_int_args *a = arg;
    const int64_t Hkv = a->dims.n_kv_heads;
    kvd_attn_int_args s = *a;
    const int64_t h = kvd__attn_part(i, KVD__ATTN_MAXG, &s.dims, &s.q, &s.out, &s.lse);
    s.k = qdata_head(a->k, Hkv, h);
    s.v = qdata_head(a->v, Hkv, h);
    s.k_tail = kvd__attn_rows(a->k_tail, Hkv, h, 1);
    s.v_tail = kvd__attn_rows(a->v_tail, Hkv, h, 1);
    kvd_attn_int_segment *segs = NULL;
    if (a->n_segments) {
        if (!(segs = malloc((size_t)a->n_segments * sizeof *segs)))
            return KVD_ENOMEM;
        for (int k = 0; k < a->n_segments; k++) {
            segs[k] = a->segments[k];
            segs[k].k = qdata_head(a->segments[k].k, Hkv, h);
            segs[k].v = qdata_head(a->segments[k].v, Hkv, h);
        }
        s.segments = segs;
    }
    int rc = kvd_cpu_attn_int_fast(&s, 1);
    free(segs);
    return rc;
}

int kvd_cpu_attn_int_fast(const kvd_attn_int_args *a, int nthreads)
{
    const kvd_attn_dims *d = &a->dims;
    int G = d->n_q_heads / d->n_kv_heads, D = d->head_dim, Dv = d->v_dim;
    /* channel-axis blocks hold whole groups: a block is the largest multiple
     * of P that fits KVD__ATTN_BLOCK */
    int vblock = KVD__ATTN_BLOCK;
    if (a->n_tokens > 0 && a->v.axis == KVD_ATTN_AXIS_CHANNEL)
        vblock = a->v.group <= KVD__ATTN_BLOCK ? KVD__ATTN_BLOCK / a->v.group * a->v.group : 0;
    /* channel-grouped keys: blocks hold whole key groups too (the check
     * makes the key group divide KVD__ATTN_BLOCK) */
    if (a->n_tokens > 0 && a->k.axis == KVD_ATTN_AXIS_CHANNEL && vblock % a->k.group)
        vblock = 0;
    if (Dv > 4096 || vblock == 0)
        return kvd_cpu_attn_int_ref(a);
    if (G > KVD__ATTN_MAXG)
        return kvd__attn_split(d, KVD__ATTN_MAXG, nthreads, int_part, a);
    int simd = kvd__attn_simd(), rc = 0;
    int vnni = simd ? vnni_form() : 0;
    int64_t Tt = a->k_tail.ndim == 3 ? a->k_tail.shape[1] : 0;
    /* the *512 kernels: 512-bit vpdpbusd (kvd__attn_simd's level 2, so not
     * with KVD_NO_AVX512; nor with KVD_NO_VNNI, as vnni is 0 then) */
    const int w512 = vnni && simd == 2 && kvd__cpu_has(KVD__CPU_AVX512VNNI);
    int_job j = {.a = a,
                 .G = G,
                 .D = D,
                 .Dv = Dv,
                 .simd = simd,
                 .vnni = vnni,
                 .vblock = vblock,
                 .v512 = w512 && Dv % 16 == 0,
                 .kch512 = w512 && kvd__cpu_has(KVD__CPU_AVX512VBMI),
                 .Tt = Tt};
    atomic_init(&j.rc, 0);
    kvd__par_for(d->n_kv_heads, nthreads, int_head, &j);
    rc = atomic_load(&j.rc);
    return rc;
}
