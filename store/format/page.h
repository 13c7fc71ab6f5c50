/*
 * kvdepot page: the one binary format of a page, used unchanged on the wire,
 * in memory and in RocksDB. docs/page-format.md is the full description; the
 * summary here is what the code relies on.
 *
 * A page is B tokens (at most page_tokens) of one layer, all KV heads:
 *
 *   offset  size  field (all integers little-endian)
 *        0     4  magic            "KVDP" (0x4b 0x56 0x44 0x50)
 *        4     2  version          1
 *        6     2  header_size      64 + 24 * n_sections (payload starts here)
 *        8     1  k_codec          kvdepot.v1.Codec of the K section
 *        9     1  v_codec          kvdepot.v1.Codec of the V section
 *       10     1  dtype            kvdepot.v1.DType (f16, bf16, f32)
 *       11     1  flags            bit 0 sealed, bit 1 has prefix hash
 *       12     4  layer
 *       16     8  token_start      first token; the tokens lie in one block of
 *                                  page_tokens: token_start % page_tokens +
 *                                  num_tokens <= page_tokens
 *       24     4  num_tokens       1..page_tokens; == page_tokens iff sealed
 *       28     4  page_tokens      capacity B
 *       32     4  num_kv_heads
 *       36     4  head_dim
 *       40     8  prefix_hash      0 unless flags bit 1
 *       48     2  n_sections       1..KVD_PAGE_MAX_SECTIONS
 *       50     2  reserved         0
 *       52     4  reserved         0
 *       56     8  checksum         xxh3-64, see below
 *       64  24*n  section table:   u16 type, u8 codec, u8 reserved (0),
 *                                  u32 reserved (0), u64 offset, u64 length
 *   header_size  payload: the sections, back to back in table order, covering
 *                the rest of the page exactly.
 *
 * checksum = XXH3_64bits (seed 0) of bytes [0, 56) followed by bytes
 * [64, page_len): every byte of the page except the checksum field itself.
 *
 * A raw (codec 0) K or V section is [kv_head][token][head_dim] in the page
 * dtype, num_tokens tokens (not page_tokens): one head is contiguous.
 *
 * A PQ-codes section (type 3, codec 0; sealed pages of sequences with a PQ
 * index, store/pqindex.h) is a 16-byte header and the codes:
 *
 *        0     2  m                sub-spaces, divides head_dim
 *        2     1  bits             4, 6 or 8 (2^bits centroids per sub-space)
 *        3     1  reserved         0
 *        4     4  reserved         0
 *        8     8  centroids_id     the id of the centroids the codes index
 *                                  (xxh3-64 of the sequence's centroid record
 *                                  of this layer, pqindex.h)
 *       16     *  codes            u8 (kv_head, token, m), num_tokens tokens,
 *                                  every code < 2^bits
 *
 * A page whose token_start is a multiple of page_tokens is a page proper; one
 * that starts inside a block is a tail fragment: tokens appended to a raw
 * tail page, stored beside it until the store merges them (see append.c).
 */
#ifndef KVDEPOT_FORMAT_PAGE_H
#define KVDEPOT_FORMAT_PAGE_H

#include <stddef.h>
#include <stdint.h>

#include "kvdepot/status.h"
#include "kvdepot/tensor.h"

#define KVD_PAGE_MAGIC 0x5044564bu /* "KVDP" read as a little-endian u32 */
#define KVD_PAGE_VERSION 1
#define KVD_PAGE_FIXED_HEADER 64
#define KVD_PAGE_SECTION_ENTRY 24
#define KVD_PAGE_MAX_SECTIONS 8
#define KVD_PAGE_CHECKSUM_OFFSET 56
#define KVD_PAGE_MAX_HEADS 1024
#define KVD_PAGE_MAX_HEAD_DIM 1024
#define KVD_PAGE_MAX_TOKENS 65536

/* Header flags. */
#define KVD_PAGE_SEALED 0x01u
#define KVD_PAGE_HAS_PREFIX_HASH 0x02u
#define KVD_PAGE_KNOWN_FLAGS (KVD_PAGE_SEALED | KVD_PAGE_HAS_PREFIX_HASH)

/* Codec ids: the numbers of kvdepot.v1.Codec. */
typedef enum kvd_codec {
    KVD_CODEC_RAW = 0,
    KVD_CODEC_INT2 = 1,
    KVD_CODEC_INT4 = 2,
    KVD_CODEC_VQ = 3,
    KVD_CODEC_SVD = 4, /* SVD-reduced section; its prefix names the inner codec (codec.h) */
    KVD_CODEC_COUNT
} kvd_codec;

/* Section types. K, V and PQ codes are produced now; activations keep
 * their number so later pages stay readable. */
typedef enum kvd_section_type {
    KVD_SECTION_K = 1,
    KVD_SECTION_V = 2,
    KVD_SECTION_PQ_CODES = 3,
    KVD_SECTION_ACTIVATIONS = 4,
    KVD_SECTION_TYPE_MAX = 4
} kvd_section_type;

typedef struct kvd_page_section {
    uint16_t type;   /* kvd_section_type */
    uint8_t codec;   /* kvd_codec */
    uint64_t offset; /* from the start of the page */
    uint64_t length; /* bytes */
} kvd_page_section;

/* The decoded header of a page. */
typedef struct kvd_page_header {
    uint16_t version;
    uint16_t header_size;
    uint8_t k_codec, v_codec;
    kvd_dtype dtype;
    uint8_t flags;
    uint32_t layer;
    uint64_t token_start;
    uint32_t num_tokens;
    uint32_t page_tokens;
    uint32_t num_kv_heads;
    uint32_t head_dim;
    uint64_t prefix_hash;
    uint16_t n_sections;
    uint64_t checksum;
    kvd_page_section sections[KVD_PAGE_MAX_SECTIONS];
} kvd_page_header;

/* A validated page: the header plus pointers into the caller's bytes (valid
 * while those bytes are). k and v are NULL when the page has no such section. */
typedef struct kvd_page_view {
    kvd_page_header h;
    const uint8_t *k;
    uint64_t k_len;
    const uint8_t *v;
    uint64_t v_len;
    uint64_t page_len;
    const uint8_t *pq; /* the PQ-codes section (header included), or NULL */
    uint64_t pq_len;
} kvd_page_view;

/* PQ-codes section: fixed header bytes before the codes (layout above). */
#define KVD_PAGE_PQ_HEADER 16

/* A page's PQ-codes section, parsed (pointers into the page). */
typedef struct kvd_page_pq {
    uint32_t m;
    uint32_t bits;
    uint64_t centroids_id;
    const uint8_t *codes; /* (num_kv_heads, num_tokens, m) u8 */
} kvd_page_pq;

/* The PQ section of a validated page: 1 with *out filled, 0 when the page
 * has none. */
int kvd_page_pq_get(const kvd_page_view *v, kvd_page_pq *out);

/*
 * Copy a valid page of len bytes into a malloc'd buffer where section `type`
 * (codec 0, payload_len bytes) replaces any section of that type and comes
 * last, in the table and in the payload; the other sections keep their
 * order and bytes. *payload points at the new section's bytes for the
 * caller to fill (zeroed); the caller then calls kvd_page_finish(*out,
 * *out_len) and frees *out.
 * Returns 0; KVD_ECORRUPT (page not valid); KVD_EINVAL when the page would
 * have more than KVD_PAGE_MAX_SECTIONS sections; KVD_ENOMEM.
 */
int kvd_page_put_section(const uint8_t *page, size_t len, uint16_t type, uint64_t payload_len,
                         uint8_t **out, size_t *out_len, uint8_t **payload, kvd_error *err);

/* What a raw K+V page holds; the input of kvd_page_raw_size/init. */
typedef struct kvd_page_desc {
    kvd_dtype dtype;
    uint32_t layer;
    uint64_t token_start;
    uint32_t num_tokens;
    uint32_t page_tokens;
    uint32_t num_kv_heads;
    uint32_t head_dim;
    int has_prefix_hash;
    uint64_t prefix_hash;
} kvd_page_desc;

/* Bytes of one raw section (num_kv_heads * num_tokens * head_dim * dtype). */
uint64_t kvd_page_raw_section_bytes(const kvd_page_desc *d);

/* Total bytes of a raw page with a K and a V section. */
uint64_t kvd_page_raw_size(const kvd_page_desc *d);

/*
 * Write the header and section table of a raw K+V page into buf (which must
 * hold kvd_page_raw_size(d) bytes) and return, in *k and *v, where the caller
 * writes the two sections ([kv_head][token][head_dim] each). The checksum is
 * not set: call kvd_page_finish once the payload is in place.
 * Returns 0, or KVD_EINVAL for a description out of bounds.
 */
int kvd_page_init_raw(const kvd_page_desc *d, uint8_t *buf, size_t cap, uint8_t **k, uint8_t **v,
                      kvd_error *err);

/* Compute and store the checksum of a complete page of len bytes. */
void kvd_page_finish(uint8_t *page, size_t len);

/* Convenience: encode a raw page from head-major K and V (each
 * kvd_page_raw_section_bytes(d) bytes) into a malloc'd buffer (*out, *len;
 * the caller frees). Returns 0, KVD_EINVAL or KVD_ENOMEM. */
int kvd_page_encode_raw(const kvd_page_desc *d, const void *k, const void *v, uint8_t **out,
                        size_t *len, kvd_error *err);

/* The checksum a page of len bytes should carry (len >= 64). */
uint64_t kvd_page_checksum(const uint8_t *page, size_t len);

/*
 * Validate len untrusted bytes as exactly one page and fill *view. Checks,
 * in order: length, magic, version, header size, every header field and
 * reserved byte, the section table (types, codecs, bounds, no overlap, no
 * gap, exact cover, raw section lengths, the PQ section's header, length
 * and codes), then the checksum. Never reads
 * outside [buf, buf + len).
 * Returns 0; KVD_EINVAL for NULL arguments; KVD_ECORRUPT with a message for
 * anything wrong in the bytes (including a checksum mismatch).
 */
int kvd_page_decode(const void *buf, size_t len, kvd_page_view *view, kvd_error *err);

/* The same checks without the checksum (used where the checksum was just
 * written by this process). */
int kvd_page_decode_nocheck(const void *buf, size_t len, kvd_page_view *view, kvd_error *err);

/* The layout checks alone: neither the checksum nor the PQ codes (H x T x m
 * bytes) are read. For pages this process has already decoded in full or
 * built itself: those a tier hands out (kvd_store_page_acquire). Any other
 * bytes go through kvd_page_decode. */
int kvd_page_decode_trusted(const void *buf, size_t len, kvd_page_view *view, kvd_error *err);

#endif /* KVDEPOT_FORMAT_PAGE_H */
