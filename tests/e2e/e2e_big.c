/*
 * The acceptance case: a 4096-token x 32-layer x 8-head x 128-dim f16
 * sequence (256 MiB of K + 256 MiB of V) appended through libkvdepot reads
 * back bit-exact, before and after a server restart.
 *
 * Memory is kept to one 512 MiB buffer at a time: the data is generated,
 * hashed (xxh3-128) and appended, then freed; each read is compared by hash,
 * and only on a mismatch is the data generated again to find the first
 * differing byte.
 *
 * Usage: e2e_big KVDEPOTD_PATH [big]
 */
#include "harness.h"

#include <inttypes.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <xxhash.h>

enum { LAYERS = 32, HEADS = 8, DIM = 128, TOKENS = 4096 };

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static void first_difference(const uint8_t *got, const uint8_t *want, size_t n, const char *what)
{
    for (size_t i = 0; i < n; i++) {
        if (got[i] != want[i]) {
            size_t tok_bytes = (size_t)HEADS * DIM * 2;
            size_t layer = i / (tok_bytes * TOKENS);
            size_t token = i / tok_bytes % TOKENS;
            fprintf(stderr, "%s differs first at byte %zu (layer %zu token %zu): got %02x want %02x\n",
                    what, i, layer, token, got[i], want[i]);
            return;
        }
    }
}

/* Read the whole sequence and compare it with the expected hashes. */
static int read_and_compare(kvdepot_client *c, XXH128_hash_t hk, XXH128_hash_t hv, size_t kv,
                            const char *when)
{
    kvdepot_read_args ra = {.id = "big", .id_len = 3};
    kvdepot_read_result res;
    double t0 = now_s();
    int rc = kvdepot_sequence_read(c, &ra, &res);
    double dt = now_s() - t0;
    if (rc) {
        fprintf(stderr, "read %s: %s: %s\n", when, kvdepot_status_name(rc), kvdepot_errmsg(c));
        kvd_test_failures++;
        return -1;
    }
    printf("read %s: %zu MiB in %.2f s (%.0f MB/s)\n", when, 2 * kv >> 20, dt, 2.0 * kv / dt / 1e6);
    int bad = 0;
    if (res.kv_bytes != kv || res.num_tokens != TOKENS || res.num_layers != LAYERS ||
        res.num_kv_heads != HEADS || res.head_dim != DIM || res.dtype != KVDEPOT_DTYPE_F16) {
        fprintf(stderr, "read %s: header %u layers x %" PRIu64 " tokens x %u x %u, %zu bytes\n", when,
                res.num_layers, res.num_tokens, res.num_kv_heads, res.head_dim, res.kv_bytes);
        bad = 1;
    } else {
        XXH128_hash_t gk = XXH3_128bits(res.k, kv), gv = XXH3_128bits(res.v, kv);
        if (!XXH128_isEqual(gk, hk) || !XXH128_isEqual(gv, hv)) {
            bad = 1;
            uint8_t *want = malloc(kv);
            if (want) {
                fill_random(want, kv, 1);
                first_difference(res.k, want, kv, "K");
                fill_random(want, kv, 2);
                first_difference(res.v, want, kv, "V");
                free(want);
            }
        }
    }
    kvdepot_free(res.owned);
    if (bad) {
        fprintf(stderr, "read %s: data differs from what was appended\n", when);
        kvd_test_failures++;
    }
    return bad ? -1 : 0;
}

static int test_big(kvd_harness *h)
{
    kvdepot_options opt;
    kvdepot_options_init(&opt);
    opt.deadline_ms = 600000;
    opt.wait_for_ready = 1;
    kvdepot_client *c = harness_client_opts(h, &opt);
    REQUIRE(c);
    kvdepot_model m;
    memset(&m, 0, sizeof m);
    snprintf(m.name, sizeof m.name, "llama-3-8b");
    m.num_layers = LAYERS;
    m.num_kv_heads = HEADS;
    m.num_q_heads = 32;
    m.head_dim = DIM;
    m.dtype = KVDEPOT_DTYPE_F16;
    REQUIRE_RC(kvdepot_model_put(c, &m, 0, NULL, NULL), KVDEPOT_OK);
    kvdepot_create_args ca = {.id = "big", .id_len = 3, .model = m.name};
    REQUIRE_RC(kvdepot_sequence_create(c, &ca, NULL), KVDEPOT_OK);

    size_t kv = kvdepot_kv_bytes(&m, LAYERS, TOKENS);
    REQUIRE(kv == 256u << 20);
    /* K and V as two separate allocations: the library must not need them
     * adjacent. */
    uint8_t *k = malloc(kv), *v = malloc(kv);
    REQUIRE(k && v);
    fill_random(k, kv, 1);
    fill_random(v, kv, 2);
    XXH128_hash_t hk = XXH3_128bits(k, kv), hv = XXH3_128bits(v, kv);

    kvdepot_append_args a = {.id = "big", .id_len = 3, .num_tokens = TOKENS,
                             .dtype = KVDEPOT_DTYPE_F16, .k = k, .k_bytes = kv, .v = v,
                             .v_bytes = kv};
    kvdepot_sequence_info s;
    double t0 = now_s();
    int rc = kvdepot_sequence_append(c, &a, &s);
    double dt = now_s() - t0;
    if (rc == KVDEPOT_OK)
        printf("append: %zu MiB in %.2f s (%.0f MB/s)\n", 2 * kv >> 20, dt, 2.0 * kv / dt / 1e6);
    /* The same 512 MiB for a sequence that does not exist: refused after
     * the header, and the client stops sending instead of streaming it all. */
    kvdepot_append_args ghost = a;
    ghost.id = "ghost";
    ghost.id_len = 5;
    double t1 = now_s();
    CHECK_RC(kvdepot_sequence_append(c, &ghost, NULL), KVDEPOT_ENOTFOUND);
    printf("refused append: %.2f s\n", now_s() - t1);
    free(k);
    free(v);
    REQUIRE_RC(rc, KVDEPOT_OK);
    CHECK(s.num_tokens == TOKENS && s.num_layers == LAYERS);
    if (s.page_tokens)
        CHECK(s.sealed_pages == (uint64_t)LAYERS * (TOKENS / s.page_tokens));
    kvdepot_sequence_info_clear(&s);

    read_and_compare(c, hk, hv, kv, "before restart");
    t0 = now_s();
    REQUIRE(harness_restart(h) == 0);
    printf("restart: %.2f s\n", now_s() - t0);
    kvdepot_close(c);
    c = harness_client_opts(h, &opt);
    REQUIRE(c);
    CHECK_RC(kvdepot_sequence_stat(c, "big", 3, &s), KVDEPOT_OK);
    CHECK(s.num_tokens == TOKENS);
    kvdepot_sequence_info_clear(&s);
    read_and_compare(c, hk, hv, kv, "after restart");
    kvdepot_close(c);
    return 0;
}

static const kvd_test tests[] = {
    {"big", test_big},
};

int main(int argc, char **argv)
{
    return harness_main(argc, argv, tests, sizeof tests / sizeof tests[0]);
}
