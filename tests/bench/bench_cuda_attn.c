/*
 * GPU benchmark of decode attention on the CUDA backend (a program that
 * prints a table, not a test). Llama-8B-like heads: 32 query heads, 8 kv
 * heads, head_dim 128; one decode step per sequence, a batch of sequences of
 * equal length per call (one item each), every form of the cache:
 *
 *   fp16      dense f16 K/V (the baseline)
 *   int2      INT2, keys per token (HACK, P = 32), values per channel (P = 32)
 *   int4      INT4, same layout
 *   vq        VQ d4b8 keys and values (Hadamard + smoothing on the query)
 *
 * For T = 1K .. 128K tokens (and 1M for batch 1) and batch 1 .. 64: time per
 * call (wall clock after a device sync, mean over repetitions after a
 * warm-up: what a caller of kvd_attn_* sees, host planning included),
 * effective bandwidth = bytes the kernel has to read (codes, group
 * parameters, K/V; not q/out) / time, as % of the HBM peak (2 x memory clock
 * x bus width, read off the device), and speed-up over the fp16 kernel of
 * the same row. Targets (kernels/cuda/README.md): fp16 >= 70 % of HBM at
 * >= 16K tokens; int2 and vq >= 3x fp16 at >= 16K tokens and batch >= 8,
 * int4 >= 2x; no form slower than fp16 at 1K.
 *
 * Rows whose caches do not fit device memory are skipped. Without a GPU the
 * program says so and exits 0.
 *
 * Options: --quick (fewer sizes), --csv FILE (rows:
 * form,batch,tokens,us,gbs,pct_hbm,speedup), --form NAME and --row B:T
 * (that form / that batch and length only: one kernel for a profiler).
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvdepot/attention.h"
#include "kvdepot/backend.h"
#include "testutil.h"

const char *kvd_backend_cuda_device_name(const kvd_backend *be);
double kvd_backend_cuda_hbm_peak_gbs(const kvd_backend *be);

enum { HQ = 32, HKV = 8, D = 128, NFORM = 4 };
static const char *kForm[NFORM] = {"fp16", "int2", "int4", "vq"};

static kvd_backend *be;
static FILE *csv;
static double peak_gbs;

static void fail(const char *what, const kvd_error *e)
{
    fprintf(stderr, "bench_cuda_attn: %s: %s\n", what, e ? e->msg : "");
    exit(1);
}

static void *dev_alloc(size_t bytes)
{
    void *p = NULL;
    kvd_error e;
    if (kvd_backend_alloc(be, bytes ? bytes : 1, &p, &e))
        return NULL;
    return p;
}

/* Fill device memory with copies of a host pattern (chunks of 16 MiB). */
static void dev_fill(void *dst, size_t bytes, const void *pat, size_t patbytes)
{
    kvd_error e;
    for (size_t o = 0; o < bytes; o += patbytes) {
        size_t n = bytes - o < patbytes ? bytes - o : patbytes;
        if (kvd_backend_upload(be, (char *)dst + o, pat, n, &e))
            fail("upload", &e);
    }
}

static kvd_tensor t1(kvd_dtype dt, void *p, int64_t a) { return kvd_tensor_make(dt, p, 1, &a); }
static kvd_tensor t2(kvd_dtype dt, void *p, int64_t a, int64_t b)
{
    int64_t s[2] = {a, b};
    return kvd_tensor_make(dt, p, 2, s);
}
static kvd_tensor t3(kvd_dtype dt, void *p, int64_t a, int64_t b, int64_t c)
{
    int64_t s[3] = {a, b, c};
    return kvd_tensor_make(dt, p, 3, s);
}

/* Per-token bytes of each form (all kv heads), what the kernel reads. */
static double bytes_per_token(int form)
{
    switch (form) {
    case 0:
        return HKV * 2.0 * D * 2;
    case 1: /* codes D/4 + K min/scale (D/32 x 4 B) + V codes + V min/scale/sum per 32 tokens */
        return HKV * (D / 4.0 + D / 32.0 * 4 + D / 4.0 + D * 6.0 / 32);
    case 2:
        return HKV * (D / 2.0 + D / 32.0 * 4 + D / 2.0 + D * 6.0 / 32);
    default: /* d4b8: one byte per 4 dims of K and of V */
        return HKV * (D / 4.0 + D / 4.0);
    }
}

typedef struct bufs {
    size_t tokens; /* capacity in tokens (all sequences of a row) */
    void *kv16;    /* fp16 K then V: (tokens, HKV, D) each */
    void *qc[2], *qp[2]; /* INT2/INT4: codes (K then V), params (K min/scale, V min/scale/sum) */
    void *vqc;     /* VQ codes K then V */
    void *kcb, *vcb, *lam;
    void *q, *out, *lse;
} bufs;

static float *host_q;

static int bufs_new(bufs *b, size_t tokens, int batch)
{
    memset(b, 0, sizeof *b);
    b->tokens = tokens;
    size_t n16 = tokens * HKV * D * 2;
    b->kv16 = dev_alloc(2 * n16);
    for (int f = 0; f < 2; f++) {
        int bits = f ? 4 : 2;
        b->qc[f] = dev_alloc(2 * tokens * HKV * D * bits / 8);
        b->qp[f] = dev_alloc(tokens * HKV * (D / 32) * 2 * 2 + tokens * HKV * D / 32 * 3 * 2);
    }
    b->vqc = dev_alloc(2 * tokens * HKV * (D / 4));
    b->kcb = dev_alloc((size_t)HKV * 256 * 4 * 4);
    b->vcb = dev_alloc((size_t)HKV * 256 * 4 * 4);
    b->lam = dev_alloc((size_t)HKV * D * 4);
    b->q = dev_alloc((size_t)batch * HQ * D * 4);
    b->out = dev_alloc((size_t)batch * HQ * D * 4);
    b->lse = dev_alloc((size_t)batch * HQ * 4);
    if (!b->kv16 || !b->qc[0] || !b->qc[1] || !b->qp[0] || !b->qp[1] || !b->vqc || !b->q || !b->out || !b->lse)
        return -1;
    /* contents: valid f16 values (no NaN/Inf), random codes, codebooks */
    tu_rng r;
    tu_rng_seed(&r, 7);
    size_t pat = 16u << 20;
    float *f = malloc(pat / 2 * 4);
    uint16_t *h = malloc(pat);
    tu_fill_normal(&r, f, pat / 2, 1.0f);
    tu_f32_to_f16(h, f, pat / 2);
    dev_fill(b->kv16, 2 * n16, h, pat);
    unsigned char *bytes = (unsigned char *)h;
    for (size_t i = 0; i < pat; i++)
        bytes[i] = (unsigned char)tu_rng_u64(&r);
    for (int k = 0; k < 2; k++)
        dev_fill(b->qc[k], 2 * tokens * HKV * D * (k ? 4 : 2) / 8, bytes, pat);
    dev_fill(b->vqc, 2 * tokens * HKV * (D / 4), bytes, pat);
    for (size_t i = 0; i < pat / 2; i++)
        h[i] = kvd_f32_to_f16(i % 2 ? 0.05f : -0.5f); /* min / scale alternate; sums read as numbers */
    for (int k = 0; k < 2; k++)
        dev_fill(b->qp[k], tokens * HKV * (D / 32) * 4 + tokens * HKV * D / 32 * 6, h, pat);
    tu_fill_normal(&r, f, (size_t)HKV * 256 * 4, 1.0f);
    dev_fill(b->kcb, (size_t)HKV * 256 * 16, f, (size_t)HKV * 256 * 16);
    dev_fill(b->vcb, (size_t)HKV * 256 * 16, f, (size_t)HKV * 256 * 16);
    tu_fill_uniform(&r, f, (size_t)HKV * D, 0.5f, 2.0f);
    dev_fill(b->lam, (size_t)HKV * D * 4, f, (size_t)HKV * D * 4);
    host_q = realloc(host_q, sizeof(float) * (size_t)batch * HQ * D);
    tu_fill_normal(&r, host_q, (size_t)batch * HQ * D, 1.0f);
    dev_fill(b->q, (size_t)batch * HQ * D * 4, host_q, (size_t)batch * HQ * D * 4);
    free(f), free(h);
    return 0;
}

static void bufs_free(bufs *b)
{
    void *p[] = {b->kv16, b->qc[0], b->qc[1], b->qp[0], b->qp[1], b->vqc, b->kcb, b->vcb, b->lam, b->q, b->out,
                 b->lse};
    for (size_t i = 0; i < sizeof p / sizeof *p; i++)
        if (p[i])
            kvd_backend_dealloc(be, p[i]);
}

/* Argument arrays of one row (batch sequences of T tokens). */
typedef struct row {
    int batch;
    int64_t T;
    kvd_attn_dense_args *dense;
    kvd_attn_int_args *q[2];
    kvd_attn_vq_args *vq;
} row;

static void row_build(row *r, const bufs *b, int batch, int64_t T)
{
    r->batch = batch;
    r->T = T;
    r->dense = calloc((size_t)batch, sizeof *r->dense);
    r->q[0] = calloc((size_t)batch, sizeof *r->q[0]);
    r->q[1] = calloc((size_t)batch, sizeof *r->q[1]);
    r->vq = calloc((size_t)batch, sizeof *r->vq);
    kvd_attn_dims dm = {HQ, HKV, D, D, 1.0f / sqrtf((float)D)};
    size_t tok = (size_t)T * batch;
    for (int i = 0; i < batch; i++) {
        size_t t0 = (size_t)T * i; /* this sequence's first token in the buffers */
        kvd_tensor q = t2(KVD_DTYPE_F32, (char *)b->q + (size_t)i * HQ * D * 4, HQ, D);
        kvd_tensor out = t2(KVD_DTYPE_F32, (char *)b->out + (size_t)i * HQ * D * 4, HQ, D);
        kvd_tensor lse = t1(KVD_DTYPE_F32, (char *)b->lse + (size_t)i * HQ * 4, HQ);
        kvd_attn_dense_args *d = &r->dense[i];
        d->dims = dm;
        d->q = q, d->out = out, d->lse = lse;
        d->k = t3(KVD_DTYPE_F16, (char *)b->kv16 + t0 * HKV * D * 2, HKV, T, D);
        d->v = t3(KVD_DTYPE_F16, (char *)b->kv16 + (tok + t0) * HKV * D * 2, HKV, T, D);
        for (int f = 0; f < 2; f++) {
            int bits = f ? 4 : 2;
            kvd_attn_int_args *a = &r->q[f][i];
            a->dims = dm;
            a->q = q, a->out = out, a->lse = lse;
            a->n_tokens = T;
            char *c = (char *)b->qc[f], *p = (char *)b->qp[f];
            size_t kcb = tok * HKV * D * bits / 8, kpb = tok * HKV * (D / 32) * 2;
            a->k.bits = bits, a->k.group = 32, a->k.axis = KVD_ATTN_AXIS_TOKEN;
            a->k.codes = t3(KVD_DTYPE_U8, c + t0 * HKV * D * bits / 8, HKV, T, D * bits / 8);
            a->k.min = t3(KVD_DTYPE_F16, p + t0 * HKV * (D / 32) * 2, HKV, T, D / 32);
            a->k.scale = t3(KVD_DTYPE_F16, p + kpb + t0 * HKV * (D / 32) * 2, HKV, T, D / 32);
            a->k.sum = a->k.min; /* not read on the token axis: any u16 view */
            a->k.sum.dtype = KVD_DTYPE_U16;
            a->v.bits = bits, a->v.group = 32, a->v.axis = KVD_ATTN_AXIS_CHANNEL;
            a->v.codes = t3(KVD_DTYPE_U8, c + kcb + t0 * HKV * D * bits / 8, HKV, D, T * bits / 8);
            char *vp = p + 2 * kpb;
            size_t vpb = tok * HKV * D / 32 * 2;
            a->v.min = t3(KVD_DTYPE_F16, vp + t0 * HKV * D / 32 * 2, HKV, D, T / 32);
            a->v.scale = t3(KVD_DTYPE_F16, vp + vpb + t0 * HKV * D / 32 * 2, HKV, D, T / 32);
            a->v.sum = t3(KVD_DTYPE_U16, vp + 2 * vpb + t0 * HKV * D / 32 * 2, HKV, D, T / 32);
        }
        kvd_attn_vq_args *v = &r->vq[i];
        v->dims = dm;
        v->q = q, v->out = out, v->lse = lse;
        v->n_tokens = T;
        v->k_sub_dim = 4, v->k_bits = 8, v->v_sub_dim = 4, v->v_bits = 8;
        v->k_codes = t3(KVD_DTYPE_U8, (char *)b->vqc + t0 * HKV * (D / 4), HKV, T, D / 4);
        v->v_codes = t3(KVD_DTYPE_U8, (char *)b->vqc + (tok + t0) * HKV * (D / 4), HKV, T, D / 4);
        v->k_codebook = t3(KVD_DTYPE_F32, b->kcb, HKV, 256, 4);
        v->v_codebook = t3(KVD_DTYPE_F32, b->vcb, HKV, 256, 4);
        v->k_lambda = t2(KVD_DTYPE_F32, b->lam, HKV, D);
        v->k_hadamard = 1;
    }
}

static void row_free(row *r)
{
    free(r->dense), free(r->q[0]), free(r->q[1]), free(r->vq);
}

static int run_form(const row *r, int form, kvd_error *e)
{
    switch (form) {
    case 0:
        return kvd_attn_dense(be, r->batch, r->dense, e);
    case 1:
        return kvd_attn_quant(be, r->batch, r->q[0], e);
    case 2:
        return kvd_attn_quant(be, r->batch, r->q[1], e);
    default:
        return kvd_attn_vq(be, r->batch, r->vq, e);
    }
}

/* Seconds per call; < 0 on error. */
static double time_form(const row *r, int form)
{
    kvd_error e;
    for (int i = 0; i < 2; i++)
        if (run_form(r, form, &e) || kvd_backend_sync(be, &e)) {
            fprintf(stderr, "%s: %s\n", kForm[form], e.msg);
            return -1;
        }
    double t0 = tu_now();
    run_form(r, form, &e);
    kvd_backend_sync(be, &e);
    double one = tu_now() - t0;
    int reps = one > 0 ? (int)(0.05 / one) : 100;
    reps = reps < 3 ? 3 : reps > 200 ? 200 : reps;
    t0 = tu_now();
    for (int i = 0; i < reps; i++)
        if (run_form(r, form, &e)) {
            fprintf(stderr, "%s: %s\n", kForm[form], e.msg);
            return -1;
        }
    if (kvd_backend_sync(be, &e))
        return -1;
    return (tu_now() - t0) / reps;
}

int main(int argc, char **argv)
{
    int quick = 0, only_form = -1, only_b = 0;
    long long only_t = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--quick"))
            quick = 1;
        else if (!strcmp(argv[i], "--form") && i + 1 < argc) {
            ++i;
            for (int f = 0; f < NFORM; f++)
                if (!strcmp(argv[i], kForm[f]))
                    only_form = f;
            if (only_form < 0) {
                fprintf(stderr, "bench_cuda_attn: unknown --form %s (fp16, int2, int4, vq)\n",
                        argv[i]);
                return 2;
            }
        } else if (!strcmp(argv[i], "--row") && i + 1 < argc) {
            if (sscanf(argv[++i], "%d:%lld", &only_b, &only_t) != 2 || only_b < 1 || only_t < 1) {
                fprintf(stderr, "bench_cuda_attn: --row wants BATCH:TOKENS, not %s\n", argv[i]);
                return 2;
            }
        } else if (!strcmp(argv[i], "--csv") && i + 1 < argc)
            csv = fopen(argv[++i], "w");
    }
    kvd_error err;
    int rc = kvd_backend_cuda_create(-1, &be, &err);
    if (rc) {
        printf("bench_cuda_attn: no CUDA device (%s); nothing to measure\n", err.msg);
        return 0;
    }
    peak_gbs = kvd_backend_cuda_hbm_peak_gbs(be);
    printf("# bench_cuda_attn on %s: HBM peak %.0f GB/s; heads %d q / %d kv / %d dims\n",
           kvd_backend_cuda_device_name(be), peak_gbs, HQ, HKV, D);
    if (csv)
        fprintf(csv, "form,batch,tokens,us,gbs,pct_hbm,speedup\n");
    const int64_t Ts_full[] = {1024, 4096, 16384, 32768, 65536, 131072, 1048576};
    const int64_t Ts_quick[] = {1024, 16384, 131072};
    const int Bs_full[] = {1, 8, 16, 64}, Bs_quick[] = {1, 8};
    const int64_t *Ts = quick ? Ts_quick : Ts_full;
    const int *Bs = quick ? Bs_quick : Bs_full;
    int nT = quick ? 3 : 7, nB = quick ? 2 : 4;
    const int64_t Ts_one[] = {only_t};
    const int Bs_one[] = {only_b};
    if (only_b) {
        Ts = Ts_one, Bs = Bs_one;
        nT = nB = 1;
    }
    /* the largest row that fits: fp16 + INT2 + INT4 + VQ bytes per token */
    size_t per_tok = 0;
    for (int f = 0; f < NFORM; f++)
        per_tok += (size_t)bytes_per_token(f) + 64;
    size_t budget = (size_t)72 << 30; /* below an H100's 80 GB */
    const char *env = getenv("KVD_BENCH_ATTN_GIB");
    if (env)
        budget = (size_t)atol(env) << 30;
    size_t maxtok = 0;
    for (int ti = 0; ti < nT; ti++)
        for (int bi = 0; bi < nB; bi++) {
            size_t tok = (size_t)Ts[ti] * Bs[bi];
            if ((Ts[ti] <= 131072 || Bs[bi] == 1) && tok * per_tok <= budget && tok > maxtok)
                maxtok = tok;
        }
    bufs b;
    while (bufs_new(&b, maxtok, Bs[nB - 1]) != 0) {
        bufs_free(&b);
        maxtok /= 2;
        if (maxtok < 1024)
            fail("device memory", NULL);
    }
    printf("\n%-6s %6s %9s %10s %9s %7s %8s\n", "form", "batch", "tokens", "us", "GB/s", "%HBM", "vs fp16");
    for (int bi = 0; bi < nB; bi++)
        for (int ti = 0; ti < nT; ti++) {
            int batch = Bs[bi];
            int64_t T = Ts[ti];
            if (T > 131072 && batch != 1)
                continue;
            if ((size_t)T * batch > maxtok) {
                printf("%-6s %6d %9lld %10s (does not fit device memory)\n", "-", batch, (long long)T, "-");
                continue;
            }
            row r;
            row_build(&r, &b, batch, T);
            double t16 = -1;
            for (int f = 0; f < NFORM; f++) {
                if (only_form >= 0 && f != only_form)
                    continue;
                double t = time_form(&r, f);
                if (t <= 0)
                    continue;
                if (f == 0)
                    t16 = t;
                double gbs = bytes_per_token(f) * (double)T * batch / t / 1e9;
                double pct = peak_gbs > 0 ? 100.0 * gbs / peak_gbs : 0.0, sp = t16 > 0 ? t16 / t : 0.0;
                printf("%-6s %6d %9lld %10.1f %9.0f %6.1f%% %7.2fx\n", kForm[f], batch, (long long)T, t * 1e6, gbs,
                       pct, sp);
                if (csv)
                    fprintf(csv, "%s,%d,%lld,%.2f,%.1f,%.2f,%.3f\n", kForm[f], batch, (long long)T, t * 1e6, gbs,
                            pct, sp);
            }
            row_free(&r);
        }
    bufs_free(&b);
    free(host_q);
    if (csv)
        fclose(csv);
    kvd_backend_free(be);
    return 0;
}
