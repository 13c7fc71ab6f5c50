/*
 * Decode attention on every cache form: fast paths against the references,
 * the references against the equations they implement (hand cases,
 * dequantize-then-attend with the same int8 rounding, decode-then-attend for
 * VQ, full-width SVD = dense), LSE merge = attention over the union, sparse
 * over all tokens = dense, empty ranges, NaN/Inf parity, guard bytes.
 */
#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kvdepot/attention.h"
#include "kvdepot/quant.h"
#include "kvdepot/svd.h"
#include "testutil.h"

static kvd_backend *be_fast, *be_ref;

/* ---- problem setup ---------------------------------------------------- */

typedef struct prob {
    int Hq, Hkv, D, Dv;
    int64_t T;
    kvd_dtype dt;
    float *q;         /* (Hq, D) */
    float *k32, *v32; /* (Hkv, T, D) / (Hkv, T, Dv) f32 values (already rounded to dt) */
    void *k, *v;      /* in dt */
} prob;

static void *to_dtype(const float *x, size_t n, kvd_dtype dt)
{
    size_t es = kvd_dtype_size(dt);
    void *out = malloc(n * es + 16);
    if (dt == KVD_DTYPE_F32)
        memcpy(out, x, n * 4);
    else if (dt == KVD_DTYPE_F16)
        tu_f32_to_f16(out, x, n);
    else
        tu_f32_to_bf16(out, x, n);
    return out;
}

static void round_to(float *x, size_t n, kvd_dtype dt)
{
    void *tmp = to_dtype(x, n, dt);
    if (dt == KVD_DTYPE_F16)
        tu_f16_to_f32(x, tmp, n);
    else if (dt == KVD_DTYPE_BF16)
        tu_bf16_to_f32(x, tmp, n);
    free(tmp);
}

static prob prob_new(tu_rng *r, int Hq, int Hkv, int D, int Dv, int64_t T, kvd_dtype dt, int llm)
{
    prob p = {Hq, Hkv, D, Dv, T, dt, NULL, NULL, NULL, NULL, NULL};
    p.q = malloc(sizeof(float) * (size_t)Hq * D + 16);
    p.k32 = malloc(sizeof(float) * (size_t)(Hkv * T * D) + 16);
    p.v32 = malloc(sizeof(float) * (size_t)(Hkv * T * Dv) + 16);
    tu_fill_normal(r, p.q, (size_t)Hq * D, 1.0f);
    tu_kv_opts ko = {4, 10.0f, 0.3f, 1}, vo = {0, 1.0f, 0.2f, 0};
    for (int h = 0; h < Hkv; h++) {
        if (llm) {
            tu_gen_kv(r, p.k32 + (size_t)h * T * D, T, D, &ko);
            tu_gen_kv(r, p.v32 + (size_t)h * T * Dv, T, Dv, &vo);
        } else {
            tu_fill_normal(r, p.k32 + (size_t)h * T * D, (size_t)(T * D), 1.0f);
            tu_fill_normal(r, p.v32 + (size_t)h * T * Dv, (size_t)(T * Dv), 1.0f);
        }
    }
    round_to(p.k32, (size_t)(Hkv * T * D), dt);
    round_to(p.v32, (size_t)(Hkv * T * Dv), dt);
    p.k = to_dtype(p.k32, (size_t)(Hkv * T * D), dt);
    p.v = to_dtype(p.v32, (size_t)(Hkv * T * Dv), dt);
    return p;
}

static void prob_free(prob *p)
{
    free(p->q), free(p->k32), free(p->v32), free(p->k), free(p->v);
}

static kvd_attn_dims dims_of(const prob *p)
{
    kvd_attn_dims d = {p->Hq, p->Hkv, p->D, p->Dv, 1.0f / sqrtf((float)p->D)};
    return d;
}

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

static kvd_tensor t1(kvd_dtype dt, void *data, int64_t a)
{
    return kvd_tensor_make(dt, data, 1, &a);
}

typedef struct res {
    tu_buf out, lse;
} res;

static res res_new(int Hq, int Dv)
{
    res r = {tu_buf_new(sizeof(float) * (size_t)Hq * Dv + 4), tu_buf_new(sizeof(float) * (size_t)Hq)};
    return r;
}

static void res_free(res *r)
{
    tu_buf_free(&r->out);
    tu_buf_free(&r->lse);
}

/* Compare two results; tolerances on NMSE of out and on the lse difference,
 * relative to the lse where it exceeds 1 (float sums of scores near 100
 * carry errors of a few of their ulps, 1.5e-5 there). */
static void compare(const char *what, const res *ref, const res *x, int Hq, int Dv, double nmse_tol,
                    double lse_tol)
{
    size_t n = (size_t)Hq * Dv;
    const float *ro = ref->out.data, *xo = x->out.data, *rl = ref->lse.data, *xl = x->lse.data;
    double e = tu_nmse(ro, xo, n);
    TU_CHECK(e <= nmse_tol, "%s: out NMSE %.3g > %.3g", what, e, nmse_tol);
    TU_CHECK(tu_nonfinite_parity(ro, xo, n) < 0, "%s: out NaN/Inf parity", what);
    TU_CHECK(tu_nonfinite_parity(rl, xl, (size_t)Hq) < 0, "%s: lse NaN/Inf parity", what);
    double dl = 0;
    for (int h = 0; h < Hq; h++)
        if (isfinite(rl[h]) && isfinite(xl[h])) {
            double d = fabs((double)xl[h] - rl[h]) / fmax(1.0, fabs((double)rl[h]));
            dl = d > dl ? d : dl;
        }
    TU_CHECK(dl <= lse_tol, "%s: lse diff %.3g > %.3g", what, dl, lse_tol);
    TU_CHECK(tu_guard_ok(&x->out) && tu_guard_ok(&x->lse), "%s: guard bytes", what);
}

static int run_dense(kvd_backend *be, const prob *p, const res *r, int64_t t_begin, int64_t t_end)
{
    kvd_attn_dense_args a;
    memset(&a, 0, sizeof a);
    a.dims = dims_of(p);
    a.q = t2(KVD_DTYPE_F32, p->q, p->Hq, p->D);
    size_t es = kvd_dtype_size(p->dt);
    /* a token sub-range is a strided view: same strides, shifted data */
    a.k = t3(p->dt, p->k, p->Hkv, p->T, p->D);
    a.v = t3(p->dt, p->v, p->Hkv, p->T, p->Dv);
    a.k.data = (char *)p->k + t_begin * p->D * es;
    a.v.data = (char *)p->v + t_begin * p->Dv * es;
    a.k.shape[1] = a.v.shape[1] = t_end - t_begin;
    a.out = t2(KVD_DTYPE_F32, r->out.data, p->Hq, p->Dv);
    a.lse = t1(KVD_DTYPE_F32, r->lse.data, p->Hq);
    kvd_error err;
    int rc = kvd_attn_dense(be, 1, &a, &err);
    TU_CHECK(rc == 0, "dense attention failed: %s", err.msg);
    return rc;
}

/* ---- hand-computed cases ---------------------------------------------- */

static void test_hand(void)
{
    /* q = [1, 0], k0 = [1, 0], k1 = [0, 0], v0 = [1, 2], v1 = [3, 4], scale 1:
     * scores (1, 0), lse = ln(e + 1), out = (e v0 + v1) / (e + 1). */
    float q[2] = {1, 0}, k[4] = {1, 0, 0, 0}, v[4] = {1, 2, 3, 4}, out[2], lse;
    for (int fast = 0; fast < 2; fast++) {
        kvd_attn_dense_args a = {{1, 1, 2, 2, 1.0f},
                                 t2(KVD_DTYPE_F32, q, 1, 2),
                                 t3(KVD_DTYPE_F32, k, 1, 2, 2),
                                 t3(KVD_DTYPE_F32, v, 1, 2, 2),
                                 t2(KVD_DTYPE_F32, out, 1, 2),
                                 t1(KVD_DTYPE_F32, &lse, 1)};
        TU_CHECK(kvd_attn_dense(fast ? be_fast : be_ref, 1, &a, NULL) == 0, "hand dense");
        double e = exp(1.0);
        TU_CHECK(fabs(lse - log(e + 1)) < 1e-6, "hand lse %g", lse);
        TU_CHECK(fabs(out[0] - (e * 1 + 3) / (e + 1)) < 1e-6, "hand out0 %g", out[0]);
        TU_CHECK(fabs(out[1] - (e * 2 + 4) / (e + 1)) < 1e-6, "hand out1 %g", out[1]);
    }
    /* merge of (lse ln 1, out 1) and (lse ln 3, out 5): weights 1/4, 3/4 -> 4 */
    float oa = 1, ob = 5, la = 0, lb = logf(3), om, lm;
    kvd_attn_merge_args m = {t2(KVD_DTYPE_F32, &oa, 1, 1), t1(KVD_DTYPE_F32, &la, 1),
                             t2(KVD_DTYPE_F32, &ob, 1, 1), t1(KVD_DTYPE_F32, &lb, 1),
                             t2(KVD_DTYPE_F32, &om, 1, 1), t1(KVD_DTYPE_F32, &lm, 1)};
    for (int fast = 0; fast < 2; fast++) {
        TU_CHECK(kvd_attn_merge(fast ? be_fast : be_ref, 1, &m, NULL) == 0, "hand merge");
        TU_CHECK(fabsf(om - 4.0f) < 1e-6f && fabsf(lm - logf(4)) < 1e-6f, "hand merge %g %g", om, lm);
    }
    /* a -inf side contributes nothing */
    la = -INFINITY;
    oa = 0;
    TU_CHECK(kvd_attn_merge(be_fast, 1, &m, NULL) == 0, "merge -inf");
    TU_CHECK(om == 5.0f && fabsf(lm - logf(3)) < 1e-6f, "merge with empty side %g %g", om, lm);

    /* INT2 hand case: D = 32 (one group), q = e_0, key codes 3 at channel 0,
     * min -1, scale 0.5 -> k_0 = 0.5; q8 = [127, 0...], s_q = 1/127, so the
     * score is exactly 0.5 * scale. */
}

/* ---- dense: fast vs ref over many shapes ------------------------------ */

static void test_dense_shapes(tu_rng *rng)
{
    const int64_t Ts[] = {0, 1, 7, 255, 256, 257, 1000};
    const int Gs[] = {1, 4, 8, 20}, Ds[] = {64, 128}; /* 20: two passes of query heads */
    const kvd_dtype dts[] = {KVD_DTYPE_F32, KVD_DTYPE_F16, KVD_DTYPE_BF16};
    for (size_t ti = 0; ti < sizeof Ts / sizeof *Ts; ti++)
        for (size_t gi = 0; gi < 4; gi++)
            for (size_t di = 0; di < 2; di++)
                for (size_t ei = 0; ei < 3; ei++) {
                    int Hkv = 2, Hq = Hkv * Gs[gi];
                    prob p = prob_new(rng, Hq, Hkv, Ds[di], Ds[di], Ts[ti], dts[ei], 1);
                    res rr = res_new(Hq, p.Dv), rf = res_new(Hq, p.Dv);
                    run_dense(be_ref, &p, &rr, 0, p.T);
                    run_dense(be_fast, &p, &rf, 0, p.T);
                    char what[96];
                    snprintf(what, sizeof what, "dense T=%lld G=%d D=%d %s", (long long)p.T, Gs[gi],
                             p.D, kvd_dtype_name(p.dt));
                    compare(what, &rr, &rf, Hq, p.Dv, 1e-9, 1e-4);
                    if (p.T == 0) {
                        const float *l = rf.lse.data, *o = rf.out.data;
                        TU_CHECK(isinf(l[0]) && l[0] < 0 && o[0] == 0.0f, "%s: empty range", what);
                    }
                    res_free(&rr), res_free(&rf), prob_free(&p);
                }
    /* odd head_dim / v_dim take the portable path */
    prob p = prob_new(rng, 6, 3, 20, 12, 50, KVD_DTYPE_F16, 0);
    res rr = res_new(6, 12), rf = res_new(6, 12);
    run_dense(be_ref, &p, &rr, 0, p.T);
    run_dense(be_fast, &p, &rf, 0, p.T);
    compare("dense odd dims", &rr, &rf, 6, 12, 1e-9, 1e-4);
    res_free(&rr), res_free(&rf), prob_free(&p);
}

/* ---- several items in one call ------------------------------------------ */

/* Three copies of args a in one call of op on be_fast (its items side by
 * side): each output must have the bits of `alone`, a call of a by itself. */
#define ITEMS_AS_ALONE(argt, op, a, alone, what, Hq, D)                                            \
    do {                                                                                           \
        argt m3_[3];                                                                               \
        res rm_[3];                                                                                \
        kvd_error e_;                                                                              \
        const size_t on_ = sizeof(float) * (size_t)(Hq) * (D), ln_ = sizeof(float) * (size_t)(Hq); \
        for (int k_ = 0; k_ < 3; k_++) {                                                           \
            rm_[k_] = res_new(Hq, D);                                                              \
            m3_[k_] = a;                                                                           \
            m3_[k_].out = t2(KVD_DTYPE_F32, rm_[k_].out.data, Hq, D);                              \
            m3_[k_].lse = t1(KVD_DTYPE_F32, rm_[k_].lse.data, Hq);                                 \
        }                                                                                          \
        TU_CHECK(op(be_fast, 3, m3_, &e_) == 0, "%s: %s", what, e_.msg);                           \
        for (int k_ = 0; k_ < 3; k_++) {                                                           \
            TU_CHECK(memcmp(rm_[k_].out.data, (alone).out.data, on_) == 0 &&                       \
                         memcmp(rm_[k_].lse.data, (alone).lse.data, ln_) == 0,                     \
                     "%s: item %d of 3 in one call differs from one alone", what, k_);             \
            res_free(&rm_[k_]);                                                                    \
        }                                                                                          \
    } while (0)

/* The call `s` over segments (its out/lse set here), on the reference and
 * the fast backend: with `exact`, the reference gives the bits of rr (the
 * same tokens in one block) and the fast path rr within 1e-9; otherwise the
 * reference is within 1e-9 of rr and the fast path within 1e-6 of rf. Each
 * item of a three-item call has its bits alone, and segments that do not
 * add up to n_tokens are refused. */
#define SEGMENTS_AS_ONE(argt, op, s, rr, rf, exact, what, Hq, D)                                   \
    do {                                                                                           \
        res sr_ = res_new(Hq, D), sf_ = res_new(Hq, D);                                            \
        kvd_error e_;                                                                              \
        for (int fast_ = 0; fast_ < 2; fast_++) {                                                  \
            const res *r_ = fast_ ? &sf_ : &sr_;                                                   \
            (s).out = t2(KVD_DTYPE_F32, r_->out.data, Hq, D);                                      \
            (s).lse = t1(KVD_DTYPE_F32, r_->lse.data, Hq);                                         \
            TU_CHECK(op(fast_ ? be_fast : be_ref, 1, &(s), &e_) == 0, "%s segments: %s", what,     \
                     e_.msg);                                                                      \
        }                                                                                          \
        char sw_[192];                                                                             \
        snprintf(sw_, sizeof sw_, "%s, in %d segments", what, (s).n_segments);                     \
        if (exact)                                                                                 \
            TU_CHECK(memcmp(sr_.out.data, (rr).out.data, sizeof(float) * (size_t)(Hq) * (D)) ==    \
                             0 &&                                                                  \
                         memcmp(sr_.lse.data, (rr).lse.data, sizeof(float) * (size_t)(Hq)) == 0,   \
                     "%s: the reference differs from one block", sw_);                             \
        else                                                                                       \
            compare(sw_, &(rr), &sr_, Hq, D, 1e-9, 1e-4);                                          \
        compare(sw_, (exact) ? &(rr) : &(rf), &sf_, Hq, D, (exact) ? 1e-9 : 1e-6, 1e-4);           \
        ITEMS_AS_ALONE(argt, op, s, sf_, sw_, Hq, D);                                              \
        (s).n_tokens += 1;                                                                         \
        TU_CHECK(op(be_fast, 1, &(s), &e_) == KVD_EINVAL, "%s: n_tokens past the segments taken",  \
                 sw_);                                                                             \
        (s).n_tokens -= 1;                                                                         \
        res_free(&sr_), res_free(&sf_);                                                            \
    } while (0)

/* A call of at least as many items as the backend has threads runs its items
 * side by side, one thread each; every item's bits are those of a call of
 * that item alone (on every thread). The items are token ranges of one
 * cache, as a sequence's pages are. */
static void test_dense_items(tu_rng *rng)
{
    enum { NI = 5 };
    const int Hkv = 2, Hq = 8, D = 128;
    prob p = prob_new(rng, Hq, Hkv, D, D, 1100, KVD_DTYPE_F16, 1);
    const int64_t cut[NI + 1] = {0, 256, 512, 600, 856, 1100};
    res alone[NI], together[NI];
    kvd_attn_dense_args a[NI];
    for (int i = 0; i < NI; i++) {
        alone[i] = res_new(Hq, D);
        together[i] = res_new(Hq, D);
        run_dense(be_fast, &p, &alone[i], cut[i], cut[i + 1]);
        size_t es = kvd_dtype_size(p.dt);
        memset(&a[i], 0, sizeof a[i]);
        a[i].dims = dims_of(&p);
        a[i].q = t2(KVD_DTYPE_F32, p.q, Hq, D);
        a[i].k = t3(p.dt, p.k, Hkv, p.T, D);
        a[i].v = t3(p.dt, p.v, Hkv, p.T, D);
        a[i].k.data = (char *)p.k + cut[i] * D * es;
        a[i].v.data = (char *)p.v + cut[i] * D * es;
        a[i].k.shape[1] = a[i].v.shape[1] = cut[i + 1] - cut[i];
        a[i].out = t2(KVD_DTYPE_F32, together[i].out.data, Hq, D);
        a[i].lse = t1(KVD_DTYPE_F32, together[i].lse.data, Hq);
    }
    kvd_error err;
    TU_CHECK(kvd_attn_dense(be_fast, NI, a, &err) == 0, "dense items: %s", err.msg);
    for (int i = 0; i < NI; i++) {
        TU_CHECK(memcmp(alone[i].out.data, together[i].out.data, sizeof(float) * (size_t)Hq * D) ==
                         0 &&
                     memcmp(alone[i].lse.data, together[i].lse.data, sizeof(float) * Hq) == 0,
                 "dense item %d of %d: other bits than alone", i, NI);
        TU_CHECK(tu_guard_ok(&together[i].out) && tu_guard_ok(&together[i].lse),
                 "dense item %d: guard bytes", i);
        res_free(&alone[i]), res_free(&together[i]);
    }
    prob_free(&p);
}

/* ---- merge of two halves = attention over the union ------------------- */

static void test_merge(tu_rng *rng)
{
    const int64_t splits[] = {0, 1, 100, 300, 511, 512};
    prob p = prob_new(rng, 8, 2, 128, 128, 512, KVD_DTYPE_F16, 1);
    res all = res_new(8, 128);
    run_dense(be_ref, &p, &all, 0, p.T);
    for (size_t i = 0; i < sizeof splits / sizeof *splits; i++)
        for (int fast = 0; fast < 2; fast++) {
            res a = res_new(8, 128), b = res_new(8, 128), m = res_new(8, 128);
            kvd_backend *be = fast ? be_fast : be_ref;
            run_dense(be, &p, &a, 0, splits[i]);
            run_dense(be, &p, &b, splits[i], p.T);
            kvd_attn_merge_args ma = {t2(KVD_DTYPE_F32, a.out.data, 8, 128), t1(KVD_DTYPE_F32, a.lse.data, 8),
                                      t2(KVD_DTYPE_F32, b.out.data, 8, 128), t1(KVD_DTYPE_F32, b.lse.data, 8),
                                      t2(KVD_DTYPE_F32, m.out.data, 8, 128), t1(KVD_DTYPE_F32, m.lse.data, 8)};
            TU_CHECK(kvd_attn_merge(be, 1, &ma, NULL) == 0, "merge");
            char what[64];
            snprintf(what, sizeof what, "merge split %lld %s", (long long)splits[i], fast ? "fast" : "ref");
            compare(what, &all, &m, 8, 128, 1e-10, 1e-5);
            res_free(&a), res_free(&b), res_free(&m);
        }
    res_free(&all);
    prob_free(&p);
}

/* ---- sparse ------------------------------------------------------------ */

static void test_sparse(tu_rng *rng)
{
    for (int fast = 0; fast < 2; fast++) {
        prob p = prob_new(rng, 8, 2, 128, 128, 700, KVD_DTYPE_F16, 1);
        kvd_backend *be = fast ? be_fast : be_ref;
        /* all indices (shuffled order) = dense */
        int32_t *idx = malloc(sizeof(int32_t) * 2 * 700);
        for (int h = 0; h < 2; h++) {
            for (int i = 0; i < 700; i++)
                idx[h * 700 + i] = i;
            for (int i = 699; i > 0; i--) {
                int j = (int)tu_rng_below(rng, (uint32_t)i + 1);
                int32_t x = idx[h * 700 + i];
                idx[h * 700 + i] = idx[h * 700 + j];
                idx[h * 700 + j] = x;
            }
        }
        res d = res_new(8, 128), s = res_new(8, 128);
        run_dense(be_ref, &p, &d, 0, p.T);
        kvd_attn_sparse_args a = {dims_of(&p),
                                  t2(KVD_DTYPE_F32, p.q, 8, 128),
                                  t3(p.dt, p.k, 2, 700, 128),
                                  t3(p.dt, p.v, 2, 700, 128),
                                  t2(KVD_DTYPE_I32, idx, 2, 700),
                                  t2(KVD_DTYPE_F32, s.out.data, 8, 128),
                                  t1(KVD_DTYPE_F32, s.lse.data, 8)};
        TU_CHECK(kvd_attn_sparse(be, 1, &a, NULL) == 0, "sparse all");
        compare(fast ? "sparse all fast" : "sparse all ref", &d, &s, 8, 128, 1e-9, 1e-4);
        /* a subset of 37 per head = dense attention over the gathered rows */
        int n = 37;
        a.idx = t2(KVD_DTYPE_I32, idx, 2, n);
        a.idx.stride[0] = 700 * 4;
        TU_CHECK(kvd_attn_sparse(be, 1, &a, NULL) == 0, "sparse subset");
        prob g = p;
        g.T = n;
        uint16_t *gk = malloc(2u * 2 * n * 128), *gv = malloc(2u * 2 * n * 128);
        for (int h = 0; h < 2; h++)
            for (int i = 0; i < n; i++) {
                memcpy(gk + (h * n + i) * 128, (uint16_t *)p.k + (h * 700 + idx[h * 700 + i]) * 128, 256);
                memcpy(gv + (h * n + i) * 128, (uint16_t *)p.v + (h * 700 + idx[h * 700 + i]) * 128, 256);
            }
        g.k = gk;
        g.v = gv;
        res gd = res_new(8, 128);
        run_dense(be_ref, &g, &gd, 0, n);
        compare("sparse subset", &gd, &s, 8, 128, 1e-9, 1e-4);
        /* n = 0: empty result */
        a.idx.shape[1] = 0;
        TU_CHECK(kvd_attn_sparse(be, 1, &a, NULL) == 0, "sparse empty");
        TU_CHECK(isinf(((float *)s.lse.data)[0]), "sparse empty lse");
        /* out-of-range index is rejected */
        idx[0] = 700;
        a.idx.shape[1] = 5;
        TU_CHECK(kvd_attn_sparse(be, 1, &a, NULL) == KVD_EINVAL, "sparse bad index");
        free(gk), free(gv), free(idx);
        res_free(&d), res_free(&s), res_free(&gd);
        prob_free(&p);
    }
}

/* ---- sparse over row addresses ----------------------------------------- */

/* kvd_cpu_attn_rows over rows each in an allocation of its own: the bits of
 * the fast sparse kernel over the same tokens, the reference's figures, and
 * the argument checks (G = 20: more query heads than one pass takes). */
static void test_rows(tu_rng *rng)
{
    static const struct {
        int Hq, D, Dv;
        kvd_dtype dt;
    } cases[] = {{8, 128, 128, KVD_DTYPE_F16},
                 {8, 128, 128, KVD_DTYPE_BF16},
                 {8, 64, 64, KVD_DTYPE_F32},
                 {40, 128, 128, KVD_DTYPE_F16},
                 {6, 40, 24, KVD_DTYPE_F16}};
    const int Hkv = 2, T = 300, n = 53;
    for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ci++) {
        const int Hq = cases[ci].Hq, D = cases[ci].D, Dv = cases[ci].Dv;
        const kvd_dtype dt = cases[ci].dt;
        const size_t es = kvd_dtype_size(dt);
        prob p = prob_new(rng, Hq, Hkv, D, Dv, T, dt, 1);
        int32_t *idx = malloc(sizeof(int32_t) * Hkv * n);
        const void **rows = malloc(sizeof(void *) * 2 * Hkv * n);
        for (int h = 0; h < Hkv; h++)
            for (int i = 0; i < n; i++) {
                idx[h * n + i] = (int32_t)((i * 149 + h * 17 + 5) % T); /* distinct, scattered */
                char *kr = malloc((size_t)D * es), *vr = malloc((size_t)Dv * es);
                memcpy(kr, (const char *)p.k + ((size_t)h * T + idx[h * n + i]) * D * es,
                       (size_t)D * es);
                memcpy(vr, (const char *)p.v + ((size_t)h * T + idx[h * n + i]) * Dv * es,
                       (size_t)Dv * es);
                rows[h * n + i] = kr;
                rows[Hkv * n + h * n + i] = vr;
            }
        kvd_attn_dims d = dims_of(&p);
        kvd_tensor q = t2(KVD_DTYPE_F32, p.q, Hq, D);
        res r = res_new(Hq, Dv), f = res_new(Hq, Dv), ref = res_new(Hq, Dv);
        kvd_tensor o = t2(KVD_DTYPE_F32, r.out.data, Hq, Dv), l = t1(KVD_DTYPE_F32, r.lse.data, Hq);
        kvd_error err;
        TU_CHECK(kvd_cpu_attn_rows(&d, &q, dt, rows, rows + Hkv * n, n, &o, &l, 2, &err) == 0,
                 "rows case %zu: %s", ci, err.msg);
        kvd_attn_sparse_args a = {d,
                                  q,
                                  t3(dt, p.k, Hkv, T, D),
                                  t3(dt, p.v, Hkv, T, Dv),
                                  t2(KVD_DTYPE_I32, idx, Hkv, n),
                                  t2(KVD_DTYPE_F32, ref.out.data, Hq, Dv),
                                  t1(KVD_DTYPE_F32, ref.lse.data, Hq)};
        TU_CHECK(kvd_attn_sparse(be_ref, 1, &a, NULL) == 0, "rows case %zu: reference", ci);
        char what[64];
        snprintf(what, sizeof what, "rows case %zu vs reference", ci);
        compare(what, &ref, &r, Hq, Dv, 1e-9, 1e-4);
        a.out = t2(KVD_DTYPE_F32, f.out.data, Hq, Dv);
        a.lse = t1(KVD_DTYPE_F32, f.lse.data, Hq);
        TU_CHECK(kvd_attn_sparse(be_fast, 1, &a, NULL) == 0, "rows case %zu: fast", ci);
        TU_CHECK(memcmp(f.out.data, r.out.data, sizeof(float) * (size_t)Hq * Dv) == 0 &&
                     memcmp(f.lse.data, r.lse.data, sizeof(float) * (size_t)Hq) == 0,
                 "rows case %zu: not the fast sparse kernel's bits", ci);
        if (ci == 0) {
            TU_CHECK(kvd_cpu_attn_rows(&d, &q, dt, rows, rows + Hkv * n, 0, &o, &l, 1, &err) == 0 &&
                         isinf(((float *)r.lse.data)[0]),
                     "rows: n = 0 gives the empty result");
            const void *keep = rows[n + 3];
            rows[n + 3] = NULL;
            TU_CHECK(kvd_cpu_attn_rows(&d, &q, dt, rows, rows + Hkv * n, n, &o, &l, 1, &err) ==
                             KVD_EINVAL &&
                         strstr(err.msg, "NULL"),
                     "rows: a NULL row is refused (%s)", err.msg);
            rows[n + 3] = keep;
            TU_CHECK(kvd_cpu_attn_rows(&d, &q, KVD_DTYPE_I32, rows, rows + Hkv * n, n, &o, &l, 1,
                                       &err) == KVD_EINVAL,
                     "rows: an integer dtype is refused");
            kvd_tensor bad = t2(KVD_DTYPE_F32, r.out.data, Hq, Dv + 1);
            TU_CHECK(kvd_cpu_attn_rows(&d, &q, dt, rows, rows + Hkv * n, n, &bad, &l, 1, &err) ==
                         KVD_EINVAL,
                     "rows: a misshapen output is refused");
        }
        for (int i = 0; i < 2 * Hkv * n; i++)
            free((void *)rows[i]);
        free(rows), free(idx);
        res_free(&r), res_free(&f), res_free(&ref);
        prob_free(&p);
    }
}

/* ---- NaN / Inf parity -------------------------------------------------- */

static void test_nonfinite(tu_rng *rng)
{
    prob p = prob_new(rng, 8, 2, 64, 64, 300, KVD_DTYPE_F32, 0);
    tu_inject_nonfinite(rng, p.k, (size_t)(2 * 300 * 64) / 2, 2); /* kv head 0 only */
    tu_inject_nonfinite(rng, (float *)p.v + 300 * 64, (size_t)(300 * 64), 1);
    res rr = res_new(8, 64), rf = res_new(8, 64);
    run_dense(be_ref, &p, &rr, 0, p.T);
    run_dense(be_fast, &p, &rf, 0, p.T);
    compare("dense NaN/Inf", &rr, &rf, 8, 64, 1e-9, 1e-4);
    res_free(&rr), res_free(&rf), prob_free(&p);
}

/* ---- INT2 / INT4 ------------------------------------------------------- */

typedef struct qbuf {
    kvd_attn_qdata qd;
    uint8_t *codes;
    uint16_t *min, *scale, *sum;
} qbuf;

/* Quantize (Hkv, T, W) x with the codec into attention's (Hkv, ...) arrays. */
static qbuf quantize_all(const float *x, int Hkv, int64_t T, int W, int bits, int group, int axis)
{
    qbuf b;
    memset(&b, 0, sizeof b);
    int64_t rows = axis == KVD_ATTN_AXIS_TOKEN ? T : W, along = axis == KVD_ATTN_AXIS_TOKEN ? W : T;
    size_t cb = (size_t)(rows * along * bits / 8), pn = (size_t)(rows * along / group);
    b.codes = malloc(cb * Hkv + 16);
    b.min = malloc(2 * pn * Hkv + 16);
    b.scale = malloc(2 * pn * Hkv + 16);
    b.sum = malloc(2 * pn * Hkv + 16);
    for (int h = 0; h < Hkv; h++) {
        kvd_qtensor q;
        TU_CHECK(kvd_qtensor_init(&q, T, W, bits, group, axis == KVD_ATTN_AXIS_TOKEN ? KVD_QAXIS_TOKEN : KVD_QAXIS_CHANNEL,
                                  NULL, NULL) == 0, "qtensor init");
        q.codes = b.codes + cb * h;
        q.min = b.min + pn * h;
        q.scale = b.scale + pn * h;
        q.sum = b.sum + pn * h;
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
    return b;
}

static void qbuf_free(qbuf *b)
{
    free(b->codes), free(b->min), free(b->scale), free(b->sum);
}

static float deq(const qbuf *b, int h, int64_t t, int j, int64_t T, int W)
{
    /* value of token t, channel j (x ~ min + scale * code) */
    const kvd_attn_qdata *q = &b->qd;
    int per = 8 / q->bits;
    if (q->axis == KVD_ATTN_AXIS_TOKEN) {
        const uint8_t *row = b->codes + ((size_t)h * T + t) * (W * q->bits / 8);
        int c = (row[j / per] >> ((j % per) * q->bits)) & ((1 << q->bits) - 1);
        size_t gi = ((size_t)h * T + t) * (W / q->group) + j / q->group;
        return kvd_f16_to_f32(b->min[gi]) + kvd_f16_to_f32(b->scale[gi]) * c;
    }
    const uint8_t *row = b->codes + ((size_t)h * W + j) * (T * q->bits / 8);
    int c = (row[t / per] >> ((t % per) * q->bits)) & ((1 << q->bits) - 1);
    size_t gi = ((size_t)h * W + j) * (T / q->group) + t / q->group;
    return kvd_f16_to_f32(b->min[gi]) + kvd_f16_to_f32(b->scale[gi]) * c;
}

/*
 * The equation the homomorphic kernel approximates, written the long way:
 * q rounded to s_q * q8, K and V dequantized, scores in double, P = exp(s -
 * max) over all tokens; for channel-grouped V each group of P is replaced by
 * its uint8 rounding mP + sP * p8 (same rule as the kernel) in the numerator.
 * Equal to the kernel up to float summation order.
 */
static void int_expected(const prob *p, const qbuf *kq, const qbuf *vq, int64_t T, const float *kt,
                         const float *vt, int64_t Tt, float *out, float *lse)
{
    int G = p->Hq / p->Hkv, D = p->D, Dv = p->Dv;
    float scale = 1.0f / sqrtf((float)D);
    int64_t N = T + Tt;
    double *s = malloc(sizeof(double) * (size_t)(N + 1)), *acc = malloc(sizeof(double) * (size_t)Dv);
    float *P = malloc(sizeof(float) * (size_t)(N + 1));
    int8_t q8[4096];
    for (int h = 0; h < p->Hkv; h++)
        for (int g = 0; g < G; g++) {
            int hq = h * G + g;
            const float *q = p->q + (size_t)hq * D;
            float sq = kvd_attn_quantize_q8(q, D, q8);
            if (kq->qd.axis == KVD_ATTN_AXIS_CHANNEL) {
                /* channel-grouped keys: per token group the query folded
                 * with the group's scales is what is rounded to int8 */
                int Pk = kq->qd.group, per = 8 / kq->qd.bits;
                float w[4096];
                int8_t w8[4096];
                for (int64_t gi = 0; gi < T / Pk; gi++) {
                    double bias = 0;
                    for (int j = 0; j < D; j++) {
                        size_t pi = ((size_t)h * D + j) * (T / Pk) + gi;
                        w[j] = q[j] * kvd_f16_to_f32(kq->scale[pi]);
                        bias += (double)q[j] * kvd_f16_to_f32(kq->min[pi]);
                    }
                    float sw = kvd_attn_quantize_q8(w, D, w8);
                    for (int64_t t = gi * Pk; t < (gi + 1) * Pk; t++) {
                        double dot = bias;
                        for (int j = 0; j < D; j++) {
                            const uint8_t *row = kq->codes + ((size_t)h * D + j) * (T * kq->qd.bits / 8);
                            int c = (row[t / per] >> ((t % per) * kq->qd.bits)) & ((1 << kq->qd.bits) - 1);
                            dot += (double)sw * w8[j] * c;
                        }
                        s[t] = dot * scale;
                    }
                }
            }
            for (int64_t t = 0; kq->qd.axis == KVD_ATTN_AXIS_TOKEN && t < T; t++) {
                double dot = 0;
                for (int j = 0; j < D; j++)
                    dot += (double)sq * q8[j] * deq(kq, h, t, j, T, D);
                s[t] = dot * scale;
            }
            for (int64_t t = 0; t < Tt; t++) {
                double dot = 0;
                for (int j = 0; j < D; j++)
                    dot += (double)q[j] * kt[((size_t)h * Tt + t) * D + j];
                s[T + t] = dot * scale;
            }
            double m = -INFINITY, l = 0;
            for (int64_t t = 0; t < N; t++)
                m = s[t] > m ? s[t] : m;
            if (N == 0) {
                lse[hq] = -INFINITY;
                for (int j = 0; j < Dv; j++)
                    out[(size_t)hq * Dv + j] = 0;
                continue;
            }
            for (int64_t t = 0; t < N; t++) {
                P[t] = (float)exp(s[t] - m);
                l += P[t];
            }
            memset(acc, 0, sizeof(double) * (size_t)Dv);
            if (vq->qd.axis == KVD_ATTN_AXIS_CHANNEL) {
                int Pg = vq->qd.group;
                for (int64_t t0 = 0; t0 < T; t0 += Pg) {
                    float lo = P[t0], hi = P[t0];
                    for (int i = 1; i < Pg; i++) {
                        lo = P[t0 + i] < lo ? P[t0 + i] : lo;
                        hi = P[t0 + i] > hi ? P[t0 + i] : hi;
                    }
                    /* a step below FLT_MIN: the group is coded as lo */
                    float sP = (hi - lo) / 255.0f, inv = sP >= FLT_MIN ? 1.0f / sP : 0.0f;
                    for (int i = 0; i < Pg; i++) {
                        float c = rintf((P[t0 + i] - lo) * inv);
                        c = c < 0 ? 0 : c > 255 ? 255 : c;
                        double ph = (double)lo + (double)sP * c;
                        for (int j = 0; j < Dv; j++)
                            acc[j] += ph * deq(vq, h, t0 + i, j, T, Dv);
                    }
                }
            } else {
                for (int64_t t = 0; t < T; t++)
                    for (int j = 0; j < Dv; j++)
                        acc[j] += (double)P[t] * deq(vq, h, t, j, T, Dv);
            }
            for (int64_t t = 0; t < Tt; t++)
                for (int j = 0; j < Dv; j++)
                    acc[j] += (double)P[T + t] * vt[((size_t)h * Tt + t) * Dv + j];
            for (int j = 0; j < Dv; j++)
                out[(size_t)hq * Dv + j] = (float)(acc[j] / l);
            lse[hq] = (float)(m + log(l));
        }
    free(s), free(acc), free(P);
}

static void test_int(tu_rng *rng)
{
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmissing-field-initializers" /* qmul: mostly left out */
    struct {
        int64_t T, Tt;
        int G, D, bits, kgroup, vgroup, vaxis, kaxis;
        float qmul; /* 0: the query as drawn */
    } cases[] = {
        {0, 0, 4, 128, 2, 32, 32, KVD_ATTN_AXIS_CHANNEL, KVD_ATTN_AXIS_TOKEN},
        {0, 5, 4, 128, 2, 32, 32, KVD_ATTN_AXIS_CHANNEL, KVD_ATTN_AXIS_TOKEN},
        {32, 0, 1, 128, 2, 32, 32, KVD_ATTN_AXIS_CHANNEL, KVD_ATTN_AXIS_TOKEN},
        {256, 3, 4, 128, 2, 32, 32, KVD_ATTN_AXIS_CHANNEL, KVD_ATTN_AXIS_TOKEN},
        {512, 17, 8, 128, 2, 64, 64, KVD_ATTN_AXIS_CHANNEL, KVD_ATTN_AXIS_TOKEN},
        {384, 1, 4, 128, 2, 128, 128, KVD_ATTN_AXIS_CHANNEL, KVD_ATTN_AXIS_TOKEN},
        {640, 0, 4, 64, 2, 32, 32, KVD_ATTN_AXIS_CHANNEL, KVD_ATTN_AXIS_TOKEN},
        {256, 9, 4, 128, 4, 32, 32, KVD_ATTN_AXIS_CHANNEL, KVD_ATTN_AXIS_TOKEN},
        {512, 0, 8, 128, 4, 64, 128, KVD_ATTN_AXIS_CHANNEL, KVD_ATTN_AXIS_TOKEN},
        {256, 2, 1, 64, 4, 64, 64, KVD_ATTN_AXIS_CHANNEL, KVD_ATTN_AXIS_TOKEN},
        {300, 4, 4, 128, 2, 32, 32, KVD_ATTN_AXIS_TOKEN, KVD_ATTN_AXIS_TOKEN},
        {77, 0, 8, 64, 4, 64, 32, KVD_ATTN_AXIS_TOKEN, KVD_ATTN_AXIS_TOKEN},
        {1, 1, 4, 128, 2, 128, 64, KVD_ATTN_AXIS_TOKEN, KVD_ATTN_AXIS_TOKEN},
        /* channel-grouped keys (KIVI-style) */
        {0, 4, 4, 128, 2, 32, 32, KVD_ATTN_AXIS_CHANNEL, KVD_ATTN_AXIS_CHANNEL},
        {256, 3, 4, 128, 2, 32, 32, KVD_ATTN_AXIS_CHANNEL, KVD_ATTN_AXIS_CHANNEL},
        {512, 0, 8, 128, 2, 64, 64, KVD_ATTN_AXIS_CHANNEL, KVD_ATTN_AXIS_CHANNEL},
        {640, 2, 4, 128, 2, 128, 32, KVD_ATTN_AXIS_CHANNEL, KVD_ATTN_AXIS_CHANNEL},
        {96, 0, 1, 128, 2, 32, 32, KVD_ATTN_AXIS_TOKEN, KVD_ATTN_AXIS_CHANNEL},
        {256, 1, 4, 64, 2, 32, 64, KVD_ATTN_AXIS_CHANNEL, KVD_ATTN_AXIS_CHANNEL},
        {384, 5, 4, 64, 4, 32, 128, KVD_ATTN_AXIS_CHANNEL, KVD_ATTN_AXIS_CHANNEL},
        {256, 0, 2, 96, 4, 64, 32, KVD_ATTN_AXIS_TOKEN, KVD_ATTN_AXIS_CHANNEL},
        {32, 0, 4, 128, 4, 32, 32, KVD_ATTN_AXIS_CHANNEL, KVD_ATTN_AXIS_CHANNEL},
        /* small groups (8, 16) for small heads, on either axis */
        {256, 3, 4, 32, 2, 8, 8, KVD_ATTN_AXIS_CHANNEL, KVD_ATTN_AXIS_TOKEN},
        {256, 0, 4, 16, 4, 16, 16, KVD_ATTN_AXIS_CHANNEL, KVD_ATTN_AXIS_CHANNEL},
        {128, 2, 2, 32, 2, 16, 8, KVD_ATTN_AXIS_TOKEN, KVD_ATTN_AXIS_CHANNEL},
        {96, 1, 4, 8, 2, 8, 16, KVD_ATTN_AXIS_CHANNEL, KVD_ATTN_AXIS_TOKEN},
        {512, 0, 4, 128, 2, 8, 16, KVD_ATTN_AXIS_CHANNEL, KVD_ATTN_AXIS_TOKEN},
        {256, 5, 4, 64, 4, 8, 8, KVD_ATTN_AXIS_TOKEN, KVD_ATTN_AXIS_CHANNEL},
        {320, 0, 8, 128, 2, 16, 8, KVD_ATTN_AXIS_CHANNEL, KVD_ATTN_AXIS_CHANNEL},
        /* values grouped per token (KIVI pairs them with channel-grouped
         * keys): G = 4 and 8 (compile-time paths), 2 and 16 (others), INT2
         * and INT4, blocks cut short by the end and by a tail */
        {768, 3, 4, 128, 2, 32, 32, KVD_ATTN_AXIS_CHANNEL, KVD_ATTN_AXIS_TOKEN},
        {700, 0, 4, 128, 2, 32, 32, KVD_ATTN_AXIS_TOKEN, KVD_ATTN_AXIS_TOKEN},
        {513, 2, 8, 128, 4, 32, 64, KVD_ATTN_AXIS_TOKEN, KVD_ATTN_AXIS_TOKEN},
        {300, 0, 2, 64, 2, 32, 32, KVD_ATTN_AXIS_TOKEN, KVD_ATTN_AXIS_TOKEN},
        {256, 1, 16, 64, 4, 64, 16, KVD_ATTN_AXIS_CHANNEL, KVD_ATTN_AXIS_TOKEN},
        {37, 0, 4, 128, 2, 32, 128, KVD_ATTN_AXIS_TOKEN, KVD_ATTN_AXIS_TOKEN},
        /* more query heads per kv head than one pass takes (20) */
        {256, 3, 20, 64, 2, 32, 32, KVD_ATTN_AXIS_CHANNEL, KVD_ATTN_AXIS_TOKEN},
        {256, 0, 20, 64, 4, 32, 32, KVD_ATTN_AXIS_TOKEN, KVD_ATTN_AXIS_CHANNEL},
        /* logits in the hundreds: whole groups of probabilities within
         * 3e-36 of each other (a step of 1/255 of their range below
         * FLT_MIN), coded as their minimum, never NaN (checked against
         * the equation only: the int8 rounding of q's scores, magnified
         * by so peaked a softmax, puts them far from float attention) */
        {96, 1, 4, 8, 2, 8, 16, KVD_ATTN_AXIS_CHANNEL, KVD_ATTN_AXIS_TOKEN, 12.0f},
        {256, 0, 4, 64, 2, 32, 32, KVD_ATTN_AXIS_CHANNEL, KVD_ATTN_AXIS_CHANNEL, 12.0f},
    };
#pragma GCC diagnostic pop
    for (size_t ci = 0; ci < sizeof cases / sizeof *cases; ci++) {
        int Hkv = 2, Hq = Hkv * cases[ci].G, D = cases[ci].D;
        int64_t T = cases[ci].T, Tt = cases[ci].Tt;
        prob p = prob_new(rng, Hq, Hkv, D, D, T, KVD_DTYPE_F32, 1);
        prob tail = prob_new(rng, Hq, Hkv, D, D, Tt, KVD_DTYPE_F16, 1);
        for (int i = 0; cases[ci].qmul != 0.0f && i < Hq * D; i++)
            p.q[i] *= cases[ci].qmul;
        qbuf kq = quantize_all(p.k32, Hkv, T, D, cases[ci].bits, cases[ci].kgroup, cases[ci].kaxis);
        qbuf vq = quantize_all(p.v32, Hkv, T, D, cases[ci].bits, cases[ci].vgroup, cases[ci].vaxis);
        res rr = res_new(Hq, D), rf = res_new(Hq, D), ex = res_new(Hq, D);
        kvd_attn_int_args a;
        memset(&a, 0, sizeof a);
        a.dims = dims_of(&p);
        a.q = t2(KVD_DTYPE_F32, p.q, Hq, D);
        a.n_tokens = T;
        a.k = kq.qd;
        a.v = vq.qd;
        a.k_tail = t3(KVD_DTYPE_F16, tail.k, Hkv, Tt, D);
        a.v_tail = t3(KVD_DTYPE_F16, tail.v, Hkv, Tt, D);
        char what[128];
        snprintf(what, sizeof what, "INT%d T=%lld+%lld G=%d D=%d P=%d/%d K %s V %s", cases[ci].bits, (long long)T,
                 (long long)Tt, cases[ci].G, D, cases[ci].kgroup, cases[ci].vgroup,
                 cases[ci].kaxis == KVD_ATTN_AXIS_CHANNEL ? "channel" : "token",
                 cases[ci].vaxis == KVD_ATTN_AXIS_CHANNEL ? "channel" : "token");
        kvd_error err;
        for (int fast = 0; fast < 2; fast++) {
            const res *r = fast ? &rf : &rr;
            a.out = t2(KVD_DTYPE_F32, r->out.data, Hq, D);
            a.lse = t1(KVD_DTYPE_F32, r->lse.data, Hq);
            int rc = kvd_attn_quant(fast ? be_fast : be_ref, 1, &a, &err);
            TU_CHECK(rc == 0, "%s: %s", what, err.msg);
        }
        /* The dot products of the codes by vpdpbusd (CPUs with VNNI) and by
         * maddubs + madd (KVD_NO_VNNI) are the same exact integer sums:
         * the same bits (on a CPU without VNNI both runs take maddubs). */
        {
            res rn = res_new(Hq, D);
            a.out = t2(KVD_DTYPE_F32, rn.out.data, Hq, D);
            a.lse = t1(KVD_DTYPE_F32, rn.lse.data, Hq);
            setenv("KVD_NO_VNNI", "1", 1);
            int rc = kvd_attn_quant(be_fast, 1, &a, &err);
            unsetenv("KVD_NO_VNNI");
            TU_CHECK(rc == 0, "%s: %s", what, err.msg);
            TU_CHECK(memcmp(rn.out.data, rf.out.data, sizeof(float) * (size_t)Hq * D) == 0 &&
                         memcmp(rn.lse.data, rf.lse.data, sizeof(float) * (size_t)Hq) == 0,
                     "%s: VNNI and maddubs dot products differ", what);
            /* and the 256-bit kernels (VNNI dot products, token-axis values,
             * channel-key weights, the softmax's exponentials), which a CPU
             * with AVX-512 leaves for its 512-bit ones (KVD_NO_AVX512) */
            setenv("KVD_NO_AVX512", "1", 1);
            rc = kvd_attn_quant(be_fast, 1, &a, &err);
            unsetenv("KVD_NO_AVX512");
            TU_CHECK(rc == 0, "%s: %s", what, err.msg);
            TU_CHECK(memcmp(rn.out.data, rf.out.data, sizeof(float) * (size_t)Hq * D) == 0 &&
                         memcmp(rn.lse.data, rf.lse.data, sizeof(float) * (size_t)Hq) == 0,
                     "%s: the 256- and 512-bit kernels differ", what);
            res_free(&rn);
        }
        /* three items in one call, side by side: each item's bits alone */
        ITEMS_AS_ALONE(kvd_attn_int_args, kvd_attn_quant, a, rf, what, Hq, D);
        /* the same tokens in segments [0, 128), [128, 128), [128, T), each
         * quantized on its own (the same codes: every group size divides
         * 128), as one call: the same result, reference and fast path */
        if (T >= 256) {
            const int64_t cut[4] = {0, 128, 128, T};
            kvd_attn_int_segment sg[3];
            qbuf sq[6];
            for (int i = 0; i < 3; i++) {
                const int64_t n = cut[i + 1] - cut[i];
                float *xk = malloc(sizeof(float) * (size_t)(Hkv * n * D) + 4);
                float *xv = malloc(sizeof(float) * (size_t)(Hkv * n * D) + 4);
                for (int h = 0; h < Hkv; h++) {
                    memcpy(xk + (size_t)h * n * D, p.k32 + ((size_t)h * T + cut[i]) * D,
                           sizeof(float) * (size_t)(n * D));
                    memcpy(xv + (size_t)h * n * D, p.v32 + ((size_t)h * T + cut[i]) * D,
                           sizeof(float) * (size_t)(n * D));
                }
                sq[2 * i] =
                    quantize_all(xk, Hkv, n, D, cases[ci].bits, cases[ci].kgroup, cases[ci].kaxis);
                sq[2 * i + 1] =
                    quantize_all(xv, Hkv, n, D, cases[ci].bits, cases[ci].vgroup, cases[ci].vaxis);
                sg[i] = (kvd_attn_int_segment){n, sq[2 * i].qd, sq[2 * i + 1].qd};
                free(xk), free(xv);
            }
            kvd_attn_int_args s = a;
            s.k.codes = s.k.min = s.k.scale = s.k.sum = (kvd_tensor){0};
            s.v.codes = s.v.min = s.v.scale = s.v.sum = (kvd_tensor){0};
            s.n_segments = 3;
            s.segments = sg;
            SEGMENTS_AS_ONE(kvd_attn_int_args, kvd_attn_quant, s, rr, rf, 0, what, Hq, D);
            sg[2].k.bits = 6 - cases[ci].bits; /* a segment coded otherwise: refused */
            TU_CHECK(kvd_attn_quant(be_fast, 1, &s, &err) == KVD_EINVAL,
                     "%s: a segment of other bits taken", what);
            for (int i = 0; i < 6; i++)
                qbuf_free(&sq[i]);
        }
        int_expected(&p, &kq, &vq, T, tail.k32, tail.v32, Tt, ex.out.data, ex.lse.data);
        /* The reference is the equation (tight); the fast path may flip a
         * p8 rounding where float and double scores straddle a .5: one step
         * of 1/255 of a group's range, bounded well below 1e-6 NMSE. */
        compare(what, &ex, &rr, Hq, D, 1e-9, 1e-4);
        compare(what, &rr, &rf, Hq, D, 1e-6, 1e-4);
        /* vs float attention on the dequantized K/V (no int8 rounding of q
         * or P): what the homomorphic evaluation itself costs */
        if (T > 0 && Tt == 0 && cases[ci].qmul == 0.0f) {
            prob dq = prob_new(rng, Hq, Hkv, D, D, T, KVD_DTYPE_F32, 0);
            memcpy(dq.q, p.q, sizeof(float) * (size_t)Hq * D);
            for (int h = 0; h < Hkv; h++)
                for (int64_t t = 0; t < T; t++)
                    for (int j = 0; j < D; j++) {
                        ((float *)dq.k)[((size_t)h * T + t) * D + j] = deq(&kq, h, t, j, T, D);
                        ((float *)dq.v)[((size_t)h * T + t) * D + j] = deq(&vq, h, t, j, T, D);
                    }
            res fl = res_new(Hq, D);
            run_dense(be_ref, &dq, &fl, 0, T);
            double e = tu_nmse(fl.out.data, rf.out.data, (size_t)Hq * D);
            /* uint8 P over groups of up to 128 tokens of a peaky softmax,
             * and with keys grouped per channel the int8 rounding of q
             * folded with each group's scales (outlier channels 10x):
             * a few 1e-3 mostly, up to 4e-2 over 40 seeds of this data
             * (logits up to ~130: a peaky softmax magnifies score errors) */
            TU_CHECK(e < 5e-2, "%s: NMSE vs dequantize-then-attend in float %.3g", what, e);
            res_free(&fl);
            prob_free(&dq);
        }
        res_free(&rr), res_free(&rf), res_free(&ex);
        qbuf_free(&kq), qbuf_free(&vq);
        prob_free(&p), prob_free(&tail);
    }
}

/* NaN parity: a NaN in one query head makes exactly that head's output and
 * lse NaN, on the reference and the fast path, for both key axes. */
static void test_int_nan(tu_rng *rng)
{
    for (int kax = 0; kax < 2; kax++) {
        int Hkv = 2, G = 4, Hq = Hkv * G, D = 128;
        int64_t T = 512;
        prob p = prob_new(rng, Hq, Hkv, D, D, T, KVD_DTYPE_F32, 1);
        p.q[(size_t)5 * D + 17] = NAN; /* query head 5 (kv head 1) */
        qbuf kq = quantize_all(p.k32, Hkv, T, D, 2, 32, kax ? KVD_ATTN_AXIS_CHANNEL : KVD_ATTN_AXIS_TOKEN);
        qbuf vq = quantize_all(p.v32, Hkv, T, D, 2, 32, KVD_ATTN_AXIS_CHANNEL);
        kvd_attn_int_args a;
        memset(&a, 0, sizeof a);
        a.dims = dims_of(&p);
        a.q = t2(KVD_DTYPE_F32, p.q, Hq, D);
        a.n_tokens = T;
        a.k = kq.qd;
        a.v = vq.qd;
        for (int fast = 0; fast < 2; fast++) {
            res r = res_new(Hq, D);
            a.out = t2(KVD_DTYPE_F32, r.out.data, Hq, D);
            a.lse = t1(KVD_DTYPE_F32, r.lse.data, Hq);
            kvd_error err;
            TU_CHECK(kvd_attn_quant(fast ? be_fast : be_ref, 1, &a, &err) == 0, "INT NaN: %s", err.msg);
            const float *o = r.out.data, *l = r.lse.data;
            for (int h = 0; h < Hq; h++) {
                int nan_o = 0, nan_all = 1;
                for (int j = 0; j < D; j++) {
                    nan_o |= o[(size_t)h * D + j] != o[(size_t)h * D + j];
                    nan_all &= o[(size_t)h * D + j] != o[(size_t)h * D + j];
                }
                if (h == 5)
                    TU_CHECK(nan_all && l[h] != l[h], "INT NaN K axis %d %s: head 5 not NaN", kax,
                             fast ? "fast" : "ref");
                else
                    TU_CHECK(!nan_o && l[h] == l[h], "INT NaN K axis %d %s: head %d NaN", kax,
                             fast ? "fast" : "ref", h);
            }
            res_free(&r);
        }
        qbuf_free(&kq), qbuf_free(&vq);
        prob_free(&p);
    }
}

/* ---- VQ ---------------------------------------------------------------- */

/* Tokens [t0, t1) of codes (Hkv, T, np) of es bytes each, copied into a
 * block of their own whose rows are 3 codes longer (strided, as a page's
 * rows are not): the tensor describes it, *buf is to be freed. */
static kvd_tensor codes_part(const uint8_t *codes, size_t es, int Hkv, int64_t T, int np,
                             int64_t t0, int64_t t1, uint8_t **buf)
{
    const int64_t n = t1 - t0, row = (int64_t)(np + 3) * (int64_t)es;
    uint8_t *p = malloc((size_t)(Hkv * n * row) + 8);
    for (int h = 0; h < Hkv; h++)
        for (int64_t t = 0; t < n; t++)
            memcpy(p + (h * n + t) * row, codes + ((h * T + t0 + t) * np) * (int64_t)es,
                   (size_t)np * es);
    kvd_tensor x = t3(es == 1 ? KVD_DTYPE_U8 : KVD_DTYPE_U16, p, Hkv, n, np);
    x.stride[1] = row;
    x.stride[0] = n * row;
    *buf = p;
    return x;
}

static void fwht_ref(float *x, int n)
{
    /* H_n x with H the normalised Sylvester Hadamard matrix, O(n^2) */
    float *y = malloc(sizeof(float) * (size_t)n);
    for (int i = 0; i < n; i++) {
        double acc = 0;
        for (int j = 0; j < n; j++)
            acc += (__builtin_popcount((unsigned)(i & j)) & 1 ? -1.0 : 1.0) * x[j];
        y[i] = (float)(acc / sqrt((double)n));
    }
    memcpy(x, y, sizeof(float) * (size_t)n);
    free(y);
}

static void test_vq(tu_rng *rng)
{
    struct {
        int64_t T, Tt;
        int G, D, dk, bk, dv, bv, had, lam;
    } cases[] = {
        {0, 0, 4, 128, 4, 8, 4, 8, 1, 1},
        {1, 0, 4, 128, 4, 8, 4, 8, 1, 1},
        {700, 3, 4, 128, 4, 8, 4, 8, 1, 1},
        {300, 0, 8, 128, 8, 12, 8, 12, 1, 1},
        {257, 5, 1, 64, 4, 8, 2, 6, 0, 0},
        {513, 0, 8, 64, 2, 4, 4, 8, 1, 0},
        /* more query heads per kv head than one pass takes (8): two, three */
        {300, 2, 12, 128, 4, 8, 4, 8, 1, 1},
        {256, 0, 20, 64, 4, 8, 4, 8, 0, 1},
    };
    for (size_t ci = 0; ci < sizeof cases / sizeof *cases; ci++) {
        int Hkv = 2, G = cases[ci].G, Hq = Hkv * G, D = cases[ci].D;
        int64_t T = cases[ci].T, Tt = cases[ci].Tt;
        int dk = cases[ci].dk, dv = cases[ci].dv, Kk = 1 << cases[ci].bk, Kv = 1 << cases[ci].bv;
        prob p = prob_new(rng, Hq, Hkv, D, D, 0, KVD_DTYPE_F32, 0);
        prob tail = prob_new(rng, Hq, Hkv, D, D, Tt, KVD_DTYPE_F32, 1);
        int kpos = D / dk, vpos = D / dv;
        size_t kes = cases[ci].bk <= 8 ? 1 : 2, ves = cases[ci].bv <= 8 ? 1 : 2;
        uint8_t *kc = malloc(kes * Hkv * T * kpos + 8), *vc = malloc(ves * Hkv * T * vpos + 8);
        float *kcb = malloc(sizeof(float) * Hkv * Kk * dk), *vcb = malloc(sizeof(float) * Hkv * Kv * dv);
        float *lam = malloc(sizeof(float) * Hkv * D);
        tu_fill_normal(rng, kcb, (size_t)Hkv * Kk * dk, 1.0f);
        tu_fill_normal(rng, vcb, (size_t)Hkv * Kv * dv, 1.0f);
        tu_fill_uniform(rng, lam, (size_t)Hkv * D, 0.5f, 3.0f);
        for (int64_t i = 0; i < Hkv * T * kpos; i++) {
            uint32_t c = tu_rng_below(rng, (uint32_t)Kk);
            if (kes == 1)
                kc[i] = (uint8_t)c;
            else
                ((uint16_t *)kc)[i] = (uint16_t)c;
        }
        for (int64_t i = 0; i < Hkv * T * vpos; i++) {
            uint32_t c = tu_rng_below(rng, (uint32_t)Kv);
            if (ves == 1)
                vc[i] = (uint8_t)c;
            else
                ((uint16_t *)vc)[i] = (uint16_t)c;
        }
        kvd_attn_vq_args a;
        memset(&a, 0, sizeof a);
        a.dims = dims_of(&p);
        a.q = t2(KVD_DTYPE_F32, p.q, Hq, D);
        a.n_tokens = T;
        a.k_sub_dim = dk;
        a.k_bits = cases[ci].bk;
        a.k_codes = t3(kes == 1 ? KVD_DTYPE_U8 : KVD_DTYPE_U16, kc, Hkv, T, kpos);
        a.k_codebook = t3(KVD_DTYPE_F32, kcb, Hkv, Kk, dk);
        if (cases[ci].lam)
            a.k_lambda = t2(KVD_DTYPE_F32, lam, Hkv, D);
        a.k_hadamard = cases[ci].had;
        a.v_sub_dim = dv;
        a.v_bits = cases[ci].bv;
        a.v_codes = t3(ves == 1 ? KVD_DTYPE_U8 : KVD_DTYPE_U16, vc, Hkv, T, vpos);
        a.v_codebook = t3(KVD_DTYPE_F32, vcb, Hkv, Kv, dv);
        a.k_tail = t3(KVD_DTYPE_F32, tail.k, Hkv, Tt, D);
        a.v_tail = t3(KVD_DTYPE_F32, tail.v, Hkv, Tt, D);
        res rr = res_new(Hq, D), rf = res_new(Hq, D);
        char what[96];
        snprintf(what, sizeof what, "VQ T=%lld+%lld G=%d D=%d k d%db%d v d%db%d", (long long)T, (long long)Tt, G,
                 D, dk, cases[ci].bk, dv, cases[ci].bv);
        kvd_error err;
        for (int fast = 0; fast < 2; fast++) {
            const res *r = fast ? &rf : &rr;
            a.out = t2(KVD_DTYPE_F32, r->out.data, Hq, D);
            a.lse = t1(KVD_DTYPE_F32, r->lse.data, Hq);
            TU_CHECK(kvd_attn_vq(fast ? be_fast : be_ref, 1, &a, &err) == 0, "%s: %s", what, err.msg);
        }
        compare(what, &rr, &rf, Hq, D, 1e-9, 1e-4);
        /* the A path (probabilities summed per code, folded with the
         * codebook at the end), which a CPU with AVX-512 leaves for the
         * codewords straight into the output (KVD_NO_AVX512) */
        {
            res rn = res_new(Hq, D);
            a.out = t2(KVD_DTYPE_F32, rn.out.data, Hq, D);
            a.lse = t1(KVD_DTYPE_F32, rn.lse.data, Hq);
            setenv("KVD_NO_AVX512", "1", 1);
            TU_CHECK(kvd_attn_vq(be_fast, 1, &a, &err) == 0, "%s: %s", what, err.msg);
            unsetenv("KVD_NO_AVX512");
            compare(what, &rr, &rn, Hq, D, 1e-9, 1e-4);
            res_free(&rn);
        }
        /* three items in one call, side by side: each item's bits alone */
        ITEMS_AS_ALONE(kvd_attn_vq_args, kvd_attn_vq, a, rf, what, Hq, D);
        /* the same codes in segments (one empty, lengths off the kernel's
         * blocks, rows strided): the reference gives the same bits, the
         * fast path the same result */
        if (T > 0) {
            const int64_t cut[5] = {0, T / 3, T / 3, T / 3 + (T - T / 3) / 2 + 1, T};
            kvd_attn_vq_segment sg[4];
            uint8_t *bufs[8];
            for (int i = 0; i < 4; i++) {
                int64_t c1 = cut[i + 1] < T ? cut[i + 1] : T;
                sg[i].n_tokens = c1 - cut[i];
                sg[i].k_codes = codes_part(kc, kes, Hkv, T, kpos, cut[i], c1, &bufs[2 * i]);
                sg[i].v_codes = codes_part(vc, ves, Hkv, T, vpos, cut[i], c1, &bufs[2 * i + 1]);
            }
            kvd_attn_vq_args s = a;
            s.k_codes = s.v_codes = (kvd_tensor){0};
            s.n_segments = 4;
            s.segments = sg;
            SEGMENTS_AS_ONE(kvd_attn_vq_args, kvd_attn_vq, s, rr, rf, 1, what, Hq, D);
            for (int i = 0; i < 8; i++)
                free(bufs[i]);
        }
        /* decode-then-attend: K~ from the codebook, q~ = H (q * lambda), no tail */
        if (Tt == 0) {
            prob dp = prob_new(rng, Hq, Hkv, D, D, T, KVD_DTYPE_F32, 0);
            for (int h = 0; h < Hkv; h++) {
                for (int64_t t = 0; t < T; t++)
                    for (int pos = 0; pos < kpos; pos++) {
                        size_t i = ((size_t)h * T + t) * kpos + pos;
                        uint32_t c = kes == 1 ? kc[i] : ((uint16_t *)kc)[i];
                        memcpy(dp.k32 + ((size_t)h * T + t) * D + pos * dk, kcb + ((size_t)h * Kk + c) * dk, 4u * dk);
                    }
                for (int64_t t = 0; t < T; t++)
                    for (int pos = 0; pos < vpos; pos++) {
                        size_t i = ((size_t)h * T + t) * vpos + pos;
                        uint32_t c = ves == 1 ? vc[i] : ((uint16_t *)vc)[i];
                        memcpy(dp.v32 + ((size_t)h * T + t) * D + pos * dv, vcb + ((size_t)h * Kv + c) * dv, 4u * dv);
                    }
                for (int g = 0; g < G; g++) {
                    float *qt = dp.q + (size_t)(h * G + g) * D;
                    for (int j = 0; j < D; j++)
                        qt[j] = p.q[(size_t)(h * G + g) * D + j] * (cases[ci].lam ? lam[h * D + j] : 1.0f);
                    if (cases[ci].had)
                        fwht_ref(qt, D);
                }
            }
            memcpy(dp.k, dp.k32, sizeof(float) * (size_t)(Hkv * T * D));
            memcpy(dp.v, dp.v32, sizeof(float) * (size_t)(Hkv * T * D));
            res dd = res_new(Hq, D);
            run_dense(be_ref, &dp, &dd, 0, T);
            compare("VQ vs decode-then-attend", &dd, &rf, Hq, D, 1e-9, 1e-4);
            res_free(&dd);
            prob_free(&dp);
        }
        res_free(&rr), res_free(&rf);
        free(kc), free(vc), free(kcb), free(vcb), free(lam);
        prob_free(&p), prob_free(&tail);
    }
}

/* A value codeword with an Inf, used only by tokens whose probability is
 * exactly 0 (their keys score thousands below the others'): such tokens add
 * nothing, as in the reference, on every path (the AVX-512 one, which would
 * make 0 x Inf a NaN, steps aside for a codebook that is not finite). */
static void test_vq_inf_codeword(tu_rng *rng)
{
    const int Hkv = 1, Hq = 4, D = 128, npos = D / 4; /* 4 query heads over 1 kv head */
    const int64_t T = 64;
    prob p = prob_new(rng, Hq, Hkv, D, D, 0, KVD_DTYPE_F32, 0);
    for (int i = 0; i < Hq * D; i++)
        p.q[i] = 1.0f;
    uint8_t *kc = malloc((size_t)T * npos), *vc = malloc((size_t)T * npos);
    float *kcb = calloc(256 * 4, sizeof(float)), *vcb = malloc(sizeof(float) * 256 * 4);
    tu_fill_normal(rng, vcb, 256 * 4, 1.0f);
    for (int i = 0; i < 4; i++) {
        kcb[0 * 4 + i] = 100.0f;  /* code 0: scores far above */
        kcb[1 * 4 + i] = -100.0f; /* code 1: far below, probability 0 */
    }
    vcb[5 * 4 + 0] = INFINITY;
    for (int64_t t = 0; t < T; t++)
        for (int pos = 0; pos < npos; pos++) {
            kc[t * npos + pos] = (uint8_t)(t % 2);
            vc[t * npos + pos] = (uint8_t)(t % 2 ? 5 : (t + pos) % 4);
        }
    kvd_attn_vq_args a;
    memset(&a, 0, sizeof a);
    a.dims = dims_of(&p);
    a.q = t2(KVD_DTYPE_F32, p.q, Hq, D);
    a.n_tokens = T;
    a.k_sub_dim = a.v_sub_dim = 4;
    a.k_bits = a.v_bits = 8;
    a.k_codes = t3(KVD_DTYPE_U8, kc, Hkv, T, npos);
    a.v_codes = t3(KVD_DTYPE_U8, vc, Hkv, T, npos);
    a.k_codebook = t3(KVD_DTYPE_F32, kcb, Hkv, 256, 4);
    a.v_codebook = t3(KVD_DTYPE_F32, vcb, Hkv, 256, 4);
    res rr = res_new(Hq, D), rf = res_new(Hq, D);
    kvd_error err;
    for (int fast = 0; fast < 2; fast++) {
        const res *r = fast ? &rf : &rr;
        a.out = t2(KVD_DTYPE_F32, r->out.data, Hq, D);
        a.lse = t1(KVD_DTYPE_F32, r->lse.data, Hq);
        TU_CHECK(kvd_attn_vq(fast ? be_fast : be_ref, 1, &a, &err) == 0, "VQ Inf codeword: %s",
                 err.msg);
    }
    int finite = 1;
    for (int i = 0; i < Hq * D; i++)
        finite &=
            isfinite(((const float *)rf.out.data)[i]) && isfinite(((const float *)rr.out.data)[i]);
    TU_CHECK(finite, "VQ Inf codeword: an unweighted token's Inf reached the output");
    compare("VQ Inf codeword", &rr, &rf, Hq, D, 1e-9, 1e-4);
    res_free(&rr), res_free(&rf);
    free(kc), free(vc), free(kcb), free(vcb);
    prob_free(&p);
}

/* ---- SVD --------------------------------------------------------------- */

static void test_svd(tu_rng *rng, int G)
{
    /* attention: R from the Q-K Gram; full width = dense exactly; reduced
     * widths (ragged, per head) fast = ref; G = 20: more query heads per kv
     * head than one pass takes */
    int Hkv = 2, Hq = Hkv * G, D = 64;
    int64_t T = 300;
    prob p = prob_new(rng, Hq, Hkv, D, D, T, KVD_DTYPE_F32, 1);
    float *Rk = malloc(sizeof(float) * Hkv * D * D), *Rv = malloc(sizeof(float) * Hkv * D * D), svk[64], svv[64];
    for (int h = 0; h < Hkv; h++) {
        double *gk = calloc((size_t)D * D, sizeof(double)), *gv = calloc((size_t)D * D, sizeof(double));
        kvd_svd_gram_accumulate(gk, D, p.k32 + (size_t)h * T * D, KVD_DTYPE_F32, T, 4 * D, 1.0, NULL);
        kvd_svd_gram_accumulate(gk, D, p.q + (size_t)h * G * D, KVD_DTYPE_F32, G, 4 * D, 1.0, NULL);
        kvd_svd_gram_accumulate(gv, D, p.v32 + (size_t)h * T * D, KVD_DTYPE_F32, T, 4 * D, 1.0, NULL);
        TU_CHECK(kvd_svd_rotation(gk, D, Rk + (size_t)h * D * D, svk, NULL) == 0, "rotation k");
        TU_CHECK(kvd_svd_rotation(gv, D, Rv + (size_t)h * D * D, svv, NULL) == 0, "rotation v");
        free(gk), free(gv);
    }
    for (int pass = 0; pass < 2; pass++) {
        int32_t kw[2], vw[2];
        if (pass == 0)
            kw[0] = kw[1] = vw[0] = vw[1] = D;
        else {
            kw[0] = 24, kw[1] = 40, vw[0] = 32, vw[1] = 16;
        }
        float *kr = malloc(sizeof(float) * (size_t)(T * (kw[0] + kw[1]))),
              *vr = malloc(sizeof(float) * (size_t)(T * (vw[0] + vw[1])));
        for (int h = 0, ko = 0, vo = 0; h < Hkv; ko += kw[h] * (int)T, vo += vw[h] * (int)T, h++) {
            TU_CHECK(kvd_svd_project(be_fast, Rk + (size_t)h * D * D, D, kw[h], p.k32 + (size_t)h * T * D,
                                     KVD_DTYPE_F32, T, 4 * D, kr + ko, NULL) == 0, "project k");
            kvd_cpu_svd_project_ref(Rv + (size_t)h * D * D, D, vw[h], p.v32 + (size_t)h * T * D, KVD_DTYPE_F32, T,
                                    4 * D, vr + vo);
        }
        kvd_attn_svd_args a;
        memset(&a, 0, sizeof a);
        a.dims = dims_of(&p);
        a.q = t2(KVD_DTYPE_F32, p.q, Hq, D);
        a.rk = t3(KVD_DTYPE_F32, Rk, Hkv, D, D);
        a.rv = t3(KVD_DTYPE_F32, Rv, Hkv, D, D);
        a.k_width = kw;
        a.v_width = vw;
        a.n_tokens = T;
        a.dtype = KVD_DTYPE_F32;
        a.k_red = kr;
        a.v_red = vr;
        res rr = res_new(Hq, D), rf = res_new(Hq, D), dn = res_new(Hq, D);
        for (int fast = 0; fast < 2; fast++) {
            const res *r = fast ? &rf : &rr;
            a.out = t2(KVD_DTYPE_F32, r->out.data, Hq, D);
            a.lse = t1(KVD_DTYPE_F32, r->lse.data, Hq);
            kvd_error err;
            TU_CHECK(kvd_attn_svd(fast ? be_fast : be_ref, 1, &a, &err) == 0, "svd attention: %s", err.msg);
        }
        char what[64];
        snprintf(what, sizeof what, "SVD G=%d %s fast vs ref", G, pass ? "reduced" : "full");
        compare(what, &rr, &rf, Hq, D, 1e-9, 1e-4);
        /* three items in one call, side by side: each item's bits alone */
        ITEMS_AS_ALONE(kvd_attn_svd_args, kvd_attn_svd, a, rf, what, Hq, D);
        {
            /* the same rows in segments (one empty), each ragged over its
             * own tokens: the reference gives the same bits, the fast path
             * the same result */
            const int64_t cut[5] = {0, 100, 100, 257, T};
            kvd_attn_svd_segment sg[4];
            float *bufs[8];
            for (int i = 0; i < 4; i++) {
                const int64_t n = cut[i + 1] - cut[i];
                float *kb = malloc(sizeof(float) * (size_t)(n * (kw[0] + kw[1])) + 4);
                float *vb = malloc(sizeof(float) * (size_t)(n * (vw[0] + vw[1])) + 4);
                for (int h = 0, ko = 0, vo = 0; h < Hkv; ko += kw[h], vo += vw[h], h++) {
                    memcpy(kb + n * ko, kr + T * ko + cut[i] * kw[h],
                           sizeof(float) * (size_t)(n * kw[h]));
                    memcpy(vb + n * vo, vr + T * vo + cut[i] * vw[h],
                           sizeof(float) * (size_t)(n * vw[h]));
                }
                sg[i] = (kvd_attn_svd_segment){n, kb, vb};
                bufs[2 * i] = kb, bufs[2 * i + 1] = vb;
            }
            kvd_attn_svd_args s = a;
            s.k_red = s.v_red = NULL;
            s.n_segments = 4;
            s.segments = sg;
            SEGMENTS_AS_ONE(kvd_attn_svd_args, kvd_attn_svd, s, rr, rf, 1, what, Hq, D);
            for (int i = 0; i < 8; i++)
                free(bufs[i]);
        }
        if (pass == 0) {
            run_dense(be_ref, &p, &dn, 0, T);
            snprintf(what, sizeof what, "SVD G=%d full width = dense", G);
            compare(what, &dn, &rr, Hq, D, 1e-10, 1e-4);
        }
        res_free(&rr), res_free(&rf), res_free(&dn);
        free(kr), free(vr);
    }
    /* back-projection inverts projection at full width */
    float y[64], xb[64];
    TU_CHECK(kvd_svd_project(be_fast, Rk, D, D, p.q, KVD_DTYPE_F32, 1, 4 * D, y, NULL) == 0, "project q");
    TU_CHECK(kvd_svd_unproject(be_fast, Rk, D, D, y, 1, xb, NULL) == 0, "unproject");
    TU_CHECK(tu_max_abs_diff(p.q, xb, (size_t)D) < 1e-4, "unproject(project(q)) = q");
    free(Rk), free(Rv);
    prob_free(&p);
}

/* ---- argument checks --------------------------------------------------- */

static void test_invalid(void)
{
    float q[8], o[8], l[2], k[8];
    kvd_attn_dense_args a = {{2, 3, 4, 4, 1.0f}, t2(KVD_DTYPE_F32, q, 2, 4), t3(KVD_DTYPE_F32, k, 3, 0, 4),
                             t3(KVD_DTYPE_F32, k, 3, 0, 4), t2(KVD_DTYPE_F32, o, 2, 4), t1(KVD_DTYPE_F32, l, 2)};
    kvd_error err;
    TU_CHECK(kvd_attn_dense(be_fast, 1, &a, &err) == KVD_EINVAL, "Hq not a multiple of Hkv");
    a.dims.n_kv_heads = 1;
    a.k = t3(KVD_DTYPE_F32, k, 1, 2, 4);
    a.v = t3(KVD_DTYPE_F32, k, 1, 1, 4);
    TU_CHECK(kvd_attn_dense(be_fast, 1, &a, &err) == KVD_EINVAL, "K/V token mismatch");
    a.v = t3(KVD_DTYPE_I32, k, 1, 2, 4);
    TU_CHECK(kvd_attn_dense(be_fast, 1, &a, &err) == KVD_EINVAL, "V dtype");
    TU_CHECK(kvd_attn_dense(be_fast, 0, NULL, &err) == 0, "zero items");
}

int main(void)
{
    tu_rng rng;
    /* KVD_TEST_SEED: another draw of the random data (CTest runs two) */
    const char *seed = getenv("KVD_TEST_SEED");
    tu_rng_seed(&rng, seed ? strtoull(seed, NULL, 10) : 1234);
    be_fast = tu_cpu_backend(2, 0);
    be_ref = tu_cpu_backend(1, 1);
    test_hand();
    test_dense_shapes(&rng);
    test_dense_items(&rng);
    test_merge(&rng);
    test_sparse(&rng);
    test_nonfinite(&rng);
    test_int(&rng);
    test_int_nan(&rng);
    test_vq(&rng);
    test_vq_inf_codeword(&rng);
    test_svd(&rng, 4);
    test_rows(&rng);
    test_svd(&rng, 20);
    test_invalid();
    kvd_backend_free(be_fast);
    kvd_backend_free(be_ref);
    return tu_report("kernels_attn");
}
