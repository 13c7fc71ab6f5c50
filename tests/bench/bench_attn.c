/*
 * Decode-attention benchmark: one decode step of a Llama-8B-like layer
 * (32 query heads, 8 kv heads, head_dim 128) over 4K, 32K and 128K cached
 * tokens, for every cache form: fp16 (the vectorised yardstick), INT2 with
 * P = 32/64/128, INT4, keys or values grouped per channel or per token
 * (KIVI: keys per channel, values per token), VQ d4b8, SVD (half width) +
 * INT2; INT2 P=32 also as the store holds it, in pages of 256 tokens: one
 * item a page merged after ("paged"), and the pages as segments of one item
 * ("segs", as the server attends a run of pages). Prints time per
 * step, GB/s of cache bytes read, and the speedup over fp16, with one thread
 * and with all threads.
 *
 *   bench_attn [max_tokens]      (default 131072)
 *
 * BENCH_FORMS=a,b (environment) times only the forms whose names contain
 * one of the comma-separated strings (fp16 always runs: it is the yardstick).
 *
 * Timings are the minimum over repetitions (the machine may be shared);
 * "cpu ms" is the minimum process CPU time of a step (all threads), and
 * "cpu ratio" the fp16 CPU time over the form's: less disturbed than wall
 * time when other processes compete for the cores. Each form's steps
 * alternate with fp16's, and its ratios use the fp16 minimum of those same
 * repetitions: a shared machine's speed drifts over seconds (2 x within a
 * minute has been seen), and forms timed one after the other would compare
 * different moments.
 * Cache contents are random: the kernels' cost does not depend on values.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kvdepot/attention.h"
#include "kvdepot/svd.h"
#include "testutil.h"

enum { HQ = 32, HKV = 8, D = 128 };

static kvd_tensor tn(kvd_dtype dt, void *data, int nd, int64_t a, int64_t b, int64_t c)
{
    int64_t s[3] = {a, b, c};
    return kvd_tensor_make(dt, data, nd, s);
}

static void fill_bytes(tu_rng *r, void *p, size_t n)
{
    uint8_t *b = p;
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        uint64_t x = tu_rng_u64(r);
        memcpy(b + i, &x, 8);
    }
    for (; i < n; i++)
        b[i] = (uint8_t)tu_rng_u64(r);
}

/* f16 params: small positive scales, mins around -1 */
static void fill_params(tu_rng *r, uint16_t *mn, uint16_t *sc, uint16_t *sm, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        mn[i] = kvd_f32_to_f16(-1.0f - tu_rng_uniform(r));
        sc[i] = kvd_f32_to_f16(0.3f + 0.5f * tu_rng_uniform(r));
        sm[i] = (uint16_t)tu_rng_below(r, 64);
    }
}

typedef struct qcache {
    kvd_attn_qdata qd;
    void *mem;
    size_t bytes;
} qcache;

static qcache make_q(tu_rng *r, int64_t T, int W, int bits, int group, int axis)
{
    qcache c;
    memset(&c, 0, sizeof c);
    int64_t rows = axis == KVD_ATTN_AXIS_TOKEN ? T : W, along = axis == KVD_ATTN_AXIS_TOKEN ? W : T;
    size_t cb = (size_t)(HKV * rows * along * bits / 8), pn = (size_t)(HKV * rows * along / group);
    c.bytes = cb + 6 * pn;
    c.mem = malloc(c.bytes + 64);
    uint8_t *codes = c.mem;
    uint16_t *mn = (uint16_t *)(codes + cb), *sc = mn + pn, *sm = sc + pn;
    fill_bytes(r, codes, cb);
    fill_params(r, mn, sc, sm, pn);
    c.qd.bits = bits;
    c.qd.group = group;
    c.qd.axis = axis;
    c.qd.codes = tn(KVD_DTYPE_U8, codes, 3, HKV, rows, along * bits / 8);
    c.qd.min = tn(KVD_DTYPE_F16, mn, 3, HKV, rows, along / group);
    c.qd.scale = tn(KVD_DTYPE_F16, sc, 3, HKV, rows, along / group);
    c.qd.sum = tn(KVD_DTYPE_U16, sm, 3, HKV, rows, along / group);
    return c;
}

typedef int (*step_fn)(kvd_backend *be, void *arg);

typedef struct paged {
    int n;
    kvd_attn_int_args *items;
    qcache *pk, *pv;
    float *outs, *lses; /* (n, HQ, D), (n, HQ) */
    kvd_attn_int_segment *segs;
    kvd_attn_int_args seq; /* the pages as segments of one item */
} paged;

#include <time.h>

static double cpu_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* Whether BENCH_FORMS selects the form `name` (see the head comment). */
static int form_on(const char *name)
{
    const char *f = getenv("BENCH_FORMS");
    if (!f || !*f)
        return 1;
    while (*f) {
        size_t n = strcspn(f, ",");
        char part[64];
        if (n > 0 && n < sizeof part) {
            memcpy(part, f, n);
            part[n] = '\0';
            if (strstr(name, part))
                return 1;
        }
        f += n + (f[n] == ',');
    }
    return 0;
}

/* Minimum wall and CPU times (all threads; the CPU minimum independently
 * of the wall-clock one) of n steps, called in turn repetition by
 * repetition for about 0.6 s a step (3 to 50 repetitions). */
static void time_steps(kvd_backend *be, int n, const step_fn *fns, void *const *args, double *t,
                       double *c)
{
    for (int s = 0; s < n; s++) {
        if (fns[s](be, args[s]) != 0) {
            fprintf(stderr, "step failed\n");
            exit(1);
        }
        t[s] = c[s] = 1e30;
    }
    double total = 0;
    for (int rep = 0; rep < 50 && (rep < 3 || total < 0.6 * n); rep++)
        for (int s = 0; s < n; s++) {
            double t0 = tu_now(), c0 = cpu_now();
            if (fns[s](be, args[s]) != 0) {
                fprintf(stderr, "step failed\n");
                exit(1);
            }
            double dt = tu_now() - t0, dc = cpu_now() - c0;
            total += dt;
            if (dt < t[s])
                t[s] = dt;
            if (dc < c[s])
                c[s] = dc;
        }
}

/* Minimum wall and CPU times of fp16's step and a form's, alternated. */
typedef struct pair_time {
    double t16, c16, t, c;
} pair_time;

static pair_time time_pair(kvd_backend *be, step_fn f16, void *a16, step_fn fn, void *arg)
{
    const step_fn fns[2] = {f16, fn};
    void *const args[2] = {a16, arg};
    double t[2], c[2];
    time_steps(be, 2, fns, args, t, c);
    return (pair_time){t[0], c[0], t[1], c[1]};
}

/* One row: the form's minima and its ratios to fp16 from the same run. */
static void print_pair(const char *name, int64_t T, int thr, const pair_time *p, size_t bytes)
{
    printf("%-14s %8lld %3d %10.3f %10.3f %8.2f %8.2fx %8.2fx\n", name, (long long)T, thr,
           p->t * 1e3, p->c * 1e3, bytes / p->t / 1e9, p->t16 / p->t, p->c16 / p->c);
}

static int step_dense(kvd_backend *be, void *arg)
{
    return kvd_attn_dense(be, 1, arg, NULL);
}
static int step_int(kvd_backend *be, void *arg)
{
    return kvd_attn_quant(be, 1, arg, NULL);
}
static int step_vq(kvd_backend *be, void *arg)
{
    return kvd_attn_vq(be, 1, arg, NULL);
}

/* The pages as the server attends a run of them: one item, the pages its
 * segments. */
static int step_segments(kvd_backend *be, void *arg)
{
    paged *p = arg;
    return kvd_attn_quant(be, 1, &p->seq, NULL);
}

/* One call over every page, then the pages' results merged into page 0's. */
static int step_paged(kvd_backend *be, void *arg)
{
    paged *p = arg;
    int rc = kvd_attn_quant(be, p->n, p->items, NULL);
    for (int i = 1; i < p->n && !rc; i++) {
        kvd_attn_merge_args m = {p->items[0].out, p->items[0].lse, p->items[i].out, p->items[i].lse,
                                 p->items[0].out, p->items[0].lse};
        rc = kvd_attn_merge(be, 1, &m, NULL);
    }
    return rc;
}

/* SVD + INT2: rotate q into the reduced key space, INT2 attention at width
 * r, rotate the output back. The rotation here is one shared (D, D) matrix
 * applied per query head. */
typedef struct svd_step {
    kvd_attn_int_args a;
    const float *R, *q;
    float *qr, *ored, *out;
    int r;
} svd_step;

static int step_svd(kvd_backend *be, void *arg)
{
    svd_step *s = arg;
    int rc = kvd_svd_project(be, s->R, D, s->r, s->q, KVD_DTYPE_F32, HQ, 4 * D, s->qr, NULL);
    if (!rc)
        rc = kvd_attn_quant(be, 1, &s->a, NULL);
    if (!rc)
        rc = kvd_svd_unproject(be, s->R, D, s->r, s->ored, HQ, s->out, NULL);
    return rc;
}

int main(int argc, char **argv)
{
    int64_t maxT = argc > 1 ? atoll(argv[1]) : 131072;
    int nall = (int)sysconf(_SC_NPROCESSORS_ONLN);
    tu_rng rng;
    tu_rng_seed(&rng, 7);
    float *q = malloc(sizeof(float) * HQ * D), *out = malloc(sizeof(float) * HQ * D), lse[HQ];
    tu_fill_normal(&rng, q, HQ * D, 1.0f);
    int threads[2] = {1, nall};
    printf("decode attention, Hq=%d Hkv=%d D=%d; cache bytes read per step / time; speedup vs fp16 at the same T and threads\n",
           HQ, HKV, D);
    printf("%-14s %8s %3s %10s %10s %8s %8s %9s\n", "form", "tokens", "thr", "ms/step", "cpu ms", "GB/s", "vs fp16",
           "cpu ratio");
    const int64_t Ts[3] = {4096, 32768, 131072};
    for (int ti = 0; ti < 3; ti++) {
        int64_t T = Ts[ti];
        if (T > maxT)
            break;
        /* fp16 K/V */
        size_t nkv = (size_t)HKV * T * D;
        uint16_t *k16 = malloc(nkv * 2), *v16 = malloc(nkv * 2);
        for (size_t i = 0; i < nkv; i++) {
            k16[i] = kvd_f32_to_f16(tu_rng_normal(&rng));
            v16[i] = kvd_f32_to_f16(tu_rng_normal(&rng));
        }
        kvd_attn_dims dims = {HQ, HKV, D, D, 1.0f / sqrtf((float)D)};
        kvd_attn_dense_args da = {dims, tn(KVD_DTYPE_F32, q, 2, HQ, D, 0), tn(KVD_DTYPE_F16, k16, 3, HKV, T, D),
                                  tn(KVD_DTYPE_F16, v16, 3, HKV, T, D), tn(KVD_DTYPE_F32, out, 2, HQ, D, 0),
                                  tn(KVD_DTYPE_F32, lse, 1, HQ, 0, 0)};
        /* INT forms */
        /* "Kch": keys grouped per channel along tokens; "KIVI": that, with
         * values grouped per token (KIVI's pairing); "Vtok": keys and values
         * both grouped per token; the others: values per channel */
        enum { NIF = 9 };
        const int TOK = KVD_ATTN_AXIS_TOKEN, CH = KVD_ATTN_AXIS_CHANNEL;
        struct {
            const char *name;
            int bits, kg, vg, kaxis, vaxis;
        } iforms[NIF] = {{"int2 P=32", 2, 32, 32, TOK, CH},       {"int2 P=64", 2, 64, 64, TOK, CH},
                         {"int2 P=128", 2, 128, 128, TOK, CH},    {"int4 P=64", 4, 64, 64, TOK, CH},
                         {"int2 Kch P=32", 2, 32, 32, CH, CH},    {"int2 Kch P=128", 2, 128, 128, CH, CH},
                         {"int2 KIVI P=32", 2, 32, 32, CH, TOK},  {"int2 Vtok P=32", 2, 32, 32, TOK, TOK},
                         {"int4 Vtok P=32", 4, 32, 32, TOK, TOK}};
        qcache kq[NIF], vq[NIF];
        for (int f = 0; f < NIF; f++) {
            kq[f] = make_q(&rng, T, D, iforms[f].bits, iforms[f].kg, iforms[f].kaxis);
            vq[f] = make_q(&rng, T, D, iforms[f].bits, iforms[f].vg, iforms[f].vaxis);
        }
        /* INT2 P=32 as the store holds it: one block per 256-token page
         * (codes and parameters of a page contiguous), one item per page in
         * one call, partial results merged by log-sum-exp */
        int64_t npg = T / 256;
        paged pg;
        pg.n = (int)npg;
        pg.items = calloc((size_t)npg, sizeof *pg.items);
        pg.pk = calloc((size_t)npg, sizeof *pg.pk);
        pg.pv = calloc((size_t)npg, sizeof *pg.pv);
        pg.outs = malloc(sizeof(float) * (size_t)npg * HQ * D);
        pg.lses = malloc(sizeof(float) * (size_t)npg * HQ);
        pg.segs = calloc((size_t)npg, sizeof *pg.segs);
        size_t pg_bytes = 0;
        for (int64_t i = 0; i < npg; i++) {
            pg.pk[i] = make_q(&rng, 256, D, 2, 32, KVD_ATTN_AXIS_TOKEN);
            pg.pv[i] = make_q(&rng, 256, D, 2, 32, KVD_ATTN_AXIS_CHANNEL);
            pg_bytes += pg.pk[i].bytes + pg.pv[i].bytes;
            kvd_attn_int_args *ia = &pg.items[i];
            ia->dims = dims;
            ia->q = tn(KVD_DTYPE_F32, q, 2, HQ, D, 0);
            ia->n_tokens = 256;
            ia->k = pg.pk[i].qd;
            ia->v = pg.pv[i].qd;
            ia->out = tn(KVD_DTYPE_F32, pg.outs + (size_t)i * HQ * D, 2, HQ, D, 0);
            ia->lse = tn(KVD_DTYPE_F32, pg.lses + (size_t)i * HQ, 1, HQ, 0, 0);
            pg.segs[i] = (kvd_attn_int_segment){256, pg.pk[i].qd, pg.pv[i].qd};
        }
        pg.seq = pg.items[0];
        pg.seq.n_tokens = npg * 256;
        pg.seq.n_segments = (int)npg;
        pg.seq.segments = pg.segs;
        /* VQ d4b8 */
        uint8_t *kc = malloc((size_t)HKV * T * (D / 4)), *vc = malloc((size_t)HKV * T * (D / 4));
        fill_bytes(&rng, kc, (size_t)HKV * T * (D / 4));
        fill_bytes(&rng, vc, (size_t)HKV * T * (D / 4));
        float *kcb = malloc(sizeof(float) * HKV * 256 * 4), *vcb = malloc(sizeof(float) * HKV * 256 * 4),
              *lam = malloc(sizeof(float) * HKV * D);
        tu_fill_normal(&rng, kcb, HKV * 256 * 4, 1.0f);
        tu_fill_normal(&rng, vcb, HKV * 256 * 4, 1.0f);
        tu_fill_uniform(&rng, lam, HKV * D, 0.5f, 2.0f);
        kvd_attn_vq_args va;
        memset(&va, 0, sizeof va);
        va.dims = dims;
        va.q = da.q;
        va.n_tokens = T;
        va.k_sub_dim = 4;
        va.k_bits = 8;
        va.k_codes = tn(KVD_DTYPE_U8, kc, 3, HKV, T, D / 4);
        va.k_codebook = tn(KVD_DTYPE_F32, kcb, 3, HKV, 256, 4);
        va.k_lambda = tn(KVD_DTYPE_F32, lam, 2, HKV, D, 0);
        va.k_hadamard = 1;
        va.v_sub_dim = 4;
        va.v_bits = 8;
        va.v_codes = tn(KVD_DTYPE_U8, vc, 3, HKV, T, D / 4);
        va.v_codebook = tn(KVD_DTYPE_F32, vcb, 3, HKV, 256, 4);
        va.out = da.out;
        va.lse = da.lse;
        size_t vq_bytes = 2 * (size_t)HKV * T * (D / 4);
        /* SVD (r = 64) + INT2 P=32 */
        int r = 64;
        qcache sk = make_q(&rng, T, r, 2, 32, KVD_ATTN_AXIS_TOKEN), sv = make_q(&rng, T, r, 2, 32, KVD_ATTN_AXIS_CHANNEL);
        float *R = malloc(sizeof(float) * D * D);
        tu_fill_normal(&rng, R, D * D, 0.1f);
        svd_step ss;
        memset(&ss, 0, sizeof ss);
        ss.R = R;
        ss.q = q;
        ss.r = r;
        ss.qr = malloc(sizeof(float) * HQ * r);
        ss.ored = malloc(sizeof(float) * HQ * r);
        ss.out = out;
        ss.a.dims = dims;
        ss.a.dims.head_dim = ss.a.dims.v_dim = r;
        ss.a.q = tn(KVD_DTYPE_F32, ss.qr, 2, HQ, r, 0);
        ss.a.n_tokens = T;
        ss.a.k = sk.qd;
        ss.a.v = sv.qd;
        ss.a.out = tn(KVD_DTYPE_F32, ss.ored, 2, HQ, r, 0);
        ss.a.lse = da.lse;

        for (int th = 0; th < 2; th++) {
            if (th == 1 && threads[1] == 1)
                break;
            kvd_backend *be = tu_cpu_backend(threads[th], 0);
            const step_fn f16[1] = {step_dense};
            void *const a16[1] = {&da};
            double t16, c16;
            time_steps(be, 1, f16, a16, &t16, &c16);
            size_t b16 = 2 * nkv * 2;
            printf("%-14s %8lld %3d %10.3f %10.3f %8.2f %8.2fx %8.2fx\n", "fp16", (long long)T,
                   threads[th], t16 * 1e3, c16 * 1e3, b16 / t16 / 1e9, 1.0, 1.0);
            for (int f = 0; f < NIF; f++) {
                if (!form_on(iforms[f].name))
                    continue;
                kvd_attn_int_args ia;
                memset(&ia, 0, sizeof ia);
                ia.dims = dims;
                ia.q = da.q;
                ia.n_tokens = T;
                ia.k = kq[f].qd;
                ia.v = vq[f].qd;
                ia.out = da.out;
                ia.lse = da.lse;
                pair_time p = time_pair(be, step_dense, &da, step_int, &ia);
                print_pair(iforms[f].name, T, threads[th], &p, kq[f].bytes + vq[f].bytes);
            }
            if (npg > 0 && form_on("int2/32 paged")) {
                pair_time p = time_pair(be, step_dense, &da, step_paged, &pg);
                print_pair("int2/32 paged", T, threads[th], &p, pg_bytes);
            }
            if (npg > 0 && form_on("int2/32 segs")) {
                pair_time p = time_pair(be, step_dense, &da, step_segments, &pg);
                print_pair("int2/32 segs", T, threads[th], &p, pg_bytes);
            }
            if (form_on("vq d4b8")) {
                pair_time p = time_pair(be, step_dense, &da, step_vq, &va);
                print_pair("vq d4b8", T, threads[th], &p, vq_bytes);
            }
            if (form_on("svd64+int2/32")) {
                pair_time p = time_pair(be, step_dense, &da, step_svd, &ss);
                print_pair("svd64+int2/32", T, threads[th], &p, sk.bytes + sv.bytes);
            }
            fflush(stdout);
            kvd_backend_free(be);
        }
        free(k16), free(v16), free(kc), free(vc), free(kcb), free(vcb), free(lam), free(R);
        free(ss.qr), free(ss.ored), free(sk.mem), free(sv.mem);
        for (int f = 0; f < NIF; f++)
            free(kq[f].mem), free(vq[f].mem);
        for (int64_t i = 0; i < npg; i++)
            free(pg.pk[i].mem), free(pg.pv[i].mem);
        free(pg.items), free(pg.pk), free(pg.pv), free(pg.outs), free(pg.lses), free(pg.segs);
    }
    free(q), free(out);
    return 0;
}
