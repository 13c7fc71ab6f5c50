/*
 * bench_stream: put/get of KV-cache-sized objects over loopback, kvdepot
 * (through libkvdepot) next to Redis (through hiredis), with per-call
 * latency percentiles, throughput, accuracy and server memory.
 *
 * Systems (--systems, comma separated; default all):
 *   raw         kvdepot, raw pages: put = one Append of the f16 K/V that
 *               creates its sequence (one call, as SET); get = Read
 *               (bit-exact)
 *   raw-pages   kvdepot, raw pages made by the client: put =
 *               kvdepot_encode_pages + one AppendPages creating the sequence;
 *               get = Read in page format (the stored pages)
 *   int2        kvdepot, K and V INT2 (group 64, the defaults) coded by the
 *               server: put = one Append of f16 creating the sequence; get =
 *               Read of the decoded f16 (lossy: its error is reported)
 *   int2-pages  kvdepot, INT2 pages coded by the client: put =
 *               kvdepot_encode_pages + one AppendPages creating the sequence
 *               (only the coded bytes cross the wire); get = Read in page
 *               format (the stored pages, not decoded here)
 *   redis       Redis SET / GET of the same bytes (bit-exact)
 *   redis-aof   the same against a second Redis (--redis-aof) that keeps an
 *               append-only file written before each reply and not fsynced
 *               (appendonly yes, appendfsync no): the promise of kvdepotd's
 *               default durability (spill), which writes every Append to
 *               RocksDB's log before its reply. Its put column "x AOF" is a
 *               put's throughput over this Redis's. Runs only with
 *               --redis-aof.
 *
 * An object of S MiB is K+V in f16 of an 8B-class model (8 KV heads x 128):
 * per layer when S <= 16 (one layer, S*256 tokens: a model of 1 layer),
 * per request otherwise (all 32 layers, S*8 tokens). Values are finite f16
 * in [-1, 1] with random mantissas (INT2 needs numbers, not random bits).
 *
 * For each size: --reps puts of distinct objects, then a get of each, each
 * call timed alone, then the objects are deleted (untimed). The table shows
 * p50 and p99 latency (nearest rank: with fewer than 100 calls p99 is the
 * slowest), MB/s at the p50 latency (10^6 bytes of f16 K+V per second, the
 * logical payload whatever crosses the wire), and for lossy systems the
 * relative RMS error of what a get returns.
 *
 * Memory (--kvdepot-pid, --redis-pid, Linux): before the sizes, --mem-mib of
 * 16 MiB objects are put and the growth of the server's resident set is
 * divided by the GiB stored, then they are deleted. kvdepotd's is measured
 * for the first kvdepot system of the list only (the next would reuse the
 * memory the first freed): give one system per fresh server for all of them.
 *
 * Both servers must run on this machine (run_stream_bench.sh and
 * tests/bench/peers/run_peers.sh start them); non-loopback addresses are
 * refused. --csv writes one row per (system, size, op).
 */
#include <errno.h>
#include <hiredis/hiredis.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kvdepot.h"

#define MiB ((size_t)1 << 20)
#define MAX_SIZES 16
#define MAX_REPS 1000
#define LAYER_MAX_MIB 16 /* objects up to this size are one layer */

enum { SYS_RAW, SYS_RAW_PAGES, SYS_INT2, SYS_INT2_PAGES, SYS_REDIS, SYS_REDIS_AOF, NUM_SYS };
static const char *const sys_names[NUM_SYS] = {"raw",        "raw-pages", "int2",
                                               "int2-pages", "redis",     "redis-aof"};
static const char *const sys_labels[NUM_SYS] = {
    "kvdepot raw", "kvdepot raw pages", "kvdepot INT2", "kvdepot INT2 pages", "Redis", "Redis AOF"};

typedef struct bench_opts {
    const char *kvdepot_addr;
    const char *redis_addr;
    const char *redis_aof_addr; /* NULL: no redis-aof system */
    unsigned sizes_mib[MAX_SIZES];
    int num_sizes;
    int reps; /* 0 = by size */
    int systems[NUM_SYS];
    unsigned mem_mib;
    long kvdepot_pid, redis_pid, redis_aof_pid;
    const char *csv_path;
} bench_opts;

/* One object shape: a model and a token count. */
typedef struct shape {
    const kvdepot_model *model;
    uint64_t tokens;
    size_t half; /* bytes of K (= bytes of V) */
    const char *kind;
} shape;

/* Results of one (system, size). */
typedef struct row {
    int sys;
    unsigned mib;
    const char *kind;
    int reps;
    double put_p50, put_p99, get_p50, get_p99; /* seconds */
    double rel_rms;                            /* NAN when exact or not decoded */
} row;

typedef struct bench {
    const bench_opts *o;
    kvdepot_client *kv;
    redisContext *rc, *rc_aof;
    kvdepot_model layer_model, request_model;
    uint32_t page_tokens;
    uint8_t *payload, *back;
    double mem_per_gib[NUM_SYS]; /* NAN when not measured */
} bench;

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Nearest-rank percentile p (0..100) of n samples (sorts them). */
static double percentile(double *v, int n, double p)
{
    qsort(v, (size_t)n, sizeof *v, cmp_double);
    int rank = (int)ceil(p / 100.0 * n);
    if (rank < 1)
        rank = 1;
    return v[rank - 1];
}

/* Finite f16 values in [-1, 1]: random sign, exponent 10..14, mantissa
 * (xorshift64*), so the bytes do not compress and INT2 sees real numbers. */
static void fill_f16(uint8_t *p, size_t n, uint64_t seed)
{
    uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
    for (size_t i = 0; i + 2 <= n; i += 2) {
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        uint64_t r = x * 0x2545F4914F6CDD1Dull;
        uint16_t h = (uint16_t)(((r >> 16) & 0x8000) | ((10 + (r >> 20) % 5) << 10) | (r & 0x3ff));
        memcpy(p + i, &h, 2);
    }
}

static double f16_value(const uint8_t *p)
{
    uint16_t h;
    memcpy(&h, p, 2);
    int e = (h >> 10) & 0x1f, m = h & 0x3ff;
    double v = e == 0 ? ldexp(m, -24) : e == 31 ? (m ? NAN : INFINITY) : ldexp(m + 1024, e - 25);
    return h & 0x8000 ? -v : v;
}

/* ||b - a|| / ||a|| over n bytes of f16. */
static double rel_rms(const uint8_t *a, const uint8_t *b, size_t n)
{
    double num = 0, den = 0;
    for (size_t i = 0; i + 2 <= n; i += 2) {
        double x = f16_value(a + i), y = f16_value(b + i);
        num += (y - x) * (y - x);
        den += x * x;
    }
    return den > 0 ? sqrt(num / den) : NAN;
}

/* Resident set of a process in bytes (Linux /proc), or -1. */
static double rss_bytes(long pid)
{
    char path[64], line[256];
    snprintf(path, sizeof path, "/proc/%ld/status", pid);
    FILE *f = fopen(path, "r");
    if (f == NULL)
        return -1;
    double kib = -1;
    while (fgets(line, sizeof line, f))
        if (sscanf(line, "VmRSS: %lf", &kib) == 1)
            break;
    fclose(f);
    return kib < 0 ? -1 : kib * 1024;
}

static int is_loopback(const char *addr)
{
    return strncmp(addr, "127.", 4) == 0 || strncmp(addr, "localhost:", 10) == 0 ||
           strncmp(addr, "[::1]:", 6) == 0 || strncmp(addr, "ipv4:127.", 9) == 0;
}

static void usage(FILE *f)
{
    fprintf(f,
            "usage: bench_stream --kvdepot HOST:PORT --redis HOST:PORT [options]\n"
            "  --systems LIST   raw,raw-pages,int2,int2-pages,redis,redis-aof (default: all;\n"
            "                   redis-aof only with --redis-aof)\n"
            "  --redis-aof HOST:PORT  a second Redis, with appendonly yes, appendfsync no\n"
            "  --sizes LIST     object MiB, comma separated (default 1,4,16,64); up to 16 MiB\n"
            "                   an object is one layer, above it a whole request\n"
            "  --reps N         objects per size (default: 100 up to 4 MiB, 64 at 16, 16 at 64)\n"
            "  --mem-mib N      MiB stored for the memory figure (default 1024; 0 = skip)\n"
            "  --kvdepot-pid P  kvdepotd's pid, for its resident memory (first kvdepot system)\n"
            "  --redis-pid P    redis-server's pid, likewise\n"
            "  --redis-aof-pid P  the second redis-server's pid, likewise\n"
            "  --csv FILE       also write the results as CSV\n"
            "Both servers must listen on loopback addresses.\n");
}

static int parse_uint(const char *s, unsigned long max, unsigned long *out)
{
    char *end = NULL;
    errno = 0;
    unsigned long v = strtoul(s, &end, 10);
    if (errno || end == s || *end != '\0' || v > max || s[0] == '-')
        return -1;
    *out = v;
    return 0;
}

static int parse_list(const char *val, int (*item)(bench_opts *, const char *), bench_opts *o)
{
    char buf[256];
    snprintf(buf, sizeof buf, "%s", val);
    int n = 0;
    for (char *save = NULL, *tok = strtok_r(buf, ",", &save); tok;
         tok = strtok_r(NULL, ",", &save), n++)
        if (item(o, tok))
            return -1;
    return n ? 0 : -1;
}

static int size_item(bench_opts *o, const char *tok)
{
    unsigned long v;
    if (o->num_sizes == MAX_SIZES || parse_uint(tok, 4096, &v) || v == 0)
        return -1;
    o->sizes_mib[o->num_sizes++] = (unsigned)v;
    return 0;
}

static int system_item(bench_opts *o, const char *tok)
{
    for (int s = 0; s < NUM_SYS; s++)
        if (strcmp(tok, sys_names[s]) == 0) {
            o->systems[s] = 1;
            return 0;
        }
    return -1;
}

static int parse_args(int argc, char **argv, bench_opts *o)
{
    memset(o, 0, sizeof *o);
    int sizes_given = 0, systems_given = 0;
    o->mem_mib = 1024;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *val = i + 1 < argc ? argv[i + 1] : NULL;
        unsigned long v;
        if (strcmp(a, "-h") == 0 || strcmp(a, "--help") == 0) {
            usage(stdout);
            exit(0);
        }
        if (val == NULL) {
            fprintf(stderr, "bench_stream: %s needs a value\n", a);
            return -1;
        }
        i++;
        int bad = 0;
        if (strcmp(a, "--kvdepot") == 0)
            o->kvdepot_addr = val;
        else if (strcmp(a, "--redis") == 0)
            o->redis_addr = val;
        else if (strcmp(a, "--redis-aof") == 0)
            o->redis_aof_addr = val;
        else if (strcmp(a, "--sizes") == 0)
            bad = sizes_given++ || parse_list(val, size_item, o);
        else if (strcmp(a, "--systems") == 0)
            bad = systems_given++ || parse_list(val, system_item, o);
        else if (strcmp(a, "--reps") == 0)
            bad = parse_uint(val, MAX_REPS, &v) || v == 0 || ((o->reps = (int)v), 0);
        else if (strcmp(a, "--mem-mib") == 0)
            bad = parse_uint(val, 65536, &v) || ((o->mem_mib = (unsigned)v), 0);
        else if (strcmp(a, "--kvdepot-pid") == 0)
            bad = parse_uint(val, 1ul << 30, &v) || ((o->kvdepot_pid = (long)v), 0);
        else if (strcmp(a, "--redis-pid") == 0)
            bad = parse_uint(val, 1ul << 30, &v) || ((o->redis_pid = (long)v), 0);
        else if (strcmp(a, "--redis-aof-pid") == 0)
            bad = parse_uint(val, 1ul << 30, &v) || ((o->redis_aof_pid = (long)v), 0);
        else if (strcmp(a, "--csv") == 0)
            o->csv_path = val;
        else
            bad = 1;
        if (bad) {
            fprintf(stderr, "bench_stream: bad argument %s %s\n", a, val);
            return -1;
        }
    }
    if (!sizes_given) {
        static const unsigned def_sizes[] = {1, 4, 16, 64};
        memcpy(o->sizes_mib, def_sizes, sizeof def_sizes);
        o->num_sizes = 4;
    }
    if (!systems_given)
        for (int s = 0; s < NUM_SYS; s++)
            o->systems[s] = s != SYS_REDIS_AOF || o->redis_aof_addr;
    if (o->kvdepot_addr == NULL || o->redis_addr == NULL) {
        usage(stderr);
        return -1;
    }
    if (o->systems[SYS_REDIS_AOF] && !o->redis_aof_addr) {
        fprintf(stderr, "bench_stream: the system redis-aof needs --redis-aof HOST:PORT\n");
        return -1;
    }
    if (!is_loopback(o->kvdepot_addr) || !is_loopback(o->redis_addr) ||
        (o->redis_aof_addr && !is_loopback(o->redis_aof_addr))) {
        fprintf(stderr, "bench_stream: only loopback addresses are allowed\n");
        return -1;
    }
    return 0;
}

static redisContext *redis_open(const char *addr)
{
    char host[256];
    const char *colon = strrchr(addr, ':');
    if (colon == NULL || (size_t)(colon - addr) >= sizeof host) {
        fprintf(stderr, "bench_stream: bad redis address %s\n", addr);
        return NULL;
    }
    memcpy(host, addr, (size_t)(colon - addr));
    host[colon - addr] = '\0';
    struct timeval tv = {60, 0};
    redisContext *c = redisConnectWithTimeout(host, atoi(colon + 1), tv);
    if (c == NULL || c->err) {
        fprintf(stderr, "bench_stream: redis %s: %s\n", addr, c ? c->errstr : "out of memory");
        if (c)
            redisFree(c);
        return NULL;
    }
    return c;
}

/* One Redis command that must succeed: 0, or -1 after printing why. With
 * want (GET) the reply must be those bytes. */
static int redis_do(redisContext *c, const char *what, redisReply *r, const void *want, size_t n)
{
    int ok = r != NULL && r->type != REDIS_REPLY_ERROR;
    if (!ok)
        fprintf(stderr, "bench_stream: redis %s: %s\n", what, r ? r->str : c->errstr);
    else if (want && (r->type != REDIS_REPLY_STRING || (size_t)r->len != n ||
                      memcmp(r->str, want, n) != 0)) {
        fprintf(stderr, "bench_stream: redis %s: bytes differ from what was SET\n", what);
        ok = 0;
    }
    if (r)
        freeReplyObject(r);
    return ok ? 0 : -1;
}

static int is_redis(int sys)
{
    return sys == SYS_REDIS || sys == SYS_REDIS_AOF;
}

/* The connection of a Redis system. */
static redisContext *redis_of(const bench *b, int sys)
{
    return sys == SYS_REDIS_AOF ? b->rc_aof : b->rc;
}

static int kv_fail(bench *b, const char *what, const char *id, int err)
{
    fprintf(stderr, "bench_stream: %s %s: %s: %s\n", what, id, kvdepot_status_name(err),
            kvdepot_errmsg(b->kv));
    return -1;
}

static shape shape_of(const bench *b, unsigned mib)
{
    shape s;
    size_t payload = (size_t)mib * MiB;
    s.model = mib <= LAYER_MAX_MIB ? &b->layer_model : &b->request_model;
    s.kind = mib <= LAYER_MAX_MIB ? "layer" : "request";
    s.half = payload / 2;
    s.tokens = s.half / kvdepot_kv_bytes(s.model, s.model->num_layers, 1);
    return s;
}

static void object_id(char *id, size_t cap, int sys, unsigned mib, int i)
{
    snprintf(id, cap, "bench-%s-%u-%d", sys_names[sys], mib, i);
}

/* Exact systems get object i's index in the first value (an exact small
 * integer in f16), so a get that returns another object's bytes is caught;
 * the lossy ones keep the payload as it is (a large value would dominate
 * its quantization group). */
static void tag_payload(bench *b, int sys, int i)
{
    uint16_t tag = (uint16_t)(0x6000 | (i & 0x3ff)); /* 512 + i */
    if (sys == SYS_RAW || is_redis(sys))
        memcpy(b->payload, &tag, 2);
}

/* Encodes every layer of the payload into pages (codecs; NULL = raw) and
 * sends them in one AppendPages that creates the sequence (ca). */
static int put_pages(bench *b, const shape *s, const kvdepot_codecs *codecs,
                     const kvdepot_create_args *ca)
{
    uint32_t layers = s->model->num_layers;
    size_t layer_bytes = s->half / layers;
    kvdepot_page *per[32] = {0}, *all = NULL;
    size_t nper[32] = {0}, n_all = 0;
    int err = layers > 32 ? KVDEPOT_EINVAL : 0;
    for (uint32_t l = 0; err == 0 && l < layers; l++) {
        err = kvdepot_encode_pages(s->model, codecs, b->page_tokens, l, 0, s->tokens,
                                   b->payload + l * layer_bytes,
                                   b->payload + s->half + l * layer_bytes, &per[l], &nper[l]);
        n_all += nper[l];
    }
    if (err == 0 && (all = malloc(n_all * sizeof *all)) == NULL)
        err = KVDEPOT_ENOMEM;
    if (err == 0) {
        size_t at = 0;
        for (uint32_t l = 0; l < layers; l++) {
            memcpy(all + at, per[l], nper[l] * sizeof *all);
            at += nper[l];
        }
        kvdepot_append_pages_args pa = {
            .id = ca->id, .id_len = ca->id_len, .pages = all, .count = n_all, .create = ca};
        err = kvdepot_sequence_append_pages(b->kv, &pa, NULL);
    }
    free(all); /* a shallow copy: the bytes belong to per[] */
    for (uint32_t l = 0; l < layers && l < 32; l++)
        kvdepot_pages_free(per[l], nper[l]);
    return err;
}

static int put_one(bench *b, int sys, const shape *s, unsigned mib, int i)
{
    char id[96];
    object_id(id, sizeof id, sys, mib, i);
    size_t idlen = strlen(id);
    tag_payload(b, sys, i);
    if (is_redis(sys)) {
        redisContext *rc = redis_of(b, sys);
        return redis_do(
            rc, "SET",
            redisCommand(rc, "SET %b %b", id, idlen, (const char *)b->payload, 2 * s->half), NULL,
            0);
    }
    kvdepot_codecs int2;
    memset(&int2, 0, sizeof int2);
    int2.k.codec = int2.v.codec = KVDEPOT_CODEC_INT2;
    kvdepot_create_args ca = {.id = id,
                              .id_len = idlen,
                              .model = s->model->name,
                              .codecs = sys == SYS_RAW ? NULL : &int2};
    if (sys == SYS_INT2_PAGES || sys == SYS_RAW_PAGES) {
        /* The encoding is part of the put: it is the client's work. */
        ca.codecs = sys == SYS_RAW_PAGES ? NULL : &int2;
        int err = put_pages(b, s, ca.codecs, &ca);
        return err ? kv_fail(b, "put pages", id, err) : 0;
    }
    kvdepot_append_args aa = {.id = id,
                              .id_len = idlen,
                              .num_tokens = s->tokens,
                              .dtype = s->model->dtype,
                              .k = b->payload,
                              .k_bytes = s->half,
                              .v = b->payload + s->half,
                              .v_bytes = s->half,
                              .create = &ca};
    int err = kvdepot_sequence_append(b->kv, &aa, NULL);
    return err ? kv_fail(b, "append", id, err) : 0;
}

/* Gets object i into b->back (decoded systems), checking the bytes of the
 * exact ones; *t is the time of the call alone. */
static int get_one(bench *b, int sys, const shape *s, unsigned mib, int i, double *t)
{
    char id[96];
    object_id(id, sizeof id, sys, mib, i);
    size_t idlen = strlen(id);
    tag_payload(b, sys, i);
    double t0 = now_s();
    if (is_redis(sys)) {
        redisContext *rc = redis_of(b, sys);
        redisReply *r = redisCommand(rc, "GET %b", id, idlen);
        *t = now_s() - t0;
        return redis_do(rc, "GET", r, b->payload, 2 * s->half);
    }
    kvdepot_read_args ra = {.id = id, .id_len = idlen};
    if (sys == SYS_INT2_PAGES || sys == SYS_RAW_PAGES) {
        kvdepot_page *pg = NULL;
        size_t np = 0;
        int err = kvdepot_sequence_read_pages(b->kv, &ra, &pg, &np);
        *t = now_s() - t0;
        size_t want =
            (size_t)s->model->num_layers * ((s->tokens + b->page_tokens - 1) / b->page_tokens);
        kvdepot_pages_free(pg, np);
        if (err)
            return kv_fail(b, "read pages", id, err);
        if (np != want) {
            fprintf(stderr, "bench_stream: read pages %s: %zu pages, want %zu\n", id, np, want);
            return -1;
        }
        return 0;
    }
    ra.k = b->back;
    ra.v = b->back + s->half;
    ra.capacity = s->half;
    kvdepot_read_result res;
    int err = kvdepot_sequence_read(b->kv, &ra, &res);
    *t = now_s() - t0;
    if (err)
        return kv_fail(b, "read", id, err);
    if (res.kv_bytes != s->half ||
        (sys == SYS_RAW && memcmp(b->back, b->payload, 2 * s->half) != 0)) {
        fprintf(stderr, "bench_stream: read %s: bytes differ from what was appended\n", id);
        return -1;
    }
    return 0;
}

static int delete_one(bench *b, int sys, unsigned mib, int i)
{
    char id[96];
    object_id(id, sizeof id, sys, mib, i);
    if (is_redis(sys)) {
        redisContext *rc = redis_of(b, sys);
        return redis_do(rc, "DEL", redisCommand(rc, "DEL %s", id), NULL, 0);
    }
    int err = kvdepot_sequence_delete(b->kv, id, strlen(id), NULL);
    return err ? kv_fail(b, "delete", id, err) : 0;
}

static int default_reps(unsigned mib)
{
    return mib <= 4 ? 100 : mib <= 16 ? 64 : 16;
}

static int bench_size(bench *b, int sys, unsigned mib, row *out)
{
    shape s = shape_of(b, mib);
    if (s.tokens == 0 || 2 * s.half != (size_t)mib * MiB ||
        s.half % kvdepot_kv_bytes(s.model, s.model->num_layers, 1)) {
        fprintf(stderr, "bench_stream: %u MiB is not a whole number of tokens\n", mib);
        return -1;
    }
    int reps = b->o->reps ? b->o->reps : default_reps(mib);
    double put[MAX_REPS], get[MAX_REPS];
    fill_f16(b->payload, 2 * s.half, mib);
    /* One untimed round first: connections, allocator, RocksDB warm. */
    if (put_one(b, sys, &s, mib, reps) || get_one(b, sys, &s, mib, reps, &get[0]) ||
        delete_one(b, sys, mib, reps))
        return -1;
    for (int i = 0; i < reps; i++) {
        double t0 = now_s();
        if (put_one(b, sys, &s, mib, i))
            return -1;
        put[i] = now_s() - t0;
    }
    double e2 = 0;
    int n_err = 0;
    for (int i = 0; i < reps; i++) {
        if (get_one(b, sys, &s, mib, i, &get[i]))
            return -1;
        if (sys == SYS_INT2 && i < 4) { /* the error of a few objects */
            e2 += rel_rms(b->payload, b->back, 2 * s.half);
            n_err++;
        }
    }
    for (int i = 0; i < reps; i++)
        if (delete_one(b, sys, mib, i))
            return -1;
    out->sys = sys;
    out->mib = mib;
    out->kind = s.kind;
    out->reps = reps;
    out->put_p50 = percentile(put, reps, 50);
    out->put_p99 = percentile(put, reps, 99);
    out->get_p50 = percentile(get, reps, 50);
    out->get_p99 = percentile(get, reps, 99);
    out->rel_rms = n_err ? e2 / n_err : NAN;
    return 0;
}

/* Server memory growth per GiB stored: mem_mib of 16 MiB (per layer)
 * objects, then deleted. */
static int bench_memory(bench *b, int sys)
{
    long pid = sys == SYS_REDIS       ? b->o->redis_pid
               : sys == SYS_REDIS_AOF ? b->o->redis_aof_pid
                                      : b->o->kvdepot_pid;
    b->mem_per_gib[sys] = NAN;
    if (pid == 0 || b->o->mem_mib == 0)
        return 0;
    const unsigned mib = 16;
    int n = (int)(b->o->mem_mib / mib);
    shape s = shape_of(b, mib);
    fill_f16(b->payload, 2 * s.half, 99);
    double before = rss_bytes(pid);
    for (int i = 0; i < n; i++)
        if (put_one(b, sys, &s, 1000 + mib, i))
            return -1;
    double after = rss_bytes(pid);
    for (int i = 0; i < n; i++)
        if (delete_one(b, sys, 1000 + mib, i))
            return -1;
    if (before < 0 || after < 0) {
        fprintf(stderr, "bench_stream: cannot read the memory of pid %ld\n", pid);
        return -1;
    }
    b->mem_per_gib[sys] = (after - before) / ((double)n * mib * MiB / (1024.0 * MiB));
    return 0;
}

static int put_model(bench *b, kvdepot_model *m, const char *name, uint32_t layers)
{
    memset(m, 0, sizeof *m);
    snprintf(m->name, sizeof m->name, "%s", name);
    snprintf(m->revision, sizeof m->revision, "bench");
    m->num_layers = layers;
    m->num_kv_heads = 8;
    m->head_dim = 128;
    m->dtype = KVDEPOT_DTYPE_F16;
    int err = kvdepot_model_put(b->kv, m, 0, NULL, NULL);
    if (err)
        fprintf(stderr, "bench_stream: PutModel %s: %s: %s\n", name, kvdepot_status_name(err),
                kvdepot_errmsg(b->kv));
    return err ? -1 : 0;
}

/* The server's page size, from a probe sequence. */
static int probe_page_tokens(bench *b)
{
    kvdepot_create_args ca = {.id = "bench-probe", .id_len = 11, .model = b->layer_model.name};
    kvdepot_sequence_info info;
    memset(&info, 0, sizeof info);
    int err = kvdepot_sequence_create(b->kv, &ca, &info);
    if (err)
        return kv_fail(b, "create", "bench-probe", err);
    b->page_tokens = info.page_tokens;
    kvdepot_sequence_info_clear(&info);
    kvdepot_sequence_delete(b->kv, "bench-probe", 11, NULL);
    return b->page_tokens ? 0 : -1;
}

static void print_rows(const bench *b, const row *rows, int n, FILE *csv)
{
    printf("put/get over loopback, objects of K+V f16 (8 KV heads x 128; 'layer' = one layer, "
           "'request' = 32 layers); latency in ms, MB/s at p50\n");
    printf("%-19s %7s %-7s %4s | %8s %8s %7s %7s %7s | %8s %8s %7s %7s | %9s | %10s\n", "system",
           "object", "shape", "n", "put p50", "put p99", "MB/s", "x Redis", "x AOF", "get p50",
           "get p99", "MB/s", "x Redis", "rel. RMS", "RSS/GiB");
    for (int i = 0; i < n; i++) {
        const row *r = &rows[i];
        double bytes = (double)r->mib * MiB;
        /* throughput over Redis's for the same object size, this run */
        char xput[16] = "-", xget[16] = "-", xaof[16] = "-";
        for (int k = 0; k < n; k++)
            if (rows[k].sys == SYS_REDIS && rows[k].mib == r->mib) {
                snprintf(xput, sizeof xput, "%.2f", rows[k].put_p50 / r->put_p50);
                snprintf(xget, sizeof xget, "%.2f", rows[k].get_p50 / r->get_p50);
            } else if (rows[k].sys == SYS_REDIS_AOF && rows[k].mib == r->mib) {
                snprintf(xaof, sizeof xaof, "%.2f", rows[k].put_p50 / r->put_p50);
            }
        char err[16] = "exact", mem[16] = "-";
        if (r->sys == SYS_INT2_PAGES)
            snprintf(err, sizeof err, "as INT2");
        else if (!isnan(r->rel_rms))
            snprintf(err, sizeof err, "%.4f", r->rel_rms);
        if (!isnan(b->mem_per_gib[r->sys]))
            snprintf(mem, sizeof mem, "%.2f GiB", b->mem_per_gib[r->sys] / (1024.0 * MiB));
        printf("%-19s %4u MiB %-7s %4d | %8.2f %8.2f %7.0f %7s %7s | %8.2f %8.2f %7.0f %7s | %9s "
               "| %10s\n",
               sys_labels[r->sys], r->mib, r->kind, r->reps, r->put_p50 * 1e3, r->put_p99 * 1e3,
               bytes / r->put_p50 / 1e6, xput, xaof, r->get_p50 * 1e3, r->get_p99 * 1e3,
               bytes / r->get_p50 / 1e6, xget, err, mem);
        if (csv)
            for (int op = 0; op < 2; op++)
                fprintf(csv, "%s,%u,%s,%s,%d,%.6f,%.6f,%.1f,%s,%s\n", sys_labels[r->sys], r->mib,
                        r->kind, op ? "get" : "put", r->reps, (op ? r->get_p50 : r->put_p50) * 1e3,
                        (op ? r->get_p99 : r->put_p99) * 1e3,
                        bytes / (op ? r->get_p50 : r->put_p50) / 1e6, isnan(r->rel_rms) ? "" : err,
                        isnan(b->mem_per_gib[r->sys]) ? "" : mem);
    }
}

int main(int argc, char **argv)
{
    bench_opts o;
    if (parse_args(argc, argv, &o))
        return 2;
    bench b;
    memset(&b, 0, sizeof b);
    b.o = &o;

    kvdepot_options kopt;
    kvdepot_options_init(&kopt);
    kopt.address = o.kvdepot_addr;
    kopt.deadline_ms = 600000;
    int err = kvdepot_connect(&kopt, &b.kv);
    kvdepot_serving serving = KVDEPOT_SERVING_UNKNOWN;
    if (err == 0)
        err = kvdepot_health_check(b.kv, "", &serving);
    if (err || serving != KVDEPOT_SERVING) {
        fprintf(stderr, "bench_stream: kvdepot %s not serving: %s\n", o.kvdepot_addr,
                err ? kvdepot_errmsg(b.kv) : "health status is not SERVING");
        kvdepot_close(b.kv);
        return 1;
    }
    b.rc = redis_open(o.redis_addr);
    if (o.redis_aof_addr && b.rc)
        b.rc_aof = redis_open(o.redis_aof_addr);
    int rc_main = b.rc == NULL || (o.redis_aof_addr && b.rc_aof == NULL);
    if (rc_main == 0 &&
        (put_model(&b, &b.layer_model, "bench-layer-8x128", 1) ||
         put_model(&b, &b.request_model, "bench-request-32x8x128", 32) || probe_page_tokens(&b)))
        rc_main = 1;

    unsigned max_mib = 16;
    for (int i = 0; i < o.num_sizes; i++)
        if (o.sizes_mib[i] > max_mib)
            max_mib = o.sizes_mib[i];
    b.payload = malloc((size_t)max_mib * MiB);
    b.back = malloc((size_t)max_mib * MiB);
    if (b.payload == NULL || b.back == NULL) {
        fprintf(stderr, "bench_stream: out of memory for %u MiB buffers\n", max_mib);
        rc_main = 1;
    }
    row rows[NUM_SYS * MAX_SIZES];
    int nrows = 0, kv_measured = 0;
    for (int sys = 0; rc_main == 0 && sys < NUM_SYS; sys++) {
        if (!o.systems[sys])
            continue;
        /* The memory of kvdepotd is measured for its first system only: the
         * next ones would reuse what the first freed. */
        b.mem_per_gib[sys] = NAN;
        if ((is_redis(sys) || !kv_measured++) && bench_memory(&b, sys))
            rc_main = 1;
        for (int i = 0; rc_main == 0 && i < o.num_sizes; i++)
            if (bench_size(&b, sys, o.sizes_mib[i], &rows[nrows++]))
                rc_main = 1;
    }
    if (rc_main == 0) {
        FILE *csv = NULL;
        if (o.csv_path) {
            csv = fopen(o.csv_path, "w");
            if (csv == NULL) {
                fprintf(stderr, "bench_stream: cannot write %s: %s\n", o.csv_path, strerror(errno));
                rc_main = 1;
            } else {
                fprintf(csv, "system,object_mib,shape,op,n,p50_ms,p99_ms,mbps_at_p50,rel_rms,"
                             "rss_per_gib\n");
            }
        }
        print_rows(&b, rows, nrows, csv);
        if (csv)
            fclose(csv);
    }
    if (b.layer_model.name[0])
        kvdepot_model_delete(b.kv, b.layer_model.name, 1, NULL);
    if (b.request_model.name[0])
        kvdepot_model_delete(b.kv, b.request_model.name, 1, NULL);
    free(b.payload);
    free(b.back);
    if (b.rc)
        redisFree(b.rc);
    if (b.rc_aof)
        redisFree(b.rc_aof);
    kvdepot_close(b.kv);
    return rc_main;
}
