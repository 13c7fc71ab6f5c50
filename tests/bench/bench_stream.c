/*
 * bench_stream: streaming throughput of kvdepot Append/Read over loopback,
 * next to Redis SET/GET of the same bytes.
 *
 * For each payload size (MiB of K+V per request) the program appends one
 * sequence holding exactly that many bytes through libkvdepot, reads it back
 * whole, then SETs and GETs the same bytes as one Redis string through
 * hiredis. Every transfer is checked bit-exact (outside the timed region).
 * One untimed warm-up round per size, then --reps timed rounds; the table
 * shows the median of each column and Read/GET, the ratio of the medians.
 *
 * MB/s is 10^6 bytes per second of K+V payload. Both servers must run on
 * this machine (run_stream_bench.sh starts them); the program refuses
 * non-loopback addresses.
 *
 * Payload shape: a model of --layers x --kv-heads x --head-dim in f16
 * (default 32 x 8 x 128, an 8B-class LLM: 128 KiB of K+V per token), so a
 * payload of S MiB is S*8 tokens of all layers, appended in one call.
 */
#include <errno.h>
#include <hiredis/hiredis.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kvdepot.h"

#define MiB ((size_t)1 << 20)
#define MAX_SIZES 16
#define MAX_REPS 101

typedef struct bench_opts {
    const char *kvdepot_addr;
    const char *redis_addr;
    unsigned sizes_mib[MAX_SIZES];
    int num_sizes;
    int reps;
    uint32_t layers, kv_heads, head_dim;
    size_t chunk_kib;
    const char *csv_path;
} bench_opts;

/* Medians of one payload size, in MB/s. */
typedef struct bench_row {
    unsigned mib;
    double append, read, set, get;
} bench_row;

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

static double median(double *v, int n)
{
    qsort(v, (size_t)n, sizeof *v, cmp_double);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

/* Deterministic, incompressible-looking fill (xorshift64*). */
static void fill_random(uint8_t *p, size_t n, uint64_t seed)
{
    uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        uint64_t r = x * 0x2545F4914F6CDD1Dull;
        memcpy(p + i, &r, 8);
    }
    for (; i < n; i++)
        p[i] = (uint8_t)(i * 131u + seed);
}

static int is_loopback(const char *addr)
{
    return strncmp(addr, "127.", 4) == 0 || strncmp(addr, "localhost:", 10) == 0 ||
           strncmp(addr, "[::1]:", 6) == 0 || strncmp(addr, "ipv4:127.", 9) == 0;
}

static void usage(FILE *f)
{
    fprintf(f, "usage: bench_stream --kvdepot HOST:PORT --redis HOST:PORT [options]\n"
               "  --sizes LIST     payload MiB per request, comma separated (default 1,4,16,64)\n"
               "  --reps N         timed repetitions per size, median reported (default 5)\n"
               "  --layers N       model layers (default 32)\n"
               "  --kv-heads N     KV heads (default 8)\n"
               "  --head-dim N     head dimension (default 128)\n"
               "  --chunk-kib N    libkvdepot message size in KiB (default: library's)\n"
               "  --csv FILE       also write the table as CSV\n"
               "Both servers must listen on loopback addresses.\n");
}

static int parse_uint(const char *s, unsigned long max, unsigned long *out)
{
    char *end = NULL;
    errno = 0;
    unsigned long v = strtoul(s, &end, 10);
    if (errno || end == s || *end != '\0' || v == 0 || v > max || s[0] == '-')
        return -1;
    *out = v;
    return 0;
}

static int parse_args(int argc, char **argv, bench_opts *o)
{
    memset(o, 0, sizeof *o);
    static const unsigned def_sizes[] = {1, 4, 16, 64};
    memcpy(o->sizes_mib, def_sizes, sizeof def_sizes);
    o->num_sizes = 4;
    o->reps = 5;
    o->layers = 32;
    o->kv_heads = 8;
    o->head_dim = 128;
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
        if (strcmp(a, "--kvdepot") == 0) {
            o->kvdepot_addr = val;
        } else if (strcmp(a, "--redis") == 0) {
            o->redis_addr = val;
        } else if (strcmp(a, "--sizes") == 0) {
            char buf[256];
            snprintf(buf, sizeof buf, "%s", val);
            o->num_sizes = 0;
            for (char *save = NULL, *tok = strtok_r(buf, ",", &save); tok;
                 tok = strtok_r(NULL, ",", &save)) {
                if (o->num_sizes == MAX_SIZES || parse_uint(tok, 4096, &v)) {
                    fprintf(stderr, "bench_stream: bad --sizes %s\n", val);
                    return -1;
                }
                o->sizes_mib[o->num_sizes++] = (unsigned)v;
            }
            if (o->num_sizes == 0)
                return -1;
        } else if (strcmp(a, "--reps") == 0 && parse_uint(val, MAX_REPS, &v) == 0) {
            o->reps = (int)v;
        } else if (strcmp(a, "--layers") == 0 && parse_uint(val, 1024, &v) == 0) {
            o->layers = (uint32_t)v;
        } else if (strcmp(a, "--kv-heads") == 0 && parse_uint(val, 1024, &v) == 0) {
            o->kv_heads = (uint32_t)v;
        } else if (strcmp(a, "--head-dim") == 0 && parse_uint(val, 1024, &v) == 0) {
            o->head_dim = (uint32_t)v;
        } else if (strcmp(a, "--chunk-kib") == 0 && parse_uint(val, 4096, &v) == 0) {
            o->chunk_kib = v;
        } else if (strcmp(a, "--csv") == 0) {
            o->csv_path = val;
        } else {
            fprintf(stderr, "bench_stream: bad argument %s %s\n", a, val);
            return -1;
        }
    }
    if (o->kvdepot_addr == NULL || o->redis_addr == NULL) {
        usage(stderr);
        return -1;
    }
    if (!is_loopback(o->kvdepot_addr) || !is_loopback(o->redis_addr)) {
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
    struct timeval tv = {10, 0};
    redisContext *c = redisConnectWithTimeout(host, atoi(colon + 1), tv);
    if (c == NULL || c->err) {
        fprintf(stderr, "bench_stream: redis %s: %s\n", addr, c ? c->errstr : "out of memory");
        if (c)
            redisFree(c);
        return NULL;
    }
    return c;
}

/* One Redis command that must succeed; returns the reply (caller frees) or NULL. */
static redisReply *redis_cmd(redisContext *c, const char *what, redisReply *r)
{
    if (r == NULL) {
        fprintf(stderr, "bench_stream: redis %s: %s\n", what, c->errstr);
        return NULL;
    }
    if (r->type == REDIS_REPLY_ERROR) {
        fprintf(stderr, "bench_stream: redis %s: %s\n", what, r->str);
        freeReplyObject(r);
        return NULL;
    }
    return r;
}

/*
 * Times one payload size. kv holds K then V (payload bytes in all); back is a
 * buffer of the same size for reading. Returns 0, or -1 after printing why.
 */
static int bench_size(const bench_opts *o, kvdepot_client *kv, redisContext *rc,
                      const kvdepot_model *model, unsigned mib, uint8_t *kv_buf, uint8_t *back,
                      bench_row *row)
{
    const size_t payload = (size_t)mib * MiB;
    const size_t per_token = 2 * kvdepot_kv_bytes(model, model->num_layers, 1);
    if (per_token == 0 || payload % per_token) {
        fprintf(stderr, "bench_stream: %u MiB is not a whole number of %zu-byte tokens\n", mib,
                per_token);
        return -1;
    }
    const uint64_t tokens = payload / per_token;
    const size_t half = payload / 2;
    double t_app[MAX_REPS], t_read[MAX_REPS], t_set[MAX_REPS], t_get[MAX_REPS];
    char key[64];
    snprintf(key, sizeof key, "bench:%u", mib);

    fill_random(kv_buf, payload, mib);
    for (int rep = -1; rep < o->reps; rep++) { /* rep -1: warm-up */
        char id[64];
        int idlen = snprintf(id, sizeof id, "bench-%u-%d", mib, rep + 1);
        kvdepot_create_args ca = {.id = id, .id_len = (size_t)idlen, .model = model->name};
        int err = kvdepot_sequence_create(kv, &ca, NULL);
        if (err) {
            fprintf(stderr, "bench_stream: create %s: %s: %s\n", id, kvdepot_status_name(err),
                    kvdepot_errmsg(kv));
            return -1;
        }

        kvdepot_append_args aa = {.id = id,
                                  .id_len = (size_t)idlen,
                                  .num_tokens = tokens,
                                  .dtype = model->dtype,
                                  .k = kv_buf,
                                  .k_bytes = half,
                                  .v = kv_buf + half,
                                  .v_bytes = half};
        double t0 = now_s();
        err = kvdepot_sequence_append(kv, &aa, NULL);
        double t1 = now_s();
        if (err) {
            fprintf(stderr, "bench_stream: append %u MiB: %s: %s\n", mib, kvdepot_status_name(err),
                    kvdepot_errmsg(kv));
            return -1;
        }

        memset(back, 0, payload);
        kvdepot_read_args ra = {
            .id = id, .id_len = (size_t)idlen, .k = back, .v = back + half, .capacity = half};
        kvdepot_read_result res;
        double t2 = now_s();
        err = kvdepot_sequence_read(kv, &ra, &res);
        double t3 = now_s();
        if (err) {
            fprintf(stderr, "bench_stream: read %u MiB: %s: %s\n", mib, kvdepot_status_name(err),
                    kvdepot_errmsg(kv));
            return -1;
        }
        if (res.kv_bytes != half || memcmp(back, kv_buf, payload) != 0) {
            fprintf(stderr, "bench_stream: kvdepot read %u MiB: bytes differ from appended\n", mib);
            return -1;
        }
        err = kvdepot_sequence_delete(kv, id, (size_t)idlen, NULL);
        if (err) {
            fprintf(stderr, "bench_stream: delete %s: %s: %s\n", id, kvdepot_status_name(err),
                    kvdepot_errmsg(kv));
            return -1;
        }

        double t4 = now_s();
        redisReply *r = redis_cmd(
            rc, "SET",
            redisCommand(rc, "SET %b %b", key, strlen(key), (const char *)kv_buf, payload));
        double t5 = now_s();
        if (r == NULL)
            return -1;
        freeReplyObject(r);
        double t6 = now_s();
        r = redis_cmd(rc, "GET", redisCommand(rc, "GET %b", key, strlen(key)));
        double t7 = now_s();
        if (r == NULL)
            return -1;
        int same = r->type == REDIS_REPLY_STRING && (size_t)r->len == payload &&
                   memcmp(r->str, kv_buf, payload) == 0;
        freeReplyObject(r);
        if (!same) {
            fprintf(stderr, "bench_stream: redis GET %u MiB: bytes differ from SET\n", mib);
            return -1;
        }
        r = redis_cmd(rc, "DEL", redisCommand(rc, "DEL %b", key, strlen(key)));
        if (r == NULL)
            return -1;
        freeReplyObject(r);

        if (rep >= 0) {
            t_app[rep] = (double)payload / (t1 - t0) / 1e6;
            t_read[rep] = (double)payload / (t3 - t2) / 1e6;
            t_set[rep] = (double)payload / (t5 - t4) / 1e6;
            t_get[rep] = (double)payload / (t7 - t6) / 1e6;
        }
    }
    row->mib = mib;
    row->append = median(t_app, o->reps);
    row->read = median(t_read, o->reps);
    row->set = median(t_set, o->reps);
    row->get = median(t_get, o->reps);
    return 0;
}

int main(int argc, char **argv)
{
    bench_opts o;
    if (parse_args(argc, argv, &o))
        return 2;

    kvdepot_options kopt;
    kvdepot_options_init(&kopt);
    kopt.address = o.kvdepot_addr;
    kopt.deadline_ms = 600000;
    if (o.chunk_kib) {
        kopt.chunk_bytes = o.chunk_kib * 1024;
        if (kopt.max_message_bytes < kopt.chunk_bytes + 64 * 1024)
            kopt.max_message_bytes = kopt.chunk_bytes + 64 * 1024;
    }
    kvdepot_client *kv = NULL;
    int err = kvdepot_connect(&kopt, &kv);
    kvdepot_serving serving = KVDEPOT_SERVING_UNKNOWN;
    if (err == 0)
        err = kvdepot_health_check(kv, "", &serving);
    if (err || serving != KVDEPOT_SERVING) {
        fprintf(stderr, "bench_stream: kvdepot %s not serving: %s\n", o.kvdepot_addr,
                err ? kvdepot_errmsg(kv) : "health status is not SERVING");
        kvdepot_close(kv);
        return 1;
    }
    redisContext *rc = redis_open(o.redis_addr);
    if (rc == NULL) {
        kvdepot_close(kv);
        return 1;
    }

    kvdepot_model model;
    memset(&model, 0, sizeof model);
    snprintf(model.name, sizeof model.name, "bench-stream-%ux%ux%u", o.layers, o.kv_heads,
             o.head_dim);
    snprintf(model.revision, sizeof model.revision, "bench");
    model.num_layers = o.layers;
    model.num_kv_heads = o.kv_heads;
    model.head_dim = o.head_dim;
    model.dtype = KVDEPOT_DTYPE_F16;
    err = kvdepot_model_put(kv, &model, 0, NULL, NULL);
    if (err) {
        fprintf(stderr, "bench_stream: PutModel: %s: %s\n", kvdepot_status_name(err),
                kvdepot_errmsg(kv));
        redisFree(rc);
        kvdepot_close(kv);
        return 1;
    }

    unsigned max_mib = 0;
    for (int i = 0; i < o.num_sizes; i++)
        if (o.sizes_mib[i] > max_mib)
            max_mib = o.sizes_mib[i];
    uint8_t *kv_buf = malloc((size_t)max_mib * MiB);
    uint8_t *back = malloc((size_t)max_mib * MiB);
    bench_row rows[MAX_SIZES];
    int rc_main = 0;
    if (kv_buf == NULL || back == NULL) {
        fprintf(stderr, "bench_stream: out of memory for %u MiB buffers\n", max_mib);
        rc_main = 1;
    }
    for (int i = 0; rc_main == 0 && i < o.num_sizes; i++) {
        if (bench_size(&o, kv, rc, &model, o.sizes_mib[i], kv_buf, back, &rows[i]))
            rc_main = 1;
    }

    if (rc_main == 0) {
        printf("kvdepot streaming over loopback vs Redis; model %s f16; median of %d reps; "
               "MB/s = 1e6 B/s of K+V\n",
               model.name, o.reps);
        printf("%-8s %16s %16s %14s %14s %9s\n", "payload", "kvdepot Append", "kvdepot Read",
               "Redis SET", "Redis GET", "Read/GET");
        for (int i = 0; i < o.num_sizes; i++) {
            const bench_row *r = &rows[i];
            char size[16];
            snprintf(size, sizeof size, "%u MiB", r->mib);
            printf("%-8s %16.0f %16.0f %14.0f %14.0f %9.2f\n", size, r->append, r->read, r->set,
                   r->get, r->read / r->get);
        }
        if (o.csv_path) {
            FILE *f = fopen(o.csv_path, "w");
            if (f == NULL) {
                fprintf(stderr, "bench_stream: cannot write %s: %s\n", o.csv_path, strerror(errno));
                rc_main = 1;
            } else {
                fprintf(f, "payload_mib,kvdepot_append_mbps,kvdepot_read_mbps,redis_set_mbps,"
                           "redis_get_mbps,read_over_get\n");
                for (int i = 0; i < o.num_sizes; i++)
                    fprintf(f, "%u,%.1f,%.1f,%.1f,%.1f,%.3f\n", rows[i].mib, rows[i].append,
                            rows[i].read, rows[i].set, rows[i].get, rows[i].read / rows[i].get);
                fclose(f);
            }
        }
    }

    kvdepot_model_delete(kv, model.name, 1, NULL);
    free(kv_buf);
    free(back);
    redisFree(rc);
    kvdepot_close(kv);
    return rc_main;
}
