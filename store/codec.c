/*
 * Page codecs (codec.h): INT2/INT4 sections, decoding, attention over pages.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "codec.h"
#include "kvdepot/convert.h"
#include "kvdepot/quant.h"

#define CORRUPT(...) kvd_error_set(err, KVD_ECORRUPT, __VA_ARGS__)

static void st16(uint8_t *p, uint16_t x)
{
    p[0] = (uint8_t)x;
    p[1] = (uint8_t)(x >> 8);
}
static void st32(uint8_t *p, uint32_t x)
{
    for (int i = 0; i < 4; i++)
        p[i] = (uint8_t)(x >> (8 * i));
}
static void st64(uint8_t *p, uint64_t x)
{
    for (int i = 0; i < 8; i++)
        p[i] = (uint8_t)(x >> (8 * i));
}
static uint16_t ld16(const uint8_t *p) { return (uint16_t)(p[0] | (p[1] << 8)); }
static uint32_t ld32(const uint8_t *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static int codec_bits(uint8_t codec) { return codec == KVD_CODEC_INT2 ? 2 : 4; }

int kvd_codec_spec_check(kvd_codec_spec *s, int is_v, uint32_t page_tokens, uint32_t head_dim,
                         kvd_error *err)
{
    const char *w = is_v ? "v" : "k";
    if (s->codec == KVD_CODEC_RAW)
        return 0;
    if (s->codec == KVD_CODEC_VQ)
        return kvd_error_set(err, KVD_EUNSUPP,
                             "%s.codec: VQ pages are not produced by this server yet", w);
    if (s->codec != KVD_CODEC_INT2 && s->codec != KVD_CODEC_INT4)
        return kvd_error_set(err, KVD_EINVAL, "%s.codec: unknown codec %u", w, s->codec);
    if (s->group == 0)
        s->group = 64;
    if (s->group != 32 && s->group != 64 && s->group != 128)
        return kvd_error_set(err, KVD_EINVAL, "%s.quant.group_size: %u, want 32, 64 or 128", w,
                             s->group);
    if (s->rounding > KVD_ROUND_STOCHASTIC)
        return kvd_error_set(err, KVD_EINVAL, "%s.quant.rounding: unknown value %u", w,
                             s->rounding);
    if (s->axis > KVD_QAXIS_CHANNEL)
        return kvd_error_set(err, KVD_EINVAL, "%s.quant.axis: unknown value %u", w, s->axis);
    if (!is_v && s->axis != KVD_QAXIS_TOKEN)
        return kvd_error_set(err, KVD_EINVAL,
                             "k.quant.axis: keys are grouped per token (along head_dim)");
    if (s->axis == KVD_QAXIS_TOKEN && head_dim % s->group)
        return kvd_error_set(err, KVD_EINVAL,
                             "%s.quant.group_size: %u does not divide head_dim %u", w, s->group,
                             head_dim);
    if (s->axis == KVD_QAXIS_CHANNEL && page_tokens % s->group)
        return kvd_error_set(err, KVD_EINVAL,
                             "%s.quant.group_size: %u does not divide the page size %u", w,
                             s->group, page_tokens);
    return 0;
}

uint64_t kvd_codec_section_bytes(const kvd_codec_spec *s, uint32_t H, uint32_t T, uint32_t D,
                                 kvd_dtype dtype)
{
    if (s->codec == KVD_CODEC_RAW)
        return (uint64_t)H * T * D * kvd_dtype_size(dtype);
    kvd_quant_sizes qs;
    if (kvd_quant_size(T, D, codec_bits(s->codec), s->group, (kvd_quant_axis)s->axis, &qs,
                       NULL))
        return 0;
    return KVD_CODEC_SECTION_PREFIX + (uint64_t)H * qs.total_bytes;
}

/* Per-head views of an (H, ...) stacked section. */
static void section_arrays(uint8_t *base, uint32_t H, const kvd_quant_sizes *qs, uint8_t **codes,
                           uint8_t **min, uint8_t **scale, uint8_t **sum)
{
    *codes = base;
    *min = *codes + (size_t)H * qs->codes_bytes;
    *scale = *min + (size_t)H * qs->ngroups * 2;
    *sum = *scale + (size_t)H * qs->ngroups * 2;
}

/* Quantize the head-major raw section src into dst (a coded section). */
static int encode_section(kvd_backend *be, const kvd_page_desc *d, const kvd_codec_spec *s,
                          int is_v, const void *src, uint8_t *dst, kvd_error *err)
{
    const uint32_t H = d->num_kv_heads, T = d->num_tokens, D = d->head_dim;
    const int bits = codec_bits(s->codec);
    kvd_quant_sizes qs;
    int rc = kvd_quant_size(T, D, bits, s->group, (kvd_quant_axis)s->axis, &qs, err);
    if (rc)
        return rc;
    memset(dst, 0, KVD_CODEC_SECTION_PREFIX);
    st16(dst, s->group);
    dst[2] = s->axis;
    dst[3] = s->rounding;
    uint8_t *codes, *mn, *sc, *sm;
    section_arrays(dst + KVD_CODEC_SECTION_PREFIX, H, &qs, &codes, &mn, &sc, &sm);
    const size_t es = kvd_dtype_size(d->dtype);
    for (uint32_t h = 0; h < H; h++) {
        kvd_qtensor q;
        memset(&q, 0, sizeof q);
        q.bits = bits;
        q.group = s->group;
        q.axis = (kvd_quant_axis)s->axis;
        q.ntok = T;
        q.dim = D;
        q.codes = codes + (size_t)h * qs.codes_bytes;
        q.min = (uint16_t *)(void *)(mn + (size_t)h * qs.ngroups * 2);
        q.scale = (uint16_t *)(void *)(sc + (size_t)h * qs.ngroups * 2);
        q.sum = (uint16_t *)(void *)(sm + (size_t)h * qs.ngroups * 2);
        int64_t shape[2] = {T, D};
        kvd_tensor x = kvd_tensor_make(d->dtype, (uint8_t *)src + (size_t)h * T * D * es, 2,
                                       shape);
        /* A different stream per (layer, page, head, K/V), so stochastic
         * rounding errors do not line up across heads or pages. */
        uint64_t seed = s->seed ^ (0x9e3779b97f4a7c15ull * (d->layer + 1)) ^
                        ((d->token_start / (d->page_tokens ? d->page_tokens : 1)) << 20) ^
                        ((uint64_t)h << 8) ^ (uint64_t)is_v;
        if ((rc = kvd_quantize(be, &x, &q, (kvd_rounding)s->rounding, seed, err)))
            return rc;
    }
    return 0;
}

int kvd_page_encode(kvd_backend *be, const kvd_page_desc *d, const kvd_codec_spec *ks_in,
                    const kvd_codec_spec *vs_in, const void *k, const void *v, uint8_t **out,
                    size_t *len, kvd_error *err)
{
    *out = NULL;
    *len = 0;
    if (!be || !d || !ks_in || !vs_in || !k || !v)
        return kvd_error_set(err, KVD_EINVAL, "page encode: NULL argument");
    kvd_codec_spec ks = *ks_in, vs = *vs_in;
    /* The raw tail rule: only a page holding its whole block is coded. */
    if (d->num_tokens < d->page_tokens) {
        ks.codec = KVD_CODEC_RAW;
        vs.codec = KVD_CODEC_RAW;
    }
    int rc;
    if ((rc = kvd_codec_spec_check(&ks, 0, d->page_tokens, d->head_dim, err)) ||
        (rc = kvd_codec_spec_check(&vs, 1, d->page_tokens, d->head_dim, err)))
        return rc;
    if (ks.codec == KVD_CODEC_RAW && vs.codec == KVD_CODEC_RAW)
        return kvd_page_encode_raw(d, k, v, out, len, err);
    /* The header and table are those of a raw page with other codecs and
     * lengths: build the raw header into a scratch page, then patch. */
    const uint64_t kb = kvd_codec_section_bytes(&ks, d->num_kv_heads, d->num_tokens,
                                                d->head_dim, d->dtype);
    const uint64_t vb = kvd_codec_section_bytes(&vs, d->num_kv_heads, d->num_tokens,
                                                d->head_dim, d->dtype);
    const size_t hsize = KVD_PAGE_FIXED_HEADER + 2 * KVD_PAGE_SECTION_ENTRY;
    if (!kb || !vb)
        return kvd_error_set(err, KVD_EINVAL, "page encode: shape does not fit the codec");
    uint8_t *page = malloc(hsize + kb + vb);
    if (!page)
        return kvd_error_set(err, KVD_ENOMEM, "out of memory encoding a page");
    kvd_page_desc one = *d;
    one.num_tokens = 1; /* smallest raw page: only its header is kept */
    one.token_start = d->token_start;
    uint8_t *scratch = malloc((size_t)kvd_page_raw_size(&one));
    uint8_t *sk, *sv;
    if (!scratch) {
        free(page);
        return kvd_error_set(err, KVD_ENOMEM, "out of memory encoding a page");
    }
    if ((rc = kvd_page_init_raw(&one, scratch, (size_t)kvd_page_raw_size(&one), &sk, &sv,
                                err))) {
        free(scratch);
        free(page);
        return rc;
    }
    memcpy(page, scratch, hsize);
    free(scratch);
    st32(page + 24, d->num_tokens);
    page[11] |= KVD_PAGE_SEALED; /* num_tokens == page_tokens here */
    page[8] = ks.codec;
    page[9] = vs.codec;
    uint8_t *e = page + KVD_PAGE_FIXED_HEADER;
    e[2] = ks.codec;
    st64(e + 8, hsize);
    st64(e + 16, kb);
    e += KVD_PAGE_SECTION_ENTRY;
    e[2] = vs.codec;
    st64(e + 8, hsize + kb);
    st64(e + 16, vb);
    const size_t rawsec = (size_t)d->num_kv_heads * d->num_tokens * d->head_dim *
                          kvd_dtype_size(d->dtype);
    if (ks.codec == KVD_CODEC_RAW)
        memcpy(page + hsize, k, rawsec);
    else if ((rc = encode_section(be, d, &ks, 0, k, page + hsize, err)))
        goto fail;
    if (vs.codec == KVD_CODEC_RAW)
        memcpy(page + hsize + kb, v, rawsec);
    else if ((rc = encode_section(be, d, &vs, 1, v, page + hsize + kb, err)))
        goto fail;
    kvd_page_finish(page, hsize + kb + vb);
    *out = page;
    *len = hsize + kb + vb;
    return 0;
fail:
    free(page);
    return rc;
}

int kvd_codec_section_parse(const kvd_page_view *v, int which, kvd_codec_section *out,
                            kvd_error *err)
{
    memset(out, 0, sizeof *out);
    const uint8_t codec = which == KVD_SECTION_K ? v->h.k_codec : v->h.v_codec;
    const uint8_t *p = which == KVD_SECTION_K ? v->k : v->v;
    const uint64_t n = which == KVD_SECTION_K ? v->k_len : v->v_len;
    const char *w = which == KVD_SECTION_K ? "K" : "V";
    out->codec = codec;
    if (codec == KVD_CODEC_RAW)
        return 0;
    if (codec != KVD_CODEC_INT2 && codec != KVD_CODEC_INT4)
        return kvd_error_set(err, KVD_EUNSUPP, "%s section: codec %u cannot be read here", w,
                             codec);
    if (n < KVD_CODEC_SECTION_PREFIX)
        return CORRUPT("%s section: %llu bytes, shorter than its codec prefix", w,
                       (unsigned long long)n);
    kvd_codec_spec s = {codec, ld16(p), p[2], p[3], 0};
    if (ld32(p + 4) != 0)
        return CORRUPT("%s section: reserved codec bytes are not zero", w);
    if (!(v->h.flags & KVD_PAGE_SEALED))
        return CORRUPT("%s section: a coded section in a page that is not sealed", w);
    kvd_error e2;
    if (kvd_codec_spec_check(&s, which == KVD_SECTION_V, v->h.page_tokens, v->h.head_dim, &e2))
        return CORRUPT("%s section: %s", w, e2.msg);
    const uint32_t H = v->h.num_kv_heads, T = v->h.num_tokens, D = v->h.head_dim;
    uint64_t want = kvd_codec_section_bytes(&s, H, T, D, v->h.dtype);
    if (want != n)
        return CORRUPT("%s section: %llu bytes, expected %llu for its shape", w,
                       (unsigned long long)n, (unsigned long long)want);
    kvd_quant_sizes qs;
    kvd_quant_size(T, D, codec_bits(codec), s.group, (kvd_quant_axis)s.axis, &qs, NULL);
    uint8_t *codes, *mn, *sc, *sm;
    section_arrays((uint8_t *)p + KVD_CODEC_SECTION_PREFIX, H, &qs, &codes, &mn, &sc, &sm);
    out->bits = codec_bits(codec);
    out->group = s.group;
    out->axis = s.axis;
    out->rounding = s.rounding;
    out->q.bits = out->bits;
    out->q.group = s.group;
    out->q.axis = s.axis == KVD_QAXIS_TOKEN ? KVD_ATTN_AXIS_TOKEN : KVD_ATTN_AXIS_CHANNEL;
    /* Rows of codes and params: tokens for the token axis, channels else. */
    int64_t rows = s.axis == KVD_QAXIS_TOKEN ? T : D;
    int64_t crow = (int64_t)(qs.codes_bytes / (size_t)rows);
    int64_t prow = (int64_t)(qs.ngroups / (size_t)rows);
    int64_t cs[3] = {H, rows, crow}, ps[3] = {H, rows, prow};
    out->q.codes = kvd_tensor_make(KVD_DTYPE_U8, codes, 3, cs);
    out->q.min = kvd_tensor_make(KVD_DTYPE_F16, mn, 3, ps);
    out->q.scale = kvd_tensor_make(KVD_DTYPE_F16, sc, 3, ps);
    out->q.sum = kvd_tensor_make(KVD_DTYPE_U16, sm, 3, ps);
    return 0;
}

int kvd_page_decode_section(kvd_backend *be, const kvd_page_view *v, int which, kvd_dtype dtype,
                            void *dst, kvd_error *err)
{
    kvd_codec_section s;
    int rc = kvd_codec_section_parse(v, which, &s, err);
    if (rc)
        return rc;
    const uint32_t H = v->h.num_kv_heads, T = v->h.num_tokens, D = v->h.head_dim;
    const size_t es = kvd_dtype_size(dtype);
    if (!es)
        return kvd_error_set(err, KVD_EINVAL, "decode: bad dtype %d", (int)dtype);
    const uint8_t *src = which == KVD_SECTION_K ? v->k : v->v;
    if (s.codec == KVD_CODEC_RAW) {
        int64_t shape[2] = {(int64_t)H * T, D};
        if (dtype == v->h.dtype) {
            memcpy(dst, src, (size_t)H * T * D * es);
            return 0;
        }
        kvd_tensor in = kvd_tensor_make(v->h.dtype, (void *)src, 2, shape);
        kvd_tensor o = kvd_tensor_make(dtype, dst, 2, shape);
        return kvd_convert(be, &o, &in, err);
    }
    for (uint32_t h = 0; h < H; h++) {
        kvd_qtensor q;
        memset(&q, 0, sizeof q);
        q.bits = s.bits;
        q.group = s.group;
        q.axis = (kvd_quant_axis)s.axis;
        q.ntok = T;
        q.dim = D;
        q.codes = (uint8_t *)s.q.codes.data + h * s.q.codes.stride[0];
        q.min = (uint16_t *)(void *)((uint8_t *)s.q.min.data + h * s.q.min.stride[0]);
        q.scale = (uint16_t *)(void *)((uint8_t *)s.q.scale.data + h * s.q.scale.stride[0]);
        q.sum = (uint16_t *)(void *)((uint8_t *)s.q.sum.data + h * s.q.sum.stride[0]);
        int64_t shape[2] = {T, D};
        kvd_tensor y = kvd_tensor_make(dtype, (uint8_t *)dst + (size_t)h * T * D * es, 2, shape);
        if ((rc = kvd_dequantize(be, &q, &y, err)))
            return rc;
    }
    return 0;
}

/* Attention of one page into (out, lse). */
static int attend_one(kvd_backend *be, const kvd_page_view *pv, const kvd_attn_dims *dims,
                      const float *q, float *out, float *lse, kvd_error *err)
{
    const uint32_t H = pv->h.num_kv_heads, T = pv->h.num_tokens, D = pv->h.head_dim;
    if ((int)H != dims->n_kv_heads || (int)D != dims->head_dim || dims->v_dim != dims->head_dim)
        return kvd_error_set(err, KVD_EINVAL,
                             "page of %u kv heads x %u dims, attention wants %d x %d", H, D,
                             dims->n_kv_heads, dims->head_dim);
    kvd_codec_section ks, vs;
    int rc;
    if ((rc = kvd_codec_section_parse(pv, KVD_SECTION_K, &ks, err)) ||
        (rc = kvd_codec_section_parse(pv, KVD_SECTION_V, &vs, err)))
        return rc;
    int64_t qs[2] = {dims->n_q_heads, D}, ls[1] = {dims->n_q_heads};
    kvd_tensor tq = kvd_tensor_make(KVD_DTYPE_F32, (void *)q, 2, qs);
    kvd_tensor to = kvd_tensor_make(KVD_DTYPE_F32, out, 2, qs);
    kvd_tensor tl = kvd_tensor_make(KVD_DTYPE_F32, lse, 1, ls);
    if (ks.codec != KVD_CODEC_RAW && vs.codec != KVD_CODEC_RAW) {
        kvd_attn_int_args a;
        memset(&a, 0, sizeof a);
        a.dims = *dims;
        a.q = tq;
        a.n_tokens = T;
        a.k = ks.q;
        a.v = vs.q;
        int64_t es[3] = {H, 0, D};
        a.k_tail = kvd_tensor_make(KVD_DTYPE_F32, NULL, 3, es);
        a.v_tail = a.k_tail;
        a.out = to;
        a.lse = tl;
        return kvd_attn_quant(be, 1, &a, err);
    }
    kvd_attn_dense_args a;
    memset(&a, 0, sizeof a);
    a.dims = *dims;
    a.q = tq;
    a.out = to;
    a.lse = tl;
    int64_t ksh[3] = {H, T, D};
    float *kf = NULL, *vf = NULL;
    if (ks.codec == KVD_CODEC_RAW && vs.codec == KVD_CODEC_RAW) {
        a.k = kvd_tensor_make(pv->h.dtype, (void *)pv->k, 3, ksh);
        a.v = kvd_tensor_make(pv->h.dtype, (void *)pv->v, 3, ksh);
        return kvd_attn_dense(be, 1, &a, err);
    }
    /* Mixed codecs: no fused kernel; decode both sides to f32. */
    kf = malloc(sizeof(float) * H * T * D);
    vf = malloc(sizeof(float) * H * T * D);
    if (!kf || !vf) {
        rc = kvd_error_set(err, KVD_ENOMEM, "out of memory decoding a page");
        goto done;
    }
    if ((rc = kvd_page_decode_section(be, pv, KVD_SECTION_K, KVD_DTYPE_F32, kf, err)) ||
        (rc = kvd_page_decode_section(be, pv, KVD_SECTION_V, KVD_DTYPE_F32, vf, err)))
        goto done;
    a.k = kvd_tensor_make(KVD_DTYPE_F32, kf, 3, ksh);
    a.v = kvd_tensor_make(KVD_DTYPE_F32, vf, 3, ksh);
    rc = kvd_attn_dense(be, 1, &a, err);
done:
    free(kf);
    free(vf);
    return rc;
}

int kvd_page_attend(kvd_backend *be, const kvd_page_view *pages, size_t n,
                    const kvd_attn_dims *dims, const float *q, float *out, float *lse,
                    kvd_error *err)
{
    const int Hq = dims->n_q_heads, D = dims->v_dim;
    for (int h = 0; h < Hq; h++) {
        lse[h] = -INFINITY;
        for (int d = 0; d < D; d++)
            out[(size_t)h * D + d] = 0.0f;
    }
    if (n == 0)
        return 0;
    float *po = malloc(sizeof(float) * (size_t)Hq * D);
    float *pl = malloc(sizeof(float) * (size_t)Hq);
    int rc = 0;
    if (!po || !pl) {
        rc = kvd_error_set(err, KVD_ENOMEM, "out of memory");
        goto done;
    }
    int64_t os[2] = {Hq, D}, ls[1] = {Hq};
    for (size_t i = 0; i < n && rc == 0; i++) {
        if ((rc = attend_one(be, &pages[i], dims, q, i == 0 ? out : po, i == 0 ? lse : pl, err)))
            break;
        if (i == 0)
            continue;
        kvd_attn_merge_args m;
        m.out_a = kvd_tensor_make(KVD_DTYPE_F32, out, 2, os);
        m.lse_a = kvd_tensor_make(KVD_DTYPE_F32, lse, 1, ls);
        m.out_b = kvd_tensor_make(KVD_DTYPE_F32, po, 2, os);
        m.lse_b = kvd_tensor_make(KVD_DTYPE_F32, pl, 1, ls);
        m.out = m.out_a;
        m.lse = m.lse_a;
        rc = kvd_attn_merge(be, 1, &m, err);
    }
done:
    free(po);
    free(pl);
    return rc;
}
