/*
 * libFuzzer target for the coded K/V sections (store/format/codec.c): a sealed
 * page of 2 kv heads x 32 tokens x 16 dims whose K section is the input
 * (after one control byte), parsed, decoded and attended with a fixed
 * artifact snapshot (VQ d4b5, SVD widths 8 and 16). Nothing may read out of
 * bounds, and every failure must be DATA_LOSS (malformed) or
 * FAILED_PRECONDITION (coded with other artifacts).
 *
 * Control byte: bits 0-2 pick the K codec (0 VQ, 1 SVD, 2 INT2, 3 INT4,
 * else raw); bit 3 overwrites the section's fingerprint with the snapshot's,
 * so the fuzzer reaches the payload checks without guessing 64 bits.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "codec.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

enum { FH = 2, FT = 32, FD = 16, FHQ = 4 };

static kvd_backend *be;
static kvd_codec_arts *arts;

static void init(void)
{
    kvd_cpu_options opt = {1, 0, 0, 0};
    if (kvd_backend_cpu_create(&opt, &be, NULL))
        abort();
    static float lam[FD], cb[32 * 4], rot[FD * FD], cbv[32 * 4];
    for (int i = 0; i < FD; i++) {
        lam[i] = 1.0f + 0.1f * (float)i;
        rot[i * FD + i] = 1.0f;
    }
    for (int i = 0; i < 32 * 4; i++) {
        cb[i] = sinf((float)i);
        cbv[i] = cosf((float)i);
    }
    kvd_art_ref r[FH * 4];
    size_t n = 0;
    for (uint32_t h = 0; h < FH; h++) {
        r[n++] = (kvd_art_ref){1, 0, h, 1, {FD, 0}, lam};
        r[n++] = (kvd_art_ref){2, 0, h, 2, {32, 4}, cb};
        r[n++] = (kvd_art_ref){3, 0, h, 2, {32, 4}, cbv};
        r[n++] = (kvd_art_ref){5, 0, h, 2, {FD, FD}, rot};
    }
    static const uint32_t w[FH] = {8, 16};
    kvd_codec_spec ks, vs;
    memset(&ks, 0, sizeof ks);
    memset(&vs, 0, sizeof vs);
    ks.codec = KVD_CODEC_VQ;
    ks.vq_sub_dim = 4;
    ks.vq_bits = 5;
    vs.svd = 1;
    vs.svd_nwidths = FH;
    vs.svd_widths = w;
    /* K side: VQ; V side (used for SVD K sections too): SVD widths. The
     * snapshot's V side is copied to its K side's rotation slots below. */
    if (kvd_codec_arts_build(&ks, &vs, 1, FH, FD, r, n, &arts, NULL))
        abort();
    arts->k[0].rotation = malloc(sizeof rot * FH);
    arts->k[0].widths = malloc(sizeof(int32_t) * FH);
    memcpy(arts->k[0].rotation, arts->v[0].rotation, sizeof rot * FH);
    memcpy(arts->k[0].widths, arts->v[0].widths, sizeof(int32_t) * FH);
    arts->k[0].fingerprint = kvd_layer_arts_fingerprint(&arts->k[0], FH, FD);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (!be)
        init();
    if (size < 1)
        return 0;
    static const uint8_t codecs[8] = {KVD_CODEC_VQ, KVD_CODEC_SVD, KVD_CODEC_INT2,
                                      KVD_CODEC_INT4, 0, 0, 0, 0};
    /* Exactly sized copy, so a read past the section end is caught. */
    size_t klen = size - 1;
    uint8_t *k = malloc(klen ? klen : 1);
    memcpy(k, data + 1, klen);
    if ((data[0] & 8) && klen >= 16)
        for (int i = 0; i < 8; i++)
            k[8 + i] = (uint8_t)(arts->k[0].fingerprint >> (8 * i));
    static uint16_t vraw[FH * FT * FD];
    kvd_page_view v;
    memset(&v, 0, sizeof v);
    v.h.k_codec = codecs[data[0] & 7];
    v.h.v_codec = KVD_CODEC_RAW;
    v.h.dtype = KVD_DTYPE_F16;
    v.h.flags = KVD_PAGE_SEALED;
    v.h.num_tokens = v.h.page_tokens = FT;
    v.h.num_kv_heads = FH;
    v.h.head_dim = FD;
    v.k = k;
    v.k_len = klen;
    v.v = (const uint8_t *)vraw;
    v.v_len = sizeof vraw;
    v.page_len = klen + sizeof vraw;
    if (v.h.k_codec == KVD_CODEC_RAW && klen != sizeof vraw) {
        free(k); /* the page decoder checks raw lengths before this layer */
        return 0;
    }
    kvd_error err;
    kvd_codec_section *s = malloc(sizeof *s);
    int rc = kvd_codec_section_parse(&v, KVD_SECTION_K, arts, s, &err);
    if (rc && rc != KVD_ECORRUPT && rc != KVD_EPRECOND)
        abort();
    free(s);
    float *dec = malloc(sizeof(float) * FH * FT * FD);
    int rc2 = kvd_page_decode_section(be, &v, KVD_SECTION_K, arts, KVD_DTYPE_F32, dec, &err);
    if ((rc == 0) != (rc2 == 0) && rc2 != KVD_ECORRUPT)
        abort(); /* decode fails only where parse does, or on an invalid code */
    float q[FHQ * FD], out[FHQ * FD], lse[FHQ];
    for (int i = 0; i < FHQ * FD; i++)
        q[i] = 0.1f * (float)(i % 7);
    kvd_attn_dims dims = {FHQ, FH, FD, FD, 0.25f};
    int rc3 = kvd_page_attend(be, &v, 1, arts, &dims, q, out, lse, &err);
    if (rc3 && rc3 != KVD_ECORRUPT && rc3 != KVD_EPRECOND)
        abort();
    if (rc2 == 0 && rc3 != 0)
        abort();
    if (getenv("KVD_FUZZ_VERBOSE")) /* which inputs get how far (corpus upkeep) */
        fprintf(stderr, "codec %u, %zu bytes: parse %d decode %d attend %d\n", v.h.k_codec, klen,
                rc, rc2, rc3);
    free(dec);
    free(k);
    return 0;
}
