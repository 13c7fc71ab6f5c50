/*
 * End-to-end tests of activation storage and activation-first Read (KVPR)
 * through libkvdepot against a real kvdepotd: X appended with K/V reads back
 * bit-exact; a Read with activation_tokens l (l from PlanFetch) is X of
 * [t0, t0 + l) followed by K/V of the rest, equal bit for bit to a plain
 * Read of those tokens; counts and bytes survive a restart; bad requests get
 * clear errors and change nothing; deleting a sequence removes its
 * activations; damaged X on disk is DATA_LOSS; kill -9 loses nothing
 * acknowledged.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include <rocksdb/c.h>

#include "harness.h"

#define L 3
#define H 2
#define D 16
#define HID 48

static int put_model(kvdepot_client *c, const char *name, uint32_t hidden, kvdepot_model *m)
{
    memset(m, 0, sizeof *m);
    snprintf(m->name, sizeof m->name, "%s", name);
    m->num_layers = L;
    m->num_kv_heads = H;
    m->num_q_heads = 2 * H;
    m->head_dim = D;
    m->hidden_size = hidden;
    m->dtype = KVDEPOT_DTYPE_F16;
    return kvdepot_model_put(c, m, 0, NULL, NULL);
}

static int create(kvdepot_client *c, const char *model, const char *id, int store_x)
{
    kvdepot_codecs cs;
    memset(&cs, 0, sizeof cs);
    cs.store_activations = store_x;
    kvdepot_create_args ca;
    memset(&ca, 0, sizeof ca);
    ca.id = id;
    ca.id_len = strlen(id);
    ca.model = model;
    ca.codecs = &cs;
    return kvdepot_sequence_create(c, &ca, NULL);
}

/*
 * Reference of one sequence: K, V ([layer][token][H][D]) and X
 * ([layer][token][HID]) of up to CAP tokens, f16 bytes from a seeded stream.
 */
#define CAP 1024
#define KV_TOK ((size_t)H * D * 2)
#define X_TOK ((size_t)HID * 2)

typedef struct ref {
    uint8_t k[L][CAP * KV_TOK], v[L][CAP * KV_TOK], x[L][CAP * X_TOK];
    uint64_t n;
} ref;

/* Append nt tokens to every layer (with X when with_x); the reference takes
 * them only when the server accepted. xb_delta changes the X byte count sent
 * (a wrong size). */
static int append(kvdepot_client *c, const char *id, ref *r, uint64_t nt, int with_x, long xb_delta,
                  uint64_t seed)
{
    size_t kvb = (size_t)L * nt * KV_TOK, xb = (size_t)L * nt * X_TOK;
    uint8_t *k = malloc(kvb), *v = malloc(kvb), *x = malloc(xb + 64);
    if (!k || !v || !x)
        return KVDEPOT_ENOMEM;
    fill_random(k, kvb, seed);
    fill_random(v, kvb, seed + 1);
    fill_random(x, xb + 64, seed + 2);
    kvdepot_append_args a;
    memset(&a, 0, sizeof a);
    a.id = id;
    a.id_len = strlen(id);
    a.token_start = r->n;
    a.num_tokens = nt;
    a.dtype = KVDEPOT_DTYPE_F16;
    a.k = k;
    a.k_bytes = kvb;
    a.v = v;
    a.v_bytes = kvb;
    if (with_x) {
        a.x = x;
        a.x_bytes = (size_t)((long)xb + xb_delta);
    }
    int rc = kvdepot_sequence_append(c, &a, NULL);
    if (rc == KVDEPOT_OK && r->n + nt <= CAP) {
        for (uint32_t l = 0; l < L; l++) {
            memcpy(r->k[l] + r->n * KV_TOK, k + (size_t)l * nt * KV_TOK, nt * KV_TOK);
            memcpy(r->v[l] + r->n * KV_TOK, v + (size_t)l * nt * KV_TOK, nt * KV_TOK);
            if (with_x)
                memcpy(r->x[l] + r->n * X_TOK, x + (size_t)l * nt * X_TOK, nt * X_TOK);
        }
        r->n += nt;
    }
    free(k);
    free(v);
    free(x);
    return rc;
}

/*
 * Activation-first read of layers [l0, l0 + nl) x tokens [t0, t0 + n) with
 * a of them as X (library buffers, or the caller's when caller_bufs):
 * X must equal the reference, K/V a plain Read of [t0 + a, t0 + n) and the
 * reference. Returns 0 when all hold.
 */
static int check_read(kvdepot_client *c, const char *id, const ref *r, uint32_t l0, uint32_t nl,
                      uint64_t t0, uint64_t n, uint64_t a, int caller_bufs)
{
    int bad = 0;
    kvdepot_read_args ra;
    memset(&ra, 0, sizeof ra);
    ra.id = id;
    ra.id_len = strlen(id);
    ra.layer_start = l0;
    ra.num_layers = nl;
    ra.token_start = t0;
    ra.num_tokens = n;
    ra.activation_tokens = a;
    uint8_t *bk = NULL, *bv = NULL, *bx = NULL;
    if (caller_bufs) {
        ra.capacity = (size_t)nl * (n - a) * KV_TOK + 1;
        ra.x_capacity = (size_t)nl * a * X_TOK + 1;
        ra.k = bk = malloc(ra.capacity);
        ra.v = bv = malloc(ra.capacity);
        ra.x = bx = malloc(ra.x_capacity);
    }
    kvdepot_read_result rr;
    int rc = kvdepot_sequence_read(c, &ra, &rr);
    if (rc != KVDEPOT_OK) {
        fprintf(stderr, "read layers %u+%u tokens %llu+%llu a=%llu: %s (%s)\n", l0, nl,
                (unsigned long long)t0, (unsigned long long)n, (unsigned long long)a,
                kvdepot_status_name(rc), kvdepot_errmsg(NULL));
        free(bk);
        free(bv);
        free(bx);
        return 1;
    }
    bad |= rr.activation_tokens != a || rr.token_start != t0 || rr.num_tokens != n ||
           rr.hidden_size != (a ? HID : 0) || rr.x_bytes != (size_t)nl * a * X_TOK ||
           rr.kv_bytes != (size_t)nl * (n - a) * KV_TOK;
    for (uint32_t i = 0; i < nl && !bad; i++) {
        const uint8_t *x = (const uint8_t *)rr.x + (size_t)i * a * X_TOK;
        const uint8_t *k = (const uint8_t *)rr.k + (size_t)i * (n - a) * KV_TOK;
        const uint8_t *v = (const uint8_t *)rr.v + (size_t)i * (n - a) * KV_TOK;
        bad |= a && memcmp(x, r->x[l0 + i] + t0 * X_TOK, a * X_TOK) != 0;
        bad |= n > a && memcmp(k, r->k[l0 + i] + (t0 + a) * KV_TOK, (n - a) * KV_TOK) != 0;
        bad |= n > a && memcmp(v, r->v[l0 + i] + (t0 + a) * KV_TOK, (n - a) * KV_TOK) != 0;
    }
    /* The K/V part equals a plain Read of the remaining tokens. */
    if (!bad && n > a) {
        kvdepot_read_args pa;
        memset(&pa, 0, sizeof pa);
        pa.id = id;
        pa.id_len = strlen(id);
        pa.layer_start = l0;
        pa.num_layers = nl;
        pa.token_start = t0 + a;
        pa.num_tokens = n - a;
        kvdepot_read_result pr;
        rc = kvdepot_sequence_read(c, &pa, &pr);
        bad |= rc != KVDEPOT_OK || pr.kv_bytes != rr.kv_bytes ||
               memcmp(pr.k, rr.k, rr.kv_bytes) != 0 || memcmp(pr.v, rr.v, rr.kv_bytes) != 0;
        if (rc == KVDEPOT_OK)
            kvdepot_free(pr.owned);
    }
    if (bad)
        fprintf(stderr, "read layers %u+%u tokens %llu+%llu a=%llu%s: wrong bytes or header\n", l0,
                nl, (unsigned long long)t0, (unsigned long long)n, (unsigned long long)a,
                caller_bufs ? " (caller buffers)" : "");
    kvdepot_free(rr.owned);
    free(bk);
    free(bv);
    free(bx);
    return bad;
}

static uint64_t act_tokens(kvdepot_client *c, const char *id, uint64_t *stored_bytes,
                           uint64_t *num_tokens)
{
    kvdepot_sequence_info si;
    if (kvdepot_sequence_stat(c, id, strlen(id), &si) != KVDEPOT_OK)
        return UINT64_MAX;
    uint64_t a = si.activation_tokens;
    if (stored_bytes)
        *stored_bytes = si.stored_bytes;
    if (num_tokens)
        *num_tokens = si.num_tokens;
    kvdepot_sequence_info_clear(&si);
    return a;
}

static ref *new_ref(void)
{
    return calloc(1, sizeof(ref));
}

/* Appends that cut blocks in several places (page_tokens 256): 300, 1, 99,
 * 150, 150 = 700 tokens, then reads over ranges, layers and splits. */
static int t_roundtrip(kvd_harness *h)
{
    kvdepot_client *c = harness_client(h);
    REQUIRE(c);
    kvdepot_model m;
    REQUIRE_RC(put_model(c, "act", HID, &m), KVDEPOT_OK);
    ref *r = new_ref(), *r0 = new_ref();
    REQUIRE(r && r0);
    REQUIRE_RC(create(c, "act", "s", 1), KVDEPOT_OK);
    REQUIRE_RC(create(c, "act", "twin", 0), KVDEPOT_OK);
    CHECK(act_tokens(c, "s", NULL, NULL) == 0);
    const uint64_t steps[] = {300, 1, 99, 150, 150};
    for (size_t i = 0; i < 5; i++) {
        REQUIRE_RC(append(c, "s", r, steps[i], 1, 0, 100 + i), KVDEPOT_OK);
        /* The same K/V without X: stored bytes differ by X alone. */
        REQUIRE_RC(append(c, "twin", r0, steps[i], 0, 0, 100 + i), KVDEPOT_OK);
        CHECK(act_tokens(c, "s", NULL, NULL) == r->n);
    }
    uint64_t sb = 0, sb0 = 0, n;
    CHECK(act_tokens(c, "s", &sb, &n) == 700 && n == 700);
    CHECK(act_tokens(c, "twin", &sb0, NULL) == 0);
    CHECK(sb - sb0 == (uint64_t)L * 700 * X_TOK);

    struct {
        uint32_t l0, nl;
        uint64_t t0, n, a;
    } cases[] = {
        {0, 0, 0, 0, 700},    /* all X */
        {0, 3, 0, 700, 1},    /* one token of X */
        {0, 3, 0, 700, 256},  /* a block boundary */
        {0, 3, 0, 700, 301},  /* inside a record */
        {1, 2, 10, 600, 390}, /* offset range, layer subset */
        {2, 1, 255, 2, 1},    /* across the first block end */
        {0, 3, 699, 1, 1},    {0, 1, 300, 400, 400},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        uint32_t nl = cases[i].nl ? cases[i].nl : L;
        uint64_t nt = cases[i].n ? cases[i].n : 700 - cases[i].t0;
        if (check_read(c, "s", r, cases[i].l0, nl, cases[i].t0, nt, cases[i].a, (int)(i & 1)))
            kvd_test_failures++;
    }
    /* A small chunk size cuts X and K/V in odd places of the stream. */
    kvdepot_options o;
    kvdepot_options_init(&o);
    o.wait_for_ready = 1;
    o.chunk_bytes = 4096; /* not a multiple of a token of X or K/V */
    kvdepot_client *c2 = harness_client_opts(h, &o);
    REQUIRE(c2);
    if (check_read(c2, "s", r, 0, L, 5, 690, 333, 0))
        kvd_test_failures++;
    kvdepot_close(c2);

    /* PlanFetch: the sequence's stored activations bound the split; l from
     * it reads back as above. The twin has none: a plain fetch. */
    kvdepot_fetch_plan p, p0, pa;
    const double bws[] = {1e6, 1e8, 1e9, 1e10};
    int interior = 0;
    for (size_t i = 0; i < 4; i++) {
        double rate = 1e11;
        REQUIRE_RC(kvdepot_plan_fetch(c, "s", 1, bws[i], rate, 0, 0, 0, &p), KVDEPOT_OK);
        REQUIRE_RC(kvdepot_plan_fetch(c, "s", 1, bws[i], rate, 0, 0, 1, &pa), KVDEPOT_OK);
        REQUIRE_RC(kvdepot_plan_fetch(c, "twin", 4, bws[i], rate, 0, 0, 0, &p0), KVDEPOT_OK);
        CHECK(p0.split_tokens == 0);
        /* Every token has activations: the same plan as assuming them. */
        CHECK(p.split_tokens == pa.split_tokens && p.split_tokens <= 700);
        CHECK(p.kv_bytes_per_token == p0.kv_bytes_per_token);
        interior += p.split_tokens > 0 && p.split_tokens < 700;
        if (check_read(c, "s", r, 0, L, 0, 700, p.split_tokens, 0))
            kvd_test_failures++;
    }
    CHECK(interior > 0);
    free(r);
    free(r0);
    kvdepot_close(c);
    return 0;
}

/* Counts and X survive a restart; appends with X continue after it. */
static int t_restart(kvd_harness *h)
{
    kvdepot_client *c = harness_client(h);
    REQUIRE(c);
    kvdepot_model m;
    REQUIRE_RC(put_model(c, "act", HID, &m), KVDEPOT_OK);
    ref *r = new_ref();
    REQUIRE(r);
    REQUIRE_RC(create(c, "act", "s", 1), KVDEPOT_OK);
    REQUIRE_RC(append(c, "s", r, 260, 1, 0, 7), KVDEPOT_OK);
    uint64_t sb_before = 0, sb_after = 0;
    CHECK(act_tokens(c, "s", &sb_before, NULL) == 260);
    kvdepot_stats st0, st1;
    REQUIRE_RC(kvdepot_stats_get(c, &st0), KVDEPOT_OK);
    REQUIRE(harness_restart(h) == 0);
    CHECK(act_tokens(c, "s", &sb_after, NULL) == 260);
    CHECK(sb_after == sb_before);
    REQUIRE_RC(kvdepot_stats_get(c, &st1), KVDEPOT_OK);
    CHECK(st1.tiers[2].bytes == st0.tiers[2].bytes);
    if (check_read(c, "s", r, 0, L, 0, 260, 260, 0) || check_read(c, "s", r, 0, L, 3, 250, 100, 1))
        kvd_test_failures++;
    REQUIRE_RC(append(c, "s", r, 10, 1, 0, 8), KVDEPOT_OK);
    CHECK(act_tokens(c, "s", NULL, NULL) == 270);
    if (check_read(c, "s", r, 0, L, 0, 270, 265, 0))
        kvd_test_failures++;
    free(r);
    kvdepot_close(c);
    return 0;
}

/* Bad requests: clear status, nothing changed. */
static int t_errors(kvd_harness *h)
{
    kvdepot_client *c = harness_client(h);
    REQUIRE(c);
    kvdepot_model m, m0;
    REQUIRE_RC(put_model(c, "act", HID, &m), KVDEPOT_OK);
    REQUIRE_RC(put_model(c, "nohidden", 0, &m0), KVDEPOT_OK);
    ref *r = new_ref(), *rp = new_ref();
    REQUIRE(r && rp);

    /* A model without hidden_size cannot store activations. */
    CHECK_RC(create(c, "nohidden", "x0", 1), KVDEPOT_EPRECOND);
    CHECK(strstr(kvdepot_errmsg(NULL), "hidden_size") != NULL);
    CHECK(act_tokens(c, "x0", NULL, NULL) == UINT64_MAX); /* not created */
    /* Nor a sequence starting from a shared prefix. */
    kvdepot_codecs cs;
    memset(&cs, 0, sizeof cs);
    cs.store_activations = 1;
    uint64_t hash = 1234;
    kvdepot_create_args ca;
    memset(&ca, 0, sizeof ca);
    ca.id = "x1";
    ca.id_len = 2;
    ca.model = "act";
    ca.codecs = &cs;
    ca.prefix_hashes = &hash;
    ca.num_prefix_hashes = 1;
    CHECK_RC(kvdepot_sequence_create(c, &ca, NULL), KVDEPOT_EINVAL);
    CHECK(act_tokens(c, "x1", NULL, NULL) == UINT64_MAX);

    /* X for a sequence created without store_activations. */
    REQUIRE_RC(create(c, "act", "plain", 0), KVDEPOT_OK);
    REQUIRE_RC(append(c, "plain", rp, 20, 0, 0, 1), KVDEPOT_OK);
    CHECK_RC(append(c, "plain", rp, 5, 1, 0, 2), KVDEPOT_EPRECOND);
    CHECK(strstr(kvdepot_errmsg(NULL), "store_activations") != NULL);
    uint64_t n;
    CHECK(act_tokens(c, "plain", NULL, &n) == 0 && n == 20);
    /* Activation-first read of it. */
    kvdepot_read_args ra;
    memset(&ra, 0, sizeof ra);
    ra.id = "plain";
    ra.id_len = 5;
    ra.activation_tokens = 1;
    kvdepot_read_result rr;
    CHECK_RC(kvdepot_sequence_read(c, &ra, &rr), KVDEPOT_EPRECOND);

    REQUIRE_RC(create(c, "act", "s", 1), KVDEPOT_OK);
    REQUIRE_RC(append(c, "s", r, 40, 1, 0, 3), KVDEPOT_OK);
    uint64_t sb = 0;
    REQUIRE(act_tokens(c, "s", &sb, NULL) == 40);
    /* Wrong X sizes: one byte short, one byte over, the X of one token too few. */
    CHECK_RC(append(c, "s", r, 10, 1, -1, 4), KVDEPOT_EINVAL);
    CHECK_RC(append(c, "s", r, 10, 1, 1, 4), KVDEPOT_EINVAL);
    CHECK_RC(append(c, "s", r, 10, 1, -(long)(L * X_TOK), 4), KVDEPOT_EINVAL);
    uint64_t sb2;
    CHECK(act_tokens(c, "s", &sb2, &n) == 40 && n == 40 && sb2 == sb);

    /* Reads: more X than stored, more than the range, pages format, caller
     * buffers without one for X. */
    ra.id = "s";
    ra.id_len = 1;
    ra.num_tokens = 0;
    ra.activation_tokens = 41;
    CHECK_RC(kvdepot_sequence_read(c, &ra, &rr), KVDEPOT_EINVAL); /* > the 40 read */
    ra.token_start = 30;
    ra.num_tokens = 10;
    ra.activation_tokens = 11;
    CHECK_RC(kvdepot_sequence_read(c, &ra, &rr), KVDEPOT_EINVAL);
    kvdepot_page *pages = NULL;
    size_t np = 0;
    ra.activation_tokens = 5;
    CHECK_RC(kvdepot_sequence_read_pages(c, &ra, &pages, &np), KVDEPOT_EINVAL);
    CHECK(strstr(kvdepot_errmsg(NULL), "decoded") != NULL);
    kvdepot_pages_free(pages, np);
    uint8_t buf[64];
    ra.k = ra.v = buf;
    ra.capacity = sizeof buf;
    CHECK_RC(kvdepot_sequence_read(c, &ra, &rr), KVDEPOT_EINVAL);
    ra.k = ra.v = NULL;
    ra.capacity = 0;

    /* A gap: an append without X is accepted, then X can no longer follow. */
    REQUIRE_RC(append(c, "s", r, 5, 0, 0, 5), KVDEPOT_OK);
    CHECK(act_tokens(c, "s", NULL, &n) == 40 && n == 45);
    CHECK_RC(append(c, "s", r, 5, 1, 0, 6), KVDEPOT_EPRECOND);
    CHECK(strstr(kvdepot_errmsg(NULL), "earlier token") != NULL);
    CHECK(act_tokens(c, "s", NULL, &n) == 40 && n == 45);
    /* Tokens past the stored activations. */
    ra.token_start = 0;
    ra.num_tokens = 0;
    ra.activation_tokens = 41;
    CHECK_RC(kvdepot_sequence_read(c, &ra, &rr), KVDEPOT_ERANGE);
    ra.token_start = 39;
    ra.activation_tokens = 2;
    CHECK_RC(kvdepot_sequence_read(c, &ra, &rr), KVDEPOT_ERANGE);
    /* What is stored still reads back: X of [0, 40), K/V of the rest. */
    if (check_read(c, "s", r, 0, L, 0, 45, 40, 0))
        kvd_test_failures++;
    /* PlanFetch bounds the split by the 40 tokens with X. */
    kvdepot_fetch_plan p;
    REQUIRE_RC(kvdepot_plan_fetch(c, "s", 1, 1e6, 1e15, 0, 0, 0, &p), KVDEPOT_OK);
    CHECK(p.split_tokens == 40);
    REQUIRE_RC(kvdepot_plan_fetch(c, "s", 1, 1e6, 1e15, 0, 0, 1, &p), KVDEPOT_OK);
    CHECK(p.split_tokens == 45);

    /* A header announcing more tokens than their X bytes can count. */
    REQUIRE_RC(create(c, "act", "big", 1), KVDEPOT_OK);
    uint8_t tiny[64];
    kvdepot_append_args ba;
    memset(&ba, 0, sizeof ba);
    ba.id = "big";
    ba.id_len = 3;
    ba.num_tokens = UINT64_MAX / (2 * L * KV_TOK);
    ba.dtype = KVDEPOT_DTYPE_F16;
    ba.k = ba.v = ba.x = tiny;
    ba.k_bytes = ba.v_bytes = ba.x_bytes = sizeof tiny;
    CHECK_RC(kvdepot_sequence_append(c, &ba, NULL), KVDEPOT_ENOMEM);
    CHECK(act_tokens(c, "big", NULL, &n) == 0 && n == 0);

    /* X on some layers only: the sequence's count is the minimum, and a
     * layer behind cannot skip ahead. */
    REQUIRE_RC(create(c, "act", "part", 1), KVDEPOT_OK);
    uint8_t kx[2 * KV_TOK * 4], xx[X_TOK * 4];
    fill_random(kx, sizeof kx, 9);
    fill_random(xx, sizeof xx, 10);
    kvdepot_append_args a;
    memset(&a, 0, sizeof a);
    a.id = "part";
    a.id_len = 4;
    a.layer_start = 1;
    a.num_layers = 1;
    a.num_tokens = 4;
    a.dtype = KVDEPOT_DTYPE_F16;
    a.k = kx;
    a.k_bytes = a.v_bytes = KV_TOK * 4;
    a.v = kx + KV_TOK * 4;
    a.x = xx;
    a.x_bytes = sizeof xx;
    CHECK_RC(kvdepot_sequence_append(c, &a, NULL), KVDEPOT_OK);
    CHECK(act_tokens(c, "part", NULL, NULL) == 0);
    a.layer_start = 0;
    a.num_layers = 2; /* layer 1 is ahead: token_start 0 is not its end */
    CHECK_RC(kvdepot_sequence_append(c, &a, NULL), KVDEPOT_EPRECOND);
    memset(&ra, 0, sizeof ra);
    ra.id = "part";
    ra.id_len = 4;
    ra.layer_start = 1;
    ra.num_layers = 1;
    ra.activation_tokens = 4;
    CHECK_RC(kvdepot_sequence_read(c, &ra, &rr), KVDEPOT_OK);
    CHECK(rr.x_bytes == sizeof xx && memcmp(rr.x, xx, sizeof xx) == 0 && rr.kv_bytes == 0);
    kvdepot_free(rr.owned);
    ra.layer_start = 0;
    ra.num_layers = 2;
    /* Layer 0 holds no tokens at all: 4 exceed the range read. */
    CHECK_RC(kvdepot_sequence_read(c, &ra, &rr), KVDEPOT_EINVAL);

    free(r);
    free(rp);
    kvdepot_close(c);
    return 0;
}

/* Deleting a sequence (or its model) removes its activations: the disk bytes
 * go back, and a new sequence of the same id starts without any. */
static int t_delete(kvd_harness *h)
{
    kvdepot_client *c = harness_client(h);
    REQUIRE(c);
    kvdepot_model m;
    REQUIRE_RC(put_model(c, "act", HID, &m), KVDEPOT_OK);
    kvdepot_stats s0, s1, s2;
    REQUIRE_RC(kvdepot_stats_get(c, &s0), KVDEPOT_OK);
    ref *r = new_ref();
    REQUIRE(r);
    REQUIRE_RC(create(c, "act", "d", 1), KVDEPOT_OK);
    REQUIRE_RC(append(c, "d", r, 300, 1, 0, 11), KVDEPOT_OK);
    REQUIRE_RC(kvdepot_stats_get(c, &s1), KVDEPOT_OK);
    CHECK(s1.tiers[2].bytes >= s0.tiers[2].bytes + (uint64_t)L * 300 * X_TOK);
    REQUIRE_RC(kvdepot_sequence_delete(c, "d", 1, NULL), KVDEPOT_OK);
    REQUIRE_RC(kvdepot_stats_get(c, &s2), KVDEPOT_OK);
    CHECK(s2.tiers[2].bytes == s0.tiers[2].bytes);

    /* Same id again: no activations, and new X reads back (not the old). */
    memset(r, 0, sizeof *r);
    REQUIRE_RC(create(c, "act", "d", 1), KVDEPOT_OK);
    CHECK(act_tokens(c, "d", NULL, NULL) == 0);
    kvdepot_read_args ra;
    memset(&ra, 0, sizeof ra);
    ra.id = "d";
    ra.id_len = 1;
    ra.activation_tokens = 1;
    kvdepot_read_result rr;
    CHECK_RC(kvdepot_sequence_read(c, &ra, &rr), KVDEPOT_EINVAL); /* 0 tokens stored */
    REQUIRE_RC(append(c, "d", r, 100, 1, 0, 12), KVDEPOT_OK);
    if (check_read(c, "d", r, 0, L, 0, 100, 100, 0))
        kvd_test_failures++;
    /* After a restart the deleted records stay gone. */
    REQUIRE(harness_restart(h) == 0);
    CHECK(act_tokens(c, "d", NULL, NULL) == 100);
    if (check_read(c, "d", r, 0, L, 0, 100, 100, 0))
        kvd_test_failures++;

    /* Deleting the model (force) takes its sequences' activations too. */
    REQUIRE_RC(kvdepot_model_delete(c, "act", 1, NULL), KVDEPOT_OK);
    REQUIRE_RC(kvdepot_stats_get(c, &s2), KVDEPOT_OK);
    CHECK(s2.tiers[2].bytes == s0.tiers[2].bytes);
    free(r);
    kvdepot_close(c);
    return 0;
}

/* Change the X record of `layer` starting at `token` on disk (server
 * stopped): flip one byte, or (remove) delete the record. 0 or -1. */
static int damage_record(const char *dir, uint32_t layer, uint64_t token, int remove)
{
    rocksdb_options_t *o = rocksdb_options_create();
    char *e = NULL;
    rocksdb_t *db = rocksdb_open(o, dir, &e);
    if (e) {
        fprintf(stderr, "rocksdb_open %s: %s\n", dir, e);
        rocksdb_free(e);
        rocksdb_options_destroy(o);
        return -1;
    }
    rocksdb_readoptions_t *ro = rocksdb_readoptions_create();
    rocksdb_writeoptions_t *wo = rocksdb_writeoptions_create();
    rocksdb_writeoptions_set_sync(wo, 1);
    /* 'x' be16 id_len id be32 layer be64 token (store/activation.h), id "s". */
    uint8_t key[1 + 2 + 1 + 4 + 8] = {'x', 0, 1, 's'};
    for (int i = 0; i < 4; i++)
        key[4 + i] = (uint8_t)(layer >> (24 - 8 * i));
    for (int i = 0; i < 8; i++)
        key[8 + i] = (uint8_t)(token >> (56 - 8 * i));
    size_t vl = 0;
    char *v = rocksdb_get(db, ro, (const char *)key, sizeof key, &vl, &e);
    int rc = -1;
    if (!e && v && vl > 8) {
        if (remove) {
            rocksdb_delete(db, wo, (const char *)key, sizeof key, &e);
        } else {
            v[vl / 3] ^= 0x10;
            rocksdb_put(db, wo, (const char *)key, sizeof key, v, vl, &e);
        }
        rc = e ? -1 : 0;
    }
    if (e) {
        fprintf(stderr, "rocksdb: %s\n", e);
        rocksdb_free(e);
    }
    rocksdb_free(v);
    rocksdb_readoptions_destroy(ro);
    rocksdb_writeoptions_destroy(wo);
    rocksdb_close(db);
    rocksdb_options_destroy(o);
    return rc;
}

/* Damaged X on disk is DATA_LOSS, never wrong bytes; the rest still reads. */
static int t_corrupt(kvd_harness *h)
{
    kvdepot_client *c = harness_client(h);
    REQUIRE(c);
    kvdepot_model m;
    REQUIRE_RC(put_model(c, "act", HID, &m), KVDEPOT_OK);
    ref *r = new_ref();
    REQUIRE(r);
    REQUIRE_RC(create(c, "act", "s", 1), KVDEPOT_OK);
    REQUIRE_RC(append(c, "s", r, 300, 1, 0, 21), KVDEPOT_OK); /* records at 0 and 256 */
    REQUIRE(harness_stop(h) == 0);
    REQUIRE(damage_record(h->data_dir, 1, 0, 0) == 0);
    REQUIRE(damage_record(h->data_dir, 2, 256, 1) == 0);
    REQUIRE(harness_start(h) == 0);
    kvdepot_read_args ra;
    memset(&ra, 0, sizeof ra);
    ra.id = "s";
    ra.id_len = 1;
    ra.activation_tokens = 10;
    kvdepot_read_result rr;
    CHECK_RC(kvdepot_sequence_read(c, &ra, &rr), KVDEPOT_ECORRUPT); /* layer 1 flipped */
    kvdepot_stats st;
    CHECK_RC(kvdepot_stats_get(c, &st), KVDEPOT_OK);
    CHECK(st.checksum_failures == 1);
    ra.layer_start = 2;
    ra.num_layers = 1;
    ra.activation_tokens = 300;
    CHECK_RC(kvdepot_sequence_read(c, &ra, &rr), KVDEPOT_ECORRUPT); /* layer 2 record gone */
    /* Untouched records and the K/V read back exactly. */
    if (check_read(c, "s", r, 0, 1, 0, 300, 300, 0) ||
        check_read(c, "s", r, 2, 1, 0, 300, 256, 0) ||
        check_read(c, "s", r, 1, 1, 256, 44, 44, 0) || check_read(c, "s", r, 0, L, 0, 300, 0, 0))
        kvd_test_failures++;
    free(r);
    kvdepot_close(c);
    return 0;
}

/* Keys of the X records of sequence "s" on layer `layer` (server stopped):
 * their first tokens into starts[], their count returned (-1 on error). */
static int list_records(const char *dir, uint32_t layer, uint64_t *starts, int cap)
{
    rocksdb_options_t *o = rocksdb_options_create();
    char *e = NULL;
    rocksdb_t *db = rocksdb_open(o, dir, &e);
    if (e) {
        fprintf(stderr, "rocksdb_open %s: %s\n", dir, e);
        rocksdb_free(e);
        rocksdb_options_destroy(o);
        return -1;
    }
    rocksdb_readoptions_t *ro = rocksdb_readoptions_create();
    rocksdb_iterator_t *it = rocksdb_create_iterator(db, ro);
    uint8_t pre[8] = {'x', 0, 1, 's'};
    for (int i = 0; i < 4; i++)
        pre[4 + i] = (uint8_t)(layer >> (24 - 8 * i));
    int n = 0;
    for (rocksdb_iter_seek(it, (const char *)pre, sizeof pre); rocksdb_iter_valid(it);
         rocksdb_iter_next(it)) {
        size_t kl;
        const uint8_t *k = (const uint8_t *)rocksdb_iter_key(it, &kl);
        if (kl != sizeof pre + 8 || memcmp(k, pre, sizeof pre) != 0)
            break;
        uint64_t t = 0;
        for (int i = 0; i < 8; i++)
            t = t << 8 | k[sizeof pre + i];
        if (n < cap)
            starts[n] = t;
        n++;
    }
    rocksdb_iter_destroy(it);
    rocksdb_readoptions_destroy(ro);
    rocksdb_close(db);
    rocksdb_options_destroy(o);
    return n;
}

/* Decode-style appends of one token each: the append completing a block
 * folds the block's records into one; the X reads back exactly throughout. */
static int t_merge(kvd_harness *h)
{
    kvdepot_client *c = harness_client(h);
    REQUIRE(c);
    kvdepot_model m;
    REQUIRE_RC(put_model(c, "act", HID, &m), KVDEPOT_OK);
    ref *r = new_ref();
    REQUIRE(r);
    REQUIRE_RC(create(c, "act", "s", 1), KVDEPOT_OK);
    REQUIRE_RC(append(c, "s", r, 250, 1, 0, 41), KVDEPOT_OK);
    for (uint64_t i = 0; i < 10; i++) {
        REQUIRE_RC(append(c, "s", r, 1, 1, 0, 50 + i), KVDEPOT_OK);
        if (check_read(c, "s", r, 0, L, 0, r->n, r->n, (int)(i & 1)))
            kvd_test_failures++;
    }
    REQUIRE_RC(append(c, "s", r, 300, 1, 0, 60), KVDEPOT_OK); /* 260..560: block 1 completes */
    if (check_read(c, "s", r, 0, L, 0, 560, 560, 0) ||
        check_read(c, "s", r, 0, L, 200, 300, 100, 1))
        kvd_test_failures++;
    REQUIRE(harness_stop(h) == 0);
    uint64_t starts[16];
    for (uint32_t l = 0; l < L; l++) {
        /* Block 0: one record (250 + 6 singles folded); block 1: one (4
         * singles and the 256..511 part of the last append); block 2: the
         * last append's 512..560. */
        int n = list_records(h->data_dir, l, starts, 16);
        if (n != 3 || starts[0] != 0 || starts[1] != 256 || starts[2] != 512) {
            fprintf(stderr, "layer %u: %d records (want 3 at 0, 256, 512)\n", l, n);
            kvd_test_failures++;
        }
    }
    REQUIRE(harness_start(h) == 0);
    if (check_read(c, "s", r, 0, L, 0, 560, 560, 0) || check_read(c, "s", r, 1, 2, 255, 10, 3, 0))
        kvd_test_failures++;
    free(r);
    kvdepot_close(c);
    return 0;
}

/* kill -9 right after appends: what was acknowledged is there, X and counts. */
static int t_crash(kvd_harness *h)
{
    kvdepot_client *c = harness_client(h);
    REQUIRE(c);
    kvdepot_model m;
    REQUIRE_RC(put_model(c, "act", HID, &m), KVDEPOT_OK);
    ref *r = new_ref();
    REQUIRE(r);
    REQUIRE_RC(create(c, "act", "s", 1), KVDEPOT_OK);
    for (uint64_t i = 0; i < 6; i++)
        REQUIRE_RC(append(c, "s", r, 50, 1, 0, 30 + i), KVDEPOT_OK);
    harness_kill(h);
    kvdepot_close(c);
    REQUIRE(harness_start(h) == 0);
    c = harness_client(h);
    REQUIRE(c);
    uint64_t n = 0, a = act_tokens(c, "s", NULL, &n);
    if (a != 300 || n != 300) {
        fprintf(stderr, "after kill -9: %llu tokens, %llu with activations; want 300, 300\n",
                (unsigned long long)n, (unsigned long long)a);
        kvd_test_failures++;
    }
    if (check_read(c, "s", r, 0, L, 0, 300, 300, 0) || check_read(c, "s", r, 0, L, 0, 300, 123, 1))
        kvd_test_failures++;
    free(r);
    kvdepot_close(c);
    return 0;
}

static const kvd_test tests[] = {
    {"roundtrip", t_roundtrip}, {"restart", t_restart}, {"errors", t_errors}, {"delete", t_delete},
    {"corrupt", t_corrupt},     {"crash", t_crash},     {"merge", t_merge},
};

int main(int argc, char **argv)
{
    return harness_main(argc, argv, tests, sizeof tests / sizeof tests[0]);
}
