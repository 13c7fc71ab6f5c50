/*
 * Several kvdepotd on loopback behind one libkvdepot client given the list
 * of their addresses: keys spread evenly, a killed server turns its keys
 * into quick misses while the others keep working, and a server added to
 * the list takes over about 1/N of the keys, all of them moving onto it.
 *
 * Each test gets the harness's server plus more started here.
 */
#include "harness.h"
#include "kvdepot/tensor.h"

#include <netdb.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>

#define NSEQ 3000
#define MAXS 4

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static kvdepot_model tiny_model(void)
{
    kvdepot_model m;
    memset(&m, 0, sizeof m);
    strcpy(m.name, "shard-tiny");
    m.num_layers = 2;
    m.num_kv_heads = 1;
    m.head_dim = 8;
    m.dtype = KVDEPOT_DTYPE_F16;
    return m;
}

/* The servers of one test: hs[0] is the harness's own. */
typedef struct cluster {
    kvd_harness *hs[MAXS];
    kvd_harness extra[MAXS - 1];
    size_t n;
} cluster;

static int cluster_start(cluster *cl, kvd_harness *h, size_t n)
{
    memset(cl, 0, sizeof *cl);
    cl->hs[0] = h;
    if (harness_start_many(cl->extra, n - 1, h->server_bin) != 0)
        return -1;
    for (size_t i = 1; i < n; i++)
        cl->hs[i] = &cl->extra[i - 1];
    cl->n = n;
    return 0;
}

static void cluster_stop(cluster *cl)
{
    for (size_t i = 1; i < cl->n; i++)
        harness_destroy(cl->hs[i], kvd_test_failures > 0);
}

static kvdepot_client *connect_list(const char *addr)
{
    kvdepot_options opt;
    kvdepot_options_init(&opt);
    opt.address = addr;
    opt.deadline_ms = 60000;
    /* A loaded CI machine may take more than the default second to connect
     * (TLS handshakes); a killed server is still refused at once. */
    opt.connect_timeout_ms = 10000;
    kvdepot_client *c = NULL;
    if (kvdepot_connect(&opt, &c) != KVDEPOT_OK)
        fprintf(stderr, "connect %s: %s\n", addr, kvdepot_errmsg(NULL));
    return c;
}

static void seq_id(char *buf, size_t cap, int i)
{
    snprintf(buf, cap, "seq-%05d", i);
}

static int create_all(kvdepot_client *c, const char *model)
{
    for (int i = 0; i < NSEQ; i++) {
        char id[32];
        seq_id(id, sizeof id, i);
        kvdepot_create_args a = {.id = id, .id_len = strlen(id), .model = model};
        REQUIRE_RC(kvdepot_sequence_create(c, &a, NULL), KVDEPOT_OK);
    }
    return 0;
}

/* Index in cl of the server named addr, or -1. */
static int server_of(const cluster *cl, const char *addr)
{
    for (size_t i = 0; i < cl->n; i++)
        if (strcmp(cl->hs[i]->addr, addr) == 0)
            return (int)i;
    return -1;
}

/* owner[i] = index of the server owning seq i. */
static int owners(kvdepot_client *c, const cluster *cl, int *owner)
{
    for (int i = 0; i < NSEQ; i++) {
        char id[32], name[256];
        seq_id(id, sizeof id, i);
        REQUIRE_RC(kvdepot_shard_owner(c, id, strlen(id), name, sizeof name), KVDEPOT_OK);
        owner[i] = server_of(cl, name);
        REQUIRE(owner[i] >= 0);
    }
    return 0;
}

static int test_spread(kvd_harness *h)
{
    cluster cl;
    REQUIRE(cluster_start(&cl, h, 3) == 0);
    char addr[512];
    harness_addr_list(cl.hs, cl.n, addr, sizeof addr);
    kvdepot_client *c = connect_list(addr);
    REQUIRE(c);
    CHECK(kvdepot_shard_count(c) == 3);

    kvdepot_serving serving = KVDEPOT_SERVING_UNKNOWN;
    CHECK_RC(kvdepot_health_check(c, NULL, &serving), KVDEPOT_OK);
    CHECK(serving == KVDEPOT_SERVING);

    /* Models go everywhere. */
    kvdepot_model m = tiny_model();
    int created = 0;
    CHECK_RC(kvdepot_model_put(c, &m, 0, NULL, &created), KVDEPOT_OK);
    CHECK(created == 1);
    for (size_t i = 0; i < cl.n; i++) {
        kvdepot_client *one = harness_client(cl.hs[i]);
        kvdepot_model got;
        CHECK_RC(kvdepot_model_get(one, m.name, &got), KVDEPOT_OK);
        kvdepot_close(one);
    }
    kvdepot_model *list = NULL;
    size_t nlist = 0;
    CHECK_RC(kvdepot_model_list(c, &list, &nlist), KVDEPOT_OK);
    CHECK(nlist == 1);
    kvdepot_free(list);

    if (create_all(c, m.name) != 0)
        goto out;
    int *owner = calloc(NSEQ, sizeof *owner);
    REQUIRE(owner);
    if (owners(c, &cl, owner) != 0) {
        free(owner);
        goto out;
    }
    size_t per[MAXS] = {0};
    for (int i = 0; i < NSEQ; i++)
        per[owner[i]]++;
    free(owner);
    /* Within 10 % of even, and each server holds exactly what the
     * placement says it owns. */
    for (size_t i = 0; i < cl.n; i++) {
        printf("server %zu (%s): %zu of %d sequences\n", i, cl.hs[i]->addr, per[i], NSEQ);
        CHECK(per[i] >= NSEQ / 3 * 9 / 10 && per[i] <= NSEQ / 3 * 11 / 10);
        kvdepot_client *one = harness_client(cl.hs[i]);
        kvdepot_sequence_info *seqs = NULL;
        size_t nseqs = 0;
        CHECK_RC(kvdepot_sequence_list(one, m.name, &seqs, &nseqs), KVDEPOT_OK);
        CHECK(nseqs == per[i]);
        kvdepot_sequence_list_free(seqs, nseqs);
        kvdepot_close(one);
    }
    kvdepot_sequence_info *all = NULL;
    size_t nall = 0;
    CHECK_RC(kvdepot_sequence_list(c, m.name, &all, &nall), KVDEPOT_OK);
    CHECK(nall == NSEQ);
    kvdepot_sequence_list_free(all, nall);

    /* Data round trip and delete through the sharded client. */
    ref_seq r;
    REQUIRE(ref_init(&r, "seq-00007", &m, 600) == 0);
    CHECK_RC(ref_append(c, &r, 0, 2, 300, 7, NULL), KVDEPOT_OK);
    CHECK(ref_verify(c, &r) == 0);
    ref_free(&r);
    uint64_t pages = 0;
    CHECK_RC(kvdepot_sequence_evict(c, "seq-00007", 9, &pages, NULL), KVDEPOT_OK);
    /* RPCs the sharded client does not place say so instead of guessing. */
    kvdepot_stats st;
    CHECK_RC(kvdepot_stats_get(c, &st), KVDEPOT_EUNSUPP);
    uint64_t freed = 0;
    CHECK_RC(kvdepot_sequence_delete(c, "seq-00007", 9, &freed), KVDEPOT_OK);
    CHECK_RC(kvdepot_sequence_stat(c, "seq-00007", 9, NULL), KVDEPOT_ENOTFOUND);

    /* Hash tags: an id tagged with a chain's first block hash lives where
     * that chain is looked up. */
    char tag[19], tagged[64], o1[256], o2[256];
    CHECK_RC(kvdepot_shard_prefix_tag(0x0123456789abcdefULL, tag, sizeof tag), KVDEPOT_OK);
    CHECK(strcmp(tag, "{0123456789abcdef}") == 0);
    snprintf(tagged, sizeof tagged, "%sreq-1", tag);
    CHECK_RC(kvdepot_shard_owner(c, tagged, strlen(tagged), o1, sizeof o1), KVDEPOT_OK);
    CHECK_RC(kvdepot_shard_owner(c, "0123456789abcdef", 16, o2, sizeof o2), KVDEPOT_OK);
    CHECK(strcmp(o1, o2) == 0);

    /* An engine chain lives with the key of its first name: a sequence
     * tagged with it, appended with engine names, is found by a lookup
     * through the sharded client. */
    {
        const uint32_t B = 16, P = 256, r = P / B;
        uint8_t names[16 * 32];
        for (size_t i = 0; i < sizeof names; i++)
            names[i] = (uint8_t)(i * 131 + 7);
        CHECK_RC(kvdepot_shard_prefix_tag(kvdepot_engine_hash_key(names, 32), tag, sizeof tag),
                 KVDEPOT_OK);
        snprintf(tagged, sizeof tagged, "%seng", tag);
        kvdepot_create_args ca = {.id = tagged, .id_len = strlen(tagged), .model = m.name};
        CHECK_RC(kvdepot_sequence_create(c, &ca, NULL), KVDEPOT_OK);
        ref_seq e;
        REQUIRE(ref_init(&e, tagged, &m, P) == 0);
        kvdepot_engine_hashes eh = {.bytes = names, .len = 32, .num = r, .block_tokens = B};
        CHECK_RC(ref_append_engine(c, &e, 0, 2, P, 9, &eh), KVDEPOT_OK);
        uint64_t blocks = 0, toks = 0;
        CHECK_RC(kvdepot_engine_lookup(c, m.name, &eh, &blocks, &toks), KVDEPOT_OK);
        CHECK(blocks == r && toks == P);
        ref_free(&e);
        CHECK_RC(kvdepot_sequence_delete(c, tagged, strlen(tagged), NULL), KVDEPOT_OK);
    }

    /* A name standing for its addresses (numeric here: no DNS in CI). */
    char dns[128];
    snprintf(dns, sizeof dns, "shards:127.0.0.1:%d", cl.hs[1]->port);
    kvdepot_client *d = connect_list(dns);
    CHECK(d);
    if (d) {
        char name[256] = "";
        CHECK(kvdepot_shard_count(d) == 1);
        CHECK_RC(kvdepot_shard_endpoint(d, 0, name, sizeof name), KVDEPOT_OK);
        CHECK(strcmp(name, cl.hs[1]->addr) == 0);
        CHECK_RC(kvdepot_shard_refresh(d), KVDEPOT_OK);
        CHECK_RC(kvdepot_health_check(d, NULL, &serving), KVDEPOT_OK);
        kvdepot_close(d);
    }
out:
    kvdepot_close(c);
    cluster_stop(&cl);
    return 0;
}

static int test_kill(kvd_harness *h)
{
    cluster cl;
    REQUIRE(cluster_start(&cl, h, 3) == 0);
    char addr[512];
    harness_addr_list(cl.hs, cl.n, addr, sizeof addr);
    kvdepot_client *c = connect_list(addr);
    REQUIRE(c);
    kvdepot_model m = tiny_model();
    CHECK_RC(kvdepot_model_put(c, &m, 0, NULL, NULL), KVDEPOT_OK);
    int *owner = calloc(NSEQ, sizeof *owner);
    if (!owner || create_all(c, m.name) != 0 || owners(c, &cl, owner) != 0)
        goto out;

    const int dead = 2;
    harness_kill(cl.hs[dead]);

    /* Every key of the dead server misses, quickly; all others answer. */
    size_t missed = 0, found = 0;
    double t_dead = 0;
    for (int i = 0; i < NSEQ; i++) {
        char id[32];
        seq_id(id, sizeof id, i);
        double t0 = now_s();
        int rc = kvdepot_sequence_stat(c, id, strlen(id), NULL);
        if (owner[i] == dead) {
            t_dead += now_s() - t0;
            CHECK_RC(rc, KVDEPOT_ENOTFOUND);
            missed += rc == KVDEPOT_ENOTFOUND;
        } else {
            CHECK_RC(rc, KVDEPOT_OK);
            found += rc == KVDEPOT_OK;
        }
    }
    printf("dead server's %zu keys missed in %.3f s; %zu others found\n", missed, t_dead, found);
    CHECK(missed > 0);
    CHECK(t_dead < 5.0);

    /* Reads miss too; writes for its keys fail fast with UNAVAILABLE. */
    for (int i = 0; i < NSEQ; i++) {
        if (owner[i] != dead)
            continue;
        char id[32];
        seq_id(id, sizeof id, i);
        kvdepot_read_args ra = {.id = id, .id_len = strlen(id)};
        kvdepot_read_result rr;
        CHECK_RC(kvdepot_sequence_read(c, &ra, &rr), KVDEPOT_ENOTFOUND);
        CHECK_RC(kvdepot_sequence_evict(c, id, strlen(id), NULL, NULL), KVDEPOT_ENOTFOUND);
        double t0 = now_s();
        CHECK_RC(kvdepot_sequence_delete(c, id, strlen(id), NULL), KVDEPOT_EUNAVAIL);
        CHECK(now_s() - t0 < 5.0);
        break;
    }
    /* Models are still readable and writable through the live servers. */
    kvdepot_model got;
    CHECK_RC(kvdepot_model_get(c, m.name, &got), KVDEPOT_OK);
    kvdepot_model m2 = tiny_model();
    strcpy(m2.name, "shard-second");
    CHECK_RC(kvdepot_model_put(c, &m2, 0, NULL, NULL), KVDEPOT_OK);
    kvdepot_serving serving = KVDEPOT_SERVING_UNKNOWN;
    CHECK_RC(kvdepot_health_check(c, NULL, &serving), KVDEPOT_OK);
    CHECK(serving == KVDEPOT_NOT_SERVING);
    /* A lookup whose chain lives there matches nothing, without error. */
    for (uint64_t hsh = 1; hsh < 1000; hsh++) {
        char key[17], name[256];
        snprintf(key, sizeof key, "%016llx", (unsigned long long)hsh);
        CHECK_RC(kvdepot_shard_owner(c, key, 16, name, sizeof name), KVDEPOT_OK);
        if (server_of(&cl, name) != dead)
            continue;
        uint64_t blocks = 99;
        CHECK_RC(kvdepot_prefix_lookup(c, m.name, &hsh, 1, &blocks, NULL), KVDEPOT_OK);
        CHECK(blocks == 0);
        break;
    }
out:
    free(owner);
    kvdepot_close(c);
    cluster_stop(&cl);
    return 0;
}

static int test_add(kvd_harness *h)
{
    cluster cl;
    REQUIRE(cluster_start(&cl, h, 4) == 0);
    char addr3[512], addr4[512];
    harness_addr_list(cl.hs, 3, addr3, sizeof addr3);
    harness_addr_list(cl.hs, 4, addr4, sizeof addr4);
    kvdepot_client *c3 = connect_list(addr3);
    kvdepot_client *c4 = connect_list(addr4);
    REQUIRE(c3 && c4);
    kvdepot_model m = tiny_model();
    CHECK_RC(kvdepot_model_put(c3, &m, 0, NULL, NULL), KVDEPOT_OK);
    int *o3 = calloc(NSEQ, sizeof *o3), *o4 = calloc(NSEQ, sizeof *o4);
    if (!o3 || !o4 || create_all(c3, m.name) != 0 || owners(c3, &cl, o3) != 0 ||
        owners(c4, &cl, o4) != 0)
        goto out;

    size_t moved = 0;
    int first_moved = -1, first_kept = -1;
    for (int i = 0; i < NSEQ; i++) {
        if (o3[i] == o4[i]) {
            if (first_kept < 0)
                first_kept = i;
            continue;
        }
        moved++;
        CHECK(o4[i] == 3); /* only onto the new server */
        if (first_moved < 0)
            first_moved = i;
    }
    double frac = (double)moved / NSEQ;
    printf("adding a fourth server moved %zu of %d keys (%.3f)\n", moved, NSEQ, frac);
    CHECK(frac >= 0.15 && frac <= 0.35);

    /* Keys that stayed are found through the four-server list; moved ones
     * are misses there (they were written to their old owner). */
    char id[32];
    REQUIRE(first_moved >= 0 && first_kept >= 0);
    seq_id(id, sizeof id, first_kept);
    CHECK_RC(kvdepot_sequence_stat(c4, id, strlen(id), NULL), KVDEPOT_OK);
    seq_id(id, sizeof id, first_moved);
    CHECK_RC(kvdepot_sequence_stat(c4, id, strlen(id), NULL), KVDEPOT_ENOTFOUND);
    /* Created anew, the moved key lands on the new server, which learns the
     * model from the others on the way. */
    kvdepot_create_args a = {.id = id, .id_len = strlen(id), .model = m.name};
    CHECK_RC(kvdepot_sequence_create(c4, &a, NULL), KVDEPOT_OK);
    kvdepot_client *one = harness_client(cl.hs[3]);
    CHECK_RC(kvdepot_sequence_stat(one, id, strlen(id), NULL), KVDEPOT_OK);
    kvdepot_model got;
    CHECK_RC(kvdepot_model_get(one, m.name, &got), KVDEPOT_OK);
    /* So does an Append that creates its sequence, with a model only the
     * first three servers know. */
    kvdepot_model late = tiny_model();
    strcpy(late.name, "shard-late");
    CHECK_RC(kvdepot_model_put(c3, &late, 0, NULL, NULL), KVDEPOT_OK);
    CHECK_RC(kvdepot_model_get(one, late.name, &got), KVDEPOT_ENOTFOUND);
    int second_moved = -1;
    for (int i = first_moved + 1; i < NSEQ && second_moved < 0; i++)
        if (o3[i] != o4[i])
            second_moved = i;
    REQUIRE(second_moved >= 0);
    seq_id(id, sizeof id, second_moved);
    size_t bytes = kvdepot_kv_bytes(&late, late.num_layers, 3);
    uint8_t *kv = calloc(2, bytes);
    REQUIRE(kv);
    kvdepot_create_args lc = {.model = late.name};
    kvdepot_append_args ap = {.id = id,
                              .id_len = strlen(id),
                              .num_tokens = 3,
                              .dtype = late.dtype,
                              .k = kv,
                              .k_bytes = bytes,
                              .v = kv + bytes,
                              .v_bytes = bytes,
                              .create = &lc};
    kvdepot_sequence_info si;
    CHECK_RC(kvdepot_sequence_append(c4, &ap, &si), KVDEPOT_OK);
    CHECK(si.num_tokens == 3);
    kvdepot_sequence_info_clear(&si);
    free(kv);
    CHECK_RC(kvdepot_sequence_stat(one, id, strlen(id), &si), KVDEPOT_OK);
    CHECK(si.num_tokens == 3 && strcmp(si.model, late.name) == 0);
    kvdepot_sequence_info_clear(&si);
    CHECK_RC(kvdepot_model_get(one, late.name, &got), KVDEPOT_OK);
    kvdepot_close(one);
out:
    free(o3);
    free(o4);
    kvdepot_close(c3);
    kvdepot_close(c4);
    cluster_stop(&cl);
    return 0;
}

/* Whether localhost resolves to 127.0.0.1 only (the servers listen there). */
static int localhost_is_v4_only(void)
{
    struct addrinfo hints = {.ai_socktype = SOCK_STREAM}, *res = NULL;
    if (getaddrinfo("localhost", "1", &hints, &res) != 0)
        return 0;
    int ok = res && !res->ai_next && res->ai_family == AF_INET;
    freeaddrinfo(res);
    return ok;
}

/*
 * Servers with TLS and tokens behind one sharded client: the TLS and token
 * options reach every member even after the caller's strings are gone, and
 * members found behind a name check the certificate against that name
 * (the certificate names localhost, the members are 127.0.0.1:PORT).
 */
static int test_tls(kvd_harness *h)
{
    /* The harness's root is short (a mkdtemp name); the sizes leave room. */
    char dir[PATH_MAX], cmd[4 * PATH_MAX + 1024], ca[PATH_MAX + 16], crt[PATH_MAX + 16],
        key[PATH_MAX + 16], tokens[PATH_MAX + 16];
    snprintf(dir, sizeof dir, "%s/pki", h->root);
    snprintf(ca, sizeof ca, "%s/ca.crt", dir);
    snprintf(crt, sizeof crt, "%s/tls.crt", dir);
    snprintf(key, sizeof key, "%s/tls.key", dir);
    snprintf(tokens, sizeof tokens, "%s/tokens.yaml", dir);
    snprintf(cmd, sizeof cmd,
             "set -e; mkdir -p %s; cd %s;"
             "openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 2"
             " -subj /CN=test-ca -keyout ca.key -out ca.crt;"
             "openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -subj /CN=localhost"
             " -keyout tls.key -out tls.csr;"
             "printf 'subjectAltName=DNS:localhost\\n' > ext;"
             "openssl x509 -req -in tls.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days 2"
             " -extfile ext -out tls.crt;"
             "printf 'tokens:\\n  - token: \"shard-test-token\"\\n    tenant: t\\n"
             "    namespaces: [\"*\"]\\n    access: read-write\\n' > tokens.yaml",
             dir, dir);
    if (system(cmd) != 0) {
        printf("openssl failed; TLS part skipped\n");
        return 0;
    }
    /* kvdepotd reads KVDEPOT_* from its environment, which it inherits. */
    setenv("KVDEPOT_TLS_CERT", crt, 1);
    setenv("KVDEPOT_TLS_KEY", key, 1);
    setenv("KVDEPOT_TOKENS_FILE", tokens, 1);
    kvd_harness extra[3];
    int started = harness_start_many(extra, 3, h->server_bin);
    unsetenv("KVDEPOT_TLS_CERT");
    unsetenv("KVDEPOT_TLS_KEY");
    unsetenv("KVDEPOT_TOKENS_FILE");
    REQUIRE(started == 0);

    char addr[512];
    /* IP targets (gRPC resolves no name), certificate checked for localhost. */
    snprintf(addr, sizeof addr, "%s,%s,%s", extra[0].addr, extra[1].addr, extra[2].addr);
    /* Strings the library must copy: overwritten right after connect. */
    char ca_copy[PATH_MAX + 16], token[64], server_name[16];
    snprintf(ca_copy, sizeof ca_copy, "%s", ca);
    snprintf(token, sizeof token, "shard-test-token");
    snprintf(server_name, sizeof server_name, "localhost");
    kvdepot_options opt;
    kvdepot_options_init(&opt);
    opt.address = addr;
    opt.connect_timeout_ms = 10000;
    opt.tls_ca_file = ca_copy;
    opt.token = token;
    opt.tls_server_name = server_name;
    kvdepot_client *c = NULL;
    CHECK_RC(kvdepot_connect(&opt, &c), KVDEPOT_OK);
    memset(ca_copy, 'x', sizeof ca_copy - 1);
    memset(token, 'x', sizeof token - 1);
    memset(server_name, 'x', sizeof server_name - 1);
    if (c) {
        kvdepot_model m = tiny_model();
        CHECK_RC(kvdepot_model_put(c, &m, 0, NULL, NULL), KVDEPOT_OK);
        for (int i = 0; i < 30; i++) {
            char id[32];
            seq_id(id, sizeof id, i);
            kvdepot_create_args a = {.id = id, .id_len = strlen(id), .model = m.name};
            CHECK_RC(kvdepot_sequence_create(c, &a, NULL), KVDEPOT_OK);
            CHECK_RC(kvdepot_sequence_stat(c, id, strlen(id), NULL), KVDEPOT_OK);
        }
        kvdepot_close(c);
    }
    /* Without the token every server refuses. */
    opt.tls_ca_file = ca;
    opt.tls_server_name = "localhost";
    opt.token = NULL;
    c = NULL;
    CHECK_RC(kvdepot_connect(&opt, &c), KVDEPOT_OK);
    if (c) {
        kvdepot_model got;
        CHECK_RC(kvdepot_model_get(c, "shard-tiny", &got), KVDEPOT_EAUTH);
        kvdepot_close(c);
    }
    /* A CA file that cannot be read fails the connect, as with one server. */
    opt.tls_ca_file = "/nonexistent/ca.crt";
    c = NULL;
    CHECK_RC(kvdepot_connect(&opt, &c), KVDEPOT_EINVAL);
    CHECK(c == NULL);

    if (localhost_is_v4_only()) {
        char dns[128];
        snprintf(dns, sizeof dns, "shards:localhost:%d", extra[1].port);
        opt.address = dns;
        opt.tls_ca_file = ca;
        opt.tls_server_name = NULL; /* the name resolved: localhost */
        opt.token = "shard-test-token";
        c = NULL;
        CHECK_RC(kvdepot_connect(&opt, &c), KVDEPOT_OK);
        if (c) {
            char name[256] = "";
            CHECK_RC(kvdepot_shard_endpoint(c, 0, name, sizeof name), KVDEPOT_OK);
            CHECK(strcmp(name, extra[1].addr) == 0);
            kvdepot_serving serving = KVDEPOT_SERVING_UNKNOWN;
            CHECK_RC(kvdepot_health_check(c, NULL, &serving), KVDEPOT_OK);
            CHECK(serving == KVDEPOT_SERVING);
            /* The model was put on every server, this one included. */
            kvdepot_model got;
            CHECK_RC(kvdepot_model_get(c, "shard-tiny", &got), KVDEPOT_OK);
            kvdepot_close(c);
        }
    } else {
        printf("localhost is not 127.0.0.1 only here; shards: name part skipped\n");
    }
    for (int i = 0; i < 3; i++)
        harness_destroy(&extra[i], kvd_test_failures > 0);
    return 0;
}

/* Deterministic values in [-2, 2) as f16, so attention sees ordinary numbers. */
static void fill_f16(uint16_t *buf, size_t n, uint64_t seed)
{
    uint64_t x = seed * 0x9e3779b97f4a7c15ull + 1;
    for (size_t i = 0; i < n; i++) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        buf[i] = kvd_f32_to_f16((float)((x >> 40) & 0xffffff) / (float)(1 << 24) * 4.0f - 2.0f);
    }
}

#define CNSEQ 12
#define CL 2
#define CH 2
#define CHQ 4
#define CD 32
#define CT 300

/* A sequence with INT4 keys (groups of 32) and a small PQ index. */
static int create_indexed(kvdepot_client *c, const char *model, const char *id)
{
    kvdepot_codecs cs;
    memset(&cs, 0, sizeof cs);
    cs.k.codec = KVDEPOT_CODEC_INT4;
    cs.k.group_size = 32;
    cs.pq_m = 4;
    cs.pq_bits = 4;
    cs.pq_iterations = 3;
    kvdepot_create_args ca = {.id = id, .id_len = strlen(id), .model = model, .codecs = &cs};
    return kvdepot_sequence_create(c, &ca, NULL);
}

/* Compute calls through the sharded client equal the same calls made
 * directly to each sequence's owner (the owner computes both), Attend
 * batches spanning every server land in query order, Calibrate's artifacts
 * reach every server, and a killed server's sequences miss. */
static int test_compute(kvd_harness *h)
{
    cluster cl;
    REQUIRE(cluster_start(&cl, h, 3) == 0);
    char addr[512];
    harness_addr_list(cl.hs, cl.n, addr, sizeof addr);
    kvdepot_client *c = connect_list(addr);
    kvdepot_client *direct[MAXS] = {0};
    REQUIRE(c);
    for (size_t i = 0; i < cl.n; i++)
        REQUIRE((direct[i] = harness_client(cl.hs[i])));
    kvdepot_model m;
    memset(&m, 0, sizeof m);
    strcpy(m.name, "shard-compute");
    m.num_layers = CL;
    m.num_kv_heads = CH;
    m.num_q_heads = CHQ;
    m.head_dim = CD;
    m.dtype = KVDEPOT_DTYPE_F16;
    REQUIRE_RC(kvdepot_model_put(c, &m, 0, NULL, NULL), KVDEPOT_OK);

    /* Sequences with a PQ index and INT4 keys, spread over the servers. */
    const size_t cnt = (size_t)CL * CT * CH * CD;
    uint16_t *k = malloc(cnt * 2), *v = malloc(cnt * 2);
    float *q = malloc(sizeof(float) * CNSEQ * CHQ * CD);
    int owner[CNSEQ], used[MAXS] = {0};
    char ids[CNSEQ][16];
    REQUIRE(k && v && q);
    for (int i = 0; i < CNSEQ; i++) {
        snprintf(ids[i], sizeof ids[i], "cseq-%d", i);
        REQUIRE_RC(create_indexed(c, m.name, ids[i]), KVDEPOT_OK);
        fill_f16(k, cnt, 100 + 2 * (uint64_t)i);
        fill_f16(v, cnt, 101 + 2 * (uint64_t)i);
        kvdepot_append_args aa = {.id = ids[i], .id_len = strlen(ids[i]), .num_tokens = CT,
                                  .dtype = m.dtype, .k = k, .k_bytes = cnt * 2, .v = v,
                                  .v_bytes = cnt * 2};
        REQUIRE_RC(kvdepot_sequence_append(c, &aa, NULL), KVDEPOT_OK);
        char name[256];
        REQUIRE_RC(kvdepot_shard_owner(c, ids[i], strlen(ids[i]), name, sizeof name),
                   KVDEPOT_OK);
        owner[i] = server_of(&cl, name);
        REQUIRE(owner[i] >= 0);
        used[owner[i]] = 1;
        for (int j = 0; j < CHQ * CD; j++)
            q[i * CHQ * CD + j] = (float)((i * 131 + j * 17) % 29) / 29.0f - 0.5f;
    }
    int servers_used = 0;
    for (size_t i = 0; i < cl.n; i++)
        servers_used += used[i];
    CHECK(servers_used >= 2);

    /* Attend: one batch over every sequence == per-owner direct calls. */
    kvdepot_attend_query qs[CNSEQ];
    kvdepot_attend_result rs[CNSEQ], one;
    for (int i = 0; i < CNSEQ; i++)
        qs[i] = (kvdepot_attend_query){ids[i], strlen(ids[i]), q + i * CHQ * CD, CHQ * CD,
                                       (uint64_t)i, 0};
    REQUIRE_RC(kvdepot_attend(c, 1, 0, qs, CNSEQ, rs), KVDEPOT_OK);
    for (int i = 0; i < CNSEQ; i++) {
        REQUIRE_RC(kvdepot_attend(direct[owner[i]], 1, 0, &qs[i], 1, &one), KVDEPOT_OK);
        CHECK(rs[i].num_tokens == CT - (uint64_t)i && one.num_tokens == rs[i].num_tokens);
        CHECK(memcmp(rs[i].output, one.output, sizeof(float) * CHQ * CD) == 0);
        CHECK(memcmp(rs[i].lse, one.lse, sizeof(float) * CHQ) == 0);
        kvdepot_attend_results_free(&one, 1);
    }
    kvdepot_attend_results_free(rs, CNSEQ);

    /* Search, SparseAttend, PlanFetch, ReadPages go to the owner. */
    for (int i = 0; i < CNSEQ; i += 5) {
        kvdepot_search_args sa = {ids[i], strlen(ids[i]), 0, q + i * CHQ * CD, CHQ * CD, 8, 2, 4,
                                  0, 0};
        kvdepot_search_result a, b;
        REQUIRE_RC(kvdepot_search(c, &sa, &a), KVDEPOT_OK);
        REQUIRE_RC(kvdepot_search(direct[owner[i]], &sa, &b), KVDEPOT_OK);
        CHECK(a.num_heads == b.num_heads && a.num_heads == CH);
        for (size_t hh = 0; hh < a.num_heads && hh < b.num_heads; hh++) {
            CHECK(a.heads[hh].count == b.heads[hh].count);
            if (a.heads[hh].count == b.heads[hh].count)
                CHECK(memcmp(a.heads[hh].tokens, b.heads[hh].tokens,
                             a.heads[hh].count * sizeof *a.heads[hh].tokens) == 0);
        }
        kvdepot_search_result_free(&a);
        kvdepot_search_result_free(&b);
        kvdepot_attend_result ra, rb;
        REQUIRE_RC(kvdepot_sparse_attend(c, &sa, 0, &ra, &a), KVDEPOT_OK);
        REQUIRE_RC(kvdepot_sparse_attend(direct[owner[i]], &sa, 0, &rb, &b), KVDEPOT_OK);
        CHECK(memcmp(ra.output, rb.output, sizeof(float) * CHQ * CD) == 0);
        kvdepot_attend_results_free(&ra, 1);
        kvdepot_attend_results_free(&rb, 1);
        kvdepot_search_result_free(&a);
        kvdepot_search_result_free(&b);
        kvdepot_fetch_plan pa, pb;
        REQUIRE_RC(kvdepot_plan_fetch(c, ids[i], strlen(ids[i]), 1e9, 1e12, 0, 0, 0, &pa),
                   KVDEPOT_OK);
        REQUIRE_RC(kvdepot_plan_fetch(direct[owner[i]], ids[i], strlen(ids[i]), 1e9, 1e12, 0, 0,
                                      0, &pb),
                   KVDEPOT_OK);
        CHECK(pa.num_tokens == CT && pa.split_tokens == pb.split_tokens &&
              pa.kv_bytes == pb.kv_bytes);
        /* Pages read through the cluster go back in through it, to a new
         * sequence that may live on another server. */
        kvdepot_read_args rd = {.id = ids[i], .id_len = strlen(ids[i])};
        kvdepot_page *pages = NULL;
        size_t np = 0;
        REQUIRE_RC(kvdepot_sequence_read_pages(c, &rd, &pages, &np), KVDEPOT_OK);
        CHECK(np > 0);
        char copy[32];
        snprintf(copy, sizeof copy, "copy-of-%d", i);
        REQUIRE_RC(create_indexed(c, m.name, copy), KVDEPOT_OK);
        kvdepot_sequence_info info;
        CHECK_RC(kvdepot_append_pages(c, copy, strlen(copy), pages, np, &info), KVDEPOT_OK);
        CHECK(info.num_tokens == CT);
        kvdepot_sequence_info_clear(&info);
        kvdepot_pages_free(pages, np);
    }

    /* Calibrate once through the cluster: every server holds the same
     * artifacts afterwards. */
    uint16_t *ck = malloc(512 * CH * CD * 2), *cv = malloc(512 * CH * CD * 2);
    REQUIRE(ck && cv);
    kvdepot_calibrate_sample smp[CL];
    for (int l = 0; l < CL; l++)
        smp[l] = (kvdepot_calibrate_sample){(uint32_t)l, 512, ck, cv, NULL, 512 * CH * CD * 2, 0};
    fill_f16(ck, 512 * CH * CD, 7);
    fill_f16(cv, 512 * CH * CD, 8);
    kvdepot_calibrate_args cal = {.model = m.name, .vq_sub_dim = 4, .vq_bits = 4, .svd = 1,
                                  .iterations = 3, .seed = 1};
    kvdepot_calibrate_result cr;
    memset(&cr, 0, sizeof cr);
    REQUIRE_RC(kvdepot_calibrate(c, &cal, smp, CL, &cr), KVDEPOT_OK);
    CHECK(cr.artifacts > 0);
    kvdepot_artifact *a0 = NULL;
    size_t n0 = 0;
    REQUIRE_RC(kvdepot_artifacts_get(direct[0], m.name, NULL, 0, &a0, &n0), KVDEPOT_OK);
    CHECK(n0 == cr.artifacts);
    for (size_t s = 1; s < cl.n; s++) {
        kvdepot_artifact *as = NULL;
        size_t ns = 0;
        REQUIRE_RC(kvdepot_artifacts_get(direct[s], m.name, NULL, 0, &as, &ns), KVDEPOT_OK);
        CHECK(ns == n0);
        for (size_t j = 0; j < ns && j < n0; j++)
            CHECK(as[j].kind == a0[j].kind && as[j].layer == a0[j].layer &&
                  as[j].kv_head == a0[j].kv_head && as[j].ndim == a0[j].ndim &&
                  as[j].shape[0] == a0[j].shape[0] && as[j].shape[1] == a0[j].shape[1] &&
                  memcmp(as[j].data, a0[j].data,
                         (size_t)a0[j].shape[0] * (a0[j].ndim == 2 ? a0[j].shape[1] : 1) *
                             sizeof(float)) == 0);
        kvdepot_artifacts_free(as, ns);
    }
    kvdepot_artifact *ag = NULL;
    size_t ng = 0;
    REQUIRE_RC(kvdepot_artifacts_get(c, m.name, NULL, 0, &ag, &ng), KVDEPOT_OK);
    CHECK(ng == n0);
    kvdepot_artifacts_free(ag, ng);
    kvdepot_artifacts_free(a0, n0);
    kvdepot_calibrate_result_clear(&cr);

    /* A killed server: an Attend batch touching it misses as a whole; one
     * without it still works. */
    const int dead = owner[0];
    harness_kill(cl.hs[dead]);
    CHECK_RC(kvdepot_attend(c, 0, 0, qs, CNSEQ, rs), KVDEPOT_ENOTFOUND);
    size_t nlive = 0;
    kvdepot_attend_query live[CNSEQ];
    for (int i = 0; i < CNSEQ; i++)
        if (owner[i] != dead)
            live[nlive++] = qs[i];
    if (nlive) {
        CHECK_RC(kvdepot_attend(c, 0, 0, live, nlive, rs), KVDEPOT_OK);
        kvdepot_attend_results_free(rs, nlive);
    }
    kvdepot_search_args sd = {ids[0], strlen(ids[0]), 0, q, CHQ * CD, 4, 0, 0, 0, 0};
    kvdepot_search_result sr;
    CHECK_RC(kvdepot_search(c, &sd, &sr), KVDEPOT_ENOTFOUND);

    free(ck);
    free(cv);
    free(k);
    free(v);
    free(q);
    for (size_t i = 0; i < cl.n; i++)
        kvdepot_close(direct[i]);
    kvdepot_close(c);
    cluster_stop(&cl);
    return 0;
}

int main(int argc, char **argv)
{
    static const kvd_test tests[] = {
        {"spread", test_spread},
        {"kill", test_kill},
        {"add", test_add},
        {"tls", test_tls},
        {"compute", test_compute},
    };
    /* Up to four servers at once: none of them takes the default metrics
     * port, which tests running beside these may need. */
    setenv("KVDEPOT_METRICS_LISTEN", "", 0);
    return harness_main(argc, argv, tests, sizeof tests / sizeof tests[0]);
}
