/*
 * Memory tiers: a device pool and host memory above RocksDB.
 *
 * Every page in a memory tier is a kvd__centry holding the page's whole
 * encoding (page.h), found by page id in cache.map. Page bytes for a given
 * (page id, token) never change: sealed pages are immutable, and a raw tail
 * page rewritten under its id only gains tokens. So an entry holding at
 * least the tokens a reader needs is always right for it, whatever snapshot
 * the reader works on, and an entry is replaced only by one holding more.
 *
 * Device tier: one pool of device_tier_bytes allocated once through the
 * backend at open (host memory from malloc when there is no backend),
 * carved by a first-fit allocator over a sorted list of free ranges (64-byte
 * granules, neighbours coalesced on free). Host tier: with a device, one
 * pinned block of host_tier_bytes from it (kvd_backend_host_alloc), carved
 * the same way, so that pages move up and down by direct DMA; otherwise one
 * mapping per page.
 * On the CPU backend the device pool is memory the kernel maps at first
 * touch, zeroing each page: a thread keeps PREFAULT_AHEAD bytes beyond the
 * furthest range the pool has handed out mapped (MADV_POPULATE_WRITE, which
 * leaves the contents of mapped pages alone), so that the copies of Appends
 * into a fresh server's tier do not take the faults (a fifth of a 1 MiB
 * Append's server time). Resident memory runs at most that far ahead of the
 * tier's reach, never past the tier.
 * Each tier keeps an LRU list; to make room, the least recently used entry
 * that nobody has pinned moves down: device -> host, host -> out of memory
 * (RocksDB still holds it). A pinned entry is never moved or freed; one
 * dropped while pinned is unlinked at once and freed at its last unpin.
 *
 * Copies into the device pool (a page inserted or promoted) and out of it
 * (demoted, or for a reader) run with cache->mu released, so that one PCIe
 * copy does not hold up every other lookup: the entry is pinned by the
 * copier, its range already charged to the tier, and marked moving;
 * acquirers of its id wait on cache->moved until the copy is done. Pages
 * move in batches where they can: a computation's pages that must go up
 * (kvd_store_pages_acquire_device), and the pages demoted to make room, go
 * as one kvd_backend_copy_batch each, one wait for the lot.
 *
 * A background thread serves read-ahead requests of Read cursors (pages
 * loaded from RocksDB, verified, and inserted) and deletes sequences whose
 * TTL has passed.
 */
#include "store_internal.h"

#include "codec.h"

#include <malloc.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#define GRANULE 64u
/* The prefault thread maps this far beyond the pool's reach, 1 MiB a step
 * (the mmap lock is held for one step at a time). */
#define PREFAULT_AHEAD (32ull << 20)
#define PREFAULT_STEP (1ull << 20)

/* ---- logging --------------------------------------------------------------- */

/* One logfmt line on stderr in a single write, like kvdepotd's own log. */
static void store_log(const char *level, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
static void store_log(const char *level, const char *fmt, ...)
{
    char line[768];
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    struct tm tm;
    gmtime_r(&ts.tv_sec, &tm);
    int n = snprintf(line, sizeof line, "ts=%04d-%02d-%02dT%02d:%02d:%02d.%03ldZ level=%s ",
                     tm.tm_year + 1900, tm.tm_mon + 1, tm.tm_mday, tm.tm_hour, tm.tm_min, tm.tm_sec,
                     ts.tv_nsec / 1000000, level);
    va_list ap;
    va_start(ap, fmt);
    if (n > 0 && (size_t)n < sizeof line)
        n += vsnprintf(line + n, sizeof line - (size_t)n, fmt, ap);
    va_end(ap);
    if (n < 0)
        return;
    if ((size_t)n >= sizeof line - 1)
        n = (int)sizeof line - 2;
    line[n++] = '\n';
    ssize_t w = write(2, line, (size_t)n);
    (void)w;
}

void kvd__note_corrupt(kvd_store *st, uint64_t page_id, const kvd_error *err)
{
    atomic_fetch_add(&st->tiers.checksum_failures, 1);
    char msg[300];
    size_t o = 0;
    /* Quote the message for logfmt: drop quotes and control bytes. */
    for (const char *p = err ? err->msg : ""; *p && o + 1 < sizeof msg; p++)
        msg[o++] = (*p == '"' || (unsigned char)*p < 0x20) ? '\'' : *p;
    msg[o] = '\0';
    store_log("error",
              "msg=\"page failed verification; served as DATA_LOSS\" page=%llu "
              "error=\"%s\"",
              (unsigned long long)page_id, msg);
}

/* ---- pool allocator (the device tier; the host tier when pinned) ----------- */

static int pool_alloc(kvd__pool *pl, uint64_t len, uint64_t *off)
{
    for (size_t i = 0; i < pl->nfree; i++) {
        if (pl->freel[i].len < len)
            continue;
        *off = pl->freel[i].off;
        if (*off + len > pl->reach) {
            pl->reach = *off + len;
            if (pl->grow && pl->reach + PREFAULT_AHEAD / 2 > pl->mapped)
                pthread_cond_signal(pl->grow);
        }
        pl->freel[i].off += len;
        pl->freel[i].len -= len;
        if (pl->freel[i].len == 0) {
            memmove(pl->freel + i, pl->freel + i + 1, (pl->nfree - i - 1) * sizeof *pl->freel);
            pl->nfree--;
        }
        return 0;
    }
    return -1;
}

static void pool_free(kvd__pool *pl, uint64_t off, uint64_t len)
{
    size_t lo = 0, hi = pl->nfree;
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        if (pl->freel[mid].off < off)
            lo = mid + 1;
        else
            hi = mid;
    }
    /* lo: first range after off. */
    int merge_prev = lo > 0 && pl->freel[lo - 1].off + pl->freel[lo - 1].len == off;
    int merge_next = lo < pl->nfree && off + len == pl->freel[lo].off;
    if (merge_prev && merge_next) {
        pl->freel[lo - 1].len += len + pl->freel[lo].len;
        memmove(pl->freel + lo, pl->freel + lo + 1, (pl->nfree - lo - 1) * sizeof *pl->freel);
        pl->nfree--;
        return;
    }
    if (merge_prev) {
        pl->freel[lo - 1].len += len;
        return;
    }
    if (merge_next) {
        pl->freel[lo].off = off;
        pl->freel[lo].len += len;
        return;
    }
    if (pl->nfree == pl->capfree) {
        size_t nc = pl->capfree ? 2 * pl->capfree : 64;
        kvd__free_range *n = realloc(pl->freel, nc * sizeof *n);
        if (!n)
            return; /* the range is lost to the pool until restart; never unsafe */
        pl->freel = n;
        pl->capfree = nc;
    }
    memmove(pl->freel + lo + 1, pl->freel + lo, (pl->nfree - lo) * sizeof *pl->freel);
    pl->freel[lo].off = off;
    pl->freel[lo].len = len;
    pl->nfree++;
}

static int pool_init(kvd__pool *pl, uint64_t bytes)
{
    pl->size = bytes;
    pl->freel = malloc(sizeof *pl->freel);
    if (!pl->freel)
        return -1;
    pl->freel[0].off = 0;
    pl->freel[0].len = bytes;
    pl->nfree = pl->capfree = 1;
    return 0;
}

/* ---- host tier memory ------------------------------------------------------ */

/* Host-tier pages are mapped one by one, so that the memory of an evicted
 * page goes back to the system at once: malloc arenas of the many threads
 * that free pages would otherwise keep it, and the process would outgrow the
 * tier's limit. The tier is charged the mapped size. */
static uint64_t host_size(size_t len)
{
    return ((uint64_t)len + 4095) / 4096 * 4096;
}

static uint8_t *host_alloc(size_t len)
{
    void *p = mmap(NULL, (size_t)host_size(len), PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
    return p == MAP_FAILED ? NULL : p;
}

static void host_free(uint8_t *p, size_t len)
{
    if (p)
        munmap(p, (size_t)host_size(len));
}

/* A pool range's size for a page of len bytes: whole granules. */
static uint64_t granules(uint64_t len)
{
    return (len + GRANULE - 1) / GRANULE * GRANULE;
}

/* With a device, the host tier is one pinned block of it (hpool), charged
 * by granule: the device copies to and from it directly. */
static uint64_t host_charge(const kvd__cache *c, size_t len)
{
    return c->hpool.base ? granules(len) : host_size(len);
}

static int make_room(kvd__cache *c, int tier, uint64_t alloc, const kvd__centry *keep);
static void evict_host(kvd__cache *c, kvd__centry *e);
static int move_down(kvd__cache *c, uint64_t want, const kvd__centry *keep);

/* Make room in a tier: its least recently used entries that nobody pins,
 * other than keep, leave it. The device tier's move down to the host tier
 * in batches (move_down: cache->mu is released while their bytes come
 * down); the host tier's are dropped, from *v up (*v moves past them).
 * 0, or -1 when there is none. */
static int demote_next(kvd__cache *c, int tier, kvd__centry **v, uint64_t want,
                       const kvd__centry *keep)
{
    if (tier == KVD_TIER_DEVICE)
        return move_down(c, want, keep);
    while (*v && ((*v)->pins || *v == keep))
        *v = (*v)->prev;
    if (!*v)
        return -1;
    kvd__centry *prev = (*v)->prev;
    evict_host(c, *v);
    *v = prev;
    return 0;
}

/* A range of alloc bytes in the tier's pool, within its budget already but
 * maybe fragmented: its least recently used unpinned entries other than
 * keep move down until one fits. 0 or -1. */
static int pool_fit(kvd__cache *c, int tier, uint64_t alloc, const kvd__centry *keep,
                    uint64_t *off)
{
    kvd__pool *pl = tier == KVD_TIER_DEVICE ? &c->dpool : &c->hpool;
    kvd__centry *v = c->tier[tier].tail;
    while (pool_alloc(pl, alloc, off) != 0)
        if (demote_next(c, tier, &v, alloc, keep))
            return -1;
    return 0;
}

/* Memory for a host-tier page of len bytes, making room (entries other than
 * keep move out); *off is its offset in hpool. 0 or -1. */
static int host_take(kvd__cache *c, size_t len, const kvd__centry *keep, uint8_t **out,
                     uint64_t *off)
{
    *out = NULL;
    *off = 0;
    const uint64_t charge = host_charge(c, len);
    if (make_room(c, KVD_TIER_HOST, charge, keep) != 0)
        return -1;
    if (!c->hpool.base)
        return (*out = host_alloc(len)) ? 0 : -1;
    if (pool_fit(c, KVD_TIER_HOST, charge, keep, off))
        return -1;
    *out = c->hpool.base + *off;
    return 0;
}

/* Give back host-tier memory of a page of len bytes (host_take's). */
static void host_return(kvd__cache *c, uint8_t *h, uint64_t off, size_t len)
{
    if (c->hpool.base)
        pool_free(&c->hpool, off, host_charge(c, len));
    else
        host_free(h, len);
}

/* Give back the memory of a host-tier entry. */
static void host_give(kvd__cache *c, kvd__centry *e)
{
    host_return(c, e->data, e->off, e->len);
}

/* ---- LRU lists ------------------------------------------------------------- */

static void lru_unlink(kvd__tier *t, kvd__centry *e)
{
    if (e->prev)
        e->prev->next = e->next;
    else
        t->head = e->next;
    if (e->next)
        e->next->prev = e->prev;
    else
        t->tail = e->prev;
    e->prev = e->next = NULL;
}

static void lru_push(kvd__tier *t, kvd__centry *e)
{
    e->prev = NULL;
    e->next = t->head;
    if (t->head)
        t->head->prev = e;
    t->head = e;
    if (!t->tail)
        t->tail = e;
}

/* e becomes the most recently used of its tier. */
static void lru_touch(kvd__cache *c, kvd__centry *e)
{
    kvd__tier *t = &c->tier[e->tier];
    lru_unlink(t, e);
    lru_push(t, e);
}

/* Put e in its tier's list (most recent) and accounting (e->tier, e->alloc
 * set). */
static void tier_attach(kvd__cache *c, kvd__centry *e)
{
    kvd__tier *t = &c->tier[e->tier];
    lru_push(t, e);
    t->used += e->alloc;
    t->pages++;
}

/* Take e out of its tier's list and accounting (its bytes stay allocated). */
static void tier_detach(kvd__cache *c, kvd__centry *e)
{
    kvd__tier *t = &c->tier[e->tier];
    lru_unlink(t, e);
    t->used -= e->alloc;
    t->pages--;
}

static void entry_free_data(kvd__cache *c, kvd__centry *e)
{
    if (e->tier == KVD_TIER_DEVICE)
        pool_free(&c->dpool, e->off, e->alloc);
    else
        host_give(c, e);
    e->data = NULL;
    free(e->layout);
    e->layout = NULL;
}

/* A page entering a pool the host does not read keeps, in host memory,
 * where its K and V lie (read from its host bytes on the way up), so that
 * compute on the device needs nothing of it back. Pages whose codecs need
 * more than the page (VQ, SVD) have none and are copied down to compute. */
static void entry_set_layout(const kvd__cache *c, kvd__centry *e, const uint8_t *host)
{
    free(e->layout);
    e->layout = NULL;
    if (c->pool_host)
        return;
    kvd_page_view v;
    kvd_error err;
    kvd_page_layout *l = malloc(sizeof *l);
    if (l && kvd_page_decode_trusted(host, e->len, &v, &err) == 0 &&
        kvd_page_layout_get(host, &v, l, &err) == 0) {
        e->layout = l;
        return;
    }
    free(l);
}

static void entry_destroy(kvd__cache *c, kvd__centry *e)
{
    entry_free_data(c, e);
    free(e);
}

/* ---- moving pages between tiers (cache->mu held) --------------------------- */

/* A failed copy on a device an error left unusable: the next cache call
 * drops the device tier (drop_device). */
static int pool_failed(kvd__cache *c, int rc)
{
    kvd_backend_desc d;
    kvd_backend_describe(c->be, &d);
    if (!d.healthy)
        c->dev_broken = 1;
    return rc;
}

/* Copies into or out of the device pool, as one batch with cache->mu
 * released (held on entry and return) when they are the device's: the
 * caller pinned and marked moving what they touch. 0 or the error. */
static int pool_copy_batch(kvd__cache *c, const kvd_copy *ops, size_t n)
{
    if (n && c->pool_host) {
        for (size_t i = 0; i < n; i++)
            memcpy(ops[i].dst, ops[i].src, ops[i].bytes);
    } else if (n) {
        pthread_mutex_unlock(&c->mu);
        kvd_error err;
        int rc = kvd_backend_copy_batch(c->be, ops, n, &err);
        pthread_mutex_lock(&c->mu);
        if (rc)
            return pool_failed(c, rc);
    }
    return 0;
}

/* Copy pool bytes out to host memory. */
static int pool_get(kvd__cache *c, uint8_t *dst, uint64_t off, size_t len)
{
    if (c->pool_host) {
        memcpy(dst, c->dpool.base + off, len);
        return 0;
    }
    int rc = kvd_backend_download(c->be, dst, c->dpool.base + off, len, NULL);
    return rc ? pool_failed(c, rc) : 0;
}

/* Drop an unpinned host-tier entry from memory (RocksDB keeps the page). */
static void evict_host(kvd__cache *c, kvd__centry *e)
{
    tier_detach(c, e);
    atomic_fetch_add(&c->evictions[1], 1);
    kvd__map_del(&c->map, e->id);
    entry_destroy(c, e);
}

/* One device-tier entry on its way down (move_down). */
typedef struct down_job {
    kvd__centry *e;
    uint8_t *h;    /* its host-tier memory; NULL: it leaves memory */
    uint64_t hoff; /* offset of h in hpool */
} down_job;

#define KVD__DOWN_BATCH 64

/*
 * Move the least recently used device-tier entries that nobody pins (other
 * than keep) down to the host tier, at least `want` bytes of them (up to
 * KVD__DOWN_BATCH entries), as one batch of copies: each is pinned and
 * marked moving, its host memory taken, then cache->mu is released while
 * their bytes come down together (kvd_backend_copy_batch, one wait), and
 * retaken to settle them. Entries that find no host memory, or whose copy
 * failed, leave memory (RocksDB keeps every page). 0, or -1 when none can
 * move.
 */
static int move_down(kvd__cache *c, uint64_t want, const kvd__centry *keep)
{
    down_job jobs[KVD__DOWN_BATCH];
    kvd_copy ops[KVD__DOWN_BATCH];
    size_t n = 0, nops = 0;
    uint64_t got = 0;
    const uint64_t hlimit = c->tier[KVD_TIER_HOST].limit;
    for (kvd__centry *v = c->tier[KVD_TIER_DEVICE].tail; v && got < want && n < KVD__DOWN_BATCH;
         v = v->prev) {
        if (v->pins || v == keep)
            continue;
        down_job *j = &jobs[n++];
        j->e = v;
        j->h = NULL;
        j->hoff = 0;
        v->pins++; /* nothing frees or moves it meanwhile */
        v->moving = 1;
        got += v->alloc;
        if (host_charge(c, v->len) <= hlimit && host_take(c, v->len, v, &j->h, &j->hoff) == 0)
            ops[nops++] = (kvd_copy){.dst = j->h, .src = v->data, .bytes = v->len, .to_device = 0};
    }
    if (!n)
        return -1;
    const int rc = pool_copy_batch(c, ops, nops);
    for (size_t i = 0; i < n; i++) {
        kvd__centry *e = jobs[i].e;
        uint8_t *h = rc ? NULL : jobs[i].h;
        if (rc && jobs[i].h)
            host_return(c, jobs[i].h, jobs[i].hoff, e->len);
        e->moving = 0;
        e->pins--;
        if (e->dead) {
            /* Dropped meanwhile (the device was lost): out of the map and
             * lists already; its device range goes with it. */
            if (h)
                host_return(c, h, jobs[i].hoff, e->len);
            if (!e->pins)
                entry_destroy(c, e);
            continue;
        }
        atomic_fetch_add(&c->evictions[0], 1);
        tier_detach(c, e);
        pool_free(&c->dpool, e->off, e->alloc);
        free(e->layout);
        e->layout = NULL;
        if (!h) {
            kvd__map_del(&c->map, e->id);
            free(e);
            continue;
        }
        e->data = h;
        e->off = jobs[i].hoff;
        e->tier = KVD_TIER_HOST;
        e->alloc = host_charge(c, e->len);
        tier_attach(c, e);
    }
    pthread_cond_broadcast(&c->moved);
    return 0;
}

/* Make `alloc` bytes fit in the tier's budget (and, for the device tier, the
 * pool) by demoting least recently used unpinned entries other than keep.
 * 0, or -1 when not enough can move. */
static int make_room(kvd__cache *c, int tier, uint64_t alloc, const kvd__centry *keep)
{
    kvd__tier *t = &c->tier[tier];
    if (alloc > t->limit)
        return -1;
    kvd__centry *v = t->tail;
    while (t->used + alloc > t->limit)
        if (demote_next(c, tier, &v, t->used + alloc - t->limit, keep))
            return -1;
    return 0;
}

/* A pool range for alloc bytes in the device tier, evicting as needed. */
static int device_alloc(kvd__cache *c, uint64_t alloc, const kvd__centry *keep, uint64_t *off)
{
    if (c->dev_gone)
        return -1;
    if (make_room(c, KVD_TIER_DEVICE, alloc, keep))
        return -1;
    return pool_fit(c, KVD_TIER_DEVICE, alloc, keep, off);
}

/* The entry of id, once it is not moving (cache->mu held). */
static kvd__centry *entry_settled(kvd__cache *c, uint64_t id)
{
    kvd__centry *e;
    while ((e = kvd__map_get(&c->map, id)) && e->moving)
        pthread_cond_wait(&c->moved, &c->mu);
    return e;
}

/* Put e (in no tier's list) in the device tier at pool range off. */
static void place_device(kvd__cache *c, kvd__centry *e, uint64_t off, uint64_t alloc)
{
    e->data = c->dpool.base + off;
    e->off = off;
    e->alloc = alloc;
    e->tier = KVD_TIER_DEVICE;
    tier_attach(c, e);
}

/*
 * Move host-tier entries that the caller pinned, and nobody else, to the
 * device tier as one batch of copies (up to KVD__DOWN_BATCH): each is
 * marked moving, given a device range (making room may release cache->mu,
 * the range is charged to the device tier meanwhile), then cache->mu is
 * released while their bytes go up together (kvd_backend_copy_batch, one
 * wait) and retaken to settle them. An entry pinned by another holder too,
 * dead or moving is left alone; one that finds no room, or whose copy
 * failed, stays in the host tier. Entries moved.
 */
static size_t promote_chunk(kvd__cache *c, kvd__centry *const *es, size_t n)
{
    kvd__centry *up[KVD__DOWN_BATCH];
    uint64_t offs[KVD__DOWN_BATCH];
    kvd_copy ops[KVD__DOWN_BATCH];
    size_t m = 0, k = 0;
    for (size_t i = 0; i < n && m < KVD__DOWN_BATCH; i++) {
        kvd__centry *e = es[i];
        if (e->dead || e->moving || e->tier != KVD_TIER_HOST || e->pins != 1)
            continue;
        /* Moving from here: making room may release cache->mu, and a
         * reader let in meanwhile would read host bytes given back below. */
        e->moving = 1;
        up[m++] = e;
    }
    for (size_t i = 0; i < m; i++) {
        kvd__centry *e = up[i];
        const uint64_t alloc = granules(e->len);
        uint64_t off;
        if (device_alloc(c, alloc, e, &off) != 0) {
            e->moving = 0;
            continue;
        }
        c->tier[KVD_TIER_DEVICE].used += alloc;
        up[k] = e;
        offs[k] = off;
        ops[k++] =
            (kvd_copy){.dst = c->dpool.base + off, .src = e->data, .bytes = e->len, .to_device = 1};
    }
    const int rc = pool_copy_batch(c, ops, k);
    size_t moved = 0;
    for (size_t i = 0; i < k; i++) {
        kvd__centry *e = up[i];
        const uint64_t alloc = granules(e->len);
        c->tier[KVD_TIER_DEVICE].used -= alloc;
        e->moving = 0;
        if (rc || e->dead || c->dev_gone) {
            pool_free(&c->dpool, offs[i], alloc);
            continue;
        }
        tier_detach(c, e);
        entry_set_layout(c, e, e->data);
        host_give(c, e);
        place_device(c, e, offs[i], alloc);
        atomic_fetch_add(&c->promotions, 1);
        moved++;
    }
    if (m)
        pthread_cond_broadcast(&c->moved);
    return moved;
}

/* promote_chunk over any number of entries. */
static size_t promote_batch(kvd__cache *c, kvd__centry *const *es, size_t n)
{
    size_t moved = 0;
    for (size_t i = 0; i < n; i += KVD__DOWN_BATCH)
        moved += promote_chunk(c, es + i, n - i < KVD__DOWN_BATCH ? n - i : KVD__DOWN_BATCH);
    return moved;
}

/* Remove an entry from the map; free it now or at its last unpin. */
static void entry_kill(kvd__cache *c, kvd__centry *e)
{
    kvd__map_del(&c->map, e->id);
    tier_detach(c, e);
    if (e->pins)
        e->dead = 1;
    else
        entry_destroy(c, e);
}

/* The device was lost: forget every page in its tier and keep no device
 * tier from now on (kvd_store_device_lost). Pages forgotten; 0 when it was
 * done before. */
static uint64_t drop_device(kvd_store *st)
{
    kvd__cache *c = &st->tiers;
    if (!st->dev || atomic_exchange(&st->dev_lost, 1))
        return 0;
    kvd__tier *t = &c->tier[KVD_TIER_DEVICE];
    uint64_t n = 0;
    c->dev_gone = 1; /* device_alloc fails from now on: pages go to the host tier */
    while (t->head) {
        entry_kill(c, t->head);
        n++;
    }
    store_log("error",
              "msg=\"device lost (a device error left it unusable): its tier is dropped, pages "
              "are read from the host tier and RocksDB and computed on the CPU\" pages=%llu",
              (unsigned long long)n);
    return n;
}

/* ---- the cache API ----------------------------------------------------------- */

static int have_tiers(const kvd__cache *c)
{
    return c->tier[0].limit || c->tier[1].limit;
}

/* Does a page's layout give what a device computation needs (on_device:
 * KVD_ON_DEVICE_* flags; 0 = it needs the bytes on the host)? */
static int layout_serves(const kvd_page_layout *l, int on_device)
{
    return l && on_device && (!(on_device & KVD_ON_DEVICE_ATTEND) || l->attend) &&
           (!(on_device & KVD_ON_DEVICE_PQ) || l->pq_m);
}

kvd__centry *kvd__cache_acquire(kvd_store *st, uint64_t id, uint32_t need, const uint8_t **bytes,
                                uint8_t **tmp)
{
    kvd__cache *c = &st->tiers;
    *bytes = NULL;
    *tmp = NULL;
    if (!have_tiers(c)) {
        atomic_fetch_add(&c->misses, 1);
        return NULL;
    }
    pthread_mutex_lock(&c->mu);
    if (c->dev_broken)
        drop_device(st);
    kvd__centry *e = entry_settled(c, id);
    if (!e || e->num_tokens < need) {
        pthread_mutex_unlock(&c->mu);
        atomic_fetch_add(&c->misses, 1);
        return NULL;
    }
    atomic_fetch_add(&c->hits[e->tier], 1);
    lru_touch(c, e);
    /* Another holder may be reading e's bytes: only an unpinned entry moves. */
    const int up = e->tier == KVD_TIER_HOST && e->pins == 0;
    e->pins++;
    if (up)
        promote_batch(c, &e, 1);
    if (e->tier == KVD_TIER_DEVICE && !c->pool_host) {
        /* Pinned, so its range stays put: copy it down unlocked. */
        const uint64_t off = e->off;
        const size_t len = e->len;
        pthread_mutex_unlock(&c->mu);
        uint8_t *h = malloc(len);
        if (!h || pool_get(c, h, off, len) != 0) {
            free(h);
            kvd__cache_release(st, e);
            return NULL;
        }
        *tmp = h;
        *bytes = h;
        return e;
    } else {
        *bytes = e->data;
    }
    pthread_mutex_unlock(&c->mu);
    return e;
}

void kvd__cache_release(kvd_store *st, kvd__centry *e)
{
    if (!e)
        return;
    kvd__cache *c = &st->tiers;
    pthread_mutex_lock(&c->mu);
    if (--e->pins == 0 && e->dead)
        entry_destroy(c, e);
    pthread_mutex_unlock(&c->mu);
}

/* Place a new entry (moving, in no list) in the host tier, copying its
 * bytes there; 0, or -1 (nothing changed) when the tier has no room. */
static int place_host(kvd__cache *c, kvd__centry *e, const uint8_t *page)
{
    if (host_take(c, e->len, NULL, &e->data, &e->off) != 0)
        return -1;
    memcpy(e->data, page, e->len);
    e->tier = KVD_TIER_HOST;
    e->alloc = host_charge(c, e->len);
    tier_attach(c, e);
    return 0;
}

/* Give back a reserved range (cache->mu held). */
static void slot_give(kvd__cache *c, const kvd__slot *s)
{
    if (!s->alloc)
        return;
    c->tier[KVD_TIER_DEVICE].used -= s->alloc;
    pool_free(&c->dpool, s->off, s->alloc);
}

/* Does a slot hold a page of len bytes in a device tier still there? */
static int slot_serves(const kvd__cache *c, const kvd__slot *s, size_t len)
{
    return s->alloc && !c->dev_gone && s->alloc >= granules(len);
}

/*
 * kvd__cache_insert_batch of at most KVD__DOWN_BATCH pages. New entries are
 * made moving first (acquirers, drops and evictions of their ids wait), then
 * placed: those given a device range are pinned in the device tier while
 * their bytes go up together with cache->mu released (one
 * kvd_backend_copy_batch), the others are copied into the host tier. A page
 * whose old entry is moving is left in *defer (waiting for it here, with
 * this chunk's entries marked moving, could wait on a chunk waiting on this
 * one) unless nothing is marked yet. Returns pages deferred.
 */
static size_t insert_chunk(kvd_store *st, const kvd__cache_put *ps, size_t n, int pin,
                           kvd__centry **out, size_t *defer)
{
    kvd__cache *c = &st->tiers;
    kvd__centry *es[KVD__DOWN_BATCH] = {0};
    kvd_copy ops[KVD__DOWN_BATCH];
    size_t up[KVD__DOWN_BATCH];
    size_t nd = 0, k = 0, marked = 0;
    pthread_mutex_lock(&c->mu);
    if (c->dev_broken)
        drop_device(st);
    for (size_t i = 0; i < n; i++) {
        kvd__centry *old = kvd__map_get(&c->map, ps[i].id);
        if (old && old->moving) {
            if (marked) {
                defer[nd++] = i;
                continue;
            }
            old = entry_settled(c, ps[i].id);
        }
        if (old && old->num_tokens >= ps[i].num_tokens) {
            slot_give(c, &ps[i].slot);
            lru_touch(c, old); /* already there with as much */
            if (pin) {
                old->pins++;
                out[i] = old;
            }
            continue;
        }
        if (old)
            entry_kill(c, old);
        kvd__centry *e = calloc(1, sizeof *e);
        if (!e || kvd__map_put(&c->map, ps[i].id, e)) {
            free(e);
            slot_give(c, &ps[i].slot);
            continue;
        }
        e->id = ps[i].id;
        e->len = ps[i].len;
        e->num_tokens = ps[i].num_tokens;
        /* Moving until placed, in no tier's list yet: making room may
         * release cache->mu. Pinned until the end: placing the pages after
         * it must not move or evict it. */
        e->moving = 1;
        e->pins = 1;
        es[i] = e;
        marked++;
    }
    /* The last pages first: when not all fit, those are the ones to keep
     * (an LRU order, restored below, would have evicted the first). */
    for (size_t i = n; i-- > 0;) {
        kvd__centry *e = es[i];
        if (!e)
            continue;
        if (slot_serves(c, &ps[i].slot, e->len)) {
            /* Written there already: it stays. */
            c->tier[KVD_TIER_DEVICE].used -= ps[i].slot.alloc;
            place_device(c, e, ps[i].slot.off, ps[i].slot.alloc);
            entry_set_layout(c, e, ps[i].page);
            e->moving = 0;
            atomic_fetch_add(&c->device_pages_placed, 1);
            continue;
        }
        slot_give(c, &ps[i].slot);
        const uint64_t alloc = granules(e->len);
        uint64_t off;
        if (device_alloc(c, alloc, NULL, &off) == 0) {
            /* In the device tier at once, pinned while its bytes go up. */
            place_device(c, e, off, alloc);
            up[k] = i;
            ops[k++] =
                (kvd_copy){.dst = e->data, .src = ps[i].page, .bytes = e->len, .to_device = 1};
            continue;
        }
        if (place_host(c, e, ps[i].page) == 0) {
            e->moving = 0;
            continue;
        }
        kvd__map_del(&c->map, e->id);
        free(e);
        es[i] = NULL;
    }
    const int rc = pool_copy_batch(c, ops, k);
    for (size_t j = 0; j < k; j++) {
        const size_t i = up[j];
        kvd__centry *e = es[i];
        e->moving = 0;
        if (e->dead) { /* dropped meanwhile */
            if (--e->pins == 0)
                entry_destroy(c, e);
            es[i] = NULL;
        } else if (rc == 0) {
            entry_set_layout(c, e, ps[i].page);
        } else {
            /* The copies failed: try the host tier. */
            tier_detach(c, e);
            pool_free(&c->dpool, e->off, e->alloc);
            e->data = NULL;
            if (place_host(c, e, ps[i].page) != 0) {
                kvd__map_del(&c->map, e->id);
                free(e);
                es[i] = NULL;
            }
        }
    }
    for (size_t i = 0; i < n; i++) {
        kvd__centry *e = es[i];
        if (!e)
            continue;
        if (e->dead) { /* in the host tier, dropped while the lock was released */
            if (--e->pins == 0)
                entry_destroy(c, e);
            continue;
        }
        lru_touch(c, e); /* the last page the most recent */
        if (pin)
            out[i] = e; /* keeps its pin */
        else
            e->pins--;
    }
    if (marked)
        pthread_cond_broadcast(&c->moved);
    pthread_mutex_unlock(&c->mu);
    return nd;
}

void kvd__cache_insert_batch(kvd_store *st, const kvd__cache_put *ps, size_t n, int pin,
                             kvd__centry **out)
{
    if (pin)
        memset(out, 0, n * sizeof *out);
    if (!have_tiers(&st->tiers))
        return;
    size_t defer[KVD__DOWN_BATCH];
    for (size_t i0 = 0; i0 < n; i0 += KVD__DOWN_BATCH) {
        const size_t m = n - i0 < KVD__DOWN_BATCH ? n - i0 : KVD__DOWN_BATCH;
        size_t nd = insert_chunk(st, ps + i0, m, pin, pin ? out + i0 : NULL, defer);
        /* Pages whose old entries were moving, one at a time: each waits. */
        for (size_t j = 0; j < nd; j++) {
            const size_t i = i0 + defer[j];
            insert_chunk(st, ps + i, 1, pin, pin ? out + i : NULL, defer);
        }
    }
}

int kvd__cache_reserve(kvd_store *st, size_t len, kvd__slot *slot)
{
    kvd__cache *c = &st->tiers;
    memset(slot, 0, sizeof *slot);
    if (!c->tier[KVD_TIER_DEVICE].limit || c->pool_host)
        return -1;
    const uint64_t alloc = granules(len);
    uint64_t off;
    pthread_mutex_lock(&c->mu);
    if (c->dev_broken)
        drop_device(st);
    const int rc = device_alloc(c, alloc, NULL, &off);
    if (rc == 0) {
        c->tier[KVD_TIER_DEVICE].used += alloc;
        *slot = (kvd__slot){off, alloc, c->dpool.base + off};
    }
    pthread_mutex_unlock(&c->mu);
    return rc;
}

void kvd__cache_unreserve(kvd_store *st, kvd__slot *slot)
{
    if (!slot->alloc)
        return;
    kvd__cache *c = &st->tiers;
    pthread_mutex_lock(&c->mu);
    slot_give(c, slot);
    pthread_mutex_unlock(&c->mu);
    memset(slot, 0, sizeof *slot);
}

kvd__centry *kvd__cache_insert(kvd_store *st, uint64_t id, const uint8_t *page, size_t len,
                               uint32_t num_tokens, int pin)
{
    const kvd__cache_put p = {.id = id, .page = page, .len = len, .num_tokens = num_tokens};
    kvd__centry *e = NULL;
    kvd__cache_insert_batch(st, &p, 1, pin, &e);
    return e;
}

void kvd__cache_drop(kvd_store *st, uint64_t id)
{
    kvd__cache *c = &st->tiers;
    if (!have_tiers(c))
        return;
    pthread_mutex_lock(&c->mu);
    kvd__centry *e = entry_settled(c, id);
    if (e)
        entry_kill(c, e);
    pthread_mutex_unlock(&c->mu);
}

uint64_t kvd__cache_evict(kvd_store *st, uint64_t id)
{
    kvd__cache *c = &st->tiers;
    if (!have_tiers(c))
        return 0;
    uint64_t freed = 0;
    pthread_mutex_lock(&c->mu);
    kvd__centry *e = entry_settled(c, id);
    if (e && !e->pins) {
        freed = e->len;
        atomic_fetch_add(&c->evictions[e->tier], 1);
        entry_kill(c, e);
    }
    pthread_mutex_unlock(&c->mu);
    return freed;
}

/* ---- background thread: read-ahead and expiry --------------------------------- */

void kvd__cache_prefetch(kvd_store *st, const kvd__prefetch_item *it)
{
    kvd__cache *c = &st->tiers;
    if (!c->thread_started || !have_tiers(c))
        return;
    pthread_mutex_lock(&c->mu);
    kvd__centry *e = kvd__map_get(&c->map, it->page_id);
    if ((!e || e->num_tokens < it->need) && c->qlen < KVD__PREFETCH_QUEUE) {
        c->queue[(c->qhead + c->qlen) % KVD__PREFETCH_QUEUE] = *it;
        c->qlen++;
        pthread_cond_signal(&c->cv);
    }
    pthread_mutex_unlock(&c->mu);
}

static void prefetch_one(kvd_store *st, const kvd__prefetch_item *it)
{
    kvd__cache *c = &st->tiers;
    pthread_mutex_lock(&c->mu);
    kvd__centry *e = kvd__map_get(&c->map, it->page_id);
    int have = e && e->num_tokens >= it->need;
    pthread_mutex_unlock(&c->mu);
    if (have)
        return;
    kvd__tail_want w = {.page_id = it->page_id,
                        .layer = it->layer,
                        .p0 = it->p0,
                        .need = it->need,
                        .B = it->B,
                        .H = it->H,
                        .D = it->D,
                        .dtype = it->dtype};
    kvd__tail pg;
    kvd_error err;
    kvd_error_clear(&err);
    /* Failures (a page deleted meanwhile, or a corrupt one) are left to the
     * reader, who reports them for its own request. */
    if (kvd__tail_load(st, st->ropt, &w, &pg, &err) != 0)
        return;
    if (pg.nfrags == 0) {
        size_t len;
        const char *v = rocksdb_pinnableslice_value(pg.ps, &len);
        kvd__cache_insert(st, it->page_id, (const uint8_t *)v, len, pg.num_tokens, 0);
        atomic_fetch_add(&c->prefetched, 1);
    }
    kvd__tail_release(&pg);
}

static uint64_t prop(rocksdb_t *db, const char *name)
{
    uint64_t v = 0;
    return rocksdb_property_int(db, name, &v) == 0 ? v : 0;
}

int kvd__blob_gc(kvd_store *st, uint64_t min_garbage, int *ran)
{
    *ran = 0;
    const uint64_t size = prop(st->db, "rocksdb.live-blob-file-size");
    const uint64_t garbage = prop(st->db, "rocksdb.live-blob-file-garbage-size");
    if (garbage < min_garbage || garbage * 2 < size)
        return 0;
    /* One compaction of everything with garbage collection on for every
     * file: each live page is rewritten once, the old files go. */
    const char *names[2] = {"enable_blob_garbage_collection", "blob_garbage_collection_age_cutoff"};
    const char *on[2] = {"true", "1.0"}, *off[2] = {"false", "0.25"};
    char *e = NULL;
    rocksdb_set_options(st->db, 2, names, on, &e);
    if (e) {
        store_log("warn", "msg=\"blob garbage collection not started\" error=\"%s\"", e);
        rocksdb_free(e);
        return -1;
    }
    rocksdb_compactoptions_t *co = rocksdb_compactoptions_create();
    rocksdb_compactoptions_set_exclusive_manual_compaction(co, 0);
    rocksdb_compactoptions_set_bottommost_level_compaction(co, 2); /* kForce: every file */
    rocksdb_compact_range_opt(st->db, co, NULL, 0, NULL, 0);
    rocksdb_compactoptions_destroy(co);
    rocksdb_set_options(st->db, 2, names, off, &e);
    if (e) {
        store_log("warn", "msg=\"blob garbage collection left on\" error=\"%s\"", e);
        rocksdb_free(e);
    }
    *ran = 1;
    store_log("info",
              "msg=\"blob files compacted\" blob_bytes_before=%llu garbage_bytes_before=%llu "
              "blob_bytes_after=%llu",
              (unsigned long long)size, (unsigned long long)garbage,
              (unsigned long long)prop(st->db, "rocksdb.live-blob-file-size"));
    return 0;
}

static void *bg_main(void *arg)
{
    kvd_store *st = arg;
    kvd__cache *c = &st->tiers;
    uint64_t next_expiry = 0, next_gc = kvd__now_ms() + KVD__BLOB_GC_EVERY_MS;
    pthread_mutex_lock(&c->mu);
    while (!c->stop) {
        if (c->qlen) {
            kvd__prefetch_item it = c->queue[c->qhead];
            c->qhead = (c->qhead + 1) % KVD__PREFETCH_QUEUE;
            c->qlen--;
            pthread_mutex_unlock(&c->mu);
            prefetch_one(st, &it);
            pthread_mutex_lock(&c->mu);
            continue;
        }
        uint64_t now = kvd__now_ms();
        if (now >= next_expiry) {
            pthread_mutex_unlock(&c->mu);
            kvd__expire(st);
            next_expiry = now + 200;
            pthread_mutex_lock(&c->mu);
            continue;
        }
        if (now >= next_gc) {
            pthread_mutex_unlock(&c->mu);
            int ran;
            kvd__blob_gc(st, KVD__BLOB_GC_MIN, &ran);
            /* Memory freed by appends and reads goes back to the system
             * (malloc keeps what each thread's arena freed otherwise). */
            malloc_trim(0);
            next_gc = kvd__now_ms() + KVD__BLOB_GC_EVERY_MS;
            pthread_mutex_lock(&c->mu);
            continue;
        }
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        ts.tv_nsec += 200 * 1000000L;
        if (ts.tv_nsec >= 1000000000L) {
            ts.tv_sec++;
            ts.tv_nsec -= 1000000000L;
        }
        pthread_cond_timedwait(&c->cv, &c->mu, &ts);
    }
    pthread_mutex_unlock(&c->mu);
    return NULL;
}

int kvd__cache_init(kvd_store *st, const kvd_store_options *opt, kvd_error *err)
{
    kvd__cache *c = &st->tiers;
    pthread_mutex_init(&c->mu, NULL);
    pthread_cond_init(&c->cv, NULL);
    pthread_cond_init(&c->moved, NULL);
    c->be = st->dev ? st->dev : st->be;
    c->tier[KVD_TIER_HOST].limit = opt->host_tier_bytes;
    uint64_t dev = opt->device_tier_bytes / GRANULE * GRANULE;
    if (dev) {
        void *p = NULL;
        if (c->be) {
            int rc = kvd_backend_alloc(c->be, (size_t)dev, &p, err);
            if (rc)
                return rc;
            c->pool_host = strcmp(c->be->iface->name, "cpu") == 0;
        } else {
            p = aligned_alloc(GRANULE, (size_t)dev);
            if (!p)
                return kvd_error_set(err, KVD_ENOMEM,
                                     "cannot allocate the device tier of %llu bytes",
                                     (unsigned long long)dev);
            c->pool_host = 1;
        }
        c->dpool.base = p;
        if (pool_init(&c->dpool, dev))
            return kvd_error_set(err, KVD_ENOMEM, "out of memory");
        c->tier[KVD_TIER_DEVICE].limit = dev;
    }
    /* With a device, the host tier is one pinned block of it, so that
     * promotion and demotion are direct DMA; without one, or when the
     * system will not lock that much, a mapping per page. */
    uint64_t host = opt->host_tier_bytes / GRANULE * GRANULE;
    if (st->dev && host) {
        void *p = NULL;
        kvd_error e2;
        if (kvd_backend_host_alloc(st->dev, (size_t)host, &p, &e2) == 0) {
            c->hpool.base = p;
            if (pool_init(&c->hpool, host))
                return kvd_error_set(err, KVD_ENOMEM, "out of memory");
            store_log("info", "msg=\"host tier in pinned memory\" bytes=%llu",
                      (unsigned long long)host);
        } else {
            store_log("warn",
                      "msg=\"host tier not pinned: pages go to and from the GPU through a "
                      "staging buffer\" bytes=%llu error=\"%s\"",
                      (unsigned long long)host, e2.msg);
        }
    }
    return 0;
}

uint64_t kvd_store_device_lost(kvd_store *st)
{
    if (!st->dev)
        return 0;
    pthread_mutex_lock(&st->tiers.mu);
    uint64_t n = drop_device(st);
    pthread_mutex_unlock(&st->tiers.mu);
    return n;
}

int kvd_store_device_fallback(kvd_store *st, int rc, kvd_error *err)
{
    if (!st->dev || (rc != KVD_EUNAVAIL && rc != KVD_ENOMEM))
        return 0;
    if (rc == KVD_EUNAVAIL)
        kvd_store_device_lost(st);
    atomic_fetch_add(&st->tiers.device_fallbacks, 1);
    kvd_error_clear(err);
    return 1;
}

/* Map pool bytes [from, to), by pages: from the page that holds from to the
 * one that holds to, not included (the next call's first; a page below the
 * pool's first byte is the allocation's too). 0, or -1 when the kernel
 * cannot (MADV_POPULATE_WRITE is Linux 5.14 or later). */
static int prefault_range(const kvd__pool *pl, uint64_t from, uint64_t to)
{
#ifdef MADV_POPULATE_WRITE
    const uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE);
    const uintptr_t a = (uintptr_t)(pl->base + from) & ~(page - 1);
    const uintptr_t b = (uintptr_t)(pl->base + to) & ~(page - 1);
    if (b <= a)
        return 0;
    return madvise((void *)a, b - a, MADV_POPULATE_WRITE) == 0 ? 0 : -1;
#else
    (void)pl, (void)from, (void)to;
    return -1;
#endif
}

static void *prefault_main(void *arg)
{
    kvd__cache *c = arg;
    kvd__pool *pl = &c->dpool;
    pthread_mutex_lock(&c->mu);
    while (!c->stop) {
        uint64_t want =
            pl->reach + PREFAULT_AHEAD < pl->size ? pl->reach + PREFAULT_AHEAD : pl->size;
        if (pl->mapped >= want) {
            pthread_cond_wait(&c->prefault_cv, &c->mu);
            continue;
        }
        const uint64_t from = pl->mapped;
        if (want - from > PREFAULT_STEP)
            want = from + PREFAULT_STEP;
        pthread_mutex_unlock(&c->mu);
        const int rc = prefault_range(pl, from, want);
        pthread_mutex_lock(&c->mu);
        if (rc) /* the first touch maps what is left */
            break;
        pl->mapped = want;
    }
    pl->grow = NULL;
    pthread_mutex_unlock(&c->mu);
    return NULL;
}

int kvd__cache_start(kvd_store *st, kvd_error *err)
{
    kvd__cache *c = &st->tiers;
    if (pthread_create(&c->thread, NULL, bg_main, st) != 0)
        return kvd_error_set(err, KVD_EINTERNAL, "cannot start the store's background thread");
    c->thread_started = 1;
    if (c->pool_host && c->dpool.base) {
        pthread_cond_init(&c->prefault_cv, NULL);
        pthread_mutex_lock(&c->mu);
        c->dpool.grow = &c->prefault_cv;
        pthread_mutex_unlock(&c->mu);
        if (pthread_create(&c->prefault, NULL, prefault_main, c) == 0) {
            c->prefault_started = 1;
        } else { /* the first touch maps the tier */
            pthread_mutex_lock(&c->mu);
            c->dpool.grow = NULL;
            pthread_mutex_unlock(&c->mu);
            pthread_cond_destroy(&c->prefault_cv);
        }
    }
    return 0;
}

void kvd__cache_fini(kvd_store *st)
{
    kvd__cache *c = &st->tiers;
    if (c->thread_started) {
        pthread_mutex_lock(&c->mu);
        c->stop = 1;
        pthread_cond_signal(&c->cv);
        if (c->prefault_started)
            pthread_cond_signal(&c->prefault_cv);
        pthread_mutex_unlock(&c->mu);
        pthread_join(c->thread, NULL);
        c->thread_started = 0;
    }
    if (c->prefault_started) {
        pthread_join(c->prefault, NULL);
        pthread_cond_destroy(&c->prefault_cv);
        c->prefault_started = 0;
    }
    for (size_t i = 0; i < c->map.cap; i++) {
        kvd__centry *e = c->map.vals[i];
        if (e && e->tier == KVD_TIER_HOST && !c->hpool.base)
            host_free(e->data, e->len);
        if (e)
            free(e->layout);
        free(e);
    }
    kvd__map_free(&c->map);
    if (c->dpool.base) {
        if (c->be)
            kvd_backend_dealloc(c->be, c->dpool.base);
        else
            free(c->dpool.base);
    }
    free(c->dpool.freel);
    if (c->hpool.base)
        kvd_backend_host_free(st->dev, c->hpool.base);
    free(c->hpool.freel);
    pthread_cond_destroy(&c->cv);
    pthread_cond_destroy(&c->moved);
    pthread_mutex_destroy(&c->mu);
}

/* ---- stats, expiry, eviction, disk limit ------------------------------------ */

int kvd_store_stats_get(kvd_store *st, kvd_store_stats *out)
{
    if (!st || !out)
        return KVD_EINVAL;
    memset(out, 0, sizeof *out);
    kvd__cache *c = &st->tiers;
    out->durability = st->durability;
    pthread_mutex_lock(&c->mu);
    for (int t = 0; t < 2; t++) {
        out->tier_limit[t] = c->tier[t].limit;
        out->tier_bytes[t] = c->tier[t].used;
        out->tier_pages[t] = c->tier[t].pages;
    }
    pthread_mutex_unlock(&c->mu);
    out->tier_limit[KVD_TIER_DISK] = st->disk_limit;
    out->tier_bytes[KVD_TIER_DISK] = atomic_load(&st->disk_bytes);
    out->tier_pages[KVD_TIER_DISK] = atomic_load(&st->disk_pages);
    for (int t = 0; t < 2; t++) {
        out->hits[t] = atomic_load(&c->hits[t]);
        out->evictions[t] = atomic_load(&c->evictions[t]);
    }
    out->misses = atomic_load(&c->misses);
    out->promotions = atomic_load(&c->promotions);
    out->prefetched = atomic_load(&c->prefetched);
    out->checksum_failures = atomic_load(&c->checksum_failures);
    out->sequences_dropped = atomic_load(&c->sequences_dropped);
    out->sequences_expired = atomic_load(&c->sequences_expired);
    out->device_pages_encoded = atomic_load(&c->device_pages_encoded);
    out->device_pages_placed = atomic_load(&c->device_pages_placed);
    out->device_fallbacks = atomic_load(&c->device_fallbacks);
    pthread_rwlock_rdlock(&st->lock);
    out->sequences = st->nseqs;
    pthread_rwlock_unlock(&st->lock);
    out->mem_appends = atomic_load(&st->append_buf_bytes);
    uint64_t v = 0;
    if (st->db && rocksdb_property_int(st->db, "rocksdb.cur-size-all-mem-tables", &v) == 0)
        out->mem_memtables = v;
    if (st->cache)
        out->mem_block_cache = rocksdb_cache_get_usage(st->cache);
    return 0;
}

/* Collect the ids of sequences matching a test, then delete each (deletion
 * takes the sequence's mutex, which may not be taken under st->lock). */
typedef struct id_list {
    uint8_t (*ids)[KVD_SEQ_ID_MAX];
    size_t *lens, n;
} id_list;

void kvd__expire(kvd_store *st)
{
    uint64_t now = kvd__now_ms();
    id_list l = {0};
    size_t cap = 0;
    pthread_rwlock_rdlock(&st->lock);
    for (size_t i = 0; i < st->nseqs; i++) {
        kvd__seq *s = st->seqs[i];
        uint64_t ex = atomic_load(&s->expires_ms);
        if (!ex || ex > now)
            continue;
        if (l.n == cap) {
            size_t nc = cap ? 2 * cap : 16;
            void *a = realloc(l.ids, nc * sizeof *l.ids);
            void *b = a ? realloc(l.lens, nc * sizeof *l.lens) : NULL;
            if (a)
                l.ids = a;
            if (!b)
                break;
            l.lens = b;
            cap = nc;
        }
        memcpy(l.ids[l.n], s->id, s->id_len);
        l.lens[l.n++] = s->id_len;
    }
    pthread_rwlock_unlock(&st->lock);
    for (size_t i = 0; i < l.n; i++) {
        kvd_error err;
        kvd_error_clear(&err);
        /* Re-check under the delete: an Append may have extended the TTL. */
        pthread_rwlock_rdlock(&st->lock);
        kvd__seq *s = kvd__seq_find(st, l.ids[i], l.lens[i], NULL);
        uint64_t ex = s ? atomic_load(&s->expires_ms) : 0;
        pthread_rwlock_unlock(&st->lock);
        if (!ex || ex > kvd__now_ms())
            continue;
        if (kvd_store_seq_delete(st, l.ids[i], l.lens[i], NULL, &err) == 0)
            atomic_fetch_add(&st->tiers.sequences_expired, 1);
    }
    free(l.ids);
    free(l.lens);
}

void kvd__disk_make_room(kvd_store *st, const kvd__seq *keep, uint64_t need)
{
    for (int guard = 0; guard < 1 << 20; guard++) {
        if (atomic_load(&st->disk_bytes) + need <= st->disk_limit)
            return;
        uint8_t id[KVD_SEQ_ID_MAX];
        size_t id_len = 0;
        uint64_t best = UINT64_MAX;
        pthread_rwlock_rdlock(&st->lock);
        for (size_t i = 0; i < st->nseqs; i++) {
            kvd__seq *s = st->seqs[i];
            uint64_t t = atomic_load(&s->last_access_ms);
            if (s == keep || t >= best)
                continue;
            best = t;
            memcpy(id, s->id, s->id_len);
            id_len = s->id_len;
        }
        pthread_rwlock_unlock(&st->lock);
        if (!id_len)
            return;
        kvd_error err;
        kvd_error_clear(&err);
        if (kvd_store_seq_delete(st, id, id_len, NULL, &err) == 0) {
            atomic_fetch_add(&st->tiers.sequences_dropped, 1);
            char idb[KVD__ID_STR_MAX];
            store_log("info", "msg=\"sequence dropped to stay under the disk limit\" seq=%s",
                      kvd__id_str(id, id_len, idb, sizeof idb));
        }
    }
}

int kvd_store_seq_evict(kvd_store *st, const void *id, size_t id_len, uint64_t *pages,
                        uint64_t *bytes, kvd_error *err)
{
    if (pages)
        *pages = 0;
    if (bytes)
        *bytes = 0;
    int rc = kvd__check_seq_id(id, id_len, err);
    if (rc)
        return rc;
    pthread_rwlock_rdlock(&st->lock);
    kvd__seq *s = kvd__seq_find(st, id, id_len, NULL);
    if (!s) {
        pthread_rwlock_unlock(&st->lock);
        char idb[KVD__ID_STR_MAX];
        return kvd_error_set(err, KVD_ENOTFOUND, "sequence %s not found",
                             kvd__id_str(id, id_len, idb, sizeof idb));
    }
    uint64_t np = 0, nb = 0;
    for (uint32_t l = 0; l < s->num_layers; l++)
        for (uint32_t i = 0; i < s->layers[l].npages; i++) {
            uint64_t b = kvd__cache_evict(st, s->layers[l].pages[i]->id);
            if (b) {
                np++;
                nb += b;
            }
        }
    pthread_rwlock_unlock(&st->lock);
    if (pages)
        *pages = np;
    if (bytes)
        *bytes = nb;
    return 0;
}

/* ---- expiry records ------------------------------------------------------- */

static void expiry_key(const kvd__seq *s, uint8_t *key, size_t *klen)
{
    key[0] = KVD__KEY_EXPIRY;
    memcpy(key + 1, s->id, s->id_len);
    *klen = s->id_len + 1;
}

void kvd__expiry_put(rocksdb_writebatch_t *b, const kvd__seq *s, uint64_t ttl_ms,
                     uint64_t expires_ms)
{
    uint8_t key[1 + KVD_SEQ_ID_MAX], v[16];
    size_t klen;
    expiry_key(s, key, &klen);
    for (int i = 0; i < 8; i++) {
        v[i] = (uint8_t)(ttl_ms >> (8 * i));
        v[8 + i] = (uint8_t)(expires_ms >> (8 * i));
    }
    rocksdb_writebatch_put(b, (const char *)key, klen, (const char *)v, sizeof v);
}

void kvd__expiry_delete(rocksdb_writebatch_t *b, const kvd__seq *s)
{
    uint8_t key[1 + KVD_SEQ_ID_MAX];
    size_t klen;
    expiry_key(s, key, &klen);
    rocksdb_writebatch_delete(b, (const char *)key, klen);
}

int kvd__load_expiry(kvd_store *st, kvd_error *err)
{
    int rc = 0;
    char start = KVD__KEY_EXPIRY;
    kvd__scan sc;
    rocksdb_iterator_t *it = kvd__scan_open(st, &sc, &start, 1);
    for (rocksdb_iter_seek(it, &start, 1); rocksdb_iter_valid(it); rocksdb_iter_next(it)) {
        size_t klen, vlen;
        const char *k = rocksdb_iter_key(it, &klen);
        if (klen == 0 || k[0] != KVD__KEY_EXPIRY)
            break;
        const uint8_t *v = (const uint8_t *)rocksdb_iter_value(it, &vlen);
        kvd__seq *s = klen > 1 ? kvd__seq_find(st, k + 1, klen - 1, NULL) : NULL;
        if (!s || vlen != 16)
            continue; /* a record left by a sequence that is gone: harmless */
        uint64_t ttl = 0, ex = 0;
        for (int i = 0; i < 8; i++) {
            ttl |= (uint64_t)v[i] << (8 * i);
            ex |= (uint64_t)v[8 + i] << (8 * i);
        }
        s->ttl_ms = ttl;
        atomic_store(&s->expires_ms, ex);
    }
    char *e = NULL;
    rocksdb_iter_get_error(it, &e);
    if (e) {
        rc = kvd_error_set(err, KVD_EINTERNAL, "rocksdb scan of expiry records failed: %s", e);
        rocksdb_free(e);
    }
    kvd__scan_close(&sc);
    return rc;
}

int kvd_store_seq_set_ttl(kvd_store *st, const void *id, size_t id_len, uint64_t ttl_ms,
                          kvd_error *err)
{
    kvd__seq *s;
    int rc = kvd__seq_acquire(st, id, id_len, &s, err);
    if (rc)
        return rc;
    char idb[KVD__ID_STR_MAX];
    pthread_mutex_lock(&s->mu);
    if (s->dead) {
        rc = kvd_error_set(err, KVD_ENOTFOUND, "sequence %s not found",
                           kvd__id_str(id, id_len, idb, sizeof idb));
    } else {
        uint64_t ex = ttl_ms ? kvd__now_ms() + ttl_ms : 0;
        rocksdb_writebatch_t *b = rocksdb_writebatch_create();
        if (ttl_ms)
            kvd__expiry_put(b, s, ttl_ms, ex);
        else
            kvd__expiry_delete(b, s);
        rc = kvd__db_write(st, b, err);
        rocksdb_writebatch_destroy(b);
        if (!rc) {
            pthread_rwlock_wrlock(&st->lock);
            s->ttl_ms = ttl_ms;
            atomic_store(&s->expires_ms, ex);
            pthread_rwlock_unlock(&st->lock);
        }
    }
    pthread_mutex_unlock(&s->mu);
    kvd__seq_unref(s);
    return rc;
}

/* ---- page acquisition for computations -------------------------------------- */

static int pages_acquire(kvd_store *st, const void *seq_id, size_t id_len, uint32_t layer,
                         uint64_t block, size_t n, int on_device, kvd_page_handle *hs,
                         kvd_error *err);

int kvd_store_page_acquire(kvd_store *st, const void *seq_id, size_t id_len, uint32_t layer,
                           uint64_t block, kvd_page_handle *h, kvd_error *err)
{
    return pages_acquire(st, seq_id, id_len, layer, block, 1, 0, h, err);
}

int kvd_store_page_acquire_device(kvd_store *st, const void *seq_id, size_t id_len, uint32_t layer,
                                  uint64_t block, int need, kvd_page_handle *h, kvd_error *err)
{
    return pages_acquire(st, seq_id, id_len, layer, block, 1, kvd_store_device(st) ? need : 0, h,
                         err);
}

/* What to load of pages [block, block + n) of a layer of a sequence, as of
 * its page table now: ws[i] for page block + i, read through one RocksDB
 * snapshot (*snap, the caller releases it). */
static int resolve_pages(kvd_store *st, const void *seq_id, size_t id_len, uint32_t layer,
                         uint64_t block, size_t n, kvd__tail_want *ws,
                         const rocksdb_snapshot_t **snap, kvd__seq **seq, kvd_error *err)
{
    *snap = NULL;
    *seq = NULL;
    int rc = kvd__check_seq_id(seq_id, id_len, err);
    if (rc)
        return rc;
    char idb[KVD__ID_STR_MAX];
    pthread_rwlock_rdlock(&st->lock);
    kvd__seq *s = kvd__seq_find(st, seq_id, id_len, NULL);
    if (!s) {
        pthread_rwlock_unlock(&st->lock);
        return kvd_error_set(err, KVD_ENOTFOUND, "sequence %s not found",
                             kvd__id_str(seq_id, id_len, idb, sizeof idb));
    }
    if (layer >= s->num_layers || block >= s->layers[layer].npages ||
        n > s->layers[layer].npages - block) {
        uint64_t miss = layer < s->num_layers && block < s->layers[layer].npages
                            ? s->layers[layer].npages
                            : block;
        pthread_rwlock_unlock(&st->lock);
        return kvd_error_set(err, KVD_ERANGE, "sequence %s has no page %llu on layer %u",
                             kvd__id_str(seq_id, id_len, idb, sizeof idb), (unsigned long long)miss,
                             layer);
    }
    for (size_t i = 0; i < n; i++) {
        const kvd__page *p = s->layers[layer].pages[block + i];
        ws[i] = (kvd__tail_want){.page_id = p->id,
                                 .layer = layer,
                                 .p0 = (block + i) * st->page_tokens,
                                 .need = p->num_tokens,
                                 .B = st->page_tokens,
                                 .H = s->model->info.num_kv_heads,
                                 .D = s->model->info.head_dim,
                                 .dtype = s->model->info.dtype};
    }
    atomic_store(&s->last_access_ms, kvd__now_ms());
    /* Pages and fragments must be read as of this page table: a concurrent
     * Append may merge the fragments into a page meanwhile. */
    *snap = rocksdb_create_snapshot(st->db);
    atomic_fetch_add(&s->refs, 1);
    *seq = s;
    pthread_rwlock_unlock(&st->lock);
    for (size_t i = 0; i < n; i++)
        ws[i].snap = *snap;
    return 0;
}

/* Fill h from entry e, pinned for it, found in tier `found`. A page in a
 * device pool the host does not read gets no bytes unless its layout
 * serves on_device: bring_down copies those. */
static void handle_from_entry(const kvd__cache *c, kvd__centry *e, int found, int on_device,
                              kvd_page_handle *h)
{
    h->priv_ = e;
    h->len = e->len;
    h->tier = found;
    h->device = e->tier == KVD_TIER_DEVICE ? e->data : NULL;
    if (e->tier == KVD_TIER_DEVICE && !c->pool_host) {
        if (layout_serves(e->layout, on_device))
            h->layout = e->layout;
    } else {
        h->bytes = e->data;
    }
}

/*
 * The pages of ws found in a memory tier with the tokens wanted, pinned and
 * handed out in hs (the others left zeroed, counted as misses). Those in the
 * host tier that nobody else holds are promoted together (promote_batch).
 */
static void acquire_cached(kvd_store *st, const kvd__tail_want *ws, size_t n, int on_device,
                           kvd_page_handle *hs)
{
    kvd__cache *c = &st->tiers;
    if (!have_tiers(c)) {
        atomic_fetch_add(&c->misses, n);
        return;
    }
    kvd__centry *up[KVD__DOWN_BATCH];
    size_t nup = 0;
    pthread_mutex_lock(&c->mu);
    if (c->dev_broken)
        drop_device(st);
    for (size_t i = 0; i < n; i++) {
        /* Waiting for a moving entry is safe here: this batch holds no entry
         * marked moving (promote_batch marks and settles its own). */
        kvd__centry *e = entry_settled(c, ws[i].page_id);
        if (!e || e->num_tokens < ws[i].need) {
            atomic_fetch_add(&c->misses, 1);
            continue;
        }
        atomic_fetch_add(&c->hits[e->tier], 1);
        lru_touch(c, e);
        hs[i].tier = e->tier;
        if (e->tier == KVD_TIER_HOST && e->pins == 0)
            up[nup++] = e;
        e->pins++;
        hs[i].priv_ = e;
        if (nup == KVD__DOWN_BATCH) {
            promote_batch(c, up, nup);
            nup = 0;
        }
    }
    promote_batch(c, up, nup);
    for (size_t i = 0; i < n; i++)
        if (hs[i].priv_)
            handle_from_entry(c, hs[i].priv_, hs[i].tier, on_device, &hs[i]);
    pthread_mutex_unlock(&c->mu);
}

/*
 * Load pages ws[idx[0..m)] (m <= KVD__DOWN_BATCH) from RocksDB, verified,
 * into hs: whole stored pages enter the memory tiers together
 * (kvd__cache_insert_batch, pinned for the handles), or are private copies
 * when no tier takes them; a tail held in fragments is handed out as one
 * page of its own.
 */
static int load_pages(kvd_store *st, const kvd__seq *s, const kvd__tail_want *ws, const size_t *idx,
                      size_t m, int on_device, kvd_page_handle *hs, kvd_error *err)
{
    kvd__tail pg[KVD__DOWN_BATCH];
    kvd__cache_put puts[KVD__DOWN_BATCH];
    kvd__centry *es[KVD__DOWN_BATCH];
    size_t at[KVD__DOWN_BATCH]; /* puts[k] is the page of hs[at[k]] */
    size_t loaded = 0, np = 0;
    int rc = 0;
    rocksdb_readoptions_t *ro = rocksdb_readoptions_create();
    rocksdb_readoptions_set_snapshot(ro, ws[idx[0]].snap);
    rocksdb_readoptions_set_verify_checksums(ro, 0); /* the page's own checksum is checked */
    for (; loaded < m && rc == 0; loaded++) {
        const kvd__tail_want *w = &ws[idx[loaded]];
        kvd_page_handle *h = &hs[idx[loaded]];
        if ((rc = kvd__tail_load(st, ro, w, &pg[loaded], err))) {
            if (rc == KVD_ECORRUPT)
                kvd__note_corrupt(st, w->page_id, err);
            break;
        }
        h->tier = KVD_TIER_DISK;
        if (pg[loaded].nfrags == 0) {
            size_t len;
            const char *v = rocksdb_pinnableslice_value(pg[loaded].ps, &len);
            puts[np] = (kvd__cache_put){.id = w->page_id,
                                        .page = (const uint8_t *)v,
                                        .len = len,
                                        .num_tokens = pg[loaded].num_tokens};
            at[np++] = idx[loaded];
            continue;
        }
        /* A tail assembled from fragments: hand out one page of it. */
        kvd_page_desc d = {.dtype = w->dtype,
                           .layer = w->layer,
                           .token_start = w->p0,
                           .num_tokens = pg[loaded].num_tokens,
                           .page_tokens = w->B,
                           .num_kv_heads = w->H,
                           .head_dim = w->D};
        uint8_t *own = NULL;
        rc = kvd_page_encode_raw(&d, pg[loaded].k, pg[loaded].v, &own, &h->len, err);
        h->bytes = h->buf_ = own;
    }
    rocksdb_readoptions_destroy(ro);
    if (rc == 0) {
        /* Into the tiers only while the sequence lives: a delete that ran
         * since the pages were resolved has dropped their ids already, and
         * would leave them there for good. Under the store's lock, a
         * delete starting now drops them once they are in. */
        pthread_rwlock_rdlock(&st->lock);
        if (s->dead)
            memset(es, 0, np * sizeof *es);
        else
            kvd__cache_insert_batch(st, puts, np, 1, es);
        pthread_rwlock_unlock(&st->lock);
    }
    for (size_t k = 0; k < np && rc == 0; k++) {
        kvd_page_handle *h = &hs[at[k]];
        if (es[k]) { /* pinned: its tier and bytes stay put until release */
            handle_from_entry(&st->tiers, es[k], KVD_TIER_DISK, on_device, h);
            atomic_fetch_add(&st->tiers.promotions, 1);
        } else if ((h->buf_ = malloc(puts[k].len))) {
            memcpy(h->buf_, puts[k].page, puts[k].len);
            h->bytes = h->buf_;
            h->len = puts[k].len;
        } else {
            rc = kvd_error_set(err, KVD_ENOMEM, "out of memory acquiring a page");
        }
    }
    for (size_t j = 0; j < loaded; j++)
        kvd__tail_release(&pg[j]);
    return rc;
}

/* Copy down, as batches, the pages of hs that lie in a device pool the
 * host does not read and were handed out without bytes or a layout. */
static int bring_down(kvd_store *st, kvd_page_handle *hs, size_t n, kvd_error *err)
{
    kvd_copy ops[KVD__DOWN_BATCH];
    size_t k = 0;
    for (size_t i = 0; i <= n; i++) {
        if (k == KVD__DOWN_BATCH || (i == n && k)) {
            int rc = kvd_backend_copy_batch(st->tiers.be, ops, k, err);
            if (rc) {
                pthread_mutex_lock(&st->tiers.mu);
                pool_failed(&st->tiers, rc);
                pthread_mutex_unlock(&st->tiers.mu);
                return kvd_error_set(err, KVD_EINTERNAL,
                                     "cannot copy a page out of the device tier");
            }
            k = 0;
        }
        kvd_page_handle *h = &hs[i];
        if (i == n || !h->priv_ || h->bytes || h->layout)
            continue;
        if (!(h->buf_ = malloc(h->len)))
            return kvd_error_set(err, KVD_ENOMEM, "out of memory acquiring a page");
        h->bytes = h->buf_;
        ops[k++] = (kvd_copy){.dst = h->buf_, .src = h->device, .bytes = h->len, .to_device = 0};
    }
    return 0;
}

/* Acquire the pages ws (all of one snapshot) into hs: from the memory tiers
 * (acquire_cached), the rest from RocksDB (load_pages), then what must come
 * down (bring_down). On an error no handle is held. */
static int acquire_pages(kvd_store *st, const kvd__seq *s, const kvd__tail_want *ws, size_t n,
                         int on_device, kvd_page_handle *hs, kvd_error *err)
{
    acquire_cached(st, ws, n, on_device, hs);
    size_t idx[KVD__DOWN_BATCH], m = 0;
    int rc = 0;
    for (size_t i = 0; i <= n && rc == 0; i++) {
        if (m == KVD__DOWN_BATCH || (i == n && m)) {
            rc = load_pages(st, s, ws, idx, m, on_device, hs, err);
            m = 0;
        }
        if (i < n && !hs[i].priv_)
            idx[m++] = i;
    }
    if (rc == 0)
        rc = bring_down(st, hs, n, err);
    if (rc)
        for (size_t i = 0; i < n; i++)
            kvd_store_page_release(st, &hs[i]);
    return rc;
}

int kvd_store_pages_acquire_device(kvd_store *st, const void *seq_id, size_t id_len, uint32_t layer,
                                   uint64_t block, size_t n, int need, kvd_page_handle *hs,
                                   kvd_error *err)
{
    return pages_acquire(st, seq_id, id_len, layer, block, n, kvd_store_device(st) ? need : 0, hs,
                         err);
}

static int pages_acquire(kvd_store *st, const void *seq_id, size_t id_len, uint32_t layer,
                         uint64_t block, size_t n, int on_device, kvd_page_handle *hs,
                         kvd_error *err)
{
    if (!hs && n)
        return kvd_error_set(err, KVD_EINVAL, "page acquire: NULL handle");
    if (!n)
        return 0;
    memset(hs, 0, n * sizeof *hs);
    kvd__tail_want one, *ws = n == 1 ? &one : malloc(n * sizeof *ws);
    if (!ws)
        return kvd_error_set(err, KVD_ENOMEM, "out of memory acquiring pages");
    const rocksdb_snapshot_t *snap;
    kvd__seq *s;
    int rc = resolve_pages(st, seq_id, id_len, layer, block, n, ws, &snap, &s, err);
    if (rc == 0) {
        rc = acquire_pages(st, s, ws, n, on_device, hs, err);
        rocksdb_release_snapshot(st->db, snap);
        kvd__seq_unref(s);
    }
    if (ws != &one)
        free(ws);
    return rc;
}

int kvd_store_page_in_tier(const kvd_page_handle *h)
{
    return h && h->priv_ && !h->buf_;
}

void kvd_store_page_release(kvd_store *st, kvd_page_handle *h)
{
    if (!h)
        return;
    kvd__cache_release(st, h->priv_);
    free(h->buf_);
    memset(h, 0, sizeof *h);
}

int kvd_store_page_prefetch(kvd_store *st, const void *seq_id, size_t id_len, uint32_t layer,
                            uint64_t block, uint32_t count, kvd_error *err)
{
    int rc = kvd__check_seq_id(seq_id, id_len, err);
    if (rc)
        return rc;
    char idb[KVD__ID_STR_MAX];
    pthread_rwlock_rdlock(&st->lock);
    kvd__seq *s = kvd__seq_find(st, seq_id, id_len, NULL);
    if (!s) {
        pthread_rwlock_unlock(&st->lock);
        return kvd_error_set(err, KVD_ENOTFOUND, "sequence %s not found",
                             kvd__id_str(seq_id, id_len, idb, sizeof idb));
    }
    if (layer >= s->num_layers) {
        pthread_rwlock_unlock(&st->lock);
        return kvd_error_set(err, KVD_EINVAL, "layer %u out of the model's %u layers", layer,
                             s->num_layers);
    }
    const kvd__layer *L = &s->layers[layer];
    for (uint64_t j = block; j < L->npages && j - block < count; j++) {
        kvd__prefetch_item it = {.page_id = L->pages[j]->id,
                                 .layer = layer,
                                 .need = L->pages[j]->num_tokens,
                                 .B = st->page_tokens,
                                 .H = s->model->info.num_kv_heads,
                                 .D = s->model->info.head_dim,
                                 .p0 = j * st->page_tokens,
                                 .dtype = s->model->info.dtype};
        kvd__cache_prefetch(st, &it);
    }
    pthread_rwlock_unlock(&st->lock);
    return 0;
}
