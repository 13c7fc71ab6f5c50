/*
 * End-to-end tests of model artifacts through libkvdepot: UploadArtifacts
 * and GetArtifacts round trip bit-exact (also across a restart), kinds
 * filter, replacement, removal with the model, and malformed uploads that
 * leave the stored artifacts as they were; Calibrate from synthetic samples
 * (artifacts checked against their definitions) and its errors; codec
 * advice (error budget): every candidate measured, one of them recomputed
 * here, the recommendation within the budget and no better than the
 * exhaustive choice, raw for a budget nothing else meets.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "harness.h"

/* A model of Hq query heads (0: as many as kv heads) over H kv heads. */
static int put_model_as(kvdepot_client *c, const char *name, uint32_t L, uint32_t H, uint32_t Hq,
                        uint32_t D, kvdepot_dtype dtype)
{
    kvdepot_model m;
    memset(&m, 0, sizeof m);
    snprintf(m.name, sizeof m.name, "%s", name);
    m.num_layers = L;
    m.num_kv_heads = H;
    m.num_q_heads = Hq;
    m.head_dim = D;
    m.dtype = dtype;
    return kvdepot_model_put(c, &m, 0, NULL, NULL);
}

static int put_model(kvdepot_client *c, const char *name, uint32_t L, uint32_t H, uint32_t D)
{
    return put_model_as(c, name, L, H, 0, D, KVDEPOT_DTYPE_F16);
}

/* An f32 model with Hq query heads over H kv heads. */
static int put_model_gqa(kvdepot_client *c, const char *name, uint32_t L, uint32_t H, uint32_t Hq,
                         uint32_t D)
{
    return put_model_as(c, name, L, H, Hq, D, KVDEPOT_DTYPE_F32);
}

/* An artifact with deterministic values (odd bit patterns included, so a
 * lossy path would show). */
static kvdepot_artifact make(int kind, uint32_t layer, uint32_t head, uint32_t r, uint32_t d,
                             uint32_t seed)
{
    kvdepot_artifact a;
    memset(&a, 0, sizeof a);
    a.kind = kind;
    a.layer = layer;
    a.kv_head = head;
    a.ndim = d ? 2 : 1;
    a.shape[0] = r;
    a.shape[1] = d;
    size_t n = (size_t)r * (d ? d : 1);
    a.data = malloc(n * sizeof(float));
    uint32_t x = seed * 2654435761u + 1;
    for (size_t i = 0; i < n; i++) {
        x ^= x << 13;
        x ^= x >> 17;
        x ^= x << 5;
        a.data[i] = ((float)(x & 0xffffff) / 16777216.0f - 0.5f) * 3.0f + 1e-7f * (float)i;
    }
    return a;
}

static int same(const kvdepot_artifact *a, const kvdepot_artifact *b)
{
    size_t n = (size_t)a->shape[0] * (a->ndim == 2 ? a->shape[1] : 1);
    return a->kind == b->kind && a->layer == b->layer && a->kv_head == b->kv_head &&
           a->ndim == b->ndim && a->shape[0] == b->shape[0] &&
           (a->ndim == 1 || a->shape[1] == b->shape[1]) &&
           memcmp(a->data, b->data, n * sizeof(float)) == 0;
}

/* The stored artifacts must be exactly want[0..n) (in key order). */
static int expect(kvdepot_client *c, const char *model, const kvdepot_artifact *want, size_t n)
{
    kvdepot_artifact *got = NULL;
    size_t cnt = 0;
    int rc = kvdepot_artifacts_get(c, model, NULL, 0, &got, &cnt);
    int ok = rc == KVDEPOT_OK && cnt == n;
    for (size_t i = 0; ok && i < n; i++)
        ok = same(&want[i], &got[i]);
    if (!ok)
        fprintf(stderr, "  artifacts of %s: rc %d, %zu of %zu expected, %s\n", model, rc, cnt, n,
                kvdepot_errmsg(c));
    kvdepot_artifacts_free(got, cnt);
    return ok;
}

static void free_all(kvdepot_artifact *a, size_t n)
{
    for (size_t i = 0; i < n; i++)
        free(a[i].data);
}

static int t_roundtrip(kvd_harness *h)
{
    kvdepot_client *c = harness_client(h);
    REQUIRE(c);
    REQUIRE_RC(put_model(c, "m", 2, 2, 16), KVDEPOT_OK);
    /* Key order: kind, layer, head. */
    kvdepot_artifact a[] = {
        make(KVDEPOT_ARTIFACT_KEY_SMOOTHING, 0, 0, 16, 0, 1),
        make(KVDEPOT_ARTIFACT_KEY_SMOOTHING, 1, 1, 16, 0, 2),
        make(KVDEPOT_ARTIFACT_VQ_CODEBOOK_K, 0, 1, 256, 4, 3),
        make(KVDEPOT_ARTIFACT_VQ_CODEBOOK_V, 1, 0, 4096, 8, 4),
        make(KVDEPOT_ARTIFACT_SVD_ROTATION_K, 0, 0, 16, 16, 5),
        make(KVDEPOT_ARTIFACT_SVD_ROTATION_V, 1, 1, 16, 16, 6),
        make(KVDEPOT_ARTIFACT_SVD_SPECTRUM_K, 0, 0, 16, 0, 7),
        make(KVDEPOT_ARTIFACT_SVD_SPECTRUM_V, 1, 1, 16, 0, 8),
    };
    size_t n = sizeof a / sizeof a[0];
    uint32_t stored = 0;
    /* Uploaded in reverse order: GetArtifacts answers in key order. */
    kvdepot_artifact rev[sizeof a / sizeof a[0]];
    for (size_t i = 0; i < n; i++)
        rev[i] = a[n - 1 - i];
    REQUIRE_RC(kvdepot_artifacts_upload(c, "m", rev, n, &stored), KVDEPOT_OK);
    CHECK(stored == n);
    CHECK(expect(c, "m", a, n));

    /* Kinds filter. */
    int kinds[] = {KVDEPOT_ARTIFACT_SVD_ROTATION_K, KVDEPOT_ARTIFACT_KEY_SMOOTHING};
    kvdepot_artifact *got = NULL;
    size_t cnt = 0;
    REQUIRE_RC(kvdepot_artifacts_get(c, "m", kinds, 2, &got, &cnt), KVDEPOT_OK);
    CHECK(cnt == 3 && same(&got[0], &a[0]) && same(&got[1], &a[1]) && same(&got[2], &a[4]));
    kvdepot_artifacts_free(got, cnt);

    /* Replacement of one (kind, layer, head). */
    free(a[1].data);
    a[1] = make(KVDEPOT_ARTIFACT_KEY_SMOOTHING, 1, 1, 16, 0, 99);
    REQUIRE_RC(kvdepot_artifacts_upload(c, "m", &a[1], 1, NULL), KVDEPOT_OK);
    CHECK(expect(c, "m", a, n));

    /* Persisted. */
    kvdepot_close(c);
    REQUIRE(harness_restart(h) == 0);
    c = harness_client(h);
    REQUIRE(c);
    CHECK(expect(c, "m", a, n));

    /* A model without artifacts answers an empty list; a deleted model's
     * artifacts go with it, also when a model of that name comes back. */
    REQUIRE_RC(put_model(c, "other", 1, 1, 8), KVDEPOT_OK);
    CHECK(expect(c, "other", NULL, 0));
    CHECK_RC(kvdepot_model_delete(c, "m", 0, NULL), KVDEPOT_OK);
    CHECK_RC(kvdepot_artifacts_get(c, "m", NULL, 0, &got, &cnt), KVDEPOT_ENOTFOUND);
    CHECK(got == NULL && cnt == 0);
    REQUIRE_RC(put_model(c, "m", 2, 2, 16), KVDEPOT_OK);
    CHECK(expect(c, "m", NULL, 0));

    /* Replacing a model with another shape drops its artifacts (they were
     * computed for the old one); an identical re-put keeps them. */
    REQUIRE_RC(kvdepot_artifacts_upload(c, "m", a, 1, NULL), KVDEPOT_OK);
    REQUIRE_RC(put_model(c, "m", 2, 2, 16), KVDEPOT_OK);
    CHECK(expect(c, "m", a, 1));
    kvdepot_model m2;
    memset(&m2, 0, sizeof m2);
    snprintf(m2.name, sizeof m2.name, "m");
    m2.num_layers = 3;
    m2.num_kv_heads = 2;
    m2.head_dim = 16;
    m2.dtype = KVDEPOT_DTYPE_F16;
    REQUIRE_RC(kvdepot_model_put(c, &m2, 1, NULL, NULL), KVDEPOT_OK);
    CHECK(expect(c, "m", NULL, 0));
    free_all(a, n);
    kvdepot_close(c);
    return 0;
}

static int t_errors(kvd_harness *h)
{
    kvdepot_client *c = harness_client(h);
    REQUIRE(c);
    REQUIRE_RC(put_model(c, "m", 2, 2, 16), KVDEPOT_OK);
    kvdepot_artifact good[] = {
        make(KVDEPOT_ARTIFACT_KEY_SMOOTHING, 0, 0, 16, 0, 1),
        make(KVDEPOT_ARTIFACT_VQ_CODEBOOK_K, 1, 1, 16, 2, 2),
    };
    REQUIRE_RC(kvdepot_artifacts_upload(c, "m", good, 2, NULL), KVDEPOT_OK);

    kvdepot_artifact bad[] = {
        make(KVDEPOT_ARTIFACT_KEY_SMOOTHING, 0, 0, 8, 0, 3),     /* not head_dim */
        make(KVDEPOT_ARTIFACT_KEY_SMOOTHING, 2, 0, 16, 0, 4),    /* layer out of range */
        make(KVDEPOT_ARTIFACT_KEY_SMOOTHING, 0, 2, 16, 0, 5),    /* head out of range */
        make(KVDEPOT_ARTIFACT_VQ_CODEBOOK_V, 0, 0, 100, 4, 6),   /* rows not 2^b */
        make(KVDEPOT_ARTIFACT_VQ_CODEBOOK_V, 0, 0, 256, 3, 7),   /* d not 2, 4, 8 */
        make(KVDEPOT_ARTIFACT_VQ_CODEBOOK_V, 0, 0, 8192, 4, 8),  /* b > 12 */
        make(KVDEPOT_ARTIFACT_SVD_ROTATION_K, 0, 0, 16, 8, 9),   /* not square head_dim */
        make(KVDEPOT_ARTIFACT_SVD_SPECTRUM_V, 0, 0, 16, 16, 10), /* 2-d spectrum */
        make(9, 0, 0, 16, 0, 11),                                /* unknown kind */
        make(KVDEPOT_ARTIFACT_SVD_SPECTRUM_K, 0, 0, 16, 0, 12),  /* NaN, set below */
    };
    size_t nb = sizeof bad / sizeof bad[0];
    bad[nb - 1].data[5] = NAN;
    kvdepot_artifact fresh = make(KVDEPOT_ARTIFACT_KEY_SMOOTHING, 0, 0, 16, 0, 50);
    for (size_t i = 0; i < nb; i++) {
        /* A good replacement beside the bad one must not be stored either. */
        kvdepot_artifact pair[2] = {fresh, bad[i]};
        CHECK_RC(kvdepot_artifacts_upload(c, "m", pair, 2, NULL), KVDEPOT_EINVAL);
        CHECK(expect(c, "m", good, 2));
    }
    CHECK_RC(kvdepot_artifacts_upload(c, "nosuch", good, 1, NULL), KVDEPOT_ENOTFOUND);
    kvdepot_artifact *got = NULL;
    size_t cnt = 0;
    CHECK_RC(kvdepot_artifacts_get(c, "nosuch", NULL, 0, &got, &cnt), KVDEPOT_ENOTFOUND);
    int kinds[] = {0};
    CHECK_RC(kvdepot_artifacts_get(c, "m", kinds, 1, &got, &cnt), KVDEPOT_EINVAL);
    CHECK(got == NULL && cnt == 0);
    CHECK(expect(c, "m", good, 2));
    free_all(bad, nb);
    free_all(good, 2);
    free(fresh.data);
    kvdepot_close(c);
    return 0;
}

/* Samples of one layer, f32: rank-4 structure plus small noise, channel 3
 * an outlier (what key smoothing is for). Returns malloc'ed k, v, q. */
static void make_samples(uint64_t n, uint32_t H, uint32_t Hq, uint32_t D, uint32_t seed,
                         float **k, float **v, float **q)
{
    *k = malloc(n * H * D * sizeof(float));
    *v = malloc(n * H * D * sizeof(float));
    *q = malloc(n * Hq * D * sizeof(float));
    uint32_t x = seed * 747796405u + 1;
#define RND() (x ^= x << 13, x ^= x >> 17, x ^= x << 5, (float)(x & 0xffff) / 65536.0f - 0.5f)
    float basis[3][4][64];
    for (int m = 0; m < 3; m++)
        for (int r = 0; r < 4; r++)
            for (uint32_t i = 0; i < D; i++)
                basis[m][r][i] = RND() * 2.0f;
    for (uint64_t t = 0; t < n; t++) {
        for (int m = 0; m < 3; m++) {
            float *dst = m == 0 ? *k : m == 1 ? *v : *q;
            uint32_t heads = m == 2 ? Hq : H;
            for (uint32_t h = 0; h < heads; h++) {
                float z[4] = {RND(), RND(), RND(), RND()};
                for (uint32_t i = 0; i < D; i++) {
                    float a = 0.01f * RND();
                    for (int r = 0; r < 4; r++)
                        a += z[r] * basis[m][r][i];
                    if (m == 0 && i == 3)
                        a *= 20.0f;
                    dst[(t * heads + h) * D + i] = a;
                }
            }
        }
    }
#undef RND
}

/* Attention-output error of values coded INT4 in groups of 32 along each
 * token (asymmetric min/scale, round to nearest), for every query of the
 * n tokens over all of them: ||o - o^||^2 / ||o||^2, head h of G query heads. */
static double int4_v_error(const float *k, const float *v, const float *q, uint64_t n, uint32_t H,
                           uint32_t Hq, uint32_t D)
{
    float *vh = malloc(n * H * D * sizeof(float));
    for (uint64_t t = 0; t < n; t++)
        for (uint32_t h = 0; h < H; h++)
            for (uint32_t g = 0; g < D; g += 32) {
                const float *x = v + (t * H + h) * D + g;
                float lo = x[0], hi = x[0];
                for (int i = 1; i < 32; i++) {
                    lo = fminf(lo, x[i]);
                    hi = fmaxf(hi, x[i]);
                }
                float sc = (hi - lo) / 15.0f;
                for (int i = 0; i < 32; i++) {
                    float c = sc > 0 ? floorf((x[i] - lo) / sc + 0.5f) : 0;
                    vh[(t * H + h) * D + g + i] = lo + fminf(fmaxf(c, 0), 15) * sc;
                }
            }
    double num = 0, den = 0;
    double *p = malloc(n * sizeof(double));
    for (uint32_t j = 0; j < Hq; j++) {
        uint32_t h = j / (Hq / H);
        for (uint64_t qi = 0; qi < n; qi++) {
            double mx = -INFINITY, sum = 0;
            for (uint64_t t = 0; t < n; t++) {
                double s = 0;
                for (uint32_t i = 0; i < D; i++)
                    s += (double)q[(qi * Hq + j) * D + i] * k[(t * H + h) * D + i];
                p[t] = s / sqrt((double)D);
                mx = fmax(mx, p[t]);
            }
            for (uint64_t t = 0; t < n; t++)
                sum += p[t] = exp(p[t] - mx);
            for (uint32_t i = 0; i < D; i++) {
                double o = 0, oh = 0;
                for (uint64_t t = 0; t < n; t++) {
                    o += p[t] / sum * v[(t * H + h) * D + i];
                    oh += p[t] / sum * vh[(t * H + h) * D + i];
                }
                num += (o - oh) * (o - oh);
                den += o * o;
            }
        }
    }
    free(p);
    free(vh);
    return num / den;
}

static int t_advise(kvd_harness *h)
{
    kvdepot_client *c = harness_client(h);
    REQUIRE(c);
    const uint32_t L = 2, H = 2, Hq = 4, D = 32;
    REQUIRE_RC(put_model_gqa(c, "adv", L, H, Hq, D), KVDEPOT_OK);
    const uint64_t n = 1024, ne = 256; /* a quarter held out */
    float *k[2], *v[2], *q[2];
    kvdepot_calibrate_sample s[2];
    for (uint32_t l = 0; l < L; l++) {
        make_samples(n, H, Hq, D, 21 + l, &k[l], &v[l], &q[l]);
        s[l] = (kvdepot_calibrate_sample){.layer = l,
                                          .num_tokens = n,
                                          .k = k[l],
                                          .v = v[l],
                                          .q = q[l],
                                          .kv_bytes = n * H * D * 4,
                                          .q_bytes = n * Hq * D * 4};
    }
    kvdepot_calibrate_args a = {.model = "adv",
                                .vq_sub_dim = 4,
                                .vq_bits = 6,
                                .svd = 1,
                                .seed = 3,
                                .error_budget = 0.01,
                                .eval_queries = 256,
                                .exhaustive = 1};
    kvdepot_calibrate_result res;
    REQUIRE_RC(kvdepot_calibrate(c, &a, s, 2, &res), KVDEPOT_OK);
    const kvdepot_codec_advice *ad = res.advice;
    REQUIRE(ad && ad->n_layers == L);
    CHECK(ad->eval_tokens == ne && ad->eval_queries == ne && ad->error_budget == 0.01);
    for (uint32_t l = 0; l < L; l++) {
        const kvdepot_layer_advice *x = &ad->layers[l];
        CHECK(x->layer == l);
        /* raw; INT4/INT2 x groups 128/64/32 on the channel axis (the page
         * holds 256 tokens) and 32 on the token axis (head_dim 32); VQ; SVD */
        CHECK(x->n_k == 11 && x->n_v == 11);
        CHECK(x->k[0].codec.codec == KVDEPOT_CODEC_RAW && x->k[0].attention_error == 0 &&
              x->k[0].bits_per_value == 32);
        double int4 = -1, int2 = -1;
        for (size_t i = 0; i < x->n_v; i++) {
            const kvdepot_codec_eval *e = &x->v[i];
            CHECK(e->attention_error >= 0 && e->bits_per_value > 0 && e->bits_per_value <= 32);
            if (e->codec.group_size == 32 && e->codec.axis == KVDEPOT_AXIS_TOKEN) {
                if (e->codec.codec == KVDEPOT_CODEC_INT4) {
                    int4 = e->attention_error;
                    CHECK(fabs(e->bits_per_value - (4 + 48.0 / 32)) < 1e-9);
                } else if (e->codec.codec == KVDEPOT_CODEC_INT2) {
                    int2 = e->attention_error;
                }
            }
            if (e->codec.codec == KVDEPOT_CODEC_VQ)
                CHECK(e->bits_per_value == 1.5 && e->codec.vq_sub_dim == 4);
            if (e->codec.svd_removal_rate > 0) { /* raw at the kept widths Calibrate reports */
                double w = 0;
                for (size_t j = 0; j < res.n_errors; j++)
                    w += res.errors[j].layer == l ? res.errors[j].svd_width_v : 0;
                CHECK(e->codec.codec == KVDEPOT_CODEC_RAW &&
                      fabs(e->bits_per_value - 32.0 * w / H / D) < 1e-9);
            }
        }
        CHECK(int4 > 0 && int2 > int4);
        /* The same figure computed here, on the held-out tokens (the last
         * 256 sent) with every one of their queries. */
        double want = int4_v_error(k[l] + (n - ne) * H * D, v[l] + (n - ne) * H * D,
                                   q[l] + (n - ne) * Hq * D, ne, H, Hq, D);
        CHECK(fabs(int4 - want) <= 0.05 * want);
        CHECK(x->attention_error <= 0.01);
        CHECK(x->best_attention_error <= 0.01);
        CHECK(x->best_bits_per_value <= x->bits_per_value);
        CHECK(x->bits_per_value < 32); /* something beats raw at 1% */
    }
    CHECK(ad->max_attention_error <= 0.01 && ad->bits_per_value < 32);
    kvdepot_calibrate_result_clear(&res);
    CHECK(res.advice == NULL);

    /* Nothing but raw meets a budget of 1e-12; nearly anything meets 1. */
    a.exhaustive = 0;
    a.error_budget = 1e-12;
    REQUIRE_RC(kvdepot_calibrate(c, &a, s, 2, &res), KVDEPOT_OK);
    REQUIRE(res.advice);
    CHECK(res.advice->k.codec == KVDEPOT_CODEC_RAW && res.advice->v.codec == KVDEPOT_CODEC_RAW &&
          res.advice->k.svd_removal_rate == 0 && res.advice->bits_per_value == 32);
    kvdepot_calibrate_result_clear(&res);
    a.error_budget = 1;
    REQUIRE_RC(kvdepot_calibrate(c, &a, s, 2, &res), KVDEPOT_OK);
    REQUIRE(res.advice);
    CHECK(res.advice->bits_per_value <= 2.5 && res.advice->max_attention_error <= 1);
    kvdepot_calibrate_result_clear(&res);

    /* Refused: no Q, too few tokens, a budget over 1, too many queries. */
    kvdepot_calibrate_sample b[2] = {s[0], s[1]};
    b[0].q = b[1].q = NULL;
    CHECK_RC(kvdepot_calibrate(c, &a, b, 2, NULL), KVDEPOT_EINVAL);
    b[0] = s[0];
    b[0].num_tokens = 500;
    b[0].kv_bytes = 500 * H * D * 4;
    b[0].q_bytes = 500 * Hq * D * 4;
    CHECK_RC(kvdepot_calibrate(c, &a, b, 1, NULL), KVDEPOT_EINVAL);
    kvdepot_calibrate_args bad = a;
    bad.error_budget = 2;
    CHECK_RC(kvdepot_calibrate(c, &bad, s, 2, NULL), KVDEPOT_EINVAL);
    bad = a;
    bad.eval_queries = 257;
    CHECK_RC(kvdepot_calibrate(c, &bad, s, 2, NULL), KVDEPOT_EINVAL);
    for (uint32_t l = 0; l < L; l++) {
        free(k[l]);
        free(v[l]);
        free(q[l]);
    }
    kvdepot_close(c);
    return 0;
}

static int t_calibrate(kvd_harness *h)
{
    kvdepot_client *c = harness_client(h);
    REQUIRE(c);
    const uint32_t L = 2, H = 2, Hq = 4, D = 16;
    REQUIRE_RC(put_model_gqa(c, "cal", L, H, Hq, D), KVDEPOT_OK);
    const uint64_t n = 300;
    float *k, *v, *q;
    make_samples(2 * n, H, Hq, D, 7, &k, &v, &q);
    kvdepot_calibrate_sample s[2];
    for (int i = 0; i < 2; i++) {
        s[i] = (kvdepot_calibrate_sample){.layer = 0,
                                          .num_tokens = n,
                                          .k = k + i * n * H * D,
                                          .v = v + i * n * H * D,
                                          .q = q + i * n * Hq * D,
                                          .kv_bytes = n * H * D * 4,
                                          .q_bytes = n * Hq * D * 4};
    }
    kvdepot_calibrate_args a = {.model = "cal", .vq_sub_dim = 4, .vq_bits = 6, .svd = 1,
                                .seed = 11};
    kvdepot_calibrate_result res;
    REQUIRE_RC(kvdepot_calibrate(c, &a, s, 2, &res), KVDEPOT_OK);
    CHECK(res.samples == 2 * n);
    CHECK(res.artifacts == H * 7);
    CHECK(res.n_errors == H);
    for (size_t i = 0; i < res.n_errors; i++) {
        const kvdepot_calibration_error *e = &res.errors[i];
        CHECK(e->layer == 0 && e->kv_head == i);
        CHECK(e->vq_k > 0 && e->vq_k < 0.3 && e->vq_v > 0 && e->vq_v < 0.3);
        /* Rank-4 data: the kept width is the alignment, almost lossless
         * (keys share R with queries of another basis: rank 8). */
        CHECK(e->svd_width_v == 8 && e->svd_v < 1e-3);
        CHECK(e->svd_width_k == 8 && e->svd_k < 1e-3);
    }
    kvdepot_calibrate_result_clear(&res);

    kvdepot_artifact *got = NULL;
    size_t cnt = 0;
    REQUIRE_RC(kvdepot_artifacts_get(c, "cal", NULL, 0, &got, &cnt), KVDEPOT_OK);
    CHECK(cnt == H * 7);
    for (size_t i = 0; i < cnt; i++) {
        const kvdepot_artifact *x = &got[i];
        CHECK(x->layer == 0);
        if (x->kind == KVDEPOT_ARTIFACT_KEY_SMOOTHING) {
            /* lambda_i = sqrt(max_t |K_t,i|) over all samples (all were kept). */
            for (uint32_t d = 0; d < D; d++) {
                float mx = 0;
                for (uint64_t t = 0; t < 2 * n; t++)
                    mx = fmaxf(mx, fabsf(k[(t * H + x->kv_head) * D + d]));
                CHECK(fabsf(x->data[d] - sqrtf(mx)) <= 1e-6f * sqrtf(mx));
            }
        }
        if (x->kind == KVDEPOT_ARTIFACT_SVD_ROTATION_K || x->kind == KVDEPOT_ARTIFACT_SVD_ROTATION_V) {
            double worst = 0; /* R^T R = I */
            for (uint32_t i2 = 0; i2 < D; i2++)
                for (uint32_t j = 0; j < D; j++) {
                    double dot = 0;
                    for (uint32_t r = 0; r < D; r++)
                        dot += (double)x->data[r * D + i2] * x->data[r * D + j];
                    worst = fmax(worst, fabs(dot - (i2 == j)));
                }
            CHECK(worst < 1e-4);
        }
        if (x->kind == KVDEPOT_ARTIFACT_VQ_CODEBOOK_K)
            CHECK(x->ndim == 2 && x->shape[0] == 64 && x->shape[1] == 4);
    }

    /* Errors leave the artifacts as they were. */
    kvdepot_calibrate_sample b = s[0];
    b.kv_bytes -= 4;
    CHECK_RC(kvdepot_calibrate(c, &a, &b, 1, NULL), KVDEPOT_EINVAL);
    b = s[0];
    b.layer = L;
    CHECK_RC(kvdepot_calibrate(c, &a, &b, 1, NULL), KVDEPOT_EINVAL);
    b = s[0];
    b.q_bytes = 8;
    CHECK_RC(kvdepot_calibrate(c, &a, &b, 1, NULL), KVDEPOT_EINVAL);
    kvdepot_calibrate_sample mixed[2] = {s[0], s[1]};
    mixed[1].q = NULL;
    CHECK_RC(kvdepot_calibrate(c, &a, mixed, 2, NULL), KVDEPOT_EINVAL);
    float saved = k[5];
    k[5] = NAN;
    CHECK_RC(kvdepot_calibrate(c, &a, s, 1, NULL), KVDEPOT_EINVAL);
    k[5] = saved;
    kvdepot_calibrate_args bad = a;
    bad.vq_sub_dim = 3;
    CHECK_RC(kvdepot_calibrate(c, &bad, s, 1, NULL), KVDEPOT_EINVAL);
    bad = a;
    bad.vq_bits = 13;
    CHECK_RC(kvdepot_calibrate(c, &bad, s, 1, NULL), KVDEPOT_EINVAL);
    CHECK_RC(kvdepot_calibrate(c, &a, NULL, 0, NULL), KVDEPOT_EINVAL);
    bad = a;
    bad.model = "nosuch";
    CHECK_RC(kvdepot_calibrate(c, &bad, s, 1, NULL), KVDEPOT_ENOTFOUND);
    CHECK(expect(c, "cal", got, cnt));

    /* VQ needs a power-of-two head_dim. */
    REQUIRE_RC(put_model_gqa(c, "odd", L, H, Hq, 12), KVDEPOT_OK);
    bad = a;
    bad.model = "odd";
    CHECK_RC(kvdepot_calibrate(c, &bad, s, 1, NULL), KVDEPOT_EINVAL);

    /* Deterministic: the same stream gives the same artifacts. */
    REQUIRE_RC(kvdepot_calibrate(c, &a, s, 2, NULL), KVDEPOT_OK);
    CHECK(expect(c, "cal", got, cnt));
    kvdepot_artifacts_free(got, cnt);

    /* A reservoir smaller than the stream: every token counted, a sample
     * of them used, artifacts replaced. */
    a.max_samples = 64;
    REQUIRE_RC(kvdepot_calibrate(c, &a, s, 2, &res), KVDEPOT_OK);
    CHECK(res.samples == 2 * n && res.artifacts == H * 7 && res.n_errors == H);
    for (size_t i = 0; i < res.n_errors; i++)
        CHECK(res.errors[i].vq_k > 0 && res.errors[i].vq_k < 0.5);
    kvdepot_calibrate_result_clear(&res);
    REQUIRE_RC(kvdepot_artifacts_get(c, "cal", NULL, 0, &got, &cnt), KVDEPOT_OK);
    CHECK(cnt == H * 7);
    kvdepot_artifacts_free(got, cnt);
    free(k);
    free(v);
    free(q);
    kvdepot_close(c);
    return 0;
}

/* Uploaded artifacts and Calibrate's kept samples are held until the stream
 * ends, so they count against --append-memory-bytes (here 64 KiB, through
 * the environment) with the appends in flight: a call past it is
 * RESOURCE_EXHAUSTED naming the setting and stores nothing; one under it
 * goes through. */
static int memory_body(kvd_harness *h)
{
    REQUIRE(harness_stop(h) == 0);
    setenv("KVDEPOT_APPEND_MEMORY_BYTES", "64KiB", 1);
    REQUIRE(harness_start(h) == 0);
    kvdepot_client *c = harness_client(h);
    REQUIRE(c);
    REQUIRE_RC(put_model(c, "cap", 2, 2, 16), KVDEPOT_OK);
    kvdepot_artifact a[] = {
        make(KVDEPOT_ARTIFACT_KEY_SMOOTHING, 0, 0, 16, 0, 1),
        make(KVDEPOT_ARTIFACT_VQ_CODEBOOK_V, 1, 0, 4096, 8, 2), /* 128 KiB */
        make(KVDEPOT_ARTIFACT_VQ_CODEBOOK_K, 0, 1, 256, 4, 3),  /* 4 KiB */
    };
    CHECK_RC(kvdepot_artifacts_upload(c, "cap", a, 3, NULL), KVDEPOT_ENOMEM);
    CHECK(strstr(kvdepot_errmsg(c), "append-memory-bytes") != NULL);
    CHECK(expect(c, "cap", NULL, 0));
    kvdepot_artifact fit[] = {a[0], a[2]};
    CHECK_RC(kvdepot_artifacts_upload(c, "cap", fit, 2, NULL), KVDEPOT_OK);
    CHECK(expect(c, "cap", fit, 2));
    /* what the two calls held was given back: the same upload again */
    CHECK_RC(kvdepot_artifacts_upload(c, "cap", fit, 2, NULL), KVDEPOT_OK);
    free_all(a, 3);

    /* Calibration samples too: 600 tokens of K, V and Q (512 bytes a
     * token as the server keeps them) pass 64 KiB, 100 tokens do not. */
    const uint32_t H = 2, Hq = 4, D = 16;
    REQUIRE_RC(put_model_gqa(c, "capcal", 1, H, Hq, D), KVDEPOT_OK);
    float *k, *v, *q;
    make_samples(600, H, Hq, D, 7, &k, &v, &q);
    kvdepot_calibrate_sample smp = {.layer = 0,
                                    .num_tokens = 600,
                                    .k = k,
                                    .v = v,
                                    .q = q,
                                    .kv_bytes = 600 * H * D * 4,
                                    .q_bytes = 600 * Hq * D * 4};
    kvdepot_calibrate_args ca = {.model = "capcal", .vq_sub_dim = 4, .vq_bits = 4, .seed = 11};
    kvdepot_calibrate_result res;
    CHECK_RC(kvdepot_calibrate(c, &ca, &smp, 1, &res), KVDEPOT_ENOMEM);
    CHECK(strstr(kvdepot_errmsg(c), "append-memory-bytes") != NULL);
    CHECK(expect(c, "capcal", NULL, 0));
    smp.num_tokens = 100;
    smp.kv_bytes = 100 * H * D * 4;
    smp.q_bytes = 100 * Hq * D * 4;
    CHECK_RC(kvdepot_calibrate(c, &ca, &smp, 1, &res), KVDEPOT_OK);
    CHECK(res.samples == 100);
    kvdepot_calibrate_result_clear(&res);
    free(k);
    free(v);
    free(q);
    kvdepot_close(c);
    return 0;
}

static int t_memory(kvd_harness *h)
{
    int rc = memory_body(h);
    unsetenv("KVDEPOT_APPEND_MEMORY_BYTES");
    return rc;
}

static const kvd_test tests[] = {
    {"calibrate", t_calibrate},
    {"advise", t_advise},
    {"roundtrip", t_roundtrip},
    {"errors", t_errors},
    {"memory", t_memory},
};

int main(int argc, char **argv)
{
    return harness_main(argc, argv, tests, sizeof tests / sizeof tests[0]);
}
