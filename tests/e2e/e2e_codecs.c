/*
 * End-to-end tests of the VQ codec and the SVD reduction through libkvdepot
 * against a real kvdepotd: a model is calibrated on synthetic LLM-like K/V/Q
 * (low-rank structure, a few outlier key channels); sequences created with
 * VQ K/V, SVD + raw and SVD + INT seal coded pages; Read (decoded) is within
 * the documented error of what was appended (raw tail bit-exact); Attend
 * equals the client's own attention (CPU kernels) on the data it reads back;
 * recalibrating the model leaves existing sequences unchanged (artifact
 * snapshot); AppendPages takes pages the client encoded with the model's
 * artifacts and refuses pages coded with other artifacts; bad specs and
 * uncalibrated models fail the create with nothing made.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "harness.h"
#include "kvdepot/tensor.h"

enum { L = 2, H = 2, HQ = 8, D = 64, N = 700, STEP = 350, SEALED = 512 };
#define ROW ((size_t)H * D)

static uint64_t xs(uint64_t *s)
{
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    return *s;
}

static float unif(uint64_t *s) /* [-1, 1) */
{
    return (float)((xs(s) >> 40) & 0xffffff) / (float)(1 << 23) - 1.0f;
}

/*
 * LLM-like K (which 0), V (1) or Q (2) of tokens [t0, t0 + n) of every layer,
 * wire layout [layer][token][head][dim], f16. Each (layer, head) has a fixed
 * rank-12 basis (the same for calibration samples and appended data); token
 * coefficients come from `seed`; keys have three channels 6x larger.
 */
static uint16_t *gen(int which, uint64_t t0, uint64_t n, uint64_t seed)
{
    const int R = 12;
    const uint32_t heads = which == 2 ? HQ : H;
    uint16_t *out = malloc(sizeof(uint16_t) * L * n * heads * D);
    float w[R * D];
    for (uint32_t l = 0; l < L; l++)
        for (uint32_t h = 0; h < heads; h++) {
            /* Q heads share their kv head's basis so q.k has structure. */
            uint32_t kh = which == 2 ? h / (HQ / H) : h;
            uint64_t bs = 1000 + 37 * l + kh + (which == 1 ? 500 : 0);
            for (int i = 0; i < R * D; i++)
                w[i] = unif(&bs);
            for (uint64_t t = 0; t < n; t++) {
                uint64_t cs = seed * 7919 + (t0 + t) * 131 + l * 17 + h + 1;
                float c[12];
                for (int r = 0; r < R; r++)
                    c[r] = unif(&cs);
                for (uint32_t i = 0; i < D; i++) {
                    float a = 0;
                    for (int r = 0; r < R; r++)
                        a += c[r] * w[r * D + i];
                    a = 0.4f * a + 0.04f * unif(&cs);
                    if (which == 0 && (i == 3 || i == 17 || i == 40))
                        a *= 6.0f;
                    out[((l * n + t) * heads + h) * D + i] = kvd_f32_to_f16(a);
                }
            }
        }
    return out;
}

static int put_model(kvdepot_client *c, const char *name, kvdepot_model *m)
{
    memset(m, 0, sizeof *m);
    snprintf(m->name, sizeof m->name, "%s", name);
    m->num_layers = L;
    m->num_kv_heads = H;
    m->num_q_heads = HQ;
    m->head_dim = D;
    m->dtype = KVDEPOT_DTYPE_F16;
    return kvdepot_model_put(c, m, 0, NULL, NULL);
}

/* Calibrate `model` on 1024 sample tokens per layer (VQ d4b8 + SVD). */
static int calibrate(kvdepot_client *c, const char *model, uint64_t seed)
{
    const uint64_t n = 1024;
    uint16_t *k = gen(0, 0, n, seed), *v = gen(1, 0, n, seed), *q = gen(2, 0, n, seed);
    kvdepot_calibrate_sample s[L];
    for (uint32_t l = 0; l < L; l++) {
        memset(&s[l], 0, sizeof s[l]);
        s[l].layer = l;
        s[l].num_tokens = n;
        s[l].k = k + l * n * ROW;
        s[l].v = v + l * n * ROW;
        s[l].q = q + l * n * HQ * D;
        s[l].kv_bytes = n * ROW * 2;
        s[l].q_bytes = n * HQ * D * 2;
    }
    kvdepot_calibrate_args a;
    memset(&a, 0, sizeof a);
    a.model = model;
    a.vq_sub_dim = 4;
    a.vq_bits = 8;
    a.svd = 1;
    a.seed = seed;
    int rc = kvdepot_calibrate(c, &a, s, L, NULL);
    free(k);
    free(v);
    free(q);
    return rc;
}

static int create(kvdepot_client *c, const char *model, const char *id, const kvdepot_codecs *cs)
{
    kvdepot_create_args ca;
    memset(&ca, 0, sizeof ca);
    ca.id = id;
    ca.id_len = strlen(id);
    ca.model = model;
    ca.codecs = cs;
    return kvdepot_sequence_create(c, &ca, NULL);
}

/* Append the test data (seed 50) in appends of STEP tokens. */
static int append_data(kvdepot_client *c, const char *id)
{
    for (uint64_t t = 0; t < N; t += STEP) {
        uint16_t *k = gen(0, t, STEP, 50), *v = gen(1, t, STEP, 50);
        kvdepot_append_args aa;
        memset(&aa, 0, sizeof aa);
        aa.id = id;
        aa.id_len = strlen(id);
        aa.token_start = t;
        aa.num_tokens = STEP;
        aa.dtype = KVDEPOT_DTYPE_F16;
        aa.k = k;
        aa.v = v;
        aa.k_bytes = aa.v_bytes = (size_t)L * STEP * ROW * 2;
        int rc = kvdepot_sequence_append(c, &aa, NULL);
        free(k);
        free(v);
        if (rc)
            return rc;
    }
    return 0;
}

static double nmse_f16(const uint16_t *a, const uint16_t *b, size_t n)
{
    double num = 0, den = 0;
    for (size_t i = 0; i < n; i++) {
        double x = kvd_f16_to_f32(a[i]), y = kvd_f16_to_f32(b[i]);
        num += (x - y) * (x - y);
        den += y * y;
    }
    return den > 0 ? num / den : num;
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

static float *make_q(uint64_t seed)
{
    uint16_t *q16 = gen(2, 5000 + seed, 1, 9);
    float *q = malloc(sizeof(float) * HQ * D);
    for (int i = 0; i < HQ * D; i++) /* layer 0 */
        q[i] = kvd_f16_to_f32(q16[i]);
    free(q16);
    return q;
}

/* Read every layer decoded. */
static int read_all(kvdepot_client *c, const char *id, kvdepot_read_result *rr)
{
    kvdepot_read_args ra;
    memset(&ra, 0, sizeof ra);
    ra.id = id;
    ra.id_len = strlen(id);
    return kvdepot_sequence_read(c, &ra, rr);
}

/*
 * The checks every coded sequence passes: bytes stored vs fp16, decoded
 * Read within max_nmse of the appended data over the sealed pages and
 * bit-exact over the raw tail, Attend (both layers) equal to the client's
 * attention on the data it read back, and the LSE merge of a server range
 * with a client tail equal to the whole Attend.
 */
static int check_seq(kvdepot_client *c, const char *id, double max_ratio, double max_nmse_k,
                     double max_nmse_v)
{
    kvdepot_sequence_info info;
    REQUIRE_RC(kvdepot_sequence_stat(c, id, strlen(id), &info), KVDEPOT_OK);
    double raw = 2.0 * 2 * N * ROW * L, ratio = (double)info.stored_bytes / raw;
    kvdepot_sequence_info_clear(&info);
    kvdepot_read_result rr;
    REQUIRE_RC(read_all(c, id, &rr), KVDEPOT_OK);
    REQUIRE(rr.num_tokens == N && rr.num_layers == L);
    double e[2];
    for (int which = 0; which < 2; which++) {
        uint16_t *want = gen(which, 0, N, 50); /* gen(t0 = 0, n = N) = the appends */
        const uint16_t *got = which ? rr.v : rr.k;
        double num = 0;
        for (uint32_t l = 0; l < L; l++) {
            const size_t o = (size_t)l * N * ROW;
            num += nmse_f16(got + o, want + o, SEALED * ROW) / L;
            CHECK(memcmp(got + o + SEALED * ROW, want + o + SEALED * ROW, (N - SEALED) * ROW * 2) ==
                  0); /* raw tail */
        }
        e[which] = num;
        free(want);
    }
    printf("%s: stored %.3f of fp16 (%.2f bits/value incl. the raw tail); decoded NMSE K %.4f "
           "V %.4f\n",
           id, ratio, 16 * ratio, e[0], e[1]);
    CHECK(ratio <= max_ratio);
    CHECK(e[0] <= max_nmse_k && e[1] <= max_nmse_v);
    float *q = make_q(1);
    for (uint32_t l = 0; l < L; l++) {
        kvdepot_attend_query qy = {id, strlen(id), q, HQ * D, 0, 0};
        kvdepot_attend_result r;
        REQUIRE_RC(kvdepot_attend(c, l, 0, &qy, 1, &r), KVDEPOT_OK);
        const uint8_t *kl = (const uint8_t *)rr.k + (size_t)l * N * ROW * 2;
        const uint8_t *vl = (const uint8_t *)rr.v + (size_t)l * N * ROW * 2;
        float lo[HQ * D], ll[HQ];
        REQUIRE_RC(kvdepot_attention_local(KVDEPOT_DTYPE_F16, HQ, H, D, 0, q, kl, vl, N, lo, ll),
                   KVDEPOT_OK);
        double eo = nmse(r.output, lo, HQ * D), el = nmse(r.lse, ll, HQ);
        printf("  layer %u: Attend vs client on read-back data: out NMSE %.3g, lse NMSE %.3g\n", l,
               eo, el);
        CHECK(eo <= 1e-3 && el <= 1e-6);
        /* server over [0, N - w) merged with the client over the last w */
        const uint64_t w = 100;
        kvdepot_attend_query q2 = {id, strlen(id), q, HQ * D, 0, N - w};
        kvdepot_attend_result r2;
        REQUIRE_RC(kvdepot_attend(c, l, 0, &q2, 1, &r2), KVDEPOT_OK);
        REQUIRE_RC(kvdepot_attention_local(KVDEPOT_DTYPE_F16, HQ, H, D, 0, q,
                                           kl + (N - w) * ROW * 2, vl + (N - w) * ROW * 2, w, lo,
                                           ll),
                   KVDEPOT_OK);
        REQUIRE_RC(kvdepot_attention_merge(HQ, D, r2.output, r2.lse, lo, ll), KVDEPOT_OK);
        CHECK(nmse(r2.output, r.output, HQ * D) <= 1e-10);
        CHECK(nmse(r2.lse, r.lse, HQ) <= 1e-10);
        kvdepot_attend_results_free(&r, 1);
        kvdepot_attend_results_free(&r2, 1);
    }
    free(q);
    kvdepot_free(rr.owned);
    return 0;
}

static kvdepot_codecs vq_codecs(void)
{
    kvdepot_codecs cs;
    memset(&cs, 0, sizeof cs);
    cs.k.codec = cs.v.codec = KVDEPOT_CODEC_VQ;
    cs.k.vq_sub_dim = cs.v.vq_sub_dim = 4;
    cs.k.vq_bits = cs.v.vq_bits = 8;
    return cs;
}

/* VQ d4b8 K and V (fused kernel), VQ K + INT4 V (decoded), VQ + raw sink;
 * Search on a VQ sequence; pages ship as stored; recalibration and a
 * restart leave the sequences as they were. */
static int t_vq(kvd_harness *h)
{
    kvdepot_client *c = harness_client(h);
    REQUIRE(c);
    kvdepot_model m;
    REQUIRE_RC(put_model(c, "vqm", &m), KVDEPOT_OK);
    REQUIRE_RC(calibrate(c, "vqm", 1), KVDEPOT_OK);
    kvdepot_codecs vq = vq_codecs(), mixed = vq_codecs(), sink = vq_codecs();
    mixed.v.codec = KVDEPOT_CODEC_INT4;
    mixed.v.vq_sub_dim = mixed.v.vq_bits = 0;
    sink.raw_sink_tokens = 1;
    REQUIRE_RC(create(c, "vqm", "vq", &vq), KVDEPOT_OK);
    REQUIRE_RC(create(c, "vqm", "vq-int4", &mixed), KVDEPOT_OK);
    REQUIRE_RC(create(c, "vqm", "vq-sink", &sink), KVDEPOT_OK);
    REQUIRE_RC(append_data(c, "vq"), KVDEPOT_OK);
    REQUIRE_RC(append_data(c, "vq-int4"), KVDEPOT_OK);
    REQUIRE_RC(append_data(c, "vq-sink"), KVDEPOT_OK);
    /* Bounds: VQ d4b8 measures K 0.055, V 0.095 on these data (README);
     * 512 of the 700 tokens are in sealed pages, the rest is the raw tail. */
    if (check_seq(c, "vq", 0.37, 0.08, 0.12) || check_seq(c, "vq-int4", 0.45, 0.08, 0.01) ||
        check_seq(c, "vq-sink", 0.7, 0.08, 0.12))
        return 1;
    /* Search and SparseAttend read the keys of a VQ sequence (decoded). */
    kvdepot_codecs vqpq = vq_codecs();
    vqpq.pq_m = 8;
    REQUIRE_RC(create(c, "vqm", "vq-pq", &vqpq), KVDEPOT_OK);
    REQUIRE_RC(append_data(c, "vq-pq"), KVDEPOT_OK);
    float *sq = make_q(3);
    kvdepot_search_args sa = {"vq-pq", 5, 0, sq, HQ * D, 16, 4, 8, 0, 0};
    kvdepot_search_result sr;
    REQUIRE_RC(kvdepot_search(c, &sa, &sr), KVDEPOT_OK);
    CHECK(sr.num_heads == H && sr.heads[0].count == 16 + 4 + 8);
    kvdepot_search_result_free(&sr);
    kvdepot_attend_result sp;
    REQUIRE_RC(kvdepot_sparse_attend(c, &sa, 0, &sp, NULL), KVDEPOT_OK);
    kvdepot_attend_results_free(&sp, 1);
    free(sq);
    /* READ_FORMAT_PAGES ships the stored VQ pages (codec byte 3). */
    kvdepot_read_args ra;
    memset(&ra, 0, sizeof ra);
    ra.id = "vq";
    ra.id_len = 2;
    ra.num_layers = 1;
    kvdepot_page *pages;
    size_t np;
    REQUIRE_RC(kvdepot_sequence_read_pages(c, &ra, &pages, &np), KVDEPOT_OK);
    REQUIRE(np == 3);
    CHECK(((uint8_t *)pages[0].data)[8] == 3 && ((uint8_t *)pages[0].data)[9] == 3);
    CHECK(((uint8_t *)pages[2].data)[8] == 0); /* the raw tail */
    kvdepot_pages_free(pages, np);
    /* Recalibrate with other samples: existing sequences keep their
     * snapshot (same decoded bytes), new ones take the new artifacts. */
    kvdepot_read_result before, after;
    REQUIRE_RC(read_all(c, "vq", &before), KVDEPOT_OK);
    REQUIRE_RC(calibrate(c, "vqm", 2), KVDEPOT_OK);
    REQUIRE_RC(read_all(c, "vq", &after), KVDEPOT_OK);
    CHECK(before.kv_bytes == after.kv_bytes &&
          memcmp(before.k, after.k, before.kv_bytes) == 0 &&
          memcmp(before.v, after.v, before.kv_bytes) == 0);
    kvdepot_free(after.owned);
    REQUIRE_RC(kvdepot_sequence_evict(c, "vq", 2, NULL, NULL), KVDEPOT_OK);
    if (check_seq(c, "vq", 0.37, 0.08, 0.12))
        return 1;
    /* The snapshot is persisted: a restarted server decodes the same, and
     * counts the same stored bytes (the sequence record keeps page sizes). */
    kvdepot_sequence_info si;
    REQUIRE_RC(kvdepot_sequence_stat(c, "vq", 2, &si), KVDEPOT_OK);
    uint64_t stored_before = si.stored_bytes;
    kvdepot_sequence_info_clear(&si);
    kvdepot_close(c);
    REQUIRE(harness_restart(h) == 0);
    c = harness_client(h);
    REQUIRE(c);
    REQUIRE_RC(read_all(c, "vq", &after), KVDEPOT_OK);
    CHECK(before.kv_bytes == after.kv_bytes &&
          memcmp(before.k, after.k, before.kv_bytes) == 0 &&
          memcmp(before.v, after.v, before.kv_bytes) == 0);
    kvdepot_free(before.owned);
    kvdepot_free(after.owned);
    REQUIRE_RC(kvdepot_sequence_stat(c, "vq", 2, &si), KVDEPOT_OK);
    CHECK(si.stored_bytes == stored_before);
    kvdepot_sequence_info_clear(&si);
    if (check_seq(c, "vq", 0.37, 0.08, 0.12))
        return 1;
    REQUIRE_RC(create(c, "vqm", "vq-new", &vq), KVDEPOT_OK);
    REQUIRE_RC(append_data(c, "vq-new"), KVDEPOT_OK);
    if (check_seq(c, "vq-new", 0.37, 0.08, 0.12))
        return 1;
    /* A deleted VQ sequence's id comes back raw: no snapshot left over. */
    REQUIRE_RC(kvdepot_sequence_delete(c, "vq", 2, NULL), KVDEPOT_OK);
    REQUIRE_RC(create(c, "vqm", "vq", NULL), KVDEPOT_OK);
    REQUIRE_RC(append_data(c, "vq"), KVDEPOT_OK);
    if (check_seq(c, "vq", 1.01, 0, 0))
        return 1;
    kvdepot_close(c);
    return 0;
}

/* SVD + raw (reduced-dimension kernel), SVD + INT4 K / INT2 V (INT kernel
 * per head at the reduced widths), SVD + raw K with INT4 V (decoded). */
static int t_svd(kvd_harness *h)
{
    kvdepot_client *c = harness_client(h);
    REQUIRE(c);
    kvdepot_model m;
    REQUIRE_RC(put_model(c, "svdm", &m), KVDEPOT_OK);
    REQUIRE_RC(calibrate(c, "svdm", 3), KVDEPOT_OK);
    kvdepot_codecs raw, in, mix;
    memset(&raw, 0, sizeof raw);
    raw.k.svd_removal_rate = raw.v.svd_removal_rate = 0.1;
    memset(&in, 0, sizeof in);
    static const uint32_t w32[1] = {32};
    in.k.codec = KVDEPOT_CODEC_INT4;
    in.k.group_size = 32;
    in.k.svd_removal_rate = 0.1;
    in.v.codec = KVDEPOT_CODEC_INT2;
    in.v.svd_widths = w32;
    in.v.svd_num_widths = 1;
    mix = raw;
    mix.v.svd_removal_rate = 0;
    mix.v.codec = KVDEPOT_CODEC_INT4;
    REQUIRE_RC(create(c, "svdm", "svd-raw", &raw), KVDEPOT_OK);
    REQUIRE_RC(create(c, "svdm", "svd-int", &in), KVDEPOT_OK);
    REQUIRE_RC(create(c, "svdm", "svd-mix", &mix), KVDEPOT_OK);
    REQUIRE_RC(append_data(c, "svd-raw"), KVDEPOT_OK);
    REQUIRE_RC(append_data(c, "svd-int"), KVDEPOT_OK);
    REQUIRE_RC(append_data(c, "svd-mix"), KVDEPOT_OK);
    REQUIRE_RC(kvdepot_sequence_evict(c, "svd-int", 7, NULL, NULL), KVDEPOT_OK);
    /* On a GPU (KVDEPOT_DEVICE=cuda) the SVD + raw and SVD + INT pages are
     * attended where they lie (the reduced-dimension kernel; the INT kernel
     * per kv head at its widths): 2 sealed pages a layer, 2 layers, two
     * Attends each (all of it, and [0, N - 100)). SVD + raw K with INT4 V
     * has no kernel: decoded on the CPU. */
    const char *want = getenv("KVDEPOT_DEVICE");
    const int on_gpu = want && strncmp(want, "cuda", 4) == 0;
    const char *ids[3] = {"svd-raw", "svd-int", "svd-mix"};
    const double lim[3][3] = {{0.6, 0.01, 0.01}, {0.4, 0.03, 0.25}, {0.6, 0.01, 0.01}};
    for (int i = 0; i < 3; i++) {
        kvdepot_stats s0, s1;
        REQUIRE_RC(kvdepot_stats_get(c, &s0), KVDEPOT_OK);
        if (check_seq(c, ids[i], lim[i][0], lim[i][1], lim[i][2]))
            return 1;
        REQUIRE_RC(kvdepot_stats_get(c, &s1), KVDEPOT_OK);
        const uint64_t dp = s1.device_pages_attended - s0.device_pages_attended;
        printf("%s: %llu pages attended on the device (backend %s)\n", ids[i],
               (unsigned long long)dp, s1.backend);
        CHECK(dp == (on_gpu && i < 2 ? 2 * 2 * 2 : 0));
    }
    kvdepot_close(c);
    return 0;
}

/* Pages the client encodes with the model's artifacts are stored as they
 * are (same bytes as the server's own); pages coded with other artifacts
 * (after a recalibration), damaged ones, or encoding without the artifacts
 * fail and change nothing. */
static int t_append_pages(kvd_harness *h)
{
    kvdepot_client *c = harness_client(h);
    REQUIRE(c);
    kvdepot_model m;
    REQUIRE_RC(put_model(c, "apm", &m), KVDEPOT_OK);
    REQUIRE_RC(calibrate(c, "apm", 4), KVDEPOT_OK);
    kvdepot_artifact *arts;
    size_t na;
    REQUIRE_RC(kvdepot_artifacts_get(c, "apm", NULL, 0, &arts, &na), KVDEPOT_OK);
    kvdepot_codecs vq = vq_codecs(), svd;
    memset(&svd, 0, sizeof svd);
    svd.k.codec = KVDEPOT_CODEC_INT4;
    svd.k.group_size = 32;
    svd.k.svd_removal_rate = 0.1;
    svd.v.svd_removal_rate = 0.1;
    const kvdepot_codecs *specs[2] = {&vq, &svd};
    const char *srv[2] = {"srv-vq", "srv-svd"}, *cli[2] = {"cli-vq", "cli-svd"};
    uint16_t *k = gen(0, 0, N, 50), *v = gen(1, 0, N, 50);
    for (int s = 0; s < 2; s++) {
        REQUIRE_RC(create(c, "apm", srv[s], specs[s]), KVDEPOT_OK);
        REQUIRE_RC(create(c, "apm", cli[s], specs[s]), KVDEPOT_OK);
        REQUIRE_RC(append_data(c, srv[s]), KVDEPOT_OK);
        kvdepot_page *all = NULL;
        size_t total = 0, sent = 0;
        for (uint32_t l = 0; l < L; l++) {
            kvdepot_page *p;
            size_t np;
            CHECK_RC(kvdepot_encode_pages(&m, specs[s], 256, l, 0, N, k + l * N * ROW,
                                          v + l * N * ROW, &p, &np),
                     KVDEPOT_EINVAL); /* VQ/SVD need the artifacts */
            REQUIRE_RC(kvdepot_encode_pages_with_artifacts(&m, specs[s], arts, na, 256, l, 0, N,
                                                           k + l * N * ROW, v + l * N * ROW, &p,
                                                           &np),
                       KVDEPOT_OK);
            all = realloc(all, (total + np) * sizeof *all);
            memcpy(all + total, p, np * sizeof *p);
            total += np;
            free(p);
        }
        for (size_t i = 0; i < total; i++)
            sent += all[i].len;
        /* a damaged coded section (checksum broken) */
        ((uint8_t *)all[0].data)[all[0].len - 3] ^= 1;
        CHECK_RC(kvdepot_append_pages(c, cli[s], strlen(cli[s]), all, total, NULL),
                 KVDEPOT_ECORRUPT);
        ((uint8_t *)all[0].data)[all[0].len - 3] ^= 1;
        REQUIRE_RC(kvdepot_append_pages(c, cli[s], strlen(cli[s]), all, total, NULL), KVDEPOT_OK);
        kvdepot_pages_free(all, total);
        kvdepot_sequence_info a, b;
        REQUIRE_RC(kvdepot_sequence_stat(c, srv[s], strlen(srv[s]), &a), KVDEPOT_OK);
        REQUIRE_RC(kvdepot_sequence_stat(c, cli[s], strlen(cli[s]), &b), KVDEPOT_OK);
        printf("%s: %zu page bytes sent for %zu fp16 K/V bytes (%.2fx smaller)\n", cli[s], sent,
               (size_t)2 * L * N * ROW * 2, (double)(2 * L * N * ROW * 2) / (double)sent);
        CHECK(a.num_tokens == N && b.num_tokens == N && a.stored_bytes == b.stored_bytes);
        kvdepot_sequence_info_clear(&a);
        kvdepot_sequence_info_clear(&b);
        kvdepot_read_result r1, r2;
        REQUIRE_RC(read_all(c, srv[s], &r1), KVDEPOT_OK);
        REQUIRE_RC(read_all(c, cli[s], &r2), KVDEPOT_OK);
        CHECK(r1.kv_bytes == r2.kv_bytes && memcmp(r1.k, r2.k, r1.kv_bytes) == 0 &&
              memcmp(r1.v, r2.v, r1.kv_bytes) == 0);
        kvdepot_free(r1.owned);
        kvdepot_free(r2.owned);
        if (check_seq(c, cli[s], 0.6, 0.08, 0.12))
            return 1;
    }
    /* Recalibrated model: pages coded with its new artifacts do not match
     * the snapshot of a sequence created before: FAILED_PRECONDITION. */
    REQUIRE_RC(create(c, "apm", "old", &vq), KVDEPOT_OK);
    REQUIRE_RC(calibrate(c, "apm", 5), KVDEPOT_OK);
    kvdepot_artifacts_free(arts, na);
    REQUIRE_RC(kvdepot_artifacts_get(c, "apm", NULL, 0, &arts, &na), KVDEPOT_OK);
    kvdepot_page *p;
    size_t np;
    REQUIRE_RC(
        kvdepot_encode_pages_with_artifacts(&m, &vq, arts, na, 256, 0, 0, 512, k, v, &p, &np),
        KVDEPOT_OK);
    kvdepot_page *p1;
    size_t np1;
    REQUIRE_RC(kvdepot_encode_pages_with_artifacts(&m, &vq, arts, na, 256, 1, 0, 512, k + N * ROW,
                                                   v + N * ROW, &p1, &np1),
               KVDEPOT_OK);
    p = realloc(p, (np + np1) * sizeof *p);
    memcpy(p + np, p1, np1 * sizeof *p1);
    free(p1);
    CHECK_RC(kvdepot_append_pages(c, "old", 3, p, np + np1, NULL), KVDEPOT_EPRECOND);
    CHECK(strstr(kvdepot_errmsg(NULL), "fingerprint") != NULL);
    kvdepot_sequence_info info;
    REQUIRE_RC(kvdepot_sequence_stat(c, "old", 3, &info), KVDEPOT_OK);
    CHECK(info.num_tokens == 0 && info.stored_bytes == 0);
    kvdepot_sequence_info_clear(&info);
    /* INT2 pages for a VQ sequence: not its codec. */
    kvdepot_codecs int2;
    memset(&int2, 0, sizeof int2);
    int2.k.codec = int2.v.codec = KVDEPOT_CODEC_INT2;
    kvdepot_page *pi;
    size_t npi;
    REQUIRE_RC(kvdepot_encode_pages(&m, &int2, 256, 0, 0, 512, k, v, &pi, &npi), KVDEPOT_OK);
    REQUIRE_RC(create(c, "apm", "vq-x", &vq), KVDEPOT_OK);
    CHECK_RC(kvdepot_append_pages(c, "vq-x", 4, pi, npi, NULL), KVDEPOT_EINVAL);
    kvdepot_pages_free(pi, npi);
    /* ... while a sequence created now takes them. */
    REQUIRE_RC(create(c, "apm", "new", &vq), KVDEPOT_OK);
    CHECK_RC(kvdepot_append_pages(c, "new", 3, p, np + np1, NULL), KVDEPOT_OK);
    kvdepot_pages_free(p, np + np1);
    kvdepot_artifacts_free(arts, na);
    free(k);
    free(v);
    kvdepot_close(c);
    return 0;
}

/* Uncalibrated models and bad specs: clear status, no sequence made. */
static int t_errors(kvd_harness *h)
{
    kvdepot_client *c = harness_client(h);
    REQUIRE(c);
    kvdepot_model m;
    REQUIRE_RC(put_model(c, "raw-model", &m), KVDEPOT_OK);
    REQUIRE_RC(put_model(c, "cal-model", &m), KVDEPOT_OK);
    REQUIRE_RC(calibrate(c, "cal-model", 6), KVDEPOT_OK);
    kvdepot_codecs vq = vq_codecs(), s;
    CHECK_RC(create(c, "raw-model", "x", &vq), KVDEPOT_EPRECOND);
    CHECK(strstr(kvdepot_errmsg(NULL), "Calibrate") != NULL);
    memset(&s, 0, sizeof s);
    s.v.svd_removal_rate = 0.1;
    CHECK_RC(create(c, "raw-model", "x", &s), KVDEPOT_EPRECOND);
    const struct {
        const char *what;
        int field, want;
        uint32_t val;
    } bad[] = {
        {"d 3", 0, KVDEPOT_EINVAL, 3},
        {"b 13", 1, KVDEPOT_EINVAL, 13},
        {"b 0", 1, KVDEPOT_EINVAL, 0},
        {"b 6 (calibrated 8)", 1, KVDEPOT_EPRECOND, 6},
        {"d 8 (calibrated 4)", 0, KVDEPOT_EPRECOND, 8},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        s = vq_codecs();
        if (bad[i].field == 0)
            s.v.vq_sub_dim = bad[i].val;
        else
            s.v.vq_bits = bad[i].val;
        printf("VQ %s\n", bad[i].what);
        CHECK_RC(create(c, "cal-model", "x", &s), bad[i].want);
    }
    s = vq_codecs();
    s.k.svd_removal_rate = 0.1; /* SVD with VQ: not offered */
    CHECK_RC(create(c, "cal-model", "x", &s), KVDEPOT_EINVAL);
    CHECK(strstr(kvdepot_errmsg(NULL), "VQ") != NULL);
    memset(&s, 0, sizeof s);
    s.k.svd_removal_rate = 1.5;
    CHECK_RC(create(c, "cal-model", "x", &s), KVDEPOT_EINVAL);
    static const uint32_t zero[1] = {0}, three[3] = {8, 8, 8};
    memset(&s, 0, sizeof s);
    s.k.svd_widths = zero;
    s.k.svd_num_widths = 1;
    CHECK_RC(create(c, "cal-model", "x", &s), KVDEPOT_EINVAL);
    s.k.svd_widths = three; /* 3 widths for 2 kv heads */
    s.k.svd_num_widths = 3;
    CHECK_RC(create(c, "cal-model", "x", &s), KVDEPOT_EINVAL);
    kvdepot_sequence_info info;
    CHECK_RC(kvdepot_sequence_stat(c, "x", 1, &info), KVDEPOT_ENOTFOUND);
    kvdepot_close(c);
    return 0;
}

/* A VQ sequence created from another's stored prefix (same codecs, same
 * artifacts) shares its coded pages: Read and Attend over the prefix equal
 * the owner's. */
static int t_prefix(kvd_harness *h)
{
    kvdepot_client *c = harness_client(h);
    REQUIRE(c);
    kvdepot_model m;
    REQUIRE_RC(put_model(c, "pfm", &m), KVDEPOT_OK);
    REQUIRE_RC(calibrate(c, "pfm", 8), KVDEPOT_OK);
    kvdepot_codecs vq = vq_codecs();
    REQUIRE_RC(create(c, "pfm", "owner", &vq), KVDEPOT_OK);
    uint32_t ids[N];
    for (uint32_t i = 0; i < N; i++)
        ids[i] = 1000 + i * 7;
    for (uint64_t t = 0; t < N; t += STEP) {
        uint16_t *k = gen(0, t, STEP, 50), *v = gen(1, t, STEP, 50);
        kvdepot_append_args aa;
        memset(&aa, 0, sizeof aa);
        aa.id = "owner";
        aa.id_len = 5;
        aa.token_start = t;
        aa.num_tokens = STEP;
        aa.dtype = KVDEPOT_DTYPE_F16;
        aa.k = k;
        aa.v = v;
        aa.k_bytes = aa.v_bytes = (size_t)L * STEP * ROW * 2;
        aa.token_ids = ids + t;
        aa.num_token_ids = STEP;
        int rc = kvdepot_sequence_append(c, &aa, NULL);
        free(k);
        free(v);
        REQUIRE_RC(rc, KVDEPOT_OK);
    }
    uint64_t hs[2];
    REQUIRE(kvdepot_prefix_hash_chain(ids, SEALED, 256, hs) == 2);
    kvdepot_create_args ca;
    memset(&ca, 0, sizeof ca);
    ca.id = "reuser";
    ca.id_len = 6;
    ca.model = "pfm";
    ca.prefix_hashes = hs;
    ca.num_prefix_hashes = 2;
    ca.codecs = &vq;
    REQUIRE_RC(kvdepot_sequence_create(c, &ca, NULL), KVDEPOT_OK);
    kvdepot_read_args ra;
    memset(&ra, 0, sizeof ra);
    ra.num_tokens = SEALED;
    kvdepot_read_result a, b;
    ra.id = "owner";
    ra.id_len = 5;
    REQUIRE_RC(kvdepot_sequence_read(c, &ra, &a), KVDEPOT_OK);
    ra.id = "reuser";
    ra.id_len = 6;
    REQUIRE_RC(kvdepot_sequence_read(c, &ra, &b), KVDEPOT_OK);
    CHECK(a.kv_bytes == b.kv_bytes && memcmp(a.k, b.k, a.kv_bytes) == 0 &&
          memcmp(a.v, b.v, a.kv_bytes) == 0);
    kvdepot_free(a.owned);
    kvdepot_free(b.owned);
    float *q = make_q(4);
    kvdepot_attend_query qs[2] = {{"owner", 5, q, HQ * D, 0, SEALED},
                                  {"reuser", 6, q, HQ * D, 0, SEALED}};
    kvdepot_attend_result r[2];
    REQUIRE_RC(kvdepot_attend(c, 1, 0, qs, 2, r), KVDEPOT_OK);
    CHECK(memcmp(r[0].output, r[1].output, sizeof(float) * HQ * D) == 0);
    CHECK(memcmp(r[0].lse, r[1].lse, sizeof(float) * HQ) == 0);
    kvdepot_attend_results_free(r, 2);
    free(q);
    kvdepot_close(c);
    return 0;
}

static const kvd_test tests[] = {
    {"vq", t_vq},
    {"svd", t_svd},
    {"append_pages", t_append_pages},
    {"errors", t_errors},
    {"prefix", t_prefix},
};

int main(int argc, char **argv)
{
    return harness_main(argc, argv, tests, sizeof tests / sizeof tests[0]);
}
