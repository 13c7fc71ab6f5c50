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
 *   offset 0   u16 group P (8, 16, 32, 64 or 128)
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
 *
 * Section layout of codec VQ (3), d = sub_dim, b = bits, cw = 1 (b <= 8) or
 * 2 (b > 8) bytes per code:
 *
 *   offset 0   u8  d (2, 4 or 8)
 *          1   u8  b (4..12)
 *          2   u8  transform: 1 keys smoothed by lambda and Hadamard-rotated
 *                  (K sections), 0 none (V sections)
 *          3   u8  reserved, 0
 *          4   u32 reserved, 0
 *          8   u64 fingerprint of the layer's artifacts (kvd_layer_arts)
 *         16   codes (H, T, D/d) u8 or u16 (little-endian): kvdepot/vq.h codes
 *                    of each head, stacked over heads
 *   length = 16 + H*T*(D/d)*cw
 *
 * The codebooks (and lambda) are not in the page: they are the sequence's
 * artifact snapshot (seqcodec.h), identified by the fingerprint.
 *
 * Section layout of codec SVD (4): each head's vectors x (T, D) stored as
 * y = x R_h[:, :r_h] (kvdepot/svd.h), then coded with the inner codec:
 *
 *   offset 0   u8  inner codec: 0 raw (page dtype), 1 INT2, 2 INT4
 *          1   u8  reserved, 0
 *          2   u16 reserved, 0
 *          4   u32 reserved, 0
 *          8   u64 fingerprint of the layer's artifacts (rotations, widths)
 *         16   u16 width r_h for each of the H heads, zero-padded to a
 *              multiple of 8 bytes: W = 16 + 8*ceil(2H/8)
 *          W   one block per head, back to back:
 *                raw:  (T, r_h) in the page dtype (the ragged layout of
 *                      kvdepot/attention.h form (d))
 *                INT:  a whole INT section (8-byte prefix above, then the
 *                      arrays) of one head of width r_h
 *   length = W + sum_h block_h
 *
 * SVD composed with VQ is not offered (kvd_codec_spec_check says so).
 */
#ifndef KVDEPOT_FORMAT_CODEC_H
#define KVDEPOT_FORMAT_CODEC_H

#include <stddef.h>
#include <stdint.h>

#include "kvdepot/attention.h"
#include "kvdepot/backend.h"
#include "page.h"

#define KVD_CODEC_SECTION_PREFIX 8
#define KVD_CODEC_ARTS_PREFIX 16 /* VQ and SVD section prefix */

/*
 * The artifacts one side (K or V) of one layer is coded with: a slice of a
 * sequence's snapshot. H = num_kv_heads, D = head_dim.
 */
typedef struct kvd_layer_arts {
    uint64_t fingerprint; /* XXH3 of everything below (kvd_layer_arts_fingerprint) */
    uint8_t vq_sub_dim;   /* VQ d; 0 = no VQ */
    uint8_t vq_bits;      /* VQ b */
    float *lambda;        /* (H, D) key smoothing (K side of VQ), else NULL */
    float *codebook;      /* (H, 2^b, d) */
    float *rotation;      /* (H, D, D) SVD rotation; NULL = no SVD */
    int32_t *widths;      /* (H) kept widths r_h */
} kvd_layer_arts;

/* A sequence's artifact snapshot: what its K and V need, every layer. */
typedef struct kvd_codec_arts {
    uint32_t num_layers, num_kv_heads, head_dim;
    kvd_layer_arts *k, *v; /* (num_layers) each; NULL when that side needs none */
} kvd_codec_arts;

/* One model artifact as the store and the client hold it (same members as
 * kvd_artifact and kvdepot_artifact). */
typedef struct kvd_art_ref {
    int kind; /* kvd_artifact_kind (store/artifact.h) */
    uint32_t layer, kv_head;
    uint32_t ndim;
    uint32_t shape[2];
    const float *data;
} kvd_art_ref;

/* kvd_codec_spec.axis before kvd_codec_spec_check resolves it: INT codes
 * grouped per channel (along tokens) when the group divides the page size,
 * else per token (along head_dim); other codecs record K token, V channel. */
#define KVD_CODEC_AXIS_DEFAULT 0xFE

typedef struct kvd_codec_spec {
    uint8_t codec;    /* kvd_codec: RAW, INT2, INT4 or VQ */
    uint16_t group;   /* P: 8, 16, 32, 64, 128; 0 = 64 (smaller for small heads) */
    uint8_t axis;     /* kvd_quant_axis, or KVD_CODEC_AXIS_DEFAULT */
    uint8_t rounding; /* kvd_rounding */
    uint64_t seed;    /* stochastic rounding; mixed per page, layer and head */
    /* VQ: sub-vector width d (2, 4, 8) and bits b (4..12). */
    uint8_t vq_sub_dim, vq_bits;
    /* 1: SVD-reduce before the codec (page codec SVD, codec inner). */
    uint8_t svd;
    /* SVD widths, used only when building the snapshot (kvd_codec_arts_build):
     * removal rate, or n explicit widths (1 or one per kv head), rounded up
     * to a multiple of svd_align (0 = 8; with INT on the token axis the
     * multiple is also one of the group size). */
    double svd_rate;
    uint32_t svd_align;
    uint32_t svd_nwidths;
    const uint32_t *svd_widths;
    /* The snapshot the sequence codes with (borrowed); required to encode,
     * decode or attend VQ and SVD sections. */
    const kvd_codec_arts *arts;
} kvd_codec_spec;

/*
 * Build the snapshot for K spec ks and V spec vs (checked) of a model of L
 * layers x H kv heads x D from its artifacts a[0..n). Keys with VQ take
 * KEY_SMOOTHING and VQ_CODEBOOK_K, values VQ_CODEBOOK_V; SVD takes
 * SVD_ROTATION_* and, for a removal rate, SVD_SPECTRUM_*. *out is NULL when
 * neither side needs artifacts. KVD_EPRECOND naming the first missing
 * artifact; KVD_EINVAL for a codebook of another shape than the spec or bad
 * widths; KVD_ENOMEM. Free with kvd_codec_arts_free.
 */
int kvd_codec_arts_build(const kvd_codec_spec *ks, const kvd_codec_spec *vs, uint32_t L, uint32_t H,
                         uint32_t D, const kvd_art_ref *a, size_t n, kvd_codec_arts **out,
                         kvd_error *err);
void kvd_codec_arts_free(kvd_codec_arts *a);

/* The fingerprint of one layer's artifacts of one side. */
uint64_t kvd_layer_arts_fingerprint(const kvd_layer_arts *la, uint32_t H, uint32_t D);

/*
 * Snapshot <-> bytes (the per-sequence record, seqcodec.h):
 *   u8 version (1), u8 reserved[3], u32 L, u32 H, u32 D, then for K and V:
 *   u8 present, u8 d, u8 b, u8 flags (bit 0 lambda, bit 1 SVD), and per
 *   layer lambda (H, D), codebook (H, 2^b, d), rotation (H, D, D) f32 and
 *   widths (H) u32, each when present; little-endian.
 * Serialize: 0 or KVD_ENOMEM (*buf malloc'd). Parse: 0, KVD_ECORRUPT, KVD_ENOMEM.
 */
int kvd_codec_arts_serialize(const kvd_codec_arts *a, uint8_t **buf, size_t *len, kvd_error *err);
int kvd_codec_arts_parse(const uint8_t *buf, size_t len, kvd_codec_arts **out, kvd_error *err);

/*
 * Check a spec for K (is_v = 0) or V of pages of page_tokens x head_dim and
 * fill in defaults (group 0 -> 64, smaller on the token axis of a small head;
 * KVD_CODEC_AXIS_DEFAULT resolved). KVD_EINVAL with a message
 * naming the field for: unknown or unsupported codec (VQ needs calibration artifacts: KVD_EUNSUPP),
 * a group not in {8, 16, 32, 64, 128} or not dividing the grouped axis (head_dim for the token axis,
 * page_tokens for the channel axis; keys per channel also need it to divide 256), an unknown
 * rounding, a VQ d not in {2, 4, 8} or not dividing head_dim, b not in 4..12, VQ keys on a head_dim
 * that is not a power of two (Hadamard), SVD composed with VQ.
 */
int kvd_codec_spec_check(kvd_codec_spec *s, int is_v, uint32_t page_tokens, uint32_t head_dim,
                         kvd_error *err);

/* Bytes of a section of T tokens in this (checked) spec; 0 for SVD (the
 * size depends on the widths in the sequence's artifacts). */
uint64_t kvd_codec_section_bytes(const kvd_codec_spec *s, uint32_t H, uint32_t T, uint32_t D,
                                 kvd_dtype dtype);

/*
 * Encode a page from head-major K and V ([kv_head][token][head_dim] in
 * d->dtype, as a raw section) into a malloc'd page (*out, *len; caller
 * frees) with the given codecs, checksum set. A page that does not hold its
 * whole block (d->num_tokens < page_tokens) is always written raw. VQ and
 * SVD specs code with spec->arts (layer d->layer), stamping its fingerprint.
 * k, v and *out are host memory whatever be is. On a device backend (CUDA)
 * the raw K and V go up once, INT, VQ and SVD sections are coded by its
 * kernels and come back down: the same bytes as the CPU's.
 * Returns 0, KVD_EINVAL (also: VQ/SVD without arts), KVD_ENOMEM, and the
 * device's errors (KVD_EUNAVAIL, KVD_ENOMEM for device memory).
 */
int kvd_page_encode(kvd_backend *be, const kvd_page_desc *d, const kvd_codec_spec *ks,
                    const kvd_codec_spec *vs, const void *k, const void *v, uint8_t **out,
                    size_t *len, kvd_error *err);

/*
 * kvd_page_encode of n pages with the same specs: out[i], len[i] are the
 * bytes kvd_page_encode gives for page i. On a device backend, n sealing
 * pages of one layer and shape are coded together: their raw sides (and a
 * VQ side's smoothing and codebooks, an SVD side's rotations, once) go up in
 * one batch of copies, an INT side is one quantize batch over every page and
 * head (one launch), a VQ side a transform and an encode launch per page and
 * head, an SVD side a projection and its inner codec's launch per page and
 * head, and the coded arrays come down in one batch. Otherwise (the CPU) one
 * page at a time. On failure every out[i] is NULL. Returns as
 * kvd_page_encode.
 */
int kvd_pages_encode(kvd_backend *be, size_t n, const kvd_page_desc *d, const kvd_codec_spec *ks,
                     const kvd_codec_spec *vs, const void *const *k, const void *const *v,
                     uint8_t **out, size_t *len, kvd_error *err);

/*
 * Where the coded sides of the pages a kvd_pages_encode_device call coded
 * still lie in the device's memory, for a caller that puts the pages there
 * too (the device tier) without sending them up again: bytes [at, at + len)
 * of page p's K (side[p][0]) or V (side[p][1]) section are at dev (len 0:
 * none there; an SVD side, whose heads' prefixes are written on the host).
 * A raw side points into the caller's own K or V. Valid until
 * kvd_dev_sections_free, to be called on the thread that coded them.
 */
typedef struct kvd_dev_side {
    const void *dev;
    uint64_t at, len;
} kvd_dev_side;
typedef struct kvd_dev_sections {
    kvd_backend *be;
    void *scratch;
    size_t n;
    kvd_dev_side (*side)[2];
} kvd_dev_sections;
void kvd_dev_sections_free(kvd_dev_sections *s);

/*
 * kvd_pages_encode of n sealing pages of one layer and shape whose raw K and
 * V sections (head-major, as in a raw page) already lie in the memory of the
 * device backend be: only the artifacts go up; a raw side comes down with
 * the coded arrays. For a caller that keeps the raw pages on the device for
 * other work too (the PQ codes of an append). With keep (else NULL), the
 * coded arrays stay on the device and *keep says where (to free with
 * kvd_dev_sections_free; zeroed on failure). KVD_EINVAL without a device
 * backend or when neither side is coded.
 */
int kvd_pages_encode_device(kvd_backend *be, size_t n, const kvd_page_desc *d,
                            const kvd_codec_spec *ks, const kvd_codec_spec *vs,
                            const void *const *k, const void *const *v, uint8_t **out, size_t *len,
                            kvd_dev_sections *keep, kvd_error *err);

/*
 * The copies that put page p of a kvd_pages_encode_device call at dst in
 * the device's memory: page (len bytes) is that call's out[p], or it with
 * sections added since (kvd_page_put_section moves sections, never changes
 * them). Its arrays that lie on the device (s) are copied within it, every
 * other byte (header, prefixes, added sections) goes up from page, which
 * must live until the copies ran. ops has room for
 * KVD_PAGE_IMAGE_COPIES; *nops is set. KVD_ECORRUPT when page does not
 * parse or its K or V section is shorter than s says.
 */
#define KVD_PAGE_IMAGE_COPIES 5
int kvd_page_image_copies(const uint8_t *page, size_t len, const kvd_dev_sections *s, size_t p,
                          void *dst, kvd_copy *ops, size_t *nops, kvd_error *err);

/* A coded section, parsed and checked against its page's shape. */
typedef struct kvd_codec_section {
    uint8_t codec;
    int bits, group, axis, rounding;
    kvd_attn_qdata q; /* (H, ...) tensors pointing into the page */
    /* VQ and SVD */
    uint64_t fingerprint;
    int sub_dim, vq_bits;                         /* VQ d, b */
    kvd_tensor vq_codes;                          /* (H, T, D/d) u8 / u16 */
    const kvd_layer_arts *la;                     /* the arts it was checked against */
    int inner;                                    /* SVD: inner codec (RAW, INT2, INT4) */
    const uint8_t *svd_block[KVD_PAGE_MAX_HEADS]; /* SVD: each head's block */
} kvd_codec_section;

/*
 * Parse section `which` (KVD_SECTION_K or KVD_SECTION_V) of a validated page
 * view. For a raw section only codec is set. KVD_ECORRUPT for a prefix or
 * length that does not fit the page's shape (untrusted bytes); KVD_EUNSUPP
 * for a codec this build cannot read. VQ and SVD sections are checked
 * against `arts` (the sequence's snapshot): KVD_EPRECOND when arts is NULL,
 * lacks that side, or its fingerprint, VQ shape or widths differ from the
 * section's (coded with other artifacts).
 */
int kvd_codec_section_parse(const kvd_page_view *v, int which, const kvd_codec_arts *arts,
                            kvd_codec_section *out, kvd_error *err);

/*
 * Decode section `which` of a validated page into dst, head-major
 * [kv_head][token][head_dim] in `dtype` (f32, f16 or bf16). A raw section in
 * the same dtype is copied. Returns 0, KVD_ECORRUPT, KVD_EINVAL.
 */
int kvd_page_decode_section(kvd_backend *be, const kvd_page_view *v, int which,
                            const kvd_codec_arts *arts, kvd_dtype dtype, void *dst, kvd_error *err);

/*
 * Attention of q (Hq, D) f32 over every token of n validated pages (of one
 * layer, any codecs), merged by log-sum-exp into out (Hq, D) and lse (Hq).
 * Raw pages run the dense kernel, INT2/INT4 pages the homomorphic kernel on
 * their codes (never dequantized), VQ K+V pages the fused VQ kernel (form
 * (c)), SVD+raw K+V pages the reduced-dimension kernel (form (d)), SVD+INT
 * K+V pages the homomorphic kernel per kv head at the reduced widths (the
 * query projected, the output rotated back); any other mix is decoded to f32
 * first. dims->n_kv_heads / head_dim must match the pages. n = 0 gives lse
 * = -inf, out = 0. Returns 0, KVD_EINVAL, KVD_ECORRUPT, KVD_EPRECOND (arts),
 * KVD_ENOMEM.
 */
int kvd_page_attend(kvd_backend *be, const kvd_page_view *pages, size_t n,
                    const kvd_codec_arts *arts, const kvd_attn_dims *dims, const float *q,
                    float *out, float *lse, kvd_error *err);

/*
 * Where the attention operands of a page lie, as byte offsets from its first
 * byte: what attends a page held in device memory, whose bytes the host does
 * not read. Both sides raw (k.codes / v.codes: (H, T, D) in the page dtype),
 * both INT2/INT4 (the four tensors of kvd_attn_qdata) or both VQ (k.codes /
 * v.codes: (H, T, D/d) u8 or u16, every code checked in range; the
 * codebooks are the sequence's, which must carry the fingerprints). The
 * tensors' data members hold offsets until kvd_page_layout_at places them.
 */
typedef struct kvd_page_layout {
    uint8_t attend;           /* 1: k and v below are set (a fused kernel reads them) */
    uint8_t k_codec, v_codec; /* RAW, INT2/INT4, VQ or SVD, the same kind on both sides;
                               * SVD: k.codes and v.codes span the head blocks (1-D):
                               * the reduced rows (kvd_attn_svd_args.k_red) for an inner
                               * raw codec, else see kvd_page_layout_svd_head */
    kvd_dtype dtype;
    uint32_t num_tokens, num_kv_heads, head_dim;
    kvd_attn_qdata k, v;
    /* VQ */
    int k_sub_dim, k_bits, v_sub_dim, v_bits;
    uint64_t k_fingerprint, v_fingerprint; /* VQ and SVD: of the artifacts coded with */
    kvd_codec_spec k_svd, v_svd;           /* SVD: the inner codec (RAW, INT2, INT4) */
    /* PQ codes section (pq_m 0: none): codes (H, T, pq_m) u8 at pq_codes */
    uint32_t pq_m, pq_bits;
    uint64_t pq_centroids_id;
    uint64_t pq_codes;
} kvd_page_layout;

/*
 * The layout of the checked page at `page` (v its kvd_page_decode view):
 * attend = 0 for pairs of codecs with no fused kernel over the page and
 * the sequence's artifacts (SVD + INT; one raw side beside a coded one),
 * the PQ codes whatever the codecs. 0 or KVD_ECORRUPT as kvd_codec_section_parse.
 */
int kvd_page_layout_get(const uint8_t *page, const kvd_page_view *v, kvd_page_layout *out,
                        kvd_error *err);

/* SVD pages: do the page's sections hold blocks of these kept widths (the
 * sequence's artifacts, one per kv head)? 1 or 0. */
int kvd_page_layout_svd_fits(const kvd_page_layout *l, const int32_t *k_widths,
                             const int32_t *v_widths);

/* SVD + INT pages: the INT arrays of kv head h of side `which`
 * (KVD_SECTION_K / V) of the page at base (any memory), for the kept widths
 * its sections fit (kvd_page_layout_svd_fits): a one-head view. */
void kvd_page_layout_svd_head(const kvd_page_layout *l, const void *base, int which,
                              const int32_t *widths, uint32_t h, kvd_attn_qdata *out);

/* The layout's K and V tensors for the page at base (any memory). */
void kvd_page_layout_at(const kvd_page_layout *l, const void *base, kvd_attn_qdata *k,
                        kvd_attn_qdata *v);

#endif /* KVDEPOT_FORMAT_CODEC_H */
