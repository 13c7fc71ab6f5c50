/*
 * Several kvdepotd on loopback behind one libkvdepot client given the list
 * of their addresses: keys spread evenly, a killed server turns its keys
 * into quick misses while the others keep working, and a server added to
 * the list takes over about 1/N of the keys, all of them moving onto it.
 *
 * Each test gets the harness's server plus more started here.
 */
#include "harness.h"

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

int main(int argc, char **argv)
{
    static const kvd_test tests[] = {
        {"spread", test_spread},
        {"kill", test_kill},
        {"add", test_add},
        {"tls", test_tls},
    };
    /* Up to four servers at once: none of them takes the default metrics
     * port, which tests running beside these may need. */
    setenv("KVDEPOT_METRICS_LISTEN", "", 0);
    return harness_main(argc, argv, tests, sizeof tests / sizeof tests[0]);
}
