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
 *   'S' id             sequence record with page tables (see sequence.c)
 *   'P' be64 page_id   one page in the format of page.h
 *   'T' be64 page_id be32 offset
 *                      a tail fragment of page page_id (see tail.c)
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
typedef struct kvd__layer {
    uint64_t tokens;
    uint32_t npages, cap;
    kvd__page **pages;
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
} kvd__seq;

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
};

uint64_t kvd__now_ms(void);
void kvd__page_key(uint8_t key[KVD__PAGE_KEY_LEN], uint64_t id);

/* Look-ups under st->lock (either mode). */
kvd__model *kvd__model_find(kvd_store *st, const char *name);
kvd__seq *kvd__seq_find(kvd_store *st, const void *id, size_t id_len, size_t *pos);

/* A sequence id for messages: printable ASCII as is, other bytes as \xNN,
 * in double quotes, cut with "..." to fit (cap >= 16). Returns out. */
#define KVD__ID_STR_MAX 80
const char *kvd__id_str(const void *id, size_t len, char *out, size_t cap);

/* Validate a sequence id argument. */
int kvd__check_seq_id(const void *id, size_t len, kvd_error *err);

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
int kvd__load_sequences(kvd_store *st, kvd_error *err);
int kvd__load_models(kvd_store *st, kvd_error *err);

#endif /* KVDEPOT_STORE_INTERNAL_H */
