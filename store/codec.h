/*
 * Page codecs: encoding the K and V sections of a page with INT2/INT4, and
 * decoding and attending over pages whatever their codecs. Used by the store
 * and the service on the server, and compiled into libkvdepot so a client
 * encodes pages with exactly the same bytes (docs/page-format.md, "Coded
 * sections").
 *
 * Section layout of codec INT2 (1) and INT4 (2), T = num_tokens,
 * H = num_kv_heads, D = head_dim, bits = 2 or 4, P = group:
 *
 *   offset 0   u16 group P (32, 64 or 128)
 *          2   u8  axis (0 token: groups of P dims of one token;
 *                        1 channel: groups of P tokens of one channel)
 *          3   u8  rounding used (0 nearest, 1 stochastic; informational)
 *          4   u32 reserved, 0
 *          8   codes  (H, T, D*bits/8) u8      token axis
 *                     (H, D, T*bits/8) u8      channel axis
 *              min    (H, ngroups) f16          ngroups = T*D/P, in the
 *              scale  (H, ngroups) f16          order of kvdepot/quant.h:
 *              sum    (H, ngroups) u16          (T, D/P) or (D, T/P)
 *
 * i.e. the arrays of kvdepot/quant.h for each head, stacked over heads so
 * each array is one contiguous (H, ...) tensor the attention kernels read
 * directly. The channel axis needs T to be a multiple of P: it is for a
 * sealed page (B is a multiple of every group size), which is the only page
 * that is ever coded.
 */
#ifndef KVDEPOT_STORE_CODEC_H
#define KVDEPOT_STORE_CODEC_H

#include <stddef.h>
#include <stdint.h>

#include "kvdepot/attention.h"
#include "kvdepot/backend.h"
#include "page.h"

#define KVD_CODEC_SECTION_PREFIX 8

typedef struct kvd_codec_spec {
    uint8_t codec;     /* kvd_codec: RAW, INT2 or INT4 */
    uint16_t group;    /* P: 32, 64, 128; 0 = 64 */
    uint8_t axis;      /* kvd_quant_axis; K must use the token axis */
    uint8_t rounding;  /* kvd_rounding */
    uint64_t seed;     /* stochastic rounding; mixed per page, layer and head */
} kvd_codec_spec;

/*
 * Check a spec for K (is_v = 0) or V of pages of page_tokens x head_dim and
 * fill in defaults (group 0 -> 64). KVD_EINVAL with a message naming the
 * field for: unknown or unsupported codec (VQ needs calibration artifacts:
 * KVD_EUNSUPP), a group not in {32, 64, 128} or not dividing the grouped
 * axis (head_dim for the token axis, page_tokens for the channel axis), a
 * channel axis on K, an unknown rounding.
 */
int kvd_codec_spec_check(kvd_codec_spec *s, int is_v, uint32_t page_tokens, uint32_t head_dim,
                         kvd_error *err);

/* Bytes of a section of T tokens in this (checked) spec. */
uint64_t kvd_codec_section_bytes(const kvd_codec_spec *s, uint32_t H, uint32_t T, uint32_t D,
                                 kvd_dtype dtype);

/*
 * Encode a page from head-major K and V ([kv_head][token][head_dim] in
 * d->dtype, as a raw section) into a malloc'd page (*out, *len; caller
 * frees) with the given codecs, checksum set. A page that does not hold its
 * whole block (d->num_tokens < page_tokens) is always written raw.
 * Returns 0, KVD_EINVAL, KVD_ENOMEM.
 */
int kvd_page_encode(kvd_backend *be, const kvd_page_desc *d, const kvd_codec_spec *ks,
                    const kvd_codec_spec *vs, const void *k, const void *v, uint8_t **out,
                    size_t *len, kvd_error *err);

/* A coded section, parsed and checked against its page's shape. */
typedef struct kvd_codec_section {
    uint8_t codec;
    int bits, group, axis, rounding;
    kvd_attn_qdata q; /* (H, ...) tensors pointing into the page */
} kvd_codec_section;

/*
 * Parse section `which` (KVD_SECTION_K or KVD_SECTION_V) of a validated page
 * view. For a raw section only codec is set. KVD_ECORRUPT for a prefix or
 * length that does not fit the page's shape (untrusted bytes); KVD_EUNSUPP
 * for a codec this build cannot read.
 */
int kvd_codec_section_parse(const kvd_page_view *v, int which, kvd_codec_section *out,
                            kvd_error *err);

/*
 * Decode section `which` of a validated page into dst, head-major
 * [kv_head][token][head_dim] in `dtype` (f32, f16 or bf16). A raw section in
 * the same dtype is copied. Returns 0, KVD_ECORRUPT, KVD_EINVAL.
 */
int kvd_page_decode_section(kvd_backend *be, const kvd_page_view *v, int which, kvd_dtype dtype,
                            void *dst, kvd_error *err);

/*
 * Attention of q (Hq, D) f32 over every token of n validated pages (of one
 * layer, any codecs), merged by log-sum-exp into out (Hq, D) and lse (Hq).
 * Raw pages run the dense kernel, INT2/INT4 pages the homomorphic kernel on
 * their codes (never dequantized); a page with one coded and one raw section
 * is decoded to f32 first. dims->n_kv_heads / head_dim must match the pages.
 * n = 0 gives lse = -inf, out = 0. Returns 0, KVD_EINVAL, KVD_ECORRUPT,
 * KVD_ENOMEM.
 */
int kvd_page_attend(kvd_backend *be, const kvd_page_view *pages, size_t n,
                    const kvd_attn_dims *dims, const float *q, float *out, float *lse,
                    kvd_error *err);

#endif /* KVDEPOT_STORE_CODEC_H */
