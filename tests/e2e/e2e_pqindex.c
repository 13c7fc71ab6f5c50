/*
 * The stored PQ index end to end (store/pqindex.h): through libkvdepot
 * against a real kvdepotd, with the centroids read from the server's data
 * directory while it is stopped (kvd_store_pq_centroids_get).
 *
 *   stored   Search equals a brute-force scan of the stored codes (the PQ
 *            sections of the pages READ_FORMAT_PAGES returns, the raw tail
 *            encoded with the stored centroids), bit for bit, before and
 *            after a restart; the codes equal the keys as appended encoded
 *            with the stored centroids; a later append codes its pages with
 *            the same centroids; SparseAttend equals attention over Search's
 *            tokens; delete removes the centroids.
 *   pages    AppendPages of pages carrying PQ sections (read from another
 *            sequence): the server writes its own; malformed sections are
 *            DATA_LOSS and change nothing.
 *   errors   k larger than the range, no PQ index, bad ranges.
 *   chunked  the same prefill appended whole and in chunks of 4096, 300 and
 *            1 tokens: the same centroids, Search answers and recall
 *            (pq.min_train_tokens); trained at the first sealing append,
 *            300-token chunks give other centroids.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "harness.h"
#include "kvdepot/attention.h"
#include "kvdepot/pq.h"
#include "page.h"
#include "pqindex.h"
#include "store.h"

#define L 2
#define H 2
#define HQ 4
#define D 64
#define M 8
#define NB 6
#define ITERS 5
#define PT 256 /* the server's default page size */
#define CPH (M * (1 << NB) * (D / M))

/* Key or value (part 0/1) of (layer, token, head, dim): [-2, 2) from a hash. */
static float val(int part, uint32_t l, uint64_t t, uint32_t h, uint32_t d)
{
    uint64_t x = (((uint64_t)part * 31 + l) * 1000003 + t) * 131 + h * 37 + d + 7;
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ull;
    x ^= x >> 33;
    return (float)(x & 0xffffff) / (float)(1 << 24) * 4.0f - 2.0f;
}

static float key(uint32_t l, uint64_t t, uint32_t h, uint32_t d)
{
    return kvd_f16_to_f32(kvd_f32_to_f16(val(0, l, t, h, d)));
}

static int put_model(kvdepot_client *c)
{
    kvdepot_model m;
    memset(&m, 0, sizeof m);
    snprintf(m.name, sizeof m.name, "pqi");
    m.num_layers = L;
    m.num_kv_heads = H;
    m.num_q_heads = HQ;
    m.head_dim = D;
    m.dtype = KVDEPOT_DTYPE_F16;
    return kvdepot_model_put(c, &m, 0, NULL, NULL);
}

/* pq: 0 no index, 1 index with K INT4, 2 index with raw K and V. */
static int create(kvdepot_client *c, const char *id, int pq)
{
    kvdepot_codecs cs;
    memset(&cs, 0, sizeof cs);
    cs.k.codec = pq == 2 ? KVDEPOT_CODEC_RAW : KVDEPOT_CODEC_INT4;
    cs.pq_m = pq ? M : 0;
    cs.pq_bits = NB;
    cs.pq_iterations = ITERS;
    cs.pq_min_train_tokens = 1; /* trained at the first sealing append */
    kvdepot_create_args ca;
    memset(&ca, 0, sizeof ca);
    ca.id = id;
    ca.id_len = strlen(id);
    ca.model = "pqi";
    ca.codecs = &cs;
    return kvdepot_sequence_create(c, &ca, NULL);
}

typedef float (*key_fn)(uint32_t l, uint64_t t, uint32_t h, uint32_t d);

/* Append tokens [t0, t0 + n) of every layer in one call; keys and values
 * of sequence `salt` (0 for all but the prefix test), or keys kf (then
 * values of salt 0), with token ids. */
static int append_keys(kvdepot_client *c, const char *id, uint64_t t0, uint64_t n, int salt,
                       key_fn kf)
{
    size_t cnt = (size_t)L * n * H * D, i = 0;
    uint16_t *k = malloc(cnt * 2), *v = malloc(cnt * 2);
    for (uint32_t l = 0; l < L; l++)
        for (uint64_t t = t0; t < t0 + n; t++)
            for (uint32_t h = 0; h < H; h++)
                for (uint32_t d = 0; d < D; d++, i++) {
                    k[i] = kvd_f32_to_f16(kf ? kf(l, t, h, d) : val(2 * salt, l, t, h, d));
                    v[i] = kvd_f32_to_f16(val(2 * salt + 1, l, t, h, d));
                }
    kvdepot_append_args aa;
    memset(&aa, 0, sizeof aa);
    aa.id = id;
    aa.id_len = strlen(id);
    aa.token_start = t0;
    aa.num_tokens = n;
    aa.dtype = KVDEPOT_DTYPE_F16;
    aa.k = k;
    aa.v = v;
    aa.k_bytes = aa.v_bytes = cnt * 2;
    uint32_t *ids = malloc(sizeof(uint32_t) * n);
    for (uint64_t t = 0; t < n; t++)
        ids[t] = (uint32_t)(t0 + t + 100000u * (uint32_t)salt);
    aa.token_ids = ids;
    aa.num_token_ids = n;
    int rc = kvdepot_sequence_append(c, &aa, NULL);
    free(ids);
    free(k);
    free(v);
    return rc;
}

static int append_salted(kvdepot_client *c, const char *id, uint64_t t0, uint64_t n, int salt)
{
    return append_keys(c, id, t0, n, salt, NULL);
}

static int append(kvdepot_client *c, const char *id, uint64_t t0, uint64_t n)
{
    return append_salted(c, id, t0, n, 0);
}

/* The stored centroids of (id, layer), read from the stopped server's data
 * directory. Returns 1 found, 0 none, -1 error. */
static int centroids(kvd_harness *h, const char *id, uint32_t layer, kvd_pq_centroids *c)
{
    kvd_store_options o = {.data_dir = h->data_dir};
    kvd_store *st;
    kvd_error err;
    if (kvd_store_open(&o, &st, &err)) {
        fprintf(stderr, "open %s: %s\n", h->data_dir, err.msg);
        return -1;
    }
    int found = 0;
    int rc = kvd_store_pq_centroids_get(st, id, strlen(id), layer, c, &found, &err);
    if (rc)
        fprintf(stderr, "centroids: %s\n", err.msg);
    kvd_store_close(st);
    return rc ? -1 : found;
}

/*
 * Codes (H, n, M) of tokens [0, n) of `layer` as the server's index holds
 * them: the PQ sections of the sealed pages READ_FORMAT_PAGES returns (each
 * checked to carry centroids `c` and to equal the keys as appended encoded
 * with them), the tail encoded with c. Returns 0 or -1.
 */
static int stored_codes(kvdepot_client *cl, const char *id, uint32_t layer, uint64_t n,
                        const kvd_pq_centroids *c, uint8_t *codes)
{
    kvdepot_read_args rd;
    memset(&rd, 0, sizeof rd);
    rd.id = id;
    rd.id_len = strlen(id);
    rd.layer_start = layer;
    rd.num_layers = 1;
    kvdepot_page *pages = NULL;
    size_t np = 0;
    int rc = kvdepot_sequence_read_pages(cl, &rd, &pages, &np);
    if (rc) {
        fprintf(stderr, "read pages: %s\n", kvdepot_errmsg(NULL));
        return -1;
    }
    int bad = 0;
    uint64_t sealed = 0;
    float *keys = malloc(sizeof(float) * n * D);
    uint8_t *want = malloc((size_t)PT * M);
    for (size_t i = 0; i < np; i++) {
        kvd_page_view v;
        kvd_error err;
        if (kvd_page_decode(pages[i].data, pages[i].len, &v, &err)) {
            fprintf(stderr, "page %zu: %s\n", i, err.msg);
            bad++;
            continue;
        }
        kvd_page_pq pq;
        int has = kvd_page_pq_get(&v, &pq);
        if (v.h.num_tokens != PT) {
            bad += has; /* a partial page has no codes */
            continue;
        }
        if (!has || pq.centroids_id != c->id || pq.m != M || pq.bits != NB ||
            v.h.k_codec != KVD_CODEC_INT4) {
            fprintf(stderr, "page %llu: section %d, centroids %016llx (stored %016llx)\n",
                    (unsigned long long)v.h.token_start, has, (unsigned long long)pq.centroids_id,
                    (unsigned long long)c->id);
            bad++;
            continue;
        }
        uint64_t t0 = v.h.token_start;
        for (uint32_t hh = 0; hh < H; hh++) {
            for (uint64_t t = 0; t < PT; t++)
                for (uint32_t d = 0; d < D; d++)
                    keys[t * D + d] = key(layer, t0 + t, hh, d);
            kvd_pq_encode_ref(PT, M, NB, D, keys, c->data + (size_t)hh * CPH, want);
            if (memcmp(want, pq.codes + (size_t)hh * PT * M, (size_t)PT * M)) {
                fprintf(stderr, "page %llu head %u: codes differ from re-encoding\n",
                        (unsigned long long)t0, hh);
                bad++;
            }
            memcpy(codes + ((size_t)hh * n + t0) * M, pq.codes + (size_t)hh * PT * M,
                   (size_t)PT * M);
        }
        sealed = t0 + PT > sealed ? t0 + PT : sealed;
    }
    /* The raw tail, encoded with the stored centroids. */
    if (sealed < n)
        for (uint32_t hh = 0; hh < H; hh++) {
            for (uint64_t t = sealed; t < n; t++)
                for (uint32_t d = 0; d < D; d++)
                    keys[(t - sealed) * D + d] = key(layer, t, hh, d);
            kvd_pq_encode_ref((int64_t)(n - sealed), M, NB, D, keys, c->data + (size_t)hh * CPH,
                              codes + ((size_t)hh * n + sealed) * M);
        }
    if (sealed != n / PT * PT) {
        fprintf(stderr, "sealed pages cover %llu tokens, want %llu\n", (unsigned long long)sealed,
                (unsigned long long)(n / PT * PT));
        bad++;
    }
    free(keys);
    free(want);
    kvdepot_pages_free(pages, np);
    return bad ? -1 : 0;
}

/* Search of [t0, t0 + nt) equals the reference scan of the codes, exactly. */
static int check_search(kvdepot_client *cl, const char *id, uint32_t layer, const float *q,
                        uint64_t t0, uint64_t nt, uint32_t k, uint32_t init, uint32_t recent,
                        uint64_t n, const uint8_t *codes, const kvd_pq_centroids *c)
{
    kvdepot_search_args sa = {id, strlen(id), layer, q, HQ * D, k, init, recent, t0, nt};
    kvdepot_search_result sr;
    int rc = kvdepot_search(cl, &sa, &sr);
    if (rc) {
        fprintf(stderr, "search: %s\n", kvdepot_errmsg(NULL));
        return -1;
    }
    uint64_t span = nt ? nt : n - t0;
    kvd_pq_search_params sp = {k, init, recent, KVD_PQ_AGG_SUM};
    int64_t cap = kvd_pq_search_count((int64_t)span, &sp);
    uint32_t *idx = malloc(sizeof(uint32_t) * (size_t)(cap ? cap : 1));
    float *sc = malloc(sizeof(float) * (size_t)(cap ? cap : 1));
    uint8_t *hc = malloc(span * M);
    int bad = sr.num_heads != H;
    for (uint32_t hh = 0; hh < H && hh < sr.num_heads; hh++) {
        memcpy(hc, codes + ((size_t)hh * n + t0) * M, span * M);
        int64_t nout = 0;
        if (kvd_pq_search_ref((int64_t)span, M, NB, D, c->data + (size_t)hh * CPH, hc, HQ / H,
                              q + (size_t)hh * (HQ / H) * D, &sp, idx, sc, &nout)) {
            bad++;
            break;
        }
        const kvdepot_head_tokens *ht = &sr.heads[hh];
        if (ht->count != (size_t)nout) {
            fprintf(stderr, "head %u: %zu entries, brute force %lld\n", hh, ht->count,
                    (long long)nout);
            bad++;
            continue;
        }
        for (int64_t i = 0; i < nout; i++)
            if (ht->tokens[i] != t0 + idx[i] || memcmp(&ht->scores[i], &sc[i], 4)) {
                fprintf(stderr, "head %u entry %lld: token %llu score %g, brute force %llu %g\n",
                        hh, (long long)i, (unsigned long long)ht->tokens[i], ht->scores[i],
                        (unsigned long long)(t0 + idx[i]), sc[i]);
                bad++;
                break;
            }
    }
    free(idx);
    free(sc);
    free(hc);
    kvdepot_search_result_free(&sr);
    return bad ? -1 : 0;
}

/* SparseAttend of `sa` (over all n tokens) equals attention over Search's
 * tokens `sr`, computed here on the K/V read back. */
static int check_sparse(kvdepot_client *c, kvd_backend *be, const kvdepot_search_args *sa,
                        uint64_t n, const kvdepot_search_result *sr)
{
    kvdepot_attend_result ar;
    kvdepot_search_result st;
    REQUIRE_RC(kvdepot_sparse_attend(c, sa, 0, &ar, &st), KVDEPOT_OK);
    REQUIRE(st.num_heads == H && sr->num_heads == H);
    CHECK(st.heads[0].count == sr->heads[0].count);
    kvdepot_read_args ra;
    memset(&ra, 0, sizeof ra);
    ra.id = sa->id;
    ra.id_len = sa->id_len;
    ra.layer_start = sa->layer;
    ra.num_layers = 1;
    kvdepot_read_result rr;
    REQUIRE_RC(kvdepot_sequence_read(c, &ra, &rr), KVDEPOT_OK);
    int64_t per = (int64_t)st.heads[0].count;
    int32_t *idx = malloc(sizeof(int32_t) * H * (size_t)(per ? per : 1));
    for (int hh = 0; hh < H; hh++)
        for (int64_t i = 0; i < per; i++) {
            idx[hh * per + i] = (int32_t)st.heads[hh].tokens[i];
            CHECK(st.heads[hh].tokens[i] == sr->heads[hh].tokens[i]);
        }
    float out[HQ * D], lse[HQ];
    kvd_attn_sparse_args a;
    memset(&a, 0, sizeof a);
    a.dims = (kvd_attn_dims){HQ, H, D, D, 1.0f / sqrtf((float)D)};
    int64_t qs[2] = {HQ, D}, ls[1] = {HQ}, ks[3] = {H, (int64_t)n, D}, is[2] = {H, per};
    a.q = kvd_tensor_make(KVD_DTYPE_F32, (void *)sa->q, 2, qs);
    a.k = kvd_tensor_make(KVD_DTYPE_F16, rr.k, 3, ks);
    a.k.stride[0] = D * 2;
    a.k.stride[1] = H * D * 2;
    a.k.stride[2] = 2;
    a.v = a.k;
    a.v.data = rr.v;
    a.idx = kvd_tensor_make(KVD_DTYPE_I32, idx, 2, is);
    a.out = kvd_tensor_make(KVD_DTYPE_F32, out, 2, qs);
    a.lse = kvd_tensor_make(KVD_DTYPE_F32, lse, 1, ls);
    REQUIRE(kvd_attn_sparse(be, 1, &a, NULL) == 0);
    double num = 0, den = 0;
    for (int i = 0; i < HQ * D; i++) {
        num += (double)(ar.output[i] - out[i]) * (ar.output[i] - out[i]);
        den += (double)out[i] * out[i];
    }
    int bad = !(num <= 1e-10 * den) || ar.num_tokens != (uint64_t)per;
    for (int i = 0; i < HQ; i++)
        bad += !(ar.lse[i] == lse[i] ||
                 fabsf(ar.lse[i] - lse[i]) <= 1e-5f * fmaxf(1.0f, fabsf(lse[i])));
    if (bad)
        fprintf(stderr, "sparse attend of %s: output NMSE %g, %llu tokens\n", (const char *)sa->id,
                den > 0 ? num / den : num, (unsigned long long)ar.num_tokens);
    free(idx);
    kvdepot_free(rr.owned);
    kvdepot_attend_results_free(&ar, 1);
    kvdepot_search_result_free(&st);
    return bad ? -1 : 0;
}

static float *make_q(uint64_t seed)
{
    float *q = malloc(sizeof(float) * HQ * D);
    for (int i = 0; i < HQ * D; i++)
        q[i] = 3.0f * val(1, 77, seed, 0, (uint32_t)i);
    return q;
}

/* Squared error of n keys (n, D) quantized with one head's centroids
 * (M, 2^NB, D/M): every sub-vector to its nearest centroid. */
static double pq_inertia(const float *keys, uint64_t n, const float *cent)
{
    const uint32_t ds = D / M, K = 1u << NB;
    double sum = 0;
    for (uint64_t t = 0; t < n; t++)
        for (uint32_t j = 0; j < M; j++) {
            double best = INFINITY;
            for (uint32_t k = 0; k < K; k++) {
                double e = 0;
                for (uint32_t i = 0; i < ds; i++) {
                    double x = keys[t * D + j * ds + i] - cent[((size_t)j * K + k) * ds + i];
                    e += x * x;
                }
                best = e < best ? e : best;
            }
            sum += best;
        }
    return sum;
}

/* The sequence's PQ index bytes and stored bytes, and the disk tier's bytes;
 * pages: the bytes of the pages of every layer as READ_FORMAT_PAGES returns
 * them. */
static int index_bytes(kvdepot_client *c, const char *id, uint64_t *pq, uint64_t *stored,
                       uint64_t *pages, uint64_t *disk)
{
    kvdepot_sequence_info info;
    kvdepot_stats st;
    if (kvdepot_sequence_stat(c, id, strlen(id), &info) || kvdepot_stats_get(c, &st))
        return -1;
    *pq = info.pq_index_bytes;
    *stored = info.stored_bytes;
    *disk = st.tiers[2].bytes;
    kvdepot_sequence_info_clear(&info);
    *pages = 0;
    for (uint32_t l = 0; l < L; l++) {
        kvdepot_read_args rd = {.id = id, .id_len = strlen(id), .layer_start = l, .num_layers = 1};
        kvdepot_page *pg = NULL;
        size_t np = 0;
        if (kvdepot_sequence_read_pages(c, &rd, &pg, &np))
            return -1;
        for (size_t i = 0; i < np; i++)
            *pages += pg[i].len;
        kvdepot_pages_free(pg, np);
    }
    return 0;
}

static int t_stored(kvd_harness *h)
{
    kvdepot_client *c = harness_client(h);
    REQUIRE(c);
    REQUIRE_RC(put_model(c), KVDEPOT_OK);
    REQUIRE_RC(create(c, "s", 1), KVDEPOT_OK);
    const char *dev = getenv("KVDEPOT_DEVICE");
    const int on_gpu = dev && strncmp(dev, "cuda", 4) == 0;
    const uint64_t n = 600; /* two sealed pages and a raw tail */
    /* The centroid records (one per layer) count in stored_bytes and on
     * disk once the first pages seal, and not before. */
    const uint64_t rec = 12 + 4ull * H * (1u << NB) * D;
    uint64_t pq0, stored0, pages0, disk0, pq1, stored1, pages1, disk1;
    REQUIRE_RC(append(c, "s", 0, 100), KVDEPOT_OK);
    REQUIRE(index_bytes(c, "s", &pq0, &stored0, &pages0, &disk0) == 0);
    REQUIRE_RC(append(c, "s", 100, n - 100), KVDEPOT_OK);
    REQUIRE(index_bytes(c, "s", &pq1, &stored1, &pages1, &disk1) == 0);
    printf("PQ index %llu bytes (%llu before the first page sealed), stored %llu, pages %llu, "
           "disk %llu -> %llu\n",
           (unsigned long long)pq1, (unsigned long long)pq0, (unsigned long long)stored1,
           (unsigned long long)pages1, (unsigned long long)disk0, (unsigned long long)disk1);
    CHECK(pq0 == 0 && pq1 == L * rec);
    CHECK(stored0 == pages0 && stored1 == pages1 + pq1);
    CHECK(disk1 - disk0 == stored1 - stored0);
    float *q = make_q(1);
    kvdepot_search_args sa = {"s", 1, 1, q, HQ * D, 20, 4, 16, 0, 0};
    kvdepot_search_result before;
    REQUIRE_RC(kvdepot_search(c, &sa, &before), KVDEPOT_OK);
    kvdepot_close(c);

    /* The centroids are on disk, trained from the keys as appended. */
    REQUIRE(harness_stop(h) == 0);
    kvd_pq_centroids cent[L];
    for (uint32_t l = 0; l < L; l++)
        REQUIRE(centroids(h, "s", l, &cent[l]) == 1);
    kvd_backend *be = NULL;
    kvd_cpu_options opt = {1, 0, 0, 0};
    REQUIRE(kvd_backend_cpu_create(&opt, &be, NULL) == 0);
    float *keys = malloc(sizeof(float) * n * D), *want = malloc(sizeof(float) * CPH);
    for (uint32_t hh = 0; hh < H; hh++) {
        for (uint64_t t = 0; t < n; t++)
            for (uint32_t d = 0; d < D; d++)
                keys[t * D + d] = key(1, t, hh, d);
        REQUIRE(kvd_pq_train_head(be, keys, (int64_t)n, D, M, NB, ITERS, 1, hh, want, NULL) == 0);
        if (!on_gpu) {
            CHECK(memcmp(want, cent[1].data + (size_t)hh * CPH, sizeof(float) * CPH) == 0);
            continue;
        }
        /* The GPU's K-means draws its own seeds: other centroids, as good. */
        double cpu = pq_inertia(keys, n, want),
               gpu = pq_inertia(keys, n, cent[1].data + (size_t)hh * CPH);
        printf("head %u: inertia of the centroids trained on the GPU %.4g, on the CPU %.4g\n", hh,
               gpu, cpu);
        CHECK(gpu <= 1.1 * cpu);
    }
    free(keys);
    free(want);
    REQUIRE(harness_start(h) == 0);
    c = harness_client(h);
    REQUIRE(c);
    {
        /* counted again at open, from the records on disk */
        uint64_t pq2, stored2, pages2, disk2;
        REQUIRE(index_bytes(c, "s", &pq2, &stored2, &pages2, &disk2) == 0);
        CHECK(pq2 == pq1 && stored2 == stored1 && disk2 == disk1);
    }

    /* After the restart: the same answer, equal to brute force over the
     * stored codes. */
    kvdepot_search_result after;
    REQUIRE_RC(kvdepot_search(c, &sa, &after), KVDEPOT_OK);
    CHECK(after.num_heads == before.num_heads);
    for (size_t hh = 0; hh < after.num_heads && hh < before.num_heads; hh++)
        CHECK(after.heads[hh].count == before.heads[hh].count &&
              memcmp(after.heads[hh].tokens, before.heads[hh].tokens,
                     sizeof(uint64_t) * after.heads[hh].count) == 0);
    kvdepot_search_result_free(&before);
    /* GetPQCentroids hands out exactly the stored centroids; with them and
     * the pages a client reproduces Search (below, through rpc[1]). */
    kvd_pq_centroids rpc[L];
    for (uint32_t l = 0; l < L; l++) {
        kvdepot_pq_centroids pc;
        REQUIRE_RC(kvdepot_pq_centroids_get(c, "s", 1, l, &pc), KVDEPOT_OK);
        CHECK(pc.layer == l && pc.num_kv_heads == H && pc.head_dim == D && pc.m == M &&
              pc.bits == NB && pc.centroids_id == cent[l].id && pc.count == (size_t)H * CPH &&
              memcmp(pc.data, cent[l].data, sizeof(float) * H * CPH) == 0);
        rpc[l] = (kvd_pq_centroids){pc.num_kv_heads, pc.head_dim,     pc.m,
                                    pc.bits,         pc.centroids_id, pc.data};
    }
    uint8_t *codes = malloc((size_t)H * (n + 300) * M);
    REQUIRE(stored_codes(c, "s", 1, n, &rpc[1], codes) == 0);
    CHECK(check_search(c, "s", 1, q, 0, 0, 20, 4, 16, n, codes, &rpc[1]) == 0);
    CHECK(check_search(c, "s", 1, q, 100, 450, 7, 0, 0, n, codes, &cent[1]) == 0);
    CHECK(check_search(c, "s", 1, q, 300, 0, 300, 0, 0, n, codes, &cent[1]) == 0);
    CHECK(check_search(c, "s", 1, q, 512, 88, 5, 2, 3, n, codes, &cent[1]) == 0); /* tail only */
    REQUIRE(stored_codes(c, "s", 0, n, &cent[0], codes) == 0);
    CHECK(check_search(c, "s", 0, q, 0, 0, 50, 0, 8, n, codes, &cent[0]) == 0);
    for (uint32_t l = 0; l < L; l++)
        kvd_pq_centroids_clear(&rpc[l]);

    CHECK(check_sparse(c, be, &sa, n, &after) == 0);
    kvdepot_search_result_free(&after);

    /* More tokens: the new pages use the same centroids. */
    REQUIRE_RC(append(c, "s", n, 300), KVDEPOT_OK);
    REQUIRE(stored_codes(c, "s", 1, n + 300, &cent[1], codes) == 0);
    CHECK(check_search(c, "s", 1, q, 0, 0, 40, 4, 16, n + 300, codes, &cent[1]) == 0);
    kvdepot_close(c);
    REQUIRE(harness_stop(h) == 0);
    kvd_pq_centroids again;
    REQUIRE(centroids(h, "s", 1, &again) == 1);
    CHECK(again.id == cent[1].id);
    kvd_pq_centroids_clear(&again);
    REQUIRE(harness_start(h) == 0);

    /* Delete removes them, and the disk bytes they counted. */
    c = harness_client(h);
    REQUIRE(c);
    REQUIRE_RC(kvdepot_sequence_delete(c, "s", 1, NULL), KVDEPOT_OK);
    {
        kvdepot_stats st;
        REQUIRE_RC(kvdepot_stats_get(c, &st), KVDEPOT_OK);
        CHECK(st.tiers[2].bytes == disk0 - stored0);
    }
    kvdepot_close(c);
    REQUIRE(harness_stop(h) == 0);
    for (uint32_t l = 0; l < L; l++) {
        CHECK(centroids(h, "s", l, &again) == 0);
        kvd_pq_centroids_clear(&cent[l]);
    }
    free(codes);
    free(q);
    kvd_backend_free(be);
    return 0;
}

static int t_pages(kvd_harness *h)
{
    kvdepot_client *c = harness_client(h);
    REQUIRE(c);
    REQUIRE_RC(put_model(c), KVDEPOT_OK);
    REQUIRE_RC(create(c, "src", 1), KVDEPOT_OK);
    REQUIRE_RC(append(c, "src", 0, 2 * PT + 10), KVDEPOT_OK);
    kvdepot_read_args rd;
    memset(&rd, 0, sizeof rd);
    rd.id = "src";
    rd.id_len = 3;
    kvdepot_page *pages = NULL;
    size_t np = 0;
    REQUIRE_RC(kvdepot_sequence_read_pages(c, &rd, &pages, &np), KVDEPOT_OK);
    REQUIRE(np == 3 * L); /* per layer: 2 sealed pages and the tail */
    /* A malformed PQ section (a code out of range, checksum redone): the
     * page is rejected, nothing stored. */
    REQUIRE_RC(create(c, "dst", 1), KVDEPOT_OK);
    kvd_page_view v;
    REQUIRE(kvd_page_decode(pages[0].data, pages[0].len, &v, NULL) == 0 && v.pq);
    size_t off = (size_t)(v.pq - (const uint8_t *)pages[0].data) + KVD_PAGE_PQ_HEADER + 3;
    uint8_t keep = ((uint8_t *)pages[0].data)[off];
    ((uint8_t *)pages[0].data)[off] = 1 << NB;
    kvd_page_finish(pages[0].data, pages[0].len);
    kvdepot_sequence_info info;
    CHECK_RC(kvdepot_append_pages(c, "dst", 3, pages, np, &info), KVDEPOT_ECORRUPT);
    REQUIRE_RC(kvdepot_sequence_stat(c, "dst", 3, &info), KVDEPOT_OK);
    CHECK(info.num_tokens == 0);
    kvdepot_sequence_info_clear(&info);
    ((uint8_t *)pages[0].data)[off] = keep;
    kvd_page_finish(pages[0].data, pages[0].len);
    /* Valid pages with the source's sections: stored with the server's
     * codes of "dst" (trained from the keys it received), searchable. */
    REQUIRE_RC(kvdepot_append_pages(c, "dst", 3, pages, np, &info), KVDEPOT_OK);
    CHECK(info.num_tokens == 2 * PT + 10);
    kvdepot_sequence_info_clear(&info);
    kvdepot_pages_free(pages, np);
    /* A sequence without a PQ index takes them as they are. */
    REQUIRE_RC(create(c, "plain", 0), KVDEPOT_OK);
    REQUIRE_RC(kvdepot_sequence_read_pages(c, &rd, &pages, &np), KVDEPOT_OK);
    CHECK_RC(kvdepot_append_pages(c, "plain", 5, pages, np, NULL), KVDEPOT_OK);
    kvdepot_pages_free(pages, np);
    float *q = make_q(2);
    kvdepot_search_args sa = {"dst", 3, 0, q, HQ * D, 10, 0, 0, 0, 0};
    kvdepot_search_result sr;
    REQUIRE_RC(kvdepot_search(c, &sa, &sr), KVDEPOT_OK);
    kvdepot_search_result_free(&sr);
    rd.id = "dst";
    REQUIRE_RC(kvdepot_sequence_read_pages(c, &rd, &pages, &np), KVDEPOT_OK);
    kvdepot_close(c);
    REQUIRE(harness_stop(h) == 0);
    kvd_pq_centroids src, dst;
    REQUIRE(centroids(h, "src", 0, &src) == 1 && centroids(h, "dst", 0, &dst) == 1);
    kvd_pq_centroids none;
    CHECK(centroids(h, "plain", 0, &none) == 0);
    REQUIRE(kvd_page_decode(pages[0].data, pages[0].len, &v, NULL) == 0);
    kvd_page_pq pq;
    CHECK(kvd_page_pq_get(&v, &pq) == 1 && pq.centroids_id == dst.id && pq.centroids_id != src.id);
    kvd_pq_centroids_clear(&src);
    kvd_pq_centroids_clear(&dst);
    kvdepot_pages_free(pages, np);
    free(q);
    return 0;
}

/* Raw pages: SparseAttend reads the selected tokens in place from the
 * pinned pages; coded (INT4) ones through the cursor; both equal attention
 * over Search's tokens, over ranges that start and end inside pages. Served
 * from a GPU (KVDEPOT_DEVICE=cuda), the raw pages' rows are gathered where
 * they lie in its memory and the attention runs there. */
static int t_sparse(kvd_harness *h)
{
    kvdepot_client *c = harness_client(h);
    REQUIRE(c);
    REQUIRE_RC(put_model(c), KVDEPOT_OK);
    kvd_backend *be = NULL;
    kvd_cpu_options opt = {1, 0, 0, 0};
    REQUIRE(kvd_backend_cpu_create(&opt, &be, NULL) == 0);
    const uint64_t n = 3 * PT + 40;
    float *q = make_q(4);
    const char *ids[2] = {"raw", "int4"};
    const char *dev = getenv("KVDEPOT_DEVICE");
    const int on_gpu = dev && strncmp(dev, "cuda", 4) == 0;
    for (int s = 0; s < 2; s++) {
        REQUIRE_RC(create(c, ids[s], s == 0 ? 2 : 1), KVDEPOT_OK);
        REQUIRE_RC(append(c, ids[s], 0, n), KVDEPOT_OK);
        if (s == 0) {
            /* Read (decoded) is unaffected by the PQ sections. */
            kvdepot_read_args ra;
            memset(&ra, 0, sizeof ra);
            ra.id = ids[s];
            ra.id_len = strlen(ids[s]);
            kvdepot_read_result rr;
            REQUIRE_RC(kvdepot_sequence_read(c, &ra, &rr), KVDEPOT_OK);
            const uint16_t *rk = rr.k, *rv = rr.v;
            size_t i = 0, bad = 0;
            for (uint32_t l = 0; l < L; l++)
                for (uint64_t t = 0; t < n; t++)
                    for (uint32_t hh = 0; hh < H; hh++)
                        for (uint32_t d = 0; d < D; d++, i++)
                            bad += rk[i] != kvd_f32_to_f16(val(0, l, t, hh, d)) ||
                                   rv[i] != kvd_f32_to_f16(val(1, l, t, hh, d));
            CHECK(bad == 0);
            kvdepot_free(rr.owned);
        }
        const struct {
            uint64_t t0, nt;
            uint32_t k, init, recent;
        } cases[] = {{0, 0, 64, 4, 16}, {100, 600, 30, 2, 2}, {0, 0, 0, 0, 0}, {700, 0, 3, 1, 1}};
        kvdepot_stats st0, st1;
        REQUIRE_RC(kvdepot_stats_get(c, &st0), KVDEPOT_OK);
        for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ci++) {
            kvdepot_search_args sa = {ids[s],
                                      strlen(ids[s]),
                                      1,
                                      q,
                                      HQ * D,
                                      cases[ci].k,
                                      cases[ci].init,
                                      cases[ci].recent,
                                      cases[ci].t0,
                                      cases[ci].nt};
            kvdepot_search_result sr;
            REQUIRE_RC(kvdepot_search(c, &sa, &sr), KVDEPOT_OK);
            CHECK(check_sparse(c, be, &sa, n, &sr) == 0);
            kvdepot_search_result_free(&sr);
        }
        REQUIRE_RC(kvdepot_stats_get(c, &st1), KVDEPOT_OK);
        uint64_t dp = st1.device_pages_attended - st0.device_pages_attended;
        printf("%s: %llu pages read on the device\n", ids[s], (unsigned long long)dp);
        if (on_gpu)
            CHECK(s == 0 ? dp > 0 : dp == 0);
        if (dev && strcmp(dev, "cpu") == 0)
            CHECK(dp == 0);
    }
    free(q);
    kvd_backend_free(be);
    kvdepot_close(c);
    return 0;
}

/* A sequence created from another's prefix: the shared pages carry the
 * other's codes; Search encodes them with the new sequence's own centroids
 * (trained at its first sealing append) and equals brute force over that. */
static int t_prefix(kvd_harness *h)
{
    kvdepot_client *c = harness_client(h);
    REQUIRE(c);
    REQUIRE_RC(put_model(c), KVDEPOT_OK);
    REQUIRE_RC(create(c, "p", 2), KVDEPOT_OK);
    REQUIRE_RC(append(c, "p", 0, 2 * PT + 30), KVDEPOT_OK);
    kvdepot_sequence_info info;
    REQUIRE_RC(kvdepot_sequence_stat(c, "p", 1, &info), KVDEPOT_OK);
    REQUIRE(info.num_block_hashes >= 2);
    kvdepot_codecs cs;
    memset(&cs, 0, sizeof cs);
    cs.pq_m = M;
    cs.pq_bits = NB;
    cs.pq_iterations = ITERS;
    cs.pq_min_train_tokens = 1; /* trained at the first sealing append */
    kvdepot_create_args ca;
    memset(&ca, 0, sizeof ca);
    ca.id = "c";
    ca.id_len = 1;
    ca.model = "pqi";
    ca.codecs = &cs;
    ca.prefix_hashes = info.block_hashes;
    ca.num_prefix_hashes = 2;
    REQUIRE_RC(kvdepot_sequence_create(c, &ca, NULL), KVDEPOT_OK);
    kvdepot_sequence_info_clear(&info);
    const uint64_t n = 2 * PT + PT + 50; /* own block 2 seals, a tail */
    REQUIRE_RC(append_salted(c, "c", 2 * PT, n - 2 * PT, 1), KVDEPOT_OK);
    float *q = make_q(5);
    kvdepot_search_args sa = {"c", 1, 1, q, HQ * D, 25, 3, 9, 0, 0};
    kvdepot_search_result sr;
    REQUIRE_RC(kvdepot_search(c, &sa, &sr), KVDEPOT_OK);
    kvdepot_close(c);
    REQUIRE(harness_stop(h) == 0);
    kvd_pq_centroids pc, cc;
    REQUIRE(centroids(h, "p", 1, &pc) == 1 && centroids(h, "c", 1, &cc) == 1);
    CHECK(pc.id != cc.id);
    REQUIRE(harness_start(h) == 0);
    c = harness_client(h);
    REQUIRE(c);
    /* Brute force: every key of "c" (the prefix's, then its own) encoded
     * with the centroids of "c". */
    uint8_t *codes = malloc((size_t)H * n * M);
    float *keys = malloc(sizeof(float) * n * D);
    for (uint32_t hh = 0; hh < H; hh++) {
        for (uint64_t t = 0; t < n; t++)
            for (uint32_t d = 0; d < D; d++)
                keys[t * D + d] =
                    kvd_f16_to_f32(kvd_f32_to_f16(val(t < 2 * PT ? 0 : 2, 1, t, hh, d)));
        kvd_pq_encode_ref((int64_t)n, M, NB, D, keys, cc.data + (size_t)hh * CPH,
                          codes + (size_t)hh * n * M);
    }
    CHECK(check_search(c, "c", 1, q, 0, 0, 25, 3, 9, n, codes, &cc) == 0);
    CHECK(check_search(c, "c", 1, q, 200, 400, 10, 0, 0, n, codes, &cc) == 0);
    /* The shared pages still index the centroids of "p". */
    kvdepot_read_args rd;
    memset(&rd, 0, sizeof rd);
    rd.id = "c";
    rd.id_len = 1;
    rd.layer_start = 1;
    rd.num_layers = 1;
    kvdepot_page *pages = NULL;
    size_t np = 0;
    REQUIRE_RC(kvdepot_sequence_read_pages(c, &rd, &pages, &np), KVDEPOT_OK);
    REQUIRE(np == 4);
    for (size_t i = 0; i < 3; i++) {
        kvd_page_view v;
        kvd_page_pq pq;
        REQUIRE(kvd_page_decode(pages[i].data, pages[i].len, &v, NULL) == 0);
        CHECK(kvd_page_pq_get(&v, &pq) == 1 && pq.centroids_id == (i < 2 ? pc.id : cc.id));
    }
    kvdepot_pages_free(pages, np);
    kvdepot_search_result_free(&sr);
    kvd_pq_centroids_clear(&pc);
    kvd_pq_centroids_clear(&cc);
    free(codes);
    free(keys);
    free(q);
    kvdepot_close(c);
    return 0;
}

static int t_errors(kvd_harness *h)
{
    kvdepot_client *c = harness_client(h);
    REQUIRE(c);
    REQUIRE_RC(put_model(c), KVDEPOT_OK);
    REQUIRE_RC(create(c, "s", 1), KVDEPOT_OK);
    REQUIRE_RC(append(c, "s", 0, PT + 4), KVDEPOT_OK);
    float *q = make_q(3);
    kvdepot_search_result sr;
    kvdepot_attend_result ar;
    kvdepot_search_args sa = {"s", 1, 0, q, HQ * D, PT + 5, 0, 0, 0, 0};
    CHECK_RC(kvdepot_search(c, &sa, &sr), KVDEPOT_EINVAL); /* k > tokens */
    CHECK_RC(kvdepot_sparse_attend(c, &sa, 0, &ar, NULL), KVDEPOT_EINVAL);
    sa.k = 11;
    sa.token_start = 250;
    sa.num_tokens = 10;
    CHECK_RC(kvdepot_search(c, &sa, &sr), KVDEPOT_EINVAL); /* k > the range */
    sa.num_tokens = 20;
    CHECK_RC(kvdepot_search(c, &sa, &sr), KVDEPOT_ERANGE);
    sa.token_start = 0;
    sa.num_tokens = 0;
    sa.layer = L;
    CHECK_RC(kvdepot_search(c, &sa, &sr), KVDEPOT_EINVAL);
    sa.layer = 0;
    sa.q_len = D;
    CHECK_RC(kvdepot_search(c, &sa, &sr), KVDEPOT_EINVAL);
    sa.q_len = HQ * D;
    REQUIRE_RC(create(c, "plain", 0), KVDEPOT_OK);
    REQUIRE_RC(append(c, "plain", 0, PT), KVDEPOT_OK);
    sa.id = "plain";
    sa.id_len = 5;
    CHECK_RC(kvdepot_search(c, &sa, &sr), KVDEPOT_EPRECOND);
    /* GetPQCentroids: no index, a layer with no sealed page, a layer past
     * the model's, an unknown sequence */
    kvdepot_pq_centroids pc;
    CHECK_RC(kvdepot_pq_centroids_get(c, "plain", 5, 0, &pc), KVDEPOT_EPRECOND);
    REQUIRE_RC(create(c, "young", 1), KVDEPOT_OK);
    REQUIRE_RC(append(c, "young", 0, 10), KVDEPOT_OK);
    CHECK_RC(kvdepot_pq_centroids_get(c, "young", 5, 0, &pc), KVDEPOT_EPRECOND);
    CHECK(strstr(kvdepot_errmsg(c), "no PQ centroids yet") != NULL);
    CHECK_RC(kvdepot_pq_centroids_get(c, "s", 1, L, &pc), KVDEPOT_EINVAL);
    CHECK_RC(kvdepot_pq_centroids_get(c, "nope", 4, 0, &pc), KVDEPOT_ENOTFOUND);
    CHECK(pc.data == NULL && pc.count == 0);
    REQUIRE_RC(kvdepot_pq_centroids_get(c, "s", 1, 0, &pc), KVDEPOT_OK);
    CHECK(pc.count == (size_t)H * CPH && pc.data);
    kvdepot_pq_centroids_free(&pc);
    /* The failed calls changed nothing: the search still answers. */
    sa.id = "s";
    sa.id_len = 1;
    REQUIRE_RC(kvdepot_search(c, &sa, &sr), KVDEPOT_OK);
    CHECK(sr.num_heads == H && sr.heads[0].count == 11);
    kvdepot_search_result_free(&sr);
    free(q);
    kvdepot_close(c);
    return 0;
}

/*
 * Create `id` with a PQ index over raw K and V, trained at min_train tokens
 * (0 = the default), and append tokens [0, n) in chunks of `chunk`.
 */
static int chunked(kvdepot_client *c, const char *id, uint32_t min_train, uint64_t n,
                   uint64_t chunk)
{
    kvdepot_codecs cs;
    memset(&cs, 0, sizeof cs);
    cs.pq_m = M;
    cs.pq_bits = NB;
    cs.pq_iterations = ITERS;
    cs.pq_min_train_tokens = min_train;
    kvdepot_create_args ca;
    memset(&ca, 0, sizeof ca);
    ca.id = id;
    ca.id_len = strlen(id);
    ca.model = "pqi";
    ca.codecs = &cs;
    int rc = kvdepot_sequence_create(c, &ca, NULL);
    for (uint64_t t = 0; t < n && rc == 0; t += chunk)
        rc = append(c, id, t, n - t < chunk ? n - t : chunk);
    return rc;
}

/* Recall of Search's k tokens per kv head against the k best by the exact
 * score (the GQA group's summed query . key), averaged over heads. */
static double search_recall_of(kvdepot_client *c, const char *id, uint32_t layer, const float *q,
                               uint64_t n, uint32_t k, kvdepot_search_result *sr, key_fn kf)
{
    kvdepot_search_args sa = {id, strlen(id), layer, q, HQ * D, k, 0, 0, 0, 0};
    if (kvdepot_search(c, &sa, sr)) {
        fprintf(stderr, "search %s: %s\n", id, kvdepot_errmsg(NULL));
        return -1;
    }
    float *exact = malloc(sizeof(float) * n);
    double sum = 0;
    for (uint32_t hh = 0; hh < H && hh < sr->num_heads; hh++) {
        float qbar[D] = {0};
        for (int g = 0; g < HQ / H; g++)
            for (int d = 0; d < D; d++)
                qbar[d] += q[(hh * (HQ / H) + g) * D + d];
        for (uint64_t t = 0; t < n; t++) {
            float x = 0;
            for (uint32_t d = 0; d < D; d++)
                x += qbar[d] * kf(layer, t, hh, d);
            exact[t] = x;
        }
        /* the k-th best exact score: a token is among the k best if above */
        float *sorted = malloc(sizeof(float) * n);
        memcpy(sorted, exact, sizeof(float) * n);
        for (uint32_t i = 0; i < k; i++) { /* partial selection */
            uint64_t best = i;
            for (uint64_t t = i + 1; t < n; t++)
                if (sorted[t] > sorted[best])
                    best = t;
            float tmp = sorted[i];
            sorted[i] = sorted[best];
            sorted[best] = tmp;
        }
        const float kth = sorted[k - 1];
        free(sorted);
        uint32_t hit = 0;
        for (size_t i = 0; i < sr->heads[hh].count; i++)
            hit += exact[sr->heads[hh].tokens[i]] >= kth;
        sum += (double)hit / k;
    }
    free(exact);
    return sum / H;
}

static double search_recall(kvdepot_client *c, const char *id, uint32_t layer, const float *q,
                            uint64_t n, uint32_t k, kvdepot_search_result *sr)
{
    return search_recall_of(c, id, layer, q, n, k, sr, key);
}

/* Keys that drift: from token 4096 on, the first half of the dimensions
 * moves by +3 (f16-exact). */
#define DRIFT_AT 4096
static float drift_key(uint32_t l, uint64_t t, uint32_t h, uint32_t d)
{
    return kvd_f16_to_f32(
        kvd_f32_to_f16(val(0, l, t, h, d) + (t >= DRIFT_AT && d < D / 2 ? 3.0f : 0.0f)));
}

static int append_drift(kvdepot_client *c, const char *id, uint64_t t0, uint64_t n)
{
    return append_keys(c, id, t0, n, 0, drift_key);
}

/* RebuildPQIndex on a sequence whose keys drift after the 4096 the index was
 * trained on: recall rises; the centroids change; the index grows by the
 * codes of every sealed page; later appends code under the new centroids;
 * errors change nothing. */
static int t_rebuild(kvd_harness *h)
{
    kvdepot_client *c = harness_client(h);
    REQUIRE(c);
    REQUIRE_RC(put_model(c), KVDEPOT_OK);
    const uint64_t n = 3 * DRIFT_AT + 10;
    REQUIRE_RC(chunked(c, "drift", 0, 0, 1), KVDEPOT_OK); /* created, nothing appended */
    for (uint64_t t = 0; t < n; t += 2048)
        REQUIRE_RC(append_drift(c, "drift", t, n - t < 2048 ? n - t : 2048), KVDEPOT_OK);
    kvdepot_sequence_info before;
    REQUIRE_RC(kvdepot_sequence_stat(c, "drift", 5, &before), KVDEPOT_OK);
    kvdepot_pq_centroids c0;
    REQUIRE_RC(kvdepot_pq_centroids_get(c, "drift", 5, 0, &c0), KVDEPOT_OK);
    float *q = make_q(21);
    for (int i = 0; i < HQ * D; i++) /* a query that looks at the drifted half */
        if (i % D < D / 2)
            q[i] = fabsf(q[i]);
    const uint32_t k = 64;
    double r0[L], r1[L];
    kvdepot_search_result sr;
    for (uint32_t l = 0; l < L; l++) {
        REQUIRE((r0[l] = search_recall_of(c, "drift", l, q, n, k, &sr, drift_key)) >= 0);
        kvdepot_search_result_free(&sr);
    }
    uint32_t layers = 0;
    uint64_t tokens = 0;
    kvdepot_sequence_info after;
    REQUIRE_RC(kvdepot_pq_rebuild(c, "drift", 5, 0, 0, &layers, &tokens, &after), KVDEPOT_OK);
    const uint64_t sealed = n / PT * PT;
    CHECK(layers == L && tokens == L * sealed);
    /* per layer: the centroids and the codes of every sealed token (before:
     * of the 2048 sealed before the layer was trained) */
    const uint64_t rec = 12 + 4ull * H * (1u << NB) * D;
    CHECK(before.pq_index_bytes == L * (rec + 16 + (uint64_t)H * 2048 * M));
    CHECK(after.pq_index_bytes == L * (rec + 16 + (uint64_t)H * sealed * M));
    CHECK(after.stored_bytes - before.stored_bytes == after.pq_index_bytes - before.pq_index_bytes);
    kvdepot_pq_centroids c1;
    REQUIRE_RC(kvdepot_pq_centroids_get(c, "drift", 5, 0, &c1), KVDEPOT_OK);
    CHECK(c1.centroids_id != c0.centroids_id);
    for (uint32_t l = 0; l < L; l++) {
        REQUIRE((r1[l] = search_recall_of(c, "drift", l, q, n, k, &sr, drift_key)) >= 0);
        kvdepot_search_result_free(&sr);
        printf("layer %u: recall@%u of %llu drifting tokens: %.3f trained on the first 4096, "
               "%.3f rebuilt\n",
               l, k, (unsigned long long)n, r0[l], r1[l]);
        CHECK(r1[l] > r0[l] + 0.1);
    }
    /* later pages are coded under the new centroids: recall holds */
    REQUIRE_RC(append_drift(c, "drift", n, PT), KVDEPOT_OK);
    double r2 = search_recall_of(c, "drift", 0, q, n + PT, k, &sr, drift_key);
    kvdepot_search_result_free(&sr);
    CHECK(r2 > r0[0] + 0.1);
    /* errors: unknown sequence, no index, layers past the model's */
    CHECK_RC(kvdepot_pq_rebuild(c, "nope", 4, 0, 0, NULL, NULL, NULL), KVDEPOT_ENOTFOUND);
    REQUIRE_RC(create(c, "plain", 0), KVDEPOT_OK);
    REQUIRE_RC(append(c, "plain", 0, PT), KVDEPOT_OK);
    CHECK_RC(kvdepot_pq_rebuild(c, "plain", 5, 0, 0, NULL, NULL, NULL), KVDEPOT_EPRECOND);
    CHECK_RC(kvdepot_pq_rebuild(c, "drift", 5, L, 0, NULL, NULL, NULL), KVDEPOT_EINVAL);
    CHECK_RC(kvdepot_pq_rebuild(c, "drift", 5, 0, L + 1, NULL, NULL, NULL), KVDEPOT_EINVAL);
    kvdepot_pq_centroids c2;
    REQUIRE_RC(kvdepot_pq_centroids_get(c, "drift", 5, 0, &c2), KVDEPOT_OK);
    CHECK(c2.centroids_id == c1.centroids_id);
    kvdepot_pq_centroids_free(&c0);
    kvdepot_pq_centroids_free(&c1);
    kvdepot_pq_centroids_free(&c2);
    kvdepot_sequence_info_clear(&before);
    kvdepot_sequence_info_clear(&after);
    free(q);
    kvdepot_close(c);
    return 0;
}

/* A prefill sent in chunks of any size gets the index one append of it
 * gets (pq.min_train_tokens, default 4096): the same centroids bit for bit,
 * the same Search answers, the same recall. Trained at the first sealing
 * append instead (min_train_tokens 1), 300-token chunks train on 300 keys. */
static int t_chunked(kvd_harness *h)
{
    kvdepot_client *c = harness_client(h);
    REQUIRE(c);
    REQUIRE_RC(put_model(c), KVDEPOT_OK);
    const uint64_t n = 4096 + 300;
    const struct {
        const char *id;
        uint32_t min_train;
        uint64_t chunk;
    } seqs[] = {
        {"whole", 0, n}, {"c4096", 0, 4096}, {"c300", 0, 300}, {"c1", 0, 1}, {"first300", 1, 300}};
    const size_t ns = sizeof seqs / sizeof seqs[0];
    for (size_t i = 0; i < ns; i++)
        REQUIRE_RC(chunked(c, seqs[i].id, seqs[i].min_train, n, seqs[i].chunk), KVDEPOT_OK);
    /* Before the layer holds 4096 tokens there are no centroids. */
    REQUIRE_RC(chunked(c, "young", 0, 4000, 300), KVDEPOT_OK);
    kvdepot_pq_centroids pc;
    CHECK_RC(kvdepot_pq_centroids_get(c, "young", 5, 0, &pc), KVDEPOT_EPRECOND);
    CHECK(strstr(kvdepot_errmsg(c), "4096 tokens") != NULL);

    float *q = make_q(11);
    const uint32_t k = 64;
    for (uint32_t l = 0; l < L; l++) {
        kvdepot_pq_centroids ref;
        REQUIRE_RC(kvdepot_pq_centroids_get(c, "whole", 5, l, &ref), KVDEPOT_OK);
        kvdepot_search_result sref;
        double rref = search_recall(c, "whole", l, q, n, k, &sref);
        REQUIRE(rref >= 0);
        printf("layer %u: recall@%u of one append of %llu tokens %.3f\n", l, k,
               (unsigned long long)n, rref);
        for (size_t i = 1; i < ns; i++) {
            kvdepot_pq_centroids pc2;
            REQUIRE_RC(kvdepot_pq_centroids_get(c, seqs[i].id, strlen(seqs[i].id), l, &pc2),
                       KVDEPOT_OK);
            const int same = pc2.count == ref.count && pc2.centroids_id == ref.centroids_id &&
                             memcmp(pc2.data, ref.data, sizeof(float) * ref.count) == 0;
            kvdepot_search_result sr;
            double r = search_recall(c, seqs[i].id, l, q, n, k, &sr);
            REQUIRE(r >= 0);
            int same_answer = sr.num_heads == sref.num_heads;
            for (size_t hh = 0; same_answer && hh < sr.num_heads; hh++)
                same_answer = sr.heads[hh].count == sref.heads[hh].count &&
                              memcmp(sr.heads[hh].tokens, sref.heads[hh].tokens,
                                     sizeof(uint64_t) * sr.heads[hh].count) == 0 &&
                              memcmp(sr.heads[hh].scores, sref.heads[hh].scores,
                                     sizeof(float) * sr.heads[hh].count) == 0;
            printf("layer %u: %-8s (chunks of %4llu, min_train_tokens %u): recall %.3f, "
                   "centroids %s, answer %s\n",
                   l, seqs[i].id, (unsigned long long)seqs[i].chunk, seqs[i].min_train, r,
                   same ? "same" : "differ", same_answer ? "same" : "differs");
            if (seqs[i].min_train == 0) {
                CHECK(same);
                CHECK(same_answer);
                CHECK(r == rref);
            } else {
                CHECK(!same); /* trained on the first 300 keys only */
            }
            kvdepot_search_result_free(&sr);
            kvdepot_pq_centroids_free(&pc2);
        }
        kvdepot_search_result_free(&sref);
        kvdepot_pq_centroids_free(&ref);
    }
    free(q);
    kvdepot_close(c);
    return 0;
}

int main(int argc, char **argv)
{
    static const kvd_test tests[] = {
        {"stored", t_stored}, {"pages", t_pages},     {"sparse", t_sparse},  {"prefix", t_prefix},
        {"errors", t_errors}, {"chunked", t_chunked}, {"rebuild", t_rebuild}};
    return harness_main(argc, argv, tests, sizeof tests / sizeof tests[0]);
}
