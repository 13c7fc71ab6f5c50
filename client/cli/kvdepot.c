/*
 * kvdepot — command-line client for a kvdepotd server, built on libkvdepot.
 *
 * Exit status: 0 on success, 1 when the server or a file operation failed,
 * 2 for a usage error. Errors go to stderr as
 *     kvdepot: NOT_FOUND: no such sequence "abc"
 */
#include "kvdepot.h"

#include <json-c/json.h>

#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

static const char usage_text[] =
    "usage: kvdepot [--addr ADDR] [--deadline-ms MS] [--tls] [--tls-ca FILE]\n"
    "               [--tls-cert FILE --tls-key FILE] [--tls-server-name NAME]\n"
    "               [--token TOKEN] [--json] [--progress|--no-progress] COMMAND [ARGS]\n"
    "\n"
    "Talks to a kvdepotd server (ADDR, default $KVDEPOT_ADDR or 127.0.0.1:50051).\n"
    "ADDR may name several servers, \"a:50051,b:50051\" or shards:HOST:PORT (every\n"
    "address HOST resolves to): sequences are then spread over them.\n"
    "TLS is used when --tls or any --tls-* file is given (--tls-ca, or --ca:\n"
    "roots to verify the server with, default the system's; --tls-cert/--tls-key: client\n"
    "certificate for mTLS). The bearer token comes from --token or $KVDEPOT_TOKEN\n"
    "(prefer the variable: command lines are visible to other users).\n"
    "These options may also follow the command. --json: what a command prints\n"
    "is one JSON value on stdout. put and get show their progress (bytes, rate,\n"
    "ETA) on stderr when it is a terminal; --progress always, --no-progress never.\n"
    "\n"
    "commands:\n"
    "  health                               is the server serving?\n"
    "  shards [ID...]                       list the servers ADDR names; with IDs, the\n"
    "                                       server that owns each sequence id\n"
    "  models                               list models\n"
    "  model put NAME --layers N --kv-heads N --head-dim N --dtype f16|bf16|f32\n"
    "            [--q-heads N] [--revision R] [--hidden N] [--replace]\n"
    "                                       register a model\n"
    "  model get NAME                       show a model\n"
    "  model rm NAME [--force]              delete a model (--force: and its sequences)\n"
    "  seqs [--model M]                     list sequences\n"
    "  seq stat ID                          show a sequence\n"
    "  seq rm ID                            delete a sequence\n"
    "  seq evict ID                         move a sequence's pages out of the server's\n"
    "                                       memory tiers (it stays stored)\n"
    "  seq pq-rebuild ID [--layer-start L] [--layers N]\n"
    "                                       train a sequence's PQ index again on keys\n"
    "                                       from all its tokens, code every page\n"
    "  stats                                the server's tiers (bytes, pages, hits,\n"
    "                                       evictions) and durability\n"
    "  backup DIR                           a consistent copy of the whole store in DIR\n"
    "                                       on the server's host (absolute, new; admin)\n"
    "  put ID --model M --tokens N --file F [--layer-start L] [--layers N]\n"
    "         [--token-ids FILE] [--ttl SECONDS] [--activations]\n"
    "         [--k CODEC] [--v CODEC] [--pq mMbB[iN][tT]] [--raw-sink N]\n"
    "                                       append N tokens from F (K then V, raw, in\n"
    "                                       [layer][token][kv_head][head_dim] layout and\n"
    "                                       the model dtype), creating the sequence if\n"
    "                                       needed; appends at each layer's end.\n"
    "                                       --activations: F ends with X ([layer][token]\n"
    "                                       [hidden]); a sequence created here stores them\n"
    "                                       CODEC (K/V of a sequence created here):\n"
    "                                       raw|int2|int4|vq-dDbB[,gG][,token|channel]\n"
    "                                       [,stochastic][,seed=N][,svd=RATE]\n"
    "                                       [,widths=W[:W...]][,align=N]; --pq: a PQ\n"
    "                                       index of m sub-spaces, 2^b centroids, N\n"
    "                                       K-means steps, trained once a layer holds T\n"
    "                                       tokens (default 4096)\n"
    "  get ID --file F [--layer-start L] [--layers N] [--token-start T] [--tokens N]\n"
    "         [--activation-tokens A]\n"
    "                                       write K then V of the range to F ('-' = stdout);\n"
    "                                       with A: X of the first A tokens, then K, V of\n"
    "                                       the rest\n"
    "  lookup --model M HASH...             how many leading blocks of a hash chain\n"
    "                                       are cached (hashes in hex)\n"
    "  attend ID --layer L --q FILE [--out F] [--token-start T] [--tokens N] [--scale S]\n"
    "                                       decode attention on the server: q is\n"
    "                                       (num_q_heads, head_dim) f32 LE; prints the\n"
    "                                       LSE per head, writes the output (f32) to F\n"
    "  search ID --layer L --q FILE --k K [--initial N] [--recent N] [--sparse]\n"
    "                                       PQ top-k tokens per kv head (sequence made\n"
    "                                       with a PQ index); --sparse also attends\n"
    "                                       over them and prints the LSE per head\n"
    "  plan ID --bandwidth B/s --flops F/s [--activations]\n"
    "                                       KVPR fetch split (PlanFetch); rates with\n"
    "                                       units: 25G, 25GB/s, 2.5e10, 512Mi\n"
    "  calibrate --model M --tokens N --file F [--q FILE] [--layer-start L] [--layers N]\n"
    "            [--vq dDbB] [--svd] [--iterations N] [--seed S] [--max-samples N]\n"
    "            [--error-budget X [--eval-queries N] [--exhaustive]]\n"
    "                                       compute the model's artifacts from samples:\n"
    "                                       F holds K then V ([layer][token][kv_head]\n"
    "                                       [head_dim], model dtype), FILE Q likewise\n"
    "                                       with q heads; prints errors per head;\n"
    "                                       --error-budget: codec advice (needs --q)\n"
    "  artifacts get|put --model M --file F [--kind K]\n"
    "                                       fetch (kind 1..7, default all) or upload\n"
    "                                       artifacts; F: per artifact u32 kind, layer,\n"
    "                                       kv_head, ndim, shape[2], then f32 data (LE)\n"
    "  hash --token-ids FILE [--page-tokens N]\n"
    "                                       print the prefix hash of every complete block\n"
    "\n"
    "A token-id FILE holds whitespace-separated decimal token ids.\n";

static void usage_error(const char *fmt, ...) __attribute__((format(printf, 1, 2), noreturn));
static void usage_error(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fputs("kvdepot: ", stderr);
    vfprintf(stderr, fmt, ap);
    fputs("\n(run 'kvdepot --help' for usage)\n", stderr);
    va_end(ap);
    exit(2);
}

/* Report a failed library call and return the exit status for it. */
static int fail(const kvdepot_client *c, int rc)
{
    const char *msg = kvdepot_errmsg(c);
    fprintf(stderr, "kvdepot: %s: %s\n", kvdepot_status_name(rc),
            msg[0] ? msg : kvdepot_strerror(rc));
    return 1;
}

static int fail_msg(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static int fail_msg(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fputs("kvdepot: ", stderr);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
    return 1;
}

/* ------------------------------------------------------------------------ */
/* Argument parsing                                                          */
/* ------------------------------------------------------------------------ */

typedef struct opt {
    const char *name; /* without the dashes */
    int has_arg;
    const char *val; /* argument, or "" for a flag that was given */
} opt;

/*
 * Split args into options from `opts` (--name VALUE, --name=VALUE, --flag)
 * and positional arguments. Unknown options are usage errors.
 */
static int parse_args(int argc, char **argv, opt *opts, const char **pos, int max_pos)
{
    int npos = 0;
    for (int i = 0; i < argc; i++) {
        const char *a = argv[i];
        if (a[0] == '-' && a[1] == '-' && a[2]) {
            const char *name = a + 2;
            const char *eq = strchr(name, '=');
            size_t len = eq ? (size_t)(eq - name) : strlen(name);
            opt *o = NULL;
            for (opt *p = opts; p && p->name; p++)
                if (strlen(p->name) == len && strncmp(p->name, name, len) == 0)
                    o = p;
            if (!o)
                usage_error("unknown option --%.*s", (int)len, name);
            if (o->has_arg) {
                if (eq)
                    o->val = eq + 1;
                else if (i + 1 < argc)
                    o->val = argv[++i];
                else
                    usage_error("--%s needs a value", o->name);
            } else {
                if (eq)
                    usage_error("--%s takes no value", o->name);
                o->val = "";
            }
        } else {
            if (npos == max_pos)
                usage_error("unexpected argument \"%s\"", a);
            pos[npos++] = a;
        }
    }
    return npos;
}

static const char *opt_get(const opt *opts, const char *name)
{
    for (const opt *p = opts; p->name; p++)
        if (strcmp(p->name, name) == 0)
            return p->val;
    return NULL;
}

static uint64_t parse_u64(const char *what, const char *s, uint64_t max)
{
    char *end;
    errno = 0;
    if (!s || !*s || *s == '-')
        usage_error("%s: expected a number, got \"%s\"", what, s ? s : "");
    unsigned long long v = strtoull(s, &end, 0);
    if (errno || *end || v > max)
        usage_error("%s: bad number \"%s\"", what, s);
    return v;
}

/* A rate or an amount with a unit: a number (exponent allowed), then K, M,
 * G or T (powers of 1000) or Ki, Mi, Gi, Ti (powers of 1024), then
 * optionally "B" and "/s": "10G", "10GB/s", "2.5e9", "512Mi". A positive,
 * finite result or a usage error naming the flag. */
static double parse_rate(const char *what, const char *s)
{
    char *end;
    errno = 0;
    double v = s && *s ? strtod(s, &end) : 0;
    if (!s || !*s || end == s || errno)
        usage_error("%s: expected a number with an optional unit (e.g. 10G, 25GB/s), got \"%s\"",
                    what, s ? s : "");
    static const char units[] = "KMGT";
    const char *u = strchr(units, *end);
    if (*end && u) {
        int k = (int)(u - units) + 1, bin = end[1] == 'i';
        for (int i = 0; i < k; i++)
            v *= bin ? 1024.0 : 1000.0;
        end += 1 + bin;
    }
    if (*end == 'B')
        end++;
    if (end[0] == '/' && end[1] == 's')
        end += 2;
    if (*end || !isfinite(v) || !(v > 0))
        usage_error("%s: bad value \"%s\" (a positive number, then K, M, G, T, Ki..Ti, B, /s)",
                    what, s);
    return v;
}

static uint64_t opt_u64(const opt *opts, const char *name, uint64_t def, uint64_t max)
{
    const char *v = opt_get(opts, name);
    if (!v)
        return def;
    char what[64];
    snprintf(what, sizeof what, "--%s", name);
    return parse_u64(what, v, max);
}

static const char *opt_required(const opt *opts, const char *name)
{
    const char *v = opt_get(opts, name);
    if (!v || !*v)
        usage_error("--%s is required", name);
    return v;
}

/* Read whitespace-separated decimal token ids; returns a malloc'ed array. */
static uint32_t *read_token_ids(const char *path, size_t *n)
{
    FILE *f = strcmp(path, "-") == 0 ? stdin : fopen(path, "r");
    if (!f) {
        fail_msg("%s: %s", path, strerror(errno));
        exit(1);
    }
    size_t cap = 1024, len = 0;
    uint32_t *ids = malloc(cap * sizeof *ids);
    unsigned long long v;
    int r;
    while (ids && (r = fscanf(f, "%llu", &v)) == 1) {
        if (v > UINT32_MAX) {
            fail_msg("%s: token id %llu does not fit in 32 bits", path, v);
            exit(1);
        }
        if (len == cap) {
            cap *= 2;
            uint32_t *n2 = realloc(ids, cap * sizeof *ids);
            if (!n2) {
                free(ids);
                ids = NULL;
                break;
            }
            ids = n2;
        }
        ids[len++] = (uint32_t)v;
    }
    if (!ids) {
        fail_msg("out of memory reading %s", path);
        exit(1);
    }
    if (!feof(f)) {
        fail_msg("%s: not a list of decimal token ids (after %zu ids)", path, len);
        exit(1);
    }
    if (f != stdin)
        fclose(f);
    *n = len;
    return ids;
}

/* Print a sequence id: as text when printable, else with \xNN escapes. */
static void print_id(FILE *f, const uint8_t *id, size_t len)
{
    for (size_t i = 0; i < len; i++) {
        if (id[i] >= 0x20 && id[i] < 0x7f && id[i] != '\\')
            fputc(id[i], f);
        else
            fprintf(f, "\\x%02x", id[i]);
    }
}

/* ------------------------------------------------------------------------ */
/* --json output                                                             */
/* ------------------------------------------------------------------------ */

static int json_out; /* --json: each command prints one JSON value */

/* A new JSON object or array; out of memory ends the program. */
static json_object *jnew(json_object *o)
{
    if (!o) {
        fputs("kvdepot: out of memory\n", stderr);
        exit(1);
    }
    return o;
}

static json_object *jobj(void)
{
    return jnew(json_object_new_object());
}

static json_object *jarr(void)
{
    return jnew(json_object_new_array());
}

static void jset(json_object *o, const char *k, json_object *v)
{
    json_object_object_add(o, k, v);
}

static void jstr(json_object *o, const char *k, const char *v)
{
    jset(o, k, json_object_new_string(v ? v : ""));
}

static void ju64(json_object *o, const char *k, uint64_t v)
{
    jset(o, k, json_object_new_uint64(v));
}

/* A double, or null when it is not finite (JSON has no NaN or infinity). */
static json_object *jdouble(double v)
{
    return isfinite(v) ? json_object_new_double(v) : NULL;
}

static void jdbl(json_object *o, const char *k, double v)
{
    jset(o, k, jdouble(v));
}

/* A 64-bit hash as 16 hex digits (JSON numbers lose precision past 2^53). */
static json_object *jhex(uint64_t v)
{
    char b[17];
    snprintf(b, sizeof b, "%016" PRIx64, v);
    return json_object_new_string(b);
}

/* A sequence id as printed: text, with \xNN escapes where not printable. */
static json_object *jid(const uint8_t *id, size_t len)
{
    char *buf = NULL;
    size_t n = 0;
    FILE *f = open_memstream(&buf, &n);
    if (f) {
        print_id(f, id, len);
        fclose(f);
    }
    json_object *o = json_object_new_string(buf ? buf : "");
    free(buf);
    return o;
}

/* Print v (pretty, one value) and release it; exit status 0. */
static int jprint(json_object *v)
{
    const char *t = json_object_to_json_string_ext(
        v, JSON_C_TO_STRING_PRETTY | JSON_C_TO_STRING_SPACED | JSON_C_TO_STRING_NOSLASHESCAPE);
    printf("%s\n", t ? t : "null");
    json_object_put(v);
    return 0;
}

/* ------------------------------------------------------------------------ */
/* Progress of put and get                                                   */
/* ------------------------------------------------------------------------ */

/* -1: on when stderr is a terminal; 0 or 1: --no-progress, --progress. */
static int progress_mode = -1;

typedef struct progress {
    const char *what; /* "put ID", "get ID" */
    double t0, last;  /* seconds */
    double delay;     /* nothing shown before this much time has passed */
    int shown;
} progress;

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* "1.50 GiB", "512 KiB", "17 B". */
static const char *human_bytes(double b, char *buf, size_t cap)
{
    static const char *u[] = {"B", "KiB", "MiB", "GiB", "TiB"};
    int i = 0;
    while (b >= 1024 && i < 4) {
        b /= 1024;
        i++;
    }
    snprintf(buf, cap, i ? "%.2f %s" : "%.0f %s", b, u[i]);
    return buf;
}

/* One status line on stderr, rewritten in place at most 5 times a second:
 * bytes done of total, percentage, rate, time left; cleared when all of it
 * has gone or arrived. */
static void show_progress(void *user, uint64_t done, uint64_t total)
{
    progress *p = user;
    if (done >= total) {
        if (p->shown)
            fputs("\r\033[K", stderr);
        p->shown = 0;
        return;
    }
    double t = now_s();
    if (t - p->t0 < p->delay || (p->shown && t - p->last < 0.2))
        return;
    p->last = t;
    p->shown = 1;
    double el = t - p->t0, rate = el > 0 ? done / el : 0;
    char a[32], b[32], r[32];
    fprintf(stderr, "\r\033[K%s: %s of %s (%.0f%%), %s/s", p->what, human_bytes(done, a, sizeof a),
            human_bytes(total, b, sizeof b), 100.0 * done / total, human_bytes(rate, r, sizeof r));
    if (rate > 0)
        fprintf(stderr, ", ETA %.0f s", (total - done) / rate);
}

/* Turn progress on for this client when asked or when stderr is a
 * terminal. KVDEPOT_PROGRESS_DELAY_MS (default 500) is how long a transfer
 * runs before its line appears. */
static void progress_start(kvdepot_client *c, progress *p, const char *what)
{
    memset(p, 0, sizeof *p);
    if (!(progress_mode == 1 || (progress_mode == -1 && isatty(STDERR_FILENO))))
        return;
    const char *d = getenv("KVDEPOT_PROGRESS_DELAY_MS");
    p->what = what;
    p->t0 = now_s();
    p->delay = d ? atof(d) / 1000.0 : 0.5;
    kvdepot_set_progress(c, show_progress, p);
}

static void progress_end(kvdepot_client *c, progress *p)
{
    if (p->shown)
        fputs("\r\033[K", stderr);
    kvdepot_set_progress(c, NULL, NULL);
}

/* ------------------------------------------------------------------------ */
/* Commands                                                                  */
/* ------------------------------------------------------------------------ */

static int cmd_health(kvdepot_client *c, int argc, char **argv)
{
    const char *pos[1];
    int n = parse_args(argc, argv, NULL, pos, 1);
    kvdepot_serving s;
    int rc = kvdepot_health_check(c, n ? pos[0] : "", &s);
    if (rc)
        return fail(c, rc);
    static const char *names[] = {"UNKNOWN", "SERVING", "NOT_SERVING", "SERVICE_UNKNOWN"};
    const char *name = (unsigned)s < 4 ? names[s] : "UNKNOWN";
    if (json_out) {
        json_object *o = jobj();
        jstr(o, "status", name);
        jprint(o);
    } else {
        printf("%s\n", name);
    }
    return s == KVDEPOT_SERVING ? 0 : 1;
}

/* The servers of a sharded address, or the owner of each id given. */
static int cmd_shards(kvdepot_client *c, int argc, char **argv)
{
    const char *pos[64];
    int n = parse_args(argc, argv, NULL, pos, 64);
    char name[256];
    json_object *arr = json_out ? jarr() : NULL;
    if (n == 0) {
        size_t count = kvdepot_shard_count(c);
        for (size_t i = 0; i < count; i++) {
            int rc = kvdepot_shard_endpoint(c, i, name, sizeof name);
            if (rc)
                return fail(c, rc);
            if (arr)
                json_object_array_add(arr, json_object_new_string(name));
            else
                printf("%s\n", name);
        }
        return arr ? jprint(arr) : 0;
    }
    for (int i = 0; i < n; i++) {
        int rc = kvdepot_shard_owner(c, pos[i], strlen(pos[i]), name, sizeof name);
        if (rc)
            return fail(c, rc);
        if (arr) {
            json_object *o = jobj();
            jstr(o, "id", pos[i]);
            jstr(o, "server", name);
            json_object_array_add(arr, o);
        } else {
            printf("%s %s\n", pos[i], name);
        }
    }
    return arr ? jprint(arr) : 0;
}

static json_object *model_json(const kvdepot_model *m)
{
    json_object *o = jobj();
    jstr(o, "name", m->name);
    jstr(o, "revision", m->revision);
    ju64(o, "layers", m->num_layers);
    ju64(o, "kv_heads", m->num_kv_heads);
    ju64(o, "q_heads", m->num_q_heads);
    ju64(o, "head_dim", m->head_dim);
    ju64(o, "hidden_size", m->hidden_size);
    jstr(o, "dtype", kvdepot_dtype_name(m->dtype));
    ju64(o, "bytes_per_token", 2 * kvdepot_kv_bytes(m, m->num_layers, 1));
    ju64(o, "created_ms", m->created_unix_ms);
    return o;
}

static void print_model(const kvdepot_model *m)
{
    printf("name:          %s\n", m->name);
    printf("revision:      %s\n", m->revision);
    printf("layers:        %u\n", m->num_layers);
    printf("kv_heads:      %u\n", m->num_kv_heads);
    printf("q_heads:       %u\n", m->num_q_heads);
    printf("head_dim:      %u\n", m->head_dim);
    printf("hidden_size:   %u\n", m->hidden_size);
    printf("dtype:         %s\n", kvdepot_dtype_name(m->dtype));
    printf("bytes/token:   %zu (K+V, all layers)\n", 2 * kvdepot_kv_bytes(m, m->num_layers, 1));
    printf("created_ms:    %" PRIu64 "\n", m->created_unix_ms);
}

static int cmd_models(kvdepot_client *c, int argc, char **argv)
{
    parse_args(argc, argv, NULL, NULL, 0);
    kvdepot_model *list;
    size_t n;
    int rc = kvdepot_model_list(c, &list, &n);
    if (rc)
        return fail(c, rc);
    if (json_out) {
        json_object *a = jarr();
        for (size_t i = 0; i < n; i++)
            json_object_array_add(a, model_json(&list[i]));
        kvdepot_free(list);
        return jprint(a);
    }
    printf("%-32s %6s %8s %7s %8s %5s  %s\n", "NAME", "LAYERS", "KV_HEADS", "Q_HEADS", "HEAD_DIM",
           "DTYPE", "REVISION");
    for (size_t i = 0; i < n; i++)
        printf("%-32s %6u %8u %7u %8u %5s  %s\n", list[i].name, list[i].num_layers,
               list[i].num_kv_heads, list[i].num_q_heads, list[i].head_dim,
               kvdepot_dtype_name(list[i].dtype), list[i].revision);
    kvdepot_free(list);
    return 0;
}

static int cmd_model(kvdepot_client *c, int argc, char **argv)
{
    if (argc < 1)
        usage_error("model: expected put, get or rm");
    const char *sub = argv[0];
    argc--, argv++;
    if (strcmp(sub, "put") == 0) {
        opt opts[] = {{"layers", 1, 0},   {"kv-heads", 1, 0}, {"q-heads", 1, 0},
                      {"head-dim", 1, 0}, {"dtype", 1, 0},    {"revision", 1, 0},
                      {"hidden", 1, 0},   {"replace", 0, 0},  {0, 0, 0}};
        const char *pos[1];
        if (parse_args(argc, argv, opts, pos, 1) != 1)
            usage_error("model put: expected NAME");
        kvdepot_model m;
        memset(&m, 0, sizeof m);
        if (strlen(pos[0]) > KVDEPOT_NAME_MAX)
            usage_error("model name longer than %d bytes", KVDEPOT_NAME_MAX);
        snprintf(m.name, sizeof m.name, "%s", pos[0]);
        const char *rev = opt_get(opts, "revision");
        if (rev && strlen(rev) > KVDEPOT_NAME_MAX)
            usage_error("revision longer than %d bytes", KVDEPOT_NAME_MAX);
        snprintf(m.revision, sizeof m.revision, "%s", rev ? rev : "");
        m.num_layers = (uint32_t)parse_u64("--layers", opt_required(opts, "layers"), UINT32_MAX);
        m.num_kv_heads =
            (uint32_t)parse_u64("--kv-heads", opt_required(opts, "kv-heads"), UINT32_MAX);
        m.head_dim = (uint32_t)parse_u64("--head-dim", opt_required(opts, "head-dim"), UINT32_MAX);
        m.num_q_heads = (uint32_t)opt_u64(opts, "q-heads", 0, UINT32_MAX);
        m.hidden_size = (uint32_t)opt_u64(opts, "hidden", 0, UINT32_MAX);
        if (kvdepot_dtype_parse(opt_required(opts, "dtype"), &m.dtype) != KVDEPOT_OK)
            usage_error("%s", kvdepot_errmsg(NULL));
        kvdepot_model out;
        int created;
        int rc = kvdepot_model_put(c, &m, opt_get(opts, "replace") != NULL, &out, &created);
        if (rc)
            return fail(c, rc);
        if (json_out) {
            json_object *o = model_json(&out);
            jset(o, "created", json_object_new_boolean(created));
            return jprint(o);
        }
        printf("model %s %s\n", out.name, created ? "created" : "already registered, unchanged");
        return 0;
    }
    if (strcmp(sub, "get") == 0) {
        const char *pos[1];
        if (parse_args(argc, argv, NULL, pos, 1) != 1)
            usage_error("model get: expected NAME");
        kvdepot_model m;
        int rc = kvdepot_model_get(c, pos[0], &m);
        if (rc)
            return fail(c, rc);
        if (json_out)
            return jprint(model_json(&m));
        print_model(&m);
        return 0;
    }
    if (strcmp(sub, "rm") == 0) {
        opt opts[] = {{"force", 0, 0}, {0, 0, 0}};
        const char *pos[1];
        if (parse_args(argc, argv, opts, pos, 1) != 1)
            usage_error("model rm: expected NAME");
        uint64_t deleted;
        int rc = kvdepot_model_delete(c, pos[0], opt_get(opts, "force") != NULL, &deleted);
        if (rc)
            return fail(c, rc);
        if (json_out) {
            json_object *o = jobj();
            jstr(o, "model", pos[0]);
            ju64(o, "sequences_deleted", deleted);
            return jprint(o);
        }
        printf("model %s deleted (%" PRIu64 " sequences with it)\n", pos[0], deleted);
        return 0;
    }
    usage_error("model: unknown subcommand \"%s\" (expected put, get or rm)", sub);
}

static int cmd_seqs(kvdepot_client *c, int argc, char **argv)
{
    opt opts[] = {{"model", 1, 0}, {0, 0, 0}};
    parse_args(argc, argv, opts, NULL, 0);
    kvdepot_sequence_info *list;
    size_t n;
    int rc = kvdepot_sequence_list(c, opt_get(opts, "model"), &list, &n);
    if (rc)
        return fail(c, rc);
    if (json_out) {
        json_object *a = jarr();
        for (size_t i = 0; i < n; i++) {
            json_object *o = jobj();
            jset(o, "id", jid(list[i].id, list[i].id_len));
            jstr(o, "model", list[i].model);
            ju64(o, "tokens", list[i].num_tokens);
            ju64(o, "sealed_pages", list[i].sealed_pages);
            ju64(o, "stored_bytes", list[i].stored_bytes);
            json_object_array_add(a, o);
        }
        kvdepot_sequence_list_free(list, n);
        return jprint(a);
    }
    printf("%-40s %-24s %10s %8s %12s\n", "ID", "MODEL", "TOKENS", "SEALED", "BYTES");
    for (size_t i = 0; i < n; i++) {
        char id[64];
        FILE *f = fmemopen(id, sizeof id, "w");
        if (f) {
            print_id(f, list[i].id, list[i].id_len);
            fclose(f);
        } else {
            id[0] = '\0';
        }
        printf("%-40s %-24s %10" PRIu64 " %8" PRIu64 " %12" PRIu64 "\n", id, list[i].model,
               list[i].num_tokens, list[i].sealed_pages, list[i].stored_bytes);
    }
    kvdepot_sequence_list_free(list, n);
    return 0;
}

/* One side of a sequence's codecs: "int4 g32 token", "vq d4b8", "raw + svd
 * widths 8..16 (64)". */
static void print_side(const char *name, const kvdepot_codec_spec *c)
{
    static const char *codec[] = {"raw", "int2", "int4", "vq"};
    static const char *axis[] = {"default", "token", "channel"};
    printf("%s %s", name, (unsigned)c->codec < 4 ? codec[c->codec] : "?");
    if (c->codec == KVDEPOT_CODEC_INT2 || c->codec == KVDEPOT_CODEC_INT4) {
        printf(" g%u %s", c->group_size, (unsigned)c->axis < 3 ? axis[c->axis] : "?");
        if (c->stochastic)
            printf(" stochastic seed %" PRIu64, c->seed);
    }
    if (c->codec == KVDEPOT_CODEC_VQ)
        printf(" d%ub%u", c->vq_sub_dim, c->vq_bits);
    if (c->svd_num_widths) {
        uint32_t lo = UINT32_MAX, hi = 0;
        for (size_t i = 0; i < c->svd_num_widths; i++) {
            lo = c->svd_widths[i] < lo ? c->svd_widths[i] : lo;
            hi = c->svd_widths[i] > hi ? c->svd_widths[i] : hi;
        }
        printf(" + svd widths %u..%u (%zu layer x head)", lo, hi, c->svd_num_widths);
    }
}

static json_object *side_json(const kvdepot_codec_spec *c)
{
    static const char *codec[] = {"raw", "int2", "int4", "vq"};
    static const char *axis[] = {"default", "token", "channel"};
    json_object *o = jobj();
    jstr(o, "codec", (unsigned)c->codec < 4 ? codec[c->codec] : "?");
    if (c->codec == KVDEPOT_CODEC_INT2 || c->codec == KVDEPOT_CODEC_INT4) {
        ju64(o, "group_size", c->group_size);
        jstr(o, "axis", (unsigned)c->axis < 3 ? axis[c->axis] : "?");
        jset(o, "stochastic", json_object_new_boolean(c->stochastic));
        if (c->stochastic)
            ju64(o, "seed", c->seed);
    }
    if (c->codec == KVDEPOT_CODEC_VQ) {
        ju64(o, "vq_sub_dim", c->vq_sub_dim);
        ju64(o, "vq_bits", c->vq_bits);
    }
    if (c->svd_num_widths) {
        json_object *w = jarr();
        for (size_t i = 0; i < c->svd_num_widths; i++)
            json_object_array_add(w, json_object_new_uint64(c->svd_widths[i]));
        jset(o, "svd_widths", w);
    }
    return o;
}

static json_object *info_json(const kvdepot_sequence_info *s)
{
    json_object *o = jobj();
    jset(o, "id", jid(s->id, s->id_len));
    jstr(o, "model", s->model);
    ju64(o, "num_tokens", s->num_tokens);
    json_object *lt = jarr();
    for (size_t i = 0; i < s->num_layers; i++)
        json_object_array_add(lt, json_object_new_uint64(s->layer_tokens[i]));
    jset(o, "layer_tokens", lt);
    ju64(o, "page_tokens", s->page_tokens);
    ju64(o, "sealed_pages", s->sealed_pages);
    ju64(o, "stored_bytes", s->stored_bytes);
    ju64(o, "prefix_blocks", s->prefix_blocks);
    ju64(o, "activation_tokens", s->activation_tokens);
    if (s->have_codecs) {
        json_object *cc = jobj();
        jset(cc, "k", side_json(&s->codecs.k));
        jset(cc, "v", side_json(&s->codecs.v));
        if (s->codecs.pq_m) {
            json_object *pq = jobj();
            ju64(pq, "m", s->codecs.pq_m);
            ju64(pq, "bits", s->codecs.pq_bits);
            ju64(pq, "iterations", s->codecs.pq_iterations);
            ju64(pq, "min_train_tokens", s->codecs.pq_min_train_tokens);
            jset(cc, "pq", pq);
        }
        ju64(cc, "raw_sink_tokens", s->codecs.raw_sink_tokens);
        jset(cc, "store_activations", json_object_new_boolean(s->codecs.store_activations));
        if (s->artifacts_fingerprint)
            jset(cc, "artifacts_fingerprint", jhex(s->artifacts_fingerprint));
        jset(o, "codecs", cc);
    }
    if (s->recovery_loss) {
        json_object *r = jobj();
        ju64(r, "acknowledged_tokens", s->loss_acknowledged_tokens);
        ju64(r, "recovered_tokens", s->loss_recovered_tokens);
        ju64(r, "unix_ms", s->loss_unix_ms);
        jset(o, "recovery_loss", r);
    }
    json_object *bh = jarr();
    for (size_t i = 0; i < s->num_block_hashes; i++)
        json_object_array_add(bh, jhex(s->block_hashes[i]));
    jset(o, "block_hashes", bh);
    ju64(o, "created_ms", s->created_unix_ms);
    return o;
}

static void print_info(const kvdepot_sequence_info *s)
{
    printf("id:            ");
    print_id(stdout, s->id, s->id_len);
    printf("\nmodel:         %s\n", s->model);
    printf("num_tokens:    %" PRIu64 "\n", s->num_tokens);
    printf("layer_tokens: ");
    /* Runs of equal counts print once, so a 32-layer model stays one line. */
    for (size_t i = 0; i < s->num_layers;) {
        size_t j = i;
        while (j + 1 < s->num_layers && s->layer_tokens[j + 1] == s->layer_tokens[i])
            j++;
        if (j == i)
            printf(" [%zu]=%" PRIu64, i, s->layer_tokens[i]);
        else
            printf(" [%zu-%zu]=%" PRIu64, i, j, s->layer_tokens[i]);
        i = j + 1;
    }
    printf("\npage_tokens:   %u\n", s->page_tokens);
    printf("sealed_pages:  %" PRIu64 "\n", s->sealed_pages);
    printf("stored_bytes:  %" PRIu64 "\n", s->stored_bytes);
    printf("prefix_blocks: %" PRIu64 "\n", s->prefix_blocks);
    if (s->activation_tokens)
        printf("activation_tokens: %" PRIu64 "\n", s->activation_tokens);
    if (s->have_codecs) {
        printf("codecs:        ");
        print_side("k", &s->codecs.k);
        print_side(", v", &s->codecs.v);
        if (s->codecs.pq_m)
            printf("; pq m%u b%u iterations %u trained at %u tokens", s->codecs.pq_m,
                   s->codecs.pq_bits, s->codecs.pq_iterations, s->codecs.pq_min_train_tokens);
        if (s->codecs.raw_sink_tokens)
            printf("; raw sink tokens %u", s->codecs.raw_sink_tokens);
        if (s->codecs.store_activations)
            printf("; activations stored");
        if (s->artifacts_fingerprint)
            printf("; artifacts %016" PRIx64, s->artifacts_fingerprint);
        printf("\n");
    }
    if (s->recovery_loss)
        printf("recovery_loss: acknowledged %" PRIu64 " tokens, %" PRIu64
               " came back (point-in-time WAL recovery, unix ms %" PRIu64 ")\n",
               s->loss_acknowledged_tokens, s->loss_recovered_tokens, s->loss_unix_ms);
    printf("block_hashes: ");
    for (size_t i = 0; i < s->num_block_hashes; i++)
        printf(" %016" PRIx64, s->block_hashes[i]);
    printf("\ncreated_ms:    %" PRIu64 "\n", s->created_unix_ms);
}

static int cmd_seq(kvdepot_client *c, int argc, char **argv)
{
    if (argc < 1)
        usage_error("seq: expected stat, rm, evict or pq-rebuild");
    const char *sub = argv[0];
    const char *pos[1];
    opt rebuild_opts[] = {{"layer-start", 1, 0}, {"layers", 1, 0}, {0, 0, 0}};
    const int rebuild = strcmp(sub, "pq-rebuild") == 0;
    if (parse_args(argc - 1, argv + 1, rebuild ? rebuild_opts : NULL, pos, 1) != 1)
        usage_error("seq %s: expected ID", sub);
    if (rebuild) {
        const char *ls = opt_get(rebuild_opts, "layer-start"),
                   *nl = opt_get(rebuild_opts, "layers");
        uint32_t layers = 0;
        uint64_t tokens = 0;
        int rc = kvdepot_pq_rebuild(c, pos[0], strlen(pos[0]),
                                    ls ? (uint32_t)parse_u64("--layer-start", ls, UINT32_MAX) : 0,
                                    nl ? (uint32_t)parse_u64("--layers", nl, UINT32_MAX) : 0,
                                    &layers, &tokens, NULL);
        if (rc)
            return fail(c, rc);
        if (json_out) {
            json_object *o = jobj();
            jstr(o, "id", pos[0]);
            ju64(o, "layers", layers);
            ju64(o, "tokens_coded", tokens);
            return jprint(o);
        }
        printf("sequence %s: PQ index rebuilt (layers %u, tokens coded %" PRIu64 ")\n", pos[0],
               layers, tokens);
        return 0;
    }
    if (strcmp(sub, "stat") == 0) {
        kvdepot_sequence_info s;
        int rc = kvdepot_sequence_stat(c, pos[0], strlen(pos[0]), &s);
        if (rc)
            return fail(c, rc);
        if (json_out)
            jprint(info_json(&s));
        else
            print_info(&s);
        kvdepot_sequence_info_clear(&s);
        return 0;
    }
    if (strcmp(sub, "rm") == 0) {
        uint64_t freed;
        int rc = kvdepot_sequence_delete(c, pos[0], strlen(pos[0]), &freed);
        if (rc)
            return fail(c, rc);
        if (json_out) {
            json_object *o = jobj();
            jstr(o, "id", pos[0]);
            ju64(o, "pages_freed", freed);
            return jprint(o);
        }
        printf("sequence %s deleted (%" PRIu64 " pages freed)\n", pos[0], freed);
        return 0;
    }
    if (strcmp(sub, "evict") == 0) {
        uint64_t pages, bytes;
        int rc = kvdepot_sequence_evict(c, pos[0], strlen(pos[0]), &pages, &bytes);
        if (rc)
            return fail(c, rc);
        if (json_out) {
            json_object *o = jobj();
            jstr(o, "id", pos[0]);
            ju64(o, "pages", pages);
            ju64(o, "bytes", bytes);
            return jprint(o);
        }
        printf("sequence %s evicted from memory (%" PRIu64 " pages, %" PRIu64 " bytes)\n", pos[0],
               pages, bytes);
        return 0;
    }
    usage_error("seq: unknown subcommand \"%s\" (expected stat, rm, evict or pq-rebuild)", sub);
}

static int cmd_backup(kvdepot_client *c, int argc, char **argv)
{
    const char *pos[1];
    if (parse_args(argc, argv, NULL, pos, 1) != 1)
        usage_error("backup: expected one directory (absolute, on the server's host)");
    kvdepot_backup_info b;
    int rc = kvdepot_backup(c, pos[0], &b);
    if (rc)
        return fail(c, rc);
    if (json_out) {
        json_object *o = jobj();
        jstr(o, "dir", pos[0]);
        ju64(o, "files", b.files);
        ju64(o, "bytes", b.bytes);
        ju64(o, "duration_ms", b.duration_ms);
        return jprint(o);
    }
    printf("backup in %s: %" PRIu64 " files, %" PRIu64 " bytes, %" PRIu64 " ms\n", pos[0], b.files,
           b.bytes, b.duration_ms);
    return 0;
}

static int cmd_stats(kvdepot_client *c, int argc, char **argv)
{
    if (parse_args(argc, argv, NULL, NULL, 0) != 0)
        usage_error("stats: no arguments expected");
    kvdepot_stats s;
    int rc = kvdepot_stats_get(c, &s);
    if (rc)
        return fail(c, rc);
    if (json_out) {
        json_object *o = jobj();
        jstr(o, "durability", s.durability);
        ju64(o, "sequences", s.sequences);
        jstr(o, "backend", s.backend);
        ju64(o, "backend_threads", s.backend_threads);
        if (s.device[0]) {
            json_object *d = jobj();
            jstr(d, "name", s.device);
            ju64(d, "memory_bytes", s.device_memory_bytes);
            jset(d, "healthy", json_object_new_boolean(s.device_healthy));
            ju64(d, "pages_attended", s.device_pages_attended);
            jset(o, "device", d);
        }
        json_object *t = jarr();
        for (size_t i = 0; i < s.num_tiers; i++) {
            json_object *x = jobj();
            jstr(x, "name", s.tiers[i].name);
            ju64(x, "limit_bytes", s.tiers[i].limit_bytes);
            ju64(x, "bytes", s.tiers[i].bytes);
            ju64(x, "pages", s.tiers[i].pages);
            ju64(x, "hits", s.tiers[i].hits);
            ju64(x, "evictions", s.tiers[i].evictions);
            json_object_array_add(t, x);
        }
        jset(o, "tiers", t);
        ju64(o, "misses", s.misses);
        ju64(o, "promotions", s.promotions);
        ju64(o, "prefetched", s.prefetched);
        ju64(o, "checksum_failures", s.checksum_failures);
        ju64(o, "sequences_dropped", s.sequences_dropped);
        ju64(o, "sequences_expired", s.sequences_expired);
        json_object *m = jobj();
        ju64(m, "rss", s.mem_rss_bytes);
        ju64(m, "appends", s.mem_appends_bytes);
        ju64(m, "memtables", s.mem_memtables_bytes);
        ju64(m, "block_cache", s.mem_block_cache_bytes);
        jset(o, "memory_bytes", m);
        return jprint(o);
    }
    printf("durability  %s\nsequences   %" PRIu64 "\nbackend     %s (%u CPU threads)\n",
           s.durability, s.sequences, s.backend, s.backend_threads);
    if (s.device[0])
        printf("device      %s, %" PRIu64 " bytes%s, %" PRIu64 " pages attended on it\n", s.device,
               s.device_memory_bytes, s.device_healthy ? "" : ", UNHEALTHY",
               s.device_pages_attended);
    printf("\n");
    printf("%-8s %16s %16s %10s %12s %12s\n", "tier", "limit_bytes", "bytes", "pages", "hits",
           "evictions");
    for (size_t i = 0; i < s.num_tiers; i++)
        printf("%-8s %16" PRIu64 " %16" PRIu64 " %10" PRIu64 " %12" PRIu64 " %12" PRIu64 "\n",
               s.tiers[i].name, s.tiers[i].limit_bytes, s.tiers[i].bytes, s.tiers[i].pages,
               s.tiers[i].hits, s.tiers[i].evictions);
    printf("\nmisses             %" PRIu64 "\npromotions         %" PRIu64
           "\nprefetched         %" PRIu64 "\nchecksum_failures  %" PRIu64
           "\nsequences_dropped  %" PRIu64 "\nsequences_expired  %" PRIu64 "\n",
           s.misses, s.promotions, s.prefetched, s.checksum_failures, s.sequences_dropped,
           s.sequences_expired);
    if (s.mem_rss_bytes)
        printf("\nmemory: rss %" PRIu64 ", appends in flight %" PRIu64 ", memtables %" PRIu64
               ", block cache %" PRIu64 " bytes\n",
               s.mem_rss_bytes, s.mem_appends_bytes, s.mem_memtables_bytes,
               s.mem_block_cache_bytes);
    return 0;
}

/* ------------------------------------------------------------------------ */
/* Codec specs on the command line                                           */
/* ------------------------------------------------------------------------ */

/* Room for explicit SVD widths of --k and --v. */
#define CLI_MAX_WIDTHS 1024

/*
 * "raw|int2|int4|vq-dDbB" followed by comma-separated options: gG (group
 * size), token|channel (axis), stochastic, seed=N, svd=RATE,
 * widths=W[:W...] (one, or one per kv head), align=N. Usage error on
 * anything else; the server checks the values against the model.
 */
static void parse_codec(const char *flag, const char *arg, kvdepot_codec_spec *out,
                        uint32_t *widths)
{
    char buf[512];
    if (strlen(arg) >= sizeof buf)
        usage_error("%s: too long", flag);
    strcpy(buf, arg);
    memset(out, 0, sizeof *out);
    char *save = NULL;
    char *tok = strtok_r(buf, ",", &save);
    if (!tok)
        usage_error("%s: expected raw, int2, int4 or vq-dDbB", flag);
    unsigned d, b;
    char tail;
    if (strcmp(tok, "raw") == 0)
        out->codec = KVDEPOT_CODEC_RAW;
    else if (strcmp(tok, "int2") == 0)
        out->codec = KVDEPOT_CODEC_INT2;
    else if (strcmp(tok, "int4") == 0)
        out->codec = KVDEPOT_CODEC_INT4;
    else if (sscanf(tok, "vq-d%ub%u%c", &d, &b, &tail) == 2) {
        out->codec = KVDEPOT_CODEC_VQ;
        out->vq_sub_dim = d;
        out->vq_bits = b;
    } else
        usage_error("%s: unknown codec \"%s\" (raw, int2, int4, vq-dDbB)", flag, tok);
    while ((tok = strtok_r(NULL, ",", &save))) {
        char what[64];
        snprintf(what, sizeof what, "%s %s", flag, tok);
        if (tok[0] == 'g' && isdigit((unsigned char)tok[1]))
            out->group_size = (uint32_t)parse_u64(what, tok + 1, UINT32_MAX);
        else if (strcmp(tok, "token") == 0)
            out->axis = KVDEPOT_AXIS_TOKEN;
        else if (strcmp(tok, "channel") == 0)
            out->axis = KVDEPOT_AXIS_CHANNEL;
        else if (strcmp(tok, "stochastic") == 0)
            out->stochastic = 1;
        else if (strncmp(tok, "seed=", 5) == 0)
            out->seed = parse_u64(what, tok + 5, UINT64_MAX);
        else if (strncmp(tok, "align=", 6) == 0)
            out->svd_align = (uint32_t)parse_u64(what, tok + 6, UINT32_MAX);
        else if (strncmp(tok, "svd=", 4) == 0) {
            char *end;
            errno = 0;
            out->svd_removal_rate = strtod(tok + 4, &end);
            if (errno || end == tok + 4 || *end || !(out->svd_removal_rate > 0) ||
                !(out->svd_removal_rate < 1))
                usage_error("%s: expected a removal rate in (0, 1)", what);
        } else if (strncmp(tok, "widths=", 7) == 0) {
            char *save2 = NULL;
            size_t n = 0;
            for (char *w = strtok_r(tok + 7, ":", &save2); w; w = strtok_r(NULL, ":", &save2)) {
                if (n == CLI_MAX_WIDTHS)
                    usage_error("%s: more than %d widths", flag, CLI_MAX_WIDTHS);
                widths[n++] = (uint32_t)parse_u64(what, w, UINT32_MAX);
            }
            if (!n)
                usage_error("%s: widths= needs at least one width", flag);
            out->svd_widths = widths;
            out->svd_num_widths = n;
        } else
            usage_error("%s: unknown option \"%s\"", flag, tok);
    }
}

/* --pq mMbB[iN][tT]: m sub-spaces, 2^b centroids, N K-means iterations,
 * trained once a layer holds T tokens. */
static void parse_pq(const char *arg, kvdepot_codecs *cc)
{
    unsigned m, b, it = 0, t = 0;
    int used = 0, more = 0;
    if (sscanf(arg, "m%ub%u%n", &m, &b, &used) != 2)
        usage_error("--pq %s: expected mMbB[iN][tT], e.g. m16b8 or m16b8i10t2048", arg);
    const char *p = arg + used;
    if (*p == 'i' && sscanf(p, "i%u%n", &it, &more) == 1)
        p += more;
    if (*p == 't' && sscanf(p, "t%u%n", &t, &more) == 1)
        p += more;
    if (*p)
        usage_error("--pq %s: expected mMbB[iN][tT], e.g. m16b8 or m16b8i10t2048", arg);
    cc->pq_m = m;
    cc->pq_bits = b;
    cc->pq_iterations = it;
    cc->pq_min_train_tokens = t;
}

static int cmd_put(kvdepot_client *c, int argc, char **argv)
{
    opt opts[] = {{"model", 1, 0},  {"tokens", 1, 0},      {"layer-start", 1, 0},
                  {"layers", 1, 0}, {"file", 1, 0},        {"token-ids", 1, 0},
                  {"ttl", 1, 0},    {"activations", 0, 0}, {"k", 1, 0},
                  {"v", 1, 0},      {"pq", 1, 0},          {"raw-sink", 1, 0},
                  {0, 0, 0}};
    const char *pos[1];
    if (parse_args(argc, argv, opts, pos, 1) != 1)
        usage_error("put: expected ID");
    /* Codecs of a sequence created here (checked before anything is read). */
    static uint32_t kw[CLI_MAX_WIDTHS], vw[CLI_MAX_WIDTHS];
    kvdepot_codecs cc;
    memset(&cc, 0, sizeof cc);
    if (opt_get(opts, "k"))
        parse_codec("--k", opt_get(opts, "k"), &cc.k, kw);
    if (opt_get(opts, "v"))
        parse_codec("--v", opt_get(opts, "v"), &cc.v, vw);
    if (opt_get(opts, "pq"))
        parse_pq(opt_get(opts, "pq"), &cc);
    cc.raw_sink_tokens = (uint32_t)opt_u64(opts, "raw-sink", 0, UINT32_MAX);
    const int want_codecs = opt_get(opts, "k") || opt_get(opts, "v") || opt_get(opts, "pq") ||
                            opt_get(opts, "raw-sink");
    const int with_x = opt_get(opts, "activations") != NULL;
    const char *id = pos[0];
    const char *model_name = opt_required(opts, "model");
    const char *path = opt_required(opts, "file");
    uint64_t tokens = parse_u64("--tokens", opt_required(opts, "tokens"), UINT64_MAX);
    uint32_t layer_start = (uint32_t)opt_u64(opts, "layer-start", 0, UINT32_MAX);

    kvdepot_model m;
    int rc = kvdepot_model_get(c, model_name, &m);
    if (rc)
        return fail(c, rc);
    if (layer_start >= m.num_layers)
        usage_error("--layer-start %u: model %s has %u layers", layer_start, m.name, m.num_layers);
    uint32_t layers = (uint32_t)opt_u64(opts, "layers", m.num_layers - layer_start, UINT32_MAX);
    size_t kv = kvdepot_kv_bytes(&m, layers, tokens);
    if (with_x && !m.hidden_size)
        return fail_msg("--activations: model %s has no hidden size", m.name);
    size_t xb = with_x ? (size_t)layers * tokens * m.hidden_size * kvdepot_dtype_size(m.dtype) : 0;

    int fd = open(path, O_RDONLY);
    if (fd < 0)
        return fail_msg("%s: %s", path, strerror(errno));
    struct stat sb;
    if (fstat(fd, &sb) != 0) {
        close(fd);
        return fail_msg("%s: %s", path, strerror(errno));
    }
    if ((uint64_t)sb.st_size != 2 * (uint64_t)kv + xb) {
        close(fd);
        return fail_msg("%s has %lld bytes; K then V for %u layers x %" PRIu64
                        " tokens x %u kv heads x %u dims of %s is %zu bytes%s",
                        path, (long long)sb.st_size, layers, tokens, m.num_kv_heads, m.head_dim,
                        kvdepot_dtype_name(m.dtype), 2 * kv + xb, with_x ? " (with X)" : "");
    }
    void *data = NULL;
    if (kv) {
        data = mmap(NULL, 2 * kv + xb, PROT_READ, MAP_PRIVATE, fd, 0);
        if (data == MAP_FAILED) {
            close(fd);
            return fail_msg("%s: %s", path, strerror(errno));
        }
    }
    close(fd);

    uint32_t *ids = NULL;
    size_t nids = 0;
    const char *ids_path = opt_get(opts, "token-ids");
    if (ids_path) {
        ids = read_token_ids(ids_path, &nids);
        if (nids != tokens)
            return fail_msg("%s has %zu token ids, expected --tokens %" PRIu64, ids_path, nids,
                            tokens);
    }

    /* The append creates the sequence itself (Append's create), so that it
     * exists only with its data: a failed put leaves nothing behind, and a
     * backup taken meanwhile holds it whole or not at all. The codec flags
     * apply only to a new sequence: with them it is looked up first. An
     * existing sequence is appended to at the end of the first layer of the
     * range (the server checks every layer of it). */
    kvdepot_sequence_info s;
    kvdepot_create_args ca = {.id = id, .id_len = strlen(id), .model = m.name};
    ca.ttl_seconds = opt_u64(opts, "ttl", 0, UINT64_MAX / 1000);
    cc.store_activations = with_x;
    if (with_x || want_codecs)
        ca.codecs = &cc;
    if (want_codecs) {
        rc = kvdepot_sequence_stat(c, id, strlen(id), &s);
        if (rc == KVDEPOT_OK) {
            kvdepot_sequence_info_clear(&s);
            return fail_msg("sequence %s exists: --k, --v, --pq and --raw-sink apply only when "
                            "put creates it",
                            id);
        }
        if (rc != KVDEPOT_ENOTFOUND)
            return fail(c, rc);
    }
    int created = 0;
    kvdepot_append_args a = {
        .id = id,
        .id_len = strlen(id),
        .layer_start = layer_start,
        .num_layers = layers,
        .num_tokens = tokens,
        .dtype = m.dtype,
        .k = data,
        .k_bytes = kv,
        .v = data ? (const uint8_t *)data + kv : NULL,
        .v_bytes = kv,
        .token_ids = ids,
        .num_token_ids = nids,
        .x = with_x && data ? (const uint8_t *)data + 2 * kv : NULL,
        .x_bytes = xb,
        .create = &ca,
        .created = &created,
    };
    char what[96];
    snprintf(what, sizeof what, "put %.80s", id);
    progress pr;
    progress_start(c, &pr, what);
    rc = kvdepot_sequence_append(c, &a, &s);
    char msg[512];
    snprintf(msg, sizeof msg, "%s", rc ? kvdepot_errmsg(c) : "");
    if (rc == KVDEPOT_EPRECOND && !want_codecs) {
        /* It may exist with tokens (the server refused the header before
         * the data went): append at their end. Any other precondition
         * stands as it was answered. */
        uint64_t end = 0;
        if (kvdepot_sequence_stat(c, id, strlen(id), &s) == KVDEPOT_OK) {
            end = layer_start < s.num_layers ? s.layer_tokens[layer_start] : 0;
            kvdepot_sequence_info_clear(&s);
        }
        if (end) {
            a.token_start = end;
            rc = kvdepot_sequence_append(c, &a, &s);
            snprintf(msg, sizeof msg, "%s", rc ? kvdepot_errmsg(c) : "");
        }
    }
    progress_end(c, &pr);
    if (data)
        munmap(data, 2 * kv + xb);
    free(ids);
    if (rc) {
        fprintf(stderr, "kvdepot: %s: %s (nothing was stored)\n", kvdepot_status_name(rc),
                msg[0] ? msg : kvdepot_strerror(rc));
        return 1;
    }
    if (json_out) {
        json_object *o = jobj();
        jstr(o, "id", id);
        jset(o, "created", json_object_new_boolean(created));
        ju64(o, "tokens_appended", tokens);
        ju64(o, "token_start", a.token_start);
        ju64(o, "layer_start", layer_start);
        ju64(o, "layers", layers);
        ju64(o, "bytes", 2 * (uint64_t)kv + xb);
        jset(o, "sequence", info_json(&s));
        kvdepot_sequence_info_clear(&s);
        return jprint(o);
    }
    printf("appended %" PRIu64 " tokens at %" PRIu64 " to layers %u..%u of %s: %" PRIu64
           " tokens readable\n",
           tokens, a.token_start, layer_start, layer_start + layers - 1, id, s.num_tokens);
    kvdepot_sequence_info_clear(&s);
    return 0;
}

static int write_all(int fd, const void *p, size_t n)
{
    const uint8_t *b = p;
    while (n) {
        ssize_t w = write(fd, b, n);
        if (w < 0) {
            if (errno == EINTR)
                continue;
            return -1;
        }
        b += w;
        n -= (size_t)w;
    }
    return 0;
}

static int cmd_get(kvdepot_client *c, int argc, char **argv)
{
    opt opts[] = {
        {"file", 1, 0},   {"layer-start", 1, 0},       {"layers", 1, 0}, {"token-start", 1, 0},
        {"tokens", 1, 0}, {"activation-tokens", 1, 0}, {0, 0, 0}};
    const char *pos[1];
    if (parse_args(argc, argv, opts, pos, 1) != 1)
        usage_error("get: expected ID");
    const char *path = opt_required(opts, "file");
    if (json_out && strcmp(path, "-") == 0)
        usage_error("get: --json with --file -: the data is the output");
    kvdepot_read_args a = {
        .id = pos[0],
        .id_len = strlen(pos[0]),
        .layer_start = (uint32_t)opt_u64(opts, "layer-start", 0, UINT32_MAX),
        .num_layers = (uint32_t)opt_u64(opts, "layers", 0, UINT32_MAX),
        .token_start = opt_u64(opts, "token-start", 0, UINT64_MAX),
        .num_tokens = opt_u64(opts, "tokens", 0, UINT64_MAX),
        .activation_tokens = opt_u64(opts, "activation-tokens", 0, UINT64_MAX),
    };
    kvdepot_read_result r;
    char what[96];
    snprintf(what, sizeof what, "get %.80s", pos[0]);
    progress pr;
    progress_start(c, &pr, what);
    int rc = kvdepot_sequence_read(c, &a, &r);
    progress_end(c, &pr);
    if (rc)
        return fail(c, rc);
    int to_stdout = strcmp(path, "-") == 0;
    int fd = to_stdout ? STDOUT_FILENO : open(path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd < 0) {
        kvdepot_free(r.owned);
        return fail_msg("%s: %s", path, strerror(errno));
    }
    int bad = write_all(fd, r.x, r.x_bytes) != 0 || write_all(fd, r.k, r.kv_bytes) != 0 ||
              write_all(fd, r.v, r.kv_bytes) != 0;
    int err = errno;
    if (!to_stdout && close(fd) != 0 && !bad) {
        bad = 1;
        err = errno;
    }
    kvdepot_free(r.owned);
    if (bad)
        return fail_msg("%s: %s", path, strerror(err));
    if (json_out) {
        json_object *o = jobj();
        jstr(o, "file", path);
        ju64(o, "bytes", r.x_bytes + 2 * (uint64_t)r.kv_bytes);
        ju64(o, "layer_start", r.layer_start);
        ju64(o, "layers", r.num_layers);
        ju64(o, "token_start", r.token_start);
        ju64(o, "tokens", r.num_tokens);
        ju64(o, "kv_heads", r.num_kv_heads);
        ju64(o, "head_dim", r.head_dim);
        jstr(o, "dtype", kvdepot_dtype_name(r.dtype));
        ju64(o, "activation_tokens", r.activation_tokens);
        if (r.activation_tokens)
            ju64(o, "hidden_size", r.hidden_size);
        return jprint(o);
    }
    if (!to_stdout && r.activation_tokens)
        printf("wrote %zu bytes (X of tokens %" PRIu64 "..%" PRIu64 " (hidden %u), then K and "
               "V of the other %" PRIu64 " tokens: layers %u..%u) to %s\n",
               r.x_bytes + 2 * r.kv_bytes, r.token_start, r.token_start + r.activation_tokens - 1,
               r.hidden_size, r.num_tokens - r.activation_tokens, r.layer_start,
               r.layer_start + r.num_layers - 1, path);
    else if (!to_stdout)
        printf("wrote %zu bytes (K then V: layers %u..%u, tokens %" PRIu64 "..%" PRIu64
               ", %u kv heads x %u dims, %s) to %s\n",
               2 * r.kv_bytes, r.layer_start, r.layer_start + r.num_layers - 1, r.token_start,
               r.token_start + r.num_tokens - 1, r.num_kv_heads, r.head_dim,
               kvdepot_dtype_name(r.dtype), path);
    return 0;
}

/* attend ID --layer L --q FILE [--out F] [--token-start T] [--tokens N] [--scale S] */
static int cmd_attend(kvdepot_client *c, int argc, char **argv)
{
    opt opts[] = {{"layer", 1, 0},  {"q", 1, 0},     {"out", 1, 0}, {"token-start", 1, 0},
                  {"tokens", 1, 0}, {"scale", 1, 0}, {0, 0, 0}};
    const char *pos[1];
    if (parse_args(argc, argv, opts, pos, 1) != 1)
        usage_error("attend: expected ID");
    const char *qpath = opt_required(opts, "q");
    FILE *f = fopen(qpath, "rb");
    if (!f)
        return fail_msg("%s: %s", qpath, strerror(errno));
    float *q = NULL;
    size_t n = 0, cap = 0;
    for (;;) {
        if (n == cap) {
            cap = cap ? 2 * cap : 4096;
            float *nq = realloc(q, cap * sizeof *q);
            if (!nq) {
                fclose(f);
                free(q);
                return fail_msg("out of memory");
            }
            q = nq;
        }
        size_t got = fread(q + n, sizeof *q, cap - n, f);
        n += got;
        if (got == 0)
            break;
    }
    fclose(f);
    const char *sc = opt_get(opts, "scale");
    kvdepot_attend_query qy = {pos[0],
                               strlen(pos[0]),
                               q,
                               n,
                               opt_u64(opts, "token-start", 0, UINT64_MAX),
                               opt_u64(opts, "tokens", 0, UINT64_MAX)};
    kvdepot_attend_result r;
    int rc = kvdepot_attend(c, (uint32_t)opt_u64(opts, "layer", 0, UINT32_MAX),
                            sc ? strtof(sc, NULL) : 0.0f, &qy, 1, &r);
    free(q);
    if (rc)
        return fail(c, rc);
    json_object *jo = NULL;
    if (json_out) {
        jo = jobj();
        ju64(jo, "tokens", r.num_tokens);
        json_object *l = jarr();
        for (size_t h = 0; h < r.num_q_heads; h++)
            json_object_array_add(l, jdouble(r.lse[h]));
        jset(jo, "lse", l);
    } else {
        printf("attended %" PRIu64 " tokens; lse per query head:", r.num_tokens);
        for (size_t h = 0; h < r.num_q_heads; h++)
            printf(" %.6g", r.lse[h]);
        printf("\n");
    }
    const char *out = opt_get(opts, "out");
    if (out) {
        FILE *o = fopen(out, "wb");
        size_t cnt = r.num_q_heads * r.head_dim;
        int bad = !o || fwrite(r.output, sizeof(float), cnt, o) != cnt;
        if (o && fclose(o) != 0)
            bad = 1;
        if (bad) {
            kvdepot_attend_results_free(&r, 1);
            json_object_put(jo);
            return fail_msg("%s: %s", out, strerror(errno));
        }
        if (jo) {
            jstr(jo, "out", out);
            ju64(jo, "q_heads", r.num_q_heads);
            ju64(jo, "head_dim", r.head_dim);
        } else {
            printf("wrote the output (%zu x %zu f32) to %s\n", r.num_q_heads, r.head_dim, out);
        }
    }
    kvdepot_attend_results_free(&r, 1);
    return jo ? jprint(jo) : 0;
}

/* A file of little-endian f32 values; *n floats. NULL (message printed) on failure. */
static float *read_f32_file(const char *path, size_t *n)
{
    FILE *f = fopen(path, "rb");
    if (!f) {
        fail_msg("%s: %s", path, strerror(errno));
        return NULL;
    }
    float *q = NULL;
    size_t cap = 0;
    *n = 0;
    for (;;) {
        if (*n == cap) {
            cap = cap ? 2 * cap : 4096;
            float *nq = realloc(q, cap * sizeof *q);
            if (!nq) {
                fclose(f);
                free(q);
                fail_msg("out of memory");
                return NULL;
            }
            q = nq;
        }
        size_t got = fread(q + *n, sizeof *q, cap - *n, f);
        *n += got;
        if (got == 0)
            break;
    }
    fclose(f);
    return q;
}

/* search ID --layer L --q FILE --k K [--initial N] [--recent N] [--sparse] */
static int cmd_search(kvdepot_client *c, int argc, char **argv)
{
    opt opts[] = {{"layer", 1, 0},  {"q", 1, 0},      {"k", 1, 0}, {"initial", 1, 0},
                  {"recent", 1, 0}, {"sparse", 0, 0}, {0, 0, 0}};
    const char *pos[1];
    if (parse_args(argc, argv, opts, pos, 1) != 1)
        usage_error("search: expected ID");
    size_t n;
    float *q = read_f32_file(opt_required(opts, "q"), &n);
    if (!q)
        return 1;
    kvdepot_search_args a = {pos[0],
                             strlen(pos[0]),
                             (uint32_t)opt_u64(opts, "layer", 0, UINT32_MAX),
                             q,
                             n,
                             (uint32_t)opt_u64(opts, "k", 0, UINT32_MAX),
                             (uint32_t)opt_u64(opts, "initial", 0, UINT32_MAX),
                             (uint32_t)opt_u64(opts, "recent", 0, UINT32_MAX),
                             0,
                             0};
    kvdepot_search_result r;
    kvdepot_attend_result ar;
    int sparse = opt_get(opts, "sparse") != NULL;
    int rc = sparse ? kvdepot_sparse_attend(c, &a, 0, &ar, &r) : kvdepot_search(c, &a, &r);
    free(q);
    if (rc)
        return fail(c, rc);
    if (json_out) {
        json_object *o = jobj(), *heads = jarr();
        for (size_t h = 0; h < r.num_heads; h++) {
            json_object *x = jobj(), *t = jarr(), *sc = jarr();
            ju64(x, "kv_head", r.heads[h].kv_head);
            for (size_t i = 0; i < r.heads[h].count; i++) {
                json_object_array_add(t, json_object_new_uint64(r.heads[h].tokens[i]));
                json_object_array_add(sc, jdouble(r.heads[h].scores[i]));
            }
            jset(x, "tokens", t);
            jset(x, "scores", sc);
            json_object_array_add(heads, x);
        }
        jset(o, "heads", heads);
        if (sparse) {
            json_object *l = jarr();
            for (size_t h = 0; h < ar.num_q_heads; h++)
                json_object_array_add(l, jdouble(ar.lse[h]));
            ju64(o, "attended_tokens", ar.num_tokens);
            jset(o, "lse", l);
            kvdepot_attend_results_free(&ar, 1);
        }
        kvdepot_search_result_free(&r);
        return jprint(o);
    }
    for (size_t h = 0; h < r.num_heads; h++) {
        printf("kv head %u:", r.heads[h].kv_head);
        for (size_t i = 0; i < r.heads[h].count; i++)
            printf(" %" PRIu64 ":%.4g", r.heads[h].tokens[i], r.heads[h].scores[i]);
        printf("\n");
    }
    if (sparse) {
        printf("attended %" PRIu64 " tokens per head; lse per query head:", ar.num_tokens);
        for (size_t h = 0; h < ar.num_q_heads; h++)
            printf(" %.6g", ar.lse[h]);
        printf("\n");
        kvdepot_attend_results_free(&ar, 1);
    }
    kvdepot_search_result_free(&r);
    return 0;
}

/* plan ID --bandwidth B --flops F [--activations] */
static int cmd_plan(kvdepot_client *c, int argc, char **argv)
{
    opt opts[] = {{"bandwidth", 1, 0}, {"flops", 1, 0}, {"activations", 0, 0}, {0, 0, 0}};
    const char *pos[1];
    if (parse_args(argc, argv, opts, pos, 1) != 1)
        usage_error("plan: expected ID");
    kvdepot_fetch_plan p;
    int rc = kvdepot_plan_fetch(c, pos[0], strlen(pos[0]),
                                parse_rate("--bandwidth", opt_required(opts, "bandwidth")),
                                parse_rate("--flops", opt_required(opts, "flops")), 0, 0,
                                opt_get(opts, "activations") != NULL, &p);
    if (rc)
        return fail(c, rc);
    if (json_out) {
        json_object *o = jobj();
        ju64(o, "split_tokens", p.split_tokens);
        ju64(o, "num_tokens", p.num_tokens);
        jdbl(o, "predicted_seconds", p.predicted_seconds);
        jdbl(o, "kv_only_seconds", p.kv_only_seconds);
        ju64(o, "activation_bytes", p.activation_bytes);
        ju64(o, "kv_bytes", p.kv_bytes);
        jdbl(o, "recompute_seconds", p.recompute_seconds);
        return jprint(o);
    }
    printf("split %" PRIu64 " of %" PRIu64 " tokens: %.6g s (plain fetch %.6g s); "
           "activations %" PRIu64 " bytes, K/V %" PRIu64 " bytes, recompute %.6g s\n",
           p.split_tokens, p.num_tokens, p.predicted_seconds, p.kv_only_seconds, p.activation_bytes,
           p.kv_bytes, p.recompute_seconds);
    return 0;
}

static int cmd_lookup(kvdepot_client *c, int argc, char **argv)
{
    opt opts[] = {{"model", 1, 0}, {0, 0, 0}};
    const char **pos = calloc((size_t)argc + 1, sizeof *pos);
    uint64_t *hashes = calloc((size_t)argc + 1, sizeof *hashes);
    if (!pos || !hashes)
        return fail_msg("out of memory");
    int n = parse_args(argc, argv, opts, pos, argc);
    const char *model = opt_required(opts, "model");
    for (int i = 0; i < n; i++) {
        const char *h = pos[i];
        if (h[0] == '0' && (h[1] == 'x' || h[1] == 'X'))
            h += 2;
        char *end;
        errno = 0;
        hashes[i] = strtoull(h, &end, 16);
        if (!*h || *end || errno || strlen(h) > 16)
            usage_error("bad hash \"%s\" (want up to 16 hex digits)", pos[i]);
    }
    uint64_t blocks, tokens;
    int rc = kvdepot_prefix_lookup(c, model, hashes, (size_t)n, &blocks, &tokens);
    free(pos);
    free(hashes);
    if (rc)
        return fail(c, rc);
    if (json_out) {
        json_object *o = jobj();
        ju64(o, "matched_blocks", blocks);
        ju64(o, "matched_tokens", tokens);
        return jprint(o);
    }
    printf("matched_blocks: %" PRIu64 "\nmatched_tokens: %" PRIu64 "\n", blocks, tokens);
    return 0;
}

static int cmd_hash(int argc, char **argv)
{
    opt opts[] = {{"token-ids", 1, 0}, {"page-tokens", 1, 0}, {0, 0, 0}};
    parse_args(argc, argv, opts, NULL, 0);
    size_t page = (size_t)opt_u64(opts, "page-tokens", 256, 1u << 24);
    if (!page)
        usage_error("--page-tokens must be positive");
    size_t n;
    uint32_t *ids = read_token_ids(opt_required(opts, "token-ids"), &n);
    size_t blocks = kvdepot_prefix_hash_chain(ids, n, page, NULL);
    uint64_t *h = malloc((blocks ? blocks : 1) * sizeof *h);
    if (!h)
        return fail_msg("out of memory");
    kvdepot_prefix_hash_chain(ids, n, page, h);
    json_object *a = json_out ? jarr() : NULL;
    for (size_t i = 0; i < blocks; i++) {
        if (a)
            json_object_array_add(a, jhex(h[i]));
        else
            printf("%016" PRIx64 "\n", h[i]);
    }
    free(h);
    free(ids);
    return a ? jprint(a) : 0;
}

/* `--name VALUE` or `--name=VALUE` of a global option; 1 when it matched. */
static int tls_flag(const char *a, int argc, char **argv, int *i, const char *name,
                    const char **out)
{
    size_t n = strlen(name);
    if (strncmp(a, name, n) != 0)
        return 0;
    if (a[n] == '=') {
        *out = a + n + 1;
        return 1;
    }
    if (a[n] == '\0' && *i + 1 < argc) {
        *out = argv[++*i];
        return 1;
    }
    return 0;
}

/* The whole of a file (malloc'ed) and its length; NULL with a message on
 * failure. */
static void *read_all(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    if (!f) {
        fail_msg("%s: %s", path, strerror(errno));
        return NULL;
    }
    uint8_t *buf = NULL;
    size_t n = 0, cap = 0;
    for (;;) {
        if (n == cap) {
            cap = cap ? 2 * cap : 65536;
            uint8_t *nb = realloc(buf, cap);
            if (!nb) {
                free(buf);
                fclose(f);
                fail_msg("out of memory");
                return NULL;
            }
            buf = nb;
        }
        size_t got = fread(buf + n, 1, cap - n, f);
        n += got;
        if (got == 0)
            break;
    }
    int bad = ferror(f);
    fclose(f);
    if (bad) {
        free(buf);
        fail_msg("%s: read error", path);
        return NULL;
    }
    *len = n;
    return buf;
}

/* A codec of the advice in the syntax of --k/--v: "int4,g32,token",
 * "vq-d4b8", "raw,svd=0.01". */
static const char *codec_arg(const kvdepot_codec_spec *c, char *buf, size_t cap)
{
    static const char *codec[] = {"raw", "int2", "int4", "vq"};
    if (c->codec == KVDEPOT_CODEC_VQ)
        snprintf(buf, cap, "vq-d%ub%u", c->vq_sub_dim, c->vq_bits);
    else if (c->codec == KVDEPOT_CODEC_INT2 || c->codec == KVDEPOT_CODEC_INT4)
        snprintf(buf, cap, "%s,g%u,%s", codec[c->codec], c->group_size,
                 c->axis == KVDEPOT_AXIS_TOKEN ? "token" : "channel");
    else if (c->svd_removal_rate > 0)
        snprintf(buf, cap, "raw,svd=%g", c->svd_removal_rate);
    else
        snprintf(buf, cap, "%s", (unsigned)c->codec < 4 ? codec[c->codec] : "?");
    return buf;
}

/* The advice as JSON: codecs in the syntax of --k/--v. */
static json_object *advice_json(const kvdepot_codec_advice *a)
{
    char k[64], v[64];
    json_object *o = jobj(), *all = jobj(), *layers = jarr();
    jdbl(o, "error_budget", a->error_budget);
    ju64(o, "eval_queries", a->eval_queries);
    ju64(o, "eval_tokens", a->eval_tokens);
    jstr(all, "k", codec_arg(&a->k, k, sizeof k));
    jstr(all, "v", codec_arg(&a->v, v, sizeof v));
    jdbl(all, "bits_per_value", a->bits_per_value);
    jdbl(all, "max_attention_error", a->max_attention_error);
    jset(o, "every_layer", all);
    for (size_t l = 0; l < a->n_layers; l++) {
        const kvdepot_layer_advice *x = &a->layers[l];
        json_object *lo = jobj();
        ju64(lo, "layer", x->layer);
        jstr(lo, "k", codec_arg(&x->k_recommended, k, sizeof k));
        jstr(lo, "v", codec_arg(&x->v_recommended, v, sizeof v));
        jdbl(lo, "bits_per_value", x->bits_per_value);
        jdbl(lo, "attention_error", x->attention_error);
        if (x->best_bits_per_value > 0) {
            json_object *b = jobj();
            jstr(b, "k", codec_arg(&x->k_best, k, sizeof k));
            jstr(b, "v", codec_arg(&x->v_best, v, sizeof v));
            jdbl(b, "bits_per_value", x->best_bits_per_value);
            jdbl(b, "attention_error", x->best_attention_error);
            jset(lo, "exhaustive", b);
        }
        for (int side = 0; side < 2; side++) {
            json_object *ev = jarr();
            for (size_t i = 0; i < (side ? x->n_v : x->n_k); i++) {
                const kvdepot_codec_eval *e = side ? &x->v[i] : &x->k[i];
                json_object *eo = jobj();
                jstr(eo, "codec", codec_arg(&e->codec, k, sizeof k));
                jdbl(eo, "bits_per_value", e->bits_per_value);
                jdbl(eo, "attention_error", e->attention_error);
                json_object_array_add(ev, eo);
            }
            jset(lo, side ? "v_evaluated" : "k_evaluated", ev);
        }
        json_object_array_add(layers, lo);
    }
    jset(o, "layers", layers);
    return o;
}

static void print_advice(const kvdepot_codec_advice *a)
{
    char k[64], v[64];
    printf("codec advice (error budget %g: ||o - o^||^2 / ||o||^2 of %u held-out queries over "
           "%u held-out tokens a layer):\n",
           a->error_budget, a->eval_queries, a->eval_tokens);
    printf("  every layer: --k %s --v %s  (%.3g bits/value, worst error %.3g)\n",
           codec_arg(&a->k, k, sizeof k), codec_arg(&a->v, v, sizeof v), a->bits_per_value,
           a->max_attention_error);
    for (size_t l = 0; l < a->n_layers; l++) {
        const kvdepot_layer_advice *x = &a->layers[l];
        printf("  layer %u: --k %s --v %s  (%.3g bits/value, error %.3g)", x->layer,
               codec_arg(&x->k_recommended, k, sizeof k), codec_arg(&x->v_recommended, v, sizeof v),
               x->bits_per_value, x->attention_error);
        if (x->best_bits_per_value > 0)
            printf("; exhaustive: --k %s --v %s  (%.3g bits/value, error %.3g)",
                   codec_arg(&x->k_best, k, sizeof k), codec_arg(&x->v_best, v, sizeof v),
                   x->best_bits_per_value, x->best_attention_error);
        printf("\n");
        for (int side = 0; side < 2; side++)
            for (size_t i = 0; i < (side ? x->n_v : x->n_k); i++) {
                const kvdepot_codec_eval *e = side ? &x->v[i] : &x->k[i];
                printf("    %s %-18s %6.3f bits  error %.3g\n", side ? "v" : "k",
                       codec_arg(&e->codec, k, sizeof k), e->bits_per_value, e->attention_error);
            }
    }
}

/* calibrate --model M --tokens N --file F [--q FILE] [--layer-start L]
 * [--layers N] [--vq dDbB] [--svd] [--iterations N] [--seed S]
 * [--max-samples N] [--error-budget X [--eval-queries N] [--exhaustive]] */
static int cmd_calibrate(kvdepot_client *c, int argc, char **argv)
{
    opt opts[] = {{"model", 1, 0},
                  {"tokens", 1, 0},
                  {"file", 1, 0},
                  {"q", 1, 0},
                  {"layer-start", 1, 0},
                  {"layers", 1, 0},
                  {"vq", 1, 0},
                  {"svd", 0, 0},
                  {"iterations", 1, 0},
                  {"seed", 1, 0},
                  {"max-samples", 1, 0},
                  {"error-budget", 1, 0},
                  {"eval-queries", 1, 0},
                  {"exhaustive", 0, 0},
                  {0, 0, 0}};
    if (parse_args(argc, argv, opts, NULL, 0) != 0)
        usage_error("calibrate: unexpected argument");
    kvdepot_model m;
    int rc = kvdepot_model_get(c, opt_required(opts, "model"), &m);
    if (rc)
        return fail(c, rc);
    uint64_t tokens = parse_u64("--tokens", opt_required(opts, "tokens"), UINT32_MAX);
    if (tokens == 0)
        usage_error("calibrate: --tokens must be at least 1");
    uint32_t l0 = (uint32_t)opt_u64(opts, "layer-start", 0, UINT32_MAX);
    if (l0 >= m.num_layers)
        usage_error("--layer-start %u: model %s has %u layers", l0, m.name, m.num_layers);
    uint32_t nl = (uint32_t)opt_u64(opts, "layers", m.num_layers - l0, m.num_layers - l0);
    kvdepot_calibrate_args a = {.model = m.name,
                                .svd = opt_get(opts, "svd") != NULL,
                                .iterations = (uint32_t)opt_u64(opts, "iterations", 0, 1000),
                                .seed = opt_u64(opts, "seed", 0, UINT64_MAX),
                                .max_samples = opt_u64(opts, "max-samples", 0, UINT64_MAX)};
    const char *vq = opt_get(opts, "vq");
    if (vq && sscanf(vq, "d%ub%u", &a.vq_sub_dim, &a.vq_bits) != 2)
        usage_error("--vq %s: expected dDbB, e.g. d4b8", vq);
    const char *budget = opt_get(opts, "error-budget");
    if (budget) {
        char *end;
        errno = 0;
        a.error_budget = strtod(budget, &end);
        if (errno || end == budget || *end || !(a.error_budget > 0) || a.error_budget > 1)
            usage_error("--error-budget %s: expected a number in (0, 1]", budget);
    }
    a.eval_queries = (uint32_t)opt_u64(opts, "eval-queries", 0, 256);
    a.exhaustive = opt_get(opts, "exhaustive") != NULL;
    size_t es = kvdepot_dtype_size(m.dtype);
    size_t per = (size_t)tokens * m.num_kv_heads * m.head_dim * es; /* K of one layer */
    size_t qper =
        (size_t)tokens * (m.num_q_heads ? m.num_q_heads : m.num_kv_heads) * m.head_dim * es;
    size_t len = 0, qlen = 0;
    uint8_t *kv = read_all(opt_required(opts, "file"), &len), *q = NULL;
    if (!kv)
        return 1;
    if (len != 2 * per * nl) {
        free(kv);
        return fail_msg("--file has %zu bytes; K then V of %u layers x %" PRIu64
                        " tokens ([layer][token][kv_head][head_dim] %s) is %zu",
                        len, nl, tokens, kvdepot_dtype_name(m.dtype), 2 * per * nl);
    }
    const char *qpath = opt_get(opts, "q");
    if (qpath) {
        if (!(q = read_all(qpath, &qlen))) {
            free(kv);
            return 1;
        }
        if (qlen != qper * nl) {
            free(kv);
            free(q);
            return fail_msg("--q has %zu bytes; %u layers x %" PRIu64
                            " tokens x q heads x head_dim is %zu",
                            qlen, nl, tokens, qper * nl);
        }
    }
    /* Samples of at most 4 MiB each (a layer's tokens in chunks), within
     * the default message limit. */
    size_t tok_bytes = (2 * per + qper) / (tokens ? tokens : 1);
    uint64_t chunk = (4u << 20) / (tok_bytes ? tok_bytes : 1);
    chunk = chunk ? chunk : 1;
    uint64_t per_layer = (tokens + chunk - 1) / chunk, ns = per_layer * nl;
    kvdepot_calibrate_sample *s = calloc(ns ? ns : 1, sizeof *s);
    if (!s) {
        free(kv);
        free(q);
        return fail_msg("out of memory");
    }
    const size_t krow = per / tokens, qrow = qper / tokens;
    for (uint32_t l = 0; l < nl; l++)
        for (uint64_t i = 0; i < per_layer; i++) {
            kvdepot_calibrate_sample *x = &s[l * per_layer + i];
            uint64_t t0 = i * chunk, n = tokens - t0 < chunk ? tokens - t0 : chunk;
            x->layer = l0 + l;
            x->num_tokens = n;
            x->k = kv + l * per + t0 * krow;
            x->v = kv + (nl + l) * per + t0 * krow;
            x->kv_bytes = n * krow;
            x->q = q ? q + l * qper + t0 * qrow : NULL;
            x->q_bytes = q ? n * qrow : 0;
        }
    kvdepot_calibrate_result r;
    rc = kvdepot_calibrate(c, &a, s, ns, &r);
    free(s);
    free(kv);
    free(q);
    if (rc)
        return fail(c, rc);
    if (json_out) {
        json_object *o = jobj(), *errs = jarr();
        ju64(o, "samples", r.samples);
        ju64(o, "artifacts", r.artifacts);
        for (size_t i = 0; i < r.n_errors; i++) {
            const kvdepot_calibration_error *e = &r.errors[i];
            json_object *x = jobj();
            ju64(x, "layer", e->layer);
            ju64(x, "kv_head", e->kv_head);
            jdbl(x, "vq_k", e->vq_k);
            jdbl(x, "vq_v", e->vq_v);
            jdbl(x, "svd_k", e->svd_k);
            jdbl(x, "svd_v", e->svd_v);
            ju64(x, "svd_width_k", e->svd_width_k);
            ju64(x, "svd_width_v", e->svd_width_v);
            json_object_array_add(errs, x);
        }
        jset(o, "errors", errs);
        if (r.advice)
            jset(o, "advice", advice_json(r.advice));
        kvdepot_calibrate_result_clear(&r);
        return jprint(o);
    }
    printf("calibrated %" PRIu64 " tokens; %u artifacts stored\n", r.samples, r.artifacts);
    printf("%-6s %-5s %-10s %-10s %-10s %-10s %-6s %-6s\n", "layer", "head", "vq_k", "vq_v",
           "svd_k", "svd_v", "w_k", "w_v");
    for (size_t i = 0; i < r.n_errors; i++) {
        const kvdepot_calibration_error *e = &r.errors[i];
        printf("%-6u %-5u %-10.3g %-10.3g %-10.3g %-10.3g %-6u %-6u\n", e->layer, e->kv_head,
               e->vq_k, e->vq_v, e->svd_k, e->svd_v, e->svd_width_k, e->svd_width_v);
    }
    if (r.advice)
        print_advice(r.advice);
    kvdepot_calibrate_result_clear(&r);
    return 0;
}

/*
 * artifacts get|put --model M --file F [--kind K]
 * File format (little-endian), one record per artifact:
 *   u32 kind, u32 layer, u32 kv_head, u32 ndim, u32 shape[2], f32 data[prod]
 */
static int cmd_artifacts(kvdepot_client *c, int argc, char **argv)
{
    opt opts[] = {{"model", 1, 0}, {"file", 1, 0}, {"kind", 1, 0}, {0, 0, 0}};
    const char *pos[1];
    if (parse_args(argc, argv, opts, pos, 1) != 1 ||
        (strcmp(pos[0], "get") != 0 && strcmp(pos[0], "put") != 0))
        usage_error("artifacts: expected get or put");
    const char *model = opt_required(opts, "model"), *path = opt_required(opts, "file");
    if (json_out && strcmp(path, "-") == 0)
        usage_error("artifacts: --json with --file -: the data is the output");
    int rc;
    if (strcmp(pos[0], "get") == 0) {
        int kind = (int)opt_u64(opts, "kind", 0, 7);
        kvdepot_artifact *a = NULL;
        size_t n = 0;
        if ((rc = kvdepot_artifacts_get(c, model, &kind, kind ? 1 : 0, &a, &n)))
            return fail(c, rc);
        FILE *f = strcmp(path, "-") == 0 ? stdout : fopen(path, "wb");
        if (!f) {
            kvdepot_artifacts_free(a, n);
            return fail_msg("%s: %s", path, strerror(errno));
        }
        int bad = 0;
        for (size_t i = 0; i < n; i++) {
            uint32_t h[6] = {(uint32_t)a[i].kind, a[i].layer,
                             a[i].kv_head,        a[i].ndim,
                             a[i].shape[0],       a[i].ndim == 2 ? a[i].shape[1] : 1};
            size_t ne = (size_t)h[4] * h[5];
            bad |= fwrite(h, sizeof h, 1, f) != 1 || fwrite(a[i].data, 4, ne, f) != ne;
        }
        bad |= f != stdout ? fclose(f) != 0 : fflush(f) != 0;
        kvdepot_artifacts_free(a, n);
        if (bad)
            return fail_msg("%s: write error", path);
        if (json_out) {
            json_object *o = jobj();
            jstr(o, "file", path);
            ju64(o, "artifacts", n);
            return jprint(o);
        }
        if (f != stdout)
            printf("wrote %zu artifacts to %s\n", n, path);
        return 0;
    }
    size_t len = 0;
    uint8_t *buf = read_all(path, &len);
    if (!buf)
        return 1;
    kvdepot_artifact *a = NULL;
    size_t n = 0, cap = 0, off = 0;
    rc = 0;
    while (off < len && !rc) {
        uint32_t h[6];
        if (len - off < sizeof h) {
            rc = fail_msg("%s: truncated record at byte %zu", path, off);
            break;
        }
        memcpy(h, buf + off, sizeof h);
        off += sizeof h;
        uint64_t ne = (uint64_t)h[4] * (h[3] == 2 ? h[5] : 1);
        if (h[3] < 1 || h[3] > 2 || ne > (len - off) / 4) {
            rc = fail_msg("%s: malformed record at byte %zu", path, off - sizeof h);
            break;
        }
        if (n == cap) {
            cap = cap ? 2 * cap : 16;
            kvdepot_artifact *na = realloc(a, cap * sizeof *na);
            if (!na) {
                rc = fail_msg("out of memory");
                break;
            }
            a = na;
        }
        a[n] = (kvdepot_artifact){.kind = (int)h[0],
                                  .layer = h[1],
                                  .kv_head = h[2],
                                  .ndim = h[3],
                                  .shape = {h[4], h[3] == 2 ? h[5] : 0},
                                  .data = (float *)(void *)(buf + off)};
        n++;
        off += 4 * ne;
    }
    uint32_t stored = 0;
    if (!rc) {
        /* data points into buf: the upload only reads it. */
        rc = kvdepot_artifacts_upload(c, model, a, n, &stored);
        if (rc)
            rc = fail(c, rc);
        else if (json_out) {
            json_object *o = jobj();
            ju64(o, "stored", stored);
            jprint(o);
        } else
            printf("stored %u artifacts\n", stored);
    }
    free(a);
    free(buf);
    return rc;
}
/* The usage lines of one command (its lines of usage_text: those that start
 * with it, and their continuations); 0, or -1 when there is no such
 * command. */
static int command_help(const char *cmd, FILE *f)
{
    const size_t n = strlen(cmd);
    int in = 0, found = 0;
    for (const char *p = usage_text; *p;) {
        const char *e = strchr(p, '\n');
        size_t len = e ? (size_t)(e - p) : strlen(p);
        if (len > 2 && p[0] == ' ' && p[1] == ' ' && p[2] != ' ')
            in = len >= n + 2 && strncmp(p + 2, cmd, n) == 0 && (len == n + 2 || p[n + 2] == ' ');
        else if (len < 3 || p[0] != ' ')
            in = 0;
        if (in) {
            fprintf(f, "%.*s\n", (int)len, p);
            found = 1;
        }
        p += len + (e != NULL);
    }
    return found ? 0 : -1;
}

/* Options that apply to every command, before or after it. */
typedef struct globals {
    const char *addr, *token, *tls_ca, *tls_cert, *tls_key, *tls_name;
    int tls;
    uint32_t deadline_ms;
} globals;

/* argv[*i] as a global option (its value consumed too): 1; 0 when it is
 * none. */
static int global_opt(int argc, char **argv, int *i, globals *g)
{
    const char *a = argv[*i];
    if (strcmp(a, "--tls") == 0)
        g->tls = 1;
    else if (strcmp(a, "--json") == 0)
        json_out = 1;
    else if (strcmp(a, "--progress") == 0)
        progress_mode = 1;
    else if (strcmp(a, "--no-progress") == 0)
        progress_mode = 0;
    else if (tls_flag(a, argc, argv, i, "--addr", &g->addr) ||
             tls_flag(a, argc, argv, i, "--tls-ca", &g->tls_ca) ||
             tls_flag(a, argc, argv, i, "--ca", &g->tls_ca) ||
             tls_flag(a, argc, argv, i, "--tls-cert", &g->tls_cert) ||
             tls_flag(a, argc, argv, i, "--tls-key", &g->tls_key) ||
             tls_flag(a, argc, argv, i, "--tls-server-name", &g->tls_name) ||
             tls_flag(a, argc, argv, i, "--token", &g->token)) {
    } else {
        const char *ms = NULL;
        if (!tls_flag(a, argc, argv, i, "--deadline-ms", &ms))
            return 0;
        g->deadline_ms = (uint32_t)parse_u64("--deadline-ms", ms, UINT32_MAX);
    }
    return 1;
}

int main(int argc, char **argv)
{
    globals g = {.addr = getenv("KVDEPOT_ADDR"), .token = getenv("KVDEPOT_TOKEN")};
    int i = 1;
    for (; i < argc && argv[i][0] == '-'; i++) {
        const char *a = argv[i];
        if (strcmp(a, "-h") == 0 || strcmp(a, "--help") == 0) {
            fputs(usage_text, stdout);
            return 0;
        } else if (strcmp(a, "--version") == 0) {
            printf("kvdepot %s\n", kvdepot_version());
            return 0;
        } else if (!global_opt(argc, argv, &i, &g)) {
            usage_error("unknown option %s", a);
        }
    }
    if (i == argc) {
        fputs(usage_text, stderr);
        return 2;
    }
    const char *cmd = argv[i++];
    /* Global options after the command are taken out of its arguments
     * (argv is compacted in place). */
    char **cargv = argv + i;
    int cargc = 0;
    for (; i < argc; i++)
        if (!global_opt(argc, argv, &i, &g))
            cargv[cargc++] = argv[i];
    cargv[cargc] = NULL;
    if (strcmp(cmd, "help") == 0) {
        if (cargc == 0) {
            fputs(usage_text, stdout);
            return 0;
        }
        if (command_help(cargv[0], stdout) != 0)
            usage_error("help: no command \"%s\"", cargv[0]);
        return 0;
    }
    if (strcmp(cmd, "version") == 0) {
        if (!json_out) {
            printf("kvdepot %s\n", kvdepot_version());
            return 0;
        }
        json_object *o = jobj();
        jstr(o, "version", kvdepot_version());
        return jprint(o);
    }
    /* CMD --help (or -h) anywhere after the command: that command's usage. */
    for (int j = 0; j < cargc; j++)
        if (strcmp(cargv[j], "--help") == 0 || strcmp(cargv[j], "-h") == 0) {
            if (command_help(cmd, stdout) != 0)
                usage_error("unknown command \"%s\"", cmd);
            return 0;
        }
    if (strcmp(cmd, "hash") == 0)
        return cmd_hash(cargc, cargv);

    static const struct {
        const char *name;
        int (*fn)(kvdepot_client *, int, char **);
    } cmds[] = {
        {"health", cmd_health},
        {"models", cmd_models},
        {"model", cmd_model},
        {"seqs", cmd_seqs},
        {"seq", cmd_seq},
        {"put", cmd_put},
        {"get", cmd_get},
        {"lookup", cmd_lookup},
        {"shards", cmd_shards},
        {"stats", cmd_stats},
        {"attend", cmd_attend},
        {"plan", cmd_plan},
        {"search", cmd_search},
        {"calibrate", cmd_calibrate},
        {"artifacts", cmd_artifacts},
        {"backup", cmd_backup},
    };
    int (*fn)(kvdepot_client *, int, char **) = NULL;
    for (size_t k = 0; k < sizeof cmds / sizeof cmds[0]; k++)
        if (strcmp(cmd, cmds[k].name) == 0)
            fn = cmds[k].fn;
    if (!fn)
        usage_error("unknown command \"%s\"", cmd);

    kvdepot_options opt;
    kvdepot_options_init(&opt);
    if (g.addr && *g.addr)
        opt.address = g.addr;
    if (g.deadline_ms)
        opt.deadline_ms = g.deadline_ms;
    else
        opt.deadline_ms = 600000; /* whole-file transfers can be large */
    opt.tls = g.tls;
    opt.tls_ca_file = g.tls_ca;
    opt.tls_cert_file = g.tls_cert;
    opt.tls_key_file = g.tls_key;
    opt.tls_server_name = g.tls_name;
    opt.token = g.token && *g.token ? g.token : NULL;
    kvdepot_client *c;
    int rc = kvdepot_connect(&opt, &c);
    if (rc)
        return fail(NULL, rc);
    int status = fn(c, cargc, cargv);
    kvdepot_close(c);
    return status;
}
