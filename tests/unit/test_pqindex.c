/*
 * The stored PQ index (store/pqindex.h) and the page's PQ-codes section
 * (store/format/page.h): section validation and replacement; centroids trained at
 * the first sealing append from the keys as appended, persisted across
 * reopen, per layer, removed with the sequence; codes of every sealed page
 * equal to encoding its keys with the stored centroids, later pages with the
 * same centroids; prefix-shared pages; client pages' sections replaced.
 *
 * In-process store in a fresh directory under $TMPDIR (or /tmp), 16-token
 * pages, K coded INT4 (the codes index the keys as appended, not the
 * quantized ones).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kvdepot/pq.h"
#include "page.h"
#include "pqindex.h"
#include "seqcodec.h"
#include "store.h"

static int failures;

#define CHECK(cond, ...)                                                                           \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            fprintf(stderr, "%s:%d: check failed: %s: ", __FILE__, __LINE__, #cond);               \
            fprintf(stderr, __VA_ARGS__);                                                          \
            fputc('\n', stderr);                                                                   \
            failures++;                                                                            \
        }                                                                                          \
    } while (0)

#define REQUIRE(cond, ...)                                                                         \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            fprintf(stderr, "%s:%d: required check failed: %s: ", __FILE__, __LINE__, #cond);      \
            fprintf(stderr, __VA_ARGS__);                                                          \
            fputc('\n', stderr);                                                                   \
            exit(1);                                                                               \
        }                                                                                          \
    } while (0)

#define B 16
#define L 2
#define H 2
#define D 32
#define M 4
#define NB 4
#define ITERS 3
#define KC (1 << NB)
#define CENT_PER_HEAD (M * KC * (D / M))

static char dir[256];
static kvd_backend *be;

static void rm_dir(void)
{
    char cmd[300];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    if (system(cmd) != 0)
        fprintf(stderr, "could not remove %s\n", dir);
}

static kvd_store *open_store(void)
{
    kvd_store_options o = {.data_dir = dir, .page_tokens = B};
    kvd_store *st;
    kvd_error err;
    REQUIRE(kvd_store_open(&o, &st, &err) == 0, "open %s: %s", dir, err.msg);
    return st;
}

static void put_model(kvd_store *st)
{
    kvd_model_info m;
    memset(&m, 0, sizeof m);
    snprintf(m.name, sizeof m.name, "pqm");
    snprintf(m.revision, sizeof m.revision, "r1");
    m.num_layers = L;
    m.num_kv_heads = H;
    m.num_q_heads = 2 * H;
    m.head_dim = D;
    m.dtype = KVD_DTYPE_F16;
    kvd_error err;
    int created;
    kvd_model_info out;
    REQUIRE(kvd_store_model_put(st, &m, 0, &out, &created, &err) == 0, "model: %s", err.msg);
}

/* Key or value (part 0/1) of (layer, token, head, dim) of sequence `salt`:
 * a value in [-2, 2) from a hash. */
static float val(int salt, int part, uint32_t l, uint64_t t, uint32_t h, uint32_t d)
{
    uint64_t x = ((((uint64_t)salt * 31 + part) * 31 + l) * 1000003 + t) * 131 + h * 37 + d;
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ull;
    x ^= x >> 33;
    return (float)(x & 0xffffff) / (float)(1 << 24) * 4.0f - 2.0f;
}

static void create_ex(kvd_store *st, const char *id, const uint64_t *prefix, size_t np,
                      uint32_t min_train);

/* Create `id` with the PQ index (K INT4) trained at the first sealing
 * append, optionally from a prefix. */
static void create(kvd_store *st, const char *id, const uint64_t *prefix, size_t np)
{
    create_ex(st, id, prefix, np, 1);
}

/* The same, trained once a layer holds min_train tokens. */
static void create_ex(kvd_store *st, const char *id, const uint64_t *prefix, size_t np,
                      uint32_t min_train)
{
    kvd_error err;
    kvd_seq_info info;
    memset(&info, 0, sizeof info);
    kvd_seq_codecs c;
    memset(&c, 0, sizeof c);
    c.k.codec = KVD_CODEC_INT4;
    c.k.group = 32;
    c.pq_m = M;
    c.pq_bits = NB;
    c.pq_iterations = ITERS;
    c.pq_min_train_tokens = min_train;
    REQUIRE(kvd_seq_codecs_check(&c, B, D, &err) == 0, "codecs: %s", err.msg);
    kvd_seq_create_opts o = {.codecs = &c};
    REQUIRE(kvd_store_seq_create_ex(st, id, strlen(id), "pqm", prefix, np, NULL, 0, &o, &info,
                                    &err) == 0,
            "create %s: %s", id, err.msg);
    kvd_seq_info_clear(&info);
}

/* Append tokens [ts, ts + n) of layers [ls, ls + nl) of sequence `salt`
 * (token ids t + 1000 * salt so blocks get prefix hashes). */
static int append(kvd_store *st, const char *id, int salt, uint32_t ls, uint32_t nl, uint64_t ts,
                  uint64_t n, kvd_error *err)
{
    uint32_t *ids = malloc(sizeof(uint32_t) * n);
    for (uint64_t t = 0; t < n; t++)
        ids[t] = (uint32_t)(ts + t + 1000u * (uint32_t)salt);
    kvd_append_spec sp = {.seq_id = id,
                          .seq_id_len = strlen(id),
                          .layer_start = ls,
                          .num_layers = nl,
                          .token_start = ts,
                          .num_tokens = n,
                          .dtype = KVD_DTYPE_F16,
                          .token_ids = ids,
                          .n_token_ids = n};
    kvd_append *ap;
    uint64_t exp;
    int rc = kvd_store_append_begin(st, &sp, &ap, &exp, err);
    if (rc) {
        free(ids);
        return rc;
    }
    size_t cnt = 2 * (size_t)nl * n * H * D, i = 0;
    uint16_t *w = malloc(cnt * sizeof *w);
    for (int part = 0; part < 2; part++)
        for (uint32_t l = ls; l < ls + nl; l++)
            for (uint64_t t = ts; t < ts + n; t++)
                for (uint32_t h = 0; h < H; h++)
                    for (uint32_t d = 0; d < D; d++)
                        w[i++] = kvd_f32_to_f16(val(salt, part, l, t, h, d));
    CHECK(exp == cnt * 2, "expected %llu bytes", (unsigned long long)exp);
    rc = kvd_store_append_write(ap, w, cnt * 2, err);
    free(w);
    free(ids);
    if (rc) {
        kvd_store_append_abort(ap);
        return rc;
    }
    return kvd_store_append_commit(ap, NULL, err);
}

/* Keys as appended (f16 -> f32) of tokens [t0, t0 + n) of one head. */
static void keys_of(int salt, uint32_t l, uint32_t h, uint64_t t0, uint64_t n, float *out)
{
    for (uint64_t t = 0; t < n; t++)
        for (uint32_t d = 0; d < D; d++)
            out[t * D + d] = kvd_f16_to_f32(kvd_f32_to_f16(val(salt, 0, l, t0 + t, h, d)));
}

/* The centroids the documented procedure trains from tokens [t0, t0 + n)
 * as appended. */
static void expected_centroids(int salt, uint32_t l, uint64_t t0, uint64_t n, float *cent)
{
    uint64_t nt = n < KVD_PQ_TRAIN_TOKENS ? n : KVD_PQ_TRAIN_TOKENS;
    float *keys = malloc(sizeof(float) * nt * D);
    for (uint32_t h = 0; h < H; h++) {
        keys_of(salt, l, h, t0, nt, keys);
        kvd_error err;
        REQUIRE(kvd_pq_train_head(be, keys, (int64_t)nt, D, M, NB, ITERS, l, h,
                                  cent + (size_t)h * CENT_PER_HEAD, &err) == 0,
                "train: %s", err.msg);
    }
    free(keys);
}

static int get_centroids(kvd_store *st, const char *id, uint32_t l, kvd_pq_centroids *c)
{
    kvd_error err;
    int found = -1;
    REQUIRE(kvd_store_pq_centroids_get(st, id, strlen(id), l, c, &found, &err) == 0,
            "centroids: %s", err.msg);
    return found;
}

/* Page `block` of layer l of `id`, acquired (release ph) and decoded. */
static void page_view(kvd_store *st, const char *id, uint32_t l, uint64_t block,
                      kvd_page_handle *ph, kvd_page_view *v)
{
    kvd_error err;
    REQUIRE(kvd_store_page_acquire(st, id, strlen(id), l, block, ph, &err) == 0, "acquire: %s",
            err.msg);
    REQUIRE(kvd_page_decode(ph->bytes, ph->len, v, &err) == 0, "decode: %s", err.msg);
}

/* Page `block` of layer l: its PQ section carries centroids `cid` and codes
 * equal to encoding the keys of sequence `salt` as appended. */
static void check_page_codes(kvd_store *st, const char *id, int salt, uint32_t l, uint64_t block,
                             const kvd_pq_centroids *c)
{
    kvd_page_handle ph;
    kvd_page_view v;
    page_view(st, id, l, block, &ph, &v);
    kvd_page_pq pq;
    CHECK(kvd_page_pq_get(&v, &pq) == 1, "page %s/%u/%llu has no PQ section", id, l,
          (unsigned long long)block);
    CHECK(v.h.k_codec == KVD_CODEC_INT4, "K codec %u", v.h.k_codec);
    if (v.pq) {
        CHECK(pq.m == M && pq.bits == NB, "m %u bits %u", pq.m, pq.bits);
        CHECK(pq.centroids_id == c->id, "page %llu: centroids %016llx, stored %016llx",
              (unsigned long long)block, (unsigned long long)pq.centroids_id,
              (unsigned long long)c->id);
        float keys[B * D];
        uint8_t want[B * M];
        int bad = 0;
        for (uint32_t h = 0; h < H; h++) {
            keys_of(salt, l, h, block * B, B, keys);
            kvd_pq_encode_ref(B, M, NB, D, keys, c->data + (size_t)h * CENT_PER_HEAD, want);
            bad += memcmp(want, pq.codes + (size_t)h * B * M, sizeof want) != 0;
        }
        CHECK(bad == 0, "page %s/%u/%llu: codes of %d heads differ from re-encoding", id, l,
              (unsigned long long)block, bad);
    }
    kvd_store_page_release(st, &ph);
}

/* ---- the PQ-codes section of a page ------------------------------------- */

static uint8_t *sealed_page(size_t *len)
{
    kvd_page_desc d = {.dtype = KVD_DTYPE_F16,
                       .layer = 1,
                       .token_start = B,
                       .num_tokens = B,
                       .page_tokens = B,
                       .num_kv_heads = H,
                       .head_dim = D};
    size_t n = (size_t)H * B * D;
    uint16_t *k = calloc(n, 2), *v = calloc(n, 2);
    uint8_t *p = NULL;
    kvd_error err;
    REQUIRE(kvd_page_encode_raw(&d, k, v, &p, len, &err) == 0, "encode: %s", err.msg);
    free(k);
    free(v);
    return p;
}

static uint8_t *with_pq(const uint8_t *page, size_t len, size_t *out_len, uint8_t **sec)
{
    uint8_t *out;
    kvd_error err;
    REQUIRE(kvd_page_put_section(page, len, KVD_SECTION_PQ_CODES,
                                 KVD_PAGE_PQ_HEADER + (uint64_t)H * B * M, &out, out_len, sec,
                                 &err) == 0,
            "put: %s", err.msg);
    (*sec)[0] = M;
    (*sec)[2] = NB;
    (*sec)[8] = 0x5a;
    for (size_t i = 0; i < (size_t)H * B * M; i++)
        (*sec)[KVD_PAGE_PQ_HEADER + i] = (uint8_t)(i % KC);
    kvd_page_finish(out, *out_len);
    return out;
}

/* Expect the page, after `poke` changed it and it was re-checksummed, to be
 * rejected as corrupt with a message containing `msg`. */
static void expect_corrupt(const uint8_t *page, size_t len, size_t off, uint8_t val,
                           const char *msg)
{
    uint8_t *p = malloc(len);
    memcpy(p, page, len);
    p[off] = val;
    kvd_page_finish(p, len);
    kvd_page_view v;
    kvd_error err;
    memset(&err, 0, sizeof err);
    int rc = kvd_page_decode(p, len, &v, &err);
    CHECK(rc == KVD_ECORRUPT && strstr(err.msg, msg), "poke %zu=%u: rc %d (%s), want '%s'", off,
          val, rc, err.msg, msg);
    free(p);
}

/* kvd_page_decode_trusted: the same view as a full decode, the layout
 * still checked, but neither the codes nor the checksum read (the tiers'
 * pages were checked on their way in). */
static void t_trusted(const uint8_t *page, size_t len, size_t s0)
{
    kvd_page_view full, tr;
    kvd_error err;
    REQUIRE(kvd_page_decode(page, len, &full, &err) == 0, "decode: %s", err.msg);
    REQUIRE(kvd_page_decode_trusted(page, len, &tr, &err) == 0, "trusted: %s", err.msg);
    CHECK(memcmp(&full, &tr, sizeof full) == 0, "trusted view differs from the full decode's");
    uint8_t *p = malloc(len);
    memcpy(p, page, len);
    p[s0 + KVD_PAGE_PQ_HEADER + 5] = KC; /* a code out of range, checksum stale */
    CHECK(kvd_page_decode_nocheck(p, len, &tr, &err) == KVD_ECORRUPT &&
              strstr(err.msg, "not below"),
          "nocheck took a bad code: %s", err.msg);
    CHECK(kvd_page_decode_trusted(p, len, &tr, &err) == 0 && tr.pq - p == full.pq - page,
          "trusted read the codes or the checksum: %s", err.msg);
    p[s0] = 5; /* m 5 does not divide D: a layout fault */
    CHECK(kvd_page_decode_trusted(p, len, &tr, &err) == KVD_ECORRUPT &&
              strstr(err.msg, "does not divide"),
          "trusted took a bad layout: %s", err.msg);
    CHECK(kvd_page_decode_trusted(p, 40, &tr, &err) == KVD_ECORRUPT, "trusted took 40 bytes");
    free(p);
}

static void t_section(void)
{
    size_t len, plen;
    uint8_t *page = sealed_page(&len), *sec;
    uint8_t *p = with_pq(page, len, &plen, &sec);
    kvd_page_view v;
    kvd_error err;
    REQUIRE(kvd_page_decode(p, plen, &v, &err) == 0, "decode: %s", err.msg);
    kvd_page_pq pq;
    CHECK(kvd_page_pq_get(&v, &pq) == 1 && pq.m == M && pq.bits == NB && pq.centroids_id == 0x5a &&
              pq.codes == sec + KVD_PAGE_PQ_HEADER,
          "parsed m %u bits %u id %llx", pq.m, pq.bits, (unsigned long long)pq.centroids_id);
    CHECK(v.h.n_sections == 3 && v.k_len == (uint64_t)H * B * D * 2, "sections %u", v.h.n_sections);
    /* Readers that do not need it see the same K and V. */
    kvd_page_view v0;
    REQUIRE(kvd_page_decode(page, len, &v0, &err) == 0, "decode: %s", err.msg);
    CHECK(memcmp(v.k, v0.k, v.k_len) == 0 && memcmp(v.v, v0.v, v.v_len) == 0, "K/V changed");
    CHECK(kvd_page_pq_get(&v0, &pq) == 0, "raw page has a PQ section");

    size_t s0 = (size_t)(sec - p);
    t_trusted(p, plen, s0);
    expect_corrupt(p, plen, s0 + KVD_PAGE_PQ_HEADER + 5, KC, "not below");
    expect_corrupt(p, plen, s0, 5, "does not divide");
    expect_corrupt(p, plen, s0, 0, "does not divide");
    expect_corrupt(p, plen, s0 + 2, 5, "bits");
    expect_corrupt(p, plen, s0 + 3, 1, "reserved");
    expect_corrupt(p, plen, s0 + 6, 1, "reserved");
    expect_corrupt(p, plen, s0, 2, "expected"); /* m 2: length no longer matches */
    /* Section codec must be raw (entry 2's codec byte). */
    expect_corrupt(p, plen, 64 + 2 * 24 + 2, KVD_CODEC_INT4, "codec");
    /* A stale checksum. */
    uint8_t *q = malloc(plen);
    memcpy(q, p, plen);
    q[plen - 1] ^= 1;
    CHECK(kvd_page_decode(q, plen, &v, &err) == KVD_ECORRUPT && strstr(err.msg, "checksum"),
          "checksum: %s", err.msg);
    free(q);

    /* Every truncation (from an exactly sized copy) and every byte flip of
     * a page with a PQ section is rejected. */
    int missed = 0;
    for (size_t n = 0; n < plen; n++) {
        uint8_t *t = malloc(n ? n : 1);
        memcpy(t, p, n);
        missed += kvd_page_decode(t, n, &v, &err) != KVD_ECORRUPT;
        free(t);
    }
    CHECK(missed == 0, "%d truncations accepted", missed);
    q = malloc(plen);
    for (size_t i = 0; i < plen; i++) {
        memcpy(q, p, plen);
        q[i] ^= 0x10;
        missed += kvd_page_decode(q, plen, &v, &err) != KVD_ECORRUPT;
    }
    free(q);
    CHECK(missed == 0, "%d byte flips accepted", missed);

    /* Replacing the section keeps one, last, with the new bytes. */
    uint8_t *r, *sec2;
    size_t rlen;
    REQUIRE(kvd_page_put_section(p, plen, KVD_SECTION_PQ_CODES,
                                 KVD_PAGE_PQ_HEADER + (uint64_t)H * B * M, &r, &rlen, &sec2,
                                 &err) == 0,
            "put: %s", err.msg);
    CHECK(rlen == plen, "replaced page %zu bytes, was %zu", rlen, plen);
    sec2[0] = M;
    sec2[2] = NB;
    kvd_page_finish(r, rlen);
    REQUIRE(kvd_page_decode(r, rlen, &v, &err) == 0, "decode: %s", err.msg);
    CHECK(v.h.n_sections == 3 && kvd_page_pq_get(&v, &pq) && pq.centroids_id == 0 &&
              pq.codes[7] == 0,
          "replacement");
    free(r);

    /* Only sealed pages carry codes. */
    kvd_page_desc d = {.dtype = KVD_DTYPE_F16,
                       .token_start = 0,
                       .num_tokens = 3,
                       .page_tokens = B,
                       .num_kv_heads = H,
                       .head_dim = D};
    uint16_t kv[(size_t)H * 3 * D];
    memset(kv, 0, sizeof kv);
    uint8_t *part;
    size_t partlen;
    REQUIRE(kvd_page_encode_raw(&d, kv, kv, &part, &partlen, &err) == 0, "encode: %s", err.msg);
    REQUIRE(kvd_page_put_section(part, partlen, KVD_SECTION_PQ_CODES,
                                 KVD_PAGE_PQ_HEADER + (uint64_t)H * 3 * M, &r, &rlen, &sec2,
                                 &err) == 0,
            "put: %s", err.msg);
    sec2[0] = M;
    sec2[2] = NB;
    kvd_page_finish(r, rlen);
    CHECK(kvd_page_decode(r, rlen, &v, &err) == KVD_ECORRUPT && strstr(err.msg, "not sealed"),
          "partial page: %s", err.msg);
    free(r);
    free(part);
    free(p);
    free(page);
}

/* ---- the index in the store ---------------------------------------------- */

static void t_store(void)
{
    kvd_store *st = open_store();
    put_model(st);
    kvd_error err;
    create(st, "s", NULL, 0);
    kvd_pq_centroids c, c2;
    /* A partial page trains nothing. */
    REQUIRE(append(st, "s", 1, 0, L, 0, 5, &err) == 0, "append: %s", err.msg);
    CHECK(get_centroids(st, "s", 0, &c) == 0, "centroids before any page sealed");
    /* The append that seals pages 0 and 1 (tokens 5..39) trains on tokens
     * 0..39: the first sealing page and the rest of the append. */
    REQUIRE(append(st, "s", 1, 0, L, 5, 35, &err) == 0, "append: %s", err.msg);
    float *want = malloc(sizeof(float) * H * CENT_PER_HEAD);
    for (uint32_t l = 0; l < L; l++) {
        REQUIRE(get_centroids(st, "s", l, &c) == 1, "layer %u has no centroids", l);
        CHECK(c.num_kv_heads == H && c.head_dim == D && c.m == M && c.bits == NB,
              "shape %u %u %u %u", c.num_kv_heads, c.head_dim, c.m, c.bits);
        expected_centroids(1, l, 0, 40, want);
        CHECK(memcmp(c.data, want, sizeof(float) * H * CENT_PER_HEAD) == 0,
              "layer %u: centroids differ from training on the appended keys", l);
        check_page_codes(st, "s", 1, l, 0, &c);
        check_page_codes(st, "s", 1, l, 1, &c);
        kvd_pq_centroids_clear(&c);
    }
    REQUIRE(get_centroids(st, "s", 0, &c) == 1, "centroids");
    REQUIRE(get_centroids(st, "s", 1, &c2) == 1, "centroids");
    CHECK(c.id != c2.id, "layers share a centroids id");
    kvd_pq_centroids_clear(&c2);
    /* More tokens: new pages coded with the same centroids. */
    REQUIRE(append(st, "s", 1, 0, L, 40, 30, &err) == 0, "append: %s", err.msg);
    REQUIRE(get_centroids(st, "s", 0, &c2) == 1, "centroids");
    CHECK(c2.id == c.id && memcmp(c.data, c2.data, sizeof(float) * H * CENT_PER_HEAD) == 0,
          "centroids changed by a later append");
    for (uint64_t blk = 0; blk < 4; blk++)
        check_page_codes(st, "s", 1, 0, blk, &c);
    kvd_pq_centroids_clear(&c2);

    /* Persisted across reopen. */
    kvd_store_close(st);
    st = open_store();
    REQUIRE(get_centroids(st, "s", 0, &c2) == 1, "centroids after reopen");
    CHECK(c2.id == c.id && memcmp(c.data, c2.data, sizeof(float) * H * CENT_PER_HEAD) == 0,
          "centroids changed by reopen");
    kvd_pq_centroids_clear(&c2);
    check_page_codes(st, "s", 1, 0, 3, &c);

    /* Layers train at their own first sealing append. */
    create(st, "ls", NULL, 0);
    REQUIRE(append(st, "ls", 2, 1, 1, 0, 20, &err) == 0, "append: %s", err.msg);
    CHECK(get_centroids(st, "ls", 0, &c2) == 0, "layer 0 trained without a page");
    REQUIRE(get_centroids(st, "ls", 1, &c2) == 1, "layer 1 not trained");
    kvd_pq_centroids_clear(&c2);
    REQUIRE(append(st, "ls", 2, 0, 1, 0, 16, &err) == 0, "append: %s", err.msg);
    REQUIRE(get_centroids(st, "ls", 0, &c2) == 1, "layer 0 not trained");
    expected_centroids(2, 0, 0, 16, want);
    CHECK(memcmp(c2.data, want, sizeof(float) * H * CENT_PER_HEAD) == 0, "layer 0 centroids");
    kvd_pq_centroids_clear(&c2);

    /* Shared prefix: "c" shares pages 0 and 1 of "s" (their sections index
     * the centroids of "s"), trains its own at its first sealing append. */
    kvd_seq_info info;
    memset(&info, 0, sizeof info);
    REQUIRE(kvd_store_seq_stat(st, "s", 1, &info, &err) == 0, "stat: %s", err.msg);
    REQUIRE(info.n_block_hashes >= 2, "%zu block hashes", info.n_block_hashes);
    uint64_t pre[2] = {info.block_hashes[0], info.block_hashes[1]};
    kvd_seq_info_clear(&info);
    create(st, "c", pre, 2);
    CHECK(get_centroids(st, "c", 0, &c2) == 0, "prefix sequence has centroids at creation");
    check_page_codes(st, "c", 1, 0, 1, &c); /* shared: the centroids of "s" */
    REQUIRE(append(st, "c", 3, 0, L, 2 * B, B, &err) == 0, "append: %s", err.msg);
    REQUIRE(get_centroids(st, "c", 0, &c2) == 1, "prefix sequence not trained");
    CHECK(c2.id != c.id, "prefix sequence reuses the centroids of another");
    expected_centroids(3, 0, 2 * B, B, want);
    CHECK(memcmp(c2.data, want, sizeof(float) * H * CENT_PER_HEAD) == 0, "c centroids");
    check_page_codes(st, "c", 3, 0, 2, &c2);

    /* Delete removes the centroids of every layer; the shared pages stay. */
    uint64_t freed = 0;
    REQUIRE(kvd_store_seq_delete(st, "s", 1, &freed, &err) == 0, "delete: %s", err.msg);
    for (uint32_t l = 0; l < L; l++) {
        kvd_pq_centroids c3;
        CHECK(get_centroids(st, "s", l, &c3) == 0, "layer %u centroids left after delete", l);
    }
    check_page_codes(st, "c", 1, 0, 0, &c);
    kvd_store_close(st);
    st = open_store();
    kvd_pq_centroids c3;
    CHECK(get_centroids(st, "s", 1, &c3) == 0, "centroids back after reopen");
    REQUIRE(get_centroids(st, "c", 0, &c3) == 1 && c3.id == c2.id, "c lost its centroids");
    kvd_pq_centroids_clear(&c3);
    /* A new sequence of the deleted id starts without centroids. */
    create(st, "s", NULL, 0);
    CHECK(get_centroids(st, "s", 0, &c3) == 0, "stale centroids for a new sequence");
    /* Bad arguments. */
    int found = 1;
    CHECK(kvd_store_pq_centroids_get(st, "", 0, 0, &c3, &found, &err) == KVD_EINVAL && !found,
          "empty id: %s", err.msg);
    kvd_pq_centroids_clear(&c2);
    kvd_pq_centroids_clear(&c);
    kvd_pq_centroids_clear(NULL);
    free(want);
    kvd_store_close(st);
}

/*
 * The cache of centroid records (a Search reads its layer's record on every
 * call): a second read is a hit with the same record; a sequence deleted,
 * made again under its id and trained on other keys gives its new centroids
 * (read, not the cached ones); a reopened store caches what it loaded.
 */
static void t_cache(void)
{
    kvd_store *st = open_store();
    put_model(st);
    kvd_error err;
    float *want = malloc(sizeof(float) * H * CENT_PER_HEAD);
    kvd_pq_centroids a, b2;
    create(st, "k", NULL, 0);
    REQUIRE(append(st, "k", 5, 0, L, 0, 40, &err) == 0, "append: %s", err.msg);
    uint64_t h0 = kvd__pq_cache_hits(st);
    REQUIRE(get_centroids(st, "k", 1, &a) == 1 && get_centroids(st, "k", 1, &b2) == 1, "centroids");
    CHECK(kvd__pq_cache_hits(st) == h0 + 1, "second read: %llu cache hits (want 1)",
          (unsigned long long)(kvd__pq_cache_hits(st) - h0));
    CHECK(a.id == b2.id && a.m == b2.m && a.bits == b2.bits && a.num_kv_heads == b2.num_kv_heads &&
              a.head_dim == b2.head_dim &&
              memcmp(a.data, b2.data, sizeof(float) * H * CENT_PER_HEAD) == 0,
          "cached record differs from the stored one");
    kvd_pq_centroids_clear(&b2);
    uint64_t freed = 0;
    REQUIRE(kvd_store_seq_delete(st, "k", 1, &freed, &err) == 0, "delete: %s", err.msg);
    CHECK(get_centroids(st, "k", 1, &b2) == 0, "centroids of a deleted sequence");
    create(st, "k", NULL, 0);
    CHECK(get_centroids(st, "k", 1, &b2) == 0, "centroids of a new sequence before training");
    REQUIRE(append(st, "k", 6, 0, L, 0, 40, &err) == 0, "append: %s", err.msg);
    h0 = kvd__pq_cache_hits(st);
    REQUIRE(get_centroids(st, "k", 1, &b2) == 1, "centroids of the new sequence");
    expected_centroids(6, 1, 0, 40, want);
    CHECK(b2.id != a.id && memcmp(b2.data, want, sizeof(float) * H * CENT_PER_HEAD) == 0 &&
              kvd__pq_cache_hits(st) == h0,
          "new sequence under an old id: stale centroids (hits %llu)",
          (unsigned long long)(kvd__pq_cache_hits(st) - h0));
    kvd_pq_centroids_clear(&b2);
    kvd_pq_centroids_clear(&a);
    kvd_store_close(st);
    st = open_store();
    h0 = kvd__pq_cache_hits(st);
    REQUIRE(get_centroids(st, "k", 1, &a) == 1 && get_centroids(st, "k", 1, &b2) == 1,
            "centroids after reopen");
    CHECK(kvd__pq_cache_hits(st) == h0 + 1 && a.id == b2.id &&
              memcmp(b2.data, want, sizeof(float) * H * CENT_PER_HEAD) == 0,
          "after reopen: %llu hits, or another record",
          (unsigned long long)(kvd__pq_cache_hits(st) - h0));
    kvd_pq_centroids_clear(&a);
    kvd_pq_centroids_clear(&b2);
    free(want);
    kvd_store_close(st);
}

/* Page `block` of layer l carries no PQ section. */
static int has_pq_section(kvd_store *st, const char *id, uint32_t l, uint64_t block)
{
    kvd_page_handle ph;
    kvd_page_view v;
    page_view(st, id, l, block, &ph, &v);
    kvd_page_pq pq;
    int has = kvd_page_pq_get(&v, &pq) == 1;
    kvd_store_page_release(st, &ph);
    return has;
}

/* Keys of page `block` of layer l as the store gives them back (INT4
 * decoded), head h, f32 (B, D). */
static void stored_page_keys(kvd_store *st, const char *id, uint32_t l, uint64_t block, uint32_t h,
                             float *out)
{
    kvd_page_handle ph;
    kvd_page_view v;
    page_view(st, id, l, block, &ph, &v);
    kvd_error err;
    float all[H * B * D];
    REQUIRE(kvd_page_decode_section(be, &v, KVD_SECTION_K, NULL, KVD_DTYPE_F32, all, &err) == 0,
            "decode K: %s", err.msg);
    memcpy(out, all + (size_t)h * B * D, sizeof(float) * B * D);
    kvd_store_page_release(st, &ph);
}

/* Deferred training (pq_min_train_tokens 48, 16-token pages): appends of 5
 * tokens seal pages 0 and 1 without codes and train nothing; the append that
 * takes the layer to 50 tokens (sealing page 2) trains on the first 50 keys:
 * those of pages 0 and 1 as stored (INT4-decoded), then 32..49 as appended.
 * Later pages are coded; the setting survives a reopen. */
static void t_deferred(void)
{
    kvd_store *st = open_store();
    put_model(st);
    kvd_error err;
    create_ex(st, "d", NULL, 0, 48);
    kvd_pq_centroids c;
    for (uint64_t t = 0; t < 45; t += 5) {
        REQUIRE(append(st, "d", 4, 0, L, t, 5, &err) == 0, "append: %s", err.msg);
        CHECK(get_centroids(st, "d", 0, &c) == 0, "trained at %llu tokens",
              (unsigned long long)(t + 5));
    }
    CHECK(!has_pq_section(st, "d", 0, 0) && !has_pq_section(st, "d", 1, 1),
          "a page sealed before training has codes");
    REQUIRE(append(st, "d", 4, 0, L, 45, 5, &err) == 0, "append: %s", err.msg);
    float *want = malloc(sizeof(float) * H * CENT_PER_HEAD);
    float keys[50 * D];
    for (uint32_t l = 0; l < L; l++) {
        REQUIRE(get_centroids(st, "d", l, &c) == 1, "layer %u not trained at 50 tokens", l);
        for (uint32_t h = 0; h < H; h++) {
            stored_page_keys(st, "d", l, 0, h, keys);
            stored_page_keys(st, "d", l, 1, h, keys + B * D);
            keys_of(4, l, h, 2 * B, 50 - 2 * B, keys + 2 * B * D);
            REQUIRE(kvd_pq_train_head(be, keys, 50, D, M, NB, ITERS, l, h,
                                      want + (size_t)h * CENT_PER_HEAD, &err) == 0,
                    "train: %s", err.msg);
        }
        CHECK(memcmp(c.data, want, sizeof(float) * H * CENT_PER_HEAD) == 0,
              "layer %u: centroids differ from training on the stored then appended keys", l);
        CHECK(!has_pq_section(st, "d", l, 0) && !has_pq_section(st, "d", l, 1),
              "layer %u: early pages", l);
        check_page_codes(st, "d", 4, l, 2, &c);
        /* the early pages' codes: their stored keys under the centroids */
        kvd_pq_codes pc;
        int found = 0;
        REQUIRE(kvd_store_pq_codes_get(st, "d", 1, l, &pc, &found, &err) == 0, "codes: %s",
                err.msg);
        CHECK(found && pc.token_start == 0 && pc.num_tokens == 2 * B && pc.m == M &&
                  pc.num_kv_heads == H && pc.centroids_id == c.id,
              "layer %u codes record: found %d [%llu, +%llu) m %u", l, found,
              (unsigned long long)pc.token_start, (unsigned long long)pc.num_tokens, pc.m);
        for (uint32_t h = 0; found && h < H; h++)
            for (uint64_t blk = 0; blk < 2; blk++) {
                uint8_t want_codes[B * M];
                stored_page_keys(st, "d", l, blk, h, keys);
                kvd_pq_encode_ref(B, M, NB, D, keys, c.data + (size_t)h * CENT_PER_HEAD,
                                  want_codes);
                CHECK(memcmp(want_codes, pc.codes + ((size_t)h * 2 * B + blk * B) * M,
                             sizeof want_codes) == 0,
                      "layer %u head %u page %llu: codes differ from its stored keys'", l, h,
                      (unsigned long long)blk);
            }
        kvd_pq_codes_clear(&pc);
        kvd_pq_centroids_clear(&c);
    }
    /* the index's bytes: both records of every layer */
    const uint64_t index = L * (12 + 4ull * H * KC * D + kvd__pq_codes_bytes(H, M, 2 * B));
    kvd_seq_info info;
    memset(&info, 0, sizeof info);
    REQUIRE(kvd_store_seq_stat(st, "d", 1, &info, &err) == 0, "stat: %s", err.msg);
    CHECK(info.pq_bytes == index, "pq bytes %llu, want %llu", (unsigned long long)info.pq_bytes,
          (unsigned long long)index);
    kvd_seq_info_clear(&info);
    REQUIRE(append(st, "d", 4, 0, L, 50, 30, &err) == 0, "append: %s", err.msg);
    REQUIRE(get_centroids(st, "d", 0, &c) == 1, "centroids");
    check_page_codes(st, "d", 4, 0, 3, &c);
    check_page_codes(st, "d", 4, 0, 4, &c);
    kvd_pq_centroids_clear(&c);
    kvd_store_close(st);
    st = open_store();
    kvd_seq_codecs sc;
    int found = 0;
    REQUIRE(kvd_store_seq_codecs_get(st, "d", 1, &sc, &found, &err) == 0 && found, "codecs: %s",
            err.msg);
    CHECK(sc.pq_min_train_tokens == 48 && sc.pq_m == M, "min_train_tokens %u after reopen",
          sc.pq_min_train_tokens);
    kvd_seq_codecs_clear(&sc);
    memset(&info, 0, sizeof info);
    REQUIRE(kvd_store_seq_stat(st, "d", 1, &info, &err) == 0, "stat: %s", err.msg);
    CHECK(info.pq_bytes == index, "pq bytes after reopen %llu, want %llu",
          (unsigned long long)info.pq_bytes, (unsigned long long)index);
    kvd_seq_info_clear(&info);
    /* Deleted with the sequence, nothing left after a reopen either. */
    uint64_t freed = 0;
    REQUIRE(kvd_store_seq_delete(st, "d", 1, &freed, &err) == 0, "delete: %s", err.msg);
    kvd_store_close(st);
    st = open_store();
    create_ex(st, "d", NULL, 0, 48);
    for (uint32_t l = 0; l < L; l++) {
        kvd_pq_codes pc;
        int found = 1;
        REQUIRE(kvd_store_pq_codes_get(st, "d", 1, l, &pc, &found, &err) == 0, "codes: %s",
                err.msg);
        CHECK(!found, "layer %u: codes record left after delete", l);
    }
    memset(&info, 0, sizeof info);
    REQUIRE(kvd_store_seq_stat(st, "d", 1, &info, &err) == 0, "stat: %s", err.msg);
    CHECK(info.pq_bytes == 0, "pq bytes of a new sequence %llu", (unsigned long long)info.pq_bytes);
    kvd_seq_info_clear(&info);
    /* The default and the bound. */
    kvd_seq_codecs dc;
    memset(&dc, 0, sizeof dc);
    dc.pq_m = M;
    REQUIRE(kvd_seq_codecs_check(&dc, B, D, &err) == 0, "codecs: %s", err.msg);
    CHECK(dc.pq_min_train_tokens == KVD_PQ_MIN_TRAIN_TOKENS, "default %u", dc.pq_min_train_tokens);
    dc.pq_min_train_tokens = KVD_PQ_MIN_TRAIN_MAX + 1;
    CHECK(kvd_seq_codecs_check(&dc, B, D, &err) == KVD_EINVAL, "over the bound accepted");
    free(want);
    kvd_store_close(st);
}

/* The centroids a rebuild of layer l of `id` trains: tokens floor(i * n /
 * T), T = min(n, KVD_PQ_TRAIN_TOKENS), of its n sealed tokens as stored. */
static void rebuilt_centroids(kvd_store *st, const char *id, uint32_t l, uint64_t n, float *cent)
{
    const uint64_t T = n < KVD_PQ_TRAIN_TOKENS ? n : KVD_PQ_TRAIN_TOKENS;
    float *all = malloc(sizeof(float) * n * D), *sample = malloc(sizeof(float) * T * D);
    kvd_error err;
    for (uint32_t h = 0; h < H; h++) {
        for (uint64_t blk = 0; blk < n / B; blk++)
            stored_page_keys(st, id, l, blk, h, all + blk * B * D);
        for (uint64_t i = 0; i < T; i++)
            memcpy(sample + i * D, all + (i * n / T) * D, sizeof(float) * D);
        REQUIRE(kvd_pq_train_head(be, sample, (int64_t)T, D, M, NB, ITERS, l, h,
                                  cent + (size_t)h * CENT_PER_HEAD, &err) == 0,
                "train: %s", err.msg);
    }
    free(all);
    free(sample);
}

/* The codes record of layer l covers tokens [0, n) with the keys as stored
 * coded under c. */
static void check_codes_record(kvd_store *st, const char *id, uint32_t l, uint64_t n,
                               const kvd_pq_centroids *c)
{
    kvd_pq_codes pc;
    int found = 0;
    kvd_error err;
    REQUIRE(kvd_store_pq_codes_get(st, id, strlen(id), l, &pc, &found, &err) == 0, "codes: %s",
            err.msg);
    CHECK(found && pc.token_start == 0 && pc.num_tokens == n && pc.centroids_id == c->id,
          "layer %u codes record: found %d [%llu, +%llu)", l, found,
          (unsigned long long)pc.token_start, (unsigned long long)pc.num_tokens);
    float keys[B * D];
    uint8_t want[B * M];
    int bad = 0;
    for (uint32_t h = 0; found && h < H; h++)
        for (uint64_t blk = 0; blk < n / B; blk++) {
            stored_page_keys(st, id, l, blk, h, keys);
            kvd_pq_encode_ref(B, M, NB, D, keys, c->data + (size_t)h * CENT_PER_HEAD, want);
            bad += memcmp(want, pc.codes + ((size_t)h * n + blk * B) * M, sizeof want) != 0;
        }
    CHECK(bad == 0, "layer %u: %d pages' codes differ from their stored keys'", l, bad);
    kvd_pq_codes_clear(&pc);
}

/* Rebuild: centroids trained on keys spread over all sealed pages (as
 * stored), every page coded into the codes record, later pages sectioned
 * under the new centroids; a layer range; a sequence never trained; the
 * errors; an aborted rebuild changes nothing. */
static void t_rebuild(void)
{
    kvd_store *st = open_store();
    put_model(st);
    kvd_error err;
    const uint64_t n = 320 * B; /* 5120 tokens: the sample skips some */
    create(st, "r", NULL, 0);
    REQUIRE(append(st, "r", 5, 0, L, 0, n + 5, &err) == 0, "append: %s", err.msg);
    kvd_pq_centroids before, c;
    REQUIRE(get_centroids(st, "r", 0, &before) == 1, "centroids");
    /* only layer 1 */
    kvd_pq_rebuild *rb = NULL;
    uint64_t bound = 0;
    REQUIRE(kvd_store_pq_rebuild_begin(st, "r", 1, 1, 1, &rb, &bound, &err) == 0, "begin: %s",
            err.msg);
    CHECK(bound == kvd__pq_codes_bytes(H, M, n), "bound %llu", (unsigned long long)bound);
    REQUIRE(kvd_store_pq_rebuild_run(rb, &err) == 0, "run: %s", err.msg);
    kvd_pq_rebuild_info ri;
    REQUIRE(kvd_store_pq_rebuild_commit(rb, &ri, &err) == 0, "commit: %s", err.msg);
    CHECK(ri.layers_rebuilt == 1 && ri.tokens_indexed == n &&
              ri.index_bytes_after - ri.index_bytes_before == bound,
          "info %u %llu", ri.layers_rebuilt, (unsigned long long)ri.tokens_indexed);
    REQUIRE(get_centroids(st, "r", 0, &c) == 1, "centroids");
    CHECK(c.id == before.id, "layer 0 changed by a rebuild of layer 1");
    kvd_pq_centroids_clear(&c);
    float *want = malloc(sizeof(float) * H * CENT_PER_HEAD);
    REQUIRE(get_centroids(st, "r", 1, &c) == 1, "centroids");
    rebuilt_centroids(st, "r", 1, n, want);
    CHECK(memcmp(c.data, want, sizeof(float) * H * CENT_PER_HEAD) == 0,
          "rebuilt centroids differ from training on the spread sample");
    check_codes_record(st, "r", 1, n, &c);
    /* a later page is coded under the new centroids */
    REQUIRE(append(st, "r", 5, 0, L, n + 5, B, &err) == 0, "append: %s", err.msg);
    check_page_codes(st, "r", 5, 1, n / B, &c);
    kvd_pq_centroids_clear(&c);
    kvd_pq_centroids_clear(&before);
    kvd_seq_info info;
    memset(&info, 0, sizeof info);
    REQUIRE(kvd_store_seq_stat(st, "r", 1, &info, &err) == 0, "stat: %s", err.msg);
    const uint64_t rec = 12 + 4ull * H * KC * D;
    CHECK(info.pq_bytes == 2 * rec + kvd__pq_codes_bytes(H, M, n), "pq bytes %llu",
          (unsigned long long)info.pq_bytes);
    kvd_seq_info_clear(&info);

    /* a sequence never trained (40 tokens of the default 4096): trained */
    create_ex(st, "young", NULL, 0, 0);
    REQUIRE(append(st, "young", 6, 0, L, 0, 40, &err) == 0, "append: %s", err.msg);
    CHECK(get_centroids(st, "young", 0, &c) == 0, "trained at 40 tokens");
    REQUIRE(kvd_store_pq_rebuild_begin(st, "young", 5, 0, 0, &rb, &bound, &err) == 0, "begin: %s",
            err.msg);
    REQUIRE(kvd_store_pq_rebuild_run(rb, &err) == 0, "run: %s", err.msg);
    REQUIRE(kvd_store_pq_rebuild_commit(rb, &ri, &err) == 0, "commit: %s", err.msg);
    CHECK(ri.layers_rebuilt == L && ri.tokens_indexed == L * 2 * B, "young: %u %llu",
          ri.layers_rebuilt, (unsigned long long)ri.tokens_indexed);
    for (uint32_t l = 0; l < L; l++) {
        REQUIRE(get_centroids(st, "young", l, &c) == 1, "young layer %u not trained", l);
        rebuilt_centroids(st, "young", l, 2 * B, want);
        CHECK(memcmp(c.data, want, sizeof(float) * H * CENT_PER_HEAD) == 0, "young centroids");
        check_codes_record(st, "young", l, 2 * B, &c);
        kvd_pq_centroids_clear(&c);
    }
    /* the sequence keeps them through a reopen, accounted */
    kvd_store_close(st);
    st = open_store();
    memset(&info, 0, sizeof info);
    REQUIRE(kvd_store_seq_stat(st, "young", 5, &info, &err) == 0, "stat: %s", err.msg);
    CHECK(info.pq_bytes == L * (rec + kvd__pq_codes_bytes(H, M, 2 * B)), "young pq bytes %llu",
          (unsigned long long)info.pq_bytes);
    kvd_seq_info_clear(&info);

    /* appends go on during a rebuild: one that seals a page of a trained
     * layer leaves the rebuild valid; one that trains a layer of the range
     * makes the commit fail, nothing changed */
    REQUIRE(kvd_store_pq_rebuild_begin(st, "r", 1, 0, 1, &rb, &bound, &err) == 0, "begin: %s",
            err.msg);
    REQUIRE(append(st, "r", 5, 0, L, n + 5 + B, B, &err) == 0, "append during: %s", err.msg);
    REQUIRE(kvd_store_pq_rebuild_run(rb, &err) == 0, "run: %s", err.msg);
    REQUIRE(kvd_store_pq_rebuild_commit(rb, &ri, &err) == 0, "commit: %s", err.msg);
    CHECK(ri.tokens_indexed == n + B, "indexed %llu: the pages sealed at begin",
          (unsigned long long)ri.tokens_indexed);
    create_ex(st, "late", NULL, 0, 48);
    REQUIRE(append(st, "late", 7, 0, L, 0, 40, &err) == 0, "append: %s", err.msg);
    REQUIRE(kvd_store_pq_rebuild_begin(st, "late", 4, 0, 0, &rb, &bound, &err) == 0, "begin: %s",
            err.msg);
    REQUIRE(append(st, "late", 7, 0, L, 40, 10, &err) == 0, "append that trains: %s", err.msg);
    REQUIRE(get_centroids(st, "late", 0, &before) == 1, "late not trained by its append");
    REQUIRE(kvd_store_pq_rebuild_run(rb, &err) == 0, "run: %s", err.msg);
    CHECK(kvd_store_pq_rebuild_commit(rb, &ri, &err) == KVD_EABORTED,
          "commit after a training "
          "append: %s",
          err.msg);
    REQUIRE(get_centroids(st, "late", 0, &c) == 1 && c.id == before.id, "changed by the abort");
    kvd_pq_centroids_clear(&c);
    kvd_pq_centroids_clear(&before);

    /* an abort writes nothing */
    REQUIRE(get_centroids(st, "r", 0, &before) == 1, "centroids");
    REQUIRE(kvd_store_pq_rebuild_begin(st, "r", 1, 0, 1, &rb, &bound, &err) == 0, "begin: %s",
            err.msg);
    REQUIRE(kvd_store_pq_rebuild_run(rb, &err) == 0, "run: %s", err.msg);
    kvd_store_pq_rebuild_abort(rb);
    REQUIRE(get_centroids(st, "r", 0, &c) == 1 && c.id == before.id, "changed by an abort");
    kvd_pq_centroids_clear(&c);
    kvd_pq_centroids_clear(&before);
    /* errors */
    CHECK(kvd_store_pq_rebuild_begin(st, "r", 1, L, 0, &rb, &bound, &err) == KVD_EINVAL && !rb,
          "layer past the model's");
    CHECK(kvd_store_pq_rebuild_begin(st, "r", 1, 0, L + 1, &rb, &bound, &err) == KVD_EINVAL,
          "too many layers");
    CHECK(kvd_store_pq_rebuild_begin(st, "nope", 4, 0, 0, &rb, &bound, &err) == KVD_ENOTFOUND,
          "unknown sequence");
    kvd_seq_info sinfo;
    REQUIRE(kvd_store_seq_create(st, "plain", 5, "pqm", NULL, 0, NULL, 0, &sinfo, &err) == 0,
            "create: %s", err.msg);
    kvd_seq_info_clear(&sinfo);
    CHECK(kvd_store_pq_rebuild_begin(st, "plain", 5, 0, 0, &rb, &bound, &err) == KVD_EPRECOND,
          "no PQ index: %s", err.msg);
    /* the sequence is usable after the failed calls (its lock released) */
    REQUIRE(append(st, "r", 5, 0, L, n + 5 + 2 * B, 3, &err) == 0, "append after errors: %s",
            err.msg);
    free(want);
    kvd_store_close(st);
}

/* A client page (AppendPages) with a PQ section of its own: the stored page
 * carries the server's codes instead. */
static void t_given_page(void)
{
    kvd_store *st = open_store();
    put_model(st);
    kvd_error err;
    create(st, "g", NULL, 0);
    /* Build page 0 of layer 0 the client's way: raw page of the same
     * values, K INT4 is not needed for the check (the page is stored as
     * given), with a bogus PQ section. */
    kvd_page_desc d = {.dtype = KVD_DTYPE_F16,
                       .layer = 0,
                       .token_start = 0,
                       .num_tokens = B,
                       .page_tokens = B,
                       .num_kv_heads = H,
                       .head_dim = D};
    uint16_t *k = malloc(2 * (size_t)H * B * D), *v = malloc(2 * (size_t)H * B * D);
    for (uint32_t h = 0; h < H; h++)
        for (uint32_t t = 0; t < B; t++)
            for (uint32_t x = 0; x < D; x++) {
                k[((size_t)h * B + t) * D + x] = kvd_f32_to_f16(val(4, 0, 0, t, h, x));
                v[((size_t)h * B + t) * D + x] = kvd_f32_to_f16(val(4, 1, 0, t, h, x));
            }
    uint8_t *raw, *bogus, *sec;
    size_t rawlen, blen;
    REQUIRE(kvd_page_encode_raw(&d, k, v, &raw, &rawlen, &err) == 0, "encode: %s", err.msg);
    bogus = with_pq(raw, rawlen, &blen, &sec);

    uint32_t ids[B];
    for (uint32_t t = 0; t < B; t++)
        ids[t] = t + 4000;
    kvd_append_spec sp = {.seq_id = "g",
                          .seq_id_len = 1,
                          .layer_start = 0,
                          .num_layers = L,
                          .token_start = 0,
                          .num_tokens = B,
                          .dtype = KVD_DTYPE_F16,
                          .token_ids = ids,
                          .n_token_ids = B};
    kvd_append *ap;
    uint64_t exp;
    REQUIRE(kvd_store_append_begin(st, &sp, &ap, &exp, &err) == 0, "begin: %s", err.msg);
    REQUIRE(kvd_store_append_give_page(ap, 0, 0, bogus, blen, &err) == 0, "give: %s", err.msg);
    size_t cnt = 2 * (size_t)L * B * H * D, i = 0;
    uint16_t *w = malloc(cnt * 2);
    for (int part = 0; part < 2; part++)
        for (uint32_t l = 0; l < L; l++)
            for (uint32_t t = 0; t < B; t++)
                for (uint32_t h = 0; h < H; h++)
                    for (uint32_t x = 0; x < D; x++)
                        w[i++] = kvd_f32_to_f16(val(4, part, l, t, h, x));
    REQUIRE(kvd_store_append_write(ap, w, cnt * 2, &err) == 0, "write: %s", err.msg);
    REQUIRE(kvd_store_append_commit(ap, NULL, &err) == 0, "commit: %s", err.msg);
    kvd_pq_centroids c;
    REQUIRE(get_centroids(st, "g", 0, &c) == 1, "no centroids");
    kvd_page_handle ph;
    REQUIRE(kvd_store_page_acquire(st, "g", 1, 0, 0, &ph, &err) == 0, "acquire: %s", err.msg);
    kvd_page_view pv;
    REQUIRE(kvd_page_decode(ph.bytes, ph.len, &pv, &err) == 0, "decode: %s", err.msg);
    CHECK(pv.h.k_codec == KVD_CODEC_RAW && pv.h.n_sections == 3,
          "stored page: codec %u, %u "
          "sections",
          pv.h.k_codec, pv.h.n_sections);
    kvd_store_page_release(st, &ph);
    /* check_page_codes expects INT4 K; compare the codes directly. */
    REQUIRE(kvd_store_page_acquire(st, "g", 1, 0, 0, &ph, &err) == 0, "acquire: %s", err.msg);
    REQUIRE(kvd_page_decode(ph.bytes, ph.len, &pv, &err) == 0, "decode: %s", err.msg);
    kvd_page_pq pq;
    REQUIRE(kvd_page_pq_get(&pv, &pq) == 1, "no PQ section");
    CHECK(pq.centroids_id == c.id, "client's section kept");
    float keys[B * D];
    uint8_t want[B * M];
    for (uint32_t h = 0; h < H; h++) {
        keys_of(4, 0, h, 0, B, keys);
        kvd_pq_encode_ref(B, M, NB, D, keys, c.data + (size_t)h * CENT_PER_HEAD, want);
        CHECK(memcmp(want, pq.codes + (size_t)h * B * M, sizeof want) == 0, "head %u codes", h);
    }
    kvd_store_page_release(st, &ph);
    kvd_pq_centroids_clear(&c);
    /* The same append with the given page's payload skipped: the layer's
     * PQ codes need its keys, so the commit refuses it and stores nothing. */
    create(st, "g2", NULL, 0);
    sp.seq_id = "g2";
    sp.seq_id_len = 2;
    REQUIRE(kvd_store_append_begin(st, &sp, &ap, &exp, &err) == 0, "begin: %s", err.msg);
    REQUIRE(kvd_store_append_give_page(ap, 0, 0, bogus, blen, &err) == 0, "give: %s", err.msg);
    const size_t lay = (size_t)B * H * D; /* elements of one layer's K or V */
    int rc = 0;
    for (int part = 0; part < 2 && rc == 0; part++)
        for (uint32_t l = 0; l < L && rc == 0; l++)
            rc = l == 0
                     ? kvd_store_append_skip(ap, lay * 2, &err)
                     : kvd_store_append_write(ap, w + ((size_t)part * L + l) * lay, lay * 2, &err);
    REQUIRE(rc == 0, "write: %s", err.msg);
    rc = kvd_store_append_commit(ap, NULL, &err);
    CHECK(rc == KVD_EINVAL && strstr(err.msg, "PQ index"), "skip with a PQ index: %d %s", rc,
          rc ? err.msg : "");
    kvd_seq_info gi;
    REQUIRE(kvd_store_seq_stat(st, "g2", 2, &gi, &err) == 0, "stat: %s", err.msg);
    CHECK(gi.num_tokens == 0, "g2 holds %llu tokens after a refused append",
          (unsigned long long)gi.num_tokens);
    kvd_seq_info_clear(&gi);
    free(w);
    free(k);
    free(v);
    free(raw);
    free(bogus);
    kvd_store_close(st);
}

int main(void)
{
    const char *tmp = getenv("TMPDIR");
    snprintf(dir, sizeof dir, "%s/kvd-pqindex-%d", tmp && *tmp ? tmp : "/tmp", (int)getpid());
    rm_dir();
    kvd_cpu_options opt = {1, 0, 0, 0};
    REQUIRE(kvd_backend_cpu_create(&opt, &be, NULL) == 0, "cpu backend");
    t_section();
    t_store();
    rm_dir();
    t_cache();
    rm_dir();
    t_given_page();
    rm_dir();
    t_deferred();
    rm_dir();
    t_rebuild();
    rm_dir();
    kvd_backend_free(be);
    if (failures) {
        fprintf(stderr, "%d check(s) failed\n", failures);
        return 1;
    }
    printf("ok\n");
    return 0;
}
