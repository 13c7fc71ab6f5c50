/*
 * kvdepot store: models, sequences and pages persisted in RocksDB.
 *
 * The store knows nothing about gRPC. It is thread-safe: any number of
 * threads may call into one kvd_store at once. Every function returns 0 or a
 * negative kvd_status and, on failure, fills `err` (which may be NULL) with a
 * message naming the problem. A failed call changes nothing.
 *
 * Tensor layout of Append and Read bytes (the wire layout): K then V, each
 * [layer][token][kv_head][head_dim] in the model dtype, little-endian.
 */
#ifndef KVDEPOT_STORE_H
#define KVDEPOT_STORE_H

#include <stddef.h>
#include <stdint.h>

#include "kvdepot/backend.h"
#include "kvdepot/status.h"
#include "kvdepot/tensor.h"

#define KVD_MODEL_NAME_MAX 128  /* bytes, [A-Za-z0-9._-] */
#define KVD_REVISION_MAX 128    /* bytes */
/* The format of a data directory, kept in its store record: a kvdepotd
 * opens its own format (and upgrades older ones in place: 1 is the first)
 * and refuses a newer one (KVD_EPRECOND). docs/upgrades.md. */
#define KVD_STORE_FORMAT 1
#define KVD_SEQ_ID_MAX 330      /* bytes, any value (kvdepotd: a tenant's namespace + 256) */
#define KVD_DEFAULT_PAGE_TOKENS 256

typedef struct kvd_store kvd_store;

typedef struct kvd_store_options {
    const char *data_dir;      /* created if missing */
    uint32_t page_tokens;      /* 0 = KVD_DEFAULT_PAGE_TOKENS; fixed at creation */
    int sync_writes;           /* 1 = fsync the WAL before an append is acknowledged */
    size_t block_cache_bytes;  /* RocksDB block cache; 0 = default */
    uint64_t max_seq_tokens;   /* 0 = no limit */
    /* Tiers (see "Tiers" below). Members appended; zero means the old
     * behaviour: no memory tiers, every read goes to RocksDB. */
    /* The compute backend: it codes pages and trains PQ centroids, on
     * host memory (the CPU backend), and holds the device tier when no
     * device is given. The caller keeps it alive until kvd_store_close.
     * NULL = the store creates a CPU backend of its own. */
    kvd_backend *backend;
    uint64_t device_tier_bytes; /* size of the device pool, allocated once at open */
    uint64_t host_tier_bytes;   /* host-memory tier below it */
    uint64_t disk_bytes;        /* page bytes RocksDB may hold; 0 = unlimited */
    uint64_t append_memory_bytes; /* what the buffers of appends in flight may hold together
                                   * (kvd_store_append_write, and what the service's
                                   * streams take: kvd_store_append_memory_take);
                                   * 0 = unlimited */
    int durability;             /* a kvd_durability; sync_writes = 1 means SYNC */
    uint32_t prefetch_pages;    /* read-ahead of a Read cursor, pages; 0 = none */
    /* A WAL record that fails its checksum: 0 = the open fails with
     * KVD_ECORRUPT naming the file (a torn last record, what a crash leaves,
     * is tolerated); 1 = keep what precedes it, drop the rest
     * (kvd_store_recovery_report says what was dropped). */
    int wal_point_in_time;
    /* Table and blob files RocksDB keeps open at most (its max_open_files,
     * at least 32); 0 = every one it has opened. */
    uint32_t max_open_files;
    /* 1 (kvdepotd repair): a sequence record that does not load (malformed,
     * or naming a model whose record was lost) is deleted, and listed in
     * kvd_store_recovery_losses (KVD_LOSS_UNREADABLE), instead of failing
     * the open. */
    int salvage;
    /* A device backend (CUDA) whose memory holds the device tier: pages are
     * coded on the host and copied up; kvd_store_page_acquire_device hands
     * them out where they lie. NULL = the device tier is in `backend`'s
     * memory. Kept alive by the caller until kvd_store_close. */
    kvd_backend *device;
} kvd_store_options;

/* What an acknowledged Append is guaranteed to survive (README, "Tiers,
 * limits and durability"). */
typedef enum kvd_durability {
    KVD_DURABILITY_SPILL = 0, /* written to RocksDB (WAL, not fsynced) before the reply */
    KVD_DURABILITY_NONE = 1,  /* pure cache: no WAL; disk limit drops LRU sequences */
    KVD_DURABILITY_SYNC = 2,  /* WAL fsynced before the reply */
} kvd_durability;

/* Open (creating if needed) the store in opt->data_dir. Fails with KVD_EINVAL
 * for bad options, KVD_EPRECOND if the directory was created with another
 * page size, KVD_ECORRUPT / KVD_EINTERNAL if RocksDB cannot open it.
 * *out is NULL on failure. */
int kvd_store_open(const kvd_store_options *opt, kvd_store **out, kvd_error *err);

/* Flush and close; NULL is a no-op. No call may be in flight. */
void kvd_store_close(kvd_store *st);

/* What the open dropped from a damaged WAL under wal_point_in_time (one
 * line per damaged stretch: file, bytes, reason), or "" when nothing. */
const char *kvd_store_recovery_report(const kvd_store *st);

/* Who computes RocksDB's CRC32C checksums (write-ahead log, blob files) in
 * this process, once a store has opened: "isa-l" (store/crc32c.c: ISA-L,
 * in hardware, serving RocksDB's calls) or "rocksdb" (RocksDB's own code;
 * Debian's computes it in software). */
const char *kvd_store_crc32c(void);

typedef struct kvd_repair_report {
    /* Blob files (the values of 4 KiB or more: pages, centroids, codes,
     * artifacts) moved into dir/repair-blobs by a MANIFEST rebuild. */
    uint64_t blob_files;
    /* The sequence ids the store held before the repair, read without
     * verifying checksums (none when it did not open): those the repaired
     * store lacks were lost with a damaged table. */
    uint8_t **ids;
    size_t *id_lens;
    size_t nids;
} kvd_repair_report;

void kvd_repair_report_clear(kvd_repair_report *r);

/* Repair the store in dir (not open). A lost CURRENT file whose MANIFEST
 * is intact is written again, pointing at the newest MANIFEST: nothing is
 * lost (*how = 1). Otherwise RocksDB's repair rebuilds the MANIFEST from
 * the table files, keeping every record it can read (*how = 2). RocksDB
 * 7.8's repair leaves the blob files out of the MANIFEST it writes (the
 * next open would delete them): they are moved into dir/repair-blobs first
 * (rep->blob_files), and the values they held answer DATA_LOSS (salvage.c).
 * Read every page afterwards to know what was lost (kvdepotd repair does).
 * rep may be NULL; otherwise clear it with kvd_repair_report_clear. */
int kvd_store_repair(const char *dir, int *how, kvd_repair_report *rep, kvd_error *err);

/* What a point-in-time WAL recovery at this open dropped, per sequence. */
typedef enum kvd_loss_kind {
    KVD_LOSS_SHORTER = 1,    /* came back with fewer tokens than acknowledged */
    KVD_LOSS_GONE = 2,       /* created after the damage: gone, with its tokens */
    KVD_LOSS_BACK = 3,       /* deleted after the damage: back */
    KVD_LOSS_UNKNOWN = 4,    /* a write to it was dropped; its record was unreadable */
    KVD_LOSS_UNREADABLE = 5, /* its record did not load (salvage): deleted */
} kvd_loss_kind;

typedef struct kvd_recovery_loss {
    uint8_t id[KVD_SEQ_ID_MAX];
    size_t id_len;
    int kind;                         /* kvd_loss_kind */
    int exists;                       /* the sequence is in the store now */
    uint64_t acknowledged, recovered; /* tokens (acknowledged 0 for BACK, UNKNOWN) */
} kvd_recovery_loss;

/* The losses of this open's point-in-time recovery (none without
 * wal_point_in_time, or when it dropped nothing): *out valid while the
 * store is open. Each sequence that still exists also carries the loss in
 * kvd_store_seq_stat. */
size_t kvd_store_recovery_losses(const kvd_store *st, const kvd_recovery_loss **out);

uint32_t kvd_store_page_tokens(const kvd_store *st);

/* NULL while the store can write; once a write met an I/O error (RocksDB
 * could not flush: no descriptor, no space, a failing disk), the error:
 * every later write fails the same way until the store is reopened, which
 * recovers every acknowledged write from the WAL. */
const char *kvd_store_broken(kvd_store *st);

/* The store's compute backend (kvd_store_options.backend, or its own), and
 * the same backend limited to one thread, which codes pages inside a
 * request: requests already run on many threads. Both live as long as the
 * store. */
kvd_backend *kvd_store_backend(kvd_store *st);
kvd_backend *kvd_store_coding_backend(kvd_store *st);
/* kvd_store_options.device, or NULL (also once the device was lost); and
 * the device it was opened with, lost or not (for stats and health). */
kvd_backend *kvd_store_device(kvd_store *st);
kvd_backend *kvd_store_device_opened(kvd_store *st);

/* The device stopped working (a sticky error): forget every page held in
 * its memory and keep no device tier from now on, so that later reads and
 * computations take pages from the host tier and RocksDB on the CPU
 * (RocksDB holds every page). Pinned pages are forgotten at their release. Returns the pages forgotten the
 * first time, 0 on later calls. */
uint64_t kvd_store_device_lost(kvd_store *st);

/* After work on the store's device ended with rc: 1 when it is to be done
 * again on the CPU, err cleared: the device was lost (KVD_EUNAVAIL; then
 * kvd_store_device_lost) or had no memory for it (KVD_ENOMEM). Counted
 * (kvd_store_stats.device_fallbacks). 0 for any other rc, or no device. */
int kvd_store_device_fallback(kvd_store *st, int rc, kvd_error *err);

/* ---- models ------------------------------------------------------------ */

typedef struct kvd_model_info {
    char name[KVD_MODEL_NAME_MAX + 1];
    char revision[KVD_REVISION_MAX + 1];
    uint32_t num_layers, num_kv_heads, num_q_heads, head_dim, hidden_size;
    kvd_dtype dtype; /* F16, BF16 or F32 */
    uint64_t created_unix_ms;
} kvd_model_info;

/* Validate a model description (name charset, bounds, GQA divisibility,
 * dtype). num_q_heads 0 is normalised to num_kv_heads. */
int kvd_model_validate(kvd_model_info *m, kvd_error *err);

/* Register a model. Identical re-put: OK with *created = 0. Different shape:
 * KVD_EEXIST unless replace and the model has no sequences (KVD_EPRECOND). */
int kvd_store_model_put(kvd_store *st, const kvd_model_info *m, int replace,
                        kvd_model_info *out, int *created, kvd_error *err);
int kvd_store_model_get(kvd_store *st, const char *name, kvd_model_info *out, kvd_error *err);
/* *out is a malloc'd array the caller frees with free(); NULL when *n == 0. */
int kvd_store_model_list(kvd_store *st, kvd_model_info **out, size_t *n, kvd_error *err);
/* KVD_EPRECOND if it has sequences and !force; force deletes them too. */
int kvd_store_model_delete(kvd_store *st, const char *name, int force, uint64_t *deleted_seqs,
                           kvd_error *err);

/* ---- sequences --------------------------------------------------------- */

typedef struct kvd_seq_info {
    uint8_t id[KVD_SEQ_ID_MAX];
    size_t id_len;
    char model[KVD_MODEL_NAME_MAX + 1];
    uint64_t num_tokens;     /* min over layer_tokens */
    uint32_t num_layers;
    uint64_t *layer_tokens;  /* num_layers entries; owned by the info, see below */
    uint32_t page_tokens;
    uint64_t sealed_pages;
    uint64_t stored_bytes;
    uint64_t created_unix_ms;
    uint64_t prefix_blocks;
    uint64_t *block_hashes;  /* n_block_hashes entries; owned by the info */
    size_t n_block_hashes;
    /* Activation storage (activation.h): tokens with stored X on every
     * layer, and the X bytes stored (also counted in stored_bytes). */
    uint64_t activation_tokens;
    uint64_t activation_bytes;
    int stores_activations; /* created with store_activations */
    /* The PQ index's centroid records (pqindex.h), one per layer trained,
     * also counted in stored_bytes; kvd_store_append_commit also says how
     * many of those bytes the append added (0 elsewhere). */
    uint64_t pq_bytes;
    uint64_t pq_bytes_added;
    /* Set by kvd_store_seq_stat when a point-in-time recovery of a damaged
     * write-ahead log (wal_point_in_time) dropped acknowledged writes of
     * the sequence: the tokens it had acknowledged (0: unknown, or it had
     * been deleted), those that came back, and when. Kept until the
     * sequence is deleted. */
    int recovery_loss;
    uint64_t loss_acknowledged, loss_recovered, loss_at_unix_ms;
} kvd_seq_info;

/* Release the arrays inside an info filled by the store (not the struct). */
void kvd_seq_info_clear(kvd_seq_info *info);

/* Create a sequence, optionally starting from a stored prefix chain (every
 * hash must be registered for the model: else KVD_ENOTFOUND). prefix_token_ids
 * (n_prefix * page_tokens ids, or NULL) are checked against the hashes.
 * KVD_EEXIST if the id is taken, KVD_ENOTFOUND for an unknown model. */
int kvd_store_seq_create(kvd_store *st, const void *id, size_t id_len, const char *model,
                         const uint64_t *prefix_hashes, size_t n_prefix,
                         const uint32_t *prefix_token_ids, size_t n_prefix_token_ids,
                         kvd_seq_info *out, kvd_error *err);

/*
 * What kvd_store_seq_create_ex writes besides the sequence record. A zeroed
 * struct adds nothing (kvd_store_seq_create).
 */
struct kvd_seq_codecs;
typedef struct kvd_seq_create_opts {
    /* The sequence's codecs (seqcodec.h), already checked with
     * kvd_seq_codecs_check; NULL = no codec record (raw pages). A VQ/SVD
     * spec takes a snapshot of the model's artifacts. */
    const struct kvd_seq_codecs *codecs;
    /* Expiry after this many ms without access (0 = never). */
    uint64_t ttl_ms;
    /* 1: store activations X from token 0 (activation.h); the model needs a
     * hidden_size (else KVD_EPRECOND) and there is no prefix (KVD_EINVAL). */
    int store_activations;
    /* 1: the sequence is made for an append that fills it next (kvdepotd's
     * Append with header.create). Until kvd_store_seq_pending_done names
     * it, a backup leaves it out, so that a backup never holds the empty
     * sequence of an append that was not acknowledged. */
    int pending;
} kvd_seq_create_opts;

/* The append a pending sequence was made for committed, or the sequence
 * was deleted again: a backup from now on keeps it like any other. */
void kvd_store_seq_pending_done(kvd_store *st, const void *id, size_t id_len);

/*
 * kvd_store_seq_create with the sequence's codec record (and the reference
 * on its artifact snapshot), expiry record and activation counts written in
 * the same RocksDB write as the sequence record: after a crash the sequence
 * exists with all of them or not at all. The sequence is visible only once
 * that write succeeded; on any error nothing was written and no snapshot
 * reference was taken. opts may be NULL. Returns kvd_store_seq_create's
 * codes, and KVD_EPRECOND naming a missing artifact or a model without
 * hidden_size, KVD_EINVAL for activations with a prefix, KVD_EINTERNAL when
 * the write fails. out as for kvd_store_seq_create.
 */
int kvd_store_seq_create_ex(kvd_store *st, const void *id, size_t id_len, const char *model,
                            const uint64_t *prefix_hashes, size_t n_prefix,
                            const uint32_t *prefix_token_ids, size_t n_prefix_token_ids,
                            const kvd_seq_create_opts *opts, kvd_seq_info *out,
                            kvd_error *err);
int kvd_store_seq_stat(kvd_store *st, const void *id, size_t id_len, kvd_seq_info *out,
                       kvd_error *err);
/* List sequences (of `model`, or all when NULL/empty) in id order, starting
 * after `after` (NULL = from the start), at most `limit` (0 = no limit). Id
 * order is bytewise, a shorter id before its extensions. *out is a malloc'd
 * array; free each with kvd_seq_info_clear and the array with free(). *more is
 * 1 when sequences remain after the last one returned. */
int kvd_store_seq_list(kvd_store *st, const char *model, const void *after, size_t after_len,
                       size_t limit, kvd_seq_info **out, size_t *n, int *more, kvd_error *err);
int kvd_store_seq_delete(kvd_store *st, const void *id, size_t id_len, uint64_t *freed_pages,
                         kvd_error *err);
/* Delete the sequence only while it is the one created at created_unix_ms
 * and holds `tokens` tokens summed over its layers (what an undone create
 * saw): else KVD_EPRECOND and it stays. */
int kvd_store_seq_delete_unchanged(kvd_store *st, const void *id, size_t id_len,
                                   uint64_t created_unix_ms, uint64_t tokens, kvd_error *err);

/* ---- append: a transaction fed with bytes ------------------------------- */

typedef struct kvd_append kvd_append;

typedef struct kvd_append_spec {
    const void *seq_id;
    size_t seq_id_len;
    uint32_t layer_start;
    uint32_t num_layers;   /* 0 = all from layer_start */
    uint64_t token_start;  /* must equal the stored token count of each layer */
    uint64_t num_tokens;   /* >= 1 */
    kvd_dtype dtype;       /* must equal the model dtype */
    const uint32_t *token_ids; /* num_tokens ids or NULL */
    size_t n_token_ids;
    const uint64_t *block_hashes; /* hashes of blocks completed by this append, or NULL */
    size_t n_block_hashes;
    /* The bytes carry X after K and V ([layer][token][hidden_size], model
     * dtype): only for a sequence storing activations whose layers have X
     * for every token before token_start (KVD_EPRECOND otherwise). */
    int with_activations;
} kvd_append_spec;

/* Start an append; validates the spec against the sequence and model.
 * *expected_bytes is the exact byte count write() must receive. */
int kvd_store_append_begin(kvd_store *st, const kvd_append_spec *spec, kvd_append **out,
                           uint64_t *expected_bytes, kvd_error *err);
/* Bytes of PQ index records the append may add at most: per layer it seals
 * a page of that has none yet, the centroid record and the codes record of
 * the pages sealed before (pqindex.h). Quotas reserve them with the
 * payload; the disk limit counts them. */
uint64_t kvd_store_append_index_bound(const kvd_append *ap);
/* Feed the next bytes (any split). More bytes than expected: KVD_EINVAL. */
int kvd_store_append_write(kvd_append *ap, const void *data, size_t len, kvd_error *err);
/* Count the next len bytes as received without their contents: the tokens
 * of pages given whole (kvd_store_append_give_page), which the commit does
 * not read unless the sequence keeps a PQ index. A commit that would read a
 * skipped byte (a page built from it, or a layer whose keys make PQ codes)
 * fails with KVD_EINVAL and stores nothing. Activation bytes cannot be
 * skipped. */
int kvd_store_append_skip(kvd_append *ap, size_t len, kvd_error *err);
/* Make the append durable and visible atomically. Fewer bytes than expected:
 * KVD_EINVAL. Fills *info (if not NULL). Frees ap in every case. */
int kvd_store_append_commit(kvd_append *ap, kvd_seq_info *info, kvd_error *err);
/* Drop an append; nothing becomes visible. NULL is a no-op. */
void kvd_store_append_abort(kvd_append *ap);

/* Memory that a call in flight holds outside an append's buffer (the pages
 * of an AppendPages stream, uploaded artifacts, calibration samples),
 * charged to the same cap as the appends' buffers (append_memory_bytes), so
 * that calls in flight together never hold more. 0, or KVD_ENOMEM naming
 * the cap, with nothing charged. Every byte taken is given back with
 * kvd_store_append_memory_give when the call ends. */
int kvd_store_append_memory_take(kvd_store *st, uint64_t bytes, kvd_error *err);
void kvd_store_append_memory_give(kvd_store *st, uint64_t bytes);

/* ---- read: a cursor producing bytes ------------------------------------- */

typedef struct kvd_read kvd_read;

typedef struct kvd_read_spec {
    const void *seq_id;
    size_t seq_id_len;
    uint32_t layer_start;
    uint32_t num_layers;   /* 0 = all from layer_start */
    uint64_t token_start;
    uint64_t num_tokens;   /* 0 = to the sequence's num_tokens */
    /* Activation-first: the bytes start with X of the first
     * activation_tokens tokens of the range ([layer][token][hidden_size]),
     * then K and V of the rest. More than the range: KVD_EINVAL; a sequence
     * without activations: KVD_EPRECOND; tokens without X: KVD_ERANGE. */
    uint64_t activation_tokens;
} kvd_read_spec;

typedef struct kvd_read_shape {
    uint32_t layer_start, num_layers;
    uint64_t token_start, num_tokens;
    uint32_t num_kv_heads, head_dim;
    kvd_dtype dtype;
    uint64_t total_bytes; /* K + V (of the tokens after the activation ones) */
    uint64_t activation_tokens;
    uint32_t hidden_size;
    uint64_t activation_bytes; /* X bytes that come first */
    /* The sequence's codecs (with its artifact snapshot), valid until
     * kvd_store_read_end; whether it was created with store_activations. */
    const struct kvd_seq_codecs *codecs;
    int stores_activations;
} kvd_read_shape;

/* Start a read (a consistent snapshot: later appends or deletes do not change
 * what it returns). Range past the stored tokens: KVD_ERANGE. The stored
 * tokens are those of every requested layer (the minimum over the layer
 * range), which is the sequence's num_tokens when all layers are read. */
int kvd_store_read_begin(kvd_store *st, const kvd_read_spec *spec, kvd_read **out,
                         kvd_read_shape *shape, kvd_error *err);
/* Copy up to cap next bytes into buf; *len = 0 at the end. A page failing its
 * checksum: KVD_ECORRUPT (no bytes of it are returned). */
int kvd_store_read_next(kvd_read *rd, void *buf, size_t cap, size_t *len, kvd_error *err);
void kvd_store_read_end(kvd_read *rd);

/* ---- prefix index ------------------------------------------------------- */

/* How many leading hashes of the chain are stored for the model (all layers
 * of the block sealed and registered). hashes[i] must name block i. A block
 * stays available while some sequence holds its pages: the one that wrote
 * it, or one created from the prefix; when the last goes, another sequence
 * holding an identical block (same hash, same position) takes over. */
int kvd_store_lookup(kvd_store *st, const char *model, const uint64_t *hashes, size_t n,
                     uint64_t *matched, kvd_error *err);

/* The documented prefix hash of one block (see kvdepot.proto):
 * XXH3_64bits_withSeed(le32 token ids, 4 * n, parent). */
uint64_t kvd_prefix_hash(uint64_t parent, const uint32_t *token_ids, size_t n);

/* ---- tiers, expiry, stats ----------------------------------------------
 *
 * Pages live in up to three tiers: a device pool (allocated once through the
 * backend; host memory on the CPU backend or without one), host memory, and
 * RocksDB, which holds every page under spill and sync (and, without a WAL,
 * under none). A tier that is full moves its least recently used unpinned
 * pages one tier down; a read or an acquire moves a page back to the device
 * tier. Memory tiers hold verified bytes: a page enters them only after its
 * checksum was checked on the way up from RocksDB, or when an Append wrote it.
 */

/* Tier indexes of kvd_store_stats and kvd_page_handle. */
#define KVD_TIER_DEVICE 0
#define KVD_TIER_HOST 1
#define KVD_TIER_DISK 2
#define KVD_TIERS 3

typedef struct kvd_store_stats {
    int durability;                 /* kvd_durability */
    uint64_t tier_limit[KVD_TIERS]; /* bytes; 0 = unlimited (disk) or off (memory) */
    uint64_t tier_bytes[KVD_TIERS]; /* page bytes held now */
    uint64_t tier_pages[KVD_TIERS]; /* pages held now */
    uint64_t hits[2];               /* page reads served by the device / host tier */
    uint64_t misses;                /* page reads that went to RocksDB */
    uint64_t promotions;            /* pages moved up (host -> device, disk -> memory) */
    uint64_t evictions[2];          /* pages moved down out of device / host */
    uint64_t prefetched;            /* pages loaded ahead of a reader */
    uint64_t checksum_failures;     /* pages (and activation records) refused as DATA_LOSS */
    uint64_t sequences_dropped;     /* dropped by the disk limit (durability none) */
    uint64_t sequences_expired;     /* deleted by their TTL */
    uint64_t sequences;             /* stored now */
    uint64_t device_pages_encoded;  /* pages an Append coded on the device */
    uint64_t device_fallbacks;      /* device work failed and done again on the CPU */
    uint64_t device_pages_placed;   /* pages an Append coded on the device and put in the device
                                     * tier where they were coded */
    /* Host memory of the store beside its tiers, now. */
    uint64_t mem_appends;     /* buffers of appends in flight (received, not yet committed) */
    uint64_t mem_memtables;   /* RocksDB's memtables */
    uint64_t mem_block_cache; /* RocksDB's block cache */
} kvd_store_stats;

/* Counters and gauges of the tiers; never fails for a non-NULL store. */
int kvd_store_stats_get(kvd_store *st, kvd_store_stats *out);

/* Set a sequence's time to live: it is deleted ttl_ms after its last
 * Append (or after this call when none follows); 0 = never. Persisted.
 * KVD_ENOTFOUND for an unknown id. */
int kvd_store_seq_set_ttl(kvd_store *st, const void *id, size_t id_len, uint64_t ttl_ms,
                          kvd_error *err);

/* An integer property of RocksDB (rocksdb_property_int: e.g.
 * "rocksdb.estimate-pending-compaction-bytes"); 0, or -1 when it has none. */
int kvd_store_db_property(kvd_store *st, const char *name, uint64_t *out);

/* A consistent copy of the store in dir (must not exist; its parent must):
 * RocksDB's checkpoint after a memtable flush. A sequence that was pending
 * (kvd_seq_create_opts.pending) at any moment while the checkpoint was
 * taken is deleted from the copy: the append that made it was not
 * acknowledged before the backup began, and the copy holds its data whole
 * or, this way, not at all. One backup runs at a time. *files / *bytes
 * (may be NULL) count what the directory holds. KVD_EEXIST, KVD_EPRECOND (no
 * parent), KVD_EINTERNAL (RocksDB's message). */
int kvd_store_backup(kvd_store *st, const char *dir, uint64_t *files, uint64_t *bytes,
                     kvd_error *err);

/* Move every page of a sequence out of the memory tiers (it stays in
 * RocksDB); pinned pages stay until released. *pages / *bytes (may be NULL)
 * count what left memory. KVD_ENOTFOUND for an unknown id. */
int kvd_store_seq_evict(kvd_store *st, const void *id, size_t id_len, uint64_t *pages,
                        uint64_t *bytes, kvd_error *err);

/* A page held for a computation: pinned in its memory tier (never evicted
 * while held) or, when no tier could take it, a private copy. `bytes` is the
 * whole page in the format of page.h, in host memory, checksum-verified when
 * it came from disk; `device` is the same page in the backend's memory when
 * it lies in the device tier, else NULL. Valid until release. */
typedef struct kvd_page_handle {
    const uint8_t *bytes; /* NULL from kvd_store_page_acquire_device when `layout` is set */
    size_t len;
    const void *device;
    /* kvd_store_page_acquire_device: where the page's K and V lie in
     * `device` (the page is in a device tier the host does not read) */
    const struct kvd_page_layout *layout;
    int tier;    /* KVD_TIER_* the page was found in (DISK: loaded for this call);
                  * it lies in the device tier now whenever `device` is set */
    void *priv_; /* owned by the store */
    void *buf_;
} kvd_page_handle;

/* Acquire page `block` (tokens [block*B, ...)) of `layer` of a sequence,
 * promoting it to the device tier. KVD_ENOTFOUND (sequence), KVD_ERANGE
 * (no such page), KVD_ECORRUPT (checksum: DATA_LOSS, counted). */
int kvd_store_page_acquire(kvd_store *st, const void *seq_id, size_t id_len, uint32_t layer,
                           uint64_t block, kvd_page_handle *h, kvd_error *err);
/* What a computation on the store's device reads of a page in place. */
#define KVD_ON_DEVICE_ATTEND 1 /* K and V, for a fused attention kernel (layout->attend) */
#define KVD_ON_DEVICE_PQ 2     /* the PQ codes (layout->pq_m) */

/* kvd_store_page_acquire for compute on the store's device
 * (kvd_store_options.device): a page in the device tier whose layout gives
 * what `need` (KVD_ON_DEVICE_* flags) asks for is handed out as `device` +
 * `layout` with no copy to the host (bytes NULL); any other page as
 * kvd_store_page_acquire hands it out. */
int kvd_store_page_acquire_device(kvd_store *st, const void *seq_id, size_t id_len, uint32_t layer,
                                  uint64_t block, int need, kvd_page_handle *h, kvd_error *err);
/* kvd_store_page_acquire_device for pages [block, block + n) of a layer,
 * hs[i] for page block + i, read as of one page table: the pages that must
 * move into the device tier go up as one batch of copies, and those that must
 * come down to the host as another, instead of one wait per page. On an
 * error no handle is held (all are zeroed). */
int kvd_store_pages_acquire_device(kvd_store *st, const void *seq_id, size_t id_len, uint32_t layer,
                                   uint64_t block, size_t n, int need, kvd_page_handle *hs,
                                   kvd_error *err);
/* Unpin; a zeroed or already released handle is a no-op. */
void kvd_store_page_release(kvd_store *st, kvd_page_handle *h);

/* 1 when the handle's bytes are a tier's (pinned there, costing no memory
 * of their own); 0 when they are a copy made for this handle (the tiers had
 * no room), which a caller holding many pages should let go of soon. */
int kvd_store_page_in_tier(const kvd_page_handle *h);

/* Ask the background thread to bring pages [block, block + count) of
 * `layer` into the memory tiers ahead of an acquire (pages past the end are
 * ignored; so are failures, which the acquire itself reports). Returns 0,
 * KVD_ENOTFOUND or KVD_EINVAL. */
int kvd_store_page_prefetch(kvd_store *st, const void *seq_id, size_t id_len, uint32_t layer,
                            uint64_t block, uint32_t count, kvd_error *err);

#endif /* KVDEPOT_STORE_H */
