/*
 * Page codecs (store/format/codec.c): INT2/INT4, VQ and SVD pages encode, pass the
 * page decoder (checksum included), decode within the codec's error bound,
 * and attention over coded pages matches dense attention over their decoded
 * values; malformed specs, damaged coded sections and pages coded with other
 * artifacts (fingerprint) are refused.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "codec.h"
#include "kvdepot/attention.h"
#include "kvdepot/quant.h"
#include "kvdepot/svd.h"
#include "kvdepot/vq.h"

static int failures;
#define CHECK(c)                                                                                   \
    do {                                                                                           \
        if (!(c)) {                                                                                \
            fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #c);                  \
            failures++;                                                                            \
        }                                                                                          \
    } while (0)

static void fill(uint16_t *x, size_t n, uint64_t seed)
{
    uint64_t s = seed * 0x9e3779b97f4a7c15ull + 7;
    for (size_t i = 0; i < n; i++) {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        float f = (float)((s >> 40) & 0xffffff) / (float)(1 << 24) * 4.0f - 2.0f;
        x[i] = kvd_f32_to_f16(f);
    }
}

static kvd_codec_spec spec(uint8_t codec, uint16_t group, uint8_t axis, uint8_t round,
                           uint64_t seed)
{
    kvd_codec_spec s;
    memset(&s, 0, sizeof s);
    s.codec = codec;
    s.group = group;
    s.axis = axis;
    s.rounding = round;
    s.seed = seed;
    return s;
}

static double nmse(const float *a, const float *b, size_t n)
{
    double num = 0, den = 0;
    for (size_t i = 0; i < n; i++) {
        num += ((double)a[i] - b[i]) * ((double)a[i] - b[i]);
        den += (double)b[i] * b[i];
    }
    return den > 0 ? num / den : num;
}

/* ---- VQ and SVD sections ------------------------------------------------------------- */

#define AL 4 /* layers of the synthetic model; pages are of layer 3 */

typedef struct arts_fixture {
    float *lambda, *cbk, *cbv, *rk, *rv, *sk, *sv; /* per head, shared by every layer */
    kvd_art_ref refs[AL * 2 * 7];
    size_t n;
} arts_fixture;

/* LLM-like head data: rank-12 structure, a little noise, a few channels
 * several times larger than the rest (keys). f16 in x, f32 copy in xf. */
static void llm_like(uint16_t *x, float *xf, uint32_t H, uint32_t T, uint32_t D, int keys,
                     uint64_t seed)
{
    const int R = 12;
    uint16_t *u = malloc(sizeof(uint16_t) * (size_t)H * T * R);
    uint16_t *w = malloc(sizeof(uint16_t) * (size_t)H * R * D);
    uint16_t *e = malloc(sizeof(uint16_t) * (size_t)H * T * D);
    fill(u, (size_t)H * T * R, seed);
    fill(w, (size_t)H * R * D, seed + 1);
    fill(e, (size_t)H * T * D, seed + 2);
    for (uint32_t h = 0; h < H; h++)
        for (uint32_t t = 0; t < T; t++)
            for (uint32_t i = 0; i < D; i++) {
                float a = 0;
                for (int r = 0; r < R; r++)
                    a += kvd_f16_to_f32(u[((size_t)h * T + t) * R + r]) *
                         kvd_f16_to_f32(w[((size_t)h * R + r) * D + i]);
                a = a * 0.3f + 0.05f * kvd_f16_to_f32(e[((size_t)h * T + t) * D + i]);
                if (keys && (i == 3 || i == 17 || i == 40))
                    a *= 6.0f;
                size_t o = ((size_t)h * T + t) * D + i;
                x[o] = kvd_f32_to_f16(a);
                xf[o] = kvd_f16_to_f32(x[o]);
            }
    free(u);
    free(w);
    free(e);
}

static void add_ref(arts_fixture *f, int kind, uint32_t l, uint32_t h, uint32_t s0, uint32_t s1,
                    const float *data)
{
    kvd_art_ref *r = &f->refs[f->n++];
    r->kind = kind;
    r->layer = l;
    r->kv_head = h;
    r->ndim = s1 ? 2 : 1;
    r->shape[0] = s0;
    r->shape[1] = s1;
    r->data = data;
}

/* Calibrate on the page's own data (as Calibrate does on samples): lambda,
 * codebooks (2^b, d) for K and V, rotations and spectra; every layer gets
 * the same artifacts. */
static void calibrate(kvd_backend *be, arts_fixture *f, uint32_t H, uint32_t T, uint32_t D,
                      const float *kf, const float *vf, int d, int b)
{
    memset(f, 0, sizeof *f);
    const size_t cb = ((size_t)1 << b) * d;
    f->lambda = malloc(sizeof(float) * H * D);
    f->cbk = malloc(sizeof(float) * H * cb);
    f->cbv = malloc(sizeof(float) * H * cb);
    f->rk = malloc(sizeof(float) * H * D * D);
    f->rv = malloc(sizeof(float) * H * D * D);
    f->sk = malloc(sizeof(float) * H * D);
    f->sv = malloc(sizeof(float) * H * D);
    float *x = malloc(sizeof(float) * T * D);
    double *g = malloc(sizeof(double) * D * D);
    kvd_error err;
    for (uint32_t h = 0; h < H; h++) {
        const float *kh = kf + (size_t)h * T * D, *vh = vf + (size_t)h * T * D;
        kvd_vq_smooth_factors_ref(T, (int)D, kh, f->lambda + (size_t)h * D);
        kvd_vq_transform_keys_ref(T, (int)D, kh, f->lambda + (size_t)h * D, x);
        kvd_kmeans_params km = {1 << b, 8, 5 + h, 0};
        int64_t xs[2] = {T, D}, bs[2] = {1 << b, d};
        double inertia;
        kvd_tensor xt = kvd_tensor_make(KVD_DTYPE_F32, x, 2, xs);
        kvd_tensor ct = kvd_tensor_make(KVD_DTYPE_F32, f->cbk + h * cb, 2, bs);
        CHECK(kvd_vq_train(be, &xt, &km, &ct, &inertia, &err) == 0);
        xt.data = (void *)vh;
        ct.data = f->cbv + h * cb;
        CHECK(kvd_vq_train(be, &xt, &km, &ct, &inertia, &err) == 0);
        memset(g, 0, sizeof(double) * D * D);
        kvd_svd_gram_accumulate(g, (int)D, kh, KVD_DTYPE_F32, T, D * 4, 1.0, NULL);
        CHECK(kvd_svd_rotation(g, (int)D, f->rk + (size_t)h * D * D, f->sk + (size_t)h * D, &err) ==
              0);
        memset(g, 0, sizeof(double) * D * D);
        kvd_svd_gram_accumulate(g, (int)D, vh, KVD_DTYPE_F32, T, D * 4, 1.0, NULL);
        CHECK(kvd_svd_rotation(g, (int)D, f->rv + (size_t)h * D * D, f->sv + (size_t)h * D, &err) ==
              0);
    }
    for (uint32_t l = 0; l < AL; l++)
        for (uint32_t h = 0; h < H; h++) {
            add_ref(f, 1, l, h, D, 0, f->lambda + (size_t)h * D);
            add_ref(f, 2, l, h, 1u << b, (uint32_t)d, f->cbk + h * cb);
            add_ref(f, 3, l, h, 1u << b, (uint32_t)d, f->cbv + h * cb);
            add_ref(f, 4, l, h, D, D, f->rk + (size_t)h * D * D);
            add_ref(f, 5, l, h, D, D, f->rv + (size_t)h * D * D);
            add_ref(f, 6, l, h, D, 0, f->sk + (size_t)h * D);
            add_ref(f, 7, l, h, D, 0, f->sv + (size_t)h * D);
        }
    free(x);
    free(g);
}

static void fixture_free(arts_fixture *f)
{
    free(f->lambda);
    free(f->cbk);
    free(f->cbv);
    free(f->rk);
    free(f->rv);
    free(f->sk);
    free(f->sv);
}

/* Patch one byte of a section and fix the checksum; returns the copy. */
static uint8_t *patched(const uint8_t *page, size_t len, size_t off, uint8_t val)
{
    uint8_t *bad = malloc(len);
    memcpy(bad, page, len);
    bad[off] = val;
    kvd_page_finish(bad, len);
    return bad;
}

/* Pages pv, then one coded as pv from other data (v and k swapped), then
 * pv again, attended in one call (the kernels take a run of pages coded
 * alike as one item), = the three one by one, merged; out/lse: pv's own. */
static void check_run(kvd_backend *be, const kvd_page_desc *d, const kvd_codec_spec *ks,
                      const kvd_codec_spec *vs, const uint16_t *k, const uint16_t *v,
                      const kvd_page_view *pv, const kvd_codec_arts *arts,
                      const kvd_attn_dims *dims, const float *q, const float *out, const float *lse)
{
    const int Hq = dims->n_q_heads, D = dims->v_dim;
    kvd_error err;
    uint8_t *p2 = NULL;
    size_t len2 = 0;
    kvd_page_view run[3], pv2;
    CHECK(kvd_page_encode(be, d, ks, vs, v, k, &p2, &len2, &err) == 0);
    CHECK(p2 && kvd_page_decode(p2, len2, &pv2, &err) == 0);
    if (!p2)
        return;
    run[0] = run[2] = *pv;
    run[1] = pv2;
    float o3[8 * 64], l3[8], om[8 * 64], lm[8], o1[8 * 64], l1[8];
    CHECK(kvd_page_attend(be, run, 3, arts, dims, q, o3, l3, &err) == 0);
    memcpy(om, out, sizeof(float) * (size_t)Hq * D);
    memcpy(lm, lse, sizeof(float) * (size_t)Hq);
    for (int r = 1; r < 3; r++) {
        CHECK(kvd_page_attend(be, &run[r], 1, arts, dims, q, o1, l1, &err) == 0);
        CHECK(kvd_attn_merge_into(be, Hq, D, om, lm, o1, l1, &err) == 0);
    }
    double e3 = nmse(o3, om, (size_t)Hq * D), l3e = nmse(l3, lm, (size_t)Hq);
    printf("  three pages in one call vs one by one: out NMSE %.3g, lse NMSE %.3g\n", e3, l3e);
    CHECK(e3 <= 1e-9 && l3e <= 1e-12);
    free(p2);
}

static void test_arts_codecs(kvd_backend *be)
{
    const uint32_t B = 256, H = 2, D = 64, Hq = 8;
    const size_t n = (size_t)H * B * D;
    uint16_t *k = malloc(n * 2), *v = malloc(n * 2);
    float *kf = malloc(n * 4), *vf = malloc(n * 4), *kd = malloc(n * 4), *vd = malloc(n * 4);
    llm_like(k, kf, H, B, D, 1, 11);
    llm_like(v, vf, H, B, D, 0, 21);
    arts_fixture f8, f6;
    calibrate(be, &f8, H, B, D, kf, vf, 4, 8);
    calibrate(be, &f6, H, B, D, kf, vf, 4, 6);
    float q[8 * 64];
    for (int i = 0; i < 8 * 64; i++)
        q[i] = sinf((float)i * 0.37f);
    kvd_attn_dims dims = {(int)Hq, (int)H, (int)D, (int)D, 0.125f};
    kvd_page_desc d = {.dtype = KVD_DTYPE_F16,
                       .layer = 3,
                       .token_start = 512,
                       .num_tokens = B,
                       .page_tokens = B,
                       .num_kv_heads = H,
                       .head_dim = D};
    const uint64_t raw_len = kvd_page_raw_size(&d);
    const uint32_t w48[1] = {48}, w32[1] = {32};
    struct {
        const char *name;
        kvd_codec_spec k, v;
        arts_fixture *f;
        double max_ratio, ek, ev; /* page bytes / raw; decode NMSE bounds */
    } cases[6];
    memset(cases, 0, sizeof cases);
    cases[0].name = "VQ d4b8 K+V (fused)";
    cases[0].k = spec(KVD_CODEC_VQ, 0, 0, 0, 0);
    cases[0].k.vq_sub_dim = 4;
    cases[0].k.vq_bits = 8;
    cases[0].v = cases[0].k;
    cases[0].f = &f8;
    cases[0].max_ratio = 0.14;
    cases[0].ek = 0.08;
    cases[0].ev = 0.12;
    cases[1].name = "VQ d4b6 K, raw V (decoded)";
    cases[1].k = cases[0].k;
    cases[1].k.vq_bits = 6;
    cases[1].v = spec(KVD_CODEC_RAW, 0, 0, 0, 0);
    cases[1].f = &f6;
    cases[1].max_ratio = 0.57;
    cases[1].ek = 0.2;
    cases[1].ev = 0;
    cases[2].name = "SVD rate 0.2 + raw K+V (reduced kernel)";
    cases[2].k = spec(KVD_CODEC_RAW, 0, 0, 0, 0);
    cases[2].k.svd = 1;
    cases[2].k.svd_rate = 0.2;
    cases[2].v = cases[2].k;
    cases[2].f = &f8;
    cases[2].max_ratio = 0.6;
    cases[2].ek = 0.02;
    cases[2].ev = 0.02;
    cases[3].name = "SVD w32 + INT4 K / w48 + INT2 V (INT per head)";
    cases[3].k = spec(KVD_CODEC_INT4, 32, KVD_QAXIS_TOKEN, 0, 1);
    cases[3].k.svd = 1;
    cases[3].k.svd_nwidths = 1;
    cases[3].k.svd_widths = w32;
    cases[3].v = spec(KVD_CODEC_INT2, 64, KVD_QAXIS_CHANNEL, 0, 1);
    cases[3].v.svd = 1;
    cases[3].v.svd_nwidths = 1;
    cases[3].v.svd_widths = w48;
    cases[3].f = &f8;
    cases[3].max_ratio = 0.25;
    cases[3].ek = 0.05;
    cases[3].ev = 0.25;
    cases[4].name = "SVD rate 0.2 + raw K, INT4 V (decoded)";
    cases[4].k = cases[2].k;
    cases[4].v = spec(KVD_CODEC_INT4, 64, KVD_QAXIS_CHANNEL, 0, 1);
    cases[4].f = &f8;
    cases[4].max_ratio = 0.5;
    cases[4].ek = 0.02;
    cases[4].ev = 0.01;
    for (int c = 0; c < 5; c++) {
        kvd_error err;
        kvd_error_clear(&err);
        kvd_codec_spec ks = cases[c].k, vs = cases[c].v;
        CHECK(kvd_codec_spec_check(&ks, 0, B, D, &err) == 0);
        CHECK(kvd_codec_spec_check(&vs, 1, B, D, &err) == 0);
        kvd_codec_arts *arts = NULL;
        int rc =
            kvd_codec_arts_build(&ks, &vs, AL, H, D, cases[c].f->refs, cases[c].f->n, &arts, &err);
        CHECK(rc == 0 && arts);
        if (rc) {
            fprintf(stderr, "case %s: %s\n", cases[c].name, err.msg);
            continue;
        }
        ks.arts = vs.arts = arts;
        uint8_t *page = NULL;
        size_t len = 0;
        rc = kvd_page_encode(be, &d, &ks, &vs, k, v, &page, &len, &err);
        CHECK(rc == 0);
        if (rc) {
            fprintf(stderr, "case %s: %s\n", cases[c].name, err.msg);
            kvd_codec_arts_free(arts);
            continue;
        }
        double ratio = (double)len / (double)raw_len;
        kvd_page_view pv;
        CHECK(kvd_page_decode(page, len, &pv, &err) == 0);
        CHECK(pv.h.k_codec == (ks.svd ? KVD_CODEC_SVD : ks.codec));
        CHECK(pv.h.v_codec == (vs.svd ? KVD_CODEC_SVD : vs.codec));
        CHECK(kvd_page_decode_section(be, &pv, KVD_SECTION_K, arts, KVD_DTYPE_F32, kd, &err) == 0);
        CHECK(kvd_page_decode_section(be, &pv, KVD_SECTION_V, arts, KVD_DTYPE_F32, vd, &err) == 0);
        double ek = nmse(kd, kf, n), ev = nmse(vd, vf, n);
        printf("%s: %zu bytes (%.3f of raw, %.2f bits/value); decode NMSE K %.3g V %.3g\n",
               cases[c].name, len, ratio, 16.0 * ratio, ek, ev);
        CHECK(ratio <= cases[c].max_ratio);
        CHECK(ek <= cases[c].ek && ev <= cases[c].ev);
        if (cases[c].k.svd)
            printf("  kept widths K %d %d\n", arts->k[3].widths[0], arts->k[3].widths[1]);
        if (c == 3) /* explicit widths: K 32 (a multiple of the group), V 48 (align 8) */
            CHECK(arts->k[3].widths[1] == 32 && arts->v[3].widths[0] == 48);
        /* Attention on the page vs dense attention on its decoded values. */
        float out[8 * 64], lse[8], ro[8 * 64], rl[8];
        CHECK(kvd_page_attend(be, &pv, 1, arts, &dims, q, out, lse, &err) == 0);
        kvd_attn_dense_args a;
        memset(&a, 0, sizeof a);
        a.dims = dims;
        int64_t qs[2] = {Hq, D}, ls[1] = {Hq}, kshape[3] = {H, B, D};
        a.q = kvd_tensor_make(KVD_DTYPE_F32, q, 2, qs);
        a.k = kvd_tensor_make(KVD_DTYPE_F32, kd, 3, kshape);
        a.v = kvd_tensor_make(KVD_DTYPE_F32, vd, 3, kshape);
        a.out = kvd_tensor_make(KVD_DTYPE_F32, ro, 2, qs);
        a.lse = kvd_tensor_make(KVD_DTYPE_F32, rl, 1, ls);
        CHECK(kvd_attn_dense(be, 1, &a, &err) == 0);
        double eo = nmse(out, ro, Hq * D), el = nmse(lse, rl, Hq);
        printf("  attention vs decoded: out NMSE %.3g, lse NMSE %.3g\n", eo, el);
        CHECK(eo <= 1e-3 && el <= 1e-5);
        /* A run of pages coded alike (another page from other data between
         * two of this one), in one call. */
        check_run(be, &d, &ks, &vs, k, v, &pv, arts, &dims, q, out, lse);
        /* Without the snapshot, or with another one: FAILED_PRECONDITION. */
        CHECK(kvd_page_attend(be, &pv, 1, NULL, &dims, q, out, lse, &err) == KVD_EPRECOND);
        CHECK(kvd_page_decode_section(be, &pv, KVD_SECTION_K, NULL, KVD_DTYPE_F32, kd, &err) ==
              KVD_EPRECOND);
        {
            arts_fixture *fx = cases[c].f;
            float keep = fx->cbk[0], rkeep = fx->rk[0];
            fx->cbk[0] += 0.5f; /* "recalibrated" */
            fx->rk[0] += 0.5f;
            kvd_codec_arts *other = NULL;
            CHECK(kvd_codec_arts_build(&ks, &vs, AL, H, D, fx->refs, fx->n, &other, &err) == 0);
            fx->cbk[0] = keep;
            fx->rk[0] = rkeep;
            if (other) {
                int ko = ks.codec == KVD_CODEC_VQ || ks.svd;
                CHECK(kvd_page_decode_section(be, &pv, KVD_SECTION_K, other, KVD_DTYPE_F32, kd,
                                              &err) == (ko ? KVD_EPRECOND : 0));
                if (ko)
                    CHECK(strstr(err.msg, "fingerprint") != NULL);
                kvd_codec_arts_free(other);
            }
        }
        /* The snapshot survives its record format. */
        {
            uint8_t *buf = NULL;
            size_t blen = 0;
            kvd_codec_arts *back = NULL;
            CHECK(kvd_codec_arts_serialize(arts, &buf, &blen, &err) == 0);
            CHECK(kvd_codec_arts_parse(buf, blen, &back, &err) == 0);
            CHECK(back && (!arts->k || back->k[3].fingerprint == arts->k[3].fingerprint));
            CHECK(back && (!arts->v || back->v[3].fingerprint == arts->v[3].fingerprint));
            kvd_codec_arts_free(back);
            back = NULL;
            CHECK(kvd_codec_arts_parse(buf, blen - 1, &back, &err) == KVD_ECORRUPT && !back);
            free(buf);
        }
        /* Damaged prefixes (checksum fixed up): DATA_LOSS. */
        const size_t ko = pv.h.sections[0].offset;
        if (ks.codec == KVD_CODEC_VQ && !ks.svd) {
            uint8_t *bad = patched(page, len, ko, 3); /* d = 3 */
            kvd_page_view bv;
            CHECK(kvd_page_decode(bad, len, &bv, &err) == 0);
            CHECK(kvd_page_attend(be, &bv, 1, arts, &dims, q, out, lse, &err) == KVD_ECORRUPT);
            free(bad);
            bad = patched(page, len, ko + 8, page[ko + 8] ^ 1); /* fingerprint */
            CHECK(kvd_page_decode(bad, len, &bv, &err) == 0);
            CHECK(kvd_page_attend(be, &bv, 1, arts, &dims, q, out, lse, &err) == KVD_EPRECOND);
            free(bad);
            if (ks.vq_bits < 8) {
                bad = patched(page, len, ko + KVD_CODEC_ARTS_PREFIX + 5, 200); /* code >= 2^b */
                CHECK(kvd_page_decode(bad, len, &bv, &err) == 0);
                CHECK(kvd_page_attend(be, &bv, 1, arts, &dims, q, out, lse, &err) == KVD_ECORRUPT);
                CHECK(kvd_page_decode_section(be, &bv, KVD_SECTION_K, arts, KVD_DTYPE_F32, kd,
                                              &err) == KVD_ECORRUPT);
                free(bad);
            }
        }
        if (ks.svd) {
            const uint8_t vals[3][2] = {{KVD_CODEC_ARTS_PREFIX, 0},  /* width 0 */
                                        {KVD_CODEC_ARTS_PREFIX, 65}, /* width > D */
                                        {0, 7}};                     /* inner codec */
            for (int i = 0; i < 3; i++) {
                uint8_t *bad = patched(page, len, ko + vals[i][0], vals[i][1]);
                kvd_page_view bv;
                CHECK(kvd_page_decode(bad, len, &bv, &err) == 0);
                CHECK(kvd_page_attend(be, &bv, 1, arts, &dims, q, out, lse, &err) == KVD_ECORRUPT);
                free(bad);
            }
        }
        free(page);
        kvd_codec_arts_free(arts);
    }
    /* f32 and bf16 pages: VQ (fused) and SVD + raw (reduced kernel) decode
     * within the same bounds and attend like their decoded values. */
    for (int dt = 0; dt < 2; dt++) {
        const kvd_dtype dtype = dt ? KVD_DTYPE_BF16 : KVD_DTYPE_F32;
        const size_t es = kvd_dtype_size(dtype);
        uint8_t *kx = malloc(n * es), *vx = malloc(n * es);
        for (size_t i = 0; i < n; i++) {
            if (dt) {
                ((uint16_t *)kx)[i] = kvd_f32_to_bf16(kf[i]);
                ((uint16_t *)vx)[i] = kvd_f32_to_bf16(vf[i]);
            } else {
                ((float *)kx)[i] = kf[i];
                ((float *)vx)[i] = vf[i];
            }
        }
        kvd_page_desc dd = d;
        dd.dtype = dtype;
        for (int c = 0; c < 3; c += 2) {
            kvd_error err;
            kvd_codec_spec ks = cases[c].k, vs = cases[c].v;
            kvd_codec_arts *arts = NULL;
            CHECK(kvd_codec_spec_check(&ks, 0, B, D, &err) == 0 &&
                  kvd_codec_spec_check(&vs, 1, B, D, &err) == 0);
            CHECK(kvd_codec_arts_build(&ks, &vs, AL, H, D, cases[c].f->refs, cases[c].f->n, &arts,
                                       &err) == 0);
            ks.arts = vs.arts = arts;
            uint8_t *page = NULL;
            size_t len = 0;
            kvd_page_view pv;
            CHECK(kvd_page_encode(be, &dd, &ks, &vs, kx, vx, &page, &len, &err) == 0);
            CHECK(page && kvd_page_decode(page, len, &pv, &err) == 0);
            if (!page) {
                kvd_codec_arts_free(arts);
                continue;
            }
            CHECK(kvd_page_decode_section(be, &pv, KVD_SECTION_K, arts, KVD_DTYPE_F32, kd, &err) ==
                  0);
            CHECK(kvd_page_decode_section(be, &pv, KVD_SECTION_V, arts, KVD_DTYPE_F32, vd, &err) ==
                  0);
            double ek = nmse(kd, kf, n), ev = nmse(vd, vf, n);
            printf("%s, %s pages: decode NMSE K %.3g V %.3g\n", cases[c].name,
                   kvd_dtype_name(dtype), ek, ev);
            CHECK(ek <= cases[c].ek && ev <= cases[c].ev);
            float out[8 * 64], lse[8], ro[8 * 64], rl[8];
            CHECK(kvd_page_attend(be, &pv, 1, arts, &dims, q, out, lse, &err) == 0);
            kvd_attn_dense_args a;
            memset(&a, 0, sizeof a);
            a.dims = dims;
            int64_t qs[2] = {Hq, D}, ls[1] = {Hq}, kshape[3] = {H, B, D};
            a.q = kvd_tensor_make(KVD_DTYPE_F32, q, 2, qs);
            a.k = kvd_tensor_make(KVD_DTYPE_F32, kd, 3, kshape);
            a.v = kvd_tensor_make(KVD_DTYPE_F32, vd, 3, kshape);
            a.out = kvd_tensor_make(KVD_DTYPE_F32, ro, 2, qs);
            a.lse = kvd_tensor_make(KVD_DTYPE_F32, rl, 1, ls);
            CHECK(kvd_attn_dense(be, 1, &a, &err) == 0);
            CHECK(nmse(out, ro, Hq * D) <= 1e-3 && nmse(lse, rl, Hq) <= 1e-5);
            free(page);
            kvd_codec_arts_free(arts);
        }
        free(kx);
        free(vx);
    }
    /* Missing or mis-shaped artifacts; encoding without a snapshot. */
    {
        kvd_error err;
        kvd_codec_spec ks = cases[0].k, vs = cases[0].v;
        kvd_codec_arts *arts = NULL;
        size_t nref = 0;
        kvd_art_ref *refs = malloc(sizeof f8.refs);
        for (size_t i = 0; i < f8.n; i++)
            if (!(f8.refs[i].kind == 3 && f8.refs[i].layer == 2 && f8.refs[i].kv_head == 1))
                refs[nref++] = f8.refs[i];
        CHECK(kvd_codec_arts_build(&ks, &vs, AL, H, D, refs, nref, &arts, &err) == KVD_EPRECOND &&
              !arts);
        CHECK(strstr(err.msg, "VQ_CODEBOOK_V") && strstr(err.msg, "layer 2"));
        ks.vq_bits = vs.vq_bits = 10; /* the model was calibrated with b = 8 */
        CHECK(kvd_codec_arts_build(&ks, &vs, AL, H, D, f8.refs, f8.n, &arts, &err) == KVD_EPRECOND);
        free(refs);
        ks = cases[0].k;
        uint8_t *page = NULL;
        size_t len;
        CHECK(kvd_page_encode(be, &d, &ks, &vs, k, v, &page, &len, &err) == KVD_EINVAL && !page);
    }
    /* Malformed VQ / SVD specs. */
    {
        kvd_codec_spec s = spec(KVD_CODEC_VQ, 0, 0, 0, 0);
        s.vq_sub_dim = 3;
        s.vq_bits = 8;
        CHECK(kvd_codec_spec_check(&s, 0, B, D, NULL) == KVD_EINVAL);
        s.vq_sub_dim = 4;
        s.vq_bits = 13;
        CHECK(kvd_codec_spec_check(&s, 1, B, D, NULL) == KVD_EINVAL);
        s.vq_bits = 8;
        CHECK(kvd_codec_spec_check(&s, 0, B, 48, NULL) == KVD_EINVAL); /* Hadamard */
        CHECK(kvd_codec_spec_check(&s, 1, B, 48, NULL) == 0);
        s.svd = 1;
        s.svd_rate = 0.1;
        CHECK(kvd_codec_spec_check(&s, 1, B, D, NULL) == KVD_EINVAL); /* SVD + VQ */
        s = spec(KVD_CODEC_RAW, 0, 0, 0, 0);
        s.svd = 1;
        kvd_codec_spec raw = spec(KVD_CODEC_RAW, 0, 0, 0, 0);
        kvd_codec_arts *none = NULL;
        CHECK(kvd_codec_spec_check(&s, 1, B, D, NULL) == 0); /* as read back from a record */
        CHECK(kvd_codec_arts_build(&raw, &s, AL, H, D, f8.refs, f8.n, &none, NULL) ==
              KVD_EINVAL); /* no rate, no widths to build a snapshot with */
        /* A reduction keeping every dimension of every head is refused:
         * widths D, D - 1 rounded up to the multiple of 8, or to the group
         * of INT on the token axis; D - 8 is a reduction. */
        {
            const uint32_t wd[4] = {D, D - 1, D - 8, 40};
            kvd_codec_spec t = spec(KVD_CODEC_RAW, 0, 0, 0, 0);
            t.svd = 1;
            t.svd_nwidths = 1;
            kvd_error e2;
            for (int i = 0; i < 3; i++) {
                t.svd_widths = &wd[i];
                kvd_codec_arts *got = NULL;
                int rc = kvd_codec_arts_build(&t, &raw, AL, H, D, f8.refs, f8.n, &got, &e2);
                CHECK(i < 2 ? rc == KVD_EINVAL && !got && strstr(e2.msg, "keeps all")
                            : rc == 0 && got);
                kvd_codec_arts_free(got);
            }
            t = spec(KVD_CODEC_INT2, 64, KVD_QAXIS_TOKEN, 0, 0);
            t.svd = 1;
            t.svd_nwidths = 1;
            t.svd_widths = &wd[3]; /* 40 -> 64, the group */
            kvd_codec_arts *got = NULL;
            CHECK(kvd_codec_arts_build(&raw, &t, AL, H, D, f8.refs, f8.n, &got, &e2) ==
                      KVD_EINVAL &&
                  strstr(e2.msg, "v.svd"));
            t.axis = KVD_QAXIS_CHANNEL; /* per channel: no group multiple */
            CHECK(kvd_codec_arts_build(&raw, &t, AL, H, D, f8.refs, f8.n, &got, &e2) == 0 && got);
            kvd_codec_arts_free(got);
        }
        s.svd_rate = 1.0;
        CHECK(kvd_codec_spec_check(&s, 1, B, D, NULL) == KVD_EINVAL);
        s.svd_rate = 0;
        const uint32_t w0[1] = {0};
        s.svd_nwidths = 1;
        s.svd_widths = w0;
        CHECK(kvd_codec_spec_check(&s, 1, B, D, NULL) == KVD_EINVAL);
    }
    fixture_free(&f8);
    fixture_free(&f6);
    free(k);
    free(v);
    free(kf);
    free(vf);
    free(kd);
    free(vd);
}

int main(void)
{
    kvd_backend *be = NULL;
    kvd_cpu_options opt = {2, 0, 0, 0};
    if (kvd_backend_cpu_create(&opt, &be, NULL)) {
        fprintf(stderr, "no CPU backend\n");
        return 1;
    }
    const uint32_t B = 256, H = 2, D = 64, Hq = 8;
    const size_t n = (size_t)H * B * D;
    uint16_t *k = malloc(n * 2), *v = malloc(n * 2);
    float *kf = malloc(n * 4), *vf = malloc(n * 4), *kd = malloc(n * 4), *vd = malloc(n * 4);
    fill(k, n, 1);
    fill(v, n, 2);
    for (size_t i = 0; i < n; i++) {
        kf[i] = kvd_f16_to_f32(k[i]);
        vf[i] = kvd_f16_to_f32(v[i]);
    }
    float q[8 * 64];
    for (int i = 0; i < 8 * 64; i++)
        q[i] = sinf((float)i * 0.37f);
    kvd_attn_dims dims = {(int)Hq, (int)H, (int)D, (int)D, 0.125f};
    kvd_page_desc d = {.dtype = KVD_DTYPE_F16,
                       .layer = 3,
                       .token_start = 512,
                       .num_tokens = B,
                       .page_tokens = B,
                       .num_kv_heads = H,
                       .head_dim = D};
    const struct {
        uint8_t kc, vc, vaxis, round;
        uint16_t kgroup, vgroup;
        double max_ratio; /* page bytes vs raw, at most */
        uint8_t kaxis;
    } cases[] = {
        {KVD_CODEC_INT2, KVD_CODEC_INT2, KVD_QAXIS_CHANNEL, 0, 64, 128, 0.165, KVD_QAXIS_TOKEN},
        {KVD_CODEC_INT2, KVD_CODEC_INT2, KVD_QAXIS_TOKEN, 1, 32, 32, 0.23, KVD_QAXIS_TOKEN},
        {KVD_CODEC_INT4, KVD_CODEC_INT4, KVD_QAXIS_CHANNEL, 1, 64, 128, 0.31, KVD_QAXIS_TOKEN},
        {KVD_CODEC_INT4, KVD_CODEC_RAW, KVD_QAXIS_TOKEN, 0, 64, 64, 0.7, KVD_QAXIS_TOKEN},
        {KVD_CODEC_RAW, KVD_CODEC_INT2, KVD_QAXIS_CHANNEL, 0, 64, 64, 0.6, KVD_QAXIS_TOKEN},
        /* keys grouped per channel (KIVI) */
        {KVD_CODEC_INT2, KVD_CODEC_INT2, KVD_QAXIS_CHANNEL, 0, 64, 64, 0.18, KVD_QAXIS_CHANNEL},
        {KVD_CODEC_INT4, KVD_CODEC_INT2, KVD_QAXIS_TOKEN, 1, 128, 32, 0.25, KVD_QAXIS_CHANNEL},
        {KVD_CODEC_INT2, KVD_CODEC_RAW, KVD_QAXIS_TOKEN, 0, 32, 64, 0.62, KVD_QAXIS_CHANNEL},
    };
    uint64_t raw_len = kvd_page_raw_size(&d);
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        kvd_codec_spec ks = spec(cases[c].kc, cases[c].kgroup, cases[c].kaxis, cases[c].round, 42);
        kvd_codec_spec vs = spec(cases[c].vc, cases[c].vgroup, cases[c].vaxis, cases[c].round, 42);
        uint8_t *page;
        size_t len;
        kvd_error err;
        kvd_error_clear(&err);
        int rc = kvd_page_encode(be, &d, &ks, &vs, k, v, &page, &len, &err);
        CHECK(rc == 0);
        if (rc) {
            fprintf(stderr, "case %zu: %s\n", c, err.msg);
            continue;
        }
        double ratio = (double)len / (double)raw_len;
        printf("case %zu: %zu bytes, %.3f of raw\n", c, len, ratio);
        CHECK(ratio <= cases[c].max_ratio);
        kvd_page_view pv;
        CHECK(kvd_page_decode(page, len, &pv, &err) == 0);
        CHECK(pv.h.k_codec == cases[c].kc && pv.h.v_codec == cases[c].vc);
        CHECK(kvd_page_decode_section(be, &pv, KVD_SECTION_K, NULL, KVD_DTYPE_F32, kd, &err) == 0);
        CHECK(kvd_page_decode_section(be, &pv, KVD_SECTION_V, NULL, KVD_DTYPE_F32, vd, &err) == 0);
        /* Uniform values in [-2, 2): round to nearest leaves an error of
         * variance scale^2/12 with scale <= 4/(2^bits - 1), i.e. NMSE about
         * 0.11 (INT2) and 0.0044 (INT4); stochastic rounding doubles it. */
        double ek = nmse(kd, kf, n), ev = nmse(vd, vf, n);
        double s = cases[c].round ? 2.0 : 1.0;
        double bk = cases[c].kc == KVD_CODEC_RAW ? 0 : cases[c].kc == KVD_CODEC_INT2 ? 0.12 : 0.005;
        double bv = cases[c].vc == KVD_CODEC_RAW ? 0 : cases[c].vc == KVD_CODEC_INT2 ? 0.12 : 0.005;
        printf("  decode NMSE K %.3g V %.3g\n", ek, ev);
        CHECK(ek <= bk * s);
        CHECK(ev <= bv * s);
        /* Attention on the page vs dense attention on its decoded values. */
        float out[8 * 64], lse[8], ro[8 * 64], rl[8];
        CHECK(kvd_page_attend(be, &pv, 1, NULL, &dims, q, out, lse, &err) == 0);
        kvd_attn_dense_args a;
        memset(&a, 0, sizeof a);
        a.dims = dims;
        int64_t qs[2] = {Hq, D}, ls[1] = {Hq}, kshape[3] = {H, B, D};
        a.q = kvd_tensor_make(KVD_DTYPE_F32, q, 2, qs);
        a.k = kvd_tensor_make(KVD_DTYPE_F32, kd, 3, kshape);
        a.v = kvd_tensor_make(KVD_DTYPE_F32, vd, 3, kshape);
        a.out = kvd_tensor_make(KVD_DTYPE_F32, ro, 2, qs);
        a.lse = kvd_tensor_make(KVD_DTYPE_F32, rl, 1, ls);
        CHECK(kvd_attn_dense(be, 1, &a, &err) == 0);
        double eo = nmse(out, ro, Hq * D), el = nmse(lse, rl, Hq);
        printf("  attention vs decoded: out NMSE %.3g, lse NMSE %.3g\n", eo, el);
        CHECK(eo <= 1e-3 && el <= 1e-5);
        /* Two pages merged = the kernel over both (second page: same data). */
        kvd_page_view two[2] = {pv, pv};
        float o2[8 * 64], l2[8];
        CHECK(kvd_page_attend(be, two, 2, NULL, &dims, q, o2, l2, &err) == 0);
        for (int h = 0; h < (int)Hq; h++)
            CHECK(fabsf(l2[h] - (lse[h] + logf(2.0f))) < 1e-4f);
        CHECK(nmse(o2, out, Hq * D) < 1e-10);
        /* A run with a page of other data in the middle, in one call. */
        check_run(be, &d, &ks, &vs, k, v, &pv, NULL, &dims, q, out, lse);
        /* A damaged codec prefix (checksum fixed up) is DATA_LOSS. */
        if (cases[c].kc != KVD_CODEC_RAW) {
            uint8_t *bad = malloc(len);
            memcpy(bad, page, len);
            bad[pv.h.sections[0].offset] = 33; /* group 33 */
            kvd_page_finish(bad, len);
            kvd_page_view bv;
            CHECK(kvd_page_decode(bad, len, &bv, &err) == 0);
            CHECK(kvd_page_attend(be, &bv, 1, NULL, &dims, q, out, lse, &err) == KVD_ECORRUPT);
            CHECK(kvd_page_decode_section(be, &bv, KVD_SECTION_K, NULL, KVD_DTYPE_F32, kd, &err) ==
                  KVD_ECORRUPT);
            free(bad);
        }
        free(page);
    }
    /* A partial page stays raw whatever the spec. */
    {
        kvd_page_desc pd = d;
        pd.num_tokens = 100;
        kvd_codec_spec s2 = spec(KVD_CODEC_INT2, 64, 0, 0, 0);
        uint8_t *page;
        size_t len;
        CHECK(kvd_page_encode(be, &pd, &s2, &s2, k, v, &page, &len, NULL) == 0);
        CHECK(len == kvd_page_raw_size(&pd));
        free(page);
    }
    /* Malformed specs. */
    {
        kvd_codec_spec s;
        s = spec(KVD_CODEC_INT2, 48, 0, 0, 0);
        CHECK(kvd_codec_spec_check(&s, 0, B, D, NULL) == KVD_EINVAL);
        s = spec(KVD_CODEC_INT2, 64, KVD_QAXIS_CHANNEL, 0, 0);
        CHECK(kvd_codec_spec_check(&s, 0, 96, D, NULL) == KVD_EINVAL); /* 64 !| page 96 */
        CHECK(kvd_codec_spec_check(&s, 0, B, D, NULL) == 0);           /* keys per channel */
        s = spec(KVD_CODEC_INT2, 32, 2, 0, 0);
        CHECK(kvd_codec_spec_check(&s, 0, B, D, NULL) == KVD_EINVAL); /* unknown axis */
        /* The default axis: per channel where the group divides the page,
         * else per token; other codecs record K token, V channel. */
        for (int is_v = 0; is_v < 2; is_v++) {
            s = spec(KVD_CODEC_INT4, 0, KVD_CODEC_AXIS_DEFAULT, 0, 0);
            CHECK(kvd_codec_spec_check(&s, is_v, B, D, NULL) == 0 && s.axis == KVD_QAXIS_CHANNEL &&
                  s.group == 64);
            s = spec(KVD_CODEC_INT2, 32, KVD_CODEC_AXIS_DEFAULT, 0, 0);
            CHECK(kvd_codec_spec_check(&s, is_v, 48, D, NULL) == 0 && s.axis == KVD_QAXIS_TOKEN);
            s = spec(KVD_CODEC_INT2, 64, KVD_CODEC_AXIS_DEFAULT, 0, 0);
            CHECK(kvd_codec_spec_check(&s, is_v, 48, 32, NULL) == KVD_EINVAL); /* neither fits */
            /* small heads: groups of 8 and 16; group 0 on the token axis
             * takes the largest that divides head_dim */
            s = spec(KVD_CODEC_INT2, 8, KVD_QAXIS_TOKEN, 0, 0);
            CHECK(kvd_codec_spec_check(&s, is_v, B, 8, NULL) == 0 && s.group == 8);
            s = spec(KVD_CODEC_INT4, 16, KVD_QAXIS_CHANNEL, 0, 0);
            CHECK(kvd_codec_spec_check(&s, is_v, B, 8, NULL) == 0 && s.group == 16);
            s = spec(KVD_CODEC_INT2, 16, KVD_QAXIS_TOKEN, 0, 0);
            CHECK(kvd_codec_spec_check(&s, is_v, B, 8, NULL) == KVD_EINVAL); /* 16 !| 8 */
            s = spec(KVD_CODEC_INT2, 0, KVD_QAXIS_TOKEN, 0, 0);
            CHECK(kvd_codec_spec_check(&s, is_v, B, 48, NULL) == 0 && s.group == 16);
            s = spec(KVD_CODEC_INT2, 0, KVD_CODEC_AXIS_DEFAULT, 0, 0);
            CHECK(kvd_codec_spec_check(&s, is_v, 40, 24, NULL) == 0 && s.group == 8 &&
                  s.axis == KVD_QAXIS_TOKEN);
            s = spec(KVD_CODEC_INT2, 0, KVD_CODEC_AXIS_DEFAULT, 0, 0);
            CHECK(kvd_codec_spec_check(&s, is_v, B, 8, NULL) == 0 && s.group == 64 &&
                  s.axis == KVD_QAXIS_CHANNEL);
            s = spec(KVD_CODEC_INT2, 4, KVD_QAXIS_TOKEN, 0, 0);
            CHECK(kvd_codec_spec_check(&s, is_v, B, 8, NULL) == KVD_EINVAL);
            s = spec(KVD_CODEC_RAW, 0, KVD_CODEC_AXIS_DEFAULT, 0, 0);
            CHECK(kvd_codec_spec_check(&s, is_v, B, D, NULL) == 0 &&
                  s.axis == (is_v ? KVD_QAXIS_CHANNEL : KVD_QAXIS_TOKEN));
        }
        s = spec(KVD_CODEC_INT2, 128, KVD_QAXIS_TOKEN, 0, 0);
        CHECK(kvd_codec_spec_check(&s, 1, B, D, NULL) == KVD_EINVAL); /* 128 !| 64 */
        s = spec(9, 64, 0, 0, 0);
        CHECK(kvd_codec_spec_check(&s, 0, B, D, NULL) == KVD_EINVAL);
        s = spec(KVD_CODEC_INT4, 64, 0, 7, 0);
        CHECK(kvd_codec_spec_check(&s, 0, B, D, NULL) == KVD_EINVAL);
        s = spec(KVD_CODEC_INT4, 0, 0, 0, 0);
        CHECK(kvd_codec_spec_check(&s, 0, B, D, NULL) == 0 && s.group == 64);
    }
    free(k);
    free(v);
    free(kf);
    free(vf);
    free(kd);
    free(vd);
    test_arts_codecs(be);
    kvd_backend_free(be);
    printf("%s\n", failures ? "FAIL" : "PASS");
    return failures != 0;
}
