/*
 * Unit tests of the store's memory tiers, in process: LRU movement between
 * the device and host tiers within their limits, pinning through
 * kvd_store_page_acquire, eviction, and 8 threads appending, reading and
 * acquiring while pages are evicted (the test the ThreadSanitizer pass of
 * deploy/dev.sh runs). Content is a function of (sequence, part, layer,
 * token), so readers check every byte they get. With KVD_TEST_DEVICE=cuda
 * the device tier lies in the memory of a CUDA backend (test_tier_cuda_emu:
 * the CPU emulation of one), where pages move by copies made with the
 * cache's lock released.
 */
#include <inttypes.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "page.h"
#include "store.h"
#include "store_internal.h" /* the device tier's slots */

static int failures;
#define CHECK(cond)                                                                                \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond);               \
            failures++;                                                                            \
        }                                                                                          \
    } while (0)

#define LAYERS 2
#define HEADS 2
#define DIM 32
#define PT 64                 /* page tokens */
#define ROW (HEADS * DIM * 2) /* bytes per token per layer, f16 */
#define PAGE_K (PT * ROW)     /* 8 KiB per part */

static uint64_t mix(uint64_t x)
{
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

static void gen_row(uint8_t *dst, uint32_t s, int part, uint32_t l, uint64_t t)
{
    uint64_t seed = mix(((uint64_t)s << 40) ^ ((uint64_t)part << 39) ^ ((uint64_t)l << 32) ^ t);
    for (size_t i = 0; i < ROW; i += 8) {
        uint64_t v = mix(seed + i);
        memcpy(dst + i, &v, 8);
    }
}

static void id_of(char *buf, uint32_t s)
{
    snprintf(buf, 16, "s%03u", s);
}

static int append_gen(kvd_store *st, uint32_t s, uint64_t t0, uint64_t n)
{
    size_t bytes = (size_t)LAYERS * n * ROW;
    uint8_t *kv = malloc(2 * bytes);
    if (!kv)
        return KVD_ENOMEM;
    for (uint32_t l = 0; l < LAYERS; l++)
        for (uint64_t t = 0; t < n; t++) {
            gen_row(kv + ((size_t)l * n + t) * ROW, s, 0, l, t0 + t);
            gen_row(kv + bytes + ((size_t)l * n + t) * ROW, s, 1, l, t0 + t);
        }
    char id[16];
    id_of(id, s);
    kvd_append_spec sp = {.seq_id = id,
                          .seq_id_len = strlen(id),
                          .token_start = t0,
                          .num_tokens = n,
                          .dtype = KVD_DTYPE_F16};
    kvd_append *ap;
    uint64_t want;
    kvd_error e;
    kvd_error_clear(&e);
    int rc = kvd_store_append_begin(st, &sp, &ap, &want, &e);
    if (!rc && want != 2 * bytes)
        rc = KVD_EINTERNAL;
    if (!rc && (rc = kvd_store_append_write(ap, kv, 2 * bytes, &e)) == 0)
        rc = kvd_store_append_commit(ap, NULL, &e);
    else if (ap)
        kvd_store_append_abort(ap);
    if (rc)
        fprintf(stderr, "append %s %" PRIu64 "+%" PRIu64 ": %s\n", id, t0, n, e.msg);
    free(kv);
    return rc;
}

/* Read all layers of tokens [t0, t0+n) and compare; 0, a store code, or
 * KVD_EINTERNAL for wrong bytes. */
static int check_gen(kvd_store *st, uint32_t s, uint64_t t0, uint64_t n)
{
    char id[16];
    id_of(id, s);
    kvd_read_spec sp = {.seq_id = id, .seq_id_len = strlen(id), .token_start = t0, .num_tokens = n};
    kvd_read *rd;
    kvd_read_shape sh;
    kvd_error e;
    kvd_error_clear(&e);
    int rc = kvd_store_read_begin(st, &sp, &rd, &sh, &e);
    if (rc)
        return rc;
    size_t bytes = (size_t)LAYERS * n * ROW;
    uint8_t *got = malloc(2 * bytes + 1), row[ROW];
    size_t have = 0, len;
    /* Odd-sized chunks so segments straddle calls. */
    while (got &&
           (rc = kvd_store_read_next(rd, got + have,
                                     2 * bytes + 1 - have > 777 ? 777 : 2 * bytes + 1 - have, &len,
                                     &e)) == 0 &&
           len)
        have += len;
    kvd_store_read_end(rd);
    if (!got)
        return KVD_ENOMEM;
    if (!rc && have != 2 * bytes)
        rc = KVD_EINTERNAL;
    for (int part = 0; part < 2 && !rc; part++)
        for (uint32_t l = 0; l < LAYERS && !rc; l++)
            for (uint64_t t = 0; t < n && !rc; t++) {
                gen_row(row, s, part, l, t0 + t);
                if (memcmp(row, got + (size_t)part * bytes + ((size_t)l * n + t) * ROW, ROW)) {
                    fprintf(stderr, "%s: wrong bytes at part %d layer %u token %" PRIu64 "\n", id,
                            part, l, t0 + t);
                    rc = KVD_EINTERNAL;
                }
            }
    free(got);
    return rc;
}

/* An acquired page holds exactly the generated rows of its block. */
static int check_page(const kvd_page_handle *h, uint32_t s, uint32_t l, uint64_t block)
{
    kvd_page_view v;
    kvd_error e;
    kvd_error_clear(&e);
    if (kvd_page_decode(h->bytes, h->len, &v, &e))
        return KVD_ECORRUPT;
    uint8_t row[ROW];
    uint32_t n = v.h.num_tokens;
    if (v.h.layer != l || v.h.token_start != block * PT)
        return KVD_EINTERNAL;
    for (uint32_t t = 0; t < n; t++)
        for (uint32_t hh = 0; hh < HEADS; hh++)
            for (int part = 0; part < 2; part++) {
                gen_row(row, s, part, l, block * PT + t);
                const uint8_t *sec = part ? v.v : v.k;
                if (memcmp(row + hh * DIM * 2, sec + ((size_t)hh * n + t) * DIM * 2, DIM * 2))
                    return KVD_EINTERNAL;
            }
    return 0;
}

static kvd_backend *device; /* KVD_TEST_DEVICE=cuda */

static kvd_store *open_store(const char *dir, uint64_t dev, uint64_t host)
{
    kvd_store_options o = {.data_dir = dir,
                           .page_tokens = PT,
                           .device_tier_bytes = dev,
                           .host_tier_bytes = host,
                           .prefetch_pages = 2,
                           .device = device};
    kvd_store *st = NULL;
    kvd_error e;
    kvd_error_clear(&e);
    if (kvd_store_open(&o, &st, &e)) {
        fprintf(stderr, "open: %s\n", e.msg);
        return NULL;
    }
    kvd_model_info m;
    memset(&m, 0, sizeof m);
    snprintf(m.name, sizeof m.name, "t");
    m.num_layers = LAYERS;
    m.num_kv_heads = HEADS;
    m.head_dim = DIM;
    m.dtype = KVD_DTYPE_F16;
    if (kvd_model_validate(&m, &e) || kvd_store_model_put(st, &m, 0, NULL, NULL, &e)) {
        fprintf(stderr, "model: %s\n", e.msg);
        kvd_store_close(st);
        return NULL;
    }
    return st;
}

static int create(kvd_store *st, uint32_t s)
{
    char id[16];
    id_of(id, s);
    return kvd_store_seq_create(st, id, strlen(id), "t", NULL, 0, NULL, 0, NULL, NULL);
}

/* ---- LRU, limits, pinning ------------------------------------------------ */

/* Wait until the read-ahead of Read cursors has settled: its counter stops
 * moving for 200 ms (bounded at 30 s). */
static void settle_prefetch(kvd_store *st)
{
    kvd_store_stats s;
    kvd_store_stats_get(st, &s);
    for (int i = 0; i < 150; i++) {
        uint64_t last = s.prefetched;
        usleep(200000);
        kvd_store_stats_get(st, &s);
        if (s.prefetched == last)
            break;
    }
}

static void test_lru(const char *dir)
{
    /* A full page is 2 * 8 KiB + header: the device tier takes 4, the host 4. */
    kvd_store *st = open_store(dir, 4 * (2 * PAGE_K + 256), 4 * (2 * PAGE_K + 4096));
    CHECK(st);
    if (!st)
        return;
    CHECK(create(st, 0) == 0);
    CHECK(append_gen(st, 0, 0, 16 * PT) == 0); /* 32 pages */
    kvd_store_stats s;
    kvd_store_stats_get(st, &s);
    CHECK(s.tier_pages[KVD_TIER_DEVICE] == 4 && s.tier_pages[KVD_TIER_HOST] == 4);
    CHECK(s.tier_bytes[KVD_TIER_DEVICE] <= s.tier_limit[KVD_TIER_DEVICE]);
    CHECK(s.tier_bytes[KVD_TIER_HOST] <= s.tier_limit[KVD_TIER_HOST]);
    CHECK(s.tier_pages[KVD_TIER_DISK] == 32);
    /* One append's pages enter the tiers together: those that fit stay,
     * none goes up only to be moved down again. */
    CHECK(s.evictions[0] == 0 && s.evictions[1] == 0);

    /* The last pages written are in the device tier, the ones before on host,
     * the first ones only on disk. */
    kvd_page_handle h[6];
    kvd_error e;
    kvd_error_clear(&e);
    CHECK(kvd_store_page_acquire(st, "s000", 4, 1, 15, &h[0], &e) == 0);
    CHECK(h[0].tier == KVD_TIER_DEVICE && h[0].device);
    CHECK(kvd_store_page_acquire(st, "s000", 4, 1, 10, &h[1], &e) == 0);
    CHECK(h[1].tier == KVD_TIER_HOST);
    CHECK(kvd_store_page_acquire(st, "s000", 4, 0, 0, &h[2], &e) == 0);
    CHECK(h[2].tier == KVD_TIER_DISK);
    CHECK(check_page(&h[0], 0, 1, 15) == 0 && check_page(&h[1], 0, 1, 10) == 0 &&
          check_page(&h[2], 0, 0, 0) == 0);
    /* Each is read where it lies in its tier, the one read from disk too
     * (it had room), unless that is a device tier the host cannot read
     * (then it came down as a copy of its own). */
    for (int i = 0; i < 3; i++)
        CHECK(kvd_store_page_in_tier(&h[i]) == (!h[i].device || h[i].bytes == h[i].device));
    /* Pinned pages survive a storm of promotions. */
    CHECK(check_gen(st, 0, 0, 16 * PT) == 0);
    CHECK(check_page(&h[0], 0, 1, 15) == 0 && check_page(&h[1], 0, 1, 10) == 0 &&
          check_page(&h[2], 0, 0, 0) == 0);
    kvd_store_stats_get(st, &s);
    CHECK(s.tier_bytes[KVD_TIER_DEVICE] <= s.tier_limit[KVD_TIER_DEVICE]);
    CHECK(s.promotions > 0 && s.misses > 0);
    /* Out of range, unknown sequence. */
    CHECK(kvd_store_page_acquire(st, "s000", 4, 1, 16, &h[3], &e) == KVD_ERANGE);
    CHECK(kvd_store_page_acquire(st, "nope", 4, 0, 0, &h[3], &e) == KVD_ENOTFOUND);
    for (int i = 0; i < 3; i++)
        kvd_store_page_release(st, &h[i]);
    kvd_store_page_release(st, &h[0]); /* released twice: no-op */

    /* Evict: nothing of the sequence left in memory; still readable. The
     * read-ahead the reads above started settles first: a page it loads
     * after the evict would enter the tiers again. */
    settle_prefetch(st);
    uint64_t pages = 0, bytes = 0;
    CHECK(kvd_store_seq_evict(st, "s000", 4, &pages, &bytes, &e) == 0);
    CHECK(pages > 0 && bytes > 0);
    kvd_store_stats_get(st, &s);
    CHECK(s.tier_pages[KVD_TIER_DEVICE] == 0 && s.tier_pages[KVD_TIER_HOST] == 0);
    CHECK(check_gen(st, 0, 100, 500) == 0);
    /* Prefetch for an acquirer: the pages arrive in memory by themselves.
     * First let read-ahead started by the read above settle, so that after
     * the evict the only prefetches counted are the ones asked for here. */
    settle_prefetch(st);
    CHECK(kvd_store_seq_evict(st, "s000", 4, NULL, NULL, &e) == 0);
    kvd_store_stats_get(st, &s);
    uint64_t before = s.prefetched;
    CHECK(kvd_store_page_prefetch(st, "s000", 4, 0, 2, 3, &e) == 0);
    /* Bounded wait (30 s) for the prefetch thread, generous for loaded CI
     * machines. */
    for (int i = 0; i < 6000 && s.prefetched < before + 3; i++) {
        usleep(5000);
        kvd_store_stats_get(st, &s);
    }
    CHECK(s.prefetched == before + 3);
    CHECK(kvd_store_page_acquire(st, "s000", 4, 0, 3, &h[5], &e) == 0);
    CHECK(h[5].tier == KVD_TIER_DEVICE && check_page(&h[5], 0, 0, 3) == 0);
    kvd_store_page_release(st, &h[5]);
    CHECK(kvd_store_page_prefetch(st, "nope", 4, 0, 0, 1, &e) == KVD_ENOTFOUND);
    CHECK(kvd_store_page_prefetch(st, "s000", 4, LAYERS, 0, 1, &e) == KVD_EINVAL);
    /* A partial tail page held in fragments is acquirable too. */
    CHECK(append_gen(st, 0, 16 * PT, 3) == 0);
    CHECK(append_gen(st, 0, 16 * PT + 3, 5) == 0);
    CHECK(kvd_store_page_acquire(st, "s000", 4, 1, 16, &h[4], &e) == 0);
    CHECK(check_page(&h[4], 0, 1, 16) == 0);
    CHECK(!kvd_store_page_in_tier(&h[4])); /* assembled for this handle */
    kvd_store_page_release(st, &h[4]);
    CHECK(!kvd_store_page_in_tier(&h[4])); /* released: zeroed */
    /* Delete drops every tier's copy. */
    CHECK(kvd_store_seq_delete(st, "s000", 4, NULL, &e) == 0);
    kvd_store_stats_get(st, &s);
    CHECK(s.tier_pages[0] == 0 && s.tier_pages[1] == 0 && s.tier_pages[2] == 0);
    CHECK(s.tier_bytes[2] == 0);
    kvd_store_close(st);
}

/* ---- acquiring pages in batches ------------------------------------------- */

/* Acquire pages [block, block + n) of layer l of s000 in one batch (need:
 * KVD_ON_DEVICE_* flags): each holds its rows, and its tier is `tier` (-1:
 * any). The handles stay held. */
static void batch_check(kvd_store *st, uint32_t l, uint64_t block, size_t n, int need, int tier,
                        kvd_page_handle *hs)
{
    kvd_error e;
    kvd_error_clear(&e);
    int rc = kvd_store_pages_acquire_device(st, "s000", 4, l, block, n, need, hs, &e);
    CHECK(rc == 0);
    if (rc) {
        fprintf(stderr, "batch layer %u [%" PRIu64 ", +%zu): %s\n", l, block, n, e.msg);
        return;
    }
    for (size_t i = 0; i < n; i++) {
        CHECK(tier < 0 || hs[i].tier == tier);
        /* In place on a device the host does not read: no host bytes. */
        if (hs[i].layout)
            CHECK(device && need && hs[i].device && !hs[i].bytes);
        else
            CHECK(check_page(&hs[i], 0, l, block + i) == 0);
    }
}

static void test_batch(const char *dir)
{
    /* Device tier: 8 full pages. Host tier: 4, whether pages are charged by
     * mapping (20 KiB each) or by 64-byte granule in a pinned block. */
    kvd_store *st = open_store(dir, 8 * (2 * PAGE_K + 256), 4 * (2 * PAGE_K + 4096) + 100);
    CHECK(st);
    if (!st)
        return;
    CHECK(create(st, 0) == 0);
    CHECK(append_gen(st, 0, 0, 16 * PT) == 0); /* 16 pages a layer, layer 0's first */
    kvd_store_stats s0, s;
    kvd_store_stats_get(st, &s0);
    CHECK(s0.tier_pages[KVD_TIER_DEVICE] == 8 && s0.tier_pages[KVD_TIER_HOST] == 4);
    kvd_page_handle a[8], b[8];

    /* Layer 1's pages 4..7 lie in the host tier: one batch moves them up. */
    batch_check(st, 1, 4, 4, 0, KVD_TIER_HOST, a);
    for (int i = 0; i < 4; i++)
        CHECK(a[i].device != NULL);
    kvd_store_stats_get(st, &s);
    CHECK(s.promotions == s0.promotions + 4 && s.hits[1] == s0.hits[1] + 4);
    CHECK(s.tier_pages[KVD_TIER_DEVICE] == 8);
    for (int i = 0; i < 4; i++)
        kvd_store_page_release(st, &a[i]);

    /* Layer 0's first pages are only on disk. */
    batch_check(st, 0, 0, 4, 0, KVD_TIER_DISK, a);
    kvd_store_stats_get(st, &s0);
    CHECK(s0.misses == s.misses + 4);
    for (int i = 0; i < 4; i++)
        kvd_store_page_release(st, &a[i]);

    /* Eight pages held fill the device tier: a batch that finds no room
     * there is served from the host tier or a private copy, every byte
     * right, and the held pages stay put. */
    batch_check(st, 1, 8, 8, KVD_ON_DEVICE_ATTEND, -1, a);
    for (int i = 0; i < 8; i++)
        CHECK(a[i].device != NULL);
    batch_check(st, 0, 8, 3, 0, -1, b);
    for (int i = 0; i < 3; i++)
        CHECK(b[i].device == NULL);
    for (int i = 0; i < 8; i++)
        if (!a[i].layout)
            CHECK(check_page(&a[i], 0, 1, 8 + (uint64_t)i) == 0);
    for (int i = 0; i < 3; i++)
        kvd_store_page_release(st, &b[i]);
    for (int i = 0; i < 8; i++)
        kvd_store_page_release(st, &a[i]);
    kvd_store_stats_get(st, &s);
    CHECK(s.tier_bytes[KVD_TIER_DEVICE] <= s.tier_limit[KVD_TIER_DEVICE]);
    CHECK(s.tier_bytes[KVD_TIER_HOST] <= s.tier_limit[KVD_TIER_HOST]);

    /* Past the end, unknown: an error, and no handle held. */
    kvd_error e;
    kvd_error_clear(&e);
    memset(b, 0x5a, sizeof b);
    CHECK(kvd_store_pages_acquire_device(st, "s000", 4, 1, 14, 3, 0, b, &e) == KVD_ERANGE);
    CHECK(strstr(e.msg, "no page 16 on layer 1") != NULL);
    CHECK(b[0].priv_ == NULL && b[2].bytes == NULL);
    CHECK(kvd_store_pages_acquire_device(st, "nope", 4, 0, 0, 1, 0, b, &e) == KVD_ENOTFOUND);
    CHECK(kvd_store_pages_acquire_device(st, "s000", 4, LAYERS, 0, 1, 0, b, &e) == KVD_ERANGE);
    CHECK(kvd_store_pages_acquire_device(st, "s000", 4, 0, 0, 0, 0, b, &e) == 0);
    kvd_store_close(st);
}

/* ---- 8 threads with eviction ------------------------------------------------ */

#define NSEQ 8
#define MAXTOK (12 * PT)

typedef struct ctx {
    kvd_store *st;
    _Atomic uint64_t tokens[NSEQ];
    _Atomic int writers_left;
    _Atomic uint64_t reads, acquires, wrong, errors;
} ctx;

typedef struct targ {
    ctx *c;
    int i;
} targ;

static void *writer(void *p)
{
    targ *a = p;
    ctx *c = a->c;
    uint64_t rnd = mix((uint64_t)a->i + 7);
    for (int k = 0; k < 2; k++) {
        uint32_t s = (uint32_t)(a->i * 2 + k);
        while (atomic_load(&c->tokens[s]) < MAXTOK) {
            rnd = mix(rnd);
            uint64_t t0 = atomic_load(&c->tokens[s]);
            uint64_t n = 1 + rnd % (2 * PT);
            if (t0 + n > MAXTOK)
                n = MAXTOK - t0;
            if (append_gen(c->st, s, t0, n)) {
                atomic_fetch_add(&c->errors, 1);
                break;
            }
            atomic_store(&c->tokens[s], t0 + n);
        }
    }
    atomic_fetch_sub(&c->writers_left, 1);
    return NULL;
}

static void *reader(void *p)
{
    targ *a = p;
    ctx *c = a->c;
    uint64_t rnd = mix((uint64_t)a->i + 1000);
    int rounds = 0;
    while (atomic_load(&c->writers_left) > 0 || rounds < 20) {
        rounds++;
        rnd = mix(rnd);
        uint32_t s = (uint32_t)(rnd % NSEQ);
        uint64_t n = atomic_load(&c->tokens[s]);
        if (!n)
            continue;
        if (a->i % 2) {
            uint64_t t0 = (rnd >> 8) % n, len = 1 + (rnd >> 24) % (n - t0);
            int rc = check_gen(c->st, s, t0, len);
            if (rc == KVD_EINTERNAL)
                atomic_fetch_add(&c->wrong, 1);
            else if (rc) {
                fprintf(stderr, "read s%u %" PRIu64 "+%" PRIu64 ": %s\n", s, t0, len,
                        kvd_strerror(rc));
                atomic_fetch_add(&c->errors, 1);
            }
            atomic_fetch_add(&c->reads, 1);
        } else {
            char id[16];
            id_of(id, s);
            uint64_t block = (rnd >> 8) % ((n + PT - 1) / PT);
            uint32_t l = (uint32_t)((rnd >> 40) % LAYERS);
            kvd_error e;
            kvd_error_clear(&e);
            /* One page, or up to three in one batch. */
            kvd_page_handle hs[3];
            size_t nb = 1 + (rnd >> 44) % 3;
            if (block + nb > (n + PT - 1) / PT)
                nb = (size_t)((n + PT - 1) / PT - block);
            int rc = (rnd >> 46) % 2
                         ? kvd_store_page_acquire(c->st, id, strlen(id), l, block, &hs[0], &e)
                         : kvd_store_pages_acquire_device(c->st, id, strlen(id), l, block, nb, 0,
                                                          hs, &e);
            if ((rnd >> 46) % 2)
                nb = 1;
            if (rc == 0) {
                for (size_t j = 0; j < nb; j++) {
                    if (check_page(&hs[j], s, l, block + j))
                        atomic_fetch_add(&c->wrong, 1);
                    kvd_store_page_release(c->st, &hs[j]);
                }
            } else {
                fprintf(stderr, "acquire %s layer %u block %" PRIu64 ": %s\n", id, l, block, e.msg);
                atomic_fetch_add(&c->errors, 1);
            }
            if ((rnd >> 50) % 16 == 0)
                kvd_store_seq_evict(c->st, id, strlen(id), NULL, NULL, &e);
            atomic_fetch_add(&c->acquires, 1);
        }
    }
    return NULL;
}

static void test_threads(const char *dir)
{
    kvd_store *st = open_store(dir, 6 * (2 * PAGE_K + 256), 6 * (2 * PAGE_K + 4096));
    CHECK(st);
    if (!st)
        return;
    ctx c = {.st = st};
    for (uint32_t s = 0; s < NSEQ; s++)
        CHECK(create(st, s) == 0);
    atomic_store(&c.writers_left, 4);
    pthread_t t[8];
    targ a[8];
    for (int i = 0; i < 8; i++) {
        a[i] = (targ){&c, i % 4};
        CHECK(pthread_create(&t[i], NULL, i < 4 ? writer : reader, &a[i]) == 0);
    }
    for (int i = 0; i < 8; i++)
        pthread_join(t[i], NULL);
    kvd_store_stats s;
    kvd_store_stats_get(st, &s);
    printf("threads: %" PRIu64 " reads, %" PRIu64 " acquires, %" PRIu64 " wrong, %" PRIu64
           " errors; evictions %" PRIu64 "/%" PRIu64 ", promotions %" PRIu64 "\n",
           atomic_load(&c.reads), atomic_load(&c.acquires), atomic_load(&c.wrong),
           atomic_load(&c.errors), s.evictions[0], s.evictions[1], s.promotions);
    CHECK(atomic_load(&c.wrong) == 0 && atomic_load(&c.errors) == 0);
    CHECK(s.evictions[0] > 0 && s.evictions[1] > 0);
    CHECK(s.tier_bytes[0] <= s.tier_limit[0] && s.tier_bytes[1] <= s.tier_limit[1]);
    for (uint32_t i = 0; i < NSEQ; i++)
        CHECK(check_gen(st, i, 0, MAXTOK) == 0);
    kvd_store_close(st);
    /* Reopened: page tables rebuilt, tiers empty, every byte there. */
    st = open_store(dir, 6 * (2 * PAGE_K + 256), 0);
    CHECK(st);
    if (!st)
        return;
    kvd_store_stats_get(st, &s);
    CHECK(s.tier_pages[0] == 0 && s.sequences == NSEQ);
    CHECK(s.tier_pages[KVD_TIER_DISK] == (uint64_t)NSEQ * LAYERS * (MAXTOK / PT));
    for (uint32_t i = 0; i < NSEQ; i++)
        CHECK(check_gen(st, i, 0, MAXTOK) == 0);
    kvd_store_close(st);
}

/* ---- deletes racing acquires ---------------------------------------------- */

typedef struct storm {
    kvd_store *st;
    _Atomic int stop;
    _Atomic uint64_t cycles, batches, wrong, errors;
} storm;

typedef struct sarg {
    storm *g;
    int i;
} sarg;

/* Sequence 100 + i is created, filled with 8 pages a layer, moved out of
 * memory and deleted, over and over. */
static void *storm_cycle(void *p)
{
    sarg *a = p;
    const uint32_t s = 100 + (uint32_t)a->i;
    char id[16];
    id_of(id, s);
    kvd_error e;
    while (!atomic_load(&a->g->stop)) {
        if (create(a->g->st, s) || append_gen(a->g->st, s, 0, 8 * PT)) {
            atomic_fetch_add(&a->g->errors, 1);
            break;
        }
        if (kvd_store_seq_evict(a->g->st, id, strlen(id), NULL, NULL, &e) ||
            kvd_store_seq_delete(a->g->st, id, strlen(id), NULL, &e)) {
            atomic_fetch_add(&a->g->errors, 1);
            break;
        }
        atomic_fetch_add(&a->g->cycles, 1);
    }
    return NULL;
}

/* Batches of pages of whichever of those sequences exist: not found is
 * expected, a page that is there holds its rows. */
static void *storm_reader(void *p)
{
    sarg *a = p;
    uint64_t rnd = mix((uint64_t)a->i + 77);
    while (!atomic_load(&a->g->stop)) {
        rnd = mix(rnd);
        const uint32_t s = 100 + (uint32_t)(rnd % 4), l = (uint32_t)((rnd >> 8) % LAYERS);
        const uint64_t block = (rnd >> 16) % 6;
        char id[16];
        id_of(id, s);
        kvd_page_handle hs[3];
        kvd_error e;
        int rc = kvd_store_pages_acquire_device(a->g->st, id, strlen(id), l, block, 3, 0, hs, &e);
        if (rc == 0) {
            for (int j = 0; j < 3; j++) {
                if (check_page(&hs[j], s, l, block + (uint64_t)j))
                    atomic_fetch_add(&a->g->wrong, 1);
                kvd_store_page_release(a->g->st, &hs[j]);
            }
            atomic_fetch_add(&a->g->batches, 1);
        } else if (rc != KVD_ENOTFOUND && rc != KVD_ERANGE) {
            fprintf(stderr, "storm acquire %s: %s\n", id, e.msg);
            atomic_fetch_add(&a->g->errors, 1);
        }
    }
    return NULL;
}

/* Sequences created, filled, brought back from RocksDB by batches of
 * acquires and deleted while those run, for about two seconds: no wrong
 * byte, no error but not-found, and once all is deleted the memory tiers
 * hold nothing and account for nothing. */
static void test_storm(const char *dir)
{
    kvd_store *st = open_store(dir, 6 * (2 * PAGE_K + 256), 6 * (2 * PAGE_K + 4096));
    CHECK(st);
    if (!st)
        return;
    storm g = {.st = st};
    pthread_t t[6];
    sarg a[6];
    for (int i = 0; i < 6; i++) {
        a[i] = (sarg){&g, i % 4};
        CHECK(pthread_create(&t[i], NULL, i < 4 ? storm_cycle : storm_reader, &a[i]) == 0);
    }
    usleep(2000000);
    atomic_store(&g.stop, 1);
    for (int i = 0; i < 6; i++)
        pthread_join(t[i], NULL);
    kvd_store_stats s;
    kvd_store_stats_get(st, &s);
    printf("storm: %" PRIu64 " create/fill/delete cycles, %" PRIu64 " batches read, %" PRIu64
           " wrong, %" PRIu64 " errors; tiers %" PRIu64 "/%" PRIu64 " pages, %" PRIu64 "/%" PRIu64
           " bytes\n",
           atomic_load(&g.cycles), atomic_load(&g.batches), atomic_load(&g.wrong),
           atomic_load(&g.errors), s.tier_pages[0], s.tier_pages[1], s.tier_bytes[0],
           s.tier_bytes[1]);
    CHECK(atomic_load(&g.wrong) == 0 && atomic_load(&g.errors) == 0);
    CHECK(atomic_load(&g.cycles) > 0);
    /* whatever the last cycles left: delete it, then nothing is held */
    kvd_error e;
    for (uint32_t i = 100; i < 104; i++) {
        char id[16];
        id_of(id, i);
        int rc = kvd_store_seq_delete(st, id, strlen(id), NULL, &e);
        CHECK(rc == 0 || rc == KVD_ENOTFOUND);
    }
    kvd_store_stats_get(st, &s);
    CHECK(s.tier_pages[0] == 0 && s.tier_pages[1] == 0);
    CHECK(s.tier_bytes[0] == 0 && s.tier_bytes[1] == 0);
    kvd_store_close(st);
}

/* Ranges of the device tier held for pages written there (an append coded
 * on the device puts its pages where they stay): charged while held, given
 * back whole, taken by the insert without a copy, given back by it when the
 * device is gone by then. A pool in host memory (no device) holds none. */
static void test_slots(const char *dir)
{
    kvd_page_desc d = {.dtype = KVD_DTYPE_F16,
                       .layer = 0,
                       .token_start = 0,
                       .num_tokens = PT,
                       .page_tokens = PT,
                       .num_kv_heads = HEADS,
                       .head_dim = DIM};
    uint8_t *k = malloc(PAGE_K), *v = malloc(PAGE_K), *page = NULL;
    size_t len = 0;
    kvd_error e;
    for (size_t i = 0; k && v && i < PAGE_K; i++) {
        k[i] = (uint8_t)mix(i);
        v[i] = (uint8_t)mix(i + PAGE_K);
    }
    CHECK(k && v && kvd_page_encode_raw(&d, k, v, &page, &len, &e) == 0);
    free(k);
    free(v);
    kvd_store *st = page ? open_store(dir, 4 * len + 100, 4 * len + 4 * 4096) : NULL;
    CHECK(!page || st);
    if (!st) {
        free(page);
        return;
    }
    kvd__slot sl[5];
    kvd_store_stats s;
    int rc = kvd__cache_reserve(st, len, &sl[0]);
    if (!device) {
        CHECK(rc == -1 && sl[0].alloc == 0 && sl[0].data == NULL);
        kvd_store_close(st);
        free(page);
        return;
    }
    CHECK(rc == 0 && sl[0].alloc >= len && sl[0].data != NULL);
    for (int i = 1; i < 4; i++)
        CHECK(kvd__cache_reserve(st, len, &sl[i]) == 0);
    CHECK(kvd__cache_reserve(st, len, &sl[4]) == -1 && sl[4].alloc == 0); /* full */
    kvd_store_stats_get(st, &s);
    CHECK(s.tier_bytes[KVD_TIER_DEVICE] == 4 * sl[0].alloc && s.tier_pages[KVD_TIER_DEVICE] == 0);
    kvd__cache_unreserve(st, &sl[3]);
    CHECK(sl[3].alloc == 0);
    kvd_store_stats_get(st, &s);
    CHECK(s.tier_bytes[KVD_TIER_DEVICE] == 3 * sl[0].alloc);

    /* Written into sl[0], the page enters the tier there. */
    CHECK(kvd_backend_upload(device, sl[0].data, page, len, &e) == 0);
    kvd__cache_put put = {.id = 1001, .page = page, .len = len, .num_tokens = PT, .slot = sl[0]};
    kvd__cache_insert_batch(st, &put, 1, 0, NULL);
    kvd_store_stats_get(st, &s);
    CHECK(s.device_pages_placed == 1 && s.tier_pages[KVD_TIER_DEVICE] == 1);
    CHECK(s.tier_bytes[KVD_TIER_DEVICE] == 3 * sl[0].alloc);
    const uint8_t *bytes = NULL;
    uint8_t *tmp = NULL;
    kvd__centry *ce = kvd__cache_acquire(st, 1001, PT, &bytes, &tmp);
    CHECK(ce && bytes && memcmp(bytes, page, len) == 0);
    free(tmp);
    kvd__cache_release(st, ce);
    /* Cached already with as many tokens: the slot is given back. */
    put.slot = sl[1];
    kvd__cache_insert_batch(st, &put, 1, 0, NULL);
    kvd_store_stats_get(st, &s);
    CHECK(s.device_pages_placed == 1 && s.tier_pages[KVD_TIER_DEVICE] == 1);
    CHECK(s.tier_bytes[KVD_TIER_DEVICE] == 2 * sl[0].alloc);

    /* The device gone, a page with a slot goes to the host tier and the
     * slot back: nothing is left charged to the device tier. */
    kvd_store_device_lost(st);
    put = (kvd__cache_put){.id = 1002, .page = page, .len = len, .num_tokens = PT, .slot = sl[2]};
    kvd__cache_insert_batch(st, &put, 1, 0, NULL);
    kvd_store_stats_get(st, &s);
    CHECK(s.device_pages_placed == 1 && s.tier_pages[KVD_TIER_DEVICE] == 0);
    CHECK(s.tier_bytes[KVD_TIER_DEVICE] == 0 && s.tier_pages[KVD_TIER_HOST] == 1);
    kvd_store_close(st);
    free(page);
}

/* Pages of the pool [from, to) (whole pages inside): how many are resident
 * and how many are not, in *absent; -1 when mincore fails. */
static long pool_resident(kvd_store *st, uint64_t from, uint64_t to, long *absent)
{
    const uintptr_t pg = (uintptr_t)sysconf(_SC_PAGESIZE);
    const uintptr_t a = ((uintptr_t)st->tiers.dpool.base + from + pg - 1) & ~(pg - 1);
    const uintptr_t b = ((uintptr_t)st->tiers.dpool.base + to) & ~(pg - 1);
    *absent = 0;
    if (b <= a)
        return 0;
    unsigned char *vec = malloc((b - a) / pg);
    if (!vec || mincore((void *)a, b - a, vec) != 0) {
        free(vec);
        return -1;
    }
    long in = 0;
    for (size_t i = 0; i < (b - a) / pg; i++) {
        in += vec[i] & 1;
        *absent += !(vec[i] & 1);
    }
    free(vec);
    return in;
}

/* Wait (up to 20 s) until the pool's [from, to) is resident: the pages
 * still absent then. */
static long pool_wait_resident(kvd_store *st, uint64_t from, uint64_t to)
{
    long absent = 0;
    for (int i = 0; i < 2000; i++) {
        if (pool_resident(st, from, to, &absent) < 0)
            return -1;
        if (!absent)
            break;
        usleep(10000);
    }
    return absent;
}

/* The CPU's device tier is mapped ahead of what it holds, never further
 * than 32 MiB past the furthest page it gave out: at open, the first 32 MiB
 * of a 48 MiB tier and nothing of its last 12; after pages filled 20 MiB of
 * it, all of it (20 + 32 > 48). The pages read back as written. */
static void test_prefault(const char *dir)
{
    const uint64_t MiB = 1u << 20, size = 48 * MiB;
    kvd_store *st = open_store(dir, size, 0);
    CHECK(st);
    if (!st)
        return;
    if (!st->tiers.pool_host) { /* a device's memory: mapped by its driver */
        kvd_store_close(st);
        return;
    }
    CHECK(pool_wait_resident(st, 0, 32 * MiB) == 0);
    usleep(100000); /* time to go further than it should */
    long absent;
    CHECK(pool_resident(st, 36 * MiB, size, &absent) == 0 && absent > 0);
    /* 2 x 2 x 20480 tokens x 128 bytes = 10 MiB a sequence */
    CHECK(create(st, 0) == 0 && create(st, 1) == 0);
    CHECK(append_gen(st, 0, 0, 20480) == 0 && append_gen(st, 1, 0, 20480) == 0);
    kvd_store_stats s;
    kvd_store_stats_get(st, &s);
    CHECK(s.tier_bytes[KVD_TIER_DEVICE] >= 20 * MiB);
    CHECK(pool_wait_resident(st, 0, size) == 0);
    for (uint32_t q = 0; q < 2; q++)
        CHECK(check_gen(st, q, 0, 20480) == 0);
    kvd_store_close(st);
}

/* The store's memory beside its tiers: an append's buffer is counted from
 * its first bytes until it commits or aborts; the memtables hold what was
 * committed. */
static void test_memory(const char *dir)
{
    kvd_store *st = open_store(dir, 0, 0);
    CHECK(st);
    if (!st)
        return;
    CHECK(create(st, 0) == 0 && create(st, 1) == 0);
    kvd_store_stats s;
    kvd_store_stats_get(st, &s);
    CHECK(s.mem_appends == 0 && s.mem_block_cache <= 64u << 20);
    const uint64_t n = 4 * PT, bytes = 2ull * LAYERS * n * ROW;
    uint8_t *kv = calloc(1, bytes);
    kvd_append *ap[2] = {NULL, NULL};
    kvd_error e;
    for (uint32_t i = 0; i < 2 && kv; i++) {
        char id[16];
        id_of(id, i);
        kvd_append_spec sp = {.seq_id = id,
                              .seq_id_len = strlen(id),
                              .token_start = 0,
                              .num_tokens = n,
                              .dtype = KVD_DTYPE_F16};
        uint64_t want = 0;
        CHECK(kvd_store_append_begin(st, &sp, &ap[i], &want, &e) == 0 && want == bytes);
        CHECK(ap[i] && kvd_store_append_write(ap[i], kv, bytes / 2, &e) == 0);
    }
    kvd_store_stats_get(st, &s);
    CHECK(s.mem_appends == 2 * bytes); /* each buffer sized to its append */
    if (ap[0])
        CHECK(kvd_store_append_write(ap[0], kv, bytes / 2, &e) == 0 &&
              kvd_store_append_commit(ap[0], NULL, &e) == 0);
    kvd_store_stats_get(st, &s);
    CHECK(s.mem_appends == bytes && s.mem_memtables >= bytes / 2);
    if (ap[1])
        kvd_store_append_abort(ap[1]);
    kvd_store_stats_get(st, &s);
    CHECK(s.mem_appends == 0);
    kvd_store_close(st);

    /* Capped at one append's buffer: a second append in flight is refused
     * when its bytes arrive, with nothing charged; once the first commits,
     * it goes through. */
    kvd_store_options o = {.data_dir = dir, .page_tokens = PT, .append_memory_bytes = bytes};
    st = NULL;
    CHECK(kvd_store_open(&o, &st, &e) == 0);
    for (uint32_t i = 0; st && kv && i < 2; i++) {
        char id[16];
        id_of(id, i + 2);
        kvd_append_spec sp = {.seq_id = id,
                              .seq_id_len = strlen(id),
                              .token_start = 0,
                              .num_tokens = n,
                              .dtype = KVD_DTYPE_F16};
        uint64_t want = 0;
        CHECK(create(st, i + 2) == 0);
        ap[i] = NULL;
        CHECK(kvd_store_append_begin(st, &sp, &ap[i], &want, &e) == 0);
    }
    if (st && ap[0] && ap[1]) {
        CHECK(kvd_store_append_write(ap[0], kv, bytes / 2, &e) == 0);
        CHECK(kvd_store_append_write(ap[1], kv, 1, &e) == KVD_ENOMEM);
        CHECK(strstr(e.msg, "append-memory-bytes") != NULL);
        kvd_store_stats_get(st, &s);
        CHECK(s.mem_appends == bytes);
        CHECK(kvd_store_append_write(ap[0], kv, bytes / 2, &e) == 0 &&
              kvd_store_append_commit(ap[0], NULL, &e) == 0);
        kvd_store_append_abort(ap[1]);
        kvd_store_stats_get(st, &s);
        CHECK(s.mem_appends == 0);
        CHECK(append_gen(st, 3, 0, n) == 0); /* room again */
    }
    free(kv);
    kvd_store_close(st);
}

int main(void)
{
    char tmpl[] = "/tmp/kvd-test-tier-XXXXXX";
    char *root = mkdtemp(tmpl);
    if (!root)
        return 1;
    const char *want = getenv("KVD_TEST_DEVICE");
    if (want && strcmp(want, "cuda") == 0) {
        kvd_error e;
        if (kvd_backend_cuda_create(-1, &device, &e)) {
            fprintf(stderr, "KVD_TEST_DEVICE=cuda: %s\n", e.msg);
            return 1;
        }
    }
    char d1[128], d2[128], d3[128], d4[128], d5[128], d6[128], d7[128], cmd[200];
    snprintf(d1, sizeof d1, "%s/lru", root);
    snprintf(d2, sizeof d2, "%s/threads", root);
    snprintf(d3, sizeof d3, "%s/batch", root);
    snprintf(d4, sizeof d4, "%s/storm", root);
    snprintf(d5, sizeof d5, "%s/slots", root);
    snprintf(d6, sizeof d6, "%s/memory", root);
    snprintf(d7, sizeof d7, "%s/prefault", root);
    test_lru(d1);
    test_batch(d3);
    test_threads(d2);
    test_storm(d4);
    test_slots(d5);
    test_memory(d6);
    test_prefault(d7);
    snprintf(cmd, sizeof cmd, "rm -rf %s", root);
    if (system(cmd) != 0)
        fprintf(stderr, "could not remove %s\n", root);
    kvd_backend_free(device);
    printf("%s (%d failures)\n", failures ? "FAIL" : "PASS", failures);
    return failures != 0;
}
