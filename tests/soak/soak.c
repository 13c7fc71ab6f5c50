/*
 * Soak: mixed load on one kvdepotd for a given time, with the server's
 * resident memory, open descriptors and threads sampled as it goes, and an
 * exact read-back of everything still stored at the end. Not a CI test:
 *
 *   soak SERVER_BIN SECONDS [THREADS]        (tests/soak/run_soak.sh)
 *
 * Each client thread loops over: create a sequence (raw, INT4, INT2 or
 * with a PQ index), append to it in steps of random length, read it back
 * (raw ones byte for byte), Attend and Search on it, and delete it, except
 * the first KEEP raw ones, kept for the end (the store stays bounded). Every 10 s a line: elapsed, operations, errors, server
 * RSS MiB, descriptors, threads, sequences stored. At the end every raw
 * sequence still stored is read back and compared with what was appended.
 * Exit 0 when no call failed and every byte came back.
 */
/* Codec tables below list the leading members of kvdepot_codecs only. */
#pragma GCC diagnostic ignored "-Wmissing-field-initializers"

#include <dirent.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "harness.h"
#include "kvdepot/tensor.h"

#define H 4
#define HQ 8
#define D 64
#define MAX_TOKENS 3000
#define KEEP 32 /* raw sequences each thread keeps for the final check */

static _Atomic uint64_t ops, errors;
static _Atomic int stop;
static kvd_harness g_h;

typedef struct kept {
    char id[48];
    uint64_t n, seed;
} kept;

typedef struct worker {
    int idx;
    kept keep[KEEP];
    int nkeep;
} worker;

/* The K (which 0) or V (1) of tokens [t0, t0+n) of the sequence made with
 * `seed`: a function of the position, so any range can be checked. */
static void fill(uint16_t *x, uint64_t seed, int which, uint64_t t0, uint64_t n)
{
    for (uint64_t t = 0; t < n; t++)
        for (int i = 0; i < H * D; i++) {
            uint64_t v = (seed * 0x9e3779b97f4a7c15ull) ^ ((t0 + t) * 0xbf58476d1ce4e5b9ull) ^
                         ((uint64_t)i << 1) ^ (uint64_t)which;
            v ^= v >> 31;
            v *= 0x94d049bb133111ebull;
            v ^= v >> 29;
            x[t * H * D + i] = kvd_f32_to_f16((float)(v & 0xffff) / 32768.0f - 1.0f);
        }
}

static void fail(const char *what)
{
    atomic_fetch_add(&errors, 1);
    fprintf(stderr, "soak: %s: %s\n", what, kvdepot_errmsg(NULL));
}

/* Read the whole sequence back and compare; 0 when equal. */
static int check_raw(kvdepot_client *c, const kept *k)
{
    kvdepot_read_args ra;
    memset(&ra, 0, sizeof ra);
    ra.id = k->id;
    ra.id_len = strlen(k->id);
    ra.num_layers = 1;
    kvdepot_read_result rr;
    if (kvdepot_sequence_read(c, &ra, &rr)) {
        fail("read");
        return -1;
    }
    uint16_t *want = malloc((size_t)k->n * H * D * 2);
    int bad = rr.num_tokens != k->n;
    for (int w = 0; w < 2 && !bad; w++) {
        fill(want, k->seed, w, 0, k->n);
        bad = memcmp(w ? rr.v : rr.k, want, (size_t)k->n * H * D * 2) != 0;
    }
    free(want);
    kvdepot_free(rr.owned);
    if (bad) {
        atomic_fetch_add(&errors, 1);
        fprintf(stderr, "soak: %s: read back differs from what was appended\n", k->id);
    }
    return bad ? -1 : 0;
}

static void *work(void *arg)
{
    worker *w = arg;
    kvdepot_client *c = harness_client(&g_h);
    if (!c) {
        fail("connect");
        return NULL;
    }
    uint64_t rnd = 0x2545f4914f6cdd1dull * (uint64_t)(w->idx + 1);
    uint16_t *k = malloc((size_t)MAX_TOKENS * H * D * 2),
             *v = malloc((size_t)MAX_TOKENS * H * D * 2);
    float q[HQ * D];
    for (int i = 0; i < HQ * D; i++)
        q[i] = (float)((i * 7919) % 97) / 97.0f - 0.5f;
    for (uint64_t it = 0; !atomic_load(&stop); it++) {
        rnd ^= rnd << 13;
        rnd ^= rnd >> 7;
        rnd ^= rnd << 17;
        int kind = (int)(rnd % 4); /* raw, INT4, INT2, PQ */
        kept s;
        snprintf(s.id, sizeof s.id, "w%d-%llu", w->idx, (unsigned long long)it);
        s.seed = rnd;
        s.n = 300 + rnd % (MAX_TOKENS - 300);
        kvdepot_codecs cs;
        memset(&cs, 0, sizeof cs);
        if (kind == 1)
            cs.k.codec = cs.v.codec = KVDEPOT_CODEC_INT4;
        if (kind == 2)
            cs.k.codec = cs.v.codec = KVDEPOT_CODEC_INT2;
        if (kind == 3) {
            cs.pq_m = 8;
            cs.pq_bits = 6;
        }
        kvdepot_create_args ca;
        memset(&ca, 0, sizeof ca);
        ca.id = s.id;
        ca.id_len = strlen(s.id);
        ca.model = "soak";
        ca.codecs = &cs;
        atomic_fetch_add(&ops, 1);
        if (kvdepot_sequence_create(c, &ca, NULL)) {
            fail("create");
            continue;
        }
        for (uint64_t t = 0; t < s.n;) {
            uint64_t step = 1 + (rnd >> 20) % 700;
            if (step > s.n - t)
                step = s.n - t;
            fill(k, s.seed, 0, t, step);
            fill(v, s.seed, 1, t, step);
            kvdepot_append_args aa;
            memset(&aa, 0, sizeof aa);
            aa.id = s.id;
            aa.id_len = strlen(s.id);
            aa.token_start = t;
            aa.num_tokens = step;
            aa.dtype = KVDEPOT_DTYPE_F16;
            aa.k = k;
            aa.v = v;
            aa.k_bytes = aa.v_bytes = (size_t)step * H * D * 2;
            atomic_fetch_add(&ops, 1);
            if (kvdepot_sequence_append(c, &aa, NULL)) {
                fail("append");
                break;
            }
            t += step;
            rnd = rnd * 6364136223846793005ull + 1442695040888963407ull;
        }
        atomic_fetch_add(&ops, 1);
        if (kind == 0)
            check_raw(c, &s);
        kvdepot_attend_query qy = {s.id, strlen(s.id), q, HQ * D, 0, 0};
        kvdepot_attend_result r;
        atomic_fetch_add(&ops, 1);
        if (kvdepot_attend(c, 0, 0, &qy, 1, &r))
            fail("attend");
        else
            kvdepot_attend_results_free(&r, 1);
        if (kind == 3) {
            kvdepot_search_args sa = {s.id, strlen(s.id), 0, q, HQ * D, 32, 4, 64, 0, 0};
            kvdepot_search_result sr;
            atomic_fetch_add(&ops, 1);
            if (kvdepot_search(c, &sa, &sr))
                fail("search");
            else
                kvdepot_search_result_free(&sr);
        }
        /* keep some raw ones for the end, delete the rest */
        if (kind == 0 && w->nkeep < KEEP) {
            w->keep[w->nkeep++] = s;
        } else {
            atomic_fetch_add(&ops, 1);
            if (kvdepot_sequence_delete(c, s.id, strlen(s.id), NULL))
                fail("delete");
        }
    }
    free(k);
    free(v);
    kvdepot_close(c);
    return NULL;
}

/* A field of /proc/PID/status in kB or as a count; -1 when absent. */
static long proc_status(pid_t pid, const char *field)
{
    char path[64], line[256];
    snprintf(path, sizeof path, "/proc/%d/status", (int)pid);
    FILE *f = fopen(path, "r");
    long v = -1;
    size_t n = strlen(field);
    while (f && fgets(line, sizeof line, f))
        if (strncmp(line, field, n) == 0 && line[n] == ':')
            v = atol(line + n + 1);
    if (f)
        fclose(f);
    return v;
}

static long open_fds(pid_t pid)
{
    char path[64];
    snprintf(path, sizeof path, "/proc/%d/fd", (int)pid);
    DIR *d = opendir(path);
    long n = 0;
    struct dirent *e;
    while (d && (e = readdir(d)))
        n += e->d_name[0] != '.';
    if (d)
        closedir(d);
    return d ? n : -1;
}

int main(int argc, char **argv)
{
    if (argc < 3) {
        fprintf(stderr, "usage: %s SERVER_BIN SECONDS [THREADS]\n", argv[0]);
        return 2;
    }
    const double seconds = atof(argv[2]);
    const int nt = argc > 3 ? atoi(argv[3]) : 8;
    if (harness_init(&g_h, argv[1]) || harness_start(&g_h))
        return 1;
    kvdepot_client *c = harness_client(&g_h);
    kvdepot_model m;
    memset(&m, 0, sizeof m);
    snprintf(m.name, sizeof m.name, "soak");
    m.num_layers = 1;
    m.num_kv_heads = H;
    m.num_q_heads = HQ;
    m.head_dim = D;
    m.dtype = KVDEPOT_DTYPE_F16;
    if (!c || kvdepot_model_put(c, &m, 0, NULL, NULL)) {
        fprintf(stderr, "soak: setup: %s\n", kvdepot_errmsg(NULL));
        harness_destroy(&g_h, 1);
        return 1;
    }
    worker *ws = calloc((size_t)nt, sizeof *ws);
    pthread_t *th = calloc((size_t)nt, sizeof *th);
    for (int i = 0; i < nt; i++) {
        ws[i].idx = i;
        pthread_create(&th[i], NULL, work, &ws[i]);
    }
    printf("| s | operations | errors | RSS MiB | descriptors | threads | sequences |\n"
           "|---:|---:|---:|---:|---:|---:|---:|\n");
    struct timespec t0, now;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (double el = 0; el < seconds;) {
        sleep(seconds - el < 10 ? (unsigned)(seconds - el) + 1 : 10);
        clock_gettime(CLOCK_MONOTONIC, &now);
        el = (double)(now.tv_sec - t0.tv_sec) + (now.tv_nsec - t0.tv_nsec) * 1e-9;
        kvdepot_stats st;
        memset(&st, 0, sizeof st);
        kvdepot_stats_get(c, &st);
        printf("| %.0f | %llu | %llu | %.1f | %ld | %ld | %llu |\n", el,
               (unsigned long long)atomic_load(&ops), (unsigned long long)atomic_load(&errors),
               proc_status(g_h.pid, "VmRSS") / 1024.0, open_fds(g_h.pid),
               proc_status(g_h.pid, "Threads"), (unsigned long long)st.sequences);
        fflush(stdout);
    }
    atomic_store(&stop, 1);
    for (int i = 0; i < nt; i++)
        pthread_join(th[i], NULL);
    size_t checked = 0;
    for (int i = 0; i < nt; i++)
        for (int j = 0; j < ws[i].nkeep; j++, checked++)
            check_raw(c, &ws[i].keep[j]);
    printf("\nfinal read-back: %zu raw sequences; %llu errors in %llu operations\n", checked,
           (unsigned long long)atomic_load(&errors), (unsigned long long)atomic_load(&ops));
    int failed = atomic_load(&errors) != 0;
    kvdepot_close(c);
    harness_destroy(&g_h, failed);
    free(ws);
    free(th);
    return failed;
}
