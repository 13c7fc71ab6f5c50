/*
 * End-to-end tests of the tiers: a working set larger than memory read back
 * bit-exact under a bounded RSS, kill -9 under each durability setting, a
 * page corrupted on disk, and concurrent readers and writers with eviction.
 *
 * Settings reach kvdepotd through the environment (KVDEPOT_<NAME>), which the
 * harness passes on. Content is a pure function of (sequence, part, layer,
 * token), so any reader can check any bytes without a reference copy.
 */
#include <inttypes.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <rocksdb/c.h>

#include "harness.h"

#define LAYERS 4
#define HEADS 2
#define DIM 64
#define ROW (HEADS * DIM * 2) /* bytes of one token of one layer, f16 */

static kvdepot_model tier_model(void)
{
    kvdepot_model m;
    memset(&m, 0, sizeof m);
    snprintf(m.name, sizeof m.name, "tiered");
    m.num_layers = LAYERS;
    m.num_kv_heads = HEADS;
    m.num_q_heads = HEADS;
    m.head_dim = DIM;
    m.dtype = KVDEPOT_DTYPE_F16;
    return m;
}

static uint64_t mix(uint64_t x)
{
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

/* The bytes of one row: sequence s, part (0 K, 1 V), layer l, token t. */
static void gen_row(uint8_t *dst, uint32_t s, int part, uint32_t l, uint64_t t)
{
    uint64_t seed = mix(((uint64_t)s << 40) ^ ((uint64_t)part << 39) ^ ((uint64_t)l << 32) ^ t);
    for (size_t i = 0; i < ROW; i += 8) {
        uint64_t v = mix(seed + i);
        memcpy(dst + i, &v, 8);
    }
}

static void seq_name(char *buf, size_t cap, uint32_t s)
{
    snprintf(buf, cap, "seq-%04u", s);
}

/* Append tokens [t0, t0+n) of sequence s to every layer. */
static int append_gen(kvdepot_client *c, uint32_t s, uint64_t t0, uint64_t n)
{
    size_t bytes = (size_t)LAYERS * n * ROW;
    uint8_t *k = malloc(bytes), *v = malloc(bytes);
    if (!k || !v) {
        free(k);
        free(v);
        return KVDEPOT_ENOMEM;
    }
    for (uint32_t l = 0; l < LAYERS; l++)
        for (uint64_t t = 0; t < n; t++) {
            gen_row(k + ((size_t)l * n + t) * ROW, s, 0, l, t0 + t);
            gen_row(v + ((size_t)l * n + t) * ROW, s, 1, l, t0 + t);
        }
    char id[32];
    seq_name(id, sizeof id, s);
    kvdepot_append_args a = {.id = id,
                             .id_len = strlen(id),
                             .token_start = t0,
                             .num_tokens = n,
                             .dtype = KVDEPOT_DTYPE_F16,
                             .k = k,
                             .k_bytes = bytes,
                             .v = v,
                             .v_bytes = bytes};
    int rc = kvdepot_sequence_append(c, &a, NULL);
    free(k);
    free(v);
    return rc;
}

static int create_gen(kvdepot_client *c, uint32_t s)
{
    char id[32];
    seq_name(id, sizeof id, s);
    kvdepot_create_args a = {.id = id, .id_len = strlen(id), .model = "tiered"};
    return kvdepot_sequence_create(c, &a, NULL);
}

/* Read layers [l0, l0+nl) x tokens [t0, t0+n) of sequence s and compare.
 * Returns the library's code, or KVDEPOT_EINTERNAL (printed) on a byte
 * difference. */
static int check_gen(kvdepot_client *c, uint32_t s, uint32_t l0, uint32_t nl, uint64_t t0,
                     uint64_t n)
{
    char id[32];
    seq_name(id, sizeof id, s);
    kvdepot_read_args a = {.id = id,
                           .id_len = strlen(id),
                           .layer_start = l0,
                           .num_layers = nl,
                           .token_start = t0,
                           .num_tokens = n};
    kvdepot_read_result r;
    int rc = kvdepot_sequence_read(c, &a, &r);
    if (rc)
        return rc;
    uint8_t row[ROW];
    int bad = 0;
    if (r.kv_bytes != (size_t)nl * n * ROW)
        bad = 1;
    for (uint32_t l = 0; l < nl && !bad; l++)
        for (uint64_t t = 0; t < n && !bad; t++)
            for (int part = 0; part < 2 && !bad; part++) {
                gen_row(row, s, part, l0 + l, t0 + t);
                const uint8_t *got =
                    (const uint8_t *)(part ? r.v : r.k) + ((size_t)l * n + t) * ROW;
                if (memcmp(row, got, ROW) != 0) {
                    fprintf(stderr, "%s: wrong bytes at part %d layer %u token %" PRIu64 "\n", id,
                            part, l0 + l, t0 + t);
                    bad = 1;
                }
            }
    kvdepot_free(r.owned);
    return bad ? KVDEPOT_EINTERNAL : KVDEPOT_OK;
}

static uint64_t tokens_of(kvdepot_client *c, uint32_t s, int *rc)
{
    char id[32];
    seq_name(id, sizeof id, s);
    kvdepot_sequence_info info;
    *rc = kvdepot_sequence_stat(c, id, strlen(id), &info);
    if (*rc)
        return 0;
    uint64_t n = info.num_tokens;
    kvdepot_sequence_info_clear(&info);
    return n;
}

/* kB of a /proc/PID/status field (VmRSS, VmHWM); 0 when unreadable. */
static uint64_t proc_kb(pid_t pid, const char *field)
{
    char path[64], line[256];
    snprintf(path, sizeof path, "/proc/%d/status", (int)pid);
    FILE *f = fopen(path, "r");
    if (!f)
        return 0;
    uint64_t v = 0;
    size_t fl = strlen(field);
    while (fgets(line, sizeof line, f))
        if (strncmp(line, field, fl) == 0 && line[fl] == ':')
            v = strtoull(line + fl + 1, NULL, 10);
    fclose(f);
    return v;
}

static int restart_with(kvd_harness *h, const char *const *env)
{
    if (harness_stop(h) != 0)
        return -1;
    for (const char *const *e = env; *e; e += 2)
        setenv(e[0], e[1], 1);
    return harness_start(h);
}

static void unset_env(const char *const *env)
{
    for (const char *const *e = env; *e; e += 2)
        unsetenv(e[0]);
}

/* ------------------------------------------------------------------------ */
/* Working set 4x the memory tiers                                           */
/* ------------------------------------------------------------------------ */

#define WS_SEQS 64
#define WS_TOKENS 1536 /* 6 pages per layer; 3 MiB of K+V per sequence */
#define WS_TIER_MIB 24 /* device and host each: 48 MiB against 192 MiB of pages */
/* What kvdepotd may hold beyond the tiers (README, "Tiers, limits and
 * durability"): RocksDB memtables (two of 16 MiB) and block cache, gRPC
 * buffers and the Append in flight (its bytes, the WriteBatch, the pages
 * built). Below the working set, so a server keeping every page in memory
 * fails the check. */
#define WS_OVERHEAD_MIB 128

static int test_working_set(kvd_harness *h)
{
    static const char *const env[] = {"KVDEPOT_DEVICE_TIER_BYTES", "24MiB",
                                      "KVDEPOT_HOST_TIER_BYTES", "24MiB", NULL};
    REQUIRE(restart_with(h, env) == 0);
    kvdepot_client *c = harness_client(h);
    REQUIRE(c);
    uint64_t base_kb = proc_kb(h->pid, "VmRSS");
    kvdepot_model m = tier_model();
    REQUIRE_RC(kvdepot_model_put(c, &m, 0, NULL, NULL), KVDEPOT_OK);
    for (uint32_t s = 0; s < WS_SEQS; s++) {
        REQUIRE_RC(create_gen(c, s), KVDEPOT_OK);
        REQUIRE_RC(append_gen(c, s, 0, WS_TOKENS), KVDEPOT_OK);
    }
    /* Random order, whole sequences, twice: the second round hits pages
     * promoted by the first or evicted again since. */
    uint32_t order[WS_SEQS];
    for (uint32_t i = 0; i < WS_SEQS; i++)
        order[i] = i;
    uint64_t rnd = 12345;
    for (int round = 0; round < 2; round++) {
        for (uint32_t i = WS_SEQS - 1; i > 0; i--) {
            rnd = mix(rnd);
            uint32_t j = (uint32_t)(rnd % (i + 1));
            uint32_t t = order[i];
            order[i] = order[j];
            order[j] = t;
        }
        for (uint32_t i = 0; i < WS_SEQS; i++)
            CHECK_RC(check_gen(c, order[i], 0, LAYERS, 0, WS_TOKENS), KVDEPOT_OK);
    }
    uint64_t rss_kb = proc_kb(h->pid, "VmRSS"), hwm_kb = proc_kb(h->pid, "VmHWM");
    kvdepot_stats st;
    REQUIRE_RC(kvdepot_stats_get(c, &st), KVDEPOT_OK);
    uint64_t limit_kb = base_kb + 2 * WS_TIER_MIB * 1024 + WS_OVERHEAD_MIB * 1024;
    printf("working set: %d MiB of pages, tiers 2 x %d MiB; RSS at start %" PRIu64
           " MiB, now %" PRIu64 " MiB, peak %" PRIu64 " MiB (bound %" PRIu64 " MiB)\n",
           WS_SEQS * WS_TOKENS * LAYERS * ROW * 2 >> 20, WS_TIER_MIB, base_kb >> 10, rss_kb >> 10,
           hwm_kb >> 10, limit_kb >> 10);
    printf("  device %" PRIu64 " B / %" PRIu64 " pages, hits %" PRIu64 ", evictions %" PRIu64
           "; host %" PRIu64 " B, hits %" PRIu64 ", evictions %" PRIu64 "; misses %" PRIu64
           ", promotions %" PRIu64 ", prefetched %" PRIu64 "\n",
           st.tiers[0].bytes, st.tiers[0].pages, st.tiers[0].hits, st.tiers[0].evictions,
           st.tiers[1].bytes, st.tiers[1].hits, st.tiers[1].evictions, st.misses, st.promotions,
           st.prefetched);
    CHECK(base_kb > 0 && hwm_kb > 0);
    CHECK(limit_kb < base_kb + (uint64_t)WS_SEQS * WS_TOKENS * LAYERS * ROW * 2 / 1024);
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
    /* Sanitizer runtimes keep shadow memory and quarantines: no RSS bound. */
    printf("  (sanitizer build: RSS bound not checked)\n");
#else
    CHECK(hwm_kb <= limit_kb);
#endif
    CHECK(st.tiers[0].bytes <= st.tiers[0].limit_bytes);
    CHECK(st.tiers[1].bytes <= st.tiers[1].limit_bytes);
    CHECK(st.tiers[0].evictions > 0 && st.tiers[1].evictions > 0);
    CHECK(st.misses > 0 && st.promotions > 0);
    CHECK(st.tiers[2].pages == (uint64_t)WS_SEQS * LAYERS * (WS_TOKENS / 256));
    CHECK(st.checksum_failures == 0);
    kvdepot_close(c);
    unset_env(env);
    return 0;
}

/* ------------------------------------------------------------------------ */
/* kill -9 during a stream of Appends                                        */
/* ------------------------------------------------------------------------ */

typedef struct appender {
    kvdepot_client *c;
    _Atomic uint64_t acked;    /* tokens acknowledged */
    _Atomic uint64_t inflight; /* tokens of the append under way, 0 = none */
    _Atomic int stop;
    uint64_t bounds[100000]; /* token counts after each acknowledged append */
    _Atomic size_t nbounds;
} appender;

static void *appender_main(void *arg)
{
    appender *a = arg;
    uint64_t rnd = 99;
    while (!atomic_load(&a->stop)) {
        rnd = mix(rnd);
        uint64_t n = 1 + rnd % 40;
        uint64_t t0 = atomic_load(&a->acked);
        atomic_store(&a->inflight, n);
        if (append_gen(a->c, 0, t0, n) != KVDEPOT_OK)
            break;
        atomic_store(&a->acked, t0 + n);
        atomic_store(&a->inflight, 0);
        size_t nb = atomic_load(&a->nbounds);
        if (nb < sizeof a->bounds / sizeof a->bounds[0]) {
            a->bounds[nb] = t0 + n;
            atomic_store(&a->nbounds, nb + 1);
        }
    }
    return NULL;
}

static int crash_run(kvd_harness *h, const char *durability)
{
    const char *env[] = {"KVDEPOT_DURABILITY",
                         durability,
                         "KVDEPOT_DEVICE_TIER_BYTES",
                         "2MiB",
                         "KVDEPOT_HOST_TIER_BYTES",
                         "2MiB",
                         NULL};
    REQUIRE(restart_with(h, env) == 0);
    kvdepot_client *c = harness_client(h);
    REQUIRE(c);
    kvdepot_model m = tier_model();
    REQUIRE_RC(kvdepot_model_put(c, &m, 0, NULL, NULL), KVDEPOT_OK);
    REQUIRE_RC(create_gen(c, 0), KVDEPOT_OK);
    /* A first append the server has certainly acknowledged. */
    REQUIRE_RC(append_gen(c, 0, 0, 300), KVDEPOT_OK);
    appender *a = calloc(1, sizeof *a);
    REQUIRE(a);
    a->c = harness_client(h);
    atomic_store(&a->acked, 300);
    a->bounds[0] = 300;
    atomic_store(&a->nbounds, 1);
    pthread_t t;
    REQUIRE(pthread_create(&t, NULL, appender_main, a) == 0);
    struct timespec ts = {0, 700 * 1000000L};
    nanosleep(&ts, NULL);
    harness_kill(h);
    atomic_store(&a->stop, 1);
    pthread_join(t, NULL);
    uint64_t acked = atomic_load(&a->acked), inflight = atomic_load(&a->inflight);
    kvdepot_close(a->c);
    kvdepot_close(c);

    REQUIRE(harness_start(h) == 0);
    c = harness_client(h);
    REQUIRE(c);
    int rc;
    uint64_t n = tokens_of(c, 0, &rc);
    printf("durability %s: %" PRIu64 " tokens acknowledged (%zu appends), %" PRIu64
           " in flight at the kill; %" PRIu64 " after restart (%s)\n",
           durability, acked, atomic_load(&a->nbounds), inflight, n, kvdepot_status_name(rc));
    if (strcmp(durability, "none") == 0) {
        /* A pure cache comes back as of its last flush: maybe empty, never
         * half an append, never wrong bytes. */
        CHECK(rc == KVDEPOT_OK || rc == KVDEPOT_ENOTFOUND);
        if (rc == KVDEPOT_OK && n) {
            int boundary = n == acked + inflight;
            for (size_t i = 0; i < atomic_load(&a->nbounds); i++)
                boundary |= a->bounds[i] == n;
            CHECK(boundary);
            CHECK_RC(check_gen(c, 0, 0, LAYERS, 0, n), KVDEPOT_OK);
        }
    } else {
        /* Every acknowledged token; the append cut off by the kill is all
         * there or not at all. */
        REQUIRE_RC(rc, KVDEPOT_OK);
        CHECK(n == acked || (inflight && n == acked + inflight));
        CHECK_RC(check_gen(c, 0, 0, LAYERS, 0, n), KVDEPOT_OK);
        /* And it carries on from there. */
        CHECK_RC(append_gen(c, 0, n, 17), KVDEPOT_OK);
        CHECK_RC(check_gen(c, 0, 0, LAYERS, n, 17), KVDEPOT_OK);
    }
    free(a);
    kvdepot_close(c);
    unset_env(env);
    return 0;
}

static int test_crash_sync(kvd_harness *h)
{
    return crash_run(h, "sync");
}
static int test_crash_spill(kvd_harness *h)
{
    return crash_run(h, "spill");
}
static int test_crash_none(kvd_harness *h)
{
    return crash_run(h, "none");
}

/* ------------------------------------------------------------------------ */
/* A page corrupted on disk                                                  */
/* ------------------------------------------------------------------------ */

static uint64_t le(const uint8_t *p, int n)
{
    uint64_t v = 0;
    for (int i = 0; i < n; i++)
        v |= (uint64_t)p[i] << (8 * i);
    return v;
}

/* Flip one payload byte of the sealed page of layer `layer` starting at
 * token `start`, through RocksDB, with the server stopped. 0 or -1. */
static int corrupt_page(const char *dir, uint32_t layer, uint64_t start)
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
    rocksdb_iterator_t *it = rocksdb_create_iterator(db, ro);
    int done = -1;
    for (rocksdb_iter_seek(it, "P", 1); rocksdb_iter_valid(it); rocksdb_iter_next(it)) {
        size_t kl, vl;
        const char *k = rocksdb_iter_key(it, &kl);
        if (kl != 9 || k[0] != 'P')
            break;
        const uint8_t *v = (const uint8_t *)rocksdb_iter_value(it, &vl);
        if (vl < 64 || le(v + 12, 4) != layer || le(v + 16, 8) != start)
            continue;
        uint8_t *copy = malloc(vl);
        if (!copy)
            break;
        memcpy(copy, v, vl);
        copy[vl / 2] ^= 0x40;
        rocksdb_put(db, wo, k, kl, (const char *)copy, vl, &e);
        free(copy);
        if (e) {
            fprintf(stderr, "rocksdb_put: %s\n", e);
            rocksdb_free(e);
        } else {
            done = 0;
        }
        break;
    }
    rocksdb_iter_destroy(it);
    rocksdb_readoptions_destroy(ro);
    rocksdb_writeoptions_destroy(wo);
    rocksdb_close(db);
    rocksdb_options_destroy(o);
    return done;
}

static int test_corrupt(kvd_harness *h)
{
    kvdepot_client *c = harness_client(h);
    REQUIRE(c);
    kvdepot_model m = tier_model();
    REQUIRE_RC(kvdepot_model_put(c, &m, 0, NULL, NULL), KVDEPOT_OK);
    REQUIRE_RC(create_gen(c, 7), KVDEPOT_OK);
    REQUIRE_RC(append_gen(c, 7, 0, 1000), KVDEPOT_OK);
    kvdepot_close(c);
    REQUIRE(harness_stop(h) == 0);
    REQUIRE(corrupt_page(h->data_dir, 2, 256) == 0);
    REQUIRE(harness_start(h) == 0);
    c = harness_client(h);
    REQUIRE(c);
    /* The page's tokens on its layer, alone and inside a larger read. */
    CHECK_RC(check_gen(c, 7, 2, 1, 256, 256), KVDEPOT_ECORRUPT);
    CHECK_RC(check_gen(c, 7, 2, 1, 300, 1), KVDEPOT_ECORRUPT);
    CHECK_RC(check_gen(c, 7, 0, LAYERS, 0, 1000), KVDEPOT_ECORRUPT);
    /* Asked again: still refused (a bad page never enters a memory tier). */
    CHECK_RC(check_gen(c, 7, 2, 1, 256, 256), KVDEPOT_ECORRUPT);
    /* Everything else reads back exactly. */
    CHECK_RC(check_gen(c, 7, 2, 1, 0, 256), KVDEPOT_OK);
    CHECK_RC(check_gen(c, 7, 2, 1, 512, 488), KVDEPOT_OK);
    CHECK_RC(check_gen(c, 7, 0, 2, 0, 1000), KVDEPOT_OK);
    CHECK_RC(check_gen(c, 7, 3, 1, 0, 1000), KVDEPOT_OK);
    kvdepot_stats st;
    CHECK_RC(kvdepot_stats_get(c, &st), KVDEPOT_OK);
    CHECK(st.checksum_failures >= 4);
    kvdepot_serving sv;
    CHECK_RC(kvdepot_health_check(c, "", &sv), KVDEPOT_OK);
    CHECK(sv == KVDEPOT_SERVING);
    CHECK(harness_alive(h));
    kvdepot_close(c);
    return 0;
}

/* ------------------------------------------------------------------------ */
/* Concurrent readers and writers while pages are evicted                    */
/* ------------------------------------------------------------------------ */

#define CC_WRITERS 4
#define CC_READERS 4
#define CC_SEQS_PER_WRITER 2
#define CC_MAX_TOKENS 1500

typedef struct cc_ctx {
    kvd_harness *h;
    _Atomic int stop;
    _Atomic uint64_t reads, appends, wrong, errors;
} cc_ctx;

typedef struct cc_thread {
    cc_ctx *ctx;
    int index;
} cc_thread;

static void *cc_writer(void *arg)
{
    cc_thread *t = arg;
    cc_ctx *x = t->ctx;
    kvdepot_client *c = harness_client(x->h);
    uint64_t have[CC_SEQS_PER_WRITER] = {0};
    uint64_t rnd = mix((uint64_t)t->index + 1);
    while (c && !atomic_load(&x->stop)) {
        rnd = mix(rnd);
        int k = (int)(rnd % CC_SEQS_PER_WRITER);
        uint32_t s = (uint32_t)(t->index * CC_SEQS_PER_WRITER + k);
        uint64_t n = 1 + (rnd >> 8) % 300;
        if (have[k] + n > CC_MAX_TOKENS)
            continue;
        int rc = append_gen(c, s, have[k], n);
        if (rc) {
            fprintf(stderr, "writer %d: append: %s\n", t->index, kvdepot_status_name(rc));
            atomic_fetch_add(&x->errors, 1);
            break;
        }
        have[k] += n;
        atomic_fetch_add(&x->appends, 1);
        if (have[0] + 300 > CC_MAX_TOKENS && have[1] + 300 > CC_MAX_TOKENS)
            break;
    }
    kvdepot_close(c);
    return NULL;
}

static void *cc_reader(void *arg)
{
    cc_thread *t = arg;
    cc_ctx *x = t->ctx;
    kvdepot_client *c = harness_client(x->h);
    uint64_t rnd = mix((uint64_t)t->index + 100);
    while (c && !atomic_load(&x->stop)) {
        rnd = mix(rnd);
        uint32_t s = (uint32_t)(rnd % (CC_WRITERS * CC_SEQS_PER_WRITER));
        int rc;
        uint64_t n = tokens_of(c, s, &rc);
        if (rc || n == 0)
            continue;
        uint64_t t0 = (rnd >> 16) % n, len = 1 + (rnd >> 32) % (n - t0);
        uint32_t l0 = (uint32_t)((rnd >> 40) % LAYERS);
        if ((rnd >> 48) % 8 == 0) {
            char id[32];
            seq_name(id, sizeof id, s);
            kvdepot_sequence_evict(c, id, strlen(id), NULL, NULL);
        }
        rc = check_gen(c, s, l0, LAYERS - l0, t0, len);
        if (rc == KVDEPOT_EINTERNAL)
            atomic_fetch_add(&x->wrong, 1);
        else if (rc)
            atomic_fetch_add(&x->errors, 1);
        atomic_fetch_add(&x->reads, 1);
    }
    kvdepot_close(c);
    return NULL;
}

static int test_concurrent(kvd_harness *h)
{
    /* Tiers of a few pages each (a page here is 128 KiB), so pages are
     * evicted and promoted all the time. */
    static const char *const env[] = {"KVDEPOT_DEVICE_TIER_BYTES", "640KiB",
                                      "KVDEPOT_HOST_TIER_BYTES", "640KiB", NULL};
    REQUIRE(restart_with(h, env) == 0);
    kvdepot_client *c = harness_client(h);
    REQUIRE(c);
    kvdepot_model m = tier_model();
    REQUIRE_RC(kvdepot_model_put(c, &m, 0, NULL, NULL), KVDEPOT_OK);
    for (uint32_t s = 0; s < CC_WRITERS * CC_SEQS_PER_WRITER; s++)
        REQUIRE_RC(create_gen(c, s), KVDEPOT_OK);
    cc_ctx x = {.h = h};
    cc_thread th[CC_WRITERS + CC_READERS];
    pthread_t tid[CC_WRITERS + CC_READERS];
    for (int i = 0; i < CC_WRITERS + CC_READERS; i++) {
        th[i].ctx = &x;
        th[i].index = i < CC_WRITERS ? i : i - CC_WRITERS;
        REQUIRE(pthread_create(&tid[i], NULL, i < CC_WRITERS ? cc_writer : cc_reader, &th[i]) == 0);
    }
    for (int i = 0; i < CC_WRITERS; i++)
        pthread_join(tid[i], NULL);
    struct timespec ts = {0, 500 * 1000000L};
    nanosleep(&ts, NULL);
    atomic_store(&x.stop, 1);
    for (int i = CC_WRITERS; i < CC_WRITERS + CC_READERS; i++)
        pthread_join(tid[i], NULL);
    kvdepot_stats st;
    CHECK_RC(kvdepot_stats_get(c, &st), KVDEPOT_OK);
    printf("concurrent: %" PRIu64 " appends, %" PRIu64 " reads, %" PRIu64 " wrong, %" PRIu64
           " errors; evictions %" PRIu64 "/%" PRIu64 ", promotions %" PRIu64 "\n",
           atomic_load(&x.appends), atomic_load(&x.reads), atomic_load(&x.wrong),
           atomic_load(&x.errors), st.tiers[0].evictions, st.tiers[1].evictions, st.promotions);
    CHECK(atomic_load(&x.wrong) == 0);
    CHECK(atomic_load(&x.errors) == 0);
    CHECK(atomic_load(&x.reads) > 0 && atomic_load(&x.appends) > 0);
    CHECK(st.tiers[0].evictions > 0);
    /* Everything, once more, after the dust settles. */
    for (uint32_t s = 0; s < CC_WRITERS * CC_SEQS_PER_WRITER; s++) {
        int rc;
        uint64_t n = tokens_of(c, s, &rc);
        CHECK_RC(rc, KVDEPOT_OK);
        if (n)
            CHECK_RC(check_gen(c, s, 0, LAYERS, 0, n), KVDEPOT_OK);
    }
    CHECK(harness_alive(h));
    kvdepot_close(c);
    unset_env(env);
    return 0;
}

/* ------------------------------------------------------------------------ */
/* TTL, the disk limit                                                       */
/* ------------------------------------------------------------------------ */

static int test_expiry(kvd_harness *h)
{
    static const char *const env[] = {"KVDEPOT_DISK_BYTES", "4MiB", NULL};
    REQUIRE(restart_with(h, env) == 0);
    kvdepot_client *c = harness_client(h);
    REQUIRE(c);
    kvdepot_model m = tier_model();
    REQUIRE_RC(kvdepot_model_put(c, &m, 0, NULL, NULL), KVDEPOT_OK);
    /* TTL: gone about a second after its last append, also across a restart. */
    kvdepot_create_args a = {.id = "short", .id_len = 5, .model = "tiered", .ttl_seconds = 1};
    REQUIRE_RC(kvdepot_sequence_create(c, &a, NULL), KVDEPOT_OK);
    kvdepot_close(c);
    REQUIRE_RC(harness_restart(h), 0);
    c = harness_client(h);
    REQUIRE(c);
    kvdepot_sequence_info info;
    int rc = KVDEPOT_OK;
    for (int i = 0; i < 40 && rc == KVDEPOT_OK; i++) {
        usleep(100000);
        rc = kvdepot_sequence_stat(c, "short", 5, &info);
        if (rc == KVDEPOT_OK)
            kvdepot_sequence_info_clear(&info);
    }
    CHECK_RC(rc, KVDEPOT_ENOTFOUND);
    /* Disk limit under spill: 2 MiB sequences, the third does not fit. */
    REQUIRE_RC(create_gen(c, 1), KVDEPOT_OK);
    REQUIRE_RC(create_gen(c, 2), KVDEPOT_OK);
    CHECK_RC(append_gen(c, 1, 0, 1024), KVDEPOT_OK);
    CHECK_RC(append_gen(c, 2, 0, 1024), KVDEPOT_ENOMEM);
    CHECK_RC(check_gen(c, 1, 0, LAYERS, 0, 1024), KVDEPOT_OK);
    kvdepot_stats st;
    CHECK_RC(kvdepot_stats_get(c, &st), KVDEPOT_OK);
    CHECK(st.tiers[2].bytes <= 4u << 20);
    /* Under none the least recently used sequence makes room instead. */
    static const char *const env2[] = {"KVDEPOT_DURABILITY", "none", NULL};
    kvdepot_close(c);
    REQUIRE(restart_with(h, env2) == 0);
    c = harness_client(h);
    REQUIRE(c);
    CHECK_RC(append_gen(c, 2, 0, 1024), KVDEPOT_OK);
    CHECK_RC(check_gen(c, 2, 0, LAYERS, 0, 1024), KVDEPOT_OK);
    char id[32];
    seq_name(id, sizeof id, 1);
    CHECK_RC(kvdepot_sequence_stat(c, id, strlen(id), &info), KVDEPOT_ENOTFOUND);
    CHECK_RC(kvdepot_stats_get(c, &st), KVDEPOT_OK);
    CHECK(st.sequences_dropped == 1);
    CHECK(strcmp(st.durability, "none") == 0);
    kvdepot_close(c);
    unset_env(env);
    unset_env(env2);
    return 0;
}

int main(int argc, char **argv)
{
    static const kvd_test tests[] = {
        {"working_set", test_working_set}, {"crash_sync", test_crash_sync},
        {"crash_spill", test_crash_spill}, {"crash_none", test_crash_none},
        {"corrupt", test_corrupt},         {"concurrent", test_concurrent},
        {"expiry", test_expiry},
    };
    return harness_main(argc, argv, tests, sizeof tests / sizeof tests[0]);
}
