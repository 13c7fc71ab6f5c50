/*
 * PQ index tests: the fast search against the reference and against an
 * independent brute force (exact equality, ties included), forced sink and
 * window tokens, GQA aggregation, wrappers with guard bytes, train/encode.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kvdepot/pq.h"
#include "testutil.h"

/* Independent brute force of the documented semantics. */
typedef struct bf_ent {
    float s;
    uint32_t i;
} bf_ent;

static int bf_cmp(const void *a, const void *b)
{
    const bf_ent *x = a, *y = b;
    int xn = isnan(x->s), yn = isnan(y->s);
    if (xn != yn)
        return xn ? 1 : -1;
    if (!xn && x->s != y->s)
        return x->s > y->s ? -1 : 1;
    return x->i < y->i ? -1 : (x->i > y->i);
}

static float bf_score(int m, int b, int D, const float *C, const uint8_t *code, const float *q)
{
    int ksub = 1 << b, dsub = D / m;
    float s = 0;
    for (int j = 0; j < m; j++) {
        float e = 0.0f;
        if (code[j] >= ksub) {
            e = -INFINITY;
        } else {
            const float *c = C + ((size_t)j * ksub + code[j]) * dsub;
            for (int t = 0; t < dsub; t++)
                e = e + q[j * dsub + t] * c[t];
        }
        s = j == 0 ? e : s + e;
    }
    return s;
}

static int64_t brute(int64_t n, int m, int b, int D, const float *C, const uint8_t *codes, int G,
                     const float *Q, const kvd_pq_search_params *p, uint32_t *idx, float *sc)
{
    float *qbar = malloc(sizeof(float) * D);
    for (int t = 0; t < D; t++) {
        float s = Q[t];
        for (int h = 1; h < G; h++)
            s = s + Q[h * D + t];
        qbar[t] = s;
    }
    bf_ent *all = malloc(sizeof(bf_ent) * (n + 1));
    for (int64_t i = 0; i < n; i++) {
        float s;
        if (p->agg == KVD_PQ_AGG_MAX) {
            s = bf_score(m, b, D, C, codes + i * m, Q);
            for (int h = 1; h < G; h++) {
                float v = bf_score(m, b, D, C, codes + i * m, Q + h * D);
                if (isnan(s) || v > s)
                    s = v;
            }
        } else {
            s = bf_score(m, b, D, C, codes + i * m, qbar);
        }
        all[i].s = s == 0.0f ? 0.0f : s;
        all[i].i = (uint32_t)i;
    }
    int64_t s0 = p->sink < n ? p->sink : n;
    int64_t w = p->window < n - s0 ? p->window : n - s0;
    int64_t nm = n - s0 - w;
    qsort(all + s0, nm, sizeof(bf_ent), bf_cmp);
    int64_t k = p->k < nm ? p->k : nm;
    /* result set: forced + first k of the sorted middle */
    bf_ent *res = malloc(sizeof(bf_ent) * (n + 1));
    int64_t c = 0;
    for (int64_t i = 0; i < s0; i++)
        res[c++] = all[i];
    for (int64_t i = n - w; i < n; i++)
        res[c++] = all[i];
    for (int64_t i = 0; i < k; i++)
        res[c++] = all[s0 + i];
    qsort(res, c, sizeof(bf_ent), bf_cmp);
    for (int64_t i = 0; i < c; i++) {
        idx[i] = res[i].i;
        sc[i] = res[i].s;
    }
    free(res);
    free(all);
    free(qbar);
    return c;
}

static int same_scores(const float *a, const float *b, int64_t n)
{
    for (int64_t i = 0; i < n; i++) {
        if (isnan(a[i]) && isnan(b[i]))
            continue;
        if (memcmp(&a[i], &b[i], 4) != 0 && !(a[i] == 0 && b[i] == 0))
            return 0;
    }
    return 1;
}

/* ties: small integer centroids and queries make many equal scores */
static void gen(tu_rng *r, int m, int b, int D, int G, int64_t n, int ties, float *C, uint8_t *codes,
                float *Q)
{
    int ksub = 1 << b;
    for (int64_t i = 0; i < (int64_t)m * ksub * (D / m); i++)
        C[i] = ties ? (float)((int)tu_rng_below(r, 3) - 1) : tu_rng_normal(r);
    for (int64_t i = 0; i < n * m; i++)
        codes[i] = (uint8_t)tu_rng_below(r, (uint32_t)ksub);
    for (int i = 0; i < G * D; i++)
        Q[i] = ties ? (float)((int)tu_rng_below(r, 3) - 1) : tu_rng_normal(r);
}

static void one_case(tu_rng *r, int64_t n, int m, int b, int D, int G, int64_t k, int64_t sink,
                     int64_t window, kvd_pq_agg agg, int ties, int nan_query)
{
    int ksub = 1 << b;
    float *C = malloc(sizeof(float) * (size_t)m * ksub * (D / m));
    uint8_t *codes = malloc((size_t)(n * m + 1));
    float *Q = malloc(sizeof(float) * G * D);
    gen(r, m, b, D, G, n, ties, C, codes, Q);
    if (nan_query)
        Q[D / 2] = NAN;
    kvd_pq_search_params p = {k, sink, window, agg};
    int64_t cnt = kvd_pq_search_count(n, &p);
    size_t cap = (size_t)cnt + 1;
    uint32_t *bi = malloc(sizeof(uint32_t) * cap), *ri = malloc(sizeof(uint32_t) * cap);
    float *bs = malloc(sizeof(float) * cap), *rs = malloc(sizeof(float) * cap);
    int64_t bn = brute(n, m, b, D, C, codes, G, Q, &p, bi, bs);
    int64_t rn = -1;
    int rc = kvd_pq_search_ref(n, m, b, D, C, codes, G, Q, &p, ri, rs, &rn);
    TU_CHECK(rc == 0 && rn == bn && bn == cnt, "ref n=%lld m=%d b=%d: rc=%d rn=%lld bn=%lld cnt=%lld",
             (long long)n, m, b, rc, (long long)rn, (long long)bn, (long long)cnt);
    if (rn == bn) {
        TU_CHECK(memcmp(ri, bi, sizeof(uint32_t) * bn) == 0 && same_scores(rs, bs, bn),
                 "ref != brute force n=%lld m=%d b=%d G=%d k=%lld s=%lld w=%lld ties=%d",
                 (long long)n, m, b, G, (long long)k, (long long)sink, (long long)window, ties);
    }
    for (int threads = 1; threads <= 3; threads += 2) {
        for (int simd = 0; simd <= 2; simd++) {
            tu_buf oi = tu_buf_new(sizeof(uint32_t) * cap), os = tu_buf_new(sizeof(float) * cap);
            int64_t fn = -1;
            rc = kvd__pq_search_cpu(threads, simd, n, m, b, D, C, codes, G, Q, &p, oi.data,
                                    os.data, &fn);
            TU_CHECK(rc == 0 && fn == bn, "fast count n=%lld m=%d: %lld vs %lld", (long long)n, m,
                     (long long)fn, (long long)bn);
            if (fn == bn)
                TU_CHECK(memcmp(oi.data, bi, sizeof(uint32_t) * bn) == 0 &&
                             same_scores(os.data, bs, bn),
                         "fast != brute n=%lld m=%d b=%d G=%d k=%lld s=%lld w=%lld ties=%d thr=%d "
                         "simd=%d agg=%d",
                         (long long)n, m, b, G, (long long)k, (long long)sink, (long long)window,
                         ties, threads, simd, agg);
            TU_CHECK(tu_guard_ok(&oi) && tu_guard_ok(&os), "guard bytes");
            if (b == 4) { /* the same codes packed: the same result */
                uint8_t *pk = malloc((size_t)kvd_pq_packed4_bytes(n, m) + 1);
                kvd_pq_pack4(n, m, codes, pk);
                memset(oi.data, 0xEE, sizeof(uint32_t) * cap);
                fn = -1;
                rc = kvd__pq_search_packed4_cpu(threads, simd, n, m, D, C, pk, G, Q, &p, oi.data,
                                                os.data, &fn);
                TU_CHECK(rc == 0 && fn == bn && memcmp(oi.data, bi, sizeof(uint32_t) * bn) == 0 &&
                             same_scores(os.data, bs, bn),
                         "packed != brute n=%lld m=%d G=%d k=%lld s=%lld w=%lld ties=%d thr=%d "
                         "simd=%d agg=%d: rc %d, %lld results",
                         (long long)n, m, G, (long long)k, (long long)sink, (long long)window, ties,
                         threads, simd, agg, rc, (long long)fn);
                TU_CHECK(tu_guard_ok(&oi) && tu_guard_ok(&os), "guard bytes (packed)");
                free(pk);
            }
            tu_buf_free(&oi);
            tu_buf_free(&os);
        }
    }
    free(C);
    free(codes);
    free(Q);
    free(bi);
    free(ri);
    free(bs);
    free(rs);
}

static void test_search_shapes(void)
{
    tu_rng r;
    tu_rng_seed(&r, 42);
    const int ms[] = {1, 2, 4, 8, 16, 32};
    const int bs[] = {4, 6, 8};
    const int64_t ns[] = {0, 1, 7, 9, 33, 1001};
    for (size_t mi = 0; mi < sizeof ms / sizeof *ms; mi++)
        for (size_t bi = 0; bi < 3; bi++)
            for (size_t ni = 0; ni < sizeof ns / sizeof *ns; ni++) {
                int64_t n = ns[ni];
                one_case(&r, n, ms[mi], bs[bi], 128, 4, 5, 0, 0, KVD_PQ_AGG_SUM, 0, 0);
                one_case(&r, n, ms[mi], bs[bi], 128, 4, n + 3, 2, 1, KVD_PQ_AGG_SUM, 1, 0);
                one_case(&r, n, ms[mi], bs[bi], 128, 1, 3, 4, 5, KVD_PQ_AGG_SUM, 1, 0);
            }
    /* m not a power of two: generic gathers (12) and scalar scan (3, 6) */
    one_case(&r, 777, 12, 8, 96, 4, 20, 1, 1, KVD_PQ_AGG_SUM, 1, 0);
    one_case(&r, 777, 3, 6, 96, 4, 20, 1, 1, KVD_PQ_AGG_SUM, 0, 0);
    one_case(&r, 777, 6, 4, 96, 2, 20, 0, 0, KVD_PQ_AGG_SUM, 1, 0);
}

static void test_search_large(void)
{
    tu_rng r;
    tu_rng_seed(&r, 7);
    /* long enough for several threads and many buffer cuts; k = 2048 */
    one_case(&r, 50001, 2, 8, 128, 4, 2048, 4, 64, KVD_PQ_AGG_SUM, 0, 0);
    one_case(&r, 50001, 16, 4, 128, 4, 256, 0, 0, KVD_PQ_AGG_SUM, 1, 0);
    one_case(&r, 40000, 8, 8, 128, 4, 2048, 100, 100, KVD_PQ_AGG_SUM, 1, 0);
    one_case(&r, 40000, 4, 6, 128, 4, 1, 0, 0, KVD_PQ_AGG_SUM, 0, 0);
    one_case(&r, 40000, 4, 8, 128, 4, 39999, 0, 0, KVD_PQ_AGG_SUM, 0, 0);
    one_case(&r, 3000, 4, 8, 128, 4, 100, 2, 2, KVD_PQ_AGG_MAX, 1, 0);
    one_case(&r, 35000, 2, 8, 128, 3, 300, 2, 2, KVD_PQ_AGG_MAX, 0, 0);
    /* a NaN in the query: every score NaN, ranked by index */
    one_case(&r, 2000, 4, 8, 128, 4, 50, 1, 1, KVD_PQ_AGG_SUM, 0, 1);
    one_case(&r, 40000, 4, 8, 128, 4, 50, 1, 1, KVD_PQ_AGG_SUM, 0, 1);
    /* quantized-table scan (where the CPU has it) on every m, ties, k = 2048 */
    one_case(&r, 60000, 4, 4, 128, 4, 256, 3, 3, KVD_PQ_AGG_SUM, 1, 0);
    one_case(&r, 70000, 16, 8, 128, 4, 2048, 0, 7, KVD_PQ_AGG_SUM, 0, 0);
    one_case(&r, 70000, 2, 4, 128, 2, 256, 0, 0, KVD_PQ_AGG_SUM, 1, 0);
    one_case(&r, 70000, 8, 6, 128, 4, 1000, 5, 0, KVD_PQ_AGG_SUM, 0, 0);
    /* 4-bit codes looked up in place (where the CPU has VBMI): every m, both
     * k, ragged ends (a step of 64 tokens cut by sink and window) */
    one_case(&r, 70001, 8, 4, 128, 4, 2048, 0, 0, KVD_PQ_AGG_SUM, 0, 0);
    one_case(&r, 90000, 16, 4, 128, 4, 2048, 5, 33, KVD_PQ_AGG_SUM, 0, 0);
    one_case(&r, 65573, 4, 4, 128, 4, 700, 1, 0, KVD_PQ_AGG_SUM, 0, 0);
    one_case(&r, 40000, 2, 4, 128, 1, 2048, 0, 0, KVD_PQ_AGG_SUM, 0, 0);
    one_case(&r, 50000, 8, 4, 128, 4, 256, 2, 2, KVD_PQ_AGG_SUM, 1, 0);
    /* forced ranges covering everything, overlapping each other */
    one_case(&r, 100, 4, 8, 128, 4, 10, 60, 60, KVD_PQ_AGG_SUM, 1, 0);
    one_case(&r, 100, 4, 8, 128, 4, 2048, 200, 0, KVD_PQ_AGG_SUM, 1, 0);
}

/* The packed layout as kvdepot/pq.h writes it down, byte by byte: 33
 * tokens, 3 sub-spaces (one padding sub-space), two blocks. */
static void test_pack_layout(void)
{
    enum { N = 33, M = 3 };
    uint8_t codes[N * M], pk[2 * 64 + 1];
    for (int i = 0; i < N; i++)
        for (int j = 0; j < M; j++)
            codes[i * M + j] = (uint8_t)(((i * 7 + j * 3) & 15) | 0x30); /* stray high bits */
    TU_CHECK(kvd_pq_packed4_bytes(N, M) == 128 && kvd_pq_packed4_bytes(0, M) == 0 &&
                 kvd_pq_packed4_bytes(64, 16) == 512,
             "packed sizes %lld", (long long)kvd_pq_packed4_bytes(N, M));
    memset(pk, 0xAB, sizeof pk);
    kvd_pq_pack4(N, M, codes, pk);
    int bad = 0;
    for (int blk = 0; blk < 2; blk++)
        for (int j = 0; j < 4; j++)
            for (int i = 0; i < 16; i++) {
                int lo_t = 32 * blk + i, hi_t = lo_t + 16, want = 0;
                if (j < M && lo_t < N)
                    want |= codes[lo_t * M + j] & 15;
                if (j < M && hi_t < N)
                    want |= (codes[hi_t * M + j] & 15) << 4;
                bad += pk[blk * 64 + 16 * j + i] != want;
            }
    TU_CHECK(bad == 0 && pk[128] == 0xAB, "packed layout: %d bytes differ, guard %02x", bad,
             pk[128]);
}

/* 2 sub-spaces of 1 dim, 16 centroids c = value of the index: hand-checked. */
static void test_hand(void)
{
    float C[2 * 16];
    for (int j = 0; j < 2; j++)
        for (int c = 0; c < 16; c++)
            C[j * 16 + c] = (float)c * (j == 0 ? 1.0f : -1.0f);
    uint8_t codes[5 * 2] = {3, 1, 0, 0, 5, 2, 3, 0, 15, 15};
    /* q0 = (1, 1), q1 = (1, 0): qbar = (2, 1);
     * scores: t0 = 6-1 = 5, t1 = 0, t2 = 10-2 = 8, t3 = 6, t4 = 30-15 = 15 */
    float Q[4] = {1, 1, 1, 0};
    kvd_pq_search_params p = {2, 1, 0, KVD_PQ_AGG_SUM};
    uint32_t idx[4];
    float sc[4];
    int64_t no = 0;
    int rc = kvd__pq_search_cpu(1, 1, 5, 2, 4, 2, C, codes, 2, Q, &p, idx, sc, &no);
    TU_CHECK(rc == 0 && no == 3, "hand: rc %d n %lld", rc, (long long)no);
    TU_CHECK(idx[0] == 4 && sc[0] == 15.0f && idx[1] == 2 && sc[1] == 8.0f && idx[2] == 0 &&
                 sc[2] == 5.0f,
             "hand: got %u:%g %u:%g %u:%g", idx[0], sc[0], idx[1], sc[1], idx[2], sc[2]);
    /* MAX: per head q0=(1,1): 2,0,3,3,0 ; q1=(1,0): 3,0,5,3,15 -> max 3,0,5,3,15 */
    kvd_pq_search_params pm = {5, 0, 0, KVD_PQ_AGG_MAX};
    uint32_t idx5[5];
    float sc5[5];
    kvd__pq_search_cpu(1, 1, 5, 2, 4, 2, C, codes, 2, Q, &pm, idx5, sc5, &no);
    TU_CHECK(no == 5 && idx5[0] == 4 && idx5[1] == 2 && idx5[2] == 0 && idx5[3] == 3 &&
                 idx5[4] == 1 && sc5[2] == 3.0f && sc5[3] == 3.0f,
             "hand max: %u %u %u %u %u", idx5[0], idx5[1], idx5[2], idx5[3], idx5[4]);
}

static void test_train_encode(void)
{
    tu_rng r;
    tu_rng_seed(&r, 99);
    const int D = 64, m = 4, b = 6, ksub = 1 << b;
    int64_t n = 3000;
    float *keys = malloc(sizeof(float) * n * D);
    tu_kv_opts o = {2, 10.0f, 0.3f, 1};
    tu_gen_kv(&r, keys, n, D, &o);
    float *c_ref = malloc(sizeof(float) * m * ksub * (D / m));
    float *c_fast = malloc(sizeof(float) * m * ksub * (D / m));
    float *c_fast3 = malloc(sizeof(float) * m * ksub * (D / m));
    kvd_kmeans_params km = {0, 10, 1234, 0};
    TU_CHECK(kvd__pq_train_cpu(1, 0, &km, n, m, b, D, keys, c_ref) == 0, "train ref");
    TU_CHECK(kvd__pq_train_cpu(1, 1, &km, n, m, b, D, keys, c_fast) == 0, "train fast");
    TU_CHECK(kvd__pq_train_cpu(3, 1, &km, n, m, b, D, keys, c_fast3) == 0, "train fast 3 thr");
    size_t cb = sizeof(float) * m * ksub * (D / m);
    TU_CHECK(memcmp(c_ref, c_fast, cb) == 0, "train: fast centroids differ from the reference");
    TU_CHECK(memcmp(c_fast, c_fast3, cb) == 0, "train: centroids depend on the thread count");
    uint8_t *e_ref = malloc(n * m), *e_fast = malloc(n * m);
    kvd_pq_encode_ref(n, m, b, D, keys, c_ref, e_ref);
    kvd__pq_encode_cpu(2, 1, n, m, b, D, keys, c_ref, e_fast);
    TU_CHECK(memcmp(e_ref, e_fast, n * m) == 0, "encode fast != ref");
    /* encoding is the argmin: reconstruction error below a random code's */
    double err_enc = 0, err_rand = 0;
    for (int64_t i = 0; i < n; i++)
        for (int j = 0; j < m; j++) {
            int ds = D / m, cr = (int)tu_rng_below(&r, ksub);
            for (int t = 0; t < ds; t++) {
                float x = keys[i * D + j * ds + t];
                float a = c_ref[((size_t)j * ksub + e_ref[i * m + j]) * ds + t];
                float z = c_ref[((size_t)j * ksub + cr) * ds + t];
                err_enc += (x - a) * (x - a);
                err_rand += (x - z) * (x - z);
            }
        }
    TU_CHECK(err_enc < 0.5 * err_rand, "encode error %g vs random %g", err_enc, err_rand);
    free(keys);
    free(c_ref);
    free(c_fast);
    free(c_fast3);
    free(e_ref);
    free(e_fast);
}

static void test_wrappers(void)
{
    tu_rng r;
    tu_rng_seed(&r, 5);
    const int D = 128, m = 8, b = 8, G = 4;
    int64_t n = 5000;
    float *keys = malloc(sizeof(float) * n * D);
    tu_kv_opts o = {4, 20.0f, 0.3f, 1};
    tu_gen_kv(&r, keys, n, D, &o);
    float *q = malloc(sizeof(float) * G * D);
    tu_fill_normal(&r, q, G * D, 1.0f);
    for (int fr = 0; fr <= 1; fr++) {
        kvd_backend *be = tu_cpu_backend(2, fr);
        kvd_error err;
        float *cent = malloc(sizeof(float) * 256 * D);
        int64_t cs[3] = {m, 256, D / m}, ks[2] = {n, D}, qs[2] = {G, D}, cds[2] = {n, m};
        kvd_tensor tc = kvd_tensor_make(KVD_DTYPE_F32, cent, 3, cs);
        kvd_tensor tk = kvd_tensor_make(KVD_DTYPE_F32, keys, 2, ks);
        kvd_tensor tq = kvd_tensor_make(KVD_DTYPE_F32, q, 2, qs);
        kvd_kmeans_params km = {0, 8, 1, 20000};
        int rc = kvd_pq_train(be, &tk, &km, &tc, &err);
        TU_CHECK(rc == 0, "pq_train: %s", err.msg);
        tu_buf codes = tu_buf_new(n * m);
        kvd_tensor tcode = kvd_tensor_make(KVD_DTYPE_U8, codes.data, 2, cds);
        rc = kvd_pq_encode(be, &tk, &tc, &tcode, &err);
        TU_CHECK(rc == 0 && tu_guard_ok(&codes), "pq_encode: %s", err.msg);
        kvd_pq_search_params p = {300, 4, 32, KVD_PQ_AGG_SUM};
        int64_t cnt = kvd_pq_search_count(n, &p), nout = 0;
        TU_CHECK(cnt == 336, "count %lld", (long long)cnt);
        tu_buf bi = tu_buf_new(4 * cnt), bs = tu_buf_new(4 * cnt);
        kvd_tensor ti = kvd_tensor_make(KVD_DTYPE_U32, bi.data, 1, &cnt);
        kvd_tensor ts = kvd_tensor_make(KVD_DTYPE_F32, bs.data, 1, &cnt);
        rc = kvd_pq_search(be, &tc, &tcode, &tq, &p, &ti, &ts, &nout, &err);
        TU_CHECK(rc == 0 && nout == cnt && tu_guard_ok(&bi) && tu_guard_ok(&bs), "search: %s",
                 err.msg);
        uint32_t *ri = malloc(4 * cnt);
        float *rs = malloc(4 * cnt);
        int64_t rn;
        kvd_pq_search_ref(n, m, b, D, cent, codes.data, G, q, &p, ri, rs, &rn);
        TU_CHECK(rn == nout && memcmp(ri, bi.data, 4 * rn) == 0, "wrapper result != ref");
        /* errors */
        int64_t small = cnt - 1;
        kvd_tensor tsmall = kvd_tensor_make(KVD_DTYPE_U32, bi.data, 1, &small);
        TU_CHECK(kvd_pq_search(be, &tc, &tcode, &tq, &p, &tsmall, NULL, &nout, &err) == KVD_EINVAL,
                 "cap too small accepted");
        int64_t bad[3] = {m, 32, D / m};
        kvd_tensor tbad = kvd_tensor_make(KVD_DTYPE_F32, cent, 3, bad);
        TU_CHECK(kvd_pq_search(be, &tbad, &tcode, &tq, &p, &ti, NULL, &nout, &err) == KVD_EINVAL,
                 "b=5 accepted");
        kvd_pq_search_params pn = {-1, 0, 0, KVD_PQ_AGG_SUM};
        TU_CHECK(kvd_pq_search(be, &tc, &tcode, &tq, &pn, &ti, NULL, &nout, &err) == KVD_EINVAL,
                 "k < 0 accepted");
        free(ri);
        free(rs);
        tu_buf_free(&bi);
        tu_buf_free(&bs);
        tu_buf_free(&codes);
        free(cent);
        kvd_backend_free(be);
    }
    free(keys);
    free(q);
}

/* Every score equal: the sampled starting threshold admits nothing and the
 * search must rescan; the result is then the lowest indices. */
static void test_all_equal(void)
{
    const int D = 128, m = 4, b = 8;
    int64_t n = 40000;
    float *C = calloc((size_t)m * 256 * (D / m), sizeof(float));
    uint8_t *codes = calloc((size_t)n * m, 1);
    float Q[2 * 128];
    for (int i = 0; i < 2 * D; i++)
        Q[i] = 1.0f;
    for (int i = 0; i < m * 256 * (D / m); i++)
        C[i] = 0.25f;
    kvd_pq_search_params p = {300, 2, 2, KVD_PQ_AGG_SUM};
    uint32_t idx[304];
    float sc[304];
    int64_t no = 0;
    for (int thr = 1; thr <= 2; thr++) {
        int rc = kvd__pq_search_cpu(thr, 1, n, m, b, D, C, codes, 2, Q, &p, idx, sc, &no);
        int ok = rc == 0 && no == 304;
        for (int64_t i = 0; ok && i < 302; i++)
            ok = idx[i] == (uint32_t)i;
        ok = ok && idx[302] == 39998 && idx[303] == 39999 && sc[0] == 64.0f;
        TU_CHECK(ok, "all-equal scores: rc %d n %lld idx[0..2] %u %u %u", rc, (long long)no,
                 idx[0], idx[1], idx[2]);
    }
    free(C);
    free(codes);
}

/* Scores rising with the position (and runs of ties): every token beats
 * the running threshold, the buffer is cut again and again. */
static void rising(int m, int b)
{
    const int D = 128, dsub = D / m, ksub = 1 << b;
    int64_t n = 50000;
    float *C = malloc(sizeof(float) * m * ksub * dsub);
    uint8_t *codes = malloc((size_t)n * m);
    float Q[128];
    for (int i = 0; i < D; i++)
        Q[i] = 1.0f;
    for (int j = 0; j < m; j++)
        for (int c = 0; c < ksub; c++)
            for (int t = 0; t < dsub; t++)
                C[((size_t)j * ksub + c) * dsub + t] = (float)c / 64.0f;
    for (int64_t i = 0; i < n; i++)
        for (int j = 0; j < m; j++)
            codes[i * m + j] = (uint8_t)(i * ksub / n);
    const int64_t ks[] = {1, 256, 2048};
    for (int ki = 0; ki < 3; ki++) {
        kvd_pq_search_params p = {ks[ki], 2, 0, KVD_PQ_AGG_SUM};
        int64_t cnt = kvd_pq_search_count(n, &p), rn = 0, fn = 0;
        uint32_t *ri = malloc(4 * cnt), *fi = malloc(4 * cnt);
        float *rs = malloc(4 * cnt), *fs = malloc(4 * cnt);
        kvd_pq_search_ref(n, m, b, D, C, codes, 1, Q, &p, ri, rs, &rn);
        for (int thr = 1; thr <= 4; thr++) {
            kvd__pq_search_cpu((thr + 1) / 2, 1 + (thr & 1), n, m, b, D, C, codes, 1, Q, &p, fi,
                               fs, &fn);
            TU_CHECK(rn == fn && !memcmp(ri, fi, 4 * rn) && !memcmp(rs, fs, 4 * rn),
                     "rising scores m=%d b=%d k=%lld threads=%d", m, b, (long long)ks[ki], thr);
        }
        free(ri);
        free(fi);
        free(rs);
        free(fs);
    }
    free(C);
    free(codes);
}

static void test_rising(void)
{
    rising(2, 8);
    rising(16, 4);
    rising(4, 4);
}

/*
 * Codes of 2^b or more are not checked per search: they read an entry of
 * -inf and rank last, on every path. 4- and 6-bit codes with stray high bits
 * (the quantized lookups read their low bits, or 0 with bit 7, for their
 * bound) against the reference, each m the fast scans take.
 */
static void test_stray_codes(void)
{
    tu_rng r;
    tu_rng_seed(&r, 11);
    const int D = 128, G = 4;
    const int64_t n = 40000;
    const int ms[] = {2, 4, 8, 16};
    for (int b = 4; b <= 6; b += 2)
        for (int mi = 0; mi < 4; mi++) {
            int m = ms[mi];
            float *C = malloc(sizeof(float) * m * (1 << b) * (D / m));
            uint8_t *codes = malloc((size_t)n * m);
            float Q[4 * 128];
            gen(&r, m, b, D, G, n, 0, C, codes, Q);
            /* one row in 8 has a stray code; rows 100..163 (one step) all do */
            for (int64_t i = 0; i < n; i++)
                if (i % 8 == 3 || (i >= 100 && i < 164))
                    codes[i * m + tu_rng_below(&r, (uint32_t)m)] |=
                        (uint8_t)((1 << b) << tu_rng_below(&r, 8 - b));
            const int64_t ks[] = {256, 2048};
            for (int ki = 0; ki < 2; ki++) {
                kvd_pq_search_params p = {ks[ki], 0, 0, KVD_PQ_AGG_SUM};
                int64_t rn = 0, fn = 0;
                uint32_t *ri = malloc(4 * ks[ki]), *fi = malloc(4 * ks[ki]);
                float *rs = malloc(4 * ks[ki]), *fs = malloc(4 * ks[ki]);
                kvd_pq_search_ref(n, m, b, D, C, codes, G, Q, &p, ri, rs, &rn);
                int stray = 0;
                for (int64_t i = 0; i < rn; i++)
                    stray += ri[i] % 8 == 3 || (ri[i] >= 100 && ri[i] < 164);
                TU_CHECK(rn == ks[ki] && stray == 0, "stray codes m=%d b=%d: ref kept %d of them",
                         m, b, stray);
                for (int simd = 1; simd <= 2; simd++) {
                    kvd__pq_search_cpu(1, simd, n, m, b, D, C, codes, G, Q, &p, fi, fs, &fn);
                    TU_CHECK(rn == fn && !memcmp(ri, fi, 4 * rn) && !memcmp(rs, fs, 4 * rn),
                             "stray codes m=%d b=%d k=%lld simd=%d: fast != reference", m, b,
                             (long long)ks[ki], simd);
                }
                free(ri);
                free(fi);
                free(rs);
                free(fs);
            }
            free(C);
            free(codes);
        }
}

/*
 * The quantized-table scans (AVX-512 VBMI or AVX2 only, every b; the exact
 * table of m = 2, b = 4) must filter well, which exact results alone do not
 * show: a bound that reads the wrong table entry mostly makes a start that
 * admits too few tokens, which is caught and scanned again without the
 * filter. On every m and b
 * they take, one search scans every full step (64 tokens with VBMI, 32
 * groups of 16 bytes with AVX2) once, never again, and re-scores exactly no
 * more than a few times the tokens above the starting threshold.
 */
static void test_filter_tight(void)
{
    __builtin_cpu_init();
    const int vbmi = __builtin_cpu_supports("avx512vbmi") && __builtin_cpu_supports("avx512bw");
    const int avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    if (!vbmi)
        printf("kernels_pq: no AVX-512 VBMI here, its quantized scans not checked\n");
    tu_rng r;
    tu_rng_seed(&r, 12);
    const int D = 128, G = 4;
    const int64_t k = 256;
    const int ms[] = {2, 4, 8, 16}, bs[] = {4, 6, 8};
    /* a long range (the start from 1024 sampled tokens) and a short one
     * (from one token in 16) */
    for (int ni = 0; ni < 2; ni++)
        for (int bi = 0; bi < 3; bi++)
            for (int mi = 0; mi < 4; mi++) {
                const int64_t n = ni == 0 ? 40000 : 4000;
                int m = ms[mi], b = bs[bi], ksub = 1 << b;
                float *C = malloc(sizeof(float) * m * ksub * (D / m));
                uint8_t *codes = malloc((size_t)n * m);
                float Q[4 * 128];
                gen(&r, m, b, D, G, n, 0, C, codes, Q);
                kvd_pq_search_params p = {k, 0, 0, KVD_PQ_AGG_SUM};
                uint32_t ri[256], fi[256];
                float rs[256], fs[256];
                int64_t rn = 0, fn = 0;
                kvd_pq_search_ref(n, m, b, D, C, codes, G, Q, &p, ri, rs, &rn);
                for (int simd = 1; simd <= 2; simd++) {
                    if (simd == 1 ? !vbmi : !avx2)
                        continue;
                    const int64_t step = simd == 1 ? 64 : 32 * 16 / m;
                    kvd__pq_counters c0, c1;
                    kvd__pq_counters_get(&c0);
                    kvd__pq_search_cpu(1, simd, n, m, b, D, C, codes, G, Q, &p, fi, fs, &fn);
                    kvd__pq_counters_get(&c1);
                    uint64_t steps = c1.steps - c0.steps, rescored = c1.rescored - c0.rescored;
                    TU_CHECK(rn == fn && !memcmp(ri, fi, 4 * rn) && !memcmp(rs, fs, 4 * rn),
                             "filter n=%lld m=%d b=%d simd=%d: fast != reference", (long long)n, m,
                             b, simd);
                    /* m = 2, b = 4: the exact table (scan_rows_m2) takes every token */
                    const int64_t want = m == 2 && b == 4 ? (n + 63) / 64 : n / step * step / 64;
                    TU_CHECK(
                        steps == (uint64_t)want && c1.rescans == c0.rescans,
                        "filter n=%lld m=%d b=%d simd=%d: %llu blocks of 64 tokens (want %lld), "
                        "%llu rescans",
                        (long long)n, m, b, simd, (unsigned long long)steps, (long long)want,
                        (unsigned long long)(c1.rescans - c0.rescans));
                    /* about k + 3.5 sqrt(k n / S) tokens beat the start: 602 of
                     * 40000 (S = 1024), 481 of 4000 (S = 248); 500-900 and
                     * 380-660 are re-scored here. A short range without a start
                     * would take no quantized step at all. */
                    TU_CHECK(rescored <= (ni == 0 ? 1800 : 1200),
                             "filter n=%lld m=%d b=%d simd=%d: %llu tokens re-scored", (long long)n,
                             m, b, simd, (unsigned long long)rescored);
                }
                if (b == 4 && avx2) { /* the packed scan: every block once, as tight */
                    uint8_t *pk = malloc((size_t)kvd_pq_packed4_bytes(n, m));
                    kvd_pq_pack4(n, m, codes, pk);
                    kvd__pq_counters c0, c1;
                    kvd__pq_counters_get(&c0);
                    kvd__pq_search_packed4_cpu(1, 1, n, m, D, C, pk, G, Q, &p, fi, fs, &fn);
                    kvd__pq_counters_get(&c1);
                    uint64_t steps = c1.steps - c0.steps, rescored = c1.rescored - c0.rescored;
                    TU_CHECK(rn == fn && !memcmp(ri, fi, 4 * rn) && !memcmp(rs, fs, 4 * rn),
                             "filter m=%d packed: fast != reference", m);
                    TU_CHECK(
                        steps == (uint64_t)((n + 63) / 64) && c1.rescans == c0.rescans &&
                            rescored <= (ni == 0 ? 1800 : 1200),
                        "filter n=%lld m=%d packed: %llu blocks of 64 tokens, %llu rescans, %llu "
                        "tokens re-scored",
                        (long long)n, m, (unsigned long long)steps,
                        (unsigned long long)(c1.rescans - c0.rescans),
                        (unsigned long long)rescored);
                    free(pk);
                }
                free(C);
                free(codes);
            }
    /* the exact tables of m <= 2 (packed; rows at m = 2), on a range too
     * short for a starting threshold (fewer than 16 x 128 tokens): every
     * token passes until the first cut, then only those above the rising
     * threshold */
    for (int m = 1; m <= 2; m++) {
        const int64_t ns = 2000;
        float *C = malloc(sizeof(float) * m * 16 * (D / m));
        uint8_t *codes = malloc((size_t)ns * m), *pk = malloc((size_t)kvd_pq_packed4_bytes(ns, m));
        float Q[4 * 128];
        gen(&r, m, 4, D, G, ns, 0, C, codes, Q);
        kvd_pq_pack4(ns, m, codes, pk);
        kvd_pq_search_params p = {16, 0, 0, KVD_PQ_AGG_SUM};
        uint32_t ri[16], fi[16];
        float rs[16], fs[16];
        int64_t rn = 0, fn = 0;
        kvd_pq_search_ref(ns, m, 4, D, C, codes, G, Q, &p, ri, rs, &rn);
        kvd__pq_counters c0, c1;
        kvd__pq_counters_get(&c0);
        kvd__pq_search_packed4_cpu(1, 1, ns, m, D, C, pk, G, Q, &p, fi, fs, &fn);
        kvd__pq_counters_get(&c1);
        uint64_t rescored = c1.rescored - c0.rescored;
        TU_CHECK(rn == fn && !memcmp(ri, fi, 4 * rn) && !memcmp(rs, fs, 4 * rn),
                 "filter m=%d packed, no start: fast != reference", m);
        if (avx2) /* 520-560 here */
            TU_CHECK(rescored < 1000, "filter m=%d packed, no start: %llu of %lld tokens scored", m,
                     (unsigned long long)rescored, (long long)ns);
        if (m == 2 && avx2) {
            kvd__pq_counters_get(&c0);
            kvd__pq_search_cpu(1, 2, ns, m, 4, D, C, codes, G, Q, &p, fi, fs, &fn);
            kvd__pq_counters_get(&c1);
            rescored = c1.rescored - c0.rescored;
            TU_CHECK(rn == fn && !memcmp(ri, fi, 4 * rn) && !memcmp(rs, fs, 4 * rn) &&
                         rescored < 1000,
                     "filter m=2 rows, no start: %llu of %lld tokens scored",
                     (unsigned long long)rescored, (long long)ns);
        }
        free(C);
        free(codes);
        free(pk);
    }
}

/*
 * A batch on the CPU backend (one thread per job when there are as many jobs
 * as threads, else one job after another): every job's result equal to its
 * own kvd_pq_search, with 1, 3 and 4 threads, fast and reference backends,
 * jobs of different lengths, a job without scores; a job that fails its
 * checks fails the batch with every nout 0.
 */
/* A batch job's fill: its codes copied in before its search reads them
 * (the caller of a batch gathering codes from pages). */
typedef struct fill_arg {
    uint8_t *dst;
    const uint8_t *src;
    size_t len;
    int rc; /* returned instead, when not 0 */
    int calls;
} fill_arg;

static int fill_codes(void *arg)
{
    fill_arg *f = arg;
    __atomic_fetch_add(&f->calls, 1, __ATOMIC_RELAXED);
    if (f->rc)
        return f->rc;
    memcpy(f->dst, f->src, f->len);
    return 0;
}

static void test_batch(void)
{
    tu_rng r;
    tu_rng_seed(&r, 13);
    enum { J = 5 };
    const int D = 128, m = 16, b = 6, G = 4;
    const int64_t ns[J] = {40000, 3000, 20011, 64, 33000};
    float *C = malloc(sizeof(float) * J * m * 64 * (D / m));
    float *Q = malloc(sizeof(float) * J * G * D);
    uint8_t *codes[J];
    for (int j = 0; j < J; j++) {
        codes[j] = malloc((size_t)ns[j] * m);
        gen(&r, m, b, D, G, ns[j], j == 1, C + (size_t)j * m * 64 * (D / m), codes[j],
            Q + (size_t)j * G * D);
    }
    kvd_pq_search_params p = {300, 2, 5, KVD_PQ_AGG_SUM};
    const int threads[] = {1, 3, 4};
    for (int ti = 0; ti < 3; ti++)
        for (int fr = 0; fr <= 1; fr++) {
            kvd_backend *be = tu_cpu_backend(threads[ti], fr);
            kvd_tensor t[J][5];
            kvd_pq_search_job jobs[J];
            uint32_t *idx[J], *want_i[J];
            float *sc[J], *want_s[J];
            for (int j = 0; j < J; j++) {
                int64_t cnt = kvd_pq_search_count(ns[j], &p), nout = -1;
                int64_t cs[3] = {m, 64, D / m}, ds[2] = {ns[j], m}, qs[2] = {G, D}, os[1] = {cnt};
                idx[j] = malloc(4 * cnt);
                sc[j] = malloc(4 * cnt);
                want_i[j] = malloc(4 * cnt);
                want_s[j] = malloc(4 * cnt);
                t[j][0] = kvd_tensor_make(KVD_DTYPE_F32, C + (size_t)j * m * 64 * (D / m), 3, cs);
                t[j][1] = kvd_tensor_make(KVD_DTYPE_U8, codes[j], 2, ds);
                t[j][2] = kvd_tensor_make(KVD_DTYPE_F32, Q + (size_t)j * G * D, 2, qs);
                t[j][3] = kvd_tensor_make(KVD_DTYPE_U32, idx[j], 1, os);
                t[j][4] = kvd_tensor_make(KVD_DTYPE_F32, sc[j], 1, os);
                kvd_tensor wi = kvd_tensor_make(KVD_DTYPE_U32, want_i[j], 1, os);
                kvd_tensor ws = kvd_tensor_make(KVD_DTYPE_F32, want_s[j], 1, os);
                int rc = kvd_pq_search(be, &t[j][0], &t[j][1], &t[j][2], &p, &wi, &ws, &nout, NULL);
                TU_CHECK(rc == 0 && nout == cnt, "batch: single search %d: rc %d", j, rc);
                jobs[j] = (kvd_pq_search_job){
                    &t[j][0], &t[j][1], &t[j][2], &t[j][3], j == 2 ? NULL : &t[j][4],
                    -1,       NULL,     NULL};
            }
            kvd_error err;
            int rc = kvd_pq_search_batch(be, jobs, J, &p, &err);
            TU_CHECK(rc == 0, "batch threads=%d ref=%d: %s", threads[ti], fr, err.msg);
            for (int j = 0; j < J && rc == 0; j++) {
                int64_t cnt = kvd_pq_search_count(ns[j], &p);
                TU_CHECK(jobs[j].nout == cnt && !memcmp(idx[j], want_i[j], 4 * cnt) &&
                             (j == 2 || !memcmp(sc[j], want_s[j], 4 * cnt)),
                         "batch threads=%d ref=%d: job %d differs from its own search", threads[ti],
                         fr, j);
            }
            /* job 3's indices too short: the whole batch fails, nothing out */
            /* the codes filled by each job's fill, on the thread that
             * searches it: the same results; a failing fill fails the batch */
            uint8_t *blank[J];
            fill_arg fa[J];
            kvd_tensor tb[J];
            for (int j = 0; j < J; j++) {
                int64_t ds[2] = {ns[j], m};
                blank[j] = calloc((size_t)ns[j], m);
                fa[j] = (fill_arg){blank[j], codes[j], (size_t)ns[j] * m, 0, 0};
                tb[j] = kvd_tensor_make(KVD_DTYPE_U8, blank[j], 2, ds);
                jobs[j].codes = &tb[j];
                jobs[j].fill = fill_codes;
                jobs[j].fill_arg = &fa[j];
                memset(idx[j], 0, 4 * (size_t)kvd_pq_search_count(ns[j], &p));
            }
            rc = kvd_pq_search_batch(be, jobs, J, &p, &err);
            TU_CHECK(rc == 0, "batch with fills, threads=%d ref=%d: %s", threads[ti], fr, err.msg);
            for (int j = 0; j < J && rc == 0; j++) {
                int64_t cnt = kvd_pq_search_count(ns[j], &p);
                TU_CHECK(fa[j].calls == 1 && jobs[j].nout == cnt &&
                             !memcmp(idx[j], want_i[j], 4 * cnt),
                         "batch with fills, threads=%d ref=%d: job %d (%d calls)", threads[ti], fr,
                         j, fa[j].calls);
            }
            fa[2].rc = KVD_ECORRUPT;
            rc = kvd_pq_search_batch(be, jobs, J, &p, &err);
            TU_CHECK(rc == KVD_ECORRUPT && strstr(err.msg, "fill") && strstr(err.msg, "2"),
                     "batch with a failing fill: rc %d, %s", rc, err.msg);
            for (int j = 0; j < J; j++) {
                jobs[j].codes = &t[j][1];
                jobs[j].fill = NULL;
                free(blank[j]);
            }
            int64_t one[1] = {1};
            t[3][3] = kvd_tensor_make(KVD_DTYPE_U32, idx[3], 1, one);
            rc = kvd_pq_search_batch(be, jobs, J, &p, &err);
            int zero = 1;
            for (int j = 0; j < J; j++)
                zero = zero && jobs[j].nout == 0;
            TU_CHECK(rc == KVD_EINVAL && zero && strstr(err.msg, "3"),
                     "batch with a bad job: rc %d, %s", rc, err.msg);
            for (int j = 0; j < J; j++) {
                free(idx[j]);
                free(sc[j]);
                free(want_i[j]);
                free(want_s[j]);
            }
            kvd_backend_free(be);
        }
    for (int j = 0; j < J; j++)
        free(codes[j]);
    free(C);
    free(Q);
}

int main(void)
{
    /* threads however short the range, as before the 4 MiB minimum: the
     * threaded scans and their merge are what the cases below check */
    kvd__pq_thread_bytes = 0;
    test_rising();
    test_all_equal();
    test_hand();
    test_pack_layout();
    test_search_shapes();
    test_search_large();
    test_stray_codes();
    test_filter_tight();
    test_batch();
    test_train_encode();
    test_wrappers();
    return tu_report("kernels_pq");
}
