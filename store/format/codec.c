/*
 * Page codecs (codec.h): INT2/INT4 sections, decoding, attention over pages.
 */
#include <math.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#define XXH_STATIC_LINKING_ONLY
#include <xxhash.h>

#include "codec.h"
#include "kvdepot/convert.h"
#include "kvdepot/quant.h"
#include "kvdepot/svd.h"
#include "kvdepot/vq.h"

/* Artifact kinds (store/artifact.h; the codec layer links no store code). */
enum { ART_SMOOTH = 1, ART_CB_K, ART_CB_V, ART_ROT_K, ART_ROT_V, ART_SPEC_K, ART_SPEC_V };

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
static uint64_t ld64(const uint8_t *p)
{
    uint64_t x = 0;
    for (int i = 0; i < 8; i++)
        x |= (uint64_t)p[i] << (8 * i);
    return x;
}
static uint32_t ld32(const uint8_t *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static int codec_bits(uint8_t codec) { return codec == KVD_CODEC_INT2 ? 2 : 4; }

int kvd_codec_spec_check(kvd_codec_spec *s, int is_v, uint32_t page_tokens, uint32_t head_dim,
                         kvd_error *err)
{
    const char *w = is_v ? "v" : "k";
    if (s->svd > 1)
        return kvd_error_set(err, KVD_EINVAL, "%s.svd: unknown value %u", w, s->svd);
    if (s->svd && !(s->svd_rate >= 0.0 && s->svd_rate < 1.0))
        return kvd_error_set(err, KVD_EINVAL, "%s.svd.removal_rate: %g not in [0, 1)", w,
                             s->svd_rate);
    if (s->svd && s->svd_align > head_dim)
        return kvd_error_set(err, KVD_EINVAL, "%s.svd.align: %u exceeds head_dim %u", w,
                             s->svd_align, head_dim);
    for (uint32_t i = 0; s->svd && s->svd_widths && i < s->svd_nwidths; i++)
        if (s->svd_widths[i] == 0 || s->svd_widths[i] > head_dim)
            return kvd_error_set(err, KVD_EINVAL, "%s.svd.widths[%u]: %u not in 1..head_dim %u",
                                 w, i, s->svd_widths[i], head_dim);
    /* The axis only matters for INT codes; other codecs keep the axis the
     * store has always recorded for them (K token, V channel). */
    if (s->axis == KVD_CODEC_AXIS_DEFAULT && s->codec != KVD_CODEC_INT2 &&
        s->codec != KVD_CODEC_INT4)
        s->axis = is_v ? KVD_QAXIS_CHANNEL : KVD_QAXIS_TOKEN;
    if (s->codec == KVD_CODEC_RAW)
        return 0;
    if (s->codec == KVD_CODEC_VQ) {
        if (s->svd)
            return kvd_error_set(err, KVD_EINVAL,
                                 "%s: SVD reduction composed with VQ is not offered (use SVD "
                                 "with raw, INT2 or INT4, or VQ alone)",
                                 w);
        if (s->vq_sub_dim != 2 && s->vq_sub_dim != 4 && s->vq_sub_dim != 8)
            return kvd_error_set(err, KVD_EINVAL, "%s.vq.sub_dim: %u, want 2, 4 or 8", w,
                                 s->vq_sub_dim);
        if (s->vq_bits < 4 || s->vq_bits > 12)
            return kvd_error_set(err, KVD_EINVAL, "%s.vq.bits: %u, want 4..12", w, s->vq_bits);
        if (head_dim % s->vq_sub_dim)
            return kvd_error_set(err, KVD_EINVAL, "%s.vq.sub_dim: %u does not divide head_dim %u",
                                 w, s->vq_sub_dim, head_dim);
        if (!is_v && (head_dim & (head_dim - 1)))
            return kvd_error_set(err, KVD_EINVAL,
                                 "k.codec: VQ keys need a power-of-two head_dim (Hadamard), got %u",
                                 head_dim);
        return 0;
    }
    if (s->codec != KVD_CODEC_INT2 && s->codec != KVD_CODEC_INT4)
        return kvd_error_set(err, KVD_EINVAL, "%s.codec: unknown codec %u", w, s->codec);
    /* Group 0: 64, or on the token axis of a head_dim it does not divide
     * the largest of 32, 16, 8 that does (small heads). */
    const int auto_group = s->group == 0;
    if (auto_group)
        s->group = 64;
    if (s->group != 8 && s->group != 16 && s->group != 32 && s->group != 64 && s->group != 128)
        return kvd_error_set(err, KVD_EINVAL,
                             "%s.quant.group_size: %u, want 8, 16, 32, 64 or 128", w, s->group);
    if (s->rounding > KVD_ROUND_STOCHASTIC)
        return kvd_error_set(err, KVD_EINVAL, "%s.quant.rounding: unknown value %u", w,
                             s->rounding);
    /* Default: groups of tokens of one channel (KIVI keys, HACK values) when
     * the group divides the page, else groups of channels of one token. */
    if (s->axis == KVD_CODEC_AXIS_DEFAULT)
        s->axis = page_tokens % s->group ? KVD_QAXIS_TOKEN : KVD_QAXIS_CHANNEL;
    while (auto_group && s->axis == KVD_QAXIS_TOKEN && s->group > 8 && head_dim % s->group)
        s->group /= 2;
    if (s->axis > KVD_QAXIS_CHANNEL)
        return kvd_error_set(err, KVD_EINVAL, "%s.quant.axis: unknown value %u", w, s->axis);
    if (!is_v && s->axis == KVD_QAXIS_CHANNEL && KVD__ATTN_BLOCK % s->group)
        return kvd_error_set(err, KVD_EINVAL,
                             "k.quant.group_size: %u; keys grouped per channel need a group "
                             "dividing %d",
                             s->group, KVD__ATTN_BLOCK);
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
    if (s->svd)
        return 0;
    if (s->codec == KVD_CODEC_RAW)
        return (uint64_t)H * T * D * kvd_dtype_size(dtype);
    if (s->codec == KVD_CODEC_VQ)
        return s->vq_sub_dim ? KVD_CODEC_ARTS_PREFIX +
                                   (uint64_t)H * T * (D / s->vq_sub_dim) * (s->vq_bits <= 8 ? 1 : 2)
                             : 0;
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

/* The prefix of an INT section: group, axis, rounding. */
static void int_prefix(uint8_t *dst, const kvd_codec_spec *s)
{
    memset(dst, 0, KVD_CODEC_SECTION_PREFIX);
    st16(dst, s->group);
    dst[2] = s->axis;
    dst[3] = s->rounding;
}

/* Quantize the head-major raw section src into the arrays of an INT section
 * (what follows its prefix); both in memory of be. */
/* The quantizations of an INT section, one per head (x[h] -> q[h] with
 * seeds[h]): the head-major raw section src into arrays (what follows the
 * section's prefix), both in memory of the backend that runs them. */
static int head_blocks(const kvd_page_desc *d, const kvd_codec_spec *s, int is_v, const void *src,
                       uint8_t *arrays, kvd_tensor *x, kvd_qtensor *q, uint64_t *seeds,
                       kvd_error *err)
{
    const uint32_t H = d->num_kv_heads, T = d->num_tokens, D = d->head_dim;
    const int bits = codec_bits(s->codec);
    kvd_quant_sizes qs;
    int rc = kvd_quant_size(T, D, bits, s->group, (kvd_quant_axis)s->axis, &qs, err);
    if (rc)
        return rc;
    uint8_t *codes, *mn, *sc, *sm;
    section_arrays(arrays, H, &qs, &codes, &mn, &sc, &sm);
    const size_t es = kvd_dtype_size(d->dtype);
    for (uint32_t h = 0; h < H; h++) {
        memset(&q[h], 0, sizeof q[h]);
        q[h].bits = bits;
        q[h].group = s->group;
        q[h].axis = (kvd_quant_axis)s->axis;
        q[h].ntok = T;
        q[h].dim = D;
        q[h].codes = codes + (size_t)h * qs.codes_bytes;
        q[h].min = (uint16_t *)(void *)(mn + (size_t)h * qs.ngroups * 2);
        q[h].scale = (uint16_t *)(void *)(sc + (size_t)h * qs.ngroups * 2);
        q[h].sum = (uint16_t *)(void *)(sm + (size_t)h * qs.ngroups * 2);
        int64_t shape[2] = {T, D};
        x[h] = kvd_tensor_make(d->dtype, (uint8_t *)src + (size_t)h * T * D * es, 2, shape);
        /* A different stream per (layer, page, head, K/V), so stochastic
         * rounding errors do not line up across heads or pages. */
        seeds[h] = s->seed ^ (0x9e3779b97f4a7c15ull * (d->layer + 1)) ^
                   ((d->token_start / (d->page_tokens ? d->page_tokens : 1)) << 20) ^
                   ((uint64_t)h << 8) ^ (uint64_t)is_v;
    }
    return 0;
}

static int quantize_heads(kvd_backend *be, const kvd_page_desc *d, const kvd_codec_spec *s,
                          int is_v, const void *src, uint8_t *arrays, kvd_error *err)
{
    const uint32_t H = d->num_kv_heads;
    kvd_tensor *x = malloc(sizeof *x * H);
    kvd_qtensor *q = malloc(sizeof *q * H);
    uint64_t *seeds = malloc(sizeof *seeds * H);
    int rc = x && q && seeds ? head_blocks(d, s, is_v, src, arrays, x, q, seeds, err)
                             : kvd_error_set(err, KVD_ENOMEM, "out of memory coding a page");
    if (rc == 0)
        rc = kvd_quantize_batch(be, (int)H, x, q, (kvd_rounding)s->rounding, seeds, err);
    free(x);
    free(q);
    free(seeds);
    return rc;
}

/* Quantize the head-major raw section src into dst (a coded section). */
static int encode_section(kvd_backend *be, const kvd_page_desc *d, const kvd_codec_spec *s,
                          int is_v, const void *src, uint8_t *dst, kvd_error *err)
{
    int_prefix(dst, s);
    return quantize_heads(be, d, s, is_v, src, dst + KVD_CODEC_SECTION_PREFIX, err);
}

/* ---- artifact snapshots ------------------------------------------------------ */

static size_t cb_floats(const kvd_layer_arts *la)
{
    return ((size_t)1 << la->vq_bits) * la->vq_sub_dim;
}

uint64_t kvd_layer_arts_fingerprint(const kvd_layer_arts *la, uint32_t H, uint32_t D)
{
    XXH3_state_t st;
    XXH3_64bits_reset(&st);
    uint8_t tag[4] = {la->vq_sub_dim, la->vq_bits, la->lambda != NULL, la->rotation != NULL};
    XXH3_64bits_update(&st, tag, sizeof tag);
    if (la->lambda)
        XXH3_64bits_update(&st, la->lambda, sizeof(float) * H * D);
    if (la->codebook)
        XXH3_64bits_update(&st, la->codebook, sizeof(float) * H * cb_floats(la));
    if (la->rotation) {
        XXH3_64bits_update(&st, la->rotation, sizeof(float) * H * D * D);
        XXH3_64bits_update(&st, la->widths, sizeof(int32_t) * H);
    }
    return XXH3_64bits_digest(&st);
}

static void layer_arts_clear(kvd_layer_arts *la)
{
    free(la->lambda);
    free(la->codebook);
    free(la->rotation);
    free(la->widths);
    memset(la, 0, sizeof *la);
}

void kvd_codec_arts_free(kvd_codec_arts *a)
{
    if (!a)
        return;
    for (uint32_t l = 0; l < a->num_layers; l++) {
        if (a->k)
            layer_arts_clear(&a->k[l]);
        if (a->v)
            layer_arts_clear(&a->v[l]);
    }
    free(a->k);
    free(a->v);
    free(a);
}

static const char *kind_name(int kind)
{
    static const char *n[] = {"?", "KEY_SMOOTHING", "VQ_CODEBOOK_K", "VQ_CODEBOOK_V",
                              "SVD_ROTATION_K", "SVD_ROTATION_V", "SVD_SPECTRUM_K",
                              "SVD_SPECTRUM_V"};
    return kind >= 1 && kind <= 7 ? n[kind] : n[0];
}

static const kvd_art_ref *find_art(const kvd_art_ref *a, size_t n, int kind, uint32_t l,
                                   uint32_t h)
{
    for (size_t i = 0; i < n; i++)
        if (a[i].kind == kind && a[i].layer == l && a[i].kv_head == h)
            return &a[i];
    return NULL;
}

static int need_art(const kvd_art_ref *a, size_t n, int kind, uint32_t l, uint32_t h,
                    uint32_t s0, uint32_t s1, const kvd_art_ref **out, kvd_error *err)
{
    const kvd_art_ref *r = find_art(a, n, kind, l, h);
    if (!r)
        return kvd_error_set(err, KVD_EPRECOND,
                             "model has no %s artifact for layer %u kv head %u (run Calibrate "
                             "or UploadArtifacts)",
                             kind_name(kind), l, h);
    uint32_t r1 = r->ndim == 2 ? r->shape[1] : 1;
    if (r->shape[0] != s0 || r1 != s1 || !r->data)
        return kvd_error_set(err, KVD_EPRECOND,
                             "%s artifact of layer %u kv head %u is %ux%u, the codec needs %ux%u "
                             "(calibrate with this VQ shape)",
                             kind_name(kind), l, h, r->shape[0], r1, s0, s1);
    *out = r;
    return 0;
}

/* The multiple SVD widths are rounded up to: svd_align (0 = 8), and for INT
 * on the token axis also the group size (powers of two: the larger). */
static uint32_t svd_align_of(const kvd_codec_spec *s)
{
    uint32_t align = s->svd_align ? s->svd_align : 8;
    if (s->codec != KVD_CODEC_RAW && s->axis == KVD_QAXIS_TOKEN && s->group)
        while (align % s->group)
            align = align < s->group ? s->group : align * 2;
    return align;
}

static int round_width(uint32_t w, uint32_t align, uint32_t D)
{
    w = (w + align - 1) / align * align;
    return (int)(w > D ? D : w);
}

/* The artifacts of one side (is_v) of layer l into la. */
static int build_layer(const kvd_codec_spec *s, int is_v, uint32_t l, uint32_t H, uint32_t D,
                       const kvd_art_ref *a, size_t n, kvd_layer_arts *la, kvd_error *err)
{
    const kvd_art_ref *r;
    int rc;
    if (s->codec == KVD_CODEC_VQ) {
        la->vq_sub_dim = s->vq_sub_dim;
        la->vq_bits = s->vq_bits;
        const size_t cbn = cb_floats(la);
        la->codebook = malloc(sizeof(float) * H * cbn);
        if (!is_v)
            la->lambda = malloc(sizeof(float) * H * D);
        if (!la->codebook || (!is_v && !la->lambda))
            return kvd_error_set(err, KVD_ENOMEM, "out of memory");
        for (uint32_t h = 0; h < H; h++) {
            if ((rc = need_art(a, n, is_v ? ART_CB_V : ART_CB_K, l, h, 1u << s->vq_bits,
                               s->vq_sub_dim, &r, err)))
                return rc;
            memcpy(la->codebook + h * cbn, r->data, sizeof(float) * cbn);
            if (!is_v) {
                if ((rc = need_art(a, n, ART_SMOOTH, l, h, D, 1, &r, err)))
                    return rc;
                memcpy(la->lambda + (size_t)h * D, r->data, sizeof(float) * D);
            }
        }
    }
    if (s->svd) {
        if (s->svd_nwidths == 0 && !(s->svd_rate > 0.0 && s->svd_rate < 1.0))
            return kvd_error_set(err, KVD_EINVAL,
                                 "%s.svd: removal_rate %g not in (0, 1) and no widths given",
                                 is_v ? "v" : "k", s->svd_rate);
        la->rotation = malloc(sizeof(float) * H * D * D);
        la->widths = malloc(sizeof(int32_t) * H);
        if (!la->rotation || !la->widths)
            return kvd_error_set(err, KVD_ENOMEM, "out of memory");
        const uint32_t align = svd_align_of(s);
        for (uint32_t h = 0; h < H; h++) {
            if ((rc = need_art(a, n, is_v ? ART_ROT_V : ART_ROT_K, l, h, D, D, &r, err)))
                return rc;
            memcpy(la->rotation + (size_t)h * D * D, r->data, sizeof(float) * D * D);
            int w;
            if (s->svd_nwidths) {
                if (s->svd_nwidths != 1 && s->svd_nwidths != H)
                    return kvd_error_set(err, KVD_EINVAL,
                                         "%s.svd.widths: %u given, want 1 or one per kv head (%u)",
                                         is_v ? "v" : "k", s->svd_nwidths, H);
                w = round_width(s->svd_widths[s->svd_nwidths == 1 ? 0 : h], align, D);
            } else {
                if ((rc = need_art(a, n, is_v ? ART_SPEC_V : ART_SPEC_K, l, h, D, 1, &r, err)))
                    return rc;
                w = round_width((uint32_t)kvd_svd_kept_width(r->data, (int)D, s->svd_rate, 1),
                                align, D);
            }
            la->widths[h] = w < 1 ? (int32_t)(align < D ? align : D) : w;
        }
    }
    la->fingerprint = kvd_layer_arts_fingerprint(la, H, D);
    return 0;
}

static int side_needs_arts(const kvd_codec_spec *s) { return s->codec == KVD_CODEC_VQ || s->svd; }

int kvd_codec_arts_build(const kvd_codec_spec *ks, const kvd_codec_spec *vs, uint32_t L,
                         uint32_t H, uint32_t D, const kvd_art_ref *a, size_t n,
                         kvd_codec_arts **out, kvd_error *err)
{
    *out = NULL;
    if (!side_needs_arts(ks) && !side_needs_arts(vs))
        return 0;
    kvd_codec_arts *r = calloc(1, sizeof *r);
    if (!r)
        return kvd_error_set(err, KVD_ENOMEM, "out of memory");
    r->num_layers = L;
    r->num_kv_heads = H;
    r->head_dim = D;
    int rc = 0;
    if ((side_needs_arts(ks) && !(r->k = calloc(L, sizeof *r->k))) ||
        (side_needs_arts(vs) && !(r->v = calloc(L, sizeof *r->v)))) {
        kvd_codec_arts_free(r);
        return kvd_error_set(err, KVD_ENOMEM, "out of memory");
    }
    for (uint32_t l = 0; l < L && rc == 0; l++) {
        if (r->k && (rc = build_layer(ks, 0, l, H, D, a, n, &r->k[l], err)))
            break;
        if (r->v)
            rc = build_layer(vs, 1, l, H, D, a, n, &r->v[l], err);
    }
    /* A reduction that keeps every dimension of every head is a no-op that
     * costs more than none (the rotation, the widths' prefix): refused. */
    for (int side = 0; side < 2 && rc == 0; side++) {
        const kvd_codec_spec *s = side ? vs : ks;
        const kvd_layer_arts *la = side ? r->v : r->k;
        int reduced = !s->svd;
        for (uint32_t l = 0; la && l < L && !reduced; l++)
            for (uint32_t h = 0; h < H && !reduced; h++)
                reduced = la[l].widths[h] < (int32_t)D;
        if (!reduced)
            rc = kvd_error_set(err, KVD_EINVAL,
                               "%s.svd: every head keeps all %u dimensions (widths are rounded up "
                               "to a multiple of %u: svd.align, and the group size for INT on the "
                               "token axis), so the reduction changes nothing and costs more than "
                               "none: raise removal_rate or give smaller widths, lower the "
                               "multiple, or leave svd out",
                               side ? "v" : "k", D, svd_align_of(s));
    }
    if (rc) {
        kvd_codec_arts_free(r);
        return rc;
    }
    *out = r;
    return 0;
}

/* Sizes of a layer's arrays: lambda, codebook, rotation, widths (floats / u32). */
static void side_sizes(uint8_t d, uint8_t b, int has_lambda, int has_svd, uint32_t H, uint32_t D,
                       size_t sz[4])
{
    sz[0] = has_lambda ? (size_t)H * D : 0;
    sz[1] = d ? (size_t)H * ((size_t)1 << b) * d : 0;
    sz[2] = has_svd ? (size_t)H * D * D : 0;
    sz[3] = has_svd ? H : 0;
}

int kvd_codec_arts_serialize(const kvd_codec_arts *a, uint8_t **buf, size_t *len, kvd_error *err)
{
    *buf = NULL;
    *len = 0;
    const uint32_t L = a->num_layers, H = a->num_kv_heads, D = a->head_dim;
    size_t total = 16;
    const kvd_layer_arts *sides[2] = {a->k, a->v};
    size_t sz[2][4] = {{0}};
    for (int s = 0; s < 2; s++) {
        total += 4;
        if (!sides[s] || !L)
            continue;
        const kvd_layer_arts *la = &sides[s][0];
        side_sizes(la->vq_sub_dim, la->vq_bits, la->lambda != NULL, la->rotation != NULL, H, D,
                   sz[s]);
        total += (size_t)L * 4 * (sz[s][0] + sz[s][1] + sz[s][2] + sz[s][3]);
    }
    uint8_t *p = calloc(1, total);
    if (!p)
        return kvd_error_set(err, KVD_ENOMEM, "out of memory");
    p[0] = 1;
    st32(p + 4, L);
    st32(p + 8, H);
    st32(p + 12, D);
    size_t o = 16;
    for (int s = 0; s < 2; s++) {
        if (!sides[s] || !L) {
            o += 4;
            continue;
        }
        const kvd_layer_arts *l0 = &sides[s][0];
        p[o] = 1;
        p[o + 1] = l0->vq_sub_dim;
        p[o + 2] = l0->vq_bits;
        p[o + 3] = (uint8_t)((l0->lambda ? 1 : 0) | (l0->rotation ? 2 : 0));
        o += 4;
        for (uint32_t l = 0; l < L; l++) {
            const kvd_layer_arts *la = &sides[s][l];
            const void *arr[4] = {la->lambda, la->codebook, la->rotation, la->widths};
            for (int i = 0; i < 4; i++) {
                if (sz[s][i])
                    memcpy(p + o, arr[i], 4 * sz[s][i]); /* f32 / i32, host is little-endian */
                o += 4 * sz[s][i];
            }
        }
    }
    *buf = p;
    *len = total;
    return 0;
}

int kvd_codec_arts_parse(const uint8_t *p, size_t len, kvd_codec_arts **out, kvd_error *err)
{
    *out = NULL;
    if (len < 24 || p[0] != 1 || p[1] || p[2] || p[3])
        return CORRUPT("artifact snapshot: bad header (%zu bytes)", len);
    const uint32_t L = ld32(p + 4), H = ld32(p + 8), D = ld32(p + 12);
    if (!L || !H || !D || H > KVD_PAGE_MAX_HEADS || D > KVD_PAGE_MAX_HEAD_DIM || L > 65536)
        return CORRUPT("artifact snapshot: shape %u x %u x %u", L, H, D);
    kvd_codec_arts *a = calloc(1, sizeof *a);
    if (!a)
        return kvd_error_set(err, KVD_ENOMEM, "out of memory");
    a->num_layers = L;
    a->num_kv_heads = H;
    a->head_dim = D;
    size_t o = 16;
    int rc = 0;
    for (int s = 0; s < 2 && rc == 0; s++) {
        if (len - o < 4) {
            rc = CORRUPT("artifact snapshot: truncated");
            break;
        }
        uint8_t present = p[o], d = p[o + 1], b = p[o + 2], fl = p[o + 3];
        o += 4;
        if (!present)
            continue;
        if ((d && d != 2 && d != 4 && d != 8) || (d && (b < 4 || b > 12)) || fl > 3 ||
            (!d && (fl & 1))) {
            rc = CORRUPT("artifact snapshot: bad side record");
            break;
        }
        kvd_layer_arts *la = calloc(L, sizeof *la);
        if (!la) {
            rc = kvd_error_set(err, KVD_ENOMEM, "out of memory");
            break;
        }
        if (s)
            a->v = la;
        else
            a->k = la;
        size_t sz[4];
        side_sizes(d, b, fl & 1, fl & 2, H, D, sz);
        for (uint32_t l = 0; l < L && rc == 0; l++) {
            la[l].vq_sub_dim = d;
            la[l].vq_bits = b;
            void **arr[4] = {(void **)&la[l].lambda, (void **)&la[l].codebook,
                             (void **)&la[l].rotation, (void **)&la[l].widths};
            for (int i = 0; i < 4 && rc == 0; i++) {
                if (!sz[i])
                    continue;
                if ((len - o) / 4 < sz[i]) {
                    rc = CORRUPT("artifact snapshot: truncated");
                    break;
                }
                if (!(*arr[i] = malloc(4 * sz[i]))) {
                    rc = kvd_error_set(err, KVD_ENOMEM, "out of memory");
                    break;
                }
                memcpy(*arr[i], p + o, 4 * sz[i]);
                o += 4 * sz[i];
            }
            for (uint32_t h = 0; rc == 0 && la[l].widths && h < H; h++)
                if (la[l].widths[h] < 1 || la[l].widths[h] > (int32_t)D)
                    rc = CORRUPT("artifact snapshot: width %d", la[l].widths[h]);
            if (rc == 0)
                la[l].fingerprint = kvd_layer_arts_fingerprint(&la[l], H, D);
        }
    }
    if (rc == 0 && o != len)
        rc = CORRUPT("artifact snapshot: %zu bytes, expected %zu", len, o);
    if (rc) {
        kvd_codec_arts_free(a);
        return rc;
    }
    *out = a;
    return 0;
}

static const kvd_layer_arts *layer_arts(const kvd_codec_arts *a, int is_v, uint32_t layer)
{
    if (!a || layer >= a->num_layers)
        return NULL;
    const kvd_layer_arts *side = is_v ? a->v : a->k;
    return side ? &side[layer] : NULL;
}

/* ---- VQ and SVD sections ----------------------------------------------------- */

static size_t svd_widths_end(uint32_t H)
{
    return KVD_CODEC_ARTS_PREFIX + (2 * (size_t)H + 7) / 8 * 8;
}

/* Bytes of one head block of an SVD section of inner codec s->codec. */
static uint64_t svd_block_bytes(const kvd_codec_spec *inner, uint32_t T, uint32_t r, kvd_dtype dt)
{
    if (inner->codec == KVD_CODEC_RAW)
        return (uint64_t)T * r * kvd_dtype_size(dt);
    kvd_codec_spec one = *inner;
    one.svd = 0;
    return kvd_codec_section_bytes(&one, 1, T, r, dt);
}

static uint64_t svd_section_bytes(const kvd_codec_spec *inner, const int32_t *widths, uint32_t H,
                                  uint32_t T, kvd_dtype dt)
{
    uint64_t n = svd_widths_end(H);
    for (uint32_t h = 0; h < H; h++) {
        uint64_t b = svd_block_bytes(inner, T, (uint32_t)widths[h], dt);
        if (!b)
            return 0;
        n += b;
    }
    return n;
}

static uint64_t vq_section_bytes(uint32_t H, uint32_t T, uint32_t D, int d, int b)
{
    return KVD_CODEC_ARTS_PREFIX + (uint64_t)H * T * (D / d) * (b <= 8 ? 1 : 2);
}

/* f32 (T, D) rows of head h of a head-major section in dtype dt. */
static int head_to_f32(kvd_backend *be, const uint8_t *src, kvd_dtype dt, uint32_t T, uint32_t D,
                       float *dst, kvd_error *err)
{
    int64_t sh[2] = {T, D};
    const size_t bytes = sizeof(float) * T * D;
    if (dt == KVD_DTYPE_F32) /* a copy in be's memory */
        return kvd_backend_copy2d(be, dst, bytes, src, bytes, bytes, 1, err);
    kvd_tensor in = kvd_tensor_make(dt, (void *)src, 2, sh);
    kvd_tensor o = kvd_tensor_make(KVD_DTYPE_F32, dst, 2, sh);
    return kvd_convert(be, &o, &in, err);
}

static int f32_to(kvd_backend *be, const float *src, kvd_dtype dt, uint32_t T, uint32_t D,
                  void *dst, kvd_error *err)
{
    int64_t sh[2] = {T, D};
    if (dt == KVD_DTYPE_F32) {
        memcpy(dst, src, sizeof(float) * T * D);
        return 0;
    }
    kvd_tensor in = kvd_tensor_make(KVD_DTYPE_F32, (void *)src, 2, sh);
    kvd_tensor o = kvd_tensor_make(dt, dst, 2, sh);
    return kvd_convert(be, &o, &in, err);
}

static void vq_prefix(uint8_t *dst, const kvd_layer_arts *la, int is_v)
{
    memset(dst, 0, KVD_CODEC_ARTS_PREFIX);
    dst[0] = la->vq_sub_dim;
    dst[1] = la->vq_bits;
    dst[2] = is_v ? 0 : 1;
    st64(dst + 8, la->fingerprint);
}

/* VQ codes of every head of the head-major raw section src: keys smoothed
 * by lambda (H, D) and rotated, values as they are, each coded with its
 * head's codebook (H, 2^b, d). src, codes, lambda, codebook and x (T * D
 * floats of work space) in memory of be. */
static int vq_heads(kvd_backend *be, const kvd_page_desc *d, const kvd_layer_arts *la,
                    const float *lambda, const float *codebook, int is_v, const void *src,
                    uint8_t *codes, float *x, kvd_error *err)
{
    const uint32_t H = d->num_kv_heads, T = d->num_tokens, D = d->head_dim;
    const int sd = la->vq_sub_dim, b = la->vq_bits, cw = b <= 8 ? 1 : 2;
    const size_t es = kvd_dtype_size(d->dtype);
    int rc = 0;
    for (uint32_t h = 0; h < H && rc == 0; h++) {
        const uint8_t *xs = (const uint8_t *)src + (size_t)h * T * D * es;
        int64_t sh[2] = {T, D}, ls[1] = {D}, cs[2] = {T, D / sd}, bs[2] = {(int64_t)1 << b, sd};
        kvd_tensor xt = kvd_tensor_make(KVD_DTYPE_F32, x, 2, sh);
        if (!is_v) {
            kvd_tensor kin = kvd_tensor_make(d->dtype, (void *)xs, 2, sh);
            kvd_tensor lam = kvd_tensor_make(KVD_DTYPE_F32, (float *)lambda + (size_t)h * D, 1, ls);
            rc = kvd_vq_transform_keys(be, &kin, &lam, &xt, err);
        } else {
            rc = head_to_f32(be, xs, d->dtype, T, D, x, err);
        }
        if (rc)
            break;
        kvd_tensor cb =
            kvd_tensor_make(KVD_DTYPE_F32, (float *)codebook + h * cb_floats(la), 2, bs);
        kvd_tensor ct = kvd_tensor_make(cw == 1 ? KVD_DTYPE_U8 : KVD_DTYPE_U16,
                                        codes + (size_t)h * T * (D / sd) * cw, 2, cs);
        rc = kvd_vq_encode(be, &xt, &cb, &ct, err);
    }
    return rc;
}

static int encode_vq(kvd_backend *be, const kvd_page_desc *d, const kvd_layer_arts *la, int is_v,
                     const void *src, uint8_t *dst, kvd_error *err)
{
    vq_prefix(dst, la, is_v);
    float *x = malloc(sizeof(float) * d->num_tokens * d->head_dim);
    if (!x)
        return kvd_error_set(err, KVD_ENOMEM, "out of memory encoding a page");
    int rc = vq_heads(be, d, la, la->lambda, la->codebook, is_v, src, dst + KVD_CODEC_ARTS_PREFIX,
                      x, err);
    free(x);
    return rc;
}

static int encode_section(kvd_backend *be, const kvd_page_desc *d, const kvd_codec_spec *s,
                          int is_v, const void *src, uint8_t *dst, kvd_error *err);

/* The prefix and kept widths of an SVD section (H kv heads). */
static void svd_prefix(uint8_t *dst, const kvd_codec_spec *s, const kvd_layer_arts *la, uint32_t H)
{
    memset(dst, 0, svd_widths_end(H));
    dst[0] = s->codec;
    st64(dst + 8, la->fingerprint);
    for (uint32_t h = 0; h < H; h++)
        st16(dst + KVD_CODEC_ARTS_PREFIX + 2 * h, (uint16_t)la->widths[h]);
}

/* The inner codec's spec of head h of an SVD side: its own rounding
 * stream per head. */
static kvd_codec_spec svd_inner(const kvd_codec_spec *s, uint32_t h)
{
    kvd_codec_spec in = *s;
    in.svd = 0;
    in.seed ^= 0xd1b54a32d192ed03ull * (h + 1);
    return in;
}

/* The head blocks of an SVD section (src, rot, blocks and y in memory of
 * be): each head of the head-major raw section src projected with its
 * rotation (rot: H x D x D) into y (T x D floats of work space), then
 * stored raw in the page's dtype or quantized into blocks. The INT blocks'
 * prefixes are the host's to write (svd_int_prefixes). */
static int svd_heads(kvd_backend *be, const kvd_page_desc *d, const kvd_codec_spec *s,
                     const kvd_layer_arts *la, const float *rot, int is_v, const void *src,
                     uint8_t *blocks, float *y, kvd_error *err)
{
    const uint32_t H = d->num_kv_heads, T = d->num_tokens, D = d->head_dim;
    const size_t es = kvd_dtype_size(d->dtype);
    int rc = 0;
    for (uint32_t h = 0; h < H && rc == 0; h++) {
        const uint32_t r = (uint32_t)la->widths[h];
        if ((rc = kvd_svd_project(be, rot + (size_t)h * D * D, (int)D, (int)r,
                                  (const uint8_t *)src + (size_t)h * T * D * es, d->dtype, T,
                                  (int64_t)(D * es), y, err)))
            break;
        if (r == 0) {
            /* nothing kept of this head: an empty block */
        } else if (s->codec == KVD_CODEC_RAW && d->dtype == KVD_DTYPE_F32) {
            rc = kvd_backend_copy2d(be, blocks, sizeof(float) * T * r, y, sizeof(float) * T * r,
                                    sizeof(float) * T * r, 1, err);
        } else if (s->codec == KVD_CODEC_RAW) {
            int64_t sh[2] = {T, r};
            kvd_tensor in = kvd_tensor_make(KVD_DTYPE_F32, y, 2, sh);
            kvd_tensor o = kvd_tensor_make(d->dtype, blocks, 2, sh);
            rc = kvd_convert(be, &o, &in, err);
        } else {
            kvd_page_desc one = *d;
            one.num_kv_heads = 1;
            one.head_dim = r;
            one.dtype = KVD_DTYPE_F32;
            const kvd_codec_spec in = svd_inner(s, h);
            rc = quantize_heads(be, &one, &in, is_v, y, blocks + KVD_CODEC_SECTION_PREFIX, err);
        }
        blocks += svd_block_bytes(s, T, r, d->dtype);
    }
    return rc;
}

/* The prefixes of the INT head blocks of an SVD section at sec (host). */
static void svd_int_prefixes(uint8_t *sec, const kvd_page_desc *d, const kvd_codec_spec *s,
                             const kvd_layer_arts *la)
{
    if (s->codec == KVD_CODEC_RAW)
        return;
    uint8_t *o = sec + svd_widths_end(d->num_kv_heads);
    for (uint32_t h = 0; h < d->num_kv_heads; h++) {
        const uint32_t r = (uint32_t)la->widths[h];
        const kvd_codec_spec in = svd_inner(s, h);
        const uint64_t bytes = svd_block_bytes(s, d->num_tokens, r, d->dtype);
        if (bytes)
            int_prefix(o, &in);
        o += bytes;
    }
}

static int encode_svd(kvd_backend *be, const kvd_page_desc *d, const kvd_codec_spec *s,
                      const kvd_layer_arts *la, int is_v, const void *src, uint8_t *dst,
                      kvd_error *err)
{
    svd_prefix(dst, s, la, d->num_kv_heads);
    float *y = malloc(sizeof(float) * d->num_tokens * d->head_dim);
    if (!y)
        return kvd_error_set(err, KVD_ENOMEM, "out of memory encoding a page");
    int rc = svd_heads(be, d, s, la, la->rotation, is_v, src, dst + svd_widths_end(d->num_kv_heads),
                       y, err);
    free(y);
    if (rc == 0)
        svd_int_prefixes(dst, d, s, la);
    return rc;
}

/* INT arrays of one head block (an INT section of H = 1, width W). */
static void int_head_views(const uint8_t *block, int bits, int group, int axis, uint32_t T,
                           uint32_t W, kvd_qtensor *q, kvd_attn_qdata *qd)
{
    kvd_quant_sizes qs;
    kvd_quant_size(T, W, bits, group, (kvd_quant_axis)axis, &qs, NULL);
    uint8_t *codes, *mn, *sc, *sm;
    section_arrays((uint8_t *)block + KVD_CODEC_SECTION_PREFIX, 1, &qs, &codes, &mn, &sc, &sm);
    if (q) {
        memset(q, 0, sizeof *q);
        q->bits = bits;
        q->group = group;
        q->axis = (kvd_quant_axis)axis;
        q->ntok = T;
        q->dim = W;
        q->codes = codes;
        q->min = (uint16_t *)(void *)mn;
        q->scale = (uint16_t *)(void *)sc;
        q->sum = (uint16_t *)(void *)sm;
    }
    if (qd) {
        memset(qd, 0, sizeof *qd);
        qd->bits = bits;
        qd->group = group;
        qd->axis = axis == KVD_QAXIS_TOKEN ? KVD_ATTN_AXIS_TOKEN : KVD_ATTN_AXIS_CHANNEL;
        int64_t rows = axis == KVD_QAXIS_TOKEN ? T : W;
        int64_t cs[3] = {1, rows, (int64_t)(qs.codes_bytes / (size_t)rows)};
        int64_t ps[3] = {1, rows, (int64_t)(qs.ngroups / (size_t)rows)};
        qd->codes = kvd_tensor_make(KVD_DTYPE_U8, codes, 3, cs);
        qd->min = kvd_tensor_make(KVD_DTYPE_F16, mn, 3, ps);
        qd->scale = kvd_tensor_make(KVD_DTYPE_F16, sc, 3, ps);
        qd->sum = kvd_tensor_make(KVD_DTYPE_U16, sm, 3, ps);
    }
}

/* The checks every VQ or SVD section starts with: its prefix is there and
 * its page is sealed. *p, *n: the section and its length. */
static int arts_section_start(const kvd_page_view *v, int which, const uint8_t **p, uint64_t *n,
                              kvd_error *err)
{
    const int is_v = which == KVD_SECTION_V;
    const char *w = is_v ? "V" : "K";
    *p = is_v ? v->v : v->k;
    *n = is_v ? v->v_len : v->k_len;
    if (*n < KVD_CODEC_ARTS_PREFIX)
        return CORRUPT("%s section: %llu bytes, shorter than its codec prefix", w,
                       (unsigned long long)*n);
    if (!(v->h.flags & KVD_PAGE_SEALED))
        return CORRUPT("%s section: a coded section in a page that is not sealed", w);
    return 0;
}

/* The prefix, size and codes of a VQ section (out->sub_dim, vq_bits,
 * vq_codes, fingerprint): everything but what the artifacts must agree
 * with. */
static int parse_vq_section(const kvd_page_view *v, int which, kvd_codec_section *out,
                            kvd_error *err)
{
    const int is_v = which == KVD_SECTION_V;
    const char *w = is_v ? "V" : "K";
    const uint32_t H = v->h.num_kv_heads, T = v->h.num_tokens, D = v->h.head_dim;
    const uint8_t *p;
    uint64_t n;
    int rc = arts_section_start(v, which, &p, &n, err);
    if (rc)
        return rc;
    const unsigned d = p[0], b = p[1], tr = p[2];
    if (p[3] || ld32(p + 4))
        return CORRUPT("%s section: reserved codec bytes are not zero", w);
    if ((d != 2 && d != 4 && d != 8) || b < 4 || b > 12 || D % d || tr != (is_v ? 0u : 1u))
        return CORRUPT("%s section: VQ prefix d %u b %u transform %u invalid here", w, d, b, tr);
    uint64_t want = vq_section_bytes(H, T, D, (int)d, (int)b);
    if (want != n)
        return CORRUPT("%s section: %llu bytes, expected %llu for its shape", w,
                       (unsigned long long)n, (unsigned long long)want);
    /* Codes come from the wire: the fused kernel indexes tables with them,
     * so every code must name a codebook row. */
    const size_t ncodes = (size_t)H * T * (D / d);
    const unsigned lim = 1u << b;
    for (size_t i = 0; b != 8 && i < ncodes; i++) {
        unsigned c = b <= 8 ? p[16 + i] : ld16(p + 16 + 2 * i);
        if (c >= lim)
            return CORRUPT("%s section: VQ code %u at %zu out of range for %u bits", w, c, i, b);
    }
    out->codec = KVD_CODEC_VQ;
    out->fingerprint = ld64(p + 8);
    out->sub_dim = (int)d;
    out->vq_bits = (int)b;
    int64_t cs[3] = {H, T, D / d};
    out->vq_codes = kvd_tensor_make(b <= 8 ? KVD_DTYPE_U8 : KVD_DTYPE_U16, (void *)(p + 16), 3, cs);
    return 0;
}

/* Parse a VQ or SVD section (codec.h layouts) and check it against arts. */
static int parse_arts_section(const kvd_page_view *v, int which, const kvd_codec_arts *arts,
                              kvd_codec_section *out, kvd_error *err)
{
    const int is_v = which == KVD_SECTION_V;
    const char *w = is_v ? "V" : "K";
    const uint32_t H = v->h.num_kv_heads, T = v->h.num_tokens, D = v->h.head_dim;
    const uint8_t *p;
    uint64_t n;
    int rc0 = arts_section_start(v, which, &p, &n, err);
    if (rc0)
        return rc0;
    out->fingerprint = ld64(p + 8);
    const kvd_layer_arts *la = layer_arts(arts, is_v, v->h.layer);
    if (out->codec == KVD_CODEC_VQ) {
        int rc = parse_vq_section(v, which, out, err);
        if (rc)
            return rc;
        if (!la || !la->codebook)
            return kvd_error_set(err, KVD_EPRECOND,
                                 "%s section: VQ page of layer %u, but the sequence has no VQ "
                                 "codebooks for it",
                                 w, v->h.layer);
        if (la->vq_sub_dim != out->sub_dim || la->vq_bits != out->vq_bits)
            return kvd_error_set(err, KVD_EPRECOND,
                                 "%s section: coded as VQ d%db%d, the sequence's codebooks are "
                                 "d%ub%u",
                                 w, out->sub_dim, out->vq_bits, la->vq_sub_dim, la->vq_bits);
    } else {
        const size_t we = svd_widths_end(H);
        out->inner = p[0];
        if (out->inner > KVD_CODEC_INT4 || p[1] || ld16(p + 2) || ld32(p + 4))
            return CORRUPT("%s section: SVD prefix (inner codec %u) invalid", w, p[0]);
        if (n < we)
            return CORRUPT("%s section: %llu bytes, shorter than its width table", w,
                           (unsigned long long)n);
        for (size_t i = KVD_CODEC_ARTS_PREFIX + 2 * (size_t)H; i < we; i++)
            if (p[i])
                return CORRUPT("%s section: width table padding is not zero", w);
        kvd_codec_spec in;
        memset(&in, 0, sizeof in);
        in.codec = (uint8_t)out->inner;
        if (in.codec != KVD_CODEC_RAW) {
            if (n < we + KVD_CODEC_SECTION_PREFIX)
                return CORRUPT("%s section: SVD head block truncated", w);
            in.group = ld16(p + we);
            in.axis = p[we + 2];
            in.rounding = p[we + 3];
            if (ld32(p + we + 4))
                return CORRUPT("%s section: reserved codec bytes are not zero", w);
            out->bits = codec_bits(in.codec);
            out->group = in.group;
            out->axis = in.axis;
            out->rounding = in.rounding;
        }
        uint64_t off = we;
        for (uint32_t h = 0; h < H; h++) {
            uint32_t r = ld16(p + KVD_CODEC_ARTS_PREFIX + 2 * h);
            kvd_error e2;
            if (r < 1 || r > D)
                return CORRUPT("%s section: kv head %u width %u not in 1..%u", w, h, r, D);
            if (in.codec != KVD_CODEC_RAW &&
                kvd_codec_spec_check(&in, is_v, v->h.page_tokens, r, &e2))
                return CORRUPT("%s section: kv head %u: %s", w, h, e2.msg);
            uint64_t b = svd_block_bytes(&in, T, r, v->h.dtype);
            if (!b || b > n - off)
                return CORRUPT("%s section: kv head %u block overruns the section", w, h);
            if (in.codec != KVD_CODEC_RAW && memcmp(p + off, p + we, KVD_CODEC_SECTION_PREFIX))
                return CORRUPT("%s section: kv head %u block prefix differs from head 0's", w, h);
            out->svd_block[h] = p + off;
            off += b;
        }
        if (off != n)
            return CORRUPT("%s section: %llu bytes, its blocks cover %llu", w,
                           (unsigned long long)n, (unsigned long long)off);
        if (!la || !la->rotation)
            return kvd_error_set(err, KVD_EPRECOND,
                                 "%s section: SVD page of layer %u, but the sequence has no SVD "
                                 "rotations for it",
                                 w, v->h.layer);
        for (uint32_t h = 0; h < H; h++)
            if ((int32_t)ld16(p + KVD_CODEC_ARTS_PREFIX + 2 * h) != la->widths[h])
                return kvd_error_set(err, KVD_EPRECOND,
                                     "%s section: kv head %u width %u, the sequence's is %d", w,
                                     h, ld16(p + KVD_CODEC_ARTS_PREFIX + 2 * h), la->widths[h]);
    }
    if (out->fingerprint != la->fingerprint)
        return kvd_error_set(err, KVD_EPRECOND,
                             "%s section: artifact fingerprint %016llx differs from the "
                             "sequence's %016llx (coded with other artifacts)",
                             w, (unsigned long long)out->fingerprint,
                             (unsigned long long)la->fingerprint);
    out->la = la;
    return 0;
}

/* Decode a VQ or SVD section (parsed) into dst, head-major in dtype. */
static int decode_arts_section(kvd_backend *be, const kvd_page_view *v, int is_v,
                               const kvd_codec_section *s, kvd_dtype dtype, void *dst,
                               kvd_error *err)
{
    const uint32_t H = v->h.num_kv_heads, T = v->h.num_tokens, D = v->h.head_dim;
    const size_t es = kvd_dtype_size(dtype);
    const kvd_layer_arts *la = s->la;
    float *x = malloc(sizeof(float) * T * D), *y = malloc(sizeof(float) * T * D);
    int rc = 0;
    if (!x || !y) {
        rc = kvd_error_set(err, KVD_ENOMEM, "out of memory decoding a page");
        goto done;
    }
    for (uint32_t h = 0; h < H && rc == 0; h++) {
        int64_t sh[2] = {T, D};
        kvd_tensor xt = kvd_tensor_make(KVD_DTYPE_F32, x, 2, sh);
        kvd_tensor yt = kvd_tensor_make(KVD_DTYPE_F32, y, 2, sh);
        float *res = x;
        if (s->codec == KVD_CODEC_VQ) {
            const int sd = s->sub_dim, b = s->vq_bits, cw = b <= 8 ? 1 : 2;
            int64_t cs[2] = {T, D / sd}, bs[2] = {(int64_t)1 << b, sd};
            kvd_tensor codes = kvd_tensor_make(
                s->vq_codes.dtype, (uint8_t *)s->vq_codes.data + (size_t)h * T * (D / sd) * cw,
                2, cs);
            kvd_tensor cb =
                kvd_tensor_make(KVD_DTYPE_F32, la->codebook + h * cb_floats(la), 2, bs);
            if ((rc = kvd_vq_decode(be, &codes, &cb, &xt, err)))
                break;
            if (!is_v) {
                /* K~ = (K / lambda) H, H symmetric orthogonal: K = (K~ H) * lambda */
                if ((rc = kvd_vq_transform_keys(be, &xt, NULL, &yt, err)))
                    break;
                const float *lam = la->lambda + (size_t)h * D;
                for (size_t t = 0; t < T; t++)
                    for (size_t i = 0; i < D; i++)
                        y[t * D + i] *= lam[i];
                res = y;
            }
        } else {
            const uint32_t r = (uint32_t)la->widths[h];
            if (s->inner == KVD_CODEC_RAW) {
                rc = head_to_f32(be, s->svd_block[h], v->h.dtype, T, r, y, err);
            } else {
                kvd_qtensor q;
                int_head_views(s->svd_block[h], s->bits, s->group, s->axis, T, r, &q, NULL);
                int64_t rs[2] = {T, r};
                kvd_tensor ot = kvd_tensor_make(KVD_DTYPE_F32, y, 2, rs);
                rc = kvd_dequantize(be, &q, &ot, err);
            }
            if (rc || (rc = kvd_svd_unproject(be, la->rotation + (size_t)h * D * D, (int)D,
                                              (int)r, y, T, x, err)))
                break;
        }
        rc = f32_to(be, res, dtype, T, D, (uint8_t *)dst + (size_t)h * T * D * es, err);
    }
done:
    free(x);
    free(y);
    return rc;
}

/* The fused VQ kernel's arguments for a page whose sections ks/vs are VQ. */
static void vq_args(const kvd_page_view *pv, const kvd_attn_dims *dims, const kvd_codec_section *ks,
                    const kvd_codec_section *vs, kvd_tensor tq, kvd_tensor to, kvd_tensor tl,
                    kvd_attn_vq_args *out)
{
    const int64_t H = pv->h.num_kv_heads, D = pv->h.head_dim;
    kvd_attn_vq_args a;
    memset(&a, 0, sizeof a);
    a.dims = *dims;
    a.q = tq;
    a.n_tokens = pv->h.num_tokens;
    int64_t kb[3] = {H, (int64_t)1 << ks->vq_bits, ks->sub_dim};
    int64_t vb[3] = {H, (int64_t)1 << vs->vq_bits, vs->sub_dim};
    int64_t ls[2] = {H, D}, es[3] = {H, 0, D};
    a.k_sub_dim = ks->sub_dim;
    a.k_bits = ks->vq_bits;
    a.k_codes = ks->vq_codes;
    a.k_codebook = kvd_tensor_make(KVD_DTYPE_F32, ks->la->codebook, 3, kb);
    a.k_lambda = kvd_tensor_make(KVD_DTYPE_F32, ks->la->lambda, 2, ls);
    a.k_hadamard = 1;
    a.v_sub_dim = vs->sub_dim;
    a.v_bits = vs->vq_bits;
    a.v_codes = vs->vq_codes;
    a.v_codebook = kvd_tensor_make(KVD_DTYPE_F32, vs->la->codebook, 3, vb);
    a.k_tail = kvd_tensor_make(KVD_DTYPE_F32, NULL, 3, es);
    a.v_tail = a.k_tail;
    a.out = to;
    a.lse = tl;
    *out = a;
}

/* The reduced-width kernel's arguments for a page whose sections ks/vs are
 * SVD with raw inner blocks. */
static void svd_raw_args(const kvd_page_view *pv, const kvd_attn_dims *dims,
                         const kvd_codec_section *ks, const kvd_codec_section *vs, kvd_tensor tq,
                         kvd_tensor to, kvd_tensor tl, kvd_attn_svd_args *out)
{
    const int64_t H = pv->h.num_kv_heads, D = pv->h.head_dim;
    kvd_attn_svd_args a;
    memset(&a, 0, sizeof a);
    a.dims = *dims;
    a.q = tq;
    int64_t rs[3] = {H, D, D};
    a.rk = kvd_tensor_make(KVD_DTYPE_F32, ks->la->rotation, 3, rs);
    a.rv = kvd_tensor_make(KVD_DTYPE_F32, vs->la->rotation, 3, rs);
    a.k_width = ks->la->widths;
    a.v_width = vs->la->widths;
    a.n_tokens = pv->h.num_tokens;
    a.dtype = pv->h.dtype;
    a.k_red = ks->svd_block[0];
    a.v_red = vs->svd_block[0];
    a.out = to;
    a.lse = tl;
    *out = a;
}

/* SVD+INT over n pages on the same rotations and INT specs (sec: K and V
 * sections of each page, in turn): the query projected once per kv head,
 * one INT item per kv head at its reduced widths over the pages' blocks of
 * that head (segments), the outputs rotated back once. */
static int attend_svd_int(kvd_backend *be, const kvd_page_view *pvs, const kvd_codec_section *sec,
                          size_t n, const kvd_attn_dims *dims, const float *q, float *out,
                          float *lse, kvd_error *err)
{
    const int H = (int)pvs[0].h.num_kv_heads, D = (int)pvs[0].h.head_dim, G = dims->n_q_heads / H;
    const kvd_codec_section *ks = &sec[0], *vs = &sec[1];
    float *qp = malloc(sizeof(float) * (size_t)H * G * D);
    float *op = malloc(sizeof(float) * (size_t)H * G * D);
    kvd_attn_int_args *a = calloc((size_t)H, sizeof *a);
    kvd_attn_int_segment *sg = n > 1 ? calloc((size_t)H * n, sizeof *sg) : NULL;
    int rc = 0;
    if (!qp || !op || !a || (n > 1 && !sg)) {
        rc = kvd_error_set(err, KVD_ENOMEM, "out of memory");
        goto done;
    }
    uint64_t T = 0;
    for (size_t b = 0; b < n; b++)
        T += pvs[b].h.num_tokens;
    for (int h = 0; h < H && rc == 0; h++) {
        const int rk = ks->la->widths[h], rv = vs->la->widths[h];
        float *qh = qp + (size_t)h * G * D;
        if ((rc =
                 kvd_svd_project(be, ks->la->rotation + (size_t)h * D * D, D, rk,
                                 q + (size_t)h * G * D, KVD_DTYPE_F32, G, (int64_t)D * 4, qh, err)))
            break;
        int64_t qs[2] = {G, rk}, os[2] = {G, rv}, ls[1] = {G};
        int64_t kt[3] = {1, 0, rk}, vt[3] = {1, 0, rv};
        kvd_attn_int_args *x = &a[h];
        x->dims.n_q_heads = G;
        x->dims.n_kv_heads = 1;
        x->dims.head_dim = rk;
        x->dims.v_dim = rv;
        x->dims.softmax_scale = dims->softmax_scale;
        x->q = kvd_tensor_make(KVD_DTYPE_F32, qh, 2, qs);
        x->n_tokens = (int64_t)T;
        for (size_t b = 0; b < n; b++) {
            const kvd_codec_section *kb = &sec[2 * b], *vb = &sec[2 * b + 1];
            const uint32_t Tb = pvs[b].h.num_tokens;
            kvd_attn_qdata kq, vq;
            int_head_views(kb->svd_block[h], kb->bits, kb->group, kb->axis, Tb, (uint32_t)rk, NULL,
                           &kq);
            int_head_views(vb->svd_block[h], vb->bits, vb->group, vb->axis, Tb, (uint32_t)rv, NULL,
                           &vq);
            if (b == 0) {
                x->k = kq;
                x->v = vq;
            }
            if (sg)
                sg[(size_t)h * n + b] = (kvd_attn_int_segment){Tb, kq, vq};
        }
        if (sg) {
            x->n_segments = (int)n;
            x->segments = &sg[(size_t)h * n];
        }
        x->k_tail = kvd_tensor_make(KVD_DTYPE_F32, NULL, 3, kt);
        x->v_tail = kvd_tensor_make(KVD_DTYPE_F32, NULL, 3, vt);
        x->out = kvd_tensor_make(KVD_DTYPE_F32, op + (size_t)h * G * D, 2, os);
        x->lse = kvd_tensor_make(KVD_DTYPE_F32, lse + (size_t)h * G, 1, ls);
    }
    if (rc == 0)
        rc = kvd_attn_quant(be, H, a, err);
    for (int h = 0; h < H && rc == 0; h++)
        rc = kvd_svd_unproject(be, vs->la->rotation + (size_t)h * D * D, D, vs->la->widths[h],
                               op + (size_t)h * G * D, G, out + (size_t)h * G * D, err);
done:
    free(qp);
    free(op);
    free(a);
    free(sg);
    return rc;
}

/* The snapshot layer a VQ/SVD spec codes with (NULL for others). */
static int encode_arts(const kvd_codec_spec *s, int is_v, const kvd_page_desc *d,
                       const kvd_layer_arts **la, kvd_error *err)
{
    *la = NULL;
    if (s->codec != KVD_CODEC_VQ && !s->svd)
        return 0;
    const char *w = is_v ? "v" : "k";
    const kvd_layer_arts *l = layer_arts(s->arts, is_v, d->layer);
    if (!l || s->arts->num_kv_heads != d->num_kv_heads || s->arts->head_dim != d->head_dim)
        return kvd_error_set(err, KVD_EINVAL,
                             "page encode: %s codec needs the sequence's artifacts for layer %u",
                             w, d->layer);
    if (s->codec == KVD_CODEC_VQ &&
        (!l->codebook || l->vq_sub_dim != s->vq_sub_dim || l->vq_bits != s->vq_bits))
        return kvd_error_set(err, KVD_EINVAL,
                             "page encode: %s VQ d%ub%u does not match the artifacts' codebooks",
                             w, s->vq_sub_dim, s->vq_bits);
    if (s->svd && !l->rotation)
        return kvd_error_set(err, KVD_EINVAL, "page encode: %s SVD needs rotations", w);
    *la = l;
    return 0;
}

static uint64_t side_bytes(const kvd_codec_spec *s, const kvd_layer_arts *la,
                           const kvd_page_desc *d)
{
    if (s->svd)
        return svd_section_bytes(s, la->widths, d->num_kv_heads, d->num_tokens, d->dtype);
    return kvd_codec_section_bytes(s, d->num_kv_heads, d->num_tokens, d->head_dim, d->dtype);
}

static int encode_side(kvd_backend *be, const kvd_page_desc *d, const kvd_codec_spec *s,
                       const kvd_layer_arts *la, int is_v, const void *src, size_t rawsec,
                       uint8_t *dst, kvd_error *err)
{
    if (s->svd)
        return encode_svd(be, d, s, la, is_v, src, dst, err);
    if (s->codec == KVD_CODEC_VQ)
        return encode_vq(be, d, la, is_v, src, dst, err);
    if (s->codec == KVD_CODEC_RAW) {
        memcpy(dst, src, rawsec);
        return 0;
    }
    return encode_section(be, d, s, is_v, src, dst, err);
}

/* Does be compute in device memory (the CUDA backend) rather than the host's? */
static int on_device(const kvd_backend *be)
{
    kvd_backend_desc desc;
    kvd_backend_describe(be, &desc);
    return desc.device[0] != '\0';
}

static size_t align256(size_t x)
{
    return (x + 255) & ~(size_t)255;
}

/* A page on its way to being coded (page_prepare): its specs after the
 * raw tail rule, their artifacts, and the page with header and section
 * table written, its sections still to fill. */
typedef struct page_job {
    kvd_codec_spec ks, vs;
    const kvd_layer_arts *kla, *vla;
    uint8_t *page; /* hsize + kb + vb bytes; NULL for a raw page */
    size_t hsize, rawsec;
    uint64_t kb, vb;
} page_job;

static int page_prepare(const kvd_page_desc *d, const kvd_codec_spec *ks_in,
                        const kvd_codec_spec *vs_in, page_job *j, kvd_error *err)
{
    memset(j, 0, sizeof *j);
    j->ks = *ks_in;
    j->vs = *vs_in;
    /* The raw tail rule: only a page holding its whole block is coded. */
    if (d->num_tokens < d->page_tokens) {
        j->ks.codec = KVD_CODEC_RAW;
        j->vs.codec = KVD_CODEC_RAW;
    }
    int rc;
    if ((rc = kvd_codec_spec_check(&j->ks, 0, d->page_tokens, d->head_dim, err)) ||
        (rc = kvd_codec_spec_check(&j->vs, 1, d->page_tokens, d->head_dim, err)))
        return rc;
    if (j->ks.codec == KVD_CODEC_RAW && j->vs.codec == KVD_CODEC_RAW && !j->ks.svd && !j->vs.svd)
        return 0; /* a raw page: kvd_page_encode_raw */
    if ((rc = encode_arts(&j->ks, 0, d, &j->kla, err)) ||
        (rc = encode_arts(&j->vs, 1, d, &j->vla, err)))
        return rc;
    /* The header and table are those of a raw page with other codecs and
     * lengths: build the raw header into a scratch page, then patch. */
    j->kb = side_bytes(&j->ks, j->kla, d);
    j->vb = side_bytes(&j->vs, j->vla, d);
    j->hsize = KVD_PAGE_FIXED_HEADER + 2 * KVD_PAGE_SECTION_ENTRY;
    if (!j->kb || !j->vb)
        return kvd_error_set(err, KVD_EINVAL, "page encode: shape does not fit the codec");
    uint8_t *page = malloc(j->hsize + j->kb + j->vb);
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
    memcpy(page, scratch, j->hsize);
    free(scratch);
    st32(page + 24, d->num_tokens);
    page[11] |= KVD_PAGE_SEALED; /* num_tokens == page_tokens here */
    const uint8_t kc = j->ks.svd ? KVD_CODEC_SVD : j->ks.codec;
    const uint8_t vc = j->vs.svd ? KVD_CODEC_SVD : j->vs.codec;
    page[8] = kc;
    page[9] = vc;
    uint8_t *e = page + KVD_PAGE_FIXED_HEADER;
    e[2] = kc;
    st64(e + 8, j->hsize);
    st64(e + 16, j->kb);
    e += KVD_PAGE_SECTION_ENTRY;
    e[2] = vc;
    st64(e + 8, j->hsize + j->kb);
    st64(e + 16, j->vb);
    j->rawsec = (size_t)d->num_kv_heads * d->num_tokens * d->head_dim * kvd_dtype_size(d->dtype);
    j->page = page;
    return 0;
}

static int encode_device_batch(kvd_backend *be, size_t n, const kvd_page_desc *d,
                               const page_job *jobs, const void *const *k, const void *const *v,
                               int in_dev, kvd_dev_sections *keep, kvd_error *err);

int kvd_page_encode(kvd_backend *be, const kvd_page_desc *d, const kvd_codec_spec *ks_in,
                    const kvd_codec_spec *vs_in, const void *k, const void *v, uint8_t **out,
                    size_t *len, kvd_error *err)
{
    *out = NULL;
    *len = 0;
    if (!be || !d || !ks_in || !vs_in || !k || !v)
        return kvd_error_set(err, KVD_EINVAL, "page encode: NULL argument");
    page_job j;
    int rc = page_prepare(d, ks_in, vs_in, &j, err);
    if (rc)
        return rc;
    if (!j.page)
        return kvd_page_encode_raw(d, k, v, out, len, err);
    uint8_t *sec = j.page + j.hsize;
    if (on_device(be))
        rc = encode_device_batch(be, 1, d, &j, &k, &v, 0, NULL, err);
    else if ((rc = encode_side(be, d, &j.ks, j.kla, 0, k, j.rawsec, sec, err)) == 0)
        rc = encode_side(be, d, &j.vs, j.vla, 1, v, j.rawsec, sec + j.kb, err);
    if (rc) {
        free(j.page);
        return rc;
    }
    kvd_page_finish(j.page, j.hsize + j.kb + j.vb);
    *out = j.page;
    *len = j.hsize + j.kb + j.vb;
    return 0;
}

/*
 * Sealing pages of one layer on a device, together: every page's coded
 * sides (and a VQ side's smoothing and codebooks, once) go up in one batch
 * of copies into one scratch block, an INT side is one quantize batch over
 * all pages and heads, a VQ side a transform and an encode launch per page
 * and head, and the coded arrays come down in one batch of copies. A raw
 * side is copied on the host. The pages' headers and prefixes are written
 * here (jobs[p].page). With in_dev, k[p] and v[p] are already in be's
 * memory: nothing goes up but the artifacts, and a raw side comes down
 * with the coded arrays. With keep, the scratch block stays and *keep says
 * where each page's arrays lie in it.
 */
static int encode_device_batch(kvd_backend *be, size_t n, const kvd_page_desc *d,
                               const page_job *jobs, const void *const *k, const void *const *v,
                               int in_dev, kvd_dev_sections *keep, kvd_error *err)
{
    const uint32_t H = d[0].num_kv_heads, T = d[0].num_tokens, D = d[0].head_dim;
    const size_t rawsec = jobs[0].rawsec;
    const kvd_codec_spec *sp[2] = {&jobs[0].ks, &jobs[0].vs};
    const kvd_layer_arts *la[2] = {jobs[0].kla, jobs[0].vla};
    const uint64_t len[2] = {jobs[0].kb, jobs[0].vb};
    /* Scratch: per coded side, n x ([raw |] arrays); then the K side's
     * smoothing and each VQ side's codebooks, each SVD side's rotations;
     * then one f32 (T, D) work block for VQ and SVD. Every part 256-byte
     * aligned. An SVD side's arrays are its head blocks. */
    size_t pre[2] = {0, 0}, arr[2] = {0, 0}, o_side[2] = {0, 0}, per[2] = {0, 0};
    size_t o_cb[2] = {0, 0}, o_rot[2] = {0, 0}, o_lam = 0, total = 0, xbytes = 0;
    int vq[2] = {0, 0}, svd[2] = {sp[0]->svd, sp[1]->svd};
    for (int i = 0; i < 2; i++) {
        if (sp[i]->codec == KVD_CODEC_RAW && !svd[i])
            continue;
        vq[i] = sp[i]->codec == KVD_CODEC_VQ;
        pre[i] = svd[i]  ? svd_widths_end(H)
                 : vq[i] ? KVD_CODEC_ARTS_PREFIX
                         : KVD_CODEC_SECTION_PREFIX;
        arr[i] = (size_t)len[i] - pre[i];
        per[i] = (in_dev ? 0 : align256(rawsec)) + align256(arr[i]);
        o_side[i] = total;
        total += n * per[i];
    }
    for (int i = 0; i < 2; i++) {
        if (svd[i]) {
            o_rot[i] = total;
            total += align256(sizeof(float) * H * D * D);
            xbytes = sizeof(float) * T * D;
        }
        if (!vq[i])
            continue;
        if (i == 0) {
            o_lam = total;
            total += align256(sizeof(float) * H * D);
        }
        o_cb[i] = total;
        total += align256(sizeof(float) * H * cb_floats(la[i]));
        xbytes = sizeof(float) * T * D;
    }
    const size_t o_x = total;
    total += align256(xbytes);
    uint8_t *m = NULL;
    const size_t o_arr = in_dev ? 0 : align256(rawsec); /* arrays within a page's part */
    kvd_copy *ops = malloc(sizeof *ops * (2 * n + 5));
    kvd_tensor *x = malloc(sizeof *x * n * H);
    kvd_qtensor *q = malloc(sizeof *q * n * H);
    uint64_t *seeds = malloc(sizeof *seeds * n * H);
    int rc = ops && x && q && seeds ? kvd_backend_scratch(be, total, (void **)&m, err)
                                    : kvd_error_set(err, KVD_ENOMEM, "out of memory coding pages");
    size_t nops = 0;
    for (size_t p = 0; p < n && rc == 0; p++)
        for (int i = 0; i < 2; i++) {
            uint8_t *sec = jobs[p].page + jobs[p].hsize + (i ? jobs[p].kb : 0);
            if (sp[i]->codec == KVD_CODEC_RAW && !svd[i]) {
                if (!in_dev)
                    memcpy(sec, i ? v[p] : k[p], rawsec);
                continue;
            }
            if (svd[i])
                svd_prefix(sec, sp[i], la[i], H);
            else if (vq[i])
                vq_prefix(sec, la[i], i);
            else
                int_prefix(sec, sp[i]);
            if (in_dev)
                continue;
            ops[nops++] = (kvd_copy){.dst = m + o_side[i] + p * per[i],
                                     .src = i ? v[p] : k[p],
                                     .bytes = rawsec,
                                     .to_device = 1};
        }
    for (int i = 0; i < 2 && rc == 0; i++) {
        if (svd[i])
            ops[nops++] = (kvd_copy){.dst = m + o_rot[i],
                                     .src = la[i]->rotation,
                                     .bytes = sizeof(float) * H * D * D,
                                     .to_device = 1};
        if (!vq[i])
            continue;
        if (i == 0)
            ops[nops++] = (kvd_copy){
                .dst = m + o_lam, .src = la[i]->lambda, .bytes = sizeof(float) * H * D, .to_device = 1};
        ops[nops++] = (kvd_copy){.dst = m + o_cb[i],
                                 .src = la[i]->codebook,
                                 .bytes = sizeof(float) * H * cb_floats(la[i]),
                                 .to_device = 1};
    }
    if (rc == 0)
        rc = kvd_backend_copy_batch(be, ops, nops, err);
    for (int i = 0; i < 2 && rc == 0; i++) {
        if (sp[i]->codec == KVD_CODEC_RAW && !svd[i])
            continue;
        for (size_t p = 0; p < n && rc == 0; p++) {
            uint8_t *part = m + o_side[i] + p * per[i];
            const void *raw = in_dev ? (i ? v[p] : k[p]) : part;
            rc = svd[i]  ? svd_heads(be, &d[p], sp[i], la[i], (const float *)(void *)(m + o_rot[i]),
                                     i, raw, part + o_arr, (float *)(void *)(m + o_x), err)
                 : vq[i] ? vq_heads(be, &d[p], la[i], (const float *)(void *)(m + o_lam),
                                    (const float *)(void *)(m + o_cb[i]), i, raw, part + o_arr,
                                    (float *)(void *)(m + o_x), err)
                         : head_blocks(&d[p], sp[i], i, raw, part + o_arr, x + p * H, q + p * H,
                                       seeds + p * H, err);
        }
        if (rc == 0 && !vq[i] && !svd[i])
            rc = kvd_quantize_batch(be, (int)(n * H), x, q, (kvd_rounding)sp[i]->rounding, seeds,
                                    err);
    }
    nops = 0;
    for (size_t p = 0; p < n && rc == 0; p++)
        for (int i = 0; i < 2; i++) {
            uint8_t *sec = jobs[p].page + jobs[p].hsize + (i ? jobs[p].kb : 0);
            if (sp[i]->codec != KVD_CODEC_RAW || svd[i])
                ops[nops++] = (kvd_copy){.dst = sec + pre[i],
                                         .src = m + o_side[i] + p * per[i] + o_arr,
                                         .bytes = arr[i],
                                         .to_device = 0};
            else if (in_dev)
                ops[nops++] = (kvd_copy){
                    .dst = sec, .src = i ? v[p] : k[p], .bytes = rawsec, .to_device = 0};
        }
    if (rc == 0)
        rc = kvd_backend_copy_batch(be, ops, nops, err);
    for (size_t p = 0; p < n && rc == 0; p++)
        for (int i = 0; i < 2; i++)
            if (svd[i])
                svd_int_prefixes(jobs[p].page + jobs[p].hsize + (i ? jobs[p].kb : 0), &d[p], sp[i],
                                 la[i]);
    if (rc == 0 && keep && !(keep->side = calloc(n, sizeof *keep->side)))
        rc = kvd_error_set(err, KVD_ENOMEM, "out of memory coding pages");
    if (rc == 0 && keep) {
        keep->be = be;
        keep->scratch = m;
        keep->n = n;
        m = NULL;
        for (size_t p = 0; p < n; p++)
            for (int i = 0; i < 2; i++) {
                kvd_dev_side *sd = &keep->side[p][i];
                if (sp[i]->codec == KVD_CODEC_RAW && !svd[i]) {
                    if (in_dev)
                        *sd = (kvd_dev_side){i ? v[p] : k[p], 0, rawsec};
                } else if (!svd[i]) {
                    *sd = (kvd_dev_side){(uint8_t *)keep->scratch + o_side[i] + p * per[i] + o_arr,
                                         pre[i], arr[i]};
                }
            }
    }
    if (m)
        kvd_backend_scratch_free(be, m);
    free(ops);
    free(x);
    free(q);
    free(seeds);
    return rc;
}

void kvd_dev_sections_free(kvd_dev_sections *s)
{
    if (!s)
        return;
    if (s->scratch)
        kvd_backend_scratch_free(s->be, s->scratch);
    free(s->side);
    memset(s, 0, sizeof *s);
}

int kvd_page_image_copies(const uint8_t *page, size_t len, const kvd_dev_sections *s, size_t p,
                          void *dst, kvd_copy *ops, size_t *nops, kvd_error *err)
{
    *nops = 0;
    if (!page || !s || p >= s->n || !dst)
        return kvd_error_set(err, KVD_EINVAL, "page image: bad argument");
    kvd_page_view v;
    int rc = kvd_page_decode_nocheck(page, len, &v, err);
    if (rc)
        return rc;
    /* The device ranges, in page order, and the host bytes around them. */
    struct dev_range {
        uint64_t off, len;
        const void *dev;
    } r[2];
    size_t nr = 0;
    for (int i = 0; i < 2; i++) {
        const kvd_dev_side *sd = &s->side[p][i];
        const uint64_t sec_len = i ? v.v_len : v.k_len;
        if (!sd->len)
            continue;
        if (sd->at > sec_len || sd->len > sec_len - sd->at)
            return kvd_error_set(err, KVD_ECORRUPT,
                                 "page image: the %s section of page %zu is shorter than its "
                                 "coded arrays",
                                 i ? "V" : "K", p);
        r[nr].off = (uint64_t)((i ? v.v : v.k) - page) + sd->at;
        r[nr].len = sd->len;
        r[nr].dev = sd->dev;
        nr++;
    }
    if (nr == 2 && r[1].off < r[0].off) {
        struct dev_range t = r[0];
        r[0] = r[1];
        r[1] = t;
    }
    uint8_t *out = dst;
    uint64_t at = 0;
    for (size_t i = 0; i <= nr; i++) {
        const uint64_t end = i < nr ? r[i].off : (uint64_t)len;
        if (end > at)
            ops[(*nops)++] = (kvd_copy){
                .dst = out + at, .src = page + at, .bytes = (size_t)(end - at), .to_device = 1};
        if (i < nr) {
            ops[(*nops)++] = (kvd_copy){
                .dst = out + r[i].off, .src = r[i].dev, .bytes = (size_t)r[i].len, .within = 1};
            at = r[i].off + r[i].len;
        }
    }
    return 0;
}

/* Check the arguments of kvd_pages_encode(_device); clears out and len. */
static int pages_args(kvd_backend *be, size_t n, const kvd_page_desc *d, const kvd_codec_spec *ks,
                      const kvd_codec_spec *vs, const void *const *k, const void *const *v,
                      uint8_t **out, size_t *len, kvd_error *err)
{
    if (n && (!be || !d || !ks || !vs || !k || !v || !out || !len))
        return kvd_error_set(err, KVD_EINVAL, "pages encode: NULL argument");
    for (size_t p = 0; p < n; p++) {
        out[p] = NULL;
        len[p] = 0;
        if (!k[p] || !v[p])
            return kvd_error_set(err, KVD_EINVAL, "pages encode: page %zu has no K or V", p);
    }
    return 0;
}

/* n sealing pages of one layer and shape coded together on be
 * (encode_device_batch): out[p], len[p], or all NULL on failure. */
static int pages_together(kvd_backend *be, size_t n, const kvd_page_desc *d,
                          const kvd_codec_spec *ks, const kvd_codec_spec *vs, const void *const *k,
                          const void *const *v, int in_dev, uint8_t **out, size_t *len,
                          kvd_dev_sections *keep, kvd_error *err)
{
    page_job *jobs = calloc(n, sizeof *jobs);
    if (!jobs)
        return kvd_error_set(err, KVD_ENOMEM, "out of memory coding pages");
    int rc = 0;
    for (size_t p = 0; p < n && rc == 0; p++) {
        const kvd_page_desc *a = &d[p], *b = &d[0];
        if (a->dtype != b->dtype || a->layer != b->layer || a->num_tokens != a->page_tokens ||
            a->page_tokens != b->page_tokens || a->num_kv_heads != b->num_kv_heads ||
            a->head_dim != b->head_dim)
            rc = kvd_error_set(err, KVD_EINVAL,
                               "pages encode: page %zu is not a sealing page of page 0's layer "
                               "and shape",
                               p);
        else
            rc = page_prepare(a, ks, vs, &jobs[p], err);
    }
    if (rc == 0 && !jobs[0].page) /* both sides raw: nothing to code */
        rc = kvd_error_set(err, KVD_EINVAL, "pages encode: both sides are raw");
    if (rc == 0)
        rc = encode_device_batch(be, n, d, jobs, k, v, in_dev, keep, err);
    for (size_t p = 0; p < n; p++) {
        if (rc == 0) {
            len[p] = jobs[p].hsize + jobs[p].kb + jobs[p].vb;
            kvd_page_finish(jobs[p].page, len[p]);
            out[p] = jobs[p].page;
        } else {
            free(jobs[p].page);
        }
    }
    free(jobs);
    return rc;
}

int kvd_pages_encode(kvd_backend *be, size_t n, const kvd_page_desc *d, const kvd_codec_spec *ks,
                     const kvd_codec_spec *vs, const void *const *k, const void *const *v,
                     uint8_t **out, size_t *len, kvd_error *err)
{
    int rc = pages_args(be, n, d, ks, vs, k, v, out, len, err);
    if (rc)
        return rc;
    const int coded =
        ks->codec != KVD_CODEC_RAW || vs->codec != KVD_CODEC_RAW || ks->svd || vs->svd;
    if (n > 1 && coded && on_device(be))
        return pages_together(be, n, d, ks, vs, k, v, 0, out, len, NULL, err);
    /* One page at a time: on the CPU, raw pages, a single page. */
    for (size_t p = 0; p < n && rc == 0; p++)
        rc = kvd_page_encode(be, &d[p], ks, vs, k[p], v[p], &out[p], &len[p], err);
    if (rc)
        for (size_t p = 0; p < n; p++) {
            free(out[p]);
            out[p] = NULL;
            len[p] = 0;
        }
    return rc;
}

int kvd_pages_encode_device(kvd_backend *be, size_t n, const kvd_page_desc *d,
                            const kvd_codec_spec *ks, const kvd_codec_spec *vs,
                            const void *const *k, const void *const *v, uint8_t **out, size_t *len,
                            kvd_dev_sections *keep, kvd_error *err)
{
    if (keep)
        memset(keep, 0, sizeof *keep);
    int rc = pages_args(be, n, d, ks, vs, k, v, out, len, err);
    if (rc || !n)
        return rc;
    if (!on_device(be))
        return kvd_error_set(err, KVD_EINVAL,
                             "pages encode: K and V in device memory need a "
                             "device backend");
    return pages_together(be, n, d, ks, vs, k, v, 1, out, len, keep, err);
}

int kvd_codec_section_parse(const kvd_page_view *v, int which, const kvd_codec_arts *arts,
                            kvd_codec_section *out, kvd_error *err)
{
    memset(out, 0, sizeof *out);
    const uint8_t codec = which == KVD_SECTION_K ? v->h.k_codec : v->h.v_codec;
    const uint8_t *p = which == KVD_SECTION_K ? v->k : v->v;
    const uint64_t n = which == KVD_SECTION_K ? v->k_len : v->v_len;
    const char *w = which == KVD_SECTION_K ? "K" : "V";
    out->codec = codec;
    if (codec == KVD_CODEC_RAW)
        return 0;
    if (codec == KVD_CODEC_VQ || codec == KVD_CODEC_SVD)
        return parse_arts_section(v, which, arts, out, err);
    if (codec != KVD_CODEC_INT2 && codec != KVD_CODEC_INT4)
        return kvd_error_set(err, KVD_EUNSUPP, "%s section: codec %u cannot be read here", w,
                             codec);
    if (n < KVD_CODEC_SECTION_PREFIX)
        return CORRUPT("%s section: %llu bytes, shorter than its codec prefix", w,
                       (unsigned long long)n);
    kvd_codec_spec s;
    memset(&s, 0, sizeof s);
    s.codec = codec;
    s.group = ld16(p);
    s.axis = p[2];
    s.rounding = p[3];
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

int kvd_page_decode_section(kvd_backend *be, const kvd_page_view *v, int which,
                            const kvd_codec_arts *arts, kvd_dtype dtype, void *dst,
                            kvd_error *err)
{
    kvd_codec_section *sp = malloc(sizeof *sp);
    if (!sp)
        return kvd_error_set(err, KVD_ENOMEM, "out of memory decoding a page");
    int rc = kvd_codec_section_parse(v, which, arts, sp, err);
    if (rc == 0 && (sp->codec == KVD_CODEC_VQ || sp->codec == KVD_CODEC_SVD)) {
        rc = kvd_dtype_size(dtype)
                 ? decode_arts_section(be, v, which == KVD_SECTION_V, sp, dtype, dst, err)
                 : kvd_error_set(err, KVD_EINVAL, "decode: bad dtype %d", (int)dtype);
        free(sp);
        return rc;
    }
    kvd_codec_section s;
    if (rc == 0)
        memcpy(&s, sp, offsetof(kvd_codec_section, svd_block));
    free(sp);
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

static int is_int(uint8_t c) { return c == KVD_CODEC_INT2 || c == KVD_CODEC_INT4; }

/* Attention of one page whose codecs no kernel takes together (a mix,
 * kvd_page_attend) into (out, lse): both sections decoded to f32. */
static int attend_one(kvd_backend *be, const kvd_page_view *pv, const kvd_codec_arts *arts,
                      const kvd_attn_dims *dims, const float *q, float *out, float *lse,
                      kvd_error *err)
{
    const uint32_t H = pv->h.num_kv_heads, T = pv->h.num_tokens, D = pv->h.head_dim;
    float *kf = malloc(sizeof(float) * H * T * D), *vf = malloc(sizeof(float) * H * T * D);
    int rc;
    if (!kf || !vf) {
        rc = kvd_error_set(err, KVD_ENOMEM, "out of memory decoding a page");
        goto done;
    }
    if ((rc = kvd_page_decode_section(be, pv, KVD_SECTION_K, arts, KVD_DTYPE_F32, kf, err)) ||
        (rc = kvd_page_decode_section(be, pv, KVD_SECTION_V, arts, KVD_DTYPE_F32, vf, err)))
        goto done;
    int64_t qs[2] = {dims->n_q_heads, D}, ls[1] = {dims->n_q_heads}, ksh[3] = {H, T, D};
    kvd_attn_dense_args a;
    memset(&a, 0, sizeof a);
    a.dims = *dims;
    a.q = kvd_tensor_make(KVD_DTYPE_F32, (void *)q, 2, qs);
    a.k = kvd_tensor_make(KVD_DTYPE_F32, kf, 3, ksh);
    a.v = kvd_tensor_make(KVD_DTYPE_F32, vf, 3, ksh);
    a.out = kvd_tensor_make(KVD_DTYPE_F32, out, 2, qs);
    a.lse = kvd_tensor_make(KVD_DTYPE_F32, lse, 1, ls);
    rc = kvd_attn_dense(be, 1, &a, err);
done:
    free(kf);
    free(vf);
    return rc;
}

/* Page cnt's SVD+INT sections code as page 0's (same rotations, widths and
 * INT specs): one attend_svd_int takes both. */
static int same_svd_int(const kvd_codec_section *sec, size_t cnt)
{
    for (int s = 0; s < 2; s++) {
        const kvd_codec_section *a = &sec[s], *b = &sec[2 * cnt + s];
        if (a->la != b->la || a->inner != b->inner || a->bits != b->bits || a->group != b->group ||
            a->axis != b->axis)
            return 0;
    }
    return 1;
}

/* Pages attended in one backend call at most (kvd_page_attend). */
#define PAGE_ATTEND_BATCH 64

/* Page pv's sections into ks/vs and the kind of call it takes: 1 INT keys
 * and values, 2 raw keys and values, 3 VQ keys and values, 4 SVD keys and
 * values over raw blocks, 5 SVD keys and values over INT blocks, 0 any
 * other (attend_one); -1 with *rc set on an error. */
static int batch_kind(const kvd_page_view *pv, const kvd_codec_arts *arts,
                      const kvd_attn_dims *dims, kvd_codec_section *ks, kvd_codec_section *vs,
                      int *rc, kvd_error *err)
{
    const uint32_t H = pv->h.num_kv_heads, D = pv->h.head_dim;
    if ((int)H != dims->n_kv_heads || (int)D != dims->head_dim || dims->v_dim != dims->head_dim) {
        *rc =
            kvd_error_set(err, KVD_EINVAL, "page of %u kv heads x %u dims, attention wants %d x %d",
                          H, D, dims->n_kv_heads, dims->head_dim);
        return -1;
    }
    if ((*rc = kvd_codec_section_parse(pv, KVD_SECTION_K, arts, ks, err)) ||
        (*rc = kvd_codec_section_parse(pv, KVD_SECTION_V, arts, vs, err)))
        return -1;
    if (is_int(ks->codec) && is_int(vs->codec))
        return 1;
    if (ks->codec == KVD_CODEC_VQ && vs->codec == KVD_CODEC_VQ)
        return 3;
    if (ks->codec == KVD_CODEC_SVD && vs->codec == KVD_CODEC_SVD && ks->inner == KVD_CODEC_RAW &&
        vs->inner == KVD_CODEC_RAW)
        return 4;
    if (ks->codec == KVD_CODEC_SVD && vs->codec == KVD_CODEC_SVD && is_int(ks->inner) &&
        is_int(vs->inner))
        return 5;
    return ks->codec == KVD_CODEC_RAW && vs->codec == KVD_CODEC_RAW ? 2 : 0;
}

/* Whether two items of a run can be one item over both pages' codes: the
 * same codebooks (VQ), rotations and widths (SVD), or coding (INT). */
static int vq_same(const kvd_attn_vq_args *x, const kvd_attn_vq_args *y)
{
    return x->k_codebook.data == y->k_codebook.data && x->v_codebook.data == y->v_codebook.data &&
           x->k_lambda.data == y->k_lambda.data && x->k_sub_dim == y->k_sub_dim &&
           x->k_bits == y->k_bits && x->v_sub_dim == y->v_sub_dim && x->v_bits == y->v_bits;
}

static int svd_same(const kvd_attn_svd_args *x, const kvd_attn_svd_args *y)
{
    return x->rk.data == y->rk.data && x->rv.data == y->rv.data && x->k_width == y->k_width &&
           x->v_width == y->v_width && x->dtype == y->dtype;
}

static int qd_same(const kvd_attn_qdata *a, const kvd_attn_qdata *b)
{
    return a->bits == b->bits && a->group == b->group && a->axis == b->axis;
}

static int int_same(const kvd_attn_int_args *x, const kvd_attn_int_args *y)
{
    return qd_same(&x->k, &y->k) && qd_same(&x->v, &y->v);
}

/* A page's codes as a segment, and an item's own codes cleared once it
 * takes segments. */
#define VQ_SEG(x) ((kvd_attn_vq_segment){(x)->n_tokens, (x)->k_codes, (x)->v_codes})
#define VQ_CLEAR(x) ((x)->k_codes = (x)->v_codes = (kvd_tensor){0})
#define SVD_SEG(x) ((kvd_attn_svd_segment){(x)->n_tokens, (x)->k_red, (x)->v_red})
#define SVD_CLEAR(x) ((x)->k_red = (x)->v_red = NULL)
#define INT_SEG(x) ((kvd_attn_int_segment){(x)->n_tokens, (x)->k, (x)->v})
#define INT_CLEAR(x) ((void)(x)) /* k and v keep the coding the segments share */

/* name(a, n, seg, po, pl, qf, Hq): consecutive items of a[0, n) that SAME
 * joins become one item over their pages' codes as segments (in seg), so
 * that the kernel prepares the query once per run rather than per page;
 * item i then writes po/pl slot i. Returns the items left. */
#define DEFINE_JOIN(name, argt, segt, SAME, SEG, CLEAR)                                            \
    static size_t name(argt *a, size_t n, segt *seg, float *po, float *pl, size_t qf, int Hq)      \
    {                                                                                              \
        size_t m = 0;                                                                              \
        for (size_t i = 0; i < n;) {                                                               \
            size_t j = i + 1;                                                                      \
            while (j < n && SAME(&a[j], &a[i]))                                                    \
                j++;                                                                               \
            argt x = a[i];                                                                         \
            if (j - i > 1) {                                                                       \
                x.n_tokens = 0;                                                                    \
                for (size_t k = i; k < j; k++) {                                                   \
                    seg[k] = SEG(&a[k]);                                                           \
                    x.n_tokens += a[k].n_tokens;                                                   \
                }                                                                                  \
                x.n_segments = (int)(j - i);                                                       \
                x.segments = &seg[i];                                                              \
                CLEAR(&x);                                                                         \
            }                                                                                      \
            x.out.data = po + m * qf;                                                              \
            x.lse.data = pl + m * (size_t)Hq;                                                      \
            a[m++] = x;                                                                            \
            i = j;                                                                                 \
        }                                                                                          \
        return m;                                                                                  \
    }

DEFINE_JOIN(vq_join, kvd_attn_vq_args, kvd_attn_vq_segment, vq_same, VQ_SEG, VQ_CLEAR)
DEFINE_JOIN(svd_join, kvd_attn_svd_args, kvd_attn_svd_segment, svd_same, SVD_SEG, SVD_CLEAR)
DEFINE_JOIN(int_join, kvd_attn_int_args, kvd_attn_int_segment, int_same, INT_SEG, INT_CLEAR)

/*
 * Runs of consecutive pages of one kind go to the backend as one call: raw
 * pages as one item per page (on the CPU the items run side by side); INT,
 * VQ and SVD-over-raw pages coded alike as one item over their codes
 * (segments: the query is prepared once per run); SVD-over-INT pages per kv
 * head (attend_svd_int). Pages of mixed codecs go one at a time
 * (attend_one). The results are merged in page order.
 */
int kvd_page_attend(kvd_backend *be, const kvd_page_view *pages, size_t n,
                    const kvd_codec_arts *arts, const kvd_attn_dims *dims, const float *q,
                    float *out, float *lse, kvd_error *err)
{
    const int Hq = dims->n_q_heads, D = dims->v_dim;
    for (int h = 0; h < Hq; h++) {
        lse[h] = -INFINITY;
        for (int d = 0; d < D; d++)
            out[(size_t)h * D + d] = 0.0f;
    }
    if (n == 0)
        return 0;
    const size_t cap = n < PAGE_ATTEND_BATCH ? n : PAGE_ATTEND_BATCH, qf = (size_t)Hq * D;
    float *po = malloc(sizeof(float) * cap * qf);
    float *pl = malloc(sizeof(float) * cap * Hq);
    kvd_codec_section *sec = malloc(2 * cap * sizeof *sec);
    kvd_attn_int_args *ia = calloc(cap, sizeof *ia);
    kvd_attn_dense_args *da = calloc(cap, sizeof *da);
    kvd_attn_vq_args *va = calloc(cap, sizeof *va);
    kvd_attn_svd_args *sa = calloc(cap, sizeof *sa);
    /* the segments of a run's joined items, as an array of its kind's */
    void *seg = calloc(cap, sizeof(union {
                           kvd_attn_vq_segment vq;
                           kvd_attn_svd_segment svd;
                           kvd_attn_int_segment in;
                       }));
    int rc = 0, first = 1;
    if (!po || !pl || !sec || !ia || !da || !va || !sa || !seg) {
        rc = kvd_error_set(err, KVD_ENOMEM, "out of memory");
        goto done;
    }
    int64_t qs[2] = {Hq, dims->head_dim}, os[2] = {Hq, D}, ls[1] = {Hq};
    const kvd_tensor tq = kvd_tensor_make(KVD_DTYPE_F32, (void *)q, 2, qs);
    for (size_t i = 0; i < n && rc == 0;) {
        int kind = 0;
        size_t cnt = 0;
        while (i + cnt < n && cnt < cap) {
            const kvd_page_view *pv = &pages[i + cnt];
            const int k = batch_kind(pv, arts, dims, &sec[2 * cnt], &sec[2 * cnt + 1], &rc, err);
            if (k < 0)
                goto done;
            if (k == 0 || (cnt > 0 && k != kind) || (k == 5 && cnt > 0 && !same_svd_int(sec, cnt)))
                break;
            kind = k;
            const uint32_t H = pv->h.num_kv_heads, T = pv->h.num_tokens;
            const kvd_tensor to = kvd_tensor_make(KVD_DTYPE_F32, po + cnt * qf, 2, os);
            const kvd_tensor tl = kvd_tensor_make(KVD_DTYPE_F32, pl + cnt * Hq, 1, ls);
            if (kind == 1) {
                kvd_attn_int_args *a = &ia[cnt];
                a->dims = *dims;
                a->q = tq;
                a->n_tokens = T;
                a->k = sec[2 * cnt].q;
                a->v = sec[2 * cnt + 1].q;
                int64_t es[3] = {H, 0, dims->head_dim};
                a->k_tail = kvd_tensor_make(KVD_DTYPE_F32, NULL, 3, es);
                a->v_tail = a->k_tail;
                a->out = to;
                a->lse = tl;
            } else if (kind == 3) {
                vq_args(pv, dims, &sec[2 * cnt], &sec[2 * cnt + 1], tq, to, tl, &va[cnt]);
            } else if (kind == 4) {
                svd_raw_args(pv, dims, &sec[2 * cnt], &sec[2 * cnt + 1], tq, to, tl, &sa[cnt]);
            } else if (kind == 5) {
                /* attend_svd_int takes the run's sections as they are */
            } else {
                kvd_attn_dense_args *a = &da[cnt];
                int64_t ksh[3] = {H, T, dims->head_dim};
                a->dims = *dims;
                a->q = tq;
                a->k = kvd_tensor_make(pv->h.dtype, (void *)pv->k, 3, ksh);
                a->v = kvd_tensor_make(pv->h.dtype, (void *)pv->v, 3, ksh);
                a->out = to;
                a->lse = tl;
            }
            cnt++;
        }
        if (cnt == 0) { /* mixed codecs: this page alone */
            rc = attend_one(be, &pages[i], arts, dims, q, first ? out : po, first ? lse : pl, err);
            if (rc == 0 && !first)
                rc = kvd_attn_merge_into(be, Hq, D, out, lse, po, pl, err);
            first = 0;
            i++;
            continue;
        }
        const size_t nout = kind == 1   ? int_join(ia, cnt, seg, po, pl, qf, Hq)
                            : kind == 3 ? vq_join(va, cnt, seg, po, pl, qf, Hq)
                            : kind == 4 ? svd_join(sa, cnt, seg, po, pl, qf, Hq)
                            : kind == 5 ? 1
                                        : cnt;
        rc = kind == 1   ? kvd_attn_quant(be, (int)nout, ia, err)
             : kind == 5 ? attend_svd_int(be, &pages[i], sec, cnt, dims, q, po, pl, err)
             : kind == 3 ? kvd_attn_vq(be, (int)nout, va, err)
             : kind == 4 ? kvd_attn_svd(be, (int)nout, sa, err)
                         : kvd_attn_dense(be, (int)cnt, da, err);
        for (size_t b = 0; b < nout && rc == 0; b++) {
            if (first) {
                memcpy(out, po, sizeof(float) * qf);
                memcpy(lse, pl, sizeof(float) * Hq);
                first = 0;
            } else {
                rc = kvd_attn_merge_into(be, Hq, D, out, lse, po + b * qf, pl + b * Hq, err);
            }
        }
        i += cnt;
    }
done:
    free(po);
    free(pl);
    free(sec);
    free(ia);
    free(da);
    free(va);
    free(sa);
    free(seg);
    return rc;
}

/* ---- layouts of device-resident pages ------------------------------------ */

static kvd_tensor rel_tensor(kvd_tensor t, const uint8_t *base)
{
    t.data = (void *)(uintptr_t)((const uint8_t *)t.data - base);
    return t;
}

static kvd_tensor abs_tensor(kvd_tensor t, const void *base)
{
    t.data = (uint8_t *)base + (uintptr_t)t.data;
    return t;
}

/* Where the head blocks of an SVD section of a checked page start (its
 * head 0 block: reduced rows for an inner raw codec, an INT section of one
 * head for INT2/INT4), its inner codec's spec and its fingerprint; rows is
 * 1-D over all blocks (elements of the page's dtype for raw, bytes for INT).
 * The kept widths the section holds must add up to its length, and every
 * INT block carry the same prefix. 0, or KVD_ECORRUPT. */
static int svd_layout(const kvd_page_view *v, int which, const uint8_t *page, kvd_tensor *rows,
                      kvd_codec_spec *inner, uint64_t *fingerprint, kvd_error *err)
{
    const uint8_t *p = which == KVD_SECTION_K ? v->k : v->v;
    const uint64_t n = which == KVD_SECTION_K ? v->k_len : v->v_len;
    const uint32_t H = v->h.num_kv_heads, T = v->h.num_tokens, D = v->h.head_dim;
    const char *w = which == KVD_SECTION_K ? "K" : "V";
    const uint64_t head = svd_widths_end(H);
    if (n < head + (p[0] == KVD_CODEC_RAW ? 0 : KVD_CODEC_SECTION_PREFIX))
        return kvd_error_set(err, KVD_ECORRUPT, "%s section: %llu bytes, shorter than its widths",
                             w, (unsigned long long)n);
    memset(inner, 0, sizeof *inner);
    inner->codec = p[0];
    if (p[0] != KVD_CODEC_RAW) {
        inner->group = ld16(p + head);
        inner->axis = p[head + 2];
        inner->rounding = p[head + 3];
    }
    uint64_t blocks = 0;
    for (uint32_t h = 0; h < H; h++) {
        const uint32_t r = ld16(p + KVD_CODEC_ARTS_PREFIX + 2 * h);
        const uint64_t b = r > D ? 0 : svd_block_bytes(inner, T, r, v->h.dtype);
        if (r > D || (r && !b))
            return kvd_error_set(err, KVD_ECORRUPT, "%s section: kept width %u of head %u", w, r,
                                 h);
        if (p[0] != KVD_CODEC_RAW && r &&
            (head + blocks + b > n || memcmp(p + head + blocks, p + head, 4) != 0))
            return kvd_error_set(err, KVD_ECORRUPT, "%s section: head %u's block differs", w, h);
        blocks += b;
    }
    if (n != head + blocks)
        return kvd_error_set(err, KVD_ECORRUPT,
                             "%s section: %llu bytes, not what its kept widths need", w,
                             (unsigned long long)n);
    const int raw = p[0] == KVD_CODEC_RAW;
    int64_t sh[1] = {(int64_t)(raw ? blocks / kvd_dtype_size(v->h.dtype) : blocks)};
    *rows = rel_tensor(kvd_tensor_make(raw ? v->h.dtype : KVD_DTYPE_U8, (void *)(p + head), 1, sh),
                       page);
    *fingerprint = ld64(p + 8);
    return 0;
}

int kvd_page_layout_svd_fits(const kvd_page_layout *l, const int32_t *k_widths,
                             const int32_t *v_widths)
{
    const kvd_codec_spec *in[2] = {&l->k_svd, &l->v_svd};
    const int32_t *w[2] = {k_widths, v_widths};
    const kvd_tensor *rows[2] = {&l->k.codes, &l->v.codes};
    for (int i = 0; i < 2; i++) {
        uint64_t b = 0;
        for (uint32_t h = 0; h < l->num_kv_heads; h++) {
            if (w[i][h] < 0 || (uint32_t)w[i][h] > l->head_dim)
                return 0;
            b += svd_block_bytes(in[i], l->num_tokens, (uint32_t)w[i][h], l->dtype);
        }
        if (in[i]->codec == KVD_CODEC_RAW)
            b /= kvd_dtype_size(l->dtype);
        if ((uint64_t)rows[i]->shape[0] != b)
            return 0;
    }
    return 1;
}

void kvd_page_layout_svd_head(const kvd_page_layout *l, const void *base, int which,
                              const int32_t *widths, uint32_t h, kvd_attn_qdata *out)
{
    const kvd_codec_spec *in = which == KVD_SECTION_K ? &l->k_svd : &l->v_svd;
    const kvd_tensor *rows = which == KVD_SECTION_K ? &l->k.codes : &l->v.codes;
    uint64_t at = (uint64_t)(uintptr_t)rows->data;
    for (uint32_t g = 0; g < h; g++)
        at += svd_block_bytes(in, l->num_tokens, (uint32_t)widths[g], l->dtype);
    int_head_views((const uint8_t *)base + at, codec_bits(in->codec), in->group, in->axis,
                   l->num_tokens, (uint32_t)widths[h], NULL, out);
}

int kvd_page_layout_get(const uint8_t *page, const kvd_page_view *v, kvd_page_layout *out,
                        kvd_error *err)
{
    memset(out, 0, sizeof *out);
    const uint8_t kc = v->h.k_codec, vc = v->h.v_codec;
    const int raw = kc == KVD_CODEC_RAW && vc == KVD_CODEC_RAW;
    const int vq = kc == KVD_CODEC_VQ && vc == KVD_CODEC_VQ;
    out->k_codec = kc;
    out->v_codec = vc;
    out->dtype = v->h.dtype;
    out->num_tokens = v->h.num_tokens;
    out->num_kv_heads = v->h.num_kv_heads;
    out->head_dim = v->h.head_dim;
    kvd_page_pq pq;
    if (kvd_page_pq_get(v, &pq)) {
        out->pq_m = pq.m;
        out->pq_bits = pq.bits;
        out->pq_centroids_id = pq.centroids_id;
        out->pq_codes = (uint64_t)(pq.codes - page);
    }
    if (kc == KVD_CODEC_SVD && vc == KVD_CODEC_SVD && v->k_len && v->v_len &&
        ((v->k[0] == KVD_CODEC_RAW && v->v[0] == KVD_CODEC_RAW) ||
         (is_int(v->k[0]) && is_int(v->v[0])))) {
        /* SVD + raw: the reduced-dimension kernel over the rows; SVD + INT:
         * the INT kernel per kv head at its widths; both with the
         * sequence's rotations and widths (checked by fingerprint). */
        int rc = svd_layout(v, KVD_SECTION_K, page, &out->k.codes, &out->k_svd, &out->k_fingerprint,
                            err);
        if (rc == 0)
            rc = svd_layout(v, KVD_SECTION_V, page, &out->v.codes, &out->v_svd, &out->v_fingerprint,
                            err);
        out->attend = rc == 0;
        return rc;
    }
    if (!raw && !vq && !(is_int(kc) && is_int(vc)))
        return 0; /* no fused kernel for this pair: attend stays 0 */
    out->attend = 1;
    if (raw) {
        int64_t sh[3] = {v->h.num_kv_heads, v->h.num_tokens, v->h.head_dim};
        out->k.codes = rel_tensor(kvd_tensor_make(v->h.dtype, (void *)v->k, 3, sh), page);
        out->v.codes = rel_tensor(kvd_tensor_make(v->h.dtype, (void *)v->v, 3, sh), page);
        return 0;
    }
    kvd_codec_section *sec = malloc(2 * sizeof *sec);
    if (!sec)
        return kvd_error_set(err, KVD_ENOMEM, "out of memory");
    int rc;
    if (vq) {
        if ((rc = parse_vq_section(v, KVD_SECTION_K, &sec[0], err)) == 0 &&
            (rc = parse_vq_section(v, KVD_SECTION_V, &sec[1], err)) == 0) {
            out->k.codes = rel_tensor(sec[0].vq_codes, page);
            out->v.codes = rel_tensor(sec[1].vq_codes, page);
            out->k_sub_dim = sec[0].sub_dim;
            out->k_bits = sec[0].vq_bits;
            out->k_fingerprint = sec[0].fingerprint;
            out->v_sub_dim = sec[1].sub_dim;
            out->v_bits = sec[1].vq_bits;
            out->v_fingerprint = sec[1].fingerprint;
        }
        free(sec);
        return rc;
    }
    if ((rc = kvd_codec_section_parse(v, KVD_SECTION_K, NULL, &sec[0], err)) == 0 &&
        (rc = kvd_codec_section_parse(v, KVD_SECTION_V, NULL, &sec[1], err)) == 0) {
        kvd_attn_qdata *q[2] = {&out->k, &out->v};
        for (int i = 0; i < 2; i++) {
            *q[i] = sec[i].q;
            q[i]->codes = rel_tensor(sec[i].q.codes, page);
            q[i]->min = rel_tensor(sec[i].q.min, page);
            q[i]->scale = rel_tensor(sec[i].q.scale, page);
            q[i]->sum = rel_tensor(sec[i].q.sum, page);
        }
    }
    free(sec);
    return rc;
}

void kvd_page_layout_at(const kvd_page_layout *l, const void *base, kvd_attn_qdata *k,
                        kvd_attn_qdata *v)
{
    const kvd_attn_qdata *src[2] = {&l->k, &l->v};
    kvd_attn_qdata *dst[2] = {k, v};
    for (int i = 0; i < 2; i++) {
        *dst[i] = *src[i];
        dst[i]->codes = abs_tensor(src[i]->codes, base);
        if (is_int(l->k_codec)) {
            dst[i]->min = abs_tensor(src[i]->min, base);
            dst[i]->scale = abs_tensor(src[i]->scale, base);
            dst[i]->sum = abs_tensor(src[i]->sum, base);
        }
    }
}
