/*
 * Page format: round trip, every flipped byte detected, truncation,
 * structural checks.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <xxhash.h>

#include "page.h"

static int failures;

#define CHECK(cond, ...)                                                                           \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            fprintf(stderr, "%s:%d: check failed: %s: ", __FILE__, __LINE__, #cond);               \
            fprintf(stderr, __VA_ARGS__);                                                          \
            fputc('\n', stderr);                                                                   \
            failures++;                                                                            \
        }                                                                                          \
    } while (0)

static void fill(uint8_t *p, size_t n, uint32_t seed)
{
    for (size_t i = 0; i < n; i++) {
        seed = seed * 1103515245u + 12345u;
        p[i] = (uint8_t)(seed >> 16);
    }
}

static kvd_page_desc desc(uint32_t ntok)
{
    kvd_page_desc d = {.dtype = KVD_DTYPE_F16,
                       .layer = 7,
                       .token_start = 32,
                       .num_tokens = ntok,
                       .page_tokens = 16,
                       .num_kv_heads = 3,
                       .head_dim = 5};
    return d;
}

static void test_round_trip(void)
{
    for (uint32_t ntok = 1; ntok <= 16; ntok += 15) {
        kvd_page_desc d = desc(ntok);
        if (ntok == 16) {
            d.has_prefix_hash = 1;
            d.prefix_hash = 0x0123456789abcdefull;
        }
        size_t sec = (size_t)kvd_page_raw_section_bytes(&d);
        uint8_t *k = malloc(sec), *v = malloc(sec);
        fill(k, sec, 1);
        fill(v, sec, 2);
        uint8_t *page;
        size_t len;
        kvd_error err;
        int rc = kvd_page_encode_raw(&d, k, v, &page, &len, &err);
        CHECK(rc == 0, "encode: %s", err.msg);
        CHECK(len == kvd_page_raw_size(&d), "len %zu", len);
        kvd_page_view vw;
        rc = kvd_page_decode(page, len, &vw, &err);
        CHECK(rc == 0, "decode: %s", err.msg);
        CHECK(vw.h.layer == 7 && vw.h.token_start == 32 && vw.h.num_tokens == ntok &&
                  vw.h.page_tokens == 16 && vw.h.num_kv_heads == 3 && vw.h.head_dim == 5 &&
                  vw.h.dtype == KVD_DTYPE_F16,
              "header fields differ");
        CHECK(!!(vw.h.flags & KVD_PAGE_SEALED) == (ntok == 16), "sealed flag");
        CHECK(vw.h.prefix_hash == (ntok == 16 ? 0x0123456789abcdefull : 0), "prefix hash");
        CHECK(vw.k_len == sec && memcmp(vw.k, k, sec) == 0, "K bytes differ");
        CHECK(vw.v_len == sec && memcmp(vw.v, v, sec) == 0, "V bytes differ");
        CHECK(memcmp(page, "KVDP", 4) == 0, "magic");
        free(page);
        free(k);
        free(v);
    }
}

/* The checksum is XXH3-64 (seed 0) of the page without its checksum field
 * (page.h), whatever XXH3 loop computes it: checked against the library's
 * one-shot hash of those bytes laid end to end, at lengths that take each of
 * XXH3's paths (short input, one stripe block, many, a long tail). */
static void test_checksum_definition(void)
{
    const size_t lens[] = {65,        64 + 16,   64 + 128,   64 + 240,
                           64 + 1000, 64 + 4096, 64 + 65536, 64 + (1u << 20) + 37};
    for (size_t i = 0; i < sizeof lens / sizeof lens[0]; i++) {
        const size_t len = lens[i], body = len - KVD_PAGE_FIXED_HEADER;
        uint8_t *page = malloc(len), *flat = malloc(KVD_PAGE_CHECKSUM_OFFSET + body);
        fill(page, len, (uint32_t)i + 11);
        memcpy(flat, page, KVD_PAGE_CHECKSUM_OFFSET);
        memcpy(flat + KVD_PAGE_CHECKSUM_OFFSET, page + KVD_PAGE_FIXED_HEADER, body);
        const uint64_t want = XXH3_64bits(flat, KVD_PAGE_CHECKSUM_OFFSET + body);
        const uint64_t got = kvd_page_checksum(page, len);
        CHECK(got == want, "length %zu: checksum %016llx, XXH3-64 of the bytes %016llx", len,
              (unsigned long long)got, (unsigned long long)want);
        free(page);
        free(flat);
    }
}

static void test_every_flipped_byte(void)
{
    kvd_page_desc d = desc(9);
    d.has_prefix_hash = 0;
    size_t sec = (size_t)kvd_page_raw_section_bytes(&d);
    uint8_t *k = malloc(sec), *v = malloc(sec);
    fill(k, sec, 3);
    fill(v, sec, 4);
    uint8_t *page;
    size_t len;
    kvd_error err;
    CHECK(kvd_page_encode_raw(&d, k, v, &page, &len, &err) == 0, "encode: %s", err.msg);
    const uint8_t flips[] = {0x01, 0x80, 0xff};
    for (size_t i = 0; i < len; i++) {
        for (size_t f = 0; f < sizeof flips; f++) {
            page[i] ^= flips[f];
            kvd_page_view vw;
            int rc = kvd_page_decode(page, len, &vw, &err);
            CHECK(rc == KVD_ECORRUPT, "flip 0x%02x at byte %zu not detected (rc %d)", flips[f], i,
                  rc);
            page[i] ^= flips[f];
        }
    }
    kvd_page_view vw;
    CHECK(kvd_page_decode(page, len, &vw, &err) == 0, "restored page: %s", err.msg);
    free(page);
    free(k);
    free(v);
}

static void test_truncated_and_extended(void)
{
    kvd_page_desc d = desc(4);
    size_t sec = (size_t)kvd_page_raw_section_bytes(&d);
    uint8_t *k = calloc(1, sec), *v = calloc(1, sec);
    uint8_t *page;
    size_t len;
    kvd_error err;
    CHECK(kvd_page_encode_raw(&d, k, v, &page, &len, &err) == 0, "encode: %s", err.msg);
    for (size_t n = 0; n < len; n++) {
        /* A copy of exactly n bytes so a sanitizer build catches any
         * read past the end. */
        uint8_t *cut = malloc(n ? n : 1);
        memcpy(cut, page, n);
        kvd_page_view vw;
        int rc = kvd_page_decode(cut, n, &vw, &err);
        CHECK(rc == KVD_ECORRUPT, "page truncated to %zu bytes accepted (rc %d)", n, rc);
        free(cut);
    }
    uint8_t *longer = malloc(len + 1);
    memcpy(longer, page, len);
    longer[len] = 0;
    kvd_page_view vw;
    CHECK(kvd_page_decode(longer, len + 1, &vw, &err) == KVD_ECORRUPT,
          "page with a trailing byte accepted");
    CHECK(kvd_page_decode(NULL, 0, &vw, &err) == KVD_EINVAL, "NULL page");
    free(longer);
    free(page);
    free(k);
    free(v);
}

/* Structurally wrong pages whose checksum is recomputed, so only the
 * structural checks can reject them. */
static void test_structure(void)
{
    kvd_page_desc d = desc(4);
    size_t sec = (size_t)kvd_page_raw_section_bytes(&d);
    uint8_t *k = calloc(1, sec), *v = calloc(1, sec);
    uint8_t *page;
    size_t len;
    kvd_error err;
    CHECK(kvd_page_encode_raw(&d, k, v, &page, &len, &err) == 0, "encode: %s", err.msg);
    struct {
        size_t off;
        uint8_t val;
        const char *what;
    } cases[] = {
        {4, 2, "version 2"},
        {6, 65, "header size"},
        {8, 9, "K codec"},
        {10, 9, "dtype"},
        {11, 0x04, "unknown flag"},
        {11, 0x01, "sealed flag"},
        {24, 17, "num_tokens > cap"},
        {24, 0, "zero tokens"},
        {16, 14, "token_start"},
        {32, 0, "zero heads"},
        {48, 9, "9 sections"},
        {50, 1, "reserved"},
        {64, 5, "section type"},
        {64 + 24, 1, "duplicate K"},
        {64 + 2, 1, "section codec"},
        {64 + 8, 0, "section offset"},
        {64 + 16, 0, "section length"},
        {64 + 3, 1, "entry reserved"},
        {40, 1, "hash without flag"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        uint8_t *p = malloc(len);
        memcpy(p, page, len);
        p[cases[i].off] = cases[i].val;
        kvd_page_finish(p, len);
        kvd_page_view vw;
        int rc = kvd_page_decode(p, len, &vw, &err);
        CHECK(rc == KVD_ECORRUPT, "%s accepted (rc %d)", cases[i].what, rc);
        CHECK(rc == 0 || strstr(err.msg, "corrupt page") != NULL, "%s: message '%s'", cases[i].what,
              err.msg);
        free(p);
    }
    /* A section length pointing far past the end must not be trusted. */
    uint8_t *p = malloc(len);
    memcpy(p, page, len);
    for (int b = 0; b < 8; b++)
        p[64 + 16 + b] = 0xff;
    kvd_page_finish(p, len);
    kvd_page_view vw;
    CHECK(kvd_page_decode(p, len, &vw, &err) == KVD_ECORRUPT, "huge section length accepted");
    free(p);
    /* Bad descriptions are refused by the encoder. */
    kvd_page_desc bad = desc(4);
    bad.token_start = 13; /* 13 + 4 tokens cross the 16-token block */
    uint8_t *out;
    size_t olen;
    CHECK(kvd_page_encode_raw(&bad, k, v, &out, &olen, &err) == KVD_EINVAL, "bad token_start");
    bad = desc(17);
    CHECK(kvd_page_encode_raw(&bad, k, v, &out, &olen, &err) == KVD_EINVAL, "17 > 16 tokens");
    bad = desc(4);
    bad.dtype = KVD_DTYPE_U8;
    CHECK(kvd_page_encode_raw(&bad, k, v, &out, &olen, &err) == KVD_EINVAL, "u8 dtype");
    free(page);
    free(k);
    free(v);
}

int main(void)
{
    test_round_trip();
    test_checksum_definition();
    test_every_flipped_byte();
    test_truncated_and_extended();
    test_structure();
    if (failures) {
        fprintf(stderr, "test_page: %d check(s) failed\n", failures);
        return 1;
    }
    printf("test_page: ok\n");
    return 0;
}
