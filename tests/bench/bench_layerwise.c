/*
 * bench_layerwise: an engine's prefill offload, layer by layer, with and
 * without overlap. A request of T tokens on a 32-layer model with 8 KV heads
 * x 128 (f16: T * 4 KiB of K+V per layer) runs a simulated forward pass, one
 * fixed amount of arithmetic per layer, and puts each layer's K and V to
 * kvdepotd as soon as the layer is computed:
 *
 *   forward       the forward pass alone (no transfers)
 *   puts          the 32 appends alone, one after the other (blocking)
 *   blocking      layer l computed, then put, then layer l + 1
 *   overlapped    layer l's put started without waiting
 *                 (kvdepot_append_start), layer l + 1 computed meanwhile,
 *                 every put waited for at the end
 *
 * and prints, per (T, ms of forward per layer), the median of --reps runs
 * of each and the overhead of the overlapped run over the forward pass
 * alone (the target: at most 15 % at 32 layers on loopback), next to the
 * sum of the parts. Every put is read back and compared once per setting.
 *
 *   bench_layerwise --address 127.0.0.1:PORT [--tokens 512,2048]
 *                   [--layer-ms 5,20] [--reps 5]
 *
 * run_layerwise_bench.sh starts a kvdepotd and runs it. The forward pass
 * is a loop of float multiply-adds calibrated once to --layer-ms per layer
 * on an idle core; on a machine with few cores the server, the transfer
 * thread and the forward pass share them, and the overhead shows it.
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kvdepot.h"

#define LAYERS 32
#define HEADS 8
#define DIM 128

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static volatile float sink;

/* `iters` rounds of multiply-adds over a small block kept in cache. */
static void layer_work(uint64_t iters)
{
    float a[256], b[256];
    for (int i = 0; i < 256; i++)
        a[i] = (float)i * 1e-3f, b[i] = 1.0f - (float)i * 1e-4f;
    for (uint64_t it = 0; it < iters; it++)
        for (int i = 0; i < 256; i++)
            a[i] = a[i] * b[i] + 1e-7f;
    sink = a[17];
}

static uint64_t calibrate(double ms)
{
    uint64_t iters = 1000;
    for (;;) {
        double t0 = now_s();
        layer_work(iters);
        double dt = now_s() - t0;
        if (dt > 0.05)
            return (uint64_t)((double)iters * ms * 1e-3 / dt) + 1;
        iters *= 2;
    }
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static double median(double *v, int n)
{
    qsort(v, (size_t)n, sizeof *v, cmp_double);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

static int parse_list(const char *s, uint64_t *out, int cap)
{
    int n = 0;
    while (*s && n < cap) {
        char *end;
        unsigned long long v = strtoull(s, &end, 10);
        if (end == s || v == 0)
            return -1;
        out[n++] = v;
        s = *end == ',' ? end + 1 : end;
        if (*end && *end != ',')
            return -1;
    }
    return n;
}

typedef struct run_ctx {
    kvdepot_client *c;
    uint64_t T;
    size_t layer_bytes; /* K (or V) of one layer */
    uint8_t *k, *v;     /* [layer][T][HEADS][DIM] f16 */
    uint64_t iters;
    int seq;
} run_ctx;

static int new_seq(run_ctx *x, char *id)
{
    snprintf(id, 32, "lw-%d", x->seq++);
    kvdepot_create_args ca = {.id = id, .id_len = strlen(id), .model = "lw32"};
    kvdepot_sequence_info info;
    int rc = kvdepot_sequence_create(x->c, &ca, &info);
    if (rc == KVDEPOT_OK)
        kvdepot_sequence_info_clear(&info);
    return rc;
}

static kvdepot_append_args layer_args(const run_ctx *x, const char *id, uint32_t l)
{
    return (kvdepot_append_args){.id = id,
                                 .id_len = strlen(id),
                                 .layer_start = l,
                                 .num_layers = 1,
                                 .token_start = 0,
                                 .num_tokens = x->T,
                                 .dtype = KVDEPOT_DTYPE_F16,
                                 .k = x->k + l * x->layer_bytes,
                                 .k_bytes = x->layer_bytes,
                                 .v = x->v + l * x->layer_bytes,
                                 .v_bytes = x->layer_bytes};
}

static void delete_seq(run_ctx *x, const char *id)
{
    kvdepot_sequence_delete(x->c, id, strlen(id), NULL);
}

/* mode 0: forward only; 1: puts only; 2: blocking; 3: overlapped. Seconds,
 * or < 0 on a failed call. check: read the sequence back and compare. */
static double run_once(run_ctx *x, int mode, int check)
{
    char id[32];
    if (mode != 0 && new_seq(x, id) != KVDEPOT_OK) {
        fprintf(stderr, "create: %s\n", kvdepot_errmsg(x->c));
        return -1;
    }
    kvdepot_transfer *t[LAYERS] = {0};
    int rc = KVDEPOT_OK;
    double t0 = now_s();
    for (uint32_t l = 0; l < LAYERS && rc == KVDEPOT_OK; l++) {
        if (mode != 1)
            layer_work(x->iters);
        if (mode == 0)
            continue;
        kvdepot_append_args a = layer_args(x, id, l);
        if (mode == 3) {
            /* a stays valid: append_start copies the args, the data is x's */
            rc = kvdepot_append_start(x->c, &a, NULL, NULL, &t[l]);
        } else {
            rc = kvdepot_sequence_append(x->c, &a, NULL);
        }
    }
    for (uint32_t l = 0; l < LAYERS; l++)
        if (t[l]) {
            int r = kvdepot_transfer_wait(t[l], NULL);
            if (r && rc == KVDEPOT_OK)
                rc = r;
        }
    double dt = now_s() - t0;
    if (rc != KVDEPOT_OK) {
        fprintf(stderr, "append: %s\n", kvdepot_errmsg(x->c));
        return -1;
    }
    if (mode != 0 && check) {
        for (uint32_t l = 0; l < LAYERS; l++) {
            kvdepot_read_args ra = {
                .id = id, .id_len = strlen(id), .layer_start = l, .num_layers = 1};
            kvdepot_read_result rr;
            if (kvdepot_sequence_read(x->c, &ra, &rr) != KVDEPOT_OK ||
                rr.kv_bytes != x->layer_bytes ||
                memcmp(rr.k, x->k + l * x->layer_bytes, x->layer_bytes) ||
                memcmp(rr.v, x->v + l * x->layer_bytes, x->layer_bytes)) {
                fprintf(stderr, "layer %u did not read back exact\n", l);
                kvdepot_free(rr.owned);
                return -1;
            }
            kvdepot_free(rr.owned);
        }
    }
    if (mode != 0)
        delete_seq(x, id);
    return dt;
}

int main(int argc, char **argv)
{
    const char *address = NULL;
    uint64_t tokens[8] = {512, 2048}, ms[8] = {5, 20};
    int nt = 2, nm = 2, reps = 5;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--address") && i + 1 < argc)
            address = argv[++i];
        else if (!strcmp(argv[i], "--tokens") && i + 1 < argc)
            nt = parse_list(argv[++i], tokens, 8);
        else if (!strcmp(argv[i], "--layer-ms") && i + 1 < argc)
            nm = parse_list(argv[++i], ms, 8);
        else if (!strcmp(argv[i], "--reps") && i + 1 < argc)
            reps = atoi(argv[++i]);
        else {
            fprintf(stderr,
                    "usage: %s --address HOST:PORT [--tokens N,..] [--layer-ms MS,..] "
                    "[--reps N]\n",
                    argv[0]);
            return 2;
        }
    }
    if (!address || nt <= 0 || nm <= 0 || reps < 1 || reps > 100) {
        fprintf(stderr, "bench_layerwise: --address needed; bad list or --reps\n");
        return 2;
    }
    kvdepot_options o;
    kvdepot_options_init(&o);
    o.address = address;
    kvdepot_client *c = NULL;
    if (kvdepot_connect(&o, &c) != KVDEPOT_OK) {
        fprintf(stderr, "connect: %s\n", kvdepot_errmsg(NULL));
        return 1;
    }
    kvdepot_model m = {.name = "lw32",
                       .num_layers = LAYERS,
                       .num_kv_heads = HEADS,
                       .head_dim = DIM,
                       .dtype = KVDEPOT_DTYPE_F16};
    if (kvdepot_model_put(c, &m, 1, NULL, NULL) != KVDEPOT_OK) {
        fprintf(stderr, "model: %s\n", kvdepot_errmsg(c));
        return 1;
    }
    printf("layer-wise prefill offload: %d layers x %d kv heads x %d, f16, loopback, median of "
           "%d\n\n",
           LAYERS, HEADS, DIM, reps);
    printf("| tokens | MiB/request | forward ms/layer | forward ms | puts ms | blocking ms | "
           "overlapped ms | sum of parts ms | overlap overhead |\n");
    printf("|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
    int status = 0;
    for (int ti = 0; ti < nt; ti++) {
        run_ctx x = {.c = c, .T = tokens[ti]};
        x.layer_bytes = (size_t)x.T * HEADS * DIM * 2;
        x.k = malloc(LAYERS * x.layer_bytes);
        x.v = malloc(LAYERS * x.layer_bytes);
        if (!x.k || !x.v)
            return 1;
        uint64_t s = 0x9e3779b97f4a7c15ull * (ti + 1);
        uint16_t *kk = (uint16_t *)x.k, *vv = (uint16_t *)x.v;
        for (size_t i = 0; i < LAYERS * x.layer_bytes / 2; i++) {
            s ^= s << 13, s ^= s >> 7, s ^= s << 17;
            /* finite f16 in about [-1, 1] */
            kk[i] = (uint16_t)(0x3800 | (s & 0x03ff) | ((s >> 20) & 0x8000));
            vv[i] = (uint16_t)(0x3400 | ((s >> 11) & 0x03ff) | ((s >> 31) & 0x8000));
        }
        for (int mi = 0; mi < nm; mi++) {
            x.iters = calibrate((double)ms[mi]);
            double r[4][100];
            for (int rep = 0; rep < reps; rep++)
                for (int mode = 0; mode < 4; mode++) {
                    r[mode][rep] = run_once(&x, mode, rep == 0);
                    if (r[mode][rep] < 0)
                        return 1;
                }
            double f = median(r[0], reps), p = median(r[1], reps), b = median(r[2], reps),
                   ov = median(r[3], reps);
            printf("| %" PRIu64 " | %.0f | %" PRIu64 " | %.1f | %.1f | %.1f | %.1f | %.1f | "
                   "%+.1f %% |\n",
                   x.T, 2.0 * LAYERS * x.layer_bytes / 1048576.0, ms[mi], f * 1e3, p * 1e3, b * 1e3,
                   ov * 1e3, (f + p) * 1e3, (ov / f - 1) * 100);
        }
        free(x.k);
        free(x.v);
    }
    kvdepot_close(c);
    return status;
}
