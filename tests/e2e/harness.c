#include "harness.h"

#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <inttypes.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

int kvd_test_failures;

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static void sleep_ms(int ms)
{
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

/* ------------------------------------------------------------------------ */
/* The server                                                                */
/* ------------------------------------------------------------------------ */

int harness_init(kvd_harness *h, const char *server_bin)
{
    memset(h, 0, sizeof *h);
    h->server_bin = server_bin;
    const char *tmp = getenv("TMPDIR");
    snprintf(h->root, sizeof h->root, "%s/kvdepot-e2e-XXXXXX", tmp && *tmp ? tmp : "/tmp");
    if (!mkdtemp(h->root)) {
        fprintf(stderr, "harness: mkdtemp %s: %s\n", h->root, strerror(errno));
        return -1;
    }
    snprintf(h->data_dir, sizeof h->data_dir, "%s/data", h->root);
    snprintf(h->port_file, sizeof h->port_file, "%s/port", h->root);
    snprintf(h->log_path, sizeof h->log_path, "%s/kvdepotd.log", h->root);
    if (access(server_bin, X_OK) != 0) {
        fprintf(stderr, "harness: server %s: %s\n", server_bin, strerror(errno));
        return -1;
    }
    return 0;
}

void harness_dump_log(const kvd_harness *h, int lines)
{
    FILE *f = fopen(h->log_path, "r");
    if (!f)
        return;
    /* Keep the last `lines` lines in a ring. */
    char **ring = calloc((size_t)lines, sizeof *ring);
    char buf[1024];
    long n = 0;
    while (ring && fgets(buf, sizeof buf, f)) {
        free(ring[n % lines]);
        ring[n % lines] = strdup(buf);
        n++;
    }
    fclose(f);
    if (!ring)
        return;
    fprintf(stderr, "---- last lines of %s ----\n", h->log_path);
    for (long i = n > lines ? n - lines : 0; i < n; i++)
        fputs(ring[i % lines] ? ring[i % lines] : "\n", stderr);
    fprintf(stderr, "---- end of server log ----\n");
    for (int i = 0; i < lines; i++)
        free(ring[i]);
    free(ring);
}

/* The port file counts once it holds a number and its newline. */
static int read_port_file(const char *path)
{
    FILE *f = fopen(path, "r");
    if (!f)
        return -1;
    char buf[32] = {0};
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    if (n == 0 || !memchr(buf, '\n', n))
        return -1;
    char *end;
    long port = strtol(buf, &end, 10);
    if (end == buf || *end != '\n' || port <= 0 || port > 65535)
        return -1;
    return (int)port;
}

static int spawn(kvd_harness *h, int port)
{
    unlink(h->port_file);
    char listen[64];
    snprintf(listen, sizeof listen, "127.0.0.1:%d", port);
    int fd = open(h->log_path, O_WRONLY | O_CREAT | O_APPEND, 0644);
    if (fd < 0) {
        fprintf(stderr, "harness: %s: %s\n", h->log_path, strerror(errno));
        return -1;
    }
    dprintf(fd, "==== harness: start %d: %s --listen %s --data-dir %s --port-file %s\n",
            h->starts + 1, h->server_bin, listen, h->data_dir, h->port_file);
    fflush(NULL);
    pid_t pid = fork();
    if (pid < 0) {
        close(fd);
        fprintf(stderr, "harness: fork: %s\n", strerror(errno));
        return -1;
    }
    if (pid == 0) {
        dup2(fd, STDOUT_FILENO);
        dup2(fd, STDERR_FILENO);
        close(fd);
        int devnull = open("/dev/null", O_RDONLY);
        if (devnull >= 0)
            dup2(devnull, STDIN_FILENO);
        const char *extra = getenv("KVD_E2E_SERVER_LOG_LEVEL");
        if (extra && *extra)
            execl(h->server_bin, h->server_bin, "--listen", listen, "--data-dir", h->data_dir,
                  "--port-file", h->port_file, "--log-level", extra, (char *)NULL);
        else
            execl(h->server_bin, h->server_bin, "--listen", listen, "--data-dir", h->data_dir,
                  "--port-file", h->port_file, (char *)NULL);
        dprintf(STDERR_FILENO, "harness: exec %s: %s\n", h->server_bin, strerror(errno));
        _exit(127);
    }
    close(fd);
    h->pid = pid;
    h->starts++;
    double t0 = now_s();
    while (now_s() - t0 < 60.0) {
        int st;
        pid_t r = waitpid(pid, &st, WNOHANG);
        if (r == pid) {
            h->pid = 0;
            fprintf(stderr, "harness: kvdepotd exited before serving (%s %d)\n",
                    WIFEXITED(st) ? "status" : "signal", WIFEXITED(st) ? WEXITSTATUS(st) : WTERMSIG(st));
            return -1;
        }
        int p = read_port_file(h->port_file);
        if (p > 0) {
            h->port = p;
            snprintf(h->addr, sizeof h->addr, "127.0.0.1:%d", p);
            return 0;
        }
        sleep_ms(20);
    }
    fprintf(stderr, "harness: no port in %s after 60 s\n", h->port_file);
    harness_kill(h);
    return -1;
}

int harness_start(kvd_harness *h)
{
    if (spawn(h, h->port) == 0)
        return 0;
    /* The old port can be taken by now; a new one is still a restart. */
    if (h->port && spawn(h, 0) == 0)
        return 0;
    harness_dump_log(h, 40);
    return -1;
}

int harness_stop(kvd_harness *h)
{
    if (!h->pid)
        return 0;
    kill(h->pid, SIGTERM);
    double t0 = now_s();
    int st;
    while (now_s() - t0 < 60.0) {
        pid_t r = waitpid(h->pid, &st, WNOHANG);
        if (r == h->pid) {
            h->pid = 0;
            if (WIFEXITED(st))
                return WEXITSTATUS(st);
            fprintf(stderr, "harness: kvdepotd died of signal %d on SIGTERM\n", WTERMSIG(st));
            return -1;
        }
        sleep_ms(10);
    }
    fprintf(stderr, "harness: kvdepotd still running 60 s after SIGTERM; killing it\n");
    harness_kill(h);
    return -1;
}

int harness_alive(kvd_harness *h)
{
    if (!h->pid)
        return 0;
    int st;
    if (waitpid(h->pid, &st, WNOHANG) != h->pid)
        return 1;
    h->pid = 0;
    if (WIFSIGNALED(st))
        fprintf(stderr, "harness: kvdepotd died of signal %d\n", WTERMSIG(st));
    else
        fprintf(stderr, "harness: kvdepotd exited with status %d\n", WEXITSTATUS(st));
    return 0;
}

void harness_kill(kvd_harness *h)
{
    if (!h->pid)
        return;
    kill(h->pid, SIGKILL);
    waitpid(h->pid, NULL, 0);
    h->pid = 0;
}

int harness_restart(kvd_harness *h)
{
    int st = harness_stop(h);
    if (st != 0) {
        fprintf(stderr, "harness: kvdepotd exited with %d on SIGTERM, want 0\n", st);
        harness_dump_log(h, 40);
    }
    if (harness_start(h) != 0)
        return -1;
    return st == 0 ? 0 : -1;
}

static int rm_entry(const char *path, const struct stat *sb, int flag, struct FTW *ftw)
{
    (void)sb, (void)flag, (void)ftw;
    remove(path);
    return 0;
}

void harness_destroy(kvd_harness *h, int failed)
{
    if (h->pid) {
        int st = harness_stop(h);
        if (st != 0) {
            fprintf(stderr, "harness: kvdepotd exited with %d on SIGTERM, want 0\n", st);
            kvd_test_failures++;
            failed = 1;
        }
    }
    if (failed || getenv("KVD_E2E_VERBOSE"))
        harness_dump_log(h, failed ? 60 : 1000);
    if (getenv("KVD_E2E_KEEP"))
        fprintf(stderr, "harness: kept %s\n", h->root);
    else if (h->root[0])
        nftw(h->root, rm_entry, 16, FTW_DEPTH | FTW_PHYS);
}

kvdepot_client *harness_client_opts(const kvd_harness *h, kvdepot_options *opt)
{
    opt->address = h->addr;
    kvdepot_client *c = NULL;
    int rc = kvdepot_connect(opt, &c);
    if (rc) {
        fprintf(stderr, "harness: connect %s: %s: %s\n", h->addr, kvdepot_status_name(rc),
                kvdepot_errmsg(NULL));
        return NULL;
    }
    return c;
}

int harness_start_many(kvd_harness *hs, size_t n, const char *server_bin)
{
    for (size_t i = 0; i < n; i++) {
        if (harness_init(&hs[i], server_bin) != 0 || harness_start(&hs[i]) != 0) {
            for (size_t j = 0; j <= i; j++)
                harness_destroy(&hs[j], 1);
            return -1;
        }
    }
    return 0;
}

char *harness_addr_list(kvd_harness *const *hs, size_t n, char *buf, size_t cap)
{
    size_t len = 0;
    buf[0] = '\0';
    for (size_t i = 0; i < n; i++) {
        if (!hs[i]->pid)
            continue;
        int w = snprintf(buf + len, cap - len, "%s%s", len ? "," : "", hs[i]->addr);
        if (w < 0 || (size_t)w >= cap - len)
            break;
        len += (size_t)w;
    }
    return buf;
}

kvdepot_client *harness_client(const kvd_harness *h)
{
    kvdepot_options opt;
    kvdepot_options_init(&opt);
    /* Long enough for a loaded machine, short enough that a dead server
     * fails the test rather than hanging it. */
    opt.deadline_ms = 60000;
    opt.wait_for_ready = 1;
    return harness_client_opts(h, &opt);
}

/* ------------------------------------------------------------------------ */
/* Test data                                                                 */
/* ------------------------------------------------------------------------ */

void fill_random(void *buf, size_t n, uint64_t seed)
{
    /* splitmix64: one multiply-xorshift round per 8 bytes, plenty fast for
     * half a gigabyte and with no visible structure. */
    uint64_t x = seed * 0x9e3779b97f4a7c15ull + 0x632be59bd9b4e019ull;
    uint8_t *p = buf;
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        x += 0x9e3779b97f4a7c15ull;
        uint64_t z = x;
        z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
        z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
        z ^= z >> 31;
        memcpy(p + i, &z, 8);
    }
    if (i < n) {
        x += 0x9e3779b97f4a7c15ull;
        uint64_t z = (x ^ (x >> 31)) * 0xbf58476d1ce4e5b9ull;
        memcpy(p + i, &z, n - i);
    }
}

int ref_init(ref_seq *r, const char *id, const kvdepot_model *m, uint64_t cap_tokens)
{
    memset(r, 0, sizeof *r);
    snprintf(r->id, sizeof r->id, "%s", id);
    r->model = *m;
    r->cap_tokens = cap_tokens;
    r->token_bytes = kvdepot_kv_bytes(m, 1, 1);
    size_t bytes = (size_t)m->num_layers * cap_tokens * r->token_bytes;
    r->k = calloc(1, bytes ? bytes : 1);
    r->v = calloc(1, bytes ? bytes : 1);
    r->layer_tokens = calloc(m->num_layers ? m->num_layers : 1, sizeof *r->layer_tokens);
    if (!r->k || !r->v || !r->layer_tokens) {
        ref_free(r);
        return -1;
    }
    return 0;
}

void ref_free(ref_seq *r)
{
    free(r->k);
    free(r->v);
    free(r->layer_tokens);
    r->k = r->v = NULL;
    r->layer_tokens = NULL;
}

static uint8_t *ref_at(const ref_seq *r, const uint8_t *base, uint32_t layer, uint64_t token)
{
    return (uint8_t *)base + ((size_t)layer * r->cap_tokens + token) * r->token_bytes;
}

int ref_make(const ref_seq *r, uint32_t l0, uint32_t nl, uint64_t nt, uint64_t seed, uint8_t **k,
             uint8_t **v, size_t *bytes)
{
    *bytes = (size_t)nl * nt * r->token_bytes;
    *k = malloc(*bytes ? *bytes : 1);
    *v = malloc(*bytes ? *bytes : 1);
    if (!*k || !*v) {
        free(*k);
        free(*v);
        return -1;
    }
    (void)l0;
    fill_random(*k, *bytes, seed * 2 + 1);
    fill_random(*v, *bytes, seed * 2 + 2);
    return 0;
}

void ref_commit(ref_seq *r, uint32_t l0, uint32_t nl, uint64_t nt, const uint8_t *k,
                const uint8_t *v)
{
    for (uint32_t l = 0; l < nl; l++) {
        uint64_t t0 = r->layer_tokens[l0 + l];
        size_t row = nt * r->token_bytes;
        memcpy(ref_at(r, r->k, l0 + l, t0), k + l * row, row);
        memcpy(ref_at(r, r->v, l0 + l, t0), v + l * row, row);
        r->layer_tokens[l0 + l] = t0 + nt;
    }
}

static int append_ex(kvdepot_client *c, ref_seq *r, uint32_t l0, uint32_t nl, uint64_t nt,
                     uint64_t seed, const uint32_t *token_ids, const kvdepot_engine_hashes *eh);

int ref_append(kvdepot_client *c, ref_seq *r, uint32_t l0, uint32_t nl, uint64_t nt, uint64_t seed,
               const uint32_t *token_ids)
{
    return append_ex(c, r, l0, nl, nt, seed, token_ids, NULL);
}

int ref_append_engine(kvdepot_client *c, ref_seq *r, uint32_t l0, uint32_t nl, uint64_t nt,
                      uint64_t seed, const kvdepot_engine_hashes *eh)
{
    return append_ex(c, r, l0, nl, nt, seed, NULL, eh);
}

static int append_ex(kvdepot_client *c, ref_seq *r, uint32_t l0, uint32_t nl, uint64_t nt,
                     uint64_t seed, const uint32_t *token_ids, const kvdepot_engine_hashes *eh)
{
    /* nl = 0 asks the server for all layers from l0; the data covers them. */
    uint32_t eff = nl ? nl : r->model.num_layers - l0;
    if (r->layer_tokens[l0] + nt > r->cap_tokens) {
        fprintf(stderr, "ref_append: reference capacity %" PRIu64 " exceeded\n", r->cap_tokens);
        return KVDEPOT_EINTERNAL;
    }
    uint8_t *k, *v;
    size_t bytes;
    if (ref_make(r, l0, eff, nt, seed, &k, &v, &bytes) != 0)
        return KVDEPOT_ENOMEM;
    kvdepot_append_args a = {
        .id = r->id,
        .id_len = strlen(r->id),
        .layer_start = l0,
        .num_layers = nl,
        .token_start = r->layer_tokens[l0],
        .num_tokens = nt,
        .dtype = r->model.dtype,
        .k = k,
        .k_bytes = bytes,
        .v = v,
        .v_bytes = bytes,
        .token_ids = token_ids,
        .num_token_ids = token_ids ? nt : 0,
    };
    if (eh)
        a.engine_hashes = *eh;
    kvdepot_sequence_info info;
    int rc = kvdepot_sequence_append(c, &a, &info);
    if (rc == KVDEPOT_OK) {
        ref_commit(r, l0, eff, nt, k, v);
        kvdepot_sequence_info_clear(&info);
    }
    free(k);
    free(v);
    return rc;
}

static int compare(const char *what, const ref_seq *r, const uint8_t *got, const uint8_t *base,
                   uint32_t l0, uint32_t nl, uint64_t t0, uint64_t nt)
{
    size_t row = nt * r->token_bytes;
    for (uint32_t l = 0; l < nl; l++) {
        const uint8_t *want = ref_at(r, base, l0 + l, t0);
        const uint8_t *g = got + l * row;
        if (memcmp(g, want, row) != 0) {
            size_t i = 0;
            while (g[i] == want[i])
                i++;
            fprintf(stderr,
                    "%s of %s differs: layer %u token %" PRIu64 " byte %zu: got %02x want %02x\n",
                    what, r->id, l0 + l, t0 + i / r->token_bytes, i % r->token_bytes, g[i], want[i]);
            return -1;
        }
    }
    return 0;
}

int ref_check_range(kvdepot_client *c, const ref_seq *r, uint32_t l0, uint32_t nl, uint64_t t0,
                    uint64_t nt)
{
    kvdepot_read_args a = {.id = r->id,
                           .id_len = strlen(r->id),
                           .layer_start = l0,
                           .num_layers = nl,
                           .token_start = t0,
                           .num_tokens = nt};
    kvdepot_read_result res;
    int rc = kvdepot_sequence_read(c, &a, &res);
    if (rc) {
        fprintf(stderr, "read %s layers %u+%u tokens %" PRIu64 "+%" PRIu64 ": %s: %s\n", r->id, l0,
                nl, t0, nt, kvdepot_status_name(rc), kvdepot_errmsg(c));
        return -1;
    }
    int bad = 0;
    if (res.layer_start != l0 || res.num_layers != nl || res.token_start != t0 ||
        res.num_tokens != nt || res.num_kv_heads != r->model.num_kv_heads ||
        res.head_dim != r->model.head_dim || res.dtype != r->model.dtype ||
        res.kv_bytes != (size_t)nl * nt * r->token_bytes) {
        fprintf(stderr,
                "read %s: header says layers %u+%u tokens %" PRIu64 "+%" PRIu64
                " heads %u dim %u dtype %d bytes %zu; asked layers %u+%u tokens %" PRIu64
                "+%" PRIu64 "\n",
                r->id, res.layer_start, res.num_layers, res.token_start, res.num_tokens,
                res.num_kv_heads, res.head_dim, (int)res.dtype, res.kv_bytes, l0, nl, t0, nt);
        bad = 1;
    }
    if (!bad) {
        bad = compare("K", r, res.k, r->k, l0, nl, t0, nt) != 0;
        bad |= compare("V", r, res.v, r->v, l0, nl, t0, nt) != 0;
    }
    kvdepot_free(res.owned);
    return bad ? -1 : 0;
}

int ref_verify(kvdepot_client *c, const ref_seq *r)
{
    kvdepot_sequence_info s;
    int rc = kvdepot_sequence_stat(c, r->id, strlen(r->id), &s);
    if (rc) {
        fprintf(stderr, "stat %s: %s: %s\n", r->id, kvdepot_status_name(rc), kvdepot_errmsg(c));
        return -1;
    }
    uint64_t min = UINT64_MAX;
    int bad = 0;
    for (uint32_t l = 0; l < r->model.num_layers; l++)
        if (r->layer_tokens[l] < min)
            min = r->layer_tokens[l];
    if (s.num_tokens != min) {
        fprintf(stderr, "stat %s: num_tokens %" PRIu64 ", want %" PRIu64 "\n", r->id, s.num_tokens, min);
        bad = 1;
    }
    if (s.num_layers != r->model.num_layers) {
        fprintf(stderr, "stat %s: %zu layer counts, want %u\n", r->id, s.num_layers,
                r->model.num_layers);
        bad = 1;
    } else {
        for (uint32_t l = 0; l < r->model.num_layers; l++) {
            if (s.layer_tokens[l] != r->layer_tokens[l]) {
                fprintf(stderr, "stat %s: layer %u has %" PRIu64 " tokens, want %" PRIu64 "\n",
                        r->id, l, s.layer_tokens[l], r->layer_tokens[l]);
                bad = 1;
            }
        }
    }
    if (strcmp(s.model, r->model.name) != 0) {
        fprintf(stderr, "stat %s: model %s, want %s\n", r->id, s.model, r->model.name);
        bad = 1;
    }
    kvdepot_sequence_info_clear(&s);
    if (bad)
        return -1;
    /* Each layer over everything it stores. */
    for (uint32_t l = 0; l < r->model.num_layers; l++)
        if (r->layer_tokens[l] && ref_check_range(c, r, l, 1, 0, r->layer_tokens[l]) != 0)
            return -1;
    /* The default range: all layers, num_tokens. */
    if (min) {
        kvdepot_read_args a = {.id = r->id, .id_len = strlen(r->id)};
        kvdepot_read_result res;
        rc = kvdepot_sequence_read(c, &a, &res);
        if (rc) {
            fprintf(stderr, "read %s (default range): %s: %s\n", r->id, kvdepot_status_name(rc),
                    kvdepot_errmsg(c));
            return -1;
        }
        if (res.num_layers != r->model.num_layers || res.num_tokens != min || res.token_start != 0) {
            fprintf(stderr, "read %s (default range): %u layers x %" PRIu64 " tokens from %" PRIu64
                            ", want %u x %" PRIu64 " from 0\n",
                    r->id, res.num_layers, res.num_tokens, res.token_start, r->model.num_layers, min);
            bad = 1;
        } else {
            bad = compare("K", r, res.k, r->k, 0, r->model.num_layers, 0, min) != 0;
            bad |= compare("V", r, res.v, r->v, 0, r->model.num_layers, 0, min) != 0;
        }
        kvdepot_free(res.owned);
    }
    return bad ? -1 : 0;
}

/* ------------------------------------------------------------------------ */
/* Running tests                                                             */
/* ------------------------------------------------------------------------ */

int harness_main(int argc, char **argv, const kvd_test *tests, size_t ntests)
{
    signal(SIGPIPE, SIG_IGN);
    const char *bin = argc > 1 ? argv[1] : getenv("KVDEPOTD");
    if (!bin) {
        fprintf(stderr, "usage: %s KVDEPOTD_PATH [TEST...]\ntests:", argv[0]);
        for (size_t i = 0; i < ntests; i++)
            fprintf(stderr, " %s", tests[i].name);
        fputc('\n', stderr);
        return 2;
    }
    int failed_tests = 0, ran = 0;
    for (size_t i = 0; i < ntests; i++) {
        int wanted = argc <= 2;
        for (int j = 2; j < argc; j++)
            if (strcmp(argv[j], tests[i].name) == 0)
                wanted = 1;
        if (!wanted)
            continue;
        ran++;
        kvd_harness h;
        kvd_test_failures = 0;
        double t0 = now_s();
        int aborted = 0;
        if (harness_init(&h, bin) != 0 || harness_start(&h) != 0) {
            kvd_test_failures++;
            aborted = 1;
        } else {
            aborted = tests[i].fn(&h) != 0;
        }
        int failed = kvd_test_failures > 0 || aborted;
        harness_destroy(&h, failed);
        failed = failed || kvd_test_failures > 0;
        printf("%s %s (%.1f s)\n", failed ? "FAIL" : "PASS", tests[i].name, now_s() - t0);
        fflush(stdout);
        failed_tests += failed;
    }
    if (!ran) {
        fprintf(stderr, "no test matched\n");
        return 2;
    }
    return failed_tests ? 1 : 0;
}
