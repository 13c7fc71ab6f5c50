/*
 * Activation-first Read (KVPR) over loopback: a sequence with stored
 * activations is read with activation_tokens l = 0 (plain K/V) ... n, and the
 * table shows the bytes, time and throughput of each, next to PlanFetch's
 * split for a 10 Gbit/s link and a 20 TFLOP/s receiver. Not a test: it
 * prints a table.
 *
 * Usage: bench_activations KVDEPOTD [tokens]   (default 4096)
 */
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "harness.h"

static double now_sec(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

int main(int argc, char **argv)
{
    if (argc < 2) {
        fprintf(stderr, "usage: %s KVDEPOTD [tokens]\n", argv[0]);
        return 2;
    }
    /* A GQA-free shape, as in KVPR: X (hidden 1024) is half of K+V. */
    const uint32_t L = 8, H = 8, D = 128, HID = 1024, STEP = 512;
    uint64_t n = argc > 2 ? strtoull(argv[2], NULL, 10) : 4096;
    n = (n + STEP - 1) / STEP * STEP;
    kvd_harness h;
    if (harness_init(&h, argv[1]) || harness_start(&h))
        return 1;
    kvdepot_client *c = harness_client(&h);
    kvdepot_model m;
    memset(&m, 0, sizeof m);
    snprintf(m.name, sizeof m.name, "bench");
    m.num_layers = L;
    m.num_kv_heads = H;
    m.num_q_heads = H;
    m.head_dim = D;
    m.hidden_size = HID;
    m.dtype = KVDEPOT_DTYPE_F16;
    kvdepot_codecs cs;
    memset(&cs, 0, sizeof cs);
    cs.store_activations = 1;
    kvdepot_create_args ca;
    memset(&ca, 0, sizeof ca);
    ca.id = "s";
    ca.id_len = 1;
    ca.model = "bench";
    ca.codecs = &cs;
    if (!c || kvdepot_model_put(c, &m, 0, NULL, NULL) || kvdepot_sequence_create(c, &ca, NULL)) {
        fprintf(stderr, "setup: %s\n", kvdepot_errmsg(NULL));
        harness_destroy(&h, 1);
        return 1;
    }
    size_t kvb = (size_t)L * STEP * H * D * 2, xb = (size_t)L * STEP * HID * 2;
    uint8_t *k = malloc(kvb), *v = malloc(kvb), *x = malloc(xb);
    double t_append = 0;
    for (uint64_t t = 0; t < n && k && v && x; t += STEP) {
        fill_random(k, kvb, 3 * t);
        fill_random(v, kvb, 3 * t + 1);
        fill_random(x, xb, 3 * t + 2);
        kvdepot_append_args a;
        memset(&a, 0, sizeof a);
        a.id = "s";
        a.id_len = 1;
        a.token_start = t;
        a.num_tokens = STEP;
        a.dtype = KVDEPOT_DTYPE_F16;
        a.k = k;
        a.k_bytes = kvb;
        a.v = v;
        a.v_bytes = kvb;
        a.x = x;
        a.x_bytes = xb;
        double t0 = now_sec();
        if (kvdepot_sequence_append(c, &a, NULL)) {
            fprintf(stderr, "append: %s\n", kvdepot_errmsg(NULL));
            harness_destroy(&h, 1);
            return 1;
        }
        t_append += now_sec() - t0;
    }
    printf("%llu tokens x %u layers appended with X: %.1f MiB in %.3f s\n", (unsigned long long)n,
           L, (double)n / STEP * (2.0 * kvb + xb) / 1048576, t_append);
    kvdepot_fetch_plan p;
    if (kvdepot_plan_fetch(c, "s", 1, 1.25e9, 2e13, 0, 0, 0, &p) == 0)
        printf("PlanFetch (10 Gbit/s, 20 TFLOP/s): split %llu of %llu, predicted %.4f s, "
               "plain fetch %.4f s\n",
               (unsigned long long)p.split_tokens, (unsigned long long)p.num_tokens,
               p.predicted_seconds, p.kv_only_seconds);
    printf("\n%8s %10s %10s %10s %8s\n", "l", "X MiB", "K+V MiB", "s", "GB/s");
    for (int i = 0; i <= 4; i++) {
        uint64_t l = n * (uint64_t)i / 4;
        double best = 1e30, bytes = 0;
        size_t xbytes = 0;
        for (int rep = 0; rep < 3; rep++) {
            kvdepot_read_args ra;
            memset(&ra, 0, sizeof ra);
            ra.id = "s";
            ra.id_len = 1;
            ra.activation_tokens = l;
            kvdepot_read_result rr;
            double t0 = now_sec();
            if (kvdepot_sequence_read(c, &ra, &rr)) {
                fprintf(stderr, "read: %s\n", kvdepot_errmsg(NULL));
                harness_destroy(&h, 1);
                return 1;
            }
            double dt = now_sec() - t0;
            best = dt < best ? dt : best;
            xbytes = rr.x_bytes;
            bytes = (double)rr.x_bytes + 2.0 * (double)rr.kv_bytes;
            kvdepot_free(rr.owned);
        }
        printf("%8llu %10.1f %10.1f %10.3f %8.2f\n", (unsigned long long)l,
               (double)xbytes / 1048576, (bytes - (double)xbytes) / 1048576, best,
               bytes / best / 1e9);
    }
    free(k);
    free(v);
    free(x);
    kvdepot_close(c);
    harness_destroy(&h, 0);
    return 0;
}
