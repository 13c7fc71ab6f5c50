#include "page.h"

#include <stdlib.h>
#include <string.h>

/* The streaming state lives on the stack; its layout is in the header. */
#define XXH_STATIC_LINKING_ONLY
#include <xxhash.h>
#ifdef KVD_HAVE_XXH_DISPATCH
/* XXH3_64bits_update becomes the library's run-time dispatched update (its
 * AVX2 / AVX-512 loops where the CPU has them); same hash. */
#include <xxh_x86dispatch.h>
#endif

/* ---- little-endian access, independent of the host byte order ---------- */

static uint16_t ld16(const uint8_t *p)
{
    return (uint16_t)(p[0] | (p[1] << 8));
}
static uint32_t ld32(const uint8_t *p)
{
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}
static uint64_t ld64(const uint8_t *p)
{
    return (uint64_t)ld32(p) | ((uint64_t)ld32(p + 4) << 32);
}
static void st16(uint8_t *p, uint16_t v)
{
    p[0] = (uint8_t)v;
    p[1] = (uint8_t)(v >> 8);
}
static void st32(uint8_t *p, uint32_t v)
{
    for (int i = 0; i < 4; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}
static void st64(uint8_t *p, uint64_t v)
{
    for (int i = 0; i < 8; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}

static int valid_page_dtype(unsigned t)
{
    return t == KVD_DTYPE_F16 || t == KVD_DTYPE_BF16 || t == KVD_DTYPE_F32;
}

uint64_t kvd_page_raw_section_bytes(const kvd_page_desc *d)
{
    /* Bounded by the checks in kvd_page_init_raw: 1024 * 65536 * 1024 * 4
     * = 2^38, far from overflow. */
    return (uint64_t)d->num_kv_heads * d->num_tokens * d->head_dim * kvd_dtype_size(d->dtype);
}

uint64_t kvd_page_raw_size(const kvd_page_desc *d)
{
    return KVD_PAGE_FIXED_HEADER + 2 * KVD_PAGE_SECTION_ENTRY + 2 * kvd_page_raw_section_bytes(d);
}

static int check_desc(const kvd_page_desc *d, kvd_error *err)
{
    if (!valid_page_dtype(d->dtype))
        return kvd_error_set(err, KVD_EINVAL, "page dtype %s is not f16, bf16 or f32",
                             kvd_dtype_name(d->dtype));
    if (d->page_tokens == 0 || d->page_tokens > KVD_PAGE_MAX_TOKENS)
        return kvd_error_set(err, KVD_EINVAL, "page_tokens %u not in 1..%u", d->page_tokens,
                             KVD_PAGE_MAX_TOKENS);
    if (d->num_tokens == 0 || d->num_tokens > d->page_tokens)
        return kvd_error_set(err, KVD_EINVAL, "page num_tokens %u not in 1..%u", d->num_tokens,
                             d->page_tokens);
    if (d->token_start % d->page_tokens + d->num_tokens > d->page_tokens)
        return kvd_error_set(err, KVD_EINVAL,
                             "page tokens %llu+%u cross a boundary of %u-token blocks",
                             (unsigned long long)d->token_start, d->num_tokens, d->page_tokens);
    if (d->num_kv_heads == 0 || d->num_kv_heads > KVD_PAGE_MAX_HEADS || d->head_dim == 0 ||
        d->head_dim > KVD_PAGE_MAX_HEAD_DIM)
        return kvd_error_set(err, KVD_EINVAL, "page shape %u heads x %u dims out of bounds",
                             d->num_kv_heads, d->head_dim);
    return 0;
}

uint64_t kvd_page_checksum(const uint8_t *page, size_t len)
{
    XXH3_state_t st;
    XXH3_64bits_reset(&st);
    XXH3_64bits_update(&st, page, KVD_PAGE_CHECKSUM_OFFSET);
    XXH3_64bits_update(&st, page + KVD_PAGE_FIXED_HEADER, len - KVD_PAGE_FIXED_HEADER);
    return XXH3_64bits_digest(&st);
}

int kvd_page_init_raw(const kvd_page_desc *d, uint8_t *buf, size_t cap, uint8_t **k, uint8_t **v,
                      kvd_error *err)
{
    int rc = check_desc(d, err);
    if (rc)
        return rc;
    uint64_t total = kvd_page_raw_size(d);
    if (cap < total)
        return kvd_error_set(err, KVD_EINVAL, "page buffer of %zu bytes < %llu", cap,
                             (unsigned long long)total);
    uint64_t sec = kvd_page_raw_section_bytes(d);
    uint16_t hsize = KVD_PAGE_FIXED_HEADER + 2 * KVD_PAGE_SECTION_ENTRY;

    memset(buf, 0, hsize);
    st32(buf + 0, KVD_PAGE_MAGIC);
    st16(buf + 4, KVD_PAGE_VERSION);
    st16(buf + 6, hsize);
    buf[8] = KVD_CODEC_RAW;
    buf[9] = KVD_CODEC_RAW;
    buf[10] = (uint8_t)d->dtype;
    buf[11] = (uint8_t)((d->num_tokens == d->page_tokens ? KVD_PAGE_SEALED : 0) | /* aligned */
                        (d->has_prefix_hash ? KVD_PAGE_HAS_PREFIX_HASH : 0));
    st32(buf + 12, d->layer);
    st64(buf + 16, d->token_start);
    st32(buf + 24, d->num_tokens);
    st32(buf + 28, d->page_tokens);
    st32(buf + 32, d->num_kv_heads);
    st32(buf + 36, d->head_dim);
    st64(buf + 40, d->has_prefix_hash ? d->prefix_hash : 0);
    st16(buf + 48, 2);

    uint8_t *e = buf + KVD_PAGE_FIXED_HEADER;
    st16(e + 0, KVD_SECTION_K);
    e[2] = KVD_CODEC_RAW;
    st64(e + 8, hsize);
    st64(e + 16, sec);
    e += KVD_PAGE_SECTION_ENTRY;
    st16(e + 0, KVD_SECTION_V);
    e[2] = KVD_CODEC_RAW;
    st64(e + 8, hsize + sec);
    st64(e + 16, sec);

    *k = buf + hsize;
    *v = buf + hsize + sec;
    return 0;
}

void kvd_page_finish(uint8_t *page, size_t len)
{
    st64(page + KVD_PAGE_CHECKSUM_OFFSET, kvd_page_checksum(page, len));
}

int kvd_page_encode_raw(const kvd_page_desc *d, const void *k, const void *v, uint8_t **out,
                        size_t *len, kvd_error *err)
{
    *out = NULL;
    *len = 0;
    int rc = check_desc(d, err);
    if (rc)
        return rc;
    uint64_t total = kvd_page_raw_size(d);
    if (total > SIZE_MAX)
        return kvd_error_set(err, KVD_ENOMEM, "page of %llu bytes too large",
                             (unsigned long long)total);
    uint8_t *buf = malloc((size_t)total);
    if (!buf)
        return kvd_error_set(err, KVD_ENOMEM, "out of memory for a %llu-byte page",
                             (unsigned long long)total);
    uint8_t *kp, *vp;
    rc = kvd_page_init_raw(d, buf, (size_t)total, &kp, &vp, err);
    if (rc) {
        free(buf);
        return rc;
    }
    uint64_t sec = kvd_page_raw_section_bytes(d);
    memcpy(kp, k, (size_t)sec);
    memcpy(vp, v, (size_t)sec);
    kvd_page_finish(buf, (size_t)total);
    *out = buf;
    *len = (size_t)total;
    return 0;
}

#define CORRUPT(...) kvd_error_set(err, KVD_ECORRUPT, "corrupt page: " __VA_ARGS__)

/* A PQ-codes section (page.h): codec raw, on a sealed page, header fields
 * in range, exactly the codes of every head and token, each < 2^bits. */
static int check_pq(const uint8_t *s, uint64_t len, const kvd_page_header *h, int codes,
                    kvd_error *err)
{
    if (!(h->flags & KVD_PAGE_SEALED))
        return CORRUPT("PQ section on a page that is not sealed");
    if (len < KVD_PAGE_PQ_HEADER)
        return CORRUPT("PQ section of %llu bytes, shorter than its %d-byte header",
                       (unsigned long long)len, KVD_PAGE_PQ_HEADER);
    unsigned m = ld16(s), bits = s[2];
    if (s[3] != 0 || ld32(s + 4) != 0)
        return CORRUPT("reserved bytes of the PQ section are not zero");
    if (m == 0 || m > h->head_dim || h->head_dim % m)
        return CORRUPT("PQ m %u does not divide head_dim %u", m, h->head_dim);
    if (bits != 4 && bits != 6 && bits != 8)
        return CORRUPT("PQ bits %u, expected 4, 6 or 8", bits);
    uint64_t ncodes = (uint64_t)h->num_kv_heads * h->num_tokens * m;
    if (len != KVD_PAGE_PQ_HEADER + ncodes)
        return CORRUPT("PQ section is %llu bytes, expected %llu", (unsigned long long)len,
                       (unsigned long long)(KVD_PAGE_PQ_HEADER + ncodes));
    if (bits < 8 && codes) {
        /* the OR of every code, 8 bytes at a time (every decode of an
         * indexed page runs this over H x T x m bytes), then its bytes
         * folded together */
        const uint8_t *c = s + KVD_PAGE_PQ_HEADER;
        uint64_t acc = 0, i = 0;
        for (; i + 8 <= ncodes; i += 8) {
            uint64_t w;
            memcpy(&w, c + i, 8);
            acc |= w;
        }
        for (; i < ncodes; i++)
            acc |= c[i];
        acc |= acc >> 32;
        acc |= acc >> 16;
        acc |= acc >> 8;
        const uint8_t any = (uint8_t)acc;
        if (any >> bits) {
            for (uint64_t i = 0; i < ncodes; i++)
                if (c[i] >> bits)
                    return CORRUPT("PQ code %u at %llu is not below 2^%u", c[i],
                                   (unsigned long long)i, bits);
        }
    }
    return 0;
}

/* What decode checks beyond the layout: the checksum, and every PQ code. */
enum { CHECK_LAYOUT = 0, CHECK_CODES = 1, CHECK_SUM = 2, CHECK_ALL = CHECK_CODES | CHECK_SUM };

static int decode(const void *buf, size_t len, kvd_page_view *view, int checks, kvd_error *err)
{
    const int verify = checks & CHECK_SUM;
    if (!buf || !view)
        return kvd_error_set(err, KVD_EINVAL, "page decode: NULL argument");
    memset(view, 0, sizeof *view);
    const uint8_t *p = buf;
    kvd_page_header *h = &view->h;

    if (len < KVD_PAGE_FIXED_HEADER)
        return CORRUPT("%zu bytes, shorter than the %d-byte header", len, KVD_PAGE_FIXED_HEADER);
    if (ld32(p) != KVD_PAGE_MAGIC)
        return CORRUPT("bad magic 0x%08x", ld32(p));
    h->version = ld16(p + 4);
    if (h->version != KVD_PAGE_VERSION)
        return CORRUPT("format version %u, this build reads version %d", h->version,
                       KVD_PAGE_VERSION);
    h->header_size = ld16(p + 6);
    h->k_codec = p[8];
    h->v_codec = p[9];
    h->dtype = (kvd_dtype)p[10];
    h->flags = p[11];
    h->layer = ld32(p + 12);
    h->token_start = ld64(p + 16);
    h->num_tokens = ld32(p + 24);
    h->page_tokens = ld32(p + 28);
    h->num_kv_heads = ld32(p + 32);
    h->head_dim = ld32(p + 36);
    h->prefix_hash = ld64(p + 40);
    h->n_sections = ld16(p + 48);
    h->checksum = ld64(p + KVD_PAGE_CHECKSUM_OFFSET);

    if (h->n_sections == 0 || h->n_sections > KVD_PAGE_MAX_SECTIONS)
        return CORRUPT("%u sections, expected 1..%d", h->n_sections, KVD_PAGE_MAX_SECTIONS);
    if (h->header_size != KVD_PAGE_FIXED_HEADER + KVD_PAGE_SECTION_ENTRY * h->n_sections)
        return CORRUPT("header size %u does not match %u sections", h->header_size, h->n_sections);
    if (len < h->header_size)
        return CORRUPT("%zu bytes, shorter than the %u-byte header", len, h->header_size);
    if (ld16(p + 50) != 0 || ld32(p + 52) != 0)
        return CORRUPT("reserved header bytes are not zero");
    if (h->k_codec >= KVD_CODEC_COUNT || h->v_codec >= KVD_CODEC_COUNT)
        return CORRUPT("unknown codec (K %u, V %u)", h->k_codec, h->v_codec);
    if (!valid_page_dtype(h->dtype))
        return CORRUPT("dtype %u is not f16, bf16 or f32", (unsigned)h->dtype);
    if (h->flags & ~KVD_PAGE_KNOWN_FLAGS)
        return CORRUPT("unknown flags 0x%02x", h->flags);
    if (h->page_tokens == 0 || h->page_tokens > KVD_PAGE_MAX_TOKENS)
        return CORRUPT("page_tokens %u not in 1..%d", h->page_tokens, KVD_PAGE_MAX_TOKENS);
    if (h->num_tokens == 0 || h->num_tokens > h->page_tokens)
        return CORRUPT("num_tokens %u not in 1..%u", h->num_tokens, h->page_tokens);
    if (h->token_start > UINT64_MAX - h->page_tokens ||
        h->token_start % h->page_tokens + h->num_tokens > h->page_tokens)
        return CORRUPT("tokens %llu+%u cross a boundary of %u-token blocks",
                       (unsigned long long)h->token_start, h->num_tokens, h->page_tokens);
    /* Only a whole block is sealed (and only a whole block fills a page:
     * a fragment never holds page_tokens tokens). */
    if (!(h->flags & KVD_PAGE_SEALED) != (h->num_tokens != h->page_tokens))
        return CORRUPT("sealed flag disagrees with %u of %u tokens", h->num_tokens, h->page_tokens);
    if (h->num_kv_heads == 0 || h->num_kv_heads > KVD_PAGE_MAX_HEADS)
        return CORRUPT("num_kv_heads %u not in 1..%d", h->num_kv_heads, KVD_PAGE_MAX_HEADS);
    if (h->head_dim == 0 || h->head_dim > KVD_PAGE_MAX_HEAD_DIM)
        return CORRUPT("head_dim %u not in 1..%d", h->head_dim, KVD_PAGE_MAX_HEAD_DIM);
    if (!(h->flags & KVD_PAGE_HAS_PREFIX_HASH) && h->prefix_hash != 0)
        return CORRUPT("prefix hash set without its flag");

    /* Section table: sections follow each other in table order and cover
     * [header_size, len) exactly, so every payload byte belongs to one
     * section and a page has a single valid encoding of its table. */
    uint64_t raw_bytes =
        (uint64_t)h->num_kv_heads * h->num_tokens * h->head_dim * kvd_dtype_size(h->dtype);
    uint64_t next = h->header_size;
    unsigned seen = 0;
    for (unsigned i = 0; i < h->n_sections; i++) {
        const uint8_t *e = p + KVD_PAGE_FIXED_HEADER + (size_t)i * KVD_PAGE_SECTION_ENTRY;
        kvd_page_section *s = &h->sections[i];
        s->type = ld16(e);
        s->codec = e[2];
        s->offset = ld64(e + 8);
        s->length = ld64(e + 16);
        if (e[3] != 0 || ld32(e + 4) != 0)
            return CORRUPT("reserved bytes of section %u are not zero", i);
        if (s->type == 0 || s->type > KVD_SECTION_TYPE_MAX)
            return CORRUPT("section %u has unknown type %u", i, s->type);
        if (seen & (1u << s->type))
            return CORRUPT("section type %u appears twice", s->type);
        seen |= 1u << s->type;
        if (s->codec >= KVD_CODEC_COUNT)
            return CORRUPT("section %u has unknown codec %u", i, s->codec);
        if (s->offset != next)
            return CORRUPT("section %u starts at %llu, expected %llu", i,
                           (unsigned long long)s->offset, (unsigned long long)next);
        if (s->length > (uint64_t)len - s->offset)
            return CORRUPT("section %u (%llu bytes at %llu) runs past the %zu-byte page", i,
                           (unsigned long long)s->length, (unsigned long long)s->offset, len);
        next = s->offset + s->length;
        if (s->type == KVD_SECTION_K) {
            if (s->codec != h->k_codec)
                return CORRUPT("K section codec %u != header K codec %u", s->codec, h->k_codec);
            view->k = p + s->offset;
            view->k_len = s->length;
        } else if (s->type == KVD_SECTION_V) {
            if (s->codec != h->v_codec)
                return CORRUPT("V section codec %u != header V codec %u", s->codec, h->v_codec);
            view->v = p + s->offset;
            view->v_len = s->length;
        }
        if (s->type == KVD_SECTION_PQ_CODES) {
            if (s->codec != KVD_CODEC_RAW)
                return CORRUPT("PQ section codec %u, expected 0 (raw)", s->codec);
            int rc = check_pq(p + s->offset, s->length, h, checks & CHECK_CODES, err);
            if (rc)
                return rc;
            view->pq = p + s->offset;
            view->pq_len = s->length;
        }
        if ((s->type == KVD_SECTION_K || s->type == KVD_SECTION_V) && s->codec == KVD_CODEC_RAW &&
            s->length != raw_bytes)
            return CORRUPT("raw %s section is %llu bytes, expected %llu",
                           s->type == KVD_SECTION_K ? "K" : "V", (unsigned long long)s->length,
                           (unsigned long long)raw_bytes);
    }
    if (next != len)
        return CORRUPT("sections end at %llu but the page has %zu bytes", (unsigned long long)next,
                       len);
    if (!view->k || !view->v)
        return CORRUPT("page lacks a %s section", view->k ? "V" : "K");

    if (verify) {
        uint64_t want = kvd_page_checksum(p, len);
        if (want != h->checksum)
            return kvd_error_set(err, KVD_ECORRUPT,
                                 "page checksum mismatch (layer %u, tokens %llu+%u): stored "
                                 "%016llx, computed %016llx",
                                 h->layer, (unsigned long long)h->token_start, h->num_tokens,
                                 (unsigned long long)h->checksum, (unsigned long long)want);
    }
    view->page_len = len;
    return 0;
}

int kvd_page_decode(const void *buf, size_t len, kvd_page_view *view, kvd_error *err)
{
    return decode(buf, len, view, CHECK_ALL, err);
}

int kvd_page_decode_nocheck(const void *buf, size_t len, kvd_page_view *view, kvd_error *err)
{
    return decode(buf, len, view, CHECK_CODES, err);
}

int kvd_page_decode_trusted(const void *buf, size_t len, kvd_page_view *view, kvd_error *err)
{
    return decode(buf, len, view, CHECK_LAYOUT, err);
}

/* ---- PQ-codes section ------------------------------------------------------ */

int kvd_page_pq_get(const kvd_page_view *v, kvd_page_pq *out)
{
    memset(out, 0, sizeof *out);
    if (!v->pq)
        return 0;
    out->m = ld16(v->pq);
    out->bits = v->pq[2];
    out->centroids_id = ld64(v->pq + 8);
    out->codes = v->pq + KVD_PAGE_PQ_HEADER;
    return 1;
}

int kvd_page_put_section(const uint8_t *page, size_t len, uint16_t type, uint64_t payload_len,
                         uint8_t **out, size_t *out_len, uint8_t **payload, kvd_error *err)
{
    *out = NULL;
    *out_len = 0;
    *payload = NULL;
    kvd_page_view v;
    int rc = decode(page, len, &v, CHECK_CODES, err);
    if (rc)
        return rc;
    const kvd_page_header *h = &v.h;
    unsigned n = 0;
    uint64_t keep = 0;
    for (unsigned i = 0; i < h->n_sections; i++)
        if (h->sections[i].type != type) {
            n++;
            keep += h->sections[i].length;
        }
    if (n >= KVD_PAGE_MAX_SECTIONS)
        return kvd_error_set(err, KVD_EINVAL, "page already has %u sections", n);
    uint64_t hsize = KVD_PAGE_FIXED_HEADER + (uint64_t)(n + 1) * KVD_PAGE_SECTION_ENTRY;
    if (payload_len > (uint64_t)SIZE_MAX - hsize - keep)
        return kvd_error_set(err, KVD_ENOMEM, "page section of %llu bytes too large",
                             (unsigned long long)payload_len);
    size_t total = (size_t)(hsize + keep + payload_len);
    uint8_t *b = malloc(total);
    if (!b)
        return kvd_error_set(err, KVD_ENOMEM, "out of memory for a %zu-byte page", total);
    /* Fixed header, then the kept sections in their order, then the new one. */
    memcpy(b, page, KVD_PAGE_FIXED_HEADER);
    st16(b + 6, (uint16_t)hsize);
    st16(b + 48, (uint16_t)(n + 1));
    uint8_t *e = b + KVD_PAGE_FIXED_HEADER;
    uint64_t off = hsize;
    for (unsigned i = 0; i < h->n_sections; i++) {
        const kvd_page_section *s = &h->sections[i];
        if (s->type == type)
            continue;
        memcpy(e, page + KVD_PAGE_FIXED_HEADER + (size_t)i * KVD_PAGE_SECTION_ENTRY,
               KVD_PAGE_SECTION_ENTRY);
        st64(e + 8, off);
        memcpy(b + off, page + s->offset, (size_t)s->length);
        off += s->length;
        e += KVD_PAGE_SECTION_ENTRY;
    }
    memset(e, 0, KVD_PAGE_SECTION_ENTRY);
    st16(e, type);
    e[2] = KVD_CODEC_RAW;
    st64(e + 8, off);
    st64(e + 16, payload_len);
    memset(b + off, 0, (size_t)payload_len);
    *out = b;
    *out_len = total;
    *payload = b + off;
    return 0;
}
