/*
 * Codecs of a sequence, fixed at creation: what its pages become when they
 * seal. Persisted under the RocksDB key 'C' ‖ sequence id (store_internal.h)
 * as
 *
 *   u8 version (1) | K spec | V spec | u32 raw_sink_tokens |
 *   u32 pq_m | u8 pq_bits | u32 pq_iterations
 *   spec = u8 codec, u16 group, u8 axis, u8 rounding, u64 seed   (13 bytes)
 *
 * little-endian. A sequence without the key stores raw pages.
 */
#ifndef KVDEPOT_STORE_SEQCODEC_H
#define KVDEPOT_STORE_SEQCODEC_H

#include "codec.h"
#include "store.h"

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
} kvd_seq_codecs;

/* Check both specs for the model's shape and the store's page size (fills
 * defaults). KVD_EINVAL / KVD_EUNSUPP naming the field. */
int kvd_seq_codecs_check(kvd_seq_codecs *c, uint32_t page_tokens, uint32_t head_dim,
                         kvd_error *err);

/* Record the codecs of an existing sequence (before its first append).
 * KVD_ENOTFOUND for an unknown sequence. */
int kvd_store_seq_codecs_set(kvd_store *st, const void *id, size_t id_len,
                             const kvd_seq_codecs *c, kvd_error *err);

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

/* A process-wide single-thread CPU backend for encoding and decoding pages
 * inside the store; NULL when it cannot be created. */
kvd_backend *kvd__codec_backend(void);

#endif /* KVDEPOT_STORE_SEQCODEC_H */
