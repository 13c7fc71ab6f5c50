/*
 * Backend comparison for decode attention: every attention op of the CUDA
 * backend against the CPU scalar reference on the same inputs, with the
 * thresholds of the CPU fast-vs-reference tests (kernels_attn.c):
 *
 *   dense, sparse, VQ, SVD   out NMSE <= 1e-9, |lse diff| <= 1e-4
 *   INT2/INT4                out NMSE <= 1e-6, |lse diff| <= 1e-4 (a uint8
 *                            probability may round the other way where
 *                            float and double scores straddle a .5)
 *   merge                    out NMSE <= 1e-10, |lse diff| <= 1e-5
 *
 * plus NaN/Inf parity of out and lse, the empty range (lse = -inf, out = 0)
 * and guard zones around every device output (which starts poisoned).
 * Shapes: T = 0, 1, odd, 1K and 33K (long enough to be split over the token
 * axis and merged in-launch), batches of items of mixed lengths in one call,
 * G = 1/4/8 (and 6, 16), D = 64/128 (and odd widths, padded rows), every
 * key/value axis and group of the INT form, raw tails, u8/u16 VQ codes,
 * ragged SVD widths.
 *
 * Without a GPU the same harness runs once in self-check mode, the CPU fast
 * backend standing in for the device, then the program prints "skipped" and
 * exits 77. `test_cuda_attn --self-check` forces that mode (exit 0 when it
 * passes), so the harness itself runs in CI.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvdepot/attention.h"
#include "kvdepot/backend.h"
#include "kvdepot/quant.h"
#include "testutil.h"

static kvd_backend *ref; /* CPU scalar reference */
static kvd_backend *dut; /* CUDA, or the CPU fast path in self-check */

/* ---- device buffers with guard zones ----------------------------------- */

#define GUARD 64

typedef struct dbuf {
    unsigned char *dev; /* GUARD | bytes | GUARD */
    size_t bytes;
} dbuf;

static void die(const char *what, const kvd_error *e)
{
    fprintf(stderr, "fatal: %s: %s\n", what, e ? e->msg : "");
    exit(1);
}

static dbuf dbuf_new(size_t bytes)
{
    dbuf b = {NULL, bytes};
    kvd_error e;
    void *p = NULL;
    if (kvd_backend_alloc(dut, bytes + 2 * GUARD, &p, &e))
        die("alloc", &e);
    b.dev = p;
    unsigned char *h = malloc(bytes + 2 * GUARD);
    for (size_t i = 0; i < bytes + 2 * GUARD; i++)
        h[i] = i < GUARD || i >= bytes + GUARD ? (unsigned char)(0xA5 ^ (i & 7)) : 0xCD;
    if (kvd_backend_upload(dut, b.dev, h, bytes + 2 * GUARD, &e))
        die("upload", &e);
    free(h);
    return b;
}

static void *dptr(const dbuf *b) { return b->dev + GUARD; }

static int dbuf_guard_ok(const dbuf *b)
{
    unsigned char *h = malloc(b->bytes + 2 * GUARD);
    kvd_error e;
    if (kvd_backend_download(dut, h, b->dev, b->bytes + 2 * GUARD, &e))
        die("download", &e);
    int ok = 1;
    for (size_t i = 0; i < b->bytes + 2 * GUARD; i++)
        if ((i < GUARD || i >= b->bytes + GUARD) && h[i] != (unsigned char)(0xA5 ^ (i & 7)))
            ok = 0;
    free(h);
    return ok;
}

static void dbuf_get(const dbuf *b, void *host, size_t bytes)
{
    kvd_error e;
    if (bytes && kvd_backend_download(dut, host, dptr(b), bytes, &e))
        die("download", &e);
}

/* Inputs of one test: host arrays mirrored on the device; dev_of() maps a
 * host pointer inside a mirrored array to the device address. */
#define MAXM 256
static struct mirror {
    const char *host;
    size_t bytes;
    dbuf d;
} mirrors[MAXM];
static int nmirror;

static void *mirror(const void *host, size_t bytes)
{
    if (nmirror == MAXM)
        die("too many mirrors", NULL);
    struct mirror *m = &mirrors[nmirror++];
    m->host = host;
    m->bytes = bytes;
    m->d = dbuf_new(bytes);
    kvd_error e;
    if (bytes && kvd_backend_upload(dut, dptr(&m->d), host, bytes, &e))
        die("upload", &e);
    return dptr(&m->d);
}

static void *dev_of(const void *host)
{
    if (!host)
        return NULL;
    for (int i = nmirror - 1; i >= 0; i--)
        if ((const char *)host >= mirrors[i].host && (const char *)host <= mirrors[i].host + mirrors[i].bytes)
            return (char *)dptr(&mirrors[i].d) + ((const char *)host - mirrors[i].host);
    die("pointer not mirrored", NULL);
    return NULL;
}

static void mirrors_free(void)
{
    for (int i = 0; i < nmirror; i++)
        kvd_backend_dealloc(dut, mirrors[i].d.dev);
    nmirror = 0;
}

static kvd_tensor dt_of(kvd_tensor t)
{
    t.data = dev_of(t.data);
    return t;
}

/* Longest sequence a case may use: all of them on a device; the CPU
 * emulation of the kernels (test_cuda_attn_emu) caps them, its two "SMs"
 * split a few thousand tokens already. */
static int64_t max_T = INT64_MAX;

static int64_t capT(int64_t T) { return T > max_T ? max_T : T; }

/* ---- problem setup ----------------------------------------------------- */

static kvd_tensor t1(kvd_dtype dt, void *data, int64_t a) { return kvd_tensor_make(dt, data, 1, &a); }

static kvd_tensor t2(kvd_dtype dt, void *data, int64_t a, int64_t b)
{
    int64_t s[2] = {a, b};
    return kvd_tensor_make(dt, data, 2, s);
}

static kvd_tensor t3(kvd_dtype dt, void *data, int64_t a, int64_t b, int64_t c)
{
    int64_t s[3] = {a, b, c};
    return kvd_tensor_make(dt, data, 3, s);
}

static void *to_dtype(const float *x, size_t n, kvd_dtype dt)
{
    void *out = malloc(n * kvd_dtype_size(dt) + 16);
    if (dt == KVD_DTYPE_F32)
        memcpy(out, x, n * 4);
    else if (dt == KVD_DTYPE_F16)
        tu_f32_to_f16(out, x, n);
    else
        tu_f32_to_bf16(out, x, n);
    return out;
}

/* (Hkv, T, W) LLM-like values, f32 */
static float *gen_kv(tu_rng *r, int Hkv, int64_t T, int W, int keys)
{
    float *x = malloc(sizeof(float) * (size_t)(Hkv * T * W) + 16);
    tu_kv_opts ko = {4, 10.0f, 0.3f, 1}, vo = {0, 1.0f, 0.2f, 0};
    for (int h = 0; h < Hkv; h++)
        tu_gen_kv(r, x + (size_t)h * T * W, T, W, keys ? &ko : &vo);
    return x;
}

static float *gen_q(tu_rng *r, int Hq, int D)
{
    float *q = malloc(sizeof(float) * (size_t)Hq * D + 16);
    tu_fill_normal(r, q, (size_t)Hq * D, 1.0f);
    return q;
}

/* Result buffers: host (reference) and device (under test). */
typedef struct res {
    int Hq, Dv;
    float *ro, *rl; /* reference */
    dbuf o, l;      /* device */
} res;

static res res_new(int Hq, int Dv)
{
    res r = {Hq, Dv, malloc(sizeof(float) * (size_t)Hq * Dv + 4), malloc(sizeof(float) * (size_t)Hq + 4),
             dbuf_new(sizeof(float) * (size_t)Hq * Dv), dbuf_new(sizeof(float) * (size_t)Hq)};
    return r;
}

static void res_free(res *r)
{
    free(r->ro), free(r->rl);
    kvd_backend_dealloc(dut, r->o.dev);
    kvd_backend_dealloc(dut, r->l.dev);
}

/* The NMSE thresholds hold up to 4K tokens; beyond, float accumulation over
 * T terms (the CPU fast path's too) adds error roughly in proportion to T. */
static double long_tol(double tol, int64_t T)
{
    return T > 4096 ? tol * (double)T / 4096.0 : tol;
}

static void compare(const char *what, res *r, double nmse_tol, double lse_tol)
{
    size_t n = (size_t)r->Hq * r->Dv;
    float *xo = malloc(sizeof(float) * n + 4), *xl = malloc(sizeof(float) * (size_t)r->Hq + 4);
    dbuf_get(&r->o, xo, sizeof(float) * n);
    dbuf_get(&r->l, xl, sizeof(float) * (size_t)r->Hq);
    double e = tu_nmse(r->ro, xo, n);
    TU_CHECK(e <= nmse_tol, "%s: out NMSE %.3g > %.3g", what, e, nmse_tol);
    TU_CHECK(tu_nonfinite_parity(r->ro, xo, n) < 0, "%s: out NaN/Inf parity", what);
    TU_CHECK(tu_nonfinite_parity(r->rl, xl, (size_t)r->Hq) < 0, "%s: lse NaN/Inf parity", what);
    double dl = tu_max_abs_diff(r->rl, xl, (size_t)r->Hq);
    TU_CHECK(dl <= lse_tol, "%s: lse diff %.3g > %.3g", what, dl, lse_tol);
    for (int h = 0; h < r->Hq; h++)
        if (isinf(r->rl[h]) && r->rl[h] < 0)
            for (int j = 0; j < r->Dv; j++)
                TU_CHECK(xo[(size_t)h * r->Dv + j] == 0.0f, "%s: empty range head %d out not 0", what, h);
    TU_CHECK(dbuf_guard_ok(&r->o) && dbuf_guard_ok(&r->l), "%s: guard bytes", what);
    free(xo), free(xl);
}

static kvd_tensor rout(res *r, int dev) { return t2(KVD_DTYPE_F32, dev ? dptr(&r->o) : r->ro, r->Hq, r->Dv); }
static kvd_tensor rlse(res *r, int dev) { return t1(KVD_DTYPE_F32, dev ? dptr(&r->l) : r->rl, r->Hq); }

static kvd_attn_dims dims(int Hq, int Hkv, int D, int Dv)
{
    kvd_attn_dims d = {Hq, Hkv, D, Dv, 1.0f / sqrtf((float)D)};
    return d;
}

static void sync_dut(void)
{
    kvd_error e;
    TU_CHECK(kvd_backend_sync(dut, &e) == 0, "sync: %s", e.msg);
}

/* ---- dense ------------------------------------------------------------- */

typedef struct dcase {
    int Hkv, G, D, Dv;
    int64_t T;
    kvd_dtype dt;
    int pad; /* extra elements per row (unaligned, non-contiguous rows) */
} dcase;

typedef struct dinput {
    float *q;
    void *k, *v;
    kvd_attn_dense_args a;
} dinput;

static dinput dense_input(tu_rng *r, const dcase *c, res *out)
{
    dinput in;
    int Hq = c->Hkv * c->G;
    int64_t rk = c->D + c->pad, rv = c->Dv + c->pad;
    float *k32 = gen_kv(r, c->Hkv, c->T, (int)rk, 1), *v32 = gen_kv(r, c->Hkv, c->T, (int)rv, 0);
    in.q = gen_q(r, Hq, c->D);
    in.k = to_dtype(k32, (size_t)(c->Hkv * c->T * rk), c->dt);
    in.v = to_dtype(v32, (size_t)(c->Hkv * c->T * rv), c->dt);
    free(k32), free(v32);
    memset(&in.a, 0, sizeof in.a);
    in.a.dims = dims(Hq, c->Hkv, c->D, c->Dv);
    in.a.q = t2(KVD_DTYPE_F32, in.q, Hq, c->D);
    size_t es = kvd_dtype_size(c->dt);
    in.a.k = t3(c->dt, in.k, c->Hkv, c->T, c->D);
    in.a.v = t3(c->dt, in.v, c->Hkv, c->T, c->Dv);
    in.a.k.stride[1] = (int64_t)(rk * es);
    in.a.k.stride[0] = (int64_t)(rk * es) * c->T;
    in.a.v.stride[1] = (int64_t)(rv * es);
    in.a.v.stride[0] = (int64_t)(rv * es) * c->T;
    in.a.out = rout(out, 0);
    in.a.lse = rlse(out, 0);
    mirror(in.q, sizeof(float) * (size_t)Hq * c->D);
    mirror(in.k, es * (size_t)(c->Hkv * c->T * rk));
    mirror(in.v, es * (size_t)(c->Hkv * c->T * rv));
    return in;
}

static kvd_attn_dense_args dense_dev(const dinput *in, res *out)
{
    kvd_attn_dense_args d = in->a;
    d.q = dt_of(d.q);
    d.k = dt_of(d.k);
    d.v = dt_of(d.v);
    d.out = rout(out, 1);
    d.lse = rlse(out, 1);
    return d;
}

static void dense_batch(tu_rng *r, const char *name, const dcase *cs0, int n)
{
    dcase *cs = malloc(sizeof(dcase) * (size_t)n);
    for (int i = 0; i < n; i++) {
        cs[i] = cs0[i];
        cs[i].T = capT(cs[i].T);
    }
    dinput *in = malloc(sizeof(dinput) * (size_t)n);
    res *rs = malloc(sizeof(res) * (size_t)n);
    kvd_attn_dense_args *da = malloc(sizeof(kvd_attn_dense_args) * (size_t)n),
                        *ra = malloc(sizeof(kvd_attn_dense_args) * (size_t)n);
    for (int i = 0; i < n; i++) {
        rs[i] = res_new(cs[i].Hkv * cs[i].G, cs[i].Dv);
        in[i] = dense_input(r, &cs[i], &rs[i]);
        ra[i] = in[i].a;
        da[i] = dense_dev(&in[i], &rs[i]);
    }
    kvd_error e;
    TU_CHECK(kvd_attn_dense(ref, n, ra, &e) == 0, "%s: ref: %s", name, e.msg);
    TU_CHECK(kvd_attn_dense(dut, n, da, &e) == 0, "%s: dut: %s", name, e.msg);
    sync_dut();
    for (int i = 0; i < n; i++) {
        char what[160];
        snprintf(what, sizeof what, "%s item %d: dense T=%lld G=%d D=%d/%d %s pad %d", name, i,
                 (long long)cs[i].T, cs[i].G, cs[i].D, cs[i].Dv, kvd_dtype_name(cs[i].dt), cs[i].pad);
        compare(what, &rs[i], long_tol(1e-9, cs[i].T), 1e-4);
        res_free(&rs[i]);
        free(in[i].q), free(in[i].k), free(in[i].v);
    }
    mirrors_free();
    free(in), free(rs), free(da), free(ra), free(cs);
}

static void test_dense(tu_rng *r)
{
    const int64_t Ts[] = {0, 1, 7, 257, 1000};
    const int Gs[] = {1, 4, 8}, Ds[] = {64, 128};
    const kvd_dtype dts[] = {KVD_DTYPE_F32, KVD_DTYPE_F16, KVD_DTYPE_BF16};
    for (size_t ti = 0; ti < sizeof Ts / sizeof *Ts; ti++)
        for (int gi = 0; gi < 3; gi++)
            for (int di = 0; di < 2; di++)
                for (int ei = 0; ei < 3; ei++) {
                    dcase c = {2, Gs[gi], Ds[di], Ds[di], Ts[ti], dts[ei], 0};
                    dense_batch(r, "shape", &c, 1);
                }
    /* long: split over the token axis and merged in-launch */
    dcase lc[] = {{2, 4, 128, 128, 33000, KVD_DTYPE_F16, 0}, {1, 8, 64, 64, 33001, KVD_DTYPE_BF16, 0},
                  {2, 1, 128, 128, 33024, KVD_DTYPE_F32, 0}};
    for (size_t i = 0; i < sizeof lc / sizeof *lc; i++)
        dense_batch(r, "long", &lc[i], 1);
    /* one call, sequences of mixed lengths */
    dcase mix[] = {{2, 4, 128, 128, 0, KVD_DTYPE_F16, 0},    {2, 4, 128, 128, 1, KVD_DTYPE_F16, 0},
                   {2, 4, 128, 128, 300, KVD_DTYPE_F16, 0},  {2, 4, 128, 128, 5000, KVD_DTYPE_F16, 0},
                   {2, 4, 128, 128, 33001, KVD_DTYPE_F16, 0}, {2, 4, 128, 128, 1024, KVD_DTYPE_F16, 0}};
    dense_batch(r, "mixed batch", mix, (int)(sizeof mix / sizeof *mix));
    /* mixed configurations in one call (several launches) */
    dcase het[] = {{2, 4, 128, 128, 700, KVD_DTYPE_F16, 0}, {3, 2, 64, 64, 513, KVD_DTYPE_F32, 0},
                   {1, 6, 20, 12, 77, KVD_DTYPE_BF16, 0},   {2, 16, 64, 64, 999, KVD_DTYPE_F16, 0}};
    dense_batch(r, "mixed configs", het, (int)(sizeof het / sizeof *het));
    /* odd widths, padded (unaligned) rows, G not a power of two, G > 8 */
    dcase odd[] = {{3, 2, 20, 12, 50, KVD_DTYPE_F16, 0},   {2, 4, 128, 128, 400, KVD_DTYPE_F16, 1},
                   {2, 4, 64, 64, 300, KVD_DTYPE_F32, 3},   {2, 6, 128, 128, 600, KVD_DTYPE_BF16, 0},
                   {1, 16, 128, 128, 2000, KVD_DTYPE_F16, 0}, {2, 4, 96, 64, 333, KVD_DTYPE_F16, 0},
                   {1, 4, 256, 256, 500, KVD_DTYPE_F16, 0}};
    for (size_t i = 0; i < sizeof odd / sizeof *odd; i++)
        dense_batch(r, "odd", &odd[i], 1);
}

/* NaN in one query head, Inf in K, NaN in V: parity with the reference. */
static void test_dense_nonfinite(tu_rng *r)
{
    for (int ei = 0; ei < 2; ei++) {
        dcase c = {2, 4, 128, 128, ei ? capT(5000) : 300, ei ? KVD_DTYPE_F16 : KVD_DTYPE_F32, 0};
        res rs = res_new(8, 128);
        dinput in = dense_input(r, &c, &rs);
        in.q[(size_t)5 * 128 + 17] = NAN;
        size_t es = kvd_dtype_size(c.dt);
        float vals[2] = {INFINITY, NAN};
        for (int s = 0; s < 2; s++) {
            void *tgt = s ? in.v : in.k;
            int64_t at = s ? (int64_t)(c.T + c.T / 3) * 128 + 5 : (int64_t)(c.T / 2) * 128 + 3; /* head 1 / head 0 */
            if (c.dt == KVD_DTYPE_F32)
                ((float *)tgt)[at] = vals[s];
            else
                ((uint16_t *)tgt)[at] = kvd_f32_to_f16(vals[s]);
        }
        mirrors_free();
        mirror(in.q, sizeof(float) * 8 * 128);
        mirror(in.k, es * (size_t)(2 * c.T * 128));
        mirror(in.v, es * (size_t)(2 * c.T * 128));
        kvd_attn_dense_args da = dense_dev(&in, &rs);
        kvd_error e;
        TU_CHECK(kvd_attn_dense(ref, 1, &in.a, &e) == 0, "nonfinite ref: %s", e.msg);
        TU_CHECK(kvd_attn_dense(dut, 1, &da, &e) == 0, "nonfinite dut: %s", e.msg);
        sync_dut();
        compare(ei ? "dense NaN/Inf (split)" : "dense NaN/Inf", &rs, long_tol(1e-9, c.T), 1e-4);
        res_free(&rs);
        free(in.q), free(in.k), free(in.v);
        mirrors_free();
    }
}

/* ---- sparse ------------------------------------------------------------ */

static void test_sparse(tu_rng *r)
{
    const int ns[] = {0, 1, 37, 700, 2048};
    for (size_t ni = 0; ni < sizeof ns / sizeof *ns; ni++)
        for (int ei = 0; ei < 2; ei++) {
            dcase c = {2, ei ? 8 : 4, 128, 128, 3000, ei ? KVD_DTYPE_BF16 : KVD_DTYPE_F16, 0};
            int Hq = c.Hkv * c.G, n = ns[ni];
            res rs = res_new(Hq, 128);
            dinput in = dense_input(r, &c, &rs);
            int32_t *idx = malloc(sizeof(int32_t) * (size_t)(2 * n) + 4);
            for (int h = 0; h < 2; h++)
                for (int i = 0; i < n; i++)
                    idx[h * n + i] = (int32_t)((i * 7919 + h * 13) % 3000); /* distinct for n <= 3000 */
            mirror(idx, sizeof(int32_t) * (size_t)(2 * n) + 4);
            kvd_attn_sparse_args sa = {in.a.dims, in.a.q, in.a.k, in.a.v, t2(KVD_DTYPE_I32, idx, 2, n), in.a.out,
                                       in.a.lse};
            kvd_attn_sparse_args sd = {in.a.dims, dt_of(in.a.q), dt_of(in.a.k), dt_of(in.a.v),
                                       dt_of(sa.idx), rout(&rs, 1), rlse(&rs, 1)};
            kvd_error e;
            TU_CHECK(kvd_attn_sparse(ref, 1, &sa, &e) == 0, "sparse ref: %s", e.msg);
            TU_CHECK(kvd_attn_sparse(dut, 1, &sd, &e) == 0, "sparse dut: %s", e.msg);
            sync_dut();
            char what[96];
            snprintf(what, sizeof what, "sparse n=%d G=%d %s", n, c.G, kvd_dtype_name(c.dt));
            compare(what, &rs, 1e-9, 1e-4);
            if (n >= 37) {
                /* an index outside [0, T): KVD_EINVAL, no output written */
                idx[n + 3] = 3000;
                kvd_backend_upload(dut, dev_of(idx), idx, sizeof(int32_t) * (size_t)(2 * n), &e);
                TU_CHECK(kvd_attn_sparse(dut, 1, &sd, &e) == KVD_EINVAL, "%s: bad index accepted", what);
                idx[n + 3] = -1;
                kvd_backend_upload(dut, dev_of(idx), idx, sizeof(int32_t) * (size_t)(2 * n), &e);
                TU_CHECK(kvd_attn_sparse(dut, 1, &sd, &e) == KVD_EINVAL, "%s: negative index accepted", what);
                compare("sparse after rejected calls", &rs, 1e-9, 1e-4);
            }
            res_free(&rs);
            free(in.q), free(in.k), free(in.v), free(idx);
            mirrors_free();
        }
}

/* ---- merge ------------------------------------------------------------- */

static void test_merge(tu_rng *r)
{
    const int Hq = 8, Dv = 128;
    float *oa = malloc(sizeof(float) * Hq * Dv), *ob = malloc(sizeof(float) * Hq * Dv), la[8], lb[8];
    tu_fill_normal(r, oa, (size_t)Hq * Dv, 1.0f);
    tu_fill_normal(r, ob, (size_t)Hq * Dv, 1.0f);
    tu_fill_normal(r, la, 8, 3.0f);
    tu_fill_normal(r, lb, 8, 3.0f);
    la[1] = -INFINITY;             /* empty side */
    la[2] = lb[2] = -INFINITY;     /* both empty */
    lb[3] = NAN;                   /* NaN side */
    la[4] = 80.0f, lb[4] = -80.0f; /* far apart */
    for (int alias = 0; alias < 2; alias++) {
        res rs = res_new(Hq, Dv);
        mirror(oa, sizeof(float) * Hq * Dv);
        mirror(ob, sizeof(float) * Hq * Dv);
        mirror(la, sizeof la);
        mirror(lb, sizeof lb);
        kvd_attn_merge_args ma = {t2(KVD_DTYPE_F32, oa, Hq, Dv), t1(KVD_DTYPE_F32, la, Hq),
                                  t2(KVD_DTYPE_F32, ob, Hq, Dv), t1(KVD_DTYPE_F32, lb, Hq),
                                  rout(&rs, 0), rlse(&rs, 0)};
        kvd_attn_merge_args md = {dt_of(ma.out_a), dt_of(ma.lse_a), dt_of(ma.out_b), dt_of(ma.lse_b),
                                  rout(&rs, 1), rlse(&rs, 1)};
        kvd_error e;
        TU_CHECK(kvd_attn_merge(ref, 1, &ma, &e) == 0, "merge ref: %s", e.msg);
        if (alias) {
            /* out/lse alias side a: the result is read back from a */
            md.out = md.out_a;
            md.lse = md.lse_a;
        }
        TU_CHECK(kvd_attn_merge(dut, 1, &md, &e) == 0, "merge dut: %s", e.msg);
        sync_dut();
        if (alias) {
            float *xo = malloc(sizeof(float) * Hq * Dv), xl[8];
            kvd_backend_download(dut, xo, md.out.data, sizeof(float) * Hq * Dv, &e);
            kvd_backend_download(dut, xl, md.lse.data, sizeof xl, &e);
            kvd_backend_upload(dut, dptr(&rs.o), xo, sizeof(float) * Hq * Dv, &e);
            kvd_backend_upload(dut, dptr(&rs.l), xl, sizeof xl, &e);
            free(xo);
        }
        compare(alias ? "merge in place" : "merge", &rs, 1e-10, 1e-5);
        res_free(&rs);
        mirrors_free();
    }
    free(oa), free(ob);
}

/* ---- INT2 / INT4 --------------------------------------------------------- */

typedef struct qbuf {
    kvd_attn_qdata qd;
    uint8_t *codes;
    uint16_t *min, *scale, *sum;
    size_t cb, pn;
} qbuf;

static qbuf quantize_all(const float *x, int Hkv, int64_t T, int W, int bits, int group, int axis)
{
    qbuf b;
    memset(&b, 0, sizeof b);
    int64_t rows = axis == KVD_ATTN_AXIS_TOKEN ? T : W, along = axis == KVD_ATTN_AXIS_TOKEN ? W : T;
    b.cb = (size_t)(rows * along * bits / 8);
    b.pn = (size_t)(rows * along / group);
    b.codes = malloc(b.cb * Hkv + 16);
    b.min = malloc(2 * b.pn * Hkv + 16);
    b.scale = malloc(2 * b.pn * Hkv + 16);
    b.sum = malloc(2 * b.pn * Hkv + 16);
    for (int h = 0; h < Hkv; h++) {
        kvd_qtensor q;
        TU_CHECK(kvd_qtensor_init(&q, T, W, bits, group,
                                  axis == KVD_ATTN_AXIS_TOKEN ? KVD_QAXIS_TOKEN : KVD_QAXIS_CHANNEL, NULL,
                                  NULL) == 0,
                 "qtensor init");
        q.codes = b.codes + b.cb * h;
        q.min = b.min + b.pn * h;
        q.scale = b.scale + b.pn * h;
        q.sum = b.sum + b.pn * h;
        kvd_tensor xt = t2(KVD_DTYPE_F32, (void *)(x + (size_t)h * T * W), T, W);
        kvd_quantize_ref(&xt, &q, KVD_ROUND_NEAREST, 0);
    }
    b.qd.bits = bits;
    b.qd.group = group;
    b.qd.axis = axis;
    b.qd.codes = t3(KVD_DTYPE_U8, b.codes, Hkv, rows, along * bits / 8);
    b.qd.min = t3(KVD_DTYPE_F16, b.min, Hkv, rows, along / group);
    b.qd.scale = t3(KVD_DTYPE_F16, b.scale, Hkv, rows, along / group);
    b.qd.sum = t3(KVD_DTYPE_U16, b.sum, Hkv, rows, along / group);
    mirror(b.codes, b.cb * Hkv + 16);
    mirror(b.min, 2 * b.pn * Hkv + 16);
    mirror(b.scale, 2 * b.pn * Hkv + 16);
    mirror(b.sum, 2 * b.pn * Hkv + 16);
    return b;
}

static kvd_attn_qdata qdev(const kvd_attn_qdata *q)
{
    kvd_attn_qdata d = *q;
    d.codes = dt_of(d.codes);
    d.min = dt_of(d.min);
    d.scale = dt_of(d.scale);
    d.sum = dt_of(d.sum);
    return d;
}

static void qbuf_free(qbuf *b) { free(b->codes), free(b->min), free(b->scale), free(b->sum); }

typedef struct icase {
    int64_t T, Tt;
    int G, D, bits, kgroup, vgroup, vaxis, kaxis;
} icase;

typedef struct iinput {
    float *q, *k32, *v32, *kt32, *vt32;
    void *kt, *vt;
    qbuf kq, vq;
    kvd_attn_int_args a, d;
} iinput;

static void int_input(tu_rng *r, const icase *c, res *rs, iinput *in, int nan_head)
{
    int Hkv = 2, Hq = Hkv * c->G, D = c->D;
    in->q = gen_q(r, Hq, D);
    if (nan_head >= 0)
        in->q[(size_t)nan_head * D + 17] = NAN;
    in->k32 = gen_kv(r, Hkv, c->T, D, 1);
    in->v32 = gen_kv(r, Hkv, c->T, D, 0);
    in->kt32 = gen_kv(r, Hkv, c->Tt, D, 1);
    in->vt32 = gen_kv(r, Hkv, c->Tt, D, 0);
    in->kt = to_dtype(in->kt32, (size_t)(Hkv * c->Tt * D), KVD_DTYPE_F16);
    in->vt = to_dtype(in->vt32, (size_t)(Hkv * c->Tt * D), KVD_DTYPE_F16);
    mirror(in->q, sizeof(float) * (size_t)Hq * D);
    mirror(in->kt, 2 * (size_t)(Hkv * c->Tt * D) + 16);
    mirror(in->vt, 2 * (size_t)(Hkv * c->Tt * D) + 16);
    in->kq = quantize_all(in->k32, Hkv, c->T, D, c->bits, c->kgroup, c->kaxis);
    in->vq = quantize_all(in->v32, Hkv, c->T, D, c->bits, c->vgroup, c->vaxis);
    kvd_attn_int_args *a = &in->a;
    memset(a, 0, sizeof *a);
    a->dims = dims(Hq, Hkv, D, D);
    a->q = t2(KVD_DTYPE_F32, in->q, Hq, D);
    a->n_tokens = c->T;
    a->k = in->kq.qd;
    a->v = in->vq.qd;
    a->k_tail = t3(KVD_DTYPE_F16, in->kt, Hkv, c->Tt, D);
    a->v_tail = t3(KVD_DTYPE_F16, in->vt, Hkv, c->Tt, D);
    a->out = rout(rs, 0);
    a->lse = rlse(rs, 0);
    in->d = *a;
    in->d.q = dt_of(a->q);
    in->d.k = qdev(&a->k);
    in->d.v = qdev(&a->v);
    in->d.k_tail = dt_of(a->k_tail);
    in->d.v_tail = dt_of(a->v_tail);
    in->d.out = rout(rs, 1);
    in->d.lse = rlse(rs, 1);
}

static void int_free(iinput *in)
{
    free(in->q), free(in->k32), free(in->v32), free(in->kt32), free(in->vt32), free(in->kt), free(in->vt);
    qbuf_free(&in->kq), qbuf_free(&in->vq);
}

static void int_batch(tu_rng *r, const char *name, const icase *cs0, int n, int nan_head)
{
    icase *cs = malloc(sizeof(icase) * (size_t)n);
    for (int i = 0; i < n; i++) {
        cs[i] = cs0[i];
        cs[i].T = capT(cs[i].T);
    }
    iinput *in = malloc(sizeof(iinput) * (size_t)n);
    res *rs = malloc(sizeof(res) * (size_t)n);
    kvd_attn_int_args *ra = malloc(sizeof *ra * (size_t)n), *da = malloc(sizeof *da * (size_t)n);
    for (int i = 0; i < n; i++) {
        rs[i] = res_new(2 * cs[i].G, cs[i].D);
        int_input(r, &cs[i], &rs[i], &in[i], nan_head);
        ra[i] = in[i].a;
        da[i] = in[i].d;
    }
    kvd_error e;
    TU_CHECK(kvd_attn_quant(ref, n, ra, &e) == 0, "%s: ref: %s", name, e.msg);
    TU_CHECK(kvd_attn_quant(dut, n, da, &e) == 0, "%s: dut: %s", name, e.msg);
    sync_dut();
    for (int i = 0; i < n; i++) {
        const icase *c = &cs[i];
        char what[192];
        snprintf(what, sizeof what, "%s item %d: INT%d T=%lld+%lld G=%d D=%d P=%d/%d K %s V %s", name, i, c->bits,
                 (long long)c->T, (long long)c->Tt, c->G, c->D, c->kgroup, c->vgroup,
                 c->kaxis == KVD_ATTN_AXIS_CHANNEL ? "channel" : "token",
                 c->vaxis == KVD_ATTN_AXIS_CHANNEL ? "channel" : "token");
        compare(what, &rs[i], long_tol(1e-6, c->T), 1e-4);
        res_free(&rs[i]);
        int_free(&in[i]);
    }
    mirrors_free();
    free(in), free(rs), free(ra), free(da), free(cs);
}

static void test_int(tu_rng *r)
{
    const int CH = KVD_ATTN_AXIS_CHANNEL, TK = KVD_ATTN_AXIS_TOKEN;
    const icase cases[] = {
        {0, 0, 4, 128, 2, 32, 32, CH, TK},     {0, 5, 4, 128, 2, 32, 32, CH, TK},
        {32, 0, 1, 128, 2, 32, 32, CH, TK},    {256, 3, 4, 128, 2, 32, 32, CH, TK},
        {512, 17, 8, 128, 2, 64, 64, CH, TK},  {384, 1, 4, 128, 2, 128, 128, CH, TK},
        {640, 0, 4, 64, 2, 32, 32, CH, TK},    {256, 9, 4, 128, 4, 32, 32, CH, TK},
        {512, 0, 8, 128, 4, 64, 128, CH, TK},  {256, 2, 1, 64, 4, 64, 64, CH, TK},
        {300, 4, 4, 128, 2, 32, 32, TK, TK},   {77, 0, 8, 64, 4, 64, 32, TK, TK},
        {1, 1, 4, 128, 2, 128, 64, TK, TK},    {0, 4, 4, 128, 2, 32, 32, CH, CH},
        {256, 3, 4, 128, 2, 32, 32, CH, CH},   {512, 0, 8, 128, 2, 64, 64, CH, CH},
        {640, 2, 4, 128, 2, 128, 32, CH, CH},  {96, 0, 1, 128, 2, 32, 32, TK, CH},
        {256, 1, 4, 64, 2, 32, 64, CH, CH},    {384, 5, 4, 64, 4, 32, 128, CH, CH},
        {256, 0, 2, 96, 4, 64, 32, TK, CH},    {32, 0, 4, 128, 4, 32, 32, CH, CH},
        {1024, 0, 4, 128, 2, 32, 32, CH, TK},  {1024, 0, 4, 128, 4, 64, 64, CH, TK},
        {480, 3, 6, 128, 2, 32, 32, CH, TK},   {416, 0, 16, 64, 2, 32, 32, CH, TK},
        /* small groups (8, 16) for small heads, on either axis */
        {256, 3, 4, 32, 2, 8, 8, CH, TK},      {256, 0, 4, 16, 4, 16, 16, CH, CH},
        {128, 2, 2, 32, 2, 16, 8, TK, CH},     {96, 1, 4, 8, 2, 8, 16, CH, TK},
        {512, 0, 4, 128, 2, 8, 16, CH, TK},    {256, 5, 4, 64, 4, 8, 8, TK, CH},
        {320, 0, 8, 128, 2, 16, 8, CH, CH},
        /* keys per channel, INT4, 8 heads per unit: int_kernel<14, 8, 128> */
        {512, 0, 8, 128, 4, 32, 64, CH, CH},   {2048, 3, 8, 128, 4, 64, 32, CH, CH},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++)
        int_batch(r, "shape", &cases[i], 1, -1);
    /* long: split over tokens (coded tokens and the tail merged in-launch) */
    const icase lc[] = {{33024, 7, 4, 128, 2, 32, 32, CH, TK},
                        {33024, 0, 8, 64, 4, 64, 128, CH, TK},
                        {32768, 100, 4, 128, 2, 32, 32, CH, CH}};
    for (size_t i = 0; i < sizeof lc / sizeof *lc; i++)
        int_batch(r, "long", &lc[i], 1, -1);
    /* one call, mixed lengths and layouts */
    const icase mix[] = {{0, 0, 4, 128, 2, 32, 32, CH, TK},    {0, 3, 4, 128, 2, 32, 32, CH, TK},
                         {4096, 0, 4, 128, 2, 32, 32, CH, TK}, {256, 200, 4, 128, 2, 32, 32, CH, TK},
                         {16384, 1, 4, 128, 2, 32, 32, CH, TK}, {300, 2, 4, 128, 4, 32, 32, TK, TK}};
    int_batch(r, "mixed batch", mix, (int)(sizeof mix / sizeof *mix), -1);
    /* NaN in query head 5 (kv head 1): exactly that head is NaN */
    const icase nc[] = {{512, 0, 4, 128, 2, 32, 32, CH, TK}, {512, 0, 4, 128, 2, 32, 32, CH, CH},
                        {20480, 3, 4, 128, 2, 32, 32, CH, TK}};
    for (size_t i = 0; i < sizeof nc / sizeof *nc; i++)
        int_batch(r, "NaN", &nc[i], 1, 5);
}

/* ---- VQ ------------------------------------------------------------------ */

typedef struct vcase {
    int64_t T, Tt;
    int G, D, dk, bk, dv, bv, had, lam;
} vcase;

/* vq_input's inputs: every 7th token gets probability exactly 0 and an Inf
 * value codeword (set by the test that wants it) */
static int vq_inf0;

typedef struct vinput {
    float *q, *kcb, *vcb, *lam, *kt, *vt;
    void *kc, *vc;
    kvd_attn_vq_args a, d;
} vinput;

/* Code i of a u8 (es 1) or u16 (es 2) code array. */
static void put_code(void *codes, size_t es, size_t i, uint32_t x)
{
    if (es == 1)
        ((uint8_t *)codes)[i] = (uint8_t)x;
    else
        ((uint16_t *)codes)[i] = (uint16_t)x;
}

static void vq_input(tu_rng *r, const vcase *c, res *rs, vinput *in)
{
    int Hkv = 2, Hq = Hkv * c->G, D = c->D, Kk = 1 << c->bk, Kv = 1 << c->bv;
    int kpos = D / c->dk, vpos = D / c->dv;
    size_t kes = c->bk <= 8 ? 1 : 2, ves = c->bv <= 8 ? 1 : 2;
    in->q = gen_q(r, Hq, D);
    in->kc = malloc(kes * Hkv * c->T * kpos + 8);
    in->vc = malloc(ves * Hkv * c->T * vpos + 8);
    in->kcb = malloc(sizeof(float) * Hkv * Kk * c->dk);
    in->vcb = malloc(sizeof(float) * Hkv * Kv * c->dv);
    in->lam = malloc(sizeof(float) * Hkv * D);
    tu_fill_normal(r, in->kcb, (size_t)Hkv * Kk * c->dk, 1.0f);
    tu_fill_normal(r, in->vcb, (size_t)Hkv * Kv * c->dv, 1.0f);
    tu_fill_uniform(r, in->lam, (size_t)Hkv * D, 0.5f, 3.0f);
    for (int64_t i = 0; i < Hkv * c->T * kpos; i++)
        put_code(in->kc, kes, (size_t)i, tu_rng_below(r, (uint32_t)Kk));
    for (int64_t i = 0; i < Hkv * c->T * vpos; i++)
        put_code(in->vc, ves, (size_t)i, tu_rng_below(r, (uint32_t)Kv));
    if (vq_inf0) {
        /* (no Hadamard, no smoothing) positive query values on position 0
         * and key codeword 0 = -1e30: a token with key code 0 there scores
         * so low that its probability is exactly 0; its value codeword 0
         * holds an Inf, which must add nothing (never 0 x Inf). Every other
         * token uses neither codeword 0 anywhere. */
        for (int h = 0; h < Hq; h++)
            for (int j = 0; j < c->dk; j++)
                in->q[(size_t)h * D + j] = fabsf(in->q[(size_t)h * D + j]) + 0.5f;
        for (int h = 0; h < Hkv; h++) {
            for (int j = 0; j < c->dk; j++)
                in->kcb[(size_t)h * Kk * c->dk + j] = -1e30f;
            in->vcb[(size_t)h * Kv * c->dv] = INFINITY;
            for (int64_t t = 0; t < c->T; t++) {
                int zero = t % 7 == 3;
                for (int pos = 0; pos < kpos; pos++)
                    put_code(in->kc, kes, (size_t)(h * c->T + t) * kpos + pos,
                             zero && pos == 0 ? 0 : 1 + tu_rng_below(r, (uint32_t)Kk - 1));
                for (int pos = 0; pos < vpos; pos++)
                    put_code(in->vc, ves, (size_t)(h * c->T + t) * vpos + pos,
                             zero && pos == 0 ? 0 : 1 + tu_rng_below(r, (uint32_t)Kv - 1));
            }
        }
    }
    in->kt = gen_kv(r, Hkv, c->Tt, D, 1);
    in->vt = gen_kv(r, Hkv, c->Tt, D, 0);
    mirror(in->q, sizeof(float) * (size_t)Hq * D);
    mirror(in->kc, kes * Hkv * c->T * kpos + 8);
    mirror(in->vc, ves * Hkv * c->T * vpos + 8);
    mirror(in->kcb, sizeof(float) * Hkv * Kk * c->dk);
    mirror(in->vcb, sizeof(float) * Hkv * Kv * c->dv);
    mirror(in->lam, sizeof(float) * Hkv * D);
    mirror(in->kt, sizeof(float) * (size_t)(Hkv * c->Tt * D) + 16);
    mirror(in->vt, sizeof(float) * (size_t)(Hkv * c->Tt * D) + 16);
    kvd_attn_vq_args *a = &in->a;
    memset(a, 0, sizeof *a);
    a->dims = dims(Hq, Hkv, D, D);
    a->q = t2(KVD_DTYPE_F32, in->q, Hq, D);
    a->n_tokens = c->T;
    a->k_sub_dim = c->dk;
    a->k_bits = c->bk;
    a->k_codes = t3(kes == 1 ? KVD_DTYPE_U8 : KVD_DTYPE_U16, in->kc, Hkv, c->T, kpos);
    a->k_codebook = t3(KVD_DTYPE_F32, in->kcb, Hkv, Kk, c->dk);
    if (c->lam)
        a->k_lambda = t2(KVD_DTYPE_F32, in->lam, Hkv, D);
    a->k_hadamard = c->had;
    a->v_sub_dim = c->dv;
    a->v_bits = c->bv;
    a->v_codes = t3(ves == 1 ? KVD_DTYPE_U8 : KVD_DTYPE_U16, in->vc, Hkv, c->T, vpos);
    a->v_codebook = t3(KVD_DTYPE_F32, in->vcb, Hkv, Kv, c->dv);
    a->k_tail = t3(KVD_DTYPE_F32, in->kt, Hkv, c->Tt, D);
    a->v_tail = t3(KVD_DTYPE_F32, in->vt, Hkv, c->Tt, D);
    a->out = rout(rs, 0);
    a->lse = rlse(rs, 0);
    in->d = *a;
    in->d.q = dt_of(a->q);
    in->d.k_codes = dt_of(a->k_codes);
    in->d.k_codebook = dt_of(a->k_codebook);
    in->d.k_lambda = dt_of(a->k_lambda);
    in->d.v_codes = dt_of(a->v_codes);
    in->d.v_codebook = dt_of(a->v_codebook);
    in->d.k_tail = dt_of(a->k_tail);
    in->d.v_tail = dt_of(a->v_tail);
    in->d.out = rout(rs, 1);
    in->d.lse = rlse(rs, 1);
}

static void vq_free(vinput *in)
{
    free(in->q), free(in->kcb), free(in->vcb), free(in->lam), free(in->kt), free(in->vt), free(in->kc),
        free(in->vc);
}

static void vq_batch(tu_rng *r, const char *name, const vcase *cs0, int n)
{
    vcase *cs = malloc(sizeof(vcase) * (size_t)n);
    for (int i = 0; i < n; i++) {
        cs[i] = cs0[i];
        cs[i].T = capT(cs[i].T);
    }
    vinput *in = malloc(sizeof(vinput) * (size_t)n);
    res *rs = malloc(sizeof(res) * (size_t)n);
    kvd_attn_vq_args *ra = malloc(sizeof *ra * (size_t)n), *da = malloc(sizeof *da * (size_t)n);
    for (int i = 0; i < n; i++) {
        rs[i] = res_new(2 * cs[i].G, cs[i].D);
        vq_input(r, &cs[i], &rs[i], &in[i]);
        ra[i] = in[i].a;
        da[i] = in[i].d;
    }
    kvd_error e;
    TU_CHECK(kvd_attn_vq(ref, n, ra, &e) == 0, "%s: ref: %s", name, e.msg);
    TU_CHECK(kvd_attn_vq(dut, n, da, &e) == 0, "%s: dut: %s", name, e.msg);
    sync_dut();
    for (int i = 0; i < n; i++) {
        const vcase *c = &cs[i];
        char what[160];
        snprintf(what, sizeof what, "%s item %d: VQ T=%lld+%lld G=%d D=%d k d%db%d v d%db%d had %d lam %d", name, i,
                 (long long)c->T, (long long)c->Tt, c->G, c->D, c->dk, c->bk, c->dv, c->bv, c->had, c->lam);
        compare(what, &rs[i], long_tol(1e-9, c->T), 1e-4);
        res_free(&rs[i]);
        vq_free(&in[i]);
    }
    mirrors_free();
    free(in), free(rs), free(ra), free(da), free(cs);
}

static void test_vq(tu_rng *r)
{
    const vcase cases[] = {
        {0, 0, 4, 128, 4, 8, 4, 8, 1, 1},   {1, 0, 4, 128, 4, 8, 4, 8, 1, 1},  {700, 3, 4, 128, 4, 8, 4, 8, 1, 1},
        {300, 0, 8, 128, 8, 12, 8, 12, 1, 1}, {257, 5, 1, 64, 4, 8, 2, 6, 0, 0}, {513, 0, 8, 64, 2, 4, 4, 8, 1, 0},
        {0, 9, 4, 128, 4, 8, 4, 8, 1, 1},   {1000, 0, 1, 128, 4, 8, 4, 8, 1, 1},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++)
        vq_batch(r, "shape", &cases[i], 1);
    const vcase lc[] = {{33000, 2, 4, 128, 4, 8, 4, 8, 1, 1}, {33001, 0, 8, 64, 4, 8, 4, 8, 0, 1}};
    for (size_t i = 0; i < sizeof lc / sizeof *lc; i++)
        vq_batch(r, "long", &lc[i], 1);
    const vcase mix[] = {{0, 0, 4, 128, 4, 8, 4, 8, 1, 1},    {5, 2, 4, 128, 4, 8, 4, 8, 1, 1},
                         {8192, 0, 4, 128, 4, 8, 4, 8, 1, 1}, {300, 0, 4, 128, 4, 8, 4, 8, 1, 1},
                         {20000, 7, 4, 128, 4, 8, 4, 8, 1, 1}};
    vq_batch(r, "mixed batch", mix, (int)(sizeof mix / sizeof *mix));
    /* a zero probability meets an Inf value codeword: nothing is added */
    const vcase zc[] = {{2000, 0, 4, 128, 4, 8, 4, 8, 0, 0},
                        {700, 3, 2, 128, 4, 8, 8, 8, 0, 0},
                        {3000, 0, 4, 64, 4, 12, 4, 8, 0, 0}};
    vq_inf0 = 1;
    for (size_t i = 0; i < sizeof zc / sizeof *zc; i++)
        vq_batch(r, "zero p, Inf codeword", &zc[i], 1);
    vq_inf0 = 0;
}

/* ---- SVD ----------------------------------------------------------------- */

static void svd_case(tu_rng *r, const char *name, int Hkv, int G, int D, int64_t T, const int32_t *kw,
                     const int32_t *vw, kvd_dtype dt)
{
    T = capT(T);
    int Hq = Hkv * G;
    int64_t sk = 0, sv = 0;
    for (int h = 0; h < Hkv; h++)
        sk += kw[h], sv += vw[h];
    float *q = gen_q(r, Hq, D), *Rk = malloc(sizeof(float) * Hkv * D * D), *Rv = malloc(sizeof(float) * Hkv * D * D);
    tu_fill_normal(r, Rk, (size_t)Hkv * D * D, 1.0f / sqrtf((float)D));
    tu_fill_normal(r, Rv, (size_t)Hkv * D * D, 1.0f / sqrtf((float)D));
    float *kr32 = malloc(sizeof(float) * (size_t)(T * sk) + 16), *vr32 = malloc(sizeof(float) * (size_t)(T * sv) + 16);
    tu_fill_normal(r, kr32, (size_t)(T * sk), 1.0f);
    tu_fill_normal(r, vr32, (size_t)(T * sv), 1.0f);
    void *kr = to_dtype(kr32, (size_t)(T * sk), dt), *vr = to_dtype(vr32, (size_t)(T * sv), dt);
    size_t es = kvd_dtype_size(dt);
    mirror(q, sizeof(float) * (size_t)Hq * D);
    mirror(Rk, sizeof(float) * Hkv * D * D);
    mirror(Rv, sizeof(float) * Hkv * D * D);
    mirror(kr, es * (size_t)(T * sk) + 16);
    mirror(vr, es * (size_t)(T * sv) + 16);
    res rs = res_new(Hq, D);
    kvd_attn_svd_args a;
    memset(&a, 0, sizeof a);
    a.dims = dims(Hq, Hkv, D, D);
    a.q = t2(KVD_DTYPE_F32, q, Hq, D);
    a.rk = t3(KVD_DTYPE_F32, Rk, Hkv, D, D);
    a.rv = t3(KVD_DTYPE_F32, Rv, Hkv, D, D);
    a.k_width = kw;
    a.v_width = vw;
    a.n_tokens = T;
    a.dtype = dt;
    a.k_red = kr;
    a.v_red = vr;
    a.out = rout(&rs, 0);
    a.lse = rlse(&rs, 0);
    kvd_attn_svd_args d = a;
    d.q = dt_of(a.q);
    d.rk = dt_of(a.rk);
    d.rv = dt_of(a.rv);
    d.k_red = dev_of(kr);
    d.v_red = dev_of(vr);
    d.out = rout(&rs, 1);
    d.lse = rlse(&rs, 1);
    kvd_error e;
    TU_CHECK(kvd_attn_svd(ref, 1, &a, &e) == 0, "%s: ref: %s", name, e.msg);
    TU_CHECK(kvd_attn_svd(dut, 1, &d, &e) == 0, "%s: dut: %s", name, e.msg);
    sync_dut();
    char what[128];
    snprintf(what, sizeof what, "%s: SVD T=%lld G=%d D=%d %s", name, (long long)T, G, D, kvd_dtype_name(dt));
    compare(what, &rs, long_tol(1e-9, T), 1e-4);
    res_free(&rs);
    mirrors_free();
    free(q), free(Rk), free(Rv), free(kr32), free(vr32), free(kr), free(vr);
}

static void test_svd(tu_rng *r)
{
    const int32_t full[4] = {128, 128, 128, 128}, rag[4] = {24, 40, 128, 7}, ragv[4] = {32, 16, 64, 100},
                  zero[4] = {0, 64, 0, 13}, zerov[4] = {16, 0, 128, 0};
    svd_case(r, "full", 2, 4, 128, 300, full, full, KVD_DTYPE_F32);
    svd_case(r, "ragged", 4, 4, 128, 1000, rag, ragv, KVD_DTYPE_F16);
    svd_case(r, "ragged bf16 G8", 4, 8, 128, 777, rag, ragv, KVD_DTYPE_BF16);
    svd_case(r, "zero widths", 4, 2, 128, 129, zero, zerov, KVD_DTYPE_F32);
    svd_case(r, "empty", 4, 4, 128, 0, rag, ragv, KVD_DTYPE_F16);
    svd_case(r, "one token", 4, 1, 128, 1, rag, ragv, KVD_DTYPE_F16);
    svd_case(r, "long", 4, 4, 128, 33000, rag, ragv, KVD_DTYPE_F16);
    const int32_t w64[2] = {64, 64};
    svd_case(r, "full 64", 2, 8, 64, 2048, w64, w64, KVD_DTYPE_F16);
}

/* ---- driver --------------------------------------------------------------- */

static void run_all(void)
{
    tu_rng r;
    tu_rng_seed(&r, 4321);
    test_dense(&r);
    test_dense_nonfinite(&r);
    test_sparse(&r);
    test_merge(&r);
    test_int(&r);
    test_vq(&r);
    test_svd(&r);
}

int main(int argc, char **argv)
{
    int self_check = argc > 1 && strcmp(argv[1], "--self-check") == 0;
    ref = tu_cpu_backend(1, 1);
    kvd_error err;
    kvd_error_clear(&err);
    kvd_backend *cuda = NULL;
    int rc = self_check ? KVD_EUNAVAIL : kvd_backend_cuda_create(-1, &cuda, &err);
#ifdef KVD_CUDA_EMU
    /* test_cuda_attn_emu: the backend on the CPU emulation of CUDA
     * (tests/backend/cuda_emu), always present; shorter sequences. */
    max_T = 4096;
    if (rc != KVD_OK) {
        fprintf(stderr, "emulated cuda backend: %s\n", err.msg);
        return 1;
    }
#endif
    if (rc == KVD_OK) {
        dut = cuda;
        run_all();
        kvd_backend_free(cuda);
        kvd_backend_free(ref);
        return tu_report("cuda_attn");
    }
    if (rc != KVD_EUNAVAIL && rc != KVD_EUNSUPP) {
        fprintf(stderr, "cuda backend: %s\n", err.msg);
        return 1;
    }
    /* No device: check the harness itself, the CPU fast path as the device. */
    dut = tu_cpu_backend(2, 0);
    run_all();
    kvd_backend_free(dut);
    kvd_backend_free(ref);
    int st = tu_report("cuda_attn self-check (cpu fast path vs reference)");
    if (st != 0 || self_check)
        return st;
    printf("skipped: %s\n", err.msg);
    return 77;
}
