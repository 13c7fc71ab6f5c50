/*
 * bench_tier: the store's tiers, in process (no gRPC), on the CPU backend.
 *
 *   - Read throughput when every page comes from the device tier, the host
 *     tier, or RocksDB (memory tiers off: pages read from RocksDB's files,
 *     which sit in the OS page cache after the first pass);
 *   - promotion latency per page (kvd_store_page_acquire + release): host ->
 *     device, and RocksDB -> device (load, checksum, insert);
 *   - Append throughput under durability none, spill and sync, for
 *     prefill-sized (256 tokens, all layers) and decode-sized (1 token)
 *     appends.
 *
 * Usage: bench_tier [DIR]   (DIR: scratch directory, default /tmp)
 * Prints one table; a benchmark, not a test.
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "store.h"

#define LAYERS 8
#define HEADS 8
#define DIM 128
#define B 256
#define ROW (HEADS * DIM * 2)
#define SEQ_TOKENS 2048 /* 8 pages per layer: 64 pages, 64 MiB of K+V */

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void die(const char *what, int rc, const kvd_error *e)
{
    fprintf(stderr, "bench_tier: %s: %s %s\n", what, kvd_strerror(rc), e ? e->msg : "");
    exit(1);
}

static char g_dir[512];
static int g_n;

static kvd_store *open_store(uint64_t dev, uint64_t host, int durability)
{
    char dir[600];
    snprintf(dir, sizeof dir, "%s/kvd-bench-tier-%d-%d", g_dir, (int)getpid(), g_n++);
    kvd_store_options o = {.data_dir = dir,
                           .device_tier_bytes = dev,
                           .host_tier_bytes = host,
                           .durability = durability,
                           .prefetch_pages = 4};
    kvd_store *st;
    kvd_error e;
    kvd_error_clear(&e);
    int rc = kvd_store_open(&o, &st, &e);
    if (rc)
        die("open", rc, &e);
    kvd_model_info m;
    memset(&m, 0, sizeof m);
    snprintf(m.name, sizeof m.name, "bench");
    m.num_layers = LAYERS;
    m.num_kv_heads = HEADS;
    m.num_q_heads = HEADS;
    m.head_dim = DIM;
    m.dtype = KVD_DTYPE_F16;
    if ((rc = kvd_model_validate(&m, &e)) || (rc = kvd_store_model_put(st, &m, 0, NULL, NULL, &e)))
        die("model", rc, &e);
    return st;
}

static void close_store(kvd_store *st)
{
    kvd_store_close(st);
    char cmd[700];
    snprintf(cmd, sizeof cmd, "rm -rf %s/kvd-bench-tier-%d-*", g_dir, (int)getpid());
    /* Removed at the end of each phase; the directories are scratch. */
    if (system(cmd) != 0)
        fprintf(stderr, "bench_tier: could not remove %s\n", cmd);
}

static uint8_t *g_data; /* K then V of one append of up to SEQ_TOKENS tokens, all layers */

static void append(kvd_store *st, const char *id, uint64_t t0, uint64_t n)
{
    kvd_append_spec sp = {.seq_id = id,
                          .seq_id_len = strlen(id),
                          .token_start = t0,
                          .num_tokens = n,
                          .dtype = KVD_DTYPE_F16};
    kvd_append *ap;
    uint64_t bytes;
    kvd_error e;
    kvd_error_clear(&e);
    int rc = kvd_store_append_begin(st, &sp, &ap, &bytes, &e);
    if (!rc)
        rc = kvd_store_append_write(ap, g_data, (size_t)bytes, &e);
    if (!rc)
        rc = kvd_store_append_commit(ap, NULL, &e);
    else
        kvd_store_append_abort(ap);
    if (rc)
        die("append", rc, &e);
}

static void create(kvd_store *st, const char *id)
{
    kvd_error e;
    kvd_error_clear(&e);
    int rc = kvd_store_seq_create(st, id, strlen(id), "bench", NULL, 0, NULL, 0, NULL, &e);
    if (rc)
        die("create", rc, &e);
}

/* Read a whole sequence `passes` times; returns GB/s of K+V produced. */
static double read_gbs(kvd_store *st, const char *id, int passes)
{
    static uint8_t *buf;
    size_t cap = 8u << 20;
    if (!buf && !(buf = malloc(cap)))
        exit(1);
    uint64_t total = 0;
    double t0 = now_s();
    for (int p = 0; p < passes; p++) {
        kvd_read_spec sp = {.seq_id = id, .seq_id_len = strlen(id)};
        kvd_read *rd;
        kvd_read_shape sh;
        kvd_error e;
        kvd_error_clear(&e);
        int rc = kvd_store_read_begin(st, &sp, &rd, &sh, &e);
        if (rc)
            die("read", rc, &e);
        size_t len;
        do {
            if ((rc = kvd_store_read_next(rd, buf, cap, &len, &e)))
                die("read next", rc, &e);
            total += len;
        } while (len);
        kvd_store_read_end(rd);
    }
    return (double)total / (now_s() - t0) / 1e9;
}

/* Mean microseconds of acquire + release over every page of a sequence. */
static double acquire_us(kvd_store *st, const char *id, int *tier_seen)
{
    uint32_t pages = SEQ_TOKENS / B;
    double t0 = now_s();
    for (uint32_t l = 0; l < LAYERS; l++)
        for (uint32_t j = 0; j < pages; j++) {
            kvd_page_handle h;
            kvd_error e;
            kvd_error_clear(&e);
            int rc = kvd_store_page_acquire(st, id, strlen(id), l, j, &h, &e);
            if (rc)
                die("acquire", rc, &e);
            *tier_seen = h.tier;
            kvd_store_page_release(st, &h);
        }
    return (now_s() - t0) * 1e6 / (LAYERS * pages);
}

int main(int argc, char **argv)
{
    snprintf(g_dir, sizeof g_dir, "%s", argc > 1 ? argv[1] : "/tmp");
    size_t bytes = (size_t)LAYERS * SEQ_TOKENS * ROW;
    g_data = malloc(2 * bytes);
    if (!g_data)
        return 1;
    for (size_t i = 0; i < 2 * bytes; i++)
        g_data[i] = (uint8_t)(i * 2654435761u >> 13);
    const uint64_t MiB = 1u << 20;
    double mb = 2.0 * bytes / 1e6;
    printf("bench_tier: %d layers x %d kv heads x %d dims, f16, %d-token pages (%.2f MiB "
           "each), sequence of %d tokens = %.0f MB of K+V\n\n",
           LAYERS, HEADS, DIM, B, 2.0 * B * ROW / MiB, SEQ_TOKENS, mb);
    printf("%-44s %14s\n", "measure", "value");

    /* Read from each tier. */
    struct {
        const char *name;
        uint64_t dev, host;
    } rt[] = {{"Read, pages in the device tier", 256 * MiB, 0},
              {"Read, pages in the host tier", 0, 256 * MiB},
              {"Read, pages in RocksDB (tiers off)", 0, 0}};
    for (int i = 0; i < 3; i++) {
        kvd_store *st = open_store(rt[i].dev, rt[i].host, KVD_DURABILITY_SPILL);
        create(st, "r");
        append(st, "r", 0, SEQ_TOKENS);
        read_gbs(st, "r", 1); /* warm: tiers filled, files in the page cache */
        printf("%-44s %9.2f GB/s\n", rt[i].name, read_gbs(st, "r", 8));
        close_store(st);
    }

    /* Promotion: host -> device, disk -> device. */
    {
        kvd_store *st = open_store(80 * MiB, 256 * MiB, KVD_DURABILITY_SPILL);
        create(st, "a");
        append(st, "a", 0, SEQ_TOKENS);
        create(st, "b");
        append(st, "b", 0, SEQ_TOKENS); /* pushes a's pages down to host */
        int tier = -1;
        double us = acquire_us(st, "a", &tier);
        printf("%-44s %9.1f us/page (%.2f GB/s)\n", "Promotion host -> device (acquire)", us,
               2.0 * B * ROW / us / 1e3);
        kvd_error e;
        kvd_error_clear(&e);
        kvd_store_seq_evict(st, "a", 1, NULL, NULL, &e);
        kvd_store_seq_evict(st, "b", 1, NULL, NULL, &e);
        us = acquire_us(st, "a", &tier);
        printf("%-44s %9.1f us/page (%.2f GB/s)\n", "Promotion RocksDB -> device (acquire)", us,
               2.0 * B * ROW / us / 1e3);
        us = acquire_us(st, "a", &tier);
        printf("%-44s %9.1f us/page\n", "Acquire, page already in the device tier", us);
        close_store(st);
    }

    /* Append under each durability setting. */
    static const char *dn[3] = {"spill", "none", "sync"};
    static const int order[3] = {KVD_DURABILITY_NONE, KVD_DURABILITY_SPILL, KVD_DURABILITY_SYNC};
    for (int k = 0; k < 3; k++) {
        int d = order[k];
        kvd_store *st = open_store(64 * MiB, 64 * MiB, d);
        create(st, "p");
        int n = 24;
        double t0 = now_s();
        for (int i = 0; i < n; i++)
            append(st, "p", (uint64_t)i * B, B);
        double dt = now_s() - t0;
        char label[80];
        snprintf(label, sizeof label, "Append %d tokens x all layers, %s", B, dn[d]);
        printf("%-44s %9.2f GB/s (%.0f appends/s)\n", label, n * 2.0 * B * ROW * LAYERS / dt / 1e9,
               n / dt);
        create(st, "d");
        int nd = d == KVD_DURABILITY_SYNC ? 200 : 2000;
        t0 = now_s();
        for (int i = 0; i < nd; i++)
            append(st, "d", (uint64_t)i, 1);
        dt = now_s() - t0;
        snprintf(label, sizeof label, "Append 1 token x all layers, %s", dn[d]);
        printf("%-44s %9.0f appends/s (%.0f us each)\n", label, nd / dt, dt / nd * 1e6);
        close_store(st);
    }
    free(g_data);
    return 0;
}
