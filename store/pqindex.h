/*
 * The stored PQ index of a sequence (PQCache): the key index behind Search
 * and SparseAttend (kvdepot.proto, SearchRequest), for sequences created with
 * codecs.pq (seqcodec.h: pq_m, pq_bits, pq_iterations, pq_min_train_tokens).
 *
 * Centroids, per (sequence, layer), all kv heads of the layer together, are
 * trained once: by the first append that seals a page of the layer and
 * leaves it with at least pq_min_train_tokens tokens (default 4096, so that
 * a prefill sent in chunks trains on the same keys as one sent whole). The
 * pages sealed before carry no codes. For kv head h, kvd_pq_train
 * (kvdepot/pq.h) runs on the first min(n, KVD_PQ_TRAIN_TOKENS) keys (f32)
 * from the sequence's first own page (the first after a shared prefix) to
 * the end of that append: those of pages sealed earlier as their pages give
 * them back (exact for raw K; a lossy K codec's decoded values), then the
 * keys as appended; seeded layer * 65536 + h, with the
 * sequence's pq_iterations Lloyd steps (on a CPU backend with every core:
 * the result does not depend on the thread count). They are written in the
 * append's batch under the RocksDB key 'Q' be16 id_len id be32 layer
 * (store_internal.h) as the centroid record
 *
 *   u8 version (1) | u8 bits | u16 m | u32 num_kv_heads | u32 head_dim |
 *   f32 centroids (num_kv_heads, m, 2^bits, head_dim / m)
 *
 * (integers and floats little-endian), and are deleted with the sequence.
 * Their id, which PQ sections carry, is the xxh3-64 of the record: two
 * records with the same id hold the same centroids.
 *
 * The pages the sequence sealed before the layer was trained (tokens
 * [t0, t0 + n): from its first own page to the first page the training
 * append seals) get their codes in the same batch, from their keys as
 * stored, in the layer's codes record under the key of the centroid record
 * followed by be64 t0 be32 n:
 *
 *   u8 version (1) | u8 0 | u16 m | u32 num_kv_heads | u64 centroids id |
 *   u8 codes (num_kv_heads, n, m)
 *
 * Search takes the codes of those tokens from there. Both records count in
 * the layer's pq.bytes (SequenceInfo.pq_index_bytes).
 *
 * Codes: every page of the sequence that seals from then on, in that layer,
 * gets a PQ-codes section (page.h) with the codes of its keys as appended
 * (before the page's K codec, which may be lossy; for AppendPages the keys
 * decoded from the client's page) under the layer's centroids. The server
 * writes the section itself: the PQ section of a client-encoded page
 * (AppendPages; e.g. pages read from another sequence) is validated with the
 * page, then replaced. A sequence without a PQ index stores such a page's
 * section as is and never reads it.
 *
 * Shared prefixes: a sequence created from a prefix shares the prefix's
 * sealed pages, whose PQ sections (if any) index the centroids of the
 * sequence that sealed them. The new sequence trains its own centroids at
 * its first sealing append; Search uses a page's stored codes only when the
 * section's centroids id equals the searching sequence's, and encodes the
 * keys of any other page (read back, decoded) with its own centroids at call
 * time: correct, only slower on those pages. The same holds for the pages a
 * sequence sealed before its layer was trained.
 */
#ifndef KVDEPOT_STORE_PQINDEX_H
#define KVDEPOT_STORE_PQINDEX_H

#include <stddef.h>
#include <stdint.h>

#include "kvdepot/backend.h"
#include "page.h"
#include "seqcodec.h"
#include "store.h"

/* Keys the centroids of one kv head are trained on, at most. */
#define KVD_PQ_TRAIN_TOKENS 4096

/* The centroids of one layer of a sequence. */
typedef struct kvd_pq_centroids {
    uint32_t num_kv_heads, head_dim, m, bits;
    uint64_t id; /* xxh3-64 of the stored record */
    float *data; /* (num_kv_heads, m, 2^bits, head_dim / m) f32, malloc'd */
} kvd_pq_centroids;

/* Free c->data and zero *c; NULL is a no-op. */
void kvd_pq_centroids_clear(kvd_pq_centroids *c);

/*
 * The stored centroids of (sequence, layer).
 * @param[out] out    filled when *found (free with kvd_pq_centroids_clear)
 * @param[out] found  0 when the layer has none (no page of it sealed yet, or
 *                    no PQ index)
 * @return 0; KVD_EINVAL (id); KVD_ECORRUPT (bad record); KVD_ENOMEM;
 *         KVD_EINTERNAL (RocksDB).
 */
int kvd_store_pq_centroids_get(kvd_store *st, const void *seq_id, size_t id_len, uint32_t layer,
                               kvd_pq_centroids *out, int *found, kvd_error *err);

/* The codes record of a layer: the PQ codes of tokens [token_start,
 * token_start + num_tokens) under the centroids of centroids_id. */
typedef struct kvd_pq_codes {
    uint64_t centroids_id, token_start, num_tokens;
    uint32_t num_kv_heads, m;
    uint8_t *codes; /* (num_kv_heads, num_tokens, m), malloc'd */
} kvd_pq_codes;

void kvd_pq_codes_clear(kvd_pq_codes *c);

/*
 * The codes record of (sequence, layer), if it has one.
 * @return 0; KVD_EINVAL (id); KVD_ECORRUPT (bad record); KVD_ENOMEM;
 *         KVD_EINTERNAL (RocksDB).
 */
int kvd_store_pq_codes_get(kvd_store *st, const void *seq_id, size_t id_len, uint32_t layer,
                           kvd_pq_codes *out, int *found, kvd_error *err);

/*
 * Rebuild: train the centroids of layers [layer_start, + num_layers) (0 =
 * to the last) again, on KVD_PQ_TRAIN_TOKENS keys spread evenly over the
 * sequence's own sealed pages (as stored: decoded for a lossy K codec),
 * same seeds and iterations as the first training, and code all those
 * pages under them into the layer's codes record (their PQ sections, coded
 * under the old centroids, are no longer read; pages sealed afterwards get
 * sections under the new ones). For a sequence whose keys drifted from its
 * first tokens', or one never trained (shorter than pq_min_train_tokens).
 * Layers without an own sealed page are left as they are.
 *
 * begin notes the sequence's sealed pages and says how many bytes the
 * index grows by (*bound, for quotas); run does the work without the
 * sequence's lock (appends and reads go on; pages sealed meanwhile keep
 * their sections, read while their centroids are the layer's); commit
 * writes it in one batch, unless the sequence was deleted meanwhile
 * (KVD_ENOTFOUND) or an append trained a layer of the range (KVD_EABORTED:
 * nothing changed). begin: 0, KVD_EINVAL (id, layers), KVD_ENOTFOUND,
 * KVD_EPRECOND (no PQ index), KVD_ENOMEM (also past the disk limit),
 * KVD_ECORRUPT. run: kernel and read errors. commit frees rb in every case;
 * abort frees it without writing. Lock order: the caller's quota lock, then
 * the sequence's (commit), as for appends.
 */
typedef struct kvd_pq_rebuild kvd_pq_rebuild;
typedef struct kvd_pq_rebuild_info {
    uint32_t layers_rebuilt;
    uint64_t tokens_indexed;                        /* over the layers rebuilt */
    uint64_t index_bytes_before, index_bytes_after; /* of the layers in the range */
} kvd_pq_rebuild_info;

int kvd_store_pq_rebuild_begin(kvd_store *st, const void *id, size_t id_len, uint32_t layer_start,
                               uint32_t num_layers, kvd_pq_rebuild **out, uint64_t *bound,
                               kvd_error *err);
int kvd_store_pq_rebuild_run(kvd_pq_rebuild *rb, kvd_error *err);
int kvd_store_pq_rebuild_commit(kvd_pq_rebuild *rb, kvd_pq_rebuild_info *info, kvd_error *err);
void kvd_store_pq_rebuild_abort(kvd_pq_rebuild *rb);

/* Bytes of a codes record of n tokens, H kv heads, m sub-spaces; the most
 * one may hold (larger: the tokens are coded at Search time, and a rebuild
 * is refused). */
#define KVD_PQ_CODES_MAX_BYTES (256u << 20)
/* Bytes of a codes record of n tokens, H kv heads, m sub-spaces. */
uint64_t kvd__pq_codes_bytes(uint32_t H, uint32_t m, uint64_t n);

/*
 * Train the centroids of kv head h of `layer` (the procedure above) on n
 * keys (n, head_dim) f32 contiguous, n >= 1 (the first KVD_PQ_TRAIN_TOKENS
 * are used). cent: (m, 2^bits, head_dim / m) f32. Returns as kvd_pq_train.
 */
int kvd_pq_train_head(kvd_backend *be, const float *keys, int64_t n, uint32_t head_dim, uint32_t m,
                      uint32_t bits, uint32_t iterations, uint32_t layer, uint32_t h, float *cent,
                      kvd_error *err);

/* ---- store internals (append.c, sequence.c) -------------------------------- */

struct kvd__pq_append; /* centroids one append has loaded or trained, per layer */
struct kvd__seq;
struct rocksdb_writebatch_t;

/*
 * The append hook, for a page that seals (d->num_tokens == page_tokens) in a
 * sequence with a PQ index: load or train the layer's centroids (training
 * puts the record into batch b), encode the page's keys and return a copy of
 * the page (in, in_len: valid, any codecs) whose PQ-codes section is these
 * codes (replacing any the page had) with a new checksum (*out malloc'd,
 * the caller frees).
 *
 * @param[in,out] state   per-append cache, NULL at first (kvd__pq_append_free)
 * @param[in] k_page      the page's keys as appended, (kv_head, token, dim)
 *                        in d->dtype, page_tokens tokens
 * @param[in] ready       the page's codes (H, page_tokens, m) made already
 *                        (kvd__pq_pages_codes), or NULL: made here
 * @param[in] wire_k      keys of the append, (token, kv_head, dim), tokens
 *                        [wire_ts, wire_end): training keys after the page
 * @return 0; KVD_ECORRUPT (invalid page, stored centroids of another
 *         shape); KVD_ENOMEM;
 *         kernel errors.
 */
int kvd__pq_page_section(struct kvd__pq_append **state, kvd_store *st, const struct kvd__seq *s,
                         const kvd_seq_codecs *c, struct rocksdb_writebatch_t *b,
                         const kvd_page_desc *d, const uint8_t *k_page, const uint8_t *ready,
                         const uint8_t *wire_k, uint64_t wire_ts, uint64_t wire_end,
                         const uint8_t *in, size_t in_len, uint8_t **out, size_t *out_len,
                         kvd_error *err);

/*
 * The PQ codes of n sealing pages of one layer on the store's device,
 * together: their keys lie there already (k_dev[p], head-major (H, B, D) in
 * d[p].dtype), each head is converted and coded there, and the codes of all
 * come down in one copy into codes (n x (H, B, m) bytes, page after page),
 * for kvd__pq_page_section's `ready`. The layer's centroids are loaded, or
 * trained from train_d / train_k (its first page needing codes, as
 * kvd__pq_page_section would) first. The device's errors are returned as
 * they are (kvd_store_device_fallback decides).
 */
int kvd__pq_pages_codes(struct kvd__pq_append **state, kvd_store *st, const struct kvd__seq *s,
                        const kvd_seq_codecs *c, struct rocksdb_writebatch_t *b,
                        const kvd_page_desc *train_d, const uint8_t *train_k, const uint8_t *wire_k,
                        uint64_t wire_ts, uint64_t wire_end, size_t n, const kvd_page_desc *d,
                        const void *const *k_dev, uint8_t *codes, kvd_error *err);

void kvd__pq_append_free(struct kvd__pq_append *state);

/* Bytes of a centroid record of H kv heads x D with 2^bits centroids. */
uint64_t kvd__pq_record_bytes(uint32_t H, uint32_t D, uint32_t bits);

/* Once the append's batch is durable (under s->mu): the layers it trained
 * centroids for record their size (kvd__layer.pq) and the store's
 * disk bytes grow by it. Returns the bytes added. */
uint64_t kvd__pq_append_done(struct kvd__pq_append *state, kvd_store *st, struct kvd__seq *s);

/* The sequence's records are deleted: the disk bytes drop by them. */
void kvd__pq_forget(kvd_store *st, struct kvd__seq *s);

/* The cache of centroid records (kvd_store_pq_centroids_get): made at open,
 * freed at close. At most KVD__PQ_CACHE_BYTES of records (a record larger
 * than a quarter of it is not kept). */
#define KVD__PQ_CACHE_ENTRIES 64
#define KVD__PQ_CACHE_BYTES (16u << 20)
void kvd__pq_cache_init(kvd_store *st);
void kvd__pq_cache_fini(kvd_store *st);
/* A record version no other had (kvd__pq_index.gen). */
uint64_t kvd__pq_new_gen(kvd_store *st);
/* Reads kvd_store_pq_centroids_get answered from the cache (tests). */
uint64_t kvd__pq_cache_hits(kvd_store *st);

/* At open, after the sequences: each layer's record size, counted in the
 * disk bytes. Records of unknown sequences are skipped. */
int kvd__pq_load(kvd_store *st, kvd_error *err);

/* Add the deletion of every centroid record of s to b (sequence delete). */
void kvd__pq_delete(struct rocksdb_writebatch_t *b, const struct kvd__seq *s);

#endif /* KVDEPOT_STORE_PQINDEX_H */
