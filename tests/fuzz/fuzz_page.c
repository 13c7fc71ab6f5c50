/*
 * libFuzzer target for the page decoder (store/format/page.c): the decoder must
 * never read out of bounds, and a page it accepts must be exactly what the
 * encoder writes for the header it reports.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "page.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    kvd_page_view v;
    kvd_error err;
    /* Check every entry point; the checksum-free ones reach the section
     * logic with arbitrary payloads (the trusted one reads no PQ codes, so
     * its pages are not held to their range). */
    for (int pass = 0; pass < 3; pass++) {
        int rc = pass == 2   ? kvd_page_decode_trusted(data, size, &v, &err)
                 : pass == 1 ? kvd_page_decode_nocheck(data, size, &v, &err)
                             : kvd_page_decode(data, size, &v, &err);
        if (rc != 0) {
            if (rc != KVD_ECORRUPT || err.msg[0] == '\0')
                abort();
            continue;
        }
        /* Touch every section byte so a sanitizer sees any bad bound. */
        uint8_t acc = 0;
        for (uint64_t i = 0; i < v.k_len; i++)
            acc ^= v.k[i];
        for (uint64_t i = 0; i < v.v_len; i++)
            acc ^= v.v[i];
        kvd_page_pq pq;
        if (kvd_page_pq_get(&v, &pq)) { /* the codes: (kv_head, token, m), each < 2^bits */
            uint64_t n = (uint64_t)v.h.num_kv_heads * v.h.num_tokens * pq.m;
            if (v.pq_len != KVD_PAGE_PQ_HEADER + n)
                abort();
            for (uint64_t i = 0; i < n; i++)
                if (pass < 2 && pq.codes[i] >> pq.bits)
                    abort();
        }
        if (v.page_len != size)
            abort();
        /* A valid raw K,V page re-encodes to the same bytes. */
        if (pass == 0 && v.h.n_sections == 2 && v.h.sections[0].type == KVD_SECTION_K &&
            v.h.k_codec == KVD_CODEC_RAW && v.h.v_codec == KVD_CODEC_RAW) {
            kvd_page_desc d = {.dtype = v.h.dtype,
                               .layer = v.h.layer,
                               .token_start = v.h.token_start,
                               .num_tokens = v.h.num_tokens,
                               .page_tokens = v.h.page_tokens,
                               .num_kv_heads = v.h.num_kv_heads,
                               .head_dim = v.h.head_dim,
                               .has_prefix_hash = !!(v.h.flags & KVD_PAGE_HAS_PREFIX_HASH),
                               .prefix_hash = v.h.prefix_hash};
            uint8_t *out;
            size_t len;
            if (kvd_page_encode_raw(&d, v.k, v.v, &out, &len, &err) != 0)
                abort();
            if (len != size || memcmp(out, data, size) != 0)
                abort();
            free(out);
        }
        (void)acc;
    }
    return 0;
}
