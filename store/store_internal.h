/*
 * Internal state of a kvd_store, shared by the store's source files.
 *
 * Locking. st->lock (rwlock) guards the in-memory maps: models, the sorted
 * sequence array, prefix tables, and every field of a sequence and page that
 * other threads read. A writer of those fields holds it exclusively.
 * seq->mu serialises the writers of one sequence (append commit, delete), so
 * that a commit can build pages and write its RocksDB batch without the
 * store-wide lock and only take st->lock (exclusive) to publish the result.
 * Lock order: seq->mu, then st->lock.
 *
 * RocksDB keys (one column family):
 *   "\0meta"           store record: u8 version, u32 page_tokens
 *   'M' name           model record (see model.c)
 *   'S' id             sequence record with page tables and page sizes (see sequence.c)
 *   'P' be64 page_id   one page in the format of page.h
 *   'T' be64 page_id be32 offset
 *                      a tail fragment of page page_id (see tail.c)
 *   'X' id             expiry of sequence id: u64 ttl_ms, u64 expires_unix_ms (LE)
 *   'Q' be16 id_len id be32 layer  PQ centroids of one layer of a sequence (pqindex.h)
 *   'a' id             activation counts of sequence id (activation.h)
 *   'x' be16 id_len id be32 layer be64 token
 *                      activations X of a run of tokens (activation.h)
 *   (defined beside their code: 'A' model artifacts, artifact.c; 'C'
 *   sequence codecs, 'z' be64 hash / 'y' be64 hash an artifact snapshot
 *   shared by content and its reference count, 'Z' id a sequence's own
 *   snapshot of older stores, seqcodec.h)
 *
 * Memory tiers (tier.c) have their own mutex, cache->mu, taken last: never
 * call into the store's other locks while holding it.
 */
#ifndef KVDEPOT_STORE_INTERNAL_H
#define KVDEPOT_STORE_INTERNAL_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>

#include <rocksdb/c.h>

#include "page.h"
#include "store.h"

#define KVD__META_KEY "\0meta"
#define KVD__META_KEY_LEN 5
#define KVD__KEY_MODEL 'M'
#define KVD__KEY_SEQ 'S'
#define KVD__KEY_PAGE 'P'
#define KVD__KEY_FRAG 'T'
#define KVD__KEY_EXPIRY 'X'
#define KVD__KEY_ACT_META 'a'
#define KVD__KEY_ACT 'x'
#define KVD__PAGE_KEY_LEN 9
#define KVD__FRAG_KEY_LEN 13
#define KVD__MAX_FRAGS 32 /* fragments of one tail page before they are merged */
#define KVD__FRAGS_UNKNOWN UINT32_MAX
#define KVD__MAX_PAGE_BYTES (3ull << 30) /* below RocksDB's 4 GiB value limit */

/* One stored page. Sealed pages may be shared by several sequences through
 * the prefix index; the raw tail page of a layer belongs to one sequence. */
typedef struct kvd__page {
    uint64_t id;
    uint32_t refs;              /* sequences whose page table holds it */
    uint32_t num_tokens;        /* tokens in the page */
    uint64_t bytes;             /* encoded size, fragments included */
    uint32_t nfrags;            /* tail fragments stored beside it; KVD__FRAGS_UNKNOWN
                                 * for a partial page loaded at open */
    struct kvd__prefix *prefix; /* the prefix entry naming it, or NULL */
} kvd__page;

/* What kvd__tail_load should find: page page_id of `layer`, block starting at
 * token p0, with at least `need` tokens, in this shape; read at snap (or the
 * latest state when NULL). */
typedef struct kvd__tail_want {
    uint64_t page_id;
    uint32_t layer;
    uint64_t p0;
    uint32_t need;
    uint32_t B, H, D;
    kvd_dtype dtype;
    const rocksdb_snapshot_t *snap;
} kvd__tail_want;

/* A loaded page: K and V, each [kv_head][token][head_dim] of num_tokens
 * tokens, pointing into the pinned RocksDB value or into buf. */
typedef struct kvd__tail {
    rocksdb_pinnableslice_t *ps;
    uint8_t *buf;
    const uint8_t *k, *v;
    uint32_t num_tokens;
    uint32_t base_tokens;
    uint32_t nfrags;                   /* fragments read (0 when the base held enough) */
    uint32_t frag_off[KVD__MAX_FRAGS]; /* their keys' offsets */
} kvd__tail;

void kvd__frag_key(uint8_t key[KVD__FRAG_KEY_LEN], uint64_t page_id, uint32_t off);
/* Add the deletion of every fragment of page_id to b (a range deletion, for
 * a page that goes away with its sequence). */
void kvd__frag_delete_all(rocksdb_writebatch_t *b, uint64_t page_id);
/* Load a page and as many of its fragments as `need` requires, each
 * checksum-verified and checked against w. KVD_ECORRUPT for anything
 * missing or inconsistent. Release with kvd__tail_release. */
int kvd__tail_load(kvd_store *st, const rocksdb_readoptions_t *ro, const kvd__tail_want *w,
                   kvd__tail *out, kvd_error *err);
void kvd__tail_release(kvd__tail *t);

/* A prefix index entry: block `block` of some sequence, every layer sealed,
 * content-addressed by `hash`. It exists while its pages do. */
typedef struct kvd__prefix {
    uint64_t hash;
    uint64_t block;
    kvd__page **pages; /* num_layers entries */
} kvd__prefix;

/* Open-addressing map u64 -> pointer (keys are hashes or page ids). */
typedef struct kvd__map {
    uint64_t *keys;
    void **vals;
    size_t cap, n; /* cap is 0 or a power of two */
} kvd__map;

void *kvd__map_get(const kvd__map *m, uint64_t key);
int kvd__map_put(kvd__map *m, uint64_t key, void *val); /* replaces; 0 or KVD_ENOMEM */
void kvd__map_del(kvd__map *m, uint64_t key);
void kvd__map_free(kvd__map *m);

typedef struct kvd__model {
    kvd_model_info info;
    uint64_t nseqs;    /* live sequences of this model */
    kvd__map prefixes; /* hash -> kvd__prefix */
    int dead;
} kvd__model;

/* Per-layer page table: pages[i] covers tokens [i*B, i*B + pages[i]->num_tokens). */
/* A layer's PQ index records (pqindex.h). */
typedef struct kvd__pq_index {
    uint32_t bytes;   /* its centroid and codes records; 0 = none */
    uint32_t codes_n; /* its codes record: tokens [codes_t0, + codes_n); 0 = none */
    uint64_t codes_t0;
    /* The centroid record's version: a number no other record of the store
     * ever had (kvd__pq_new_gen), set when the record is written or loaded;
     * 0 = unknown (the record is then read, never taken from the cache). */
    uint64_t gen;
} kvd__pq_index;

typedef struct kvd__layer {
    uint64_t tokens;
    uint32_t npages, cap;
    kvd__page **pages;
    kvd__pq_index pq;
} kvd__layer;

typedef struct kvd__seq {
    uint8_t id[KVD_SEQ_ID_MAX];
    size_t id_len;
    kvd__model *model;
    uint64_t created_ms;
    uint64_t prefix_blocks;
    uint32_t num_layers;
    kvd__layer *layers;
    /* Block hashes known so far: hashes[i] is block i's (n_hashes, in order). */
    uint64_t *hashes;
    uint64_t n_hashes, cap_hashes;
    /* Token ids of tokens [n_hashes*B, n_hashes*B + n_ids) kept until their
     * block is hashed; ids of hashed blocks are not retained. */
    uint32_t *ids;
    uint64_t n_ids, cap_ids;
    /* Blocks whose hashes are registered or found in the prefix index. */
    uint64_t registered_blocks;

    pthread_mutex_t mu;
    atomic_int refs; /* the store's map holds one; appends in flight hold one each */
    int dead;        /* removed from the store (under st->lock) */

    uint64_t ttl_ms;                  /* 0 = no expiry (under s->mu and st->lock) */
    _Atomic uint64_t expires_ms;      /* unix ms; 0 = never */
    _Atomic uint64_t last_access_ms;  /* last read or append: LRU of whole sequences */

    /* Activation storage (activation.c): per layer, the leading tokens
     * with stored X; NULL when the sequence stores none. Written under
     * s->mu and st->lock. */
    uint64_t *act_tokens;
} kvd__seq;

/* ---- memory tiers (tier.c) ---------------------------------------------- */

/* One page held in a memory tier: its whole encoding (page.h), verified. */
typedef struct kvd__centry {
    uint64_t id;
    uint8_t *data;        /* device tier: pool + off; host tier: malloc'd */
    size_t len;           /* page bytes */
    size_t alloc;         /* bytes charged to the tier (len rounded up) */
    uint64_t off;         /* offset in the device pool */
    uint32_t num_tokens;  /* tokens the page holds */
    int tier;             /* KVD_TIER_DEVICE or KVD_TIER_HOST */
    uint32_t pins;        /* readers and acquirers using data now */
    int dead;             /* out of the map and lists; freed at the last unpin */
    int moving;           /* being copied into the device tier, cache->mu released:
                           * pinned by the copier; acquirers wait (cache->moved) */
    /* device tier of a pool the host does not read: where K and V lie
     * (NULL when the page's codecs need more than the page) */
    struct kvd_page_layout *layout;
    struct kvd__centry *prev, *next; /* LRU list of its tier, head = most recent */
} kvd__centry;

typedef struct kvd__tier {
    uint64_t limit, used, pages;
    kvd__centry *head, *tail;
} kvd__tier;

typedef struct kvd__free_range {
    uint64_t off, len;
} kvd__free_range;

/* One block of memory carved by a first-fit allocator (tier.c). */
typedef struct kvd__pool {
    uint8_t *base;
    kvd__free_range *freel; /* free ranges, sorted by offset */
    size_t nfree, capfree;
    uint64_t size;
    /* Ranges have been handed out up to reach; [0, mapped) is mapped ahead of
     * it by the cache's prefault thread, which grow (non-NULL) wakes. */
    uint64_t reach, mapped;
    pthread_cond_t *grow;
} kvd__pool;

typedef struct kvd__prefetch_item {
    uint64_t page_id;
    uint32_t layer, need, B, H, D;
    uint64_t p0;
    kvd_dtype dtype;
} kvd__prefetch_item;

#define KVD__PREFETCH_QUEUE 64

typedef struct kvd__cache {
    pthread_mutex_t mu;
    kvd__map map; /* page id -> kvd__centry */
    kvd__tier tier[2];
    kvd_backend *be;      /* NULL: the pool is malloc'd host memory */
    int pool_host;        /* pool bytes are addressable by the CPU */
    _Atomic int dev_broken; /* a pool copy failed on a device an error left unusable */
    int dev_gone;         /* the device tier was dropped (kvd_store_device_lost) */
    kvd__pool dpool;      /* the device tier */
    kvd__pool hpool;      /* the host tier when it is one pinned block of the
                           * device's (base NULL: one mapping per page) */
    /* Counters, kvd_store_stats order. */
    _Atomic uint64_t hits[2], misses, promotions, evictions[2], prefetched;
    _Atomic uint64_t checksum_failures, sequences_dropped, sequences_expired;
    _Atomic uint64_t device_pages_encoded, device_fallbacks, device_pages_placed;

    /* Background thread: read-ahead of cursors, TTL expiry. */
    pthread_t thread;
    int thread_started, stop;
    pthread_cond_t cv;
    pthread_cond_t moved; /* an entry stopped moving */
    kvd__prefetch_item queue[KVD__PREFETCH_QUEUE];
    size_t qhead, qlen;

    /* The CPU's device tier is memory the kernel maps at first touch: a
     * thread maps dpool ahead of its reach (tier.c, prefault_main), so that
     * the Appends that fill a fresh server's tier do not take the page
     * faults. */
    pthread_t prefault;
    int prefault_started;
    pthread_cond_t prefault_cv;
} kvd__cache;

int kvd__cache_init(kvd_store *st, const kvd_store_options *opt, kvd_error *err);
void kvd__cache_fini(kvd_store *st);
/* Start the background thread (after recovery). */
int kvd__cache_start(kvd_store *st, kvd_error *err);
/* Pin the entry of page id holding at least `need` tokens and move it to the
 * device tier when it can; NULL on a miss (counted). *bytes is host-readable
 * page memory (*tmp a malloc'd copy to free when the pool is not). */
kvd__centry *kvd__cache_acquire(kvd_store *st, uint64_t id, uint32_t need, const uint8_t **bytes,
                                uint8_t **tmp);
void kvd__cache_release(kvd_store *st, kvd__centry *e);
/* Put a verified page (len bytes, copied) in the device tier, moving others
 * down to make room; nothing happens when no tier can take it. pin = 1
 * returns it pinned (NULL when it was not cached). */
kvd__centry *kvd__cache_insert(kvd_store *st, uint64_t id, const uint8_t *page, size_t len,
                               uint32_t num_tokens, int pin);
/* A range of the device tier's pool held for a page about to be written
 * there (kvd__cache_reserve); alloc 0: none. */
typedef struct kvd__slot {
    uint64_t off, alloc;
    uint8_t *data; /* device memory */
} kvd__slot;
/* Hold a range of the device pool for a page of len bytes that the caller
 * writes there with the store's device (an append coded on the device puts
 * its pages where they will stay): charged to the device tier, moving
 * others down to make room. 0, or -1 (slot zeroed) when the device tier
 * cannot take it or its pool is host memory. */
int kvd__cache_reserve(kvd_store *st, size_t len, kvd__slot *slot);
/* Give a slot back unused. */
void kvd__cache_unreserve(kvd_store *st, kvd__slot *slot);
/* A page for kvd__cache_insert_batch. */
typedef struct kvd__cache_put {
    uint64_t id;
    const uint8_t *page;
    size_t len;
    uint32_t num_tokens;
    kvd__slot slot; /* the page already written there, or none */
} kvd__cache_put;
/* kvd__cache_insert of n pages: those the device tier takes go up as one
 * batch of copies (per 64 pages) instead of one wait each; a page with a
 * slot enters the device tier there without a copy (when the device is
 * gone, or the page is cached already with as many tokens, the slot is
 * given back). The slots are the call's. With pin, out[i] is page i's entry
 * pinned (NULL when it was not cached); out may be NULL without. */
void kvd__cache_insert_batch(kvd_store *st, const kvd__cache_put *ps, size_t n, int pin,
                             kvd__centry **out);
/* Forget page id (the page is gone). */
void kvd__cache_drop(kvd_store *st, uint64_t id);
/* Move page id out of memory; returns bytes freed (0 if not cached or pinned). */
uint64_t kvd__cache_evict(kvd_store *st, uint64_t id);
void kvd__cache_prefetch(kvd_store *st, const kvd__prefetch_item *it);
/* A page failed its checksum: count and log. */
void kvd__note_corrupt(kvd_store *st, uint64_t page_id, const kvd_error *err);

struct kvd_store {
    rocksdb_t *db;
    rocksdb_options_t *dbopt;
    rocksdb_cache_t *cache;
    rocksdb_block_based_table_options_t *bbopt;
    rocksdb_writeoptions_t *wopt;
    rocksdb_readoptions_t *ropt;
    uint32_t page_tokens;
    uint64_t max_seq_tokens;

    pthread_rwlock_t lock;
    kvd__model **models;
    size_t nmodels, cap_models;
    kvd__seq **seqs; /* sorted by id (memcmp, then length) */
    size_t nseqs, cap_seqs;
    atomic_uint_fast64_t next_page_id;

    int durability;                 /* kvd_durability */
    uint64_t disk_limit;            /* page bytes; 0 = unlimited */
    _Atomic uint64_t disk_bytes;    /* page bytes in RocksDB (fragments included) */
    _Atomic uint64_t disk_pages;
    _Atomic uint64_t append_buf_bytes; /* buffers of appends not yet committed or aborted */
    uint64_t append_limit;             /* cap on append_buf_bytes; 0 = none */
    uint32_t prefetch_pages;
    kvd__cache tiers;
    /* Buffers of finished appends and write batches kept for the next
     * ones (batch.c). */
#define KVD__BATCH_KEEP 2
    pthread_mutex_t batch_mu;
    struct {
        uint8_t *buf;
        size_t cap;
    } batch_free[KVD__BATCH_KEEP];
    size_t nbatch_free;
    _Atomic uint64_t batch_kept_bytes;

    /* Centroid records lately read (pqindex.c), by version (kvd__pq_index.gen):
     * a Search reads its layer's record on every call. */
    pthread_mutex_t pqc_mu;
    struct kvd__pq_cached *pqc; /* KVD__PQ_CACHE_ENTRIES slots */
    uint64_t pqc_bytes, pqc_tick;
    _Atomic uint64_t pq_gen, pqc_hits;

    kvd_backend *be;       /* compute backend (options.backend or own_be) */
    kvd_backend *own_be;   /* created at open when none was given */
    kvd_backend *dev;      /* options.device: holds the device tier, or NULL */
    _Atomic int dev_lost;  /* kvd_store_device_lost was called */
    _Atomic int broken;    /* a write met an I/O error (kvd_store_broken) */
    _Atomic int broken_claim; /* the first such write, which fills broken_why */
    char broken_why[512];  /* set once, before broken */
    kvd_backend be_coding; /* be limited to one thread: page coding */
    /* Sequences made for an append not committed yet
     * (kvd_seq_create_opts.pending). While a backup runs, those done keep
     * their entry (done = 1), so that the backup sees every sequence that
     * was pending at some moment of it. pend_mu after st->lock. */
    pthread_mutex_t pend_mu, backup_mu;
    struct kvd__pending *pending;
    int backup_running;
    char recovery_report[1024]; /* kvd_store_recovery_report */
    kvd_recovery_loss *losses;  /* kvd_store_recovery_losses */
    int salvage;                /* kvd_store_options.salvage */
    size_t nlosses;
};

/* An entry of kvd_store.pending. */
typedef struct kvd__pending {
    struct kvd__pending *next;
    int done;
    uint64_t created_ms; /* the sequence's: a later one of the same id is another */
    size_t len;
    uint8_t id[];
} kvd__pending;

/* Enter the preallocated entry p (from kvd__pending_new) in st->pending. */
kvd__pending *kvd__pending_new(const void *id, size_t len);
void kvd__pending_add(kvd_store *st, kvd__pending *p);

uint64_t kvd__now_ms(void);
void kvd__page_key(uint8_t key[KVD__PAGE_KEY_LEN], uint64_t id);

/* A repair's blob files (salvage.c): moved from dir into dir/repair-blobs
 * before RocksDB's repair; *moved counts them. */
int kvd__blob_stash(const char *dir, uint64_t *moved, kvd_error *err);
/* The sequence ids of the store in dir, read without verifying checksums
 * (into r->ids); nothing when it does not open. 0 or KVD_ENOMEM. */
int kvd__seq_ids_unverified(const char *dir, kvd_repair_report *r);

/* Look-ups under st->lock (either mode). */
kvd__model *kvd__model_find(kvd_store *st, const char *name);
kvd__seq *kvd__seq_find(kvd_store *st, const void *id, size_t id_len, size_t *pos);

/* A sequence id for messages: printable ASCII as is, other bytes as \xNN,
 * in double quotes, cut with "..." to fit (cap >= 16). Returns out. */
#define KVD__ID_STR_MAX 80
const char *kvd__id_str(const void *id, size_t len, char *out, size_t cap);

/* Validate a sequence id argument. */
int kvd__check_seq_id(const void *id, size_t len, kvd_error *err);

/* *out = the sequence `id` with a reference taken (drop it with
 * kvd__seq_unref). 0, KVD_EINVAL (bad id) or KVD_ENOTFOUND. The caller
 * still checks s->dead under s->mu. */
int kvd__seq_acquire(kvd_store *st, const void *id, size_t id_len, kvd__seq **out,
                     kvd_error *err);
void kvd__seq_unref(kvd__seq *s);
void kvd__seq_free(kvd__seq *s);
int kvd__seq_fill_info(kvd_store *st, const kvd__seq *s, kvd_seq_info *out, kvd_error *err);
/* Serialise the sequence record (malloc'd *buf) with the page tables given
 * by `layers` (which may be a proposed new state). */
int kvd__seq_encode(const kvd_store *st, const kvd__seq *s, const kvd__layer *layers,
                    const uint64_t *hashes, uint64_t n_hashes, const uint32_t *ids, uint64_t n_ids,
                    uint8_t **buf, size_t *len, kvd_error *err);
void kvd__seq_key(const kvd__seq *s, uint8_t *key, size_t *klen);

/* Register every complete block with a known hash (under st->lock, exclusive). */
void kvd__prefix_register(kvd_store *st, kvd__seq *s);
/* Drop one sequence's reference to a page (under st->lock, exclusive). On
 * the last one the page is freed and its prefix entry, if any, removed: its
 * hash is appended to dropped (room for one per freed page). The caller has
 * already deleted the page from RocksDB. */
void kvd__page_drop(kvd_store *st, kvd__model *m, kvd__page *p, uint64_t *dropped,
                    size_t *ndropped);
/* After entries were dropped: let another sequence of the model holding a
 * block with one of those hashes take the entry over. */
void kvd__prefix_reregister(kvd_store *st, kvd__model *m, const uint64_t *dropped, size_t n);

int kvd__db_write(kvd_store *st, rocksdb_writebatch_t *b, kvd_error *err);

/* A write batch in a buffer of kvdepot's (batch.c): records in RocksDB's
 * write-batch format (buf[0, len) is always a whole batch), page bytes
 * written in place, the whole handed to RocksDB at the write. Records added to a RocksDB batch `b`
 * alongside are moved in first at every put and at the write, so the order of all the records is
 * the order they were added in. */
typedef struct kvd__batch {
    kvd_store *st;
    uint8_t *buf;
    size_t len, cap;
    uint32_t count;
    int failed; /* out of memory: the write fails */
} kvd__batch;
void kvd__batch_pool_init(kvd_store *st);
void kvd__batch_pool_fini(kvd_store *st);
/* A buffer of at least need bytes: the smallest kept one that is large
 * enough, or a new one of need bytes; *cap = its size. NULL: out of memory. */
uint8_t *kvd__buf_take(kvd_store *st, size_t need, size_t *cap);
/* Keep buf (cap bytes) for a later kvd__buf_take, or free it. */
void kvd__buf_give(kvd_store *st, uint8_t *buf, size_t cap);
/* Start a batch, with room for about hint bytes of records (0: none yet). */
void kvd__batch_init(kvd__batch *wb, kvd_store *st, size_t hint);
/* Its buffer goes back to the store (kvd__buf_give). */
void kvd__batch_release(kvd__batch *wb);
/* Move b's records in (b is cleared); 0, or -1 when out of memory. */
int kvd__batch_take(kvd__batch *wb, rocksdb_writebatch_t *b);
/* Add a Put of key with a value of vlen bytes, after b's records (b may be
 * NULL); returns where the caller writes the value, valid until the next
 * call on wb, or NULL when out of memory (the batch has failed). */
uint8_t *kvd__batch_put(kvd__batch *wb, rocksdb_writebatch_t *b, const void *key, size_t klen,
                        size_t vlen);
/* Write the batch (b's records last) through kvd__db_write. */
int kvd__batch_write(kvd__batch *wb, rocksdb_writebatch_t *b, kvd_error *err);
/* Tests: while > 0, kvd__db_write fails (KVD_EINTERNAL) without writing and
 * decrements it. 0 outside tests. */
extern _Atomic int kvd__fault_db_write;
/* Writes kvd__db_write made (for tests counting a change's writes). */
extern _Atomic uint64_t kvd__db_writes;
/* Expiry record of a sequence (key 'X' id). */
void kvd__expiry_put(rocksdb_writebatch_t *b, const kvd__seq *s, uint64_t ttl_ms,
                     uint64_t expires_ms);
void kvd__expiry_delete(rocksdb_writebatch_t *b, const kvd__seq *s);
int kvd__load_expiry(kvd_store *st, kvd_error *err);
/* Durability none: delete least recently used sequences other than `keep`
 * until `need` more bytes fit under the disk limit. */
void kvd__disk_make_room(kvd_store *st, const kvd__seq *keep, uint64_t need);
/* Delete the sequences whose TTL passed. */
void kvd__expire(kvd_store *st);
/* Blob files hold the page bytes; RocksDB's compactions leave them alone
 * (store.c). When deleted pages make up half of what they hold, and at
 * least min_garbage bytes, compact everything once with garbage collection
 * on, which rewrites the live pages and drops the old files (*ran = 1).
 * The tiers' background thread checks every KVD__BLOB_GC_EVERY_MS (and
 * then hands the memory malloc holds free back to the system). 0, or -1
 * when RocksDB refused the settings. */
#define KVD__BLOB_GC_EVERY_MS 10000
#define KVD__BLOB_GC_MIN ((uint64_t)64 << 20)
int kvd__blob_gc(kvd_store *st, uint64_t min_garbage, int *ran);
int kvd__load_sequences(kvd_store *st, kvd_error *err);

/* An iterator over the keys that start with a prefix (at most 64 bytes),
 * bounded above so that it never steps onto a key past them: the scans of
 * small records at start do not read a page's value (in a blob file that
 * may be damaged). Close with kvd__scan_close. */
typedef struct kvd__scan {
    rocksdb_iterator_t *it;
    rocksdb_readoptions_t *ro;
    char upper[64];
} kvd__scan;
rocksdb_iterator_t *kvd__scan_open(kvd_store *st, kvd__scan *sc, const void *prefix, size_t plen);
void kvd__scan_close(kvd__scan *sc);

/* walscan.c: tokens readable on every layer of a sequence record (-2 when
 * it does not parse); the sequence-record writes of the WAL files in dir
 * (before a point-in-time recovery opens them; NULL on no memory); after
 * it, the losses of the writes numbered above `latest` (the recovered
 * database's last sequence number): into st->losses and 'L' records. */
int64_t kvd__seq_record_tokens(const uint8_t *v, size_t vlen);
void *kvd__wal_scan(const char *dir);
int kvd__wal_losses(kvd_store *st, void *scan, uint64_t latest, kvd_error *err);
void kvd__wal_scan_free(void *scan);
/* The 'L' record of a sequence (1 found, 0 none); its delete into b. */
int kvd__loss_get(kvd_store *st, const void *id, size_t id_len, uint64_t *acknowledged,
                  uint64_t *recovered, uint64_t *at_ms);
void kvd__loss_delete(struct rocksdb_writebatch_t *b, const kvd__seq *s);

/* ---- activations (activation.c; layout in activation.h) ------------------ */

typedef struct kvd__act_cursor kvd__act_cursor;
/* X bytes of one token of one layer (hidden_size x dtype size). */
uint64_t kvd__act_token_bytes(const kvd__seq *s);
/* Tokens with activations on every layer, and the X bytes stored (st->lock). */
void kvd__act_info(const kvd__seq *s, uint64_t *tokens, uint64_t *bytes);
/* May an append at token ts of layers [ls, ls + nl) carry X? *x_bytes: how
 * many (layer-major after K and V). KVD_EPRECOND naming the reason. */
int kvd__act_check(const kvd__seq *s, uint32_t ls, uint32_t nl, uint64_t ts, uint64_t n,
                   uint64_t *x_bytes, kvd_error *err);
/* Commit of such an append (s->mu held): re-check, put the X records and the
 * new counts in b; *counts (malloc'd) goes to kvd__act_publish. */
int kvd__act_stage(kvd_store *st, const kvd__seq *s, uint32_t ls, uint32_t nl, uint64_t ts,
                   uint64_t n, const uint8_t *x, rocksdb_writebatch_t *b, uint64_t **counts,
                   kvd_error *err);
/* Once the batch is durable (st->lock exclusive): take the counts over. */
void kvd__act_publish(kvd_store *st, kvd__seq *s, uint64_t *counts);
/* Add the deletion of every activation record of s to b. */
void kvd__act_delete(rocksdb_writebatch_t *b, const kvd__seq *s);
/* Put the activation counts of s, all 0 (activations on, none stored), in
 * b; *counts (malloc'd, NULL on failure) becomes s->act_tokens once b is
 * written. */
int kvd__act_enable_stage(rocksdb_writebatch_t *b, const kvd__seq *s, uint64_t **counts,
                          kvd_error *err);
/* After that batch is durable (st->lock exclusive): drop the counts. */
void kvd__act_forget(kvd_store *st, kvd__seq *s);
/* At open, after the sequences: their activation counts. */
int kvd__act_load(kvd_store *st, kvd_error *err);
/* A cursor over X of layers [ls, ls + nl) x tokens [ts, ts + n) in the wire
 * layout [layer][token][hidden_size], on its own snapshot (st->lock held to
 * open). KVD_EPRECOND (no activations stored), KVD_ERANGE (tokens without). */
int kvd__act_cursor_open(kvd_store *st, const kvd__seq *s, uint32_t ls, uint32_t nl, uint64_t ts,
                         uint64_t n, kvd__act_cursor **out, kvd_error *err);
uint64_t kvd__act_cursor_bytes(const kvd__act_cursor *c);
/* Up to cap next bytes; *len < cap only at the end. KVD_ECORRUPT for a
 * record failing its checksum or missing. */
int kvd__act_cursor_read(kvd__act_cursor *c, uint8_t *buf, size_t cap, size_t *len,
                         kvd_error *err);
void kvd__act_cursor_close(kvd__act_cursor *c);
int kvd__load_models(kvd_store *st, kvd_error *err);

/* Calls RocksDB made to kvdepot's CRC32C (store/crc32c.c; 0 without ISA-L). */
uint64_t kvd__crc32c_calls(void);

#endif /* KVDEPOT_STORE_INTERNAL_H */
