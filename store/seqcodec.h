/*
 * Codecs of a sequence, fixed at creation: what its pages become when they
 * seal. Persisted under the RocksDB key 'C' ‖ sequence id (store_internal.h)
 * as
 *
 *   u8 version (3) | K spec | V spec | u32 raw_sink_tokens |
 *   u32 pq_m | u8 pq_bits | u32 pq_iterations |
 *   K vq_sub_dim, K vq_bits, K svd, V vq_sub_dim, V vq_bits, V svd (u8 each) |
 *   u64 snapshot hash (XXH3 of the snapshot's bytes; 0 = none) |
 *   u32 pq_min_train_tokens   (only in records of sequences with a PQ index)
 *   spec = u8 codec, u16 group, u8 axis, u8 rounding, u64 seed   (13 bytes)
 *
 * little-endian. Version 3: the snapshot is the shared record of that hash;
 * version 2: the sequence's own snapshot ('Z' below), or none; version 1
 * records (without the last 14 bytes) and version 2 records without the
 * hash still read; a record without pq_min_train_tokens reads as 1 (the
 * index trained at the first sealing page, as it was before the field). A sequence without the key
 * stores raw pages.
 *
 * A sequence with VQ or SVD has a snapshot of the model's artifacts its
 * codecs need (kvd_codec_arts_serialize), taken at CreateSequence:
 * recalibrating the model later never changes what the sequence's pages
 * decode to. Sequences made from the same artifacts have byte-identical
 * snapshots, so one record serves them all:
 *
 *   'z' ‖ be64 hash   the snapshot's bytes (hash = their XXH3)
 *   'y' ‖ be64 hash   u64 LE: the codec records (version 3) naming it
 *
 * The count changes in the same WriteBatch as the codec record that takes
 * or drops the reference (the sequence record's batch at creation,
 * kvd_store_seq_create_ex; kvd_store_seq_codecs_set; kvd__seq_arts_release
 * in every sequence delete), read and written under one mutex, so a crash
 * never leaves a count that differs from the records; the last reference's
 * batch deletes both keys. A new snapshot whose hash is already stored with
 * other bytes (an XXH3 collision, found by comparing the bytes) is kept as
 * the sequence's own under 'Z' ‖ sequence id with a version 2 record and
 * hash 0, the form stores written before snapshots were shared still have
 * (read as such, deleted with the sequence). Parsed snapshots are kept in
 * a small in-memory cache keyed by the hash; a miss reads and parses the
 * whole snapshot.
 */
#ifndef KVDEPOT_STORE_SEQCODEC_H
#define KVDEPOT_STORE_SEQCODEC_H

#include "codec.h"
#include "store.h"

/* pq_min_train_tokens: the default (a typical prefill, and as many keys as
 * the training uses: KVD_PQ_TRAIN_TOKENS, pqindex.h), the most accepted. */
#define KVD_PQ_MIN_TRAIN_TOKENS 4096
#define KVD_PQ_MIN_TRAIN_MAX (1u << 20)

typedef struct kvd_seq_codecs {
    kvd_codec_spec k, v;
    /* Sealed pages of blocks starting before this token stay raw (attention
     * sinks); rounded up to whole pages. */
    uint32_t raw_sink_tokens;
    /* PQ index on K (Search, SparseAttend): m sub-spaces (0 = none) of
     * 2^pq_bits centroids, K-means with pq_iterations Lloyd steps. */
    uint32_t pq_m;
    uint8_t pq_bits;
    uint32_t pq_iterations;
    /* The centroids are trained by the append that takes the layer to at
     * least this many tokens (pqindex.h); 0 = KVD_PQ_MIN_TRAIN_TOKENS. */
    uint32_t pq_min_train_tokens;
    /* The artifact snapshot (kvd_seq_codecs_load_arts; k.arts and v.arts
     * point at it), released by kvd_seq_codecs_clear; arts_hash from the
     * record names it, arts_ent is its cache entry (NULL: owned). */
    kvd_codec_arts *arts;
    uint64_t arts_hash;
    void *arts_ent;
    /* 1: the snapshot is the shared record of arts_hash ('z'); 0: the
     * sequence's own ('Z', older records and XXH3 collisions). */
    uint8_t arts_shared;
} kvd_seq_codecs;

/* Does a sealed page get coded (anything but raw)? Does it need artifacts? */
int kvd_seq_codecs_coded(const kvd_seq_codecs *c);
int kvd_seq_codecs_need_arts(const kvd_seq_codecs *c);

/* Load the snapshot of a sequence whose codecs need one into c->arts.
 * KVD_ECORRUPT when it is missing or damaged. */
int kvd_seq_codecs_load_arts(kvd_store *st, const void *id, size_t id_len, kvd_seq_codecs *c,
                             kvd_error *err);

/* Free c->arts; NULL-safe. */
void kvd_seq_codecs_clear(kvd_seq_codecs *c);

/*
 * Add to b the deletion of a sequence's codec record and own snapshot, and
 * the release of its reference on a shared snapshot (which b deletes with
 * its count when it was the last). On success the reference counts stay
 * locked until kvd__seq_arts_release_done, to be called once b is written
 * (or dropped); on failure (KVD_EINTERNAL reading the record or the count)
 * nothing is locked and b may hold part of the deletion. Called with the sequence's s->mu held.
 */
struct rocksdb_writebatch_t;
int kvd__seq_arts_release(kvd_store *st, struct rocksdb_writebatch_t *b, const void *id,
                          size_t id_len, kvd_error *err);
void kvd__seq_arts_release_done(void);

/* Check both specs for the model's shape and the store's page size (fills
 * defaults). KVD_EINVAL / KVD_EUNSUPP naming the field. */
int kvd_seq_codecs_check(kvd_seq_codecs *c, uint32_t page_tokens, uint32_t head_dim,
                         kvd_error *err);

/*
 * Replace the codecs of an existing sequence (before its first append),
 * with the snapshot of the model's artifacts its VQ/SVD specs need, in one
 * write. CreateSequence does not use it: kvd_store_seq_create_ex writes a
 * new sequence's codecs in the batch of its sequence record. KVD_ENOTFOUND
 * for an unknown sequence; KVD_EPRECOND naming a missing artifact;
 * KVD_EINVAL for widths the model cannot take.
 */
int kvd_store_seq_codecs_set(kvd_store *st, const void *id, size_t id_len,
                             const kvd_seq_codecs *c, kvd_error *err);

/*
 * The serialised snapshot of model mi's artifacts that c needs: *buf
 * (malloc'd, the caller frees; NULL when c needs none), *len and *hash (its
 * XXH3). Reads the model's artifacts (takes st->lock shared): call it
 * without st->lock held. KVD_EPRECOND naming a missing artifact.
 */
int kvd__seq_codecs_snapshot(kvd_store *st, const kvd_model_info *mi, const kvd_seq_codecs *c,
                             uint8_t **buf, size_t *len, uint64_t *hash, kvd_error *err);

/*
 * Add to b the codec record of sequence id for c, with a reference on the
 * snapshot buf[0..len) of XXH3 hash (from kvd__seq_codecs_snapshot; NULL =
 * none) and the release of a reference an older record of the id held. On
 * success the reference counts stay locked until kvd__seq_arts_release_done,
 * to be called once b is written (or dropped); on failure nothing is locked
 * and b may hold part of the change. Called with st->lock held (exclusive,
 * sequence create) or the sequence's s->mu (codecs set), never after taking
 * the counts' lock.
 */
int kvd__seq_codecs_stage(kvd_store *st, struct rocksdb_writebatch_t *b, const void *id,
                          size_t id_len, const kvd_seq_codecs *c, const uint8_t *buf, size_t len,
                          uint64_t hash, kvd_error *err);

/* The codecs of a sequence; *found = 0 (and *c all raw) when none were set. */
int kvd_store_seq_codecs_get(kvd_store *st, const void *id, size_t id_len, kvd_seq_codecs *c,
                             int *found, kvd_error *err);

/*
 * Store `page` (len bytes, a sealed page of `layer` holding block `block`,
 * already validated by the caller against the sequence) verbatim when the
 * append commits, instead of the page it would build from the appended
 * bytes for that block. The bytes are copied. 0 or KVD_ENOMEM.
 */
struct kvd_append;
int kvd_store_append_give_page(struct kvd_append *ap, uint32_t layer, uint64_t block,
                               const uint8_t *page, size_t len, kvd_error *err);

#endif /* KVDEPOT_STORE_SEQCODEC_H */
