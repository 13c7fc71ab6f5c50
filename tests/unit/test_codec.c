/*
 * Page codecs (store/codec.c): INT2/INT4 pages encode, pass the page
 * decoder (checksum included), decode within the quantization bound, and
 * attention over coded pages matches dense attention over their decoded
 * values; malformed specs and damaged coded sections are refused.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "codec.h"
#include "kvdepot/attention.h"
#include "kvdepot/quant.h"

static int failures;
#define CHECK(c)                                                                 \
    do {                                                                         \
        if (!(c)) {                                                              \
            fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #c); \
            failures++;                                                          \
        }                                                                        \
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

static double nmse(const float *a, const float *b, size_t n)
{
    double num = 0, den = 0;
    for (size_t i = 0; i < n; i++) {
        num += ((double)a[i] - b[i]) * ((double)a[i] - b[i]);
        den += (double)b[i] * b[i];
    }
    return den > 0 ? num / den : num;
}

int main(void)
{
    kvd_backend *be = NULL;
    kvd_cpu_options opt = {2, 0};
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
    kvd_page_desc d = {.dtype = KVD_DTYPE_F16, .layer = 3, .token_start = 512, .num_tokens = B,
                       .page_tokens = B, .num_kv_heads = H, .head_dim = D};
    const struct {
        uint8_t kc, vc, vaxis, round;
        uint16_t kgroup, vgroup;
        double max_ratio; /* page bytes vs raw, at most */
    } cases[] = {
        {KVD_CODEC_INT2, KVD_CODEC_INT2, KVD_QAXIS_CHANNEL, 0, 64, 128, 0.165},
        {KVD_CODEC_INT2, KVD_CODEC_INT2, KVD_QAXIS_TOKEN, 1, 32, 32, 0.23},
        {KVD_CODEC_INT4, KVD_CODEC_INT4, KVD_QAXIS_CHANNEL, 1, 64, 128, 0.31},
        {KVD_CODEC_INT4, KVD_CODEC_RAW, KVD_QAXIS_TOKEN, 0, 64, 64, 0.7},
        {KVD_CODEC_RAW, KVD_CODEC_INT2, KVD_QAXIS_CHANNEL, 0, 64, 64, 0.6},
    };
    uint64_t raw_len = kvd_page_raw_size(&d);
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        kvd_codec_spec ks = {cases[c].kc, cases[c].kgroup, KVD_QAXIS_TOKEN, cases[c].round, 42};
        kvd_codec_spec vs = {cases[c].vc, cases[c].vgroup, cases[c].vaxis, cases[c].round, 42};
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
        CHECK(kvd_page_decode_section(be, &pv, KVD_SECTION_K, KVD_DTYPE_F32, kd, &err) == 0);
        CHECK(kvd_page_decode_section(be, &pv, KVD_SECTION_V, KVD_DTYPE_F32, vd, &err) == 0);
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
        CHECK(kvd_page_attend(be, &pv, 1, &dims, q, out, lse, &err) == 0);
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
        CHECK(kvd_page_attend(be, two, 2, &dims, q, o2, l2, &err) == 0);
        for (int h = 0; h < (int)Hq; h++)
            CHECK(fabsf(l2[h] - (lse[h] + logf(2.0f))) < 1e-4f);
        CHECK(nmse(o2, out, Hq * D) < 1e-10);
        /* A damaged codec prefix (checksum fixed up) is DATA_LOSS. */
        if (cases[c].kc != KVD_CODEC_RAW) {
            uint8_t *bad = malloc(len);
            memcpy(bad, page, len);
            bad[pv.h.sections[0].offset] = 33; /* group 33 */
            kvd_page_finish(bad, len);
            kvd_page_view bv;
            CHECK(kvd_page_decode(bad, len, &bv, &err) == 0);
            CHECK(kvd_page_attend(be, &bv, 1, &dims, q, out, lse, &err) == KVD_ECORRUPT);
            CHECK(kvd_page_decode_section(be, &bv, KVD_SECTION_K, KVD_DTYPE_F32, kd, &err) ==
                  KVD_ECORRUPT);
            free(bad);
        }
        free(page);
    }
    /* A partial page stays raw whatever the spec. */
    {
        kvd_page_desc pd = d;
        pd.num_tokens = 100;
        kvd_codec_spec s2 = {KVD_CODEC_INT2, 64, 0, 0, 0};
        uint8_t *page;
        size_t len;
        CHECK(kvd_page_encode(be, &pd, &s2, &s2, k, v, &page, &len, NULL) == 0);
        CHECK(len == kvd_page_raw_size(&pd));
        free(page);
    }
    /* Malformed specs. */
    {
        kvd_codec_spec s;
        s = (kvd_codec_spec){KVD_CODEC_INT2, 48, 0, 0, 0};
        CHECK(kvd_codec_spec_check(&s, 0, B, D, NULL) == KVD_EINVAL);
        s = (kvd_codec_spec){KVD_CODEC_INT2, 64, KVD_QAXIS_CHANNEL, 0, 0};
        CHECK(kvd_codec_spec_check(&s, 0, B, D, NULL) == KVD_EINVAL);
        s = (kvd_codec_spec){KVD_CODEC_INT2, 128, KVD_QAXIS_TOKEN, 0, 0};
        CHECK(kvd_codec_spec_check(&s, 1, B, D, NULL) == KVD_EINVAL); /* 128 !| 64 */
        s = (kvd_codec_spec){9, 64, 0, 0, 0};
        CHECK(kvd_codec_spec_check(&s, 0, B, D, NULL) == KVD_EINVAL);
        s = (kvd_codec_spec){KVD_CODEC_INT4, 64, 0, 7, 0};
        CHECK(kvd_codec_spec_check(&s, 0, B, D, NULL) == KVD_EINVAL);
        s = (kvd_codec_spec){KVD_CODEC_INT4, 0, 0, 0, 0};
        CHECK(kvd_codec_spec_check(&s, 0, B, D, NULL) == 0 && s.group == 64);
    }
    free(k);
    free(v);
    free(kf);
    free(vf);
    free(kd);
    free(vd);
    kvd_backend_free(be);
    printf("%s\n", failures ? "FAIL" : "PASS");
    return failures != 0;
}
