/*
 * Attend over gRPC, end to end, on whatever device kvdepotd serves from:
 * a program that prints a table (and CSV for bench_attend_e2e.sh).
 *
 *   bench_attend_e2e SERVER_BIN [--quick] [--csv FILE]
 *
 * Starts kvdepotd on loopback (tests/e2e/harness; KVDEPOT_* in the
 * environment reach it, e.g. KVDEPOT_DEVICE=cuda and
 * KVDEPOT_DEVICE_TIER_BYTES=40GiB), stores one sequence per cache form
 * (fp16, INT4, INT2, VQ d4b8 after a Calibrate) of up to 128K tokens of one
 * layer, 32 query heads over 8 kv heads x 128, and times Attend for 4K to
 * 128K tokens x batch 1 to 64 (a batch is that many queries over the
 * sequence: the same bytes read per query as with distinct sequences).
 * Per row: the best of 5 calls after one warm-up, queries/s, the pages
 * Attend read where they lie on the GPU (Stats.device_pages_attended), and
 * the time to Read the fp16 cache of one query's range (the first half of
 * the "Read fp16 + attend on the GPU" alternative; bench_attend_sdpa.py
 * times the second half with PyTorch).
 */
/* Codec tables below list the leading members of kvdepot_codecs only. */
#pragma GCC diagnostic ignored "-Wmissing-field-initializers"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bench_data.h"
#include "harness.h"
#include "kvdepot/tensor.h"

#define H 8
#define HQ 32
#define D 128
#define CHUNK 4096

static uint64_t device_pages(kvdepot_client *c)
{
    kvdepot_stats st;
    return kvdepot_stats_get(c, &st) == 0 ? st.device_pages_attended : 0;
}

int main(int argc, char **argv)
{
    if (argc < 2) {
        fprintf(stderr, "usage: %s SERVER_BIN [--quick] [--csv FILE]\n", argv[0]);
        return 2;
    }
    int quick = 0;
    FILE *csv = NULL;
    for (int i = 2; i < argc; i++) {
        if (strcmp(argv[i], "--quick") == 0)
            quick = 1;
        else if (strcmp(argv[i], "--csv") == 0 && i + 1 < argc)
            csv = fopen(argv[++i], "w");
    }
    const uint64_t max_tokens = quick ? 8192 : 131072;
    const uint64_t sizes[] = {4096, 8192, 16384, 32768, 131072};
    const int batches[] = {1, 8, 32, 64};
    kvd_harness h;
    if (harness_init(&h, argv[1]) || harness_start(&h))
        return 1;
    kvdepot_client *c = harness_client(&h);
    kvdepot_model m;
    memset(&m, 0, sizeof m);
    snprintf(m.name, sizeof m.name, "e2e");
    m.num_layers = 1;
    m.num_kv_heads = H;
    m.num_q_heads = HQ;
    m.head_dim = D;
    m.dtype = KVDEPOT_DTYPE_F16;
    if (!c || kvdepot_model_put(c, &m, 0, NULL, NULL) || bench_calibrate(c, "e2e", H, D, 0)) {
        fprintf(stderr, "setup: %s\n", kvdepot_errmsg(NULL));
        harness_destroy(&h, 1);
        return 1;
    }
    kvdepot_stats st;
    kvdepot_stats_get(c, &st);
    printf("kvdepotd: backend %s, device '%s' (%.1f GiB), device tier %.1f GiB\n", st.backend,
           st.device, st.device_memory_bytes / 1073741824.0,
           st.tiers[0].limit_bytes / 1073741824.0);
    kvdepot_codecs cs[4];
    memset(cs, 0, sizeof cs);
    const char *names[4] = {"fp16", "INT4 g128", "INT2 g128", "VQ d4b8"};
    cs[1].k.codec = cs[1].v.codec = KVDEPOT_CODEC_INT4;
    cs[1].k.group_size = cs[1].v.group_size = 128;
    cs[2].k.codec = cs[2].v.codec = KVDEPOT_CODEC_INT2;
    cs[2].k.group_size = cs[2].v.group_size = 128;
    cs[3].k.codec = cs[3].v.codec = KVDEPOT_CODEC_VQ;
    cs[3].k.vq_sub_dim = cs[3].v.vq_sub_dim = 4;
    cs[3].k.vq_bits = cs[3].v.vq_bits = 8;
    for (int ci = 0; ci < 4; ci++)
        if (bench_make_seq(c, "e2e", names[ci], max_tokens, CHUNK, H, D, &cs[ci])) {
            fprintf(stderr, "append %s: %s\n", names[ci], kvdepot_errmsg(NULL));
            harness_destroy(&h, 1);
            return 1;
        }
    float *q = malloc(sizeof(float) * 64 * HQ * D);
    for (int i = 0; i < 64 * HQ * D; i++)
        q[i] = sinf(0.1f * (float)i);
    if (csv)
        fprintf(csv, "backend,device,cache,tokens,batch,attend_ms,queries_per_s,"
                     "device_pages_per_call,read_fp16_ms_per_query\n");
    printf("\n| tokens | batch | cache | Attend ms | queries/s | pages on the GPU per call | vs "
           "fp16 Attend | Read fp16 ms per query |\n|---:|---:|---|---:|---:|---:|---:|---:|\n");
    for (size_t si = 0; si < sizeof sizes / sizeof sizes[0]; si++) {
        uint64_t n = sizes[si];
        if (n > max_tokens)
            continue;
        /* the first half of the alternative: Read the fp16 range */
        double t_read = 1e9;
        for (int rep = 0; rep < 3; rep++) {
            kvdepot_read_args ra;
            memset(&ra, 0, sizeof ra);
            ra.id = names[0];
            ra.id_len = strlen(names[0]);
            ra.num_layers = 1;
            ra.num_tokens = n;
            kvdepot_read_result rr;
            double t0 = bench_now();
            if (kvdepot_sequence_read(c, &ra, &rr)) {
                fprintf(stderr, "read: %s\n", kvdepot_errmsg(NULL));
                return 1;
            }
            double dt = bench_now() - t0;
            kvdepot_free(rr.owned);
            t_read = dt < t_read ? dt : t_read;
        }
        for (size_t bi = 0; bi < sizeof batches / sizeof batches[0]; bi++) {
            int nb = batches[bi];
            if (quick && nb > 8)
                continue;
            double t_fp16 = 0;
            for (int ci = 0; ci < 4; ci++) {
                kvdepot_attend_query qs[64];
                for (int s = 0; s < nb; s++)
                    qs[s] = (kvdepot_attend_query){names[ci], strlen(names[ci]),
                                                   q + (size_t)s * HQ * D, HQ * D, 0, n};
                kvdepot_attend_result res[64];
                double best = 1e9;
                uint64_t pages = 0;
                for (int rep = 0; rep < 6; rep++) {
                    uint64_t p0 = device_pages(c);
                    double t0 = bench_now();
                    if (kvdepot_attend(c, 0, 0, qs, (size_t)nb, res)) {
                        fprintf(stderr, "attend: %s\n", kvdepot_errmsg(NULL));
                        return 1;
                    }
                    double dt = bench_now() - t0;
                    pages = device_pages(c) - p0;
                    kvdepot_attend_results_free(res, (size_t)nb);
                    if (rep > 0 && dt < best)
                        best = dt;
                }
                if (ci == 0)
                    t_fp16 = best;
                printf("| %lluK | %d | %s | %.2f | %.0f | %llu | %.2fx | %.2f |\n",
                       (unsigned long long)(n / 1024), nb, names[ci], best * 1e3, nb / best,
                       (unsigned long long)pages, t_fp16 / best, t_read * 1e3);
                if (csv)
                    fprintf(csv, "%s,%s,%s,%llu,%d,%.4f,%.1f,%llu,%.4f\n", st.backend, st.device,
                            names[ci], (unsigned long long)n, nb, best * 1e3, nb / best,
                            (unsigned long long)pages, t_read * 1e3);
                fflush(stdout);
            }
        }
    }
    if (csv)
        fclose(csv);
    free(q);
    kvdepot_close(c);
    harness_destroy(&h, 0);
    return 0;
}
