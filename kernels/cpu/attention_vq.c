/*
 * Fused VQ attention (VecInfer), see kvdepot/attention.h.
 *
 * Per kv head the fast path builds, for the G query heads of the group,
 *   LUT[pos][c][g] = q~_g[pos*dk : (pos+1)*dk] . C_k[c]     (npos x 2^bk x GP)
 * so a token's G scores are npos vector loads and adds (GP = 4 or 8 lanes,
 * one per query head), and accumulates probabilities per value code,
 *   A[pos][c][g] += p_g(t)   for c = vcode[t][pos]
 * so the output is a single pass over the value codebook at the end,
 *   out_g[pos*dv + i] = sum_c A[pos][c][g] * C_v[c][i].
 * Neither K nor V is decoded. The online softmax of the driver rescales its
 * accumulator when the running max grows; A is kept in units of a per-head
 * multiplier instead (A_true = A * mult_g) so a rescale costs nothing, and A
 * is folded into the driver's accumulator if mult_g gets tiny and at the end.
 * With AVX-512, 8-bit value codes of sub-vectors of 4 and up to 4 query heads
 * skip A: each token's codewords go straight into the accumulator, one
 * 16-lane FMA per position (4 heads x 4 dimensions; vq_values_512).
 */
#include <immintrin.h>
#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "common/cpu_internal.h"
#include "kvdepot/attention.h"

/* In-place orthonormal Walsh-Hadamard transform (Sylvester order), n = 2^k. */
static void fwht(float *x, int n)
{
    for (int len = 1; len < n; len <<= 1)
        for (int i = 0; i < n; i += 2 * len)
            for (int j = i; j < i + len; j++) {
                float a = x[j], b = x[j + len];
                x[j] = a + b;
                x[j + len] = a - b;
            }
    float s = 1.0f / sqrtf((float)n);
    for (int i = 0; i < n; i++)
        x[i] *= s;
}

/* q~ = H (q * lambda) of query head hq, kv head h. */
static void transform_query(const kvd_attn_vq_args *a, int h, int hq, float *qt)
{
    int D = a->dims.head_dim;
    const float *q = (const float *)((const char *)a->q.data + (int64_t)hq * a->q.stride[0]);
    const float *lam = a->k_lambda.data
                           ? (const float *)((const char *)a->k_lambda.data + (int64_t)h * a->k_lambda.stride[0])
                           : NULL;
    for (int j = 0; j < D; j++)
        qt[j] = lam ? q[j] * lam[j] : q[j];
    if (a->k_hadamard)
        fwht(qt, D);
}

static inline uint32_t code_at(const kvd_tensor *c, int bits, int64_t h, int64_t t, int pos)
{
    const char *p = (const char *)c->data + h * c->stride[0] + t * c->stride[1];
    if (bits <= 8)
        return ((const uint8_t *)p)[pos];
    uint16_t v;
    memcpy(&v, p + 2 * pos, 2);
    return v;
}

static inline const float *cb_row(const kvd_tensor *cb, int64_t h, uint32_t c)
{
    return (const float *)((const char *)cb->data + h * cb->stride[0] + (int64_t)c * cb->stride[1]);
}

static inline float tail_elem(const kvd_tensor *x, int64_t h, int64_t t, int64_t j)
{
    const char *p = (const char *)x->data + h * x->stride[0] + t * x->stride[1];
    return kvd__load_float(p + j * (int64_t)kvd_dtype_size(x->dtype), x->dtype);
}

/* ---------------------------------------------------------------------- */
/* Reference: decode-free but written as the equation, in double          */
/* ---------------------------------------------------------------------- */

/* The codes of side `v` (0 K, 1 V) of a segmented call in one block
 * (Hkv, T, positions): *t describes it, *buf is to be freed. */
static int vq_flatten(const kvd_attn_vq_args *a, int v, kvd_tensor *t, void **buf)
{
    const int64_t H = a->dims.n_kv_heads, T = a->n_tokens;
    const int bits = v ? a->v_bits : a->k_bits;
    const int64_t np = (v ? a->dims.v_dim / a->v_sub_dim : a->dims.head_dim / a->k_sub_dim);
    const size_t row = (size_t)np * (bits <= 8 ? 1 : 2);
    uint8_t *p = malloc((size_t)(H * T) * row + 1);
    if (!p)
        return KVD_ENOMEM;
    for (int64_t h = 0; h < H; h++) {
        int64_t t = 0;
        for (int i = 0; i < a->n_segments; i++) {
            const kvd_tensor *c = v ? &a->segments[i].v_codes : &a->segments[i].k_codes;
            for (int64_t j = 0; j < a->segments[i].n_tokens; j++, t++)
                memcpy(p + (size_t)(h * T + t) * row,
                       (const char *)c->data + h * c->stride[0] + j * c->stride[1], row);
        }
    }
    int64_t sh[3] = {H, T, np};
    *t = kvd_tensor_make(bits <= 8 ? KVD_DTYPE_U8 : KVD_DTYPE_U16, p, 3, sh);
    *buf = p;
    return 0;
}

int kvd_cpu_attn_vq_ref(const kvd_attn_vq_args *a)
{
    if (a->n_segments) { /* the specification: the segments' codes in one block */
        kvd_attn_vq_args f = *a;
        void *kb = NULL, *vb = NULL;
        int rc = vq_flatten(a, 0, &f.k_codes, &kb);
        if (!rc)
            rc = vq_flatten(a, 1, &f.v_codes, &vb);
        f.n_segments = 0;
        f.segments = NULL;
        if (!rc)
            rc = kvd_cpu_attn_vq_ref(&f);
        free(kb);
        free(vb);
        return rc;
    }
    const kvd_attn_dims *d = &a->dims;
    int G = d->n_q_heads / d->n_kv_heads, D = d->head_dim, Dv = d->v_dim;
    int64_t T = a->n_tokens, Tt = a->k_tail.ndim == 3 ? a->k_tail.shape[1] : 0, N = T + Tt;
    double *s = malloc(sizeof(double) * (size_t)(N + 1));
    float *vals = malloc(sizeof(float) * (size_t)(N * Dv + 1));
    float *qt = malloc(sizeof(float) * (size_t)(D + 1));
    if (!s || !vals || !qt) {
        free(s), free(vals), free(qt);
        return KVD_ENOMEM;
    }
    int dk = a->k_sub_dim, dv = a->v_sub_dim;
    for (int h = 0; h < d->n_kv_heads; h++) {
        for (int64_t t = 0; t < T; t++)
            for (int pos = 0; pos < Dv / dv; pos++) {
                const float *cv = cb_row(&a->v_codebook, h, code_at(&a->v_codes, a->v_bits, h, t, pos));
                for (int i = 0; i < dv; i++)
                    vals[t * Dv + pos * dv + i] = cv[i];
            }
        for (int64_t t = 0; t < Tt; t++)
            for (int j = 0; j < Dv; j++)
                vals[(T + t) * Dv + j] = tail_elem(&a->v_tail, h, t, j);
        for (int g = 0; g < G; g++) {
            int hq = h * G + g;
            const float *q = (const float *)((const char *)a->q.data + (int64_t)hq * a->q.stride[0]);
            transform_query(a, h, hq, qt);
            for (int64_t t = 0; t < T; t++) {
                double dot = 0.0;
                for (int pos = 0; pos < D / dk; pos++) {
                    const float *ck = cb_row(&a->k_codebook, h, code_at(&a->k_codes, a->k_bits, h, t, pos));
                    for (int i = 0; i < dk; i++)
                        dot += (double)qt[pos * dk + i] * ck[i];
                }
                s[t] = dot * d->softmax_scale;
            }
            for (int64_t t = 0; t < Tt; t++) {
                double dot = 0.0;
                for (int j = 0; j < D; j++)
                    dot += (double)q[j] * tail_elem(&a->k_tail, h, t, j);
                s[T + t] = dot * d->softmax_scale;
            }
            kvd__attn_ref_finish(s, N, vals, Dv,
                                 (float *)((char *)a->out.data + (int64_t)hq * a->out.stride[0]),
                                 (float *)((char *)a->lse.data + (int64_t)hq * a->lse.stride[0]));
        }
    }
    free(s), free(vals), free(qt);
    return 0;
}

/* ---------------------------------------------------------------------- */
/* Fast path                                                              */
/* ---------------------------------------------------------------------- */

typedef struct vq_ctx {
    const kvd_attn_vq_args *a;
    int h, G, GP, D, Dv, simd;
    int kpos, vpos, kK, vK; /* positions, codebook sizes */
    float *lut;             /* (kpos, kK, GP) */
    float *A;               /* (vpos, vK, GP) */
    float *cbx;             /* vq_values_512: (vK, 16), codeword c four times; else NULL */
    int s512;               /* scores by vq_scores_512 */
    float mult[KVD__ATTN_MAXG];
    int dirty;
} vq_ctx;

/* The codes of one segment for the head (the driver's source context):
 * LUT and A are the head's, shared by all its segments. */
typedef struct vq_seg {
    vq_ctx *c;
    const char *k, *v; /* row 0 of the head */
    int64_t krs, vrs;  /* row strides, bytes */
    int64_t n;         /* tokens */
} vq_seg;

static inline uint32_t seg_code(const char *base, int64_t rs, int bits, int64_t t, int pos)
{
    const char *p = base + t * rs;
    if (bits <= 8)
        return ((const uint8_t *)p)[pos];
    uint16_t v;
    memcpy(&v, p + 2 * pos, 2);
    return v;
}

/* Fold A into the driver's accumulator: for each position, sum over codes
 * of A[pos][c][g] * C_v[c][:], with the GP query heads in vector lanes. */
__attribute__((target("avx2,fma"))) static void vq_fold_avx2(vq_ctx *c, float *acc)
{
    const kvd_attn_vq_args *a = c->a;
    int dv = a->v_sub_dim, GP = c->GP, K = c->vK;
    __m256 mult = _mm256_setr_ps(c->mult[0], c->mult[1], c->mult[2], c->mult[3], GP > 4 ? c->mult[4] : 0,
                                 GP > 4 ? c->mult[5] : 0, GP > 4 ? c->mult[6] : 0, GP > 4 ? c->mult[7] : 0);
    const float *cb = (const float *)((const char *)a->v_codebook.data + c->h * a->v_codebook.stride[0]);
    __m256 o[16]; /* dv <= 16 on this path */
    for (int pos = 0; pos < c->vpos; pos++) {
        for (int i = 0; i < dv; i++)
            o[i] = _mm256_setzero_ps();
        const float *Ap = c->A + (size_t)pos * K * GP;
        for (int code = 0; code < K; code++) {
            __m256 w = GP == 8 ? _mm256_loadu_ps(Ap + (size_t)code * 8)
                               : _mm256_castps128_ps256(_mm_loadu_ps(Ap + (size_t)code * 4));
            if (GP == 4)
                w = _mm256_insertf128_ps(w, _mm_setzero_ps(), 1);
            const float *cv = cb + (size_t)code * dv;
            int fin = 1;
            for (int i = 0; i < dv; i++)
                fin &= isfinite(cv[i]);
            if (fin) {
                for (int i = 0; i < dv; i++)
                    o[i] = _mm256_fmadd_ps(w, _mm256_set1_ps(cv[i]), o[i]);
            } else {
                /* an Inf/NaN codeword adds nothing where a head's weight is
                 * 0 (never 0 x Inf), as in the reference */
                const __m256 nz = _mm256_cmp_ps(w, _mm256_setzero_ps(), _CMP_NEQ_UQ);
                for (int i = 0; i < dv; i++)
                    o[i] = _mm256_add_ps(
                        o[i], _mm256_and_ps(nz, _mm256_mul_ps(w, _mm256_set1_ps(cv[i]))));
            }
        }
        for (int i = 0; i < dv; i++) {
            float r[8];
            _mm256_storeu_ps(r, _mm256_mul_ps(o[i], mult));
            for (int g = 0; g < c->G; g++)
                acc[(size_t)g * c->Dv + pos * dv + i] += r[g];
        }
    }
}

static void vq_fold(vq_ctx *c, float *acc)
{
    const kvd_attn_vq_args *a = c->a;
    int dv = a->v_sub_dim, GP = c->GP;
    if (c->simd && dv <= 16 && a->v_codebook.stride[1] == (int64_t)dv * 4) {
        vq_fold_avx2(c, acc);
    } else {
        for (int pos = 0; pos < c->vpos; pos++)
            for (int code = 0; code < c->vK; code++) {
                const float *w = c->A + ((size_t)pos * c->vK + code) * GP;
                const float *cv = cb_row(&a->v_codebook, c->h, (uint32_t)code);
                for (int g = 0; g < c->G; g++) {
                    float wg = w[g] * c->mult[g];
                    if (wg == 0.0f)
                        continue;
                    float *ag = acc + (size_t)g * c->Dv + pos * dv;
                    for (int i = 0; i < dv; i++)
                        ag[i] += wg * cv[i];
                }
            }
    }
    memset(c->A, 0, sizeof(float) * (size_t)c->vpos * c->vK * GP);
    for (int g = 0; g < c->G; g++)
        c->mult[g] = 1.0f;
    c->dirty = 0;
}

static void vq_rescale(void *vctx, int g, float f)
{
    vq_ctx *c = ((vq_seg *)vctx)->c;
    c->mult[g] *= f;
}

static void vq_finish(void *vctx, float *acc)
{
    vq_ctx *c = ((vq_seg *)vctx)->c;
    if (c->dirty)
        vq_fold(c, acc);
}

/* Scores of n tokens, acc[t] holding token t's for up to 4 query heads,
 * into s (head g's row at s + g ld): 4 tokens x 4 heads transposed at a
 * time. */
__attribute__((target("avx2,fma"))) static void store_scores4(const __m128 *acc, int n, int G,
                                                              float *s, int ld)
{
    int i = 0;
    for (; i + 4 <= n; i += 4) {
        __m128 r0 = acc[i], r1 = acc[i + 1], r2 = acc[i + 2], r3 = acc[i + 3];
        _MM_TRANSPOSE4_PS(r0, r1, r2, r3);
        const __m128 rr[4] = {r0, r1, r2, r3};
        for (int g = 0; g < G && g < 4; g++)
            _mm_storeu_ps(s + (size_t)g * ld + i, rr[g]);
    }
    for (; i < n; i++) {
        float r[4];
        _mm_storeu_ps(r, acc[i]);
        for (int g = 0; g < G && g < 4; g++)
            s[(size_t)g * ld + i] = r[g];
    }
}

__attribute__((target("avx2,fma"))) static void vq_scores_avx2(void *vctx, int64_t t0, int n,
                                                               float *s, int ld)
{
    const vq_seg *sg = vctx;
    const vq_ctx *c = sg->c;
    const kvd_attn_vq_args *a = c->a;
    int kpos = c->kpos, K = c->kK, G = c->G;
    const char *base = sg->k;
    int64_t rs = sg->krs;
    float r[8];
    if (c->GP == 4 && a->k_bits <= 8 && n <= KVD__ATTN_BLOCK && kpos % 4 == 0) {
        /* the LUT (kpos x K x 4 floats, 128 KB for d4b8) a chunk of 4
         * positions (16 KB) at a time over the block's tokens, as the value
         * side does with A */
        __m128 acc[KVD__ATTN_BLOCK];
        for (int pos0 = 0; pos0 < kpos; pos0 += 4) {
            const float *Lp = c->lut + (size_t)pos0 * K * 4;
            const uint8_t *cr = (const uint8_t *)(base + t0 * rs) + pos0;
            for (int t = 0; t < n; t++, cr += rs) {
                if (pos0 == 0 && t0 + n + t < sg->n) /* the next block's row */
                    __builtin_prefetch(cr + n * rs);
                uint32_t w;
                memcpy(&w, cr, 4);
                __m128 v = _mm_add_ps(
                    _mm_add_ps(_mm_loadu_ps(Lp + (size_t)(w & 255) * 4),
                               _mm_loadu_ps(Lp + (size_t)K * 4 + (size_t)((w >> 8) & 255) * 4)),
                    _mm_add_ps(_mm_loadu_ps(Lp + (size_t)K * 8 + (size_t)((w >> 16) & 255) * 4),
                               _mm_loadu_ps(Lp + (size_t)K * 12 + (size_t)(w >> 24) * 4)));
                acc[t] = pos0 == 0 ? v : _mm_add_ps(acc[t], v);
            }
        }
        store_scores4(acc, n, G, s, ld);
        return;
    }
    for (int i = 0; i < n; i++) {
        const char *row = base + (t0 + i) * rs;
        if (c->GP == 8) {
            __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
            int pos = 0;
            if (a->k_bits <= 8) {
                const uint8_t *cr = (const uint8_t *)row;
                for (; pos + 2 <= kpos; pos += 2) {
                    s0 = _mm256_add_ps(s0, _mm256_loadu_ps(c->lut + ((size_t)pos * K + cr[pos]) * 8));
                    s1 = _mm256_add_ps(s1, _mm256_loadu_ps(c->lut + ((size_t)(pos + 1) * K + cr[pos + 1]) * 8));
                }
                for (; pos < kpos; pos++)
                    s0 = _mm256_add_ps(s0, _mm256_loadu_ps(c->lut + ((size_t)pos * K + cr[pos]) * 8));
            } else {
                const uint16_t *cr = (const uint16_t *)row;
                for (; pos < kpos; pos++)
                    s0 = _mm256_add_ps(s0, _mm256_loadu_ps(c->lut + ((size_t)pos * K + cr[pos]) * 8));
            }
            _mm256_storeu_ps(r, _mm256_add_ps(s0, s1));
        } else {
            __m128 s0 = _mm_setzero_ps(), s1 = _mm_setzero_ps(), s2 = _mm_setzero_ps(), s3 = _mm_setzero_ps();
            int pos = 0;
            if (a->k_bits <= 8) {
                const uint8_t *cr = (const uint8_t *)row;
                const float *Lp = c->lut;
                for (; pos + 4 <= kpos; pos += 4, Lp += (size_t)4 * K * 4) {
                    uint32_t w;
                    memcpy(&w, cr + pos, 4);
                    s0 = _mm_add_ps(s0, _mm_loadu_ps(Lp + (size_t)(w & 255) * 4));
                    s1 = _mm_add_ps(s1, _mm_loadu_ps(Lp + (size_t)K * 4 + (size_t)((w >> 8) & 255) * 4));
                    s2 = _mm_add_ps(s2, _mm_loadu_ps(Lp + (size_t)K * 8 + (size_t)((w >> 16) & 255) * 4));
                    s3 = _mm_add_ps(s3, _mm_loadu_ps(Lp + (size_t)K * 12 + (size_t)(w >> 24) * 4));
                }
                for (; pos < kpos; pos++)
                    s0 = _mm_add_ps(s0, _mm_loadu_ps(c->lut + ((size_t)pos * K + cr[pos]) * 4));
            } else {
                const uint16_t *cr = (const uint16_t *)row;
                for (; pos + 2 <= kpos; pos += 2) {
                    s0 = _mm_add_ps(s0, _mm_loadu_ps(c->lut + ((size_t)pos * K + cr[pos]) * 4));
                    s1 = _mm_add_ps(s1, _mm_loadu_ps(c->lut + ((size_t)(pos + 1) * K + cr[pos + 1]) * 4));
                }
                for (; pos < kpos; pos++)
                    s0 = _mm_add_ps(s0, _mm_loadu_ps(c->lut + ((size_t)pos * K + cr[pos]) * 4));
            }
            _mm_storeu_ps(r, _mm_add_ps(_mm_add_ps(s0, s1), _mm_add_ps(s2, s3)));
        }
        for (int g = 0; g < G; g++)
            s[(size_t)g * ld + i] = r[g];
    }
}

/*
 * vq_scores_avx2's chunked path on AVX-512 (BW, VL) for up to 32 positions,
 * a multiple of 8: the block's codes first become 16-bit byte offsets into
 * their position's table (16 codes a step), so that each lookup is one load
 * of the offset and one add of the LUT entry from memory; positions go 8 at
 * a time (32 KB of the LUT) over the block's tokens.
 */
__attribute__((target("avx512f,avx512bw,avx512vl"))) static void
vq_scores_512(void *vctx, int64_t t0, int n, float *s, int ld)
{
    const vq_seg *sg = vctx;
    const vq_ctx *c = sg->c;
    const int kpos = c->kpos, K = c->kK, G = c->G;
    const int64_t rs = sg->krs;
    _Alignas(64) uint16_t off[KVD__ATTN_BLOCK * 32];
    for (int t = 0; t < n; t++) {
        const uint8_t *cr = (const uint8_t *)(sg->k + (t0 + t) * rs);
        if (t0 + n + t < sg->n) /* the next block's row */
            __builtin_prefetch(cr + n * rs);
        for (int k = 0; k < kpos; k += 16) {
            const __m128i b = kpos - k >= 16 ? _mm_loadu_si128((const __m128i *)(cr + k))
                                             : _mm_maskz_loadu_epi8((__mmask16)0xFF, cr + k);
            _mm256_store_si256((__m256i *)(off + t * 32 + k),
                               _mm256_slli_epi16(_mm256_cvtepu8_epi16(b), 4));
        }
    }
    __m128 acc[KVD__ATTN_BLOCK];
    for (int pos0 = 0; pos0 < kpos; pos0 += 8) {
        const char *L[8];
        for (int j = 0; j < 8; j++)
            L[j] = (const char *)(c->lut + (size_t)(pos0 + j) * K * 4);
        for (int t = 0; t < n; t++) {
            const uint16_t *o = off + t * 32 + pos0;
            __m128 a = _mm_loadu_ps((const float *)(L[0] + o[0])),
                   b = _mm_loadu_ps((const float *)(L[1] + o[1]));
            a = _mm_add_ps(a, _mm_loadu_ps((const float *)(L[2] + o[2])));
            b = _mm_add_ps(b, _mm_loadu_ps((const float *)(L[3] + o[3])));
            a = _mm_add_ps(a, _mm_loadu_ps((const float *)(L[4] + o[4])));
            b = _mm_add_ps(b, _mm_loadu_ps((const float *)(L[5] + o[5])));
            a = _mm_add_ps(a, _mm_loadu_ps((const float *)(L[6] + o[6])));
            b = _mm_add_ps(b, _mm_loadu_ps((const float *)(L[7] + o[7])));
            acc[t] = pos0 == 0 ? _mm_add_ps(a, b) : _mm_add_ps(acc[t], _mm_add_ps(a, b));
        }
    }
    store_scores4(acc, n, G, s, ld);
}

static void vq_scores_scalar(void *vctx, int64_t t0, int n, float *s, int ld)
{
    const vq_seg *sg = vctx;
    const vq_ctx *c = sg->c;
    const kvd_attn_vq_args *a = c->a;
    for (int i = 0; i < n; i++)
        for (int g = 0; g < c->G; g++) {
            float acc = 0.0f;
            for (int pos = 0; pos < c->kpos; pos++)
                acc += c->lut[((size_t)pos * c->kK +
                               seg_code(sg->k, sg->krs, a->k_bits, t0 + i, pos)) *
                                  c->GP +
                              g];
            s[(size_t)g * ld + i] = acc;
        }
}

__attribute__((target("avx2,fma"))) static void vq_values_avx2(void *vctx, int64_t t0, int n,
                                                               const float *p, int ld, float *acc)
{
    const vq_seg *sg = vctx;
    vq_ctx *c = sg->c;
    const kvd_attn_vq_args *a = c->a;
    int G = c->G, GP = c->GP, vpos = c->vpos, K = c->vK;
    float inv[KVD__ATTN_MAXG];
    for (int g = 0; g < G; g++) {
        if (c->mult[g] < 1e-20f) { /* keep p / mult finite: fold now */
            vq_fold(c, acc);
            break;
        }
    }
    for (int g = 0; g < G; g++)
        inv[g] = 1.0f / c->mult[g];
    c->dirty = 1;
    const char *base = sg->v;
    int64_t rs = sg->vrs;
    float *const A = c->A;
    if (GP == 4 && a->v_bits <= 8 && n <= KVD__ATTN_BLOCK) {
        /* A is vpos x K x 4 floats (128 KB for d4b8), beyond L1: a token's
         * 32 updates would each miss it. The block's tokens instead take
         * the positions a chunk at a time, so that the chunk's part of A
         * (VQ_PC positions, 16 KB) stays in L1 over the block. Each entry
         * still receives its tokens in token order: the same sums. */
        enum { VQ_PC = 4 };
        __m128 pv[KVD__ATTN_BLOCK];
        const __m128 inv4 = _mm_setr_ps(inv[0], G > 1 ? inv[1] : 0.0f, G > 2 ? inv[2] : 0.0f,
                                        G > 3 ? inv[3] : 0.0f);
        int i = 0;
        for (; i + 4 <= n; i += 4) {
            __m128 r[4];
            for (int g = 0; g < 4; g++)
                r[g] = g < G ? _mm_loadu_ps(p + (size_t)g * ld + i) : _mm_setzero_ps();
            _MM_TRANSPOSE4_PS(r[0], r[1], r[2], r[3]);
            for (int k = 0; k < 4; k++)
                pv[i + k] = _mm_mul_ps(r[k], inv4);
        }
        for (; i < n; i++) {
            float pt4[4] = {0};
            for (int g = 0; g < G; g++)
                pt4[g] = p[(size_t)g * ld + i] * inv[g];
            pv[i] = _mm_loadu_ps(pt4);
        }
        int pos0 = 0;
        for (; pos0 + VQ_PC <= vpos; pos0 += VQ_PC) {
            float *Ap = A + (size_t)pos0 * K * 4;
            const uint8_t *cr = (const uint8_t *)(base + t0 * rs) + pos0;
            for (int t = 0; t < n; t++, cr += rs) {
                if (pos0 == 0 && t0 + n + t < sg->n) /* the next block's row */
                    __builtin_prefetch(cr + n * rs);
                uint32_t w;
                memcpy(&w, cr, 4);
                float *d0 = Ap + (size_t)(w & 255) * 4,
                      *d1 = Ap + (size_t)K * 4 + (size_t)((w >> 8) & 255) * 4;
                float *d2 = Ap + (size_t)K * 8 + (size_t)((w >> 16) & 255) * 4;
                float *d3 = Ap + (size_t)K * 12 + (size_t)(w >> 24) * 4;
                _mm_storeu_ps(d0, _mm_add_ps(_mm_loadu_ps(d0), pv[t]));
                _mm_storeu_ps(d1, _mm_add_ps(_mm_loadu_ps(d1), pv[t]));
                _mm_storeu_ps(d2, _mm_add_ps(_mm_loadu_ps(d2), pv[t]));
                _mm_storeu_ps(d3, _mm_add_ps(_mm_loadu_ps(d3), pv[t]));
            }
        }
        for (; pos0 < vpos; pos0++)
            for (int t = 0; t < n; t++) {
                const uint8_t *cr = (const uint8_t *)(base + (t0 + t) * rs);
                float *dst = A + ((size_t)pos0 * K + cr[pos0]) * 4;
                _mm_storeu_ps(dst, _mm_add_ps(_mm_loadu_ps(dst), pv[t]));
            }
        return;
    }
    float pt[8] = {0};
    /* GP = 4: the probabilities of 4 tokens x 4 heads are transposed in
     * registers (writing pt[] with scalar stores and reading it back as one
     * vector would stall store forwarding once per token) */
    __m128 p4[4] = {_mm_setzero_ps(), _mm_setzero_ps(), _mm_setzero_ps(), _mm_setzero_ps()};
    const __m128 inv4 = _mm_setr_ps(inv[0], G > 1 ? inv[1] : 0.0f, G > 2 ? inv[2] : 0.0f, G > 3 ? inv[3] : 0.0f);
    for (int i = 0; i < n; i++) {
        if (GP == 4 && (i & 3) == 0 && i + 4 <= n) {
            __m128 r[4];
            for (int g = 0; g < 4; g++)
                r[g] = g < G ? _mm_loadu_ps(p + (size_t)g * ld + i) : _mm_setzero_ps();
            _MM_TRANSPOSE4_PS(r[0], r[1], r[2], r[3]);
            for (int k = 0; k < 4; k++)
                p4[k] = _mm_mul_ps(r[k], inv4);
        }
        if (GP != 4 || i >= (n & ~3))
            for (int g = 0; g < G; g++)
                pt[g] = p[(size_t)g * ld + i] * inv[g];
        const char *row = base + (t0 + i) * rs;
        if (GP == 8) {
            __m256 pv = _mm256_loadu_ps(pt);
            for (int pos = 0; pos < vpos; pos++) {
                uint32_t code = a->v_bits <= 8 ? ((const uint8_t *)row)[pos] : ((const uint16_t *)row)[pos];
                float *dst = c->A + ((size_t)pos * K + code) * 8;
                _mm256_storeu_ps(dst, _mm256_add_ps(_mm256_loadu_ps(dst), pv));
            }
        } else {
            /* 16-bit codes (8-bit ones took the chunked path above) */
            __m128 pv = i < (n & ~3) ? p4[i & 3] : _mm_loadu_ps(pt);
            const uint16_t *cr = (const uint16_t *)row;
            for (int pos = 0; pos < vpos; pos++) {
                float *dst = A + ((size_t)pos * K + cr[pos]) * 4;
                _mm_storeu_ps(dst, _mm_add_ps(_mm_loadu_ps(dst), pv));
            }
        }
    }
}

/*
 * Values with sub-vectors of 4 and up to 4 query heads on AVX-512F, for a
 * head whose value codewords are all finite: no A, the codewords straight
 * into the output. Lane 4 g + i of a position's vector is dimension i of
 * head g: the token's probabilities (lanes 4 g .. 4 g + 3 hold head g's)
 * times the codeword four times over (cbx), one FMA a position and token.
 * The block's positions go 8 at a time, their sums in registers over the
 * block's tokens, then added into the driver's accumulator (which it
 * rescales itself). 8-bit codes.
 */
__attribute__((target("avx512f,avx512bw,avx512vl"))) static void
vq_values_512(void *vctx, int64_t t0, int n, const float *p, int ld, float *acc)
{
    const vq_seg *sg = vctx;
    const vq_ctx *c = sg->c;
    const int G = c->G, vpos = c->vpos, Dv = c->Dv;
    const float *cbx = c->cbx;
    _Alignas(64) float pe[KVD__ATTN_BLOCK][16];
    const __m512i spread = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    int t = 0;
    for (; t + 4 <= n; t += 4) { /* 4 tokens x 4 heads, transposed */
        __m128 r[4];
        for (int g = 0; g < 4; g++)
            r[g] = g < G ? _mm_loadu_ps(p + (size_t)g * ld + t) : _mm_setzero_ps();
        _MM_TRANSPOSE4_PS(r[0], r[1], r[2], r[3]);
        for (int k = 0; k < 4; k++)
            _mm512_store_ps(pe[t + k], _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(r[k])));
    }
    for (; t < n; t++) {
        float p4[4] = {0};
        for (int g = 0; g < G; g++)
            p4[g] = p[(size_t)g * ld + t];
        _mm512_store_ps(pe[t],
                        _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(_mm_loadu_ps(p4))));
    }
    const int64_t rs = sg->vrs;
    /* the codes as byte offsets into cbx, 16 positions a step (the FMAs
     * then take them with one load each) */
    _Alignas(64) uint32_t off[KVD__ATTN_BLOCK * 32];
    const int vp16 = vpos <= 32 ? (vpos + 15) / 16 : 0;
    for (int tt = 0; tt < n && vp16; tt++) {
        const uint8_t *cr = (const uint8_t *)(sg->v + (t0 + tt) * rs);
        if (t0 + n + tt < sg->n) /* the next block's row, read while this one is computed */
            __builtin_prefetch(cr + n * rs);
        for (int k = 0; k < vp16; k++) {
            const int m = vpos - 16 * k < 16 ? vpos - 16 * k : 16;
            const __m128i b = m == 16
                                  ? _mm_loadu_si128((const __m128i *)(cr + 16 * k))
                                  : _mm_maskz_loadu_epi8((__mmask16)((1u << m) - 1), cr + 16 * k);
            _mm512_store_si512(off + tt * 32 + 16 * k,
                               _mm512_slli_epi32(_mm512_cvtepu8_epi32(b), 6));
        }
    }
    enum { PC = 8 };
    for (int pos0 = 0; pos0 < vpos; pos0 += PC) {
        const int np = vpos - pos0 < PC ? vpos - pos0 : PC;
        __m512 o[PC];
        for (int j = 0; j < PC; j++)
            o[j] = _mm512_setzero_ps();
        const uint8_t *cr = (const uint8_t *)(sg->v + t0 * rs) + pos0;
        if (np == PC && vp16) {
            const char *cx = (const char *)cbx;
            for (int tt = 0; tt < n; tt++) {
                const __m512 pv = _mm512_load_ps(pe[tt]);
                const uint32_t *ot = off + tt * 32 + pos0;
                _Pragma("GCC unroll 8") for (int j = 0; j < PC; j++) o[j] =
                    _mm512_fmadd_ps(pv, _mm512_load_ps((const float *)(cx + ot[j])), o[j]);
            }
        } else {
            for (int tt = 0; tt < n; tt++, cr += rs) {
                const __m512 pv = _mm512_load_ps(pe[tt]);
                for (int j = 0; j < np; j++)
                    o[j] = _mm512_fmadd_ps(pv, _mm512_load_ps(cbx + (size_t)cr[j] * 16), o[j]);
            }
        }
        for (int j = 0; j < np; j++) {
            _Alignas(64) float r[16];
            _mm512_store_ps(r, o[j]);
            for (int g = 0; g < G; g++) {
                float *ag = acc + (size_t)g * Dv + (pos0 + j) * 4;
                for (int i = 0; i < 4; i++)
                    ag[i] += r[4 * g + i];
            }
        }
    }
}

/* The value codebook of head h as vq_values_512 reads it, when that path
 * applies (see there); else NULL. The codewords' finiteness matters: the
 * A path adds nothing for a head whose weight is 0, where 0 x Inf would
 * be NaN here. */
static float *vq_cbx(const kvd_attn_vq_args *a, int h, int G, int simd)
{
    if (simd != 2 || G > 4 || a->v_sub_dim != 4 || a->v_bits != 8 ||
        a->v_codebook.dtype != KVD_DTYPE_F32 || a->v_codebook.stride[1] != 16)
        return NULL;
    const float *cb =
        (const float *)((const char *)a->v_codebook.data + h * a->v_codebook.stride[0]);
    for (int i = 0; i < 256 * 4; i++)
        if (!isfinite(cb[i]))
            return NULL;
    float *x = aligned_alloc(64, sizeof(float) * 256 * 16);
    if (!x)
        return NULL;
    for (int code = 0; code < 256; code++)
        for (int r = 0; r < 4; r++)
            memcpy(x + code * 16 + r * 4, cb + code * 4, sizeof(float) * 4);
    return x;
}

static void vq_values_scalar(void *vctx, int64_t t0, int n, const float *p, int ld, float *acc)
{
    const vq_seg *sg = vctx;
    vq_ctx *c = sg->c;
    const kvd_attn_vq_args *a = c->a;
    for (int g = 0; g < c->G; g++)
        if (c->mult[g] < 1e-20f) {
            vq_fold(c, acc);
            break;
        }
    c->dirty = 1;
    for (int i = 0; i < n; i++)
        for (int pos = 0; pos < c->vpos; pos++) {
            uint32_t code = seg_code(sg->v, sg->vrs, a->v_bits, t0 + i, pos);
            float *dst = c->A + ((size_t)pos * c->vK + code) * c->GP;
            for (int g = 0; g < c->G; g++)
                dst[g] += p[(size_t)g * ld + i] / c->mult[g];
        }
}

/* LUT[pos][code][g] = q~_g[pos] . C_k[code]: the GP query heads in vector
 * lanes, dk FMAs per entry. */
__attribute__((target("avx2,fma"))) static void vq_lut_avx2(vq_ctx *c, const float *qt, int dk)
{
    const kvd_attn_vq_args *a = c->a;
    int GP = c->GP, K = c->kK;
    const float *cb = (const float *)((const char *)a->k_codebook.data + c->h * a->k_codebook.stride[0]);
    __m256 qv[16];
    for (int pos = 0; pos < c->kpos; pos++) {
        for (int i = 0; i < dk; i++) {
            float v[8] = {0};
            for (int g = 0; g < c->G; g++)
                v[g] = qt[(size_t)g * c->D + pos * dk + i];
            qv[i] = _mm256_loadu_ps(v);
        }
        float *dst = c->lut + (size_t)pos * K * GP;
        for (int code = 0; code < K; code++) {
            const float *ck = cb + (size_t)code * dk;
            __m256 acc = _mm256_setzero_ps();
            for (int i = 0; i < dk; i++)
                acc = _mm256_fmadd_ps(qv[i], _mm256_set1_ps(ck[i]), acc);
            if (GP == 8)
                _mm256_storeu_ps(dst + (size_t)code * 8, acc);
            else
                _mm_storeu_ps(dst + (size_t)code * 4, _mm256_castps256_ps128(acc));
        }
    }
}

/* One kv head of kvd_cpu_attn_vq_fast (kvd__par_for). */
typedef struct vq_job {
    const kvd_attn_vq_args *a;
    int G, GP, D, Dv, simd;
    int64_t Tt;
    atomic_int rc;
} vq_job;

static void vq_head(void *arg, int h)
{
    vq_job *job = arg;
    const kvd_attn_vq_args *a = job->a;
    const kvd_attn_dims *d = &a->dims;
    const int G = job->G, GP = job->GP, D = job->D, Dv = job->Dv, simd = job->simd;
    const int64_t Tt = job->Tt;
    vq_ctx c;
    memset(&c, 0, sizeof c);
    c.a = a;
    c.h = h;
    c.G = G;
    c.GP = GP;
    c.D = D;
    c.Dv = Dv;
    c.simd = simd;
    int T = a->n_tokens > 0;
    c.kpos = T ? D / a->k_sub_dim : 0;
    c.vpos = T ? Dv / a->v_sub_dim : 0;
    c.kK = T ? 1 << a->k_bits : 0;
    c.vK = T ? 1 << a->v_bits : 0;
    size_t nl = (size_t)c.kpos * c.kK * GP, na = (size_t)c.vpos * c.vK * GP;
    float *buf = malloc(sizeof(float) * (nl + na + (size_t)2 * G * D + 16));
    if (!buf) {
        atomic_store(&job->rc, KVD_ENOMEM);
        return;
    }
    c.lut = buf;
    c.A = buf + nl;
    float *qt = c.A + na, *qs = qt + (size_t)G * D;
    memset(c.A, 0, sizeof(float) * na);
    for (int g = 0; g < KVD__ATTN_MAXG; g++)
        c.mult[g] = 1.0f;
    if (T) {
        int dk = a->k_sub_dim;
        for (int g = 0; g < G; g++) {
            transform_query(a, h, h * G + g, qt + (size_t)g * D);
            for (int j = 0; j < D; j++)
                qt[(size_t)g * D + j] *= d->softmax_scale;
        }
        if (simd && dk <= 16 && a->k_codebook.stride[1] == (int64_t)dk * 4)
            vq_lut_avx2(&c, qt, dk);
        else
            for (int pos = 0; pos < c.kpos; pos++)
                for (int code = 0; code < c.kK; code++) {
                    const float *ck = cb_row(&a->k_codebook, h, (uint32_t)code);
                    float *dst = c.lut + ((size_t)pos * c.kK + code) * GP;
                    for (int g = 0; g < GP; g++) {
                        float dot = 0.0f;
                        if (g < G)
                            for (int i = 0; i < dk; i++)
                                dot += qt[(size_t)g * D + pos * dk + i] * ck[i];
                        dst[g] = dot;
                    }
                }
    }
    kvd__attn_scaled_q(d, &a->q, h, qs);
    c.cbx = T ? vq_cbx(a, h, G, simd) : NULL;
    c.s512 = T && simd == 2 && GP == 4 && a->k_bits == 8 && c.kpos % 8 == 0 && c.kpos <= 32;
    /* One source per segment, all on the head's LUT and A; A is folded
     * once, after the last. */
    const int nseg = a->n_segments ? a->n_segments : 1;
    kvd__attn_src src1[2], *src = src1;
    vq_seg seg1, *seg = &seg1;
    if (nseg > 1) {
        src = malloc((size_t)(nseg + 1) * sizeof *src);
        seg = malloc((size_t)nseg * sizeof *seg);
        if (!src || !seg) {
            atomic_store(&job->rc, KVD_ENOMEM);
            if (src != src1)
                free(src);
            free(seg);
            free(buf);
            free(c.cbx);
            return;
        }
    }
    int nsrc = 0;
    for (int i = 0; i < nseg && a->n_tokens > 0; i++) {
        const kvd_attn_vq_segment *sp = a->n_segments ? &a->segments[i] : NULL;
        const kvd_tensor *kc = sp ? &sp->k_codes : &a->k_codes,
                         *vc = sp ? &sp->v_codes : &a->v_codes;
        const int64_t n = sp ? sp->n_tokens : a->n_tokens;
        if (n == 0)
            continue;
        seg[nsrc] = (vq_seg){.c = &c,
                             .k = (const char *)kc->data + h * kc->stride[0],
                             .v = (const char *)vc->data + h * vc->stride[0],
                             .krs = kc->stride[1],
                             .vrs = vc->stride[1],
                             .n = n};
        src[nsrc] = (kvd__attn_src){.ctx = &seg[nsrc],
                                    .n = n,
                                    .block = KVD__ATTN_BLOCK,
                                    .scores = c.s512 ? vq_scores_512
                                              : simd ? vq_scores_avx2
                                                     : vq_scores_scalar,
                                    .values = c.cbx  ? vq_values_512
                                              : simd ? vq_values_avx2
                                                     : vq_values_scalar,
                                    .rescale = c.cbx ? NULL : vq_rescale};
        nsrc++;
    }
    if (nsrc && !c.cbx)
        src[nsrc - 1].finish = vq_finish;
    _Alignas(8) char tailctx[KVD__ATTN_DENSE_CTX_BYTES];
    if (Tt > 0)
        kvd__attn_dense_src(&src[nsrc++], tailctx, &a->k_tail, &a->v_tail, NULL, Tt, qs, G, D, Dv,
                            h, simd);
    float *o[KVD__ATTN_MAXG], *l[KVD__ATTN_MAXG];
    kvd__attn_out_ptrs(d, &a->out, &a->lse, h, o, l);
    int r = kvd__attn_head_run(src, nsrc, G, Dv, o, l, simd);
    if (r) {
        atomic_store(&job->rc, r);
    }
    if (src != src1) {
        free(src);
        free(seg);
    }
    free(buf);
    free(c.cbx);
}

/* More than 8 query heads per kv head: each kv head's query heads, 8 at a
 * time, as calls of their own (one kv head each; every query head's
 * arithmetic is its own). */
static int vq_part(const void *arg, int i)
{
    const kvd_attn_vq_args *a = arg;
    const int64_t Hkv = a->dims.n_kv_heads;
    kvd_attn_vq_args s = *a;
    const int64_t h = kvd__attn_part(i, 8, &s.dims, &s.q, &s.out, &s.lse);
    s.k_codes = kvd__attn_rows(a->k_codes, Hkv, h, 1);
    s.k_codebook = kvd__attn_rows(a->k_codebook, Hkv, h, 1);
    s.k_lambda = kvd__attn_rows(a->k_lambda, Hkv, h, 1);
    s.v_codes = kvd__attn_rows(a->v_codes, Hkv, h, 1);
    s.v_codebook = kvd__attn_rows(a->v_codebook, Hkv, h, 1);
    s.k_tail = kvd__attn_rows(a->k_tail, Hkv, h, 1);
    s.v_tail = kvd__attn_rows(a->v_tail, Hkv, h, 1);
    kvd_attn_vq_segment *segs = NULL;
    if (a->n_segments) {
        if (!(segs = malloc((size_t)a->n_segments * sizeof *segs)))
            return KVD_ENOMEM;
        for (int i = 0; i < a->n_segments; i++) {
            segs[i] = a->segments[i];
            segs[i].k_codes = kvd__attn_rows(a->segments[i].k_codes, Hkv, h, 1);
            segs[i].v_codes = kvd__attn_rows(a->segments[i].v_codes, Hkv, h, 1);
        }
        s.segments = segs;
    }
    int rc = kvd_cpu_attn_vq_fast(&s, 1);
    free(segs);
    return rc;
}

int kvd_cpu_attn_vq_fast(const kvd_attn_vq_args *a, int nthreads)
{
    const kvd_attn_dims *d = &a->dims;
    int G = d->n_q_heads / d->n_kv_heads, D = d->head_dim, Dv = d->v_dim;
    if (G > 8)
        return kvd__attn_split(d, 8, nthreads, vq_part, a);
    int simd = kvd__attn_simd(), rc = 0;
    int GP = G <= 4 ? 4 : 8;
    int64_t Tt = a->k_tail.ndim == 3 ? a->k_tail.shape[1] : 0;
    vq_job j = {.a = a, .G = G, .GP = GP, .D = D, .Dv = Dv, .simd = simd, .Tt = Tt};
    atomic_init(&j.rc, 0);
    kvd__par_for(d->n_kv_heads, nthreads, vq_head, &j);
    rc = atomic_load(&j.rc);
    return rc;
}
