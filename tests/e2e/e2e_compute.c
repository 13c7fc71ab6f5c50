/*
 * End-to-end tests of the compute RPCs through libkvdepot: Attend against
 * the client's own attention (same CPU kernels) on the data it reads back,
 * the log-sum-exp merge of a server range with a client range, PlanFetch
 * against a brute-force minimisation of its documented cost model, and the
 * errors (nothing changed afterwards).
 */
/* Codec tables below list the leading members of kvdepot_codecs only. */
#pragma GCC diagnostic ignored "-Wmissing-field-initializers"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "harness.h"
#include "kvdepot/attention.h"
#include "kvdepot/backend.h"
#include "kvdepot/pq.h"
#include "kvdepot/tensor.h"

/* K/V values in [-2, 2) from a deterministic stream, in the model dtype, so
 * attention sees ordinary numbers (random bytes would make NaNs). */
static void fill_values(void *buf, size_t n, kvdepot_dtype dt, uint64_t seed)
{
    uint64_t x = seed * 0x9e3779b97f4a7c15ull + 1;
    for (size_t i = 0; i < n; i++) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        float f = (float)((x >> 40) & 0xffffff) / (float)(1 << 24) * 4.0f - 2.0f;
        if (dt == KVDEPOT_DTYPE_F32)
            ((float *)buf)[i] = f;
        else if (dt == KVDEPOT_DTYPE_F16)
            ((uint16_t *)buf)[i] = kvd_f32_to_f16(f);
        else
            ((uint16_t *)buf)[i] = kvd_f32_to_bf16(f);
    }
}

static int put_model(kvdepot_client *c, const char *name, uint32_t L, uint32_t H, uint32_t Hq,
                     uint32_t D, uint32_t hidden, kvdepot_dtype dt, kvdepot_model *m)
{
    memset(m, 0, sizeof *m);
    snprintf(m->name, sizeof m->name, "%s", name);
    m->num_layers = L;
    m->num_kv_heads = H;
    m->num_q_heads = Hq;
    m->head_dim = D;
    m->hidden_size = hidden;
    m->dtype = dt;
    return kvdepot_model_put(c, m, 0, NULL, NULL);
}

/* Create a sequence and append n tokens to every layer in appends of `step`
 * tokens (so pages seal and a raw tail stays). */
static int make_seq(kvdepot_client *c, const kvdepot_model *m, const char *id, uint64_t n,
                    uint64_t step, uint64_t seed)
{
    kvdepot_create_args ca;
    memset(&ca, 0, sizeof ca);
    ca.id = id;
    ca.id_len = strlen(id);
    ca.model = m->name;
    int rc = kvdepot_sequence_create(c, &ca, NULL);
    if (rc)
        return rc;
    size_t es = kvdepot_dtype_size(m->dtype);
    for (uint64_t t = 0; t < n; t += step) {
        uint64_t nt = n - t < step ? n - t : step;
        size_t cnt = (size_t)m->num_layers * nt * m->num_kv_heads * m->head_dim;
        void *k = malloc(cnt * es), *v = malloc(cnt * es);
        if (!k || !v)
            return KVDEPOT_ENOMEM;
        fill_values(k, cnt, m->dtype, seed + 2 * t);
        fill_values(v, cnt, m->dtype, seed + 2 * t + 1);
        kvdepot_append_args aa;
        memset(&aa, 0, sizeof aa);
        aa.id = id;
        aa.id_len = strlen(id);
        aa.token_start = t;
        aa.num_tokens = nt;
        aa.dtype = m->dtype;
        aa.k = k;
        aa.k_bytes = cnt * es;
        aa.v = v;
        aa.v_bytes = cnt * es;
        rc = kvdepot_sequence_append(c, &aa, NULL);
        free(k);
        free(v);
        if (rc)
            return rc;
    }
    return 0;
}

/* Append n tokens at t0 to every layer of an existing sequence in one call. */
static int append_at(kvdepot_client *c, const kvdepot_model *m, const char *id, uint64_t t0,
                     uint64_t n)
{
    size_t cnt = (size_t)m->num_layers * n * m->num_kv_heads * m->head_dim;
    size_t es = kvdepot_dtype_size(m->dtype);
    void *k = malloc(cnt * es), *v = malloc(cnt * es);
    if (!k || !v)
        return KVDEPOT_ENOMEM;
    fill_values(k, cnt, m->dtype, 3);
    fill_values(v, cnt, m->dtype, 4);
    kvdepot_append_args aa;
    memset(&aa, 0, sizeof aa);
    aa.id = id;
    aa.id_len = strlen(id);
    aa.token_start = t0;
    aa.num_tokens = n;
    aa.dtype = m->dtype;
    aa.k = k;
    aa.v = v;
    aa.k_bytes = aa.v_bytes = cnt * es;
    int rc = kvdepot_sequence_append(c, &aa, NULL);
    free(k);
    free(v);
    return rc;
}

/* Append n tokens to every layer of a new sequence in one call. */
static int make_seq_append_only(kvdepot_client *c, const kvdepot_model *m, const char *id,
                                uint64_t n)
{
    return append_at(c, m, id, 0, n);
}

/* Attention computed by the client on K/V it reads back: the reference. */
static int local_attend(kvdepot_client *c, const kvdepot_model *m, const char *id,
                        uint32_t layer, uint64_t t0, uint64_t nt, const float *q, float *out,
                        float *lse)
{
    kvdepot_read_args ra;
    memset(&ra, 0, sizeof ra);
    ra.id = id;
    ra.id_len = strlen(id);
    ra.layer_start = layer;
    ra.num_layers = 1;
    ra.token_start = t0;
    ra.num_tokens = nt;
    kvdepot_read_result rr;
    if (nt == 0)
        return kvdepot_attention_local(m->dtype, m->num_q_heads, m->num_kv_heads, m->head_dim,
                                       0, q, NULL, NULL, 0, out, lse);
    int rc = kvdepot_sequence_read(c, &ra, &rr);
    if (rc)
        return rc;
    rc = kvdepot_attention_local(m->dtype, m->num_q_heads, m->num_kv_heads, m->head_dim, 0, q,
                                 rr.k, rr.v, rr.num_tokens, out, lse);
    kvdepot_free(rr.owned);
    return rc;
}

/* Largest |a - b| relative to max(1, |b|) over n floats. */
static double max_rel(const float *a, const float *b, size_t n)
{
    double worst = 0;
    for (size_t i = 0; i < n; i++) {
        double d = fabs((double)a[i] - b[i]) / fmax(1.0, fabs((double)b[i]));
        if (isnan(a[i]) != isnan(b[i]))
            d = INFINITY;
        if (d > worst)
            worst = d;
    }
    return worst;
}

static float *make_q(const kvdepot_model *m, uint64_t seed)
{
    size_t n = (size_t)m->num_q_heads * m->head_dim;
    float *q = malloc(n * sizeof *q);
    if (q)
        fill_values(q, n, KVDEPOT_DTYPE_F32, seed);
    return q;
}

/* A batch over sequences of two models (f16 GQA 4, f32 MHA) and several
 * token ranges equals the client's attention on the bytes it reads. */
static int t_attend(kvd_harness *h)
{
    kvdepot_client *c = harness_client(h);
    REQUIRE(c);
    kvdepot_model ma, mb;
    REQUIRE_RC(put_model(c, "gqa", 2, 2, 8, 64, 0, KVDEPOT_DTYPE_F16, &ma), KVDEPOT_OK);
    REQUIRE_RC(put_model(c, "mha", 1, 3, 3, 32, 0, KVDEPOT_DTYPE_BF16, &mb), KVDEPOT_OK);
    REQUIRE_RC(make_seq(c, &ma, "a1", 700, 300, 1), KVDEPOT_OK);
    REQUIRE_RC(make_seq(c, &ma, "a2", 257, 257, 2), KVDEPOT_OK);
    REQUIRE_RC(make_seq(c, &mb, "b1", 1000, 1000, 3), KVDEPOT_OK);
    struct {
        const char *id;
        const kvdepot_model *m;
        uint64_t t0, nt;
    } cases[] = {
        {"a1", &ma, 0, 0},   {"a1", &ma, 100, 500}, {"a2", &ma, 256, 1},
        {"b1", &mb, 0, 0},   {"a1", &ma, 700, 0},   {"b1", &mb, 999, 1},
    };
    enum { N = sizeof cases / sizeof cases[0] };
    kvdepot_attend_query qs[N];
    float *q[N];
    for (int i = 0; i < N; i++) {
        q[i] = make_q(cases[i].m, 100 + i);
        REQUIRE(q[i]);
        qs[i] = (kvdepot_attend_query){cases[i].id, strlen(cases[i].id), q[i],
                                       (size_t)cases[i].m->num_q_heads * cases[i].m->head_dim,
                                       cases[i].t0, cases[i].nt};
    }
    for (uint32_t layer = 0; layer < 1; layer++) {
        kvdepot_attend_result res[N];
        REQUIRE_RC(kvdepot_attend(c, layer, 0, qs, N, res), KVDEPOT_OK);
        for (int i = 0; i < N; i++) {
            const kvdepot_model *m = cases[i].m;
            size_t Hq = m->num_q_heads, D = m->head_dim;
            CHECK(res[i].num_q_heads == Hq && res[i].head_dim == D);
            uint64_t want_nt = cases[i].nt ? cases[i].nt
                               : (strcmp(cases[i].id, "a1") == 0 ? 700 : 1000) - cases[i].t0;
            CHECK(res[i].num_tokens == want_nt);
            float *out = malloc(Hq * D * sizeof(float)), lse[64];
            REQUIRE(out);
            REQUIRE_RC(local_attend(c, m, cases[i].id, layer, cases[i].t0, want_nt, q[i], out,
                                    lse),
                       KVDEPOT_OK);
            double eo = max_rel(res[i].output, out, Hq * D), el = max_rel(res[i].lse, lse, Hq);
            if (!(eo < 1e-5 && (el < 1e-5 || want_nt == 0))) {
                fprintf(stderr, "case %d: output error %g, lse error %g\n", i, eo, el);
                kvd_test_failures++;
            }
            if (want_nt == 0)
                for (size_t j = 0; j < Hq; j++)
                    CHECK(isinf(res[i].lse[j]) && res[i].lse[j] < 0);
            free(out);
        }
        kvdepot_attend_results_free(res, N);
    }
    /* Layer 1 of the GQA model too (different bytes from layer 0). */
    kvdepot_attend_result r1;
    REQUIRE_RC(kvdepot_attend(c, 1, 0.05f, &qs[0], 1, &r1), KVDEPOT_OK);
    {
        float out[8 * 64], lse[8];
        kvdepot_read_args ra;
        memset(&ra, 0, sizeof ra);
        ra.id = "a1";
        ra.id_len = 2;
        ra.layer_start = 1;
        ra.num_layers = 1;
        kvdepot_read_result rr;
        REQUIRE_RC(kvdepot_sequence_read(c, &ra, &rr), KVDEPOT_OK);
        REQUIRE_RC(kvdepot_attention_local(ma.dtype, 8, 2, 64, 0.05f, q[0], rr.k, rr.v,
                                           rr.num_tokens, out, lse),
                   KVDEPOT_OK);
        kvdepot_free(rr.owned);
        CHECK(max_rel(r1.output, out, 8 * 64) < 1e-5);
        CHECK(max_rel(r1.lse, lse, 8) < 1e-5);
    }
    kvdepot_attend_results_free(&r1, 1);
    for (int i = 0; i < N; i++)
        free(q[i]);
    kvdepot_close(c);
    return 0;
}

/* A sequence longer than the server's attention window (8192 tokens): the
 * window results merge into the full result. */
static int t_attend_long(kvd_harness *h)
{
    kvdepot_client *c = harness_client(h);
    REQUIRE(c);
    kvdepot_model m;
    REQUIRE_RC(put_model(c, "long", 1, 1, 2, 16, 0, KVDEPOT_DTYPE_F16, &m), KVDEPOT_OK);
    REQUIRE_RC(make_seq(c, &m, "L", 20000, 20000, 9), KVDEPOT_OK);
    float *q = make_q(&m, 5);
    REQUIRE(q);
    kvdepot_attend_query qy = {"L", 1, q, 32, 0, 0};
    kvdepot_attend_result r;
    REQUIRE_RC(kvdepot_attend(c, 0, 0, &qy, 1, &r), KVDEPOT_OK);
    float out[32], lse[2];
    REQUIRE_RC(local_attend(c, &m, "L", 0, 0, 20000, q, out, lse), KVDEPOT_OK);
    double eo = max_rel(r.output, out, 32), el = max_rel(r.lse, lse, 2);
    if (!(eo < 1e-4 && el < 1e-5)) {
        fprintf(stderr, "long: output error %g, lse error %g\n", eo, el);
        kvd_test_failures++;
    }
    kvdepot_attend_results_free(&r, 1);
    free(q);
    kvdepot_close(c);
    return 0;
}

/* Server Attend over [0, n - w) merged with the client's attention over the
 * last w tokens equals attention over all n. */
static int t_lse_merge(kvd_harness *h)
{
    kvdepot_client *c = harness_client(h);
    REQUIRE(c);
    kvdepot_model m;
    REQUIRE_RC(put_model(c, "merge", 1, 2, 4, 64, 0, KVDEPOT_DTYPE_F16, &m), KVDEPOT_OK);
    const uint64_t n = 1500;
    REQUIRE_RC(make_seq(c, &m, "s", n, 500, 21), KVDEPOT_OK);
    float *q = make_q(&m, 8);
    REQUIRE(q);
    /* (w = n would ask for [0, 0), which means "to the end".) */
    const uint64_t ws[] = {1, 37, 256, 300, n - 1};
    for (size_t i = 0; i < sizeof ws / sizeof ws[0]; i++) {
        uint64_t w = ws[i];
        kvdepot_attend_query qy = {"s", 1, q, 256, 0, n - w};
        kvdepot_attend_result r;
        REQUIRE_RC(kvdepot_attend(c, 0, 0, &qy, 1, &r), KVDEPOT_OK);
        float tail[256], tlse[4], full[256], flse[4];
        REQUIRE_RC(local_attend(c, &m, "s", 0, n - w, w, q, tail, tlse), KVDEPOT_OK);
        REQUIRE_RC(kvdepot_attention_merge(4, 64, r.output, r.lse, tail, tlse), KVDEPOT_OK);
        REQUIRE_RC(local_attend(c, &m, "s", 0, 0, n, q, full, flse), KVDEPOT_OK);
        double eo = max_rel(r.output, full, 256), el = max_rel(r.lse, flse, 4);
        if (!(eo < 1e-5 && el < 1e-5)) {
            fprintf(stderr, "w=%llu: output error %g, lse error %g\n", (unsigned long long)w, eo,
                    el);
            kvd_test_failures++;
        }
        kvdepot_attend_results_free(&r, 1);
    }
    free(q);
    kvdepot_close(c);
    return 0;
}

static double cost(const kvdepot_fetch_plan *p, double bw, double rate, uint64_t l)
{
    double x = (double)l * p->activation_bytes_per_token / bw;
    double rc = (double)l * p->flops_per_token / rate;
    double kv = (double)(p->num_tokens - l) * p->kv_bytes_per_token / bw;
    return x + (rc > kv ? rc : kv);
}

/* PlanFetch's split minimises the documented cost model (brute force over
 * every l), and its per-token terms are the documented ones. */
static int t_plan_fetch(kvd_harness *h)
{
    kvdepot_client *c = harness_client(h);
    REQUIRE(c);
    kvdepot_model m, m0;
    REQUIRE_RC(put_model(c, "plan", 4, 2, 8, 64, 128, KVDEPOT_DTYPE_F16, &m), KVDEPOT_OK);
    REQUIRE_RC(put_model(c, "nohidden", 4, 2, 8, 64, 0, KVDEPOT_DTYPE_F16, &m0), KVDEPOT_OK);
    REQUIRE_RC(make_seq(c, &m, "p", 777, 777, 4), KVDEPOT_OK);
    REQUIRE_RC(make_seq(c, &m0, "p0", 300, 300, 4), KVDEPOT_OK);
    const double bws[] = {1e6, 1e8, 1e9, 1.25e10, 1e12};
    const double rates[] = {1e6, 1e9, 1e11, 1e13, 1e15};
    int nonzero = 0, interior = 0;
    for (size_t i = 0; i < 5; i++)
        for (size_t j = 0; j < 5; j++)
            for (uint32_t nl = 0; nl <= 2; nl += 2) {
                kvdepot_fetch_plan p;
                REQUIRE_RC(kvdepot_plan_fetch(c, "p", 1, bws[i], rates[j], 0, nl, 1, &p),
                           KVDEPOT_OK);
                uint32_t L = nl ? nl : 4;
                CHECK(p.num_tokens == 777);
                /* K+V (2 x 2 heads x 64 x f16 = 512 bytes) is twice the activation
                 * (128 x f16), as in KVPR's setting. */
                CHECK(p.activation_bytes_per_token == 128.0 * 2 * L);
                CHECK(p.flops_per_token == 2.0 * 128 * (2.0 * 2 * 64) * L);
                CHECK(p.kv_bytes_per_token >= 2.0 * 2 * 64 * 2 * L);
                uint64_t best = 0;
                double tb = cost(&p, bws[i], rates[j], 0);
                for (uint64_t l = 1; l <= p.num_tokens; l++) {
                    double t = cost(&p, bws[i], rates[j], l);
                    if (t < tb * (1 - 1e-12)) {
                        tb = t;
                        best = l;
                    }
                }
                double tp = cost(&p, bws[i], rates[j], p.split_tokens);
                if (!(tp <= tb * (1 + 1e-12)) || fabs(p.predicted_seconds - tp) > 1e-9 * tp) {
                    fprintf(stderr, "bw %g rate %g: split %llu (t %g), brute force %llu (t %g)\n",
                            bws[i], rates[j], (unsigned long long)p.split_tokens, tp,
                            (unsigned long long)best, tb);
                    kvd_test_failures++;
                }
                CHECK(p.kv_only_seconds >= p.predicted_seconds);
                nonzero += p.split_tokens > 0;
                interior += p.split_tokens > 0 && p.split_tokens < p.num_tokens;
                /* Without activations the plan is a plain fetch. */
                REQUIRE_RC(kvdepot_plan_fetch(c, "p", 1, bws[i], rates[j], 0, nl, 0, &p),
                           KVDEPOT_OK);
                CHECK(p.split_tokens == 0 && p.activation_bytes == 0);
            }
    CHECK(nonzero > 0 && interior > 0); /* the grid reaches both regimes */
    kvdepot_fetch_plan p;
    REQUIRE_RC(kvdepot_plan_fetch(c, "p0", 2, 1e9, 1e12, 0, 0, 1, &p), KVDEPOT_OK);
    CHECK(p.split_tokens == 0); /* no hidden size: nothing to recompute from */
    CHECK_RC(kvdepot_plan_fetch(c, "p", 1, 0, 1e12, 0, 0, 1, &p), KVDEPOT_EINVAL);
    CHECK_RC(kvdepot_plan_fetch(c, "p", 1, 1e9, -1, 0, 0, 1, &p), KVDEPOT_EINVAL);
    CHECK_RC(kvdepot_plan_fetch(c, "p", 1, NAN, 1e9, 0, 0, 1, &p), KVDEPOT_EINVAL);
    CHECK_RC(kvdepot_plan_fetch(c, "p", 1, 1e9, 1e9, 3, 2, 1, &p), KVDEPOT_EINVAL);
    /* the messages name the field and the model's layers, not an empty or
     * backwards range */
    CHECK(strstr(kvdepot_errmsg(c), "num_layers 2 from layer_start 3: model plan has layers 0..3"));
    CHECK_RC(kvdepot_plan_fetch(c, "p", 1, 1e9, 1e9, 5, 0, 1, &p), KVDEPOT_EINVAL);
    CHECK(strstr(kvdepot_errmsg(c), "layer_start 5: model plan has layers 0..3") &&
          !strstr(kvdepot_errmsg(c), "["));
    CHECK_RC(kvdepot_plan_fetch(c, "nope", 4, 1e9, 1e9, 0, 0, 1, &p), KVDEPOT_ENOTFOUND);
    kvdepot_close(c);
    return 0;
}

/* A batch too large for one gRPC message is refused before it is sent,
 * naming the limit and how many such queries fit; that many pass. A client
 * allowed larger messages than the server hears the server's limit in the
 * same terms. */
static int t_batch_limit(kvd_harness *h)
{
    kvdepot_client *c = harness_client(h);
    REQUIRE(c);
    kvdepot_model m;
    REQUIRE_RC(put_model(c, "llama", 1, 8, 32, 128, 0, KVDEPOT_DTYPE_F16, &m), KVDEPOT_OK);
    REQUIRE_RC(make_seq(c, &m, "b", 16, 16, 2), KVDEPOT_OK);
    const size_t nq = 1024, per = 32 * 128; /* 16 KiB of f32 per query: 16 MiB */
    float *q = malloc(sizeof(float) * per);
    kvdepot_attend_query *qs = malloc(sizeof *qs * nq);
    kvdepot_attend_result *rs = calloc(nq, sizeof *rs);
    REQUIRE(q && qs && rs);
    fill_values(q, per, KVDEPOT_DTYPE_F32, 5);
    for (size_t i = 0; i < nq; i++)
        qs[i] = (kvdepot_attend_query){"b", 1, q, per, 0, 0};
    CHECK_RC(kvdepot_attend(c, 0, 0, qs, nq, rs), KVDEPOT_ENOMEM);
    const char *msg = kvdepot_errmsg(c), *at = strstr(msg, "at most ");
    printf("%s\n", msg);
    size_t fit = 0;
    CHECK(strstr(msg, "message limit") && at && sscanf(at, "at most %zu", &fit) == 1);
    CHECK(fit > 400 && fit < 512); /* 8 MiB / 16 KiB, less the framing */
    if (fit > 0 && fit < nq) {
        CHECK_RC(kvdepot_attend(c, 0, 0, qs, fit, rs), KVDEPOT_OK);
        CHECK(rs[0].num_tokens == 16 && rs[fit - 1].num_tokens == 16);
        kvdepot_attend_results_free(rs, fit);
    }
    /* the server's own limit (8 MiB), met by a client allowed 64 MiB */
    kvdepot_options opt;
    kvdepot_options_init(&opt);
    opt.max_message_bytes = 64u << 20;
    kvdepot_client *big = harness_client_opts(h, &opt);
    REQUIRE(big);
    CHECK_RC(kvdepot_attend(big, 0, 0, qs, nq, rs), KVDEPOT_ENOMEM);
    msg = kvdepot_errmsg(big);
    printf("%s\n", msg);
    at = strstr(msg, "at most ");
    size_t fit2 = 0;
    CHECK(strstr(msg, "max-message-bytes") && at && sscanf(at, "at most %zu", &fit2) == 1 &&
          fit2 > 400 && fit2 < 512);
    kvdepot_close(big);
    free(q);
    free(qs);
    free(rs);
    kvdepot_close(c);
    return 0;
}

/* Queries in f16 and bf16 (kvdepot_attend_dtype): the server attends with
 * exactly their values (the LSE equals the f32 call's on the same values),
 * the outputs come back rounded to the query dtype; twice as many such
 * queries fit in one message; a wrong size or dtype is refused. */
static int t_attend_half(kvd_harness *h)
{
    kvdepot_client *c = harness_client(h);
    REQUIRE(c);
    kvdepot_model m;
    REQUIRE_RC(put_model(c, "half", 1, 8, 32, 128, 0, KVDEPOT_DTYPE_F16, &m), KVDEPOT_OK);
    REQUIRE_RC(make_seq(c, &m, "h", 700, 350, 3), KVDEPOT_OK);
    const size_t per = 32 * 128;
    float *q32 = malloc(sizeof(float) * per), *qw = malloc(sizeof(float) * per);
    uint16_t *q16 = malloc(2 * per);
    REQUIRE(q32 && qw && q16);
    fill_values(q32, per, KVDEPOT_DTYPE_F32, 9);
    const kvdepot_dtype dts[2] = {KVDEPOT_DTYPE_F16, KVDEPOT_DTYPE_BF16};
    for (int di = 0; di < 2; di++) {
        const int f16 = dts[di] == KVDEPOT_DTYPE_F16;
        for (size_t i = 0; i < per; i++) {
            q16[i] = f16 ? kvd_f32_to_f16(q32[i]) : kvd_f32_to_bf16(q32[i]);
            qw[i] = f16 ? kvd_f16_to_f32(q16[i]) : kvd_bf16_to_f32(q16[i]);
        }
        kvdepot_attend_query qa = {"h", 1, (const float *)q16, per, 100, 500};
        kvdepot_attend_query qb = {"h", 1, qw, per, 100, 500};
        kvdepot_attend_result ra, rb;
        REQUIRE_RC(kvdepot_attend_dtype(c, 0, 0, dts[di], &qa, 1, &ra), KVDEPOT_OK);
        REQUIRE_RC(kvdepot_attend(c, 0, 0, &qb, 1, &rb), KVDEPOT_OK);
        CHECK(ra.num_q_heads == 32 && ra.head_dim == 128 && ra.num_tokens == 500);
        CHECK(memcmp(ra.lse, rb.lse, sizeof(float) * 32) == 0);
        int bad = 0;
        for (size_t i = 0; i < per; i++) {
            uint16_t r = f16 ? kvd_f32_to_f16(rb.output[i]) : kvd_f32_to_bf16(rb.output[i]);
            float want = f16 ? kvd_f16_to_f32(r) : kvd_bf16_to_f32(r);
            bad += memcmp(&want, &ra.output[i], 4) != 0;
        }
        printf("%s queries: %d of %zu outputs differ from the f32 call's rounded\n",
               f16 ? "f16" : "bf16", bad, per);
        CHECK(bad == 0);
        kvdepot_attend_results_free(&ra, 1);
        kvdepot_attend_results_free(&rb, 1);
    }
    /* about twice the f32 batch fits in one message */
    const size_t nq = 1024;
    kvdepot_attend_query *qs = malloc(sizeof *qs * nq);
    kvdepot_attend_result *rs = calloc(nq, sizeof *rs);
    REQUIRE(qs && rs);
    for (size_t i = 0; i < nq; i++)
        qs[i] = (kvdepot_attend_query){"h", 1, (const float *)q16, per, 0, 16};
    CHECK_RC(kvdepot_attend_dtype(c, 0, 0, KVDEPOT_DTYPE_BF16, qs, nq, rs), KVDEPOT_ENOMEM);
    const char *at = strstr(kvdepot_errmsg(c), "at most ");
    size_t fit = 0;
    CHECK(at && sscanf(at, "at most %zu", &fit) == 1 && fit > 900 && fit < 1024);
    if (fit > 900 && fit < 1024) {
        CHECK_RC(kvdepot_attend_dtype(c, 0, 0, KVDEPOT_DTYPE_BF16, qs, fit, rs), KVDEPOT_OK);
        CHECK(rs[fit - 1].num_tokens == 16);
        kvdepot_attend_results_free(rs, fit);
    }
    /* a query of the wrong size, an unknown dtype */
    kvdepot_attend_query shortq = {"h", 1, (const float *)q16, per - 1, 0, 0};
    CHECK_RC(kvdepot_attend_dtype(c, 0, 0, KVDEPOT_DTYPE_F16, &shortq, 1, rs), KVDEPOT_EINVAL);
    CHECK_RC(kvdepot_attend_dtype(c, 0, 0, (kvdepot_dtype)7, qs, 1, rs), KVDEPOT_EINVAL);
    free(qs);
    free(rs);
    free(q32);
    free(qw);
    free(q16);
    kvdepot_close(c);
    return 0;
}

/* Bad requests get clear errors and change nothing. */
static int t_errors(kvd_harness *h)
{
    kvdepot_client *c = harness_client(h);
    REQUIRE(c);
    kvdepot_model m;
    REQUIRE_RC(put_model(c, "err", 2, 2, 4, 32, 0, KVDEPOT_DTYPE_F16, &m), KVDEPOT_OK);
    REQUIRE_RC(make_seq(c, &m, "e", 300, 300, 6), KVDEPOT_OK);
    kvdepot_sequence_info before, after;
    REQUIRE_RC(kvdepot_sequence_stat(c, "e", 1, &before), KVDEPOT_OK);
    float q[4 * 32];
    fill_values(q, 128, KVDEPOT_DTYPE_F32, 1);
    kvdepot_attend_result r[2];
    kvdepot_attend_query good = {"e", 1, q, 128, 0, 0};
    kvdepot_attend_query bad;
    /* unknown sequence, alone and in a batch with a good one */
    bad = (kvdepot_attend_query){"nope", 4, q, 128, 0, 0};
    CHECK_RC(kvdepot_attend(c, 0, 0, &bad, 1, r), KVDEPOT_ENOTFOUND);
    kvdepot_attend_query batch[2] = {good, bad};
    CHECK_RC(kvdepot_attend(c, 0, 0, batch, 2, r), KVDEPOT_ENOTFOUND);
    CHECK(r[0].output == NULL && r[1].output == NULL);
    /* query of the wrong head count (mismatched heads) */
    bad = (kvdepot_attend_query){"e", 1, q, 64, 0, 0};
    CHECK_RC(kvdepot_attend(c, 0, 0, &bad, 1, r), KVDEPOT_EINVAL);
    CHECK(strstr(kvdepot_errmsg(NULL), "num_q_heads") != NULL);
    bad = (kvdepot_attend_query){"e", 1, NULL, 0, 0, 0};
    CHECK_RC(kvdepot_attend(c, 0, 0, &bad, 1, r), KVDEPOT_EINVAL);
    /* layer outside the model */
    CHECK_RC(kvdepot_attend(c, 2, 0, &good, 1, r), KVDEPOT_EINVAL);
    /* tokens past those stored */
    bad = (kvdepot_attend_query){"e", 1, q, 128, 200, 101};
    CHECK_RC(kvdepot_attend(c, 0, 0, &bad, 1, r), KVDEPOT_ERANGE);
    bad = (kvdepot_attend_query){"e", 1, q, 128, 301, 0};
    CHECK_RC(kvdepot_attend(c, 0, 0, &bad, 1, r), KVDEPOT_ERANGE);
    bad = (kvdepot_attend_query){"e", 1, q, 128, UINT64_MAX, 2};
    CHECK_RC(kvdepot_attend(c, 0, 0, &bad, 1, r), KVDEPOT_EINVAL);
    /* empty batch, non-finite scale, empty id */
    CHECK_RC(kvdepot_attend(c, 0, 0, &good, 0, r), KVDEPOT_EINVAL);
    CHECK_RC(kvdepot_attend(c, 0, NAN, &good, 1, r), KVDEPOT_EINVAL);
    bad = (kvdepot_attend_query){"", 0, q, 128, 0, 0};
    CHECK_RC(kvdepot_attend(c, 0, 0, &bad, 1, r), KVDEPOT_EINVAL);
    /* a NaN or an infinity in a query: refused, naming it, the batch with it */
    float qn[4 * 32];
    memcpy(qn, q, sizeof qn);
    qn[32 + 5] = NAN;
    bad = (kvdepot_attend_query){"e", 1, qn, 128, 0, 0};
    kvdepot_attend_query nb[2] = {good, bad};
    CHECK_RC(kvdepot_attend(c, 0, 0, nb, 2, r), KVDEPOT_EINVAL);
    CHECK(strstr(kvdepot_errmsg(NULL), "queries[1].q: not finite") != NULL &&
          strstr(kvdepot_errmsg(NULL), "q head 1, dimension 5") != NULL);
    qn[32 + 5] = -INFINITY;
    CHECK_RC(kvdepot_attend(c, 0, 0, &bad, 1, r), KVDEPOT_EINVAL);
    /* the sequence is as it was, and still answers */
    REQUIRE_RC(kvdepot_sequence_stat(c, "e", 1, &after), KVDEPOT_OK);
    CHECK(after.num_tokens == before.num_tokens && after.stored_bytes == before.stored_bytes);
    kvdepot_sequence_info_clear(&before);
    kvdepot_sequence_info_clear(&after);
    REQUIRE_RC(kvdepot_attend(c, 0, 0, &good, 1, r), KVDEPOT_OK);
    CHECK(r[0].num_tokens == 300);
    kvdepot_attend_results_free(r, 1);
    kvdepot_close(c);
    return 0;
}

/* NMSE of a against b. */
static double nmse(const float *a, const float *b, size_t n)
{
    double num = 0, den = 0;
    for (size_t i = 0; i < n; i++) {
        num += ((double)a[i] - b[i]) * ((double)a[i] - b[i]);
        den += (double)b[i] * b[i];
    }
    return den > 0 ? num / den : num;
}

static int create_coded(kvdepot_client *c, const char *model, const char *id,
                        const kvdepot_codecs *cs)
{
    kvdepot_create_args ca;
    memset(&ca, 0, sizeof ca);
    ca.id = id;
    ca.id_len = strlen(id);
    ca.model = model;
    ca.codecs = cs;
    return kvdepot_sequence_create(c, &ca, NULL);
}

/* K (or V) of layer 0 as appended by make_seq's generator, f16 -> f32. */
static void expected_f32(const kvdepot_model *m, uint64_t n, uint64_t step, uint64_t seed,
                         int which, float *dst)
{
    size_t row = (size_t)m->num_kv_heads * m->head_dim;
    uint16_t *tmp = malloc(row * step * m->num_layers * 2);
    for (uint64_t t = 0; t < n; t += step) {
        uint64_t nt = n - t < step ? n - t : step;
        fill_values(tmp, (size_t)m->num_layers * nt * row, m->dtype, seed + 2 * t + which);
        for (size_t i = 0; i < nt * row; i++) /* layer 0 comes first */
            dst[t * row + i] = kvd_f16_to_f32(tmp[i]);
    }
    free(tmp);
}

/* For each codec: pages seal coded (fewer stored bytes), the raw tail and the
 * raw sink pages read back bit-exact, coded pages within the quantization
 * error; Attend equals the client's attention on the data it reads back;
 * the LSE merge with a client-side tail equals the full Attend. */
static int t_codecs(kvd_harness *h)
{
    kvdepot_client *c = harness_client(h);
    REQUIRE(c);
    kvdepot_model m;
    REQUIRE_RC(put_model(c, "coded", 2, 2, 8, 128, 0, KVDEPOT_DTYPE_F16, &m), KVDEPOT_OK);
    const uint64_t n = 700, step = 350;
    const struct {
        const char *id;
        kvdepot_codecs cs;
        double max_bytes_ratio, max_nmse;
    } cases[] = {
        {"int2",
         {{KVDEPOT_CODEC_INT2, 128, 0, 0, 0}, {KVDEPOT_CODEC_INT2, 128, 0, 0, 0}, 0},
         0.5,
         0.12},
        {"int2-kivi",
         {{KVDEPOT_CODEC_INT2, 64, 1, 1, 7}, {KVDEPOT_CODEC_INT2, 64, 1, 1, 7}, 0},
         0.5,
         0.25},
        {"int4",
         {{KVDEPOT_CODEC_INT4, 64, 0, 0, 0}, {KVDEPOT_CODEC_INT4, 32, 0, 2, 0}, 0},
         0.6,
         0.006},
        {"int2-sink",
         {{KVDEPOT_CODEC_INT2, 0, 0, 0, 0}, {KVDEPOT_CODEC_INT2, 0, 0, 0, 0}, 1},
         0.7,
         0.12},
        /* keys per token (HACK); the cases above group them per channel
         * (the default axis) */
        {"int2-ktok",
         {{KVDEPOT_CODEC_INT2, 128, 0, KVDEPOT_AXIS_TOKEN, 0},
          {KVDEPOT_CODEC_INT2, 128, 0, 0, 0},
          0},
         0.5,
         0.12},
        {"raw", {{0, 0, 0, 0, 0}, {0, 0, 0, 0, 0}, 0}, 1.01, 0},
    };
    const size_t row = (size_t)m.num_kv_heads * m.head_dim;
    float *want = malloc(sizeof(float) * n * row), *got = malloc(sizeof(float) * n * row);
    REQUIRE(want && got);
    for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ci++) {
        const char *id = cases[ci].id;
        REQUIRE_RC(create_coded(c, m.name, id, &cases[ci].cs), KVDEPOT_OK);
        kvdepot_append_args aa;
        for (uint64_t t = 0; t < n; t += step) {
            size_t cnt = (size_t)m.num_layers * step * row;
            uint16_t *k = malloc(cnt * 2), *v = malloc(cnt * 2);
            fill_values(k, cnt, m.dtype, 50 + 2 * t);
            fill_values(v, cnt, m.dtype, 50 + 2 * t + 1);
            memset(&aa, 0, sizeof aa);
            aa.id = id;
            aa.id_len = strlen(id);
            aa.token_start = t;
            aa.num_tokens = step;
            aa.dtype = m.dtype;
            aa.k = k;
            aa.k_bytes = aa.v_bytes = cnt * 2;
            aa.v = v;
            REQUIRE_RC(kvdepot_sequence_append(c, &aa, NULL), KVDEPOT_OK);
            free(k);
            free(v);
        }
        kvdepot_sequence_info info;
        REQUIRE_RC(kvdepot_sequence_stat(c, id, strlen(id), &info), KVDEPOT_OK);
        double raw_bytes = 2.0 * 2 * n * row * m.num_layers;
        double ratio = (double)info.stored_bytes / raw_bytes;
        printf("%s: stored %llu bytes, %.3f of raw\n", id, (unsigned long long)info.stored_bytes,
               ratio);
        CHECK(ratio <= cases[ci].max_bytes_ratio);
        kvdepot_sequence_info_clear(&info);
        /* Every other case out of the memory tiers: coded pages then come
         * back from RocksDB (checksum-verified) for Read and Attend. */
        if (ci % 2 == 1)
            REQUIRE_RC(kvdepot_sequence_evict(c, id, strlen(id), NULL, NULL), KVDEPOT_OK);
        /* Read back (decoded) layer 0 and compare with what was appended. */
        kvdepot_read_args ra;
        memset(&ra, 0, sizeof ra);
        ra.id = id;
        ra.id_len = strlen(id);
        ra.num_layers = 1;
        kvdepot_read_result rr;
        REQUIRE_RC(kvdepot_sequence_read(c, &ra, &rr), KVDEPOT_OK);
        for (int which = 0; which < 2; which++) {
            expected_f32(&m, n, step, 50, which, want);
            const uint16_t *src = which ? rr.v : rr.k;
            for (size_t i = 0; i < n * row; i++)
                got[i] = kvd_f16_to_f32(src[i]);
            uint64_t exact0 = cases[ci].cs.raw_sink_tokens ? 256 : 0;
            double e = nmse(got + exact0 * row, want + exact0 * row, (512 - exact0) * row);
            CHECK(e <= cases[ci].max_nmse + 1e-12);
            /* sink pages and the raw tail are bit-exact */
            CHECK(memcmp(got, want, exact0 * row * sizeof(float)) == 0);
            CHECK(memcmp(got + 512 * row, want + 512 * row, (n - 512) * row * sizeof(float)) == 0);
            if (cases[ci].max_nmse == 0)
                CHECK(e == 0);
        }
        /* Attend vs the client's attention on the data read back. */
        float *q = make_q(&m, 77 + ci);
        kvdepot_attend_query qy = {id, strlen(id), q, 8 * 128, 0, 0};
        kvdepot_attend_result r;
        REQUIRE_RC(kvdepot_attend(c, 0, 0, &qy, 1, &r), KVDEPOT_OK);
        float lo[8 * 128], ll[8];
        REQUIRE_RC(kvdepot_attention_local(m.dtype, 8, 2, 128, 0, q, rr.k, rr.v, n, lo, ll),
                   KVDEPOT_OK);
        double eo = nmse(r.output, lo, 8 * 128), el = nmse(r.lse, ll, 8);
        printf("  attend vs client on read-back data: out NMSE %.3g, lse NMSE %.3g\n", eo, el);
        CHECK(eo <= 1e-3 && el <= 1e-6);
        /* Server over [0, n - w) merged with the client over the tail. */
        const uint64_t w = 100;
        kvdepot_attend_query q2 = {id, strlen(id), q, 8 * 128, 0, n - w};
        kvdepot_attend_result r2;
        REQUIRE_RC(kvdepot_attend(c, 0, 0, &q2, 1, &r2), KVDEPOT_OK);
        const size_t es = 2;
        REQUIRE_RC(kvdepot_attention_local(m.dtype, 8, 2, 128, 0, q,
                                           (const uint8_t *)rr.k + (n - w) * row * es,
                                           (const uint8_t *)rr.v + (n - w) * row * es, w, lo, ll),
                   KVDEPOT_OK);
        REQUIRE_RC(kvdepot_attention_merge(8, 128, r2.output, r2.lse, lo, ll), KVDEPOT_OK);
        CHECK(nmse(r2.output, r.output, 8 * 128) <= 1e-10);
        CHECK(nmse(r2.lse, r.lse, 8) <= 1e-10);
        kvdepot_attend_results_free(&r, 1);
        kvdepot_attend_results_free(&r2, 1);
        free(q);
        kvdepot_free(rr.owned);
    }
    free(want);
    free(got);
    kvdepot_close(c);
    return 0;
}

/* Small heads (head_dim 8 and 16): INT keys and values in groups of 8 and
 * 16 on either axis; group 0 on the token axis takes the largest group that
 * divides head_dim; the codecs come back resolved; pages read back within
 * the codec's error and Attend equals the client's attention on them. */
static int t_small_heads(kvd_harness *h)
{
    kvdepot_client *c = harness_client(h);
    REQUIRE(c);
    kvdepot_model ms[2];
    REQUIRE_RC(put_model(c, "d16", 2, 2, 8, 16, 0, KVDEPOT_DTYPE_F16, &ms[0]), KVDEPOT_OK);
    REQUIRE_RC(put_model(c, "d8", 1, 2, 4, 8, 0, KVDEPOT_DTYPE_F16, &ms[1]), KVDEPOT_OK);
    const kvdepot_quant_axis TK = KVDEPOT_AXIS_TOKEN, CH = KVDEPOT_AXIS_CHANNEL;
    const struct {
        const char *id;
        int model;
        kvdepot_codecs cs;
        uint32_t kgroup, vgroup; /* as reported */
        kvdepot_quant_axis kaxis, vaxis;
        double max_nmse;
    } cases[] = {
        {"g8tok",
         0,
         {{KVDEPOT_CODEC_INT2, 8, 0, TK, 0}, {KVDEPOT_CODEC_INT2, 16, 0, TK, 0}, 0},
         8,
         16,
         TK,
         TK,
         0.12},
        {"g16ch",
         0,
         {{KVDEPOT_CODEC_INT4, 16, 0, CH, 0}, {KVDEPOT_CODEC_INT2, 8, 1, CH, 3}, 0},
         16,
         8,
         CH,
         CH,
         0.25},
        {"auto",
         0,
         {{KVDEPOT_CODEC_INT2, 0, 0, TK, 0}, {KVDEPOT_CODEC_INT4, 0, 0, 0, 0}, 0},
         16,
         64,
         TK,
         CH,
         0.12},
        {"d8",
         1,
         {{KVDEPOT_CODEC_INT2, 0, 0, TK, 0}, {KVDEPOT_CODEC_INT4, 8, 0, TK, 0}, 0},
         8,
         8,
         TK,
         TK,
         0.12},
    };
    const uint64_t n = 600;
    for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ci++) {
        const kvdepot_model *m = &ms[cases[ci].model];
        const char *id = cases[ci].id;
        const uint32_t Hq = m->num_q_heads, D = m->head_dim;
        const size_t row = (size_t)m->num_kv_heads * D;
        REQUIRE_RC(create_coded(c, m->name, id, &cases[ci].cs), KVDEPOT_OK);
        REQUIRE_RC(make_seq_append_only(c, m, id, n), KVDEPOT_OK);
        kvdepot_sequence_info info;
        REQUIRE_RC(kvdepot_sequence_stat(c, id, strlen(id), &info), KVDEPOT_OK);
        CHECK(info.have_codecs && info.codecs.k.group_size == cases[ci].kgroup &&
              info.codecs.v.group_size == cases[ci].vgroup &&
              info.codecs.k.axis == cases[ci].kaxis && info.codecs.v.axis == cases[ci].vaxis);
        printf("%s (head_dim %u): k g%u axis %d, v g%u axis %d, stored %llu bytes\n", id, D,
               info.codecs.k.group_size, (int)info.codecs.k.axis, info.codecs.v.group_size,
               (int)info.codecs.v.axis, (unsigned long long)info.stored_bytes);
        CHECK(info.stored_bytes < 2ull * 2 * n * row * m->num_layers); /* less than raw */
        kvdepot_sequence_info_clear(&info);
        /* the sealed pages of layer 0 within the codec's error, the tail exact */
        kvdepot_read_args ra;
        memset(&ra, 0, sizeof ra);
        ra.id = id;
        ra.id_len = strlen(id);
        ra.num_layers = 1;
        kvdepot_read_result rr;
        REQUIRE_RC(kvdepot_sequence_read(c, &ra, &rr), KVDEPOT_OK);
        const size_t cnt = (size_t)m->num_layers * n * row;
        uint16_t *want = malloc(cnt * 2);
        float *wf = malloc(sizeof(float) * n * row), *gf = malloc(sizeof(float) * n * row);
        REQUIRE(want && wf && gf);
        for (int which = 0; which < 2; which++) {
            fill_values(want, cnt, m->dtype, 3 + which); /* as append_at wrote layer 0 */
            const uint16_t *got = which ? rr.v : rr.k;
            for (size_t i = 0; i < n * row; i++) {
                wf[i] = kvd_f16_to_f32(want[i]);
                gf[i] = kvd_f16_to_f32(got[i]);
            }
            double e = nmse(gf, wf, 512 * row);
            printf("  %s read back: NMSE %.3g\n", which ? "V" : "K", e);
            CHECK(e > 0 && e <= cases[ci].max_nmse);
            CHECK(memcmp(gf + 512 * row, wf + 512 * row, (n - 512) * row * sizeof(float)) == 0);
        }
        /* Attend (whole, and a range with partial pages) vs the client */
        float *q = make_q(m, 90 + ci);
        REQUIRE(q);
        const uint64_t ranges[][2] = {{0, 0}, {100, 400}};
        for (size_t ri = 0; ri < 2; ri++) {
            kvdepot_attend_query qy = {id,           strlen(id), q, (size_t)Hq * D, ranges[ri][0],
                                       ranges[ri][1]};
            kvdepot_attend_result r;
            REQUIRE_RC(kvdepot_attend(c, 0, 0, &qy, 1, &r), KVDEPOT_OK);
            float lo[8 * 16], ll[8];
            uint64_t t0 = ranges[ri][0], nt = ranges[ri][1] ? ranges[ri][1] : n - t0;
            REQUIRE_RC(kvdepot_attention_local(m->dtype, Hq, m->num_kv_heads, D, 0, q,
                                               (const uint16_t *)rr.k + t0 * row,
                                               (const uint16_t *)rr.v + t0 * row, nt, lo, ll),
                       KVDEPOT_OK);
            double eo = nmse(r.output, lo, (size_t)Hq * D), el = nmse(r.lse, ll, Hq);
            printf("  attend [%llu, +%llu) vs client: out NMSE %.3g, lse NMSE %.3g\n",
                   (unsigned long long)t0, (unsigned long long)nt, eo, el);
            CHECK(eo <= 1e-3 && el <= 1e-6);
            kvdepot_attend_results_free(&r, 1);
        }
        free(q);
        free(want);
        free(wf);
        free(gf);
        kvdepot_free(rr.owned);
    }
    /* a group that divides neither head_dim (token axis) nor is offered */
    kvdepot_codecs bad[] = {{{KVDEPOT_CODEC_INT2, 16, 0, TK, 0}, {0, 0, 0, 0, 0}, 0},
                            {{KVDEPOT_CODEC_INT2, 4, 0, CH, 0}, {0, 0, 0, 0, 0}, 0}};
    for (size_t i = 0; i < 2; i++) {
        CHECK_RC(create_coded(c, "d8", "bad", &bad[i]), KVDEPOT_EINVAL);
        kvdepot_sequence_info info;
        CHECK_RC(kvdepot_sequence_stat(c, "bad", 3, &info), KVDEPOT_ENOTFOUND);
    }
    kvdepot_close(c);
    return 0;
}

/* Malformed or unsupported codec specs fail the create; nothing is made. */
static int t_bad_codecs(kvd_harness *h)
{
    kvdepot_client *c = harness_client(h);
    REQUIRE(c);
    kvdepot_model m;
    REQUIRE_RC(put_model(c, "bc", 1, 2, 2, 64, 0, KVDEPOT_DTYPE_F16, &m), KVDEPOT_OK);
    const struct {
        kvdepot_codecs cs;
        int want;
    } bad[] = {
        {{{KVDEPOT_CODEC_INT2, 48, 0, 0, 0}, {0, 0, 0, 0, 0}, 0}, KVDEPOT_EINVAL},
        /* 128 !| head_dim 64 */
        {{{KVDEPOT_CODEC_INT2, 128, 0, KVDEPOT_AXIS_TOKEN, 0}, {0, 0, 0, 0, 0}, 0}, KVDEPOT_EINVAL},
        {{{(kvdepot_codec)9, 0, 0, 0, 0}, {0, 0, 0, 0, 0}, 0}, KVDEPOT_EINVAL},
        {{{0, 0, 0, 0, 0}, {KVDEPOT_CODEC_INT4, 64, 0, (kvdepot_quant_axis)5, 0}, 0},
         KVDEPOT_EINVAL},
        /* VQ without its d and b (e2e_codecs covers VQ itself) */
        {{{KVDEPOT_CODEC_VQ, 0, 0, 0, 0}, {0, 0, 0, 0, 0}, 0}, KVDEPOT_EINVAL},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        CHECK_RC(create_coded(c, "bc", "x", &bad[i].cs), bad[i].want);
        kvdepot_sequence_info info;
        CHECK_RC(kvdepot_sequence_stat(c, "x", 1, &info), KVDEPOT_ENOTFOUND);
    }
    /* A deleted coded sequence's id, created again raw, stores raw pages. */
    kvdepot_codecs ok = {{KVDEPOT_CODEC_INT2, 64, 0, 0, 0}, {KVDEPOT_CODEC_INT2, 64, 0, 0, 0}, 0};
    REQUIRE_RC(create_coded(c, "bc", "y", &ok), KVDEPOT_OK);
    REQUIRE_RC(kvdepot_sequence_delete(c, "y", 1, NULL), KVDEPOT_OK);
    REQUIRE_RC(create_coded(c, "bc", "y", NULL), KVDEPOT_OK);
    REQUIRE_RC(make_seq_append_only(c, &m, "y", 256), KVDEPOT_OK);
    kvdepot_sequence_info info;
    REQUIRE_RC(kvdepot_sequence_stat(c, "y", 1, &info), KVDEPOT_OK);
    CHECK(info.stored_bytes >= 2ull * 256 * 2 * 64 * 2);
    kvdepot_sequence_info_clear(&info);
    kvdepot_close(c);
    return 0;
}

/* Brute-force PQ scores of every token of [t0, t0 + n) (kwire, the keys as
 * appended) for kv head h, with the documented stored index of a sequence
 * appended in one call: centroids trained on its first min(nall, 4096) keys
 * as appended (kall; seed layer * 65536 + h), every key encoded, summed
 * group queries. */
static int brute_scores(kvd_backend *be, const kvdepot_model *m, const uint16_t *kall,
                        uint64_t nall, const uint16_t *kwire, uint64_t n, uint32_t layer, int h,
                        int M, int nb, int iters, const float *q, float *scores)
{
    const int H = (int)m->num_kv_heads, D = (int)m->head_dim, G = (int)m->num_q_heads / H;
    const int K = 1 << nb, ds = D / M;
    float *keys = malloc(sizeof(float) * n * D), *cent = malloc(sizeof(float) * M * K * ds);
    uint8_t *codes = malloc(n * M);
    for (uint64_t t = 0; t < n; t++)
        for (int d = 0; d < D; d++)
            keys[t * D + d] = kvd_f16_to_f32(kwire[(t * H + h) * D + d]);
    int64_t ntrain = nall < 4096 ? (int64_t)nall : 4096;
    float *tkeys = malloc(sizeof(float) * ntrain * D);
    for (int64_t t = 0; t < ntrain; t++)
        for (int d = 0; d < D; d++)
            tkeys[t * D + d] = kvd_f16_to_f32(kall[(t * H + h) * D + d]);
    int64_t ts[2] = {ntrain, D}, cs[3] = {M, K, ds}, ks[2] = {(int64_t)n, D}, cds[2] = {(int64_t)n, M};
    kvd_tensor train = kvd_tensor_make(KVD_DTYPE_F32, tkeys, 2, ts);
    kvd_tensor all = kvd_tensor_make(KVD_DTYPE_F32, keys, 2, ks);
    kvd_tensor tc = kvd_tensor_make(KVD_DTYPE_F32, cent, 3, cs);
    kvd_tensor tcodes = kvd_tensor_make(KVD_DTYPE_U8, codes, 2, cds);
    kvd_kmeans_params km = {K, iters, (uint64_t)layer * 65536 + (uint64_t)h, 0};
    int rc = kvd_pq_train(be, &train, &km, &tc, NULL);
    if (!rc)
        rc = kvd_pq_encode(be, &all, &tc, &tcodes, NULL);
    float qbar[1024] = {0};
    for (int g = 0; g < G; g++)
        for (int d = 0; d < D; d++)
            qbar[d] += q[(size_t)(h * G + g) * D + d];
    /* scan: s_t = sum_j LUT[j][code_tj], LUT[j][c] = qbar_j . C[j][c] */
    for (uint64_t t = 0; t < n && !rc; t++) {
        float s = 0;
        for (int j = 0; j < M; j++) {
            const float *c = cent + ((size_t)j * K + codes[t * M + j]) * ds;
            float l = 0;
            for (int i = 0; i < ds; i++)
                l += qbar[j * ds + i] * c[i];
            s += l;
        }
        scores[t] = s;
    }
    free(keys);
    free(tkeys);
    free(cent);
    free(codes);
    return rc;
}

/* Search equals a brute-force scan of the documented index; SparseAttend
 * equals attention over Search's tokens; errors for bad requests. */
static int t_search(kvd_harness *h)
{
    kvdepot_client *c = harness_client(h);
    REQUIRE(c);
    kvdepot_model m;
    REQUIRE_RC(put_model(c, "pq", 2, 2, 4, 64, 0, KVDEPOT_DTYPE_F16, &m), KVDEPOT_OK);
    kvdepot_codecs cs;
    memset(&cs, 0, sizeof cs);
    cs.k.codec = KVDEPOT_CODEC_INT4;
    cs.pq_m = 8;
    cs.pq_bits = 6;
    cs.pq_iterations = 5;
    cs.pq_min_train_tokens = 1; /* the stored index, trained on the keys as appended */
    REQUIRE_RC(create_coded(c, "pq", "s", &cs), KVDEPOT_OK);
    const uint64_t n = 900;
    REQUIRE_RC(make_seq_append_only(c, &m, "s", n), KVDEPOT_OK);
    kvdepot_read_args ra;
    memset(&ra, 0, sizeof ra);
    ra.id = "s";
    ra.id_len = 1;
    ra.layer_start = 1;
    ra.num_layers = 1;
    kvdepot_read_result rr;
    REQUIRE_RC(kvdepot_sequence_read(c, &ra, &rr), KVDEPOT_OK);
    kvd_backend *be = NULL;
    kvd_cpu_options opt = {1, 0, 0, 0};
    REQUIRE(kvd_backend_cpu_create(&opt, &be, NULL) == 0);
    float *q = make_q(&m, 11);
    float *sc = malloc(sizeof(float) * n);
    /* The keys as appended (make_seq_append_only): layer 1 follows layer 0. */
    uint16_t *kapp = malloc(2 * n * 2 * 2 * 64);
    fill_values(kapp, 2 * n * 2 * 64, KVDEPOT_DTYPE_F16, 3);
    const uint16_t *kl1 = kapp + n * 2 * 64;
    const struct {
        uint64_t t0, nt;
        uint32_t k, init, recent;
    } cases[] = {{0, 0, 32, 4, 16}, {100, 700, 10, 0, 0}, {0, 0, 900, 0, 0}, {256, 512, 1, 2, 3}};
    for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ci++) {
        uint64_t t0 = cases[ci].t0, nt = cases[ci].nt ? cases[ci].nt : n - t0;
        kvdepot_search_args sa = {"s", 1, 1, q, 4 * 64, cases[ci].k, cases[ci].init,
                                  cases[ci].recent, t0, cases[ci].nt};
        kvdepot_search_result sr;
        REQUIRE_RC(kvdepot_search(c, &sa, &sr), KVDEPOT_OK);
        CHECK(sr.num_heads == 2);
        for (int hh = 0; hh < 2 && hh < (int)sr.num_heads; hh++) {
            REQUIRE(brute_scores(be, &m, kl1, n, kl1 + t0 * 2 * 64, nt, 1, hh, 8, 6, 5, q, sc) ==
                    0);
            /* expected: forced tokens + the k best of the middle (ties: lower index) */
            uint64_t lo = cases[ci].init < nt ? cases[ci].init : nt;
            uint64_t hi = nt > cases[ci].recent ? nt - cases[ci].recent : 0;
            if (hi < lo)
                hi = lo;
            char *want = calloc(nt, 1);
            for (uint64_t t = 0; t < nt; t++)
                want[t] = t < lo || t >= hi;
            for (uint32_t pick = 0; pick < cases[ci].k && pick < hi - lo; pick++) {
                int64_t best = -1;
                for (uint64_t t = lo; t < hi; t++)
                    if (!want[t] && (best < 0 || sc[t] > sc[best]))
                        best = (int64_t)t;
                want[best] = 1;
            }
            size_t nwant = 0;
            for (uint64_t t = 0; t < nt; t++)
                nwant += want[t];
            const kvdepot_head_tokens *ht = &sr.heads[hh];
            CHECK(ht->count == nwant);
            int bad = 0;
            for (size_t i = 0; i < ht->count; i++) {
                uint64_t t = ht->tokens[i] - t0;
                if (ht->tokens[i] < t0 || t >= nt || !want[t] ||
                    fabsf(ht->scores[i] - sc[t]) > 1e-4f * fmaxf(1.0f, fabsf(sc[t])))
                    bad++;
                if (i && ht->scores[i] > ht->scores[i - 1])
                    bad++;
            }
            if (bad) {
                fprintf(stderr, "search case %zu head %d: %d entries differ from brute force\n",
                        ci, hh, bad);
                kvd_test_failures++;
            }
            free(want);
        }
        /* SparseAttend = attention over exactly those tokens. */
        kvdepot_attend_result ar;
        kvdepot_search_result st;
        REQUIRE_RC(kvdepot_sparse_attend(c, &sa, 0, &ar, &st), KVDEPOT_OK);
        CHECK(st.num_heads == sr.num_heads && st.heads[0].count == sr.heads[0].count);
        int64_t per = (int64_t)st.heads[0].count;
        int32_t *idx = malloc(sizeof(int32_t) * 2 * (per ? per : 1));
        for (int hh = 0; hh < 2; hh++)
            for (int64_t i = 0; i < per; i++) {
                idx[hh * per + i] = (int32_t)(st.heads[hh].tokens[i] - t0);
                CHECK(st.heads[hh].tokens[i] == sr.heads[hh].tokens[i]);
            }
        float out[4 * 64], lse[4];
        kvd_attn_sparse_args a;
        memset(&a, 0, sizeof a);
        a.dims = (kvd_attn_dims){4, 2, 64, 64, 0.125f};
        int64_t qs[2] = {4, 64}, ls[1] = {4}, ks[3] = {2, (int64_t)nt, 64}, is[2] = {2, per};
        a.q = kvd_tensor_make(KVD_DTYPE_F32, q, 2, qs);
        a.k = kvd_tensor_make(KVD_DTYPE_F16, (uint16_t *)rr.k + t0 * 128, 3, ks);
        a.k.stride[0] = 64 * 2;
        a.k.stride[1] = 128 * 2;
        a.k.stride[2] = 2;
        a.v = a.k;
        a.v.data = (uint16_t *)rr.v + t0 * 128;
        a.idx = kvd_tensor_make(KVD_DTYPE_I32, idx, 2, is);
        a.out = kvd_tensor_make(KVD_DTYPE_F32, out, 2, qs);
        a.lse = kvd_tensor_make(KVD_DTYPE_F32, lse, 1, ls);
        REQUIRE(kvd_attn_sparse(be, 1, &a, NULL) == 0);
        CHECK(nmse(ar.output, out, 4 * 64) < 1e-10 && nmse(ar.lse, lse, 4) < 1e-10);
        CHECK(ar.num_tokens == (uint64_t)per);
        free(idx);
        kvdepot_attend_results_free(&ar, 1);
        kvdepot_search_result_free(&st);
        kvdepot_search_result_free(&sr);
    }
    /* errors */
    kvdepot_search_result sr;
    kvdepot_search_args sa = {"s", 1, 1, q, 4 * 64, 901, 0, 0, 0, 0};
    CHECK_RC(kvdepot_search(c, &sa, &sr), KVDEPOT_EINVAL); /* k larger than the sequence */
    sa.k = 10;
    sa.q_len = 64;
    CHECK_RC(kvdepot_search(c, &sa, &sr), KVDEPOT_EINVAL); /* head count */
    sa.q_len = 256;
    sa.layer = 2;
    CHECK_RC(kvdepot_search(c, &sa, &sr), KVDEPOT_EINVAL);
    sa.layer = 0;
    sa.token_start = 901;
    CHECK_RC(kvdepot_search(c, &sa, &sr), KVDEPOT_ERANGE);
    sa.token_start = 0;
    q[7] = INFINITY; /* a non-finite query: refused by Search and SparseAttend */
    CHECK_RC(kvdepot_search(c, &sa, &sr), KVDEPOT_EINVAL);
    CHECK(strstr(kvdepot_errmsg(NULL), "not finite") != NULL);
    {
        kvdepot_attend_result a2;
        CHECK_RC(kvdepot_sparse_attend(c, &sa, 0, &a2, NULL), KVDEPOT_EINVAL);
    }
    q[7] = 0.25f;
    sa.id = "nope";
    sa.id_len = 4;
    CHECK_RC(kvdepot_search(c, &sa, &sr), KVDEPOT_ENOTFOUND);
    kvdepot_attend_result ar;
    CHECK_RC(kvdepot_sparse_attend(c, &sa, 0, &ar, NULL), KVDEPOT_ENOTFOUND);
    REQUIRE_RC(create_coded(c, "pq", "nopq", NULL), KVDEPOT_OK);
    REQUIRE_RC(make_seq_append_only(c, &m, "nopq", 10), KVDEPOT_OK);
    sa.id = "nopq";
    CHECK_RC(kvdepot_search(c, &sa, &sr), KVDEPOT_EPRECOND);
    kvdepot_codecs bad;
    memset(&bad, 0, sizeof bad);
    bad.pq_m = 7; /* does not divide 64 */
    CHECK_RC(create_coded(c, "pq", "bad", &bad), KVDEPOT_EINVAL);
    bad.pq_m = 8;
    bad.pq_bits = 5;
    CHECK_RC(create_coded(c, "pq", "bad", &bad), KVDEPOT_EINVAL);
    /* Served from a GPU (KVDEPOT_DEVICE=cuda), the searches above read the
     * codes of the sealed pages where they lie in its memory. */
    kvdepot_stats st;
    REQUIRE_RC(kvdepot_stats_get(c, &st), KVDEPOT_OK);
    printf("%llu pages searched on the device\n", (unsigned long long)st.device_pages_searched);
    const char *dev = getenv("KVDEPOT_DEVICE");
    if (dev && strncmp(dev, "cuda", 4) == 0)
        CHECK(st.device_pages_searched > 0);
    if (dev && strcmp(dev, "cpu") == 0)
        CHECK(st.device_pages_searched == 0);
    free(sc);
    free(kapp);
    free(q);
    kvdepot_free(rr.owned);
    kvd_backend_free(be);
    kvdepot_close(c);
    return 0;
}

/* Wire K/V of `n` tokens of all layers from a seed (as make_seq appends). */
static void gen_kv(const kvdepot_model *m, uint64_t n, uint64_t seed, uint16_t **k, uint16_t **v)
{
    size_t cnt = (size_t)m->num_layers * n * m->num_kv_heads * m->head_dim;
    *k = malloc(cnt * 2);
    *v = malloc(cnt * 2);
    fill_values(*k, cnt, m->dtype, seed);
    fill_values(*v, cnt, m->dtype, seed + 1);
}

/* Pages of every layer of wire K/V ([layer][token][head][dim]) for tokens
 * [t0, t0 + n), encoded by the client (VQ with the model's artifacts). */
static int encode_arts(const kvdepot_model *m, const kvdepot_codecs *cs,
                       const kvdepot_artifact *arts, size_t na, uint64_t t0, uint64_t n,
                       const void *k, const void *v, kvdepot_page **pages, size_t *count)
{
    size_t per = (size_t)n * m->num_kv_heads * m->head_dim * kvdepot_dtype_size(m->dtype);
    kvdepot_page *all = NULL;
    size_t total = 0;
    for (uint32_t l = 0; l < m->num_layers; l++) {
        kvdepot_page *p;
        size_t np;
        int rc = kvdepot_encode_pages_with_artifacts(m, cs, arts, na, 256, l, t0, n,
                                                     (const char *)k + l * per,
                                                     (const char *)v + l * per, &p, &np);
        if (rc)
            return rc;
        all = realloc(all, (total + np) * sizeof *all);
        memcpy(all + total, p, np * sizeof *p);
        total += np;
        free(p);
    }
    *pages = all;
    *count = total;
    return 0;
}

static int encode_all(const kvdepot_model *m, const kvdepot_codecs *cs, uint64_t t0, uint64_t n,
                      const uint16_t *k, const uint16_t *v, kvdepot_page **pages, size_t *count)
{
    return encode_arts(m, cs, NULL, 0, t0, n, k, v, pages, count);
}

/* Pages stored for id (append_at's data, tokens [0, n) of every layer)
 * that differ from what the client's CPU encoder makes of the same data:
 * where the server coded them (GPU or CPU) must not change a byte. -1 when
 * the pages cannot be read or made. */
static long pages_unlike_cpu(kvdepot_client *c, const kvdepot_model *m, const char *id,
                             const kvdepot_codecs *cs, uint64_t n)
{
    kvdepot_artifact *arts = NULL;
    size_t na = 0;
    const int vq = cs->k.codec == KVDEPOT_CODEC_VQ || cs->v.codec == KVDEPOT_CODEC_VQ ||
                   cs->k.svd_removal_rate > 0 || cs->v.svd_removal_rate > 0;
    if (vq && kvdepot_artifacts_get(c, m->name, NULL, 0, &arts, &na) != KVDEPOT_OK)
        return -1;
    size_t cnt = (size_t)m->num_layers * n * m->num_kv_heads * m->head_dim;
    size_t es = kvdepot_dtype_size(m->dtype);
    void *k = malloc(cnt * es), *v = malloc(cnt * es);
    kvdepot_page *mine = NULL, *got = NULL;
    size_t nmine = 0, ngot = 0;
    long bad = -1;
    kvdepot_read_args ra;
    memset(&ra, 0, sizeof ra);
    ra.id = id;
    ra.id_len = strlen(id);
    if (k && v) {
        fill_values(k, cnt, m->dtype, 3);
        fill_values(v, cnt, m->dtype, 4);
    }
    if (k && v && encode_arts(m, cs, arts, na, 0, n, k, v, &mine, &nmine) == 0 &&
        kvdepot_sequence_read_pages(c, &ra, &got, &ngot) == 0 && ngot == nmine) {
        bad = 0;
        for (size_t i = 0; i < ngot; i++)
            bad += got[i].len != mine[i].len || memcmp(got[i].data, mine[i].data, got[i].len);
    }
    kvdepot_pages_free(mine, nmine);
    kvdepot_pages_free(got, ngot);
    kvdepot_artifacts_free(arts, na);
    free(k);
    free(v);
    return bad;
}

/* AppendPages: pages encoded by the client are stored as they are: the
 * sequence equals one whose pages the server encoded from the same data
 * (same bytes stored, same Read, same Attend); damaged or mismatched pages
 * are refused and change nothing. */
static int t_append_pages(kvd_harness *h)
{
    kvdepot_client *c = harness_client(h);
    REQUIRE(c);
    kvdepot_model m;
    REQUIRE_RC(put_model(c, "ap", 2, 2, 4, 64, 0, KVDEPOT_DTYPE_F16, &m), KVDEPOT_OK);
    kvdepot_codecs cs;
    memset(&cs, 0, sizeof cs);
    cs.k.codec = KVDEPOT_CODEC_INT2;
    cs.v.codec = KVDEPOT_CODEC_INT2;
    REQUIRE_RC(create_coded(c, "ap", "server", &cs), KVDEPOT_OK);
    REQUIRE_RC(create_coded(c, "ap", "client", &cs), KVDEPOT_OK);
    const uint64_t steps[][2] = {{0, 600}, {600, 300}};
    size_t sent = 0;
    for (int s = 0; s < 2; s++) {
        uint64_t t0 = steps[s][0], n = steps[s][1];
        uint16_t *k, *v;
        gen_kv(&m, n, 40 + s, &k, &v);
        kvdepot_append_args aa;
        memset(&aa, 0, sizeof aa);
        aa.id = "server";
        aa.id_len = 6;
        aa.token_start = t0;
        aa.num_tokens = n;
        aa.dtype = m.dtype;
        aa.k = k;
        aa.v = v;
        aa.k_bytes = aa.v_bytes = (size_t)2 * n * 2 * 64 * 2;
        REQUIRE_RC(kvdepot_sequence_append(c, &aa, NULL), KVDEPOT_OK);
        kvdepot_page *pages;
        size_t np;
        REQUIRE_RC(encode_all(&m, &cs, t0, n, k, v, &pages, &np), KVDEPOT_OK);
        size_t bytes = 0;
        for (size_t i = 0; i < np; i++)
            bytes += pages[i].len;
        sent += bytes;
        if (s == 0) {
            /* errors first: nothing may change */
            uint8_t *save = malloc(pages[0].len);
            memcpy(save, pages[0].data, pages[0].len);
            ((uint8_t *)pages[0].data)[pages[0].len / 2] ^= 1;
            CHECK_RC(kvdepot_append_pages(c, "client", 6, pages, np, NULL), KVDEPOT_ECORRUPT);
            memcpy(pages[0].data, save, pages[0].len);
            free(save);
            CHECK_RC(kvdepot_append_pages(c, "client", 6, pages + 1, np - 1, NULL),
                     KVDEPOT_EPRECOND); /* not at the layer's end */
            kvdepot_page *rawp;
            size_t nraw;
            REQUIRE_RC(encode_all(&m, NULL, t0, n, k, v, &rawp, &nraw), KVDEPOT_OK);
            CHECK_RC(kvdepot_append_pages(c, "client", 6, rawp, nraw, NULL), KVDEPOT_EINVAL);
            kvdepot_pages_free(rawp, nraw);
            kvdepot_model wrong = m;
            wrong.num_kv_heads = 1;
            wrong.num_q_heads = 2;
            REQUIRE_RC(kvdepot_encode_pages(&wrong, &cs, 256, 0, 0, n, k, v, &rawp, &nraw),
                       KVDEPOT_OK);
            CHECK_RC(kvdepot_append_pages(c, "client", 6, rawp, nraw, NULL), KVDEPOT_EINVAL);
            kvdepot_pages_free(rawp, nraw);
            CHECK_RC(kvdepot_append_pages(c, "nope", 4, pages, np, NULL), KVDEPOT_ENOTFOUND);
            kvdepot_sequence_info info;
            REQUIRE_RC(kvdepot_sequence_stat(c, "client", 6, &info), KVDEPOT_OK);
            CHECK(info.num_tokens == 0 && info.stored_bytes == 0);
            kvdepot_sequence_info_clear(&info);
        }
        REQUIRE_RC(kvdepot_append_pages(c, "client", 6, pages, np, NULL), KVDEPOT_OK);
        kvdepot_pages_free(pages, np);
        free(k);
        free(v);
    }
    kvdepot_sequence_info a, b;
    REQUIRE_RC(kvdepot_sequence_stat(c, "server", 6, &a), KVDEPOT_OK);
    REQUIRE_RC(kvdepot_sequence_stat(c, "client", 6, &b), KVDEPOT_OK);
    CHECK(a.num_tokens == 900 && b.num_tokens == 900);
    CHECK(a.stored_bytes == b.stored_bytes);
    CHECK(a.sealed_pages == b.sealed_pages);
    printf("AppendPages: %zu page bytes sent for %llu K/V bytes (%.2fx smaller); stored %llu\n",
           sent, 2ull * 900 * 2 * 64 * 2 * 2, (double)(2ull * 900 * 2 * 64 * 2 * 2) / sent,
           (unsigned long long)b.stored_bytes);
    kvdepot_sequence_info_clear(&a);
    kvdepot_sequence_info_clear(&b);
    kvdepot_read_args ra;
    memset(&ra, 0, sizeof ra);
    kvdepot_read_result r1, r2;
    ra.id = "server";
    ra.id_len = 6;
    REQUIRE_RC(kvdepot_sequence_read(c, &ra, &r1), KVDEPOT_OK);
    ra.id = "client";
    REQUIRE_RC(kvdepot_sequence_read(c, &ra, &r2), KVDEPOT_OK);
    CHECK(r1.kv_bytes == r2.kv_bytes && memcmp(r1.k, r2.k, r1.kv_bytes) == 0 &&
          memcmp(r1.v, r2.v, r1.kv_bytes) == 0);
    kvdepot_free(r1.owned);
    kvdepot_free(r2.owned);
    float *q = make_q(&m, 3);
    kvdepot_attend_query qs[2] = {{"server", 6, q, 256, 0, 0}, {"client", 6, q, 256, 0, 0}};
    kvdepot_attend_result res[2];
    REQUIRE_RC(kvdepot_attend(c, 1, 0, qs, 2, res), KVDEPOT_OK);
    CHECK(memcmp(res[0].output, res[1].output, 256 * sizeof(float)) == 0);
    CHECK(memcmp(res[0].lse, res[1].lse, 4 * sizeof(float)) == 0);
    kvdepot_attend_results_free(res, 2);
    free(q);
    kvdepot_close(c);
    return 0;
}

/* Header field of a page (docs/page-format.md, "Fixed header"). */
static uint64_t page_u(const kvdepot_page *p, size_t off, int bytes)
{
    uint64_t x = 0;
    for (int i = bytes - 1; i >= 0; i--)
        x = x << 8 | ((const uint8_t *)p->data)[off + (size_t)i];
    return x;
}

/* Read in page format: the stored pages come back verbatim (sealed pages
 * byte-equal to the client's encoding of the same data), cover whole blocks
 * around the range, and make an equal sequence when appended elsewhere;
 * bad requests fail and change nothing. */
static int t_read_pages(kvd_harness *h)
{
    kvdepot_client *c = harness_client(h);
    REQUIRE(c);
    kvdepot_model m;
    REQUIRE_RC(put_model(c, "rp", 2, 2, 4, 64, 0, KVDEPOT_DTYPE_F16, &m), KVDEPOT_OK);
    kvdepot_codecs cs;
    memset(&cs, 0, sizeof cs);
    cs.k.codec = KVDEPOT_CODEC_INT4;
    cs.v.codec = KVDEPOT_CODEC_INT2;
    REQUIRE_RC(create_coded(c, "rp", "rp-src", &cs), KVDEPOT_OK);
    REQUIRE_RC(create_coded(c, "rp", "rp-dst", &cs), KVDEPOT_OK);
    const uint64_t n = 600; /* two sealed blocks of 256 and a raw tail per layer */
    uint16_t *k, *v;
    gen_kv(&m, n, 77, &k, &v);
    kvdepot_append_args aa;
    memset(&aa, 0, sizeof aa);
    aa.id = "rp-src";
    aa.id_len = 6;
    aa.num_tokens = n;
    aa.dtype = m.dtype;
    aa.k = k;
    aa.v = v;
    aa.k_bytes = aa.v_bytes = (size_t)2 * n * 2 * 64 * 2;
    REQUIRE_RC(kvdepot_sequence_append(c, &aa, NULL), KVDEPOT_OK);

    kvdepot_read_args ra;
    memset(&ra, 0, sizeof ra);
    ra.id = "rp-src";
    ra.id_len = 6;
    kvdepot_page *pages, *mine;
    size_t np, nmine;
    REQUIRE_RC(kvdepot_sequence_read_pages(c, &ra, &pages, &np), KVDEPOT_OK);
    REQUIRE(np == 6);
    REQUIRE_RC(encode_all(&m, &cs, 0, n, k, v, &mine, &nmine), KVDEPOT_OK);
    REQUIRE(nmine == 6);
    for (size_t i = 0; i < np; i++) {
        const uint64_t b = i % 3, ntok = b < 2 ? 256 : n - 512;
        CHECK(memcmp(pages[i].data, "KVDP", 4) == 0);
        CHECK(page_u(&pages[i], 12, 4) == i / 3);     /* layer */
        CHECK(page_u(&pages[i], 16, 8) == b * 256);   /* token_start */
        CHECK(page_u(&pages[i], 24, 4) == ntok);      /* num_tokens */
        CHECK(page_u(&pages[i], 8, 1) == (b < 2 ? KVDEPOT_CODEC_INT4 : KVDEPOT_CODEC_RAW));
        if (b < 2)
            CHECK(pages[i].len == mine[i].len &&
                  memcmp(pages[i].data, mine[i].data, pages[i].len) == 0);
    }
    kvdepot_pages_free(mine, nmine);
    /* Server to server: the pages as read make the same sequence. */
    REQUIRE_RC(kvdepot_append_pages(c, "rp-dst", 6, pages, np, NULL), KVDEPOT_OK);
    kvdepot_pages_free(pages, np);
    kvdepot_read_result r1, r2;
    REQUIRE_RC(kvdepot_sequence_read(c, &ra, &r1), KVDEPOT_OK);
    ra.id = "rp-dst";
    REQUIRE_RC(kvdepot_sequence_read(c, &ra, &r2), KVDEPOT_OK);
    CHECK(r1.kv_bytes == r2.kv_bytes && memcmp(r1.k, r2.k, r1.kv_bytes) == 0 &&
          memcmp(r1.v, r2.v, r1.kv_bytes) == 0);
    kvdepot_free(r1.owned);
    kvdepot_free(r2.owned);

    /* A range inside one layer: whole blocks around it. */
    ra.id = "rp-src";
    ra.layer_start = 1;
    ra.num_layers = 1;
    ra.token_start = 5;
    ra.num_tokens = 256;
    REQUIRE_RC(kvdepot_sequence_read_pages(c, &ra, &pages, &np), KVDEPOT_OK);
    CHECK(np == 2);
    for (size_t i = 0; i < np; i++)
        CHECK(page_u(&pages[i], 12, 4) == 1 && page_u(&pages[i], 16, 8) == i * 256);
    kvdepot_pages_free(pages, np);
    ra.num_tokens = 0;
    ra.token_start = n;
    REQUIRE_RC(kvdepot_sequence_read_pages(c, &ra, &pages, &np), KVDEPOT_OK);
    CHECK(np == 0 && pages == NULL);

    /* Errors: clear codes, nothing allocated, nothing changed. */
    ra.token_start = n;
    ra.num_tokens = 1;
    CHECK_RC(kvdepot_sequence_read_pages(c, &ra, &pages, &np), KVDEPOT_ERANGE);
    CHECK(pages == NULL && np == 0);
    ra.token_start = 0;
    ra.layer_start = 2;
    CHECK_RC(kvdepot_sequence_read_pages(c, &ra, &pages, &np), KVDEPOT_EINVAL);
    ra.layer_start = 0;
    ra.id = "rp-none";
    ra.id_len = 7;
    CHECK_RC(kvdepot_sequence_read_pages(c, &ra, &pages, &np), KVDEPOT_ENOTFOUND);
    CHECK_RC(kvdepot_sequence_read_pages(c, NULL, &pages, &np), KVDEPOT_EINVAL);
    CHECK_RC(kvdepot_sequence_read_pages(c, &ra, NULL, &np), KVDEPOT_EINVAL);
    kvdepot_sequence_info info;
    REQUIRE_RC(kvdepot_sequence_stat(c, "rp-src", 6, &info), KVDEPOT_OK);
    CHECK(info.num_tokens == n);
    kvdepot_sequence_info_clear(&info);
    free(k);
    free(v);
    kvdepot_close(c);
    return 0;
}

/*
 * Where the pages are attended. With KVDEPOT_DEVICE=cuda (the server on a
 * GPU, or kvdepotd_cuda_emu on the CPU emulation of one) Stats names the
 * device, every coded page is coded there with the client's CPU bytes, and
 * whole pages are attended where they lie in its memory: raw, VQ, INT4,
 * INT2 (values on either axis), SVD + raw and SVD + INT sequences of odd
 * page counts, in one batch over several ranges (partial pages at both
 * ends, exact pages, the raw tail), also after an eviction brought them
 * back from RocksDB. Every answer equals the client's attention on the
 * data it reads back. With KVDEPOT_DEVICE=cpu
 * nothing is coded or attended on a device.
 */
static int t_device(kvd_harness *h)
{
    const char *want = getenv("KVDEPOT_DEVICE");
    const int on_gpu = want && strncmp(want, "cuda", 4) == 0;
    const int on_cpu = want && strcmp(want, "cpu") == 0;
    kvdepot_client *c = harness_client(h);
    REQUIRE(c);
    kvdepot_stats st0;
    REQUIRE_RC(kvdepot_stats_get(c, &st0), KVDEPOT_OK);
    printf("backend %s, device '%s', %llu bytes, healthy %d\n", st0.backend, st0.device,
           (unsigned long long)st0.device_memory_bytes, st0.device_healthy);
    if (on_gpu) {
        CHECK(strcmp(st0.backend, "cuda") == 0);
        CHECK(st0.device[0] != '\0' && st0.device_memory_bytes > 0 && st0.device_healthy);
    }
    if (on_cpu)
        CHECK(strcmp(st0.backend, "cpu") == 0 && st0.device[0] == '\0');
    kvdepot_model ms[2];
    REQUIRE_RC(put_model(c, "dev", 2, 2, 8, 64, 0, KVDEPOT_DTYPE_F16, &ms[0]), KVDEPOT_OK);
    REQUIRE_RC(put_model(c, "dev32", 2, 4, 4, 32, 0, KVDEPOT_DTYPE_F32, &ms[1]), KVDEPOT_OK);
    {
        /* VQ codebooks for "dev" (d4 b8, keys smoothed and rotated), SVD
         * rotations and spectra */
        const size_t ns = 1024, cnt = ns * 2 * 64; /* tokens x kv heads x dims */
        uint16_t *k = malloc(cnt * 2), *v = malloc(cnt * 2);
        REQUIRE(k && v);
        fill_values(k, cnt, KVDEPOT_DTYPE_F16, 31);
        fill_values(v, cnt, KVDEPOT_DTYPE_F16, 32);
        kvdepot_calibrate_sample smp[2];
        memset(smp, 0, sizeof smp);
        for (uint32_t l = 0; l < 2; l++) {
            smp[l].layer = l;
            smp[l].num_tokens = ns;
            smp[l].k = k;
            smp[l].v = v;
            smp[l].kv_bytes = cnt * 2;
        }
        kvdepot_calibrate_args ca;
        memset(&ca, 0, sizeof ca);
        ca.model = "dev";
        ca.vq_sub_dim = 4;
        ca.vq_bits = 8;
        ca.iterations = 4;
        ca.svd = 1;
        REQUIRE_RC(kvdepot_calibrate(c, &ca, smp, 2, NULL), KVDEPOT_OK);
        free(k);
        free(v);
    }
    const uint64_t n = 5 * 256 + 77; /* 5 whole pages and a raw tail */
    const struct {
        const char *id;
        kvdepot_codecs cs;
        int model;
    } seqs[] = {
        {"dev-raw", {{0, 0, 0, 0, 0}, {0, 0, 0, 0, 0}, 0}},
        {"dev-f32", {{0, 0, 0, 0, 0}, {0, 0, 0, 0, 0}, 0}, 1}, /* another shape, same batch */
        {"dev-vq", {{KVDEPOT_CODEC_VQ, 0, 0, 0, 0, 4, 8}, {KVDEPOT_CODEC_VQ, 0, 0, 0, 0, 4, 8}, 0}},
        {"dev-int4", {{KVDEPOT_CODEC_INT4, 64, 0, 0, 0}, {KVDEPOT_CODEC_INT4, 32, 0, 0, 0}, 0}},
        {"dev-int2", {{KVDEPOT_CODEC_INT2, 64, 1, 0, 5}, {KVDEPOT_CODEC_INT2, 64, 0, 1, 0}, 0}},
        /* keys per token; the INT sequences above group them per channel */
        {"dev-int2t",
         {{KVDEPOT_CODEC_INT2, 64, 0, KVDEPOT_AXIS_TOKEN, 0},
          {KVDEPOT_CODEC_INT2, 64, 0, 0, 0},
          0}},
        {"dev-svd", {.k = {.svd_removal_rate = 0.3}, .v = {.svd_removal_rate = 0.3}}, 0},
        {"dev-svdint",
         {.k = {.codec = KVDEPOT_CODEC_INT4, .group_size = 32, .svd_removal_rate = 0.3},
          .v = {.codec = KVDEPOT_CODEC_INT2, .stochastic = 1, .svd_removal_rate = 0.3}},
         0},
    };
    const size_t ns = sizeof seqs / sizeof seqs[0];
    for (size_t i = 0; i < ns; i++) {
        const kvdepot_model *m = &ms[seqs[i].model];
        REQUIRE_RC(create_coded(c, m->name, seqs[i].id, &seqs[i].cs), KVDEPOT_OK);
        REQUIRE_RC(make_seq_append_only(c, m, seqs[i].id, n), KVDEPOT_OK);
        long bad = pages_unlike_cpu(c, m, seqs[i].id, &seqs[i].cs, n);
        if (bad)
            printf("%s: %ld stored pages unlike the client's CPU encoding\n", seqs[i].id, bad);
        CHECK(bad == 0);
    }
    {
        /* the coded sequences' whole pages (5 x 2 layers each; all but the two
         * raw ones) were coded on the GPU */
        kvdepot_stats se;
        REQUIRE_RC(kvdepot_stats_get(c, &se), KVDEPOT_OK);
        uint64_t enc = se.device_pages_encoded - st0.device_pages_encoded;
        uint64_t placed = se.device_pages_placed - st0.device_pages_placed;
        printf("%llu pages coded on the device, %llu of them put in its tier where they were "
               "coded\n",
               (unsigned long long)enc, (unsigned long long)placed);
        if (on_gpu || on_cpu)
            CHECK(enc == (on_gpu ? 5 * 2 * (ns - 2) : 0));
        /* every one (the tier holds them all), and none was copied up again:
         * the Attends below read them there */
        CHECK(placed == enc);
        CHECK(se.device_fallbacks == st0.device_fallbacks);
    }
    /* ranges: all, partial pages at both ends, exact pages, tail only */
    const uint64_t ranges[][2] = {{0, 0}, {100, 1100}, {256, 768}, {1280, 0}};
    const size_t nr = sizeof ranges / sizeof ranges[0], nq = ns * nr;
    kvdepot_attend_query qs[32];
    float *q[32];
    for (int pass = 0; pass < 2; pass++) {
        kvdepot_stats st1;
        REQUIRE_RC(kvdepot_stats_get(c, &st1), KVDEPOT_OK);
        for (size_t i = 0; i < nq; i++) {
            const kvdepot_model *m = &ms[seqs[i / nr].model];
            q[i] = make_q(m, 900 + i);
            REQUIRE(q[i]);
            const char *id = seqs[i / nr].id;
            qs[i] = (kvdepot_attend_query){id,
                                           strlen(id),
                                           q[i],
                                           (size_t)m->num_q_heads * m->head_dim,
                                           ranges[i % nr][0],
                                           ranges[i % nr][1]};
        }
        kvdepot_attend_result *r = NULL;
        r = calloc(nq, sizeof *r);
        REQUIRE(r);
        for (int layer = 0; layer < 2; layer++) {
            REQUIRE_RC(kvdepot_attend(c, (uint32_t)layer, 0, qs, nq, r), KVDEPOT_OK);
            for (size_t i = 0; i < nq; i++) {
                uint64_t t0 = ranges[i % nr][0],
                         cnt = ranges[i % nr][1] ? ranges[i % nr][1] : n - t0;
                const kvdepot_model *m = &ms[seqs[i / nr].model];
                const size_t qf = (size_t)m->num_q_heads * m->head_dim;
                float lo[8 * 64], ll[8];
                REQUIRE_RC(
                    local_attend(c, m, seqs[i / nr].id, (uint32_t)layer, t0, cnt, q[i], lo, ll),
                    KVDEPOT_OK);
                double eo = nmse(r[i].output, lo, qf), el = nmse(r[i].lse, ll, m->num_q_heads);
                if (!(eo <= 1e-3 && el <= 1e-6))
                    printf("  pass %d layer %d %s [%llu, +%llu): out NMSE %.3g, lse NMSE %.3g\n",
                           pass, layer, seqs[i / nr].id, (unsigned long long)t0,
                           (unsigned long long)cnt, eo, el);
                CHECK(eo <= 1e-3 && el <= 1e-6);
            }
            kvdepot_attend_results_free(r, nq);
        }
        free(r);
        for (size_t i = 0; i < nq; i++)
            free(q[i]);
        kvdepot_stats st2;
        REQUIRE_RC(kvdepot_stats_get(c, &st2), KVDEPOT_OK);
        uint64_t dp = st2.device_pages_attended - st1.device_pages_attended;
        printf("pass %d: %llu pages attended on the device, device tier %llu pages\n", pass,
               (unsigned long long)dp, (unsigned long long)st2.tiers[0].pages);
        if (on_gpu) {
            /* whole pages of a layer: all 5, [100, 1200) 3, [256, 1024) 3 */
            CHECK(dp == 2 * ns * (5 + 3 + 3));
            CHECK(st2.tiers[0].pages > 0);
        }
        if (on_cpu)
            CHECK(dp == 0);
        /* again from RocksDB: every page goes back up to the device */
        for (size_t i = 0; i < ns; i++)
            REQUIRE_RC(kvdepot_sequence_evict(c, seqs[i].id, strlen(seqs[i].id), NULL, NULL),
                       KVDEPOT_OK);
    }
    kvdepot_close(c);
    return 0;
}

/*
 * A GPU that faults: kvdepotd_cuda_emu with KVD_EMU_FAULT_AT_LAUNCH=1, whose
 * first kernel launch fails with an illegal address, a sticky error. Raw
 * pages are stored without a launch, so the first Attend meets it: it still
 * answers, from the CPU, what the client computes; the device tier is
 * dropped and the GPU reported unusable (Stats, health NOT_SERVING);
 * appends (coded on the CPU now), reads and attention go on from the host
 * tier and RocksDB.
 */
static int t_device_fault(kvd_harness *h)
{
    REQUIRE(getenv("KVD_EMU_FAULT_AT_LAUNCH") != NULL);
    kvdepot_client *c = harness_client(h);
    REQUIRE(c);
    kvdepot_stats st;
    kvdepot_serving sv;
    REQUIRE_RC(kvdepot_stats_get(c, &st), KVDEPOT_OK);
    REQUIRE(strcmp(st.backend, "cuda") == 0 && st.device_healthy);
    REQUIRE_RC(kvdepot_health_check(c, NULL, &sv), KVDEPOT_OK);
    CHECK(sv == KVDEPOT_SERVING);
    kvdepot_model m;
    REQUIRE_RC(put_model(c, "fault", 1, 2, 8, 64, 0, KVDEPOT_DTYPE_F16, &m), KVDEPOT_OK);
    kvdepot_codecs cs;
    memset(&cs, 0, sizeof cs);
    const char *id = "f-raw";
    const uint64_t n = 3 * 256 + 10;
    REQUIRE_RC(create_coded(c, m.name, id, &cs), KVDEPOT_OK);
    REQUIRE_RC(make_seq_append_only(c, &m, id, n), KVDEPOT_OK);
    REQUIRE_RC(kvdepot_stats_get(c, &st), KVDEPOT_OK);
    CHECK(st.tiers[0].pages == 4);
    float *q = make_q(&m, 5);
    REQUIRE(q);
    for (int round = 0; round < 2; round++) {
        uint64_t len = n + (uint64_t)round * 300;
        kvdepot_attend_query qy = {id, strlen(id), q, 8 * 64, 0, 0};
        kvdepot_attend_result r;
        REQUIRE_RC(kvdepot_attend(c, 0, 0, &qy, 1, &r), KVDEPOT_OK);
        CHECK(r.num_tokens == len);
        float lo[8 * 64], ll[8];
        REQUIRE_RC(local_attend(c, &m, id, 0, 0, len, q, lo, ll), KVDEPOT_OK);
        double eo = nmse(r.output, lo, 8 * 64), el = nmse(r.lse, ll, 8);
        printf("round %d: attend vs client: out NMSE %.3g, lse NMSE %.3g\n", round, eo, el);
        CHECK(eo <= 1e-3 && el <= 1e-6);
        kvdepot_attend_results_free(&r, 1);
        REQUIRE_RC(kvdepot_stats_get(c, &st), KVDEPOT_OK);
        printf("  device '%s' healthy %d, %llu pages attended on it, device tier %llu pages, "
               "host tier %llu\n",
               st.device, st.device_healthy, (unsigned long long)st.device_pages_attended,
               (unsigned long long)st.tiers[0].pages, (unsigned long long)st.tiers[1].pages);
        CHECK(!st.device_healthy && st.device_pages_attended == 0 && st.tiers[0].pages == 0);
        REQUIRE_RC(kvdepot_health_check(c, NULL, &sv), KVDEPOT_OK);
        CHECK(sv == KVDEPOT_NOT_SERVING);
        if (round == 0) /* appends go on, into the host tier */
            REQUIRE_RC(append_at(c, &m, id, n, 300), KVDEPOT_OK);
    }
    /* a coded sequence now: its pages are coded on the CPU */
    kvdepot_codecs ci = {{KVDEPOT_CODEC_INT4, 64, 0, 0, 0}, {KVDEPOT_CODEC_INT2, 64, 1, 0, 9}, 0};
    REQUIRE_RC(create_coded(c, m.name, "f-int", &ci), KVDEPOT_OK);
    REQUIRE_RC(make_seq_append_only(c, &m, "f-int", n), KVDEPOT_OK);
    CHECK(pages_unlike_cpu(c, &m, "f-int", &ci, n) == 0);
    REQUIRE_RC(kvdepot_stats_get(c, &st), KVDEPOT_OK);
    CHECK(st.device_pages_encoded == 0 && st.device_fallbacks == 1);
    free(q);
    kvdepot_close(c);
    return 0;
}

/*
 * The same fault met by an Append coding its pages on the GPU (the first
 * launch is its first page's): the append still stores every page, coded
 * again on the CPU (the bytes the client's encoder makes), and the GPU is
 * reported unusable; Read and Attend answer from the host tier.
 */
static int t_device_fault_append(kvd_harness *h)
{
    REQUIRE(getenv("KVD_EMU_FAULT_AT_LAUNCH") != NULL);
    kvdepot_client *c = harness_client(h);
    REQUIRE(c);
    kvdepot_model m;
    REQUIRE_RC(put_model(c, "fa", 2, 2, 8, 64, 0, KVDEPOT_DTYPE_F16, &m), KVDEPOT_OK);
    kvdepot_codecs cs = {{KVDEPOT_CODEC_INT4, 64, 0, 0, 0}, {KVDEPOT_CODEC_INT2, 64, 1, 0, 9}, 0};
    const char *id = "fa-int";
    const uint64_t n = 3 * 256 + 10;
    REQUIRE_RC(create_coded(c, m.name, id, &cs), KVDEPOT_OK);
    REQUIRE_RC(make_seq_append_only(c, &m, id, n), KVDEPOT_OK);
    kvdepot_stats st;
    REQUIRE_RC(kvdepot_stats_get(c, &st), KVDEPOT_OK);
    printf("healthy %d, %llu pages coded on the device, %llu fallbacks, tiers %llu / %llu pages\n",
           st.device_healthy, (unsigned long long)st.device_pages_encoded,
           (unsigned long long)st.device_fallbacks, (unsigned long long)st.tiers[0].pages,
           (unsigned long long)st.tiers[1].pages);
    CHECK(!st.device_healthy && st.device_pages_encoded == 0 && st.device_fallbacks == 1);
    CHECK(st.tiers[0].pages == 0 && st.tiers[1].pages == 2 * 4);
    kvdepot_serving sv;
    REQUIRE_RC(kvdepot_health_check(c, NULL, &sv), KVDEPOT_OK);
    CHECK(sv == KVDEPOT_NOT_SERVING);
    CHECK(pages_unlike_cpu(c, &m, id, &cs, n) == 0);
    float *q = make_q(&m, 8);
    REQUIRE(q);
    kvdepot_attend_query qy = {id, strlen(id), q, 8 * 64, 0, 0};
    kvdepot_attend_result r;
    REQUIRE_RC(kvdepot_attend(c, 1, 0, &qy, 1, &r), KVDEPOT_OK);
    float lo[8 * 64], ll[8];
    REQUIRE_RC(local_attend(c, &m, id, 1, 0, n, q, lo, ll), KVDEPOT_OK);
    CHECK(nmse(r.output, lo, 8 * 64) <= 1e-3 && nmse(r.lse, ll, 8) <= 1e-6);
    kvdepot_attend_results_free(&r, 1);
    free(q);
    kvdepot_close(c);
    return 0;
}

/*
 * A GPU with no memory to spare: kvdepotd_cuda_emu with a 2 MiB device
 * (KVD_EMU_DEVICE_MIB=2) whose 2 MiB device tier takes all of it. Pages
 * still go to the device tier, but an Attend or a Search finds no memory
 * for its queries and results there: it is done on the CPU instead, with
 * the same answers, and the device stays healthy.
 */
static int t_device_oom(kvd_harness *h)
{
    REQUIRE(getenv("KVD_EMU_DEVICE_MIB") != NULL);
    kvdepot_client *c = harness_client(h);
    REQUIRE(c);
    kvdepot_model m;
    REQUIRE_RC(put_model(c, "oom", 1, 2, 8, 64, 0, KVDEPOT_DTYPE_F16, &m), KVDEPOT_OK);
    kvdepot_codecs cs = {{KVDEPOT_CODEC_INT4, 64, 0, 0, 0}, {KVDEPOT_CODEC_INT4, 64, 0, 0, 0}, 0};
    cs.pq_m = 8;
    cs.pq_bits = 6;
    const char *id = "o-int4";
    const uint64_t n = 4 * 256 + 10;
    REQUIRE_RC(create_coded(c, m.name, id, &cs), KVDEPOT_OK);
    REQUIRE_RC(make_seq_append_only(c, &m, id, n), KVDEPOT_OK);
    float *q = make_q(&m, 6);
    REQUIRE(q);
    kvdepot_attend_query qy = {id, strlen(id), q, 8 * 64, 0, 0};
    kvdepot_attend_result r;
    REQUIRE_RC(kvdepot_attend(c, 0, 0, &qy, 1, &r), KVDEPOT_OK);
    float lo[8 * 64], ll[8];
    REQUIRE_RC(local_attend(c, &m, id, 0, 0, n, q, lo, ll), KVDEPOT_OK);
    double eo = nmse(r.output, lo, 8 * 64), el = nmse(r.lse, ll, 8);
    printf("attend vs client: out NMSE %.3g, lse NMSE %.3g\n", eo, el);
    CHECK(eo <= 1e-3 && el <= 1e-6);
    kvdepot_attend_results_free(&r, 1);
    kvdepot_search_args sa = {id, strlen(id), 0, q, 8 * 64, 16, 4, 16, 0, 0};
    kvdepot_search_result sr;
    REQUIRE_RC(kvdepot_search(c, &sa, &sr), KVDEPOT_OK);
    CHECK(sr.num_heads == 2 && sr.heads[0].count == 16 + 4 + 16);
    kvdepot_search_result_free(&sr);
    kvdepot_stats st;
    REQUIRE_RC(kvdepot_stats_get(c, &st), KVDEPOT_OK);
    printf("device tier %llu pages, %llu attended and %llu searched on the device, healthy %d\n",
           (unsigned long long)st.tiers[0].pages, (unsigned long long)st.device_pages_attended,
           (unsigned long long)st.device_pages_searched, st.device_healthy);
    CHECK(st.tiers[0].pages > 0 && st.device_pages_attended == 0 && st.device_pages_searched == 0 &&
          st.device_healthy);
    free(q);
    kvdepot_close(c);
    return 0;
}

static const kvd_test tests[] = {
    {"attend", t_attend},
    {"attend_long", t_attend_long},
    {"lse_merge", t_lse_merge},
    {"plan_fetch", t_plan_fetch},
    {"errors", t_errors},
    {"batch_limit", t_batch_limit},
    {"attend_half", t_attend_half},
    {"codecs", t_codecs},
    {"bad_codecs", t_bad_codecs},
    {"small_heads", t_small_heads},
    {"search", t_search},
    {"append_pages", t_append_pages},
    {"read_pages", t_read_pages},
    {"device", t_device},
    {"device_fault", t_device_fault},
    {"device_oom", t_device_oom},
    {"device_fault_append", t_device_fault_append},
};

int main(int argc, char **argv)
{
    return harness_main(argc, argv, tests, sizeof tests / sizeof tests[0]);
}
