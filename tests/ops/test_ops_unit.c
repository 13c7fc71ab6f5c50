/*
 * Unit tests of kvdepotd's operating pieces without a network: the tokens
 * file (parsing, errors with file:line, expiry, namespaces), token checks on
 * call metadata, quota reservations at their exact bounds, the YAML config
 * file and its precedence, the loopback rule, and the metrics rendering.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "auth.h"
#include "config.h"
#include "metrics.h"
#include "server.h"

static int failures;

#define CHECK(cond)                                                                                \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond);               \
            failures++;                                                                            \
        }                                                                                          \
    } while (0)

static char dir[] = "/tmp/kvd-ops-unit-XXXXXX";

static const char *write_file(const char *name, const char *text)
{
    static char path[4][512];
    static int next;
    char *p = path[next++ % 4];
    snprintf(p, 512, "%s/%s", dir, name);
    FILE *f = fopen(p, "w");
    fputs(text, f);
    fclose(f);
    return p;
}

/* Metadata with one `authorization` entry (or none when value is NULL). */
typedef struct md1 {
    grpc_metadata m;
    grpc_metadata_array a;
} md1;

static void md_set(md1 *x, const char *value)
{
    memset(x, 0, sizeof *x);
    if (value) {
        x->m.key = grpc_slice_from_static_string("authorization");
        x->m.value = grpc_slice_from_static_string(value);
        x->a.metadata = &x->m;
        x->a.count = 1;
    }
}

static const char tokens_yaml[] = "tokens:\n"
                                  "  - token: \"tok-a-rw-0123456789\"\n"
                                  "    tenant: team-a\n"
                                  "    namespaces: [\"a-*\"]\n"
                                  "  - token: \"tok-a-ro-0123456789\"\n"
                                  "    tenant: team-a\n"
                                  "    namespaces: [\"a-*\", \"shared\"]\n"
                                  "    access: read-only\n"
                                  "  - token: \"tok-b-0123456789ab\"\n"
                                  "    tenant: team-b\n"
                                  "    namespaces: \"*\"\n"
                                  "    expires: 2030-06-01T00:00:00Z\n"
                                  "tenants:\n"
                                  "  team-b: {max-sequences: 5, max-bytes: 1KiB}\n";

static void test_tokens(void)
{
    char err[512];
    kvd_auth *a = NULL;
    CHECK(kvd_auth_load(write_file("t.yaml", tokens_yaml), 2, 100, &a, err, sizeof err) == 0);
    if (!a) {
        fprintf(stderr, "load: %s\n", err);
        failures++;
        return;
    }
    CHECK(a->required && a->n_tokens == 3 && a->n_tenants == 2);
    md1 m;
    const kvd_principal *p = NULL;
    kvd_error e;
    md_set(&m, NULL);
    CHECK(kvd_auth_check(a, &m.a, 0, &p, &e) == KVD_EAUTH);
    md_set(&m, "Basic abc");
    CHECK(kvd_auth_check(a, &m.a, 0, &p, &e) == KVD_EAUTH);
    md_set(&m, "Bearer tok-a-rw-012345678"); /* a prefix of a real token */
    CHECK(kvd_auth_check(a, &m.a, 0, &p, &e) == KVD_EAUTH);
    CHECK(strstr(e.msg, "tok-") == NULL); /* never echo the token */
    md_set(&m, "Bearer tok-a-rw-0123456789");
    CHECK(kvd_auth_check(a, &m.a, 0, &p, &e) == 0 && p && !p->read_only);
    CHECK(strcmp(kvd_auth_tenant(a, p), "team-a") == 0);
    CHECK(kvd_auth_model_allowed(p, "a-llama"));
    CHECK(!kvd_auth_model_allowed(p, "b-llama"));
    CHECK(!kvd_auth_model_allowed(p, "shared"));
    md_set(&m, "bearer tok-a-ro-0123456789"); /* the scheme is case-insensitive */
    CHECK(kvd_auth_check(a, &m.a, 0, &p, &e) == 0 && p && p->read_only);
    CHECK(kvd_auth_model_allowed(p, "shared"));
    /* Expiry: valid the second before, refused from the second itself. */
    md_set(&m, "Bearer tok-b-0123456789ab");
    CHECK(kvd_auth_check(a, &m.a, 1906502399, &p, &e) == 0);
    CHECK(kvd_auth_check(a, &m.a, 1906502400, &p, &e) == KVD_EAUTH);
    CHECK(strstr(e.msg, "expired") != NULL);

    /* Quotas: team-a's namespaces are a-* and shared (union of its tokens),
     * with the defaults 2 sequences, 100 bytes; team-b ("*") 5 and 1 KiB. */
    CHECK(kvd_quota_reserve(a, "a-m", 1, 60, &e) == 0);
    CHECK(kvd_quota_reserve(a, "a-m", 1, 40, &e) == 0); /* exactly at both bounds */
    CHECK(kvd_quota_reserve(a, "a-m", 0, 1, &e) == KVD_ENOMEM);
    CHECK(strstr(e.msg, "tenant-max-bytes") && strstr(e.msg, "team-a"));
    CHECK(kvd_quota_reserve(a, "shared", 1, 0, &e) == KVD_ENOMEM);
    CHECK(strstr(e.msg, "tenant-max-sequences") != NULL);
    /* team-b holds everything: "a-m" counted against it too. */
    CHECK(a->tenants[1].sequences == 2 && a->tenants[1].bytes == 100);
    CHECK(kvd_quota_reserve(a, "b-m", 3, 924, &e) == 0);
    CHECK(kvd_quota_reserve(a, "b-m", 1, 0, &e) == KVD_ENOMEM);
    /* A refused reservation changes nothing; a release gives back exactly. */
    CHECK(a->tenants[1].sequences == 5 && a->tenants[1].bytes == 1024);
    kvd_quota_release(a, "a-m", 1, 40);
    CHECK(a->tenants[0].sequences == 1 && a->tenants[0].bytes == 60);
    CHECK(a->tenants[1].sequences == 4 && a->tenants[1].bytes == 984); /* both tenants */
    CHECK(kvd_quota_reserve(a, "a-m", 0, 41, &e) == KVD_ENOMEM);
    CHECK(kvd_quota_reserve(a, "a-m", 0, 40, &e) == 0); /* both exactly full again */
    CHECK(kvd_quota_reserve(a, "b-m", 0, 1, &e) == KVD_ENOMEM);
    kvd_auth_unref(a);

    /* No tokens file: one anonymous tenant, every call accepted. */
    CHECK(kvd_auth_load(NULL, 1, 0, &a, err, sizeof err) == 0);
    md_set(&m, NULL);
    CHECK(kvd_auth_check(a, &m.a, 0, &p, &e) == 0 && p == NULL);
    CHECK(strcmp(kvd_auth_tenant(a, p), "anonymous") == 0);
    CHECK(kvd_quota_reserve(a, "anything", 1, 0, &e) == 0);
    CHECK(kvd_quota_reserve(a, "anything", 1, 0, &e) == KVD_ENOMEM);
    kvd_auth_unref(a);
}

static void test_tokens_errors(void)
{
    static const struct {
        const char *text, *want;
    } bad[] = {
        {"tokens:\n  - token: short\n    tenant: x\n    namespaces: [\"*\"]\n", "t.yaml:2"},
        {"tokens:\n  - token: abcdefghijklmnopq\n    namespaces: [\"*\"]\n", "tenant"},
        {"tokens:\n  - token: abcdefghijklmnopq\n    tenant: x\n", "namespaces"},
        {"tokens:\n  - {token: abcdefghijklmnopq, tenant: x, namespaces: [a], access: all}\n",
         "access"},
        {"tokens:\n  - {token: abcdefghijklmnopq, tenant: x, namespaces: [a], expires: soon}\n",
         "expires"},
        {"tokens:\n  - {token: abcdefghijklmnopq, tenant: x, namespaces: [a], colour: red}\n",
         "colour"},
        {"tokens:\n  - {token: abcdefghijklmnopq, tenant: x, namespaces: [a]}\n"
         "  - {token: abcdefghijklmnopq, tenant: y, namespaces: [a]}\n",
         "twice"},
        {"tokens:\n  - {token: abcdefghijklmnopq, tenant: x, namespaces: [a]}\n"
         "tenants:\n  y: {max-bytes: 1}\n",
         "no token"},
        {"tokens: [\n", "t.yaml"},
        {"users: []\n", "users"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        char err[512] = "";
        kvd_auth *a = NULL;
        int rc = kvd_auth_load(write_file("t.yaml", bad[i].text), 0, 0, &a, err, sizeof err);
        CHECK(rc == -1 && a == NULL);
        if (!strstr(err, bad[i].want)) {
            fprintf(stderr, "case %zu: '%s' lacks '%s'\n", i, err, bad[i].want);
            failures++;
        }
        CHECK(strstr(err, "abcdefghijklmnopq") == NULL);
    }
}

static char *fake_env(const char *name)
{
    if (strcmp(name, "KVDEPOT_THREADS") == 0)
        return "4";
    if (strcmp(name, "KVDEPOT_SYNC") == 0)
        return "true";
    return NULL;
}

static char *no_env(const char *name)
{
    (void)name;
    return NULL;
}

static void test_config_file(void)
{
    const char *path = write_file("c.yaml", "threads: 3\n"
                                            "page_tokens: 64\n"
                                            "sync: false\n"
                                            "tenant-max-bytes: 2GiB\n"
                                            "port-file: ~\n"
                                            "metrics-listen: \"\"\n");
    char arg[600];
    snprintf(arg, sizeof arg, "--config=%s", path);
    char *argv[] = {"kvdepotd", arg, "--page-tokens", "128", NULL};
    kvd_config c;
    char err[512];
    int action;
    CHECK(kvd_config_defaults(&c) == 0);
    CHECK(kvd_config_load(&c, 4, argv, fake_env, &action, err, sizeof err) == 0);
    CHECK(c.threads == 4);       /* env over file */
    CHECK(c.sync == 1);          /* env over file */
    CHECK(c.page_tokens == 128); /* flag over file */
    CHECK(c.tenant_max_bytes == 2048ull << 20);
    CHECK(c.metrics_listen == NULL); /* empty = off */
    for (size_t i = 0; i < kvd_config_count(); i++) {
        const char *n = kvd_config_name(i);
        int want = strcmp(n, "threads") == 0 || strcmp(n, "sync") == 0         ? KVD_SRC_ENV
                   : strcmp(n, "page-tokens") == 0 || strcmp(n, "config") == 0 ? KVD_SRC_FLAG
                   : strcmp(n, "tenant-max-bytes") == 0 || strcmp(n, "metrics-listen") == 0 ||
                           strcmp(n, "port-file") == 0
                       ? KVD_SRC_FILE
                       : KVD_SRC_DEFAULT;
        if (c.source[i] != want) {
            fprintf(stderr, "%s: source %d, want %d\n", n, c.source[i], want);
            failures++;
        }
    }
    kvd_config_free(&c);

    static const char *const bad[] = {"nope: 1\n",
                                      "threads: x\n",
                                      "threads: [1]\n",
                                      "listen: {a: b}\n",
                                      "- a\n",
                                      "threads: 1\nthreads: 2: 3\n",
                                      "config: other.yaml\n",
                                      "listen: \"\"\n"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        CHECK(kvd_config_defaults(&c) == 0);
        err[0] = '\0';
        CHECK(kvd_config_apply_file(&c, write_file("b.yaml", bad[i]), err, sizeof err) == -1);
        CHECK(strstr(err, "b.yaml:") != NULL);
        kvd_config_free(&c);
    }
    /* An empty file is no settings. */
    CHECK(kvd_config_defaults(&c) == 0);
    CHECK(kvd_config_apply_file(&c, write_file("e.yaml", ""), err, sizeof err) == 0);
    CHECK(kvd_config_apply_file(&c, write_file("e.yaml", "# only a comment\n"), err, sizeof err) ==
          0);
    kvd_config_free(&c);

    /* --print-config output loads back to the same values. */
    CHECK(kvd_config_defaults(&c) == 0);
    char *argv2[] = {"kvdepotd", "--threads", "7", "--listen", "[::1]:0", "--print-config", NULL};
    CHECK(kvd_config_load(&c, 6, argv2, no_env, &action, err, sizeof err) == 0);
    CHECK(action == KVD_CONFIG_PRINT);
    char ppath[600];
    snprintf(ppath, sizeof ppath, "%s/p.yaml", dir);
    FILE *f = fopen(ppath, "w");
    kvd_config_print(f, &c);
    fclose(f);
    kvd_config d;
    CHECK(kvd_config_defaults(&d) == 0);
    CHECK(kvd_config_apply_file(&d, ppath, err, sizeof err) == 0);
    CHECK(d.threads == 7 && strcmp(d.listen, "[::1]:0") == 0);
    kvd_config_free(&c);
    kvd_config_free(&d);
}

static void test_security_rules(void)
{
    CHECK(kvd_listen_is_loopback("127.0.0.1:50051"));
    CHECK(kvd_listen_is_loopback("127.1.2.3:0"));
    CHECK(kvd_listen_is_loopback("localhost:1"));
    CHECK(kvd_listen_is_loopback("[::1]:50051"));
    CHECK(kvd_listen_is_loopback("ipv4:127.0.0.1:5"));
    CHECK(kvd_listen_is_loopback("unix:/run/kvdepot.sock"));
    CHECK(!kvd_listen_is_loopback("0.0.0.0:50051"));
    CHECK(!kvd_listen_is_loopback("[::]:50051"));
    CHECK(!kvd_listen_is_loopback(":50051"));
    CHECK(!kvd_listen_is_loopback("10.0.0.1:50051"));
    CHECK(!kvd_listen_is_loopback("kv.example:50051"));

    kvd_config c;
    char err[256];
    CHECK(kvd_config_defaults(&c) == 0);
    CHECK(kvd_server_check_security(&c, err, sizeof err) == 0); /* the default: loopback */
    CHECK(kvd_config_set(&c, "listen", "0.0.0.0:1", err, sizeof err) == 0);
    CHECK(kvd_server_check_security(&c, err, sizeof err) == -1);
    CHECK(kvd_config_set(&c, "insecure", "true", err, sizeof err) == 0);
    CHECK(kvd_server_check_security(&c, err, sizeof err) == -1);
    CHECK(kvd_config_set(&c, "allow-insecure-remote", "true", err, sizeof err) == 0);
    CHECK(kvd_server_check_security(&c, err, sizeof err) == 0);
    CHECK(kvd_config_set(&c, "tls-cert", "c.pem", err, sizeof err) == 0);
    CHECK(kvd_server_check_security(&c, err, sizeof err) == -1); /* no key; and insecure */
    CHECK(kvd_config_set(&c, "tls-key", "k.pem", err, sizeof err) == 0);
    CHECK(kvd_server_check_security(&c, err, sizeof err) == -1); /* insecure contradicts */
    CHECK(kvd_config_set(&c, "insecure", "false", err, sizeof err) == 0);
    CHECK(kvd_server_check_security(&c, err, sizeof err) == 0);
    kvd_config_free(&c);
}

static void test_metrics(void)
{
    KVD_METRIC_ADD(bytes_received_total, 5);
    kvd_metrics_observe(0, 0, 0.003);
    kvd_metrics_observe(0, KVD_ENOTFOUND, 100.0); /* above every bucket */
    kvd_metrics_observe(-1, KVD_EUNSUPP, 0.0);
    size_t len = 0;
    char *text = kvd_metrics_render(&len);
    CHECK(text && strlen(text) == len);
    if (!text)
        return;
    CHECK(strstr(text, "kvdepot_bytes_received_total 5\n") != NULL);
    CHECK(strstr(text, "# TYPE kvdepot_calls_in_flight gauge\n") != NULL);
    CHECK(strstr(text, "kvdepot_requests_total{method=\"PutModel\",status=\"OK\"} 1\n"));
    CHECK(strstr(text, "kvdepot_requests_total{method=\"unknown\",status=\"UNIMPLEMENTED\"} 1\n"));
    CHECK(strstr(text, "{method=\"PutModel\",status=\"OK\",le=\"0.0025\"} 0\n"));
    CHECK(strstr(text, "{method=\"PutModel\",status=\"OK\",le=\"0.005\"} 1\n"));
    CHECK(strstr(text, "{method=\"PutModel\",status=\"NOT_FOUND\",le=\"60\"} 0\n"));
    CHECK(strstr(text, "{method=\"PutModel\",status=\"NOT_FOUND\",le=\"+Inf\"} 1\n"));
    free(text);
}

int main(void)
{
    if (!mkdtemp(dir)) {
        perror("mkdtemp");
        return 1;
    }
    test_tokens();
    test_tokens_errors();
    test_config_file();
    test_security_rules();
    test_metrics();
    char cmd[600];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    if (system(cmd) != 0)
        fprintf(stderr, "could not remove %s\n", dir);
    if (failures) {
        fprintf(stderr, "%d check(s) failed\n", failures);
        return 1;
    }
    printf("ops unit tests passed\n");
    return 0;
}
