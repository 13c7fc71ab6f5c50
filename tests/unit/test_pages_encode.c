/*
 * Sealing pages coded together on a device backend (store/format/codec.c):
 * kvd_pages_encode with the raw pages in host memory and
 * kvd_pages_encode_device with them already in device memory give, page for
 * page, the bytes the CPU backend gives one page at a time (INT2, INT4,
 * keys and values on either axis, a raw side next to a coded one, stochastic
 * rounding); pages put in device memory from where their coding left their
 * arrays (kvd_page_image_copies) are the same bytes; the
 * misuses are refused with a clear error. Built against the CPU emulation of
 * the CUDA backend (tests/backend/cuda_emu.cmake).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "codec.h"
#include "kvdepot/quant.h"

static int failures;
#define CHECK(c)                                                                                   \
    do {                                                                                           \
        if (!(c)) {                                                                                \
            fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #c);                  \
            failures++;                                                                            \
        }                                                                                          \
    } while (0)

#define NP 5 /* pages */
#define B 64 /* page tokens */
#define H 2
#define D 64

static void fill(uint16_t *x, size_t n, uint64_t seed)
{
    uint64_t s = seed * 0x9e3779b97f4a7c15ull + 7;
    for (size_t i = 0; i < n; i++) {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        float f = (float)((s >> 40) & 0xffffff) / (float)(1 << 24) * 4.0f - 2.0f;
        x[i] = kvd_f32_to_f16(f);
    }
}

static kvd_codec_spec spec(uint8_t codec, uint16_t group, uint8_t axis, uint8_t round)
{
    kvd_codec_spec s;
    memset(&s, 0, sizeof s);
    s.codec = codec;
    s.group = group;
    s.axis = axis;
    s.rounding = round;
    s.seed = 42;
    return s;
}

static void free_pages(uint8_t **out)
{
    for (int p = 0; p < NP; p++) {
        free(out[p]);
        out[p] = NULL;
    }
}

/* The page with a PQ-codes section added (M sub-spaces of 8 bits), as an
 * append adds one: the K and V sections move behind a longer table. */
static uint8_t *with_pq(const uint8_t *page, size_t len, size_t *plen)
{
    enum { M = 8 };
    uint8_t *out = NULL, *sec = NULL;
    kvd_error err;
    if (kvd_page_put_section(page, len, KVD_SECTION_PQ_CODES,
                             KVD_PAGE_PQ_HEADER + (uint64_t)H * B * M, &out, plen, &sec, &err)) {
        fprintf(stderr, "put section: %s\n", err.msg);
        return NULL;
    }
    sec[0] = M;
    sec[2] = 8;
    sec[8] = 1; /* the centroids' id */
    for (size_t i = 0; i < (size_t)H * B * M; i++)
        sec[KVD_PAGE_PQ_HEADER + i] = (uint8_t)(i * 2654435761u >> 11);
    kvd_page_finish(out, *plen);
    return out;
}

/* Each page, with and without a PQ section added, put in device memory by
 * kvd_page_image_copies (its coded arrays copied within the device from
 * where the coding left them, the rest up) comes back the same bytes; the
 * arrays that stayed there are not sent up again. */
static void check_images(kvd_backend *gpu, uint8_t **pages, const size_t *len,
                         const kvd_dev_sections *keep, size_t c)
{
    CHECK(keep->n == NP && keep->scratch != NULL);
    for (int p = 0; p < NP; p++)
        for (int pq = 0; pq < 2; pq++) {
            size_t plen = len[p];
            uint8_t *page = pq ? with_pq(pages[p], len[p], &plen) : pages[p];
            void *img = NULL;
            uint8_t *back = malloc(plen);
            kvd_copy ops[KVD_PAGE_IMAGE_COPIES];
            size_t nops = 0, up = 0, within = 0;
            kvd_error err;
            int rc = page && back ? kvd_backend_alloc(gpu, plen, &img, &err) : -1;
            if (rc == 0)
                rc = kvd_page_image_copies(page, plen, keep, (size_t)p, img, ops, &nops, &err);
            for (size_t i = 0; rc == 0 && i < nops; i++) {
                up += ops[i].within ? 0 : ops[i].bytes;
                within += ops[i].within ? ops[i].bytes : 0;
            }
            if (rc == 0)
                rc = kvd_backend_copy_batch(gpu, ops, nops, &err);
            if (rc == 0)
                rc = kvd_backend_download(gpu, back, img, plen, &err);
            CHECK(rc == 0);
            if (rc == 0) {
                CHECK(memcmp(back, page, plen) == 0);
                CHECK(up + within == plen);
                /* Every coded or raw side's arrays stayed on the device: what
                 * goes up is the header, prefixes and the PQ section. */
                uint64_t kept = keep->side[p][0].len + keep->side[p][1].len;
                CHECK(within == kept && kept > 0);
                if (memcmp(back, page, plen) || within != kept)
                    fprintf(stderr,
                            "case %zu page %d%s: image differs or %zu of %llu bytes "
                            "copied within\n",
                            c, p, pq ? " with PQ" : "", within, (unsigned long long)kept);
            } else {
                fprintf(stderr, "case %zu page %d image: %s\n", c, p, rc < 0 ? "" : err.msg);
            }
            kvd_backend_dealloc(gpu, img);
            free(back);
            if (pq)
                free(page);
        }
    /* A page that does not parse gives no copies. */
    kvd_copy ops[KVD_PAGE_IMAGE_COPIES];
    size_t nops = 7;
    kvd_error err;
    uint8_t junk[256] = {1, 2, 3};
    void *img = (void *)junk;
    CHECK(kvd_page_image_copies(junk, sizeof junk, keep, 0, img, ops, &nops, &err) ==
              KVD_ECORRUPT &&
          nops == 0);
}

int main(void)
{
    kvd_backend *cpu = NULL, *gpu = NULL;
    kvd_cpu_options opt = {1, 0, 0, 0};
    kvd_error err;
    if (kvd_backend_cpu_create(&opt, &cpu, &err) || kvd_backend_cuda_create(-1, &gpu, &err)) {
        fprintf(stderr, "backends: %s\n", err.msg);
        return 1;
    }
    const size_t sec = (size_t)H * B * D; /* f16 values of one side of a page */
    uint16_t *k[NP], *v[NP];
    void *kd[NP], *vd[NP];
    kvd_page_desc d[NP];
    for (int p = 0; p < NP; p++) {
        k[p] = malloc(sec * 2);
        v[p] = malloc(sec * 2);
        fill(k[p], sec, 10 + (uint64_t)p);
        fill(v[p], sec, 100 + (uint64_t)p);
        d[p] = (kvd_page_desc){.dtype = KVD_DTYPE_F16,
                               .layer = 2,
                               .token_start = (uint64_t)(p + 1) * B,
                               .num_tokens = B,
                               .page_tokens = B,
                               .num_kv_heads = H,
                               .head_dim = D};
        if (kvd_backend_alloc(gpu, sec * 2, &kd[p], &err) ||
            kvd_backend_alloc(gpu, sec * 2, &vd[p], &err) ||
            kvd_backend_upload(gpu, kd[p], k[p], sec * 2, &err) ||
            kvd_backend_upload(gpu, vd[p], v[p], sec * 2, &err)) {
            fprintf(stderr, "device memory: %s\n", err.msg);
            return 1;
        }
    }
    const void *const *kh = (const void *const *)k, *const *vh = (const void *const *)v;
    const void *const *kdv = (const void *const *)kd, *const *vdv = (const void *const *)vd;
    const struct {
        uint8_t kc, vc, kaxis, vaxis, round;
        uint16_t kgroup, vgroup;
    } cases[] = {
        {KVD_CODEC_INT2, KVD_CODEC_INT2, KVD_QAXIS_TOKEN, KVD_QAXIS_CHANNEL, 0, 64, 64},
        {KVD_CODEC_INT4, KVD_CODEC_INT4, KVD_QAXIS_TOKEN, KVD_QAXIS_TOKEN, 1, 32, 32},
        {KVD_CODEC_INT4, KVD_CODEC_RAW, KVD_QAXIS_TOKEN, KVD_QAXIS_TOKEN, 0, 64, 64},
        {KVD_CODEC_RAW, KVD_CODEC_INT2, KVD_QAXIS_TOKEN, KVD_QAXIS_TOKEN, 1, 64, 32},
        /* keys per channel (KIVI) */
        {KVD_CODEC_INT2, KVD_CODEC_INT2, KVD_QAXIS_CHANNEL, KVD_QAXIS_CHANNEL, 0, 64, 64},
        {KVD_CODEC_INT4, KVD_CODEC_INT2, KVD_QAXIS_CHANNEL, KVD_QAXIS_TOKEN, 1, 32, 32},
    };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        kvd_codec_spec ks = spec(cases[c].kc, cases[c].kgroup, cases[c].kaxis, cases[c].round);
        kvd_codec_spec vs = spec(cases[c].vc, cases[c].vgroup, cases[c].vaxis, cases[c].round);
        uint8_t *want[NP] = {0}, *host[NP] = {0}, *dev[NP] = {0};
        size_t wl[NP], hl[NP], dl[NP];
        int rc = 0;
        for (int p = 0; p < NP && rc == 0; p++)
            rc = kvd_page_encode(cpu, &d[p], &ks, &vs, k[p], v[p], &want[p], &wl[p], &err);
        CHECK(rc == 0);
        rc = kvd_pages_encode(gpu, NP, d, &ks, &vs, kh, vh, host, hl, &err);
        CHECK(rc == 0);
        if (rc)
            fprintf(stderr, "case %zu, host inputs: %s\n", c, err.msg);
        kvd_dev_sections keep;
        rc = kvd_pages_encode_device(gpu, NP, d, &ks, &vs, kdv, vdv, dev, dl, &keep, &err);
        CHECK(rc == 0);
        if (rc)
            fprintf(stderr, "case %zu, device inputs: %s\n", c, err.msg);
        else
            check_images(gpu, dev, dl, &keep, c);
        kvd_dev_sections_free(&keep);
        for (int p = 0; p < NP; p++) {
            CHECK(want[p] && host[p] && dev[p]);
            if (!want[p] || !host[p] || !dev[p])
                continue;
            CHECK(hl[p] == wl[p] && memcmp(host[p], want[p], wl[p]) == 0);
            CHECK(dl[p] == wl[p] && memcmp(dev[p], want[p], wl[p]) == 0);
            kvd_page_view pv;
            CHECK(kvd_page_decode(dev[p], dl[p], &pv, &err) == 0);
        }
        free_pages(want);
        free_pages(host);
        free_pages(dev);
    }

    /* Misuses: no device, nothing to code, a page of another shape,
     * a missing side. Every out[] is left NULL. */
    kvd_codec_spec i2 = spec(KVD_CODEC_INT2, 64, KVD_QAXIS_TOKEN, 0);
    kvd_codec_spec raw = spec(KVD_CODEC_RAW, 0, 0, 0);
    uint8_t *out[NP];
    size_t len[NP];
    CHECK(kvd_pages_encode_device(cpu, NP, d, &i2, &i2, kdv, vdv, out, len, NULL, &err) ==
          KVD_EINVAL);
    CHECK(strstr(err.msg, "device backend") != NULL);
    CHECK(kvd_pages_encode_device(gpu, NP, d, &raw, &raw, kdv, vdv, out, len, NULL, &err) ==
          KVD_EINVAL);
    CHECK(strstr(err.msg, "both sides are raw") != NULL);
    kvd_page_desc bad[NP];
    memcpy(bad, d, sizeof bad);
    bad[3].num_tokens = B - 1;
    CHECK(kvd_pages_encode_device(gpu, NP, bad, &i2, &i2, kdv, vdv, out, len, NULL, &err) ==
          KVD_EINVAL);
    CHECK(strstr(err.msg, "page 3 is not a sealing page") != NULL);
    for (int p = 0; p < NP; p++)
        CHECK(out[p] == NULL);
    const void *kmiss[NP] = {kd[0], kd[1], NULL, kd[3], kd[4]};
    CHECK(kvd_pages_encode_device(gpu, NP, d, &i2, &i2, kmiss, vdv, out, len, NULL, &err) ==
          KVD_EINVAL);
    CHECK(strstr(err.msg, "page 2 has no K or V") != NULL);
    CHECK(kvd_pages_encode_device(gpu, 0, d, &i2, &i2, kdv, vdv, out, len, NULL, &err) == 0);

    for (int p = 0; p < NP; p++) {
        free(k[p]);
        free(v[p]);
        kvd_backend_dealloc(gpu, kd[p]);
        kvd_backend_dealloc(gpu, vd[p]);
    }
    kvd_backend_free(gpu);
    kvd_backend_free(cpu);
    printf("%s (%d failures)\n", failures ? "FAIL" : "PASS", failures);
    return failures != 0;
}
