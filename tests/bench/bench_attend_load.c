/*
 * Attend latency under concurrency, end to end over gRPC: a program that
 * prints a table (and CSV).
 *
 *   bench_attend_load SERVER_BIN [--clients 1,4,16] [--seconds S]
 *                     [--warmup W] [--load N] [--load-shared] [--csv FILE]
 *
 * Starts kvdepotd on loopback (tests/e2e/harness; KVDEPOT_* in the
 * environment reach it, e.g. KVDEPOT_COMPUTE_THREADS=1), stores one layer of
 * 32K tokens, 32 query heads over 8 kv heads x 128, as fp16 and as INT2,
 * then for each form and client count runs that many clients, each on its
 * own client and thread, calling Attend back to back for S seconds
 * (default 5), alternating a decode step (1 query over the first 4K tokens)
 * and a batch (8 queries over all 32K), the odd clients batch first. Calls
 * begun in the first W seconds (default 1) are not counted: all clients
 * start at once, which no steady load does. Per row: calls, p50, p99 and
 * p99/p50 of each call kind. --load N keeps N other processes busy
 * spinning on the machine meanwhile (a loaded machine), each in a session
 * of its own as other programs are (the OS weighs nice values within a
 * session's autogroup or a cgroup); --load-shared keeps them in kvdepotd's
 * session, where its background threads' priority (--background-priority)
 * weighs against them.
 */
#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "bench_data.h"
#include "harness.h"

#define H 8
#define HQ 32
#define D 128
#define TOKENS 32768
#define CHUNK 4096
#define MAX_CLIENTS 64
#define MAX_CALLS 200000

typedef struct client_run {
    const kvd_harness *h;
    const char *seq;
    const float *q;
    double seconds, warmup;
    int first;      /* the first call's kind */
    double *lat[2]; /* [0] decode steps, [1] batches: seconds per call */
    size_t n[2];
    int failed;
} client_run;

static void *client_main(void *arg)
{
    client_run *r = arg;
    kvdepot_client *c = harness_client(r->h);
    if (!c) {
        r->failed = 1;
        return NULL;
    }
    const double from = bench_now() + r->warmup, end = from + r->seconds;
    for (int kind = r->first; bench_now() < end && !r->failed; kind ^= 1) {
        const int nb = kind ? 8 : 1;
        const uint64_t n = kind ? TOKENS : 4096;
        kvdepot_attend_query qs[8];
        for (int s = 0; s < nb; s++)
            qs[s] = (kvdepot_attend_query){
                r->seq, strlen(r->seq), r->q + (size_t)s * HQ * D, HQ * D, 0, n};
        kvdepot_attend_result res[8];
        double t0 = bench_now();
        if (kvdepot_attend(c, 0, 0, qs, (size_t)nb, res)) {
            fprintf(stderr, "attend: %s\n", kvdepot_errmsg(c));
            r->failed = 1;
            break;
        }
        double dt = bench_now() - t0;
        kvdepot_attend_results_free(res, (size_t)nb);
        if (t0 >= from && r->n[kind] < MAX_CALLS)
            r->lat[kind][r->n[kind]++] = dt;
    }
    kvdepot_close(c);
    return NULL;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* nearest-rank percentile of sorted v */
static double pct(const double *v, size_t n, double p)
{
    if (!n)
        return NAN;
    size_t k = (size_t)ceil(p / 100.0 * (double)n);
    return v[k ? k - 1 : 0];
}

int main(int argc, char **argv)
{
    if (argc < 2) {
        fprintf(stderr,
                "usage: %s SERVER_BIN [--clients 1,4,16] [--seconds S] [--warmup W] [--load N] "
                "[--load-shared] [--csv FILE]\n",
                argv[0]);
        return 2;
    }
    int clients[8] = {1, 4, 16}, nclients = 3, load = 0, load_shared = 0;
    double seconds = 5, warmup = 1;
    FILE *csv = NULL;
    for (int i = 2; i < argc; i++) {
        if (strcmp(argv[i], "--clients") == 0 && i + 1 < argc) {
            nclients = 0;
            for (char *save = NULL, *tok = strtok_r(argv[++i], ",", &save); tok && nclients < 8;
                 tok = strtok_r(NULL, ",", &save)) {
                int v = atoi(tok);
                if (v < 1 || v > MAX_CLIENTS) {
                    fprintf(stderr, "--clients: 1..%d each\n", MAX_CLIENTS);
                    return 2;
                }
                clients[nclients++] = v;
            }
        } else if (strcmp(argv[i], "--seconds") == 0 && i + 1 < argc) {
            seconds = atof(argv[++i]);
        } else if (strcmp(argv[i], "--warmup") == 0 && i + 1 < argc) {
            warmup = atof(argv[++i]);
        } else if (strcmp(argv[i], "--load") == 0 && i + 1 < argc) {
            load = atoi(argv[++i]);
        } else if (strcmp(argv[i], "--load-shared") == 0) {
            load_shared = 1;
        } else if (strcmp(argv[i], "--csv") == 0 && i + 1 < argc) {
            csv = fopen(argv[++i], "w");
        } else {
            fprintf(stderr, "unknown argument %s\n", argv[i]);
            return 2;
        }
    }
    kvd_harness h;
    if (harness_init(&h, argv[1]) || harness_start(&h))
        return 1;
    kvdepot_client *c = harness_client(&h);
    kvdepot_model m;
    memset(&m, 0, sizeof m);
    snprintf(m.name, sizeof m.name, "load");
    m.num_layers = 1;
    m.num_kv_heads = H;
    m.num_q_heads = HQ;
    m.head_dim = D;
    m.dtype = KVDEPOT_DTYPE_F16;
    kvdepot_codecs cs[2];
    memset(cs, 0, sizeof cs);
    cs[1].k.codec = cs[1].v.codec = KVDEPOT_CODEC_INT2;
    const char *names[2] = {"fp16", "INT2"};
    if (!c || kvdepot_model_put(c, &m, 0, NULL, NULL) ||
        bench_make_seq(c, "load", names[0], TOKENS, CHUNK, H, D, &cs[0]) ||
        bench_make_seq(c, "load", names[1], TOKENS, CHUNK, H, D, &cs[1])) {
        fprintf(stderr, "setup: %s\n", kvdepot_errmsg(c));
        harness_destroy(&h, 1);
        return 1;
    }
    float *q = malloc(sizeof(float) * 8 * HQ * D);
    for (int i = 0; i < 8 * HQ * D; i++)
        q[i] = sinf(0.1f * (float)i);
    /* warm the tiers: every page read once */
    for (int f = 0; f < 2; f++) {
        kvdepot_attend_query wq = {names[f], strlen(names[f]), q, HQ * D, 0, TOKENS};
        kvdepot_attend_result wr;
        if (kvdepot_attend(c, 0, 0, &wq, 1, &wr) == 0)
            kvdepot_attend_results_free(&wr, 1);
    }
    pid_t busy[64];
    int nbusy = load < 64 ? load : 64;
    for (int i = 0; i < nbusy; i++) {
        busy[i] = fork();
        if (busy[i] == 0) {
            if (!load_shared)
                (void)setsid();
            volatile unsigned long x = 0;
            for (;;)
                x++;
        }
    }
    const char *ct = getenv("KVDEPOT_COMPUTE_THREADS");
    double la[1];
    printf("Attend under concurrency: %ld CPUs, %d busy processes beside (%s), compute-threads "
           "%s, load %.2f; calls of %g s counted after %g s\n",
           sysconf(_SC_NPROCESSORS_ONLN), nbusy,
           load_shared ? "in kvdepotd's session" : "each in its own session", ct ? ct : "default",
           getloadavg(la, 1) == 1 ? la[0] : -1.0, seconds, warmup);
    printf("| cache | clients | calls | 1 x 4K p50 ms | p99 ms | p99/p50 | 8 x 32K p50 ms | p99 ms "
           "| p99/p50 |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|\n");
    if (csv)
        fprintf(csv, "cache,clients,busy,compute_threads,calls,decode_p50_ms,decode_p99_ms,"
                     "batch_p50_ms,batch_p99_ms\n");
    int status = 0;
    for (int f = 0; f < 2 && !status; f++)
        for (int ci = 0; ci < nclients && !status; ci++) {
            int nc = clients[ci];
            client_run runs[MAX_CLIENTS];
            pthread_t th[MAX_CLIENTS];
            memset(runs, 0, sizeof runs);
            for (int i = 0; i < nc; i++) {
                runs[i] =
                    (client_run){&h, names[f], q, seconds, warmup, i & 1, {NULL, NULL}, {0, 0}, 0};
                runs[i].lat[0] = malloc(sizeof(double) * MAX_CALLS);
                runs[i].lat[1] = malloc(sizeof(double) * MAX_CALLS);
                pthread_create(&th[i], NULL, client_main, &runs[i]);
            }
            double *all[2] = {malloc(sizeof(double) * MAX_CALLS * (size_t)nc),
                              malloc(sizeof(double) * MAX_CALLS * (size_t)nc)};
            size_t n[2] = {0, 0};
            for (int i = 0; i < nc; i++) {
                pthread_join(th[i], NULL);
                status |= runs[i].failed;
                for (int k = 0; k < 2; k++) {
                    memcpy(all[k] + n[k], runs[i].lat[k], runs[i].n[k] * sizeof(double));
                    n[k] += runs[i].n[k];
                    free(runs[i].lat[k]);
                }
            }
            double p[2][2];
            for (int k = 0; k < 2; k++) {
                qsort(all[k], n[k], sizeof(double), cmp_double);
                p[k][0] = pct(all[k], n[k], 50) * 1e3;
                p[k][1] = pct(all[k], n[k], 99) * 1e3;
                free(all[k]);
            }
            printf("| %s | %d | %zu | %.2f | %.2f | %.1f | %.2f | %.2f | %.1f |\n", names[f], nc,
                   n[0] + n[1], p[0][0], p[0][1], p[0][1] / p[0][0], p[1][0], p[1][1],
                   p[1][1] / p[1][0]);
            fflush(stdout);
            if (csv)
                fprintf(csv, "%s,%d,%d,%s,%zu,%.3f,%.3f,%.3f,%.3f\n", names[f], nc, nbusy,
                        ct ? ct : "", n[0] + n[1], p[0][0], p[0][1], p[1][0], p[1][1]);
        }
    for (int i = 0; i < nbusy; i++) {
        kill(busy[i], SIGKILL);
        waitpid(busy[i], NULL, 0);
    }
    free(q);
    kvdepot_close(c);
    if (csv)
        fclose(csv);
    harness_destroy(&h, status);
    return status;
}
